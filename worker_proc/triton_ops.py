"""The op layer on a GPU: Triton kernels for the fused norms and the activation, and a matmul
with fixed tiles for deterministic mode. `GpuOps` is `Ops` with these in place of the CPU
kernels; the torch versions in `Ops` stay the reference they are tested against (they round to
the activation dtype at the same points).

- `rms_norm` / `add_rms_norm`: one program per row (the residual add, its rounding to the
  activation dtype and the norm in one pass over the row).
- `silu_mul`: [T, 2I] = [gate | up] -> silu(gate) * up in one pass.
- `rope_`: the rotary embedding of a row's q and k heads in place, one program per token (the
  torch form is ~10 launches a layer: gathers, casts, a concatenation, products).
- `matmul`: y = x @ w.T (+ bias), w dense or int8 with a per-row scale (weight-only int8, the
  codes widened in registers), tiles of fixed size whatever the number of rows, so each output's
  reduction runs in the same order at batch 1 and inside any batch (batch-invariant, for
  `--enable-deterministic-inference`; cuBLAS picks its algorithm by shape, so its results for a
  row change with the batch around it).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from worker_proc.ops import Ops, dequantize_int4

# deterministic mode's tiles: the same for every shape (what makes the results batch-invariant)
MATMUL_BLOCK_M, MATMUL_BLOCK_N, MATMUL_BLOCK_K = 64, 64, 64
# a launch option of the compiler; the interpreter has no fusion to turn off (and takes no such option)
NO_FP_FUSION = {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}


@triton.jit
def _add_rms_norm_kernel(X, R, W, Y, stride_x, stride_r, stride_y, n_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=valid, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=valid, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(R + row * stride_r + cols, x, mask=valid)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    w = tl.load(W + cols, mask=valid, other=0.0)
    y = (h * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=valid)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_norm(x) over the last dim, x [T, N] with unit stride on N."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _add_rms_norm_kernel[(x.shape[0],)](x, x, weight, y, x.stride(0), 0, y.stride(0), x.shape[1], eps,
                                            HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(x.shape[1]))
    return y


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x), the sum written into `residual` in place."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _add_rms_norm_kernel[(x.shape[0],)](x, residual, weight, y, x.stride(0), residual.stride(0), y.stride(0),
                                            x.shape[1], eps, HAS_RESIDUAL=True,
                                            BLOCK=triton.next_power_of_2(x.shape[1]))
    return y, residual


@triton.jit
def _silu_mul_kernel(GU, Y, stride_gu, stride_y, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < n_cols
    gate = tl.load(GU + row * stride_gu + cols, mask=valid, other=0.0)
    up = tl.load(GU + row * stride_gu + n_cols + cols, mask=valid, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(Y + row * stride_y + cols, (act.to(tl.float32) * up.to(tl.float32)).to(Y.dtype.element_ty), mask=valid)


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, y, gate_up.stride(0), y.stride(0), n,
                                                     BLOCK=min(block, triton.next_power_of_2(n)))
    return y


@triton.jit
def _rope_kernel(QKV, positions, COS, SIN, stride_row, stride_pos, heads, half,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + row).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    valid = (h < heads) & (d < half)
    first = QKV + row * stride_row + h * (2 * half) + d
    x1 = tl.load(first, mask=valid, other=0.0)
    x2 = tl.load(first + half, mask=valid, other=0.0)
    dt = x1.dtype
    # cos/sin rounded to the activation dtype and each product and the sum rounded to it, as the
    # torch reference (and HF) compute it: the same bits, not just close ones
    c1 = tl.load(COS + pos * stride_pos + d, mask=d < half, other=0.0).to(dt).to(tl.float32)
    c2 = tl.load(COS + pos * stride_pos + half + d, mask=d < half, other=0.0).to(dt).to(tl.float32)
    s1 = tl.load(SIN + pos * stride_pos + d, mask=d < half, other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(SIN + pos * stride_pos + half + d, mask=d < half, other=0.0).to(dt).to(tl.float32)
    a1 = (x1.to(tl.float32) * c1).to(dt).to(tl.float32)
    b1 = (-x2.to(tl.float32) * s1).to(dt).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2).to(dt).to(tl.float32)
    b2 = (x1.to(tl.float32) * s2).to(dt).to(tl.float32)
    tl.store(first, (a1 + b1).to(dt), mask=valid)
    tl.store(first + half, (a2 + b2).to(dt), mask=valid)


def rope_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
          head_dim: int) -> None:
    """Rotates the first `heads` heads of each row of qkv [T, W] (unit stride on W) in place;
    cos/sin [positions, head_dim] float32 tables."""
    if len(qkv):
        half = head_dim // 2
        # no fused multiply-adds: each product rounds on its own, as in the reference
        _rope_kernel[(len(qkv),)](qkv, positions, cos, sin, qkv.stride(0), cos.stride(0), heads, half,
                                  BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(half),
                                  **NO_FP_FUSION)


@triton.jit
def _matmul_kernel(X, W, S, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = offs_m < M
    n_valid = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        x = tl.load(X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(W + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                    mask=n_valid[None, :] & k_valid[:, None], other=0.0)
        acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    if HAS_SCALE:
        acc = acc * tl.load(S + offs_n, mask=n_valid, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_valid[:, None] & n_valid[None, :])


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T ([N, K], dense in x's dtype or int8 codes with `scale` [N] float32)
    (+ bias), in fixed tiles: row i of the result is the same whatever M is."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    grid = (triton.cdiv(m, MATMUL_BLOCK_M), triton.cdiv(n, MATMUL_BLOCK_N))
    _matmul_kernel[grid](x, weight, scale if scale is not None else weight, bias if bias is not None else weight, y,
                         m, n, k, x.stride(0), weight.stride(0), y.stride(0),
                         HAS_SCALE=scale is not None, HAS_BIAS=bias is not None,
                         PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                         BLOCK_M=MATMUL_BLOCK_M, BLOCK_N=MATMUL_BLOCK_N, BLOCK_K=MATMUL_BLOCK_K)
    return y


class GpuOps(Ops):
    """`Ops` on a GPU: the Triton norms and activation; with `deterministic`, every linear through
    the fixed-tile matmul (int8 included; int4 widens its weights first, then the same matmul).
    Without it, dense linears are cuBLAS's (F.linear), int8 the fused Triton matmul, int4 widened
    by torch ops."""

    def __init__(self, deterministic: bool = False):
        super().__init__()
        self.deterministic = deterministic

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.contiguous().view(-1, x.shape[-1])  # (Qwen3's q/k norms: [T, heads, Dh])
        return rms_norm(rows, weight, eps).view(x.shape)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x.contiguous(), residual if residual.is_contiguous() else residual.contiguous(),
                            weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up.contiguous())

    def rope_(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              heads: int, head_dim: int) -> None:
        if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride(0) != cos.stride(0):
            return super().rope_(qkv, positions, cos, sin, heads, head_dim)
        rope_(qkv, positions, cos, sin, heads, head_dim)

    def dense_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     packed: torch.Tensor | None = None, onednn: torch.Tensor | None = None) -> torch.Tensor:
        if self.deterministic:
            return matmul(x, weight, bias)
        return F.linear(x, weight, bias)

    def int8_linear(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        return matmul(x, qweight, bias, scale)

    def int4_linear(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                    bias: torch.Tensor | None, panels: torch.Tensor | None = None) -> torch.Tensor:
        widened = dequantize_int4(qweight, scale, minimum, x.dtype)
        return matmul(x, widened, bias) if self.deterministic else F.linear(x, widened, bias)
