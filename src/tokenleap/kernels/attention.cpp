// tokenleap CPU kernels (AVX2 + FMA): attention of a step's new rows over their keys
// (decoding, verification, token trees), replacing one scaled_dot_product_attention call per row.
// The algorithm is attention_unit.h's; this file gives it AVX2 dot products and value sums, and
// hands whole calls to attention512.cpp's AVX-512 ones where the CPU has them (attention512_takes).
#include <ATen/ATen.h>
#include <immintrin.h>

#include "attention_unit.h"

namespace {

// attention_unit.h's vector arithmetic on 8-float vectors (hd a multiple of 8).
struct Avx2 {
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

  // acc[c .. c + 8R) += w[i] * v_i[c .. c + 8R) for i in [i0, i1), ascending (acc kept in memory
  // between calls: the same chain of FMAs per element as one pass over every key)
  template <int R>
  static void add_values(const float* w, int64_t i0, int64_t i1, const float* vb, const int64_t* voff, int64_t c,
                         float* acc_mem) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_loadu_ps(acc_mem + c + 8 * r);
    for (int64_t i = i0; i < i1; ++i) {
      const __m256 p = _mm256_set1_ps(w[i]);
      const float* vv = vb + voff[i] + c;
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vv + 8 * r), acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc_mem + c + 8 * r, acc[r]);
  }

  static void add_values_all(const float* w, int64_t i0, int64_t i1, const float* vb, const int64_t* voff, int64_t hd,
                             float* acc) {
    if (i1 <= i0) return;
    for (int64_t c = 0; c < hd; c += 64) {
      switch (std::min<int64_t>(8, (hd - c) / 8)) {
        case 8: add_values<8>(w, i0, i1, vb, voff, c, acc); break;
        case 7: add_values<7>(w, i0, i1, vb, voff, c, acc); break;
        case 6: add_values<6>(w, i0, i1, vb, voff, c, acc); break;
        case 5: add_values<5>(w, i0, i1, vb, voff, c, acc); break;
        case 4: add_values<4>(w, i0, i1, vb, voff, c, acc); break;
        case 3: add_values<3>(w, i0, i1, vb, voff, c, acc); break;
        case 2: add_values<2>(w, i0, i1, vb, voff, c, acc); break;
        default: add_values<1>(w, i0, i1, vb, voff, c, acc); break;
      }
    }
  }

  // add_values for two (row, head)s at once (weights wa, wb; sums acc_a, acc_b): each value vector
  // is loaded once for both. Per element the same ascending chain of FMAs as add_values.
  template <int R>
  static void add_values2(const float* wa, const float* wb, int64_t i0, int64_t i1, const float* vb,
                          const int64_t* voff, int64_t c, float* acc_a, float* acc_b) {
    __m256 a[R], b[R];
    for (int r = 0; r < R; ++r) {
      a[r] = _mm256_loadu_ps(acc_a + c + 8 * r);
      b[r] = _mm256_loadu_ps(acc_b + c + 8 * r);
    }
    for (int64_t i = i0; i < i1; ++i) {
      const __m256 pa = _mm256_set1_ps(wa[i]), pb = _mm256_set1_ps(wb[i]);
      const float* vv = vb + voff[i] + c;
      for (int r = 0; r < R; ++r) {
        const __m256 v = _mm256_loadu_ps(vv + 8 * r);
        a[r] = _mm256_fmadd_ps(pa, v, a[r]);
        b[r] = _mm256_fmadd_ps(pb, v, b[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(acc_a + c + 8 * r, a[r]);
      _mm256_storeu_ps(acc_b + c + 8 * r, b[r]);
    }
  }

  static void add_values_all2(const float* wa, const float* wb, int64_t i0, int64_t i1, const float* vb,
                              const int64_t* voff, int64_t hd, float* acc_a, float* acc_b) {
    if (i1 <= i0) return;
    for (int64_t c = 0; c < hd; c += 32) {
      switch (std::min<int64_t>(4, (hd - c) / 8)) {
        case 4: add_values2<4>(wa, wb, i0, i1, vb, voff, c, acc_a, acc_b); break;
        case 3: add_values2<3>(wa, wb, i0, i1, vb, voff, c, acc_a, acc_b); break;
        case 2: add_values2<2>(wa, wb, i0, i1, vb, voff, c, acc_a, acc_b); break;
        default: add_values2<1>(wa, wb, i0, i1, vb, voff, c, acc_a, acc_b); break;
      }
    }
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
