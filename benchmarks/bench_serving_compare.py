"""Serving at saturation, side by side in one run, on one seeded workload:

  1. loom's Engine offline (no HTTP), at --concurrency running requests;
  2. loom's HTTP server (`/v1/completions`, streaming), --concurrency streams in flight;
  3. llama.cpp's server (`python -m llama_cpp.server`, the GGUF of the embedded model), the same
     client load — when llama-cpp-python is installed (optional);
  4. vLLM's OpenAI server (its CPU engine, in its own environment: --vllm-python) on loom's
     checkpoint folder, the same client load (token-id prompts, max_tokens, ignore_eos), with
     loom's limits (--concurrency requests at once, loom's default prompt tokens per step and KV
     memory), its compute threads bound to --vllm-omp-threads-bind and tcmalloc and Intel OpenMP
     preloaded where found — skipped, with a line saying why, when that python cannot import vllm.
     Its start-up compiles the model (a minute or more), before any request is timed.

Each side runs alone (the previous one is shut down first). Prints output tok/s of each and the
ratios loom HTTP / loom offline, loom HTTP / llama.cpp server and loom HTTP / vLLM server. With
--rounds N, loom offline, loom's server and vLLM's server (when measured) are measured N times in
turn (a fresh engine or server each time, every other round in reverse order, loom's server always
next to loom offline; the llama.cpp server once) and each ratio is the median of the rounds' ratios: a VM's speed can move by tens
of per cent within minutes, which one pair of runs cannot tell from the engines.

    python benchmarks/bench_serving_compare.py                      # 64 requests, 32 streams
    python benchmarks/bench_serving_compare.py --num-prompts 128 --no-llamacpp --no-vllm
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (AVX2_ONLY_ENV, ROOT, add_repo_to_path, add_vllm_args,  # noqa: E402
                               avx2_only_vllm_env, default_result_path, format_table, log_tail, measure_rounds,
                               vllm_engine_args, vllm_env, vllm_preloads, vllm_server_command, vllm_version,
                               wait_healthy, write_json)

add_repo_to_path()

from worker_proc.cpu_kernels import ISA_LEVELS  # noqa: E402


def stop(proc: subprocess.Popen, group: bool = False) -> None:
    """Ends a server. `group`: it was started in a session of its own; whatever of its processes
    outlive it are killed too, so none keeps a core busy while the next side runs."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if group:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # none left
            return
        # until the last of them is gone: a dying engine's processes still held the cores while the
        # next server timed its dtype probe (an AMX Xeon's bfloat16 read 20x slow: it chose float32)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def client_args(args, port: int, label: str, model: str | None = None) -> list[str]:
    out = ["--backend", "openai", "--port", str(port), "--num-prompts", str(args.num_prompts),
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--random-range-ratio", str(args.range_ratio), "--max-concurrency", str(args.concurrency),
           "--seed", str(args.seed), "--tokenizer", str(args.model_dir), "--no-probe", "--no-output-file",
           "--disable-tqdm", "--label", label]
    return out + (["--model", model] if model else [])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256, help="longest prompt (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=128, help="longest output (default: %(default)s)")
    p.add_argument("--range-ratio", type=float, default=0.5, help="shortest = ratio x longest (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="none")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--kernel-isa", default="native", choices=ISA_LEVELS,
                   help="instruction-set level of loom's CPU kernels (default: %(default)s)")
    p.add_argument("--emulate-avx2", action="store_true",
                   help="both engines on AVX2 code only (loom's avx2 kernels; torch, oneDNN and MKL held to AVX2; "
                        "vLLM's AVX2 build): on an AVX-512 CPU, an estimate of the ratios on an AVX2-only one "
                        "(the instructions are the same; the memory system and clocks stay this CPU's)")
    p.add_argument("--port", type=int, default=30700)
    p.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp server side")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM server side")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure loom offline, loom's server and vLLM's server this many times in turn; each "
                        "ratio is the median of the rounds' (default: %(default)s)")
    add_vllm_args(p)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    if args.emulate_avx2:  # (loom's processes inherit this environment; vLLM's gets it in run_vllm_side)
        args.kernel_isa = "avx2"
        os.environ.update(AVX2_ONLY_ENV)

    from benchmarks import bench_serving
    from benchmarks.bench_offline import run_loom
    from benchmarks.common import embedded_gguf, llama_cpp_installed
    from benchmarks.probes import header_lines, probe_machine
    from worker_proc.model_loader import ensure_default_model

    args.model_dir = ensure_default_model()
    machine = probe_machine()
    print("\n".join(header_lines(machine, {"loom": f"{args.dtype}, quantization {args.quantization}, "
                                                    f"KV cache {args.kv_cache_dtype}, kernels {args.kernel_isa}"
                                                    + (" (both engines on AVX2 code only)" if args.emulate_avx2
                                                       else "")}, [])))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.model_dir))
    requests = bench_serving.build_requests(bench_serving.parse_args(client_args(args, 0, "")), tokenizer, None)
    print(f"workload: {len(requests)} requests, {sum(r.input_len for r in requests)} input + "
          f"{sum(r.output_len for r in requests)} output tokens, {args.concurrency} in flight", flush=True)
    results: dict = {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()}}

    from launch import Engine

    def run_loom_offline() -> dict:
        with Engine(dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                    kernel_isa=args.kernel_isa, max_running_requests=args.concurrency,
                    log_level="warning") as engine:
            return run_loom(engine, requests)

    results["loom_offline"] = run_loom_offline()

    results["loom_http"] = run_loom_server(args)

    if not args.no_llamacpp and llama_cpp_installed():
        port = args.port + 1
        server = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(embedded_gguf()),
                                   "--n_threads", str(machine["cpu"]["cores"]), "--n_ctx", "4096",
                                   "--port", str(port), "--model_alias", "smollm2",
                                   # by default a new request cuts the one being generated short
                                   "--interrupt_requests", "False"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_healthy(server, f"http://127.0.0.1:{port}/v1/models", "llama.cpp server")
            # llama-cpp-python's server takes prompts as text only and has no ignore_eos: the
            # end-of-text tokens get a -100 bias instead.
            eos = {str(t): -100 for t in {tokenizer.eos_token_id, tokenizer.pad_token_id} if t is not None}
            results["llamacpp_http"] = bench_serving.run_benchmark(bench_serving.parse_args(
                client_args(args, port, "llama.cpp server", model="smollm2")
                + ["--prompt-as-text", "--extra-request-body", json.dumps({"logit_bias": eos})]))
        finally:
            stop(server)

    # (loom HTTP in the middle: next to loom offline, its own ratio's other side, either way)
    first = {"loom_offline": results["loom_offline"]["output_tok_s"],
             "loom_http": results["loom_http"]["output_throughput"]}
    runs = {"loom_offline": lambda: run_loom_offline()["output_tok_s"],
            "loom_http": lambda: run_loom_server(args)["output_throughput"]}
    ratios = {"http_over_offline": ("loom_http", "loom_offline")}
    vllm = None if args.no_vllm else run_vllm_side(args, results)
    if vllm is not None:
        results["vllm_http"] = vllm
        first["vllm_http"] = vllm["output_throughput"]
        runs["vllm_http"] = lambda: run_vllm_side(args, results)["output_throughput"]
        ratios["ratio"] = ("loom_http", "vllm_http")
    rounds = results["rounds"] = measure_rounds(args.rounds, first, runs, ratios)
    several = len(rounds) > 1
    median = " (median)" if several else ""
    offline = statistics.median(r["loom_offline"] for r in rounds)
    http = statistics.median(r["loom_http"] for r in rounds)
    # each round's HTTP over its own offline run, the median of those
    http_over_offline = statistics.median(r["http_over_offline"] for r in rounds)
    rows = [["loom offline (Engine)" + median, f"{offline:.1f}", ""],
            ["loom HTTP" + median, f"{http:.1f}",
             f"{http_over_offline:.2f}x offline" + (" (median of rounds)" if several else "")]]
    results["ratios"] = {"loom_http_over_offline": http_over_offline}
    if "llamacpp_http" in results:
        lc = results["llamacpp_http"]["output_throughput"]
        rows.append(["llama.cpp server", f"{lc:.1f}", f"loom HTTP = {http / lc:.2f}x"])
        results["ratios"]["loom_http_over_llamacpp_http"] = http / lc
    for i, r in enumerate(rounds if several else []):
        if vllm is None:
            rows.append([f"round {i + 1}: loom offline / HTTP", f"{r['loom_offline']:.1f} / {r['loom_http']:.1f}",
                         f"{r['http_over_offline']:.2f}x offline"])
        else:
            rows.append([f"round {i + 1}: loom offline / HTTP / vLLM",
                         f"{r['loom_offline']:.1f} / {r['loom_http']:.1f} / {r['vllm_http']:.1f}",
                         f"{r['http_over_offline']:.2f}x offline, {r['ratio']:.2f}x vLLM"])
    if vllm is not None:
        v = statistics.median(r["vllm_http"] for r in rounds)
        ratio = statistics.median(r["ratio"] for r in rounds)
        rows.append([f"vLLM server{median}", f"{v:.1f}",
                     f"loom HTTP = {ratio:.2f}x{' (median of rounds)' if several else ''}"])
        results["ratios"]["loom_http_over_vllm_http"] = ratio
    print(format_table(["side", "output tok/s", "ratio"], rows))
    path = write_json(args.json or default_result_path("bench_serving_compare"), results)
    print(f"results: {path}")
    return results


def loom_server_command(args) -> list[str]:
    """loom's server with the offline side's settings, one running request per stream."""
    return [sys.executable, str(ROOT / "launch.py"), "--port", str(args.port), "--zmq-port", "0",
            "--dtype", args.dtype, "--quantization", args.quantization, "--kv-cache-dtype", args.kv_cache_dtype,
            "--kernel-isa", args.kernel_isa, "--max-running-requests", str(args.concurrency), "--log-level", "warning"]


def run_loom_server(args) -> dict:
    """bench_serving's result against a fresh loom server (shut down after)."""
    from benchmarks import bench_serving

    server = subprocess.Popen(loom_server_command(args), cwd=str(ROOT))
    try:
        wait_healthy(server, f"http://127.0.0.1:{args.port}/health", "loom server")
        return bench_serving.run_benchmark(bench_serving.parse_args(client_args(args, args.port, "loom http")))
    finally:
        stop(server)


def run_vllm_side(args, results: dict) -> dict | None:
    """bench_serving's result against a fresh vLLM server under the client load loom's got; None,
    after a line saying why, where vLLM is missing. Notes its version and settings in results."""
    from benchmarks import bench_serving
    from launch import ServerArgs

    version, why = vllm_version(args.vllm_python)
    if version is None:
        print(f"vLLM server: skipped, {why}", flush=True)
        return None
    preloads, missing = vllm_preloads(args.vllm_python)
    loom_defaults = ServerArgs()
    # loom's limits: --concurrency requests at once, its prompt budget plus one decode each, its KV memory
    engine_args = vllm_engine_args(args.concurrency, loom_defaults.max_prefill_tokens + args.concurrency,
                                   loom_defaults.kv_cache_gb, args.vllm_kv_cache_dtype)
    port = args.port + 2
    print(f"vLLM server {version} ({args.vllm_python}): {args.vllm_dtype}, threads bound to "
          f"{args.vllm_omp_threads_bind}, preloaded: {', '.join(Path(p).name for p in preloads) or 'nothing'}"
          + (f" ({', '.join(missing)} not found)" if missing else "") + "; starting (a minute or more) ...",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="loom-vllm-") as tmp, (Path(tmp) / "vllm.log").open("w") as log:
        server = subprocess.Popen(vllm_server_command(args.vllm_python, args.model_dir, port, args.vllm_dtype,
                                                      engine_args),
                                  env=vllm_env(preloads, args.vllm_omp_threads_bind,
                                               avx2_only_vllm_env(Path(tmp), dict(os.environ))
                                               if args.emulate_avx2 else None), stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        try:
            try:
                wait_healthy(server, f"http://127.0.0.1:{port}/health", "vLLM server", timeout_s=1200)
            except (RuntimeError, TimeoutError) as e:
                raise RuntimeError(f"{e}; its log ends:\n{log_tail(Path(log.name))}") from None
            measured = bench_serving.run_benchmark(bench_serving.parse_args(
                client_args(args, port, "vLLM server", model=str(args.model_dir))))
        finally:
            stop(server, group=True)
    results["vllm"] = {"version": version, "engine_args": engine_args, "dtype": args.vllm_dtype,
                       "omp_threads_bind": args.vllm_omp_threads_bind, "preloaded": preloads}
    return measured


if __name__ == "__main__":
    main()
