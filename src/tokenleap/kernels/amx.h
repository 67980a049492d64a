// What the AMX kernels share (amx.cpp: bf16 products; amx_int.cpp: int4 / int6 products on AMX-INT8).
#pragma once
#include <sys/syscall.h>
#include <unistd.h>

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
