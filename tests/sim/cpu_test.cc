#include "sim/cpu.h"

#include <catch2/catch.hpp>
#include <fstream>
#include <sstream>
#include <string>

namespace kvsim {

// On Linux x86-64 the kernel lists the CPU's features in /proc/cpuinfo: CpuHas must agree with every one.
TEST_CASE("CpuHas agrees with the kernel's /proc/cpuinfo flags", "[cpu]") {
  std::ifstream in("/proc/cpuinfo");
  std::string line, flags;
  while (std::getline(in, line))
    if (line.rfind("flags", 0) == 0) {
      flags = " " + line.substr(line.find(':') + 1) + " ";
      break;
    }
#if defined(__x86_64__)
  REQUIRE_FALSE(flags.empty());
#endif
  if (flags.empty()) {  // not Linux on x86: nothing is claimed
    for (CpuFeature f : {CpuFeature::kAvx2, CpuFeature::kFma, CpuFeature::kAvx512f}) CHECK_FALSE(CpuHas(f));
    return;
  }
  auto listed = [&](const char* name) {
    return flags.find(" " + std::string(name) + " ") != std::string::npos;
  };
  CHECK(CpuHas(CpuFeature::kAvx2) == listed("avx2"));
  CHECK(CpuHas(CpuFeature::kFma) == listed("fma"));
  CHECK(CpuHas(CpuFeature::kAvx512f) == listed("avx512f"));
  CHECK(CpuHas(CpuFeature::kAvx512bw) == listed("avx512bw"));
  CHECK(CpuHas(CpuFeature::kAvx512dq) == listed("avx512dq"));
  CHECK(CpuHas(CpuFeature::kAvx512vl) == listed("avx512vl"));
  CHECK(CpuHas(CpuFeature::kAvx512bf16) == listed("avx512_bf16"));
  CHECK(CpuHas(CpuFeature::kAvx512vnni) == listed("avx512_vnni"));
}

}  // namespace kvsim
