#pragma once
// Shared CUDA helpers of gpu_replay: error handling into Status, RAII device buffers, 16-bit type traits,
// warp reductions, event timing with an L2 flush between samples.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "gpu_replay/gpu_api.h"

namespace kvsim::gpu_replay {

Status CudaError(cudaError_t e, const char* what, const char* file, int line);

#define KVSIM_CUDA(expr)                                                                         \
  do {                                                                                           \
    cudaError_t _e = (expr);                                                                     \
    if (_e != cudaSuccess) return ::kvsim::gpu_replay::CudaError(_e, #expr, __FILE__, __LINE__); \
  } while (0)

// FailedPrecondition("no CUDA device: ...") unless a device is usable; selects device 0.
Status RequireDevice();

template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t n = 0;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  Status Alloc(size_t count) {
    if (ptr) cudaFree(ptr);
    ptr = nullptr;
    n = count;
    if (count == 0) return Status::Ok();
    KVSIM_CUDA(cudaMalloc(&ptr, count * sizeof(T)));
    KVSIM_CUDA(cudaMemset(ptr, 0, count * sizeof(T)));
    return Status::Ok();
  }
  Status Upload(const T* host, size_t count) {
    KVSIM_RETURN_IF_ERROR(Alloc(count));
    if (count) KVSIM_CUDA(cudaMemcpy(ptr, host, count * sizeof(T), cudaMemcpyHostToDevice));
    return Status::Ok();
  }
  Status Upload(const std::vector<T>& v) { return Upload(v.data(), v.size()); }
  Status Download(std::vector<T>* out) const {
    out->resize(n);
    if (n) KVSIM_CUDA(cudaMemcpy(out->data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return Status::Ok();
  }
};

// 16-bit storage: uint16_t on the host, these on the device (same bits).
template <typename T>
__device__ __forceinline__ float ToF(T x);
template <>
__device__ __forceinline__ float ToF<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float ToF<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
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

// Same hash as gpu_replay/dtype.h HashUniform.
__host__ __device__ __forceinline__ float DeviceHashUniform(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + i + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<int64_t>(z >> 40) - (1ll << 23)) * (1.0f / (1 << 23));
}

// Event timing: `launch(stream)` enqueues one sample's work; an L2 flush precedes each sample when asked.
class Timer {
 public:
  Status Init();
  ~Timer();
  template <typename F>
  StatusOr<TimingSummary> Time(F&& launch, const TimingOptions& o) {
    for (int i = 0; i < o.warmup; ++i) KVSIM_RETURN_IF_ERROR(launch(stream_));
    KVSIM_CUDA(cudaStreamSynchronize(stream_));
    std::vector<double> us;
    for (int i = 0; i < o.repeats; ++i) {
      if (o.flush_l2) KVSIM_RETURN_IF_ERROR(FlushL2());
      KVSIM_CUDA(cudaEventRecord(start_, stream_));
      KVSIM_RETURN_IF_ERROR(launch(stream_));
      KVSIM_CUDA(cudaEventRecord(stop_, stream_));
      KVSIM_CUDA(cudaEventSynchronize(stop_));
      float ms = 0;
      KVSIM_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
      us.push_back(ms * 1e3);
    }
    KVSIM_CUDA(cudaGetLastError());
    return Summarize(us);
  }
  cudaStream_t stream() const { return stream_; }

 private:
  Status FlushL2();
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  DeviceBuffer<int4> flush_;
};

}  // namespace kvsim::gpu_replay
