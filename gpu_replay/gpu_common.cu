// Device queries, error handling, the L2 flush, and the bandwidth kernels (gpu_api.h TimeCopy, TimeRead).

#include <cstdio>

#include "gpu_replay/copy_kernels.cuh"
#include "gpu_replay/gpu_common.cuh"

namespace kvsim::gpu_replay {

Status CudaError(cudaError_t e, const char* what, const char* file, int line) {
  return Status::Internal(std::string("CUDA error ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
                          ") in " + what + " at " + file + ":" + std::to_string(line));
}

Status RequireDevice() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error
    return Status::FailedPrecondition(std::string("no CUDA device: ") + cudaGetErrorString(e));
  }
  if (n == 0) return Status::FailedPrecondition("no CUDA device: cudaGetDeviceCount returned 0");
  KVSIM_CUDA(cudaSetDevice(0));
  return Status::Ok();
}

DeviceInfo QueryDevice(int device) {
  DeviceInfo d;
  d.built_with_cuda = true;
  d.device = device;
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    d.reason = std::string("no CUDA device: ") + cudaGetErrorString(e);
    return d;
  }
  if (n <= device) {
    d.reason =
        "no CUDA device: " + std::to_string(n) + " device(s), asked for device " + std::to_string(device);
    return d;
  }
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, device) != cudaSuccess) {
    d.reason = "no CUDA device: cudaGetDeviceProperties failed";
    return d;
  }
  d.available = true;
  d.name = p.name;
  d.sm_count = p.multiProcessorCount;
  d.cc_major = p.major;
  d.cc_minor = p.minor;
  d.total_mem_gib = p.totalGlobalMem / double(1 << 30);
  d.l2_bytes = p.l2CacheSize;
  int clock = 0, bus = 0;
  cudaDeviceGetAttribute(&clock, cudaDevAttrMemoryClockRate, device);
  cudaDeviceGetAttribute(&bus, cudaDevAttrGlobalMemoryBusWidth, device);
  d.mem_clock_khz = clock;
  d.mem_bus_bits = bus;
  return d;
}

Status Timer::Init() {
  KVSIM_RETURN_IF_ERROR(RequireDevice());
  KVSIM_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  KVSIM_CUDA(cudaEventCreate(&start_));
  KVSIM_CUDA(cudaEventCreate(&stop_));
  int l2 = 0;
  KVSIM_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  KVSIM_RETURN_IF_ERROR(sink_.Alloc(1));
  return flush_.Alloc(std::max<size_t>(1, 4 * static_cast<size_t>(l2) / sizeof(int4)));  // 4x L2
}

Timer::~Timer() {
  if (start_) cudaEventDestroy(start_);
  if (stop_) cudaEventDestroy(stop_);
  if (stream_) cudaStreamDestroy(stream_);
}

Status Timer::FlushL2() {
  int sms = 0;
  KVSIM_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  return Launch(ReadKernel<>, dim3(sms * 4), dim3(512), stream_, static_cast<const int4*>(flush_.ptr),
                flush_.n, sink_.ptr);
}

StatusOr<TimingSummary> TimeCopy(size_t bytes, const TimingOptions& o, double* gb_per_s) {
  Timer timer;
  KVSIM_RETURN_IF_ERROR(timer.Init());
  const size_t n = bytes / sizeof(int4);
  DeviceBuffer<int4> a, b;
  KVSIM_RETURN_IF_ERROR(a.Alloc(n));
  KVSIM_RETURN_IF_ERROR(b.Alloc(n));
  int sms = 0;
  KVSIM_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  auto t = timer.Time(
      [&](cudaStream_t s) -> Status {
        return Launch(CopyKernel<int4>, dim3(sms * 8), dim3(512), s, static_cast<const int4*>(a.ptr), b.ptr,
                      n);
      },
      o);
  if (t.ok() && gb_per_s) *gb_per_s = 2.0 * n * sizeof(int4) / (t->median * 1e-6) / 1e9;
  return t;
}

StatusOr<TimingSummary> TimeRead(size_t bytes, const TimingOptions& o, double* gb_per_s) {
  Timer timer;
  KVSIM_RETURN_IF_ERROR(timer.Init());
  const size_t n = bytes / sizeof(int4);
  DeviceBuffer<int4> a;
  DeviceBuffer<int> sink;
  KVSIM_RETURN_IF_ERROR(a.Alloc(n));
  KVSIM_RETURN_IF_ERROR(sink.Alloc(1));
  int sms = 0;
  KVSIM_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  auto t = timer.Time(
      [&](cudaStream_t s) {
        return Launch(ReadKernel<>, dim3(sms * 8), dim3(512), s, static_cast<const int4*>(a.ptr), n,
                      sink.ptr);
      },
      o);
  if (t.ok() && gb_per_s) *gb_per_s = 1.0 * n * sizeof(int4) / (t->median * 1e-6) / 1e9;
  return t;
}

}  // namespace kvsim::gpu_replay
