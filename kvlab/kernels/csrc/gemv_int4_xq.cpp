// int4 products with x rounded per block of 32 inputs (int4.h has the layout), two widths:
//
// - int16 (KVLAB_INT4_X=int16, the default; a Linear prepared with it reads the tiled layout instead,
//   gemv_int4_tiled.cpp, the same integer sums): each input within 2^-16 of its block's max |x|, about
//   float32's accuracy for these weights (quantized to 4 bits). A block's 16 bytes of codes are widened
//   once to 16-bit lanes (low nibble: odd columns, high: even), multiplied with x's int16 codes and
//   summed in pairs in int32 (vpmaddwd), converted and scaled: no 512-bit shuffles, the same instructions
//   on AVX2 and AVX-512 machines.
// - int8 (llama.cpp's Q4 x Q8_0 products; KVLAB_INT4_X=int8): each block's 32 code-times-input products
//   summed exactly in int32 by byte dot products (AVX2 maddubs + madd, or AVX512-VNNI's vpdpbusd); each
//   input off by at most half its block's step (max |x| / 127).
//
// Either way each block's integer sum is exact, so the rounding is x's, then float32 summation's.
#include "int4.h"

namespace kvlab {

// The reference: each block's products summed in int32, scaled by the weight's scale and the block's step.
template <typename T>
static void gemv_int4_xq_rows_scalar(const QuantizedInput<T>& in, const Int4Weight& w, float* y, int64_t M, int64_t n0, int64_t n1) {
  const int64_t blocks = w.Kp / 32;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* bytes = w.codes + n * (w.Kp / 2) + 16 * b;
        const T* q = in.codes.data() + m * w.Kp + 32 * b;
        int32_t dot = 0;
        for (int64_t i = 0; i < 16; ++i) dot += (bytes[i] & 15) * q[i] + (bytes[i] >> 4) * q[16 + i];
        acc += w.scales[n * w.G + 32 * b / w.groupsize] * in.steps[m * blocks + b] * static_cast<float>(dot);
      }
      y[m * w.N + n] = acc + offset_term(w, in.group_sums.data(), n, m);
    }
}

// The weight row `ahead` rows on, at block b, on its way to L1: its codes' line (64 bytes: 4 blocks) and,
// every 16 blocks, its scales' and offsets' lines. Over 30 layers' products streamed from DRAM (2 Zen 4
// cores) it took int16 x from 0.89 to 0.81 of float32 x's time in two runs, where other runs move by as much
// (docs/results.md). A prefetch never faults, so rows past the weight's end are harmless.
constexpr int64_t kPrefetchRows = 8;

__attribute__((target("avx2,fma"))) static inline void prefetch_row(const Int4Weight& w, int64_t ahead, int64_t b, int group_shift) {
  _mm_prefetch(reinterpret_cast<const char*>(w.codes + ahead * (w.Kp / 2) + 16 * b), _MM_HINT_T0);
  if (b % 16 == 0) {
    _mm_prefetch(reinterpret_cast<const char*>(w.scales + ahead * w.G + (b >> group_shift)), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w.offsets + ahead * w.G + (b >> group_shift)), _MM_HINT_T0);
  }
}

// NR weight rows from n against MB rows of x from m, x in int16: per block, each weight row's 16 bytes
// widened once to 16-bit lanes, split into low and high nibbles, multiplied with each row of x's odd and
// even inputs and summed in pairs (vpmaddwd); each sum converted, scaled by the weight's scale (a broadcast
// load) and the block's step, and accumulated in float32 per (weight row, x row).
template <int MB, int NR>
__attribute__((target("avx2,fma"))) static void dot_rows_int4_x16(const QuantizedInput<int16_t>& in, const Int4Weight& w, float* y, int64_t n, int64_t m) {
  const int64_t blocks = w.Kp / 32;
  const int group_shift = w.groupsize == 32 ? 0 : w.groupsize == 64 ? 1 : 2;
  const __m256i low_nibble = _mm256_set1_epi16(15);
  __m256 acc[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MB; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b)
    for (int r = 0; r < NR; ++r) {
      if (b % 4 == 0) prefetch_row(w, n + r + kPrefetchRows, b, group_shift);
      const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.codes + (n + r) * (w.Kp / 2) + 16 * b)));
      const __m256i odd = _mm256_and_si256(c, low_nibble), even = _mm256_srli_epi16(c, 4);
      const __m256 scale = _mm256_broadcast_ss(w.scales + (n + r) * w.G + (b >> group_shift));
      for (int i = 0; i < MB; ++i) {
        const int16_t* q = in.codes.data() + (m + i) * w.Kp + 32 * b;
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(odd, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))),
                                             _mm256_madd_epi16(even, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16))));
        const __m256 step = _mm256_broadcast_ss(in.steps.data() + (m + i) * blocks + b);
        acc[r][i] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), scale), step, acc[r][i]);
      }
    }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MB; ++i) y[(m + i) * w.N + n + r] = hsum256(acc[r][i]) + offset_term_avx2(w, in.group_sums.data(), n + r, m + i);
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
__attribute__((target("avx2,fma"))) static void dot_rows_int4_x8_avx2(const QuantizedInput<int8_t>& in, const Int4Weight& w, float* y, int64_t n, int64_t m) {
  KVLAB_INT4_X8_ROWS(KVLAB_MADDUBS)
}

template <int MB, int NR>
__attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni"))) static void dot_rows_int4_x8_vnni(const QuantizedInput<int8_t>& in, const Int4Weight& w,
                                                                                                          float* y, int64_t n, int64_t m) {
  KVLAB_INT4_X8_ROWS(KVLAB_VPDPBUSD)
}

#undef KVLAB_INT4_X8_ROWS
#undef KVLAB_MADDUBS
#undef KVLAB_VPDPBUSD

// One call of either width's kernel: int8 on its VNNI or AVX2 twin, int16 on its one.
template <int MB, int NR>
static void dot_rows(bool vnni, const QuantizedInput<int8_t>& in, const Int4Weight& w, float* y, int64_t n, int64_t m) {
  if (vnni)
    dot_rows_int4_x8_vnni<MB, NR>(in, w, y, n, m);
  else
    dot_rows_int4_x8_avx2<MB, NR>(in, w, y, n, m);
}

template <int MB, int NR>
static void dot_rows(bool, const QuantizedInput<int16_t>& in, const Int4Weight& w, float* y, int64_t n, int64_t m) {
  dot_rows_int4_x16<MB, NR>(in, w, y, n, m);
}

// Rows [n0, n1) for every row of x: batch 1 takes four weight rows at a time (four independent sums),
// larger batches one weight row against up to four rows of x.
template <typename T>
static void gemv_int4_xq_rows_simd(bool vnni, const QuantizedInput<T>& in, const Int4Weight& w, float* y, int64_t M, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (M == 1)
    for (; n + 4 <= n1; n += 4) dot_rows<1, 4>(vnni, in, w, y, n, 0);
  for (; n < n1; ++n) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) dot_rows<4, 1>(vnni, in, w, y, n, m);
    if (M - m == 3) dot_rows<3, 1>(vnni, in, w, y, n, m);
    if (M - m == 2) dot_rows<2, 1>(vnni, in, w, y, n, m);
    if (M - m == 1) dot_rows<1, 1>(vnni, in, w, y, n, m);
  }
}

// The rows of x w^T with x quantized by quantize_input, on the chosen path, for matvec.h.
template <typename T>
static auto quantized_x_rows(const Int4Weight& w, const QuantizedInput<T>& in) {
  return [w, &in](Isa isa, const float*, float* yp, int64_t M, int64_t n0, int64_t n1) {
    if (isa == Isa::scalar)
      gemv_int4_xq_rows_scalar(in, w, yp, M, n0, n1);
    else
      gemv_int4_xq_rows_simd(isa == Isa::avx512 && has_avx512_vnni(), in, w, yp, M, n0, n1);
  };
}

template <typename T>
static at::Tensor linear_quantized(const char* op, const at::Tensor& x, const Int4Weight& w) {
  const QuantizedInput<T> in = quantize_input<T>(x, w.Kp, w.groupsize, true);
  return matvec(op, x, w.N, x.size(-1), quantized_x_rows(w, in));
}

template <typename T>
static at::Tensor gated_quantized(const char* op, const at::Tensor& x, const Int4Weight& gate, const Int4Weight& up) {
  const QuantizedInput<T> in = quantize_input<T>(x, gate.Kp, gate.groupsize, true);
  return gated_matvec(op, x, gate.N, x.size(-1), quantized_x_rows(gate, in), quantized_x_rows(up, in));
}

at::Tensor linear_int4_quantized_x(const char* op, const at::Tensor& x, const Int4Weight& w, int64_t bits) {
  return bits == 16 ? linear_quantized<int16_t>(op, x, w) : linear_quantized<int8_t>(op, x, w);
}

at::Tensor gated_int4_quantized_x(const char* op, const at::Tensor& x, const Int4Weight& gate, const Int4Weight& up, int64_t bits) {
  return bits == 16 ? gated_quantized<int16_t>(op, x, gate, up) : gated_quantized<int8_t>(op, x, gate, up);
}

}  // namespace kvlab
