"""One step's work as the scheduler plans it, and its wire form for the worker."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ipc.messages import DllmStep, ModelWorkerBatch, PrefixTable
from scheduler_proc.req import Req


@dataclass(slots=True)
class BatchRow:
    req: Req
    prefix_len: int  # tokens already in the KV cache
    extend_len: int  # tokens this step computes
    new_slots: np.ndarray  # KV slots for those tokens
    samples: bool  # the step reaches the end of prompt + output: its last position is sampled
    # The request's slots for its first prefix_len tokens, on its first row after a prefix cache
    # hit: the worker's req_to_token mirror learns them (its deltas never carried them).
    prefix_table: np.ndarray | None = None
    # A sampling row's token: where it goes in req.output_ids (a placeholder until on_result)
    # and the future-map entry the worker stores it in (a later step planned before on_result
    # reads it from there: see SchedulerCore's placeholders).
    output_index: int = -1
    future: int = -1
    # block diffusion: the row's ids (its committed tokens past prefix_len, then its block as the
    # last round left it), where they are not simply the request's tokens; speculative decoding:
    # the last token, then the drafts
    input_ids: list[int] | None = None
    drafts: list[int] | None = None  # speculative decoding's draft tokens (every position is sampled)


@dataclass(slots=True)
class ScheduleBatch:
    step: int
    rows: list[BatchRow] = field(default_factory=list)
    # block diffusion: each row ends with a block of this many positions; 0: every sampling row
    # samples one token
    dllm_block_size: int = 0
    dllm_fdfo: bool = True
    dllm_reloop: bool = True
    prompt_logprob_rows: list[int] = field(default_factory=list)  # (set by to_worker_batch)

    @property
    def num_tokens(self) -> int:
        return sum(r.extend_len for r in self.rows)

    @property
    def num_decode(self) -> int:
        return sum(1 for r in self.rows if r.prefix_len > 0 and (r.extend_len == 1 or r.drafts))

    @property
    def has_prompts(self) -> bool:
        """Some row computes prompt tokens (a chunk, or a whole prompt), not only decodes."""
        return any((r.extend_len > 1 and not r.drafts) or r.prefix_len == 0 for r in self.rows)

    def to_worker_batch(self) -> ModelWorkerBatch:
        """The step's wire form: every row computes at least one token; sample entries in the
        order of the rows that sample, as on_result reads them."""
        rows = self.rows
        input_ids: list[int] = []
        for r in rows:
            input_ids += r.input_ids if r.input_ids is not None else r.req.fill_slice(r.prefix_len,
                                                                                   r.prefix_len + r.extend_len)
        slots = np.concatenate([r.new_slots for r in rows]) if rows else np.empty(0, np.int32)
        sampling_rows = [(i, r) for i, r in enumerate(rows) if r.samples]
        track = any(r.req.sampling.uses_token_history for r in rows)
        # prompt chunks of requests whose prompt logprobs are not all in (a chunk computed again
        # after a retraction overwrites what it had)
        self.prompt_logprob_rows = [i for i, r in enumerate(rows) if r.req.prompt_logprobs_missing
                                    and r.prefix_len < len(r.req.input_ids) - 1
                                    and r.prefix_len + r.extend_len <= len(r.req.input_ids)]
        asked = [rows[i] for i in self.prompt_logprob_rows]
        return ModelWorkerBatch(
            step=self.step,
            input_ids=np.asarray(input_ids, dtype=np.int32).tobytes(),
            out_cache_loc=slots.astype(np.int32, copy=False).tobytes(),
            req_pool_indices=[r.req.req_pool_idx for r in rows],
            prefix_lens=[r.prefix_len for r in rows],
            extend_lens=[r.extend_len for r in rows],
            prompt_lens=[len(r.req.input_ids) for r in rows],
            sample_rows=[i for i, _ in sampling_rows],
            sampling=[r.req.sampling for _, r in sampling_rows],
            output_lens=[r.output_index for _, r in sampling_rows],
            future_slots=[r.future for _, r in sampling_rows],
            prefix_tables=[PrefixTable(r.req.req_pool_idx, r.prefix_table.astype(np.int32, copy=False).tobytes(),
                                       # the prefix's tokens, where this request's penalties read its history
                                       np.asarray(r.req.fill_slice(0, r.prefix_len), dtype=np.int32).tobytes()
                                       if r.req.sampling.uses_token_history else b"")
                           for r in rows if r.prefix_table is not None],
            track_tokens=track,
            prompt_logprob_rows=self.prompt_logprob_rows,
            prompt_logprob_next=[r.req.input_ids[r.prefix_len + r.extend_len]
                                 if r.prefix_len + r.extend_len < len(r.req.input_ids) else -1 for r in asked],
            prompt_logprob_top=[r.req.sampling.prompt_logprobs for r in asked],
            draft_lens=[len(r.drafts or ()) for _, r in sampling_rows] if any(r.drafts for r in rows) else [],
            dllm=DllmStep(self.dllm_block_size, self.dllm_fdfo, self.dllm_reloop,
                          [r.req.dllm_algo_state for r in rows]) if self.dllm_block_size else None,
        )
