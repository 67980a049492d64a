// tokenleap CPU kernels, part 4: 6-bit weights (a GGUF's Q6_K blocks, exactly) times int8 activations.
//
// int6_linear: y = x W^T (+ bias) with W[n, k] = d[n, k / 256] * sc[n, k / 16] * (q[n, k] - 32),
// q in 0..63, sc int8, d float -- the values of llama.cpp's Q6_K, which Q4_K_M files use for the
// output layer and part of v_proj / down_proj. Each row of x is quantized to int8 per group of 32
// (xq = round(x / a), a = max|x| / 127), as for the int4 kernel; then per 16 inputs h
//   dot_h = sum_{k in h} q[n, k] xq[m, k] - 32 sum_{k in h} xq[m, k]     (exact, int32)
//   y[m, n] += float(dot_h) * (d sc_h a[m, g])                            (one FMA, ascending h)
// The integer products use vpmaddubsw on unsigned 6-bit weights and signed activations: two
// products summed in int16 stay below 2 * 2 * 63 * 127 < 32767, then widen to int32. One fixed
// float chain per output, every row quantized on its own: row-invariant for any number of rows.
// It reads 6.56 bits a weight (int8: 8) and does 32 multiply-adds an instruction (int8's float
// path: 8), so it is faster both when memory-bound (one row) and when compute-bound (verification,
// prefill).
//
// Packed layout: [N/8 column blocks][K/32 groups][208 bytes]; per group of 32 k and 8 columns
//   bytes   0..127: four k-steps st of 8 k, 32 bytes each; byte (c, t) holds q[c, k0 + t] & 15 in
//                   its low nibble and q[c, k0 + 4 + t] & 15 in its high nibble (k0 = 32 g + 8 st)
//   bytes 128..191: the top two bits of q, for the k-step pairs (0, 1) and (2, 3), 32 bytes each;
//                   byte (c, t) holds, from bit 0 up: q[c, k0a + t], q[c, k0a + 4 + t],
//                   q[c, k0b + t], q[c, k0b + 4 + t] >> 4 (k0a / k0b: the pair's first / second step)
//   bytes 192..207: sc as int8 [2 halves of 16 k][8 columns]
// and d float32 [N/8][K/256][8]. That is the blocked layout; the paired one, [N/16 pairs of
// blocks][K/32][2 blocks][208 bytes] with d [N/16][K/256][2 blocks][8], alternates a pair's two
// blocks group by group so that vnni.cpp's and amx_int.cpp's two-block tiles read one forward stream
// (int4.cpp's paired layout, for the same reason). ``pack_int6`` packs paired where the CPU has
// AVX-512 VNNI and N is a multiple of 16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "ops.h"
#include "simd.h"

namespace {

using tokenleap_simd::bcast4;

constexpr int64_t kGroup = 32, kGroupBytes = 208, kSuper = 256;

// Row x [K] -> xq int8 [K], a[g] per 32, sum16[h] = sum of xq over each 16.
inline void quantize_row(const float* x, int64_t K, int8_t* xq, float* a, int32_t* sum16) {
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const float* v = x + g * kGroup;
    float amax = 0.f;
    for (int i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m256 iv = _mm256_set1_ps(inv);
    for (int i = 0; i < kGroup; i += 8) {  // the same rounding as the int4 kernel (round to nearest even)
      alignas(32) int32_t r[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(r), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i), iv)));
      for (int t = 0; t < 8; ++t) xq[g * kGroup + i + t] = static_cast<int8_t>(r[t]);
    }
    a[g] = amax / 127.f;
    for (int h = 0; h < 2; ++h) {
      int32_t s = 0;
      for (int i = 0; i < 16; ++i) s += xq[g * kGroup + h * 16 + i];
      sum16[2 * g + h] = s;
    }
  }
}

// Rows [0, MB) of quantized x times one column block (8 outputs): its groups gs bytes apart, its
// super-blocks' d ds floats apart (blocked: 208 and 8; paired: 416 and 16, read only where the VNNI
// tiles are turned off).
template <int MB>
inline void int6_tile(const int8_t* xq, const float* a, const int32_t* sum16, int64_t K, const uint8_t* wb,
                      const float* db, float* y, int64_t ldy, int64_t gs = kGroupBytes, int64_t ds = 8) {
  const int64_t G = K / kGroup;
  const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  __m256 dv = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* p = wb + g * gs;
    _mm_prefetch(reinterpret_cast<const char*>(p) + 2048, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p) + 2048 + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p) + 2048 + 128, _MM_HINT_T0);
    if (g % (kSuper / kGroup) == 0) dv = _mm256_loadu_ps(db + (g / (kSuper / kGroup)) * ds);
    for (int h = 0; h < 2; ++h) {
      __m256i s32[MB];
      for (int m = 0; m < MB; ++m) s32[m] = _mm256_setzero_si256();
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + h * 32));
      const auto step = [&](int half) {
        const int st = 2 * h + half;
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + st * 32));
        const __m256i top_lo = half == 0 ? _mm256_and_si256(_mm256_slli_epi16(hb, 4), m2) : _mm256_and_si256(hb, m2);
        const __m256i top_hi = half == 0 ? _mm256_and_si256(_mm256_slli_epi16(hb, 2), m2)
                                         : _mm256_and_si256(_mm256_srli_epi16(hb, 2), m2);
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, m4), top_lo);
        const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), top_hi);
        for (int m = 0; m < MB; ++m) {
          const int8_t* xp = xq + m * K + g * kGroup + st * 8;
          const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xp)), _mm256_maddubs_epi16(hi, bcast4(xp + 4)));
          s32[m] = _mm256_add_epi32(s32[m], _mm256_madd_epi16(t, ones));
        }
      };
      if constexpr (MB <= 2) {
        step(0);
        step(1);
      } else {  // not unrolled: unrolling hoists every product and spills registers
#pragma GCC unroll 1
        for (int half = 0; half < 2; ++half) step(half);
      }
      const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 192 + h * 8));
      const __m256 sc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)), dv);  // d * sc, exact
      for (int m = 0; m < MB; ++m) {
        const __m256i dot = _mm256_sub_epi32(s32[m], _mm256_set1_epi32(32 * sum16[m * 2 * G + 2 * g + h]));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sc, _mm256_set1_ps(a[m * G + g])), acc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(y + m * ldy, acc[m]);
}

at::Tensor int6_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int6_linear: x must be float32 [M, K]");
  const bool paired = packed.dim() == 4 && packed.size(2) == 2;
  TORCH_CHECK(packed.dim() == (paired ? 4 : 3) && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(-1) == kGroupBytes,
              "int6_linear: packed must be contiguous uint8 [N/8, K/32, 208] or [N/16, K/32, 2, 208]");
  const int64_t M = x.size(0), K = x.size(1), NB8 = packed.size(0) * (paired ? 2 : 1), N = NB8 * 8, G = K / kGroup;
  TORCH_CHECK(K % kSuper == 0 && packed.size(1) == G, "int6_linear: K must be a multiple of 256 and match packed");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.numel() == NB8 * (K / kSuper) * 8,
              "int6_linear: d must be contiguous float32 [N/8, K/256, 8] or [N/16, K/256, 2, 8]");
  const float* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == N, "int6_linear: bias must be float32 [N]");
    bp = bc.data_ptr<float>();
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor av = at::empty({M, G}, x.options());
  at::Tensor sums = at::empty({M, 2 * G}, x.options().dtype(at::kInt));
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* ap = av.data_ptr<float>();
  int32_t* sp = sums.data_ptr<int32_t>();
  // rows on their own (any split, the same values); a few rows stay on one thread
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(xp + m * K, K, qp + m * K, ap + m * G, sp + m * 2 * G);
  });
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  float* out = y.data_ptr<float>();
  if (tokenleap_ops::amx_int8_takes(M, N)) {  // bitwise the same values
    tokenleap_ops::int6_amx_product(qp, ap, sp, M, K, w, dp, out, N, paired);
    if (bp != nullptr) tokenleap_simd::add_bias_rows(out, bp, M, N);
    return y;
  }
  if (tokenleap_ops::vnni_takes()) {  // bitwise the same values
    tokenleap_ops::int6_vnni_product(qp, ap, sp, M, K, w, dp, out, N, paired);
    if (bp != nullptr) tokenleap_simd::add_bias_rows(out, bp, M, N);
    return y;
  }
  at::parallel_for(0, NB8, 8, [&](int64_t b0, int64_t b1) {  // each thread streams its blocks in order
    for (int64_t b = b0; b < b1; ++b) {
      // paired: block b's groups every other 208 bytes of its pair's, its d every other 8
      const uint8_t* wb = paired ? w + (b >> 1) * G * 2 * kGroupBytes + (b & 1) * kGroupBytes : w + b * G * kGroupBytes;
      const float* db = paired ? dp + (b >> 1) * (K / kSuper) * 16 + (b & 1) * 8 : dp + b * (K / kSuper) * 8;
      const int64_t gs = paired ? 2 * kGroupBytes : kGroupBytes, ds = paired ? 16 : 8;
      for (int64_t m = 0; m < M;) {
        const int8_t* xm = qp + m * K;
        const float* am = ap + m * G;
        const int32_t* sm = sp + m * 2 * G;
        float* ym = out + m * N + b * 8;
        const int64_t take = tokenleap_simd::tile_rows(M - m);
        if (take == 4) int6_tile<4>(xm, am, sm, K, wb, db, ym, N, gs, ds);
        else if (take == 3) int6_tile<3>(xm, am, sm, K, wb, db, ym, N, gs, ds);
        else if (take == 2) int6_tile<2>(xm, am, sm, K, wb, db, ym, N, gs, ds);
        else int6_tile<1>(xm, am, sm, K, wb, db, ym, N, gs, ds);
        m += take;
      }
    }
  });
  if (bp != nullptr) tokenleap_simd::add_bias_rows(out, bp, M, N);
  return y;
}

}  // namespace

namespace tokenleap_ops {
at::Tensor int6_product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                        const c10::optional<at::Tensor>& bias) {
  return int6_linear(x, packed, d, bias);
}
}  // namespace tokenleap_ops

TORCH_LIBRARY_FRAGMENT(tokenleap, m) {
  m.def("int6_linear(Tensor x, Tensor packed, Tensor d, Tensor? bias=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(tokenleap, CPU, m) { m.impl("int6_linear", &int6_linear); }
