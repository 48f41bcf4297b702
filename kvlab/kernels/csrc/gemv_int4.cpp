// Matrix-vector products with 4-bit weights in groups for decode: w[n, k] = codes[n, k] * scales[n, g] +
// offsets[n, g] for k in group g (offsets = zeros - 8 scales: kvlab.quantize's int4, zero point folded), so
//
//     y[m, n] = sum_g scales[n, g] * (sum_{k in g} x[m, k] codes[n, k]) + offsets[n, g] * (sum_{k in g} x[m, k])
//
// Codes are stored as kvlab.quantize writes them, two per byte along a row (the even column in the high
// nibble), rows padded to Kp, a multiple of the group size (32, 64 or 128). Two ways to take x:
//
// - float32 (the default): the codes widened exactly to float32 and multiplied with x in float32, x
//   reordered once per call to match the nibble split, so the only rounding is float32 summation's.
// - quantized (llama.cpp's Q4 x Q8_0 products; kvlab's with KVLAB_INT4_X=int8): each run of 32 inputs (a
//   block) rounded to int8 with one scale (max |x| / 127), once per call, and each block's 32
//   code-times-input products summed exactly in int32 by byte dot products (AVX2 maddubs + madd, or
//   AVX512-VNNI's vpdpbusd): about ten instructions per 32 weights; each input is off by at most half its
//   block's step.
//
// Both take the offsets' part from the exact float32 sums of x per group (one multiply-add per group).
#include <torch/library.h>

#include "matvec.h"

namespace kvlab {

struct Int4Weight {
  const uint8_t* codes;  // [N, Kp / 2]
  const float* scales;   // [N, G]
  const float* offsets;  // [N, G]
  int64_t N, Kp, G, groupsize;
};

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

// The offsets' part of row n for row m of x: sum_g offsets[n, g] * group_sums[m, g].
static inline float offset_term(const Int4Weight& w, const float* sums, int64_t n, int64_t m) {
  float s = 0.f;
  for (int64_t g = 0; g < w.G; ++g) s += w.offsets[n * w.G + g] * sums[m * w.G + g];
  return s;
}

// The same sum for the SIMD paths, 8 groups at a time.
__attribute__((target("avx2,fma"))) static float offset_term_avx2(const Int4Weight& w, const float* sums, int64_t n, int64_t m) {
  const float *offsets = w.offsets + n * w.G, *row_sums = sums + m * w.G;
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= w.G; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(offsets + g), _mm256_loadu_ps(row_sums + g), acc);
  float total = hsum256(acc);
  for (; g < w.G; ++g) total += offsets[g] * row_sums[g];
  return total;
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

// x [M, K] rounded for the byte dot products: per block of 32 inputs, int8 codes q = round(x / step) with
// step = max |x| / 127 (0 for a block of zeros), stored odd inputs first, then even ones (the order a
// block's 16 bytes of weight codes unpack in: low nibbles, then high); and x's exact sums per weight group.
struct Int4QuantizedInput {
  std::vector<int8_t> codes;      // [M, Kp]
  std::vector<float> steps;       // [M, Kp / 32]
  std::vector<float> group_sums;  // [M, G]
};

// v rounded to the nearest integer, ties to even (std::nearbyint in the default rounding mode), inline:
// SSE's conversion, where nearbyint is a library call without SSE4.1, a few microseconds per call's x.
static inline int round_to_int(float v) { return _mm_cvtss_si32(_mm_set_ss(v)); }

static Int4QuantizedInput quantize_input(const at::Tensor& x, int64_t Kp, int64_t groupsize) {
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const int64_t K = x.size(-1), M = xc.numel() / K, blocks = Kp / 32, G = Kp / groupsize;
  Int4QuantizedInput in{std::vector<int8_t>(M * Kp), std::vector<float>(M * blocks), std::vector<float>(M * G, 0.f)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      float v[32], amax = 0.f;
      float& group_sum = in.group_sums[m * G + b * 32 / groupsize];  // a group is whole blocks
      for (int64_t i = 0; i < 32; ++i) {
        v[i] = b * 32 + i < K ? xp[m * K + b * 32 + i] : 0.f;
        amax = std::max(amax, std::fabs(v[i]));
        group_sum += v[i];
      }
      const float inverse = amax > 0.f ? 127.f / amax : 0.f;
      in.steps[m * blocks + b] = amax / 127.f;
      for (int64_t i = 0; i < 32; ++i) in.codes[m * Kp + b * 32 + (i % 2 == 1 ? i / 2 : 16 + i / 2)] = static_cast<int8_t>(round_to_int(v[i] * inverse));
    }
  return in;
}

// The reference: each block's products summed in int32, scaled by the weight's scale and the block's step.
static void gemv_int4_x8_rows_scalar(const Int4QuantizedInput& in, const Int4Weight& w, float* y, int64_t M, int64_t n0, int64_t n1) {
  const int64_t blocks = w.Kp / 32;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* bytes = w.codes + n * (w.Kp / 2) + 16 * b;
        const int8_t* q = in.codes.data() + m * w.Kp + 32 * b;
        int32_t dot = 0;
        for (int64_t i = 0; i < 16; ++i) dot += (bytes[i] & 15) * q[i] + (bytes[i] >> 4) * q[16 + i];
        acc += w.scales[n * w.G + 32 * b / w.groupsize] * in.steps[m * blocks + b] * static_cast<float>(dot);
      }
      y[m * w.N + n] = acc + offset_term(w, in.group_sums.data(), n, m);
    }
}

// A block's 16 bytes of codes as 32 bytes: the low nibbles (odd columns), then the high ones (even).
__attribute__((target("avx2,fma"))) static inline __m256i unpack_block(const uint8_t* bytes) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(15));
}

// NR weight rows from n against MB rows of x from m: per block, each row's codes unpacked once, their byte
// products with each row of x summed in int32 lanes (DOT: maddubs + madd, or vpdpbusd), converted and
// scaled into one float32 accumulator per (weight row, x row). Two twins below, one per DOT.
#define KVLAB_INT4_X8_ROWS(DOT)                                                                                                     \
  const int64_t blocks = w.Kp / 32;                                                                                                 \
  __m256 acc[NR][MB];                                                                                                               \
  for (int r = 0; r < NR; ++r)                                                                                                      \
    for (int i = 0; i < MB; ++i) acc[r][i] = _mm256_setzero_ps();                                                                   \
  for (int64_t b = 0; b < blocks; ++b)                                                                                              \
    for (int r = 0; r < NR; ++r) {                                                                                                  \
      const __m256i c = unpack_block(w.codes + (n + r) * (w.Kp / 2) + 16 * b);                                                      \
      const float scale = w.scales[(n + r) * w.G + 32 * b / w.groupsize];                                                           \
      for (int i = 0; i < MB; ++i) {                                                                                                \
        const __m256i dot = DOT(c, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.codes.data() + (m + i) * w.Kp + 32 * b))); \
        acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale * in.steps[(m + i) * blocks + b]), acc[r][i]);    \
      }                                                                                                                             \
    }                                                                                                                               \
  for (int r = 0; r < NR; ++r)                                                                                                      \
    for (int i = 0; i < MB; ++i)                                                                                                    \
      y[(m + i) * w.N + n + r] = hsum256(acc[r][i]) + offset_term_avx2(w, in.group_sums.data(), n + r, m + i);

#define KVLAB_MADDUBS(c, q) _mm256_madd_epi16(_mm256_maddubs_epi16(c, q), _mm256_set1_epi16(1))
#define KVLAB_VPDPBUSD(c, q) _mm256_dpbusd_epi32(_mm256_setzero_si256(), c, q)

template <int MB, int NR>
__attribute__((target("avx2,fma"))) static void dot_rows_int4_x8_avx2(const Int4QuantizedInput& in, const Int4Weight& w, float* y, int64_t n, int64_t m) {
  KVLAB_INT4_X8_ROWS(KVLAB_MADDUBS)
}

template <int MB, int NR>
__attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni"))) static void dot_rows_int4_x8_vnni(const Int4QuantizedInput& in, const Int4Weight& w,
                                                                                                          float* y, int64_t n, int64_t m) {
  KVLAB_INT4_X8_ROWS(KVLAB_VPDPBUSD)
}

#undef KVLAB_INT4_X8_ROWS
#undef KVLAB_MADDUBS
#undef KVLAB_VPDPBUSD

template <int MB, int NR>
static void dot_rows_int4_x8(bool vnni, const Int4QuantizedInput& in, const Int4Weight& w, float* y, int64_t n, int64_t m) {
  if (vnni)
    dot_rows_int4_x8_vnni<MB, NR>(in, w, y, n, m);
  else
    dot_rows_int4_x8_avx2<MB, NR>(in, w, y, n, m);
}

// Rows [n0, n1) for every row of x: batch 1 takes four weight rows at a time (four independent sums),
// larger batches one weight row against up to four rows of x.
static void gemv_int4_x8_rows_simd(bool vnni, const Int4QuantizedInput& in, const Int4Weight& w, float* y, int64_t M, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (M == 1)
    for (; n + 4 <= n1; n += 4) dot_rows_int4_x8<1, 4>(vnni, in, w, y, n, 0);
  for (; n < n1; ++n) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) dot_rows_int4_x8<4, 1>(vnni, in, w, y, n, m);
    if (M - m == 3) dot_rows_int4_x8<3, 1>(vnni, in, w, y, n, m);
    if (M - m == 2) dot_rows_int4_x8<2, 1>(vnni, in, w, y, n, m);
    if (M - m == 1) dot_rows_int4_x8<1, 1>(vnni, in, w, y, n, m);
  }
}

static Int4Weight int4_weight(const char* op, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, int64_t groupsize) {
  TORCH_CHECK(groupsize == 32 || groupsize == 64 || groupsize == 128, op, ": group size must be 32, 64 or 128, got ", groupsize);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous(), op, " takes contiguous uint8 [N, Kp / 2] codes");
  const int64_t N = codes.size(0), Kp = 2 * codes.size(1);
  TORCH_CHECK(Kp % groupsize == 0, op, ": rows of ", Kp, " codes are not whole groups of ", groupsize);
  for (const at::Tensor* t : {&scales, &offsets})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N && t->size(1) == Kp / groupsize, op,
                ": scales and offsets must be contiguous float32 [", N, ", ", Kp / groupsize, "], got ", t->sizes());
  return {codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), offsets.data_ptr<float>(), N, Kp, Kp / groupsize, groupsize};
}

// The rows of x w^T on the chosen path, for matvec.h, reading `in` (prepared once per call).
static auto int4_rows(const Int4Weight& w, const Int4Input& in) {
  return [w, natural = in.natural, reordered = in.reordered, sums = in.group_sums](Isa isa, const float*, float* yp, int64_t M, int64_t n0, int64_t n1) {
    if (isa == Isa::avx512)
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

// The rows of x w^T with x quantized by quantize_input, on the chosen path.
static auto int4_x8_rows(const Int4Weight& w, const Int4QuantizedInput& in) {
  return [w, &in](Isa isa, const float*, float* yp, int64_t M, int64_t n0, int64_t n1) {
    if (isa == Isa::scalar)
      gemv_int4_x8_rows_scalar(in, w, yp, M, n0, n1);
    else
      gemv_int4_x8_rows_simd(isa == Isa::avx512 && has_avx512_vnni(), in, w, yp, M, n0, n1);
  };
}

// y [..., N] = x [..., K] @ w^T + bias, w [N, Kp >= K] in 4-bit codes, a scale and an offset per group;
// x quantized per block of 32 (quantize_x) or kept in float32.
at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, int64_t groupsize,
                       const c10::optional<at::Tensor>& bias, bool quantize_x) {
  const char* op = "kvlab::linear_int4";
  const Int4Weight w = int4_weight(op, codes, scales, offsets, groupsize);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) <= w.Kp, op, ": x must be float32 with at most ", w.Kp, " features");
  at::Tensor y;
  if (quantize_x) {
    const Int4QuantizedInput in = quantize_input(x, w.Kp, groupsize);
    y = matvec(op, x, w.N, x.size(-1), int4_x8_rows(w, in));
  } else {
    const Int4Input in = int4_input(x, w.Kp, groupsize);
    y = int4_output(x, matvec(op, natural_rows(in, x, w.Kp), w.N, w.Kp, int4_rows(w, in)), w.N);
  }
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// silu(x gate^T) * (x up^T) with both weights in 4-bit groups of the same size.
at::Tensor gated_int4(const at::Tensor& x, const at::Tensor& c_gate, const at::Tensor& s_gate, const at::Tensor& o_gate, const at::Tensor& c_up,
                      const at::Tensor& s_up, const at::Tensor& o_up, int64_t groupsize, bool quantize_x) {
  const char* op = "kvlab::gated_int4";
  const Int4Weight gate = int4_weight(op, c_gate, s_gate, o_gate, groupsize), up = int4_weight(op, c_up, s_up, o_up, groupsize);
  TORCH_CHECK(c_gate.sizes() == c_up.sizes(), op, ": gate ", c_gate.sizes(), " and up ", c_up.sizes(), " differ");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) <= gate.Kp, op, ": x must be float32 with at most ", gate.Kp, " features");
  if (quantize_x) {
    const Int4QuantizedInput in = quantize_input(x, gate.Kp, groupsize);
    return gated_matvec(op, x, gate.N, x.size(-1), int4_x8_rows(gate, in), int4_x8_rows(up, in));
  }
  const Int4Input in = int4_input(x, gate.Kp, groupsize);
  return int4_output(x, gated_matvec(op, natural_rows(in, x, gate.Kp), gate.N, gate.Kp, int4_rows(gate, in), int4_rows(up, in)), gate.N);
}

}  // namespace kvlab

TORCH_LIBRARY_FRAGMENT(kvlab, m) {
  m.def("linear_int4(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int groupsize, Tensor? bias, bool quantize_x=False) -> Tensor");
  m.def("gated_int4(Tensor x, Tensor c_gate, Tensor s_gate, Tensor o_gate, Tensor c_up, Tensor s_up, Tensor o_up, int groupsize, bool quantize_x=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvlab, CPU, m) {
  m.impl("linear_int4", &kvlab::linear_int4);
  m.impl("gated_int4", &kvlab::gated_int4);
}
