// The instruction set every kernel of this library takes, chosen once per process: the widest the CPU
// has (AVX-512F, else AVX2 with FMA and F16C, else scalar C++), or KVLAB_KERNEL_ISA=scalar|avx2|avx512 where the CPU
// has it (tests run each path on one machine); plus helpers the SIMD paths share.
#pragma once
#include <immintrin.h>

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

}  // namespace kvlab
