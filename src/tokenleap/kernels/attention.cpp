// tokenleap CPU kernels (AVX2 + FMA): attention of a step's new rows over their keys
// (decoding, verification, token trees), replacing one scaled_dot_product_attention call per row.
//
// Each (row, head) is computed in a fixed order -- scores, max, exp, sum, weighted values -- that
// depends only on its own keys, so a row's output is bitwise the same whatever else shares the call.
// The work is split into units: the query heads of one kv head (or a part of them, where there are
// more threads than kv heads) over a run of rows. The keys all rows of a unit see in the same order
// (their lists' common prefix: the committed cache) are read once per block for every (row, head)
// of the unit, from L1, instead of once per (row, head) from memory: a 1.5B model's six query heads
// per kv head, and a verification step's rows, share one pass over the cache. Within a block, two
// (row, head)s go together, so each key and value vector is loaded into a register once for both.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using tokenleap_ops::RowKeys;
using tokenleap_simd::exp_neg;
using tokenleap_simd::hsum8;

constexpr int64_t kUnitRows = 16;   // rows of one unit at most (bounds its score buffer)
constexpr int64_t kValueBlock = 16;  // shared values weighed per pass over the unit's (row, head)s

// 8 sums at once: lane i = sum of the lanes of a[i]
inline __m256 hsum8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Scaled scores of the 8 keys at kb + ko[0 .. 8) against the query qv [hd]: lane i = sc * q . k_i.
inline __m256 scores8(const float* qv, const float* kb, const int64_t* ko, int64_t hd, __m256 sc) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < hd; d += 8) {
    const __m256 qd = _mm256_loadu_ps(qv + d);
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kb + ko[i] + d), acc[i]);
  }
  return _mm256_mul_ps(hsum8x8(acc), sc);
}

// Lane i = the sum of a[i]'s lanes, for 4 vectors, in hsum8x8's order (the halves' sums of pairs, then
// the low half's plus the high half's), so a score is the same bits whichever of the two forms it.
inline __m128 hsum4x8(const __m256* a) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// scores8 for two queries at once (qa, qb: [hd]) against the same 8 keys: each key vector is
// loaded once for both, 4 keys at a time (8 accumulators: AVX2 has 16 registers). Every score is
// the same chain of FMAs and the same sum as scores8's, so the bits are the same.
inline void scores8x2(const float* qa, const float* qb, const float* kb, const int64_t* ko, int64_t hd, __m256 sc,
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
inline void add_values(const float* w, int64_t i0, int64_t i1, const float* vb, const int64_t* voff, int64_t c,
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

inline void add_values_all(const float* w, int64_t i0, int64_t i1, const float* vb, const int64_t* voff, int64_t hd,
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
inline void add_values2(const float* wa, const float* wb, int64_t i0, int64_t i1, const float* vb,
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

inline void add_values_all2(const float* wa, const float* wb, int64_t i0, int64_t i1, const float* vb,
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

struct Unit {
  int64_t t0, t1, h0, h1;  // rows [t0, t1) and query heads [h0, h1), all of one kv head
};

// Scratch of one thread, reused across its units.
struct Scratch {
  std::vector<float> w, acc, mx, inv;
};

// One unit: rows of q [T, H, hd] at qp, outputs at op; the unit's kv head's keys / values at kb / vb.
void attend_unit(const Unit& u, const float* qp, float* op, const float* kb, const float* vb,
                 const std::vector<RowKeys>& keys, int64_t H, int64_t hd, float scale, Scratch& s) {
  const int64_t nh = u.h1 - u.h0, P = (u.t1 - u.t0) * nh;
  const RowKeys& first = keys[u.t0];
  int64_t shared = first.n, L = first.n;  // shared: the common prefix of the rows' key lists
  for (int64_t t = u.t0 + 1; t < u.t1; ++t) {
    const RowKeys& k = keys[t];
    L = std::max(L, k.n);
    shared = std::min(shared, k.n);
    if (k.ko != first.ko || k.vo != first.vo) {
      int64_t j = 0;
      while (j < shared && k.ko[j] == first.ko[j] && k.vo[j] == first.vo[j]) ++j;
      shared = j;
    }
  }
  const int64_t stride = L + 8;
  s.w.resize(P * stride);
  s.acc.assign(P * hd, 0.f);
  s.mx.assign(P * 8, -INFINITY);
  s.inv.resize(P);
  const __m256 sc = _mm256_set1_ps(scale);
  const auto qrow = [&](int64_t p) { return qp + ((u.t0 + p / nh) * H + u.h0 + p % nh) * hd; };
  // scores of the shared keys, 8 at a time: every row's first blocks of 8 (which keys take the
  // 8-wide path depends only on the row's own key count, and every row has at least `shared`)
  const int64_t blocks = shared / 8 * 8;
  const auto keep = [&](int64_t p, int64_t j, __m256 sv) {
    _mm256_storeu_ps(s.w.data() + p * stride + j, sv);
    _mm256_storeu_ps(s.mx.data() + p * 8, _mm256_max_ps(_mm256_loadu_ps(s.mx.data() + p * 8), sv));
  };
  for (int64_t j = 0; j < blocks; j += 8) {
    int64_t p = 0;
    for (; p + 2 <= P; p += 2) {  // two (row, head)s per pass over the block's keys
      __m256 sa, sb;
      scores8x2(qrow(p), qrow(p + 1), kb, first.ko + j, hd, sc, sa, sb);
      keep(p, j, sa);
      keep(p + 1, j, sb);
    }
    if (p < P) keep(p, j, scores8(qrow(p), kb, first.ko + j, hd, sc));
  }
  // each (row, head): the rest of its scores, as 8-wide blocks then one by one; exp and their sum
  for (int64_t p = 0; p < P; ++p) {
    const RowKeys& k = keys[u.t0 + p / nh];
    const float* qv = qrow(p);
    float* w = s.w.data() + p * stride;
    __m256 mxv = _mm256_loadu_ps(s.mx.data() + p * 8);
    int64_t j = blocks;
    for (; j + 8 <= k.n; j += 8) {
      const __m256 sv = scores8(qv, kb, k.ko + j, hd, sc);
      _mm256_storeu_ps(w + j, sv);
      mxv = _mm256_max_ps(mxv, sv);
    }
    alignas(32) float m8[8];
    _mm256_store_ps(m8, mxv);
    float mx = m8[0];
    for (int i = 1; i < 8; ++i) mx = std::max(mx, m8[i]);
    for (; j < k.n; ++j) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t d = 0; d < hd; d += 8)
        a = _mm256_fmadd_ps(_mm256_loadu_ps(qv + d), _mm256_loadu_ps(kb + k.ko[j] + d), a);
      w[j] = hsum8(a) * scale;
      mx = std::max(mx, w[j]);
    }
    const int64_t n8 = (k.n + 7) / 8 * 8;  // exp(score - max), padded to whole 8-lane blocks
    for (int64_t i = k.n; i < n8; ++i) w[i] = -INFINITY;
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < n8; i += 8) {
      const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(w + i), mv));
      _mm256_storeu_ps(w + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    s.inv[p] = 1.f / hsum8(sum);
  }
  // values: the shared ones a block at a time for every (row, head), then each its own rest
  for (int64_t i0 = 0; i0 < shared; i0 += kValueBlock) {
    const int64_t i1 = std::min(shared, i0 + kValueBlock);
    int64_t p = 0;
    for (; p + 2 <= P; p += 2)
      add_values_all2(s.w.data() + p * stride, s.w.data() + (p + 1) * stride, i0, i1, vb, first.vo, hd,
                      s.acc.data() + p * hd, s.acc.data() + (p + 1) * hd);
    if (p < P) add_values_all(s.w.data() + p * stride, i0, i1, vb, first.vo, hd, s.acc.data() + p * hd);
  }
  for (int64_t p = 0; p < P; ++p) {
    const int64_t t = u.t0 + p / nh;
    float* acc = s.acc.data() + p * hd;
    add_values_all(s.w.data() + p * stride, shared, keys[t].n, vb, keys[t].vo, hd, acc);
    float* o = op + (t * H + u.h0 + p % nh) * hd;
    const __m256 iv = _mm256_set1_ps(s.inv[p]);
    for (int64_t c = 0; c < hd; c += 8) _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(acc + c), iv));
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

namespace tokenleap_ops {

// Rows q [T, H, hd]; row t attends to keys[t].n keys, the j-th of kv head g at kp + g * ks0 +
// keys[t].ko[j] (values at vp + g * vs0 + keys[t].vo[j]): a contiguous cache, a paged one, or a
// token tree's path. A (row, head) depends only on its own keys, in their order.
at::Tensor attend_keys(const at::Tensor& q, const float* kp, const float* vp, int64_t ks0, int64_t vs0,
                       const std::vector<RowKeys>& keys, int64_t nkv, double scale) {
  const at::Tensor qc = q.contiguous();
  const int64_t T = qc.size(0), H = qc.size(1), hd = qc.size(2);
  TORCH_CHECK(hd % 8 == 0 && H % nkv == 0, "attend_rows: head_dim % 8, shapes");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == T, "attend_rows: one key list per row");
  for (const auto& k : keys) TORCH_CHECK(k.n >= 1, "attend_rows: a row without keys");
  at::Tensor out = at::empty_like(qc);
  if (T == 0) return out;
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = H / nkv, threads = std::max<int64_t>(1, at::get_num_threads());
  // units: all of a kv head's query heads over up to kUnitRows rows, split (rows first) while
  // there are fewer units than threads
  int64_t rows = std::min(T, kUnitRows), heads = group;
  const auto units = [&](int64_t r, int64_t h) { return nkv * ceil_div(T, r) * ceil_div(group, h); };
  while (units(rows, heads) < threads && (rows > 1 || heads > 1)) {
    if (rows >= heads) rows = ceil_div(rows, 2);
    else heads = ceil_div(heads, 2);
  }
  const int64_t row_parts = ceil_div(T, rows), head_parts = ceil_div(group, heads);
  const float sc = float(scale);
  at::parallel_for(0, units(rows, heads), 1, [&](int64_t u0, int64_t u1) {
    Scratch s;
    for (int64_t i = u0; i < u1; ++i) {
      const int64_t g = i / (row_parts * head_parts), r = i / head_parts % row_parts, h = i % head_parts;
      const int64_t h0 = g * group + h * heads;
      const Unit u{r * rows, std::min(T, (r + 1) * rows), h0, std::min((g + 1) * group, h0 + heads)};
      attend_unit(u, qp, op, kp + g * ks0, vp + g * vs0, keys, H, hd, sc, s);
    }
  });
  return out;
}

}  // namespace tokenleap_ops
