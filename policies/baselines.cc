#include "policies/baselines.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "policies/pieces.h"
#include "sim/select.h"

namespace kvsim {
namespace {

// Evicts the slot with the lowest score[token] among slots [0, limit) (ties: the oldest), until size <=
// target.
void EvictLowest(HeadCache* cache, int target, int protected_tail, const float* score) {
  while (cache->size() > target) {
    const int limit = cache->size() - protected_tail;
    KVSIM_CHECK(limit > 0);
    cache->EvictSlot(FirstLowestAt(score, cache->tokens().data(), limit));
  }
}

// ---- full ----
class KeepAll final : public HeadPolicy {
 public:
  void OnPrefill(const HeadContext&, int, HeadCache*) override {}
};

// ---- streaming_llm ----
class SinkWindowHead final : public HeadPolicy {
 public:
  explicit SinkWindowHead(int sinks) : sinks_(sinks) {}
  void OnPrefill(const HeadContext& ctx, int budget, HeadCache* cache) override {
    const int n = ctx.compress_end, sinks = std::min(sinks_, budget);
    std::vector<int32_t> keep;
    for (int32_t j = 0; j < sinks; ++j) keep.push_back(j);
    for (int32_t j = std::max(sinks, n - (budget - sinks)); j < n; ++j) keep.push_back(j);
    cache->Assign(keep);
  }
  void BeforeStep(const HeadContext&, const StepAttention&, int cap, HeadCache* cache) override {
    // Make room for the new token: drop the oldest token that is not a sink.
    while (cache->size() + 1 > cap) {
      int victim = 0;
      while (victim < cache->size() && cache->token(victim) < sinks_) ++victim;
      if (victim == cache->size()) victim = cache->size() - 1;  // cap smaller than the sinks
      cache->EvictSlot(victim);
    }
  }

 private:
  int sinks_;
};

// ---- h2o ----
class H2OHead final : public HeadPolicy {
 public:
  H2OHead(const policy::H2OParams& p, const HeadContext& ctx) : p_(p), acc_(ctx.meta->total_tokens(), 0.0f) {}
  int Recent(int budget) const {
    const int heavy = static_cast<int>(std::lround(budget * p_.heavy_fraction()));
    // The per-step form needs room for the new token in the recent window.
    return std::max(p_.one_shot() ? 0 : 1, budget - heavy);
  }
  void OnPrefill(const HeadContext& ctx, int budget, HeadCache* cache) override {
    const int n = ctx.compress_end;
    std::vector<float> score = GroupColumnSums(ctx, p_.group_aggregation());
    std::copy(score.begin(), score.end(), acc_.begin());
    const int recent = std::min(Recent(budget), budget);
    cache->Assign(TopKPlusTail(score, budget - recent, n - recent, n));
    recent_ = recent;
  }
  void BeforeStep(const HeadContext&, const StepAttention&, int cap, HeadCache* cache) override {
    if (p_.one_shot()) return;
    // The new token joins the recent window; the other recent_-1 most recent slots are protected.
    EvictLowest(cache, cap - 1, std::min(recent_ - 1, cap - 1), acc_.data());
  }
  void AfterStep(const HeadContext& ctx, const StepAttention& att, HeadCache* cache) override {
    if (p_.one_shot()) return;
    AddGroupStepRow(ctx, att, p_.group_aggregation(), *cache, &acc_);
  }

 private:
  policy::H2OParams p_;
  std::vector<float> acc_;  // accumulated attention per token position
  int recent_ = 1;
};

// ---- snapkv / pyramidkv ----
class SnapKVHead final : public HeadPolicy {
 public:
  explicit SnapKVHead(SnapKVSelection sel) : sel_(sel) {}
  void OnPrefill(const HeadContext& ctx, int budget, HeadCache* cache) override {
    cache->Assign(sel_.Select(ctx, budget, &rank_));
  }
  std::span<const float> PrefillRank() const override { return rank_; }

 private:
  SnapKVSelection sel_;
  std::vector<float> rank_;
};

// ---- oracle ----
class OracleHead final : public HeadPolicy {
 public:
  OracleHead(policy::GroupAggregation agg, bool growth) : agg_(agg), growth_(growth) {}
  void OnPrefill(const HeadContext& ctx, int budget, HeadCache* cache) override {
    // Nothing is known before the first decode query; re-selected at every step anyway.
    cache->AssignRange(std::max(0, ctx.compress_end - budget), ctx.compress_end);
  }
  void BeforeStep(const HeadContext& ctx, const StepAttention& att, int cap, HeadCache* cache) override {
    const int pos = ctx.prefill_length() + att.step;
    if (growth_) cap += att.step + 1;  // as many slots as a prefill-compressing cache holds at this step
    // keep_: the head's buffer, reused at every step (no allocation once it has grown).
    std::vector<int32_t>& keep = keep_;
    if (ctx.group_size == 1) {  // MHA: the engine gives the top-k without a selection here
      const int k = std::min(cap, pos + 1);
      if (k > 0)
        (*att.full_topk)(0, k, &keep);
      else
        keep.clear();
    } else {
      std::vector<std::span<const float>> rows;
      for (int g = 0; g < ctx.group_size; ++g) rows.emplace_back(att.full_probs[g], pos + 1);
      keep = TopKIndices(AggregateGroup(rows, agg_), cap);
    }
    append_new_ = !keep.empty() && keep.back() == pos;
    if (append_new_) keep.pop_back();
    cache->Assign(keep);
  }
  bool AppendNewToken() const override { return append_new_; }

 private:
  policy::GroupAggregation agg_;
  bool growth_;
  bool append_new_ = true;
  std::vector<int32_t> keep_;
};

}  // namespace

std::vector<int32_t> SnapKVSelection::Select(const HeadContext& ctx, int budget,
                                             std::vector<float>* rank) const {
  const int n = ctx.compress_end;
  const int observe = std::min(window, n);
  const int tail = std::min(observe, budget);  // the kept observation window
  // B <= w': the budget holds (part of) the window only, no prefix token is voted in, so no scores are
  // computed: window tokens are never ranked by the window's own attention (docs/policies/snapkv.md).
  if (rank != nullptr) rank->clear();
  if (budget <= tail) {
    std::vector<int32_t> keep(tail);
    std::iota(keep.begin(), keep.end(), n - tail);
    return keep;
  }
  std::vector<float> score = GroupWindowColumnSums(ctx, observe, aggregation);
  score.resize(n - tail);
  score = Pool1D(score, kernel_size, pooling);
  std::vector<int32_t> keep = TopKPlusTail(score, budget - tail, n - tail, n);
  if (rank != nullptr) *rank = std::move(score);
  return keep;
}

std::vector<int> FullPolicy::LayerBudgets(const TraceMeta& meta, int, int compress_len) const {
  return std::vector<int>(meta.model.num_layers, compress_len);
}
std::unique_ptr<HeadPolicy> FullPolicy::NewHeadPolicy(const HeadContext&) const {
  return std::make_unique<KeepAll>();
}

Status StreamingLLMPolicy::Validate(const policy::StreamingLLMParams& p) {
  return Need(p.num_sinks() >= 0, "num_sinks must be >= 0");
}
std::unique_ptr<HeadPolicy> StreamingLLMPolicy::NewHeadPolicy(const HeadContext&) const {
  return std::make_unique<SinkWindowHead>(params_.num_sinks());
}

Status H2OPolicy::Validate(const policy::H2OParams& p) {
  return Need(p.heavy_fraction() >= 0 && p.heavy_fraction() <= 1, "heavy_fraction must be in [0, 1]");
}
PolicyRequirements H2OPolicy::requirements() const {
  return {.prompt_column_sums = true, .decode_attention = !params_.one_shot()};
}
std::unique_ptr<HeadPolicy> H2OPolicy::NewHeadPolicy(const HeadContext& ctx) const {
  return std::make_unique<H2OHead>(params_, ctx);
}

namespace {
Status ValidateSnap(int window, int kernel) {
  KVSIM_RETURN_IF_ERROR(Need(window >= 1, "window must be >= 1"));
  return Need(kernel >= 1 && kernel % 2 == 1, "kernel_size must be odd and >= 1 (same-length pooling)");
}
}  // namespace

Status SnapKVPolicy::Validate(const policy::SnapKVParams& p) {
  return ValidateSnap(p.window(), p.kernel_size());
}
std::unique_ptr<HeadPolicy> SnapKVPolicy::NewHeadPolicy(const HeadContext&) const {
  return std::make_unique<SnapKVHead>(SnapKVSelection{params_.window(), params_.kernel_size(),
                                                      params_.pooling(), params_.group_aggregation()});
}

Status PyramidKVPolicy::Validate(const policy::PyramidKVParams& p) {
  KVSIM_RETURN_IF_ERROR(ValidateSnap(p.window(), p.kernel_size()));
  return Need(p.beta() >= 1, "beta must be >= 1");
}
std::vector<int> PyramidKVPolicy::LayerBudgets(const TraceMeta& meta, int budget, int compress_len) const {
  return PyramidLayerBudgets(meta.model.num_layers, budget, params_.window(), params_.beta(), compress_len);
}
std::unique_ptr<HeadPolicy> PyramidKVPolicy::NewHeadPolicy(const HeadContext&) const {
  return std::make_unique<SnapKVHead>(SnapKVSelection{params_.window(), params_.kernel_size(),
                                                      params_.pooling(), params_.group_aggregation()});
}

std::unique_ptr<HeadPolicy> OraclePolicy::NewHeadPolicy(const HeadContext&) const {
  return std::make_unique<OracleHead>(params_.group_aggregation(), params_.decode_growth());
}

void RegisterBaselinePolicies(PolicyRegistry* r) {
  r->Register({"full", "keeps every token (reference)", "kvsim.policy.FullParams", false, false},
              TypedFactory<FullPolicy, policy::FullParams>());
  r->Register({"streaming_llm", "attention sinks + sliding recent window (Xiao et al. 2024)",
               "kvsim.policy.StreamingLLMParams"},
              TypedFactory<StreamingLLMPolicy, policy::StreamingLLMParams>());
  r->Register(
      {"h2o", "heavy hitters by accumulated attention + recent, per-step eviction (Zhang et al. 2023)",
       "kvsim.policy.H2OParams"},
      TypedFactory<H2OPolicy, policy::H2OParams>());
  r->Register({"snapkv", "observation-window voting, pooled, per-head top-k + window (Li et al. 2024)",
               "kvsim.policy.SnapKVParams"},
              TypedFactory<SnapKVPolicy, policy::SnapKVParams>());
  r->Register({"pyramidkv", "SnapKV scoring with a linear per-layer budget pyramid (Cai et al. 2024)",
               "kvsim.policy.PyramidKVParams"},
              TypedFactory<PyramidKVPolicy, policy::PyramidKVParams>());
  r->Register({"oracle", "per step, the budget's highest-attention tokens of that step (upper bound)",
               "kvsim.policy.OracleParams", true, false},
              TypedFactory<OraclePolicy, policy::OracleParams>());
}

}  // namespace kvsim
