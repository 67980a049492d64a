// What the AMX kernels share (amx.cpp: bf16 products; amx_int.cpp: int4 / int6 products on AMX-INT8).
#pragma once
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

namespace tokenleap_amx {

// Linux grants the tile state per process on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
inline bool permitted() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

// LDTILECFG's 64-byte operand: palette 1, then per tile its bytes a row and its rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace tokenleap_amx

// Load a configuration the compiler wrote: GCC's _tile_loadconfig declares that it reads only the
// first 8 bytes, so without the barrier the stores of the rows and column widths may be dropped
// as dead (seen: a configuration of palette 1 and no tiles, then #UD at the first tile load).
#define TL_LOAD_TILE_CONFIG(cfg)                                    \
  do {                                                              \
    __asm__ __volatile__("" : : "r"(&(cfg)) : "memory");            \
    _tile_loadconfig(&(cfg));                                       \
  } while (0)

namespace tokenleap_amx {

// Keeps the thread's tile configuration across a kernel call: saved on construction, restored (or
// the tiles released, where none was loaded) on destruction -- so other AMX code on the same
// threads (oneDNN, say) that keeps its configuration loaded between its calls finds it as it was.
class SavedTileConfig {
 public:
  __attribute__((target("amx-tile"))) SavedTileConfig() {
    __asm__ __volatile__("" : : "r"(&saved_) : "memory");  // (STTILECFG, too, declares 8 bytes)
    _tile_storeconfig(&saved_);
    __asm__ __volatile__("" : : "r"(&saved_) : "memory");
  }
  __attribute__((target("amx-tile"))) ~SavedTileConfig() {
    if (saved_.palette != 0)
      TL_LOAD_TILE_CONFIG(saved_);
    else
      _tile_release();
  }
  SavedTileConfig(const SavedTileConfig&) = delete;
  SavedTileConfig& operator=(const SavedTileConfig&) = delete;

 private:
  TileConfig saved_;
};

// Runs pass(j, m0, rows) for column pairs [j0, j1) and every 16 rows, configuring the tiles by
// configure(rows) when the row count changes; the thread's configuration is kept (SavedTileConfig).
template <typename Configure, typename Pass>
__attribute__((target("amx-tile"))) void column_pairs(int64_t M, int64_t j0, int64_t j1, Configure configure,
                                                       Pass pass) {
  SavedTileConfig keep;
  int cfg = -1;
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int mr = static_cast<int>(std::min<int64_t>(16, M - m0));
      if (mr != cfg) configure(mr), cfg = mr;
      pass(j, m0, mr);
    }
}

}  // namespace tokenleap_amx
