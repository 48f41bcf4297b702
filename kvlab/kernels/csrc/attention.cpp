// Decode attention over a cache's slots, the softmax fused: y[b, h, t] = sum_j p_j v[b, h_kv, j] with
// p = softmax_j(q[b, h, t] . k[b, h_kv, j] / sqrt(D)) over the slots j whose position is filled (>= 0)
// and no later than the query's (key_pos [B, S] shared by the KV heads, or [B, H_kv, S] per head, -1 for
// an empty slot), h_kv = h / (H / H_kv). The same mask as kvlab.model.attention_mask, so it serves the
// static cache and every compressed cache's slots alike. Keys and values are float32, or float16 (a
// 16-bit cache: half the bytes to read, widened to float32 as they are loaded); the arithmetic is float32.
//
// Each (sequence, KV head, run of kChunk slots) is one task: the query heads sharing the KV head read
// each key and value row once. A task keeps its rows' maximum score, sum of exponentials and weighted
// sum of values (flash-decoding's partials); one pass merges the tasks' partials.
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "matvec.h"

namespace kvlab {

constexpr int64_t kChunk = 256;  // slots per task: a 2K cache gives 8 tasks per KV head to split over the cores
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A key or value row's elements as float32: 8 (AVX2, F16C's conversion for float16) or 16 (AVX-512) at a time.
__attribute__((target("avx2,fma,f16c"))) static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma,f16c"))) static inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
__attribute__((target("avx512f"))) static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) static inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

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

// e^x for 8 floats (Cephes' expf: x = n ln2 + f, |f| <= ln2 / 2, a degree-5 polynomial in f, times 2^n):
// within 2 ulp over the range; scores are <= 0 here (the row's maximum is subtracted first).
__attribute__((target("avx2,fma"))) static inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
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

// The SIMD paths read key and value rows in blocks (16 rows on AVX-512, 8 on AVX2), each row widened once to
// float32 and padded with zeros to Dp columns; q and the output are padded alike (attend_chunk). Scores:
// each query row's products with the block's keys accumulate in registers and are summed together by one
// transpose-and-add tree. Weighted sums: up to four query rows accumulate a run of columns in registers
// while the block's value rows stream past. A block that no query row may see is skipped.
constexpr int64_t kMaxHeadDim = 256;  // the SIMD paths' buffers; wider heads take the scalar path

// Whether any of n slots is filled (>= 0) and no later than `last`, the latest query position.
static bool any_visible(const int64_t* key_pos, int64_t n, int64_t last) {
  for (int64_t j = 0; j < n; ++j)
    if (key_pos[j] >= 0 && key_pos[j] <= last) return true;
  return false;
}

// Lane i of the result is the sum of v[i]'s lanes: a transpose-and-add tree, three instructions per sum.
__attribute__((target("avx2,fma"))) static inline __m256 sum_lanes8(const __m256* v) {
  __m256 x[2];
  for (int g = 0; g < 2; ++g) {
    const __m256* a = v + 4 * g;
    const __m256d u0 = _mm256_castps_pd(_mm256_add_ps(_mm256_unpacklo_ps(a[0], a[1]), _mm256_unpackhi_ps(a[0], a[1])));
    const __m256d u1 = _mm256_castps_pd(_mm256_add_ps(_mm256_unpacklo_ps(a[2], a[3]), _mm256_unpackhi_ps(a[2], a[3])));
    x[g] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(u0, u1)), _mm256_castpd_ps(_mm256_unpackhi_pd(u0, u1)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(x[0], x[1], 0x20), _mm256_permute2f128_ps(x[0], x[1], 0x31));
}

__attribute__((target("avx512f"))) static inline __m512 sum_lanes16(const __m512* v) {
  __m512 x[4];
  for (int g = 0; g < 4; ++g) {
    const __m512* a = v + 4 * g;
    const __m512d u0 = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1])));
    const __m512d u1 = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3])));
    x[g] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u0, u1)), _mm512_castpd_ps(_mm512_unpackhi_pd(u0, u1)));
  }
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

constexpr int64_t kPrefetchRows = 32;  // how far ahead a widening pass asks for rows from memory

// Asks for row i of D elements (its cache lines) kPrefetchRows rows before the widening pass reads it: a pass
// over a long cache is bound by memory, and a task's first rows by the hardware prefetcher's warm-up.
template <typename T>
static inline void prefetch_row(const T* src, int64_t i, int64_t D) {
  const char* row = reinterpret_cast<const char*>(src + i * D);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(row + b);
}

// `rows` of D elements as float32 rows of Dp, zero-padded; the block's unused rows up to `block` zeroed too.
template <typename T>
__attribute__((target("avx2,fma,f16c"))) static void widen_avx2(const T* src, int64_t rows, int64_t block, int64_t D, int64_t Dp, float* dst) {
  for (int64_t i = 0; i < rows; ++i) {
    prefetch_row(src, i + kPrefetchRows, D);
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + i * Dp + d, load8(src + i * D + d));
    for (; d < D; ++d) dst[i * Dp + d] = static_cast<float>(src[i * D + d]);
    std::fill(dst + i * Dp + D, dst + (i + 1) * Dp, 0.f);
  }
  std::fill(dst + rows * Dp, dst + block * Dp, 0.f);
}

template <typename T>
__attribute__((target("avx512f"))) static void widen_avx512(const T* src, int64_t rows, int64_t block, int64_t D, int64_t Dp, float* dst) {
  for (int64_t i = 0; i < rows; ++i) {
    prefetch_row(src, i + kPrefetchRows, D);
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) _mm512_storeu_ps(dst + i * Dp + d, load16(src + i * D + d));
    for (; d < D; ++d) dst[i * Dp + d] = static_cast<float>(src[i * D + d]);
    std::fill(dst + i * Dp + D, dst + (i + 1) * Dp, 0.f);
  }
  std::fill(dst + rows * Dp, dst + block * Dp, 0.f);
}

// s[r * n + j] = scale * q_r . k_j, q padded to [R, Dp] (Dp a multiple of 8).
template <typename T>
__attribute__((target("avx2,fma,f16c"))) static void scores_avx2(const float* q, const T* k, const int64_t* key_pos, int64_t last, float* s, int64_t R, int64_t n,
                                                                int64_t D, int64_t Dp, float scale) {
  alignas(32) float rows[8 * kMaxHeadDim];
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int64_t count = std::min<int64_t>(8, n - j0);
    if (!any_visible(key_pos + j0, count, last)) continue;  // every score here is masked to -inf afterwards
    widen_avx2(k + j0 * D, count, 8, D, Dp, rows);
    for (int64_t r = 0; r < R; ++r) {
      __m256 dots[8];
      for (int i = 0; i < 8; ++i) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < Dp; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * Dp + d), _mm256_load_ps(rows + i * Dp + d), a);
        dots[i] = a;
      }
      alignas(32) float out[8];
      _mm256_store_ps(out, _mm256_mul_ps(sum_lanes8(dots), _mm256_set1_ps(scale)));
      std::copy(out, out + count, s + r * n + j0);
    }
  }
}

template <typename T>
__attribute__((target("avx512f"))) static void scores_avx512(const float* q, const T* k, const int64_t* key_pos, int64_t last, float* s, int64_t R, int64_t n,
                                                              int64_t D, int64_t Dp, float scale) {
  alignas(64) float rows[16 * kMaxHeadDim];
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t count = std::min<int64_t>(16, n - j0);
    if (!any_visible(key_pos + j0, count, last)) continue;  // every score here is masked to -inf afterwards
    widen_avx512(k + j0 * D, count, 16, D, Dp, rows);
    for (int64_t r = 0; r < R; ++r) {
      __m512 dots[16];
      for (int i = 0; i < 16; ++i) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t d = 0; d < Dp; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * Dp + d), _mm512_load_ps(rows + i * Dp + d), a);
        dots[i] = a;
      }
      _mm512_mask_storeu_ps(s + r * n + j0, static_cast<__mmask16>((1u << count) - 1), _mm512_mul_ps(sum_lanes16(dots), _mm512_set1_ps(scale)));
    }
  }
}

// acc[r] += sum_i p[r * n + i] rows_i for RB query rows over `count` widened value rows, CW columns at a time
// (C vectors of W lanes) held in registers.
#define KVLAB_WEIGHTED_BLOCK(V, C, LOAD, STORE, FMA, SET1)                                    \
  for (int64_t d0 = 0; d0 < Dp; d0 += C * sizeof(V) / sizeof(float)) {                      \
    constexpr int64_t W = sizeof(V) / sizeof(float);                                          \
    V a[RB][C];                                                                               \
    for (int r = 0; r < RB; ++r)                                                              \
      for (int c = 0; c < C; ++c) a[r][c] = LOAD(acc + r * Dp + d0 + W * c);                  \
    for (int64_t i = 0; i < count; ++i) {                                                     \
      V x[C];                                                                                 \
      for (int c = 0; c < C; ++c) x[c] = LOAD(rows + i * Dp + d0 + W * c);                    \
      for (int r = 0; r < RB; ++r) {                                                          \
        const V w = SET1(p[r * n + i]);                                                       \
        for (int c = 0; c < C; ++c) a[r][c] = FMA(w, x[c], a[r][c]);                          \
      }                                                                                       \
    }                                                                                         \
    for (int r = 0; r < RB; ++r)                                                              \
      for (int c = 0; c < C; ++c) STORE(acc + r * Dp + d0 + W * c, a[r][c]);                  \
  }

template <int RB>
__attribute__((target("avx2,fma"))) static void weighted_block_avx2(const float* p, int64_t n, const float* rows, int64_t count, int64_t Dp, float* acc) {
  KVLAB_WEIGHTED_BLOCK(__m256, 2, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_fmadd_ps, _mm256_set1_ps)
}

template <int RB>
__attribute__((target("avx512f"))) static void weighted_block_avx512(const float* p, int64_t n, const float* rows, int64_t count, int64_t Dp, float* acc) {
  KVLAB_WEIGHTED_BLOCK(__m512, 4, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_fmadd_ps, _mm512_set1_ps)
}

#undef KVLAB_WEIGHTED_BLOCK

// Whether some query row's weight p[r * n], r < rows, for one slot is nonzero (the row sees the slot).
static bool seen_by_any(const float* p, int64_t n, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r)
    if (p[r * n] != 0.f) return true;
  return false;
}

// acc [R, Dp] += p [R, n] v [n, D] over blocks of KB value rows, up to four query rows at a time. A slot
// that no query row sees adds nothing, whatever its row holds (an empty slot's values need not be finite:
// 0 x NaN would poison the sum), so its widened row is zeros.
template <int KB, typename T, typename Widen, typename Block>
static void weighted_sum_simd(const float* p, const T* v, float* acc, int64_t R, int64_t n, int64_t D, int64_t Dp, Widen widen, Block block) {
  alignas(64) float rows[KB * kMaxHeadDim];
  for (int64_t j0 = 0; j0 < n; j0 += KB) {
    const int64_t count = std::min<int64_t>(KB, n - j0);
    bool seen[KB], any = false;
    for (int64_t i = 0; i < count; ++i) any |= seen[i] = seen_by_any(p + j0 + i, n, R);
    if (!any) continue;
    widen(v + j0 * D, count, KB, D, Dp, rows);
    for (int64_t i = 0; i < count; ++i)
      if (!seen[i]) std::fill(rows + i * Dp, rows + (i + 1) * Dp, 0.f);
    for (int64_t r = 0; r < R; r += 4) block(std::min<int64_t>(4, R - r), p + r * n + j0, n, rows, count, Dp, acc + r * Dp);
  }
}

template <typename T>
static void weighted_sum_avx2(const float* p, const T* v, float* acc, int64_t R, int64_t n, int64_t D, int64_t Dp) {
  weighted_sum_simd<8>(p, v, acc, R, n, D, Dp, widen_avx2<T>, [](int64_t rows, const float* pr, int64_t n, const float* vr, int64_t count, int64_t Dp, float* a) {
    rows == 4 ? weighted_block_avx2<4>(pr, n, vr, count, Dp, a) : rows == 3 ? weighted_block_avx2<3>(pr, n, vr, count, Dp, a)
    : rows == 2 ? weighted_block_avx2<2>(pr, n, vr, count, Dp, a) : weighted_block_avx2<1>(pr, n, vr, count, Dp, a);
  });
}

template <typename T>
static void weighted_sum_avx512(const float* p, const T* v, float* acc, int64_t R, int64_t n, int64_t D, int64_t Dp) {
  weighted_sum_simd<16>(p, v, acc, R, n, D, Dp, widen_avx512<T>, [](int64_t rows, const float* pr, int64_t n, const float* vr, int64_t count, int64_t Dp, float* a) {
    rows == 4 ? weighted_block_avx512<4>(pr, n, vr, count, Dp, a) : rows == 3 ? weighted_block_avx512<3>(pr, n, vr, count, Dp, a)
    : rows == 2 ? weighted_block_avx512<2>(pr, n, vr, count, Dp, a) : weighted_block_avx512<1>(pr, n, vr, count, Dp, a);
  });
}

// Masks row r's scores (-inf where the slot is empty or later than query_pos[r]) and turns them into
// e^(s - m[r]) in place, m[r] the row's maximum; l[r] = their sum (0, and every p 0, for a row that sees no slot).
static void masked_exp(Isa isa, float* s, const int64_t* key_pos, const int64_t* query_pos, int64_t R, int64_t n, float* m, float* l) {
  for (int64_t r = 0; r < R; ++r) {
    float* row = s + r * n;
    m[r] = kNegInf;
    for (int64_t j = 0; j < n; ++j) {
      if (key_pos[j] < 0 || key_pos[j] > query_pos[r]) row[j] = kNegInf;
      m[r] = std::max(m[r], row[j]);
    }
    l[r] = m[r] == kNegInf ? 0.f : isa == Isa::scalar ? exp_scalar(row, n, m[r]) : exp_avx2(row, n, m[r]);
    if (m[r] == kNegInf) std::fill(row, row + n, 0.f);
  }
}

// One task's partials: for R query rows (query_pos[r]) over n slots (key_pos[j]), each row's maximum
// score m[r], sum of e^(s - m) l[r] and unnormalized output acc[r] (zeroed by the caller).
template <typename T>
static void attend_chunk(Isa isa, const float* q, const T* k, const T* v, const int64_t* key_pos, const int64_t* query_pos, int64_t R, int64_t n,
                         int64_t D, float scale, float* m, float* l, float* acc) {
  std::vector<float> s(R * n);
  if (isa == Isa::scalar || D > kMaxHeadDim) {
    scores_scalar(q, k, s.data(), R, n, D, scale);
    masked_exp(Isa::scalar, s.data(), key_pos, query_pos, R, n, m, l);
    weighted_sum_scalar(s.data(), v, acc, R, n, D);
    return;
  }
  const int64_t width = isa == Isa::avx512 ? 64 : 16, Dp = (D + width - 1) / width * width;
  std::vector<float> qp(R * Dp, 0.f), ap(R * Dp, 0.f);  // q and the output, padded to Dp columns
  for (int64_t r = 0; r < R; ++r) std::copy(q + r * D, q + (r + 1) * D, qp.data() + r * Dp);
  const int64_t last = *std::max_element(query_pos, query_pos + R);
  if (isa == Isa::avx512)
    scores_avx512(qp.data(), k, key_pos, last, s.data(), R, n, D, Dp, scale);
  else
    scores_avx2(qp.data(), k, key_pos, last, s.data(), R, n, D, Dp, scale);
  masked_exp(isa, s.data(), key_pos, query_pos, R, n, m, l);
  if (isa == Isa::avx512)
    weighted_sum_avx512(s.data(), v, ap.data(), R, n, D, Dp);
  else
    weighted_sum_avx2(s.data(), v, ap.data(), R, n, D, Dp);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t d = 0; d < D; ++d) acc[r * D + d] += ap[r * Dp + d];
}

// Each row's output from its tasks' partials m, l [..., chunks, R] and acc [..., chunks, R, D]:
// y = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c with M = max_c m_c -> [..., R, D].
static at::Tensor merge(const at::Tensor& m, const at::Tensor& l, const at::Tensor& acc) {
  const int64_t chunks = m.size(2), R = m.size(3), D = acc.size(4), heads = m.numel() / (chunks * R);
  at::Tensor y = at::empty({m.size(0), m.size(1), R, D}, acc.options());
  const float *mp = m.data_ptr<float>(), *lp = l.data_ptr<float>(), *ap = acc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t r = 0; r < R; ++r) {
      float M = kNegInf, L = 0.f;
      for (int64_t c = 0; c < chunks; ++c) M = std::max(M, mp[(h * chunks + c) * R + r]);
      float* out = yp + (h * R + r) * D;
      std::fill(out, out + D, 0.f);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t i = (h * chunks + c) * R + r;
        const float w = M == kNegInf ? 0.f : std::exp(mp[i] - M);
        L += w * lp[i];
        for (int64_t d = 0; d < D; ++d) out[d] += w * ap[i * D + d];
      }
      if (L > 0.f)
        for (int64_t d = 0; d < D; ++d) out[d] /= L;  // else no slot seen: zeros
    }
  return y;
}

// y [B, H, T, D] for q [B, H, T, D] float32, k and v [B, H_kv, S, D] float32 or float16 (both alike), key_pos
// [B, S] or [B, H_kv, S] and query_pos [B, T] int64. A query that sees no slot gets zeros, as torch's attention gives it.
at::Tensor attend_fp32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_pos, const at::Tensor& query_pos) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(), "kvlab::attend_fp32: q [B, H, T, D], k and v [B, H_kv, S, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kHalf) && v.scalar_type() == k.scalar_type(),
              "kvlab::attend_fp32 takes float32 q, and k and v both float32 or both float16");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && H % Hkv == 0, "kvlab::attend_fp32: q ", q.sizes(), " does not match k ", k.sizes());
  const bool per_head = key_pos.dim() == 3;
  TORCH_CHECK(key_pos.scalar_type() == at::kLong && key_pos.size(0) == B && key_pos.size(-1) == S && (!per_head || key_pos.size(1) == Hkv),
              "kvlab::attend_fp32: key_pos must be int64 [B, S] or [B, H_kv, S], got ", key_pos.sizes());
  TORCH_CHECK(query_pos.scalar_type() == at::kLong && query_pos.dim() == 2 && query_pos.size(0) == B && query_pos.size(1) == T,
              "kvlab::attend_fp32: query_pos must be int64 [B, T], got ", query_pos.sizes());
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), kp = key_pos.contiguous(), qp = query_pos.contiguous();
  const int64_t G = H / Hkv, R = G * T, chunks = (S + kChunk - 1) / kChunk;
  at::Tensor m = at::empty({B, Hkv, chunks, R}, q.options()), l = at::empty_like(m), acc = at::zeros({B, Hkv, chunks, R, D}, q.options());
  std::vector<int64_t> row_pos(B * R);  // the position of each (sequence, row): row r is query head r / T's time r % T
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < R; ++r) row_pos[b * R + r] = qp.data_ptr<int64_t>()[b * T + r % T];
  const Isa isa = kernel_isa();
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  auto run = [&](const auto* keys, const auto* values) {  // float or at::Half
    at::parallel_for(0, B * Hkv * chunks, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t b = task / (Hkv * chunks), h = task / chunks % Hkv, c = task % chunks, j0 = c * kChunk, n = std::min(kChunk, S - j0);
        const int64_t head = b * Hkv + h;
        const int64_t* positions = kp.data_ptr<int64_t>() + (per_head ? head * S : b * S) + j0;
        attend_chunk(isa, qc.data_ptr<float>() + head * R * D, keys + (head * S + j0) * D, values + (head * S + j0) * D, positions, row_pos.data() + b * R, R, n,
                     D, scale, m.data_ptr<float>() + task * R, l.data_ptr<float>() + task * R, acc.data_ptr<float>() + task * R * D);
      }
    });
  };
  if (kc.scalar_type() == at::kHalf)
    run(kc.data_ptr<at::Half>(), vc.data_ptr<at::Half>());
  else
    run(kc.data_ptr<float>(), vc.data_ptr<float>());
  return merge(m, l, acc).view({B, H, T, D});
}
}  // namespace kvlab

TORCH_LIBRARY_FRAGMENT(kvlab, m) { m.def("attend_fp32(Tensor q, Tensor k, Tensor v, Tensor key_pos, Tensor query_pos) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvlab, CPU, m) { m.impl("attend_fp32", &kvlab::attend_fp32); }
