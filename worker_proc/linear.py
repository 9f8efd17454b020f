"""Linear layers: dense (the checkpoint's weights in the compute dtype) and weight-only
quantized (`--quantization fp16 | int8 | int4`), all computed through `Ops`."""

from __future__ import annotations

import torch
from torch import nn

from worker_proc.ops import (INT4_GROUP, Ops, dequantize_int4, int8_panels, quantize_int4, quantize_int8,
                             unpack_half)
from worker_proc.tensor_parallel import TPGroup

QUANTIZATIONS = ("none", "fp16", "int8", "int4")


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, ops: Ops, input_sharded: bool = False,
                 gated: bool = False):
        super().__init__()
        self.ops = ops
        # holds some input columns of a row-parallel layer (tensor parallelism): its output is a
        # partial sum, and a row's int8 scale comes from every rank's columns
        self.input_sharded = input_sharded
        # an MLP's fused [gate; up]: Ops.silu_mul_linear may compute silu(gate) * up in the kernel
        self.gated = gated
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        # The weight as the kernel's panels read it (see pack_weight); not part of the checkpoint.
        self.register_buffer("packed", None, persistent=False)
        # The weight in oneDNN's layout for torch's GEMM where loom's kernel does not take the rows
        # (Ops.pack_onednn); a plain attribute: an opaque mkldnn tensor, never saved or moved.
        self.onednn = None

    def pack_weight(self) -> None:
        """Lays the weight out once for loom's kernel (call after loading and any dtype cast). The
        [N, K] weight stays: larger inputs take torch's GEMM, and ties share it."""
        self.packed = self.ops.pack_dense(self.weight.detach(), gated=self.gated and self.bias is None)
        self.onednn = self.ops.pack_onednn(self.weight, self.packed is not None)

    def streamed_tensors(self) -> list[torch.Tensor]:
        """What a small step reads of this layer (for the weights' huge-page region): with float32
        panels, not the [N, K] weight (left to torch's GEMM above the panels' rows and to a last
        partial panel); bfloat16 keeps it (one row streams it)."""
        weight = [] if self.packed is not None and self.weight.dtype == torch.float32 else [self.weight]
        return [*weight, *(t for t in (self.packed, self.bias) if t is not None)]

    @property
    def packed_gated(self) -> bool:
        """Whether `packed` holds [gate; up] for the fused silu(gate) * up (pack_dense_bf16)."""
        return self.packed is not None and self.packed.dim() == 6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.dense_linear(x, self.weight, self.bias, None if self.packed_gated else self.packed,
                                     self.onednn)

    def kernel_spec(self) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The weights as the compiled layer stack takes them (cpu_kernels/layer_stack.cpp)."""
        return [self.weight] + ([self.packed] if self.packed is not None else []), self.bias


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops: Ops,
                 row_absmax: torch.Tensor | None = None):
        super().__init__()
        self.ops = ops
        q, scale = quantize_int8(weight, row_absmax)
        self.register_buffer("qweight", ops.pack_int8(q, weight.dtype))
        self.register_buffer("scale", scale)
        self.bias = bias

    @property
    def integer_gemm(self) -> bool:
        """Whether the kernels take this layer at every row count (the integer GEMM's panels)."""
        return int8_panels(self.qweight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.int8_linear(x, self.qweight, self.scale, self.bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.ops.dequantize_int8(self.qweight, self.scale, dtype)

    def kernel_spec(self) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        return [self.qweight, self.scale], self.bias


class HalfLinear(nn.Module):
    """float16 weights: half the bytes of float32 to stream; where the CPU has AVX512-FP16 the
    products run in float16 too (worker_proc/cpu_kernels/half_linear.cpp)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops: Ops):
        super().__init__()
        self.ops = ops
        self.out_features, self.in_features = weight.shape
        self.register_buffer("qweight", ops.pack_half(weight))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.half_linear(x, self.qweight, self.out_features, self.bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The float16 weights [N, K] in `dtype`."""
        return unpack_half(self.qweight, self.out_features, self.in_features).to(dtype)

    def kernel_spec(self) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        return [self.qweight, torch.tensor([self.out_features])], self.bias


class Int4Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops: Ops):
        super().__init__()
        self.ops = ops
        q, scale, minimum = quantize_int4(weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("minimum", minimum)
        # the same weights in the integer GEMM's panels (more than one row), where the kernels have it
        self.register_buffer("panels", ops.pack_int4_panels(q, scale, minimum))
        self.bias = bias

    @property
    def integer_gemm(self) -> bool:
        """Whether the kernels take this layer at every row count (the integer GEMM's panels)."""
        return self.panels is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.int4_linear(x, self.qweight, self.scale, self.minimum, self.bias, self.panels)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int4(self.qweight, self.scale, self.minimum, dtype)

    def kernel_spec(self) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        panels = [] if self.panels is None else [self.panels]
        return [self.qweight, self.scale, self.minimum, *panels], self.bias


def quantize_linears(model: nn.Module, scheme: str, tp: TPGroup | None = None) -> int:
    """Replaces every `Linear` in `model` by its quantized form (call after the dtype cast: the
    scales stay float32). Under tensor parallelism every rank calls it on its shard; int8 rows
    split across the ranks take the whole row's scale, so the codes are those of one rank.
    Returns how many were replaced."""
    if scheme == "none":
        return 0
    cls = {"fp16": HalfLinear, "int8": Int8Linear, "int4": Int4Linear}.get(scheme)
    if cls is None:
        raise ValueError(f"--quantization {scheme!r}: choose one of {', '.join(QUANTIZATIONS)}")
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, Linear)]
    for parent, name, child in targets:
        bias = None if child.bias is None else child.bias.detach()
        weight = child.weight.detach()
        if cls is HalfLinear:
            setattr(parent, name, HalfLinear(weight, bias, child.ops))
            continue
        # int4 groups are 32 inputs: a linear with another input size keeps 8 bits, and so does the
        # LM head (most of int4's distance from the float model; llama.cpp's Q4 files keep it at 8)
        if cls is Int4Linear and weight.shape[1] % INT4_GROUP == 0 and name != "lm_head":
            setattr(parent, name, Int4Linear(weight, bias, child.ops))
            continue
        absmax = None
        if child.input_sharded and tp is not None and tp.size > 1:
            absmax = tp.all_reduce_max(weight.abs().amax(dim=1).float())
        setattr(parent, name, Int8Linear(weight, bias, child.ops, absmax))
    return len(targets)


def pack_dense_weights(model: nn.Module) -> None:
    """Packs every dense `Linear`'s weight for loom's kernel (after loading, casting and
    quantization)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack_weight()
