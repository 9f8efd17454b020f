"""Attention over the paged KV pool for a packed batch that mixes prefills and decodes.

`PagedKernelAttention` runs loom's compiled kernel (worker_proc/cpu_kernels): every row of the
step in one call, reading K/V in place from the pool. `TorchAttention` is the pure-torch
backend: decodes (one new token per request) attend in one batched SDPA call over K/V gathered
through req_to_token and padded to the longest row; multi-token rows (prompts, chunks) attend
one request at a time with a causal mask.

Block-diffusion steps (ForwardBatch.block_size > 0) attend block-causally: a token sees every key
of the blocks before its own and all of its own block. The torch backend builds that mask; the
compiled kernel, whose rows are causal, gets one single-token row per query token whose key range
ends where the token's block ends (the decode path, reading the block's K/V, stored before any
row attends).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from worker_proc.forward_batch import ForwardBatch
from worker_proc.kv_cache import KVPool, dequantize_kv_rows, quantize_kv_rows


class AttentionBackend(Protocol):
    def prepare(self, batch: ForwardBatch) -> None: ...

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] of this step's tokens -> [T, H, D]."""
        ...


def store_kv(pool: KVPool, layer_id: int, out_cache_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Writes this step's K and V rows to their slots ([S, 2, KVH, Dh]: K then V per slot)."""
    kv = pool.kv[layer_id]
    rows = pool_rows(torch.cat((k, v), dim=1), kv.dtype)
    kv.view(kv.shape[0], -1).index_copy_(0, out_cache_loc, rows.view(len(k), -1))


def pool_rows(values: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """Values [..., D] as a pool of pool_dtype stores them ([..., D], or int8 [..., D + 4])."""
    return quantize_kv_rows(values) if pool_dtype == torch.int8 else values.to(pool_dtype)


def pool_values(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a pool ([..., D], or int8 [..., D + 4]) as values of dtype."""
    return dequantize_kv_rows(rows, dtype) if rows.dtype == torch.int8 else rows.to(dtype)


class PagedKernelAttention:
    def __init__(self, pool: KVPool, head_dim: int, kernels):
        self.pool = pool
        self.kernels = kernels
        self.scale = head_dim**-0.5

    def prepare(self, batch: ForwardBatch) -> None:
        self.out_cache_loc = batch.out_cache_loc
        if batch.block_size:
            block = batch.block_size
            per_token = batch.positions.numpy()
            self.rows = (torch.from_numpy(np.repeat(batch.req_pool_indices, batch.extend_lens)),
                         torch.arange(len(per_token), dtype=torch.int64),
                         torch.ones(len(per_token), dtype=torch.int64),
                         torch.from_numpy((per_token // block + 1) * block))
            return
        self.rows = tuple(torch.from_numpy(a) for a in (
            batch.req_pool_indices, batch.token_starts, batch.extend_lens, batch.prefix_lens + batch.extend_lens))

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k and v may be views of the fused qkv rows: the kernels read them in place
        self.kernels.store_kv(self.pool.kv[layer_id], self.out_cache_loc, k, v)
        return self.kernels.paged_attention(q, self.pool.kv[layer_id], self.pool.req_to_token, *self.rows, self.scale)

    def run_model(self, stack, input_ids: torch.Tensor, logit_rows: torch.Tensor, positions: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The whole model in one compiled call (cpu_kernels/layer_stack.cpp), attending as
        forward() does: logits of the token rows in logit_rows."""
        return stack.forward(input_ids, logit_rows, positions, cos, sin, self.pool.kv, self.out_cache_loc,
                             self.pool.req_to_token, *self.rows, self.scale)


class TorchAttention:
    def __init__(self, pool: KVPool, num_heads: int, head_dim: int):
        self.pool = pool
        self.num_heads = num_heads
        self.scale = head_dim**-0.5
        self.batch: ForwardBatch | None = None
        self.device = pool.req_to_token.device  # (the step's host tensors index it as they are)

    def prepare(self, batch: ForwardBatch) -> None:
        """Per-step work shared by every layer: the decode gather indices and padding mask."""
        self.batch = batch
        self.decode_slots = None
        self.decode_mask = None
        self.extend_slots: list[torch.Tensor | None] = []
        if len(batch.decode_tokens):
            max_len = int(batch.decode_seq_lens.max())
            self.decode_slots = self.pool.req_to_token[batch.decode_reqs, :max_len].long().view(-1)
            self.decode_shape = (len(batch.decode_tokens), max_len)
            if int(batch.decode_seq_lens.min()) != max_len:
                cols = torch.arange(max_len)
                self.decode_mask = (cols[None, :] < batch.decode_seq_lens[:, None])[:, None, None, :].to(self.device)
        for start, length, prefix, req in batch.extends:
            if prefix == 0 and not batch.block_size:
                self.extend_slots.append(None)
            else:
                self.extend_slots.append(self.pool.req_to_token[req, : prefix + length].long())
        # Rows of K and V side by side: a gather is one index_select of contiguous rows.
        self.row_view_shape = (self.pool.kv[0].shape[0], -1)

    def _decode_attention(self, q: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        """q [D, H, Dh] against gathered K/V [D, L, 2, KVH, Dh] -> [D, H, Dh]."""
        if q.dtype == torch.float32:
            return F.scaled_dot_product_attention(
                q.unsqueeze(2), gathered[:, :, 0].transpose(1, 2), gathered[:, :, 1].transpose(1, 2),
                attn_mask=self.decode_mask, scale=self.scale, enable_gqa=True).squeeze(2)
        # torch's CPU flash kernel is several times slower in bf16/fp16 for one query row;
        # two batched matmuls with a float32 softmax are not.
        d, kvh, dh = q.shape[0], gathered.shape[3], q.shape[2]
        q = q.view(d, kvh, -1, dh)
        scores = torch.matmul(q, gathered[:, :, 0].permute(0, 2, 3, 1)).float() * self.scale  # [D, KVH, G, L]
        if self.decode_mask is not None:
            scores.masked_fill_(~self.decode_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, gathered[:, :, 1].permute(0, 2, 1, 3)).view(d, -1, dh)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b = self.batch
        store_kv(self.pool, layer_id, b.out_cache_loc, k, v)
        kv = self.pool.kv[layer_id]
        kv_rows = kv.view(self.row_view_shape)
        n = len(b.decode_tokens)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if n:
            q_d = q[:n] if b.decode_is_prefix else q[b.decode_tokens]
            gathered = pool_values(kv_rows.index_select(0, self.decode_slots).view(*self.decode_shape, *kv.shape[1:]),
                                   q.dtype)
            o = self._decode_attention(q_d, gathered)  # gathered: [D, L, 2, KVH, Dh]
            if b.decode_is_prefix:
                out[:n] = o
            else:
                out[b.decode_tokens] = o
        for (start, length, prefix, _), slots in zip(b.extends, self.extend_slots):
            q_e = q[start : start + length].transpose(0, 1).unsqueeze(0)
            if slots is None:
                k_e = k[start : start + length].transpose(0, 1).unsqueeze(0)
                v_e = v[start : start + length].transpose(0, 1).unsqueeze(0)
                if kv.dtype != q.dtype:  # K/V as stored in a narrower pool, as every later step reads them
                    k_e, v_e = (pool_values(pool_rows(x, kv.dtype), q.dtype) for x in (k_e, v_e))
                o = F.scaled_dot_product_attention(q_e, k_e, v_e, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                full = pool_values(kv_rows.index_select(0, slots).view(len(slots), *kv.shape[1:]), q.dtype)  # [P+L, 2, KVH, Dh]
                k_e = full[:, 0].transpose(0, 1).unsqueeze(0)
                v_e = full[:, 1].transpose(0, 1).unsqueeze(0)
                cols = torch.arange(prefix + length, device=q.device)
                query_pos = torch.arange(length, device=q.device) + prefix
                if b.block_size:
                    mask = cols[None, :] // b.block_size <= query_pos[:, None] // b.block_size
                else:
                    mask = cols[None, :] <= query_pos[:, None]
                o = F.scaled_dot_product_attention(q_e, k_e, v_e, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[start : start + length] = o[0].transpose(0, 1)
        return out


class TritonAttention:
    """The Triton kernels over the pool: this step's decode rows in one split-K launch pair, its
    multi-token rows in one extend launch. The step's row tables go to the device through
    `staging` (one copy). `split_tokens` > 0 fixes the decode split length (deterministic mode:
    a row's reduction order then depends on its length only, never on the batch)."""

    def __init__(self, pool: KVPool, head_dim: int, staging, num_sms: int, split_tokens: int = 0,
                 causal_block: int = 1):
        from worker_proc import triton_attention

        if pool.kv[0].dtype == torch.int8:
            raise ValueError("--kv-cache-dtype int8 runs on the CPU attention kernels and the torch backend; the "
                             "Triton kernels read float pools (choose auto, bfloat16, float16 or float32)")
        self.kernels = triton_attention
        self.pool = pool
        self.staging = staging
        self.scale = head_dim**-0.5
        self.num_sms = num_sms
        self.num_kv_heads = pool.kv[0].shape[2]
        self.split_tokens = split_tokens
        # with fixed split lengths the grid covers the longest row the pool can hold
        self.fixed_splits = -(-pool.req_to_token.shape[1] // split_tokens) if split_tokens else 0
        self.causal_block = causal_block
        empty = torch.zeros(0, dtype=torch.int64, device=pool.req_to_token.device)
        self.ext_start = self.ext_len = self.ext_prefix = self.ext_req = empty
        self.max_extend = 0

    def decode_splits(self, num_rows: int) -> int:
        return self.fixed_splits or self.kernels.decode_splits(num_rows, self.num_kv_heads, self.num_sms)

    def prepare(self, batch: ForwardBatch) -> None:
        """batch.out_cache_loc must already be on the pool's device."""
        single = batch.extend_lens == 1
        dec, ext = np.flatnonzero(single), np.flatnonzero(~single)
        (self.dec_row, self.dec_req, self.dec_len, self.ext_start, self.ext_len, self.ext_prefix,
         self.ext_req) = self.staging.upload([
             batch.token_starts[dec], batch.req_pool_indices[dec], batch.prefix_lens[dec] + 1,
             batch.token_starts[ext], batch.extend_lens[ext], batch.prefix_lens[ext], batch.req_pool_indices[ext]])
        self.max_extend = int(batch.extend_lens[ext].max()) if len(ext) else 0
        self.num_splits = self.decode_splits(len(dec))
        self.out_cache_loc = batch.out_cache_loc

    def bind_decode(self, out_cache_loc: torch.Tensor, dec_row: torch.Tensor, dec_req: torch.Tensor,
                    dec_len: torch.Tensor) -> None:
        """A decode-only step over fixed buffers (a CUDA graph's: replays read what they hold)."""
        self.out_cache_loc, self.dec_row, self.dec_req, self.dec_len = out_cache_loc, dec_row, dec_req, dec_len
        self.ext_len = self.ext_len[:0]
        self.max_extend = 0
        self.num_splits = self.decode_splits(len(dec_row))

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv, r2t = self.pool.kv[layer_id], self.pool.req_to_token
        self.kernels.store_kv(kv, self.out_cache_loc, k, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self.kernels.decode_attention(q, kv, out, r2t, self.dec_row, self.dec_req, self.dec_len, self.scale,
                                      self.num_splits, self.split_tokens)
        self.kernels.extend_attention(q, kv, out, r2t, self.ext_start, self.ext_len, self.ext_prefix, self.ext_req,
                                      self.max_extend, self.scale, self.causal_block)
        return out
