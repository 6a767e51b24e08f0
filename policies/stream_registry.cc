#include "policies/stream_registry.h"

namespace kvsim {

const StreamPolicyRegistry& StreamPolicyRegistry::Default() {
  static const StreamPolicyRegistry* r = [] {
    auto* reg = new StreamPolicyRegistry();
    RegisterStreamBaselines(reg);
    RegisterReKV(reg);
    RegisterMuKV(reg);
    return reg;
  }();
  return *r;
}

void StreamPolicyRegistry::Register(StreamPolicyInfo info, Factory factory) {
  const std::string name = info.name;
  entries_[name] = Entry{std::move(info), std::move(factory)};
}

std::vector<StreamPolicyInfo> StreamPolicyRegistry::List() const {
  std::vector<StreamPolicyInfo> out;
  for (const auto& [name, e] : entries_) out.push_back(e.info);
  return out;
}

const StreamPolicyInfo* StreamPolicyRegistry::Find(const std::string& name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : &it->second.info;
}

StatusOr<std::shared_ptr<const StreamPolicy>> StreamPolicyRegistry::Create(
    const std::string& name, std::span<const std::string> sets) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    std::string known;
    for (const auto& [n, e] : entries_) known += (known.empty() ? "" : ", ") + n;
    return Status::NotFound("unknown streaming policy '" + name + "'; streaming policies: " + known);
  }
  auto p = it->second.factory(sets);
  if (!p.ok()) return p.status().WithContext(name);
  return p;
}

}  // namespace kvsim
