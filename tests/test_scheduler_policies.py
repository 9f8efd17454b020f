"""Scheduler knobs driven on the pure core with a fake clock and the bookkeeping-checking fake
worker: mixed chunks, decode-first, admission packing, force-fifo, queue orders, priority,
timeouts."""

from __future__ import annotations

from collections import deque

import pytest

from ipc.messages import SamplingParams
from scheduler_proc.policies import QUEUE_POLICIES
from scheduler_proc.req import Req
from test_core import FakeWorker, make_core, reference, req, run


def step(core, worker, now=None):
    batch, ended = core.next_batch(now)
    outs = core.on_result(batch, worker.forward(batch.to_worker_batch())) if batch else []
    return batch, ended + outs


def test_mixed_chunk_puts_decodes_and_a_chunk_in_one_batch():
    core, worker = make_core(max_prefill_tokens=256, chunked_prefill_size=256), FakeWorker()
    for i in range(3):
        core.add_request(req(f"d{i}", 10, 20, seed=i))
    step(core, worker)  # the three prompts
    core.add_request(req("long", 1000, 4, seed=7))
    batch, _ = step(core, worker)
    kinds = {(row.req.rid, row.extend_len) for row in batch.rows}
    assert {("d0", 1), ("d1", 1), ("d2", 1), ("long", 256)} == kinds


def test_unmixed_steps_are_either_prompts_or_decodes():
    core = make_core(max_prefill_tokens=256, chunked_prefill_size=256, enable_mixed_chunk=False)
    worker = FakeWorker()
    for i in range(3):
        core.add_request(req(f"d{i}", 10, 20, seed=i))
    step(core, worker)
    core.add_request(req("long", 1000, 4, seed=7))
    outputs, _, batches = run(core, worker)
    for b in batches:
        decode_rows = [r for r in b.rows if r.extend_len == 1 and r.prefix_len > 0]
        assert not decode_rows or len(decode_rows) == len(b.rows)
    assert outputs["long"] == reference(core_req_prompt(batches, "long"), 4)


def core_req_prompt(batches, rid):
    return next(row.req.input_ids for b in batches for row in b.rows if row.req.rid == rid)


def test_decode_first_unmixed_alternates_a_decode_step_before_each_prompt_step():
    core = make_core(max_prefill_tokens=64, chunked_prefill_size=64, enable_mixed_chunk=False, decode_first=True)
    worker = FakeWorker()
    core.add_request(req("a", 10, 30, seed=1))
    step(core, worker)
    core.add_request(req("long", 640, 2, seed=2))
    kinds = []
    for _ in range(8):
        batch, _ = step(core, worker)
        kinds.append("prompt" if any(r.req.rid == "long" for r in batch.rows) else "decode")
    assert kinds[:6] == ["decode", "prompt", "decode", "prompt", "decode", "prompt"]


def test_decode_first_mixed_counts_decodes_against_the_budget():
    core = make_core(max_prefill_tokens=100, chunked_prefill_size=100, decode_first=True)
    worker = FakeWorker()
    for i in range(10):
        core.add_request(req(f"d{i}", 5, 20, seed=i))
    step(core, worker)
    core.add_request(req("long", 500, 2, seed=3))
    batch, _ = step(core, worker)
    assert batch.num_tokens == 100 and batch.num_decode == 10


def test_no_chunking_admits_a_head_larger_than_the_budget_alone():
    core = make_core(max_prefill_tokens=64, chunked_prefill_size=None)
    worker = FakeWorker()
    core.add_request(req("big", 200, 2, seed=1))
    core.add_request(req("small", 10, 2, seed=2))
    batch, _ = step(core, worker)
    assert [(r.req.rid, r.extend_len) for r in batch.rows] == [("big", 200)]
    batch, _ = step(core, worker)
    assert ("small", 10) in [(r.req.rid, r.extend_len) for r in batch.rows]


def hol_core(**kw):
    return make_core(max_prefill_tokens=64, chunked_prefill_size=64, prefill_admission_policy="pack",
                     admission_lookahead=16, **kw)


def test_pack_admits_short_requests_behind_an_oversize_head():
    core, worker = hol_core(), FakeWorker()
    core.add_request(req("head", 500, 2, seed=1))
    for i in range(3):
        core.add_request(req(f"s{i}", 8, 2, seed=10 + i))
    batch, _ = step(core, worker)
    assert [r.req.rid for r in batch.rows] == ["s0", "s1", "s2"]  # queue order among the chosen
    fifo, worker2 = make_core(max_prefill_tokens=64, chunked_prefill_size=64), FakeWorker()
    fifo.add_request(req("head", 500, 2, seed=1))
    for i in range(3):
        fifo.add_request(req(f"s{i}", 8, 2, seed=10 + i))
    batch, _ = step(fifo, worker2)
    assert [(r.req.rid, r.extend_len) for r in batch.rows] == [("head", 64)]


def test_force_fifo_every_bounds_the_heads_wait():
    def first_head_step(force: int) -> int | None:
        core, worker = hol_core(force_fifo_every=force), FakeWorker()
        core.add_request(req("head", 500, 2, seed=1))
        for i in range(100):
            core.add_request(req(f"s{i}", 8, 2, seed=10 + i))
        for n in range(12):
            batch, _ = step(core, worker)
            if any(r.req.rid == "head" for r in batch.rows):
                return n
        return None

    assert first_head_step(0) is None  # packing alone keeps passing the head over
    # 8 shorts fill a step's 64-token budget: after those 8 admissions the head goes first
    assert first_head_step(8) == 1


def test_pack_outputs_stay_correct_and_leak_free():
    core, worker = hol_core(force_fifo_every=4), FakeWorker()
    reqs = [req("head", 300, 5, seed=1)] + [req(f"s{i}", 5 + i, 6, seed=20 + i) for i in range(20)]
    for r in reqs:
        core.add_request(r)
    outputs, finishes, _ = run(core, worker)
    for r in reqs:
        assert outputs[r.rid] == reference(r.input_ids, r.sampling.max_new_tokens)


def _queue(*specs):
    return deque(Req(rid, [1, 2, 3], SamplingParams(max_new_tokens=n), arrival=t, routing_key=key, priority=p)
                 for rid, n, t, key, p in specs)


@pytest.mark.parametrize("policy,expected", [
    ("fcfs", ["a", "b", "c", "d"]),
    ("lof", ["c", "a", "d", "b"]),  # most max_new_tokens first, arrival among equals
    ("routing-key", ["a", "c", "b", "d"]),  # key x (earliest group) together, then y, then the keyless
])
def test_queue_policies_order_as_documented(policy, expected):
    waiting = _queue(("d", 50, 3.0, None, 0), ("b", 10, 1.0, "y", 0), ("c", 90, 2.0, "x", 0), ("a", 50, 0.0, "x", 0))
    QUEUE_POLICIES.make(policy, 0).order(waiting, [])
    assert [r.rid for r in waiting] == expected


def test_routing_key_prefers_keys_already_running():
    waiting = _queue(("a", 5, 0.0, "x", 0), ("b", 5, 1.0, "y", 0), ("c", 5, 2.0, "x", 0))
    running = [Req("r", [1], SamplingParams(), routing_key="y")]
    QUEUE_POLICIES.make("routing-key", 0).order(waiting, running)
    assert [r.rid for r in waiting] == ["b", "a", "c"]


def test_random_policy_is_a_seeded_permutation():
    orders = []
    for _ in range(2):
        waiting = _queue(*[(str(i), 5, float(i), None, 0) for i in range(10)])
        QUEUE_POLICIES.make("random", 3).order(waiting, [])
        orders.append([r.rid for r in waiting])
    assert orders[0] == orders[1] and sorted(orders[0]) == sorted(str(i) for i in range(10))
    assert orders[0] != [str(i) for i in range(10)]


def test_priority_scheduling_higher_first_fcfs_within_a_level():
    core = make_core(max_running_requests=1, enable_priority_scheduling=True)
    worker = FakeWorker()
    for rid, p, t in [("low", 0, 0.0), ("high1", 5, 1.0), ("mid", 1, 2.0), ("high2", 5, 3.0)]:
        r = req(rid, 5, 1, seed=int(t))
        r.priority, r.arrival = p, t
        core.add_request(r)
    order = []
    while core.waiting or core.running:
        batch, _ = step(core, worker)
        order += [r.req.rid for r in batch.rows]
    assert order == ["high1", "high2", "mid", "low"]


def test_waiting_and_running_timeouts_fire():
    core = make_core(max_running_requests=1, waiting_timeout=5.0, running_timeout=10.0)
    worker = FakeWorker()
    core.add_request(req("runner", 5, 1000, seed=0, ignore_eos=True))
    core.add_request(req("waiter", 5, 3, seed=0))
    step(core, worker, now=0.0)
    _, out = step(core, worker, now=4.0)
    assert not any(o.finished for o in out)
    _, out = step(core, worker, now=6.0)
    ended = {o.req.rid: o.req.finish for o in out if o.finished}
    assert ended["waiter"].type == "abort" and "queue" in ended["waiter"].message
    _, out = step(core, worker, now=11.0)
    ended = {o.req.rid: o.req.finish for o in out if o.finished}
    assert ended["runner"].type == "abort" and "ran more than 10" in ended["runner"].message
    assert not core.idle_leaks()


# ---- cache-aware orders ------------------------------------------------------------------------

def _cached_core(policy: str):
    from test_core import FakeWorker, make_core
    from scheduler_proc.req import Req
    from ipc.messages import SamplingParams

    core, worker = make_core(schedule_policy=policy, max_running_requests=1), FakeWorker()
    prefixes = {name: [ord(c) + 10 * i for i in range(1, 41)] for c, name in zip("abc", ("a", "b", "c"))}
    for name, prefix in prefixes.items():  # cache every prefix
        core.add_request(Req(f"warm-{name}", prefix + [7], SamplingParams(max_new_tokens=1)))
        while core.waiting or core.running:
            batch, _ = core.next_batch()
            core.on_result(batch, worker.forward(batch.to_worker_batch()))
    return core, worker, prefixes, Req, SamplingParams


def test_lpm_puts_the_longest_cached_prefix_first():
    core, _, prefixes, Req, SamplingParams = _cached_core("lpm")
    sp = SamplingParams(max_new_tokens=1)
    reqs = [Req("none", [999] * 30, sp, arrival=0.0), Req("short", prefixes["a"][:10] + [1] * 20, sp, arrival=1.0),
            Req("long", prefixes["b"] + [2] * 5, sp, arrival=2.0)]
    for r in reqs:
        core.add_request(r)
    core.queue_policy.order(core.waiting, core.running, core._match)
    assert [r.rid for r in core.waiting] == ["long", "short", "none"]
    core.queue_policy.LPM_MAX_WAITING = 2  # past the limit: arrival order
    core.queue_policy.order(core.waiting, core.running, core._match)
    assert [r.rid for r in core.waiting] == ["none", "short", "long"]


def test_dfs_weight_runs_the_heaviest_prefix_group_first_and_keeps_groups_together():
    core, _, prefixes, Req, SamplingParams = _cached_core("dfs-weight")
    sp = SamplingParams(max_new_tokens=1)
    arrivals = [("a", 0), ("b", 1), ("a", 2), ("c", 3), ("b", 4), ("a", 5)]
    for i, (name, t) in enumerate(arrivals):
        core.add_request(Req(f"{name}{i}", prefixes[name] + [100 + i] * 3, sp, arrival=float(t)))
    core.queue_policy.order(core.waiting, core.running, core._match)
    assert [r.rid for r in core.waiting] == ["a0", "a2", "a5", "b1", "b4", "c3"]


def test_cache_aware_orders_fall_back_to_arrival_without_the_cache():
    from test_core import make_core
    from scheduler_proc.req import Req
    from ipc.messages import SamplingParams

    for policy in ("lpm", "dfs-weight"):
        core = make_core(schedule_policy=policy, enable_radix_cache=False)
        for i in (2, 0, 1):
            core.add_request(Req(f"r{i}", [5, 6, 7], SamplingParams(max_new_tokens=1), arrival=float(i)))
        core.queue_policy.order(core.waiting, core.running, None)
        assert [r.rid for r in core.waiting] == ["r0", "r1", "r2"]
