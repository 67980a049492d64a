// W8A8 products on Intel AMX-INT8 tiles: int8 weights with one scale per output, activations
// divided by a fixed per-input smoothing vector and quantized to int8 per row and per block of
// ``block`` inputs (symmetric, scale = max|x| / 127, round half to even). TDPBSSD forms each
// block's integer dot product exactly (|sum| <= block * 127 * 127 < 2^24), so every product
// sum * scale is exact in float64; the blocks are summed in float64 in ascending order, then
// multiplied by the output's scale and rounded to float32. Each row depends only on itself: the
// product is row-invariant, and any number of rows costs about one stream of the weights (the
// tiles do the arithmetic of 16 rows at once). ``models/w8a8.py`` computes the same values with
// torch ops, bitwise, where the tiles are missing.
//
// Weights are packed [N/16, K/64, 16, 16, 4]: per 16 outputs and 64 inputs, the B tile of TDPBSSD
// (row r holds inputs 4r..4r+3 of each of the 16 outputs). A pass computes up to 16 rows against
// two such column blocks, streaming both in order with software prefetch a few tiles ahead.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "amx.h"

#define TL_W8A8 __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq")))

namespace {

using tokenleap_amx::TileConfig;
constexpr int64_t kAheadBytes = 4096;  // prefetch distance in each weight stream

// Tiles: 0 activations [rows, 64 bytes]; 1, 2 the weights of two column blocks; 4, 5 their int32 sums.
TL_W8A8 void configure(int rows) {
  TileConfig c;
  c.rows[0] = rows, c.colsb[0] = 64;
  for (int t : {1, 2}) c.rows[t] = 16, c.colsb[t] = 64;
  for (int t : {4, 5}) c.rows[t] = rows, c.colsb[t] = 64;
  TL_LOAD_TILE_CONFIG(c);
}

// Row m of x (K inputs) times inv_smooth, quantized per block: xq [K] int8, d [K / block] float.
TL_W8A8 void quantize_row(const float* x, const float* inv_smooth, int64_t K, int64_t block, int8_t* xq, float* d,
                          float* tmp) {
  for (int64_t b0 = 0; b0 < K; b0 += block) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t k = b0; k < b0 + block; k += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(inv_smooth + k));
      _mm512_storeu_ps(tmp + k, v);
      mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
    }
    const float amax = _mm512_reduce_max_ps(mx);
    d[b0 / block] = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    for (int64_t k = b0; k < b0 + block; k += 16) {
      const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(tmp + k), inv),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
    }
  }
}

// Rows [0, MR) of xq (stride K) times the 32 outputs of column blocks w0, w0 + 16 K bytes -> y.
template <int MR>
TL_W8A8 void pass(const int8_t* xq, const float* d, int64_t K, int64_t block, const int8_t* w0, const float* scale,
                  float* y, int64_t ldy) {
  const int8_t* w1 = w0 + 16 * K;
  const int64_t nb = K / block, chunks = block / 64, kc = K / 64;
  alignas(64) int32_t ct[2][16 * 16];
  __m512d acc[MR][4];  // [row][outputs 0-7, 8-15, 16-23, 24-31] in float64
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 4; ++h) acc[m][h] = _mm512_setzero_pd();
  for (int64_t b = 0; b < nb; ++b) {
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t c = b * chunks; c < (b + 1) * chunks; ++c) {
      if (c * 1024 + kAheadBytes < kc * 1024) {
        const char* p0 = reinterpret_cast<const char*>(w0 + c * 1024) + kAheadBytes;
        const char* p1 = reinterpret_cast<const char*>(w1 + c * 1024) + kAheadBytes;
        for (int l = 0; l < 1024; l += 64) {
          _mm_prefetch(p0 + l, _MM_HINT_T0);
          _mm_prefetch(p1 + l, _MM_HINT_T0);
        }
      }
      _tile_loadd(0, xq + c * 64, K);
      _tile_loadd(1, w0 + c * 1024, 64);
      _tile_dpbssd(4, 0, 1);
      _tile_loadd(2, w1 + c * 1024, 64);
      _tile_dpbssd(5, 0, 2);
    }
    _tile_stored(4, ct[0], 64);
    _tile_stored(5, ct[1], 64);
    for (int m = 0; m < MR; ++m) {  // exact products sum * d in float64, added in block order
      const __m512d dm = _mm512_set1_pd(static_cast<double>(d[m * nb + b]));
      for (int h = 0; h < 4; ++h) {
        const __m256i s = _mm256_load_si256(reinterpret_cast<const __m256i*>(ct[h / 2] + m * 16 + (h % 2) * 8));
        acc[m][h] = _mm512_add_pd(acc[m][h], _mm512_mul_pd(_mm512_cvtepi32_pd(s), dm));
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 4; ++h) {
      const __m512d s = _mm512_cvtps_pd(_mm256_loadu_ps(scale + h * 8));
      _mm256_storeu_ps(y + m * ldy + h * 8, _mm512_cvtpd_ps(_mm512_mul_pd(acc[m][h], s)));
    }
}

using Pass = void (*)(const int8_t*, const float*, int64_t, int64_t, const int8_t*, const float*, float*, int64_t);

template <int... R>
constexpr std::array<Pass, sizeof...(R)> passes(std::integer_sequence<int, R...>) {
  return {&pass<R + 1>...};
}
constexpr auto kPasses = passes(std::make_integer_sequence<int, 16>{});

}  // namespace

namespace tokenleap_ops {

// x float32 [M, K], packed int8 [N/16, K/64, 16, 16, 4] (N a multiple of 32), scale float32 [N],
// inv_smooth float32 [K] -> float32 [M, N].
TL_W8A8 at::Tensor w8a8_product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                const at::Tensor& inv_smooth, int64_t block) {
  TORCH_CHECK(tokenleap_amx::permitted(), "w8a8_linear: AMX tiles are not available to this process");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "w8a8_linear: x must be float32 [M, K]");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == 16 && packed.size(4) == 4 && packed.size(0) % 2 == 0,
              "w8a8_linear: packed must be contiguous int8 [N/16, K/64, 16, 16, 4] with N a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(packed.size(1) * 64 == K, "w8a8_linear: x has ", K, " inputs, the weights ", packed.size(1) * 64);
  TORCH_CHECK(block >= 64 && block % 64 == 0 && K % block == 0, "w8a8_linear: block must be a multiple of 64 dividing K");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N,
              "w8a8_linear: scale must be float32 [N]");
  TORCH_CHECK(inv_smooth.scalar_type() == at::kFloat && inv_smooth.is_contiguous() && inv_smooth.numel() == K,
              "w8a8_linear: inv_smooth must be float32 [K]");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const int64_t nb = K / block;
  at::Tensor xq = at::empty({M, K}, at::kChar);
  at::Tensor d = at::empty({M, nb}, at::kFloat);
  at::Tensor tmp = at::empty({K}, at::kFloat);
  for (int64_t m = 0; m < M; ++m)
    quantize_row(xc.data_ptr<float>() + m * K, inv_smooth.data_ptr<float>(), K, block, xq.data_ptr<int8_t>() + m * K,
                 d.data_ptr<float>() + m * nb, tmp.data_ptr<float>());
  const int8_t* xp = xq.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N / 32, 4, [&](int64_t j0, int64_t j1) {
    tokenleap_amx::column_pairs(M, j0, j1, configure, [&](int64_t j, int64_t m0, int mr) {
      kPasses[mr - 1](xp + m0 * K, dp + m0 * nb, K, block, wp + j * 32 * K, sp + j * 32, yp + m0 * N + j * 32, N);
    });
  });
  return y;
}

}  // namespace tokenleap_ops

namespace {
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const at::Tensor& inv_smooth, int64_t block) {
  return tokenleap_ops::w8a8_product(x, packed, scale, inv_smooth, block);
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenleap, m) {
  m.def("w8a8_linear(Tensor x, Tensor packed, Tensor scale, Tensor inv_smooth, int block) -> Tensor");
}
TORCH_LIBRARY_IMPL(tokenleap, CPU, m) { m.impl("w8a8_linear", &w8a8_linear); }
