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

    @property
    def samples(self) -> bool:
        """The step reaches the end of prompt + output, so its last position is sampled."""
        return self.prefix_len + self.extend_len == self.req.num_fill


@dataclass(slots=True)
class ScheduleBatch:
    step: int
    rows: list[BatchRow] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.extend_len for r in self.rows)

    @property
    def num_decode(self) -> int:
        return sum(1 for r in self.rows if r.prefix_len > 0 and r.extend_len == 1)

    def to_worker_batch(self) -> ModelWorkerBatch:
        input_ids: list[int] = []
        for r in self.rows:
            input_ids += r.req.fill_slice(r.prefix_len, r.prefix_len + r.extend_len)
        slots = np.concatenate([r.new_slots for r in self.rows]) if self.rows else np.empty(0, np.int32)
        sample_rows = [i for i, r in enumerate(self.rows) if r.samples]
        return ModelWorkerBatch(
            step=self.step,
            input_ids=np.asarray(input_ids, dtype=np.int32).tobytes(),
            out_cache_loc=slots.astype(np.int32, copy=False).tobytes(),
            req_pool_indices=[r.req.req_pool_idx for r in self.rows],
            prefix_lens=[r.prefix_len for r in self.rows],
            extend_lens=[r.extend_len for r in self.rows],
            prompt_lens=[len(r.req.input_ids) for r in self.rows],
            sample_rows=sample_rows,
            sampling=[self.rows[i].req.sampling for i in sample_rows],
            output_lens=[len(self.rows[i].req.output_ids) for i in sample_rows],
        )
