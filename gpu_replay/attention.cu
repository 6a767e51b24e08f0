// Decode attention over ragged per-(layer, KV head) caches: one flat K and V buffer per layer, per-head
// offsets; split-KV work items from PartitionSplitKv (gpu_replay/layout.h), one thread block each; each
// warp walks tokens of the item with an online softmax for every query head of the GQA group (K/V read
// once per group); a combine kernel rescales the items' partials (flash-decoding).

#include <algorithm>

#include "gpu_replay/attention_kernels.cuh"
#include "gpu_replay/gpu_common.cuh"

namespace kvsim::gpu_replay {

namespace {

template <typename T, int D, int G>
__global__ void __launch_bounds__(kAttnThreads)
    SplitKvKernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                  const int64_t* __restrict__ offset, const int4* __restrict__ items, float scale,
                  float* __restrict__ part) {
  constexpr int E = D / 32;
  constexpr int W = kAttnThreads / 32;
  const int4 item = items[blockIdx.x];
  const int h = item.x, begin = item.y, end = item.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float qv[G][E], acc[G][E], m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      qv[g][e] = ToF(q[(static_cast<int64_t>(h) * G + g) * D + lane * E + e]) * scale;
      acc[g][e] = 0;
    }
  }
  const T* kb = k + offset[h] * D + lane * E;
  const T* vb = v + offset[h] * D + lane * E;
  for (int j = begin + warp; j < end; j += W) {
    float kr[E], vr[E];
#pragma unroll
    for (int e = 0; e < E; ++e) kr[e] = ToF(kb[static_cast<int64_t>(j) * D + e]);
#pragma unroll
    for (int e = 0; e < E; ++e) vr[e] = ToF(vb[static_cast<int64_t>(j) * D + e]);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float dot = 0;
#pragma unroll
      for (int e = 0; e < E; ++e) dot += qv[g][e] * kr[e];
      dot = WarpSum(dot);
      const float nm = fmaxf(m[g], dot), c = __expf(m[g] - nm), p = __expf(dot - nm);
      l[g] = l[g] * c + p;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] = acc[g][e] * c + p * vr[e];
      m[g] = nm;
    }
  }
  // Combine the warps of the block.
  __shared__ float sm_m[W][G], sm_l[W][G], sm_acc[W][G][D];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g];
    }
#pragma unroll
    for (int e = 0; e < E; ++e) sm_acc[warp][g][lane * E + e] = acc[g][e];
  }
  __syncthreads();
  // part layout per item: [G][D + 2]: unnormalised output, then max and sum.
  float* out = part + static_cast<int64_t>(blockIdx.x) * G * (D + 2);
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    const int g = idx / D, d = idx % D;
    float M = -INFINITY;
    for (int w = 0; w < W; ++w) M = fmaxf(M, sm_m[w][g]);
    float L = 0, A = 0;
    for (int w = 0; w < W; ++w) {
      const float c = sm_m[w][g] == -INFINITY ? 0.0f : __expf(sm_m[w][g] - M);
      L += sm_l[w][g] * c;
      A += sm_acc[w][g][d] * c;
    }
    out[g * (D + 2) + d] = A;
    if (d == 0) {
      out[g * (D + 2) + D] = M;
      out[g * (D + 2) + D + 1] = L;
    }
  }
}

template <typename OutT, int D, int G>
__global__ void CombineKernel(const float* __restrict__ part, const int* __restrict__ head_first,
                              OutT* __restrict__ out) {
  const int qh = blockIdx.x, h = qh / G, g = qh % G, d = threadIdx.x;
  const int first = head_first[h], last = head_first[h + 1];
  float M = -INFINITY;
  for (int it = first; it < last; ++it) M = fmaxf(M, part[(static_cast<int64_t>(it) * G + g) * (D + 2) + D]);
  float L = 0, A = 0;
  for (int it = first; it < last; ++it) {
    const float* p = part + (static_cast<int64_t>(it) * G + g) * (D + 2);
    const float c = __expf(p[D] - M);
    L += p[D + 1] * c;
    A += p[d] * c;
  }
  out[static_cast<int64_t>(qh) * D + d] = FromF<OutT>(last > first ? A / L : 0.0f);
}

template <typename T, typename OutT, int D, int G>
Status LaunchTyped(const AttentionArgs& a, cudaStream_t s) {
  if (a.num_items > 0)
    SplitKvKernel<T, D, G><<<a.num_items, kAttnThreads, 0, s>>>(
        static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<const T*>(a.v), a.offset,
        reinterpret_cast<const int4*>(a.items), a.scale, a.partials);
  CombineKernel<OutT, D, G>
      <<<a.num_kv_heads * G, D, 0, s>>>(a.partials, a.head_first, static_cast<OutT*>(a.out));
  KVSIM_CUDA(cudaGetLastError());
  return Status::Ok();
}

template <typename T, int D, int G>
Status LaunchOut(const AttentionArgs& a, cudaStream_t s) {
  return a.out_fp32 ? LaunchTyped<T, float, D, G>(a, s) : LaunchTyped<T, T, D, G>(a, s);
}

template <typename T, int D>
Status LaunchGroup(const AttentionArgs& a, cudaStream_t s) {
  switch (a.group) {
    case 1:
      return LaunchOut<T, D, 1>(a, s);
    case 2:
      return LaunchOut<T, D, 2>(a, s);
    case 4:
      return LaunchOut<T, D, 4>(a, s);
    case 7:
      return LaunchOut<T, D, 7>(a, s);
    case 8:
      return LaunchOut<T, D, 8>(a, s);
  }
  return Status::InvalidArgument("decode attention: GQA group size " + std::to_string(a.group) +
                                 " not compiled (1, 2, 4, 7, 8)");
}

template <typename T>
Status LaunchDim(const AttentionArgs& a, cudaStream_t s) {
  if (a.head_dim == 64) return LaunchGroup<T, 64>(a, s);
  if (a.head_dim == 128) return LaunchGroup<T, 128>(a, s);
  return Status::InvalidArgument("decode attention: head_dim " + std::to_string(a.head_dim) +
                                 " not compiled (64, 128)");
}

}  // namespace

Status LaunchDecodeAttention(const AttentionArgs& a, cudaStream_t s) {
  return a.dtype == Dtype::kF16 ? LaunchDim<__half>(a, s) : LaunchDim<__nv_bfloat16>(a, s);
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
  return TimeDecodeAttention(padded, PartitionSplitKv(lens, AttentionTargetItems(sms)), o);
}

}  // namespace kvsim::gpu_replay
