// Float products for many rows of x (a prompt's or a chunk's): y[m, n] = sum_k x[m, k] * w[n, k] for a weight stored
// row-major [N, K] (float32, or bfloat16 widened as it is packed), in float32.
//
// A matrix-vector kernel (gemv_fp32.cpp) reads each weight row once per few rows of x: right for a decode step, but a
// prompt's rows would re-read the weight from cache for every four of them, at one load per multiply-add. Here each
// thread copies 32 weight rows at a time into a panel, k-major ([K, 32]: the copy is made per call, in cache, so no
// second copy of the weight is kept), then runs a register-blocked micro-kernel over it: for each k, the panel's 32
// values (two AVX-512 vectors) times x[m, k] broadcast for 14 rows of x, 28 accumulators (AVX2: 16 values, 6 rows, 12
// accumulators, each half of the panel in turn). Each FMA then needs a load of a quarter of a vector or less, and the
// sums run at the FMA units' rate: 170-195 GFLOP/s on SmolLM2's shapes on 2 Zen 4 cores, where torch's MKL product
// reaches 140-180 (docs/results/prefill.md). Each output is one sum over k in order, as the scalar reference takes it,
// whatever the rows around it: a row of a batch gets what it gets alone.
#pragma once
#include <cstring>
#include <vector>

#include "matvec.h"

namespace kvlab {

constexpr int64_t kPanel = 32;     // weight rows per panel: two AVX-512 vectors of float32
constexpr int64_t kGemmRows = 9;  // rows of x past a decode step's (kvlab.kernels.MAX_ROWS): a prompt's or a chunk's

// Eight weight rows from `src` (row stride K), k in [0, 8), transposed into the panel's columns from `dst`: each
// of the eight stores holds one k's values of the eight rows (three shuffle stages, no scalar stores).
template <typename W>
__attribute__((target("avx2,fma,f16c"))) void transpose8(const W* src, int64_t K, float* dst) {
  __m256 r[8], t[8], s[8];
  for (int i = 0; i < 8; ++i) r[i] = load8(src + i * K);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(dst + c * kPanel, _mm256_permute2f128_ps(s[c], s[c + 4], 0x20));
    _mm256_storeu_ps(dst + (c + 4) * kPanel, _mm256_permute2f128_ps(s[c], s[c + 4], 0x31));
  }
}

// Weight rows [n0, n0 + 32) as a panel [K, 32], rows past N zero: a whole panel eight rows by eight k at a time,
// the rest value by value. A decode batch of 9 or more rows packs every weight once per step, so the copy's speed
// is the product's.
template <typename W>
void pack_panel(const W* w, int64_t N, int64_t K, int64_t n0, float* panel) {
  const int64_t rows = std::min(kPanel, N - n0);
  if (rows < kPanel) std::memset(panel, 0, K * kPanel * sizeof(float));
  int64_t k0 = 0;
  if (rows == kPanel) {
    for (; k0 + 8 <= K; k0 += 8)
      for (int64_t j = 0; j < kPanel; j += 8) transpose8(w + (n0 + j) * K + k0, K, panel + k0 * kPanel + j);
  }
  for (int64_t j = 0; j < rows; ++j) {
    const W* src = w + (n0 + j) * K;
    for (int64_t k = k0; k < K; ++k) panel[k * kPanel + j] = static_cast<float>(src[k]);
  }
}

// MR rows of x (from x, row stride K) against a panel: y's 32 columns from n (`cols` of them real) for those rows.
template <int MR>
__attribute__((target("avx512f"))) void panel_avx512(const float* x, int64_t K, const float* panel, float* y, int64_t N, int64_t cols) {
  __m512 acc[MR][2];  // in registers only if every loop over the rows is unrolled (KVLAB_ROWS_UNROLLED)
  KVLAB_ROWS_UNROLLED
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 b0 = _mm512_loadu_ps(panel + k * kPanel), b1 = _mm512_loadu_ps(panel + k * kPanel + 16);
    KVLAB_ROWS_UNROLLED
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(x[i * K + k]);
      acc[i][0] = _mm512_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(a, b1, acc[i][1]);
    }
  }
  const __mmask16 low = cols >= 16 ? 0xFFFF : (1u << cols) - 1, high = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1;
  KVLAB_ROWS_UNROLLED
  for (int i = 0; i < MR; ++i) {
    _mm512_mask_storeu_ps(y + i * N, low, acc[i][0]);
    _mm512_mask_storeu_ps(y + i * N + 16, high, acc[i][1]);
  }
}

// The AVX2 twin, for one half of the panel (16 columns from `half`): 16 registers hold 6 rows' sums.
template <int MR>
__attribute__((target("avx2,fma"))) void panel_avx2(const float* x, int64_t K, const float* panel, int64_t half, float* y, int64_t N, int64_t cols) {
  __m256 acc[MR][2];
  KVLAB_ROWS_UNROLLED
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * kPanel + half), b1 = _mm256_loadu_ps(panel + k * kPanel + half + 8);
    KVLAB_ROWS_UNROLLED
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + i * K + k);
      acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
    }
  }
  const int64_t real = cols - half;
  const __m256i low = first_lanes8(real), high = first_lanes8(real - 8);
  KVLAB_ROWS_UNROLLED
  for (int i = 0; i < MR; ++i) {
    _mm256_maskstore_ps(y + i * N + half, low, acc[i][0]);
    _mm256_maskstore_ps(y + i * N + half + 8, high, acc[i][1]);
  }
}

// Output columns [n0, n1) for the M rows of x, panel by panel (pack(n, panel) fills the panel of weight rows from n;
// this thread's panel buffer is reused across calls), in passes of equal rows (16 rows: two of 8, not 14 and 2), up
// to 14 (AVX2: 6).
template <typename Pack>
void gemm_panels(bool avx512, const float* x, Pack pack, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  static thread_local std::vector<float> panel;
  panel.resize(K * kPanel);
  const int64_t most = avx512 ? 14 : 6, passes = (M + most - 1) / most, pass = (M + passes - 1) / passes;
  for (int64_t n = n0; n < n1; n += kPanel) {
    pack(n, panel.data());
    const int64_t cols = std::min(kPanel, n1 - n);
    for (int64_t m = 0; m < M;) {
      const int64_t rows = std::min<int64_t>(M - m, pass);
      const float* xm = x + m * K;
      float* ym = y + m * N + n;
      if (avx512)
        with_rows<14>(rows, [&](auto mr) { panel_avx512<decltype(mr)::value>(xm, K, panel.data(), ym, N, cols); });
      else
        for (int64_t half = 0; half < cols; half += 16)
          with_rows<6>(rows, [&](auto mr) { panel_avx2<decltype(mr)::value>(xm, K, panel.data(), half, ym, N, cols); });
      m += rows;
    }
  }
}

// The same for a weight stored row-major [N, K] in W (float32, or bfloat16).
template <typename W>
void gemm_rows(bool avx512, const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  gemm_panels(avx512, x, [w, N, K](int64_t n, float* panel) { pack_panel(w, N, K, n, panel); }, y, M, N, K, n0, n1);
}

}  // namespace kvlab
