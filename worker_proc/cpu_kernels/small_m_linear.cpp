// y[M, N] = x[M, K] @ W[N, K]^T for a few rows of x (decode batches), where streaming W from
// memory is the cost. The weights are widened to float32 in registers as they are read, and
// each widened vector of W serves up to four rows of x. Weight formats:
//   dense  W float32 / bfloat16 [N, K]
//   int8   W int8 [N, K], one float32 scale per output row:  w = q * scale[n] (pack_int8's
//          panels go to integer_panels.cpp)
//   int4   W uint8 [N, K/2] in groups of 32 (GGUF Q4 order: byte i of a group holds element i in
//          its low nibble and element i+16 in its high one), per group float16 scale and min:
//          w = q * scale + min (the GGUF Q4_1 block, 20 bytes per 32 weights)
// With VNNI, int8 and int4 quantize bfloat16 activations to int8 per 32 (llama.cpp's Q8) for
// integer dot products.
// One SIMD layer (AVX-512, AVX2 or scalar, whichever the compiler targets) keeps one kernel.
// AVX2 and AVX-512 builds also take float32 linears of 5 to kDenseF32Rows rows (linear_f32_rows:
// blocked dot products, then packed panels), where torch's GEMM is slow with few rows.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <bit>
#include <cmath>
#include <type_traits>
#include <cstring>
#include <optional>
#include <omp.h>
#include <vector>

#include "kernels.h"
#include "team.h"
#include "vec_math.h"

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset(float a) { return _mm512_set1_ps(a); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline float vsum(Vec a) { return _mm512_reduce_add_ps(a); }
inline Vec load_f32(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load_bf16(const uint16_t* p) {
  __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
inline Vec load_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec load_u4(const uint8_t* p, bool high) {  // kLanes nibbles from kLanes bytes
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  b = high ? _mm512_srli_epi32(b, 4) : _mm512_and_si512(b, _mm512_set1_epi32(0xF));
  return _mm512_cvtepi32_ps(b);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float a) { return _mm256_set1_ps(a); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline float vsum(Vec a) { return loom::add_lanes_8(a); }
inline Vec load_f32(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load_bf16(const uint16_t* p) { return loom::load8(reinterpret_cast<const c10::BFloat16*>(p)); }
inline Vec load_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec load_u4(const uint8_t* p, bool high) {
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  b = high ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(0xF));
  return _mm256_cvtepi32_ps(b);
}
#else
constexpr int64_t kLanes = 1;
using Vec = float;
inline Vec vzero() { return 0.f; }
inline Vec vset(float a) { return a; }
inline Vec vfma(Vec a, Vec b, Vec c) { return a * b + c; }
inline Vec vmul(Vec a, Vec b) { return a * b; }
inline float vsum(Vec a) { return a; }
inline Vec load_f32(const float* p) { return *p; }
inline Vec load_bf16(const uint16_t* p) {
  uint32_t u = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline Vec load_i8(const int8_t* p) { return static_cast<float>(*p); }
inline Vec load_u4(const uint8_t* p, bool high) { return static_cast<float>(high ? (*p >> 4) : (*p & 0xF)); }
#endif

inline float half_to_float(const at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

constexpr int64_t kGroup = 32;   // int4 group size (GGUF Q4_0 / Q4_1 blocks)
// Integer dot products of int8 activations: AVX512-VNNI (vpdpbusd) or AVX2 (vpmaddubsw).
// (int8 weights of pack_int8, and int4 ones beside their panels: integer_panels.cpp)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LOOM_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LOOM_AVX2_INT 1
#endif
constexpr int64_t kXBlock = 4;      // rows of x sharing each read of W
constexpr int64_t kPrefetchRows = 16;
// Up to this many rows of x, a linear is limited by its weight stream: the bf16-dot and int4 VNNI
// kernels then walk rows of W one at a time (one stream the hardware prefetcher follows), where
// walking several row-major rows together (sharing each load of x) interleaves their reads.
// Measured on Zen 4: row-major int8 at batch 1 13 -> 21 GB/s; bf16 at 4-8 rows 15-25% faster.
constexpr int64_t kStreamRows = 8;

// Each format: load(n, k) -> W[n, k : k + kLanes] widened, at(n, k) -> W[n, k] (the last k % (2 kLanes)
// inputs, one at a time); finish(n, acc) applies per-row scales; kBlockRows rows of W are walked together.
struct DenseF32 {
  static constexpr int64_t kBlockRows = 1;
  const float* w; int64_t k;
  Vec load(int64_t n, int64_t j) const { return load_f32(w + n * k + j); }
  float at(int64_t n, int64_t j) const { return w[n * k + j]; }
  const void* addr(int64_t n, int64_t j) const { return w + n * k + j; }
  float finish(int64_t, float acc) const { return acc; }
};

struct DenseBF16 {
  static constexpr int64_t kBlockRows = 1;
  const uint16_t* w; int64_t k;
  Vec load(int64_t n, int64_t j) const { return load_bf16(w + n * k + j); }
  float at(int64_t n, int64_t j) const { return std::bit_cast<float>(static_cast<uint32_t>(w[n * k + j]) << 16); }
  const void* addr(int64_t n, int64_t j) const { return w + n * k + j; }
  float finish(int64_t, float acc) const { return acc; }
};

struct Int8Rows {
  static constexpr int64_t kBlockRows = 8;
  const int8_t* w; const float* scale; int64_t k;
  Vec load(int64_t n, int64_t j) const { return load_i8(w + n * k + j); }
  float at(int64_t n, int64_t j) const { return static_cast<float>(w[n * k + j]); }
  const void* addr(int64_t n, int64_t j) const { return w + n * k + j; }
  float finish(int64_t n, float acc) const { return acc * scale[n]; }
};

// int4 works a whole group at a time: w = q * scale + min gives
//   W[n] . x = sum_g scale[n, g] * (q_g . x_g) + sum_g min[n, g] * sum(x_g),
// so only the 4-bit codes are widened, and the group sums of x are computed once per call.
struct Int4Rows {
  static constexpr int64_t kBlockRows = 4;
  const uint8_t* w; const at::Half* scale; const at::Half* minimum; int64_t k;
  const void* addr(int64_t n, int64_t j) const { return w + n * (k / 2) + j / 2; }
};

template <int R, int MX>
inline void int4_block_dot(const Int4Rows& rows, int64_t n0, const float* xf, const float* xsum, int64_t k,
                           float out[R][kXBlock]) {
  const int64_t groups = k / kGroup;
  constexpr int64_t kHalf = kGroup / 2;  // bytes per group
  Vec acc[R][MX];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MX; ++i) acc[r][i] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    for (int r = 0; r < R; ++r) __builtin_prefetch(rows.addr(n0 + r + kPrefetchRows, g * kGroup));
    for (int r = 0; r < R; ++r) {
      const uint8_t* bytes = rows.w + (n0 + r) * (k / 2) + g * kHalf;
      Vec dot[MX];
      for (int i = 0; i < MX; ++i) dot[i] = vzero();
      for (int64_t h = 0; h < kHalf; h += kLanes) {  // low nibbles: elements h.., high: 16 + h..
        const Vec lo = load_u4(bytes + h, false), hi = load_u4(bytes + h, true);
        for (int i = 0; i < MX; ++i) {
          const float* xg = xf + i * k + g * kGroup + h;
          dot[i] = vfma(hi, load_f32(xg + kHalf), vfma(lo, load_f32(xg), dot[i]));
        }
      }
      const Vec sc = vset(half_to_float(rows.scale[(n0 + r) * groups + g]));
      for (int i = 0; i < MX; ++i) acc[r][i] = vfma(dot[i], sc, acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const at::Half* mins = rows.minimum + (n0 + r) * groups;
    for (int i = 0; i < MX; ++i) {
      float offset = 0.f;
      for (int64_t g = 0; g < groups; ++g) offset += half_to_float(mins[g]) * xsum[i * groups + g];
      out[r][i] = vsum(acc[r][i]) + offset;
    }
  }
}

// out[r][i] = W[n0 + r] . x[i] for R rows of W and MX rows of x; each widened vector of W
// serves all MX rows of x. With one row of W (the bandwidth-bound dense formats: one stream the
// hardware prefetcher follows) two accumulators per dot hide the FMA latency; with several
// rows (the quantized formats, where widening costs more than the bytes) the rows do.
template <int R, int MX, typename Rows>
inline void block_dot(const Rows& rows, int64_t n0, const float* xf, int64_t k, float out[R][kXBlock]) {
  constexpr int U = R == 1 ? 2 : 1;
  const int64_t whole = k - k % (U * kLanes);  // the rest: a scalar tail
  Vec acc[R][MX][U];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MX; ++i)
      for (int u = 0; u < U; ++u) acc[r][i][u] = vzero();
  for (int64_t j = 0; j < whole; j += U * kLanes) {
    // Rows are short: prefetch a few rows ahead, where the hardware prefetcher starts late.
    for (int r = 0; r < R; ++r) __builtin_prefetch(rows.addr(n0 + r + kPrefetchRows, j));
    for (int u = 0; u < U; ++u) {
      Vec xv[MX];
      for (int i = 0; i < MX; ++i) xv[i] = load_f32(xf + i * k + j + u * kLanes);
      for (int r = 0; r < R; ++r) {
        const Vec w = rows.load(n0 + r, j + u * kLanes);
        for (int i = 0; i < MX; ++i) acc[r][i][u] = vfma(w, xv[i], acc[r][i][u]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MX; ++i) {
      float s = 0.f;
      for (int u = 0; u < U; ++u) s += vsum(acc[r][i][u]);
      for (int64_t j = whole; j < k; ++j) s += rows.at(n0 + r, j) * xf[i * k + j];
      out[r][i] = s;
    }
}

template <int R, int MX, typename Rows>
inline void any_block_dot(const Rows& rows, int64_t n0, const float* xf, const float* xsum, int64_t k,
                          float out[R][kXBlock]) {
  if constexpr (std::is_same_v<Rows, Int4Rows>) {
    int4_block_dot<R, MX>(rows, n0, xf, xsum, k, out);
  } else {
    block_dot<R, MX>(rows, n0, xf, k, out);
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < MX; ++i) out[r][i] = rows.finish(n0 + r, out[r][i]);
  }
}

// xsum: per row of x, the sum of each int4 group (only the int4 format reads it).
template <int R, typename T, typename Rows>
inline void rows_block(const Rows& rows, int64_t n0, const float* xf, const float* xsum, int64_t m, int64_t k,
                       T* y, int64_t n_out) {
  const int64_t groups = k / kGroup;
  for (int64_t i0 = 0; i0 < m; i0 += kXBlock) {
    float part[R][kXBlock];
    const float* xb = xf + i0 * k;
    const float* sb = xsum + i0 * groups;
    const int64_t mx = std::min<int64_t>(kXBlock, m - i0);
    switch (mx) {
      case 1: any_block_dot<R, 1>(rows, n0, xb, sb, k, part); break;
      case 2: any_block_dot<R, 2>(rows, n0, xb, sb, k, part); break;
      case 3: any_block_dot<R, 3>(rows, n0, xb, sb, k, part); break;
      default: any_block_dot<R, kXBlock>(rows, n0, xb, sb, k, part);
    }
    for (int r = 0; r < R; ++r)
      for (int64_t i = 0; i < mx; ++i) y[(i0 + i) * n_out + n0 + r] = static_cast<T>(part[r][i]);
  }
}

template <typename T, typename Rows>
void run(const at::Tensor& x, const Rows& rows, int64_t n_out, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1);
  std::vector<float> xf(m * k);
  const T* xp = x.data_ptr<T>();
  for (int64_t i = 0; i < m * k; ++i) xf[i] = static_cast<float>(xp[i]);
  std::vector<float> xsum(m * (k / kGroup), 0.f);
  if constexpr (std::is_same_v<Rows, Int4Rows>)
    for (int64_t i = 0; i < m * k; ++i) xsum[i / kGroup] += xf[i];
  T* y = out.data_ptr<T>();
  constexpr int64_t R = Rows::kBlockRows;
  const int64_t blocks = n_out / R;
  // Contiguous row ranges per thread: each thread streams its own part of W.
  at::parallel_for(0, blocks, 16 / R, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) rows_block<R>(rows, b * R, xf.data(), xsum.data(), m, k, y, n_out);
  });
  for (int64_t n = blocks * R; n < n_out; ++n) rows_block<1>(rows, n, xf.data(), xsum.data(), m, k, y, n_out);
}

// Calls row_block(R, n0) for every row of W, split over the threads: rows one at a time while x
// has at most kStreamRows rows (the weight stream is the limit), else in blocks of R rows (sharing
// each load of x), the last n_out % R rows one at a time. R arrives as std::integral_constant.
template <int R, typename RowBlock>
void for_row_blocks(int64_t m, int64_t n_out, RowBlock row_block) {
  if (m <= kStreamRows) {
    at::parallel_for(0, n_out, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) row_block(std::integral_constant<int, 1>{}, n);
    });
    return;
  }
  const int64_t blocks = n_out / R;
  at::parallel_for(0, blocks, 16 / R, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) row_block(std::integral_constant<int, R>{}, b * R);
  });
  for (int64_t n = blocks * R; n < n_out; ++n) row_block(std::integral_constant<int, 1>{}, n);
}

// x[0:32] -> q ~ x / dx, dx = max|x| / 127 (0 for an all-zero group); returns sum(x).
template <typename T>
inline float quantize_group(const T* x, int8_t* q, float& dx) {
  float v[kGroup], top = 0.f, sum = 0.f;
  for (int64_t j = 0; j < kGroup; ++j) {
    v[j] = static_cast<float>(x[j]);
    top = std::max(top, std::abs(v[j]));
    sum += v[j];
  }
  dx = top / 127.f;
  const float inv = top > 0.f ? 127.f / top : 0.f;
  for (int64_t j = 0; j < kGroup; ++j) q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
  return sum;
}

// Rows of x quantized per group of 32 for int4 weights, each pair of groups laid out as the
// codes of a pair of GGUF groups unpack from 32 bytes (low nibbles, then high ones).
struct QuantizedX {
  int64_t m, groups;
  std::vector<int8_t> q;       // [m][groups / 2][64]: per pair, x_g[0:16] x_g1[0:16] x_g[16:32] x_g1[16:32]
  std::vector<float> dx_lanes; // [m][groups / 2][16]: the dx of each lane's group, in that order
  std::vector<float> sums;     // [m][groups]: sum of x_g (unquantized)
};

template <typename T>
QuantizedX quantize_x(const T* x, int64_t m, int64_t k) {
  const int64_t groups = k / kGroup, pairs = groups / 2;
  QuantizedX qx{m, groups, std::vector<int8_t>(m * pairs * 64), std::vector<float>(m * pairs * 16),
                std::vector<float>(m * groups)};
  for (int64_t i = 0; i < m; ++i)
    for (int64_t g = 0; g < groups; ++g) {
      int8_t q[kGroup];
      float dx;
      qx.sums[i * groups + g] = quantize_group(x + i * k + g * kGroup, q, dx);
      const int64_t pair = g / 2, side = g % 2;
      int8_t* dst = qx.q.data() + (i * pairs + pair) * 64;
      float* lanes = qx.dx_lanes.data() + (i * pairs + pair) * 16;
      for (int64_t j = 0; j < kGroup; ++j) dst[(j < 16 ? 0 : 32) + 16 * side + j % 16] = q[j];
      for (int l = 0; l < 4; ++l) lanes[4 * side + l] = lanes[8 + 4 * side + l] = dx;
    }
  return qx;
}

#if defined(LOOM_VNNI)
// int4 x int8 on VNNI (vpdpbusd: 64 unsigned-by-signed byte products summed 4 to a lane), as
// llama.cpp does for Q4_1: each row of x is quantized once per call to int8 per group of 32
// (x ~ q * dx), so a pair of groups of W is unpacked to 64 codes and dotted with 64 int8s in
// one instruction:
//   W[n] . x = sum_g scale[n,g] * dx[g] * (q_g . xq_g) + sum_g min[n,g] * sum(x_g).
// Used for bfloat16 and float32 activations, as the AVX2 builds do (--quantization is llama.cpp's
// Q4 x Q8 arithmetic on every CPU kind).
template <int R, int MX>
inline void int4_vnni_block(const Int4Rows& rows, int64_t n0, const QuantizedX& qx, int64_t i0, int64_t k,
                            float out[R][kXBlock]) {
  const int64_t groups = k / kGroup, pairs = groups / 2;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m512i scale_lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
  __m512 acc[R][MX];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MX; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    for (int r = 0; r < R; ++r) __builtin_prefetch(rows.addr(n0 + r + kPrefetchRows, p * 2 * kGroup));
    for (int r = 0; r < R; ++r) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows.w + (n0 + r) * (k / 2) + p * 32));
      const __m256i lo = _mm256_and_si256(b, low4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
      const __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      int32_t two_scales;
      std::memcpy(&two_scales, rows.scale + (n0 + r) * groups + 2 * p, 4);
      const __m512 ws = _mm512_permutexvar_ps(
          scale_lanes, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_set1_epi32(two_scales))));
      for (int i = 0; i < MX; ++i) {
        const int64_t row = (i0 + i) * pairs + p;
        const __m512i xq = _mm512_loadu_si512(qx.q.data() + row * 64);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, xq);
        const __m512 dx = _mm512_loadu_ps(qx.dx_lanes.data() + row * 16);
        acc[r][i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), dx), ws, acc[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const at::Half* mins = rows.minimum + (n0 + r) * groups;
    for (int i = 0; i < MX; ++i) {
      const float* sums = qx.sums.data() + (i0 + i) * groups;
      __m512 offset = _mm512_setzero_ps();
      for (int64_t g = 0; g < groups; g += 16) {
        const __mmask16 live = static_cast<__mmask16>(groups - g >= 16 ? 0xFFFF : (1u << (groups - g)) - 1);
        const __m512 mn = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, mins + g));
        offset = _mm512_fmadd_ps(mn, _mm512_maskz_loadu_ps(live, sums + g), offset);
      }
      out[r][i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][i], offset));
    }
  }
}

// y = x @ W.T for x [M, K] of T (bfloat16 or float32): x quantized once by `quantize`, then rows of W (see
// for_row_blocks; blocks of Rows::kBlockRows) dotted with the quantized rows of x, kXBlock at a
// time, by `block_dot_fn`.
template <typename T, typename Rows, typename Quantize, typename Block>
at::Tensor vnni_linear(const at::Tensor& x_in, const Rows& rows, int64_t n_out, Quantize quantize,
                       Block block_dot_fn) {
  const auto x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  const auto qx = quantize(x.data_ptr<T>(), m, k);
  auto out = at::empty({m, n_out}, x.options());
  T* y = out.data_ptr<T>();
  for_row_blocks<Rows::kBlockRows>(m, n_out, [&](auto r_const, int64_t n0) {
    constexpr int R = decltype(r_const)::value;
    for (int64_t i0 = 0; i0 < m; i0 += kXBlock) {
      float part[R][kXBlock];
      const int64_t mx = std::min<int64_t>(kXBlock, m - i0);
      block_dot_fn(r_const, mx, rows, n0, qx, i0, k, part);
      for (int r = 0; r < R; ++r)
        for (int64_t i = 0; i < mx; ++i) y[(i0 + i) * n_out + n0 + r] = static_cast<T>(part[r][i]);
    }
  });
  return out;
}

// Calls BLOCK<R, MX>(...) with MX (rows of x in this block, 1..kXBlock) as a template argument.
#define LOOM_VNNI_BLOCK(BLOCK)                                                                        \
  [](auto r_const, int64_t mx, const auto& rows, int64_t n0, const auto& qx, int64_t i0, int64_t k,  \
     float(*part)[kXBlock]) {                                                                       \
    constexpr int RR = decltype(r_const)::value;                                                    \
    switch (mx) {                                                                                   \
      case 1: BLOCK<RR, 1>(rows, n0, qx, i0, k, part); break;                                       \
      case 2: BLOCK<RR, 2>(rows, n0, qx, i0, k, part); break;                                       \
      case 3: BLOCK<RR, 3>(rows, n0, qx, i0, k, part); break;                                       \
      default: BLOCK<RR, kXBlock>(rows, n0, qx, i0, k, part);                                       \
    }                                                                                               \
  }
#endif

#if defined(LOOM_AVX2_INT)
// int8 activations on AVX2 (vpmaddubsw: 32 unsigned-by-signed byte products summed in pairs to
// int16), as llama.cpp does without VNNI: x is quantized once per call to int8 per group of 32
// (x ~ q * dx). int8 weights take integer_panels.cpp's kernel at every row count.
inline __m256i load_256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// int4 (the row layout of Int4Rows) against int8 activations, as on VNNI a pair of groups at a
// time: 32 bytes of codes unpack to their low and high nibbles (elements 0-15 and 16-31 of both
// groups), each dotted with the matching 32 bytes of quantize_x's reordered q in unsigned-by-
// signed products (codes <= 15: nothing saturates), so lanes 0-3 sum group 2p and lanes 4-7 group
// 2p + 1, scaled per lane by dx and the weights' group scale:
//   W[n] . x = sum_g scale[n,g] * dx[g] * (codes_g . q_g) + sum_g min[n,g] * sum(x_g).
template <int MX>
inline void int4_avx2_row(const Int4Rows& rows, int64_t n, const QuantizedX& qx, int64_t i0, int64_t k,
                          float out[kXBlock]) {
  const int64_t groups = k / kGroup, pairs = groups / 2;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i scale_lanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const uint8_t* codes = rows.w + n * (k / 2);
  const at::Half* scales = rows.scale + n * groups;
  __m256 acc[MX];
  for (int i = 0; i < MX; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m256i b = load_256(codes + p * kGroup);
    const __m256i lo = _mm256_and_si256(b, low4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
    int32_t two_scales;
    std::memcpy(&two_scales, scales + 2 * p, sizeof(two_scales));
    const __m256 ws = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(two_scales))),
                                               scale_lanes);
    for (int i = 0; i < MX; ++i) {
      const int64_t row = (i0 + i) * pairs + p;
      const int8_t* xq = qx.q.data() + row * 64;
      const __m256i pairs16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, load_256(xq)),
                                               _mm256_maddubs_epi16(hi, load_256(xq + 32)));
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs16, ones));
      acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(dot, _mm256_loadu_ps(qx.dx_lanes.data() + row * 16)), ws, acc[i]);
    }
  }
  const at::Half* mins = rows.minimum + n * groups;
  for (int i = 0; i < MX; ++i) {
    const float* sums = qx.sums.data() + (i0 + i) * groups;
    __m256 offset = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8)
      offset = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + g))),
                               _mm256_loadu_ps(sums + g), offset);
    float total = loom::add_lanes_8(_mm256_add_ps(acc[i], offset));
    for (; g < groups; ++g) total += half_to_float(mins[g]) * sums[g];
    out[i] = total;
  }
}

template <typename T>
at::Tensor linear_int4_avx2(const at::Tensor& x, const Int4Rows& rows, int64_t n_out) {
  const int64_t m = x.size(0), k = x.size(1);
  const auto qx = quantize_x(x.data_ptr<T>(), m, k);
  auto out = at::empty({m, n_out}, x.options());
  T* y = out.data_ptr<T>();
  at::parallel_for(0, n_out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t i0 = 0; i0 < m; i0 += kXBlock) {
        float part[kXBlock];
        const int64_t mx = std::min<int64_t>(kXBlock, m - i0);
        switch (mx) {
          case 1: int4_avx2_row<1>(rows, n, qx, i0, k, part); break;
          case 2: int4_avx2_row<2>(rows, n, qx, i0, k, part); break;
          case 3: int4_avx2_row<3>(rows, n, qx, i0, k, part); break;
          default: int4_avx2_row<kXBlock>(rows, n, qx, i0, k, part);
        }
        for (int64_t i = 0; i < mx; ++i) y[(i0 + i) * n_out + n] = static_cast<T>(part[i]);
      }
  });
  return out;
}
#endif

#if defined(__AVX512BF16__)
// bfloat16 weights and activations on AVX512-BF16: vdpbf16ps multiplies 32 bf16 pairs into 16
// float32 lanes, so neither side is widened and each instruction does twice an FMA's work. Fast
// enough to beat torch's GEMM up to a few dozen rows (DENSE_BF16_ROWS in model_runner.py).
template <int R, int MX>
inline void dense_dpbf16_block(const uint16_t* w, int64_t n0, const uint16_t* x, int64_t k, float out[R][kXBlock]) {
  __m512 acc[R][MX];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MX; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < k; j += 32) {
    if constexpr (R > 1)  // (one row at a time: the hardware prefetcher does better alone)
      for (int r = 0; r < R; ++r) __builtin_prefetch(w + (n0 + r + kPrefetchRows) * k + j);
    __m512bh xv[MX];
    for (int i = 0; i < MX; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(x + i * k + j);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (n0 + r) * k + j);
      for (int i = 0; i < MX; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], wv, xv[i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MX; ++i) out[r][i] = _mm512_reduce_add_ps(acc[r][i]);
}

template <int R>
inline void dense_dpbf16_rows(const uint16_t* w, int64_t n0, const uint16_t* x, int64_t m, int64_t k,
                              at::BFloat16* y, int64_t n_out) {
  for (int64_t i0 = 0; i0 < m; i0 += kXBlock) {
    float part[R][kXBlock];
    const uint16_t* xb = x + i0 * k;
    const int64_t mx = std::min<int64_t>(kXBlock, m - i0);
    switch (mx) {
      case 1: dense_dpbf16_block<R, 1>(w, n0, xb, k, part); break;
      case 2: dense_dpbf16_block<R, 2>(w, n0, xb, k, part); break;
      case 3: dense_dpbf16_block<R, 3>(w, n0, xb, k, part); break;
      default: dense_dpbf16_block<R, kXBlock>(w, n0, xb, k, part);
    }
    for (int r = 0; r < R; ++r)
      for (int64_t i = 0; i < mx; ++i) y[(i0 + i) * n_out + n0 + r] = static_cast<at::BFloat16>(part[r][i]);
  }
}

// Rows of W as for_row_blocks walks them: one at a time, batch 1 reads 30-40 GB/s, where widening
// bf16 to float32 managed ~23.
at::Tensor linear_dense_dpbf16(const at::Tensor& x_in, const at::Tensor& w) {
  auto x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  auto out = at::empty({m, n}, x.options());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  at::BFloat16* y = out.data_ptr<at::BFloat16>();
  for_row_blocks<4>(m, n, [&](auto r_const, int64_t n0) {
    dense_dpbf16_rows<decltype(r_const)::value>(wp, n0, xp, m, k, y, n);
  });
  return out;
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define LOOM_F32_PANELS 1
// float32 linears with more rows of x than the weight stream needs, on AVX2 CPUs. Measured on Zen 3
// (2 threads, weights from DRAM, GFLOP/s at 16 / 64 / 128 / 256 rows): torch's GEMM 58 / 113 / 137
// / 150, the lm_head-sized one 40 / 98 / 105 / 112; these two paths 83 / 150 / 167 / 167, on the
// lm_head 83 / 151 / 162 / 131-151:
//   up to kDotMaxRows rows: blocked dot products, 4 rows of W x 3 rows of x, no packing;
//   up to kDenseF32Rows rows: W packed per call into panels of 16 transposed rows (8 x 8 register
//   transposes, the next chunk prefetched while this one computes), a 6 x 16 tile of y per step
//   (the classic broadcast kernel, no horizontal sums).
// Above kDenseF32Rows torch's GEMM is as fast. On AVX2 that is from ~2,048 rows: on Zen 3, the
// model's linears with prepacked panels against torch's GEMM, GFLOP/s, 512 rows 142-151 vs 126-132,
// 1,056 rows (a 1,024-token prompt chunk with 32 decodes) 137-141 vs 125-133, 2,048 rows 129-136 vs
// 134-144; so the steps of the default --max-prefill-tokens run in the layer stack on the panels
// (interleaved A/B there: the 32-stream load 1.06x, median of 6 pairs; offline 1.04x, 1.19x).
// Weights packed once at load (pack_dense_f32) skip
// the per-call packing and take the panels at any row count: 1.25x at 8-32 rows, 1.13x at 64,
// 1.05x at 128, 1.01x at 512; at one row 1.12x over the weight stream.
// AVX-512 builds take the same paths with panels of 32 rows and tiles of 8 rows of x (16
// accumulators; 12 rows were slower). Measured on an Intel Xeon (AVX-512, 2 threads, the model's
// linears, prepacked), GFLOP/s at 8 / 32 / 64 / 128 / 256 / 512 rows: torch's GEMM 59 / 158 / 199 /
// 251 / 259 / 303, the panels 84 / 200 / 242 / 279 / 313 / 287; at 1-4 rows the panels tie the
// weight stream.
constexpr int64_t kDotMaxRows = 16;
#if defined(__AVX512F__)
constexpr int64_t kDenseF32Rows = 256;
constexpr int64_t kPanel = 32;     // W rows per packed panel (two registers of y per row of x)
constexpr int kPanelTileRows = 8;
constexpr int64_t kShortTailRows = 0;  // (5 + 4 rows for 8 + 1 ran 3-5% slower on Zen 4, whose
                                       // 512-bit FMAs, one a cycle, keep busy with half the sums)
#else
constexpr int64_t kDenseF32Rows = 1536;
constexpr int64_t kPanel = 16;
constexpr int kPanelTileRows = 6;
// Two FMA pipes of 4-cycle latency keep busy with 8 independent sums: a tile of 4 to 6 rows (8 to
// 12) does, one of 3 rows (6 sums) runs at 3/4 of the rate, of 2 at half, of 1 at a quarter. So
// 6 + 3 rows run as 5 + 4, 6 + 2 as 4 + 4 and 6 + 1 as 4 + 3: AVX2 kernels on an AMD Zen 4,
// outputs identical, 32 rows 1.6-2.5% faster (decode steps 1.8%), 8 rows 6-12% (decode steps
// 4.5%), 9-39 rows with 3 left over 1-5% (one shape 2% slower at 9 rows).
constexpr int64_t kShortTailRows = 3;  // (loom::row_tile_at)
#endif
// Inputs per panel chunk: 16 KB of L1 either way. AVX-512's chunks of 256 inputs (32 KB) filled a
// 32 KB L1 with no room for x: chunks of 128 on a Cascade Lake Xeon, the model's 121 linears from
// DRAM, 2 threads, pairs in turn (16-20 rounds, two runs): 1 row 1.03x, 4 rows 1.04-1.06x, 16 rows
// 1.14-1.15x, 32 rows 1.06x, 64 rows 0.99x, 128 rows 1.04-1.07x, 256 rows 1.01x.
#if defined(__AVX512F__)
constexpr int64_t kPanelK = 128;
#else
constexpr int64_t kPanelK = 256;
#endif

// y[i, n0 + r] = W[n0 + r] . x[i] for R rows of W streaming past MX rows of x (loom::tile_dots).
template <int R, int MX>
inline void dot_tile(const float* w, const float* x, int64_t k, float* y, int64_t n_out) {
  const float* xs[MX];
  const float* ws[R];
  for (int i = 0; i < MX; ++i) xs[i] = x + i * k;
  for (int r = 0; r < R; ++r) ws[r] = w + r * k;
  __m256 acc[MX][R];
  loom::tile_dots<MX, R>(xs, ws, k, acc);
  for (int i = 0; i < MX; ++i)
    for (int r = 0; r < R; ++r) y[i * n_out + r] = loom::add_lanes_8(acc[i][r]);
}

// Rows [n0, n0 + R) of W against every row of x; the next block's rows are fetched meanwhile.
template <int R>
void dot_rows(const float* x, const float* w, float* y, int64_t m, int64_t k, int64_t n_out, int64_t n0) {
  const float* wb = w + n0 * k;
  if (n0 + 2 * R <= n_out)
    for (int64_t j = 0; j < R * k; j += 16) _mm_prefetch(reinterpret_cast<const char*>(wb + R * k + j), _MM_HINT_T0);
  int64_t i = 0;
  for (; i + 3 <= m; i += 3) dot_tile<R, 3>(wb, x + i * k, k, y + i * n_out + n0, n_out);
  if (m - i == 2) dot_tile<R, 2>(wb, x + i * k, k, y + i * n_out + n0, n_out);
  if (m - i == 1) dot_tile<R, 1>(wb, x + i * k, k, y + i * n_out + n0, n_out);
}

// rows [n_begin, n_out) of y by dot products: blocks of 4 rows of W over the threads, then the rest.
void dense_f32_dots(const float* x, const float* w, float* y, int64_t m, int64_t k, int64_t n_out, int64_t n_begin) {
  const int64_t blocks = (n_out - n_begin) / 4;
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) dot_rows<4>(x, w, y, m, k, n_out, n_begin + 4 * b);
  });
  for (int64_t n = n_begin + 4 * blocks; n < n_out; ++n) dot_rows<1>(x, w, y, m, k, n_out, n);
}

// y[i0 : i0 + MR, panel columns] (+)= x[i0 : i0 + MR, k-range] @ panel; panel[kk][c] = W[c, k0 + kk];
// x[i][kk] at x[i * x_row + kk * x_step].
// With `fetch`, input kk also prefetches line (kk * fetch_step) >> 16 from `fetch` on (and the
// line after it on AVX-512).
// (Inlined where it is called: with a second loop added here GCC once kept it apart, and every
// tile ran at ~60 GFLOP/s.)
template <int MR>
__attribute__((always_inline)) inline void panel_tile(const float* x, int64_t x_row, int64_t x_step, const float* panel,
                                                      int64_t kb, float* y, int64_t ldy, bool first, const char* fetch,
                                                      int64_t fetch_step) {
#if defined(__AVX512F__)
  if (fetch) {  // (two lines of the next chunk an input: a panel row is two lines)
    auto load_panel_row = [panel, fetch, fetch_step](int64_t kk, __m512& b0, __m512& b1) __attribute__((always_inline)) {
      const char* line = fetch + (((kk * fetch_step) >> 16) << 6);
      _mm_prefetch(line, _MM_HINT_T0);
      _mm_prefetch(line + 64, _MM_HINT_T0);
      b0 = _mm512_loadu_ps(panel + kk * kPanel);
      b1 = _mm512_loadu_ps(panel + kk * kPanel + 16);
    };
    loom::broadcast_tile_32<MR>(x, x_row, kb, load_panel_row, y, ldy, !first);
    return;
  }
  auto load_panel_row = [panel](int64_t kk, __m512& b0, __m512& b1) __attribute__((always_inline)) {
    b0 = _mm512_loadu_ps(panel + kk * kPanel);
    b1 = _mm512_loadu_ps(panel + kk * kPanel + 16);
  };
  loom::broadcast_tile_32<MR>(x, x_row, kb, load_panel_row, y, ldy, !first);
#else
  if (fetch) {
    auto load_panel_row = [panel, fetch, fetch_step](int64_t kk, __m256& b0, __m256& b1) __attribute__((always_inline)) {
      _mm_prefetch(fetch + (((kk * fetch_step) >> 16) << 6), _MM_HINT_T0);
      b0 = _mm256_load_ps(panel + kk * kPanel);
      b1 = _mm256_load_ps(panel + kk * kPanel + 8);
    };
    loom::broadcast_tile_16<MR>(x, x_row, x_step, kb, load_panel_row, y, ldy, !first);
    return;
  }
  auto load_panel_row = [panel](int64_t kk, __m256& b0, __m256& b1) __attribute__((always_inline)) {
    b0 = _mm256_load_ps(panel + kk * kPanel);
    b1 = _mm256_load_ps(panel + kk * kPanel + 8);
  };
  loom::broadcast_tile_16<MR>(x, x_row, x_step, kb, load_panel_row, y, ldy, !first);
#endif
}

// The last rows of x (fewer than kPanelTileRows): one tile of `rows` rows.
template <int MR>
inline void panel_tail(int64_t rows, const float* x, int64_t x_row, int64_t x_step, const float* panel, int64_t kb,
                       float* y, int64_t ldy, bool first, const char* fetch, int64_t fetch_step) {
  if constexpr (MR > 0) {
    if (rows == MR) panel_tile<MR>(x, x_row, x_step, panel, kb, y, ldy, first, fetch, fetch_step);
    else panel_tail<MR - 1>(rows, x, x_row, x_step, panel, kb, y, ldy, first, fetch, fetch_step);
  }
}

// dst[c * kPanel + r] = src[r * ld + c] for an 8 x 8 block.
inline void transpose_8x8(const float* src, int64_t ld, float* dst) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld);
  loom::transpose_8x8(r);
  for (int i = 0; i < 8; ++i) _mm256_store_ps(dst + i * kPanel, r[i]);
}

// panel[kk][c] = W[row0 + c, k0 + kk] for kb inputs (kb % 8 == 0).
inline void pack_panel(const float* w, int64_t k, int64_t row0, int64_t k0, int64_t kb, float* panel) {
  for (int64_t c = 0; c < kPanel; c += 8)
    for (int64_t kk = 0; kk < kb; kk += 8) transpose_8x8(w + (row0 + c) * k + k0 + kk, k, panel + kk * kPanel + c);
}

// A tile of the AVX2 panels that would fetch this many lines of the next chunk or more fetches
// them as it computes, one an input, not in a burst after it: a burst of dozens of lines overruns
// the L1's miss buffers (24 on Zen 3) while the tile waits. The model's linears on Zen 3 (prepacked,
// weights from DRAM, medians of 12-30 in turn, two or three runs): 4-16 rows (64-128 lines a tile)
// 1.13-1.20x, 24 rows 1.06x; 32 rows (43 lines) 0.98-1.11x: undecided, so left as it was; 40 and 48
// rows (37 and 32 lines) 0.95-1.01x; with every tile spreading, 64-1,056 rows lost 4-7% to the
// extra prefetches. Greedy decoding, both builds in one process, medians of 6 in turn: batch 4
// 1.14x, 8 1.12x, 16 1.02x, 24 1.04x, 1 1.03x (batch 32, unchanged: 1.02x).
// AVX-512 (a panel row is two lines: two fetched an input), the model's 121 one-row linears from
// DRAM on a Cascade Lake Xeon, 2 threads, medians of 12 in turn, against the burst after the
// tile: 1 row 1.09x, 4 rows 1.08x, 16 1.19x, 32 1.23x, 64 1.16x; spreading every tile's fetch lost
// 8-12% at 128-256 rows there too.
// AVX-512's chunks are half as long (kPanelK), so its tiles spread from 32 lines: with 64, 64-row
// steps (32 lines a tile) went back to a burst and ran 0.94-0.97x against the longer chunks.
#if defined(__AVX512F__)
constexpr int64_t kSpreadFetchLines = 32;
constexpr int64_t kFetchLinesPerInput = 2;
#else
constexpr int64_t kSpreadFetchLines = 64;
constexpr int64_t kFetchLinesPerInput = 1;
#endif

// Prefetches (into L2) the W lines of the panel chunk after this one, a share after each tile of
// y: packing used to wait on DRAM for every chunk, ~25% of the time at 64 rows.
// With prepacked panels, next_packed is where the next chunk starts: one contiguous range, fetched
// into L1, spread over the tiles' inputs where they are few (kSpreadFetchLines; AVX2 and AVX-512).
struct NextChunkFetch {
  const float* w;
  const float* next_packed;
  int64_t k, row0, k0, lines_per_row, lines, tiles, kb, issued = 0, tile = 0;  // kb: this chunk's inputs
  bool spread = false;
  NextChunkFetch(const float* w, const float* next_packed, int64_t k, int64_t row0, int64_t k0, int64_t tiles,
                 int64_t kb)
      : w(w), next_packed(next_packed), k(k), row0(row0), k0(k0), lines_per_row(std::min(kPanelK, k - k0) / 16),
        lines(kPanel * lines_per_row), tiles(tiles), kb(kb) {
    // (at most one line an input, two on AVX-512: a tile of a short chunk keeps the burst)
    spread = next_packed && tiles > 0 && lines >= kSpreadFetchLines * tiles && lines <= kFetchLinesPerInput * kb * tiles;
  }
  // Where tile t fetches as it computes (nullptr: after_tile does) and its 16.16 steps per input
  // (of kFetchLinesPerInput lines each).
  const char* spread_start(int64_t t, int64_t& step) const {
    if (!spread) return nullptr;
    const int64_t l0 = lines * t / tiles, l1 = lines * (t + 1) / tiles;
    step = ((l1 - l0) << 16) / (kFetchLinesPerInput * kb) * kFetchLinesPerInput;
    return reinterpret_cast<const char*>(next_packed) + 64 * l0;
  }
  void after_tile() {  // tiles == 0: nothing comes next
    if (tiles == 0 || spread) return;
    const int64_t upto = lines * ++tile / tiles;
    for (; issued < upto; ++issued) {
      if (next_packed) {
        _mm_prefetch(reinterpret_cast<const char*>(next_packed + 16 * issued), _MM_HINT_T0);
      } else {
        const float* line = w + (row0 + issued / lines_per_row) * k + k0 + 16 * (issued % lines_per_row);
        _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
      }
    }
  }
};

#if !defined(__AVX512F__)
// x laid out as its tiles read it: for each chunk of kPanelK inputs and each tile of rows, the
// tile's x as [kb][rows], so a tile reads one stream instead of one a row. Each block has 8
// floats of slack after it for the packing's whole-register stores. One buffer per calling thread,
// kept between calls (a fresh one a call would page-fault its megabytes in each time).
struct XStrips {
  const std::vector<int64_t>& starts;  // tile t: rows [starts[t], starts[t + 1])
  int64_t m, k, tiles;
  float* data;

  XStrips(const std::vector<int64_t>& starts, int64_t m, int64_t k)
      : starts(starts), m(m), k(k), tiles(static_cast<int64_t>(starts.size()) - 1) {
    static thread_local std::vector<float> buffer;
    const int64_t chunks = (k + kPanelK - 1) / kPanelK;
    buffer.resize(std::max<size_t>(buffer.size(), m * k + chunks * tiles * 8 + 8));
    data = buffer.data();
  }
  float* tile(int64_t k0, int64_t t) const {
    const int64_t kb = std::min(kPanelK, k - k0);
    return data + k0 * m + (k0 / kPanelK) * tiles * 8 + starts[t] * kb + t * 8;
  }
  void pack(const float* x, int64_t k0, int64_t t) {
    const int64_t kb = std::min(kPanelK, k - k0), rows = starts[t + 1] - starts[t];
    const float* src = x + starts[t] * k + k0;
    float* dst = tile(k0, t);
    for (int64_t kk = 0; kk < kb; kk += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j) r[j] = j < rows ? _mm256_loadu_ps(src + j * k + kk) : _mm256_setzero_ps();
      loom::transpose_8x8(r);  // r[j] = x[rows of the tile][kk + j]
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + (kk + j) * rows, r[j]);
    }
  }
};
// Steps of this many rows or more take x as strips. The model's linears on Zen 3 (2 threads,
// prepacked weights, outputs identical), strips against rows, medians of 8 in turn: 1,536 rows 1.13x
// and 1.20x, 1,056 rows 1.09x and 1.12x, 512 rows 1.05x, 384 1.02x, 256 1.00x; 16-192 rows 0.96x
// to 1.03x (x there stays in L2, re-read for each panel; above, from L3, six streams a tile).
constexpr int64_t kStripRows = 256;
#endif

// One call's panels: run(p, ...) computes panel p (kPanel columns of y) for every row of x.
// packed: pack_dense_f32(w), or nullptr to pack each panel chunk here (into own_panel).
struct F32PanelCall {
  const float *x, *w, *packed;
  float* y;
  int64_t m, k, n_out, panels, tiles;
  std::vector<int64_t> starts{0};
#if !defined(__AVX512F__)
  std::optional<XStrips> strips;
#endif

  F32PanelCall(const float* x, const float* w, const float* packed, float* y, int64_t m, int64_t k, int64_t n_out)
      : x(x), w(w), packed(packed), y(y), m(m), k(k), n_out(n_out), panels(n_out / kPanel) {
    for (int64_t i = 0; i < m;) starts.push_back(i += loom::row_tile_at(i, m, kPanelTileRows, kShortTailRows));
    tiles = static_cast<int64_t>(starts.size()) - 1;
  }

  // panel p; fetch_next: the panel after it is this thread's next (fetch its first chunk meanwhile)
  void run(int64_t p, bool fetch_next, float* own_panel) const {
    for (int64_t k0 = 0; k0 < k; k0 += kPanelK) {
      const int64_t kb = std::min(kPanelK, k - k0);
      const float* panel = packed ? packed + p * k * kPanel + k0 * kPanel : own_panel;
      if (!packed) pack_panel(w, k, p * kPanel, k0, kb, own_panel);
      const bool last_chunk = k0 + kPanelK >= k;
      // packed chunks lie in order: the next one (this panel's or the next panel's first) follows
      NextChunkFetch fetch(w, packed ? panel + kb * kPanel : nullptr, k, (last_chunk ? p + 1 : p) * kPanel,
                           last_chunk ? 0 : k0 + kPanelK, last_chunk && !fetch_next ? 0 : tiles, kb);
      float* yp = y + p * kPanel;
      const bool first = k0 == 0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t i = starts[t], rows = starts[t + 1] - i;
        const float* xt = x + i * k + k0;
        int64_t x_row = k, x_step = 1;
#if !defined(__AVX512F__)
        if (strips) xt = strips->tile(k0, t), x_row = 1, x_step = rows;
#endif
        int64_t fetch_step = 0;
        const char* fetch_from = fetch.spread_start(t, fetch_step);
        if (rows == kPanelTileRows)
          panel_tile<kPanelTileRows>(xt, x_row, x_step, panel, kb, yp + i * n_out, n_out, first, fetch_from, fetch_step);
        else
          panel_tail<kPanelTileRows - 1>(rows, xt, x_row, x_step, panel, kb, yp + i * n_out, n_out, first, fetch_from,
                                         fetch_step);
        fetch.after_tile();
      }
    }
  }

  // This thread's panels in a region: its share front first (fetching its next panel meanwhile),
  // then single panels from the back of the others' shares (team.h): a thread the VM slows no
  // longer holds the other at the join. AVX2 kernels on Zen 4, decode steps (interleaved A/B):
  // 1 row +0.4% to +5.7% (four runs), 4 rows +2.9%, 8 rows +2.5%, 32 rows -0.6% and +1.0%.
  void take_panels(loom::BlockClaims& claims) const {
    alignas(64) float own_panel[kPanelK * kPanel];  // (unused with packed weights)
    const int t = omp_get_thread_num();
    int64_t p0, p1, end;
    while (claims.take_front(t, 1, p0, p1, end)) run(p0, p1 < end, own_panel);
    for (int64_t p; claims.steal(t, p);) run(p, false, own_panel);
  }
};

void dense_f32_panels(const float* x, const float* w, const float* packed, float* y, int64_t m, int64_t k,
                      int64_t n_out) {
  F32PanelCall call(x, w, packed, y, m, k, n_out);
  const int64_t panels = call.panels, tiles = call.tiles;
#if !defined(__AVX512F__)
  if (m >= kStripRows && k % 8 == 0 && panels > 0) {
    call.strips.emplace(call.starts, m, k);
    const int64_t chunks = (k + kPanelK - 1) / kPanelK;
    at::parallel_for(0, chunks * tiles, 8, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) call.strips->pack(x, (b / tiles) * kPanelK, b % tiles);
    });
  }
#endif
  const int threads = at::get_num_threads();
  if (panels >= 2 * threads && threads > 1 && !at::in_parallel_region()) {
    loom::BlockClaims claims;
    claims.reset(panels, threads);
#pragma omp parallel num_threads(threads)
    call.take_panels(claims);
  } else {
    at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
      alignas(64) float own_panel[kPanelK * kPanel];
      for (int64_t p = begin; p < end; ++p) call.run(p, p + 1 < end, own_panel);
    });
  }
  if (panels * kPanel < n_out) dense_f32_dots(x, w, y, m, k, n_out, panels * kPanel);
}

at::Tensor linear_f32_rows(const at::Tensor& x_in, const at::Tensor& w, const float* packed) {
  auto x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  auto out = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* y = out.data_ptr<float>();
  if (m <= kDotMaxRows && !packed) dense_f32_dots(xp, wp, y, m, k, n, 0);
  else dense_f32_panels(xp, wp, packed, y, m, k, n);
  return out;
}
#endif

template <typename Rows>
at::Tensor dispatch(const at::Tensor& x_in, const Rows& rows, int64_t n_out) {
  auto x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  auto out = at::empty({x.size(0), n_out}, x.options());
  if (x.scalar_type() == at::kFloat) {
    run<float>(x, rows, n_out, out);
  } else if (x.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(x, rows, n_out, out);
  } else {
    TORCH_CHECK(false, "small_m_linear: activations must be float32 or bfloat16");
  }
  return out;
}

}  // namespace

at::Tensor linear_dense(at::Tensor x, at::Tensor w, std::optional<at::Tensor> packed) {
  TORCH_CHECK(w.is_contiguous() && w.dim() == 2 && w.size(1) == x.size(1), "w must be contiguous [N, K]");
  const bool has_packed = packed.has_value() && packed->numel() > 0;
  if (w.scalar_type() == at::kFloat) {
#if defined(LOOM_F32_PANELS)
    if (has_packed) {
      TORCH_CHECK(packed->is_contiguous() && packed->scalar_type() == at::kFloat &&
                      packed->sizes() == at::IntArrayRef({w.size(0) / kPanel, w.size(1), kPanel}),
                  "packed must come from pack_dense_f32(w)");
      TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "x must be float32 [M, K]");
      return linear_f32_rows(x, w, packed->data_ptr<float>());
    }
    if (x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(0) > kXBlock && x.size(1) % 8 == 0)
      return linear_f32_rows(x, w, nullptr);
#endif
    TORCH_CHECK(!has_packed, "packed float32 weights are not used by this build");
    return dispatch(x, DenseF32{w.data_ptr<float>(), w.size(1)}, w.size(0));
  }
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "dense weights must be float32 or bfloat16");
#if defined(__AVX512BF16__)
  // One row without AMX streams W faster through the unpacked kernel below (a batch-1 step on
  // AMD Zen 4: 9.7-10.4 against 11.4-12.1 ms); from two rows the packed kernel wins.
  if (has_packed && !amx_bf16() && x.size(0) == 1 && x.scalar_type() == at::kBFloat16) {
    auto y = linear_dense_dpbf16(x, w);
    return packed->dim() == 6 ? silu_mul(y) : y;  // gated: [gate; up] -> silu(gate) * up
  }
#endif
  if (has_packed) return linear_packed_bf16(x, *packed);
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) % 32 == 0)
    return linear_dense_dpbf16(x, w);
#endif
  return dispatch(x, DenseBF16{reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), w.size(1)}, w.size(0));
}

// bfloat16 x of amx_panel_rows() rows or more on integer panels: AMX tiles over widened weights
static bool takes_amx_panels(const at::Tensor& x, const at::Tensor& panels, int64_t n) {
  return amx_panel_rows() && x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(0) >= amx_panel_rows() &&
         amx_panels_take(panels, n);
}

at::Tensor linear_int8(at::Tensor x, at::Tensor w, at::Tensor scale) {
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == at::kFloat, "scale must be float32 [N]");
  if (w.dim() == 3) {
    if (takes_amx_panels(x, w, scale.numel())) return linear_panels_amx(x, w, scale.numel(), scale, false);
    return linear_int8_panels(x, w, scale);
  }
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kChar && w.dim() == 2 && w.size(1) == x.size(1) &&
                  scale.numel() == w.size(0), "w must be int8 [N, K] (or from pack_int8), scale float32 [N]");
  const Int8Rows rows{w.data_ptr<int8_t>(), scale.data_ptr<float>(), w.size(1)};
  return dispatch(x, rows, w.size(0));
}

// w [N, K] float32 in the panels dense_f32_panels reads ([N / 16, K, 16]: panel p, input j, row
// r = W[16 p + r, j]; the last N % 16 rows stay with w), once at load instead of on every call.
// Empty where the build has no float32 panels or w does not fit them (N < 16, K % 8 != 0).
at::Tensor pack_dense_f32(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "w must be contiguous [N, K]");
#if defined(LOOM_F32_PANELS)
  const int64_t n = w.size(0), k = w.size(1), panels = n / kPanel;
  if (w.scalar_type() == at::kFloat && panels > 0 && k % 8 == 0) {
    auto out = at::empty({panels, k, kPanel}, w.options());
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, panels, 16, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p)
        for (int64_t k0 = 0; k0 < k; k0 += kPanelK)
          pack_panel(w.data_ptr<float>(), k, p * kPanel, k0, std::min(kPanelK, k - k0), dst + p * k * kPanel + k0 * kPanel);
    });
    return out;
  }
#endif
  return at::empty({0}, w.options());
}

// Rows of x up to which linear_dense beats torch's GEMM for float32 (0: only the weight-streaming
// sizes the caller picks).
int64_t dense_f32_rows() {
#if defined(LOOM_F32_PANELS)
  return kDenseF32Rows;
#else
  return 0;
#endif
}

// Whether bfloat16 x bfloat16 linears use vdpbf16ps (AVX512-BF16 builds).
bool dense_bf16_dot() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// Whether linear_int4, and linear_int8 on pack_int8's layout, quantize activations of `dtype` to
// int8 per group of 32 (integer dot products): float32 and bfloat16 on VNNI and AVX2 builds
// (widening the codes to float is compute-bound: on an AVX-512 Xeon without AMX, where float32 is
// the fast dtype, int4 batch 1 ran at 16.7 ms a step on one core for 80 MiB of weights).
bool quantized_int8_activations(at::ScalarType dtype) {
#if defined(LOOM_VNNI) || defined(LOOM_AVX2_INT)
  return dtype == at::kBFloat16 || dtype == at::kFloat;
#else
  return false;
#endif
}

// int8 [N, K] -> the layout of linear_int8's integer kernel: pack_int8_panels' (VNNI and AVX2).
at::Tensor pack_int8(at::Tensor w) {
#if defined(LOOM_VNNI) || defined(LOOM_AVX2_INT)
  return pack_int8_panels(w);
#else
  TORCH_CHECK(false, "pack_int8 needs integer dot products (see quantized_int8_activations)");
#endif
}

// Rows of x from which int4 takes its panels. AVX2: one row streams the weights, where the GGUF
// layout's fewer bytes pay (on Zen 3, 30 layers' shapes from DRAM, the panels ran 0.96x at one row,
// 1.19x at 2, 1.49x at 4, 1.80x at 8). VNNI: the panels take one row too (a Cascade Lake Xeon, the
// same shapes from DRAM: 1.62x).
int64_t int4_panel_rows() {
#if defined(LOOM_VNNI)
  return 1;
#else
  return 2;
#endif
}

at::Tensor linear_int4(at::Tensor x, at::Tensor w, at::Tensor scale, at::Tensor minimum,
                       std::optional<at::Tensor> panels) {
  const int64_t k = x.size(1), n = w.size(0);
  if (panels && panels->numel() && takes_amx_panels(x, *panels, n))
    return linear_panels_amx(x, *panels, n, std::nullopt, false);
  if (panels && panels->numel() && x.dim() == 2 && x.size(0) >= int4_panel_rows())
    return linear_int4_panels(x, *panels, n);
  TORCH_CHECK(k % kGroup == 0, "int4 weights need K (", k, ") to be a multiple of ", kGroup);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kByte && w.size(1) * 2 == k, "w must be uint8 [N, K/2]");
  TORCH_CHECK(scale.is_contiguous() && minimum.is_contiguous() && scale.scalar_type() == at::kHalf &&
                  minimum.scalar_type() == at::kHalf && scale.numel() == n * (k / kGroup) &&
                  minimum.numel() == n * (k / kGroup),
              "scale/min must be float16 [N, K/32]");
  const Int4Rows rows{w.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), minimum.data_ptr<at::Half>(), k};
#if defined(LOOM_VNNI)
  if (x.scalar_type() == at::kBFloat16 && k % (2 * kGroup) == 0)
    return vnni_linear<at::BFloat16>(x, rows, n, quantize_x<at::BFloat16>, LOOM_VNNI_BLOCK(int4_vnni_block));
  if (x.scalar_type() == at::kFloat && k % (2 * kGroup) == 0)
    return vnni_linear<float>(x, rows, n, quantize_x<float>, LOOM_VNNI_BLOCK(int4_vnni_block));
#elif defined(LOOM_AVX2_INT)
  if (x.dim() == 2 && k % (2 * kGroup) == 0 && quantized_int8_activations(x.scalar_type())) {
    const auto xc = x.contiguous();
    return xc.scalar_type() == at::kFloat ? linear_int4_avx2<float>(xc, rows, n)
                                               : linear_int4_avx2<at::BFloat16>(xc, rows, n);
  }
#endif
  return dispatch(x, rows, n);
}

// Widened weights [N, K] in the activation dtype, for inputs with many rows (prefill), where
// torch's GEMM on the widened copy beats streaming the codes once per row block.
at::Tensor dequantize_int8(at::Tensor w, at::Tensor scale, at::ScalarType dtype) {
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == at::kFloat && scale.dim() == 1,
              "dequantize_int8: float32 scale [N]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize_int8: float32 or bfloat16 output");
  if (w.dim() == 3) w = unpack_int8_panels(w, scale.numel());  // pack_int8's panels
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && scale.numel() == w.size(0),
              "dequantize_int8: int8 [N, K] (or from pack_int8), float32 [N]");
  const auto wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1);
  auto out = at::empty({n, k}, wc.options().dtype(dtype));
  const int8_t* q = wc.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, dtype, "dequantize_int8", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t j = 0; j < k; ++j) o[r * k + j] = static_cast<scalar_t>(static_cast<float>(q[r * k + j]) * s[r]);
    });
  });
  return out;
}

at::Tensor dequantize_int4(at::Tensor w, at::Tensor scale, at::Tensor minimum, at::ScalarType dtype) {
  const int64_t n = w.size(0), k = w.size(1) * 2, groups = k / kGroup;
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kByte && k % kGroup == 0 && scale.is_contiguous() &&
                  minimum.is_contiguous() && scale.scalar_type() == at::kHalf &&
                  minimum.scalar_type() == at::kHalf && scale.numel() == n * groups && minimum.numel() == n * groups,
              "dequantize_int4: uint8 [N, K/2], float16 scale/min [N, K/32]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize_int4: float32 or bfloat16 output");
  auto out = at::empty({n, k}, w.options().dtype(dtype));
  const uint8_t* q = w.data_ptr<uint8_t>();
  const at::Half* s = scale.data_ptr<at::Half>();
  const at::Half* mn = minimum.data_ptr<at::Half>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, dtype, "dequantize_int4", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* b = q + r * (k / 2) + g * (kGroup / 2);
          const float sc = half_to_float(s[r * groups + g]), m = half_to_float(mn[r * groups + g]);
          scalar_t* og = o + r * k + g * kGroup;
          for (int64_t i = 0; i < kGroup / 2; ++i) {
            og[i] = static_cast<scalar_t>(static_cast<float>(b[i] & 0xF) * sc + m);
            og[i + kGroup / 2] = static_cast<scalar_t>(static_cast<float>(b[i] >> 4) * sc + m);
          }
        }
    });
  });
  return out;
}

#if defined(__AVX512BF16__)
// Team forms (team.h) of the one-row bfloat16 linear: each thread streams its share of W's rows
// (at one row the weight stream is the limit; no stealing).
void linear_row_bf16_team(const at::BFloat16* x, const at::BFloat16* w, int64_t n, int64_t k, at::BFloat16* y) {
  int64_t begin, end;
  loom::team_share(n, begin, end);
  const auto* wp = reinterpret_cast<const uint16_t*>(w);
  const auto* xp = reinterpret_cast<const uint16_t*>(x);
  for (int64_t row = begin; row < end; ++row) dense_dpbf16_rows<1>(wp, row, xp, 1, k, y, n);
}

// An MLP's [gate; up] (w [2 inter, K]) on one row: y [inter] = silu(gate) * up, each thread its
// share of columns: their gate rows, then their up rows (two sequential streams, as the
// prefetcher likes them), then 16 columns at a time rounded where linear_dense then silu_mul
// round (bf16 gate and up, the silu, the product).
void gated_row_bf16_team(const at::BFloat16* x, const at::BFloat16* w, int64_t inter, int64_t k, at::BFloat16* y) {
  int64_t begin, end;
  loom::team_share(inter / 16, begin, end);
  const int64_t c0 = begin * 16, cols = (end - begin) * 16;
  const auto* wp = reinterpret_cast<const uint16_t*>(w);
  const auto* xp = reinterpret_cast<const uint16_t*>(x);
  std::vector<float> sums(2 * cols);
  for (int half = 0; half < 2; ++half)
    for (int64_t j = 0; j < cols; ++j) {
      float part[1][kXBlock];
      dense_dpbf16_block<1, 1>(wp, half * inter + c0 + j, xp, k, part);
      sums[half * cols + j] = part[0][0];
    }
  for (int64_t j = 0; j < cols; j += 16) {
    const __m512 gate = loom::round_bf16(_mm512_loadu_ps(sums.data() + j));
    const __m512 up = loom::round_bf16(_mm512_loadu_ps(sums.data() + cols + j));
    loom::store16_bf16(y + c0 + j, _mm512_mul_ps(loom::round_bf16(loom::silu16(gate)), up));
  }
}
#endif

// Team form of the prepacked float32 panels (dense_f32_panels) for steps whose x takes no strips.
bool f32_panels_team_takes(int64_t m, int64_t n_out) {
#if defined(LOOM_F32_PANELS) && defined(__AVX512F__)
  return n_out % kPanel == 0;
#elif defined(LOOM_F32_PANELS)
  return n_out % kPanel == 0 && m < kStripRows;
#else
  return false;
#endif
}

void linear_f32_panels_team(const float* x, int64_t m, int64_t k, const float* packed, float* y, int64_t n_out,
                            loom::BlockClaims& claims) {
#if defined(LOOM_F32_PANELS)
  F32PanelCall(x, nullptr, packed, y, m, k, n_out).take_panels(claims);
#else
  TORCH_CHECK(false, "this build has no float32 panels");
#endif
}
