#include "sim/blas.h"

#include <cblas.h>
#include <unistd.h>

#include <cstdlib>

namespace kvsim {

CpuVectorSupport ThisCpuVectorSupport() {
  __builtin_cpu_init();
  CpuVectorSupport c;
  c.avx2 = __builtin_cpu_supports("avx2");
  c.fma = __builtin_cpu_supports("fma");
  c.avx512f = __builtin_cpu_supports("avx512f");
  c.avx512bw = __builtin_cpu_supports("avx512bw");
  c.avx512dq = __builtin_cpu_supports("avx512dq");
  c.avx512vl = __builtin_cpu_supports("avx512vl");
  return c;
}

std::string BlasCoreName() {
  const char* name = openblas_get_corename();
  return name != nullptr ? name : "";
}

std::string BlasCoreToRequest(const char* env_coretype, std::string_view chosen,
                              const CpuVectorSupport& cpu) {
  if (env_coretype != nullptr && env_coretype[0] != '\0') return "";  // the user's choice stands
  if (chosen != "Prescott") return "";                                // OpenBLAS knew this CPU
  if (cpu.avx512f && cpu.avx512bw && cpu.avx512dq && cpu.avx512vl) return "SkylakeX";
  if (cpu.avx2 && cpu.fma) return "Haswell";
  return "";
}

void RestartForBlasKernels(char** argv) {
  const std::string core =
      BlasCoreToRequest(std::getenv("OPENBLAS_CORETYPE"), BlasCoreName(), ThisCpuVectorSupport());
  if (core.empty() || argv == nullptr || argv[0] == nullptr) return;
  // The variable set, a second start never restarts again.
  if (setenv("OPENBLAS_CORETYPE", core.c_str(), 1) != 0) return;
  execv("/proc/self/exe", argv);
  unsetenv("OPENBLAS_CORETYPE");  // exec failed: go on with the kernels this process has
}

}  // namespace kvsim
