// Stand-ins for amx.cpp, amx_int.cpp, vnni.cpp, w8a8.cpp and attention512.cpp in a build without them (a compiler that
// cannot compile AMX or AVX-512 intrinsics): the same symbols and ops, reporting that no tile may
// run, so the AVX2 kernels take every product. kernels/__init__.py builds with this file only when the AMX files fail.
#include <torch/library.h>

#include "ops.h"

namespace tokenleap_ops {

at::Tensor bf16_amx_product(const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "bf16_amx_linear: tokenleap's kernels were built without AMX (the compiler could not build amx.cpp)");
}

bool amx_int8_takes(int64_t, int64_t) { return false; }

void int4_amx_product(const int8_t*, const float*, const float*, int64_t, int64_t, const uint8_t*,
                      const uint16_t*, float*, int64_t) {
  TORCH_CHECK(false, "int4 AMX product: tokenleap's kernels were built without AMX");
}

void int6_amx_product(const int8_t*, const float*, const int32_t*, int64_t, int64_t, const uint8_t*,
                      const float*, float*, int64_t, bool) {
  TORCH_CHECK(false, "int6 AMX product: tokenleap's kernels were built without AMX");
}

at::Tensor w8a8_product(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "w8a8 product: tokenleap's kernels were built without AMX");
}

bool vnni_takes() { return false; }

void int4_vnni_product(const int8_t*, const float*, const float*, int64_t, int64_t, const uint8_t*, const uint16_t*,
                       float*, int64_t) {
  TORCH_CHECK(false, "int4 VNNI product: tokenleap's kernels were built without vnni.cpp");
}

void int6_vnni_product(const int8_t*, const float*, const int32_t*, int64_t, int64_t, const uint8_t*, const float*,
                       float*, int64_t, bool) {
  TORCH_CHECK(false, "int6 VNNI product: tokenleap's kernels were built without vnni.cpp");
}

bool attention512_takes(int64_t) { return false; }

at::Tensor attend_keys_512(const at::Tensor&, const float*, const float*, int64_t, int64_t, const std::vector<RowKeys>&,
                           int64_t, double) {
  TORCH_CHECK(false, "AVX-512 attention: tokenleap's kernels were built without attention512.cpp");
}

}  // namespace tokenleap_ops

namespace {
at::Tensor bf16_amx_linear(const at::Tensor& x, const at::Tensor& packed) {
  return tokenleap_ops::bf16_amx_product(x, packed);
}
bool no_tiles() { return false; }
}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenleap, m) {
  m.def("bf16_amx_linear(Tensor x, Tensor packed) -> Tensor");
  m.def("amx_init() -> bool", &no_tiles);
  m.def("vnni(int mode) -> bool", [](int64_t) -> bool { return false; });
  m.def("vnni_supported() -> bool", &no_tiles);
  m.def("attention512(int mode) -> bool", [](int64_t) -> bool { return false; });
  m.def("attention512_supported() -> bool", &no_tiles);
  m.def("amx_int8_rows(int rows) -> int", [](int64_t rows) -> int64_t {
    TORCH_CHECK(rows <= 0, "amx_int8_rows: tokenleap's kernels were built without AMX");
    return 0;
  });
}
TORCH_LIBRARY_IMPL(tokenleap, CPU, m) {
  m.impl("bf16_amx_linear", &bf16_amx_linear);
}
