#pragma once
// The decoder step's own kernels (the GEMVs are cuBLAS), device code for nvcc (decoder.cu) and the host
// execution layer (host_kernels.cc): weight generation, add + RMSNorm, bias + RoPE + KV append, fp32 copy,
// SwiGLU.

#include "gpu_replay/device_common.cuh"

namespace kvsim::gpu_replay::KVSIM_KERNELS_NS {

template <typename T>
__global__ void FillKernel(T* out, int64_t n, uint64_t seed, float scale, bool norm) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float u = DeviceHashUniform(seed, static_cast<uint64_t>(i)) * scale;
    out[i] = FromF<T>(norm ? 1.0f + u : u);
  }
}

// x += delta (if any); out = RMSNorm(x) * w. One block.
template <typename T>
__global__ void AddRmsNormKernel(float* __restrict__ x, const T* __restrict__ delta, const T* __restrict__ w,
                                 T* __restrict__ out, int n, float eps) {
  KVSIM_SHARED(float, red, [32]);
  float ss = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float v = x[i];
    if (delta) {
      v += ToF(delta[i]);
      x[i] = v;
    }
    ss += v * v;
  }
  ss = WarpSum(ss);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float t = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : 0.0f;
    t = WarpSum(t);
    if (threadIdx.x == 0) red[0] = t;
  }
  __syncthreads();
  const float inv = rsqrtf(red[0] / n + eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = FromF<T>(x[i] * inv * ToF(w[i]));
}

// q heads -> q buffer (RoPE), k heads -> cache slot lengths[h] (RoPE), v heads -> cache slot (bias only).
template <typename T>
__global__ void RopeAppendKernel(const T* __restrict__ qkv, const T* __restrict__ bias, int hq, int hkv,
                                 int d, int position, const float* __restrict__ inv_freq, T* __restrict__ q,
                                 T* __restrict__ kc, T* __restrict__ vc, const int64_t* __restrict__ offset,
                                 const int32_t* __restrict__ length) {
  const int head = blockIdx.x, i = threadIdx.x, half = d / 2;
  auto val = [&](int c) {
    const int64_t idx = static_cast<int64_t>(head) * d + c;
    return ToF(qkv[idx]) + (bias ? ToF(bias[idx]) : 0.0f);
  };
  if (head >= hq + hkv) {  // value head
    const int h = head - hq - hkv;
    T* dst = vc + (offset[h] + length[h]) * d;
    dst[i] = FromF<T>(val(i));
    dst[i + half] = FromF<T>(val(i + half));
    return;
  }
  const float ang = static_cast<float>(position) * inv_freq[i];  // frequencies from the host (RopeInvFreq)
  const float c = cosf(ang), s = sinf(ang), x1 = val(i), x2 = val(i + half);
  T* dst = head < hq ? q + static_cast<int64_t>(head) * d : kc + (offset[head - hq] + length[head - hq]) * d;
  dst[i] = FromF<T>(x1 * c - x2 * s);
  dst[i + half] = FromF<T>(x2 * c + x1 * s);
}

template <typename T>
__global__ void ToFloatKernel(const T* in, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = ToF(in[i]);
}

template <typename T>
__global__ void SwiGluKernel(const T* __restrict__ gu, int inter, T* __restrict__ out) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < inter; i += gridDim.x * blockDim.x) {
    const float g = ToF(gu[i]), u = ToF(gu[inter + i]);
    out[i] = FromF<T>(g / (1.0f + __expf(-g)) * u);
  }
}

}  // namespace kvsim::gpu_replay::KVSIM_KERNELS_NS
