// What every matrix-vector op shares: the output for the rows of x, computed on torch's threads.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "isa.h"

namespace kvlab {

// y [..., N] for x [..., K] float32 (made contiguous): rows(isa, x, y, M, n0, n1) fills output columns
// [n0, n1) for all M rows of x. Each thread takes one contiguous run of weight rows (at::parallel_for:
// OpenMP in torch's builds, so the library is compiled with -fopenmp).
template <typename Rows>
at::Tensor matvec(const char* op, const at::Tensor& x, int64_t N, int64_t K, Rows rows) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, " takes float32 x, got ", x.scalar_type());
  TORCH_CHECK(x.size(-1) == K, op, ": x has ", x.size(-1), " features, the weight ", K);
  at::Tensor xc = x.contiguous();
  const int64_t M = xc.numel() / K;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const Isa isa = kernel_isa();
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) { rows(isa, xp, yp, M, n0, n1); });
  return y;
}

}  // namespace kvlab
