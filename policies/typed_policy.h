#pragma once
// Base for policies whose parameters are a Protobuf message: parsing "key=value" overrides, validation,
// and the parameter text recorded in results.

#include <memory>
#include <span>
#include <string>

#include "policies/registry.h"
#include "sim/text_proto.h"

namespace kvsim {

// Parameter validation: Ok, or InvalidArgument(what) naming the field and the allowed range.
inline Status Need(bool ok, const std::string& what) {
  return ok ? Status::Ok() : Status::InvalidArgument(what);
}

template <typename Params>
class TypedPolicy : public Policy {
 public:
  explicit TypedPolicy(Params params) : params_(std::move(params)) {}
  std::string ParamsText() const override { return ToTextWithDefaults(params_); }
  const Params& params() const { return params_; }

 protected:
  Params params_;
};

// Factory for `Impl` (constructible from Params, with `static Status Validate(const Params&)`).
template <typename Impl, typename Params>
PolicyRegistry::Factory TypedFactory() {
  return [](std::span<const std::string> sets) -> StatusOr<std::shared_ptr<const Policy>> {
    Params params;
    for (const std::string& s : sets) KVSIM_RETURN_IF_ERROR(SetFieldFromString(s, &params));
    KVSIM_RETURN_IF_ERROR(Impl::Validate(params));
    return std::shared_ptr<const Policy>(std::make_shared<Impl>(std::move(params)));
  };
}

}  // namespace kvsim
