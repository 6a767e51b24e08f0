// gpu_replay/plan.{h,cc}: the decision recorder, plan deltas replayed against the engine's own caches,
// determinism, files, validation messages, and the `kvsim gpu-plan` command.

#include "gpu_replay/plan.h"

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>

#include "policies/registry.h"
#include "tests/test_util.h"

namespace kvsim::gpu_replay {
namespace {

namespace fs = std::filesystem;

// Records the full cache (sorted anchors and merged keys) at every event, as the ground truth that the
// plan's deltas must reproduce.
class SnapshotRecorder final : public DecisionRecorder {
 public:
  struct Snap {
    std::vector<int32_t> anchors;
    std::map<int32_t, std::vector<float>> merged_keys;
  };
  void AfterPrefill(int run, int layer, int kv_head, const HeadCache& cache) override {
    Put(run, layer, kv_head, -1, cache);
  }
  void BeforeAttention(int run, int layer, int kv_head, int step, const HeadCache& cache) override {
    Put(run, layer, kv_head, 2 * step, cache);
  }
  void AfterStep(int run, int layer, int kv_head, int step, const HeadCache& cache) override {
    Put(run, layer, kv_head, 2 * step + 1, cache);
  }
  std::map<std::tuple<int, int, int, int>, Snap> snaps;

 private:
  void Put(int run, int layer, int kv_head, int event, const HeadCache& cache) {
    Snap s;
    s.anchors.assign(cache.tokens().begin(), cache.tokens().end());
    std::sort(s.anchors.begin(), s.anchors.end());
    for (int i = 0; i < cache.size(); ++i)
      if (cache.is_merged(i)) s.merged_keys[cache.token(i)] = cache.merged(i).key;
    std::lock_guard<std::mutex> lock(mu_);
    snaps[{run, layer, kv_head, event}] = std::move(s);
  }
  std::mutex mu_;
};

// Both recorders on one replay.
class TeeRecorder final : public DecisionRecorder {
 public:
  TeeRecorder(DecisionRecorder* a, DecisionRecorder* b) : a_(a), b_(b) {}
  void Begin(const TraceMeta& meta, std::span<const RunSpec> runs, std::span<const int> ce,
             std::span<const std::vector<int>> hb) override {
    a_->Begin(meta, runs, ce, hb);
    b_->Begin(meta, runs, ce, hb);
  }
  void AfterPrefill(int r, int l, int u, const HeadCache& c) override {
    a_->AfterPrefill(r, l, u, c);
    b_->AfterPrefill(r, l, u, c);
  }
  void BeforeAttention(int r, int l, int u, int t, const HeadCache& c) override {
    a_->BeforeAttention(r, l, u, t, c);
    b_->BeforeAttention(r, l, u, t, c);
  }
  void AfterStep(int r, int l, int u, int t, const HeadCache& c) override {
    a_->AfterStep(r, l, u, t, c);
    b_->AfterStep(r, l, u, t, c);
  }

 private:
  DecisionRecorder *a_, *b_;
};

void CheckState(const HeadState& st, const SnapshotRecorder::Snap& snap) {
  std::vector<int32_t> anchors = st.anchors;
  std::sort(anchors.begin(), anchors.end());
  REQUIRE(anchors == snap.anchors);
  REQUIRE(st.merges.size() == snap.merged_keys.size());
  for (const PlanMergedSlot& m : st.merges) {
    auto it = snap.merged_keys.find(m.anchor());
    REQUIRE(it != snap.merged_keys.end());
    REQUIRE(std::vector<float>(m.key().begin(), m.key().end()) == it->second);
  }
}

// Replays `policy` (several runs at once: budget 0.25 and 0.5) and checks each plan against the snapshots.
void CheckPlansReproduceCaches(const std::string& policy, const std::vector<std::string>& sets,
                               const testing::TinyTraceSpec& spec = {}) {
  INFO(policy);
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  auto p = PolicyRegistry::Default().Create(policy, sets);
  REQUIRE(p.ok());
  std::vector<RunSpec> runs{RunSpec{*p, policy, 0.25}, RunSpec{*p, policy, 0.5}};
  PlanRecorder plans;
  SnapshotRecorder snaps;
  TeeRecorder tee(&plans, &snaps);
  ReplayOptions ro;
  ro.threads = 2;
  ro.recorder = &tee;
  auto results = Replay(trace, runs, ro);
  REQUIRE(results.ok());
  const ModelInfo& m = trace.meta().model;
  for (int r = 0; r < 2; ++r) {
    const GpuPlan plan = plans.TakePlan(r, (*results)[r]);
    Status st = ValidatePlan(plan, "plan");
    INFO(st.message());
    REQUIRE(st.ok());
    REQUIRE(plan.heads_size() == m.num_layers * m.num_kv_heads);
    CHECK(plan.budget_tokens() == (*results)[r].budget_tokens());
    for (const HeadPlan& h : plan.heads()) {
      HeadState state = InitialState(h);
      CheckState(state, snaps.snaps.at({r, h.layer(), h.kv_head(), -1}));
      for (int t = 0; t < h.steps_size(); ++t) {
        ApplyDelta(h.steps(t).before_attention(), &state);
        CheckState(state, snaps.snaps.at({r, h.layer(), h.kv_head(), 2 * t}));
        ApplyDelta(h.steps(t).after_step(), &state);
        CheckState(state, snaps.snaps.at({r, h.layer(), h.kv_head(), 2 * t + 1}));
      }
    }
    // Lengths per step agree with the engine's own per-head token counts.
    for (int l = 0; l < m.num_layers; ++l) {
      const LayerResult& lr = (*results)[r].layers(l);
      for (int u = 0; u < m.num_kv_heads; ++u) {
        double sum = 0;
        for (int t = 0; t < plan.num_decode_steps(); ++t)
          sum += LengthsAtStep(plan, t)[l * m.num_kv_heads + u];
        CHECK(sum / plan.num_decode_steps() == Approx(lr.kv_head_tokens_mean(u)));
      }
    }
  }
}

}  // namespace

TEST_CASE("gpu plan: deltas reproduce the engine's caches at every event", "[gpu_replay][plan]") {
  CheckPlansReproduceCaches("snapkv", {"window=4"});
  CheckPlansReproduceCaches("h2o", {});  // decode-time evictions
  CheckPlansReproduceCaches("streaming_llm", {});
  CheckPlansReproduceCaches("snapkv+average", {"window=4"});  // merged K/V after prefill
  CheckPlansReproduceCaches("h2o+weighted", {});              // merges during decode
  CheckPlansReproduceCaches("oracle", {});                    // re-selection every step (tokens come back)
  testing::TinyTraceSpec gqa;
  gqa.num_heads = 4;
  gqa.num_kv_heads = 2;
  CheckPlansReproduceCaches("adakv", {}, gqa);                   // ragged per-head budgets
  CheckPlansReproduceCaches("meda", {"variant=OFFICIAL_CODE"});  // compression at decode step 0
}

TEST_CASE("gpu plan: ragged budgets and compression step are recorded", "[gpu_replay][plan]") {
  testing::TinyTraceSpec spec;
  spec.num_heads = 4;
  spec.num_kv_heads = 4;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  auto p = PolicyRegistry::Default().Create("adakv");
  REQUIRE(p.ok());
  RunResult res;
  auto plan = BuildPlanFromSource(trace, RunSpec{*p, "adakv", 0.3}, 1, &res);
  REQUIRE(plan.ok());
  CHECK(plan->compression_step() == -1);
  for (int l = 0; l < spec.num_layers; ++l)
    for (int u = 0; u < spec.num_kv_heads; ++u) {
      const HeadPlan& h = plan->heads(l * spec.num_kv_heads + u);
      CHECK(h.budget() == res.layers(l).kv_head_budgets(u));
      CHECK(h.kept_after_compression() <= h.budget() + (spec.prefill_length - plan->compress_end()));
      CHECK(h.max_slots() ==
            h.kept_after_compression() + h.new_tokens());  // prefill-compressing: appends only
    }
  auto meda = PolicyRegistry::Default().Create("meda", std::vector<std::string>{"variant=OFFICIAL_CODE"});
  REQUIRE(meda.ok());
  auto plan2 = BuildPlanFromSource(trace, RunSpec{*meda, "meda", 0.3}, 1);
  REQUIRE(plan2.ok());
  CHECK(plan2->compression_step() == 0);
  // Official MEDA keeps the whole prompt at prefill and compresses after step 0 attends.
  CHECK(plan2->heads(0).slots_size() == spec.prefill_length);
  for (const HeadPlan& h : plan2->heads()) {
    HeadState st = InitialState(h);
    ApplyDelta(h.steps(0).before_attention(), &st);
    ApplyDelta(h.steps(0).after_step(), &st);
    CHECK(h.kept_after_compression() == static_cast<int>(st.anchors.size()));
  }
}

TEST_CASE("gpu plan: identical at any thread count", "[gpu_replay][plan]") {
  MemoryTrace trace = testing::MakeTinyTrace();
  auto p = PolicyRegistry::Default().Create("h2o+average");
  REQUIRE(p.ok());
  auto a = BuildPlanFromSource(trace, RunSpec{*p, "x", 0.3}, 1);
  auto b = BuildPlanFromSource(trace, RunSpec{*p, "x", 0.3}, 3);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a->SerializeAsString() == b->SerializeAsString());
}

TEST_CASE("gpu plan: files are atomic, bad input names the file and field", "[gpu_replay][plan]") {
  MemoryTrace trace = testing::MakeTinyTrace();
  auto p = PolicyRegistry::Default().Create("snapkv", std::vector<std::string>{"window=4"});
  REQUIRE(p.ok());
  auto plan = BuildPlanFromSource(trace, RunSpec{*p, "snapkv", 0.3}, 1);
  REQUIRE(plan.ok());
  const std::string dir = testing::ScratchDir("gpu_plan_files");
  const std::string path = dir + "/plan.pb";
  REQUIRE(WritePlan(*plan, path).ok());
  for (const auto& e : fs::directory_iterator(dir)) CHECK(e.path().filename() == "plan.pb");  // no temp left
  auto back = ReadPlan(path);
  REQUIRE(back.ok());
  CHECK(back->SerializeAsString() == plan->SerializeAsString());
  CHECK(PlanSummary(*back).find("caches") != std::string::npos);

  auto missing = ReadPlan(dir + "/nope.pb");
  CHECK(!missing.ok());
  CHECK(missing.status().message().find("nope.pb") != std::string::npos);
  {
    std::ofstream out(dir + "/garbage.pb", std::ios::binary);
    out << "\xff\xff\xff not a plan";
  }
  auto garbage = ReadPlan(dir + "/garbage.pb");
  CHECK(!garbage.ok());
  CHECK(garbage.status().message().find("garbage.pb") != std::string::npos);

  GpuPlan broken = *plan;
  broken.mutable_heads()->RemoveLast();
  REQUIRE(WritePlan(broken, dir + "/broken.pb").ok());
  auto b = ReadPlan(dir + "/broken.pb");
  CHECK(!b.ok());
  CHECK(b.status().message().find("broken.pb: field 'heads'") != std::string::npos);

  broken = *plan;
  broken.mutable_heads(1)->mutable_steps(2)->mutable_before_attention()->add_removed(100000);
  const Status st = ValidatePlan(broken, "p.pb");
  CHECK(st.message().find("p.pb: heads[1].steps[2].before_attention.removed") != std::string::npos);

  broken = *plan;
  broken.mutable_heads(0)->add_slots(broken.heads(0).slots(0));  // a token twice
  CHECK(ValidatePlan(broken, "p.pb").message().find("heads[0].slots.added") != std::string::npos);
}

TEST_CASE("gpu plan: sizes whose products overflow int32 are refused (fuzz_plan_reader)",
          "[gpu_replay][plan]") {
  // num_layers * num_kv_heads = 2^32 wrapped to 0 and let a plan with no heads through.
  GpuPlan plan;
  plan.set_format_version(kPlanFormatVersion);
  plan.mutable_model()->set_num_layers(65536);
  plan.mutable_model()->set_num_heads(65536);
  plan.mutable_model()->set_num_kv_heads(65536);
  plan.mutable_model()->set_head_dim(1);
  plan.set_prefill_length(1);
  CHECK(ValidatePlan(plan, "p.pb").message().find("num_kv_heads = 4294967296") != std::string::npos);
  // The last token index, prefill_length + num_decode_steps - 1, must be an int32.
  plan.mutable_model()->set_num_layers(1);
  plan.mutable_model()->set_num_heads(1);
  plan.mutable_model()->set_num_kv_heads(1);
  plan.set_prefill_length(std::numeric_limits<int32_t>::max());
  plan.set_num_decode_steps(2);
  HeadPlan* head = plan.add_heads();
  head->add_steps();
  head->add_steps();
  CHECK(ValidatePlan(plan, "p.pb").message().find("'prefill_length'") != std::string::npos);
}

TEST_CASE("gpu plan: kvsim gpu-plan writes a plan, errors exit 1 in one line", "[gpu_replay][plan][cli]") {
  const std::string dir = testing::ScratchDir("gpu_plan_cli");
  const std::string trace = dir + "/tiny.h5";
  std::string log;
  REQUIRE(testing::RunCommand(testing::KvsimBinary() + " synth --config " + testing::SourceDir() +
                                  "/configs/synth/tiny.textproto --out " + trace + " --threads 1",
                              &log) == 0);
  const std::string out = dir + "/plan.pb";
  INFO(log);
  REQUIRE(testing::RunCommand(testing::KvsimBinary() + " gpu-plan --trace " + trace +
                                  " --policy snapkv --budget 0.2 --threads 1 --out " + out,
                              &log) == 0);
  auto plan = ReadPlan(out);
  REQUIRE(plan.ok());
  CHECK(plan->policy() == "snapkv");
  CHECK(plan->trace_hash().size() > 8);
  CHECK(log.find("caches") != std::string::npos);

  CHECK(testing::RunCommand(testing::KvsimBinary() + " gpu-plan --trace " + dir +
                                "/missing.h5 --policy snapkv --budget 0.2 --out " + dir + "/x.pb",
                            &log) == 1);
  CHECK(log.find("missing.h5") != std::string::npos);
  CHECK(std::count(log.begin(), log.end(), '\n') == 1);
  CHECK(!fs::exists(dir + "/x.pb"));
  CHECK(testing::RunCommand(testing::KvsimBinary() + " gpu-plan --trace " + trace +
                                " --policy nope --budget 0.2 --out " + dir + "/x.pb",
                            &log) == 1);
  CHECK(testing::RunCommand(
            testing::KvsimBinary() + " gpu-plan --trace " + trace + " --policy snapkv --out " + dir + "/x.pb",
            &log) == 2);
  CHECK(!fs::exists(dir + "/x.pb"));
}

TEST_CASE("gpu plan: --result, --config/--out-dir and kvsim hash agree on the trace",
          "[gpu_replay][plan][cli]") {
  const std::string dir = testing::ScratchDir("gpu_plan_config");
  const std::string trace = dir + "/tiny.h5";
  std::string log;
  REQUIRE(testing::RunCommand(testing::KvsimBinary() + " synth --config " + testing::SourceDir() +
                                  "/configs/synth/tiny.textproto --out " + trace + " --threads 1",
                              &log) == 0);
  REQUIRE(testing::RunCommand(testing::KvsimBinary() + " hash " + trace, &log) == 0);
  const std::string hash = log.substr(0, log.find('\n'));
  CHECK(hash.size() == 16);
  CHECK(testing::RunCommand(testing::KvsimBinary() + " hash", &log) == 2);
  CHECK(testing::RunCommand(testing::KvsimBinary() + " hash " + dir + "/missing.h5", &log) == 1);

  // One plan with its replay result.
  REQUIRE(testing::RunCommand(testing::KvsimBinary() + " gpu-plan --trace " + trace +
                                  " --policy h2o --budget 0.25 --threads 1 --out " + dir +
                                  "/h2o.pb --result " + dir + "/h2o.result.json",
                              &log) == 0);
  auto plan = ReadPlan(dir + "/h2o.pb");
  REQUIRE(plan.ok());
  CHECK(plan->trace_hash() == hash);
  const std::string json = testing::ReadFile(dir + "/h2o.result.json");
  CHECK(json.find("\"trace_hash\": \"" + hash + "\"") != std::string::npos);
  CHECK(json.find("\"policy\": \"h2o\"") != std::string::npos);

  // A plan per experiment run: full once, snapkv (labelled) at two budgets.
  const std::string exp = dir + "/exp.textproto";
  std::ofstream(exp) << "traces: \"tiny.h5\"\npolicies { name: \"full\" }\n"
                        "policies { name: \"snapkv\" set: \"window=8\" label: \"snap w8\" }\n"
                        "budgets: 0.1\nbudgets: 0.5\n";
  const std::string plans = dir + "/plans";
  REQUIRE(testing::RunCommand(testing::KvsimBinary() + " gpu-plan --trace " + trace + " --config " + exp +
                                  " --out-dir " + plans + " --threads 1",
                              &log) == 0);
  INFO(log);
  for (const char* f : {"00_full_1", "01_snap_w8_0.1", "02_snap_w8_0.5"}) {
    CHECK(fs::exists(plans + "/" + f + ".pb"));
    CHECK(fs::exists(plans + "/" + f + ".result.json"));
  }
  auto labelled = ReadPlan(plans + "/02_snap_w8_0.5.pb");
  REQUIRE(labelled.ok());
  CHECK(labelled->label() == "snap w8");
  CHECK(labelled->budget_fraction() == 0.5);
  CHECK(labelled->trace_hash() == hash);
  // A bad experiment: one line, exit 1, nothing written.
  std::ofstream(exp) << "traces: \"tiny.h5\"\npolicies { name: \"nope\" }\nbudgets: 0.1\n";
  CHECK(testing::RunCommand(testing::KvsimBinary() + " gpu-plan --trace " + trace + " --config " + exp +
                                " --out-dir " + dir + "/plans2",
                            &log) == 1);
  CHECK(std::count(log.begin(), log.end(), '\n') == 1);
  CHECK(!fs::exists(dir + "/plans2"));
}

}  // namespace kvsim::gpu_replay
