"""The GPU path on a CUDA device: the model end to end, CUDA graphs against eager steps, the
Triton backend against the torch reference, deterministic mode's batch invariance, and greedy
parity with Hugging Face in bfloat16. Skipped where no CUDA device is visible (the kernels
themselves are tested on the CPU through Triton's interpreter: tests/test_triton_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from inproc import TINY_ARCHS, build_tiny_checkpoint, generate_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none is visible)")

NEW_TOKENS = 32


def runner_on_gpu(path, dtype=torch.bfloat16, **kwargs):
    from worker_proc.model_runner import ModelRunner, RunnerConfig

    config = dict(kv_cache_gb=0, max_running_requests=64, device="cuda", mem_fraction_static=0.5,
                  cuda_graph_max_bs=64)
    config.update(kwargs)
    return ModelRunner(RunnerConfig(str(path), dtype, **config))


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_triton_backend_and_cuda_graphs_match_the_torch_backend(arch, tmp_path):
    """float32 on tiny checkpoints: eager Triton, Triton with graphs and eager torch attention give
    the same greedy tokens (batched: decode steps of 3 rows replay the size-4 graph, padded)."""
    path = build_tiny_checkpoint(arch, tmp_path, seed=TINY_ARCHS.index(arch))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 17, 40)]
    outs = {}
    for name, kwargs in {"torch": dict(attention_backend="torch", cuda_graph_max_bs=0),
                         "triton": dict(cuda_graph_max_bs=0), "graphs": dict(cuda_graph_max_bs=8)}.items():
        runner = runner_on_gpu(path, torch.float32, max_running_requests=8, mem_fraction_static=0.1, **kwargs)
        assert (runner.graphs is not None) == (name == "graphs")
        outs[name] = generate_greedy(runner, prompts, NEW_TOKENS, together=True)
        del runner
        torch.cuda.empty_cache()
    assert outs["triton"] == outs["torch"]
    assert outs["graphs"] == outs["triton"]


def test_bfloat16_greedy_parity_with_hf(default_model_dir, chat_prompt_ids):
    """The default model in bfloat16 (the GPU's auto dtype) against HF's bfloat16 on the GPU: the
    same 32 greedy tokens on at least 7 of the 8 chat prompts (bf16 rounding may flip a near tie)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.bfloat16).cuda().eval()
    expected = []
    with torch.inference_mode():
        for ids in chat_prompt_ids:
            out = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=NEW_TOKENS, do_sample=False,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"))
            expected.append(out[0, len(ids):].tolist())
    del hf
    torch.cuda.empty_cache()
    runner = runner_on_gpu(default_model_dir)
    got = generate_greedy(runner, chat_prompt_ids, NEW_TOKENS, together=True, eos_token_ids=runner.eos_token_ids,
                          ignore_eos=False)
    del runner
    torch.cuda.empty_cache()
    same = sum(g == e[: len(g)] for g, e in zip(got, expected))
    assert same >= 7, [(g, e) for g, e in zip(got, expected) if g != e[: len(g)]]


def test_deterministic_mode_is_batch_invariant(default_model_dir, chat_prompt_ids):
    """--enable-deterministic-inference: a prompt alone and inside a batch of 32 (other prompts of
    other lengths, mixed prefill and decode steps) gives the same tokens, graphs on."""
    runner = runner_on_gpu(default_model_dir, deterministic=True)
    prompts = [chat_prompt_ids[i % len(chat_prompt_ids)] + [chat_prompt_ids[0][-1]] * (i // 8) for i in range(32)]
    alone = generate_greedy(runner, prompts[:1], 64, together=False)
    batched = generate_greedy(runner, prompts, 64, together=True, max_prefill_tokens=256)
    del runner
    torch.cuda.empty_cache()
    assert batched[0] == alone[0]


def test_engine_serves_on_the_gpu(default_model_dir):
    """Every process, the worker on the GPU with its defaults (bfloat16, Triton, graphs)."""
    from launch import Engine

    with Engine(device="cuda", max_running_requests=16, cuda_graph_max_bs=16, port=0) as engine:
        assert engine.server_info["dtype"] == "bfloat16"
        assert engine.server_info["attention_backend"] == "triton"
        assert engine.server_info["cuda_graph_max_bs"] == 16
        out = engine.generate(["The capital of France is"] * 3, {"max_new_tokens": 16, "temperature": 0})
        assert "Paris" in out[0]["text"] and out[0]["text"] == out[1]["text"] == out[2]["text"]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_weight_only_quantization_matches_the_cpu_reference(scheme, deterministic, tmp_path):
    """--quantization on the GPU (int8 through the Triton matmul, int4 widened then multiplied) gives
    the greedy tokens of the same quantized model on the CPU's torch ops (float32)."""
    from worker_proc.model_runner import ModelRunner, RunnerConfig

    path = build_tiny_checkpoint("llama", tmp_path, seed=0)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (6, 30)]
    cpu = ModelRunner(RunnerConfig(str(path), torch.float32, kv_cache_gb=0.01, max_running_requests=4,
                                   kernel_backend="torch", quantization=scheme))
    expected = generate_greedy(cpu, prompts, NEW_TOKENS, together=True)
    gpu = runner_on_gpu(path, torch.float32, max_running_requests=4, mem_fraction_static=0.1, quantization=scheme,
                        deterministic=deterministic)
    assert generate_greedy(gpu, prompts, NEW_TOKENS, together=True) == expected
    del gpu
    torch.cuda.empty_cache()
