// Merging: nearest neighbour by cosine, the average / pivot / weighted formulas on hand-computed cases,
// the similarity filter, decode-time merges (dissolving a merged slot), and the base+merge wrapper.

#include "policies/merge.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <set>

#include "policies/registry.h"
#include "sim/replay.h"
#include "tests/test_util.h"

namespace kvsim {
namespace {

// Five tokens, d = 2. Keys: k0 (1,0), k1 (0,1), k2 (.9,.1), k3 (.1,.9), k4 (1,1).
// Values: v0 (1,2), v1 (3,4), v2 (5,6), v3 (7,8), v4 (0,0).
struct HandHead {
  TraceMeta meta;
  std::vector<float> keys{1, 0, 0, 1, .9f, .1f, .1f, .9f, 1, 1};
  std::vector<float> values{1, 2, 3, 4, 5, 6, 7, 8, 0, 0};
  HeadContext ctx;
  HandHead() {
    meta.model.head_dim = 2;
    meta.prefill_length = 5;
    meta.tokens.Resize(5);
    ctx.meta = &meta;
    ctx.compress_end = 5;
    ctx.keys = keys.data();
    ctx.values = values.data();
  }
};

std::vector<int32_t> Members(const HeadCache& c, int slot) {
  std::vector<int32_t> out;
  if (c.is_merged(slot))
    for (const auto& [t, w] : c.merged(slot).members) out.push_back(t);
  return out;
}

}  // namespace

TEST_CASE("merge: nearest kept key by cosine, ties to the earliest target", "[merge]") {
  const std::vector<float> q{1, 0, 0, 1, 1, 1, 0, 0};  // (1,0) (0,1) (1,1) and a zero vector
  const std::vector<float> t{2, 0, 0, 3};              // (2,0) (0,3)
  std::vector<int> nearest;
  std::vector<float> sim;
  NearestByCosine(q.data(), 4, t.data(), 2, 2, &nearest, &sim);
  CHECK(nearest == std::vector<int>{0, 1, 0, 0});
  CHECK(sim[0] == Approx(1.0f));
  CHECK(sim[1] == Approx(1.0f));
  CHECK(sim[2] == Approx(0.70710678f));  // cos 45°, tie between both targets -> the first
  CHECK(sim[3] == 0.0f);                 // zero vectors are similar to nothing
}

TEST_CASE("merge: nearest by cosine matches std::max_element over many targets (8-lane search)", "[merge]") {
  // 21 targets in 2-D at angles that repeat, so every query has tied maxima spread over several lanes and
  // the tail; the first maximum must win, as std::max_element's does.
  constexpr int kTargets = 21, kQueries = 7;
  std::vector<float> t, q;
  for (int i = 0; i < kTargets; ++i) {
    const double a = 0.3 * (i % 6);
    t.push_back(static_cast<float>(std::cos(a)));
    t.push_back(static_cast<float>(std::sin(a)));
  }
  for (int i = 0; i < kQueries; ++i) {
    const double a = 0.3 * i - 0.05;
    q.push_back(static_cast<float>(std::cos(a)));
    q.push_back(static_cast<float>(std::sin(a)));
  }
  std::vector<int> nearest;
  std::vector<float> sim;
  NearestByCosine(q.data(), kQueries, t.data(), kTargets, 2, &nearest, &sim);
  for (int i = 0; i < kQueries; ++i) {
    std::vector<float> row(kTargets);
    for (int j = 0; j < kTargets; ++j) {
      const double nt = std::hypot(t[2 * j], t[2 * j + 1]), nq = std::hypot(q[2 * i], q[2 * i + 1]);
      row[j] =
          static_cast<float>((t[2 * j] / nt) * (q[2 * i] / nq) + (t[2 * j + 1] / nt) * (q[2 * i + 1] / nq));
    }
    const int expect = std::min(i, 5);  // the nearest angle's first target (i = 6 is nearest to 5 * 0.3)
    CHECK(nearest[i] == expect);
    CHECK(sim[i] == Approx(row[expect]).margin(1e-6));
  }
}

TEST_CASE("merge: nearest by cosine does not depend on where a row falls in the 8-row normalisation blocks",
          "[merge]") {
  // Rows are normalised eight at a time (interleaved sums) with a row-at-a-time tail; each row's result must
  // not depend on which path it took: the same query rows shifted by 3 give the same nearest targets and
  // cosines. (Not compared bit for bit: the BLAS product itself may round a row differently at another
  // position in the block; that the engine's results did not change is checked with
  // bench/compare_sweeps.py on whole sweeps.)
  constexpr int kTargets = 23, kQueries = 19, kD = 37;
  std::vector<float> t(kTargets * kD), q(kQueries * kD);
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<float>(std::sin(0.37 * i + 0.1) * (1 + i % 5));
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(std::cos(0.53 * i - 0.2) * (1 + i % 3));
  std::vector<int> n_all, n_shift;
  std::vector<float> s_all, s_shift;
  NearestByCosine(q.data(), kQueries, t.data(), kTargets, kD, &n_all, &s_all);
  NearestByCosine(q.data() + 3 * kD, kQueries - 3, t.data(), kTargets, kD, &n_shift, &s_shift);
  for (int i = 3; i < kQueries; ++i) {
    CHECK(n_all[i] == n_shift[i - 3]);
    CHECK(s_all[i] == Approx(s_shift[i - 3]).epsilon(1e-6));
    double dot = 0, nq = 0, nt = 0;  // and it is the cosine
    for (int k = 0; k < kD; ++k) {
      dot += static_cast<double>(q[i * kD + k]) * t[n_all[i] * kD + k];
      nq += static_cast<double>(q[i * kD + k]) * q[i * kD + k];
      nt += static_cast<double>(t[n_all[i] * kD + k]) * t[n_all[i] * kD + k];
    }
    CHECK(s_all[i] == Approx(dot / std::sqrt(nq * nt)).margin(1e-5));
  }
}

TEST_CASE("merge: average (MEDA Eq. 12) of keys and values with the key-based assignment", "[merge]") {
  HandHead h;
  HeadCache cache(2);
  Merger m(policy::AVERAGE, policy::MERGE_ALL);
  const std::vector<int32_t> kept{0, 1}, evicted{2, 3, 4};
  m.KeepAndMerge(h.ctx, kept, evicted, &cache);
  REQUIRE(cache.size() == 2);
  // c(2) = 0 (cos .994 vs .110), c(3) = 1, c(4) = 0 (tie .707: the earliest slot).
  CHECK(Members(cache, 0) == std::vector<int32_t>{2, 4});
  CHECK(Members(cache, 1) == std::vector<int32_t>{3});
  // k_0 = (k0 + k2 + k4) / 3 = (2.9, 1.1) / 3; v_0 = (v0 + v2 + v4) / 3 = (2, 8/3).
  CHECK(cache.merged(0).key[0] == Approx(2.9 / 3));
  CHECK(cache.merged(0).key[1] == Approx(1.1 / 3));
  CHECK(cache.merged(0).value[0] == Approx(2.0));
  CHECK(cache.merged(0).value[1] == Approx(8.0 / 3));
  // k_1 = (k1 + k3) / 2 = (.05, .95); v_1 = (5, 6).
  CHECK(cache.merged(1).key[0] == Approx(0.05));
  CHECK(cache.merged(1).key[1] == Approx(0.95));
  CHECK(cache.merged(1).value[0] == Approx(5.0));
  CHECK(cache.merged(1).value[1] == Approx(6.0));
  CHECK(cache.merged(0).members[0].second == 1.0f);
}

TEST_CASE("merge: Release frees the running sums but leaves the merged slots as they are", "[merge]") {
  // MEDA / LOOK-M merge once and then Release: the cache keeps its merges; a later batch starts afresh.
  HandHead h;
  HeadCache cache(2);
  Merger m(policy::AVERAGE, policy::MERGE_ALL);
  m.KeepAndMerge(h.ctx, std::vector<int32_t>{0, 1}, std::vector<int32_t>{2, 3}, &cache);
  const std::vector<float> key0 = cache.merged(0).key, value1 = cache.merged(1).value;
  m.Release();
  REQUIRE(cache.size() == 2);
  CHECK(Members(cache, 0) == std::vector<int32_t>{2});
  CHECK(Members(cache, 1) == std::vector<int32_t>{3});
  CHECK(cache.merged(0).key == key0);
  CHECK(cache.merged(1).value == value1);
  // Without the sums, token 4 (nearest: slot 0) merges into slot 0 as if slot 0 were its plain anchor
  // merged with nothing: the slot's members are {4} only, its key (k0 + k4) / 2 from the anchor's original.
  m.MergeTokens(h.ctx, std::vector<int32_t>{4}, &cache);
  CHECK(Members(cache, 0) == std::vector<int32_t>{4});
}

TEST_CASE("merge: pivot (LOOK-M) averages each evicted token with its pivot first", "[merge]") {
  HandHead h;
  HeadCache cache(2);
  Merger m(policy::PIVOT, policy::MERGE_ALL);
  m.KeepAndMerge(h.ctx, std::vector<int32_t>{0, 1}, std::vector<int32_t>{2, 3, 4}, &cache);
  // k~2 = (k2 + k0)/2 = (.95, .05), k~4 = (k4 + k0)/2 = (1, .5); k_0 = mean(k0, k~2, k~4) = (2.95, .55)/3.
  CHECK(cache.merged(0).key[0] == Approx(2.95 / 3));
  CHECK(cache.merged(0).key[1] == Approx(0.55 / 3));
  // v~2 = (3, 4), v~4 = (.5, 1); v_0 = mean(v0, v~2, v~4) = (4.5, 7) / 3.
  CHECK(cache.merged(0).value[0] == Approx(4.5 / 3));
  CHECK(cache.merged(0).value[1] == Approx(7.0 / 3));
  // k_1 = mean(k1, (k3 + k1)/2) = (.05/2... ) = ((0,1) + (.05,.95)) / 2 = (.025, .975).
  CHECK(cache.merged(1).key[0] == Approx(0.025));
  CHECK(cache.merged(1).key[1] == Approx(0.975));
  CHECK(cache.merged(1).members[0].second == 0.5f);
}

TEST_CASE("merge: weighted (LOOK-M) scales by the similarity, without renormalising", "[merge]") {
  HandHead h;
  HeadCache cache(2);
  Merger m(policy::WEIGHTED, policy::MERGE_ALL);
  m.KeepAndMerge(h.ctx, std::vector<int32_t>{0, 1}, std::vector<int32_t>{2, 3, 4}, &cache);
  // s2 = .9 / |(.9,.1)| = .99388373, s4 = .70710678; k_0 = (k0 + s2 k2 + s4 k4) / 3.
  CHECK(cache.merged(0).key[0] == Approx(0.86720071));
  CHECK(cache.merged(0).key[1] == Approx(0.26883172));
  CHECK(cache.merged(0).value[0] == Approx(1.98980622));
  CHECK(cache.merged(0).value[1] == Approx(2.65443414));
  CHECK(cache.merged(0).members[0].second == Approx(0.99388373));
  CHECK(cache.merged(0).members[1].second == Approx(0.70710678));
}

TEST_CASE("merge: the above-mean filter drops dissimilar evicted tokens", "[merge]") {
  HandHead h;
  HeadCache cache(2);
  Merger m(policy::AVERAGE, policy::ABOVE_MEAN_SIMILARITY);
  m.KeepAndMerge(h.ctx, std::vector<int32_t>{0, 1}, std::vector<int32_t>{2, 3, 4}, &cache);
  // Best similarities .994, .994, .707: mean .898, so token 4 is dropped.
  CHECK(Members(cache, 0) == std::vector<int32_t>{2});
  CHECK(Members(cache, 1) == std::vector<int32_t>{3});
  CHECK(cache.merged(0).key[0] == Approx(0.95));
  CHECK(cache.merged(0).key[1] == Approx(0.05));
}

TEST_CASE("merge: NO_MERGE only keeps", "[merge]") {
  HandHead h;
  HeadCache cache(2);
  Merger m(policy::NO_MERGE, policy::MERGE_ALL);
  m.KeepAndMerge(h.ctx, std::vector<int32_t>{0, 1}, std::vector<int32_t>{2, 3, 4}, &cache);
  CHECK_FALSE(cache.has_merges());
  CHECK(cache.CoveredTokens() == std::vector<int32_t>{0, 1});
}

TEST_CASE("merge: an evicted merged slot dissolves into the others, members included", "[merge]") {
  HandHead h;
  HeadCache cache(2);
  Merger m(policy::AVERAGE, policy::MERGE_ALL);
  m.KeepAndMerge(h.ctx, std::vector<int32_t>{0, 1}, std::vector<int32_t>{2, 3, 4}, &cache);
  const std::vector<int32_t> before{0, 1};
  cache.EvictSlot(0);  // a decode-evicting policy drops anchor 0 (which holds 2 and 4)
  m.Reconcile(h.ctx, before, &cache);
  REQUIRE(cache.size() == 1);
  CHECK(cache.token(0) == 1);
  const std::vector<int32_t> members = Members(cache, 0);
  CHECK(std::set<int32_t>(members.begin(), members.end()) == std::set<int32_t>{0, 2, 3, 4});
  // Average of every original key: (k0 + k1 + k2 + k3 + k4) / 5 = (3, 3) / 5.
  CHECK(cache.merged(0).key[0] == Approx(0.6));
  CHECK(cache.merged(0).key[1] == Approx(0.6));
  CHECK(cache.merged(0).value[0] == Approx(16.0 / 5));
  CHECK(cache.merged(0).value[1] == Approx(20.0 / 5));
}

TEST_CASE("merge: Reconcile restores merges a policy dropped by rebuilding the cache", "[merge]") {
  HandHead h;
  HeadCache cache(2);
  Merger m(policy::AVERAGE, policy::MERGE_ALL);
  m.KeepAndMerge(h.ctx, std::vector<int32_t>{0, 1}, std::vector<int32_t>{2, 3, 4}, &cache);
  const std::vector<float> key0 = cache.merged(0).key;
  const std::vector<int32_t> before{0, 1};
  cache.Assign(before);  // same anchors, merges gone
  m.Reconcile(h.ctx, before, &cache);
  REQUIRE(cache.is_merged(0));
  CHECK(cache.merged(0).key == key0);
  CHECK(Members(cache, 1) == std::vector<int32_t>{3});
}

TEST_CASE("merge wrapper: snapkv+average merges every evicted prompt token", "[merge]") {
  MemoryTrace trace = testing::MakeTinyTrace();
  auto plain = PolicyRegistry::Default().Create("snapkv", std::vector<std::string>{"window=4"});
  auto merged = PolicyRegistry::Default().Create("snapkv+average", std::vector<std::string>{"window=4"});
  REQUIRE(plain.ok());
  REQUIRE(merged.ok());
  std::vector<RunSpec> runs{RunSpec{*plain, "plain", 0, 6}, RunSpec{*merged, "merged", 0, 6}};
  auto res = Replay(trace, runs, ReplayOptions{.threads = 1});
  REQUIRE(res.ok());
  const Metrics &a = (*res)[0].metrics(), &b = (*res)[1].metrics();
  // Same selection; the anchors of the merged slots move from retained to merged_anchor mass (their key
  // and value were replaced), so the two add up to the plain run's retained mass. The 18 evicted prompt
  // tokens per head are merged in.
  CHECK(a.merged_anchor_mass_mean() == 0);
  CHECK(b.merged_anchor_mass_mean() > 0);
  CHECK(b.retained_mass_mean() < a.retained_mass_mean());
  CHECK(b.retained_mass_mean() + b.merged_anchor_mass_mean() == Approx(a.retained_mass_mean()).margin(1e-6));
  CHECK(a.merged_tokens_mean() == 0);
  CHECK(b.merged_tokens_mean() == 24 - 6);
  CHECK(b.merged_slots_mean() >= 1);
  CHECK(b.merge_members_max() >= (24.0 - 6) / 6);
  CHECK(b.covered_mass_mean() > a.covered_mass_mean() + 0.05);
  CHECK(b.bound_checks() == 0);  // the eviction bound does not apply to merged caches
  CHECK((*res)[1].parameters().find("merge: AVERAGE") != std::string::npos);
}

TEST_CASE("merge wrapper: h2o+average covers every token it ever evicted", "[merge]") {
  MemoryTrace trace = testing::MakeTinyTrace();
  auto p = PolicyRegistry::Default().Create("h2o+average");
  REQUIRE(p.ok());
  std::vector<RunSpec> runs{RunSpec{*p, "h2o+average", 0, 5}};
  auto res = Replay(trace, runs, ReplayOptions{.threads = 1});
  REQUIRE(res.ok());
  const RunResult& r = (*res)[0];
  const TraceMeta& meta = trace.meta();
  // At the last step the cache holds 5 slots per head; every other token seen (n + S in all) is merged in.
  const double last =
      r.timeline(r.timeline_size() - 1).kv_tokens() / (meta.model.num_layers * meta.model.num_kv_heads);
  CHECK(last == 5);
  CHECK(r.metrics().merged_tokens_mean() == meta.total_tokens() - 5);
  CHECK(r.metrics().covered_mass_mean() == Approx(1.0).margin(1e-5));
}

}  // namespace kvsim
