"""Offline throughput: loom's `Engine` against Hugging Face transformers' static batching.

Both sides get the same seeded requests: random regular-token prompts (input length uniform in
[--input-min, --input-max]) that each generate exactly their own output length (uniform in
[--output-min, --output-max]; greedy, EOS ignored). loom runs them all in one `generate` call
(continuous batching); the baseline runs them in request order as left-padded static batches of
--hf-batch-size, where only each request's own output tokens count ("useful" tokens: the steps a
batch spends after a request's own length are wasted). loom is shut down before the baseline
starts, so each side has every core to itself.

    python benchmarks/bench_offline.py                      # 128 requests, loom vs HF
    python benchmarks/bench_offline.py --quick              # smoke test: 8 short requests
    python benchmarks/bench_offline.py --dtype bfloat16 --hf-dtype bfloat16 --json out.json
    python benchmarks/bench_offline.py --baseline none --num-requests 256 --max-running-requests 128

Figures, CPU description and arguments go to --json (default:
benchmarks/results/bench_offline_<timestamp>.json).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (Request, add_repo_to_path, cpu_info, default_result_path, format_cpu_header,
                               format_summary, format_table, num_cores, random_requests, summarize, write_json)

add_repo_to_path()

import torch  # noqa: E402

QUICK = {"num_requests": 8, "input_min": 16, "input_max": 64, "output_min": 8, "output_max": 32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=128, help="requests (default: %(default)s)")
    w.add_argument("--seed", type=int, default=0, help="seed for lengths and prompts (default: %(default)s)")
    w.add_argument("--input-min", type=int, default=32, help="shortest prompt, tokens (default: %(default)s)")
    w.add_argument("--input-max", type=int, default=512, help="longest prompt, tokens (default: %(default)s)")
    w.add_argument("--output-min", type=int, default=16, help="shortest output, tokens (default: %(default)s)")
    w.add_argument("--output-max", type=int, default=256, help="longest output, tokens (default: %(default)s)")
    w.add_argument("--quick", action="store_true",
                   help="smoke-test preset: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
                   + " (explicit flags still win)")
    lm = p.add_argument_group("loom")
    lm.add_argument("--model-path", default=None, help="checkpoint folder (default: loom's embedded model)")
    lm.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="loom's dtype; auto times both on this CPU (default: %(default)s)")
    lm.add_argument("--kv-cache-gb", type=float, default=4.0, help="KV cache size, GiB (default: %(default)s)")
    lm.add_argument("--max-running-requests", type=int, default=64,
                    help="requests decoding at once (default: %(default)s)")
    lm.add_argument("--max-prefill-tokens", type=int, default=1024,
                    help="prompt tokens per step (default: %(default)s)")
    lm.add_argument("--log-level", default="warning", help="loom's log level (default: %(default)s)")
    b = p.add_argument_group("baseline")
    b.add_argument("--baseline", default="hf", choices=["hf", "none"],
                   help="hf: transformers static batching; none: loom only (default: %(default)s)")
    b.add_argument("--hf-batch-size", type=int, default=32, help="static batch size (default: %(default)s)")
    b.add_argument("--hf-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: the GEMM probe loom uses, i.e. the faster dtype on this CPU (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None,
                   help="result file (default: benchmarks/results/bench_offline_<timestamp>.json)")

    pre, _ = p.parse_known_args(argv)
    if pre.quick:
        p.set_defaults(**QUICK)
    return p.parse_args(argv)


# ---- loom -------------------------------------------------------------------------------------

def _progress_ticker(engine: Any, total: int, start: float, stop: threading.Event, every_s: float = 10.0) -> None:
    """Prints elapsed time and how many requests are done while the single generate call runs."""
    while not stop.wait(every_s):
        try:
            s = engine.get_stats()
            detail = (f"{total - s['num_tokenizer_requests']}/{total} done, "
                      f"{s['num_running']} running, {s['num_waiting']} waiting")
        except Exception:  # stats are a nicety; never let them disturb the run
            detail = "running"
        print(f"  loom: {time.perf_counter() - start:6.1f} s  {detail}", flush=True)


def run_loom(engine: Any, requests: list[Request]) -> dict[str, Any]:
    params = [{"max_new_tokens": r.output_len, "ignore_eos": True, "temperature": 0.0} for r in requests]
    warm = [[100 + i for i in range(8)], [200 + i for i in range(12)]]
    engine.generate(input_ids=warm, sampling_params={"max_new_tokens": 4, "ignore_eos": True, "temperature": 0.0})

    print(f"loom: generating {len(requests)} requests in one call ...", flush=True)
    stop = threading.Event()
    start = time.perf_counter()
    ticker = threading.Thread(target=_progress_ticker, args=(engine, len(requests), start, stop), daemon=True)
    ticker.start()
    try:
        outs = engine.generate(input_ids=[r.input_ids for r in requests], sampling_params=params)
    finally:
        wall = time.perf_counter() - start
        stop.set()
        ticker.join()
    print(f"loom: done in {wall:.2f} s", flush=True)

    stats = engine.get_stats()
    meta = [o["meta_info"] for o in outs]
    short = [(i, m["completion_tokens"], r.output_len) for i, (m, r) in enumerate(zip(meta, requests))
             if m["completion_tokens"] != r.output_len]
    if short:
        print(f"WARNING: {len(short)} loom requests did not generate their output length "
              f"(index, got, wanted): {short[:5]}", file=sys.stderr)
    out_tokens = sum(m["completion_tokens"] for m in meta)
    in_tokens = sum(m["prompt_tokens"] for m in meta)
    return {
        "wall_s": wall,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (in_tokens + out_tokens) / wall,
        "e2e_latency_s": summarize(m["e2e_latency"] for m in meta),
        "ttft_s": summarize(m["ttft"] for m in meta),
        "finish_reasons": sorted({(m["finish_reason"] or {}).get("type", "?") for m in meta}),
        "length_mismatches": len(short),
        "num_retractions": stats.get("num_retractions"),
        "scheduler_steps": stats.get("step"),
    }


# ---- Hugging Face baseline --------------------------------------------------------------------

def run_hf(model_dir: Path, tokenizer: Any, requests: list[Request], dtype: torch.dtype,
           batch_size: int) -> dict[str, Any]:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def generate(batch: list[Request]) -> int:
        """One left-padded static batch, run to its longest output; returns the steps it ran."""
        width, steps = max(r.input_len for r in batch), max(r.output_len for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - r.input_len:] = torch.tensor(r.input_ids)
            mask[row, width - r.input_len:] = 1
        # min_new_tokens == max_new_tokens keeps EOS from ending any row early.
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, pad_token_id=pad_id)
        generated = out.shape[1] - width
        if generated != steps:
            raise RuntimeError(f"HF generated {generated} steps for a batch that needs {steps}")
        return generated

    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    with torch.inference_mode():
        generate([Request([100 + i for i in range(8)], 4), Request([200 + i for i in range(12)], 4)])  # warm-up
        start = time.perf_counter()
        computed = 0
        for batch in tqdm(batches, desc="hf batches", unit="batch"):
            computed += generate(batch) * len(batch)
        wall = time.perf_counter() - start

    useful = sum(r.output_len for r in requests)
    in_tokens = sum(r.input_len for r in requests)
    return {
        "wall_s": wall,
        "input_tokens": in_tokens,
        "output_tokens": useful,
        "computed_output_tokens": computed,
        "output_tok_s": useful / wall,
        "total_tok_s": (in_tokens + useful) / wall,
        "computed_output_tok_s": computed / wall,
        "batch_size": batch_size,
        "num_batches": len(batches),
    }


# ---- main -------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from launch import Engine
    from worker_proc.dtype_probe import resolve_dtype

    threads = num_cores()
    torch.set_num_threads(threads)
    cpu = cpu_info()

    # Probe the baseline's dtype first, while no loom process is busy on the cores.
    hf_dtype, hf_dtype_reason = (resolve_dtype(args.hf_dtype) if args.baseline == "hf" else (None, "no baseline"))

    engine = Engine(dtype=args.dtype, model_path=args.model_path, kv_cache_gb=args.kv_cache_gb,
                    max_running_requests=args.max_running_requests, max_prefill_tokens=args.max_prefill_tokens,
                    log_level=args.log_level)
    try:
        tokenizer, model_dir, info = engine.tokenizer, Path(engine.model_dir), engine.server_info
        hf_dtype_name = str(hf_dtype).removeprefix("torch.") if hf_dtype is not None else "-"
        print("\n".join([
            "=" * 78,
            *format_cpu_header(cpu),
            f"torch      {torch.__version__}, {torch.get_num_threads()} threads here, "
            f"{info.get('threads', '?')} in loom's worker",
            f"model      {model_dir}",
            f"loom       {info['dtype']}  ({info.get('dtype_reason', '')})",
            f"hf         {hf_dtype_name}  ({hf_dtype_reason})",
            "=" * 78,
        ]), flush=True)

        requests = random_requests(tokenizer, args.num_requests, (args.input_min, args.input_max),
                                   (args.output_min, args.output_max), args.seed)
        print(f"workload: {len(requests)} requests, seed {args.seed}, "
              f"{sum(r.input_len for r in requests)} input + {sum(r.output_len for r in requests)} output tokens "
              f"(input {args.input_min}-{args.input_max}, output {args.output_min}-{args.output_max})", flush=True)

        loom = {"dtype": info["dtype"], **run_loom(engine, requests)}
    finally:
        engine.shutdown()  # frees the cores before the baseline runs

    print(f"loom: {loom['output_tok_s']:.1f} output tok/s, {loom['total_tok_s']:.1f} total tok/s")
    print(format_summary("  e2e", loom["e2e_latency_s"]))
    print(format_summary("  ttft", loom["ttft_s"]), flush=True)

    hf: dict[str, Any] | None = None
    if args.baseline == "hf":
        print(f"hf: {len(requests)} requests in static batches of {args.hf_batch_size} ({hf_dtype_name}) ...",
              flush=True)
        hf = {"dtype": hf_dtype_name, "dtype_reason": hf_dtype_reason,
              **run_hf(model_dir, tokenizer, requests, hf_dtype, args.hf_batch_size)}
        print(f"hf: {hf['output_tok_s']:.1f} useful output tok/s "
              f"({hf['computed_output_tok_s']:.1f} computed, {hf['output_tokens']}/{hf['computed_output_tokens']} "
              f"useful), {hf['total_tok_s']:.1f} total tok/s", flush=True)

    rows = [["loom", loom["dtype"], f"{loom['wall_s']:.2f}", f"{loom['output_tok_s']:.1f}"]]
    if hf is not None:
        rows.append(["hf (useful)", hf["dtype"], f"{hf['wall_s']:.2f}", f"{hf['output_tok_s']:.1f}"])
    print("\n" + format_table(["side", "dtype", "wall s", "output tok/s"], rows))
    ratio = loom["output_tok_s"] / hf["output_tok_s"] if hf is not None else None
    if ratio is not None:
        print(f"ratio loom/hf: {ratio:.2f}x")

    result = {
        "benchmark": "bench_offline",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cpu": cpu,
        "torch": {"version": torch.__version__, "threads": threads, "loom_worker_threads": info.get("threads")},
        "model_dir": str(model_dir),
        "loom_server_info": info,
        "workload": {"num_requests": len(requests),
                     "input_tokens": sum(r.input_len for r in requests),
                     "output_tokens": sum(r.output_len for r in requests),
                     "input_lens": [r.input_len for r in requests],
                     "output_lens": [r.output_len for r in requests]},
        "loom": loom,
        "hf": hf,
        "ratio_loom_over_hf": ratio,
    }
    path = write_json(args.json or default_result_path("bench_offline"), result)
    print(f"results: {path}")
    return result


if __name__ == "__main__":
    main()
