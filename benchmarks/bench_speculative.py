"""Speculative decoding: loom's `Engine` with `--speculative-algorithm ngram` against without.

Two workloads of chat requests, each at the concurrencies asked (requests sent together, greedy,
each to its own end or --max-tokens):
  copy  replies that repeat their prompt: "copy this code", "fix the typo in", "list again";
        the drafts (prompt lookup) hold often
  free  open questions whose replies share little with their prompts; the drafts rarely hold,
        so this is what speculation costs where it does not pay
Each configuration runs in its own Engine; the two alternate over --rounds rounds (a fresh
Engine each), and each figure is the median of its rounds: output tokens per second of the
requests' wall time, and for speculation the drafts proposed and kept.

    python benchmarks/bench_speculative.py
    python benchmarks/bench_speculative.py --concurrency 1,4 --rounds 3 --json /tmp/spec.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_repo_to_path, cpu_info, default_result_path, format_cpu_header, format_table, write_json

add_repo_to_path()

CODE = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n",
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
        "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n",
        "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'is even')\n    else:\n        print(i, 'is odd')\n"]
TEXT = ["The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all afternoon.",
        "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy."]
COPY = ([f"Copy this code exactly:\n{c}" for c in CODE] + [f"Rewrite this code with comments:\n{c}" for c in CODE]
        + [f"Repeat this text word for word: {t}" for t in TEXT] + [f"Fix the typos and repeat: {t}" for t in TEXT])
FREE = ["Why is the sky blue?", "Write a haiku about the sea.", "Give me three ideas for a birthday party.",
        "Explain gravity to a child.", "What should I cook for dinner tonight?", "Describe a cat in two sentences.",
        "How do plants make food?", "Name some fun things to do on a rainy day.", "What is a good name for a dog?",
        "Tell me a short story about a brave mouse."]
WORKLOADS = {"copy": COPY, "free": FREE}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,4", help="comma list of requests sent together (default: %(default)s)")
    p.add_argument("--workloads", default="copy,free", help="comma list of copy, free (default: %(default)s)")
    p.add_argument("--requests", type=int, default=8, help="requests per workload and concurrency (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=160, help="output tokens at most (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each configuration, in turn (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="(default: %(default)s)")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="--speculative-num-draft-tokens (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None,
                   help="results file (default: benchmarks/results/bench_speculative_<timestamp>.json)")
    return p.parse_args(argv)


def run_config(args, speculative: str | None) -> dict:
    """One Engine: every workload at every concurrency; tok/s and draft counts per cell."""
    from launch import Engine

    out = {}
    with Engine(dtype=args.dtype, speculative_algorithm=speculative, log_level="warning",
                speculative_num_draft_tokens=args.num_draft_tokens) as engine:
        engine.chat([{"role": "user", "content": "Hi"}], max_tokens=4)  # (warm-up)
        for name in args.workloads.split(","):
            prompts = WORKLOADS[name]
            for concurrency in map(int, args.concurrency.split(",")):
                before = engine.get_stats()
                tokens, elapsed = 0, 0.0
                for start in range(0, args.requests, concurrency):
                    group = [[{"role": "user", "content": prompts[(start + k) % len(prompts)]}]
                             for k in range(min(concurrency, args.requests - start))]
                    t = time.perf_counter()
                    replies = engine.chat(group, max_tokens=args.max_tokens, temperature=0)
                    elapsed += time.perf_counter() - t
                    tokens += sum(r["usage"]["completion_tokens"] for r in replies)
                after = engine.get_stats()
                out[f"{name}@{concurrency}"] = {
                    "tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed,
                    "drafts": after["num_draft_tokens"] - before["num_draft_tokens"],
                    "kept": after["num_accepted_tokens"] - before["num_accepted_tokens"]}
        dtype = engine.server_info.get("dtype")
    return {"cells": out, "dtype": dtype}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cpu = cpu_info()
    print("\n".join(format_cpu_header(cpu)), flush=True)
    rounds: dict[str, list[dict]] = {"off": [], "ngram": []}
    for k in range(args.rounds):
        for label in (("off", "ngram") if k % 2 == 0 else ("ngram", "off")):
            run = run_config(args, None if label == "off" else "ngram")
            rounds[label].append(run)
            print(f"round {k + 1} {label}: " + ", ".join(f"{c} {v['tok_s']:.1f} tok/s" for c, v in run["cells"].items()),
                  flush=True)
    rows, cells = [], {}
    for cell in rounds["off"][0]["cells"]:
        off = statistics.median(r["cells"][cell]["tok_s"] for r in rounds["off"])
        on = statistics.median(r["cells"][cell]["tok_s"] for r in rounds["ngram"])
        drafts = sum(r["cells"][cell]["drafts"] for r in rounds["ngram"])
        kept = sum(r["cells"][cell]["kept"] for r in rounds["ngram"])
        cells[cell] = {"off_tok_s": off, "ngram_tok_s": on, "speedup": on / off, "drafts": drafts, "kept": kept}
        rows.append([cell, f"{off:.1f}", f"{on:.1f}", f"{on / off:.2f}x", drafts,
                     f"{kept / drafts:.0%}" if drafts else "-"])
    print(f"dtype {rounds['off'][0]['dtype']}, medians of {args.rounds} rounds")
    print(format_table(["workload@concurrency", "off tok/s", "ngram tok/s", "ratio", "drafts", "kept"], rows))
    result = {"cpu": cpu, "args": vars(args), "dtype": rounds["off"][0]["dtype"], "cells": cells, "rounds": rounds}
    path = write_json(args.json or default_result_path("bench_speculative"), result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
