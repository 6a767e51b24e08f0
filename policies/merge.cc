#include "policies/merge.h"

#include <cblas.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>

#include "sim/attention.h"

namespace kvsim {
namespace {

// Row r's squared norm as a sequential double sum over k (the order every row has always used).
double SquaredNorm(const float* row, int d) {
  double s = 0;
  for (int k = 0; k < d; ++k) s += static_cast<double>(row[k]) * row[k];
  return s;
}

void ScaleRow(const float* x, double s, int d, float* out) {
  const float inv = s > 0 ? static_cast<float>(1.0 / std::sqrt(s)) : 0.0f;
  for (int k = 0; k < d; ++k) out[k] = x[k] * inv;
}

// Rows scaled to unit length (zero rows stay zero). Eight rows at a time: each row's sum still runs over k
// in order (so the result is the same as one row at a time), but the eight dependency chains overlap
// instead of one latency-bound chain per row (it was a third of NearestByCosine's own time, issue 14).
void NormalizeRows(const float* x, int rows, int d, float* out) {
  constexpr int kRows = 8;
  int r = 0;
  for (; r + kRows <= rows; r += kRows) {
    const float* xr = x + static_cast<size_t>(r) * d;
    double s[kRows] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < d; ++k)
      for (int i = 0; i < kRows; ++i) {
        const double v = xr[static_cast<size_t>(i) * d + k];
        s[i] += v * v;  // exact product (float x float fits a double): fused or not, the same sum
      }
    for (int i = 0; i < kRows; ++i)
      ScaleRow(xr + static_cast<size_t>(i) * d, s[i], d, out + static_cast<size_t>(r + i) * d);
  }
  for (; r < rows; ++r)
    ScaleRow(x + static_cast<size_t>(r) * d, SquaredNorm(x + static_cast<size_t>(r) * d, d), d,
             out + static_cast<size_t>(r) * d);
}

// Index of the first maximum of a finite row, as std::max_element returns it. Two passes: an 8-lane max
// reduction (max is exact, so the lane order does not matter), then the first index equal to it, eight
// elements per compare mask. std::max_element's compare-and-select chain was the profile's top line of
// merging (issue 14); the compiler keeps both loops scalar, hence the AVX2 intrinsics (same comparisons:
// max_ps(v, lane) is `v > lane ? v : lane`, an ordered equality never matches a NaN).
int FirstMaxIndex(const float* row, int n) {
  float lane[8];
  int i = 0;
#ifdef __AVX2__
  __m256 lanes = _mm256_set1_ps(row[0]);
  for (; i + 8 <= n; i += 8) lanes = _mm256_max_ps(_mm256_loadu_ps(row + i), lanes);
  _mm256_storeu_ps(lane, lanes);
#else
  for (int k = 0; k < 8; ++k) lane[k] = row[0];
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) lane[k] = row[i + k] > lane[k] ? row[i + k] : lane[k];
#endif
  float mx = lane[0];
  for (int k = 1; k < 8; ++k) mx = lane[k] > mx ? lane[k] : mx;
  for (; i < n; ++i) mx = row[i] > mx ? row[i] : mx;
  int j = 0;
#ifdef __AVX2__
  const __m256 target = _mm256_set1_ps(mx);
  for (; j + 8 <= n; j += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), target, _CMP_EQ_OQ));
    if (mask != 0) return j + std::countr_zero(static_cast<unsigned>(mask));
  }
#endif
  for (; j < n; ++j)
    if (row[j] == mx) return j;
  return static_cast<int>(std::max_element(row, row + n) - row);  // a NaN: as before
}

const float* OriginalKey(const HeadContext& ctx, int32_t tok) {
  return ctx.keys + static_cast<size_t>(tok) * ctx.head_dim();
}
const float* OriginalValue(const HeadContext& ctx, int32_t tok) {
  return ctx.values + static_cast<size_t>(tok) * ctx.head_dim();
}

}  // namespace

void NearestByCosine(const float* queries, int num_queries, const float* targets, int num_targets, int d,
                     std::vector<int>* nearest, std::vector<float>* similarity) {
  nearest->assign(num_queries, -1);
  similarity->assign(num_queries, 0.0f);
  if (num_queries == 0 || num_targets == 0) return;
  EnsureSingleThreadedBlas();
  std::vector<float> t(static_cast<size_t>(num_targets) * d);
  NormalizeRows(targets, num_targets, d, t.data());
  constexpr int kBlock = 256;  // query rows per GEMM: bounds the similarity block to 256 x num_targets
  std::vector<float> q(static_cast<size_t>(kBlock) * d), sim(static_cast<size_t>(kBlock) * num_targets);
  for (int b = 0; b < num_queries; b += kBlock) {
    const int rows = std::min(kBlock, num_queries - b);
    NormalizeRows(queries + static_cast<size_t>(b) * d, rows, d, q.data());
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, num_targets, d, 1.0f, q.data(), d, t.data(), d,
                0.0f, sim.data(), num_targets);
    for (int r = 0; r < rows; ++r) {
      const float* row = sim.data() + static_cast<size_t>(r) * num_targets;
      const int best = FirstMaxIndex(row, num_targets);
      (*nearest)[b + r] = best;
      (*similarity)[b + r] = row[best];
    }
  }
}

void Merger::Apply(const HeadContext& ctx, int slot, Sums& s, HeadCache* cache) const {
  const int d = ctx.head_dim();
  const int32_t anchor = cache->token(slot);
  const double m = static_cast<double>(s.members.size());
  const double a = strategy_ == policy::PIVOT ? 1.0 + m / 2 : 1.0;
  const double inv = 1.0 / (1.0 + m);
  MergedSlot out;
  out.key.resize(d);
  out.value.resize(d);
  const float* ka = OriginalKey(ctx, anchor);
  const float* va = OriginalValue(ctx, anchor);
  for (int k = 0; k < d; ++k) {
    out.key[k] = static_cast<float>((a * ka[k] + s.k[k]) * inv);
    out.value[k] = static_cast<float>((a * va[k] + s.v[k]) * inv);
  }
  out.members = s.members;
  cache->SetMerge(slot, std::move(out));
}

void Merger::KeepAndMerge(const HeadContext& ctx, std::span<const int32_t> kept,
                          std::span<const int32_t> evicted, HeadCache* cache) {
  cache->Assign(kept);
  sums_.clear();
  MergeTokens(ctx, evicted, cache);
}

void Merger::MergeTokens(const HeadContext& ctx, std::span<const int32_t> tokens, HeadCache* cache) {
  if (strategy_ == policy::NO_MERGE || tokens.empty() || cache->size() == 0) return;
  const int d = ctx.head_dim(), slots = cache->size(), e = static_cast<int>(tokens.size());
  std::vector<float> targets(static_cast<size_t>(slots) * d), x(static_cast<size_t>(e) * d);
  for (int s = 0; s < slots; ++s) {
    const float* k = cache->is_merged(s) ? cache->merged(s).key.data() : OriginalKey(ctx, cache->token(s));
    std::copy(k, k + d, targets.begin() + static_cast<size_t>(s) * d);
  }
  for (int i = 0; i < e; ++i) {
    const float* k = OriginalKey(ctx, tokens[i]);
    std::copy(k, k + d, x.begin() + static_cast<size_t>(i) * d);
  }
  std::vector<int> nearest;
  std::vector<float> sim;
  NearestByCosine(x.data(), e, targets.data(), slots, d, &nearest, &sim);
  double threshold = -2;  // below every cosine
  if (filter_ == policy::ABOVE_MEAN_SIMILARITY) {
    double mean = 0;
    for (float s : sim) mean += s;
    threshold = mean / e;
  }
  std::vector<char> dirty(slots, 0);
  for (int i = 0; i < e; ++i) {
    if (sim[i] < threshold) continue;  // filtered out: dropped
    const int slot = nearest[i];
    const float c = strategy_ == policy::AVERAGE ? 1.0f : strategy_ == policy::PIVOT ? 0.5f : sim[i];
    Sums& s = sums_[cache->token(slot)];
    if (s.k.empty()) {
      s.k.assign(d, 0.0f);
      s.v.assign(d, 0.0f);
    }
    const float* k = OriginalKey(ctx, tokens[i]);
    const float* v = OriginalValue(ctx, tokens[i]);
    for (int j = 0; j < d; ++j) {
      s.k[j] += c * k[j];
      s.v[j] += c * v[j];
    }
    s.members.emplace_back(tokens[i], c);
    dirty[slot] = 1;
  }
  for (int s = 0; s < slots; ++s)
    if (dirty[s]) Apply(ctx, s, sums_[cache->token(s)], cache);
}

void Merger::Reconcile(const HeadContext& ctx, std::span<const int32_t> before, HeadCache* cache) {
  if (strategy_ == policy::NO_MERGE) return;
  mark_.resize(ctx.meta->total_tokens(), 0);
  for (int32_t tok : cache->tokens()) mark_[tok] = 1;
  std::vector<int32_t> originals;
  for (int32_t tok : before) {
    if (mark_[tok]) continue;
    originals.push_back(tok);
    auto it = sums_.find(tok);
    if (it != sums_.end()) {
      for (const auto& [member, c] : it->second.members) originals.push_back(member);
      sums_.erase(it);
    }
  }
  for (int32_t tok : cache->tokens()) mark_[tok] = 0;
  // A policy that rebuilt the cache (Assign) dropped the merges of the anchors it kept: restore them (every
  // surviving anchor with sums is a merged slot unless a merge was dropped).
  if (static_cast<size_t>(cache->num_merged_slots()) < sums_.size())
    for (int s = 0; s < cache->size(); ++s)
      if (!cache->is_merged(s)) {
        auto it = sums_.find(cache->token(s));
        if (it != sums_.end()) Apply(ctx, s, it->second, cache);
      }
  std::sort(originals.begin(), originals.end());
  MergeTokens(ctx, originals, cache);
}

void Merger::Release() {
  std::unordered_map<int32_t, Sums>().swap(sums_);
  std::vector<char>().swap(mark_);
}

// ---- wrapper ----
namespace {

const char* StrategySuffix(policy::MergeStrategy s) {
  switch (s) {
    case policy::AVERAGE:
      return "average";
    case policy::PIVOT:
      return "pivot";
    case policy::WEIGHTED:
      return "weighted";
    default:
      return "none";
  }
}

class MergeWrappedHead final : public HeadPolicy {
 public:
  MergeWrappedHead(std::unique_ptr<HeadPolicy> base, policy::MergeStrategy strategy)
      : base_(std::move(base)), merger_(strategy, policy::MERGE_ALL) {}

  void OnPrefill(const HeadContext& ctx, int budget, HeadCache* cache) override {
    base_->OnPrefill(ctx, budget, cache);
    // The cache held [0, compress_end) as plain slots: every token the base left out was evicted.
    std::vector<char> kept(ctx.compress_end, 0);
    for (int32_t tok : cache->tokens())
      if (tok < ctx.compress_end) kept[tok] = 1;
    std::vector<int32_t> evicted;
    for (int32_t j = 0; j < ctx.compress_end; ++j)
      if (!kept[j]) evicted.push_back(j);
    merger_.MergeTokens(ctx, evicted, cache);
  }
  void BeforeStep(const HeadContext& ctx, const StepAttention& att, int cap, HeadCache* cache) override {
    const uint64_t version = cache->version();
    before_.assign(cache->tokens().begin(), cache->tokens().end());
    base_->BeforeStep(ctx, att, cap, cache);
    if (cache->version() != version) merger_.Reconcile(ctx, before_, cache);  // else: only appends, if any
  }
  bool AppendNewToken() const override { return base_->AppendNewToken(); }
  void AfterStep(const HeadContext& ctx, const StepAttention& att, HeadCache* cache) override {
    const uint64_t version = cache->version();
    before_.assign(cache->tokens().begin(), cache->tokens().end());
    base_->AfterStep(ctx, att, cache);
    if (cache->version() != version) merger_.Reconcile(ctx, before_, cache);
  }

 private:
  std::unique_ptr<HeadPolicy> base_;
  Merger merger_;
  std::vector<int32_t> before_;
};

class MergeWrappedPolicy final : public Policy {
 public:
  MergeWrappedPolicy(std::shared_ptr<const Policy> base, policy::MergeStrategy strategy)
      : base_(std::move(base)), strategy_(strategy) {}
  std::string name() const override { return base_->name() + "+" + StrategySuffix(strategy_); }
  std::string ParamsText() const override {
    const std::string base = base_->ParamsText();
    return base + (base.empty() ? "" : " ") + "merge: " + policy::MergeStrategy_Name(strategy_);
  }
  PolicyRequirements requirements() const override { return base_->requirements(); }
  bool evicts_during_decode() const override { return base_->evicts_during_decode(); }
  bool may_exceed_budget() const override { return base_->may_exceed_budget(); }
  int compression_step() const override { return base_->compression_step(); }
  int decode_headroom() const override { return base_->decode_headroom(); }
  PolicyGpuWork gpu_work() const override {
    PolicyGpuWork w = base_->gpu_work();
    w.merge = true;
    return w;
  }
  std::vector<int> LayerBudgets(const TraceMeta& meta, int budget, int compress_len) const override {
    return base_->LayerBudgets(meta, budget, compress_len);
  }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext& ctx) const override {
    return std::make_unique<MergeWrappedHead>(base_->NewHeadPolicy(ctx), strategy_);
  }
  std::unique_ptr<PolicyPlan> NewPlan(const TraceMeta& meta, int compress_len) const override {
    return base_->NewPlan(meta, compress_len);
  }
  void ObserveLayer(const LayerView& layer, PolicyPlan* plan) const override {
    base_->ObserveLayer(layer, plan);
  }
  void FinishPlan(const TraceMeta& meta, PolicyPlan* plan) const override { base_->FinishPlan(meta, plan); }
  std::vector<int> PlannedLayerBudgets(const TraceMeta& meta, int budget, int compress_len,
                                       const PolicyPlan& plan) const override {
    return base_->PlannedLayerBudgets(meta, budget, compress_len, plan);
  }
  std::vector<int> PlannedHeadBudgets(const TraceMeta& meta, int budget, int compress_len,
                                      const PolicyPlan& plan,
                                      std::span<const int> layer_budgets) const override {
    return base_->PlannedHeadBudgets(meta, budget, compress_len, plan, layer_budgets);
  }
  std::map<std::string, std::vector<double>> PlannedLayerStats(const TraceMeta& meta, int budget,
                                                               int compress_len,
                                                               const PolicyPlan& plan) const override {
    return base_->PlannedLayerStats(meta, budget, compress_len, plan);
  }

 private:
  std::shared_ptr<const Policy> base_;
  policy::MergeStrategy strategy_;
};

}  // namespace

bool ParseMergeSuffix(const std::string& suffix, policy::MergeStrategy* strategy) {
  for (policy::MergeStrategy s : {policy::AVERAGE, policy::PIVOT, policy::WEIGHTED})
    if (suffix == StrategySuffix(s)) {
      *strategy = s;
      return true;
    }
  return false;
}

std::shared_ptr<const Policy> WrapWithMerge(std::shared_ptr<const Policy> base,
                                            policy::MergeStrategy strategy) {
  return std::make_shared<MergeWrappedPolicy>(std::move(base), strategy);
}

}  // namespace kvsim
