// Fixed-order cosine products (CosineDots), the first-maximum search and the shared matrix of a head's
// prompt-key cosines (PromptSimilarity) against the per-call product.

#include "sim/similarity.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <thread>

namespace kvsim {
namespace {

std::vector<float> RandomRows(int rows, int d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(rows) * d);
  for (float& v : x) v = normal(rng);
  return x;
}

}  // namespace

TEST_CASE("similarity: every dot product is one FMA chain over k, whatever the tiling", "[similarity]") {
  // Sizes that leave partial row tiles (6) and column panels (16); d not a multiple of 8.
  const int rows = 23, cols = 37, d = 19;
  const std::vector<float> a = RandomRows(rows, d, 1), b = RandomRows(cols, d, 2);
  std::vector<float> c(static_cast<size_t>(rows) * cols);
  CosineDots(a.data(), rows, b.data(), cols, d, c.data(), cols);
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) {
      float s = 0.0f;
      for (int k = 0; k < d; ++k)
        s = std::fma(a[static_cast<size_t>(i) * d + k], b[static_cast<size_t>(j) * d + k], s);
      INFO(i << " " << j);
      REQUIRE(c[static_cast<size_t>(i) * cols + j] == s);
    }
  // A row computed alone, or shifted to another place in its tile, gives the same bits.
  for (int shift : {1, 5, 7}) {
    std::vector<float> c2(static_cast<size_t>(rows - shift) * cols);
    CosineDots(a.data() + static_cast<size_t>(shift) * d, rows - shift, b.data() + d, cols - 1, d, c2.data(),
               cols);
    for (int i = 0; i < rows - shift; ++i)
      for (int j = 0; j < cols - 1; ++j)
        REQUIRE(c2[static_cast<size_t>(i) * cols + j] == c[static_cast<size_t>(i + shift) * cols + j + 1]);
  }
}

TEST_CASE("similarity: the shared matrix answers as the per-call product (ties, zero keys, any slot order)",
          "[similarity]") {
  const int n = 61, d = 10;
  std::vector<float> keys = RandomRows(n, d, 7);
  // Ties: keys 40..44 are scaled copies of key 3 (equal cosines up to rounding of the scaling, and exact
  // duplicates 45, 46 of key 3); key 50 is zero (similar to nothing: 0 everywhere).
  for (int r = 40; r < 45; ++r)
    for (int k = 0; k < d; ++k) keys[r * d + k] = keys[3 * d + k] * static_cast<float>(r - 38);
  for (int r : {45, 46})
    for (int k = 0; k < d; ++k) keys[r * d + k] = keys[3 * d + k];
  for (int k = 0; k < d; ++k) keys[50 * d + k] = 0.0f;
  std::vector<float> norm(keys.size());
  NormalizeRows(keys.data(), n, d, norm.data());
  PromptSimilarity shared(keys.data(), n, d);
  std::mt19937 rng(3);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<int32_t> perm(n);
    for (int i = 0; i < n; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    const int k = 1 + static_cast<int>(rng() % (n - 1));
    std::vector<int32_t> targets(perm.begin(), perm.begin() + k), queries(perm.begin() + k, perm.end());
    if (trial % 2 == 0) std::sort(targets.begin(), targets.end());  // slot order ascending or not
    if (trial == 0) targets = {46, 3, 45, 50, 44};                  // ties between duplicates: first slot
    if (trial == 0) queries = {40, 41, 3, 50, 0, 60};
    std::vector<float> q(queries.size() * d), t(targets.size() * d);
    for (size_t i = 0; i < queries.size(); ++i) std::copy_n(&keys[queries[i] * d], d, &q[i * d]);
    for (size_t i = 0; i < targets.size(); ++i) std::copy_n(&keys[targets[i] * d], d, &t[i * d]);
    std::vector<int> n_call, n_shared;
    std::vector<float> s_call, s_shared;
    // The per-call product (as Merger's fallback path computes it).
    {
      std::vector<float> qn(q.size()), tn(t.size()), sim(queries.size() * targets.size());
      NormalizeRows(q.data(), static_cast<int>(queries.size()), d, qn.data());
      NormalizeRows(t.data(), static_cast<int>(targets.size()), d, tn.data());
      CosineDots(qn.data(), static_cast<int>(queries.size()), tn.data(), static_cast<int>(targets.size()), d,
                 sim.data(), static_cast<int>(targets.size()));
      for (size_t i = 0; i < queries.size(); ++i) {
        const float* row = &sim[i * targets.size()];
        const int best = FirstMaxIndex(row, static_cast<int>(targets.size()));
        n_call.push_back(best);
        s_call.push_back(row[best]);
      }
    }
    REQUIRE(shared.Covers(queries));
    REQUIRE(shared.Covers(targets));
    shared.Nearest(queries, targets, &n_shared, &s_shared);
    INFO("trial " << trial);
    CHECK(n_shared == n_call);
    CHECK(s_shared == s_call);
    if (trial == 0) {
      CHECK(n_shared[2] != 1);  // key 3 vs its exact duplicates 46, 3, 45: the first slot wins the tie
      CHECK(n_shared[2] != 2);
      CHECK(s_shared[3] == 0.0f);
      CHECK(n_shared[3] == 0);  // the zero key: 0 everywhere, first slot
    }
  }
  CHECK(shared.calls() == 20);
  CHECK_FALSE(shared.Covers(std::vector<int32_t>{n}));
  CHECK_FALSE(shared.Covers(std::vector<int32_t>{-1}));
}

TEST_CASE("similarity: concurrent first use computes the matrix once, same answers", "[similarity]") {
  const int n = 300, d = 16;
  const std::vector<float> keys = RandomRows(n, d, 11);
  PromptSimilarity shared(keys.data(), n, d);
  std::vector<int32_t> targets, queries;
  for (int i = 0; i < n; ++i) (i % 3 == 0 ? targets : queries).push_back(i);
  std::vector<int> a, b;
  std::vector<float> sa, sb;
  std::thread t1([&] { shared.Nearest(queries, targets, &a, &sa); });
  std::thread t2([&] { shared.Nearest(queries, targets, &b, &sb); });
  t1.join();
  t2.join();
  CHECK(a == b);
  CHECK(sa == sb);
  CHECK(shared.calls() == 2);
}

}  // namespace kvsim
