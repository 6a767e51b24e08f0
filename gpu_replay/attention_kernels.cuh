#pragma once
// Ragged split-KV decode attention (flash-decoding), device code for nvcc (attention.cu) and the host
// execution layer (host_kernels.cc): one thread block per work item of PartitionSplitKv
// (gpu_replay/layout.h); each warp walks tokens of the item with an online softmax for every query head of
// the GQA group (K/V read once per group, 16-byte loads, several tokens per warp in flight); the block
// combines its warps and writes (max, sum, unnormalised output) per item; a combine kernel rescales the items
// of each head. Empty heads give zeros.

#include "gpu_replay/device_common.cuh"
#include "gpu_replay/dtype.h"

namespace kvsim::gpu_replay {

inline constexpr int kAttnThreads = 128;
// Work items the partition aims for: enough blocks to fill every SM several times.
inline int AttentionTargetItems(int sm_count) { return sm_count * 8; }

struct AttentionArgs {
  Dtype dtype = Dtype::kF16;
  int head_dim = 128, group = 1, num_kv_heads = 0;
  float scale = 0;
  int num_items = 0;
  const void* q = nullptr;  // [num_kv_heads * group][head_dim]
  const void* k = nullptr;  // layer buffer [total_slots][head_dim]
  const void* v = nullptr;
  const int64_t* offset = nullptr;      // [num_kv_heads]
  const int32_t* items = nullptr;       // [num_items][4]: kv_head, begin, end, 0
  const int32_t* head_first = nullptr;  // [num_kv_heads + 1]
  float* partials = nullptr;            // [num_items][group][head_dim + 2]
  void* out = nullptr;                  // [num_kv_heads * group][head_dim], fp32 or the dtype
  bool out_fp32 = true;
};

namespace KVSIM_KERNELS_NS {

// 8 consecutive 16-bit values (one 16-byte load; p 16-byte aligned) as floats.
template <typename T>
__device__ __forceinline__ void Load8(const T* __restrict__ p, float (&out)[8]) {
#if defined(__CUDACC__)
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* h = reinterpret_cast<const T*>(&raw);
#else
  T h[8];
  hx::VectorLoad(h, p, 16);  // checks the alignment a real 16-byte load needs
#endif
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = ToF(h[e]);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// Asynchronous 16-byte global -> shared copies (sm_80+), bypassing L1 and registers.
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif

// One block per work item. A token's K (and V) row is read with 16-byte loads by L = D / 8 lanes, so a
// warp covers TPW = 32 / L tokens per step (4 at d 64, 2 at d 128); several steps are in flight per warp
// (sm_80+: a 4-stage cp.async pipeline through shared memory; otherwise, and on the host execution layer,
// the plain loads of 2 steps are issued before their use). The dot product is reduced over the
// token's L lanes; each lane group keeps an online softmax (m, l, acc) per query head of the group, the
// groups of a warp are merged by shuffles, the warps of the block through shared memory.
template <typename T, int D, int G>
__global__ void __launch_bounds__(kAttnThreads)
    SplitKvKernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                  const int64_t* __restrict__ offset, const int4* __restrict__ items, float scale,
                  float* __restrict__ part) {
  static_assert(sizeof(T) == 2 && D % 64 == 0, "16-bit storage, head_dim a multiple of 64");
  constexpr int VEC = 8, L = D / VEC, TPW = 32 / L;
  constexpr int W = kAttnThreads / 32, STEP = W * TPW;  // tokens per block step
  const int4 item = items[blockIdx.x];
  const int h = item.x, begin = item.y, end = item.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sub = lane / L, li = lane % L;
  float qv[G][VEC], acc[G][VEC], m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0;
    Load8(q + (static_cast<int64_t>(h) * G + g) * D + li * VEC, qv[g]);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      qv[g][e] *= scale;
      acc[g][e] = 0;
    }
  }
  const T* kb = k + offset[h] * D + li * VEC;
  const T* vb = v + offset[h] * D + li * VEC;
  // One token's row pair for this lane group: the dot product over the token's L lanes (every lane of the
  // warp calls this: the shuffles need them all), then the online-softmax update if the token exists.
  auto consume = [&](const float(&kr)[VEC], const float(&vr)[VEC], bool valid) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float dot = 0;
#pragma unroll
      for (int e = 0; e < VEC; ++e) dot += qv[g][e] * kr[e];
#pragma unroll
      for (int o = L / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if (valid) {
        const float nm = fmaxf(m[g], dot), c = __expf(m[g] - nm), p = __expf(dot - nm);
        l[g] = l[g] * c + p;
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[g][e] = acc[g][e] * c + p * vr[e];
        m[g] = nm;
      }
    }
  };
  const int first = begin + warp * TPW;  // the warp's first token; it then advances by STEP
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // sm_80+: a cp.async pipeline of S stages per warp. Each lane copies its own 16-byte chunks of K and V
  // into its own slots of the stage and later reads back only those, so cp.async.wait_group alone orders
  // them (no barrier). S * TPW tokens per warp in flight, without holding them in registers.
  // (Not run by the host execution layer, which compiles the plain path below; checked by the GPU tests.)
  constexpr int S = 4;
  __shared__ __align__(16) T kst[W][S][32][VEC];
  __shared__ __align__(16) T vst[W][S][32][VEC];
  const int nsteps = first < end ? (end - first + STEP - 1) / STEP : 0;  // uniform over the warp
  auto issue = [&](int n) {
    const int j = first + n * STEP + sub;
    if (n < nsteps && j < end) {
      CpAsync16(&kst[warp][n % S][lane][0], kb + static_cast<int64_t>(j) * D);
      CpAsync16(&vst[warp][n % S][lane][0], vb + static_cast<int64_t>(j) * D);
    }
    CpAsyncCommit();  // an empty group keeps the group count uniform
  };
#pragma unroll
  for (int n = 0; n < S - 1; ++n) issue(n);
  for (int n = 0; n < nsteps; ++n) {
    issue(n + S - 1);
    CpAsyncWait<S - 1>();  // this lane's copies of step n have landed
    const bool valid = first + n * STEP + sub < end;
    float kr[VEC], vr[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      kr[e] = valid ? ToF(kst[warp][n % S][lane][e]) : 0.0f;
      vr[e] = valid ? ToF(vst[warp][n % S][lane][e]) : 0.0f;
    }
    consume(kr, vr, valid);
  }
  CpAsyncWait<0>();
#else
  // Plain loads: the loads of U steps are issued before their use (U * TPW rows of K and V per warp in
  // flight). The loop bound is uniform over the warp; tokens past `end` are masked.
  constexpr int U = 2;
  for (int j0 = first; j0 < end; j0 += STEP * U) {
    float kr[U][VEC], vr[U][VEC];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u * STEP + sub;
      if (j < end) {
        Load8(kb + static_cast<int64_t>(j) * D, kr[u]);
        Load8(vb + static_cast<int64_t>(j) * D, vr[u]);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) kr[u][e] = vr[u][e] = 0;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) consume(kr[u], vr[u], j0 + u * STEP + sub < end);
  }
#endif
  // Merge the warp's TPW lane groups (same li, different tokens).
#pragma unroll
  for (int o = L; o < 32; o <<= 1) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float om = __shfl_xor_sync(0xffffffffu, m[g], o), ol = __shfl_xor_sync(0xffffffffu, l[g], o);
      const float M = fmaxf(m[g], om);
      const float c1 = m[g] == -INFINITY ? 0.0f : __expf(m[g] - M);
      const float c2 = om == -INFINITY ? 0.0f : __expf(om - M);
      l[g] = l[g] * c1 + ol * c2;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float oa = __shfl_xor_sync(0xffffffffu, acc[g][e], o);
        acc[g][e] = acc[g][e] * c1 + oa * c2;
      }
      m[g] = M;
    }
  }
  // Combine the warps of the block.
  KVSIM_SHARED(float, sm_m, [W][G]);
  KVSIM_SHARED(float, sm_l, [W][G]);
  KVSIM_SHARED(float, sm_acc, [W][G][D]);
  if (sub == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (lane == 0) {
        sm_m[warp][g] = m[g];
        sm_l[warp][g] = l[g];
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) sm_acc[warp][g][li * VEC + e] = acc[g][e];
    }
  }
  __syncthreads();
  // part layout per item: [G][D + 2]: unnormalised output, then max and sum.
  float* out = part + static_cast<int64_t>(blockIdx.x) * G * (D + 2);
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    const int g = idx / D, d = idx % D;
    float M = -INFINITY;
    for (int w = 0; w < W; ++w) M = fmaxf(M, sm_m[w][g]);
    float Lsum = 0, A = 0;
    for (int w = 0; w < W; ++w) {
      const float mw = sm_m[w][g];
      const float c = mw == -INFINITY ? 0.0f : __expf(mw - M);
      Lsum += sm_l[w][g] * c;
      A += sm_acc[w][g][d] * c;
    }
    out[g * (D + 2) + d] = A;
    if (d == 0) {
      out[g * (D + 2) + D] = M;
      out[g * (D + 2) + D + 1] = Lsum;
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
Status LaunchAttentionTyped(const AttentionArgs& a, cudaStream_t s) {
  if (a.num_items > 0)
    KVSIM_RETURN_IF_ERROR(Launch(SplitKvKernel<T, D, G>, dim3(a.num_items), dim3(kAttnThreads), s,
                                 static_cast<const T*>(a.q), static_cast<const T*>(a.k),
                                 static_cast<const T*>(a.v), a.offset, reinterpret_cast<const int4*>(a.items),
                                 a.scale, a.partials));
  return Launch(CombineKernel<OutT, D, G>, dim3(a.num_kv_heads * G), dim3(D), s,
                static_cast<const float*>(a.partials), a.head_first, static_cast<OutT*>(a.out));
}

template <typename T, int D, int G>
Status LaunchAttentionOut(const AttentionArgs& a, cudaStream_t s) {
  return a.out_fp32 ? LaunchAttentionTyped<T, float, D, G>(a, s) : LaunchAttentionTyped<T, T, D, G>(a, s);
}

template <typename T, int D>
Status LaunchAttentionGroup(const AttentionArgs& a, cudaStream_t s) {
  switch (a.group) {
    case 1:
      return LaunchAttentionOut<T, D, 1>(a, s);
    case 2:
      return LaunchAttentionOut<T, D, 2>(a, s);
    case 4:
      return LaunchAttentionOut<T, D, 4>(a, s);
    case 7:
      return LaunchAttentionOut<T, D, 7>(a, s);
    case 8:
      return LaunchAttentionOut<T, D, 8>(a, s);
  }
  return Status::InvalidArgument("decode attention: GQA group size " + std::to_string(a.group) +
                                 " not compiled (1, 2, 4, 7, 8)");
}

template <typename T>
Status LaunchAttentionDim(const AttentionArgs& a, cudaStream_t s) {
  if (a.head_dim == 64) return LaunchAttentionGroup<T, 64>(a, s);
  if (a.head_dim == 128) return LaunchAttentionGroup<T, 128>(a, s);
  return Status::InvalidArgument("decode attention: head_dim " + std::to_string(a.head_dim) +
                                 " not compiled (64, 128)");
}

// Enqueues the split-KV kernel (if any item) and the combine kernel.
inline Status LaunchDecodeAttentionKernels(const AttentionArgs& a, cudaStream_t s) {
  return a.dtype == Dtype::kF16 ? LaunchAttentionDim<F16>(a, s) : LaunchAttentionDim<BF16>(a, s);
}

}  // namespace KVSIM_KERNELS_NS

#if defined(__CUDACC__)
// attention.cu: the kernels above for the real device (decoder.cu uses it too).
Status LaunchDecodeAttention(const AttentionArgs& a, cudaStream_t s);
#endif

}  // namespace kvsim::gpu_replay
