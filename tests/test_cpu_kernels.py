"""loom's compiled CPU kernels against their torch references: paged attention (gather +
SDPA), the fused element-wise ops (`Ops` without kernels) and the small-M linears (dense, int8,
int4 against their dequantized weights). `kernel` (conftest) is each build this CPU runs."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from worker_proc import cpu_kernels
from worker_proc.ops import (Ops, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8)


_V3 = "avx avx2 fma f16c bmi1 bmi2 abm movbe"
_V4 = _V3 + " avx512f avx512bw avx512cd avx512dq avx512vl"


@pytest.mark.parametrize("march,flags,tested", [
    ("znver3", _V3, ["native", "scalar"]),  # native runs avx2's paths: tested once, as native
    # Zen 4's paths (AVX-512 with VNNI and BF16) as GCC 12 knows them: it predates -march=znver4
    ("cooperlake", _V4 + " avx512_vnni avx512_bf16", ["native", "avx512", "avx2", "scalar"]),
    ("sapphirerapids", _V4 + " avx512_vnni avx512_bf16 amx_tile", ["native", "avx512", "avx2", "scalar"]),
    ("haswell", "avx avx2 fma f16c", ["native", "scalar"]),  # lacks movbe in cpuinfo: no portable avx2
], ids=["zen3", "zen4", "xeon-spr", "no-movbe"])
def test_the_levels_each_cpu_kind_tests(monkeypatch, march, flags, tested):
    """Which builds the suite runs on each CPU kind, from its cpuinfo flags and what the compiler
    makes of -march=<that CPU> (as -march=native would there)."""
    if cpu_kernels._macros(march) is None:
        pytest.skip("the compiler did not list its target macros")
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: set(flags.split()))
    monkeypatch.setitem(cpu_kernels._MARCH, "native", march)
    assert cpu_kernels.distinct_levels() == tested


def test_each_build_runs_the_code_paths_of_its_level(kernel, request):
    level = request.node.callspec.params["kernel"]
    predicted = cpu_kernels.target_macros(level)
    if predicted is None:
        pytest.skip("the compiler did not list its target macros")
    assert set(kernel.target_macros()) == predicted
    if level == "scalar":
        assert not predicted
    if level in ("avx2", "avx512"):
        assert {"__AVX2__", "__FMA__", "__F16C__"} <= predicted
        assert ("__AVX512F__" in predicted) == (level == "avx512")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 16), (4, 2, 128), (6, 2, 24),
                                                    (20, 1, 16), (64, 1, 32), (3, 1, 18)])
def test_paged_attention_matches_reference(kernel, dtype, tol, heads, kv_heads, head_dim):
    """Rows of one token (decodes), whole prompts and chunks over a cached prefix, in one call."""
    torch.manual_seed(0)
    slots, reqs, ctx = 4000, 12, 300
    kv = torch.randn(slots, 2, kv_heads, head_dim, dtype=dtype)
    req_to_token = torch.randint(1, slots, (reqs, ctx), dtype=torch.int32)
    req_idx = torch.randperm(reqs)[:8]
    extend_lens = torch.tensor([1, 37, 1, 300, 1, 6, 17, 1])
    prefix_lens = torch.tensor([299, 0, 0, 0, 130, 250, 40, 16])
    seq_lens = prefix_lens + extend_lens
    token_starts = torch.cumsum(extend_lens, 0) - extend_lens
    q = torch.randn(int(extend_lens.sum()), heads, head_dim, dtype=dtype)
    out = kernel.paged_attention(q, kv, req_to_token, req_idx, token_starts, extend_lens, seq_lens, head_dim**-0.5)
    _check_against_sdpa(kv, req_to_token, req_idx, q, out, token_starts, extend_lens, prefix_lens, tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 16)])
def test_few_decode_rows_split_across_threads_match_reference(kernel, dtype, tol, heads, kv_heads, head_dim):
    """One or two long decodes: each row's cached tokens are split into parts that are merged."""
    torch.manual_seed(1)
    kv = torch.randn(2000, 2, kv_heads, head_dim, dtype=dtype)
    req_to_token = torch.randint(1, 2000, (4, 1000), dtype=torch.int32)
    for lens in ([1000], [700, 129]):
        req_idx = torch.arange(len(lens))
        extend_lens = torch.ones(len(lens), dtype=torch.int64)
        prefix_lens = torch.tensor(lens) - 1
        token_starts = torch.arange(len(lens))
        q = torch.randn(len(lens), heads, head_dim, dtype=dtype)
        out = kernel.paged_attention(q, kv, req_to_token, req_idx, token_starts, extend_lens, prefix_lens + 1,
                                     head_dim**-0.5)
        _check_against_sdpa(kv, req_to_token, req_idx, q, out, token_starts, extend_lens, prefix_lens, tol)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (16, 2, 64)])
def test_decode_rows_over_runs_of_consecutive_slots_match_reference(kernel, heads, kv_heads, head_dim):
    """bfloat16 decodes whose slots lie in runs of 16 consecutive ones (read in place by the AMX
    path) mixed with scattered ones (copied), short and long rows (split into parts), and scores
    that grow along the context (the AMX path's reference max moves and rescales its sums)."""
    torch.manual_seed(2)
    slots = 6000
    kv = torch.randn(slots, 2, kv_heads, head_dim).bfloat16()
    lens = [1, 15, 16, 17, 200, 333, 1000, 2048]
    table = torch.randint(1, slots, (len(lens), 2048), dtype=torch.int32)
    table[:, :1024] = (torch.arange(1024, dtype=torch.int32) + 1 + 64 * torch.arange(len(lens))[:, None]).int()
    table[:, 1024:1040] = 3000  # past the runs: a group of one repeated slot
    growth = torch.linspace(0, 4, 2048)[:, None, None]  # later keys align more and more with q
    kv[table[-1].long(), 0] = (kv[table[-1].long(), 0].float() + growth * torch.ones(head_dim)).bfloat16()
    for rows in (lens, lens[-2:]):
        idx = torch.tensor([lens.index(n) for n in rows])
        extend_lens = torch.ones(len(rows), dtype=torch.int64)
        prefix_lens = torch.tensor(rows) - 1
        token_starts = torch.arange(len(rows))
        q = (torch.randn(len(rows), heads, head_dim) + 0.5).bfloat16()
        out = kernel.paged_attention(q, kv, table, idx, token_starts, extend_lens, prefix_lens + 1, head_dim**-0.5)
        _check_against_sdpa(kv, table, idx, q, out, token_starts, extend_lens, prefix_lens, 2e-2)


@pytest.mark.parametrize("dtype,kv_dtype,tol", [(torch.float32, torch.float16, 1e-5), (torch.float32, torch.bfloat16, 1e-5),
                                              (torch.bfloat16, torch.float16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 16), (3, 1, 18)])
def test_paged_attention_over_a_narrower_pool(kernel, dtype, kv_dtype, tol, heads, kv_heads, head_dim):
    """--kv-cache-dtype: q in the model's dtype, K/V read from a 16-bit pool; every row kind (split
    decodes included) computes as over the pool's values in float32."""
    torch.manual_seed(2)
    slots, reqs, ctx = 3000, 6, 900
    kv = torch.randn(slots, 2, kv_heads, head_dim).to(kv_dtype)
    req_to_token = torch.randint(1, slots, (reqs, ctx), dtype=torch.int32)
    req_idx = torch.tensor([4, 0, 2, 5])
    extend_lens = torch.tensor([1, 33, 1, 7])
    prefix_lens = torch.tensor([899, 0, 64, 300])
    token_starts = torch.cumsum(extend_lens, 0) - extend_lens
    q = torch.randn(int(extend_lens.sum()), heads, head_dim).to(dtype)
    for rows in ([0], [0, 1, 2, 3]):  # one long decode alone: split across the threads
        r, q_rows, starts, out = _attend_rows(kernel, rows, q, kv, req_to_token, req_idx, token_starts, extend_lens,
                                              prefix_lens)
        assert out.dtype == dtype
        _check_against_sdpa(kv, req_to_token, req_idx[r], q_rows, out, starts, extend_lens[r], prefix_lens[r], tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128), (8, 2, 16), (3, 1, 18)])
def test_paged_attention_over_an_int8_pool(kernel, dtype, heads, kv_heads, head_dim):
    """--kv-cache-dtype int8: store_kv quantizes each head row as quantize_kv_rows does, and every
    row kind (split decodes, prompts, chunks over a prefix) attends as over the dequantized values
    (bfloat16 steps round the dequantized values to bfloat16, and decodes on VNNI builds take q as
    two rows of int8 codes: hence the looser bound there)."""
    from worker_proc.kv_cache import dequantize_kv_rows, quantize_kv_rows

    torch.manual_seed(3)
    slots, reqs, ctx = 3000, 6, 900
    values = torch.randn(slots, 2, kv_heads, head_dim) * torch.rand(slots, 1, kv_heads, 1) * 3
    values[7] = 0  # an all-zero row: scale 0
    kv = torch.zeros(slots, 2, kv_heads, head_dim + 4, dtype=torch.int8)
    kernel.store_kv(kv, torch.arange(slots, dtype=torch.int32), values[:, 0].to(dtype), values[:, 1].to(dtype))
    expected = quantize_kv_rows(values.to(dtype).float())
    assert (kv.view(torch.uint8) != expected.view(torch.uint8)).float().mean() < 1e-3  # (ties may round apart)
    dequantized = dequantize_kv_rows(kv, torch.float32)
    torch.testing.assert_close(dequantized, values.to(dtype).float(), atol=values.abs().max() / 250, rtol=0)
    req_to_token = torch.randint(1, slots, (reqs, ctx), dtype=torch.int32)
    req_to_token[0, :40] = 7
    req_idx = torch.tensor([4, 0, 2, 5, 1])
    extend_lens = torch.tensor([1, 33, 1, 7, 1])
    prefix_lens = torch.tensor([899, 0, 64, 300, 15])
    token_starts = torch.cumsum(extend_lens, 0) - extend_lens
    q = (torch.randn(int(extend_lens.sum()), heads, head_dim) * 2).to(dtype)
    kernel_exact = "__AVX512VNNI__" not in kernel.target_macros()
    for rows in ([0], [0, 1, 2, 3, 4]):  # one long decode alone: split across the threads
        r, q_rows, starts, out = _attend_rows(kernel, rows, q, kv, req_to_token, req_idx, token_starts, extend_lens,
                                              prefix_lens)
        assert out.dtype == dtype
        _check_against_sdpa(dequantized, req_to_token, req_idx[r], q_rows, out, starts, extend_lens[r],
                            prefix_lens[r], (1e-4 if kernel_exact else 3e-3) if dtype == torch.float32 else 1e-1)


def _attend_rows(kernel, rows, q, kv, req_to_token, req_idx, token_starts, extend_lens, prefix_lens):
    """paged_attention over the batch rows `rows` alone: (their index tensor, q rows, starts, output)."""
    r = torch.tensor(rows)
    starts = torch.cumsum(extend_lens[r], 0) - extend_lens[r]
    q_rows = torch.cat([q[token_starts[i] : token_starts[i] + extend_lens[i]] for i in rows])
    out = kernel.paged_attention(q_rows, kv, req_to_token, req_idx[r], starts, extend_lens[r],
                                 prefix_lens[r] + extend_lens[r], q.shape[-1] ** -0.5)
    return r, q_rows, starts, out


def _check_against_sdpa(kv, req_to_token, req_idx, q, out, token_starts, extend_lens, prefix_lens, tol):
    seq_lens = prefix_lens + extend_lens
    for r in range(len(req_idx)):
        rows = kv[req_to_token[req_idx[r], : seq_lens[r]].long()].float()
        start, n, prefix = int(token_starts[r]), int(extend_lens[r]), int(prefix_lens[r])
        visible = torch.arange(prefix + n)[None, :] <= (prefix + torch.arange(n))[:, None]
        ref = F.scaled_dot_product_attention(q[start : start + n].transpose(0, 1)[None].float(),
                                             rows[:, 0].transpose(0, 1)[None], rows[:, 1].transpose(0, 1)[None],
                                             attn_mask=visible, enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[start : start + n].float(), ref, atol=tol, rtol=tol)


# ---- fused element-wise ops --------------------------------------------------------------------

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_fused_norms_and_activation_match_torch(kernel, dtype, tol):
    torch.manual_seed(0)
    fast, ref = Ops(kernel), Ops()
    x, residual = torch.randn(7, 576, dtype=dtype), torch.randn(7, 576, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(576)).to(dtype)
    torch.testing.assert_close(fast.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5), atol=tol, rtol=tol)
    out_ref, res_ref = ref.add_rms_norm(x, residual.clone(), weight, 1e-5)
    res = residual.clone()
    out, res_out = fast.add_rms_norm(x, res, weight, 1e-5)
    assert res_out is res  # updated in place
    torch.testing.assert_close(res, res_ref, atol=0, rtol=0)
    torch.testing.assert_close(out, out_ref, atol=tol, rtol=tol)
    gate_up = torch.randn(5, 2 * 1536, dtype=dtype)
    torch.testing.assert_close(fast.silu_mul(gate_up), ref.silu_mul(gate_up), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rope_in_place_matches_torch(kernel, dtype, tol):
    torch.manual_seed(0)
    heads, kv_heads, head_dim, positions = 9, 3, 64, torch.tensor([0, 5, 17, 1000, 3])
    angles = torch.arange(2048, dtype=torch.float32)[:, None] * torch.rand(head_dim // 2)[None]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    a, b = qkv.clone(), qkv.clone()
    Ops(kernel).rope_(a, positions, cos, sin, heads + kv_heads, head_dim)
    Ops().rope_(b, positions, cos, sin, heads + kv_heads, head_dim)
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    v = slice((heads + kv_heads) * head_dim, None)
    assert torch.equal(a[:, v], qkv[:, v])  # v untouched


# ---- small-M linears ---------------------------------------------------------------------------

@pytest.mark.parametrize("m", [5, 7, 16, 17, 18, 23, 47, 53, 200, 512, 515])
@pytest.mark.parametrize("n,k", [(960, 576), (45, 1536), (33, 64), (40, 72), (7, 64)])
def test_dense_float32_linear_at_every_row_count(kernel, m, n, k):
    """float32 linear_dense on as many rows as Ops hands it (dense_f32_rows), past it too: the
    blocked-dot and packed-panel paths of AVX2 builds, with row counts and output sizes that leave
    partial tiles (m % 3, m % 6, n % 4, n % 16) and a last chunk of inputs that is not whole cache lines."""
    torch.manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k), torch.randn(n, k) * 0.05
    torch.testing.assert_close(kernel.linear_dense(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 8, 9, 13, 17, 32, 200, 515])
@pytest.mark.parametrize("n,k", [(960, 576), (45, 1536), (40, 72), (7, 64)])
def test_dense_float32_linear_on_weights_packed_at_load(kernel, m, n, k):
    """linear_dense on pack_dense_f32's panels of 16 rows (AVX2) or 32 (AVX-512), at any row count
    (7, 8, 9, 13, 32, 200: AVX2 builds split their last 7 to 9 rows into two tiles), the last rows
    that fill no panel from w, where the build packs; elsewhere pack_dense_f32 is empty and
    linear_dense takes w as before."""
    torch.manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k), torch.randn(n, k) * 0.05
    packed = kernel.pack_dense_f32(w)
    if packed.numel():
        width = packed.shape[-1]
        assert width in (16, 32) and packed.shape == (n // width, k, width)
        # panel p, input j, row r = w[width p + r, j]
        assert torch.equal(packed[-1, :, 3], w[(n // width - 1) * width + 3])
    elif kernel.dense_f32_rows() and n >= 16 and k % 8 == 0:
        pytest.fail("this build has float32 panels: the weight should have been packed")
    torch.testing.assert_close(kernel.linear_dense(x, w, packed), F.linear(x, w), atol=1e-4, rtol=1e-5)



@pytest.mark.parametrize("n,k", [(960, 576), (45, 1536), (40, 72)])
def test_dense_float32_rows_do_not_depend_on_the_step(kernel, n, k):
    """A row's output is the same bits whatever else is in the step: large steps on AVX2 builds
    read x re-laid in tiles' strips, smaller ones its rows, in the same order of products."""
    torch.manual_seed(n + k)
    x, w = torch.randn(601, k), torch.randn(n, k) * 0.05
    packed = kernel.pack_dense_f32(w)
    whole = kernel.linear_dense(x, w, packed)
    for rows in (slice(0, 200), slice(401, 601), slice(37, 43)):
        assert torch.equal(kernel.linear_dense(x[rows], w, packed), whole[rows])

@pytest.mark.parametrize("m", [1, 5, 12, 13, 14, 15, 16, 17, 26, 31, 32, 33, 100, 300])
@pytest.mark.parametrize("n,k", [(960, 576), (64, 1536), (32, 32), (45, 576), (64, 72)])
def test_bfloat16_linear_on_packed_weights(kernel, m, n, k):
    """linear_dense on pack_dense_bf16's weights: on AMX tiles, row counts that leave one or two
    partial row tiles (m % 16, m % 32) and pass a chunk of 256 rows; by vdpbf16ps elsewhere, row
    counts that leave a partial block of 12 (1 to 3 rows: with the full block before it, split in
    two). Only builds with AMX (on a CPU that grants it) or
    AVX512-BF16 pack (N and K multiples of 32); elsewhere the pack is empty and linear_dense keeps
    its other paths."""
    torch.manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k).bfloat16(), (torch.randn(n, k) * 0.05).bfloat16()
    packed = kernel.pack_dense_bf16(w)
    if not (kernel.packed_bf16_rows() and n % 32 == 0 and k % 32 == 0):
        assert packed.numel() == 0
        if not kernel.packed_bf16_rows():
            pytest.skip("no bfloat16 products (AMX tiles or AVX512-BF16) in this build or on this CPU")
        return
    assert ("__AMX_BF16__" if kernel.amx_bf16() else "__AVX512BF16__") in kernel.target_macros()
    assert packed.shape == (n // 32, k // 32, 2, 16, 32)
    # column block b, input block kb, column tile t, input pair p, 2 c + e = W[32 b + 16 t + c, 32 kb + 2 p + e]
    assert packed[-1, 0, 1, 3, 2 * 5 + 1] == w[n - 32 + 16 + 5, 2 * 3 + 1]
    y = kernel.linear_dense(x, w, packed)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # float32 sums rounded once to bfloat16: within one bfloat16 rounding of the exact product
    torch.testing.assert_close(y.float(), F.linear(x.double(), w.double()).bfloat16().float(), atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("m", [1, 14, 16, 17, 33, 300])
@pytest.mark.parametrize("inter,k", [(1536, 576), (16, 64), (48, 96), (40, 64)])
def test_gated_packed_linear_is_silu_of_gate_times_up(kernel, m, inter, k):
    """pack_dense_bf16(gated=True) of an MLP's [gate; up]: linear_dense returns silu(gate) * up,
    bit for bit what the unfused linear and silu_mul give (it rounds where they round). An
    intermediate size that is no multiple of 16 is not packed gated."""
    if not kernel.packed_bf16_rows():
        pytest.skip("no bfloat16 products (AMX tiles or AVX512-BF16) in this build or on this CPU")
    torch.manual_seed(m * 1000 + inter)
    x, w = torch.randn(m, k).bfloat16(), (torch.randn(2 * inter, k) / 8).bfloat16()
    gated = kernel.pack_dense_bf16(w, gated=True)
    if inter % 16:
        assert gated.numel() == 0
        return
    assert gated.shape == (inter // 16, k // 32, 2, 16, 16, 2)
    last = inter // 16 - 1  # block, input block, up tile, input pair, column, parity
    assert gated[last, 0, 1, 0, 3, 1] == w[inter + 16 * last + 3, 1]
    y = kernel.linear_dense(x, w, gated)
    assert y.shape == (m, inter)
    assert torch.equal(y, kernel.silu_mul(kernel.linear_dense(x, w, kernel.pack_dense_bf16(w))))


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 4, 6, 9])
@pytest.mark.parametrize("n,k", [(960, 576), (45, 1536), (7, 64)])
def test_small_m_linears_match_dequantized_reference(kernel, dtype, tol, m, n, k):
    torch.manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k) * 0.05
    scale_tol = dict(atol=tol * 4, rtol=tol)
    dense = w.to(dtype)
    torch.testing.assert_close(kernel.linear_dense(x, dense), F.linear(x.float(), dense.float()).to(dtype), **scale_tol)
    int8_acts = k % 64 == 0 and kernel.quantized_int8_activations(dtype)
    q8, s8 = quantize_int8(w)
    w8 = dequantize_int8(q8, s8, torch.float32)
    torch.testing.assert_close(kernel.linear_int8(x, q8, s8), F.linear(x.float(), w8).to(dtype), **scale_tol)
    if int8_acts:  # the integer GEMM's panels (n = 45, 7: a part-padded last panel)
        packed = kernel.pack_int8(q8)
        torch.testing.assert_close(kernel.linear_int8(x, packed, s8), F.linear(_int8_per_group(x.float()), w8).to(dtype),
                                   **scale_tol)
        assert torch.equal(kernel.dequantize_int8(packed, s8, torch.float32), w8)
    q4, s4, m4 = quantize_int4(w)
    torch.testing.assert_close(kernel.linear_int4(x, q4, s4, m4),
                               _int4_reference(x.float(), q4, s4, m4, int8_acts).to(dtype), **scale_tol)


@pytest.mark.parametrize("m", [1, 2, 3, 7, 13, 64])
@pytest.mark.parametrize("n,k", [(960, 576), (45, 1536), (33, 71), (7, 64)])
def test_half_linear_on_float16_weights(kernel, m, n, k):
    """linear_half on pack_half's panels (16 columns x input pairs, zero-padded past N and K): the
    float16 weights times x, partial tiles of rows and panels, an odd K. AVX512-FP16 builds round x
    to float16 and sum 128 pairs at a time in float16 (error ~1.6e-3 of |y|); others are float32 sums."""
    torch.manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k), torch.randn(n, k) * 0.05
    packed = kernel.pack_half(w)
    assert packed.dtype == torch.float16 and packed.shape == ((n + 15) // 16, (k + 1) // 2, 16, 2)
    assert torch.equal(packed[-1, 5, (n - 1) % 16], w[n - 1, 10:12].half())  # panel p, pair j, column c
    w16 = w.half().double()
    y = kernel.linear_half(x, packed, n)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    if kernel.half_products():
        ref = F.linear(x.half().double(), w16)
        assert ((y - ref).abs().sum() / ref.abs().sum()).item() < 2.5e-3  # a bfloat16 linear: 2.8e-3
    else:
        torch.testing.assert_close(y.double(), F.linear(x.double(), w16), atol=1e-4, rtol=1e-5)
    y16 = kernel.linear_half(x.bfloat16(), packed, n)  # bfloat16 activations: a bfloat16 result
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), F.linear(x.bfloat16().float(), w.half().float()), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("rows", [1, 8, 9, 40])
def test_half_linear_module_takes_the_kernel_where_it_pays(kernel, rows):
    """HalfLinear through Ops: the kernel for every row count where it multiplies in float16, for
    up to small_m_rows elsewhere (more rows widen the weights once for torch's GEMM); the same
    product either way, and the layout unpacks to the float16 weights."""
    from worker_proc.linear import HalfLinear

    torch.manual_seed(rows)
    w, x = torch.randn(45, 200) * 0.05, torch.randn(rows, 200)
    ops = Ops(kernel, small_m_rows=8)
    linear = HalfLinear(w, None, ops)
    assert torch.equal(linear.dequantized(torch.float32), w.half().float())
    assert ops.half_rows == (sys.maxsize if kernel.half_products() else 8)
    ref = F.linear(x.double(), w.half().double())
    assert ((linear(x) - ref).abs().sum() / ref.abs().sum()).item() < 2.5e-3


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("m", [1, 4, 9, 35])
@pytest.mark.parametrize("n,k", [(960, 576), (45, 1536), (7, 96), (33, 160)])
def test_int4_panels_match_the_int8_activation_reference(kernel, dtype, tol, m, n, k):
    """The integer GEMM on pack_int4_panels' layout: 16 features a panel on AVX2 builds, 32 on
    AVX512-VNNI ones (n = 45, 33, 7: a part-padded last one), any number of groups (96, 160: odd
    counts), x rounded to int8 per group of 32; linear_int4 takes it above one row, the same product
    (bfloat16 x on AMX from amx_panel_rows() rows: the tiles over the widened weights instead)."""
    if not kernel.integer_panels():
        pytest.skip("this build has no integer panels (no AVX2)")
    torch.manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k) * 0.05
    q4, s4, m4 = quantize_int4(w)
    panels = kernel.pack_int4_panels(q4, s4, m4)
    cols = panels.shape[2] // 24  # a group: 16 bytes of codes and two float32 a feature
    lanes = cols // 2
    assert cols in (16, 32) and panels.shape == ((n + cols - 1) // cols, k // 32, 24 * cols)
    # feature n - 1, group 1, element 13: part 1 (elements 8-15), byte 13 - 8 - 4 of its lane, high nibble
    groups = q4.view(n, k // 32, 16)
    codes = torch.cat((groups & 0xF, groups >> 4), dim=-1)  # [n, group, element] (GGUF: e, e + 16 share a byte)
    f = n - 1
    lane_byte = panels[f // cols, 1, (f % cols) // lanes * 16 * lanes + 4 * lanes + (f % lanes) * 4 + 1]
    assert lane_byte >> 4 == codes[f, 1, 13] and lane_byte & 0xF == codes[f, 1, 9]
    y = kernel.linear_int4_panels(x, panels, n)
    assert y.dtype == dtype and y.shape == (m, n)
    ref = _int4_reference(x.float(), q4, s4, m4, True)
    torch.testing.assert_close(y.float(), ref, atol=tol * 20, rtol=tol * 2)
    if m > 1:
        direct = kernel.linear_int4(x, q4, s4, m4, panels)
        assert torch.equal(direct, kernel.linear_panels_amx(x, panels, n) if _takes_amx_tiles(kernel, x, n) else y)


def _takes_amx_tiles(kernel, x: torch.Tensor, n: int) -> bool:
    """Whether linear_int8 / linear_int4 multiply x on AMX tiles over the widened panels (bfloat16
    x of amx_panel_rows() rows or more, n a multiple of 32; test_quantization checks their bits)."""
    rows = kernel.amx_panel_rows()
    return x.dtype == torch.bfloat16 and 0 < rows <= x.shape[0] and n % 32 == 0


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("m", [1, 4, 9, 35])
@pytest.mark.parametrize("n,k", [(960, 576), (45, 1536), (7, 96), (33, 160)])
def test_int8_panels_match_the_int8_activation_reference(kernel, dtype, tol, m, n, k):
    """int8 weights: pack_int8 lays them out in the integer GEMM's panels (16 features on AVX2
    builds, 32 on AVX512-VNNI ones stored + 128 as uint8; part-padded last ones; odd group counts),
    linear_int8 takes them at every row count with x rounded to int8 per group of 32 (bfloat16 x on
    AMX from amx_panel_rows() rows: the tiles over the widened weights), and dequantize_int8 reads
    them back exactly."""
    if not kernel.integer_panels():
        pytest.skip("this build has no integer panels (no AVX2)")
    torch.manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k) * 0.05
    q8, s8 = quantize_int8(w)
    panels = kernel.pack_int8(q8)
    cols = panels.shape[2] // 32
    lanes, offset = cols // 2, 128 if panels.dtype == torch.uint8 else 0
    assert (cols, panels.dtype) in ((16, torch.int8), (32, torch.uint8))
    assert panels.shape == ((n + cols - 1) // cols, k // 32, 32 * cols)
    f, g, e = n - 1, 2, 13  # group 2, input 13: step 3, byte 1; feature f: vector (f % cols) // lanes, lane f % lanes
    code = panels[f // cols, g, 3 * 8 * lanes + (f % cols) // lanes * 4 * lanes + (f % lanes) * 4 + 1]
    assert int(code) - offset == q8[f, 32 * g + e]
    w8 = dequantize_int8(q8, s8, torch.float32)
    assert torch.equal(kernel.dequantize_int8(panels, s8, torch.float32), w8)
    y = kernel.linear_int8(x, panels, s8)
    assert y.dtype == dtype and y.shape == (m, n)
    if _takes_amx_tiles(kernel, x, n):
        assert torch.equal(y, kernel.linear_panels_amx(x, panels, n, s8))
    else:
        torch.testing.assert_close(y.float(), F.linear(_int8_per_group(x.float()), w8), atol=tol * 20, rtol=tol * 2)


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_integer_panels_rows_do_not_depend_on_the_step(kernel, scheme):
    """A row's output is the same bits whatever else is in the step: x lies in the tiles' strips,
    whose tails of 1-3 rows are tiles of their own."""
    if not kernel.integer_panels():
        pytest.skip("this build has no integer panels (no AVX2)")
    torch.manual_seed(7)
    x, w = torch.randn(603, 160), torch.randn(45, 160) * 0.05
    if scheme == "int4":
        q4, s4, m4 = quantize_int4(w)
        panels = kernel.pack_int4_panels(q4, s4, m4)
        linear = lambda rows: kernel.linear_int4_panels(rows, panels, 45)  # noqa: E731
    else:
        q8, s8 = quantize_int8(w)
        panels = kernel.pack_int8(q8)
        linear = lambda rows: kernel.linear_int8(rows, panels, s8)  # noqa: E731
    whole = linear(x)
    for rows in (slice(0, 200), slice(401, 603), slice(598, 603), slice(37, 43)):
        assert torch.equal(linear(x[rows]), whole[rows])


def _int4_reference(x, q4, s4, m4, int8_acts: bool) -> torch.Tensor:
    """x @ W.T for the dequantized int4 W = codes * scale + min. With int8 activations (integer dot
    products) the codes term sees x rounded to int8 per group of 32; the min term sees x itself."""
    w = dequantize_int4(q4, s4, m4, torch.float32)
    if not int8_acts:
        return F.linear(x, w)
    mins = m4.float().repeat_interleave(32, dim=1)
    return F.linear(_int8_per_group(x), w - mins) + F.linear(x, mins)


def _int8_per_group(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 per group of 32 with scale max|x| / 127 (llama.cpp's Q8 activations),
    in the kernels' float32 arithmetic: q = round(x * (127 / max|x|))."""
    g = x.view(len(x), -1, 32)
    top = g.abs().amax(-1, keepdim=True)
    return (torch.round(g * (127 / top.clamp_min(1e-30))) * (top / 127)).view_as(x)


def test_quantization_round_trip_error_is_bounded():
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    q8, s8 = quantize_int8(w)
    assert (dequantize_int8(q8, s8, torch.float32) - w).abs().le(s8[:, None] / 2 + 1e-6).all()
    q4, s4, m4 = quantize_int4(w)
    err = (dequantize_int4(q4, s4, m4, torch.float32) - w).view(64, 8, 32).abs()
    # half a step, plus what rounding the stored scale and min to float16 moves the grid
    assert err.le(s4.float()[..., None] * (0.5 + 16 * 2**-10) + 1e-3 * m4.float().abs()[..., None]).all()
    # a grid already on 16 levels comes back exactly (as weights dequantized from GGUF Q4_1 do)
    step, low = 2.0**-7, -0.0625  # exact in float16, as GGUF's scales and mins are
    levels = torch.randint(0, 16, (8, 64)).float() * step + low
    levels[:, ::32] = low  # every group spans the full 0..15 range
    levels[:, 1::32] = low + 15 * step
    q4, s4, m4 = quantize_int4(levels)
    torch.testing.assert_close(dequantize_int4(q4, s4, m4, torch.float32), levels, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_kernels_match_torch(kernel, dtype):
    torch.manual_seed(0)
    w = torch.randn(96, 320)
    q8, s8 = quantize_int8(w)
    torch.testing.assert_close(kernel.dequantize_int8(q8, s8, dtype), dequantize_int8(q8, s8, dtype))
    q4, s4, m4 = quantize_int4(w)
    torch.testing.assert_close(kernel.dequantize_int4(q4, s4, m4, dtype), dequantize_int4(q4, s4, m4, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_matches_torch(kernel, dtype):
    torch.manual_seed(0)
    x = torch.randn(7, 3001).to(dtype)
    x[1, 5] = x[1, 2900] = 100.0  # a tie: the first index wins
    x[2] = float("-inf")
    x[3, 3000] = 50.0  # in the last, partial chunk
    x[4, 1024:2048] = 75.0  # a run of equal maxima starting at a chunk boundary
    assert torch.equal(kernel.argmax_rows(x), torch.argmax(x, dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv_from_fused_rows_matches_index_copy(kernel, dtype, slot_dtype):
    """K and V read in place from views of fused qkv rows, and attention over a strided q."""
    heads, kv_heads, head_dim, rows = 6, 2, 16, 5
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(rows, q_size + 2 * kv_size).to(dtype)
    q = qkv[:, :q_size].view(rows, heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(rows, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(rows, kv_heads, head_dim)
    kv, want = torch.zeros(11, 2, kv_heads, head_dim, dtype=dtype), torch.zeros(11, 2, kv_heads, head_dim, dtype=dtype)
    slots = torch.tensor([3, 7, 1, 10, 4], dtype=slot_dtype)
    kernel.store_kv(kv, slots, k, v)
    want.view(11, -1).index_copy_(0, slots.long(), qkv[:, q_size:])
    assert torch.equal(kv, want)
    # one request whose 5 tokens are a prompt over those slots: strided q gives contiguous q's result
    req_to_token = torch.zeros(1, 8, dtype=torch.int32)
    req_to_token[0, :rows] = slots.int()
    lens = (torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
            torch.full((1,), rows, dtype=torch.int64), torch.full((1,), rows, dtype=torch.int64))
    got = kernel.paged_attention(q, kv, req_to_token, *lens, head_dim**-0.5)
    torch.testing.assert_close(got, kernel.paged_attention(q.contiguous(), kv, req_to_token, *lens, head_dim**-0.5))
    with pytest.raises(RuntimeError, match="slot out of the pool"):
        kernel.store_kv(kv, torch.tensor([0, 1, 2, 3, 11], dtype=slot_dtype), k, v)


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                            (torch.bfloat16, torch.float16)])
def test_store_kv_rounds_rows_into_a_narrower_pool(kernel, dtype, kv_dtype):
    """Rows of the model's dtype become the pool's, rounded to nearest as torch's .to() rounds (32
    dims: the vector body; 18: its tail too)."""
    for head_dim in (32, 18):
        k, v = torch.randn(7, 3, head_dim).to(dtype) * 30, torch.randn(7, 3, head_dim).to(dtype)
        kv, want = torch.zeros(9, 2, 3, head_dim, dtype=kv_dtype), torch.zeros(9, 2, 3, head_dim, dtype=kv_dtype)
        slots = torch.tensor([8, 1, 5, 2, 7, 3, 6])
        kernel.store_kv(kv, slots, k, v)
        want.view(9, -1).index_copy_(0, slots, torch.cat((k, v), dim=1).view(7, -1).to(kv_dtype))
        assert torch.equal(kv, want)
    with pytest.raises(RuntimeError, match="store_kv"):  # a wider pool than the rows: refused
        kernel.store_kv(torch.zeros(9, 2, 3, 32), slots, k.half(), v.half())


def test_auto_dtype_times_the_linear_the_model_runs(kernel, monkeypatch):
    import re

    from worker_proc import dtype_probe
    from worker_proc.linear import Linear

    assert dtype_probe.resolve_dtype("float32", "cpu", kernel) == (torch.float32, "dtype float32 (asked for)")
    with pytest.raises(ValueError, match="bfloat16"):
        dtype_probe.resolve_dtype("fp8", "cpu", kernel)
    timed = []  # the layers the probe timed: loom's Linear, its weight packed as at load
    pack = Linear.pack_weight
    monkeypatch.setattr(Linear, "pack_weight", lambda self: (pack(self), timed.append(self)))
    dtype, why = dtype_probe.resolve_dtype("auto", "cpu", kernel)
    assert [layer.weight.dtype for layer in timed] == [torch.float32, torch.bfloat16] and "on loom's kernels" in why
    if kernel.packed_bf16_rows():  # (AMX or AVX512-BF16) what a bfloat16 model's linears run on
        assert timed[1].packed is not None and timed[1].packed.numel() > 0
    fp32, bf16 = map(float, re.findall(r"float32 ([\d.]+) ms, bfloat16 ([\d.]+) ms", why)[0])
    assert dtype == (torch.bfloat16 if bf16 < 0.9 * fp32 else torch.float32)
    assert "torch's GEMM" in dtype_probe.resolve_dtype("auto", "cpu", None)[1]


class _Bf16Products:
    def packed_bf16_rows(self):
        return 1 << 62


def test_auto_dtype_survives_one_slow_round(monkeypatch):
    """A bfloat16 call that lost its core at start-up (8 ms where it takes 0.2) does not decide."""
    from worker_proc import dtype_probe

    monkeypatch.setattr(dtype_probe, "_linear_call", lambda dtype, kernels: dtype)
    rounds = iter([1.5e-3, 8e-3, 1.5e-3, 0.2e-3] + [1.5e-3, 0.2e-3] * (dtype_probe.PROBE_ROUNDS - 2))
    monkeypatch.setattr(dtype_probe, "best_seconds", lambda call, give_up_above=None: next(rounds))
    dtype, why = dtype_probe.resolve_dtype("auto", "cpu", _Bf16Products())
    assert dtype == torch.bfloat16 and "bfloat16 0.20 ms" in why


@pytest.mark.parametrize("has_products", [True, False])
def test_auto_dtype_probes_again_where_bf16_products_lost(monkeypatch, has_products):
    """Every first round slow for bfloat16 (the host busy): where the kernels have bfloat16
    products the probe goes on after a pause and finds them; where they have none it does not
    wait."""
    from worker_proc import dtype_probe

    monkeypatch.setattr(dtype_probe, "_linear_call", lambda dtype, kernels: dtype)
    monkeypatch.setattr(dtype_probe, "RETRY_PAUSE_S", 0.0)
    busy = 2 * dtype_probe.PROBE_ROUNDS  # calls of best_seconds in the first attempt
    calls = []

    def best_seconds(dtype, give_up_above=None):
        calls.append(dtype)
        if dtype == torch.float32:
            return 1.5e-3
        return 4e-3 if len(calls) <= busy else 0.2e-3

    monkeypatch.setattr(dtype_probe, "best_seconds", best_seconds)
    kernels = _Bf16Products() if has_products else type("NoProducts", (), {"packed_bf16_rows": lambda self: 0})()
    dtype, why = dtype_probe.resolve_dtype("auto", "cpu", kernels)
    if has_products:
        assert dtype == torch.bfloat16 and "bfloat16 0.20 ms" in why and len(calls) == 2 * busy
    else:
        assert dtype == torch.float32 and "bfloat16 4.00 ms" in why and len(calls) == busy


@pytest.mark.parametrize("ranks", [2, 3])
def test_shared_memory_all_reduce_sums_in_rank_order_on_every_rank(kernel, ranks):
    """Ranks as threads over one region: calls of many sizes back to back (each slot set is reused
    two calls later), tensors larger than a slot in pieces as TPGroup.all_reduce cuts them; every
    rank gets the same bits, the float32 sum in rank order."""
    from concurrent.futures import ThreadPoolExecutor

    from worker_proc.huge_pages import zeros_on_huge_pages

    region = zeros_on_huge_pages(64 * ranks + 2 * ranks * 4096)
    slot = kernel.shared_reduce_slot_bytes(region, ranks)
    assert slot == 4096
    g = torch.Generator().manual_seed(ranks)
    shapes = [(3, 7), (1, 576), (0, 5), (2, 512), (1,), (5, 100), (1024,), (3000,)] * 3
    calls = [[torch.randn(s, generator=g).to(dtype) for _ in range(ranks)]
             for s in shapes for dtype in (torch.float32, torch.bfloat16)]
    results = [[x.clone() for x in parts] for parts in calls]

    def rank_loop(rank):
        seq = 0
        for parts in results:
            x = parts[rank].view(-1)
            step = slot // x.element_size()
            for begin in range(0, x.numel(), step):
                seq += 1
                kernel.shared_memory_all_reduce(region, rank, ranks, seq, x[begin : begin + step])

    with ThreadPoolExecutor(ranks) as pool:
        list(pool.map(rank_loop, range(ranks)))
    for parts, outs in zip(calls, results):
        want = parts[0].float()
        for p in parts[1:]:
            want = want + p.float()
        for out in outs:
            assert torch.equal(out, want.to(out.dtype))


def test_shared_memory_exchange_hands_every_rank_each_ranks_tensor(kernel):
    """Ranks as threads: each call returns every rank's tensor (its shape and dtype), the sets
    alternating as in the all-reduce; the views are read before the rank's next call."""
    from concurrent.futures import ThreadPoolExecutor

    from worker_proc.huge_pages import zeros_on_huge_pages

    ranks = 3
    region = zeros_on_huge_pages(64 * ranks + 2 * ranks * 4096)
    g = torch.Generator().manual_seed(0)
    calls = [[torch.randint(-1000, 1000, (n, 4), generator=g, dtype=torch.int64) for _ in range(ranks)]
             for n in (1, 0, 64, 3, 128, 7)] * 2 + [[torch.randn(2, 100, generator=g) for _ in range(ranks)]]

    def rank_loop(rank):
        seen = []
        for seq, parts in enumerate(calls, start=1):
            seen.append([p.clone() for p in kernel.shared_memory_exchange(region, rank, ranks, seq, parts[rank])])
        return seen

    with ThreadPoolExecutor(ranks) as pool:
        for seen in pool.map(rank_loop, range(ranks)):
            for got, parts in zip(seen, calls):
                assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, parts))
