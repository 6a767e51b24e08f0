// HAE: DAP's scores and its two conditions on hand-computed cases, the budget-driven mode, the broadcast
// (the same evicted set at every layer and head), and DDES's bin (growth to l + d, batch eviction, reset).

#include "policies/hae.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <set>

#include "policies/registry.h"
#include "sim/replay.h"
#include "tests/test_util.h"

namespace kvsim {
namespace {

std::shared_ptr<const Policy> Make(std::vector<std::string> sets) {
  auto p = PolicyRegistry::Default().Create("hae", sets);
  INFO(p.status().message());
  REQUIRE(p.ok());
  return *p;
}

policy::HAEParams Params(std::vector<std::string> sets) {
  return static_cast<const HAEPolicy&>(*Make(sets)).params();
}

}  // namespace

TEST_CASE("hae: DAP scores are the head-mean attention of the text queries (Eqs. 1-2)", "[hae]") {
  // Tokens: 0 text, 1-2 image, 3 text; keys (0, 1, 0, 0); text query 3 is 1 for head 0 and 0 for head 1.
  testing::TinyTraceSpec spec;
  spec.num_layers = 1;
  spec.prefill_length = 4;
  spec.decode_steps = 1;
  spec.image_begin = 1;
  spec.image_end = 3;
  spec.question_tokens = 0;
  MemoryTrace tr = testing::MakeTinyTrace(spec);
  tr.mutable_meta().model.softmax_scale = 1.0;
  LayerData& l = tr.layers()[0];
  std::fill(l.queries.begin(), l.queries.end(), 0.0f);
  std::fill(l.keys.begin(), l.keys.end(), 0.0f);
  const int t = 5, d = 8;
  for (int u = 0; u < 2; ++u) l.keys[(static_cast<size_t>(u) * t + 1) * d] = 1.0f;
  l.queries[(0 * t + 3) * d] = 1.0f;  // head 0, token 3
  LayerData layer;
  REQUIRE(tr.ReadLayer(0, &layer).ok());
  const DapScores s = ComputeDapScores(LayerView{&tr.meta(), &layer, 0, 4, 1});
  // Row 0 sees only key 0 (Ā = 1). Row 3: head 0 softmax(0, 1, 0, 0) = (1, e, 1, 1) / (3 + e), head 1
  // uniform.
  const double e = std::exp(1.0), lo = (1 / (3 + e) + 0.25) / 2, hi = (e / (3 + e) + 0.25) / 2;
  CHECK(s.received[0] == Approx(1 + lo));
  CHECK(s.received[1] == Approx(hi));
  CHECK(s.received[2] == Approx(lo));
  CHECK(s.received[3] == Approx(lo));
  CHECK(s.peak[0] == Approx(1.0));
  CHECK(s.peak[1] == Approx(hi));
}

TEST_CASE("hae: DAP evicts visual tokens that fail both conditions (Eq. 3), at most c", "[hae]") {
  TraceMeta meta;
  meta.tokens.Resize(6);
  for (int j : {1, 2, 3, 4}) meta.tokens.modality[j] = Modality::kImage;
  DapScores s;
  s.received = {5, 0.001, 0.5, 0.002, 0.0005, 3};  // Σ_V A = 0.5035
  s.peak = {1, 0.0009, 0.3, 0.002, 0.0001, 1};
  // r = 0.01: A_j <= 0.005035 for 1, 3, 4; alpha = 0.001: peak < alpha for 1 and 4 only (3 fails it).
  CHECK(DapEvictions(meta, s, 6, Params({"r=0.01", "alpha=0.001"}), 0) == std::vector<int32_t>{1, 4});
  CHECK(DapEvictions(meta, s, 6, Params({"r=0.01", "alpha=0.001", "max_evict=1"}), 0) ==
        std::vector<int32_t>{4});  // the lowest A_j
  CHECK(DapEvictions(meta, s, 6, Params({"r=0.001", "alpha=0.001"}), 0) == std::vector<int32_t>{4});
  CHECK(DapEvictions(meta, s, 6, Params({"r=1", "alpha=1"}), 0) ==
        std::vector<int32_t>{1, 2, 3, 4});  // text never
  // Budget-driven: the lowest A_j until B remain, visual first.
  CHECK(DapEvictions(meta, s, 6, Params({"mode=BUDGET"}), 3) == std::vector<int32_t>{1, 3, 4});
  CHECK(DapEvictions(meta, s, 6, Params({"mode=BUDGET"}), 1) == std::vector<int32_t>{1, 2, 3, 4, 5});
}

TEST_CASE("hae: max_evict is an inclusive bound (at most c); Definition 1's strict |S0 \\ S1| < c is c - 1",
          "[hae]") {
  TraceMeta meta;
  meta.tokens.Resize(6);
  for (int j : {1, 2, 3, 4}) meta.tokens.modality[j] = Modality::kImage;
  DapScores s;
  s.received = {5, 0.001, 0.5, 0.002, 0.0005, 3};
  s.peak = {1, 0.0009, 0.3, 0.002, 0.0001, 1};
  // r = 1, alpha = 1: all four image tokens qualify; by A_j: 4 (.0005), 1 (.001), 3 (.002), 2 (.5).
  auto evict = [&](const char* c) { return DapEvictions(meta, s, 6, Params({"r=1", "alpha=1", c}), 0); };
  CHECK(evict("max_evict=4") == std::vector<int32_t>{1, 2, 3, 4});  // exactly c qualify: all c evicted
  CHECK(evict("max_evict=3") == std::vector<int32_t>{1, 3, 4});     // = the paper's strict bound with c = 4
  CHECK(evict("max_evict=2") == std::vector<int32_t>{1, 4});
  CHECK(evict("max_evict=1") == std::vector<int32_t>{4});
  CHECK(evict("max_evict=0") == std::vector<int32_t>{1, 2, 3, 4});  // no limit
}

TEST_CASE("hae: Table 5 presets fill unset fields", "[hae]") {
  const policy::HAEParams llava = Params({});
  CHECK(llava.r() == 0.0012);
  CHECK(llava.alpha() == 0.001);
  CHECK(llava.rc_size() == 64);
  const policy::HAEParams phi = Params({"preset=PHI_3_5_VISION_B", "rc_size=10"});
  CHECK(phi.r() == 0.0015);
  CHECK(phi.rc_size() == 10);  // explicit wins
  CHECK_FALSE(PolicyRegistry::Default().Create("hae", std::vector<std::string>{"rc_size=0"}).ok());
}

TEST_CASE("hae: DDES evicts the lowest cumulative scores once the bin of d tokens is full", "[hae]") {
  CHECK(LowestSlots(std::vector<float>{0.2f, 0.7f, 0.15f, 0.3f, 0.45f, 0.2f}, 2) == std::vector<int>{0, 2});
  CHECK(LowestSlots(std::vector<float>{1, 2}, 0).empty());
  TraceMeta meta;
  meta.model.head_dim = 1;
  meta.prefill_length = 4;
  meta.num_decode_steps = 2;
  meta.tokens.Resize(6);
  HeadContext ctx;
  ctx.meta = &meta;
  ctx.compress_end = 4;
  auto policy = Make({"components=DDES_ONLY", "rc_size=2"});  // THRESHOLD: the prompt is kept
  auto head = policy->NewHeadPolicy(ctx);
  HeadCache cache(1);
  cache.AssignRange(0, 4);
  head->OnPrefill(ctx, 2, &cache);
  REQUIRE(cache.size() == 4);  // l = 4
  const std::vector<float> p0{0.1f, 0.4f, 0.05f, 0.2f, 0.25f}, p1{0.1f, 0.3f, 0.1f, 0.1f, 0.2f, 0.2f};
  head->BeforeStep(ctx, StepAttention{0, 4}, 2, &cache);
  cache.Append(4);
  head->AfterStep(ctx, StepAttention{0, 5, p0.data()}, &cache);
  CHECK(cache.size() == 5);  // l + 1 < l + d: no flush
  head->BeforeStep(ctx, StepAttention{1, 5}, 2, &cache);
  cache.Append(5);
  head->AfterStep(ctx, StepAttention{1, 6, p1.data()}, &cache);
  // β = (.2, .7, .15, .3, .45, .2): the bin is full (l + 2): the 2 lowest go at once, tie to the older.
  CHECK(std::vector<int32_t>(cache.tokens().begin(), cache.tokens().end()) ==
        std::vector<int32_t>{1, 3, 4, 5});
}

TEST_CASE("hae: LowestSlots are a stable sort's first slots, ascending (ties, zeros of both signs, NaN)",
          "[hae]") {
  // The reference is the stable sort by score the function used to do; the selection must give the same
  // slots for every count, with many ties (the lower slot goes first), -0 equal to +0, and NaN scores (the
  // stable sort's own outcome, whatever it is).
  auto reference = [](const std::vector<float>& s, int count) {
    std::vector<int> idx(s.size());
    std::iota(idx.begin(), idx.end(), 0);
    count = std::clamp(count, 0, static_cast<int>(idx.size()));
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return s[a] < s[b]; });
    idx.resize(count);
    std::sort(idx.begin(), idx.end());
    return idx;
  };
  std::mt19937 rng(5);
  int compared = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 150);
    std::vector<float> s(n);
    for (float& x : s) {
      const int l = static_cast<int>(rng() % 9);
      x = l == 0 ? -0.0f : l == 8 && trial % 10 == 0 ? std::numeric_limits<float>::quiet_NaN() : 0.25f * l;
    }
    for (int count : {-1, 0, 1, 2, n / 3, n / 2, n - 1, n, n + 3}) {
      INFO("trial " << trial << " n " << n << " count " << count);
      CHECK(LowestSlots(s, count) == reference(s, count));
      ++compared;
    }
  }
  CHECK(compared == 2700);
}

TEST_CASE("hae: the cache grows to l + d and returns to l, the DAP set is broadcast", "[hae]") {
  testing::TinyTraceSpec spec;
  spec.num_layers = 3;
  MemoryTrace trace = testing::MakeTinyTrace(spec);  // n 24, 6 decode steps
  std::vector<RunSpec> runs{RunSpec{Make({"mode=BUDGET", "rc_size=2"}), "hae", 0, 10},
                            RunSpec{Make({"mode=BUDGET", "components=DAP_ONLY"}), "dap", 0, 10}};
  auto res = Replay(trace, runs, ReplayOptions{.threads = 2});
  REQUIRE(res.ok());
  const RunResult& r = (*res)[0];
  const double heads = spec.num_layers * spec.num_kv_heads;
  std::vector<double> sizes;
  for (const auto& tp : r.timeline()) sizes.push_back(tp.kv_tokens() / heads);
  // prefill 10; steps 0..5 attend with 11, 12 (flush after), 11, 12, 11, 12.
  CHECK(sizes == std::vector<double>{10, 11, 12, 11, 12, 11, 12});
  for (const LayerResult& l : r.layers())
    for (int u = 0; u < spec.num_kv_heads; ++u) CHECK(l.kv_head_tokens_peak(u) == 12);
  // DAP only: the same prompt tokens at every layer and head (kept-by-modality identical everywhere).
  const RunResult& dap = (*res)[1];
  for (const LayerResult& l : dap.layers()) {
    CHECK(l.metrics().kept_tokens_by_modality().image() ==
          dap.layers(0).metrics().kept_tokens_by_modality().image());
    CHECK(l.metrics().prompt_kept_tokens_mean() == 10);
  }
  double evicted = -1;
  for (const auto& st : dap.layers(1).policy_stats())
    if (st.name() == "dap_evicted") evicted = st.value();
  CHECK(evicted == 24 - 10);
}

TEST_CASE("hae: the paper's thresholds ignore the budget, and results say what was kept", "[hae]") {
  MemoryTrace trace = testing::MakeTinyTrace();
  std::vector<RunSpec> runs{RunSpec{Make({"r=0.5", "alpha=1", "rc_size=3"}), "hae", 0, 4}};
  auto res = Replay(trace, runs, ReplayOptions{.threads = 1});
  REQUIRE(res.ok());
  const Metrics& m = (*res)[0].metrics();
  CHECK(m.prompt_kept_tokens_mean() >= 12);  // DAP evicts visual tokens only: the 12 text tokens stay
  CHECK(m.prompt_kept_over_budget() > 1);
}

}  // namespace kvsim
