"""torch's oneDNN linear on weights reordered once at load.

`F.linear` hands oneDNN the [N, K] weight as it lies, and oneDNN reorders it into its blocked
layout (bfloat16: pairs of K interleaved for dot products) on every call: at a few dozen rows that
reorder costs as much as the product itself. Reordering once at load and calling the primitive on
the reordered weight removes it (measured on an AMD EPYC Zen 4, bfloat16 at 64 rows: 300-360 ->
355-400 GFLOP/s; float32 165 -> 205). Whether it pays is timed per dtype at start-up, so a CPU
where it does not keeps `F.linear`."""

from __future__ import annotations

import functools

import torch

from worker_proc.dtype_probe import best_seconds

# The row count oneDNN picks the weight layout for; the layout serves any count (decode batches of
# a few dozen rows and prompt chunks of a thousand ran within noise of a layout picked for each).
LAYOUT_ROWS = 128
DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def supports(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN reorders weights of `dtype` and multiplies by them (bfloat16
    needs AVX512-BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only CPU has neither)."""
    if dtype not in DTYPES or not available():
        return False
    try:
        linear(torch.zeros(1, 32, dtype=dtype), pack(torch.zeros(32, 32, dtype=dtype)), None)
    except RuntimeError:
        return False
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] reordered into oneDNN's layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), LAYOUT_ROWS)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.cache
def pays(dtype: torch.dtype, m: int = LAYOUT_ROWS, k: int = 576, n: int = 1536) -> bool:
    """Whether a model-shaped product on a reordered weight beats `F.linear` on this CPU."""
    if not supports(dtype):
        return False
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    packed = pack(w)
    reordered = best_seconds(lambda: linear(x, packed, None))
    return reordered < best_seconds(lambda: torch.nn.functional.linear(x, w))
