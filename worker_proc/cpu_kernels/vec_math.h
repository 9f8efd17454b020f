// Small numeric helpers shared by the kernels.
#pragma once
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <type_traits>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace loom {

// e^(x - n ln2), n = round(x / ln2): Cody-Waite range reduction and the Cephes polynomial.
// F is float or a vector of floats (vexp and vexp16 share it).
template <typename F>
inline F exp_reduced(F x, F n) {
  const F r = x - n * 0.693359375f + n * 2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// expf in a form the compiler vectorises (libm's expf is a call per element, and float
// compares in the loop body stop the vectoriser), within about 1 ulp; the exponent is clamped
// in integers (0 below, inf above).
inline float vexp(float x) {
  const float t = x * 1.44269504089f + 0.5f;
  const int32_t ti = static_cast<int32_t>(t);
  const int32_t ni = ti - (static_cast<float>(ti) > t);  // floor(t)
  const int32_t biased = std::min(std::max(ni + 127, 0), 255);
  return exp_reduced(x, static_cast<float>(ni)) * std::bit_cast<float>(biased << 23);
}

// 16 floats: GCC vector types, compiled to AVX-512, or to pairs of AVX2 registers.
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));

inline vf load16(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vf load16(const c10::BFloat16* p) {  // bf16 is the high half of a float
#ifdef __AVX512F__
  // one widening load (GCC splits the generic form into two 256-bit halves)
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<vf>(_mm512_slli_epi32(w, 16));
#else
  vh h;
  std::memcpy(&h, p, sizeof(h));
  return reinterpret_cast<vf>(__builtin_convertvector(h, vu) << 16);
#endif
}
inline vf load16(const int8_t* p) {  // (an int8 KV pool's codes, unscaled)
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#else
  typedef int8_t vb __attribute__((vector_size(16)));
  vb b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, vf);
#endif
}
inline vf load16(const c10::Half* p) {  // (a float16 KV pool)
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  vf v;
  std::memcpy(&v, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
  return v;
#else
  vf v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}
inline vf splat(float s) { return vf{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

#if defined(__AVX512BF16__)
// 16 floats rounded to bfloat16 (to nearest even, vcvtneps2bf16) and stored.
inline void store16_bf16(void* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
// v rounded to bfloat16 and widened back: what a bf16 tensor between two ops holds.
inline __m512 round_bf16(__m512 v) {
  const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

#if defined(__AVX512F__)
// silu(g) = g / (1 + e^-g), e^-g as 2^n 2^f (n = round(-g log2 e), |f| <= 1/2, 2^f by the Cephes
// exp2f series) with vscalefps applying 2^n, which overflows to inf and underflows to 0 by itself:
// about half the instructions of vexp16 and its clamps (the MLP's gated linear runs this on every
// output: 2-3% of its time). The fused and unfused SiLU both take it, so they agree bit for bit.
inline __m512 silu16(__m512 g) {
  const __m512 t = _mm512_mul_ps(g, _mm512_set1_ps(-1.44269504089f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), _mm512_scalef_ps(p, n)));
}
#endif

// dst[0:n) = src[0:n) in dst's type: a KV row stored in the pool's dtype. Float to float16 takes
// the conversion instructions (a scalar c10::Half per element costs as much as the step's attention).
template <typename D, typename S>
inline void convert_row(D* dst, const S* src, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<D, S>) {
    std::memcpy(dst, src, n * sizeof(D));
    return;
  }
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<D, c10::Half>) {
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                          _mm512_cvtps_ph(reinterpret_cast<__m512>(load16(src + i)), _MM_FROUND_TO_NEAREST_INT));
  }
#elif defined(__F16C__)
  if constexpr (std::is_same_v<D, c10::Half>) {
    for (; i + 16 <= n; i += 16) {
      const vf x = load16(src + i);
      __m256 h[2];
      std::memcpy(h, &x, sizeof(x));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(h[0], _MM_FROUND_TO_NEAREST_INT));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i + 8), _mm256_cvtps_ph(h[1], _MM_FROUND_TO_NEAREST_INT));
    }
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<D>(static_cast<float>(src[i]));
}

// vexp on the lanes of a GCC vector F (I: the int32 vector of as many lanes); the same steps,
// written on vectors where the loop form does not vectorise.
template <typename F, typename I>
inline F vexp_lanes(F x) {
  const F t = x * 1.44269504089f + 0.5f;
  const I ti = __builtin_convertvector(t, I);
  const I ni = ti + (__builtin_convertvector(ti, F) > t);  // floor(t): a true lane is -1
  I biased = ni + 127;
  biased = biased < 0 ? I{} : biased;
  biased = biased > 255 ? I{} + 255 : biased;
  return exp_reduced(x, __builtin_convertvector(ni, F)) * reinterpret_cast<F>(biased << 23);
}
inline vf vexp16(vf x) { return vexp_lanes<vf, vi>(x); }

#if defined(__AVX2__)
// The lane sums of v[0..7], in order, as one vector (an hadd tree).
inline __m256 sum_lanes_8(const __m256* v) {
  const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 y = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
}

inline float add_lanes_8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// 8 floats from float or bfloat16 (bf16 is the high half of a float).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 load8(const c10::Half* p) {  // (x86-64-v3 has F16C)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// r[i][j] <-> r[j][i] for 8 registers of 8 floats (unpack, shuffle, then swap 128-bit halves).
inline void transpose_8x8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  // r[i], i < 4: column i of rows 0-3 (low half) and column i + 4 (high half); r[i + 4]: rows 4-7
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
    t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
  }
  for (int i = 0; i < 8; ++i) r[i] = t[i];
}

// c[i][0:16] (+)= sum_{k < kb} a[i * a_row + k * a_step] * b_k[0:16] for MR rows, where
// load_b(k, b0, b1) gives b_k as two registers: 2 MR accumulators, MR broadcasts and two loads per
// 2 MR FMAs (6 rows fill AVX2's 16 registers). With accumulate false, c starts from 0.
template <int MR, typename LoadB>
__attribute__((always_inline)) inline void broadcast_tile_16(const float* a, int64_t a_row, int64_t a_step, int64_t kb, LoadB&& load_b, float* c,
                              int64_t ldc, bool accumulate) {
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < 2; ++h) acc[i][h] = accumulate ? _mm256_loadu_ps(c + i * ldc + 8 * h) : _mm256_setzero_ps();
  for (int64_t k = 0; k < kb; ++k) {
    __m256 b0, b1;
    load_b(k, b0, b1);
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + i * a_row + k * a_step);
      acc[i][0] = _mm256_fmadd_ps(x, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(x, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(c + i * ldc + 8 * h, acc[i][h]);
}

#if defined(__AVX512F__)
// c[i][0:32] (+)= sum_{k < kb} a[i * a_row + k] * b[32 k : 32 k + 32] for MR rows: 2 MR
// accumulators, MR broadcasts and two loads per 2 MR FMAs (12 rows take 24 of AVX-512's 32
// registers). With accumulate false, c starts from 0.
template <int MR, typename LoadB>
__attribute__((always_inline)) inline void broadcast_tile_32(const float* a, int64_t a_row, int64_t kb, LoadB&& load_b,
                                                             float* c, int64_t ldc, bool accumulate) {
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < 2; ++h) acc[i][h] = accumulate ? _mm512_loadu_ps(c + i * ldc + 16 * h) : _mm512_setzero_ps();
  for (int64_t k = 0; k < kb; ++k) {
    __m512 b0, b1;
    load_b(k, b0, b1);
    for (int i = 0; i < MR; ++i) {
      const __m512 x = _mm512_set1_ps(a[i * a_row + k]);
      acc[i][0] = _mm512_fmadd_ps(x, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(x, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < 2; ++h) _mm512_storeu_ps(c + i * ldc + 16 * h, acc[i][h]);
}
#endif

// acc[h][s] = held[h] . streamed[s] over k elements (a multiple of 8), one 8-lane partial sum
// per pair: H rows stay in registers while S rows stream past them. 3 x 4 fills AVX2's 16
// registers (12 accumulators, 3 held vectors, one streamed): 7 loads per 12 FMAs.
template <int H, int S, typename A, typename B>
inline void tile_dots(const A* const* held, const B* const* streamed, int64_t k, __m256 acc[H][S]) {
  for (int h = 0; h < H; ++h)
    for (int s = 0; s < S; ++s) acc[h][s] = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; j += 8) {
    __m256 hv[H];
    for (int h = 0; h < H; ++h) hv[h] = load8(held[h] + j);
    for (int s = 0; s < S; ++s) {
      const __m256 sv = load8(streamed[s] + j);
      for (int h = 0; h < H; ++h) acc[h][s] = _mm256_fmadd_ps(hv[h], sv, acc[h][s]);
    }
  }
}
#endif

}  // namespace loom
