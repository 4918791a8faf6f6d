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
// cache (from a copy of the tree's slots taken first; only the slots that differ from what is
// there, as raw bytes), and the tree's slots are put back at the end. The tree goes in chains:
// one path placed serves every row on it (each sees the cache and a prefix of it), grouped as a
// chain's rows are.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

torch::Tensor exact_row(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<double> scale,
                        c10::optional<torch::Tensor> lse);

// One row's attention as the one-token step computes it (one: attention.one_token_mode): HF's SDPA
// call (0; enable_gqa where the heads are grouped), its kv head's query heads as rows (1,
// attention.py's _folded), or HF's call's arithmetic from exact_row.cpp (2, exactrow.py). Also
// pool_attend's call for a maskless one-token row. q [1, H, 1, D]; k, v [1, KV, L, D] -> [1, H, 1, D].
at::Tensor one_row(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, c10::optional<double> scale,
                   int64_t one) {
  const int64_t H = q.size(1), KV = k.size(1), D = q.size(3);
  if (one == 2) {
    return exact_row(q, k, v, scale, c10::nullopt);
  }
  if (one == 1) {
    auto rows = q.reshape({1, KV, H / KV, D});  // [1, KV, G, D]
    return at::scaled_dot_product_attention(rows, k, v, {}, 0.0, false, scale).reshape({1, H, 1, D});
  }
  return at::scaled_dot_product_attention(q, k, v, {}, 0.0, false, scale, H != KV);
}

namespace {

// Rows of one sequence in one call (module comment): qs [m, H, 1, D]; k, v the sequence's views
// [1, KV, S, D]; row r sees slots [0, lens[r]), lens ascending, all sharing floor(lens / width)
// -> [m, H, D].
at::Tensor batch_rows(const at::Tensor& qs, const at::Tensor& k, const at::Tensor& v, const std::vector<int64_t>& lens,
                      c10::optional<double> scale, bool fold) {
  const int64_t m = qs.size(0), slots = lens.back(), H = qs.size(1), KV = k.size(1), D = qs.size(3);
  auto mask = at::zeros({m, 1, 1, slots}, qs.options());  // [m, 1, 1, N]: -inf past each row's own slots
  for (int64_t r = 0; r < m; ++r) {
    if (lens[r] < slots) mask[r].narrow(-1, lens[r], slots - lens[r]).fill_(-std::numeric_limits<double>::infinity());
  }
  const auto ks = k.slice(2, 0, slots).expand({m, KV, slots, D});  // [m, KV, N, D], stride 0 over rows
  const auto vs = v.slice(2, 0, slots).expand({m, KV, slots, D});
  if (fold) {
    return at::scaled_dot_product_attention(qs.reshape({m, KV, H / KV, D}), ks, vs, mask, 0.0, false, scale)
        .reshape({m, H, D});
  }
  return at::scaled_dot_product_attention(qs, ks, vs, mask, 0.0, false, scale, H != KV).select(2, 0);
}

// rows[i] (a query row of q [1, H, n, D]) sees slots [0, lens[i]) of k, v, lens ascending: runs of
// rows sharing floor(lens / width) in one call each (width 0: one call per row) -> out[rows[i]].
void attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<int64_t>& rows,
                 const std::vector<int64_t>& lens, int64_t width, c10::optional<double> scale, int64_t one,
                 at::Tensor& out) {
  const int64_t count = static_cast<int64_t>(rows.size());
  for (int64_t a = 0, b = 0; a < count; a = b) {
    for (b = a + 1; width > 0 && b < count && lens[b] / width == lens[a] / width; ++b) {
    }
    if (b - a == 1) {
      const int64_t j = rows[a];
      out[j].copy_(one_row(q.slice(2, j, j + 1), k.slice(2, 0, lens[a]), v.slice(2, 0, lens[a]), scale, one)[0]
                       .select(1, 0));
      continue;
    }
    const std::vector<int64_t> part(rows.begin() + a, rows.begin() + b), seen(lens.begin() + a, lens.begin() + b);
    const auto idx = torch::tensor(part, torch::dtype(torch::kLong));
    const auto qs = q.index_select(2, idx).transpose(0, 2);  // [m, H, 1, D]
    out.index_copy_(0, idx, batch_rows(qs, k, v, seen, scale, one == 1));
  }
}

// A tree's paths as sdpa_rows takes them: row j's ends at j, and each of its entries at depth p is
// a row whose own path is its first p + 1 entries (a prefix-closed tree in topological order).
// Checked as each row's path being its parent's (the entry before itself) and then itself: by
// induction every ancestor's path is then a prefix, in one comparison per row.
void check_paths(const int64_t* op, const int64_t* pp, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t d = op[j + 1] - op[j];
    TORCH_CHECK(d >= 1 && d <= n && pp[op[j] + d - 1] == j,
                "sdpa rows: a tree row's path holds 1 to n slots, itself last");
    if (d == 1) continue;
    const int64_t parent = pp[op[j] + d - 2];
    TORCH_CHECK(parent >= 0 && parent < n && op[parent + 1] - op[parent] == d - 1 &&
                std::equal(pp + op[parent], pp + op[parent] + d - 1, pp + op[j]),
                "sdpa rows: a path names the tree's own rows, each ancestor's path a prefix of it");
  }
}

// A tree's rows (module comment), in chains: from the last row not yet computed, its path goes
// into the slots after the cache (only where it differs from what is there, one head-dim run of
// raw bytes per kv head and slot, from a copy of the tree's slots taken first), and every row on
// that path not yet computed attends over the cache and its own prefix of the path, grouped as
// attend_rows groups. The tree's slots are put back at the end.
void tree_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t length, const at::Tensor& path,
               const at::Tensor& off, c10::optional<double> scale, int64_t one, int64_t width, at::Tensor& out) {
  const int64_t n = q.size(2);
  TORCH_CHECK(off.numel() == n + 1, "sdpa rows: one path per tree row");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.strides() == v.strides() && path.is_contiguous(),
              "sdpa rows: a tree's keys and values as the pool's views (head dim contiguous)");
  const auto offs = off.contiguous();
  const int64_t* op = offs.data_ptr<int64_t>();
  const int64_t* pp = path.data_ptr<int64_t>();
  TORCH_CHECK(op[0] == 0 && op[n] == path.numel(), "sdpa rows: offsets bound the paths");
  check_paths(op, pp, n);
  const auto tree_k = k.slice(2, length).clone(at::MemoryFormat::Contiguous);  // [1, KV, n, D], a copy
  const auto tree_v = v.slice(2, length).clone(at::MemoryFormat::Contiguous);
  const int64_t KV = k.size(1), bytes = k.size(3) * k.element_size();
  char *kp = static_cast<char*>(k.data_ptr()), *vp = static_cast<char*>(v.data_ptr());
  const char *tk = static_cast<const char*>(tree_k.data_ptr()), *tv = static_cast<const char*>(tree_v.data_ptr());
  const int64_t head_s = k.stride(1) * k.element_size(), slot_s = k.stride(2) * k.element_size();
  std::vector<int64_t> at(n);  // slot length + p holds tree node at[p]: the tree's own order at first
  for (int64_t p = 0; p < n; ++p) at[p] = p;
  auto place = [&](int64_t p, int64_t node) {
    for (int64_t h = 0; h < KV; ++h) {
      const int64_t dst = h * head_s + (length + p) * slot_s, src = (h * n + node) * bytes;
      std::memcpy(kp + dst, tk + src, bytes);
      std::memcpy(vp + dst, tv + src, bytes);
    }
    at[p] = node;
  };
  std::vector<char> done(n, 0);
  for (int64_t j = n - 1; j >= 0; --j) {
    if (done[j]) continue;
    std::vector<int64_t> rows, lens;
    for (int64_t p = 0; p < op[j + 1] - op[j]; ++p) {
      const int64_t node = pp[op[j] + p];
      if (at[p] != node) place(p, node);
      if (!done[node]) done[node] = 1, rows.push_back(node), lens.push_back(length + p + 1);
    }
    attend_rows(q, k, v, rows, lens, width, scale, one, out);
  }
  for (int64_t p = 0; p < n; ++p) {
    if (at[p] != p) place(p, p);  // the tree's slots as they were
  }
}

}  // namespace

// q: [1, H, n, D]; k, v: the sequence's views [1, KV, L + n, D] (its cache, then its n new slots);
// path: [E] int64 (a tree: row j's ancestors as new-token indices, root first, in
// path[off[j] .. off[j + 1])), empty for a chain; one: one_row's call; width: rows grouped by
// floor(slots / width) (0: one call per row); out: [n, H, D], filled in place.
void sdpa_rows(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t length, torch::Tensor path,
               torch::Tensor off, c10::optional<double> scale, int64_t one, int64_t width, torch::Tensor out) {
  const int64_t n = q.size(2);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.size(2) == length + n && v.sizes() == k.sizes() &&
              out.size(0) == n, "sdpa rows: q [1, H, n, D], k and v [1, KV, L + n, D], out [n, H, D]");
  if (path.numel() == 0) {
    std::vector<int64_t> rows(n), lens(n);
    for (int64_t j = 0; j < n; ++j) rows[j] = j, lens[j] = length + j + 1;
    attend_rows(q, k, v, rows, lens, width, scale, one, out);
    return;
  }
  tree_rows(q, k, v, length, path, off, scale, one, width, out);
}
