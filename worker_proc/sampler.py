"""Batched token sampling: temperature, top-k, top-p, min-p, then the exponential race.

One pass over the [B, V] logits for the whole batch. Filters follow vLLM/SGLang order on the
temperature-scaled distribution: top-k, then top-p, then min-p. A token is drawn as
argmax(probs / q) with q = -log(U) ~ Exp(1), which samples exactly from `probs`. Seeded rows take
U from a generator seeded by (seed, output_len), so their tokens don't depend on the batch.

Penalties, logit_bias and min_new_tokens masking (worker_proc/penalties.py) run on the logits
before `sample`, so they act before temperature and also steer greedy rows; logprobs are taken
from the raw logits, not from what `sample` sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ipc.messages import SamplingParams

_MIN_TEMPERATURE = 1e-5
_SEED_MASK = (1 << 63) - 1


@dataclass(slots=True)
class SamplingBatch:
    temperatures: torch.Tensor  # [B] float32, 1.0 on greedy rows, clamped >= _MIN_TEMPERATURE
    top_ks: torch.Tensor  # [B] int64, vocab_size where off
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    seeds: list[int | None]
    output_lens: list[int]

    @classmethod
    def build(cls, params: list[SamplingParams], output_lens: list[int], vocab_size: int,
              device: torch.device | str) -> SamplingBatch:
        assert len(params) == len(output_lens)
        greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else max(p.temperature, _MIN_TEMPERATURE) for p, g in zip(params, greedy)]
        top_ks = [vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size) for p in params]
        top_ps = [min(max(p.top_p, 0.0), 1.0) for p in params]
        min_ps = [max(p.min_p, 0.0) for p in params]
        sampled = [i for i, g in enumerate(greedy) if not g]
        return cls(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            min_ps=torch.tensor(min_ps, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=not sampled,
            need_top_k=any(top_ks[i] < vocab_size for i in sampled),
            need_top_p=any(top_ps[i] < 1.0 for i in sampled),
            need_min_p=any(min_ps[i] > 0.0 for i in sampled),
            seeds=[p.seed for p in params],
            output_lens=list(output_lens),
        )


def _uniform_noise(batch: SamplingBatch, vocab_size: int, device: torch.device) -> torch.Tensor:
    """U in [0, 1) of shape [B, V]: one global draw for unseeded rows, a private one per seeded row."""
    seeded = [i for i, s in enumerate(batch.seeds) if s is not None]
    n = len(batch.seeds)
    if not seeded:
        return torch.rand(n, vocab_size, device=device)
    u = torch.empty(n, vocab_size, device=device)
    unseeded = [i for i, s in enumerate(batch.seeds) if s is None]
    if unseeded:
        u[torch.tensor(unseeded, device=device)] = torch.rand(len(unseeded), vocab_size, device=device)
    for i in seeded:
        g = torch.Generator(device=device)
        g.manual_seed((batch.seeds[i] * 1_000_003 + batch.output_lens[i]) & _SEED_MASK)
        u[i] = torch.rand(vocab_size, generator=g, device=device)
    return u


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Next token id per row, [B] int64, from logits [B, V]."""
    greedy_ids = torch.argmax(logits, dim=-1)
    if batch.all_greedy:
        return greedy_ids
    vocab_size = logits.shape[-1]
    logits = logits.float() / batch.temperatures[:, None]

    if batch.need_top_k or batch.need_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        if batch.need_top_k:
            ranks = torch.arange(vocab_size, device=logits.device)
            sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= batch.top_ks[:, None], -torch.inf)
        if batch.need_top_p:
            sorted_probs = sorted_logits.softmax(dim=-1)
            cum = sorted_probs.cumsum(dim=-1)
            mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # better tokens' mass
            drop = (mass_before >= batch.top_ps[:, None]) & (batch.top_ps < 1.0)[:, None]
            drop[:, 0] = False  # always keep the top token
            sorted_logits = sorted_logits.masked_fill(drop, -torch.inf)
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)

    probs = logits.softmax(dim=-1)
    if batch.need_min_p:
        threshold = batch.min_ps[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)  # the race needs no renormalisation

    u = _uniform_noise(batch, vocab_size, logits.device)
    q = -torch.log(u.clamp_min(torch.finfo(torch.float32).tiny))  # Exp(1), finite and > 0
    sampled_ids = torch.argmax(probs / q, dim=-1)
    return torch.where(batch.greedy, greedy_ids, sampled_ids)
