"""Per-step timing of the scheduler loop: the worker's forward time, the gap the worker waited
between two forwards while work was queued, the scheduler's own CPU time, and the busy fraction
(forward / (forward + gaps)). Summed since start for the stats, and over the last --log-interval
steps for the log. With --step-log-file, every step's shape and wall time as a JSON line (the
simulator fits its step-time model to them: `python -m sim profile --step-log`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# A step's shape, as the simulator's step-time model reads it (one pass over its rows):
#   tokens        tokens computed (prompt tokens + one per decode)
#   sampled       LM-head rows: one per row that samples (a diffusion row: its whole block)
#   prefill_attn  attention pairs of prompt rows: sum of extend x (prefix + (extend + 1) / 2)
#   decode_ctx    context length summed over decode rows (the KV a decode reads)
#   rows          rows (per-request work: metadata, sampling, streaming)
STEP_FEATURES = ("tokens", "sampled", "prefill_attn", "decode_ctx", "rows")


def step_features(batch) -> tuple[float, float, float, float, float]:
    """The STEP_FEATURES of a ScheduleBatch."""
    tokens = sampled = prefill_attn = decode_ctx = 0
    head_rows = batch.dllm_block_size or 1
    for r in batch.rows:
        e = r.extend_len
        tokens += e
        sampled += head_rows if r.samples else 0
        if e == 1 and r.prefix_len > 0:
            decode_ctx += r.prefix_len + 1
        else:
            prefill_attn += e * (r.prefix_len + (e + 1) * 0.5)
    return tokens, sampled, prefill_attn, decode_ctx, len(batch.rows)


class StepRecorder:
    """--step-log-file: one JSON line per applied step. `seconds` is the step's share of the
    scheduler's wall clock as the simulator counts a step: from the previous step's result applied
    (or, after idle, from when this step's planning began) to this step's result applied and its
    tokens sent on. It holds the forward, the worker gap, the scheduler's own work and whatever
    the other processes on the machine take from it."""

    def __init__(self, path: str | None):
        # line-buffered: a step's line is on disk when its tokens are out (a write per step is noise)
        self.file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 (open for the run)
        self.last_applied: float | None = None
        self.planned_at: dict[int, float] = {}  # step -> when the plan that made it began

    def on_planned(self, batch, planning_began: float) -> None:
        if self.file is not None:
            self.planned_at[batch.step] = planning_began

    def on_applied(self, batch, now: float, after_idle: bool, forward_s: float) -> None:
        if self.file is None:
            return
        planned_at = self.planned_at.pop(batch.step)
        start = planned_at if after_idle or self.last_applied is None else self.last_applied
        self.last_applied = now
        self.file.write(json.dumps({"step": batch.step, "seconds": round(now - start, 6),
                                    "forward_s": round(forward_s, 6), "after_idle": after_idle,
                                    "shape": step_features(batch)}) + "\n")

    def on_idle(self) -> None:
        self.last_applied = None


@dataclass(slots=True)
class StepTotals:
    steps: int = 0
    forward_s: float = 0.0
    gap_s: float = 0.0  # worker idle between forwards, counted only while the scheduler had work
    scheduler_cpu_s: float = 0.0
    collective_s: float = 0.0  # of forward_s: tensor-parallel collectives (rank 0)

    @property
    def busy_fraction(self) -> float:
        busy = self.forward_s + self.gap_s
        return self.forward_s / busy if busy else 0.0

    def add(self, forward_s: float, gap_s: float, collective_s: float) -> None:
        self.steps += 1
        self.forward_s += forward_s
        self.gap_s += gap_s
        self.collective_s += collective_s


@dataclass(slots=True)
class StepMetrics:
    log_interval: int = 0  # steps between log lines (0: none)
    total: StepTotals = field(default_factory=StepTotals)
    window: StepTotals = field(default_factory=StepTotals)
    overlapped: int = 0  # steps planned while the one before ran
    overlap_skips: dict[str, int] = field(default_factory=dict)  # reason -> steps not planned ahead

    def on_step(self, forward_s: float, gap_s: float, collective_s: float) -> str | None:
        """Records a finished step; returns a log line every log_interval steps."""
        for t in (self.total, self.window):
            t.add(forward_s, gap_s, collective_s)
        if not self.log_interval or self.window.steps < self.log_interval:
            return None
        w, self.window = self.window, StepTotals()
        return (f"last {w.steps} steps: forward {1e3 * w.forward_s / w.steps:.1f} ms, worker gap "
                f"{1e3 * w.gap_s / w.steps:.2f} ms, scheduler cpu {1e3 * w.scheduler_cpu_s / w.steps:.2f} ms "
                f"a step; busy {w.busy_fraction:.3f}")

    def on_scheduler_cpu(self, seconds: float) -> None:
        self.total.scheduler_cpu_s += seconds
        self.window.scheduler_cpu_s += seconds

    def stats(self) -> dict[str, float | int]:
        t = self.total
        return {"forward_steps": t.steps, "forward_seconds": t.forward_s, "worker_gap_seconds": t.gap_s,
                "scheduler_cpu_seconds": t.scheduler_cpu_s, "collective_seconds": t.collective_s,
                "busy_fraction": t.busy_fraction, "overlapped_steps": self.overlapped,
                **{f"overlap_skipped_{reason.replace('-', '_')}": n for reason, n in self.overlap_skips.items()}}
