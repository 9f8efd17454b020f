// int4 and int8 linears on integer products: the weights packed once at load into panels of
// 2 x kLanes output features (two vectors of int32 sums), x quantized per call to int8 per group of
// 32 (llama.cpp's Q8 activations, as the streaming kernels do).
//
// Each 32-bit lane of an accumulator is one output feature, so no horizontal sums are needed:
// four codes of a feature per lane meet four codes of x broadcast to every lane.
// - AVX512-VNNI (vpdpbusd: 64 unsigned-by-signed byte products summed 4 to each of 16 int32 lanes,
//   without saturation): panels of 32 features. int4 codes (<= 15) are the unsigned side as they
//   are; int8 weights are stored as w + 128, and each group's int32 sums start at -128 * sum(q) of
//   its row of x, which takes the offset off.
// - AVX2 (vpmaddubsw, pairs summed to saturating int16): panels of 16 features.
//   int4 (GGUF Q4_1 groups): unsigned codes <= 15 by signed x, a pair sums to at most
//   2 * 15 * 127, and a group's 8 such int16 products add up without saturating (8 * 3810 <
//   32767), so a 32-product group costs one vpmaddubsw and one vpaddw per 8 features and row,
//   twice the float32 FMA's products per instruction. Measured on AMD Zen 3 (one core, data in
//   L1): 213-223 GFLOP/s-equivalent for tiles of 4 rows x 16 features, against the float32 FMA
//   peak of ~100.
//   int8 (one scale per output feature): the unsigned side is |w| and x takes w's signs
//   (vpsignb), so no pair passes 2 * 127 * 127; each pair sum widens to int32 at once (vpmaddwd).
//   4 x 16 tiles ran at 130 GFLOP/s-equivalent there (the row-at-a-time kernel before: 94).
// Per group, the int32 sums turn float and take the scales:
//   int4: y[r, n] = sum_g scale[n, g] * dx[r, g] * (codes[n, g] . q[r, g]) + min[n, g] * sum(x[r, g])
//   int8: y[r, n] = scale[n] * sum_g dx[r, g] * (w[n, g] . q[r, g])
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "team.h"
#include "vec_math.h"


namespace {

constexpr int64_t kGroup = 32;  // products per x scale (and int4 scale / min: the GGUF Q4_1 block)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LOOM_INTEGER_PANELS 1
#define LOOM_VNNI_PANELS 1
constexpr int64_t kLanes = 16;  // output features per vector of int32 sums
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LOOM_INTEGER_PANELS 1
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 8;  // (the layouts only: nothing multiplies them on this build)
#endif
constexpr int64_t kPanelCols = 2 * kLanes;          // output features of a panel: two vectors
constexpr int64_t kCodeBytes = kPanelCols * kGroup / 2;  // an int4 panel's codes of one group
// An int4 panel's group: its codes, then the features' scales and mins (float32).
constexpr int64_t kPanelGroupBytes = kCodeBytes + 2 * kPanelCols * sizeof(float);
constexpr int64_t kInt8GroupBytes = kPanelCols * kGroup;  // an int8 panel's group: 8 steps x 2 vectors
// int8 panels hold w + 128 on VNNI (vpdpbusd's unsigned side), w itself on AVX2.
#if defined(LOOM_VNNI_PANELS)
constexpr auto kInt8PanelType = at::kByte;
using Int8PanelCode = uint8_t;
#else
constexpr auto kInt8PanelType = at::kChar;
using Int8PanelCode = int8_t;
#endif
// Tiles of one or two rows stream the weights: each step fetches a line this far ahead (8 groups).
constexpr int64_t kInt8Ahead = 8 * kInt8GroupBytes;

// rows of x per tile (4 x 16 ran fastest of 1-6 x 8-40 features on Zen 3's AVX2; 4 x 32 on VNNI)
constexpr int kTileRows = 4;

#if defined(LOOM_INTEGER_PANELS)
// Codes of group g, vector v (features kLanes v .. kLanes v + kLanes - 1) in the panel layout: 4
// parts of 4 kLanes bytes, part p holding, in lane l, byte j: element 8 p + j (low nibble) and
// 8 p + 4 + j (high nibble) of feature kLanes v + l. So one load feeds two products: the low
// nibbles against x[8p : 8p+4], the high ones against x[8p+4 : 8p+8].
struct Int4Panels {
  const uint8_t* data;
  int64_t groups;
  const uint8_t* group(int64_t panel, int64_t g) const { return data + (panel * groups + g) * kPanelGroupBytes; }
};

// x quantized per row and group: q [m][k], dx and the (unquantized) sum [m][k / 32]; on VNNI also
// -128 * the sum of each group's codes (int8 weights' offset).
struct Int8Groups {
  int8_t* q;
  float* dx;
  float* sum;
  int32_t* offset;
  int64_t k, groups;
  // q lies as the tiles read it: per tile of kTileRows rows, per group, each row's 32 codes (one
  // stream a tile). So every load of x in a tile is a fixed offset from one pointer; with x by rows
  // GCC kept a pointer per row and step and spilled them to the stack. Cascade Lake Xeon: VNNI
  // int8 256 x 3,072 x 576 on one core 117 -> 222-244 GOP/s, int4 145 -> 224; the avx2 build's
  // model linears (2 threads, 16-1,024 rows) 1.07-1.13x.
  int64_t m = 0;
  // A tile of R rows from row0 (a multiple of kTileRows) finds row r's group g at
  // tile_codes(row0) + r * kGroup + g * R * kGroup.
  const int8_t* tile_codes(int64_t row0) const { return q + row0 * k; }
  // where row i's group g lies
  int8_t* at(int64_t i, int64_t g) const {
    const int64_t row0 = i / kTileRows * kTileRows, rows = std::min<int64_t>(kTileRows, m - row0);
    return q + row0 * k + (i - row0) * kGroup + g * rows * kGroup;
  }
};

// One group of 32 inputs of one row: int8 codes (round to nearest, as the scalar kernels'
// nearbyint), its scale and its sum.
template <typename T>
inline void quantize_group(const T* x, int8_t* q, float& dx, float& sum, int32_t* offset) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = loom::load8(x + 8 * i);
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  const float most = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
  sum = loom::add_lanes_8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  dx = most / 127.f;
  const __m256 inv = _mm256_set1_ps(most > 0.f ? 127.f / most : 0.f);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  if (offset) {
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(1, 0, 3, 2)));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(2, 3, 0, 1)));
    *offset = -128 * _mm_cvtsi128_si32(t4);
  }
  // packs work within 128-bit halves: bytes come out as 0-3 8-11 16-19 24-27 4-7 12-15 20-23 28-31
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
}

// Group `at` (row at / groups, group at % groups) of x into qx.
template <typename T>
inline void quantize_group_at(const T* x, const Int8Groups& qx, int64_t at) {
  const int64_t row = at / qx.groups, g = at % qx.groups;
  quantize_group(x + row * qx.k + g * kGroup, qx.at(row, g), qx.dx[at], qx.sum[at], qx.offset ? qx.offset + at : nullptr);
}

template <typename T>
void quantize_rows(const T* x, int64_t m, const Int8Groups& qx) {
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t at = begin * qx.groups; at < end * qx.groups; ++at) quantize_group_at(x, qx, at);
  });
}

#if defined(LOOM_VNNI_PANELS)
// A tile row's kPanelCols sums to y[0 : cols].
template <typename T>
inline void store_row(const __m512 sums[2], T* y, int64_t cols) {
  if constexpr (std::is_same_v<T, float>) {
    if (cols == kPanelCols) {
      _mm512_storeu_ps(y, sums[0]);
      _mm512_storeu_ps(y + 16, sums[1]);
      return;
    }
  }
  alignas(64) float out[kPanelCols];
  _mm512_store_ps(out, sums[0]);
  _mm512_store_ps(out + 16, sums[1]);
  for (int64_t c = 0; c < cols; ++c) y[c] = static_cast<T>(out[c]);
}

// R rows of x times one int4 panel: y[r, 0:cols] for the panel's features (cols < kPanelCols for a
// last panel past N). The tiles stay inlined: GCC keeps a separate function's accumulators on the
// stack.
template <int R, typename T>
__attribute__((always_inline)) inline void int4_tile(const Int4Panels& w, int64_t panel, const Int8Groups& qx,
                                                      int64_t row0, T* y, int64_t ldy, int64_t cols) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int8_t* xq = qx.tile_codes(row0);
  constexpr int64_t x_row = kGroup, x_group = R * kGroup;
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* codes = w.group(panel, g);
    const int8_t* xg = xq + g * x_group;
    __m512i sums[R][2];
    for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      __m512i raw[2];
      for (int v = 0; v < 2; ++v) raw[v] = _mm512_loadu_si512(codes + v * 256 + p * 64);
#pragma GCC unroll 2
      for (int high = 0; high < 2; ++high) {
        __m512i wv[2];
        for (int v = 0; v < 2; ++v) wv[v] = _mm512_and_si512(high ? _mm512_srli_epi16(raw[v], 4) : raw[v], low4);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, xg + r * x_row + 8 * p + 4 * high, sizeof(four));
          const __m512i xb = _mm512_set1_epi32(four);
          for (int v = 0; v < 2; ++v) sums[r][v] = _mm512_dpbusd_epi32(sums[r][v], wv[v], xb);
        }
      }
    }
    const float* scales = reinterpret_cast<const float*>(codes + kCodeBytes);
    const float* mins = scales + kPanelCols;
    for (int v = 0; v < 2; ++v) {
      const __m512 scale = _mm512_loadu_ps(scales + 16 * v), minimum = _mm512_loadu_ps(mins + 16 * v);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t at = (row0 + r) * qx.groups + g;
        const __m512 dot = _mm512_cvtepi32_ps(sums[r][v]);
        acc[r][v] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(qx.dx[at])), acc[r][v]);
        acc[r][v] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(qx.sum[at]), acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store_row(acc[r], y + r * ldy, cols);
}

// int8 weights + 128 [ceil(N/32), K/32, 1024] (pack_int8_panels): group g, step s (inputs 4 s ..
// 4 s + 3), vector v: 64 bytes, lane l = the 4 codes of feature 16 v + l.
template <int R, typename T>
__attribute__((always_inline)) inline void int8_tile(const uint8_t* panel, int64_t groups, const float* scale,
                                                     const Int8Groups& qx, int64_t row0, T* y, int64_t ldy,
                                                     int64_t cols) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int8_t* xq = qx.tile_codes(row0);
  constexpr int64_t x_row = kGroup, x_group = R * kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* codes = panel + g * kInt8GroupBytes;
    const int8_t* xg = xq + g * x_group;
    __m512i sums[R][2];
    // (one row: two chains of sums a vector, odd and even steps, so that vpdpbusd's latency hides)
    constexpr int chains = R == 1 ? 2 : 1;
    __m512i odd[R][2];
    for (int r = 0; r < R; ++r) {
      sums[r][0] = sums[r][1] = _mm512_set1_epi32(qx.offset[(row0 + r) * qx.groups + g]);
      odd[r][0] = odd[r][1] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int step = 0; step < 8; ++step) {
      __m512i wv[2];
      if constexpr (R <= 2) {
        _mm_prefetch(reinterpret_cast<const char*>(codes + kInt8Ahead + step * 128), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(codes + kInt8Ahead + step * 128 + 64), _MM_HINT_T0);
      }
      for (int v = 0; v < 2; ++v) wv[v] = _mm512_loadu_si512(codes + step * 128 + v * 64);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xg + r * x_row + 4 * step, sizeof(four));
        const __m512i xb = _mm512_set1_epi32(four);
        for (int v = 0; v < 2; ++v) {
          __m512i& chain = chains == 2 && step % 2 ? odd[r][v] : sums[r][v];
          chain = _mm512_dpbusd_epi32(chain, wv[v], xb);
        }
      }
    }
    if constexpr (chains == 2)
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < 2; ++v) sums[r][v] = _mm512_add_epi32(sums[r][v], odd[r][v]);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(qx.dx[(row0 + r) * qx.groups + g]);
      for (int v = 0; v < 2; ++v) acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][v]), dx, acc[r][v]);
    }
  }
  const __mmask16 live[2] = {static_cast<__mmask16>(cols >= 16 ? 0xFFFF : (1u << cols) - 1),
                             static_cast<__mmask16>(cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1)};
  __m512 feature_scale[2];
  for (int v = 0; v < 2; ++v) feature_scale[v] = _mm512_maskz_loadu_ps(live[v], scale + 16 * v);
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 2; ++v) acc[r][v] = _mm512_mul_ps(acc[r][v], feature_scale[v]);
    store_row(acc[r], y + r * ldy, cols);
  }
}
#else
// R rows of x times one int4 panel: y[r, 0:cols] for the panel's features (cols < kPanelCols for a
// panel past N). The tiles stay inlined: GCC keeps a separate function's accumulators on the stack.
template <int R, typename T>
__attribute__((always_inline)) inline void int4_tile(const Int4Panels& w, int64_t panel, const Int8Groups& qx,
                                                      int64_t row0, T* y, int64_t ldy, int64_t cols) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int8_t* xq = qx.tile_codes(row0);
  constexpr int64_t x_row = kGroup, x_group = R * kGroup;
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* codes = w.group(panel, g);
    const int8_t* xg = xq + g * x_group;
    __m256i sums[R][2];
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
#pragma GCC unroll 2
      for (int high = 0; high < 2; ++high) {
        __m256i wv[2];
        for (int v = 0; v < 2; ++v) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + v * 128 + p * 32));
          wv[v] = _mm256_and_si256(high ? _mm256_srli_epi16(raw, 4) : raw, low4);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, xg + r * x_row + 8 * p + 4 * high, sizeof(four));
          const __m256i xb = _mm256_set1_epi32(four);
          for (int v = 0; v < 2; ++v) {
            const __m256i prod = _mm256_maddubs_epi16(wv[v], xb);
            sums[r][v] = p == 0 && !high ? prod : _mm256_add_epi16(sums[r][v], prod);
            // (keeps GCC from reassociating the sums into a tree, which holds every product live
            // and spills them: half the speed)
            asm("" : "+x"(sums[r][v]));
          }
        }
      }
    }
    const float* scales = reinterpret_cast<const float*>(codes + kCodeBytes);
    const float* mins = scales + kPanelCols;
    for (int v = 0; v < 2; ++v) {
      const __m256 scale = _mm256_loadu_ps(scales + 8 * v), minimum = _mm256_loadu_ps(mins + 8 * v);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t at = (row0 + r) * qx.groups + g;
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r][v], ones));
        acc[r][v] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, _mm256_set1_ps(qx.dx[at])), acc[r][v]);
        acc[r][v] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(qx.sum[at]), acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[kPanelCols];
    _mm256_store_ps(out, acc[r][0]);
    _mm256_store_ps(out + 8, acc[r][1]);
    T* yr = y + r * ldy;
    for (int64_t c = 0; c < cols; ++c) yr[c] = static_cast<T>(out[c]);
  }
}

// int8 weights [ceil(N/16), K/32, 512] (pack_int8_panels): group g, step s (inputs 4 s .. 4 s + 3),
// vector v: 32 bytes, lane l = the 4 codes of feature 8 v + l.
template <int R, typename T>
__attribute__((always_inline)) inline void int8_tile(const Int8PanelCode* panel, int64_t groups, const float* scale,
                                                     const Int8Groups& qx, int64_t row0, T* y, int64_t ldy,
                                                     int64_t cols) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int8_t* xq = qx.tile_codes(row0);
  constexpr int64_t x_row = kGroup, x_group = R * kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const Int8PanelCode* codes = panel + g * kInt8GroupBytes;
    const int8_t* xg = xq + g * x_group;
    __m256i sums[R][2];
#pragma GCC unroll 8
    for (int step = 0; step < 8; ++step) {
      __m256i wv[2], magnitude[2];
      if constexpr (R <= 2) _mm_prefetch(reinterpret_cast<const char*>(codes + kInt8Ahead + step * 64), _MM_HINT_T0);
      for (int v = 0; v < 2; ++v) {
        wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + step * 64 + v * 32));
        magnitude[v] = _mm256_abs_epi8(wv[v]);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xg + r * x_row + 4 * step, sizeof(four));
        const __m256i xb = _mm256_set1_epi32(four);
        for (int v = 0; v < 2; ++v) {
          const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[v], _mm256_sign_epi8(xb, wv[v])), ones);
          sums[r][v] = step == 0 ? dot : _mm256_add_epi32(sums[r][v], dot);
          asm("" : "+x"(sums[r][v]));  // (as in int4_tile: keeps the chain)
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(qx.dx[(row0 + r) * qx.groups + g]);
      for (int v = 0; v < 2; ++v) acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][v]), dx, acc[r][v]);
    }
  }
  alignas(32) float feature_scale[kPanelCols] = {};
  std::memcpy(feature_scale, scale, cols * sizeof(float));
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[kPanelCols];
    for (int v = 0; v < 2; ++v) _mm256_store_ps(out + 8 * v, _mm256_mul_ps(acc[r][v], _mm256_load_ps(feature_scale + 8 * v)));
    T* yr = y + r * ldy;
    for (int64_t c = 0; c < cols; ++c) yr[c] = static_cast<T>(out[c]);
  }
}

#endif

// Every row of x times one panel of kPanelCols features (y's columns n0 .. n0 + cols), kTileRows rows a
// tile: tile(R, row0, y_at_row0, cols) with R as a compile-time constant.
template <typename T, typename Tile>
void run_panel(int64_t panel, int64_t m, T* y, int64_t n_out, Tile tile) {
  const int64_t n0 = panel * kPanelCols, cols = std::min(kPanelCols, n_out - n0);
  T* yp = y + n0;
  int64_t i = 0;
  for (; i + kTileRows <= m; i += kTileRows) tile(std::integral_constant<int, kTileRows>{}, i, yp + i * n_out, cols);
  switch (m - i) {
    case 3: tile(std::integral_constant<int, 3>{}, i, yp + i * n_out, cols); break;
    case 2: tile(std::integral_constant<int, 2>{}, i, yp + i * n_out, cols); break;
    case 1: tile(std::integral_constant<int, 1>{}, i, yp + i * n_out, cols); break;
    default: break;
  }
}

// x's quantized form for m rows of k inputs in caller-owned buffers: codes m * k, scales 2 * m *
// k / 32 (dx, then the sums), offsets m * k / 32 (VNNI).
Int8Groups quantized_x(int8_t* codes, float* scales, int32_t* offsets, int64_t m, int64_t k) {
  const int64_t groups = k / kGroup;
#if !defined(LOOM_VNNI_PANELS)
  offsets = nullptr;
#endif
  return {codes, scales, scales + m * groups, offsets, k, groups, m};
}

// Every row of x times panel p into y [M, n_out] (x quantized in qx).
template <typename T, typename Tile>
void panel_rows(const Int8Groups& qx, int64_t p, T* y, int64_t n_out, Tile tile) {
  run_panel(p, qx.m, y, n_out,
            [&](auto r_const, int64_t row0, T* yr, int64_t cols) { tile(r_const, qx, p, row0, yr, n_out, cols); });
}

// This thread's panels in a region: its share front first, then single panels from the back of
// the others' (team.h), as the float32 panels do.
template <typename T, typename Tile>
void take_panels(const Int8Groups& qx, T* y, int64_t n_out, loom::BlockClaims& claims, Tile tile) {
  const int t = omp_get_thread_num();
  int64_t p0, p1, end;
  while (claims.take_front(t, 1, p0, p1, end)) panel_rows(qx, p0, y, n_out, tile);
  for (int64_t p; claims.steal(t, p);) panel_rows(qx, p, y, n_out, tile);
}

// y [M, n_out] = x @ W.T: x quantized once, then the panels shared among the threads.
template <typename T, typename Tile>
at::Tensor linear_panels_as(const at::Tensor& x, int64_t panels, int64_t n_out, Tile tile) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup;
  auto codes = at::empty({m, k}, x.options().dtype(at::kChar));
  auto scales = at::empty({2, m, groups}, x.options().dtype(at::kFloat));
  auto offsets = at::empty({m, groups}, x.options().dtype(at::kInt));
  const Int8Groups qx = quantized_x(codes.data_ptr<int8_t>(), scales.data_ptr<float>(), offsets.data_ptr<int32_t>(), m, k);
  quantize_rows(x.data_ptr<T>(), m, qx);
  auto out = at::empty({m, n_out}, x.options());
  T* y = out.data_ptr<T>();
  const int threads = at::get_num_threads();
  if (panels >= 2 * threads && threads > 1 && !at::in_parallel_region()) {
    loom::BlockClaims claims;
    claims.reset(panels, threads);
#pragma omp parallel num_threads(threads)
    take_panels(qx, y, n_out, claims, tile);
  } else {
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) panel_rows(qx, p, y, n_out, tile);
    });
  }
  return out;
}

// The same in a region: the team quantizes x (a barrier), then takes the panels (no barrier).
template <typename T, typename Tile>
void linear_panels_team(const T* x, int64_t m, int64_t k, const IntegerScratch& scratch, T* y, int64_t n_out,
                        loom::BlockClaims& claims, Tile tile) {
  const Int8Groups qx = quantized_x(scratch.codes, scratch.scales, scratch.offsets, m, k);
#pragma omp for schedule(static)
  for (int64_t at = 0; at < m * qx.groups; ++at) quantize_group_at(x, qx, at);
  take_panels(qx, y, n_out, claims, tile);
}

auto int4_tiles(const Int4Panels& w) {
  return [w](auto r_const, const Int8Groups& qx, int64_t p, int64_t row0, auto* y, int64_t ldy, int64_t cols) {
    int4_tile<decltype(r_const)::value>(w, p, qx, row0, y, ldy, cols);
  };
}

auto int8_tiles(const Int8PanelCode* w, int64_t groups, const float* scale) {
  return [=](auto r_const, const Int8Groups& qx, int64_t p, int64_t row0, auto* y, int64_t ldy, int64_t cols) {
    int8_tile<decltype(r_const)::value>(w + p * groups * kInt8GroupBytes, groups, scale + p * kPanelCols, qx, row0, y,
                                        ldy, cols);
  };
}

template <typename T>
at::Tensor linear_int4_panels_as(const at::Tensor& x, const Int4Panels& w, int64_t panels, int64_t n_out) {
  return linear_panels_as<T>(x, panels, n_out, int4_tiles(w));
}

template <typename T>
at::Tensor linear_int8_panels_as(const at::Tensor& x, const Int8PanelCode* w, int64_t panels, const float* scale,
                                 int64_t n_out) {
  return linear_panels_as<T>(x, panels, n_out, int8_tiles(w, x.size(1) / kGroup, scale));
}
#endif

}  // namespace

#if defined(LOOM_VNNI_PANELS) && defined(__AVX512BF16__)
namespace {
// Lane l of f0 and f1 as the bf16 pair (f0[l], f1[l]) in 32-bit lane l: the VNNI form the AMX
// tiles multiply (cvtne2ps puts f0's 16 words first, f1's after; the permutation interleaves them).
inline __m512i interleave_bf16(__m512 f0, __m512 f1) {
  alignas(64) static const int16_t order[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_permutexvar_epi16(_mm512_load_si512(order), (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
}
}  // namespace

// Column tile `tile` (features 16 tile .. 16 tile + 15) of int8 panels, as bfloat16 weights in the
// AMX tiles' form: group g's 16 pairs of inputs at dst + g * group_stride, pair p's 32 values at
// p * 32. Each value is bf16(code * scale), rounded as dequantize_int8 rounds it (the FMA of
// code + 128 by scale plus -128 scale is that product, exact, rounded once).
void int8_panel_tile_bf16(const uint8_t* panels, int64_t groups, const float* scale, int64_t tile,
                          at::BFloat16* dst, int64_t group_stride) {
  const __m512 s = _mm512_loadu_ps(scale + 16 * tile), offset = _mm512_mul_ps(s, _mm512_set1_ps(-128.f));
  const __m512i byte = _mm512_set1_epi32(0xFF);
  const uint8_t* src = panels + (tile / 2) * groups * kInt8GroupBytes + (tile % 2) * 64;
  const auto value = [&](__m512i w, int shift) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, shift), byte)), s, offset);
  };
  for (int64_t g = 0; g < groups; ++g, src += kInt8GroupBytes, dst += group_stride)
    for (int step = 0; step < 8; ++step) {  // inputs 4 step .. 4 step + 3: two pairs
      const __m512i w = _mm512_loadu_si512(src + step * 2 * 64);
      _mm512_storeu_si512(dst + (2 * step) * 32, interleave_bf16(value(w, 0), value(w, 8)));
      _mm512_storeu_si512(dst + (2 * step + 1) * 32, interleave_bf16(value(w, 16), value(w, 24)));
    }
}

// The same for int4 panels: bf16(code * scale + min), rounded as dequantize_int4 rounds it (the
// product, then the sum).
void int4_panel_tile_bf16(const uint8_t* panels, int64_t groups, int64_t tile, at::BFloat16* dst,
                          int64_t group_stride) {
  const __m512i nibble = _mm512_set1_epi32(0xF);
  const uint8_t* src = panels + (tile / 2) * groups * kPanelGroupBytes;
  const int64_t v = tile % 2;
  for (int64_t g = 0; g < groups; ++g, src += kPanelGroupBytes, dst += group_stride) {
    const float* scales = reinterpret_cast<const float*>(src + kCodeBytes);
    const __m512 s = _mm512_loadu_ps(scales + 16 * v), minimum = _mm512_loadu_ps(scales + kPanelCols + 16 * v);
    const auto value = [&](__m512i w, int shift) {
      const __m512 code = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, shift), nibble));
      return _mm512_add_ps(_mm512_mul_ps(code, s), minimum);
    };
    for (int part = 0; part < 4; ++part) {  // inputs 8 part .. 8 part + 7: lane l's byte j holds
      // input 8 part + j (low nibble) and 8 part + 4 + j (high nibble) of feature 16 v + l
      const __m512i w = _mm512_loadu_si512(src + v * 256 + part * 64);
      at::BFloat16* out = dst + 4 * part * 32;
      _mm512_storeu_si512(out, interleave_bf16(value(w, 0), value(w, 8)));
      _mm512_storeu_si512(out + 32, interleave_bf16(value(w, 16), value(w, 24)));
      _mm512_storeu_si512(out + 64, interleave_bf16(value(w, 4), value(w, 12)));
      _mm512_storeu_si512(out + 96, interleave_bf16(value(w, 20), value(w, 28)));
    }
  }
}
#endif

bool integer_panels() {
#if defined(LOOM_INTEGER_PANELS)
  return true;
#else
  return false;
#endif
}

// uint8 [N, K/2] in GGUF Q4 order (linear_int4's layout) with float16 scale / min [N, K/32] ->
// the panels: [ceil(N / kPanelCols), K/32] groups of kPanelGroupBytes (features past N: zero codes
// and scales).
at::Tensor pack_int4_panels(at::Tensor w, at::Tensor scale, at::Tensor minimum) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte, "pack_int4_panels: uint8 [N, K/2] codes");
  const int64_t n = w.size(0), k = 2 * w.size(1), groups = k / kGroup;
  TORCH_CHECK(k % kGroup == 0 && scale.numel() == n * groups && minimum.numel() == n * groups &&
                  scale.scalar_type() == at::kHalf && minimum.scalar_type() == at::kHalf,
              "pack_int4_panels: K a multiple of 32, float16 scale / min [N, K/32]");
  const auto wc = w.contiguous();
  const auto s = scale.contiguous().to(at::kFloat), mn = minimum.contiguous().to(at::kFloat);
  const int64_t panels = (n + kPanelCols - 1) / kPanelCols;
  auto packed = at::zeros({panels, groups, kPanelGroupBytes}, w.options());
  const uint8_t* src = wc.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  const float* mp = mn.data_ptr<float>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel)
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* out = dst + (panel * groups + g) * kPanelGroupBytes;
        float* scales = reinterpret_cast<float*>(out + kCodeBytes);
        for (int64_t c = 0; c < kPanelCols; ++c) {
          const int64_t feature = panel * kPanelCols + c;
          if (feature >= n) break;
          const uint8_t* group = src + feature * (k / 2) + g * (kGroup / 2);
          // element e of a GGUF group: byte e % 16, low nibble for e < 16
          const auto code = [&](int64_t e) { return e < 16 ? group[e] & 0xF : group[e - 16] >> 4; };
          const int64_t v = c / kLanes, lane = c % kLanes;
          for (int64_t p = 0; p < 4; ++p)
            for (int64_t j = 0; j < 4; ++j)
              out[v * 16 * kLanes + p * 4 * kLanes + lane * 4 + j] = static_cast<uint8_t>(code(8 * p + j) | code(8 * p + 4 + j) << 4);
          scales[c] = sp[feature * groups + g];
          scales[kPanelCols + c] = mp[feature * groups + g];
        }
      }
  });
  return packed;
}

at::Tensor linear_int4_panels(at::Tensor x, at::Tensor panels, int64_t n_out) {
#if defined(LOOM_INTEGER_PANELS)
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == kPanelGroupBytes &&
                  panels.size(0) * kPanelCols >= n_out && x.size(1) == panels.size(1) * kGroup,
              "linear_int4_panels: x [M, K] and panels from pack_int4_panels of K / 32 groups");
  const auto xc = x.contiguous();
  const Int4Panels w{panels.data_ptr<uint8_t>(), panels.size(1)};
  if (xc.scalar_type() == at::kFloat) return linear_int4_panels_as<float>(xc, w, panels.size(0), n_out);
  TORCH_CHECK(xc.scalar_type() == at::kBFloat16, "linear_int4_panels: float32 or bfloat16 x");
  return linear_int4_panels_as<c10::BFloat16>(xc, w, panels.size(0), n_out);
#else
  TORCH_CHECK(false, "linear_int4_panels needs AVX2 or AVX512-VNNI (see integer_panels())");
#endif
}

// int8 [N, K] (K a multiple of 32) -> [ceil(N / kPanelCols), K/32, 32 kPanelCols]: panel p, group g,
// step s, vector v, lane l, byte j = W[kPanelCols p + kLanes v + l, 32 g + 4 s + j] (features past N:
// zero weights), + 128 as uint8 on VNNI builds.
at::Tensor pack_int8_panels(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.size(1) % kGroup == 0,
              "pack_int8_panels: int8 [N, K] with K a multiple of 32");
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanelCols - 1) / kPanelCols;
  auto padded = at::zeros({panels * kPanelCols, k}, w.options().dtype(at::kShort));
  padded.narrow(0, 0, n).copy_(w);
  if (kInt8PanelType == at::kByte) padded.add_(128);
  // [p, v, l, g, s, j] -> [p, g, s, v, l, j]
  return padded.to(kInt8PanelType).view({panels, 2, kLanes, k / kGroup, 8, 4}).permute({0, 3, 4, 1, 2, 5})
      .contiguous().view({panels, k / kGroup, kInt8GroupBytes});
}

// The int8 [N, K] weights of pack_int8_panels' layout (n features).
at::Tensor unpack_int8_panels(at::Tensor panels, int64_t n) {
  const int64_t count = panels.size(0), groups = panels.size(1);
  auto codes = panels.view({count, groups, 8, 2, kLanes, 4}).permute({0, 3, 4, 1, 2, 5})
      .reshape({count * kPanelCols, groups * kGroup}).narrow(0, 0, n);
  return panels.scalar_type() == at::kByte ? codes.to(at::kShort).sub(128).to(at::kChar) : codes;
}

at::Tensor linear_int8_panels(at::Tensor x, at::Tensor panels, at::Tensor scale) {
#if defined(LOOM_INTEGER_PANELS)
  const int64_t n_out = scale.numel();
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.scalar_type() == kInt8PanelType &&
                  panels.size(2) == kInt8GroupBytes && panels.size(0) * kPanelCols >= n_out &&
                  x.size(1) == panels.size(1) * kGroup && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "linear_int8_panels: x [M, K], panels from pack_int8_panels of K / 32 groups, float32 scale [N]");
  const auto xc = x.contiguous();
  const auto* w = static_cast<const Int8PanelCode*>(panels.data_ptr());
  if (xc.scalar_type() == at::kFloat)
    return linear_int8_panels_as<float>(xc, w, panels.size(0), scale.data_ptr<float>(), n_out);
  TORCH_CHECK(xc.scalar_type() == at::kBFloat16, "linear_int8_panels: float32 or bfloat16 x");
  return linear_int8_panels_as<c10::BFloat16>(xc, w, panels.size(0), scale.data_ptr<float>(), n_out);
#else
  TORCH_CHECK(false, "linear_int8_panels needs AVX2 or AVX512-VNNI (see integer_panels())");
#endif
}

namespace {
template <typename T>
void int8_panels_team(const T* x, int64_t m, int64_t k, const at::Tensor& panels, const float* scale, int64_t n_out,
                      const IntegerScratch& scratch, T* y, loom::BlockClaims& claims) {
#if defined(LOOM_INTEGER_PANELS)
  const auto* w = static_cast<const Int8PanelCode*>(panels.data_ptr());
  linear_panels_team(x, m, k, scratch, y, n_out, claims, int8_tiles(w, k / kGroup, scale));
#else
  TORCH_CHECK(false, "linear_int8_panels needs AVX2 or AVX512-VNNI (see integer_panels())");
#endif
}

template <typename T>
void int4_panels_team(const T* x, int64_t m, int64_t k, const at::Tensor& panels, int64_t n_out,
                      const IntegerScratch& scratch, T* y, loom::BlockClaims& claims) {
#if defined(LOOM_INTEGER_PANELS)
  linear_panels_team(x, m, k, scratch, y, n_out, claims, int4_tiles(Int4Panels{panels.data_ptr<uint8_t>(), k / kGroup}));
#else
  TORCH_CHECK(false, "linear_int4_panels needs AVX2 or AVX512-VNNI (see integer_panels())");
#endif
}
}  // namespace

void linear_int8_panels_team(const float* x, int64_t m, int64_t k, const at::Tensor& panels, const float* scale,
                             int64_t n_out, const IntegerScratch& scratch, float* y, loom::BlockClaims& claims) {
  int8_panels_team(x, m, k, panels, scale, n_out, scratch, y, claims);
}

void linear_int8_panels_team(const at::BFloat16* x, int64_t m, int64_t k, const at::Tensor& panels, const float* scale,
                             int64_t n_out, const IntegerScratch& scratch, at::BFloat16* y, loom::BlockClaims& claims) {
  int8_panels_team(x, m, k, panels, scale, n_out, scratch, y, claims);
}

void linear_int4_panels_team(const float* x, int64_t m, int64_t k, const at::Tensor& panels, int64_t n_out,
                             const IntegerScratch& scratch, float* y, loom::BlockClaims& claims) {
  int4_panels_team(x, m, k, panels, n_out, scratch, y, claims);
}

void linear_int4_panels_team(const at::BFloat16* x, int64_t m, int64_t k, const at::Tensor& panels, int64_t n_out,
                             const IntegerScratch& scratch, at::BFloat16* y, loom::BlockClaims& claims) {
  int4_panels_team(x, m, k, panels, n_out, scratch, y, claims);
}
