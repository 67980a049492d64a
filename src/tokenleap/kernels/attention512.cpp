// tokenleap CPU kernels: attention_unit.h's attention on AVX-512 vectors. A row's 128 head floats
// are 8 vector FMAs per key instead of 16, and a value pass keeps all 128 sums of a (row, head) in
// 8 of the 32 registers (16 for two). Where the FMA units are 512 bits wide (Intel Xeons) that
// doubles the arithmetic per cycle; where 512-bit work runs as two 256-bit halves (AMD Zen 4) it
// halves the instructions issued.
//
// A score sums the same products as attention.cpp's in another order (16 lanes folded to 8, then
// attention.cpp's 8-lane sum), so its bits may differ from the AVX2 kernel's; the weighted value
// sums are elementwise, the same chain of FMAs per float, so those are the AVX2 kernel's bits for the
// same weights. A process takes one kernel for every call (attention512_takes), so a row's output is
// still bitwise the same in every path and batch of that process.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "ops.h"
#include "simd.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512dq,avx512vl")
#include <immintrin.h>

#include "attention_unit.h"

namespace {

// 16-float vectors for ValueSums (two (row, head)s keep all 8 vectors of a 128-float head's sums each)
struct F16 {
  using T = __m512;
  static constexpr int kWidth = 16, kPairVectors = 8;
  static T loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
};

// attention_unit.h's vector arithmetic on 16-float vectors (hd a multiple of 16).
struct Avx512 {
  using Values = ValueSums<F16>;

  // The 16 lanes of a partial dot product folded to 8 (lane i + lane i + 8)
  static __m256 fold(__m512 a) { return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)); }

  // Scaled scores of the 8 keys at kb + ko[0 .. 8) against the query qv [hd]: lane i = sc * q . k_i.
  static __m256 scores8(const float* qv, const float* kb, const int64_t* ko, int64_t hd, __m256 sc) {
    __m512 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d += 16) {
      const __m512 qd = _mm512_loadu_ps(qv + d);
      for (int i = 0; i < 8; ++i) acc[i] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(kb + ko[i] + d), acc[i]);
    }
    __m256 a8[8];
    for (int i = 0; i < 8; ++i) a8[i] = fold(acc[i]);
    return _mm256_mul_ps(hsum8x8(a8), sc);
  }

  // scores8 for two queries against the same 8 keys, 4 keys at a time, each key vector loaded once
  // for both; per score the same FMAs, fold and sum as scores8: the same bits.
  static void scores8x2(const float* qa, const float* qb, const float* kb, const int64_t* ko, int64_t hd, __m256 sc,
                        __m256& sa, __m256& sb) {
    __m256 a8[8], b8[8];
    for (int h = 0; h < 8; h += 4) {
      __m512 acc[2][4];
      for (int i = 0; i < 4; ++i) acc[0][i] = acc[1][i] = _mm512_setzero_ps();
      for (int64_t d = 0; d < hd; d += 16) {
        const __m512 a = _mm512_loadu_ps(qa + d), b = _mm512_loadu_ps(qb + d);
        for (int i = 0; i < 4; ++i) {
          const __m512 k = _mm512_loadu_ps(kb + ko[h + i] + d);
          acc[0][i] = _mm512_fmadd_ps(a, k, acc[0][i]);
          acc[1][i] = _mm512_fmadd_ps(b, k, acc[1][i]);
        }
      }
      for (int i = 0; i < 4; ++i) {
        a8[h + i] = fold(acc[0][i]);
        b8[h + i] = fold(acc[1][i]);
      }
    }
    sa = _mm256_mul_ps(hsum8x8(a8), sc);
    sb = _mm256_mul_ps(hsum8x8(b8), sc);
  }

  // q . k for one key
  static float dot(const float* qv, const float* kv, int64_t hd) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(qv + d), _mm512_loadu_ps(kv + d), a);
    return hsum8(fold(a));
  }
};

}  // namespace

namespace tokenleap_ops {
at::Tensor attend_keys_512(const at::Tensor& q, const float* kp, const float* vp, int64_t ks0, int64_t vs0,
                           const std::vector<RowKeys>& keys, int64_t nkv, double scale) {
  return attend_keys_t<Avx512>(q, kp, vp, ks0, vs0, keys, nkv, scale);
}
}  // namespace tokenleap_ops

#pragma GCC pop_options

namespace {
// 1 where the CPU has AVX-512 F / DQ / VL and the kernel is turned on (it is by default), else 0.
std::atomic<int> attention512_on{-1};

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl");
}

bool attention512_enabled() {
  int on = attention512_on.load(std::memory_order_relaxed);
  if (on < 0) {
    on = cpu_has_avx512() ? 1 : 0;
    attention512_on.store(on, std::memory_order_relaxed);
  }
  return on == 1;
}
}  // namespace

namespace tokenleap_ops {
bool attention512_takes(int64_t hd) { return hd % 16 == 0 && attention512_enabled(); }
}  // namespace tokenleap_ops

TORCH_LIBRARY_FRAGMENT(tokenleap, m) {
  // mode 1: attention takes the AVX-512 kernel where the CPU has it, 0: the AVX2 one; -1: only ask.
  // Returns the previous state. Benchmarks and tests switch it; a model's outputs assume one setting.
  m.def("attention512(int mode) -> bool", [](int64_t mode) -> bool {
    const bool was = attention512_enabled();
    if (mode >= 0) attention512_on.store(mode > 0 && cpu_has_avx512() ? 1 : 0, std::memory_order_relaxed);
    return was;
  });
  m.def("attention512_supported() -> bool", []() -> bool { return cpu_has_avx512(); });
}
