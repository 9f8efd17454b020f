"""The GPU's Triton kernels against loom's torch references, on small shapes. Without a GPU they
run through Triton's interpreter (TRITON_INTERPRET=1, set here before the kernels are defined),
on CPU tensors; with one, compiled on it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before worker_proc.triton_* define their kernels
pytest.importorskip("triton")

from ipc.messages import ModelWorkerBatch  # noqa: E402
from worker_proc import triton_attention, triton_ops  # noqa: E402
from worker_proc.attention import TorchAttention, TritonAttention  # noqa: E402
from worker_proc.forward_batch import ForwardBatch, HostStaging  # noqa: E402
from worker_proc.kv_cache import KVPool  # noqa: E402
from worker_proc.ops import Ops, quantize_int8  # noqa: E402

HEAD_DIM, KV_HEADS, MAX_CONTEXT = 32, 2, 512


def make_pool(dtype: torch.dtype, page_size: int, rows: list[tuple[int, int]], seed: int = 0):
    """A pool with random K/V and a req_to_token row per (prefix, extend) row, each row's
    positions on its own pages of `page_size` slots, pages in random order."""
    g = torch.Generator().manual_seed(seed)
    pages_per_row = [-(-(p + e) // page_size) for p, e in rows]
    num_pages = sum(pages_per_row) + 4
    pool = KVPool(1, num_pages * page_size, KV_HEADS, HEAD_DIM, dtype, len(rows), MAX_CONTEXT, DEVICE)
    pool.kv[0].copy_(torch.randn(pool.kv[0].shape, generator=g).to(dtype))
    pages = torch.randperm(num_pages, generator=g)
    taken = 0
    for r, ((p, e), n) in enumerate(zip(rows, pages_per_row)):
        first = pages[taken : taken + n] * page_size + 1  # slot 0 is scratch
        slots = (first[:, None] + torch.arange(page_size)[None, :]).reshape(-1)[: p + e]
        pool.req_to_token[r, : p + e] = slots.to(torch.int32)
        taken += n
    return pool


def step(rows: list[tuple[int, int]], pool: KVPool) -> ForwardBatch:
    """The ForwardBatch of a step whose row r extends request r from its prefix (slots already in
    req_to_token)."""
    r2t = pool.req_to_token.cpu().numpy()
    loc = np.concatenate([r2t[r, p : p + e] for r, (p, e) in enumerate(rows)]).astype(np.int32)
    total = sum(e for _, e in rows)
    batch = ModelWorkerBatch(step=0, input_ids=np.zeros(total, np.int32).tobytes(), out_cache_loc=loc.tobytes(),
                             req_pool_indices=list(range(len(rows))), prefix_lens=[p for p, _ in rows],
                             extend_lens=[e for _, e in rows], prompt_lens=[p + e for p, e in rows],
                             sample_rows=[], sampling=[], output_lens=[])
    return ForwardBatch.from_worker_batch(batch)


def qkv(total: int, heads: int, dtype: torch.dtype, pool: KVPool, fb: ForwardBatch, seed: int = 1):
    """Random q, and k/v (in q's dtype) equal to what the pool holds at the step's slots (so storing
    them is a no-op and both backends see the same keys)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total, heads, HEAD_DIM, generator=g).to(dtype).to(DEVICE)
    kv = pool.kv[0][fb.out_cache_loc.to(DEVICE)].to(dtype)
    return q, kv[:, 0].contiguous(), kv[:, 1].contiguous()


def run_both(rows, group: int, page_size: int, dtype=torch.float32, split_tokens: int = 0, kv_dtype=None):
    pool = make_pool(kv_dtype or dtype, page_size, rows)
    fb = step(rows, pool)
    heads = group * KV_HEADS
    q, k, v = qkv(len(fb.input_ids), heads, dtype, pool, fb)
    reference = TorchAttention(pool, heads, HEAD_DIM)
    fb_ref = step(rows, pool)
    fb_ref.out_cache_loc = fb_ref.out_cache_loc.to(DEVICE)
    reference.prepare(fb_ref)
    expected = reference.forward(0, q, k, v)
    triton_attn = TritonAttention(pool, HEAD_DIM, HostStaging(DEVICE), num_sms=8, split_tokens=split_tokens)
    fb.out_cache_loc = fb.out_cache_loc.to(DEVICE)
    triton_attn.prepare(fb)
    return triton_attn.forward(0, q, k, v), expected


# A packed step: a whole prompt, a chunk over a cached prefix, decodes short and long (split-K),
# decodes after extends (rows the decode kernel reaches by index).
MIXED_ROWS = [(0, 21), (3, 1), (40, 19), (300, 1), (0, 2), (17, 1)]


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_and_decode_match_the_torch_backend(group, page_size):
    out, expected = run_both(MIXED_ROWS, group, page_size)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_a_float16_pool_under_float32_queries():
    """--kv-cache-dtype float16 with a float32 model: keys and values widen as they load."""
    out, expected = run_both(MIXED_ROWS, 3, 16, kv_dtype=torch.float16)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(DEVICE == "cpu", reason="Triton's interpreter computes bfloat16 dot products wrongly "
                                            "(numpy has no bfloat16); runs compiled on a GPU")
def test_bfloat16_matches_within_its_rounding():
    out, expected = run_both(MIXED_ROWS, 3, 16, torch.bfloat16)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_decode_splits_agree_and_fixed_splits_are_batch_invariant():
    rows = [(300, 1), (5, 1), (130, 1), (64, 1)]
    pool = make_pool(torch.float32, 1, rows)
    fb = step(rows, pool)
    q, _, _ = qkv(len(rows), 3 * KV_HEADS, torch.float32, pool, fb)
    r2t = pool.req_to_token
    t = lambda a: torch.tensor(a, dtype=torch.int64, device=DEVICE)  # noqa: E731
    scale = HEAD_DIM**-0.5

    def decode(which, num_splits, split_tokens=0):
        out = torch.zeros_like(q)
        triton_attention.decode_attention(q, pool.kv[0], out, r2t, t(which), t(which),
                                          t([rows[i][0] + 1 for i in which]), scale, num_splits, split_tokens)
        return out[which]

    everyone = list(range(len(rows)))
    one_split = decode(everyone, 1)
    for splits in (3, 16):
        torch.testing.assert_close(decode(everyone, splits), one_split, atol=2e-6, rtol=1e-5)
    fixed = -(-MAX_CONTEXT // 64)
    alone = decode([0], fixed, 64)
    in_batch = decode(everyone, fixed, 64)[:1]
    assert torch.equal(alone, in_batch), "deterministic decode: a row's result depends on its batch"
    torch.testing.assert_close(alone, one_split[:1], atol=2e-6, rtol=1e-5)


def _block_causal_reference(q, kv, slots, prefix, block, scale):
    keys = kv[slots.long()]
    k, v = keys[:, 0], keys[:, 1]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    q_pos = torch.arange(len(q), device=q.device) + prefix
    k_pos = torch.arange(len(k), device=q.device)
    visible = (k_pos[None, :] // block) <= (q_pos[:, None] // block)
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) * scale
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v.float())


@pytest.mark.parametrize("page_size", [1, 16])
def test_block_causal_mask_for_diffusion_blocks(page_size):
    """A dLLM step: committed tokens (the prefix) and the blocks being denoised (block_size 8,
    aligned): each query sees every committed token and its whole block, later tokens included."""
    block = 8
    rows = [(16, 16), (8, 8), (0, 24)]
    pool = make_pool(torch.float32, page_size, rows)
    fb = step(rows, pool)
    q, _, _ = qkv(len(fb.input_ids), 3 * KV_HEADS, torch.float32, pool, fb)
    t = lambda a: torch.tensor(a, dtype=torch.int64, device=DEVICE)  # noqa: E731
    out = torch.zeros_like(q)
    scale = HEAD_DIM**-0.5
    triton_attention.extend_attention(q, pool.kv[0], out, pool.req_to_token, t(fb.token_starts), t(fb.extend_lens),
                                      t(fb.prefix_lens), t(range(len(rows))), 24, scale, causal_block=block)
    causal = torch.zeros_like(q)
    triton_attention.extend_attention(q, pool.kv[0], causal, pool.req_to_token, t(fb.token_starts),
                                      t(fb.extend_lens), t(fb.prefix_lens), t(range(len(rows))), 24, scale)
    for r, (p, e) in enumerate(rows):
        s = int(fb.token_starts[r])
        expected = _block_causal_reference(q[s : s + e], pool.kv[0], pool.req_to_token[r, : p + e], p, block, scale)
        torch.testing.assert_close(out[s : s + e].float(), expected, atol=2e-5, rtol=1e-4)
        # the last query of each block sees the same keys either way; the others see more
        assert torch.allclose(out[s + e - 1], causal[s + e - 1], atol=2e-5)
        assert not torch.allclose(out[s : s + 1], causal[s : s + 1], atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_activation_match_the_torch_ops(dtype):
    g = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(5, 96, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype).to(DEVICE)
    reference = Ops()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(triton_ops.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), **tol)
    expected_y, expected_r = reference.add_rms_norm(x, residual, weight, 1e-6)
    y, r = triton_ops.add_rms_norm(x, residual.clone(), weight, 1e-6)
    torch.testing.assert_close(r, expected_r, **tol)
    torch.testing.assert_close(y, expected_y, **tol)
    gate_up = torch.randn(7, 2 * 80, generator=g).to(dtype).to(DEVICE)
    torch.testing.assert_close(triton_ops.silu_mul(gate_up), reference.silu_mul(gate_up), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_kv_store_give_the_torch_ops_bits(dtype):
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, tokens = 5, 2, HEAD_DIM, 7  # q heads 3, k heads 2 rotated; v after them
    qkv = torch.randn(tokens, (heads + kv_heads) * head_dim, generator=g).to(dtype).to(DEVICE)
    positions = torch.randint(0, 300, (tokens,), generator=g).to(DEVICE)
    angles = torch.arange(300, dtype=torch.float32)[:, None] * (0.5 ** torch.arange(head_dim // 2))[None, :]
    cos, sin = (f(torch.cat((angles, angles), dim=1)).to(DEVICE) for f in (torch.cos, torch.sin))
    expected = qkv.clone()
    Ops().rope_(expected, positions, cos, sin, heads, head_dim)
    rotated = qkv.clone()
    triton_ops.GpuOps().rope_(rotated, positions, cos, sin, heads, head_dim)
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(rotated, expected)
    else:  # the interpreter rounds float32 to bfloat16 by truncation; a GPU to nearest, as torch
        torch.testing.assert_close(rotated, expected, atol=2e-2, rtol=2e-2)
    assert not torch.equal(rotated, qkv)

    k = rotated[:, 3 * head_dim : heads * head_dim].view(tokens, kv_heads, head_dim)
    v = rotated[:, heads * head_dim :].view(tokens, kv_heads, head_dim)
    for pool_dtype in (dtype, torch.float16):
        kv = torch.randn(20, 2, kv_heads, head_dim, generator=g).to(pool_dtype).to(DEVICE)
        loc = torch.randperm(20, generator=g)[:tokens].to(DEVICE)
        want = kv.clone()
        want.view(20, -1).index_copy_(0, loc, torch.cat((k, v), dim=1).view(tokens, -1).to(pool_dtype))
        triton_attention.store_kv(kv, loc, k, v)
        assert torch.equal(kv, want)


def test_gpu_ops_take_every_argument_the_cpu_ops_take():
    """The models call one Ops interface: each method GpuOps overrides accepts the CPU Ops' parameters
    (a parameter added on the CPU side alone breaks every GPU step, and no CPU test runs GpuOps)."""
    import inspect

    for name, method in vars(triton_ops.GpuOps).items():
        base = getattr(Ops, name, None)
        if name.startswith("__") or not callable(method) or not callable(base):
            continue
        mine, theirs = inspect.signature(method).parameters, inspect.signature(base).parameters
        assert list(theirs) == list(mine)[: len(theirs)], \
            f"GpuOps.{name}{inspect.signature(method)} vs Ops.{name}{inspect.signature(base)}"


# Compiles every kernel as the GPU path launches it (row tables int64, req_to_token int32); run in
# a process of its own: under TRITON_INTERPRET the kernels are interpreter objects, not compilable.
_COMPILE_FOR_CUDA = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from worker_proc import triton_attention, triton_ops
dtype = sys.argv[1]
rows = dict.fromkeys(["row_start", "row_len", "row_prefix", "row_req", "dec_row", "dec_req", "dec_len"], "*i64")
attention = dict.fromkeys(["Q", "K", "V", "O"], "*" + dtype) | {"req_to_token": "*i32", "sm_scale": "fp32"} | rows
attention |= dict.fromkeys(["part_out", "part_lse"], "*fp32")
ops = dict.fromkeys(["X", "R", "W", "Y", "GU", "B"], "*" + dtype) | {"S": "*fp32", "eps": "fp32"}
precision = "ieee" if dtype == "fp32" else "tf32"
kernels = {  # kernel: (its pointer and float arguments, its constants); the rest are int32
    triton_attention._extend_kernel: (attention, dict(GROUP=3, HEAD_DIM=64, BLOCK_D=64, BLOCK_M=64, BLOCK_N=64,
                                                      CAUSAL_BLOCK=1, PRECISION=precision)),
    triton_attention._decode_split_kernel: (attention, dict(GROUP=3, BLOCK_H=16, HEAD_DIM=64, BLOCK_D=64, BLOCK_N=64,
                                                            PRECISION=precision)),
    triton_attention._decode_merge_kernel: (attention, dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_N=64)),
    triton_ops._add_rms_norm_kernel: (ops, dict(HAS_RESIDUAL=True, BLOCK=1024)),
    triton_ops._silu_mul_kernel: (ops, dict(BLOCK=1024)),
    triton_ops._rope_kernel: (ops | {"QKV": "*" + dtype, "positions": "*i64", "COS": "*fp32", "SIN": "*fp32"},
                              dict(BLOCK_H=16, BLOCK_D=32)),
    triton_attention._store_kv_kernel: (attention | {"KV": "*" + dtype, "out_cache_loc": "*i64"}, dict(BLOCK=256)),
    triton_ops._matmul_kernel: (ops, dict(HAS_SCALE=True, HAS_BIAS=True, PRECISION=precision, BLOCK_M=64, BLOCK_N=64,
                                          BLOCK_K=64)),
}
for kernel, (types, constants) in kernels.items():
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    triton.compile(ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in constants.items()}),
                   target=GPUTarget("cuda", 90, 32))
"""


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kernels_compile_for_a_cuda_gpu(dtype):
    """Every kernel through Triton's CUDA compiler (sm_90): the interpreter the other tests run
    under checks no types (an if/else that gives one name int32 and int64 runs there and fails
    to compile for a GPU)."""
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler", reason="this Triton has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_CUDA, dtype], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_fixed_tile_matmul_is_batch_invariant_and_matches_linear():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(70, 96, generator=g).to(DEVICE)
    w = torch.randn(80, 96, generator=g).to(DEVICE)
    bias = torch.randn(80, generator=g).to(DEVICE)
    y = triton_ops.matmul(x, w, bias)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, bias), atol=1e-4, rtol=1e-4)
    assert torch.equal(triton_ops.matmul(x[5:6], w, bias), y[5:6]), "row 5 alone differs from row 5 in the batch"
    q, scale = quantize_int8(w)
    expected = torch.nn.functional.linear(x, q.float() * scale[:, None])
    torch.testing.assert_close(triton_ops.matmul(x, q, None, scale), expected, atol=1e-3, rtol=1e-4)


def test_triton_backend_end_to_end_matches_the_torch_backend(tmp_path):
    """The model runner with --attention-backend triton (interpreted on the CPU): the same greedy
    tokens as the torch backend on a tiny GQA Llama, prompts batched together."""
    if DEVICE != "cpu":
        pytest.skip("the CUDA form is tests/test_gpu.py")
    from inproc import build_tiny_checkpoint, generate_greedy

    from worker_proc.model_runner import ModelRunner, RunnerConfig

    path = build_tiny_checkpoint("llama", tmp_path, seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 17, 40)]
    outs = []
    for backend in ("torch", "triton"):
        runner = ModelRunner(RunnerConfig(str(path), torch.float32, kv_cache_gb=0.01, max_running_requests=4,
                                          kernel_backend="torch", attention_backend=backend))
        assert type(runner.attn).__name__ == {"torch": "TorchAttention", "triton": "TritonAttention"}[backend]
        outs.append(generate_greedy(runner, prompts, 8, together=True))
    assert outs[0] == outs[1]


def test_gpu_flags_refuse_what_cannot_run_here(tmp_path):
    import launch
    from inproc import build_tiny_checkpoint

    from worker_proc.model_runner import ModelRunner, RunnerConfig

    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="no CUDA device"):
            launch.ServerArgs(device="cuda")
        assert launch.ServerArgs().device == "cpu"  # auto
    with pytest.raises(ValueError, match="mem_fraction_static"):
        launch.ServerArgs(mem_fraction_static=1.5)
    path = build_tiny_checkpoint("llama", tmp_path, seed=0)
    with pytest.raises(ValueError, match="enable-deterministic-inference"):
        ModelRunner(RunnerConfig(str(path), torch.float32, kv_cache_gb=0.01, max_running_requests=2,
                                 kernel_backend="torch", deterministic=True))
