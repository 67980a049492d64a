// int4 (W4A8) and int6 (W6A8, Q6_K) weight products on Intel AMX-INT8 tiles, for calls of several
// rows: the operands of int4.cpp's and int6.cpp's AVX2 kernels (their packed layouts, their int8
// activations) and bitwise their results, so a call may take either kernel by its row count.
// TDPBSUD forms each group's integer dot product exactly; the float chain per group and output is
// the AVX2 kernel's, in the same order. A pass computes up to 16 rows against 16 columns (two of
// the AVX2 layouts' 8-column blocks), software-pipelined over a ring of groups: a group is
// unpacked kAhead groups before the tiles load it and its sums are read kAhead groups after the
// tiles stored them, so no load waits on the stores just before it (one group at a time was
// latency-bound, ~60% slower). The thread's tile configuration is saved and restored around a call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <utility>

#include "amx.h"
#include "ops.h"

#define TL_AMX8 __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

namespace {

using tokenleap_amx::TileConfig;

std::atomic<int64_t> g_rows{0};  // products of at least this many rows take the tiles (0: none)
constexpr int64_t kRing = 4, kAhead = 2;

// Two tile sets (0-2, 3-5) of: activations [rows, k_bytes], weights [k_bytes / 4 VNNI rows, 16 x 4
// bytes], int32 sums [rows, 16].
TL_AMX8 void configure_sets(int rows, int k_bytes) {
  TileConfig c;
  for (int t : {0, 3}) c.rows[t] = rows, c.colsb[t] = k_bytes;
  for (int t : {1, 4}) c.rows[t] = k_bytes / 4, c.colsb[t] = 64;
  for (int t : {2, 5}) c.rows[t] = rows, c.colsb[t] = 64;
  TL_LOAD_TILE_CONFIG(c);
}

// ---- int4 (W4A8) -------------------------------------------------------------------------
// The same operands as int4.cpp's AVX2 kernel (its packed layout, its int8 activations, scales and
// group sums) and the same values: TDPBSUD forms each 32-input group's integer dot product exactly
// (|sum| <= 32 * 127 * 15), and the float chain per group and output is int4.cpp's -- one multiply
// and two FMAs in ascending group order -- so a row's outputs are bitwise those of the AVX2 kernel,
// whichever kernel a call takes. Tiles (two sets, 0-2 and 3-5): up to 16 rows of activations (one
// group: 32 bytes a row), the weights of 16 columns (two AVX2 column blocks) in VNNI order (8 rows
// of 16 x 4 bytes), the int32 dot products [rows, 16].
TL_AMX8 void configure_int4(int rows) { configure_sets(rows, 32); }

// 32 bytes at a then 32 at b
TL_AMX8 inline __m512i pair256(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

// 8 float16 at a then 8 at b -> 16 floats
TL_AMX8 inline __m512 halves(const uint16_t* a, const uint16_t* b) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}

// One group's weights of the column pair into VNNI rows at bt (8 x 64 bytes) and its scales and mins.
TL_AMX8 inline void unpack_group(const uint8_t* p0, const uint8_t* p1, const uint16_t* s0, const uint16_t* s1,
                                 uint8_t* bt, __m512& sc, __m512& mn) {
  const __m512i mask = _mm512_set1_epi8(0x0f);
  for (int l = 0; l < 128; l += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p0) + 2048 + l, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p1) + 2048 + l, _MM_HINT_T0);
  }
  for (int st = 0; st < 4; ++st) {
    const __m512i v = pair256(p0 + st * 32, p1 + st * 32);
    _mm512_store_si512(bt + 2 * st * 64, _mm512_and_si512(v, mask));
    _mm512_store_si512(bt + (2 * st + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
  }
  sc = halves(s0, s1);
  mn = halves(s0 + 8, s1 + 8);
}

// int4.cpp's float chain for one group: acc[m] += d * (sc * a[m]) then += mn * as[m].
template <int MR>
TL_AMX8 inline void finish_group(const int32_t* ct, __m512 sc, __m512 mn, const float* a, const float* as,
                                 int64_t G, int64_t g, __m512* acc) {
  for (int m = 0; m < MR; ++m) {
    const __m512 d = _mm512_cvtepi32_ps(_mm512_load_si512(ct + m * 16));
    acc[m] = _mm512_fmadd_ps(d, _mm512_mul_ps(sc, _mm512_set1_ps(a[m * G + g])), acc[m]);
    acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(as[m * G + g]), acc[m]);
  }
}

// One group's tile work on tile set 0-2 (odd: 3-5); the tile intrinsics take literal tile numbers.
TL_AMX8 inline void group_tiles(bool odd, const int8_t* xq, int64_t K, int64_t g, const uint8_t* bt, int32_t* ct) {
  if (odd) {
    _tile_loadd(4, bt, 64);
    _tile_loadd(3, xq + g * 32, K);
    _tile_zero(5);
    _tile_dpbsud(5, 3, 4);
    _tile_stored(5, ct, 64);
  } else {
    _tile_loadd(1, bt, 64);
    _tile_loadd(0, xq + g * 32, K);
    _tile_zero(2);
    _tile_dpbsud(2, 0, 1);
    _tile_stored(2, ct, 64);
  }
}

// Rows [0, MR) of xq (row stride K) times the 16 columns of one pair of int4.cpp's column blocks at
// w0 / s0: group g of the pair's first block at w0 + 256 g, of its second 128 bytes on (scales and
// mins: s0 + 32 g, 16 halves on). In that layout a block's group is 4 k-steps of [8 columns][4
// bytes]; the low nibbles of k-step s are inputs 8s..8s+3 and the high ones 8s+4..8s+7 -- VNNI
// rows 2s and 2s + 1 for 8 columns. Consecutive groups alternate between tiles 0-2 and 3-5.
template <int MR>
TL_AMX8 void int4_pass(const int8_t* xq, const float* a, const float* as, int64_t K, const uint8_t* w0,
                       const uint16_t* s0, float* y, int64_t ldy) {
  const int64_t G = K / 32;
  const uint8_t* w1 = w0 + 128;
  const uint16_t* s1 = s0 + 16;
  alignas(64) uint8_t bt[kRing][512];
  alignas(64) int32_t ct[kRing][16 * 16];
  __m512 sc[kRing], mn[kRing];
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t u = 0; u < std::min(kAhead, G); ++u)
    unpack_group(w0 + u * 256, w1 + u * 256, s0 + u * 32, s1 + u * 32, bt[u], sc[u], mn[u]);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t f = g - kAhead, u = g + kAhead;
    if (f >= 0) finish_group<MR>(ct[f % kRing], sc[f % kRing], mn[f % kRing], a, as, G, f, acc);
    if (u < G)  // into the ring slot group f just left
      unpack_group(w0 + u * 256, w1 + u * 256, s0 + u * 32, s1 + u * 32, bt[u % kRing], sc[u % kRing], mn[u % kRing]);
    group_tiles(g & 1, xq, K, g, bt[g % kRing], ct[g % kRing]);
  }
  for (int64_t f = std::max<int64_t>(0, G - kAhead); f < G; ++f)
    finish_group<MR>(ct[f % kRing], sc[f % kRing], mn[f % kRing], a, as, G, f, acc);
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y + m * ldy, acc[m]);
}

using Int4Pass = void (*)(const int8_t*, const float*, const float*, int64_t, const uint8_t*, const uint16_t*,
                          float*, int64_t);

template <int... R>
constexpr std::array<Int4Pass, sizeof...(R)> int4_passes(std::integer_sequence<int, R...>) {
  return {&int4_pass<R + 1>...};
}

// ---- int6 (W6A8: a GGUF's Q6_K) ----------------------------------------------------------
// Per 16 inputs h of group g: dot = sum q xq - 32 sum xq (exact), acc += float(dot) * (d sc_h * a[g])
// as int6.cpp computes it. Each half of a group is one TDPBSUD of 16 inputs; halves 0 and 1 take
// tile sets 0-2 and 3-5 (activations: 16 bytes a row; weights: 4 VNNI rows of 16 x 4 bytes).
constexpr int64_t kInt6GroupBytes = 208;

TL_AMX8 void configure_int6(int rows) { configure_sets(rows, 16); }

TL_AMX8 inline __m512 floats8x2(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}

// One group of the column pair (int6.cpp's layout at p0, p1) -> bt: half h's 4 VNNI rows at
// bt + 256 h, and each half's d * sc (16 floats; dv: the 16 columns' d of this super-block).
TL_AMX8 inline void unpack_int6(const uint8_t* p0, const uint8_t* p1, __m512 dv, uint8_t* bt, __m512* sc) {
  const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(0x30);
  for (int l = 0; l < 256; l += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p0) + 2048 + l, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p1) + 2048 + l, _MM_HINT_T0);
  }
  for (int h = 0; h < 2; ++h) {
    const __m512i hb = pair256(p0 + 128 + h * 32, p1 + 128 + h * 32);
    for (int half = 0; half < 2; ++half) {  // k-step 2h + half: VNNI rows 2 half (low nibbles), 2 half + 1
      const int st = 2 * h + half;
      const __m512i v = pair256(p0 + st * 32, p1 + st * 32);
      const __m512i top_lo = half == 0 ? _mm512_and_si512(_mm512_slli_epi16(hb, 4), m2) : _mm512_and_si512(hb, m2);
      const __m512i top_hi = half == 0 ? _mm512_and_si512(_mm512_slli_epi16(hb, 2), m2)
                                       : _mm512_and_si512(_mm512_srli_epi16(hb, 2), m2);
      _mm512_store_si512(bt + h * 256 + 2 * half * 64, _mm512_or_si512(_mm512_and_si512(v, m4), top_lo));
      _mm512_store_si512(bt + h * 256 + (2 * half + 1) * 64,
                         _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), top_hi));
    }
    const __m128i sc8 = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0 + 192 + h * 8)),
                                           _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1 + 192 + h * 8)));
    sc[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)), dv);  // d * sc, exact
  }
}

TL_AMX8 inline void int6_tiles(const int8_t* xq, int64_t K, int64_t g, const uint8_t* bt, int32_t* ct) {
  _tile_loadd(1, bt, 64);
  _tile_loadd(0, xq + g * 32, K);
  _tile_zero(2);
  _tile_dpbsud(2, 0, 1);
  _tile_loadd(4, bt + 256, 64);
  _tile_loadd(3, xq + g * 32 + 16, K);
  _tile_zero(5);
  _tile_dpbsud(5, 3, 4);
  _tile_stored(2, ct, 64);
  _tile_stored(5, ct + 256, 64);
}

template <int MR>
TL_AMX8 inline void finish_int6(const int32_t* ct, const __m512* sc, const float* a, const int32_t* sum16,
                                int64_t G, int64_t g, __m512* acc) {
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MR; ++m) {
      const __m512i dot = _mm512_sub_epi32(_mm512_load_si512(ct + h * 256 + m * 16),
                                           _mm512_set1_epi32(32 * sum16[m * 2 * G + 2 * g + h]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sc[h], _mm512_set1_ps(a[m * G + g])), acc[m]);
    }
}

// Rows [0, MR) of xq times the 16 columns of int6.cpp's blocks at w0 and w1, d at d0 and d1: a block's
// groups gs bytes apart, its super-blocks' d ds floats apart (blocked layout: 208 and 8; paired: 416
// and 16).
template <int MR>
TL_AMX8 void int6_pass(const int8_t* xq, const float* a, const int32_t* sum16, int64_t K, const uint8_t* w0,
                       const uint8_t* w1, const float* d0, const float* d1, int64_t gs, int64_t ds, float* y,
                       int64_t ldy) {
  const int64_t G = K / 32;
  alignas(64) uint8_t bt[kRing][512];
  alignas(64) int32_t ct[kRing][2 * 16 * 16];
  __m512 sc[kRing][2];
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = -kAhead; g < G; ++g) {
    const int64_t f = g - kAhead, u = g + kAhead;
    if (f >= 0) finish_int6<MR>(ct[f % kRing], sc[f % kRing], a, sum16, G, f, acc);
    if (u < G)
      unpack_int6(w0 + u * gs, w1 + u * gs, floats8x2(d0 + u / 8 * ds, d1 + u / 8 * ds), bt[u % kRing], sc[u % kRing]);
    if (g >= 0) int6_tiles(xq, K, g, bt[g % kRing], ct[g % kRing]);
  }
  for (int64_t f = std::max<int64_t>(0, G - kAhead); f < G; ++f)
    finish_int6<MR>(ct[f % kRing], sc[f % kRing], a, sum16, G, f, acc);
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y + m * ldy, acc[m]);
}

using Int6Pass = void (*)(const int8_t*, const float*, const int32_t*, int64_t, const uint8_t*, const uint8_t*,
                          const float*, const float*, int64_t, int64_t, float*, int64_t);

template <int... R>
constexpr std::array<Int6Pass, sizeof...(R)> int6_passes(std::integer_sequence<int, R...>) {
  return {&int6_pass<R + 1>...};
}

}  // namespace

namespace tokenleap_ops {

bool amx_int8_takes(int64_t rows, int64_t cols) {
  const int64_t from = g_rows.load(std::memory_order_relaxed);
  return from > 0 && rows >= from && cols % 16 == 0;  // a pass covers 16 columns
}

void int4_amx_product(const int8_t* xq, const float* a, const float* as, int64_t M, int64_t K,
                      const uint8_t* packed, const uint16_t* sm, float* y, int64_t N) {
  static constexpr auto passes = int4_passes(std::make_integer_sequence<int, 16>{});
  const int64_t G = K / 32;
  at::parallel_for(0, N / 16, 4, [&](int64_t j0, int64_t j1) {
    tokenleap_amx::column_pairs(M, j0, j1, configure_int4, [&](int64_t j, int64_t m0, int mr) {
      passes[mr - 1](xq + m0 * K, a + m0 * G, as + m0 * G, K, packed + 2 * j * K * 4, sm + 2 * j * G * 16,
                     y + m0 * N + j * 16, N);
    });
  });
}

void int6_amx_product(const int8_t* xq, const float* a, const int32_t* sum16, int64_t M, int64_t K,
                      const uint8_t* packed, const float* d, float* y, int64_t N, bool paired) {
  static constexpr auto passes = int6_passes(std::make_integer_sequence<int, 16>{});
  const int64_t G = K / 32, block = G * kInt6GroupBytes, dblock = K / 256 * 8;
  // the pair's second block: a whole block on (blocked layout) or one group on (paired)
  const int64_t w_next = paired ? kInt6GroupBytes : block, d_next = paired ? 8 : dblock;
  const int64_t gs = paired ? 2 * kInt6GroupBytes : kInt6GroupBytes, ds = paired ? 16 : 8;
  at::parallel_for(0, N / 16, 4, [&](int64_t j0, int64_t j1) {
    tokenleap_amx::column_pairs(M, j0, j1, configure_int6, [&](int64_t j, int64_t m0, int mr) {
      const uint8_t* w0 = packed + 2 * j * block;
      const float* d0 = d + 2 * j * dblock;
      passes[mr - 1](xq + m0 * K, a + m0 * G, sum16 + m0 * 2 * G, K, w0, w0 + w_next, d0, d0 + d_next, gs, ds,
                     y + m0 * N + j * 16, N);
    });
  });
}

}  // namespace tokenleap_ops

TORCH_LIBRARY_FRAGMENT(tokenleap, m) {
  // int4 / int6 products of at least ``rows`` rows take the tiles (0: none); returns the previous setting
  m.def("amx_int8_rows(int rows) -> int", [](int64_t rows) -> int64_t {
    TORCH_CHECK(rows <= 0 || tokenleap_amx::permitted(), "amx_int8_rows: AMX tiles are not available to this process");
    return g_rows.exchange(std::max<int64_t>(0, rows));
  });
}
