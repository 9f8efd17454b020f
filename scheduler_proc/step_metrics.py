"""Per-step timing of the scheduler loop: the worker's forward time, the gap the worker waited
between two forwards while work was queued, the scheduler's own CPU time, and the busy fraction
(forward / (forward + gaps)). Summed since start for the stats, and over the last --log-interval
steps for the log."""

from __future__ import annotations

from dataclasses import dataclass, field


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
