"""`python -m sim profile`: time loom's own worker over a grid of step shapes on this machine and
fit the simulator's step-time model (predictor.FittedPredictor).

For each (decoding requests R, their context C) of the grid, R prompts of C tokens are computed
(not timed), then timed: pure decode steps, and steps where one new prompt of P tokens rides with
the R decodes; and prompt-only steps of P tokens. A step is timed as the live scheduler's normal
loop runs it: plan (next_batch), wire form, forward, apply the result. The model, dtype, kernels
and quantization come from the same flags as the server's."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from sim.predictor import FittedPredictor, step_shape

GRID_DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)
GRID_CONTEXTS = (32, 256, 1024)
GRID_PROMPTS = (32, 128, 512, 1024)
MAX_PREFILLED = 8192  # R x C above this is skipped (its set-up would dominate the profile)


def build_runner(args: dict):
    import torch

    from worker_proc.dtype_probe import resolve_dtype
    from worker_proc.model_loader import resolve_model_path
    from worker_proc.model_runner import ModelRunner, RunnerConfig

    if args.get("num_threads"):
        torch.set_num_threads(args["num_threads"])
    dtype, why = resolve_dtype(args["dtype"], "cpu")
    model_dir = resolve_model_path(args["model_path"])
    runner = ModelRunner(RunnerConfig(str(model_dir), dtype, args["kv_cache_gb"], max(args["max_running_requests"], 65),
                                      context_length=args.get("context_length"), kernel_backend=args["kernel_backend"],
                                      kernel_isa=args["kernel_isa"], quantization=args["quantization"]))
    return runner, dtype, why, model_dir


def profile(runner, decode_rows=GRID_DECODE_ROWS, contexts=GRID_CONTEXTS, prompts=GRID_PROMPTS,
            decode_reps: int = 3, seed: int = 0, progress: bool = True) -> tuple[list[tuple], list[float]]:
    """Timed steps: (shape features, seconds) pairs."""
    from ipc.messages import SamplingParams
    from scheduler_proc.core import SchedulerConfig, SchedulerCore
    from scheduler_proc.req import Req

    rng = np.random.default_rng(seed)
    vocab = 1000
    shapes: list[tuple] = []
    seconds: list[float] = []
    max_rows = runner.pool.req_to_token.shape[0]
    core = SchedulerCore(SchedulerConfig(
        max_total_tokens=runner.num_slots, max_running_requests=max_rows, max_prefill_tokens=max(prompts) + max(decode_rows),
        max_context_len=runner.context_len, chunked_prefill_size=None, enable_radix_cache=False))

    def step(timed: bool) -> bool:
        t0 = time.perf_counter()
        batch, _ = core.next_batch()
        if batch is None:
            return False
        core.on_result(batch, runner.forward(batch.to_worker_batch()))
        if timed:
            seconds.append(time.perf_counter() - t0)
            shapes.append(step_shape(batch))
        return True

    def prompt(n: int, max_new: int) -> Req:
        return Req(f"p{len(shapes)}-{rng.integers(1 << 30)}", rng.integers(3, vocab, n).tolist(),
                   SamplingParams(max_new_tokens=max_new, ignore_eos=True))

    cells = [(r, c) for c in contexts for r in decode_rows if r * c <= MAX_PREFILLED and r < max_rows
             and c + decode_reps + 2 * len(prompts) + 2 < runner.context_len]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(cells) + 1, desc="profiling step shapes", unit="cell")
    for p in prompts:  # prompt-only steps
        if p < runner.context_len:
            core.add_request(prompt(p, 1))
            step(timed=True)
    if bar is not None:
        bar.update(1)
    for r, c in cells:
        for _ in range(r):
            core.add_request(prompt(c, 10_000))
        while any(q.num_pending > 1 for q in core.running) or core.waiting:
            step(timed=False)
        for _ in range(decode_reps):
            step(timed=True)
        for p in prompts:
            if c + p < runner.context_len:
                core.add_request(prompt(p, 1))
                step(timed=True)
        core.abort("")
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return shapes, seconds


def main(argv: list[str] | None = None) -> None:
    from launch import ServerArgs

    p = argparse.ArgumentParser(prog="python -m sim profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("sim_profile.json"), help="where the fitted model goes")
    p.add_argument("--quick", action="store_true", help="a small grid (a smoke test)")
    ServerArgs.add_arguments(p.add_argument_group("server flags (the model, dtype and kernels profiled)"))
    args = p.parse_args(argv)
    server = {k: v for k, v in vars(args).items() if k not in ("out", "quick")}
    runner, dtype, why, model_dir = build_runner(server)
    grid = dict(decode_rows=(1, 4), contexts=(16,), prompts=(8, 32), decode_reps=2) if args.quick else {}
    t0 = time.perf_counter()
    shapes, seconds = profile(runner, **grid)
    from benchmarks.common import cpu_info
    from worker_proc.kv_cache import KVPool

    cpu = cpu_info()
    meta = {"cpu": cpu["model_name"], "cores": cpu["cores"], "dtype": str(dtype).removeprefix("torch."),
            "dtype_reason": why, "model_dir": str(model_dir), "kernel_isa": runner.kernel_isa,
            "kernel_backend": runner.kernel_backend, "quantization": server["quantization"],
            "kv_bytes_per_token": KVPool.bytes_per_token(runner.config.num_layers, runner.shard.num_kv_heads,
                                                         runner.config.head_dim, dtype),
            "context_len": runner.context_len, "steps": len(seconds), "profile_s": time.perf_counter() - t0}
    model = FittedPredictor.fit(shapes, seconds, meta)
    pred = np.array([model.seconds_of_shape(s) for s in shapes])
    err = np.abs(pred - np.array(seconds)) / np.array(seconds)
    meta["fit_mape"], meta["fit_p90_error"] = float(err.mean()), float(np.percentile(err, 90))
    model.save(args.out, {"samples": [{"shape": list(s), "seconds": t} for s, t in zip(shapes, seconds)]})
    print(json.dumps({"intercept": model.intercept, "coef": model.coef, **meta}, indent=1))
    print(f"fitted on {len(seconds)} steps: mean error {err.mean():.1%}, p90 {np.percentile(err, 90):.1%}; "
          f"wrote {args.out}")
