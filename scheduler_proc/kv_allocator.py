"""Free lists for KV token slots and request slots. The scheduler owns indices only; the
worker owns the tensors they index."""

from __future__ import annotations

import numpy as np


class TokenSlotAllocator:
    """Slots 1..capacity of the worker's KV pool. Slot 0 is a scratch slot the worker may use for
    padding, so it is never handed out."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free = np.arange(capacity, 0, -1, dtype=np.int32)  # stack: top is slot 1
        self._num_free = capacity

    @property
    def num_free(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> np.ndarray | None:
        if n > self._num_free:
            return None
        self._num_free -= n
        return self._free[self._num_free : self._num_free + n][::-1].copy()

    def free(self, slots: np.ndarray) -> None:
        n = len(slots)
        if n == 0:
            return
        if self._num_free + n > self.capacity:
            raise RuntimeError("double free of KV slots")
        self._free[self._num_free : self._num_free + n] = slots[::-1]
        self._num_free += n


class ReqSlotAllocator:
    """Rows of the worker's req_to_token table."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, idx: int) -> None:
        if len(self._free) >= self.capacity:
            raise RuntimeError("double free of a request slot")
        self._free.append(idx)
