// bf16 weight products on Intel AMX tiles (Sapphire Rapids and later): any number of rows at about
// the cost of streaming the weights once.
//
// The activations are rounded to bfloat16 (round to nearest even) and multiplied with the bf16
// weights by TDPBF16PS, which sums in float32. A row's outputs depend only on that row, its weights
// and the fixed order over K (32 inputs an instruction, tile after tile), never on how many rows the
// call holds or where the row sits in it: row-invariant, so verification, batching and prefill all
// compute plain decoding's values. The weights are packed as the B operand wants them:
// [N/16, K/32, 16, 16, 2] -- per 16 outputs and 32 inputs, 16 rows of (input pair) x 16 outputs.
//
// int4 (W4A8) products of several rows run here too, on AMX-INT8 tiles, bitwise as int4.cpp computes them.
//
// Compiled for AVX2 machines too (function target attributes); ``amx_init`` asks Linux for the
// tile state and tells the caller whether these kernels may run.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <utility>

#include "ops.h"

#define TL_AMX __attribute__((target("amx-tile,amx-bf16,avx512f")))

namespace {

constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: request a dynamically enabled feature
constexpr long kXfeatureXtiledata = 18;

bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 accumulate rows [m0, m0 + ma) for column blocks j, j + 1; 2, 3 rows [m0 + 16, + mb);
// 4, 5 hold those rows' activations, 6, 7 the two weight blocks.
TL_AMX void configure(int ma, int mb) {
  TileConfig c;
  for (int t : {0, 1, 4}) c.rows[t] = ma, c.colsb[t] = 64;
  if (mb > 0)
    for (int t : {2, 3, 5}) c.rows[t] = mb, c.colsb[t] = 64;
  for (int t : {6, 7}) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// Software prefetch distance in 1 KB weight tiles. A/B of a one-row 1536x8960 call over the AVX2
// kernel's in the same run (bench_kernels.py, two rounds): none 1.11 / 0.77, 4 tiles 0.84 / 0.81,
// 8 tiles 0.93 / 0.89, 16 tiles 0.85 / 0.89 -- within the noise of the machine measured.
constexpr int64_t kPrefetchTiles = 4;

// Rows [m0, m0 + 16 + mb) (mb > 0: two row groups) or [m0, m0 + ma) times NB (1 or 2) column
// blocks starting at block j; y [M, N] float32.
template <int NB, bool kTwo>
TL_AMX void tile_pass(const uint16_t* xb, int64_t K, const uint16_t* w, int64_t m0, int64_t j,
                      float* y, int64_t N) {
  const int64_t xs = K * 2, kb = K / 32;
  const uint16_t* w0 = w + j * 16 * K;
  const uint16_t* w1 = w0 + 16 * K;
  const uint16_t* xa = xb + m0 * K;
  const uint16_t* xc = xa + 16 * K;
  _tile_zero(0);
  if (NB == 2) _tile_zero(1);
  if (kTwo) {
    _tile_zero(2);
    if (NB == 2) _tile_zero(3);
  }
  for (int64_t k = 0; k < kb; ++k) {
    if (k + kPrefetchTiles < kb) {  // every line of the weight tiles kPrefetchTiles ahead
      const char* p0 = reinterpret_cast<const char*>(w0 + (k + kPrefetchTiles) * 512);
      const char* p1 = reinterpret_cast<const char*>(w1 + (k + kPrefetchTiles) * 512);
      for (int l = 0; l < 1024; l += 64) {
        _mm_prefetch(p0 + l, _MM_HINT_T0);
        if (NB == 2) _mm_prefetch(p1 + l, _MM_HINT_T0);
      }
    }
    _tile_loadd(4, xa + k * 32, xs);
    _tile_loadd(6, w0 + k * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (kTwo) {
      _tile_loadd(5, xc + k * 32, xs);
      _tile_dpbf16ps(2, 5, 6);
    }
    if (NB == 2) {
      _tile_loadd(7, w1 + k * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (kTwo) _tile_dpbf16ps(3, 5, 7);
    }
  }
  float* out = y + m0 * N + j * 16;
  _tile_stored(0, out, N * 4);
  if (NB == 2) _tile_stored(1, out + 16, N * 4);
  if (kTwo) {
    _tile_stored(2, out + 16 * N, N * 4);
    if (NB == 2) _tile_stored(3, out + 16 * N + 16, N * 4);
  }
}

// Column blocks [j0, j1) (pairs, then a last single block) for every row, 32 rows at a time: a
// pair of weight blocks is read from memory once and from L2 for the later row groups.
// The thread's tile configuration is saved first and restored last, so other AMX code on the same
// threads (oneDNN, say) that keeps its configuration loaded between its calls finds it as it was.
TL_AMX void column_blocks(const uint16_t* xb, int64_t M, int64_t K, const uint16_t* w, int64_t j0,
                          int64_t j1, float* y, int64_t N) {
  TileConfig saved;
  _tile_storeconfig(&saved);
  int cfg_a = -1, cfg_b = -1;
  for (int64_t j = j0; j < j1; j += 2) {
    const bool pair = j + 1 < j1;
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
      const int ma = static_cast<int>(std::min<int64_t>(16, M - m0));
      const int mb = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, M - m0 - 16)));
      if (ma != cfg_a || mb != cfg_b) configure(ma, mb), cfg_a = ma, cfg_b = mb;
      if (mb > 0)
        pair ? tile_pass<2, true>(xb, K, w, m0, j, y, N) : tile_pass<1, true>(xb, K, w, m0, j, y, N);
      else
        pair ? tile_pass<2, false>(xb, K, w, m0, j, y, N) : tile_pass<1, false>(xb, K, w, m0, j, y, N);
    }
  }
  if (saved.palette != 0)
    _tile_loadconfig(&saved);
  else
    _tile_release();
}


// ---- int4 (W4A8) products on AMX-INT8 tiles -------------------------------------------------
// The same operands as int4.cpp's AVX2 kernel (its packed layout, its int8 activations, scales and
// group sums) and the same values: TDPBSUD forms each 32-input group's integer dot product exactly
// (|sum| <= 32 * 127 * 15), and the float chain per group and output is int4.cpp's -- one multiply
// and two FMAs in ascending group order -- so a row's outputs are bitwise those of the AVX2 kernel,
// whichever kernel a call takes. Tiles (two sets, 0-2 and 3-5): up to 16 rows of activations (one
// group: 32 bytes a row), the weights of 16 columns (two AVX2 column blocks) in VNNI order (8 rows
// of 16 x 4 bytes), the int32 dot products [rows, 16].
#define TL_AMX8 __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

std::atomic<int64_t> g_int4_rows{0};  // int4 products of at least this many rows take the tiles (0: none)

TL_AMX8 void configure_int4(int rows) {
  TileConfig c;
  for (int t : {0, 3}) c.rows[t] = rows, c.colsb[t] = 32;
  for (int t : {1, 4}) c.rows[t] = 8, c.colsb[t] = 64;
  for (int t : {2, 5}) c.rows[t] = rows, c.colsb[t] = 64;
  _tile_loadconfig(&c);
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
    const __m512i v = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0 + st * 32))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1 + st * 32)), 1);
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

// Rows [0, MR) of xq (row stride K) times the 16 columns of AVX2 blocks w0 and w0 + K * 4 bytes.
// In the AVX2 layout a group is 4 k-steps of [8 columns][4 bytes]; the low nibbles of k-step s
// are inputs 8s..8s+3 and the high ones 8s+4..8s+7 -- VNNI rows 2s and 2s + 1 for 8 columns.
// Software-pipelined over a ring of kRing groups: a group is unpacked kAhead groups before its
// tiles load it, and its sums are read kAhead groups after the tiles stored them, so no load waits
// on the stores just before it; consecutive groups alternate between tiles 0-2 and 3-5.
constexpr int64_t kRing = 4, kAhead = 2;

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

template <int MR>
TL_AMX8 void int4_pass(const int8_t* xq, const float* a, const float* as, int64_t K, const uint8_t* w0,
                       const uint16_t* s0, float* y, int64_t ldy) {
  const int64_t G = K / 32;
  const uint8_t* w1 = w0 + K * 4;
  const uint16_t* s1 = s0 + G * 16;
  alignas(64) uint8_t bt[kRing][512];
  alignas(64) int32_t ct[kRing][16 * 16];
  __m512 sc[kRing], mn[kRing];
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t u = 0; u < std::min(kAhead, G); ++u)
    unpack_group(w0 + u * 128, w1 + u * 128, s0 + u * 16, s1 + u * 16, bt[u], sc[u], mn[u]);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t f = g - kAhead, u = g + kAhead;
    if (f >= 0) finish_group<MR>(ct[f % kRing], sc[f % kRing], mn[f % kRing], a, as, G, f, acc);
    if (u < G)  // into the ring slot group f just left
      unpack_group(w0 + u * 128, w1 + u * 128, s0 + u * 16, s1 + u * 16, bt[u % kRing], sc[u % kRing], mn[u % kRing]);
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

// Column pairs [j0, j1) for every row, 16 rows a pass (the thread's tile configuration kept, as above).
TL_AMX8 void int4_pairs(const int8_t* xq, const float* a, const float* as, int64_t M, int64_t K,
                        const uint8_t* w, const uint16_t* s, int64_t j0, int64_t j1, float* y, int64_t N) {
  static constexpr auto passes = int4_passes(std::make_integer_sequence<int, 16>{});
  const int64_t G = K / 32;
  TileConfig saved;
  _tile_storeconfig(&saved);
  int cfg = -1;
  for (int64_t j = j0; j < j1; ++j) {
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int mr = static_cast<int>(std::min<int64_t>(16, M - m0));
      if (mr != cfg) configure_int4(mr), cfg = mr;
      passes[mr - 1](xq + m0 * K, a + m0 * G, as + m0 * G, K, w + 2 * j * K * 4, s + 2 * j * G * 16,
                     y + m0 * N + j * 16, N);
    }
  }
  if (saved.palette != 0)
    _tile_loadconfig(&saved);
  else
    _tile_release();
}

}  // namespace

namespace tokenleap_ops {

// x float32 [M, K] @ W.T, W bfloat16 [N, K] packed [N/16, K/32, 16, 16, 2] -> float32 [M, N].
at::Tensor bf16_amx_product(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(amx_permitted(), "bf16_amx_linear: AMX tiles are not available to this process");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "bf16_amx_linear: x must be float32 [M, K]");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == 16 && packed.size(4) == 2,
              "bf16_amx_linear: packed must be contiguous bfloat16 [N/16, K/32, 16, 16, 2]");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), N = NB * 16;
  TORCH_CHECK(packed.size(1) * 32 == K, "bf16_amx_linear: x has ", K, " inputs, the weights ", packed.size(1) * 32);
  const at::Tensor xb = x.contiguous().to(at::kBFloat16);  // [M, K], round to nearest even
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* yp = y.data_ptr<float>();
  // units of two column blocks (a thread's blocks are one stretch of memory, read in order)
  at::parallel_for(0, (NB + 1) / 2, 4, [&](int64_t u0, int64_t u1) {
    column_blocks(xp, M, K, wp, 2 * u0, std::min(NB, 2 * u1), yp, N);
  });
  return y;
}


bool int4_amx_takes(int64_t rows) {
  const int64_t from = g_int4_rows.load(std::memory_order_relaxed);
  return from > 0 && rows >= from;
}

void int4_amx_product(const int8_t* xq, const float* a, const float* as, int64_t M, int64_t K,
                      const uint8_t* packed, const uint16_t* sm, float* y, int64_t N) {
  at::parallel_for(0, N / 16, 4, [&](int64_t j0, int64_t j1) { int4_pairs(xq, a, as, M, K, packed, sm, j0, j1, y, N); });
}

}  // namespace tokenleap_ops

namespace {
at::Tensor bf16_amx_linear(const at::Tensor& x, const at::Tensor& packed) {
  return tokenleap_ops::bf16_amx_product(x, packed);
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenleap, m) {
  m.def("bf16_amx_linear(Tensor x, Tensor packed) -> Tensor");
  m.def("amx_init() -> bool", &amx_permitted);
  // int4 products of at least ``rows`` rows take the tiles (0: none); returns the previous setting
  m.def("int4_amx_rows(int rows) -> int", [](int64_t rows) -> int64_t {
    TORCH_CHECK(rows <= 0 || amx_permitted(), "int4_amx_rows: AMX tiles are not available to this process");
    return g_int4_rows.exchange(std::max<int64_t>(0, rows));
  });
}
TORCH_LIBRARY_IMPL(tokenleap, CPU, m) {
  m.impl("bf16_amx_linear", &bf16_amx_linear);
}
