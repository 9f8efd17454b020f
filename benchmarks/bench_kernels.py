"""Op by op, what a decode step of loom's model costs on this CPU: each of the model's linears at
the given row counts, and decode attention over the KV layout a batch leaves in the pool, each from
memory (as a step reads them: every layer's weights or pool in turn, evicted in between) and again
from cache (one layer's, called over and over), against this CPU's GEMV and GEMM probes.
bench_one_batch says how fast a whole step runs; this says which op holds it below the roofs, and
(`--ops step`) what the weights' stream costs a whole decode step: the compiled layer stack with
the model's weights against one given layer 0's weights in every layer, which then stay in cache.

Linears run as the model's op-by-op path calls them (the kernels, packing and dtype that launch.py
would pick), each call in a parallel region of its own: a step's compiled layer stack runs them in
one region, parted by barriers, so a small call here also pays a wake-up and a join that a step
does not. Attention calls the paged kernel on the model's pools with each row's first tokens in
contiguous slots and its last --decoded tokens interleaved across the batch, as decode steps leave
them."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

if __package__ in (None, ""):  # run as a script: make the repo root and `benchmarks` importable
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_repo_to_path, default_result_path, num_cores, write_json  # noqa: E402

add_repo_to_path()

import torch  # noqa: E402

from benchmarks.bench_one_batch import WeightStats, add_model_args, streamed_bytes  # noqa: E402
from benchmarks.probes import (PROBE_DTYPES, describe_machine, gemm_gflops, gemv_gbs, header_lines,  # noqa: E402
                               probe_machine)
from worker_proc.kv_cache import KVPool, resolve_kv_dtype  # noqa: E402

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="linears,attention",
                   help="comma list of linears, attention, step (default: %(default)s)")
    p.add_argument("--rows", default="1,32,256", help="linears: comma list of row counts (default: %(default)s)")
    p.add_argument("--batch-sizes", default="1,32,128", help="attention: comma list of decode rows (default: %(default)s)")
    p.add_argument("--context", type=int, default=160, help="attention: cached tokens a row (default: %(default)s)")
    p.add_argument("--decoded", type=int, default=32,
                   help="attention: of those, the last ones a row decoded, in slots interleaved across the batch "
                        "(default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="timed passes of each measurement; the median is taken "
                                                         "(default: %(default)s)")
    add_model_args(p)
    p.add_argument("--no-probe", action="store_true", help="skip the GEMV / GEMM probes (no %% of roof)")
    p.add_argument("--json", default=None, help="result file (default: benchmarks/results/bench_kernels_<time>.json)")
    args = p.parse_args(argv)
    args.ops = [o for o in args.ops.split(",") if o]
    if set(args.ops) - {"linears", "attention", "step"}:
        p.error(f"--ops: choose from linears, attention, step (got {','.join(args.ops)})")
    args.rows = [int(r) for r in args.rows.split(",") if r]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    if min(args.rows + args.batch_sizes, default=1) < 1:
        p.error("--rows and --batch-sizes take positive counts")
    if not 0 <= args.decoded <= args.context or args.context < 1:
        p.error("--decoded must lie between 0 and --context, and --context be positive")
    return args


def median_time(fn: Callable[[], None], rounds: int) -> float:
    """Median seconds of `fn` over `rounds` calls after one untimed call (first-call costs)."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---- linears --------------------------------------------------------------------------------------

def layer_linears(model: torch.nn.Module) -> dict[str, list[torch.nn.Module]]:
    """Each linear of the model by name, one module a layer (the LM head: one)."""
    linears = {
        "qkv_proj": [layer.self_attn.qkv_proj for layer in model.layers],
        "o_proj": [layer.self_attn.o_proj for layer in model.layers],
        "gate_up_proj": [layer.mlp.gate_up_proj for layer in model.layers],
        "down_proj": [layer.mlp.down_proj for layer in model.layers],
    }
    if model.lm_head is not None:
        linears["lm_head"] = [model.lm_head]
    return linears


def linear_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """[N, K] of each linear from the config (quantized modules keep no [N, K] weight); gate_up:
    the fused [gate; up]."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"qkv_proj": (q + 2 * kv, c.hidden_size), "o_proj": (c.hidden_size, q),
            "gate_up_proj": (2 * c.intermediate_size, c.hidden_size), "down_proj": (c.hidden_size, c.intermediate_size),
            "lm_head": (c.vocab_size, c.hidden_size)}


def time_linears(model: torch.nn.Module, rows: int, rounds: int, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Per linear at `rows` rows: a call's median time from memory (every layer's module in the
    order a step calls them, so each one's weights were evicted by the others since its last use)
    and from cache (layer 0's module called again and again)."""
    linears = layer_linears(model)
    shapes = linear_shapes(model.config)
    ops = model.ops
    inputs = {name: torch.randn(rows, shapes[name][1]).to(dtype) for name in linears}

    def call(name: str, module: torch.nn.Module) -> None:
        x = inputs[name]
        ops.silu_mul_linear(x, module) if name == "gate_up_proj" else module(x)

    def step_order() -> dict[str, float]:
        spent = dict.fromkeys(linears, 0.0)
        for layer in range(len(model.layers)):
            for name in LINEARS[:4]:
                start = time.perf_counter()
                call(name, linears[name][layer])
                spent[name] += time.perf_counter() - start
        if "lm_head" in linears:
            start = time.perf_counter()
            call("lm_head", linears["lm_head"][0])
            spent["lm_head"] += time.perf_counter() - start
        return {name: t / len(linears[name]) for name, t in spent.items()}

    step_order()  # (first calls at this row count: kernel choice, allocator growth)
    passes = [step_order() for _ in range(rounds)]
    out = []
    for name, modules in linears.items():
        module = modules[0]
        n, k = shapes[name]
        # (a gated [gate; up] gives silu(gate) * up: its products are those of both halves)
        flops = 2.0 * rows * n * k
        memory_s = statistics.median(p[name] for p in passes)
        cached_s = (median_time(lambda: [call(name, module) for _ in modules], rounds) / len(modules)
                    if len(modules) > 1 else None)  # (one LM head: it does not fit a cache anyway)
        out.append({"op": name, "rows": rows, "shape_nk": [n, k], "bytes": streamed_bytes(module, rows=rows), "flops": flops,
                    "memory_s": memory_s, "cached_s": cached_s})
    return out


# ---- attention ------------------------------------------------------------------------------------

def decode_slots(batch: int, context: int, decoded: int) -> torch.Tensor:
    """req_to_token [batch, context] int32: row r's first context - decoded tokens in slots of its
    own run, then its decoded tokens one a step, interleaved with the other rows'."""
    prompt = context - decoded
    table = torch.empty(batch, context, dtype=torch.int32)
    for r in range(batch):
        table[r, :prompt] = torch.arange(r * prompt, (r + 1) * prompt, dtype=torch.int32)
        table[r, prompt:] = batch * prompt + torch.arange(decoded, dtype=torch.int32) * batch + r
    return table


def time_attention(kernels: Any, pools: list[torch.Tensor], num_heads: int, head_dim: int, batch: int,
                   context: int, decoded: int, rounds: int, dtype: torch.dtype) -> dict[str, Any]:
    """Decode attention of `batch` rows over `context` cached tokens each: one layer's median time
    from memory (every layer's pool in turn) and from cache (layer 0's pool again and again)."""
    table = decode_slots(batch, context, decoded)
    q = torch.randn(batch, num_heads, head_dim).to(dtype)
    rows = torch.arange(batch)
    lens = (table, rows, rows, torch.ones(batch, dtype=torch.long), torch.full((batch,), context, dtype=torch.long),
            head_dim**-0.5)

    def layers(which: Callable[[int], torch.Tensor]) -> None:
        for layer in range(len(pools)):
            kernels.paged_attention(q, which(layer), *lens)

    memory_s = median_time(lambda: layers(lambda i: pools[i]), rounds) / len(pools)
    cached_s = median_time(lambda: layers(lambda i: pools[0]), rounds) / len(pools)
    slot_bytes = pools[0][0].numel() * pools[0].element_size()
    return {"op": "decode_attention", "rows": batch, "context": context, "decoded": decoded,
            "bytes": batch * context * slot_bytes, "memory_s": memory_s, "cached_s": cached_s}


# ---- whole steps -----------------------------------------------------------------------------------

def layer0_stack(model: torch.nn.Module, kernels: Any) -> Any:
    """A compiled layer stack like the model's with layer 0's weights (norms and linears) in every
    layer: a step through it does the same work with its weights in cache (the LM head streams)."""
    stack, weights = model.headed_layer_stack(kernels), model.layers[0].layer_stack_args()
    for _ in model.layers:
        stack.add_layer(*weights)
    return stack


def time_steps(runner: Any, kernels: Any, batch: int, context: int, decoded: int, rounds: int) -> dict[str, Any]:
    """Decode steps of `batch` rows from `context` - `decoded` to `context` cached tokens, through the
    model's layer stack and through layer0_stack's in turn (`rounds` batches each): the median
    step's forward time of each."""
    from benchmarks.bench_one_batch import run_batch
    from benchmarks.common import Request

    model = runner.model
    stacks = {"memory_s": model.layer_stack, "cached_s": layer0_stack(model, kernels)}
    prompt = max(1, context - decoded)
    requests = [Request(list(range(100, 100 + prompt)), max(2, decoded)) for _ in range(batch)]
    times: dict[str, list[float]] = {key: [] for key in stacks}
    try:
        run_batch(runner, requests)  # (first steps at these shapes)
        for _ in range(rounds):
            for key, stack in stacks.items():
                model.layer_stack = stack
                times[key].append(statistics.median(s.forward_s for s in run_batch(runner, requests) if s.decode))
    finally:
        model.layer_stack = stacks["memory_s"]
    weights = WeightStats.of(model, model.config)
    return {"op": "decode_step", "rows": batch, "context": context, "decoded": decoded,
            "flops": batch * weights.flops_per_token, "bytes": weights.bytes,  # (the weights; KV reads not counted)
            **{key: statistics.median(v) for key, v in times.items()}}


# ---- report ---------------------------------------------------------------------------------------

def add_rates(row: dict[str, Any], gemv: float | None, gemm: float | None) -> dict[str, Any]:
    for where in ("memory", "cached"):
        seconds = row[f"{where}_s"]
        row[f"{where}_gbs"] = row["bytes"] / seconds / 1e9 if seconds else None
        row[f"{where}_gflops"] = row["flops"] / seconds / 1e9 if seconds and row.get("flops") else None
    row["memory_pct_gemv"] = 100 * row["memory_gbs"] / gemv if gemv and row["memory_gbs"] else None
    row["memory_pct_gemm"] = 100 * row["memory_gflops"] / gemm if gemm and row["memory_gflops"] else None
    return row


def format_rows(rows: list[dict[str, Any]]) -> str:
    def f(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
        return "-" if value is None else f"{value * scale:.{digits}f}"

    head = (f"{'op':<16} {'rows':>5}  {'memory us':>10} {'cached us':>10} {'GB/s mem':>9} {'GFLOP/s mem':>12} "
            f"{'%GEMV':>6} {'%GEMM':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        op = {"decode_attention": f"attention@{r.get('context')}", "decode_step": f"step@{r.get('context')}"}.get(r["op"], r["op"])
        lines.append(f"{op:<16} {r['rows']:>5}  {f(r['memory_s'], 1e6):>10} {f(r['cached_s'], 1e6):>10} "
                     f"{f(r['memory_gbs']):>9} {f(r['memory_gflops'], digits=0):>12} {f(r['memory_pct_gemv'], digits=0):>6} "
                     f"{f(r['memory_pct_gemm'], digits=0):>6}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from worker_proc.dtype_probe import resolve_dtype
    from worker_proc.model_config import ModelConfig
    from worker_proc.model_loader import ensure_default_model
    from worker_proc.model_runner import ModelRunner, RunnerConfig, load_kernels

    torch.set_num_threads(num_cores())  # as loom's worker does
    machine = describe_machine() if args.no_probe else probe_machine(PROBE_DTYPES)
    kernels = load_kernels("auto", "cpu", args.kernel_isa)
    dtype, dtype_reason = resolve_dtype(args.dtype, "cpu", kernels)
    dtype_name = str(dtype).removeprefix("torch.")
    model_dir = Path(args.model_path) if args.model_path else ensure_default_model()
    config = ModelConfig.from_dir(model_dir)
    kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, dtype, args.quantization)
    tokens = max(args.batch_sizes, default=1) * args.context + 1024
    kv_gb = tokens * KVPool.bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, kv_dtype) / 2**30
    runner = ModelRunner(RunnerConfig(str(model_dir), dtype, kv_gb, max(args.batch_sizes, default=1), device="cpu",
                                      kernel_isa=args.kernel_isa, quantization=args.quantization,
                                      kv_cache_dtype=args.kv_cache_dtype))
    gemv, gemm = gemv_gbs(machine, dtype_name), gemm_gflops(machine, dtype_name)
    print("\n".join(header_lines(machine, {"loom": f"{dtype_name}  ({dtype_reason})"}, [
        f"model      {model_dir}",
        f"runner     kernels {runner.kernel_isa}; quantization {args.quantization}; KV cache "
        f"{str(runner.kv_dtype).removeprefix('torch.')}; attention {runner.attention_backend}",
    ])))
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        if "linears" in args.ops:
            for r in args.rows:
                rows += [add_rates(row, gemv, gemm) for row in time_linears(runner.model, r, args.rounds, dtype)]
        attention_kernels = getattr(runner.attn, "kernels", None)
        if "attention" in args.ops and attention_kernels is None:
            print(f"attention: skipped (the {runner.attention_backend} backend has no paged kernel to time)")
        elif "attention" in args.ops:
            heads = runner.model.layers[0].self_attn.num_heads
            for b in args.batch_sizes:
                row = time_attention(attention_kernels, runner.pool.kv, heads, config.head_dim, b, args.context,
                                     args.decoded, args.rounds, dtype)
                rows.append(add_rates(row, gemv, gemm))
        if "step" in args.ops and runner.model.layer_stack is None:
            print("step: skipped (this model and build run no compiled layer stack)")
        elif "step" in args.ops:
            for b in args.batch_sizes:
                rows.append(add_rates(time_steps(runner, kernels, b, args.context, args.decoded, args.rounds),
                                      gemv, gemm))
    print(format_rows(rows))
    result = {"benchmark": "bench_kernels", "machine": machine, "dtype": dtype_name, "dtype_reason": dtype_reason,
              "quantization": args.quantization, "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
              "kernel_isa": runner.kernel_isa, "model": str(model_dir), "rounds": args.rounds, "results": rows}
    path = write_json(Path(args.json) if args.json else default_result_path("bench_kernels"), result)
    print(f"results: {path}")
    return result


if __name__ == "__main__":
    main()
