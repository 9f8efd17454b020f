"""One step's work as the scheduler plans it, and its wire form for the worker."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ipc.messages import ModelWorkerBatch
from scheduler_proc.req import Req


@dataclass(slots=True)
class BatchRow:
    req: Req
    prefix_len: int  # tokens already in the KV cache
    extend_len: int  # tokens this step computes
    new_slots: np.ndarray  # KV slots for those tokens
    samples: bool  # the step reaches the end of prompt + output: its last position is sampled
    # A forked request computes nothing (extend_len 0): it samples from the logits of the row
    # at this index in ScheduleBatch.rows, its leader's last prompt chunk.
    logits_of: int | None = None
    # A sampling row's token: where it goes in req.output_ids (a placeholder until on_result)
    # and the future-map entry the worker stores it in (a later step planned before on_result
    # reads it from there: see SchedulerCore's placeholders).
    output_index: int = -1
    future: int = -1


@dataclass(slots=True)
class ScheduleBatch:
    step: int
    rows: list[BatchRow] = field(default_factory=list)
    forks: list[tuple[int, int, int]] = field(default_factory=list)  # see ModelWorkerBatch.forks

    @property
    def num_tokens(self) -> int:
        return sum(r.extend_len for r in self.rows)

    @property
    def num_decode(self) -> int:
        return sum(1 for r in self.rows if r.prefix_len > 0 and r.extend_len == 1)

    def to_worker_batch(self) -> ModelWorkerBatch:
        """Rows that compute tokens become worker rows; a forked row has none and only adds a
        sample entry on its leader's worker row (so sample_rows may repeat an index). Sample
        entries stay in the order of the rows that sample, as on_result reads them."""
        # batch row index -> worker row index, for the rows that compute tokens
        worker_row = {i: w for w, i in enumerate(i for i, r in enumerate(self.rows) if r.extend_len > 0)}
        compute = [self.rows[i] for i in worker_row]
        input_ids: list[int] = []
        for r in compute:
            input_ids += r.req.fill_slice(r.prefix_len, r.prefix_len + r.extend_len)
        slots = np.concatenate([r.new_slots for r in compute]) if compute else np.empty(0, np.int32)
        sampling_rows = [(i, r) for i, r in enumerate(self.rows) if r.samples]
        return ModelWorkerBatch(
            step=self.step,
            input_ids=np.asarray(input_ids, dtype=np.int32).tobytes(),
            out_cache_loc=slots.astype(np.int32, copy=False).tobytes(),
            req_pool_indices=[r.req.req_pool_idx for r in compute],
            prefix_lens=[r.prefix_len for r in compute],
            extend_lens=[r.extend_len for r in compute],
            prompt_lens=[len(r.req.input_ids) for r in compute],
            sample_rows=[worker_row[i if r.logits_of is None else r.logits_of] for i, r in sampling_rows],
            sampling=[r.req.sampling for _, r in sampling_rows],
            output_lens=[r.output_index for _, r in sampling_rows],
            future_slots=[r.future for _, r in sampling_rows],
            forks=list(self.forks),
            track_tokens=any(_uses_token_history(r.req) for r in self.rows),
        )


def _uses_token_history(req: Req) -> bool:
    return req.sampling.uses_token_history or any(f.sampling.uses_token_history for f in req.followers)
