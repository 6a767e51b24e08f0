#pragma once
// Host API of the CUDA kernels (gpu_replay/*.cu). No CUDA headers: callers build everywhere. Built without
// CUDA (or in the sanitizer build), every call reports that no device is available (gpu_stub.cc).
// Every function returns FailedPrecondition("no CUDA device: ...") when there is no usable GPU.

#include <string>
#include <vector>

#include "gpu_replay/harness.h"
#include "gpu_replay/kernels.h"

namespace kvsim::gpu_replay {

struct DeviceInfo {
  bool available = false;
  std::string reason;  // why not, when !available ("no CUDA device: ...")
  bool built_with_cuda = false;
  std::string name;
  int device = 0;
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;
  double total_mem_gib = 0;
  int l2_bytes = 0;
  int mem_clock_khz = 0, mem_bus_bits = 0;
  double peak_gb_per_s() const { return 2.0 * mem_clock_khz * 1e3 * (mem_bus_bits / 8) / 1e9; }
};
DeviceInfo QueryDevice(int device = 0);

// ---- Correctness entry points: upload, run once, download (tests compare with the CPU reference) ----
Status GpuDecodeAttention(const AttentionProblem& p, const SplitKvPartition& part, std::vector<float>* out);
Status GpuWindowScores(const WindowScoreProblem& p, std::vector<float>* scores);
Status GpuTopKCompact(const TopKProblem& p, TopKResult* out);
Status GpuMergeNearest(const MergeProblem& p, MergeResult* out);
// Runs the step once directly and once through its CUDA graph; returns the graph's logits (the direct
// run's must be identical, checked inside).
Status GpuDecoderStep(const DecoderProblem& p, std::vector<float>* logits);

// ---- Timing (CUDA events; each sample after an L2 flush unless flush_l2 = false) ----
struct TimingOptions {
  int warmup = 5;
  int repeats = 50;
  bool flush_l2 = true;
};
// Device-to-device copy bandwidth (read + write bytes / time) of a vectorised copy kernel over `bytes`.
StatusOr<TimingSummary> TimeCopy(size_t bytes, const TimingOptions& o, double* gb_per_s);
// Read-only bandwidth (bytes read / time) of a vectorised read kernel over `bytes`: the lower bound's
// denominator (a decode step reads weights and KV; it writes almost nothing).
StatusOr<TimingSummary> TimeRead(size_t bytes, const TimingOptions& o, double* gb_per_s);
// One decode-attention call over a layer's ragged caches (split-KV), per-call time in us.
StatusOr<TimingSummary> TimeDecodeAttention(const AttentionProblem& p, const SplitKvPartition& part,
                                            const TimingOptions& o);
// Same problem, caches padded to the longest head (what a dense engine / PyTorch SDPA would read): the
// same kernel over a dense [H][max_len] layout. The harness reports both.
StatusOr<TimingSummary> TimePaddedAttention(const AttentionProblem& p, const TimingOptions& o);
StatusOr<TimingSummary> TimeWindowScores(const WindowScoreProblem& p, const TimingOptions& o);
StatusOr<TimingSummary> TimeTopKCompact(const TopKProblem& p, const TimingOptions& o);
StatusOr<TimingSummary> TimeMergeNearest(const MergeProblem& p, const TimingOptions& o);
struct DecoderTiming {
  TimingSummary step;       // the full step (CUDA graph launch), us
  TimingSummary attention;  // every layer's attention kernels only (a graph of those), us
};
StatusOr<DecoderTiming> TimeDecoderStep(const DecoderProblem& p, const TimingOptions& o);

}  // namespace kvsim::gpu_replay
