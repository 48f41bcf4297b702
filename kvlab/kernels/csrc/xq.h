// x rounded to integers per block of 32 inputs, for the products that multiply integers (the int4 ones of
// gemv_int4_xq.cpp and gemv_int4_tiled.cpp, the int8 one of gemv_int8_tiled.cpp).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include <immintrin.h>

namespace kvlab {

// x [M, K] rounded: per block of 32 inputs, codes q = round(x / step) with step = max |x| / qmax (0 for a
// block of zeros), in natural order or, `reordered`, odd inputs first, then even ones (the order a block's
// 16 bytes of plain weight codes unpack in: low nibbles, then high); and x's exact sums per weight group.
template <typename T>
struct QuantizedInput {
  std::vector<T> codes;           // [M, Kp]
  std::vector<float> steps;       // [M, Kp / 32]
  std::vector<float> group_sums;  // [M, G]
};

// v rounded to the nearest integer, ties to even (std::nearbyint in the default rounding mode), inline:
// SSE's conversion, where nearbyint is a library call without SSE4.1, a few microseconds per call's x.
inline int round_to_int(float v) { return _mm_cvtss_si32(_mm_set_ss(v)); }

constexpr int64_t kRoundingGrain = 64;  // rows of x per task when x is rounded: a decode step's stay on one thread

template <typename T>
QuantizedInput<T> quantize_input(const at::Tensor& x, int64_t Kp, int64_t groupsize, bool reordered) {
  constexpr float qmax = std::numeric_limits<T>::max();
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const int64_t K = x.size(-1), M = xc.numel() / K, blocks = Kp / 32, G = Kp / groupsize;
  QuantizedInput<T> in{std::vector<T>(M * Kp), std::vector<float>(M * blocks), std::vector<float>(M * G, 0.f)};
  at::parallel_for(0, M, kRoundingGrain, [&](int64_t m0, int64_t m1) {  // a prefill's rows, over the cores
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < blocks; ++b) {
        float v[32], amax = 0.f;
        float& group_sum = in.group_sums[m * G + b * 32 / groupsize];  // a group is whole blocks
        for (int64_t i = 0; i < 32; ++i) {
          v[i] = b * 32 + i < K ? xp[m * K + b * 32 + i] : 0.f;
          amax = std::max(amax, std::fabs(v[i]));
          group_sum += v[i];
        }
        const float inverse = amax > 0.f ? qmax / amax : 0.f;
        in.steps[m * blocks + b] = amax / qmax;
        for (int64_t i = 0; i < 32; ++i) {
          const int64_t at = !reordered ? i : i % 2 == 1 ? i / 2 : 16 + i / 2;
          in.codes[m * Kp + b * 32 + at] = static_cast<T>(round_to_int(v[i] * inverse));
        }
      }
  });
  return in;
}

}  // namespace kvlab
