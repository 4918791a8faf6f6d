// lean_hf.py's decoder layer in two calls, for steps whose linears all run from oneDNN-prepacked
// weights (and lean.py's, from the packed float32 kernel's panels): the same ATen ops on the same
// tensors in the same order as lean_hf's Python (which is HF's modules' order), without ~25
// Python-level tensor calls per layer around them. Attention stays in Python between the two
// halves (kv.py's _attend: every plan kind).
//
// A linear here is rowexact.linear_forward's call of a prepacked weight, spelt out: a call of m
// rows runs at onednn.bucket(m) rows (zero rows appended), a deterministic step cuts its rows
// into chunks of `step` and pads a chunk shorter than `floor` by repeating its last row
// (rowexact.floored). step <= 0: one call (the default mode's onednn.packed).
#include <torch/extension.h>

#include <vector>

namespace {

using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>);

const c10::TypedOperatorHandle<LinearFn>& linear_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<LinearFn>();
  return op;
}

int64_t bucket(int64_t m) {  // onednn.bucket
  if (m <= 32) return m;
  const int64_t s = m <= 128 ? 8 : m <= 256 ? 16 : 32;
  return (m + s - 1) / s * s;
}

}  // namespace

torch::Tensor bf16_rows(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias, int64_t kc);  // bf16_rows.cpp
torch::Tensor linear(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias, int64_t N);  // packed_gemm.cpp

namespace {

// onednn.run; a [N/32, K/2, 64] weight (bf16rows.py's copy): bf16_rows, its sums in chunks of kc
// k-pairs; a [N/16, K, 16] one (the packed float32 kernel's panels, lean.py: whole panels): its linear
at::Tensor run(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& b, int64_t kc) {
  if (wp.dim() == 3 && wp.size(2) == 16) return ::linear(x, wp, b, wp.size(0) * 16);
  if (wp.dim() == 3) return bf16_rows(x, wp, b, kc);
  const int64_t m = x.size(0), pad = bucket(m) - m;
  const at::Tensor xi = pad ? at::cat({x, x.new_zeros({pad, x.size(1)})}) : x;
  at::Tensor y = linear_op().call(xi, wp, b, "none", c10::List<std::optional<c10::Scalar>>(),
                                  std::optional<c10::string_view>(""));
  return pad ? y.slice(0, 0, m) : y;
}

at::Tensor floored(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& b, int64_t floor,
                   int64_t kc) {
  const int64_t m = x.size(0);
  if (floor <= 1 || m >= floor) return run(x, wp, b, kc);
  return run(at::cat({x, x.slice(0, m - 1).expand({floor - m, -1})}), wp, b, kc).slice(0, 0, m);
}

// x: [M, in] -> [M, out]
at::Tensor linear(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& b, int64_t step,
                  int64_t floor, int64_t kc) {
  const int64_t m = x.size(0);
  if (step <= 0) return run(x, wp, b, kc);
  if (m <= step) return floored(x, wp, b, floor, kc);
  std::vector<at::Tensor> parts;
  for (int64_t i = 0; i < m; i += step) parts.push_back(floored(x.slice(0, i, std::min(i + step, m)), wp, b, floor, kc));
  return at::cat(parts);
}

// HF's RMSNorm: x [T, hidden] in the model's dtype -> the same shape and dtype
at::Tensor rms(const at::Tensor& x, const at::Tensor& w, double eps) {
  const at::Tensor h = x.to(at::kFloat);
  const at::Tensor variance = h.pow(2).mean(-1, true);  // [T, 1]
  return w * (h * at::rsqrt(variance + eps)).to(x.scalar_type());
}

}  // namespace

// First half of a layer: x [T, hidden] -> (q [1, H, T, D], k [1, KV, T, D], v [1, KV, T, D]),
// the norm, the stacked q/k/v call (columns q, k, v) and RoPE on q and k in one call; cos, sin: [T, 1, D].
std::vector<at::Tensor> lean_pre(const at::Tensor& x, const at::Tensor& norm_w, double eps, const at::Tensor& wp,
                                 const std::optional<at::Tensor>& b, int64_t step, int64_t floor, const at::Tensor& cos,
                                 const at::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t d, int64_t kc) {
  const int64_t t = x.size(0), qe = heads * d, ke = qe + kv_heads * d;
  const at::Tensor qkv = linear(rms(x, norm_w, eps), wp, b, step, floor, kc);  // [T, (H + 2 KV) D]
  const at::Tensor q = qkv.slice(1, 0, qe).view({t, heads, d});
  const at::Tensor k = qkv.slice(1, qe, ke).view({t, kv_heads, d});
  const at::Tensor v = qkv.slice(1, ke, ke + kv_heads * d).view({t, kv_heads, d});
  const at::Tensor x2 = at::cat({q, k}, 1);  // [T, H + KV, D]
  const int64_t half = d / 2;
  const at::Tensor qk = (x2 * cos) + (at::cat({x2.slice(2, half).neg(), x2.slice(2, 0, half)}, -1) * sin);
  return {qk.slice(1, 0, heads).transpose(0, 1).unsqueeze(0), qk.slice(1, heads).transpose(0, 1).unsqueeze(0),
          v.transpose(0, 1).unsqueeze(0)};
}

// Second half: x [T, hidden], o [1, T, H, D] (attention's) -> the layer's output [T, hidden]:
// o_proj and the residual, the norm, the stacked gate/up call (columns gate, up), SiLU(gate) * up,
// down_proj and the residual. Each linear: (weight, bias, step, floor); kc: bf16_rows' chunk (run).
at::Tensor lean_post(const at::Tensor& x, const at::Tensor& o, const at::Tensor& wp_o, const std::optional<at::Tensor>& b_o,
                     int64_t step_o, int64_t floor_o, const at::Tensor& norm_w, double eps, const at::Tensor& wp_gu,
                     const std::optional<at::Tensor>& b_gu, int64_t step_gu, int64_t floor_gu, int64_t inter,
                     const at::Tensor& wp_d, const std::optional<at::Tensor>& b_d, int64_t step_d, int64_t floor_d,
                     int64_t kc) {
  const int64_t t = x.size(0);
  const at::Tensor x1 = x + linear(o.reshape({t, o.size(2) * o.size(3)}), wp_o, b_o, step_o, floor_o, kc);
  const at::Tensor gu = linear(rms(x1, norm_w, eps), wp_gu, b_gu, step_gu, floor_gu, kc);  // [T, 2 I]
  const at::Tensor act = at::silu(gu.slice(1, 0, inter)) * gu.slice(1, inter, 2 * inter);  // [T, I]
  return x1 + linear(act, wp_d, b_d, step_d, floor_d, kc);
}

// sdpa_rows.cpp
at::Tensor one_row(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, c10::optional<double> scale,
                   int64_t one);
void sdpa_rows(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t length, torch::Tensor path,
               torch::Tensor off, c10::optional<double> scale, int64_t one, int64_t width, torch::Tensor out);

// kv.py's _attend for a step whose rows all attend with torch's SDPA in one pool: per sequence, its
// new keys and values written to its slots, then HF's SDPA call over its slots in place (mask,
// is_causal, or for a maskless one-token row the call `one` names: attention.one_token_mode, made by the
// caller), or with
// kind 2 its rows one call each (sdpa_rows: a deterministic verify). q: [1, H, T, D]; k, v:
// [1, KV, T, D]; pk, pv: the layer's pool [KV, S, D]; geo: per sequence (offset, n, start, length,
// kind: 0 SDPA, 1 causal, 2 rows); masks[b]: kind 0's additive mask or none; paths, offs: kind 2's
// tree paths (empty for a chain); width: sdpa_rows' chain row groups -> [1, T, H, D].
at::Tensor pool_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pk,
                       const at::Tensor& pv, const std::vector<int64_t>& geo, const std::vector<std::optional<at::Tensor>>& masks,
                       const std::vector<at::Tensor>& paths, const std::vector<at::Tensor>& offs, std::optional<double> scale,
                       int64_t one, int64_t width) {
  const int64_t T = q.size(2), H = q.size(1), KV = k.size(1), D = q.size(3), B = static_cast<int64_t>(masks.size());
  TORCH_CHECK(static_cast<int64_t>(geo.size()) == 5 * B && static_cast<int64_t>(paths.size()) == B &&
              static_cast<int64_t>(offs.size()) == B, "pool_attend: five numbers, a mask, a path and offsets per sequence");
  at::Tensor out = q.new_empty({T, H, D});
  for (int64_t b = 0; b < B; ++b) {
    const int64_t a = geo[5 * b], n = geo[5 * b + 1], start = geo[5 * b + 2], length = geo[5 * b + 3], kind = geo[5 * b + 4];
    pk.slice(1, start + length, start + length + n).copy_(k[0].slice(1, a, a + n));
    pv.slice(1, start + length, start + length + n).copy_(v[0].slice(1, a, a + n));
    const at::Tensor ks = pk.slice(1, start, start + length + n).unsqueeze(0);  // [1, KV, L + n, D]
    const at::Tensor vs = pv.slice(1, start, start + length + n).unsqueeze(0);
    const at::Tensor qs = q.slice(2, a, a + n);
    if (kind == 2) {
      sdpa_rows(qs, ks, vs, length, paths[b], offs[b], scale, one, width, out.slice(0, a, a + n));
      continue;
    }
    const at::Tensor o = kind == 0 && n == 1 && !masks[b].has_value()
                             ? one_row(qs, ks, vs, scale, one)  // attention.sdpa's one-token call
                             : at::scaled_dot_product_attention(qs, ks, vs, masks[b], 0.0, kind == 1, scale, H != KV);
    out.slice(0, a, a + n).copy_(o[0].transpose(0, 1));
  }
  return out.unsqueeze(0);
}
