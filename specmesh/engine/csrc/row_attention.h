// Shared by row_attention.cpp (AVX2: one (row, kv head) at a time) and row_attention_group.cpp
// (AVX-512: a sequence's rows together): the reductions, exp and softmax whose exact order makes a
// row's output a function of its own slots alone, the slot list, the call's arguments; and the
// exact bf16 -> float32 loads the other kernels use too.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace specmesh_attn {

inline float hsum(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// exp(x) lane-wise (Cephes expf: range reduction by ln 2 in two parts, a degree-5 polynomial,
// 2^n through the exponent bits); x is clamped below at -87, where exp is ~1.6e-38. The constants
// are shared with the AVX-512 path's exp16 (row_attention_group.cpp): the same bits need them.
constexpr float EXP_LO = -87.0f, EXP_LOG2E = 1.44269504088896341f, EXP_LN2_HI = 0.693359375f,
                EXP_LN2_LO = -2.12194440e-4f;
constexpr float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x));
  __m256 y = _mm256_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_POLY[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Eight consecutive values as float32: loaded, or widened from bf16 (its bits are float32's top half).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#ifdef __AVX512F__
// Sixteen consecutive values as float32, the same way (also packed_gemm.cpp's AVX-512 tiles and
// exact_row.cpp).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// How far ahead (in slots) the attention kernels prefetch the keys they are about to read. A step's
// K/V mostly comes from memory (16 sequences at 256 slots: 94 MB a step), each kv head's slots two
// short contiguous streams of a few KB that the hardware prefetcher alone starts late on and drops
// at page boundaries. So the keys go towards L1 PREFETCH_SLOTS ahead of the scores, the values
// towards L2 as the scores pass reads the same slots' keys (the values pass follows it), and the
// next kv head's first keys towards L2 while this one runs. Hints only: no value changes. Measured
// on a 2-core Zen 4 EPYC, one thread, 16 one-row sequences x 30 layers of SmolLM2's 9 x 3 x 64 from
// cold pools: 22.5 -> 18.1 us per (sequence, layer) at 256 slots, 14.1 -> 9.8 at 128 (8 and 32
// slots ahead, or the values only towards L1 as they are read, gained less).
constexpr int64_t PREFETCH_SLOTS = 16;

// Every cache line of [p, p + bytes) towards L1 (T0) or L2 (T1); p 64-byte aligned, as a pool row of
// bf16 or float32 head dims of 32s is (a row that started mid-line would leave its last line to the
// hardware prefetcher).
template <int Hint = _MM_HINT_T0>
__attribute__((always_inline)) inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, static_cast<_mm_hint>(Hint));
}

struct Slots {  // the slots one row sees, in order
  const int64_t start, len, *extra, n_extra;
  int64_t count() const { return len + n_extra; }
  int64_t operator[](int64_t j) const { return j < len ? start + j : extra[j - len]; }
};

// Slot rows [j0, min(j1, n)) of a [S, D] head towards L1 or L2 (columns [d0, d0 + w) of each).
template <int Hint = _MM_HINT_T0, typename T>
__attribute__((always_inline)) inline void prefetch_rows(const T* base, const Slots& sl, int64_t j0, int64_t j1, int64_t D,
                                                         int64_t d0, int64_t w) {
  const int64_t end = std::min(j1, sl.count());
  for (int64_t j = j0; j < end; ++j) prefetch_span<Hint>(base + sl[j] * D + d0, w * static_cast<int64_t>(sizeof(T)));
}

// hsum of eight vectors at once, lane i = hsum(r[i]) bitwise: the same additions in the same
// pairing ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)), eight dot products per shuffle.
inline __m256 hsum8(const __m256* r) {
  __m256 s[4];  // [s(r_i) | s(r_i+4)], s_k = v_k + v_k+4
  for (int i = 0; i < 4; ++i)
    s[i] = _mm256_add_ps(_mm256_permute2f128_ps(r[i], r[i + 4], 0x20), _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  // t_0 = s_0 + s_2, t_1 = s_1 + s_3 of rows (0, 1 | 4, 5) and (2, 3 | 6, 7)
  const __m256 t01 = _mm256_add_ps(_mm256_shuffle_ps(s[0], s[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 t23 = _mm256_add_ps(_mm256_shuffle_ps(s[2], s[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(s[2], s[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// In place: s[j .. j + 8) -> exp(s - m), lanes at or past n set to 0; returns them (softmax's step,
// shared with the AVX-512 path's last eight lanes).
inline __m256 weights8(float* s, int64_t j, int64_t n, __m256 mv) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - j)), lane));
  const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv)), live);
  _mm256_storeu_ps(s + j, p);
  return p;
}

// In place: s[0 .. n) -> exp(s - max s), lanes past n set to 0 (s holds a multiple of 8 floats);
// returns their sum (8 lanes in slot order, then one fixed reduction).
inline float softmax_weights(float* s, int64_t n) {
  // the max eight lanes at a time (a max is exact in any order; a zero's sign cannot matter below)
  __m256 m8 = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + i));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float m = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_shuffle_ps(m4, m4, 1)));
  for (; i < n; ++i) m = std::max(m, s[i]);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) sum = _mm256_add_ps(sum, weights8(s, j, n, mv));
  return hsum(sum);
}

struct RowArgs {  // one step's rows: float32 queries and output, slot lists, shapes
  const float* q;
  float* o;
  const int64_t *start, *len, *off, *extra;
  int64_t H, D, KV, G, ks, vs;
  float scale;

  Slots slots(int64_t t) const {  // the slots row t sees
    return {start[t], len[t], extra ? extra + off[t] : nullptr, off[t + 1] - off[t]};
  }
};

// The first keys row t sees in kv head h (k: the pool's heads, ks apart) towards L2: the next task's,
// while this one runs (the prefetch comment above).
template <typename T>
inline void prefetch_first_keys(const RowArgs& a, const T* k, int64_t t, int64_t h) {
  prefetch_rows<_MM_HINT_T1>(k + h * a.ks, a.slots(t), 0, 2 * PREFETCH_SLOTS, a.D, 0, a.D);
}

}  // namespace specmesh_attn
