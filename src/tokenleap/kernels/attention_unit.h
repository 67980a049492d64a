// The attention of a step's new rows over their keys, as a template over the vector arithmetic of
// the dot products and the weighted value sums (V: attention.cpp's AVX2 helpers, or
// attention512.cpp's AVX-512 ones); everything else -- units, the shared-key passes, max, exp and
// sums -- is the same code for both. Included by those two files only, each compiling it for its
// own instruction set (hence the anonymous namespace: nothing here is shared between them).
//
// Each (row, head) is computed in a fixed order -- scores, max, exp, sum, weighted values -- that
// depends only on its own keys, so a row's output is bitwise the same whatever else shares the call.
// The work is split into units: the query heads of one kv head (or a part of them, where there are
// more threads than kv heads) over a run of rows. The keys all rows of a unit see in the same order
// (their lists' common prefix: the committed cache) are read once per block for every (row, head)
// of the unit, from L1, instead of once per (row, head) from memory: a 1.5B model's six query heads
// per kv head, and a verification step's rows, share one pass over the cache. Within a block, two
// (row, head)s go together (V::scores8x2, bitwise V::scores8 for each), so each key and value vector
// is loaded into a register once for both.
//
// V provides, for hd a multiple of its vector width:
//   __m256 scores8(q, kb, ko, hd, sc)        lane i = sc * q . k_i for the 8 keys at kb + ko[0 .. 8)
//   void scores8x2(qa, qb, kb, ko, hd, sc, sa, sb)   scores8 for two queries, the same bits
//   float dot(q, k, hd)                      q . k for one key (a row's last keys, past its 8-blocks)
//   Values                                   ValueSums<its vector type>: the weighted value sums
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
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

// Lane i = the sum of a[i]'s lanes, for 4 vectors, in hsum8x8's order (the halves' sums of pairs, then
// the low half's plus the high half's), so a score is the same bits whichever of the two forms it.
inline __m128 hsum4x8(const __m256* a) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// fn(std::integral_constant<int, min(n, R)>) for 1 <= n: a run-time count of vectors as a template's
template <int R, class Fn>
inline void with_count(int64_t n, Fn&& fn) {
  if constexpr (R > 1) {
    if (n < R) return with_count<R - 1>(n, fn);
  }
  fn(std::integral_constant<int, R>{});
}

// The weighted value sums on vectors of F::kWidth floats (F: the vector type T and its loadu, storeu,
// set1 and fmadd; F::kPairVectors: the vectors of sums two (row, head)s keep in registers together).
// acc[0 .. hd) += w[i] * v_i for i ascending, kept in memory between calls: per float the same
// chain of FMAs as one pass over every key, whatever the vector width.
template <class F>
struct ValueSums {
  static constexpr int W = F::kWidth;

  // acc[c .. c + W * R) for one (row, head)
  template <int R>
  static void one(const float* w, int64_t i0, int64_t i1, const float* vb, const int64_t* voff, int64_t c,
                  float* acc_mem) {
    typename F::T acc[R];
    for (int r = 0; r < R; ++r) acc[r] = F::loadu(acc_mem + c + W * r);
    for (int64_t i = i0; i < i1; ++i) {
      const typename F::T p = F::set1(w[i]);
      const float* vv = vb + voff[i] + c;
      for (int r = 0; r < R; ++r) acc[r] = F::fmadd(p, F::loadu(vv + W * r), acc[r]);
    }
    for (int r = 0; r < R; ++r) F::storeu(acc_mem + c + W * r, acc[r]);
  }

  static void all(const float* w, int64_t i0, int64_t i1, const float* vb, const int64_t* voff, int64_t hd,
                  float* acc) {
    if (i1 <= i0) return;
    for (int64_t c = 0; c < hd; c += 8 * W)
      with_count<8>((hd - c) / W, [&](auto r) { one<decltype(r)::value>(w, i0, i1, vb, voff, c, acc); });
  }

  // one() for two (row, head)s at once (weights wa, wb; sums acc_a, acc_b): each value vector loaded
  // once for both, the same chain of FMAs per float
  template <int R>
  static void two(const float* wa, const float* wb, int64_t i0, int64_t i1, const float* vb, const int64_t* voff,
                  int64_t c, float* acc_a, float* acc_b) {
    typename F::T a[R], b[R];
    for (int r = 0; r < R; ++r) {
      a[r] = F::loadu(acc_a + c + W * r);
      b[r] = F::loadu(acc_b + c + W * r);
    }
    for (int64_t i = i0; i < i1; ++i) {
      const typename F::T pa = F::set1(wa[i]), pb = F::set1(wb[i]);
      const float* vv = vb + voff[i] + c;
      for (int r = 0; r < R; ++r) {
        const typename F::T v = F::loadu(vv + W * r);
        a[r] = F::fmadd(pa, v, a[r]);
        b[r] = F::fmadd(pb, v, b[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      F::storeu(acc_a + c + W * r, a[r]);
      F::storeu(acc_b + c + W * r, b[r]);
    }
  }

  static void all2(const float* wa, const float* wb, int64_t i0, int64_t i1, const float* vb, const int64_t* voff,
                   int64_t hd, float* acc_a, float* acc_b) {
    if (i1 <= i0) return;
    for (int64_t c = 0; c < hd; c += F::kPairVectors * W)
      with_count<F::kPairVectors>((hd - c) / W, [&](auto r) {
        two<decltype(r)::value>(wa, wb, i0, i1, vb, voff, c, acc_a, acc_b);
      });
  }
};

struct Unit {
  int64_t t0, t1, h0, h1;  // rows [t0, t1) and query heads [h0, h1), all of one kv head
};

// Scratch of one thread, reused across its units.
struct Scratch {
  std::vector<float> w, acc, mx, inv;
};

// One unit: rows of q [T, H, hd] at qp, outputs at op; the unit's kv head's keys / values at kb / vb.
template <class V>
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
      V::scores8x2(qrow(p), qrow(p + 1), kb, first.ko + j, hd, sc, sa, sb);
      keep(p, j, sa);
      keep(p + 1, j, sb);
    }
    if (p < P) keep(p, j, V::scores8(qrow(p), kb, first.ko + j, hd, sc));
  }
  // each (row, head): the rest of its scores, as 8-wide blocks then one by one; exp and their sum
  for (int64_t p = 0; p < P; ++p) {
    const RowKeys& k = keys[u.t0 + p / nh];
    const float* qv = qrow(p);
    float* w = s.w.data() + p * stride;
    __m256 mxv = _mm256_loadu_ps(s.mx.data() + p * 8);
    int64_t j = blocks;
    for (; j + 8 <= k.n; j += 8) {
      const __m256 sv = V::scores8(qv, kb, k.ko + j, hd, sc);
      _mm256_storeu_ps(w + j, sv);
      mxv = _mm256_max_ps(mxv, sv);
    }
    alignas(32) float m8[8];
    _mm256_store_ps(m8, mxv);
    float mx = m8[0];
    for (int i = 1; i < 8; ++i) mx = std::max(mx, m8[i]);
    for (; j < k.n; ++j) {
      w[j] = V::dot(qv, kb + k.ko[j], hd) * scale;
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
      V::Values::all2(s.w.data() + p * stride, s.w.data() + (p + 1) * stride, i0, i1, vb, first.vo, hd,
                      s.acc.data() + p * hd, s.acc.data() + (p + 1) * hd);
    if (p < P) V::Values::all(s.w.data() + p * stride, i0, i1, vb, first.vo, hd, s.acc.data() + p * hd);
  }
  for (int64_t p = 0; p < P; ++p) {
    const int64_t t = u.t0 + p / nh;
    float* acc = s.acc.data() + p * hd;
    V::Values::all(s.w.data() + p * stride, shared, keys[t].n, vb, keys[t].vo, hd, acc);
    float* o = op + (t * H + u.h0 + p % nh) * hd;
    const __m256 iv = _mm256_set1_ps(s.inv[p]);
    for (int64_t c = 0; c < hd; c += 8) _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(acc + c), iv));
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Rows q [T, H, hd]; row t attends to keys[t].n keys, the j-th of kv head g at kp + g * ks0 +
// keys[t].ko[j] (values at vp + g * vs0 + keys[t].vo[j]). See tokenleap_ops::attend_keys.
template <class V>
at::Tensor attend_keys_t(const at::Tensor& q, const float* kp, const float* vp, int64_t ks0, int64_t vs0,
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
      attend_unit<V>(u, qp, op, kp + g * ks0, vp + g * vs0, keys, H, hd, sc, s);
    }
  });
  return out;
}

}  // namespace
