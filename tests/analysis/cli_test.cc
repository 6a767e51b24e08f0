// End-to-end tests of the kvsim binary: exit codes, one-line errors, no partial output, determinism.

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "sim/results.pb.h"
#include "tests/test_util.h"
#include "traces/hdf5_trace.h"

namespace kvsim {
namespace {

namespace fs = std::filesystem;

std::string Kvsim() { return testing::KvsimBinary(); }

std::string ReadAll(const std::string& path) { return testing::ReadFile(path); }

// A tiny synthetic trace shared by the tests of this file.
const std::string& TinyTrace() {
  static const std::string path = [] {
    const std::string dir = testing::ScratchDir("cli_trace");
    const std::string out = dir + "/tiny.h5";
    std::string log;
    const int rc = testing::RunCommand(Kvsim() + " synth --config " + testing::SourceDir() +
                                           "/configs/synth/tiny.textproto --out " + out + " --threads 1",
                                       &log);
    INFO(log);
    REQUIRE(rc == 0);
    return out;
  }();
  return path;
}

}  // namespace

TEST_CASE("cli: usage errors exit 2, help exits 0", "[cli]") {
  std::string out;
  CHECK(testing::RunCommand(Kvsim(), &out) == 2);
  CHECK(testing::RunCommand(Kvsim() + " frobnicate", &out) == 2);
  CHECK(out.find("unknown command") != std::string::npos);
  CHECK(testing::RunCommand(Kvsim() + " run --trace x.h5 --policy snapkv --budget 0.1", &out) == 2);
  CHECK(out.find("--out") != std::string::npos);
  CHECK(testing::RunCommand(Kvsim() + " run --trace x.h5 --policy snapkv --out r.json", &out) == 2);
  CHECK(out.find("exactly one of --budget") != std::string::npos);
  for (const char* cmd : {"synth", "inspect", "validate", "list-policies", "run", "sweep"}) {
    INFO(cmd);
    CHECK(testing::RunCommand(Kvsim() + " " + cmd + " --help", &out) == 0);
    CHECK(out.find("usage: kvsim") != std::string::npos);
  }
  CHECK(testing::RunCommand(Kvsim() + " version", &out) == 0);
}

TEST_CASE("cli: bad input gives one clear line, exit 1 and no output file", "[cli]") {
  const std::string dir = testing::ScratchDir("cli_bad");
  const std::string result = dir + "/r.json";
  std::string out;
  CHECK(testing::RunCommand(
            Kvsim() + " run --trace " + dir + "/missing.h5 --policy snapkv --budget 0.1 --out " + result,
            &out) == 1);
  CHECK(out.find("missing.h5") != std::string::npos);
  CHECK(out.find("kvsim: error:") == 0);
  CHECK(std::count(out.begin(), out.end(), '\n') == 1);
  CHECK_FALSE(fs::exists(result));
  CHECK(testing::RunCommand(
            Kvsim() + " run --trace " + TinyTrace() + " --policy nope --budget 0.1 --out " + result, &out) ==
        1);
  CHECK(out.find("unknown policy 'nope'") != std::string::npos);
  CHECK(testing::RunCommand(Kvsim() + " run --trace " + TinyTrace() +
                                " --policy snapkv --set bogus=1 --budget 0.1 --out " + result,
                            &out) == 1);
  CHECK(out.find("no parameter 'bogus'") != std::string::npos);
  CHECK(testing::RunCommand(
            Kvsim() + " run --trace " + TinyTrace() + " --policy snapkv --budget 2 --out " + result, &out) ==
        1);
  CHECK(out.find("(0, 1]") != std::string::npos);
  CHECK(testing::RunCommand(Kvsim() + " run --trace " + TinyTrace() +
                                " --policy snapkv --budget 0.1 --question-mode maybe --out " + result,
                            &out) == 1);
  CHECK_FALSE(fs::exists(result));
  // Not an HDF5 file.
  const std::string junk = dir + "/junk.h5";
  std::ofstream(junk) << "not a trace";
  CHECK(testing::RunCommand(Kvsim() + " inspect " + junk, &out) == 1);
  CHECK(out.find("junk.h5") != std::string::npos);
  // A bad synth config names the line.
  const std::string cfg = dir + "/bad.textproto";
  std::ofstream(cfg) << "model {\n  num_layers: abc\n}\n";
  CHECK(testing::RunCommand(Kvsim() + " synth --config " + cfg + " --out " + dir + "/t.h5", &out) == 1);
  CHECK(out.find("line 2") != std::string::npos);
  CHECK_FALSE(fs::exists(dir + "/t.h5"));
  // A bad experiment leaves no results folder.
  const std::string exp = dir + "/exp.textproto";
  std::ofstream(exp) << "traces: \"" << TinyTrace() << "\"\npolicies { name: \"snapkv\" }\nbudgets: 0\n";
  CHECK(testing::RunCommand(Kvsim() + " sweep --config " + exp + " --out " + dir + "/res", &out) == 1);
  CHECK(out.find("budgets") != std::string::npos);
  CHECK_FALSE(fs::exists(dir + "/res"));
  for (const auto& e : fs::directory_iterator(dir))
    CHECK(e.path().string().find(".tmp") == std::string::npos);
}

TEST_CASE("cli: run writes a complete result.json", "[cli]") {
  const std::string dir = testing::ScratchDir("cli_run");
  const std::string result = dir + "/r.json";
  std::string out;
  REQUIRE(testing::RunCommand(Kvsim() + " run --trace " + TinyTrace() +
                                  " --policy snapkv --budget 0.2 --set window=8 --threads 2 --out " + result,
                              &out) == 0);
  RunResult r;
  REQUIRE(google::protobuf::util::JsonStringToMessage(ReadAll(result), &r).ok());
  CHECK(r.policy() == "snapkv");
  CHECK(r.parameters().find("window: 8") != std::string::npos);
  CHECK(r.budget_fraction() == 0.2);
  CHECK(r.trace_hash().size() == 16);
  CHECK(r.question_mode() == "query_aware");
  CHECK(r.metrics().samples() > 0);
  CHECK(r.metrics().bound_violations() == 0);
  CHECK(r.layers_size() > 0);
  CHECK(r.timeline_size() > 1);
  CHECK(r.metrics().retained_mass_mean() > 0);
  CHECK(r.metrics().retained_mass_mean() < 1);
}

TEST_CASE("cli: sweep is deterministic across invocations and thread counts", "[cli]") {
  const std::string dir = testing::ScratchDir("cli_sweep");
  const std::string exp = testing::SourceDir() + "/configs/experiments/demo.textproto";
  std::string out;
  REQUIRE(testing::RunCommand(Kvsim() + " sweep --config " + exp + " --trace " + TinyTrace() +
                                  " --threads 1 --out " + dir + "/a",
                              &out) == 0);
  REQUIRE(testing::RunCommand(Kvsim() + " sweep --config " + exp + " --trace " + TinyTrace() +
                                  " --threads 2 --out " + dir + "/b",
                              &out) == 0);
  for (const char* f : {"results.json", "runs.csv", "layers.csv", "summary.md"}) {
    INFO(f);
    CHECK(ReadAll(dir + "/a/" + std::string(f)) == ReadAll(dir + "/b/" + std::string(f)));
  }
  const std::string summary = ReadAll(dir + "/a/summary.md");
  for (const char* p : {"full", "streaming_llm", "h2o", "snapkv", "pyramidkv", "oracle"})
    CHECK(summary.find(p) != std::string::npos);
  // A trailing slash names the same folder.
  REQUIRE(testing::RunCommand(Kvsim() + " sweep --config " + exp + " --trace " + TinyTrace() +
                                  " --threads 2 --out " + dir + "/c/",
                              &out) == 0);
  CHECK(ReadAll(dir + "/c/results.json") == ReadAll(dir + "/b/results.json"));
  CHECK_FALSE(fs::exists(dir + "/c.tmp"));
  // Re-running into the same folder replaces it.
  REQUIRE(testing::RunCommand(
              Kvsim() + " sweep --config " + exp + " --trace " + TinyTrace() + " --out " + dir + "/a",
              &out) == 0);
  CHECK(ReadAll(dir + "/a/results.json") == ReadAll(dir + "/b/results.json"));
  // Never replaces a folder holding anything else, nor a file.
  std::ofstream(dir + "/a/notes.txt") << "mine";
  CHECK(testing::RunCommand(
            Kvsim() + " sweep --config " + exp + " --trace " + TinyTrace() + " --out " + dir + "/a", &out) ==
        1);
  CHECK(out.find("notes.txt") != std::string::npos);
  CHECK(fs::exists(dir + "/a/notes.txt"));
  std::ofstream(dir + "/file") << "x";
  CHECK(testing::RunCommand(
            Kvsim() + " sweep --config " + exp + " --trace " + TinyTrace() + " --out " + dir + "/file",
            &out) == 1);
  CHECK(ReadAll(dir + "/file") == "x");
  // Tidy tables: one row per run, one per (run, layer).
  CHECK(ReadAll(dir + "/a/runs.csv").rfind("run,trace_hash,policy,label,", 0) == 0);
  CHECK(ReadAll(dir + "/a/layers.csv").find(",layer,layer_budget_tokens,") != std::string::npos);
}

TEST_CASE("cli: inspect and validate", "[cli]") {
  std::string out;
  REQUIRE(testing::RunCommand(Kvsim() + " inspect " + TinyTrace(), &out) == 0);
  CHECK(out.find("layer") != std::string::npos);
  REQUIRE(testing::RunCommand(Kvsim() + " inspect " + TinyTrace() + " --json", &out) == 0);
  CHECK(out.find('{') == 0);
  REQUIRE(testing::RunCommand(Kvsim() + " validate " + TinyTrace(), &out) == 0);
  CHECK(out.find("structure: ok") != std::string::npos);
  CHECK(out.find("-> ok") != std::string::npos);
  CHECK(testing::RunCommand(Kvsim() + " list-policies", &out) == 0);
  CHECK(out.find("pyramidkv") != std::string::npos);
  CHECK(out.find("variant: PAPER entropy: CROSS_MODAL") != std::string::npos);  // meda, resolved defaults
  CHECK(out.find("NAME+average") != std::string::npos);
}

TEST_CASE("cli: merge-wrapped and multimodal policies run end to end; bad wrappers fail cleanly", "[cli]") {
  const std::string dir = testing::ScratchDir("cli_merge");
  std::string out;
  REQUIRE(testing::RunCommand(Kvsim() + " run --trace " + TinyTrace() +
                                  " --policy snapkv+pivot --budget 0.25 --set window=4 --out " + dir +
                                  "/r.json",
                              &out) == 0);
  std::ifstream in(dir + "/r.json");
  const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(json.find("\"policy\": \"snapkv+pivot\"") != std::string::npos);
  CHECK(json.find("\"merged_tokens_mean\"") != std::string::npos);
  REQUIRE(testing::RunCommand(Kvsim() + " run --trace " + TinyTrace() +
                                  " --policy meda --budget 0.25 --set variant=OFFICIAL_CODE --out " + dir +
                                  "/m.json",
                              &out) == 0);
  CHECK(testing::RunCommand(Kvsim() + " run --trace " + TinyTrace() +
                                " --policy oracle+average --budget 0.25 --out " + dir + "/x.json",
                            &out) != 0);
  CHECK(out.find("cannot be wrapped") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(dir + "/x.json"));
}

TEST_CASE("cli: validate reports recorded aggregates that disagree with Q/K (exit 3)", "[cli]") {
  MemoryTrace tr = testing::MakeTinyTrace();
  tr.mutable_meta().has_prefill_column_sums = true;
  const TraceMeta& m = tr.meta();
  for (auto& l : tr.layers())
    l.prefill_column_sums.assign(static_cast<size_t>(m.model.num_heads) * m.prefill_length, 0.5f);
  const std::string path = testing::ScratchDir("cli_validate") + "/wrong.h5";
  auto w = Hdf5TraceWriter::Create(path);
  REQUIRE(w.ok());
  REQUIRE((*w)->Begin(m).ok());
  for (const auto& l : tr.layers()) REQUIRE((*w)->WriteLayer(l).ok());
  REQUIRE((*w)->Finish().ok());
  std::string out;
  CHECK(testing::RunCommand(Kvsim() + " validate " + path, &out) == 3);
  CHECK(out.find("MISMATCH") != std::string::npos);
}

TEST_CASE("cli: validate recomputes recorded prompt entropies: synth's are exact, wrong ones exit 3",
          "[cli]") {
  const std::string dir = testing::ScratchDir("cli_validate_entropies");
  std::string cfg = testing::ReadFile(testing::SourceDir() + "/configs/synth/tiny.textproto");
  const std::string flag = "record_prefill_column_sums: true";
  REQUIRE(cfg.find(flag) != std::string::npos);
  cfg.replace(cfg.find(flag), flag.size(), flag + " record_prompt_entropies: true");
  testing::WriteFile(dir + "/e.textproto", cfg);
  std::string out;
  REQUIRE(testing::RunCommand(Kvsim() + " synth --config " + dir + "/e.textproto --out " + dir + "/e.h5",
                              &out) == 0);
  REQUIRE(testing::RunCommand(Kvsim() + " inspect " + dir + "/e.h5", &out) == 0);
  CHECK(out.find("prefill column sums yes; prompt entropies for compress_end 84, 94\n") != std::string::npos);
  REQUIRE(testing::RunCommand(Kvsim() + " validate " + dir + "/e.h5", &out) == 0);
  // tiny: 3 layers x 2 regions (before the question, the prompt) x 3 kinds x 4 heads, every bit equal.
  CHECK(out.find(
            "prompt_entropies vs recomputed from Q/K (HeadPromptEntropies): 0 of 72 values differ, max abs "
            "deviation 0 nats -> ok") != std::string::npos);
  // The same trace with one value off by 0.5 nats (still within [0, log ce]).
  auto r = Hdf5TraceReader::Open(dir + "/e.h5");
  REQUIRE(r.ok());
  TraceMeta m = (*r)->meta();
  auto w = Hdf5TraceWriter::Create(dir + "/wrong.h5");
  REQUIRE(w.ok());
  REQUIRE((*w)->Begin(m).ok());
  for (int l = 0; l < m.model.num_layers; ++l) {
    LayerData layer;
    REQUIRE((*r)->ReadLayer(l, &layer).ok());
    if (l == 2) {  // region 0, kind 1, head 1
      double& v = layer.prompt_entropies[5];
      v = v > 1 ? v - 0.5 : v + 0.5;
    }
    REQUIRE((*w)->WriteLayer(layer).ok());
  }
  REQUIRE((*w)->Finish().ok());
  CHECK(testing::RunCommand(Kvsim() + " validate " + dir + "/wrong.h5", &out) == 3);
  CHECK(out.find("1 of 72 values differ") != std::string::npos);
  CHECK(out.find("(layer 2, region ce=") != std::string::npos);
  CHECK(out.find("kind 1, head 1) -> MISMATCH") != std::string::npos);
}

}  // namespace kvsim

namespace kvsim {
namespace {

// Values that used to be accepted silently (issue 18): each is refused with exit 1, one line naming the
// option, and nothing written; an --out naming an input never overwrites it.
TEST_CASE("cli: bad values are refused, inputs are never overwritten", "[cli]") {
  const std::string dir = testing::ScratchDir("cli_bad_values");
  std::string out;
  auto refused = [&](const std::string& args, const std::string& needle) {
    INFO(args);
    CHECK(testing::RunCommand(Kvsim() + " " + args + " 2>&1", &out) == 1);
    CHECK(out.find(needle) != std::string::npos);
    CHECK(std::count(out.begin(), out.end(), '\n') == 1);
  };
  const std::string tiny_cfg = testing::SourceDir() + "/configs/synth/tiny.textproto";
  refused("synth --config " + tiny_cfg + " --out " + dir + "/t.h5 --threads -1",
          "--threads -1: must be >= 0");
  refused("synth --config " + tiny_cfg + " --out " + dir + "/t.h5 --seed -1",
          "--seed '-1': must be an integer");
  refused("synth --config " + tiny_cfg + " --out " + dir + "/t.h5 --seed 12x", "--seed '12x'");
  CHECK_FALSE(fs::exists(dir + "/t.h5"));
  refused("validate " + TinyTrace() + " --tolerance nan", "--tolerance nan: must be a finite number >= 0");
  refused("validate " + TinyTrace() + " --tolerance -1", "--tolerance");
  refused(
      "run --trace " + TinyTrace() + " --policy snapkv --budget 0.2 --threads -2 --out " + dir + "/r.json",
      "--threads -2");
  // --out naming the input: refused before anything is read or written; the input is unchanged.
  const std::string copy = dir + "/copy.h5";
  fs::copy_file(TinyTrace(), copy);
  const std::string before = ReadAll(copy);
  refused("run --trace " + copy + " --policy snapkv --budget 0.2 --out " + copy, "would overwrite it");
  refused("run --trace " + copy + " --policy snapkv --budget 0.2 --out " + dir + "/./copy.h5",
          "would overwrite it");
  refused("gpu-plan --trace " + copy + " --policy snapkv --budget 0.2 --out " + copy, "would overwrite it");
  refused("verify hae --trace " + copy + " --out " + copy, "would overwrite it");
  CHECK(ReadAll(copy) == before);
  const std::string cfg = dir + "/cfg.textproto";
  fs::copy_file(tiny_cfg, cfg);
  refused("synth --config " + cfg + " --out " + cfg, "would overwrite it");
  CHECK(ReadAll(cfg) == ReadAll(tiny_cfg));
  // A streaming --budget-tokens 0 no longer runs the default budget.
  const std::string stream = dir + "/stream.h5";
  REQUIRE(testing::RunCommand(Kvsim() + " synth --config " + testing::SourceDir() +
                                  "/configs/synth/streaming_tiny.textproto --out " + stream,
                              &out) == 0);
  refused("run --trace " + stream + " --policy rekv --budget-tokens 0 --out " + dir + "/s.json",
          "--budget-tokens must be >= 1");
  CHECK_FALSE(fs::exists(dir + "/s.json"));
  // An --out naming an existing folder gets the default file name inside it (no longer a failed rename).
  fs::create_directories(dir + "/taken");
  CHECK(testing::RunCommand(Kvsim() + " run -q --trace " + TinyTrace() +
                                " --policy snapkv --budget 0.2 --out " + dir + "/taken",
                            &out) == 0);
  CHECK(fs::exists(dir + "/taken/result.json"));
  // gpu-plan on a streaming trace, a folder as --config, a value of the wrong type.
  refused("gpu-plan --trace " + stream + " --policy snapkv --budget 0.2 --out " + dir + "/p.pb",
          "is a streaming trace; gpu-plan records plain");
  CHECK_FALSE(fs::exists(dir + "/p.pb"));
  refused("synth --config " + dir + " --out " + dir + "/x.h5", "is a folder, not a text-proto file");
  refused("run --trace " + TinyTrace() + " --policy snapkv --budget abc --out " + dir + "/r.json",
          "the argument ('abc') for option '--budget' is invalid");
}

TEST_CASE("cli: a full disk, exhausted memory and memory limits: one line, exit 1, nothing written",
          "[cli]") {
  const std::string dir = testing::ScratchDir("cli_resources");
  const std::string tiny_cfg = testing::SourceDir() + "/configs/synth/tiny.textproto";
  std::string out;
  auto one_line = [&](const std::string& cmd, const std::string& needle) {
    INFO(cmd);
    CHECK(testing::RunCommand(cmd + " 2>&1", &out) == 1);  // not a signal: exit 1 after the message
    INFO(out);
    CHECK(out.find(needle) != std::string::npos);
    CHECK(std::count(out.begin(), out.end(), '\n') == 1);
    for (const auto& e : fs::directory_iterator(dir)) FAIL_CHECK("left behind: " + e.path().string());
  };
  // A file-size limit makes every write past 100 KiB fail as a full disk would (EFBIG); HDF5's failed
  // close used to crash kvsim at exit.
  one_line("bash -c 'ulimit -f 100; trap \"\" XFSZ; exec " + Kvsim() + " synth --config " + tiny_cfg +
               " --out " + dir + "/t.h5'",
           "(HDF5: file write failed: File too large); check free disk space");
  // More than the memory kvsim may use: refused before allocating.
  one_line("KVSIM_MAX_MEMORY=64K " + Kvsim() + " synth --config " + tiny_cfg + " --out " + dir + "/t.h5",
           "synth config: one layer (4 heads x 102 tokens x head_dim 32, float32) and the token table needs");
  one_line("KVSIM_MAX_MEMORY=64K " + Kvsim() + " run --trace " + TinyTrace() +
               " --policy snapkv --budget 0.2 --out " + dir + "/r.json",
           "two layers of keys, values and queries as float32");
  // An allocation that fails anyway (an address-space limit below what the checks see) is a clear line, not
  // a bare std::bad_alloc. (Not under ASan, which needs terabytes of address space.)
#if !defined(__SANITIZE_ADDRESS__)
  const std::string big_cfg = dir + "/../big.textproto";
  std::string cfg = testing::ReadFile(tiny_cfg);
  for (auto [from, to] : {std::pair{"num_heads: 4", "num_heads: 64"},
                          {"num_kv_heads: 4", "num_kv_heads: 64"},
                          {"tokens: 10 }", "tokens: 20000 }"},
                          {"rope_theta: 10000", "rope_theta: 100000000"},
                          {"head_dim: 32", "head_dim: 128"}})
    cfg.replace(cfg.find(from), std::string(from).size(), to);
  testing::WriteFile(big_cfg, cfg);
  one_line("bash -c 'ulimit -v 400000; exec " + Kvsim() + " synth --config " + big_cfg + " --out " + dir +
               "/big.h5 --threads 1'",
           "out of memory in 'kvsim synth'");
#endif
}

}  // namespace
}  // namespace kvsim

namespace kvsim {
namespace {

bool Has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("cli: --out paths are normalised the same way for every command", "[cli][friction]") {
  namespace fs = std::filesystem;
  const std::string dir = testing::ScratchDir("cli_out_paths");
  const std::string trace = TinyTrace();
  std::string out;
  // A folder output with trailing slashes and "./" parts: the folder, named cleanly.
  const std::string exp = testing::SourceDir() + "/configs/experiments/demo.textproto";
  REQUIRE(testing::RunCommand("cd " + dir + " && " + Kvsim() + " sweep -q --config " + exp + " --trace " +
                                  trace + " --out ./results///",
                              &out) == 0);
  CHECK(fs::exists(dir + "/results/results.json"));
  CHECK(Has(out, "-> results/{results.json"));
  CHECK_FALSE(Has(out, "//"));
  // "." or ".." as a folder output would replace the current folder: refused in one line.
  CHECK(testing::RunCommand(
            "cd " + dir + " && " + Kvsim() + " sweep -q --config " + exp + " --trace " + trace + " --out .",
            &out) == 1);
  CHECK(Has(out, "kvsim: error: --out '.': give a new folder's name"));
  // A file output naming a folder (trailing slash or existing): the command's default name inside it.
  fs::create_directories(dir + "/into");
  REQUIRE(testing::RunCommand(
              Kvsim() + " run -q --trace " + trace + " --policy snapkv --budget 0.5 --out " + dir + "/into/",
              &out) == 0);
  CHECK(fs::exists(dir + "/into/result.json"));
  REQUIRE(testing::RunCommand(
              Kvsim() + " search -q " + trace + " --policy h2o --at-least 0.5 --out " + dir + "/into",
              &out) == 0);
  CHECK(fs::exists(dir + "/into/search.json"));
  REQUIRE(testing::RunCommand(Kvsim() + " synth --config " + testing::SourceDir() +
                                  "/configs/synth/tiny.textproto --out " + dir + "/into/",
                              &out) == 0);
  CHECK(fs::exists(dir + "/into/tiny.h5"));
  REQUIRE(testing::RunCommand(
              Kvsim() + " verify hae -q --trace " + trace + " --rc-size 4 --out " + dir + "/into/", &out) ==
          0);
  CHECK(fs::exists(dir + "/into/report.json"));
  CHECK(fs::exists(dir + "/into/report.md"));
  REQUIRE(testing::RunCommand(Kvsim() + " gpu-plan -q --trace " + trace +
                                  " --policy snapkv --budget 0.5 --out " + dir + "/into/ --result " + dir +
                                  "/into/",
                              &out) == 0);
  CHECK(fs::exists(dir + "/into/plan.pb"));
  CHECK(fs::exists(dir + "/into/result.json"));
  REQUIRE(testing::RunCommand(Kvsim() + " gpu-plan -q --trace " + trace + " --config " + exp + " --out-dir " +
                                  dir + "/plans//",
                              &out) == 0);
  CHECK(fs::exists(dir + "/plans/00_full_1.pb"));
  CHECK_FALSE(Has(out, "//"));
  // A file output in a folder that does not exist: refused before any work, one line, nothing created.
  for (const std::string& cmd :
       {" run -q --trace " + trace + " --policy snapkv --budget 0.5 --out " + dir + "/missing/r.json",
        " search -q " + trace + " --policy h2o --at-least 0.5 --out " + dir + "/missing/",
        " synth --config " + testing::SourceDir() + "/configs/synth/tiny.textproto --out " + dir +
            "/missing/t.h5"}) {
    INFO(cmd);
    CHECK(testing::RunCommand(Kvsim() + cmd, &out) == 1);
    CHECK(Has(out, "kvsim: error: --out "));
    CHECK(Has(out, "does not exist; create it first (mkdir -p "));
    CHECK(std::count(out.begin(), out.end(), '\n') == 1);
    CHECK_FALSE(fs::exists(dir + "/missing"));
  }
}

TEST_CASE("cli: run warns in one line when the run is degenerate", "[cli][friction]") {
  const std::string dir = testing::ScratchDir("cli_warnings");
  const std::string trace = TinyTrace();  // 94-token prompt
  auto warnings = [&](const std::string& args) {
    std::string out;
    REQUIRE(testing::RunCommand(
                Kvsim() + " run -q --trace " + trace + " " + args + " --out " + dir + "/r.json", &out) == 0);
    std::vector<std::string> w;
    std::istringstream is(out);
    for (std::string line; std::getline(is, line);)
      if (line.rfind("kvsim: warning: ", 0) == 0) w.push_back(line);
    // The same sentences are saved: result.json's `warnings`, runs.csv's `warnings` column ("; "-joined).
    RunResult saved;
    REQUIRE(google::protobuf::util::JsonStringToMessage(ReadAll(dir + "/r.json"), &saved).ok());
    REQUIRE(saved.warnings_size() == static_cast<int>(w.size()));
    std::string joined;
    for (size_t i = 0; i < w.size(); ++i) {
      CHECK(w[i] == "kvsim: warning: " + saved.warnings(static_cast<int>(i)));
      joined += (i ? "; " : "") + saved.warnings(static_cast<int>(i));
    }
    std::istringstream csv(ReadAll(dir + "/r.runs.csv"));
    std::string header, row;
    std::getline(csv, header);
    std::getline(csv, row);
    // warnings, then the dataset columns (empty for kvsim run).
    const std::string tail = ",warnings,sample_id,tags,group";
    REQUIRE(header.size() > tail.size());
    CHECK(header.substr(header.size() - tail.size()) == tail);
    REQUIRE(row.size() > 3);
    CHECK(row.substr(row.size() - 3) == ",,,");
    row.resize(row.size() - 3);
    if (joined.empty())
      CHECK(row.back() == ',');
    else if (joined.find(',') == std::string::npos)  // CSV quoting only when needed
      CHECK(row.substr(row.size() - joined.size() - 1) == "," + joined);
    else
      CHECK(row.substr(row.size() - joined.size() - 3) == ",\"" + joined + "\"");
    return w;
  };
  auto full = warnings("--policy full --budget 0.2");
  REQUIRE(full.size() == 1);
  CHECK(Has(full[0], "full ignores the budget"));
  auto below = warnings("--policy snapkv --budget 0.2");  // B = 19 <= the default window of 32
  REQUIRE(below.size() == 1);
  CHECK(Has(below[0], "budget 19 tokens is at or below snapkv's observation window of 32 tokens"));
  CHECK(Has(below[0], "--set window=N"));
  CHECK(Has(warnings("--policy madakv --budget-tokens 32")[0], "--set proxy_window=N"));
  auto over = warnings("--policy meda --set variant=OFFICIAL_CODE --budget 0.5");
  REQUIRE(over.size() == 1);
  CHECK(Has(over[0], "x the budget of 47 tokens"));
  CHECK(warnings("--policy snapkv --budget 0.5").empty());
  CHECK(warnings("--policy snapkv --budget 0.2 --set window=8").empty());
  CHECK(warnings("--policy h2o --budget 0.1").empty());

  // kvsim sweep saves each run's warnings the same way: results.json, runs.csv, a summary.md line per run.
  const std::string exp = dir + "/exp.textproto";
  std::ofstream(exp) << "traces: \"" << trace
                     << "\"\npolicies { name: \"snapkv\" }\npolicies { name: \"full\" }\nbudgets: 0.2\n"
                        "budgets: 0.5\n";
  std::string log;
  REQUIRE(testing::RunCommand(Kvsim() + " sweep -q --config " + exp + " --out " + dir + "/sw", &log) == 0);
  SweepResult sweep;
  REQUIRE(google::protobuf::util::JsonStringToMessage(ReadAll(dir + "/sw/results.json"), &sweep).ok());
  REQUIRE(sweep.runs_size() == 3);
  for (const RunResult& r : sweep.runs()) {
    INFO(r.label() << " " << r.budget_tokens());
    const std::string line = "- " + r.label() + " at " + std::to_string(r.budget_tokens()) + " tokens: ";
    if (r.policy() == "snapkv" && r.budget_tokens() == 47) {
      CHECK(r.warnings().empty());
      CHECK_FALSE(Has(ReadAll(dir + "/sw/summary.md"), line));
    } else {
      REQUIRE(r.warnings_size() == 1);
      CHECK(
          Has(r.warnings(0), r.policy() == "full" ? "full ignores the budget" : "observation window of 32"));
      CHECK(Has(ReadAll(dir + "/sw/summary.md"), line + r.warnings(0) + "\n"));
      CHECK(Has(ReadAll(dir + "/sw/runs.csv"), r.warnings(0)));
    }
  }
}

TEST_CASE("cli: the README's small trace: snapkv, pyramidkv, adakv and madakv differ at budget 0.2",
          "[cli][friction]") {
  // Runs the README's own lines (synth + the loop over the four policies), with `kvsim` = this build.
  const std::string readme = ReadAll(testing::SourceDir() + "/README.md");
  auto line_with = [&](const std::string& start) {
    const size_t at = readme.find(start);
    REQUIRE(at != std::string::npos);
    std::string line = readme.substr(at, readme.find('\n', at) - at);
    return line.substr(0, line.find("   #"));  // without the comment
  };
  const std::string synth = line_with("kvsim synth --config configs/synth/small.textproto --out small.h5");
  const std::string loop =
      line_with("for p in snapkv pyramidkv adakv madakv; do kvsim run --trace small.h5 ");
  CHECK(Has(loop, "--budget 0.2 --out $p.json; done"));
  const std::string dir = testing::ScratchDir("cli_readme_small");
  std::string log;
  const int rc = testing::RunCommand("(cd " + dir + " && ln -sfn " + testing::SourceDir() +
                                         "/configs configs && kvsim() { " + Kvsim() + " \"$@\"; } && " +
                                         synth + " && " + loop + ")",
                                     &log);
  INFO(log);
  REQUIRE(rc == 0);
  CHECK_FALSE(Has(log, "warning"));  // no run is degenerate
  std::vector<RunResult> runs;
  for (const char* p : {"snapkv", "pyramidkv", "adakv", "madakv"}) {
    RunResult r;
    REQUIRE(google::protobuf::util::JsonStringToMessage(ReadAll(dir + "/" + p + ".json"), &r).ok());
    CHECK(r.compressed_prompt_tokens() > 256);
    CHECK(r.budget_tokens() > 32);  // above every default observation window
    CHECK(r.warnings().empty());
    runs.push_back(r);
  }
  for (size_t i = 0; i < runs.size(); ++i)
    for (size_t j = i + 1; j < runs.size(); ++j) {
      INFO(runs[i].policy() << " vs " << runs[j].policy());
      CHECK(runs[i].metrics().retained_mass_mean() != runs[j].metrics().retained_mass_mean());
      CHECK(runs[i].metrics().output_rel_error_mean() != runs[j].metrics().output_rel_error_mean());
    }
}

TEST_CASE("cli: help texts show plain defaults, positional traces, merge variants, no internal options",
          "[cli][friction]") {
  std::string out;
  for (const char* cmd : {"synth", "inspect", "validate", "run", "sweep", "search", "verify hae", "gpu-plan",
                          "latency", "list-policies"}) {
    INFO(cmd);
    REQUIRE(testing::RunCommand(Kvsim() + " " + cmd + " --help", &out) == 0);
    // No binary-float noise such as "(=0.050000000000000003)".
    for (size_t i = 0; (i = out.find("(=", i)) != std::string::npos; ++i) {
      const std::string value = out.substr(i + 2, out.find(')', i) - i - 2);
      if (!value.empty() && std::isdigit(static_cast<unsigned char>(value[0]))) CHECK(value.size() < 8);
    }
    CHECK_FALSE(Has(out, "--what"));
  }
  REQUIRE(testing::RunCommand(Kvsim() + " validate --help", &out) == 0);
  CHECK(Has(out, "--tolerance X (=0.05)"));
  for (const char* cmd : {"inspect", "validate", "search"}) {
    INFO(cmd);
    REQUIRE(testing::RunCommand(Kvsim() + " " + cmd + " --help", &out) == 0);
    CHECK(Has(out, "[--trace] T.h5"));
    CHECK(Has(out, "also as the first argument"));
  }
  for (const char* cmd : {"run", "gpu-plan"}) {
    INFO(cmd);
    REQUIRE(testing::RunCommand(Kvsim() + " " + cmd + " --help", &out) == 0);
    CHECK(Has(out, "NAME+average"));
    CHECK(Has(out, "NAME+pivot"));
    CHECK(Has(out, "NAME+weighted"));
  }
}

TEST_CASE("cli: progress is plain lines without carriage returns off a terminal; --quiet silences it",
          "[cli][friction][progress]") {
  const std::string dir = testing::ScratchDir("cli_progress");
  const std::string trace = TinyTrace();
  const std::string exp = testing::SourceDir() + "/configs/experiments/demo.textproto";
  std::string out;
  // Through a pipe (not a terminal): the last progress line of each engine, and no '\r' anywhere.
  const std::vector<std::pair<std::string, std::string>> cmds = {
      {" run --trace " + trace + " --policy snapkv --budget 0.5 --out " + dir + "/r.json",
       "kvsim: run: layer 3/3, done in "},
      {" sweep --config " + exp + " --trace " + trace + " --trace " + trace + " --out " + dir + "/sw",
       "kvsim: sweep: trace 2/2, layer 3/3, done in "},
      {" search " + trace + " --policy snapkv --at-least 0.8 --out " + dir + "/s.json",
       "kvsim: search: pass "},
      {" verify hae --trace " + trace + " --rc-size 4 --out " + dir + "/v.json",
       "kvsim: verify hae: layer 3/3, done"},
      {" gpu-plan --trace " + trace + " --config " + exp + " --out-dir " + dir + "/plans",
       "kvsim: gpu-plan: plan 33/33, layer 3/3, done in "}};
  for (const auto& [cmd, line] : cmds) {
    INFO(cmd);
    REQUIRE(testing::RunCommand("env -u KVSIM_PROGRESS KVSIM_PROGRESS_INTERVAL=0 " + Kvsim() + cmd, &out) ==
            0);
    CHECK(Has(out, line));
    CHECK(out.find('\r') == std::string::npos);
    REQUIRE(testing::RunCommand("KVSIM_PROGRESS_INTERVAL=0 " + Kvsim() + cmd + " --quiet", &out) == 0);
    CHECK_FALSE(Has(out, line));
    REQUIRE(testing::RunCommand("KVSIM_PROGRESS=off KVSIM_PROGRESS_INTERVAL=0 " + Kvsim() + cmd, &out) == 0);
    CHECK_FALSE(Has(out, line));
    // The default interval (10 s): a run this short prints no progress at all.
    REQUIRE(testing::RunCommand("env -u KVSIM_PROGRESS -u KVSIM_PROGRESS_INTERVAL " + Kvsim() + cmd, &out) ==
            0);
    CHECK_FALSE(Has(out, line));
  }
  // Streaming runs use the same reporter.
  const std::string stream = dir + "/stream.h5";
  REQUIRE(testing::RunCommand(Kvsim() + " synth --config " + testing::SourceDir() +
                                  "/configs/synth/streaming_tiny.textproto --out " + stream,
                              &out) == 0);
  REQUIRE(testing::RunCommand("env -u KVSIM_PROGRESS KVSIM_PROGRESS_INTERVAL=0 " + Kvsim() + " run --trace " +
                                  stream + " --policy rekv --out " + dir + "/sr.json",
                              &out) == 0);
  CHECK(Has(out, "kvsim: streaming run: layer 4/4, done in "));
  CHECK(out.find('\r') == std::string::npos);
  CHECK(testing::RunCommand("KVSIM_PROGRESS=maybe " + Kvsim() + cmds[0].first, &out) == 1);
  CHECK(Has(out, "KVSIM_PROGRESS='maybe'"));
  CHECK(testing::RunCommand("KVSIM_PROGRESS_INTERVAL=soon " + Kvsim() + cmds[0].first, &out) == 1);
  CHECK(Has(out, "KVSIM_PROGRESS_INTERVAL='soon'"));
  for (const char* name : {"KVSIM_MERGE_SCREEN", "KVSIM_MERGE_MEMO", "KVSIM_MERGE_INT8"}) {
    CHECK(testing::RunCommand(std::string(name) + "=yes " + Kvsim() + cmds[0].first, &out) == 1);
    CHECK(Has(out, std::string("kvsim: error: environment variable ") + name +
                       "='yes': expected 0 (off) or 1 (on)"));
    CHECK(std::count(out.begin(), out.end(), '\n') == 1);
    CHECK(testing::RunCommand("KVSIM_PROGRESS=off " + std::string(name) + "=0 " + Kvsim() + cmds[0].first,
                              &out) == 0);
  }
  // The screen's switch also names a screen (the same results with either; policies/merge_screen.h).
  for (const char* screen : {"bf16", "int16"})
    CHECK(testing::RunCommand(
              std::string("KVSIM_PROGRESS=off KVSIM_MERGE_SCREEN=") + screen + " " + Kvsim() + cmds[0].first,
              &out) == 0);
  CHECK(testing::RunCommand("KVSIM_MERGE_MEMO=int16 " + Kvsim() + cmds[0].first, &out) == 1);
  CHECK(Has(out, "KVSIM_MERGE_MEMO='int16': expected 0 (off) or 1 (on)\n"));
  // A failing command prints its error alone: no "done" line before it.
  CHECK(testing::RunCommand("KVSIM_PROGRESS_INTERVAL=0 " + Kvsim() + " sweep --config " + exp + " --trace " +
                                trace + " --out " + dir + "/into_a_file/x --trace " + dir + "/missing.h5",
                            &out) == 1);
  CHECK(std::count(out.begin(), out.end(), '\n') == 1);
}

}  // namespace kvsim
