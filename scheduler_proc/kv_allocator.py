"""Free lists for KV token slots and request slots. The scheduler owns indices only; the
worker owns the tensors they index."""

from __future__ import annotations

import numpy as np


class TokenSlotAllocator:
    """Slots 1..capacity of the worker's KV pool. Slot 0 is a scratch slot the worker may use for
    padding, so it is never handed out.

    Slots are reference counted: requests that share a prefill hold the same slots, and a slot
    returns to the free list only when its last holder frees it."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free = np.arange(capacity, 0, -1, dtype=np.int32)  # stack: top is slot 1
        self._num_free = capacity
        self._refs = np.zeros(capacity + 1, dtype=np.int32)  # holders per slot (index 0 unused)
        self.allocated_total = 0  # slots handed out since start (for checks of allocation churn)
        self.freed_total = 0  # slots returned to the free list since start

    @property
    def num_free(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> np.ndarray | None:
        if n > self._num_free:
            return None
        self._num_free -= n
        slots = self._free[self._num_free : self._num_free + n][::-1].copy()
        self._refs[slots] = 1
        self.allocated_total += n
        return slots

    def share(self, slots: np.ndarray) -> None:
        """One more holder for each of `slots` (distinct, all in use)."""
        if len(slots) and (self._refs[slots] <= 0).any():
            raise RuntimeError("sharing KV slots that are not in use")
        self._refs[slots] += 1

    def free(self, slots: np.ndarray) -> None:
        """One holder fewer for each of `slots` (distinct); slots nobody holds become free."""
        if len(slots) == 0:
            return
        if (self._refs[slots] <= 0).any():
            raise RuntimeError("double free of KV slots")
        self._refs[slots] -= 1
        released = slots[self._refs[slots] == 0]
        n = len(released)
        self.freed_total += n
        self._free[self._num_free : self._num_free + n] = released[::-1]
        self._num_free += n

    def refcounts(self, slots: np.ndarray) -> np.ndarray:
        """Holders of each of `slots` (for checks)."""
        return self._refs[slots].copy()


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
