"""Block diffusion in the simulator: what the worker's rounds (worker_proc/dllm.py) would answer a
diffusion step, without a model. The scheduling is the core's own (scheduler_proc/dllm.py plans
the steps and applies these results); only how many rounds a block needs is modelled: each new
block draws its rounds uniformly from [low, high] (a trained model with LowConfidence at 0.95
typically needs a quarter to a half of the block size; the live server's `dllm_rounds` over
`dllm_blocks_committed` in /get_server_info is the figure to give it).

The rounds of one step follow the worker's modes:
  sync           rounds until every block of the step is done (the slowest block sets the step);
  FDFO, re-loop  rounds until some block is done: those commit, the others keep what is left;
  FDFO alone     one round per step.
The first round computes the step's rows as planned (committed tokens not yet in the KV, then
the block); later rounds only the unfinished blocks, each over its block_size positions.
"""

from __future__ import annotations

import numpy as np

from ipc.messages import DllmResult


class BlockRounds:
    def __init__(self, low: int, high: int, seed: int = 0):
        if not 1 <= low <= high:
            raise ValueError(f"rounds per block: need 1 <= low <= high, got {low}, {high}")
        self.low, self.high = low, high
        self.rng = np.random.default_rng(seed)
        # request -> (its block: start, retractions), rounds that block still needs
        self.left: dict[str, tuple[tuple[int, int], int]] = {}

    def run(self, batch, predictor) -> tuple[float, DllmResult]:
        """The step's duration (the predictor over each round's shape) and the worker's answer."""
        block = batch.dllm_block_size
        rows = batch.rows
        starts = [r.prefix_len + r.extend_len - block for r in rows]
        keys = [(s, r.req.retractions) for s, r in zip(starts, rows)]  # (a retracted block starts over)
        left = []
        for r, key in zip(rows, keys):
            known = self.left.get(r.req.rid)
            left.append(known[1] if known is not None and known[0] == key
                        else int(self.rng.integers(self.low, self.high, endpoint=True)))
        if not batch.dllm_fdfo:
            rounds = max(left)
        elif batch.dllm_reloop:
            rounds = min(left)
        else:
            rounds = 1
        seconds = predictor.seconds(batch)
        block_rounds = len(rows)
        for k in range(1, rounds):  # later rounds: the blocks not done after k rounds
            active = [s for s, n in zip(starts, left) if n > k]
            block_rounds += len(active)
            pairs = sum(block * (s + (block + 1) * 0.5) for s in active)
            seconds += predictor.seconds_of_shape((block * len(active), block * len(active), pairs, 0, len(active)))
        done = [n <= rounds for n in left]
        for r, key, n, d in zip(rows, keys, left, done):
            if d:
                self.left.pop(r.req.rid, None)
            else:
                self.left[r.req.rid] = (key, n - rounds)
        ids = np.ones(block, dtype=np.int32).tobytes()  # placeholders (requests end at their length)
        return seconds, DllmResult(blocks=[ids] * len(rows), accept_lens=[block if d else 0 for d in done],
                                   algo_states=[None] * len(rows), rounds=rounds, block_rounds=block_rounds)
