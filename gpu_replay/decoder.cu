// One decoder step at model shapes with random weights (generated on the device by the same hash as the CPU
// reference, gpu_replay/decoder_ref.cc): per layer add+RMSNorm, QKV GEMV (cuBLAS, fp32 accumulation),
// bias + RoPE + KV append in place into the ragged cache, split-KV decode attention, O GEMV, add+RMSNorm,
// gate/up GEMV, SwiGLU, down GEMV; final RMSNorm and LM head. The whole step is captured in a CUDA graph.
// Every replay of the graph appends at the same slot (lengths[h]): a steady-state step at these lengths.

#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "gpu_replay/attention_kernels.cuh"
#include "gpu_replay/decoder_kernels.cuh"
#include "gpu_replay/gpu_common.cuh"

namespace kvsim::gpu_replay {
namespace {

Status Cublas(cublasStatus_t st, const char* what) {
  if (st == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return Status::Internal(std::string("cuBLAS error ") + std::to_string(static_cast<int>(st)) + " in " +
                          what);
}
#define KVSIM_CUBLAS(expr) KVSIM_RETURN_IF_ERROR(Cublas((expr), #expr))

template <typename T>
constexpr cudaDataType_t CudaType() {
  return std::is_same_v<T, __half> ? CUDA_R_16F : CUDA_R_16BF;
}

template <typename T>
class GpuDecoder {
 public:
  Status Init(const DecoderProblem& p) {
    p_ = p;
    const ModelShape& s = p.shape;
    KVSIM_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    KVSIM_CUBLAS(cublasCreate(&cublas_));
    KVSIM_CUBLAS(cublasSetStream(cublas_, stream_));
    KVSIM_RETURN_IF_ERROR(workspace_.Alloc(32 << 20));
    KVSIM_CUBLAS(cublasSetWorkspace(cublas_, workspace_.ptr, workspace_.n));
    int sms = 0;
    KVSIM_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    for (int l = 0; l < s.num_layers; ++l) {
      layers_.push_back(std::make_unique<Layer>());
      Layer& L = *layers_[l];
      const int base = l * kTensorsPerLayer;
      KVSIM_RETURN_IF_ERROR(Fill(&L.attn_norm, base + kAttnNorm, s.hidden, true));
      KVSIM_RETURN_IF_ERROR(
          Fill(&L.wqkv, base + kWqkv, static_cast<int64_t>(s.qkv_rows()) * s.hidden, false));
      if (s.qkv_bias) KVSIM_RETURN_IF_ERROR(Fill(&L.bqkv, base + kBqkv, s.qkv_rows(), false));
      KVSIM_RETURN_IF_ERROR(
          Fill(&L.wo, base + kWo, static_cast<int64_t>(s.hidden) * s.num_heads * s.head_dim, false));
      KVSIM_RETURN_IF_ERROR(Fill(&L.mlp_norm, base + kMlpNorm, s.hidden, true));
      KVSIM_RETURN_IF_ERROR(Fill(&L.wgu, base + kWgateUp, 2LL * s.intermediate * s.hidden, false));
      KVSIM_RETURN_IF_ERROR(
          Fill(&L.wdown, base + kWdown, static_cast<int64_t>(s.hidden) * s.intermediate, false));
      const RaggedLayout layout = DecoderLayerLayout(p, l);
      KVSIM_RETURN_IF_ERROR(Fill(&L.k, kCacheKId + 2 * l, layout.total_slots * s.head_dim, false));
      KVSIM_RETURN_IF_ERROR(Fill(&L.v, kCacheVId + 2 * l, layout.total_slots * s.head_dim, false));
      KVSIM_RETURN_IF_ERROR(L.offset.Upload(layout.offset));
      KVSIM_RETURN_IF_ERROR(L.length.Upload(layout.length));
      std::vector<int32_t> attend(layout.length);
      for (int32_t& n : attend) ++n;  // the appended token
      const SplitKvPartition part = PartitionSplitKv(attend, AttentionTargetItems(sms), kSplitKvMinChunk);
      std::vector<int32_t> it;
      for (const WorkItem& w : part.items) it.insert(it.end(), {w.kv_head, w.begin, w.end, 0});
      KVSIM_RETURN_IF_ERROR(L.items.Upload(it));
      KVSIM_RETURN_IF_ERROR(L.head_first.Upload(part.head_first));
      L.num_items = static_cast<int>(part.items.size());
      max_items_ = std::max(max_items_, L.num_items);
    }
    KVSIM_RETURN_IF_ERROR(inv_freq_.Upload(RopeInvFreq(s)));
    KVSIM_RETURN_IF_ERROR(Fill(&final_norm_, kFinalNormId, s.hidden, true));
    KVSIM_RETURN_IF_ERROR(Fill(&lm_head_, kLmHeadId, static_cast<int64_t>(s.vocab) * s.hidden, false));
    KVSIM_RETURN_IF_ERROR(Fill(&input16_, kInputId, s.hidden, false));
    KVSIM_RETURN_IF_ERROR(x_.Alloc(s.hidden));
    KVSIM_RETURN_IF_ERROR(xn_.Alloc(s.hidden));
    KVSIM_RETURN_IF_ERROR(qkv_.Alloc(s.qkv_rows()));
    KVSIM_RETURN_IF_ERROR(q_.Alloc(static_cast<size_t>(s.num_heads) * s.head_dim));
    KVSIM_RETURN_IF_ERROR(attn_.Alloc(static_cast<size_t>(s.num_heads) * s.head_dim));
    KVSIM_RETURN_IF_ERROR(tmp_.Alloc(std::max(s.hidden, 2 * s.intermediate)));
    KVSIM_RETURN_IF_ERROR(act_.Alloc(s.intermediate));
    KVSIM_RETURN_IF_ERROR(logits_.Alloc(s.vocab));
    KVSIM_RETURN_IF_ERROR(partials_.Alloc(static_cast<size_t>(std::max(1, max_items_)) * s.num_heads /
                                          s.num_kv_heads * (s.head_dim + 2)));
    KVSIM_CUDA(cudaStreamSynchronize(stream_));
    return Status::Ok();
  }

  ~GpuDecoder() {
    if (step_exec_) cudaGraphExecDestroy(step_exec_);
    if (attn_exec_) cudaGraphExecDestroy(attn_exec_);
    if (cublas_) cublasDestroy(cublas_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  // Enqueues one step (attention_only: every layer's attention kernels and nothing else).
  Status Enqueue(bool attention_only) {
    const ModelShape& s = p_.shape;
    cudaStream_t st = stream_;
    if (!attention_only) {
      // x = input (fp32 copy of the 16-bit input).
      KVSIM_RETURN_IF_ERROR(InputToX());
    }
    for (int l = 0; l < s.num_layers; ++l) {
      Layer& L = *layers_[l];
      if (!attention_only) {
        KVSIM_RETURN_IF_ERROR(Launch(AddRmsNormKernel<T>, dim3(1), dim3(1024), st, x_.ptr,
                                     l == 0 ? nullptr : Ptr(tmp_), Ptr(L.attn_norm), Ptr(xn_), s.hidden,
                                     s.rms_eps));
        KVSIM_RETURN_IF_ERROR(Gemv(L.wqkv, xn_, qkv_, s.qkv_rows(), s.hidden));
        KVSIM_RETURN_IF_ERROR(Launch(RopeAppendKernel<T>, dim3(s.num_heads + 2 * s.num_kv_heads),
                                     dim3(s.head_dim / 2), st, Ptr(qkv_), s.qkv_bias ? Ptr(L.bqkv) : nullptr,
                                     s.num_heads, s.num_kv_heads, s.head_dim, p_.position,
                                     static_cast<const float*>(inv_freq_.ptr), Ptr(q_), Ptr(L.k), Ptr(L.v),
                                     L.offset.ptr, L.length.ptr));
      }
      AttentionArgs a{p_.dtype,
                      s.head_dim,
                      s.num_heads / s.num_kv_heads,
                      s.num_kv_heads,
                      1.0f / std::sqrt(static_cast<float>(s.head_dim)),
                      L.num_items,
                      q_.ptr,
                      L.k.ptr,
                      L.v.ptr,
                      L.offset.ptr,
                      L.items.ptr,
                      L.head_first.ptr,
                      partials_.ptr,
                      attn_.ptr,
                      false};
      KVSIM_RETURN_IF_ERROR(LaunchDecodeAttention(a, st));
      if (attention_only) continue;
      KVSIM_RETURN_IF_ERROR(Gemv(L.wo, attn_, tmp_, s.hidden, s.num_heads * s.head_dim));
      KVSIM_RETURN_IF_ERROR(Launch(AddRmsNormKernel<T>, dim3(1), dim3(1024), st, x_.ptr, Ptr(tmp_),
                                   Ptr(L.mlp_norm), Ptr(xn_), s.hidden, s.rms_eps));
      KVSIM_RETURN_IF_ERROR(Gemv(L.wgu, xn_, tmp_, 2 * s.intermediate, s.hidden));
      KVSIM_RETURN_IF_ERROR(Launch(SwiGluKernel<T>, dim3((s.intermediate + 255) / 256), dim3(256), st,
                                   Ptr(tmp_), s.intermediate, Ptr(act_)));
      KVSIM_RETURN_IF_ERROR(Gemv(L.wdown, act_, tmp_, s.hidden, s.intermediate));
    }
    if (!attention_only) {
      KVSIM_RETURN_IF_ERROR(Launch(AddRmsNormKernel<T>, dim3(1), dim3(1024), st, x_.ptr, Ptr(tmp_),
                                   Ptr(final_norm_), Ptr(xn_), s.hidden, s.rms_eps));
      const float one = 1.0f, zero = 0.0f;
      KVSIM_CUBLAS(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, s.vocab, 1, s.hidden, &one, lm_head_.ptr,
                                CudaType<T>(), s.hidden, xn_.ptr, CudaType<T>(), s.hidden, &zero, logits_.ptr,
                                CUDA_R_32F, s.vocab, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    KVSIM_CUDA(cudaGetLastError());
    return Status::Ok();
  }

  Status Capture(bool attention_only, cudaGraphExec_t* exec) {
    cudaGraph_t graph;
    KVSIM_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    Status st = Enqueue(attention_only);
    const cudaError_t e = cudaStreamEndCapture(stream_, &graph);
    KVSIM_RETURN_IF_ERROR(st);
    KVSIM_CUDA(e);
    KVSIM_CUDA(cudaGraphInstantiate(exec, graph, 0));
    KVSIM_CUDA(cudaGraphDestroy(graph));
    return Status::Ok();
  }

  Status BuildGraphs() {
    KVSIM_RETURN_IF_ERROR(Capture(false, &step_exec_));
    return Capture(true, &attn_exec_);
  }
  Status LaunchStep(cudaStream_t s) {
    KVSIM_CUDA(cudaGraphLaunch(step_exec_, s));
    return Status::Ok();
  }
  Status LaunchAttention(cudaStream_t s) {
    KVSIM_CUDA(cudaGraphLaunch(attn_exec_, s));
    return Status::Ok();
  }
  cudaStream_t stream() const { return stream_; }
  Status Logits(std::vector<float>* out) {
    KVSIM_CUDA(cudaStreamSynchronize(stream_));
    return logits_.Download(out);
  }

 private:
  struct Layer {
    DeviceBuffer<uint16_t> attn_norm, wqkv, bqkv, wo, mlp_norm, wgu, wdown, k, v;
    DeviceBuffer<int64_t> offset;
    DeviceBuffer<int32_t> length, items, head_first;
    int num_items = 0;
  };
  static T* Ptr(DeviceBuffer<uint16_t>& b) { return reinterpret_cast<T*>(b.ptr); }

  Status Fill(DeviceBuffer<uint16_t>* b, int id, int64_t n, bool norm) {
    KVSIM_RETURN_IF_ERROR(b->Alloc(n));
    return Launch(FillKernel<T>, dim3(1024), dim3(256), stream_, Ptr(*b), n, TensorSeed(p_.seed, id),
                  TensorScale(p_.shape, id), norm);
  }
  Status InputToX() {
    auto* in = Ptr(input16_);
    float* x = x_.ptr;
    const int n = p_.shape.hidden;
    return Launch(ToFloatKernel<T>, dim3((n + 255) / 256), dim3(256), stream_, static_cast<const T*>(in), x,
                  n);
  }
  // y[rows] = W[rows][cols] x (row-major W = column-major W^T).
  Status Gemv(DeviceBuffer<uint16_t>& w, DeviceBuffer<uint16_t>& x, DeviceBuffer<uint16_t>& y, int rows,
              int cols) {
    const float one = 1.0f, zero = 0.0f;
    KVSIM_CUBLAS(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, rows, 1, cols, &one, w.ptr, CudaType<T>(),
                              cols, x.ptr, CudaType<T>(), cols, &zero, y.ptr, CudaType<T>(), rows,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return Status::Ok();
  }

  DecoderProblem p_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  DeviceBuffer<uint8_t> workspace_;
  std::vector<std::unique_ptr<Layer>> layers_;
  DeviceBuffer<uint16_t> final_norm_, lm_head_, input16_, xn_, qkv_, q_, attn_, tmp_, act_;
  DeviceBuffer<float> x_, logits_, partials_, inv_freq_;
  int max_items_ = 0;
  cudaGraphExec_t step_exec_ = nullptr, attn_exec_ = nullptr;
};

template <typename T>
Status RunDecoder(const DecoderProblem& p, std::vector<float>* logits) {
  GpuDecoder<T> dec;
  KVSIM_RETURN_IF_ERROR(dec.Init(p));
  KVSIM_RETURN_IF_ERROR(dec.Enqueue(false));
  std::vector<float> direct;
  KVSIM_RETURN_IF_ERROR(dec.Logits(&direct));
  KVSIM_RETURN_IF_ERROR(dec.BuildGraphs());
  KVSIM_RETURN_IF_ERROR(dec.LaunchStep(dec.stream()));
  KVSIM_RETURN_IF_ERROR(dec.Logits(logits));
  if (direct != *logits)
    return Status::Internal("decoder step: the CUDA graph's logits differ from the direct launch's");
  return Status::Ok();
}

template <typename T>
StatusOr<DecoderTiming> TimeDecoder(const DecoderProblem& p, const TimingOptions& o) {
  Timer timer;
  KVSIM_RETURN_IF_ERROR(timer.Init());
  GpuDecoder<T> dec;
  KVSIM_RETURN_IF_ERROR(dec.Init(p));
  // One eager run before capture: cuBLAS's lazy initialisation and first-call work happen outside the graph.
  KVSIM_RETURN_IF_ERROR(dec.Enqueue(false));
  KVSIM_CUDA(cudaStreamSynchronize(dec.stream()));
  KVSIM_RETURN_IF_ERROR(dec.BuildGraphs());
  DecoderTiming t;
  KVSIM_ASSIGN_OR_RETURN(t.step, timer.Time([&](cudaStream_t s) { return dec.LaunchStep(s); }, o));
  KVSIM_ASSIGN_OR_RETURN(t.attention, timer.Time([&](cudaStream_t s) { return dec.LaunchAttention(s); }, o));
  return t;
}

}  // namespace

Status GpuDecoderStep(const DecoderProblem& p, std::vector<float>* logits) {
  KVSIM_RETURN_IF_ERROR(RequireDevice());
  return p.dtype == Dtype::kF16 ? RunDecoder<__half>(p, logits) : RunDecoder<__nv_bfloat16>(p, logits);
}

StatusOr<DecoderTiming> TimeDecoderStep(const DecoderProblem& p, const TimingOptions& o) {
  KVSIM_RETURN_IF_ERROR(RequireDevice());
  return p.dtype == Dtype::kF16 ? TimeDecoder<__half>(p, o) : TimeDecoder<__nv_bfloat16>(p, o);
}

}  // namespace kvsim::gpu_replay
