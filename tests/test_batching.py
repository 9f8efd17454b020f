"""Batching strategies (scheduler_proc/batching.py): each one's defining behaviour on the scheduling
core with the checking fake worker, correct outputs and no leak under every strategy."""

from __future__ import annotations

import pytest

from scheduler_proc.batching import BATCHING_STRATEGIES, peak_kv_need
from test_core import FakeWorker, make_core, reference, req, run

STRATEGIES = BATCHING_STRATEGIES.names()


def test_every_strategy_is_registered():
    assert set(STRATEGIES) == {"loom", "sarathi", "vllm", "orca", "lightllm", "static"}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("pool", [4096, 400])
def test_outputs_are_correct_and_nothing_leaks(strategy, pool):
    """A small pool forces preemption (or, for the reserving strategies, waiting)."""
    core, worker = make_core(batching_strategy=strategy, max_total_tokens=pool, chunked_prefill_size=64,
                             max_prefill_tokens=128), FakeWorker()
    reqs = [req(f"r{i}", 20 + 13 * i, 8 + 3 * i, seed=i) for i in range(10)]
    for r in reqs:
        core.add_request(r)
    outputs, finishes, _ = run(core, worker)
    for r in reqs:
        assert outputs[r.rid] == reference(r.input_ids, r.sampling.max_new_tokens), r.rid
        assert finishes[r.rid].type == "length"


def test_static_never_admits_into_a_running_batch():
    core, worker = make_core(batching_strategy="static", max_running_requests=3), FakeWorker()
    for i in range(7):
        core.add_request(req(f"r{i}", 10, 4 + 5 * i, seed=i))
    _, _, batches = run(core, worker)
    members, seen = set(), set()
    for b in batches:
        rids = {row.req.rid for row in b.rows}
        new = rids - seen
        if new:  # a batch forms only when the last one has ended, and alone
            assert not members & {r.req.rid for r in b.rows if r.req.rid not in new}
            assert all(row.prefix_len == 0 for row in b.rows), "a prompt step with a decode in it"
            members = set(new)
            seen |= new
        else:
            assert rids <= members
    # batches of 3 in arrival order: r0-r2, r3-r5, r6
    first_step = {rid: next(i for i, b in enumerate(batches) if rid in {r.req.rid for r in b.rows})
                  for rid in seen}
    assert first_step["r0"] == first_step["r2"] < first_step["r3"] == first_step["r5"] < first_step["r6"]
    assert first_step["r3"] > max(i for i, b in enumerate(batches) if "r2" in {r.req.rid for r in b.rows})


def test_vllm_preempts_the_most_recent_request():
    core, worker = make_core(batching_strategy="vllm", max_total_tokens=200, watermark=0.0), FakeWorker()
    for i in range(4):
        core.add_request(req(f"r{i}", 30, 40, seed=i))  # arrivals 0, 1, 2, 3
    victims = []
    orig = core._retract

    def spy(r):
        victims.append((r.arrival, max(x.arrival for x in core.running)))
        orig(r)

    core._retract = spy
    outputs, _, batches = run(core, worker)
    assert victims, "the pool was meant to run short"
    for arrival, latest in victims:
        assert arrival == latest, victims
    for b in batches:  # whole prompts first: a step is prompts only or decodes only
        kinds = {row.extend_len > 1 or row.prefix_len == 0 for row in b.rows}
        assert len(kinds) == 1


def test_vllm_keeps_the_watermark_free_when_admitting():
    core = make_core(batching_strategy="vllm", max_total_tokens=1000, watermark=0.5)
    core.add_request(req("a", 400, 5, seed=1))
    core.add_request(req("b", 200, 5, seed=2))
    batch, _ = core.next_batch()
    assert [r.req.rid for r in batch.rows] == ["a"]  # b would leave 400 < 500 free


def test_orca_reserves_the_whole_max_new_tokens():
    core = make_core(batching_strategy="orca", max_total_tokens=120)
    core.add_request(req("a", 10, 60, seed=1))
    core.add_request(req("b", 10, 45, seed=2))  # 10 + 60 + 10 + 45 = 125 > 120
    batch, _ = core.next_batch()
    assert [r.req.rid for r in batch.rows] == ["a"]
    loom = make_core(max_total_tokens=120)  # the default reserves an estimate and admits both
    loom.add_request(req("a", 10, 60, seed=1))
    loom.add_request(req("b", 10, 45, seed=2))
    batch, _ = loom.next_batch()
    assert [r.req.rid for r in batch.rows] == ["a", "b"]
    core = make_core(batching_strategy="orca", max_total_tokens=120)
    for i in range(6):
        core.add_request(req(f"r{i}", 10, 30 + 5 * i, seed=i))
    run(core, FakeWorker())
    assert core.num_retractions == 0  # what it reserved, it had


def test_peak_kv_need():
    assert peak_kv_need([]) == 0
    assert peak_kv_need([(10, 5)]) == 15
    # sorted by remainder: (5, 8), (10, 5), (20, 1): 5+8=13, 15+10=25, 35+3=38
    assert peak_kv_need([(10, 5), (20, 1), (5, 8)]) == 38


def test_lightllm_rejects_a_request_that_would_overflow_at_its_peak():
    core = make_core(batching_strategy="lightllm", max_total_tokens=100, max_waiting_iters=1)
    # (held, to come) sorted by what is to come; the need when the k-th ends: held of the k
    # longest + k x its remainder
    core.add_request(req("a", 20, 40, seed=1))  # 20 + 40 = 60
    core.add_request(req("b", 10, 20, seed=2))  # 60, 30 + 2 x 20 = 70
    core.add_request(req("c", 10, 20, seed=3))  # 60, 70, 40 + 3 x 20 = 100: fits 100
    core.add_request(req("d", 5, 10, seed=4))  # 60, 70, 100, 45 + 4 x 10 = 85: fits
    batch, _ = core.next_batch()
    assert [r.req.rid for r in batch.rows] == ["a", "b", "c", "d"]
    core2 = make_core(batching_strategy="lightllm", max_total_tokens=99)
    for r in (req("a", 20, 40, seed=1), req("b", 10, 20, seed=2), req("c", 10, 20, seed=3)):
        core2.add_request(r)
    batch, _ = core2.next_batch()
    assert [r.req.rid for r in batch.rows] == ["a", "b"]  # c's peak (100) overflows 99 slots
    loom = make_core(max_total_tokens=99)
    for r in (req("a", 20, 40, seed=1), req("b", 10, 20, seed=2), req("c", 10, 20, seed=3)):
        loom.add_request(r)
    batch, _ = loom.next_batch()
    assert len(batch.rows) == 3


def test_lightllm_runs_prompt_steps_apart_every_max_waiting_iters():
    core, worker = make_core(batching_strategy="lightllm", max_waiting_iters=4), FakeWorker()
    core.add_request(req("a", 10, 30, seed=0))
    late = [req(f"late{i}", 10, 5, seed=i + 1) for i in range(3)]

    def on_step(step, core):
        if step in (1, 2, 3):
            core.add_request(late[step - 1])

    _, _, batches = run(core, worker, on_step=on_step)
    prompt_steps = [i for i, b in enumerate(batches) if any(r.prefix_len == 0 for r in b.rows)]
    for i in prompt_steps:
        assert all(r.prefix_len == 0 for r in batches[i].rows), "prompt and decode steps apart"
    assert prompt_steps[:2] == [0, 5], prompt_steps  # step 0, then after 4 decode steps (1-4)


def test_sarathi_fills_a_token_budget_decodes_first():
    core, worker = make_core(batching_strategy="sarathi", max_prefill_tokens=64, chunked_prefill_size=1024), FakeWorker()
    for i in range(3):
        core.add_request(req(f"d{i}", 8, 40, seed=i))
    core.add_request(req("long", 300, 3, seed=7))
    outputs, _, batches = run(core, worker)
    assert all(b.num_tokens <= 64 for b in batches)
    chunks = [r.extend_len for b in batches for r in b.rows if r.req.rid == "long" and r.extend_len > 1]
    assert len(chunks) >= 5 and max(chunks) <= 64 - 3  # the budget less the three decodes
    for b in batches:  # decodes come first in the step
        kinds = [r.extend_len == 1 and r.prefix_len > 0 for r in b.rows]
        assert kinds == sorted(kinds, reverse=True)


def test_every_strategy_serves_end_to_end_with_the_default_s_greedy_outputs(tmp_path, default_model_dir):
    """Each strategy in the real engine (every process) on a tiny float32 model: prompts longer
    than the step budget, more requests than run at once; greedy outputs equal loom's."""
    import torch

    from inproc import build_tiny_checkpoint, with_tokenizer
    from launch import Engine

    path = with_tokenizer(build_tiny_checkpoint("llama", tmp_path / "llama", seed=5), default_model_dir)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 70, 12, 33, 90, 8, 41, 19)]
    sp = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
    outs = {}
    for strategy in ["loom", *(s for s in STRATEGIES if s != "loom")]:
        with Engine(model_path=str(path), dtype="float32", kv_cache_gb=0.05, max_running_requests=4,
                    max_prefill_tokens=64, chunked_prefill_size=64, batching_strategy=strategy,
                    log_level="warning") as e:
            outs[strategy] = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sp)]
            stats = e.get_stats()
            assert stats["num_running"] == 0 and stats["req_slots_free"] == stats["req_slots_total"]
        assert all(len(o) == 20 for o in outs[strategy])
        assert outs[strategy] == outs["loom"], strategy
