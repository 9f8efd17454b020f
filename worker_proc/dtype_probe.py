"""Choosing the compute dtype: `auto` times a model-shaped GEMM in float32 and bfloat16 on this
CPU and keeps the faster (bfloat16 wins where the CPU has AVX512-BF16/AMX, loses elsewhere)."""

from __future__ import annotations

import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def best_seconds(fn, reps: int = 8) -> float:
    """The fastest of `reps` calls of fn after one warm-up call (kernel selection, packing)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _gemm_seconds(dtype: torch.dtype, m: int = 256, k: int = 576, n: int = 1536) -> float:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    return best_seconds(lambda: torch.nn.functional.linear(a, b))


def resolve_dtype(name: str, device: str = "cpu") -> tuple[torch.dtype, str]:
    """Returns the dtype and a sentence on why it was chosen."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"--dtype {name!r}: choose auto, {', '.join(DTYPES)}")
        return DTYPES[name], f"dtype {name} (asked for)"
    if device != "cpu":
        return torch.bfloat16, "dtype bfloat16 (auto: accelerator)"
    fp32, bf16 = _gemm_seconds(torch.float32), _gemm_seconds(torch.bfloat16)
    # bfloat16 halves weight traffic; take it only where its GEMMs are not slower.
    chosen = "bfloat16" if bf16 < fp32 * 0.9 else "float32"
    return DTYPES[chosen], f"dtype {chosen} (auto: GEMM float32 {fp32*1e3:.2f} ms, bfloat16 {bf16*1e3:.2f} ms)"
