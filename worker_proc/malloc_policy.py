"""glibc malloc's handling of large blocks, tuned for a CPU worker's activations.

A prompt-sized step allocates and frees tens of MB a tensor (a 4,096-row step's MLP output alone is
50 MB). glibc serves every block over its mmap threshold (at most 32 MB) with freshly mapped pages
and unmaps them on free, and gives the heap's free top back to the kernel past 128 KB: so each
step faulted its activations in again, page by page (in a VM, each fault also goes to the host).
Kept for reuse instead, a 4,096-token prefill step ran 1.2x faster and a 32,768-token one 1.46x
(a Cascade Lake Xeon; docs/performance-notes.md).
The memory held is the largest step's working set, which the next such step needs again."""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

# mallopt's parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 2**31 - 1  # (an int: give back only a free heap top past 2 GB)


def keep_freed_memory() -> bool:
    """Has malloc serve large blocks from its heap and keep what is freed there (mallopt: no mmap
    for blocks, no trimming of the heap's top). False where the C library has no mallopt or
    refuses (not glibc); allocation then works as before."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    kept = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    if not kept:
        log.debug("mallopt refused: large blocks keep their own mappings")
    return kept
