#pragma once
// Host-side pieces of the GPU replay harness that need no GPU (and are tested on the CPU): timing summaries,
// the latency-model fit written for `kvsim run/sweep --latency-model`, NVML readings through dlopen, and the
// physical lower bound of a decode step.

#include <span>
#include <string>
#include <vector>

#include "sim/latency_model.pb.h"
#include "sim/status.h"

namespace kvsim::gpu_replay {

struct TimingSummary {
  double median = 0, p10 = 0, p90 = 0, mean = 0, min = 0;
  int samples = 0;
};
// Quantiles by nearest rank (index round(q * (n - 1)) of the sorted samples).
TimingSummary Summarize(std::vector<double> samples);

// One measured point: x = mean per-head KV cache length (decode) or prompt tokens (prefill), y =
// microseconds.
struct LatencyPoint {
  double x = 0;
  double us = 0;
};
// Least-squares line y = a + b x, constrained to a, b >= 0 (what LoadLatencyModel accepts): if the free fit
// has b < 0, b = 0 and a = mean(y); if a < 0, the line goes through the origin. Needs >= 2 points with
// distinct x for the decode fit; `prefill` may be empty (prefill fields stay 0 and the description says so).
StatusOr<LatencyModelProto> FitLatencyModel(std::span<const LatencyPoint> decode,
                                            std::span<const LatencyPoint> prefill,
                                            const std::string& fitted_on);
// Text format, loadable by LoadLatencyModel (sim/latency_model.h).
std::string LatencyModelText(const LatencyModelProto& model);

// Clocks and power of one GPU via NVML, loaded with dlopen("libnvidia-ml.so.1") at run time (not linked).
struct NvmlReading {
  bool ok = false;
  std::string why;  // when !ok
  unsigned sm_clock_mhz = 0, mem_clock_mhz = 0, max_sm_clock_mhz = 0;
  double power_w = 0;
  unsigned temperature_c = 0;
};
NvmlReading ReadNvml(int device_index);

// Lower bound of one decode step: every weight and kept KV byte read once at the measured bandwidth
// (kvsim_replay_gpu passes the read-only kernel's, TimeRead).
double LowerBoundUs(double bytes, double gb_per_s);

}  // namespace kvsim::gpu_replay
