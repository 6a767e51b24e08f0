#pragma once
// MEDA (Wan et al., NAACL 2025): per-layer budgets from cross-modal attention entropy, text-prior selection
// with a 3:1 recent:important split, and average merging of every evicted token. Prefill-only.
// Paper equations, options and the official-code variant: docs/policies/meda.md.

#include <optional>
#include <span>
#include <vector>

#include "policies/merge.h"
#include "policies/policy_params.pb.h"
#include "policies/typed_policy.h"
#include "sim/attention.h"

namespace kvsim {

// The layer entropy over the compressible prompt [0, view.compress_end):
//   CROSS_MODAL (Eqs. 4-6): E_CM = H(softmax(Q_T K_V^T)) + H(softmax(Q_V K_T^T)), mean row entropies,
//                           T = text-like tokens, V = image and video tokens;
//   FULL_SELF (code):       mean row entropy of the causal self-attention.
// MEAN_OF_HEAD_ENTROPIES: the mean over query heads of each head's value; ENTROPY_OF_MEAN_ATTENTION: the row
// entropies of the head-averaged attention.
double MedaLayerEntropy(
    const LayerView& view, policy::MedaParams::Entropy mode,
    policy::MedaParams::HeadAveraging averaging = policy::MedaParams::MEAN_OF_HEAD_ENTROPIES);

// The same layer entropy from the trace's recorded per-head prompt entropies
// (TraceMeta::RecordedPromptEntropies; docs/policies/meda.md "Recorded entropies"), bit-identical to
// MedaLayerEntropy on that trace; nullopt when the trace has none for (layer, compress_end) or for
// ENTROPY_OF_MEAN_ATTENTION (not recorded: computed from the layer).
std::optional<double> MedaRecordedLayerEntropy(
    const TraceMeta& meta, int layer, int compress_end, policy::MedaParams::Entropy mode,
    policy::MedaParams::HeadAveraging averaging = policy::MedaParams::MEAN_OF_HEAD_ENTROPIES);

// Eq. 7: α_l = softmax_l(E) * L * ρ with ρ = budget / compress_len, S_l = α_l * compress_len:
//   clamp = false (paper): ProportionalLayerBudgets(softmax(E), L * budget, compress_len): exact total,
//                          no layer above compress_len, what a cap removes goes to the other layers;
//   clamp = true (code):   r_l = clamp(α_l, min_ratio, 1), S_l = floor(r_l * compress_len), no
//                          redistribution (the total may differ from L * budget).
std::vector<int> MedaLayerBudgets(std::span<const double> entropy, int budget, int compress_len, bool clamp,
                                  double min_ratio);

// Params with every field resolved from `variant` (fields set explicitly win).
policy::MedaParams ResolveMedaParams(const policy::MedaParams& p);

class MedaPolicy final : public TypedPolicy<policy::MedaParams> {
 public:
  explicit MedaPolicy(const policy::MedaParams& p) : TypedPolicy(ResolveMedaParams(p)) {}
  static Status Validate(const policy::MedaParams& p);
  std::string name() const override { return "meda"; }
  PolicyRequirements requirements() const override;
  // Its evicted tokens merged into their nearest kept slot (unless merge: NO_MERGE), for the latency model.
  PolicyGpuWork gpu_work() const override;
  bool evicts_during_decode() const override { return false; }
  bool may_exceed_budget() const override;
  int compression_step() const override;
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext& ctx) const override;
  std::unique_ptr<PolicyPlan> NewPlan(const TraceMeta& meta, int compress_len) const override;
  std::vector<int> FirstPassLayers(const TraceMeta& meta, int compress_len) const override;
  void ObserveLayer(const LayerView& layer, PolicyPlan* plan) const override;
  void FinishPlan(const TraceMeta& meta, PolicyPlan* plan) const override;
  std::vector<int> PlannedLayerBudgets(const TraceMeta& meta, int budget, int compress_len,
                                       const PolicyPlan& plan) const override;
};

// LOOK-M (Wan et al., EMNLP Findings 2024): text-prior selection + merging of the evicted tokens.
class LookMPolicy final : public TypedPolicy<policy::LookMParams> {
 public:
  using TypedPolicy::TypedPolicy;
  static Status Validate(const policy::LookMParams& p);
  std::string name() const override { return "look_m"; }
  PolicyRequirements requirements() const override { return {.prompt_column_sums = true}; }
  PolicyGpuWork gpu_work() const override;  // as MedaPolicy's
  bool evicts_during_decode() const override { return false; }
  bool may_exceed_budget() const override { return params_.text_prior() == policy::KEEP_ALL_TEXT; }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext& ctx) const override;
};

void RegisterMultimodalPolicies(PolicyRegistry* registry);

}  // namespace kvsim
