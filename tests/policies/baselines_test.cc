// Each baseline HeadPolicy driven directly, with hand-made prompt scores and decode attention, the way the
// replay engine drives it: OnPrefill on a cache holding [0, compress_end), then per step BeforeStep(cap),
// append the new token (unless the policy declines), AfterStep with the step's attention.

#include "policies/baselines.h"

#include <catch2/catch.hpp>
#include <functional>
#include <vector>

#include "policies/pieces.h"
#include "sim/select.h"

namespace kvsim {
namespace {

// Prompt scores chosen by the test, per query head of the group.
class FakeScores final : public PromptScores {
 public:
  std::span<const float> ColumnSums(int g) override { return col.at(g); }
  std::span<const float> WindowColumnSums(int g, int window) override {
    windows_asked.push_back(window);
    return win.at(g);
  }
  std::vector<std::vector<float>> col, win;
  std::vector<int> windows_asked;
};

TraceMeta Meta(int prefill, int steps, int num_layers = 1, int group = 1) {
  TraceMeta meta;
  meta.model.num_layers = num_layers;
  meta.model.num_heads = group;
  meta.model.num_kv_heads = 1;
  meta.model.head_dim = 2;
  meta.model.softmax_scale = 1;
  meta.prefill_length = prefill;
  meta.num_decode_steps = steps;
  meta.tokens.Resize(prefill + steps);
  return meta;
}

HeadContext Ctx(const TraceMeta& meta, int group, int compress_end, PromptScores* scores) {
  HeadContext ctx;
  ctx.meta = &meta;
  ctx.group_size = group;
  ctx.compress_end = compress_end;
  ctx.scores = scores;
  return ctx;
}

std::vector<int32_t> Tokens(const HeadCache& c) { return {c.tokens().begin(), c.tokens().end()}; }

std::vector<int32_t> Range(int32_t begin, int32_t end) {
  std::vector<int32_t> v;
  for (int32_t i = begin; i < end; ++i) v.push_back(i);
  return v;
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Runs the prefill hook on a cache holding [0, compress_end) and appends [compress_end, n) like the engine.
HeadCache Prefill(HeadPolicy& hp, const HeadContext& ctx, int budget) {
  HeadCache cache(ctx.head_dim());
  cache.AssignRange(0, ctx.compress_end);
  hp.OnPrefill(ctx, budget, &cache);
  for (int j = ctx.compress_end; j < ctx.prefill_length(); ++j) cache.Append(j);
  return cache;
}

// One decode step without attention feedback: BeforeStep, then append the new token.
void Step(HeadPolicy& hp, const HeadContext& ctx, int step, int cap, HeadCache* cache,
          const float* const* full_probs = nullptr,
          const std::function<void(int, int, std::vector<int32_t>*)>* full_topk = nullptr) {
  StepAttention att{step, cache->size(), nullptr, full_probs, full_topk};
  hp.BeforeStep(ctx, att, cap, cache);
  if (hp.AppendNewToken()) cache->Append(ctx.prefill_length() + step);
}

}  // namespace

// ---- full ----

TEST_CASE("full keeps everything and asks for nothing", "[baselines]") {
  FullPolicy p{policy::FullParams()};
  const TraceMeta meta = Meta(10, 2, 3);
  CHECK(p.LayerBudgets(meta, 2, 10) == std::vector<int>{10, 10, 10});
  CHECK_FALSE(p.evicts_during_decode());
  const PolicyRequirements req = p.requirements();
  CHECK_FALSE(req.prompt_column_sums);
  CHECK(req.window == 0);
  auto hp = p.NewHeadPolicy(Ctx(meta, 1, 10, nullptr));
  HeadCache cache = Prefill(*hp, Ctx(meta, 1, 10, nullptr), 2);
  CHECK(Tokens(cache) == Range(0, 10));
}

// ---- streaming_llm ----

TEST_CASE("streaming_llm: 4 sinks + the most recent tokens, the window slides during decode", "[baselines]") {
  StreamingLLMPolicy p{policy::StreamingLLMParams()};
  CHECK(p.params().num_sinks() == 4);
  CHECK(p.evicts_during_decode());
  CHECK_FALSE(p.requirements().prompt_column_sums);
  const TraceMeta meta = Meta(20, 4);
  const HeadContext ctx = Ctx(meta, 1, 20, nullptr);
  auto hp = p.NewHeadPolicy(ctx);
  // Budget 10: sinks 0..3 + the last 6 prompt tokens 14..19.
  HeadCache cache = Prefill(*hp, ctx, 10);
  CHECK(Tokens(cache) == Concat(Range(0, 4), Range(14, 20)));
  // Decode with cap 10: each step drops the oldest non-sink token and appends the new one.
  Step(*hp, ctx, 0, 10, &cache);
  CHECK(Tokens(cache) == Concat(Range(0, 4), Range(15, 21)));
  Step(*hp, ctx, 1, 10, &cache);
  Step(*hp, ctx, 2, 10, &cache);
  CHECK(Tokens(cache) == Concat(Range(0, 4), Range(17, 23)));
}

TEST_CASE("streaming_llm: query-agnostic question tail, zero sinks, budget below the sinks", "[baselines]") {
  const TraceMeta meta = Meta(20, 4);
  StreamingLLMPolicy p{policy::StreamingLLMParams()};
  {
    // Context [0, 16) compressed to 6 (sinks + 14, 15); the question 16..19 appended; cap = 6 + 4.
    const HeadContext ctx = Ctx(meta, 1, 16, nullptr);
    auto hp = p.NewHeadPolicy(ctx);
    HeadCache cache = Prefill(*hp, ctx, 6);
    CHECK(Tokens(cache) == Concat(Range(0, 4), Range(14, 20)));
    Step(*hp, ctx, 0, 10, &cache);
    CHECK(Tokens(cache) == Concat(Range(0, 4), Range(15, 21)));
  }
  {
    policy::StreamingLLMParams none;
    none.set_num_sinks(0);
    StreamingLLMPolicy p0{none};
    const HeadContext ctx = Ctx(meta, 1, 20, nullptr);
    auto hp = p0.NewHeadPolicy(ctx);
    HeadCache cache = Prefill(*hp, ctx, 5);
    CHECK(Tokens(cache) == Range(15, 20));
    Step(*hp, ctx, 0, 5, &cache);
    CHECK(Tokens(cache) == Range(16, 21));
  }
  {
    // Budget 3 < 4 sinks: keeps tokens 0..2; decode keeps 0, 1 and slides the last slot.
    const HeadContext ctx = Ctx(meta, 1, 20, nullptr);
    auto hp = p.NewHeadPolicy(ctx);
    HeadCache cache = Prefill(*hp, ctx, 3);
    CHECK(Tokens(cache) == Range(0, 3));
    Step(*hp, ctx, 0, 3, &cache);
    CHECK(Tokens(cache) == std::vector<int32_t>{0, 1, 20});
    Step(*hp, ctx, 1, 3, &cache);
    CHECK(Tokens(cache) == std::vector<int32_t>{0, 1, 21});
  }
}

// ---- h2o ----

namespace {

// Prompt column sums of both query heads (positions 0..9):
const std::vector<float> kH2OCol{3, 1, 0, 2, 4, 0, 2, 2.5f, 9, 0.5f};

struct H2OFixture {
  TraceMeta meta = Meta(10, 4, 1, 2);
  FakeScores scores;
  HeadContext ctx;
  H2OFixture() {
    scores.col = {kH2OCol, kH2OCol};
    ctx = Ctx(meta, 2, 10, &scores);
  }
};

policy::H2OParams H2O(double heavy_fraction, bool one_shot = false,
                      policy::GroupAggregation agg = policy::MEAN) {
  policy::H2OParams p;
  p.set_heavy_fraction(heavy_fraction);
  p.set_one_shot(one_shot);
  p.set_group_aggregation(agg);
  return p;
}

}  // namespace

TEST_CASE("h2o prefill: heavy hitters by column sums + the recent window", "[baselines]") {
  H2OFixture f;
  struct Case {
    double heavy_fraction;
    bool one_shot;
    std::vector<int32_t> want;
  };
  // Budget 6 over scores [3, 1, 0, 2, 4, 0, 2, 2.5, 9, 0.5]:
  const Case cases[] = {
      // heavy round(3) = 3, recent 3 (7..9); top-3 of [3, 1, 0, 2, 4, 0, 2] = 4, 0, then 3 (tie with 6:
      // lower).
      {0.5, false, {0, 3, 4, 7, 8, 9}},
      // heavy 0: the last 6 tokens.
      {0.0, false, {4, 5, 6, 7, 8, 9}},
      // heavy round(2.04) = 2, recent 4 (6..9); top-2 of [3, 1, 0, 2, 4, 0] = 4, 0.
      {0.34, false, {0, 4, 6, 7, 8, 9}},
      // heavy 6 but the per-step form keeps >= 1 recent slot: top-5 of [0, 9) + token 9.
      {1.0, false, {0, 3, 4, 7, 8, 9}},
      // one-shot, heavy 6: no recent window, top-6 of all 10 (token 9 scores 0.5 and is dropped).
      {1.0, true, {0, 3, 4, 6, 7, 8}},
  };
  for (const Case& c : cases) {
    INFO("heavy_fraction " << c.heavy_fraction << " one_shot " << c.one_shot);
    H2OPolicy p{H2O(c.heavy_fraction, c.one_shot)};
    auto hp = p.NewHeadPolicy(f.ctx);
    CHECK(Tokens(Prefill(*hp, f.ctx, 6)) == c.want);
  }
}

TEST_CASE("h2o prefill: the group's column sums are aggregated (mean / max / sum)", "[baselines]") {
  // Budget 2, heavy 1 + recent 1 (token 3). Heads: [10, 6, 0, 0] and [0, 6, 0, 0].
  //   mean [5, 6, 0] -> token 1; max [10, 6, 0] -> token 0; sum [10, 12, 0] -> token 1.
  const TraceMeta meta = Meta(4, 2, 1, 2);
  FakeScores scores;
  scores.col = {{10, 6, 0, 0}, {0, 6, 0, 0}};
  const HeadContext ctx = Ctx(meta, 2, 4, &scores);
  const std::pair<policy::GroupAggregation, std::vector<int32_t>> cases[] = {
      {policy::MEAN, {1, 3}}, {policy::MAX, {0, 3}}, {policy::SUM, {1, 3}}};
  for (const auto& [agg, want] : cases) {
    H2OPolicy p{H2O(0.5, false, agg)};
    auto hp = p.NewHeadPolicy(ctx);
    CHECK(Tokens(Prefill(*hp, ctx, 2)) == want);
  }
}

TEST_CASE("h2o decode: evicts the lowest accumulated score outside the protected recent window",
          "[baselines]") {
  H2OFixture f;
  CHECK(H2OPolicy{H2O(0.5)}.requirements().prompt_column_sums);
  CHECK(H2OPolicy{H2O(0.5)}.requirements().decode_attention);
  CHECK(H2OPolicy{H2O(0.5)}.evicts_during_decode());
  // After step 0 the cache is [0, 4, 7, 8, 9, 10]; the step's attention per head over those slots:
  const std::vector<float> probs{0.0f, 0.0f, 0.9f, 0.0f, 0.0f, 0.1f,   // head 0
                                 0.3f, 0.0f, 0.0f, 0.3f, 0.0f, 0.4f};  // head 1
  // mean: +[.15, 0, .45, .15, 0, .25] -> token 0: 3.15, token 7: 2.95 -> token 7 is evicted at step 1;
  // max:  +[.3,  0, .9,  .3,  0, .4 ] -> token 0: 3.3,  token 7: 3.4  -> token 0 is evicted at step 1.
  // Token 9 (0.5) and token 10 (new, 0.25 / 0.4) score lower but are the protected recent window
  // (recent 3 = the new token + the 2 most recent slots).
  for (auto agg : {policy::MEAN, policy::MAX}) {
    INFO("aggregation " << policy::GroupAggregation_Name(agg));
    H2OPolicy p{H2O(0.5, false, agg)};
    auto hp = p.NewHeadPolicy(f.ctx);
    HeadCache cache = Prefill(*hp, f.ctx, 6);
    REQUIRE(Tokens(cache) == std::vector<int32_t>{0, 3, 4, 7, 8, 9});
    // Step 0, cap 6: candidates are slots of 0 (3), 3 (2), 4 (4), 7 (2.5); 8 and 9 protected -> evict 3.
    Step(*hp, f.ctx, 0, 6, &cache);
    REQUIRE(Tokens(cache) == std::vector<int32_t>{0, 4, 7, 8, 9, 10});
    hp->AfterStep(f.ctx, StepAttention{0, 6, probs.data(), nullptr}, &cache);
    Step(*hp, f.ctx, 1, 6, &cache);
    if (agg == policy::MEAN)
      CHECK(Tokens(cache) == std::vector<int32_t>{0, 4, 8, 9, 10, 11});
    else
      CHECK(Tokens(cache) == std::vector<int32_t>{4, 7, 8, 9, 10, 11});
  }
}

TEST_CASE("h2o decode: kvsim at budget B attends with the paper's cache of budget B - 1 plus the new token",
          "[baselines]") {
  // The paper keeps B' slots between steps, attends with B' + 1 (the new token added), then evicts one. kvsim
  // counts the new token in its cap, so each step attends with B slots: B' = B - 1. Reference below: the
  // paper's loop at B' = 5 (heavy 3, recent 2 including the new token); kvsim at B = 6 (heavy 3, recent 3).
  H2OFixture f;
  auto attention = [](int32_t tok, int step) {  // any fixed per-(token, step) attention without ties
    return 0.01f * static_cast<float>((tok * 7 + step * 3) % 13 + 1) + 1e-4f * static_cast<float>(tok);
  };
  H2OPolicy p{H2O(0.5)};
  auto hp = p.NewHeadPolicy(f.ctx);
  HeadCache cache = Prefill(*hp, f.ctx, 6);
  // Paper prefill at B' = 5: the top-3 column sums over [0, 8) -> 4 (4), 0 (3), 7 (2.5), plus 8, 9. kvsim
  // kept {0, 3, 4, 7, 8, 9} and evicts 3 (2) before step 0: the same 5 old slots.
  std::vector<float> acc(kH2OCol.begin(), kH2OCol.end());
  acc.resize(14, 0.0f);
  std::vector<int32_t> paper{0, 4, 7, 8, 9};
  for (int t = 0; t < 4; ++t) {
    const int32_t tok = 10 + t;
    Step(*hp, f.ctx, t, 6, &cache);
    std::vector<int32_t> attended = paper;
    attended.push_back(tok);
    INFO("step " << t);
    CHECK(Tokens(cache) == attended);
    CHECK(cache.size() == 6);
    std::vector<float> probs;
    for (int g = 0; g < 2; ++g)
      for (int32_t a : Tokens(cache)) probs.push_back(attention(a, t));
    hp->AfterStep(f.ctx, StepAttention{t, cache.size(), probs.data(), nullptr}, &cache);
    // Paper: accumulate, then evict the lowest score outside the 2 most recent slots.
    for (int32_t a : attended) acc[a] += attention(a, t);
    int victim = 0;
    for (int s = 1; s < static_cast<int>(attended.size()) - 2; ++s)
      if (acc[attended[s]] < acc[attended[victim]]) victim = s;
    attended.erase(attended.begin() + victim);
    paper = attended;
  }
}

TEST_CASE("h2o decode: heavy_fraction 1 still gives the new token its slot", "[baselines]") {
  H2OFixture f;
  H2OPolicy p{H2O(1.0)};
  auto hp = p.NewHeadPolicy(f.ctx);
  HeadCache cache = Prefill(*hp, f.ctx, 6);
  REQUIRE(Tokens(cache) == std::vector<int32_t>{0, 3, 4, 7, 8, 9});
  // Recent window = 1 (the new token): every old slot competes; token 9 (0.5) is the lowest.
  Step(*hp, f.ctx, 0, 6, &cache);
  CHECK(Tokens(cache) == std::vector<int32_t>{0, 3, 4, 7, 8, 10});
  // Without attention feedback token 10 has accumulated 0: it goes next, and 11 takes its place.
  Step(*hp, f.ctx, 1, 6, &cache);
  CHECK(Tokens(cache) == std::vector<int32_t>{0, 3, 4, 7, 8, 11});
}

TEST_CASE("h2o one_shot: compresses the prompt once, never evicts during decode", "[baselines]") {
  H2OFixture f;
  H2OPolicy p{H2O(0.5, true)};
  CHECK_FALSE(p.evicts_during_decode());
  CHECK_FALSE(p.requirements().decode_attention);
  CHECK(p.requirements().prompt_column_sums);
  auto hp = p.NewHeadPolicy(f.ctx);
  HeadCache cache = Prefill(*hp, f.ctx, 6);
  CHECK(Tokens(cache) == std::vector<int32_t>{0, 3, 4, 7, 8, 9});
  const std::vector<float> probs(14, 0.5f);
  for (int t = 0; t < 3; ++t) {
    Step(*hp, f.ctx, t, 6, &cache);
    hp->AfterStep(f.ctx, StepAttention{t, cache.size(), probs.data(), nullptr}, &cache);
  }
  CHECK(Tokens(cache) == std::vector<int32_t>{0, 3, 4, 7, 8, 9, 10, 11, 12});
}

// ---- snapkv ----

namespace {

struct SnapFixture {
  TraceMeta meta = Meta(10, 2, 1, 2);
  FakeScores scores;
  HeadContext ctx;
  SnapFixture() {
    // Window column sums per head; the group mean over [0, 7) is [3, 0, 0, 6, 0, 0, 0].
    scores.win = {{6, 0, 0, 12, 0, 0, 0, 1, 1, 1}, {0, 0, 0, 0, 0, 0, 0, 1, 1, 1}};
    ctx = Ctx(meta, 2, 10, &scores);
  }
};

policy::SnapKVParams Snap(int window, int kernel, policy::Pooling pooling) {
  policy::SnapKVParams p;
  p.set_window(window);
  p.set_kernel_size(kernel);
  p.set_pooling(pooling);
  return p;
}

}  // namespace

TEST_CASE("snapkv: pooled observation-window scores, top-k + the window", "[baselines]") {
  // Window 3, budget 5: keep 7..9 + top-2 of the pooled scores over [0, 7).
  //   AVG kernel 3 on [3, 0, 0, 6, 0, 0, 0] = [1, 1, 2, 2, 2, 0, 0] -> tokens 2, 3 (ties to the lower index).
  //   no pooling: top-2 of [3, 0, 0, 6, 0, 0, 0] -> tokens 0, 3.
  //   MAX kernel 3: [3, 3, 6, 6, 6, 0, 0] -> tokens 2, 3.
  const std::pair<policy::Pooling, std::vector<int32_t>> cases[] = {{policy::AVG, {2, 3, 7, 8, 9}},
                                                                    {policy::NO_POOL, {0, 3, 7, 8, 9}},
                                                                    {policy::MAX_POOL, {2, 3, 7, 8, 9}}};
  for (const auto& [pooling, want] : cases) {
    SnapFixture f;
    SnapKVPolicy p{Snap(3, 3, pooling)};
    CHECK(p.requirements().window == 3);
    CHECK_FALSE(p.requirements().prompt_column_sums);
    CHECK_FALSE(p.evicts_during_decode());
    auto hp = p.NewHeadPolicy(f.ctx);
    CHECK(Tokens(Prefill(*hp, f.ctx, 5)) == want);
    CHECK(f.scores.windows_asked == std::vector<int>{3, 3});  // once per query head of the group
  }
}

TEST_CASE("snapkv: budget below the window keeps only the last B tokens, scoring nothing", "[baselines]") {
  // B = 2 < w = 3: the official code refuses (assert B > w); kvsim keeps the window's last B tokens. No
  // prefix token can be voted in (B - w < 0) and no window token is ranked by the window's own attention:
  // no scores are computed.
  for (int budget : {1, 2, 3}) {
    SnapFixture f;
    SnapKVPolicy p{Snap(3, 3, policy::AVG)};
    auto hp = p.NewHeadPolicy(f.ctx);
    CHECK(Tokens(Prefill(*hp, f.ctx, budget)) == Range(10 - budget, 10));
    CHECK(f.scores.windows_asked.empty());
  }
  // B = w + 1: one prefix token is voted in, scored over [0, 7) only: AVG [1, 1, 2, 2, 2, 0, 0] -> token 2
  // (ties to the lower position).
  SnapFixture f;
  SnapKVPolicy p{Snap(3, 3, policy::AVG)};
  auto hp = p.NewHeadPolicy(f.ctx);
  CHECK(Tokens(Prefill(*hp, f.ctx, 4)) == std::vector<int32_t>{2, 7, 8, 9});
  CHECK(f.scores.windows_asked == std::vector<int>{3, 3});
}

TEST_CASE("snapkv: a window longer than the prompt observes the whole prompt", "[baselines]") {
  SnapFixture f;
  SnapKVPolicy p{Snap(32, 5, policy::AVG)};
  auto hp = p.NewHeadPolicy(f.ctx);
  HeadCache cache = Prefill(*hp, f.ctx, 4);
  CHECK(Tokens(cache) == std::vector<int32_t>{6, 7, 8, 9});
  CHECK(f.scores.windows_asked.empty());  // B < w' = 10: nothing to vote for
  // Decode appends (no eviction hooks).
  Step(*hp, f.ctx, 0, 4, &cache);
  CHECK(Tokens(cache) == std::vector<int32_t>{6, 7, 8, 9, 10});
}

TEST_CASE("snapkv: query-agnostic compress_end bounds the window and the selection", "[baselines]") {
  // compress_end 8: window 3 = queries 5..7, top-2 of pooled [0, 5): [3, 0, 0, 6, 0] -> AVG k3 -> [1, 1, 2,
  // 2, 2]
  // -> tokens 2, 3; then 5..7, and the question 8, 9 appended.
  SnapFixture f;
  f.ctx.compress_end = 8;
  SnapKVPolicy p{Snap(3, 3, policy::AVG)};
  auto hp = p.NewHeadPolicy(f.ctx);
  CHECK(Tokens(Prefill(*hp, f.ctx, 5)) == std::vector<int32_t>{2, 3, 5, 6, 7, 8, 9});
}

// ---- pyramidkv ----

TEST_CASE("pyramidkv: linear layer budgets with an exact total; SnapKV selection per layer", "[baselines]") {
  policy::PyramidKVParams params;
  params.set_window(8);
  PyramidKVPolicy p{params};
  CHECK(p.requirements().window == 8);
  CHECK_FALSE(p.evicts_during_decode());
  const TraceMeta meta4 = Meta(1000, 2, 4);
  // See pieces_test: 188, 130, 72, 14 (= 404) -> 187, 129, 71, 13.
  CHECK(p.LayerBudgets(meta4, 100, 1000) == std::vector<int>{187, 129, 71, 13});
  CHECK(p.LayerBudgets(meta4, 100, 150) == std::vector<int>{150, 142, 83, 25});
  // Defaults: window 32, beta 20.
  PyramidKVPolicy def{policy::PyramidKVParams()};
  CHECK(def.LayerBudgets(meta4, 100, 1000) == std::vector<int>{165, 122, 78, 35});
  // The head policy is SnapKV's selection with the layer's budget.
  SnapFixture f;
  policy::PyramidKVParams small;
  small.set_window(3);
  small.set_kernel_size(3);
  PyramidKVPolicy ps{small};
  auto hp = ps.NewHeadPolicy(f.ctx);
  CHECK(Tokens(Prefill(*hp, f.ctx, 5)) == std::vector<int32_t>{2, 3, 7, 8, 9});
}

// ---- oracle ----

TEST_CASE("oracle: each step keeps the top-cap tokens of that step's attention", "[baselines]") {
  const TraceMeta meta = Meta(5, 3, 1, 2);
  const HeadContext ctx = Ctx(meta, 2, 5, nullptr);
  OraclePolicy p{policy::OracleParams()};
  CHECK(p.requirements().future_attention);
  CHECK(p.evicts_during_decode());
  auto hp = p.NewHeadPolicy(ctx);
  // Prefill: nothing known yet; keeps the last `budget` prompt tokens.
  HeadCache cache = Prefill(*hp, ctx, 3);
  CHECK(Tokens(cache) == std::vector<int32_t>{2, 3, 4});
  // Step 0 (token 5): group mean of [.1, .5, 0, .1, .1, .2] and [.3, .1, 0, .1, .1, .4]
  //   = [.2, .3, 0, .1, .1, .3]; top-3 = tokens 1, 5, 0 -> the new token is in: cache {0, 1} + 5.
  const std::vector<float> g0{.1f, .5f, 0, .1f, .1f, .2f}, g1{.3f, .1f, 0, .1f, .1f, .4f};
  const float* rows0[2] = {g0.data(), g1.data()};
  Step(*hp, ctx, 0, 3, &cache, rows0);
  CHECK(hp->AppendNewToken());
  CHECK(Tokens(cache) == std::vector<int32_t>{0, 1, 5});
  // Step 1 (token 6): both heads [.4, .1, .1, .1, .1, .1, .1]; top-3 = 0, 1, 2 (ties to the lower index):
  // the new token is not among them and is left out.
  const std::vector<float> h{.4f, .1f, .1f, .1f, .1f, .1f, .1f};
  const float* rows1[2] = {h.data(), h.data()};
  Step(*hp, ctx, 1, 3, &cache, rows1);
  CHECK_FALSE(hp->AppendNewToken());
  CHECK(Tokens(cache) == std::vector<int32_t>{0, 1, 2});
}

TEST_CASE("oracle: decode_growth keeps cap + t + 1 slots, a prefill-compressing cache's size",
          "[baselines]") {
  const TraceMeta meta = Meta(5, 3, 1, 2);
  const HeadContext ctx = Ctx(meta, 2, 5, nullptr);
  policy::OracleParams params;
  params.set_decode_growth(true);
  OraclePolicy p{params};
  CHECK_FALSE(p.evicts_during_decode());  // the engine checks it like snapkv: cap + t + 1 at step t
  auto hp = p.NewHeadPolicy(ctx);
  HeadCache cache = Prefill(*hp, ctx, 2);
  CHECK(Tokens(cache) == std::vector<int32_t>{3, 4});
  // Step 0 (token 5), cap 2 + 1: group mean [.2, .3, 0, .1, .15, .25] -> top-3 = 1, 5, 0.
  const std::vector<float> g0{.1f, .5f, 0, .1f, .1f, .2f}, g1{.3f, .1f, 0, .1f, .2f, .3f};
  const float* rows0[2] = {g0.data(), g1.data()};
  Step(*hp, ctx, 0, 2, &cache, rows0);
  CHECK(Tokens(cache) == std::vector<int32_t>{0, 1, 5});
  // Step 1 (token 6), cap 2 + 2: [.4, .1, .05, .3, .06, .07, .02] -> top-4 = 0, 3, 1, 5; the new token is
  // out.
  const std::vector<float> h{.4f, .1f, .05f, .3f, .06f, .07f, .02f};
  const float* rows1[2] = {h.data(), h.data()};
  Step(*hp, ctx, 1, 2, &cache, rows1);
  CHECK_FALSE(hp->AppendNewToken());
  CHECK(Tokens(cache) == std::vector<int32_t>{0, 1, 3, 5});
}

TEST_CASE("oracle: MHA selection takes the engine's top-k indices", "[baselines]") {
  const TraceMeta meta = Meta(4, 3, 1, 1);  // n = 4, MHA
  const HeadContext ctx = Ctx(meta, 1, 4, nullptr);
  OraclePolicy p{policy::OracleParams()};
  auto hp = p.NewHeadPolicy(ctx);
  HeadCache cache = Prefill(*hp, ctx, 3);
  // Step 0 (token 4): [.1, .4, .2, .2, .1]; top-3 = 1 (.4) and the tied .2s at 2, 3 -> {1, 2, 3}; the new
  // token (.1) is left out.
  // The engine's answer (here TopKIndices over the row, as the engine's is) is what the cache keeps.
  const std::vector<float> row{.1f, .4f, .2f, .2f, .1f};
  const float* probs[1] = {row.data()};
  std::vector<int> asked;
  const std::function<void(int, int, std::vector<int32_t>*)> topk = [&](int g, int k,
                                                                        std::vector<int32_t>* out) {
    CHECK(g == 0);
    asked.push_back(k);
    *out = TopKIndices(row, k);
  };
  Step(*hp, ctx, 0, 3, &cache, probs, &topk);
  CHECK_FALSE(hp->AppendNewToken());
  CHECK(Tokens(cache) == std::vector<int32_t>{1, 2, 3});
  // cap 2: .4 and the first .2 (tie to the lower index).
  Step(*hp, ctx, 0, 2, &cache, probs, &topk);
  CHECK(Tokens(cache) == std::vector<int32_t>{1, 2});
  // cap 5: every token, the new one (4) too: left to the engine's append (AppendNewToken), not assigned.
  Step(*hp, ctx, 0, 5, &cache, probs, &topk);
  CHECK(hp->AppendNewToken());
  CHECK(Tokens(cache) == std::vector<int32_t>{0, 1, 2, 3, 4});
  CHECK(asked == std::vector<int>{3, 2, 5});
}

TEST_CASE("oracle: GQA selection follows the group aggregation", "[baselines]") {
  // Token 3 is new. Heads [.8, .2, 0, 0] and [0, .7, .2, .1]: mean [.4, .45, .1, .05] -> token 1;
  // max [.8, .7, .2, .1] -> token 0. Cap 1: the new token is left out either way.
  const TraceMeta meta = Meta(3, 1, 1, 2);
  const HeadContext ctx = Ctx(meta, 2, 3, nullptr);
  const std::vector<float> g0{.8f, .2f, 0, 0}, g1{0, .7f, .2f, .1f};
  const float* rows[2] = {g0.data(), g1.data()};
  for (auto [agg, want] : {std::pair{policy::MEAN, 1}, std::pair{policy::MAX, 0}}) {
    policy::OracleParams params;
    params.set_group_aggregation(agg);
    OraclePolicy p{params};
    auto hp = p.NewHeadPolicy(ctx);
    HeadCache cache = Prefill(*hp, ctx, 1);
    Step(*hp, ctx, 0, 1, &cache, rows);
    CHECK_FALSE(hp->AppendNewToken());
    CHECK(Tokens(cache) == std::vector<int32_t>{want});
  }
}

}  // namespace kvsim
