#pragma once
// `kvsim latency`: the device performance model's numbers for one shape (sim/perf_model.h,
// docs/latency.md), also used by the calibration bench (bench/latency_anchors.cc).

#include <string>

#include "sim/device.pb.h"
#include "sim/status.h"

namespace kvsim {

struct LatencyQuery {
  std::string device;  // name or profile file
  std::string model;   // preset or shape file; empty: heads / kv_heads / head_dim
  int heads = 0, kv_heads = 0, head_dim = 0;
  int kv_length = 0;
  int batch = 1;
  int prompt_tokens = 0;  // 0: no prefill estimate
  double hbm_gbps = 0;    // > 0: overrides the profile's peak bandwidth (e.g. a power-limited card)
};

// Checks the query (one-line errors naming the option) and the memory it needs against the device's.
StatusOr<LatencyReport> ComputeLatencyReport(const LatencyQuery& q);
// Plain-text form of a report.
std::string LatencyReportText(const LatencyReport& r);

}  // namespace kvsim
