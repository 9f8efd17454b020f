"""Pipeline parallelism (`--pp-size`, gloo point-to-point on CPU): how layers split into stages,
how the scheduler keeps disjoint micro-batches in flight, and greedy outputs of the full server
against the same model without stages, with the stages' busy intervals read from the step trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from inproc import build_tiny_checkpoint, parallel_outputs, with_tokenizer
from scheduler_proc.core import SchedulerConfig, SchedulerCore
from scheduler_proc.req import Req
from worker_proc.pipeline_parallel import stage_layers


def test_stages_split_the_layers_contiguously_the_first_ones_taking_the_remainder():
    assert [stage_layers(30, 2, r) for r in range(2)] == [range(0, 15), range(15, 30)]
    assert [stage_layers(30, 4, r) for r in range(4)] == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert [len(stage_layers(2, 2, r)) for r in range(2)] == [1, 1]
    with pytest.raises(ValueError, match="--pp-size 3: between 1 and the model's 2 layers"):
        stage_layers(2, 3, 0)


def _core(stages: int) -> SchedulerCore:
    return SchedulerCore(SchedulerConfig(max_total_tokens=4096, max_running_requests=16, max_prefill_tokens=4096,
                                         max_context_len=512, pipeline_stages=stages))


def _add(core: SchedulerCore, n: int) -> None:
    for i in range(n):
        core.add_request(Req(f"r{i}", list(range(10 + i)), _greedy(8)))


def _greedy(n: int):
    from ipc.messages import SamplingParams

    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def test_micro_batches_in_flight_hold_disjoint_requests_and_share_them_evenly():
    core = _core(2)
    _add(core, 6)
    first, _ = core.next_batch(0.0)
    second, _ = core.next_batch(0.0)
    rids = lambda b: {r.req.rid for r in b.rows}  # noqa: E731
    assert len(rids(first)) == 3 and len(rids(second)) == 3 and not rids(first) & rids(second)
    assert core.next_batch(0.0)[0] is None  # every request is in flight
    core.on_result(first, [1] * 3)
    third, _ = core.next_batch(0.0)  # the first micro-batch's requests decode while the second is in flight
    assert rids(third) == rids(first) and all(r.extend_len == 1 for r in third.rows)
    # without stages one step takes them all
    core = _core(1)
    _add(core, 6)
    assert len(core.next_batch(0.0)[0].rows) == 6


def _read_trace(path: Path) -> list[dict]:
    return json.loads(path.read_text().rstrip().rstrip(",") + "]")  # (written as it goes: no closing bracket)


def test_smollm2_in_two_stages_matches_one_and_both_stages_compute_at_once(chat_prompt_ids, default_model_dir,
                                                                         tmp_path):
    prompts = [list(p) for p in chat_prompt_ids]
    # (two alone: the batch, split into micro-batches, covers the rest; a stage's Python path is slow)
    ref_alone, ref_batched, ref_weights = parallel_outputs(default_model_dir, prompts, alone=2)
    alone, batched, weights = parallel_outputs(default_model_dir, prompts, alone=2, trace_dir=tmp_path, pp_size=2)
    assert alone == ref_alone
    assert batched == ref_batched
    shares = {name: round(b / ref_weights["worker"], 3) for name, b in weights.items()}
    print(f"SmolLM2 resident weight bytes at --pp-size 2 (share of the whole model's): {shares}")
    # each stage holds its 15 layers; the tied embedding sits on both ends (first: lookup, last: LM head)
    assert set(shares) == {"worker_pp0", "worker_pp1"} and all(0.5 < s < 0.8 for s in shares.values())
    # the step trace: while stage 1 computes one micro-batch, stage 0 computes the next
    stage0, stage1 = (_read_trace(tmp_path / f"worker_pp{p}.trace.json") for p in range(2))
    assert [e["args"]["step"] for e in stage0] == [e["args"]["step"] for e in stage1]
    overlapping = [(a["args"]["step"], b["args"]["step"]) for a in stage0 for b in stage1
                   if a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]]
    print(f"{len(stage0)} steps; {len(overlapping)} pairs of steps computed at once by the two stages")
    assert any(s0 != s1 for s0, s1 in overlapping)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, default_model_dir):
    path = build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("pp-qwen3"), seed=5, num_attention_heads=8,
                                 num_key_value_heads=4)
    return with_tokenizer(path, default_model_dir)


def test_tiny_model_at_tp2_x_pp2_matches_one_worker(tiny_qwen3):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (3, 9, 17, 30, 5, 41, 12, 64)]
    ref_alone, ref_batched, _ = parallel_outputs(tiny_qwen3, prompts, alone=4)
    alone, batched, weights = parallel_outputs(tiny_qwen3, prompts, alone=4, tp_size=2, pp_size=2)
    assert alone == ref_alone
    assert sum(a == b for a, b in zip(batched, ref_batched)) >= 7
    assert set(weights) == {"worker_pp0_tp0", "worker_pp0_tp1", "worker_pp1_tp0", "worker_pp1_tp1"}


def test_a_pp_size_beyond_the_layers_is_refused_at_start():
    from launch import Engine

    with pytest.raises(ValueError, match="--pp-size 31: the model has only 30 layers"):
        Engine(pp_size=31)


def test_killing_one_stage_brings_the_server_down_naming_it():
    from test_faults import kill_and_expect_shutdown

    kill_and_expect_shutdown(("--pp-size", "2"), "worker_pp1")
