"""The scheduling core driven directly, with a fake worker that checks its bookkeeping: the fake
keeps its own KV (slot -> token) and req_to_token mirror from the wire batches (forks included),
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
        row_tokens, start = [], 0
        for r, p, e in zip(b.req_pool_indices, b.prefix_lens, b.extend_lens):
            table = self.req_to_token.setdefault(r, {})
            for j in range(e):
                table[p + j] = int(loc[start + j])
                self.kv[int(loc[start + j])] = int(ids[start + j])
            start += e
            row_tokens.append([self.kv[table[i]] for i in range(p + e)])
        for src, dst, n in b.forks:  # after the step's KV writes, as the real worker
            assert src in b.req_pool_indices, "a fork's source computes its prompt in this step"
            assert dst not in b.req_pool_indices, "a forked request computes nothing in its fork step"
            self.req_to_token[dst] = {i: self.req_to_token[src][i] for i in range(n)}
        # one token per sample entry; forked entries repeat their leader's row
        return [next_token(row_tokens[row]) for row in b.sample_rows]


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
    assert core.token_pool.num_free == 300


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
    assert core.token_pool.num_free == core.token_pool.capacity
    assert core.req_pool.num_free == core.req_pool.capacity
    core.add_request(req("x", 10, 3))
    core.abort("")
    assert not core.idle_leaks()


# ---- shared prefills (the n choices of one prompt) ------------------------------------------

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


def test_n_choices_share_one_prefill_and_free_shared_slots_last():
    core, worker = make_core(), FakeWorker()
    group = choices("g", 3, 40, [3, 6, 9], seed=1)
    for r in group:
        assert core.add_request(r) is None
    assert core.stats()["num_waiting"] == 3 and len(core.waiting) == 1  # two parked on the leader
    batch, _ = core.next_batch()
    leader, *followers = group
    assert [(row.req.rid, row.prefix_len, row.extend_len, row.logits_of) for row in batch.rows] == \
        [("g.0", 0, 40, None), ("g.1", 40, 0, 0), ("g.2", 40, 0, 0)]
    wire = batch.to_worker_batch()
    assert wire.extend_lens == [40] and wire.sample_rows == [0, 0, 0]
    assert wire.forks == [(leader.req_pool_idx, f.req_pool_idx, 40) for f in followers]
    for f in followers:
        assert np.array_equal(f.kv_slots, leader.kv_slots) and f.cached_tokens == 40
    assert core.token_pool.refcounts(leader.kv_slots).tolist() == [3] * 40
    assert core.token_pool.num_free == core.token_pool.capacity - 40
    core.on_result(batch, worker.forward(wire))
    prompt_slots = leader.kv_slots.copy()
    outputs, finishes, batches = run(core, worker)
    for r in group:
        assert [*r.output_ids] == reference(r.input_ids, r.sampling.max_new_tokens)
        assert finishes[r.rid].type == "length"
    assert core.token_pool.num_free == core.token_pool.capacity  # freed once the last choice ended
    assert computed_prompt_tokens([batch, *batches], {r.rid for r in group}) == 40
    stats = core.stats()
    assert stats["num_prompt_tokens"] == 120 and stats["num_cached_prompt_tokens"] == 80
    assert stats["cache_hit_rate"] == pytest.approx(2 / 3)
    assert leader.cached_tokens == 0
    assert core.token_pool.refcounts(prompt_slots).tolist() == [0] * 40


def test_shared_slots_stay_held_until_the_last_choice_finishes():
    core, worker = make_core(), FakeWorker()
    group = choices("g", 3, 30, [2, 5, 8], seed=2)
    for r in group:
        core.add_request(r)
    batch, _ = core.next_batch()
    core.on_result(batch, worker.forward(batch.to_worker_batch()))
    prompt_slots = group[0].kv_slots.copy()
    holders = [int(core.token_pool.refcounts(prompt_slots)[0])]  # after each step
    while core.running:
        batch, _ = core.next_batch()
        core.on_result(batch, worker.forward(batch.to_worker_batch()))
        holders.append(int(core.token_pool.refcounts(prompt_slots)[0]))
    assert holders == [3, 2, 2, 2, 1, 1, 1, 0]  # the choices end after 2, 5 and 8 tokens
    assert not core.idle_leaks()


def test_followers_arriving_during_a_chunked_prefill_still_fork():
    core, worker = make_core(max_prefill_tokens=64, chunked_prefill_size=64), FakeWorker()
    group = choices("g", 3, 300, 5, seed=3)
    core.add_request(group[0])
    batch, _ = core.next_batch()  # the leader's first chunk
    core.on_result(batch, worker.forward(batch.to_worker_batch()))
    core.add_request(group[1])
    batch, _ = core.next_batch()
    core.on_result(batch, worker.forward(batch.to_worker_batch()))
    core.add_request(group[2])
    outputs, _, batches = run(core, worker)
    for r in group:
        assert outputs[r.rid] == reference(r.input_ids, 5)
    assert [r.cached_tokens for r in group] == [0, 300, 300]
    assert sum(row.extend_len for b in batches for row in b.rows if row.extend_len > 1) == 300 - 128


@pytest.mark.parametrize("when", ["waiting", "chunking"])
def test_followers_complete_when_their_leader_is_aborted_before_the_fork(when):
    core, worker = make_core(max_prefill_tokens=64, chunked_prefill_size=64), FakeWorker()
    group = choices("g", 4, 200, 6, seed=4)
    for r in group:
        core.add_request(r)
    if when == "chunking":
        batch, _ = core.next_batch()
        core.on_result(batch, worker.forward(batch.to_worker_batch()))
    ended = core.abort("g.0")
    assert [o.req.rid for o in ended] == ["g.0"]
    assert core.stats()["num_waiting"] == 3 and core.group_leaders["g"] is group[1]
    outputs, finishes, batches = run(core, worker)
    for r in group[1:]:
        assert outputs[r.rid] == reference(r.input_ids, 6) and finishes[r.rid].type == "length"
    assert [r.cached_tokens for r in group[1:]] == [0, 200, 200]
    assert computed_prompt_tokens(batches, {r.rid for r in group[1:]}) == 200


def test_a_parked_follower_can_be_aborted_alone_or_with_everything():
    core, worker = make_core(), FakeWorker()
    group = choices("g", 3, 20, 4, seed=5)
    for r in group:
        core.add_request(r)
    ended = core.abort("g.2")
    assert [o.req.rid for o in ended] == ["g.2"] and ended[0].finished and ended[0].req.finish.type == "abort"
    assert group[0].followers == [group[1]] and core.stats()["num_waiting"] == 2
    outputs, finishes, _ = run(core, worker)
    assert set(finishes) == {"g.0", "g.1"} and outputs["g.1"] == reference(group[1].input_ids, 4)

    for r in choices("h", 3, 20, 4, seed=6):
        core.add_request(r)
    assert sorted(o.req.rid for o in core.abort("")) == ["h.0", "h.1", "h.2"]
    assert core.stats()["num_waiting"] == 0 and not core.group_leaders and not core.idle_leaks()


def test_followers_without_a_request_slot_queue_behind_a_new_leader():
    core, worker = make_core(max_running_requests=2), FakeWorker()
    group = choices("g", 5, 30, 4, seed=7)
    for r in group:
        core.add_request(r)
    outputs, _, batches = run(core, worker)
    for r in group:
        assert outputs[r.rid] == reference(r.input_ids, 4)
    # slots for two at a time: three prefills (g.0, g.2, g.4), each shared by the next choice
    assert computed_prompt_tokens(batches, {r.rid for r in group}) == 90
    assert core.stats()["num_cached_prompt_tokens"] == 60


def test_retraction_with_forked_choices_keeps_greedy_outputs_and_frees_everything():
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
    assert core.token_pool.num_free == 300 and not core.idle_leaks()


def test_a_waiting_timeout_reaches_parked_followers_and_hands_the_group_over():
    core = make_core(waiting_timeout=5.0, max_running_requests=1)
    worker = FakeWorker()
    core.add_request(req("busy", 10, 40, seed=1))
    batch, _ = core.next_batch(now=0.0)
    core.on_result(batch, worker.forward(batch.to_worker_batch()))
    leader, follower = choices("g", 2, 10, 3, seed=8)
    leader.arrival, follower.arrival = 0.0, 4.0
    core.add_request(leader)
    core.add_request(follower)
    _, ended = core.next_batch(now=6.0)
    assert [o.req.rid for o in ended] == ["g.0"]
    assert core.group_leaders["g"] is follower and follower in core.waiting
    _, ended = core.next_batch(now=10.0)
    assert [o.req.rid for o in ended] == ["g.1"] and not core.group_leaders
