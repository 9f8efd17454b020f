// Python bindings of loom's CPU kernels (one module; each kernel lives in its own file).
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

#include <string>
#include <vector>

void bind_layer_stack(pybind11::module_& m);  // layer_stack.cpp

// The compiler's target macros that choose the kernels' code paths (cpu_kernels.PATH_MACROS), as
// this build saw them.
static std::vector<std::string> target_macros() {
  std::vector<std::string> defined;
#define LOOM_NOTE(macro) defined.push_back(#macro)
#ifdef __FMA__
  LOOM_NOTE(__FMA__);
#endif
#ifdef __F16C__
  LOOM_NOTE(__F16C__);
#endif
#ifdef __AVX2__
  LOOM_NOTE(__AVX2__);
#endif
#ifdef __AVX512F__
  LOOM_NOTE(__AVX512F__);
#endif
#ifdef __AVX512BW__
  LOOM_NOTE(__AVX512BW__);
#endif
#ifdef __AVX512VNNI__
  LOOM_NOTE(__AVX512VNNI__);
#endif
#ifdef __AVX512BF16__
  LOOM_NOTE(__AVX512BF16__);
#endif
#ifdef __AVX512FP16__
  LOOM_NOTE(__AVX512FP16__);
#endif
#ifdef __AMX_BF16__
  LOOM_NOTE(__AMX_BF16__);
#endif
#undef LOOM_NOTE
  return defined;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_layer_stack(m);
  m.def("target_macros", &target_macros, "the target macros (instruction sets) this build's code paths were chosen by");
  m.def("paged_attention", &paged_attention, "causal attention of a packed batch over the paged KV pool");
  m.def("store_kv", &store_kv, "each row's K and V to its pool slot (kv, out_cache_loc, k, v)");
  m.def("linear_dense", &linear_dense, "x @ w.T (float32 / bfloat16 weights; packed: from pack_dense_f32 / pack_dense_bf16)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("packed") = pybind11::none());
  m.def("pack_dense_f32", &pack_dense_f32, "float32 weights [N, K] in the panels of linear_dense (empty where unused)");
  m.def("pack_dense_bf16", &pack_dense_bf16,
        "bfloat16 weights [N, K] in AMX tiles' VNNI form for linear_dense (empty where unused); gated: [gate; up], and linear_dense returns silu(gate) * up",
        pybind11::arg("w"), pybind11::arg("gated") = false);
  m.def("packed_bf16_rows", &packed_bf16_rows, "rows of x up to which linear_dense takes pack_dense_bf16's weights (0: never packed)");
  m.def("linear_panels_amx", &linear_panels_amx, "x @ W.T (silu(gate) * up where gated) on int8 (with scale) or int4 panels, widened to bfloat16 on AMX tiles",
        pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("n"), pybind11::arg("scale") = pybind11::none(),
        pybind11::arg("gated") = false);
  m.def("amx_panel_rows", &amx_panel_rows, "rows of x from which int8 / int4 panels run on AMX tiles (0: no AMX)");
  m.def("amx_bf16", &amx_bf16, "whether this build multiplies bfloat16 linears on AMX tiles (and the OS allows them)");
  m.def("linear_int8", &linear_int8, "x @ w.T, int8 weights (as quantized: few rows of x; or from pack_int8: any count) with per-row scales");
  m.def("pack_int8", &pack_int8, "int8 weights [N, K] in the panels of linear_int8's integer GEMM (VNNI and AVX2 builds)");
  m.def("linear_int4", &linear_int4, "x @ w.T on packed int4 weights with group scale/min (panels: from pack_int4_panels, for more than one row; on VNNI builds for one too)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("scale"), pybind11::arg("minimum"), pybind11::arg("panels") = pybind11::none());
  m.def("integer_panels", &integer_panels, "whether this build has the integer GEMM panels (linear_int4_panels; pack_int8's layout): AVX2 or AVX512-VNNI integer products");
  m.def("pack_int4_panels", &pack_int4_panels, "int4 codes [N, K/2] with float16 scale/min [N, K/32] in the panels of linear_int4_panels");
  m.def("int4_panel_rows", &int4_panel_rows, "rows of x from which linear_int4 (and a step's layers) read the panels, not the plain codes");
  m.def("linear_int4_panels", &linear_int4_panels, "x @ w.T [M, n] on pack_int4_panels' weights, int8 activations per group of 32");
  m.def("dense_f32_rows", &dense_f32_rows, "rows of x up to which float32 linear_dense beats torch's GEMM (0: few)");
  m.def("dense_bf16_dot", &dense_bf16_dot, "whether bfloat16 linears use bf16 dot products (vdpbf16ps)");
  m.def("quantized_int8_activations", &quantized_int8_activations,
        "whether linear_int8 (on pack_int8's layout) and linear_int4 quantize activations of this dtype to int8 per group of 32 (integer dot products)");
  m.def("pack_half", &pack_half, "weights [N, K] as float16 panels for linear_half");
  m.def("linear_half", &linear_half, "x @ w.T [M, n] on pack_half's float16 weights, any row count");
  m.def("half_products", &half_products, "whether linear_half multiplies in float16 (AVX512-FP16) or widens the weights to float32");
  m.def("dequantize_int8", &dequantize_int8, "int8 weights widened to float32 / bfloat16");
  m.def("dequantize_int4", &dequantize_int4, "int4 weights widened to float32 / bfloat16");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim");
  m.def("add_rms_norm", &add_rms_norm, "residual += x (in place), then RMSNorm of residual");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [gate | up] row");
  m.def("argmax_rows", &argmax_rows, "first index of each row's largest value (greedy sampling)");
  m.def("shared_reduce_slot_bytes", &shared_reduce_slot_bytes,
        "the largest tensor (bytes) shared_memory_all_reduce / _exchange take in a region for `size` ranks");
  // (the GIL released while it waits for the other ranks: they may be threads of this process)
  m.def("shared_memory_all_reduce", &shared_memory_all_reduce,
        "sums x (float32 / bfloat16, in place) over the ranks mapping `region`; call seq = 1, 2, ... on every rank",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("shared_memory_exchange", &shared_memory_exchange,
        "every rank's x (views of the region, valid until this rank's next call); call seq as for the all-reduce",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rope_", &rope_, "rotary embedding in place on the leading heads of each row");
}
