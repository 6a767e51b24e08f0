// The policies' own GPU work (gpu_replay/kernels.h has the CPU reference of each):
//   window scores  two passes: per window query the log-sum-exp over its causal keys (warp per key, online),
//                  then per key tile the sum of exp(logit - lse) over the group's window queries;
//   top-k          one block per head: 4-pass 8-bit radix select of the k-th largest score, ties to the
//                  lowest slot by a block scan, then a warp-per-row gather of K/V into the new ragged layout;
//   merge          warp per evicted token: cosine against every kept slot of its head (first max wins),
//                  fp32 atomics into per-slot sums, then (k_a + Σ k_e) / (1 + m).

#include <cub/block/block_scan.cuh>

#include "gpu_replay/gpu_common.cuh"

namespace kvsim::gpu_replay {
namespace {

// ---- Window scores ----
template <typename T, int D>
__global__ void WindowLseKernel(const T* __restrict__ q, const T* __restrict__ k, int hkv, int group, int n,
                                int window, float scale, float* __restrict__ lse) {
  constexpr int E = D / 32, W = 4;
  const int row = blockIdx.x;  // qh * window + w
  const int qh = row / window, w = row % window, h = qh / group, pos = n - window + w;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float qv[E];
  for (int e = 0; e < E; ++e) qv[e] = ToF(q[static_cast<int64_t>(row) * D + lane * E + e]) * scale;
  const T* kb = k + static_cast<int64_t>(h) * n * D + lane * E;
  float m = -INFINITY, l = 0;
  for (int j = warp; j <= pos; j += W) {
    float dot = 0;
    for (int e = 0; e < E; ++e) dot += qv[e] * ToF(kb[static_cast<int64_t>(j) * D + e]);
    dot = WarpSum(dot);
    const float nm = fmaxf(m, dot);
    l = l * __expf(m - nm) + __expf(dot - nm);
    m = nm;
  }
  __shared__ float sm[W], sl[W];
  if (lane == 0) sm[warp] = m, sl[warp] = l;
  __syncthreads();
  if (threadIdx.x == 0) {
    float M = -INFINITY, L = 0;
    for (int i = 0; i < W; ++i) M = fmaxf(M, sm[i]);
    for (int i = 0; i < W; ++i) L += sm[i] == -INFINITY ? 0.0f : sl[i] * __expf(sm[i] - M);
    lse[row] = M + __logf(L);
  }
}

template <typename T, int D>
__global__ void WindowScoreKernel(const T* __restrict__ q, const T* __restrict__ k, int group, int n,
                                  int window, float scale, const float* __restrict__ lse,
                                  float* __restrict__ scores) {
  constexpr int TILE = 64, QC = 8;
  const int h = blockIdx.y, j0 = blockIdx.x * TILE, t = threadIdx.x, j = j0 + t;
  __shared__ __align__(16) T ks[TILE][D + 2];  // +2: rows start in different banks
  __shared__ float qs[QC][D];
  const T* kb = k + static_cast<int64_t>(h) * n * D;
  for (int idx = t; idx < TILE * D; idx += TILE) {
    const int r = idx / D, c = idx % D;
    ks[r][c] = j0 + r < n ? kb[static_cast<int64_t>(j0 + r) * D + c] : FromF<T>(0.0f);
  }
  float acc = 0;
  const int rows = group * window;
  for (int r0 = 0; r0 < rows; r0 += QC) {
    __syncthreads();
    for (int idx = t; idx < QC * D; idx += TILE) {
      const int r = r0 + idx / D;
      const int qh = h * group + r / window, w = r % window;
      qs[idx / D][idx % D] =
          r < rows ? ToF(q[(static_cast<int64_t>(qh) * window + w) * D + idx % D]) * scale : 0.0f;
    }
    __syncthreads();
    if (j >= n) continue;
    for (int i = 0; i < QC && r0 + i < rows; ++i) {
      const int r = r0 + i, w = r % window, pos = n - window + w;
      if (j > pos) continue;
      float dot = 0;
#pragma unroll 16
      for (int c = 0; c < D; ++c) dot += qs[i][c] * ToF(ks[t][c]);
      acc += __expf(dot - lse[(h * group + r / window) * window + w]);
    }
  }
  if (j < n) scores[static_cast<int64_t>(h) * n + j] = acc;
}

// ---- Top-k with compaction ----
__device__ __forceinline__ uint32_t OrderedKey(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

constexpr int kTopKThreads = 512;

__global__ void TopKSelectKernel(const float* __restrict__ scores, const int64_t* __restrict__ src_offset,
                                 const int32_t* __restrict__ src_len, const int64_t* __restrict__ dst_offset,
                                 const int32_t* __restrict__ dst_len, int32_t* __restrict__ selected) {
  const int h = blockIdx.x, n = src_len[h], keep = dst_len[h], t = threadIdx.x;
  const float* sc = scores + src_offset[h];
  __shared__ uint32_t hist[256];
  __shared__ uint32_t prefix_s, remaining_s;
  if (t == 0) prefix_s = 0, remaining_s = keep;
  // Radix select: the key of the keep-th largest score.
  for (int pass = 0; pass < 4 && keep > 0; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int b = t; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    const uint32_t prefix = prefix_s;
    const uint32_t mask = pass == 0 ? 0u : (0xffffffffu << (shift + 8));
    for (int i = t; i < n; i += blockDim.x) {
      const uint32_t key = OrderedKey(sc[i]);
      if ((key & mask) == (prefix & mask)) atomicAdd(&hist[(key >> shift) & 0xff], 1u);
    }
    __syncthreads();
    if (t == 0) {
      uint32_t rem = remaining_s;
      int b = 255;
      for (; b > 0 && hist[b] < rem; --b) rem -= hist[b];
      prefix_s = prefix | (static_cast<uint32_t>(b) << shift);
      remaining_s = rem;  // how many keys equal to the threshold (within this bucket chain) to take
    }
    __syncthreads();
  }
  if (keep == 0) return;
  const uint32_t thr = prefix_s;
  const uint32_t take_equal = remaining_s;
  // Ordered compaction: slot i is kept if key > thr, or key == thr and among the first take_equal such slots.
  using Scan = cub::BlockScan<int, kTopKThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int base_sel, base_eq;
  if (t == 0) base_sel = 0, base_eq = 0;
  __syncthreads();
  for (int c = 0; c < n; c += blockDim.x) {
    const int i = c + t;
    const uint32_t key = i < n ? OrderedKey(sc[i]) : 0u;
    const int eq = i < n && key == thr;
    int eq_before, eq_total;
    Scan(tmp).ExclusiveSum(eq, eq_before, eq_total);
    __syncthreads();
    const int sel = i < n && (key > thr || (eq && base_eq + eq_before < static_cast<int>(take_equal)));
    int sel_before, sel_total;
    Scan(tmp).ExclusiveSum(sel, sel_before, sel_total);
    if (sel) selected[dst_offset[h] + base_sel + sel_before] = i;
    __syncthreads();
    if (t == 0) base_sel += sel_total, base_eq += eq_total;
    __syncthreads();
  }
}

template <typename T, int D>
__global__ void GatherKernel(const T* __restrict__ k, const T* __restrict__ v,
                             const int64_t* __restrict__ src_offset, const int64_t* __restrict__ dst_offset,
                             const int32_t* __restrict__ dst_len, const int32_t* __restrict__ selected,
                             int num_heads, T* __restrict__ ko, T* __restrict__ vo) {
  const int h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * (blockDim.x / 32) + warp;
  if (row >= dst_len[h]) return;
  const int64_t src = (src_offset[h] + selected[dst_offset[h] + row]) * D, dst = (dst_offset[h] + row) * D;
  for (int c = lane; c < D; c += 32) {
    ko[dst + c] = k[src + c];
    vo[dst + c] = v[src + c];
  }
}

// ---- Merge ----
template <typename T, int D>
__global__ void KeyNormKernel(const T* __restrict__ k, int64_t slots, float* __restrict__ norm) {
  const int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (s >= slots) return;
  float ss = 0;
  for (int c = lane; c < D; c += 32) {
    const float x = ToF(k[s * D + c]);
    ss += x * x;
  }
  ss = WarpSum(ss);
  if (lane == 0) norm[s] = sqrtf(ss);
}

template <typename T, int D>
__global__ void NearestKernel(const T* __restrict__ k, const float* __restrict__ knorm,
                              const T* __restrict__ ek, const T* __restrict__ ev,
                              const int32_t* __restrict__ e_head, const int64_t* __restrict__ offset,
                              const int32_t* __restrict__ len, int num_e, int32_t* __restrict__ nearest,
                              float* __restrict__ sim, int32_t* __restrict__ count, float* __restrict__ ksum,
                              float* __restrict__ vsum) {
  constexpr int E = D / 32;
  const int e = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (e >= num_e) return;
  const int h = e_head[e], n = len[h];
  if (n == 0) {
    if (lane == 0) nearest[e] = -1, sim[e] = 0;
    return;
  }
  float x[E], en = 0;
  for (int i = 0; i < E; ++i) {
    x[i] = ToF(ek[static_cast<int64_t>(e) * D + lane * E + i]);
    en += x[i] * x[i];
  }
  en = sqrtf(WarpSum(en));
  float best = -INFINITY;
  int best_s = 0;
  const T* kb = k + offset[h] * D + lane * E;
  for (int s = 0; s < n; ++s) {
    float dot = 0;
    for (int i = 0; i < E; ++i) dot += x[i] * ToF(kb[static_cast<int64_t>(s) * D + i]);
    dot = WarpSum(dot);
    const float kn = knorm[offset[h] + s];
    const float c = (en > 0 && kn > 0) ? dot / (en * kn) : 0.0f;
    if (c > best) best = c, best_s = s;
  }
  const int64_t slot = offset[h] + best_s;
  if (lane == 0) {
    nearest[e] = best_s;
    sim[e] = best;
    atomicAdd(&count[slot], 1);
  }
  for (int i = 0; i < E; ++i) {
    atomicAdd(&ksum[slot * D + lane * E + i], x[i]);
    atomicAdd(&vsum[slot * D + lane * E + i], ToF(ev[static_cast<int64_t>(e) * D + lane * E + i]));
  }
}

template <typename T, int D>
__global__ void MergeFinalizeKernel(T* __restrict__ k, T* __restrict__ v, const int32_t* __restrict__ count,
                                    const float* __restrict__ ksum, const float* __restrict__ vsum,
                                    int64_t slots) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= slots * D) return;
  const int c = count[i / D];
  if (c == 0) return;
  const float inv = 1.0f / (1.0f + c);
  k[i] = FromF<T>((ToF(k[i]) + ksum[i]) * inv);
  v[i] = FromF<T>((ToF(v[i]) + vsum[i]) * inv);
}

// ---- Dispatch helpers ----
template <template <typename, int> class F, typename... A>
Status Dispatch(Dtype dt, int d, A&&... a) {
  if (d != 64 && d != 128)
    return Status::InvalidArgument("head_dim " + std::to_string(d) + " not compiled (64, 128)");
  if (dt == Dtype::kF16) return d == 64 ? F<__half, 64>::Run(a...) : F<__half, 128>::Run(a...);
  return d == 64 ? F<__nv_bfloat16, 64>::Run(a...) : F<__nv_bfloat16, 128>::Run(a...);
}

struct WindowDevice {
  DeviceBuffer<uint16_t> q, k;
  DeviceBuffer<float> lse, scores;
  Status Upload(const WindowScoreProblem& p) {
    KVSIM_RETURN_IF_ERROR(q.Upload(p.q));
    KVSIM_RETURN_IF_ERROR(k.Upload(p.k));
    KVSIM_RETURN_IF_ERROR(lse.Alloc(static_cast<size_t>(p.num_q_heads) * p.window));
    return scores.Alloc(static_cast<size_t>(p.num_kv_heads) * p.num_keys);
  }
};

template <typename T, int D>
struct WindowRun {
  static Status Run(const WindowScoreProblem& p, WindowDevice& dev, cudaStream_t s) {
    const int group = p.num_q_heads / p.num_kv_heads;
    const T* q = reinterpret_cast<const T*>(dev.q.ptr);
    const T* k = reinterpret_cast<const T*>(dev.k.ptr);
    WindowLseKernel<T, D><<<p.num_q_heads * p.window, 128, 0, s>>>(q, k, p.num_kv_heads, group, p.num_keys,
                                                                   p.window, p.scale, dev.lse.ptr);
    dim3 grid((p.num_keys + 63) / 64, p.num_kv_heads);
    WindowScoreKernel<T, D>
        <<<grid, 64, 0, s>>>(q, k, group, p.num_keys, p.window, p.scale, dev.lse.ptr, dev.scores.ptr);
    KVSIM_CUDA(cudaGetLastError());
    return Status::Ok();
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
};

template <typename T, int D>
struct TopKRun {
  static Status Run(const TopKProblem& p, TopKDevice& dev, cudaStream_t s) {
    const int h = p.src.num_kv_heads;
    TopKSelectKernel<<<h, kTopKThreads, 0, s>>>(dev.scores.ptr, dev.src_offset.ptr, dev.src_len.ptr,
                                                dev.dst_offset.ptr, dev.dst_len.ptr, dev.selected.ptr);
    if (dev.max_len > 0) {
      dim3 grid((dev.max_len + 7) / 8, h);
      GatherKernel<T, D>
          <<<grid, 256, 0, s>>>(reinterpret_cast<const T*>(dev.k.ptr), reinterpret_cast<const T*>(dev.v.ptr),
                                dev.src_offset.ptr, dev.dst_offset.ptr, dev.dst_len.ptr, dev.selected.ptr, h,
                                reinterpret_cast<T*>(dev.ko.ptr), reinterpret_cast<T*>(dev.vo.ptr));
    }
    KVSIM_CUDA(cudaGetLastError());
    return Status::Ok();
  }
};

struct MergeDevice {
  DeviceBuffer<uint16_t> k, v, ek, ev;
  DeviceBuffer<float> knorm, sim, ksum, vsum;
  DeviceBuffer<int32_t> e_head, len, nearest, count;
  DeviceBuffer<int64_t> offset;
  int num_e = 0;
  int64_t slots = 0;
  Status Upload(const MergeProblem& p) {
    num_e = p.evicted_first.back();
    slots = p.layout.total_slots;
    std::vector<int32_t> eh(num_e);
    for (int h = 0; h < p.layout.num_kv_heads; ++h)
      for (int e = p.evicted_first[h]; e < p.evicted_first[h + 1]; ++e) eh[e] = h;
    KVSIM_RETURN_IF_ERROR(k.Upload(p.k));
    KVSIM_RETURN_IF_ERROR(v.Upload(p.v));
    KVSIM_RETURN_IF_ERROR(ek.Upload(p.ek));
    KVSIM_RETURN_IF_ERROR(ev.Upload(p.ev));
    KVSIM_RETURN_IF_ERROR(e_head.Upload(eh));
    KVSIM_RETURN_IF_ERROR(len.Upload(p.layout.length));
    KVSIM_RETURN_IF_ERROR(offset.Upload(p.layout.offset));
    KVSIM_RETURN_IF_ERROR(knorm.Alloc(std::max<int64_t>(1, slots)));
    KVSIM_RETURN_IF_ERROR(sim.Alloc(std::max(1, num_e)));
    KVSIM_RETURN_IF_ERROR(nearest.Alloc(std::max(1, num_e)));
    KVSIM_RETURN_IF_ERROR(count.Alloc(std::max<int64_t>(1, slots)));
    KVSIM_RETURN_IF_ERROR(ksum.Alloc(std::max<int64_t>(1, slots * p.layout.head_dim)));
    return vsum.Alloc(ksum.n);
  }
  Status Reset(cudaStream_t s) {  // the merge accumulates: zero the sums before a timed repeat
    KVSIM_CUDA(cudaMemsetAsync(count.ptr, 0, count.n * sizeof(int32_t), s));
    KVSIM_CUDA(cudaMemsetAsync(ksum.ptr, 0, ksum.n * sizeof(float), s));
    KVSIM_CUDA(cudaMemsetAsync(vsum.ptr, 0, vsum.n * sizeof(float), s));
    return Status::Ok();
  }
};

template <typename T, int D>
struct MergeRun {
  static Status Run(const MergeProblem& p, MergeDevice& dev, cudaStream_t s) {
    T* k = reinterpret_cast<T*>(dev.k.ptr);
    T* v = reinterpret_cast<T*>(dev.v.ptr);
    if (dev.slots > 0) KeyNormKernel<T, D><<<(dev.slots + 7) / 8, 256, 0, s>>>(k, dev.slots, dev.knorm.ptr);
    if (dev.num_e > 0)
      NearestKernel<T, D><<<(dev.num_e + 7) / 8, 256, 0, s>>>(
          k, dev.knorm.ptr, reinterpret_cast<const T*>(dev.ek.ptr), reinterpret_cast<const T*>(dev.ev.ptr),
          dev.e_head.ptr, dev.offset.ptr, dev.len.ptr, dev.num_e, dev.nearest.ptr, dev.sim.ptr, dev.count.ptr,
          dev.ksum.ptr, dev.vsum.ptr);
    const int64_t total = dev.slots * D;
    if (total > 0)
      MergeFinalizeKernel<T, D>
          <<<(total + 255) / 256, 256, 0, s>>>(k, v, dev.count.ptr, dev.ksum.ptr, dev.vsum.ptr, dev.slots);
    KVSIM_CUDA(cudaGetLastError());
    return Status::Ok();
  }
};

}  // namespace

Status GpuWindowScores(const WindowScoreProblem& p, std::vector<float>* scores) {
  KVSIM_RETURN_IF_ERROR(RequireDevice());
  WindowDevice dev;
  KVSIM_RETURN_IF_ERROR(dev.Upload(p));
  KVSIM_RETURN_IF_ERROR(Dispatch<WindowRun>(p.dtype, p.head_dim, p, dev, cudaStream_t{}));
  KVSIM_CUDA(cudaDeviceSynchronize());
  return dev.scores.Download(scores);
}

StatusOr<TimingSummary> TimeWindowScores(const WindowScoreProblem& p, const TimingOptions& o) {
  Timer timer;
  KVSIM_RETURN_IF_ERROR(timer.Init());
  WindowDevice dev;
  KVSIM_RETURN_IF_ERROR(dev.Upload(p));
  return timer.Time([&](cudaStream_t s) { return Dispatch<WindowRun>(p.dtype, p.head_dim, p, dev, s); }, o);
}

Status GpuTopKCompact(const TopKProblem& p, TopKResult* out) {
  KVSIM_RETURN_IF_ERROR(RequireDevice());
  TopKDevice dev;
  KVSIM_RETURN_IF_ERROR(dev.Upload(p));
  KVSIM_RETURN_IF_ERROR(Dispatch<TopKRun>(p.dtype, p.src.head_dim, p, dev, cudaStream_t{}));
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
  return timer.Time([&](cudaStream_t s) { return Dispatch<TopKRun>(p.dtype, p.src.head_dim, p, dev, s); }, o);
}

Status GpuMergeNearest(const MergeProblem& p, MergeResult* out) {
  KVSIM_RETURN_IF_ERROR(RequireDevice());
  MergeDevice dev;
  KVSIM_RETURN_IF_ERROR(dev.Upload(p));
  KVSIM_RETURN_IF_ERROR(Dispatch<MergeRun>(p.dtype, p.layout.head_dim, p, dev, cudaStream_t{}));
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
  return timer.Time(
      [&](cudaStream_t s) -> Status {
        KVSIM_RETURN_IF_ERROR(dev.Reset(s));  // K/V drift across repeats (merged in place); timing only
        return Dispatch<MergeRun>(p.dtype, p.layout.head_dim, p, dev, s);
      },
      o);
}

}  // namespace kvsim::gpu_replay
