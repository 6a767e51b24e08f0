#pragma once
// Shared CUDA helpers of gpu_replay (nvcc only): error handling into Status, RAII device buffers, event
// timing with an L2 flush between samples. Device code shared with the host execution layer:
// device_common.cuh.

#include <string>
#include <vector>

#include "gpu_replay/device_common.cuh"  // CUDA headers, ToF / FromF, warp reductions, Launch
#include "gpu_replay/gpu_api.h"

namespace kvsim::gpu_replay {

using namespace cuda;  // the device code of device_common.cuh and the kernel headers

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

// Event timing: `launch(stream)` enqueues one sample's work; an L2 flush precedes each sample when asked (a
// read-only kernel over 4x L2: L2 then holds clean lines, nothing to write back inside the timed region).
class Timer {
 public:
  Status Init();
  ~Timer();
  template <typename F>
  StatusOr<TimingSummary> Time(F&& launch, const TimingOptions& o) {
    return Time([](cudaStream_t) { return Status::Ok(); }, launch, o);
  }
  // `prepare(stream)` runs before every sample, outside the timed region (e.g. zeroing accumulators).
  template <typename P, typename F>
  StatusOr<TimingSummary> Time(P&& prepare, F&& launch, const TimingOptions& o) {
    for (int i = 0; i < o.warmup; ++i) {
      KVSIM_RETURN_IF_ERROR(prepare(stream_));
      KVSIM_RETURN_IF_ERROR(launch(stream_));
    }
    KVSIM_CUDA(cudaStreamSynchronize(stream_));
    std::vector<double> us;
    for (int i = 0; i < o.repeats; ++i) {
      KVSIM_RETURN_IF_ERROR(prepare(stream_));
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
  DeviceBuffer<int> sink_;
};

}  // namespace kvsim::gpu_replay
