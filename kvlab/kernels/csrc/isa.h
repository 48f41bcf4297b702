// The instruction set every kernel of this library takes, chosen once per process: the widest the CPU
// has (AVX-512F, else AVX2 with FMA and F16C, else scalar C++), or KVLAB_KERNEL_ISA=scalar|avx2|avx512 where the CPU
// has it (tests run each path on one machine); plus helpers the SIMD paths share.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace kvlab {

enum class Isa { scalar = 0, avx2 = 1, avx512 = 2 };

inline Isa widest_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return Isa::avx2;
  return Isa::scalar;
}

// The path every kernel of this library takes: the widest the CPU has, or KVLAB_KERNEL_ISA's if the CPU has it.
inline Isa kernel_isa() {
  static const Isa chosen = [] {
    Isa widest = widest_isa();
    const char* forced = std::getenv("KVLAB_KERNEL_ISA");
    if (forced == nullptr || *forced == '\0') return widest;
    std::string name(forced);
    Isa want = name == "scalar" ? Isa::scalar : name == "avx2" ? Isa::avx2 : name == "avx512" ? Isa::avx512 : widest;
    if (name != "scalar" && name != "avx2" && name != "avx512")
      throw std::runtime_error("KVLAB_KERNEL_ISA must be scalar, avx2 or avx512, got " + name);
    if (static_cast<int>(want) > static_cast<int>(widest))
      throw std::runtime_error("KVLAB_KERNEL_ISA=" + name + ": this CPU lacks it");
    return want;
  }();
  return chosen;
}

// Whether the AVX-512 path may also take AVX512-VNNI's byte dot products (vpdpbusd on 256-bit vectors).
inline bool has_avx512_vnni() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
  }();
  return has;
}

inline const char* isa_name(Isa isa) {
  return isa == Isa::avx512 ? "avx512" : isa == Isa::avx2 ? "avx2" : "scalar";
}

__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for 8 or 16 floats (Cephes' expf: x = n ln2 + f, |f| <= ln2 / 2, a degree-5 polynomial in f, times 2^n):
// within 2 ulp over [-87.3, 88.3], x clamped to that range (e^-87.3 ~ 1e-38 stands for 0, e^88.3 ~ 2e38 for inf).
#define KVLAB_EXP_BODY(V, SET1, MAX, MIN, MUL, ADD, FMA, FNMA, ROUND, CVT_I, ADD_I, SLLI, CAST_PS, SET1_I)                       \
  x = MIN(MAX(x, SET1(-87.3f)), SET1(88.3f));                                                                               \
  const V n = ROUND(MUL(x, SET1(1.44269504088896341f)));                                                                    \
  V f = FNMA(n, SET1(0.693359375f), x);                                                                                    \
  f = FNMA(n, SET1(-2.12194440e-4f), f);                                                                                   \
  V p = SET1(1.9875691500e-4f);                                                                                            \
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) p = FMA(p, f, SET1(c)); \
  p = FMA(p, MUL(f, f), ADD(f, SET1(1.f)));                                                                               \
  return MUL(p, CAST_PS(SLLI(ADD_I(CVT_I(n), SET1_I(127)), 23)));

__attribute__((target("avx2,fma"))) inline __m256 round256(__m256 x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
__attribute__((target("avx512f"))) inline __m512 round512(__m512 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

__attribute__((target("avx2,fma"))) inline __m256 exp256(__m256 x) {
  KVLAB_EXP_BODY(__m256, _mm256_set1_ps, _mm256_max_ps, _mm256_min_ps, _mm256_mul_ps, _mm256_add_ps, _mm256_fmadd_ps, _mm256_fnmadd_ps, round256,
                 _mm256_cvtps_epi32, _mm256_add_epi32, _mm256_slli_epi32, _mm256_castsi256_ps, _mm256_set1_epi32)
}

__attribute__((target("avx512f"))) inline __m512 exp512(__m512 x) {
  KVLAB_EXP_BODY(__m512, _mm512_set1_ps, _mm512_max_ps, _mm512_min_ps, _mm512_mul_ps, _mm512_add_ps, _mm512_fmadd_ps, _mm512_fnmadd_ps, round512,
                 _mm512_cvtps_epi32, _mm512_add_epi32, _mm512_slli_epi32, _mm512_castsi512_ps, _mm512_set1_epi32)
}

#undef KVLAB_EXP_BODY

// Float32, float16 or bfloat16 elements as float32 vectors: 8 (AVX2, F16C converting float16) or 16 (AVX-512) at a time.
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// bfloat16 elements are a float32's upper 16 bits: widened by a shift.
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
__attribute__((target("avx512f"))) inline __m512 load16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// A mask of the first n of 8 float lanes (none for n <= 0, all from 8), for _mm256_maskload_ps / _mm256_maskstore_ps.
__attribute__((target("avx2"))) inline __m256i first_lanes8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::clamp<int64_t>(n, 0, 8))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Unrolls a loop over a micro-kernel's rows. GCC keeps an array of accumulators in registers only when every loop
// indexing it is unrolled; otherwise it also stores each one to the stack after every multiply-add (gemm.h's panel:
// 12 stores a k on AVX2, 28 on AVX-512; the AVX2 product at a third of the FMA units' rate on a Zen 2).
#define KVLAB_ROWS_UNROLLED _Pragma("GCC unroll 16")

// Asks for the cache lines `kStreamAhead` bytes past [p, p + bytes) into L2: a weight stream read straight
// through runs ahead of the hardware prefetcher this way (decode's float32 products on a Zen 4: 22-28 GB/s
// without, 25-31 with; 2-32 KB ahead measured alike). A line past the weight's end is only a hint: never a fault.
constexpr int64_t kStreamAhead = 8192;
inline void prefetch_ahead(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p) + kStreamAhead;
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T1);
}

// Lane i of the result is the sum of v[i]'s lanes: a transpose-and-add tree, three instructions per sum.
__attribute__((target("avx512f"))) inline __m512 sum_lanes16(const __m512* v) {
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

}  // namespace kvlab
