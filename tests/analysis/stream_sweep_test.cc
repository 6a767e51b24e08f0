// `kvsim run` / `kvsim sweep` / `kvsim inspect` on streaming traces, end to end through the binary, and the
// streaming report writers (analysis/stream_sweep.cc).
#include "analysis/stream_sweep.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <google/protobuf/util/message_differencer.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "analysis/sweep.h"
#include "tests/test_util.h"
#include "traces/hdf5_trace.h"
#include "traces/synth.h"

namespace kvsim {
namespace {

namespace fs = std::filesystem;

std::string Kvsim() { return testing::KvsimBinary(); }

std::string ReadAll(const std::string& path) { return testing::ReadFile(path); }

int Lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

const std::string& TinyStream() {
  static const std::string path = [] {
    const std::string out = testing::ScratchDir("stream_cli") + "/stream.h5";
    std::string log;
    const int rc = testing::RunCommand(Kvsim() + " synth --config " + testing::SourceDir() +
                                           "/configs/synth/streaming_tiny.textproto --out " + out,
                                       &log);
    INFO(log);
    REQUIRE(rc == 0);
    return out;
  }();
  return path;
}

const char* kMukvSets = " --set granularities=4,16,64 --set keep_ratios=0.5,0.25,0.8 ";

TEST_CASE("stream cli: inspect summarises the stream, run writes a streaming result", "[stream_cli]") {
  std::string out;
  REQUIRE(testing::RunCommand(Kvsim() + " inspect " + TinyStream(), &out) == 0);
  CHECK(out.find("questions: 3") != std::string::npos);
  CHECK(out.find("block encodings: g4") != std::string::npos);
  const std::string dir = testing::ScratchDir("stream_cli_run");
  const std::string res = dir + "/mukv.json";
  REQUIRE(testing::RunCommand(Kvsim() + " run --trace " + TinyStream() + " --policy mukv" + kMukvSets +
                                  "--budget-tokens 64 --threads 1 --out " + res,
                              &out) == 0);
  const std::string json = ReadAll(res);
  CHECK(json.find("\"policy\": \"mukv\"") != std::string::npos);
  CHECK(json.find("\"evidence_frame_recall\"") != std::string::npos);
  CHECK(json.find("\"memory\"") != std::string::npos);
  // Same run at 2 threads: identical bytes.
  const std::string res2 = dir + "/mukv2.json";
  REQUIRE(testing::RunCommand(Kvsim() + " run --trace " + TinyStream() + " --policy mukv" + kMukvSets +
                                  "--budget-tokens 64 --threads 2 --out " + res2,
                              &out) == 0);
  CHECK(ReadAll(res2) == json);
  // Default budget (no --budget-tokens).
  REQUIRE(testing::RunCommand(
              Kvsim() + " run --trace " + TinyStream() + " --policy rekv --out " + dir + "/rekv.json",
              &out) == 0);
}

TEST_CASE("stream cli: bad input gives one-line errors and no output", "[stream_cli]") {
  const std::string dir = testing::ScratchDir("stream_cli_bad");
  std::string out;
  auto fails = [&](const std::string& args, const std::string& needle) {
    const std::string res = dir + "/r.json";
    const int rc = testing::RunCommand(Kvsim() + " " + args + " --out " + res, &out);
    INFO(args << "\n" << out);
    CHECK(rc != 0);
    CHECK(out.find(needle) != std::string::npos);
    CHECK(Lines(out) == 1);
    CHECK_FALSE(fs::exists(res));
  };
  fails("run --trace " + TinyStream() + " --policy rekv --budget 0.2", "give --budget-tokens");
  fails("run --trace " + TinyStream() + " --policy snapkv --budget-tokens 8", "is not a streaming policy");
  fails("run --trace " + TinyStream() + " --policy mukv --set granularities=4,16,64 --budget-tokens 8",
        "int(g * keep) must be >= 1");
  fails("run --trace " + TinyStream() + " --policy mukv --set granularities=4,16 --budget-tokens 8",
        "one value per granularity");
  // A streaming policy on a plain trace.
  const std::string plain = dir + "/plain.h5";
  REQUIRE(testing::RunCommand(Kvsim() + " synth --config " + testing::SourceDir() +
                                  "/configs/synth/tiny.textproto --out " + plain,
                              &out) == 0);
  fails("run --trace " + plain + " --policy rekv --budget 0.2", "is a streaming policy");
}

TEST_CASE("stream cli: sweep writes every output; fractions and mixed experiments are refused",
          "[stream_cli]") {
  const std::string dir = testing::ScratchDir("stream_cli_sweep");
  const std::string cfg = dir + "/exp.textproto";
  {
    std::ofstream f(cfg);
    f << "traces: \"" << TinyStream() << "\"\n"
      << "policies { name: \"stream_full\" }\npolicies { name: \"rekv\" }\n"
      << "policies { name: \"mukv\" set: \"granularities=4,16,64\" set: \"keep_ratios=0.5,0.25,0.8\" }\n"
      << "budget_tokens: 32\nbudget_tokens: 64\n";
  }
  std::string out;
  const std::string res = dir + "/out";
  REQUIRE(testing::RunCommand(Kvsim() + " sweep --config " + cfg + " --out " + res, &out) == 0);
  for (const char* f : {"results.json", "runs.csv", "questions.csv", "memory.csv", "summary.md"})
    CHECK(fs::exists(res + "/" + f));
  // stream_full runs once, rekv and mukv at both budgets: 5 runs; 3 questions each.
  CHECK(Lines(ReadAll(res + "/runs.csv")) == 1 + 5);
  CHECK(ReadAll(res + "/memory.csv").rfind("run,trace_hash,policy,label,budget_tokens,time_s,", 0) == 0);
  CHECK(Lines(ReadAll(res + "/questions.csv")) == 1 + 5 * 3);
  CHECK(ReadAll(res + "/summary.md").find("| mukv granularities=4,16,64 keep_ratios=0.5,0.25,0.8 | 64 |") !=
        std::string::npos);
  // Rerunning into the same folder replaces it.
  REQUIRE(testing::RunCommand(Kvsim() + " sweep --config " + cfg + " --out " + res, &out) == 0);
  // Fractions.
  {
    std::ofstream f(cfg);
    f << "traces: \"" << TinyStream() << "\"\npolicies { name: \"rekv\" }\nbudgets: 0.1\n";
  }
  CHECK(testing::RunCommand(Kvsim() + " sweep --config " + cfg + " --out " + dir + "/o2", &out) != 0);
  CHECK(out.find("budget_tokens") != std::string::npos);
  CHECK_FALSE(fs::exists(dir + "/o2"));
  // Mixed traces.
  const std::string plain = dir + "/plain.h5";
  REQUIRE(testing::RunCommand(Kvsim() + " synth --config " + testing::SourceDir() +
                                  "/configs/synth/tiny.textproto --out " + plain,
                              &out) == 0);
  {
    std::ofstream f(cfg);
    f << "traces: \"" << TinyStream() << "\"\ntraces: \"" << plain
      << "\"\npolicies { name: \"rekv\" }\nbudget_tokens: 32\n";
  }
  CHECK(testing::RunCommand(Kvsim() + " sweep --config " + cfg + " --out " + dir + "/o3", &out) != 0);
  CHECK(out.find("mixes streaming and non-streaming") != std::string::npos);
}

TEST_CASE("streaming run and sweep: the trace hash beside the replay (page cache warm) is the serial one",
          "[stream_sweep]") {
  const std::string path = TinyStream();
  REQUIRE(HashFile(path).ok());  // read: in the page cache
  REQUIRE(HashConcurrently(path, 2));
  const RunOptions serial{1, false, "", -1, "", ""}, concurrent{2, false, "", -1, "", ""};
  auto a = RunStreamOne(path, "rekv", {}, 32, serial);
  auto b = RunStreamOne(path, "rekv", {}, 32, concurrent);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a->trace_hash() == *HashFile(path));
  CHECK(google::protobuf::util::MessageDifferencer::Equals(*a, *b));
  config::Experiment e;
  e.add_traces(path);
  e.add_policies()->set_name("stream_full");
  e.add_policies()->set_name("rekv");
  e.add_budget_tokens(32);
  auto x = RunStreamSweep(e, ".", serial, nullptr);
  auto y = RunStreamSweep(e, ".", concurrent, nullptr);
  REQUIRE(x.ok());
  REQUIRE(y.ok());
  REQUIRE(x->runs_size() == 2);
  for (const StreamRunResult& r : y->runs()) CHECK(r.trace_hash() == *HashFile(path));
  CHECK(google::protobuf::util::MessageDifferencer::Equals(*x, *y));
}

TEST_CASE("stream report: CSV rows and summary columns", "[stream_cli]") {
  StreamRunResult r;
  r.set_policy("rekv");
  r.set_label("rekv");
  r.set_budget_tokens(12);
  r.mutable_mean()->set_retained_mass_mean(0.5);
  r.mutable_mean()->set_evidence_frame_recall(-1);
  r.add_questions()->set_question(0);
  r.add_questions()->set_question(1);
  auto* p = r.add_memory();
  p->set_time_s(1.5);
  p->set_event("encode");
  const std::vector<StreamRunResult> runs{r};
  CHECK(Lines(StreamRunsCsv(runs)) == 2);
  CHECK(Lines(StreamQuestionsCsv(runs)) == 3);
  CHECK(StreamMemoryCsv(runs).find("\n0,,rekv,rekv,12,1.5,encode,") != std::string::npos);
  const std::string md = StreamSummaryMarkdown(runs, "t");
  CHECK(md.find("| rekv | 12 |") != std::string::npos);
  CHECK(md.find("n/a") != std::string::npos);  // no evidence frames
}

}  // namespace
}  // namespace kvsim

namespace kvsim {

TEST_CASE("streaming inspect --json escapes the model name (valid JSON for any name)", "[stream_sweep]") {
  auto config = LoadSynthConfig(testing::SourceDir() + "/configs/synth/streaming_tiny.textproto");
  REQUIRE(config.ok());
  config->mutable_model()->set_name("my \"tiny\" model\\v2");
  auto meta = BuildSynthMeta(*config);
  REQUIRE(meta.ok());
  const std::string json = StreamSummaryJson(*meta);
  google::protobuf::Struct parsed;
  INFO(json);
  REQUIRE(google::protobuf::util::JsonStringToMessage(json, &parsed).ok());
  CHECK(parsed.fields().at("model").string_value() == "my \"tiny\" model\\v2");
}

}  // namespace kvsim
