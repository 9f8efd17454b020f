"""Shapes the kernels' vector widths do not divide, on every build this CPU runs (`kernel`, see
conftest): input sizes that are not a multiple of 8, 16 or 32, fewer than 16 outputs, more query
heads per kv head than a prompt tile holds. Through `Ops` op by op, then whole models through the
per-layer path and the compiled layer stack, each against the torch backend."""

from __future__ import annotations

import pytest
import torch

from inproc import build_tiny_checkpoint, generate_greedy
from worker_proc.model_runner import DENSE_BF16_ROWS, SMALL_M_ROWS
from worker_proc import onednn_linear
from worker_proc.ops import Ops, quantize_int4, quantize_int8

TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}
ODD_LINEARS = [(1, 1), (5, 3), (7, 13), (40, 72), (17, 100), (15, 33), (5, 1000)]  # (n, k)
ROWS = [1, 3, 8, 9, 33]


@pytest.fixture(scope="module")
def ops_pair(kernel):
    return Ops(kernel, SMALL_M_ROWS, DENSE_BF16_ROWS), Ops()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n,k", ODD_LINEARS)
def test_linears_on_odd_shapes_match_torch(ops_pair, dtype, n, k):
    fast, ref = ops_pair
    torch.manual_seed(n * 1000 + k)
    w = torch.randn(n, k) * 0.1
    bias = torch.randn(n).to(dtype)
    dense = w.to(dtype)
    packed = fast.pack_dense(dense)
    q8, s8 = quantize_int8(w)
    for m in ROWS:
        x = torch.randn(m, k).to(dtype)
        torch.testing.assert_close(fast.dense_linear(x, dense, bias, packed), ref.dense_linear(x, dense, bias),
                                   **TOLERANCE[dtype])
        # k is no multiple of 64 here: no packed blocks, the exact int8 path (activations unrounded)
        torch.testing.assert_close(fast.int8_linear(x, fast.pack_int8(q8, dtype), s8, bias),
                                   ref.int8_linear(x, q8, s8, bias), **TOLERANCE[dtype])


@pytest.mark.skipif(not onednn_linear.available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n,k", ODD_LINEARS + [(960, 576)])
def test_linears_on_weights_reordered_for_onednn_match_torch(dtype, n, k):
    """Ops.dense_linear on a weight reordered once at load (onednn_linear.pack), at row counts
    below, at and far above the layout's LAYOUT_ROWS, with and without a bias."""
    if not onednn_linear.supports(dtype):
        pytest.skip(f"this CPU's oneDNN does not reorder {dtype} weights")
    torch.manual_seed(n * 1000 + k)
    dense = (torch.randn(n, k) * 0.1).to(dtype)
    reordered = onednn_linear.pack(dense)
    ops = Ops()  # no kernel: every row count reaches the GEMM
    for m, bias in [(1, None), (9, torch.randn(n).to(dtype)), (onednn_linear.LAYOUT_ROWS, None), (300, None)]:
        x = torch.randn(m, k).to(dtype)
        torch.testing.assert_close(ops.dense_linear(x, dense, bias, None, reordered),
                                   torch.nn.functional.linear(x, dense, bias), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (13, 160)])
def test_int4_on_few_outputs_and_odd_group_counts_matches_torch(ops_pair, dtype, n, k):
    """int4 takes whole groups of 32; an odd number of them leaves no pair for the integer path."""
    fast, ref = ops_pair
    torch.manual_seed(n + k)
    q4, s4, m4 = quantize_int4(torch.randn(n, k) * 0.1)
    for m in ROWS:
        x = torch.randn(m, k).to(dtype)
        torch.testing.assert_close(fast.int4_linear(x, q4, s4, m4, None), ref.int4_linear(x, q4, s4, m4, None),
                                   **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("width", [1, 7, 54, 100])
def test_elementwise_ops_on_odd_widths_match_torch(ops_pair, dtype, width):
    fast, ref = ops_pair
    torch.manual_seed(width)
    tol = TOLERANCE[dtype]
    x, residual = torch.randn(5, width).to(dtype), torch.randn(5, width).to(dtype)
    weight = (1 + 0.1 * torch.randn(width)).to(dtype)
    torch.testing.assert_close(fast.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5), **tol)
    got, got_res = fast.add_rms_norm(x, residual.clone(), weight, 1e-5)
    want, want_res = ref.add_rms_norm(x, residual.clone(), weight, 1e-5)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_res, want_res, **tol)
    gate_up = torch.randn(3, 2 * width).to(dtype)
    torch.testing.assert_close(fast.silu_mul(gate_up), ref.silu_mul(gate_up), **tol)
    logits = torch.randn(4, width).to(dtype)
    assert torch.equal(fast.kernels.argmax_rows(logits), logits.argmax(-1))


@pytest.mark.parametrize("head_dim", [2, 6, 18])
def test_rope_on_odd_head_sizes_matches_torch(ops_pair, head_dim):
    fast, ref = ops_pair
    torch.manual_seed(head_dim)
    heads, positions = 5, torch.tensor([0, 3, 9])
    angles = torch.arange(16, dtype=torch.float32)[:, None] * torch.rand(head_dim // 2)[None]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    qkv = torch.randn(len(positions), (heads + 1) * head_dim)
    a, b = qkv.clone(), qkv.clone()
    fast.rope_(a, positions, cos, sin, heads, head_dim)
    ref.rope_(b, positions, cos, sin, heads, head_dim)
    torch.testing.assert_close(a, b, **TOLERANCE[torch.float32])


# ---- whole models ---------------------------------------------------------------------------

MODEL_SHAPES = {
    # every linear's input size odd (54, 44), 13 outputs for the LM head, head_dim 18
    "odd-widths": dict(hidden_size=54, num_attention_heads=3, num_key_value_heads=1, intermediate_size=44,
                       vocab_size=13),
    # 20 query heads on one kv head: more than a prompt tile's rows on AVX-512 builds
    "wide-group": dict(hidden_size=320, num_attention_heads=20, num_key_value_heads=1, intermediate_size=100,
                       vocab_size=300),
}
# int8 on odd widths only: where K is a multiple of 64 the integer kernels round activations to
# int8 (test_cpu_kernels checks those against their own reference), which the torch backend does not
CASES = [("odd-widths", "none"), ("odd-widths", "int8"), ("wide-group", "none")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: build_tiny_checkpoint("llama", tmp_path_factory.mktemp(name), seed=7, **sizes)
            for name, sizes in MODEL_SHAPES.items()}


def _run_and_capture(runner, prompts) -> tuple[list[list[int]], list[torch.Tensor], list[int]]:
    """Greedy outputs, the logits of every step and the token rows of each step the layer stack ran."""
    model, run_model = runner.model, getattr(runner.attn, "run_model", None)
    logits, stack_steps = [], []

    def capture(*args, **kwargs):
        out = model(*args, **kwargs)
        logits.append(out.detach().clone())
        return out

    def counted(stack, input_ids, *args, **kwargs):
        stack_steps.append(input_ids.numel())
        return run_model(stack, input_ids, *args, **kwargs)

    runner.model = capture
    if run_model is not None:
        runner.attn.run_model = counted
    try:
        outputs = generate_greedy(runner, prompts, max_new_tokens=4, together=True)
    finally:
        runner.model = model
        if run_model is not None:
            runner.attn.run_model = run_model
    return outputs, logits, stack_steps


@pytest.mark.parametrize("shape,quantization", CASES, ids=[f"{s}-{q}" for s, q in CASES])
def test_models_of_odd_shapes_match_the_torch_backend(kernel, request, checkpoints, shape, quantization):
    """Decode and prefill steps through the layer stack, then through the per-layer Python path
    (Ops) with the stack taken away, each step's logits against the torch backend's. The KV cache
    is pinned to float32 (int8's default is float16): a last-bit difference in K or V would
    otherwise round to a different float16 (~1e-3 apart) and hide the comparison in that noise."""
    from worker_proc.model_runner import ModelRunner, RunnerConfig

    def runner(backend: str) -> ModelRunner:
        return ModelRunner(RunnerConfig(str(checkpoints[shape]), torch.float32, kv_cache_gb=0.02, max_running_requests=4,
                                        kernel_backend=backend, kernel_isa=request.node.callspec.params["kernel"],
                                        quantization=quantization, kv_cache_dtype="float32"))

    vocab = runner("torch").config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 40)]
    want_out, want_logits, _ = _run_and_capture(runner("torch"), prompts)

    fast = runner("cpu")
    assert fast.model.layer_stack is not None
    got_out, got_logits, stack_steps = _run_and_capture(fast, prompts)
    assert len(stack_steps) >= 3  # at least the decode steps
    fast.model.layer_stack = None  # the per-layer path, op by op through Ops
    per_layer_out, per_layer_logits, _ = _run_and_capture(fast, prompts)
    for outputs, logits in ((got_out, got_logits), (per_layer_out, per_layer_logits)):
        assert len(logits) == len(want_logits)
        for got, want in zip(logits, want_logits):
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        assert outputs == want_out


def test_bfloat16_model_on_packed_weights_follows_the_torch_backend(kernel, request, tmp_path):
    """bfloat16 with every linear packed in the tiles' VNNI form (the MLP's gated, silu(gate) * up in the
    kernel): the layer stack takes every step, prompts included, and each step's logits agree
    with the torch backend's in bfloat16 (both round to bfloat16 after each op, in other orders),
    up to the first greedy pick that differs."""
    import sys

    from worker_proc.model_runner import ModelRunner, RunnerConfig

    if not kernel.packed_bf16_rows():
        pytest.skip("no bfloat16 products (AMX tiles or AVX512-BF16) in this build or on this CPU")
    path = build_tiny_checkpoint("llama", tmp_path, seed=7, vocab_size=1024)  # every N and K a multiple of 32

    def runner(backend: str) -> ModelRunner:
        return ModelRunner(RunnerConfig(str(path), torch.bfloat16, kv_cache_gb=0.02, max_running_requests=4,
                                        kernel_backend=backend, kernel_isa=request.node.callspec.params["kernel"]))

    fast = runner("cpu")
    assert fast.model.layer_stack_rows == min(kernel.packed_bf16_rows(), sys.maxsize)
    assert all(layer.mlp.gate_up_proj.packed_gated for layer in fast.model.layers)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (5, 17, 40)]
    want_out, want_logits, _ = _run_and_capture(runner("torch"), prompts)
    got_out, got_logits, stack_steps = _run_and_capture(fast, prompts)
    assert len(stack_steps) == len(got_logits)
    for step, (got, want) in enumerate(zip(got_logits, want_logits)):
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert err < 0.05, f"step {step}: relative error {err:.3f}"
        if not torch.equal(got.argmax(-1), want.argmax(-1)):
            break
    assert sum(a == b for a, b in zip(got_out, want_out)) >= 2


REGION_CASES = [("llama", "bfloat16", "none", "auto"), ("llama", "float32", "none", "float32"),
                ("llama", "float32", "none", "float16"), ("llama", "float32", "int8", "float16"),
                ("llama", "float32", "int4", "float32"), ("llama", "bfloat16", "none", "int8"),
                ("llama", "float32", "none", "int8"), ("llama", "bfloat16", "int8", "auto"),
                ("llama", "bfloat16", "int4", "auto"),
                # a qkv bias (Qwen2), per-head q / k norms (Qwen3): QkvExtras in the region
                ("qwen2", "bfloat16", "none", "auto"), ("qwen2", "float32", "none", "float32"),
                ("qwen2", "float32", "int8", "float16"), ("qwen3", "bfloat16", "none", "auto"),
                ("qwen3", "float32", "int4", "float32"), ("qwen3", "bfloat16", "int8", "auto"),
                ("qwen2", "bfloat16", "none", "int8"), ("qwen3", "float32", "none", "int8")]


@pytest.mark.parametrize("arch,dtype,quantization,kv_cache_dtype", REGION_CASES,
                         ids=[f"{a}-{d}-{q}-kv-{k}" for a, d, q, k in REGION_CASES])
def test_one_region_steps_equal_op_by_op_steps(kernel, request, tmp_path, arch, dtype, quantization, kv_cache_dtype):
    """The layer stack's steps in one parallel region (each op's team form, the linears' blocks
    balanced between threads) give the logits of its op-by-op calls bit for bit: prompt steps (the
    last layer narrowed to the logit rows), mixed and decode steps, one-row steps (bfloat16: their
    own linears without AMX) included; bfloat16 on packed weights, float32 activations on float32,
    int8 or int4 panels with a float32 or float16 KV cache; int8 KV caches under both; bfloat16 on
    int8 / int4 panels (AMX tiles over the widened weights in steps of amx_panel_rows() rows or
    more, the integer GEMM's products below them and without AMX). Qwen2's qkv bias and Qwen3's
    q / k norms too. The same steps with the region run over row chunks give the same logits too."""
    from worker_proc.model_runner import ModelRunner, RunnerConfig

    if dtype == "bfloat16" and not kernel.packed_bf16_rows():
        pytest.skip("no bfloat16 products (AMX tiles or AVX512-BF16) in this build or on this CPU")
    if quantization == "none" and dtype == "float32" and not kernel.dense_f32_rows():
        pytest.skip("no float32 panels (AVX2 and FMA) in this build")
    if quantization != "none" and not kernel.integer_panels():
        pytest.skip("no integer panels (AVX2 or AVX512-VNNI) in this build")
    # head_dim 64 (the default model's), every N and K a multiple of 32
    path = build_tiny_checkpoint(arch, tmp_path, seed=7, vocab_size=1024, hidden_size=128, num_attention_heads=2,
                                 num_key_value_heads=1, intermediate_size=256)
    fast = ModelRunner(RunnerConfig(str(path), getattr(torch, dtype), kv_cache_gb=0.02, max_running_requests=4,
                                    kernel_backend="cpu", kernel_isa=request.node.callspec.params["kernel"],
                                    quantization=quantization, kv_cache_dtype=kv_cache_dtype))
    stack = fast.model.layer_stack
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (5, 17, 40, 90)]
    # (alone, a prompt's decode steps have one row; int4 takes its panels from two rows on AVX2)
    for batch in (prompts, prompts[2:4] if quantization == "int4" else prompts[2:3]):
        stack.one_region = True
        steps = stack.one_region_steps
        out_region, logits_region, rows = _run_and_capture(fast, batch)
        in_region = rows  # every step
        assert len(rows) == len(logits_region) and in_region
        assert stack.one_region_steps - steps == len(in_region)
        stack.one_region = False
        out_ops, logits_ops, _ = _run_and_capture(fast, batch)
        assert stack.one_region_steps - steps == len(in_region)
        assert out_region == out_ops and len(logits_region) == len(logits_ops)
        for a, b in zip(logits_region, logits_ops):
            assert torch.equal(a, b)
        # the region over row chunks of 32-48 rows, prompts cut mid-way (each chunk one region)
        chunk_rows = 40
        stack.one_region, stack.region_rows, whole = True, chunk_rows, stack.region_rows
        steps = stack.one_region_steps
        try:
            out_chunks, logits_chunks, _ = _run_and_capture(fast, batch)
        finally:
            stack.region_rows = whole
        chunked = any(n > chunk_rows for n in in_region)
        assert (stack.one_region_steps - steps > len(in_region)) if chunked else (
            stack.one_region_steps - steps == len(in_region))
        assert out_chunks == out_region and all(torch.equal(a, b) for a, b in zip(logits_chunks, logits_region))
