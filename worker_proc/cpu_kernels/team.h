// Work shared among the threads of a parallel region the caller opened. The compiled layer stack
// runs a step's layers in one region (layer_stack.cpp): each op's team form takes this thread's
// share and the ops are parted by barriers, where each op would otherwise open a region of its
// own (~9 a layer: a wake-up and a join each, and the small ops ran on one thread).
#pragma once
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace loom {

// This thread's contiguous share [begin, end) of n items.
inline void team_share(int64_t n, int64_t& begin, int64_t& end) {
  const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
  begin = n * t / threads;
  end = n * (t + 1) / threads;
}

// The column blocks of one linear call among a team. Thread t owns an even contiguous share and
// takes it from the front a group at a time (so it can fetch its next group's weights ahead); a
// thread out of work then takes single blocks from the back of the others' shares. Even shares
// alone leave one thread waiting at the join whenever the other runs slower (in a VM, a core
// that is briefly lent elsewhere). Correct for any team size: shares without an owner are
// taken block by block.
class BlockClaims {
 public:
  void reset(int64_t blocks, int threads) {
    if (threads != threads_) shares_.reset(new Share[threads]);
    threads_ = threads;
    for (int t = 0; t < threads; ++t)
      shares_[t].range.store(pack(blocks * t / threads, blocks * (t + 1) / threads), std::memory_order_relaxed);
  }

  // Up to `want` of thread t's own blocks, [b0, b1); `end`: where its share now ends (for fetching
  // ahead). False when its share is done.
  bool take_front(int t, int64_t want, int64_t& b0, int64_t& b1, int64_t& end) {
    if (t >= threads_) return false;
    std::atomic<uint64_t>& range = shares_[t].range;
    uint64_t v = range.load(std::memory_order_acquire);
    for (;;) {
      const int64_t front = v & 0xffffffff, back = v >> 32;
      if (front >= back) return false;
      b0 = front;
      b1 = std::min(back, front + want);
      end = back;
      if (range.compare_exchange_weak(v, pack(b1, back), std::memory_order_acq_rel)) return true;
    }
  }

  // One block from the back of another thread's share (the next thread's first). False when
  // every share is done.
  bool steal(int t, int64_t& b) {
    for (int i = 1; i <= threads_; ++i) {
      std::atomic<uint64_t>& range = shares_[(t + i) % threads_].range;
      uint64_t v = range.load(std::memory_order_acquire);
      for (;;) {
        const int64_t front = v & 0xffffffff, back = v >> 32;
        if (front >= back) break;
        if (range.compare_exchange_weak(v, pack(front, back - 1), std::memory_order_acq_rel)) {
          b = back - 1;
          return true;
        }
      }
    }
    return false;
  }

 private:
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | static_cast<uint64_t>(back) << 32;
  }
  struct alignas(64) Share {
    std::atomic<uint64_t> range{0};
  };
  std::unique_ptr<Share[]> shares_;
  int threads_ = 0;
};

}  // namespace loom
