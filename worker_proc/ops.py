"""The per-layer ops of a forward pass, from loom's compiled CPU kernels when they are loaded
(worker_proc/cpu_kernels) and from plain torch otherwise. The torch versions are the reference:
the kernels round to the activation dtype at the same points.

Linears with few input rows (decode steps) stream their weights through the small-M kernel, and
dense ones take loom's kernels up to Ops.dense_rows (more rows on some builds); larger inputs
(prefill chunks) go to torch's GEMM (on weights reordered once for oneDNN where that pays), after
widening quantized weights.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from worker_proc import onednn_linear

INT4_GROUP = 32  # weights per int4 scale/min group (the GGUF Q4 block size)
_INT8_PACK_STEP = 32  # pack_int8's panels take inputs in groups of 32


class Ops:
    def __init__(self, kernels=None, small_m_rows: int = 0, dense_bf16_rows: int = 0):
        self.kernels = kernels
        # Inputs with at most this many rows take the weight-streaming kernel; bfloat16 x bfloat16
        # ones up to dense_bf16_rows where the kernel has bf16 dot products (faster than the GEMM
        # for a few dozen rows).
        self.small_m_rows = small_m_rows if kernels is not None else 0
        bf16_dot = kernels is not None and kernels.dense_bf16_dot()
        self.dense_bf16_rows = max(self.small_m_rows, dense_bf16_rows if bf16_dot else 0)
        # float32 x float32 ones up to however many rows the build's kernel beats the GEMM at.
        self.dense_f32_rows = max(self.small_m_rows, kernels.dense_f32_rows() if kernels is not None else 0)
        # float16 weights (pack_half): any number where the kernel multiplies in float16; else a few
        # (it widens the weights to float32 per row tile, slower than widening them once for torch's
        # GEMM when rows are many: 0.4-0.7x at 32 rows on AVX2 / AVX-512 builds).
        self.half_rows = sys.maxsize if kernels is not None and kernels.half_products() else self.small_m_rows
        # bfloat16 ones on pack_dense_bf16's weights: every count (AMX tiles or vdpbf16ps), 0 where
        # nothing packs them.
        self.packed_bf16_rows = min(kernels.packed_bf16_rows(), sys.maxsize) if kernels is not None else 0

    def dense_rows(self, dtype: torch.dtype, packed: bool = False) -> int:
        """Rows of x up to which dense linears of `dtype` take loom's kernel (`packed`: their
        weights from pack_dense; bfloat16 ones then take it up to packed_bf16_rows)."""
        if packed and dtype == torch.bfloat16:
            return max(self.packed_bf16_rows, self.dense_bf16_rows)
        return {torch.bfloat16: self.dense_bf16_rows, torch.float32: self.dense_f32_rows}.get(dtype, self.small_m_rows)

    # ---- normalisation, activation, rotary ----------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.kernels is not None and x.is_contiguous():
            return self.kernels.rms_norm(x, weight, eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x); the kernel updates `residual` in place."""
        if self.kernels is not None and x.is_contiguous() and residual.is_contiguous():
            return self.kernels.add_rms_norm(x, residual, weight, eps), residual
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] = [gate | up] -> silu(gate) * up."""
        if self.kernels is not None and gate_up.is_contiguous():
            return self.kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              heads: int, head_dim: int) -> None:
        """Rotates the first `heads` heads (q, then k) of each row of qkv [T, W] in place."""
        if self.kernels is not None and qkv.stride(1) == 1:
            self.kernels.rope_(qkv, positions, cos, sin, heads, head_dim)
            return
        x = qkv[:, : heads * head_dim].view(len(qkv), heads, head_dim)
        c, s = cos[positions].unsqueeze(1).to(x.dtype), sin[positions].unsqueeze(1).to(x.dtype)
        half = head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * c + rotated * s)

    # ---- linears --------------------------------------------------------------------------------

    def _small(self, x: torch.Tensor, rows: int | None = None) -> bool:
        return x.shape[0] <= (self.small_m_rows if rows is None else rows)

    def dense_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     packed: torch.Tensor | None = None, onednn: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype == weight.dtype and self._small(x, self.dense_rows(x.dtype, packed is not None)):
            y = self.kernels.linear_dense(x, weight, packed)
            return y if bias is None else y.add_(bias)
        if onednn is not None and x.dtype == weight.dtype:
            return onednn_linear.linear(x, onednn, bias)
        return F.linear(x, weight, bias)

    def pack_dense(self, weight: torch.Tensor, gated: bool = False) -> torch.Tensor | None:
        """weight in the layout dense_linear's kernel reads without repacking it per call (float32
        on builds with the panel kernel, bfloat16 on AMX or AVX512-BF16 builds), or None where nothing
        would use it.
        gated: weight is an MLP's [gate; up], packed (where the kernel can) for silu_mul_linear."""
        if self.kernels is None or weight.device.type != "cpu":
            return None
        weight = weight.contiguous()
        if weight.dtype == torch.float32:
            packed = self.kernels.pack_dense_f32(weight)
        elif weight.dtype == torch.bfloat16:
            packed = self.kernels.pack_dense_bf16(weight, gated)
            if gated and not packed.numel():
                packed = self.kernels.pack_dense_bf16(weight)
        else:
            return None
        return packed if packed.numel() else None

    def pack_onednn(self, weight: torch.Tensor, packed: bool) -> torch.Tensor | None:
        """weight reordered once for torch's oneDNN GEMM (worker_proc/onednn_linear.py), where some
        rows reach that GEMM (not bfloat16 on AMX tiles, which loom's kernel takes at every row
        count) and the start-up timing says it beats F.linear on this CPU."""
        if self.kernels is None or weight.device.type != "cpu" or self.dense_rows(weight.dtype, packed) == sys.maxsize:
            return None
        return onednn_linear.pack(weight) if onednn_linear.pays(weight.dtype) else None

    def silu_mul_linear(self, x: torch.Tensor, gate_up) -> torch.Tensor:
        """silu(gate) * up of an MLP's fused [gate; up] linear: in its kernel's epilogue where the
        weights are packed for it (Linear.packed_gated), else the linear, then silu_mul."""
        if getattr(gate_up, "packed_gated", False) and x.dtype == gate_up.weight.dtype and \
                self._small(x, self.packed_bf16_rows):
            return self.kernels.linear_dense(x, gate_up.weight, gate_up.packed)
        return self.silu_mul(gate_up(x))

    def pack_half(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] in float16: pack_half's panels for the kernel, else as it is."""
        if self.kernels is not None and weight.device.type == "cpu":
            return self.kernels.pack_half(weight.contiguous())
        return weight.half().contiguous()

    def half_linear(self, x: torch.Tensor, qweight: torch.Tensor, out_features: int,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W.T of pack_half's float16 weights."""
        if qweight.dim() == 4 and self._small(x, self.half_rows):
            y = self.kernels.linear_half(x, qweight, out_features)
            return y if bias is None else y.add_(bias)
        return F.linear(x, unpack_half(qweight, out_features, x.shape[1]).to(x.dtype), bias)

    def pack_int8(self, q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """q [N, K] in the layout of the int8 kernel for activations of `dtype`: where those are
        quantized to int8 (integer dot products), the integer GEMM's panels."""
        if (self.kernels is not None and q.shape[1] % _INT8_PACK_STEP == 0
                and self.kernels.quantized_int8_activations(dtype)):
            return self.kernels.pack_int8(q)
        return q

    def dequantize_int8(self, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weights widened to `dtype` [N, K], from either layout of pack_int8."""
        if self.kernels is not None:
            return self.kernels.dequantize_int8(qweight, scale, dtype)
        return dequantize_int8(qweight, scale, dtype)

    def int8_linear(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        if self._small(x) or int8_panels(qweight):
            y = self.kernels.linear_int8(x, qweight, scale)
            return y if bias is None else y.add_(bias)
        return F.linear(x, self.dequantize_int8(qweight, scale, x.dtype), bias)

    def pack_int4_panels(self, qweight: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor | None:
        """int4 weights also in the panels of the kernels' integer GEMM (any row count), or None
        where the build has none."""
        if self.kernels is None or not self.kernels.integer_panels():
            return None
        return self.kernels.pack_int4_panels(qweight, scale, minimum)

    def int4_linear(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                    bias: torch.Tensor | None, panels: torch.Tensor | None = None) -> torch.Tensor:
        if panels is not None or self._small(x):
            y = self.kernels.linear_int4(x, qweight, scale, minimum, panels)
            return y if bias is None else y.add_(bias)
        widened = (self.kernels.dequantize_int4(qweight, scale, minimum, x.dtype) if self.kernels is not None
                   else dequantize_int4(qweight, scale, minimum, x.dtype))
        return F.linear(x, widened, bias)


# ---- weight-only quantization formats -------------------------------------------------------------

def int8_panels(qweight: torch.Tensor) -> bool:
    """Whether int8 weights are in the integer GEMM's panels (pack_int8), which the kernel takes at
    every row count."""
    return qweight.dim() == 3


def quantize_int8(weight: torch.Tensor, row_absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per output row: w ~ q * scale, q in [-127, 127], scale = max|row| / 127 (the
    whole row's max where `weight` holds only some of its columns: a tensor-parallel shard)."""
    w = weight.float()
    absmax = w.abs().amax(dim=1) if row_absmax is None else row_absmax.float()
    scale = (absmax / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def unpack_half(qweight: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The float16 weights [N, K] from either layout of Ops.pack_half (panels [P, pairs, 16, 2])."""
    if qweight.dim() == 2:
        return qweight
    return qweight.permute(0, 2, 1, 3).reshape(qweight.shape[0] * qweight.shape[2], -1)[:n, :k]


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per group of 32 along K, as GGUF Q4_1: w ~ q * scale + min, q in [0, 15], scale
    and min kept in float16. Packed two per byte in GGUF order: byte i of a group holds element i
    (low nibble) and element i + 16 (high nibble)."""
    n, k = weight.shape
    if k % INT4_GROUP:
        raise ValueError(f"int4 needs the input size ({k}) to be a multiple of {INT4_GROUP}")
    w = weight.float().view(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    # codes on the grid that is stored: float16 scale and min
    scale = ((hi - lo) / 15.0).clamp_min(1e-7).half()
    lo = lo.half()
    q = torch.round((w - lo.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15).to(torch.uint8)
    half = INT4_GROUP // 2
    packed = q[..., :half] | (q[..., half:] << 4)
    return packed.reshape(n, k // 2).contiguous(), scale.contiguous(), lo.contiguous()


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    n = packed.shape[0]
    groups = scale.shape[1]
    p = packed.view(n, groups, INT4_GROUP // 2)
    q = torch.cat((p & 0xF, p >> 4), dim=-1).float()
    return (q * scale.float()[..., None] + minimum.float()[..., None]).view(n, groups * INT4_GROUP).to(dtype)
