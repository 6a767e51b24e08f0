// Device queries, error handling, the L2 flush, and the copy-bandwidth kernel (gpu_api.h TimeCopy).

#include <cstdio>

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
  return flush_.Alloc(std::max<size_t>(1, 4 * static_cast<size_t>(l2) / sizeof(int4)));  // 4x L2
}

Timer::~Timer() {
  if (start_) cudaEventDestroy(start_);
  if (stop_) cudaEventDestroy(stop_);
  if (stream_) cudaStreamDestroy(stream_);
}

Status Timer::FlushL2() {
  KVSIM_CUDA(
      cudaMemsetAsync(flush_.ptr, static_cast<int>(flush_.n & 0xff), flush_.n * sizeof(int4), stream_));
  return Status::Ok();
}

namespace {
__global__ void CopyKernel(const int4* __restrict__ src, int4* __restrict__ dst, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}
}  // namespace

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
        CopyKernel<<<sms * 8, 512, 0, s>>>(a.ptr, b.ptr, n);
        KVSIM_CUDA(cudaGetLastError());
        return Status::Ok();
      },
      o);
  if (t.ok() && gb_per_s) *gb_per_s = 2.0 * n * sizeof(int4) / (t->median * 1e-6) / 1e9;
  return t;
}

}  // namespace kvsim::gpu_replay
