"""The few facts of a checkpoint's config.json that the model code needs, for every family
loom serves."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# architecture name -> (qkv projections have a bias, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool | None, bool]] = {
    "LlamaForCausalLM": (None, False),  # None: read `attention_bias` from the config
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (None, True),
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    # block-diffusion checkpoints: the id that marks a position not yet filled, and the block size
    # the model was trained with (None where the config does not say)
    mask_token_id: int | None = None
    block_size: int | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: --model-path must be a Hugging Face checkpoint folder")
        raw = json.loads(path.read_text())
        arch = (raw.get("architectures") or [None])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not supported; loom serves {sorted(SUPPORTED_ARCHITECTURES)}")
        bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        if bias is None:
            bias = bool(raw.get("attention_bias", False))
        rope = raw.get("rope_parameters") or {}
        rope_scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind not in ("default", "llama3", None):
                raise ValueError(f"rope scaling {kind!r} is not supported yet")
            if kind in ("default", None):
                rope_scaling = None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        heads = raw["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bias,
            qk_norm=qk_norm,
            eos_token_ids=eos_ids,
            mask_token_id=raw.get("mask_token_id"),
            block_size=raw.get("block_size") or raw.get("bd_size"),
        )


def dllm_block_size(config: ModelConfig, flag: int | None) -> int:
    """--dllm-block-size, else the checkpoint's block size, else 32."""
    size = flag or config.block_size or 32
    if size < 1:
        raise ValueError(f"--dllm-block-size {size}: at least 1")
    return size


def dllm_mask_token_id(config: ModelConfig) -> int:
    if config.mask_token_id is None:
        raise ValueError("--dllm-algorithm: the checkpoint's config.json has no mask_token_id (a block-diffusion "
                         "model names the id of its mask token there)")
    if not 0 <= config.mask_token_id < config.vocab_size:
        raise ValueError(f"mask_token_id {config.mask_token_id} is outside the vocabulary ({config.vocab_size})")
    return config.mask_token_id
