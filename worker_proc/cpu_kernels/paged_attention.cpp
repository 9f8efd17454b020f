// Decode attention that reads K/V straight from the paged pool through req_to_token: no
// gather copy, no padding. One task per (request, kv head); the query heads of a GQA group
// share each K/V row read. Two passes per task: scores (then one softmax), then V.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T>
void decode_kernel(const T* q, const T* kv, const int32_t* req_to_token, const int64_t* req_idx,
                   const int64_t* seq_lens, T* out, int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t kv_slot_stride, int64_t r2t_stride, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t kv_width = num_kv_heads * head_dim;  // K of a slot, then V of the slot
  constexpr int64_t kPrefetch = 8;                    // slots ahead: the pool is read in random order
  at::parallel_for(0, num_reqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(num_heads * head_dim), acc(num_heads * head_dim), scores, row(kv_width);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = seq_lens[b];
      const int32_t* slots = req_to_token + req_idx[b] * r2t_stride;
      const T* qb = q + b * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) qf[i] = static_cast<float>(qb[i]) * scale;
      scores.assign(num_heads * len, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        if (t + kPrefetch < len) __builtin_prefetch(kv + static_cast<int64_t>(slots[t + kPrefetch]) * kv_slot_stride);
        const T* k = kv + static_cast<int64_t>(slots[t]) * kv_slot_stride;
#pragma omp simd
        for (int64_t i = 0; i < kv_width; ++i) row[i] = static_cast<float>(k[i]);
        for (int64_t hq = 0; hq < num_heads; ++hq) {
          const float* qh = qf.data() + hq * head_dim;
          const float* kh = row.data() + (hq / group) * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * kh[d];
          scores[hq * len + t] = s;
        }
      }
      for (int64_t hq = 0; hq < num_heads; ++hq) {
        float* sh = scores.data() + hq * len;
        const float m = *std::max_element(sh, sh + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { sh[t] = std::exp(sh[t] - m); sum += sh[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sh[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        if (t + kPrefetch < len)
          __builtin_prefetch(kv + static_cast<int64_t>(slots[t + kPrefetch]) * kv_slot_stride + kv_width);
        const T* v = kv + static_cast<int64_t>(slots[t]) * kv_slot_stride + kv_width;
#pragma omp simd
        for (int64_t i = 0; i < kv_width; ++i) row[i] = static_cast<float>(v[i]);
        for (int64_t hq = 0; hq < num_heads; ++hq) {
          const float p = scores[hq * len + t];
          const float* vh = row.data() + (hq / group) * head_dim;
          float* a = acc.data() + hq * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vh[d];
        }
      }
      T* ob = out + b * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) ob[i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

// q [D, H, Dh]; kv [S, 2, KVH, Dh]; req_to_token [R, C] int32; req_idx, seq_lens [D] int64.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv, torch::Tensor req_to_token,
                                     torch::Tensor req_idx, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous() && req_to_token.is_contiguous(), "contiguous inputs expected");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv dtypes differ");
  TORCH_CHECK(req_to_token.scalar_type() == torch::kInt32, "req_to_token must be int32");
  auto req_idx_c = req_idx.to(torch::kInt64).contiguous();
  auto seq_lens_c = seq_lens.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(q);
  const int64_t num_reqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = kv.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), kv.data_ptr<scalar_t>(), req_to_token.data_ptr<int32_t>(),
                            req_idx_c.data_ptr<int64_t>(), seq_lens_c.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                            num_reqs, num_heads, num_kv_heads, head_dim, kv.stride(0), req_to_token.stride(0),
                            static_cast<float>(scale));
  });
  return out;
}
