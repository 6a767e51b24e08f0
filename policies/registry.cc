#include "policies/registry.h"

#include "policies/merge.h"

namespace kvsim {

const PolicyRegistry& PolicyRegistry::Default() {
  static const PolicyRegistry* registry = [] {
    auto* r = new PolicyRegistry();
    RegisterBaselinePolicies(r);
    RegisterMultimodalPolicies(r);
    RegisterAdaptivePolicies(r);
    RegisterMadaKVPolicy(r);
    RegisterHAEPolicy(r);
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
  auto it = entries_.find(name.substr(0, name.find('+')));
  return it == entries_.end() ? nullptr : &it->second.info;
}

StatusOr<std::shared_ptr<const Policy>> PolicyRegistry::Create(const std::string& name,
                                                               std::span<const std::string> sets) const {
  const size_t plus = name.find('+');
  if (plus != std::string::npos) {
    const std::string base = name.substr(0, plus), suffix = name.substr(plus + 1);
    policy::MergeStrategy strategy;
    if (!ParseMergeSuffix(suffix, &strategy))
      return Status::InvalidArgument("policy '" + name + "': unknown merge '" + suffix + "' (use " + base +
                                     "+average, +pivot or +weighted)");
    const PolicyInfo* info = Find(base);
    if (info && !info->merge_wrappable)
      return Status::InvalidArgument("policy '" + name + "': " + base +
                                     " cannot be wrapped with a merge (it evicts nothing, re-selects every "
                                     "step, or has its own `merge` parameter)");
    KVSIM_ASSIGN_OR_RETURN(auto inner, Create(base, sets));
    return WrapWithMerge(std::move(inner), strategy);
  }
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
