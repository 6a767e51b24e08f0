#include "policies/pieces.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "sim/attention.h"
#include "sim/select.h"

namespace kvsim {

std::vector<float> AggregateGroup(std::span<const std::span<const float>> per_head,
                                  policy::GroupAggregation agg) {
  KVSIM_CHECK(!per_head.empty());
  const size_t n = per_head[0].size();
  std::vector<float> out(per_head[0].begin(), per_head[0].end());
  for (size_t g = 1; g < per_head.size(); ++g) {
    KVSIM_CHECK(per_head[g].size() == n);
    for (size_t j = 0; j < n; ++j)
      out[j] = agg == policy::MAX ? std::max(out[j], per_head[g][j]) : out[j] + per_head[g][j];
  }
  if (agg == policy::MEAN)
    for (float& x : out) x /= static_cast<float>(per_head.size());
  return out;
}

std::vector<float> GroupColumnSums(const HeadContext& ctx, policy::GroupAggregation agg) {
  std::vector<std::span<const float>> rows;
  for (int g = 0; g < ctx.group_size; ++g) rows.push_back(ctx.scores->ColumnSums(g));
  return AggregateGroup(rows, agg);
}

std::vector<float> GroupWindowColumnSums(const HeadContext& ctx, int window, policy::GroupAggregation agg) {
  std::vector<std::span<const float>> rows;
  for (int g = 0; g < ctx.group_size; ++g) rows.push_back(ctx.scores->WindowColumnSums(g, window));
  return AggregateGroup(rows, agg);
}

std::vector<float> GroupStepRow(const HeadContext& ctx, const StepAttention& att,
                                policy::GroupAggregation agg) {
  std::vector<std::span<const float>> rows;
  for (int g = 0; g < ctx.group_size; ++g)
    rows.emplace_back(att.cache_probs + static_cast<size_t>(g) * att.num_slots, att.num_slots);
  return AggregateGroup(rows, agg);
}

void AddGroupStepRow(const HeadContext& ctx, const StepAttention& att, policy::GroupAggregation agg,
                     const HeadCache& cache, std::vector<float>* acc) {
  if (ctx.group_size == 1) {
    for (int s = 0; s < att.num_slots; ++s) (*acc)[cache.token(s)] += att.cache_probs[s];
    return;
  }
  const std::vector<float> step = GroupStepRow(ctx, att, agg);
  for (int s = 0; s < att.num_slots; ++s) (*acc)[cache.token(s)] += step[s];
}

std::vector<float> Pool1D(std::span<const float> x, int kernel, policy::Pooling pooling) {
  if (pooling == policy::NO_POOL || kernel <= 1) return {x.begin(), x.end()};
  const int n = static_cast<int>(x.size()), half = kernel / 2;
  std::vector<float> out(n);
  for (int i = 0; i < n; ++i) {
    const int lo = std::max(0, i - half), hi = std::min(n - 1, i + half);
    if (pooling == policy::AVG) {
      double s = 0;
      for (int j = lo; j <= hi; ++j) s += x[j];
      out[i] = static_cast<float>(s / kernel);  // zero padding counts in the divisor
    } else {
      float m = x[lo];
      for (int j = lo + 1; j <= hi; ++j) m = std::max(m, x[j]);
      out[i] = m;
    }
  }
  return out;
}

std::vector<float> LayerGroupWindowColumnSums(const LayerView& view, int kv_head, int window,
                                              policy::GroupAggregation agg) {
  const TraceMeta& meta = *view.meta;
  const ModelInfo& m = meta.model;
  const int ce = view.compress_end, d = m.head_dim, t_all = meta.total_tokens(), group = m.GroupSize();
  window = std::min(window, ce);
  const int first_query = meta.QueryIndex(ce - window);
  KVSIM_CHECK_MSG(first_query >= 0, "window queries missing (CheckRuns should have refused the trace)");
  std::vector<int32_t> pos(window);
  std::iota(pos.begin(), pos.end(), ce - window);
  const float* keys = view.data->keys.data() + static_cast<size_t>(kv_head) * t_all * d;
  std::vector<std::vector<float>> per_head(group, std::vector<float>(ce, 0.0f));
  std::vector<std::span<const float>> spans;
  for (int g = 0; g < group; ++g) {
    const int qh = kv_head * group + g;
    const float* q = view.data->HeadQueries(meta, qh, first_query, first_query + window) +
                     static_cast<size_t>(first_query) * d;
    AccumulateColumnSums(m, q, pos.data(), window, keys, ce, per_head[g].data());
    spans.emplace_back(per_head[g]);
  }
  return AggregateGroup(spans, agg);
}

std::vector<int32_t> TopKPlusTail(std::span<const float> scores, int k, int limit, int n) {
  std::vector<int32_t> keep = TopKIndices(scores.first(limit), k);
  for (int32_t j = limit; j < n; ++j) keep.push_back(j);
  return keep;
}

std::vector<int> UniformLayerBudgets(int num_layers, int budget, int compress_len) {
  return std::vector<int>(num_layers, std::min(budget, compress_len));
}

std::vector<int> RebalanceToTotal(std::vector<int> budgets, int64_t target, int cap) {
  const int L = static_cast<int>(budgets.size());
  target = std::min<int64_t>(target, static_cast<int64_t>(L) * cap);
  for (int& b : budgets) b = std::clamp(b, 0, cap);
  int64_t total = std::accumulate(budgets.begin(), budgets.end(), int64_t{0});
  // Add (or remove) one token per layer per round, in layer order, until the total matches.
  while (total < target)
    for (int l = 0; l < L && total < target; ++l)
      if (budgets[l] < cap) ++budgets[l], ++total;
  while (total > target)
    for (int l = L - 1; l >= 0 && total > target; --l)
      if (budgets[l] > 0) --budgets[l], --total;
  return budgets;
}

std::vector<int> ProportionalLayerBudgets(std::span<const double> weights, int64_t total, int cap) {
  const int L = static_cast<int>(weights.size());
  std::vector<int> out(L, 0);
  if (L == 0 || cap <= 0) return out;
  total = std::clamp<int64_t>(total, 0, static_cast<int64_t>(L) * cap);
  // Water-filling in doubles: cap every layer whose share exceeds cap, re-split the rest, repeat.
  std::vector<double> x(L, 0.0);
  std::vector<char> capped(L, 0);
  for (;;) {
    double remaining = static_cast<double>(total), w = 0;
    int free = 0;
    for (int l = 0; l < L; ++l) {
      if (capped[l]) {
        remaining -= cap;
      } else {
        w += std::max(0.0, weights[l]);
        ++free;
      }
    }
    if (free == 0) break;
    bool changed = false;
    for (int l = 0; l < L; ++l) {
      if (capped[l]) continue;
      x[l] = w > 0 ? remaining * std::max(0.0, weights[l]) / w : remaining / free;
      if (x[l] > cap) capped[l] = 1, changed = true;
    }
    if (!changed) break;
  }
  int64_t sum = 0;
  std::vector<std::pair<double, int>> frac;  // (-fractional part, layer): largest first, then lower layer
  for (int l = 0; l < L; ++l) {
    out[l] = capped[l] ? cap : std::min(cap, static_cast<int>(std::floor(x[l])));
    sum += out[l];
    if (!capped[l]) frac.emplace_back(-(x[l] - std::floor(x[l])), l);
  }
  std::sort(frac.begin(), frac.end());
  for (size_t i = 0; sum < total && !frac.empty(); i = (i + 1) % frac.size()) {
    const int l = frac[i].second;
    if (out[l] < cap) ++out[l], ++sum;
  }
  return out;
}

std::vector<int32_t> TextPriorSelect(const HeadContext& ctx, std::vector<float> scores, int n, int recent,
                                     int heavy, policy::TextPrior prior, int num_sinks) {
  recent = std::clamp(recent, 0, n);
  const int limit = n - recent;
  heavy = std::clamp(heavy, 0, limit);
  scores.resize(n);
  if (prior != policy::NO_TEXT_PRIOR) {
    const float mx = n > 0 ? *std::max_element(scores.begin(), scores.end()) : 0.0f;
    for (int j = 0; j < n; ++j)
      if (IsTextLike(ctx.modality(j))) scores[j] += mx;
  } else {
    for (int j = 0; j < std::min(num_sinks, limit); ++j) scores[j] = std::numeric_limits<float>::infinity();
  }
  std::vector<int32_t> keep = TopKPlusTail(scores, heavy, limit, n);
  if (prior == policy::KEEP_ALL_TEXT) {
    std::vector<char> in(n, 0);
    for (int32_t j : keep) in[j] = 1;
    for (int j = 0; j < n; ++j)
      if (!in[j] && IsTextLike(ctx.modality(j))) keep.push_back(j);
    std::sort(keep.begin(), keep.end());
  }
  return keep;
}

std::vector<int> PyramidLayerBudgets(int num_layers, int budget, int window, int beta, int compress_len) {
  const int c = std::min(budget, compress_len);
  const int w = std::min(window, c);
  const int L = num_layers;
  std::vector<int> out(L, c);
  if (L > 1 && c > w) {
    const int min_num = (c - w) / beta;
    const int max_num = 2 * (c - w) - min_num;
    const int step = (max_num - min_num) / (L - 1);
    for (int l = 0; l < L; ++l) out[l] = max_num - l * step + w;
  }
  return RebalanceToTotal(std::move(out), static_cast<int64_t>(L) * c, compress_len);
}

}  // namespace kvsim
