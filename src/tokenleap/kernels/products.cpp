// tokenleap CPU kernels (AVX2 + FMA + F16C), part 1: weight-only int8 / bf16 / int4 matrix
// products (attention and the elementwise steps are in decoder.cpp). All row-invariant.
//
// int8 / bf16 products:
// y[m, n] = scale[n] * sum_k x[m, k] * q[n, k], x float32 [M, K], q int8 packed (see below).
//
// Row invariance, by construction: every output element is one 8-lane FMA chain over k in
// ascending order (lane t sums k = t, t+8, t+16, ...), then a fixed horizontal sum, then the scale.
// Tiles of different shapes (chosen by how many rows a call has) only change which chains run side by
// side, never the arithmetic of a chain, so a row's result is bitwise the same for any M. Speculative
// verification (k+1 rows) and batching therefore reproduce one-row decoding exactly.
//
// Packed layout: [N/8 column blocks][K/8][8 columns][8 k] int8, so one tile streams one contiguous
// region and every 64-byte cache line holds 8 k of 8 neighbouring columns. bfloat16 weights:
// [N/8][K/16][8 columns][16 k], so one 32-byte load holds 16 k of one column; its even k become
// float32 by a shift and its odd k by a mask (bf16 is the top half of a float32), multiplied by x
// with each 16 inputs stored evens first (``split16``): two ALU ops and two FMAs per 16 weights.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using tokenleap_simd::hsum8;
#ifndef PF_AHEAD
#define PF_AHEAD 4096
#endif

inline __m256 load_w(const int8_t* p) {  // 8 int8 -> 8 float32 (exact)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256 load_w(const uint16_t* p) {  // 8 bfloat16 -> 8 float32 (exact: a shift)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Rows [0, MB) x block columns [j0, j0 + NB) of one 8-column block.
template <int MB, int NB, typename W>
inline void tile(const float* x, int64_t K, const W* blk, int j0, const float* scale, float* y,
                 int64_t ldy) {
  __m256 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
  const W* p = blk + j0 * 8;
  for (int64_t k = 0; k < K; k += 8, p += 64) {
    for (int line = 0; line < static_cast<int>(sizeof(W)); ++line)  // every line of this k-step's 64 weights
      _mm_prefetch(reinterpret_cast<const char*>(p) + PF_AHEAD + 64 * line, _MM_HINT_T0);
    __m256 w[NB];
    for (int j = 0; j < NB; ++j) w[j] = load_w(p + j * 8);
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_fmadd_ps(w[j], xv, acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) y[m * ldy + j0 + j] = hsum8(acc[m][j]) * scale[j0 + j];
}

template <int MB, int NB, typename W>
inline void block_rows(const float* x, int64_t K, const W* blk, const float* scale, float* y, int64_t ldy) {
  for (int j = 0; j < 8; j += NB) tile<MB, NB, W>(x, K, blk, j, scale, y, ldy);
}

// bf16: rows [0, MB) x columns [j0, j0 + NB) of one 8-column block, x split per 16 (split16).
// Lane t of an output's accumulator takes, per 16 k, the product at k0 + 2t, then at k0 + 2t + 1:
// one fixed chain whatever the tile shape, so row-invariant like the int8 tiles.
template <int MB, int NB>
inline void tile_bf16(const float* xs, int64_t K, const uint16_t* blk, int j0, float* y, int64_t ldy) {
  const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
  const uint16_t* p = blk + j0 * 16;
  for (int64_t k = 0; k < K; k += 16, p += 128) {
    for (int line = 0; line < 4; ++line)  // the step's 256 bytes, PF_AHEAD on
      _mm_prefetch(reinterpret_cast<const char*>(p) + PF_AHEAD + 64 * line, _MM_HINT_T0);
    for (int j = 0; j < NB; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j * 16));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, odd));
      for (int m = 0; m < MB; ++m) {
        acc[m][j] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xs + m * K + k), acc[m][j]);
        acc[m][j] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xs + m * K + k + 8), acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) y[m * ldy + j0 + j] = hsum8(acc[m][j]);
}

template <int MB, int NB>
inline void block_rows_bf16(const float* xs, int64_t K, const uint16_t* blk, float* y, int64_t ldy) {
  for (int j = 0; j < 8; j += NB) tile_bf16<MB, NB>(xs, K, blk, j, y, ldy);
}

// x float32 [M, K] -> the same values with each 16 reordered evens first: k0, k0+2, .., k0+14, k0+1, ..
at::Tensor split16(const at::Tensor& xc) {
  const int64_t M = xc.size(0), K = xc.size(1);
  at::Tensor xs = at::empty({M, K}, xc.options());
  const float* src = xc.data_ptr<float>();
  float* dst = xs.data_ptr<float>();
  for (int64_t i = 0; i < M * K; i += 16)
    for (int t = 0; t < 8; ++t) dst[i + t] = src[i + 2 * t], dst[i + 8 + t] = src[i + 2 * t + 1];
  return xs;
}

// Checked arguments of a weight product: x float32 [M, K], packed weights [N*K] (int8 or bfloat16),
// scale float32 [N] (ones for bfloat16 weights).
template <typename W>
struct ProductArgs {
  at::Tensor xc, y;
  int64_t M, K, N;
  const float* x;
  const W* q;
  const float* scale;
  float* out;
};

template <typename W>
ProductArgs<W> product_args(const char* name, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                            int64_t n_multiple) {
  constexpr bool is_int8 = std::is_same<W, int8_t>::value;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, name, ": x must be float32 [M, K]");
  TORCH_CHECK(packed.scalar_type() == (is_int8 ? at::kChar : at::kBFloat16) && packed.is_contiguous(), name,
              ": packed must be contiguous ", is_int8 ? "int8" : "bfloat16");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.is_contiguous(), name,
              ": scale must be float32 [N]");
  ProductArgs<W> a;
  a.M = x.size(0), a.K = x.size(1), a.N = scale.size(0);
  TORCH_CHECK(a.N % n_multiple == 0 && a.K % 8 == 0 && packed.numel() == a.N * a.K, name,
              ": N must be a multiple of ", n_multiple, " and K of 8");
  a.xc = x.contiguous();
  a.y = at::empty({a.M, a.N}, x.options());
  a.x = a.xc.template data_ptr<float>();
  a.q = reinterpret_cast<const W*>(packed.data_ptr());
  a.scale = scale.template data_ptr<float>();
  a.out = a.y.template data_ptr<float>();
  return a;
}

at::Tensor bf16_linear_impl(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale) {
  const ProductArgs<uint16_t> a = product_args<uint16_t>("bf16_linear", x, packed, scale, 8);
  TORCH_CHECK(a.K % 16 == 0, "bf16_linear: K must be a multiple of 16");
  const at::Tensor xs_t = split16(a.xc);
  const float* xs = xs_t.data_ptr<float>();
  at::parallel_for(0, a.N / 8, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint16_t* blk = a.q + b * 8 * a.K;
      int64_t m = 0;
      for (; m + 6 <= a.M; m += 6) block_rows_bf16<6, 2>(xs + m * a.K, a.K, blk, a.out + m * a.N + b * 8, a.N);
      const float* xm = xs + m * a.K;
      float* ym = a.out + m * a.N + b * 8;
      switch (a.M - m) {
        case 5: block_rows_bf16<5, 2>(xm, a.K, blk, ym, a.N); break;
        case 4: block_rows_bf16<4, 2>(xm, a.K, blk, ym, a.N); break;
        case 3: block_rows_bf16<3, 2>(xm, a.K, blk, ym, a.N); break;
        case 2: block_rows_bf16<2, 4>(xm, a.K, blk, ym, a.N); break;
        case 1: block_rows_bf16<1, 8>(xm, a.K, blk, ym, a.N); break;
        default: break;
      }
    }
  });
  return a.y;
}

template <typename W>
at::Tensor linear_impl(const char* name, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale) {
  const ProductArgs<W> a = product_args<W>(name, x, packed, scale, 8);
  at::parallel_for(0, a.N / 8, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const W* blk = a.q + b * 8 * a.K;
      const float* s = a.scale + b * 8;
      int64_t m = 0;
      for (; m + 6 <= a.M; m += 6) block_rows<6, 2, W>(a.x + m * a.K, a.K, blk, s, a.out + m * a.N + b * 8, a.N);
      const float* xm = a.x + m * a.K;
      float* ym = a.out + m * a.N + b * 8;
      switch (a.M - m) {
        case 5: block_rows<5, 2, W>(xm, a.K, blk, s, ym, a.N); break;
        case 4: block_rows<4, 2, W>(xm, a.K, blk, s, ym, a.N); break;
        case 3: block_rows<3, 2, W>(xm, a.K, blk, s, ym, a.N); break;
        case 2: block_rows<2, 4, W>(xm, a.K, blk, s, ym, a.N); break;
        case 1: block_rows<1, 8, W>(xm, a.K, blk, s, ym, a.N); break;
        default: break;
      }
    }
  });
  return a.y;
}

// ---------------------------------------------------------------------------------- many rows
// int8_gemm: the same product for many rows (prompt prefill), as a register-blocked GEMM: 6 rows x
// 16 columns of y in 12 accumulators, k by k, with the weights of 16 columns x 256 k converted
// (times their scale) into a float32 panel that stays in L1 while every 6-row tile passes over it.
// A different summation order from int8_linear, so not row-invariant -- used only where the
// engine asks for speed over row exactness (fixed prompt windows; see Engine.prefill_step).
constexpr int64_t kPanelK = 256;

// panel[k][c], c < 16 = (columns n0 .. n0+16 of the weight) * scale, for k in [k0, k0 + kc)
template <typename W>
inline void fill_panel(const W* qp, const float* sp, int64_t K, int64_t n0, int64_t k0, int64_t kc,
                       float* panel) {
  for (int half = 0; half < 2; ++half) {
    const int64_t b = n0 / 8 + half;
    const W* blk = qp + b * 8 * K;
    for (int c = 0; c < 8; ++c) {
      const float s = sp[b * 8 + c];
      for (int64_t k = k0; k < k0 + kc; k += 8) {
        const W* src = std::is_same<W, uint16_t>::value ? blk + (k / 16) * 128 + c * 16 + k % 16  // bf16 layout
                                                         : blk + (k / 8) * 64 + c * 8;
        alignas(32) float w[8];
        _mm256_store_ps(w, _mm256_mul_ps(load_w(src), _mm256_set1_ps(s)));
        for (int t = 0; t < 8; ++t) panel[(k - k0 + t) * 16 + half * 8 + c] = w[t];
      }
    }
  }
}

template <int MR>
inline void gemm_tile(const float* x, int64_t K, const float* panel, int64_t k0, int64_t kc, float* y,
                      int64_t N, bool first) {
  __m256 c0[MR], c1[MR];
  for (int m = 0; m < MR; ++m) {
    c0[m] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + m * N);
    c1[m] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + m * N + 8);
  }
  const float* xk = x + k0;
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(panel + k * 16), b1 = _mm256_load_ps(panel + k * 16 + 8);
    for (int m = 0; m < MR; ++m) {
      const __m256 a = _mm256_broadcast_ss(xk + m * K + k);
      c0[m] = _mm256_fmadd_ps(a, b0, c0[m]);
      c1[m] = _mm256_fmadd_ps(a, b1, c1[m]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(y + m * N, c0[m]);
    _mm256_storeu_ps(y + m * N + 8, c1[m]);
  }
}

template <typename W>
at::Tensor gemm_impl(const char* name, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale) {
  const ProductArgs<W> a = product_args<W>(name, x, packed, scale, 16);
  at::parallel_for(0, a.N / 16, 1, [&](int64_t c0, int64_t c1) {
    alignas(64) float panel[kPanelK * 16];
    for (int64_t cb = c0; cb < c1; ++cb) {
      const int64_t n0 = cb * 16;
      for (int64_t k0 = 0; k0 < a.K; k0 += kPanelK) {
        const int64_t kc = std::min(kPanelK, a.K - k0);
        fill_panel(a.q, a.scale, a.K, n0, k0, kc, panel);
        const bool first = k0 == 0;
        int64_t m = 0;
        for (; m + 6 <= a.M; m += 6) gemm_tile<6>(a.x + m * a.K, a.K, panel, k0, kc, a.out + m * a.N + n0, a.N, first);
        const float* xm = a.x + m * a.K;
        float* ym = a.out + m * a.N + n0;
        switch (a.M - m) {
          case 5: gemm_tile<5>(xm, a.K, panel, k0, kc, ym, a.N, first); break;
          case 4: gemm_tile<4>(xm, a.K, panel, k0, kc, ym, a.N, first); break;
          case 3: gemm_tile<3>(xm, a.K, panel, k0, kc, ym, a.N, first); break;
          case 2: gemm_tile<2>(xm, a.K, panel, k0, kc, ym, a.N, first); break;
          case 1: gemm_tile<1>(xm, a.K, panel, k0, kc, ym, a.N, first); break;
          default: break;
        }
      }
    }
  });
  return a.y;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& p, const at::Tensor& s) {
  return linear_impl<int8_t>("int8_linear", x, p, s);
}
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& p, const at::Tensor& s) {
  return gemm_impl<int8_t>("int8_gemm", x, p, s);
}
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& p, const at::Tensor& s) {
  return bf16_linear_impl(x, p, s);
}
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& p, const at::Tensor& s) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 16 == 0, "bf16_gemm: K must be a multiple of 16");
  return gemm_impl<uint16_t>("bf16_gemm", x, p, s);
}

// --------------------------------------------------------------- int4 weights, int8 activations
// int4_linear: y = x W^T with W[n, k] = s[n, g] * q[n, k] + mn[n, g], q in 0..15, groups g of 32 k.
// Each row of x is first quantized to int8 per group of 32 (xq = round(x / a), a = max|x| / 127,
// the way llama.cpp feeds its 4-bit dot products), then
//   y[m, n] = sum_g a[m, g] * s[n, g] * (sum_{k in g} q[n, k] xq[m, k])  +  mn[n, g] * (a[m, g] sum_{k in g} xq[m, k]).
// The integer dot products (vpmaddubsw: unsigned 4-bit weight x signed 8-bit activation, summed
// in int16 without overflow: 32 * 15 * 127 < 32767) are exact; the float work is a fixed chain of
// one multiply and two FMAs per group per output, in ascending g, so a row's result does not
// depend on how many rows share the call (row-invariant), and the weights are unpacked once for
// all rows of a tile. Every row is quantized on its own, so the quantization is row-invariant too.
//
// Packed layout: [N/8 column blocks][K/8][8 columns][4 bytes]; byte (c, t) of k-step k0 holds
// q[c, k0 + t] in its low nibble and q[c, k0 + 4 + t] in its high nibble, so a 32-byte load
// unpacks (and / shift+and) into two vectors that line up with 4 broadcast activation bytes.
// Scales and mins: float16 [N/8][K/32][2][8] (8 scales then 8 mins of one column block and group).
constexpr int64_t kGroup = 32;

inline __m256i bcast4(const int8_t* p) {  // 4 bytes repeated 8 times
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Row m of x [M, K] -> xq int8 [K], a[g] = scale, as[g] = a[g] * sum of the group's xq.
inline void quantize_row(const float* x, int64_t K, int8_t* xq, float* a, float* as) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const float* v = x + g * kGroup;
    __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
           v3 = _mm256_loadu_ps(v + 24);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absmask), _mm256_and_ps(v1, absmask)),
                              _mm256_max_ps(_mm256_and_ps(v2, absmask), _mm256_and_ps(v3, absmask)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m256 iv = _mm256_set1_ps(inv);
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, iv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, iv)),
                  i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, iv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, iv));
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    p = _mm256_permutevar8x32_epi32(p, order);  // back to k order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + g * kGroup), p);
    // sum of the signed bytes: |1 * xq| pairs in int16, then pairs of those in int32
    const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, p), ones16);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    a[g] = amax / 127.f;
    as[g] = a[g] * float(_mm_cvtsi128_si32(s4));
  }
}

// Rows [0, MB) of quantized x times one column block (8 outputs) at wb / smb. (Two blocks per tile,
// sharing each activation broadcast, measured no faster: the accumulators spill.)
template <int MB>
inline void int4_tile(const int8_t* xq, const float* a, const float* as, int64_t K, const uint8_t* wb,
                      const uint16_t* smb, float* y, int64_t ldy) {
  const int64_t G = K / kGroup;
  const __m256i mask = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i s16[MB];
    for (int m = 0; m < MB; ++m) s16[m] = _mm256_setzero_si256();
    const auto step = [&](int st) {
      const uint8_t* p = wb + g * 128 + st * 32;
      if (st % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(p) + 2048, _MM_HINT_T0);  // one per line
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      for (int m = 0; m < MB; ++m) {
        const int8_t* xp = xq + m * K + g * kGroup + st * 8;
        s16[m] = _mm256_add_epi16(
            s16[m], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xp)), _mm256_maddubs_epi16(hi, bcast4(xp + 4))));
      }
    };
    if constexpr (MB <= 2) {  // unrolled: more loads in flight for the memory-bound case
#pragma GCC unroll 4
      for (int st = 0; st < 4; ++st) step(st);
    } else {  // not unrolled: unrolling hoists every product and spills registers (-30% at 64 rows)
#pragma GCC unroll 1
      for (int st = 0; st < 4; ++st) step(st);
    }
    const uint16_t* sp = smb + g * 16;
    const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp)));
    const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 8)));
    for (int m = 0; m < MB; ++m) {
      const __m256 d = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[m], ones));
      acc[m] = _mm256_fmadd_ps(d, _mm256_mul_ps(sc, _mm256_set1_ps(a[m * G + g])), acc[m]);
      acc[m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(as[m * G + g]), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(y + m * ldy, acc[m]);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sm,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int4_linear: x must be float32 [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == 8 && packed.size(3) == 4,
              "int4_linear: packed must be contiguous uint8 [N/8, K/8, 8, 4]");
  const int64_t M = x.size(0), K = x.size(1), NB8 = packed.size(0), N = NB8 * 8, G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0 && packed.size(1) * 8 == K, "int4_linear: K must be a multiple of 32 and match packed");
  TORCH_CHECK(sm.scalar_type() == at::kHalf && sm.is_contiguous() && sm.numel() == NB8 * G * 16,
              "int4_linear: scales/mins must be contiguous float16 [N/8, K/32, 2, 8]");
  const float* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == N, "int4_linear: bias must be float32 [N]");
    bp = bc.data_ptr<float>();
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  at::Tensor sc = at::empty({M, G}, x.options()), ss = at::empty({M, G}, x.options());
  float* scp = sc.data_ptr<float>();
  float* ssp = ss.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) quantize_row(xp + m * K, K, qp + m * K, scp + m * G, ssp + m * G);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(sm.data_ptr<at::Half>());
  float* out = y.data_ptr<float>();
  // Each thread walks its column blocks in memory order (one block is K*4 contiguous bytes), all
  // rows of a block before the next: a single forward stream, which the prefetchers keep up with
  // (two interleaved streams ran at ~12 GB/s instead of ~18 on short K).
  at::parallel_for(0, NB8, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* wb = w + b * K * 4;
      const uint16_t* sb = s + b * G * 16;
      for (int64_t m = 0; m < M;) {
        const int8_t* xm = qp + m * K;
        const float *am = scp + m * G, *sm2 = ssp + m * G;
        float* ym = out + m * N + b * 8;
        const int64_t left = M - m;
        // a 6-row tile for 6+ rows (a 6-row verification step in one pass over the weights:
        // relative to one row, 6 rows of the 1.5B model cost 1.6-1.8x instead of 2.1-2.3x as 3 + 3)
        const int64_t take = left >= 6 ? 6 : tokenleap_simd::tile_rows(left);
        if (take == 6) int4_tile<6>(xm, am, sm2, K, wb, sb, ym, N);
        else if (take == 4) int4_tile<4>(xm, am, sm2, K, wb, sb, ym, N);
        else if (take == 3) int4_tile<3>(xm, am, sm2, K, wb, sb, ym, N);
        else if (take == 2) int4_tile<2>(xm, am, sm2, K, wb, sb, ym, N);
        else int4_tile<1>(xm, am, sm2, K, wb, sb, ym, N);
        m += take;
      }
    }
  });
  if (bp != nullptr) tokenleap_simd::add_bias_rows(out, bp, M, N);
  return y;
}

}  // namespace

namespace tokenleap_ops {
at::Tensor int4_product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sm,
                        const c10::optional<at::Tensor>& bias) {
  return int4_linear(x, packed, sm, bias);
}
at::Tensor int8_product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale) {
  return int8_linear(x, packed, scale);
}
at::Tensor bf16_product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale) {
  return bf16_linear(x, packed, scale);
}
}  // namespace tokenleap_ops

TORCH_LIBRARY(tokenleap, m) {
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale) -> Tensor");
  m.def("int8_gemm(Tensor x, Tensor packed, Tensor scale) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor scale) -> Tensor");
  m.def("bf16_gemm(Tensor x, Tensor packed, Tensor scale) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor sm, Tensor? bias=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(tokenleap, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_gemm", &int8_gemm);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("bf16_gemm", &bf16_gemm);
  m.impl("int4_linear", &int4_linear);
}
