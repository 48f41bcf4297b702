// What the int4 products share (gemv_int4.cpp: x in float32; gemv_int4_xq.cpp: x rounded to int16 or
// int8): the weight's layout and checks, and the offsets' part of a product.
//
// w[n, k] = codes[n, k] * scales[n, g] + offsets[n, g] for k in group g (offsets = zeros - 8 scales:
// kvlab.quantize's int4, zero point folded), so
//
//     y[m, n] = sum_g scales[n, g] * (sum_{k in g} x[m, k] codes[n, k]) + offsets[n, g] * (sum_{k in g} x[m, k])
//
// Codes are stored as kvlab.quantize writes them, two per byte along a row (the even column in the high
// nibble), rows padded to Kp, a multiple of the group size (32, 64 or 128). Every path takes the offsets'
// part from the exact float32 sums of x per group (one multiply-add per group).
#pragma once
#include "matvec.h"
#include "xq.h"

namespace kvlab {

struct Int4Weight {
  const uint8_t* codes;  // [N, Kp / 2]
  const float* scales;   // [N, G]
  const float* offsets;  // [N, G]
  int64_t N, Kp, G, groupsize;
};

inline Int4Weight int4_weight(const char* op, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, int64_t groupsize) {
  TORCH_CHECK(groupsize == 32 || groupsize == 64 || groupsize == 128, op, ": group size must be 32, 64 or 128, got ", groupsize);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous(), op, " takes contiguous uint8 [N, Kp / 2] codes");
  const int64_t N = codes.size(0), Kp = 2 * codes.size(1);
  TORCH_CHECK(Kp % groupsize == 0, op, ": rows of ", Kp, " codes are not whole groups of ", groupsize);
  for (const at::Tensor* t : {&scales, &offsets})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N && t->size(1) == Kp / groupsize, op,
                ": scales and offsets must be contiguous float32 [", N, ", ", Kp / groupsize, "], got ", t->sizes());
  return {codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), offsets.data_ptr<float>(), N, Kp, Kp / groupsize, groupsize};
}

// The offsets' part of row n for row m of x: sum_g offsets[n, g] * group_sums[m, g].
inline float offset_term(const Int4Weight& w, const float* sums, int64_t n, int64_t m) {
  float s = 0.f;
  for (int64_t g = 0; g < w.G; ++g) s += w.offsets[n * w.G + g] * sums[m * w.G + g];
  return s;
}

// The same sum for the SIMD paths, 8 groups at a time.
__attribute__((target("avx2,fma"))) inline float offset_term_avx2(const Int4Weight& w, const float* sums, int64_t n, int64_t m) {
  const float *offsets = w.offsets + n * w.G, *row_sums = sums + m * w.G;
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= w.G; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(offsets + g), _mm256_loadu_ps(row_sums + g), acc);
  float total = hsum256(acc);
  for (; g < w.G; ++g) total += offsets[g] * row_sums[g];
  return total;
}

// x [..., K] @ w^T with x rounded per block of 32 inputs to `bits` (16 or 8) bits (gemv_int4_xq.cpp).
at::Tensor linear_int4_quantized_x(const char* op, const at::Tensor& x, const Int4Weight& w, int64_t bits);
// silu(x gate^T) * (x up^T), x rounded as above.
at::Tensor gated_int4_quantized_x(const char* op, const at::Tensor& x, const Int4Weight& gate, const Int4Weight& up, int64_t bits);

}  // namespace kvlab
