"""The scheduling core driven directly, with a fake worker that checks its bookkeeping: the fake
keeps its own KV (slot -> token) and req_to_token mirror from the wire batches, and its "model"
returns a token that depends on every token the request's slots hold, so a wrong slot, a lost
token or a stale mirror changes the output."""

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
        out, start = [], 0
        for row, (r, p, e) in enumerate(zip(b.req_pool_indices, b.prefix_lens, b.extend_lens)):
            table = self.req_to_token.setdefault(r, {})
            for j in range(e):
                table[p + j] = int(loc[start + j])
                self.kv[int(loc[start + j])] = int(ids[start + j])
            start += e
            if row in b.sample_rows:
                tokens = [self.kv[table[i]] for i in range(p + e)]
                out.append(next_token(tokens))
        return out


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
