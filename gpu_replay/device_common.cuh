#pragma once
// Device code shared by nvcc and the host compiler. Every gpu_replay kernel lives in a .cuh header written
// against this file: nvcc compiles it into the .cu files (real CUDA), g++ into the host execution layer
// (gpu_replay/host_exec.h: thread blocks as fibers, race / divergence / deadlock checks; the tests in
// tests/gpu_replay/host_*_test.cc compare every kernel with its CPU reference on the CPU).
//
// Kernel code written for both follows four rules (docs/gpu-replay.md, "CPU verification"):
//   * kernels and their device helpers live in namespace kvsim::gpu_replay::KVSIM_KERNELS_NS ("cuda" under
//     nvcc, "host" under g++), so both builds link into one binary without clashing symbols;
//   * shared memory is declared with KVSIM_SHARED(type, name, dims), not `__shared__` (the host layer
//     tracks every access to it);
//   * kernels are launched with Launch(kernel, grid, block, stream, args...), not <<<>>>;
//   * 16-bit storage types are F16 / BF16, converted with ToF / FromF<T>.
// Tensor cores are used through nvcuda::wmma (16x16x16, fp16 / bf16 inputs, fp32 accumulators), which the
// host layer emulates as warp collectives (gpu_replay/host_exec.h).

#include <cstdint>
#include <string>
#include <utility>

#include "sim/status.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>
#define KVSIM_KERNELS_NS cuda
// Shared memory; all of it 32-byte aligned (vector loads; WMMA tiles need 32 bytes).
#define KVSIM_SHARED(type, name, dims) __shared__ __align__(32) type name dims
#else
#include "gpu_replay/host_exec.h"
#define KVSIM_KERNELS_NS host
#define KVSIM_SHARED(type, name, dims)           \
  static const char kvsim_shared_key_##name = 0; \
  auto name = ::kvsim::gpu_replay::hx::DeclareShared<type dims>(&kvsim_shared_key_##name, #name)
#endif

namespace kvsim::gpu_replay::KVSIM_KERNELS_NS {

#if defined(__CUDACC__)
using F16 = __half;
using BF16 = __nv_bfloat16;

__device__ __forceinline__ float ToF(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToF(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ToF(float x) { return x; }
template <typename T>
__device__ __forceinline__ T FromF(float x);
template <>
__device__ __forceinline__ __half FromF<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ float FromF<float>(float x) {
  return x;
}

// Enqueues `kernel` on `stream`; the launch error (if any) as a Status.
template <typename... P, typename... A>
Status Launch(void (*kernel)(P...), dim3 grid, dim3 block, cudaStream_t stream, A&&... args) {
  kernel<<<grid, block, 0, stream>>>(std::forward<A>(args)...);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return Status::Internal(std::string("kernel launch failed: ") + cudaGetErrorName(e) + " (" +
                            cudaGetErrorString(e) + ")");
  return Status::Ok();
}
#else
using F16 = hx::Half;
using BF16 = hx::Bf16;

inline float ToF(hx::Half x) { return HalfToFloat(x.bits); }
inline float ToF(hx::Bf16 x) { return Bf16ToFloat(x.bits); }
inline float ToF(float x) { return x; }
template <typename T>
inline T FromF(float x) {
  if constexpr (std::is_same_v<T, hx::Half>) {
    return hx::Half{FloatToHalf(x)};
  } else if constexpr (std::is_same_v<T, hx::Bf16>) {
    return hx::Bf16{FloatToBf16(x)};
  } else {
    static_assert(std::is_same_v<T, float>);
    return x;
  }
}

// Runs `kernel` on the host execution layer now (the stream is ignored); a race, divergent barrier,
// deadlock or timeout comes back as an error Status.
template <typename... P, typename... A>
Status Launch(void (*kernel)(P...), dim3 grid, dim3 block, cudaStream_t, A&&... args) {
  return hx::LaunchKernel(kernel, grid, block, std::forward<A>(args)...);
}
#endif

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Exclusive prefix sum of `v` over the block (NT threads, a multiple of 32); *total = the block's sum.
// `warp_sums` is shared scratch of NT / 32 ints. Contains two __syncthreads; like cub::BlockScan, a
// __syncthreads is needed before `warp_sums` is reused.
template <int NT, typename S>
__device__ __forceinline__ int BlockExclusiveSum(int v, int* total, S& warp_sums) {
  static_assert(NT % 32 == 0 && NT <= 1024, "BlockExclusiveSum: NT must be a multiple of 32, <= 1024");
  constexpr int NW = NT / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int x = v;  // inclusive scan within the warp
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < NW ? static_cast<int>(warp_sums[lane]) : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    if (lane < NW) warp_sums[lane] = w;
  }
  __syncthreads();
  *total = warp_sums[NW - 1];
  return (warp == 0 ? 0 : static_cast<int>(warp_sums[warp - 1])) + x - v;
}

}  // namespace kvsim::gpu_replay::KVSIM_KERNELS_NS

namespace kvsim::gpu_replay {
// Same hash as gpu_replay/dtype.h HashUniform (host and device).
__host__ __device__ __forceinline__ float DeviceHashUniform(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + i + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<int64_t>(z >> 40) - (1ll << 23)) * (1.0f / (1 << 23));
}
}  // namespace kvsim::gpu_replay
