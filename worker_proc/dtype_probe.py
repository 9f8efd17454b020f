"""Choosing the compute dtype: `auto` times a model-shaped linear in float32 and bfloat16 on this
CPU, as the model will run it (loom's kernels where they are loaded, else torch's GEMM), and keeps
the faster. bfloat16 wins where the CPU has AMX or AVX512-BF16 products (loom packs bf16 weights
for them), loses where it has neither."""

from __future__ import annotations

import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def best_seconds(fn, reps: int = 8, give_up_above: float = float("inf")) -> float:
    """The fastest of `reps` calls of fn after one warm-up call (kernel selection, packing); after
    two calls that all took longer than `give_up_above`, the fastest of those."""
    fn()
    best = float("inf")
    for rep in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        if rep >= 1 and best > give_up_above:
            break
    return best


def _linear_call(dtype: torch.dtype, kernels, m: int = 256, k: int = 576, n: int = 1536):
    """One prompt-sized linear, ready to call: through loom's Linear (its weight packed as at load)
    when the kernels are loaded, else torch's GEMM."""
    x = torch.randn(m, k, dtype=dtype)
    if kernels is None:
        w = torch.randn(n, k, dtype=dtype)
        return lambda: torch.nn.functional.linear(x, w)
    from worker_proc.linear import Linear
    from worker_proc.model_runner import cpu_ops

    layer = Linear(k, n, bias=False, ops=cpu_ops(kernels)).to(dtype)
    with torch.no_grad():
        layer.weight.normal_()
    layer.pack_weight()
    return lambda: layer(x)


# The probe runs while the server's other processes start: a call whose second thread lost its core
# to one of them waits out a scheduler quantum (a 0.2 ms bfloat16 linear read 8 ms on a 2-core AMX
# Xeon, and auto chose float32), so both dtypes are timed in turns and each keeps its best.
PROBE_ROUNDS = 3
# Where the kernels have bfloat16 products (AMX, AVX512-BF16) and bfloat16 still lost, the probe
# goes on after a pause, this many times: every call of the first rounds can fall in a busy stretch
# of the host (a 2-core AMX Xeon, the server started right after another engine's processes were
# killed: bfloat16 4.00 ms against its usual 0.17-0.21, float32 1.58; it served in float32 at a
# third of its speed).
RETRIES = 3
RETRY_PAUSE_S = 0.25


def resolve_dtype(name: str, device: str = "cpu", kernels=None) -> tuple[torch.dtype, str]:
    """Returns the dtype and a sentence on why it was chosen. `kernels`: loom's CPU kernels as the
    model will use them (None: plain torch ops)."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"--dtype {name!r}: choose auto, {', '.join(DTYPES)}")
        return DTYPES[name], f"dtype {name} (asked for)"
    if device != "cpu":
        return torch.bfloat16, "dtype bfloat16 (auto: accelerator)"
    fp32_call, bf16_call = _linear_call(torch.float32, kernels), _linear_call(torch.bfloat16, kernels)
    fp32 = bf16 = float("inf")
    has_bf16_products = kernels is not None and bool(kernels.packed_bf16_rows())
    with torch.inference_mode():
        for attempt in range(1 + (RETRIES if has_bf16_products else 0)):
            if attempt:
                time.sleep(RETRY_PAUSE_S)
            for _ in range(PROBE_ROUNDS):
                fp32 = min(fp32, best_seconds(fp32_call))
                # (where bf16 products are widened, as on AVX2 CPUs, it runs several times slower: two calls tell)
                bf16 = min(bf16, best_seconds(bf16_call, give_up_above=2 * fp32))
            # bfloat16 halves weight traffic; take it only where its products are not slower.
            if bf16 < fp32 * 0.9:
                break
    chosen = "bfloat16" if bf16 < fp32 * 0.9 else "float32"
    on = "loom's kernels" if kernels is not None else "torch's GEMM"
    return DTYPES[chosen], (f"dtype {chosen} (auto: a 256-row linear on {on}: float32 {fp32*1e3:.2f} ms, "
                            f"bfloat16 {bf16*1e3:.2f} ms)")
