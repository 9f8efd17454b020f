"""What a simulation measured: per-request metrics (CSV), a JSON summary, a Chrome trace of the
steps (chrome://tracing or Perfetto), and matplotlib plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from sim.simulator import SimResult

REQUEST_COLUMNS = ("rid", "replica", "arrival", "prompt_len", "output_len", "schedule_delay", "ttft", "tbt_mean",
                   "tbt_max", "e2e", "preempted_s", "restarts", "finish_reason")


def request_rows(result: SimResult) -> list[dict]:
    rows = []
    for r in result.records:
        done = r.finished >= 0 and r.first_token >= 0
        rows.append({
            "rid": r.rid, "replica": r.replica, "arrival": r.arrival, "prompt_len": r.prompt_len,
            "output_len": r.output_len,
            "schedule_delay": r.scheduled - r.arrival if r.scheduled >= 0 else None,
            "ttft": r.first_token - r.arrival if done else None,
            "tbt_mean": (r.last_token - r.first_token) / (r.tokens - 1) if done and r.tokens > 1 else None,
            "tbt_max": r.tbt_max if done else None,
            "e2e": r.finished - r.arrival if done else None,
            "preempted_s": r.preempted_s, "restarts": r.restarts, "finish_reason": r.finish_reason,
        })
    return rows


def _pcts(values) -> dict[str, float] | None:
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    if not len(v):
        return None
    p = np.percentile(v, [50, 90, 99])
    return {"mean": float(v.mean()), "p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2]), "max": float(v.max())}


def summary(result: SimResult) -> dict:
    rows = request_rows(result)
    out_tokens = sum(r.tokens for r in result.records)
    in_tokens = sum(r.prompt_len for r in result.records)
    steps = result.steps
    span = result.end_time - min((r.arrival for r in result.records), default=0.0)
    return {
        "requests": len(result.records),
        "completed": sum(r["finish_reason"] == "length" for r in rows),
        "refused": sum(r["finish_reason"] == "abort" for r in rows),
        "replicas": result.replicas,
        "kv_slots_per_replica": result.kv_slots,
        "predictor": result.predictor,
        "simulated_s": result.end_time,
        "wall_s": result.wall_s,
        "steps": len(steps),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / span if span > 0 else None,
        "requests_per_s": len(result.records) / span if span > 0 else None,
        "ttft_s": _pcts(r["ttft"] for r in rows),
        "tbt_s": _pcts(result.tbts),
        "e2e_s": _pcts(r["e2e"] for r in rows),
        "schedule_delay_s": _pcts(r["schedule_delay"] for r in rows),
        "preemptions": sum(r.restarts for r in result.records),
        "preempted_requests": sum(r.restarts > 0 for r in result.records),
        "mean_batch_rows": float(np.mean(steps.rows)) if len(steps) else 0.0,
        "mean_step_tokens": float(np.mean(steps.tokens)) if len(steps) else 0.0,
        "mean_kv_use": float(np.mean(steps.kv_used)) / result.kv_slots if len(steps) else 0.0,
        "config": {k: v for k, v in result.config.items() if k != "eos_token_ids"},
    }


def write_requests_csv(result: SimResult, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=REQUEST_COLUMNS)
        w.writeheader()
        w.writerows(request_rows(result))


def write_chrome_trace(result: SimResult, path: Path, max_steps: int = 200_000) -> int:
    """Steps as complete events, one process per replica (the first max_steps steps); returns
    how many were written."""
    s = result.steps
    n = min(len(s), max_steps)
    events = [{"name": "replica", "ph": "M", "pid": i, "tid": 0, "args": {"name": f"replica {i}"}}
              for i in range(result.replicas)]
    for i in range(n):
        events.append({"name": f"{s.rows[i]} rows", "ph": "X", "pid": s.replica[i], "tid": 0,
                       "ts": s.start[i] * 1e6, "dur": s.duration[i] * 1e6,
                       "args": {"tokens": s.tokens[i], "decodes": s.decodes[i], "kv_used": s.kv_used[i],
                                "waiting": s.waiting[i]}})
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return n


def plot(results: dict[str, SimResult], path: Path, title: str = "") -> None:
    """Latency CDFs (TTFT, TBT, e2e) of each labelled result, and batch size and KV use over
    time (replica 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for label, res in results.items():
        rows = request_rows(res)
        for ax, key, name in ((axes[0][0], "ttft", "TTFT"), (axes[0][2], "e2e", "end-to-end latency")):
            v = np.sort([r[key] for r in rows if r[key] is not None])
            if len(v):
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)
            ax.set_xlabel(f"{name} (s)")
        tbt = np.sort(np.asarray(res.tbts))
        if len(tbt):
            step = max(1, len(tbt) // 5000)
            axes[0][1].plot(tbt[::step], np.linspace(0, 1, len(tbt[::step])), label=label)
        axes[0][1].set_xlabel("time between tokens (s)")
        s = res.steps
        mine = np.asarray(s.replica) == 0
        t = np.asarray(s.start)[mine]
        stride = max(1, len(t) // 4000)
        axes[1][0].plot(t[::stride], np.asarray(s.rows)[mine][::stride], label=label, lw=0.8)
        axes[1][1].plot(t[::stride], np.asarray(s.kv_used)[mine][::stride] / res.kv_slots, label=label, lw=0.8)
        axes[1][2].plot(t[::stride], np.asarray(s.waiting)[mine][::stride], label=label, lw=0.8)
    for ax in axes[0]:
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    for ax, name in zip(axes[1], ("rows per step", "KV pool in use", "requests waiting")):
        ax.set_xlabel("time (s), replica 0")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
