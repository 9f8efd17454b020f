"""Host memory the kernel may back with 2 MiB pages (transparent huge pages, asked for with
madvise). Decode streams hundreds of MB a step (all weights at small batch, the KV pool at large
batch): with 4 KiB pages a TLB miss comes every 64 cache lines, and a weight split over hundreds
of small allocations restarts the stream at each one."""

from __future__ import annotations

import math
import mmap
from typing import Sequence

import torch

HUGE_PAGE = 2 << 20
_ALIGN = 64  # a cache line: every packed tensor starts on one, as the kernels' loads expect


def zeros_on_huge_pages(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 CPU tensor of nbytes, huge-page aligned. Falls back to plain memory where
    madvise(MADV_HUGEPAGE) does not exist."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # anonymous memory starts zeroed
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + nbytes]


def zeros_tensor_on_huge_pages(shape: Sequence[int], dtype: torch.dtype, prefault: bool = False) -> torch.Tensor:
    """prefault: touch every page now (the kernel maps and zeroes it) rather than on the first
    write of a step; in a VM the host may have to back each page too."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    region = zeros_on_huge_pages(nbytes)
    if prefault and nbytes:
        region[::4096].zero_()
    return region.view(dtype).view(tuple(shape))


def pack_on_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (CPU, any dtypes) laid out one after another, in the given order, in one
    huge-page region: a pass that reads them in that order streams one contiguous range."""
    offsets, end = [], 0
    for t in tensors:
        end += -end % _ALIGN
        offsets.append(end)
        end += t.nbytes
    region = zeros_on_huge_pages(end)
    packed = []
    for t, offset in zip(tensors, offsets):
        view = region[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        packed.append(view)
    return packed
