"""Block-diffusion scheduling: sync vs FDFO vs FDFO + in-place reuse, side by side in one run.

The model is a random-weight block-diffusion Qwen3 built at start (no hub here): --hidden-size,
--num-layers, a 4096-token vocabulary whose last id is the mask, its LM head scaled by
--lm-head-scale so the top-token confidences spread around --dllm-threshold (a block takes from
one round to block_size rounds, varying by prompt and position, as with a trained model whose
confidence depends on the text). The tokenizer is the embedded model's (ids below 4096 decode).

Workload (mixed difficulty, seeded, the same for every mode): --num-requests requests submitted
at once; prompt lengths uniform in [16, 96] tokens (random ids, so the first block is shared
with 0..block_size-1 prompt tokens); three quarters are short answers (1 to 2 x block_size
tokens: one or two blocks, some of them easy because the prompt fills most of the first block),
one quarter long ones (4 to 8 blocks). Greedy, EOS ignored: every request makes exactly its
length, in every mode. Per block, the number of rounds depends on the model's confidence.

Modes (one Engine each, per --max-running value):
  sync       --no-dllm-fdfo: a step runs rounds until every block of the batch is done.
  fdfo       --dllm-fdfo --no-dllm-in-place: every round returns to the scheduler; finished
             blocks commit and stream at once and free room for waiting requests; unfinished
             blocks free their KV and allocate it again next round.
  fdfo+ip    --dllm-fdfo --dllm-in-place: unfinished blocks keep their slots; rounds that finish
             no block re-loop in the worker without a scheduler round-trip.
Reported: output tok/s over the whole run, request latency p50/p99 (submission to last token),
forward rounds, the blocks they computed (block-rounds: each round's work is its blocks), ms per
round, scheduler steps, and each mode against the first: throughput, and rounds saved (first's
rounds / this one's). Where a round's cost is flat in its batch (a memory-bound accelerator),
time follows rounds; where it grows with the blocks in it (a compute-bound CPU), time follows
block-rounds, which FDFO does not reduce: it removes the rounds that straggling blocks run
nearly alone, and those are the cheap ones.

    python benchmarks/bench_dllm.py                         # the full comparison (max running 4 and 16)
    python benchmarks/bench_dllm.py --quick                 # smoke test: a tiny model, 8 requests
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (add_repo_to_path, cpu_info, default_result_path, format_cpu_header, format_table,
                               summarize, write_json)

add_repo_to_path()

import numpy as np  # noqa: E402
import torch  # noqa: E402

VOCAB = 4096
MASK = VOCAB - 1
MODES = {
    "sync": dict(dllm_fdfo=False),
    "fdfo": dict(dllm_fdfo=True, dllm_in_place=False),
    "fdfo+ip": dict(dllm_fdfo=True, dllm_in_place=True),
}


def build_model(out: Path, hidden: int, layers: int, lm_head_scale: float, block_size: int) -> Path:
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from worker_proc.model_loader import ensure_default_model

    heads = max(hidden // 64, 2)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), head_dim=64,
                         max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(str(out), safe_serialization=True)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["lm_head.weight"] *= lm_head_scale
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(mask_token_id=MASK, block_size=block_size)
    (out / "config.json").write_text(json.dumps(cfg))
    for f in Path(ensure_default_model()).iterdir():  # a tokenizer for the server (ids < VOCAB decode)
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


HEADER = ["max running", "mode", "tok/s", "p50 s", "p99 s", "rounds", "block-rounds", "ms/round", "steps",
          "tok/s vs first", "rounds saved"]


def workload(n: int, block: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request: see the module docstring."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(3, MASK, int(rng.integers(16, 97))).tolist()
        long = i % 4 == 3
        length = int(rng.integers(4 * block, 8 * block + 1)) if long else int(rng.integers(1, 2 * block + 1))
        out.append((prompt, length))
    return out


def run_mode(model: Path, mode: str, max_running: int, requests, args) -> dict:
    from launch import Engine

    with Engine(model_path=str(model), dtype="float32", kv_cache_gb=args.kv_cache_gb, log_level="warning",
                max_running_requests=max_running, dllm_algorithm=args.dllm_algorithm,
                dllm_threshold=args.dllm_threshold, page_size=args.block_size, disable_radix_cache=True,
                **MODES[mode]) as engine:
        engine.generate(input_ids=requests[0][0], sampling_params=dict(max_new_tokens=1, temperature=0))  # warm-up
        before = engine.get_stats()

        async def one(prompt, length, t0):
            out = await engine.async_generate(input_ids=prompt, sampling_params=dict(
                max_new_tokens=length, temperature=0.0, ignore_eos=True))
            return time.perf_counter() - t0, len(out["output_ids"])

        async def burst():
            t0 = time.perf_counter()
            results = await asyncio.gather(*(one(p, n, t0) for p, n in requests))
            return results, time.perf_counter() - t0

        results, wall = asyncio.run(burst())
        after = engine.get_stats()
    latencies = [r[0] for r in results]
    tokens = sum(r[1] for r in results)
    assert tokens == sum(n for _, n in requests), "every request makes exactly its length"
    counts = {k: after[k] - before[k] for k in ("dllm_steps", "dllm_rounds", "dllm_block_rounds",
                                                 "dllm_blocks_committed")}
    return {"mode": mode, "max_running": max_running, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "latency": summarize(latencies), **counts}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-running", type=str, default="4,16", help="comma list of --max-running-requests values")
    p.add_argument("--modes", type=str, default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--lm-head-scale", type=float, default=4.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dllm-algorithm", type=str, default="low_confidence")
    p.add_argument("--dllm-threshold", type=float, default=0.9)
    p.add_argument("--kv-cache-gb", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke test: a tiny model, 8 requests, max running 4")
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.max_running, args.hidden_size, args.num_layers = 8, "4", 128, 2
        args.block_size = 8
    requests = workload(args.num_requests, args.block_size, args.seed)
    rows, runs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp), args.hidden_size, args.num_layers, args.lm_head_scale, args.block_size)
        for max_running in [int(x) for x in args.max_running.split(",")]:
            base = None
            for mode in args.modes.split(","):
                r = run_mode(model, mode, max_running, requests, args)
                runs.append(r)
                base = base or r
                rows.append([max_running, mode, f"{r['tok_s']:.1f}", f"{r['latency']['p50']:.2f}",
                             f"{r['latency']['p99']:.2f}", r["dllm_rounds"], r["dllm_block_rounds"],
                             f"{1e3 * r['wall_s'] / r['dllm_rounds']:.1f}", r["dllm_steps"],
                             f"{r['tok_s'] / base['tok_s']:.2f}x", f"{base['dllm_rounds'] / r['dllm_rounds']:.2f}x"])
                print(format_table(HEADER, rows[-1:]), flush=True)
    info = cpu_info()
    print("\n".join(format_cpu_header(info)))
    print(f"{args.num_requests} requests, block {args.block_size}, {args.dllm_algorithm} threshold "
          f"{args.dllm_threshold}, model hidden {args.hidden_size} x {args.num_layers} layers")
    print(format_table(HEADER, rows))
    path = write_json(Path(args.json) if args.json else default_result_path("bench_dllm"),
                      {"cpu": info, "args": vars(args), "runs": runs})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
