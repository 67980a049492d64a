// tokenleap CPU kernels: attention for the rows of a token tree (one sequence's drafted tree).
//
// tree = [first, parents of nodes 0 .. n-1] (parents[0] == -1, parents[i] < i); the call's T rows
// are nodes first .. first+T-1 of a tree whose root sits at position pos0. Node i is rotated for
// position pos0 + depth(i), its key and value stored at cache index pos0 + i, and it attends to
// cache positions 0 .. pos0-1 and then to its ancestors and itself in path order -- the keys
// plain decoding of the same prefix holds, in the same order, through the same per-row attention
// (attend_keys), so a node's output is bitwise what plain decoding computes for it.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "ops.h"

namespace {

using tokenleap_ops::RowKeys;

// koff / voff cover cache indices 0 .. pos0 + first + T - 1.
at::Tensor tree_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                     const at::Tensor& sin, float* kbase, float* vbase, int64_t ks0, int64_t vs0,
                     const std::vector<int64_t>& koff, const std::vector<int64_t>& voff, int64_t pos0,
                     at::IntArrayRef tree, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                  q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  k.stride(2) == 1 && v.stride(2) == 1,
              "rope_store_attend_tree: float32 q [T, H, hd], k / v [T, n_kv, hd] with unit last strides");
  const int64_t T = q.size(0), H = q.size(1), nkv = k.size(1), hd = q.size(2);
  TORCH_CHECK(tree.size() >= 2 && T >= 1, "rope_store_attend_tree: tree = [first, parents...], rows");
  const int64_t first = tree[0], n = static_cast<int64_t>(tree.size()) - 1;
  const int64_t* parents = tree.data() + 1;
  TORCH_CHECK(first >= 0 && first + T <= n && pos0 >= 0 && pos0 + first + T == static_cast<int64_t>(koff.size()),
              "rope_store_attend_tree: rows, nodes and cache offsets disagree");
  TORCH_CHECK(parents[0] == -1, "rope_store_attend_tree: node 0 is the root");
  std::vector<int64_t> depth(first + T, 0);
  for (int64_t i = 1; i < first + T; ++i) {
    TORCH_CHECK(parents[i] >= 0 && parents[i] < i, "rope_store_attend_tree: a parent must be an earlier node");
    depth[i] = depth[parents[i]] + 1;
  }
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  const float* cp = cc.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  at::Tensor qr = q.contiguous().clone();  // [T, H, hd]
  float* qp = qr.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {  // rotate and store every row before any attends
    const int64_t node = first + t, p = pos0 + depth[node];
    TORCH_CHECK(p < cc.size(0), "rope_store_attend_tree: position past the tables");
    tokenleap_ops::rotate_store_row(qp + t * H * hd, H, kp + t * k.stride(0), k.stride(1), vp + t * v.stride(0),
                                    v.stride(1), nkv, kbase + koff[pos0 + node], vbase + voff[pos0 + node], ks0, vs0,
                                    cp + p * hd, sp + p * hd, hd);
  }
  // each row's keys: the committed prefix, then its path from the root
  std::vector<std::vector<int64_t>> ko(T), vo(T);
  std::vector<RowKeys> keys(T);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> path;
    for (int64_t a = first + t; a >= 0; a = parents[a]) path.push_back(pos0 + a);
    ko[t].assign(koff.begin(), koff.begin() + pos0);
    vo[t].assign(voff.begin(), voff.begin() + pos0);
    for (auto it = path.rbegin(); it != path.rend(); ++it) {
      ko[t].push_back(koff[*it]);
      vo[t].push_back(voff[*it]);
    }
    keys[t] = {ko[t].data(), vo[t].data(), static_cast<int64_t>(ko[t].size())};
  }
  return tokenleap_ops::attend_keys(qr, kbase, vbase, ks0, vs0, keys, nkv, scale);
}

}  // namespace

namespace tokenleap_ops {

// Contiguous cache: k_store, v_store [n_kv, max_len, hd] (one slot, unit last stride).
at::Tensor rope_store_attend_tree(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                  const at::Tensor& sin, at::Tensor& k_store, at::Tensor& v_store, int64_t pos0,
                                  at::IntArrayRef tree, double scale) {
  TORCH_CHECK(k_store.dim() == 3 && k_store.sizes() == v_store.sizes() && k_store.scalar_type() == at::kFloat &&
                  v_store.scalar_type() == at::kFloat && k_store.stride(2) == 1 && v_store.stride(2) == 1 &&
                  k_store.size(0) == k.size(1) && k_store.size(2) == q.size(2),
              "rope_store_attend_tree: float32 stores [n_kv, max_len, hd], unit last strides");
  TORCH_CHECK(!tree.empty(), "rope_store_attend_tree: tree = [first, parents...]");
  const int64_t L = pos0 + tree[0] + q.size(0);
  TORCH_CHECK(L <= k_store.size(1), "rope_store_attend_tree: positions past the store");
  std::vector<int64_t> koff(L), voff(L);
  for (int64_t j = 0; j < L; ++j) {
    koff[j] = j * k_store.stride(1);
    voff[j] = j * v_store.stride(1);
  }
  return tree_impl(q, k, v, cos, sin, k_store.data_ptr<float>(), v_store.data_ptr<float>(), k_store.stride(0),
                   v_store.stride(0), koff, voff, pos0, tree, scale);
}

// Paged cache: pools [n_kv, num_blocks, block_size, hd]; table covers cache indices 0 .. pos0+first+T-1.
at::Tensor rope_store_attend_tree_paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_pool,
                                        at::Tensor& v_pool, at::IntArrayRef table, int64_t pos0, at::IntArrayRef tree,
                                        double scale) {
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.scalar_type() == at::kFloat &&
                  v_pool.scalar_type() == at::kFloat && k_pool.stride(3) == 1 && v_pool.stride(3) == 1 &&
                  k_pool.size(0) == k.size(1) && k_pool.size(3) == q.size(2),
              "rope_store_attend_tree_paged: float32 pools [n_kv, blocks, block_size, hd], unit last strides");
  TORCH_CHECK(!tree.empty(), "rope_store_attend_tree_paged: tree = [first, parents...]");
  const int64_t L = pos0 + tree[0] + q.size(0), bs = k_pool.size(2);
  TORCH_CHECK(static_cast<int64_t>(table.size()) * bs >= L, "rope_store_attend_tree_paged: the block table is too short");
  std::vector<int64_t> koff(L), voff(L);
  for (int64_t j = 0; j < L; ++j) {
    const int64_t b = table[j / bs];
    TORCH_CHECK(b >= 0 && b < k_pool.size(1), "rope_store_attend_tree_paged: block id out of range");
    koff[j] = b * k_pool.stride(1) + (j % bs) * k_pool.stride(2);
    voff[j] = b * v_pool.stride(1) + (j % bs) * v_pool.stride(2);
  }
  return tree_impl(q, k, v, cos, sin, k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), k_pool.stride(0),
                   v_pool.stride(0), koff, voff, pos0, tree, scale);
}

}  // namespace tokenleap_ops

TORCH_LIBRARY_FRAGMENT(tokenleap, m) {
  m.def("rope_store_attend_tree(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_store, "
        "Tensor(b!) v_store, int pos0, int[] tree, float scale) -> Tensor");
  m.def("rope_store_attend_tree_paged(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_pool, "
        "Tensor(b!) v_pool, int[] table, int pos0, int[] tree, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(tokenleap, CPU, m) {
  m.impl("rope_store_attend_tree", &tokenleap_ops::rope_store_attend_tree);
  m.impl("rope_store_attend_tree_paged", &tokenleap_ops::rope_store_attend_tree_paged);
}
