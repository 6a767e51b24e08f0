#pragma once
// The baseline policies of the foundation: full, streaming_llm, h2o, snapkv, pyramidkv, oracle.
// Equations and deviations: docs/policies/*.md.

#include "policies/policy_params.pb.h"
#include "policies/typed_policy.h"

namespace kvsim {

// Keeps everything; the reference every metric is measured against (and a contract-test anchor).
class FullPolicy final : public TypedPolicy<policy::FullParams> {
 public:
  using TypedPolicy::TypedPolicy;
  static Status Validate(const policy::FullParams&) { return Status::Ok(); }
  std::string name() const override { return "full"; }
  PolicyRequirements requirements() const override { return {}; }
  bool evicts_during_decode() const override { return false; }
  std::vector<int> LayerBudgets(const TraceMeta& meta, int budget, int compress_len) const override;
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext& ctx) const override;
};

// StreamingLLM: the first num_sinks tokens + the most recent ones; the window slides during decode.
class StreamingLLMPolicy final : public TypedPolicy<policy::StreamingLLMParams> {
 public:
  using TypedPolicy::TypedPolicy;
  static Status Validate(const policy::StreamingLLMParams& p);
  std::string name() const override { return "streaming_llm"; }
  PolicyRequirements requirements() const override { return {}; }
  bool evicts_during_decode() const override { return true; }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext& ctx) const override;
};

// H2O: heavy hitters by accumulated attention + recent window; per-step decode eviction (or one-shot).
class H2OPolicy final : public TypedPolicy<policy::H2OParams> {
 public:
  using TypedPolicy::TypedPolicy;
  static Status Validate(const policy::H2OParams& p);
  std::string name() const override { return "h2o"; }
  PolicyRequirements requirements() const override;
  bool evicts_during_decode() const override { return !params_.one_shot(); }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext& ctx) const override;
};

// SnapKV selection shared by snapkv and pyramidkv.
struct SnapKVSelection {
  int window;
  int kernel_size;
  policy::Pooling pooling;
  policy::GroupAggregation aggregation;
  // Kept prompt tokens (ascending) for a budget; ctx.scores must provide the window column sums. `rank`,
  // when given, receives the pooled scores the tokens [0, rank->size()) were ranked by (empty when the
  // budget holds the observation window only).
  std::vector<int32_t> Select(const HeadContext& ctx, int budget, std::vector<float>* rank = nullptr) const;
};

class SnapKVPolicy final : public TypedPolicy<policy::SnapKVParams> {
 public:
  using TypedPolicy::TypedPolicy;
  static Status Validate(const policy::SnapKVParams& p);
  std::string name() const override { return "snapkv"; }
  PolicyRequirements requirements() const override { return {.window = params_.window()}; }
  bool evicts_during_decode() const override { return false; }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext& ctx) const override;
};

class PyramidKVPolicy final : public TypedPolicy<policy::PyramidKVParams> {
 public:
  using TypedPolicy::TypedPolicy;
  static Status Validate(const policy::PyramidKVParams& p);
  std::string name() const override { return "pyramidkv"; }
  PolicyRequirements requirements() const override { return {.window = params_.window()}; }
  bool evicts_during_decode() const override { return false; }
  std::vector<int> LayerBudgets(const TraceMeta& meta, int budget, int compress_len) const override;
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext& ctx) const override;
};

// Oracle: each decode step keeps the `cap` tokens with the highest attention from that step's own queries
// (group-aggregated), chosen from every token so far. Not causal. With decode_growth, `cap + t + 1` at
// step t (a prefill-compressing policy's cache size); the engine then checks it as a non-evicting policy.
class OraclePolicy final : public TypedPolicy<policy::OracleParams> {
 public:
  using TypedPolicy::TypedPolicy;
  static Status Validate(const policy::OracleParams&) { return Status::Ok(); }
  std::string name() const override { return "oracle"; }
  PolicyRequirements requirements() const override { return {.future_attention = true}; }
  bool evicts_during_decode() const override { return !params_.decode_growth(); }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext& ctx) const override;
};

}  // namespace kvsim
