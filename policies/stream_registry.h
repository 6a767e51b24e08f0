#pragma once
// Streaming policy names -> factories (docs/streaming.md). Same conventions as PolicyRegistry: typed
// Protobuf parameters (policies/policy_params.proto), "key=value" overrides.

#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sim/stream_policy.h"

namespace kvsim {

struct StreamPolicyInfo {
  std::string name;
  std::string summary;
  std::string params_type;
  bool uses_budget = true;  // false: a sweep runs it once (stream_full)
};

class StreamPolicyRegistry {
 public:
  using Factory =
      std::function<StatusOr<std::shared_ptr<const StreamPolicy>>(std::span<const std::string> sets)>;
  static const StreamPolicyRegistry& Default();
  void Register(StreamPolicyInfo info, Factory factory);
  std::vector<StreamPolicyInfo> List() const;
  const StreamPolicyInfo* Find(const std::string& name) const;
  StatusOr<std::shared_ptr<const StreamPolicy>> Create(const std::string& name,
                                                       std::span<const std::string> sets = {}) const;

 private:
  struct Entry {
    StreamPolicyInfo info;
    Factory factory;
  };
  std::map<std::string, Entry> entries_;
};

void RegisterStreamBaselines(StreamPolicyRegistry* r);  // policies/stream_baselines.cc
void RegisterReKV(StreamPolicyRegistry* r);             // policies/rekv.cc
void RegisterMuKV(StreamPolicyRegistry* r);             // policies/mukv.cc

// Base for streaming policies with typed parameters.
template <typename Params>
class TypedStreamPolicy : public StreamPolicy {
 public:
  explicit TypedStreamPolicy(Params p) : params_(std::move(p)) {}
  std::string ParamsText() const override;
  const Params& params() const { return params_; }

 protected:
  Params params_;
};

}  // namespace kvsim

#include "sim/text_proto.h"

namespace kvsim {
template <typename Params>
std::string TypedStreamPolicy<Params>::ParamsText() const {
  return ToTextWithDefaults(params_);
}

template <typename Impl, typename Params>
StreamPolicyRegistry::Factory TypedStreamFactory() {
  return [](std::span<const std::string> sets) -> StatusOr<std::shared_ptr<const StreamPolicy>> {
    Params params;
    for (const std::string& s : sets) KVSIM_RETURN_IF_ERROR(SetFieldFromString(s, &params));
    KVSIM_RETURN_IF_ERROR(Impl::Validate(params));
    return std::shared_ptr<const StreamPolicy>(std::make_shared<Impl>(std::move(params)));
  };
}
}  // namespace kvsim
