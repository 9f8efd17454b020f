"""Block-diffusion rounds in the worker: runs a DllmStep (ipc/messages.py) over the model and
the KV pool, with the algorithm picked by --dllm-algorithm (dllm_algorithms.py).

The first round runs the rows as the scheduler sent them: each row's committed tokens whose KV
is not computed yet (a new request's whole prompt blocks, the block that finished last step)
and its block being denoised, in one block-causal forward. Later rounds in the same step run
only the blocks, on the same KV slots (their K/V is rewritten in place each round):
  sync (fdfo False): rounds go on until every block is done; a done block leaves the rounds;
  fdfo with reloop: rounds go on while no block is done, and the step returns at the first
    round where some block is done (no scheduler round-trip for rounds that finish nothing);
  fdfo without reloop: one round per step.
With tensor parallelism rank 0 runs the algorithm and shares each round's ids and done flags.
"""

from __future__ import annotations

import numpy as np
import torch

from ipc.messages import DllmResult, ModelWorkerBatch
from worker_proc.dllm_algorithms import DLLM_ALGORITHMS, DllmAlgoConfig, DllmBlocks
from worker_proc.forward_batch import ForwardBatch


class DllmRunner:
    def __init__(self, runner, algorithm: str, config: DllmAlgoConfig):
        self.runner = runner
        self.config = config
        self.algorithm = DLLM_ALGORITHMS.make(algorithm, config)
        self.rounds = 0  # forward rounds run since start

    def run(self, batch: ModelWorkerBatch) -> DllmResult | None:
        """The step's rounds; None on tensor-parallel ranks other than 0."""
        step, r = batch.dllm, self.runner
        block = step.block_size
        assert block == self.config.block_size, (block, self.config.block_size)
        fb = ForwardBatch.from_worker_batch(batch)
        if batch.prefix_tables:
            r._apply_prefix_tables(batch, fb)
        r.pool.record(fb.req_pool_indices, fb.prefix_lens, fb.extend_lens, fb.token_starts, fb.slots)
        n = len(fb.extend_lens)
        block_starts = fb.prefix_lens + fb.extend_lens - block
        rows_of_blocks = fb.logit_rows.numpy().reshape(n, block)
        block_slots = fb.slots[rows_of_blocks]  # [N, B]
        req_pool_indices = fb.req_pool_indices
        positions = torch.from_numpy(block_starts)[:, None] + torch.arange(block)[None, :]
        prompt_lens = torch.tensor(batch.prompt_lens, dtype=torch.int64)
        blocks = DllmBlocks(ids=fb.input_ids[fb.logit_rows].view(n, block).clone(),
                            prompt_mask=positions < prompt_lens[:, None],
                            block_starts=torch.from_numpy(block_starts), sampling=list(batch.sampling))
        leader = r.tp.rank == 0
        states = list(step.algo_states)
        if leader:
            states = [s if s is not None else self.algorithm.init_state(blocks.prompt_mask[i].tolist())
                      for i, s in enumerate(states)]
        done = [False] * n
        active = list(range(n))
        rounds = block_rounds = 0
        while True:
            r.attn.prepare(fb)
            logits = r.model(fb.input_ids, fb.positions, r.attn, fb.logit_rows)
            rounds += 1
            block_rounds += len(active)
            idx = torch.tensor(active, dtype=torch.int64)
            sub = DllmBlocks(blocks.ids[idx], blocks.prompt_mask[idx], blocks.block_starts[idx],
                             [blocks.sampling[i] for i in active])
            if leader:
                finished = self.algorithm.step(sub, logits.view(len(active), block, -1), [states[i] for i in active])
            else:
                finished = [False] * len(active)
            if r.tp.size > 1:  # every rank's next round needs rank 0's ids and verdicts
                shared = r.tp.broadcast_ids(sub.ids.reshape(-1).tolist() + [int(f) for f in finished],
                                            len(active) * (block + 1))
                sub.ids = torch.tensor(shared[: len(active) * block], dtype=torch.int64).view(len(active), block)
                finished = [bool(f) for f in shared[len(active) * block :]]
            blocks.ids[idx] = sub.ids
            for i, f in zip(active, finished):
                done[i] = f
            if step.fdfo:
                if any(done) or not step.reloop:
                    break
            elif all(done):
                break
            active = [i for i in range(n) if not done[i]]
            a = np.asarray(active)
            fb = ForwardBatch.blocks_only(req_pool_indices[a], block_starts[a], block, block_slots[a].reshape(-1),
                                          blocks.ids[torch.from_numpy(a)])
        self.rounds += rounds
        if not leader:
            return None
        ids = blocks.ids.to(torch.int32).numpy()
        return DllmResult(blocks=[ids[i].tobytes() for i in range(n)],
                          accept_lens=[block if d else 0 for d in done],
                          algo_states=[None if d else s for d, s in zip(done, states)], rounds=rounds,
                          block_rounds=block_rounds)
