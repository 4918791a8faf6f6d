// out[t] = softmax(q[t] . K_t^T * scale) V_t for each query row t alone, AVX2/FMA: the attention of
// a decode or verify step, every row over exactly the slots it sees. float32, or bfloat16 q / k / v
// (each value widened to float32 exactly as it is loaded, the same float32 arithmetic, the output
// rounded to bf16 once at the end: the deterministic mode's 2-row floor, rowexact.py).
//
// The slots row t sees: the contiguous pool slots [start[t], start[t] + len[t]) (its sequence's
// cache, plus, for a chain, the new rows up to itself), then the pool slots
// extra[off[t] .. off[t + 1]) (for a draft tree: its ancestors' and its own new slots, root first).
// A tree row thus reads its path where it lies: no slot is copied.
//
// Row-invariant by construction: each (row, kv head) is computed start to end by one thread, in an
// order fixed by its own slot count alone (scores slot by slot, one max, exp lane-wise, sums in
// slot order), whatever else the step holds. A verify row is therefore bitwise the one-token step
// that sees the same slots, in a chain, a tree or a batch, which makes deterministic verification
// free of per-row calls. It replaces one SDPA call per sequence per layer (or per row) and the
// Python around it by one call per layer for the whole step. Where AVX-512 is built, a sequence's
// rows run together instead (row_attention_group.cpp: each key and value loaded once for all of
// them), in the same arithmetic: the same bits, row by row.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <vector>

#include "row_attention.h"

using namespace specmesh_attn;

namespace {

// One dot product's lanes: two FMA chains over d (d mod 16 < 8, >= 8), added lane-wise.
template <typename T>
inline __m256 dot_lanes(const float* q, const T* kr, int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(kr + d), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(kr + d + 8), a1);
  }
  return _mm256_add_ps(a0, a1);
}

// Scores of G query heads (q: [G, D]) against every slot of one kv head (k: [S, D]), times scale,
// into s[g * stride + j]: each one dot_lanes reduced by hsum, eight slots per reduction.
template <typename T>
void scores(const float* q, int64_t G, int64_t D, const T* k, const T* v, const Slots& sl, float scale, float* s,
            int64_t stride) {
  const int64_t n = sl.count();
  const __m256 sv = _mm256_set1_ps(scale);
  int64_t j = 0;
  prefetch_rows(k, sl, 0, PREFETCH_SLOTS, D, 0, D);
  for (; j + 8 <= n; j += 8) {
    prefetch_rows(k, sl, j + PREFETCH_SLOTS, j + PREFETCH_SLOTS + 8, D, 0, D);  // (row_attention.h)
    prefetch_rows<_MM_HINT_T1>(v, sl, j, j + 8, D, 0, D);
    const T* kr[8];
    for (int i = 0; i < 8; ++i) kr[i] = k + sl[j + i] * D;
    for (int64_t g = 0; g < G; ++g) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = dot_lanes(q + g * D, kr[i], D);
      _mm256_storeu_ps(s + g * stride + j, _mm256_mul_ps(hsum8(r), sv));
    }
  }
  for (; j < n; ++j)
    for (int64_t g = 0; g < G; ++g) s[g * stride + j] = hsum(dot_lanes(q + g * D, k + sl[j] * D, D)) * scale;
}

// o_g[0 .. D) = sum_j p_g[j] v[slot j] / total_g for GN query heads at once (p_g = p + g * stride,
// o_g = o + g * D): one pass over the values per CW columns (GN x CW / 8 accumulators, at most 12,
// so that they, the GN weights and a value vector fit the 16 registers), each column of each head
// one FMA chain in slot order from 0. Each pass prefetches the value rows PREFETCH_SLOTS ahead.
template <int GN, int CW, typename T>
void weighted_values(const float* p, int64_t stride, const float* total, int64_t D, const T* v, const Slots& sl,
                     float* o) {
  constexpr int NV = CW / 8;
  const int64_t n = sl.count();
  for (int64_t d = 0; d < D; d += CW) {
    __m256 a[GN][NV];
    for (int g = 0; g < GN; ++g)
      for (int c = 0; c < NV; ++c) a[g][c] = _mm256_setzero_ps();
    prefetch_rows(v, sl, 0, PREFETCH_SLOTS, D, d, CW);
    for (int64_t j = 0; j < n; ++j) {
      if (j + PREFETCH_SLOTS < n) prefetch_span(v + sl[j + PREFETCH_SLOTS] * D + d, CW * sizeof(T));
      const T* vr = v + sl[j] * D + d;
      __m256 w[GN];
      for (int g = 0; g < GN; ++g) w[g] = _mm256_set1_ps(p[g * stride + j]);
      for (int c = 0; c < NV; ++c) {
        const __m256 x = load8(vr + 8 * c);
        for (int g = 0; g < GN; ++g) a[g][c] = _mm256_fmadd_ps(w[g], x, a[g][c]);
      }
    }
    for (int g = 0; g < GN; ++g) {
      const __m256 inv = _mm256_set1_ps(1.0f / total[g]);
      for (int c = 0; c < NV; ++c) _mm256_storeu_ps(o + g * D + d + 8 * c, _mm256_mul_ps(a[g][c], inv));
    }
  }
}

// All G query heads of one kv head: three at a time over 32 columns (four over 16 where G is a
// multiple of 4), the rest alike.
template <typename T>
void all_values(const float* p, int64_t stride, const float* total, int64_t G, int64_t D, const T* v, const Slots& sl,
                float* o) {
  const int64_t step = G % 4 == 0 ? 4 : 3;
  for (int64_t g = 0; g < G; g += step) {
    const float *pg = p + g * stride, *tg = total + g;
    float* og = o + g * D;
    switch (std::min<int64_t>(step, G - g)) {
      case 4: weighted_values<4, 16>(pg, stride, tg, D, v, sl, og); break;
      case 3: weighted_values<3, 32>(pg, stride, tg, D, v, sl, og); break;
      case 2: weighted_values<2, 32>(pg, stride, tg, D, v, sl, og); break;
      default: weighted_values<1, 32>(pg, stride, tg, D, v, sl, og); break;
    }
  }
}

// Every (row, kv head) of the step alone (rows over threads; see the top of the file).
template <typename T>
void attend_rows(const RowArgs& a, const T* kp, const T* vp, int64_t T_rows) {
  at::parallel_for(0, T_rows * a.KV, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> s, total(a.G);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / a.KV, h = i % a.KV;
      const Slots sl = a.slots(t);
      const int64_t n = sl.count(), stride = (n + 7) / 8 * 8;
      s.assign(a.G * stride, 0.0f);
      if (i + 1 < T_rows * a.KV) prefetch_first_keys(a, kp, (i + 1) / a.KV, (i + 1) % a.KV);  // the next task's
      scores(a.q + (t * a.H + h * a.G) * a.D, a.G, a.D, kp + h * a.ks, vp + h * a.vs, sl, a.scale, s.data(), stride);
      for (int64_t g = 0; g < a.G; ++g) total[g] = softmax_weights(s.data() + g * stride, n);
      all_values(s.data(), stride, total.data(), a.G, a.D, vp + h * a.vs, sl, a.o + (t * a.H + h * a.G) * a.D);
    }
  });
}

}  // namespace

// row_attention_group.cpp: a sequence's rows together, bitwise attend_rows (false where not built).
bool attend_groups(const RowArgs& a, const float* k, const float* v, int64_t T_rows);
bool attend_groups(const RowArgs& a, const uint16_t* k, const uint16_t* v, int64_t T_rows);

// q: [T, H, D]; k, v: [KV, S, D] (one layer of the pool; each head's slots contiguous);
// start, len: [T] int64; off: [T + 1] int64; extra: [E] int64 (pool slots) -> [T, H, D].
// grouped: the AVX-512 path where built (same bits; false: one (row, kv head) at a time, AVX2).
torch::Tensor row_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor start,
                            torch::Tensor len, torch::Tensor off, torch::Tensor extra, double scale, bool grouped) {
  const auto dt = q.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && k.scalar_type() == dt && v.scalar_type() == dt,
              "row attention: q, k, v all float32 or all bfloat16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(2) == k.size(2),
              "row attention: q [T, H, D], k and v [KV, S, D]");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "row attention: each head's slots must be contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(0), S = k.size(1), G = H / KV;
  TORCH_CHECK(H % KV == 0 && D % 32 == 0, "row attention: heads a multiple of kv heads, head dim of 32s");
  auto qc = q.to(at::kFloat).contiguous();  // [T, H, D] float32 (bf16 widened exactly)
  auto st = start.contiguous(), ln = len.contiguous(), of = off.contiguous(), ex = extra.contiguous();
  TORCH_CHECK(st.numel() == T && ln.numel() == T && of.numel() == T + 1, "row attention: one slot range per row");
  const int64_t *sp = st.data_ptr<int64_t>(), *lp = ln.data_ptr<int64_t>(), *op = of.data_ptr<int64_t>();
  const int64_t* ep = ex.numel() ? ex.data_ptr<int64_t>() : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(lp[t] >= 0 && sp[t] >= 0 && sp[t] + lp[t] <= S && op[t] <= op[t + 1] && op[t + 1] <= ex.numel() &&
                lp[t] + op[t + 1] - op[t] > 0, "row attention: row ", t, " sees no slot or slots past the pool");
    for (int64_t e = op[t]; e < op[t + 1]; ++e) TORCH_CHECK(ep[e] >= 0 && ep[e] < S, "row attention: slot past the pool");
  }
  auto out = torch::empty({T, H, D}, qc.options());
  const RowArgs a{qc.data_ptr<float>(), out.data_ptr<float>(), sp, lp, op, ep, H, D, KV, G, k.stride(0), v.stride(0),
                  static_cast<float>(scale)};
  if (dt == at::kFloat) {
    if (!grouped || !attend_groups(a, k.data_ptr<float>(), v.data_ptr<float>(), T))
      attend_rows(a, k.data_ptr<float>(), v.data_ptr<float>(), T);
    return out;
  }
  const auto *kb = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
             *vb = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  if (!grouped || !attend_groups(a, kb, vb, T)) attend_rows(a, kb, vb, T);
  return out.to(at::kBFloat16);  // one rounding, round-to-nearest-even
}
