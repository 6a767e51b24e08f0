#pragma once
// The policy interface the replay engine drives. A Policy is configured once (parameters, budget rule);
// for every (layer, KV head) it creates a HeadPolicy that owns that head's decisions:
//   OnPrefill   — compression hook after prefill: reduce the cache to the layer's prompt budget;
//   BeforeStep  — decode step t is about to attend: evict to make room (decode-evicting policies);
//   AfterStep   — observe the step's attention over the cache (accumulated scores, ...).
// Reusable pieces (scorers, selection, per-layer allocation, decode eviction) live in policies/.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "sim/cache_state.h"
#include "sim/gpu_work.h"
#include "sim/status.h"
#include "sim/trace.h"

namespace kvsim {

// Lazily computed prompt statistics for one (layer, KV head), shared by every policy and budget of a run.
// All scores are per query head of the group, indexed by key position in [0, compress_end).
class PromptScores {
 public:
  virtual ~PromptScores() = default;
  // Σ_i A[i, j] over all compressible prompt queries i (causal softmax over keys [0, compress_end)).
  virtual std::span<const float> ColumnSums(int group_member) = 0;
  // Σ_i A[i, j] over the last `window` compressible prompt queries (SnapKV's observation window).
  virtual std::span<const float> WindowColumnSums(int group_member, int window) = 0;
};

// State a policy library shares among the runs of one (layer, KV head) unit: owned by the replay's per-unit
// state (sim/replay.cc UnitWork), created empty with the unit's Prefill, freed with the unit. The unit's runs
// may call into it concurrently (decode items of one unit run on several workers): `mu` guards creating the
// members; each member guards itself after that. Whatever it holds may change how much work a run does, never
// a run's results.
struct UnitShared {
  class State {
   public:
    virtual ~State() = default;
  };
  std::mutex mu;
  std::unique_ptr<State> merge;  // policies/merge.cc: the similarity answers of the unit's merging runs
};

// State built by a policy's first pass over all layers (cross-layer information: MEDA's per-layer entropy,
// MadaKV's modality preferences, HAE's first-layer scores). It does not depend on the budget: the engine
// builds one plan per (policy object, compressible region) and shares it by every budget of a sweep; the
// per-budget decisions come from Policy::PlannedLayerBudgets and the heads. Policies derive their own type.
class PolicyPlan {
 public:
  virtual ~PolicyPlan() = default;
  // Per-layer statistics reported in results (LayerResult.policy_stats), by name; each vector has one value
  // per layer. Ordered by name, so results are deterministic.
  std::map<std::string, std::vector<double>> layer_stats;
  // Per-(layer, KV head) statistics ([layer * num_kv_heads + kv_head]), reported as
  // LayerResult.policy_head_stats (e.g. MadaKV's modality preference per head).
  std::map<std::string, std::vector<double>> head_stats;
};

// One layer as the first pass sees it (fp32 tensors of every head; see LayerData for layouts).
struct LayerView {
  const TraceMeta* meta = nullptr;
  const LayerData* data = nullptr;  // null in the first pass for layers not in Policy::FirstPassLayers
  int layer = 0;
  int compress_end = 0;
  int threads = 1;  // a policy may parallelise its per-layer statistics with ParallelFor
};

struct HeadContext {
  const TraceMeta* meta = nullptr;
  int layer = 0;
  int kv_head = 0;
  int group_size = 1;             // query heads sharing this KV head
  int compress_end = 0;           // tokens [0, compress_end) are compressed; [compress_end, n) appended as-is
  const float* keys = nullptr;    // [T][head_dim] this KV head's keys (fp32, post-RoPE)
  const float* values = nullptr;  // [T][head_dim]
  PromptScores* scores = nullptr;
  const PolicyPlan* plan = nullptr;  // the run's first-pass plan, or null
  int run_budget = 0;                // the run's requested budget B (tokens per layer per KV head)
  UnitShared* shared = nullptr;      // state shared by this unit's runs (the replay's; null: none)
  int head_dim() const { return meta->model.head_dim; }
  int prefill_length() const { return meta->prefill_length; }
  Modality modality(int32_t token) const { return meta->tokens.modality[token]; }
};

// The attention of one decode step, as seen by a policy.
struct StepAttention {
  int step = 0;       // 0-based decode step; the new token's position is prefill_length + step
  int num_slots = 0;  // cache size during this step (the new token included)
  // Per query head of the group: attention over the cache's slots, renormalised over the cache:
  // [group][num_slots]. Only in AfterStep and only for policies with Requirements::decode_attention (the
  // engine skips computing it for the others, and after their decode_attention_steps); null otherwise.
  const float* cache_probs = nullptr;
  // Only for policies with Requirements::future_attention: full-cache attention of this step's queries over
  // every token [0, prefill_length + step], [group][prefill_length + step + 1]. Null otherwise.
  const float* const* full_probs = nullptr;
  // Alongside full_probs: (*full_topk)(g, k, out) writes into *out the indices of the k largest values of
  // query head g's full_probs (1 <= k <= prefill_length + step + 1), ascending, ties to the lower index:
  // TopKIndices(full_probs[g] over [0, prefill_length + step], k) (sim/select.h), so a policy gets its
  // top-k without a selection of its own (the engine's answer reads its regret's bucket counts of the row:
  // one pass over the row). *out is resized to k; its capacity is reused.
  const std::function<void(int g, int k, std::vector<int32_t>* out)>* full_topk = nullptr;
};

class HeadPolicy {
 public:
  virtual ~HeadPolicy() = default;
  // The cache holds tokens [0, compress_end) as plain slots. Reduce it to at most `budget` slots.
  virtual void OnPrefill(const HeadContext& ctx, int budget, HeadCache* cache) = 0;
  // Step `step` is about to attend; the new token is not in the cache yet. `cap` is the decode-time cache
  // limit (new token included) for decode-evicting policies. `att.full_probs` is set for future-attention
  // policies only (cache_probs is null here).
  virtual void BeforeStep(const HeadContext& ctx, const StepAttention& att, int cap, HeadCache* cache) {}
  // Whether the engine appends the new token after BeforeStep (an oracle may choose to leave it out).
  virtual bool AppendNewToken() const { return true; }
  // After the step attended: `att.cache_probs` is over the cache's slots.
  virtual void AfterStep(const HeadContext& ctx, const StepAttention& att, HeadCache* cache) {}
  // Optional, read by the engine after the decode steps: the scores r[j], j < r.size(), by which OnPrefill
  // ranked the prompt tokens it kept (its top-k by score: every kept token with j < r.size() scores at
  // least as high as every evicted one). The engine then adds the run's output product in rank order, in
  // fixed bands, so runs whose kept sets are nested (the same scores at several budgets) share the bands
  // they have in common (docs/metrics.md, "Output error"). Empty (the default): token order.
  virtual std::span<const float> PrefillRank() const { return {}; }
};

struct PolicyRequirements {
  bool prompt_column_sums = false;  // PromptScores::ColumnSums
  int window = 0;                   // PromptScores::WindowColumnSums(window) (0 = not used)
  bool future_attention = false;    // StepAttention::full_probs (oracle only)
  bool decode_attention = false;    // AfterStep needs cache_probs
  // With decode_attention: AfterStep reads cache_probs only at the steps < decode_attention_steps (0: at
  // every step); the engine computes none after them (cache_probs is null there). MEDA's official code
  // reads step 0's only.
  int decode_attention_steps = 0;
  bool first_pass = false;  // NewPlan / ObserveLayer / FinishPlan before the replay
  // The first pass's ObserveLayer reads the query of every compressible token, of the layers
  // FirstPassLayers(meta, compress_end) lists, and only there: the replay itself reads only decode rows,
  // `window` rows and, for `prompt_column_sums` the trace does not record, every compressible row
  // (ReplayQueryRows, CheckRuns). FirstPassLayers is what makes this trace-aware: a policy whose first pass
  // needs no layer on this trace (MEDA with recorded prompt entropies) needs no prompt query for it.
  bool first_pass_prompt_queries = false;
  // For CheckRuns' message when first_pass_prompt_queries cannot be met: what else would make the prompt
  // queries unnecessary ("" = nothing; the fix is then only to store every prompt query).
  std::string prompt_queries_alternative;
};

class Policy {
 public:
  virtual ~Policy() = default;
  virtual std::string name() const = 0;
  // Parameters in Protobuf text format (defaults included), for results.
  virtual std::string ParamsText() const = 0;
  virtual PolicyRequirements requirements() const = 0;
  // true: keeps the cache at <= the budget during decode; false: compresses the prompt, then appends.
  virtual bool evicts_during_decode() const = 0;
  // true for variants whose budget is a floor or a target rather than a cap (official-code behaviours that
  // keep every text token, or compress only at the first decode step; HAE's absolute DAP thresholds). The
  // engine then checks only that the cache grows by at most one slot per step after the prefill event;
  // results report how many prompt tokens were actually kept (Metrics.prompt_kept_tokens_mean,
  // prompt_kept_over_budget).
  virtual bool may_exceed_budget() const { return false; }
  // When the prompt is compressed: -1 = the prefill hook (OnPrefill); 0 = in AfterStep of decode step 0
  // (official MEDA/LOOK-M code compresses when the first token is generated; OnPrefill then keeps all).
  // Kept-token statistics (by modality, vs the budget) are taken right after this event.
  virtual int compression_step() const { return -1; }
  // Decode-evicting policies that let the cache grow past its cap before evicting in a batch (HAE's DDES
  // bin of RC_size tokens): the engine allows cap + decode_headroom() slots during decode.
  virtual int decode_headroom() const { return 0; }
  // What the policy computes on the GPU besides attention, for the latency model (docs/latency.md). Default:
  // derived from requirements() (window scoring, scores from all prompt queries, per-step weights).
  virtual PolicyGpuWork gpu_work() const;
  // Prompt budget of every layer (tokens per KV head) for a uniform per-layer budget `budget` over
  // `compress_len` compressible tokens. Must sum to num_layers * budget unless capped by compress_len.
  // Default: uniform.
  virtual std::vector<int> LayerBudgets(const TraceMeta& meta, int budget, int compress_len) const;
  virtual std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext& ctx) const = 0;

  // First pass (requirements().first_pass): the engine visits every layer once, in order, before any
  // compression: plan = NewPlan(...); ObserveLayer(view, plan) for each layer; FinishPlan(plan). One plan
  // serves every run of this policy object with the same compressible region (every budget of a sweep).
  // Per-layer budgets then come from PlannedLayerBudgets, and the plan reaches every HeadPolicy
  // (HeadContext::plan).
  virtual std::unique_ptr<PolicyPlan> NewPlan(const TraceMeta& meta, int compress_len) const {
    return std::make_unique<PolicyPlan>();
  }
  // The layers whose tensors ObserveLayer needs for a plan over [0, compress_len) (ascending, distinct, in
  // [0, num_layers)). The engine reads only these (the next one prefetched while one is observed) but still
  // calls ObserveLayer for every layer in order: for a layer not listed, LayerView::data is null. Empty: no
  // layer is read (e.g. MEDA on a trace with recorded prompt entropies). Default: every layer.
  virtual std::vector<int> FirstPassLayers(const TraceMeta& meta, int compress_len) const;
  virtual void ObserveLayer(const LayerView& layer, PolicyPlan* plan) const {}
  virtual void FinishPlan(const TraceMeta& meta, PolicyPlan* plan) const {}
  // Per-layer budgets of a first-pass policy (each in [0, compress_len]); the total may differ from
  // num_layers * budget only for variants that say so in their docs. Default: LayerBudgets.
  virtual std::vector<int> PlannedLayerBudgets(const TraceMeta& meta, int budget, int compress_len,
                                               const PolicyPlan& plan) const {
    return LayerBudgets(meta, budget, compress_len);
  }
  // Optional ragged per-(layer, KV head) budgets of a first-pass policy ([layer * num_kv_heads + kv_head],
  // each in [0, compress_len]); empty = every KV head of layer l gets layer_budgets[l]. When set, a layer's
  // budget (reported as LayerResult.budget_tokens_mean) is the mean of its heads' budgets, each head's
  // OnPrefill receives its own budget and the engine checks every head against its own cap.
  virtual std::vector<int> PlannedHeadBudgets(const TraceMeta& meta, int budget, int compress_len,
                                              const PolicyPlan& plan,
                                              std::span<const int> layer_budgets) const {
    return {};
  }
  // Budget-dependent per-layer statistics of a first-pass policy (name -> one value per layer), reported
  // next to the plan's layer_stats in LayerResult.policy_stats. Called after PlannedHeadBudgets.
  virtual std::map<std::string, std::vector<double>> PlannedLayerStats(const TraceMeta& meta, int budget,
                                                                       int compress_len,
                                                                       const PolicyPlan& plan) const {
    return {};
  }
};

}  // namespace kvsim
