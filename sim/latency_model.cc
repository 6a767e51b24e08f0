#include "sim/latency_model.h"

#include <google/protobuf/text_format.h>

#include <cmath>
#include <fstream>
#include <sstream>
#include <vector>

#include "sim/stats.h"
#include "sim/text_proto.h"

namespace kvsim {
namespace {

class TokenStepModel final : public LatencyModel {
 public:
  double PrefillDuration(int, int) const override { return 1; }
  double DecodeStepDuration(const CacheLengths&) const override { return 1; }
  double UniformDecodeStepDuration(double, int, int) const override { return 1; }
  std::string unit() const override { return "token_steps"; }
  std::string Describe() const override { return "token steps (every event lasts 1)"; }
};

class LinearModel final : public LatencyModel {
 public:
  explicit LinearModel(LatencyModelProto p) : p_(std::move(p)) {}
  double PrefillDuration(int tokens, int) const override {
    return p_.prefill_base_us() + p_.prefill_us_per_token() * tokens;
  }
  double DecodeStepDuration(const CacheLengths& cache) const override {
    return p_.decode_base_us() + p_.decode_us_per_kv_token() * cache.Mean();
  }
  double UniformDecodeStepDuration(double mean, int, int) const override {
    return p_.decode_base_us() + p_.decode_us_per_kv_token() * mean;
  }
  std::string unit() const override { return "us"; }
  std::string Describe() const override {
    std::ostringstream os;
    os << "linear: decode " << p_.decode_base_us() << " us + " << p_.decode_us_per_kv_token()
       << " us/KV token; prefill " << p_.prefill_base_us() << " us + " << p_.prefill_us_per_token()
       << " us/token" << (p_.fitted_on().empty() ? "" : " (fitted on " + p_.fitted_on() + ")");
    return os.str();
  }

 private:
  LatencyModelProto p_;
};

class DeviceModel final : public LatencyModel {
 public:
  DeviceModel(const DeviceProfile& d, ModelShape m) : perf_(d), m_(std::move(m)) {}
  double PrefillDuration(int tokens, int cached) const override {
    return perf_.Prefill(m_, 1, tokens, cached).total_us;
  }
  double DecodeStepDuration(const CacheLengths& cache) const override {
    return perf_.DecodeStep(m_, 1, cache.tokens).total_us;
  }
  double PolicyWorkDuration(const PolicyGpuWork& work, int prompt_tokens, const CacheLengths& cache,
                            bool per_step) const override {
    return perf_.PolicyWork(m_, work, prompt_tokens, cache.tokens, per_step).us;
  }
  std::string unit() const override { return "us"; }
  std::string Describe() const override {
    return "modelled: " + perf_.device().name() + " performance model (docs/latency.md), " + m_.name() +
           ", batch 1, decode attention kernel " + perf_.AttentionKernel().name();
  }
  const PerfModel* perf_model() const override { return &perf_; }
  const ModelShape* model_shape() const override { return &m_; }

 private:
  PerfModel perf_;
  ModelShape m_;
};

}  // namespace

double LatencyModel::UniformDecodeStepDuration(double mean_tokens, int num_layers, int num_kv_heads) const {
  const std::vector<int> tokens(static_cast<size_t>(num_layers) * num_kv_heads,
                                static_cast<int>(std::lround(mean_tokens)));
  return DecodeStepDuration(CacheLengths{tokens, num_layers, num_kv_heads});
}

double CacheLengths::Mean() const { return kvsim::Mean(tokens); }

std::unique_ptr<LatencyModel> MakeDeviceLatencyModel(const DeviceProfile& device, const ModelShape& model) {
  return std::make_unique<DeviceModel>(device, model);
}

StatusOr<ModelShape> ModelShapeForTrace(const ModelInfo& t, const std::string& model) {
  ModelShape m;
  if (!model.empty()) {
    KVSIM_ASSIGN_OR_RETURN(m, FindModelShape(model));
  } else if (const ModelShape* p = ModelPresetFor(t.name)) {
    m = *p;
  } else {
    return Status::InvalidArgument("the trace's model '" + t.name +
                                   "' has no latency-model preset; pass --model with one of " +
                                   JoinNames(ModelPresetNames()) +
                                   " or a model shape file (configs/models/*.textproto) of the same shape");
  }
  const std::pair<const char*, std::pair<int, int>> dims[] = {
      {"num_layers", {m.num_layers(), t.num_layers}},
      {"num_heads", {m.num_heads(), t.num_heads}},
      {"num_kv_heads", {m.num_kv_heads(), t.num_kv_heads}},
      {"head_dim", {m.head_dim(), t.head_dim}}};
  for (const auto& [field, v] : dims)
    if (v.first != v.second)
      return Status::InvalidArgument("model shape '" + m.name() + "' has " + field + " " +
                                     std::to_string(v.first) + " but the trace's model '" + t.name +
                                     "' has " + std::to_string(v.second) +
                                     "; pass --model with a shape that matches");
  return m;
}

std::unique_ptr<LatencyModel> MakeTokenStepLatencyModel() { return std::make_unique<TokenStepModel>(); }
std::unique_ptr<LatencyModel> MakeLinearLatencyModel(const LatencyModelProto& proto) {
  return std::make_unique<LinearModel>(proto);
}

StatusOr<std::unique_ptr<LatencyModel>> LoadLatencyModel(const std::string& path) {
  KVSIM_ASSIGN_OR_RETURN(std::string text, ReadTextProtoFile(path));
  return ParseLatencyModel(text, path);
}

StatusOr<std::unique_ptr<LatencyModel>> ParseLatencyModel(const std::string& text, const std::string& path) {
  LatencyModelProto proto;
  KVSIM_RETURN_IF_ERROR(ParseTextProto(text, path, &proto));
  for (double v : {proto.prefill_base_us(), proto.prefill_us_per_token(), proto.decode_base_us(),
                   proto.decode_us_per_kv_token()})
    if (!(v >= 0) || !std::isfinite(v))
      return Status::InvalidArgument(path + ": latency model coefficients must be finite and >= 0");
  if (proto.decode_base_us() + proto.decode_us_per_kv_token() <= 0)
    return Status::InvalidArgument(path +
                                   ": decode_base_us and decode_us_per_kv_token are both 0; a decode step "
                                   "would take no time. Set at least one.");
  return MakeLinearLatencyModel(proto);
}

}  // namespace kvsim
