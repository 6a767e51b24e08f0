// MEDA and LOOK-M: the paper's equations on hand-computed cases (entropy Eqs. 4-6, allocation Eq. 7, text
// prior Eq. 9, M:N split Eq. 10, merge Eqs. 11-12), the official-code variant's behaviours, and the
// properties the issue asks for on a synthetic LLaVA-shaped trace.

#include "policies/meda.h"

#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <numeric>
#include <optional>

#include "policies/registry.h"
#include "sim/replay.h"
#include "tests/test_util.h"
#include "traces/synth.h"

namespace kvsim {
namespace {

std::shared_ptr<const Policy> Make(const std::string& name, std::vector<std::string> sets = {}) {
  auto p = PolicyRegistry::Default().Create(name, sets);
  INFO(p.status().message());
  REQUIRE(p.ok());
  return *p;
}

// One layer, one head, d 8 (only component 0 used), softmax scale 1. Tokens 0-1 text, 2-4 image.
// Queries (0, 1 | 0, 1, 2), keys (1, -1 | 0, 1, 2).
// One layer, d 8, softmax scale 1, text tokens [0, image_begin), image tokens [image_begin, prefill), one
// decode step, every query stored; queries and keys zero (the hand-computed cases set what they use).
MemoryTrace ZeroedLayer(int heads, int prefill, int image_begin) {
  testing::TinyTraceSpec spec;
  spec.num_layers = 1;
  spec.num_heads = heads;
  spec.num_kv_heads = 1;
  spec.prefill_length = prefill;
  spec.decode_steps = 1;
  spec.image_begin = image_begin;
  spec.image_end = prefill;
  spec.question_tokens = 0;
  MemoryTrace tr = testing::MakeTinyTrace(spec);
  tr.mutable_meta().model.softmax_scale = 1.0;
  LayerData& l = tr.layers()[0];
  std::fill(l.queries.begin(), l.queries.end(), 0.0f);
  std::fill(l.keys.begin(), l.keys.end(), 0.0f);
  return tr;
}

MemoryTrace HandLayer() {
  MemoryTrace tr = ZeroedLayer(/*heads=*/1, /*prefill=*/5, /*image_begin=*/2);
  LayerData& l = tr.layers()[0];
  const float q[5] = {0, 1, 0, 1, 2}, k[5] = {1, -1, 0, 1, 2};
  for (int i = 0; i < 5; ++i) {
    l.queries[i * 8] = q[i];
    l.keys[i * 8] = k[i];
  }
  return tr;
}

// Prompt scores from a fixed vector (one query head).
class FixedScores final : public PromptScores {
 public:
  explicit FixedScores(std::vector<float> s) : s_(std::move(s)) {}
  std::span<const float> ColumnSums(int) override { return s_; }
  std::span<const float> WindowColumnSums(int, int) override { return s_; }

 private:
  std::vector<float> s_;
};

// 12 prompt tokens, d 2: text 0, 1, 6, 10, 11; image 2-5, 7-9. Image token 5 has the highest raw score.
struct HandHead {
  TraceMeta meta;
  std::vector<float> keys, values;
  FixedScores scores{{.01f, .02f, .2f, .3f, .4f, .5f, .03f, .1f, .1f, .1f, .05f, .05f}};
  HeadContext ctx;
  HandHead() {
    meta.model.head_dim = 2;
    meta.model.num_layers = 1;
    meta.prefill_length = 12;
    meta.num_decode_steps = 1;
    meta.tokens.Resize(13);
    for (int j : {2, 3, 4, 5, 7, 8, 9}) meta.tokens.modality[j] = Modality::kImage;
    for (int j = 0; j < 13; ++j) {
      keys.push_back(std::cos(0.3f * j));
      keys.push_back(std::sin(0.3f * j));
      values.push_back(j);
      values.push_back(-j);
    }
    ctx.meta = &meta;
    ctx.compress_end = 12;
    ctx.keys = keys.data();
    ctx.values = values.data();
    ctx.scores = &scores;
  }
  // Runs the policy's prefill hook on a cache holding [0, 12) and returns it.
  HeadCache Prefill(const Policy& p, int budget) {
    HeadCache cache(2);
    cache.AssignRange(0, 12);
    p.NewHeadPolicy(ctx)->OnPrefill(ctx, budget, &cache);
    return cache;
  }
};

std::vector<int32_t> Anchors(const HeadCache& c) { return {c.tokens().begin(), c.tokens().end()}; }

}  // namespace

TEST_CASE("meda: mean row entropy of a known 2x3 block", "[meda]") {
  // Rows q = 0 and q = 1 over keys 0, 1, 2 (d 1): H(uniform 3) = ln 3 and H(softmax(0, 1, 2)) = 0.83239558.
  const float q[2] = {0, 1}, k[3] = {0, 1, 2};
  CHECK(MeanRowEntropy(LogitTransform(1.0f, 0.0f), q, 2, k, 3, 1) ==
        Approx((std::log(3.0) + 0.83239558) / 2));
  CHECK(MeanRowEntropy(LogitTransform(1.0f, 0.0f), q, 0, k, 3, 1) == 0);
}

TEST_CASE("meda: cross-modal entropy (Eqs. 4-6) restricts each softmax to the other modality", "[meda]") {
  MemoryTrace tr = HandLayer();
  LayerData layer;
  REQUIRE(tr.ReadLayer(0, &layer).ok());
  const LayerView view{&tr.meta(), &layer, 0, 5, 1};
  // -E_TV: text queries 0, 1 over image keys 0, 1, 2 -> mean(ln 3, 0.83239558) = 0.96550394.
  // -E_VT: image queries 0, 1, 2 over text keys 1, -1 -> mean(ln 2, 0.36533386, 0.09009477) = 0.38285860.
  CHECK(MedaLayerEntropy(view, policy::MedaParams::CROSS_MODAL) == Approx(1.34836254));
  // Code: causal self-attention rows 0..4: 0, 0.36533386, ln 3, 1.17266778, 0.74318973 -> mean 0.67596073.
  CHECK(MedaLayerEntropy(view, policy::MedaParams::FULL_SELF) == Approx(0.67596073));
}

TEST_CASE("meda: head_averaging = entropy of the head-averaged attention (the paper's wording)", "[meda]") {
  // 2 query heads on 1 KV head, d 8 (component 0), scale 1. Tokens 0-1 text, 2-3 image; keys (0, 1 | 0, 1);
  // queries head 0 (ln 3, ln 3 | 0, 0), head 1 (-ln 3, -ln 3 | 0, 0).
  MemoryTrace tr = ZeroedLayer(/*heads=*/2, /*prefill=*/4, /*image_begin=*/2);
  LayerData& l = tr.layers()[0];
  const int t = 5, d = 8;  // 4 prompt + 1 decode token, every query stored
  const float ln3 = static_cast<float>(std::log(3.0));
  for (int j : {1, 3}) l.keys[static_cast<size_t>(j) * d] = 1.0f;
  for (int i : {0, 1}) {
    l.queries[(0 * t + i) * d] = ln3;
    l.queries[(1 * t + i) * d] = -ln3;
  }
  LayerData layer;
  REQUIRE(tr.ReadLayer(0, &layer).ok());
  const LayerView view{&tr.meta(), &layer, 0, 4, 1};
  using P = policy::MedaParams;
  const double h13 = 0.25 * std::log(4.0) + 0.75 * std::log(4.0 / 3);  // H(1/4, 3/4) = 0.5623351
  const double ln2 = std::log(2.0), ln3d = std::log(3.0), ln4 = std::log(4.0);
  // CROSS_MODAL. Text rows over image keys (0, 1): head 0 (1/4, 3/4), head 1 (3/4, 1/4); image rows (q = 0)
  // over text keys: uniform. Per-head entropies: H(1/4, 3/4) + ln 2; the head mean of the rows is
  // (1/2, 1/2): ln 2 + ln 2.
  CHECK(MedaLayerEntropy(view, P::CROSS_MODAL, P::MEAN_OF_HEAD_ENTROPIES) == Approx(h13 + ln2));
  CHECK(MedaLayerEntropy(view, P::CROSS_MODAL, P::ENTROPY_OF_MEAN_ATTENTION) == Approx(2 * ln2));
  // FULL_SELF, causal rows 0..3: 0; keys (0, 1): H(1/4, 3/4) per head, ln 2 averaged; uniform 3; uniform 4.
  CHECK(MedaLayerEntropy(view, P::FULL_SELF, P::MEAN_OF_HEAD_ENTROPIES) ==
        Approx((0 + h13 + ln3d + ln4) / 4));  // 0.76181045
  CHECK(MedaLayerEntropy(view, P::FULL_SELF, P::ENTROPY_OF_MEAN_ATTENTION) ==
        Approx((0 + ln2 + ln3d + ln4) / 4));  // 0.79451348
  // The parameter reaches the first pass; the default keeps the mean of per-head entropies.
  CHECK(Make("meda")->ParamsText().find("head_averaging: MEAN_OF_HEAD_ENTROPIES") != std::string::npos);
  CHECK(Make("meda", {"variant=OFFICIAL_CODE"})->ParamsText().find("MEAN_OF_HEAD_ENTROPIES") !=
        std::string::npos);
}

TEST_CASE("meda: the head-averaged entropy is bit-identical at any thread count", "[meda]") {
  testing::TinyTraceSpec spec;
  spec.num_heads = 4;
  spec.num_kv_heads = 2;
  spec.prefill_length = 300;  // 3 row blocks of 128
  spec.image_end = 280;
  MemoryTrace tr = testing::MakeTinyTrace(spec);
  LayerData layer;
  REQUIRE(tr.ReadLayer(1, &layer).ok());
  for (auto mode : {policy::MedaParams::CROSS_MODAL, policy::MedaParams::FULL_SELF}) {
    const double one = MedaLayerEntropy(LayerView{&tr.meta(), &layer, 1, 300, 1}, mode,
                                        policy::MedaParams::ENTROPY_OF_MEAN_ATTENTION);
    const double two = MedaLayerEntropy(LayerView{&tr.meta(), &layer, 1, 300, 3}, mode,
                                        policy::MedaParams::ENTROPY_OF_MEAN_ATTENTION);
    CHECK(one == two);
    // Entropy is concave: the entropy of the mean row is at least the mean of the heads' entropies.
    CHECK(one >= MedaLayerEntropy(LayerView{&tr.meta(), &layer, 1, 300, 1}, mode) - 1e-6);
  }
}

TEST_CASE("meda: softmax allocation (Eq. 7) has an exact total and respects the prompt length", "[meda]") {
  const double ln2 = std::log(2.0), ln3 = std::log(3.0);
  // softmax(0, ln 2, ln 3) = (1, 2, 3) / 6; L * B = 30 -> (5, 10, 15).
  CHECK(MedaLayerBudgets(std::vector<double>{0, ln2, ln3}, 10, 100, false, 0.01) ==
        std::vector<int>{5, 10, 15});
  // L * B = 21 -> (3.5, 7, 10.5): floors (3, 7, 10), the remaining token goes to the first largest remainder.
  CHECK(MedaLayerBudgets(std::vector<double>{0, ln2, ln3}, 7, 100, false, 0.01) ==
        std::vector<int>{4, 7, 10});
  // L * B = 150 over prompt 60: (25, 50, 75) -> layer 2 capped at 60, its 15 split 1:2 -> (30, 60, 60).
  CHECK(MedaLayerBudgets(std::vector<double>{0, ln2, ln3}, 50, 60, false, 0.01) ==
        std::vector<int>{30, 60, 60});
  // Equal entropies: uniform.
  CHECK(MedaLayerBudgets(std::vector<double>{2, 2, 2, 2}, 9, 50, false, 0.01) ==
        std::vector<int>{9, 9, 9, 9});
}

TEST_CASE("meda: the official code clamps layer ratios to [0.01, 1] and does not redistribute", "[meda]") {
  const std::vector<double> e{0, 0, std::log(100.0)};  // softmax = (1, 1, 100) / 102
  // Paper: 150 tokens, layer 2 capped at 100, the other two share 50 -> exact total.
  CHECK(MedaLayerBudgets(e, 50, 100, false, 0.01) == std::vector<int>{25, 25, 100});
  // Code: α = softmax * 3 * 0.5 = (0.0147, 0.0147, 1.47) -> clamp -> floor(α * 100) = (1, 1, 100): 102 !=
  // 150.
  CHECK(MedaLayerBudgets(e, 50, 100, true, 0.01) == std::vector<int>{1, 1, 100});
  CHECK(MedaLayerBudgets(e, 50, 100, true, 0.05) == std::vector<int>{5, 5, 100});
}

TEST_CASE("meda: the lower clamp of clamp_layer_ratio can allocate more than L * B", "[meda]") {
  // E = (2, 1.5, 1, .5): β = (.455, .276, .167, .102); ce = 1000, B = 5: ρ = .005, α = β * 4 * .005 =
  // (.0091, .0055, .0033, .0020) -> all clamped up to .01 -> ⌊.01 * 1000⌋ = 10 per layer: 40 > L * B = 20.
  const std::vector<double> e{2.0, 1.5, 1.0, 0.5};
  CHECK(MedaLayerBudgets(e, 5, 1000, true, 0.01) == std::vector<int>{10, 10, 10, 10});
  CHECK(MedaLayerBudgets(e, 5, 1000, false, 0.01) == std::vector<int>{9, 6, 3, 2});  // paper: exact 20
  // B = 200: α = (.364, .221, .134, .081) -> floors 364, 220, 133, 81 = 798 < 800 (meda.md's table).
  CHECK(MedaLayerBudgets(e, 200, 1000, true, 0.01) == std::vector<int>{364, 220, 133, 81});
}

TEST_CASE("meda: with clamp_layer_ratio the run keeps more than B per layer, every layer within its budget",
          "[meda]") {
  // 4 layers, ce = 400 (376 image tokens), B = 2: every layer asks for about .005 of the prompt and is
  // clamped up to .01 -> ⌊4⌋ = 4 tokens. The per-layer budgets are caps (prompt_kept_over_budget 1 per
  // layer, may_exceed_budget() false), but the run keeps 4 per layer for B = 2: run-level ratio 2.
  testing::TinyTraceSpec spec;
  spec.num_layers = 4;
  spec.prefill_length = 400;
  spec.image_end = 380;
  spec.decode_steps = 2;
  MemoryTrace tr = testing::MakeTinyTrace(spec);
  const auto clamp = Make("meda", {"clamp_layer_ratio=true"});
  CHECK_FALSE(clamp->may_exceed_budget());
  std::vector<RunSpec> runs{RunSpec{clamp, "clamp", 0, 2}};
  auto res = Replay(tr, runs, ReplayOptions{.threads = 1});
  REQUIRE(res.ok());
  const RunResult& r = (*res)[0];
  CHECK(r.budget_tokens() == 2);
  CHECK(r.allocated_budget_tokens_mean() == 4);
  CHECK(r.metrics().prompt_kept_tokens_mean() == 4);
  CHECK(r.metrics().prompt_kept_over_budget() == 2);
  for (const auto& l : r.layers()) {
    CHECK(l.budget_tokens_mean() == 4);
    CHECK(l.metrics().prompt_kept_over_budget() == 1);
  }
}

TEST_CASE("meda: text prior (Eq. 9) and the 3:1 recent:important split (Eq. 10), the rest merged", "[meda]") {
  HandHead h;
  // Budget 4: M = 3 recent (9, 10, 11), N = 1 important: text scores += max (0.5), so text token 6
  // (0.03 + 0.5) beats image token 5 (0.5).
  const HeadCache c = h.Prefill(*Make("meda"), 4);
  CHECK(Anchors(c) == std::vector<int32_t>{6, 9, 10, 11});
  auto covered = c.CoveredTokens();
  std::sort(covered.begin(), covered.end());
  CHECK(covered.size() == 12);  // every evicted token is averaged into a kept slot (Eqs. 11-12)
  // Without merging: the same anchors, nothing covered beyond them.
  const HeadCache bare = h.Prefill(*Make("meda", {"merge=NO_MERGE"}), 4);
  CHECK(Anchors(bare) == Anchors(c));
  CHECK_FALSE(bare.has_merges());
  // Budget 8: M = 6 (6..11), N = 2: the two best boosted text tokens before the window, 1 and 0.
  CHECK(Anchors(h.Prefill(*Make("meda"), 8)) == std::vector<int32_t>{0, 1, 6, 7, 8, 9, 10, 11});
}

TEST_CASE("meda: official-code behaviours make the budget a floor", "[meda]") {
  HandHead h;
  // Keep-all-text, M:N 1:1: budget 4 -> recent 10, 11; 2 important = boosted text 6, 1; + every text token.
  const auto keep_text = Make("meda", {"text_prior=KEEP_ALL_TEXT", "recent_share=0.5"});
  CHECK(keep_text->may_exceed_budget());
  CHECK(Anchors(h.Prefill(*keep_text, 4)) == std::vector<int32_t>{0, 1, 6, 10, 11});
  // Recent window forced to text_len + 100 when shorter than the text: everything is kept.
  const auto code = Make("meda", {"variant=OFFICIAL_CODE", "compress_at=PREFILL"});
  CHECK(Anchors(h.Prefill(*code, 4)).size() == 12);
  // The variant preset fills unset fields; explicit ones win.
  CHECK(code->ParamsText().find("entropy: FULL_SELF") != std::string::npos);
  CHECK(code->ParamsText().find("compress_at: PREFILL") != std::string::npos);
  CHECK(code->ParamsText().find("merge_filter: ABOVE_MEAN_SIMILARITY") != std::string::npos);
  CHECK(Make("meda")->ParamsText().find("recent_share: 0.75") != std::string::npos);
  CHECK_FALSE(Make("meda")->may_exceed_budget());
}

TEST_CASE("meda: parameter validation names the field", "[meda]") {
  auto st = PolicyRegistry::Default().Create("meda", std::vector<std::string>{"recent_share=1.5"});
  REQUIRE_FALSE(st.ok());
  CHECK(st.status().message().find("recent_share") != std::string::npos);
  st = PolicyRegistry::Default().Create("meda", std::vector<std::string>{"text_prior=NO_TEXT_PRIOR"});
  REQUIRE_FALSE(st.ok());
  CHECK(st.status().message().find("LOOK-M") != std::string::npos);
  st = PolicyRegistry::Default().Create("look_m", std::vector<std::string>{"num_sinks=-1"});
  REQUIRE_FALSE(st.ok());
}

TEST_CASE("meda: needs every prompt query; the error says how to get them", "[meda]") {
  testing::TinyTraceSpec spec;
  spec.all_queries = false;
  MemoryTrace tr = testing::MakeTinyTrace(spec);
  tr.mutable_meta().has_prefill_column_sums = true;
  std::vector<RunSpec> runs{RunSpec{Make("meda"), "meda", 0.5, 0}};
  Status st = CheckRuns(tr.meta(), runs);
  CHECK(st.code() == StatusCode::kFailedPrecondition);
  CHECK(st.message().find("every prompt token") != std::string::npos);
  CHECK(st.message().find("query_storage: ALL") != std::string::npos);
}

TEST_CASE("meda: compressing at the first decode step uses that step's row and reports the event", "[meda]") {
  MemoryTrace tr = testing::MakeTinyTrace();  // 2 layers, 2 heads, n 24, 6 steps
  std::vector<RunSpec> runs{RunSpec{Make("meda", {"compress_at=FIRST_DECODE_STEP"}), "deferred", 0, 6},
                            RunSpec{Make("meda"), "prefill", 0, 6}};
  auto res = Replay(tr, runs, ReplayOptions{.threads = 1});
  REQUIRE(res.ok());
  const RunResult& d = (*res)[0];
  // Per KV head: the whole prompt through step 0, then the budget + the tokens of steps 0 and 1.
  const double heads = tr.meta().model.num_layers * tr.meta().model.num_kv_heads;
  CHECK(d.timeline(0).kv_tokens() / heads == 24);
  CHECK(d.timeline(1).kv_tokens() / heads == 25);
  CHECK(d.timeline(2).kv_tokens() / heads == 6 + 2);
  CHECK(d.metrics().prompt_kept_tokens_mean() == 6);
  CHECK(d.metrics().prompt_kept_over_budget() == 1);
  const auto& km = d.metrics().kept_tokens_by_modality();
  CHECK(km.text() + km.image() == 6);
  // The deferred run attends over the full cache at step 0, so it retains more on average.
  CHECK(d.metrics().retained_mass_mean() > (*res)[1].metrics().retained_mass_mean());
}

TEST_CASE("meda: the official-code variant overshoots the budget, and results say by how much", "[meda]") {
  MemoryTrace tr = testing::MakeTinyTrace();  // 12 of 24 prompt tokens are text
  std::vector<RunSpec> runs{RunSpec{Make("meda", {"variant=OFFICIAL_CODE"}), "code", 0, 3},
                            RunSpec{Make("meda"), "paper", 0, 3}};
  auto res = Replay(tr, runs, ReplayOptions{.threads = 1});
  REQUIRE(res.ok());
  const RunResult &code = (*res)[0], &paper = (*res)[1];
  CHECK(paper.metrics().prompt_kept_over_budget() == 1);
  CHECK(paper.allocated_budget_tokens_mean() == 3);
  // Recent window >= text + 100 keeps the whole prompt: 24 tokens for a budget of 3.
  CHECK(code.metrics().prompt_kept_tokens_mean() == 24);
  CHECK(code.metrics().prompt_kept_over_budget() == 8);
  // floor(clamped ratio * n) with n = 24: the lower clamp (0.01 * 24 < 1) cannot add a token here.
  CHECK(code.allocated_budget_tokens_mean() <= 3);
  REQUIRE(code.layers(0).policy_stats_size() == 2);
  CHECK(code.layers(0).policy_stats(0).name() == "budget_share");
  CHECK(code.layers(0).policy_stats(1).name() == "self_attention_entropy");
  CHECK(paper.layers(0).policy_stats(1).name() == "cross_modal_entropy");
}

TEST_CASE("look_m: text prior, pivot merge by default, and the non-text family", "[look_m]") {
  HandHead h;
  // Budget 4, recent 2 (10, 11), 2 heavy: boosted text 6, 1.
  const HeadCache c = h.Prefill(*Make("look_m"), 4);
  CHECK(Anchors(c) == std::vector<int32_t>{1, 6, 10, 11});
  CHECK(c.CoveredTokens().size() == 12);
  CHECK(c.merged(0).members[0].second == 0.5f);  // pivot coefficients
  // Non-text family: 4 sinks use the heavy slots first: budget 8 -> 4 recent (8..11) + sinks 0..3.
  CHECK(Anchors(h.Prefill(*Make("look_m", {"text_prior=NO_TEXT_PRIOR"}), 8)) ==
        std::vector<int32_t>{0, 1, 2, 3, 8, 9, 10, 11});
  // Non-text family, budget 6: 3 recent + 3 sinks (the sinks fill every heavy slot).
  CHECK(Anchors(h.Prefill(*Make("look_m", {"text_prior=NO_TEXT_PRIOR"}), 6)) ==
        std::vector<int32_t>{0, 1, 2, 9, 10, 11});
  // No sinks: plain scores, image tokens 5 and 4 are the heavy hitters.
  CHECK(Anchors(h.Prefill(*Make("look_m", {"text_prior=NO_TEXT_PRIOR", "num_sinks=0"}), 4)) ==
        std::vector<int32_t>{4, 5, 10, 11});
  // Keep-all-text (code): the budget becomes a floor.
  const auto all_text = Make("look_m", {"text_prior=KEEP_ALL_TEXT"});
  CHECK(all_text->may_exceed_budget());
  CHECK(Anchors(h.Prefill(*all_text, 4)) == std::vector<int32_t>{0, 1, 6, 10, 11});
}

namespace {

// A scaled-down LLaVA-1.5-shaped trace (system + two 8x8 images with text between + context + question).
// entropies: record the prompt entropies (storage.record_prompt_entropies).
MemoryTrace MiniLlava(bool entropies = false, const std::string& dtype = "float32", int kv_heads = 4,
                      int sliding_window = 0) {
  auto config = ParseSynthConfig(
      R"pb(
            model { name: "llava-mini" family: "llama" num_layers: 6 num_heads: 4 num_kv_heads:)pb" +
          std::to_string(kv_heads) + " sliding_window: " + std::to_string(sliding_window) + R"pb(
          head_dim: 32
          rope_theta: 10000
        }
                      layout {
          segments { kind: TEXT role: SYSTEM tokens: 12 }
          segments { kind: IMAGE role: CONTEXT rows: 8 cols: 8 repeat: 2 text_between: 10 }
          segments { kind: TEXT role: CONTEXT tokens: 20 }
          segments { kind: TEXT role: QUESTION tokens: 10 }
          decode_steps: 16
        }
        storage { query_storage: ALL dtype: ")pb" +
          dtype +
          "\" record_prefill_column_sums: true record_prompt_entropies: " + (entropies ? "true" : "false") +
          R"pb(}
               profile { num_sinks: 4 dense_layers: 2 }
        seed: 3
      )pb",
      "mini llava");
  INFO(config.status().message());
  REQUIRE(config.ok());
  MemoryTrace trace;
  REQUIRE(Synthesize(*config, &trace, 2).ok());
  return trace;
}

double Stat(const LayerResult& l, const std::string& name) {
  for (const auto& s : l.policy_stats())
    if (s.name() == name) return s.value();
  FAIL("no policy stat " << name);
  return 0;
}

}  // namespace

TEST_CASE("meda on a LLaVA-shaped trace: budgets follow the entropy profile; merging adds coverage",
          "[meda][synth]") {
  MemoryTrace trace = MiniLlava();
  std::vector<RunSpec> runs{RunSpec{Make("meda"), "meda", 0.2, 0},
                            RunSpec{Make("meda", {"merge=NO_MERGE"}), "meda-nomerge", 0.2, 0},
                            RunSpec{Make("look_m"), "look_m", 0.2, 0},
                            RunSpec{Make("look_m", {"merge=NO_MERGE"}), "look_m-nomerge", 0.2, 0},
                            RunSpec{Make("snapkv+average"), "snapkv+average", 0.2, 0},
                            RunSpec{Make("snapkv"), "snapkv", 0.2, 0}};
  auto res = Replay(trace, runs, ReplayOptions{.threads = 2});
  REQUIRE(res.ok());
  const RunResult& meda = (*res)[0];
  // The profile is not flat (dense first layers, sparse deep ones), and budgets are ordered like it.
  double lo = 1e9, hi = -1e9;
  for (const auto& l : meda.layers()) {
    lo = std::min(lo, Stat(l, "cross_modal_entropy"));
    hi = std::max(hi, Stat(l, "cross_modal_entropy"));
  }
  CHECK(hi - lo > 0.1);
  for (const auto& a : meda.layers())
    for (const auto& b : meda.layers())
      if (Stat(a, "cross_modal_entropy") > Stat(b, "cross_modal_entropy"))
        CHECK(a.budget_tokens_mean() >= b.budget_tokens_mean());
  CHECK(meda.layers(0).budget_tokens_mean() > meda.layers(4).budget_tokens_mean());
  CHECK(meda.allocated_budget_tokens_mean() == meda.budget_tokens());
  // Merging: same anchors; merged slots' anchors count as merged_anchor mass instead of retained (their key
  // and value were replaced), the two adding up to the unmerged run's retained mass; strictly more covered.
  for (size_t i = 0; i < runs.size(); i += 2) {
    const Metrics &with = (*res)[i].metrics(), &without = (*res)[i + 1].metrics();
    INFO(runs[i].label);
    CHECK(without.merged_anchor_mass_mean() == 0);
    CHECK(with.retained_mass_mean() + with.merged_anchor_mass_mean() ==
          Approx(without.retained_mass_mean()).margin(1e-6));
    CHECK(with.covered_mass_mean() > without.covered_mass_mean() + 0.01);
    CHECK(with.merged_tokens_mean() > 0);
    CHECK(without.merged_tokens_mean() == 0);
  }
}

}  // namespace kvsim

namespace kvsim {

TEST_CASE("meda: recorded prompt entropies are bit-identical to the computed ones", "[meda][synth]") {
  using P = policy::MedaParams;
  for (const char* dtype : {"float32", "float16"})
    for (int kv_heads : {4, 2})
      for (int window : {0, 40}) {
        INFO(dtype << " kv_heads " << kv_heads << " sliding_window " << window);
        MemoryTrace trace = MiniLlava(true, dtype, kv_heads, window);
        const TraceMeta& meta = trace.meta();
        const int n = meta.prefill_length;
        // Both question modes' compressible regions: the context before the question, and the prompt.
        REQUIRE(meta.prompt_entropy_regions == std::vector<int32_t>{n - 10, n});
        REQUIRE(meta.prompt_entropies.size() == 6u * 2 * kNumPromptEntropyKinds * 4);
        for (int l = 0; l < meta.model.num_layers; ++l) {
          LayerData layer;
          REQUIRE(trace.ReadLayer(l, &layer).ok());
          for (int ce : meta.prompt_entropy_regions)
            for (auto mode : {P::CROSS_MODAL, P::FULL_SELF}) {
              const double computed = MedaLayerEntropy(LayerView{&meta, &layer, l, ce, 2}, mode);
              const std::optional<double> recorded = MedaRecordedLayerEntropy(meta, l, ce, mode);
              REQUIRE(recorded.has_value());
              CHECK(std::bit_cast<uint64_t>(*recorded) == std::bit_cast<uint64_t>(computed));
              CHECK(computed > 0);
            }
          // Not recorded: the entropy of the head-averaged attention, and any other region.
          CHECK_FALSE(MedaRecordedLayerEntropy(meta, l, n, P::FULL_SELF, P::ENTROPY_OF_MEAN_ATTENTION));
          CHECK_FALSE(MedaRecordedLayerEntropy(meta, l, n - 1, P::FULL_SELF));
        }
      }
  // Without the storage flag nothing is recorded.
  const MemoryTrace plain = MiniLlava(false);
  CHECK(plain.meta().prompt_entropy_regions.empty());
  CHECK(plain.meta().RecordedPromptEntropies(0, plain.meta().prefill_length) == nullptr);
}

TEST_CASE("meda: a replay with recorded entropies equals one computing them and reads no layer twice",
          "[meda][synth]") {
  MemoryTrace with = MiniLlava(true), without = MiniLlava(false);
  std::vector<RunSpec> runs;
  for (QuestionMode mode : {QuestionMode::kQueryAware, QuestionMode::kQueryAgnostic})
    for (double b : {0.1, 0.3}) {
      runs.push_back(RunSpec{Make("meda"), "meda", b, 0, mode});
      runs.push_back(RunSpec{Make("meda", {"variant=OFFICIAL_CODE"}), "meda-code", b, 0, mode});
      runs.push_back(RunSpec{Make("meda", {"entropy=FULL_SELF"}), "meda-self", b, 0, mode});
    }
  const int L = with.meta().model.num_layers;
  testing::CountingTrace counted_with(with), counted_without(without);
  auto a = Replay(counted_with, runs, ReplayOptions{.threads = 2});
  auto b = Replay(counted_without, runs, ReplayOptions{.threads = 1});
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(a->size() == b->size());
  for (size_t r = 0; r < a->size(); ++r) {
    INFO(runs[r].label << " " << QuestionModeName(runs[r].question_mode) << " " << runs[r].budget_fraction);
    CHECK((*a)[r].SerializeAsString() == (*b)[r].SerializeAsString());
  }
  std::vector<int> once(L), twice;
  std::iota(once.begin(), once.end(), 0);
  twice = once;
  twice.insert(twice.end(), once.begin(), once.end());
  CHECK(counted_with.reads == once);      // the replay only: the first pass read nothing
  CHECK(counted_without.reads == twice);  // the first pass, then the replay
  // ENTROPY_OF_MEAN_ATTENTION is not recorded: it still reads every layer.
  testing::CountingTrace mean_of(with);
  std::vector<RunSpec> eom{RunSpec{Make("meda", {"head_averaging=ENTROPY_OF_MEAN_ATTENTION"}), "m", 0.2, 0}};
  REQUIRE(Replay(mean_of, eom, ReplayOptions{.threads = 2}).ok());
  CHECK(mean_of.reads == twice);
}

}  // namespace kvsim
