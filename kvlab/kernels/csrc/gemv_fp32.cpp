// Matrix-vector products for decode: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a few rows m of x
// (batch 1 to 8) and a float32 or bfloat16 weight stored row-major [N, K], the layout torch's Linear has.
// A bfloat16 weight is widened to float32 as it streams (half the bytes of float32); x and the sums are
// float32 on every path, and a bfloat16 op rounds its output to bfloat16 once, at the end.
//
// A decode step reads every weight once per token, so the product is bound by memory bandwidth: the
// kernel reads the weight rows straight through, once each, and multiplies each row with up to four rows
// of x per pass (further rows of x re-read it from L1). Output rows are split over torch's threads (matvec.h).
//
// Three paths compute the same sums: a scalar reference, AVX2/FMA and AVX-512F, picked at run time (isa.h). From
// kGemmRows rows of x (a prompt's) the SIMD paths run gemm.h's panel product instead.
#include <torch/library.h>

#include "gemm.h"
#include "matvec.h"

namespace kvlab {

// Rows [n0, n1) of y = x w^T for the M rows of x: the reference every SIMD path is tested against.
template <typename W>
static void gemv_rows_scalar(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += x[m * K + k] * static_cast<float>(w[n * K + k]);
      y[m * N + n] = acc;
    }
}

// One weight row against MB rows of x, U independent accumulators per row of x (8 lanes each); the
// K % 8 tail in scalar. Reading the weight row straight through, L2 fetching ahead of it (prefetch_ahead),
// is what keeps the stream at bandwidth.
template <int MB, int U, typename W>
__attribute__((target("avx2,fma,f16c"))) static void dot_row_avx2(const float* x, const W* wr, float* y, int64_t N, int64_t K, int64_t n, int64_t m) {
  __m256 acc[MB][U];
  for (int b = 0; b < MB; ++b)
    for (int u = 0; u < U; ++u) acc[b][u] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * U <= K; k += 8 * U) {
    prefetch_ahead(wr + k, 8 * U * sizeof(W));
    for (int u = 0; u < U; ++u) {
      __m256 wv = load8(wr + k + 8 * u);
      for (int b = 0; b < MB; ++b) acc[b][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (m + b) * K + k + 8 * u), acc[b][u]);
    }
  }
  for (; k + 8 <= K; k += 8) {
    __m256 wv = load8(wr + k);
    for (int b = 0; b < MB; ++b) acc[b][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (m + b) * K + k), acc[b][0]);
  }
  for (int b = 0; b < MB; ++b) {
    for (int u = 1; u < U; ++u) acc[b][0] = _mm256_add_ps(acc[b][0], acc[b][u]);
    float s = hsum256(acc[b][0]);
    for (int64_t t = k; t < K; ++t) s += x[(m + b) * K + t] * static_cast<float>(wr[t]);
    y[(m + b) * N + n] = s;
  }
}

// Rows of x four at a time (two accumulators each: eight registers), a single row with four.
template <typename W>
__attribute__((target("avx2,fma,f16c"))) static void gemv_rows_avx2(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * K;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) dot_row_avx2<4, 2>(x, wr, y, N, K, n, m);
    if (M - m == 3) dot_row_avx2<3, 2>(x, wr, y, N, K, n, m);
    if (M - m == 2) dot_row_avx2<2, 2>(x, wr, y, N, K, n, m);
    if (M - m == 1) dot_row_avx2<1, 4>(x, wr, y, N, K, n, m);
  }
}

// The AVX-512 twin: 16 lanes per register.
template <int MB, int U, typename W>
__attribute__((target("avx512f"))) static void dot_row_avx512(const float* x, const W* wr, float* y, int64_t N, int64_t K, int64_t n, int64_t m) {
  __m512 acc[MB][U];
  for (int b = 0; b < MB; ++b)
    for (int u = 0; u < U; ++u) acc[b][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 * U <= K; k += 16 * U) {
    prefetch_ahead(wr + k, 16 * U * sizeof(W));
    for (int u = 0; u < U; ++u) {
      __m512 wv = load16(wr + k + 16 * u);
      for (int b = 0; b < MB; ++b) acc[b][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + (m + b) * K + k + 16 * u), acc[b][u]);
    }
  }
  for (; k + 16 <= K; k += 16) {
    __m512 wv = load16(wr + k);
    for (int b = 0; b < MB; ++b) acc[b][0] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + (m + b) * K + k), acc[b][0]);
  }
  for (int b = 0; b < MB; ++b) {
    for (int u = 1; u < U; ++u) acc[b][0] = _mm512_add_ps(acc[b][0], acc[b][u]);
    float s = _mm512_reduce_add_ps(acc[b][0]);
    for (int64_t t = k; t < K; ++t) s += x[(m + b) * K + t] * static_cast<float>(wr[t]);
    y[(m + b) * N + n] = s;
  }
}

template <typename W>
__attribute__((target("avx512f"))) static void gemv_rows_avx512(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * K;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) dot_row_avx512<4, 2>(x, wr, y, N, K, n, m);
    if (M - m == 3) dot_row_avx512<3, 2>(x, wr, y, N, K, n, m);
    if (M - m == 2) dot_row_avx512<2, 2>(x, wr, y, N, K, n, m);
    if (M - m == 1) dot_row_avx512<1, 4>(x, wr, y, N, K, n, m);
  }
}

// The rows of x w^T on the chosen path, for matvec.h: w [N, K] contiguous, of W's dtype (float32 or bfloat16); from
// kGemmRows rows of x, the panel product (gemm.h). The ops split output rows over threads in whole panels.
template <typename W>
static auto weight_rows(const char* op, const at::Tensor& weight) {
  constexpr auto dtype = c10::CppTypeToScalarType<W>::value;
  TORCH_CHECK(weight.scalar_type() == dtype && weight.dim() == 2 && weight.is_contiguous(), op, " takes contiguous ", dtype, " [N, K] weights");
  const W* wp = weight.data_ptr<W>();
  const int64_t N = weight.size(0), K = weight.size(1);
  return [wp, N, K](Isa isa, const float* xp, float* yp, int64_t M, int64_t n0, int64_t n1) {
    if (isa != Isa::scalar && M >= kGemmRows)
      gemm_rows(isa == Isa::avx512, xp, wp, yp, M, N, K, n0, n1);
    else if (isa == Isa::avx512)
      gemv_rows_avx512(xp, wp, yp, M, N, K, n0, n1);
    else if (isa == Isa::avx2)
      gemv_rows_avx2(xp, wp, yp, M, N, K, n0, n1);
    else
      gemv_rows_scalar(xp, wp, yp, M, N, K, n0, n1);
  };
}

// y [..., N] = x [..., K] @ weight [N, K]^T + bias [N]: float32, weight contiguous.
at::Tensor linear_fp32(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  at::Tensor y = matvec("kvlab::linear_fp32", x, weight.size(0), weight.size(1), weight_rows<float>("kvlab::linear_fp32", weight), kPanel);
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// silu(x gate^T) * (x up^T): SwiGLU's two projections of the same x in one call.
at::Tensor gated_fp32(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.sizes() == up.sizes(), "kvlab::gated_fp32: gate ", gate.sizes(), " and up ", up.sizes(), " differ");
  return gated_matvec("kvlab::gated_fp32", x, gate.size(0), gate.size(1), weight_rows<float>("kvlab::gated_fp32", gate), weight_rows<float>("kvlab::gated_fp32", up),
                      kPanel);
}

// The bfloat16 twins: x (bfloat16) widened once, the weights as they stream, the result rounded to bfloat16.
static at::Tensor widened(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, op, " takes bfloat16 x, got ", x.scalar_type());
  return x.to(at::kFloat);
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const char* op = "kvlab::linear_bf16";
  at::Tensor y = matvec(op, widened(op, x), weight.size(0), weight.size(1), weight_rows<at::BFloat16>(op, weight), kPanel);
  if (bias.has_value()) y.add_(*bias);
  return y.to(at::kBFloat16);
}

at::Tensor gated_bf16(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up) {
  const char* op = "kvlab::gated_bf16";
  TORCH_CHECK(gate.sizes() == up.sizes(), op, ": gate ", gate.sizes(), " and up ", up.sizes(), " differ");
  return gated_matvec(op, widened(op, x), gate.size(0), gate.size(1), weight_rows<at::BFloat16>(op, gate), weight_rows<at::BFloat16>(op, up), kPanel)
      .to(at::kBFloat16);
}

std::string isa() { return isa_name(kernel_isa()); }

}  // namespace kvlab

TORCH_LIBRARY(kvlab, m) {
  m.def("linear_fp32(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("gated_fp32(Tensor x, Tensor gate, Tensor up) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("gated_bf16(Tensor x, Tensor gate, Tensor up) -> Tensor");
  m.def("isa() -> str", &kvlab::isa);
}

TORCH_LIBRARY_IMPL(kvlab, CPU, m) {
  m.impl("linear_fp32", &kvlab::linear_fp32);
  m.impl("gated_fp32", &kvlab::gated_fp32);
  m.impl("linear_bf16", &kvlab::linear_bf16);
  m.impl("gated_bf16", &kvlab::gated_bf16);
}
