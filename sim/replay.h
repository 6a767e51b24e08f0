#pragma once
// The replay engine: runs many (policy, budget) configurations over one trace in a single streamed pass.
// For every layer it reads the layer's tensors once, computes the full-attention reference once (shared by
// every configuration), and runs the request's events — prefill, compression hook, decode steps — on a
// discrete-event queue in token-step time. After the last layer, the latency model turns the per-step cache
// sizes into simulated time, and metrics are aggregated (docs/metrics.md).

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sim/latency_model.h"
#include "sim/policy.h"
#include "sim/results.pb.h"
#include "sim/trace.h"

namespace kvsim {

enum class QuestionMode { kQueryAware, kQueryAgnostic };
const char* QuestionModeName(QuestionMode m);  // "query_aware" | "query_agnostic"

struct RunSpec {
  std::shared_ptr<const Policy> policy;
  std::string label;           // default: policy name
  double budget_fraction = 0;  // B = round(fraction * compressible prompt length), >= 1
  int budget_tokens = 0;       // used when budget_fraction == 0
  QuestionMode question_mode = QuestionMode::kQueryAware;
};

struct ReplayOptions {
  int threads = 0;                        // <= 0: hardware concurrency; results never depend on it
  const LatencyModel* latency = nullptr;  // null: token steps
  bool progress = false;                  // progress bar on stderr
  std::string trace_hash;                 // recorded in results
  // Prefill in chunks of this many tokens (0 = the whole prompt at once). Chunks are timeline events: each
  // lasts LatencyModel::PrefillDuration(chunk) and holds its uncompressed prefix; the compression hook runs
  // at the end of the last chunk.
  int prefill_chunk = 0;
};

// Start of the compressible region for a question mode: n (aware) or the first question token (agnostic).
int CompressEnd(const TraceMeta& meta, QuestionMode mode);

// Checks that every run can be replayed on this trace (budgets, required queries/aggregates) before any
// work starts. The message names the run, the requirement and the fix.
Status CheckRuns(const TraceMeta& meta, std::span<const RunSpec> runs);

// Replays all runs; one RunResult per run, in order.
StatusOr<std::vector<RunResult>> Replay(TraceSource& trace, std::span<const RunSpec> runs,
                                        const ReplayOptions& options);

}  // namespace kvsim
