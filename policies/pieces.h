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
std::vector<float> AggregateGroup(std::span<const std::span<const float>> per_head,
                                  policy::GroupAggregation agg);

// Convenience: aggregates PromptScores::ColumnSums / WindowColumnSums over the group.
std::vector<float> GroupColumnSums(const HeadContext& ctx, policy::GroupAggregation agg);
std::vector<float> GroupWindowColumnSums(const HeadContext& ctx, int window, policy::GroupAggregation agg);
// The decode step's attention over the cache slots, aggregated over the group (AggregateGroup of the group's
// `att.cache_probs` rows).
std::vector<float> GroupStepRow(const HeadContext& ctx, const StepAttention& att,
                                policy::GroupAggregation agg);
// (*acc)[cache.token(s)] += GroupStepRow(ctx, att, agg)[s] for every slot s (a per-token running score: H2O's
// accumulated attention, HAE's β). A group of one adds its row in place, with no vector: AggregateGroup of
// one row is that row (MEAN divides by 1, which is exact), so the sums are the same.
void AddGroupStepRow(const HeadContext& ctx, const StepAttention& att, policy::GroupAggregation agg,
                     const HeadCache& cache, std::vector<float>* acc);
// The first-pass twin: KV head `kv_head`'s group-aggregated column sums over [0, view.compress_end) of the
// last `window` compressible queries, computed from the layer's tensors with the same arithmetic as
// PromptScores::WindowColumnSums at the prefill hook (so a plan and the heads agree bit for bit).
// REQUIRES: the window's queries are stored (CheckRuns checks the policy's `window` requirement).
std::vector<float> LayerGroupWindowColumnSums(const LayerView& view, int kv_head, int window,
                                              policy::GroupAggregation agg);

// 1-D pooling with stride 1 and padding kernel/2 on both sides, output length = input length (PyTorch
// avg_pool1d with padding=kernel//2, count_include_pad=True: zeros count in the divisor; max_pool1d pads
// with -inf, i.e. the max is over the in-range window). Even kernels are
// rejected by parameter validation. NO_POOL returns the input.
std::vector<float> Pool1D(std::span<const float> x, int kernel, policy::Pooling pooling);

// Tokens kept by "top-k of scores over [0, limit) + every token in [limit, n)": ascending positions.
std::vector<int32_t> TopKPlusTail(std::span<const float> scores, int k, int limit, int n);

// Uniform per-layer budgets, each min(budget, compress_len).
std::vector<int> UniformLayerBudgets(int num_layers, int budget, int compress_len);

// PyramidKV's linear schedule (KVCache-Factory): with C = budget, w = window,
//   min = (C - w) / beta, max = 2 (C - w) - min, step = (max - min) / (L - 1) (integer division),
//   layer l keeps max - l * step + w.
// The floored step makes the schedule overshoot L * C; kvsim restores the exact total with RebalanceToTotal
// (caps each layer at compress_len, then removes surplus one token per layer from the last layer upwards,
// or adds what a cap removed from the first layer downwards; docs/policies/pyramidkv.md).
std::vector<int> PyramidLayerBudgets(int num_layers, int budget, int window, int beta, int compress_len);

// Splits `total` tokens over layers in proportion to `weights` (>= 0), each layer capped at `cap`:
// water-filling (what a cap removes goes to the uncapped layers in proportion to their weights; all-zero
// weights share equally), then largest-remainder rounding (ties: the lower layer). Σ = min(total, L * cap)
// exactly and no layer exceeds cap (MEDA Eq. 7 with S_l <= prompt length).
std::vector<int> ProportionalLayerBudgets(std::span<const double> weights, int64_t total, int cap);

// Visual tokens (image and video patches) for the multimodal policies.
inline bool IsVisual(Modality m) { return m == Modality::kImage || m == Modality::kVideo; }
// Whether a token counts as text for a text prior: every non-visual token (text and other; the official
// code's "non-image span").
inline bool IsTextLike(Modality m) { return !IsVisual(m); }

// Text-prior selection over [0, n) (MEDA Eqs. 9-10, LOOK-M): keeps the last `recent` tokens and the `heavy`
// highest-scoring tokens before them, after
//   ADD_MAX:        s[j] += max(s) for text tokens (text outranks every visual token),
//   KEEP_ALL_TEXT:  the same ranking, plus every text token kept (the budget becomes a floor),
//   NO_TEXT_PRIOR:  scores unchanged; the first `num_sinks` tokens are kept first (they use heavy slots).
// `scores` has length >= n. Returns ascending positions.
std::vector<int32_t> TextPriorSelect(const HeadContext& ctx, std::vector<float> scores, int n, int recent,
                                     int heavy, policy::TextPrior prior, int num_sinks);

// Applies caps and restores the exact total: every layer <= cap, Σ = min(target, L * cap); surplus goes to
// layers in order of index, one token at a time (deterministic).
std::vector<int> RebalanceToTotal(std::vector<int> budgets, int64_t target, int cap);

}  // namespace kvsim
