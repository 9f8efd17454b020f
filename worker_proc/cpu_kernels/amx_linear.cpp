// y[M, N] = x[M, K] @ W[N, K]^T in bfloat16 on AMX tiles (Intel Xeon since Sapphire Rapids), for
// every row count: decode steps and prompt chunks alike; on AVX512-BF16 CPUs without AMX, the same
// packed weights by vdpbf16ps, also at every row count (at a few dozen rows oneDNN's GEMM streams
// the weights at a fraction of the products' rate; at prompt sizes the two run within a few per
// cent, and whole steps gain from the compiled layer stack: AMD Zen 4, 503-row mixed steps 410 ->
// 340 ms, 2,002-row prompt steps 1.82 -> 1.55 s).
//
// torch's bfloat16 GEMM (oneDNN) reaches AMX too, but re-lays the weights out on every call: on a
// 2-core Xeon a 576 x 576 linear cost it ~35 us at any row count up to 32 (the weights' own stream
// takes a few), which for a 30-layer model is ~5 ms of each decode step. Here the weights are laid
// out once at load (pack_dense_bf16) as the tiles read them.
//
// Layout: [N / 32, K / 32, 2, 16, 32] bf16: column block b (32 outputs), input block kb (32
// inputs), column tile t (16 outputs), input pair p, then 16 columns x 2 inputs, holding
// W[32 b + 16 t + c, 32 kb + 2 p + e] at [b, kb, t, p, 2 c + e]. A tile of W is then 16 rows of 64
// bytes (1 KB, contiguous): the VNNI form tdpbf16ps multiplies, 32 inputs x 16 columns.
//
// Gated (pack_dense_bf16(w, gated=true), w = [gate; up] of an MLP, [2 I, K]): block b holds gate
// columns 16 b.. in its first column tile and up columns 16 b.. in its second, one more dimension
// marks it ([I / 16, K / 32, 2, 16, 16, 2]), and linear_packed_bf16 returns silu(gate) * up [M, I]
// from the sums in registers: no [M, 2 I] result to write and read back, no separate pass.
//
// Tiles: 0-3 sums (row tile i, column tile j -> tile 2 i + j, 16 x 16 float32 each), 4-5 rows of
// x (16 rows x 32 inputs), 6-7 the two column tiles of W: a 32 x 32 block of y per pass over K.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"
#include "team.h"
#include "vec_math.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LOOM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include "amx_tiles.h"
#endif

namespace {

constexpr int64_t kBlockN = 32;   // output columns per packed block (two column tiles)
constexpr int64_t kBlockK = 32;   // inputs per tile (a 64-byte tile row of bf16)
constexpr int64_t kTileRows = 16;
constexpr int64_t kBlockM = 2 * kTileRows;
// Prompt-sized inputs are walked in passes of kChunkM rows (256 x K of x stays in L2) over
// groups of column blocks of about kGroupBytes of W (which stay in L2 across the passes): each
// weight comes from memory once a call, and x from L2/L3 once per group.
constexpr int64_t kChunkM = 256;
constexpr int64_t kGroupBytes = 256 << 10;
constexpr int64_t kFetchXBytes = 128 << 10;
// On AMX, x of more than kLargeX bytes takes groups of kLargeGroupBytes (AMX Xeons have 2 MB of L2
// a core): the model's linears at 32,768 rows, 2 threads, 1 MB against 256 KB groups: qkv 1.24x,
// o 1.07x, gate_up 1.06x, down 1.30x; at 8,192 rows 1.02-1.06x, at 1,088 (x in L2) no gain.
constexpr int64_t kLargeX = 8 << 20;
constexpr int64_t kLargeGroupBytes = 1 << 20;
// Up to this many rows (two passes of kDotRows) groups stay one block, each fetched during the one
// before: doubling them asked the memory for two blocks in one block's short compute (decode steps
// of 4 / 8 / 12 / 16 rows 4.0 / 5.3 / 6.6 / 8.4-9.6% faster; at 24-32 rows no gain; AMD Zen 4).
constexpr int64_t kSingleBlockRows = 16;

#if defined(__AVX512BF16__)
// rows x 32 float32 sums -> y (bf16, round to nearest even as torch rounds).
inline void store_rows(const float* sums, int64_t rows, at::BFloat16* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_load_ps(sums + r * kBlockN), hi = _mm512_load_ps(sums + r * kBlockN + 16);
    _mm512_storeu_si512(y + r * ldy, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// rows x (16 gate | 16 up) float32 sums -> silu(gate) * up, 16 bf16 columns, rounded where the
// unfused ops round (the bf16 gate/up, silu, the product: fused_ops.cpp's silu_mul).
inline void store_silu_rows(const float* sums, int64_t rows, at::BFloat16* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 gate = loom::round_bf16(_mm512_load_ps(sums + r * kBlockN));
    const __m512 up = loom::round_bf16(_mm512_load_ps(sums + r * kBlockN + 16));
    const __m512 silu = loom::round_bf16(loom::silu16(gate));
    loom::store16_bf16(y + r * ldy, _mm512_mul_ps(silu, up));
  }
}

// rows x 32 float32 sums -> y as the linear gives it: the plain or the gated (silu) columns.
inline void store_block_rows(const float* sums, int64_t rows, bool gated, at::BFloat16* y, int64_t ldy) {
  if (gated)
    store_silu_rows(sums, rows, y, ldy);
  else
    store_rows(sums, rows, y, ldy);
}

// A finished block's sums still to be written to y: a few rows at a time between the next block's
// tile products (step), so the epilogue's vector work (the MLP's silu above all) runs beside the
// tiles instead of after them. Outputs identical; 2 threads on the AMX Xeon, the model's linears
// at 32 / 64 / 1,088 / 8,192 rows: 1.03-1.12x / 1.09-1.14x / 1.06-1.14x / 1.10-1.28x (the gated
// gate_up most), 1-7 rows unchanged.
struct PendingRows {
  const float* sums = nullptr;
  at::BFloat16* y = nullptr;
  int64_t ldy = 0, rows = 0, done = 0;
  bool gated = false;
  inline void step(int64_t count) {
    const int64_t stop = std::min(rows, done + count);
    store_block_rows(sums + done * kBlockN, stop - done, gated, y + done * ldy, ldy);
    done = stop;
  }
  inline void finish() { step(rows); }
};

// Fetches the next group of W into L2 a few lines per step of the current group's passes, so its
// first pass (from memory) overlaps the compute of the rows before it.
struct GroupPrefetch {
  const char* next;
  const char* end;
  int64_t lines_per_step;
  inline void step() {
    for (int64_t i = 0; i < lines_per_step && next < end; ++i, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

// One block of y without AMX: MR rows of x (row stride ldx) x 32 columns (packed block w) over
// all K, into sums [MR][32] float32. Each k pair's two 64-byte rows of the block (16 columns x 2
// inputs: the tiles' VNNI form) meet a broadcast pair of each row's x in vdpbf16ps: 2 MR sums in
// registers, no horizontal sums, W read once per MR rows.
template <int MR>
inline void dot_block(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t k, float* sums,
                      GroupPrefetch& prefetch) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < k / kBlockK; ++kb) {
    prefetch.step();
    const at::BFloat16* wk = w + kb * kBlockK * kBlockN;
    const at::BFloat16* xk = x + kb * kBlockK;
    for (int64_t p = 0; p < kTileRows; ++p) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk + p * kBlockK);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wk + (kTileRows + p) * kBlockK);
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        std::memcpy(&pair, xk + r * ldx + 2 * p, sizeof(pair));
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_store_ps(sums + r * kBlockN, acc[r][0]);
    _mm512_store_ps(sums + r * kBlockN + kTileRows, acc[r][1]);
  }
}

constexpr int kDotRows = 12;  // rows a dot_block holds: 24 sums + 2 W rows + a broadcast of 32 registers

template <int MR>
void dot_rows_upto(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t k, int64_t rows, float* sums,
                   GroupPrefetch& prefetch) {
  if constexpr (MR > 1) {
    if (rows < MR) return dot_rows_upto<MR - 1>(x, ldx, w, k, rows, sums, prefetch);
  }
  dot_block<MR>(x, ldx, w, k, sums, prefetch);
}
#endif

#if defined(LOOM_AMX)
// Linux hands out the AMX tile state only to a process that asks for it (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); without it the first tile instruction faults.
bool os_grants_amx() {
  static const bool granted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// Tiles for blocks of `rows` rows of x (1-32): the sums and x tiles as many rows as they hold.
void configure_tiles(int64_t rows) {
  const int first = static_cast<int>(std::min(rows, kTileRows)), second = static_cast<int>(rows - first);
  loom::configure_tiles({first, first, second, second, first, second, kTileRows, kTileRows});
}

// One block of y: RT row tiles (16 rows of x each, row stride ldx) x 32 columns (packed block w)
// over all K, into sums [RT * 16][32] float32; the pending block's rows are written meanwhile.
template <int RT>
inline void tile_block(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t k_blocks, float* sums,
                       PendingRows& pending, GroupPrefetch& prefetch) {
  const int64_t pending_step = (pending.rows - pending.done + k_blocks - 1) / k_blocks;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (RT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t x_stride = ldx * sizeof(at::BFloat16);
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    const at::BFloat16* wk = w + kb * kBlockK * kBlockN;
    _tile_loadd(6, wk, 64);
    _tile_loadd(7, wk + kTileRows * kBlockK, 64);
    _tile_loadd(4, x + kb * kBlockK, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT == 2) {
      _tile_loadd(5, x + kTileRows * ldx + kb * kBlockK, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    pending.step(pending_step);
    prefetch.step();
  }
  pending.finish();
  constexpr int64_t ld = kBlockN * sizeof(float);
  _tile_stored(0, sums, ld);
  _tile_stored(1, sums + kTileRows, ld);
  if constexpr (RT == 2) {
    _tile_stored(2, sums + kTileRows * kBlockN, ld);
    _tile_stored(3, sums + kTileRows * kBlockN + kTileRows, ld);
  }
}

// One block of y (rows of x x 32 columns of the packed block w) into the sums buffer the pending
// block does not hold; the pending one is written meanwhile, and this one is left pending.
void block_rows(const at::BFloat16* x, int64_t k, const at::BFloat16* w, int64_t rows, bool gated, at::BFloat16* y,
                int64_t n, float (*sums)[kBlockM * kBlockN], PendingRows& pending, GroupPrefetch& prefetch) {
  float* target = sums[pending.sums == sums[0] ? 1 : 0];
  if (rows > kTileRows)
    tile_block<2>(x, k, w, k / kBlockK, target, pending, prefetch);
  else
    tile_block<1>(x, k, w, k / kBlockK, target, pending, prefetch);
  pending = PendingRows{target, y, n, rows, 0, gated};
}

// Column blocks of W a group holds on AMX: ~kGroupBytes of bfloat16, kLargeGroupBytes where x
// passes kLargeX bytes (it then comes from L3 or memory once a group: larger groups, fewer passes).
int64_t amx_group_blocks(int64_t m, int64_t k) {
  const int64_t x_bytes = m * k * static_cast<int64_t>(sizeof(at::BFloat16));
  return std::max<int64_t>(1, (x_bytes > kLargeX ? kLargeGroupBytes : kGroupBytes) /
                                  (k * kBlockN * static_cast<int64_t>(sizeof(at::BFloat16))));
}

// Blocks [g0, g1) of packed W (block b at w + (b - g0) K 32) under all m rows of x into y [m, n]:
// full 32-row blocks in passes of kChunkM rows, then the last partial one (its own tile
// configuration), so W comes from memory (or from the caller's buffer) once a call at every row count.
void amx_group(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* w, int64_t g0, int64_t g1,
               bool gated, at::BFloat16* y, int64_t n, const at::BFloat16* fetch_begin = nullptr,
               const at::BFloat16* fetch_end = nullptr) {
  const int64_t block_cols = gated ? kTileRows : kBlockN, full_rows = m / kBlockM * kBlockM, tail = m - full_rows;
  const int64_t steps = ((full_rows / kBlockM) + (tail ? 1 : 0)) * (g1 - g0) * (k / kBlockK);
  const int64_t lines = fetch_begin ? (fetch_end - fetch_begin) * static_cast<int64_t>(sizeof(at::BFloat16)) / 64 : 0;
  GroupPrefetch prefetch{reinterpret_cast<const char*>(fetch_begin), reinterpret_cast<const char*>(fetch_end),
                         steps ? (lines + steps - 1) / steps : 0};
  const auto block_at = [&](int64_t b) { return w + (b - g0) * k * kBlockN; };
  alignas(64) float sums[2][kBlockM * kBlockN];
  PendingRows pending;
  if (full_rows) configure_tiles(kBlockM);
  for (int64_t r0 = 0; r0 < full_rows; r0 += kChunkM) {
    const int64_t r1 = std::min(full_rows, r0 + kChunkM);
    for (int64_t b = g0; b < g1; ++b)
      for (int64_t r = r0; r < r1; r += kBlockM)
        block_rows(x + r * k, k, block_at(b), kBlockM, gated, y + r * n + b * block_cols, n, sums, pending, prefetch);
  }
  if (tail) {
    configure_tiles(tail);
    for (int64_t b = g0; b < g1; ++b)
      block_rows(x + full_rows * k, k, block_at(b), tail, gated, y + full_rows * n + b * block_cols, n, sums, pending, prefetch);
  }
  pending.finish();
}

// This thread's buffer for widened panel blocks, 64-byte aligned for the tile loads.
at::BFloat16* widened_buffer(int64_t elements) {
  struct Buffer {
    void* data = nullptr;
    int64_t size = 0;
    ~Buffer() { std::free(data); }
  };
  thread_local Buffer buffer;
  if (elements > buffer.size) {
    std::free(buffer.data);
    buffer.data = std::aligned_alloc(64, (elements * static_cast<int64_t>(sizeof(at::BFloat16)) + 63) / 64 * 64);
    TORCH_CHECK(buffer.data, "out of memory for widened weights");
    buffer.size = elements;
  }
  return static_cast<at::BFloat16*>(buffer.data);
}
#endif

// Each thread walks its blocks a group at a time, then takes single blocks left in the others'
// shares. run(g0, g1, ahead): blocks [g0, g1), fetching blocks [g1, ahead) meanwhile; groups start
// at `size` blocks and double up to `group` (stay at `size` if not `grow`).
template <typename Run>
void claim_and_run(loom::BlockClaims& claims, int64_t size, int64_t group, bool grow, Run&& run) {
  const int t = omp_get_thread_num();
  int64_t g0, g1, end;
  for (bool more = claims.take_front(t, size, g0, g1, end); more;) {
    if (grow) size = std::min(group, 2 * size);
    run(g0, g1, std::min(end, g1 + size));
    more = claims.take_front(t, size, g0, g1, end);
  }
  for (int64_t b; claims.steal(t, b);) run(b, b + 1, b + 1);
}

}  // namespace

bool amx_bf16() {
#if defined(LOOM_AMX)
  return os_grants_amx();
#else
  return false;
#endif
}

int64_t packed_bf16_rows() {
#if defined(__AVX512BF16__)
  return std::numeric_limits<int64_t>::max();  // (AMX tiles, or vdpbf16ps without them)
#else
  return 0;
#endif
}

at::Tensor pack_dense_bf16(at::Tensor w, bool gated) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "w must be contiguous [N, K]");
  const int64_t n = w.size(0), k = w.size(1), half = n / 2;
  if (!packed_bf16_rows() || w.scalar_type() != at::kBFloat16 || n % kBlockN || k % kBlockK || n == 0 || k == 0 ||
      (gated && half % kTileRows))
    return at::empty({0}, w.options());
  auto out = at::empty({n / kBlockN, k / kBlockK, 2, kTileRows, kBlockK}, w.options());
  // W's row for column c of column tile t of block b
  const auto source_row = [&](int64_t b, int64_t t, int64_t c) {
    return gated ? t * half + b * kTileRows + c : b * kBlockN + t * kTileRows + c;
  };
  const at::BFloat16* src = w.data_ptr<at::BFloat16>();
  at::BFloat16* dst = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, n / kBlockN, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t kb = 0; kb < k / kBlockK; ++kb)
        for (int64_t t = 0; t < 2; ++t)
          for (int64_t p = 0; p < kTileRows; ++p)
            for (int64_t c = 0; c < kTileRows; ++c)
              for (int64_t e = 0; e < 2; ++e)
                dst[(((b * (k / kBlockK) + kb) * 2 + t) * kTileRows + p) * kBlockK + 2 * c + e] =
                    src[source_row(b, t, c) * k + kb * kBlockK + 2 * p + e];
  });
  return gated ? out.view({n / kBlockN, k / kBlockK, 2, kTileRows, kTileRows, 2}) : out;
}

at::Tensor linear_packed_bf16(at::Tensor x_in, at::Tensor packed) {
  const bool gated = packed.dim() == 6;
  const std::vector<int64_t> tile_row = gated ? std::vector<int64_t>{kTileRows, 2} : std::vector<int64_t>{kBlockK};
  TORCH_CHECK((packed.dim() == 5 || gated) && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == 2 && packed.size(3) == kTileRows && packed.sizes().slice(4) == at::IntArrayRef(tile_row),
              "packed must come from pack_dense_bf16");
  const int64_t k = packed.size(1) * kBlockK, n = packed_bf16_cols(packed);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k && x_in.scalar_type() == at::kBFloat16,
              "x must be bfloat16 [M, K] with the packed weights' K");
  TORCH_CHECK(packed_bf16_rows(), "linear_packed_bf16: this build has no bfloat16 products");
  auto x = x_in.contiguous();
  const int64_t m = x.size(0);
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  loom::BlockClaims claims;
  claims.reset(packed.size(0), at::get_num_threads());
#pragma omp parallel num_threads(at::get_num_threads())
  linear_packed_bf16_team(x.data_ptr<at::BFloat16>(), m, packed, out.data_ptr<at::BFloat16>(), claims);
  return out;
}

int64_t packed_bf16_cols(const at::Tensor& packed) {
  return packed.size(0) * (packed.dim() == 6 ? kTileRows : kBlockN);  // 16 gated columns a block, else 32
}

void linear_packed_bf16_team(const at::BFloat16* xp, int64_t m, const at::Tensor& packed, at::BFloat16* y,
                             loom::BlockClaims& claims) {
#if defined(__AVX512BF16__)
  const bool gated = packed.dim() == 6;
  const int64_t k = packed.size(1) * kBlockK, block_cols = gated ? kTileRows : kBlockN, n = packed_bf16_cols(packed);
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  const int64_t block_bytes = k * kBlockN * sizeof(at::BFloat16);
  const int64_t group = std::max<int64_t>(1, kGroupBytes / block_bytes);
#if defined(LOOM_AMX)
  if (amx_bf16()) {
    // Above kSingleBlockRows rows each group's successor is fetched into L2 during its passes (the
    // tiles' loads found its blocks in DRAM otherwise). The model's bfloat16 linears, 30 layers'
    // weights in turn, 2 threads, AMX Xeon, in turn in one process: 17 / 32 / 46 / 64 / 128 / 256 /
    // 474 rows 1.12x / 1.14x / 1.11x / 1.06x / 1.05x / 1.09x / 1.03x; 46-row decode steps 1.06x;
    // at 1 and 16 rows, where one tile row streams W, 0.93x and 0.96x (so none there).
    const bool fetch = m > kSingleBlockRows;
    claim_and_run(claims, amx_group_blocks(m, k), 0, false, [&](int64_t g0, int64_t g1, int64_t ahead) {
      amx_group(xp, m, k, wp + g0 * k * kBlockN, g0, g1, gated, y, n, fetch ? wp + g1 * k * kBlockN : nullptr,
                fetch ? wp + ahead * k * kBlockN : nullptr);
    });
    _tile_release();
    return;
  }
#endif
  // x of a decode-sized call (up to kFetchXBytes) fetched whole at the start: its rows were written
  // by the op before, half in the other threads' caches, and the first block's passes would wait
  // for them a line at a time (32-row decode steps 1.0% faster, 8-row 2.6%; AMD Zen 4)
  if (const int64_t x_bytes = m * k * static_cast<int64_t>(sizeof(at::BFloat16)); x_bytes <= kFetchXBytes)
    for (int64_t at = 0; at < x_bytes; at += 64) _mm_prefetch(reinterpret_cast<const char*>(xp) + at, _MM_HINT_T1);
  // (the first group's first pass reads W from memory unfetched: without AMX groups grow from
  // one block, 1, 2, 4, ... up to `group`, each fetched during the passes of the one before; up to
  // kSingleBlockRows rows they stay one block)
  claim_and_run(claims, 1, group, m > kSingleBlockRows, [&](int64_t g0, int64_t g1, int64_t ahead) {
    alignas(64) float sums[kDotRows * kBlockN];
    // A last row block of 1 to 3 rows holds 2 to 6 sums, fewer than vdpbf16ps's latency keeps
    // busy: with the full block before it, it runs as two of about equal size (12 + 1 as 7 + 6).
    // Decode steps (AMD Zen 4, interleaved A/B, outputs identical): 13 rows 1.34x, 14 rows 1.08x,
    // 25 rows 1.10x, 26 rows 1.05x, 37 rows 1.06x.
    const int64_t row_blocks = (m + kDotRows - 1) / kDotRows, steps = row_blocks * (g1 - g0) * (k / kBlockK);
    const int64_t lines = (ahead - g1) * block_bytes / 64;
    GroupPrefetch prefetch{reinterpret_cast<const char*>(wp + g1 * k * kBlockN),
                           reinterpret_cast<const char*>(wp + ahead * k * kBlockN), (lines + steps - 1) / steps};
    for (int64_t r = 0, rows; r < m; r += rows) {
      rows = loom::row_tile_at(r, m, kDotRows, kDotRows / 4);
      for (int64_t b = g0; b < g1; ++b) {
        dot_rows_upto<kDotRows>(xp + r * k, k, wp + b * k * kBlockN, k, rows, sums, prefetch);
        store_block_rows(sums, rows, gated, y + r * n + b * block_cols, n);
      }
    }
  });
#else
  TORCH_CHECK(false, "linear_packed_bf16: this build has no bfloat16 products");
#endif
}

// int8 / int4 panels on AMX: from this many rows of x the widened blocks' tile products beat the
// integer panels' vpdpbusd. The model's linears, 30 layers' weights in turn, 2 threads, AMX Xeon,
// ms for int8 / int4 (integer panels against AMX): 16 rows 13.1 / 12.8 against 16.2 / 14.4; 32
// rows 18.6 / 19.8 against 19.4 / 17.7; 64 rows 25.7 / 29.6 against 19.2 / 17.5; 1,088 rows
// 349 / 427 against 142 / 129 (bfloat16 weights 125).
constexpr int64_t kAmxPanelRows = 32;

int64_t amx_panel_rows() { return amx_bf16() ? kAmxPanelRows : 0; }

int64_t amx_panel_blocks(int64_t n, bool gated) { return gated ? n / 2 / kTileRows : n / kBlockN; }

// (gated: each half of [gate; up] then fills blocks of 16, two halves a block)
bool amx_panels_take(const at::Tensor& panels, int64_t n) {
  return amx_bf16() && panels.dim() == 3 && panels.size(0) * kBlockN >= n && n > 0 && n % kBlockN == 0;
}

void linear_panels_amx_team(const at::BFloat16* x, int64_t m, int64_t k, const at::Tensor& panels, int64_t n,
                            const float* scale, bool gated, at::BFloat16* y, loom::BlockClaims& claims) {
#if defined(LOOM_AMX)
  const auto* codes = static_cast<const uint8_t*>(panels.data_ptr());
  const int64_t groups = k / kBlockK, up_tiles = n / 2 / kTileRows, block = k * kBlockN;
  claim_and_run(claims, amx_group_blocks(m, k), 0, false, [&](int64_t g0, int64_t g1, int64_t) {
    at::BFloat16* w = widened_buffer((g1 - g0) * block);
    // block b's column tiles: features 32 b.. and 32 b + 16.., or where gated gate features 16 b..
    // and up features n / 2 + 16 b.. (each a tile of 16 features of the panels)
    for (int64_t b = g0; b < g1; ++b)
      for (int64_t t = 0; t < 2; ++t) {
        const int64_t tile = gated ? (t ? up_tiles + b : b) : 2 * b + t;
        at::BFloat16* dst = w + (b - g0) * block + t * kTileRows * kBlockK;
        if (scale)
          int8_panel_tile_bf16(codes, groups, scale, tile, dst, kBlockK * kBlockN);
        else
          int4_panel_tile_bf16(codes, groups, tile, dst, kBlockK * kBlockN);
      }
    amx_group(x, m, k, w, g0, g1, gated, y, gated ? n / 2 : n);
  });
  _tile_release();
#else
  TORCH_CHECK(false, "linear_panels_amx: this build has no AMX tiles");
#endif
}

at::Tensor linear_panels_amx(at::Tensor x_in, at::Tensor panels, int64_t n, std::optional<at::Tensor> scale,
                             bool gated) {
  TORCH_CHECK(amx_panels_take(panels, n), "linear_panels_amx: no AMX, or ", n, " outputs do not fill blocks of 32");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.size(1) == panels.size(1) * kBlockK,
              "linear_panels_amx: x must be bfloat16 [M, K] with the panels' K");
  TORCH_CHECK(!scale || (scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->numel() == n),
              "linear_panels_amx: int8 scale must be float32 [n]");
  // a group's bytes: int8 codes of 32 features x 32 inputs; int4 half as many, then float32 scales and mins
  TORCH_CHECK(panels.size(2) == (scale ? kBlockN * kBlockK : kBlockN * kBlockK / 2 + 2 * kBlockN * 4),
              "linear_panels_amx: int8 panels (pack_int8_panels) with a scale, int4 ones (pack_int4_panels) without");
  auto x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  auto out = at::empty({m, gated ? n / 2 : n}, x.options());
  if (m == 0) return out;
  loom::BlockClaims claims;
  claims.reset(amx_panel_blocks(n, gated), at::get_num_threads());
  const float* s = scale ? scale->data_ptr<float>() : nullptr;
#pragma omp parallel num_threads(at::get_num_threads())
  linear_panels_amx_team(x.data_ptr<at::BFloat16>(), m, k, panels, n, s, gated, out.data_ptr<at::BFloat16>(), claims);
  return out;
}
