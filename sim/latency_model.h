#pragma once
// Maps simulator events to durations. The default counts token steps (every event lasts 1); a linear model
// fitted by gpu_replay (sim/latency_model.proto) gives microseconds.

#include <memory>
#include <string>

#include "sim/latency_model.pb.h"
#include "sim/status.h"

namespace kvsim {

class LatencyModel {
 public:
  virtual ~LatencyModel() = default;
  virtual double PrefillDuration(int prompt_tokens) const = 0;
  // mean_kv_tokens: KV tokens held during the step, averaged over layers and KV heads.
  virtual double DecodeStepDuration(double mean_kv_tokens) const = 0;
  virtual std::string unit() const = 0;  // "token_steps" | "us"
  virtual std::string Describe() const = 0;
};

std::unique_ptr<LatencyModel> MakeTokenStepLatencyModel();
std::unique_ptr<LatencyModel> MakeLinearLatencyModel(const LatencyModelProto& proto);
// Loads a LatencyModelProto text file; errors name the file and field.
StatusOr<std::unique_ptr<LatencyModel>> LoadLatencyModel(const std::string& path);

}  // namespace kvsim
