// The kernels one translation unit calls from another (layer.cpp composes the others).
#pragma once
#include <ATen/ATen.h>

#include <cstring>
#include <vector>

namespace tokenleap_ops {

// products.cpp
at::Tensor int4_product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sm,
                        const c10::optional<at::Tensor>& bias);
at::Tensor int8_product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale);
at::Tensor bf16_product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale);

// amx.cpp: bf16 weights packed [N/16, K/32, 16, 16, 2]
at::Tensor bf16_amx_product(const at::Tensor& x, const at::Tensor& packed);
// amx_int.cpp: int4.cpp's and int6.cpp's products on AMX-INT8 tiles (their operands, bitwise their
// results), for calls of at least the rows set by the op amx_int8_rows and a multiple of 16 columns
bool amx_int8_takes(int64_t rows, int64_t cols);
void int4_amx_product(const int8_t* xq, const float* a, const float* as, int64_t M, int64_t K,
                      const uint8_t* packed, const uint16_t* sm, float* y, int64_t N);
void int6_amx_product(const int8_t* xq, const float* a, const int32_t* sum16, int64_t M, int64_t K,
                      const uint8_t* packed, const float* d, float* y, int64_t N, bool paired);

// w8a8.cpp: W8A8 products on AMX-INT8 tiles (models/w8a8.py); x float32 [M, K] -> [M, N]
at::Tensor w8a8_product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                        const at::Tensor& inv_smooth, int64_t block);

// vnni.cpp: int4.cpp's and int6.cpp's products on AVX-512 VNNI register tiles (their operands,
// bitwise their results); vnni_takes: the CPU has VNNI and the tiles are turned on (op vnni)
bool vnni_takes();
void int4_vnni_product(const int8_t* xq, const float* a, const float* as, int64_t M, int64_t K,
                       const uint8_t* packed, const uint16_t* sm, float* y, int64_t N);
void int6_vnni_product(const int8_t* xq, const float* a, const int32_t* sum16, int64_t M, int64_t K,
                       const uint8_t* packed, const float* d, float* y, int64_t N, bool paired);

// int6.cpp
at::Tensor int6_product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d,
                        const c10::optional<at::Tensor>& bias);

// decoder.cpp
struct RowKeys {  // one attention row's keys: n offsets of keys (ko) and of values (vo), in order
  const int64_t* ko;
  const int64_t* vo;
  int64_t n;
};
at::Tensor attend_keys(const at::Tensor& q, const float* kp, const float* vp, int64_t ks0, int64_t vs0,
                       const std::vector<RowKeys>& keys, int64_t nkv, double scale);
// attention512.cpp: attend_keys on AVX-512 vectors, for heads of hd floats where attention512_takes(hd):
// the CPU has AVX-512 F / DQ / VL, hd % 16 == 0, and the op attention512 has not turned it off
bool attention512_takes(int64_t hd);
at::Tensor attend_keys_512(const at::Tensor& q, const float* kp, const float* vp, int64_t ks0, int64_t vs0,
                           const std::vector<RowKeys>& keys, int64_t nkv, double scale);
// One head's rotation, in place: v[i], v[i + half] by the angle whose cos / sin rows are c, s.
inline void rope_vec(float* v, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * c[i] - b * s[i];
    v[i + half] = b * c[i + half] + a * s[i + half];
  }
}
// Row t of a step: rotate its H query heads (q_row, in place) by the angle (c, s), store its n_kv keys
// (rotated) and values at kdst + j * ks0 / vdst + j * vs0. k_row / v_row: the row's heads, kst / vst apart.
inline void rotate_store_row(float* q_row, int64_t H, const float* k_row, int64_t kst, const float* v_row, int64_t vst,
                             int64_t nkv, float* kdst, float* vdst, int64_t ks0, int64_t vs0, const float* c,
                             const float* s, int64_t hd) {
  for (int64_t h = 0; h < H; ++h) rope_vec(q_row + h * hd, c, s, hd / 2);
  for (int64_t j = 0; j < nkv; ++j) {
    std::memcpy(kdst + j * ks0, k_row + j * kst, hd * sizeof(float));
    std::memcpy(vdst + j * vs0, v_row + j * vst, hd * sizeof(float));
    rope_vec(kdst + j * ks0, c, s, hd / 2);
  }
}
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor silu_mul_rows(const at::Tensor& gate, const at::Tensor& up);
at::Tensor rope_store_attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_store,
                                  at::Tensor& v_store, int64_t pos0, double scale);
at::Tensor rope_store_attend_paged_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_pool,
                                        at::Tensor& v_pool, at::IntArrayRef table, int64_t pos0, double scale);


// tree.cpp: tree = [first, parents of nodes 0 .. n-1]; rows are nodes first .. first+T-1
at::Tensor rope_store_attend_tree(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                  const at::Tensor& sin, at::Tensor& k_store, at::Tensor& v_store, int64_t pos0,
                                  at::IntArrayRef tree, double scale);
at::Tensor rope_store_attend_tree_paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_pool,
                                        at::Tensor& v_pool, at::IntArrayRef table, int64_t pos0, at::IntArrayRef tree,
                                        double scale);

}  // namespace tokenleap_ops
