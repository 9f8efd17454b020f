"""The simulator's command line.

  python -m sim profile --out sim_profile.json [server flags]     time this machine's worker, fit
  python -m sim run --predictor sim_profile.json [workload] [server flags] --out DIR
  python -m sim run --hardware h100 --model-shape llama-2-7b --dp-size 16 --num-requests 100000 --rate 160
  python -m sim compare --vary batching_strategy=loom,sarathi,vllm,orca,lightllm,static [...]

Server flags are the server's own (`python launch.py --help`): --batching-strategy,
--schedule-policy, --max-running-requests, --chunked-prefill-size, --dp-size (replicas),
--load-balance-method (the global scheduler), --disable-radix-cache, ...
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from sim.predictor import DEVICES, MODELS, FittedPredictor, RooflinePredictor


def _add_workload(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=1000, help="requests generated (default %(default)s)")
    w.add_argument("--arrival", choices=("poisson", "gamma", "burst"), default="poisson",
                   help="arrival process (burst: all at time 0)")
    w.add_argument("--rate", type=float, default=10.0, help="mean requests per second, all replicas together")
    w.add_argument("--cv", type=float, default=1.0, help="gamma arrivals: coefficient of variation of the gaps")
    w.add_argument("--length-dist", choices=("fixed", "uniform", "zipf"), default="uniform",
                   help="request length distribution")
    w.add_argument("--min-len", type=int, default=256, help="shortest request (prompt + output) with --pd-ratio")
    w.add_argument("--max-len", type=int, default=2048, help="longest request (prompt + output) with --pd-ratio")
    w.add_argument("--pd-ratio", type=float, default=20.0,
                   help="prompt:output token ratio of each request (0: draw --prompt-len and --output-len apart)")
    w.add_argument("--prompt-len", type=int, nargs=2, default=(128, 512), metavar=("LOW", "HIGH"))
    w.add_argument("--output-len", type=int, nargs=2, default=(32, 128), metavar=("LOW", "HIGH"))
    w.add_argument("--zipf-theta", type=float, default=1.1)
    w.add_argument("--shared-prefix-groups", type=int, default=0,
                   help="requests belong to this many groups sharing a prompt prefix (the prefix cache)")
    w.add_argument("--shared-prefix-len", type=int, default=0, help="tokens each group shares")
    w.add_argument("--trace", type=Path, help="replay a CSV trace (arrived_at, num_prefill_tokens, num_decode_tokens)")
    w.add_argument("--replay", type=Path,
                   help="replay a bench_serving or bench_offline JSON result, and compare with what it measured")
    w.add_argument("--seed", type=int, default=0)


def _add_sim(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("simulation")
    s.add_argument("--predictor", type=Path, help="a fitted step-time model (python -m sim profile)")
    s.add_argument("--hardware", choices=sorted(DEVICES), help="roofline step times on this device ...")
    s.add_argument("--model-shape", choices=sorted(MODELS), help="... for this model's shapes")
    s.add_argument("--kv-slots", type=int,
                   help="KV token slots per replica (default: --kv-cache-gb over the profiled model's bytes per "
                        "token; on --hardware, 90%% of its memory less the weights)")
    s.add_argument("--hardware-memory-gb", type=float, default=80.0,
                   help="memory of one device of --hardware (a replica has --tp-size of them)")
    s.add_argument("--max-context-len", type=int, help="context limit (default: the profiled model's, or 8192)")
    s.add_argument("--pp-stages", type=int, default=1, help="pipeline stages per replica (micro-batches)")
    s.add_argument("--dllm-rounds", type=int, nargs=2, default=(4, 12), metavar=("LOW", "HIGH"),
                   help="with --dllm-algorithm: forward rounds a diffusion block needs, uniform in [LOW, HIGH] (a live "
                        "server's dllm_rounds / dllm_blocks_committed is the figure)")
    s.add_argument("--out", type=Path, help="folder for summary.json, requests.csv, trace.json and plots")
    s.add_argument("--trace-steps", type=int, default=200_000, help="steps written to the Chrome trace")
    s.add_argument("--no-progress", action="store_true")


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    from launch import ServerArgs

    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_workload(p)
    _add_sim(p)
    ServerArgs.add_arguments(p.add_argument_group("server flags (the scheduler simulated)"))
    return p


def _requests(args):
    from sim import workload

    if args.replay:
        return workload.from_bench_json(args.replay)
    if args.trace:
        return workload.from_csv(args.trace), None
    pd = args.pd_ratio if args.pd_ratio > 0 else None
    return workload.generate(args.num_requests, arrival=args.arrival, rate=args.rate, cv=args.cv,
                             length_dist=args.length_dist, min_len=args.min_len, max_len=args.max_len, pd_ratio=pd,
                             prompt_len=tuple(args.prompt_len), output_len=tuple(args.output_len),
                             zipf_theta=args.zipf_theta, shared_prefix_groups=args.shared_prefix_groups,
                             shared_prefix_len=args.shared_prefix_len, seed=args.seed), None


def _predictor_and_pool(args) -> tuple[object, int, int]:
    if args.predictor:
        pred = FittedPredictor.load(args.predictor)
        per_token = pred.meta.get("kv_bytes_per_token")
        slots = args.kv_slots or (int(args.kv_cache_gb / args.dp_size * (1 << 30)) // per_token if per_token else None)
        context = args.max_context_len or pred.meta.get("context_len") or 8192
    elif args.hardware and args.model_shape:
        try:
            pred = RooflinePredictor.named(args.hardware, args.model_shape, args.tp_size)
        except ValueError as e:
            raise SystemExit(str(e))
        shape = MODELS[args.model_shape]
        free = args.hardware_memory_gb * 1e9 * 0.9 * args.tp_size - shape.weight_bytes  # (a replica's devices)
        slots = args.kv_slots or int(free // pred.kv_bytes_per_token)
        context = args.max_context_len or 8192
    else:
        raise SystemExit("give --predictor FILE (python -m sim profile), or --hardware and --model-shape")
    if not slots or slots < 16:
        raise SystemExit("--kv-slots: give the KV token slots per replica")
    return pred, slots, context


def simulate(args, overrides: dict | None = None):
    from scheduler_proc.core import SchedulerConfig
    from sim.simulator import Simulator

    if overrides:  # (first: --vary kv_cache_gb or dp_size changes the pool per replica)
        args = argparse.Namespace(**{**vars(args), **overrides})
    if getattr(args, "speculative_algorithm", None):
        raise SystemExit("--speculative-algorithm: the simulator has no model outputs to draft from or confirm")
    pred, slots, context = _predictor_and_pool(args)
    requests, measured = _requests(args)
    # block diffusion: the block size the flag gives (the server reads it from the checkpoint)
    dllm = {"dllm_block_size": args.dllm_block_size or 32, "dllm_fdfo": args.dllm_fdfo,
            "dllm_in_place": args.dllm_in_place} if args.dllm_algorithm else {}
    sim = Simulator(SchedulerConfig.from_args(vars(args), slots, context, **dllm), pred, replicas=args.dp_size,
                    pp_stages=args.pp_stages, load_balance_method=args.load_balance_method, seed=args.seed,
                    progress=not args.no_progress, dllm_rounds=tuple(args.dllm_rounds),
                    overlap=not args.disable_overlap_schedule)
    return sim.run(requests), measured


def _fmt_summary(s: dict) -> str:
    def ms(d, key="p50"):
        return f"{d[key] * 1e3:.1f}" if d else "-"

    return (f"{s['requests']} requests on {s['replicas']} replica(s), {s['steps']} steps, simulated "
            f"{s['simulated_s']:.1f} s in {s['wall_s']:.1f} s wall\n"
            f"  throughput {s['output_tok_s']:.1f} output tok/s, {s['requests_per_s']:.2f} req/s\n"
            f"  TTFT p50 {ms(s['ttft_s'])} ms p99 {ms(s['ttft_s'], 'p99')} ms | TBT p50 {ms(s['tbt_s'])} ms "
            f"p99 {ms(s['tbt_s'], 'p99')} ms | e2e p50 {ms(s['e2e_s'])} ms p99 {ms(s['e2e_s'], 'p99')} ms\n"
            f"  preemptions {s['preemptions']} ({s['preempted_requests']} requests), mean rows/step "
            f"{s['mean_batch_rows']:.1f}, mean KV use {s['mean_kv_use']:.0%}")


def fidelity(summary: dict, measured: dict) -> dict:
    """Simulated against measured: median TTFT, median e2e, output throughput; error as a fraction."""
    pairs = {"ttft_p50_s": ((summary["ttft_s"] or {}).get("p50"), measured.get("ttft_s")),
             "e2e_p50_s": ((summary["e2e_s"] or {}).get("p50"), measured.get("e2e_s")),
             "output_tok_s": (summary["output_tok_s"], measured.get("output_tok_s"))}
    return {k: {"simulated": s, "measured": m, "error": (s - m) / m if s is not None and m else None}
            for k, (s, m) in pairs.items()}


def cmd_run(argv: list[str]) -> dict:
    from sim import metrics

    args = _parser("python -m sim run", "Simulate one configuration.").parse_args(argv)
    result, measured = simulate(args)
    summary = metrics.summary(result)
    print(_fmt_summary(summary))
    if measured:
        summary["fidelity"] = fidelity(summary, measured)
        for k, v in summary["fidelity"].items():
            if v["error"] is not None:
                print(f"  {k}: simulated {v['simulated']:.4g}, measured {v['measured']:.4g}, error {v['error']:+.1%}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        metrics.write_requests_csv(result, args.out / "requests.csv")
        n = metrics.write_chrome_trace(result, args.out / "trace.json", args.trace_steps)
        metrics.plot({"simulated": result}, args.out / "latency.png", _title(args))
        print(f"wrote {args.out}/summary.json, requests.csv, trace.json ({n} steps), latency.png")
    return summary


def _title(args) -> str:
    return (f"{args.batching_strategy} batching, {args.dp_size} replica(s), {args.load_balance_method}, "
            f"{args.arrival} {args.rate:g} req/s")


def cmd_compare(argv: list[str]) -> dict:
    from sim import metrics

    p = _parser("python -m sim compare", "Simulate the same requests under several configurations.")
    p.add_argument("--vary", action="append", required=True, metavar="FLAG=V1,V2,...",
                   help="a server or simulation flag (underscores) and its values; several --vary: every combination")
    args = p.parse_args(argv)
    axes = []
    for spec in args.vary:
        name, _, values = spec.partition("=")
        name = name.replace("-", "_").lstrip("_")
        if name not in vars(args) or not values:
            raise SystemExit(f"--vary {spec!r}: give FLAG=V1,V2 with a flag of `python -m sim run`")
        current = getattr(args, name)
        cast = type(current) if current is not None and not isinstance(current, bool) else \
            (lambda v: v.lower() in ("1", "true", "yes")) if isinstance(current, bool) else str
        axes.append([(name, cast(v)) for v in values.split(",")])
    results, summaries = {}, {}
    for combo in itertools.product(*axes):
        label = ", ".join(f"{n}={v}" for n, v in combo)
        print(f"== {label}", flush=True)
        result, measured = simulate(args, dict(combo))
        results[label], summaries[label] = result, metrics.summary(result)
        print(_fmt_summary(summaries[label]))
    rows = [("configuration", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TBT p99 ms", "e2e p50 ms", "preempt")]
    for label, s in summaries.items():
        rows.append((label, f"{s['output_tok_s']:.1f}", f"{s['ttft_s']['p50'] * 1e3:.1f}",
                     f"{s['ttft_s']['p99'] * 1e3:.1f}", f"{s['tbt_s']['p99'] * 1e3:.1f}" if s["tbt_s"] else "-",
                     f"{s['e2e_s']['p50'] * 1e3:.1f}", str(s["preemptions"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compare.json").write_text(json.dumps(summaries, indent=1, default=str))
        metrics.plot(results, args.out / "compare.png", _title(args))
        print(f"wrote {args.out}/compare.json, compare.png")
    return summaries


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"run": cmd_run, "compare": cmd_compare}
    if not argv or argv[0] not in (*commands, "profile"):
        print(__doc__)
        raise SystemExit(2)
    if argv[0] == "profile":
        from sim.profile import main as profile_main

        return profile_main(argv[1:])
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
