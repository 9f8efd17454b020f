"""Owns the model, the KV pool and the sampler; turns one ModelWorkerBatch into sampled ids."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ipc.messages import ModelWorkerBatch
from worker_proc.attention import TorchAttention
from worker_proc.forward_batch import ForwardBatch
from worker_proc.kv_cache import KVPool
from worker_proc.model_config import ModelConfig
from worker_proc.model_loader import iter_checkpoint_tensors
from worker_proc.models import MODEL_CLASSES
from worker_proc.sampler import SamplingBatch, sample

log = logging.getLogger("loom.worker")


@dataclass(slots=True)
class RunnerConfig:
    model_dir: str
    dtype: torch.dtype
    kv_cache_gb: float
    max_running_requests: int
    context_length: int | None = None
    device: str = "cpu"
    attention_backend: str = "auto"  # auto | torch | cpu_kernel


def plan_kv_slots(config: ModelConfig, dtype: torch.dtype, kv_cache_gb: float) -> int:
    """KV slots that fit the memory budget (`--kv-cache-gb` on CPU)."""
    per_token = KVPool.bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, dtype)
    slots = int(kv_cache_gb * (1 << 30)) // per_token
    if slots < 16:
        raise ValueError(f"--kv-cache-gb {kv_cache_gb} holds only {slots} tokens ({per_token} bytes each)")
    return slots


def _decode_kernel(backend: str, device: str):
    if backend == "torch" or device != "cpu":
        return None
    from worker_proc import cpu_kernels

    kernel = cpu_kernels.load()
    if kernel is None and backend == "cpu_kernel":
        raise RuntimeError("--attention-backend cpu_kernel: the kernel failed to compile (see the log)")
    return kernel


class ModelRunner:
    def __init__(self, rc: RunnerConfig):
        self.config = ModelConfig.from_dir(rc.model_dir)
        self.dtype = rc.dtype
        self.device = rc.device
        self.context_len = min(rc.context_length or self.config.max_position_embeddings,
                               self.config.max_position_embeddings)
        model = MODEL_CLASSES[self.config.architecture](self.config, self.context_len)
        model.load_weights(iter_checkpoint_tensors(rc.model_dir))
        self.model = model.to(dtype=rc.dtype, device=rc.device).eval()
        self.num_slots = plan_kv_slots(self.config, rc.dtype, rc.kv_cache_gb)
        self.pool = KVPool(self.config.num_layers, self.num_slots, self.config.num_kv_heads, self.config.head_dim,
                           rc.dtype, rc.max_running_requests, self.context_len, rc.device)
        self.attn = TorchAttention(self.pool, self.config.num_heads, self.config.head_dim,
                                   decode_kernel=_decode_kernel(rc.attention_backend, rc.device))
        self.attention_backend = "cpu_kernel" if self.attn.decode_kernel is not None else "torch"

    @torch.inference_mode()
    def forward(self, batch: ModelWorkerBatch) -> list[int]:
        fb = ForwardBatch.from_worker_batch(batch)
        self.pool.record(fb.req_pool_indices, fb.prefix_lens, fb.extend_lens, fb.token_starts, fb.out_cache_loc)
        self.attn.prepare(fb)
        logits = self.model(fb.input_ids, fb.positions, self.attn, fb.logit_rows)
        if not batch.sampling:
            return []
        sb = SamplingBatch.build(batch.sampling, batch.output_lens, self.config.vocab_size, logits.device)
        return sample(logits, sb).tolist()
