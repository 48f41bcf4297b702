// Decode attention over a cache's slots, the softmax fused: y[b, h, t] = sum_j p_j v[b, h_kv, j] with
// p = softmax_j(q[b, h, t] . k[b, h_kv, j] / sqrt(D)) over the slots j whose position is filled (>= 0)
// and no later than the query's (key_pos [B, S] shared by the KV heads, or [B, H_kv, S] per head, -1 for
// an empty slot), h_kv = h / (H / H_kv). The same mask as kvlab.model.attention_mask, so it serves the
// static cache and every compressed cache's slots alike. Keys and values are float32, float16 or bfloat16
// (16-bit caches: half the bytes, widened to float32 as they load); the arithmetic is float32.
//
// Each (sequence, KV head, run of kChunk slots it holds) is one task: the query heads sharing the KV head read
// each key and value row once. A task keeps its rows' maximum score, sum of exponentials and weighted
// sum of values (flash-decoding's partials); one pass merges the tasks' partials.
#include <torch/library.h>

#include "attention.h"

namespace kvlab {

// The rows of KV head (b, h)'s slots: keys and values from `first_row` of k and v, positions from `positions`,
// `count` of them (the rest of the head's slots are empty).
struct HeadSlots {
  int64_t first_row, count;
  const int64_t* positions;
};

// y [B, H, T, D] for q [B, H, T, D] float32 over the slots `head_slots(b, h)` of each of the H_kv KV heads of
// k and v ([rows, D] after the head's first row, float32, float16 or bfloat16, both alike). The tasks are each head's
// runs of kChunk slots, only as many as it holds, shared evenly by the threads (a compact store's heads hold
// uneven counts: split by head, one thread would get the long ones). A query that sees no slot gets zeros.
template <typename HeadSlotsOf>
static at::Tensor attend_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& query_pos, int64_t Hkv,
                               HeadSlotsOf head_slots) {
  const bool kv_dtype = k.scalar_type() == at::kFloat || k.scalar_type() == at::kHalf || k.scalar_type() == at::kBFloat16;
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv_dtype && v.scalar_type() == k.scalar_type(), "kvlab attention takes float32 q, and k and v of one of float32, float16, bfloat16");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  TORCH_CHECK(k.size(-1) == D && H % Hkv == 0, "kvlab attention: q ", q.sizes(), " does not match k ", k.sizes());
  TORCH_CHECK(query_pos.scalar_type() == at::kLong && query_pos.dim() == 2 && query_pos.size(0) == B && query_pos.size(1) == T,
              "kvlab attention: query_pos must be int64 [B, T], got ", query_pos.sizes());
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), qp = query_pos.contiguous();
  const int64_t G = H / Hkv, R = G * T;
  std::vector<HeadSlots> slots;
  std::vector<int64_t> first{0}, task_head;  // head i's tasks are first[i] .. first[i + 1] - 1
  for (int64_t head = 0; head < B * Hkv; ++head) {
    slots.push_back(head_slots(head / Hkv, head % Hkv));
    first.push_back(first.back() + (slots.back().count + kChunk - 1) / kChunk);
    task_head.resize(first.back(), head);
  }
  const int64_t tasks = first.back();
  at::Tensor m = at::full({tasks, R}, kNegInf, q.options()), l = at::zeros_like(m), acc = at::zeros({tasks, R, D}, q.options());
  const std::vector<int64_t> row_pos = row_positions(qp, R);
  const Isa isa = kernel_isa();
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  auto run = [&](const auto* keys, const auto* values) {  // float, at::Half or at::BFloat16
    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t head = task_head[task], j0 = (task - first[head]) * kChunk;
        const HeadSlots& own = slots[head];
        const int64_t n = std::min(kChunk, own.count - j0), row = (own.first_row + j0) * D;
        attend_chunk(isa, qc.data_ptr<float>() + head * R * D, keys + row, values + row, own.positions + j0, row_pos.data() + head / Hkv * R, R, n, D,
                     scale, m.data_ptr<float>() + task * R, l.data_ptr<float>() + task * R, acc.data_ptr<float>() + task * R * D);
      }
    });
  };
  if (kc.scalar_type() == at::kHalf) run(kc.data_ptr<at::Half>(), vc.data_ptr<at::Half>());
  if (kc.scalar_type() == at::kBFloat16) run(kc.data_ptr<at::BFloat16>(), vc.data_ptr<at::BFloat16>());
  if (kc.scalar_type() == at::kFloat) run(kc.data_ptr<float>(), vc.data_ptr<float>());
  return merge_runs(m, l, acc, first, R, D).view({B, H, T, D});
}

// y [B, H, T, D] for q [B, H, T, D] float32, k and v [B, H_kv, S, D] float32, float16 or bfloat16 (both alike), key_pos
// [B, S] or [B, H_kv, S] and query_pos [B, T] int64. A query that sees no slot gets zeros, as torch's attention gives it.
at::Tensor attend_fp32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_pos, const at::Tensor& query_pos) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(), "kvlab::attend_fp32: q [B, H, T, D], k and v [B, H_kv, S, D]");
  const int64_t B = q.size(0), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B, "kvlab::attend_fp32: q ", q.sizes(), " does not match k ", k.sizes());
  const bool per_head = key_pos.dim() == 3;
  TORCH_CHECK(key_pos.scalar_type() == at::kLong && key_pos.size(0) == B && key_pos.size(-1) == S && (!per_head || key_pos.size(1) == Hkv),
              "kvlab::attend_fp32: key_pos must be int64 [B, S] or [B, H_kv, S], got ", key_pos.sizes());
  const at::Tensor kp = key_pos.contiguous();
  const int64_t* pos = kp.data_ptr<int64_t>();
  return attend_heads(q, k, v, query_pos, Hkv, [&](int64_t b, int64_t h) {
    return HeadSlots{(b * Hkv + h) * S, S, pos + (per_head ? b * Hkv + h : b) * S};
  });
}

// The same attention over a compact store: KV head (b, h) holds `lengths[b, h]` slots, rows offsets[b, h] ..
// offsets[b, h] + lengths[b, h] - 1 of k and v [N, D], positions key_pos[b, h, :lengths[b, h]] (key_pos [B, H_kv, S],
// S >= every length); offsets and lengths int64 [B, H_kv]. No head's slots are copied into a dense view.
at::Tensor attend_ragged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_pos, const at::Tensor& offsets,
                         const at::Tensor& lengths, const at::Tensor& query_pos) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 2 && v.sizes() == k.sizes() && key_pos.dim() == 3, "kvlab::attend_ragged: q [B, H, T, D], k and v [N, D], key_pos [B, H_kv, S]");
  const int64_t B = key_pos.size(0), Hkv = key_pos.size(1), S = key_pos.size(2), N = k.size(0);
  const bool layout = offsets.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && key_pos.scalar_type() == at::kLong;
  TORCH_CHECK(layout && q.size(0) == B && offsets.sizes() == lengths.sizes() && offsets.dim() == 2 && offsets.size(0) == B && offsets.size(1) == Hkv,
              "kvlab::attend_ragged: int64 key_pos [B, H_kv, S], offsets and lengths [B, H_kv]; got ", key_pos.sizes(), ", ", offsets.sizes(), ", ", lengths.sizes());
  const at::Tensor kp = key_pos.contiguous(), off = offsets.contiguous(), len = lengths.contiguous();
  const int64_t *pos = kp.data_ptr<int64_t>(), *first = off.data_ptr<int64_t>(), *count = len.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * Hkv; ++i)
    TORCH_CHECK(first[i] >= 0 && count[i] >= 0 && count[i] <= S && first[i] + count[i] <= N, "kvlab::attend_ragged: head ", i, " holds rows ", first[i], " + ",
                count[i], " of ", N, " (at most ", S, ")");
  return attend_heads(q, k, v, query_pos, Hkv, [&](int64_t b, int64_t h) {
    const int64_t head = b * Hkv + h;
    return HeadSlots{first[head], count[head], pos + head * S};
  });
}
}  // namespace kvlab

TORCH_LIBRARY_FRAGMENT(kvlab, m) {
  m.def("attend_fp32(Tensor q, Tensor k, Tensor v, Tensor key_pos, Tensor query_pos) -> Tensor");
  m.def("attend_ragged(Tensor q, Tensor k, Tensor v, Tensor key_pos, Tensor offsets, Tensor lengths, Tensor query_pos) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvlab, CPU, m) {
  m.impl("attend_fp32", &kvlab::attend_fp32);
  m.impl("attend_ragged", &kvlab::attend_ragged);
}
