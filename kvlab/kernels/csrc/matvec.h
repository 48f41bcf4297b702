// What every matrix-vector op shares: the output for the rows of x, computed on torch's threads, and the
// gated form of the feed-forward (silu(x gate^T) * (x up^T)) built from any op's rows.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "isa.h"

namespace kvlab {

constexpr int64_t kGrain = 256;  // output rows per task: SmolLM2's smallest projection (576) still splits over 2 cores

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
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) {
        const float a = gp[m * N + n];
        yp[m * N + n] *= a / (1.f + std::exp(-a));
      }
  });
  return y;
}

}  // namespace kvlab
