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
            expected = np.bincount(np.asarray(req.output_ids, dtype=np.int64), minlength=1000)
            assert np.array_equal(runner.output_counts.counts[slot].numpy(), expected), req.rid
            prompt = np.zeros(1000, dtype=bool)
            prompt[req.input_ids] = True
            assert np.array_equal(runner.prompt_tokens.mask[slot].numpy(), prompt), req.rid
            checked += 1
        core.on_result(batch, ids)
    assert core.num_retractions > 0 and checked > 100
