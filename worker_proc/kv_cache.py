"""KV tensors and the req_to_token mirror. The scheduler hands out slot indices; this holds
what they index. Slot 0 is scratch (padding reads land there)."""

from __future__ import annotations

import numpy as np
import torch

from worker_proc.huge_pages import zeros_tensor_on_huge_pages


KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}
# (compute dtype, pool dtype) pairs the attention backends read: the compute dtype itself, or a
# narrower pool (K and V are computed in the compute dtype: a wider pool would hold the same values)
_POOL_PAIRS = {(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float16),
               (torch.float32, torch.int8), (torch.bfloat16, torch.int8)}
# int8 pools: each head row is head_dim codes (value = code * scale, codes in [-127, 127]) and then
# its float32 scale (largest magnitude / 127) in 4 bytes (cpu_kernels/kv_int8.h)
INT8_SCALE_BYTES = 4


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] values -> int8 [..., D + 4]: each row's codes, then its scale's bytes."""
    amax = x.float().abs().amax(-1, keepdim=True)
    scale = amax / 127
    codes = torch.where(amax > 0, x.float() * (127 / amax.clamp_min(1e-30)), 0.0).round().clamp(-127, 127)
    return torch.cat((codes.to(torch.int8), scale.view(torch.int8)), dim=-1)


def dequantize_kv_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., D + 4] -> [..., D] of dtype."""
    scale = rows[..., -INT8_SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-INT8_SCALE_BYTES].float() * scale).to(dtype)


def resolve_kv_dtype(name: str, compute_dtype: torch.dtype, quantization: str = "none") -> torch.dtype:
    """`--kv-cache-dtype`: auto stores K and V in the compute dtype, or in float16 (half the bytes a
    decode step reads per cached token) with `--quantization fp16`, and with int8 / int4 under
    float32 compute, as llama.cpp keeps its cache for such weights (measured: the Zen 3 section of
    docs/performance-notes.md)."""
    if name == "auto":
        narrower = (quantization == "fp16" and compute_dtype in (torch.float32, torch.bfloat16)) or \
            (quantization in ("int8", "int4") and compute_dtype == torch.float32)
        return torch.float16 if narrower else compute_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r}: choose auto, {', '.join(KV_CACHE_DTYPES)}")
    chosen = KV_CACHE_DTYPES[name]
    if chosen != compute_dtype and (compute_dtype, chosen) not in _POOL_PAIRS:
        compute = str(compute_dtype).removeprefix("torch.")
        raise ValueError(f"--kv-cache-dtype {name} with compute dtype {compute}: the KV cache takes the compute "
                         f"dtype or a narrower one (float32 compute: bfloat16, float16 or int8; bfloat16: float16 or int8)")
    return chosen


class KVPool:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, max_reqs: int, max_context_len: int, device: str = "cpu"):
        # One tensor per layer with K and V side by side, so a gather of a slot fetches both.
        shape = (num_slots + 1, 2, num_kv_heads, head_dim + (INT8_SCALE_BYTES if dtype == torch.int8 else 0))
        if device == "cpu":
            # huge pages: attention reads slots in scattered order, each a TLB miss with 4 KiB pages;
            # mapped at start, as the pool is used slot by slot (page faults in a step's KV writes
            # cost ~1 ms a 2 MiB page in a VM, several per step while a load ramps up)
            whole = zeros_tensor_on_huge_pages((num_layers, *shape), dtype, prefault_now=True)
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
        if dtype == torch.int8:
            return num_layers * 2 * num_kv_heads * (head_dim + INT8_SCALE_BYTES)
        return num_layers * 2 * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

