"""Scheduler CPU time per step: the scheduling core alone (no model, no sockets) with N requests
decoding at once: planning the step (`next_batch`), its wire form for the worker
(`to_worker_batch`) and applying the sampled tokens (`on_result`).

    python benchmarks/bench_scheduler.py                  # 256 running requests
    python benchmarks/bench_scheduler.py --running 1024 --steps 500
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_repo_to_path, cpu_info, format_cpu_header  # noqa: E402

add_repo_to_path()

import numpy as np  # noqa: E402

from ipc.messages import SamplingParams  # noqa: E402
from scheduler_proc.core import SchedulerConfig, SchedulerCore  # noqa: E402
from scheduler_proc.req import Req  # noqa: E402


def measure(running: int, steps: int, prompt_len: int, warmup: int = 10) -> dict[str, float]:
    """Mean milliseconds per step of each phase, once every request decodes."""
    core = SchedulerCore(SchedulerConfig(max_total_tokens=running * (prompt_len + steps + warmup + 16),
                                         max_running_requests=running, max_prefill_tokens=running * prompt_len,
                                         max_context_len=prompt_len + steps + warmup + 16))
    rng = np.random.default_rng(0)
    for i in range(running):
        core.add_request(Req(str(i), rng.integers(100, 1000, prompt_len).tolist(),
                             SamplingParams(max_new_tokens=steps + warmup + 8, ignore_eos=True)))
    totals = {"next_batch": 0.0, "to_worker_batch": 0.0, "on_result": 0.0}
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        batch, _ = core.next_batch(float(step))
        t1 = time.perf_counter()
        wire = batch.to_worker_batch()
        t2 = time.perf_counter()
        core.on_result(batch, [7] * len(wire.sample_rows))
        t3 = time.perf_counter()
        if step >= warmup:
            assert len(core.running) == running
            for key, dt in zip(totals, (t1 - t0, t2 - t1, t3 - t2)):
                totals[key] += dt
    out = {k: v / steps * 1e3 for k, v in totals.items()}
    out["total"] = sum(out.values())
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--running", type=int, default=256, help="requests decoding at once (default: %(default)s)")
    p.add_argument("--steps", type=int, default=200, help="measured steps (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=300, help="prompt tokens per request (default: %(default)s)")
    args = p.parse_args(argv)
    print("\n".join(format_cpu_header(cpu_info())))
    r = measure(args.running, args.steps, args.prompt_len)
    print(f"{args.running} running requests, ms per step: next_batch {r['next_batch']:.2f}  "
          f"to_worker_batch {r['to_worker_batch']:.2f}  on_result {r['on_result']:.2f}  total {r['total']:.2f}")


if __name__ == "__main__":
    main()
