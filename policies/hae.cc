#include "policies/hae.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <numeric>

#include "policies/pieces.h"
#include "sim/attention.h"
#include "sim/parallel.h"

namespace kvsim {
namespace {

struct HAEPlan final : PolicyPlan {
  int dap_layer = 0;
  DapScores scores;
  // Per requested budget: DAP's evicted set (filled by PlannedLayerBudgets, which the engine calls before
  // any head runs; read-only afterwards).
  mutable std::map<int, std::vector<int32_t>> evicted;
};

class HAEHead final : public HeadPolicy {
 public:
  HAEHead(const policy::HAEParams& p, const HeadContext& ctx)
      : p_(p), beta_(ctx.meta->total_tokens(), 0.0f) {}

  void OnPrefill(const HeadContext& ctx, int budget, HeadCache* cache) override {
    const int ce = ctx.compress_end;
    std::vector<int32_t> keep;
    if (p_.components() != policy::HAEParams::DDES_ONLY) {
      // DAP: the same evicted set at every layer and head (broadcast).
      const auto& plan = *static_cast<const HAEPlan*>(ctx.plan);
      const std::vector<int32_t>& evicted = plan.evicted.at(ctx.run_budget);
      std::vector<char> gone(ce, 0);
      for (int32_t j : evicted) gone[j] = 1;
      for (int32_t j = 0; j < ce; ++j)
        if (!gone[j]) keep.push_back(j);
    } else if (p_.mode() == policy::HAEParams::BUDGET) {
      const std::vector<float> s = GroupColumnSums(ctx, p_.group_aggregation());
      keep = TopKPlusTail(s, budget, ce, ce);
    } else {
      keep.resize(ce);
      std::iota(keep.begin(), keep.end(), 0);
    }
    cache->Assign(keep);
    if (p_.ddes_init() == policy::HAEParams::PROMPT_COLUMN_SUMS) {
      const std::vector<float> s = GroupColumnSums(ctx, p_.group_aggregation());
      std::copy(s.begin(), s.end(), beta_.begin());
    }
  }

  void BeforeStep(const HeadContext&, const StepAttention&, int, HeadCache* cache) override {
    if (base_ < 0) base_ = cache->size();  // l: the post-prefill size (appended prompt tokens included)
  }

  void AfterStep(const HeadContext& ctx, const StepAttention& att, HeadCache* cache) override {
    if (p_.components() == policy::HAEParams::DAP_ONLY) return;
    AddGroupStepRow(ctx, att, p_.group_aggregation(), *cache, &beta_);  // Eq. 5
    // The bin is full once d tokens have been added since the last flush: evict back to l at once.
    if (cache->size() >= base_ + p_.rc_size()) {
      std::vector<float> slot_scores(cache->size());
      for (int s = 0; s < cache->size(); ++s) slot_scores[s] = beta_[cache->token(s)];
      cache->EvictSlots(LowestSlots(slot_scores, cache->size() - base_));
    }
  }

 private:
  policy::HAEParams p_;
  std::vector<float> beta_;  // β per token position
  int base_ = -1;
};

}  // namespace

DapScores ComputeDapScores(const LayerView& view) {
  const TraceMeta& meta = *view.meta;
  const ModelInfo& m = meta.model;
  const int ce = view.compress_end, d = m.head_dim, t_all = meta.total_tokens(), H = m.num_heads;
  std::vector<int32_t> text;
  for (int i = 0; i < ce; ++i)
    if (!IsVisual(meta.tokens.modality[i])) text.push_back(i);
  const int nt = static_cast<int>(text.size());
  // Ā rows of the text queries, [nt][ce]: row blocks in parallel, heads in a fixed order inside each block.
  std::vector<float> abar(static_cast<size_t>(nt) * ce, 0.0f);
  constexpr int kRows = 64;
  const int blocks = (nt + kRows - 1) / kRows;
  EnsureSingleThreadedBlas();
  ParallelFor(blocks, view.threads, [&](int b) {
    const int r0 = b * kRows, rows = std::min(kRows, nt - r0);
    const int last = std::min(text[r0 + rows - 1], ce - 1), first = FirstVisibleKey(m, text[r0]);
    const int width = last + 1 - first;
    std::vector<float> q(static_cast<size_t>(rows) * d), logits(static_cast<size_t>(rows) * width);
    for (int h = 0; h < H; ++h) {
      const float* keys = view.data->keys.data() + static_cast<size_t>(h / m.GroupSize()) * t_all * d;
      for (int r = 0; r < rows; ++r) {
        const int qi = meta.QueryIndex(text[r0 + r]);
        KVSIM_CHECK_MSG(qi >= 0, "hae: missing prompt query (CheckRuns should have refused the trace)");
        const float* queries = view.data->HeadQueries(meta, h, qi, qi + 1);
        std::copy(queries + static_cast<size_t>(qi) * d, queries + static_cast<size_t>(qi + 1) * d,
                  q.begin() + static_cast<size_t>(r) * d);
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, width, d,
                  static_cast<float>(m.softmax_scale), q.data(), d, keys + static_cast<size_t>(first) * d, d,
                  0.0f, logits.data(), width);
      for (int r = 0; r < rows; ++r) {
        const int pos = text[r0 + r];
        const int lo = FirstVisibleKey(m, pos) - first, hi = std::min(pos, ce - 1) + 1 - first;
        float* row = logits.data() + static_cast<size_t>(r) * width + lo;
        SoftCap(row, hi - lo, static_cast<float>(m.logit_softcap));
        SoftmaxInPlace(row, hi - lo);
        float* dst = abar.data() + static_cast<size_t>(r0 + r) * ce + first + lo;
        for (int j = 0; j < hi - lo; ++j) dst[j] += row[j] / H;
      }
    }
  });
  DapScores s;
  s.received.assign(ce, 0.0);
  s.peak.assign(ce, 0.0);
  for (int i = 0; i < nt; ++i)
    for (int j = 0; j < ce; ++j) {
      const double a = abar[static_cast<size_t>(i) * ce + j];
      s.received[j] += a;
      s.peak[j] = std::max(s.peak[j], a);
    }
  return s;
}

std::vector<int32_t> DapEvictions(const TraceMeta& meta, const DapScores& s, int ce,
                                  const policy::HAEParams& p, int budget) {
  auto by_score = [&](std::vector<int32_t>& v) {
    std::stable_sort(v.begin(), v.end(), [&](int32_t a, int32_t b) { return s.received[a] < s.received[b]; });
  };
  std::vector<int32_t> visual, text, out;
  for (int32_t j = 0; j < ce; ++j) (IsVisual(meta.tokens.modality[j]) ? visual : text).push_back(j);
  if (p.mode() == policy::HAEParams::THRESHOLD) {
    double total = 0;
    for (int32_t j : visual) total += s.received[j];
    for (int32_t j : visual)
      if (s.received[j] <= p.r() * total && s.peak[j] < p.alpha()) out.push_back(j);
    if (p.max_evict() > 0 && static_cast<int>(out.size()) > p.max_evict()) {
      by_score(out);
      out.resize(p.max_evict());
    }
  } else {
    const int count = std::max(0, ce - budget);
    by_score(visual);
    by_score(text);
    for (int32_t j : visual)
      if (static_cast<int>(out.size()) < count) out.push_back(j);
    for (int32_t j : text)
      if (static_cast<int>(out.size()) < count) out.push_back(j);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<int> LowestSlots(std::span<const float> slot_scores, int count) {
  std::vector<int> idx(slot_scores.size());
  std::iota(idx.begin(), idx.end(), 0);
  count = std::clamp(count, 0, static_cast<int>(idx.size()));
  // The first `count` of a stable sort by score are the `count` smallest (score, slot) pairs: a selection
  // of those (nth_element with the slot breaking ties, a strict total order) then a sort of the selected
  // slots, instead of a stable sort of every slot. With a NaN score `<` is no order and the stable sort's
  // outcome depends on its steps: that case keeps the stable sort.
  const bool ordered =
      std::none_of(slot_scores.begin(), slot_scores.end(), [](float x) { return std::isnan(x); });
  if (ordered && count > 0 && count < static_cast<int>(idx.size())) {
    std::nth_element(idx.begin(), idx.begin() + (count - 1), idx.end(), [&](int a, int b) {
      return slot_scores[a] < slot_scores[b] || (slot_scores[a] == slot_scores[b] && a < b);
    });
  } else if (!ordered) {
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return slot_scores[a] < slot_scores[b]; });
  }
  idx.resize(count);
  std::sort(idx.begin(), idx.end());
  return idx;
}

policy::HAEParams ResolveHAEParams(const policy::HAEParams& in) {
  policy::HAEParams p = in;
  struct Preset {
    double r, alpha;
    int rc;
  };
  const Preset table[] = {{0.0012, 0.001, 64}, {0.0005, 0.0005, 128}, {0.0015, 0.0015, 56}};
  const Preset& t = table[static_cast<int>(p.preset())];
  if (!p.has_preset()) p.set_preset(p.preset());
  if (!p.has_r()) p.set_r(t.r);
  if (!p.has_alpha()) p.set_alpha(t.alpha);
  if (!p.has_rc_size()) p.set_rc_size(t.rc);
  return p;
}

Status HAEPolicy::Validate(const policy::HAEParams& in) {
  const policy::HAEParams p = ResolveHAEParams(in);
  KVSIM_RETURN_IF_ERROR(Need(p.r() >= 0 && p.r() <= 1, "r must be in [0, 1]"));
  KVSIM_RETURN_IF_ERROR(Need(p.alpha() >= 0 && p.alpha() <= 1, "alpha must be in [0, 1]"));
  KVSIM_RETURN_IF_ERROR(Need(p.rc_size() >= 1, "rc_size must be >= 1"));
  KVSIM_RETURN_IF_ERROR(Need(p.max_evict() >= 0, "max_evict must be >= 0 (0 = no limit)"));
  return Need(p.dap_layer() >= 0, "dap_layer must be >= 0");
}

PolicyRequirements HAEPolicy::requirements() const {
  const bool dap = params_.components() != policy::HAEParams::DDES_ONLY;
  const bool colsums = (!dap && params_.mode() == policy::HAEParams::BUDGET) ||
                       params_.ddes_init() == policy::HAEParams::PROMPT_COLUMN_SUMS;
  return {.prompt_column_sums = colsums,
          .decode_attention = evicts_during_decode(),
          .first_pass = dap,
          .first_pass_prompt_queries = dap,  // DAP's text queries, of dap_layer only (FirstPassLayers)
          .prompt_queries_alternative = dap ? "or run HAE without DAP (--set components=DDES_ONLY)" : ""};
}

std::unique_ptr<HeadPolicy> HAEPolicy::NewHeadPolicy(const HeadContext& ctx) const {
  return std::make_unique<HAEHead>(params_, ctx);
}

std::unique_ptr<PolicyPlan> HAEPolicy::NewPlan(const TraceMeta& meta, int) const {
  auto plan = std::make_unique<HAEPlan>();
  plan->dap_layer = std::min(params_.dap_layer(), meta.model.num_layers - 1);  // documented clamp
  return plan;
}

std::vector<int> HAEPolicy::FirstPassLayers(const TraceMeta& meta, int) const {
  return {std::min(params_.dap_layer(), meta.model.num_layers - 1)};  // NewPlan's dap_layer
}

void HAEPolicy::ObserveLayer(const LayerView& view, PolicyPlan* plan) const {
  auto* p = static_cast<HAEPlan*>(plan);
  if (view.layer == p->dap_layer) p->scores = ComputeDapScores(view);
}

std::vector<int> HAEPolicy::PlannedLayerBudgets(const TraceMeta& meta, int budget, int compress_len,
                                                const PolicyPlan& plan) const {
  const auto& p = static_cast<const HAEPlan&>(plan);
  auto it = p.evicted.find(budget);
  if (it == p.evicted.end())
    it = p.evicted.emplace(budget, DapEvictions(meta, p.scores, compress_len, params_, budget)).first;
  // BUDGET: exactly B remain; THRESHOLD: the budget is not DAP's (reported; may_exceed_budget).
  return std::vector<int>(meta.model.num_layers, std::min(budget, compress_len));
}

std::map<std::string, std::vector<double>> HAEPolicy::PlannedLayerStats(const TraceMeta& meta, int budget,
                                                                        int, const PolicyPlan& plan) const {
  const auto& p = static_cast<const HAEPlan&>(plan);
  const auto it = p.evicted.find(budget);
  if (it == p.evicted.end()) return {};
  return {
      {"dap_evicted", std::vector<double>(meta.model.num_layers, static_cast<double>(it->second.size()))}};
}

void RegisterHAEPolicy(PolicyRegistry* r) {
  r->Register(
      {"hae", "DAP (text-ignored visual tokens evicted everywhere) + DDES batch decode eviction (HAE)",
       "kvsim.policy.HAEParams"},
      TypedFactory<HAEPolicy, policy::HAEParams>());
}

}  // namespace kvsim
