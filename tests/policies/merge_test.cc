// Merging: nearest neighbour by cosine, the average / pivot / weighted formulas on hand-computed cases,
// the similarity filter, decode-time merges (dissolving a merged slot), and the base+merge wrapper.

#include "policies/merge.h"

#include <algorithm>
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "policies/merge_screen.h"
#include "policies/merge_screen_int16.h"
#include "policies/registry.h"
#include "sim/cpu.h"
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

namespace {

// Keys with exact duplicates (ties), zero rows and rows that differ only in scale, d = 128 like the traces.
std::vector<float> AwkwardKeys(int rows, int d, uint32_t seed) {
  std::vector<float> base(static_cast<size_t>(rows) * d);
  uint32_t s = seed;
  for (float& v : base) {
    s = s * 1664525u + 1013904223u;
    v = static_cast<float>(static_cast<int>(s >> 9) % 2001 - 1000) / 997.0f;
  }
  std::vector<float> x = base;
  for (int r = 0; r < rows; ++r) {
    float* row = x.data() + static_cast<size_t>(r) * d;
    const float* src = base.data() + static_cast<size_t>(r) * d;
    if (r % 7 == 3 && r >= 7) std::copy(src - 7 * d, src - 6 * d, row);  // exact duplicate of row r - 7
    if (r % 13 == 9 && r >= 13)                                          // row r - 13's direction, x4
      std::transform(src - 13 * d, src - 12 * d, row, [](float v) { return 4.0f * v; });
    if (r % 11 == 5) std::fill(row, row + d, 0.0f);  // zero key
  }
  return x;
}

}  // namespace

TEST_CASE("merge: nearest by cosine from row pointers equals the contiguous form, with reused scratch",
          "[merge]") {
  // MergeTokens hands NearestByCosine the cache's keys in place (row pointers, in any order) and the search
  // reuses per-thread buffers across calls: the same rows, scattered or contiguous, before or after a larger
  // or smaller call, and on a fresh thread, give the same targets and the same bits. 600 queries span three
  // 256-row blocks; duplicates make ties (the first target must win), zero keys have similarity 0.
  constexpr int d = 128;
  for (const auto& [nq, nt] :
       std::vector<std::pair<int, int>>{{600, 300}, {1, 1}, {37, 1}, {1, 500}, {260, 17}}) {
    const std::vector<float> q = AwkwardKeys(nq, d, 7u + nq), t = AwkwardKeys(nt, d, 11u + nt);
    std::vector<int> n_fresh, n_big, n_ptr;
    std::vector<float> s_fresh, s_big, s_ptr;
    std::thread([&] { NearestByCosine(q.data(), nq, t.data(), nt, d, &n_fresh, &s_fresh); }).join();
    {
      const std::vector<float> big = AwkwardKeys(700, d, 3u);  // fills the scratch with other rows first
      std::vector<int> n;
      std::vector<float> s;
      NearestByCosine(big.data(), 700, big.data(), 700, d, &n, &s);
    }
    NearestByCosine(q.data(), nq, t.data(), nt, d, &n_big, &s_big);
    // The same rows at scattered addresses: each row copied into its own buffer, in reverse order.
    std::vector<std::vector<float>> qr(nq), tr(nt);
    std::vector<const float*> qp(nq), tp(nt);
    for (int i = nq - 1; i >= 0; --i) {
      qr[i].assign(q.begin() + i * d, q.begin() + (i + 1) * d);
      qp[i] = qr[i].data();
    }
    for (int j = nt - 1; j >= 0; --j) {
      tr[j].assign(t.begin() + j * d, t.begin() + (j + 1) * d);
      tp[j] = tr[j].data();
    }
    NearestByCosine(qp.data(), nq, tp.data(), nt, d, &n_ptr, &s_ptr);
    CHECK(n_big == n_fresh);
    CHECK(n_ptr == n_fresh);
    CHECK(std::memcmp(s_big.data(), s_fresh.data(), nq * sizeof(float)) == 0);
    CHECK(std::memcmp(s_ptr.data(), s_fresh.data(), nq * sizeof(float)) == 0);
    int zeros = 0;
    for (int i = 0; i < nq; ++i) {
      const bool zero =
          std::all_of(q.begin() + i * d, q.begin() + (i + 1) * d, [](float v) { return v == 0; });
      if (zero) CHECK(s_fresh[i] == 0.0f);
      zeros += zero;
      // A maximum (within the product's rounding; which of two tied targets wins is checked bit for bit
      // above against the contiguous form, and on exact ties in the 2-D cases), its cosine the double one.
      const float* qi = q.data() + static_cast<size_t>(i) * d;
      auto cosine = [&](int j) {
        const float* tj = t.data() + static_cast<size_t>(j) * d;
        double dot = 0, a = 0, b = 0;
        for (int k = 0; k < d; ++k) {
          dot += static_cast<double>(qi[k]) * tj[k];
          a += static_cast<double>(qi[k]) * qi[k];
          b += static_cast<double>(tj[k]) * tj[k];
        }
        return a > 0 && b > 0 ? dot / std::sqrt(a * b) : 0.0;
      };
      const int best = n_fresh[i];
      REQUIRE(best >= 0);
      REQUIRE(best < nt);
      CHECK(s_fresh[i] == Approx(cosine(best)).margin(1e-5));
      double most = -2;
      for (int j = 0; j < nt; ++j) most = std::max(most, cosine(j));
      CHECK(most <= cosine(best) + 1e-5);
    }
    if (nq >= 260) CHECK(zeros > 10);
  }
}

TEST_CASE("merge: many tokens into many slots, every strategy x filter, match the formulas; merge-once too",
          "[merge]") {
  // 300 kept slots and 900 evicted tokens (the running sums' map grows while tokens join): each slot's key
  // and value are (a k_a + sum c_e k_e) / (1 + m) over exactly the tokens NearestByCosine assigns to it and
  // the filter keeps, in token order, with c_e = 1 / 0.5 / s_e and a = 1 (1 + m/2 for pivot).
  constexpr int d = 128, kKept = 300, kEvicted = 900, n = kKept + kEvicted;
  const std::vector<float> keys = AwkwardKeys(n, d, 5u), values = AwkwardKeys(n, d, 9u);
  TraceMeta meta;
  meta.model.head_dim = d;
  meta.prefill_length = n;
  meta.tokens.Resize(n);
  HeadContext ctx;
  ctx.meta = &meta;
  ctx.compress_end = n;
  ctx.keys = keys.data();
  ctx.values = values.data();
  std::vector<int32_t> kept, evicted;
  for (int32_t j = 0; j < n; ++j) (j % 4 == 1 ? kept : evicted).push_back(j);
  std::vector<float> q, t;
  for (int32_t j : evicted) q.insert(q.end(), keys.begin() + j * d, keys.begin() + (j + 1) * d);
  for (int32_t j : kept) t.insert(t.end(), keys.begin() + j * d, keys.begin() + (j + 1) * d);
  std::vector<int> nearest;
  std::vector<float> sim;
  NearestByCosine(q.data(), kEvicted, t.data(), kKept, d, &nearest, &sim);
  double mean = 0;
  for (float s : sim) mean += s;
  mean /= kEvicted;
  for (auto strategy : {policy::AVERAGE, policy::PIVOT, policy::WEIGHTED})
    for (auto filter : {policy::MERGE_ALL, policy::ABOVE_MEAN_SIMILARITY}) {
      CAPTURE(strategy, filter);
      HeadCache cache(d);
      Merger m(strategy, filter);
      m.KeepAndMerge(ctx, kept, evicted, &cache);
      REQUIRE(cache.size() == kKept);
      std::vector<std::vector<std::pair<int32_t, float>>> expect(kKept);
      for (int i = 0; i < kEvicted; ++i) {
        if (filter == policy::ABOVE_MEAN_SIMILARITY && sim[i] < mean) continue;
        const float c = strategy == policy::AVERAGE ? 1.0f : strategy == policy::PIVOT ? 0.5f : sim[i];
        expect[nearest[i]].emplace_back(evicted[i], c);
      }
      int merged = 0;
      for (int s = 0; s < kKept; ++s) {
        REQUIRE(cache.token(s) == kept[s]);
        if (expect[s].empty()) {
          CHECK_FALSE(cache.is_merged(s));
          continue;
        }
        ++merged;
        REQUIRE(cache.is_merged(s));
        CHECK(cache.merged(s).members == expect[s]);
        const double mm = static_cast<double>(expect[s].size());
        const double a = strategy == policy::PIVOT ? 1.0 + mm / 2 : 1.0;
        for (int k = 0; k < d; k += 17) {
          double kk = a * keys[kept[s] * d + k], vv = a * values[kept[s] * d + k];
          for (const auto& [tok, c] : expect[s]) {
            kk += c * keys[tok * d + k];
            vv += c * values[tok * d + k];
          }
          CHECK(cache.merged(s).key[k] == Approx(kk / (1 + mm)).margin(1e-4));
          CHECK(cache.merged(s).value[k] == Approx(vv / (1 + mm)).margin(1e-4));
        }
      }
      CHECK(merged > 50);
      // The merge-once path (MEDA, LOOK-M) gives the same slots bit for bit and keeps no sums: a later
      // batch starts afresh, as after Release.
      HeadCache once(d);
      Merger m1(strategy, filter);
      m1.KeepAndMergeOnce(ctx, kept, evicted, &once);
      REQUIRE(once.size() == kKept);
      for (int s = 0; s < kKept; ++s) {
        REQUIRE(once.token(s) == kept[s]);
        REQUIRE(once.is_merged(s) == cache.is_merged(s));
        if (!once.is_merged(s)) continue;
        CHECK(once.merged(s).key == cache.merged(s).key);
        CHECK(once.merged(s).value == cache.merged(s).value);
        CHECK(once.merged(s).members == cache.merged(s).members);
      }
      m.Release();
      const std::vector<int32_t> late{evicted[0]};
      m.MergeTokens(ctx, late, &cache);
      m1.MergeTokens(ctx, late, &once);
      for (int s = 0; s < kKept; ++s)
        if (once.is_merged(s)) {
          CHECK(once.merged(s).key == cache.merged(s).key);
          CHECK(once.merged(s).members == cache.merged(s).members);
        }
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

// ---- the bf16 screen (policies/merge_screen.*; issue 14, round 7) ----
namespace {

// The merge similarity by its definition (round 10): each row scaled as NormalizeRows does (the squared norm
// summed in double in k order, inv = float(1 / sqrt), each entry x * inv; zero rows stay zero), then one
// fmaf chain over k from +0; the answer is the scan from j = 0 that moves on only to a strictly greater
// value (std::max_element's first maximum; a NaN is never taken unless v_0 is NaN).
float ChainRef(const float* a, const float* b, int d) {
  float acc = 0.0f;
  for (int k = 0; k < d; ++k) acc = std::fma(a[k], b[k], acc);
  return acc;
}

std::vector<float> NormalizedRef(const std::vector<float>& x, int n, int d) {
  std::vector<float> out(static_cast<size_t>(n) * d);
  for (int r = 0; r < n; ++r) {
    double s = 0;
    for (int k = 0; k < d; ++k) s += static_cast<double>(x[r * d + k]) * x[r * d + k];
    const float inv = s > 0 ? static_cast<float>(1.0 / std::sqrt(s)) : 0.0f;
    for (int k = 0; k < d; ++k) out[r * d + k] = x[r * d + k] * inv;
  }
  return out;
}

struct NearestRef {
  std::vector<int> index;
  std::vector<float> value;
};

NearestRef FirstMaxRef(const float* q, int nq, const float* t, int nt, int d) {
  NearestRef out;
  for (int i = 0; i < nq; ++i) {
    int best = 0;
    float bv = ChainRef(q + static_cast<size_t>(i) * d, t, d);
    for (int j = 1; j < nt; ++j) {
      const float v = ChainRef(q + static_cast<size_t>(i) * d, t + static_cast<size_t>(j) * d, d);
      if (v > bv) best = j, bv = v;
    }
    out.index.push_back(best);
    out.value.push_back(bv);
  }
  return out;
}

NearestRef ExactNearestRef(const std::vector<float>& q, int nq, const std::vector<float>& t, int nt, int d) {
  const std::vector<float> qn = NormalizedRef(q, nq, d), tn = NormalizedRef(t, nt, d);
  return FirstMaxRef(qn.data(), nq, tn.data(), nt, d);
}

// The same bits, or both NaN.
bool SameBits(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b) || (std::isnan(a) && std::isnan(b));
}

struct ScreenResult {
  std::vector<int> nearest;
  std::vector<float> similarity;
  long screened_queries = 0, exact_blocks = 0;
};

ScreenResult Search(const std::vector<float>& q, int nq, const std::vector<float>& t, int nt, int d,
                    bool screen) {
  merge_screen::SetEnabledForTesting(screen);
  const merge_screen::Stats before = merge_screen::ThreadStats();
  ScreenResult r;
  NearestByCosine(q.data(), nq, t.data(), nt, d, &r.nearest, &r.similarity);
  r.screened_queries = merge_screen::ThreadStats().screened_queries - before.screened_queries;
  r.exact_blocks = merge_screen::ThreadStats().exact_blocks - before.exact_blocks;
  merge_screen::SetEnabledForTesting(true);
  return r;
}

// Whether NearestByCosine screens here (the chosen screen, or the one a test chose, runs on this CPU).
bool ScreenOn() {
  merge_screen::SetEnabledForTesting(true);
  return merge_screen::Enabled() || merge_screen::Int16Enabled();
}

// The screened search, the exact search (screen forced off; the AVX2 kernel where the CPU has it) and the
// reference (the test's own normalisation, fmaf chain and first-maximum scan: ExactNearestRef below) give the
// same slots and the same bits; returns how many queries the screen searched (0 without AVX512-BF16).
long CheckScreenedEqualsExact(const std::vector<float>& q, int nq, const std::vector<float>& t, int nt,
                              int d) {
  const ScreenResult old = Search(q, nq, t, nt, d, false), now = Search(q, nq, t, nt, d, true);
  CHECK(old.screened_queries == 0);
  CHECK(old.exact_blocks > 0);
  REQUIRE(old.nearest.size() == static_cast<size_t>(nq));
  const NearestRef ref = ExactNearestRef(q, nq, t, nt, d);
  int differ = 0, differ_ref = 0;
  for (int i = 0; i < nq; ++i) {
    differ += old.nearest[i] != now.nearest[i] || !SameBits(old.similarity[i], now.similarity[i]);
    differ_ref += old.nearest[i] != ref.index[i] || !SameBits(old.similarity[i], ref.value[i]);
  }
  CHECK(differ == 0);
  CHECK(differ_ref == 0);
  if (!ScreenOn()) CHECK(now.screened_queries == 0);
  return now.screened_queries;
}

std::vector<float> Gaussian(int rows, int d, uint32_t seed, float shared = 0.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g;
  std::vector<float> dir(d), x(static_cast<size_t>(rows) * d);
  for (float& v : dir) v = g(rng);
  for (size_t i = 0; i < x.size(); ++i) x[i] = g(rng) + shared * dir[i % d];
  return x;
}

// Chooses a screen for one test (SetScreenForTesting; a screen this CPU cannot run: none), and gives the
// process's own choice back at the end of the scope.
struct ScreenChoice {
  explicit ScreenChoice(merge_screen::Screen s) { merge_screen::SetScreenForTesting(s); }
  ~ScreenChoice() { merge_screen::SetScreenForTesting(merge_screen::ChosenScreen()); }
};

}  // namespace

TEST_CASE("merge screen: int16 is the default screen where the CPU has AVX2, else bf16 (round 25)",
          "[merge][screen]") {
  using merge_screen::Screen;
  const char* env = std::getenv("KVSIM_MERGE_SCREEN");
  if (env == nullptr || std::string(env).empty() || std::string(env) == "1")
    CHECK(merge_screen::ChosenScreen() == (CpuHas(CpuFeature::kAvx2)   ? Screen::kInt16
                                           : merge_screen::Supported() ? Screen::kBf16
                                                                       : Screen::kNone));
  {
    ScreenChoice c(Screen::kBf16);
    CHECK(merge_screen::Enabled() == merge_screen::Supported());
    CHECK_FALSE(merge_screen::Int16Enabled());
  }
  {
    ScreenChoice c(Screen::kInt16);
    CHECK_FALSE(merge_screen::Enabled());
    CHECK(merge_screen::Int16Enabled() == merge_screen::int16::Supported());
  }
  {
    ScreenChoice c(Screen::kNone);
    CHECK_FALSE(ScreenOn());
  }
}

TEST_CASE("merge screen: each screen + exact re-check equals the exact search bit for bit",
          "[merge][screen]") {
  constexpr int d = 128;
  // Every screen this CPU runs (bf16 where it has AVX512-BF16, int16 where it has AVX2); one it cannot run
  // is the exact search, and the checks below say so (ScreenOn() false).
  const merge_screen::Screen screen = GENERATE(merge_screen::Screen::kBf16, merge_screen::Screen::kInt16);
  const ScreenChoice choice(screen);
  CAPTURE(static_cast<int>(screen));
  SECTION("random and clustered keys, query counts around the 4-query and 256-query blocks") {
    for (int nq : {1, 3, 4, 5, 7, 255, 256, 257, 259, 515})
      for (int nt : {17, 162, 300}) {
        CAPTURE(nq, nt);
        const long screened =
            CheckScreenedEqualsExact(Gaussian(nq, d, nq), nq, Gaussian(nt, d, 99 + nt), nt, d);
        // Blocks below 2^18 multiply-adds go to the exact search (the screen would not pay there).
        if (ScreenOn() && static_cast<long>(std::min(nq, 256)) * nt * d >= (1L << 18)) CHECK(screened > 0);
      }
    // Clustered: every key near one of 5 centres (many near-equal cosines), and a large shared direction.
    std::vector<float> centres = Gaussian(5, d, 5), q = Gaussian(600, d, 6), t = Gaussian(640, d, 7);
    for (size_t i = 0; i < q.size(); ++i) q[i] = 0.1f * q[i] + centres[(i / d % 5) * d + i % d];
    for (size_t i = 0; i < t.size(); ++i) t[i] = 0.1f * t[i] + centres[(i / d % 5) * d + i % d];
    CHECK(CheckScreenedEqualsExact(q, 600, t, 640, d) == (ScreenOn() ? 600 : 0));
    CHECK(CheckScreenedEqualsExact(Gaussian(700, d, 8, 3.0f), 700, Gaussian(900, d, 9, 3.0f), 900, d) ==
          (ScreenOn() ? 700 : 0));
  }
  SECTION("exact duplicates (the first wins), zero keys, scaled copies") {
    const std::vector<float> q = AwkwardKeys(600, d, 21u), t = AwkwardKeys(700, d, 22u);
    CHECK(CheckScreenedEqualsExact(q, 600, t, 700, d) == (ScreenOn() ? 600 : 0));
    CHECK(CheckScreenedEqualsExact(t, 700, t, 700, d) == (ScreenOn() ? 700 : 0));  // self: ties
  }
  SECTION("near ties: targets whose exact cosines differ by 1 ulp ... 1e-3") {
    // Each query's targets are the query itself perturbed in one coordinate by 2^-24 ... 1e-3 (relative),
    // in a shuffled order, plus exact copies: cosines within a few ulps of each other and of 1.
    std::mt19937 rng(31);
    const std::vector<float> base = Gaussian(8, d, 32);
    std::vector<float> q, t;
    for (int b = 0; b < 8; ++b) {
      const float* row = base.data() + b * d;
      for (int c = 0; c < 32; ++c) q.insert(q.end(), row, row + d);
      for (int j = 0; j < 40; ++j) {
        std::vector<float> x(row, row + d);
        const double rel = j % 5 == 0 ? 0.0 : std::ldexp(1.0, -24 + static_cast<int>(rng() % 15));
        x[rng() % d] *= static_cast<float>(1 + (rng() % 2 ? rel : -rel));
        t.insert(t.end(), x.begin(), x.end());
      }
    }
    CHECK(CheckScreenedEqualsExact(q, 256, t, 320, d) == (ScreenOn() ? 256 : 0));
    // Cosines of random directions around 1e-3 apart: a query and targets on a small cone around it.
    std::vector<float> cone = Gaussian(900, d, 33);
    for (size_t i = 0; i < cone.size(); ++i) cone[i] = base[i % d] + 1e-3f * cone[i];
    CHECK(CheckScreenedEqualsExact(q, 256, cone, 900, d) == (ScreenOn() ? 256 : 0));
  }
  SECTION("denormal-scale keys: screened where the scale factor is a normal float, else the exact search") {
    std::vector<float> q = Gaussian(300, d, 41), t = Gaussian(400, d, 42);
    for (float& v : q) v *= 1e-38f;  // subnormal and tiny normal entries, norms ~1e-37: inv stays normal
    for (size_t i = 0; i < t.size(); ++i) t[i] *= i / d % 2 ? 1e-36f : 1.0f;
    CHECK(CheckScreenedEqualsExact(q, 300, t, 400, d) == (ScreenOn() ? 300 : 0));
    for (float& v : q) v *= 1e-6f;  // norms below 2^-128: 1/norm overflows a float -> exact search
    CHECK(CheckScreenedEqualsExact(q, 300, t, 400, d) == 0);
    // A target whose entries are subnormal after normalisation (one large entry, the rest ~1e-40).
    std::vector<float> t2 = Gaussian(400, d, 43);
    for (int j = 0; j < 400; j += 3)
      for (int k = 1; k < d; ++k) t2[j * d + k] = 1e-40f * (k % 2 ? 1 : -1);
    CHECK(CheckScreenedEqualsExact(Gaussian(300, d, 44), 300, t2, 400, d) == (ScreenOn() ? 300 : 0));
  }
  SECTION("one target; 16k+1 targets; odd d and non-finite keys go to the exact search") {
    // One target: every block (<= 256 x 1 x 128) is below 2^18, so the exact search.
    CHECK(CheckScreenedEqualsExact(Gaussian(3000, d, 51), 3000, Gaussian(1, d, 52), 1, d) == 0);
    CHECK(CheckScreenedEqualsExact(Gaussian(20, d, 53), 20, Gaussian(16385, d, 54), 16385, d) ==
          (ScreenOn() ? 20 : 0));
    CHECK(CheckScreenedEqualsExact(Gaussian(300, 127, 55), 300, Gaussian(300, 127, 56), 300, 127) == 0);
    std::vector<float> bad = Gaussian(300, d, 57);
    bad[5 * d + 3] = std::numeric_limits<float>::infinity();
    const ScreenResult r = Search(Gaussian(300, d, 58), 300, bad, 300, d, true);
    CHECK(r.screened_queries == 0);
    // Target 5 normalises to a NaN row (inf x 0): its similarity is NaN and never the first maximum.
    CHECK(CheckScreenedEqualsExact(Gaussian(300, d, 58), 300, bad, 300, d) == 0);
    CHECK(r.nearest != std::vector<int>(300, 5));
  }
}

TEST_CASE("merge screen: the error bound holds and adversarial rows nearly reach it", "[merge][screen]") {
  // Unit rows whose every entry is 2^e times one mantissa just above a bf16 rounding midpoint: entries
  // 3 x 2^-1, 3 x 2^-2, 3 x 2^-3, 2 x 2^-4 (sum of squares S = 0.9921875), normalised by 1/sqrt(S)
  // = 1.0039292: every entry rounds up by 0.99 x 2^-8 of itself, so the bf16 square norm is 1 + 0.99 x 2^-7.
  // |approx - fp32 value| must stay within the derived bound (ErrorBound / kSafetyFactor) and reach 98% of
  // it: a bound a few percent too small fails here.
  constexpr int d = 128;
  std::vector<float> x(d, 0.0f);
  const std::vector<float> pattern{0.5f,   0.5f,   0.5f,   0.25f,   0.25f,  0.25f,
                                   0.125f, 0.125f, 0.125f, 0.0625f, 0.0625f};
  std::copy(pattern.begin(), pattern.end(), x.begin() + 40);
  double s = 0;
  for (float v : x) s += static_cast<double>(v) * v;
  const float inv = static_cast<float>(1.0 / std::sqrt(s));  // what NormalizeRows computes
  for (float& v : x) v *= inv;
  // The a-priori bound (any rows) is 2^-7 + ~1.5e-5; this pair's own (its rounding-error norms) is
  // nearly the same, and the pair reaches 98% of it.
  CHECK(merge_screen::ErrorBound(d) / merge_screen::kSafetyFactor == Approx(0.00784).epsilon(0.01));
  const float* xp = x.data();
  float exact = 0;
  merge_screen::ExactDots(&xp, &xp, 1, d, &exact);
  CHECK(exact == Approx(1.0f).margin(1e-6));
  if (merge_screen::Supported()) {
    std::vector<uint32_t> qp(d / 2), tp(merge_screen::PackedTargetsSize(1, d));
    double rq = 0;
    merge_screen::PackQueries(x.data(), 1, d, qp.data(), &rq);
    const double rt = merge_screen::PackTargets(x.data(), 1, d, tp.data());
    CHECK(rq == Approx(rt).epsilon(1e-12));  // vector and scalar packing: the same rounding
    CHECK(rq == Approx(0.99 * std::ldexp(1.0, -8)).epsilon(0.01));
    const double bound = merge_screen::ErrorBound(d, rq, rt) / merge_screen::kSafetyFactor;
    CHECK(bound <= merge_screen::ErrorBound(d) / merge_screen::kSafetyFactor);
    std::vector<float> approx(16);
    merge_screen::ApproxDots(qp.data(), 1, tp.data(), 1, d, approx.data(), 16);
    const double err = std::abs(static_cast<double>(approx[0]) - exact);
    CAPTURE(err, bound);
    CHECK(err <= bound);
    CHECK(err >= 0.98 * bound);
    for (int j = 1; j < 16; ++j) CHECK(approx[j] == 0.0f);  // padding targets
  }
  // Random unit rows: the bound holds with room (typical errors are far below the worst case).
  if (merge_screen::Supported()) {
    const int nq = 64, nt = 200;
    std::vector<float> q = Gaussian(nq, d, 61, 1.0f), t = Gaussian(nt, d, 62, 1.0f);
    for (std::vector<float>* m : {&q, &t})
      for (size_t r = 0; r < m->size() / d; ++r) {
        double n2 = 0;
        for (int k = 0; k < d; ++k) n2 += static_cast<double>((*m)[r * d + k]) * (*m)[r * d + k];
        const float f = static_cast<float>(1.0 / std::sqrt(n2));
        for (int k = 0; k < d; ++k) (*m)[r * d + k] *= f;
      }
    std::vector<uint32_t> qp(nq * d / 2), tp(merge_screen::PackedTargetsSize(nt, d));
    std::vector<double> rq(nq);
    merge_screen::PackQueries(q.data(), nq, d, qp.data(), rq.data());
    const double rt = merge_screen::PackTargets(t.data(), nt, d, tp.data());
    const int ld = merge_screen::PaddedTargets(nt);
    std::vector<float> approx(static_cast<size_t>(nq) * ld);
    merge_screen::ApproxDots(qp.data(), nq, tp.data(), nt, d, approx.data(), ld);
    double worst = 0;  // the largest error relative to the pair's bound
    for (int i = 0; i < nq; ++i)
      for (int j = 0; j < nt; ++j) {
        const float* a = q.data() + i * d;
        const float* b = t.data() + j * d;
        float v;
        merge_screen::ExactDots(&a, &b, 1, d, &v);
        const double bound = merge_screen::ErrorBound(d, rq[i], rt) / merge_screen::kSafetyFactor;
        worst = std::max(worst, std::abs(static_cast<double>(approx[i * ld + j]) - v) / bound);
      }
    CHECK(worst <= 1.0);
  }
}

namespace {
// Two caches hold the same slots, merged alike: the same members and the same key and value bits.
void CheckSameMerges(const HeadCache& with, const HeadCache& without, int d) {
  REQUIRE(with.size() == without.size());
  for (int s = 0; s < with.size(); ++s) {
    REQUIRE(with.is_merged(s) == without.is_merged(s));
    if (!with.is_merged(s)) continue;
    CHECK(with.merged(s).members == without.merged(s).members);
    CHECK(std::memcmp(with.merged(s).key.data(), without.merged(s).key.data(), d * sizeof(float)) == 0);
    CHECK(std::memcmp(with.merged(s).value.data(), without.merged(s).value.data(), d * sizeof(float)) == 0);
  }
}
}  // namespace

TEST_CASE("merge screen: every strategy x filter merges the same with and without the screen",
          "[merge][screen]") {
  // The callers read the best slot and its value (Join: the ABOVE_MEAN_SIMILARITY filter's mean and the
  // WEIGHTED coefficients), so the merged slots must be the same bits either way.
  constexpr int d = 128, kKept = 400, kEvicted = 1300, n = kKept + kEvicted;
  const std::vector<float> keys = AwkwardKeys(n, d, 71u), values = AwkwardKeys(n, d, 72u);
  TraceMeta meta;
  meta.model.head_dim = d;
  meta.prefill_length = n;
  meta.tokens.Resize(n);
  HeadContext ctx;
  ctx.meta = &meta;
  ctx.compress_end = n;
  ctx.keys = keys.data();
  ctx.values = values.data();
  std::vector<int32_t> kept, evicted;
  for (int32_t j = 0; j < n; ++j) (j % 17 < 4 ? kept : evicted).push_back(j);
  for (auto strategy : {policy::AVERAGE, policy::PIVOT, policy::WEIGHTED})
    for (auto filter : {policy::MERGE_ALL, policy::ABOVE_MEAN_SIMILARITY})
      for (bool once : {false, true}) {
        CAPTURE(strategy, filter, once);
        HeadCache with(d), without(d);
        Merger a(strategy, filter), b(strategy, filter);
        merge_screen::SetEnabledForTesting(false);
        once ? b.KeepAndMergeOnce(ctx, kept, evicted, &without)
             : b.KeepAndMerge(ctx, kept, evicted, &without);
        merge_screen::SetEnabledForTesting(true);
        const long before = merge_screen::ThreadStats().screened_queries;
        once ? a.KeepAndMergeOnce(ctx, kept, evicted, &with) : a.KeepAndMerge(ctx, kept, evicted, &with);
        if (ScreenOn()) CHECK(merge_screen::ThreadStats().screened_queries > before);
        CheckSameMerges(with, without, d);
      }
}

// ---- the similarity memo of a unit's merging runs (merge_memo; issue 14, round 8) ----
namespace {

// Every evicted token's slot and similarity as KeepAndMergeOnce assigned them: WEIGHTED + MERGE_ALL records
// each token with its cosine as the coefficient (bit for bit), so (slot, cosine bits) per token.
struct Assignment {
  std::vector<std::pair<int, uint32_t>> by_token;  // by evicted index
  bool operator==(const Assignment&) const = default;
};

struct MemoHead {
  TraceMeta meta;
  std::vector<float> keys, values;
  HeadContext ctx;
  UnitShared shared;
  MemoHead(std::vector<float> k, int d) : keys(std::move(k)) {
    const int n = static_cast<int>(keys.size() / d);
    values = keys;
    meta.model.head_dim = d;
    meta.prefill_length = n;
    meta.tokens.Resize(n);
    ctx.meta = &meta;
    ctx.compress_end = n;
    ctx.keys = keys.data();
    ctx.values = values.data();
  }
  int n() const { return meta.prefill_length; }
  // One merge-once compression keeping `kept` (slot order as given), with (memo = true) or without the
  // unit's memo; the strategy and filter of the merger.
  HeadCache Compress(std::span<const int32_t> kept, bool memo,
                     policy::MergeStrategy strategy = policy::WEIGHTED,
                     policy::MergeFilter filter = policy::MERGE_ALL) {
    std::vector<char> in(n(), 0);
    for (int32_t j : kept) in[j] = 1;
    std::vector<int32_t> evicted;
    for (int32_t j = 0; j < n(); ++j)
      if (!in[j]) evicted.push_back(j);
    HeadContext c = ctx;
    c.shared = memo ? &shared : nullptr;
    HeadCache cache(meta.model.head_dim);
    Merger m(strategy, filter);
    m.KeepAndMergeOnce(c, kept, evicted, &cache);
    return cache;
  }
  Assignment Assign(std::span<const int32_t> kept, bool memo) {
    const HeadCache cache = Compress(kept, memo);
    std::vector<std::pair<int, uint32_t>> by_tok(n(), {-2, 0});
    for (int s = 0; s < cache.size(); ++s)
      if (cache.is_merged(s))
        for (const auto& [tok, c] : cache.merged(s).members) by_tok[tok] = {s, std::bit_cast<uint32_t>(c)};
    Assignment a;
    std::vector<char> in(n(), 0);
    for (int32_t j : kept) in[j] = 1;
    for (int32_t j = 0; j < n(); ++j)
      if (!in[j]) a.by_token.push_back(by_tok[j]);
    return a;
  }
};

// Kept sets like the policies' (a share of "important" tokens plus a recent window), nested by budget.
std::vector<std::vector<int32_t>> NestedSets(int n, std::initializer_list<double> fractions, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<std::vector<int32_t>> out;
  for (double f : fractions) {
    const int k = std::max(1, static_cast<int>(f * n));
    std::vector<int32_t> s(order.begin(), order.begin() + k / 2);
    for (int j = n - (k - k / 2); j < n; ++j) s.push_back(j);
    std::sort(s.begin(), s.end());
    s.erase(std::unique(s.begin(), s.end()), s.end());
    out.push_back(s);
  }
  return out;
}

long MemoReuses() { return merge_screen::ThreadStats().memo_reuse_calls; }

// With the memo (shared by the calls in the given order) == without, for every set; returns the reuses.
long CheckMemoEqualsPlain(MemoHead& h, const std::vector<std::vector<int32_t>>& sets) {
  const long before = MemoReuses();
  for (const auto& kept : sets) {
    const Assignment plain = h.Assign(kept, false), memo = h.Assign(kept, true);
    REQUIRE(plain.by_token.size() == memo.by_token.size());
    int differ = 0;
    for (size_t i = 0; i < plain.by_token.size(); ++i) differ += plain.by_token[i] != memo.by_token[i];
    CHECK(differ == 0);
  }
  return MemoReuses() - before;
}

}  // namespace

TEST_CASE("merge memo: the memo's answers equal NearestByCosine's bit for bit", "[merge][memo]") {
  constexpr int d = 128, n = 1500;
  merge_memo::SetEnabledForTesting(true);
  const bool on = merge_memo::Enabled();  // on every CPU since round 10 (the exact search's blocks too)
  SECTION("random keys, nested budgets in increasing order: reused") {
    MemoHead h(Gaussian(n, d, 3u), d);
    const long reuses = CheckMemoEqualsPlain(h, NestedSets(n, {0.05, 0.10, 0.20, 0.50}, 5u));
    if (on) CHECK(reuses == 3);
  }
  SECTION("clustered keys and a large shared direction") {
    MemoHead h(Gaussian(n, d, 7u, 3.0f), d);
    const long reuses = CheckMemoEqualsPlain(h, NestedSets(n, {0.10, 0.20, 0.50}, 9u));
    if (on) CHECK(reuses == 2);
  }
  SECTION("decreasing order (a superset first), non-nested sets, another call's subset") {
    MemoHead h(Gaussian(n, d, 11u), d);
    auto sets = NestedSets(n, {0.50, 0.20, 0.05}, 13u);
    const merge_screen::Stats before = merge_screen::ThreadStats();
    // Since round 13 a stored superset serves every row whose stored answer is one of our targets, with no
    // product at all.
    CHECK(CheckMemoEqualsPlain(h, sets) == (on ? 2 : 0));
    if (on) {
      const merge_screen::Stats& now = merge_screen::ThreadStats();
      CHECK(now.memo_superset_calls - before.memo_superset_calls == 2);
      CHECK(now.memo_free_queries - before.memo_free_queries > 100);
    }
    // Another random set overlaps the stored ones (neither inside the other): reused since round 13; then
    // a set containing the stored 5% set reuses it.
    auto other = NestedSets(n, {0.3}, 99u);
    CHECK(CheckMemoEqualsPlain(h, other) == (on ? 1 : 0));
    std::vector<int32_t> super = sets[2];
    for (int32_t j = 0; j < n; j += 7) super.push_back(j);
    std::sort(super.begin(), super.end());
    super.erase(std::unique(super.begin(), super.end()), super.end());
    const long reuses = CheckMemoEqualsPlain(h, {super});
    if (on) CHECK(reuses == 1);
  }
  SECTION("a subset listed in another slot order is not used") {
    MemoHead h(Gaussian(n, d, 17u), d);
    auto sets = NestedSets(n, {0.1, 0.3}, 19u);
    std::reverse(sets[1].begin(), sets[1].end());  // slots in descending token order
    CHECK(CheckMemoEqualsPlain(h, sets) == 0);
  }
  SECTION("exact duplicates and near ties split between the stored targets and the rest") {
    // Tokens 2i and 2i + 1 share one key (the even copy of every pair in the stored 10% set for i % 2 == 0,
    // the odd copy for i % 2 == 1), plus near copies scaled by 1 + 2^-20 … : every query equal to a pair's
    // key ties between a slot of A and a slot of B, the earlier slot on either side. A combination that
    // broke ties towards the stored answer or towards the rest would pick the later slot for half of them.
    std::vector<float> k = Gaussian(n, d, 23u);
    for (int i = 0; i + 1 < n; i += 2)
      std::copy_n(&k[static_cast<size_t>(i) * d], d, &k[static_cast<size_t>(i + 1) * d]);
    for (int i = 0; i + 2 < 300; i += 4)
      k[static_cast<size_t>(i + 2) * d] *= 1.0f + std::ldexp(1.0f, -20 + i % 5);
    MemoHead h(std::move(k), d);
    // Queries: every token of [1000, n) (evicted); targets: the pairs [0, 600), A = one copy of each pair.
    std::vector<int32_t> a, full;
    for (int32_t p = 0; p < 300; ++p) a.push_back(2 * p + (p % 2));
    for (int32_t j = 0; j < 600; ++j) full.push_back(j);
    // Queries equal to target keys: tokens [1000, n) copy pairs' keys.
    for (int j = 1000; j < n; ++j)
      std::copy_n(&h.keys[static_cast<size_t>(j % 600) * d], d, &h.keys[static_cast<size_t>(j) * d]);
    h.values = h.keys;
    h.ctx.values = h.values.data();
    const long reuses = CheckMemoEqualsPlain(h, {a, full});
    if (on) CHECK(reuses == 1);
    // And the answer is the earlier copy: a query j ≥ 1000 equal to an unperturbed pair p's key (p even, or
    // p ≥ 150) joins slot 2p, which is in A for even p and in B for odd p.
    h.shared.merge.reset();
    CheckMemoEqualsPlain(h, {a});
    const Assignment got = h.Assign(full, true);
    int wrong = 0, checked = 0;
    for (int j = 1000; j < n; ++j) {
      const int p = (j % 600) / 2;
      if (p % 2 == 1 && p < 150) continue;  // perturbed pair
      ++checked;
      wrong += got.by_token[j - 600].first != 2 * p;  // evicted index: tokens [600, n) are evicted
    }
    CHECK(checked > 300);
    CHECK(wrong == 0);
  }
  SECTION("small blocks and irregular rows") {
    // 5 targets x 256 queries x 128 < 2^18: the exact search (with the memo since round 10); an irregular
    // query row (norm ~1e-40) sends its block to the plain search, without the memo; the last block
    // (n - 1280 = 220 rows) of a large call is screened or not by its own size.
    std::vector<float> k = Gaussian(n, d, 29u);
    for (int c = 0; c < d; ++c) k[static_cast<size_t>(700) * d + c] *= 1e-41f;
    MemoHead h(std::move(k), d);
    std::vector<int32_t> tiny{0, 1, 2, 3, 4}, small{0, 1, 2, 3, 4, 5, 6, 7}, mid;
    for (int32_t j = 0; j < 40; ++j) mid.push_back(j);
    std::vector<int32_t> last = NestedSets(n, {0.3}, 31u)[0];
    last.insert(last.end(), mid.begin(), mid.end());
    std::sort(last.begin(), last.end());
    last.erase(std::unique(last.begin(), last.end()), last.end());
    const long reuses = CheckMemoEqualsPlain(h, {tiny, small, mid, last});
    if (on) CHECK(reuses >= 1);
  }
}

// Since round 11 a memo call reads its rows from the unit's keys, normalised and (for the int16 screen)
// packed once per unit (UnitKeys), in place. A first call (nothing stored: no reuse) must screen exactly as
// the plain search does: the same slots and values, and the same candidates (the same words and error
// norms, so the same slack), then again from the table already built, for a second unit's worth of keys
// with irregular rows (a zero row, a tiny one) among them.
TEST_CASE("merge memo: the unit's keys normalised and packed once screen like each call's own",
          "[merge][memo]") {
  constexpr int d = 128, n = 1300;
  merge_memo::SetEnabledForTesting(true);
  std::vector<float> k = Gaussian(n, d, 59u, 2.0f);
  for (int c = 0; c < d; ++c) k[static_cast<size_t>(5) * d + c] = 0.0f;       // a zero row
  for (int c = 0; c < d; ++c) k[static_cast<size_t>(900) * d + c] *= 1e-41f;  // irregular
  MemoHead h(std::move(k), d);
  bool second = false;
  for (auto kept : NestedSets(n, {0.3, 0.07}, 61u)) {
    std::erase(kept, 900);  // a query: its block takes the exact search
    // The second lists its slots in descending token order: the stored set's order differs, no reuse.
    if (second) std::reverse(kept.begin(), kept.end());
    second = true;
    const merge_screen::Stats s0 = merge_screen::ThreadStats();
    const Assignment plain = h.Assign(kept, false);
    const merge_screen::Stats s1 = merge_screen::ThreadStats();
    const Assignment memo = h.Assign(kept, true);
    const merge_screen::Stats s2 = merge_screen::ThreadStats();
    CHECK(s2.memo_reuse_calls == s1.memo_reuse_calls);
    CHECK(plain.by_token == memo.by_token);
    CHECK(s2.screened_queries - s1.screened_queries == s1.screened_queries - s0.screened_queries);
    CHECK(s2.candidates - s1.candidates == s1.candidates - s0.candidates);
    if (merge_screen::Int16Enabled()) CHECK(s1.candidates > s0.candidates);
  }
}

TEST_CASE("merge memo: every strategy x filter merges the same with and without it", "[merge][memo]") {
  constexpr int d = 128, n = 1400;
  merge_memo::SetEnabledForTesting(true);
  const auto sets = NestedSets(n, {0.05, 0.10, 0.20, 0.50}, 37u);
  for (auto strategy : {policy::AVERAGE, policy::PIVOT, policy::WEIGHTED})
    for (auto filter : {policy::MERGE_ALL, policy::ABOVE_MEAN_SIMILARITY}) {
      CAPTURE(strategy, filter);
      MemoHead h(Gaussian(n, d, 41u, 1.0f), d);
      for (const auto& kept : sets) {
        const HeadCache without = h.Compress(kept, false, strategy, filter),
                        with = h.Compress(kept, true, strategy, filter);
        CheckSameMerges(with, without, d);
      }
    }
}

// ---- round 13: stored sets that are not inside K (a larger budget's, another policy's) ----
namespace {

// Keys with exact duplicate pairs (tokens 2p and 2p + 1 share pair p's key, p < 300), near ties (a few
// pairs' second copy scaled by 1 + 2^-20 …), and query tokens [1000, n) equal to pair (j % 600) / 2's key:
// every such query ties between the two copies of its pair.
MemoHead PairHead(int n, int d) {
  std::vector<float> k = Gaussian(n, d, 23u);
  for (int i = 0; i + 1 < 600; i += 2)
    std::copy_n(&k[static_cast<size_t>(i) * d], d, &k[static_cast<size_t>(i + 1) * d]);
  for (int i = 0; i + 2 < 300; i += 4)
    k[static_cast<size_t>(i + 2) * d] *= 1.0f + std::ldexp(1.0f, -20 + i % 5);
  for (int j = 1000; j < n; ++j)
    std::copy_n(&k[static_cast<size_t>((j % 600) & ~1) * d], d, &k[static_cast<size_t>(j) * d]);
  return MemoHead(std::move(k), d);
}

std::vector<int32_t> Range(int32_t lo, int32_t hi) {
  std::vector<int32_t> r;
  for (int32_t j = lo; j < hi; ++j) r.push_back(j);
  return r;
}
std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

TEST_CASE("merge memo: supersets and other policies' sets reused, bit for bit (round 13)", "[merge][memo]") {
  constexpr int d = 128, n = 1500;
  merge_memo::SetEnabledForTesting(true);
  const bool on = merge_memo::Enabled();
  const merge_screen::Stats s0 = merge_screen::ThreadStats();
  auto delta = [&](long merge_screen::Stats::*f) { return merge_screen::ThreadStats().*f - s0.*f; };
  SECTION("another policy's set at the same budget: overlapping, neither inside the other") {
    MemoHead h(Gaussian(n, d, 71u, 2.0f), d);
    const std::vector<int32_t> a = NestedSets(n, {0.2}, 73u)[0];
    std::vector<int32_t> k = a;
    std::mt19937 rng(79u);
    for (int i = 0; i < 30; ++i) k[rng() % k.size()] = static_cast<int32_t>(rng() % n);  // swap some
    std::sort(k.begin(), k.end());
    k.erase(std::unique(k.begin(), k.end()), k.end());
    CHECK(CheckMemoEqualsPlain(h, {a}) == 0);
    const merge_screen::Stats s1 = merge_screen::ThreadStats();
    CHECK(CheckMemoEqualsPlain(h, {k}) == (on ? 1 : 0));
    if (on) {
      // ~90% of the rows have a* ∈ K and search the ~30 slots of K \ A: far fewer products.
      const merge_screen::Stats& s2 = merge_screen::ThreadStats();
      CHECK(s2.memo_overlap_calls - s1.memo_overlap_calls == 1);
      CHECK(s2.memo_queries - s1.memo_queries > 800);
      CHECK((s2.memo_products - s1.memo_products) * 4 < s2.memo_products_without - s1.memo_products_without);
    }
  }
  SECTION("a stored answer outside K: those rows search every target") {
    // Queries [1000, n) are near copies of token 5's key: their stored answer over A is token 5, which K
    // (A without 5, inside A) lacks; the others take the stored answer with no product.
    std::vector<float> keys = Gaussian(n, d, 83u);
    for (int j = 1000; j < n; ++j)
      for (int c = 0; c < d; ++c)
        keys[static_cast<size_t>(j) * d + c] += 4.0f * keys[static_cast<size_t>(5) * d + c];
    MemoHead h(std::move(keys), d);
    const std::vector<int32_t> a = Range(0, 400);
    std::vector<int32_t> k = a;
    std::erase(k, 5);
    CHECK(CheckMemoEqualsPlain(h, {a, k}) == (on ? 1 : 0));
    if (on) {
      CHECK(delta(&merge_screen::Stats::memo_superset_calls) == 1);
      CHECK(delta(&merge_screen::Stats::memo_free_queries) > 0);
      CHECK(delta(&merge_screen::Stats::memo_free_queries) <= 600);  // not queries [1000, n)
      CHECK(delta(&merge_screen::Stats::memo_products) >= 500L * 399);
    }
  }
  SECTION("ties between the stored answer and a target outside A, either side first") {
    // A (another policy's set): one copy of each pair (the even one for even p, the odd one for odd p) and
    // tokens K lacks; K: both copies of every pair and tokens A lacks. A query equal to pair p ties between
    // a* ∈ A ∩ K and the other copy in K \ A: the first copy (slot 2p) must win on either side.
    MemoHead h = PairHead(n, d);
    std::vector<int32_t> a;
    for (int32_t p = 0; p < 300; ++p) a.push_back(2 * p + (p % 2));
    a = Concat(a, Range(600, 700));
    const std::vector<int32_t> k = Concat(Range(0, 600), Range(800, 850));
    CHECK(CheckMemoEqualsPlain(h, {a, k}) == (on ? 1 : 0));
    if (on) CHECK(delta(&merge_screen::Stats::memo_overlap_calls) == 1);
    const Assignment got = h.Assign(k, true);  // evicted: [600, 800) and [850, n)
    int wrong = 0, checked = 0;
    for (int j = 1000; j < n; ++j) {
      const int p = (j % 600) / 2;
      if (p % 2 == 1 && p < 150) continue;  // perturbed pair: no exact tie
      ++checked;
      wrong += got.by_token[j - 650].first != 2 * p;
    }
    CHECK(checked > 300);
    CHECK(wrong == 0);
  }
  SECTION("ties inside A ∩ K, in the same order: no product") {
    MemoHead h = PairHead(n, d);
    const std::vector<int32_t> a = Concat(Range(0, 600), Range(600, 650));
    const std::vector<int32_t> k = Range(0, 600);
    CHECK(CheckMemoEqualsPlain(h, {a, k}) == (on ? 1 : 0));
    if (on) CHECK(delta(&merge_screen::Stats::memo_free_queries) >= n - 1000);
  }
  SECTION("A ∩ K in another order: not used") {
    // A lists the pairs' tokens in descending order, so its first maximum is each pair's second copy; K
    // lists them ascending, where the first copy wins. Using A would answer 2p + 1.
    MemoHead h = PairHead(n, d);
    std::vector<int32_t> a = Range(0, 650);
    std::reverse(a.begin(), a.end());
    const std::vector<int32_t> k = Range(0, 600);
    CHECK(CheckMemoEqualsPlain(h, {a, k}) == 0);
    // The same sets in one order: reused.
    MemoHead h2 = PairHead(n, d);
    std::reverse(a.begin(), a.end());
    CHECK(CheckMemoEqualsPlain(h2, {a, k}) == (on ? 1 : 0));
  }
  SECTION("per row: each row takes the stored set covering most of K") {
    // Budgets in increasing order after a large one: rows answered by the 50% set (a* ∈ K) need no product,
    // the others take the 20% set (inside K) and search K \ A.
    MemoHead h(Gaussian(n, d, 89u), d);
    const auto sets = NestedSets(n, {0.5, 0.2, 0.3}, 97u);
    CHECK(CheckMemoEqualsPlain(h, {sets[0], sets[1]}) == (on ? 1 : 0));
    const merge_screen::Stats s1 = merge_screen::ThreadStats();
    CHECK(CheckMemoEqualsPlain(h, {sets[2]}) == (on ? 1 : 0));
    // About 0.6 of the 750 rows answered over the 50% set are free, the other rows search 10% of n: ~1/5
    // of the products without the memo (one set for the whole call: >= 1/3).
    const merge_screen::Stats& s2 = merge_screen::ThreadStats();
    if (on)
      CHECK((s2.memo_products - s1.memo_products) * 4 < s2.memo_products_without - s1.memo_products_without);
  }
}

// Round 14: a row with a stored answer v* re-checks only the targets of K \ A that can reach v*
// (ScreenBlock's floor). With it on and off: the same answers as without the memo, bit for bit, and on the
// int16 screen fewer exact re-checks (candidates). The ties (a* against an equal key in K \ A, either side
// first; near ties scaled by 1 + 2^-20 …) are the cases where a floor without its slack would drop the
// winner.
TEST_CASE("merge memo: the rest searches' floor gives the same answers with fewer re-checks (round 14)",
          "[merge][memo]") {
  constexpr int d = 128, n = 1500;
  merge_memo::SetEnabledForTesting(true);
  const bool int16 = merge_screen::Int16Enabled();
  auto run = [&](bool floor, auto&& scenario) {
    merge_memo::SetRestFloorForTesting(floor);
    const long c0 = merge_screen::ThreadStats().candidates;
    scenario();
    merge_memo::SetRestFloorForTesting(true);
    return merge_screen::ThreadStats().candidates - c0;
  };
  SECTION("random keys, nested budgets; clustered keys") {
    for (float shared : {0.0f, 3.0f}) {
      auto scenario = [&] {
        MemoHead h(Gaussian(n, d, 3u, shared), d);
        CheckMemoEqualsPlain(h, NestedSets(n, {0.05, 0.10, 0.20, 0.50}, 5u));
        CheckMemoEqualsPlain(h, NestedSets(n, {0.3}, 99u));  // another policy's overlapping set
      };
      const long off = run(false, scenario), on = run(true, scenario);
      CAPTURE(shared, off, on);
      if (int16) CHECK(on < off);
      CHECK(on <= off);
    }
  }
  SECTION("exact duplicates and near ties between the stored answer and the rest, either side first") {
    auto scenario = [&] {
      MemoHead h = PairHead(n, d);
      std::vector<int32_t> a;
      for (int32_t p = 0; p < 300; ++p) a.push_back(2 * p + (p % 2));
      a = Concat(a, Range(600, 700));
      const std::vector<int32_t> k = Concat(Range(0, 600), Range(800, 850));
      CheckMemoEqualsPlain(h, {a, k});
      const Assignment got = h.Assign(k, true);
      int wrong = 0;
      for (int j = 1000; j < n; ++j) {
        const int p = (j % 600) / 2;
        if (p % 2 == 1 && p < 150) continue;  // perturbed pair: no exact tie
        wrong += got.by_token[j - 650].first != 2 * p;
      }
      CHECK(wrong == 0);
    };
    const long off = run(false, scenario), on = run(true, scenario);
    CAPTURE(off, on);
    CHECK(on <= off);
  }
}

TEST_CASE("merge memo: switched off, nothing is stored or reused; the memo keeps a bounded number of sets",
          "[merge][memo]") {
  constexpr int d = 128, n = 1200;
  MemoHead h(Gaussian(n, d, 43u), d);
  const auto sets = NestedSets(n, {0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9}, 47u);
  merge_memo::SetEnabledForTesting(false);
  const merge_screen::Stats before = merge_screen::ThreadStats();
  for (const auto& kept : sets) h.Compress(kept, true);
  CHECK(merge_screen::ThreadStats().memo_calls == before.memo_calls);
  CHECK(h.shared.merge == nullptr);
  merge_memo::SetEnabledForTesting(true);
  const bool on = merge_memo::Enabled();  // KVSIM_MERGE_MEMO=0 keeps it off
  const merge_screen::Stats mid = merge_screen::ThreadStats();
  // Ten nested sets, at most kMaxEntries stored: each set still finds the one before it.
  CHECK(CheckMemoEqualsPlain(h, sets) == (on ? 9 : 0));
  CHECK(merge_memo::StoredSets(h.shared) == (on ? merge_memo::kMaxEntries : 0));
  if (on) {
    const merge_screen::Stats& now = merge_screen::ThreadStats();
    CHECK(now.memo_products - mid.memo_products < now.memo_products_without - mid.memo_products_without);
  }
}

TEST_CASE(
    "merge memo: meda / official / look_m sweeps are the same with and without the similarity memo, at 1 and "
    "3 threads",
    "[merge][memo]") {
  // Long enough prompts and d = 64 that the memo has nested kept sets to reuse (on every CPU since round 10).
  testing::TinyTraceSpec spec;
  spec.num_layers = 2;
  spec.num_heads = 4;
  spec.num_kv_heads = 4;
  spec.head_dim = 64;
  spec.prefill_length = 900;
  spec.decode_steps = 4;
  spec.image_begin = 100;
  spec.image_end = 850;
  spec.question_tokens = 8;
  spec.seed = 53;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  std::vector<RunSpec> runs;
  const std::vector<std::pair<const char*, std::vector<std::string>>> policies{
      {"meda", {}}, {"meda", {"variant=OFFICIAL_CODE"}}, {"look_m", {}}};
  for (const auto& [name, sets] : policies) {
    auto p = PolicyRegistry::Default().Create(name, sets);
    REQUIRE(p.ok());
    for (double b : {0.05, 0.1, 0.2, 0.5})
      runs.push_back(
          RunSpec{*p, name + std::string(sets.empty() ? "" : " official"), b, 0, QuestionMode::kQueryAware});
  }
  merge_memo::SetEnabledForTesting(false);
  auto off = Replay(trace, runs, ReplayOptions{.threads = 1});
  REQUIRE(off.ok());
  merge_memo::SetEnabledForTesting(true);
  for (int threads : {1, 3}) {
    const merge_memo::Totals before = merge_memo::ProcessTotals();
    auto on = Replay(trace, runs, ReplayOptions{.threads = threads});
    REQUIRE(on.ok());
    const merge_memo::Totals after = merge_memo::ProcessTotals();
    if (merge_memo::Enabled()) {
      CHECK(after.reuse_calls > before.reuse_calls);
      CHECK(after.products - before.products < after.products_without - before.products_without);
    }
    for (size_t i = 0; i < runs.size(); ++i) {
      INFO(runs[i].label << " budget " << runs[i].budget_fraction << " threads " << threads);
      CHECK((*on)[i].metrics().merged_tokens_mean() > 0);
      CHECK((*on)[i].SerializeAsString() == (*off)[i].SerializeAsString());
    }
  }
}

// ---- the exact search (merge_screen::ExactNearest; issue 14, round 10) ----
namespace {

// Both implementations this CPU can run: the AVX2 kernel (if it has AVX2 + FMA) and the portable one.
std::vector<bool> ExactPaths() {
  merge_screen::SetExactAvx2ForTesting(true);
  return merge_screen::ExactAvx2() ? std::vector<bool>{true, false} : std::vector<bool>{false};
}

// Rows of mixed magnitudes (2^-12 ... 2^12 times a Gaussian): every rounding step of a chain matters, so a
// reassociated or non-fused sum gives other bits somewhere.
std::vector<float> MixedRows(int rows, int d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g;
  std::vector<float> x(static_cast<size_t>(rows) * d);
  for (float& v : x) v = std::ldexp(g(rng), static_cast<int>(rng() % 25) - 12);
  return x;
}

std::vector<float> Packed(const std::vector<float>& t, int nt, int d) {
  std::vector<float> p(merge_screen::ExactPackedSize(nt, d), -1.0f);
  merge_screen::PackExactTargets(t.data(), nt, d, p.data());
  return p;
}

// ExactNearest and ExactDotsPacked on raw rows == FirstMaxRef / ChainRef, bit for bit; returns the
// mismatches.
int CheckExactKernel(const std::vector<float>& q, int nq, const std::vector<float>& t, int nt, int d,
                     bool values = true) {
  const std::vector<float> p = Packed(t, nt, d);
  int bad = 0;
  if (values) {
    std::vector<float> out(static_cast<size_t>(nq) * nt, -7.0f);
    merge_screen::ExactDotsPacked(q.data(), nq, p.data(), nt, d, out.data(), nt);
    for (int i = 0; i < nq; ++i)
      for (int j = 0; j < nt; ++j)
        bad += !SameBits(
            out[static_cast<size_t>(i) * nt + j],
            ChainRef(q.data() + static_cast<size_t>(i) * d, t.data() + static_cast<size_t>(j) * d, d));
  }
  std::vector<int> nearest(nq, -1);
  std::vector<float> sim(nq, -7.0f);
  merge_screen::ExactNearest(q.data(), nq, p.data(), nt, d, nearest.data(), sim.data());
  const NearestRef ref = FirstMaxRef(q.data(), nq, t.data(), nt, d);
  for (int i = 0; i < nq; ++i) bad += nearest[i] != ref.index[i] || !SameBits(sim[i], ref.value[i]);
  return bad;
}

}  // namespace

TEST_CASE("merge exact: the kernel's values are the scalar fmaf chain bit for bit (every even d, tails)",
          "[merge][exact]") {
  // d = 2 ... 256; target counts 1 ... 40 and 100 (every tail of the 8-target groups and 3-group tiles) and
  // 1640 (the demo's 50% budget); query counts 1 ... 9 (every tail of the 4-row tiles) and 256 (a block).
  for (bool avx2 : ExactPaths()) {
    merge_screen::SetExactAvx2ForTesting(avx2);
    int bad = 0, cases = 0;
    for (int d = 2; d <= 256; d += 2) {
      if (!avx2 && d % 14 != 2) continue;  // the portable path: a sample of d
      const std::vector<float> q = MixedRows(256, d, 1000u + d), t = MixedRows(1640, d, 2000u + d);
      for (int nt = 1; nt <= 41; ++nt) {
        const int targets = nt == 41 ? 100 : nt;
        const int nq = 1 + (d / 2 + nt) % 9;
        CAPTURE(avx2, d, targets, nq);
        const int b = CheckExactKernel(q, nq, t, targets, d);
        CHECK(b == 0);
        bad += b, ++cases;
      }
      for (int nq = 1; nq <= 9; ++nq)
        if ((d / 2 + nq) % 3 == 0) bad += CheckExactKernel(q, nq, t, 1640, d), ++cases;
      if (d % 32 == 2 || d == 128) bad += CheckExactKernel(q, 256, t, 1 + d % 40, d), ++cases;
    }
    // The largest block: 256 queries x 1640 targets.
    for (int d : {2, 128}) {
      const std::vector<float> q = MixedRows(256, d, 7u), t = MixedRows(1640, d, 8u);
      bad += CheckExactKernel(q, 256, t, 1640, d, avx2 || d == 2), ++cases;
    }
    CAPTURE(avx2, cases);
    CHECK(bad == 0);
  }
  merge_screen::SetExactAvx2ForTesting(true);
}

TEST_CASE("merge exact: ExactDots' pairs (scattered rows, 8 lanes transposed) are the scalar fmaf chain",
          "[merge][exact]") {
  // Pair counts 1 ... 27 (every tail of the 8-pair groups), d = 1 ... 40 and 128 (every tail of the 8-wide
  // dimension blocks), each pair's rows anywhere (rows of two buffers, repeated, in shuffled order).
  for (bool avx2 : ExactPaths()) {
    merge_screen::SetExactAvx2ForTesting(avx2);
    int bad = 0;
    for (int d = 1; d <= 129; d += d < 40 ? 1 : 88) {
      const std::vector<float> x = MixedRows(60, d, 3000u + d), y = MixedRows(60, d, 4000u + d);
      std::mt19937 rng(5000u + d);
      for (int n = 1; n <= 27; ++n) {
        std::vector<const float*> a(n), b(n);
        for (int i = 0; i < n; ++i)
          a[i] = x.data() + static_cast<size_t>(rng() % 60) * d,
          b[i] = y.data() + static_cast<size_t>(rng() % 60) * d;
        std::vector<float> out(n, -7.0f);
        merge_screen::ExactDots(a.data(), b.data(), n, d, out.data());
        for (int i = 0; i < n; ++i) bad += !SameBits(out[i], ChainRef(a[i], b[i], d));
      }
    }
    CAPTURE(avx2);
    CHECK(bad == 0);
  }
  merge_screen::SetExactAvx2ForTesting(true);
}

TEST_CASE("merge exact: the first maximum over ties, zeros, NaN, huge and tiny values", "[merge][exact]") {
  constexpr int d = 16;
  for (bool avx2 : ExactPaths()) {
    merge_screen::SetExactAvx2ForTesting(avx2);
    std::mt19937 rng(5);
    for (int nt : {1, 2, 7, 8, 9, 23, 24, 25, 40, 100}) {
      CAPTURE(avx2, nt);
      const std::vector<float> base = MixedRows(nt, d, 50u + nt), qs = MixedRows(9, d, 60u + nt);
      {  // exact duplicates of the best target in the same lane, other lanes, other tiles
        // Each query row equals target m, and copies of target m sit at m + 1, m + 8, m + 24 and later:
        // the first copy must win (the scan's first maximum, not the last, not the lowest lane).
        for (int m = 0; m < nt; ++m) {
          std::vector<float> t = base;
          for (int c : {1, 8, 24, 3, 17})
            if (m + c < nt) std::copy_n(&base[m * d], d, &t[(m + c) * d]);
          std::vector<float> q;
          for (int i = 0; i < 5; ++i) q.insert(q.end(), &base[m * d], &base[m * d] + d);
          CHECK(CheckExactKernel(q, 5, t, nt, d) == 0);
          // A later copy, earlier in the lane order (m + 7 is lane (m + 7) % 8 < m % 8 for m % 8 > 0).
          if (m + 7 < nt) {
            std::copy_n(&base[m * d], d, &t[(m + 7) * d]);
            CHECK(CheckExactKernel(q, 5, t, nt, d) == 0);
          }
        }
      }
      SECTION(
          "zero rows (every value +0: the first target), zero targets, orthogonal rows (+0 and -0 "
          "products)") {
        std::vector<float> zq(3 * d, 0.0f), t = base;
        CHECK(CheckExactKernel(zq, 3, t, nt, d) == 0);
        std::vector<int> nearest(3);
        std::vector<float> sim(3);
        const std::vector<float> p = Packed(t, nt, d);
        merge_screen::ExactNearest(zq.data(), 3, p.data(), nt, d, nearest.data(), sim.data());
        CHECK(nearest == std::vector<int>(3, 0));
        CHECK(std::bit_cast<uint32_t>(sim[0]) == 0u);
        // Targets of zeros and of negated-sign zeros, and queries orthogonal to them (values 0, -0 products).
        std::vector<float> t2(static_cast<size_t>(nt) * d, 0.0f);
        for (int j = 0; j < nt; ++j)
          for (int k = 0; k < d; ++k)
            t2[j * d + k] = j % 3 == 0 ? -0.0f : (j % 3 == 1 ? 0.0f : (k < d / 2 ? 0.0f : -1.0f));
        std::vector<float> q2(3 * d, 0.0f);
        for (int k = 0; k < d / 2; ++k) q2[k] = 1.0f, q2[d + k] = -1.0f, q2[2 * d + k] = k % 2 ? 1.0f : -1.0f;
        CHECK(CheckExactKernel(q2, 3, t2, nt, d) == 0);
      }
      {  // NaN, infinite, huge and tiny rows
        std::vector<float> t = base, q = qs;
        const float nan = std::numeric_limits<float>::quiet_NaN(),
                    inf = std::numeric_limits<float>::infinity();
        // Query 0: NaN everywhere (v_0 NaN: index 0). Query 1: huge (overflows to +-inf). Query 2: tiny
        // (subnormal products). Query 3: an infinite entry.
        std::fill_n(&q[0], d, nan);
        for (int k = 0; k < d; ++k)
          q[d + k] = 3e38f * (k % 2 ? 1 : -1), q[2 * d + k] = 1e-40f * (k % 3 ? 1 : -1);
        q[3 * d + 5] = inf;
        CHECK(CheckExactKernel(q, 9, t, nt, d) == 0);
        // A NaN target: never the maximum unless it is target 0 (then the scan never moves).
        const int j = static_cast<int>(rng() % nt);
        t[j * d + 1] = nan;
        CHECK(CheckExactKernel(q, 9, t, nt, d) == 0);
        t[1] = nan;  // target 0 NaN too
        CHECK(CheckExactKernel(q, 9, t, nt, d) == 0);
        std::vector<int> nearest(9);
        std::vector<float> sim(9);
        const std::vector<float> p = Packed(t, nt, d);
        merge_screen::ExactNearest(q.data(), 9, p.data(), nt, d, nearest.data(), sim.data());
        CHECK(nearest == std::vector<int>(9, 0));
        // Huge targets: +inf and -inf values, and -inf as the only non-NaN value of target 0.
        std::vector<float> t3 = base;
        for (int k = 0; k < d; ++k) t3[k] = 3e38f, t3[(nt - 1) * d + k] = -3e38f;
        std::vector<float> q3(2 * d, 1.0f);
        for (int k = 0; k < d; ++k) q3[d + k] = -1.0f;
        CHECK(CheckExactKernel(q3, 2, t3, nt, d) == 0);
      }
    }
  }
  merge_screen::SetExactAvx2ForTesting(true);
}

TEST_CASE("merge exact: NearestByCosine is the first maximum of the fmaf chain on every path",
          "[merge][exact]") {
  // Through NearestByCosine (normalisation, 256-row blocks, the screen where the CPU has it): the AVX2
  // kernel, the portable path and the reference agree bit for bit, with duplicates, zero and scaled keys.
  constexpr int d = 128;
  for (const auto& [nq, nt] : std::vector<std::pair<int, int>>{{600, 1640}, {257, 100}, {9, 40}, {1, 1}}) {
    const std::vector<float> q = AwkwardKeys(nq, d, 81u + nq), t = AwkwardKeys(nt, d, 82u + nt);
    const NearestRef ref = ExactNearestRef(q, nq, t, nt, d);
    for (bool avx2 : ExactPaths())
      for (bool screen : {false, true}) {
        CAPTURE(nq, nt, avx2, screen);
        merge_screen::SetExactAvx2ForTesting(avx2);
        const ScreenResult r = Search(q, nq, t, nt, d, screen);
        int differ = 0;
        for (int i = 0; i < nq; ++i)
          differ += r.nearest[i] != ref.index[i] || !SameBits(r.similarity[i], ref.value[i]);
        CHECK(differ == 0);
        if (!screen || !ScreenOn()) CHECK(r.exact_blocks == (nq + 255) / 256);
      }
    merge_screen::SetExactAvx2ForTesting(true);
  }
}

}  // namespace kvsim
