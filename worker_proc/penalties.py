"""Batched OpenAI-style logit processing: penalties, logit_bias, min_new_tokens, logprobs.

Pure functions and small state holders on tensors; nothing here knows about processes or the
scheduler. Every function takes logits ``[B, V]`` (float32, one row per sampled request, in the
order of ``ModelWorkerBatch.sampling``) and returns a tensor. A function that has nothing to do
returns its input object unchanged (no copy, no kernel launch); otherwise it returns a new tensor
and never writes into its input, so the caller may keep the raw logits for `logprobs`.

Definitions (as in vLLM / SGLang / the OpenAI API):

* ``repetition_penalty`` p > 0 (HF/CTRL style, neutral 1.0): for every token that appears in
  the prompt *or* in the output so far, ``logit > 0 -> logit / p`` else ``logit * p``.
* ``frequency_penalty`` f (neutral 0.0): ``logit -= f * count``, count = times the token was
  generated so far (output only, not the prompt).
* ``presence_penalty`` r (neutral 0.0): ``logit -= r * (count > 0)`` (output only).
* ``logit_bias`` {token_id: bias}: ``logit += bias``.
* ``min_new_tokens`` n: while a request has generated fewer than n tokens, its stop token ids
  (``stop_token_ids`` plus the model's EOS ids unless ``ignore_eos``) get ``-inf``.

Order used per step (vLLM v1 order; penalties come before temperature, which `sampler.sample`
applies)::

    raw = model logits [B, V] float32
    pb = PenaltyBatch.build(params, output_lens, vocab_size, device, eos_token_ids)
    logits = pb.apply(raw, counts.gather(slots) if pb.needs_counts else None,
                      prompt_masks.gather(slots) if pb.needs_prompt_mask else None)
        # == apply_logit_bias -> mask_min_tokens -> apply_penalties
    next_ids = sampler.sample(logits, SamplingBatch.build(...))
    if pb.top_logprobs is not None:                      # some row asked for logprobs
        chosen_lp, top_ids, top_lps = logprobs(raw, next_ids, pb.top_logprobs)
        # row i keeps top_ids[i, :params[i].top_logprobs]

Logprobs refer to the raw model distribution (``log_softmax`` of the unprocessed logits, vLLM's
default ``logprobs_mode="raw_logprobs"``): `logprobs` computes on whatever it is given, and the
caller passes the raw logits.

Per-request state lives in slot-indexed tables (slot = ``req_pool_indices`` entry):

* `OutputTokenCounts` ``[max_reqs, V]`` int32 and `PromptTokenMask` ``[max_reqs, V]`` bool:
  ``reset(slots)`` when a request (re)starts in a slot, ``add(slots, tokens)`` for the tokens it
  is fed, ``gather(slots)`` -> ``[B, V]``. The model runner feeds them from each step's input
  tokens (prompt positions to the mask, output positions to the counts), so a re-prefill after a
  retraction rebuilds both; it skips steps where no request reads them
  (``ModelWorkerBatch.track_tokens``). A request that starts on a cached prefix gets both rebuilt
  from the prefix's tokens (``ModelWorkerBatch.prefix_tables``).

SamplingParams fields are read with ``getattr(p, name, default)``, so this module works whether
or not ``ipc.messages.SamplingParams`` already defines ``repetition_penalty``,
``frequency_penalty``, ``presence_penalty``, ``logit_bias``, ``logprobs`` and ``top_logprobs``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "OutputTokenCounts",
    "PromptTokenMask",
    "PenaltyBatch",
    "apply_penalties",
    "apply_logit_bias",
    "mask_min_tokens",
    "min_tokens_rows",
    "logprobs",
]


def _as_index(x: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.int64)
    return torch.tensor(list(x), dtype=torch.int64, device=device)


# ---- per-slot state ---------------------------------------------------------------------

class OutputTokenCounts:
    """How often each request slot has generated each token: ``counts[slot, token]`` int32."""

    def __init__(self, max_reqs: int, vocab_size: int, device: torch.device | str):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.counts = torch.zeros(max_reqs, vocab_size, dtype=torch.int32, device=self.device)

    def reset(self, slots: torch.Tensor | Sequence[int]) -> None:
        """Zero the rows of `slots` (a request just took them)."""
        idx = _as_index(slots, self.device)
        if idx.numel():
            self.counts.index_fill_(0, idx, 0)

    def add(self, slots: torch.Tensor | Sequence[int], tokens: torch.Tensor | Sequence[int], times: int = 1) -> None:
        """Count one generated token per entry: ``counts[slots[i], tokens[i]] += times`` (-1: take
        back tokens counted too early, a speculative draft the model did not confirm).

        `slots` and `tokens` have the same shape (any; flattened). Repeated (slot, token) pairs
        in one call all count (index_put_ with accumulate)."""
        s = _as_index(slots, self.device).reshape(-1)
        t = _as_index(tokens, self.device).reshape(-1)
        assert s.shape == t.shape, (s.shape, t.shape)
        if s.numel():
            self.counts.index_put_((s, t), torch.full_like(s, times, dtype=torch.int32), accumulate=True)

    def gather(self, slots: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """``[B, V]`` int32 copy of the rows of `slots`, in that order."""
        return self.counts.index_select(0, _as_index(slots, self.device))


class PromptTokenMask:
    """Which tokens occur in each slot's prompt: ``mask[slot, token]`` bool (for repetition_penalty)."""

    def __init__(self, max_reqs: int, vocab_size: int, device: torch.device | str):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.mask = torch.zeros(max_reqs, vocab_size, dtype=torch.bool, device=self.device)

    def add(self, slots: torch.Tensor | Sequence[int], tokens: torch.Tensor | Sequence[int]) -> None:
        """Mark ``mask[slots[i], tokens[i]]``."""
        s = _as_index(slots, self.device).reshape(-1)
        t = _as_index(tokens, self.device).reshape(-1)
        assert s.shape == t.shape, (s.shape, t.shape)
        if s.numel():
            self.mask[s, t] = True

    def reset(self, slots: torch.Tensor | Sequence[int]) -> None:
        idx = _as_index(slots, self.device)
        if idx.numel():
            self.mask.index_fill_(0, idx, False)

    def gather(self, slots: torch.Tensor | Sequence[int]) -> torch.Tensor:
        return self.mask.index_select(0, _as_index(slots, self.device))


# ---- logit processing -------------------------------------------------------------------

def apply_penalties(logits: torch.Tensor, counts: torch.Tensor | None,
                    repetition: torch.Tensor | None, frequency: torch.Tensor | None,
                    presence: torch.Tensor | None,
                    prompt_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Repetition, then frequency, then presence penalty (vLLM order); see module docstring.

    logits [B, V] float; counts [B, V] int (output token counts); repetition / frequency /
    presence [B] float, or None when every row is neutral (that penalty is skipped without
    touching the device). prompt_mask [B, V] bool or None (then repetition looks at the output
    only). Returns `logits` itself when all three are None; otherwise a new tensor. Neutral rows
    (1.0 / 0.0 / 0.0) in a mixed batch come out bit-identical.
    """
    if repetition is None and frequency is None and presence is None:
        return logits
    assert counts is not None, "penalties need output token counts"
    seen_out = counts > 0
    if repetition is not None:
        seen = seen_out if prompt_mask is None else seen_out | prompt_mask
        p = repetition.to(logits.dtype)[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    if frequency is not None:
        logits = logits - frequency.to(logits.dtype)[:, None] * counts.to(logits.dtype)
    if presence is not None:
        logits = logits - presence.to(logits.dtype)[:, None] * seen_out.to(logits.dtype)
    return logits


def apply_logit_bias(logits: torch.Tensor,
                     biases: Sequence[Mapping[int, float] | None]) -> torch.Tensor:
    """``logits[i, t] += biases[i][t]`` for each row i with a bias dict (None / {} rows untouched).

    Keys may be ints or numeric strings (as JSON delivers them). Token ids outside [0, V) are
    ignored (the API layer is expected to reject them). One index_put_ for the whole batch;
    returns `logits` itself when no row has a bias."""
    assert len(biases) == logits.shape[0], (len(biases), logits.shape)
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, bias in enumerate(biases):
        if not bias:
            continue
        for tok, val in bias.items():
            tok = int(tok)
            if 0 <= tok < vocab:
                rows.append(i)
                cols.append(tok)
                vals.append(float(val))
    if not rows:
        return logits
    out = logits.clone()
    out.index_put_((_as_index(rows, logits.device), _as_index(cols, logits.device)),
                   torch.tensor(vals, dtype=logits.dtype, device=logits.device), accumulate=True)
    return out


def mask_min_tokens(logits: torch.Tensor, rows_needing_mask: Sequence[int],
                    stop_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Set ``-inf`` on ``stop_ids[j]`` in row ``rows_needing_mask[j]`` (the two lists are parallel).

    Use `min_tokens_rows` to compute both lists from SamplingParams. Ids outside [0, V) are
    ignored. Returns `logits` itself when there is nothing to mask."""
    assert len(rows_needing_mask) == len(stop_ids), (len(rows_needing_mask), len(stop_ids))
    vocab = logits.shape[-1]
    rows = [r for r, ids in zip(rows_needing_mask, stop_ids) for t in ids if 0 <= t < vocab]
    cols = [t for ids in stop_ids for t in ids if 0 <= t < vocab]
    if not rows:
        return logits
    out = logits.clone()
    out[_as_index(rows, logits.device), _as_index(cols, logits.device)] = -torch.inf
    return out


def min_tokens_rows(params: Sequence, output_lens: Sequence[int],
                    eos_token_ids: Sequence[int] = ()) -> tuple[list[int], list[list[int]]]:
    """Rows (and their stop ids) that may not stop yet: ``output_lens[i] < min_new_tokens``.

    The stop ids of a row are its ``stop_token_ids`` plus `eos_token_ids` unless ``ignore_eos``
    (with ignore_eos EOS does not end the request, so it needs no mask). `output_lens[i]` is the
    number of tokens row i has generated before this step. A row under a grammar (structured
    output) is left to it: the grammar allows the end only once its text is whole, and a mask of
    the end there would leave that row no token at all."""
    rows: list[int] = []
    stops: list[list[int]] = []
    for i, (p, n) in enumerate(zip(params, output_lens)):
        if n >= getattr(p, "min_new_tokens", 0) or getattr(p, "has_grammar", False):
            continue
        ids = list(getattr(p, "stop_token_ids", ()) or ())
        if not getattr(p, "ignore_eos", False):
            ids += [t for t in eos_token_ids if t not in ids]
        if ids:
            rows.append(i)
            stops.append(ids)
    return rows, stops


def logprobs(logits: torch.Tensor, chosen: torch.Tensor,
             top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities from ``log_softmax(logits.float())`` of whatever logits are passed.

    The engine passes the *raw* model logits (vLLM's default): logprobs describe the model's
    distribution, not the penalised / temperature-scaled one that was sampled from.
    Returns ``(chosen_logprob [B] float32, top_ids [B, k] int64, top_logprobs [B, k] float32)``
    with k = min(top_k, V), each row sorted by descending logprob. With mixed per-request
    ``top_logprobs`` pass the batch maximum and slice each row; top_k=0 gives [B, 0] tensors."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = lp.gather(-1, chosen.to(device=lp.device, dtype=torch.int64).reshape(-1, 1)).squeeze(-1)
    k = max(0, min(int(top_k), lp.shape[-1]))
    if k == 0:
        return (chosen_lp, torch.empty(lp.shape[0], 0, dtype=torch.int64, device=lp.device),
                torch.empty(lp.shape[0], 0, dtype=torch.float32, device=lp.device))
    top_lps, top_ids = lp.topk(k, dim=-1, largest=True, sorted=True)
    return chosen_lp, top_ids, top_lps


# ---- per-step batch ---------------------------------------------------------------------

@dataclass(slots=True)
class PenaltyBatch:
    """Everything one step's logit processing needs, built once per batch on the host.

    Tensors are None when every row is neutral for that feature, so `apply` skips the work
    without a device sync."""

    repetition: torch.Tensor | None  # [B] float32
    frequency: torch.Tensor | None  # [B] float32
    presence: torch.Tensor | None  # [B] float32
    logit_biases: list[Mapping[int, float] | None] | None
    min_token_rows: list[int]
    min_token_stop_ids: list[list[int]]
    top_logprobs: int | None  # batch max of top_logprobs over rows with logprobs; None: no row wants any
    want_logprobs: list[bool]

    @property
    def needs_counts(self) -> bool:
        """The caller must pass `OutputTokenCounts.gather(slots)` to `apply`."""
        return self.repetition is not None or self.frequency is not None or self.presence is not None

    @property
    def needs_prompt_mask(self) -> bool:
        """The caller should pass `PromptTokenMask.gather(slots)` to `apply`."""
        return self.repetition is not None

    @property
    def is_noop(self) -> bool:
        return not (self.needs_counts or self.logit_biases or self.min_token_rows)

    @classmethod
    def build(cls, params: Sequence, output_lens: Sequence[int], vocab_size: int,
              device: torch.device | str, eos_token_ids: Sequence[int] = ()) -> PenaltyBatch:
        assert len(params) == len(output_lens)
        rep = [float(getattr(p, "repetition_penalty", 1.0)) for p in params]
        freq = [float(getattr(p, "frequency_penalty", 0.0)) for p in params]
        pres = [float(getattr(p, "presence_penalty", 0.0)) for p in params]
        biases = [getattr(p, "logit_bias", None) or None for p in params]
        rows, stops = min_tokens_rows(params, output_lens, eos_token_ids)
        want = [bool(getattr(p, "logprobs", False)) for p in params]
        ks = [max(0, int(getattr(p, "top_logprobs", 0) or 0)) for p, w in zip(params, want) if w]

        def vec(vals: list[float], neutral: float) -> torch.Tensor | None:
            if all(v == neutral for v in vals):
                return None
            return torch.tensor(vals, dtype=torch.float32, device=device)

        return cls(
            repetition=vec(rep, 1.0),
            frequency=vec(freq, 0.0),
            presence=vec(pres, 0.0),
            logit_biases=biases if any(biases) else None,
            min_token_rows=rows,
            min_token_stop_ids=stops,
            top_logprobs=min(max(ks), vocab_size) if ks else None,
            want_logprobs=want,
        )

    def apply(self, logits: torch.Tensor, counts: torch.Tensor | None = None,
              prompt_mask: torch.Tensor | None = None) -> torch.Tensor:
        """logit_bias -> min_new_tokens mask -> penalties. Returns `logits` itself if nothing applies."""
        if self.logit_biases is not None:
            logits = apply_logit_bias(logits, self.logit_biases)
        if self.min_token_rows:
            logits = mask_min_tokens(logits, self.min_token_rows, self.min_token_stop_ids)
        return apply_penalties(logits, counts, self.repetition, self.frequency, self.presence,
                               prompt_mask)
