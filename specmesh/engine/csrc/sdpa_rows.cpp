// The deterministic mode's attention on torch's own kernel: each query row of one sequence alone,
// unmasked, over exactly the slots it sees, laid out as a one-token step sees them, one
// at::scaled_dot_product_attention call per row: the very op, inputs and strides of the Python
// loop it replaces (kv.py's _rows_exact), so bitwise the same, without ~6 Python tensor calls per
// row per layer around each call (measured on a 2-core AMX Xeon, bf16, 256 slots: a row cost
// ~32 us through Python, of which the SDPA call ~20 us).
//
// A chain row j sees slots [0, L + j + 1) of the sequence's view in place. A tree row sees the
// cache and its ancestors: its path's few slots are copied right after the cache for its call
// (from a copy of the tree's slots taken first; only the slots that differ from the previous
// row's, as raw bytes), and the tree's slots are put back at the end.
#include <torch/extension.h>

#include <cstring>
#include <vector>

namespace {

// One row's attention as the one-token step computes it: HF's SDPA call (enable_gqa where the
// heads are grouped), or with fold its kv head's query heads as rows (attention.py's _folded).
at::Tensor one_row(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, c10::optional<double> scale,
                   bool fold) {
  const int64_t H = q.size(1), KV = k.size(1), D = q.size(3);
  if (fold) {
    auto rows = q.reshape({1, KV, H / KV, D});  // [1, KV, G, D]
    return at::scaled_dot_product_attention(rows, k, v, {}, 0.0, false, scale).reshape({1, H, 1, D});
  }
  return at::scaled_dot_product_attention(q, k, v, {}, 0.0, false, scale, H != KV);
}

}  // namespace

// q: [1, H, n, D]; k, v: the sequence's views [1, KV, L + n, D] (its cache, then its n new slots);
// path: [E] int64 (a tree: row j's ancestors as new-token indices, root first, in
// path[off[j] .. off[j + 1])), empty for a chain; out: [n, H, D], filled in place.
void sdpa_rows(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t length, torch::Tensor path,
               torch::Tensor off, c10::optional<double> scale, bool fold, torch::Tensor out) {
  const int64_t n = q.size(2);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.size(2) == length + n && v.sizes() == k.sizes() &&
              out.size(0) == n, "sdpa rows: q [1, H, n, D], k and v [1, KV, L + n, D], out [n, H, D]");
  if (path.numel() == 0) {
    for (int64_t j = 0; j < n; ++j) {
      out[j].copy_(one_row(q.slice(2, j, j + 1), k.slice(2, 0, length + j + 1), v.slice(2, 0, length + j + 1),
                           scale, fold)[0].select(1, 0));
    }
    return;
  }
  TORCH_CHECK(off.numel() == n + 1, "sdpa rows: one path per tree row");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.strides() == v.strides() && path.is_contiguous(),
              "sdpa rows: a tree's keys and values as the pool's views (head dim contiguous)");
  auto offs = off.contiguous();
  const int64_t* op = offs.data_ptr<int64_t>();
  const int64_t* pp = path.data_ptr<int64_t>();
  auto tree_k = k.slice(2, length).clone(at::MemoryFormat::Contiguous);  // [1, KV, n, D], a copy
  auto tree_v = v.slice(2, length).clone(at::MemoryFormat::Contiguous);
  const int64_t KV = k.size(1), D = k.size(3), bytes = D * k.element_size();
  char *kp = static_cast<char*>(k.data_ptr()), *vp = static_cast<char*>(v.data_ptr());
  const char *tk = static_cast<const char*>(tree_k.data_ptr()), *tv = static_cast<const char*>(tree_v.data_ptr());
  const int64_t head_s = k.stride(1) * k.element_size(), slot_s = k.stride(2) * k.element_size();
  // slot length + p holds tree node at[p]: the tree's own order at first; a row's path goes in
  // where it differs (a row shares its parent's path but for its own slot), one head-dim run of
  // bytes per kv head, no tensor op per slot
  std::vector<int64_t> at(n);
  for (int64_t p = 0; p < n; ++p) at[p] = p;
  auto place = [&](int64_t p, int64_t node) {
    for (int64_t h = 0; h < KV; ++h) {
      const int64_t dst = h * head_s + (length + p) * slot_s, src = (h * n + node) * bytes;
      std::memcpy(kp + dst, tk + src, bytes);
      std::memcpy(vp + dst, tv + src, bytes);
    }
    at[p] = node;
  };
  for (int64_t j = 0; j < n; ++j) {
    const int64_t d = op[j + 1] - op[j];
    TORCH_CHECK(d >= 1 && d <= n, "sdpa rows: a tree row's path holds 1 to n slots");
    for (int64_t p = 0; p < d; ++p) {
      const int64_t node = pp[op[j] + p];
      TORCH_CHECK(node >= 0 && node < n, "sdpa rows: a path names the tree's own rows");
      if (at[p] != node) place(p, node);
    }
    out[j].copy_(one_row(q.slice(2, j, j + 1), k.slice(2, 0, length + d), v.slice(2, 0, length + d), scale,
                         fold)[0].select(1, 0));
  }
  for (int64_t p = 0; p < n; ++p) {
    if (at[p] != p) place(p, p);  // the tree's slots as they were
  }
}
