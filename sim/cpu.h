#pragma once
// What the CPU running kvsim can do, for code that picks a kernel at run time (the build may target an older
// CPU: every such kernel has a portable path that gives the same results; see each caller).

namespace kvsim {

enum class CpuFeature { kAvx2, kFma, kAvx512f, kAvx512bw, kAvx512dq, kAvx512vl, kAvx512bf16, kAvx512vnni };

// Whether the CPU has `feature` (always false off x86-64 or without GCC/Clang's CPU detection).
inline bool CpuHas(CpuFeature feature) {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();  // static initialisers may run before the runtime's own
  switch (feature) {
    case CpuFeature::kAvx2:
      return __builtin_cpu_supports("avx2") != 0;
    case CpuFeature::kFma:
      return __builtin_cpu_supports("fma") != 0;
    case CpuFeature::kAvx512f:
      return __builtin_cpu_supports("avx512f") != 0;
    case CpuFeature::kAvx512bw:
      return __builtin_cpu_supports("avx512bw") != 0;
    case CpuFeature::kAvx512dq:
      return __builtin_cpu_supports("avx512dq") != 0;
    case CpuFeature::kAvx512vl:
      return __builtin_cpu_supports("avx512vl") != 0;
    case CpuFeature::kAvx512bf16:
      return __builtin_cpu_supports("avx512bf16") != 0;
    case CpuFeature::kAvx512vnni:
      return __builtin_cpu_supports("avx512vnni") != 0;
  }
#endif
  (void)feature;
  return false;
}

}  // namespace kvsim
