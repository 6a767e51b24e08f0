#include "policies/adakv.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <tuple>

#include "policies/pieces.h"
#include "sim/attention.h"
#include "sim/parallel.h"

namespace kvsim {
namespace {

// Per (layer, KV head): the pooled observation-window scores over [0, compress_end - window), descending.
struct AdaKVPlan final : PolicyPlan {
  int window = 0;                          // min(params.window, compress_end)
  std::vector<std::vector<float>> sorted;  // [layer * Hkv + kv head]
};

class AdaKVHead final : public HeadPolicy {
 public:
  explicit AdaKVHead(SnapKVSelection sel) : sel_(sel) {}
  void OnPrefill(const HeadContext& ctx, int budget, HeadCache* cache) override {
    cache->Assign(sel_.Select(ctx, budget, &rank_));  // `budget` is this head's own share
  }
  std::span<const float> PrefillRank() const override { return rank_; }

 private:
  SnapKVSelection sel_;
  std::vector<float> rank_;
};

}  // namespace

std::vector<int> SplitAcrossHeads(std::span<const std::vector<float>> sorted, int64_t total, int floor) {
  const int heads = static_cast<int>(sorted.size());
  std::vector<int> out(heads, 0);
  int64_t capacity = 0;
  for (int h = 0; h < heads; ++h) {
    out[h] = std::clamp(floor, 0, static_cast<int>(sorted[h].size()));
    capacity += static_cast<int64_t>(sorted[h].size());
  }
  total = std::clamp<int64_t>(total, 0, capacity);
  int64_t used = std::accumulate(out.begin(), out.end(), int64_t{0});
  if (used > total) {  // floors alone exceed the total: lower them evenly (lower heads keep the extra one)
    const int64_t each = total / std::max(1, heads), extra = total % std::max(1, heads);
    for (int h = 0; h < heads; ++h)
      out[h] = static_cast<int>(std::min<int64_t>(sorted[h].size(), each + (h < extra ? 1 : 0)));
    return out;
  }
  // One top-k over every head's scores beyond its floor: a k-way merge of the sorted lists.
  using Item = std::tuple<float, int, int>;  // (score, head, rank); best = highest score, lower head
  auto worse = [](const Item& a, const Item& b) {
    if (std::get<0>(a) != std::get<0>(b)) return std::get<0>(a) < std::get<0>(b);
    return std::get<1>(a) > std::get<1>(b);
  };
  std::vector<Item> heap;
  for (int h = 0; h < heads; ++h)
    if (out[h] < static_cast<int>(sorted[h].size())) heap.emplace_back(sorted[h][out[h]], h, out[h]);
  std::make_heap(heap.begin(), heap.end(), worse);
  while (used < total && !heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), worse);
    const auto [score, h, rank] = heap.back();
    heap.pop_back();
    ++out[h];
    ++used;
    if (rank + 1 < static_cast<int>(sorted[h].size())) {
      heap.emplace_back(sorted[h][rank + 1], h, rank + 1);
      std::push_heap(heap.begin(), heap.end(), worse);
    }
  }
  return out;
}

Status AdaKVPolicy::Validate(const policy::AdaKVParams& p) {
  KVSIM_RETURN_IF_ERROR(Need(p.window() >= 1, "window must be >= 1"));
  KVSIM_RETURN_IF_ERROR(Need(p.kernel_size() >= 1 && p.kernel_size() % 2 == 1,
                             "kernel_size must be odd and >= 1 (same-length pooling)"));
  return Need(p.floor_fraction() >= 0 && p.floor_fraction() <= 1, "floor_fraction must be in [0, 1]");
}

std::unique_ptr<HeadPolicy> AdaKVPolicy::NewHeadPolicy(const HeadContext&) const {
  return std::make_unique<AdaKVHead>(SnapKVSelection{params_.window(), params_.kernel_size(),
                                                     params_.pooling(), params_.group_aggregation()});
}

std::unique_ptr<PolicyPlan> AdaKVPolicy::NewPlan(const TraceMeta& meta, int compress_len) const {
  auto plan = std::make_unique<AdaKVPlan>();
  plan->window = std::min(params_.window(), compress_len);
  plan->sorted.resize(static_cast<size_t>(meta.model.num_layers) * meta.model.num_kv_heads);
  return plan;
}

void AdaKVPolicy::ObserveLayer(const LayerView& view, PolicyPlan* plan) const {
  auto* p = static_cast<AdaKVPlan*>(plan);
  const int ce = view.compress_end, w = p->window, hkv = view.meta->model.num_kv_heads;
  ParallelFor(hkv, view.threads, [&](int u) {
    // The same scores SnapKVSelection computes at the prefill hook (window column sums, group-aggregated,
    // truncated before the window, pooled), so the split and the heads' selections agree.
    std::vector<float> score = LayerGroupWindowColumnSums(view, u, w, params_.group_aggregation());
    score.resize(ce - w);
    score = Pool1D(score, params_.kernel_size(), params_.pooling());
    std::sort(score.begin(), score.end(), std::greater<float>());
    p->sorted[static_cast<size_t>(view.layer) * hkv + u] = std::move(score);
  });
}

std::vector<int> AdaKVPolicy::PlannedHeadBudgets(const TraceMeta& meta, int budget, int compress_len,
                                                 const PolicyPlan& plan,
                                                 std::span<const int> layer_budgets) const {
  const auto& p = static_cast<const AdaKVPlan&>(plan);
  const int hkv = meta.model.num_kv_heads;
  std::vector<int> out;
  for (int l = 0; l < meta.model.num_layers; ++l) {
    const int b = layer_budgets[l];
    const int tail = std::min(p.window, b);  // every head keeps its observation window (SnapKV)
    const int floor = static_cast<int>(std::lround(params_.floor_fraction() * (b - tail)));
    const std::span<const std::vector<float>> heads(&p.sorted[static_cast<size_t>(l) * hkv], hkv);
    const std::vector<int> extra = SplitAcrossHeads(heads, static_cast<int64_t>(hkv) * (b - tail), floor);
    for (int e : extra) out.push_back(std::min(compress_len, tail + e));
  }
  return out;
}

void RegisterAdaptivePolicies(PolicyRegistry* r) {
  r->Register(
      {"adakv",
       "SnapKV scores, layer budget split across KV heads by one top-k with a floor (Feng et al. 2024)",
       "kvsim.policy.AdaKVParams"},
      TypedFactory<AdaKVPolicy, policy::AdaKVParams>());
}

}  // namespace kvsim
