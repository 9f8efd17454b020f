"""One static batch through loom's model, in-process (no server processes): prefill and decode
speed per batch size, how much of each step is the forward pass, and how close both come to
this CPU's limits.

For each --batch-sizes entry it submits that many prompts of exactly --input-len random regular
tokens (greedy, EOS ignored, --output-len tokens each) to a fresh SchedulerCore and drives it
the way the scheduler process does (next_batch -> to_worker_batch -> ModelRunner.forward ->
on_result), timing every step. The whole batch's prompts fit one step's token budget, so the
first step is the prefill (it also samples the first token) and every later step a full-batch
decode.

Reported per batch size: prefill s and tok/s; decode step ms (median) and tok/s; busy fraction
(time inside ModelRunner.forward / whole step time: the rest is scheduling and batch building);
and the rooflines from the probes of the same run (by default each batch size's own: the mean of
a GEMV and a GEMM probe right before and right after its timed steps; --probe-once takes the
start-up probe's; --prefill-rounds N also times the prefill alone N more times, each between
GEMM probes, and reports the median of those rounds' shares of the roof, and --decode-rounds N
runs the batch N more times, each between GEMV probes, for the decode's share of the bandwidth
roof: on a VM whose rates move within minutes, one pair of probes around a batch's whole run can
straddle a change):
  bandwidth  a decode step streams every weight once and each row's KV cache: batch x GEMV rate /
             (weight bytes + batch x mean context x KV bytes per token) tok/s (at batch 1 the
             limit of single-stream decode);
  GEMM       tok/s x FLOPs per token (2 x weight parameters, LM head included, attention not)
             / GEMM GFLOP/s of the dtype.

    python benchmarks/bench_one_batch.py                                   # 1,4,16,64,128 x 256 in, 32 out
    python benchmarks/bench_one_batch.py --batch-sizes 1,4 --input-len 32 --output-len 8   # smoke test
    python benchmarks/bench_one_batch.py --dtype float32 --json out.json
    python benchmarks/bench_one_batch.py --batch-sizes 1 --quantization int4 --llamacpp-baseline
    python benchmarks/bench_one_batch.py --batch-sizes 256 --input-len 128 --output-len 16 --prefill-rounds 5
    python benchmarks/bench_one_batch.py --batch-sizes 1 --input-len 128 --output-len 64 --decode-rounds 6
    python benchmarks/bench_one_batch.py --batch-sizes 128,256 --input-len 128 --output-len 64 --kv-cache-dtype int8

Writes --json (default: benchmarks/results/bench_one_batch_<timestamp>.json) and a plot of
throughput against batch size next to it (when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

if __package__ in (None, ""):  # run as a script: make the repo root and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (Request, add_repo_to_path, default_result_path, embedded_gguf,  # noqa: E402
                               fixed_length_requests, format_table, gguf_format, llama_cpp_installed, num_cores,
                               write_json)
from benchmarks.probes import (GEMV_WORKING_SET, PROBE_DTYPES, GemvProbe, describe_machine, gemm_gflops,  # noqa: E402
                               gemv_gbs, header_lines, load_loom_gemv, probe_gemm, probe_gemv, probe_machine)

add_repo_to_path()

import torch  # noqa: E402

from worker_proc.cpu_kernels import ISA_LEVELS  # noqa: E402
from worker_proc.kv_cache import KV_CACHE_DTYPES, KVPool, resolve_kv_dtype  # noqa: E402
from worker_proc.linear import QUANTIZATIONS, Int4Linear  # noqa: E402


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags that pick the model and how it runs, as launch.py names them (shared by the
    benchmarks that load loom's model runner)."""
    p.add_argument("--model-path", default=None, help="checkpoint folder (default: loom's embedded model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto times both on this CPU, as the server does (default: %(default)s)")
    p.add_argument("--kernel-isa", default="native", choices=ISA_LEVELS,
                   help="the CPU kernels' instruction-set level, as launch.py (default: %(default)s)")
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                   help="weight-only quantization, as launch.py (default: %(default)s)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *KV_CACHE_DTYPES],
                   help="dtype of the KV cache, as launch.py's flag (auto picks as it does: the compute dtype, "
                        "or float16 with some --quantization; int8 on CPU: 0.53x bfloat16's bytes a decode step)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,4,16,64,128", help="comma list (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request (default: %(default)s)")
    add_model_args(p)
    p.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "cpu"],
                   help="loom's CPU kernels or plain torch ops, as launch.py (default: %(default)s)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the model runs (auto: cuda where a GPU is visible; default: %(default)s)")
    p.add_argument("--disable-cuda-graph", action="store_true", help="on a GPU: every decode step eager")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="on a GPU: the batch-invariant kernels (to measure what they cost)")
    p.add_argument("--hbm-gbps", type=float, default=None,
                   help="on a GPU: its memory bandwidth in GB/s for the bandwidth roof (e.g. 3350 for an H100 "
                        "SXM); the CPU probes are skipped there")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="KV cache, GiB (default: what the largest batch needs, plus a margin)")
    p.add_argument("--seed", type=int, default=0, help="seed for the prompts (default: %(default)s)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the untimed pass of each batch size (prompt + 2 tokens) before its timed one")
    p.add_argument("--no-probe", action="store_true", help="skip the GEMM/GEMV probes (no roofline figures)")
    p.add_argument("--probe-working-set-mb", type=int, default=GEMV_WORKING_SET >> 20,
                   help="MiB the GEMV probe cycles over (default: 4x the last-level cache, at least 256)")
    p.add_argument("--probe-once", action="store_true",
                   help="rooflines from the start-up probe only (default: each batch size also probes its "
                        "dtype's GEMM and GEMV right before and after its timed steps and takes the mean)")
    p.add_argument("--prefill-rounds", type=int, default=0,
                   help="after each batch size's run, time its prefill alone this many more times, each "
                        "between GEMM probes (probe, prefill, probe, prefill, ..., probe), and report the median "
                        "of the rounds' shares of the GEMM roof as its prefill %%GEMM (default: %(default)s: "
                        "the share from the batch's own probes)")
    p.add_argument("--decode-rounds", type=int, default=0,
                   help="after each batch size's run, run the batch this many more times, each between GEMV "
                        "probes (probe, batch, probe, ..., probe), and report the median of the rounds' decode "
                        "shares of the bandwidth roof as its %%BW roof (default: %(default)s: the share from "
                        "the batch's own probes; on a VM whose memory rate moves within seconds, probes around "
                        "a whole run straddle its changes)")
    p.add_argument("--json", type=Path, default=None,
                   help="result file (default: benchmarks/results/bench_one_batch_<timestamp>.json)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--hf-baseline", action="store_true",
                   help="also time HF transformers `generate` at batch 1 on the same prompt and lengths, at "
                        "its best dtype on this CPU (--hf-dtype), for the batch-1 ratio")
    p.add_argument("--hf-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="HF baseline dtype; auto times both like loom's probe (default: %(default)s)")
    p.add_argument("--llamacpp-baseline", action="store_true",
                   help="also time llama.cpp (llama-cpp-python) at batch 1 on the same prompt and lengths, on the "
                        "embedded model's GGUF (Q4_1) or --llamacpp-gguf")
    p.add_argument("--llamacpp-gguf", type=Path, default=None, help="GGUF file for --llamacpp-baseline")
    args = p.parse_args(argv)
    try:
        args.batch_sizes = sorted({int(x) for x in args.batch_sizes.split(",") if x.strip()})
    except ValueError:
        p.error(f"--batch-sizes wants comma-separated integers, got {args.batch_sizes!r}")
    if not args.batch_sizes or args.batch_sizes[0] < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("batch sizes, --input-len and --output-len must be at least 1")
    for flag in ("prefill_rounds", "decode_rounds"):
        name = "--" + flag.replace("_", "-")
        if getattr(args, flag) < 0:
            p.error(f"{name} must be at least 0")
        if getattr(args, flag) and (args.no_probe or args.probe_once):
            p.error(f"{name} takes probes of its own: drop --no-probe / --probe-once")
    return args


# ---- the model ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class WeightStats:
    """What one token costs in weights: the bytes a decode step streams and the FLOPs per token."""
    matmul_params: int  # logical weight parameters of every projection and the LM head
    bytes: int  # what the model holds for them (and its norms), as stored: dtype or quantized
    flops_per_token: float  # 2 x matmul_params; attention excluded
    head_flops_per_token: float  # the LM head's share, which a prompt pays for its last token only

    @classmethod
    def of(cls, model: torch.nn.Module, config: Any) -> "WeightStats":
        # FLOPs from the shapes in the config, so they hold whatever form the weights take.
        c = config
        per_layer = (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim  # fused qkv
                     + c.num_heads * c.head_dim * c.hidden_size  # o
                     + c.hidden_size * 2 * c.intermediate_size  # fused gate/up
                     + c.intermediate_size * c.hidden_size)  # down
        matmul = c.num_layers * per_layer + c.vocab_size * c.hidden_size  # + LM head
        # Bytes from the tensors themselves. An embedding table is a gather of a few rows, not
        # streamed, unless it is also the (tied) LM head, which then counts once, under the head;
        # rotary tables are read a row per token.
        seen: set[int] = set()
        nbytes = sum(streamed_bytes(module, seen) for module in model.modules()
                     if not isinstance(module, torch.nn.Embedding) and "rotary" not in type(module).__name__.lower())
        return cls(matmul, nbytes, 2.0 * matmul, 2.0 * c.vocab_size * c.hidden_size)


def streamed_bytes(module: torch.nn.Module, seen: set[int] | None = None, rows: int = 1) -> int:
    """The bytes of its own tensors a step of `rows` rows reads of `module` (not its children's),
    each tensor once across calls sharing `seen`. A linear with its weight also packed for the
    kernel (Linear.packed) streams the panels and only the rows past the last whole panel; an int4
    one holding the integer GEMM's panels too reads those from int4_panel_rows() rows, its plain
    codes below that (the same weights in two forms)."""
    seen = set() if seen is None else seen
    packed = getattr(module, "packed", None)
    unread: set[int] = set()
    if isinstance(module, Int4Linear) and module.integer_gemm:  # (panels come only with the kernels)
        if rows >= module.ops.kernels.int4_panel_rows():
            unread = {module.qweight.data_ptr(), module.scale.data_ptr(), module.minimum.data_ptr()}
        else:
            unread = {module.panels.data_ptr()}
    nbytes = 0
    for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
        if t is None or t.data_ptr() in seen or t.data_ptr() in unread:
            continue
        seen.add(t.data_ptr())
        if packed is not None and t is module.weight:
            nbytes += (t.shape[0] - packed.numel() // t.shape[1]) * t.shape[1] * t.element_size()
        else:
            nbytes += t.numel() * t.element_size()
    return nbytes


def load_runner(args: argparse.Namespace, dtype: torch.dtype, model_dir: Path) -> Any:
    from worker_proc.model_config import ModelConfig
    from worker_proc.model_runner import ModelRunner, RunnerConfig

    kv_gb = args.kv_cache_gb
    if kv_gb is None:
        config = ModelConfig.from_dir(model_dir)
        kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, dtype, args.quantization)
        per_token = KVPool.bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, kv_dtype)
        tokens = max(args.batch_sizes) * (args.input_len + args.output_len)
        kv_gb = (tokens * 1.25 + 4096) * per_token / 2**30
    on_gpu = args.device == "cuda"
    return ModelRunner(RunnerConfig(str(model_dir), dtype, kv_gb, max(args.batch_sizes),
                                    device=args.device, kernel_backend="auto" if on_gpu else args.kernel_backend,
                                    kernel_isa=args.kernel_isa, quantization=args.quantization,
                                    kv_cache_dtype=args.kv_cache_dtype,
                                    cuda_graph_max_bs=0 if args.disable_cuda_graph else max(args.batch_sizes),
                                    deterministic=args.enable_deterministic_inference))


# ---- one batch ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    decode: bool  # every row decodes one token
    rows: int
    tokens: int
    forward_s: float  # inside ModelRunner.forward
    step_s: float  # next_batch + to_worker_batch + forward + on_result


def run_batch(runner: Any, requests: list[Request], bar: Any = None) -> list[Step]:
    """Drive a fresh SchedulerCore over `requests` (submitted together), timing each step."""
    from ipc.messages import SamplingParams
    from scheduler_proc.core import SchedulerConfig, SchedulerCore
    from scheduler_proc.req import Req

    core = SchedulerCore(SchedulerConfig(
        max_total_tokens=runner.num_slots, max_running_requests=len(requests),
        max_prefill_tokens=sum(r.input_len for r in requests),  # the whole batch prefills in one step
        max_context_len=runner.context_len))
    reqs = [Req(str(i), r.input_ids, SamplingParams(max_new_tokens=r.output_len, temperature=0.0, ignore_eos=True))
            for i, r in enumerate(requests)]
    for req in reqs:
        refused = core.add_request(req)
        if refused is not None:
            raise RuntimeError(f"request {req.rid} refused: {refused.req.finish}")

    steps: list[Step] = []
    while True:
        start = time.perf_counter()
        batch, _ended = core.next_batch()
        if batch is None:
            break
        worker_batch = batch.to_worker_batch()
        forward_start = time.perf_counter()
        next_ids = runner.forward(worker_batch)
        forward_end = time.perf_counter()
        core.on_result(batch, next_ids)
        end = time.perf_counter()
        steps.append(Step(batch.num_decode == len(batch.rows), len(batch.rows), batch.num_tokens,
                          forward_end - forward_start, end - start))
        if bar is not None:
            bar.update(1)
    short = [(r.rid, len(r.output_ids)) for r, want in zip(reqs, requests) if len(r.output_ids) != want.output_len]
    if short:
        raise RuntimeError(f"{len(short)} requests did not generate their output length: {short[:5]}")
    if leaks := core.idle_leaks():
        raise RuntimeError(f"scheduler state left behind: {leaks}")
    return steps


def summarize_steps(batch_size: int, input_len: int, steps: list[Step]) -> dict[str, Any]:
    prefill = [s for s in steps if not s.decode]
    decode = [s for s in steps if s.decode]
    prefill_s = sum(s.step_s for s in prefill)
    decode_s = sum(s.step_s for s in decode)
    decode_tokens = sum(s.rows for s in decode)
    return {
        "batch_size": batch_size,
        "prefill_steps": len(prefill),
        "prefill_s": prefill_s,
        "prefill_forward_s": sum(s.forward_s for s in prefill),
        "prefill_tok_s": batch_size * input_len / prefill_s,
        "decode_steps": len(decode),
        "decode_step_ms_median": statistics.median(s.step_s for s in decode) * 1e3 if decode else None,
        "decode_forward_ms_median": statistics.median(s.forward_s for s in decode) * 1e3 if decode else None,
        "decode_tok_s": decode_tokens / decode_s if decode else None,
        "busy_fraction": sum(s.forward_s for s in decode) / decode_s if decode else None,
        "busy_fraction_all_steps": sum(s.forward_s for s in steps) / sum(s.step_s for s in steps),
        "decode_step_ms": [round(s.step_s * 1e3, 4) for s in decode],
        "decode_forward_ms": [round(s.forward_s * 1e3, 4) for s in decode],
    }


def prompt_flops(weights: WeightStats, input_len: int) -> float:
    """Weight FLOPs per prompt token: the LM head runs for each prompt's last token alone."""
    return weights.flops_per_token - weights.head_flops_per_token * (1 - 1 / input_len)


def bandwidth_roof_tok_s(batch: int, gemv_rate_gbs: float, step_bytes: float) -> float:
    """Decode tok/s if a step's bytes (every weight once, the batch's KV reads) stream at the GEMV rate."""
    return batch * gemv_rate_gbs * 1e9 / step_bytes


def add_rooflines(row: dict[str, Any], weights: WeightStats, gemv_rate_gbs: float | None,
                  gemm_rate_gflops: float | None, input_len: int, kv_bytes_per_step: float = 0.0) -> None:
    """Bandwidth roof: a decode step streams all weights once for the whole batch, and each row's
    KV cache (kv_bytes_per_step: the mean over the decode steps). GEMM roof: the weight FLOPs of
    each token at the probed GEMM rate (a prompt's tokens skip the LM head but for the last). The
    roofline is the lower of the two."""
    step_bytes = weights.bytes + kv_bytes_per_step
    bw = bandwidth_roof_tok_s(row["batch_size"], gemv_rate_gbs, step_bytes) if gemv_rate_gbs else None
    gemm = gemm_rate_gflops * 1e9 / weights.flops_per_token if gemm_rate_gflops else None
    prefill_gemm = gemm_rate_gflops * 1e9 / prompt_flops(weights, input_len) if gemm_rate_gflops else None
    roof = min(x for x in (bw, gemm) if x is not None) if (bw or gemm) else None
    decode = row["decode_tok_s"]

    def pct(value: float | None, limit: float | None) -> float | None:
        return 100.0 * value / limit if value is not None and limit else None

    row.update({
        "bandwidth_roof_tok_s": bw, "gemm_roof_tok_s": gemm, "roof_tok_s": roof, "kv_bytes_per_step": kv_bytes_per_step,
        "decode_pct_of_bandwidth_roof": pct(decode, bw), "decode_pct_of_gemm_roof": pct(decode, gemm),
        "decode_pct_of_roof": pct(decode, roof),
        "prefill_gemm_roof_tok_s": prefill_gemm, "prefill_pct_of_gemm_roof": pct(row["prefill_tok_s"], prefill_gemm),
    })


def probed_rounds(run: Callable[[], float], probe: Callable[[], float], rounds: int,
                  roof_per_rate: float) -> dict[str, Any]:
    """`rounds` runs, each between probes (probe, run, probe, ...): per round its tok/s and its
    share of the roof (roof_per_rate x the probed rate) taken from the mean of the probes either
    side; the median share is the figure (a round that straddles a change of the VM's rate moves
    only itself)."""
    probes = [probe()]
    tok_s: list[float] = []
    for _ in range(rounds):
        tok_s.append(run())
        probes.append(probe())
    pcts = [100.0 * t / (roof_per_rate * (a + b) / 2) for t, a, b in zip(tok_s, probes, probes[1:])]
    return {"tok_s": tok_s, "probes": probes, "pct_of_roof": pcts, "median_pct_of_roof": statistics.median(pcts)}


def describe_rounds(rounds: dict[str, Any], unit: str, roof: str) -> str:
    return (", ".join(f"{t:.0f} tok/s = {p:.1f}%" for t, p in zip(rounds["tok_s"], rounds["pct_of_roof"]))
            + f" of the {roof} roof (probes {', '.join(f'{g:.0f}' for g in rounds['probes'])} {unit})"
            f" -> median {rounds['median_pct_of_roof']:.1f}%")


def format_rows(rows: list[dict[str, Any]]) -> str:
    def f(value: float | None, digits: int = 1) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}"

    table = [[r["batch_size"], f(r["prefill_s"], 3), f(r["prefill_tok_s"]), f(r["prefill_pct_of_gemm_roof"]),
              f(r["decode_step_ms_median"], 2), f(r["decode_forward_ms_median"], 2), f(r["decode_tok_s"]),
              f(None if r["busy_fraction"] is None else 100 * r["busy_fraction"]),
              f(r["decode_pct_of_bandwidth_roof"]), f(r["decode_pct_of_gemm_roof"])] for r in rows]
    return format_table(["batch", "prefill s", "prefill tok/s", "pf %GEMM", "step ms p50", "fwd ms p50",
                         "decode tok/s", "busy %", "%BW roof", "%GEMM roof"], table)


# ---- main ---------------------------------------------------------------------------------------

def hf_batch1_decode(model_dir: Path, tokenizer: Any, input_len: int, output_len: int, seed: int,
                     dtype: torch.dtype) -> dict[str, Any]:
    """HF `generate` on one request (greedy, EOS ignored): decode tok/s, the prefill timed apart
    (a one-token generate) and taken out, as loom's figure."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    ids = torch.tensor([fixed_length_requests(tokenizer, [input_len], [output_len], seed)[0].input_ids])
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        gc = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=tokenizer.pad_token_id or 0)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, generation_config=gc)
        return time.perf_counter() - start

    run(2)  # warm-up
    prefill, full = run(1), run(output_len)
    return {"dtype": str(dtype).removeprefix("torch."), "decode_tok_s": (output_len - 1) / (full - prefill),
            "wall_s": full}


def llamacpp_batch1_decode(gguf: Path, input_ids: list[int], output_len: int, threads: int) -> dict[str, Any]:
    """llama.cpp on one request (greedy, EOS ignored): decode tok/s from the time between the
    first and the last generated token, as loom's figure (prefill excluded)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=len(input_ids) + output_len + 8, n_batch=max(512, len(input_ids)),
                n_threads=threads, n_threads_batch=threads, seed=0, verbose=False)

    def run(n: int) -> tuple[float, float]:
        llm.reset()
        count, first = 0, 0.0
        for _token in llm.generate(input_ids, temp=0.0, top_k=1, repeat_penalty=1.0):
            count += 1
            if count == 1:
                first = time.perf_counter()
            if count == n:
                break
        return first, time.perf_counter()

    run(4)  # warm-up
    first, last = run(output_len)
    llm.close()
    return {"dtype": gguf_format(gguf), "gguf": str(gguf), "threads": threads,
            "decode_tok_s": (output_len - 1) / (last - first)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from worker_proc.dtype_probe import resolve_dtype
    from worker_proc.model_loader import ensure_default_model
    from worker_proc.model_runner import load_kernels

    torch.set_num_threads(num_cores())  # as loom's worker does
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda":  # the CPU's probes say nothing of a GPU: its bandwidth is given
        args.no_probe = True
    working_set = args.probe_working_set_mb << 20
    machine = describe_machine() if args.no_probe else probe_machine(PROBE_DTYPES, gemv_working_set=working_set)
    if args.device == "cuda":
        machine["gpu"] = torch.cuda.get_device_name()
        if args.hbm_gbps:
            machine["gemv"] = {name: {"best_gbs": args.hbm_gbps} for name in ("float32", "bfloat16", "float16")}
    kernels = load_kernels(args.kernel_backend, args.device, args.kernel_isa) if args.device == "cpu" else None
    dtype, dtype_reason = resolve_dtype(args.dtype, args.device, kernels)  # as loom's worker decides
    dtype_name = str(dtype).removeprefix("torch.")
    model_dir = Path(args.model_path) if args.model_path else ensure_default_model()

    runner = load_runner(args, dtype, model_dir)
    backend, kv_slots = runner.kernel_backend, runner.num_slots
    kv_dtype_name = str(runner.kv_dtype).removeprefix("torch.")
    weights = WeightStats.of(runner.model, runner.config)
    gemv_rate, gemm_rate = gemv_gbs(machine, dtype_name), gemm_gflops(machine, dtype_name)
    # a decode step j (1 .. output_len - 1) attends input_len + j tokens of each row
    kv_per_token = KVPool.bytes_per_token(runner.config.num_layers, runner.config.num_kv_heads,
                                          runner.config.head_dim, runner.kv_dtype)

    def kv_bytes_per_step(batch: int) -> float:
        return batch * (args.input_len + args.output_len / 2) * kv_per_token

    batch1_limit = gemv_rate * 1e9 / (weights.bytes + kv_bytes_per_step(1)) if gemv_rate else None
    print("\n".join(header_lines(machine, {"loom": f"{dtype_name}  ({dtype_reason})"}, [
        f"model      {model_dir}",
        f"weights    {weights.matmul_params / 1e6:.1f} M matmul parameters, {weights.bytes / 2**20:.1f} MiB "
        f"streamed per step ({dtype_name}, quantization {args.quantization}), "
        f"{weights.flops_per_token / 1e6:.0f} MFLOP per token",
        f"runner     kernels {runner.kernel_isa}; KV pool {runner.num_slots} tokens in {kv_dtype_name}",
        "roof bw    " + (f"batch 1: {(weights.bytes + kv_bytes_per_step(1)) / 2**20:.1f} MiB (weights + KV) / "
                         f"{gemv_rate:.1f} GB/s -> "
                         f"{batch1_limit:.1f} tok/s" if batch1_limit else "n/a (no probe)"),
        "roof GEMM  " + (f"{gemm_rate:.1f} GFLOP/s / {weights.flops_per_token / 1e6:.0f} MFLOP -> "
                         f"{gemm_rate * 1e9 / weights.flops_per_token:.1f} tok/s" if gemm_rate else "n/a (no probe)"),
        f"workload   batch sizes {args.batch_sizes}, {args.input_len} prompt + {args.output_len} output tokens each",
    ])), flush=True)

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    paired_probe = None
    paired_kernel = None if args.no_probe or args.probe_once else load_loom_gemv()[0]
    if not (args.no_probe or args.probe_once):
        # This VM's memory and GEMM rates drift by tens of percent over minutes: a roof probed at
        # start-up can belong to another phase than the steps it judges.
        def paired_probe() -> tuple[float, float]:
            with torch.inference_mode():
                return (probe_gemv(dtype_name, paired_kernel, working_set=working_set)["best_gbs"],
                        probe_gemm(dtype_name, kernel=paired_kernel)["gflops"])
    rows: list[dict[str, Any]] = []
    warmup_steps = 0 if args.no_warmup else 2
    with tqdm(total=len(args.batch_sizes) * (warmup_steps + args.output_len), unit="step") as bar:
        for bs in args.batch_sizes:
            if warmup_steps:
                # Untimed, same shapes: first-call costs (kernel selection and JIT for a new
                # row count, allocator growth) stay out of the figures.
                bar.set_description(f"batch {bs} warm-up")
                run_batch(runner, fixed_length_requests(tokenizer, [args.input_len] * bs, [warmup_steps] * bs,
                                                        args.seed + 1), bar)
            bar.set_description(f"batch {bs}")
            requests = fixed_length_requests(tokenizer, [args.input_len] * bs, [args.output_len] * bs, args.seed)
            before = paired_probe() if paired_probe else None
            row = summarize_steps(bs, args.input_len, run_batch(runner, requests, bar))
            if paired_probe:
                after = paired_probe()
                row["paired_probes"] = {"gemv_gbs": [before[0], after[0]], "gemm_gflops": [before[1], after[1]]}
                add_rooflines(row, weights, (before[0] + after[0]) / 2, (before[1] + after[1]) / 2, args.input_len,
                              kv_bytes_per_step(bs))
            else:
                add_rooflines(row, weights, gemv_rate, gemm_rate, args.input_len, kv_bytes_per_step(bs))
            if args.prefill_rounds:
                bar.set_description(f"batch {bs} prefill rounds")
                prompts = fixed_length_requests(tokenizer, [args.input_len] * bs, [1] * bs, args.seed)

                def run_prefill() -> float:
                    return summarize_steps(bs, args.input_len, run_batch(runner, prompts))["prefill_tok_s"]

                def probe_gflops() -> float:
                    with torch.inference_mode():
                        return probe_gemm(dtype_name, kernel=paired_kernel)["gflops"]

                rounds = probed_rounds(run_prefill, probe_gflops, args.prefill_rounds,
                                       1e9 / prompt_flops(weights, args.input_len))
                row["prefill_rounds"] = rounds
                row["prefill_pct_of_gemm_roof_own_probes"] = row["prefill_pct_of_gemm_roof"]
                row["prefill_pct_of_gemm_roof"] = rounds["median_pct_of_roof"]
                print(f"batch {bs} prefill rounds: " + describe_rounds(rounds, "GFLOP/s", "GEMM"), flush=True)
            if args.decode_rounds:
                bar.set_description(f"batch {bs} decode rounds")

                def run_decode() -> float:
                    return summarize_steps(bs, args.input_len, run_batch(runner, requests))["decode_tok_s"]

                with torch.inference_mode():  # (its weights stay allocated through the rounds)
                    gemv = GemvProbe(dtype_name, paired_kernel, working_set=working_set)

                def probe_gbs() -> float:
                    with torch.inference_mode():
                        return gemv.measure()["best_gbs"]

                rounds = probed_rounds(run_decode, probe_gbs, args.decode_rounds,
                                       bandwidth_roof_tok_s(bs, 1.0, weights.bytes + kv_bytes_per_step(bs)))
                del gemv
                row["decode_rounds"] = rounds
                row["decode_pct_of_bandwidth_roof_own_probes"] = row["decode_pct_of_bandwidth_roof"]
                row["decode_pct_of_bandwidth_roof"] = rounds["median_pct_of_roof"]
                print(f"batch {bs} decode rounds: " + describe_rounds(rounds, "GB/s", "bandwidth"), flush=True)
            rows.append(row)
    print(format_rows(rows))
    if rows[0]["batch_size"] == 1 and rows[0].get("bandwidth_roof_tok_s") and rows[0]["decode_tok_s"]:
        probes = rows[0].get("paired_probes")
        source = (f"GEMV {probes['gemv_gbs'][0]:.1f} / {probes['gemv_gbs'][1]:.1f} GB/s before / after"
                  if probes else "the start-up probe")
        rounds = rows[0].get("decode_rounds")
        own = rows[0]["decode_pct_of_bandwidth_roof_own_probes" if rounds else "decode_pct_of_bandwidth_roof"]
        print(f"batch 1: {rows[0]['decode_tok_s']:.1f} decode tok/s = {own:.0f}% "
              f"of the bandwidth limit {rows[0]['bandwidth_roof_tok_s']:.1f} tok/s ({source})"
              + (f"; {len(rounds['tok_s'])} rounds each between probes: median {rounds['median_pct_of_roof']:.0f}%"
                 if rounds else ""))
    kernel_isa = runner.kernel_isa
    hf = None
    if args.hf_baseline:
        runner = None  # free the memory and threads before the baseline
        hf_dtype, hf_reason = resolve_dtype(args.hf_dtype)
        hf = hf_batch1_decode(model_dir, tokenizer, args.input_len, args.output_len, args.seed, hf_dtype)
        hf["dtype_reason"] = hf_reason
        loom_b1 = next((r["decode_tok_s"] for r in rows if r["batch_size"] == 1), None)
        ratio = f" -> loom / HF = {loom_b1 / hf['decode_tok_s']:.2f}x" if loom_b1 else ""
        print(f"HF generate batch 1 ({hf['dtype']}): {hf['decode_tok_s']:.1f} decode tok/s{ratio}")
    llamacpp = None
    if args.llamacpp_baseline:
        if not llama_cpp_installed():
            raise SystemExit("--llamacpp-baseline: llama-cpp-python is not installed")
        runner = None  # free the memory and threads before the baseline
        gguf = args.llamacpp_gguf or embedded_gguf()
        prompt = fixed_length_requests(tokenizer, [args.input_len], [args.output_len], args.seed)[0].input_ids
        llamacpp = llamacpp_batch1_decode(gguf, prompt, args.output_len, num_cores())
        loom_b1 = next((r["decode_tok_s"] for r in rows if r["batch_size"] == 1), None)
        ratio = f" -> loom / llama.cpp = {loom_b1 / llamacpp['decode_tok_s']:.2f}x" if loom_b1 else ""
        print(f"llama.cpp batch 1 ({llamacpp['dtype']}, {llamacpp['threads']} threads): "
              f"{llamacpp['decode_tok_s']:.1f} decode tok/s{ratio}")
    multi_step = [r["batch_size"] for r in rows if r["prefill_steps"] != 1]
    if multi_step:
        print(f"NOTE: the prefill took more than one step at batch sizes {multi_step}", file=sys.stderr)

    result = {
        "benchmark": "bench_one_batch",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine,
        "model": {"dir": str(model_dir), "dtype": dtype_name, "dtype_reason": dtype_reason,
                  "kernel_backend": backend, "kernel_isa": kernel_isa, "quantization": args.quantization,
                  "kv_cache_dtype": kv_dtype_name,
                  "kv_slots": kv_slots, "matmul_params": weights.matmul_params, "weight_bytes": weights.bytes,
                  "flops_per_token": weights.flops_per_token},
        "rooflines": {"gemv_rate_gbs": gemv_rate, "gemm_gflops": gemm_rate,
                      "batch1_bandwidth_limit_tok_s": batch1_limit, "paired_probes": paired_probe is not None,
                      "note": "bandwidth roof = batch x GEMV rate / (weight bytes + the batch's KV reads a step, "
                              "results[i].kv_bytes_per_step); GEMM roof = "
                              "GEMM rate / (2 x weight parameters) (attention FLOPs ignored); with paired probes "
                              "each row's rates are the mean of the probes right before and after its steps "
                              "(results[i].paired_probes), else the start-up probe's"},
        "results": rows,
        "hf_batch1": hf,
        "llamacpp_batch1": llamacpp,
    }
    path = write_json(args.json or default_result_path("bench_one_batch"), result)
    print(f"results: {path}")
    if not args.no_plot:
        from benchmarks.plots import plot_throughput_vs_batch

        plot_throughput_vs_batch(rows, path.with_suffix(".png"),
                                 f"loom one batch, {dtype_name}, {args.input_len} in / {args.output_len} out")
    return result


if __name__ == "__main__":
    main()
