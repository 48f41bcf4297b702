// An int8 weight as kvlab.quantize's int8 Linear holds it (q [N, K] row-major, one float32 scale per output row),
// checked once for the ops that read it (gemv_int8.cpp, gemv_int8_tiled.cpp).
#pragma once
#include <ATen/ATen.h>

namespace kvlab {

struct Int8Rows {
  const int8_t* q;      // [N, K]
  const float* scales;  // [N]
  int64_t N, K, Kp;     // Kp: K rounded up to whole blocks of 32
};

inline Int8Rows int8_weight(const char* op, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(), op, " takes contiguous int8 [N, K] weights");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == q.size(0) && scales.is_contiguous(), op, ": ", q.size(0),
              " weight rows need as many contiguous float32 scales, got ", scales.sizes());
  return {q.data_ptr<int8_t>(), scales.data_ptr<float>(), q.size(0), q.size(1), (q.size(1) + 31) / 32 * 32};
}

}  // namespace kvlab
