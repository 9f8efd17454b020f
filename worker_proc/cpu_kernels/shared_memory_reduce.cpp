// The tensor-parallel collectives between the ranks of one host, through a region of shared memory
// every rank maps (TPGroup.share_memory in worker_proc/tensor_parallel.py). gloo's TCP transport
// polls and switches threads on every call: on AMD Zen 3 with 3 ranks on 2 cores, a SmolLM2 decode
// step (61 all-reduces) took 250 ms against 24 ms at one rank, most of it in the kernel.
//
// The region: one arrival counter per rank (a cache line each), then two sets of one slot per rank.
// Call `seq` (1, 2, 3, ... the same on every rank) copies x into this rank's slot of set seq % 2,
// publishes seq and waits until every rank has. Then the all-reduce sums the slots in rank order
// into x (every rank gets the same bits); the exchange hands the caller every rank's slot to read
// (a gather, a broadcast). A set is written again two calls later, when every rank has published
// the call in between, so has finished reading it: no second barrier.
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kLine = 64;
// spins before each wait yields the core (several ranks may share one: the rank it waits for
// may need it)
constexpr int kSpins = 2000;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// out = slots[0] + slots[1] + ... in rank order, summed in float32, in blocks that stay in L1
template <typename T>
void sum_slots(const uint8_t* const* slots, int64_t size, T* out, int64_t n) {
  constexpr int64_t kBlock = 1024;
  float total[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t len = std::min(kBlock, n - i0);
    const T* first = reinterpret_cast<const T*>(slots[0]) + i0;
    for (int64_t j = 0; j < len; ++j) total[j] = static_cast<float>(first[j]);
    for (int64_t r = 1; r < size; ++r) {
      const T* part = reinterpret_cast<const T*>(slots[r]) + i0;
      for (int64_t j = 0; j < len; ++j) total[j] += static_cast<float>(part[j]);
    }
    for (int64_t j = 0; j < len; ++j) out[i0 + j] = static_cast<T>(total[j]);
  }
}

}  // namespace

int64_t shared_reduce_slot_bytes(const at::Tensor& region, int64_t size) {
  return (region.numel() - size * kLine) / (2 * size) / kLine * kLine;
}

namespace {

// Copies x into this rank's slot of call seq's set, publishes seq, waits for every rank; returns
// the set (rank r's slot at r * slot_bytes).
uint8_t* publish_and_wait(const at::Tensor& region, int64_t rank, int64_t size, int64_t seq, const at::Tensor& x,
                          int64_t& slot_bytes) {
  TORCH_CHECK(region.scalar_type() == at::kByte && region.is_contiguous() && region.data_ptr<uint8_t>() != nullptr &&
                  reinterpret_cast<uintptr_t>(region.data_ptr<uint8_t>()) % kLine == 0,
              "region must be a cache-line aligned uint8 tensor");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  TORCH_CHECK(0 <= rank && rank < size && size <= 64 && seq > 0, "rank, size (at most 64 ranks), seq");
  slot_bytes = shared_reduce_slot_bytes(region, size);
  const int64_t bytes = x.numel() * x.element_size();
  TORCH_CHECK(bytes <= slot_bytes, "x (", bytes, " bytes) exceeds a slot (", slot_bytes, ")");
  uint8_t* base = region.data_ptr<uint8_t>();
  uint8_t* set = base + size * kLine + (seq % 2) * size * slot_bytes;
  const auto arrived = [&](int64_t r) { return std::atomic_ref<int64_t>(*reinterpret_cast<int64_t*>(base + r * kLine)); };
  if (bytes > 0) std::memcpy(set + rank * slot_bytes, x.data_ptr(), bytes);
  arrived(rank).store(seq, std::memory_order_release);
  for (int64_t r = 0; r < size; ++r)
    for (int spins = 0; arrived(r).load(std::memory_order_acquire) < seq; ++spins)
      if (spins < kSpins)
        cpu_relax();
      else
        sched_yield();
  return set;
}

}  // namespace

std::vector<at::Tensor> shared_memory_exchange(at::Tensor region, int64_t rank, int64_t size, int64_t seq, at::Tensor x) {
  int64_t slot_bytes;
  uint8_t* set = publish_and_wait(region, rank, size, seq, x, slot_bytes);
  std::vector<at::Tensor> parts;
  for (int64_t r = 0; r < size; ++r)
    parts.push_back(at::from_blob(set + r * slot_bytes, x.sizes(), x.options()));
  return parts;
}

void shared_memory_all_reduce(at::Tensor region, int64_t rank, int64_t size, int64_t seq, at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  int64_t slot_bytes;
  uint8_t* set = publish_and_wait(region, rank, size, seq, x, slot_bytes);
  const uint8_t* slots[64];
  for (int64_t r = 0; r < size; ++r) slots[r] = set + r * slot_bytes;
  if (x.scalar_type() == at::kFloat)
    sum_slots(slots, size, x.data_ptr<float>(), x.numel());
  else
    sum_slots(slots, size, x.data_ptr<at::BFloat16>(), x.numel());
}
