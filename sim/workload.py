"""Simulated requests: when each arrives, how many prompt and output tokens it has, and which
requests share a prompt prefix. Generated (Poisson or gamma arrivals; fixed, uniform or zipf
lengths) or replayed from a trace (Vidur-style CSV, or a bench_serving / bench_offline JSON)."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(slots=True)
class SimRequest:
    rid: str
    arrival: float  # seconds from the start
    prompt_len: int
    output_len: int
    prefix_group: int = -1  # requests of one group share their first prefix_len prompt tokens
    prefix_len: int = 0

    def prompt_ids(self, index: int) -> list[int]:
        """Token ids the scheduling core sees: only which requests share a prefix matters, so a
        shared prefix is one group token then a filler, the rest starts with a token of this
        request's own (no two requests share more than their group's prefix)."""
        own = [100_000 + index] + [7] * (self.prompt_len - self.prefix_len - 1)
        if self.prefix_len <= 0:
            return own
        return [50_000 + self.prefix_group] + [5] * (self.prefix_len - 1) + own


def arrivals(n: int, process: str, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times: `poisson` (exponential gaps), `gamma` (gaps with coefficient of variation
    cv: burstier above 1) at `rate` requests/s, or all at 0 (`rate` inf, or process `burst`)."""
    if process == "burst" or math.isinf(rate):
        return np.zeros(n)
    if rate <= 0:
        raise ValueError(f"rate={rate}: requests per second must be positive (or inf)")
    if process == "poisson":
        gaps = rng.exponential(1.0 / rate, n)
    elif process == "gamma":
        shape = 1.0 / (cv * cv)
        gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    else:
        raise ValueError(f"arrival process {process!r}: choose poisson, gamma or burst")
    gaps[0] = 0.0
    return np.cumsum(gaps)


def lengths(n: int, dist: str, low: int, high: int, theta: float, rng: np.random.Generator) -> np.ndarray:
    """Token counts in [low, high]: `fixed` (high), `uniform`, or `zipf` (rank k of the
    range drawn with probability ~ 1/k^theta: many short, a few long)."""
    if dist == "fixed":
        return np.full(n, high)
    if dist == "uniform":
        return rng.integers(low, high + 1, n)
    if dist == "zipf":
        ranks = np.arange(1, high - low + 2, dtype=np.float64)
        p = ranks ** -theta
        return low + rng.choice(len(ranks), n, p=p / p.sum())
    raise ValueError(f"length distribution {dist!r}: choose fixed, uniform or zipf")


def generate(n: int, *, arrival: str = "poisson", rate: float = 10.0, cv: float = 1.0,
             length_dist: str = "uniform", min_len: int = 256, max_len: int = 2048, pd_ratio: float | None = 20.0,
             prompt_len: tuple[int, int] = (128, 512), output_len: tuple[int, int] = (32, 128),
             zipf_theta: float = 1.1, shared_prefix_groups: int = 0, shared_prefix_len: int = 0,
             seed: int = 0) -> list[SimRequest]:
    """n requests. With pd_ratio, each request's total length is drawn from [min_len, max_len]
    and split prompt:output = pd_ratio:1 (Vidur's prefill:decode ratio); without it, prompt and
    output lengths are drawn apart from their ranges. shared_prefix_groups > 0: each request
    belongs to a random group whose first shared_prefix_len prompt tokens it shares."""
    rng = np.random.default_rng(seed)
    times = arrivals(n, arrival, rate, cv, rng)
    if pd_ratio is not None:
        total = lengths(n, length_dist, min_len, max_len, zipf_theta, rng)
        outs = np.maximum(1, np.round(total / (pd_ratio + 1))).astype(int)
        prompts = np.maximum(1, total - outs)
    else:
        prompts = lengths(n, length_dist, *prompt_len, zipf_theta, rng)
        outs = lengths(n, length_dist, *output_len, zipf_theta, rng)
    groups = rng.integers(0, shared_prefix_groups, n) if shared_prefix_groups > 0 else np.full(n, -1)
    out = []
    for i in range(n):
        p = int(prompts[i]) + (shared_prefix_len if groups[i] >= 0 else 0)
        out.append(SimRequest(f"r{i}", float(times[i]), p, int(outs[i]), int(groups[i]),
                              shared_prefix_len if groups[i] >= 0 else 0))
    return out


def from_csv(path: str | Path) -> list[SimRequest]:
    """A trace with one request per row: Vidur's columns (arrived_at, num_prefill_tokens,
    num_decode_tokens) or loom's (arrival, prompt_len, output_len)."""
    out = []
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            arrival = row.get("arrived_at", row.get("arrival"))
            prompt = row.get("num_prefill_tokens", row.get("prompt_len"))
            output = row.get("num_decode_tokens", row.get("output_len"))
            if arrival is None or prompt is None or output is None:
                raise ValueError(f"{path}: row {i + 1} lacks arrived_at/arrival, num_prefill_tokens/prompt_len "
                                 "or num_decode_tokens/output_len")
            out.append(SimRequest(f"r{i}", float(arrival), int(float(prompt)), max(1, int(float(output)))))
    out.sort(key=lambda r: r.arrival)
    return out


def from_bench_json(path: str | Path) -> tuple[list[SimRequest], dict]:
    """The requests of a bench_serving (send times, lengths) or bench_offline (lengths, all at
    once) result, and what it measured (for the simulator's fidelity report)."""
    data = json.loads(Path(path).read_text())
    reqs = data.get("requests") or {}
    if "start_s" in reqs:  # bench_serving
        starts, ins, outs = reqs["start_s"], reqs["input_lens"], reqs["expected_output_lens"]
        t0 = min(starts)
        out = [SimRequest(f"r{i}", s - t0, int(p), int(o)) for i, (s, p, o) in enumerate(zip(starts, ins, outs))]
        measured = {"ttft_s": _median([t for t in reqs["ttfts_s"] if t is not None]),
                    "e2e_s": _median([t for t in reqs["e2e_latencies_s"] if t is not None]),
                    "output_tok_s": data.get("output_throughput")}
    elif "input_lens" in data.get("workload", {}):  # bench_offline
        work = data["workload"]
        out = [SimRequest(f"r{i}", 0.0, int(p), int(o)) for i, (p, o) in enumerate(zip(work["input_lens"],
                                                                                     work["output_lens"]))]
        loom = data.get("loom", {})
        measured = {"ttft_s": (loom.get("ttft_s") or {}).get("p50"),
                    "e2e_s": (loom.get("e2e_latency_s") or {}).get("p50"),
                    "output_tok_s": loom.get("output_tok_s")}
    else:
        raise ValueError(f"{path}: neither a bench_serving nor a bench_offline result")
    out.sort(key=lambda r: r.arrival)
    return out, measured


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None
