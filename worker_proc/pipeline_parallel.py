"""Pipeline parallelism: which layers a stage holds, and how its hidden states reach the next.

The layers split into `size` contiguous stages (the first stages take one more where they do not
divide evenly). Stage 0 also holds the embedding, the last stage the final norm and the LM head
(and samples). Every stage is sent every step by the scheduler (each needs the step's positions
and KV slots for its own layers); stage i passes the step's hidden state and residual to stage
i+1 with torch.distributed point-to-point (gloo on CPU, NCCL on GPU), each tensor-parallel rank to
the same rank of the next stage. Steps arrive at every stage in the scheduler's order, so the
receives pair with the sends without tags, and the scheduler keeps up to `size` disjoint
micro-batches in flight (SchedulerConfig.pipeline_stages) to keep every stage busy.

With tensor parallelism too, the world is pp x tp processes, global rank = stage x tp + tp rank;
each stage's tp ranks form their own group for the all-reduces.
"""

from __future__ import annotations

import time

import torch

from worker_proc.tensor_parallel import TPGroup


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The layers stage `pp_rank` of `pp_size` holds."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"--pp-size {pp_size}: between 1 and the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


class PPGroup:
    """This worker's place in the pipeline (size 1: no pipeline) and its sends and receives.
    `wait_s` adds up the seconds spent waiting for the previous stage's hidden state."""

    def __init__(self, rank: int = 0, size: int = 1, tp_rank: int = 0, tp_size: int = 1, device: str = "cpu"):
        self.rank, self.size = rank, size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = device
        self.wait_s = 0.0
        self._sending = None  # (work, tensor): the last step's send in progress; its tensor must stay alive

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @classmethod
    def connect(cls, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, init_addr: str,
                device: str = "cpu") -> tuple[TPGroup, "PPGroup"]:
        """Joins the world of pp_size x tp_size workers; returns this worker's tensor-parallel
        group (its stage's ranks) and its pipeline place."""
        import torch.distributed as dist

        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{init_addr}", rank=pp_rank * tp_size + tp_rank,
                                world_size=pp_size * tp_size)
        tp = TPGroup()
        if tp_size > 1:
            for stage in range(pp_size):  # every process creates every group, in the same order
                group = dist.new_group([stage * tp_size + r for r in range(tp_size)])
                if stage == pp_rank:
                    tp = TPGroup(tp_rank, tp_size, device, group)
        return tp, cls(pp_rank, pp_size, tp_rank, tp_size, device)

    def _peer(self, stage: int) -> int:
        return stage * self.tp_size + self.tp_rank

    def send(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        """The step's hidden state and residual to the next stage (asynchronous: this stage goes on
        to its next step while the next stage takes it)."""
        import torch.distributed as dist

        self._finish_send()
        packed = torch.stack((x, residual))
        self._sending = (dist.isend(packed, self._peer(self.rank + 1)), packed)

    def _finish_send(self) -> None:
        if self._sending is not None:
            self._sending[0].wait()
            self._sending = None

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's hidden state and residual for a step of `num_tokens` tokens."""
        import torch.distributed as dist

        packed = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=self.device)
        start = time.perf_counter()
        dist.recv(packed, self._peer(self.rank - 1))
        self.wait_s += time.perf_counter() - start
        return packed[0], packed[1]

    def close(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            self._finish_send()
            if dist.is_initialized():
                dist.destroy_process_group()
