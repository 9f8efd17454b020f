"""Prometheus metrics of the serving front end (`GET /metrics`): latency histograms and token
counters observed here, scheduler gauges (running / waiting requests, KV usage, prefix cache hit
rate) read at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("loom_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("loom_inter_token_latency_seconds", "Time between output tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("loom_e2e_request_latency_seconds", "Request latency, arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("loom_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_prompt_tokens = Counter("loom_cached_prompt_tokens",
                                            "Prompt tokens of finished requests that were not computed "
                                            "(shared from another request's prefill)", registry=r)
        self.generation_tokens = Counter("loom_generation_tokens", "Generated tokens", registry=r)
        self.finished = Counter("loom_requests_finished", "Finished requests by reason", ["reason"], registry=r)
        # per data-parallel rank (label dp_rank)
        self.running = Gauge("loom_num_running_reqs", "Requests running in the scheduler", ["dp_rank"], registry=r)
        self.waiting = Gauge("loom_num_waiting_reqs", "Requests waiting in the scheduler", ["dp_rank"], registry=r)
        self.kv_usage = Gauge("loom_kv_cache_usage", "Fraction of KV slots in use", ["dp_rank"], registry=r)
        self.retractions = Gauge("loom_num_retractions", "Retractions since start", ["dp_rank"], registry=r)
        self.cache_hit_rate = Gauge("loom_cache_hit_rate",
                                    "Fraction of the scheduler's prompt tokens not computed (shared from another "
                                    "request's prefill), since start", ["dp_rank"], registry=r)
        # the scheduler's step trace (scheduler_proc/step_metrics.py), since start
        self.step_seconds = Gauge("loom_step_seconds", "Seconds summed over the steps: the worker's forward "
                                  "passes, its gaps between them while work was queued, the scheduler's CPU",
                                  ["dp_rank", "part"], registry=r)
        self.busy_fraction = Gauge("loom_busy_fraction", "The worker's forward time over forward plus gaps",
                                   ["dp_rank"], registry=r)
        self.overlapped_steps = Gauge("loom_overlapped_steps", "Steps planned while the one before ran",
                                      ["dp_rank"], registry=r)
        self.draft_tokens = Gauge("loom_spec_draft_tokens", "Speculative draft tokens proposed since start",
                                  ["dp_rank"], registry=r)
        self.accepted_tokens = Gauge("loom_spec_accepted_tokens", "Speculative draft tokens kept since start",
                                     ["dp_rank"], registry=r)

    def on_tokens(self, now: float, created: float, first_at: float | None, last_at: float | None, n: int) -> None:
        if n <= 0:
            return
        self.generation_tokens.inc(n)
        if first_at is None:
            self.ttft.observe(now - created)
        elif last_at is not None:
            gap = (now - last_at) / n
            for _ in range(n):
                self.itl.observe(gap)

    def on_finish(self, now: float, created: float, prompt_tokens: int, reason: str, cached_tokens: int = 0) -> None:
        self.e2e.observe(now - created)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_prompt_tokens.inc(cached_tokens)
        self.finished.labels(reason=reason).inc()

    def render(self, stats: dict) -> bytes:
        """The text exposition, with the scheduler gauges of each rank in `stats["dp_ranks"]`."""
        for rank in stats["dp_ranks"]:
            label = str(rank["dp_rank"])
            self.running.labels(dp_rank=label).set(rank["num_running"])
            self.waiting.labels(dp_rank=label).set(rank["num_waiting"])
            total = rank["kv_slots_total"] or 1
            self.kv_usage.labels(dp_rank=label).set((rank["kv_slots_total"] - rank["kv_slots_free"]) / total)
            self.retractions.labels(dp_rank=label).set(rank["num_retractions"])
            self.cache_hit_rate.labels(dp_rank=label).set(rank["cache_hit_rate"])
            for part, key in (("forward", "forward_seconds"), ("worker_gap", "worker_gap_seconds"),
                              ("scheduler_cpu", "scheduler_cpu_seconds")):
                self.step_seconds.labels(dp_rank=label, part=part).set(rank[key])
            self.busy_fraction.labels(dp_rank=label).set(rank["busy_fraction"])
            self.overlapped_steps.labels(dp_rank=label).set(rank["overlapped_steps"])
            self.draft_tokens.labels(dp_rank=label).set(rank["num_draft_tokens"])
            self.accepted_tokens.labels(dp_rank=label).set(rank["num_accepted_tokens"])
        return generate_latest(self.registry)
