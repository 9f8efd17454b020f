"""CPU limit probes that head every benchmark report: what this machine can do at best, measured in
the same run as the figures they put in perspective.

- GEMM GFLOP/s per dtype at a model-shaped size (a batch of 1024 tokens through a 576 -> 1536
  projection of the embedded model): the compute roof of prefill and of large decode batches.
  torch's GEMM and, where it compiles and packs the dtype, loom's kernel on the packed weight;
  the better of the two.
- GEMV GB/s per dtype: one token against a weight the size of the model's LM head, cycling over
  several such weights (>= 256 MB in all, well past any L3) so each call streams from DRAM: the
  bandwidth roof of small-batch decode. Measured with torch's F.linear and, where it compiles,
  loom's own small-M kernel (worker_proc.cpu_kernels.linear_dense, on the [N, K] weight and, where
  the build packs the dtype's weights at load, on the packed copy the model streams); the best of
  these is the "GEMV rate".

    python benchmarks/probes.py                 # print the header and probes for this machine
    python benchmarks/probes.py --no-kernel     # skip loom's kernel (no compile)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

if __package__ in (None, ""):  # run as a script: make the repo root and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import add_repo_to_path, cpu_info, format_cpu_header  # noqa: E402

GEMM_SHAPE = (1024, 576, 1536)  # M, K, N: F.linear(x[M, K], w[N, K])
GEMV_SHAPE = (49152, 576)  # N, K of w: the embedded model's LM head (vocab x hidden)


def last_level_cache_bytes() -> int:
    """The largest CPU cache (sysfs), 0 where unknown."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            pass
    return max(sizes, default=0)


# bytes cycled over, so no call finds its weight in cache: 4x the last-level cache (an Intel
# Xeon here has 260 MiB of L3, where a 256 MiB set ran from cache at ~1.5x the DRAM rate)
GEMV_WORKING_SET = max(256 << 20, 4 * last_level_cache_bytes())
PROBE_DTYPES = ("float32", "bfloat16")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _best_seconds(fn: Callable[[], Any], min_reps: int = 3, max_reps: int = 10, budget_s: float = 1.0) -> float:
    """Fastest of a few timed calls after one warm-up call (kernel selection, weight packing);
    stops early past budget_s so a slow dtype cannot stretch the probe."""
    fn()
    best, spent = float("inf"), 0.0
    for rep in range(max_reps):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
        if rep + 1 >= min_reps and spent > budget_s:
            break
    return best


def _agrees_with_torch(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a kernel's x @ w.T matches F.linear's: a kernel that skipped work would look fast."""
    want = F.linear(x, w).float()
    tol = 1e-3 if w.dtype == torch.float32 else 5e-2
    return torch.allclose(y.float(), want, rtol=tol, atol=tol * want.abs().max().item())


def probe_gemm(dtype: str, shape: tuple[int, int, int] = GEMM_SHAPE,
               kernel: Callable[..., torch.Tensor] | None = None) -> dict[str, Any]:
    """GFLOP/s of torch's GEMM and, given loom's linear_dense, of loom's kernel on the weight packed
    as loom packs it at load (where the build packs this dtype); "gflops" is the better one."""
    m, k, n = shape
    x = torch.randn(m, k, dtype=_DTYPES[dtype])
    w = torch.randn(n, k, dtype=_DTYPES[dtype])
    flops = 2.0 * m * k * n
    seconds = _best_seconds(lambda: F.linear(x, w))
    out = {"gflops": flops / seconds / 1e9, "torch_gflops": flops / seconds / 1e9, "loom_gflops": None,
           "seconds": seconds, "shape_mkn": list(shape)}
    packed = _packed_copies([w]) if kernel is not None else {}
    if packed:
        try:
            if _agrees_with_torch(kernel(x[:4], w, packed[w.data_ptr()]), x[:4], w):
                loom_seconds = _best_seconds(lambda: kernel(x, w, packed[w.data_ptr()]))
                out["loom_gflops"] = flops / loom_seconds / 1e9
                if loom_seconds < seconds:
                    out["gflops"], out["seconds"] = out["loom_gflops"], loom_seconds
        except Exception:  # a benchmark must not fail because an optional kernel did
            pass
    return out


def zeros_tensor_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    add_repo_to_path()
    from worker_proc.huge_pages import zeros_tensor_on_huge_pages as allocate

    return allocate(shape, dtype)


def load_loom_gemv() -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None, str]:
    """loom's small-M linear kernel and a word on its state. The first call may compile it (about
    a minute); later runs load the cached build."""
    add_repo_to_path()
    start = time.perf_counter()
    try:
        from worker_proc import cpu_kernels

        module = cpu_kernels.load()
    except Exception as e:  # a benchmark must not fail because an optional kernel did
        return None, f"unavailable ({type(e).__name__}: {e})"
    if module is None:
        return None, "unavailable (did not compile; see the log)"
    fn = getattr(module, "linear_dense", None)
    if fn is None:
        return None, "unavailable (this build has no linear_dense)"
    return fn, f"loaded in {time.perf_counter() - start:.1f} s"


def _packed_copies(weights: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """data_ptr -> the weight packed as loom packs it at load (float32 panels, bfloat16 in the AMX
    tiles' form), on huge pages as loom keeps it; empty where the build does not pack this dtype."""
    from worker_proc import cpu_kernels

    module = cpu_kernels.load()
    pack = getattr(module, "pack_dense_f32" if weights[0].dtype == torch.float32 else "pack_dense_bf16", None)
    out: dict[int, torch.Tensor] = {}
    for w in weights:
        panels = pack(w) if pack is not None else None
        if panels is None or panels.numel() == 0:
            return {}
        out[w.data_ptr()] = zeros_tensor_on_huge_pages(tuple(panels.shape), panels.dtype).copy_(panels)
    return out


class GemvProbe:
    """The GEMV probe's weights, allocated once (on huge pages, as loom keeps its weights) and
    timed on each measure(): rounds between other work then add no allocation of their own."""

    def __init__(self, dtype: str, kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                 shape: tuple[int, int] = GEMV_SHAPE, working_set: int = GEMV_WORKING_SET) -> None:
        n, k = shape
        torch_dtype = _DTYPES[dtype]
        self.shape = shape
        self.matrix_bytes = n * k * torch.empty((), dtype=torch_dtype).element_size()
        count = max(2, math.ceil(working_set / self.matrix_bytes))
        self.weights = [zeros_tensor_on_huge_pages((n, k), torch_dtype).uniform_(-1.0, 1.0) for _ in range(count)]
        self.x = torch.randn(1, k, dtype=torch_dtype)
        self.impls: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"torch": F.linear}
        self.kernel_note = None
        if kernel is not None:
            try:
                if _agrees_with_torch(kernel(self.x, self.weights[0]), self.x, self.weights[0]):
                    self.impls["loom"] = kernel
                else:
                    self.kernel_note = "result differs from F.linear; not timed"
            except Exception as e:
                self.kernel_note = f"failed ({type(e).__name__}: {e})"
        if "loom" in self.impls:
            # loom's linears keep float32 and bfloat16 weights packed for the kernel as well
            # (Linear.pack_weight): a token against the packed copy is the stream a decode step does
            # (bfloat16: on AMX tiles; without AMX linear_dense takes the unpacked weight at one row)
            packed = _packed_copies(self.weights)
            if packed:
                self.impls["loom packed"] = lambda x, w: kernel(x, w, packed[w.data_ptr()])

    def measure(self, rounds: int = 3) -> dict[str, Any]:
        rates: dict[str, float] = {}
        for name, fn in self.impls.items():
            fn(self.x, self.weights[0])  # warm-up
            best = float("inf")
            # Cycling through the set means the weight of each call was last touched a whole
            # working set ago: it comes from DRAM.
            for _ in range(rounds):
                for w in self.weights:
                    t = time.perf_counter()
                    fn(self.x, w)
                    best = min(best, time.perf_counter() - t)
            rates[name] = self.matrix_bytes / best / 1e9
        best_impl = max(rates, key=rates.get)
        return {"torch_gbs": rates["torch"], "loom_gbs": rates.get("loom"),
                "loom_packed_gbs": rates.get("loom packed"), "best_gbs": rates[best_impl], "best_by": best_impl,
                "loom_note": self.kernel_note, "shape_nk": list(self.shape), "matrix_bytes": self.matrix_bytes,
                "working_set_bytes": self.matrix_bytes * len(self.weights)}


def probe_gemv(dtype: str, kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
               shape: tuple[int, int] = GEMV_SHAPE, working_set: int = GEMV_WORKING_SET,
               rounds: int = 3) -> dict[str, Any]:
    return GemvProbe(dtype, kernel, shape, working_set).measure(rounds)


def describe_machine() -> dict[str, Any]:
    """CPU model and flags, torch version and threads: no measurement."""
    return {"cpu": cpu_info(), "torch": {"version": torch.__version__, "threads": torch.get_num_threads()}}


def probe_machine(dtypes: Iterable[str] = PROBE_DTYPES, kernel: bool = True,
                  gemm_shape: tuple[int, int, int] = GEMM_SHAPE, gemv_shape: tuple[int, int] = GEMV_SHAPE,
                  gemv_working_set: int = GEMV_WORKING_SET) -> dict[str, Any]:
    """describe_machine() plus GEMM and GEMV probes per dtype. Run it while nothing else of the
    benchmark is busy on the cores."""
    dtypes = [d for d in dict.fromkeys(dtypes) if d in _DTYPES]
    machine = describe_machine()
    loom_gemv, kernel_state = load_loom_gemv() if kernel else (None, "not probed (--no-kernel)")
    start = time.perf_counter()
    with torch.inference_mode():
        machine["gemm"] = {d: probe_gemm(d, gemm_shape, loom_gemv) for d in dtypes}
        machine["gemv"] = {d: probe_gemv(d, loom_gemv, gemv_shape, gemv_working_set) for d in dtypes}
    machine["loom_kernel"] = kernel_state
    machine["probe_seconds"] = time.perf_counter() - start
    return machine


# ---- reading and formatting --------------------------------------------------------------------

def gemm_gflops(machine: Mapping[str, Any], dtype: str) -> float | None:
    return ((machine.get("gemm") or {}).get(dtype) or {}).get("gflops")


def gemv_gbs(machine: Mapping[str, Any], dtype: str) -> float | None:
    """The GEMV rate: the best of torch and loom's kernel."""
    return ((machine.get("gemv") or {}).get(dtype) or {}).get("best_gbs")


def format_probe_lines(machine: Mapping[str, Any]) -> list[str]:
    if "gemm" not in machine:
        return ["probes     skipped"]
    m, k, n = GEMM_SHAPE if not machine["gemm"] else next(iter(machine["gemm"].values()))["shape_mkn"]
    gemm = ", ".join(f"{d} {r['gflops']:.1f}" + (f" (torch {r['torch_gflops']:.1f}, loom {r['loom_gflops']:.1f})"
                                                 if r.get("loom_gflops") is not None else "")
                     for d, r in machine["gemm"].items())
    lines = [f"GEMM       x[{m},{k}] w[{n},{k}]: {gemm} GFLOP/s"]
    for d, r in machine["gemv"].items():
        loom = f"{r['loom_gbs']:.1f}" if r["loom_gbs"] is not None else (r["loom_note"] or "n/a")
        if r.get("loom_packed_gbs") is not None:
            loom += f" (packed {r['loom_packed_gbs']:.1f})"
        wn, wk = r["shape_nk"]
        lines.append(f"GEMV {d:<9} x[1,{wk}] w[{wn},{wk}] over {r['working_set_bytes'] / 2**20:.0f} MiB: "
                     f"torch {r['torch_gbs']:.1f}, loom {loom} -> rate {r['best_gbs']:.1f} GB/s")
    lines.append(f"probes     {machine['probe_seconds']:.1f} s; loom kernel {machine['loom_kernel']}")
    return lines


def header_lines(machine: Mapping[str, Any], sides: Mapping[str, str] | None = None,
                 extra: Sequence[str] = ()) -> list[str]:
    """The report header: CPU, flags, torch threads, the dtype of each side, the probes, and any
    benchmark-specific lines."""
    t = machine["torch"]
    lines = ["=" * 78, *format_cpu_header(machine["cpu"]), f"torch      {t['version']}, {t['threads']} threads"]
    lines += [f"{'dtype ' + side:<10} {what}" for side, what in (sides or {}).items()]
    lines += [*format_probe_lines(machine), *extra, "=" * 78]
    return lines


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-kernel", action="store_true", help="do not load (or compile) loom's GEMV kernel")
    p.add_argument("--dtypes", default=",".join(PROBE_DTYPES), help="(default: %(default)s)")
    args = p.parse_args(argv)
    machine = probe_machine(args.dtypes.split(","), kernel=not args.no_kernel)
    print("\n".join(header_lines(machine)))
    return machine


if __name__ == "__main__":
    main()
