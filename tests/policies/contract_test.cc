// Contract tests: every registered policy, at several budgets, in both question modes, on MHA and GQA
// traces, must satisfy the same invariants. (The engine itself aborts on a token held twice, a token from
// the future, or a cache over its budget; these tests make every policy go through those checks.)

#include <catch2/catch.hpp>
#include <cmath>
#include <numeric>

#include "policies/registry.h"
#include "sim/replay.h"
#include "tests/test_util.h"

namespace kvsim {
namespace {

// Every registered policy with its defaults, plus merge-wrapped baselines and official-code variants.
std::vector<std::pair<std::string, std::vector<std::string>>> AllConfigs() {
  std::vector<std::pair<std::string, std::vector<std::string>>> configs;
  for (const PolicyInfo& info : PolicyRegistry::Default().List()) configs.push_back({info.name, {}});
  for (const char* wrapped : {"snapkv+average", "pyramidkv+pivot", "h2o+weighted", "h2o+average",
                              "streaming_llm+average", "streaming_llm+pivot"})
    configs.push_back({wrapped, {}});
  configs.push_back({"h2o+pivot", {"one_shot=true"}});
  configs.push_back({"adakv+average", {"window=4"}});
  configs.push_back({"adakv", {"floor_fraction=0"}});
  configs.push_back({"madakv", {"combine=THETA_SETS", "proxy_window=4"}});
  configs.push_back({"hae", {"mode=BUDGET", "rc_size=2"}});
  configs.push_back({"hae", {"mode=BUDGET", "components=DDES_ONLY", "rc_size=3"}});
  configs.push_back({"hae", {"mode=BUDGET", "components=DAP_ONLY"}});
  configs.push_back({"hae", {"components=DDES_ONLY", "rc_size=4", "ddes_init=PROMPT_COLUMN_SUMS"}});
  configs.push_back({"hae+average", {"mode=BUDGET", "rc_size=2"}});
  configs.push_back({"madakv+pivot", {"theta=0.5", "pooling=AVG", "kernel_size=3"}});
  configs.push_back({"meda", {"variant=OFFICIAL_CODE"}});
  configs.push_back({"meda", {"entropy=FULL_SELF", "merge=PIVOT"}});
  configs.push_back({"oracle", {"decode_growth=true"}});
  configs.push_back({"meda", {"clamp_layer_ratio=true", "head_averaging=ENTROPY_OF_MEAN_ATTENTION"}});
  configs.push_back(
      {"look_m", {"text_prior=KEEP_ALL_TEXT", "merge=AVERAGE", "merge_filter=ABOVE_MEAN_SIMILARITY"}});
  configs.push_back({"look_m", {"text_prior=NO_TEXT_PRIOR", "merge=WEIGHTED"}});
  configs.push_back({"look_m", {"merge=NO_MERGE"}});
  return configs;
}

std::vector<RunSpec> AllRuns(QuestionMode mode) {
  std::vector<RunSpec> runs;
  for (const auto& [name, sets] : AllConfigs()) {
    auto p = PolicyRegistry::Default().Create(name, sets);
    REQUIRE(p.ok());
    std::string label = name;
    for (const std::string& s : sets) label += " " + s;
    for (double b : {0.1, 0.25, 0.5, 1.0}) runs.push_back(RunSpec{*p, label, b, 0, mode});
    runs.push_back(RunSpec{*p, label, 0, 3, mode});  // absolute budget
  }
  return runs;
}

void CheckInvariants(const TraceMeta& meta, const std::vector<RunSpec>& runs,
                     const std::vector<RunResult>& res) {
  REQUIRE(res.size() == runs.size());
  for (size_t i = 0; i < runs.size(); ++i) {
    const RunResult& r = res[i];
    const Metrics& m = r.metrics();
    INFO(r.label() << " budget " << runs[i].budget_fraction << "/" << runs[i].budget_tokens << " "
                   << r.question_mode());
    const bool floor_budget = runs[i].policy->may_exceed_budget();
    CHECK(m.bound_violations() == 0);
    CHECK(m.retained_mass_mean() + m.merged_anchor_mass_mean() <= m.covered_mass_mean() + 1e-6);
    CHECK(m.merged_anchor_mass_mean() >= 0);
    if (m.merged_tokens_mean() == 0) CHECK(m.merged_anchor_mass_mean() == 0);
    CHECK(m.covered_mass_mean() <= 1.0 + 1e-5);
    CHECK(m.retained_mass_mean() >= 0);
    CHECK(m.regret_vs_oracle_mean() >= -1e-5);
    CHECK(m.kv_bytes_peak() <= m.full_kv_bytes_peak() + 1e-9);
    CHECK(r.layers_size() == meta.model.num_layers);
    for (const auto& l : r.layers()) {
      REQUIRE(l.kv_head_tokens_mean_size() == meta.model.num_kv_heads);
      double heads = 0;
      for (int u = 0; u < meta.model.num_kv_heads; ++u) {
        heads += l.kv_head_tokens_mean(u);
        CHECK(l.kv_head_tokens_peak(u) >= l.kv_head_tokens_mean(u));
      }
      CHECK(heads / meta.model.num_kv_heads == Approx(l.metrics().kept_tokens_mean()).epsilon(1e-9));
    }
    // Σ layer budgets = L * B (exact totals for uneven allocations), unless the policy ignores the budget.
    double total = 0;
    for (const auto& l : r.layers()) total += l.budget_tokens_mean();
    const int ce = CompressEnd(meta, runs[i].question_mode);
    if (r.policy() == "full") {
      CHECK(total == static_cast<double>(ce) * meta.model.num_layers);
      CHECK(m.retained_mass_mean() == Approx(1.0).epsilon(1e-6));
      CHECK(m.output_rel_error_mean() < 1e-5);
      CHECK(m.regret_vs_oracle_mean() == Approx(0).margin(1e-5));
    } else if (!floor_budget) {
      // Every layer's budget is a cap; the total is L * B except for MEDA's clamped ratios (not
      // redistributed), where the run-level ratio over B may exceed 1 (docs/metrics.md).
      for (const auto& l : r.layers()) CHECK(l.metrics().prompt_kept_over_budget() <= 1 + 1e-9);
      CHECK(m.prompt_kept_tokens_mean() <= r.allocated_budget_tokens_mean() + 1e-9);
      if (r.parameters().find("clamp_layer_ratio: true") == std::string::npos) {
        CHECK(total == static_cast<double>(r.budget_tokens()) * meta.model.num_layers);
        CHECK(r.allocated_budget_tokens_mean() == r.budget_tokens());
        CHECK(m.prompt_kept_tokens_mean() <= r.budget_tokens() + 1e-9);
        CHECK(m.prompt_kept_over_budget() <= 1 + 1e-9);
      }
    }
    // Merging only ever adds coverage; kept + merged tokens never exceed the compressible prompt + decode.
    CHECK(m.merged_tokens_mean() >= 0);
    CHECK(m.merged_slots_mean() <= m.merged_tokens_mean() + 1e-9);
    if (r.policy().find('+') == std::string::npos &&
        r.parameters().find("merge: NO_MERGE") != std::string::npos)
      CHECK(m.merged_tokens_mean() == 0);
    for (const auto& l : r.layers())
      for (const auto& st : l.policy_stats()) CHECK(std::isfinite(st.value()));
    // Decode-evicting policies never exceed their cap; others hold at most budget + appended + decode.
    const int appended = meta.prefill_length - ce;
    for (const auto& tp : r.timeline()) {
      const double per_head = tp.kv_tokens() / (meta.model.num_layers * meta.model.num_kv_heads);
      const double decode = tp.step() + 1;
      if (r.policy() != "full" && !floor_budget)
        CHECK(per_head <= r.budget_tokens() + appended + decode + 1e-9);
      CHECK(per_head <= meta.prefill_length + decode + 1e-9);
    }
    // MHA: the oracle is the per-head optimum (zero regret). GQA: it optimises the group mean, so each head
    // may lose a little against its own optimum.
    if (r.policy() == "oracle" && meta.model.GroupSize() == 1)
      CHECK(m.regret_vs_oracle_mean() == Approx(0).margin(1e-6));
  }
}

}  // namespace

TEST_CASE("contract: every policy, MHA, query-aware and query-agnostic", "[contract]") {
  MemoryTrace trace = testing::MakeTinyTrace();
  for (QuestionMode mode : {QuestionMode::kQueryAware, QuestionMode::kQueryAgnostic}) {
    auto runs = AllRuns(mode);
    auto res = Replay(trace, runs, ReplayOptions{.threads = 1});
    REQUIRE(res.ok());
    CheckInvariants(trace.meta(), runs, *res);
  }
}

// The GPU work a policy declares for the latency model (Policy::gpu_work) includes the nearest-slot merge
// exactly when its runs merge evicted tokens (issue 14, round 29: MEDA and LOOK-M merged without declaring
// it). (A run that evicted no prompt token, e.g. MEDA's official code on this trace, has nothing to merge.)
TEST_CASE("contract: a policy declares the merge work exactly when its runs merge", "[contract]") {
  MemoryTrace trace = testing::MakeTinyTrace();
  for (const auto& [name, sets] : AllConfigs()) {
    auto p = PolicyRegistry::Default().Create(name, sets);
    REQUIRE(p.ok());
    const bool declared = (*p)->gpu_work().merge;
    INFO(name << " " << (sets.empty() ? "" : sets.front()));
    for (double budget : {0.0, 0.1, 0.25}) {  // 0: an absolute budget of 2 tokens
      const RunSpec spec{*p, name, budget, budget > 0 ? 0 : 2, QuestionMode::kQueryAware};
      auto res = Replay(trace, std::vector<RunSpec>{spec}, ReplayOptions{.threads = 1});
      REQUIRE(res.ok());
      const RunResult& r = (*res)[0];
      const bool merged = r.metrics().merged_tokens_mean() > 0;
      const bool evicted = r.metrics().prompt_kept_tokens_mean() < r.compressed_prompt_tokens();
      CAPTURE(budget);
      CHECK((!merged || declared));            // a run that merged declares it
      if (evicted) CHECK(declared == merged);  // a run that evicted merged iff it declares it
    }
  }
}

TEST_CASE("contract: every policy on a GQA trace", "[contract]") {
  testing::TinyTraceSpec spec;
  spec.num_heads = 4;
  spec.num_kv_heads = 2;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  auto runs = AllRuns(QuestionMode::kQueryAware);
  auto res = Replay(trace, runs, ReplayOptions{.threads = 2});
  REQUIRE(res.ok());
  CheckInvariants(trace.meta(), runs, *res);
}

TEST_CASE("contract: deterministic and independent of the thread count", "[contract]") {
  testing::TinyTraceSpec spec;
  spec.num_heads = 4;
  spec.num_kv_heads = 4;
  spec.seed = 7;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  auto runs = AllRuns(QuestionMode::kQueryAware);
  auto a = Replay(trace, runs, ReplayOptions{.threads = 1});
  auto b = Replay(trace, runs, ReplayOptions{.threads = 2});
  auto c = Replay(trace, runs, ReplayOptions{.threads = 3});
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(c.ok());
  for (size_t i = 0; i < runs.size(); ++i) {
    INFO(runs[i].label);
    CHECK((*a)[i].SerializeAsString() == (*b)[i].SerializeAsString());
    CHECK((*a)[i].SerializeAsString() == (*c)[i].SerializeAsString());
  }
}

// What a run reports depends on the run alone, not on the runs replayed beside it: the engine shares work
// between a unit's runs (the merge memo, rank bands, the decode part of the outputs, the regret sums) but
// never results. A prompt long enough for several 64-column rank bands.
TEST_CASE("contract: every run's results are the same alone as beside every other run", "[contract]") {
  testing::TinyTraceSpec spec;
  spec.num_heads = 4;
  spec.num_kv_heads = 2;
  spec.prefill_length = 200;
  spec.image_end = 150;
  spec.seed = 3;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  auto runs = AllRuns(QuestionMode::kQueryAware);
  auto together = Replay(trace, runs, ReplayOptions{.threads = 2});
  REQUIRE(together.ok());
  for (size_t i = 0; i < runs.size(); ++i) {
    auto alone = Replay(trace, std::vector<RunSpec>{runs[i]}, ReplayOptions{.threads = 1});
    REQUIRE(alone.ok());
    INFO(runs[i].label << " budget " << runs[i].budget_fraction << "/" << runs[i].budget_tokens);
    CHECK((*alone)[0].SerializeAsString() == (*together)[i].SerializeAsString());
  }
}

TEST_CASE("contract: budget 100% keeps every prompt token for prefill-compressing policies", "[contract]") {
  MemoryTrace trace = testing::MakeTinyTrace();
  const std::vector<std::string> one_shot{"one_shot=true"};
  for (const char* name : {"snapkv", "pyramidkv", "h2o"}) {
    auto p = PolicyRegistry::Default().Create(
        name, std::string(name) == "h2o" ? one_shot : std::vector<std::string>{});
    REQUIRE(p.ok());
    std::vector<RunSpec> runs{RunSpec{*p, name, 1.0, 0, QuestionMode::kQueryAware}};
    auto res = Replay(trace, runs, ReplayOptions{.threads = 1});
    REQUIRE(res.ok());
    INFO(name);
    CHECK((*res)[0].metrics().retained_mass_mean() == Approx(1.0).epsilon(1e-6));
  }
}

TEST_CASE("contract: oracle mass grows with the budget", "[contract]") {
  MemoryTrace trace = testing::MakeTinyTrace();
  auto p = PolicyRegistry::Default().Create("oracle");
  REQUIRE(p.ok());
  std::vector<RunSpec> runs;
  for (double b : {0.1, 0.3, 0.6, 0.9})
    runs.push_back(RunSpec{*p, "oracle", b, 0, QuestionMode::kQueryAware});
  auto res = Replay(trace, runs, ReplayOptions{.threads = 1});
  REQUIRE(res.ok());
  for (size_t i = 1; i < runs.size(); ++i)
    CHECK((*res)[i].metrics().retained_mass_mean() >= (*res)[i - 1].metrics().retained_mass_mean());
}

}  // namespace kvsim
