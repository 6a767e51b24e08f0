#include "sim/latency_model.h"

#include <google/protobuf/text_format.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "sim/text_proto.h"

namespace kvsim {
namespace {

class TokenStepModel final : public LatencyModel {
 public:
  double PrefillDuration(int) const override { return 1; }
  double DecodeStepDuration(double) const override { return 1; }
  std::string unit() const override { return "token_steps"; }
  std::string Describe() const override { return "token steps (every event lasts 1)"; }
};

class LinearModel final : public LatencyModel {
 public:
  explicit LinearModel(LatencyModelProto p) : p_(std::move(p)) {}
  double PrefillDuration(int tokens) const override {
    return p_.prefill_base_us() + p_.prefill_us_per_token() * tokens;
  }
  double DecodeStepDuration(double kv) const override {
    return p_.decode_base_us() + p_.decode_us_per_kv_token() * kv;
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

}  // namespace

std::unique_ptr<LatencyModel> MakeTokenStepLatencyModel() { return std::make_unique<TokenStepModel>(); }
std::unique_ptr<LatencyModel> MakeLinearLatencyModel(const LatencyModelProto& proto) {
  return std::make_unique<LinearModel>(proto);
}

StatusOr<std::unique_ptr<LatencyModel>> LoadLatencyModel(const std::string& path) {
  LatencyModelProto proto;
  KVSIM_RETURN_IF_ERROR(ParseTextProtoFile(path, &proto));
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
