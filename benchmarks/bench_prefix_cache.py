"""The prefix cache side by side in one run, a launch.py server per configuration, one after the
other, each under bench_serving's load (every request at once):

  1. shared prompt: 64 requests sharing a 1,000-token system prompt, each with a 32-token
     question, 64 output tokens: the cache on against --disable-radix-cache (throughput, TTFT);
  2. queue order: 8 interleaved prefix groups (16 requests each, 400-token system prompts) under
     a full queue (--max-running-requests 16) and a KV pool too small to keep every prefix:
     --schedule-policy lpm against fcfs (cache hit rate, throughput);
  3. chat: a 4-turn replay of 16 conversations (64-token user turns, 64-token replies; each
     turn's prompt the conversation so far): TTFT per turn with the cache and without.

    python benchmarks/bench_prefix_cache.py
    python benchmarks/bench_prefix_cache.py --parts shared,chat
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a script: make the repo root and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (add_repo_to_path, default_result_path, format_table, wait_healthy,  # noqa: E402
                               write_json)
from benchmarks.probes import describe_machine, header_lines  # noqa: E402

add_repo_to_path()
ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="shared,order,chat", help="comma list (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--port", type=int, default=30900)
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiplies every request count (0.25: a quick run; default: %(default)s)")
    p.add_argument("--json", type=Path, default=None,
                   help="result file (default: benchmarks/results/bench_prefix_cache_<timestamp>.json)")
    return p.parse_args(argv)


def serve_and_load(args, server_flags: list[str], client_flags: list[str], label: str) -> dict[str, Any]:
    """Starts a server with `server_flags`, runs bench_serving with `client_flags` against it."""
    from benchmarks import bench_serving
    from worker_proc.model_loader import ensure_default_model

    server = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "--port", str(args.port), "--zmq-port", "0",
                               "--dtype", args.dtype, "--log-level", "warning", *server_flags], cwd=str(ROOT))
    try:
        wait_healthy(server, f"http://127.0.0.1:{args.port}/health", "loom server")
        out = bench_serving.run_benchmark(bench_serving.parse_args([
            "--backend", "loom", "--port", str(args.port), "--tokenizer", str(ensure_default_model()), "--no-probe",
            "--no-output-file", "--disable-tqdm", "--warmup-requests", "0", "--label", label, *client_flags]))
    finally:
        server.terminate()
        server.wait(30)
    before, after = out["server_stats_before"], out["server_stats_after"]
    prompt = after["num_prompt_tokens"] - before["num_prompt_tokens"]
    cached = after["num_cached_prompt_tokens"] - before["num_cached_prompt_tokens"]
    return {"label": label, "output_tok_s": out["output_throughput"], "ttft_p50_ms": out["median_ttft_ms"],
            "completed": out["completed"], "hit_rate": cached / prompt if prompt else 0.0,
            "ttft_by_turn": [t["ttft_ms"]["median"] for t in out["ttft_by_turn"]]}


def n(args, count: int) -> str:
    return str(max(1, round(count * args.scale)))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",")]
    machine = describe_machine()
    print("\n".join(header_lines(machine, {"loom": args.dtype}, [f"parts      {args.parts}"])), flush=True)
    results: dict[str, Any] = {}
    if "shared" in parts:
        load = ["--dataset", "generated-shared-prefix", "--gsp-num-groups", "1", "--gsp-prompts-per-group",
                n(args, 64), "--gsp-system-prompt-len", "1000", "--gsp-question-len", "32", "--gsp-output-len", "64"]
        server = ["--max-running-requests", "64", "--kv-cache-gb", "4"]
        results["shared"] = [serve_and_load(args, server, load, "cache"),
                             serve_and_load(args, server + ["--disable-radix-cache"], load, "no cache")]
    if "order" in parts:
        load = ["--dataset", "generated-shared-prefix", "--gsp-num-groups", "8", "--gsp-prompts-per-group",
                n(args, 16), "--gsp-system-prompt-len", "400", "--gsp-question-len", "32", "--gsp-output-len", "32"]
        server = ["--max-running-requests", "16", "--kv-cache-gb", "0.3"]
        results["order"] = [serve_and_load(args, server + ["--schedule-policy", policy], load, policy)
                            for policy in ("lpm", "fcfs")]
    if "chat" in parts:
        load = ["--dataset", "multi-turn", "--num-prompts", n(args, 16), "--mt-turns", "4", "--mt-user-len", "64",
                "--mt-output-len", "64"]
        server = ["--max-running-requests", "16", "--kv-cache-gb", "2"]
        results["chat"] = [serve_and_load(args, server, load, "cache"),
                           serve_and_load(args, server + ["--disable-radix-cache"], load, "no cache")]

    rows = []
    for part, sides in results.items():
        first = sides[0]
        for side in sides:
            turns = " / ".join(f"{t:.0f}" for t in side["ttft_by_turn"]) if side["ttft_by_turn"] else ""
            rows.append([part, side["label"], f"{side['output_tok_s']:.1f}",
                         f"{side['output_tok_s'] / sides[-1]['output_tok_s']:.2f}x" if side is first else "",
                         f"{side['ttft_p50_ms']:.0f}",
                         f"{sides[-1]['ttft_p50_ms'] / side['ttft_p50_ms']:.1f}x" if side is first else "",
                         f"{100 * side['hit_rate']:.1f}%", turns])
    print(format_table(["part", "side", "out tok/s", "vs other", "TTFT p50 ms", "lower by", "hit rate",
                        "TTFT p50 per turn ms"], rows))
    out = {"benchmark": "bench_prefix_cache", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "args": vars(args), "machine": machine, "results": results}
    path = write_json(args.json or default_result_path("bench_prefix_cache"), out)
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
