// The policies' own GPU work on the device (kernels: gpu_replay/policy_kernels.cuh, shared with the host
// execution layer): uploads, launches and timing of window scoring, top-k + compaction and merging.

#include "gpu_replay/gpu_common.cuh"
#include "gpu_replay/policy_kernels.cuh"

namespace kvsim::gpu_replay {
namespace {

struct WindowDevice {
  DeviceBuffer<uint16_t> q, k;
  DeviceBuffer<float> lse, lse_part, scores;
  Status Upload(const WindowScoreProblem& p) {
    KVSIM_RETURN_IF_ERROR(q.Upload(p.q));
    KVSIM_RETURN_IF_ERROR(k.Upload(p.k));
    KVSIM_RETURN_IF_ERROR(lse_part.Alloc(WindowLsePartSize(p.num_q_heads, p.num_keys, p.window)));
    KVSIM_RETURN_IF_ERROR(lse.Alloc(static_cast<size_t>(p.num_q_heads) * p.window));
    return scores.Alloc(static_cast<size_t>(p.num_kv_heads) * p.num_keys);
  }
  WindowArgs Args(const WindowScoreProblem& p) {
    return WindowArgs{p.dtype, p.head_dim, p.num_q_heads, p.num_kv_heads, p.num_keys,   p.window,
                      p.scale, q.ptr,      k.ptr,         lse.ptr,        lse_part.ptr, scores.ptr};
  }
};

struct TopKDevice {
  DeviceBuffer<float> scores;
  DeviceBuffer<int64_t> src_offset, dst_offset;
  DeviceBuffer<int32_t> src_len, dst_len, selected;
  DeviceBuffer<uint16_t> k, v, ko, vo;
  RaggedLayout dst;
  int max_len = 0;
  Status Upload(const TopKProblem& p) {
    dst = TopKDestinationLayout(p);
    max_len = 0;
    for (int32_t n : dst.length) max_len = std::max(max_len, n);
    KVSIM_RETURN_IF_ERROR(scores.Upload(p.scores));
    KVSIM_RETURN_IF_ERROR(src_offset.Upload(p.src.offset));
    KVSIM_RETURN_IF_ERROR(dst_offset.Upload(dst.offset));
    KVSIM_RETURN_IF_ERROR(src_len.Upload(p.src.length));
    KVSIM_RETURN_IF_ERROR(dst_len.Upload(dst.length));
    std::vector<int32_t> none(dst.total_slots, -1);
    KVSIM_RETURN_IF_ERROR(selected.Upload(none));
    KVSIM_RETURN_IF_ERROR(k.Upload(p.k));
    KVSIM_RETURN_IF_ERROR(v.Upload(p.v));
    KVSIM_RETURN_IF_ERROR(ko.Alloc(static_cast<size_t>(dst.total_slots) * p.src.head_dim));
    return vo.Alloc(ko.n);
  }
  TopKArgs Args(const TopKProblem& p) {
    return TopKArgs{p.dtype,     p.src.head_dim, p.src.num_kv_heads, max_len,      scores.ptr, src_offset.ptr,
                    src_len.ptr, dst_offset.ptr, dst_len.ptr,        selected.ptr, k.ptr,      v.ptr,
                    ko.ptr,      vo.ptr};
  }
};

struct MergeDevice {
  DeviceBuffer<uint16_t> k, v, ek, ev;
  DeviceBuffer<float> knorm, sim, ksum, vsum;
  DeviceBuffer<int32_t> e_first, len, nearest, count;
  DeviceBuffer<int64_t> offset;
  int num_e = 0, max_e = 0;
  int64_t slots = 0;
  Status Upload(const MergeProblem& p) {
    num_e = p.evicted_first.back();
    slots = p.layout.total_slots;
    max_e = 0;
    for (int h = 0; h < p.layout.num_kv_heads; ++h)
      max_e = std::max(max_e, p.evicted_first[h + 1] - p.evicted_first[h]);
    KVSIM_RETURN_IF_ERROR(k.Upload(p.k));
    KVSIM_RETURN_IF_ERROR(v.Upload(p.v));
    KVSIM_RETURN_IF_ERROR(ek.Upload(p.ek));
    KVSIM_RETURN_IF_ERROR(ev.Upload(p.ev));
    KVSIM_RETURN_IF_ERROR(e_first.Upload(p.evicted_first));
    KVSIM_RETURN_IF_ERROR(len.Upload(p.layout.length));
    KVSIM_RETURN_IF_ERROR(offset.Upload(p.layout.offset));
    KVSIM_RETURN_IF_ERROR(knorm.Alloc(std::max<int64_t>(1, slots)));
    KVSIM_RETURN_IF_ERROR(sim.Alloc(std::max(1, num_e)));
    KVSIM_RETURN_IF_ERROR(nearest.Alloc(std::max(1, num_e)));
    KVSIM_RETURN_IF_ERROR(count.Alloc(std::max<int64_t>(1, slots)));
    KVSIM_RETURN_IF_ERROR(ksum.Alloc(std::max<int64_t>(1, slots * p.layout.head_dim)));
    return vsum.Alloc(ksum.n);
  }
  MergeArgs Args(const MergeProblem& p) {
    return MergeArgs{p.dtype,
                     p.layout.head_dim,
                     num_e,
                     slots,
                     k.ptr,
                     v.ptr,
                     p.layout.num_kv_heads,
                     max_e,
                     ek.ptr,
                     ev.ptr,
                     e_first.ptr,
                     offset.ptr,
                     len.ptr,
                     knorm.ptr,
                     nearest.ptr,
                     sim.ptr,
                     count.ptr,
                     ksum.ptr,
                     vsum.ptr};
  }
  Status Reset(cudaStream_t s) {  // the merge accumulates: zero the sums before a timed repeat
    KVSIM_CUDA(cudaMemsetAsync(count.ptr, 0, count.n * sizeof(int32_t), s));
    KVSIM_CUDA(cudaMemsetAsync(ksum.ptr, 0, ksum.n * sizeof(float), s));
    KVSIM_CUDA(cudaMemsetAsync(vsum.ptr, 0, vsum.n * sizeof(float), s));
    return Status::Ok();
  }
};

}  // namespace

Status GpuWindowScores(const WindowScoreProblem& p, std::vector<float>* scores) {
  KVSIM_RETURN_IF_ERROR(RequireDevice());
  WindowDevice dev;
  KVSIM_RETURN_IF_ERROR(dev.Upload(p));
  KVSIM_RETURN_IF_ERROR(LaunchWindowScores(dev.Args(p), cudaStream_t{}));
  KVSIM_CUDA(cudaDeviceSynchronize());
  return dev.scores.Download(scores);
}

StatusOr<TimingSummary> TimeWindowScores(const WindowScoreProblem& p, const TimingOptions& o) {
  Timer timer;
  KVSIM_RETURN_IF_ERROR(timer.Init());
  WindowDevice dev;
  KVSIM_RETURN_IF_ERROR(dev.Upload(p));
  return timer.Time([&](cudaStream_t s) { return LaunchWindowScores(dev.Args(p), s); }, o);
}

Status GpuTopKCompact(const TopKProblem& p, TopKResult* out) {
  KVSIM_RETURN_IF_ERROR(RequireDevice());
  TopKDevice dev;
  KVSIM_RETURN_IF_ERROR(dev.Upload(p));
  KVSIM_RETURN_IF_ERROR(LaunchTopKCompact(dev.Args(p), cudaStream_t{}));
  KVSIM_CUDA(cudaDeviceSynchronize());
  out->dst = dev.dst;
  KVSIM_RETURN_IF_ERROR(dev.selected.Download(&out->selected));
  KVSIM_RETURN_IF_ERROR(dev.ko.Download(&out->k));
  return dev.vo.Download(&out->v);
}

StatusOr<TimingSummary> TimeTopKCompact(const TopKProblem& p, const TimingOptions& o) {
  Timer timer;
  KVSIM_RETURN_IF_ERROR(timer.Init());
  TopKDevice dev;
  KVSIM_RETURN_IF_ERROR(dev.Upload(p));
  return timer.Time([&](cudaStream_t s) { return LaunchTopKCompact(dev.Args(p), s); }, o);
}

Status GpuMergeNearest(const MergeProblem& p, MergeResult* out) {
  KVSIM_RETURN_IF_ERROR(RequireDevice());
  MergeDevice dev;
  KVSIM_RETURN_IF_ERROR(dev.Upload(p));
  KVSIM_RETURN_IF_ERROR(LaunchMergeNearest(dev.Args(p), cudaStream_t{}));
  KVSIM_CUDA(cudaDeviceSynchronize());
  KVSIM_RETURN_IF_ERROR(dev.nearest.Download(&out->nearest));
  KVSIM_RETURN_IF_ERROR(dev.sim.Download(&out->similarity));
  KVSIM_RETURN_IF_ERROR(dev.count.Download(&out->count));
  out->nearest.resize(dev.num_e);
  out->similarity.resize(dev.num_e);
  out->count.resize(dev.slots);
  KVSIM_RETURN_IF_ERROR(dev.k.Download(&out->k));
  return dev.v.Download(&out->v);
}

StatusOr<TimingSummary> TimeMergeNearest(const MergeProblem& p, const TimingOptions& o) {
  Timer timer;
  KVSIM_RETURN_IF_ERROR(timer.Init());
  MergeDevice dev;
  KVSIM_RETURN_IF_ERROR(dev.Upload(p));
  // The merge accumulates: its sums are zeroed before every sample, outside the timed region. (K/V drift
  // across repeats, merged in place: timing only.)
  return timer.Time([&](cudaStream_t s) { return dev.Reset(s); },
                    [&](cudaStream_t s) { return LaunchMergeNearest(dev.Args(p), s); }, o);
}

}  // namespace kvsim::gpu_replay
