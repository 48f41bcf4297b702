// What every matrix-vector op shares: the output for the rows of x, computed on torch's threads, and the
// gated form of the feed-forward (silu(x gate^T) * (x up^T)) built from any op's rows.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "isa.h"

namespace kvlab {

constexpr int64_t kGrain = 256;  // output rows per task: SmolLM2's smallest projection (576) still splits over 2 cores

// f(std::integral_constant<int, rows>()) for rows in [1, MB]: a pass's rows of x as a compile-time count.
template <int MB, typename F>
void with_rows(int64_t rows, F f) {
  if (rows == MB)
    f(std::integral_constant<int, MB>());
  else if constexpr (MB > 1)
    with_rows<MB - 1>(rows, f);
}

// x made contiguous and y [..., N] allocated for x [..., K] float32; M = the rows of x.
inline std::pair<at::Tensor, at::Tensor> operands(const char* op, const at::Tensor& x, int64_t N, int64_t K) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, " takes float32 x, got ", x.scalar_type());
  TORCH_CHECK(x.size(-1) == K, op, ": x has ", x.size(-1), " features, the weight ", K);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return {x.contiguous(), at::empty(shape, x.options())};
}

// Runs body(n0, n1) over [0, N) on torch's threads (at::parallel_for: OpenMP in torch's builds, so the library
// is compiled with -fopenmp), each thread one contiguous run of weight rows that starts at a multiple of `unit`
// (a tiled weight's rows per tile) and ends at one, or at N.
template <typename Body>
void parallel_rows(int64_t N, int64_t unit, Body body) {
  at::parallel_for(0, (N + unit - 1) / unit, std::max<int64_t>(kGrain / unit, 1),
                   [&](int64_t u0, int64_t u1) { body(u0 * unit, std::min(u1 * unit, N)); });
}

// y [..., N] for x [..., K]: rows(isa, x, y, M, n0, n1) fills output columns [n0, n1) for all M rows of x.
template <typename Rows>
at::Tensor matvec(const char* op, const at::Tensor& x, int64_t N, int64_t K, Rows rows, int64_t unit = 1) {
  auto [xc, y] = operands(op, x, N, K);
  const int64_t M = xc.numel() / K;
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const Isa isa = kernel_isa();
  parallel_rows(N, unit, [&](int64_t n0, int64_t n1) { rows(isa, xp, yp, M, n0, n1); });
  return y;
}

// y[n] *= silu(g[n]) = g[n] / (1 + e^-g[n]) for n in [n0, n1): 16 or 8 at a time (e^x from isa.h, within 2 ulp of
// std::exp), the rest in scalar.
__attribute__((target("avx512f"))) inline int64_t silu_times_avx512(const float* g, float* y, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 16 <= n1; n += 16) {
    const __m512 a = _mm512_loadu_ps(g + n), e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), a));
    _mm512_storeu_ps(y + n, _mm512_mul_ps(_mm512_loadu_ps(y + n), _mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.f), e))));
  }
  return n;
}

__attribute__((target("avx2,fma"))) inline int64_t silu_times_avx2(const float* g, float* y, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 8 <= n1; n += 8) {
    const __m256 a = _mm256_loadu_ps(g + n), e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), a));
    _mm256_storeu_ps(y + n, _mm256_mul_ps(_mm256_loadu_ps(y + n), _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.f), e))));
  }
  return n;
}

inline void silu_times(Isa isa, const float* g, float* y, int64_t n0, int64_t n1) {
  int64_t n = isa == Isa::avx512 ? silu_times_avx512(g, y, n0, n1) : isa == Isa::avx2 ? silu_times_avx2(g, y, n0, n1) : n0;
  for (; n < n1; ++n) y[n] *= g[n] / (1.f + std::exp(-g[n]));
}

// silu(x gate^T) * (x up^T) [..., N] in one call: each thread computes both products for its run of
// output rows, while they are in cache, and multiplies them (SwiGLU's gate and up projections).
template <typename GateRows, typename UpRows>
at::Tensor gated_matvec(const char* op, const at::Tensor& x, int64_t N, int64_t K, GateRows gate, UpRows up, int64_t unit = 1) {
  auto [xc, y] = operands(op, x, N, K);
  const int64_t M = xc.numel() / K;
  at::Tensor g = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *gp = g.data_ptr<float>();
  const Isa isa = kernel_isa();
  parallel_rows(N, unit, [&](int64_t n0, int64_t n1) {
    gate(isa, xp, gp, M, n0, n1);
    up(isa, xp, yp, M, n0, n1);
    for (int64_t m = 0; m < M; ++m) silu_times(isa, gp + m * N, yp + m * N, n0, n1);
  });
  return y;
}

}  // namespace kvlab
