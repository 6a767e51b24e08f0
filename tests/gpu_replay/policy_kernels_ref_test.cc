// gpu_replay/policy_kernels_ref.cc: window scoring against the simulator's column sums, top-k against the
// simulator's selection, merging against the merge piece's nearest-slot rule, and hand-checked cases.

#include <catch2/catch.hpp>
#include <cmath>
#include <numeric>

#include "gpu_replay/kernels.h"
#include "policies/merge.h"
#include "sim/attention.h"
#include "sim/select.h"

namespace kvsim::gpu_replay {

TEST_CASE("window scores ref: matches the simulator's column sums, rows sum to one", "[gpu_replay][policy]") {
  const int hq = 4, hkv = 2, d = 64, n = 200, w = 16;
  const WindowScoreProblem p = MakeWindowScoreProblem(Dtype::kF16, hq, hkv, d, n, w, 3);
  std::vector<float> scores;
  RefWindowScores(p, &scores);
  ModelInfo m;
  m.num_layers = 1, m.num_heads = hq, m.num_kv_heads = hkv, m.head_dim = d;
  m.softmax_scale = p.scale;
  std::vector<int32_t> pos(w);
  std::iota(pos.begin(), pos.end(), n - w);
  for (int h = 0; h < hkv; ++h) {
    std::vector<float> keys(static_cast<size_t>(n) * d), sim(n, 0.0f);
    for (size_t i = 0; i < keys.size(); ++i) keys[i] = HalfToFloat(p.k[static_cast<size_t>(h) * n * d + i]);
    for (int g = 0; g < hq / hkv; ++g) {
      std::vector<float> q(static_cast<size_t>(w) * d);
      for (size_t i = 0; i < q.size(); ++i)
        q[i] = HalfToFloat(p.q[static_cast<size_t>(h * 2 + g) * w * d + i]);
      AccumulateColumnSums(m, q.data(), pos.data(), w, keys.data(), n, sim.data());
    }
    const std::span<const float> mine(&scores[static_cast<size_t>(h) * n], n);
    CHECK(MaxRelError(mine, sim) < 1e-4);
    CHECK(std::accumulate(mine.begin(), mine.end(), 0.0) == Approx(2.0 * w).epsilon(1e-4));
  }
}

TEST_CASE("top-k ref: same selection as the simulator, rows gathered in order", "[gpu_replay][policy]") {
  const std::vector<int32_t> len{50, 0, 300, 7}, keep{10, 5, 300, 20};
  const TopKProblem p = MakeTopKProblem(Dtype::kBF16, len, keep, 3, 64, 8);
  TopKResult r;
  RefTopKCompact(p, &r);
  CHECK(CheckLayout(r.dst).empty());
  CHECK(r.dst.length == std::vector<int32_t>{10, 0, 300, 7});
  CHECK(r.dst.capacity == std::vector<int32_t>{13, 3, 303, 10});
  for (int h = 0; h < 4; ++h) {
    const std::span<const float> sc(&p.scores[p.src.offset[h]], len[h]);
    const std::vector<int32_t> want = TopKIndices(sc, keep[h]);
    std::vector<int32_t> got(&r.selected[r.dst.offset[h]], &r.selected[r.dst.offset[h]] + r.dst.length[h]);
    CHECK(got == want);
    for (int i = 0; i < r.dst.length[h]; ++i)
      for (int k = 0; k < 64; ++k) {
        REQUIRE(r.k[r.dst.Element(h, i) + k] == p.k[p.src.Element(h, got[i]) + k]);
        REQUIRE(r.v[r.dst.Element(h, i) + k] == p.v[p.src.Element(h, got[i]) + k]);
      }
  }
  // Ties go to the lower slot.
  TopKProblem tie = p;
  std::fill(tie.scores.begin(), tie.scores.end(), 1.0f);
  RefTopKCompact(tie, &r);
  for (int i = 0; i < 10; ++i) CHECK(r.selected[r.dst.offset[0] + i] == i);
}

TEST_CASE("merge ref: nearest slot as the merge piece picks it, AVERAGE values", "[gpu_replay][policy]") {
  const std::vector<int32_t> kept{40, 3, 0}, evicted{100, 9, 4};
  const MergeProblem p = MakeMergeProblem(Dtype::kF16, kept, evicted, 64, 4);
  MergeResult r;
  RefMergeNearest(p, &r);
  for (int h = 0; h < 2; ++h) {
    std::vector<float> targets(static_cast<size_t>(kept[h]) * 64),
        queries(static_cast<size_t>(evicted[h]) * 64);
    for (size_t i = 0; i < targets.size(); ++i) targets[i] = HalfToFloat(p.k[p.layout.Element(h, 0) + i]);
    for (size_t i = 0; i < queries.size(); ++i)
      queries[i] = HalfToFloat(p.ek[static_cast<size_t>(p.evicted_first[h]) * 64 + i]);
    std::vector<int> nearest;
    std::vector<float> sim;
    NearestByCosine(queries.data(), evicted[h], targets.data(), kept[h], 64, &nearest, &sim);
    for (int e = 0; e < evicted[h]; ++e) {
      CHECK(r.nearest[p.evicted_first[h] + e] == nearest[e]);
      CHECK(r.similarity[p.evicted_first[h] + e] == Approx(sim[e]).margin(1e-5));
    }
  }
  for (int e = p.evicted_first[2]; e < p.evicted_first[3]; ++e) CHECK(r.nearest[e] == -1);  // nothing kept
  // Slot 0 of head 1: (k_a + sum of its members) / (1 + m).
  const int64_t slot = p.layout.offset[1];
  std::vector<float> want(64);
  for (int k = 0; k < 64; ++k) want[k] = HalfToFloat(p.k[slot * 64 + k]);
  int m = 0;
  for (int e = p.evicted_first[1]; e < p.evicted_first[2]; ++e)
    if (r.nearest[e] == 0) {
      ++m;
      for (int k = 0; k < 64; ++k) want[k] += HalfToFloat(p.ek[static_cast<size_t>(e) * 64 + k]);
    }
  CHECK(r.count[slot] == m);
  for (int k = 0; k < 64; ++k)
    CHECK(HalfToFloat(r.k[slot * 64 + k]) == RoundTo(Dtype::kF16, want[k] / (1 + m)));
  int64_t merged = 0;
  for (int c : r.count) merged += c;
  CHECK(merged == 109);
}

}  // namespace kvsim::gpu_replay
