"""Triton attention kernels over the paged KV pool (the GPU's attention backend).

Both kernels read K and V in place from a layer's pool tensor [slots, 2, KVH, Dh] through the
req_to_token rows (position -> slot), after this step's K/V rows are stored, so a prompt chunk
over a cached prefix and a whole prompt are the same case. Query heads are grouped over their KV
head (GQA: `group` query heads per KV head).

- `extend_attention`: multi-token rows (prompts, chunks). One program per (row, query head,
  block of BLOCK_M query tokens) walks the row's keys in BLOCK_N tiles with an online softmax.
  The mask is block-causal with `causal_block` B: a query at position p sees the keys at
  positions k with k // B <= p // B. B = 1 is the causal mask of a language model; a diffusion
  LLM denoising a block of B tokens (aligned to B) sees every committed token before its block
  and the whole block.
- `store_kv`: this step's K and V rows into their slots, one program per token (in place of a
  concatenation, a cast and an index copy: three launches a layer).
- `decode_attention`: one query token per row, split-K. Stage 1: one program per (row, KV head,
  split) computes its split's partial output and log-sum-exp for all query heads of the KV head
  at once; stage 2 merges the splits of each (row, head) in split order. The split length is
  either derived from the row's length and the step's split count (spreads a long row over the
  GPU's SMs) or fixed (`split_tokens`: deterministic mode, where a row's result must not depend
  on what else is in the batch).

Under `TRITON_INTERPRET=1` (set before this module is imported) the same kernels run on CPU
tensors through Triton's interpreter: that is how CI tests them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DECODE_BLOCK_N = 64  # keys per tile of the decode kernel; derived split lengths are multiples of it
MAX_DECODE_SPLITS = 16  # splits of a row when they are derived from the batch shape


@triton.jit
def _attend_keys(q, K, V, req_to_token, req, stride_r2t, kv_head, stride_ks, stride_kh, stride_vs, stride_vh,
                 offs_d, d_valid, sm_scale, lo, hi, q_block,
                 ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL_BLOCK: tl.constexpr,
                 PRECISION: tl.constexpr):
    """The query rows q [ROWS, BLOCK_D] over the keys [lo, hi) of request `req`, in BLOCK_N tiles
    with an online softmax: (unnormalized output, running max, running sum). CAUSAL_BLOCK > 0: a
    row sees the keys whose block is at most its q_block; 0: every key (q_block unused)."""
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < hi
        slot = tl.load(req_to_token + req * stride_r2t + offs_n, mask=n_valid, other=0).to(tl.int64)
        k = tl.load(K + slot[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None],
                    mask=n_valid[None, :] & d_valid[:, None], other=0.0).to(q.dtype)  # (a narrower pool: --kv-cache-dtype)
        scores = tl.dot(q, k, input_precision=PRECISION) * sm_scale
        if CAUSAL_BLOCK > 0:
            visible = ((offs_n // CAUSAL_BLOCK)[None, :] <= q_block[:, None]) & n_valid[None, :]
        else:
            visible = n_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        # every row sees the first key of its range, so m_new is finite from the first tile on
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                    mask=n_valid[:, None] & d_valid[None, :], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _extend_kernel(Q, K, V, O, req_to_token, row_start, row_len, row_prefix, row_req, sm_scale,
                   stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
                   stride_r2t,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, CAUSAL_BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    length = tl.load(row_len + row)
    if m_block * BLOCK_M >= length:
        return
    start = tl.load(row_start + row)
    prefix = tl.load(row_prefix + row)
    req = tl.load(row_req + row).to(tl.int64)
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < length
    d_valid = offs_d < HEAD_DIM
    q_rows = (start + offs_m).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    q_block = (prefix + offs_m) // CAUSAL_BLOCK

    # keys this tile can see: up to the end of its last query's block, within the row
    last_query = prefix + tl.minimum(m_block * BLOCK_M + BLOCK_M, length) - 1
    key_end = tl.minimum((last_query // CAUSAL_BLOCK + 1) * CAUSAL_BLOCK, prefix + length)

    acc, m_i, l_i = _attend_keys(q, K, V, req_to_token, req, stride_r2t, kv_head, stride_ks, stride_kh, stride_vs,
                                 stride_vh, offs_d, d_valid, sm_scale, 0, key_end, q_block,
                                 BLOCK_M, BLOCK_D, BLOCK_N, CAUSAL_BLOCK, PRECISION)
    out = acc / l_i[:, None]
    tl.store(O + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=m_valid[:, None] & d_valid[None, :])


@triton.jit
def _split_bounds(split, seq_len, num_splits, split_tokens, BLOCK_N: tl.constexpr):
    seq_len = seq_len.to(tl.int32)  # (both branches must give per_split one type: int64 lengths vs int32 split_tokens)
    if split_tokens > 0:
        per_split = split_tokens
    else:
        per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    return lo, tl.minimum(lo + per_split, seq_len)


@triton.jit
def _decode_split_kernel(Q, K, V, part_out, part_lse, req_to_token, dec_row, dec_req, dec_len, sm_scale,
                         num_splits, split_tokens,
                         stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_r2t,
                         stride_pr, stride_ph, stride_ps, stride_lr, stride_lh,
                         GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(dec_len + row)
    lo, hi = _split_bounds(split, seq_len, num_splits, split_tokens, BLOCK_N)
    if lo >= hi:
        return
    req = tl.load(dec_req + row).to(tl.int64)
    token = tl.load(dec_row + row).to(tl.int64)

    offs_h = tl.arange(0, BLOCK_H)
    h_valid = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    q = tl.load(Q + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_valid[:, None] & d_valid[None, :], other=0.0)

    acc, m_i, l_i = _attend_keys(q, K, V, req_to_token, req, stride_r2t, kv_head, stride_ks, stride_kh, stride_vs,
                                 stride_vh, offs_d, d_valid, sm_scale, lo, hi, offs_h,
                                 BLOCK_H, BLOCK_D, BLOCK_N, 0, PRECISION)
    tl.store(part_out + row * stride_pr + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :],
             acc / l_i[:, None], mask=h_valid[:, None] & d_valid[None, :])
    tl.store(part_lse + row * stride_lr + heads * stride_lh + split, m_i + tl.log(l_i), mask=h_valid)


@triton.jit
def _decode_merge_kernel(O, part_out, part_lse, dec_row, dec_len, num_splits, split_tokens,
                         stride_ot, stride_oh, stride_pr, stride_ph, stride_ps, stride_lr, stride_lh,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(dec_len + row)
    token = tl.load(dec_row + row).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for split in range(0, num_splits):  # in split order: the merge's rounding is fixed
        lo, hi = _split_bounds(split, seq_len, num_splits, split_tokens, BLOCK_N)
        if lo < hi:
            lse = tl.load(part_lse + row * stride_lr + head * stride_lh + split)
            part = tl.load(part_out + row * stride_pr + head * stride_ph + split * stride_ps + offs_d,
                           mask=d_valid, other=0.0)
            m_new = tl.maximum(m, lse)
            scale_old = tl.exp(m - m_new)
            scale_new = tl.exp(lse - m_new)
            acc = acc * scale_old + part * scale_new
            total = total * scale_old + scale_new
            m = m_new
    tl.store(O + token * stride_ot + head * stride_oh + offs_d, (acc / total).to(O.dtype.element_ty), mask=d_valid)


def _precision(dtype: torch.dtype) -> str:
    # float32 models keep float32 dot products (tf32 would cost them their parity with the reference)
    return "ieee" if dtype == torch.float32 else "tf32"


def extend_attention(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, req_to_token: torch.Tensor,
                     row_start: torch.Tensor, row_len: torch.Tensor, row_prefix: torch.Tensor, row_req: torch.Tensor,
                     max_len: int, sm_scale: float, causal_block: int = 1, block_m: int = 64,
                     block_n: int = 64) -> None:
    """Writes out[t] for the tokens of every multi-token row: q/out [T, H, Dh] (views allowed:
    unit stride on Dh), kv the layer's pool [slots, 2, KVH, Dh]; per row its first token row,
    length, prefix length and req_to_token row (int tensors on q's device); max_len the longest
    row's length."""
    num_rows = row_len.shape[0]
    if num_rows == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    k, v = kv[:, 0], kv[:, 1]
    grid = (num_rows, num_heads, triton.cdiv(max_len, block_m))
    _extend_kernel[grid](
        q, k, v, out, req_to_token, row_start, row_len, row_prefix, row_req, sm_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // kv.shape[2], HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL_BLOCK=causal_block, PRECISION=_precision(q.dtype))


@triton.jit
def _store_kv_kernel(K, V, KV, out_cache_loc, stride_k, stride_v, stride_slot, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(out_cache_loc + row).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < n_cols
    k = tl.load(K + row * stride_k + cols, mask=valid)
    v = tl.load(V + row * stride_v + cols, mask=valid)
    tl.store(KV + slot * stride_slot + cols, k.to(KV.dtype.element_ty), mask=valid)
    tl.store(KV + slot * stride_slot + n_cols + cols, v.to(KV.dtype.element_ty), mask=valid)


def store_kv(kv: torch.Tensor, out_cache_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """kv[out_cache_loc[t]] = (k[t], v[t]) in the pool's dtype: kv the layer's pool [slots, 2, KVH,
    Dh], k/v [T, KVH, Dh] (views of the fused qkv rows allowed: unit stride within a row)."""
    t, n = k.shape[0], k.shape[1] * k.shape[2]
    k, v = (x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous() for x in (k, v))
    if t:
        _store_kv_kernel[(t,)](k, v, kv, out_cache_loc, k.stride(0), v.stride(0), kv.stride(0), n,
                               BLOCK=triton.next_power_of_2(n))


def decode_splits(num_rows: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per row that give the GPU about two programs per SM (from the batch shape only, so a
    captured graph and an eager step of the same size split alike)."""
    return max(1, min(MAX_DECODE_SPLITS, triton.cdiv(2 * num_sms, max(1, num_rows * num_kv_heads))))


def decode_attention(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, req_to_token: torch.Tensor,
                     dec_row: torch.Tensor, dec_req: torch.Tensor, dec_len: torch.Tensor, sm_scale: float,
                     num_splits: int, split_tokens: int = 0) -> None:
    """Writes out[dec_row[i]] for every decode row i (its query q[dec_row[i]] against the first
    dec_len[i] positions of req_to_token row dec_req[i]). `num_splits` splits per row, each
    dec_len / num_splits tokens long (rounded up to the tile), or with `split_tokens` > 0 each
    split_tokens long (then num_splits must cover the longest row)."""
    num_rows = dec_len.shape[0]
    if num_rows == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv.shape[2]
    group = num_heads // num_kv_heads
    k, v = kv[:, 0], kv[:, 1]
    part_out = torch.empty(num_rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_rows, num_heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(num_rows, num_kv_heads, num_splits)](
        q, k, v, part_out, part_lse, req_to_token, dec_row, dec_req, dec_len, sm_scale, num_splits, split_tokens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), req_to_token.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=DECODE_BLOCK_N, PRECISION=_precision(q.dtype))
    _decode_merge_kernel[(num_rows, num_heads)](
        out, part_out, part_lse, dec_row, dec_len, num_splits, split_tokens,
        out.stride(0), out.stride(1), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=DECODE_BLOCK_N)
