#pragma once
// Maps simulator events to durations. The default counts token steps (every event lasts 1); a linear model
// fitted by gpu_replay (sim/latency_model.proto) gives microseconds; a device model (sim/perf_model.h,
// `--device`) gives modelled microseconds from every (layer, KV head)'s cache length.

#include <memory>
#include <span>
#include <string>

#include "sim/device.pb.h"
#include "sim/gpu_work.h"
#include "sim/latency_model.pb.h"
#include "sim/perf_model.h"
#include "sim/status.h"
#include "sim/trace.h"

namespace kvsim {

// Cache lengths of one request at one event: tokens[layer * num_kv_heads + kv_head].
struct CacheLengths {
  std::span<const int> tokens;
  int num_layers = 0;
  int num_kv_heads = 0;
  double Mean() const;  // mean per-(layer, KV head) length
};

class LatencyModel {
 public:
  virtual ~LatencyModel() = default;
  // A prefill event of `prompt_tokens` new tokens after `cached_tokens` already in the cache.
  virtual double PrefillDuration(int prompt_tokens, int cached_tokens) const = 0;
  // One decode step attending over caches of the given lengths.
  virtual double DecodeStepDuration(const CacheLengths& cache) const = 0;
  // A decode step where every (layer, KV head) holds `mean_tokens` (the device model rounds it).
  virtual double UniformDecodeStepDuration(double mean_tokens, int num_layers, int num_kv_heads) const;
  // A policy's own GPU work: at its compression event (prompt of `prompt_tokens`, `cache` after it) or, with
  // per_step, at a decode step. 0 unless the model knows the device.
  virtual double PolicyWorkDuration(const PolicyGpuWork& work, int prompt_tokens, const CacheLengths& cache,
                                    bool per_step) const {
    return 0;
  }
  virtual std::string unit() const = 0;  // "token_steps" | "us"
  virtual std::string Describe() const = 0;
  // The device model behind it, or null (token steps, linear fits).
  virtual const PerfModel* perf_model() const { return nullptr; }
  virtual const ModelShape* model_shape() const { return nullptr; }
};

std::unique_ptr<LatencyModel> MakeTokenStepLatencyModel();
std::unique_ptr<LatencyModel> MakeLinearLatencyModel(const LatencyModelProto& proto);
// Loads a LatencyModelProto text file; errors name the file and field.
StatusOr<std::unique_ptr<LatencyModel>> LoadLatencyModel(const std::string& path);
// The same from the file's text (`what` names it in messages).
StatusOr<std::unique_ptr<LatencyModel>> ParseLatencyModel(const std::string& text, const std::string& what);
// The device performance model for `model` at batch 1.
std::unique_ptr<LatencyModel> MakeDeviceLatencyModel(const DeviceProfile& device, const ModelShape& model);
// The model shape for a trace: `model` (a preset name or file) when given, else the preset named like the
// trace's model; its layers, heads, KV heads and head_dim must equal the trace's.
StatusOr<ModelShape> ModelShapeForTrace(const ModelInfo& trace_model, const std::string& model);

}  // namespace kvsim
