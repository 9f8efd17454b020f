"""Host memory the kernel may back with 2 MiB pages (transparent huge pages, asked for with
madvise). Decode streams hundreds of MB a step (all weights at small batch, the KV pool at large
batch): with 4 KiB pages a TLB miss comes every 64 cache lines, and a weight split over hundreds
of small allocations restarts the stream at each one."""

from __future__ import annotations

import math
import mmap
from concurrent.futures import ThreadPoolExecutor
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


def prefault(region: torch.Tensor) -> None:
    """Touches every page of a fresh uint8 region now (the kernel maps and zeroes it) rather than
    on the first write of a step. In a VM the host may have to back each page too: a fresh 2 MiB
    page took ~7.5 ms on AMD Zen 3 (3.8 s a GB, 4 KiB pages 0.65), and the faults of separate
    pages run in parallel (two threads 1.9-2.1 s a GB), so each thread touches its own pages."""
    parts = max(1, min(torch.get_num_threads(), region.numel() // HUGE_PAGE))
    bounds = [i * region.numel() // parts // HUGE_PAGE * HUGE_PAGE for i in range(parts)] + [region.numel()]
    touch = [region[a:b:4096] for a, b in zip(bounds, bounds[1:])]
    if parts == 1:
        touch[0].zero_()
        return
    with ThreadPoolExecutor(parts) as pool:  # (torch's ops release the GIL)
        list(pool.map(torch.Tensor.zero_, touch))


def zeros_tensor_on_huge_pages(shape: Sequence[int], dtype: torch.dtype, prefault_now: bool = False) -> torch.Tensor:
    """prefault_now: map every page at once (prefault), not on a step's first write."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    region = zeros_on_huge_pages(nbytes)
    if prefault_now and nbytes:
        prefault(region)
    return region.view(dtype).view(tuple(shape))


def move_to_huge_pages(tensors: Sequence[torch.Tensor]) -> None:
    """Moves `tensors` (CPU parameters or buffers, any dtypes) into one huge-page region, one after
    another in the given order: a pass that reads them in that order streams one contiguous range.
    Each tensor keeps its identity (ties hold) and takes its copy at once, so its old storage goes
    as the region fills: the peak stays near the region's size, not twice it (fresh pages are most
    of a start-up's time in a VM)."""
    offsets, end = [], 0
    for t in tensors:
        end += -end % _ALIGN
        offsets.append(end)
        end += t.nbytes
    region = zeros_on_huge_pages(end)
    prefault(region)
    for t, offset in zip(tensors, offsets):
        view = region[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t.detach())
        t.data = view
