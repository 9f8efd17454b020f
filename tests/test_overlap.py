"""Overlap scheduling: the core planned one step ahead of its results (placeholders resolved in
the worker's future map) against the normal order, first without processes (a fake worker with
its own future map, random workloads), then through every process with SmolLM2."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipc.messages import SamplingParams, future_capacity
from scheduler_proc.req import Req
from test_core import EOS, FakeWorker, make_core, next_token


class FutureWorker(FakeWorker):
    """The fake worker with a future map: input references -k - 1 read entry k, and every
    step's sampled tokens are stored in their entries. Its model ends a request (EOS) where the
    next token would be a multiple of `eos_every`, so requests finish at lengths the scheduler
    cannot foresee."""

    def __init__(self, max_running: int, eos_every: int = 0):
        super().__init__()
        self.futures = np.zeros(future_capacity(max_running), dtype=np.int32)
        self.eos_every = eos_every
        self.references_seen = 0

    def forward(self, b):
        ids = np.frombuffer(b.input_ids, np.int32).copy()
        refs = ids < 0
        self.references_seen += int(refs.sum())
        ids[refs] = self.futures[-ids[refs] - 1]
        tokens = super().forward(msgspec.structs.replace(b, input_ids=ids.tobytes()))
        if self.eos_every:
            tokens = [EOS if t % self.eos_every == 0 else t for t in tokens]
        self.futures[b.future_slots] = tokens
        return tokens


def drive(core, worker, overlap: bool, on_step=None, max_steps: int = 20_000):
    """Runs the core as the scheduler's event loops do (scheduler_proc/event_loop.py): overlap
    launches step N+1 before applying step N's result. Returns outputs, finishes, overlapped steps."""
    outputs, finishes, results = {}, {}, {}
    overlapped = 0

    def record(outs):
        for o in outs:
            outputs.setdefault(o.req.rid, []).extend(o.new_ids)
            if o.finished:
                assert o.req.rid not in finishes, "a request ended twice"
                finishes[o.req.rid] = o.req.finish

    def apply(batch):
        record(core.on_result(batch, results.pop(batch.step)))

    in_flight = None
    for step in range(max_steps):
        if on_step:
            record(on_step(step, core))
        if in_flight is not None and (not overlap or core.overlap_blocker(in_flight)):
            apply(in_flight)
            in_flight = None
        batch, ended = core.next_batch()
        record(ended)
        if batch is not None:
            results[batch.step] = worker.forward(batch.to_worker_batch())  # the worker runs steps in order
            overlapped += in_flight is not None
        if in_flight is not None:
            apply(in_flight)
        in_flight = batch
        if in_flight is None and not core.waiting and not core.running:
            break
    assert not core.idle_leaks(), core.idle_leaks()
    assert core.token_pool.num_free == core.token_pool.capacity
    return outputs, finishes, overlapped


def workload(seed: int, n: int = 12, **sp) -> list[Req]:
    rng = np.random.default_rng(seed)
    return [Req(f"r{i}", rng.integers(3, 900, int(rng.integers(1, 90))).tolist(),
                SamplingParams(max_new_tokens=int(rng.integers(1, 40)), **sp), arrival=float(i)) for i in range(n)]


def both(cfg: dict, reqs_of, eos_every: int = 0, on_step=None):
    runs = {}
    for overlap in (False, True):
        core = make_core(**cfg)
        worker = FutureWorker(cfg.get("max_running_requests", 16), eos_every)
        for r in reqs_of():
            core.add_request(r)
        runs[overlap] = (*drive(core, worker, overlap, on_step), worker, core)
    return runs


def test_outputs_and_finishes_equal_the_normal_order_and_steps_really_overlap():
    runs = both({}, lambda: workload(0), eos_every=13)
    (out_n, fin_n, _, worker_n, _), (out_o, fin_o, overlapped, worker_o, core) = runs[False], runs[True]
    assert out_o == out_n and fin_o == fin_n
    assert {f.type for f in fin_o.values()} == {"stop", "length"}  # EOS found one step late, and lengths
    assert worker_n.references_seen == 0  # the normal order never sends a reference
    assert worker_o.references_seen > 0 and overlapped > 0
    for rid, ids in out_o.items():  # no token past a stop
        assert EOS not in ids[:-1] and len(ids) <= 40


def test_a_length_limit_is_not_planned_past():
    """A request whose token in flight is its last gets no further decode step."""
    core = make_core()
    worker = FutureWorker(16)
    core.add_request(Req("a", [5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True)))
    outputs, finishes, _ = drive(core, worker, overlap=True)
    assert len(outputs["a"]) == 3 and finishes["a"].type == "length"
    assert core.step == 3  # prompt step + 2 decodes: none wasted


config = st.fixed_dictionaries({
    "max_total_tokens": st.integers(200, 800),
    "max_running_requests": st.integers(1, 8),
    "max_prefill_tokens": st.integers(8, 200),
    "chunked_prefill_size": st.one_of(st.none(), st.integers(4, 64)),
    "enable_mixed_chunk": st.booleans(),
    "decode_first": st.booleans(),
    "init_new_token_ratio": st.sampled_from([0.0, 0.7]),
    "min_new_token_ratio": st.just(0.0),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config, seed=st.integers(0, 10_000), eos_every=st.sampled_from([0, 7, 29]),
       stop_at=st.sampled_from([None, 101, 404]), groups=st.booleans())
def test_random_workloads_give_the_same_outputs_in_both_orders(cfg, seed, eos_every, stop_at, groups):
    """Retractions (small pools), chunked prompts, mixed and unmixed steps, stop tokens, EOS one
    step late, shared prefills: the overlap order gives the normal order's tokens and finishes."""
    def reqs():
        out = workload(seed, stop_token_ids=[stop_at] if stop_at else [])
        if groups:  # the n choices of one prompt share its prefill
            out += [Req(f"g{k}", list(out[0].input_ids), out[0].sampling, arrival=99.0, prefill_group="g")
                    for k in range(3)]
        return out

    runs = both(cfg, reqs, eos_every)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == runs[False][1]


def test_an_abort_while_steps_are_in_flight_frees_everything():
    victims = {3: "r1", 7: "r4", 11: "r8"}  # (step of the loop, request)

    def on_step(step, core):
        return core.abort(victims[step]) if step in victims else []

    def reqs():
        return [Req(f"r{i}", list(range(10 + i, 30 + 2 * i)), SamplingParams(max_new_tokens=30, ignore_eos=True),
                    arrival=float(i)) for i in range(10)]

    runs = both({}, reqs, on_step=on_step)
    (out_n, fin_n, *_), (out_o, fin_o, *_) = runs[False], runs[True]
    assert sum(f.type == "abort" for f in fin_o.values()) == 3
    for rid in out_n:
        if "abort" in (fin_n[rid].type, fin_o[rid].type):  # cut at different points: one a prefix of the other
            short, long = sorted((out_n[rid], out_o[rid]), key=len)
            assert long[: len(short)] == short
        else:
            assert out_o[rid] == out_n[rid] and fin_o[rid] == fin_n[rid]


@pytest.mark.parametrize("max_new", [1, 2])
def test_one_and_two_token_outputs(max_new):
    runs = both({}, lambda: [Req("x", [9, 8, 7], SamplingParams(max_new_tokens=max_new, ignore_eos=True))])
    assert runs[True][0] == runs[False][0] and len(runs[True][0]["x"]) == max_new


def test_tokens_are_the_model_s_whatever_the_order():
    core = make_core()
    worker = FutureWorker(16)
    prompt = [11, 12, 13]
    core.add_request(Req("x", prompt, SamplingParams(max_new_tokens=6, ignore_eos=True)))
    outputs, *_ = drive(core, worker, overlap=True)
    tokens = list(prompt)
    for _ in range(6):
        tokens.append(next_token(tokens))
    assert outputs["x"] == tokens[3:]
