"""Replica batching strategies (`--batching-strategy`): how one step is composed and how much KV
a request must find before it is admitted. Small classes over the scheduling core's own
primitives (`_schedule_decodes`, `_schedule_prefills`), so the live scheduler, the simulator and
the tests run the same strategy.

  loom      continuous batching, chunked prefill, decodes and prompt chunks in one step (or not,
            with --no-enable-mixed-chunk), outputs reserved at a decaying estimate (SGLang's)
  sarathi   a per-step token budget (--max-prefill-tokens) filled by decodes first, then the
            running prompt's next chunk, then new prompts, chunked to fit; KV taken as needed
  vllm      whole prompts first (a step of prompts only while any fits), else decodes; KV taken as
            needed, prompts admitted only above a free-KV watermark; when decodes run out of
            KV the most recent request is preempted and later recomputed
  orca      iteration-level: decodes and whole new prompts in one step; a request is admitted
            only when KV for its prompt and its whole max_new_tokens is free (never preempts)
  lightllm  token-granular KV; a request is admitted only if the peak KV need of every running
            request plus it, over their remaining lengths, fits the pool; prompt steps and
            decode steps apart, a prompt step at most every --max-waiting-iters decode steps
  static    a batch of whole prompts starts when nothing runs and stays together until its last
            request ends (no joins); KV for every max_new_tokens reserved
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from scheduler_proc.registry import Registry

if TYPE_CHECKING:
    from scheduler_proc.core import ReqOutput, SchedulerCore
    from scheduler_proc.req import Req
    from scheduler_proc.schedule_batch import ScheduleBatch

BATCHING_STRATEGIES = Registry("batching strategy")  # --batching-strategy

# Outputs longer than this are reserved as if they were this long (keeps admission possible
# for requests that ask for huge max_new_tokens).
CLIP_MAX_NEW_TOKENS = 4096


def max_output(req: "Req") -> int:
    """Output tokens a request may still produce, clipped."""
    return min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS)


class BatchingStrategy:
    name = ""
    chunked = True  # prompts may be split across steps (--chunked-prefill-size)
    decaying_estimate = False  # reserves outputs at core.new_token_ratio (decayed every step)

    def __init__(self, max_waiting_iters: int = 10, watermark: float = 0.01):
        self.max_waiting_iters = max_waiting_iters
        self.watermark = watermark

    def plan(self, core: "SchedulerCore", batch: "ScheduleBatch") -> list["ReqOutput"]:
        """Fill `batch` with this step's rows; returns requests ended while planning."""
        raise NotImplementedError

    def reserve(self, core: "SchedulerCore", req: "Req") -> int:
        """Output tokens of KV a request must leave room for, admitted or running (0: taken as
        it decodes)."""
        return 0

    def admissible(self, core: "SchedulerCore", req: "Req", pending: int) -> bool:
        """A check of the strategy's own, beyond the step's budgets, before `req` (computing
        `pending` tokens) is admitted."""
        return True

    def victim(self, core: "SchedulerCore") -> "Req":
        """The running request to preempt when decodes run out of KV: the longest output
        (it frees the most), ties to the latest arrival."""
        return max(core.running, key=lambda r: (len(r.output_ids), r.arrival))

    def chunk_size(self, core: "SchedulerCore") -> int | None:
        return core.config.chunked_prefill_size if self.chunked else None


@BATCHING_STRATEGIES.register("loom")
class LoomBatching(BatchingStrategy):
    decaying_estimate = True

    def plan(self, core, batch):
        cfg, ended = core.config, []
        if cfg.enable_mixed_chunk:
            ended += core._schedule_decodes(batch)
            spent = len(batch.rows) if cfg.decode_first else 0
            core._schedule_prefills(batch, cfg.max_prefill_tokens - spent)
        else:
            has_decodes = any(r.num_pending == 1 for r in core.running)
            if not (cfg.decode_first and has_decodes and core.last_batch_was_prefill):
                core._schedule_prefills(batch, cfg.max_prefill_tokens)
            if not batch.rows:
                ended += core._schedule_decodes(batch)
        return ended

    def reserve(self, core, req):
        return int(max_output(req) * core.new_token_ratio)


class _LatestPreempted(BatchingStrategy):
    """KV is taken as requests grow; the most recent request is the one preempted."""

    def victim(self, core):
        return max(core.running, key=lambda r: (r.arrival, r.rid))


@BATCHING_STRATEGIES.register("sarathi")
class SarathiBatching(_LatestPreempted):
    def plan(self, core, batch):
        ended = core._schedule_decodes(batch)
        core._schedule_prefills(batch, core.config.max_prefill_tokens - len(batch.rows))
        return ended

    def chunk_size(self, core):
        return core.config.max_prefill_tokens  # a prompt takes whatever the budget has left


@BATCHING_STRATEGIES.register("vllm")
class VllmBatching(_LatestPreempted):
    chunked = False

    def plan(self, core, batch):
        core._schedule_prefills(batch, core.config.max_prefill_tokens)
        return [] if batch.rows else core._schedule_decodes(batch)

    def admissible(self, core, req, pending):
        return core._available() - pending >= self.watermark * core.token_pool.capacity


@BATCHING_STRATEGIES.register("orca")
class OrcaBatching(BatchingStrategy):
    chunked = False

    def plan(self, core, batch):
        ended = core._schedule_decodes(batch)
        core._schedule_prefills(batch, core.config.max_prefill_tokens)
        return ended

    def reserve(self, core, req):
        return max_output(req)


@BATCHING_STRATEGIES.register("lightllm")
class LightLLMBatching(BatchingStrategy):
    chunked = False

    def __init__(self, max_waiting_iters: int = 10, watermark: float = 0.01):
        super().__init__(max_waiting_iters, watermark)
        self.decodes_since_prefill = 0

    def plan(self, core, batch):
        decoding = any(r.num_pending == 1 for r in core.running)
        if not decoding or self.decodes_since_prefill >= self.max_waiting_iters:
            core._schedule_prefills(batch, core.config.max_prefill_tokens)
            if batch.rows:
                self.decodes_since_prefill = 0
                return []
        ended = core._schedule_decodes(batch)
        self.decodes_since_prefill += bool(batch.rows)
        return ended

    def admissible(self, core, req, pending):
        held = [(r.num_fill, max_output(r)) for r in core.running]
        held.append((req.num_fill, max_output(req)))
        return peak_kv_need(held) <= core.token_pool.capacity


def peak_kv_need(requests: list[tuple[int, int]]) -> int:
    """The most KV slots (tokens held now, output tokens still to come) requests hold at once
    if each runs to its full length: when the one with the k-th longest remainder ends, the k
    longest have each grown by its remainder and the rest have ended."""
    if not requests:
        return 0
    held = np.array(requests, dtype=np.int64)
    held = held[np.argsort(-held[:, 1], kind="stable")]
    ranks = np.arange(1, len(held) + 1)
    return int((np.cumsum(held[:, 0]) + held[:, 1] * ranks).max())


@BATCHING_STRATEGIES.register("static")
class StaticBatching(BatchingStrategy):
    chunked = False

    def plan(self, core, batch):
        if not core.running:
            core._schedule_prefills(batch, core.config.max_prefill_tokens)
            return []
        return core._schedule_decodes(batch)

    def reserve(self, core, req):
        return max_output(req)
