"""Large blocks reuse freed heap memory in the CPU worker (worker_proc/malloc_policy.py)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# In a fresh interpreter: where a large activation lies, and how many pages a step-like round of
# large allocations faults in once a round before it has been freed, before and after
# keep_freed_memory().
_PROBE = """
import json, resource, torch
from worker_proc.malloc_policy import keep_freed_memory

def in_heap(t):
    p = t.data_ptr()
    for line in open("/proc/self/maps"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= p < hi:
            return line.rstrip().endswith("[heap]")
    return False

def step():  # a prompt step's activations: written, then freed together
    held = [torch.ones(mb << 20, dtype=torch.uint8) for mb in (9, 16, 50, 25, 9)]
    return in_heap(held[2])

def faults_on_reuse():
    step()
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    return step(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

plain = faults_on_reuse()
kept = keep_freed_memory()
print(json.dumps({"plain": plain, "kept": kept, "after": faults_on_reuse()}))
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_a_freed_large_block_is_reused_without_faulting_its_pages_in_again():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, cwd=ROOT)
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["plain"][0] is False  # glibc's default: a mapping of its own, unmapped on free
    assert result["kept"] is True
    in_heap, faults = result["after"]
    assert in_heap and faults < 256, result  # (the round writes 109 MB: ~28,000 small pages)
