"""Property test: random arrivals, lengths, aborts and scheduler settings never leak a slot,
never exceed capacity, and end every request exactly once. Some requests come as groups that
share one prefill (the n choices of a prompt), some join a group late."""

from __future__ import annotations

import numpy as np

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipc.messages import SamplingParams
from scheduler_proc.req import Req
from test_core import FakeWorker, make_core, reference

event = st.one_of(
    # (add, prompt length, max_new_tokens, priority, copies: > 1 is a group sharing one prefill)
    st.tuples(st.just("add"), st.integers(1, 120), st.integers(1, 40), st.integers(0, 3),
              st.sampled_from([1, 1, 2, 3])),
    st.tuples(st.just("join"), st.integers(0, 60), st.integers(1, 40)),  # one more in r{k}'s group
    st.tuples(st.just("abort"), st.integers(0, 60)),
    st.tuples(st.just("abort_all")),
    st.tuples(st.just("step"), st.integers(1, 4)),
)

config = st.fixed_dictionaries({
    "max_total_tokens": st.integers(130, 600),
    "max_running_requests": st.integers(1, 8),
    "max_prefill_tokens": st.integers(8, 200),
    "chunked_prefill_size": st.one_of(st.none(), st.integers(4, 128)),
    "enable_mixed_chunk": st.booleans(),
    "decode_first": st.booleans(),
    "prefill_admission_policy": st.sampled_from(["fifo", "pack"]),
    "force_fifo_every": st.integers(0, 4),
    "schedule_policy": st.sampled_from(["fcfs", "lof", "random", "routing-key"]),
    "enable_priority_scheduling": st.booleans(),
    "init_new_token_ratio": st.sampled_from([0.0, 0.3, 0.7]),
    "min_new_token_ratio": st.just(0.0),
})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config, events=st.lists(event, max_size=40))
def test_random_workloads_never_leak_and_end_every_request_once(cfg, events):
    core, worker = make_core(max_context_len=256, **cfg), FakeWorker()
    capacity = core.token_pool.capacity
    ended: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    prompts: dict[str, list[int]] = {}
    groups: dict[str, str] = {}  # rid -> its prefill group
    added = 0

    def record(outs):
        for o in outs:
            outputs.setdefault(o.req.rid, []).extend(o.new_ids)
            if o.finished:
                ended[o.req.rid] = ended.get(o.req.rid, 0) + 1

    def one_step():
        batch, outs = core.next_batch(now=float(core.step))
        record(outs)
        if batch is not None:
            assert batch.num_tokens <= capacity
            record(core.on_result(batch, worker.forward(batch.to_worker_batch())))
        used = capacity - core.token_pool.num_free
        cached = core.cache.all_slots().tolist()
        assert len(cached) == len(set(cached)) == core.cache.total_size
        held = set(cached) | {int(s) for r in core.running for s in r.kv_slots}
        reserved = [int(s) for r in core.running for s in r.kv_reserve]  # slots of their next decodes
        assert not held & set(reserved) and len(reserved) == len(set(reserved))
        held |= set(reserved)
        assert used == len(held), "slots in use must be exactly those the cache and running requests hold"
        if held:
            assert set(core.token_pool.refcounts(np.fromiter(held, dtype=np.int32)).tolist()) == {1}
        for r in core.running:  # a running request's cached slots are locked
            locked = r.kv_slots[: r.cached_tokens] if r.retractions == 0 else []
            assert set(int(s) for s in locked) <= set(cached)
        core.cache.check()
        assert len(core.running) <= core.req_pool.capacity

    def add(prompt: list[int], max_new: int, prio: int, group: str | None) -> None:
        nonlocal added
        rid = f"r{added}"
        prompts[rid] = prompt
        if group is not None:
            groups[rid] = group
        r = Req(rid, prompt, SamplingParams(max_new_tokens=max_new), arrival=float(added),
                priority=prio, routing_key=f"k{prio}" if prio else None, prefill_group=group)
        added += 1
        out = core.add_request(r)
        if out is not None:
            record([out])

    for ev in events:
        if ev[0] == "add":
            _, length, max_new, prio, copies = ev
            prompt = [(added * 7 + i) % 900 + 3 for i in range(length)]
            group = f"g{added}" if copies > 1 else None
            for _ in range(copies):
                add(list(prompt), max_new, prio, group)
        elif ev[0] == "join":
            rid = f"r{ev[1]}"
            if rid in groups:
                add(list(prompts[rid]), ev[2], 0, groups[rid])
        elif ev[0] == "abort":
            record(core.abort(f"r{ev[1]}"))
        elif ev[0] == "abort_all":
            record(core.abort(""))
        else:
            for _ in range(ev[1]):
                one_step()
    for _ in range(5000):
        if not core.waiting and not core.running:
            break
        one_step()
    assert not core.waiting and not core.running, "the workload must drain"
    assert not core.idle_leaks() and core.stats()["num_waiting"] == 0
    assert set(ended) == set(prompts) and all(n == 1 for n in ended.values()), ended
    for rid, out in outputs.items():
        # every request's tokens are the reference continuation, however it was scheduled
        assert out == reference(prompts[rid], len(out)), rid
