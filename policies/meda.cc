#include "policies/meda.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>

#include "policies/pieces.h"
#include "sim/parallel.h"
#include "sim/stats.h"

namespace kvsim {
namespace {

// Gathers rows `idx` of a [*][d] matrix.
std::vector<float> Gather(const float* src, std::span<const int32_t> idx, int d) {
  std::vector<float> out(idx.size() * static_cast<size_t>(d));
  for (size_t i = 0; i < idx.size(); ++i)
    std::copy(src + static_cast<size_t>(idx[i]) * d, src + static_cast<size_t>(idx[i] + 1) * d,
              out.begin() + i * d);
  return out;
}

struct MedaPlan final : PolicyPlan {
  std::vector<double> entropy;  // per layer
};

// Text-prior selection over [0, n) with a recent share, then merging of the rest (MEDA and LOOK-M).
struct TextPriorMerge {
  double recent_share;
  bool recent_covers_text;
  policy::TextPrior prior;
  int num_sinks;

  // Kept positions of [0, n) for `budget`, from scores over [0, n).
  std::vector<int32_t> Select(const HeadContext& ctx, std::vector<float> scores, int n, int budget) const {
    budget = std::clamp(budget, 0, n);
    const int recent0 = static_cast<int>(std::lround(budget * recent_share));
    int recent = recent0;
    if (recent_covers_text) {
      int text = 0;
      for (int j = 0; j < n; ++j) text += IsTextLike(ctx.modality(j));
      if (recent < text) recent = std::min(n, text + 100);
    }
    return TextPriorSelect(ctx, std::move(scores), n, recent, budget - recent0, prior, num_sinks);
  }
};

// Compresses [0, compress_end) of a cache that holds it as plain slots (plus anything after it), keeping
// `keep` and merging the rest of [0, compress_end) into the kept compressible slots only: tokens after
// compress_end (a query-agnostic run's question, the first decode token) are kept as they are and never
// absorb context. MEDA and LOOK-M compress once: the merger's running sums are freed afterwards (the merged
// slots hold the result), which halves the merging runs' per-head state while the layer replays.
void CompressAndMerge(const HeadContext& ctx, std::span<const int32_t> keep, Merger* merger,
                      HeadCache* cache) {
  const int ce = ctx.compress_end;
  std::vector<char> in(ce, 0);
  for (int32_t j : keep) in[j] = 1;
  std::vector<int32_t> evicted, tail;
  for (int32_t j = 0; j < ce; ++j)
    if (!in[j]) evicted.push_back(j);
  for (int32_t tok : cache->tokens())
    if (tok >= ce) tail.push_back(tok);
  merger->KeepAndMergeOnce(ctx, keep, evicted, cache);
  for (int32_t tok : tail) cache->Append(tok);
}

class MedaHead final : public HeadPolicy {
 public:
  explicit MedaHead(const policy::MedaParams& p)
      : p_(p),
        sel_{p.recent_share(), p.recent_covers_text(), p.text_prior(), 0},
        merger_(p.merge(), p.merge_filter()) {}

  void OnPrefill(const HeadContext& ctx, int budget, HeadCache* cache) override {
    std::vector<float> scores = GroupColumnSums(ctx, p_.group_aggregation());
    if (p_.compress_at() == policy::MedaParams::FIRST_DECODE_STEP) {
      scores_ = std::move(scores);  // compressed after decode step 0 (AfterStep); keep everything until then
      budget_ = budget;
      return;
    }
    CompressAndMerge(ctx, sel_.Select(ctx, std::move(scores), ctx.compress_end, budget), &merger_, cache);
  }

  void AfterStep(const HeadContext& ctx, const StepAttention& att, HeadCache* cache) override {
    if (att.step != 0 || p_.compress_at() != policy::MedaParams::FIRST_DECODE_STEP) return;
    // Official code: s = prefill column sums + the first generated token's attention row, over the
    // still-uncompressed cache (slot s holds token s).
    const std::vector<float> row = GroupStepRow(ctx, att, p_.group_aggregation());
    for (int j = 0; j < ctx.compress_end; ++j) scores_[j] += row[j];
    CompressAndMerge(ctx, sel_.Select(ctx, std::move(scores_), ctx.compress_end, budget_), &merger_, cache);
    scores_ = {};
  }

 private:
  policy::MedaParams p_;
  TextPriorMerge sel_;
  Merger merger_;
  std::vector<float> scores_;
  int budget_ = 0;
};

class LookMHead final : public HeadPolicy {
 public:
  explicit LookMHead(const policy::LookMParams& p)
      : p_(p),
        sel_{p.recent_share(), false, p.text_prior(), p.num_sinks()},
        merger_(p.merge(), p.merge_filter()) {}
  void OnPrefill(const HeadContext& ctx, int budget, HeadCache* cache) override {
    std::vector<float> scores = GroupColumnSums(ctx, p_.group_aggregation());
    CompressAndMerge(ctx, sel_.Select(ctx, std::move(scores), ctx.compress_end, budget), &merger_, cache);
  }

 private:
  policy::LookMParams p_;
  TextPriorMerge sel_;
  Merger merger_;
};

}  // namespace

double MedaLayerEntropy(const LayerView& view, policy::MedaParams::Entropy mode,
                        policy::MedaParams::HeadAveraging averaging) {
  const TraceMeta& meta = *view.meta;
  const ModelInfo& m = meta.model;
  const int d = m.head_dim, ce = view.compress_end, t_all = meta.total_tokens();
  std::vector<int32_t> text, visual, all(ce), qidx(ce);
  std::iota(all.begin(), all.end(), 0);
  for (int j = 0; j < ce; ++j) {
    (IsVisual(meta.tokens.modality[j]) ? visual : text).push_back(j);
    qidx[j] = meta.QueryIndex(j);
    KVSIM_CHECK_MSG(qidx[j] >= 0, "meda: missing prompt query (CheckRuns should have refused the trace)");
  }
  auto head_keys = [&](int h) {
    return view.data->keys.data() + static_cast<size_t>(h / m.GroupSize()) * t_all * d;
  };
  auto head_query_rows = [&](int h, std::span<const int32_t> pos) {
    // Rows [qidx[0], qidx[ce - 1]] (ascending) hold every prompt query used here: checked read.
    const float* queries = view.data->HeadQueries(meta, h, qidx.front(), qidx.back() + 1);
    std::vector<int32_t> idx(pos.size());
    for (size_t i = 0; i < pos.size(); ++i) idx[i] = qidx[pos[i]];
    return Gather(queries, idx, d);
  };
  if (averaging == policy::MedaParams::ENTROPY_OF_MEAN_ATTENTION) {
    // Every head's query rows (and, cross-modal, its KV head's keys) gathered once; rows in parallel.
    auto entropy = [&](std::span<const int32_t> qpos, std::span<const int32_t> kpos, bool causal) {
      std::vector<std::vector<float>> qs(m.num_heads), ks(m.num_kv_heads);
      std::vector<const float*> qp(m.num_heads), kp(m.num_heads);
      for (int u = 0; u < m.num_kv_heads; ++u)
        if (!causal) ks[u] = Gather(head_keys(u * m.GroupSize()), kpos, d);
      for (int h = 0; h < m.num_heads; ++h) {
        qs[h] = head_query_rows(h, qpos);
        qp[h] = qs[h].data();
        kp[h] = causal ? head_keys(h) : ks[h / m.GroupSize()].data();
      }
      return MeanRowEntropyOfHeadMean(m, qp, kp, static_cast<int>(qpos.size()), static_cast<int>(kpos.size()),
                                      causal, view.threads);
    };
    if (mode == policy::MedaParams::FULL_SELF) return entropy(all, all, true);
    if (text.empty() || visual.empty()) return 0;
    return entropy(text, visual, false) + entropy(visual, text, false);  // -E_TV - E_VT
  }
  const bool self = mode == policy::MedaParams::FULL_SELF;
  std::vector<double> per_head(m.num_heads, 0.0);
  ParallelFor(m.num_heads, view.threads, [&](int h) {
    double e[kNumPromptEntropyKinds];
    HeadPromptEntropies(m, std::span(meta.tokens.modality).first(ce), head_query_rows(h, all).data(),
                        head_keys(h), ce, self, !self, e);
    per_head[h] = self ? e[kSelfEntropy] : e[kTextToVisualEntropy] + e[kVisualToTextEntropy];  // -E_TV - E_VT
  });
  return Mean(per_head);  // over the num_heads heads
}

std::optional<double> MedaRecordedLayerEntropy(const TraceMeta& meta, int layer, int compress_end,
                                               policy::MedaParams::Entropy mode,
                                               policy::MedaParams::HeadAveraging averaging) {
  if (averaging != policy::MedaParams::MEAN_OF_HEAD_ENTROPIES) return std::nullopt;
  const double* rec = meta.RecordedPromptEntropies(layer, compress_end);
  if (!rec) return std::nullopt;
  const int heads = meta.model.num_heads;
  auto kind = [&](PromptEntropyKind k, int h) { return rec[static_cast<size_t>(k) * heads + h]; };
  std::vector<double> per_head(heads);  // exactly as MedaLayerEntropy combines the computed values
  for (int h = 0; h < heads; ++h)
    per_head[h] = mode == policy::MedaParams::FULL_SELF
                      ? kind(kSelfEntropy, h)
                      : kind(kTextToVisualEntropy, h) + kind(kVisualToTextEntropy, h);
  return Mean(per_head);
}

namespace {

// softmax_l(E): the share of the total budget each layer asks for (Eq. 7, before caps and clamps).
std::vector<double> BudgetShares(std::span<const double> entropy) {
  if (entropy.empty()) return {};
  const double mx = *std::max_element(entropy.begin(), entropy.end());
  std::vector<double> w(entropy.size());
  double z = 0;
  for (size_t l = 0; l < w.size(); ++l) z += w[l] = std::exp(entropy[l] - mx);
  for (double& x : w) x /= z;
  return w;
}

}  // namespace

std::vector<int> MedaLayerBudgets(std::span<const double> entropy, int budget, int compress_len, bool clamp,
                                  double min_ratio) {
  const int L = static_cast<int>(entropy.size());
  if (L == 0) return {};
  const std::vector<double> w = BudgetShares(entropy);
  budget = std::clamp(budget, 0, compress_len);
  if (!clamp) return ProportionalLayerBudgets(w, static_cast<int64_t>(L) * budget, compress_len);
  const double rho = compress_len > 0 ? static_cast<double>(budget) / compress_len : 0;
  std::vector<int> out(L);
  for (int l = 0; l < L; ++l) {
    const double r = std::clamp(w[l] * L * rho, min_ratio, 1.0);
    out[l] = std::clamp(static_cast<int>(std::floor(r * compress_len)), 0, compress_len);
  }
  return out;
}

policy::MedaParams ResolveMedaParams(const policy::MedaParams& in) {
  policy::MedaParams p = in;
  const bool code = p.variant() == policy::MedaParams::OFFICIAL_CODE;
  if (!p.has_variant()) p.set_variant(p.variant());
  if (!p.has_entropy()) p.set_entropy(code ? policy::MedaParams::FULL_SELF : policy::MedaParams::CROSS_MODAL);
  if (!p.has_clamp_layer_ratio()) p.set_clamp_layer_ratio(code);
  if (!p.has_recent_share()) p.set_recent_share(code ? 0.5 : 0.75);
  if (!p.has_recent_covers_text()) p.set_recent_covers_text(code);
  if (!p.has_text_prior()) p.set_text_prior(code ? policy::KEEP_ALL_TEXT : policy::ADD_MAX);
  if (!p.has_compress_at())
    p.set_compress_at(code ? policy::MedaParams::FIRST_DECODE_STEP : policy::MedaParams::PREFILL);
  if (!p.has_merge()) p.set_merge(policy::AVERAGE);
  if (!p.has_merge_filter()) p.set_merge_filter(code ? policy::ABOVE_MEAN_SIMILARITY : policy::MERGE_ALL);
  if (!p.has_min_layer_ratio()) p.set_min_layer_ratio(0.01);
  if (!p.has_group_aggregation()) p.set_group_aggregation(policy::MEAN);
  if (!p.has_head_averaging()) p.set_head_averaging(policy::MedaParams::MEAN_OF_HEAD_ENTROPIES);
  return p;
}

Status MedaPolicy::Validate(const policy::MedaParams& in) {
  const policy::MedaParams p = ResolveMedaParams(in);
  KVSIM_RETURN_IF_ERROR(
      Need(p.recent_share() >= 0 && p.recent_share() <= 1, "recent_share must be in [0, 1]"));
  KVSIM_RETURN_IF_ERROR(
      Need(p.min_layer_ratio() >= 0 && p.min_layer_ratio() <= 1, "min_layer_ratio must be in [0, 1]"));
  return Need(p.text_prior() != policy::NO_TEXT_PRIOR,
              "text_prior NO_TEXT_PRIOR is LOOK-M's non-text family; MEDA uses ADD_MAX or KEEP_ALL_TEXT");
}

namespace {
// A policy's default GPU work plus its nearest-slot merge (unless NO_MERGE).
PolicyGpuWork WithMerge(PolicyGpuWork w, policy::MergeStrategy merge) {
  w.merge = merge != policy::NO_MERGE;
  return w;
}
}  // namespace

PolicyGpuWork MedaPolicy::gpu_work() const { return WithMerge(Policy::gpu_work(), params_.merge()); }
PolicyGpuWork LookMPolicy::gpu_work() const { return WithMerge(Policy::gpu_work(), params_.merge()); }

PolicyRequirements MedaPolicy::requirements() const {
  return {.prompt_column_sums = true,
          .decode_attention = params_.compress_at() == policy::MedaParams::FIRST_DECODE_STEP,
          .decode_attention_steps = 1,  // AfterStep reads step 0's attention only
          .first_pass = true,
          // The entropies' queries, unless the trace records them (FirstPassLayers is then empty).
          .first_pass_prompt_queries = true,
          .prompt_queries_alternative =
              params_.head_averaging() == policy::MedaParams::MEAN_OF_HEAD_ENTROPIES
                  ? "or record prompt entropies for this compressible region (synth/capture "
                    "storage.record_prompt_entropies)"
                  : ""};
}

bool MedaPolicy::may_exceed_budget() const {
  return params_.text_prior() == policy::KEEP_ALL_TEXT || params_.recent_covers_text() ||
         params_.compress_at() == policy::MedaParams::FIRST_DECODE_STEP;
}

int MedaPolicy::compression_step() const {
  return params_.compress_at() == policy::MedaParams::FIRST_DECODE_STEP ? 0 : -1;
}

std::unique_ptr<HeadPolicy> MedaPolicy::NewHeadPolicy(const HeadContext&) const {
  return std::make_unique<MedaHead>(params_);
}

std::unique_ptr<PolicyPlan> MedaPolicy::NewPlan(const TraceMeta&, int) const {
  return std::make_unique<MedaPlan>();
}

std::vector<int> MedaPolicy::FirstPassLayers(const TraceMeta& meta, int compress_len) const {
  if (meta.RecordedPromptEntropies(0, compress_len) &&
      params_.head_averaging() == policy::MedaParams::MEAN_OF_HEAD_ENTROPIES)
    return {};  // every layer's entropy is recorded (RecordedPromptEntropies covers all layers or none)
  return Policy::FirstPassLayers(meta, compress_len);
}

void MedaPolicy::ObserveLayer(const LayerView& layer, PolicyPlan* plan) const {
  const std::optional<double> recorded = MedaRecordedLayerEntropy(
      *layer.meta, layer.layer, layer.compress_end, params_.entropy(), params_.head_averaging());
  static_cast<MedaPlan*>(plan)->entropy.push_back(
      recorded ? *recorded : MedaLayerEntropy(layer, params_.entropy(), params_.head_averaging()));
}

void MedaPolicy::FinishPlan(const TraceMeta& meta, PolicyPlan* plan) const {
  auto* p = static_cast<MedaPlan*>(plan);
  KVSIM_CHECK(static_cast<int>(p->entropy.size()) == meta.model.num_layers);
  p->layer_stats[params_.entropy() == policy::MedaParams::CROSS_MODAL ? "cross_modal_entropy"
                                                                      : "self_attention_entropy"] =
      p->entropy;
  p->layer_stats["budget_share"] = BudgetShares(p->entropy);
}

std::vector<int> MedaPolicy::PlannedLayerBudgets(const TraceMeta&, int budget, int compress_len,
                                                 const PolicyPlan& plan) const {
  return MedaLayerBudgets(static_cast<const MedaPlan&>(plan).entropy, budget, compress_len,
                          params_.clamp_layer_ratio(), params_.min_layer_ratio());
}

Status LookMPolicy::Validate(const policy::LookMParams& p) {
  KVSIM_RETURN_IF_ERROR(
      Need(p.recent_share() >= 0 && p.recent_share() <= 1, "recent_share must be in [0, 1]"));
  return Need(p.num_sinks() >= 0, "num_sinks must be >= 0");
}

std::unique_ptr<HeadPolicy> LookMPolicy::NewHeadPolicy(const HeadContext&) const {
  return std::make_unique<LookMHead>(params_);
}

void RegisterMultimodalPolicies(PolicyRegistry* r) {
  r->Register({"meda", "cross-modal-entropy layer budgets + text prior + average merge (Wan et al. 2025)",
               "kvsim.policy.MedaParams", true, false},
              TypedFactory<MedaPolicy, policy::MedaParams>());
  r->Register({"look_m", "text-prior recent + heavy selection, evicted tokens merged (Wan et al. 2024)",
               "kvsim.policy.LookMParams", true, false},
              TypedFactory<LookMPolicy, policy::LookMParams>());
}

}  // namespace kvsim
