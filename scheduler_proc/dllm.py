"""Block-diffusion scheduling: the part of the scheduling core (pure: no clock, socket or tensor)
that plans the steps of a diffusion model and applies their results (--dllm-algorithm).

A request's tokens fall in blocks of block_size positions from position 0. Its next block
starts where its prompt + committed output ends, rounded down to a block: a prompt that is not
block-aligned shares its last block with the first output positions (the algorithm never edits
the prompt's). A new block starts as the mask id at every output position. Every step gives
every running request one row: its committed tokens whose KV is not computed from their final
ids yet (a new request's whole prompt blocks; the block it finished last step) and its block,
in one block-causal forward; the worker runs the algorithm's rounds over the blocks
(worker_proc/dllm.py) and answers per row with the block's ids and an accept length:
block_size: the block is done and commits (its output positions are appended, checked for
EOS, stop and length, and streamed as one chunk); 0: not done (FDFO only), the request keeps the
ids in dllm_incomplete_ids and the algorithm's opaque state in dllm_algo_state, and its next row
hands both back.

Modes: sync (--no-dllm-fdfo) asks the worker to run rounds until every block of the step is
done, so a batch moves at its slowest block; FDFO returns at the first round where some block is
done: that one commits and streams, the room it frees admits waiting requests, and the others
continue. In-place reuse (--dllm-in-place, FDFO): an unfinished block keeps its KV slots and
its request slot between steps (no free/alloc), and the worker re-loops rounds that finish no
block without a round-trip to the scheduler; without it an unfinished block's slots are freed
after each round and allocated again for the next.

KV: a request holds slots up to the end of its block; `dllm_kv_valid` counts the leading
positions whose KV came from final ids (whole blocks). Only those ever enter the prefix cache
(when the request ends, is aborted or retracted): a block being denoised, or committed but not
yet recomputed, never does. An abort frees the block's slots with the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ipc.messages import DllmResult, FinishReason
from scheduler_proc.policies import apply_priority
from scheduler_proc.req import Req, ReqState
from scheduler_proc.schedule_batch import BatchRow, ScheduleBatch

if TYPE_CHECKING:
    from scheduler_proc.core import ReqOutput, SchedulerCore


class DllmPlanner:
    def __init__(self, core: "SchedulerCore"):
        cfg = core.config
        self.core = core
        self.block = cfg.dllm_block_size
        self.mask_id = cfg.dllm_mask_id
        self.fdfo = cfg.dllm_fdfo
        self.in_place = cfg.dllm_in_place
        self.steps = 0  # diffusion steps (scheduler round-trips)
        self.rounds = 0  # forward rounds the workers ran for them
        self.block_rounds = 0  # blocks those rounds computed (the work: rounds x blocks in each)
        self.blocks_committed = 0

    # ---- geometry ------------------------------------------------------------------------

    def block_start(self, req: Req) -> int:
        return req.num_fill // self.block * self.block

    def block_end(self, req: Req) -> int:
        return self.block_start(req) + self.block

    def refusal(self, req: Req) -> str | None:
        """Why a request can never run (its first block does not fit), or None."""
        limit = min(self.core.config.max_context_len, self.core.config.max_total_tokens)
        end = self.block_end(req)
        if end > limit:
            return (f"the prompt has {len(req.input_ids)} tokens; its first block of {self.block} ends at {end}, past "
                    f"the {limit} tokens this server holds")
        return None

    # ---- planning ------------------------------------------------------------------------

    def plan(self, batch: ScheduleBatch) -> list["ReqOutput"]:
        """Every running request's row (its block continued, or the next one started), then
        waiting requests admitted while request slots, KV and the step's token budget allow."""
        core = self.core
        batch.dllm_block_size, batch.dllm_fdfo = self.block, self.fdfo
        batch.dllm_reloop = self.fdfo and self.in_place
        ended = []
        for req in list(core.running):  # a request that cannot finish its block within context ends now
            if self.block_end(req) > core.config.max_context_len:
                ended.append(core._finish(req, FinishReason("length", message="reached the model's context length")))
        while core.running and not core._make_room(sum(self.block_end(r) - r.num_computed for r in core.running)):
            if len(core.running) == 1:
                ended.append(core._finish(core.running[0], FinishReason(
                    "abort", message="the KV cache is too small to continue this request")))
            else:
                core._retract(core.batching.victim(core))
        for req in core.running:
            self._add_row(batch, req)
        self._admit(batch)
        return ended

    def _add_row(self, batch: ScheduleBatch, req: Req) -> None:
        start, end = self.block_start(req), self.block_end(req)
        if req.num_computed < end:  # a new block, or an unfinished one whose slots were freed
            req.append_kv(self.core.token_pool.alloc(end - req.num_computed))
        if req.dllm_incomplete_ids is None:
            fill = req.num_fill
            req.dllm_incomplete_ids = req.fill_slice(start, fill) + [self.mask_id] * (end - fill)
        valid = req.dllm_kv_valid
        row = BatchRow(req, valid, end - valid, req.kv_slots[valid:end].copy(), samples=True,
                       input_ids=req.fill_slice(valid, start) + req.dllm_incomplete_ids)
        if req.prefix_table_due:
            row.prefix_table = req.kv_slots[:valid].copy()
            req.prefix_table_due = False
        batch.rows.append(row)

    def match(self, req: Req) -> tuple[np.ndarray, object]:
        """The request's cached prefix: whole pages (so whole blocks) of its tokens before its
        first block (memoized for the step, as SchedulerCore._match)."""
        core = self.core
        hit = core._matches.get(id(req))
        if hit is None:
            hit = core._matches[id(req)] = core.cache.match_prefix(req.fill_slice(0, self.block_start(req)))
        return hit

    def _admit(self, batch: ScheduleBatch) -> None:
        core, cfg = self.core, self.core.config
        core._matches.clear()
        core.queue_policy.order(core.waiting, core.running, self.match if core.cache is not None else None)
        if cfg.enable_priority_scheduling:
            apply_priority(core.waiting)
        budget = cfg.max_prefill_tokens
        admitted = 0
        for req in list(core.waiting):
            if core.req_pool.num_free == 0:
                break
            cached, node = self.match(req) if core.cache is not None else (np.empty(0, np.int32), None)
            need = self.block_end(req) - len(cached)
            if admitted and need > budget:  # (the first admission of a step may exceed it: it must go some time)
                break
            if node is not None:
                core.cache.lock(node)
            # the next blocks of the running requests come first
            reserve = self.block * len(core.running)
            if core._available() - reserve < need or not core._make_room(need):
                if node is not None:
                    core.cache.unlock(node)
                break
            core.waiting.remove(req)
            if node is not None:
                req.cache_node = node
                req.append_kv(cached)
                req.prefix_table_due = len(cached) > 0
                if req.retractions == 0:
                    req.cached_tokens = len(cached)
                    core.num_cached_prompt_tokens += len(cached)
            req.dllm_kv_valid = len(cached)
            req.req_pool_idx = core.req_pool.alloc()
            req.state = ReqState.RUNNING
            if req.started is None:
                req.started = core.now
            if req.retractions == 0:
                core.num_prompt_tokens += len(req.input_ids)
            core.running.append(req)
            self._add_row(batch, req)
            budget -= need
            admitted += 1

    # ---- results -------------------------------------------------------------------------

    def apply(self, batch: ScheduleBatch, result: DllmResult) -> list["ReqOutput"]:
        """Commits the done blocks (finishing requests where they end), keeps the others' ids and
        states for the next step."""
        from scheduler_proc.core import ReqOutput

        core = self.core
        self.steps += 1
        self.rounds += result.rounds
        self.block_rounds += result.block_rounds
        outputs = []
        for row, block, accept, state in zip(batch.rows, result.blocks, result.accept_lens, result.algo_states):
            req = row.req
            if req.state is not ReqState.RUNNING:
                continue  # aborted while the step ran: its slots are already freed
            ids = np.frombuffer(block, dtype=np.int32).tolist()
            start = row.prefix_len + row.extend_len - self.block
            req.dllm_kv_valid = start  # the step computed everything before the block from final ids
            if accept == 0:
                req.dllm_incomplete_ids, req.dllm_algo_state = ids, state
                if not self.in_place:
                    core.token_pool.free(req.kv_slots[start:].copy())
                    req.num_computed = start
                continue
            self.blocks_committed += 1
            req.dllm_incomplete_ids, req.dllm_algo_state = None, None
            finish = None
            for token in ids[req.num_fill - start :]:
                req.output_ids.append(token)
                finish = core._check_finish(req, token, len(req.output_ids))
                if finish is not None:
                    break
            if finish is not None:
                outputs.append(core._finish(req, finish))
            else:
                outputs.append(ReqOutput(req, core._take_unsent(req), False))
        return outputs

    def forget(self, req: Req) -> None:
        """A request that leaves the running set (finished, aborted, retracted) drops its block."""
        req.dllm_incomplete_ids, req.dllm_algo_state, req.dllm_kv_valid = None, None, 0

    def stats(self) -> dict[str, int]:
        return {"dllm_steps": self.steps, "dllm_rounds": self.rounds, "dllm_block_rounds": self.block_rounds,
                "dllm_reloop_rounds": self.rounds - self.steps, "dllm_blocks_committed": self.blocks_committed}
