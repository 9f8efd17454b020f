// int8 KV pools (--kv-cache-dtype int8): each head row of a slot is its D values as int8 codes
// (symmetric: value = code * scale, codes in [-127, 127]) followed by that row's float32 scale
// (its largest magnitude / 127), so a pool is [S, 2, KVH, D + 4] bytes. A decode reads ~0.53x
// the bytes of a bfloat16 pool (408 against 768 a slot at 3 kv heads of 64), for about twice
// bfloat16's rounding error in the attention's output.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace loom {

constexpr int64_t kKvScaleBytes = 4;  // a head row's scale after its codes

inline float kv_row_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof(s));
  return s;
}

// One head row of D values (the model's dtype) -> codes and scale at dst.
template <typename S>
inline void quantize_kv_row(int8_t* dst, const S* src, int64_t D) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(src[d])));
  const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t d = 0; d < D; ++d) {
    const float c = std::nearbyint(static_cast<float>(src[d]) * inv);
    dst[d] = static_cast<int8_t>(std::clamp(c, -127.f, 127.f));
  }
  std::memcpy(dst + D, &scale, sizeof(scale));
}

// The other way: D values of type T from one head row's codes and scale.
template <typename T>
inline void dequantize_kv_row(T* dst, const int8_t* src, int64_t D) {
  const float scale = kv_row_scale(src, D);
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(static_cast<float>(src[d]) * scale);
}

}  // namespace loom
