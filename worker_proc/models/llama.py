"""Decoder-only transformer of the Llama family (Llama, Qwen2 with qkv bias, Qwen3 with
per-head q/k norm), over a packed batch of variable-length rows.

Projections are fused (one QKV GEMM, one gate/up GEMM); the math of each op follows the
reference implementation so float32 greedy outputs match token for token.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from worker_proc.attention import AttentionBackend
from worker_proc.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to the context length, computed once."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if config.rope_scaling is not None:
            inv_freq = _llama3_scaled_inv_freq(inv_freq, config.rope_scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, 1, head_dim], broadcast over heads
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def _llama3_scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], attn: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = attn.forward(self.layer_id, q, k, v)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos_sin, attn):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, logit_rows: torch.Tensor
    ) -> torch.Tensor:
        """Returns logits (float32) only for the token rows in `logit_rows`."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos_sin, attn)
        x = self.norm(x[logit_rows])
        return F.linear(x, self.lm_head_weight).float()

    # ---- weights ---------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Takes Hugging Face tensor names; fuses q/k/v and gate/up into their packed params."""
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("lm_head.") and self.config.tie_word_embeddings:
                continue
            if "rotary_emb" in name:
                continue
            parts = name.split(".")
            shard = None
            if len(parts) >= 2 and parts[-2] in fused:
                target, shard = fused[parts[-2]]
                parts[-2] = target
            target_name = ".".join(parts)
            if target_name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")
            param = params[target_name]
            with torch.no_grad():
                if shard is None:
                    _copy_checked(param, tensor, name)
                else:
                    start, size = self._shard_range(parts[-2], shard)
                    _copy_checked(param.narrow(0, start, size), tensor, name)
            loaded.add(f"{target_name}#{shard}")
        expected = self._expected_loads(params)
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def _shard_range(self, fused_name: str, shard: int) -> tuple[int, int]:
        c = self.config
        if fused_name == "qkv_proj":
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            return [(0, q), (q, kv), (q + kv, kv)][shard]
        return (shard * c.intermediate_size, c.intermediate_size)

    def _expected_loads(self, params: dict) -> set[str]:
        expected = set()
        for name in params:
            if ".qkv_proj." in name:
                expected |= {f"{name}#{i}" for i in range(3)}
            elif ".gate_up_proj." in name:
                expected |= {f"{name}#{i}" for i in range(2)}
            else:
                expected.add(f"{name}#None")
        return expected


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}")
    dst.copy_(src)
