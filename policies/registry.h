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
};

class PolicyRegistry {
 public:
  using Factory = std::function<StatusOr<std::shared_ptr<const Policy>>(std::span<const std::string> sets)>;
  // The registry with every built-in policy.
  static const PolicyRegistry& Default();

  void Register(PolicyInfo info, Factory factory);
  std::vector<PolicyInfo> List() const;
  const PolicyInfo* Find(const std::string& name) const;
  // Error names the unknown policy or parameter and lists what exists.
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

}  // namespace kvsim
