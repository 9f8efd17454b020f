"""Data, tensor and pipeline parallelism side by side in one run: the same seeded offline workload
through loom's `Engine` at each --configs entry (dp x tp x pp), one after the other, each alone on
the machine.

For each it prints output tok/s and the ratio to the first entry, the steps each data-parallel
rank ran, and from the step trace (the workers time every forward pass and, of it, the
tensor-parallel collectives: all-reduce and the logits gather, waiting for the other ranks
included) the forward and collective milliseconds per step.

    python benchmarks/bench_parallel.py                                   # dp1-tp1, dp2-tp1, dp1-tp3
    python benchmarks/bench_parallel.py --configs dp1-tp1,dp1-tp3 --num-requests 32
    python benchmarks/bench_parallel.py --configs dp1-tp1,dp1-tp1-pp2      # two pipeline stages

The embedded SmolLM2 has 9 attention heads: it runs at --tp-size 1 or 3, not 2.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a script: make the repo root and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (add_repo_to_path, default_result_path, format_table, random_requests,  # noqa: E402
                               write_json)
from benchmarks.probes import describe_machine, header_lines  # noqa: E402

add_repo_to_path()


def parse_configs(text: str) -> list[tuple[int, int, int]]:
    """(dp, tp, pp) of each dpN-tpM[-ppK] entry."""
    configs = []
    for part in text.split(","):
        m = re.fullmatch(r"dp(\d+)-tp(\d+)(?:-pp(\d+))?", part.strip())
        if not m:
            raise SystemExit(f"--configs: {part!r} is not of the form dpN-tpM or dpN-tpM-ppK")
        configs.append((int(m.group(1)), int(m.group(2)), int(m.group(3) or 1)))
    return configs


def config_name(dp: int, tp: int, pp: int) -> str:
    return f"dp{dp}-tp{tp}" + (f"-pp{pp}" if pp > 1 else "")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="dp1-tp1,dp2-tp1,dp1-tp3",
                   help="comma list of dpN-tpM or dpN-tpM-ppK, the first is the reference (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--input-range", default="32,256", help="prompt lengths, inclusive (default: %(default)s)")
    p.add_argument("--output-range", default="16,128", help="output lengths, inclusive (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                   help="(default: %(default)s; auto may choose differently per configuration)")
    p.add_argument("--kv-cache-gb", type=float, default=2.0, help="the whole server's KV memory (default: %(default)s)")
    p.add_argument("--max-running-requests", type=int, default=64, help="per data-parallel rank (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None,
                   help="result file (default: benchmarks/results/bench_parallel_<timestamp>.json)")
    return p.parse_args(argv)


def run_config(dp: int, tp: int, pp: int, requests, args) -> dict[str, Any]:
    from launch import Engine

    with Engine(dtype=args.dtype, dp_size=dp, tp_size=tp, pp_size=pp, kv_cache_gb=args.kv_cache_gb,
                max_running_requests=args.max_running_requests, log_level="warning") as engine:
        engine.generate(input_ids=[[100 + i for i in range(8)]] * dp * 2,
                        sampling_params={"max_new_tokens": 4, "ignore_eos": True, "temperature": 0.0})
        before = engine.get_stats()["dp_ranks"]
        params = [{"max_new_tokens": r.output_len, "ignore_eos": True, "temperature": 0.0} for r in requests]
        start = time.perf_counter()
        outs = engine.generate(input_ids=[r.input_ids for r in requests], sampling_params=params)
        wall = time.perf_counter() - start
        after = engine.get_stats()["dp_ranks"]
    output_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    ranks = []
    for b, a in zip(before, after):
        steps = a["step"] - b["step"]
        forward, collective = a["forward_seconds"] - b["forward_seconds"], a["collective_seconds"] - b["collective_seconds"]
        ranks.append({"dp_rank": a["dp_rank"], "steps": steps, "requests": a["requests_received"] - b["requests_received"],
                      "forward_ms_per_step": 1e3 * forward / max(steps, 1),
                      "collective_ms_per_step": 1e3 * collective / max(steps, 1),
                      "collective_share": collective / forward if forward else 0.0})
    return {"dp_size": dp, "tp_size": tp, "pp_size": pp, "wall_s": wall, "output_tokens": output_tokens,
            "output_tok_s": output_tokens / wall, "ranks": ranks}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from worker_proc.model_loader import ensure_default_model

    configs = parse_configs(args.configs)
    model_dir = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    lo_in, hi_in = map(int, args.input_range.split(","))
    lo_out, hi_out = map(int, args.output_range.split(","))
    requests = random_requests(tokenizer, args.num_requests, (lo_in, hi_in), (lo_out, hi_out), args.seed)
    machine = describe_machine()
    print("\n".join(header_lines(machine, {"loom": args.dtype}, [
        f"workload   {len(requests)} requests, input {args.input_range}, output {args.output_range}, "
        f"all at once; configurations {args.configs}"])), flush=True)

    results = []
    for dp, tp, pp in configs:
        print(f"dp {dp} x tp {tp} x pp {pp} ...", flush=True)
        results.append(run_config(dp, tp, pp, requests, args))
        print(f"  {results[-1]['output_tok_s']:.1f} output tok/s in {results[-1]['wall_s']:.1f} s", flush=True)

    reference = results[0]["output_tok_s"]
    rows = []
    for r in results:
        for rank in r["ranks"]:
            rows.append([config_name(r["dp_size"], r["tp_size"], r["pp_size"]) if rank["dp_rank"] == 0 else "",
                         f"{r['output_tok_s']:.1f}" if rank["dp_rank"] == 0 else "",
                         f"{r['output_tok_s'] / reference:.2f}x" if rank["dp_rank"] == 0 else "",
                         rank["dp_rank"], rank["requests"], rank["steps"], f"{rank['forward_ms_per_step']:.1f}",
                         f"{rank['collective_ms_per_step']:.1f}", f"{100 * rank['collective_share']:.0f}%"])
    print(format_table(["config", "out tok/s", "vs first", "dp rank", "requests", "steps", "forward ms/step",
                        "collective ms/step", "collective share"], rows))
    out = {"benchmark": "bench_parallel", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "args": vars(args),
           "machine": machine, "results": results}
    path = write_json(args.json or default_result_path("bench_parallel"), out)
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
