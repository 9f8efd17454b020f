"""Offline throughput: loom's `Engine` against baselines on the same requests.

Every side gets the same seeded requests: random regular-token prompts (input length uniform in
[--input-min, --input-max]) that each generate exactly their own output length (uniform in
[--output-min, --output-max]; greedy, EOS ignored). loom runs them all in one `generate` call
(continuous batching). Baselines (--baseline, a comma list):

  hf        transformers' static batching: left-padded batches of --hf-batch-size in request
            order; only each request's own output tokens count ("useful" tokens: the steps a
            batch spends after a request's own length are wasted).
  hf-cb     transformers' continuous batching (the manager behind `generate_batch`).
            `generate_batch` takes one max_new_tokens for all requests, so each request is
            submitted to that same manager with its own max_new_tokens and EOS disabled: the
            work is exactly loom's. It gets loom's KV memory (--kv-cache-gb), requests per batch
            (--max-running-requests) and tokens per step (--max-prefill-tokens + one decode per
            request).
  llamacpp  llama.cpp (llama-cpp-python, when installed) on the model's GGUF file (the embedded
            model's Q4_1 file by default), one request at a time, n_threads = cores, greedy with
            its own sampler; its generate loop never stops at EOS, so each request runs to its
            own length.
  llamacpp-if-installed   llamacpp where llama_cpp imports, else nothing.
  vllm      vLLM's CPU engine (`LLM.generate`, all requests in one call, each with its own
            max_tokens, EOS ignored, greedy) on loom's checkpoint folder. vLLM lives in its own
            environment (--vllm-python; docs/benchmarks.md says how to install it), so
            benchmarks/vllm_offline_worker.py runs it there; only its generate call is timed.
            It gets loom's KV memory, requests at once and tokens per step (as hf-cb), its
            compute threads bound to --vllm-omp-threads-bind, and tcmalloc and Intel OpenMP
            preloaded as vLLM's CPU guide advises (where found; the header says which).
  vllm-if-installed       vllm where --vllm-python imports vllm, else a line saying why not.
  none      loom only.

hf and hf-cb run in --hf-dtype (auto: loom's GEMM probe picks the faster dtype on this CPU);
llama.cpp runs its GGUF's own format; vLLM runs --vllm-dtype. loom is shut down before the
baselines start and each baseline frees its model before the next, so each side has every core
to itself. The report starts with the CPU and probes of its GEMM and GEMV limits
(benchmarks/probes.py). With --rounds N and the vllm baseline, loom and vLLM run N times in
turn and the loom/vllm ratio is the median of the rounds' (this VM's speed moves by 5-10% over
the minutes of one run of each).

    python benchmarks/bench_offline.py                      # 128 requests, loom vs every baseline
    python benchmarks/bench_offline.py --quick              # smoke test: 8 short requests
    python benchmarks/bench_offline.py --quick --baseline hf-cb,llamacpp
    python benchmarks/bench_offline.py --baseline vllm --vllm-python ~/vllm-venv/bin/python
    python benchmarks/bench_offline.py --num-requests 256 --baseline vllm --rounds 3
    python benchmarks/bench_offline.py --dtype bfloat16 --hf-dtype bfloat16 --json out.json
    python benchmarks/bench_offline.py --baseline none --num-requests 256 --max-running-requests 128

Figures, machine description and arguments go to --json (default:
benchmarks/results/bench_offline_<timestamp>.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (ROOT, Request, add_repo_to_path, add_vllm_args, cpu_info,
                               default_result_path, default_vllm_python, embedded_gguf, format_summary, format_table,
                               gguf_format, llama_cpp_installed, log_tail, measure_rounds, num_cores, random_requests,
                               summarize, vllm_engine_args, vllm_env, vllm_preloads, vllm_version, write_json)
from benchmarks.probes import PROBE_DTYPES, header_lines, probe_machine

add_repo_to_path()

import torch  # noqa: E402

from worker_proc.kv_cache import KV_CACHE_DTYPES  # noqa: E402
from worker_proc.linear import QUANTIZATIONS  # noqa: E402

QUICK = {"num_requests": 8, "input_min": 16, "input_max": 64, "output_min": 8, "output_max": 32}
BASELINES = ("hf", "hf-cb", "llamacpp", "vllm")


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
    lm.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                    help="loom's weight quantization, as launch.py (default: %(default)s)")
    lm.add_argument("--kv-cache-dtype", default="auto", choices=("auto", *KV_CACHE_DTYPES),
                    help="loom's KV cache dtype, as launch.py (default: %(default)s)")
    lm.add_argument("--kv-cache-gb", type=float, default=4.0, help="KV cache size, GiB (default: %(default)s)")
    lm.add_argument("--max-running-requests", type=int, default=64,
                    help="requests decoding at once (default: %(default)s)")
    lm.add_argument("--max-prefill-tokens", type=int, default=1024,
                    help="prompt tokens per step (default: %(default)s)")
    lm.add_argument("--log-level", default="warning", help="loom's log level (default: %(default)s)")
    b = p.add_argument_group("baseline")
    b.add_argument("--baseline", default="hf,hf-cb,llamacpp-if-installed,vllm-if-installed",
                   help="comma list of hf (transformers static batching), hf-cb (transformers continuous "
                        "batching), llamacpp (llama-cpp-python), llamacpp-if-installed, vllm (vLLM's CPU "
                        "engine), vllm-if-installed, or none (default: %(default)s)")
    b.add_argument("--hf-batch-size", type=int, default=32, help="static batch size (default: %(default)s)")
    b.add_argument("--hf-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="hf and hf-cb; auto: the GEMM probe loom uses, i.e. the faster dtype on this CPU "
                        "(default: %(default)s)")
    b.add_argument("--llamacpp-gguf", type=Path, default=None,
                   help="GGUF file for llamacpp (default: the embedded model's; needed with --model-path)")
    add_vllm_args(b)
    p.add_argument("--rounds", type=int, default=1,
                   help="with the vllm baseline: run loom's Engine and vLLM this many times in turn (every other "
                        "round vLLM first); the loom/vllm ratio is the median of the rounds' (default: %(default)s)")
    p.add_argument("--no-kernel-probe", action="store_true",
                   help="probe GEMV with torch only (loom's kernel may compile for a minute the first time)")
    p.add_argument("--json", type=Path, default=None,
                   help="result file (default: benchmarks/results/bench_offline_<timestamp>.json)")

    pre, _ = p.parse_known_args(argv)
    if pre.quick:
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    try:
        args.baselines = parse_baselines(args.baseline, args.vllm_python)
    except ValueError as e:
        p.error(str(e))
    return args



def parse_baselines(text: str, vllm_python: str | None = None) -> list[str]:
    """The --baseline comma list, in the canonical order, without duplicates. vllm is checked by
    importing it with `vllm_python` (default: default_vllm_python())."""
    chosen: set[str] = set()
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if item == "none":
            continue
        if item == "llamacpp-if-installed":
            if llama_cpp_installed():
                chosen.add("llamacpp")
        elif item == "vllm-if-installed":
            version, why = vllm_version(vllm_python or default_vllm_python())
            if version is not None:
                chosen.add("vllm")
            else:
                print(f"vllm baseline skipped: {why}", flush=True)
        elif item in BASELINES:
            if item == "llamacpp" and not llama_cpp_installed():
                raise ValueError("--baseline llamacpp: llama_cpp is not installed (pip install llama-cpp-python)")
            if item == "vllm" and (why := vllm_version(vllm_python or default_vllm_python())[1]):
                raise ValueError(f"--baseline vllm: {why}")
            chosen.add(item)
        else:
            raise ValueError(f"--baseline: unknown {item!r}; choose from {', '.join(BASELINES)}, "
                             "llamacpp-if-installed, vllm-if-installed, none")
    return [b for b in BASELINES if b in chosen]


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


def throughput(wall: float, input_tokens: int, output_tokens: int) -> dict[str, Any]:
    """The figures every side reports: tokens and tokens per second over the wall time."""
    return {"wall_s": wall, "input_tokens": input_tokens, "output_tokens": output_tokens,
            "output_tok_s": output_tokens / wall, "total_tok_s": (input_tokens + output_tokens) / wall}


def run_loom(engine: Any, requests: list[Request]) -> dict[str, Any]:
    params = [{"max_new_tokens": r.output_len, "ignore_eos": True, "temperature": 0.0} for r in requests]
    warm = [[100 + i for i in range(8)], [200 + i for i in range(12)]]
    engine.generate(input_ids=warm, sampling_params={"max_new_tokens": 4, "ignore_eos": True, "temperature": 0.0})

    before = engine.get_stats()
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
        **throughput(wall, in_tokens, out_tokens),
        "e2e_latency_s": summarize(m["e2e_latency"] for m in meta),
        "ttft_s": summarize(m["ttft"] for m in meta),
        "finish_reasons": sorted({(m["finish_reason"] or {}).get("type", "?") for m in meta}),
        "length_mismatches": len(short),
        "num_retractions": stats.get("num_retractions"),
        "scheduler_steps": stats.get("step"),
        # the worker's forward time over forward plus its gaps while work was queued
        "busy_fraction": _busy_fraction(before, stats),
    }


def _busy_fraction(before: dict, after: dict) -> float | None:
    forward = after["forward_seconds"] - before["forward_seconds"]
    gap = after["worker_gap_seconds"] - before["worker_gap_seconds"]
    return forward / (forward + gap) if forward + gap else None


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
        **throughput(wall, in_tokens, useful),
        "computed_output_tokens": computed,
        "computed_output_tok_s": computed / wall,
        "batch_size": batch_size,
        "num_batches": len(batches),
    }


def run_hf_cb(model_dir: Path, requests: list[Request], dtype: torch.dtype, kv_cache_gb: float,
              max_running_requests: int, max_prefill_tokens: int) -> dict[str, Any]:
    """transformers' continuous batching, each request with its own max_new_tokens and no EOS."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    page_size = 256  # transformers' default
    # A block holds page_size tokens of K and V for every layer. Left to itself on CPU the cache
    # would size itself from total RAM; give it loom's KV budget instead.
    block_bytes = page_size * 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * dtype.itemsize
    cb_config = ContinuousBatchingConfig(
        page_size=page_size, num_blocks=max(1, int(kv_cache_gb * 2**30) // block_bytes),
        max_requests_per_batch=max_running_requests,
        max_batch_tokens=max_prefill_tokens + max_running_requests)  # loom's prompt budget + one decode each
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in requests),
                                  eos_token_id=-1)  # -1: no EOS (per request too, below)
    hints = WorkloadHints(max_prompt_length=max(r.input_len for r in requests),
                          max_generated_length=max(r.output_len for r in requests), num_requests=len(requests))

    def generate(manager: Any, batch: list[Request], prefix: str, bar: Any = None) -> dict[str, Any]:
        for i, r in enumerate(batch):
            manager.add_request(r.input_ids, request_id=f"{prefix}{i}", max_new_tokens=r.output_len, eos_token_id=-1)
        done: dict[str, Any] = {}
        while len(done) < len(batch):
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped")
            elif out.is_finished():
                done[out.request_id] = out
                if bar is not None:
                    bar.update(1)
        return done

    with torch.no_grad(), model.continuous_batching_context_manager(
            generation_config=gen_config, continuous_batching_config=cb_config, workload_hints=hints,
            block=True, timeout=60) as manager:
        generate(manager, [Request([100 + i for i in range(8)], 4), Request([200 + i for i in range(12)], 4)], "warm")
        with tqdm(total=len(requests), desc="hf-cb requests", unit="req") as bar:
            start = time.perf_counter()
            outs = generate(manager, requests, "req", bar)
            wall = time.perf_counter() - start
    del model
    gc.collect()

    got = [len(outs[f"req{i}"].generated_tokens) for i in range(len(requests))]
    errors = [o.error for o in outs.values() if o.error is not None]
    short = [(i, n, r.output_len) for i, (n, r) in enumerate(zip(got, requests)) if n != r.output_len]
    if short or errors:
        print(f"WARNING: hf-cb: {len(short)} requests did not generate their output length (index, got, wanted): "
              f"{short[:5]}; {len(errors)} errors {errors[:2]}", file=sys.stderr)
    # Only tokens each request asked for count, should one have run long.
    useful = sum(min(n, r.output_len) for n, r in zip(got, requests))
    in_tokens = sum(r.input_len for r in requests)
    return {
        **throughput(wall, in_tokens, useful),
        "length_mismatches": len(short),
        "errors": len(errors),
        "config": {"page_size": cb_config.page_size, "num_blocks": cb_config.num_blocks,
                   "max_requests_per_batch": cb_config.max_requests_per_batch,
                   "max_batch_tokens": cb_config.max_batch_tokens},
    }


# ---- llama.cpp baseline -----------------------------------------------------------------------

def run_llamacpp(gguf: Path, requests: list[Request], threads: int) -> dict[str, Any]:
    """One request at a time, greedy. Llama.generate never stops at EOS by itself: each request
    runs to exactly its own output length."""
    from llama_cpp import Llama
    from tqdm import tqdm

    n_ctx = max(r.input_len + r.output_len for r in requests) + 8
    n_batch = min(n_ctx, max(512, max(r.input_len for r in requests)))  # a whole prompt per llama_decode call
    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                n_threads_batch=threads, seed=0, verbose=False)

    def generate(r: Request) -> tuple[int, float]:
        """Tokens generated and the time of the first one."""
        llm.reset()  # random prompts share no prefix worth reusing; start every request clean
        count, first = 0, 0.0
        for _token in llm.generate(r.input_ids, temp=0.0, top_k=1, repeat_penalty=1.0):
            count += 1
            if count == 1:
                first = time.perf_counter()
            if count == r.output_len:
                break  # before the generator evaluates this token: no forward is wasted
        return count, first

    generate(Request([100 + i for i in range(8)], 4))  # warm-up
    ttfts, e2es, got = [], [], []
    start = time.perf_counter()
    for r in tqdm(requests, desc="llamacpp requests", unit="req"):
        n, first = generate(r)
        got.append(n)
        # Latencies as if every request had arrived at the start, as loom's offline ones are.
        ttfts.append(first - start)
        e2es.append(time.perf_counter() - start)
    wall = time.perf_counter() - start
    llm.close()  # frees the model and context before anything else runs

    short = [(i, n, r.output_len) for i, (n, r) in enumerate(zip(got, requests)) if n != r.output_len]
    if short:
        print(f"WARNING: llamacpp: {len(short)} requests did not generate their output length: {short[:5]}",
              file=sys.stderr)
    out_tokens = sum(got)
    in_tokens = sum(r.input_len for r in requests)
    return {
        **throughput(wall, in_tokens, out_tokens),
        "e2e_latency_s": summarize(e2es),
        "ttft_s": summarize(ttfts),
        "length_mismatches": len(short),
        "gguf": str(gguf),
        "threads": threads,
        "n_batch": n_batch,
    }


# ---- vLLM baseline ----------------------------------------------------------------------------

def run_vllm(python: str, model_dir: Path, requests: list[Request], dtype: str, engine_args: dict[str, int],
             env: dict[str, str]) -> dict[str, Any]:
    """vLLM's LLM.generate on every request at once, in vLLM's own environment
    (benchmarks/vllm_offline_worker.py); its start-up and warm-up are not timed."""
    with tempfile.TemporaryDirectory(prefix="loom-vllm-") as tmp:
        job, out, log = Path(tmp) / "job.json", Path(tmp) / "result.json", Path(tmp) / "vllm.log"
        job.write_text(json.dumps({"model": str(model_dir), "dtype": dtype, "engine": engine_args,
                                   "requests": [[r.input_ids, r.output_len] for r in requests]}))
        with log.open("w") as log_file:
            proc = subprocess.run([python, str(ROOT / "benchmarks" / "vllm_offline_worker.py"), str(job), str(out)],
                                  env=env, stdout=log_file, stderr=subprocess.STDOUT)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"vLLM's offline run failed (exit code {proc.returncode}); its log ends:\n"
                               + log_tail(log))
        got = json.loads(out.read_text())

    short = [(i, n, r.output_len) for i, (n, r) in enumerate(zip(got["output_lens"], requests)) if n != r.output_len]
    if short:
        print(f"WARNING: vllm: {len(short)} requests did not generate their output length: {short[:5]}",
              file=sys.stderr)
    # Only tokens each request asked for count, should one have run long.
    useful = sum(min(n, r.output_len) for n, r in zip(got["output_lens"], requests))
    return {
        **throughput(got["wall_s"], sum(r.input_len for r in requests), useful),
        "length_mismatches": len(short),
        "vllm_version": got["vllm_version"],
        "engine_args": engine_args,
        "omp_threads_bind": env.get("VLLM_CPU_OMP_THREADS_BIND"),
        "ld_preload": env.get("LD_PRELOAD"),
    }


# ---- main -------------------------------------------------------------------------------------

def print_side(name: str, r: dict[str, Any]) -> None:
    busy = f", worker busy {r['busy_fraction']:.3f}" if r.get("busy_fraction") is not None else ""
    print(f"{name}: {r['output_tok_s']:.1f} output tok/s, {r['total_tok_s']:.1f} total tok/s, {r['wall_s']:.2f} s"
          f"{busy}", flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from launch import Engine
    from worker_proc.dtype_probe import resolve_dtype

    threads = num_cores()
    torch.set_num_threads(threads)
    cpu = cpu_info()

    # Probe the machine and the baseline's dtype first, while no loom process is busy on the cores.
    machine = probe_machine(PROBE_DTYPES, kernel=not args.no_kernel_probe)
    uses_hf = any(b in ("hf", "hf-cb") for b in args.baselines)
    hf_dtype, hf_dtype_reason = resolve_dtype(args.hf_dtype) if uses_hf else (None, "no hf baseline")
    hf_dtype_name = str(hf_dtype).removeprefix("torch.") if hf_dtype is not None else "-"
    gguf = None
    if "llamacpp" in args.baselines:
        if args.llamacpp_gguf is None and args.model_path is not None:
            raise SystemExit("--baseline llamacpp with --model-path: pass the same model's --llamacpp-gguf")
        gguf = args.llamacpp_gguf or embedded_gguf()
    if "vllm" in args.baselines:
        vllm_preload, vllm_missing = vllm_preloads(args.vllm_python)
        vllm_side = (f"{args.vllm_dtype}, vLLM {vllm_version(args.vllm_python)[0]} ({args.vllm_python}), "
                     f"threads bound to {args.vllm_omp_threads_bind}, preloaded: "
                     f"{', '.join(Path(p).name for p in vllm_preload) or 'nothing'}"
                     + (f" ({', '.join(vllm_missing)} not found)" if vllm_missing else ""))

    def start_engine() -> Any:
        return Engine(dtype=args.dtype, quantization=args.quantization, model_path=args.model_path,
                      kv_cache_gb=args.kv_cache_gb, kv_cache_dtype=args.kv_cache_dtype,
                      max_running_requests=args.max_running_requests, max_prefill_tokens=args.max_prefill_tokens,
                      log_level=args.log_level)

    engine = start_engine()
    try:
        tokenizer, model_dir, info = engine.tokenizer, Path(engine.model_dir), engine.server_info
        sides = {"loom": f"{info['dtype']}  ({info.get('dtype_reason', '')}); quantization {args.quantization}; "
                         f"KV cache {info.get('kv_cache_dtype', info['dtype'])}; "
                         f"{info.get('threads', '?')} worker threads"}
        for b in ("hf", "hf-cb"):
            if b in args.baselines:
                sides[b] = f"{hf_dtype_name}  ({hf_dtype_reason})"
        if gguf is not None:
            sides["llamacpp"] = f"{gguf_format(gguf)} ({gguf.name}), {threads} threads"
        if "vllm" in args.baselines:
            sides["vllm"] = vllm_side
        print("\n".join(header_lines(machine, sides, [f"model      {model_dir}"])), flush=True)

        requests = random_requests(tokenizer, args.num_requests, (args.input_min, args.input_max),
                                   (args.output_min, args.output_max), args.seed)
        print(f"workload: {len(requests)} requests, seed {args.seed}, "
              f"{sum(r.input_len for r in requests)} input + {sum(r.output_len for r in requests)} output tokens "
              f"(input {args.input_min}-{args.input_max}, output {args.output_min}-{args.output_max})", flush=True)

        loom = {"dtype": info["dtype"], **run_loom(engine, requests)}
    finally:
        engine.shutdown()  # frees the cores before the baselines run

    print_side("loom", loom)
    print(format_summary("  e2e", loom["e2e_latency_s"]))
    print(format_summary("  ttft", loom["ttft_s"]), flush=True)

    results: dict[str, dict[str, Any]] = {}
    rounds: list[dict] = []
    if "hf" in args.baselines:
        print(f"hf: {len(requests)} requests in static batches of {args.hf_batch_size} ({hf_dtype_name}) ...",
              flush=True)
        hf = results["hf"] = {"dtype": hf_dtype_name, "dtype_reason": hf_dtype_reason,
                              **run_hf(model_dir, tokenizer, requests, hf_dtype, args.hf_batch_size)}
        gc.collect()
        print(f"hf: {hf['output_tok_s']:.1f} useful output tok/s "
              f"({hf['computed_output_tok_s']:.1f} computed, {hf['output_tokens']}/{hf['computed_output_tokens']} "
              f"useful), {hf['total_tok_s']:.1f} total tok/s", flush=True)
    if "hf-cb" in args.baselines:
        print(f"hf-cb: {len(requests)} requests through transformers' continuous batching ({hf_dtype_name}) ...",
              flush=True)
        results["hf-cb"] = {"dtype": hf_dtype_name, "dtype_reason": hf_dtype_reason,
                            **run_hf_cb(model_dir, requests, hf_dtype, args.kv_cache_gb, args.max_running_requests,
                                        args.max_prefill_tokens)}
        print_side("hf-cb", results["hf-cb"])
    if gguf is not None:
        print(f"llamacpp: {len(requests)} requests one at a time ({gguf.name}, {threads} threads) ...", flush=True)
        results["llamacpp"] = {"dtype": gguf_format(gguf), **run_llamacpp(gguf, requests, threads)}
        print_side("llamacpp", results["llamacpp"])
    if "vllm" in args.baselines:
        print(f"vllm: {len(requests)} requests in one generate call ({args.vllm_dtype}; start-up and compile "
              f"warm-up take a minute or more, untimed) ...", flush=True)
        engine_args = vllm_engine_args(args.max_running_requests, args.max_prefill_tokens + args.max_running_requests,
                                       args.kv_cache_gb, args.vllm_kv_cache_dtype)  # loom's limits, as hf-cb gets them
        env = vllm_env(vllm_preload, args.vllm_omp_threads_bind)
        results["vllm"] = {"dtype": args.vllm_dtype,
                           **run_vllm(args.vllm_python, model_dir, requests, args.vllm_dtype, engine_args, env)}
        print_side("vllm", results["vllm"])
        if args.rounds > 1:
            def loom_again() -> float:
                again = start_engine()
                try:
                    return run_loom(again, requests)["output_tok_s"]
                finally:
                    again.shutdown()

            rounds = measure_rounds(
                args.rounds, {"loom": loom["output_tok_s"], "vllm": results["vllm"]["output_tok_s"]},
                {"loom": loom_again,
                 "vllm": lambda: run_vllm(args.vllm_python, model_dir, requests, args.vllm_dtype, engine_args,
                                          env)["output_tok_s"]})

    rows = [["loom", loom["dtype"], f"{loom['wall_s']:.2f}", f"{loom['output_tok_s']:.1f}", ""]]
    ratios = {}
    for name, r in results.items():
        ratios[f"loom/{name}"] = loom["output_tok_s"] / r["output_tok_s"]
        label = "hf (useful)" if name == "hf" else name
        rows.append([label, r["dtype"], f"{r['wall_s']:.2f}", f"{r['output_tok_s']:.1f}",
                     f"{ratios[f'loom/{name}']:.2f}x"])
    print("\n" + format_table(["side", "dtype", "wall s", "output tok/s", "loom/side"], rows))
    if rounds:
        for i, r in enumerate(rounds):
            print(f"round {i + 1}: loom / vllm {r['loom']:.1f} / {r['vllm']:.1f} output tok/s = {r['ratio']:.2f}x")
        ratios["loom/vllm"] = statistics.median(r["ratio"] for r in rounds)
        print(f"loom/vllm: median of {len(rounds)} rounds {ratios['loom/vllm']:.2f}x")
    for name, ratio in ratios.items():
        print(f"ratio {name}: {ratio:.2f}x")

    result = {
        "benchmark": "bench_offline",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cpu": cpu,
        "torch": {"version": torch.__version__, "threads": threads, "loom_worker_threads": info.get("threads")},
        "machine": machine,
        "model_dir": str(model_dir),
        "loom_server_info": info,
        "workload": {"num_requests": len(requests),
                     "input_tokens": sum(r.input_len for r in requests),
                     "output_tokens": sum(r.output_len for r in requests),
                     "input_lens": [r.input_len for r in requests],
                     "output_lens": [r.output_len for r in requests]},
        "loom": loom,
        "hf": results.get("hf"),
        "hf_cb": results.get("hf-cb"),
        "llamacpp": results.get("llamacpp"),
        "vllm": results.get("vllm"),
        "baselines": args.baselines,
        "rounds": rounds,  # loom and vLLM output tok/s and their ratio per round (with --rounds > 1)
        "ratio_loom_over_hf": ratios.get("loom/hf"),
        "ratios_loom_over": {name.removeprefix("loom/"): r for name, r in ratios.items()},
    }
    path = write_json(args.json or default_result_path("bench_offline"), result)
    print(f"results: {path}")
    return result


if __name__ == "__main__":
    main()
