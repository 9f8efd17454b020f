"""Speculative decoding's draft tokens (`--speculative-algorithm`), proposed by the scheduler.

A decoding request with drafts computes its last token and the drafts in one row; the worker
samples every position of it as it samples any row (the request's own parameters, each position
with its own output index, so seeded noise is per position), and the core keeps the samples
while each equals the draft it follows (`accepted`), plus the one after: 1 to drafts + 1 tokens a
step for one pass over the weights, which a memory-bound decode step reads anyway. With drafts
fixed in advance (a point mass), keeping a sampled token exactly when it equals the draft is
speculative sampling's own rule (accept with the target's probability of the draft, else sample
from what remains), so the outputs follow the model's distribution, and greedy outputs equal
those without drafts.
"""

from __future__ import annotations

import numpy as np

from scheduler_proc.registry import Registry

SPECULATIVE_ALGORITHMS = Registry("speculative algorithm")


@SPECULATIVE_ALGORITHMS.register("ngram")
class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the request's last
    n tokens (the longest n from ngram_max down to ngram_min that occurs), as the next ones. Pays
    where replies repeat their context: code edits, quotes, summaries, extraction."""

    def __init__(self, num_draft_tokens: int, ngram_min: int, ngram_max: int):
        self.num_draft_tokens, self.ngram_min, self.ngram_max = num_draft_tokens, ngram_min, ngram_max

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to min(num_draft_tokens, limit) draft tokens to follow `tokens` ([] where no n-gram recurs)."""
        limit = min(limit, self.num_draft_tokens)
        if limit <= 0 or len(tokens) <= self.ngram_min:
            return []
        seq = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.ngram_max, len(seq) - 1), self.ngram_min - 1, -1):
            # windows that start before the last n-gram itself, compared with it column by column
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return seq[start:start + limit].tolist()
        return []


def accepted(drafts: list[int], samples: list[int]) -> int:
    """How many drafts the samples keep: samples[j] is the token sampled after drafts[:j] (so after
    the row's first token and j drafts); the drafts hold while each equals the sample before it."""
    n = 0
    while n < len(drafts) and samples[n] == drafts[n]:
        n += 1
    return n
