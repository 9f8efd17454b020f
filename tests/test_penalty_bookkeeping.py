"""The worker's per-slot output-token counts and prompt masks stay exact through chunked
prompts, decodes and retraction re-prefills (in-process: SchedulerCore + ModelRunner)."""

from __future__ import annotations

import numpy as np
import torch

from inproc import build_tiny_checkpoint
from ipc.messages import SamplingParams
from scheduler_proc.core import SchedulerConfig, SchedulerCore
from scheduler_proc.req import Req
from worker_proc.model_runner import ModelRunner, RunnerConfig


def test_counts_and_prompt_masks_track_every_request(tmp_path):
    ckpt = build_tiny_checkpoint("llama", tmp_path / "llama", seed=0)
    runner = ModelRunner(RunnerConfig(str(ckpt), torch.float32, kv_cache_gb=0.01, max_running_requests=4))
    core = SchedulerCore(SchedulerConfig(max_total_tokens=160, max_running_requests=4, max_prefill_tokens=24,
                                         chunked_prefill_size=24, max_context_len=256, init_new_token_ratio=0.0,
                                         min_new_token_ratio=0.0))
    rng = np.random.default_rng(0)
    reqs = [Req(f"r{i}", rng.integers(0, 1000, 30 + 5 * i).tolist(),
                SamplingParams(max_new_tokens=40, temperature=1.0, seed=i, frequency_penalty=0.5,
                               repetition_penalty=1.3, ignore_eos=True)) for i in range(4)]
    for r in reqs:
        core.add_request(r)
    checked = 0
    while core.waiting or core.running:
        batch, _ = core.next_batch()
        if batch is None:
            continue
        ids = runner.forward(batch.to_worker_batch())
        for row in batch.rows:  # state the sampling in this step saw
            req, slot = row.req, row.req.req_pool_idx
            if not row.samples:
                continue
            expected = np.bincount(np.asarray(req.output_ids[: row.output_index], dtype=np.int64), minlength=1000)
            assert np.array_equal(runner.output_counts.counts[slot].numpy(), expected), req.rid
            prompt = np.zeros(1000, dtype=bool)
            prompt[req.input_ids] = True
            assert np.array_equal(runner.prompt_tokens.mask[slot].numpy(), prompt), req.rid
            checked += 1
        core.on_result(batch, ids)
    assert core.num_retractions > 0 and checked > 100


def test_forked_choices_see_exact_penalty_state_and_match_lone_runs(tmp_path):
    """The n choices of a prompt share one prefill: a forked slot gets the prompt mask and fresh
    counts, so each choice samples exactly as it would alone (greedy, and seeded with penalties)."""
    ckpt = build_tiny_checkpoint("llama", tmp_path / "llama", seed=0)
    runner = ModelRunner(RunnerConfig(str(ckpt), torch.float32, kv_cache_gb=0.01, max_running_requests=4))
    prompt = np.random.default_rng(1).integers(0, 1000, 37).tolist()

    def params(seed):
        return SamplingParams(max_new_tokens=12, temperature=0.0 if seed is None else 1.0, seed=seed,
                              frequency_penalty=0.5, repetition_penalty=1.3, ignore_eos=True)

    def run(reqs):
        core = SchedulerCore(SchedulerConfig(max_total_tokens=1000, max_running_requests=4, max_prefill_tokens=16,
                                             chunked_prefill_size=16, max_context_len=256))
        for r in reqs:
            core.add_request(r)
        while core.waiting or core.running:
            batch, _ = core.next_batch()
            ids = runner.forward(batch.to_worker_batch())
            for row in batch.rows:
                if row.samples:
                    slot = row.req.req_pool_idx
                    expected = np.bincount(np.asarray(row.req.output_ids[: row.output_index], dtype=np.int64),
                                           minlength=1000)
                    assert np.array_equal(runner.output_counts.counts[slot].numpy(), expected)
                    mask = np.zeros(1000, dtype=bool)
                    mask[prompt] = True
                    assert np.array_equal(runner.prompt_tokens.mask[slot].numpy(), mask)
            core.on_result(batch, ids)
        assert not core.idle_leaks()
        return core, [r.output_ids for r in reqs]

    seeds = [None, 11, 12, 13]
    core, together = run([Req(f"c{k}", list(prompt), params(s), prefill_group="g") for k, s in enumerate(seeds)])
    assert core.stats()["num_cached_prompt_tokens"] == 3 * (len(prompt) - 1)  # the others take it from the cache
    alone = [run([Req("lone", list(prompt), params(s))])[1][0] for s in seeds]
    assert together == alone
    assert len({tuple(o) for o in together[1:]}) > 1  # seeded choices differ


def test_token_history_is_recorded_only_where_penalties_read_it(tmp_path):
    """Batches whose requests have no history penalties skip the bookkeeping; with a penalty
    request among them (or parked behind a leader to share its prefill) every row is recorded,
    so its state stays exact."""
    ckpt = build_tiny_checkpoint("llama", tmp_path / "llama", seed=0)
    runner = ModelRunner(RunnerConfig(str(ckpt), torch.float32, kv_cache_gb=0.01, max_running_requests=4))
    rng = np.random.default_rng(2)
    plain = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    penalised = SamplingParams(max_new_tokens=8, temperature=0.0, presence_penalty=0.7, ignore_eos=True)

    def run(reqs: list[Req]) -> list[tuple[bool, set[str]]]:
        """Per step: the batch's track_tokens flag and the requests it computes."""
        core = SchedulerCore(SchedulerConfig(max_total_tokens=400, max_running_requests=4, max_prefill_tokens=16,
                                             chunked_prefill_size=16, max_context_len=256))
        for r in reqs:
            core.add_request(r)
        flags = []
        while core.waiting or core.running:
            batch, _ = core.next_batch()
            wire = batch.to_worker_batch()
            flags.append((wire.track_tokens, {r.req.rid for r in batch.rows if r.extend_len}))
            ids = runner.forward(wire)
            for row in batch.rows:
                if row.samples and row.req.sampling.uses_token_history:
                    expected = np.bincount(np.asarray(row.req.output_ids[: row.output_index], dtype=np.int64),
                                           minlength=1000)
                    assert np.array_equal(runner.output_counts.counts[row.req.req_pool_idx].numpy(), expected)
                    mask = np.zeros(1000, dtype=bool)
                    mask[row.req.input_ids] = True
                    assert np.array_equal(runner.prompt_tokens.mask[row.req.req_pool_idx].numpy(), mask)
            core.on_result(batch, ids)
        return flags

    prompts = [rng.integers(0, 1000, 20 + 3 * i).tolist() for i in range(3)]
    assert not any(flag for flag, _ in run([Req(f"p{i}", p, plain) for i, p in enumerate(prompts)]))
    steps = run([Req("a", prompts[0], plain), Req("b", prompts[1], penalised)])
    assert all(flag == ("b" in rids) for flag, rids in steps) and any(flag for flag, _ in steps)
    # a penalised choice that waits for a plain one to compute their prompt: the plain one's
    # steps record nothing; the penalised one's state starts from the cached prefix's tokens
    shared = rng.integers(0, 1000, 40).tolist()
    steps = run([Req("lead", list(shared), plain, prefill_group="g"),
                 Req("follow", list(shared), penalised, prefill_group="g")])
    assert steps[0] == (False, {"lead"})
    assert all(flag == ("follow" in rids) for flag, rids in steps) and any(flag for flag, _ in steps)
