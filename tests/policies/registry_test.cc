#include "policies/registry.h"

#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "policies/baselines.h"

namespace kvsim {
namespace {

bool Contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

Status CreateStatus(const std::string& name, std::vector<std::string> sets) {
  auto p = PolicyRegistry::Default().Create(name, sets);
  return p.ok() ? Status::Ok() : p.status();
}

}  // namespace

TEST_CASE("registry: the baselines and multimodal policies are listed, sorted by name", "[registry]") {
  const auto list = PolicyRegistry::Default().List();
  std::vector<std::string> names;
  for (const PolicyInfo& i : list) names.push_back(i.name);
  CHECK(names == std::vector<std::string>{"adakv", "full", "h2o", "hae", "look_m", "madakv", "meda", "oracle",
                                          "pyramidkv", "snapkv", "streaming_llm"});
  for (const PolicyInfo& i : list) {
    INFO(i.name);
    CHECK_FALSE(i.summary.empty());
    CHECK(i.params_type.rfind("kvsim.policy.", 0) == 0);
    CHECK(i.uses_budget == (i.name != "full"));
  }
  const PolicyInfo* snap = PolicyRegistry::Default().Find("snapkv");
  REQUIRE(snap);
  CHECK(snap->params_type == "kvsim.policy.SnapKVParams");
  CHECK(PolicyRegistry::Default().Find("nope") == nullptr);
}

TEST_CASE("registry: every listed policy is created with its defaults", "[registry]") {
  for (const PolicyInfo& i : PolicyRegistry::Default().List()) {
    auto p = PolicyRegistry::Default().Create(i.name);
    REQUIRE(p.ok());
    CHECK((*p)->name() == i.name);
  }
  auto snap = PolicyRegistry::Default().Create("snapkv");
  REQUIRE(snap.ok());
  CHECK((*snap)->ParamsText() == "window: 32 kernel_size: 5 pooling: AVG group_aggregation: MEAN");
  auto sl = PolicyRegistry::Default().Create("streaming_llm");
  REQUIRE(sl.ok());
  CHECK((*sl)->ParamsText() == "num_sinks: 4");
}

TEST_CASE("registry: unknown policy names list the known ones", "[registry]") {
  Status st = CreateStatus("snap", {});
  CHECK(st.code() == StatusCode::kInvalidArgument);
  INFO(st.message());
  CHECK(Contains(st.message(), "unknown policy 'snap'"));
  CHECK(Contains(st.message(),
                 "adakv, full, h2o, hae, look_m, madakv, meda, oracle, pyramidkv, snapkv, streaming_llm"));
}

TEST_CASE("registry: base+merge wraps an evicting policy", "[registry][merge]") {
  auto p = PolicyRegistry::Default().Create("snapkv+average", std::vector<std::string>{"window=8"});
  REQUIRE(p.ok());
  CHECK((*p)->name() == "snapkv+average");
  CHECK((*p)->ParamsText() == "window: 8 kernel_size: 5 pooling: AVG group_aggregation: MEAN merge: AVERAGE");
  CHECK((*p)->requirements().window == 8);
  auto h = PolicyRegistry::Default().Create("h2o+pivot");
  REQUIRE(h.ok());
  CHECK((*h)->evicts_during_decode());
  CHECK(PolicyRegistry::Default().Create("streaming_llm+weighted").ok());
  const PolicyInfo* info = PolicyRegistry::Default().Find("pyramidkv+average");
  REQUIRE(info);
  CHECK(info->name == "pyramidkv");
}

TEST_CASE("registry: bad merge wrappers are refused with the fix", "[registry][merge]") {
  Status st = CreateStatus("snapkv+median", {});
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(Contains(st.message(), "unknown merge 'median'"));
  CHECK(Contains(st.message(), "snapkv+average"));
  for (const char* name : {"full+average", "oracle+pivot", "meda+average", "look_m+average"}) {
    INFO(name);
    st = CreateStatus(name, {});
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(Contains(st.message(), "cannot be wrapped"));
  }
  st = CreateStatus("nope+average", {});
  CHECK(Contains(st.message(), "unknown policy 'nope'"));
  st = CreateStatus("snapkv+average", {"window=0"});
  CHECK(Contains(st.message(), "window must be >= 1"));
}

TEST_CASE("registry: --set overrides reach the policy", "[registry]") {
  auto p =
      PolicyRegistry::Default().Create("snapkv", std::vector<std::string>{"window=16", "pooling=MAX_POOL"});
  REQUIRE(p.ok());
  CHECK(Contains((*p)->ParamsText(), "window: 16"));
  CHECK(Contains((*p)->ParamsText(), "pooling: MAX_POOL"));
  CHECK((*p)->requirements().window == 16);
  const auto* typed = dynamic_cast<const SnapKVPolicy*>(p->get());
  REQUIRE(typed);
  CHECK(typed->params().window() == 16);

  auto h = PolicyRegistry::Default().Create("h2o",
                                            std::vector<std::string>{"one_shot=true", "heavy_fraction=0.25"});
  REQUIRE(h.ok());
  CHECK((*h)->ParamsText() == "heavy_fraction: 0.25 one_shot: true group_aggregation: MEAN");
  CHECK_FALSE((*h)->evicts_during_decode());
  // Later sets win.
  auto w = PolicyRegistry::Default().Create("pyramidkv", std::vector<std::string>{"beta=4", "beta=8"});
  REQUIRE(w.ok());
  CHECK(Contains((*w)->ParamsText(), "beta: 8"));
}

TEST_CASE("registry: invalid parameters are rejected with the policy named", "[registry]") {
  struct Case {
    const char* policy;
    const char* set;
    const char* expect;
  };
  const Case cases[] = {
      {"snapkv", "kernel_size=4", "kernel_size must be odd"},
      {"snapkv", "kernel_size=0", "kernel_size must be odd"},
      {"snapkv", "window=0", "window must be >= 1"},
      {"pyramidkv", "kernel_size=6", "kernel_size must be odd"},
      {"pyramidkv", "beta=0", "beta must be >= 1"},
      {"h2o", "heavy_fraction=2", "heavy_fraction must be in [0, 1]"},
      {"h2o", "heavy_fraction=-0.1", "heavy_fraction must be in [0, 1]"},
      {"streaming_llm", "num_sinks=-1", "num_sinks must be >= 0"},
      {"snapkv", "windw=8", "has no parameter 'windw'"},
      {"oracle", "group_aggregation=MEDIAN", "is not a valid enum"},
      {"full", "window=8", "(parameters: none)"},
  };
  for (const Case& c : cases) {
    Status st = CreateStatus(c.policy, {c.set});
    INFO(c.policy << " " << c.set << ": " << st.message());
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(Contains(st.message(), std::string("policy '") + c.policy + "': "));
    CHECK(Contains(st.message(), c.expect));
  }
}

TEST_CASE("registry: a private registry registers and creates its own entries", "[registry]") {
  PolicyRegistry r;
  CHECK(r.List().empty());
  RegisterBaselinePolicies(&r);
  CHECK(r.List().size() == 6);
  PolicyRegistry mine;
  mine.Register({"keep_all", "test", "kvsim.policy.FullParams", false},
                [](std::span<const std::string>) -> StatusOr<std::shared_ptr<const Policy>> {
                  return std::shared_ptr<const Policy>(std::make_shared<FullPolicy>(policy::FullParams()));
                });
  auto p = mine.Create("keep_all");
  REQUIRE(p.ok());
  CHECK((*p)->name() == "full");
  CHECK_FALSE(mine.Find("keep_all")->uses_budget);
}

}  // namespace kvsim
