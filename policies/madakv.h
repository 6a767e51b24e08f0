#pragma once
// MadaKV (Li et al., ACL 2025): modality preference per head from proxy-token attention (Eqs. 6-8),
// θ-mass sparsity per modality (Eq. 9) and hierarchical compression compensation carried layer to layer
// (Eqs. 10-11), with real ragged per-head caches. The paper has no public code: every ⚠ reading is
// documented in docs/policies/madakv.md and the alternatives are parameters.

#include <span>
#include <vector>

#include "policies/policy_params.pb.h"
#include "policies/typed_policy.h"

namespace kvsim {

// Eq. 9: the fewest tokens whose scores (descending) reach θ of their sum; 0 for an empty or all-zero set.
int ThetaSetSize(std::vector<float> scores, double theta);

// One head's statistics from ψ over the non-proxy tokens (Eqs. 6, 9).
struct ModalityStats {
  double w_v = 0, w_t = 0;  // Eq. 6: Σψ over visual / text tokens
  int k_v = 0, k_t = 0;     // Eq. 9: θ-set sizes
  int n_v = 0, n_t = 0;     // candidate tokens of each modality
};
ModalityStats ComputeModalityStats(const TraceMeta& meta, std::span<const float> psi, double theta);

// Splits `extra` kept tokens (beyond the proxy window) of one head into (visual, text): the θ-sets when
// extra = k_v + k_t; proportionally to (k_v, k_t) when less; the surplus by preference w_v : w_t (Eq. 8)
// when more; then clamped to the candidates of each modality (the overflow goes to the other).
std::pair<int, int> SplitByModality(int extra, int want_v, int want_t, const ModalityStats& s);

// Eqs. 10-11 over all layers for one budget: per (layer, head) kept tokens beyond the proxy window, and
// per layer the allowance φ^l (per head) and the compensation K^l / H carried to the next layers.
struct MadaKVAllocation {
  std::vector<int> extra;                  // [layer * H + head]
  std::vector<std::pair<int, int>> split;  // [layer * H + head] (visual, text)
  std::vector<std::pair<int, int>> want;   // [layer * H + head] what the head asked for (θ-sets or capped)
  std::vector<double> allowance, compensation;
};
MadaKVAllocation AllocateMadaKV(std::span<const ModalityStats> stats, int num_layers, int heads, int budget,
                                int window, int compress_len, policy::MadaKVParams::Combine combine);

class MadaKVPolicy final : public TypedPolicy<policy::MadaKVParams> {
 public:
  using TypedPolicy::TypedPolicy;
  static Status Validate(const policy::MadaKVParams& p);
  std::string name() const override { return "madakv"; }
  PolicyRequirements requirements() const override {
    return {.window = params_.proxy_window(), .first_pass = true};
  }
  bool evicts_during_decode() const override { return false; }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext& ctx) const override;
  std::unique_ptr<PolicyPlan> NewPlan(const TraceMeta& meta, int compress_len) const override;
  void ObserveLayer(const LayerView& layer, PolicyPlan* plan) const override;
  void FinishPlan(const TraceMeta& meta, PolicyPlan* plan) const override;
  std::vector<int> PlannedHeadBudgets(const TraceMeta& meta, int budget, int compress_len,
                                      const PolicyPlan& plan,
                                      std::span<const int> layer_budgets) const override;
  std::map<std::string, std::vector<double>> PlannedLayerStats(const TraceMeta& meta, int budget,
                                                               int compress_len,
                                                               const PolicyPlan& plan) const override;
};

}  // namespace kvsim
