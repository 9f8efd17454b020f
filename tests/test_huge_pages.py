"""The weights' huge-page region and the KV pool's pages mapped at start (worker_proc/huge_pages.py)."""

from __future__ import annotations

import psutil
import torch
from torch import nn

from worker_proc.huge_pages import HUGE_PAGE, move_to_huge_pages, zeros_tensor_on_huge_pages


def test_moved_tensors_keep_identity_and_values_and_lie_in_order_in_one_region():
    layers = nn.ModuleList([nn.Linear(100, 37), nn.Linear(37, 5, bias=False)])
    layers[0].register_buffer("panels", torch.randn(3, 7))
    tensors = [layers[1].weight, layers[0].panels, layers[0].weight, layers[0].bias]
    before = [t.detach().clone() for t in tensors]
    ids = [id(t) for t in tensors]
    move_to_huge_pages(tensors)
    assert [id(t) for t in (layers[1].weight, layers[0].panels, layers[0].weight, layers[0].bias)] == ids
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))
    starts = [t.data_ptr() for t in tensors]
    assert starts == sorted(starts) and all(s % 64 == 0 for s in starts)
    assert starts[-1] + tensors[-1].nbytes - starts[0] < HUGE_PAGE  # one range, in the order given
    assert isinstance(layers[1].weight, nn.Parameter) and layers[1].weight.requires_grad


def test_a_prefaulted_pool_is_mapped_at_once_and_a_plain_one_on_first_write():
    process, nbytes = psutil.Process(), 64 << 20
    rss = process.memory_info().rss
    lazy = zeros_tensor_on_huge_pages((nbytes // 4,), torch.float32)
    assert process.memory_info().rss - rss < nbytes // 4
    rss = process.memory_info().rss
    mapped = zeros_tensor_on_huge_pages((nbytes // 4,), torch.float32, prefault_now=True)
    assert process.memory_info().rss - rss >= nbytes * 0.95
    assert not mapped.any() and not lazy.any()
