"""Drive SchedulerCore + ModelRunner in one process (no sockets), and build tiny random
Hugging Face checkpoints for parity tests."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from ipc.messages import SamplingParams
from scheduler_proc.core import SchedulerConfig, SchedulerCore
from scheduler_proc.req import Req


def generate_greedy(
    runner,
    prompts: list[list[int]],
    max_new_tokens: int,
    together: bool,
    eos_token_ids: Sequence[int] = (),
    ignore_eos: bool = True,
    max_prefill_tokens: int = 4096,
    max_running_requests: int | None = None,
) -> list[list[int]]:
    """Greedy outputs for `prompts`, in order. together=True submits every prompt at once (they
    share batches: continuous batching); together=False runs them one after another."""

    def make_core() -> SchedulerCore:
        return SchedulerCore(SchedulerConfig(
            max_total_tokens=runner.num_slots,
            max_running_requests=max_running_requests or runner.pool.req_to_token.shape[0],
            max_prefill_tokens=max_prefill_tokens,
            max_context_len=runner.context_len,
            eos_token_ids=tuple(eos_token_ids),
        ))

    def params() -> SamplingParams:
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=ignore_eos)

    def run(core: SchedulerCore, reqs: list[Req]) -> None:
        for req in reqs:
            out = core.add_request(req)
            assert out is None, f"request {req.rid} refused: {out.req.finish}"
        while True:
            batch, _ended = core.next_batch()
            if batch is None:
                break
            core.on_result(batch, runner.forward(batch.to_worker_batch()))
        assert not core.idle_leaks(), core.idle_leaks()

    reqs = [Req(str(i), list(map(int, p)), params()) for i, p in enumerate(prompts)]
    if together:
        run(make_core(), reqs)
    else:
        for req in reqs:
            run(make_core(), [req])
    return [list(r.output_ids) for r in reqs]


# ---- tiny checkpoints --------------------------------------------------------------------

TINY_ARCHS = ("llama", "qwen2", "qwen3")


def build_tiny_checkpoint(arch: str, out_dir, seed: int = 0, **sizes) -> Path:
    """A tiny random-weight float32 checkpoint (safetensors + config.json) in `out_dir`; `sizes`
    overrides config fields (hidden_size, num_attention_heads, vocab_size, ...).

    llama: 3 layers, untied lm_head; qwen2: 2 layers, q/k/v biases, tied embeddings;
    qwen3: 2 layers, head_dim 32 != hidden/heads (16), q_norm/k_norm, untied.
    Weights use a large std and every norm weight / bias is random, so logits are far from
    uniform and a wrong or missing tensor changes the output.
    """
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    common = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    common.update(sizes)
    if arch == "llama":
        config = LlamaConfig(num_hidden_layers=3, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)
        cls = LlamaForCausalLM
    elif arch == "qwen2":
        config = Qwen2Config(num_hidden_layers=2, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **common)
        cls = Qwen2ForCausalLM
    elif arch == "qwen3":
        config = Qwen3Config(num_hidden_layers=2, head_dim=32, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **common)
        cls = Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # input/post-attention/final norms, q_norm, k_norm
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):  # qwen2 q/k/v biases
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def with_tokenizer(checkpoint: Path, tokenizer_dir: Path) -> Path:
    """Copies a tokenizer (the default model's) into a tiny checkpoint, so the full server (which
    tokenizes and detokenizes) can serve it; token ids below the tiny vocabulary decode as usual."""
    import shutil

    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, checkpoint / f.name)
    return checkpoint


PARALLEL_GREEDY = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}


def parallel_outputs(model_path, prompts, alone: int = 8, trace_dir: Path | None = None,
                     **engine_kwargs) -> tuple[list, list, dict]:
    """Greedy outputs of an Engine with the given parallel layout (tp_size, pp_size, ...): the
    first `alone` prompts each alone, all in one batch; and each worker's weight bytes. (A step of
    one row over several ranks costs as much as a batch's: a few prompts alone suffice.)"""
    from launch import Engine

    with Engine(model_path=str(model_path), dtype="float32", kv_cache_gb=0.3, log_level="warning",
                step_trace_dir=str(trace_dir) if trace_dir else None, **engine_kwargs) as engine:
        each = [engine.generate(input_ids=p, sampling_params=PARALLEL_GREEDY)["output_ids"] for p in prompts[:alone]]
        batched = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=PARALLEL_GREEDY)]
        weights = {name: info["weight_bytes"] for name, info in engine.launcher.ready_info.items()
                   if name.startswith("worker")}
    return each, batched, weights


def run_to_completion(runner, core: SchedulerCore, reqs: list[Req], after_step=None) -> SchedulerCore:
    """Add `reqs` and run core and runner until nothing is left (logprobs, prompt logprobs and embeddings included);
    after_step(batch) runs after each step's forward, before its result is applied."""
    for r in reqs:
        core.add_request(r)
    while core.waiting or core.running:
        batch, _ = core.next_batch()
        if batch is None:
            continue
        ids, logprobs = runner.forward_with_logprobs(batch.to_worker_batch())
        if after_step is not None:
            after_step(batch)
        core.on_result(batch, ids, logprobs, runner.prompt_logprobs, runner.embeddings)
    assert not core.idle_leaks()
    return core
