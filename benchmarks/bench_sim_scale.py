"""The simulator at scale, timed side by side with Vidur on the same configuration.

loom's simulator (`python -m sim run`, roofline step times for a GPU and a model shape) and, when
--vidur-python names a Python with `vidur` installed, Vidur's own simulator on the same cluster
(replicas, tensor parallelism, global scheduler, vllm-style batching) and workload (Poisson
arrivals, uniform request lengths with a prefill:decode ratio), one after the other, each alone:
wall time and peak memory of each process, and what each simulated (throughput, median TTFT and
e2e). Their step times differ by construction (roofline vs. Vidur's profiled operators); the
question here is what a run of that size costs.

Vidur's execution-time predictor reads profiling CSVs from Hugging Face datasets; on a machine
without the hub lay them out as a Hugging Face cache under --vidur-cache
(`profiling_data/compute/datasets--ORG--NAME/snapshots/REV/{mlp,attention}.csv.xz` and
`config.json`, `refs/main` = REV; the same under `profiling_data/network/` with
`{all_reduce,send_recv}.csv.xz`) and name the datasets with --vidur-compute-dataset and
--vidur-network-dataset. Vidur trains its predictor on first use and caches it there, so the
first Vidur run of a configuration includes training; --vidur-runs 2 times a warm one too.
Its random forest's default grid search (27 settings x 10 folds per operator) takes hours on 2
cores; flags after `--` go to Vidur, e.g. a one-setting grid:
`-- --random_forrest_execution_time_predictor_config_num_estimators 250
--random_forrest_execution_time_predictor_config_max_depth 16
--random_forrest_execution_time_predictor_config_min_samples_split 2
--random_forrest_execution_time_predictor_config_k_fold_cv_splits 2`. The simulation itself reads
a table of predictions computed once before it starts, whatever the grid.

    python benchmarks/bench_sim_scale.py                    # the issue's case: 7B on 16 H100s
    python benchmarks/bench_sim_scale.py --hardware a100 --model-shape llama-2-70b --tp-size 2 \\
        --vidur-python /path/venv/bin/python --vidur-cache DIR \\
        --vidur-compute-dataset local/llama-2-70b-a100 --vidur-network-dataset local/a100-pairwise-nvlink
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, cpu_info, default_result_path, format_table, write_json  # noqa: E402

VIDUR_MODELS = {"llama-2-7b": "meta-llama/Llama-2-7b-hf", "llama-2-70b": "meta-llama/Llama-2-70b-hf",
                "llama-3-8b": "meta-llama/Meta-Llama-3-8B"}
VIDUR_NETWORK = {"h100": "h100_dgx", "a100": "a100_pairwise_nvlink"}


def timed(cmd: list[str], env: dict | None = None, cwd: Path | None = None) -> dict:
    """Run a command to the end: wall seconds, peak resident MB (the child's own), exit status."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # (the child's own peak RSS, which Popen.wait does not give)
    return {"wall_s": time.perf_counter() - start, "peak_rss_mb": usage.ru_maxrss / 1024,
            "returncode": os.waitstatus_to_exitcode(status), "output": output}


def run_loom(args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "sim", "run", "--hardware", args.hardware, "--model-shape", args.model_shape,
           "--tp-size", str(args.tp_size), "--dp-size", str(args.replicas), "--num-requests", str(args.num_requests),
           "--rate", str(args.rate), "--length-dist", "uniform", "--min-len", str(args.min_len),
           "--max-len", str(args.max_len), "--pd-ratio", str(args.pd_ratio), "--seed", str(args.seed),
           "--batching-strategy", "vllm", "--load-balance-method", args.global_scheduler,
           "--max-running-requests", str(args.batch_size_cap), "--disable-radix-cache", "--no-progress",
           "--out", str(out)]
    result = timed(cmd, cwd=ROOT)
    if result["returncode"] != 0:
        raise SystemExit(f"loom's simulator failed:\n{result['output'][-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    result["simulated"] = {"output_tok_s": s["output_tok_s"], "ttft_p50_s": s["ttft_s"]["p50"],
                           "e2e_p50_s": s["e2e_s"]["p50"], "simulated_s": s["simulated_s"], "steps": s["steps"],
                           "preemptions": s["preemptions"]}
    return result


def run_vidur(args, out: Path) -> dict:
    predictor = "random_forrest_execution_time_predictor_config"
    cmd = [args.vidur_python, "-m", "vidur.main",
           "--replica_config_device", args.hardware,
           "--replica_config_network_device", args.vidur_network_device or VIDUR_NETWORK[args.hardware],
           "--replica_config_model_name", VIDUR_MODELS[args.model_shape],
           "--replica_config_tensor_parallel_size", str(args.tp_size),
           "--cluster_config_num_replicas", str(args.replicas),
           "--global_scheduler_config_type", args.global_scheduler,
           "--replica_scheduler_config_type", "vllm",
           "--vllm_scheduler_config_batch_size_cap", str(args.batch_size_cap),
           "--request_generator_config_type", "synthetic",
           "--synthetic_request_generator_config_num_requests", str(args.num_requests),
           "--interval_generator_config_type", "poisson",
           "--poisson_request_interval_generator_config_qps", str(args.rate),
           "--poisson_request_interval_generator_config_seed", str(args.seed),
           "--length_generator_config_type", "uniform",
           "--uniform_request_length_generator_config_min_tokens", str(args.min_len),
           "--uniform_request_length_generator_config_max_tokens", str(args.max_len),
           "--uniform_request_length_generator_config_prefill_to_decode_ratio", str(args.pd_ratio),
           "--uniform_request_length_generator_config_seed", str(args.seed),
           "--execution_time_predictor_config_type", "random_forrest",
           f"--{predictor}_cache_dir", str(args.vidur_cache),
           "--metrics_config_output_dir", str(out),
           "--no-metrics_config_store_plots"]  # (its PNGs go through kaleido, which wants Chrome)
    if args.vidur_compute_dataset:
        cmd += [f"--{predictor}_model_profiling_dataset", args.vidur_compute_dataset]
    if args.vidur_network_dataset:
        cmd += [f"--{predictor}_network_profiling_dataset", args.vidur_network_dataset]
    cmd += args.vidur_args
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    result = timed(cmd, env=env, cwd=out)
    if result["returncode"] != 0:
        raise SystemExit(f"Vidur failed:\n{result['output'][-3000:]}")
    result["simulated"] = vidur_summary(out)
    return result


def vidur_summary(out: Path) -> dict:
    """Vidur's request metrics (its CSV) as the figures loom's summary gives: median TTFT and e2e
    (the CSV holds per-request durations, not arrival and completion times: no throughput)."""
    import csv
    import statistics

    found = sorted(out.rglob("request_metrics.csv"))
    if not found:
        return {}
    with found[-1].open() as f:
        rows = list(csv.DictReader(f))

    def column(name):
        return [float(r[name]) for r in rows if r.get(name) not in (None, "")]

    ttft, e2e = column("prefill_e2e_time"), column("request_e2e_time")
    return {"ttft_p50_s": statistics.median(ttft) if ttft else None,
            "e2e_p50_s": statistics.median(e2e) if e2e else None}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hardware", default="h100", help="a device of `python -m sim run --hardware`")
    p.add_argument("--model-shape", default="llama-2-7b", choices=sorted(VIDUR_MODELS))
    p.add_argument("--tp-size", type=int, default=1, help="devices per replica (tensor parallel)")
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=100_000)
    p.add_argument("--rate", type=float, default=160.0, help="Poisson arrivals per second, all replicas")
    p.add_argument("--min-len", type=int, default=256, help="shortest request (prompt + output)")
    p.add_argument("--max-len", type=int, default=2048, help="longest request (prompt + output)")
    p.add_argument("--pd-ratio", type=float, default=20.0, help="prefill:decode tokens of each request")
    p.add_argument("--global-scheduler", default="round_robin", choices=("round_robin", "lor", "random"))
    p.add_argument("--batch-size-cap", type=int, default=128, help="running requests per replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vidur-python", help="a Python with vidur installed (default: loom's simulator only)")
    p.add_argument("--vidur-cache", type=Path, help="Vidur's cache folder, its profiling data laid out inside")
    p.add_argument("--vidur-compute-dataset", help="Vidur's model profiling dataset (ORG/NAME)")
    p.add_argument("--vidur-network-dataset", help="Vidur's network profiling dataset (ORG/NAME)")
    p.add_argument("--vidur-network-device", help="Vidur's network device (default: by --hardware)")
    p.add_argument("--vidur-runs", type=int, default=2,
                   help="Vidur runs (the first trains and caches its predictor; default 2)")
    p.add_argument("--json", type=Path)
    p.add_argument("vidur_args", nargs="*", help="more Vidur flags, after --")
    args = p.parse_args(argv)
    if args.vidur_python and not args.vidur_cache:
        p.error("--vidur-python needs --vidur-cache")
    cpu = cpu_info()
    case = (f"{args.num_requests} requests, {args.replicas} replicas of {args.model_shape} on {args.tp_size}x "
            f"{args.hardware}, Poisson {args.rate:g}/s, lengths {args.min_len}-{args.max_len} (P:D {args.pd_ratio:g}), "
            f"{args.global_scheduler}, vllm batching")
    print(f"CPU: {cpu['model_name']}, {cpu['cores']} cores\n{case}", flush=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        print("== loom's simulator", flush=True)
        runs.append(("loom", run_loom(args, Path(tmp) / "loom")))
        for i in range(args.vidur_runs if args.vidur_python else 0):
            print(f"== Vidur, run {i + 1}", flush=True)
            out = Path(tmp) / f"vidur{i}"
            out.mkdir()
            runs.append((f"vidur run {i + 1}", run_vidur(args, out)))
    rows = []
    for name, r in runs:
        s = r["simulated"]
        rows.append((name, f"{r['wall_s']:.1f}", f"{r['peak_rss_mb']:.0f}",
                     *(f"{s[k] * scale:.4g}" if s.get(k) is not None else "-"
                       for k, scale in (("output_tok_s", 1), ("ttft_p50_s", 1e3), ("e2e_p50_s", 1)))))
        r.pop("output")
    print(format_table(["simulator", "wall s", "peak MB", "out tok/s", "TTFT p50 ms", "e2e p50 s"], rows))
    result = {"benchmark": "bench_sim_scale", "cpu": cpu, "case": case,
              "args": {k: str(v) for k, v in vars(args).items()}, "runs": dict(runs)}
    path = write_json(args.json or default_result_path("bench_sim_scale"), result)
    print(f"results: {path}")
    return result


if __name__ == "__main__":
    main()
