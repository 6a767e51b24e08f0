#pragma once
// `kvsim search`: the smallest budget per policy that meets a quality target on one trace, by a k-ary
// bisection whose passes are multi-run replays (docs/cli.md "kvsim search"). Each pass replays every
// policy's candidate budgets together, so the trace is read and the full-attention reference computed once
// per pass for all of them; the bracket [largest failing, smallest meeting] shrinks by a factor of
// points_per_pass + 1 per pass. Assumes the metric improves with the budget and reports when the evaluated
// points say otherwise.

#include <string>
#include <vector>

#include "analysis/search.pb.h"
#include "sim/progress.h"
#include "sim/replay.h"

namespace kvsim {

struct SearchSpec {
  std::vector<std::string>
      policies;  // "snapkv" or "snapkv window=16 pooling=MAX_POOL" (name, then overrides)
  std::string metric = "retained_mass";  // retained_mass | output_error | regret
  bool at_least = true;                  // retained_mass: --at-least; output_error, regret: --at-most
  double target = 0;
  int points_per_pass = 4;
  QuestionMode question_mode = QuestionMode::kQueryAware;
  int threads = 0;
};

// Checks the metric, its direction and the target; the message names the flag and the fix.
Status CheckSearchSpec(const SearchSpec& spec);

// The search over an open trace; `trace_hash` is recorded; `progress` (optional) sees every pass.
StatusOr<SearchResult> SearchBudgets(TraceSource& trace, const SearchSpec& spec,
                                     const std::string& trace_hash, Progress* progress);

// Opens the trace and searches (progress on stderr unless `progress` is false).
StatusOr<SearchResult> RunSearch(const std::string& trace_path, const SearchSpec& spec, bool progress);

// The Metrics field a search metric compares ("retained_mass" -> retained_mass_mean); empty if unknown.
std::string SearchMetricField(const std::string& metric);

}  // namespace kvsim
