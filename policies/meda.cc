#include "policies/meda.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "policies/pieces.h"
#include "sim/parallel.h"
#include "sim/stats.h"

namespace kvsim {
namespace {

constexpr int kEntropyRows = 128;  // query rows per GEMM block

// Gathers rows `idx` of a [*][d] matrix.
std::vector<float> Gather(const float* src, std::span<const int32_t> idx, int d) {
  std::vector<float> out(idx.size() * static_cast<size_t>(d));
  for (size_t i = 0; i < idx.size(); ++i)
    std::copy(src + static_cast<size_t>(idx[i]) * d, src + static_cast<size_t>(idx[i] + 1) * d,
              out.begin() + i * d);
  return out;
}

// Group-aggregated scores over the cache slots of one decode step.
std::vector<float> GroupStepRow(const HeadContext& ctx, const StepAttention& att,
                                policy::GroupAggregation agg) {
  std::vector<std::span<const float>> rows;
  for (int g = 0; g < ctx.group_size; ++g)
    rows.emplace_back(att.cache_probs + static_cast<size_t>(g) * att.num_slots, att.num_slots);
  return AggregateGroup(rows, agg);
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
  merger->KeepAndMerge(ctx, keep, evicted, cache);
  merger->Release();
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

double MeanRowEntropy(const LogitTransform& tf, const float* q, int rows, const float* k, int cols, int d) {
  if (rows == 0 || cols == 0) return 0;
  EnsureSingleThreadedBlas();
  std::vector<float> block(static_cast<size_t>(kEntropyRows) * cols);
  double sum = 0;
  for (int b = 0; b < rows; b += kEntropyRows) {
    const int r = std::min(kEntropyRows, rows - b);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r, cols, d, tf.scale, q + static_cast<size_t>(b) * d,
                d, k, d, 0.0f, block.data(), cols);
    for (int i = 0; i < r; ++i) {
      float* row = block.data() + static_cast<size_t>(i) * cols;
      SoftCap(row, cols, tf.softcap);
      sum += SoftmaxEntropy(row, cols);
    }
  }
  return sum / rows;
}

double MeanCausalRowEntropy(const ModelInfo& m, const float* q, const float* k, int n) {
  if (n == 0) return 0;
  EnsureSingleThreadedBlas();
  const int d = m.head_dim;
  std::vector<float> block;
  double sum = 0;
  for (int b0 = 0; b0 < n; b0 += kEntropyRows) {
    const int b1 = std::min(n, b0 + kEntropyRows), rows = b1 - b0;
    const int kmin = FirstVisibleKey(m, b0), width = b1 - kmin;
    block.resize(static_cast<size_t>(rows) * width);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, width, d, static_cast<float>(m.softmax_scale),
                q + static_cast<size_t>(b0) * d, d, k + static_cast<size_t>(kmin) * d, d, 0.0f, block.data(),
                width);
    for (int i = 0; i < rows; ++i) {
      const int pos = b0 + i, lo = FirstVisibleKey(m, pos) - kmin, hi = pos + 1 - kmin;
      float* row = block.data() + static_cast<size_t>(i) * width + lo;
      SoftCap(row, hi - lo, static_cast<float>(m.logit_softcap));
      sum += SoftmaxEntropy(row, hi - lo);
    }
  }
  return sum / n;
}

double MeanRowEntropyOfHeadMean(const ModelInfo& m, std::span<const float* const> q,
                                std::span<const float* const> k, int rows, int cols, bool causal,
                                int threads) {
  KVSIM_CHECK(q.size() == k.size());
  const int H = static_cast<int>(q.size()), d = m.head_dim;
  if (rows == 0 || cols == 0 || H == 0) return 0;
  EnsureSingleThreadedBlas();
  const float scale = static_cast<float>(m.softmax_scale), cap = static_cast<float>(m.logit_softcap);
  const int blocks = (rows + kEntropyRows - 1) / kEntropyRows;
  std::vector<double> part(blocks, 0.0);  // per row block, summed in block order: any thread count
  ParallelFor(blocks, threads, [&](int b) {
    const int r0 = b * kEntropyRows, r1 = std::min(rows, r0 + kEntropyRows), nr = r1 - r0;
    const int kmin = causal ? FirstVisibleKey(m, r0) : 0, width = (causal ? r1 : cols) - kmin;
    auto lo = [&](int i) { return causal ? FirstVisibleKey(m, r0 + i) - kmin : 0; };
    auto hi = [&](int i) { return causal ? r0 + i + 1 - kmin : width; };
    std::vector<float> block(static_cast<size_t>(nr) * width), mean(block.size(), 0.0f);
    for (int h = 0; h < H; ++h) {  // heads in a fixed order
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, width, d, scale,
                  q[h] + static_cast<size_t>(r0) * d, d, k[h] + static_cast<size_t>(kmin) * d, d, 0.0f,
                  block.data(), width);
      for (int i = 0; i < nr; ++i) {
        float* row = block.data() + static_cast<size_t>(i) * width;
        float* acc = mean.data() + static_cast<size_t>(i) * width;
        SoftCap(row + lo(i), hi(i) - lo(i), cap);
        SoftmaxInPlace(row + lo(i), hi(i) - lo(i));
        for (int j = lo(i); j < hi(i); ++j) acc[j] += row[j];
      }
    }
    double sum = 0;
    for (int i = 0; i < nr; ++i) {
      const float* acc = mean.data() + static_cast<size_t>(i) * width;
      for (int j = lo(i); j < hi(i); ++j) {
        const double p = static_cast<double>(acc[j]) / H;
        if (p > 0) sum -= p * std::log(p);
      }
    }
    part[b] = sum;
  });
  return std::accumulate(part.begin(), part.end(), 0.0) / rows;
}

double MedaLayerEntropy(const LayerView& view, policy::MedaParams::Entropy mode,
                        policy::MedaParams::HeadAveraging averaging) {
  const TraceMeta& meta = *view.meta;
  const ModelInfo& m = meta.model;
  const int d = m.head_dim, ce = view.compress_end, t_all = meta.total_tokens();
  const size_t tq = meta.query_positions.size();
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
    const float* queries = view.data->queries.data() + static_cast<size_t>(h) * tq * d;
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
  std::vector<double> per_head(m.num_heads, 0.0);
  ParallelFor(m.num_heads, view.threads, [&](int h) {
    const float* keys = head_keys(h);
    auto query_rows = [&](std::span<const int32_t> pos) { return head_query_rows(h, pos); };
    if (mode == policy::MedaParams::FULL_SELF) {
      per_head[h] = MeanCausalRowEntropy(m, query_rows(all).data(), keys, ce);
      return;
    }
    const LogitTransform tf(m);
    const std::vector<float> qt = query_rows(text), qv = query_rows(visual);
    const std::vector<float> kt = Gather(keys, text, d), kv = Gather(keys, visual, d);
    const int nt = static_cast<int>(text.size()), nv = static_cast<int>(visual.size());
    per_head[h] = MeanRowEntropy(tf, qt.data(), nt, kv.data(), nv, d) +  // -E_TV
                  MeanRowEntropy(tf, qv.data(), nv, kt.data(), nt, d);   // -E_VT
  });
  return Mean(per_head);  // over the num_heads heads
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

PolicyRequirements MedaPolicy::requirements() const {
  return {.prompt_column_sums = true,
          .decode_attention = params_.compress_at() == policy::MedaParams::FIRST_DECODE_STEP,
          .first_pass = true,
          .all_prompt_queries = true};
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

void MedaPolicy::ObserveLayer(const LayerView& layer, PolicyPlan* plan) const {
  static_cast<MedaPlan*>(plan)->entropy.push_back(
      MedaLayerEntropy(layer, params_.entropy(), params_.head_averaging()));
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
