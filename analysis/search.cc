#include "analysis/search.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>

#include "analysis/report.h"
#include "analysis/sweep.h"
#include "policies/registry.h"
#include "sim/version.h"
#include "traces/hdf5_trace.h"

namespace kvsim {

std::string SearchMetricField(const std::string& metric) {
  if (metric == "retained_mass") return "retained_mass_mean";
  if (metric == "output_error") return "output_rel_error_mean";
  if (metric == "regret") return "regret_vs_oracle_mean";
  return "";
}

Status CheckSearchSpec(const SearchSpec& spec) {
  if (SearchMetricField(spec.metric).empty())
    return Status::InvalidArgument("--metric '" + spec.metric +
                                   "': expected retained_mass, output_error or regret");
  const bool higher_better = spec.metric == "retained_mass";
  if (higher_better != spec.at_least)
    return Status::InvalidArgument(
        "--metric " + spec.metric + ": " +
        (higher_better ? "higher is better; give --at-least X" : "lower is better; give --at-most X"));
  if (!std::isfinite(spec.target) || spec.target < 0)
    return Status::InvalidArgument("the target of --metric " + spec.metric + " must be a finite number >= 0");
  if (spec.metric == "retained_mass" && spec.target > 1)
    return Status::InvalidArgument("--at-least " + FormatNumber(spec.target) +
                                   ": retained mass is at most 1; give a target in [0, 1], e.g. 0.9");
  if (spec.points_per_pass < 1)
    return Status::InvalidArgument("--points-per-pass must be >= 1 (budgets evaluated per policy per pass)");
  if (spec.policies.empty()) return Status::InvalidArgument("--policy: give at least one policy");
  return Status::Ok();
}

namespace {

double MetricValue(const Metrics& m, const std::string& metric) {
  if (metric == "retained_mass") return m.retained_mass_mean();
  if (metric == "output_error") return m.output_rel_error_mean();
  return m.regret_vs_oracle_mean();
}

struct PolicyState {
  std::shared_ptr<const Policy> policy;
  std::string label;
  bool uses_budget = true;
  std::map<int, SearchPoint> points;  // by budget
};

// The bracket of a policy's search: the smallest evaluated budget that meets the target (0 = none) and the
// largest evaluated budget below it that fails (0 = none).
std::pair<int, int> Bracket(const PolicyState& s) {
  int hi = 0, lo = 0;
  for (const auto& [b, p] : s.points)
    if (p.meets()) {
      hi = b;
      break;
    }
  for (const auto& [b, p] : s.points)
    if (!p.meets() && b < hi) lo = std::max(lo, b);
  return {lo, hi};
}

// The budgets a policy evaluates next (ascending); empty when its search is over.
std::vector<int> Candidates(const PolicyState& s, int ce, int k) {
  std::vector<int> out;
  auto add = [&](int b) {
    if (b >= 1 && b <= ce && !s.points.count(b) && std::find(out.begin(), out.end(), b) == out.end())
      out.push_back(b);
  };
  if (s.points.empty()) {
    add(ce);  // the whole prompt: whether the target is reachable at all
    if (s.uses_budget)
      for (int i = 1; i < k; ++i) add(static_cast<int>(std::lround(static_cast<double>(i) * ce / k)));
  } else if (s.uses_budget) {
    const auto [lo, hi] = Bracket(s);
    if (hi > 0 && hi - lo > 1)
      for (int i = 1; i <= k; ++i)
        add(lo + static_cast<int>(std::lround(static_cast<double>(i) * (hi - lo) / (k + 1))));
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

StatusOr<SearchResult> SearchBudgets(TraceSource& trace, const SearchSpec& spec,
                                     const std::string& trace_hash, Progress* progress) {
  KVSIM_RETURN_IF_ERROR(CheckSearchSpec(spec));
  const TraceMeta& meta = trace.meta();
  if (meta.is_streaming())
    return Status::InvalidArgument(
        "a streaming trace; kvsim search replays plain (prefill + decode) traces only (docs/streaming.md)");
  const int ce = CompressEnd(meta, spec.question_mode);
  std::vector<PolicyState> states;
  for (const std::string& entry : spec.policies) {
    std::istringstream is(entry);
    std::string name, set;
    is >> name;
    std::vector<std::string> sets;
    while (is >> set) sets.push_back(set);
    if (name.empty()) return Status::InvalidArgument("--policy: an empty policy name in the list");
    KVSIM_ASSIGN_OR_RETURN(auto policy, PolicyRegistry::Default().Create(name, sets));
    const PolicyInfo* info = PolicyRegistry::Default().Find(name);
    states.push_back(PolicyState{policy, RunLabel(name, sets), info == nullptr || info->uses_budget, {}});
  }
  SearchResult out;
  const int k = spec.points_per_pass;
  // Passes the bracket needs at most: the first pass cuts [1, ce] into k parts, each later one by k + 1.
  int expected = 1 + static_cast<int>(
                         std::ceil(std::log(std::max(2.0, ce / static_cast<double>(k))) / std::log(k + 1.0)));
  int pass = 0, total_runs = 0;
  for (;;) {
    std::vector<RunSpec> runs;
    std::vector<std::pair<size_t, int>> owner;  // (policy, budget) of each run
    for (size_t i = 0; i < states.size(); ++i)
      for (int b : Candidates(states[i], ce, k)) {
        runs.push_back(RunSpec{states[i].policy, states[i].label, 0, b, spec.question_mode});
        owner.emplace_back(i, b);
      }
    if (runs.empty()) break;
    ++pass;
    expected = std::max(expected, pass);
    if (progress) progress->SetOuter("pass", pass, expected);
    ReplayOptions ro;
    ro.threads = spec.threads;
    ro.progress = progress;
    ro.trace_hash = trace_hash;
    KVSIM_ASSIGN_OR_RETURN(auto results, Replay(trace, runs, ro));
    total_runs += static_cast<int>(runs.size());
    for (size_t r = 0; r < results.size(); ++r) {
      SearchPoint p;
      p.set_budget_tokens(owner[r].second);
      p.set_budget_fraction(static_cast<double>(owner[r].second) / ce);
      p.set_value(MetricValue(results[r].metrics(), spec.metric));
      p.set_meets(spec.at_least ? p.value() >= spec.target : p.value() <= spec.target);
      p.set_kv_memory_ratio(results[r].metrics().kv_memory_ratio());
      p.set_pass(pass);
      states[owner[r].first].points[owner[r].second] = p;
    }
  }
  const std::string field = SearchMetricField(spec.metric);
  const std::string target = (spec.at_least ? ">= " : "<= ") + FormatNumber(spec.target);
  for (size_t i = 0; i < states.size(); ++i) {
    const PolicyState& s = states[i];
    PolicySearch* ps = out.add_policies();
    ps->set_label(s.label);
    ps->set_policy(s.policy->name());
    ps->set_parameters(s.policy->ParamsText());
    for (const auto& [b, p] : s.points) *ps->add_points() = p;
    // Monotonicity over the evaluated points: a larger budget must not give a worse value.
    ps->set_monotone(true);
    const SearchPoint* best = nullptr;  // the best value at any smaller budget so far
    for (const auto& [b, p] : s.points) {
      if (best) {
        const double tol = 1e-9 * (1 + std::fabs(best->value()));
        const bool worse = spec.at_least ? p.value() < best->value() - tol : p.value() > best->value() + tol;
        if (worse) {
          ps->set_monotone(false);
          ps->add_non_monotone("B=" + std::to_string(best->budget_tokens()) + ": " +
                               FormatNumber(best->value()) + " but B=" + std::to_string(b) + ": " +
                               FormatNumber(p.value()));
        }
      }
      if (!best || (spec.at_least ? p.value() > best->value() : p.value() < best->value())) best = &p;
    }
    const SearchPoint& whole = s.points.at(ce);
    if (!s.uses_budget) {
      ps->set_reason(s.policy->name() + " ignores the budget (it keeps every token): " + field + " " +
                     FormatNumber(whole.value()) + (whole.meets() ? " meets " : " does not meet ") + target +
                     " at any budget");
      continue;
    }
    const auto [lo, hi] = Bracket(s);
    if (hi == 0) {
      ps->set_reason("even the whole prompt (B = " + std::to_string(ce) +
                     " tokens, nothing evicted from it) gives " + field + " " + FormatNumber(whole.value()) +
                     ", which does not meet " + target);
      continue;
    }
    const SearchPoint& p = s.points.at(hi);
    ps->set_found(true);
    ps->set_budget_tokens(hi);
    ps->set_budget_fraction(p.budget_fraction());
    ps->set_kv_memory_ratio(p.kv_memory_ratio());
    ps->set_value(p.value());
  }
  out.set_trace_path(trace.Describe());
  out.set_trace_hash(trace_hash);
  out.set_trace_model(meta.model.name);
  out.set_trace_source(meta.source);
  out.set_metric(spec.metric);
  out.set_metric_field(field);
  out.set_comparison(spec.at_least ? "at_least" : "at_most");
  out.set_target(spec.target);
  out.set_question_mode(QuestionModeName(spec.question_mode));
  out.set_compressed_prompt_tokens(ce);
  out.set_points_per_pass(k);
  out.set_passes(pass);
  out.set_runs(total_runs);
  out.set_kvsim_version(kVersion);
  out.set_git_commit(kGitCommit);
  return out;
}

StatusOr<SearchResult> RunSearch(const std::string& trace_path, const SearchSpec& spec, bool progress) {
  KVSIM_RETURN_IF_ERROR(CheckSearchSpec(spec));
  KVSIM_ASSIGN_OR_RETURN(auto trace, OpenTrace(trace_path));
  Progress reporter = Progress::FromEnv("search", progress);
  // Hashed beside the first pass's replay when that pays (HashConcurrently); only the result records it.
  SearchResult result;
  KVSIM_ASSIGN_OR_RETURN(std::string hash,
                         HashBesideReplay(trace_path, spec.threads, [&](const std::string& h) {
                           auto searched = SearchBudgets(*trace, spec, h, &reporter);
                           if (!searched.ok()) return searched.status().WithContext(trace_path);
                           result = std::move(*searched);
                           return Status::Ok();
                         }));
  result.set_trace_hash(hash);
  reporter.Finish();
  return result;
}

}  // namespace kvsim
