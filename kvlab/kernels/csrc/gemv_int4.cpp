// int4 products with x in float32 (int4.h has the layout; gemv_int4_xq.cpp the paths that round x): the
// codes widened exactly to float32 and multiplied with x in float32, x reordered once per call to match the
// nibble split, so the only rounding is float32 summation's. Also the ops' entry points, which pick the path
// by x_bits: 32 here, 16 or 8 in gemv_int4_xq.cpp.
#include <torch/library.h>

#include "gemm.h"
#include "int4.h"

namespace kvlab {

// x [M, K] as the kernels read it, in one buffer: zero-padded to Kp in natural order (the scalar path),
// reordered per run of 32 (even inputs, then odd: the SIMD paths), and the sums of each group [M, G].
// Plain loops: a few microseconds of torch ops per call would cost more than the product itself.
struct Int4Input {
  at::Tensor buffer;
  const float *natural, *reordered, *group_sums;
};

static Int4Input int4_input(const at::Tensor& x, int64_t Kp, int64_t groupsize) {
  const at::Tensor xc = x.contiguous();
  const int64_t K = x.size(-1), M = xc.numel() / K, G = Kp / groupsize;
  at::Tensor buffer = at::empty({M * (2 * Kp + G)}, x.options());
  float *natural = buffer.data_ptr<float>(), *reordered = natural + M * Kp, *sums = reordered + M * Kp;
  const float* xp = xc.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    float* row = natural + m * Kp;
    std::copy(xp + m * K, xp + (m + 1) * K, row);
    std::fill(row + K, row + Kp, 0.f);
    for (int64_t k = 0; k < Kp; k += 32)
      for (int64_t i = 0; i < 16; ++i) {
        reordered[m * Kp + k + i] = row[k + 2 * i];
        reordered[m * Kp + k + 16 + i] = row[k + 2 * i + 1];
      }
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int64_t k = g * groupsize; k < (g + 1) * groupsize; ++k) sum += row[k];
      sums[m * G + g] = sum;
    }
  }
  return {buffer, natural, reordered, sums};
}

// The reference: each weight dequantized, then the dot product in natural order.
static void gemv_int4_rows_scalar(const float* x, const Int4Weight& w, float* y, int64_t M, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < w.Kp; ++k) {
        const uint8_t byte = w.codes[n * (w.Kp / 2) + k / 2];
        const int64_t g = n * w.G + k / w.groupsize;
        acc += x[m * w.Kp + k] * (static_cast<float>(k % 2 == 0 ? byte >> 4 : byte & 15) * w.scales[g] + w.offsets[g]);
      }
      y[m * w.N + n] = acc;
    }
}

// One weight row against MB rows of x (reordered): each 16 bytes widened to four float vectors (even codes
// 0-7 and 8-15, odd codes 0-7 and 8-15), one accumulator each per row of x; at a group's end their sum is
// scaled into the row's total.
template <int MB>
__attribute__((target("avx2,fma"))) static void dot_row_int4_avx2(const float* x, const float* sums, const Int4Weight& w, float* y, int64_t n, int64_t m) {
  const __m128i low_nibble = _mm_set1_epi8(15);
  const uint8_t* row = w.codes + n * (w.Kp / 2);
  __m256 total[MB];
  for (int b = 0; b < MB; ++b) total[b] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.G; ++g) {
    __m256 acc[MB][4];
    for (int b = 0; b < MB; ++b)
      for (int u = 0; u < 4; ++u) acc[b][u] = _mm256_setzero_ps();
    for (int64_t k = g * w.groupsize; k < (g + 1) * w.groupsize; k += 32) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2));
      const __m128i even = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibble), odd = _mm_and_si128(bytes, low_nibble);
      const __m256 c[4] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(even)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(even, 8))),
                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(odd)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(odd, 8)))};
      for (int b = 0; b < MB; ++b)
        for (int u = 0; u < 4; ++u) acc[b][u] = _mm256_fmadd_ps(c[u], _mm256_loadu_ps(x + (m + b) * w.Kp + k + 8 * u), acc[b][u]);
    }
    const __m256 scale = _mm256_set1_ps(w.scales[n * w.G + g]);
    for (int b = 0; b < MB; ++b)
      total[b] = _mm256_fmadd_ps(_mm256_add_ps(_mm256_add_ps(acc[b][0], acc[b][1]), _mm256_add_ps(acc[b][2], acc[b][3])), scale, total[b]);
  }
  for (int b = 0; b < MB; ++b) y[(m + b) * w.N + n] = hsum256(total[b]) + offset_term_avx2(w, sums, n, m + b);
}

__attribute__((target("avx2,fma"))) static void gemv_int4_rows_avx2(const float* x, const float* sums, const Int4Weight& w, float* y, int64_t M, int64_t n0,
                                                                     int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) dot_row_int4_avx2<2>(x, sums, w, y, n, m);
    if (m < M) dot_row_int4_avx2<1>(x, sums, w, y, n, m);
  }
}

// The AVX-512 twin: each 16 bytes widened to two vectors of 16 codes (even, odd).
template <int MB>
__attribute__((target("avx512f"))) static void dot_row_int4_avx512(const float* x, const float* sums, const Int4Weight& w, float* y, int64_t n, int64_t m) {
  const __m128i low_nibble = _mm_set1_epi8(15);
  const uint8_t* row = w.codes + n * (w.Kp / 2);
  __m512 total[MB];
  for (int b = 0; b < MB; ++b) total[b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.G; ++g) {
    __m512 acc[MB][2];
    for (int b = 0; b < MB; ++b) acc[b][0] = acc[b][1] = _mm512_setzero_ps();
    for (int64_t k = g * w.groupsize; k < (g + 1) * w.groupsize; k += 32) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2));
      const __m512 even = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibble)));
      const __m512 odd = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low_nibble)));
      for (int b = 0; b < MB; ++b) {
        acc[b][0] = _mm512_fmadd_ps(even, _mm512_loadu_ps(x + (m + b) * w.Kp + k), acc[b][0]);
        acc[b][1] = _mm512_fmadd_ps(odd, _mm512_loadu_ps(x + (m + b) * w.Kp + k + 16), acc[b][1]);
      }
    }
    const __m512 scale = _mm512_set1_ps(w.scales[n * w.G + g]);
    for (int b = 0; b < MB; ++b) total[b] = _mm512_fmadd_ps(_mm512_add_ps(acc[b][0], acc[b][1]), scale, total[b]);
  }
  for (int b = 0; b < MB; ++b) y[(m + b) * w.N + n] = _mm512_reduce_add_ps(total[b]) + offset_term_avx2(w, sums, n, m + b);
}

__attribute__((target("avx512f"))) static void gemv_int4_rows_avx512(const float* x, const float* sums, const Int4Weight& w, float* y, int64_t M, int64_t n0,
                                                                      int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) dot_row_int4_avx512<2>(x, sums, w, y, n, m);
    if (m < M) dot_row_int4_avx512<1>(x, sums, w, y, n, m);
  }
}

// Weight row n dequantized into out [Kp]: code * scale + offset, the value kvlab.quantize's dequantize_int4 gives
// (the product is exact, so fused or not the sum rounds once), 16 bytes widened to 32 codes in order.
__attribute__((target("avx512f"))) static void dequantize_row_avx512(const Int4Weight& w, int64_t n, float* out) {
  const __m128i low_nibble = _mm_set1_epi8(15);
  const uint8_t* row = w.codes + n * (w.Kp / 2);
  for (int64_t k = 0; k < w.Kp; k += 32) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2));
    const __m128i even = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibble), odd = _mm_and_si128(bytes, low_nibble);
    const __m512 scale = _mm512_set1_ps(w.scales[n * w.G + k / w.groupsize]), offset = _mm512_set1_ps(w.offsets[n * w.G + k / w.groupsize]);
    const __m128i halves[2] = {_mm_unpacklo_epi8(even, odd), _mm_unpackhi_epi8(even, odd)};
    for (int h = 0; h < 2; ++h)
      _mm512_storeu_ps(out + k + 16 * h, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(halves[h])), scale, offset));
  }
}

__attribute__((target("avx2,fma"))) static void dequantize_row_avx2(const Int4Weight& w, int64_t n, float* out) {
  const __m128i low_nibble = _mm_set1_epi8(15);
  const uint8_t* row = w.codes + n * (w.Kp / 2);
  for (int64_t k = 0; k < w.Kp; k += 32) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2));
    const __m128i even = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibble), odd = _mm_and_si128(bytes, low_nibble);
    const __m256 scale = _mm256_set1_ps(w.scales[n * w.G + k / w.groupsize]), offset = _mm256_set1_ps(w.offsets[n * w.G + k / w.groupsize]);
    const __m128i halves[2] = {_mm_unpacklo_epi8(even, odd), _mm_unpackhi_epi8(even, odd)};
    for (int h = 0; h < 4; ++h) {
      const __m128i eight = h % 2 == 0 ? halves[h / 2] : _mm_srli_si128(halves[h / 2], 8);
      _mm256_storeu_ps(out + k + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight)), scale, offset));
    }
  }
}

// The panel of weight rows from n0 (gemm.h) for a prompt's rows: the rows dequantized into this thread's scratch,
// then packed as a float32 weight's, so the product is the float32 model's on the same weights, bit for bit.
static void pack_panel_int4(bool avx512, const Int4Weight& w, int64_t n0, float* panel) {
  static thread_local std::vector<float> rows;
  rows.resize(kPanel * w.Kp);
  const int64_t count = std::min(kPanel, w.N - n0);
  for (int64_t j = 0; j < count; ++j) {
    if (avx512)
      dequantize_row_avx512(w, n0 + j, rows.data() + j * w.Kp);
    else
      dequantize_row_avx2(w, n0 + j, rows.data() + j * w.Kp);
  }
  pack_panel(rows.data(), count, w.Kp, 0, panel);
}

// The rows of x w^T on the chosen path, for matvec.h, reading `in` (prepared once per call); from kGemmRows rows of
// x on the SIMD paths, gemm.h's panel product over dequantized panels.
static auto int4_rows(const Int4Weight& w, const Int4Input& in) {
  return [w, natural = in.natural, reordered = in.reordered, sums = in.group_sums](Isa isa, const float*, float* yp, int64_t M, int64_t n0, int64_t n1) {
    const bool avx512 = isa == Isa::avx512;
    if (isa != Isa::scalar && M >= kGemmRows)
      gemm_panels(avx512, natural, [&w, avx512](int64_t n, float* panel) { pack_panel_int4(avx512, w, n, panel); }, yp, M, w.N, w.Kp, n0, n1);
    else if (isa == Isa::avx512)
      gemv_int4_rows_avx512(reordered, sums, w, yp, M, n0, n1);
    else if (isa == Isa::avx2)
      gemv_int4_rows_avx2(reordered, sums, w, yp, M, n0, n1);
    else
      gemv_int4_rows_scalar(natural, w, yp, M, n0, n1);
  };
}

// The padded rows of x [M, Kp] as a tensor, the operand matvec sizes the output by.
static at::Tensor natural_rows(const Int4Input& in, const at::Tensor& x, int64_t Kp) { return in.buffer.narrow(0, 0, x.numel() / x.size(-1) * Kp).view({-1, Kp}); }

// The products' output [..., N] for x [..., K]: matvec's over the rows of x as one batch.
static at::Tensor int4_output(const at::Tensor& x, const at::Tensor& flat, int64_t N) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return flat.view(shape);
}

// What both ops take: float32 x of at most Kp features, and x in 32, 16 or 8 bits.
static void check_input(const char* op, const at::Tensor& x, int64_t Kp, int64_t x_bits) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) <= Kp, op, ": x must be float32 with at most ", Kp, " features");
  TORCH_CHECK(x_bits == 32 || x_bits == 16 || x_bits == 8, op, ": x_bits must be 32, 16 or 8, got ", x_bits);
}

// y [..., N] = x [..., K] @ w^T + bias, w [N, Kp >= K] in 4-bit codes, a scale and an offset per group;
// x kept in float32 (x_bits 32) or rounded per block of 32 to int16 or int8 (x_bits 16 or 8).
at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, int64_t groupsize,
                       const c10::optional<at::Tensor>& bias, int64_t x_bits) {
  const char* op = "kvlab::linear_int4";
  const Int4Weight w = int4_weight(op, codes, scales, offsets, groupsize);
  check_input(op, x, w.Kp, x_bits);
  at::Tensor y;
  if (x_bits == 32) {
    const Int4Input in = int4_input(x, w.Kp, groupsize);
    y = int4_output(x, matvec(op, natural_rows(in, x, w.Kp), w.N, w.Kp, int4_rows(w, in), kPanel), w.N);
  } else {
    y = linear_int4_quantized_x(op, x, w, x_bits);
  }
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// silu(x gate^T) * (x up^T) with both weights in 4-bit groups of the same size, x as in linear_int4.
at::Tensor gated_int4(const at::Tensor& x, const at::Tensor& c_gate, const at::Tensor& s_gate, const at::Tensor& o_gate, const at::Tensor& c_up,
                      const at::Tensor& s_up, const at::Tensor& o_up, int64_t groupsize, int64_t x_bits) {
  const char* op = "kvlab::gated_int4";
  const Int4Weight gate = int4_weight(op, c_gate, s_gate, o_gate, groupsize), up = int4_weight(op, c_up, s_up, o_up, groupsize);
  TORCH_CHECK(c_gate.sizes() == c_up.sizes(), op, ": gate ", c_gate.sizes(), " and up ", c_up.sizes(), " differ");
  check_input(op, x, gate.Kp, x_bits);
  if (x_bits != 32) return gated_int4_quantized_x(op, x, gate, up, x_bits);
  const Int4Input in = int4_input(x, gate.Kp, groupsize);
  return int4_output(x, gated_matvec(op, natural_rows(in, x, gate.Kp), gate.N, gate.Kp, int4_rows(gate, in), int4_rows(up, in), kPanel), gate.N);
}

}  // namespace kvlab

TORCH_LIBRARY_FRAGMENT(kvlab, m) {
  m.def("linear_int4(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int groupsize, Tensor? bias, int x_bits=32) -> Tensor");
  m.def("gated_int4(Tensor x, Tensor c_gate, Tensor s_gate, Tensor o_gate, Tensor c_up, Tensor s_up, Tensor o_up, int groupsize, int x_bits=32) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvlab, CPU, m) {
  m.impl("linear_int4", &kvlab::linear_int4);
  m.impl("gated_int4", &kvlab::gated_int4);
}
