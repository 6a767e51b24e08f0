#include "policies/madakv.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <numeric>

#include "policies/pieces.h"
#include "sim/attention.h"
#include "sim/parallel.h"
#include "sim/select.h"

namespace kvsim {
namespace {

// ψ over [0, compress_end - window): group-aggregated proxy-window column sums, optionally pooled.
std::vector<float> Psi(std::vector<float> colsum, int limit, const policy::MadaKVParams& p) {
  colsum.resize(limit);
  return Pool1D(colsum, p.kernel_size(), p.pooling());
}

struct MadaKVPlan final : PolicyPlan {
  int window = 0;                    // |P| = min(proxy_window, compress_end)
  std::vector<ModalityStats> stats;  // [layer * Hkv + kv head]
  // Per requested budget: the allocation (filled by PlannedHeadBudgets before any head runs; read-only
  // while the heads run).
  mutable std::map<int, MadaKVAllocation> runs;
};

class MadaKVHead final : public HeadPolicy {
 public:
  explicit MadaKVHead(const policy::MadaKVParams& p) : p_(p) {}
  void OnPrefill(const HeadContext& ctx, int budget, HeadCache* cache) override {
    const auto& plan = *static_cast<const MadaKVPlan*>(ctx.plan);
    const int ce = ctx.compress_end, tail = std::min(plan.window, budget);
    std::vector<int32_t> keep;
    rank_.clear();
    if (budget > plan.window) {
      const MadaKVAllocation& a = plan.runs.at(ctx.run_budget);
      const auto [rv, rt] =
          a.split[static_cast<size_t>(ctx.layer) * ctx.meta->model.num_kv_heads + ctx.kv_head];
      std::vector<float>& psi = rank_;
      psi = Psi(GroupWindowColumnSums(ctx, plan.window, p_.group_aggregation()), ce - plan.window, p_);
      // The top rv visual and rt text tokens by ψ (ties: the lower position).
      std::vector<float> sv(psi), st(psi);
      const float off = -std::numeric_limits<float>::infinity();
      for (int j = 0; j < ce - plan.window; ++j) (IsVisual(ctx.modality(j)) ? st : sv)[j] = off;
      for (int32_t j : TopKIndices(sv, rv)) keep.push_back(j);
      for (int32_t j : TopKIndices(st, rt)) keep.push_back(j);
      std::sort(keep.begin(), keep.end());
    }
    for (int32_t j = ce - tail; j < ce; ++j) keep.push_back(j);
    cache->Assign(keep);
  }
  // ψ: each modality's kept tokens are its top ones by ψ, so the kept set is a prefix of the ψ order when
  // the budget's split follows it (the engine's bands are shared only as far as that holds).
  std::span<const float> PrefillRank() const override { return rank_; }

 private:
  policy::MadaKVParams p_;
  std::vector<float> rank_;
};

}  // namespace

int ThetaSetSize(std::vector<float> scores, double theta) {
  std::sort(scores.begin(), scores.end(), std::greater<float>());
  double total = 0;
  for (float s : scores) total += s;
  if (total <= 0 || theta <= 0) return 0;
  const double target = theta * total;
  double acc = 0;
  for (size_t i = 0; i < scores.size(); ++i) {
    acc += scores[i];
    if (acc >= target * (1 - 1e-12)) return static_cast<int>(i + 1);
  }
  return static_cast<int>(scores.size());
}

ModalityStats ComputeModalityStats(const TraceMeta& meta, std::span<const float> psi, double theta) {
  ModalityStats s;
  std::vector<float> v, t;
  for (size_t j = 0; j < psi.size(); ++j) (IsVisual(meta.tokens.modality[j]) ? v : t).push_back(psi[j]);
  for (float x : v) s.w_v += x;
  for (float x : t) s.w_t += x;
  s.n_v = static_cast<int>(v.size());
  s.n_t = static_cast<int>(t.size());
  s.k_v = ThetaSetSize(std::move(v), theta);
  s.k_t = ThetaSetSize(std::move(t), theta);
  return s;
}

std::pair<int, int> SplitByModality(int extra, int want_v, int want_t, const ModalityStats& s) {
  extra = std::clamp(extra, 0, s.n_v + s.n_t);
  int rv;
  if (extra == want_v + want_t) {
    rv = want_v;
  } else if (extra < want_v + want_t) {
    rv = static_cast<int>(std::lround(static_cast<double>(extra) * want_v / (want_v + want_t)));
  } else {
    const double pref = s.w_v + s.w_t > 0
                            ? s.w_v / (s.w_v + s.w_t)
                            : (s.n_v + s.n_t > 0 ? static_cast<double>(s.n_v) / (s.n_v + s.n_t) : 0);
    rv = want_v + static_cast<int>(std::lround((extra - want_v - want_t) * pref));
  }
  rv = std::clamp(rv, 0, extra);
  int rt = extra - rv;
  if (rv > s.n_v) rt += rv - s.n_v, rv = s.n_v;
  if (rt > s.n_t) rv += rt - s.n_t, rt = s.n_t;
  return {rv, rt};
}

MadaKVAllocation AllocateMadaKV(std::span<const ModalityStats> stats, int num_layers, int heads, int budget,
                                int window, int compress_len, policy::MadaKVParams::Combine combine) {
  MadaKVAllocation a;
  const int L = num_layers, H = heads, cap_extra = std::max(0, compress_len - window);
  a.extra.assign(static_cast<size_t>(L) * H, 0);
  a.split.assign(a.extra.size(), {0, 0});
  a.want.assign(a.extra.size(), {0, 0});
  a.allowance.assign(L, 0);
  a.compensation.assign(L, 0);
  int64_t remaining = static_cast<int64_t>(L) * H * budget;  // tokens left for layers l.. (all heads)
  for (int l = 0; l < L; ++l) {
    const double phi = static_cast<double>(remaining) / (static_cast<double>(H) * (L - l));  // per head
    a.allowance[l] = phi;
    std::vector<int> want_v(H), want_t(H);
    std::vector<double> want(H);
    int64_t demand = 0;
    for (int h = 0; h < H; ++h) {
      const ModalityStats& s = stats[static_cast<size_t>(l) * H + h];
      if (combine == policy::MadaKVParams::THETA_SETS) {
        want_v[h] = s.k_v;
        want_t[h] = s.k_t;
      } else {  // Eq. 8 allowances cap the θ-sets
        const double room = std::max(0.0, phi - window);
        const double pref = s.w_v + s.w_t > 0 ? s.w_v / (s.w_v + s.w_t) : 0.5;
        want_v[h] = std::min(s.k_v, static_cast<int>(std::lround(room * pref)));
        want_t[h] = std::min(s.k_t, static_cast<int>(std::lround(room * (1 - pref))));
      }
      want[h] = std::min(want_v[h] + want_t[h], cap_extra);
      demand += static_cast<int64_t>(want[h]);
    }
    // Every later layer keeps at least its proxy windows; the last layer takes exactly what is left.
    const int64_t after = static_cast<int64_t>(L - l - 1) * H * window;
    int64_t target = std::max<int64_t>(0, remaining - static_cast<int64_t>(H) * window - after);
    if (l < L - 1) target = std::min(target, demand);
    target = std::min<int64_t>(target, static_cast<int64_t>(H) * cap_extra);
    std::vector<int> extra(H);
    if (target == demand) {
      for (int h = 0; h < H; ++h) extra[h] = static_cast<int>(want[h]);
    } else {
      std::vector<double> weights(want);
      if (demand == 0) std::fill(weights.begin(), weights.end(), 1.0);
      extra = ProportionalLayerBudgets(weights, target, cap_extra);
    }
    int64_t kept = 0;
    for (int h = 0; h < H; ++h) {
      const size_t i = static_cast<size_t>(l) * H + h;
      a.extra[i] = extra[h];
      a.split[i] = SplitByModality(extra[h], want_v[h], want_t[h], stats[i]);
      kept += window + extra[h];
    }
    a.compensation[l] = static_cast<double>(kept) / H - phi;  // K^l / H: > 0 overspent, < 0 saved
    remaining -= kept;
    for (int h = 0; h < H; ++h) {
      a.want[static_cast<size_t>(l) * H + h] = {want_v[h], want_t[h]};
    }
  }
  // Savings the last layer could not absorb (a head holds at most the compressible prompt) go back to the
  // nearest earlier layers with room, so the request's total is exactly min(L·H·B, L·H·ce).
  for (int l = L - 1; l >= 0 && remaining > 0; --l) {
    int64_t added = 0;
    for (int h = 0; h < H && remaining > 0; ++h) {
      const size_t i = static_cast<size_t>(l) * H + h;
      const int more = static_cast<int>(std::min<int64_t>(remaining, cap_extra - a.extra[i]));
      if (more <= 0) continue;
      a.extra[i] += more;
      a.split[i] = SplitByModality(a.extra[i], a.want[i].first, a.want[i].second, stats[i]);
      remaining -= more;
      added += more;
    }
    a.compensation[l] += static_cast<double>(added) / H;
  }
  return a;
}

Status MadaKVPolicy::Validate(const policy::MadaKVParams& p) {
  KVSIM_RETURN_IF_ERROR(Need(p.proxy_window() >= 1, "proxy_window must be >= 1"));
  KVSIM_RETURN_IF_ERROR(Need(p.theta() > 0 && p.theta() <= 1, "theta must be in (0, 1]"));
  return Need(p.kernel_size() >= 1 && p.kernel_size() % 2 == 1,
              "kernel_size must be odd and >= 1 (same-length pooling)");
}

std::unique_ptr<HeadPolicy> MadaKVPolicy::NewHeadPolicy(const HeadContext&) const {
  return std::make_unique<MadaKVHead>(params_);
}

std::unique_ptr<PolicyPlan> MadaKVPolicy::NewPlan(const TraceMeta& meta, int compress_len) const {
  auto plan = std::make_unique<MadaKVPlan>();
  plan->window = std::min(params_.proxy_window(), compress_len);
  plan->stats.resize(static_cast<size_t>(meta.model.num_layers) * meta.model.num_kv_heads);
  return plan;
}

void MadaKVPolicy::ObserveLayer(const LayerView& view, PolicyPlan* plan) const {
  auto* p = static_cast<MadaKVPlan*>(plan);
  const TraceMeta& meta = *view.meta;
  const int ce = view.compress_end, w = p->window, hkv = meta.model.num_kv_heads;
  ParallelFor(hkv, view.threads, [&](int u) {
    // ψ exactly as the head computes it at the prefill hook (Eq. 7), then Eqs. 6 and 9.
    const std::vector<float> psi =
        Psi(LayerGroupWindowColumnSums(view, u, w, params_.group_aggregation()), ce - w, params_);
    p->stats[static_cast<size_t>(view.layer) * hkv + u] = ComputeModalityStats(meta, psi, params_.theta());
  });
}

void MadaKVPolicy::FinishPlan(const TraceMeta& meta, PolicyPlan* plan) const {
  auto* p = static_cast<MadaKVPlan*>(plan);
  const int L = meta.model.num_layers, H = meta.model.num_kv_heads;
  auto& pref = p->head_stats["visual_preference"];  // w_v / (w_v + w_t)
  auto& kv = p->head_stats["k_visual"];
  auto& kt = p->head_stats["k_text"];
  for (const ModalityStats& s : p->stats) {
    pref.push_back(s.w_v + s.w_t > 0 ? s.w_v / (s.w_v + s.w_t) : 0);
    kv.push_back(s.k_v);
    kt.push_back(s.k_t);
  }
  for (const char* name : {"visual_preference", "k_visual", "k_text"}) {
    std::vector<double>& mean = p->layer_stats[std::string(name) + "_mean"];
    const std::vector<double>& v = p->head_stats[name];
    for (int l = 0; l < L; ++l)
      mean.push_back(std::accumulate(v.begin() + static_cast<size_t>(l) * H,
                                     v.begin() + static_cast<size_t>(l + 1) * H, 0.0) /
                     H);
  }
}

std::vector<int> MadaKVPolicy::PlannedHeadBudgets(const TraceMeta& meta, int budget, int compress_len,
                                                  const PolicyPlan& plan, std::span<const int>) const {
  const auto& p = static_cast<const MadaKVPlan&>(plan);
  const int L = meta.model.num_layers, H = meta.model.num_kv_heads;
  if (budget <= p.window)
    return std::vector<int>(static_cast<size_t>(L) * H, budget);  // only the window fits
  auto it = p.runs.find(budget);
  if (it == p.runs.end())
    it =
        p.runs
            .emplace(budget, AllocateMadaKV(p.stats, L, H, budget, p.window, compress_len, params_.combine()))
            .first;
  std::vector<int> out;
  for (int e : it->second.extra) out.push_back(p.window + e);
  return out;
}

std::map<std::string, std::vector<double>> MadaKVPolicy::PlannedLayerStats(const TraceMeta& meta, int budget,
                                                                           int,
                                                                           const PolicyPlan& plan) const {
  const auto& p = static_cast<const MadaKVPlan&>(plan);
  auto it = p.runs.find(budget);
  if (it == p.runs.end()) return {};
  return {{"allowance", it->second.allowance}, {"compensation", it->second.compensation}};
}

void RegisterMadaKVPolicy(PolicyRegistry* r) {
  r->Register(
      {"madakv",
       "modality preference per head + θ-mass sparsity + layer-to-layer budget compensation (Li et al. 2025)",
       "kvsim.policy.MadaKVParams"},
      TypedFactory<MadaKVPolicy, policy::MadaKVParams>());
}

}  // namespace kvsim
