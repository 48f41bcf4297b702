// Prefill attention, flash style: y[b, h, t] = sum_j p_j v[b, h_kv, j] with p = softmax_j(q[b, h, t] . k[b, h_kv, j]
// / sqrt(D)) over the slots j whose position is filled (>= 0) and no later than the query's, h_kv = h / (H / H_kv),
// and each query's log-sum-exp of its scaled scores. The mask of kvlab.model.attention_mask, with a padding query
// (position -1) seeing every filled slot (a finite output nothing keeps), so one op serves a prompt over itself
// (causal), a chunk over what a cache holds plus itself, and a compressed cache's slots in any order.
//
// No [T, S] matrix: each task is (sequence, KV head, block of kQueryBlock query times), its rows the times of
// every query head sharing the KV head (the heads' queries read each key and value block once). The task walks
// the keys kKeyBlock at a time with an online softmax (running maximum, sum and output per row), skipping a
// block that no row sees, masking only a block that some row sees in part. Keys and values are float32,
// float16 or bfloat16 (a 16-bit cache widened as it loads); the arithmetic is float32. An empty slot's values
// are never read (they need not be finite).
#include <torch/library.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "isa.h"

namespace kvlab {

constexpr int64_t kQueryBlock = 32;  // query times per task: a 512-token prompt gives 16 tasks per KV head
constexpr int64_t kKeyBlock = 64;    // keys per step of the online softmax
constexpr float kMasked = -std::numeric_limits<float>::infinity();
constexpr int32_t kEmpty = std::numeric_limits<int32_t>::max();  // an empty slot's (or the padding's) position
constexpr int32_t kSeesAll = kEmpty - 1;                          // a padding query's position

// One task's state: R rows of D (queries scaled by 1/sqrt(D), outputs), each row's position, maximum and sum.
struct Rows {
  int64_t R, D;
  std::vector<float> q, out, m, l, alpha, s;  // s [R, kKeyBlock]: a key block's probabilities
  std::vector<int32_t> pos;
  Rows(int64_t R, int64_t D) : R(R), D(D), q(R * D), out(R * D, 0.f), m(R, kMasked), l(R, 0.f), alpha(R), s(R * kKeyBlock), pos(R) {}
};

// e^x (isa.h) for a block's scores less the row's maximum: 0 for a masked score (-inf) and below e^-87.3.
__attribute__((target("avx512f"))) static inline __m512 exp512_masked(__m512 x) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ), exp512(x));
}

__attribute__((target("avx2,fma"))) static inline __m256 exp256_masked(__m256 x) {
  return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ), exp256(x));
}

// Row r's scores s_j = q_r . k_j for a key block (kt [D, kKeyBlock], C vectors of W keys held in registers for RB
// rows), -inf where slot j is later than the row's position (unless the block is seen in full), then the online
// softmax's step while they are in registers: the running maximum m, the rescaling alpha of the row's sum l and
// output (applied as the weighted sum loads it), and p_j = e^(s_j - m) stored for the weighted sum.
#define KVLAB_SCORE_ROWS(V, W, ZERO, LOAD, STORE, FMA, SET1, MASK_LATER, MAX, REDUCE_MAX, REDUCE_ADD, EXP, SUB, ADD) \
  V acc[RB][C];                                                                                                      \
  for (int r = 0; r < RB; ++r)                                                                                       \
    for (int c = 0; c < C; ++c) acc[r][c] = ZERO();                                                                  \
  for (int64_t d = 0; d < D; ++d) {                                                                                  \
    V kd[C];                                                                                                         \
    for (int c = 0; c < C; ++c) kd[c] = LOAD(kt + d * kKeyBlock + c * W);                                            \
    for (int r = 0; r < RB; ++r) {                                                                                   \
      const V qd = SET1(q[r * D + d]);                                                                               \
      for (int c = 0; c < C; ++c) acc[r][c] = FMA(qd, kd[c], acc[r][c]);                                             \
    }                                                                                                                \
  }                                                                                                                  \
  for (int r = 0; r < RB; ++r) {                                                                                     \
    V most = SET1(kMasked);                                                                                          \
    for (int c = 0; c < C; ++c) {                                                                                    \
      if (!full) acc[r][c] = MASK_LATER(acc[r][c], slot + c * W, pos[r]);                                            \
      most = MAX(most, acc[r][c]);                                                                                   \
    }                                                                                                                \
    const float m_new = std::max(st.m[r], REDUCE_MAX(most));                                                         \
    if (m_new == kMasked) { /* the row has seen no slot yet: its output stays zero */                                \
      for (int c = 0; c < C; ++c) STORE(s + r * kKeyBlock + c * W, ZERO());                                         \
      st.alpha[r] = 1.f;                                                                                             \
      continue;                                                                                                      \
    }                                                                                                                \
    V sum = ZERO();                                                                                                  \
    for (int c = 0; c < C; ++c) {                                                                                    \
      const V p = EXP(SUB(acc[r][c], SET1(m_new)));                                                                  \
      STORE(s + r * kKeyBlock + c * W, p);                                                                           \
      sum = ADD(sum, p);                                                                                             \
    }                                                                                                                \
    st.alpha[r] = std::exp(st.m[r] - m_new);                                                                         \
    st.l[r] = st.l[r] * st.alpha[r] + REDUCE_ADD(sum);                                                               \
    st.m[r] = m_new;                                                                                                 \
  }

// out [RB, D] = alpha out + p [RB, n] v [n, D] over the filled slots, C vectors of W columns at a time in registers.
#define KVLAB_WEIGHT_ROWS(V, W, LOAD_V, LOAD, STORE, FMA, SET1, MUL)                                \
  for (int64_t d0 = 0; d0 < D; d0 += C * W) {                                                       \
    V a[RB][C];                                                                                     \
    for (int r = 0; r < RB; ++r)                                                                    \
      for (int c = 0; c < C; ++c) a[r][c] = MUL(LOAD(out + r * D + d0 + W * c), SET1(alpha[r]));    \
    for (int64_t j = 0; j < n; ++j) {                                                               \
      if (slot[j] == kEmpty) continue;                                                              \
      V x[C];                                                                                       \
      for (int c = 0; c < C; ++c) x[c] = LOAD_V(v + j * v_stride + d0 + W * c);                     \
      for (int r = 0; r < RB; ++r) {                                                                \
        const V w = SET1(p[r * kKeyBlock + j]);                                                     \
        for (int c = 0; c < C; ++c) a[r][c] = FMA(w, x[c], a[r][c]);                                \
      }                                                                                             \
    }                                                                                               \
    for (int r = 0; r < RB; ++r)                                                                    \
      for (int c = 0; c < C; ++c) STORE(out + r * D + d0 + W * c, a[r][c]);                        \
  }

__attribute__((target("avx512f"))) static inline __m512 mask_later512(__m512 x, const int32_t* slot, int32_t pos) {
  const __mmask16 seen = _mm512_cmple_epi32_mask(_mm512_loadu_si512(slot), _mm512_set1_epi32(pos));
  return _mm512_mask_blend_ps(seen, _mm512_set1_ps(kMasked), x);
}

__attribute__((target("avx2,fma"))) static inline __m256 mask_later256(__m256 x, const int32_t* slot, int32_t pos) {
  const __m256i later = _mm256_cmpgt_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(slot)), _mm256_set1_epi32(pos));
  return _mm256_blendv_ps(x, _mm256_set1_ps(kMasked), _mm256_castsi256_ps(later));
}

__attribute__((target("avx512f"))) static inline float reduce_max512(__m512 x) { return _mm512_reduce_max_ps(x); }
__attribute__((target("avx512f"))) static inline float reduce_add512(__m512 x) { return _mm512_reduce_add_ps(x); }

__attribute__((target("avx2,fma"))) static inline float reduce_max256(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// The online softmax's state of RB rows: each row's running maximum and sum, and its output's rescaling at this block.
struct RowState {
  float *m, *l, *alpha;
};

template <int RB>
__attribute__((target("avx512f"))) static void score_rows_avx512(const float* q, const float* kt, const int32_t* slot, const int32_t* pos, bool full, float* s,
                                                                  int64_t D, RowState st) {
  constexpr int C = kKeyBlock / 16;
  KVLAB_SCORE_ROWS(__m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_fmadd_ps, _mm512_set1_ps, mask_later512, _mm512_max_ps,
                   reduce_max512, reduce_add512, exp512_masked, _mm512_sub_ps, _mm512_add_ps)
}

template <int RB>
__attribute__((target("avx2,fma"))) static void score_rows_avx2(const float* q, const float* kt, const int32_t* slot, const int32_t* pos, bool full, float* s,
                                                                int64_t D, RowState st) {
  constexpr int C = kKeyBlock / 8;
  KVLAB_SCORE_ROWS(__m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_fmadd_ps, _mm256_set1_ps, mask_later256, _mm256_max_ps,
                   reduce_max256, hsum256, exp256_masked, _mm256_sub_ps, _mm256_add_ps)
}

template <int RB, typename T>
__attribute__((target("avx512f"))) static void weight_rows_avx512(const float* p, const T* v, int64_t v_stride, const int32_t* slot, float* out, int64_t n,
                                                                   int64_t D, const float* alpha) {
  constexpr int C = 4;  // 64 columns: D is a multiple of 64 on this path
  KVLAB_WEIGHT_ROWS(__m512, 16, load16, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_fmadd_ps, _mm512_set1_ps, _mm512_mul_ps)
}

template <int RB, typename T>
__attribute__((target("avx2,fma,f16c"))) static void weight_rows_avx2(const float* p, const T* v, int64_t v_stride, const int32_t* slot, float* out, int64_t n,
                                                                      int64_t D, const float* alpha) {
  constexpr int C = 4;  // 32 columns: D is a multiple of 32 on this path
  KVLAB_WEIGHT_ROWS(__m256, 8, load8, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_fmadd_ps, _mm256_set1_ps, _mm256_mul_ps)
}

#undef KVLAB_SCORE_ROWS
#undef KVLAB_WEIGHT_ROWS

// The reference: one key block for every row, in plain C++.
template <typename T>
static void key_block_scalar(Rows& t, const T* k, const T* v, int64_t stride, const int32_t* slot, int64_t n) {
  const int64_t D = t.D;
  for (int64_t r = 0; r < t.R; ++r) {
    float* s = t.s.data() + r * kKeyBlock;
    float m = t.m[r];
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += t.q[r * D + d] * static_cast<float>(k[j * stride + d]);
      s[j] = slot[j] <= t.pos[r] ? acc : kMasked;
      m = std::max(m, s[j]);
    }
    if (m == kMasked) continue;
    const float alpha = std::exp(t.m[r] - m);
    float sum = 0.f;
    for (int64_t d = 0; d < D; ++d) t.out[r * D + d] *= alpha;
    for (int64_t j = 0; j < n; ++j) {
      if (s[j] == kMasked) continue;
      const float p = std::exp(s[j] - m);
      sum += p;
      for (int64_t d = 0; d < D; ++d) t.out[r * D + d] += p * static_cast<float>(v[j * stride + d]);
    }
    t.l[r] = t.l[r] * alpha + sum;
    t.m[r] = m;
  }
}

// A key block transposed (and widened) into kt [D, kKeyBlock] float32 for the SIMD paths' scores: zero past n and
// in empty slots. Done once per KV head, before the tasks that share it.
template <typename T>
static void transpose_keys(const T* k, int64_t stride, const int32_t* slot, int64_t n, int64_t D, float* kt) {
  std::fill(kt, kt + D * kKeyBlock, 0.f);
  for (int64_t j = 0; j < n; ++j)
    if (slot[j] != kEmpty)
      for (int64_t d = 0; d < D; ++d) kt[d * kKeyBlock + j] = static_cast<float>(k[j * stride + d]);
}

// The SIMD paths (D a multiple of 64 on AVX-512, of 32 on AVX2) for one key block, its keys in kt [D, kKeyBlock]:
// scores and the softmax's step four rows at a time (one on AVX2), then the weighted values four rows at a time.
template <typename T>
static void key_block_simd(Isa isa, Rows& t, const float* kt, const T* v, int64_t stride, const int32_t* slot, int64_t n, bool full) {
  const int64_t D = t.D, R = t.R;
  for (int64_t r = 0; r < R; r += 4) {
    const int64_t rows = std::min<int64_t>(4, R - r);
    const float* q = t.q.data() + r * D;
    float* s = t.s.data() + r * kKeyBlock;
    const int32_t* pos = t.pos.data() + r;
    const RowState st{t.m.data() + r, t.l.data() + r, t.alpha.data() + r};
    if (isa == Isa::avx512)
      rows == 4 ? score_rows_avx512<4>(q, kt, slot, pos, full, s, D, st) : rows == 3 ? score_rows_avx512<3>(q, kt, slot, pos, full, s, D, st)
      : rows == 2 ? score_rows_avx512<2>(q, kt, slot, pos, full, s, D, st) : score_rows_avx512<1>(q, kt, slot, pos, full, s, D, st);
    else  // 16 registers: one row's 8 vectors of scores at a time
      for (int64_t i = 0; i < rows; ++i) score_rows_avx2<1>(q + i * D, kt, slot, pos + i, full, s + i * kKeyBlock, D, {st.m + i, st.l + i, st.alpha + i});
  }
  for (int64_t r = 0; r < R; r += 4) {
    const int64_t rows = std::min<int64_t>(4, R - r);
    const float *p = t.s.data() + r * kKeyBlock, *alpha = t.alpha.data() + r;
    float* out = t.out.data() + r * D;
    if (isa == Isa::avx512)
      rows == 4 ? weight_rows_avx512<4>(p, v, stride, slot, out, n, D, alpha) : rows == 3 ? weight_rows_avx512<3>(p, v, stride, slot, out, n, D, alpha)
      : rows == 2 ? weight_rows_avx512<2>(p, v, stride, slot, out, n, D, alpha) : weight_rows_avx512<1>(p, v, stride, slot, out, n, D, alpha);
    else
      rows == 4 ? weight_rows_avx2<4>(p, v, stride, slot, out, n, D, alpha) : rows == 3 ? weight_rows_avx2<3>(p, v, stride, slot, out, n, D, alpha)
      : rows == 2 ? weight_rows_avx2<2>(p, v, stride, slot, out, n, D, alpha) : weight_rows_avx2<1>(p, v, stride, slot, out, n, D, alpha);
  }
}

// Each slot's position as int32 (kEmpty for an empty slot and the padding to whole key blocks), and per key block
// its least and greatest position.
struct Slots {
  std::vector<int32_t> pos, least, most;
  Slots(const int64_t* key_pos, int64_t S) {
    const int64_t blocks = (S + kKeyBlock - 1) / kKeyBlock;
    pos.assign(blocks * kKeyBlock, kEmpty);
    for (int64_t j = 0; j < S; ++j) pos[j] = key_pos[j] < 0 ? kEmpty : static_cast<int32_t>(std::min<int64_t>(key_pos[j], kSeesAll - 1));
    for (int64_t b = 0; b < blocks; ++b) {
      least.push_back(*std::min_element(pos.begin() + b * kKeyBlock, pos.begin() + (b + 1) * kKeyBlock));
      most.push_back(*std::max_element(pos.begin() + b * kKeyBlock, pos.begin() + (b + 1) * kKeyBlock));
    }
  }
};

// One task: rows [G heads x times t0..t0+n_t) of sequence b and KV head h over every key block some row sees.
// With kt (the SIMD paths): every key block of the KV head, transposed.
template <typename T>
static void attend_task(Isa isa, Rows& t, const T* k, const T* v, int64_t stride, const Slots& slots, int64_t S, const float* kt) {
  const int32_t least_pos = *std::min_element(t.pos.begin(), t.pos.end()), most_pos = *std::max_element(t.pos.begin(), t.pos.end());
  for (int64_t blk = 0; blk * kKeyBlock < S; ++blk) {
    if (slots.least[blk] > most_pos) continue;  // no row sees any of its slots
    const int64_t j0 = blk * kKeyBlock, n = std::min(kKeyBlock, S - j0);
    const int32_t* slot = slots.pos.data() + j0;
    if (kt != nullptr)
      key_block_simd(isa, t, kt + blk * t.D * kKeyBlock, v + j0 * stride, stride, slot, n, slots.most[blk] <= least_pos);
    else
      key_block_scalar(t, k + j0 * stride, v + j0 * stride, stride, slot, n);
  }
}

// The op's operands checked: one line naming what is off.
static void check_prefill_operands(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_pos, const at::Tensor& query_pos) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(), "kvlab::attend_prefill: q [B, H, T, D], k and v [B, H_kv, S, D]");
  const auto kv = k.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && (kv == at::kFloat || kv == at::kHalf || kv == at::kBFloat16) && v.scalar_type() == kv,
              "kvlab::attend_prefill takes float32 q, and k and v of one of float32, float16, bfloat16");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && H % Hkv == 0, "kvlab::attend_prefill: q ", q.sizes(), " does not match k ", k.sizes());
  const bool per_head = key_pos.dim() == 3;
  TORCH_CHECK(key_pos.scalar_type() == at::kLong && key_pos.size(0) == B && key_pos.size(-1) == S && (!per_head || key_pos.size(1) == Hkv),
              "kvlab::attend_prefill: key_pos must be int64 [B, S] or [B, H_kv, S], got ", key_pos.sizes());
  TORCH_CHECK(query_pos.scalar_type() == at::kLong && query_pos.dim() == 2 && query_pos.size(0) == B && query_pos.size(1) == T,
              "kvlab::attend_prefill: query_pos must be int64 [B, T], got ", query_pos.sizes());
}

// (y [B, H, T, D] float32, laid out as [B, T, H, D], lse [B, H, T] float32) for q [B, H, T, D] float32 (any strides
// with D contiguous), k and v [B, H_kv, S, D] float32, float16 or bfloat16 (both alike, D contiguous, a row stride
// shared), key_pos [B, S] or [B, H_kv, S] and query_pos [B, T] int64. A query that sees no slot gets zeros and -inf.
std::tuple<at::Tensor, at::Tensor> attend_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_pos,
                                                  const at::Tensor& query_pos) {
  check_prefill_operands(q, k, v, key_pos, query_pos);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  const bool per_head = key_pos.dim() == 3;
  const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous(), kp = key_pos.contiguous(), qp = query_pos.contiguous();
  const bool shared_rows = k.stride(3) == 1 && v.stride(3) == 1 && k.stride(2) == v.stride(2) && k.stride(1) == v.stride(1) && k.stride(0) == v.stride(0);
  const at::Tensor kc = shared_rows ? k : k.contiguous(), vc = shared_rows ? v : v.contiguous();
  const int64_t G = H / Hkv, blocks = (T + kQueryBlock - 1) / kQueryBlock, stride = kc.stride(2);
  at::Tensor y = at::empty({B, T, H, D}, q.options()), lse = at::empty({B, H, T}, q.options());
  std::vector<Slots> slots;
  for (int64_t i = 0; i < (per_head ? B * Hkv : B); ++i) slots.emplace_back(kp.data_ptr<int64_t>() + i * S, S);
  const Isa isa = kernel_isa();
  const bool simd = isa != Isa::scalar && D % (isa == Isa::avx512 ? 64 : 32) == 0;
  const int64_t key_blocks = (S + kKeyBlock - 1) / kKeyBlock;
  const std::unique_ptr<float[]> kt(simd ? new float[B * Hkv * key_blocks * D * kKeyBlock] : nullptr);  // transpose_keys fills it
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  auto run = [&](const auto* keys, const auto* values) {  // float, at::Half or at::BFloat16
    if (simd)
      at::parallel_for(0, B * Hkv * key_blocks, 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t b = i / (Hkv * key_blocks), h = i / key_blocks % Hkv, blk = i % key_blocks, j0 = blk * kKeyBlock;
          const Slots& own = slots[per_head ? b * Hkv + h : b];
          transpose_keys(keys + b * kc.stride(0) + h * kc.stride(1) + j0 * stride, stride, own.pos.data() + j0, std::min(kKeyBlock, S - j0), D,
                         kt.get() + i * D * kKeyBlock);
        }
      });
    at::parallel_for(0, B * Hkv * blocks, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t task = i0; task < i1; ++task) {
        // Tasks in the order (sequence, query blocks zig-zag: first, last, second, ..., KV head): a causal prompt's
        // later blocks see more keys, and torch's threads take contiguous runs of tasks, each this way as much work.
        const int64_t b = task / (Hkv * blocks), z = task % (Hkv * blocks) / Hkv, h = task % Hkv;
        const int64_t t0 = (z % 2 == 0 ? z / 2 : blocks - 1 - z / 2) * kQueryBlock, n_t = std::min(kQueryBlock, T - t0);
        Rows t(G * n_t, D);
        for (int64_t r = 0; r < t.R; ++r) {
          const int64_t head = h * G + r / n_t, time = t0 + r % n_t, p = qp.data_ptr<int64_t>()[b * T + time];
          const float* qr = qc.data_ptr<float>() + b * qc.stride(0) + head * qc.stride(1) + time * qc.stride(2);
          for (int64_t d = 0; d < D; ++d) t.q[r * D + d] = qr[d] * scale;
          t.pos[r] = p < 0 ? kSeesAll : static_cast<int32_t>(std::min<int64_t>(p, kSeesAll - 1));
        }
        const int64_t offset = b * kc.stride(0) + h * kc.stride(1);
        const float* head_kt = simd ? kt.get() + (b * Hkv + h) * key_blocks * D * kKeyBlock : nullptr;
        attend_task(isa, t, keys + offset, values + offset, stride, slots[per_head ? b * Hkv + h : b], S, head_kt);
        for (int64_t r = 0; r < t.R; ++r) {
          const int64_t head = h * G + r / n_t, time = t0 + r % n_t;
          float* out = y.data_ptr<float>() + ((b * T + time) * H + head) * D;
          const float inv = t.l[r] > 0.f ? 1.f / t.l[r] : 0.f;
          for (int64_t d = 0; d < D; ++d) out[d] = t.out[r * D + d] * inv;
          lse.data_ptr<float>()[(b * H + head) * T + time] = t.l[r] > 0.f ? t.m[r] + std::log(t.l[r]) : kMasked;
        }
      }
    });
  };
  if (kc.scalar_type() == at::kHalf) run(kc.data_ptr<at::Half>(), vc.data_ptr<at::Half>());
  if (kc.scalar_type() == at::kBFloat16) run(kc.data_ptr<at::BFloat16>(), vc.data_ptr<at::BFloat16>());
  if (kc.scalar_type() == at::kFloat) run(kc.data_ptr<float>(), vc.data_ptr<float>());
  return {y.transpose(1, 2), lse};
}
}  // namespace kvlab

TORCH_LIBRARY_FRAGMENT(kvlab, m) {
  m.def("attend_prefill(Tensor q, Tensor k, Tensor v, Tensor key_pos, Tensor query_pos) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvlab, CPU, m) { m.impl("attend_prefill", &kvlab::attend_prefill); }
