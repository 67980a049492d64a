// tokenleap CPU kernels, part 5: 4-bit weights times int8 activations (W4A8), row-invariant.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "ops.h"
#include "simd.h"

namespace {

using tokenleap_simd::bcast4;

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
// Packed layouts. A k-step of a column block is [8 columns][4 bytes]: byte (c, t) of k-step k0 holds
// q[c, k0 + t] in its low nibble and q[c, k0 + 4 + t] in its high nibble, so a 32-byte load
// unpacks (and / shift+and) into two vectors that line up with 4 broadcast activation bytes; a
// block's 32-input group is 4 k-steps (128 bytes), its scales and mins 8 + 8 float16.
// - blocked: [N/8 column blocks][K/8 k-steps][8][4], scales and mins [N/8][K/32][2][8] -- each
//   block's groups one after another (the AVX2 tile reads one block at a time);
// - paired: [N/16 pairs of blocks][K/32 groups][2 blocks][128], scales and mins
//   [N/16][K/32][2 blocks][2][8] -- a pair's two blocks alternate group by group, so the tiles that
//   take both blocks at once (vnni.cpp, amx_int.cpp) read one forward stream. (Reading two
//   blocks K*4 bytes apart at once held them to 26 GB/s against 45 for one stream on a Zen 4.)
// ``pack_int4`` packs in the layout of the CPU's fastest kernel: paired where AVX-512 VNNI is.
constexpr int64_t kGroup = 32;

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

// Rows [0, MB) of quantized x times one column block (8 outputs) at wb / smb, its groups gs bytes
// apart and their scales and mins ss halves apart (blocked layout: 128 and 16; paired: 256 and 32,
// read only where a VNNI CPU's tiles are turned off). (Two blocks per tile, sharing each activation
// broadcast, measured no faster: the accumulators spill.)
template <int MB>
inline void int4_tile(const int8_t* xq, const float* a, const float* as, int64_t K, const uint8_t* wb,
                      const uint16_t* smb, float* y, int64_t ldy, int64_t gs, int64_t ss) {
  const int64_t G = K / kGroup;
  const __m256i mask = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i s16[MB];
    for (int m = 0; m < MB; ++m) s16[m] = _mm256_setzero_si256();
    const auto step = [&](int st) {
      const uint8_t* p = wb + g * gs + st * 32;
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
    const uint16_t* sp = smb + g * ss;
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
  const bool paired = packed.dim() == 4 && packed.size(2) == 2 && packed.size(3) == 128;
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  (paired || (packed.size(2) == 8 && packed.size(3) == 4)),
              "int4_linear: packed must be contiguous uint8 [N/8, K/8, 8, 4] or [N/16, K/32, 2, 128]");
  const int64_t M = x.size(0), K = x.size(1), NB8 = packed.size(0) * (paired ? 2 : 1), N = NB8 * 8, G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0 && packed.size(1) * (paired ? kGroup : 8) == K,
              "int4_linear: K must be a multiple of 32 and match packed");
  TORCH_CHECK(sm.scalar_type() == at::kHalf && sm.is_contiguous() && sm.numel() == NB8 * G * 16,
              "int4_linear: scales/mins must be contiguous float16 [N/8, K/32, 2, 8] or [N/16, K/32, 2, 2, 8]");
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
  // rows on their own (any split, the same values); a few rows stay on one thread
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(xp + m * K, K, qp + m * K, scp + m * G, ssp + m * G);
  });
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(sm.data_ptr<at::Half>());
  float* out = y.data_ptr<float>();
  if (paired && tokenleap_ops::amx_int8_takes(M, N)) {  // bitwise the same values
    tokenleap_ops::int4_amx_product(qp, scp, ssp, M, K, w, s, out, N);
    if (bp != nullptr) tokenleap_simd::add_bias_rows(out, bp, M, N);
    return y;
  }
  if (paired && tokenleap_ops::vnni_takes()) {  // bitwise the same values
    tokenleap_ops::int4_vnni_product(qp, scp, ssp, M, K, w, s, out, N);
    if (bp != nullptr) tokenleap_simd::add_bias_rows(out, bp, M, N);
    return y;
  }
  // Each thread walks its column blocks in memory order (blocked: one block is K*4 contiguous bytes),
  // all rows of a block before the next: a single forward stream, which the prefetchers keep up with
  // (two interleaved streams ran at ~12 GB/s instead of ~18 on short K).
  const int64_t gs = paired ? 256 : 128, hs = paired ? 32 : 16;  // group strides: bytes, halves
  at::parallel_for(0, NB8, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* wb = paired ? w + (b >> 1) * K * 8 + (b & 1) * 128 : w + b * K * 4;
      const uint16_t* sb = paired ? s + (b >> 1) * G * 32 + (b & 1) * 16 : s + b * G * 16;
      for (int64_t m = 0; m < M;) {
        const int8_t* xm = qp + m * K;
        const float *am = scp + m * G, *sm2 = ssp + m * G;
        float* ym = out + m * N + b * 8;
        const int64_t left = M - m;
        // a 6-row tile for 6+ rows (a 6-row verification step in one pass over the weights:
        // relative to one row, 6 rows of the 1.5B model cost 1.6-1.8x instead of 2.1-2.3x as 3 + 3)
        // and a 5-row tile for 5 (one pass over the weights instead of 3 + 2)
        const int64_t take = left >= 5 ? std::min<int64_t>(left, 6) : tokenleap_simd::tile_rows(left);
        if (take == 6) int4_tile<6>(xm, am, sm2, K, wb, sb, ym, N, gs, hs);
        else if (take == 5) int4_tile<5>(xm, am, sm2, K, wb, sb, ym, N, gs, hs);
        else if (take == 4) int4_tile<4>(xm, am, sm2, K, wb, sb, ym, N, gs, hs);
        else if (take == 3) int4_tile<3>(xm, am, sm2, K, wb, sb, ym, N, gs, hs);
        else if (take == 2) int4_tile<2>(xm, am, sm2, K, wb, sb, ym, N, gs, hs);
        else int4_tile<1>(xm, am, sm2, K, wb, sb, ym, N, gs, hs);
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
}  // namespace tokenleap_ops

TORCH_LIBRARY_FRAGMENT(tokenleap, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor sm, Tensor? bias=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(tokenleap, CPU, m) { m.impl("int4_linear", &int4_linear); }
