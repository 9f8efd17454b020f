"""The normal and the overlap event loop side by side in one run, on the same seeded workloads:

  1. offline: all requests at once through the Engine (output tok/s);
  2. steady decode: --decode-requests requests of one prompt length and one output length, so all
     of them decode together for most steps; the busy fraction over those steps;
  3. serving: a launch.py server under --concurrency streams (bench_serving's random workload):
     output tok/s and inter-token latency.

Every side also reports, from the scheduler's step trace: the worker's forward ms per step, the
gap it waited between forwards while work was queued, the scheduler's own CPU ms per step, and
the busy fraction forward / (forward + gap). --num-threads-options repeats everything per worker
thread count (on 2 cores: does the scheduler's CPU slice stall a compute thread?).

    python benchmarks/bench_overlap.py
    python benchmarks/bench_overlap.py --num-threads-options 2,1 --num-requests 64
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a script: make the repo root and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (add_repo_to_path, default_result_path, format_table, random_requests,  # noqa: E402
                               wait_healthy, write_json)
from benchmarks.probes import describe_machine, header_lines  # noqa: E402

add_repo_to_path()
ROOT = Path(__file__).resolve().parent.parent
LOOPS = {"normal": True, "overlap": False}  # loop -> disable_overlap_schedule


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=128, help="offline requests (default: %(default)s)")
    p.add_argument("--decode-requests", type=int, default=64, help="steady-decode batch (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=32, help="serving streams (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=64, help="serving requests (default: %(default)s)")
    p.add_argument("--num-threads-options", default="2", help="worker thread counts to run (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--port", type=int, default=30800)
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None,
                   help="result file (default: benchmarks/results/bench_overlap_<timestamp>.json)")
    return p.parse_args(argv)


def step_figures(before: dict, after: dict) -> dict[str, float]:
    """Per-step figures from two snapshots of the scheduler's stats."""
    steps = max(after["forward_steps"] - before["forward_steps"], 1)
    forward = after["forward_seconds"] - before["forward_seconds"]
    gap = after["worker_gap_seconds"] - before["worker_gap_seconds"]
    return {"steps": steps, "forward_ms": 1e3 * forward / steps, "gap_ms": 1e3 * gap / steps,
            "scheduler_cpu_ms": 1e3 * (after["scheduler_cpu_seconds"] - before["scheduler_cpu_seconds"]) / steps,
            "busy_fraction": forward / (forward + gap) if forward + gap else 0.0,
            "overlapped_steps": after["overlapped_steps"] - before["overlapped_steps"]}


def run_offline(engine, requests) -> dict[str, Any]:
    params = [{"max_new_tokens": r.output_len, "ignore_eos": True, "temperature": 0.0} for r in requests]
    before = engine.get_stats()
    start = time.perf_counter()
    outs = engine.generate(input_ids=[r.input_ids for r in requests], sampling_params=params)
    wall = time.perf_counter() - start
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"output_tok_s": tokens / wall, "wall_s": wall, **step_figures(before, engine.get_stats())}


def run_steady_decode(engine, n: int, prompt_len: int = 32, output_len: int = 96) -> dict[str, Any]:
    """n requests decoding together: the busy fraction between the end of their prompt steps and
    the last 8 steps (the stats are read while they run)."""
    prompts = [[100 + (i * 7 + j) % 5000 for j in range(prompt_len)] for i in range(n)]
    done = threading.Event()
    thread = threading.Thread(target=lambda: (engine.generate(
        input_ids=prompts, sampling_params={"max_new_tokens": output_len, "ignore_eos": True}), done.set()))
    start_steps = engine.get_stats()["forward_steps"]
    thread.start()
    first = last = None
    while not done.is_set():
        stats = engine.get_stats()
        steps = stats["forward_steps"] - start_steps
        if first is None and steps >= 8 and stats["num_waiting"] == 0:
            first = stats
        if steps <= output_len - 8:
            last = stats
        time.sleep(0.05)
    thread.join()
    return step_figures(first, last) if first and last and last["forward_steps"] > first["forward_steps"] else {}


def run_serving(loop: str, threads: int, args, model_dir) -> dict[str, Any]:
    from benchmarks import bench_serving

    port = args.port
    server = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "--port", str(port), "--zmq-port", "0",
                               "--dtype", args.dtype, "--num-threads", str(threads), "--max-running-requests",
                               str(args.concurrency), "--log-level", "warning",
                               *(["--disable-overlap-schedule"] if LOOPS[loop] else [])], cwd=str(ROOT))
    try:
        wait_healthy(server, f"http://127.0.0.1:{port}/health", "loom server")
        result = bench_serving.run_benchmark(bench_serving.parse_args([
            "--backend", "openai", "--port", str(port), "--num-prompts", str(args.num_prompts),
            "--random-input-len", "256", "--random-output-len", "128", "--random-range-ratio", "0.5",
            "--max-concurrency", str(args.concurrency), "--seed", str(args.seed), "--tokenizer", str(model_dir),
            "--no-probe", "--no-output-file", "--disable-tqdm", "--label", f"loom {loop}"]))
    finally:
        server.terminate()
        server.wait(30)
    figures = step_figures(result["server_stats_before"]["dp_ranks"][0], result["server_stats_after"]["dp_ranks"][0])
    return {"output_tok_s": result["output_throughput"], "itl_p50_ms": result["median_itl_ms"],
            "ttft_p50_ms": result["median_ttft_ms"], **figures}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from launch import Engine
    from worker_proc.model_loader import ensure_default_model

    model_dir = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    requests = random_requests(tokenizer, args.num_requests, (32, 256), (16, 128), args.seed)
    machine = describe_machine()
    print("\n".join(header_lines(machine, {"loom": args.dtype}, [
        f"workload   offline {args.num_requests} requests (input 32-256, output 16-128); steady decode "
        f"{args.decode_requests} x (32 + 96); serving {args.num_prompts} requests at {args.concurrency} streams"])),
        flush=True)
    results = []
    for threads in [int(t) for t in args.num_threads_options.split(",")]:
        for loop, disable in LOOPS.items():
            print(f"{loop} loop, {threads} worker threads ...", flush=True)
            side: dict[str, Any] = {"loop": loop, "threads": threads}
            with Engine(dtype=args.dtype, disable_overlap_schedule=disable, num_threads=threads, kv_cache_gb=2.0,
                        max_running_requests=max(args.decode_requests, 64), log_level="warning") as engine:
                engine.generate(input_ids=[[100 + i for i in range(8)]] * 2, sampling_params={"max_new_tokens": 4})
                side["offline"] = run_offline(engine, requests)
                side["steady_decode"] = run_steady_decode(engine, args.decode_requests)
            if not args.skip_serving:
                side["serving"] = run_serving(loop, threads, args, model_dir)
            results.append(side)

    rows = []
    for side in results:
        for part in ("offline", "steady_decode", "serving"):
            f = side.get(part)
            if not f:
                continue
            rows.append([f"{side['loop']} t{side['threads']}", part, _fmt(f.get("output_tok_s")),
                         _fmt(f.get("itl_p50_ms")), f"{f['forward_ms']:.1f}", f"{f['gap_ms']:.2f}",
                         f"{f['scheduler_cpu_ms']:.2f}", f"{f['busy_fraction']:.3f}", f["overlapped_steps"]])
    print(format_table(["loop", "part", "out tok/s", "ITL p50 ms", "forward ms", "gap ms", "sched cpu ms", "busy",
                        "overlapped"], rows))
    out = {"benchmark": "bench_overlap", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "args": vars(args),
           "machine": machine, "results": results}
    path = write_json(args.json or default_result_path("bench_overlap"), out)
    print(f"wrote {path}")
    return out


def _fmt(value) -> str:
    return "" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    main()
