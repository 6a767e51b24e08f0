#pragma once
// The bandwidth kernels of the lower bound (gpu_common.cu TimeCopy), shared by nvcc and the host execution
// layer: a grid-stride vectorised copy (16-byte elements; read + write bandwidth) and a read-only kernel
// (the bandwidth of the lower bound, which only reads weights and KV; also the L2 flush: it leaves L2
// holding clean lines, where a memset would leave dirty ones to be written back inside the timed region).

#include "gpu_replay/device_common.cuh"

namespace kvsim::gpu_replay::KVSIM_KERNELS_NS {

template <typename V>
__global__ void CopyKernel(const V* __restrict__ src, V* __restrict__ dst, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

// Reads src[0, n) (int4): XORs every word and folds the result into *sink (one atomic per warp), so the
// loads cannot be elided; *sink ends as the XOR of all words when it starts at 0. (A template: the header
// is included by several files.) Block size: a multiple of 32.
template <int kUnused = 0>
__global__ void ReadKernel(const int4* __restrict__ src, size_t n, int* __restrict__ sink) {
  int acc = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int4 x = src[i];
    acc ^= x.x ^ x.y ^ x.z ^ x.w;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if (threadIdx.x % 32 == 0) atomicXor(sink, acc);
}

}  // namespace kvsim::gpu_replay::KVSIM_KERNELS_NS
