// The row-attention kernel's AVX-512 path (row_attention.cpp holds the AVX2 one and the entry): a
// sequence's rows together, so that each key and value a verify step reads is loaded (and widened
// from bf16) once for all of its rows and query heads, not once per (row, head).
//
// Bitwise the AVX2 path, row by row. What fixes a row's bits there is per (query head, slot) and per
// query head, never per call: a score is one dot product in two 8-lane FMA chains over d (d mod 16 <
// 8 and >= 8), the chains added, then reduced in hsum's pairing; a query head's softmax runs over
// its own n scores (softmax_weights); each output column is one FMA chain over the head's slots in
// slot order, times 1 / total. Here a 16-lane FMA chain is those two 8-lane chains side by side
// (lanes 0-7 and 8-15; FMA is lane-wise), added as its two halves; a value column's chain is the same
// chain in a wider register; a row's chain that runs past the slots its group shares is stored
// (float32, exact) and carried on alone. No other order changes, so a verify row is still the
// one-token step on the same slots, whatever shares its call.
//
// Groups: consecutive rows with the same first slot (one sequence's chain or tree, as row_attn.py
// packs them), at most GROUP_ROWS; they share the contiguous slots every one of them sees (a chain:
// the cache and its first new slot; a tree: the cache), each row's further slots its own.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "row_attention.h"

#ifdef __AVX512F__
using namespace specmesh_attn;

namespace {

constexpr int64_t GROUP_ROWS = 16;
constexpr int MAX_QUERIES = 6;  // query heads' value accumulators at once: 6 x 4 zmm, with 4 for a value row

// The AVX2 path's a0 + a1 from a 16-lane chain (lanes 0-7: a0, 8-15: a1).
inline __m256 halves(__m512 acc) {
  return _mm256_add_ps(_mm512_castps512_ps256(acc), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
}

// kb[i * D ..] = slot sl[j + i] of k as float32, i < 8.
template <typename T>
inline void widen8(const T* k, const Slots& sl, int64_t j, int64_t D, float* kb) {
  for (int i = 0; i < 8; ++i) {
    const T* kr = k + sl[j + i] * D;
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(kb + i * D + d, load16(kr + d));
  }
}

// s[0 .. 8) = scale * q . kb[i], i < 8 (the AVX2 path's hsum8 of its dot_lanes).
inline void scores8(const float* q, const float* kb, int64_t D, __m256 sv, float* s) {
  __m512 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 qd = _mm512_loadu_ps(q + d);
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(kb + i * D + d), acc[i]);
  }
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = halves(acc[i]);
  _mm256_storeu_ps(s, _mm256_mul_ps(hsum8(r), sv));
}

template <typename T>
inline float score1(const float* q, const T* kr, int64_t D, float scale) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(kr + d), acc);
  return hsum(halves(acc)) * scale;
}

// exp8 (row_attention.h) on sixteen lanes: the same operations and constants lane for lane.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(EXP_LO));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x));
  __m512 y = _mm512_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_POLY[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// softmax_weights (row_attention.h) sixteen lanes at a time, bitwise: the same max, the same exp
// lane for lane, and the sum still eight lanes added in slot order (low half, then high half).
inline float softmax16(float* s, int64_t n) {
  __m512 m16 = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(s + i));
  float m = _mm512_reduce_max_ps(m16);
  for (; i < n; ++i) m = std::max(m, s[i]);
  const __m512 mv = _mm512_set1_ps(m);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int64_t n8 = (n + 7) / 8 * 8;  // the AVX2 loop's extent: s holds that many floats
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n8; j += 16) {
    const __mmask16 live = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(static_cast<int>(n - j)), lane);
    const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv)));
    _mm512_storeu_ps(s + j, p);
    sum = _mm256_add_ps(sum, _mm512_castps512_ps256(p));
    sum = _mm256_add_ps(sum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1)));
  }
  if (j < n8) sum = _mm256_add_ps(sum, weights8(s, j, n, _mm512_castps512_ps256(mv)));
  return hsum(sum);
}

struct Query {  // one (row, query head) of a group
  const float* q;
  float* o;  // [D] output, float32
  float* s;  // its scores, then softmax weights (a multiple of 8 floats)
  Slots sl;
  float total;
};

// Scores of every query over slots [0, shared) (the same pool slots for all), then each one's own
// further slots: 8 at a time where 8 remain, then one by one.
template <typename T>
void group_scores(std::vector<Query>& qs, int64_t shared, const T* k, const T* v, int64_t D, float scale, float* kb) {
  const __m256 sv = _mm256_set1_ps(scale);
  const int64_t full = shared / 8 * 8;
  prefetch_rows(k, qs[0].sl, 0, std::min<int64_t>(PREFETCH_SLOTS, shared), D, 0, D);
  for (int64_t j = 0; j < full; j += 8) {
    prefetch_rows(k, qs[0].sl, j + PREFETCH_SLOTS, std::min(j + PREFETCH_SLOTS + 8, shared), D, 0, D);
    prefetch_rows<_MM_HINT_T1>(v, qs[0].sl, j, j + 8, D, 0, D);
    widen8(k, qs[0].sl, j, D, kb);
    for (auto& x : qs) scores8(x.q, kb, D, sv, x.s + j);
  }
  for (auto& x : qs) {
    const int64_t n = x.sl.count();
    int64_t j = full;
    for (; j + 8 <= n; j += 8) {
      widen8(k, x.sl, j, D, kb);
      scores8(x.q, kb, D, sv, x.s + j);
    }
    for (; j < n; ++j) x.s[j] = score1(x.q, k + x.sl[j] * D, D, scale);
  }
}

// o = sum_j p[j] v[slot j] over slots [j0, j1) for NQ queries at once, columns [d, d + 16 NV):
// carried on from o where j0 > 0, scaled by 1 / total where last.
template <int NQ, int NV, typename T>
void values_span(Query* qs, const T* v, const Slots& sl, int64_t j0, int64_t j1, int64_t D, int64_t d, bool last) {
  __m512 a[NQ][NV];
  prefetch_rows(v, sl, j0, std::min(j0 + PREFETCH_SLOTS, j1), D, d, 16 * NV);
  for (int g = 0; g < NQ; ++g)
    for (int c = 0; c < NV; ++c) a[g][c] = j0 ? _mm512_loadu_ps(qs[g].o + d + 16 * c) : _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    if (j + PREFETCH_SLOTS < j1) prefetch_span(v + sl[j + PREFETCH_SLOTS] * D + d, 16 * NV * sizeof(T));
    const T* vr = v + sl[j] * D + d;
    __m512 x[NV];
    for (int c = 0; c < NV; ++c) x[c] = load16(vr + 16 * c);
    for (int g = 0; g < NQ; ++g) {
      const __m512 w = _mm512_set1_ps(qs[g].s[j]);
      for (int c = 0; c < NV; ++c) a[g][c] = _mm512_fmadd_ps(w, x[c], a[g][c]);
    }
  }
  for (int g = 0; g < NQ; ++g) {
    const __m512 inv = _mm512_set1_ps(last ? 1.0f / qs[g].total : 1.0f);
    for (int c = 0; c < NV; ++c)
      _mm512_storeu_ps(qs[g].o + d + 16 * c, last ? _mm512_mul_ps(a[g][c], inv) : a[g][c]);
  }
}

template <int NV, typename T>
void values_chunk(Query* qs, int nq, const T* v, const Slots& sl, int64_t j0, int64_t j1, int64_t D, int64_t d,
                  bool last) {
  switch (nq) {
    case 6: values_span<6, NV>(qs, v, sl, j0, j1, D, d, last); break;
    case 5: values_span<5, NV>(qs, v, sl, j0, j1, D, d, last); break;
    case 4: values_span<4, NV>(qs, v, sl, j0, j1, D, d, last); break;
    case 3: values_span<3, NV>(qs, v, sl, j0, j1, D, d, last); break;
    case 2: values_span<2, NV>(qs, v, sl, j0, j1, D, d, last); break;
    default: values_span<1, NV>(qs, v, sl, j0, j1, D, d, last); break;
  }
}

// Every query's output: the shared slots for up to MAX_QUERIES at once, then each one's own rest,
// 64 columns at a time (32 where D is not a multiple of 64).
template <typename T>
void group_values(std::vector<Query>& qs, int64_t shared, const T* v, int64_t D) {
  const int64_t cw = D % 64 == 0 ? 64 : 32;
  for (int64_t d = 0; d < D; d += cw) {
    const size_t chunks = (qs.size() + MAX_QUERIES - 1) / MAX_QUERIES;  // of balanced sizes (15: 5 + 5 + 5)
    int nq = 0;
    for (size_t c = 0, g = 0; c < chunks; ++c, g += nq) {
      nq = static_cast<int>((qs.size() - g) / (chunks - c));
      const bool last = shared == qs[g].sl.count() && std::all_of(qs.begin() + g, qs.begin() + g + nq,
                                                                   [&](const Query& x) { return x.sl.count() == shared; });
      if (cw == 64) values_chunk<4>(&qs[g], nq, v, qs[0].sl, 0, shared, D, d, last);
      else values_chunk<2>(&qs[g], nq, v, qs[0].sl, 0, shared, D, d, last);
      if (last) continue;
      for (int i = 0; i < nq; ++i) {
        Query& x = qs[g + i];
        if (cw == 64) values_span<1, 4>(&x, v, x.sl, shared, x.sl.count(), D, d, true);
        else values_span<1, 2>(&x, v, x.sl, shared, x.sl.count(), D, d, true);
      }
    }
  }
}

}  // namespace

// Rows [t0, t1) of one group, kv head h (row_attention.cpp's RowArgs; out float32).
template <typename T>
static void attend_group(const RowArgs& a, const T* k, const T* v, int64_t t0, int64_t t1, int64_t h,
                         std::vector<float>& s, std::vector<float>& kb, std::vector<Query>& qs) {
  int64_t shared = a.len[t0], stride = 0;
  for (int64_t t = t0; t < t1; ++t) {
    shared = std::min(shared, a.len[t]);
    stride = std::max(stride, (a.len[t] + a.off[t + 1] - a.off[t] + 7) / 8 * 8);
  }
  s.assign((t1 - t0) * a.G * stride, 0.0f);
  qs.clear();
  for (int64_t t = t0; t < t1; ++t) {
    const Slots sl = a.slots(t);
    for (int64_t g = 0; g < a.G; ++g) {
      const int64_t at = (t * a.H + h * a.G + g) * a.D;
      qs.push_back({a.q + at, a.o + at, s.data() + ((t - t0) * a.G + g) * stride, sl, 0.0f});
    }
  }
  group_scores(qs, shared, k, v, a.D, a.scale, kb.data());
  for (auto& x : qs) x.total = softmax16(x.s, x.sl.count());
  group_values(qs, shared, v, a.D);
}

template <typename T>
static void attend_groups_t(const RowArgs& a, const T* k, const T* v, int64_t T_rows) {
  std::vector<int64_t> first{0};  // group g: rows [first[g], first[g + 1])
  for (int64_t t = 1; t < T_rows; ++t)
    if (a.start[t] != a.start[t - 1] || t - first.back() == GROUP_ROWS) first.push_back(t);
  first.push_back(T_rows);
  const int64_t groups = static_cast<int64_t>(first.size()) - 1;
  at::parallel_for(0, groups * a.KV, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> s, kb(8 * a.D);
    std::vector<Query> qs;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / a.KV, h = i % a.KV;
      if (i + 1 < groups * a.KV) prefetch_first_keys(a, k, first[(i + 1) / a.KV], (i + 1) % a.KV);  // the next task's
      attend_group(a, k + h * a.ks, v + h * a.vs, first[g], first[g + 1], h, s, kb, qs);
    }
  });
}

bool attend_groups(const RowArgs& a, const float* k, const float* v, int64_t T_rows) {
  attend_groups_t(a, k, v, T_rows);
  return true;
}
bool attend_groups(const RowArgs& a, const uint16_t* k, const uint16_t* v, int64_t T_rows) {
  attend_groups_t(a, k, v, T_rows);
  return true;
}
#else
bool attend_groups(const specmesh_attn::RowArgs&, const float*, const float*, int64_t) { return false; }
bool attend_groups(const specmesh_attn::RowArgs&, const uint16_t*, const uint16_t*, int64_t) { return false; }
#endif
