// int4 products in a tiled layout, x rounded to int16 per block of 32 inputs (int4.h has the codes' meaning
// and the rounding): kvlab's default int4 decode path.
//
// The plain layout (gemv_int4_xq.cpp) sums each weight row's block across vector lanes, so every row pays a
// conversion, a scale and a multiply-add per block. Here 16 weight rows form a tile and each 32-bit lane holds
// one row: per block of 32 inputs the tile's 512 codes take 16 pair-products of 16-bit integers (AVX512-VNNI's
// vpdpwssd, or AVX2's vpmaddwd and an add on each half), then one conversion and one multiply-add for all 16
// rows. A tile's block is 256 bytes: four chunks of 64, chunk c holding inputs 8c to 8c + 7 of every row. A
// chunk's low nibbles widen (vpunpcklbw, vpunpckhbw) to the row-lanes' input pairs (8c, 8c+1) and (8c+2, 8c+3),
// its high nibbles to (8c+4, 8c+5) and (8c+6, 8c+7); `tiled_position` says where each code goes. The same bytes
// serve both widths: a 64-byte chunk's first 32 bytes are rows 0-7 (AVX2's first half), the rest rows 8-15.
// Scales and offsets are float16 (llama.cpp Q4_1's numerics: kvlab.quantize rounds them so), tiled
// [tiles, G, 16]: one vector per tile and group, half the bytes of float32 (0.625 bytes a weight at g32).
#include <torch/library.h>

#include "int4.h"

namespace kvlab {

constexpr int64_t kTile = 16;             // weight rows per tile: one per 32-bit lane of a 512-bit vector
constexpr int64_t kTileBlockBytes = 256;  // a tile's 16 rows x 32 codes, two per byte

// Where code (row r of its tile, input i of its block of 32) sits in the tile's block: byte and nibble (1: high).
inline std::pair<int64_t, int> tiled_position(int64_t r, int64_t i) {
  const int64_t chunk = i / 8, pair = i % 8 / 2, lane = r % 4, quarter = r / 4;
  return {64 * chunk + 16 * quarter + 8 * (pair % 2) + 2 * lane + i % 2, static_cast<int>(pair / 2)};
}

struct TiledInt4 {
  const uint8_t* codes;  // [T, blocks * 256]
  const at::Half* scales;   // [T, G, 16]
  const at::Half* offsets;  // [T, G, 16]
  int64_t N, Kp, G, groupsize;
};

static TiledInt4 tiled_weight(const char* op, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, int64_t N, int64_t groupsize) {
  TORCH_CHECK(groupsize == 32 || groupsize == 64 || groupsize == 128, op, ": group size must be 32, 64 or 128, got ", groupsize);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous() && codes.size(1) % kTileBlockBytes == 0, op,
              " takes contiguous uint8 [tiles, blocks * 256] codes (kvlab::int4_tile's)");
  const int64_t T = codes.size(0), Kp = codes.size(1) / kTileBlockBytes * 32;
  TORCH_CHECK(N > 0 && (N + kTile - 1) / kTile == T, op, ": ", T, " tiles do not hold ", N, " rows");
  TORCH_CHECK(Kp % groupsize == 0, op, ": rows of ", Kp, " codes are not whole groups of ", groupsize);
  for (const at::Tensor* t : {&scales, &offsets})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->sizes() == at::IntArrayRef({T, Kp / groupsize, kTile}), op,
                ": scales and offsets must be contiguous float16 [", T, ", ", Kp / groupsize, ", 16] (kvlab.kernels.tile_rows'), got ",
                t->scalar_type(), " ", t->sizes());
  return {codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), offsets.data_ptr<at::Half>(), N, Kp, Kp / groupsize, groupsize};
}

// Plain codes [N, Kp / 2] (int4.h's: the even input in the high nibble) -> tiled [T, blocks * 256]; rows past N are zeros.
at::Tensor int4_tile(const at::Tensor& codes) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.size(1) % 16 == 0, "kvlab::int4_tile takes uint8 [N, Kp / 2] codes, Kp a multiple of 32");
  const at::Tensor plain = codes.contiguous();
  const int64_t N = plain.size(0), Kp = 2 * plain.size(1), blocks = Kp / 32, T = (N + kTile - 1) / kTile;
  at::Tensor tiled = at::zeros({T, blocks * kTileBlockBytes}, plain.options());
  const uint8_t* src = plain.data_ptr<uint8_t>();
  uint8_t* dst = tiled.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < Kp; ++k) {
      const uint8_t byte = src[n * (Kp / 2) + k / 2], code = k % 2 == 0 ? byte >> 4 : byte & 15;
      const auto [at, high] = tiled_position(n % kTile, k % 32);
      dst[(n / kTile * blocks + k / 32) * kTileBlockBytes + at] |= high ? code << 4 : code;
    }
  return tiled;
}

// The reference: each code read back through tiled_position, block sums in int32, as the SIMD paths take them.
static void tiles_scalar(const QuantizedInput<int16_t>& in, const TiledInt4& w, float* y, int64_t M, int64_t n0, int64_t n1) {
  const int64_t blocks = w.Kp / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t t = n / kTile, r = n % kTile;
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t dot = 0;
        for (int64_t i = 0; i < 32; ++i) {
          const auto [at, high] = tiled_position(r, i);
          const uint8_t byte = w.codes[(t * blocks + b) * kTileBlockBytes + at];
          dot += (high ? byte >> 4 : byte & 15) * in.codes[m * w.Kp + 32 * b + i];
        }
        acc += static_cast<float>(dot) * (static_cast<float>(w.scales[(t * w.G + 32 * b / w.groupsize) * kTile + r]) * in.steps[m * blocks + b]);
      }
      for (int64_t g = 0; g < w.G; ++g) acc += static_cast<float>(w.offsets[(t * w.G + g) * kTile + r]) * in.group_sums[m * w.G + g];
      y[m * w.N + n] = acc;
    }
  }
}

// Tiles [t0, t1) against MB rows of x from m, 16 rows a vector: per block, the 4 chunks' nibbles widened to
// 16-bit lanes and pair-multiplied with x's input pairs (a 32-bit broadcast) into two int32 sums; their total
// converted and scaled by the tile's scales times the block's step.
template <int MB>
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vnni"))) static void tiles_vnni(const QuantizedInput<int16_t>& in, const TiledInt4& w, float* y,
                                                                                         int64_t m, int64_t t0, int64_t t1) {
  const int64_t blocks = w.Kp / 32;
  const __m512i low_nibble = _mm512_set1_epi8(15), zero = _mm512_setzero_si512();
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[MB];
    for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
    const uint8_t* codes = w.codes + t * blocks * kTileBlockBytes;
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i lo[4], hi[4];
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(codes + b * kTileBlockBytes + 64 * c);
        lo[c] = _mm512_and_si512(v, low_nibble);
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibble);
      }
      const __m512 scale = load16(w.scales + (t * w.G + 32 * b / w.groupsize) * kTile);
      for (int i = 0; i < MB; ++i) {
        const int32_t* pairs = reinterpret_cast<const int32_t*>(in.codes.data() + (m + i) * w.Kp + 32 * b);
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
          s0 = _mm512_dpwssd_epi32(s0, _mm512_unpacklo_epi8(lo[c], zero), _mm512_set1_epi32(pairs[4 * c]));
          s1 = _mm512_dpwssd_epi32(s1, _mm512_unpackhi_epi8(lo[c], zero), _mm512_set1_epi32(pairs[4 * c + 1]));
          s0 = _mm512_dpwssd_epi32(s0, _mm512_unpacklo_epi8(hi[c], zero), _mm512_set1_epi32(pairs[4 * c + 2]));
          s1 = _mm512_dpwssd_epi32(s1, _mm512_unpackhi_epi8(hi[c], zero), _mm512_set1_epi32(pairs[4 * c + 3]));
        }
        const __m512 step = _mm512_set1_ps(in.steps[(m + i) * blocks + b]);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_mul_ps(scale, step), acc[i]);
      }
    }
    const int64_t rows = std::min(kTile, w.N - t * kTile);
    for (int i = 0; i < MB; ++i) {
      for (int64_t g = 0; g < w.G; ++g)
        acc[i] = _mm512_fmadd_ps(load16(w.offsets + (t * w.G + g) * kTile), _mm512_set1_ps(in.group_sums[(m + i) * w.G + g]), acc[i]);
      _mm512_mask_storeu_ps(y + (m + i) * w.N + t * kTile, static_cast<__mmask16>((1u << rows) - 1), acc[i]);
    }
  }
}

// The AVX2 twin, a tile's rows 0-7 (each chunk's first 32 bytes) then rows 8-15, so that only one half's
// accumulators are live (AVX2 has 16 registers): per chunk, its nibbles widened to four vectors of 16-bit lanes,
// pair-multiplied (vpmaddwd) with each row of x's input pairs into one int32 sum per row of x, the same exact
// integers the VNNI path sums; a row of x's block total is then converted and scaled as there.
template <int MB>
__attribute__((target("avx2,fma,f16c"))) static void tiles_avx2(const QuantizedInput<int16_t>& in, const TiledInt4& w, float* y, int64_t m, int64_t t0, int64_t t1) {
  const int64_t blocks = w.Kp / 32;
  const __m256i low_nibble = _mm256_set1_epi8(15), zero = _mm256_setzero_si256();
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* codes = w.codes + t * blocks * kTileBlockBytes;
    const int64_t rows = std::min(kTile, w.N - t * kTile);
    for (int h = 0; h < 2 && 8 * h < rows; ++h) {
      __m256 acc[MB];
      KVLAB_ROWS_UNROLLED
      for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        __m256i sum[MB];
        KVLAB_ROWS_UNROLLED
        for (int i = 0; i < MB; ++i) sum[i] = zero;
#pragma GCC unroll 1  // a chunk at a time: four chunks' nibbles at once would not fit the registers
        for (int c = 0; c < 4; ++c) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b * kTileBlockBytes + 64 * c + 32 * h));
          const __m256i lo = _mm256_and_si256(v, low_nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibble);
          const __m256i nibbles[4] = {_mm256_unpacklo_epi8(lo, zero), _mm256_unpackhi_epi8(lo, zero), _mm256_unpacklo_epi8(hi, zero),
                                      _mm256_unpackhi_epi8(hi, zero)};
          KVLAB_ROWS_UNROLLED
          for (int i = 0; i < MB; ++i) {
            const int32_t* pairs = reinterpret_cast<const int32_t*>(in.codes.data() + (m + i) * w.Kp + 32 * b) + 4 * c;
            KVLAB_ROWS_UNROLLED
            for (int j = 0; j < 4; ++j) sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(nibbles[j], _mm256_set1_epi32(pairs[j])));
          }
        }
        const __m256 scale = load8(w.scales + (t * w.G + 32 * b / w.groupsize) * kTile + 8 * h);
        KVLAB_ROWS_UNROLLED
        for (int i = 0; i < MB; ++i)
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i]), _mm256_mul_ps(scale, _mm256_set1_ps(in.steps[(m + i) * blocks + b])), acc[i]);
      }
      const __m256i kept = first_lanes8(rows - 8 * h);
      KVLAB_ROWS_UNROLLED
      for (int i = 0; i < MB; ++i) {
        for (int64_t g = 0; g < w.G; ++g)
          acc[i] = _mm256_fmadd_ps(load8(w.offsets + (t * w.G + g) * kTile + 8 * h), _mm256_set1_ps(in.group_sums[(m + i) * w.G + g]), acc[i]);
        _mm256_maskstore_ps(y + (m + i) * w.N + t * kTile + 8 * h, kept, acc[i]);
      }
    }
  }
}

// Rows [n0, n1) (whole tiles, but for the weight's last) for every row of x, up to four rows of x per pass.
static void tiles_simd(bool vnni, const QuantizedInput<int16_t>& in, const TiledInt4& w, float* y, int64_t M, int64_t n0, int64_t n1) {
  const int64_t t0 = n0 / kTile, t1 = (n1 + kTile - 1) / kTile;
  for (int64_t m = 0; m < M;) {
    const int64_t rows = std::min<int64_t>(M - m, 4);
    auto pass = [&](auto mb) {
      if (vnni)
        tiles_vnni<decltype(mb)::value>(in, w, y, m, t0, t1);
      else
        tiles_avx2<decltype(mb)::value>(in, w, y, m, t0, t1);
    };
    if (rows == 4) pass(std::integral_constant<int, 4>());
    if (rows == 3) pass(std::integral_constant<int, 3>());
    if (rows == 2) pass(std::integral_constant<int, 2>());
    if (rows == 1) pass(std::integral_constant<int, 1>());
    m += rows;
  }
}

static auto tiled_rows(const TiledInt4& w, const QuantizedInput<int16_t>& in) {
  return [w, &in](Isa isa, const float*, float* yp, int64_t M, int64_t n0, int64_t n1) {
    if (isa == Isa::scalar)
      tiles_scalar(in, w, yp, M, n0, n1);
    else
      tiles_simd(isa == Isa::avx512 && has_avx512_vnni(), in, w, yp, M, n0, n1);
  };
}

static void check_tiled_input(const char* op, const at::Tensor& x, int64_t Kp) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) <= Kp, op, ": x must be float32 with at most ", Kp, " features");
}

// y [..., N] = x [..., K] @ w^T + bias for w tiled by int4_tile (scales and offsets tiled alike), x in int16.
at::Tensor linear_int4_tiled(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, int64_t N, int64_t groupsize,
                             const c10::optional<at::Tensor>& bias) {
  const char* op = "kvlab::linear_int4_tiled";
  const TiledInt4 w = tiled_weight(op, codes, scales, offsets, N, groupsize);
  check_tiled_input(op, x, w.Kp);
  const QuantizedInput<int16_t> in = quantize_input<int16_t>(x, w.Kp, groupsize, false);
  at::Tensor y = matvec(op, x, N, x.size(-1), tiled_rows(w, in), kTile);
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// silu(x gate^T) * (x up^T), both weights tiled with the same shape and group size.
at::Tensor gated_int4_tiled(const at::Tensor& x, const at::Tensor& c_gate, const at::Tensor& s_gate, const at::Tensor& o_gate, const at::Tensor& c_up,
                            const at::Tensor& s_up, const at::Tensor& o_up, int64_t N, int64_t groupsize) {
  const char* op = "kvlab::gated_int4_tiled";
  const TiledInt4 gate = tiled_weight(op, c_gate, s_gate, o_gate, N, groupsize), up = tiled_weight(op, c_up, s_up, o_up, N, groupsize);
  TORCH_CHECK(c_gate.sizes() == c_up.sizes(), op, ": gate ", c_gate.sizes(), " and up ", c_up.sizes(), " differ");
  check_tiled_input(op, x, gate.Kp);
  const QuantizedInput<int16_t> in = quantize_input<int16_t>(x, gate.Kp, groupsize, false);
  return gated_matvec(op, x, N, x.size(-1), tiled_rows(gate, in), tiled_rows(up, in), kTile);
}

}  // namespace kvlab

TORCH_LIBRARY_FRAGMENT(kvlab, m) {
  m.def("int4_tile(Tensor codes) -> Tensor");
  m.def("linear_int4_tiled(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int n, int groupsize, Tensor? bias) -> Tensor");
  m.def("gated_int4_tiled(Tensor x, Tensor c_gate, Tensor s_gate, Tensor o_gate, Tensor c_up, Tensor s_up, Tensor o_up, int n, int groupsize) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvlab, CPU, m) {
  m.impl("int4_tile", &kvlab::int4_tile);
  m.impl("linear_int4_tiled", &kvlab::linear_int4_tiled);
  m.impl("gated_int4_tiled", &kvlab::gated_int4_tiled);
}
