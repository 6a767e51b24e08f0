// Tests of sim/blas: which OpenBLAS kernels kvsim asks for, and that its programs run them.

#include "sim/blas.h"

#include <catch2/catch.hpp>
#include <string>

#include "tests/test_util.h"

namespace kvsim {
namespace {

CpuVectorSupport Avx2Fma() {
  CpuVectorSupport c;
  c.avx2 = c.fma = true;
  return c;
}
CpuVectorSupport Avx512() {
  CpuVectorSupport c = Avx2Fma();
  c.avx512f = c.avx512bw = c.avx512dq = c.avx512vl = true;
  return c;
}

TEST_CASE("BlasCoreToRequest: the generic kernels are replaced by the best set the CPU runs") {
  CHECK(BlasCoreToRequest(nullptr, "Prescott", Avx512()) == "SkylakeX");
  CHECK(BlasCoreToRequest("", "Prescott", Avx512()) == "SkylakeX");  // set but empty = unset
  CHECK(BlasCoreToRequest(nullptr, "Prescott", Avx2Fma()) == "Haswell");
  CpuVectorSupport no_vl = Avx512();
  no_vl.avx512vl = false;  // AVX-512 F alone (Knights Landing-like): not SkylakeX's kernels
  CHECK(BlasCoreToRequest(nullptr, "Prescott", no_vl) == "Haswell");
  CpuVectorSupport no_fma = Avx2Fma();
  no_fma.fma = false;
  CHECK(BlasCoreToRequest(nullptr, "Prescott", no_fma).empty());  // nothing better than generic
  CHECK(BlasCoreToRequest(nullptr, "Prescott", CpuVectorSupport{}).empty());
}

TEST_CASE("BlasCoreToRequest: OpenBLAS's own choice and the user's OPENBLAS_CORETYPE stand") {
  CHECK(BlasCoreToRequest(nullptr, "Haswell", Avx512()).empty());  // OpenBLAS knew the CPU
  CHECK(BlasCoreToRequest(nullptr, "Zen", Avx2Fma()).empty());
  CHECK(BlasCoreToRequest(nullptr, "SapphireRapids", Avx512()).empty());
  CHECK(BlasCoreToRequest("Prescott", "Prescott", Avx512()).empty());  // asked for by the user
  CHECK(BlasCoreToRequest("Haswell", "Prescott", Avx512()).empty());
}

TEST_CASE("kvsim runs OpenBLAS's vector kernels on a CPU that has them, unless told otherwise") {
  const CpuVectorSupport cpu = ThisCpuVectorSupport();
  std::string out;
  REQUIRE(testing::RunCommand("env -u OPENBLAS_CORETYPE " + testing::KvsimBinary() + " version", &out) == 0);
  INFO(out);
  REQUIRE(out.find("BLAS: OpenBLAS, ") != std::string::npos);
  // Whatever OpenBLAS chose for this CPU, it is not its generic set when the CPU runs AVX2 + FMA.
  if (cpu.avx2 && cpu.fma) CHECK(out.find("Prescott kernels") == std::string::npos);
  // The user's choice is kept, even the generic one.
  REQUIRE(testing::RunCommand("OPENBLAS_CORETYPE=Prescott " + testing::KvsimBinary() + " version", &out) ==
          0);
  CHECK(out.find("BLAS: OpenBLAS, Prescott kernels") != std::string::npos);
}

}  // namespace
}  // namespace kvsim
