"""`python -m sim profile`: time loom's steps on this machine and fit the simulator's step-time
model (predictor.FittedPredictor). Three sources of timed steps:

  --live         (what a serving run's simulation wants) a loom server with the given flags
                 serves a calibration load over HTTP (a burst, a light and a busy Poisson load)
                 and logs every step (--step-log-file); the fit is to the steps' wall time as the
                 scheduler lives it, with the HTTP, tokenizer and detokenizer processes and the
                 load's client sharing the machine.
  --step-log F   fit to step logs a server already wrote (--step-log-file): your own traffic.
  (neither)      the worker alone in this process over a grid of step shapes (below): no other
                 process, so it is the lower bound of a step's time.

Grid: for each (decoding requests R, their context C) of the grid, R prompts of C tokens are computed
(not timed), then timed: pure decode steps, and steps where one new prompt of P tokens rides with
the R decodes; and prompt-only steps of P tokens. A step is timed as the live scheduler's normal
loop runs it: plan (next_batch), wire form, forward, apply the result. The model, dtype, kernels
and quantization come from the same flags as the server's."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from scheduler_proc.step_metrics import step_features
from sim.predictor import FittedPredictor

GRID_DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)
GRID_CONTEXTS = (32, 256, 1024)
GRID_PROMPTS = (32, 128, 512, 1024)
MAX_PREFILLED = 8192  # R x C above this is skipped (its set-up would dominate the profile)


def build_runner(args: dict):
    import torch

    from worker_proc.dtype_probe import resolve_dtype
    from worker_proc.model_loader import resolve_model_path
    from worker_proc.model_runner import ModelRunner, RunnerConfig, load_kernels

    if args.get("num_threads"):
        torch.set_num_threads(args["num_threads"])
    dtype, why = resolve_dtype(args["dtype"], "cpu", load_kernels(args["kernel_backend"], "cpu", args["kernel_isa"]))
    model_dir = resolve_model_path(args["model_path"])
    runner = ModelRunner(RunnerConfig(str(model_dir), dtype, args["kv_cache_gb"], max(args["max_running_requests"], 65),
                                      context_length=args.get("context_length"), kernel_backend=args["kernel_backend"],
                                      kernel_isa=args["kernel_isa"], quantization=args["quantization"],
                                      kv_cache_dtype=args.get("kv_cache_dtype", "auto")))
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
            shapes.append(step_features(batch))
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


# The calibration load of --live: (requests, longest prompt, longest output, shortest = ratio x
# longest, Poisson rate per second; inf: all at once). Seeds differ from bench_serving's default.
LIVE_PHASES = ((48, 512, 64, 0.1, float("inf")),  # long prompt steps, then large decode batches
               (32, 256, 128, 0.25, 2.0),  # light: small decode batches, prompts mostly alone
               (96, 160, 48, 0.25, 8.0))  # busy: prompts riding with many decodes
QUICK_PHASES = ((8, 32, 8, 0.5, float("inf")), (8, 16, 8, 0.5, 8.0))


def read_step_logs(paths: list[Path]) -> tuple[list[tuple], list[float], dict]:
    """(shape, seconds) of every step in the logs (--step-log-file JSON lines), or in the samples
    an earlier fit kept (a profile JSON: fit them again; its description of the model and machine
    comes along)."""
    shapes, seconds, meta = [], [], {}
    for path in paths:
        text = path.read_text()
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:  # JSON lines
            whole = None
        if isinstance(whole, dict) and "samples" in whole:
            meta = {k: v for k, v in whole.get("meta", {}).items() if k not in ("steps", "fit_mape", "fit_p90_error")}
            for sample in whole["samples"]:
                shapes.append(tuple(sample["shape"]))
                seconds.append(sample["seconds"])
            continue
        for line in text.splitlines():
            if line.strip():
                step = json.loads(line)
                if step["seconds"] > 0:
                    shapes.append(tuple(step["shape"]))
                    seconds.append(step["seconds"])
    if not seconds:
        raise SystemExit(f"no steps in {', '.join(map(str, paths))}")
    return shapes, seconds, meta


def profile_live(server_argv: list[str], phases=LIVE_PHASES, port: int = 30790, seed: int = 11,
                 progress: bool = True) -> tuple[list[tuple], list[float], dict]:
    """Serves the calibration load from a server of these flags; its steps and its server info."""
    import httpx

    from benchmarks import bench_serving
    from benchmarks.bench_serving_compare import stop
    from benchmarks.common import ROOT, wait_healthy

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "steps.jsonl"
        server = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "--port", str(port), "--zmq-port", "0",
                                   "--log-level", "warning", *server_argv, "--step-log-file", str(log)], cwd=str(ROOT))
        try:
            wait_healthy(server, f"http://127.0.0.1:{port}/health", "loom server")
            info = httpx.get(f"http://127.0.0.1:{port}/get_server_info", timeout=30).json()
            for i, (n, prompt, output, ratio, rate) in enumerate(phases):
                if progress:
                    print(f"calibration load {i + 1}/{len(phases)}: {n} requests, prompts {int(prompt * ratio)}-"
                          f"{prompt}, outputs {int(output * ratio)}-{output}, rate {rate:g}/s", flush=True)
                bench_serving.run_benchmark(bench_serving.parse_args([
                    "--port", str(port), "--num-prompts", str(n), "--random-input-len", str(prompt),
                    "--random-output-len", str(output), "--random-range-ratio", str(ratio),
                    "--request-rate", str(rate), "--seed", str(seed + i), "--no-probe", "--no-output-file",
                    "--no-plot", *([] if progress else ["--disable-tqdm"])]))
        finally:
            stop(server)
        shapes, seconds, _ = read_step_logs([log])
    return shapes, seconds, info


def live_meta(info: dict) -> dict:
    import torch

    from worker_proc.kv_cache import KVPool
    from worker_proc.model_config import ModelConfig

    model = ModelConfig.from_dir(info["model_path"])
    return {"dtype": info["dtype"], "model_dir": info["model_path"], "context_len": info["max_context_len"],
            "kv_bytes_per_token": KVPool.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim,
                                                         getattr(torch, info.get("kv_cache_dtype", info["dtype"])))}


def main(argv: list[str] | None = None) -> None:
    from launch import ServerArgs

    p = argparse.ArgumentParser(prog="python -m sim profile", description=__doc__.split("\n\n")[0],
                                epilog="Other arguments are server flags (python launch.py --help): the model, "
                                       "dtype, kernels and scheduling profiled.")
    p.add_argument("--out", type=Path, default=Path("sim_profile.json"), help="where the fitted model goes")
    p.add_argument("--live", action="store_true", help="time a live server's steps under a calibration load")
    p.add_argument("--step-log", type=Path, nargs="+", help="fit to these --step-log-file logs")
    p.add_argument("--port", type=int, default=30790, help="--live: the server's HTTP port")
    p.add_argument("--quick", action="store_true", help="a small grid or calibration load (a smoke test)")
    args, server_argv = p.parse_known_args(argv)
    server_parser = argparse.ArgumentParser(prog="python -m sim profile")
    ServerArgs.add_arguments(server_parser)
    server = vars(server_parser.parse_args(server_argv))
    from benchmarks.common import cpu_info

    cpu = cpu_info()
    t0 = time.perf_counter()
    meta = {"cpu": cpu["model_name"], "cores": cpu["cores"]}
    if args.live or args.step_log:
        if args.live:
            shapes, seconds, info = profile_live(server_argv, QUICK_PHASES if args.quick else LIVE_PHASES, args.port)
            meta |= {"source": "live server", **live_meta(info)}
        else:
            shapes, seconds, earlier = read_step_logs(args.step_log)
            meta |= {**earlier, "source": "step logs " + ", ".join(map(str, args.step_log))}
    else:
        runner, dtype, why, model_dir = build_runner(server)
        grid = dict(decode_rows=(1, 4), contexts=(16,), prompts=(8, 32), decode_reps=2) if args.quick else {}
        shapes, seconds = profile(runner, **grid)
        from worker_proc.kv_cache import KVPool

        meta |= {"source": "worker alone", "dtype": str(dtype).removeprefix("torch."), "dtype_reason": why,
                 "model_dir": str(model_dir), "kernel_isa": runner.kernel_isa,
                 "kernel_backend": runner.kernel_backend, "quantization": server["quantization"],
                 "kv_bytes_per_token": KVPool.bytes_per_token(runner.config.num_layers, runner.shard.num_kv_heads,
                                                              runner.config.head_dim, runner.kv_dtype),
                 "context_len": runner.context_len}
    meta |= {"steps": len(seconds), "profile_s": time.perf_counter() - t0}
    model = FittedPredictor.fit(shapes, seconds, meta)
    pred = np.array([model.seconds_of_shape(s) for s in shapes])
    err = np.abs(pred - np.array(seconds)) / np.array(seconds)
    meta["fit_mape"], meta["fit_p90_error"] = float(err.mean()), float(np.percentile(err, 90))
    model.save(args.out, {"samples": [{"shape": list(s), "seconds": t} for s, t in zip(shapes, seconds)]})
    print(json.dumps({"intercept": model.intercept, "coef": model.coef, **meta}, indent=1))
    print(f"fitted on {len(seconds)} steps: mean error {err.mean():.1%}, p90 {np.percentile(err, 90):.1%}; "
          f"wrote {args.out}")
