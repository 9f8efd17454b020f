// The kernels' entry points, each defined in its own file: what bindings.cpp exposes to Python
// and what layer_stack.cpp calls directly. Only the two files that bind to Python include
// pybind11 and torch's Python headers (the heaviest part of the build); the others take ATen's
// Tensor and the few operators they call (ATen/ops/*.h), not all of torch (torch/types.h): on 2
// cores the build takes ~70 s instead of ~110.
#pragma once
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace loom {
// Row tiles of a register-tile kernel: `tile` rows each, except that a last tile of 1 to
// `short_max` rows (too few independent sums to keep the multiply-adds busy) and the full tile
// before it become two of about equal size. The rows of the tile that starts at row r of m.
inline int64_t row_tile_at(int64_t r, int64_t m, int64_t tile, int64_t short_max) {
  const int64_t left = m - r, rest = m % tile;
  return rest && rest <= short_max && left == tile + rest ? (left + 1) / 2 : std::min(tile, left);
}
}  // namespace loom

at::Tensor paged_attention(at::Tensor q, at::Tensor kv, at::Tensor req_to_token, at::Tensor req_idx,
                           at::Tensor token_starts, at::Tensor extend_lens, at::Tensor seq_lens,
                           double scale);
// paged_attention in two parts: what all layers of a step share (planned from the shape of q
// [num_tokens, num_heads, D]), then one layer's attention. q may be a view with a row stride
// (of fused qkv rows).
struct PagedAttentionPlan;
std::shared_ptr<const PagedAttentionPlan> plan_paged_attention(
    int64_t num_tokens, int64_t num_heads, at::Tensor kv, at::Tensor req_to_token, at::Tensor req_idx,
    at::Tensor token_starts, at::Tensor extend_lens, at::Tensor seq_lens, double scale);
at::Tensor run_paged_attention(const PagedAttentionPlan& plan, at::Tensor q, at::Tensor kv);
// Writes row r of k and v [T, KVH, D] (views with contiguous rows, e.g. of fused qkv) to pool slot
// out_cache_loc[r] of kv [S, 2, KVH, D] (int8: [S, 2, KVH, D + 4], each head row quantized, kv_int8.h).
void store_kv(at::Tensor kv, at::Tensor out_cache_loc, at::Tensor k, at::Tensor v);
// packed: pack_dense_f32(w) (or empty / none: the kernel packs what it needs per call).
at::Tensor linear_dense(at::Tensor x, at::Tensor w, std::optional<at::Tensor> packed = std::nullopt);
at::Tensor pack_dense_f32(at::Tensor w);
// bfloat16 on AMX tiles, or vdpbf16ps without them (amx_linear.cpp): pack_dense_bf16 lays W [N, K]
// out for linear_packed_bf16 (empty where the build has neither, or N or K is not a multiple of 32);
// gated: W is an MLP's [gate; up] and linear_packed_bf16 returns silu(gate) * up. packed_bf16_rows:
// the rows of x up to which the packed kernel is used (every count where it builds; 0: no packing).
bool amx_bf16();
int64_t packed_bf16_rows();
at::Tensor pack_dense_bf16(at::Tensor w, bool gated = false);
at::Tensor linear_packed_bf16(at::Tensor x, at::Tensor packed);
at::Tensor linear_int8(at::Tensor x, at::Tensor w, at::Tensor scale);
at::Tensor pack_int8(at::Tensor w);
// linear_int4: panels (pack_int4_panels of the same weights) take every x of more than one row
// (of one row too on VNNI builds).
at::Tensor linear_int4(at::Tensor x, at::Tensor w, at::Tensor scale, at::Tensor minimum,
                       std::optional<at::Tensor> panels = std::nullopt);
bool quantized_int8_activations(at::ScalarType dtype);
// int4 and int8 linears of any row count (integer_panels.cpp): the weights in panels of 16 output
// features (AVX2) or 32 (AVX512-VNNI), x quantized to int8 per group of 32. pack_int4_panels lays
// linear_int4's codes, scales and mins out, linear_int4_panels(x, panels, n) = x @ W.T [M, n];
// pack_int8_panels lays int8 [N, K] out (pack_int8), linear_int8_panels(x, panels, scale) =
// x @ (W * scale).T. integer_panels(): whether this build has them (AVX2 or AVX512-VNNI).
bool integer_panels();
at::Tensor pack_int4_panels(at::Tensor w, at::Tensor scale, at::Tensor minimum);
at::Tensor linear_int4_panels(at::Tensor x, at::Tensor panels, int64_t n);
at::Tensor pack_int8_panels(at::Tensor w);
at::Tensor unpack_int8_panels(at::Tensor panels, int64_t n);
at::Tensor linear_int8_panels(at::Tensor x, at::Tensor panels, at::Tensor scale);
// int8 and int4 panels on AMX tiles (amx_linear.cpp): each group of column blocks widened to
// bfloat16 (integer_panels.cpp's *_panel_tile_bf16) into an L2 buffer, then the bfloat16 tile
// products, with x in bfloat16 (not quantized). linear_panels_amx(x, panels, n, scale, gated) =
// x @ W.T [M, n] (int8: scale [n]; int4: none), or silu(gate) * up [M, n / 2] where gated (W an
// MLP's [gate; up]); amx_panel_rows(): the rows from which it beats the integer panels (0: no AMX).
int64_t amx_panel_rows();
bool amx_panels_take(const at::Tensor& panels, int64_t n);  // n outputs fill blocks of 32 (gated too)
at::Tensor linear_panels_amx(at::Tensor x, at::Tensor panels, int64_t n, std::optional<at::Tensor> scale,
                             bool gated);
void int8_panel_tile_bf16(const uint8_t* panels, int64_t groups, const float* scale, int64_t tile,
                          at::BFloat16* dst, int64_t group_stride);
void int4_panel_tile_bf16(const uint8_t* panels, int64_t groups, int64_t tile, at::BFloat16* dst,
                          int64_t group_stride);
// float16 weights (--quantization fp16): pack_half lays W [N, K] out for linear_half, which
// returns x @ W.T [M, n] in x's dtype.
at::Tensor pack_half(at::Tensor w);
at::Tensor linear_half(at::Tensor x, at::Tensor packed, int64_t n);
bool half_products();
bool dense_bf16_dot();
int64_t dense_f32_rows();
at::Tensor dequantize_int8(at::Tensor w, at::Tensor scale, at::ScalarType dtype);
at::Tensor dequantize_int4(at::Tensor w, at::Tensor scale, at::Tensor minimum, at::ScalarType dtype);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
at::Tensor silu_mul(at::Tensor x);
void rope_(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin, int64_t heads,
           int64_t head_dim);

at::Tensor argmax_rows(at::Tensor x);
// the tensor-parallel collectives through shared memory (shared_memory_reduce.cpp)
int64_t shared_reduce_slot_bytes(const at::Tensor& region, int64_t size);
void shared_memory_all_reduce(at::Tensor region, int64_t rank, int64_t size, int64_t seq, at::Tensor x);
std::vector<at::Tensor> shared_memory_exchange(at::Tensor region, int64_t rank, int64_t size, int64_t seq, at::Tensor x);

// Team forms (team.h), for the layer stack's one parallel region a step: every thread of the
// region calls one with the same arguments; each ends at the team's barrier, except the linears,
// which leave it to the caller.
// The plain entry points above check what these take as given. bfloat16 first:
namespace loom {
class BlockClaims;
}
int64_t packed_bf16_cols(const at::Tensor& packed);  // y's columns of pack_dense_bf16's weights
// y [m, packed_bf16_cols] = x [m, K] @ W.T (silu(gate) * up where gated); claims reset to the
// packed blocks (packed.size(0)) before the region. Ends without a barrier: the caller's.
void linear_packed_bf16_team(const at::BFloat16* x, int64_t m, const at::Tensor& packed, at::BFloat16* y,
                             loom::BlockClaims& claims);
// linear_panels_amx's team form: claims reset to amx_panel_blocks(n, gated) before the region.
int64_t amx_panel_blocks(int64_t n, bool gated);
void linear_panels_amx_team(const at::BFloat16* x, int64_t m, int64_t k, const at::Tensor& panels, int64_t n,
                            const float* scale, bool gated, at::BFloat16* y, loom::BlockClaims& claims);
// One row of x without AMX (linear_dense's path there): y [n] = x [K] @ W.T, W [n, K] unpacked;
// gated: W = an MLP's [gate; up] [2 inter, K] and y [inter] = silu(gate) * up (inter a multiple of 16)
void linear_row_bf16_team(const at::BFloat16* x, const at::BFloat16* w, int64_t n, int64_t k, at::BFloat16* y);
void gated_row_bf16_team(const at::BFloat16* x, const at::BFloat16* w, int64_t inter, int64_t k, at::BFloat16* y);
// What a model adds to its qkv projection's rows before RoPE, each null where it has none: a bias
// over the (q_heads + 2 kv_heads) * head_dim columns (Qwen2), then per-head RMSNorms of the q
// heads and of the k heads (Qwen3), each computed as rms_norm computes the heads' rows.
template <typename T>
struct QkvExtras {
  const T* bias = nullptr;
  const T* q_norm = nullptr;
  const T* k_norm = nullptr;
  float eps = 0.f;
};
void rms_norm_team(const at::BFloat16* x, at::BFloat16* residual, const at::BFloat16* weight, at::BFloat16* out,
                   int64_t rows, int64_t dim, double eps);  // dim a multiple of 16
// extras, then rope_ on each row's q and k heads (head_dim a multiple of 32), then its k and v
// heads to pool slot slots[r] of a bfloat16 kv [S, 2, kv_heads, head_dim]
void rope_store_kv_team(at::BFloat16* qkv, int64_t rows, int64_t row_stride, const int64_t* positions,
                        const float* cos, const float* sin, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                        at::BFloat16* kv, const int64_t* slots,
                        const QkvExtras<at::BFloat16>& extras);
int64_t paged_attention_partial_floats(const PagedAttentionPlan& plan);  // partials' size for the team form
// run_paged_attention of q (rows q_row_stride apart) over the pool into out [N, H * D]
void run_paged_attention_team(const PagedAttentionPlan& plan, const at::BFloat16* q, int64_t q_row_stride,
                              const at::BFloat16* kv, at::BFloat16* out, float* partials);
// the same two over an int8 pool [S, 2, kv_heads, head_dim + 4] (kv_int8.h)
void rope_store_kv_team(at::BFloat16* qkv, int64_t rows, int64_t row_stride, const int64_t* positions,
                        const float* cos, const float* sin, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                        int8_t* kv, const int64_t* slots, const QkvExtras<at::BFloat16>& extras);
void run_paged_attention_team(const PagedAttentionPlan& plan, const at::BFloat16* q, int64_t q_row_stride,
                              const int8_t* kv, at::BFloat16* out, float* partials);
// float32 throughout (the pool float32 or float16), as the op-by-op functions compute each row:
// y [m, n_out] = x [m, K] @ W.T on pack_dense_f32's panels where f32_panels_team_takes(m, n_out)
// (AVX2 / AVX-512 builds; claims reset to n_out / the panels' width; no barrier at the end)
bool f32_panels_team_takes(int64_t m, int64_t n_out);
void linear_f32_panels_team(const float* x, int64_t m, int64_t k, const float* packed, float* y, int64_t n_out,
                            loom::BlockClaims& claims);
void rms_norm_team(const float* x, float* residual, const float* weight, float* out, int64_t rows, int64_t dim,
                   double eps);
void silu_mul_team(const float* x, float* out, int64_t rows, int64_t inter);  // x [rows, 2 inter] = [gate | up]
void silu_mul_team(const at::BFloat16* x, at::BFloat16* out, int64_t rows, int64_t inter);
void rope_store_kv_team(float* qkv, int64_t rows, int64_t row_stride, const int64_t* positions, const float* cos,
                        const float* sin, int64_t q_heads, int64_t kv_heads, int64_t head_dim, float* kv,
                        const int64_t* slots, const QkvExtras<float>& extras);
void rope_store_kv_team(float* qkv, int64_t rows, int64_t row_stride, const int64_t* positions, const float* cos,
                        const float* sin, int64_t q_heads, int64_t kv_heads, int64_t head_dim, at::Half* kv,
                        const int64_t* slots, const QkvExtras<float>& extras);
void run_paged_attention_team(const PagedAttentionPlan& plan, const float* q, int64_t q_row_stride, const float* kv,
                              float* out, float* partials);
void run_paged_attention_team(const PagedAttentionPlan& plan, const float* q, int64_t q_row_stride,
                              const at::Half* kv, float* out, float* partials);
void rope_store_kv_team(float* qkv, int64_t rows, int64_t row_stride, const int64_t* positions, const float* cos,
                        const float* sin, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int8_t* kv,
                        const int64_t* slots, const QkvExtras<float>& extras);
void run_paged_attention_team(const PagedAttentionPlan& plan, const float* q, int64_t q_row_stride, const int8_t* kv,
                              float* out, float* partials);
// The integer panels (pack_int8_panels' int8 weights with their float32 scale [n_out];
// pack_int4_panels' int4 ones, from int4_panel_rows() rows): the team quantizes x into scratch
// (codes m * k, scales 2 * m * k / 32, offsets m * k / 32), meets, then takes the panels (no barrier).
struct IntegerScratch {
  int8_t* codes;
  float* scales;
  int32_t* offsets;
};
int64_t int4_panel_rows();
void linear_int8_panels_team(const float* x, int64_t m, int64_t k, const at::Tensor& panels, const float* scale,
                             int64_t n_out, const IntegerScratch& scratch, float* y, loom::BlockClaims& claims);
void linear_int4_panels_team(const float* x, int64_t m, int64_t k, const at::Tensor& panels, int64_t n_out,
                             const IntegerScratch& scratch, float* y, loom::BlockClaims& claims);
// (bfloat16 x and y: x quantized as the op-by-op linear_int8 / linear_int4 quantize it)
void linear_int8_panels_team(const at::BFloat16* x, int64_t m, int64_t k, const at::Tensor& panels, const float* scale,
                             int64_t n_out, const IntegerScratch& scratch, at::BFloat16* y, loom::BlockClaims& claims);
void linear_int4_panels_team(const at::BFloat16* x, int64_t m, int64_t k, const at::Tensor& panels, int64_t n_out,
                             const IntegerScratch& scratch, at::BFloat16* y, loom::BlockClaims& claims);
