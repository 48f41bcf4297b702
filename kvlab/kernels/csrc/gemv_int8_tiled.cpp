// Products with int8 weights for many rows of x (a prompt's or a chunk's): y[m, n] = scales[n] * sum_k x[m, k] q[n, k]
// (+ bias[n]), q int8 row-major [N, K] with one float scale per output row (kvlab.quantize's int8), x rounded to int16
// per block of 32 inputs (xq.h: each input within 2^-16 of its block's max |x|).
//
// gemv_int8.cpp widens every code to float32 and multiplies it with x in float32: the right trade for a decode step,
// which streams the weight once, but a prompt's rows would pay the widening again for every few rows. Here each
// thread copies its output rows' codes, 16 rows to a tile, into a layout where each 32-bit lane holds one weight row
// and per block of 32 inputs the tile's 512 codes take 16 pair-products of 16-bit integers (AVX512-VNNI's vpdpwssd,
// or AVX2's vpmaddwd and an add on each half of the tile), then one conversion and one multiply-add by the block's
// step for all 16 rows. A tile's block is 512 bytes: 32 for each input pair (2p, 2p + 1), row r's two codes at
// 2r and 2r + 1, so one sign extension (vpmovsxbw) of 32 bytes gives the 16 rows' pairs (16 bytes, 8 rows, on AVX2).
// The copy is made per call (it reads each code once, against the many rows of x that reuse it from cache): no
// second copy of the weight is kept.
#include <torch/library.h>

#include <cstring>

#include "int8.h"
#include "matvec.h"
#include "xq.h"

namespace kvlab {

constexpr int64_t kRowsPerTile = 16;     // weight rows per tile: one per 32-bit lane of a 512-bit vector
constexpr int64_t kTileBlock = 512;      // a tile's 16 rows x 32 codes

// Rows [n0, n1) of q (n0 a multiple of 16) tiled as above; inputs past K and rows past n1 are zero codes. A tile's
// block is a 16 x 16 transpose of 16-bit code pairs (row r's pair p goes to 16 p + r), copied a pair at a time.
static void tile_codes(const Int8Rows& w, int64_t n0, int64_t n1, std::vector<int8_t>& tiled) {
  const int64_t tiles = (n1 - n0 + kRowsPerTile - 1) / kRowsPerTile, blocks = w.Kp / 32, whole = w.K / 32 * 32;
  tiled.assign(tiles * blocks * kTileBlock, 0);
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t t = (n - n0) / kRowsPerTile, r = (n - n0) % kRowsPerTile;
    const int8_t* row = w.q + n * w.K;
    int8_t* dst = tiled.data() + t * blocks * kTileBlock + 2 * r;
    for (int64_t k = 0; k < whole; k += 2) std::memcpy(dst + k / 32 * kTileBlock + 16 * (k % 32), row + k, 2);
    for (int64_t k = whole; k < w.K; ++k) dst[k / 32 * kTileBlock + 16 * (k % 32 / 2 * 2) + k % 2] = row[k];
  }
}

// The reference, from the plain codes: per block an exact int32 sum, then float32 as the SIMD paths take it.
static void rows_scalar(const QuantizedInput<int16_t>& in, const Int8Rows& w, float* y, int64_t M, int64_t n0, int64_t n1) {
  const int64_t blocks = w.Kp / 32;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t dot = 0;
        for (int64_t k = 32 * b; k < std::min(32 * b + 32, w.K); ++k) dot += w.q[n * w.K + k] * in.codes[m * w.Kp + k];
        acc += static_cast<float>(dot) * in.steps[m * blocks + b];
      }
      y[m * w.N + n] = acc * w.scales[n];
    }
}

// Tiles [0, tiles) of `codes` (output rows from n0) against MB rows of x from m: per block, each input pair's 32 bytes
// widened once and pair-multiplied with every row's pair (a 32-bit broadcast), in two int32 sums per row.
template <int MB>
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vnni"))) static void tiles_vnni(const QuantizedInput<int16_t>& in, const Int8Rows& w,
                                                                                         const int8_t* codes, float* y, int64_t m, int64_t n0, int64_t tiles) {
  const int64_t blocks = w.Kp / 32;
  for (int64_t t = 0; t < tiles; ++t) {
    __m512 acc[MB];
    for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t* block = codes + (t * blocks + b) * kTileBlock;
      __m512i sums[MB];
      for (int i = 0; i < MB; ++i) sums[i] = _mm512_setzero_si512();
      for (int p = 0; p < 16; ++p) {
        const __m512i pairs = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * p)));
        for (int i = 0; i < MB; ++i) {
          const int32_t* x_pairs = reinterpret_cast<const int32_t*>(in.codes.data() + (m + i) * w.Kp + 32 * b);
          sums[i] = _mm512_dpwssd_epi32(sums[i], pairs, _mm512_set1_epi32(x_pairs[p]));
        }
      }
      for (int i = 0; i < MB; ++i) {
        const __m512 step = _mm512_set1_ps(in.steps[(m + i) * blocks + b]);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i]), step, acc[i]);
      }
    }
    const int64_t n = n0 + t * kRowsPerTile, rows = std::min(kRowsPerTile, w.N - n);
    const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
    const __m512 scale = _mm512_maskz_loadu_ps(mask, w.scales + n);
    for (int i = 0; i < MB; ++i) _mm512_mask_storeu_ps(y + (m + i) * w.N + n, mask, _mm512_mul_ps(acc[i], scale));
  }
}

// The AVX2 twin: a tile's rows 0-7 (each pair's first 16 bytes) then rows 8-15, so that only one half's accumulators
// are live (AVX2 has 16 registers), vpmaddwd and an add per pair and row of x.
template <int MB>
__attribute__((target("avx2,fma"))) static void tiles_avx2(const QuantizedInput<int16_t>& in, const Int8Rows& w, const int8_t* codes, float* y,
                                                            int64_t m, int64_t n0, int64_t tiles) {
  const int64_t blocks = w.Kp / 32;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n = n0 + t * kRowsPerTile, rows = std::min(kRowsPerTile, w.N - n);
    for (int h = 0; h < 2 && 8 * h < rows; ++h) {
      __m256 acc[MB];
      KVLAB_ROWS_UNROLLED
      for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* block = codes + (t * blocks + b) * kTileBlock + 16 * h;
        __m256i sums[MB];
        KVLAB_ROWS_UNROLLED
        for (int i = 0; i < MB; ++i) sums[i] = _mm256_setzero_si256();
#pragma GCC unroll 2  // a few pairs at a time: every pair's widened codes at once would not fit the registers
        for (int p = 0; p < 16; ++p) {
          const __m256i pairs = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 * p)));
          KVLAB_ROWS_UNROLLED
          for (int i = 0; i < MB; ++i) {
            const int32_t* x_pairs = reinterpret_cast<const int32_t*>(in.codes.data() + (m + i) * w.Kp + 32 * b);
            sums[i] = _mm256_add_epi32(sums[i], _mm256_madd_epi16(pairs, _mm256_set1_epi32(x_pairs[p])));
          }
        }
        KVLAB_ROWS_UNROLLED
        for (int i = 0; i < MB; ++i)
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i]), _mm256_set1_ps(in.steps[(m + i) * blocks + b]), acc[i]);
      }
      const __m256i kept = first_lanes8(rows - 8 * h);
      const __m256 scale = _mm256_maskload_ps(w.scales + n + 8 * h, kept);
      KVLAB_ROWS_UNROLLED
      for (int i = 0; i < MB; ++i) _mm256_maskstore_ps(y + (m + i) * w.N + n + 8 * h, kept, _mm256_mul_ps(acc[i], scale));
    }
  }
}

// Rows [n0, n1) of the output for every row of x: the codes tiled once (into this thread's buffer, reused by later
// calls: a fresh allocation's page faults cost as much as a 16-row product), then 12 rows of x per pass over them
// (4 on AVX2, whose 16 registers hold fewer sums): each widened pair serves every row of the pass.
static void rows_simd(bool vnni, const QuantizedInput<int16_t>& in, const Int8Rows& w, float* y, int64_t M, int64_t n0, int64_t n1) {
  static thread_local std::vector<int8_t> codes;
  tile_codes(w, n0, n1, codes);
  const int64_t tiles = (n1 - n0 + kRowsPerTile - 1) / kRowsPerTile;
  for (int64_t m = 0; m < M;) {
    const int64_t rows = std::min<int64_t>(M - m, vnni ? 12 : 4);
    if (vnni)
      with_rows<12>(rows, [&](auto mb) { tiles_vnni<decltype(mb)::value>(in, w, codes.data(), y, m, n0, tiles); });
    else
      with_rows<4>(rows, [&](auto mb) { tiles_avx2<decltype(mb)::value>(in, w, codes.data(), y, m, n0, tiles); });
    m += rows;
  }
}

static auto tiled_rows(const Int8Rows& w, const QuantizedInput<int16_t>& in) {
  return [w, &in](Isa isa, const float*, float* yp, int64_t M, int64_t n0, int64_t n1) {
    if (isa == Isa::scalar)
      rows_scalar(in, w, yp, M, n0, n1);
    else
      rows_simd(isa == Isa::avx512 && has_avx512_vnni(), in, w, yp, M, n0, n1);
  };
}

// y [..., N] = (x [..., K] @ q [N, K]^T) * scales [N] + bias [N], x rounded to int16 per block of 32 inputs.
at::Tensor linear_int8_tiled(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const c10::optional<at::Tensor>& bias) {
  const char* op = "kvlab::linear_int8_tiled";
  const Int8Rows w = int8_weight(op, q, scales);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) == w.K, op, ": x must be float32 with ", w.K, " features");
  const QuantizedInput<int16_t> in = quantize_input<int16_t>(x, w.Kp, 32, false);
  at::Tensor y = matvec(op, x, w.N, w.K, tiled_rows(w, in), kRowsPerTile);
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// silu(x gate^T) * (x up^T) with both weights in int8, x rounded as above.
at::Tensor gated_int8_tiled(const at::Tensor& x, const at::Tensor& q_gate, const at::Tensor& s_gate, const at::Tensor& q_up, const at::Tensor& s_up) {
  const char* op = "kvlab::gated_int8_tiled";
  TORCH_CHECK(q_gate.sizes() == q_up.sizes(), op, ": gate ", q_gate.sizes(), " and up ", q_up.sizes(), " differ");
  const Int8Rows gate = int8_weight(op, q_gate, s_gate), up = int8_weight(op, q_up, s_up);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) == gate.K, op, ": x must be float32 with ", gate.K, " features");
  const QuantizedInput<int16_t> in = quantize_input<int16_t>(x, gate.Kp, 32, false);
  return gated_matvec(op, x, gate.N, gate.K, tiled_rows(gate, in), tiled_rows(up, in), kRowsPerTile);
}

}  // namespace kvlab

TORCH_LIBRARY_FRAGMENT(kvlab, m) {
  m.def("linear_int8_tiled(Tensor x, Tensor q, Tensor scales, Tensor? bias) -> Tensor");
  m.def("gated_int8_tiled(Tensor x, Tensor q_gate, Tensor s_gate, Tensor q_up, Tensor s_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvlab, CPU, m) {
  m.impl("linear_int8_tiled", &kvlab::linear_int8_tiled);
  m.impl("gated_int8_tiled", &kvlab::gated_int8_tiled);
}
