"""Token ids sampled by a step that a later step already feeds as input (overlap scheduling: the
scheduler plans step N+1 before it has step N's tokens, and writes entry k's token as the input
id -k - 1). The worker stores each step's sampled ids in their entries and resolves the
references of the next step's inputs before it runs."""

from __future__ import annotations

import torch

from ipc.messages import future_capacity


class FutureMap:
    def __init__(self, max_running_requests: int):
        self.ids = torch.zeros(future_capacity(max_running_requests), dtype=torch.int64)

    def resolve(self, input_ids: torch.Tensor) -> None:
        """Replaces the references among input_ids (int64, in place) by their tokens."""
        refs = input_ids < 0
        if refs.any():
            input_ids[refs] = self.ids[-input_ids[refs] - 1]

    def store(self, entries: list[int], token_ids: list[int]) -> None:
        if entries:
            self.ids[torch.tensor(entries)] = torch.tensor(token_ids, dtype=torch.int64)
