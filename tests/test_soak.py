"""The long soak (`python -m pytest -m reliability tests/test_soak.py -s`): 2,000 streamed
requests at concurrency 64 against a server per variant (the default; --dp-size 2; the normal
loop instead of overlap; no prefix cache), with 30% of clients leaving mid-stream and random
aborts by request id. Nothing lost, nothing leaked, and each process's memory flat between the
two halves of the run. LOOM_SOAK_REQUESTS changes the count. CI runs the short form in
tests/test_reliability.py."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from soak import leaks, soak, wait_idle
from test_server import Server

REQUESTS = int(os.environ.get("LOOM_SOAK_REQUESTS", "2000"))
RSS_NOISE_MB = 64  # growth between the halves beyond this (and 10%) counts as a leak

VARIANTS = {
    "default": (),
    "dp2": ("--dp-size", "2"),
    "normal-loop": ("--disable-overlap-schedule",),
    "no-radix-cache": ("--disable-radix-cache",),
}


@pytest.mark.reliability
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_long_soak(variant):
    s = Server("--max-running-requests", "64", "--kv-cache-gb", "0.5", "--context-length", "512", *VARIANTS[variant])
    try:
        report, _ = asyncio.run(soak(s.url, s.proc.pid, n=REQUESTS, concurrency=64, seed=7, max_tokens=48,
                                     greedy_prompts=32))

        async def idle_stats():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as client:
                return await wait_idle(client)

        stats = asyncio.run(idle_stats())
        print(f"\nsoak {variant}: {report.summary()}")
        assert report.lost == [] and report.greedy_mismatches == []
        assert leaks(stats) == []
        for name, (_, half, end) in report.rss_mb.items():
            assert end - half <= max(RSS_NOISE_MB, 0.1 * half), f"{name} grew {half:.0f} -> {end:.0f} MB"
    finally:
        s.stop()
