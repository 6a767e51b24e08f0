#include "policies/registry.h"

namespace kvsim {

const PolicyRegistry& PolicyRegistry::Default() {
  static const PolicyRegistry* registry = [] {
    auto* r = new PolicyRegistry();
    RegisterBaselinePolicies(r);
    return r;
  }();
  return *registry;
}

void PolicyRegistry::Register(PolicyInfo info, Factory factory) {
  KVSIM_CHECK_MSG(!entries_.count(info.name), "policy registered twice: " + info.name);
  const std::string name = info.name;
  entries_.emplace(name, Entry{std::move(info), std::move(factory)});
}

std::vector<PolicyInfo> PolicyRegistry::List() const {
  std::vector<PolicyInfo> out;
  for (const auto& [name, e] : entries_) out.push_back(e.info);
  return out;
}

const PolicyInfo* PolicyRegistry::Find(const std::string& name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : &it->second.info;
}

StatusOr<std::shared_ptr<const Policy>> PolicyRegistry::Create(const std::string& name,
                                                               std::span<const std::string> sets) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    std::string names;
    for (const auto& [n, e] : entries_) names += (names.empty() ? "" : ", ") + n;
    return Status::InvalidArgument("unknown policy '" + name + "' (known: " + names +
                                   "; see `kvsim list-policies`)");
  }
  auto policy = it->second.factory(sets);
  if (!policy.ok()) return policy.status().WithContext("policy '" + name + "'");
  return policy;
}

}  // namespace kvsim
