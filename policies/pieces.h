#pragma once
// Reusable pieces policies are assembled from: group aggregation of per-query-head scores (GQA), 1-D
// pooling, selection (top-k + protected windows), and per-layer budget schedules.

#include <cstdint>
#include <span>
#include <vector>

#include "policies/policy_params.pb.h"
#include "sim/policy.h"

namespace kvsim {

// Combines per-query-head scores of one KV head's group into one score per key.
// REQUIRES: every span has the same length.
std::vector<float> AggregateGroup(std::span<const std::span<const float>> per_head, policy::GroupAggregation agg);

// Convenience: aggregates PromptScores::ColumnSums / WindowColumnSums over the group.
std::vector<float> GroupColumnSums(const HeadContext& ctx, policy::GroupAggregation agg);
std::vector<float> GroupWindowColumnSums(const HeadContext& ctx, int window, policy::GroupAggregation agg);

// 1-D pooling with stride 1 and zero padding kernel/2 on both sides, output length = input length
// (PyTorch avg_pool1d/max_pool1d with padding=kernel//2, count_include_pad=True). Even kernels are
// rejected by parameter validation. NO_POOL returns the input.
std::vector<float> Pool1D(std::span<const float> x, int kernel, policy::Pooling pooling);

// Tokens kept by "top-k of scores over [0, limit) + every token in [limit, n)": ascending positions.
std::vector<int32_t> TopKPlusTail(std::span<const float> scores, int k, int limit, int n);

// Uniform per-layer budgets, each min(budget, compress_len).
std::vector<int> UniformLayerBudgets(int num_layers, int budget, int compress_len);

// PyramidKV's linear schedule (KVCache-Factory): with C = budget, w = window,
//   min = (C - w) / beta, max = 2 (C - w) - min, step = (max - min) / (L - 1) (integer division),
//   layer l keeps max - l * step + w.
// kvsim then restores the exact total L * C (integer division loses tokens) by adding the remainder one
// token per layer from the top of the pyramid, and caps each layer at compress_len, moving what a cap
// removes to the layers below the cap (docs/policies/pyramidkv.md).
std::vector<int> PyramidLayerBudgets(int num_layers, int budget, int window, int beta, int compress_len);

// Applies caps and restores the exact total: every layer <= cap, Σ = min(target, L * cap); surplus goes to
// layers in order of index, one token at a time (deterministic).
std::vector<int> RebalanceToTotal(std::vector<int> budgets, int64_t target, int cap);

}  // namespace kvsim
