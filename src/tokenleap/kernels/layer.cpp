// tokenleap CPU kernels, part 3: one whole decoder layer (Llama / Qwen2) for the rows of a decode
// or verification step, in one call from Python instead of ~12 ops and as many module calls.
//
// It composes the other kernels in exactly the order the Python layer calls them -- RMSNorm, the
// q/k/v products, rotate + store + attend per sequence, the output product, the residual add,
// RMSNorm, gate/up, SiLU * up, down, the residual add -- with the same functions and the same
// elementwise adds, so its result is bitwise the Python layer's (tested), and it is row-invariant
// like every piece of it. What it saves is Python and dispatch overhead, which for a 0.5B draft
// model (24 layers, 896 wide) was about a third of a decode step.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "ops.h"

namespace {

constexpr int64_t kInt4 = 4, kInt6 = 6, kInt8 = 8, kBf16 = 16, kW8A8 = 88;

// One weight product: kind (kInt4 / kInt6 / kInt8 / kBf16 / kW8A8), its true output size, a
// parameter (W8A8: the activation block; else 0), its tensors. W8A8's scales tensor holds the
// per-output scales [N padded to 32] followed by the inverse smoothing [K].
struct Product {
  int64_t kind, out, param;
  at::Tensor packed, scales;
  c10::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {  // x float32 [M, K] -> [M, out]
    if (kind == kInt4) return tokenleap_ops::int4_product(x, packed, scales, bias);
    if (kind == kInt6) return tokenleap_ops::int6_product(x, packed, scales, bias);
    at::Tensor y;
    if (kind == kW8A8) {
      const int64_t n = packed.size(0) * 16, k = x.size(1);
      TORCH_CHECK(scales.numel() == n + k, "decoder_layer: W8A8 scales must hold ", n, " scales and ", k,
                  " smoothing factors");
      // [M, out padded to 32]
      y = tokenleap_ops::w8a8_product(x, packed, scales.narrow(0, 0, n), scales.narrow(0, n, k), param);
    } else {
      y = kind == kBf16 ? tokenleap_ops::bf16_product(x, packed, scales)   // [M, out]
                        : tokenleap_ops::int8_product(x, packed, scales);  // [M, out padded to 8]
    }
    if (y.size(1) != out) y = y.narrow(1, 0, out);
    if (bias.has_value()) y = y + *bias;  // as Int8Linear / Linear: the bias added after the product
    return y;
  }
};

// Several products of the same input whose outputs sit side by side (q | k | v, gate | up).
at::Tensor side_by_side(const std::vector<Product>& ps, const at::Tensor& x) {
  if (ps.size() == 1) return ps[0](x);
  std::vector<at::Tensor> ys;
  for (const auto& p : ps) ys.push_back(p(x));
  return at::cat(ys, 1);
}

// x float32 [M, hidden]; weights: input and post-attention norm weights, then for every product
// (packed, scales, bias or None); ints: n_heads, n_kv, head_dim, the number of attention input
// products (1: joined q/k/v, 3: separate), the number of MLP input products (1 or 2), then
// (kind, out, param) per product: attention inputs, o, MLP inputs, down. k_cache / v_cache: this layer's
// stores, either contiguous [slots, n_kv, max_len, head_dim] or paged [n_kv, blocks, block_size,
// head_dim]; segments: (slot, pos0, length, row_start) per sequence; tables (paged only): each
// segment's block table covering positions 0 .. pos0+length-1, one after another; scale: the
// attention's softmax scale. trees (decoder_layer_trees): per segment m, then m ints -- m == 0 for
// a chain, else tree.cpp's [first, parents...] (its rows are tree nodes; its table covers cache
// indices 0 .. pos0+first+length-1).
at::Tensor layer_impl(const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& weights,
                      at::IntArrayRef ints, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                      at::Tensor& v_cache, at::IntArrayRef segments, at::IntArrayRef tables, at::IntArrayRef trees,
                      double eps, double scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "decoder_layer: x must be float32 [M, hidden]");
  TORCH_CHECK(ints.size() >= 5, "decoder_layer: ints");
  const int64_t H = ints[0], nkv = ints[1], hd = ints[2], n_attn = ints[3], n_mlp = ints[4];
  const int64_t n_products = n_attn + 1 + n_mlp + 1;
  TORCH_CHECK(static_cast<int64_t>(ints.size()) == 5 + 3 * n_products &&
                  static_cast<int64_t>(weights.size()) == 2 + 3 * n_products,
              "decoder_layer: ", n_products, " products need ", 5 + 3 * n_products, " ints and ",
              2 + 3 * n_products, " weights");
  TORCH_CHECK(segments.size() % 4 == 0 && !segments.empty(), "decoder_layer: segments are (slot, pos0, length, row_start)");
  std::vector<Product> products;
  for (int64_t i = 0; i < n_products; ++i) {
    const auto& packed = weights[2 + 3 * i];
    const auto& scales = weights[3 + 3 * i];
    TORCH_CHECK(packed.has_value() && scales.has_value(), "decoder_layer: product ", i, " has no weights");
    const int64_t kind = ints[5 + 3 * i];
    TORCH_CHECK(kind == kInt4 || kind == kInt6 || kind == kInt8 || kind == kBf16 || kind == kW8A8,
                "decoder_layer: product kind");
    products.push_back({kind, ints[6 + 3 * i], ints[7 + 3 * i], *packed, *scales, weights[4 + 3 * i]});
  }
  const std::vector<Product> attn_in(products.begin(), products.begin() + n_attn);
  const Product& o_proj = products[n_attn];
  const std::vector<Product> mlp_in(products.begin() + n_attn + 1, products.begin() + n_attn + 1 + n_mlp);
  const Product& down = products.back();
  TORCH_CHECK(weights[0].has_value() && weights[1].has_value(), "decoder_layer: norm weights");
  const int64_t M = x.size(0);

  // attention
  const at::Tensor qkv = side_by_side(attn_in, tokenleap_ops::rms_norm_rows(x, *weights[0], eps));  // [M, (H + 2 nkv) hd]
  TORCH_CHECK(qkv.size(1) == (H + 2 * nkv) * hd, "decoder_layer: q/k/v sizes");
  const at::Tensor q = qkv.narrow(1, 0, H * hd).view({M, H, hd});
  const at::Tensor k = qkv.narrow(1, H * hd, nkv * hd).view({M, nkv, hd});
  const at::Tensor v = qkv.narrow(1, (H + nkv) * hd, nkv * hd).view({M, nkv, hd});
  at::Tensor attn;  // [M, H, hd]
  const int64_t n_seg = static_cast<int64_t>(segments.size()) / 4;
  const bool paged = !tables.empty();  // contiguous caches pass no block tables
  int64_t table_at = 0, tree_at = 0;
  for (int64_t s = 0; s < n_seg; ++s) {
    const int64_t slot = segments[4 * s], pos0 = segments[4 * s + 1], len = segments[4 * s + 2],
                  row0 = segments[4 * s + 3];
    TORCH_CHECK(row0 >= 0 && len >= 1 && row0 + len <= M, "decoder_layer: segment rows");
    at::IntArrayRef tree;  // empty: a chain
    if (!trees.empty()) {
      TORCH_CHECK(tree_at < static_cast<int64_t>(trees.size()), "decoder_layer: a tree entry per segment");
      const int64_t m = trees[tree_at];
      TORCH_CHECK(m >= 0 && tree_at + 1 + m <= static_cast<int64_t>(trees.size()), "decoder_layer: tree entries");
      tree = trees.slice(tree_at + 1, m);
      tree_at += 1 + m;
    }
    const int64_t end = pos0 + (tree.empty() ? 0 : tree[0]) + len;  // one past the last cache index written
    const at::Tensor qs = q.narrow(0, row0, len), ks = k.narrow(0, row0, len), vs = v.narrow(0, row0, len);
    at::Tensor o;
    if (paged) {
      const int64_t bs = k_cache.size(2), nb = (end + bs - 1) / bs;
      TORCH_CHECK(table_at + nb <= static_cast<int64_t>(tables.size()), "decoder_layer: block tables too short");
      const at::IntArrayRef table = tables.slice(table_at, nb);
      o = tree.empty() ? tokenleap_ops::rope_store_attend_paged_rows(qs, ks, vs, cos, sin, k_cache, v_cache, table,
                                                                     pos0, scale)
                       : tokenleap_ops::rope_store_attend_tree_paged(qs, ks, vs, cos, sin, k_cache, v_cache, table,
                                                                     pos0, tree, scale);
      table_at += nb;
    } else {
      at::Tensor kst = k_cache.select(0, slot), vst = v_cache.select(0, slot);
      o = tree.empty() ? tokenleap_ops::rope_store_attend_rows(qs, ks, vs, cos, sin, kst, vst, pos0, scale)
                       : tokenleap_ops::rope_store_attend_tree(qs, ks, vs, cos, sin, kst, vst, pos0, tree, scale);
    }
    if (n_seg == 1) {
      TORCH_CHECK(len == M, "decoder_layer: one segment must hold every row");
      attn = o;
    } else {
      if (!attn.defined()) attn = at::empty({M, H, hd}, x.options());
      attn.narrow(0, row0, len).copy_(o);
    }
  }
  const at::Tensor h = x + o_proj(attn.view({M, H * hd}));  // [M, hidden]

  // MLP
  const at::Tensor gu = side_by_side(mlp_in, tokenleap_ops::rms_norm_rows(h, *weights[1], eps));  // [M, 2 I]
  const int64_t I = gu.size(1) / 2;
  return h + down(tokenleap_ops::silu_mul_rows(gu.narrow(1, 0, I), gu.narrow(1, I, I)));
}

at::Tensor decoder_layer(const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& weights,
                         at::IntArrayRef ints, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                         at::Tensor& v_cache, at::IntArrayRef segments, at::IntArrayRef tables, double eps,
                         double scale) {
  return layer_impl(x, weights, ints, cos, sin, k_cache, v_cache, segments, tables, {}, eps, scale);
}

at::Tensor decoder_layer_trees(const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& weights,
                               at::IntArrayRef ints, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                               at::Tensor& v_cache, at::IntArrayRef segments, at::IntArrayRef tables,
                               at::IntArrayRef trees, double eps, double scale) {
  return layer_impl(x, weights, ints, cos, sin, k_cache, v_cache, segments, tables, trees, eps, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenleap, m) {
  m.def("decoder_layer(Tensor x, Tensor?[] weights, int[] ints, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, int[] segments, int[] tables, float eps, float scale) -> Tensor");
  m.def("decoder_layer_trees(Tensor x, Tensor?[] weights, int[] ints, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, int[] segments, int[] tables, int[] trees, float eps, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(tokenleap, CPU, m) {
  m.impl("decoder_layer", &decoder_layer);
  m.impl("decoder_layer_trees", &decoder_layer_trees);
}
