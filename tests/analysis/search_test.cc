#include "analysis/search.h"

#include <google/protobuf/util/message_differencer.h>

#include <catch2/catch.hpp>
#include <map>
#include <string>
#include <vector>

#include "analysis/sweep.h"
#include "policies/registry.h"
#include "tests/test_util.h"
#include "traces/hdf5_trace.h"

namespace kvsim {
namespace {

const std::string& SearchTrace() {
  static const std::string path = [] {
    const std::string out = testing::ScratchDir("search_trace") + "/tiny.h5";
    std::string log;
    const int rc = testing::RunCommand(testing::KvsimBinary() + " synth --config " + testing::SourceDir() +
                                           "/configs/synth/tiny.textproto --out " + out + " --threads 1",
                                       &log);
    INFO(log);
    REQUIRE(rc == 0);
    return out;
  }();
  return path;
}

double Value(const Metrics& m, const std::string& metric) {
  if (metric == "retained_mass") return m.retained_mass_mean();
  if (metric == "output_error") return m.output_rel_error_mean();
  return m.regret_vs_oracle_mean();
}

// The brute-force scan: every budget 1..ce of one policy, replayed in one multi-run pass.
std::map<int, Metrics> Scan(TraceSource& trace, const std::string& policy) {
  auto p = PolicyRegistry::Default().Create(policy, {});
  REQUIRE(p.ok());
  const int ce = CompressEnd(trace.meta(), QuestionMode::kQueryAware);
  std::vector<RunSpec> runs;
  for (int b = 1; b <= ce; ++b) runs.push_back(RunSpec{*p, policy, 0, b, QuestionMode::kQueryAware});
  ReplayOptions ro;
  ro.threads = 2;
  auto res = Replay(trace, runs, ro);
  REQUIRE(res.ok());
  std::map<int, Metrics> out;
  for (int b = 1; b <= ce; ++b) out[b] = (*res)[b - 1].metrics();
  return out;
}

}  // namespace

TEST_CASE("search: the smallest budget meeting the target, as a brute-force scan over every budget finds it",
          "[search]") {
  auto trace = OpenTrace(SearchTrace());
  REQUIRE(trace.ok());
  const int ce = CompressEnd((*trace)->meta(), QuestionMode::kQueryAware);
  struct Case {
    std::string metric;
    bool at_least;
    double target;
    int points;
  };
  const std::vector<std::string> policies = {"snapkv", "h2o", "streaming_llm", "pyramidkv"};
  std::map<std::string, std::map<int, Metrics>> scans;
  int compared = 0;  // cases where the scan's curve is monotone, so the answer must equal the scan's
  for (const auto& p : policies) scans[p] = Scan(**trace, p);
  for (const Case& c : {Case{"retained_mass", true, 0.9, 4}, Case{"retained_mass", true, 0.5, 1},
                        Case{"retained_mass", true, 0.75, 7}, Case{"output_error", false, 0.3, 3},
                        Case{"regret", false, 0.05, 4}}) {
    SearchSpec spec;
    spec.policies = policies;
    spec.metric = c.metric;
    spec.at_least = c.at_least;
    spec.target = c.target;
    spec.points_per_pass = c.points;
    spec.threads = 1;
    auto res = SearchBudgets(**trace, spec, "hash", nullptr);
    REQUIRE(res.ok());
    REQUIRE(res->policies_size() == static_cast<int>(policies.size()));
    int runs = 0;
    for (const PolicySearch& ps : res->policies()) {
      INFO(c.metric << " " << c.target << " k=" << c.points << " " << ps.label());
      const auto& scan = scans.at(ps.label());
      auto meets = [&](int b) {
        const double v = Value(scan.at(b), c.metric);
        return c.at_least ? v >= c.target : v <= c.target;
      };
      runs += ps.points_size();
      // Every evaluated point is the scan's value at that budget (the search replays the same runs).
      for (const SearchPoint& p : ps.points()) {
        CHECK(p.value() == Value(scan.at(p.budget_tokens()), c.metric));
        CHECK(p.kv_memory_ratio() == scan.at(p.budget_tokens()).kv_memory_ratio());
      }
      // The scan's monotonicity over the evaluated budgets is what the search reports.
      bool monotone = true;
      double best = 0;
      bool first = true;
      for (const SearchPoint& p : ps.points()) {
        const double tol = 1e-9 * (1 + std::fabs(best));
        if (!first && (c.at_least ? p.value() < best - tol : p.value() > best + tol)) monotone = false;
        if (first || (c.at_least ? p.value() > best : p.value() < best)) best = p.value();
        first = false;
      }
      CHECK(ps.monotone() == monotone);
      CHECK(ps.non_monotone().empty() == monotone);
      // Brute force: the smallest budget meeting the target, and whether the whole curve is monotone.
      int smallest = 0;
      bool curve_monotone = true;
      for (int b = 1; b <= ce; ++b) {
        if (!smallest && meets(b)) smallest = b;
        if (b > 1 && meets(b - 1) && !meets(b)) curve_monotone = false;
      }
      if (!meets(ce)) {
        CHECK_FALSE(ps.found());
        CHECK(ps.reason().find("even the whole prompt") != std::string::npos);
        continue;
      }
      REQUIRE(ps.found());
      // Bisection's invariant: the budget found meets the target and the one below it fails.
      CHECK(meets(ps.budget_tokens()));
      if (ps.budget_tokens() > 1) CHECK_FALSE(meets(ps.budget_tokens() - 1));
      if (curve_monotone) {
        CHECK(ps.budget_tokens() == smallest);
        ++compared;
      }
      CHECK(ps.budget_fraction() == Approx(static_cast<double>(ps.budget_tokens()) / ce));
      CHECK(ps.value() == Value(scan.at(ps.budget_tokens()), c.metric));
      // Far fewer runs than the scan.
      CHECK(ps.points_size() < ce / 2);
    }
    CHECK(res->runs() == runs);
    CHECK(res->compressed_prompt_tokens() == ce);
  }
  CHECK(compared >= 10);
}

TEST_CASE("search: the trace hash beside the first pass (page cache warm) is the serial one", "[search]") {
  const std::string path = SearchTrace();
  REQUIRE(HashFile(path).ok());  // read: in the page cache
  REQUIRE(HashConcurrently(path, 2));
  SearchSpec spec;
  spec.policies = {"snapkv", "h2o"};
  spec.target = 0.9;
  spec.threads = 1;
  auto serial = RunSearch(path, spec, false);
  spec.threads = 2;
  auto concurrent = RunSearch(path, spec, false);
  REQUIRE(serial.ok());
  REQUIRE(concurrent.ok());
  CHECK(serial->trace_hash() == *HashFile(path));
  CHECK(google::protobuf::util::MessageDifferencer::Equals(*concurrent, *serial));
  // A missing trace is the open's error, as before.
  auto missing = RunSearch(path + ".missing", spec, false);
  CHECK_FALSE(missing.ok());
}

TEST_CASE("search: unreachable targets, budget-free policies and bad specs are reported", "[search]") {
  auto trace = OpenTrace(SearchTrace());
  REQUIRE(trace.ok());
  SearchSpec spec;
  spec.policies = {"h2o", "full"};
  spec.target = 0.999;  // h2o at the whole prompt keeps every prompt token but evicts decode ones
  auto res = SearchBudgets(**trace, spec, "", nullptr);
  REQUIRE(res.ok());
  const PolicySearch& h2o = res->policies(0);
  const double whole = h2o.points(h2o.points_size() - 1).value();
  if (whole < 0.999) {
    CHECK_FALSE(h2o.found());
    CHECK(h2o.reason().find("does not meet >= 0.999") != std::string::npos);
  }
  const PolicySearch& full = res->policies(1);
  CHECK_FALSE(full.found());
  CHECK(full.points_size() == 1);
  CHECK(full.reason().find("ignores the budget") != std::string::npos);

  spec.metric = "output_error";  // lower is better: --at-least is refused
  CHECK(CheckSearchSpec(spec).message().find("--at-most") != std::string::npos);
  spec.metric = "perplexity";
  CHECK(CheckSearchSpec(spec).message().find("retained_mass, output_error or regret") != std::string::npos);
  spec.metric = "retained_mass";
  spec.target = 1.5;
  CHECK_FALSE(CheckSearchSpec(spec).ok());
  spec.target = 0.5;
  spec.policies = {"nope"};
  CHECK(SearchBudgets(**trace, spec, "", nullptr).status().message().find("nope") != std::string::npos);
}

}  // namespace kvsim
