// Matrix-vector products with int8 weights for decode: y[m, n] = scales[n] * sum_k x[m, k] * q[n, k]
// (+ bias[n]), q int8 row-major [N, K] with one float scale per output row (kvlab.quantize's int8), x float32.
//
// A quarter of float32's bytes to stream per token. Each weight row is read straight through, 16 codes at
// a time widened to float32 and multiplied with up to four rows of x in float32, so the only rounding
// beside float32 summation is the weights' own quantization (x is not quantized, unlike llama.cpp's Q8_0
// dot products). Output rows are split over torch's threads (matvec.h).
#include <torch/library.h>

#include "int8.h"
#include "matvec.h"

namespace kvlab {

static void gemv_int8_rows_scalar(const float* x, const int8_t* q, const float* scales, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += x[m * K + k] * static_cast<float>(q[n * K + k]);
      y[m * N + n] = acc * scales[n];
    }
}

// One weight row against MB rows of x: 16 codes per step widened to two float vectors, U steps unrolled
// with their own accumulators (2U chains per row of x hide the FMA latency); the tail in scalar.
template <int MB, int U>
__attribute__((target("avx2,fma"))) static void dot_row_int8_avx2(const float* x, const int8_t* qr, float scale, float* y, int64_t N, int64_t K, int64_t n, int64_t m) {
  __m256 acc[MB][2 * U];
  for (int b = 0; b < MB; ++b)
    for (int u = 0; u < 2 * U; ++u) acc[b][u] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 * U <= K; k += 16 * U)
    for (int u = 0; u < U; ++u) {
      __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qr + k + 16 * u))));
      __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qr + k + 16 * u + 8))));
      for (int b = 0; b < MB; ++b) {
        const float* xs = x + (m + b) * K + k + 16 * u;
        acc[b][2 * u] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xs), acc[b][2 * u]);
        acc[b][2 * u + 1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xs + 8), acc[b][2 * u + 1]);
      }
    }
  for (int b = 0; b < MB; ++b) {
    for (int u = 1; u < 2 * U; ++u) acc[b][0] = _mm256_add_ps(acc[b][0], acc[b][u]);
    float s = hsum256(acc[b][0]);
    for (int64_t t = k; t < K; ++t) s += x[(m + b) * K + t] * static_cast<float>(qr[t]);
    y[(m + b) * N + n] = s * scale;
  }
}

__attribute__((target("avx2,fma"))) static void gemv_int8_rows_avx2(const float* x, const int8_t* q, const float* scales, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                                                                     int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* qr = q + n * K;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) dot_row_int8_avx2<4, 1>(x, qr, scales[n], y, N, K, n, m);
    if (M - m == 3) dot_row_int8_avx2<3, 1>(x, qr, scales[n], y, N, K, n, m);
    if (M - m == 2) dot_row_int8_avx2<2, 2>(x, qr, scales[n], y, N, K, n, m);
    if (M - m == 1) dot_row_int8_avx2<1, 2>(x, qr, scales[n], y, N, K, n, m);
  }
}

// The AVX-512 twin: 32 codes per step, 16 lanes per register.
template <int MB>
__attribute__((target("avx512f"))) static void dot_row_int8_avx512(const float* x, const int8_t* qr, float scale, float* y, int64_t N, int64_t K, int64_t n, int64_t m) {
  __m512 lo[MB], hi[MB];
  for (int b = 0; b < MB; ++b) lo[b] = hi[b] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + k))));
    __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + k + 16))));
    for (int b = 0; b < MB; ++b) {
      lo[b] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + (m + b) * K + k), lo[b]);
      hi[b] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + (m + b) * K + k + 16), hi[b]);
    }
  }
  for (int b = 0; b < MB; ++b) {
    float s = _mm512_reduce_add_ps(_mm512_add_ps(lo[b], hi[b]));
    for (int64_t t = k; t < K; ++t) s += x[(m + b) * K + t] * static_cast<float>(qr[t]);
    y[(m + b) * N + n] = s * scale;
  }
}

__attribute__((target("avx512f"))) static void gemv_int8_rows_avx512(const float* x, const int8_t* q, const float* scales, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                                                                      int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* qr = q + n * K;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) dot_row_int8_avx512<4>(x, qr, scales[n], y, N, K, n, m);
    if (M - m == 3) dot_row_int8_avx512<3>(x, qr, scales[n], y, N, K, n, m);
    if (M - m == 2) dot_row_int8_avx512<2>(x, qr, scales[n], y, N, K, n, m);
    if (M - m == 1) dot_row_int8_avx512<1>(x, qr, scales[n], y, N, K, n, m);
  }
}

// The rows of (x q^T) * scales on the chosen path, for matvec.h: q int8 [N, K] contiguous, scales [N].
static auto int8_rows(const char* op, const at::Tensor& q, const at::Tensor& scales) {
  const Int8Rows w = int8_weight(op, q, scales);
  const int8_t* qp = w.q;
  const float* sp = w.scales;
  const int64_t N = w.N, K = w.K;
  return [qp, sp, N, K](Isa isa, const float* xp, float* yp, int64_t M, int64_t n0, int64_t n1) {
    if (isa == Isa::avx512)
      gemv_int8_rows_avx512(xp, qp, sp, yp, M, N, K, n0, n1);
    else if (isa == Isa::avx2)
      gemv_int8_rows_avx2(xp, qp, sp, yp, M, N, K, n0, n1);
    else
      gemv_int8_rows_scalar(xp, qp, sp, yp, M, N, K, n0, n1);
  };
}

// y [..., N] = (x [..., K] @ q [N, K]^T) * scales [N] + bias [N]: x float32, q int8 contiguous.
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const c10::optional<at::Tensor>& bias) {
  at::Tensor y = matvec("kvlab::linear_int8", x, q.size(0), q.size(1), int8_rows("kvlab::linear_int8", q, scales));
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// silu(x gate^T) * (x up^T) with both weights in int8.
at::Tensor gated_int8(const at::Tensor& x, const at::Tensor& q_gate, const at::Tensor& s_gate, const at::Tensor& q_up, const at::Tensor& s_up) {
  TORCH_CHECK(q_gate.sizes() == q_up.sizes(), "kvlab::gated_int8: gate ", q_gate.sizes(), " and up ", q_up.sizes(), " differ");
  return gated_matvec("kvlab::gated_int8", x, q_gate.size(0), q_gate.size(1), int8_rows("kvlab::gated_int8", q_gate, s_gate),
                      int8_rows("kvlab::gated_int8", q_up, s_up));
}

}  // namespace kvlab

TORCH_LIBRARY_FRAGMENT(kvlab, m) {
  m.def("linear_int8(Tensor x, Tensor q, Tensor scales, Tensor? bias) -> Tensor");
  m.def("gated_int8(Tensor x, Tensor q_gate, Tensor s_gate, Tensor q_up, Tensor s_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvlab, CPU, m) {
  m.impl("linear_int8", &kvlab::linear_int8);
  m.impl("gated_int8", &kvlab::gated_int8);
}
