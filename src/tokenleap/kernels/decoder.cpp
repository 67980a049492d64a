// tokenleap CPU kernels (AVX2 + FMA), part 2: the decoder's attention calls (rotate, store, attend;
// contiguous and paged caches) and its fused elementwise steps. Every row is computed on its own, in
// a fixed order: row-invariant.

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

using tokenleap_ops::RowKeys;
using tokenleap_simd::exp_neg;

// ------------------------------------------------------------------------------ attention rows
// attend_rows: causal attention for a few new rows (decoding and verification). Row t (at position
// pos0 + t) attends to cache positions 0 .. pos0 + t; head h reads kv head h / (H / n_kv). The
// arithmetic is attention.cpp's attend_keys: every row is computed on its own, in a fixed order.

// Rows q [T, H, hd] at positions pos0 .. pos0+T-1; key / value j of kv head g at kp + g * ks0 +
// koff[j] (vp + g * vs0 + voff[j]): a contiguous cache (offsets j * stride) or a paged one.
// Row t attends to positions 0 .. pos0 + t.
at::Tensor attend_impl(const at::Tensor& q, const float* kp, const float* vp, int64_t ks0, int64_t vs0,
                       const std::vector<int64_t>& koff, const std::vector<int64_t>& voff, int64_t nkv,
                       int64_t pos0, double scale) {
  const int64_t T = q.size(0), L = static_cast<int64_t>(koff.size());
  TORCH_CHECK(pos0 >= 0 && pos0 + T <= L && voff.size() == koff.size(), "attend_rows: rows reach past the keys");
  std::vector<RowKeys> keys(T);
  for (int64_t t = 0; t < T; ++t) keys[t] = {koff.data(), voff.data(), pos0 + t + 1};
  return tokenleap_ops::attend_keys(q, kp, vp, ks0, vs0, keys, nkv, scale);
}

std::vector<int64_t> strided_offsets(int64_t L, int64_t stride) {
  std::vector<int64_t> off(L);
  for (int64_t j = 0; j < L; ++j) off[j] = j * stride;
  return off;
}

at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t pos0,
                       double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "attend_rows: q must be float32 [T, H, hd]");
  TORCH_CHECK(keys.dim() == 3 && values.sizes() == keys.sizes() && keys.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat && keys.stride(2) == 1 && values.stride(2) == 1,
              "attend_rows: keys / values must be float32 [n_kv, L, hd] with unit last stride");
  TORCH_CHECK(keys.size(2) == q.size(2), "attend_rows: head_dim");
  const int64_t L = keys.size(1);
  return attend_impl(q, keys.data_ptr<float>(), values.data_ptr<float>(), keys.stride(0), values.stride(0),
                     strided_offsets(L, keys.stride(1)), strided_offsets(L, values.stride(1)), keys.size(0), pos0, scale);
}

// ------------------------------------------------------------------------------- elementwise
// Fused row-local operations of the decoder, replacing several small torch ops each. Every row is
// computed on its own in a fixed order, so they are row-invariant.

// The sum of r[0 .. D)^2 in float64 (each square exact): four 4-lane accumulators over steps of 16,
// added in a fixed tree, then the tail in order -- the same order for every row, whatever the call.
inline double sum_squares(const float* r, int64_t D) {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    for (int h = 0; h < 2; ++h) {
      const __m256 v = _mm256_loadu_ps(r + d + 8 * h);
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
      acc[2 * h] = _mm256_fmadd_pd(lo, lo, acc[2 * h]);
      acc[2 * h + 1] = _mm256_fmadd_pd(hi, hi, acc[2 * h + 1]);
    }
  }
  alignas(32) double lane[4];
  _mm256_store_pd(lane, _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3])));
  double ss = (lane[0] + lane[1]) + (lane[2] + lane[3]);
  for (; d < D; ++d) ss += double(r[d]) * double(r[d]);
  return ss;
}

// y = w * x / sqrt(mean(x^2) + eps), per row. x float32 [M, D].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "rms_norm: float32 [M, D] input and weight");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = xc.size(0), D = xc.size(1);
  TORCH_CHECK(wc.numel() == D, "rms_norm: weight size");
  at::Tensor y = at::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // rows on their own: any split, the same values (up to 32 rows on one thread: a thread hand-off
  // costs more than their sums)
  at::parallel_for(0, M, 32, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* r = xp + m * D;
      const float inv = float(1.0 / std::sqrt(sum_squares(r, D) / double(D) + eps));
      for (int64_t d = 0; d < D; ++d) yp[m * D + d] = wp[d] * (r[d] * inv);
    }
  });
  return y;
}

// silu(g) * u for gate, up float32 [M, I] (rows may be strided, e.g. the halves of a joined
// gate/up product); silu(g) = g / (1 + e^-g), evaluated with e^-|g| (never overflows) and the
// same exp as attention.
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.scalar_type() == at::kFloat &&
                  up.scalar_type() == at::kFloat && gate.stride(1) == 1 && up.stride(1) == 1 && gate.size(1) % 8 == 0,
              "silu_mul: float32 [M, I] gate and up, I a multiple of 8, unit column stride");
  const int64_t M = gate.size(0), I = gate.size(1), gs = gate.stride(0), us = up.stride(0);
  at::Tensor y = at::empty({M, I}, gate.options());
  const float* gp = gate.data_ptr<float>();
  const float* upp = up.data_ptr<float>();
  float* o = y.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  at::parallel_for(0, M, 2, [&](int64_t m0, int64_t m1) {  // rows on their own: any split, the same values
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t i = 0; i < I; i += 8) {
        const __m256 g = _mm256_loadu_ps(gp + m * gs + i), u = _mm256_loadu_ps(upp + m * us + i);
        const __m256 e = exp_neg(_mm256_or_ps(g, sign));  // e^-|g|
        const __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
        // g >= 0: g / (1 + e^-g);  g < 0: g e^g / (1 + e^g)
        const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), neg);
        _mm256_storeu_ps(o + m * I + i, _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(one, e)), u));
      }
  });
  return y;
}

using tokenleap_ops::rope_vec;

// In place: rotary embedding (half-split layout) of x float32 [M, H, hd] at positions [M],
// with cos / sin tables float32 [max_pos, hd].
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && x.scalar_type() == at::kFloat, "rope_: contiguous float32 [M, H, hd]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == x.size(0), "rope_: int64 positions [M]");
  const int64_t M = x.size(0), H = x.size(1), hd = x.size(2), half = hd / 2;
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous(), pc = positions.contiguous();
  const float* cp = cc.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  const int64_t* pp = pc.data_ptr<int64_t>();
  float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(pp[m] >= 0 && pp[m] < cc.size(0), "rope_: position out of range");
    const float* c = cp + pp[m] * hd;
    const float* s = sp + pp[m] * hd;
    for (int64_t h = 0; h < H; ++h) rope_vec(xp + (m * H + h) * hd, c, s, half);
  }
}

// The decode / verification attention of one sequence in one call: rotate q and k at positions
// pos0 .. pos0+T-1, store k and v into that sequence's cache entries, attend (as attend_rows).
// q [T, H, hd], k, v [T, n_kv, hd] (views with unit last stride). Cache entry j < pos0 + T of kv head g is at
// kbase + g * ks0 + koff[j] (values likewise): the same arithmetic as rope_ + a cache write +
// attend_rows, for a contiguous or a paged cache.
at::Tensor rope_store_attend_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                  const at::Tensor& sin, float* kbase, float* vbase, int64_t ks0, int64_t vs0,
                                  const std::vector<int64_t>& koff, const std::vector<int64_t>& voff, int64_t pos0,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                  q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  k.stride(2) == 1 && v.stride(2) == 1,
              "rope_store_attend: float32 q [T, H, hd], k / v [T, n_kv, hd] with unit last strides");
  const int64_t T = q.size(0), nkv = k.size(1), hd = q.size(2);
  TORCH_CHECK(k.size(2) == hd, "rope_store_attend: shapes");
  TORCH_CHECK(pos0 >= 0 && pos0 + T == static_cast<int64_t>(koff.size()) && koff.size() == voff.size() &&
                  pos0 + T <= cos.size(0),
              "rope_store_attend: positions (offsets for exactly positions 0 .. pos0+T-1)");
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  const float* cp = cc.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  at::Tensor qr = q.contiguous().clone();  // [T, H, hd]
  float* qp = qr.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    tokenleap_ops::rotate_store_row(qp + t * q.size(1) * hd, q.size(1), kp + t * k.stride(0), k.stride(1),
                                    vp + t * v.stride(0), v.stride(1), nkv, kbase + koff[pos0 + t],
                                    vbase + voff[pos0 + t], ks0, vs0, cp + (pos0 + t) * hd, sp + (pos0 + t) * hd, hd);
  }
  return attend_impl(qr, kbase, vbase, ks0, vs0, koff, voff, nkv, pos0, scale);
}

// Contiguous cache: k_store, v_store [n_kv, max_len, hd] (one slot, unit last stride).
at::Tensor rope_store_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                             const at::Tensor& sin, at::Tensor& k_store, at::Tensor& v_store, int64_t pos0,
                             double scale) {
  TORCH_CHECK(k_store.dim() == 3 && k_store.sizes() == v_store.sizes() && k_store.scalar_type() == at::kFloat &&
                  v_store.scalar_type() == at::kFloat && k_store.stride(2) == 1 && v_store.stride(2) == 1 &&
                  k_store.size(0) == k.size(1) && k_store.size(2) == q.size(2),
              "rope_store_attend: float32 stores [n_kv, max_len, hd], unit last strides");
  TORCH_CHECK(pos0 + q.size(0) <= k_store.size(1), "rope_store_attend: positions past the store");
  const int64_t L = pos0 + q.size(0);
  return rope_store_attend_impl(q, k, v, cos, sin, k_store.data_ptr<float>(), v_store.data_ptr<float>(),
                                k_store.stride(0), v_store.stride(0), strided_offsets(L, k_store.stride(1)),
                                strided_offsets(L, v_store.stride(1)), pos0, scale);
}

// Paged cache: pools [n_kv, num_blocks, block_size, hd] (unit last stride); table: the sequence's
// blocks, covering positions 0 .. pos0+T-1 (position p in block table[p / block_size]).
at::Tensor rope_store_attend_paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                   const at::Tensor& sin, at::Tensor& k_pool, at::Tensor& v_pool, at::IntArrayRef table,
                                   int64_t pos0, double scale) {
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.scalar_type() == at::kFloat &&
                  v_pool.scalar_type() == at::kFloat && k_pool.stride(3) == 1 && v_pool.stride(3) == 1 &&
                  k_pool.size(0) == k.size(1) && k_pool.size(3) == q.size(2),
              "rope_store_attend_paged: float32 pools [n_kv, blocks, block_size, hd], unit last strides");
  const int64_t L = pos0 + q.size(0), bs = k_pool.size(2);
  TORCH_CHECK(static_cast<int64_t>(table.size()) * bs >= L, "rope_store_attend_paged: the block table is too short");
  std::vector<int64_t> koff(L), voff(L);
  for (int64_t j = 0; j < L; ++j) {
    const int64_t b = table[j / bs];
    TORCH_CHECK(b >= 0 && b < k_pool.size(1), "rope_store_attend_paged: block id out of range");
    koff[j] = b * k_pool.stride(1) + (j % bs) * k_pool.stride(2);
    voff[j] = b * v_pool.stride(1) + (j % bs) * v_pool.stride(2);
  }
  return rope_store_attend_impl(q, k, v, cos, sin, k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
                                k_pool.stride(0), v_pool.stride(0), koff, voff, pos0, scale);
}

}  // namespace

namespace tokenleap_ops {
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& w, double eps) { return rms_norm(x, w, eps); }
at::Tensor silu_mul_rows(const at::Tensor& gate, const at::Tensor& up) { return silu_mul(gate, up); }
at::Tensor rope_store_attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_store,
                                  at::Tensor& v_store, int64_t pos0, double scale) {
  return rope_store_attend(q, k, v, cos, sin, k_store, v_store, pos0, scale);
}
at::Tensor rope_store_attend_paged_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_pool,
                                        at::Tensor& v_pool, at::IntArrayRef table, int64_t pos0, double scale) {
  return rope_store_attend_paged(q, k, v, cos, sin, k_pool, v_pool, table, pos0, scale);
}
}  // namespace tokenleap_ops

TORCH_LIBRARY_FRAGMENT(tokenleap, m) {
  m.def("attend_rows(Tensor q, Tensor keys, Tensor values, int pos0, float scale) -> Tensor");
  m.def("rope_store_attend(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_store, Tensor(b!) v_store, int pos0, float scale) -> Tensor");
  m.def("rope_store_attend_paged(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, int[] table, int pos0, float scale) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin, Tensor positions) -> ()");
}
TORCH_LIBRARY_IMPL(tokenleap, CPU, m) {
  m.impl("attend_rows", &attend_rows);
  m.impl("rope_store_attend", &rope_store_attend);
  m.impl("rope_store_attend_paged", &rope_store_attend_paged);
  m.impl("silu_mul", &silu_mul);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_", &rope_);
}
