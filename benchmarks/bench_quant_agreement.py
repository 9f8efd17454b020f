"""Greedy agreement of the weight-only quantized paths with the unquantized one.

Runs the same chat prompts greedily (--max-tokens each, EOS honoured) through loom's `Engine`
with `--quantization none`, then each scheme in --schemes, each KV cache dtype in
--kv-cache-dtypes (unquantized weights), and with --compare-dtype the unquantized model in
another dtype, for scale; it reports per side: how many
completions are identical to the unquantized one, and the mean share of each completion that
matches it token for token before the first difference.

    python benchmarks/bench_quant_agreement.py
    python benchmarks/bench_quant_agreement.py --schemes int4 --max-tokens 128 --json out.json
    python benchmarks/bench_quant_agreement.py --schemes "" --kv-cache-dtypes int8,float16 --compare-dtype float32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a script: make the repo root and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (add_repo_to_path, cpu_info, default_result_path, format_cpu_header,  # noqa: E402
                               format_table, write_json)

add_repo_to_path()

PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "What is 17 times 23? Show your steps.",
    "Give me a short definition of entropy.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Suggest a name for a bakery and say why.",
    "Describe a cat to someone who has never seen one.",
    "What are the primary colors?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "How do I boil an egg?",
    "What does a CPU do?",
    "Name four planets of the solar system.",
    "Write a limerick about a programmer.",
]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schemes", default="fp16,int8,int4", help="comma list of quantization schemes (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per completion (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--compare-dtype", default=None, choices=["float32", "bfloat16"],
                   help="also compare the unquantized model in this dtype, for scale: how much a dtype "
                        "change alone moves greedy outputs")
    p.add_argument("--kv-cache-dtypes", default="", help="comma list of KV cache dtypes to compare too, unquantized "
                   "weights (e.g. int8,float16; default: none)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    args.kv_cache_dtypes = [s.strip() for s in args.kv_cache_dtypes.split(",") if s.strip()]
    return args


def completions(quantization: str, dtype: str, max_tokens: int, kv_cache_dtype: str = "auto"
                ) -> tuple[list[list[int]], str]:
    from launch import Engine

    params = {"max_new_tokens": max_tokens, "temperature": 0.0}
    with Engine(quantization=quantization, dtype=dtype, kv_cache_dtype=kv_cache_dtype, log_level="warning") as engine:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                        add_generation_prompt=True) for p in PROMPTS]
        outs = engine.generate(prompts, sampling_params=params)
        dtype_used = str(engine.server_info.get("dtype", dtype))
    return [o["output_ids"] for o in outs], dtype_used


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    prefix_shares = []
    for ref, out in zip(reference, other):
        same = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
        prefix_shares.append(same / max(len(ref), len(out), 1))
    identical = sum(ref == out for ref, out in zip(reference, other))
    return {"identical": identical, "completions": len(reference),
            "mean_matching_prefix": sum(prefix_shares) / len(prefix_shares)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cpu = cpu_info()
    print("\n".join(format_cpu_header(cpu)), flush=True)
    start = time.perf_counter()
    reference, dtype = completions("none", args.dtype, args.max_tokens)
    rows, results = [], {}
    for scheme in args.schemes:
        outs, _ = completions(scheme, args.dtype, args.max_tokens)
        r = agreement(reference, outs)
        results[scheme] = r
        rows.append([scheme, f"{r['identical']}/{r['completions']}", f"{100 * r['mean_matching_prefix']:.1f}%"])
    for kv_dtype in args.kv_cache_dtypes:
        outs, _ = completions("none", args.dtype, args.max_tokens, kv_dtype)
        r = agreement(reference, outs)
        results[f"kv cache {kv_dtype}"] = r
        rows.append([f"kv cache {kv_dtype}", f"{r['identical']}/{r['completions']}", f"{100 * r['mean_matching_prefix']:.1f}%"])
    if args.compare_dtype:
        outs, _ = completions("none", args.compare_dtype, args.max_tokens)
        r = agreement(reference, outs)
        results[f"none, {args.compare_dtype}"] = r
        rows.append([f"none, {args.compare_dtype}", f"{r['identical']}/{r['completions']}",
                     f"{100 * r['mean_matching_prefix']:.1f}%"])
    print(f"{len(PROMPTS)} chat prompts, greedy, up to {args.max_tokens} tokens, reference: unquantized {dtype}")
    print(format_table(["scheme", "identical completions", "mean matching prefix"], rows))
    result = {"benchmark": "bench_quant_agreement", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "cpu": cpu, "dtype": dtype, "max_tokens": args.max_tokens, "prompts": PROMPTS,
              "results": results, "wall_s": time.perf_counter() - start}
    path = write_json(args.json or default_result_path("bench_quant_agreement"), result)
    print(f"results: {path}")
    return result


if __name__ == "__main__":
    main()
