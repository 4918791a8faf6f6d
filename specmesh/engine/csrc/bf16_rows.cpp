// y[M, N] = x[M, K] @ W^T (+ bias), bf16 in and out, float32 sums, for the 2..~32 rows of a
// batched decode or verify step on a CPU with AVX512-BF16 but no AMX.
//
// Why: there oneDNN's bf16 matmul streams a weight once for one row but runs several rows far
// below what the memory allows. Measured on a 2-core Intel Xeon (family 6 model 207, AMX not
// exposed, one thread), prepacked oneDNN calls, us: 1536x576 1 row 109, 5 rows 159, 9 rows 243;
// the 49152x576 LM head 2254 / 3312 / 5572. A one-token step reads each weight once (~17 GB/s);
// nine rows are ~40 MACs per weight byte, well inside one core's VDPBF16PS rate, so a kernel
// that reads the weight once for every row costs about what one row does.
//
// Layout: W is packed once into panel pairs wp[P][K/2][64] (pair p holds columns 32p .. 32p+31;
// at each k-pair j, column c's two weights W[c, 2j], W[c, 2j+1] side by side, as VDPBF16PS takes
// them), one contiguous stream. A tile keeps MR rows x 32 columns of float32 sums in registers
// (2 MR chains); rows past 12 go in balanced groups over the same pair, re-read from cache.
//
// Row-invariant by construction: every y[m, n] is one VDPBF16PS chain over k-pairs in order, from
// 0, then + bias, then one rounding to bf16, whatever M or the group a row falls in. It is not
// oneDNN's summation order, so its rows are not bitwise a one-row oneDNN call (the engine runs it
// in the default, batched mode only, never for a lone row: onednn.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

constexpr int MAX_MR = 12;
// The first row group prefetches its pair's stream 2 KB ahead into L1 and 8 KB ahead into L2: the
// VDPBF16PS chains of a few rows otherwise leave DRAM idle between loads. Measured on that Xeon,
// SmolLM2-135M's 121 decoder and head weights streamed once, one thread, ms for 1 / 5 / 9 rows:
// 1 KB ahead only 22.4 / 30.6 / 35.5, with the L2 prefetch 21.4 / 24.1 / 29.0 (oneDNN: 25.9 /
// 30.2 / 41.7; this VM reads +-10% from run to run). A k-pair's step reads two cache lines (128
// bytes), so each step prefetches both: one line a step left every other line to the hardware
// prefetcher, which falls behind once the sums keep the core busy. SmolLM2-135M's 210 decoder
// linears streamed from DRAM on a 2-core Zen 4 EPYC (family 25 model 17), ms for 1 / 5 / 9 / 16
// rows: one line a step 11.4-12.4 / 13.0-13.4 / 21.3-22.1 / 28.5-28.8, both lines 9.1-9.6 /
// 10.1-10.8 / 10.3-11.0 / 17.0-17.6 (two interleaved passes): nine rows now cost what one does.
constexpr int PREFETCH_BYTES = 2048;
constexpr int PREFETCH_FAR = 8192;
constexpr int LINE = 64;

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

inline void store_row(c10::BFloat16* y, const float* bias, __m512 a, int64_t col) {
  if (bias != nullptr) a = _mm512_add_ps(a, _mm512_loadu_ps(bias + col));
  __m256bh h = _mm512_cvtneps_pbh(a);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + col), reinterpret_cast<__m256i&>(h));
}

// MR rows x one panel pair (32 columns): x rows at stride K (bf16), pair at stride 64 per k-pair.
// The k-pairs run in chunks of kc (kc <= 0: one chunk): each chunk's chains start from 0 and are
// added in order to the float32 sums of the chunks before (the first chunk's taken as they are),
// as oneDNN's brgemm sums a one-row call in K blocks (kc = 256 pairs, K blocks of 512, on a Zen 4).
template <int MR>
void tile(const c10::BFloat16* x, int64_t K, const c10::BFloat16* pair, bool near, const float* bias,
          c10::BFloat16* y, int64_t N, int64_t col, int64_t kc) {
  __m512 s0[MR], s1[MR];  // [MR] x 32 columns: the sums of the chunks done
  const int64_t K2 = K / 2, step = kc > 0 ? kc : K2;
  for (int64_t j0 = 0; j0 < K2; j0 += step) {
    __m512 a0[MR], a1[MR];
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) a0[i] = a1[i] = _mm512_setzero_ps();
    const int64_t j1 = std::min(K2, j0 + step);
    for (int64_t j = j0; j < j1; ++j) {
      const c10::BFloat16* w = pair + j * 64;
      if (near) {
        const char* b = reinterpret_cast<const char*>(w);  // the step's two lines, each ahead
        _mm_prefetch(b + PREFETCH_BYTES, _MM_HINT_T0);
        _mm_prefetch(b + PREFETCH_BYTES + LINE, _MM_HINT_T0);
        _mm_prefetch(b + PREFETCH_FAR, _MM_HINT_T1);
        _mm_prefetch(b + PREFETCH_FAR + LINE, _MM_HINT_T1);
      }
      const __m512bh w0 = as_bh(_mm512_loadu_si512(w)), w1 = as_bh(_mm512_loadu_si512(w + 32));
#pragma GCC unroll 12
      for (int i = 0; i < MR; ++i) {
        const __m512bh u = as_bh(_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + i * K + 2 * j)));
        a0[i] = _mm512_dpbf16_ps(a0[i], u, w0);
        a1[i] = _mm512_dpbf16_ps(a1[i], u, w1);
      }
    }
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      s0[i] = j0 == 0 ? a0[i] : _mm512_add_ps(s0[i], a0[i]);
      s1[i] = j0 == 0 ? a1[i] : _mm512_add_ps(s1[i], a1[i]);
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
    store_row(y + i * N, bias, s0[i], col);
    store_row(y + i * N, bias, s1[i], col + 16);
  }
}

using TileFn = void (*)(const c10::BFloat16*, int64_t, const c10::BFloat16*, bool, const float*, c10::BFloat16*,
                        int64_t, int64_t, int64_t);

template <int... I>
constexpr std::array<TileFn, sizeof...(I)> tiles(std::integer_sequence<int, I...>) {
  return {&tile<I + 1>...};
}

void pair_rows(const c10::BFloat16* x, int64_t M, int64_t K, const c10::BFloat16* wp, int64_t p, const float* bias,
               c10::BFloat16* y, int64_t N, int64_t kc) {
  static const auto table = tiles(std::make_integer_sequence<int, MAX_MR>{});
  const int64_t groups = (M + MAX_MR - 1) / MAX_MR;
  const c10::BFloat16* pair = wp + p * (K / 2) * 64;
  for (int64_t g = 0, m = 0; g < groups; ++g) {
    const int64_t rows = M / groups + (g < M % groups ? 1 : 0);
    table[rows - 1](x + m * K, K, pair, g == 0, bias, y + m * N, N, p * 32, kc);
    m += rows;
  }
}

#endif

}  // namespace

bool bf16_rows_built() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

// w: [N, K] bf16, N % 32 == 0, K % 2 == 0 -> [N / 32, K / 2, 64]: pair p, k-pair j, column c's
// two weights at 2c, 2c + 1.
torch::Tensor bf16_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(), "bf16_pack: a 2-D bf16 CPU weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 32 == 0 && K % 2 == 0, "bf16_pack: N must be a multiple of 32 and K even");
  // [N, K] -> [P, 32, K2, 2] -> [P, K2, 32, 2]
  return w.contiguous().view({N / 32, 32, K / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({N / 32, K / 2, 64});
}

// x: [M, K] bf16; wp: bf16_pack(W); bias: [N] float32 / bf16 or None; kc: k-pairs per chunk (tile)
// -> [M, N] bf16.
torch::Tensor bf16_rows(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias, int64_t kc) {
  TORCH_CHECK(bf16_rows_built(), "bf16_rows: built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16 && wp.dim() == 3 &&
                  wp.size(2) == 64 && x.size(1) == 2 * wp.size(1) && x.device().is_cpu() && wp.device().is_cpu(),
              "bf16_rows: shapes or dtypes do not match");
  const int64_t M = x.size(0), K = x.size(1), P = wp.size(0), N = P * 32;
  auto xc = x.contiguous();
  auto y = torch::empty({M, N}, xc.options());
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) bc = bias->to(at::kFloat).contiguous();
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
  const c10::BFloat16* pp = wp.data_ptr<c10::BFloat16>();
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  if (M > 0) {
    at::parallel_for(0, P, 8, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) pair_rows(xp, M, K, pp, p, bp, yp, N, kc);
    });
  }
#endif
  return y;
}
