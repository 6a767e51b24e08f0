#pragma once
// `kvsim verify hae`: measures on a trace what HAE's theory claims (App. A.2) and says where it holds:
//   Theorem 2.1  fit of an exponential decay of the attention a prompt token receives per decode step
//                (λ, fit quality), Attn_max and the bound k <= log(ε/Attn_max)/log(1−λ) for DAP's evicted
//                set, against the measured attention mass those tokens would have received;
//   Corollary 2.1  for every DDES flush (bin of d tokens), its eviction loss against per-step greedy
//                eviction (H2O-style) over the same steps and against the d lowest scores;
//   App. A.1     sparsity rate (entries <= ε) of decode attention per layer and key modality.
// Definitions and how to read the verdicts: docs/verify-hae.md.

#include <span>
#include <string>
#include <vector>

#include "analysis/verify_hae.pb.h"
#include "sim/progress.h"
#include "sim/trace.h"

namespace kvsim {

struct VerifyHaeOptions {
  double r = 0.0012;  // DAP thresholds (HAE Table 5, LLaVA-1.5-7B)
  double alpha = 0.001;
  int dap_layer = 0;
  int rc_size = 64;            // DDES bin d
  double epsilon = 0.01;       // Theorem 2.1's ε
  double min_r_squared = 0.5;  // below: the trace is not exponential and the theorem does not apply
  double sparsity_epsilon = 1e-4;
  int threads = 0;
  std::string trace_hash;        // recorded in the report
  Progress* progress = nullptr;  // optional: told after every layer (sim/progress.h)
};

// Within-token least squares of log s(j, t) on t over series (one per token, equal lengths, every value
// > 0); accumulates so layers can be pooled.
class DecayFitter {
 public:
  void Add(std::span<const double> series);
  void Merge(const DecayFitter& other);
  DecayFit Fit(int layer) const;

 private:
  double sxx_ = 0, sxy_ = 0, syy_ = 0;
  int64_t tokens_ = 0;
};

// One flush of the DDES-vs-greedy simulation over `rows` ([steps][num_keys], the attention of each decode
// step over keys; the cache starts with tokens [0, n) and both caches see the same scores β_j = Σ_t rows).
struct FlushOutcome {
  int step = 0;
  double ddes = 0, greedy = 0, d_lowest = 0;
  double ddes_future = 0, greedy_future = 0;  // attention received after eviction (later rows)
};
std::vector<FlushOutcome> SimulateDdesVsGreedy(std::span<const float> rows, int steps, int num_keys, int n,
                                               int d);

StatusOr<HaeVerifyReport> VerifyHae(TraceSource& trace, const VerifyHaeOptions& options);

// The human-readable summary (markdown).
std::string HaeVerifyMarkdown(const HaeVerifyReport& report);

}  // namespace kvsim
