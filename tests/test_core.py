"""The scheduling core driven directly, with a fake worker that checks its bookkeeping: the fake
keeps its own KV (slot -> token) and req_to_token mirror from the wire batches (prefix tables included),
and its "model" returns a token that depends on every token the request's slots hold, so a wrong
slot, a lost token, a stale mirror or a shared slot reused too early changes the output."""

from __future__ import annotations

import numpy as np
import pytest

from ipc.messages import ModelWorkerBatch, SamplingParams
from scheduler_proc.core import SchedulerConfig, SchedulerCore
from scheduler_proc.req import Req

EOS = 2


class FakeWorker:
    def __init__(self):
        self.kv: dict[int, int] = {}  # slot -> token id stored there
        self.req_to_token: dict[int, dict[int, int]] = {}  # req slot -> position -> slot

    def forward(self, b: ModelWorkerBatch) -> list[int]:
        ids = np.frombuffer(b.input_ids, np.int32)
        loc = np.frombuffer(b.out_cache_loc, np.int32)
        assert len(ids) == len(loc) == sum(b.extend_lens)
        assert len(set(loc.tolist())) == len(loc), "a slot handed out twice in one step"
        assert len(b.sample_rows) == len(b.sampling) == len(b.output_lens)
        assert all(e > 0 for e in b.extend_lens), "a worker row computes at least one token"
        for t in b.prefix_tables:  # a request starting on a cached prefix: where it lies
            self.req_to_token[t.req_pool_idx] = dict(enumerate(np.frombuffer(t.slots, np.int32).tolist()))
        row_tokens, start = [], 0
        for r, p, e in zip(b.req_pool_indices, b.prefix_lens, b.extend_lens):
            table = self.req_to_token.setdefault(r, {})
            for j in range(e):
                table[p + j] = int(loc[start + j])
                self.kv[int(loc[start + j])] = int(ids[start + j])
            start += e
            row_tokens.append([self.kv[table[i]] for i in range(p + e)])
        # (speculative drafts: a row's last 1 + drafts positions are each sampled, in order)
        drafts = b.draft_lens or [0] * len(b.sample_rows)
        return [self.next_token(row_tokens[row][:len(row_tokens[row]) - d + j])
                for row, d in zip(b.sample_rows, drafts) for j in range(d + 1)]

    @staticmethod
    def next_token(tokens: list[int]) -> int:
        return next_token(tokens)


def next_token(tokens: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 2654435761 % 997) + 3  # never EOS


def make_core(**kw) -> SchedulerCore:
    cfg = dict(max_total_tokens=4096, max_running_requests=16, max_prefill_tokens=512, max_context_len=2048,
               eos_token_ids=(EOS,))
    cfg.update(kw)
    return SchedulerCore(SchedulerConfig(**cfg))


def run(core: SchedulerCore, worker: FakeWorker, max_steps: int = 10_000, on_step=None):
    outputs: dict[str, list[int]] = {}
    finishes = {}
    batches = []
    for step in range(max_steps):
        if on_step:
            on_step(step, core)
        batch, ended = core.next_batch()
        for o in ended:
            finishes[o.req.rid] = o.req.finish
        if batch is None:
            if not core.waiting and not core.running:
                break
            continue
        batches.append(batch)
        for o in core.on_result(batch, worker.forward(batch.to_worker_batch())):
            outputs.setdefault(o.req.rid, []).extend(o.new_ids)
            if o.finished:
                assert o.req.rid not in finishes, "a request ended twice"
                finishes[o.req.rid] = o.req.finish
    assert not core.idle_leaks(), core.idle_leaks()
    return outputs, finishes, batches


def reference(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def req(rid: str, length: int, max_new: int, seed: int = 0, **sp) -> Req:
    rng = np.random.default_rng(seed)
    return Req(rid, rng.integers(3, 900, length).tolist(), SamplingParams(max_new_tokens=max_new, **sp),
               arrival=float(seed))


def test_outputs_match_reference_and_nothing_leaks():
    core, worker = make_core(), FakeWorker()
    reqs = [req(f"r{i}", 10 + 7 * i, 5 + i, seed=i) for i in range(10)]
    for r in reqs:
        core.add_request(r)
    outputs, finishes, _ = run(core, worker)
    for r in reqs:
        assert outputs[r.rid] == reference(r.input_ids, r.sampling.max_new_tokens)
        assert finishes[r.rid].type == "length"


def test_new_request_joins_while_others_decode():
    core, worker = make_core(), FakeWorker()
    for i in range(3):
        core.add_request(req(f"early{i}", 20, 30, seed=i))
    joined_at = {}

    def on_step(step, core):
        if step == 5:
            core.add_request(req("late", 20, 3, seed=9))

    _, _, batches = run(core, worker, on_step=on_step)
    for i, b in enumerate(batches):
        rids = {row.req.rid for row in b.rows}
        if "late" in rids and "late" not in joined_at:
            joined_at["late"] = i
            assert {"early0", "early1", "early2"} <= rids, "the newcomer rides in the same batch as decodes"
    last_early = max(i for i, b in enumerate(batches) if any(r.req.rid.startswith("early") for r in b.rows))
    assert joined_at["late"] < last_early


def test_long_prompt_is_chunked_by_the_step_budget_and_resumes_first():
    core, worker = make_core(max_prefill_tokens=1024, chunked_prefill_size=1024, max_context_len=4096,
                             max_total_tokens=8192), FakeWorker()
    long = req("long", 3000, 4, seed=1)
    core.add_request(long)
    core.add_request(req("short", 50, 4, seed=2))
    outputs, _, batches = run(core, worker)
    chunks = [row.extend_len for b in batches for row in b.rows if row.req.rid == "long" and row.extend_len > 1]
    assert chunks == [1024, 1024, 952]
    assert all(b.num_tokens - b.num_decode <= 1024 for b in batches)
    assert outputs["long"] == reference(long.input_ids, 4)


def test_retraction_under_a_small_pool_keeps_outputs_correct():
    # 8 requests of 40 + 60 tokens need 800 slots; the pool has 300, and with no output
    # reservation admission over-commits, so decodes run out of slots.
    core = make_core(max_total_tokens=300, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    worker = FakeWorker()
    reqs = [req(f"r{i}", 40, 60, seed=i) for i in range(8)]
    for r in reqs:
        core.add_request(r)
    outputs, finishes, _ = run(core, worker)
    assert core.num_retractions > 0
    for r in reqs:
        assert finishes[r.rid].type == "length"
        assert outputs[r.rid] == reference(r.input_ids, 60)
    assert drained(core) and core.token_pool.num_free == 300


def test_a_request_the_pool_cannot_hold_is_aborted_not_crashed():
    core, worker = make_core(max_total_tokens=64), FakeWorker()
    core.add_request(req("big", 50, 100, seed=3))
    outputs, finishes, _ = run(core, worker)
    assert finishes["big"].type == "abort" and "KV cache" in finishes["big"].message
    assert len(outputs["big"]) == 64 - 50 + 1  # every slot used; the last token needs none yet
    ended = core.add_request(req("huge", 80, 5))
    assert ended is not None and ended.finished and "prompt has 80 tokens" in ended.req.finish.message


def test_finish_reasons():
    core, worker = make_core(), FakeWorker()
    prompt = req("p", 12, 50, seed=5).input_ids
    ref = reference(prompt, 10)
    core.add_request(Req("stop_id", prompt, SamplingParams(max_new_tokens=50, stop_token_ids=[ref[3]])))
    core.add_request(Req("length", prompt, SamplingParams(max_new_tokens=4)))
    outputs, finishes, _ = run(core, worker)
    assert outputs["stop_id"] == ref[:4] and finishes["stop_id"].matched == ref[3]
    assert finishes["length"].type == "length" and len(outputs["length"]) == 4


def test_eos_respects_ignore_eos_and_min_new_tokens():
    class EosWorker(FakeWorker):
        def forward(self, b):
            return [EOS for _ in super().forward(b)]

    core, worker = make_core(), EosWorker()
    core.add_request(req("eos", 5, 10))
    core.add_request(req("ignore", 5, 6, ignore_eos=True))
    core.add_request(req("min", 5, 10, min_new_tokens=3))
    outputs, finishes, _ = run(core, worker)
    assert outputs["eos"] == [EOS] and finishes["eos"].matched == EOS
    assert outputs["ignore"] == [EOS] * 6 and finishes["ignore"].type == "length"
    assert outputs["min"] == [EOS] * 3


@pytest.mark.parametrize("when", ["waiting", "running", "in_flight"])
def test_abort_from_any_state_frees_everything(when):
    core, worker = make_core(max_running_requests=2), FakeWorker()
    for i in range(4):
        core.add_request(req(f"r{i}", 30, 20, seed=i))
    target = {"waiting": "r3", "running": "r0", "in_flight": "r1"}[when]
    batch, _ = core.next_batch()
    if when == "in_flight":
        ended = core.abort(target)
        core.on_result(batch, worker.forward(batch.to_worker_batch()))  # the step's result arrives late
    else:
        core.on_result(batch, worker.forward(batch.to_worker_batch()))
        ended = core.abort(target)
    assert [o.req.rid for o in ended] == [target] and ended[0].req.finish.type == "abort"
    outputs, finishes, _ = run(core, worker)
    assert target not in finishes
    assert drained(core)
    core.add_request(req("x", 10, 3))
    core.abort("")
    assert not core.idle_leaks()


# ---- the prefix cache: the n choices of one prompt, and requests that share a prefix -----------

def drained(core) -> bool:
    """Nothing leaked: with every request ended, flushing the cache returns the pool to full."""
    assert not core.idle_leaks(), core.idle_leaks()
    assert core.flush_cache() is None
    return core.token_pool.num_free == core.token_pool.capacity and core.req_pool.num_free == core.req_pool.capacity


def choices(group: str, n: int, length: int, max_new: int | list[int], seed: int = 0) -> list[Req]:
    """n requests with one prompt and one prefill group, as the OpenAI route sends n choices."""
    prompt = req("x", length, 1, seed=seed).input_ids
    news = max_new if isinstance(max_new, list) else [max_new] * n
    return [Req(f"{group}.{k}", list(prompt), SamplingParams(max_new_tokens=news[k]), arrival=float(seed),
                prefill_group=group) for k in range(n)]


def computed_prompt_tokens(batches, rids) -> int:
    """Prompt tokens the worker computed for these requests (before each had any output)."""
    return sum(min(row.extend_len, max(len(row.req.input_ids) - row.prefix_len, 0))
               for b in batches for row in b.rows if row.req.rid in rids)


def test_n_choices_compute_their_prompt_once():
    """The first choice computes the prompt, which enters the cache as it is scheduled; the
    others, admitted in the same step, take all of it but the last token from there."""
    core, worker = make_core(), FakeWorker()
    group = choices("g", 3, 40, [3, 6, 9], seed=1)
    for r in group:
        assert core.add_request(r) is None
    batch, _ = core.next_batch()
    assert [(row.req.rid, row.prefix_len, row.extend_len) for row in batch.rows] == \
        [("g.0", 0, 40), ("g.1", 39, 1), ("g.2", 39, 1)]
    wire = batch.to_worker_batch()
    assert [(t.req_pool_idx, np.frombuffer(t.slots, np.int32).tolist()) for t in wire.prefix_tables] == \
        [(f.req_pool_idx, group[0].kv_slots[:39].tolist()) for f in group[1:]]
    assert [r.cached_tokens for r in group] == [0, 39, 39]
    core.on_result(batch, worker.forward(wire))
    outputs, finishes, batches = run(core, worker)
    for r in group:
        assert [*r.output_ids] == reference(r.input_ids, r.sampling.max_new_tokens)
        assert finishes[r.rid].type == "length"
    assert computed_prompt_tokens([batch, *batches], {r.rid for r in group}) == 42
    stats = core.stats()
    assert stats["num_prompt_tokens"] == 120 and stats["num_cached_prompt_tokens"] == 78
    assert stats["cache_hit_rate"] == pytest.approx(78 / 120)
    assert drained(core)


def test_cached_slots_stay_locked_until_the_last_user_ends():
    core, worker = make_core(), FakeWorker()
    group = choices("g", 3, 30, [2, 5, 8], seed=2)
    for r in group:
        core.add_request(r)
    locked = []
    while core.running or core.waiting:
        batch, _ = core.next_batch()
        core.on_result(batch, worker.forward(batch.to_worker_batch()))
        locked.append(core.stats()["kv_slots_locked"])
    assert locked[0] >= 29 and locked[-1] == 0  # the shared prompt is locked while any choice runs
    stats = core.stats()
    assert stats["kv_slots_evictable"] == core.cache.total_size > 0 and stats["kv_slots_locked"] == 0
    assert drained(core)


def test_choices_arriving_during_a_chunked_prefill_wait_for_it_then_hit():
    core, worker = make_core(max_prefill_tokens=64, chunked_prefill_size=64), FakeWorker()
    group = choices("g", 3, 300, 5, seed=3)
    core.add_request(group[0])
    batch, _ = core.next_batch()  # the first chunk
    core.on_result(batch, worker.forward(batch.to_worker_batch()))
    core.add_request(group[1])
    batch, _ = core.next_batch()
    assert [row.req.rid for row in batch.rows] == ["g.0"]  # g.1 waits: its prompt is being computed
    core.on_result(batch, worker.forward(batch.to_worker_batch()))
    core.add_request(group[2])
    outputs, _, batches = run(core, worker)
    for r in group:
        assert outputs[r.rid] == reference(r.input_ids, 5)
    assert [r.cached_tokens for r in group] == [0, 299, 299]
    assert drained(core)


@pytest.mark.parametrize("when", ["waiting", "chunking"])
def test_choices_complete_when_the_one_computing_their_prompt_is_aborted(when):
    core, worker = make_core(max_prefill_tokens=64, chunked_prefill_size=64), FakeWorker()
    group = choices("g", 4, 200, 6, seed=4)
    for r in group:
        core.add_request(r)
    if when == "chunking":
        batch, _ = core.next_batch()
        core.on_result(batch, worker.forward(batch.to_worker_batch()))
    ended = core.abort("g.0")
    assert [o.req.rid for o in ended] == ["g.0"] and core.stats()["num_waiting"] == 3
    outputs, finishes, batches = run(core, worker)
    for r in group[1:]:
        assert outputs[r.rid] == reference(r.input_ids, 6) and finishes[r.rid].type == "length"
    done_before = 64 if when == "chunking" else 0  # the aborted one's chunk stays cached
    assert [r.cached_tokens for r in group[1:]] == [done_before, 199, 199]
    assert computed_prompt_tokens(batches, {r.rid for r in group[1:]}) == 200 - done_before + 2
    assert drained(core)


def test_a_waiting_choice_can_be_aborted_alone_or_with_everything():
    core, worker = make_core(), FakeWorker()
    group = choices("g", 3, 20, 4, seed=5)
    for r in group:
        core.add_request(r)
    ended = core.abort("g.2")
    assert [o.req.rid for o in ended] == ["g.2"] and ended[0].finished and ended[0].req.finish.type == "abort"
    outputs, finishes, _ = run(core, worker)
    assert set(finishes) == {"g.0", "g.1"} and outputs["g.1"] == reference(group[1].input_ids, 4)
    for r in choices("h", 3, 20, 4, seed=6):
        core.add_request(r)
    assert sorted(o.req.rid for o in core.abort("")) == ["h.0", "h.1", "h.2"]
    assert core.stats()["num_waiting"] == 0 and drained(core)


def test_choices_without_a_request_slot_hit_the_cache_later():
    core, worker = make_core(max_running_requests=2), FakeWorker()
    group = choices("g", 5, 30, 4, seed=7)
    for r in group:
        core.add_request(r)
    outputs, _, batches = run(core, worker)
    for r in group:
        assert outputs[r.rid] == reference(r.input_ids, 4)
    assert computed_prompt_tokens(batches, {r.rid for r in group}) == 30 + 4  # once, then the last token each
    assert core.stats()["num_cached_prompt_tokens"] == 4 * 29
    assert drained(core)


def test_requests_sharing_a_long_prefix_wait_for_the_first_to_compute_it():
    """Not one prompt, not one group: a shared system prompt of 200 tokens, different questions.
    The first is chunked through the prefix; the others hold (--in-batch-prefix-threshold) and
    then take the prefix from the cache."""
    core, worker = make_core(max_prefill_tokens=64, chunked_prefill_size=64), FakeWorker()
    system = req("s", 200, 1, seed=9).input_ids
    reqs = [Req(f"q{i}", system + [500 + i] * 10, SamplingParams(max_new_tokens=3), arrival=float(i))
            for i in range(4)]
    for r in reqs:
        core.add_request(r)
    outputs, _, batches = run(core, worker)
    for r in reqs:
        assert outputs[r.rid] == reference(r.input_ids, 3)
    assert [r.cached_tokens for r in reqs] == [0, 200, 200, 200]
    assert drained(core)


def test_retraction_with_choices_keeps_greedy_outputs_and_frees_everything():
    def workload():
        return [r for g in range(4) for r in choices(f"g{g}", 3, 30, 50, seed=10 + g)]

    relaxed, worker = make_core(), FakeWorker()
    for r in workload():
        relaxed.add_request(r)
    unpressured, _, _ = run(relaxed, worker)
    assert relaxed.num_retractions == 0

    core = make_core(max_total_tokens=300, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    worker = FakeWorker()
    for r in workload():
        core.add_request(r)
    outputs, finishes, _ = run(core, worker)
    assert core.num_retractions > 0
    assert outputs == unpressured
    assert all(f.type == "length" for f in finishes.values()) and len(finishes) == 12
    assert drained(core)


def test_the_cache_evicts_the_least_recently_used_and_outputs_stay_exact():
    """A pool that holds a few prompts: later requests evict older cached ones; a prompt seen
    again after its eviction is computed again, a recent one is hit."""
    core, worker = make_core(max_total_tokens=200), FakeWorker()
    prompts = [req("p", 60, 1, seed=20 + i).input_ids for i in range(4)]

    def ask(i, rid):
        r = Req(rid, list(prompts[i]), SamplingParams(max_new_tokens=2))
        core.add_request(r)
        outs, _, _ = run(core, worker)
        assert outs[rid] == reference(prompts[i], 2)
        return r.cached_tokens

    assert [ask(i, f"a{i}") for i in range(3)] == [0, 0, 0]
    assert ask(3, "b3") == 0  # needs room: the least recently used (prompt 0) goes
    assert ask(2, "c2") == 59  # still cached
    assert ask(0, "c0") == 0  # evicted earlier
    assert drained(core)


def test_without_the_cache_nothing_is_kept():
    core, worker = make_core(enable_radix_cache=False), FakeWorker()
    group = choices("g", 3, 40, 3, seed=1)
    for r in group:
        core.add_request(r)
    outputs, _, batches = run(core, worker)
    assert computed_prompt_tokens(batches, {r.rid for r in group}) == 120
    assert core.token_pool.num_free == core.token_pool.capacity and core.stats()["cache_hit_rate"] == 0


def test_flush_is_refused_while_requests_run():
    core, worker = make_core(), FakeWorker()
    core.add_request(req("a", 20, 5))
    batch, _ = core.next_batch()
    assert "1 requests running" in core.flush_cache()
    core.on_result(batch, worker.forward(batch.to_worker_batch()))
    run(core, worker)
    assert core.cache.total_size > 0 and drained(core) and core.cache.total_size == 0


def test_a_waiting_timeout_reaches_waiting_choices():
    core = make_core(waiting_timeout=5.0, max_running_requests=1)
    worker = FakeWorker()
    core.add_request(req("busy", 10, 40, seed=1))
    batch, _ = core.next_batch(now=0.0)
    core.on_result(batch, worker.forward(batch.to_worker_batch()))
    first, second = choices("g", 2, 10, 3, seed=8)
    first.arrival, second.arrival = 0.0, 4.0
    core.add_request(first)
    core.add_request(second)
    _, ended = core.next_batch(now=6.0)
    assert [o.req.rid for o in ended] == ["g.0"] and second in core.waiting
    _, ended = core.next_batch(now=10.0)
    assert [o.req.rid for o in ended] == ["g.1"]

def test_stream_interval_sends_the_first_tokens_at_once_then_chunks():
    """The scheduler process's delivery (`--stream-interval`, a request's own stream_interval):
    a running request's first tokens at once, then every `interval` tokens; the rest at its end
    (finished or aborted), every id once and in order, logprobs alongside."""
    from types import SimpleNamespace

    from scheduler_proc.process import SchedulerProcess

    proc = SchedulerProcess.__new__(SchedulerProcess)
    sent = []
    proc.detokenizer, proc.controller, proc.stream_interval = SimpleNamespace(send=sent.append), None, 3
    core, worker = make_core(), FakeWorker()
    core.add_request(req("a", 20, 10))
    core.add_request(req("b", 30, 9, seed=1, stream_interval=4))  # raises the server's 3
    core.add_request(req("c", 25, 50, seed=2, logprobs=True))
    for step in range(12):
        batch, _ = core.next_batch()
        outputs = core.on_result(batch, worker.forward(batch.to_worker_batch()),
                                 [("lp", step)] * sum(1 for r in batch.rows if r.samples))
        proc.emit(outputs)
    proc.emit(core.abort("c"))
    chunks: dict[str, list] = {}
    for message in sent:
        for d in message.items:
            chunks.setdefault(d.rid, []).append(d)
    sizes = {rid: [len(d.new_ids) for d in ds] for rid, ds in chunks.items()}
    assert sizes == {"a": [1, 3, 3, 3], "b": [1, 4, 4], "c": [1, 3, 3, 3, 2]}
    ids = {rid: [t for d in ds for t in d.new_ids] for rid, ds in chunks.items()}
    assert ids["a"] == reference(req("a", 20, 10).input_ids, 10)
    assert ids["b"] == reference(req("b", 30, 9, seed=1).input_ids, 9)
    assert [lp for d in chunks["c"] for lp in d.logprobs] == [("lp", s) for s in range(12)]
    assert [d.finish is not None for d in chunks["c"]] == [False] * 4 + [True]
    assert chunks["a"][-1].completion_tokens == 10 and chunks["a"][-1].finish.type == "length"
