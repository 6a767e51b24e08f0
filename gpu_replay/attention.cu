// Decode attention over ragged per-(layer, KV head) caches on the device: the kernels are in
// gpu_replay/attention_kernels.cuh (shared with the host execution layer); this file uploads problems,
// launches and times them.

#include <algorithm>

#include "gpu_replay/attention_kernels.cuh"
#include "gpu_replay/gpu_common.cuh"

namespace kvsim::gpu_replay {

namespace {

// A problem's buffers on the device (tests, timing).
struct DeviceAttention {
  DeviceBuffer<uint16_t> q, k, v;
  DeviceBuffer<int64_t> offset;
  DeviceBuffer<int32_t> items, head_first;
  DeviceBuffer<float> partials, out;
  AttentionArgs args;
  Status Upload(const AttentionProblem& p, const SplitKvPartition& part);
};

}  // namespace

Status LaunchDecodeAttention(const AttentionArgs& a, cudaStream_t s) {
  return cuda::LaunchDecodeAttentionKernels(a, s);
}

Status DeviceAttention::Upload(const AttentionProblem& p, const SplitKvPartition& part) {
  KVSIM_RETURN_IF_ERROR(q.Upload(p.q));
  KVSIM_RETURN_IF_ERROR(k.Upload(p.k));
  KVSIM_RETURN_IF_ERROR(v.Upload(p.v));
  KVSIM_RETURN_IF_ERROR(offset.Upload(p.layout.offset));
  std::vector<int32_t> it;
  for (const WorkItem& w : part.items) it.insert(it.end(), {w.kv_head, w.begin, w.end, 0});
  KVSIM_RETURN_IF_ERROR(items.Upload(it));
  KVSIM_RETURN_IF_ERROR(head_first.Upload(part.head_first));
  const int g = p.group(), d = p.layout.head_dim;
  KVSIM_RETURN_IF_ERROR(partials.Alloc(std::max<size_t>(1, part.items.size() * g * (d + 2))));
  KVSIM_RETURN_IF_ERROR(out.Alloc(static_cast<size_t>(p.num_q_heads) * d));
  args = AttentionArgs{p.dtype,
                       d,
                       g,
                       p.layout.num_kv_heads,
                       p.scale,
                       static_cast<int>(part.items.size()),
                       q.ptr,
                       k.ptr,
                       v.ptr,
                       offset.ptr,
                       items.ptr,
                       head_first.ptr,
                       partials.ptr,
                       out.ptr,
                       true};
  return Status::Ok();
}

Status GpuDecodeAttention(const AttentionProblem& p, const SplitKvPartition& part, std::vector<float>* out) {
  KVSIM_RETURN_IF_ERROR(RequireDevice());
  DeviceAttention dev;
  KVSIM_RETURN_IF_ERROR(dev.Upload(p, part));
  KVSIM_RETURN_IF_ERROR(LaunchDecodeAttention(dev.args, nullptr));
  KVSIM_CUDA(cudaDeviceSynchronize());
  return dev.out.Download(out);
}

StatusOr<TimingSummary> TimeDecodeAttention(const AttentionProblem& p, const SplitKvPartition& part,
                                            const TimingOptions& o) {
  Timer timer;
  KVSIM_RETURN_IF_ERROR(timer.Init());
  DeviceAttention dev;
  KVSIM_RETURN_IF_ERROR(dev.Upload(p, part));
  return timer.Time([&](cudaStream_t s) { return LaunchDecodeAttention(dev.args, s); }, o);
}

StatusOr<TimingSummary> TimePaddedAttention(const AttentionProblem& p, const TimingOptions& o) {
  // Every head padded to the longest one: what a dense [H][max_len] cache makes a kernel read.
  const int max_len = *std::max_element(p.layout.length.begin(), p.layout.length.end());
  std::vector<int32_t> lens(p.layout.num_kv_heads, max_len);
  const AttentionProblem padded = MakeAttentionProblem(p.dtype, p.num_q_heads, lens, 0, p.layout.head_dim, 1);
  int sms = 0;
  KVSIM_RETURN_IF_ERROR(RequireDevice());
  KVSIM_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  return TimeDecodeAttention(padded, PartitionSplitKv(lens, AttentionTargetItems(sms), kSplitKvMinChunk), o);
}

}  // namespace kvsim::gpu_replay
