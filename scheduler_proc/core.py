"""The scheduling core: a plain object with no clock, socket or tensor.

The scheduler process, the tests (and later the simulator) drive the same object:
`add_request`, `next_batch`, `on_result`, `abort`. Every step it runs each decoding request one
token, continues a chunked prompt, and admits waiting requests while the step's token budget,
the request slots and the KV pool allow (continuous batching, decodes and prefills in one
packed forward).

Prefix cache (radix_cache.py, on unless disabled): a request's prompt (and, after a retraction,
its output so far) is matched against the tree when it is admitted; it takes the cached slots
(locking their node) and computes only the rest, at least its last token. Its computed tokens go
into the tree as they are scheduled (a prompt chunk is reusable from the step that computes it:
the worker stores every row's K/V before any row attends) and when it ends; the tree keeps the
first copy of a shared part, the request's duplicates are freed when it ends. Unlocked slots are
evicted, least recently used first, when the pool needs room. Waiting requests that share a
prompt not cached yet with one being computed (its prefill group, the n choices of one prompt,
or --in-batch-prefix-threshold tokens) wait a step so they hit the cache instead.

Placeholders: every row that samples appends a placeholder to its request's output_ids when the
step is planned, -k - 1 for the worker's future-map entry k, and on_result puts the sampled token
in its place. A step planned before the previous step's result is applied (the overlap loop)
thus feeds the not-yet-known token by reference, resolved inside the worker; the normal loop
applies every result before planning again, so its steps never carry one. A request found
finished one step late drops the placeholder of the step after (that row's token is ignored and
its KV slot freed with the rest of the request's).

Block diffusion (config.dllm_block_size > 0): the steps are rounds of a diffusion model over
each request's block instead of one sampled token per row; scheduler_proc/dllm.py plans them
and applies their results (`on_dllm_result`), with the same queues, pools and prefix cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from ipc.messages import DllmResult, FinishReason, future_capacity
from scheduler_proc.batching import BATCHING_STRATEGIES, BatchingStrategy
from scheduler_proc.dllm import DllmPlanner
from scheduler_proc.kv_allocator import ReqSlotAllocator, TokenSlotAllocator
from scheduler_proc.policies import QUEUE_POLICIES, QueuePolicy, apply_priority
from scheduler_proc.prefill_adder import ADMISSION_POLICIES, PrefillAdder
from scheduler_proc.radix_cache import RadixCache, common_prefix
from scheduler_proc.req import Req, ReqState
from scheduler_proc.schedule_batch import BatchRow, ScheduleBatch
from scheduler_proc.speculative import SPECULATIVE_ALGORITHMS, accepted

# Decode slots are reserved per request in runs that end on positions that are multiples of this
# (SchedulerCore._reserve_decode_slots): the AMX decode kernel's group of tokens.
KV_SLOT_RUN = 16


@dataclass(slots=True)
class SchedulerConfig:
    max_total_tokens: int  # KV slots in the pool
    max_running_requests: int
    max_prefill_tokens: int  # prompt tokens one step may compute
    max_context_len: int
    eos_token_ids: tuple[int, ...] = ()
    chunked_prefill_size: int | None = None  # one request's prompt tokens per step; None: no chunking
    enable_mixed_chunk: bool = True  # decodes ride in the same forward as prompt chunks (loom batching)
    decode_first: bool = False  # see SchedulerCore.next_batch (loom batching)
    batching_strategy: str = "loom"  # batching.py
    max_waiting_iters: int = 10  # lightllm batching: decode steps between prompt steps
    watermark: float = 0.01  # vllm batching: pool fraction kept free when admitting
    # Pipeline stages (micro-batches in flight), above 1: a request with a row in a step not yet
    # applied is left out of the next plans, so several steps of disjoint requests can be in
    # flight, and a step takes at most its share (1 / stages) of the active requests, so that the
    # micro-batches stay even (a burst admitted at once would otherwise ride one micro-batch).
    pipeline_stages: int = 1
    schedule_policy: str = "fcfs"
    enable_priority_scheduling: bool = False
    prefill_admission_policy: str = "fifo"
    admission_lookahead: int = 16
    force_fifo_every: int = 0
    waiting_timeout: float | None = None  # seconds a request may wait before it is aborted
    running_timeout: float | None = None  # seconds a request may run before it is aborted
    seed: int = 0
    enable_radix_cache: bool = True
    page_size: int = 1  # prefix cache matches and inserts whole pages of this many tokens
    in_batch_prefix_threshold: int = 32  # shared uncached prompt tokens that hold a waiting request a step
    # Reservation for the outputs of running requests: ratio x remaining max_new_tokens.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.14
    new_token_ratio_decay: float = 0.001
    # Block diffusion (scheduler_proc/dllm.py): block size (0: autoregressive), the mask id, FDFO
    # or sync rounds, and in-place reuse of an unfinished block's slots (with worker re-loops).
    dllm_block_size: int = 0
    dllm_mask_id: int = -1
    dllm_fdfo: bool = True
    dllm_in_place: bool = True
    # Speculative decoding (speculative.py): the draft proposer (None: off), drafts per request and
    # step, its n-gram lengths, and the most decoding requests a step may have for drafts (a larger
    # step is compute-bound, where drafts cost more than they save)
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 4
    speculative_ngram_min: int = 2
    speculative_ngram_max: int = 4
    speculative_max_batch_size: int = 4

    @classmethod
    def from_args(cls, args: dict, max_total_tokens: int, max_context_len: int,
                  eos_token_ids: tuple[int, ...] = (), **more) -> "SchedulerConfig":
        """The configuration the server's flags (ServerArgs, as a dict) give a pool of this size
        (`more`: fields the flags alone do not give, e.g. the diffusion model's)."""
        same = ("max_running_requests", "max_prefill_tokens", "enable_mixed_chunk", "decode_first",
                "batching_strategy", "max_waiting_iters", "watermark", "schedule_policy",
                "enable_priority_scheduling", "prefill_admission_policy", "admission_lookahead", "force_fifo_every",
                "waiting_timeout", "running_timeout", "page_size", "in_batch_prefix_threshold",
                "speculative_algorithm", "speculative_num_draft_tokens", "speculative_ngram_min",
                "speculative_ngram_max", "speculative_max_batch_size")
        return cls(max_total_tokens=max_total_tokens, max_context_len=max_context_len, eos_token_ids=eos_token_ids,
                   chunked_prefill_size=None if args["chunked_prefill_size"] <= 0 else args["chunked_prefill_size"],
                   enable_radix_cache=not args["disable_radix_cache"], **{name: args[name] for name in same}, **more)


@dataclass(slots=True)
class ReqOutput:
    req: Req
    new_ids: list[int]
    finished: bool


class SchedulerCore:
    def __init__(
        self,
        config: SchedulerConfig,
        stop_checker: Callable[[Req, int], str | FinishReason | None] | None = None,
    ):
        self.config = config
        self.token_pool = TokenSlotAllocator(config.max_total_tokens)
        self.req_pool = ReqSlotAllocator(config.max_running_requests)
        self.cache = RadixCache(config.page_size) if config.enable_radix_cache else None
        self.queue_policy: QueuePolicy = QUEUE_POLICIES.make(config.schedule_policy, config.seed)
        self.batching: BatchingStrategy = BATCHING_STRATEGIES.make(
            config.batching_strategy, config.max_waiting_iters, config.watermark)
        self.admission = ADMISSION_POLICIES.make(config.prefill_admission_policy, config.admission_lookahead,
                                               config.force_fifo_every)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.stop_checker = stop_checker
        self.new_token_ratio = config.init_new_token_ratio
        self.step = 0
        self.num_retractions = 0
        self.idle_check_failures = 0
        self.last_batch_was_prefill = False
        self.now: float | None = None  # the clock value the caller passed to next_batch
        self.row_cap: int | None = None  # requests the step being planned may take (pipeline stages)
        self._eos = frozenset(config.eos_token_ids)
        self.num_prompt_tokens = 0  # prompt tokens of every request admitted, once each
        self.num_cached_prompt_tokens = 0  # of those, the ones taken from the prefix cache
        self._matches: dict[int, tuple[np.ndarray, object]] = {}  # id(req) -> its cache match, this step
        self.future_capacity = future_capacity(config.max_running_requests)
        self.next_future = 0
        self.retracted_last_step = False  # the last planned step retracted a request
        self.dllm = DllmPlanner(self) if config.dllm_block_size > 0 else None
        self.proposer = (SPECULATIVE_ALGORITHMS.make(config.speculative_algorithm, config.speculative_num_draft_tokens,
                                                     config.speculative_ngram_min, config.speculative_ngram_max)
                         if config.speculative_algorithm and self.dllm is None and config.pipeline_stages == 1
                         else None)
        self.num_draft_tokens = 0  # drafts proposed
        self.num_accepted_tokens = 0  # of those, kept

    # ---- requests in ---------------------------------------------------------------------

    def add_request(self, req: Req) -> ReqOutput | None:
        """Queue a request; one that can never run is finished at once (the output says why)."""
        limit = self.config.max_context_len
        if len(req.input_ids) == 0:
            return self._finish_now(req, "the prompt is empty")
        if len(req.input_ids) + 1 > min(limit, self.config.max_total_tokens):
            return self._finish_now(
                req,
                f"the prompt has {len(req.input_ids)} tokens; this server holds at most "
                f"{min(limit, self.config.max_total_tokens) - 1}",
            )
        if self.dllm is not None:
            refusal = self.dllm.refusal(req)
            if refusal is not None:
                return self._finish_now(req, refusal)
        req.state = ReqState.WAITING
        self.waiting.append(req)
        return None

    def abort(self, rid: str, message: str = "aborted") -> list[ReqOutput]:
        """Abort one request by id ("" aborts all), from any state, freeing what it holds."""
        outputs = []
        for req in [*self.waiting, *self.running]:
            if rid == "" or req.rid == rid:
                if req.state is ReqState.WAITING:
                    self.waiting.remove(req)
                outputs.append(self._finish(req, FinishReason("abort", message=message)))
        return outputs

    # ---- one step ----------------------------------------------------------------------

    def next_batch(self, now: float | None = None) -> tuple[ScheduleBatch | None, list[ReqOutput]]:
        """Plan the next forward, as the batching strategy composes it. Also returns requests
        that ended while planning (timeouts, a lone request the KV pool cannot grow any further).

        loom batching, mixed mode (default): every step runs each decoding request one token and
        admits prompts alongside; with decode_first the decodes also count against the step's
        token budget. Unmixed: a step is either prompts only (prefill first, as SGLang) or
        decodes only; with decode_first a pending decode step goes before the next prompt step."""
        self.now = now
        retractions = self.num_retractions
        ended = self._check_timeouts(now) if now is not None else []
        batch = ScheduleBatch(step=self.step)
        if self.dllm is not None:
            ended += self.dllm.plan(batch)
            self.retracted_last_step = self.num_retractions > retractions
            if not batch.rows:
                return None, ended
            self.step += 1
            return batch, ended
        stages = self.config.pipeline_stages
        self.row_cap = -(-(len(self.running) + len(self.waiting)) // stages) if stages > 1 else None
        ended += self.batching.plan(self, batch)
        self.retracted_last_step = self.num_retractions > retractions
        if not batch.rows:
            return None, ended
        self.last_batch_was_prefill = batch.has_prompts
        if stages > 1:
            for row in batch.rows:
                row.req.in_flight = True
        for row in batch.rows:
            if row.samples:
                row.output_index, row.future = len(row.req.output_ids), self.next_future
                self.next_future = (self.next_future + 1) % self.future_capacity
                row.req.output_ids.append(-row.future - 1)
        self.step += 1
        return batch, ended

    def overlap_blocker(self, in_flight: ScheduleBatch) -> str | None:
        """Why the next step should not be planned while `in_flight` runs (the overlap loop then
        applies its result first), or None. Planning ahead is always correct (placeholders);
        these are the cases where it helps nothing or costs:
          prefill-after-prefill: the step in flight computes prompts and more prompts wait: their
            first tokens go out sooner if the next prompt step does not delay applying this one
            (SGLang does the same, to protect time to first token);
          after-retraction: the last plan retracted; the KV pool is short and the next plan
            should see the slots that finishing requests free;
          kv-short: the decodes of the next step may not fit the free KV slots (they would
            retract, which the results in flight could make unnecessary);
          speculative: the step in flight has drafts, or the next one may (few enough requests)."""
        if self.dllm is not None:
            return "dllm"  # a diffusion step's rows continue from its result
        if any(r.drafts for r in in_flight.rows) or (
                self.proposer is not None and len(self.running) <= self.config.speculative_max_batch_size):
            # how many tokens a row with drafts keeps decides where its next ones start, and drafts
            # are proposed from known tokens only (not a step's still in flight)
            return "speculative"
        if self.retracted_last_step:
            return "after-retraction"
        in_flight_prefill = in_flight.has_prompts
        if in_flight_prefill and (self.waiting or any(r.num_pending > 1 for r in self.running)):
            return "prefill-after-prefill"
        if self.token_pool.num_free < len(self.running):
            return "kv-short"
        return None

    def on_result(self, batch: ScheduleBatch, next_token_ids: Iterable[int], logprobs: list | None = None,
                  prompt_logprobs: list | None = None, embeddings: list | None = None) -> list[ReqOutput]:
        """Apply a step's sampled tokens (one per sampling row, in row order) and, for requests
        that asked, their logprobs (opaque to the core; kept aligned with output_ids), the
        prompt logprobs of batch.prompt_logprob_rows (a list per row, from its first position)
        and their embeddings (one per sampling row, opaque)."""
        outputs: list[ReqOutput] = []
        if self.config.pipeline_stages > 1:
            for row in batch.rows:
                row.req.in_flight = False
        for i, entries in zip(batch.prompt_logprob_rows, prompt_logprobs or ()):
            row = batch.rows[i]
            table = row.req.prompt_logprobs
            for position, entry in enumerate(entries, row.prefix_len):
                row.req.prompt_logprobs_missing -= table[position] is None
                table[position] = entry
        tokens = iter(next_token_ids)
        lps = iter(logprobs or ())
        embedded = iter(embeddings or ())
        for row in batch.rows:
            if not row.samples:
                continue  # a prompt chunk that samples nothing
            req, token, lp, embedding = row.req, next(tokens), next(lps, None), next(embedded, None)
            kept, kept_lps = [token], [lp]
            if row.drafts:  # the samples after each draft too: the drafts hold while they match
                samples = [token] + [next(tokens) for _ in row.drafts]
                kept_lps += [next(lps, None) for _ in row.drafts]
                for _ in row.drafts:
                    next(embedded, None)
                kept = samples[:accepted(row.drafts, samples) + 1]
                if req.state is not ReqState.FINISHED:
                    self._keep_drafts(req, row, len(kept) - 1)
            if req.state is ReqState.FINISHED:
                continue  # aborted while in flight, or found finished by the step before
            # (a request retracted while this step ran is WAITING: its token still counts)
            req.output_ids[row.output_index] = token
            if len(kept) > 1:
                assert row.output_index == len(req.output_ids) - 1, "a step was planned past one with drafts"
                req.output_ids += kept[1:]
            if lp is not None:
                req.output_logprobs += kept_lps[:len(kept)]
            if embedding and not req.embedding:
                req.embedding = embedding
            for produced, token in enumerate(kept, row.output_index + 1):
                finish = self._check_finish(req, token, produced)
                if finish is not None:
                    del req.output_ids[produced:]  # a later step's placeholder: that token is not wanted
                    del req.output_logprobs[produced:]  # (and kept drafts' after a stop among them)
                    outputs.append(self._finish(req, finish))
                    break
            else:
                outputs.append(ReqOutput(req, self._take_unsent(req), False))
        if self.batching.decaying_estimate and self.new_token_ratio > self.config.min_new_token_ratio:
            self.new_token_ratio = max(
                self.config.min_new_token_ratio, self.new_token_ratio - self.config.new_token_ratio_decay
            )
        return outputs

    def _keep_drafts(self, req: Req, row: BatchRow, kept: int) -> None:
        """A row with drafts kept `kept` of them: their KV stays; the slots of the rest (the row's
        last ones) go back to the request's reserve for its next tokens."""
        self.num_accepted_tokens += kept
        rejected = len(row.drafts) - kept
        if rejected and req.state is ReqState.RUNNING:
            req.num_computed -= rejected
            req.kv_reserve = np.concatenate([row.new_slots[len(row.new_slots) - rejected:], req.kv_reserve])

    def on_dllm_result(self, batch: ScheduleBatch, result: DllmResult) -> list[ReqOutput]:
        """Apply a diffusion step's result: done blocks commit (one output per request whose
        block committed), unfinished ones continue next step (scheduler_proc/dllm.py)."""
        return self.dllm.apply(batch, result)

    # ---- planning ----------------------------------------------------------------------

    def _schedule_decodes(self, batch: ScheduleBatch) -> list[ReqOutput]:
        ended: list[ReqOutput] = []
        while True:
            # (a request whose last token is still in flight needs no more once that one is its
            # last: the normal loop never has such a request running)
            decoding = [r for r in self.running if r.num_pending == 1 and not self._last_token_planned(r)
                        and not r.in_flight][: self.row_cap]
            if self._make_room(sum(1 for r in decoding if not len(r.kv_reserve))):
                break
            if len(self.running) == 1:
                ended.append(self._finish(self.running[0], FinishReason(
                    "abort", message="the KV cache is too small to continue this request")))
            else:
                self._retract(self.batching.victim(self))
        self._reserve_decode_slots(decoding)
        speculate = self.proposer is not None and len(decoding) <= self.config.speculative_max_batch_size
        for req in decoding:
            drafts = self._drafts(req) if speculate else []
            if drafts:
                slots, req.kv_reserve = req.kv_reserve[:1 + len(drafts)], req.kv_reserve[1 + len(drafts):]
                if len(slots) < 1 + len(drafts):
                    slots = np.concatenate([slots, self.token_pool.alloc(1 + len(drafts) - len(slots))])
                self._extend(batch, req, 1 + len(drafts), slots, drafts)
            else:
                slot, req.kv_reserve = req.kv_reserve[:1], req.kv_reserve[1:]
                self._extend(batch, req, 1, slot)
        return ended

    def _drafts(self, req: Req) -> list[int]:
        """Speculative draft tokens for a decoding request ([]: none): where its tokens are all
        known (not planned ahead of a step in flight), no grammar of its waits for a tag
        (grammar_after), and the pool has the slots free."""
        sp = req.sampling
        if not req.output_ids or req.output_ids[-1] < 0 or sp.grammar_after or sp.embedding:
            return []
        room = min(req.remaining_new_tokens, self.config.max_context_len - req.num_fill) - 1
        drafts = self.proposer.propose(req.fill_slice(0, req.num_fill), room)
        if drafts and not self._make_room(len(drafts) + 1 - len(req.kv_reserve)):
            return []
        self.num_draft_tokens += len(drafts)
        return drafts

    def _reserve_decode_slots(self, decoding: list[Req]) -> None:
        """Gives each decode without reserved slots a run of consecutive ones, up to its next
        position that is a multiple of KV_SLOT_RUN (or its last token), so that a request's KV
        lies in runs of slots rather than interleaved with every other decode of the step: the
        attention kernels read a run as one stream. Runs come only from free slots; short of them,
        a slot each."""
        short = [r for r in decoding if not len(r.kv_reserve)]
        runs = [max(1, min(KV_SLOT_RUN - r.num_computed % KV_SLOT_RUN, r.remaining_new_tokens)) for r in short]
        if sum(runs) > self.token_pool.num_free:
            runs = [1] * len(short)
        slots = self.token_pool.alloc(sum(runs))  # one allocation for every run
        start = 0
        for req, n in zip(short, runs):
            req.kv_reserve = slots[start : start + n]
            start += n

    def _schedule_prefills(self, batch: ScheduleBatch, input_budget: int) -> None:
        if not self.waiting and not any(r.num_pending > 1 for r in self.running):
            return  # no prompt to compute (most steps of a steady load)
        cfg = self.config
        self._matches.clear()
        available = self._available()
        adder = PrefillAdder(
            rem_total=available - self._reserved_tokens(),
            rem_input=input_budget,
            chunk_size=self.batching.chunk_size(self),
            pool_free=available,
            nothing_running=not self.running,
        )
        # A request whose prompt was chunked last step resumes first.
        for req in list(self.running):
            if req.num_pending > 1 and not req.in_flight and self._row_left(batch):
                n = min(req.num_pending, adder.rem_input, adder.chunk_size or req.num_pending,
                        self._available())
                if n > 0:
                    adder.add_resumed_chunk(n, req.num_pending)
                    self._extend(batch, req, n)
        self.queue_policy.order(self.waiting, self.running, self._match if self.cache is not None else None)
        if cfg.enable_priority_scheduling:
            apply_priority(self.waiting)
        computing = [r for r in self.running if r.num_pending > 1] if self.cache is not None else []
        candidates = deque(r for r in self.waiting if not self._held(r, computing)) if computing \
            else self.waiting.copy()  # (a C-level copy: the queue can be thousands long under overload)

        def admit(req: Req, n: int) -> bool:
            """Takes the request's cached prefix (re-checking the budget: those slots no longer
            count as evictable), then computes n tokens of the rest; False: it does not fit."""
            if self.cache is not None:
                cached, node = self._match(req)
                before = self.cache.evictable_size
                self.cache.lock(node)
                freed_from_budget = before - self.cache.evictable_size
                adder.rem_total -= freed_from_budget
                adder.pool_free -= freed_from_budget
                req.cache_node = node
                req.append_kv(cached)
                n = adder.fits(req.num_pending, self._expected_output(req))
                if n == 0 or not self.batching.admissible(self, req, n):
                    req.clear_kv()
                    self.cache.unlock(node)
                    req.cache_node = None
                    adder.rem_total += freed_from_budget
                    adder.pool_free += freed_from_budget
                    return False
                req.prefix_table_due = len(cached) > 0
                if req.retractions == 0:
                    req.cached_tokens = len(cached)
                    self.num_cached_prompt_tokens += len(cached)
            elif not self.batching.admissible(self, req, n):
                return False
            self.waiting.remove(req)
            candidates.remove(req)
            adder.add(n, req.num_pending, self._expected_output(req))
            req.req_pool_idx = self.req_pool.alloc()
            req.state = ReqState.RUNNING
            if req.started is None:
                req.started = self.now
            if req.retractions == 0:  # its first admission (only a retraction brings one back)
                self.num_prompt_tokens += len(req.input_ids)
            self.running.append(req)
            self._extend(batch, req, n)
            return True

        self.admission.admit(candidates, adder, self._expected_output, admit,
                             lambda: self.req_pool.num_free > 0 and self._row_left(batch), self._pending)

    def _row_left(self, batch: ScheduleBatch) -> bool:
        """Whether the step may take one more request (a pipeline's micro-batch takes its share)."""
        return self.row_cap is None or len(batch.rows) < self.row_cap

    def _pending(self, req: Req) -> int:
        """Tokens the request would compute if admitted now: its pending ones less its cached prefix."""
        return req.num_pending - len(self._match(req)[0]) if self.cache is not None and req.num_computed == 0 \
            else req.num_pending

    def _match(self, req: Req) -> tuple[np.ndarray, object]:
        """The request's cached prefix (memoized for this step: inserts and evictions clear it).
        At least its last token stays to compute: its logits are sampled."""
        hit = self._matches.get(id(req))
        if hit is None:
            # (prompt logprobs need the logits of every prompt position: none is taken from the cache)
            tokens = self._resolved(req, 0 if req.prompt_logprobs_missing else req.num_fill - 1)
            hit = self._matches[id(req)] = self.cache.match_prefix(tokens)
        return hit

    def _held(self, req: Req, computing: list[Req]) -> bool:
        """Whether a waiting request waits a step for a prompt being computed that it shares
        (`computing`: running requests mid-prompt): the same prefill group (the n choices of one
        prompt), or at least --in-batch-prefix-threshold tokens past its cached prefix; it then
        hits the cache."""
        threshold = self.config.in_batch_prefix_threshold
        for other in computing:
            if req.prefill_group is not None and other.prefill_group == req.prefill_group:
                return True
            if threshold > 0 and common_prefix(other.input_ids, req.input_ids) - len(self._match(req)[0]) >= threshold:
                return True
        return False

    def _check_timeouts(self, now: float) -> list[ReqOutput]:
        cfg, ended = self.config, []
        if cfg.waiting_timeout is not None:
            for req in [r for r in self.waiting if now - r.arrival > cfg.waiting_timeout]:
                self.waiting.remove(req)
                ended.append(self._finish(req, FinishReason(
                    "abort", message=f"waited more than {cfg.waiting_timeout:g} s in the queue")))
        if cfg.running_timeout is not None:
            for req in [r for r in self.running if r.started is not None and now - r.started > cfg.running_timeout]:
                ended.append(self._finish(req, FinishReason(
                    "abort", message=f"ran more than {cfg.running_timeout:g} s")))
        return ended

    def _extend(self, batch: ScheduleBatch, req: Req, n: int, slots: np.ndarray | None = None,
                drafts: list[int] | None = None) -> None:
        """Add `n` tokens of `req` to the batch, on `slots` or freshly allocated ones (with
        `drafts`: its last token and the drafts). A prompt chunk goes into the prefix cache at once."""
        if slots is None:
            if not self._make_room(n):
                raise AssertionError("the caller checked the budget")
            slots = self.token_pool.alloc(n)
        prefix = req.num_computed
        row = BatchRow(req, prefix, n, slots, samples=prefix + n == req.num_fill + len(drafts or ()))
        if drafts:
            row.input_ids, row.drafts = req.fill_slice(prefix, prefix + 1) + drafts, drafts
        if req.prefix_table_due:  # its first row: the worker learns where the cached prefix lies
            row.prefix_table = req.kv_slots.copy()
            req.prefix_table_due = False
        batch.rows.append(row)
        req.append_kv(slots)
        if self.cache is not None and not drafts and (n > 1 or prefix < len(req.input_ids)):  # a prompt chunk (or a re-prefill)
            self._cache_computed(req)

    def _cache_computed(self, req: Req) -> None:
        """Puts the request's computed tokens into the tree and moves its lock to where they end."""
        tokens = self._resolved(req, req.num_computed)
        _, node = self.cache.insert(tokens, req.kv_slots[: len(tokens)])
        self.cache.lock(node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = node
        self._matches.clear()

    # ---- memory ------------------------------------------------------------------------

    def _available(self) -> int:
        """KV slots free now or freeable by evicting unlocked cached ones."""
        return self.token_pool.num_free + (self.cache.evictable_size if self.cache is not None else 0)

    def _make_room(self, n: int) -> bool:
        """Evicts cached slots until n are free; False if even that cannot."""
        short = n - self.token_pool.num_free
        if short > 0 and self.cache is not None and self.cache.evictable_size:
            self.token_pool.free(self.cache.evict(short))
            self._matches.clear()
        return self.token_pool.num_free >= n

    def _expected_output(self, req: Req) -> int:
        """Output tokens to reserve KV for (the batching strategy's rule)."""
        return self.batching.reserve(self, req)

    def _reserved_tokens(self) -> int:
        return sum(self._expected_output(r) + max(r.num_pending - 1, 0) for r in self.running)

    def _retract(self, req: Req) -> None:
        self._release(req)
        req.state = ReqState.WAITING
        req.retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)
        self.new_token_ratio = self.config.init_new_token_ratio

    @staticmethod
    def _resolved(req: Req, n: int) -> list[int]:
        """The request's first n tokens of prompt + output, up to its first placeholder."""
        tokens = req.fill_slice(0, n)
        if n > len(req.input_ids) and tokens[-1] < 0:
            tokens = tokens[: next(i for i, t in enumerate(tokens) if t < 0)]
        return tokens

    # ---- finishing ---------------------------------------------------------------------

    def _check_finish(self, req: Req, token: int, produced: int) -> FinishReason | None:
        """Whether `token`, the request's output token number `produced`, ends it (later
        output ids may be placeholders of steps planned since)."""
        sp = req.sampling
        if token in sp.stop_token_ids:
            return FinishReason("stop", matched=token)
        # (a grammar lets EOS through only once its text is whole: min_new_tokens does not hold it)
        if not sp.ignore_eos and token in self._eos and (produced >= sp.min_new_tokens or sp.has_grammar):
            return FinishReason("stop", matched=token)
        if (sp.stop or sp.stop_regex) and self.stop_checker is not None:
            matched = self.stop_checker(req, produced)
            if isinstance(matched, FinishReason):  # (a stop regex that ran out of time)
                return matched
            if matched is not None:
                return FinishReason("stop", matched=matched)
        if produced >= sp.max_new_tokens:
            return FinishReason("length")
        if len(req.input_ids) + produced >= self.config.max_context_len:
            return FinishReason("length", message="reached the model's context length")
        return None

    def _last_token_planned(self, req: Req) -> bool:
        """The request's output already reaches its length limit with the tokens planned so far."""
        return (len(req.output_ids) >= req.sampling.max_new_tokens
                or req.num_fill >= self.config.max_context_len)

    def _finish(self, req: Req, finish: FinishReason) -> ReqOutput:
        if req.state is ReqState.RUNNING:
            self._release(req)
        elif req in self.waiting:  # retracted while its last token was in flight
            self.waiting.remove(req)
        req.state = ReqState.FINISHED
        req.finish = finish
        return ReqOutput(req, self._take_unsent(req), True)

    def _finish_now(self, req: Req, message: str) -> ReqOutput:
        req.state = ReqState.FINISHED
        req.finish = FinishReason("abort", message=message)
        return ReqOutput(req, [], True)

    def _release(self, req: Req) -> None:
        """Frees what a running request holds. With the cache, its computed tokens go into the
        tree first; of its slots, those the tree now holds stay (cached), the rest (copies of
        tokens the tree had already, tokens past the last whole page, a step planned past its
        end) go back to the pool."""
        self.token_pool.free(req.kv_reserve)
        req.kv_reserve = req.kv_reserve[:0]
        slots = req.kv_slots
        if self.dllm is not None:  # only whole blocks whose KV came from final ids may be cached
            computed = req.dllm_kv_valid
            self.dllm.forget(req)
        else:
            computed = req.num_computed
        if self.cache is not None:
            tokens = self._resolved(req, computed)
            self.cache.insert(tokens, slots[: len(tokens)])
            kept, _ = self.cache.match_prefix(tokens)
            mine = slots[: len(kept)]
            self.token_pool.free(np.concatenate([mine[mine != kept], slots[len(kept):]]))
            if req.cache_node is not None:
                self.cache.unlock(req.cache_node)
                req.cache_node = None
            self._matches.clear()
        else:
            self.token_pool.free(slots)
        req.clear_kv()
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = -1
        self.running.remove(req)

    @staticmethod
    def _take_unsent(req: Req) -> list[int]:
        """The output ids not handed out yet, up to the first placeholder."""
        ids, end = req.output_ids, len(req.output_ids)
        while end > req.sent_ids and ids[end - 1] < 0:
            end -= 1
        new = ids[req.sent_ids : end]
        req.sent_ids = end
        return new

    # ---- the prefix cache --------------------------------------------------------------

    def flush_cache(self) -> str | None:
        """Empties the prefix cache; refused (the reason returned) while requests are queued or run."""
        if self.cache is None:
            return "the prefix cache is disabled (--disable-radix-cache)"
        if self.running or self.waiting:
            return f"{len(self.running)} requests running and {len(self.waiting)} waiting: flush when idle"
        self.token_pool.free(self.cache.reset())
        self._matches.clear()
        return None

    # ---- introspection -----------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        cache = self.cache
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_slots_total": self.token_pool.capacity,
            "kv_slots_free": self.token_pool.num_free,
            # of the slots in use: cached and evictable, cached and locked by running requests
            "kv_slots_evictable": cache.evictable_size if cache is not None else 0,
            "kv_slots_locked": cache.protected_size if cache is not None else 0,
            "req_slots_total": self.req_pool.capacity,
            "req_slots_free": self.req_pool.num_free,
            "new_token_ratio": self.new_token_ratio,
            "num_retractions": self.num_retractions,
            "idle_check_failures": self.idle_check_failures,
            "step": self.step,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_prompt_tokens": self.num_cached_prompt_tokens,
            "cache_hit_rate": self.num_cached_prompt_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0,
            "kv_slots_allocated_total": self.token_pool.allocated_total,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "kv_slots_freed_total": self.token_pool.freed_total,
            **(self.dllm.stats() if self.dllm is not None else {}),
        }

    def idle_leaks(self) -> list[str]:
        """When nothing is queued or running, every slot must be free or held by the prefix
        cache, unlocked; returns what is not."""
        if self.running or self.waiting:
            return []
        problems = []
        cached = self.cache.total_size if self.cache is not None else 0
        used = self.token_pool.capacity - self.token_pool.num_free
        if used != cached:
            problems.append(f"{used - cached} KV slots leaked ({used} in use, {cached} cached)")
        if self.cache is not None and self.cache.protected_size:
            problems.append(f"{self.cache.protected_size} cached tokens still locked")
        if self.req_pool.num_free != self.req_pool.capacity:
            problems.append(f"{self.req_pool.capacity - self.req_pool.num_free} request slots leaked")
        self.idle_check_failures += bool(problems)
        return problems
