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
// Compiled for AVX2 machines too (function target attributes); ``amx_init`` asks Linux for the
// tile state and tells the caller whether these kernels may run.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "amx.h"
#include "ops.h"

#define TL_AMX __attribute__((target("amx-tile,amx-bf16,avx512f")))

namespace {

using tokenleap_amx::TileConfig;

// Tiles: 0, 1 accumulate rows [m0, m0 + ma) for column blocks j, j + 1; 2, 3 rows [m0 + 16, + mb);
// 4, 5 hold those rows' activations, 6, 7 the two weight blocks.
TL_AMX void configure(int ma, int mb) {
  TileConfig c;
  for (int t : {0, 1, 4}) c.rows[t] = ma, c.colsb[t] = 64;
  if (mb > 0)
    for (int t : {2, 3, 5}) c.rows[t] = mb, c.colsb[t] = 64;
  for (int t : {6, 7}) c.rows[t] = 16, c.colsb[t] = 64;
  TL_LOAD_TILE_CONFIG(c);
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
// The thread's tile configuration is kept (SavedTileConfig).
TL_AMX void column_blocks(const uint16_t* xb, int64_t M, int64_t K, const uint16_t* w, int64_t j0,
                          int64_t j1, float* y, int64_t N) {
  tokenleap_amx::SavedTileConfig keep;
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
}

}  // namespace

namespace tokenleap_ops {

// x float32 [M, K] @ W.T, W bfloat16 [N, K] packed [N/16, K/32, 16, 16, 2] -> float32 [M, N].
at::Tensor bf16_amx_product(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(tokenleap_amx::permitted(), "bf16_amx_linear: AMX tiles are not available to this process");
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

}  // namespace tokenleap_ops

namespace {
at::Tensor bf16_amx_linear(const at::Tensor& x, const at::Tensor& packed) {
  return tokenleap_ops::bf16_amx_product(x, packed);
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenleap, m) {
  m.def("bf16_amx_linear(Tensor x, Tensor packed) -> Tensor");
  m.def("amx_init() -> bool", &tokenleap_amx::permitted);
}
TORCH_LIBRARY_IMPL(tokenleap, CPU, m) {
  m.impl("bf16_amx_linear", &bf16_amx_linear);
}
