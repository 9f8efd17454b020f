"""Speculative decoding (scheduler_proc/speculative.py): the n-gram proposer, and whole runs with
drafts against the same runs without: a fake model whose outputs recur (so drafts hold) through
the core in the normal and the overlap order, KV pressure and aborts; then SmolLM2 in-process,
greedy and seeded sampling, whose outputs must not change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inproc import run_to_completion
from ipc.messages import SamplingParams
from scheduler_proc.core import SchedulerConfig, SchedulerCore
from scheduler_proc.req import Req
from scheduler_proc.speculative import NgramProposer, accepted
from test_core import EOS, drained, make_core
from test_overlap import FutureWorker, drive


@pytest.mark.parametrize("tokens,limit,drafts", [
    ([1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),
    ([1, 2, 3, 9, 1, 2, 3], 1, [9]),
    ([5, 2, 3, 7, 1, 2, 3, 8, 6, 2, 3], 4, [8, 6, 2, 3]),  # (the latest occurrence of [2, 3])
    ([4, 1, 2, 3, 7, 9, 2, 3, 5, 1, 2, 3], 2, [7, 9]),  # (the longest n-gram that recurs: [1, 2, 3])
    ([1, 2, 3, 4, 5], 4, []),
    ([1, 2, 1, 2], 4, [1, 2]),  # (up to the end)
    ([3, 3], 4, []),  # (too short for a 2-gram before it)
    ([1, 2, 3, 1, 2], 0, []),
])
def test_the_ngram_proposer_continues_the_latest_occurrence(tokens, limit, drafts):
    assert NgramProposer(4, 2, 3).propose(tokens, limit) == drafts


def test_drafts_hold_while_each_equals_the_sample_before_it():
    assert accepted([7, 8, 9], [7, 8, 9, 4]) == 3
    assert accepted([7, 8, 9], [7, 5, 9, 4]) == 1
    assert accepted([7, 8, 9], [6, 8, 9, 4]) == 0


class CyclingWorker(FutureWorker):
    """The fake model's next token is a function of the last two, so outputs fall into cycles
    that n-grams find; the second-to-last token is read from the KV the scheduler kept, so a draft
    slot handed back wrongly shows as a different output. EOS where the function lands on it."""

    @staticmethod
    def next_token(tokens: list[int]) -> int:
        if len(tokens) < 2:
            return 5
        return (3 * tokens[-2] + 5 * tokens[-1]) % 9 + 2  # (2 is EOS)


def _workload(n: int = 8, seed: int = 0) -> list[Req]:
    rng = np.random.default_rng(seed)
    return [Req(f"r{i}", rng.integers(3, 12, int(rng.integers(2, 20))).tolist(),  # (drafts from it may not hold)
                SamplingParams(max_new_tokens=int(rng.integers(1, 60)), ignore_eos=bool(i % 2)), arrival=float(i))
            for i in range(n)]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("cfg", [{}, {"max_total_tokens": 160, "max_running_requests": 4},
                                 {"speculative_num_draft_tokens": 7, "speculative_ngram_min": 1, "page_size": 4}])
def test_runs_with_drafts_equal_runs_without(overlap, cfg):
    runs = {}
    for spec in (None, "ngram"):
        core = make_core(speculative_algorithm=spec, speculative_max_batch_size=16, **cfg)
        for r in _workload():
            core.add_request(r)
        runs[spec] = (*drive(core, CyclingWorker(cfg.get("max_running_requests", 16)), overlap), core)
    (out, fin, _, plain), (out_s, fin_s, _, spec) = runs[None], runs["ngram"]
    assert out_s == out and fin_s == fin
    assert {f.type for f in fin.values()} == {"stop", "length"}
    assert spec.num_accepted_tokens > 0 and spec.num_draft_tokens > spec.num_accepted_tokens
    assert spec.step < plain.step
    assert drained(spec)


def test_an_abort_while_drafts_are_in_flight_frees_everything():
    core = make_core(speculative_algorithm="ngram")
    worker = CyclingWorker(16)
    core.add_request(Req("a", [3, 4, 3, 4, 3, 4], SamplingParams(max_new_tokens=50, ignore_eos=True)))
    batch, _ = core.next_batch()
    while not any(r.drafts for r in batch.rows):
        core.on_result(batch, worker.forward(batch.to_worker_batch()))
        batch, _ = core.next_batch()
    results = worker.forward(batch.to_worker_batch())  # (the worker runs it; the abort comes meanwhile)
    core.abort("a")
    assert core.on_result(batch, results) == []
    assert drained(core)


@pytest.fixture(scope="module")
def runner(default_model_dir):
    from worker_proc.model_runner import ModelRunner, RunnerConfig

    return ModelRunner(RunnerConfig(str(default_model_dir), torch.float32, kv_cache_gb=0.05, max_running_requests=4,
                                    eos_token_ids=(EOS,)))


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.95, seed=11),
                                      dict(temperature=0.0, logprobs=True, top_logprobs=2),
                                      dict(temperature=0.0, repetition_penalty=1.05, frequency_penalty=0.05),
                                      dict(temperature=0.7, presence_penalty=0.5, seed=5)])
def test_smollm2_outputs_do_not_change_with_drafts(runner, smollm2_tokenizer, sampling):
    """float32: a row with drafts computes each position as a decode would, seeded noise is per
    output position, and each position's penalties count the tokens before it only (drafts not
    kept are taken back from the counts), so greedy and seeded outputs are the same with drafts
    as without."""
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    prompt = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "Copy this code:\n" + code}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    outputs = {}
    for spec in (None, "ngram"):
        core = SchedulerCore(SchedulerConfig(max_total_tokens=1500, max_running_requests=4, max_prefill_tokens=64,
                                             chunked_prefill_size=64, max_context_len=1024, eos_token_ids=(EOS,),
                                             speculative_algorithm=spec))
        reqs = [Req(f"r{i}", list(prompt), SamplingParams(max_new_tokens=48, **sampling)) for i in range(2)]
        run_to_completion(runner, core, reqs)
        outputs[spec] = ([r.output_ids for r in reqs], core.num_accepted_tokens, [r.output_logprobs for r in reqs])
    assert outputs["ngram"][0] == outputs[None][0] and outputs["ngram"][1] > 0
    for with_drafts, without in zip(outputs["ngram"][2], outputs[None][2]):  # (one per output token, where asked)
        assert len(with_drafts) == len(without) == (len(outputs[None][0][0]) if sampling.get("logprobs") else 0)
        for a, b in zip(with_drafts, without):
            assert abs(a.logprob - b.logprob) < 1e-3 and [t for t, _ in a.top] == [t for t, _ in b.top]


def test_each_position_counts_only_the_drafts_before_it(runner):
    """The penalty counts of a row's positions: position j leaves out the drafts after it; and
    the drafts the scheduler did not keep come off the slot's counts at its next step, the kept
    ones onto its grammar record."""
    from ipc.messages import ModelWorkerBatch
    from worker_proc.forward_batch import ForwardBatch

    ids = np.asarray([7, 50, 51, 52, 9], dtype=np.int32)  # row 0: last token 7, drafts 50 51 52; row 1: 9
    batch = ModelWorkerBatch(step=0, input_ids=ids.tobytes(), out_cache_loc=np.arange(5, dtype=np.int32).tobytes(),
                             req_pool_indices=[1, 2], prefix_lens=[10, 6], extend_lens=[4, 1], prompt_lens=[5, 5],
                             sample_rows=[0, 1], sampling=[SamplingParams(), SamplingParams()], output_lens=[5, 1],
                             draft_lens=[3, 0])
    fb = ForwardBatch.from_worker_batch(batch)
    runner.counted_drafts.clear()
    params, output_lens, slots, (rows, tokens), ahead = runner._draft_positions(batch, fb, counted=True)
    assert ahead == [[], [50], [50, 51], [50, 51, 52], []]
    assert fb.logit_rows.tolist() == [0, 1, 2, 3, 4] and output_lens == [5, 6, 7, 8, 1] and slots.tolist() == [1] * 4 + [2]
    assert sorted(zip(rows.tolist(), tokens.tolist())) == [(0, 50), (0, 51), (0, 52), (1, 51), (1, 52), (2, 52)]
    assert runner.counted_drafts == {1: (10, [50, 51, 52])}
    runner.output_counts.reset([1])
    runner.output_counts.add([1] * 4, [7, 50, 51, 52])  # (what the step counted)
    nxt = ModelWorkerBatch(step=1, input_ids=np.asarray([8], np.int32).tobytes(), out_cache_loc=b"\0\0\0\0",
                           req_pool_indices=[1], prefix_lens=[12], extend_lens=[1], prompt_lens=[5], sample_rows=[0],
                           sampling=[SamplingParams()], output_lens=[7])
    runner.grammars.reset([1])
    runner.grammars.record([1], [7])
    runner._settle_drafts(ForwardBatch.from_worker_batch(nxt), nxt)  # (one draft kept: 12 = 10 + 1 + 1)
    counts = runner.output_counts.gather([1])[0]
    assert [int(counts[t]) for t in (7, 50, 51, 52)] == [1, 1, 0, 0] and not runner.counted_drafts
    assert runner.grammars.outputs[1] == [7, 50]  # (the kept draft goes on the grammar record)
    runner.grammars.reset([1])


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=3)])
def test_grammar_outputs_do_not_change_with_drafts(runner, smollm2_tokenizer, sampling, caplog):
    """A grammar row with drafts: each position's mask is the matcher's after the drafts before it
    (taken in, then back), and the kept drafts go onto the record the next step."""
    import json

    person = {"name": "Alice Martin", "city": "Paris", "job": "baker", "age": 31}
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                               "job": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "city", "job", "age"], "additionalProperties": False}
    prompt = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this JSON exactly: {json.dumps(person)}"}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    outputs = {}
    for spec in (None, "ngram"):
        core = SchedulerCore(SchedulerConfig(max_total_tokens=1500, max_running_requests=4, max_prefill_tokens=256,
                                             max_context_len=1024, eos_token_ids=(EOS,), speculative_algorithm=spec))
        reqs = [Req(f"r{i}", list(prompt), SamplingParams(max_new_tokens=60, json_schema=json.dumps(schema), **sampling))
                for i in range(2)]
        run_to_completion(runner, core, reqs)
        outputs[spec] = ([r.output_ids for r in reqs], core.num_accepted_tokens)
    assert outputs["ngram"][0] == outputs[None][0] and outputs["ngram"][1] > 0
    assert not [r.message for r in caplog.records if r.name == "worker_proc.grammar"]  # (the record kept up)
    for ids in outputs["ngram"][0]:
        assert set(json.loads(smollm2_tokenizer.decode(ids, skip_special_tokens=True))) == set(person)
