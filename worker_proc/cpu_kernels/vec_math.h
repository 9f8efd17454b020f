// Small numeric helpers shared by the kernels.
#pragma once
#include <algorithm>
#include <bit>
#include <cstdint>

namespace loom {

// expf in a form the compiler vectorises (libm's expf is a call per element, and float
// compares in the loop body stop the vectoriser): Cody-Waite range reduction and the Cephes
// polynomial, within about 1 ulp; the exponent is clamped in integers (0 below, inf above).
inline float vexp(float x) {
  const float t = x * 1.44269504089f + 0.5f;
  const int32_t ti = static_cast<int32_t>(t);
  const int32_t ni = ti - (static_cast<float>(ti) > t);  // floor(t)
  const float n = static_cast<float>(ni);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t biased = std::min(std::max(ni + 127, 0), 255);
  return p * std::bit_cast<float>(biased << 23);
}

// 16 floats: GCC vector types, compiled to AVX-512, or to pairs of AVX2 registers.
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

// vexp on 16 lanes (the same steps; written on vectors where the loop form does not vectorise).
inline vf vexp16(vf x) {
  const vf t = x * 1.44269504089f + 0.5f;
  const vi ti = __builtin_convertvector(t, vi);
  const vi ni = ti + (__builtin_convertvector(ti, vf) > t);  // floor(t): a true lane is -1
  const vf n = __builtin_convertvector(ni, vf);
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi biased = ni + 127;
  biased = biased < 0 ? vi{} : biased;
  biased = biased > 255 ? vi{} + 255 : biased;
  return p * reinterpret_cast<vf>(biased << 23);
}

}  // namespace loom
