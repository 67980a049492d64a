// tokenleap CPU kernels (AVX2 + FMA): attention of a step's new rows over their keys
// (decoding, verification, token trees), replacing one scaled_dot_product_attention call per row.
// The algorithm is attention_unit.h's; this file gives it AVX2 dot products and value sums, and
// hands whole calls to attention512.cpp's AVX-512 ones where the CPU has them (attention512_takes).
#include <ATen/ATen.h>
#include <immintrin.h>

#include "attention_unit.h"

namespace {

// 8-float vectors for ValueSums (two (row, head)s keep 4 vectors of sums each: AVX2 has 16 registers)
struct F8 {
  using T = __m256;
  static constexpr int kWidth = 8, kPairVectors = 4;
  static T loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
};

// attention_unit.h's vector arithmetic on 8-float vectors (hd a multiple of 8).
struct Avx2 {
  using Values = ValueSums<F8>;

  // Scaled scores of the 8 keys at kb + ko[0 .. 8) against the query qv [hd]: lane i = sc * q . k_i.
  static __m256 scores8(const float* qv, const float* kb, const int64_t* ko, int64_t hd, __m256 sc) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) {
      const __m256 qd = _mm256_loadu_ps(qv + d);
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kb + ko[i] + d), acc[i]);
    }
    return _mm256_mul_ps(hsum8x8(acc), sc);
  }

  // scores8 for two queries at once (qa, qb: [hd]) against the same 8 keys: each key vector is
  // loaded once for both, 4 keys at a time (8 accumulators: AVX2 has 16 registers). Every score is
  // the same chain of FMAs and the same sum as scores8's, so the bits are the same.
  static void scores8x2(const float* qa, const float* qb, const float* kb, const int64_t* ko, int64_t hd, __m256 sc,
                        __m256& sa, __m256& sb) {
    __m128 half[2][2];
    for (int h = 0; h < 2; ++h) {
      __m256 acc[2][4];
      for (int i = 0; i < 4; ++i) acc[0][i] = acc[1][i] = _mm256_setzero_ps();
      const float* k0 = kb + ko[4 * h];
      const float* k1 = kb + ko[4 * h + 1];
      const float* k2 = kb + ko[4 * h + 2];
      const float* k3 = kb + ko[4 * h + 3];
      for (int64_t d = 0; d < hd; d += 8) {
        const __m256 a = _mm256_loadu_ps(qa + d), b = _mm256_loadu_ps(qb + d);
        __m256 k = _mm256_loadu_ps(k0 + d);
        acc[0][0] = _mm256_fmadd_ps(a, k, acc[0][0]);
        acc[1][0] = _mm256_fmadd_ps(b, k, acc[1][0]);
        k = _mm256_loadu_ps(k1 + d);
        acc[0][1] = _mm256_fmadd_ps(a, k, acc[0][1]);
        acc[1][1] = _mm256_fmadd_ps(b, k, acc[1][1]);
        k = _mm256_loadu_ps(k2 + d);
        acc[0][2] = _mm256_fmadd_ps(a, k, acc[0][2]);
        acc[1][2] = _mm256_fmadd_ps(b, k, acc[1][2]);
        k = _mm256_loadu_ps(k3 + d);
        acc[0][3] = _mm256_fmadd_ps(a, k, acc[0][3]);
        acc[1][3] = _mm256_fmadd_ps(b, k, acc[1][3]);
      }
      half[0][h] = hsum4x8(acc[0]);
      half[1][h] = hsum4x8(acc[1]);
    }
    sa = _mm256_mul_ps(_mm256_set_m128(half[0][1], half[0][0]), sc);
    sb = _mm256_mul_ps(_mm256_set_m128(half[1][1], half[1][0]), sc);
  }

  // q . k for one key: 8-wide FMAs along the head, then one sum of the lanes
  static float dot(const float* qv, const float* kv, int64_t hd) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qv + d), _mm256_loadu_ps(kv + d), a);
    return hsum8(a);
  }
};

}  // namespace

namespace tokenleap_ops {

// Rows q [T, H, hd]; row t attends to keys[t].n keys, the j-th of kv head g at kp + g * ks0 +
// keys[t].ko[j] (values at vp + g * vs0 + keys[t].vo[j]): a contiguous cache, a paged one, or a
// token tree's path. A (row, head) depends only on its own keys, in their order -- and on which
// arithmetic the process takes (AVX-512 where the CPU has it and hd is a multiple of 16), which is
// fixed for a model, so every path of one process gives a row the same bits.
at::Tensor attend_keys(const at::Tensor& q, const float* kp, const float* vp, int64_t ks0, int64_t vs0,
                       const std::vector<RowKeys>& keys, int64_t nkv, double scale) {
  if (attention512_takes(q.size(-1))) return attend_keys_512(q, kp, vp, ks0, vs0, keys, nkv, scale);
  return attend_keys_t<Avx2>(q, kp, vp, ks0, vs0, keys, nkv, scale);
}

}  // namespace tokenleap_ops
