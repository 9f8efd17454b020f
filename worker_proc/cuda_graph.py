"""CUDA graphs for decode steps: the model's forward for a batch of B one-token rows, captured
once per size B at start-up and replayed with new inputs, so a decode step costs one graph launch
instead of hundreds of kernel launches from Python.

A step of n decode rows replays the smallest captured size B >= n: the inputs are copied into
the graph's fixed buffers and the B - n rows past them are padding (token 0 at position 0,
writing its K/V to the scratch slot 0, attending over one position); their logits are dropped.
Only decode-only steps with at most `--cuda-graph-max-bs` rows replay; every other step runs
eagerly. Never used on the CPU.
"""

from __future__ import annotations

import logging

import torch
from tqdm import tqdm

log = logging.getLogger("loom.worker")


def capture_sizes(max_bs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8 up to max_bs (and max_bs)."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs + 1, 8))
    return sorted(set(sizes) | {max_bs})


class DecodeGraphs:
    def __init__(self, model, attn, max_bs: int, device: torch.device | str):
        self.model = model
        self.attn = attn
        self.sizes = capture_sizes(max_bs)
        self.max_bs = max_bs
        zeros = lambda: torch.zeros(max_bs, dtype=torch.int64, device=device)  # noqa: E731
        self.input_ids, self.positions, self.out_cache_loc, self.req_rows = zeros(), zeros(), zeros(), zeros()
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=device)
        self.token_rows = torch.arange(max_bs, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def padded_size(self, n: int) -> int:
        """The captured size a step of n decode rows replays (n <= max_bs)."""
        return next(b for b in self.sizes if b >= n)

    def _run(self, bs: int) -> torch.Tensor:
        self.attn.bind_decode(self.out_cache_loc[:bs], self.token_rows[:bs], self.req_rows[:bs], self.seq_lens[:bs])
        return self.model(self.input_ids[:bs], self.positions[:bs], self.attn, self.token_rows[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        memory_pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        # largest first: the smaller graphs reuse its memory from the shared pool
        for bs in tqdm(list(reversed(self.sizes)), desc="loom: capturing CUDA graphs", unit="graph"):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside the capture (Triton compiles, cuBLAS plans)
                for _ in range(2):
                    self._run(bs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory_pool, stream=stream):
                logits = self._run(bs)
            self.graphs[bs] = (graph, logits)
        torch.cuda.synchronize()
        log.info("CUDA graphs captured for decode batch sizes %s", self.sizes)

    def replay(self, bs: int, input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
               req_rows: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Logits [bs, V] of a decode step whose inputs (already padded to bs, on the device) are
        given."""
        self.input_ids[:bs].copy_(input_ids)
        self.positions[:bs].copy_(positions)
        self.out_cache_loc[:bs].copy_(out_cache_loc)
        self.req_rows[:bs].copy_(req_rows)
        self.seq_lens[:bs].copy_(seq_lens)
        graph, logits = self.graphs[bs]
        graph.replay()
        return logits
