// gpu_api.h without CUDA (KVSIM_WITH_CUDA=OFF, or the sanitizer build): no device, ever.

#include "gpu_replay/gpu_api.h"

namespace kvsim::gpu_replay {
namespace {
Status NoDevice() {
  return Status::FailedPrecondition(
      "no CUDA device: kvsim was built without CUDA (KVSIM_WITH_CUDA=OFF or "
      "KVSIM_SANITIZE=ON)");
}
}  // namespace

DeviceInfo QueryDevice(int device) {
  DeviceInfo d;
  d.device = device;
  d.reason = NoDevice().message();
  return d;
}
Status GpuDecodeAttention(const AttentionProblem&, const SplitKvPartition&, std::vector<float>*) {
  return NoDevice();
}
Status GpuWindowScores(const WindowScoreProblem&, std::vector<float>*) { return NoDevice(); }
Status GpuTopKCompact(const TopKProblem&, TopKResult*) { return NoDevice(); }
Status GpuMergeNearest(const MergeProblem&, MergeResult*) { return NoDevice(); }
Status GpuDecoderStep(const DecoderProblem&, std::vector<float>*) { return NoDevice(); }
StatusOr<TimingSummary> TimeCopy(size_t, const TimingOptions&, double*) { return NoDevice(); }
StatusOr<TimingSummary> TimeRead(size_t, const TimingOptions&, double*) { return NoDevice(); }
StatusOr<TimingSummary> TimeDecodeAttention(const AttentionProblem&, const SplitKvPartition&,
                                            const TimingOptions&) {
  return NoDevice();
}
StatusOr<TimingSummary> TimePaddedAttention(const AttentionProblem&, const TimingOptions&) {
  return NoDevice();
}
StatusOr<TimingSummary> TimeWindowScores(const WindowScoreProblem&, const TimingOptions&) {
  return NoDevice();
}
StatusOr<TimingSummary> TimeTopKCompact(const TopKProblem&, const TimingOptions&) { return NoDevice(); }
StatusOr<TimingSummary> TimeMergeNearest(const MergeProblem&, const TimingOptions&) { return NoDevice(); }
StatusOr<DecoderTiming> TimeDecoderStep(const DecoderProblem&, const TimingOptions&) { return NoDevice(); }

}  // namespace kvsim::gpu_replay
