#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "sim/blas.h"

// The tests run on the OpenBLAS kernels the kvsim binary runs (sim/blas.h).
int main(int argc, char** argv) {
  kvsim::RestartForBlasKernels(argv);
  return Catch::Session().run(argc, argv);
}
