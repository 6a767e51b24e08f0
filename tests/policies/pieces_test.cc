#include "policies/pieces.h"

#include <catch2/catch.hpp>
#include <numeric>
#include <vector>

namespace kvsim {
namespace {

std::vector<float> Agg(const std::vector<std::vector<float>>& rows, policy::GroupAggregation agg) {
  std::vector<std::span<const float>> spans(rows.begin(), rows.end());
  return AggregateGroup(spans, agg);
}

int Sum(const std::vector<int>& v) { return std::accumulate(v.begin(), v.end(), 0); }

// Two query heads with fixed column sums.
class TwoHeadScores final : public PromptScores {
 public:
  std::span<const float> ColumnSums(int g) override { return col_[g]; }
  std::span<const float> WindowColumnSums(int g, int window) override {
    last_window_ = window;
    return win_[g];
  }
  std::vector<float> col_[2] = {{1, 4, 2}, {3, 0, 2}};
  std::vector<float> win_[2] = {{0, 2, 0}, {1, 1, 1}};
  int last_window_ = -1;
};

}  // namespace

TEST_CASE("AggregateGroup: mean, max, sum over the query heads of a group", "[pieces]") {
  const std::vector<std::vector<float>> rows{{1, 4, 2}, {3, 0, 2}};
  CHECK(Agg(rows, policy::MEAN) == std::vector<float>{2, 2, 2});
  CHECK(Agg(rows, policy::MAX) == std::vector<float>{3, 4, 2});
  CHECK(Agg(rows, policy::SUM) == std::vector<float>{4, 4, 4});
  // Three heads: mean divides by 3.
  const std::vector<std::vector<float>> three{{3, 0}, {0, 6}, {3, 3}};
  CHECK(Agg(three, policy::MEAN) == std::vector<float>{2, 3});
  // A single head is returned as-is under every aggregation.
  for (auto agg : {policy::MEAN, policy::MAX, policy::SUM})
    CHECK(Agg({{0.5f, 0.25f}}, agg) == std::vector<float>{0.5f, 0.25f});
}

TEST_CASE("GroupColumnSums / GroupWindowColumnSums aggregate PromptScores over the group", "[pieces]") {
  TraceMeta meta;
  TwoHeadScores scores;
  HeadContext ctx;
  ctx.meta = &meta;
  ctx.group_size = 2;
  ctx.compress_end = 3;
  ctx.scores = &scores;
  CHECK(GroupColumnSums(ctx, policy::MEAN) == std::vector<float>{2, 2, 2});
  CHECK(GroupColumnSums(ctx, policy::MAX) == std::vector<float>{3, 4, 2});
  CHECK(GroupWindowColumnSums(ctx, 7, policy::SUM) == std::vector<float>{1, 3, 1});
  CHECK(scores.last_window_ == 7);
  ctx.group_size = 1;  // only the first head
  CHECK(GroupColumnSums(ctx, policy::MEAN) == std::vector<float>{1, 4, 2});
}

TEST_CASE("Pool1D AVG: stride 1, zero padding counted in the divisor", "[pieces]") {
  // Kernel 3 on [3, 0, 0, 6]: windows [pad, 3, 0], [3, 0, 0], [0, 0, 6], [0, 6, pad] / 3 = [1, 1, 2, 2].
  const std::vector<float> x{3, 0, 0, 6};
  CHECK(Pool1D(x, 3, policy::AVG) == std::vector<float>{1, 1, 2, 2});
  // Kernel 5 on [5, 0, 0, 0, 0, 0, 10]: [5, 5, 5, 0, 10, 10, 10] / 5.
  const std::vector<float> y{5, 0, 0, 0, 0, 0, 10};
  CHECK(Pool1D(y, 5, policy::AVG) == std::vector<float>{1, 1, 1, 0, 2, 2, 2});
  // Kernel wider than the input: both outputs see [5, 5] + 3 padding zeros -> 10 / 5.
  CHECK(Pool1D(std::vector<float>{5, 5}, 5, policy::AVG) == std::vector<float>{2, 2});
}

TEST_CASE("Pool1D MAX_POOL and NO_POOL", "[pieces]") {
  const std::vector<float> x{3, 0, 0, 6};
  CHECK(Pool1D(x, 3, policy::MAX_POOL) == std::vector<float>{3, 3, 6, 6});
  const std::vector<float> y{0, 1, 0, 0, 0, 0, 2, 0};
  CHECK(Pool1D(y, 5, policy::MAX_POOL) == std::vector<float>{1, 1, 1, 1, 2, 2, 2, 2});
  CHECK(Pool1D(x, 3, policy::NO_POOL) == x);
  CHECK(Pool1D(x, 1, policy::AVG) == x);  // kernel 1: identity
  CHECK(Pool1D(std::vector<float>{}, 3, policy::AVG).empty());
}

TEST_CASE("TopKPlusTail: top-k before the limit, then every token of the tail", "[pieces]") {
  const std::vector<float> s{0.1f, 0.9f, 0.5f, 0.7f, 0.2f, 0.3f};
  CHECK(TopKPlusTail(s, 2, 4, 6) == std::vector<int32_t>{1, 3, 4, 5});
  CHECK(TopKPlusTail(s, 0, 4, 6) == std::vector<int32_t>{4, 5});
  CHECK(TopKPlusTail(s, 3, 6, 6) == std::vector<int32_t>{1, 2, 3});
  CHECK(TopKPlusTail(s, 9, 2, 6) == std::vector<int32_t>{0, 1, 2, 3, 4, 5});  // k clamps to the limit
  // Scores may be shorter than n: only the first `limit` are read.
  CHECK(TopKPlusTail(std::vector<float>{1, 2}, 1, 2, 5) == std::vector<int32_t>{1, 2, 3, 4});
}

TEST_CASE("UniformLayerBudgets caps at the compressible length", "[pieces]") {
  CHECK(UniformLayerBudgets(3, 10, 7) == std::vector<int>{7, 7, 7});
  CHECK(UniformLayerBudgets(2, 5, 7) == std::vector<int>{5, 5});
}

TEST_CASE("RebalanceToTotal: caps, then adds in layer order or removes from the last layer", "[pieces]") {
  // Sum already equals the target after capping 9 -> 6.
  CHECK(RebalanceToTotal({5, 1, 9}, 12, 6) == std::vector<int>{5, 1, 6});
  // Target above L * cap: every layer at the cap.
  CHECK(RebalanceToTotal({5, 1, 9}, 20, 6) == std::vector<int>{6, 6, 6});
  // Remove 3 from [5, 1, 6]: one token per layer from the last layer up -> [4, 0, 5].
  CHECK(RebalanceToTotal({5, 1, 9}, 9, 6) == std::vector<int>{4, 0, 5});
  // Add 4 to [0, 2, 6] (cap 6): round robin in layer order over layers below the cap: +2, +2, +0.
  CHECK(RebalanceToTotal({0, 2, 6}, 12, 6) == std::vector<int>{2, 4, 6});
  // Negative entries clamp to 0 first.
  CHECK(RebalanceToTotal({-3, 4}, 4, 10) == std::vector<int>{0, 4});
}

TEST_CASE("PyramidLayerBudgets: hand-computed schedule, exact total", "[pieces]") {
  // L = 4, C = 100, w = 8, beta = 20: min = 92 / 20 = 4, max = 2 * 92 - 4 = 180, step = 176 / 3 = 58;
  // layers keep 180 + 8 = 188, 122 + 8 = 130, 64 + 8 = 72, 6 + 8 = 14: total 404 (the floored step adds 4).
  // Restored to 4 x 100 = 400 by removing one token per layer from the last layer up: 187, 129, 71, 13.
  const std::vector<int> b = PyramidLayerBudgets(4, 100, 8, 20, 1000);
  CHECK(b == std::vector<int>{187, 129, 71, 13});
  CHECK(Sum(b) == 400);
  // Default window 32: min = 68 / 20 = 3, max = 133, step = 130 / 3 = 43 -> 165, 122, 79, 36 = 402 -> -2.
  CHECK(PyramidLayerBudgets(4, 100, 32, 20, 1000) == std::vector<int>{165, 122, 78, 35});
}

TEST_CASE("PyramidLayerBudgets: layers capped at compress_len hand their excess to the others", "[pieces]") {
  // Same schedule capped at compress_len = 150: [150, 130, 72, 14] = 366; 34 tokens go round robin to the
  // three uncapped layers: 11 rounds of +1 (33) and one more to layer 1 -> [150, 142, 83, 25] = 400.
  const std::vector<int> b = PyramidLayerBudgets(4, 100, 8, 20, 150);
  CHECK(b == std::vector<int>{150, 142, 83, 25});
  CHECK(Sum(b) == 400);
  // Budget above compress_len: C = compress_len = 30 -> every layer keeps the whole prompt.
  CHECK(PyramidLayerBudgets(2, 50, 8, 20, 30) == std::vector<int>{30, 30});
}

TEST_CASE("PyramidLayerBudgets: degenerate cases are uniform", "[pieces]") {
  CHECK(PyramidLayerBudgets(1, 64, 8, 20, 1000) == std::vector<int>{64});      // one layer
  CHECK(PyramidLayerBudgets(3, 8, 8, 20, 1000) == std::vector<int>{8, 8, 8});  // C <= w
  CHECK(PyramidLayerBudgets(3, 5, 8, 20, 1000) == std::vector<int>{5, 5, 5});
  // beta large: min = 0, max = 2 (C - w), step = 2 (C - w) / (L - 1): C = 20, w = 4, L = 3, beta = 100
  //   -> 32 + 4, 16 + 4, 0 + 4 = 36, 20, 4 (= 60, exact).
  CHECK(PyramidLayerBudgets(3, 20, 4, 100, 1000) == std::vector<int>{36, 20, 4});
}

TEST_CASE("ProportionalLayerBudgets: water-filling under the cap, exact total, largest remainder",
          "[pieces]") {
  CHECK(ProportionalLayerBudgets(std::vector<double>{1, 2, 3}, 30, 100) == std::vector<int>{5, 10, 15});
  CHECK(ProportionalLayerBudgets(std::vector<double>{1, 2, 3}, 21, 100) == std::vector<int>{4, 7, 10});
  // (25, 50, 75) with cap 60: 15 tokens move to the others in ratio 1:2.
  CHECK(ProportionalLayerBudgets(std::vector<double>{1, 2, 3}, 150, 60) == std::vector<int>{30, 60, 60});
  // Two rounds of capping: (1, 1, 8) * 50 / 10 -> layer 2 capped at 20, then 15 / 15 ... all capped.
  CHECK(ProportionalLayerBudgets(std::vector<double>{1, 1, 8}, 50, 20) == std::vector<int>{15, 15, 20});
  CHECK(ProportionalLayerBudgets(std::vector<double>{1, 1, 8}, 70, 20) == std::vector<int>{20, 20, 20});
  CHECK(ProportionalLayerBudgets(std::vector<double>{0, 0}, 7, 10) == std::vector<int>{4, 3});  // all zero
  CHECK(ProportionalLayerBudgets(std::vector<double>{0, 1}, 7, 5) == std::vector<int>{2, 5});   // zero weight
}

TEST_CASE("TextPriorSelect: add-max, keep-all-text and the sink family", "[pieces]") {
  TraceMeta meta;
  meta.prefill_length = 6;
  meta.tokens.Resize(6);
  for (int j : {1, 2, 4}) meta.tokens.modality[j] = Modality::kImage;
  meta.tokens.modality[5] = Modality::kOther;  // counts as text
  HeadContext ctx;
  ctx.meta = &meta;
  const std::vector<float> s{0.1f, 0.9f, 0.5f, 0.05f, 0.8f, 0.3f};
  // Recent 1 (token 5); 2 heavy over [0, 5). Add-max: text 0 (1.0) and 3 (0.95) beat image 1 (0.9).
  CHECK(TextPriorSelect(ctx, s, 6, 1, 2, policy::ADD_MAX, 0) == std::vector<int32_t>{0, 3, 5});
  CHECK(TextPriorSelect(ctx, s, 6, 1, 2, policy::NO_TEXT_PRIOR, 0) == std::vector<int32_t>{1, 4, 5});
  // Keep-all-text: 1 heavy (0) + recent (5) + every text token (3): 3 tokens for a budget of 2.
  CHECK(TextPriorSelect(ctx, s, 6, 1, 1, policy::KEEP_ALL_TEXT, 0) == std::vector<int32_t>{0, 3, 5});
  // One sink takes a heavy slot: 0, then the best of the rest (1).
  CHECK(TextPriorSelect(ctx, s, 6, 1, 2, policy::NO_TEXT_PRIOR, 1) == std::vector<int32_t>{0, 1, 5});
  CHECK(TextPriorSelect(ctx, s, 6, 6, 3, policy::ADD_MAX, 0).size() == 6);  // recent covers everything
}

}  // namespace kvsim
