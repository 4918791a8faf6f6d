// The deterministic mode's attention on torch's own kernel: each query row of one sequence as a
// one-token step computes it, unmasked over exactly the slots it sees (the very op, inputs and
// strides of kv.py's _rows_exact loop, so bitwise the same, without ~6 Python tensor calls per row
// per layer around each call: measured on a 2-core AMX Xeon, bf16, 256 slots, a row cost ~32 us
// through Python, of which the SDPA call ~20 us).
//
// A chain row j sees slots [0, L + j + 1) of the sequence's view in place. Consecutive chain rows
// whose slot counts share floor(count / width) go in one call (width > 0, probed per shape by
// rowgroup.py): each row a batch entry of its own (torch's kernel computes every batch entry and
// head alone, with the one-row path of a one-token call), over the slots of the group's last row
// with the slots past its own masked. Masked slots add exact zeros to the softmax's sum and the
// weighted values, and the kernel's vector blocks over the slots end where they end for the row's
// own call when the two counts share floor(count / vector width): so each row is bitwise its own
// call, for ~1 call's fixed cost per group instead of per row.
//
// A tree row sees the cache and its ancestors: its path's few slots are copied right after the
// cache for its own call (from a copy of the tree's slots taken first; only the slots that differ
// from the previous row's, as raw bytes), and the tree's slots are put back at the end.
#include <torch/extension.h>

#include <cstring>
#include <limits>
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

// Chain rows j..e (e > j) of one sequence in one call (module comment): q [1, H, n, D]; k, v the
// sequence's views [1, KV, L + n, D] -> [e - j + 1, H, D].
at::Tensor grouped_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t length, int64_t j,
                        int64_t e, c10::optional<double> scale, bool fold) {
  const int64_t m = e - j + 1, slots = length + e + 1, H = q.size(1), KV = k.size(1), D = q.size(3);
  auto mask = at::zeros({m, 1, 1, slots}, q.options());  // [m, 1, 1, N]: row r sees length + j + r + 1 slots
  for (int64_t r = 0; r + 1 < m; ++r) {
    mask[r].narrow(-1, slots - (m - 1 - r), m - 1 - r).fill_(-std::numeric_limits<double>::infinity());
  }
  const auto ks = k.slice(2, 0, slots).expand({m, KV, slots, D});  // [m, KV, N, D], stride 0 over rows
  const auto vs = v.slice(2, 0, slots).expand({m, KV, slots, D});
  const auto qs = q.slice(2, j, e + 1).transpose(0, 2);  // [m, H, 1, D]
  if (fold) {
    return at::scaled_dot_product_attention(qs.reshape({m, KV, H / KV, D}), ks, vs, mask, 0.0, false, scale)
        .reshape({m, H, D});
  }
  return at::scaled_dot_product_attention(qs, ks, vs, mask, 0.0, false, scale, H != KV).select(2, 0);
}

}  // namespace

// q: [1, H, n, D]; k, v: the sequence's views [1, KV, L + n, D] (its cache, then its n new slots);
// path: [E] int64 (a tree: row j's ancestors as new-token indices, root first, in
// path[off[j] .. off[j + 1])), empty for a chain; width: chain rows grouped by floor(slots / width)
// (0: one call per row); out: [n, H, D], filled in place.
void sdpa_rows(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t length, torch::Tensor path,
               torch::Tensor off, c10::optional<double> scale, bool fold, int64_t width, torch::Tensor out) {
  const int64_t n = q.size(2);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.size(2) == length + n && v.sizes() == k.sizes() &&
              out.size(0) == n, "sdpa rows: q [1, H, n, D], k and v [1, KV, L + n, D], out [n, H, D]");
  if (path.numel() == 0) {
    for (int64_t j = 0, e = 0; j < n; j = e + 1) {
      e = j;
      while (width > 0 && e + 1 < n && (length + e + 2) / width == (length + j + 1) / width) ++e;
      if (e > j) {
        out.slice(0, j, e + 1).copy_(grouped_rows(q, k, v, length, j, e, scale, fold));
        continue;
      }
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
