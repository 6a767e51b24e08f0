// analysis/sweep.h: a sweep split into units (PlanSweep, ComputeSweepUnit, ParseSweepUnit, AssembleSweep), as
// kvsim.ray runs it, gives RunSweep's result; a unit computed from a copy of its trace is the same unit.

#include "analysis/sweep.h"

#include <google/protobuf/util/message_differencer.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <string>
#include <vector>

#include "analysis/report.h"
#include "tests/test_util.h"
#include "traces/hdf5_trace.h"

namespace kvsim {
namespace {

namespace fs = std::filesystem;

// Two tiny synthetic traces in a scratch folder, and an experiment over them.
struct Dataset {
  std::string dir;
  config::Experiment experiment;
};

const Dataset& TwoTraces() {
  static const Dataset d = [] {
    Dataset out;
    out.dir = testing::ScratchDir("sweep_units");
    for (int i = 0; i < 2; ++i) {
      std::string log;
      const int rc =
          testing::RunCommand(testing::KvsimBinary() + " synth --config " + testing::SourceDir() +
                                  "/configs/synth/tiny.textproto --out " + out.dir + "/s" +
                                  std::to_string(i) + ".h5 --seed " + std::to_string(10 + i) + " --threads 1",
                              &log);
      INFO(log);
      REQUIRE(rc == 0);
    }
    auto e = ParseExperiment(
        "traces: \"s0.h5\" traces: \"s1.h5\" policies { name: \"snapkv\" } policies { name: \"full\" } "
        "budgets: 0.25 budgets: 0.5 seed: 3",
        "test");
    REQUIRE(e.ok());
    out.experiment = *e;
    return out;
  }();
  return d;
}

TEST_CASE("sweep units: plan + compute + assemble is RunSweep, from the original or a copied trace",
          "[sweep]") {
  const Dataset& d = TwoTraces();
  const RunOptions options{1, false, "", -1, "", ""};
  auto whole = RunSweep(d.experiment, d.dir, options);
  REQUIRE(whole.ok());
  REQUIRE(whole->runs_size() == 2 * 3);

  auto plan = PlanSweep(d.experiment, d.dir, options);
  REQUIRE(plan.ok());
  // A worker's plan: same experiment and folder, no trace opened; the same definition hash.
  auto worker = PlanSweep(d.experiment, d.dir, options, /*check_traces=*/false);
  REQUIRE(worker.ok());
  CHECK(worker->definition_hash == plan->definition_hash);
  CHECK(plan->UnitFile(1) == "s1-" + plan->definition_hash + ".json");

  // Unit 0 from a copy of its trace (a shipped trace): the unit records the sample's own path.
  const std::string copy = testing::ScratchDir("sweep_units_copy") + "/shipped.h5";
  fs::copy_file(d.dir + "/s0.h5", copy, fs::copy_options::overwrite_existing);
  std::vector<StatusOr<SweepUnit>> units;
  std::vector<std::string> json;
  for (size_t i = 0; i < 2; ++i) {
    auto u = ComputeSweepUnit(*worker, i, 1, nullptr, i == 0 ? copy : "");
    REQUIRE(u.ok());
    CHECK(u->trace_path() == plan->samples[i].path());
    for (const RunResult& r : u->runs()) CHECK(r.trace_path() == plan->samples[i].path());
    json.push_back(ToJson(*u));
    // Through JSON, as a task returns it.
    auto parsed = ParseSweepUnit(*plan, i, json.back());
    REQUIRE(parsed.ok());
    units.push_back(std::move(*parsed));
  }
  const SweepResult assembled = AssembleSweep(*plan, std::move(units), "");
  CHECK(ToJson(assembled) == ToJson(*whole));

  // A unit of another sample or another definition is refused.
  CHECK_FALSE(ParseSweepUnit(*plan, 1, json[0]).ok());
  config::Experiment other = d.experiment;
  other.set_seed(4);
  auto other_plan = PlanSweep(other, d.dir, options, false);
  REQUIRE(other_plan.ok());
  auto refused = ParseSweepUnit(*other_plan, 0, json[0]);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().message().find("definition hash") != std::string::npos);
  CHECK_FALSE(ParseSweepUnit(*plan, 0, "not json").ok());
}

TEST_CASE("sweep units: a failed unit is listed, the rest aggregated; stale unit files removed", "[sweep]") {
  const Dataset& d = TwoTraces();
  const RunOptions options{1, false, "", -1, "", ""};
  auto plan = PlanSweep(d.experiment, d.dir, options);
  REQUIRE(plan.ok());
  const std::string units_dir = testing::ScratchDir("sweep_units_dir");
  testing::WriteFile(units_dir + "/stale-0000.json", "{}");
  testing::WriteFile(units_dir + "/" + plan->UnitFile(1), "{}");
  std::vector<StatusOr<SweepUnit>> units;
  units.push_back(Status::DataLoss("layer 2 unreadable"));
  units.push_back(ComputeSweepUnit(*plan, 1, 1, nullptr));
  const SweepResult r = AssembleSweep(*plan, std::move(units), units_dir);
  REQUIRE(r.failed_units_size() == 1);
  CHECK(r.failed_units(0).sample_id() == "s0");
  CHECK(r.failed_units(0).error() == "layer 2 unreadable");
  CHECK(r.runs_size() == 3);
  for (const Aggregate& a : r.aggregates()) CHECK(a.n() == 1);
  CHECK_FALSE(fs::exists(units_dir + "/stale-0000.json"));
  CHECK(fs::exists(units_dir + "/" + plan->UnitFile(1)));
}

StatusOr<std::string> ShrankHash(const std::string& path) {
  return Status::DataLoss(path + ": the file shrank to 0 bytes while it was being hashed");
}

TEST_CASE("HashBesideReplay: serial and concurrent give the same hash; a failed hash is the error",
          "[sweep]") {
  const std::string path = TwoTraces().dir + "/s0.h5";
  const auto want = HashFile(path);
  REQUIRE(want.ok());
  for (bool concurrent : {false, true}) {
    INFO("concurrent " << concurrent);
    std::string given = "unset";
    auto replay_ok = [&](const std::string& h) {
      given = h;
      return Status::Ok();
    };
    auto h = HashBesideReplay(path, concurrent ? 2 : 1, replay_ok);
    REQUIRE(h.ok());
    CHECK(*h == *want);
    CHECK(given == (concurrent ? "" : *want));  // concurrently the caller records the returned hash
    // The hash fails: its error, whether the replay succeeded or failed too (serially it never ran).
    given = "unset";
    auto failed = HashBesideReplay(path, concurrent ? 2 : 1, replay_ok, &ShrankHash);
    CHECK(failed.status().code() == StatusCode::kDataLoss);
    CHECK(failed.status().message() == path + ": the file shrank to 0 bytes while it was being hashed");
    CHECK(given == (concurrent ? "" : "unset"));
    auto replay_fails = [&](const std::string&) { return Status::InvalidArgument("replay failed"); };
    CHECK(HashBesideReplay(path, concurrent ? 2 : 1, replay_fails, &ShrankHash).status().code() ==
          StatusCode::kDataLoss);
    // The replay fails, the hash does not: the replay's error.
    auto r = HashBesideReplay(path, concurrent ? 2 : 1, replay_fails);
    CHECK(r.status().message() == "replay failed");
  }
}

TEST_CASE("run and sweep: the trace hash beside the replay (page cache warm) is the serial one", "[sweep]") {
  const Dataset& d = TwoTraces();
  const std::string path = d.dir + "/s0.h5";
  REQUIRE(HashFile(path).ok());  // read: in the page cache
  CHECK_FALSE(HashConcurrently(path, 1));
  REQUIRE(HashConcurrently(path, 2));
  CHECK_FALSE(HashConcurrently(d.dir + "/missing.h5", 2));
  const RunOptions serial{1, false, "", -1, "", ""}, concurrent{2, false, "", -1, "", ""};
  auto a = RunOne(path, "snapkv", {}, 0.25, 0, QuestionMode::kQueryAgnostic, serial);
  auto b = RunOne(path, "snapkv", {}, 0.25, 0, QuestionMode::kQueryAgnostic, concurrent);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a->trace_hash() == *HashFile(path));
  CHECK(google::protobuf::util::MessageDifferencer::Equals(*a, *b));
  auto x = RunSweep(d.experiment, d.dir, serial);
  auto y = RunSweep(d.experiment, d.dir, concurrent);
  REQUIRE(x.ok());
  REQUIRE(y.ok());
  REQUIRE(x->runs_size() == 6);
  for (const RunResult& r : y->runs()) CHECK(r.trace_hash() == *HashFile(r.trace_path()));
  CHECK(google::protobuf::util::MessageDifferencer::Equals(*x, *y));
}

TEST_CASE("sweep outputs: the files are the same at any thread count, each in its place", "[sweep]") {
  // WriteSweepOutputs formats results.json beside the tables (2 threads): every file byte for byte the
  // serial one's, and each under its own name.
  const Dataset& d = TwoTraces();
  auto result = RunSweep(d.experiment, d.dir, RunOptions{1, false, "", -1, "", ""});
  REQUIRE(result.ok());
  const std::string dir = testing::ScratchDir("sweep_outputs");
  REQUIRE(WriteSweepOutputs(*result, dir + "/serial", 1).ok());
  const std::vector<RunResult> runs(result->runs().begin(), result->runs().end());
  const std::vector<Aggregate> aggregates(result->aggregates().begin(), result->aggregates().end());
  CHECK(testing::ReadFile(dir + "/serial/results.json") == ToJson(*result));
  CHECK(testing::ReadFile(dir + "/serial/runs.csv") == RunsCsv(runs));
  CHECK(testing::ReadFile(dir + "/serial/layers.csv") == LayersCsv(runs));
  CHECK(testing::ReadFile(dir + "/serial/aggregates.csv") == AggregatesCsv(aggregates));
  CHECK(
      testing::ReadFile(dir + "/serial/summary.md").rfind(SummaryMarkdown(runs, "kvsim sweep summary"), 0) ==
      0);
  for (int threads : {0, 2, 3}) {
    const std::string out = dir + "/t" + std::to_string(threads);
    REQUIRE(WriteSweepOutputs(*result, out, threads).ok());
    for (const std::string& name : kSweepOutputNames) {
      INFO(name << " threads " << threads);
      CHECK(testing::ReadFile(out + "/" + name) == testing::ReadFile(dir + "/serial/" + name));
    }
  }
}

TEST_CASE("sweep input: --trace folders and --manifest replace the experiment's traces", "[sweep]") {
  const Dataset& d = TwoTraces();
  const std::string dir = testing::ScratchDir("sweep_input");
  const std::string exp = testing::WriteFile(
      dir + "/exp.textproto", "traces: \"unused.h5\" policies { name: \"snapkv\" } budgets: 0.5\n");
  auto folder = LoadSweepInput(exp, {d.dir}, "");
  REQUIRE(folder.ok());
  REQUIRE(folder->experiment.samples_size() == 2);
  CHECK(folder->experiment.samples(1).id() == "s1");
  CHECK(folder->base_dir == ".");
  const std::string manifest =
      testing::WriteFile(dir + "/m.csv", "id,path,tags\na," + d.dir + "/s1.h5,split=dev\n");
  auto m = LoadSweepInput(exp, {}, manifest);
  REQUIRE(m.ok());
  REQUIRE(m->experiment.samples_size() == 1);
  CHECK(m->experiment.samples(0).tags(0) == "split=dev");
  auto both = LoadSweepInput(exp, {d.dir}, manifest);
  REQUIRE_FALSE(both.ok());
  CHECK(both.status().message().find("give --manifest or --trace, not both") != std::string::npos);
  auto plain = LoadSweepInput(exp, {}, "");
  REQUIRE(plain.ok());
  CHECK(plain->base_dir == dir);
  CHECK(plain->experiment.traces(0) == "unused.h5");
}

}  // namespace
}  // namespace kvsim
