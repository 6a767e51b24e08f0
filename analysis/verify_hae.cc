#include "analysis/verify_hae.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <numeric>
#include <sstream>

#include "policies/hae.h"
#include "policies/pieces.h"
#include "sim/attention.h"
#include "sim/parallel.h"
#include "sim/version.h"

namespace kvsim {

void DecayFitter::Add(std::span<const double> series) {
  const int s = static_cast<int>(series.size());
  if (s < 2) return;
  const double tbar = (s - 1) / 2.0;
  double ybar = 0;
  for (double v : series) ybar += std::log(v);
  ybar /= s;
  for (int t = 0; t < s; ++t) {
    const double x = t - tbar, y = std::log(series[t]) - ybar;
    sxx_ += x * x;
    sxy_ += x * y;
    syy_ += y * y;
  }
  ++tokens_;
}

void DecayFitter::Merge(const DecayFitter& o) {
  sxx_ += o.sxx_;
  sxy_ += o.sxy_;
  syy_ += o.syy_;
  tokens_ += o.tokens_;
}

DecayFit DecayFitter::Fit(int layer) const {
  DecayFit f;
  f.set_layer(layer);
  f.set_tokens(tokens_);
  if (sxx_ <= 0) return f;
  const double slope = sxy_ / sxx_;
  f.set_lambda(1 - std::exp(slope));
  f.set_r_squared(syy_ > 0 ? sxy_ * sxy_ / (sxx_ * syy_) : 1.0);
  return f;
}

std::vector<FlushOutcome> SimulateDdesVsGreedy(std::span<const float> rows, int steps, int num_keys, int n,
                                               int d) {
  std::vector<double> beta(num_keys, 0.0);
  // future[t][j] = Σ_{t' > t} rows[t'][j]: what token j would still receive after step t.
  std::vector<double> future(static_cast<size_t>(steps) * num_keys, 0.0);
  for (int t = steps - 2; t >= 0; --t)
    for (int j = 0; j < num_keys; ++j)
      future[static_cast<size_t>(t) * num_keys + j] =
          future[static_cast<size_t>(t + 1) * num_keys + j] + rows[static_cast<size_t>(t + 1) * num_keys + j];
  double greedy_future_since_flush = 0;
  int step_now = 0;
  std::vector<int32_t> removed;
  std::vector<int32_t> ddes(n), greedy(n);
  std::iota(ddes.begin(), ddes.end(), 0);
  std::iota(greedy.begin(), greedy.end(), 0);
  const size_t l = n;
  std::vector<FlushOutcome> out;
  double greedy_since_flush = 0;
  auto lowest = [&](std::vector<int32_t>& cache, size_t count) {  // removes and returns Σβ of the lowest
    if (count == 1) {  // per-step greedy: one linear scan (ties: the earlier slot)
      size_t best = 0;
      for (size_t i = 1; i < cache.size(); ++i)
        if (beta[cache[i]] < beta[cache[best]]) best = i;
      removed.assign(1, cache[best]);
      const double loss = beta[cache[best]];
      cache.erase(cache.begin() + static_cast<std::ptrdiff_t>(best));
      return loss;
    }
    std::vector<size_t> idx(cache.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(),
                     [&](size_t a, size_t b) { return beta[cache[a]] < beta[cache[b]]; });
    double loss = 0;
    std::vector<char> drop(cache.size(), 0);
    removed.clear();
    for (size_t i = 0; i < count && i < idx.size(); ++i) {
      loss += beta[cache[idx[i]]];
      drop[idx[i]] = 1;
      removed.push_back(cache[idx[i]]);
    }
    size_t w = 0;
    for (size_t r = 0; r < cache.size(); ++r)
      if (!drop[r]) cache[w++] = cache[r];
    cache.resize(w);
    return loss;
  };
  auto future_of_removed = [&]() {
    double f = 0;
    for (int32_t j : removed) f += future[static_cast<size_t>(step_now) * num_keys + j];
    return f;
  };
  for (int t = 0; t < steps; ++t) {
    step_now = t;
    const int32_t tok = n + t;
    ddes.push_back(tok);
    greedy.push_back(tok);
    const float* row = rows.data() + static_cast<size_t>(t) * num_keys;
    for (int j = 0; j <= tok && j < num_keys; ++j) beta[j] += row[j];  // Eq. 5: the step's attention
    if (greedy.size() > l) {
      greedy_since_flush += lowest(greedy, greedy.size() - l);
      greedy_future_since_flush += future_of_removed();
    }
    if (ddes.size() >= l + d) {
      FlushOutcome f;
      f.step = t;
      std::vector<int32_t> probe = ddes;
      f.d_lowest = lowest(probe, d);
      f.ddes = lowest(ddes, ddes.size() - l);
      f.ddes_future = future_of_removed();
      f.greedy = greedy_since_flush;
      f.greedy_future = greedy_future_since_flush;
      greedy_since_flush = greedy_future_since_flush = 0;
      out.push_back(f);
    }
  }
  return out;
}

namespace {

// Per KV head contributions of one layer.
struct HeadPart {
  std::vector<float> mean_rows;  // [S][n] Σ over the group's query heads of p_t(j), j < n
  std::vector<double> lost;      // [group][S] Σ_{j in E} p_t(j)
  double sparse[4] = {0, 0, 0, 0}, entries[4] = {0, 0, 0, 0};
  std::vector<FlushOutcome> flushes;
};

}  // namespace

StatusOr<HaeVerifyReport> VerifyHae(TraceSource& trace, const VerifyHaeOptions& o) {
  const TraceMeta& meta = trace.meta();
  const ModelInfo& m = meta.model;
  const int L = m.num_layers, H = m.num_heads, hkv = m.num_kv_heads, G = m.GroupSize();
  const int n = meta.prefill_length, S = meta.num_decode_steps, t_all = meta.total_tokens(), d = m.head_dim;
  if (S < 2)
    return Status::FailedPrecondition(trace.Describe() +
                                      ": verify hae needs >= 2 decode steps to fit a decay; "
                                      "capture or synthesize more");
  if (!meta.HasAllPromptQueries())
    return Status::FailedPrecondition(trace.Describe() +
                                      ": verify hae scores DAP from the text queries of the prompt, but the "
                                      "trace stores only the last " +
                                      std::to_string(meta.query_positions.size() - S) +
                                      " prompt queries; capture (or synthesize) with all prompt queries");
  if (o.rc_size < 1) return Status::InvalidArgument("--rc-size must be >= 1");
  auto finite = [](double v) { return std::isfinite(v); };
  if (!(o.epsilon > 0) || !finite(o.epsilon))
    return Status::InvalidArgument("--epsilon must be a finite number > 0");
  if (!(o.r >= 0) || !finite(o.r)) return Status::InvalidArgument("--r must be a finite number >= 0");
  if (!(o.alpha >= 0) || !finite(o.alpha))
    return Status::InvalidArgument("--alpha must be a finite number >= 0");
  if (!(o.min_r_squared >= 0 && o.min_r_squared <= 1))
    return Status::InvalidArgument("--min-r2 must be in [0, 1]");
  if (!(o.sparsity_epsilon >= 0) || !finite(o.sparsity_epsilon))
    return Status::InvalidArgument("--sparsity-epsilon must be a finite number >= 0");
  if (o.dap_layer < 0 || o.dap_layer >= L)
    return Status::InvalidArgument("--dap-layer " + std::to_string(o.dap_layer) +
                                   ": the trace has layers 0.." + std::to_string(L - 1));
  HaeVerifyReport rep;
  rep.set_trace_path(trace.Describe());
  rep.set_trace_hash(o.trace_hash);
  rep.set_kvsim_version(kVersion);
  rep.set_git_commit(kGitCommit);
  rep.set_r(o.r);
  rep.set_alpha(o.alpha);
  const int dap_layer = o.dap_layer;
  rep.set_dap_layer(dap_layer);
  rep.set_sparsity_epsilon(o.sparsity_epsilon);

  // DAP's evicted set at the thresholds (the paper's mode), from the DAP layer.
  LayerData layer;
  KVSIM_RETURN_IF_ERROR(trace.ReadLayer(dap_layer, &layer));
  const DapScores dap = ComputeDapScores(LayerView{&meta, &layer, dap_layer, n, o.threads});
  policy::HAEParams hp;
  hp.set_r(o.r);
  hp.set_alpha(o.alpha);
  hp.set_mode(policy::HAEParams::THRESHOLD);
  const std::vector<int32_t> evicted = DapEvictions(meta, dap, n, hp, 0);
  double attn_max = evicted.empty() ? 0 : 1e300;
  for (int32_t j : evicted) attn_max = std::min(attn_max, dap.peak[j]);

  DecayFitter pooled;
  double lost_sum = 0, lost_max = 0;
  int64_t lost_n = 0;
  std::vector<double> lost_step(S, 0.0);  // Σ over layers and query heads, per decode step
  Corollary21* cor = rep.mutable_corollary();
  cor->set_rc_size(o.rc_size);
  std::vector<std::pair<double, FlushCase>> cases;
  for (int l = 0; l < L; ++l) {
    KVSIM_RETURN_IF_ERROR(trace.ReadLayer(l, &layer));
    std::vector<HeadPart> parts(hkv);
    ParallelFor(hkv, o.threads, [&](int u) {
      HeadPart& part = parts[u];
      part.mean_rows.assign(static_cast<size_t>(S) * n, 0.0f);
      part.lost.assign(static_cast<size_t>(G) * S, 0.0);
      std::vector<float> group_rows(static_cast<size_t>(S) * t_all, 0.0f);
      const size_t kv = static_cast<size_t>(u) * t_all * d;
      const int qi = meta.QueryIndex(n);
      for (int g = 0; g < G; ++g) {
        const int qh = u * G + g;
        const float* q =
            layer.queries.data() + (static_cast<size_t>(qh) * meta.query_positions.size() + qi) * d;
        DecodeReference ref;
        ComputeDecodeReference(m, n, S, q, layer.keys.data() + kv, layer.values.data() + kv, &ref);
        for (int t = 0; t < S; ++t) {
          const float* row = ref.row(t);
          for (int j = 0; j < n; ++j) part.mean_rows[static_cast<size_t>(t) * n + j] += row[j];
          double lost = 0;
          for (int32_t j : evicted) lost += row[j];
          part.lost[static_cast<size_t>(g) * S + t] = lost;
          for (int j = ref.first[t]; j <= ref.last(t); ++j) {
            const int mo = static_cast<int>(meta.tokens.modality[j]);
            part.entries[mo] += 1;
            part.sparse[mo] += row[j] <= o.sparsity_epsilon;
          }
          float* gr = &group_rows[static_cast<size_t>(t) * t_all];
          for (int j = 0; j < t_all; ++j) gr[j] += row[j] / G;
        }
      }
      part.flushes = SimulateDdesVsGreedy(group_rows, S, t_all, n, o.rc_size);
    });
    // Decay fit of this layer: head-mean attention each prompt token receives, per decode step.
    DecayFitter fit;
    std::vector<double> series(S);
    for (int j = 0; j < n; ++j) {
      bool positive = true;
      for (int t = 0; t < S && positive; ++t) {
        double s = 0;
        for (int u = 0; u < hkv; ++u) s += parts[u].mean_rows[static_cast<size_t>(t) * n + j];
        series[t] = s / H;
        positive = series[t] > 1e-30;
      }
      if (positive) fit.Add(series);
    }
    *rep.mutable_theorem()->add_per_layer() = fit.Fit(l);
    pooled.Merge(fit);
    SparsityRow* sp = rep.add_sparsity();
    sp->set_layer(l);
    double sparse[4] = {0, 0, 0, 0}, entries[4] = {0, 0, 0, 0};
    for (int u = 0; u < hkv; ++u) {
      for (int mo = 0; mo < 4; ++mo) sparse[mo] += parts[u].sparse[mo], entries[mo] += parts[u].entries[mo];
      for (size_t i = 0; i < parts[u].lost.size(); ++i) {
        const double v = parts[u].lost[i];
        lost_sum += v;
        lost_max = std::max(lost_max, v);
        lost_step[i % S] += v;
        ++lost_n;
      }
      for (const FlushOutcome& f : parts[u].flushes) {
        cor->set_flushes(cor->flushes() + 1);
        const double excess = f.ddes - f.greedy;
        if (excess <= 1e-6 * (1 + std::fabs(f.greedy)))
          cor->set_holds(cor->holds() + 1);
        else
          cor->set_violations(cor->violations() + 1);
        FlushCase c;
        c.set_layer(l);
        c.set_kv_head(u);
        c.set_step(f.step);
        c.set_ddes_loss(f.ddes);
        c.set_greedy_loss(f.greedy);
        c.set_d_lowest(f.d_lowest);
        c.set_ddes_future(f.ddes_future);
        c.set_greedy_future(f.greedy_future);
        if (f.ddes_future <= f.greedy_future + 1e-6 * (1 + f.greedy_future))
          cor->set_future_holds(cor->future_holds() + 1);
        cases.emplace_back(excess, c);
      }
    }
    auto frac = [&](int mo) { return entries[mo] > 0 ? sparse[mo] / entries[mo] : 0.0; };
    sp->set_text(frac(0));
    sp->set_image(frac(1));
    sp->set_video(frac(2));
    sp->set_other(frac(3));
    const double all_e = entries[0] + entries[1] + entries[2] + entries[3];
    sp->set_all(all_e > 0 ? (sparse[0] + sparse[1] + sparse[2] + sparse[3]) / all_e : 0);
    if (o.progress) o.progress->Update("layer", l + 1, L);
  }
  // Corollary: the worst cases (largest excess first; ties by position for determinism).
  std::stable_sort(cases.begin(), cases.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  cor->set_max_excess(cases.empty() ? 0 : cases.front().first);
  for (size_t i = 0; i < cases.size() && i < 5; ++i) *cor->add_worst() = cases[i].second;

  // Theorem 2.1.
  Theorem21* th = rep.mutable_theorem();
  th->set_epsilon(o.epsilon);
  *th->mutable_fit() = pooled.Fit(-1);
  const double lambda = th->fit().lambda();
  th->set_evicted(static_cast<int>(evicted.size()));
  th->set_attn_max(attn_max);
  th->set_loss_mean(lost_n ? lost_sum / lost_n : 0);
  th->set_loss_max(lost_max);
  double total = 0;
  for (int t = 0; t < S; ++t) {
    const double measured = lost_step[t] / (static_cast<double>(L) * H);
    th->add_measured_per_step(measured);
    total += measured;
  }
  th->set_total_loss(total);
  th->set_total_below_epsilon(total < o.epsilon);
  if (evicted.empty()) {
    th->set_verdict("not applicable");
    th->set_reason("DAP evicts nothing at r = " + std::to_string(o.r) +
                   ", alpha = " + std::to_string(o.alpha));
  } else if (!(lambda > 0 && lambda < 1)) {
    th->set_verdict("not applicable");
    th->set_reason("attention received does not decay with age on this trace (fitted lambda " +
                   std::to_string(lambda) + ")");
  } else {
    const bool exponential = th->fit().r_squared() >= o.min_r_squared;
    // The theorem's k: log(ε / Attn_max) / log(1 − λ) (premise k <= bound, as stated; see docs).
    const double k = std::log(o.epsilon / attn_max) / std::log(1 - lambda);
    th->set_k_bound(k);
    th->set_premise(static_cast<double>(evicted.size()) <= k);
    double peak_sum = 0;
    for (int32_t j : evicted) peak_sum += dap.peak[j];
    int violated = 0, worst = -1;
    double worst_excess = 0;
    for (int t = 0; t < S; ++t) {
      const double predicted = peak_sum * std::pow(1 - lambda, t);
      th->add_predicted_per_step(predicted);
      const double excess = th->measured_per_step(t) - predicted;
      if (excess > 1e-9 + 1e-6 * predicted) {
        ++violated;
        if (excess > worst_excess) worst_excess = excess, worst = t;
      }
    }
    th->set_steps_violated(violated);
    if (!exponential) {
      th->set_verdict("not applicable");
      th->set_reason("the attention prompt tokens receive does not decay exponentially on this trace (R² " +
                     std::to_string(th->fit().r_squared()) + " < " + std::to_string(o.min_r_squared) +
                     "); the bound check below is informational (" + std::to_string(violated) + " of " +
                     std::to_string(S) + " steps exceed it)");
    } else if (violated == 0) {
      th->set_verdict("holds");
      th->set_reason(
          "at every decode step the evicted tokens' measured attention mass stays under the "
          "exponential-decay "
          "bound Σ peak_j (1 − λ)^t");
    } else {
      th->set_verdict("violated");
      th->set_reason(
          "at " + std::to_string(violated) + " of " + std::to_string(S) +
          " decode steps the evicted tokens receive more than the exponential-decay bound (worst: step " +
          std::to_string(worst) + ", excess " + std::to_string(worst_excess) + ")");
    }
  }
  return rep;
}

std::string HaeVerifyMarkdown(const HaeVerifyReport& r) {
  std::ostringstream os;
  os << std::setprecision(4);
  const Theorem21& th = r.theorem();
  const Corollary21& c = r.corollary();
  os << "# HAE theory on `" << r.trace_path() << "`\n\n"
     << "DAP at layer " << r.dap_layer() << " with r = " << r.r() << ", alpha = " << r.alpha()
     << "; DDES bin d = " << c.rc_size() << ". Definitions: docs/verify-hae.md.\n\n"
     << "## Theorem 2.1 (bounded loss of DAP's evictions): **" << th.verdict() << "**\n\n"
     << th.reason() << ".\n\n"
     << "| quantity | value |\n|---|---:|\n"
     << "| fitted decay λ (pooled) | " << th.fit().lambda() << " |\n"
     << "| fit quality R² (1 = exactly exponential) | " << th.fit().r_squared() << " |\n"
     << "| evicted tokens \\|E\\| | " << th.evicted() << " |\n"
     << "| Attn_max | " << th.attn_max() << " |\n"
     << "| bound log(ε/Attn_max)/log(1−λ) | " << th.k_bound() << " |\n"
     << "| ε | " << th.epsilon() << " |\n"
     << "| premise \\|E\\| <= bound (as stated) | " << (th.premise() ? "true" : "false") << " |\n"
     << "| measured loss per step, mean / max over samples | " << th.loss_mean() << " / " << th.loss_max()
     << " |\n"
     << "| total loss Σ_t (mean over layers, heads) | " << th.total_loss()
     << (th.total_below_epsilon() ? " < ε" : " >= ε") << " |\n"
     << "| steps where the measured loss exceeds Σ peak_j (1−λ)^t | " << th.steps_violated() << " |\n\n";
  if (th.fit().r_squared() < 0.5)
    os << "The trace does not look exponential (R² < 0.5): the theorem's assumption fails here.\n\n";
  os << "## Corollary 2.1 (DDES loss <= greedy loss): " << c.holds() << " of " << c.flushes()
     << " flushes hold, " << c.violations() << " violations\n\n"
     << "Loss = Σ of the evicted tokens' cumulative scores β at eviction (the corollary's terms). Measured "
        "by "
        "what the model loses instead — the attention the evicted tokens receive after their eviction — DDES "
        "loses no more than greedy in "
     << c.future_holds() << " of " << c.flushes() << " flushes.\n\n";
  if (c.worst_size() > 0) {
    os << "| layer | KV head | step | DDES loss | greedy loss | Σ d lowest | DDES future | greedy future |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for (const FlushCase& f : c.worst())
      os << "| " << f.layer() << " | " << f.kv_head() << " | " << f.step() << " | " << f.ddes_loss() << " | "
         << f.greedy_loss() << " | " << f.d_lowest() << " | " << f.ddes_future() << " | " << f.greedy_future()
         << " |\n";
    os << "\n(worst cases first: the largest DDES − greedy)\n\n";
  }
  os << "## Sparsity rate (App. A.1): decode attention entries <= " << r.sparsity_epsilon() << "\n\n"
     << "| layer | text | image | video | all |\n|---:|---:|---:|---:|---:|\n";
  for (const SparsityRow& s : r.sparsity())
    os << "| " << s.layer() << " | " << s.text() << " | " << s.image() << " | " << s.video() << " | "
       << s.all() << " |\n";
  return os.str();
}

}  // namespace kvsim
