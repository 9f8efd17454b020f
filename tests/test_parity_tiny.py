"""Token-for-token parity of loom's model code (fused QKV / gate-up, paged KV, packed batches)
with Hugging Face transformers, on tiny random checkpoints of each supported family."""

from __future__ import annotations

import pytest
import torch

from inproc import TINY_ARCHS, build_tiny_checkpoint, generate_greedy, run_to_completion
from ipc.messages import SamplingParams
from scheduler_proc.core import SchedulerConfig, SchedulerCore
from scheduler_proc.req import Req

NEW_TOKENS = 32
PROMPT_LENS = (5, 17, 40)


class Tiny:
    def __init__(self, arch, path, hf, runner, prompts, hf_out):
        self.arch, self.path, self.hf, self.runner, self.prompts, self.hf_out = arch, path, hf, runner, prompts, hf_out


# Each family through loom's compiled CPU kernels (auto) and through the plain torch ops.
@pytest.fixture(scope="module", params=[(a, b) for a in TINY_ARCHS for b in ("auto", "torch")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def tiny(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM, GenerationConfig

    from worker_proc.model_runner import ModelRunner, RunnerConfig

    arch, backend = request.param
    seed = TINY_ARCHS.index(arch)
    path = build_tiny_checkpoint(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), seed=seed)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa").eval()
    runner = ModelRunner(RunnerConfig(str(path), torch.float32, kv_cache_gb=0.05, max_running_requests=8,
                                      kernel_backend=backend))
    g = torch.Generator().manual_seed(100 + seed)
    vocab = hf.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    # No EOS: HF runs the full NEW_TOKENS, like loom's ignore_eos.
    gc = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    hf_out = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              generation_config=gc)
            hf_out.append(out[0, len(p):].tolist())
    assert all(len(o) == NEW_TOKENS for o in hf_out)
    return Tiny(arch, path, hf, runner, prompts, hf_out)


def test_checkpoint_exercises_the_family(tiny):
    """The checkpoint really carries what makes the family different."""
    from safetensors.torch import load_file

    from worker_proc.model_config import ModelConfig

    tensors = load_file(str(tiny.path / "model.safetensors"))
    cfg = ModelConfig.from_dir(tiny.path)
    if tiny.arch == "llama":
        assert "lm_head.weight" in tensors and not cfg.tie_word_embeddings
        assert not cfg.qkv_bias and not cfg.qk_norm
    if tiny.arch == "qwen2":
        assert cfg.qkv_bias and cfg.tie_word_embeddings
        for proj in ("q_proj", "k_proj", "v_proj"):
            bias = tensors[f"model.layers.0.self_attn.{proj}.bias"]
            assert bias.abs().min() > 0, proj
    if tiny.arch == "qwen3":
        assert cfg.qk_norm and cfg.head_dim == 32 and cfg.head_dim != cfg.hidden_size // cfg.num_heads
        for norm in ("q_norm", "k_norm"):
            w = tensors[f"model.layers.0.self_attn.{norm}.weight"]
            assert not torch.allclose(w, torch.ones_like(w)), norm


def test_last_position_logits_match(tiny):
    """One prefill of the whole prompt: loom's logits for the last position vs HF's."""
    runner = tiny.runner
    captured = []
    model = runner.model

    def capture(*args, **kwargs):
        logits = model(*args, **kwargs)
        captured.append(logits.detach().clone())
        return logits

    runner.model = capture
    try:
        generate_greedy(runner, tiny.prompts, max_new_tokens=1, together=False)
    finally:
        runner.model = model
    assert len(captured) == len(tiny.prompts)  # one prefill step each, nothing else
    with torch.no_grad():
        for prompt, mine in zip(tiny.prompts, captured):
            ref = tiny.hf(torch.tensor([prompt])).logits[0, -1].float()
            assert mine.shape == (1, ref.shape[-1])
            diff = (mine[0] - ref).abs().max().item()
            assert diff < 1e-4, f"{tiny.arch}: max |logit diff| {diff:.3g} (prompt len {len(prompt)})"
            assert ref.std() > 0.5, "logits too flat for greedy parity to mean anything"


def test_layer_stack_matches_the_per_layer_path(tiny):
    """Decode steps through the compiled layer stack give the logits of the per-layer Python path."""
    runner, model = tiny.runner, tiny.runner.model
    if model.layer_stack is None:
        pytest.skip("no layer stack: the torch backend")

    def decode_logits() -> list[torch.Tensor]:
        captured, stack_calls = [], []
        run_model = runner.attn.run_model

        def counted(*args, **kwargs):
            stack_calls.append(1)
            return run_model(*args, **kwargs)

        def capture(*args, **kwargs):
            logits = model(*args, **kwargs)
            captured.append(logits.detach().clone())
            return logits

        runner.model, runner.attn.run_model = capture, counted
        try:
            generate_greedy(runner, tiny.prompts, max_new_tokens=4, together=True)
        finally:
            runner.model = model
            del runner.attn.run_model
        return captured, len(stack_calls)

    with_stack, calls = decode_logits()
    assert calls >= 3  # the decode steps went through the stack
    stack, model.layer_stack = model.layer_stack, None
    try:
        per_layer, calls = decode_logits()
    finally:
        model.layer_stack = stack
    assert calls == 0 and len(per_layer) == len(with_stack)
    for a, b in zip(with_stack, per_layer):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_greedy_matches_hf_one_at_a_time(tiny):
    mine = generate_greedy(tiny.runner, tiny.prompts, NEW_TOKENS, together=False)
    for i, (m, ref) in enumerate(zip(mine, tiny.hf_out)):
        assert m == ref, f"{tiny.arch} prompt {i} (len {len(tiny.prompts[i])}): loom {m} != HF {ref}"


def test_greedy_matches_hf_batched(tiny):
    """All prompts submitted at once: prefills and decodes share packed batches."""
    mine = generate_greedy(tiny.runner, tiny.prompts, NEW_TOKENS, together=True)
    for i, (m, ref) in enumerate(zip(mine, tiny.hf_out)):
        assert len(m) == NEW_TOKENS
        assert m[:16] == ref[:16], f"{tiny.arch} prompt {i}: loom {m[:16]} != HF {ref[:16]}"
        if m != ref:  # past 16 tokens batching may legitimately flip a near-tie; say so
            first = next(j for j, (a, b) in enumerate(zip(m, ref)) if a != b)
            print(f"note: {tiny.arch} prompt {i} batched output diverges from HF at token {first}")


def test_greedy_matches_hf_chunked_prefill(tiny):
    """Prompts split into 7-token chunks (attention over a cached prefix) still match."""
    mine = generate_greedy(tiny.runner, tiny.prompts, NEW_TOKENS, together=True, max_prefill_tokens=7)
    for i, (m, ref) in enumerate(zip(mine, tiny.hf_out)):
        assert m[:16] == ref[:16], f"{tiny.arch} prompt {i}: loom {m[:16]} != HF {ref[:16]}"


@pytest.mark.parametrize("scheme", ["fp16", "int8", "int4"])
def test_quantized_model_equals_its_dequantized_weights(tiny, scheme):
    """--quantization: the quantized linears (the small-M kernel for decode rows, widened weights
    for prefill rows, or the integer GEMM) compute what the plain model computes with the
    dequantized weights."""
    from worker_proc import cpu_kernels
    from worker_proc.linear import HalfLinear, Int4Linear, Int8Linear, Linear
    from worker_proc.model_runner import ModelRunner, RunnerConfig

    backend = tiny.runner.kernel_backend
    # (a float32 KV cache as the reference's: fp16 would default to a float16 one, tested on its own)
    quantized = ModelRunner(RunnerConfig(str(tiny.path), torch.float32, kv_cache_gb=0.05, max_running_requests=8,
                                         kernel_backend=backend, quantization=scheme, kv_cache_dtype="float32"))
    reference = ModelRunner(RunnerConfig(str(tiny.path), torch.float32, kv_cache_gb=0.05, max_running_requests=8,
                                         kernel_backend="torch"))
    ref_modules = dict(reference.model.named_modules())
    replaced = 0
    for name, module in quantized.model.named_modules():
        if isinstance(module, (HalfLinear, Int8Linear, Int4Linear)):
            target = ref_modules[name]
            assert isinstance(target, Linear)
            w = module.dequantized(torch.float32)
            with torch.no_grad():
                target.weight = torch.nn.Parameter(w)  # unties a tied head: it is quantized apart
            replaced += 1
    assert replaced == 4 * tiny.runner.config.num_layers + 1  # qkv, o, gate_up, down per layer + head
    logits = {}
    for label, runner in (("quantized", quantized), ("reference", reference)):
        model, seen = runner.model, []

        def capture(*args, _model=model, _seen=seen, **kwargs):
            out = _model(*args, **kwargs)
            _seen.append(out.detach().clone())
            return out

        runner.model = capture
        try:
            generate_greedy(runner, tiny.prompts, 6, together=True)
        finally:
            runner.model = model
        logits[label] = seen
    assert len(logits["quantized"]) == len(logits["reference"])
    kernels = cpu_kernels.load() if quantized.kernel_backend == "cpu" else None
    rounded_acts = kernels is not None and (kernels.half_products() if scheme == "fp16" else
                                            scheme != "fp16" and kernels.quantized_int8_activations(torch.float32))
    for step, (a, b) in enumerate(zip(logits["quantized"], logits["reference"])):
        if rounded_acts:
            # AVX2 builds quantize float32 activations of int8 and int4 linears (every row count; VNNI
            # builds those of few-row ones: decodes, the LM head) to int8 per 32, AVX512-FP16 ones round fp16 linears' activations to
            # float16; the kernels' own tests check that arithmetic, so here only an error of that
            # rounding's size is allowed, up to the first greedy pick that differs. (This random
            # model amplifies it: with int8 activations, x perturbed by 1e-6 moved its logits 9%.)
            err = ((a - b).abs().max() / b.abs().max()).item()
            assert err < 0.25, f"step {step}: relative error {err:.3f}"
            if not torch.equal(a.argmax(-1), b.argmax(-1)):
                break  # a greedy pick differs: later steps see different tokens
        else:
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


def test_layer_stack_weights_lie_in_step_order(tiny):
    """build_layer_stack packs the weights a step reads into one region in the order it reads
    them (float32 panels without their [N, K] weights), and parameters keep their identity (a
    tied LM head still is the embedding)."""
    from worker_proc.linear import Linear

    model = tiny.runner.model
    if model.layer_stack is None:
        pytest.skip("no layer stack: the torch backend")
    starts = []
    for layer in model.layers:
        for module in (layer.input_layernorm, layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.post_attention_layernorm, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            tensors = (module.streamed_tensors() if isinstance(module, Linear) else
                       (*module.parameters(recurse=False), *module.buffers(recurse=False)))
            starts += [t.data_ptr() for t in tensors]
    starts += [model.norm.weight.data_ptr(), *(t.data_ptr() for t in model.lm_head.streamed_tensors())]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    weights = [*model.parameters(), *(m.packed for m in model.modules() if getattr(m, "packed", None) is not None)]
    assert starts[-1] - starts[0] < sum(t.numel() * t.element_size() for t in weights) + 64 * len(starts)
    panels_only = [m for m in model.modules() if isinstance(m, Linear) and m.packed is not None
                   and m.weight.dtype == torch.float32 and m.weight is not model.embed_tokens.weight]
    assert all(not starts[0] <= m.weight.data_ptr() <= starts[-1] for m in panels_only)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight


def test_float16_kv_cache_follows_the_float32_one(tiny):
    """--kv-cache-dtype float16 under a float32 model: twice the slots in the same memory, K/V
    rounded once when stored; prompts chunked over cached prefixes and batched decodes give the
    float32 cache's greedy tokens."""
    from worker_proc.model_runner import ModelRunner, RunnerConfig

    runner = ModelRunner(RunnerConfig(str(tiny.path), torch.float32, kv_cache_gb=0.05, max_running_requests=8,
                                      kernel_backend=tiny.runner.kernel_backend, kv_cache_dtype="float16"))
    assert runner.pool.kv[0].dtype == torch.float16 and tiny.runner.pool.kv[0].dtype == torch.float32
    assert abs(runner.num_slots - 2 * tiny.runner.num_slots) <= 1
    narrow = generate_greedy(runner, tiny.prompts, NEW_TOKENS, together=True, max_prefill_tokens=7)
    full = generate_greedy(tiny.runner, tiny.prompts, NEW_TOKENS, together=True, max_prefill_tokens=7)
    for i, (m, ref) in enumerate(zip(narrow, full)):
        assert m[:16] == ref[:16], f"{tiny.arch} prompt {i}: float16 KV {m[:16]} != float32 KV {ref[:16]}"


def test_int8_kv_cache_follows_the_float32_one(tiny):
    """--kv-cache-dtype int8: each head row as int8 codes and a float32 scale, ~3.8x the float32
    cache's slots in the same memory (head_dim 16: 64 bytes a row against 20); chunked prompts and
    batched decodes give the float32 cache's greedy tokens for a while (random weights: close logits,
    so a ~0.4% rounding of K and V flips one in time)."""
    from worker_proc.model_runner import ModelRunner, RunnerConfig

    runner = ModelRunner(RunnerConfig(str(tiny.path), torch.float32, kv_cache_gb=0.05, max_running_requests=8,
                                      kernel_backend=tiny.runner.kernel_backend, kv_cache_dtype="int8"))
    head_dim = tiny.runner.pool.kv[0].shape[-1]
    assert runner.pool.kv[0].dtype == torch.int8 and runner.pool.kv[0].shape[-1] == head_dim + 4
    assert abs(runner.num_slots / tiny.runner.num_slots - 4 * head_dim / (head_dim + 4)) < 0.01
    narrow = generate_greedy(runner, tiny.prompts, NEW_TOKENS, together=True, max_prefill_tokens=7)
    full = generate_greedy(tiny.runner, tiny.prompts, NEW_TOKENS, together=True, max_prefill_tokens=7)
    same = [next((i for i, (a, b) in enumerate(zip(m, ref)) if a != b), len(ref)) for m, ref in zip(narrow, full)]
    # (int8 rounds ~16x coarser than float16: the random qwen2 flips a close pair at its 4th token)
    assert min(same) >= 3 and max(same) >= 8, f"{tiny.arch}: greedy tokens agree with the float32 cache's up to {same}"


def test_kv_cache_dtype_choices():
    from worker_proc.kv_cache import resolve_kv_dtype

    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert resolve_kv_dtype("auto", f32) == f32 and resolve_kv_dtype("auto", bf16) == bf16
    assert resolve_kv_dtype("auto", f32, "fp16") == f16 and resolve_kv_dtype("auto", bf16, "fp16") == f16
    assert resolve_kv_dtype("auto", f32, "int8") == f16 and resolve_kv_dtype("auto", f32, "int4") == f16
    assert resolve_kv_dtype("auto", bf16, "int4") == bf16
    assert resolve_kv_dtype("float16", f32) == f16 and resolve_kv_dtype("bfloat16", f32) == bf16
    assert resolve_kv_dtype("float16", bf16) == f16 and resolve_kv_dtype("bfloat16", bf16) == bf16
    assert resolve_kv_dtype("int8", f32) == torch.int8 and resolve_kv_dtype("int8", bf16) == torch.int8
    for name, compute in (("float32", bf16), ("bfloat16", f16), ("float32", f16)):
        with pytest.raises(ValueError, match="--kv-cache-dtype"):
            resolve_kv_dtype(name, compute)
    with pytest.raises(ValueError, match="choose auto"):
        resolve_kv_dtype("fp8", f32)


def test_embeddings_match_the_final_hidden_state(tiny):
    """SamplingParams.embedding: the final hidden state (after the last norm) at each prompt's last
    token, as HF's last hidden state; beside a generating request, the 40-token prompt in chunks."""
    reqs = [Req(f"e{i}", list(p), SamplingParams(max_new_tokens=1, temperature=0.0, embedding=True))
            for i, p in enumerate(tiny.prompts)]
    beside = Req("g", list(tiny.prompts[0]), SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    run_to_completion(tiny.runner, SchedulerCore(SchedulerConfig(
        max_total_tokens=tiny.runner.num_slots, max_running_requests=8, max_prefill_tokens=16,
        chunked_prefill_size=16, max_context_len=tiny.runner.context_len, eos_token_ids=())), [beside, *reqs])
    assert beside.output_ids == tiny.hf_out[0][:4] and not beside.embedding
    with torch.no_grad():
        for req, p in zip(reqs, tiny.prompts):
            want = tiny.hf(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0, -1]
            got = torch.frombuffer(bytearray(req.embedding), dtype=torch.float32)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
