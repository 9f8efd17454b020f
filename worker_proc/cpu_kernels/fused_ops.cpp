// Fused element-wise ops of a decoder layer, so a decode step makes a few calls per layer
// instead of dozens of small torch ops. Each rounds to the activation dtype exactly where the
// unfused torch code does (worker_proc/ops.py holds that reference), so outputs match it in
// float32 and within one bf16 rounding step elsewhere.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <algorithm>
#include <bit>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "kv_int8.h"
#include "vec_math.h"

namespace {

// float -> bfloat16 bits, round to nearest even (NaN stays NaN), in integer ops only so the
// loops around it vectorise (c10::BFloat16's conversion branches).
inline uint32_t bf16_bits(float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : rounded;
}

// v rounded to T and back: where the unfused torch code rounds an intermediate to the dtype.
template <typename T>
inline float round_to(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return std::bit_cast<float>(bf16_bits(v));
  }
}

template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void narrow(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) bits[i] = static_cast<uint16_t>(bf16_bits(src[i]) >> 16);
  }
}

#if defined(__AVX512BF16__)
// bfloat16 rows 16 at a time (loom::load16 widens, store16_bf16 and round_bf16 round to nearest
// even, as bf16_bits). The generic loops below spend most of their time converting one value at a time.
inline __m512 load_bf16(const at::BFloat16* p) { return reinterpret_cast<__m512>(loom::load16(p)); }
using loom::round_bf16;
using loom::store16_bf16;

// Up to this many rows these run on the calling thread: a decode step's ~1-2 us of work costs less
// than waking the other threads and waiting for them (each op a parallel region, ~90 a step).
constexpr int64_t kSerialRows = 64;

// One row: out = weight * T(h * rsqrt(mean(h^2) + eps)), h = x (+ residual, stored back).
inline void rms_norm_row_bf16(const at::BFloat16* xr, at::BFloat16* res, const at::BFloat16* weight, at::BFloat16* out,
                              int64_t dim, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    __m512 h = load_bf16(xr + i);
    if (res) {
      h = round_bf16(_mm512_add_ps(h, load_bf16(res + i)));
      store16_bf16(res + i, h);
    }
    ss = _mm512_fmadd_ps(h, h, ss);
  }
  const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(dim) + eps);
  const at::BFloat16* h = res ? res : xr;
  for (int64_t i = 0; i < dim; i += 16)
    store16_bf16(out + i, _mm512_mul_ps(load_bf16(weight + i), round_bf16(_mm512_mul_ps(load_bf16(h + i), _mm512_set1_ps(inv)))));
}

void rms_norm_bf16(const at::BFloat16* x, at::BFloat16* residual, const at::BFloat16* weight, at::BFloat16* out,
                   int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, kSerialRows, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      rms_norm_row_bf16(x + row * dim, residual ? residual + row * dim : nullptr, weight, out + row * dim, dim, eps);
  });
}

// rope_rows for bf16 with head_dim a multiple of 32 (halves of whole vectors)
inline void rope_row_bf16(at::BFloat16* row, const float* cp, const float* sp, int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t d = 0; d < half; d += 16) {
    // c, s rounded to bf16 as the torch code casts them; the same for every head of the row
    const __m512 c_lo = round_bf16(_mm512_loadu_ps(cp + d)), c_hi = round_bf16(_mm512_loadu_ps(cp + half + d));
    const __m512 s_lo = round_bf16(_mm512_loadu_ps(sp + d)), s_hi = round_bf16(_mm512_loadu_ps(sp + half + d));
    for (int64_t hd = 0; hd < heads; ++hd) {
      at::BFloat16* xh = row + hd * head_dim;
      const __m512 lo = load_bf16(xh + d), hi = load_bf16(xh + half + d);
      // x' = T(T(x * c) + T(rotate_half(x) * s)), rotate_half(x) = [-hi, lo]
      store16_bf16(xh + d, _mm512_add_ps(round_bf16(_mm512_mul_ps(lo, c_lo)),
                                         round_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), hi), s_lo))));
      store16_bf16(xh + half + d, _mm512_add_ps(round_bf16(_mm512_mul_ps(hi, c_hi)), round_bf16(_mm512_mul_ps(lo, s_hi))));
    }
  }
}

void rope_bf16(at::BFloat16* qkv, const int64_t* positions, const float* cos, const float* sin, int64_t rows,
               int64_t row_stride, int64_t heads, int64_t head_dim) {
  at::parallel_for(0, rows, kSerialRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rope_row_bf16(qkv + r * row_stride, cos + positions[r] * head_dim, sin + positions[r] * head_dim, heads, head_dim);
  });
}
#endif

// One row of rms_norm_rows; h and r: dim floats of scratch.
template <typename T>
inline void rms_norm_row(const T* x, T* res, const float* wf, T* out, int64_t dim, float eps, float* h, float* r) {
  widen(x, h, dim);
  if (res) {
    widen(res, r, dim);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) h[i] = round_to<T>(h[i] + r[i]);
    narrow(h, res, dim);
  }
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < dim; ++i) ss += h[i] * h[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) h[i] = wf[i] * round_to<T>(h[i] * inv);
  narrow(h, out, dim);
}

// out = weight * T(x * rsqrt(mean(x^2) + eps)), per row; with a residual: residual += x first
// and the sum is what gets normalised. Work is done in float32 row buffers so the loops vectorise.
template <typename T>
void rms_norm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t dim, float eps) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (dim % 16 == 0) return rms_norm_bf16(x, residual, weight, out, rows, dim, eps);
  }
#endif
  std::vector<float> wf(dim);
  widen(weight, wf.data(), dim);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(dim), r(dim);
    for (int64_t row = begin; row < end; ++row)
      rms_norm_row(x + row * dim, residual ? residual + row * dim : nullptr, wf.data(), out + row * dim, dim, eps,
                   h.data(), r.data());
  });
}

// x [T, 2I] = [gate | up] -> T(T(silu(gate)) * up)  [T, I]
// out[i] = T(T(silu(gate[i])) * up[i]) for n values; g and u: n floats of scratch.
template <typename T>
inline void silu_mul_span(const T* gate, const T* up, T* out, int64_t n, float* g, float* u) {
  widen(gate, g, n);
  widen(up, u, n);
#if defined(__AVX512F__)
  for (int64_t i = 0; i < n; i += 16) {  // (as the gated linear's stores compute it)
    const __mmask16 lanes = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(g + i, lanes, loom::silu16(_mm512_maskz_loadu_ps(lanes, g + i)));
  }
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) g[i] = round_to<T>(round_to<T>(g[i]) * u[i]);
#else
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) g[i] = round_to<T>(round_to<T>(g[i] / (1.f + loom::vexp(-g[i]))) * u[i]);
#endif
  narrow(g, out, n);
}

// x [T, 2I] = [gate | up] -> T(T(silu(gate)) * up)  [T, I]
template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> g(inter), u(inter);
    for (int64_t r = begin; r < end; ++r)
      silu_mul_span(x + r * 2 * inter, x + r * 2 * inter + inter, out + r * inter, inter, g.data(), u.data());
  });
}

// One row of rope_rows: its first `heads` heads; scratch: 3 * head_dim floats.
template <typename T>
inline void rope_row(T* row, const float* cp, const float* sp, int64_t heads, int64_t head_dim, float* scratch) {
  const int64_t half = head_dim / 2;
  float *c = scratch, *s = scratch + head_dim, *h = scratch + 2 * head_dim;
  for (int64_t d = 0; d < head_dim; ++d) { c[d] = round_to<T>(cp[d]); s[d] = round_to<T>(sp[d]); }
  for (int64_t hd = 0; hd < heads; ++hd) {
    T* x = row + hd * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) h[d] = static_cast<float>(x[d]);
    for (int64_t d = 0; d < head_dim; ++d) {
      const float rot = d < half ? -h[d + half] : h[d - half];
      x[d] = static_cast<T>(round_to<T>(h[d] * c[d]) + round_to<T>(rot * s[d]));
    }
  }
}

// Rotary embedding in place on the q and k heads of a fused qkv row:
// x' = T(T(x * c) + T(rotate_half(x) * s)), with c, s rounded to T first (as the torch code).
template <typename T>
void rope_rows(T* qkv, const int64_t* positions, const float* cos, const float* sin, int64_t rows,
               int64_t row_stride, int64_t heads, int64_t head_dim) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (head_dim % 32 == 0) return rope_bf16(qkv, positions, cos, sin, rows, row_stride, heads, head_dim);
  }
#endif
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(3 * head_dim);
    for (int64_t r = begin; r < end; ++r)
      rope_row(qkv + r * row_stride, cos + positions[r] * head_dim, sin + positions[r] * head_dim, heads, head_dim,
               scratch.data());
  });
}

// Index of the first largest value of each row (greedy sampling): a vectorised max over the
// row, then the first position holding it. torch's argmax walks the row element by element
// (~1 ns each: 3 ms for 64 rows of a 49152-token vocabulary). NaNs are skipped.
template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
  using loom::vf;
  const int64_t whole = n / 16 * 16;
  vf m = loom::splat(-INFINITY);
  for (int64_t i = 0; i < whole; i += 16) {
    const vf v = loom::load16(row + i);
    m = v > m ? v : m;
  }
  float best = -INFINITY;
  for (int l = 0; l < 16; ++l) best = m[l] > best ? m[l] : best;
  for (int64_t i = whole; i < n; ++i) best = static_cast<float>(row[i]) > best ? static_cast<float>(row[i]) : best;
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i < whole; i += 16) {
    const __mmask16 hit = _mm512_cmpeq_ps_mask(reinterpret_cast<__m512>(loom::load16(row + i)), _mm512_set1_ps(best));
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i)
    if (static_cast<float>(row[i]) == best) return i;
  return 0;  // every value NaN
}

#define LOOM_DISPATCH(dtype, NAME, ...)                                                        \
  if (dtype == at::kFloat) { using scalar_t = float; __VA_ARGS__(); }                     \
  else if (dtype == at::kBFloat16) { using scalar_t = at::BFloat16; __VA_ARGS__(); }         \
  else TORCH_CHECK(false, NAME ": float32 or bfloat16 expected")

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.scalar_type() == weight.scalar_type(),
              "rms_norm: contiguous x and weight of one dtype expected");
  auto out = at::empty_like(x);
  const int64_t dim = x.size(-1);
  LOOM_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            x.numel() / dim, dim, static_cast<float>(eps));
  });
  return out;
}

// residual += x (in place); returns rms_norm(residual).
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous() &&
                  x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type() &&
                  x.scalar_type() == weight.scalar_type(),
              "add_rms_norm: contiguous x, residual, weight of one shape and dtype expected");
  auto out = at::empty_like(x);
  const int64_t dim = x.size(-1);
  LOOM_DISPATCH(x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.numel() / dim, dim, static_cast<float>(eps));
  });
  return out;
}

at::Tensor silu_mul(at::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && x.size(1) % 2 == 0, "silu_mul: contiguous [T, 2I] expected");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  LOOM_DISPATCH(x.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), x.size(1) / 2);
  });
  return out;
}

// Rotates, in place, the first `heads` heads of each row of qkv [T, row_stride] (q then k are
// adjacent in the fused projection, so q and k heads are rotated in one pass).
void rope_(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin, int64_t heads,
           int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= heads * head_dim, "rope_: qkv [T, W] rows");
  TORCH_CHECK(positions.is_contiguous() && positions.scalar_type() == at::kLong && positions.numel() == qkv.size(0),
              "rope_: int64 positions, one per row");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.size(1) == head_dim && head_dim % 2 == 0,
              "rope_: float32 cos/sin [P, head_dim]");
  LOOM_DISPATCH(qkv.scalar_type(), "rope_", [&] {
    rope_rows<scalar_t>(qkv.data_ptr<scalar_t>(), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                        sin.data_ptr<float>(), qkv.size(0), qkv.stride(0), heads, head_dim);
  });
}

namespace {
// A row's k and v heads (after RoPE), each quantized into its int8 pool row.
template <typename S>
void quantize_kv_heads(int8_t* kv, int64_t slot, const S* k, const S* v, int64_t kv_heads, int64_t head_dim) {
  const int64_t row_bytes = head_dim + loom::kKvScaleBytes;
  for (int64_t h = 0; h < kv_heads; ++h) {
    loom::quantize_kv_row(kv + (slot * 2 * kv_heads + h) * row_bytes, k + h * head_dim, head_dim);
    loom::quantize_kv_row(kv + ((slot * 2 + 1) * kv_heads + h) * row_bytes, v + h * head_dim, head_dim);
  }
}
}  // namespace

void store_kv(at::Tensor kv, at::Tensor out_cache_loc, at::Tensor k, at::Tensor v) {
  TORCH_CHECK(kv.is_contiguous() && kv.dim() == 4 && kv.size(1) == 2, "store_kv: contiguous kv [S, 2, KVH, D]");
  const bool int8_pool = kv.scalar_type() == at::kChar;
  const int64_t head_dim = kv.size(3) - (int8_pool ? loom::kKvScaleBytes : 0), kv_heads = kv.size(2);
  const int64_t rows = k.size(0), width = kv_heads * head_dim, slots = kv.size(0);
  for (const auto& t : {k, v}) {
    const bool rows_contiguous = t.stride(-1) == 1 && (t.dim() == 2 || (t.dim() == 3 && t.stride(1) == t.size(2)));
    TORCH_CHECK(t.scalar_type() == k.scalar_type() && t.size(0) == rows && t.numel() == rows * width && rows_contiguous,
                "store_kv: k and v [T, KVH, D] (or [T, KVH * D]) of one dtype and kv's head shape, each row contiguous");
  }
  TORCH_CHECK(out_cache_loc.is_contiguous() && out_cache_loc.numel() == rows &&
                  (out_cache_loc.scalar_type() == at::kLong || out_cache_loc.scalar_type() == at::kInt),
              "store_kv: one int32/int64 slot per row");
  const bool wide = out_cache_loc.scalar_type() == at::kLong;
  const int64_t* slots64 = wide ? out_cache_loc.data_ptr<int64_t>() : nullptr;
  const int32_t* slots32 = wide ? nullptr : out_cache_loc.data_ptr<int32_t>();
  // rows of k and v (the model's dtype) into slots of the pool's dtype (the same or narrower)
  auto store = [&](auto src_type, auto pool_type) {
    using S = decltype(src_type);
    using P = decltype(pool_type);
    P* pool = kv.data_ptr<P>();
    const S* kp = k.data_ptr<S>();
    const S* vp = v.data_ptr<S>();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t slot = wide ? slots64[r] : slots32[r];
      TORCH_CHECK(slot >= 0 && slot < slots, "store_kv: slot out of the pool");
      loom::convert_row(pool + slot * 2 * width, kp + r * k.stride(0), width);
      loom::convert_row(pool + (slot * 2 + 1) * width, vp + r * v.stride(0), width);
    }
  };
  const auto src = k.scalar_type(), dst = kv.scalar_type();
  if (int8_pool) {
    TORCH_CHECK(src == at::kFloat || src == at::kBFloat16, "store_kv: float32 or bfloat16 k and v into an int8 pool");
    auto quantize = [&](auto src_type) {
      using S = decltype(src_type);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t slot = wide ? slots64[r] : slots32[r];
        TORCH_CHECK(slot >= 0 && slot < slots, "store_kv: slot out of the pool");
        quantize_kv_heads(kv.data_ptr<int8_t>(), slot, k.data_ptr<S>() + r * k.stride(0), v.data_ptr<S>() + r * v.stride(0),
                          kv_heads, head_dim);
      }
    };
    if (src == at::kFloat) quantize(float{});
    else quantize(c10::BFloat16{});
  } else if (src == dst) {
    LOOM_DISPATCH(src, "store_kv", [&] { store(scalar_t{}, scalar_t{}); });
  } else if (src == at::kFloat && dst == at::kHalf) {
    store(float{}, c10::Half{});
  } else if (src == at::kFloat && dst == at::kBFloat16) {
    store(float{}, c10::BFloat16{});
  } else {
    TORCH_CHECK(src == at::kBFloat16 && dst == at::kHalf,
                "store_kv: k and v of kv's dtype, or float32 into a bfloat16 or float16 pool, or bfloat16 into a "
                "float16 one");
    store(c10::BFloat16{}, c10::Half{});
  }
}

// [B, V] -> int64 [B]: the first index of each row's largest value (as torch.argmax, NaNs aside).
at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) > 0, "argmax_rows: contiguous [B, V] expected");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  LOOM_DISPATCH(x.scalar_type(), "argmax_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    int64_t* o = out.data_ptr<int64_t>();
    const int64_t n = x.size(1);
    at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(xp + r * n, n);
    });
  });
  return out;
}

#if defined(__AVX512BF16__)
// Team forms (team.h) for the layer stack's one region: rows split among the team, which meets
// at the loop's closing barrier.
void rms_norm_team(const at::BFloat16* x, at::BFloat16* residual, const at::BFloat16* weight, at::BFloat16* out,
                   int64_t rows, int64_t dim, double eps) {
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    rms_norm_row_bf16(x + r * dim, residual ? residual + r * dim : nullptr, weight, out + r * dim, dim,
                      static_cast<float>(eps));
}

namespace {
// QkvExtras on one row of bfloat16 qkv, as the op-by-op steps compute them: the bias add rounded
// as a bfloat16 tensor's add_, each head's norm by rms_norm's row function.
void add_qkv_extras_bf16(at::BFloat16* row, const QkvExtras<at::BFloat16>& e, int64_t q_heads, int64_t kv_heads,
                         int64_t head_dim) {
  if (e.bias)
    for (int64_t c = 0; c < (q_heads + 2 * kv_heads) * head_dim; c += 16)
      store16_bf16(row + c, _mm512_add_ps(load_bf16(row + c), load_bf16(e.bias + c)));
  if (e.q_norm)
    for (int64_t h = 0; h < q_heads + kv_heads; ++h)
      rms_norm_row_bf16(row + h * head_dim, nullptr, h < q_heads ? e.q_norm : e.k_norm, row + h * head_dim, head_dim,
                        e.eps);
}
}  // namespace

void rope_store_kv_team(at::BFloat16* qkv, int64_t rows, int64_t row_stride, const int64_t* positions,
                        const float* cos, const float* sin, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                        at::BFloat16* kv, const int64_t* slots, const QkvExtras<at::BFloat16>& extras) {
  const int64_t width = kv_heads * head_dim;
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    at::BFloat16* row = qkv + r * row_stride;
    add_qkv_extras_bf16(row, extras, q_heads, kv_heads, head_dim);
    rope_row_bf16(row, cos + positions[r] * head_dim, sin + positions[r] * head_dim, q_heads + kv_heads, head_dim);
    std::memcpy(kv + slots[r] * 2 * width, row + q_heads * head_dim, width * sizeof(at::BFloat16));
    std::memcpy(kv + (slots[r] * 2 + 1) * width, row + (q_heads + kv_heads) * head_dim, width * sizeof(at::BFloat16));
  }
}
#endif

#if defined(__AVX512BF16__)
void rope_store_kv_team(at::BFloat16* qkv, int64_t rows, int64_t row_stride, const int64_t* positions,
                        const float* cos, const float* sin, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                        int8_t* kv, const int64_t* slots, const QkvExtras<at::BFloat16>& extras) {
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    at::BFloat16* row = qkv + r * row_stride;
    add_qkv_extras_bf16(row, extras, q_heads, kv_heads, head_dim);
    rope_row_bf16(row, cos + positions[r] * head_dim, sin + positions[r] * head_dim, q_heads + kv_heads, head_dim);
    quantize_kv_heads(kv, slots[r], row + q_heads * head_dim, row + (q_heads + kv_heads) * head_dim, kv_heads, head_dim);
  }
}
#endif

// float32 team forms, as the op-by-op functions compute each row.
void rms_norm_team(const float* x, float* residual, const float* weight, float* out, int64_t rows, int64_t dim,
                   double eps) {
  std::vector<float> h(dim), r(dim);
#pragma omp for schedule(static)
  for (int64_t row = 0; row < rows; ++row)
    rms_norm_row(x + row * dim, residual ? residual + row * dim : nullptr, weight, out + row * dim, dim,
                 static_cast<float>(eps), h.data(), r.data());
}

namespace {
// (spans of a row among the team: a decode step's one row is work for both threads)
template <typename T>
void silu_mul_spans_team(const T* x, T* out, int64_t rows, int64_t inter) {
  constexpr int64_t kSpan = 256;  // a multiple of every vector width: the same lanes as whole rows
  const int64_t spans = (inter + kSpan - 1) / kSpan;
  float g[kSpan], u[kSpan];
#pragma omp for schedule(static)
  for (int64_t i = 0; i < rows * spans; ++i) {
    const int64_t r = i / spans, c0 = i % spans * kSpan, n = std::min(kSpan, inter - c0);
    silu_mul_span(x + r * 2 * inter + c0, x + r * 2 * inter + inter + c0, out + r * inter + c0, n, g, u);
  }
}
}  // namespace

void silu_mul_team(const float* x, float* out, int64_t rows, int64_t inter) { silu_mul_spans_team(x, out, rows, inter); }

void silu_mul_team(const at::BFloat16* x, at::BFloat16* out, int64_t rows, int64_t inter) {
  silu_mul_spans_team(x, out, rows, inter);
}

namespace {
template <typename KV>
void rope_store_kv_rows(float* qkv, int64_t rows, int64_t row_stride, const int64_t* positions, const float* cos,
                        const float* sin, int64_t q_heads, int64_t kv_heads, int64_t head_dim, KV* kv,
                        const int64_t* slots, const QkvExtras<float>& extras) {
  const int64_t width = kv_heads * head_dim;
  std::vector<float> scratch(3 * head_dim), norm_scratch(2 * head_dim);
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float* row = qkv + r * row_stride;
    // (extras as the op-by-op steps compute them: the bias add, each head by rms_norm's row function)
    if (extras.bias)
      for (int64_t c = 0; c < (q_heads + 2 * kv_heads) * head_dim; ++c) row[c] += extras.bias[c];
    if (extras.q_norm)
      for (int64_t h = 0; h < q_heads + kv_heads; ++h)
        rms_norm_row(row + h * head_dim, static_cast<float*>(nullptr), h < q_heads ? extras.q_norm : extras.k_norm,
                     row + h * head_dim, head_dim, extras.eps, norm_scratch.data(), norm_scratch.data() + head_dim);
    rope_row(row, cos + positions[r] * head_dim, sin + positions[r] * head_dim, q_heads + kv_heads, head_dim,
             scratch.data());
    if constexpr (std::is_same_v<KV, int8_t>) {
      quantize_kv_heads(kv, slots[r], row + q_heads * head_dim, row + (q_heads + kv_heads) * head_dim, kv_heads,
                        head_dim);
    } else {
      loom::convert_row(kv + slots[r] * 2 * width, row + q_heads * head_dim, width);
      loom::convert_row(kv + (slots[r] * 2 + 1) * width, row + (q_heads + kv_heads) * head_dim, width);
    }
  }
}
}  // namespace

void rope_store_kv_team(float* qkv, int64_t rows, int64_t row_stride, const int64_t* positions, const float* cos,
                        const float* sin, int64_t q_heads, int64_t kv_heads, int64_t head_dim, float* kv,
                        const int64_t* slots, const QkvExtras<float>& extras) {
  rope_store_kv_rows(qkv, rows, row_stride, positions, cos, sin, q_heads, kv_heads, head_dim, kv, slots, extras);
}

void rope_store_kv_team(float* qkv, int64_t rows, int64_t row_stride, const int64_t* positions, const float* cos,
                        const float* sin, int64_t q_heads, int64_t kv_heads, int64_t head_dim, at::Half* kv,
                        const int64_t* slots, const QkvExtras<float>& extras) {
  rope_store_kv_rows(qkv, rows, row_stride, positions, cos, sin, q_heads, kv_heads, head_dim, kv, slots, extras);
}

void rope_store_kv_team(float* qkv, int64_t rows, int64_t row_stride, const int64_t* positions, const float* cos,
                        const float* sin, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int8_t* kv,
                        const int64_t* slots, const QkvExtras<float>& extras) {
  rope_store_kv_rows(qkv, rows, row_stride, positions, cos, sin, q_heads, kv_heads, head_dim, kv, slots, extras);
}
