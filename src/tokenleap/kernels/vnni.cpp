// tokenleap CPU kernels: int4.cpp's and int6.cpp's register tiles on AVX-512 VNNI (vpdpbusd),
// bitwise their results.
//
// int4.cpp's AVX2 tile multiplies 4-bit weights by int8 activations with vpmaddubsw / vpaddw /
// vpmaddwd: 2.5 instructions per 32 products. vpdpbusd does 64 unsigned-by-signed byte products
// and their int32 sums in one, so a tile of several rows (a verification step) costs far fewer
// instructions, which is what limits it once the weights stream from memory for all rows at once.
//
// Same operands, same results. int4: the tile takes both column blocks of one pair of int4.cpp's
// paired layout (16 outputs), whose groups alternate in memory, so it reads one forward stream. Its
// k-steps are regrouped into 16-column vectors, so each row's activations are broadcast operands of
// vpdpbusd and the float work is 512 bits wide. Every integer sum is exact (no saturation: AVX2's
// int16 pairs never overflow either), so each column's group sum equals the AVX2 tile's; the float
// work after it is the same multiply and two FMAs per column in the same order, so y is bitwise
// equal, at every row count.
// int6: one 64-byte load holds two k-steps (2 x 32 bytes) of one column block, so its lower 256 bits
// are multiplied by the activations of the first step and its upper 256 bits by those of the second
// (a vpermd of the group's 32 activation bytes), their top bits one 32-byte load shifted per half as
// int6.cpp shifts them, and the two halves' int32 sums are added at the end of the half-group. From
// kPairMinRows rows on, two adjacent column blocks are multiplied together as int4's are.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "ops.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#include <immintrin.h>

namespace {

constexpr int64_t kGroup = 32, kSuper = 256, kInt6GroupBytes = 208;
// 4 activation bytes read as one int32 at any address (an aliasing, unaligned load)
typedef int32_t Dword __attribute__((may_alias, aligned(1)));
// From this many rows on, int6 products take the two-block tile (int6_pair_tile), and from one row
// fewer where the rows are long (kPairLongK inputs or more): fewer instructions a row, but two
// blocks' weights streamed at once from two places (int6.cpp's layout keeps a block's groups
// together) and regrouped per group, which did not pay back at 1-2 rows (memory-bound), nor at 3 rows
// of 1536 inputs (6 KB blocks). Whole steps of the int4 1.5B model and its 0.5B draft set these
// (BENCHMARKS.md, "Two-block tiles from 4 rows").
constexpr int64_t kPairMinRows = 4, kPairLongK = 4096;
std::atomic<int64_t> pair_min_rows{kPairMinRows};  // kPairMinRows unless a benchmark sets another

inline bool pair_tiles(int64_t M, int64_t K) {
  const int64_t from = pair_min_rows.load(std::memory_order_relaxed);
  return M >= from || (K >= kPairLongK && M >= from - 1);
}

// Rows [0, MB) of quantized x times one pair of int4.cpp's paired layout (16 outputs) in one pass:
// the weights of both blocks' k-steps are regrouped (vshufi64x2) into one 16-column vector per
// k-step, once per group for all MB rows, so each row's activation dword is a broadcast operand of
// vpdpbusd: no per-row permutes, and the float work runs 512 bits wide. The column sums are the same
// exact integers and each column's float chain is the same multiply and two FMAs in the same order,
// so y is bitwise the AVX2 kernel's.
template <int MB>
inline void int4_pair_tile(const int8_t* xq, const float* a, const float* as, int64_t K, const uint8_t* wb,
                           const uint16_t* smb, float* y, int64_t ldy) {
  const int64_t G = K / kGroup;
  const uint8_t* wb1 = wb + 128;  // block b + 1: int4.cpp's pair layout alternates the blocks group by group
  const uint16_t* smb1 = smb + 16;
  const __m512i mask = _mm512_set1_epi8(0x0f);
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* p = wb + g * 256;
    const uint8_t* q = p + 128;
    // one forward stream: 8 groups (2 KB) ahead, past the pair's end into the next pair, which is
    // the next this thread takes; the scales (64 bytes a group) as many groups ahead
    for (int off = 0; off < 256; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + 2048 + off, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(smb + g * 32 + 256), _MM_HINT_T0);
    const __m512i a0 = _mm512_loadu_si512(p), a1 = _mm512_loadu_si512(p + 64);
    const __m512i b0 = _mm512_loadu_si512(q), b1 = _mm512_loadu_si512(q + 64);
    // k-step t of the 16 columns (block b's 8, then block b + 1's): a 64-byte load holds steps
    // 2i (lower 256 bits) and 2i + 1 (upper); its low nibbles pair with activation dword 2t, its
    // high nibbles with dword 2t + 1 (int4_tile's lo / hi permutes)
    const __m512i step[4] = {_mm512_shuffle_i64x2(a0, b0, 0x44), _mm512_shuffle_i64x2(a0, b0, 0xEE),
                             _mm512_shuffle_i64x2(a1, b1, 0x44), _mm512_shuffle_i64x2(a1, b1, 0xEE)};
    __m512i w[8];
    for (int t = 0; t < 4; ++t) {
      w[2 * t] = _mm512_and_si512(step[t], mask);
      w[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(step[t], 4), mask);
    }
    const uint16_t* sp = smb + g * 32;
    const uint16_t* sq = smb1 + g * 32;
    const __m512 sc = _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(sq)), 1));
    const __m512 mn = _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 8))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(sq + 8)), 1));
    for (int m = 0; m < MB; ++m) {
      const int8_t* xg = xq + m * K + g * kGroup;
      const Dword* d4 = reinterpret_cast<const Dword*>(xg);  // broadcast operands straight from memory
      __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(d4[0]));
      for (int j = 1; j < 8; ++j) s = _mm512_dpbusd_epi32(s, w[j], _mm512_set1_epi32(d4[j]));
      const __m512 d = _mm512_cvtepi32_ps(s);
      acc[m] = _mm512_fmadd_ps(d, _mm512_mul_ps(sc, _mm512_set1_ps(a[m * G + g])), acc[m]);
      acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(as[m * G + g]), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(y + m * ldy, acc[m]);
}

// Rows [0, MB) of quantized x times one column block of int6.cpp's layout (208 bytes a group).
template <int MB>
inline void int6_tile(const int8_t* xq, const float* a, const int32_t* sum16, int64_t K, const uint8_t* wb,
                      const float* db, float* y, int64_t ldy) {
  const int64_t G = K / kGroup;
  const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(0x30);
  const __m512i lo[2] = {_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
                         _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6)};
  const __m512i hi[2] = {_mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3),
                         _mm512_setr_epi32(5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7)};
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  __m256 dv = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* p = wb + g * kInt6GroupBytes;
    _mm_prefetch(reinterpret_cast<const char*>(p) + 2048, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p) + 2048 + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p) + 2048 + 128, _MM_HINT_T0);
    if (g % (kSuper / kGroup) == 0) dv = _mm256_loadu_ps(db + (g / (kSuper / kGroup)) * 8);
    for (int h = 0; h < 2; ++h) {
      // lower 256 bits: k-step 2h (int6.cpp's half 0), upper: k-step 2h + 1 (half 1)
      const __m512i v = _mm512_loadu_si512(p + h * 64);
      const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + h * 32)));
      const __m512i top_lo = _mm512_and_si512(_mm512_mask_blend_epi64(0xf0, _mm512_slli_epi16(hb, 4), hb), m2);
      const __m512i top_hi =
          _mm512_and_si512(_mm512_mask_blend_epi64(0xf0, _mm512_slli_epi16(hb, 2), _mm512_srli_epi16(hb, 2)), m2);
      const __m512i wl = _mm512_or_si512(_mm512_and_si512(v, m4), top_lo);
      const __m512i wh = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), top_hi);
      const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 192 + h * 8));
      const __m256 sc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)), dv);  // d * sc, exact
      for (int m = 0; m < MB; ++m) {
        const __m512i x = _mm512_castsi256_si512(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + g * kGroup)));
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wl, _mm512_permutexvar_epi32(lo[h], x));
        s = _mm512_dpbusd_epi32(s, wh, _mm512_permutexvar_epi32(hi[h], x));
        const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
        const __m256i dot = _mm256_sub_epi32(s8, _mm256_set1_epi32(32 * sum16[m * 2 * G + 2 * g + h]));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sc, _mm256_set1_ps(a[m * G + g])), acc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(y + m * ldy, acc[m]);
}

// Rows [0, MB) of quantized x times two adjacent column blocks of int6.cpp's layout, as
// int4_pair_tile regroups its k-steps: each half's two k-steps become one 16-column vector each, low
// bits and top bits alike, and each row's activation dwords are broadcast operands. Same integer
// sums, the same multiply and FMA per column in the same order: bitwise int6_tile's values.
// Paired: the pair of int6.cpp's paired layout (its blocks' groups alternating: one stream), else
// blocks b and b + 1 of the blocked layout.
template <int MB, bool Paired>
inline void int6_pair_tile(const int8_t* xq, const float* a, const int32_t* sum16, int64_t K, const uint8_t* wb,
                           const float* db, float* y, int64_t ldy) {
  const int64_t G = K / kGroup;
  const int64_t gs = Paired ? 2 * kInt6GroupBytes : kInt6GroupBytes, ds = Paired ? 16 : 8;  // group / super-block strides
  const uint8_t* wb1 = wb + (Paired ? kInt6GroupBytes : G * kInt6GroupBytes);  // block b + 1
  const float* db1 = db + (Paired ? 8 : (K / kSuper) * 8);
  const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(0x30);
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  __m512 dv = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* p = wb + g * gs;
    const uint8_t* q = wb1 + g * gs;
    if constexpr (Paired) {  // one stream: 5 groups (2 KB) ahead, past the pair's end into the next pair
      for (int off = 0; off < 2 * kInt6GroupBytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p) + 2048 + off, _MM_HINT_T0);
    } else {  // 10 groups ahead in each block's stream; past a block's end, into the same block of the next pair
      const int64_t ahead = g + 10 < G ? 10 * kInt6GroupBytes : 10 * kInt6GroupBytes + G * kInt6GroupBytes;
      for (int off = 0; off < 192; off += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(p) + ahead + off, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(q) + ahead + off, _MM_HINT_T0);
      }
    }
    if (g % (kSuper / kGroup) == 0) {
      const int64_t sup = (g / (kSuper / kGroup)) * ds;
      dv = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(db + sup))),
                                               _mm256_castps_pd(_mm256_loadu_ps(db1 + sup)), 1));
    }
    for (int h = 0; h < 2; ++h) {
      const __m512i vp = _mm512_loadu_si512(p + h * 64), vq = _mm512_loadu_si512(q + h * 64);
      const __m512i s0 = _mm512_shuffle_i64x2(vp, vq, 0x44), s1 = _mm512_shuffle_i64x2(vp, vq, 0xEE);  // k-steps 2h, 2h + 1
      const __m512i hb = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + h * 32))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 128 + h * 32)), 1);
      // int6_tile's top bits: step 2h takes hb << 4 (low nibbles) and hb << 2 (high), step 2h + 1
      // takes hb and hb >> 2
      const __m512i w[4] = {
          _mm512_or_si512(_mm512_and_si512(s0, m4), _mm512_and_si512(_mm512_slli_epi16(hb, 4), m2)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(s0, 4), m4), _mm512_and_si512(_mm512_slli_epi16(hb, 2), m2)),
          _mm512_or_si512(_mm512_and_si512(s1, m4), _mm512_and_si512(hb, m2)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(s1, 4), m4), _mm512_and_si512(_mm512_srli_epi16(hb, 2), m2))};
      const __m128i sc8 = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 192 + h * 8)),
                                             _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 192 + h * 8)));
      const __m512 sc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)), dv);  // d * sc, exact
      for (int m = 0; m < MB; ++m) {
        const Dword* d4 = reinterpret_cast<const Dword*>(xq + m * K + g * kGroup) + 4 * h;
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(d4[0]));
        for (int j = 1; j < 4; ++j) s = _mm512_dpbusd_epi32(s, w[j], _mm512_set1_epi32(d4[j]));
        const __m512i dot = _mm512_sub_epi32(s, _mm512_set1_epi32(32 * sum16[m * 2 * G + 2 * g + h]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sc, _mm512_set1_ps(a[m * G + g])), acc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(y + m * ldy, acc[m]);
}

// Rows [0, M) in tiles, each one pass over a column block's weights: 16 rows while 16 are left,
// then one of 12, then up to 8. A tile's shared work (loading and unpacking a group's weights and
// scales) is spread over its rows, so a prefill's many rows run in the widest tiles the 32 vector
// registers hold (16 accumulators beside the group's 8 weight vectors); every row's arithmetic is
// the same in any tile. tile(std::integral_constant<int, MB>{}, m) for the tile of MB rows at row m.
template <typename Tile>
inline void in_tiles(int64_t M, Tile&& tile) {
  for (int64_t m = 0; m < M;) {
    if (M - m >= 12) {
      const bool wide = M - m >= 16;
      if (wide) tile(std::integral_constant<int, 16>{}, m);
      else tile(std::integral_constant<int, 12>{}, m);
      m += wide ? 16 : 12;
      continue;
    }
    const int64_t take = M - m >= 8 ? 8 : M - m;
    switch (take) {
      case 8: tile(std::integral_constant<int, 8>{}, m); break;
      case 7: tile(std::integral_constant<int, 7>{}, m); break;
      case 6: tile(std::integral_constant<int, 6>{}, m); break;
      case 5: tile(std::integral_constant<int, 5>{}, m); break;
      case 4: tile(std::integral_constant<int, 4>{}, m); break;
      case 3: tile(std::integral_constant<int, 3>{}, m); break;
      case 2: tile(std::integral_constant<int, 2>{}, m); break;
      default: tile(std::integral_constant<int, 1>{}, m); break;
    }
    m += take;
  }
}

// Column blocks in pairs, each thread walking its pairs in memory order: block(b, true) for the pair
// of blocks b and b + 1, block(b, false) for a last block of an odd count.
template <typename Block>
inline void in_block_pairs(int64_t NB8, Block&& block) {
  at::parallel_for(0, (NB8 + 1) / 2, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t pr = p0; pr < p1; ++pr) block(2 * pr, 2 * pr + 1 < NB8);
  });
}

}  // namespace

namespace tokenleap_ops {

void int4_vnni_product(const int8_t* xq, const float* a, const float* as, int64_t M, int64_t K,
                       const uint8_t* w, const uint16_t* s, float* y, int64_t N) {
  // int4.cpp's paired layout: every pair whole, one forward stream a pair, at any row count
  const int64_t G = K / kGroup;
  in_block_pairs(N / 8, [&](int64_t b, bool) {
    in_tiles(M, [&](auto mb, int64_t m) {
      int4_pair_tile<decltype(mb)::value>(xq + m * K, a + m * G, as + m * G, K, w + b * K * 4, s + b * G * 16,
                                          y + m * N + b * 8, N);
    });
  });
}

void int6_vnni_product(const int8_t* xq, const float* a, const int32_t* sum16, int64_t M, int64_t K,
                       const uint8_t* w, const float* d, float* y, int64_t N, bool paired) {
  const int64_t G = K / kGroup, NB8 = N / 8;
  if (paired) {  // int6.cpp's paired layout: every pair whole, one forward stream a pair, at any row count
    in_block_pairs(NB8, [&](int64_t b, bool) {
      in_tiles(M, [&](auto mb, int64_t m) {
        int6_pair_tile<decltype(mb)::value, true>(xq + m * K, a + m * G, sum16 + m * 2 * G, K, w + b * G * kInt6GroupBytes,
                                                  d + b * (K / kSuper) * 8, y + m * N + b * 8, N);
      });
    });
    return;
  }
  if (pair_tiles(M, K)) {
    in_block_pairs(NB8, [&](int64_t b, bool pair) {
      const uint8_t* wb = w + b * G * kInt6GroupBytes;
      const float* db = d + b * (K / kSuper) * 8;
      in_tiles(M, [&](auto mb, int64_t m) {
        constexpr int MB = decltype(mb)::value;
        if (pair) int6_pair_tile<MB, false>(xq + m * K, a + m * G, sum16 + m * 2 * G, K, wb, db, y + m * N + b * 8, N);
        else int6_tile<MB>(xq + m * K, a + m * G, sum16 + m * 2 * G, K, wb, db, y + m * N + b * 8, N);
      });
    });
    return;
  }
  at::parallel_for(0, NB8, 8, [&](int64_t b0, int64_t b1) {  // each thread streams its blocks in order
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* wb = w + b * G * kInt6GroupBytes;
      const float* db = d + b * (K / kSuper) * 8;
      in_tiles(M, [&](auto mb, int64_t m) {
        int6_tile<decltype(mb)::value>(xq + m * K, a + m * G, sum16 + m * 2 * G, K, wb, db, y + m * N + b * 8, N);
      });
    }
  });
}

}  // namespace tokenleap_ops

#pragma GCC pop_options

namespace {
// 1 where the CPU has AVX-512 VNNI and the tiles are turned on (it is by default), else 0.
std::atomic<int> vnni_on{-1};

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
}  // namespace

namespace tokenleap_ops {
bool vnni_takes() {
  int on = vnni_on.load(std::memory_order_relaxed);
  if (on < 0) {
    on = cpu_has_vnni() ? 1 : 0;
    vnni_on.store(on, std::memory_order_relaxed);
  }
  return on == 1;
}
}  // namespace tokenleap_ops

TORCH_LIBRARY_FRAGMENT(tokenleap, m) {
  // mode 1: int4 / int6 products take the VNNI tiles where the CPU has them, 0: never; -1: only ask.
  // Returns the previous state.
  m.def("vnni(int mode) -> bool", [](int64_t mode) -> bool {
    const bool was = tokenleap_ops::vnni_takes();
    if (mode >= 0) vnni_on.store(mode > 0 && cpu_has_vnni() ? 1 : 0, std::memory_order_relaxed);
    return was;
  });
  m.def("vnni_supported() -> bool", []() -> bool { return cpu_has_vnni(); });
  // products of at least `rows` rows (of long rows, one fewer) take the two-block tiles (rows <= 0:
  // kPairMinRows); returns the previous setting. Both tiles compute bitwise the same values.
  m.def("vnni_pair_rows(int rows) -> int", [](int64_t rows) -> int64_t {
    return pair_min_rows.exchange(rows > 0 ? rows : kPairMinRows);
  });
}
