#pragma once
// Stable policy names -> factories. Parameters are typed Protobuf messages (policies/policy_params.proto)
// with defaults; "key=value" overrides set fields by name.

#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sim/policy.h"

namespace kvsim {

struct PolicyInfo {
  std::string name;
  std::string summary;      // one line
  std::string params_type;  // Protobuf message name of its parameters
  bool uses_budget = true;  // false for `full`: a sweep runs it once
  // Whether "name+average|pivot|weighted" may wrap it with a merge (policies/merge.h): false for policies
  // that evict nothing, re-select from every token each step, or have their own merge option.
  bool merge_wrappable = true;
};

class PolicyRegistry {
 public:
  using Factory = std::function<StatusOr<std::shared_ptr<const Policy>>(std::span<const std::string> sets)>;
  // The registry with every built-in policy.
  static const PolicyRegistry& Default();

  void Register(PolicyInfo info, Factory factory);
  std::vector<PolicyInfo> List() const;
  // Also finds the base of a merge-wrapped name ("snapkv+average" -> snapkv).
  const PolicyInfo* Find(const std::string& name) const;
  // Error names the unknown policy or parameter and lists what exists. "base+average|pivot|weighted"
  // wraps a merge-wrappable policy (`sets` go to the base policy).
  StatusOr<std::shared_ptr<const Policy>> Create(const std::string& name,
                                                 std::span<const std::string> sets = {}) const;

 private:
  struct Entry {
    PolicyInfo info;
    Factory factory;
  };
  std::map<std::string, Entry> entries_;
};

// Built-in registrations (policies/*.cc).
void RegisterBaselinePolicies(PolicyRegistry* registry);
void RegisterMultimodalPolicies(PolicyRegistry* registry);  // meda, look_m (policies/meda.cc)
void RegisterAdaptivePolicies(PolicyRegistry* registry);    // adakv (policies/adakv.cc)
void RegisterMadaKVPolicy(PolicyRegistry* registry);        // madakv (policies/madakv.cc)
void RegisterHAEPolicy(PolicyRegistry* registry);           // hae (policies/hae.cc)

}  // namespace kvsim
