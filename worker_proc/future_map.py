"""Token ids sampled by a step that a later step already feeds as input (overlap scheduling: the
scheduler plans step N+1 before it has step N's tokens, and writes entry k's token as the input
id -k - 1). The worker stores each step's sampled ids in their entries and resolves the
references of the next step's inputs before it runs."""

from __future__ import annotations

import numpy as np
import torch

from ipc.messages import future_capacity


class FutureMap:
    # (numpy: a step's few ids are stored and resolved in microseconds; torch's indexing ops took
    # ~0.15 ms a step, ~1.3% of a batch-1 decode step on the AMX Xeon)
    def __init__(self, max_running_requests: int):
        self.ids = np.zeros(future_capacity(max_running_requests), dtype=np.int64)

    def resolve(self, input_ids: torch.Tensor) -> None:
        """Replaces the references among input_ids (int64, on the host, in place) by their tokens."""
        ids = input_ids.numpy()
        refs = ids < 0
        if refs.any():
            ids[refs] = self.ids[-ids[refs] - 1]

    def store(self, entries: list[int], token_ids: list[int]) -> None:
        if entries:
            self.ids[entries] = token_ids
