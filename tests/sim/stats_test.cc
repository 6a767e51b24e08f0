#include "sim/stats.h"

#include <catch2/catch.hpp>

namespace kvsim {

TEST_CASE("stats: mean and nearest-rank quantiles", "[stats]") {
  const std::vector<float> v{5, 1, 4, 2, 3};
  CHECK(Mean(v) == 3.0);
  CHECK(Quantile(v, 0) == 1);
  CHECK(Quantile(v, 0.5) == 3);
  CHECK(Quantile(v, 1) == 5);
  CHECK(Quantile(v, 0.95) == 5);  // index round(0.95 * 4) = 4
  CHECK(Quantile(v, 0.05) == 1);  // index round(0.2) = 0
  CHECK(Quantile(v, 0.4) == 3);   // index round(1.6) = 2
  const std::vector<double> sorted{1, 2, 3, 4};
  CHECK(SortedQuantile(sorted, 0.5) == 3);   // index round(1.5) = 2: halves round up
  CHECK(SortedQuantile(sorted, 0.25) == 2);  // index round(0.75) = 1
  CHECK(Mean(std::vector<double>{}) == 0);
  CHECK(Quantile(std::vector<float>{}, 0.5) == 0);
  CHECK(SortedQuantile(std::vector<double>{}, 0.5) == 0);
}

}  // namespace kvsim
