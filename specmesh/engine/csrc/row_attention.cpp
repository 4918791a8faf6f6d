// out[t] = softmax(q[t] . K_t^T * scale) V_t for each query row t alone, float32, AVX2/FMA: the
// attention of a decode or verify step, every row over exactly the slots it sees.
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
// Python around it by one call per layer for the whole step.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

namespace {

inline float hsum(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// exp(x) lane-wise (Cephes expf: range reduction by ln 2 in two parts, a degree-5 polynomial,
// 2^n through the exponent bits); x is clamped below at -87, where exp is ~1.6e-38.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

struct Slots {  // the slots one row sees, in order
  const int64_t start, len, *extra, n_extra;
  int64_t count() const { return len + n_extra; }
  int64_t operator[](int64_t j) const { return j < len ? start + j : extra[j - len]; }
};

// Scores of G query heads (q: [G, D]) against every slot of one kv head (k: [S, D]), times scale,
// into s[g * stride + j]. Two accumulators per dot product, summed then reduced in a fixed order.
void scores(const float* q, int64_t G, int64_t D, const float* k, const Slots& sl, float scale, float* s,
            int64_t stride) {
  const int64_t n = sl.count();
  for (int64_t j = 0; j < n; ++j) {
    const float* kr = k + sl[j] * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(kr + d), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d + 8), _mm256_loadu_ps(kr + d + 8), a1);
      }
      s[g * stride + j] = hsum(_mm256_add_ps(a0, a1)) * scale;
    }
  }
}

// In place: s[0 .. n) -> exp(s - max s), lanes past n set to 0 (s holds a multiple of 8 floats);
// returns their sum (8 lanes in slot order, then one fixed reduction).
float softmax_weights(float* s, int64_t n) {
  float m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
  const __m256 mv = _mm256_set1_ps(m);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - j)), lane));
    const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv)), live);
    _mm256_storeu_ps(s + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  return hsum(sum);
}

// o[0 .. D) = sum_j p[j] v[slot j] / total, 32 columns at a time (four FMA chains in slot order).
void weighted_values(const float* p, float total, int64_t D, const float* v, const Slots& sl, float* o) {
  const int64_t n = sl.count();
  const __m256 inv = _mm256_set1_ps(1.0f / total);
  for (int64_t d = 0; d < D; d += 32) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j = 0; j < n; ++j) {
      const float* vr = v + sl[j] * D + d;
      const __m256 w = _mm256_set1_ps(p[j]);
      a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr), a0);
      a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8), a1);
      a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 16), a2);
      a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 24), a3);
    }
    _mm256_storeu_ps(o + d, _mm256_mul_ps(a0, inv));
    _mm256_storeu_ps(o + d + 8, _mm256_mul_ps(a1, inv));
    _mm256_storeu_ps(o + d + 16, _mm256_mul_ps(a2, inv));
    _mm256_storeu_ps(o + d + 24, _mm256_mul_ps(a3, inv));
  }
}

}  // namespace

// q: [T, H, D]; k, v: [KV, S, D] (one layer of the pool; each head's slots contiguous);
// start, len: [T] int64; off: [T + 1] int64; extra: [E] int64 (pool slots) -> [T, H, D].
torch::Tensor row_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor start,
                            torch::Tensor len, torch::Tensor off, torch::Tensor extra, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "row attention: float32 only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(2) == k.size(2),
              "row attention: q [T, H, D], k and v [KV, S, D]");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "row attention: each head's slots must be contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(0), S = k.size(1), G = H / KV;
  TORCH_CHECK(H % KV == 0 && D % 32 == 0, "row attention: heads a multiple of kv heads, head dim of 32s");
  auto qc = q.contiguous();
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
  const float *qp = qc.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  at::parallel_for(0, T * KV, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> s;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / KV, h = i % KV;
      const Slots sl{sp[t], lp[t], ep ? ep + op[t] : nullptr, op[t + 1] - op[t]};
      const int64_t n = sl.count(), stride = (n + 7) / 8 * 8;
      s.assign(G * stride, 0.0f);
      scores(qp + (t * H + h * G) * D, G, D, kp + h * ks, sl, static_cast<float>(scale), s.data(), stride);
      for (int64_t g = 0; g < G; ++g) {
        const float total = softmax_weights(s.data() + g * stride, n);
        weighted_values(s.data() + g * stride, total, D, vp + h * vs, sl, o + (t * H + h * G + g) * D);
      }
    }
  });
  return out;
}
