#include "sim/blas.h"

#include <cblas.h>
#include <unistd.h>

#include <cstdlib>

#include "sim/cpu.h"

namespace kvsim {

CpuVectorSupport ThisCpuVectorSupport() {
  CpuVectorSupport c;
  c.avx2 = CpuHas(CpuFeature::kAvx2);
  c.fma = CpuHas(CpuFeature::kFma);
  c.avx512f = CpuHas(CpuFeature::kAvx512f);
  c.avx512bw = CpuHas(CpuFeature::kAvx512bw);
  c.avx512dq = CpuHas(CpuFeature::kAvx512dq);
  c.avx512vl = CpuHas(CpuFeature::kAvx512vl);
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
