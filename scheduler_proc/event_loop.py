"""The scheduler's event loops over the same scheduling core; they differ only in when they call
it (--disable-overlap-schedule picks the normal one, --pp-size > 1 the pipeline's).

normal:  plan step N, run it, apply its result, plan N+1, ...
overlap: plan and launch step N+1 while step N runs, then apply N's result: the scheduler's CPU
         work (applying results, streaming, planning) hides behind the worker's forward pass.
         Step N+1 feeds N's sampled tokens by reference (the core's placeholders, resolved in the
         worker). When the core says planning ahead helps nothing or costs (overlap_blocker),
         the loop applies N's result first; each such step is counted by reason.
pipeline: up to --pp-size steps in flight, each over requests no other step in flight holds
         (SchedulerConfig.pipeline_stages: micro-batches), so stage s computes step N while stage
         s+1 computes step N-1. Results come back in launch order; each applied one frees its
         requests for the next plan.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler_proc.process import SchedulerProcess
    from scheduler_proc.schedule_batch import ScheduleBatch


def event_loop_normal(proc: "SchedulerProcess") -> None:
    while True:
        cpu = time.thread_time()
        batch = proc.plan()
        if batch is None:
            proc.metrics.on_scheduler_cpu(time.thread_time() - cpu)
            proc.idle_wait()
            continue
        proc.launch(batch)
        proc.metrics.on_scheduler_cpu(time.thread_time() - cpu)
        cpu = time.thread_time()
        proc.apply_result(batch)
        proc.metrics.on_scheduler_cpu(time.thread_time() - cpu)


def event_loop_overlap(proc: "SchedulerProcess") -> None:
    in_flight: "ScheduleBatch | None" = None
    while True:
        cpu = time.thread_time()
        proc.drain_requests()
        if in_flight is not None:
            reason = proc.core.overlap_blocker(in_flight)
            if reason is not None:  # apply the running step's result before planning the next
                proc.metrics.overlap_skips[reason] = proc.metrics.overlap_skips.get(reason, 0) + 1
                proc.apply_result(in_flight)
                in_flight = None
        batch = proc.plan()
        if batch is not None:
            proc.launch(batch, after=in_flight)
            proc.metrics.overlapped += in_flight is not None
        idle = batch is None and in_flight is None
        if in_flight is not None:  # (its result may free room, or requests arrived meanwhile: plan again)
            proc.apply_result(in_flight)
        in_flight = batch
        proc.metrics.on_scheduler_cpu(time.thread_time() - cpu)
        if idle:
            proc.idle_wait()


def event_loop_pipeline(proc: "SchedulerProcess", stages: int) -> None:
    in_flight: "deque[ScheduleBatch]" = deque()
    while True:
        cpu = time.thread_time()
        while len(in_flight) < stages:
            batch = proc.plan()
            if batch is None:
                break
            proc.launch(batch)
            in_flight.append(batch)
        idle = not in_flight  # (the planning above found nothing to run)
        if in_flight:
            proc.apply_result(in_flight.popleft())
        proc.metrics.on_scheduler_cpu(time.thread_time() - cpu)
        if idle:
            proc.idle_wait()
