"""Head-of-line blocking: FIFO admission against pack + force-fifo-every, side by side in one run.

For each configuration it starts a loom server, runs bench_serving's head-of-line workload
(prompts cycling 512,1,1,1 x a short prompt, every request at once), stops the server, and prints
TTFT per configuration, overall and for the short and long prompts, with the change vs FIFO.
The report starts with the CPU and probes of its GEMM and GEMV limits (benchmarks/probes.py),
measured once before any server starts.

    python benchmarks/bench_admission.py                   # 128 requests, budget 256, 32 out
    python benchmarks/bench_admission.py --num-prompts 32 --output-len 8     # quicker
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_serving import parse_args, run_benchmark  # noqa: E402
from benchmarks.common import default_result_path, format_table, wait_healthy  # noqa: E402
from benchmarks.probes import PROBE_DTYPES, header_lines, probe_machine  # noqa: E402

CONFIGS = {
    "fifo": ["--prefill-admission-policy", "fifo"],
    "pack+force8": ["--prefill-admission-policy", "pack", "--force-fifo-every", "8"],
}


def start_server(port: int, extra: list[str], args) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "launch.py"), "--port", str(port), "--zmq-port", "0", "--log-level", "warning",
           "--dtype", args.dtype, "--max-prefill-tokens", str(args.budget), "--chunked-prefill-size",
           str(args.budget), *args.server_args.split(), *extra]
    proc = subprocess.Popen(cmd, cwd=str(ROOT))
    wait_healthy(proc, f"http://127.0.0.1:{port}/health", f"server ({' '.join(cmd)})", timeout_s=600)
    return proc


def ttft_row(name: str, result: dict, base: dict | None) -> list[str]:
    groups = result["by_input_len"]
    long = max(groups, key=lambda g: g["input_len"])
    short = [g for g in groups if g is not long]
    short_p99 = max(g["ttft_ms"]["p99"] for g in short) if short else None
    cells = [result["p99_ttft_ms"], result["mean_ttft_ms"], short_p99, long["ttft_ms"]["p99"]]
    dtype = (result.get("server_info") or {}).get("dtype", "?")
    row = [name, dtype] + [f"{c:.0f}" if c is not None else "n/a" for c in cells]
    if base is not None:
        change = (result["p99_ttft_ms"] / base["p99_ttft_ms"] - 1) * 100
        row.append(f"{change:+.0f}%")
    else:
        row.append("")
    row.append(f"{result['output_throughput']:.1f}")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--prompt-repeats", default="512,1,1,1")
    p.add_argument("--hol-short-len", type=int, default=1)
    p.add_argument("--budget", type=int, default=256, help="--max-prefill-tokens and --chunked-prefill-size")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--server-args", default="--max-running-requests 128",
                   help="more launch.py flags for both servers (default: %(default)s, so every request is "
                        "admitted by the scheduler, not held back by request slots)")
    p.add_argument("--port", type=int, default=30500)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--no-kernel-probe", action="store_true",
                   help="probe GEMV with torch only, not loom's kernel (which may compile the first time)")
    args = p.parse_args()

    # Before any server starts: the probes get the cores to themselves.
    machine = probe_machine(PROBE_DTYPES, kernel=not args.no_kernel_probe)
    configs = "; ".join(f"{name}: {' '.join(extra)}" for name, extra in CONFIGS.items())
    print("\n".join(header_lines(machine, {"servers": f"--dtype {args.dtype} (each server's choice: table below)"},
                                  [f"configs    {configs}; budget {args.budget}"])), flush=True)

    results: dict[str, dict] = {}
    for i, (name, extra) in enumerate(CONFIGS.items()):
        port = args.port + i
        print(f"== {name}: launch.py {' '.join(extra)} (budget {args.budget})", flush=True)
        server = start_server(port, extra, args)
        try:
            bench_args = parse_args([
                "--port", str(port), "--dataset", "head-of-line", "--prompt-repeats", args.prompt_repeats,
                "--hol-short-len", str(args.hol_short_len), "--random-output-len", str(args.output_len),
                "--num-prompts", str(args.num_prompts), "--label", name, "--no-output-file", "--no-probe"])
            results[name] = run_benchmark(bench_args)
        finally:
            server.terminate()
            server.wait(30)
    base = results["fifo"]
    rows = [ttft_row(name, r, base if name != "fifo" else None) for name, r in results.items()]
    print()
    print(format_table(["admission", "dtype", "TTFT p99 ms", "TTFT mean ms", "short p99 ms", "long p99 ms",
                        "p99 vs fifo", "out tok/s"], rows))
    out = args.json or default_result_path("bench_admission")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "machine": machine,
                               "results": results}, indent=1, default=str))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
