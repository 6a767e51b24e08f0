#pragma once
// The BLAS library that runs kvsim's dense products (OpenBLAS), and which of its kernel sets runs them.
//
// OpenBLAS picks its kernels when it is loaded, from the CPU's model number. A CPU newer than the library
// (Debian 12's OpenBLAS 0.3.21 on an Emerald Rapids Xeon, family 6 model 207, for one) gets its generic
// "Prescott" kernels (SSE3), several times slower than the AVX2 or AVX-512 kernels the CPU can run: the
// 45-run demo sweep took 60–68 s instead of 39–41 s (docs/performance.md, "Round 25"). OpenBLAS's own knob,
// the environment variable OPENBLAS_CORETYPE, is read only at load time, so kvsim's programs restart
// themselves once with it set (RestartForBlasKernels) before doing anything else.

#include <string>
#include <string_view>

namespace kvsim {

// The instruction-set extensions that decide which OpenBLAS kernels a CPU can run.
struct CpuVectorSupport {
  bool avx2 = false, fma = false;
  bool avx512f = false, avx512bw = false, avx512dq = false, avx512vl = false;
};
// This CPU's, as the CPU and the operating system report them (CpuHas, sim/cpu.h; all false off x86-64).
CpuVectorSupport ThisCpuVectorSupport();

// The OpenBLAS kernel set this process runs ("Haswell", "SkylakeX", "Zen", ...; "Prescott" = generic).
std::string BlasCoreName();

// The OpenBLAS kernel set to ask for (the value for OPENBLAS_CORETYPE), or "" to leave OpenBLAS's choice:
// only when OPENBLAS_CORETYPE is unset (`env_coretype` null or empty) and OpenBLAS fell back to its generic
// kernels (`chosen` == "Prescott") on a CPU that runs AVX-512 F/BW/DQ/VL ("SkylakeX") or AVX2 + FMA
// ("Haswell").
std::string BlasCoreToRequest(const char* env_coretype, std::string_view chosen, const CpuVectorSupport& cpu);

// Called first in main(): when BlasCoreToRequest asks for a kernel set, sets OPENBLAS_CORETYPE and
// re-executes this program (/proc/self/exe) with the same arguments. Returns when nothing is to be done, or
// when the restart failed (then the generic kernels run: the same metrics, slower, their last bits their
// own).
void RestartForBlasKernels(char** argv);

}  // namespace kvsim
