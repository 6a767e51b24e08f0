#pragma once
// Decode-latency performance model of a GPU (docs/latency.md). No GPU is measured here: the model combines
// vendor specifications with constants fitted once to published measurements (bench/latency_anchors.cc,
// configs/devices/*.textproto), and every number it gives is labelled "modelled".
//
// Pieces:
//  - a streaming kernel reads B bytes in work units (thread blocks); they share the aggregate bandwidth
//    peak * e(B) equally (processor sharing, a fluid schedule) and each SM streams at most
//    unit_bandwidth_share * peak / SMs, so few or unequal units leave bandwidth unused and the longest unit
//    bounds the kernel; e(B) = e_max / (1 + (B_half / B)^hill) is the size-dependent efficiency;
//  - decode attention: every (request, KV head) cache is cut into chunks (split-KV) that become work units;
//    a GQA unit reads its KV head once for the whole query group;
//  - projections, MLP and LM head: GEMV/GEMM rooflines (max of weight streaming and tensor-core FLOPs);
//  - a fixed cost per kernel call (standalone: launch_us; inside the CUDA-graph decode step:
//    graph_kernel_us);
//  - prefill: GEMMs and causal flash attention at assumed fractions of the tensor-core peak;
//  - a policy's own GPU work (observation-window scoring, top-k, merging) at the event where it runs.

#include <span>
#include <string>
#include <vector>

#include "sim/device.pb.h"
#include "sim/gpu_work.h"
#include "sim/status.h"

namespace kvsim {

// Built-in device profiles (configs/devices/*.textproto) and model presets (configs/models/*.textproto),
// embedded in the binary. `name` is a canonical name or alias (case-insensitive), or a text-proto file.
StatusOr<DeviceProfile> FindDevice(const std::string& name);
StatusOr<ModelShape> FindModelShape(const std::string& name);
std::vector<std::string> DeviceNames();                        // the first alias of every built-in profile
std::vector<std::string> ModelPresetNames();                   // every built-in preset
std::string JoinNames(const std::vector<std::string>& names);  // "a, b, c" for error messages
// The preset whose name or alias equals a trace's model name (case-insensitive), or null.
const ModelShape* ModelPresetFor(const std::string& trace_model_name);
// One-line errors naming `where` and the missing or invalid field.
Status CheckDevice(const DeviceProfile& d, const std::string& where);
Status CheckModelShape(const ModelShape& m, const std::string& where);

// The cost of one piece of work.
struct KernelCost {
  double us = 0;     // modelled time
  double bytes = 0;  // HBM bytes moved
  double flops = 0;
  int kernels = 0;  // kernel calls
  int units = 0;    // work units (thread blocks) of a streaming kernel
};

struct DecodeStepCost {
  double total_us = 0;
  double attention_us = 0;  // decode attention kernels (and their split merges), all layers
  double weights_us = 0;    // projection / MLP / LM-head GEMVs
  double other_us = 0;      // norms, RoPE + KV append, activation, sampling
  double bytes = 0;         // HBM bytes moved: weights + KV cache read
  int kernels = 0;
};

struct PrefillCost {
  double total_us = 0;
  double gemm_us = 0;
  double attention_us = 0;
  double other_us = 0;
  double flops = 0;
  int kernels = 0;
};

class PerfModel {
 public:
  // `device` must pass CheckDevice.
  explicit PerfModel(DeviceProfile device);
  const DeviceProfile& device() const { return d_; }
  double PeakBytesPerUs() const { return d_.hbm_bandwidth_gbps() * 1e3; }

  // The kernel family `name`, or null.
  const StreamingKernel* Kernel(const std::string& name) const;
  const StreamingKernel& AttentionKernel() const { return d_.kernels(0); }
  const StreamingKernel& GemvKernel() const { return *gemv_; }

  // e(B) of a kernel family.
  double Efficiency(const StreamingKernel& k, double bytes) const;
  // Streaming time (no fixed cost) of work units of the given sizes, total bytes B = their sum.
  double FluidUs(const StreamingKernel& k, std::vector<double> unit_bytes) const;

  // One decode attention call over `kv_lengths` (one per (request, KV head)) with `group` query heads per
  // KV head. in_graph: the fixed cost is graph_kernel_us per kernel instead of the kernel's launch_us.
  KernelCost DecodeAttention(std::span<const int> kv_lengths, int group, int head_dim, int kv_dtype_bytes,
                             const StreamingKernel& k, bool in_graph) const;
  // A [rows x cols] weight matrix times `batch` vectors: max(weight streaming, tensor FLOPs).
  KernelCost Gemv(double rows, double cols, int batch, int dtype_bytes, bool in_graph) const;
  // A GEMM of `flops` reading `bytes` (prefill), compute-bound at gemm_efficiency.
  KernelCost Gemm(double flops, double bytes) const;
  // A small elementwise kernel moving `bytes`.
  KernelCost Elementwise(double bytes, bool in_graph) const;

  // One decode step (one output token for each of `batch` requests) of model `m`; `lengths` holds the cache
  // length of every (layer, KV head) of one request ([layer * num_kv_heads + kv_head]); every request of the
  // batch has the same lengths.
  DecodeStepCost DecodeStep(const ModelShape& m, int batch, std::span<const int> lengths) const;
  // Prefill of `tokens` new prompt tokens per request after `cached` tokens already in the cache (chunked
  // prefill), including the LM head of the last token.
  PrefillCost Prefill(const ModelShape& m, int batch, int tokens, int cached = 0) const;
  // A policy's own work for one request, summed over layers: at its compression event (prompt of
  // `prompt_tokens`, `kept` slots per (layer, KV head) after it) or, with per_step, at one decode step over
  // caches of `lengths`.
  KernelCost PolicyWork(const ModelShape& m, const PolicyGpuWork& w, int prompt_tokens,
                        std::span<const int> lengths, bool per_step) const;

 private:
  double FixedUs(const StreamingKernel& k, bool in_graph) const {
    return in_graph ? d_.graph_kernel_us() : k.launch_us();
  }
  DeviceProfile d_;
  const StreamingKernel* gemv_ = nullptr;
};

// Bytes of KV cache one token occupies in one (layer, KV head): K and V.
inline double KvBytesPerToken(int head_dim, int kv_dtype_bytes) { return 2.0 * head_dim * kv_dtype_bytes; }

}  // namespace kvsim
