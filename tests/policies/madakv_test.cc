// MadaKV: Eqs. 6-11 on hand-computed cases (θ-sets, modality split, compensation over 3 layers) and the
// policy through the engine (ragged per-head caches, exact request total, reported statistics).

#include "policies/madakv.h"

#include <catch2/catch.hpp>

#include "policies/registry.h"
#include "sim/replay.h"
#include "tests/test_util.h"

namespace kvsim {

TEST_CASE("madakv: θ-set size (Eq. 9)", "[madakv]") {
  const std::vector<float> s{0.5f, 0.1f, 0.3f, 0.1f};  // sorted .5 .3 .1 .1, sum 1
  CHECK(ThetaSetSize(s, 0.8) == 2);                    // .5 + .3 reaches .8
  CHECK(ThetaSetSize(s, 0.81) == 3);
  CHECK(ThetaSetSize(s, 1.0) == 4);
  CHECK(ThetaSetSize({}, 0.9) == 0);
  CHECK(ThetaSetSize({0.0f, 0.0f}, 0.9) == 0);
}

TEST_CASE("madakv: modality preference (Eq. 6) and θ-sets per modality (Eq. 9)", "[madakv]") {
  TraceMeta meta;
  meta.tokens.Resize(5);
  for (int j : {1, 2, 4}) meta.tokens.modality[j] = Modality::kImage;
  const std::vector<float> psi{0.1f, 0.4f, 0.2f, 0.05f, 0.25f};
  const ModalityStats s = ComputeModalityStats(meta, psi, 0.6);
  CHECK(s.w_v == Approx(0.85));  // .4 + .2 + .25
  CHECK(s.w_t == Approx(0.15));  // .1 + .05
  CHECK(s.k_v == 2);             // .4 + .25 >= .6 * .85 = .51
  CHECK(s.k_t == 1);             // .1 >= .6 * .15 = .09
  CHECK(s.n_v == 3);
  CHECK(s.n_t == 2);
  // Kept tokens beyond the proxy window, split into (visual, text).
  CHECK(SplitByModality(3, 2, 1, s) == std::pair<int, int>{2, 1});  // exactly the θ-sets
  CHECK(SplitByModality(2, 2, 1, s) == std::pair<int, int>{1, 1});  // fewer: in proportion 2 : 1
  // More: the surplus 2 by preference .85 -> 2 visual, 0 text -> (4, 1); only 3 visual exist -> (3, 2).
  CHECK(SplitByModality(5, 2, 1, s) == std::pair<int, int>{3, 2});
}

TEST_CASE("madakv: compensation carried over 3 layers (Eqs. 10-11) keeps the total exact", "[madakv]") {
  // One head, proxy window 1, prompt 10, B = 5: 15 tokens for the request.
  std::vector<ModalityStats> st(3);
  st[0] = {1, 1, 3, 2, 4, 5};  // θ-sets 3 + 2
  st[1] = {1, 1, 1, 0, 4, 5};  // θ-sets 1 + 0
  st[2] = {1, 1, 2, 2, 4, 5};  // θ-sets 2 + 2
  const MadaKVAllocation a = AllocateMadaKV(st, 3, 1, 5, 1, 10, policy::MadaKVParams::THETA_SETS);
  // Layer 0: φ = 15/3 = 5; keeps 1 + 5 = 6 -> K = +1.   φ^1 = 5 - 1/(3-1) = 4.5
  // Layer 1: keeps 1 + 1 = 2 -> K = 2 - 4.5 = -2.5.     φ^2 = 4.5 + 2.5/(3-2) = 7
  // Layer 2 (last): takes what is left, 7 = 1 + 6: θ-sets 4 + a surplus of 2 split 1 : 1.
  CHECK(a.allowance == std::vector<double>{5, 4.5, 7});
  CHECK(a.compensation == std::vector<double>{1, -2.5, 0});
  CHECK(a.extra == std::vector<int>{5, 1, 6});
  CHECK(a.split[0] == std::pair<int, int>{3, 2});
  CHECK(a.split[1] == std::pair<int, int>{1, 0});
  CHECK(a.split[2] == std::pair<int, int>{3, 3});
  // Eq. 8 caps instead (MIN_OF_BOTH): layer 0 may only spend its allowance room φ - |P| = 4 split 1 : 1.
  const MadaKVAllocation b = AllocateMadaKV(st, 3, 1, 5, 1, 10, policy::MadaKVParams::MIN_OF_BOTH);
  CHECK(b.split[0] == std::pair<int, int>{2, 2});
  CHECK(b.extra[0] + b.extra[1] + b.extra[2] + 3 == 15);
}

TEST_CASE("madakv: later layers always keep their proxy windows; savings never get lost", "[madakv]") {
  std::vector<ModalityStats> st(3, ModalityStats{1, 1, 9, 9, 9, 9});  // every layer wants everything
  const MadaKVAllocation a = AllocateMadaKV(st, 3, 1, 6, 2, 20, policy::MadaKVParams::THETA_SETS);
  // 18 tokens: layer 0 may take at most 18 - 3 windows = 12 extra; the others keep their windows.
  CHECK(a.extra == std::vector<int>{12, 0, 0});
  std::vector<ModalityStats> low(3, ModalityStats{1, 1, 0, 1, 9, 9});  // θ-sets of 1 token
  const MadaKVAllocation b = AllocateMadaKV(low, 3, 1, 15, 2, 20, policy::MadaKVParams::THETA_SETS);
  // 45 tokens; the last layer can hold at most 20 (18 extra): the rest returns to layers 1, then 0.
  CHECK(b.extra[2] == 18);
  CHECK(b.extra[0] + b.extra[1] + b.extra[2] + 3 * 2 == 45);
}

TEST_CASE("madakv: ragged per-head caches through the engine, exact total, reported statistics", "[madakv]") {
  testing::TinyTraceSpec spec;
  spec.num_layers = 3;
  spec.num_heads = 4;
  spec.num_kv_heads = 2;
  spec.prefill_length = 40;
  spec.image_end = 30;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  auto p = PolicyRegistry::Default().Create("madakv", std::vector<std::string>{"proxy_window=4"});
  REQUIRE(p.ok());
  std::vector<RunSpec> runs{RunSpec{*p, "madakv", 0, 10}, RunSpec{*p, "madakv", 0, 20}};
  auto res = Replay(trace, runs, ReplayOptions{.threads = 2});
  REQUIRE(res.ok());
  for (const RunResult& r : *res) {
    INFO(r.budget_tokens());
    CHECK(r.allocated_budget_tokens_mean() == r.budget_tokens());
    CHECK(r.metrics().prompt_kept_tokens_mean() == Approx(r.budget_tokens()));
    double kept_over_layers = 0;
    for (const LayerResult& l : r.layers()) {
      REQUIRE(l.policy_head_stats_size() == 3);
      CHECK(l.policy_head_stats(0).name() == "k_text");
      CHECK(l.policy_head_stats(2).name() == "visual_preference");
      CHECK(l.policy_head_stats(2).values_size() == 2);
      double allowance = 0, compensation = 0;
      for (const auto& s : l.policy_stats()) {
        if (s.name() == "allowance") allowance = s.value();
        if (s.name() == "compensation") compensation = s.value();
      }
      // Kept per head = allowance + compensation (K^l / H), layer by layer.
      CHECK(l.budget_tokens_mean() == Approx(allowance + compensation));
      for (int u = 0; u < 2; ++u) CHECK(l.kv_head_budgets(u) >= 4);
      kept_over_layers += l.budget_tokens_mean();
    }
    CHECK(kept_over_layers == Approx(3.0 * r.budget_tokens()));
  }
}

}  // namespace kvsim
