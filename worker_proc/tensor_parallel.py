"""Tensor parallelism: which part of the model a rank holds, and the collectives between ranks.

A model splits over `size` worker processes, Megatron style: the fused QKV and gate/up
projections by output rows (each rank its query heads, its KV heads and its share of the MLP),
o_proj and down_proj by input columns (partial sums, one all-reduce each), the embedding and
the LM head by vocabulary rows. With fewer KV heads than ranks, each KV head is replicated on the
ranks whose query heads use it. Norms are replicated.

The logits are gathered on rank 0, which samples: the scheduler sends every step's token ids to
every rank, so the others never need the sampled ids, and sampling (penalties, seeds, logprobs)
stays one code path over the whole vocabulary.

Collectives are torch.distributed's (gloo on CPU, NCCL on GPU). On a CPU host holding every rank
of its group, the forward's all-reduces, the logits' gather and the ids' broadcast go through
shared memory instead (share_memory).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from worker_proc.model_config import ModelConfig


def valid_tp_sizes(config: ModelConfig, limit: int = 64) -> list[int]:
    return [n for n in range(1, limit + 1) if _tp_problem(config, n) is None]


def _tp_problem(config: ModelConfig, size: int) -> str | None:
    if config.num_heads % size:
        return f"{config.num_heads} attention heads"
    if config.num_kv_heads % size and size % config.num_kv_heads:
        return f"{config.num_kv_heads} KV heads (neither divides the other)"
    if config.intermediate_size % size:
        return f"an MLP of {config.intermediate_size}"
    return None


@dataclass(frozen=True, slots=True)
class TPShard:
    """What rank `rank` of `size` holds of a model: heads, KV heads, MLP columns and vocabulary rows."""

    rank: int
    size: int
    num_heads: int  # query heads on this rank
    head_start: int
    num_kv_heads: int  # KV heads on this rank (1 where replicated)
    kv_head_start: int
    intermediate_size: int
    intermediate_start: int
    vocab_rows: int  # rows of the embedding / LM head per rank (the vocabulary padded to size x this)
    vocab_start: int
    vocab_size: int  # the model's whole vocabulary

    @classmethod
    def of(cls, config: ModelConfig, rank: int = 0, size: int = 1) -> "TPShard":
        problem = _tp_problem(config, size)
        if problem is not None:
            raise ValueError(f"--tp-size {size} does not divide {problem}; this model runs at --tp-size "
                             f"{', '.join(map(str, valid_tp_sizes(config)))}")
        heads = config.num_heads // size
        if config.num_kv_heads >= size:
            kv_heads, kv_start = config.num_kv_heads // size, rank * (config.num_kv_heads // size)
        else:  # replicated: the KV head of this rank's query heads
            kv_heads, kv_start = 1, rank * config.num_kv_heads // size
        inter = config.intermediate_size // size
        vocab_rows = -(-config.vocab_size // size)
        return cls(rank, size, heads, rank * heads, kv_heads, kv_start, inter, rank * inter, vocab_rows,
                   rank * vocab_rows, config.vocab_size)

    @property
    def vocab_end(self) -> int:
        """Where this rank's real vocabulary rows end (the last rank's padding rows are past it)."""
        return min(self.vocab_start + self.vocab_rows, self.vocab_size)


class TPGroup:
    """The collectives of one tensor-parallel group (no-ops at size 1). `collective_s` adds up the
    seconds spent in them (waiting for the other ranks included): the step trace reports it."""

    def __init__(self, rank: int = 0, size: int = 1, device: str = "cpu", group=None):
        self.rank, self.size = rank, size
        self.device = device  # where the small tensors of broadcasts live (NCCL takes GPU tensors only)
        self.group = group  # torch.distributed's process group (None: the whole world, no pipeline stages)
        self.collective_s = 0.0
        self._shared = None  # (region, kernels, bytes a slot holds) once share_memory has mapped it
        self._calls = 0  # shared calls so far: every rank counts the same

    def share_memory(self, name: str, kernels, nbytes: int = 16 << 20) -> bool:
        """Maps a region of shared memory (/dev/shm/`name`, unique to this group) with the other
        ranks, through which all_reduce, gather_vocab and broadcast_ids then pass (loom's CPU
        kernels: shared_memory_all_reduce, shared_memory_exchange).
        Rank 0 creates it and removes the name once every rank has mapped it, so nothing is left
        behind. Every rank of the group calls it, on one host; all return False (and keep gloo)
        where any of them could not open it."""
        import mmap
        import os

        import torch.distributed as dist

        path, fd = f"/dev/shm/{name}", -1

        def create() -> None:
            nonlocal fd
            if self.rank == 0:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                os.ftruncate(fd, nbytes)

        def open_created() -> None:
            nonlocal fd
            if self.rank != 0:
                fd = os.open(path, os.O_RDWR)

        def on_every_rank(action) -> bool:  # whether it succeeded on every rank (all learn the same)
            try:
                action()
                failed = 0
            except OSError:
                failed = 1
            return not self.all_reduce_max(torch.tensor([failed], dtype=torch.int64)).item()

        ok = on_every_rank(create) and on_every_rank(open_created)
        if ok:
            region = mmap.mmap(fd, nbytes)
            shared = torch.frombuffer(region, dtype=torch.uint8)
            self._shared = (shared, kernels, kernels.shared_reduce_slot_bytes(shared, self.size))
            dist.barrier(group=self.group)  # every rank has mapped it
        if fd >= 0:
            os.close(fd)
            if self.rank == 0:
                os.unlink(path)
        return ok

    @classmethod
    def connect(cls, rank: int, size: int, init_addr: str, device: str = "cpu") -> "TPGroup":
        import torch.distributed as dist

        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{init_addr}", rank=rank, world_size=size)
        return cls(rank, size, device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place; returns it."""
        if self.size > 1:
            import torch.distributed as dist

            start = time.perf_counter()
            if self._shared is not None and x.is_contiguous() and x.dtype in (torch.float32, torch.bfloat16):
                region, kernels, slot_bytes = self._shared
                flat, step = x.view(-1), slot_bytes // x.element_size()
                for begin in range(0, flat.numel(), step):
                    kernels.shared_memory_all_reduce(region, self.rank, self.size, self._next_call(),
                                                     flat[begin : begin + step])
            else:
                dist.all_reduce(x, group=self.group)
            self.collective_s += time.perf_counter() - start
        return x

    def _next_call(self) -> int:
        self._calls += 1
        return self._calls

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (of one shape) through the shared region: views valid until this rank's
        next shared call."""
        region, kernels, _ = self._shared
        return kernels.shared_memory_exchange(region, self.rank, self.size, self._next_call(), x)

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise max of x over the ranks, in place; returns it."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's logits [R, vocab_rows] -> [R, vocab_size] on rank 0; None on the others."""
        if self.size == 1:
            return logits
        import torch.distributed as dist

        start = time.perf_counter()
        logits = logits.contiguous()
        rows, part = logits.shape
        out = torch.empty(rows, part * self.size, dtype=logits.dtype) if self.rank == 0 else None
        row_bytes = part * logits.element_size()
        if self._shared is not None and row_bytes <= self._shared[2]:
            step = self._shared[2] // max(1, row_bytes)  # rows a slot holds (one call at least: every rank the same)
            for begin in range(0, max(rows, 1), step):
                parts = self._exchange(logits[begin : begin + step])
                if out is not None:
                    torch.cat(parts, dim=1, out=out[begin : begin + step])
        else:
            parts = [torch.empty_like(logits) for _ in range(self.size)] if out is not None else None
            dist.gather(logits, parts, group=self.group, group_dst=0)
            if out is not None:
                torch.cat(parts, dim=1, out=out)
        self.collective_s += time.perf_counter() - start
        return out[:, :vocab_size] if out is not None else None

    def broadcast_index(self, index: int) -> int:
        """rank 0's `index` on every rank: a choice made once (such as the dtype), as a tensor
        (torch.distributed's object broadcast would pickle)."""
        if self.size == 1:
            return index
        import torch.distributed as dist

        box = torch.tensor([index], dtype=torch.int64, device=self.device)
        dist.broadcast(box, group=self.group, group_src=0)
        return int(box.item())

    def broadcast_ids(self, ids: list[int], n: int) -> list[int]:
        """rank 0's n token ids on every rank."""
        import torch.distributed as dist

        box = torch.tensor(ids if self.rank == 0 else [0] * n, dtype=torch.int64, device=self.device)
        start = time.perf_counter()
        if self._shared is not None and box.numel() * box.element_size() <= self._shared[2]:
            ids = self._exchange(box)[0].tolist()
        else:
            dist.broadcast(box, group=self.group, group_src=0)
            ids = box.tolist()
        self.collective_s += time.perf_counter() - start
        return ids

    def close(self) -> None:
        if self.size > 1 and self.group is None:  # (a pipeline's groups: PPGroup.close)
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
