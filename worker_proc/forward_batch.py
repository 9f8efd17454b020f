"""The worker's view of one step: tensors built from a ModelWorkerBatch, and (`HostStaging`) how
its per-step tables reach a GPU."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ipc.messages import ModelWorkerBatch


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64
    slots: np.ndarray  # the same, int32
    logit_rows: torch.Tensor  # token rows whose logits are sampled
    # single-token rows (decodes) attend in one batched call
    decode_tokens: torch.Tensor  # [D] token rows
    decode_reqs: torch.Tensor  # [D] req_to_token rows
    decode_seq_lens: torch.Tensor  # [D]
    decode_is_prefix: bool  # decode tokens are rows [0, D): slice instead of gather
    # multi-token rows (prefills, chunks): (token_start, length, prefix_len, req_pool_idx)
    extends: list[tuple[int, int, int, int]]
    # numpy copies for bookkeeping
    req_pool_indices: np.ndarray
    prefix_lens: np.ndarray
    extend_lens: np.ndarray
    token_starts: np.ndarray
    # block-diffusion steps: attention is block-causal (a token sees every key of its own block
    # of this many positions and of the blocks before it); 0: causal
    block_size: int = 0

    @classmethod
    def from_worker_batch(cls, b: ModelWorkerBatch) -> "ForwardBatch":
        ids = np.frombuffer(b.input_ids, dtype=np.int32)
        loc = np.frombuffer(b.out_cache_loc, dtype=np.int32)
        reqs = np.asarray(b.req_pool_indices, dtype=np.int64)
        prefix = np.asarray(b.prefix_lens, dtype=np.int64)
        ext = np.asarray(b.extend_lens, dtype=np.int64)
        sample_rows = np.asarray(b.sample_rows, dtype=np.int64)
        block = b.dllm.block_size if b.dllm is not None else 0
        if not block and len(ids) == len(ext) and (ext == 1).all():
            return cls._decodes_only(ids, loc, reqs, prefix, ext, sample_rows)
        return cls._rows(ids, loc, reqs, prefix, ext, sample_rows, block)

    @classmethod
    def _rows(cls, ids: np.ndarray, loc: np.ndarray, reqs: np.ndarray, prefix: np.ndarray, ext: np.ndarray,
              sample_rows: np.ndarray, block: int) -> "ForwardBatch":
        starts = np.cumsum(ext) - ext
        total = int(ext.sum())
        positions = np.repeat(prefix - starts, ext) + np.arange(total)
        if block:  # unshifted logits: every position of each row's last block predicts itself
            logit_rows = (np.repeat(starts + ext - block, block) + np.tile(np.arange(block), len(ext)))
        else:
            logit_rows = starts[sample_rows] + ext[sample_rows] - 1
        single = ext == 1
        decode_tokens = starts[single]
        extends = [(int(starts[i]), int(ext[i]), int(prefix[i]), int(reqs[i])) for i in np.flatnonzero(~single)]
        return cls(
            input_ids=torch.from_numpy(ids.astype(np.int64)),
            positions=torch.from_numpy(positions),
            out_cache_loc=torch.from_numpy(loc.astype(np.int64)),
            slots=loc,
            logit_rows=torch.from_numpy(logit_rows),
            decode_tokens=torch.from_numpy(decode_tokens),
            decode_reqs=torch.from_numpy(reqs[single]),
            decode_seq_lens=torch.from_numpy(prefix[single] + 1),
            decode_is_prefix=bool(len(decode_tokens) == 0 or decode_tokens[-1] == len(decode_tokens) - 1),
            extends=extends,
            req_pool_indices=reqs,
            prefix_lens=prefix,
            extend_lens=ext,
            token_starts=starts,
            block_size=block,
        )

    @classmethod
    def _decodes_only(cls, ids: np.ndarray, loc: np.ndarray, reqs: np.ndarray, prefix: np.ndarray, ext: np.ndarray,
                      sample_rows: np.ndarray) -> "ForwardBatch":
        """_rows where every row is one token (a decode step): row i is token i, at position
        prefix[i]; the same fields in fewer array operations (this runs every step: a batch-1 step's
        Python took ~0.5 ms of ~12 on the AMX Xeon)."""
        starts = np.arange(len(ext), dtype=np.int64)
        return cls(
            input_ids=torch.from_numpy(ids.astype(np.int64)),
            positions=torch.from_numpy(prefix.copy()),
            out_cache_loc=torch.from_numpy(loc.astype(np.int64)),
            slots=loc,
            logit_rows=torch.from_numpy(sample_rows),
            decode_tokens=torch.from_numpy(starts),
            decode_reqs=torch.from_numpy(reqs.copy()),
            decode_seq_lens=torch.from_numpy(prefix + 1),
            decode_is_prefix=True,
            extends=[],
            req_pool_indices=reqs,
            prefix_lens=prefix,
            extend_lens=ext,
            token_starts=starts,
        )

    @classmethod
    def blocks_only(cls, req_pool_indices: np.ndarray, block_starts: np.ndarray, block_size: int,
                    slots: np.ndarray, block_ids: torch.Tensor) -> "ForwardBatch":
        """A further round of diffusion over blocks already in the req_to_token mirror: each row
        is one block (prefix = its start, the committed tokens before it), on the same slots."""
        n = len(req_pool_indices)
        ext = np.full(n, block_size, dtype=np.int64)
        starts = np.arange(n, dtype=np.int64) * block_size
        positions = np.repeat(block_starts, block_size) + np.tile(np.arange(block_size), n)
        loc = np.ascontiguousarray(slots, dtype=np.int32)
        return cls(
            input_ids=block_ids.reshape(-1).to(torch.int64),
            positions=torch.from_numpy(positions.astype(np.int64)),
            out_cache_loc=torch.from_numpy(loc.astype(np.int64)),
            slots=loc,
            logit_rows=torch.arange(n * block_size),
            decode_tokens=torch.empty(0, dtype=torch.int64),
            decode_reqs=torch.empty(0, dtype=torch.int64),
            decode_seq_lens=torch.empty(0, dtype=torch.int64),
            decode_is_prefix=True,
            extends=[(int(starts[i]), block_size, int(block_starts[i]), int(req_pool_indices[i])) for i in range(n)],
            req_pool_indices=np.asarray(req_pool_indices, dtype=np.int64),
            prefix_lens=np.asarray(block_starts, dtype=np.int64),
            extend_lens=ext,
            token_starts=starts,
            block_size=block_size,
        )


class HostStaging:
    """Uploads a step's small int tables to the device: packed into one pinned host buffer and
    copied asynchronously (one copy per call, not one per array). Calls within a step take
    successive parts of the buffer; `begin_step` waits until the last step's copies have left it.
    On the CPU (Triton's interpreter) the arrays are only wrapped."""

    def __init__(self, device: torch.device | str, capacity: int = 1 << 16):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.offset = 0
        self.copied = None  # a CUDA event after the latest copy
        if self.pinned:
            self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self.host_np = self.host.numpy()

    def begin_step(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()
        self.offset = 0

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """int64 device tensors of `arrays`, in order."""
        if not self.pinned:
            return [torch.from_numpy(np.array(a, dtype=np.int64)) for a in arrays]
        sizes = [len(a) for a in arrays]
        total = sum(sizes)
        if self.offset + total > len(self.host_np):  # a bigger buffer; the old one may still be copying
            torch.cuda.current_stream(self.device).synchronize()
            self._allocate(max(2 * len(self.host_np), total))
            self.offset = 0
        at = self.offset
        for a, n in zip(arrays, sizes):
            self.host_np[at : at + n] = a
            at += n
        dev = self.host[self.offset : at].to(self.device, non_blocking=True)
        self.offset = at
        self.copied = torch.cuda.Event()
        self.copied.record()
        return list(dev.split(sizes))
