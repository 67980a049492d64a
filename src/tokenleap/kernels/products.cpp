// tokenleap CPU kernels (AVX2 + FMA + F16C), part 1: weight-only int8 / bf16 matrix products
// (int4 is in int4.cpp, int6 in int6.cpp, attention and the elementwise steps in decoder.cpp).
// All row-invariant.
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

#include <algorithm>
#include <cmath>
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

// Rows [0, MB) x columns [j0, j0 + NB) of one 8-column block over k in [k0, k1), continuing the
// accumulators (8 lanes each, rows of 8 columns: accm + (m * 8 + j) * 8) kept in memory between
// spans -- stored and reloaded exactly, so splitting k changes no value. int8: lane t of an
// output's accumulator takes the product at k = t of every 8 k in turn; bf16: per 16 k, the product
// at 2t, then at 2t + 1 (x split evens first). One fixed chain per output whatever the tile shape
// or span, so row-invariant.
template <int MB, int NB, typename W>
inline void span(const float* xs, int64_t K, const W* blk, int j0, int64_t k0, int64_t k1, float* accm) {
  constexpr bool kBf16 = std::is_same<W, uint16_t>::value;
  constexpr int KS = kBf16 ? 16 : 8;  // k a step; a step's weights, 8 columns x KS, are 256 / 64 bytes
  __m256 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_loadu_ps(accm + (m * 8 + j0 + j) * 8);
  const W* p = blk + (k0 / KS) * 8 * KS + j0 * KS;
  for (int64_t k = k0; k < k1; k += KS, p += 8 * KS) {
    for (int line = 0; line < KS * 8 * static_cast<int>(sizeof(W)) / 64; ++line)  // the step's lines, PF_AHEAD on
      _mm_prefetch(reinterpret_cast<const char*>(p - j0 * KS) + PF_AHEAD + 64 * line, _MM_HINT_T0);
    for (int j = 0; j < NB; ++j) {
      if constexpr (kBf16) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j * 16));
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
        for (int m = 0; m < MB; ++m) {
          acc[m][j] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xs + m * K + k), acc[m][j]);
          acc[m][j] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xs + m * K + k + 8), acc[m][j]);
        }
      } else {
        const __m256 w = load_w(p + j * 8);
        for (int m = 0; m < MB; ++m) acc[m][j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs + m * K + k), acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) _mm256_storeu_ps(accm + (m * 8 + j0 + j) * 8, acc[m][j]);
}

template <int MB, int NB, typename W>
inline void span_rows(const float* xs, int64_t K, const W* blk, int64_t k0, int64_t k1, float* accm) {
  for (int j = 0; j < 8; j += NB) span<MB, NB, W>(xs, K, blk, j, k0, k1, accm);
}

// All M rows of one 8-column block: k in spans of 8 KB of weights (512 k of bf16, 1024 of int8),
// within a span every row tile in turn, so the span's weights are read from memory once and stay
// in L1 for the other tiles, and each tile's rows of x come from L1 too. Tiles of three rows x
// four columns (12 accumulators), two-row tiles for the rest (4 = 2 + 2; a lone row would pass over
// all 8 columns once more). Before (bf16: whole-K tiles, rows of x from L2, 2-column tiles
// rereading them) 2 / 6 rows of a 1536 x 8960 layer took 1.5x / 2.5x one row; now ~0.95x / 1.5x.
constexpr int64_t kSpanBytes = 8192;

template <typename W>
void block(const float* xs, int64_t M, int64_t K, const W* blk, const float* scale, float* accm, float* y,
           int64_t ldy) {
  constexpr int64_t kSpan = kSpanBytes / (8 * sizeof(W));
  std::fill(accm, accm + M * 64, 0.0f);
  for (int64_t k0 = 0; k0 < K; k0 += kSpan) {
    const int64_t k1 = std::min(K, k0 + kSpan);
    int64_t m = 0;
    for (; M - m >= 3 && M - m != 4; m += 3) span_rows<3, 4, W>(xs + m * K, K, blk, k0, k1, accm + m * 64);
    for (; M - m >= 2; m += 2) span_rows<2, 4, W>(xs + m * K, K, blk, k0, k1, accm + m * 64);
    if (M - m == 1) span_rows<1, 8, W>(xs + m * K, K, blk, k0, k1, accm + m * 64);
  }
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < 8; ++j) y[m * ldy + j] = hsum8(_mm256_loadu_ps(accm + (m * 8 + j) * 8)) * scale[j];
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

// Every 8-column block (a thread streams its blocks in memory order) times all M rows; bf16's x
// split evens first per 16 inputs.
template <typename W>
at::Tensor linear_impl(const char* name, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale) {
  constexpr bool kBf16 = std::is_same<W, uint16_t>::value;
  const ProductArgs<W> a = product_args<W>(name, x, packed, scale, 8);
  TORCH_CHECK(!kBf16 || a.K % 16 == 0, name, ": K must be a multiple of 16");
  const at::Tensor xs = kBf16 ? split16(a.xc) : a.xc;
  const float* xp = xs.data_ptr<float>();
  at::parallel_for(0, a.N / 8, 8, [&](int64_t b0, int64_t b1) {
    std::vector<float> accm(a.M * 64);
    for (int64_t b = b0; b < b1; ++b)
      block<W>(xp, a.M, a.K, a.q + b * 8 * a.K, a.scale + b * 8, accm.data(), a.out + b * 8, a.N);
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
  return linear_impl<uint16_t>("bf16_linear", x, p, s);
}
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& p, const at::Tensor& s) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 16 == 0, "bf16_gemm: K must be a multiple of 16");
  return gemm_impl<uint16_t>("bf16_gemm", x, p, s);
}

}  // namespace

namespace tokenleap_ops {
at::Tensor int8_product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale) {
  return int8_linear(x, packed, scale);
}
at::Tensor bf16_product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale) {
  if (packed.dim() == 5) return bf16_amx_product(x, packed);  // packed for AMX tiles (amx.cpp)
  return bf16_linear(x, packed, scale);
}
}  // namespace tokenleap_ops

TORCH_LIBRARY(tokenleap, m) {
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale) -> Tensor");
  m.def("int8_gemm(Tensor x, Tensor packed, Tensor scale) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor scale) -> Tensor");
  m.def("bf16_gemm(Tensor x, Tensor packed, Tensor scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(tokenleap, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_gemm", &int8_gemm);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("bf16_gemm", &bf16_gemm);
}
