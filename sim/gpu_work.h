#pragma once
// What a KV-cache policy computes on the GPU besides attention (Policy::gpu_work); the latency model
// charges it at the event where it runs (sim/perf_model.h, docs/latency.md).

namespace kvsim {

struct PolicyGpuWork {
  int window = 0;                 // observation-window scoring: window queries x prompt keys per head
  bool all_query_scores = false;  // scores from every prompt query (column sums, per-query statistics)
  bool decode_scores = false;     // each decode step writes the step's attention weights and picks a victim
  bool merge = false;             // evicted keys merged into their nearest kept slot
};

}  // namespace kvsim
