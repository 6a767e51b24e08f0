#pragma once
// Ada-KV (Feng et al. 2024): adaptive per-head budgets. A layer's budget is one pool shared by its KV
// heads, split by a single top-k over every head's scores with a per-head floor; every head then selects
// its own tokens with its own budget (real ragged per-head caches). `adakv` = SnapKV scores + this split.
// Equations and deviations: docs/policies/adakv.md.

#include <span>
#include <vector>

#include "policies/baselines.h"
#include "policies/policy_params.pb.h"
#include "policies/typed_policy.h"

namespace kvsim {

// Splits `total` tokens over heads. `sorted[h]` holds head h's candidate scores, descending. Each head
// first gets min(floor, |sorted[h]|); the rest go to the highest scores over all heads beyond each head's
// floor (ties: the lower head, then the higher-ranked score). Returns per-head counts, Σ = min(total,
// Σ|s_h|).
std::vector<int> SplitAcrossHeads(std::span<const std::vector<float>> sorted, int64_t total, int floor);

class AdaKVPolicy final : public TypedPolicy<policy::AdaKVParams> {
 public:
  using TypedPolicy::TypedPolicy;
  static Status Validate(const policy::AdaKVParams& p);
  std::string name() const override { return "adakv"; }
  PolicyRequirements requirements() const override {
    return {.window = params_.window(), .first_pass = true};
  }
  bool evicts_during_decode() const override { return false; }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext& ctx) const override;
  std::unique_ptr<PolicyPlan> NewPlan(const TraceMeta& meta, int compress_len) const override;
  void ObserveLayer(const LayerView& layer, PolicyPlan* plan) const override;
  std::vector<int> PlannedHeadBudgets(const TraceMeta& meta, int budget, int compress_len,
                                      const PolicyPlan& plan,
                                      std::span<const int> layer_budgets) const override;
};

void RegisterAdaptivePolicies(PolicyRegistry* registry);  // adakv

}  // namespace kvsim
