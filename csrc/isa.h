// The instruction set a kernel runs with, chosen at run time: the best this CPU has (AVX-512, AVX2, or
// plain scalar code), or HF_ZERO_CPU_ADAM_ISA (avx512, avx2, scalar) when set, e.g. to test every path on
// one machine. One choice for every hf_zero kernel (the variable keeps its first kernel's name).
#pragma once
#include <c10/util/Exception.h>
#include <cstdlib>
#include <cstring>

enum class Isa { kScalar, kAvx2, kAvx512 };

inline Isa supported_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::kAvx2;
  return Isa::kScalar;
}

inline const char* isa_name(Isa isa) {
  return isa == Isa::kAvx512 ? "avx512" : isa == Isa::kAvx2 ? "avx2" : "scalar";
}

inline Isa active_isa() {
  static const Isa isa = [] {
    Isa best = supported_isa();
    const char* asked = std::getenv("HF_ZERO_CPU_ADAM_ISA");
    if (asked == nullptr || *asked == '\0') return best;
    for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
      if (std::strcmp(asked, isa_name(isa)) == 0) {
        TORCH_CHECK(isa <= best, "HF_ZERO_CPU_ADAM_ISA=", asked, " but this CPU supports at most ", isa_name(best));
        return isa;
      }
    }
    TORCH_CHECK(false, "HF_ZERO_CPU_ADAM_ISA must be one of avx512, avx2, scalar; got ", asked);
  }();
  return isa;
}

