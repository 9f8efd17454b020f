"""KV tensors and the req_to_token mirror. The scheduler hands out slot indices; this holds
what they index. Slot 0 is scratch (padding reads land there)."""

from __future__ import annotations

import numpy as np
import torch

from worker_proc.huge_pages import zeros_tensor_on_huge_pages


class KVPool:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, max_reqs: int, max_context_len: int, device: str = "cpu"):
        # One tensor per layer with K and V side by side, so a gather of a slot fetches both.
        shape = (num_slots + 1, 2, num_kv_heads, head_dim)
        if device == "cpu":
            # huge pages: attention reads slots in scattered order, each a TLB miss with 4 KiB pages
            whole = zeros_tensor_on_huge_pages((num_layers, *shape), dtype)
            self.kv = list(whole.unbind(0))
        else:
            self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.req_to_token = torch.zeros(max_reqs, max_context_len, dtype=torch.int32, device=device)
        # On the host, the mirror is written through a numpy view: its indexing of a few rows
        # costs a tenth of torch's. (On a GPU the model runner writes it with write_rows.)
        self._host_rows = self.req_to_token.numpy() if device == "cpu" else None
        self.num_slots = num_slots

    def record(self, req_pool_indices: np.ndarray, prefix_lens: np.ndarray, extend_lens: np.ndarray,
               token_starts: np.ndarray, slots: np.ndarray) -> None:
        """Write this step's new slots (int32, packed by row) into the host mirror: row r gets
        slots for positions [prefix, prefix + extend)."""
        target = self._host_rows
        single = extend_lens == 1
        target[req_pool_indices[single], prefix_lens[single]] = slots[token_starts[single]]
        for i in np.flatnonzero(~single):
            p, e, s = int(prefix_lens[i]), int(extend_lens[i]), int(token_starts[i])
            target[int(req_pool_indices[i]), p : p + e] = slots[s : s + e]

    def write_rows(self, req_of_token: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """The same on the device, from tensors there: one scatter for the whole step."""
        self.req_to_token[req_of_token, positions] = slots.to(torch.int32)

    def set_prefix(self, req_pool_idx: int, slots: np.ndarray) -> None:
        """Row req_pool_idx's first len(slots) positions: a request starting on a cached prefix."""
        self.req_to_token[req_pool_idx, : len(slots)] = torch.from_numpy(np.array(slots, dtype=np.int32))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

