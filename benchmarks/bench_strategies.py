"""Batching strategies at one load, live and simulated, side by side in one run.

First the step-time model: a loom server with the same flags serves a calibration load (other
seeds, lengths and rates than the measured runs) and the simulator's model is fitted to its
logged steps (`python -m sim profile --live`), unless --profile gives one. Then, for each
--batching-strategy, a loom server with it serves a seeded bench_serving workload (random
prompts, Poisson arrivals at --request-rate) and the simulator replays that run's very arrivals
and lengths through the same strategy; and an offline run (bench_offline: every request at once
through the Engine) is replayed too. The table gives both sides' median TTFT, median e2e and
output throughput and the simulator's error on each; the plot puts them side by side.

    python benchmarks/bench_strategies.py
    python benchmarks/bench_strategies.py --strategies loom,vllm --request-rate 4 -- --dtype float32
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (ROOT, add_repo_to_path, cpu_info, default_result_path, format_table,  # noqa: E402
                               wait_healthy, write_json)

add_repo_to_path()

STRATEGIES = "loom,sarathi,vllm,orca,lightllm,static"


def serve_and_measure(args, strategy: str, out_json: Path) -> None:
    from benchmarks import bench_serving
    from benchmarks.bench_serving_compare import stop

    server = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "--port", str(args.port), "--zmq-port", "0",
                               "--batching-strategy", strategy, "--max-running-requests", str(args.max_running_requests),
                               "--log-level", "warning", *args.server_args], cwd=str(ROOT))
    try:
        wait_healthy(server, f"http://127.0.0.1:{args.port}/health", "loom server")
        bench_serving.run_benchmark(bench_serving.parse_args([
            "--port", str(args.port), "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", str(args.range_ratio),
            "--request-rate", str(args.request_rate), "--seed", str(args.seed), "--no-probe", "--disable-tqdm", "--no-plot",
            "--label", strategy, "--output-file", str(out_json)]))
    finally:
        stop(server)


def simulate(args, strategy: str, replay: Path, server_args: list[str]) -> dict:
    from sim.__main__ import cmd_run

    return cmd_run(["--predictor", str(args.profile), "--replay", str(replay), "--batching-strategy", strategy,
                    "--max-running-requests", str(args.max_running_requests), "--no-progress", *server_args])


def row(name: str, summaries: list[dict]) -> dict:
    """A table row over repeated live runs of one configuration, each replayed: the medians of
    both sides and the error between them (one live run moves by more than the simulator errs on
    a noisy machine), the live runs' spread, and what the first replay simulated."""
    import statistics

    fidelity = {}
    for key in summaries[0]["fidelity"]:
        measured = [s["fidelity"][key]["measured"] for s in summaries]
        simulated = statistics.median(s["fidelity"][key]["simulated"] for s in summaries)
        live = statistics.median(measured)
        fidelity[key] = {"simulated": simulated, "measured": live, "error": (simulated - live) / live,
                         "measured_runs": measured, "live_spread": (max(measured) - min(measured)) / live}
    return {"strategy": name, "runs": len(summaries), "fidelity": fidelity,
            "simulated": {k: summaries[0][k] for k in ("ttft_s", "tbt_s", "e2e_s", "preemptions", "steps")}}


def calibrate(args, path: Path) -> None:
    """The step-time model, fitted to a live server's steps under the calibration load."""
    from sim.profile import main as profile

    profile(["--live", "--out", str(path), "--port", str(args.port), "--max-running-requests",
             str(args.max_running_requests), *args.server_args])


def offline(args, out_json: Path, run: bool = True) -> list[str]:
    """bench_offline (loom only) over the serving runs' length ranges (unless not `run`); returns
    the server flags its Engine runs with, for the replay."""
    from benchmarks import bench_offline
    from launch import ServerArgs

    server = argparse.ArgumentParser()
    ServerArgs.add_arguments(server)
    flags = server.parse_args(args.server_args)
    engine_args = ["--kv-cache-gb", str(flags.kv_cache_gb), "--max-prefill-tokens", str(flags.max_prefill_tokens)]
    if not run:
        return engine_args
    bench_offline.main(["--baseline", "none", "--no-kernel-probe", "--num-requests", str(args.offline_requests),
                        "--seed", str(args.seed), "--input-min", str(int(args.input_len * args.range_ratio)),
                        "--input-max", str(args.input_len), "--output-min", str(int(args.output_len * args.range_ratio)),
                        "--output-max", str(args.output_len), "--max-running-requests", str(args.max_running_requests),
                        "--max-prefill-tokens", str(flags.max_prefill_tokens), "--kv-cache-gb", str(flags.kv_cache_gb),
                        "--dtype", flags.dtype, "--json", str(out_json)])
    return engine_args


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    x = np.arange(len(rows))
    for ax, key, name, scale in ((axes[0], "ttft_p50_s", "median TTFT (ms)", 1e3),
                                 (axes[1], "e2e_p50_s", "median e2e latency (s)", 1.0),
                                 (axes[2], "output_tok_s", "output tok/s", 1.0)):
        live = np.array([r["fidelity"][key]["measured"] * scale for r in rows])
        simulated = [r["fidelity"][key]["simulated"] * scale for r in rows]
        runs = [np.array(r["fidelity"][key].get("measured_runs", [r["fidelity"][key]["measured"]])) * scale
                for r in rows]
        spread = [live - [m.min() for m in runs], [m.max() for m in runs] - live]
        ax.bar(x - 0.2, live, 0.4, yerr=spread, capsize=3, label="live (median, range of runs)")
        ax.bar(x + 0.2, simulated, 0.4, label="simulated")
        ax.set_xticks(x, [r["strategy"] for r in rows])
        if key != "output_tok_s":  # (static and offline latencies are tens of times the others')
            ax.set_yscale("log")
        ax.set_title(name)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", type=Path,
                   help="a fitted step-time model (python -m sim profile); default: fit one to a live server first")
    p.add_argument("--strategies", default=STRATEGIES, help="comma list (default: all)")
    p.add_argument("--num-prompts", type=int, default=120)
    p.add_argument("--input-len", type=int, default=256, help="longest prompt")
    p.add_argument("--output-len", type=int, default=64, help="longest output")
    p.add_argument("--range-ratio", type=float, default=0.25, help="shortest = ratio x longest")
    p.add_argument("--request-rate", type=float, default=3.0, help="Poisson arrivals per second")
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--offline-requests", type=int, default=128,
                   help="requests of the offline run replayed too (0: none)")
    p.add_argument("--repeats", type=int, default=3,
                   help="live runs of each configuration; the table compares medians (default 3)")
    p.add_argument("--reuse-runs", action="store_true",
                   help="live runs already in the runs folder (next to the JSON) are simulated again, not re-run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--port", type=int, default=30710)
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path, help="where the plot goes (default: next to the JSON)")
    p.add_argument("server_args", nargs="*", help="more server flags, after --")
    args = p.parse_args(argv)
    cpu = cpu_info()
    print(f"CPU: {cpu['model_name']}, {cpu['cores']} cores", flush=True)
    path = args.json or default_result_path("bench_strategies")
    if args.profile is None:
        args.profile = path.with_suffix(".profile.json")
        print(f"== calibration: a live server's steps -> {args.profile}", flush=True)
        calibrate(args, args.profile)
    rows = []
    runs = path.with_suffix(".runs")  # the live runs, kept: `python -m sim run --replay` takes them again
    runs.mkdir(parents=True, exist_ok=True)
    for strategy in args.strategies.split(","):
        summaries = []
        for i in range(args.repeats):
            print(f"== {strategy}: live run {i + 1} of {args.repeats}", flush=True)
            live = runs / f"{strategy}.{i}.json"
            if not (args.reuse_runs and live.exists()):
                serve_and_measure(args, strategy, live)
            summaries.append(simulate(args, strategy, live, args.server_args))
        rows.append(row(strategy, summaries))
    if args.offline_requests:
        summaries = []
        for i in range(args.repeats):
            print(f"== offline ({args.offline_requests} requests at once, loom batching): live run {i + 1} of "
                  f"{args.repeats}", flush=True)
            live = runs / f"offline.{i}.json"
            engine_args = offline(args, live, run=not (args.reuse_runs and live.exists()))
            summaries.append(simulate(args, "loom", live, [*args.server_args, *engine_args]))
        rows.append(row("offline", summaries))

    def cell(r, key, scale=1.0):
        f = r["fidelity"][key]
        return (f"{f['measured'] * scale:.4g} / {f['simulated'] * scale:.4g} ({f['error']:+.0%}; "
                f"live runs ±{f['live_spread'] / 2:.0%})")

    table = format_table(["strategy", "TTFT p50 ms live / sim", "e2e p50 s live / sim", "out tok/s live / sim"],
                         [(r["strategy"], cell(r, "ttft_p50_s", 1e3), cell(r, "e2e_p50_s"), cell(r, "output_tok_s"))
                          for r in rows])
    print(f"(medians of {args.repeats} live runs each against their replays; ± is half the live runs' range)")
    print(table)
    result = {"benchmark": "bench_strategies", "cpu": cpu, "args": {k: str(v) for k, v in vars(args).items()},
              "rows": rows}
    path = write_json(path, result)
    plot_path = args.plot or path.with_suffix(".png")
    plot(rows, plot_path, f"{args.num_prompts} requests, Poisson {args.request_rate:g}/s (offline: "
                          f"{args.offline_requests} at once), prompts "
                          f"{int(args.input_len * args.range_ratio)}-{args.input_len}, outputs "
                          f"{int(args.output_len * args.range_ratio)}-{args.output_len} ({cpu['model_name']})")
    print(f"results: {path}, plot: {plot_path}")
    return result


if __name__ == "__main__":
    main()
