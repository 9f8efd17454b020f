// y[M, N] = x[M, K] @ W[N, K]^T with W kept in float16 (`--quantization fp16`): half the bytes of
// float32 weights to stream at decode; on AVX512-FP16 at any row count (batch 1 to prefill).
//
// Layout (pack_half): [P = ceil(N / 16), ceil(K / 2), 16, 2] halves, panel p, input pair j,
// column c, parity e holding W[16 p + c, 2 j + e] (zeros past N and K). One 64-byte row of a panel
// is 16 columns x 2 inputs: a broadcast pair of x (x[2j], x[2j+1]) multiplies it lane by lane, so
// each accumulator lane sums one column's even or odd inputs, and the two are added at the end.
//
// AVX512-FP16 builds multiply in float16 (vfmadd231ph: twice float32's lanes; 2.2x its FMA rate
// on an AVX-512 Xeon): x is rounded to float16 once per call, products are summed in float16 over
// spans of kSpan pairs and each span's sums widened into float32 (float16 sums over the whole of
// K = 1536 erred 4e-3 of |y|, bfloat16 linears 2.7e-3; spans of 128 pairs 1.5-1.8e-3 at 0.95x the
// speed of unwidened sums, spans of 64 1.1-1.3e-3 at 0.8x). Other builds
// widen the weights to float32 (F16C) and keep x in float32: the bandwidth gain alone.
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kernels.h"

namespace {

constexpr int64_t kCols = 16;          // output columns per panel
constexpr int64_t kPanelRow = 2 * kCols;  // halves per pair-row of a panel

#if defined(__AVX512FP16__) && defined(__AVX512BW__)
#define LOOM_FP16_MATH 1
constexpr int kTileRows = 6, kTilePanels = 4;  // 24 float16 accumulators
constexpr int64_t kSpan = 128;
#elif defined(__AVX512F__)
constexpr int kTileRows = 4, kTilePanels = 3;  // 24 float32 accumulators (2 per panel row)
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kTileRows = 3, kTilePanels = 1;  // 12 accumulators (4 per panel row)
#else
constexpr int kTileRows = 2, kTilePanels = 1;
#endif

#if defined(LOOM_FP16_MATH)
// R rows of x (float16, row stride x_stride halves) times P panels (panel stride w_stride halves)
// -> y, columns [0, cols) of the P panels.
template <int R, int P>
void tile(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t w_stride, int64_t pairs, float* y,
          int64_t y_stride, int64_t cols) {
  alignas(64) float sums[R * P * kPanelRow];
  for (int64_t j0 = 0; j0 < pairs; j0 += kSpan) {
    const int64_t j1 = std::min(pairs, j0 + kSpan);
    __m512h acc[R][P];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ph();
    for (int64_t j = j0; j < j1; ++j) {
      __m512h wv[P];
      for (int p = 0; p < P; ++p) wv[p] = _mm512_castsi512_ph(_mm512_loadu_si512(w + p * w_stride + j * kPanelRow));
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * x_stride + 2 * j, sizeof pair);
        const __m512h xb = _mm512_castsi512_ph(_mm512_set1_epi32(pair));
        for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ph(xb, wv[p], acc[r][p]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) {  // widen the span's float16 sums into float32
        const __m512i bits = _mm512_castph_si512(acc[r][p]);
        float* s = sums + (r * P + p) * kPanelRow;
        __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(bits));
        __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(bits, 1));
        if (j0 > 0) {
          lo = _mm512_add_ps(_mm512_load_ps(s), lo);
          hi = _mm512_add_ps(_mm512_load_ps(s + 16), hi);
        }
        _mm512_store_ps(s, lo);
        _mm512_store_ps(s + 16, hi);
      }
  }
  // lanes (column, parity) -> columns: even lanes plus odd lanes
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) {
      const float* s = sums + (r * P + p) * kPanelRow;
      const __m512 a = _mm512_load_ps(s), b = _mm512_load_ps(s + 16);
      const __m512 col = _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
      const int64_t width = std::min<int64_t>(kCols, cols - p * kCols);
      _mm512_mask_storeu_ps(y + r * y_stride + p * kCols, static_cast<__mmask16>((1u << width) - 1), col);
    }
}
using XElem = uint16_t;
#else
#if defined(__AVX512F__)
constexpr int kLanes = 16;
using Vec = __m512;
inline Vec widen(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Vec pair_of(const float* p) {
  double d;
  std::memcpy(&d, p, sizeof d);
  return _mm512_castpd_ps(_mm512_set1_pd(d));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kLanes = 8;
using Vec = __m256;
inline Vec widen(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Vec pair_of(const float* p) { return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(p))); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
constexpr int kVecs = kPanelRow / kLanes;  // vectors per pair-row of a panel

template <int R, int P>
void tile_sums(const float* x, int64_t x_stride, const uint16_t* w, int64_t w_stride, int64_t pairs, float* sums) {
  Vec acc[R][P][kVecs];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      for (int v = 0; v < kVecs; ++v) acc[r][p][v] = vzero();
  for (int64_t j = 0; j < pairs; ++j) {
    Vec wv[P][kVecs];
    for (int p = 0; p < P; ++p)
      for (int v = 0; v < kVecs; ++v) wv[p][v] = widen(w + p * w_stride + j * kPanelRow + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec xb = pair_of(x + r * x_stride + 2 * j);
      for (int p = 0; p < P; ++p)
        for (int v = 0; v < kVecs; ++v) acc[r][p][v] = vfma(xb, wv[p][v], acc[r][p][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      for (int v = 0; v < kVecs; ++v) vstore(sums + (r * P + p) * kPanelRow + v * kLanes, acc[r][p][v]);
}
#else
template <int R, int P>
void tile_sums(const float* x, int64_t x_stride, const uint16_t* w, int64_t w_stride, int64_t pairs, float* sums) {
  std::fill(sums, sums + R * P * kPanelRow, 0.f);
  for (int64_t j = 0; j < pairs; ++j)
    for (int p = 0; p < P; ++p) {
      const auto* row = reinterpret_cast<const at::Half*>(w + p * w_stride + j * kPanelRow);
      for (int r = 0; r < R; ++r)
        for (int64_t l = 0; l < kPanelRow; ++l)
          sums[(r * P + p) * kPanelRow + l] += x[r * x_stride + 2 * j + (l & 1)] * static_cast<float>(row[l]);
    }
}
#endif
using XElem = float;

// sums [R][P][32] (lane 2c + e: column c, parity e) -> y rows, columns [0, cols) of each panel.
template <int R, int P>
void tile(const float* x, int64_t x_stride, const uint16_t* w, int64_t w_stride, int64_t pairs, float* y,
          int64_t y_stride, int64_t cols) {
  alignas(64) float sums[R * P * kPanelRow];
  tile_sums<R, P>(x, x_stride, w, w_stride, pairs, sums);
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) {
      const float* s = sums + (r * P + p) * kPanelRow;
      const int64_t width = std::min<int64_t>(kCols, cols - p * kCols);
      for (int64_t c = 0; c < width; ++c) y[r * y_stride + p * kCols + c] = s[2 * c] + s[2 * c + 1];
    }
}
#endif

// One tile of `rows` <= R rows and `panels` <= P panels (the instantiation that fits it exactly).
template <int R, int P>
void run_tile(int rows, int panels, const XElem* x, int64_t x_stride, const uint16_t* w, int64_t w_stride,
              int64_t pairs, float* y, int64_t y_stride, int64_t cols) {
  if constexpr (R > 1) {
    if (rows < R) return run_tile<R - 1, P>(rows, panels, x, x_stride, w, w_stride, pairs, y, y_stride, cols);
  }
  if constexpr (P > 1) {
    if (panels < P) return run_tile<R, P - 1>(rows, panels, x, x_stride, w, w_stride, pairs, y, y_stride, cols);
  }
  tile<R, P>(x, x_stride, w, w_stride, pairs, y, y_stride, cols);
}

}  // namespace

at::Tensor pack_half(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.is_floating_point(), "pack_half: floating-point [N, K] weights expected");
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kCols - 1) / kCols, pairs = (k + 1) / 2;
  auto padded = at::zeros({panels * kCols, pairs * 2}, w.options().dtype(at::kHalf));
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(w);
  // [P, 16, pairs, 2] -> [P, pairs, 16, 2]
  return padded.view({panels, kCols, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor linear_half(at::Tensor x, at::Tensor packed, int64_t n) {
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kHalf && packed.dim() == 4 &&
                  packed.size(2) == kCols && packed.size(3) == 2,
              "linear_half: packed must come from pack_half");
  const int64_t panels = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) <= 2 * pairs && x.size(1) > 2 * pairs - 2 && n > (panels - 1) * kCols &&
                  n <= panels * kCols,
              "linear_half: x [M, K] and n must match the packed weights");
  const int64_t m = x.size(0);
  auto xf = x.to(at::kFloat).contiguous();
  if (xf.size(1) < 2 * pairs) xf = at::constant_pad_nd(xf, {0, 2 * pairs - xf.size(1)});
#if defined(LOOM_FP16_MATH)
  const auto xs = xf.to(at::kHalf);
  const auto* xp = reinterpret_cast<const XElem*>(xs.data_ptr<at::Half>());
#else
  const XElem* xp = xf.data_ptr<float>();
#endif
  auto out = at::empty({m, n}, xf.options());
  float* y = out.data_ptr<float>();
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::Half>());
  const int64_t w_stride = pairs * kPanelRow, x_stride = 2 * pairs;
  // Few rows stream the weights: one panel a work item spreads them evenly over the threads.
  const int64_t group = m <= 2 ? 1 : kTilePanels;
  const int64_t groups = (panels + group - 1) / group, row_tiles = (m + kTileRows - 1) / kTileRows;
  // Items in group-major order: a thread's consecutive tiles reuse a group's panels from cache.
  at::parallel_for(0, groups * row_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / row_tiles, r0 = (item % row_tiles) * kTileRows, p0 = g * group;
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - r0));
      const int count = static_cast<int>(std::min(group, panels - p0));
      run_tile<kTileRows, kTilePanels>(rows, count, xp + r0 * x_stride, x_stride, w + p0 * w_stride, w_stride, pairs,
                                       y + r0 * n + p0 * kCols, n, n - p0 * kCols);
    }
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

bool half_products() {
#if defined(LOOM_FP16_MATH)
  return true;
#else
  return false;
#endif
}
