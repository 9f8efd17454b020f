// AMX tile configuration shared by the kernels that use tiles (amx_linear.cpp, paged_attention.cpp).
// Included only where the build targets AMX (__AMX_TILE__ and __AMX_BF16__).
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace loom {

// Palette 1: tile t is rows[t] rows of colsb[t] bytes (at most 16 x 64); unused tiles stay 0 x 0.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 as rows[t] rows of 64 bytes (0: unused), for this thread.
inline void configure_tiles(const int (&rows)[8]) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows[t]);
    cfg.colsb[t] = rows[t] ? 64 : 0;
  }
  // (GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes, which let it drop the stores above)
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

}  // namespace loom
