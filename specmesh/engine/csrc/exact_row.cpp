// One bf16 query row's attention in the order torch's CPU SDPA computes it, bit for bit, without its
// per-call cost (attention.py's exact_ok probes the equality before any step uses it).
//
// Why: a one-token step must be HF `generate`'s arithmetic (the mesh's AR is HF's, bit for bit),
// and HF's bf16 SDPA for one query row is slow on a CPU whose BLAS takes a generic path: torch 2.13's
// flash kernel runs two BLAS matrix-vector products per head and 512-slot block (q . k, then
// probabilities . v), and on a 2-core AMD EPYC (Zen 5) those were MKL's default bf16 gemv, ~1.8 ms a
// layer at 2,200 slots (perf: most of it in mkl_blas_def_xgemv_bf16bf16f32).
//
// The order, measured on that CPU with one thread against MKL's cblas_gemm_bf16bf16f32 itself on
// wide-range data (values 2^-12 .. 2^12, where any other order rounds apart) and then against the
// whole SDPA call (every bf16 product of two bf16 values is exact in float32, so only the order of
// the additions matters):
//   scores      q . k[j] over d as four float32 lanes (lane l sums d = l, l + 4, ... in order), then
//               (l0 + l2) + (l1 + l3); times the scale; the block's max
//   softmax     ATen's fexp_u20 of (score - max), summed 32 at a time in two 16-lane vectors (a last
//               16 into the first), the two added and reduced as ATen's vec_reduce_all does, the
//               tail by std::exp added in order (matched against the call's logsumexp); probabilities
//               rounded to bf16; running max / sum across 512-slot blocks as the flash kernel keeps
//               them (the new sum one fma of the rescale and the old: matched against the logsumexp)
//   weighted    per head dim: from the running sum (0 for the first block, else the rescaled one),
//   values      + ((t0 + t2) + (t1 + t3)) for each 4 slots in order, then the block's tail slots
//               one at a time from its last
//   output      the float32 sum times 1 / (the softmax's sum), rounded to bf16
// Each head's arithmetic is that order alone; the query heads of one kv head (up to 4 a pass) share
// each gathered key and widened value (session 47, a Zen 4: SmolLM2's 9 x 3 x 64 at 2,200 slots 193 ->
// 101 us a call, Qwen2.5-Coder-1.5B's 12 x 2 x 128 475 -> 221 us, same bits).
// Nothing here assumes the order holds elsewhere: another CPU, BLAS, thread count or torch build
// may differ, so the probe compares this kernel with HF's call on this machine and the engine uses
// it only where they are equal on every draw.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define SPECMESH_EXACT_ROW 1
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY AVX512
#endif

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#ifdef SPECMESH_EXACT_ROW
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

#include "row_attention.h"

namespace {

using Vec = at::vec::Vectorized<float>;
using bf16 = at::BFloat16;
constexpr int64_t KV_SPLIT = 512;  // the flash kernel's slots per block
static_assert(Vec::size() == 16, "exp_sum widens its probabilities 16 at a time");
using specmesh_attn::prefetch_span;
using specmesh_attn::PREFETCH_SLOTS;

inline __m512 widen16(const bf16* p) {  // 16 bf16 -> 16 float32, exactly
  return specmesh_attn::load16(reinterpret_cast<const uint16_t*>(p));
}

// The G query heads of one kv head run together (G <= 4 a pass): every gathered key and widened
// value is loaded once for all of them, each head's sums kept apart in the same order as alone.

// scores[g][j] = q[g] . k[j] for n slots (k rows ks apart, D % 4 == 0): 4 slots per vector, 4 lanes each
template <int G>
void scores(const bf16* k, int64_t ks, const bf16* v, int64_t vs, int64_t n, const float* q, int64_t D, float* out) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    for (int64_t i = j + PREFETCH_SLOTS; i < std::min(j + PREFETCH_SLOTS + 4, n); ++i) prefetch_span(k + i * ks, D * 2);
    for (int64_t i = j; i < j + 4; ++i) prefetch_span<_MM_HINT_T1>(v + i * vs, D * 2);  // for weigh (row_attention.h)
    __m512 acc[G];  // per head: [slot 0 lanes 0..3 | slot 1 | slot 2 | slot 3]
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 4) {
      const __m256i raw = _mm256_set_epi64x(*(const int64_t*)(k + (j + 3) * ks + d), *(const int64_t*)(k + (j + 2) * ks + d),
                                            *(const int64_t*)(k + (j + 1) * ks + d), *(const int64_t*)(k + j * ks + d));
      const __m512 kv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
      for (int g = 0; g < G; ++g)
        acc[g] = _mm512_add_ps(acc[g], _mm512_mul_ps(kv, _mm512_broadcast_f32x4(_mm_loadu_ps(q + g * D + d))));
    }
    for (int g = 0; g < G; ++g) {
      const __m512 r1 = _mm512_add_ps(acc[g], _mm512_shuffle_ps(acc[g], acc[g], _MM_SHUFFLE(1, 0, 3, 2)));  // l0+l2, l1+l3
      const __m512 r2 = _mm512_add_ps(r1, _mm512_shuffle_ps(r1, r1, _MM_SHUFFLE(2, 3, 0, 1)));
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, r2);
      for (int i = 0; i < 4; ++i) out[g * KV_SPLIT + j + i] = lanes[4 * i];
    }
  }
  for (; j < n; ++j) {
    for (int g = 0; g < G; ++g) {
      float l[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t d = 0; d < D; ++d) l[d & 3] = l[d & 3] + static_cast<float>(k[j * ks + d]) * q[g * D + d];
      out[g * KV_SPLIT + j] = (l[0] + l[2]) + (l[1] + l[3]);
    }
  }
}

// scale the scores in place, return their max (the flash kernel's _mul_reduce_max_fusion_kernel)
float scale_max(float* s, int64_t n, float scale) {
  const int64_t W = Vec::size();
  Vec vmax(-std::numeric_limits<float>::infinity()), vsc(scale);
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i < W * (n / W); i += W) {
    const Vec t = Vec::loadu(s + i) * vsc;
    vmax = at::vec::maximum(vmax, t);
    t.store(s + i);
  }
  for (; i < n; ++i) s[i] = s[i] * scale, m = std::max(m, s[i]);
  return std::max(m, at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmax));
}

// p = exp(s - max) rounded to bf16 (kept widened to float32: exact), returns their float32 sum (the
// flash kernel's exp-and-sum pass): exps 32 at a time into two 16-lane sums (a last 16 into the
// first), the two added and reduced as ATen's vec_reduce_all, the tail (std::exp) added in order
float exp_sum(const float* s, int64_t n, float max, float* p) {
  const int64_t W = Vec::size();
  const Vec vm(max);
  Vec sum0(0.f), sum1(0.f);
  alignas(64) bf16 h[32];
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    const Vec e0 = (Vec::loadu(s + i) - vm).fexp_u20(), e1 = (Vec::loadu(s + i + W) - vm).fexp_u20();
    sum0 += e0;
    sum1 += e1;
    at::vec::convert_from_float<bf16>(e0, e1).store(h, 2 * W);
    _mm512_storeu_ps(p + i, widen16(h));
    _mm512_storeu_ps(p + i + W, widen16(h + W));
  }
  if (i + W <= n) {
    const Vec e0 = (Vec::loadu(s + i) - vm).fexp_u20();
    sum0 += e0;
    at::vec::convert_from_float<bf16>(e0, e0).store(h, W);
    _mm512_storeu_ps(p + i, widen16(h));
    i += W;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum0 + sum1);
  for (; i < n; ++i) {
    const float e = std::exp(s[i] - max);
    sum += e;
    p[i] = static_cast<float>(bf16(e));
  }
  return sum;
}

// y[g][d] += sum over n slots of p[g][j] v[j][d] in the BLAS's order (file comment); D % 16 == 0. Each
// 16-dim chunk of y is its own sum, so chunk by chunk is the same arithmetic as all chunks at once.
template <int G>
void weigh(const bf16* v, int64_t vs, const float* p, int64_t n, int64_t D, float* y) {
  const int64_t full = n - n % 4;
  for (int64_t c = 0; c < D; c += 16) {
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_loadu_ps(y + g * D + c);
    for (int64_t j = 0; j < full; j += 4) {
      const bf16* r = v + j * vs + c;
      const __m512 w0 = widen16(r), w1 = widen16(r + vs), w2 = widen16(r + 2 * vs), w3 = widen16(r + 3 * vs);
      for (int g = 0; g < G; ++g) {
        const float* pg = p + g * KV_SPLIT + j;
        const __m512 t0 = _mm512_mul_ps(w0, _mm512_set1_ps(pg[0])), t1 = _mm512_mul_ps(w1, _mm512_set1_ps(pg[1]));
        const __m512 t2 = _mm512_mul_ps(w2, _mm512_set1_ps(pg[2])), t3 = _mm512_mul_ps(w3, _mm512_set1_ps(pg[3]));
        acc[g] = _mm512_add_ps(acc[g], _mm512_add_ps(_mm512_add_ps(t0, t2), _mm512_add_ps(t1, t3)));
      }
    }
    for (int64_t j = n - 1; j >= full; --j) {
      const __m512 w = widen16(v + j * vs + c);
      for (int g = 0; g < G; ++g) acc[g] = _mm512_add_ps(acc[g], _mm512_mul_ps(w, _mm512_set1_ps(p[g * KV_SPLIT + j])));
    }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(y + g * D + c, acc[g]);
  }
}

struct Scratch {  // per call: G <= 4 heads' scores, probabilities, queries and running outputs
  std::vector<float> s, p, qf, dst;
  explicit Scratch(int64_t D) : s(4 * KV_SPLIT), p(4 * KV_SPLIT), qf(4 * D), dst(4 * D) {}
};

// G query heads (rows D apart from q) of one kv head over L slots -> out [G, D] bf16 (the flash kernel's
// loop over 512-slot blocks, each head's running max and sum its own); lse[g]: each head's logsumexp
// as the flash op reports it
template <int G>
void heads(const bf16* q, const bf16* k, int64_t ks, const bf16* v, int64_t vs, int64_t L, int64_t D, float scale,
           Scratch& w, bf16* out, float* lse) {
  for (int64_t i = 0; i < G * D; ++i) w.qf[i] = static_cast<float>(q[i]);
  float run_max[G], run_sum[G];
  for (int g = 0; g < G; ++g) run_max[g] = -std::numeric_limits<float>::infinity(), run_sum[g] = 0.f;
  std::fill(w.dst.begin(), w.dst.end(), 0.f);
  for (int64_t j = 0; j < std::min(PREFETCH_SLOTS, L); ++j) prefetch_span(k + j * ks, D * 2);
  for (int64_t n0 = 0; n0 < L; n0 += KV_SPLIT) {
    const int64_t nb = std::min(KV_SPLIT, L - n0);
    scores<G>(k + n0 * ks, ks, v + n0 * vs, vs, nb, w.qf.data(), D, w.s.data());
    for (int g = 0; g < G; ++g) {
      float* sg = w.s.data() + g * KV_SPLIT;
      const float block_max = std::max(run_max[g], scale_max(sg, nb, scale));
      const float block_sum = exp_sum(sg, nb, block_max, w.p.data() + g * KV_SPLIT);
      const float rescale = std::exp(run_max[g] - block_max);
      run_sum[g] = std::fma(rescale, run_sum[g], block_sum);  // torch's build contracts sum + rescale * old into one fma
      run_max[g] = block_max;
      if (n0 > 0) {
        for (int64_t d = 0; d < D; ++d) w.dst[g * D + d] = w.dst[g * D + d] * rescale;
      }
    }
    weigh<G>(v + n0 * vs, vs, w.p.data(), nb, D, w.dst.data());
  }
  for (int g = 0; g < G; ++g) {
    const float rec = 1.f / run_sum[g];
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = bf16(w.dst[g * D + d] * rec);
    if (lse != nullptr) lse[g] = run_max[g] + std::log(run_sum[g]);
  }
}

using Heads = void (*)(const bf16*, const bf16*, int64_t, const bf16*, int64_t, int64_t, int64_t, float, Scratch&, bf16*,
                       float*);
constexpr Heads HEADS[5] = {nullptr, heads<1>, heads<2>, heads<3>, heads<4>};

}  // namespace

bool exact_row_built() { return true; }

// q: [1, H, 1, D] bf16; k, v: [1, KV, L, D] bf16 (head dim contiguous, any slot and head strides),
// H a multiple of KV (query head h reads kv head h / (H / KV)); D a multiple of 16, at most 256;
// scale: none for torch's default, 1 / sqrt(D) -> [1, H, 1, D]: HF's SDPA call (enable_gqa where grouped, no mask, scale) in its own order; lse, if
// given ([H] float32), receives each head's logsumexp (the probe compares it with the flash op's).
torch::Tensor exact_row(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<double> scale,
                        c10::optional<torch::Tensor> lse) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "exact_row: bf16 only");
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && q.size(2) == 1 && k.dim() == 4 && k.size(0) == 1 && v.sizes() == k.sizes(),
              "exact_row: q [1, H, 1, D], k and v [1, KV, L, D]");
  const int64_t H = q.size(1), KV = k.size(1), L = k.size(2), D = q.size(3);
  TORCH_CHECK(k.size(3) == D && H % KV == 0 && D % 16 == 0 && D <= 256 && L >= 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "exact_row: grouped heads, D a multiple of 16 up to 256, head dim contiguous, at least one slot");
  TORCH_CHECK(!lse.has_value() || (lse->scalar_type() == at::kFloat && lse->is_contiguous() && lse->numel() == H),
              "exact_row: lse, where given, [H] float32");
  const float sc = static_cast<float>(scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(D)));
  const auto qc = q.contiguous();
  auto out = torch::empty({1, H, 1, D}, q.options());
  Scratch w(D);
  const bf16 *qp = qc.data_ptr<bf16>(), *kp = k.data_ptr<bf16>(), *vp = v.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  float* lp = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  const int64_t group = H / KV, passes = (group + 3) / 4;  // each kv head's query heads, in passes of <= 4
  for (int64_t g = 0, h = 0; g < KV; ++g) {
    if (g + 1 < KV)  // the next kv head's first keys towards L2 while this one runs
      for (int64_t j = 0; j < std::min(2 * PREFETCH_SLOTS, L); ++j)
        prefetch_span<_MM_HINT_T1>(kp + (g + 1) * k.stride(1) + j * k.stride(2), D * 2);
    for (int64_t i = 0; i < passes; ++i) {
      const int64_t n = group / passes + (i < group % passes ? 1 : 0);
      HEADS[n](qp + h * D, kp + g * k.stride(1), k.stride(2), vp + g * v.stride(1), v.stride(2), L, D, sc, w, op + h * D,
               lp == nullptr ? nullptr : lp + h);
      h += n;
    }
  }
  return out;
}

#else  // no AVX-512 build: the probe finds exact_row_built() false and never calls exact_row

bool exact_row_built() { return false; }

torch::Tensor exact_row(torch::Tensor q, torch::Tensor, torch::Tensor, c10::optional<double>, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "exact_row: not built (needs AVX-512 F/BW/VL/DQ)");
  return q;
}

#endif
