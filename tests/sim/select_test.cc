#include "sim/select.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <functional>
#include <limits>
#include <random>
#include <vector>

namespace kvsim {

TEST_CASE("TopKIndices: largest scores, ascending indices, ties to the lower index", "[select]") {
  const std::vector<float> s{0.5f, 0.9f, 0.5f, 0.1f, 0.9f};
  CHECK(TopKIndices(s, 1) == std::vector<int32_t>{1});        // 0.9 at 1 and 4: the lower index wins
  CHECK(TopKIndices(s, 2) == std::vector<int32_t>{1, 4});     // both 0.9s, ascending
  CHECK(TopKIndices(s, 3) == std::vector<int32_t>{0, 1, 4});  // 0.5 at 0 and 2: index 0
  CHECK(TopKIndices(s, 4) == std::vector<int32_t>{0, 1, 2, 4});
  // All equal: the first k.
  const std::vector<float> flat(6, 1.0f);
  CHECK(TopKIndices(flat, 3) == std::vector<int32_t>{0, 1, 2});
}

TEST_CASE("TopKIndices: k is clamped to [0, n]", "[select]") {
  const std::vector<float> s{3, 1, 2};
  CHECK(TopKIndices(s, 0).empty());
  CHECK(TopKIndices(s, -5).empty());
  CHECK(TopKIndices(s, 3) == std::vector<int32_t>{0, 1, 2});
  CHECK(TopKIndices(s, 10) == std::vector<int32_t>{0, 1, 2});
  CHECK(TopKIndices(std::vector<float>{}, 2).empty());
}

TEST_CASE("TopKIndices matches a full stable sort on random data with many ties", "[select]") {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> level(0, 9);  // 10 distinct values: lots of ties
  for (int trial = 0; trial < 20; ++trial) {
    const int n = 1 + trial * 13;
    std::vector<float> s(n);
    for (float& x : s) x = 0.1f * static_cast<float>(level(rng));
    std::vector<int32_t> order(n);
    for (int i = 0; i < n; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return s[a] > s[b]; });
    for (int k : {0, 1, n / 3, n / 2, n}) {
      std::vector<int32_t> want(order.begin(), order.begin() + k);
      std::sort(want.begin(), want.end());
      CHECK(TopKIndices(s, k) == want);
    }
  }
}

TEST_CASE("SortDescendingNonNegative: hand case", "[select]") {
  std::vector<float> out;
  SortDescendingNonNegative(std::vector<float>{0.25f, 0.0f, 1.0f, 0.5f, 0.25f}, &out);
  CHECK(out == std::vector<float>{1.0f, 0.5f, 0.25f, 0.25f, 0.0f});
  SortDescendingNonNegative(std::vector<float>{}, &out);
  CHECK(out.empty());
}

TEST_CASE("SortDescendingNonNegative matches std::sort, with zeros, denormals and extremes", "[select]") {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::uniform_int_distribution<int> kind(0, 9);
  const float denorm = std::numeric_limits<float>::denorm_min();
  for (int trial = 0; trial < 10; ++trial) {
    const int n = trial * 997 + 1;
    std::vector<float> v(n);
    for (float& x : v) {
      switch (kind(rng)) {
        case 0:
          x = 0.0f;
          break;
        case 1:
          x = -0.0f;
          break;  // allowed: sorts as zero
        case 2:
          x = denorm * static_cast<float>(1 + static_cast<int>(u(rng) * 1000));
          break;
        case 3:
          x = std::numeric_limits<float>::min() * u(rng);
          break;  // subnormal range
        case 4:
          x = std::numeric_limits<float>::max() * u(rng);
          break;
        case 5:
          x = u(rng) * 1e-30f;
          break;
        default:
          x = u(rng);
          break;
      }
    }
    std::vector<float> want = v;
    std::sort(want.begin(), want.end(), std::greater<float>());
    std::vector<float> got;
    SortDescendingNonNegative(v, &got);
    REQUIRE(got.size() == want.size());
    for (int i = 0; i < n; ++i) REQUIRE(got[i] == want[i]);  // -0.0 == 0.0
  }
}

}  // namespace kvsim
