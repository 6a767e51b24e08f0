#pragma once
// `kvsim validate`: reads every layer (shapes, dtypes, NaN/Inf, metadata consistency) and, where the trace
// records attention aggregates, recomputes them from Q and K and reports the deviation.

#include <cstdint>
#include <string>

#include "sim/trace.h"

namespace kvsim {

struct ValidationReport {
  int layers_checked = 0;
  bool aggregates_present = false;
  bool aggregates_checked = false;  // needs the queries of every prompt token
  double max_abs_deviation = 0;     // max |recorded - recomputed| over layers, heads, keys
  // max |recorded - recomputed| / max(recomputed, 1): absolute for sums below 1 (probability scale),
  // relative above (a sink key's sum over thousands of queries carries thousands of rounding errors). This
  // is what --tolerance bounds.
  double max_rel_deviation = 0;
  int worst_layer = -1, worst_head = -1, worst_key = -1;  // where max_rel_deviation is
  // Decode attention rows recorded by the capture tool (extension), vs recomputed from the decode queries.
  TraceIntegrity integrity;  // the file's checksums (docs/trace-format.md, "Integrity")
  bool decode_rows_present = false;
  int decode_rows_layers = 0;
  double decode_max_abs_deviation = 0;
  int decode_worst_layer = -1, decode_worst_head = -1, decode_worst_step = -1, decode_worst_key = -1;
  // Recorded prompt entropies (aggregates/layer_XXX/prompt_entropies) vs recomputed with
  // HeadPromptEntropies from the stored Q/K (needs every prompt query): values that differ in any bit, and
  // the largest absolute difference (nats) and where it is.
  bool entropies_present = false;
  bool entropies_checked = false;
  int64_t entropies_compared = 0, entropies_differing = 0;
  double entropy_max_abs_deviation = 0;
  int entropy_worst_layer = -1, entropy_worst_region = -1, entropy_worst_kind = -1, entropy_worst_head = -1;
  // Whether anything checked exceeds the tolerance.
  bool Mismatch(double tolerance) const {
    return (aggregates_checked && max_rel_deviation > tolerance) ||
           (decode_rows_present && decode_max_abs_deviation > tolerance) ||
           (entropies_checked && entropy_max_abs_deviation > tolerance);
  }
  std::string Text(const TraceMeta& meta, double tolerance) const;
};

// Structural errors come back as a non-ok Status (the first problem found).
StatusOr<ValidationReport> ValidateTrace(TraceSource& trace, int threads);

}  // namespace kvsim
