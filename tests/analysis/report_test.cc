#include "analysis/report.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "analysis/sweep.h"
#include "tests/test_util.h"

namespace kvsim {

namespace {

int CsvLines(const std::string& csv) {
  std::istringstream in(csv);
  std::string line;
  int rows = 0;
  while (std::getline(in, line)) ++rows;
  return rows;
}

// Every row has as many fields as the header.
void CheckRectangular(const std::string& csv) {
  const auto commas = [](const std::string& s) {
    int n = 0;
    bool quoted = false;
    for (char c : s) {
      if (c == '"') quoted = !quoted;
      if (c == ',' && !quoted) ++n;
    }
    return n;
  };
  std::istringstream in(csv);
  std::string header, line;
  std::getline(in, header);
  while (std::getline(in, line)) CHECK(commas(line) == commas(header));
}

}  // namespace

TEST_CASE("report: SplitJson prints a repeated field's elements apart, the same bytes as ToJson",
          "[report]") {
  // Elements with nested messages, repeated fields and strings that JSON escapes (a newline, quotes,
  // braces); the field between others (SweepResult: experiment before, aggregates after) and last
  // (SweepUnit); no element and one element.
  SweepResult result;
  result.set_experiment("description: \"a\\nb\" {x: [1]}\n");
  for (int r = 0; r < 4; ++r) {
    RunResult* run = result.add_runs();
    run->set_policy(r % 2 ? "snapkv" : "full");
    run->set_label("line one\n  \"two\" ],\n{");
    run->set_budget_tokens(10 * r);
    run->mutable_metrics()->set_retained_mass_mean(0.1 * r + 1e-17);
    for (int l = 0; l < r; ++l) {
      LayerResult* lr = run->add_layers();
      lr->set_layer(l);
      lr->add_kv_head_budgets(l);
      lr->add_kv_head_budgets(l + 1);
    }
    run->add_warnings(r % 2 ? "w\tx" : "");
  }
  result.add_aggregates()->set_policy("full");
  SweepUnit unit;
  unit.set_sample_id("s0");
  for (const RunResult& r : result.runs()) *unit.add_runs() = r;
  SweepResult none;
  none.set_experiment("e");
  SweepUnit one;
  *one.add_runs() = result.runs(3);
  for (int threads : {1, 2, 3}) {
    INFO("threads " << threads);
    CHECK(ToJsonSplit(result, "runs", threads) == ToJson(result));
    CHECK(ToJsonSplit(unit, "runs", threads) == ToJson(unit));
    CHECK(ToJsonSplit(none, "runs", threads) == ToJson(none));
    CHECK(ToJsonSplit(one, "runs", threads) == ToJson(one));
    CHECK(ToJsonSplit(result, "aggregates", threads) == ToJson(result));
  }
  // Printed in any order before the join.
  SplitJson json(result, "runs");
  REQUIRE(json.parts() == 5);
  for (int i = json.parts() - 1; i >= 0; --i) json.Print(i);
  CHECK(json.Join() == ToJson(result));
}

TEST_CASE("report: runs.csv has one row per run, layers.csv one per (run, layer), quoting fields",
          "[report]") {
  RunResult r;
  r.set_policy("snapkv");
  r.set_label("snapkv window=8, \"x\"");
  r.set_trace_path("t.h5");
  r.set_trace_hash("abc");
  r.set_time_unit("token_steps");
  r.set_kvsim_version("1.2.3");
  r.set_git_commit("deadbeef");
  r.set_budget_tokens(10);
  r.mutable_metrics()->set_retained_mass_mean(0.5);
  for (int l = 0; l < 3; ++l) {
    LayerResult* lr = r.add_layers();
    lr->set_layer(l);
    lr->add_kv_head_budgets(9 + l);
    lr->add_kv_head_budgets(11);
  }
  RunResult r2 = r;
  r2.set_label("h2o");
  const std::string runs = RunsCsv({r, r2}), layers = LayersCsv({r, r2});
  CHECK(CsvLines(runs) == 1 + 2);
  CHECK(CsvLines(layers) == 1 + 2 * 3);
  CHECK(runs.find("\"snapkv window=8, \"\"x\"\"\"") != std::string::npos);
  CHECK(runs.rfind("run,trace_hash,policy,label,budget_fraction,budget_tokens,", 0) == 0);
  CHECK(layers.rfind("run,trace_hash,policy,label,budget_fraction,budget_tokens,layer,", 0) == 0);
  for (const char* col : {",time_unit,", ",kvsim_version,", ",git_commit,"})
    CHECK(runs.find(col) != std::string::npos);
  CHECK(runs.find(",token_steps,1.2.3,deadbeef,") != std::string::npos);
  CHECK(runs.find(",latency_device,") != std::string::npos);
  // Integer layers (no "all" rows), the run index as the key, the head budget range.
  CHECK(layers.find(",all,") == std::string::npos);
  CHECK(layers.find("\n1,abc,snapkv,h2o,0,10,2,0,11,11,") != std::string::npos);
  CHECK(layers.find("\n0,abc,snapkv,") != std::string::npos);
  CheckRectangular(runs);
  CheckRectangular(layers);
}

TEST_CASE("report: a run's warnings are a runs.csv column (before the dataset columns) and a summary line",
          "[report]") {
  RunResult quiet;
  quiet.set_policy("snapkv");
  quiet.set_label("snapkv");
  quiet.set_trace_path("t.h5");
  quiet.set_budget_tokens(40);
  RunResult warned = quiet;
  warned.set_label("snapkv, small");
  warned.set_budget_tokens(19);
  warned.add_warnings("budget 19 tokens is at or below the window, raise it");
  warned.add_warnings("second \"one\"");
  const std::string runs = RunsCsv({quiet, warned});
  std::istringstream in(runs);
  std::string header, row0, row1;
  std::getline(in, header);
  std::getline(in, row0);
  std::getline(in, row1);
  const std::string tail = ",warnings,sample_id,tags,group";
  CHECK(header.substr(header.size() - tail.size()) == tail);
  CHECK(row0.substr(row0.size() - 4) == ",,,,");  // no warnings, no sample: empty fields
  // Joined with "; ", quoted as a CSV field; then the (empty) sample_id, tags and group.
  const std::string field = "\"budget 19 tokens is at or below the window, raise it; second \"\"one\"\"\"";
  CHECK(row1.substr(row1.size() - field.size() - 4) == "," + field + ",,,");
  CheckRectangular(runs);
  const std::string md = SummaryMarkdown({quiet, warned}, "title");
  CHECK(md.find("**Warnings**") != std::string::npos);
  CHECK(md.find("- snapkv, small at 19 tokens: budget 19 tokens is at or below the window, raise it; second "
                "\"one\"\n") != std::string::npos);
  CHECK(md.find("- snapkv at 40 tokens") == std::string::npos);  // one line per run that has any
  CHECK(SummaryMarkdown({quiet}, "title").find("Warnings") == std::string::npos);
}

TEST_CASE("report: CSV numbers read back exactly, in their shortest form", "[report]") {
  CHECK(CsvNumber(0.1) == "0.1");
  CHECK(CsvNumber(8.5) == "8.5");
  CHECK(CsvNumber(3) == "3");
  CHECK(CsvNumber(1234567890123.0) == "1234567890123");
  CHECK(std::stod(CsvNumber(1.0 / 3)) == 1.0 / 3);
  CHECK(CsvNumber(std::nan("")) == "nan");
}

TEST_CASE("report: runs.csv's allocated layer budget is the allocated mean", "[report]") {
  RunResult r;
  r.set_policy("meda");
  r.set_label("meda");
  r.set_budget_tokens(10);
  r.set_allocated_budget_tokens_mean(8.5);
  const std::string csv = RunsCsv({r});
  CHECK(csv.find(",allocated_budget_tokens_mean,") != std::string::npos);
  CHECK(csv.find(",8.5,") != std::string::npos);
}

TEST_CASE("report: summary lists every run and the best causal policy per budget", "[report]") {
  std::vector<RunResult> runs(3);
  const char* names[] = {"oracle", "snapkv", "h2o"};
  const double err[] = {0.01, 0.3, 0.2};
  for (int i = 0; i < 3; ++i) {
    runs[i].set_policy(names[i]);
    runs[i].set_label(names[i]);
    runs[i].set_trace_path("t.h5");
    runs[i].set_budget_tokens(10);
    runs[i].set_budget_fraction(0.1);
    runs[i].mutable_metrics()->set_output_rel_error_mean(err[i]);
  }
  runs[2].mutable_metrics()->set_prompt_kept_over_budget(2.5);
  runs[2].mutable_metrics()->set_merged_tokens_mean(42);
  runs[2].mutable_metrics()->set_retained_mass_mean(0.25);
  runs[2].mutable_metrics()->set_merged_anchor_mass_mean(0.125);
  runs[2].mutable_metrics()->set_covered_mass_mean(0.5);
  const std::string md = SummaryMarkdown(runs, "title");
  CHECK(md.find("# title") == 0);
  CHECK(md.find("| snapkv | 10% (10)") != std::string::npos);
  CHECK(md.find("| prompt kept / budget |") != std::string::npos);
  CHECK(md.find("| h2o | 10% (10) | 2.50 |") != std::string::npos);  // the overshoot is visible
  CHECK(md.find("| 42.0 |") != std::string::npos);                   // merged tokens per head
  // Retained mass (plain slots), merged anchors' mass and covered mass side by side.
  CHECK(md.find("| retained mass | merged anchors | covered |") != std::string::npos);
  CHECK(md.find("| 0.250 | 0.125 | 0.500 |") != std::string::npos);
  // The oracle's cache size is stated next to the prefill-compressing policies'.
  CHECK(md.find("B + (n − ce) + t + 1") != std::string::npos);
  // h2o has the lowest error but kept 2.5x its budget: snapkv is the best within budget.
  CHECK(md.find("**snapkv**") != std::string::npos);
  CHECK(md.find("**h2o**") == std::string::npos);
  CHECK(md.find("not ranked") != std::string::npos);
}

TEST_CASE("report: the modelled latency table says where a decode-step-0 compression's work is", "[report]") {
  std::vector<RunResult> runs(3);
  const char* labels[] = {"snapkv", "meda (official code)", "meda (official code)"};
  for (int i = 0; i < 3; ++i) {
    runs[i].set_policy(i == 0 ? "snapkv" : "meda");
    runs[i].set_label(labels[i]);
    runs[i].set_trace_path("t.h5");
    runs[i].set_budget_tokens(10 * (i + 1));
    runs[i].set_compression_step(i == 0 ? -1 : 0);
    runs[i].mutable_latency()->set_source("modelled: test");
    runs[i].mutable_latency()->set_policy_work_ms(1.5);
  }
  std::string md = SummaryMarkdown(runs, "title");
  CHECK(md.find("**Decode latency — MODELLED, not measured**: modelled: test. Time to first token includes "
                "the policy's compression work at prefill; meda (official code) compresses at decode step 0 "
                "instead: that work is in the step, so in ms/token") != std::string::npos);
  // A policy compressing at a later step: that step is named; two different steps: neither.
  runs[2].set_label("later");
  runs[1].set_compression_step(3);
  runs[2].set_compression_step(3);
  md = SummaryMarkdown(runs, "title");
  CHECK(md.find("meda (official code) and later compress at decode step 3 instead") != std::string::npos);
  runs[2].set_compression_step(0);
  md = SummaryMarkdown(runs, "title");
  CHECK(md.find("meda (official code) and later compress at a decode step instead") != std::string::npos);
  // Only prefill compressions: the plain sentence.
  runs.resize(1);
  md = SummaryMarkdown(runs, "title");
  CHECK(md.find("compression work at prefill.\n") != std::string::npos);
  CHECK(md.find("decode step 0") == std::string::npos);
}

TEST_CASE("report: the summary says whether a trace is a real model run or synthetic", "[report]") {
  std::vector<RunResult> runs(2);
  for (int i = 0; i < 2; ++i) {
    runs[i].set_policy("snapkv");
    runs[i].set_label("snapkv");
    runs[i].set_budget_tokens(10);
    runs[i].set_budget_fraction(0.1);
  }
  runs[0].set_trace_path("real.h5");
  runs[0].set_trace_source("captured");
  runs[1].set_trace_path("synth.h5");
  runs[1].set_trace_source("synthetic");
  const std::string md = SummaryMarkdown(runs, "title");
  const size_t real = md.find("## Trace `real.h5`"), synth = md.find("## Trace `synth.h5`");
  REQUIRE(real != std::string::npos);
  REQUIRE(synth != std::string::npos);
  CHECK(md.find("**Real model run**", real) < synth);
  CHECK(md.find("**Synthetic trace**", synth) != std::string::npos);
  CHECK(md.find("**Synthetic trace**") > synth);  // not in the real trace's section
}

TEST_CASE("report: WriteFileAtomic writes whole files and fails cleanly", "[report]") {
  const std::string dir = testing::ScratchDir("report_atomic");
  REQUIRE(WriteFileAtomic(dir + "/a.txt", "hello").ok());
  std::ifstream in(dir + "/a.txt");
  std::string s;
  std::getline(in, s);
  CHECK(s == "hello");
  Status st = WriteFileAtomic(dir + "/no/such/dir/a.txt", "x");
  CHECK_FALSE(st.ok());
  CHECK(st.message().find("no/such/dir/a.txt") != std::string::npos);
  for (const auto& e : std::filesystem::directory_iterator(dir)) CHECK(e.path().filename() == "a.txt");
}

TEST_CASE("sweep: experiment errors name the field", "[report]") {
  const std::string dir = testing::ScratchDir("sweep_exp");
  auto write = [&](const std::string& text) {
    std::ofstream(dir + "/e.textproto") << text;
    return LoadExperiment(dir + "/e.textproto");
  };
  auto e = write("policies { name: \"snapkv\" } budgets: 0.1");
  REQUIRE_FALSE(e.ok());
  CHECK(e.status().message().find("traces") != std::string::npos);
  e = write("traces: \"t.h5\" budgets: 0.1");
  REQUIRE_FALSE(e.ok());
  CHECK(e.status().message().find("policies") != std::string::npos);
  // No budgets: loads (a streaming experiment may run every policy at its default), but a plain sweep
  // refuses it before opening any trace.
  e = write("traces: \"t.h5\" policies { name: \"snapkv\" }");
  REQUIRE(e.ok());
  auto swept = RunSweep(*e, dir, RunOptions{});
  REQUIRE_FALSE(swept.ok());
  CHECK(swept.status().message().find("budget") != std::string::npos);
  e = write("traces: \"t.h5\" policies { name: \"snapkv\" } budgets: 1.5");
  REQUIRE_FALSE(e.ok());
  e = write("traces: \"t.h5\" polices { name: \"snapkv\" }");
  REQUIRE_FALSE(e.ok());
  CHECK(e.status().message().find("line 1") != std::string::npos);
  e = write("traces: \"t.h5\" policies { name: \"snapkv\" } budgets: 0.1 budget_tokens: 64");
  CHECK(e.ok());
}

}  // namespace kvsim
