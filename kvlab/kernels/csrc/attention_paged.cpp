// Decode attention straight over a paged block pool (kvlab/block_tables.py), with KV-Compress's metric: the same
// attention as attend_fp32 (softmax over the filled slots no later than the query, h_kv = h / (H / H_kv)), where KV
// head (b, h)'s slots are the blocks its row of the block table lists, read in place: no dense view is gathered.
//
// Each (sequence, KV head, run of blocks) is one task; each block is one run of attend_chunk (attention.h), its
// partials merged as attend_fp32's chunks are. With a metric, each block also keeps its rows' exponentials, and a
// last pass turns them into each slot's probabilities, summed over the KV head's query rows (metric 1) or their
// squares summed (metric 2, KV-Compress's): what PagedKV.observe adds to the pool's metrics.
#include <torch/library.h>

#include <tuple>

#include "attention.h"

namespace kvlab {

// The metric [B, H_kv, W x block] from the blocks' exponentials p_raw [B, H_kv, W, R, block] and partials m, l
// [B, H_kv, W, R]: p = p_raw e^(m_w - M) / L per row (M, L the row's over every block), then summed over the rows,
// squared first for metric 2. A row that sees no slot adds nothing.
static at::Tensor paged_metric(const at::Tensor& p_raw, const at::Tensor& m, const at::Tensor& l, int64_t metric) {
  const int64_t heads = m.size(0) * m.size(1), W = m.size(2), R = m.size(3), bs = p_raw.size(4);
  at::Tensor out = at::zeros({m.size(0), m.size(1), W * bs}, m.options());
  const float *pp = p_raw.data_ptr<float>(), *mp = m.data_ptr<float>(), *lp = l.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, heads, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t r = 0; r < R; ++r) {
        float M = kNegInf, L = 0.f;
        for (int64_t w = 0; w < W; ++w) M = std::max(M, mp[(h * W + w) * R + r]);
        if (M == kNegInf) continue;
        for (int64_t w = 0; w < W; ++w) L += std::exp(mp[(h * W + w) * R + r] - M) * lp[(h * W + w) * R + r];
        for (int64_t w = 0; w < W; ++w) {
          const float mw = mp[(h * W + w) * R + r];
          if (mw == kNegInf) continue;
          const float weight = std::exp(mw - M) / L;
          const float* raw = pp + ((h * W + w) * R + r) * bs;
          float* slots = op + (h * W + w) * bs;
          for (int64_t o = 0; o < bs; ++o) {
            const float p = raw[o] * weight;
            slots[o] += metric == 2 ? p * p : p;
          }
        }
      }
  });
  return out;
}

// y [B, H, T, D] for q [B, H, T, D] float32 over the pool k, v [blocks, block, D] (float32, float16 or bfloat16,
// both alike) with positions pos [blocks, block] (int64, -1 an empty slot): KV head (b, h) attends the blocks
// table[b, h, :] (int64 [B, H_kv, W], a negative entry no block) at query_pos [B, T]. The second output is the
// metric [B, H_kv, W x block] (metric 1: probabilities summed over the KV head's query rows; 2: their squares; 0:
// an empty tensor). A query that sees no slot gets zeros and adds nothing.
std::tuple<at::Tensor, at::Tensor> attend_paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos, const at::Tensor& table,
                                                const at::Tensor& query_pos, int64_t metric) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 3 && v.sizes() == k.sizes() && pos.dim() == 2 && table.dim() == 3,
              "kvlab::attend_paged: q [B, H, T, D], k and v [blocks, block, D], pos [blocks, block], table [B, H_kv, W]");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), NB = k.size(0), bs = k.size(1), Hkv = table.size(1), W = table.size(2);
  const bool kv_dtype = k.scalar_type() == at::kFloat || k.scalar_type() == at::kHalf || k.scalar_type() == at::kBFloat16;
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv_dtype && v.scalar_type() == k.scalar_type(), "kvlab::attend_paged takes float32 q, and k and v of one of float32, float16, bfloat16");
  TORCH_CHECK(k.size(2) == D && table.size(0) == B && H % Hkv == 0 && pos.size(0) == NB && pos.size(1) == bs && pos.scalar_type() == at::kLong &&
                  table.scalar_type() == at::kLong && metric >= 0 && metric <= 2,
              "kvlab::attend_paged: q ", q.sizes(), ", k ", k.sizes(), ", pos ", pos.sizes(), ", table ", table.sizes(), ", metric ", metric, " (0, 1 or 2)");
  TORCH_CHECK(query_pos.scalar_type() == at::kLong && query_pos.dim() == 2 && query_pos.size(0) == B && query_pos.size(1) == T,
              "kvlab::attend_paged: query_pos must be int64 [B, T], got ", query_pos.sizes());
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), pc = pos.contiguous(), tc = table.contiguous(), qp = query_pos.contiguous();
  const int64_t* blocks = tc.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * Hkv * W; ++i) TORCH_CHECK(blocks[i] < NB, "kvlab::attend_paged: table entry ", blocks[i], " past the pool's ", NB, " blocks");
  const int64_t G = H / Hkv, R = G * T, per_task = std::max<int64_t>(1, kChunk / bs), tasks = (W + per_task - 1) / per_task;
  const std::vector<int64_t> row_pos = row_positions(qp, R);
  at::Tensor m = at::full({B, Hkv, W, R}, kNegInf, q.options()), l = at::zeros_like(m), acc = at::zeros({B, Hkv, W, R, D}, q.options());
  at::Tensor p_raw = metric ? at::empty({B, Hkv, W, R, bs}, q.options()) : at::Tensor();
  const Isa isa = kernel_isa();
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  auto run = [&](const auto* keys, const auto* values) {  // float, at::Half or at::BFloat16
    at::parallel_for(0, B * Hkv * tasks, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t b = task / (Hkv * tasks), head = task / tasks, w1 = std::min(W, (task % tasks + 1) * per_task);
        for (int64_t w = task % tasks * per_task; w < w1; ++w) {
          const int64_t block = blocks[head * W + w], i = head * W + w;
          if (block < 0) continue;
          attend_chunk(isa, qc.data_ptr<float>() + head * R * D, keys + block * bs * D, values + block * bs * D, pc.data_ptr<int64_t>() + block * bs,
                       row_pos.data() + b * R, R, bs, D, scale, m.data_ptr<float>() + i * R, l.data_ptr<float>() + i * R, acc.data_ptr<float>() + i * R * D,
                       metric ? p_raw.data_ptr<float>() + i * R * bs : nullptr);
        }
      }
    });
  };
  if (kc.scalar_type() == at::kHalf) run(kc.data_ptr<at::Half>(), vc.data_ptr<at::Half>());
  if (kc.scalar_type() == at::kBFloat16) run(kc.data_ptr<at::BFloat16>(), vc.data_ptr<at::BFloat16>());
  if (kc.scalar_type() == at::kFloat) run(kc.data_ptr<float>(), vc.data_ptr<float>());
  at::Tensor y = merge(m, l, acc).view({B, H, T, D});
  return {y, metric ? paged_metric(p_raw, m, l, metric) : at::empty({0}, q.options())};
}
}  // namespace kvlab

TORCH_LIBRARY_FRAGMENT(kvlab, m) {
  m.def("attend_paged(Tensor q, Tensor k, Tensor v, Tensor pos, Tensor table, Tensor query_pos, int metric) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvlab, CPU, m) { m.impl("attend_paged", &kvlab::attend_paged); }
