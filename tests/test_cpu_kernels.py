"""The compiled paged decode attention equals the pure-torch path (gather + SDPA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_proc import cpu_kernels


@pytest.fixture(scope="module")
def kernel():
    k = cpu_kernels.load()
    if k is None:
        pytest.skip("no C++ compiler here: the torch attention path is used instead")
    return k


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 16)])
def test_paged_decode_matches_reference(kernel, dtype, tol, heads, kv_heads, head_dim):
    torch.manual_seed(0)
    slots, reqs, ctx, batch = 4000, 12, 300, 7
    kv = torch.randn(slots, 2, kv_heads, head_dim, dtype=dtype)
    req_to_token = torch.randint(1, slots, (reqs, ctx), dtype=torch.int32)
    req_idx = torch.randperm(reqs)[:batch]
    seq_lens = torch.randint(1, ctx + 1, (batch,))
    q = torch.randn(batch, heads, head_dim, dtype=dtype)
    out = kernel.paged_decode_attention(q, kv, req_to_token, req_idx, seq_lens, head_dim**-0.5)
    for b in range(batch):
        rows = kv[req_to_token[req_idx[b], : seq_lens[b]].long()].float()
        ref = F.scaled_dot_product_attention(q[b : b + 1, :, None].float(), rows[:, 0].transpose(0, 1)[None],
                                             rows[:, 1].transpose(0, 1)[None], enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(out[b].float(), ref, atol=tol, rtol=tol)
