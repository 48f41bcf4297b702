// The pieces of decode attention that attention.cpp (dense and compact caches) and attention_paged.cpp (the
// paged pool) share: one task's partials over a run of slots (scores, masked exponentials, weighted sum of
// values; scalar, AVX2 and AVX-512 paths), and the merge of a head's partials.
#pragma once
#include <algorithm>
#include <limits>
#include <type_traits>

#include "matvec.h"

namespace kvlab {

constexpr int64_t kChunk = 256;  // slots per task: a 2K cache gives 8 tasks per KV head to split over the cores
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// s[r * n + j] = scale * q_r . k_j for R query rows and n key rows of D elements.
template <typename T>
static void scores_scalar(const float* q, const T* k, float* s, int64_t R, int64_t n, int64_t D, float scale) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += q[r * D + d] * static_cast<float>(k[j * D + d]);
      s[r * n + j] = acc * scale;
    }
}

// p_j = e^(s_j - m) in place (0 where s_j is -inf: a masked slot); returns sum_j p_j.
static float exp_scalar(float* s, int64_t n, float m) {
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) sum += (s[j] = s[j] == kNegInf ? 0.f : std::exp(s[j] - m));
  return sum;
}

__attribute__((target("avx2,fma"))) static float exp_avx2(float* s, int64_t n, float m) {
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_loadu_ps(s + j);
    const __m256 p = _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(kNegInf), _CMP_EQ_OQ), exp256(_mm256_sub_ps(x, _mm256_set1_ps(m))));
    _mm256_storeu_ps(s + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  return hsum256(sum) + exp_scalar(s + j, n - j, m);
}

// acc[r] += sum_j p[r * n + j] v_j for R rows, n value rows of D elements.
template <typename T>
static void weighted_sum_scalar(const float* p, const T* v, float* acc, int64_t R, int64_t n, int64_t D) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < n; ++j)
      if (p[r * n + j] != 0.f)  // a slot the row does not see adds nothing, whatever it holds (as on the SIMD paths)
        for (int64_t d = 0; d < D; ++d) acc[r * D + d] += p[r * n + j] * static_cast<float>(v[j * D + d]);
}

// The SIMD paths take heads of whole vectors (D a multiple of 16 on AVX-512, of 8 on AVX2: every model's
// head size; others take the scalar path). Scores on AVX-512: a task's keys in blocks of 16 rows, 16-bit
// ones widened once into a float32 block (float32 ones read in place), each query row's 16 products
// accumulated in registers, summed by one transpose-and-add tree and masked, each row's maximum kept per
// lane; on AVX2 (scores_rows_avx2) up to 3 query rows against 4 keys at a time. Weighted sums: each value
// row read in place and widened once while up to four query rows accumulate it. A block of keys, or a value
// row, that no query row sees is skipped.
constexpr int64_t kMaxHeadDim = 256;  // the widened block's columns; wider heads take the scalar path
constexpr int32_t kNever = std::numeric_limits<int32_t>::max();  // an empty slot's position in `slot_positions`

// Each slot's position as int32, as the SIMD paths compare 8 or 16 at a time: an empty slot (-1), and the
// padding up to a whole block of 16, as kNever, so slot j is visible to a query at p exactly when out[j] <= p.
static std::vector<int32_t> slot_positions(const int64_t* key_pos, int64_t n) {
  std::vector<int32_t> out((n + 15) / 16 * 16, kNever);
  for (int64_t j = 0; j < n; ++j) out[j] = key_pos[j] < 0 ? kNever : static_cast<int32_t>(std::min<int64_t>(key_pos[j], kNever));
  return out;
}

// Whether any of n slots is visible to a query at `last`, the latest query position.
static bool any_visible(const int32_t* slot, int64_t n, int32_t last) {
  for (int64_t j = 0; j < n; ++j)
    if (slot[j] <= last) return true;
  return false;
}

constexpr int64_t kPrefetchRows = 32;  // how far ahead the scores ask for key rows from memory

// Asks for row i of D elements (its cache lines) before it is read: a pass over a long cache is bound by
// memory, and a task's first rows by the hardware prefetcher's warm-up.
template <typename T>
static inline void prefetch_row(const T* src, int64_t i, int64_t D) {
  const char* row = reinterpret_cast<const char*>(src + i * D);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(row + b);
}

// A block of `count` key rows as 16 float32 rows of D, the rows past `count` zeros: a whole block of float32
// keys in place, any other widened into `buffer`.
template <typename T>
__attribute__((target("avx512f"))) static const float* key_block_avx512(const T* k, int64_t count, int64_t D, float* buffer) {
  if constexpr (std::is_same_v<T, float>)
    if (count == 16) return k;
  for (int64_t i = 0; i < count; ++i) {
    prefetch_row(k, i + kPrefetchRows, D);
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(buffer + i * D + d, load16(k + i * D + d));
  }
  std::fill(buffer + count * D, buffer + 16 * D, 0.f);
  return buffer;
}

// s[r * n + j] = scale * q_r . k_j for R query rows, -inf where slot j is not visible to row r (at
// query_pos[r]); lane_max [R, W] gets the maximum of each row's lanes. AVX2 (16 registers): RB <= 3 rows
// against 4 keys keep 12 sums, each key widened in a register and taken by every row, the query vectors
// memory operands; a block past the last key rereads it, its lanes masked and not stored. Each block's value
// rows are asked for with its keys: the weighted sum then finds them in cache (20-30% faster from memory).
template <int RB, typename T>
__attribute__((target("avx2,fma,f16c"))) static void scores_rows_avx2(const float* q, const T* k, const T* v, const int32_t* slot, const int64_t* query_pos, float* s,
                                                                     float* lane_max, int64_t n, int64_t D, float scale, int32_t last) {
  __m128 row_max[RB];
  for (int r = 0; r < RB; ++r) row_max[r] = _mm_set1_ps(kNegInf);
  for (int64_t j0 = 0; j0 < n; j0 += 4) {
    const int64_t count = std::min<int64_t>(4, n - j0);
    if (!any_visible(slot + j0, count, last)) {
      for (int r = 0; r < RB; ++r) std::fill(s + r * n + j0, s + r * n + j0 + count, kNegInf);
      continue;
    }
    const T* rows[4];
    for (int i = 0; i < 4; ++i) {
      rows[i] = k + std::min<int64_t>(j0 + i, n - 1) * D;
      prefetch_row(k, std::min<int64_t>(j0 + i + kPrefetchRows, n - 1), D);
      prefetch_row(v, j0 + i, D);
    }
    __m256 dots[RB][4];
    for (int r = 0; r < RB; ++r)
      for (int i = 0; i < 4; ++i) dots[r][i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8)
      for (int i = 0; i < 4; ++i) {
        const __m256 key = load8(rows[i] + d);
        for (int r = 0; r < RB; ++r) dots[r][i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + d), key, dots[r][i]);
      }
    const __m128i slots = _mm_loadu_si128(reinterpret_cast<const __m128i*>(slot + j0));
    for (int r = 0; r < RB; ++r) {
      const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(dots[r][0], dots[r][1]), _mm256_hadd_ps(dots[r][2], dots[r][3]));
      const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
      const __m128 hidden = _mm_castsi128_ps(_mm_cmpgt_epi32(slots, _mm_set1_epi32(static_cast<int32_t>(query_pos[r]))));
      const __m128 x = _mm_blendv_ps(_mm_mul_ps(sums, _mm_set1_ps(scale)), _mm_set1_ps(kNegInf), hidden);
      row_max[r] = _mm_max_ps(row_max[r], x);
      if (count == 4)
        _mm_storeu_ps(s + r * n + j0, x);
      else {
        alignas(16) float out[4];
        _mm_store_ps(out, x);
        std::copy(out, out + count, s + r * n + j0);
      }
    }
  }
  for (int r = 0; r < RB; ++r) {
    _mm_storeu_ps(lane_max + r * 8, row_max[r]);
    std::fill(lane_max + r * 8 + 4, lane_max + r * 8 + 8, kNegInf);
  }
}

template <typename T>
static void scores_avx2(const float* q, const T* k, const T* v, const int32_t* slot, const int64_t* query_pos, float* s, float* lane_max, int64_t R, int64_t n, int64_t D,
                        float scale) {
  const int32_t last = static_cast<int32_t>(*std::max_element(query_pos, query_pos + R));
  for (int64_t r = 0; r < R; r += 3) {
    const int64_t rows = std::min<int64_t>(3, R - r);
    const float* qr = q + r * D;
    if (rows == 3) scores_rows_avx2<3>(qr, k, v, slot, query_pos + r, s + r * n, lane_max + r * 8, n, D, scale, last);
    if (rows == 2) scores_rows_avx2<2>(qr, k, v, slot, query_pos + r, s + r * n, lane_max + r * 8, n, D, scale, last);
    if (rows == 1) scores_rows_avx2<1>(qr, k, v, slot, query_pos + r, s + r * n, lane_max + r * 8, n, D, scale, last);
  }
}

template <typename T>
__attribute__((target("avx512f"))) static void scores_avx512(const float* q, const T* k, const int32_t* slot, const int64_t* query_pos, float* s,
                                                              float* lane_max, int64_t R, int64_t n, int64_t D, float scale) {
  alignas(64) float buffer[16 * kMaxHeadDim];
  const int32_t last = static_cast<int32_t>(*std::max_element(query_pos, query_pos + R));
  std::fill(lane_max, lane_max + R * 16, kNegInf);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t count = std::min<int64_t>(16, n - j0);
    if (!any_visible(slot + j0, count, last)) {
      for (int64_t r = 0; r < R; ++r) std::fill(s + r * n + j0, s + r * n + j0 + count, kNegInf);
      continue;
    }
    const float* rows = key_block_avx512(k + j0 * D, count, D, buffer);
    const __m512i slots = _mm512_loadu_si512(slot + j0);
    const __mmask16 tail = static_cast<__mmask16>((1u << count) - 1);
    for (int64_t r = 0; r < R; ++r) {
      __m512 dots[16];
      for (int i = 0; i < 16; ++i) dots[i] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 qd = _mm512_loadu_ps(q + r * D + d);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) dots[i] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(rows + i * D + d), dots[i]);
      }
      const __mmask16 seen = _mm512_cmple_epi32_mask(slots, _mm512_set1_epi32(static_cast<int32_t>(query_pos[r])));
      const __m512 x = _mm512_mask_blend_ps(seen, _mm512_set1_ps(kNegInf), _mm512_mul_ps(sum_lanes16(dots), _mm512_set1_ps(scale)));
      _mm512_mask_storeu_ps(s + r * n + j0, tail, x);
      _mm512_storeu_ps(lane_max + r * 16, _mm512_max_ps(_mm512_loadu_ps(lane_max + r * 16), x));
    }
  }
}

// acc [R, D] += p [R, n] v [n, D] for RB <= 4 query rows, C vectors of W columns at a time held in registers;
// each value row that some query row sees (seen[j]) widened once per run of columns.
#define KVLAB_WEIGHTED_ROWS(V, W, LOAD_V, LOAD, STORE, FMA, SET1)              \
  for (int64_t d0 = 0; d0 < D; d0 += C * W) {                                \
    V a[RB][C];                                                              \
    for (int r = 0; r < RB; ++r)                                             \
      for (int c = 0; c < C; ++c) a[r][c] = LOAD(acc + r * D + d0 + W * c);  \
    for (int64_t j = 0; j < n; ++j) {                                        \
      if (!seen[j]) continue;                                                \
      V x[C];                                                                \
      for (int c = 0; c < C; ++c) x[c] = LOAD_V(v + j * D + d0 + W * c);     \
      for (int r = 0; r < RB; ++r) {                                         \
        const V w = SET1(p[r * n + j]);                                      \
        for (int c = 0; c < C; ++c) a[r][c] = FMA(w, x[c], a[r][c]);         \
      }                                                                      \
    }                                                                        \
    for (int r = 0; r < RB; ++r)                                             \
      for (int c = 0; c < C; ++c) STORE(acc + r * D + d0 + W * c, a[r][c]);  \
  }

template <int RB, int C, typename T>
__attribute__((target("avx2,fma,f16c"))) static void weighted_rows_avx2(const float* p, const T* v, const bool* seen, float* acc, int64_t n, int64_t D) {
  KVLAB_WEIGHTED_ROWS(__m256, 8, load8, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_fmadd_ps, _mm256_set1_ps)
}

template <int RB, int C, typename T>
__attribute__((target("avx512f"))) static void weighted_rows_avx512(const float* p, const T* v, const bool* seen, float* acc, int64_t n, int64_t D) {
  KVLAB_WEIGHTED_ROWS(__m512, 16, load16, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_fmadd_ps, _mm512_set1_ps)
}

#undef KVLAB_WEIGHTED_ROWS

// One call of the ISA's kernel for RB rows, C vectors at a time, as many as the registers hold with RB <= 4
// rows' sums: four on AVX-512 (32 registers) where the head has a multiple of four vectors (64 or 128
// columns), two on AVX2 (16 registers) where it has an even number, else one.
template <int RB, typename T>
static void weighted_rows(Isa isa, const float* p, const T* v, const bool* seen, float* acc, int64_t n, int64_t D) {
  if (isa == Isa::avx512)
    D % 64 == 0 ? weighted_rows_avx512<RB, 4>(p, v, seen, acc, n, D) : weighted_rows_avx512<RB, 1>(p, v, seen, acc, n, D);
  else
    D % 16 == 0 ? weighted_rows_avx2<RB, 2>(p, v, seen, acc, n, D) : weighted_rows_avx2<RB, 1>(p, v, seen, acc, n, D);
}

// acc [R, D] += p [R, n] v [n, D], four query rows at a time. A slot that no query row sees adds nothing,
// whatever its row holds (an empty slot's values need not be finite: 0 x NaN would poison the sum).
template <typename T>
static void weighted_sum_simd(Isa isa, const float* p, const T* v, float* acc, int64_t R, int64_t n, int64_t D) {
  bool seen[kChunk];
  for (int64_t j = 0; j < n; ++j) {
    seen[j] = false;
    for (int64_t r = 0; r < R && !seen[j]; ++r) seen[j] = p[r * n + j] != 0.f;
  }
  for (int64_t r = 0; r < R; r += 4) {
    const float* pr = p + r * n;
    float* a = acc + r * D;
    const int64_t rows = std::min<int64_t>(4, R - r);
    rows == 4 ? weighted_rows<4>(isa, pr, v, seen, a, n, D) : rows == 3 ? weighted_rows<3>(isa, pr, v, seen, a, n, D)
    : rows == 2 ? weighted_rows<2>(isa, pr, v, seen, a, n, D) : weighted_rows<1>(isa, pr, v, seen, a, n, D);
  }
}

// Masks row r's scores (-inf where the slot is empty or later than query_pos[r]) and turns them into
// e^(s - m[r]) in place, m[r] the row's maximum; l[r] = their sum (0, and every p 0, for a row that sees no slot).
static void masked_exp_scalar(float* s, const int64_t* key_pos, const int64_t* query_pos, int64_t R, int64_t n, float* m, float* l) {
  for (int64_t r = 0; r < R; ++r) {
    float* row = s + r * n;
    m[r] = kNegInf;
    for (int64_t j = 0; j < n; ++j) {
      if (key_pos[j] < 0 || key_pos[j] > query_pos[r]) row[j] = kNegInf;
      m[r] = std::max(m[r], row[j]);
    }
    l[r] = m[r] == kNegInf ? 0.f : exp_scalar(row, n, m[r]);
    if (m[r] == kNegInf) std::fill(row, row + n, 0.f);
  }
}

// The SIMD paths' scores, masked already, as e^(s - m[r]) in place, m[r] the row's maximum (from its W lanes'),
// l[r] their sum.
static void exp_rows(float* s, const float* lane_max, int64_t W, int64_t R, int64_t n, float* m, float* l) {
  for (int64_t r = 0; r < R; ++r) {
    float* row = s + r * n;
    m[r] = *std::max_element(lane_max + r * W, lane_max + (r + 1) * W);
    l[r] = m[r] == kNegInf ? 0.f : exp_avx2(row, n, m[r]);
    if (m[r] == kNegInf) std::fill(row, row + n, 0.f);
  }
}

// One task's partials: for R query rows (query_pos[r]) over n slots (key_pos[j]), each row's maximum
// score m[r], sum of e^(s - m) l[r] and unnormalized output acc[r] (zeroed by the caller); with p_out, also
// each row's e^(s_j - m[r]) ([R, n], 0 where the slot is hidden), from which a caller normalizes probabilities.
template <typename T>
static void attend_chunk(Isa isa, const float* q, const T* k, const T* v, const int64_t* key_pos, const int64_t* query_pos, int64_t R, int64_t n,
                         int64_t D, float scale, float* m, float* l, float* acc, float* p_out = nullptr) {
  thread_local std::vector<float> s, lane_max;  // a task's scratch, kept between calls (the paged pool's are many)
  s.resize(R * n);
  const int64_t W = isa == Isa::avx512 ? 16 : 8;
  if (isa == Isa::scalar || D > kMaxHeadDim || D % W != 0) {
    scores_scalar(q, k, s.data(), R, n, D, scale);
    masked_exp_scalar(s.data(), key_pos, query_pos, R, n, m, l);
    weighted_sum_scalar(s.data(), v, acc, R, n, D);
  } else {
    const std::vector<int32_t> slot = slot_positions(key_pos, n);
    lane_max.resize(R * W);
    if (isa == Isa::avx512)
      scores_avx512(q, k, slot.data(), query_pos, s.data(), lane_max.data(), R, n, D, scale);
    else
      scores_avx2(q, k, v, slot.data(), query_pos, s.data(), lane_max.data(), R, n, D, scale);
    exp_rows(s.data(), lane_max.data(), W, R, n, m, l);
    weighted_sum_simd(isa, s.data(), v, acc, R, n, D);
  }
  if (p_out != nullptr) std::copy(s.begin(), s.begin() + R * n, p_out);
}

// Each (sequence, query row)'s position, [B * R] for query_pos [B, T] (contiguous int64): row r of a KV head's
// rows is query head r / T's time r % T; refused in one line at 2^31 - 1 or more (the SIMD paths compare int32).
static std::vector<int64_t> row_positions(const at::Tensor& query_pos, int64_t R) {
  const int64_t B = query_pos.size(0), T = query_pos.size(1);
  const int64_t* qp = query_pos.data_ptr<int64_t>();
  std::vector<int64_t> row_pos(B * R);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < R; ++r) row_pos[b * R + r] = qp[b * T + r % T];
  for (const int64_t p : row_pos) TORCH_CHECK(p < kNever, "kvlab attention: query positions must be below 2^31 - 1, got ", p);
  return row_pos;
}

// Each row's output from its head's tasks' partials: head i's are tasks first[i] .. first[i + 1] - 1 of m, l [tasks, R]
// and acc [tasks, R, D]: y = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c with M = max_c m_c -> [heads, R, D].
static at::Tensor merge_runs(const at::Tensor& m, const at::Tensor& l, const at::Tensor& acc, const std::vector<int64_t>& first, int64_t R, int64_t D) {
  const int64_t heads = static_cast<int64_t>(first.size()) - 1;
  at::Tensor y = at::empty({heads, R, D}, acc.options());
  const float *mp = m.data_ptr<float>(), *lp = l.data_ptr<float>(), *ap = acc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t r = 0; r < R; ++r) {
      float M = kNegInf, L = 0.f;
      for (int64_t c = first[h]; c < first[h + 1]; ++c) M = std::max(M, mp[c * R + r]);
      float* out = yp + (h * R + r) * D;
      std::fill(out, out + D, 0.f);
      for (int64_t c = first[h]; c < first[h + 1]; ++c) {
        const int64_t i = c * R + r;
        const float w = M == kNegInf ? 0.f : std::exp(mp[i] - M);
        L += w * lp[i];
        for (int64_t d = 0; d < D; ++d) out[d] += w * ap[i * D + d];
      }
      if (L > 0.f)
        for (int64_t d = 0; d < D; ++d) out[d] /= L;  // else no slot seen: zeros
    }
  return y;
}

// merge_runs for partials m, l [..., chunks, R] and acc [..., chunks, R, D]: every head `chunks` tasks -> [..., R, D].
static at::Tensor merge(const at::Tensor& m, const at::Tensor& l, const at::Tensor& acc) {
  const int64_t chunks = m.size(2), R = m.size(3), heads = m.numel() / (chunks * R);
  std::vector<int64_t> first(heads + 1);
  for (int64_t h = 0; h <= heads; ++h) first[h] = h * chunks;
  return merge_runs(m, l, acc, first, R, acc.size(4)).view({m.size(0), m.size(1), R, acc.size(4)});
}

}  // namespace kvlab
