"""Prompt logprobs (SamplingParams.prompt_logprobs): the logprob of every prompt token after the
first, and its most likely alternatives, from the worker's logits of every prompt position, equal
to HF's log_softmax over the same prompt: through chunked prompts, a retraction, a shared prefix
that the cache would have given (it is not used for them) and requests beside that do not ask
(in-process: SchedulerCore + ModelRunner on a tiny random checkpoint)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inproc import build_tiny_checkpoint, run_to_completion
from ipc.messages import SamplingParams
from scheduler_proc.core import SchedulerConfig, SchedulerCore
from scheduler_proc.req import Req


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from worker_proc.model_runner import ModelRunner, RunnerConfig

    path = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"), seed=0)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    runner = ModelRunner(RunnerConfig(str(path), torch.float32, kv_cache_gb=0.01, max_running_requests=4))
    return hf, runner


def _hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]  # position p predicts token p + 1


def test_prompt_logprobs_match_hf_through_chunks_retraction_and_the_cache(tiny):
    hf, runner = tiny
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 1000, 40).tolist()
    prompts = [shared + rng.integers(0, 1000, 20 + 7 * i).tolist() for i in range(4)]
    core = SchedulerCore(SchedulerConfig(max_total_tokens=200, max_running_requests=4, max_prefill_tokens=24,
                                         chunked_prefill_size=24, max_context_len=256, init_new_token_ratio=0.0,
                                         min_new_token_ratio=0.0))
    first = Req("first", list(prompts[0]), SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    run_to_completion(runner, core, [first])  # (its prompt is now in the prefix cache)
    reqs = [Req(f"r{i}", list(p), SamplingParams(max_new_tokens=30, temperature=1.0, seed=i, ignore_eos=True,
                                                 prompt_logprobs=(0, 3, None, 5)[i]))
            for i, p in enumerate(prompts)]
    run_to_completion(runner, core, reqs)
    assert core.num_retractions > 0 and reqs[0].cached_tokens == 0 and reqs[2].cached_tokens > 0
    for req, prompt in zip(reqs, prompts):
        top = req.sampling.prompt_logprobs
        if top is None:
            assert req.prompt_logprobs == []
            continue
        want = _hf_prompt_logprobs(hf, prompt)
        assert len(req.prompt_logprobs) == len(prompt) - 1 and req.prompt_logprobs_missing == 0
        got = torch.tensor([e.logprob for e in req.prompt_logprobs])
        torch.testing.assert_close(got, want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], atol=2e-4, rtol=0)
        for entry, row in zip(req.prompt_logprobs, want):
            assert len(entry.top) == top
            if top:
                values, ids = row.topk(top)
                assert [t for t, _ in entry.top] == ids.tolist() or \
                    torch.allclose(torch.tensor([v for _, v in entry.top]), values, atol=2e-4)
