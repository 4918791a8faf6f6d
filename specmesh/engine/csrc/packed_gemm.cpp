// y[M, N] = x[M, K] @ W^T (+ bias), float32, for the few rows of a decode or verify step.
//
// W is packed once into panels wp[P][K][16] (panel p holds columns 16p .. 16p+15, zero-padded), so
// every panel streams contiguously while rows of x are broadcast against it. Tiles keep every
// accumulator in registers: 1-2 rows x 32 columns (two panels side by side), or 3-6 rows x 16
// columns, i.e. 4-12 independent FMA chains, enough to keep both FMA ports busy.
//
// Why: on CPUs where the BLAS runs small-M float32 GEMMs far below peak (an AMD EPYC with MKL:
// M=5 costs ~3x M=1 at K=576), a verify round of k+1 positions costs several one-token steps.
//
// bf16 panels: a weight whose every value is a bf16 (a bf16 checkpoint loaded as
// float32) is packed in bf16, half the bytes a step streams. The tiles widen each panel row as they
// load it (exact: a bf16 is the top half of its float32), so every product and sum, and every
// output bit, is the float32 panels'.
//
// Row-invariant by construction: every y[m, n] is one FMA chain over k = 0..K-1 in order, from 0,
// then + bias, whatever M, the tile it falls in or the thread count. A batched call over M rows is
// therefore bitwise the M one-row calls, and deterministic verification costs nothing extra.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

#include "row_attention.h"

namespace {

// Each k step reads one 64-byte line of a panel; the packed weight is one contiguous stream (panel
// p + 1 follows panel p). A software prefetch 16 lines ahead keeps DRAM reads in flight while the
// FMAs of a multi-row tile run, where the hardware prefetcher alone stalls at page boundaries:
// measured on a 2-core Xeon (AVX-512, ~13 GB/s), a 5-row pass over SmolLM2's 540 MB of linears
// took 56 ms without it and 49 ms with it (1 row: 42 ms either way). Prefetches past the end of
// the weight are harmless (they never fault). Arithmetic is unchanged: still row-invariant.
constexpr int PREFETCH_BYTES = 1024;

inline void store(float* y, const float* bias, __m256 a0, __m256 a1, int nc) {
  alignas(32) float t[16];
  _mm256_store_ps(t, a0);
  _mm256_store_ps(t + 8, a1);
  for (int j = 0; j < nc; ++j) y[j] = bias ? t[j] + bias[j] : t[j];
}

// Where a step's prefetches go. `near` (the first row group of a panel pair): PREFETCH_BYTES ahead
// in the panel being read, into L1. `far` (steps with more rows than
// one tile): the next panel pair, into L2, spread over every row group's k steps in proportion
// (`rate`: lines per step in 16.16 fixed point from global step `s0`), so DRAM keeps streaming
// while the later row groups re-read this pair from cache.
struct Prefetch {
  bool near;
  const char* far;  // nullptr: none
  int64_t s0, rate;
  inline void at(const void* panel_k, int64_t k) const {
    if (near) _mm_prefetch(static_cast<const char*>(panel_k) + PREFETCH_BYTES, _MM_HINT_T0);
    if (far != nullptr) _mm_prefetch(far + (((s0 + k) * rate) >> 16) * 64, _MM_HINT_T1);
  }
  Prefetch then(int64_t steps) const { return {near, far, s0 + steps, rate}; }
};

// One panel row's 16 columns (c0-7, c8-15). float32 panels hold them in order; bf16 panels as c0-3
// c8-11 c4-7 c12-15 (pack's NARROW_ORDER), so interleaving them with zeros in each 128-bit lane puts
// c0-7 and c8-15 in order, every bf16 the top half of its float32: two shuffles, no shifts.
inline void load16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
inline void load16(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), z = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, h));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, h));
}

// MR rows x one 16-column panel (W: float, or uint16_t for bf16 panels).
template <int MR, typename W>
void tile16(const float* x, int64_t K, const W* panel, const Prefetch& pf, const float* bias, float* y, int64_t N,
            int nc) {
  __m256 acc0[MR], acc1[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    pf.at(panel + k * 16, k);
    __m256 w0, w1;
    load16(panel + k * 16, w0, w1);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 u = _mm256_broadcast_ss(x + i * K + k);
      acc0[i] = _mm256_fmadd_ps(u, w0, acc0[i]);
      acc1[i] = _mm256_fmadd_ps(u, w1, acc1[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) store(y + i * N, bias, acc0[i], acc1[i], nc);
}

// MR (1 or 2) rows x two panels side by side: 4 * MR chains.
template <int MR, typename W>
void tile32(const float* x, int64_t K, const W* pa, const W* pb, const Prefetch& pf, const float* bias,
            float* y, int64_t N, int ncb) {
  __m256 a0[MR], a1[MR], b0[MR], b1[MR];
#pragma GCC unroll 2
  for (int i = 0; i < MR; ++i) a0[i] = a1[i] = b0[i] = b1[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    pf.at(pa + k * 16, k);
    if (pf.near) _mm_prefetch(reinterpret_cast<const char*>(pb + k * 16) + PREFETCH_BYTES, _MM_HINT_T0);
    __m256 w0, w1, w2, w3;
    load16(pa + k * 16, w0, w1);
    load16(pb + k * 16, w2, w3);
#pragma GCC unroll 2
    for (int i = 0; i < MR; ++i) {
      const __m256 u = _mm256_broadcast_ss(x + i * K + k);
      a0[i] = _mm256_fmadd_ps(u, w0, a0[i]);
      a1[i] = _mm256_fmadd_ps(u, w1, a1[i]);
      b0[i] = _mm256_fmadd_ps(u, w2, b0[i]);
      b1[i] = _mm256_fmadd_ps(u, w3, b1[i]);
    }
  }
#pragma GCC unroll 2
  for (int i = 0; i < MR; ++i) {
    store(y + i * N, bias, a0[i], a1[i], 16);
    store(y + i * N + 16, bias ? bias + 16 : nullptr, b0[i], b1[i], ncb);
  }
}

// Panel p and (when `pair`) p + 1 of a packed weight, i.e. output columns n0 .. n0 + 31: where
// they start, how many of their 16 columns are real, and their bias.
template <typename W>
struct PanelPair {
  int64_t n0;
  const W* pa;
  const W* pb;  // nullptr without a pair
  int nca, ncb;
  const float* ba;
  const float* bb;
  PanelPair(const W* wp, int64_t p, bool pair, int64_t K, int64_t N, const float* bias)
      : n0(p * 16),
        pa(wp + p * K * 16),
        pb(pair ? pa + K * 16 : nullptr),
        nca(static_cast<int>(std::min<int64_t>(16, N - n0))),
        ncb(pair ? static_cast<int>(std::min<int64_t>(16, N - n0 - 16)) : 0),
        ba(bias ? bias + n0 : nullptr),
        bb(bias ? bias + n0 + 16 : nullptr) {}
};

#ifdef __AVX512F__
// AVX-512 (built where the CPU has it): one zmm holds a whole 16-column panel row, so MR rows x two
// panels need 2 * MR accumulators; up to 12 rows per tile (24 of the 32 registers) halves the FMA
// count of the AVX2 tiles where a step is compute-bound (a batch of sequences, a tree). Every
// y[m, n] is still one FMA chain over k in order from 0: bitwise the AVX2 tiles' result.
inline void store512(float* y, const float* bias, __m512 a, int nc) {
  alignas(64) float t[16];
  _mm512_store_ps(t, a);
  for (int j = 0; j < nc; ++j) y[j] = bias ? t[j] + bias[j] : t[j];
}

// One panel row's 16 columns (specmesh_attn::load16): float32 panels in order; bf16 panels in order
// too in this build (NARROW_ORDER is the identity here), each widened to its float32 exactly.
using specmesh_attn::load16;

template <int MR, typename W>
void tile512(const float* x, int64_t K, const W* pa, const W* pb, const float* bias, float* y, int64_t N, int nca,
             int ncb) {
  __m512 a[MR], b[MR];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) a[i] = b[i] = _mm512_setzero_ps();
  if (pb != nullptr) {
    for (int64_t k = 0; k < K; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(pa + k * 16) + PREFETCH_BYTES, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pb + k * 16) + PREFETCH_BYTES, _MM_HINT_T0);
      const __m512 wa = load16(pa + k * 16), wb = load16(pb + k * 16);
#pragma GCC unroll 12
      for (int i = 0; i < MR; ++i) {
        const __m512 u = _mm512_set1_ps(x[i * K + k]);
        a[i] = _mm512_fmadd_ps(u, wa, a[i]);
        b[i] = _mm512_fmadd_ps(u, wb, b[i]);
      }
    }
  } else {
    for (int64_t k = 0; k < K; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(pa + k * 16) + PREFETCH_BYTES, _MM_HINT_T0);
      const __m512 wa = load16(pa + k * 16);
#pragma GCC unroll 12
      for (int i = 0; i < MR; ++i) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * K + k]), wa, a[i]);
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
    store512(y + i * N, bias, a[i], nca);
    if (pb != nullptr) store512(y + i * N + 16, bias ? bias + 16 : nullptr, b[i], ncb);
  }
}

template <typename W>
using Tile512 = void (*)(const float*, int64_t, const W*, const W*, const float*, float*, int64_t, int, int);
constexpr int MR512 = 12;
template <typename W>
const Tile512<W> TILES512[MR512 + 1] = {nullptr,           tile512<1, W>,  tile512<2, W>,  tile512<3, W>, tile512<4, W>,
                                        tile512<5, W>,     tile512<6, W>,  tile512<7, W>,  tile512<8, W>, tile512<9, W>,
                                        tile512<10, W>,    tile512<11, W>, tile512<12, W>};

// bf16 panels (where a weight is exactly bf16) hold a panel row's columns in order here
constexpr int64_t NARROW_ORDER[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

template <typename W>
void panel_rows(const float* x, int64_t M, int64_t K, const W* wp, int64_t p, bool pair, const float* bias,
                float* y, int64_t N) {
  const PanelPair<W> g(wp, p, pair, K, N, bias);
  for (int64_t m = 0; m < M; m += MR512) {
    const int rows = static_cast<int>(std::min<int64_t>(MR512, M - m));
    TILES512<W>[rows](x + m * K, K, g.pa, g.pb, g.ba, y + m * N + g.n0, N, g.nca, g.ncb);
  }
}
#else
// bf16 panels (where a weight is exactly bf16): a panel row's columns as load16 reads them
constexpr int64_t NARROW_ORDER[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};  // load16's

// k steps one row group of `rows` takes over a pair (two 16-column passes, or one 32-column one).
inline int64_t group_steps(int64_t rows, bool pair, int64_t K) { return (pair && rows > 2) ? 2 * K : K; }

// One row group against the pair: tiles of 3-6 rows per panel, 1-2 rows across both panels.
template <typename W>
void group(const float* xr, int64_t rows, int64_t K, const PanelPair<W>& g, bool pair, const Prefetch& pf, float* yr,
           int64_t N) {
  const int64_t n0 = g.n0;
  auto halves = [&](auto tile) {
    tile(xr, K, g.pa, pf, g.ba, yr + n0, N, g.nca);
    if (pair) tile(xr, K, g.pb, pf.then(K), g.bb, yr + n0 + 16, N, g.ncb);
  };
  switch (rows) {
    case 6: halves(tile16<6, W>); break;
    case 5: halves(tile16<5, W>); break;
    case 4: halves(tile16<4, W>); break;
    case 3: halves(tile16<3, W>); break;
    case 2: if (pair) tile32<2>(xr, K, g.pa, g.pb, pf, g.ba, yr + n0, N, g.ncb); else halves(tile16<2, W>); break;
    case 1: if (pair) tile32<1>(xr, K, g.pa, g.pb, pf, g.ba, yr + n0, N, g.ncb); else halves(tile16<1, W>); break;
    default: break;
  }
}

// Rows [0, M) of x against panels p and (when `pair`) p + 1, i.e. columns n0 .. n0 + 31, in
// ceil(M / 6) row groups of as equal a size as can be (9 rows: 5 + 4, not 6 + 3; never a lone row,
// whose 4 FMA chains wait on the FMA latency). The first group reads the pair from DRAM (near
// prefetch); with more than one group, every group also prefetches its share of the next pair, so
// the later groups' passes over this pair (from cache) overlap the DRAM stream instead of idling it.
// Measured on a 2-core Zen 3 EPYC, 40 weights of 576 x 1536 streamed from DRAM, one thread, us per
// call before -> after: 9 rows 263 -> 225, 12 rows 297 -> 247, 17 rows 382 -> 349 (bitwise the same).
template <typename W>
void panel_rows(const float* x, int64_t M, int64_t K, const W* wp, int64_t p, bool pair, const float* bias,
                float* y, int64_t N) {
  const PanelPair<W> g(wp, p, pair, K, N, bias);
  const int64_t groups = (M + 5) / 6;
  auto rows_of = [&](int64_t i) { return M / groups + (i < M % groups ? 1 : 0); };
  int64_t total = 0;
  for (int64_t i = 0; i < groups; ++i) total += group_steps(rows_of(i), pair, K);
  const int64_t lines = 2 * K * static_cast<int64_t>(sizeof(W)) / 4;  // the next pair's 64-byte lines
  // (past the end of the weight: never faults)
  const char* far = groups > 1 ? reinterpret_cast<const char*>(g.pa + 2 * K * 16) : nullptr;
  const int64_t rate = (lines << 16) / total;
  for (int64_t i = 0, m = 0, s = 0; i < groups; ++i) {
    const int64_t rows = rows_of(i);
    group(x + m * K, rows, K, g, pair, Prefetch{i == 0, far, s, rate}, y + m * N, N);
    m += rows;
    s += group_steps(rows, pair, K);
  }
}

#endif  // __AVX512F__

}  // namespace

// w: [N, K] float32 -> [P, K, 16], P = ceil(N / 16), zero-padded: float32, or bf16 in NARROW_ORDER
// where `narrow` and every value of w is a bf16 (so exactly w).
torch::Tensor pack(torch::Tensor w, bool narrow) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(), "pack: a 2-D float32 CPU weight");
  const int64_t N = w.size(0), K = w.size(1), P = (N + 15) / 16;
  auto padded = torch::zeros({P * 16, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  auto wp = padded.view({P, 16, K}).transpose(1, 2).contiguous();
  if (!narrow || !torch::equal(wp.to(at::kBFloat16).to(at::kFloat), wp)) return wp;
  const auto order = torch::tensor(std::vector<int64_t>(NARROW_ORDER, NARROW_ORDER + 16), torch::kLong);
  return wp.index_select(2, order).to(at::kBFloat16);
}

// x: [..., K] float32; wp: pack(W); bias: [N] or None -> [..., N].
torch::Tensor linear(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias, int64_t N) {
  const bool half = wp.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.scalar_type() == at::kFloat && (wp.scalar_type() == at::kFloat || half),
              "packed linear: float32 rows and pack()'s panels");
  TORCH_CHECK(x.device().is_cpu() && wp.device().is_cpu(), "packed linear: CPU tensors only");
  const int64_t P = wp.size(0), K = wp.size(1);
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == 16 && x.size(-1) == K && N <= P * 16 && N > (P - 1) * 16,
              "packed linear: shapes do not match");
  auto x2 = x.reshape({-1, K}).contiguous();
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) bc = bias->contiguous();
  const int64_t M = x2.size(0);
  auto y = torch::empty({M, N}, x2.options());
  const float* xp = x2.data_ptr<float>();
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t pairs = (P + 1) / 2;
  auto run = [&](const auto* pp) {
    at::parallel_for(0, pairs, 4, [&](int64_t q0, int64_t q1) {
      for (int64_t q = q0; q < q1; ++q) panel_rows(xp, M, K, pp, 2 * q, 2 * q + 1 < P, bp, yp, N);
    });
  };
  if (half) {
    run(reinterpret_cast<const uint16_t*>(wp.data_ptr<at::BFloat16>()));
  } else {
    run(wp.data_ptr<float>());
  }
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

// row_attention.cpp
torch::Tensor row_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor start,
                            torch::Tensor len, torch::Tensor off, torch::Tensor extra, double scale, bool grouped);
// sdpa_rows.cpp
void sdpa_rows(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t length, torch::Tensor path,
               torch::Tensor off, c10::optional<double> scale, int64_t one, int64_t width, torch::Tensor out);

// lean_layer.cpp
std::vector<at::Tensor> lean_pre(const at::Tensor& x, const at::Tensor& norm_w, double eps, const at::Tensor& wp,
                                 const std::optional<at::Tensor>& b, int64_t step, int64_t floor, const at::Tensor& cos,
                                 const at::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t d, int64_t kc);
at::Tensor lean_post(const at::Tensor& x, const at::Tensor& o, const at::Tensor& wp_o, const std::optional<at::Tensor>& b_o,
                     int64_t step_o, int64_t floor_o, const at::Tensor& norm_w, double eps, const at::Tensor& wp_gu,
                     const std::optional<at::Tensor>& b_gu, int64_t step_gu, int64_t floor_gu, int64_t inter,
                     const at::Tensor& wp_d, const std::optional<at::Tensor>& b_d, int64_t step_d, int64_t floor_d,
                     int64_t kc);
at::Tensor pool_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pk,
                       const at::Tensor& pv, const std::vector<int64_t>& geo, const std::vector<std::optional<at::Tensor>>& masks,
                       const std::vector<at::Tensor>& paths, const std::vector<at::Tensor>& offs, std::optional<double> scale,
                       int64_t one, int64_t width);

// exact_row.cpp
bool exact_row_built();
torch::Tensor exact_row(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<double> scale,
                        c10::optional<torch::Tensor> lse);

// bf16_rows.cpp
bool bf16_rows_built();
torch::Tensor bf16_pack(torch::Tensor w);
torch::Tensor bf16_rows(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias, int64_t kc);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "pack a [N, K] float32 weight into [ceil(N/16), K, 16] panels (bf16 where narrow and exact)",
        pybind11::arg("w"), pybind11::arg("narrow") = true);
  m.def("linear", &linear, "y = x @ W^T + bias from packed panels, float32, row-invariant (AVX2/FMA)");
  m.def("row_attention", &row_attention, "each query row's attention alone over its own pool slots, float32 or bf16",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("start"), pybind11::arg("len"),
        pybind11::arg("off"), pybind11::arg("extra"), pybind11::arg("scale"), pybind11::arg("grouped") = true);
  m.def("sdpa_rows", &sdpa_rows, "a sequence's rows as one-token steps on torch SDPA, each bitwise its own call (deterministic mode)");
  m.def("lean_pre", &lean_pre, "lean_hf's layer up to attention: norm, stacked q/k/v, RoPE (prepacked bf16 linears)");
  m.def("pool_attend", &pool_attend, "kv._attend's SDPA sequences in one call: KV written in place, HF's SDPA calls");
  m.def("exact_row_built", &exact_row_built, "whether exact_row was built (AVX-512 F/BW/VL/DQ)");
  m.def("exact_row", &exact_row, "one bf16 query row's attention in torch's CPU SDPA order, bit for bit where probed");
  m.def("bf16_rows_built", &bf16_rows_built, "whether bf16_rows was built with AVX512-BF16");
  m.def("bf16_pack", &bf16_pack, "pack a [N, K] bf16 weight into [N/32, K/2, 64] panel pairs (k-pairs interleaved)");
  m.def("bf16_rows", &bf16_rows, "y = x @ W^T + bias, bf16, float32 sums in chunks of kc k-pairs, row-invariant (AVX512-BF16)",
        pybind11::arg("x"), pybind11::arg("wp"), pybind11::arg("bias"), pybind11::arg("kc") = 0);
  m.def("lean_post", &lean_post, "lean_hf's layer after attention: o_proj, residual, norm, gate/up, SiLU, down, residual");
}
