"""Data parallelism (`--dp-size 2`): the DP controller process between the tokenizer and two
schedulers (each with its own workers and KV pool), through the Engine and a live server."""

from __future__ import annotations

import threading
import time

import pytest

from inproc import build_tiny_checkpoint, with_tokenizer

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(default_model_dir):
    from launch import Engine

    with Engine(dtype="float32", dp_size=2, load_balance_method="total_requests", kv_cache_gb=0.5,
                max_running_requests=64, log_level="warning") as e:
        yield e


def received(engine) -> list[int]:
    return [r["requests_received"] for r in engine.get_stats()["dp_ranks"]]


def test_total_requests_keeps_the_ranks_within_one_under_a_burst(engine):
    before = received(engine)
    outs = engine.generate([f"Count to {i}." for i in range(64)], GREEDY)
    assert len(outs) == 64 and all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    got = [after - b for after, b in zip(received(engine), before)]
    assert sum(got) == 64 and abs(got[0] - got[1]) <= 1, got


def test_routed_dp_rank_lands_where_asked(engine):
    before = received(engine)
    for _ in range(3):
        engine.generate("Pinned.", GREEDY, routed_dp_rank=1)
    after = received(engine)
    assert (after[0] - before[0], after[1] - before[1]) == (0, 3)
    from tokenizer_proc.manager import RequestError

    with pytest.raises(RequestError, match=r"routed_dp_rank must be an integer in 0..1"):
        engine.generate("Nowhere.", GREEDY, routed_dp_rank=2)


def test_an_abort_reaches_the_rank_that_runs_the_request(engine):
    results = {}

    def run(rank: int, rid: str) -> None:
        results[rid] = engine.generate("Tell me a long story.", {"max_new_tokens": 4000, "ignore_eos": True},
                                       rid=rid, routed_dp_rank=rank)

    threads = [threading.Thread(target=run, args=(rank, f"long-{rank}")) for rank in (0, 1)]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while [r["num_running"] for r in engine.get_stats()["dp_ranks"]] != [1, 1] and time.time() < deadline:
        time.sleep(0.05)
    engine.abort("long-1")
    threads[1].join(30)
    assert results["long-1"]["meta_info"]["finish_reason"]["type"] == "abort"
    ranks = engine.get_stats()["dp_ranks"]
    assert [r["num_running"] for r in ranks] == [1, 0]  # rank 0's request runs on
    engine.abort()  # all
    threads[0].join(30)
    assert results["long-0"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_stats_and_metrics_show_every_rank_and_every_slot_is_free_after_the_run(engine):
    deadline = time.time() + 30
    while engine.get_stats()["num_running"] and time.time() < deadline:
        time.sleep(0.05)
    stats = engine.get_stats()
    assert [r["dp_rank"] for r in stats["dp_ranks"]] == [0, 1]
    for r in stats["dp_ranks"]:
        assert r["num_running"] == 0 and r["num_waiting"] == 0, r
        assert r["kv_slots_total"] - r["kv_slots_free"] == r["kv_slots_evictable"] and r["kv_slots_locked"] == 0, r
        assert r["req_slots_free"] == r["req_slots_total"], r
    assert stats["kv_slots_total"] == sum(r["kv_slots_total"] for r in stats["dp_ranks"])
    assert engine.flush_cache() is None  # every rank's cache
    assert all(r["kv_slots_free"] == r["kv_slots_total"] for r in engine.get_stats()["dp_ranks"])
    metrics = engine.manager.metrics.render(stats).decode()
    assert 'loom_num_running_reqs{dp_rank="0"}' in metrics and 'loom_num_running_reqs{dp_rank="1"}' in metrics


def test_two_replicas_of_two_ranks_give_one_rank_s_outputs(tmp_path, default_model_dir):
    """--dp-size 2 x --tp-size 2 on a tiny model: greedy outputs equal --dp-size 1 --tp-size 1."""
    import torch

    from launch import Engine

    path = with_tokenizer(build_tiny_checkpoint("llama", tmp_path / "llama", seed=3), default_model_dir)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (4, 11, 25, 7, 18, 30)]
    sp = {**GREEDY, "max_new_tokens": 24}
    outs = {}
    for dp, tp in ((1, 1), (2, 2)):
        with Engine(model_path=str(path), dtype="float32", dp_size=dp, tp_size=tp, kv_cache_gb=0.2,
                    log_level="warning") as e:
            outs[dp, tp] = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sp)]
            if dp == 2:
                assert sorted(e.launcher.ready_info) == sorted(
                    ["detokenizer", "dp_controller", "worker_dp0_tp0", "worker_dp0_tp1", "worker_dp1_tp0",
                     "worker_dp1_tp1", "scheduler_dp0", "scheduler_dp1"])
    assert outs[2, 2] == outs[1, 1]


def test_killing_the_controller_brings_the_server_down_naming_it():
    from test_faults import kill_and_expect_shutdown

    kill_and_expect_shutdown(("--dp-size", "2"), "dp_controller")
