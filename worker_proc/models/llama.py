"""Decoder-only transformer of the Llama family (Llama, Qwen2 with qkv bias, Qwen3 with
per-head q/k norm), over a packed batch of variable-length rows.

Projections are fused (one QKV GEMM, one gate/up GEMM); the math of each op follows the
reference implementation so float32 greedy outputs match token for token.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Iterable

import torch
from torch import nn

from worker_proc.attention import AttentionBackend
from worker_proc.huge_pages import move_to_huge_pages
from worker_proc.linear import HalfLinear, Linear
from worker_proc.model_config import ModelConfig
from worker_proc.ops import Ops
from worker_proc.tensor_parallel import TPGroup, TPShard


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Ops):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """float32 cos/sin [positions, head_dim] up to the context length, computed once."""

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

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) must not round the tables: rotation is computed from float32 values.
        cos, sin = self.cos, self.sin
        out = super()._apply(fn, recurse)
        self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)
        return out


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


class Attention(nn.Module):
    """This rank's query and KV heads (all of them without tensor parallelism); o_proj's partial
    sums are all-reduced over the ranks."""

    def __init__(self, config: ModelConfig, layer_id: int, ops: Ops, shard: TPShard, tp: TPGroup):
        super().__init__()
        self.layer_id = layer_id
        self.ops = ops
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, ops)
        self.o_proj = Linear(self.q_size, config.hidden_size, False, ops, input_sharded=tp.size > 1)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops) if config.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                attn: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q.copy_(self.q_norm(q.contiguous()))
            k.copy_(self.k_norm(k.contiguous()))
        # q and k heads are adjacent in the fused projection: one in-place rotation covers both.
        self.ops.rope_(qkv, positions, rotary.cos, rotary.sin, self.num_heads + self.num_kv_heads, self.head_dim)
        out = attn.forward(self.layer_id, q, k, v)
        return self.tp.all_reduce(self.o_proj(out.view(t, self.q_size)))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, shard: TPShard, tp: TPGroup):
        super().__init__()
        self.ops = ops
        self.tp = tp
        self.gate_up_proj = Linear(config.hidden_size, 2 * shard.intermediate_size, False, ops, gated=True)
        self.down_proj = Linear(shard.intermediate_size, config.hidden_size, False, ops, input_sharded=tp.size > 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.ops.silu_mul_linear(x, self.gate_up_proj)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, ops: Ops, shard: TPShard, tp: TPGroup):
        super().__init__()
        self.ops = ops
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = Attention(config, layer_id, ops, shard, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = MLP(config, ops, shard, tp)

    def layer_stack_args(self) -> tuple:
        """This layer's weights as the compiled layer stack's add_layer takes them."""
        attn, mlp = self.self_attn, self.mlp
        qk_norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else (None, None)
        return (self.input_layernorm.weight, self.post_attention_layernorm.weight, attn.qkv_proj.kernel_spec(),
                attn.o_proj.kernel_spec(), mlp.gate_up_proj.kernel_spec(), mlp.down_proj.kernel_spec(), *qk_norms)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding, attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried separately so each norm also does the residual add."""
        norm = self.input_layernorm
        if residual is None:
            residual, h = x, norm(x)
        else:
            h, residual = self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        x = self.self_attn(h, positions, rotary, attn)
        norm = self.post_attention_layernorm
        h, residual = self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """The model, or one tensor-parallel rank's shard of it (`shard`, `tp`), or one pipeline
    stage's layers of it (`stage`): forward returns the logits of the whole vocabulary on
    tensor-parallel rank 0 of the last stage, None on the other ranks, and a stage before the last
    returns its hidden state and residual for the next."""

    def __init__(self, config: ModelConfig, max_positions: int, ops: Ops | None = None,
                 shard: TPShard | None = None, tp: TPGroup | None = None, stage: range | None = None):
        super().__init__()
        self.config = config
        self.ops = ops = ops or Ops()
        self.shard = shard = shard or TPShard.of(config)
        self.tp = tp = tp or TPGroup()
        self.stage = stage = stage if stage is not None else range(config.num_layers)
        self.is_first_stage, self.is_last_stage = stage.start == 0, stage.stop == config.num_layers
        # vocabulary rows [vocab_start, vocab_start + vocab_rows) of the embedding and LM head
        holds_embedding = self.is_first_stage or (self.is_last_stage and config.tie_word_embeddings)
        # (_weight: left uninitialized, as the checkpoint overwrites it; a random init costs ~0.2 s)
        self.embed_tokens = (nn.Embedding(shard.vocab_rows, config.hidden_size,
                                          _weight=torch.empty(shard.vocab_rows, config.hidden_size))
                             if holds_embedding else None)
        # layer i of the model is self.layers[i - stage.start]; its KV lives in the pool's layer of that index
        self.layers = nn.ModuleList(DecoderLayer(config, i, ops, shard, tp) for i in range(len(stage)))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops) if self.is_last_stage else None
        self.rotary = RotaryEmbedding(config, max_positions)
        self.lm_head = Linear(config.hidden_size, shard.vocab_rows, False, ops) if self.is_last_stage else None
        if self.is_last_stage and config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.layer_stack = None  # see build_layer_stack
        self.layer_stack_rows = 0

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, logit_rows: torch.Tensor,
        hidden: tuple[torch.Tensor, torch.Tensor] | None = None, return_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """Logits, in the model's dtype, of the token rows in `logit_rows`; with `return_hidden`,
        (logits, the final hidden states of those rows after the last norm). A pipeline stage
        after the first starts from `hidden` (the previous stage's hidden state and residual); one
        before the last returns its own."""
        run_model = getattr(attn, "run_model", None)
        if (self.layer_stack is not None and run_model is not None and len(input_ids) <= self.layer_stack_rows
                and not return_hidden):  # (the compiled stack runs through to the logits)
            logits = run_model(self.layer_stack, input_ids, logit_rows, positions, self.rotary.cos, self.rotary.sin)
            return self.tp.gather_vocab(logits, self.config.vocab_size)
        x, residual = (self._embed(input_ids), None) if hidden is None else hidden
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary, attn)
        if not self.is_last_stage:
            return x, residual
        h, _ = self.ops.add_rms_norm(x[logit_rows], residual[logit_rows], self.norm.weight, self.norm.eps)
        logits = self.tp.gather_vocab(self.lm_head(h), self.config.vocab_size)
        return (logits, h) if return_hidden else logits

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        # vocabulary-parallel: each rank looks up the ids it holds, zeros elsewhere, then the sum
        local = input_ids - self.shard.vocab_start
        outside = (local < 0) | (local >= self.shard.vocab_end - self.shard.vocab_start)
        x = self.embed_tokens(local.masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))

    def headed_layer_stack(self, kernels: Any) -> Any:
        """A compiled layer stack of this model's shape with its embedding, final norm and LM head
        (and its tensor-parallel shard), no layers yet."""
        c = self.config
        stack = kernels.LayerStack(self.shard.num_heads, self.shard.num_kv_heads, c.head_dim, c.rms_norm_eps)
        stack.set_head(self.embed_tokens.weight, self.norm.weight, self.lm_head.kernel_spec())
        if self.tp.size > 1:
            stack.set_tensor_parallel(self.shard.vocab_start, self.shard.vocab_end - self.shard.vocab_start,
                                      self.tp.all_reduce)
        return stack

    def build_layer_stack(self) -> bool:
        """Hands the weights to the compiled layer stack, which then runs small steps from token
        ids to logits in one call: up to as many tokens as its linears take loom's kernels
        (Ops.dense_rows for unquantized weights, Ops.half_rows for float16 ones). Call after any
        weight change (loading, quantization)."""
        kernels = self.ops.kernels
        # (it runs ids to logits: a pipeline stage's hidden states in and out take the Python path)
        whole = len(self.stage) == self.config.num_layers
        if kernels is None or self.ops.small_m_rows == 0 or not whole:
            return False
        self._pack_weights_in_step_order()
        stack = self.headed_layer_stack(kernels)
        for layer in self.layers:
            stack.add_layer(*layer.layer_stack_args())
        self.layer_stack = stack
        linears = [mod for mod in self.modules() if hasattr(mod, "kernel_spec")]
        dense_dtypes = {mod.weight.dtype if isinstance(mod, Linear) else None for mod in linears}
        dense_dtype = dense_dtypes.pop() if len(dense_dtypes) == 1 else None
        if all(isinstance(mod, HalfLinear) for mod in linears):
            self.layer_stack_rows = self.ops.half_rows
        elif all(getattr(mod, "integer_gemm", False) for mod in linears):
            self.layer_stack_rows = sys.maxsize  # (int4 / int8 on the integer GEMM's panels)
        elif dense_dtype:
            packed = all(mod.packed is not None for mod in linears)
            self.layer_stack_rows = self.ops.dense_rows(dense_dtype, packed)
        else:
            self.layer_stack_rows = self.ops.small_m_rows
        return True

    def _pack_weights_in_step_order(self) -> None:
        """Moves the weights a step reads (Linear.streamed_tensors) into one huge-page region in the
        order it reads them, so a small-batch step streams one contiguous range instead of ~120
        separate allocations (batch-1 step 3-6% faster). Parameters and buffers keep their
        identity (ties hold)."""
        order: list[nn.Module] = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            order += [layer.input_layernorm, attn.qkv_proj, attn.o_proj, layer.post_attention_layernorm,
                      mlp.gate_up_proj, mlp.down_proj]
        order += [self.norm, self.lm_head, self.embed_tokens]
        tensors = list({id(t): t for module in order
                        for t in (module.streamed_tensors() if isinstance(module, Linear) else
                                  (*module.parameters(recurse=False), *module.buffers(recurse=False)))}.values())
        if any(t.device.type != "cpu" for t in tensors):
            return
        move_to_huge_pages(tensors)

    # ---- weights ---------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Takes Hugging Face tensor names, each with a tensor or a lazy slice
        (model_loader.iter_checkpoint_tensors: a tensor-parallel rank reads only its shard);
        fuses q/k/v and gate/up into their packed params."""
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
            if not self._on_this_stage(parts):
                continue  # another pipeline stage's: never read
            if parts[0] == "layers":
                parts[1] = str(int(parts[1]) - self.stage.start)
            fused_index = None
            if len(parts) >= 2 and parts[-2] in fused:
                target, fused_index = fused[parts[-2]]
                parts[-2] = target
            target_name = ".".join(parts)
            if target_name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")
            param = params[target_name]
            tensor = _read(tensor, self._tp_slice(name.split(".")))
            with torch.no_grad():
                if fused_index is not None:
                    start, size = self._fused_range(parts[-2], fused_index)
                    param = param.narrow(0, start, size)
                elif parts[0] in ("embed_tokens", "lm_head") and len(tensor) < len(param):
                    param[len(tensor):].zero_()  # the last rank's padding rows of the vocabulary
                    param = param[: len(tensor)]
                _copy_checked(param, tensor, name)
            loaded.add(f"{target_name}#{fused_index}")
        expected = self._expected_loads(params)
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def _on_this_stage(self, parts: list[str]) -> bool:
        """Whether checkpoint tensor `parts` (its name, split) is held by this pipeline stage."""
        if parts[0] == "layers":
            return int(parts[1]) in self.stage
        return getattr(self, parts[0], None) is not None

    def _fused_range(self, fused_name: str, index: int) -> tuple[int, int]:
        s, d = self.shard, self.config.head_dim
        if fused_name == "qkv_proj":
            q, kv = s.num_heads * d, s.num_kv_heads * d
            return [(0, q), (q, kv), (q + kv, kv)][index]
        return (index * s.intermediate_size, s.intermediate_size)

    def _tp_slice(self, parts: list[str]) -> tuple[int, int, int] | None:
        """(dim, start, size): the part of checkpoint tensor `parts` (its name, split) this rank
        holds; None for all of it."""
        s, d = self.shard, self.config.head_dim
        if s.size == 1:
            return None
        if parts[0] in ("embed_tokens", "lm_head"):
            return 0, s.vocab_start, s.vocab_end - s.vocab_start
        owner = parts[-2] if len(parts) >= 2 else ""
        return {"q_proj": (0, s.head_start * d, s.num_heads * d),
                "k_proj": (0, s.kv_head_start * d, s.num_kv_heads * d),
                "v_proj": (0, s.kv_head_start * d, s.num_kv_heads * d),
                "o_proj": (1, s.head_start * d, s.num_heads * d),
                "gate_proj": (0, s.intermediate_start, s.intermediate_size),
                "up_proj": (0, s.intermediate_start, s.intermediate_size),
                "down_proj": (1, s.intermediate_start, s.intermediate_size)}.get(owner)

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


def _read(src: Any, part: tuple[int, int, int] | None) -> torch.Tensor:
    """src (a tensor or a lazy safetensors slice), whole or only `part` (dim, start, size)."""
    if part is None:
        return src if isinstance(src, torch.Tensor) else src[:]
    dim, start, size = part
    if isinstance(src, torch.Tensor):
        return src.narrow(dim, start, size)
    return src[(slice(None),) * dim + (slice(start, start + size),)]


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}")
    dst.copy_(src)
