#include "sim/stats.h"

#include <catch2/catch.hpp>
#include <random>

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

TEST_CASE("stats: sample standard deviation", "[stats]") {
  const std::vector<double> v{1, 2, 4};
  // mean 7/3; squared deviations 16/9 + 1/9 + 25/9 = 42/9; / (n - 1) = 7/3.
  CHECK(StdDev(std::span<const double>(v)) == Approx(std::sqrt(7.0 / 3.0)).epsilon(1e-15));
  CHECK(StdDev(std::span<const double>(std::vector<double>{3.5})) == 0);
}

TEST_CASE("stats: bootstrap CI of the mean, hand-checked and brute force", "[stats]") {
  const std::vector<double> v{1, 2, 4};
  // Hand-checked: mt19937_64(5489)'s first outputs are 14514284786278117030, 4620546740167642908 and
  // 13109570281517897720 (the standard's reference sequence); mod 3 they are 1, 0, 2, so the one resample is
  // {2, 1, 4} with mean 7/3, which is then both bounds.
  const Interval one = BootstrapMeanCi(std::span<const double>(v), 1, 5489);
  CHECK(one.low == Approx(7.0 / 3.0).epsilon(1e-15));
  CHECK(one.high == one.low);

  // Brute force: enumerate every resample's mean with a separate loop, sort, take ranks round(0.025 * 1999)
  // = 50 and round(0.975 * 1999) = 1949.
  const std::vector<double> w{0.9, 0.1, 0.5, 0.7, 0.3};
  std::mt19937_64 rng(17);
  std::vector<double> means;
  for (int r = 0; r < 2000; ++r) {
    double s = 0;
    for (int i = 0; i < 5; ++i) s += w[rng() % 5];
    means.push_back(s / 5);
  }
  std::sort(means.begin(), means.end());
  const Interval ci = BootstrapMeanCi(std::span<const double>(w), 2000, 17);
  CHECK(ci.low == means[50]);
  CHECK(ci.high == means[1949]);
  CHECK(ci.low < Mean(w));
  CHECK(ci.high > Mean(w));
  CHECK(ci.low >= 0.1);
  CHECK(ci.high <= 0.9);
  // Reproducible; another seed gives other (but close) bounds; a constant sample has a zero-width interval.
  const Interval again = BootstrapMeanCi(std::span<const double>(w), 2000, 17);
  CHECK(again.low == ci.low);
  CHECK(again.high == ci.high);
  const std::vector<double> c{0.25, 0.25, 0.25};
  const Interval flat = BootstrapMeanCi(std::span<const double>(c), 2000, 3);
  CHECK(flat.low == 0.25);
  CHECK(flat.high == 0.25);
  CHECK(BootstrapMeanCi(std::span<const double>(std::vector<double>{}), 2000, 3).high == 0);
}

}  // namespace kvsim
