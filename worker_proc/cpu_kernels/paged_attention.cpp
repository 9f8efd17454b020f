// Attention of a packed batch over the paged KV pool, read in place through req_to_token (no
// gather copy, no padding). Each batch row is one request's newest tokens, already written to the
// pool: a decode's one token or a prompt chunk's tokens; token i of a row of n tokens sees the
// request's first seq_len - n + i + 1 cached tokens (causal), so decodes, first chunks and later
// chunks (over a cached prefix) take the same path.
//
// One task per (row, kv head, tile of query tokens). A tile's rows are its tokens times the query
// heads of the kv head (GQA), so every K/V row read from the pool serves all of them. On AVX-512,
// scores come from 16-lane partial dot products that are transposed and summed 16 tokens at a
// time (no horizontal sum per token), then a float32 softmax, then probabilities times V with the
// accumulators in registers (GCC vector types). AVX2 builds run prompts flash-attention style
// (attend_prompt_avx2) and decodes in blocks (attend_decode_avx2).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "kernels.h"
#include "kv_int8.h"
#include "vec_math.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx_tiles.h"
#endif

#pragma GCC optimize("fp-contract=fast")  // a * b + c on vectors becomes one FMA

namespace {

using loom::vf;
using loom::vi;
using loom::load16;
using loom::splat;
constexpr int kLanes = 16;


// out[i] = the sum of the lanes of v[i], for 16 vectors: three rounds of pairwise shuffles and
// adds (about three operations per sum instead of a horizontal reduction per vector).
template <typename V>  // vf, or vi (exact integer sums)
inline V transpose_sum(const V* v) {
  const vi lo_ps = {0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29};
  const vi hi_ps = {2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31};
  const vi lo_pd = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const vi hi_pd = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const vi even_blocks = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const vi odd_blocks = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  V t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)
    t[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo_ps) + __builtin_shuffle(v[2 * i], v[2 * i + 1], hi_ps);
  // each 4-lane block of u[j] holds that block's sums of v[4j .. 4j+3]
  for (int j = 0; j < 4; ++j)
    u[j] = __builtin_shuffle(t[2 * j], t[2 * j + 1], lo_pd) + __builtin_shuffle(t[2 * j], t[2 * j + 1], hi_pd);
  for (int j = 0; j < 2; ++j)
    w[j] = __builtin_shuffle(u[2 * j], u[2 * j + 1], even_blocks) +
           __builtin_shuffle(u[2 * j], u[2 * j + 1], odd_blocks);
  return __builtin_shuffle(w[0], w[1], even_blocks) + __builtin_shuffle(w[0], w[1], odd_blocks);
}

// Every cache line of one head's K or V row of a slot that is `ahead` tokens on.
template <typename T, int64_t D>
inline void prefetch_row(const T* p) {
  for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + off);
}

constexpr int kPrefetchTokens = 16;  // slots are scattered in the pool: fetch ahead of use
constexpr int kMaxTileRows = 16;  // query-head rows per tile (accumulators and partial sums on the stack)
constexpr int kValueRows = 4;     // rows whose V accumulators stay in registers together

struct Task {
  int64_t row, kv_head, first_token, num_tokens;  // tokens [first, first + num) of the batch row
  // kv_head -1: (part of) a decode row, every head at once (attend_decode): first_token and
  // num_tokens are then the range of cached tokens it covers, and `partial` where it writes
  // its unnormalised result
  int64_t partial = -1;
};

// A decode part's result per head: D sums of p * v, then the max score and the sum of p.
inline float* partial_at(float* partials, int64_t index, int64_t H, int64_t D) {
  return partials + index * H * (D + 2);
}

struct Problem {
  int64_t num_heads, num_kv_heads, group, kv_slot_stride, r2t_stride;
  int64_t q_row_stride;  // elements from one token's q to the next (q may be a view of fused qkv rows)
  const int32_t* req_to_token;
  const int64_t* req_idx;
  const int64_t* token_starts;
  const int64_t* extend_lens;
  const int64_t* seq_lens;
  float scale;
};

// Writes head h's part of a decode partial: its D sums, then the max score and the sum of p.
inline void store_partial(float* partial, int64_t h, int64_t D, const void* sums, float max, float sum) {
  float* o = partial + h * (D + 2);
  std::memcpy(o, sums, D * sizeof(float));
  o[D] = max;
  o[D + 1] = sum;
}

// Per-thread buffers, grown as needed.
struct Scratch {
  std::vector<float> scores;  // [tile rows, padded length]; AVX2: attend_prompt_avx2's q, output, block scores, K panel
  std::vector<float> zeros;   // probabilities of the padding rows of the last value group (not AVX2)
};

#if defined(__AVX2__) && !defined(__AVX512F__)
#define LOOM_AVX2_ATTENTION 1
// On AVX2 a vf is two registers: arrays of them per query head spill to the stack, so the AVX2
// paths below keep q and accumulators as float rows in L1 and one head's row in registers.
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
using loom::add_lanes_8;

using loom::load8;
using loom::tile_dots;

inline float max_lanes_8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// q_row = src * scale as a float row (D = 8 NY) in L1.
template <int NY, typename T>
inline void scaled_row(const T* src, float scale, float* q_row) {
  for (int j = 0; j < NY; ++j) _mm256_store_ps(q_row + 8 * j, _mm256_mul_ps(load8(src + 8 * j), _mm256_set1_ps(scale)));
}

// Decode tiles as small GEMMs, register-blocked: scores of kScoreRows query heads x kScoreKeys keys
// (12 accumulators over D, 7 loads per 12 FMAs, where one row against one key loaded q from L1
// for every FMA), and the values of kValueTileRows heads x 32 dims (8 loads per 12 FMAs).
constexpr int kScoreRows = 3, kScoreKeys = 4, kValueTileRows = 3;

// The largest of s[0:len).
inline float row_max(const float* s, int64_t len) {
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
  float m = max_lanes_8(mv);
  for (; t < len; ++t) m = std::max(m, s[t]);
  return m;
}

// s[0:len) -> exp(s - m), 0 on to `padded` (a multiple of 8); returns their sum.
inline float exp_row(float* s, int64_t len, int64_t padded, float m) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < padded; t += 8) {
    v8f x;
    const __m256 raw = _mm256_loadu_ps(s + t);
    std::memcpy(&x, &raw, sizeof(x));
    x = x - m;
    x = x > -87.f ? x : v8f{} - 87.f;  // exp underflows to 0 there; keeps vexp_lanes in range
    const __m256 seen = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(len - t)), lane));
    const __m256 e = _mm256_and_ps(reinterpret_cast<__m256>(loom::vexp_lanes<v8f, v8i>(x)), seen);
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(s + t, e);
  }
  return add_lanes_8(sum);
}

// The 4 lane sums of a, b, c, d.
inline __m128 sum_lanes_4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// scores[r * ld + c] = q_rows[r] . k[c] for R rows (L1 float rows of D) and C keys (pool rows).
template <int R, int C, int64_t D, typename T>
inline void score_tile(const float* q_rows, const T* const* k, float* scores, int64_t ld) {
  const float* q[R];
  for (int r = 0; r < R; ++r) q[r] = q_rows + r * D;
  __m256 acc[R][C];
  tile_dots<R, C>(q, k, D, acc);
  static_assert(C <= kScoreKeys && kScoreKeys == 4, "one sum_lanes_4 per row");
  for (int r = 0; r < R; ++r) {
    __m256 a[kScoreKeys];
    for (int c = 0; c < C; ++c) a[c] = acc[r][c];
    for (int c = C; c < kScoreKeys; ++c) a[c] = _mm256_setzero_ps();
    alignas(16) float four[kScoreKeys];
    _mm_store_ps(four, sum_lanes_4(a[0], a[1], a[2], a[3]));
    for (int c = 0; c < C; ++c) scores[r * ld + c] = four[c];
  }
}

// score_tile over n <= kScoreKeys keys (k[c] for c < n).
template <int R, int64_t D, typename T>
inline void score_tiles(const float* q_rows, const T* const* k, int64_t n, float* scores, int64_t ld) {
  if (n == kScoreKeys) score_tile<R, kScoreKeys, D>(q_rows, k, scores, ld);
  else for (int64_t c = 0; c < n; ++c) score_tile<R, 1, D>(q_rows, k + c, scores + c, ld);
}

// scores[r * ld + i] = q_rows[r] . k_i for `rows` L1 rows of D (D apart) and n <= kScoreKeys keys,
// key i at kv + slots[i] * slot_stride: tiles of kScoreRows rows, then single rows.
template <int64_t D, typename T>
inline void score_rows(const float* q_rows, int64_t rows, const T* kv, const int32_t* slots, int64_t slot_stride,
                       int64_t n, float* scores, int64_t ld) {
  const T* k[kScoreKeys];
  for (int64_t c = 0; c < kScoreKeys; ++c) k[c] = kv + slots[std::min(c, n - 1)] * slot_stride;  // past n: a repeat, never stored
  int64_t r = 0;
  for (; r + kScoreRows <= rows; r += kScoreRows) score_tiles<kScoreRows, D>(q_rows + r * D, k, n, scores + r * ld, ld);
  for (; r < rows; ++r) score_tiles<1, D>(q_rows + r * D, k, n, scores + r * ld, ld);
}

// out_rows[r][0:8W] += sum_t p[r][t] v_t[0:8W] over tokens [0, len) for R rows of probabilities.
template <int R, int W, typename T>
inline void value_tile(const float* probs, int64_t ld, const T* kv, const int32_t* slots, int64_t slot_stride,
                       int64_t len, float* out_rows, int64_t out_ld) {
  __m256 acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) acc[r][j] = _mm256_loadu_ps(out_rows + r * out_ld + 8 * j);
  for (int64_t t = 0; t < len; ++t) {
    const T* v = kv + slots[t] * slot_stride;
    __m256 w[R];  // (12 accumulators, 3 probabilities, one V register: AVX2's 16)
    for (int r = 0; r < R; ++r) w[r] = _mm256_broadcast_ss(probs + r * ld + t);
    for (int j = 0; j < W; ++j) {
      const __m256 vr = load8(v + 8 * j);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(w[r], vr, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) _mm256_storeu_ps(out_rows + r * out_ld + 8 * j, acc[r][j]);
}

// value_tile over nr <= kValueTileRows rows and all D dims of V (v: the kv head's V in slot 0).
template <int64_t D, typename T>
inline void value_rows(int64_t nr, const float* probs, int64_t ld, const T* v, const int32_t* slots,
                       int64_t slot_stride, int64_t len, float* out_rows, int64_t out_ld) {
  constexpr int W = D < 32 ? static_cast<int>(D / 8) : 4;  // registers per row of a tile
  static_assert(D % (8 * W) == 0 && kValueTileRows == 3, "value tiles split D evenly; 3 rows at most");
  for (int64_t d = 0; d < D; d += 8 * W) {
    if (nr == 3) value_tile<3, W>(probs, ld, v + d, slots, slot_stride, len, out_rows + d, out_ld);
    else if (nr == 2) value_tile<2, W>(probs, ld, v + d, slots, slot_stride, len, out_rows + d, out_ld);
    else value_tile<1, W>(probs, ld, v + d, slots, slot_stride, len, out_rows + d, out_ld);
  }
}

// Prompt tasks on AVX2, flash-attention style: the task's rows (its tokens x the kv head's query
// heads) go through the keys a block of kFlashKeys at a time. The block's K is transposed into an
// L1 panel, so its scores are a small GEMM without horizontal sums (register tiles of 6 rows x 16
// keys: 8 loads per 12 FMAs); an online softmax rescales each output row, which then gains the
// block's P V in tiles of 6 rows x 16 dims. q (scaled, 6 rows interleaved), the block's scores
// and the output rows are per-thread float buffers.
constexpr int64_t kFlashKeys = 64;
constexpr int kFlashRows = 6;
constexpr int kPromptTileRows = 48;  // rows per prompt task: 16 tokens of 3 query heads

// kt[d * kFlashKeys + c] = k[c][d] for c < n, 0 for n <= c < padded (a multiple of 8).
template <int64_t D, typename T>
inline void transpose_keys(const T* const* k, int64_t n, int64_t padded, float* kt) {
  for (int64_t c0 = 0; c0 < padded; c0 += 8) {
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = c0 + i < n ? load8(k[c0 + i] + d0) : _mm256_setzero_ps();
      loom::transpose_8x8(r);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(kt + (d0 + j) * kFlashKeys + c0, r[j]);
    }
  }
}

template <typename T, typename KV, int64_t D>
void attend_prompt_avx2(const Problem& p, const Task& task, const T* q, const KV* kv, T* out, Scratch& scratch) {
  static_assert(D % 16 == 0, "value tiles are 16 dims");
  const int64_t G = p.group, H = p.num_heads;
  const int64_t rows = task.num_tokens * G;
  const int64_t tiles = (rows + kFlashRows - 1) / kFlashRows, padded_rows = tiles * kFlashRows;
  const int32_t* slots = p.req_to_token + p.req_idx[task.row] * p.r2t_stride;
  // keys seen by the task's first token; token i of the task sees i more
  const int64_t first_seen = p.seq_lens[task.row] - p.extend_lens[task.row] + task.first_token + 1;
  const int64_t tile_len = first_seen + task.num_tokens - 1;
  const int64_t k_off = task.kv_head * D, v_off = (p.num_kv_heads + task.kv_head) * D;
  auto token_of = [&](int64_t r) { return p.token_starts[task.row] + task.first_token + r / G; };
  auto head_of = [&](int64_t r) { return task.kv_head * G + r % G; };

  const size_t need = static_cast<size_t>(padded_rows * (2 * D + kFlashKeys) + D * kFlashKeys);
  if (scratch.scores.size() < need) scratch.scores.resize(need);
  float* qt = scratch.scores.data();          // [tiles][D][kFlashRows]
  float* o = qt + padded_rows * D;            // [padded_rows][D]
  float* s = o + padded_rows * D;             // [padded_rows][kFlashKeys]
  float* kt = s + padded_rows * kFlashKeys;   // [D][kFlashKeys]
  for (int64_t r = 0; r < padded_rows; ++r) {
    float* dst = qt + (r / kFlashRows) * D * kFlashRows + r % kFlashRows;
    if (r < rows) {
      const T* src = q + token_of(r) * p.q_row_stride + head_of(r) * D;
      for (int64_t d = 0; d < D; ++d) dst[d * kFlashRows] = static_cast<float>(src[d]) * p.scale;
    } else {
      for (int64_t d = 0; d < D; ++d) dst[d * kFlashRows] = 0.f;
    }
  }
  std::fill(o, o + padded_rows * D, 0.f);
  float row_max_so_far[kPromptTileRows], row_sum[kPromptTileRows];
  std::fill(row_max_so_far, row_max_so_far + rows, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + rows, 0.f);

  const KV* k[kFlashKeys];
  const KV* v[kFlashKeys];
  for (int64_t t0 = 0; t0 < tile_len; t0 += kFlashKeys) {
    const int64_t n = std::min(kFlashKeys, tile_len - t0), padded = (n + 15) / 16 * 16;
    for (int64_t c = 0; c < n; ++c) {
      const KV* slot = kv + slots[t0 + c] * p.kv_slot_stride;
      k[c] = slot + k_off;
      v[c] = slot + v_off;
    }
    for (int64_t t = t0 + n; t < std::min(t0 + n + kFlashKeys, tile_len); ++t) {  // the next block
      const KV* slot = kv + slots[t] * p.kv_slot_stride;
      prefetch_row<KV, D>(slot + k_off);
      prefetch_row<KV, D>(slot + v_off);
    }
    transpose_keys<D>(k, n, padded, kt);
    // s[r][c] = sum_d qt[d][r] kt[d][c]: tiles of 6 rows x 16 keys
    for (int64_t c0 = 0; c0 < padded; c0 += 16) {
      auto load_keys = [kt, c0](int64_t d, __m256& b0, __m256& b1) __attribute__((always_inline)) {
        b0 = _mm256_loadu_ps(kt + d * kFlashKeys + c0);
        b1 = _mm256_loadu_ps(kt + d * kFlashKeys + c0 + 8);
      };
      for (int64_t i = 0; i < tiles; ++i)
        loom::broadcast_tile_16<kFlashRows>(qt + i * D * kFlashRows, 1, kFlashRows, D, load_keys,
                                            s + i * kFlashRows * kFlashKeys + c0, kFlashKeys, false);
    }
    // online softmax: the block's scores become exp(s - running max), 0 past what the row sees
    for (int64_t r = 0; r < padded_rows; ++r) {
      float* sr = s + r * kFlashKeys;
      const int64_t seen = r < rows ? std::min(n, first_seen + r / G - t0) : 0;
      if (seen <= 0) {
        std::fill(sr, sr + padded, 0.f);
        continue;
      }
      const float top = std::max(row_max_so_far[r], row_max(sr, seen));
      const float sum = exp_row(sr, seen, padded, top);
      if (row_max_so_far[r] != top && t0 > 0) {
        const __m256 c = _mm256_set1_ps(std::exp(row_max_so_far[r] - top));
        row_sum[r] *= _mm256_cvtss_f32(c);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + r * D + d, _mm256_mul_ps(c, _mm256_loadu_ps(o + r * D + d)));
      }
      row_sum[r] += sum;
      row_max_so_far[r] = top;
    }
    // o[r][d] += sum_t s[r][t] v_t[d]: tiles of 6 rows x 16 dims
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      auto load_values = [&v, d0](int64_t t, __m256& b0, __m256& b1) __attribute__((always_inline)) {
        b0 = load8(v[t] + d0);
        b1 = load8(v[t] + d0 + 8);
      };
      for (int64_t i = 0; i < tiles; ++i)
        loom::broadcast_tile_16<kFlashRows>(s + i * kFlashRows * kFlashKeys, kFlashKeys, 1, n, load_values,
                                            o + i * kFlashRows * D + d0, D, true);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + (token_of(r) * H + head_of(r)) * D;
    const float inv = 1.f / row_sum[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[r * D + d] * inv);
  }
}
#endif


#if !defined(LOOM_AVX2_ATTENTION)
// Prompt tasks (AVX-512 and other builds): every row's scores over the keys it sees, then one
// pass over V per kValueRows rows.
// Row s of `padded` scores, times `scale`: exp(s - max) over its first `len`, 0 past them, in
// place; returns 1 / their sum.
inline float masked_exp_row(float* s, int64_t padded, int64_t len, float scale) {
  const vi iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const vf neg_inf = splat(-std::numeric_limits<float>::infinity());
  vf mv = neg_inf;
  for (int64_t t0 = 0; t0 < padded; t0 += kLanes) {
    const vf x = load16(s + t0) * scale;
    const vf masked = (iota + static_cast<int32_t>(t0)) < static_cast<int32_t>(len) ? x : neg_inf;
    std::memcpy(s + t0, &masked, sizeof(masked));
    mv = masked > mv ? masked : mv;
  }
  float m = mv[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, mv[i]);
  vf sum = {};
  for (int64_t t0 = 0; t0 < padded; t0 += kLanes) {
    vf x = load16(s + t0) - m;
    x = x > -87.f ? x : splat(-87.f);  // exp underflows to 0 there; keeps vexp16 in range
    vf e = loom::vexp16(x);
    e = (iota + static_cast<int32_t>(t0)) < static_cast<int32_t>(len) ? e : vf{};
    sum += e;
    std::memcpy(s + t0, &e, sizeof(e));
  }
  float total = 0.f;
  for (int i = 0; i < kLanes; ++i) total += sum[i];
  return 1.f / total;
}

template <typename T, typename KV, int NV>
void attend_tile(const Problem& p, const Task& task, const T* q, const KV* kv, T* out, Scratch& scratch) {
  constexpr int64_t D = NV * kLanes;
  const int64_t G = p.group, H = p.num_heads;
  const int64_t rows = task.num_tokens * G;
  const int64_t n_row = p.extend_lens[task.row];
  const int64_t first_pos = p.seq_lens[task.row] - n_row;  // position of the row's first token
  const int32_t* slots = p.req_to_token + p.req_idx[task.row] * p.r2t_stride;
  const int64_t tile_len = first_pos + task.first_token + task.num_tokens;  // seen by the last token
  const int64_t padded = (tile_len + kLanes - 1) / kLanes * kLanes;
  const int64_t k_off = task.kv_head * D, v_off = (p.num_kv_heads + task.kv_head) * D;
  auto token_of = [&](int64_t r) { return p.token_starts[task.row] + task.first_token + r / G; };
  auto head_of = [&](int64_t r) { return task.kv_head * G + r % G; };

  if (scratch.scores.size() < static_cast<size_t>(kMaxTileRows * padded)) scratch.scores.resize(kMaxTileRows * padded);
  float* scores = scratch.scores.data();
  vf qs[kMaxTileRows][NV];
  for (int64_t r = 0; r < rows; ++r) {
    const T* qr = q + token_of(r) * p.q_row_stride + head_of(r) * D;
    for (int j = 0; j < NV; ++j) qs[r][j] = load16(qr + j * kLanes) * p.scale;
  }

  // scores[r][t] = q_r . k_t, 16 tokens at a time
  vf part[kMaxTileRows][kLanes];
  for (int64_t t0 = 0; t0 < tile_len; t0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, tile_len - t0);
    for (int64_t i = 0; i < n; ++i) {
      if (t0 + i + kPrefetchTokens < tile_len)
        prefetch_row<KV, D>(kv + slots[t0 + i + kPrefetchTokens] * p.kv_slot_stride + k_off);
      const KV* k = kv + slots[t0 + i] * p.kv_slot_stride + k_off;
      vf kr[NV];
      for (int j = 0; j < NV; ++j) kr[j] = load16(k + j * kLanes);
      for (int64_t r = 0; r < rows; ++r) {
        vf acc = qs[r][0] * kr[0];
        for (int j = 1; j < NV; ++j) acc = qs[r][j] * kr[j] + acc;
        part[r][i] = acc;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = n; i < kLanes; ++i) part[r][i] = vf{};
      const vf s = transpose_sum(part[r]);
      std::memcpy(scores + r * padded + t0, &s, sizeof(s));
    }
  }
  // softmax of each row over the tokens it sees; the rest of its (padded) row becomes 0
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * padded;
    const vf inv = splat(masked_exp_row(s, padded, first_pos + task.first_token + r / G + 1, 1.f));
    for (int64_t t0 = 0; t0 < padded; t0 += kLanes) {
      const vf x = load16(s + t0) * inv;
      std::memcpy(s + t0, &x, sizeof(x));
    }
  }

  // out_r = sum_t p[r][t] v_t, kValueRows rows per pass over V
  if (scratch.zeros.size() < static_cast<size_t>(padded)) scratch.zeros.assign(padded, 0.f);
  for (int64_t r0 = 0; r0 < rows; r0 += kValueRows) {
    const float* pr[kValueRows];
    for (int i = 0; i < kValueRows; ++i) pr[i] = r0 + i < rows ? scores + (r0 + i) * padded : scratch.zeros.data();
    vf acc[kValueRows][NV] = {};
    for (int64_t t = 0; t < tile_len; ++t) {
      if (t + kPrefetchTokens < tile_len) prefetch_row<KV, D>(kv + slots[t + kPrefetchTokens] * p.kv_slot_stride + v_off);
      const KV* v = kv + slots[t] * p.kv_slot_stride + v_off;
      vf vr[NV];
      for (int j = 0; j < NV; ++j) vr[j] = load16(v + j * kLanes);
      for (int i = 0; i < kValueRows; ++i) {
        const vf w = splat(pr[i][t]);
        for (int j = 0; j < NV; ++j) acc[i][j] = w * vr[j] + acc[i][j];
      }
    }
    for (int i = 0; i < kValueRows && r0 + i < rows; ++i) {
      T* o = out + (token_of(r0 + i) * H + head_of(r0 + i)) * D;
      alignas(64) float buf[D];
      std::memcpy(buf, acc[i], sizeof(buf));
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(buf[d]);
    }
  }
}
#endif

// Query-head rows per prompt task on the fixed-D paths; more query heads per kv head than this go
// to attend_tile_generic.
#if defined(LOOM_AVX2_ATTENTION)
constexpr int64_t kTileRows = kPromptTileRows;
#else
constexpr int64_t kTileRows = kMaxTileRows;
#endif

constexpr int kMaxHeads = 32;
constexpr int64_t kDecodeAhead = 8;  // slots fetched ahead by the decode path (whole slots: K and V of every head)
constexpr int64_t kMinDecodePart = 64;  // cached tokens per part, at least, when a decode row is split

// Into L2 (prefetcht1), 8 slots ahead: fetching into L1 ran out of L1 miss buffers (a slot is 12
// lines); batch 64 decode attention went from ~32 to ~21 ms a step on Zen 4.
inline void prefetch_slot(const void* slot, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(static_cast<const char*>(slot) + off, 0, 2);
}

// The slots a decode task fetches ahead, by token: its own up to its end, then the first `ahead`
// of the task its thread likely runs next, so that one does not start on a cold block (decode
// attention alone 3-10% faster, 32-row decode steps ~1%; AMD Zen 4).
struct SlotsAhead {
  const int32_t* slots;
  int64_t end;
  const int32_t* next_slots = nullptr;
  int64_t next_begin = 0, next_end = 0;

  SlotsAhead(const Problem& p, const Task& task, const Task* next, int64_t ahead)
      : slots(p.req_to_token + p.req_idx[task.row] * p.r2t_stride), end(task.first_token + task.num_tokens) {
    if (next == nullptr) return;
    next_slots = p.req_to_token + p.req_idx[next->row] * p.r2t_stride;
    next_begin = next->first_token;
    next_end = next->first_token + std::min(ahead, next->num_tokens);
  }
  // tokens that may be fetched: this task's, then the next one's first
  int64_t limit() const { return end + next_end - next_begin; }
  // the slot of token t (t < limit())
  int32_t operator[](int64_t t) const { return t < end ? slots[t] : next_slots[t - end + next_begin]; }
};

// (AVX-512: a shuffle tree; a loop over the lanes extracts each one)
inline float lane_max(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
#endif
}
inline float lane_sum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

#if defined(__AVX512F__)
// e^x for x <= 88 within ~2e-6 relative (2^f for |f| <= 1/2 by its degree-5 series, scaled by
// 2^n; below -87 it gives e^-87): attention's probabilities, half the work of vexp16.
inline __m512 exp_probs(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504089f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

// One head's online softmax in a decode kernel, with its running max as the exps' reference: a
// block whose scores stay at or below it (most blocks past the first few) takes no horizontal
// max, and the sums stay 16 lanes, added up once at the end. (A reference left up to 2 or 8
// below the max, moving less often, ran 1.06-1.08x but raised the output's mean error 1.1-1.2x:
// the top probability is then rounded to bfloat16 instead of being exactly 1.) With exp_probs for
// vexp16, 64 rows x 362 tokens, 30 layers, on the AMX Xeon: bf16 KV 1.04-1.05x from memory, 1.07x
// cached; int8 KV 1.07x; float32 KV (the generic kernel, as AVX-512 CPUs without BF16 run it) 1.05x.
struct RunningSoftmax {
  float ref = -std::numeric_limits<float>::infinity();
  vf sums{};

  // exps of a block's scores s (-inf past its end, giving 0); acc: the head's sums of p v so far
  template <typename V, int NV>
  vf exps(vf s, V (&acc)[NV]) {
    if (any_above(s, ref)) {  // (always on the first block)
      const float new_ref = lane_max(s), c = std::exp(ref - new_ref);
      sums *= c;
      for (int j = 0; j < NV; ++j) acc[j] = reinterpret_cast<V>(reinterpret_cast<vf>(acc[j]) * c);
      ref = new_ref;
    }
    const vf x = s - ref;
#if defined(__AVX512F__)
    const vf e = reinterpret_cast<vf>(_mm512_maskz_mov_ps(
        _mm512_cmp_ps_mask(reinterpret_cast<__m512>(s), _mm512_set1_ps(-kInf), _CMP_GT_OQ), exp_probs(reinterpret_cast<__m512>(x))));
#else
    const vf e = s > -kInf ? loom::vexp16(x > -87.f ? x : splat(-87.f)) : vf{};
#endif
    sums += e;
    return e;
  }
  float sum() const { return lane_sum(sums); }

 private:
  static constexpr float kInf = std::numeric_limits<float>::infinity();
  static bool any_above(vf s, float ref) {
#if defined(__AVX512F__)
    return _mm512_cmp_ps_mask(reinterpret_cast<__m512>(s), _mm512_set1_ps(ref), _CMP_GT_OQ);
#else
    for (int i = 0; i < kLanes; ++i)
      if (s[i] > ref) return true;
    return false;
#endif
  }
};

// acc[r] += sum_i prob[r][i] v_i for R query heads of one kv head over n slots (V of the kv head
// at kv + slots[i] * slot_stride + v_off): R x NV accumulators in registers.
template <int R, int NV, typename KV>
inline void add_values(vf (*acc)[NV], const float (*prob)[kLanes], const KV* kv, const int32_t* slots,
                       int64_t slot_stride, int64_t v_off, int64_t n) {
  vf a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) a[r][j] = acc[r][j];
  for (int64_t i = 0; i < n; ++i) {
    const KV* v = kv + slots[i] * slot_stride + v_off;
    vf vr[NV];
    for (int j = 0; j < NV; ++j) vr[j] = load16(v + j * kLanes);
    for (int r = 0; r < R; ++r) {
      const vf w = splat(prob[r][i]);
      for (int j = 0; j < NV; ++j) a[r][j] = w * vr[j] + a[r][j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = a[r][j];
}

// add_values over `count` query heads of one kv head, R at a time (then fewer).
template <int R, int NV, typename KV>
inline void add_value_heads(vf (*acc)[NV], const float (*prob)[kLanes], const KV* kv, const int32_t* slots,
                            int64_t slot_stride, int64_t v_off, int64_t n, int64_t count) {
  for (; count >= R; count -= R, acc += R, prob += R) add_values<R, NV>(acc, prob, kv, slots, slot_stride, v_off, n);
  if constexpr (R > 1)
    if (count) add_value_heads<R - 1, NV>(acc, prob, kv, slots, slot_stride, v_off, n, count);
}

// A row of one token (a decode): every head in one pass over the request's slots. A slot's K and
// V of all kv heads are contiguous, so each is read whole, once, 16 tokens a block, with an
// online softmax (a running max and sum per head). Slots are scattered in the pool: reading them
// whole and fetching ahead is what keeps this near the memory's speed.
template <typename T, typename KV, int NV>
void attend_decode(const Problem& p, const Task& task, const T* q, const KV* kv, float* partial, const Task* next) {
  constexpr int64_t D = NV * kLanes;
  const int64_t H = p.num_heads, G = p.group, KVH = p.num_kv_heads, row = task.row;
  const int64_t begin = task.first_token, len = task.first_token + task.num_tokens, token = p.token_starts[row];
  const int32_t* slots = p.req_to_token + p.req_idx[row] * p.r2t_stride;
  const int64_t slot_bytes = 2 * KVH * D * static_cast<int64_t>(sizeof(KV));
  constexpr float kInf = std::numeric_limits<float>::infinity();

  vf qs[kMaxHeads][NV], acc[kMaxHeads][NV], part[kMaxHeads][kLanes];
  RunningSoftmax soft[kMaxHeads];
  alignas(64) float prob[kMaxHeads][kLanes];
  for (int64_t h = 0; h < H; ++h)
    for (int j = 0; j < NV; ++j) {
      qs[h][j] = load16(q + token * p.q_row_stride + h * D + j * kLanes) * p.scale;
      acc[h][j] = vf{};
    }
  const SlotsAhead ahead(p, task, next, kDecodeAhead);
  const vi iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t t0 = begin; t0 < len; t0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, len - t0);
    for (int64_t i = 0; i < n; ++i) {
      if (t0 + i + kDecodeAhead < ahead.limit())
        prefetch_slot(kv + ahead[t0 + i + kDecodeAhead] * p.kv_slot_stride, slot_bytes);
      const KV* k = kv + slots[t0 + i] * p.kv_slot_stride;
      for (int64_t kh = 0; kh < KVH; ++kh) {
        vf kr[NV];
        for (int j = 0; j < NV; ++j) kr[j] = load16(k + kh * D + j * kLanes);
        for (int64_t h = kh * G; h < (kh + 1) * G; ++h) {
          vf s = qs[h][0] * kr[0];
          for (int j = 1; j < NV; ++j) s = qs[h][j] * kr[j] + s;
          part[h][i] = s;
        }
      }
    }
    const vi valid = iota < static_cast<int32_t>(n);
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = n; i < kLanes; ++i) part[h][i] = vf{};
      const vf e = soft[h].exps(valid ? transpose_sum(part[h]) : splat(-kInf), acc[h]);
      std::memcpy(prob[h], &e, sizeof(e));
    }
    // acc += p * v, up to kValueRows query heads of one kv head in registers at a time
    for (int64_t kh = 0; kh < KVH; ++kh)
      add_value_heads<kValueRows, NV>(acc + kh * G, prob + kh * G, kv, slots + t0, p.kv_slot_stride, (KVH + kh) * D, n, G);
  }
  for (int64_t h = 0; h < H; ++h) store_partial(partial, h, D, acc[h], soft[h].ref, soft[h].sum());
}

#if defined(LOOM_AVX2_ATTENTION)
// attend_decode for AVX2, where a vf is two registers and the generic kernel's per-head q and
// accumulators spill to the stack on every token. Here the register tiles above (score_rows,
// value_rows) do the work, a block of kDecodeBlock tokens at a time: scores of a kv head's query
// heads x 4 tokens, an online softmax per head over the block, then values in tiles of 3 heads x
// 32 dims (q, probabilities and accumulators are L1 rows). Same contract as attend_decode.
constexpr int64_t kDecodeBlock = 64;  // its slots (96 KB at 3 kv heads of 64) stay in L2 from scores to values
constexpr int64_t kDecodeAheadAvx2 = 16;  // slots ahead that prefetch_slot_heads fetches

// The first line of a slot's K and of its V: the hardware prefetcher streams the rest of each.
// Fetching every line of the slot (prefetch_slot) cost more issue slots than it saved on Zen 3:
// decode at batch 128, context 400 read 15-16 GB/s of scattered slots that way, 17-19 with this
// (the machine's limit for scattered 1.5 KB reads: ~20).
inline void prefetch_slot_heads(const void* slot, int64_t bytes) {
  __builtin_prefetch(slot, 0, 2);
  __builtin_prefetch(static_cast<const char*>(slot) + bytes / 2, 0, 2);
}

template <typename T, typename KV, int NY>  // NY: 8-float registers per head row (D = 8 NY)
void attend_decode_avx2(const Problem& p, const Task& task, const T* q, const KV* kv, float* partial,
                        const Task* next) {
  constexpr int64_t D = NY * 8, B = kDecodeBlock;
  const int64_t H = p.num_heads, G = p.group, KVH = p.num_kv_heads, row = task.row;
  const int64_t begin = task.first_token, end = task.first_token + task.num_tokens, token = p.token_starts[row];
  const int32_t* slots = p.req_to_token + p.req_idx[row] * p.r2t_stride;
  const int64_t slot_bytes = 2 * KVH * D * static_cast<int64_t>(sizeof(KV));

  alignas(32) float qs[kMaxHeads][D], acc[kMaxHeads][D], prob[kMaxHeads][B];
  float run_max[kMaxHeads], run_sum[kMaxHeads];
  for (int64_t h = 0; h < H; ++h) {
    scaled_row<NY>(q + token * p.q_row_stride + h * D, p.scale, qs[h]);
    std::memset(acc[h], 0, sizeof(acc[h]));
    run_max[h] = -std::numeric_limits<float>::infinity();
    run_sum[h] = 0.f;
  }
  const SlotsAhead ahead(p, task, next, kDecodeAheadAvx2);
  for (int64_t t0 = begin; t0 < end; t0 += B) {
    const int64_t n = std::min<int64_t>(B, end - t0), padded = (n + 7) / 8 * 8;
    // prob[h][i] = q_h . k_i
    for (int64_t i0 = 0; i0 < n; i0 += kScoreKeys) {
      const int64_t nk = std::min<int64_t>(kScoreKeys, n - i0);
      for (int64_t t = t0 + i0 + kDecodeAheadAvx2; t < std::min(t0 + i0 + nk + kDecodeAheadAvx2, ahead.limit()); ++t)
        prefetch_slot_heads(kv + ahead[t] * p.kv_slot_stride, slot_bytes);
      for (int64_t kh = 0; kh < KVH; ++kh)
        score_rows<D>(qs[kh * G], G, kv + kh * D, slots + t0 + i0, p.kv_slot_stride, nk, prob[kh * G] + i0, B);
    }
    // online softmax: the block's exps under a running max; what was summed before is rescaled
    for (int64_t h = 0; h < H; ++h) {
      const float new_max = std::max(run_max[h], row_max(prob[h], n));
      const float c = std::exp(run_max[h] - new_max);  // 0 on the first block
      run_sum[h] = run_sum[h] * c + exp_row(prob[h], n, padded, new_max);
      if (c != 1.f) {
        const __m256 cv = _mm256_set1_ps(c);
        for (int j = 0; j < NY; ++j) _mm256_store_ps(acc[h] + 8 * j, _mm256_mul_ps(_mm256_load_ps(acc[h] + 8 * j), cv));
      }
      run_max[h] = new_max;
    }
    // acc += p * v, a kv head's query heads in tiles of kValueTileRows
    for (int64_t kh = 0; kh < KVH; ++kh)
      for (int64_t h = kh * G; h < (kh + 1) * G; h += kValueTileRows)
        value_rows<D>(std::min<int64_t>(kValueTileRows, (kh + 1) * G - h), prob[h], B, kv + (KVH + kh) * D,
                      slots + t0, p.kv_slot_stride, n, acc[h], D);
  }
  for (int64_t h = 0; h < H; ++h) store_partial(partial, h, D, acc[h], run_max[h], run_sum[h]);
}
#endif

#ifdef __AVX512BF16__
// attend_decode for bfloat16 on CPUs with AVX512-BF16: the products take bf16 pairs straight from
// the pool (vdpbf16ps: 32 multiply-adds, no widening). Per block of 16 cached tokens, one query
// head at a time: its scores over the block (16 tokens' partial sums in registers, then one
// transpose_sum; the head's K rows come from L1 after the first head of their kv head), an online
// softmax per head, then the values of each kv head's query heads with their sums in registers
// (value_rows_dpbf16). Keeping every head's sums at once spilled them: two stores a token per head.
// Scores pair adjacent head dims; the V sums pair two tokens, so V rows are interleaved two by two
// and the probabilities rounded to bf16 (as GPU flash-attention kernels round P). Lanes of the V
// sums come out permuted within each 128-bit block; the store undoes that.
// Blocks of 16: the next block's 16 slots are fetched while this one is computed (blocks of 32
// or 64 fetched further ahead and read 7-19% slower from memory on Zen 4).
constexpr int64_t kDpbf16Block = 16;  // cached tokens per online-softmax update

// acc[r] += sum_i prob[r][i] v_i over the block's nb (padded to even) tokens for R query heads
// of one kv head (V at slot + v_off), R x NV sums in registers.
template <int R, int NV>
inline void value_rows_dpbf16(__m512 (*acc)[NV], const uint16_t (*prob)[kDpbf16Block],
                              const c10::BFloat16* const* slot, int64_t v_off, int64_t nb) {
  constexpr int NB = NV / 2;
  __m512 a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) a[r][j] = acc[r][j];
  for (int64_t i = 0; i < nb; i += 2) {
    const c10::BFloat16 *v0 = slot[i] + v_off, *v1 = slot[i + 1] + v_off;
    __m512i lo[NB], hi[NB];
    for (int b = 0; b < NB; ++b) {
      const __m512i x = _mm512_loadu_si512(v0 + b * 32), y = _mm512_loadu_si512(v1 + b * 32);
      lo[b] = _mm512_unpacklo_epi16(x, y);
      hi[b] = _mm512_unpackhi_epi16(x, y);
    }
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, prob[r] + i, 4);
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int b = 0; b < NB; ++b) {
        a[r][2 * b] = _mm512_dpbf16_ps(a[r][2 * b], (__m512bh)lo[b], w);
        a[r][2 * b + 1] = _mm512_dpbf16_ps(a[r][2 * b + 1], (__m512bh)hi[b], w);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = a[r][j];
}

// value_rows_dpbf16 over `count` heads, R at a time (then fewer).
template <int R, int NV>
inline void value_heads_dpbf16(__m512 (*acc)[NV], const uint16_t (*prob)[kDpbf16Block],
                               const c10::BFloat16* const* slot, int64_t v_off, int64_t nb, int64_t count) {
  for (; count >= R; count -= R, acc += R, prob += R) value_rows_dpbf16<R, NV>(acc, prob, slot, v_off, nb);
  if constexpr (R > 1)
    if (count) value_heads_dpbf16<R - 1, NV>(acc, prob, slot, v_off, nb, count);
}

template <int NV>
void attend_decode_dpbf16(const Problem& p, const Task& task, const c10::BFloat16* q, const c10::BFloat16* kv,
                          float* partial, const Task* next) {
  constexpr int64_t D = NV * kLanes, kBlock = kDpbf16Block;
  constexpr int NB = NV / 2;                   // 32-element bf16 vectors per head row
  constexpr int R = NV <= 2 ? 8 : 12 / NV;     // heads whose V sums share registers (NV x R of them)
  const int64_t H = p.num_heads, G = p.group, KVH = p.num_kv_heads, row = task.row;
  const int64_t begin = task.first_token, len = task.first_token + task.num_tokens, token = p.token_starts[row];
  const int32_t* slots = p.req_to_token + p.req_idx[row] * p.r2t_stride;
  const int64_t slot_bytes = 2 * KVH * D * 2;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  auto load_bh = [](const c10::BFloat16* src) { return (__m512bh)_mm512_loadu_si512(src); };

  __m512 acc[kMaxHeads][NV];  // [2b] and [2b + 1]: the two permuted halves of bf16 vector b
  vf scores[kMaxHeads];  // of the block's tokens
  alignas(64) uint16_t prob[kMaxHeads][kBlock];
  RunningSoftmax soft[kMaxHeads];
  // the block's slots; past its end, its last one again (scored -inf, probability 0)
  const c10::BFloat16* slot[kBlock];
  for (int64_t h = 0; h < H; ++h) {
    for (int j = 0; j < NV; ++j) acc[h][j] = _mm512_setzero_ps();
  }
  for (int64_t i = begin; i < std::min(len, begin + kBlock); ++i) prefetch_slot(kv + slots[i] * p.kv_slot_stride, slot_bytes);
  // the next block's lines are fetched a share per head's scores, so that the memory stays busy
  // while this block is computed (all at once overran the miss queues)
  const int64_t slot_lines = slot_bytes / 64;
  const SlotsAhead ahead(p, task, next, kBlock);  // (the last block fetches the next task's first)
  int64_t fetch_slot = 0, fetch_line = 0, fetch_end = 0;
  auto fetch_ahead = [&](int64_t lines) {
    for (; lines > 0 && fetch_slot < fetch_end; --lines) {
      __builtin_prefetch(reinterpret_cast<const char*>(kv + ahead[fetch_slot] * p.kv_slot_stride) + fetch_line * 64, 0, 2);
      if (++fetch_line == slot_lines) fetch_line = 0, ++fetch_slot;
    }
  };
  const vi iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  static_assert(kBlock == kLanes, "a block's scores of a head are one transpose_sum");
  for (int64_t t0 = begin; t0 < len; t0 += kBlock) {
    const int64_t nb = std::min(kBlock, len - t0);
    for (int64_t i = 0; i < kBlock; ++i) slot[i] = kv + slots[t0 + std::min(i, nb - 1)] * p.kv_slot_stride;
    fetch_ahead(std::numeric_limits<int64_t>::max());  // (what the last block left)
    fetch_slot = std::min(t0 + kBlock, len), fetch_line = 0, fetch_end = std::min(ahead.limit(), fetch_slot + kBlock);
    const int64_t fetch_share = ((fetch_end - fetch_slot) * slot_lines + H - 1) / H;
    const vi valid = iota < static_cast<int32_t>(nb);  // tokens past the end score -inf
    for (int64_t kh = 0; kh < KVH; ++kh)
      for (int64_t h = kh * G; h < (kh + 1) * G; ++h) {
        fetch_ahead(fetch_share);
        __m512bh qh[NB];
        for (int b = 0; b < NB; ++b) qh[b] = load_bh(q + token * p.q_row_stride + h * D + b * 32);
        vf part[kLanes];
        for (int i = 0; i < kLanes; ++i) {
          const c10::BFloat16* k = slot[i] + kh * D;
          __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), qh[0], load_bh(k));
          for (int b = 1; b < NB; ++b) s = _mm512_dpbf16_ps(s, qh[b], load_bh(k + b * 32));
          part[i] = reinterpret_cast<vf>(s);
        }
        scores[h] = valid ? transpose_sum(part) * p.scale : splat(-kInf);
      }
    for (int64_t h = 0; h < H; ++h) {
      const __m512 e = reinterpret_cast<__m512>(soft[h].exps(scores[h], acc[h]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prob[h]), (__m256i)_mm512_cvtneps_pbh(e));
    }
    for (int64_t kh = 0; kh < KVH; ++kh)  // (an odd last token pairs with the slot after it at probability 0)
      value_heads_dpbf16<R, NV>(acc + kh * G, prob + kh * G, slot, (KVH + kh) * D, nb, G);
  }
  for (int64_t h = 0; h < H; ++h) {
    alignas(64) float lo[16], hi[16];
    float* o = partial + h * (D + 2);
    for (int b = 0; b < NB; ++b) {
      _mm512_store_ps(lo, acc[h][2 * b]);
      _mm512_store_ps(hi, acc[h][2 * b + 1]);
      // 128-bit block k of lo holds dims 8k..8k+3 of this 32-dim slice, of hi dims 8k+4..8k+7
      for (int k = 0; k < 4; ++k)
        for (int j = 0; j < 4; ++j) {
          o[b * 32 + 8 * k + j] = lo[4 * k + j];
          o[b * 32 + 8 * k + 4 + j] = hi[4 * k + j];
        }
    }
    o[D] = soft[h].ref;
    o[D + 1] = soft[h].sum();
  }
}
#endif

#ifdef __AVX512BF16__
// rows r[0..15] of 16 32-bit elements -> r[c] = element c of every row
inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4 i + e], lane L: element 4 L + e of rows 4 i .. 4 i + 3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i a = _mm512_shuffle_i32x4(u[e], u[4 + e], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i b = _mm512_shuffle_i32x4(u[e], u[4 + e], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512i c = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i d = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], _MM_SHUFFLE(3, 1, 3, 1));
    r[e] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(2, 0, 2, 0));
    r[8 + e] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(3, 1, 3, 1));
    r[4 + e] = _mm512_shuffle_i32x4(b, d, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + e] = _mm512_shuffle_i32x4(b, d, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// Row s of `padded` scores: exp(scale s - max) over its first `len` into bf16 probs, 0 past them;
// returns 1 / their sum (of the float32 values).
inline float exp_row_bf16(const float* s, int64_t padded, int64_t len, float scale, uint16_t* probs) {
  const int64_t full = len / kLanes * kLanes;
  const __mmask16 last = static_cast<__mmask16>((1u << (len - full)) - 1);
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t0 = 0; t0 < full; t0 += kLanes) mv = _mm512_max_ps(mv, _mm512_load_ps(s + t0));
  if (last) mv = _mm512_mask_max_ps(mv, last, mv, _mm512_load_ps(s + full));
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mv) * scale), sv = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < padded; t0 += kLanes) {
    __m512 e = _mm512_setzero_ps();
    if (t0 < full)
      e = exp_probs(_mm512_fmsub_ps(_mm512_load_ps(s + t0), sv, top));
    else if (t0 == full && last)
      e = _mm512_maskz_mov_ps(last, exp_probs(_mm512_fmsub_ps(_mm512_load_ps(s + t0), sv, top)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + t0), (__m256i)_mm512_cvtneps_pbh(e));
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

constexpr int64_t kBf16TaskTokens = 16;  // query tokens per bf16 prompt task (AMX or vdpbf16ps; all their heads)

// What the bf16 prompt paths (AMX tiles, vdpbf16ps register tiles) share for one task (its
// tokens x the kv head's query heads = `rows`): per-thread buffers (q rows zero past `rows`,
// scores, bf16 probabilities, V of every block of 32 keys in VNNI form), K^T of a block by 16 x 16
// transposes of 32-bit pairs, V by interleaving the rows of token pairs, the softmax of each row
// into bf16 probabilities (as the bf16 decode path and GPU flash-attention kernels round P), and
// the store of an output row, whose sums come out permuted within 128-bit blocks (the interleave).
template <int64_t D>
struct Bf16PromptTask {
  static constexpr int64_t kKeys = 32;   // keys per block (two 16-key halves)
  static constexpr int64_t KS = D / 32;  // 32-dim steps of a score
  struct Buffers {
    std::vector<c10::BFloat16> q;
    std::vector<float> scores, inv_sum;
    std::vector<uint16_t> probs;
    std::vector<__m512i> values;
  };
  const Problem& p;
  const Task& task;
  const c10::BFloat16* kv;
  const int32_t* slots;
  int64_t G, rows, padded_rows, first_pos, tile_len, padded, blocks, k_off, v_off;
  c10::BFloat16* qrows;
  float *scores, *inv_sum;
  uint16_t* probs;
  __m512i* values;  // [blocks][4][16 pairs]: pair row holds keys 2 pair, 2 pair + 1 of 16 dims

  // row_multiple: rows are padded to a multiple of it (the row tiles)
  Bf16PromptTask(const Problem& p_, const Task& task_, const c10::BFloat16* q, const c10::BFloat16* kv_,
                 int64_t row_multiple)
      : p(p_), task(task_), kv(kv_), slots(p.req_to_token + p.req_idx[task.row] * p.r2t_stride), G(p.group) {
    rows = task.num_tokens * G;
    padded_rows = (rows + row_multiple - 1) / row_multiple * row_multiple;
    first_pos = p.seq_lens[task.row] - p.extend_lens[task.row];
    tile_len = first_pos + task.first_token + task.num_tokens;  // seen by the last token
    padded = (tile_len + kKeys - 1) / kKeys * kKeys;
    blocks = padded / kKeys;
    k_off = task.kv_head * D;
    v_off = (p.num_kv_heads + task.kv_head) * D;
    thread_local Buffers buf;
    buf.q.assign(padded_rows * D, c10::BFloat16(0.f));
    if (buf.scores.size() < static_cast<size_t>(padded_rows * padded)) {
      buf.scores.resize(padded_rows * padded);
      buf.probs.resize(padded_rows * padded);
    }
    if (buf.values.size() < static_cast<size_t>(blocks * 4 * 16)) buf.values.resize(blocks * 4 * 16);
    if (buf.inv_sum.size() < static_cast<size_t>(rows)) buf.inv_sum.resize(rows);
    qrows = buf.q.data();
    scores = buf.scores.data();
    probs = buf.probs.data();
    values = buf.values.data();
    inv_sum = buf.inv_sum.data();
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(qrows + r * D, q + token_of(r) * p.q_row_stride + head_of(r) * D, D * sizeof(c10::BFloat16));
  }
  int64_t token_of(int64_t r) const { return p.token_starts[task.row] + task.first_token + r / G; }
  int64_t head_of(int64_t r) const { return task.kv_head * G + r % G; }
  const c10::BFloat16* key(int64_t t, int64_t off) const { return kv + slots[t] * p.kv_slot_stride + off; }

  // kt[s][half][j]: dims 32 s + 2 j, 32 s + 2 j + 1 of keys t0 + 16 half .. + 15 (0 past tile_len)
  void keys_vnni(int64_t t0, __m512i (*kt)[2][16]) const {
    for (int64_t half = 0; half < 2; ++half)
      for (int64_t s = 0; s < KS; ++s) {
        __m512i* r = kt[s][half];
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t t = t0 + half * 16 + i;
          r[i] = t < tile_len ? _mm512_loadu_si512(key(t, k_off) + s * 32) : _mm512_setzero_si512();
        }
        transpose_16x16(r);
      }
  }

  // softmax numerators of each row over the keys it sees, into bf16 probabilities (0 past them
  // and in the padding rows); the output rows are divided by their sums as they are stored
  void softmax() {
    std::memset(probs + rows * padded, 0, (padded_rows - rows) * padded * sizeof(uint16_t));
    for (int64_t r = 0; r < rows; ++r)
      inv_sum[r] = exp_row_bf16(scores + r * padded, padded, first_pos + task.first_token + r / G + 1, p.scale,
                                probs + r * padded);
  }

  // `values` for dims d0 .. d0 + 63 of every block
  void values_vnni(int64_t d0) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      __m512i* vt = values + blk * 4 * 16;
      for (int64_t pair = 0; pair < 16; ++pair) {
        const int64_t t = blk * kKeys + 2 * pair;
        for (int64_t b = 0; b < 2; ++b) {
          const __m512i x = t < tile_len ? _mm512_loadu_si512(key(t, v_off) + d0 + 32 * b) : _mm512_setzero_si512();
          const __m512i y = t + 1 < tile_len ? _mm512_loadu_si512(key(t + 1, v_off) + d0 + 32 * b) : _mm512_setzero_si512();
          vt[2 * b * 16 + pair] = _mm512_unpacklo_epi16(x, y);
          vt[(2 * b + 1) * 16 + pair] = _mm512_unpackhi_epi16(x, y);
        }
      }
    }
  }

  // Output row r, dims d0 .. d0 + 63, from its 4 vectors of sums: vector 2 b + h, lane 4 k + j
  // holds dim 32 b + 8 k + 4 h + j (unpacklo: h = 0, unpackhi: h = 1).
  void store_row(int64_t r, int64_t d0, const __m512* sums, c10::BFloat16* out) const {
    const __m512i first_dims = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i last_dims = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    c10::BFloat16* dst = out + (token_of(r) * p.num_heads + head_of(r)) * D + d0;
    const __m512 inv = _mm512_set1_ps(inv_sum[r]);
    for (int64_t b = 0; b < 2; ++b) {
      const __m512 lo = _mm512_mul_ps(sums[2 * b], inv), hi = _mm512_mul_ps(sums[2 * b + 1], inv);
      _mm512_storeu_si512(dst + 32 * b, (__m512i)_mm512_cvtne2ps_pbh(_mm512_permutex2var_ps(lo, last_dims, hi),
                                                                     _mm512_permutex2var_ps(lo, first_dims, hi)));
    }
  }
};

// Prompt tiles in bfloat16 with vdpbf16ps, for CPUs with AVX512-BF16 but no AMX (q and the pool
// both bf16, D of 64 or 128): attend_tile_amx's blocks with register tiles in place of AMX tiles.
// Scores: 12 rows x 32 keys of sums in registers, each K^T pair row loaded once for the 12 rows, q
// pairs broadcast. Output: 6 rows x 64 dims of sums, each V pair row loaded once for the 6 rows,
// probability pairs broadcast.
constexpr int kScoreTileRows = 12, kValueTileRows = 6;

template <int64_t D>
void attend_tile_dpbf16(const Problem& p, const Task& task, const c10::BFloat16* q, const c10::BFloat16* kv,
                        c10::BFloat16* out) {
  Bf16PromptTask<D> t(p, task, q, kv, kScoreTileRows);  // (a multiple of kValueTileRows too)
  constexpr int64_t kKeys = Bf16PromptTask<D>::kKeys, KS = Bf16PromptTask<D>::KS;
  const uint32_t* q_pairs = reinterpret_cast<const uint32_t*>(t.qrows);  // row r: D / 2 pairs

  // S = Q K^T, a block of 32 keys at a time, each block's K^T shared by every row tile
  alignas(64) __m512i kt[KS][2][16];
  for (int64_t t0 = 0; t0 < t.tile_len; t0 += kKeys) {
    t.keys_vnni(t0, kt);
    for (int64_t i0 = 0; i0 < t.padded_rows; i0 += kScoreTileRows) {
      __m512 acc[kScoreTileRows][2];
      for (int r = 0; r < kScoreTileRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      for (int64_t s = 0; s < KS; ++s)
        for (int j = 0; j < 16; ++j) {
          const __m512bh k0 = (__m512bh)kt[s][0][j], k1 = (__m512bh)kt[s][1][j];
#pragma GCC unroll 12
          for (int r = 0; r < kScoreTileRows; ++r) {
            const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(q_pairs[(i0 + r) * (D / 2) + s * 16 + j]));
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qp, k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qp, k1);
          }
        }
      for (int r = 0; r < kScoreTileRows; ++r) {
        _mm512_storeu_ps(t.scores + (i0 + r) * t.padded + t0, acc[r][0]);
        _mm512_storeu_ps(t.scores + (i0 + r) * t.padded + t0 + 16, acc[r][1]);
      }
    }
  }
  t.softmax();
  const uint32_t* prob_pairs = reinterpret_cast<const uint32_t*>(t.probs);  // row r: padded / 2 pairs

  // O = P V, 64 dims at a time: V of every block in VNNI form, then each 6-row tile
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    t.values_vnni(d0);
    for (int64_t i0 = 0; i0 < t.rows; i0 += kValueTileRows) {
      __m512 acc[kValueTileRows][4];
      for (int r = 0; r < kValueTileRows; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
      for (int64_t blk = 0; blk < t.blocks; ++blk) {
        const __m512i* vt = t.values + blk * 4 * 16;
        for (int pair = 0; pair < 16; ++pair) {
          const __m512bh v0 = (__m512bh)vt[pair], v1 = (__m512bh)vt[16 + pair], v2 = (__m512bh)vt[32 + pair],
                         v3 = (__m512bh)vt[48 + pair];
#pragma GCC unroll 6
          for (int r = 0; r < kValueTileRows; ++r) {
            const __m512bh w =
                (__m512bh)_mm512_set1_epi32(static_cast<int>(prob_pairs[(i0 + r) * (t.padded / 2) + blk * 16 + pair]));
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], v0, w);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], v1, w);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], v2, w);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], v3, w);
          }
        }
      }
      for (int64_t rr = 0; rr < kValueTileRows && i0 + rr < t.rows; ++rr) t.store_row(i0 + rr, d0, acc[rr], out);
    }
  }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LOOM_AMX_ATTENTION 1
// Prompt tiles in bfloat16 on AMX (q and the pool both bf16, D a multiple of 64): the scores
// S = Q K^T and the output P V are tile products (tdpbf16ps), float32 sums, over Bf16PromptTask's
// K^T and V blocks; the softmax between the two passes is attend_tile's.
template <int64_t D>
void attend_tile_amx(const Problem& p, const Task& task, const c10::BFloat16* q, const c10::BFloat16* kv,
                     c10::BFloat16* out) {
  Bf16PromptTask<D> t(p, task, q, kv, 16);
  constexpr int64_t kKeys = Bf16PromptTask<D>::kKeys, KS = Bf16PromptTask<D>::KS;
  const int64_t tiles = t.padded_rows / 16, padded = t.padded;
  // 0-3: sums (scores: 0-1; output: 0-3), 4: Q or P, 5: V, 6-7: K^T
  loom::configure_tiles({16, 16, 16, 16, 16, 16, 16, 16});

  // S = Q K^T, a block of 32 keys at a time, each block's K^T shared by every row tile
  alignas(64) __m512i kt[KS][2][16];
  for (int64_t t0 = 0; t0 < t.tile_len; t0 += kKeys) {
    t.keys_vnni(t0, kt);
    for (int64_t i = 0; i < tiles; ++i) {
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t s = 0; s < KS; ++s) {
        _tile_loadd(4, t.qrows + i * 16 * D + s * 32, D * sizeof(c10::BFloat16));
        _tile_loadd(6, kt[s][0], 64);
        _tile_loadd(7, kt[s][1], 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
      _tile_stored(0, t.scores + i * 16 * padded + t0, padded * sizeof(float));
      _tile_stored(1, t.scores + i * 16 * padded + t0 + 16, padded * sizeof(float));
    }
  }
  t.softmax();

  // O = P V, 64 dims (four tiles) at a time: V of every block in VNNI form, then each row tile
  alignas(64) float o[16][64];
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    t.values_vnni(d0);
    for (int64_t i = 0; i < tiles; ++i) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t blk = 0; blk < t.blocks; ++blk) {
        const __m512i* vt = t.values + blk * 4 * 16;
        _tile_loadd(4, t.probs + i * 16 * padded + blk * kKeys, padded * sizeof(uint16_t));
        _tile_loadd(5, vt, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, vt + 16, 64);
        _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(5, vt + 32, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, vt + 48, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, &o[0][0], 64 * sizeof(float));
      _tile_stored(1, &o[0][16], 64 * sizeof(float));
      _tile_stored(2, &o[0][32], 64 * sizeof(float));
      _tile_stored(3, &o[0][48], 64 * sizeof(float));
      for (int64_t rr = 0; rr < 16 && i * 16 + rr < t.rows; ++rr) {
        const __m512 sums[4] = {_mm512_load_ps(&o[rr][0]), _mm512_load_ps(&o[rr][16]), _mm512_load_ps(&o[rr][32]),
                                _mm512_load_ps(&o[rr][48])};
        t.store_row(i * 16 + rr, d0, sums, out);
      }
    }
  }
  _tile_release();
}
#endif

// Any head size: the same math one query head at a time, with plain loops.
template <typename T, typename KV>
void attend_tile_generic(const Problem& p, const Task& task, int64_t D, const T* q, const KV* kv, T* out,
                         Scratch& scratch) {
  const int64_t G = p.group, H = p.num_heads;
  const int64_t first_pos = p.seq_lens[task.row] - p.extend_lens[task.row];
  const int32_t* slots = p.req_to_token + p.req_idx[task.row] * p.r2t_stride;
  std::vector<float> acc(D);
  for (int64_t i = task.first_token; i < task.first_token + task.num_tokens; ++i) {
    const int64_t len = first_pos + i + 1, token = p.token_starts[task.row] + i;
    if (scratch.scores.size() < static_cast<size_t>(len)) scratch.scores.resize(len);
    float* s = scratch.scores.data();
    for (int64_t g = 0; g < G; ++g) {
      const int64_t head = task.kv_head * G + g;
      const T* qh = q + token * p.q_row_stride + head * D;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < len; ++t) {
        const KV* k = kv + slots[t] * p.kv_slot_stride + task.kv_head * D;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += static_cast<float>(qh[d]) * static_cast<float>(k[d]);
        s[t] = dot * p.scale;
        m = std::max(m, s[t]);
      }
      float sum = 0.f;
      for (int64_t t = 0; t < len; ++t) sum += (s[t] = std::exp(s[t] - m));
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const KV* v = kv + slots[t] * p.kv_slot_stride + (p.num_kv_heads + task.kv_head) * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += s[t] * static_cast<float>(v[d]);
      }
      T* o = out + (token * H + head) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d] / sum);
    }
  }
}

struct DecodeRow {
  int64_t row, first_partial, num_parts;
};

// Floats of the decode rows' partial sums (every decode part writes all of its partial: no
// zeroing, a serial pass over ~150 KB a layer).
int64_t partial_floats(const std::vector<DecodeRow>& decode_rows, int64_t H, int64_t D) {
  const int64_t num_partials = decode_rows.empty() ? 0 : decode_rows.back().first_partial + decode_rows.back().num_parts;
  return num_partials * H * (D + 2);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// attend_decode for int8 pools (kv_int8.h) with AVX512-VNNI. Scores: each head's q, times the
// softmax scale, becomes two rows of int8 codes once per task, q ~ s (256 hi + lo) / 256 (lo the
// rounding left by hi: q to ~1/65,000 of its largest value, finer than bfloat16's q; one row of
// codes alone moved outputs by up to ~0.2 on peaked random scores). vpdpbusd multiplies 64 of
// K's codes by codes + 128 (its first operand is unsigned) in one instruction; the 257 x 128 x
// (sum of K's codes) that adds comes off with one more vpdpbusd per kv head and token (ones times
// K), so a score is s x k_scale x (256 hi.k + lo.k) / 256 with exact integer sums up to there.
// Values: V's codes widened to float (add_values), times probabilities that carry their V row's
// scale. Blocks of 16 tokens with an online softmax; the next block's slots are fetched ahead as
// attend_decode_dpbf16 does.
template <typename T, int ND>  // ND: 64-code chunks per head row (D = 64 ND)
void attend_decode_i8(const Problem& p, const Task& task, const T* q, const int8_t* kv, float* partial,
                      const Task* next) {
  constexpr int64_t D = 64 * ND, RB = D + loom::kKvScaleBytes, kBlock = kLanes;
  constexpr int NV = D / kLanes, R = NV <= 4 ? 3 : 1;  // R: heads whose V sums share registers
  const int64_t H = p.num_heads, G = p.group, KVH = p.num_kv_heads, row = task.row;
  const int64_t begin = task.first_token, len = task.first_token + task.num_tokens, token = p.token_starts[row];
  const int32_t* slots = p.req_to_token + p.req_idx[row] * p.r2t_stride;
  const int64_t slot_bytes = 2 * KVH * RB;
  constexpr float kInf = std::numeric_limits<float>::infinity();

  alignas(64) uint8_t q_hi[kMaxHeads][D], q_lo[kMaxHeads][D];  // q's two rows of codes, + 128
  float q_scale[kMaxHeads];
  vf acc[kMaxHeads][NV];
  alignas(64) float prob[kMaxHeads][kBlock];
  RunningSoftmax soft[kMaxHeads];
  // (16 lanes at a time: 1.015x over an element at a time, 64 rows x 362 tokens; codes identical)
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i bias = _mm512_set1_epi32(128);
  for (int64_t h = 0; h < H; ++h) {
    const T* src = q + token * p.q_row_stride + h * D;
    __m512 x[NV], amax = _mm512_setzero_ps();
    for (int j = 0; j < NV; ++j) {
      x[j] = reinterpret_cast<__m512>(load16(src + j * kLanes));
      amax = _mm512_max_ps(amax, _mm512_abs_ps(x[j]));
    }
    const float top = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
    for (int j = 0; j < NV; ++j) {
      const __m512 xs = _mm512_mul_ps(x[j], inv), hi = _mm512_roundscale_ps(xs, kNearest);
      const __m512 lo = _mm512_min_ps(
          _mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(xs, hi), _mm512_set1_ps(256.f)), kNearest),
                        _mm512_set1_ps(-127.f)),
          _mm512_set1_ps(127.f));
      _mm_store_si128(reinterpret_cast<__m128i*>(q_hi[h] + j * kLanes),
                      _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(hi), bias)));
      _mm_store_si128(reinterpret_cast<__m128i*>(q_lo[h] + j * kLanes),
                      _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(lo), bias)));
    }
    q_scale[h] = top / 127.f / 256.f * p.scale;
    for (int j = 0; j < NV; ++j) acc[h][j] = vf{};
  }
  // the block's slots; past its end, its last one again (scored -inf, probability 0)
  const int8_t* slot[kBlock];
  for (int64_t i = begin; i < std::min(len, begin + kBlock); ++i) prefetch_slot(kv + slots[i] * p.kv_slot_stride, slot_bytes);
  const int64_t slot_lines = (slot_bytes + 63) / 64;
  const SlotsAhead ahead(p, task, next, kBlock);
  int64_t fetch_slot = 0, fetch_line = 0, fetch_end = 0;
  auto fetch_ahead = [&](int64_t lines) {
    for (; lines > 0 && fetch_slot < fetch_end; --lines) {
      __builtin_prefetch(kv + ahead[fetch_slot] * p.kv_slot_stride + fetch_line * 64, 0, 2);
      if (++fetch_line == slot_lines) fetch_line = 0, ++fetch_slot;
    }
  };
  const vi iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t t0 = begin; t0 < len; t0 += kBlock) {
    const int64_t nb = std::min(kBlock, len - t0);
    for (int64_t i = 0; i < kBlock; ++i) slot[i] = kv + slots[t0 + std::min(i, nb - 1)] * p.kv_slot_stride;
    fetch_ahead(std::numeric_limits<int64_t>::max());  // (what the last block left)
    fetch_slot = std::min(t0 + kBlock, len), fetch_line = 0, fetch_end = std::min(ahead.limit(), fetch_slot + kBlock);
    const int64_t fetch_share = ((fetch_end - fetch_slot) * slot_lines + H + KVH - 1) / (H + KVH);
    const vi valid = iota < static_cast<int32_t>(nb);  // tokens past the end score -inf
    vf scores[kMaxHeads];
    vi part[kBlock];
    for (int64_t kh = 0; kh < KVH; ++kh) {
      alignas(64) float k_scale[kBlock];
      for (int64_t i = 0; i < kBlock; ++i) k_scale[i] = loom::kv_row_scale(slot[i] + kh * RB, D);
      fetch_ahead(fetch_share);
      for (int64_t i = 0; i < kBlock; ++i) {
        __m512i s = _mm512_setzero_si512();
        for (int c = 0; c < ND; ++c) s = _mm512_dpbusd_epi32(s, ones, _mm512_loadu_si512(slot[i] + kh * RB + 64 * c));
        part[i] = reinterpret_cast<vi>(s);
      }
      const vi k_sums = transpose_sum(part) * (257 * 128);
      const vf ks = load16(k_scale);
      for (int64_t h = kh * G; h < (kh + 1) * G; ++h) {
        fetch_ahead(fetch_share);
        __m512i hi[ND], lo[ND];
        for (int c = 0; c < ND; ++c) {
          hi[c] = _mm512_load_si512(q_hi[h] + 64 * c);
          lo[c] = _mm512_load_si512(q_lo[h] + 64 * c);
        }
        for (int64_t i = 0; i < kBlock; ++i) {
          __m512i s_hi = _mm512_setzero_si512(), s_lo = _mm512_setzero_si512();
          for (int c = 0; c < ND; ++c) {
            const __m512i k = _mm512_loadu_si512(slot[i] + kh * RB + 64 * c);
            s_hi = _mm512_dpbusd_epi32(s_hi, hi[c], k);
            s_lo = _mm512_dpbusd_epi32(s_lo, lo[c], k);
          }
          part[i] = reinterpret_cast<vi>(_mm512_add_epi32(_mm512_slli_epi32(s_hi, 8), s_lo));
        }
        const vf s = __builtin_convertvector(transpose_sum(part) - k_sums, vf) * ks * q_scale[h];
        scores[h] = valid ? s : splat(-kInf);
      }
    }
    for (int64_t kh = 0; kh < KVH; ++kh) {
      alignas(64) float v_scale[kBlock];
      for (int64_t i = 0; i < kBlock; ++i) v_scale[i] = loom::kv_row_scale(slot[i] + (KVH + kh) * RB, D);
      const vf vs = load16(v_scale);
      for (int64_t h = kh * G; h < (kh + 1) * G; ++h) {
        const vf pv = soft[h].exps(scores[h], acc[h]) * vs;
        std::memcpy(prob[h], &pv, sizeof(pv));
      }
    }
    for (int64_t kh = 0; kh < KVH; ++kh)
      add_value_heads<R, NV>(acc + kh * G, prob + kh * G, kv, slots + t0, p.kv_slot_stride, (KVH + kh) * RB, nb, G);
  }
  for (int64_t h = 0; h < H; ++h) store_partial(partial, h, D, acc[h], soft[h].ref, soft[h].sum());
}
#endif

// One task (attend_team's loop): a decode part into its partial, or a prompt tile into out.
// next: the task this thread likely runs after it (decode parts fetch its first slots ahead).
template <typename T, typename KV>
void run_task(const Problem& p, const Task& task, [[maybe_unused]] const Task* next, int64_t D, const T* q,
              const KV* kv, T* out, float* partials, Scratch& scratch) {
  if (task.kv_head < 0) {  // (part of) a decode row, all heads
    float* partial = partial_at(partials, task.partial, p.num_heads, D);
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<KV, c10::BFloat16>) {
      if (D == 64) return attend_decode_dpbf16<4>(p, task, q, kv, partial, next);
      if (D == 128) return attend_decode_dpbf16<8>(p, task, q, kv, partial, next);
      if (D == 32) return attend_decode_dpbf16<2>(p, task, q, kv, partial, next);
    }
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
    switch (D) {
      case 16: return attend_decode_avx2<T, KV, 2>(p, task, q, kv, partial, next);
      case 32: return attend_decode_avx2<T, KV, 4>(p, task, q, kv, partial, next);
      case 64: return attend_decode_avx2<T, KV, 8>(p, task, q, kv, partial, next);
      case 128: return attend_decode_avx2<T, KV, 16>(p, task, q, kv, partial, next);
    }
#else
    switch (D) {
      case 16: return attend_decode<T, KV, 1>(p, task, q, kv, partial, next);
      case 32: return attend_decode<T, KV, 2>(p, task, q, kv, partial, next);
      case 64: return attend_decode<T, KV, 4>(p, task, q, kv, partial, next);
      case 128: return attend_decode<T, KV, 8>(p, task, q, kv, partial, next);
    }
#endif
    return;
  }
#if defined(LOOM_AMX_ATTENTION)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<KV, c10::BFloat16>) {
    if (amx_bf16() && D == 64) return attend_tile_amx<64>(p, task, q, kv, out);
    if (amx_bf16() && D == 128) return attend_tile_amx<128>(p, task, q, kv, out);
  }
#endif
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<KV, c10::BFloat16>) {
    if (D == 64) return attend_tile_dpbf16<64>(p, task, q, kv, out);
    if (D == 128) return attend_tile_dpbf16<128>(p, task, q, kv, out);
  }
#endif
  if (p.group > kTileRows) return attend_tile_generic<T, KV>(p, task, D, q, kv, out, scratch);
  // (a task planned for the bf16 paths runs here as several tiles of this path's size)
  const int64_t tile_tokens = std::max<int64_t>(1, kTileRows / p.group);
  for (int64_t first = task.first_token; first < task.first_token + task.num_tokens; first += tile_tokens) {
    const Task tile{task.row, task.kv_head, first, std::min(tile_tokens, task.first_token + task.num_tokens - first)};
    switch (D) {
#if defined(LOOM_AVX2_ATTENTION)
      case 16: attend_prompt_avx2<T, KV, 16>(p, tile, q, kv, out, scratch); break;
      case 32: attend_prompt_avx2<T, KV, 32>(p, tile, q, kv, out, scratch); break;
      case 64: attend_prompt_avx2<T, KV, 64>(p, tile, q, kv, out, scratch); break;
      case 128: attend_prompt_avx2<T, KV, 128>(p, tile, q, kv, out, scratch); break;
#else
      case 16: attend_tile<T, KV, 1>(p, tile, q, kv, out, scratch); break;
      case 32: attend_tile<T, KV, 2>(p, tile, q, kv, out, scratch); break;
      case 64: attend_tile<T, KV, 4>(p, tile, q, kv, out, scratch); break;
      case 128: attend_tile<T, KV, 8>(p, tile, q, kv, out, scratch); break;
#endif
      default: attend_tile_generic<T, KV>(p, tile, D, q, kv, out, scratch);
    }
  }
}

// Each decode row: its parts' sums, rescaled to their common max, then normalised (the team's
// rows split among it).
template <typename T>
void merge_decode_rows(const Problem& p, const std::vector<DecodeRow>& decode_rows, int64_t D, T* out,
                       float* partials) {
  const int64_t H = p.num_heads;
  std::vector<float> acc(D);
#pragma omp for schedule(static)
  for (size_t r = 0; r < decode_rows.size(); ++r) {
    const DecodeRow& dr = decode_rows[r];
    T* o = out + p.token_starts[dr.row] * H * D;
    for (int64_t h = 0; h < H; ++h) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t k = 0; k < dr.num_parts; ++k)
        top = std::max(top, partial_at(partials, dr.first_partial + k, H, D)[h * (D + 2) + D]);
      std::fill(acc.begin(), acc.end(), 0.f);
      float sum = 0.f;
      for (int64_t k = 0; k < dr.num_parts; ++k) {
        const float* part = partial_at(partials, dr.first_partial + k, H, D) + h * (D + 2);
        const float c = dr.num_parts == 1 ? 1.f : std::exp(part[D] - top);
        sum += part[D + 1] * c;
        for (int64_t d = 0; d < D; ++d) acc[d] += part[d] * c;
      }
      for (int64_t d = 0; d < D; ++d) o[h * D + d] = static_cast<T>(acc[d] / sum);
    }
  }
}

// The task this thread likely takes after task i (the dynamic schedule hands them out in turn),
// where both are decode parts.
inline const Task* next_decode_task(const std::vector<Task>& tasks, int64_t i) {
  const int64_t after = i + omp_get_num_threads();
  return tasks[i].kv_head < 0 && after < static_cast<int64_t>(tasks.size()) && tasks[after].kv_head < 0
             ? &tasks[after] : nullptr;
}

// The attention's work for every thread of a region the caller opened (team.h): tasks handed out
// one at a time (contexts and chunk sizes vary), then the decode rows' parts merged; the team
// meets at the end.
template <typename T, typename KV>
void attend_team(const Problem& p, const std::vector<Task>& tasks, const std::vector<DecodeRow>& decode_rows,
                 int64_t D, const T* q, const KV* kv, T* out, float* partials) {
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  Scratch scratch;
#pragma omp for schedule(dynamic, 1)
  for (int64_t i = 0; i < num_tasks; ++i)
    run_task<T, KV>(p, tasks[i], next_decode_task(tasks, i), D, q, kv, out, partials, scratch);
  merge_decode_rows<T>(p, decode_rows, D, out, partials);
}

// int8 pools (kv_int8.h). Decode parts read the codes directly where the build has AVX512-VNNI
// (attend_decode_i8); every other task dequantizes the slots it reads (the kv head it attends, or
// all of them for a decode part) into a per-thread pool of T, laid out as a T pool with the
// row's tokens in order, and runs as attend_team runs T pools.
template <typename T>
void attend_team_i8(const Problem& p, const std::vector<Task>& tasks, const std::vector<DecodeRow>& decode_rows,
                    int64_t D, const T* q, const int8_t* kv, T* out, float* partials) {
  const int64_t num_tasks = static_cast<int64_t>(tasks.size()), KVH = p.num_kv_heads, row_bytes = D + loom::kKvScaleBytes;
  Scratch scratch;
  std::vector<T> local;           // the dequantized slots, [tokens, 2, KVH, D]
  std::vector<int32_t> identity;  // token t -> its slot in `local`
#pragma omp for schedule(dynamic, 1)
  for (int64_t i = 0; i < num_tasks; ++i) {
    const Task& task = tasks[i];
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (task.kv_head < 0 && D % 64 == 0 && D <= 128 && p.num_heads <= kMaxHeads) {
      float* partial = partial_at(partials, task.partial, p.num_heads, D);
      const Task* next = next_decode_task(tasks, i);
      if (D == 64) attend_decode_i8<T, 1>(p, task, q, kv, partial, next);
      else attend_decode_i8<T, 2>(p, task, q, kv, partial, next);
      continue;
    }
#endif
    const int64_t r = task.row;
    // a decode part reads its range of cached tokens; a prompt tile every token before its last
    const int64_t lo = task.kv_head < 0 ? task.first_token : 0;
    const int64_t hi = task.kv_head < 0 ? task.first_token + task.num_tokens
                                        : p.seq_lens[r] - p.extend_lens[r] + task.first_token + task.num_tokens;
    const int64_t h0 = task.kv_head < 0 ? 0 : task.kv_head, h1 = task.kv_head < 0 ? KVH : task.kv_head + 1;
    const int64_t slot_elems = 2 * KVH * D;
    if (static_cast<int64_t>(local.size()) < (hi - lo) * slot_elems) local.resize((hi - lo) * slot_elems);
    if (static_cast<int64_t>(identity.size()) < hi) identity.resize(hi);
    const int32_t* slots = p.req_to_token + p.req_idx[r] * p.r2t_stride;
    for (int64_t t = lo; t < hi; ++t) {
      identity[t] = static_cast<int32_t>(t - lo);
      const int8_t* src = kv + slots[t] * p.kv_slot_stride;
      T* dst = local.data() + (t - lo) * slot_elems;
      for (int64_t half = 0; half < 2; ++half)
        for (int64_t h = h0; h < h1; ++h)
          loom::dequantize_kv_row(dst + (half * KVH + h) * D, src + (half * KVH + h) * row_bytes, D);
    }
    Problem local_problem = p;
    local_problem.req_to_token = identity.data();
    local_problem.r2t_stride = 0;  // (every row reads `identity`)
    local_problem.kv_slot_stride = slot_elems;
    run_task<T, T>(local_problem, task, nullptr, D, q, local.data(), out, partials, scratch);
  }
  merge_decode_rows<T>(p, decode_rows, D, out, partials);
}

template <typename T, typename KV>
void attend(const Problem& p, const std::vector<Task>& tasks, const std::vector<DecodeRow>& decode_rows,
            int64_t D, const T* q, const KV* kv, T* out) {
  const std::unique_ptr<float[]> partials(new float[partial_floats(decode_rows, p.num_heads, D)]);
#pragma omp parallel num_threads(at::get_num_threads())
  {
    if constexpr (std::is_same_v<KV, int8_t>) attend_team_i8<T>(p, tasks, decode_rows, D, q, kv, out, partials.get());
    else attend_team<T, KV>(p, tasks, decode_rows, D, q, kv, out, partials.get());
  }
}

}  // namespace

// What every layer's attention of one step shares: the rows' lengths as int64, the problem and
// the task list. A layer stack plans once per step and runs it against each layer's pool.
struct PagedAttentionPlan {
  at::Tensor req_idx, token_starts, extend_lens, seq_lens;  // int64, kept alive for `problem`
  Problem problem;
  std::vector<Task> tasks;
  std::vector<DecodeRow> decode_rows;
  int64_t num_tokens, head_dim;
  at::ScalarType dtype;
};

// num_tokens rows of q [N, H, D] (this step's tokens, H = num_heads) over kv [S, 2, KVH, D] (read
// for its layout only); req_to_token [R, C] int32; per batch row (int64): req_idx, token_starts
// (first token of the row in q), extend_lens, seq_lens (cached tokens including this step's).
std::shared_ptr<const PagedAttentionPlan> plan_paged_attention(
    int64_t num_tokens, int64_t num_heads, at::Tensor kv, at::Tensor req_to_token, at::Tensor req_idx,
    at::Tensor token_starts, at::Tensor extend_lens, at::Tensor seq_lens, double scale) {
  TORCH_CHECK(req_to_token.is_contiguous(), "contiguous req_to_token expected");
  TORCH_CHECK(kv.dim() == 4 && kv.size(1) == 2, "kv [S,2,KVH,D] expected");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt, "req_to_token must be int32");
  const bool int8_pool = kv.scalar_type() == at::kChar;  // head rows of D codes and a scale (kv_int8.h)
  const int64_t D = kv.size(3) - (int8_pool ? loom::kKvScaleBytes : 0), num_kv_heads = kv.size(2);
  TORCH_CHECK(D > 0, "kv [S,2,KVH,D] expected (int8: D codes and 4 scale bytes a head row)");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads");
  auto plan = std::make_shared<PagedAttentionPlan>();
  auto as_i64 = [](const at::Tensor& t) { return t.to(at::kLong).contiguous(); };
  plan->req_idx = as_i64(req_idx);
  plan->token_starts = as_i64(token_starts);
  plan->extend_lens = as_i64(extend_lens);
  plan->seq_lens = as_i64(seq_lens);
  const int64_t num_rows = plan->req_idx.numel();
  TORCH_CHECK(plan->token_starts.numel() == num_rows && plan->extend_lens.numel() == num_rows &&
                  plan->seq_lens.numel() == num_rows,
              "one req_idx, token_start, extend_len and seq_len per row");
  const int64_t group = num_heads / num_kv_heads;
  plan->problem = Problem{num_heads, num_kv_heads, group, kv.stride(0), req_to_token.stride(0), num_heads * D,
                          req_to_token.data_ptr<int32_t>(), plan->req_idx.data_ptr<int64_t>(),
                          plan->token_starts.data_ptr<int64_t>(), plan->extend_lens.data_ptr<int64_t>(),
                          plan->seq_lens.data_ptr<int64_t>(), static_cast<float>(scale)};
  plan->num_tokens = num_tokens;
  plan->head_dim = D;
  plan->dtype = kv.scalar_type();
  const Problem& p = plan->problem;
  // Tiles of as many tokens as fit kTileRows query-head rows (at least one token; a larger group
  // takes the generic path, a token at a time).
  int64_t tile_tokens = std::max<int64_t>(1, kTileRows / group);
#if defined(__AVX512BF16__)
  // bfloat16 pools with bf16 products (AMX tiles or vdpbf16ps; a bf16 q, as the model's dtype):
  // larger tasks share each key block's conversion across their row tiles (attend splits them
  // back where q is float32)
  if ((kv.scalar_type() == at::kBFloat16 || int8_pool) && (D == 64 || D == 128) && group <= kMaxTileRows)
    tile_tokens = kBf16TaskTokens;
#endif
  const bool whole_slot_decode = num_heads <= kMaxHeads && (D == 16 || D == 32 || D == 64 || D == 128);
  std::vector<Task>& tasks = plan->tasks;
  std::vector<int64_t> decodes;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t n = p.extend_lens[r];
    TORCH_CHECK(n >= 1 && p.seq_lens[r] >= n && p.seq_lens[r] <= req_to_token.size(1), "bad row lengths");
    TORCH_CHECK(p.token_starts[r] >= 0 && p.token_starts[r] + n <= num_tokens, "row tokens out of q");
    if (n == 1 && whole_slot_decode) {
      decodes.push_back(r);
      continue;
    }
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t first = 0; first < n; first += tile_tokens)
        tasks.push_back({r, h, first, std::min(tile_tokens, n - first)});
  }
  // With fewer tasks than threads to keep busy (small decode batches), a decode row's cached
  // tokens are split into parts that run in parallel and are merged at the end.
  const int64_t threads = at::get_num_threads(), want = 2 * threads, have = static_cast<int64_t>(tasks.size() + decodes.size());
  int64_t num_partials = 0;
  for (int64_t r : decodes) {
    const int64_t len = p.seq_lens[r];
    const int64_t split = have >= want ? 1 : (want + have - 1) / have;
    int64_t parts = std::max<int64_t>(1, std::min(split, len / kMinDecodePart));
    if (parts > threads) parts -= parts % threads;  // 3 parts on 2 threads take as long as 4
    plan->decode_rows.push_back({r, num_partials, parts});
    // (part boundaries on multiples of 16 tokens: the decode kernels read blocks of 16 slots)
    auto boundary = [&](int64_t k) { return k == parts ? len : len * k / parts / 16 * 16; };
    for (int64_t k = 0; k < parts; ++k) {
      const int64_t first = boundary(k), last = boundary(k + 1);
      tasks.push_back({r, -1, first, last - first, num_partials++});
    }
  }
  // Longest first, so the dynamic schedule ends with short ones.
  auto work = [&](const Task& t) {
    return t.kv_head < 0 ? t.num_tokens : p.seq_lens[t.row] - p.extend_lens[t.row] + t.first_token + t.num_tokens;
  };
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) { return work(a) > work(b); });
  return plan;
}

// Returns [N, H, D]: the attention of the planned rows over one layer's pool kv.
at::Tensor run_paged_attention(const PagedAttentionPlan& plan, at::Tensor q, at::Tensor kv) {
  TORCH_CHECK(kv.is_contiguous(), "contiguous kv expected");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q rows [H, D] must be contiguous");
  TORCH_CHECK(q.size(0) == plan.num_tokens && q.size(1) == plan.problem.num_heads &&
                  q.size(2) == plan.head_dim,
              "q differs from the planned shape");
  TORCH_CHECK(kv.dim() == 4 && kv.stride(0) == plan.problem.kv_slot_stride && kv.size(2) == plan.problem.num_kv_heads &&
                  kv.scalar_type() == plan.dtype,
              "kv differs from the planned layout or dtype");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const int64_t D = plan.head_dim;
  Problem problem = plan.problem;
  problem.q_row_stride = q.stride(0);
  // (q, pool) dtype pairs: the model's dtype, and a pool as narrow or narrower (float16 halves a
  // float32 pool's reads, the bulk of a long-context decode step)
  auto run = [&](auto q_type, auto kv_type) {
    using T = decltype(q_type);
    using KV = decltype(kv_type);
    attend<T, KV>(problem, plan.tasks, plan.decode_rows, D, q.data_ptr<T>(), kv.data_ptr<KV>(), out.data_ptr<T>());
  };
  const auto kv_type = kv.scalar_type();
  if (q.scalar_type() == at::kFloat && kv_type == at::kFloat) run(float{}, float{});
  else if (q.scalar_type() == at::kFloat && kv_type == at::kBFloat16) run(float{}, c10::BFloat16{});
  else if (q.scalar_type() == at::kFloat && kv_type == at::kHalf) run(float{}, c10::Half{});
  else if (q.scalar_type() == at::kBFloat16 && kv_type == at::kBFloat16) run(c10::BFloat16{}, c10::BFloat16{});
  else if (q.scalar_type() == at::kBFloat16 && kv_type == at::kHalf) run(c10::BFloat16{}, c10::Half{});
  else if (q.scalar_type() == at::kFloat && kv_type == at::kChar) run(float{}, int8_t{});
  else if (q.scalar_type() == at::kBFloat16 && kv_type == at::kChar) run(c10::BFloat16{}, int8_t{});
  else TORCH_CHECK(false, "paged_attention: q float32 with a float32, bfloat16, float16 or int8 pool, or q bfloat16 "
                          "with a bfloat16, float16 or int8 pool");
  return out;
}

at::Tensor paged_attention(at::Tensor q, at::Tensor kv, at::Tensor req_to_token, at::Tensor req_idx,
                           at::Tensor token_starts, at::Tensor extend_lens, at::Tensor seq_lens,
                           double scale) {
  TORCH_CHECK(q.dim() == 3, "q [N,H,D] expected");
  const auto plan = plan_paged_attention(q.size(0), q.size(1), kv, req_to_token, req_idx, token_starts, extend_lens,
                                         seq_lens, scale);
  return run_paged_attention(*plan, q, kv);
}

int64_t paged_attention_partial_floats(const PagedAttentionPlan& plan) {
  return partial_floats(plan.decode_rows, plan.problem.num_heads, plan.head_dim);
}

namespace {
template <typename T, typename KV>
void attend_planned_team(const PagedAttentionPlan& plan, const T* q, int64_t q_row_stride, const KV* kv, T* out,
                         float* partials) {
  Problem problem = plan.problem;
  problem.q_row_stride = q_row_stride;
  if constexpr (std::is_same_v<KV, int8_t>)
    attend_team_i8<T>(problem, plan.tasks, plan.decode_rows, plan.head_dim, q, kv, out, partials);
  else
    attend_team<T, KV>(problem, plan.tasks, plan.decode_rows, plan.head_dim, q, kv, out, partials);
}
}  // namespace

#if defined(__AVX512BF16__)
void run_paged_attention_team(const PagedAttentionPlan& plan, const at::BFloat16* q, int64_t q_row_stride,
                              const at::BFloat16* kv, at::BFloat16* out, float* partials) {
  attend_planned_team(plan, q, q_row_stride, kv, out, partials);
}

void run_paged_attention_team(const PagedAttentionPlan& plan, const at::BFloat16* q, int64_t q_row_stride,
                              const int8_t* kv, at::BFloat16* out, float* partials) {
  attend_planned_team(plan, q, q_row_stride, kv, out, partials);
}
#endif

void run_paged_attention_team(const PagedAttentionPlan& plan, const float* q, int64_t q_row_stride, const int8_t* kv,
                              float* out, float* partials) {
  attend_planned_team(plan, q, q_row_stride, kv, out, partials);
}

void run_paged_attention_team(const PagedAttentionPlan& plan, const float* q, int64_t q_row_stride, const float* kv,
                              float* out, float* partials) {
  attend_planned_team(plan, q, q_row_stride, kv, out, partials);
}

void run_paged_attention_team(const PagedAttentionPlan& plan, const float* q, int64_t q_row_stride,
                              const at::Half* kv, float* out, float* partials) {
  attend_planned_team(plan, q, q_row_stride, kv, out, partials);
}
