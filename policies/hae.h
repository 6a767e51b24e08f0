#pragma once
// HAE — Hierarchical Adaptive Eviction (ICLR 2026 submission; no public code):
//   DAP (prefill): at one early layer, A_j = Σ_{i ∈ T} Ā[i, j] (Ā = head-mean causal attention of the text
//     queries); visual j is evicted if A_j <= r Σ_{k ∈ V} A_k and max_{i ∈ T} Ā[i, j] < alpha (at most c,
//     the lowest A_j), from every layer and head (Eqs. 1-3);
//   DDES (decode): β_j accumulates each step's attention (Eq. 5); the cache grows from its post-prefill size
//     l by up to d = rc_size tokens, then the lowest-β tokens are evicted at once back to l (Definition 2).
// Readings of the paper's open points and the options: docs/policies/hae.md.

#include <span>
#include <vector>

#include "policies/policy_params.pb.h"
#include "policies/typed_policy.h"

namespace kvsim {

// DAP's scores at one layer over the compressible prompt [0, ce).
struct DapScores {
  std::vector<double> received;  // A_j = Σ_{i ∈ T} Ā[i, j]
  std::vector<double> peak;      // max_{i ∈ T} Ā[i, j]
};
// Ā[i, j] = (1/H) Σ_h softmax_j(causal logits of query i over keys [first visible, min(i, ce - 1)]), for the
// text-like queries i < view.compress_end.
DapScores ComputeDapScores(const LayerView& view);

// DAP's evicted positions (ascending). THRESHOLD: the visual j with A_j <= r Σ_V A and peak_j < alpha, at
// most max_evict (the lowest A_j; 0 = no limit). BUDGET: the ce - budget tokens with the lowest A_j, visual
// first (then text-like if there are not enough visual tokens). Ties: the lower position.
std::vector<int32_t> DapEvictions(const TraceMeta& meta, const DapScores& s, int ce,
                                  const policy::HAEParams& p, int budget);

// DDES flush: the `count` slots with the lowest scores (ties: the earlier slot), ascending slot indices.
std::vector<int> LowestSlots(std::span<const float> slot_scores, int count);

// Params with the preset's values filled in where unset.
policy::HAEParams ResolveHAEParams(const policy::HAEParams& p);

class HAEPolicy final : public TypedPolicy<policy::HAEParams> {
 public:
  explicit HAEPolicy(const policy::HAEParams& p) : TypedPolicy(ResolveHAEParams(p)) {}
  static Status Validate(const policy::HAEParams& p);
  std::string name() const override { return "hae"; }
  PolicyRequirements requirements() const override;
  bool evicts_during_decode() const override { return params_.components() != policy::HAEParams::DAP_ONLY; }
  bool may_exceed_budget() const override { return params_.mode() == policy::HAEParams::THRESHOLD; }
  int decode_headroom() const override { return evicts_during_decode() ? params_.rc_size() : 0; }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext& ctx) const override;
  std::unique_ptr<PolicyPlan> NewPlan(const TraceMeta& meta, int compress_len) const override;
  std::vector<int> FirstPassLayers(const TraceMeta& meta, int compress_len) const override;
  void ObserveLayer(const LayerView& layer, PolicyPlan* plan) const override;
  std::vector<int> PlannedLayerBudgets(const TraceMeta& meta, int budget, int compress_len,
                                       const PolicyPlan& plan) const override;
  std::map<std::string, std::vector<double>> PlannedLayerStats(const TraceMeta& meta, int budget,
                                                               int compress_len,
                                                               const PolicyPlan& plan) const override;
};

void RegisterHAEPolicy(PolicyRegistry* registry);

}  // namespace kvsim
