// `kvsim latency` (analysis/latency_report.cc) and `--device` on run/sweep, end to end through the binary.

#include "analysis/latency_report.h"

#include <google/protobuf/util/json_util.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <string>

#include "sim/perf_model.h"
#include "sim/results.pb.h"
#include "tests/test_util.h"

namespace kvsim {
namespace {

std::string Kvsim() { return testing::KvsimBinary(); }

TEST_CASE("latency report: the documented JSON fields, by hand", "[latency]") {
  LatencyQuery q;
  q.device = "h100-sxm";
  q.heads = 32;
  q.kv_heads = 8;
  q.head_dim = 128;
  q.kv_length = 4096;
  auto r = ComputeLatencyReport(q);
  REQUIRE(r.ok());
  // attention_us = the device's decode kernel for batch 1, 8 KV heads at 4096 tokens.
  const PerfModel perf(*FindDevice("h100-sxm"));
  const std::vector<int> heads(8, 4096);
  CHECK(r->attention_us() ==
        Approx(perf.DecodeAttention(heads, 4, 128, 2, perf.AttentionKernel(), false).us));
  CHECK(r->kv_bytes_per_layer() == 8.0 * 4096 * 2 * 128 * 2);
  CHECK_FALSE(r->has_decode_step_ms());
  CHECK(r->source().find("modelled") == 0);
  // With a model: the whole step and the prefill.
  LatencyQuery m = q;
  m.heads = m.kv_heads = m.head_dim = 0;
  m.model = "llava-1.5-7b";
  m.prompt_tokens = 2048;
  m.batch = 4;
  auto rm = ComputeLatencyReport(m);
  REQUIRE(rm.ok());
  CHECK(rm->decode_step_ms() > rm->decode_floor_ms());
  CHECK(rm->prefill_ms() > 0);
  CHECK(rm->batch() == 4);
}

TEST_CASE("latency report: bad input is one line naming the problem", "[latency]") {
  LatencyQuery base;
  base.device = "a100-sxm";
  base.model = "llama-2-7b";
  base.kv_length = 1024;
  REQUIRE(ComputeLatencyReport(base).ok());
  auto message = [](LatencyQuery q) {
    auto r = ComputeLatencyReport(q);
    REQUIRE_FALSE(r.ok());
    const std::string msg = r.status().message();
    CHECK(msg.find('\n') == std::string::npos);
    return msg;
  };
  LatencyQuery q = base;
  q.device = "tpu-v5";
  CHECK(message(q).find("unknown device 'tpu-v5'") == 0);
  q = base;
  q.kv_length = 0;
  CHECK(message(q).find("--kv-length") == 0);
  q = base;
  q.kv_length = -5;
  CHECK(message(q).find("--kv-length") == 0);
  q = base;
  q.batch = 0;
  CHECK(message(q).find("--batch") == 0);
  q = base;
  q.model = "";
  q.heads = 32;
  q.kv_heads = 5;
  q.head_dim = 128;
  CHECK(message(q).find("--kv-heads 5 must divide --heads 32") == 0);
  q = base;
  q.heads = 32;  // both a model and dimensions
  CHECK(message(q).find("give either --model") == 0);
  q = base;
  q.model = "gpt-5";
  CHECK(message(q).find("unknown model preset 'gpt-5'") == 0);
  // Does not fit: says so with the sizes.
  q = base;
  q.kv_length = 1000000;
  q.batch = 8;
  const std::string big = message(q);
  CHECK(big.find("the shape does not fit in A100-SXM4-80GB's 80.00 GiB") == 0);
  CHECK(big.find("weights 12.55 GiB + KV cache") != std::string::npos);
  q = base;
  q.model = "";
  q.heads = q.kv_heads = q.head_dim = 64;
  q.prompt_tokens = 100;
  CHECK(message(q).find("--prompt-tokens needs --model") == 0);
}

TEST_CASE("kvsim latency: CLI text, JSON, list, exit codes", "[latency][cli]") {
  std::string out;
  REQUIRE(testing::RunCommand(Kvsim() + " latency --device a100-sxm --model llama-2-7b --kv-length 2048 "
                                        "--prompt-tokens 512 --json",
                              &out) == 0);
  for (const char* key :
       {"\"attention_us\"", "\"decode_step_ms\"", "\"prefill_ms\"", "\"source\": \"modelled"})
    CHECK(out.find(key) != std::string::npos);
  LatencyReport parsed;
  REQUIRE(google::protobuf::util::JsonStringToMessage(out, &parsed).ok());
  CHECK(parsed.kv_length() == 2048);
  REQUIRE(testing::RunCommand(Kvsim() + " latency --device h200 --heads 28 --kv-heads 4 --head-dim 128 "
                                        "--kv-length 8192 --batch 2",
                              &out) == 0);
  CHECK(out.find("MODELLED") == 0);
  CHECK(out.find("H200-SXM-141GB") != std::string::npos);
  REQUIRE(testing::RunCommand(Kvsim() + " latency --list", &out) == 0);
  CHECK(out.find("a100-pcie") != std::string::npos);
  CHECK(out.find("qwen2-7b") != std::string::npos);
  // Bad values: exit 1, one line on stderr, nothing on stdout.
  CHECK(testing::RunCommand(Kvsim() + " latency --device nope --model llama-2-7b --kv-length 10 2>&1",
                            &out) == 1);
  CHECK(out.find("kvsim: error: unknown device 'nope'") == 0);
  CHECK(std::count(out.begin(), out.end(), '\n') == 1);
  CHECK(testing::RunCommand(Kvsim() + " latency --device a100-sxm --model llama-2-7b --kv-length -3 2>&1",
                            &out) == 1);
  // Missing required options: usage error (2).
  CHECK(testing::RunCommand(Kvsim() + " latency --model llama-2-7b --kv-length 10 2>/dev/null") == 2);
}

TEST_CASE("kvsim run/sweep --device: modelled latency in results and summary", "[latency][cli]") {
  const std::string dir = testing::ScratchDir("latency_cli");
  const std::string trace = dir + "/tiny.h5";
  std::string log;
  REQUIRE(testing::RunCommand(Kvsim() + " synth --config " + testing::SourceDir() +
                                  "/configs/synth/tiny.textproto --out " + trace + " --threads 1",
                              &log) == 0);
  // tiny-mha has no preset: the error names --model.
  CHECK(testing::RunCommand(Kvsim() + " run --trace " + trace +
                                " --policy snapkv --budget 0.2 --device a100-sxm "
                                "--out " +
                                dir + "/r.json 2>&1",
                            &log) == 1);
  CHECK(log.find("has no latency-model preset; pass --model") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(dir + "/r.json"));
  // A shape file of the same shape.
  const std::string shape = dir + "/tiny_shape.textproto";
  testing::WriteFile(
      shape,
      "name: \"tiny-mha\" num_layers: 3 num_heads: 4 num_kv_heads: 4 head_dim: 32 hidden_size: 128 "
      "intermediate_size: 256 vocab_size: 1000\n");
  REQUIRE(testing::RunCommand(Kvsim() + " run --trace " + trace +
                                  " --policy snapkv --budget 0.2 --device a100-sxm "
                                  "--model " +
                                  shape + " --out " + dir + "/r.json 2>&1",
                              &log) == 0);
  CHECK(log.find("MODELLED on A100-SXM4-80GB") != std::string::npos);
  RunResult r;
  REQUIRE(google::protobuf::util::JsonStringToMessage(testing::ReadFile(dir + "/r.json"), &r).ok());
  CHECK(r.time_unit() == "us");
  CHECK(r.latency().ms_per_output_token() > 0);
  CHECK(r.latency().speedup_vs_full() >= 1);
  // --device and --latency-model together, --model without --device: refused.
  CHECK(testing::RunCommand(Kvsim() + " run --trace " + trace +
                                " --policy snapkv --budget 0.2 --device a100-sxm "
                                "--latency-model x.textproto --out " +
                                dir + "/r2.json 2>&1",
                            &log) == 1);
  CHECK(log.find("--device and --latency-model") != std::string::npos);
  CHECK(testing::RunCommand(Kvsim() + " run --trace " + trace + " --policy snapkv --budget 0.2 --model " +
                                shape + " --out " + dir + "/r2.json 2>&1",
                            &log) == 1);
  CHECK(log.find("add --device") != std::string::npos);
  // A sweep: summary columns labelled as modelled.
  const std::string exp = dir + "/exp.textproto";
  testing::WriteFile(exp, "traces: \"" + trace +
                              "\"\npolicies { name: \"full\" }\npolicies { name: \"snapkv\" }\nbudgets: 0.2\n"
                              "device: \"h100-sxm\"\nmodel_shape: \"" +
                              shape + "\"\n");
  REQUIRE(testing::RunCommand(Kvsim() + " sweep --config " + exp + " --out " + dir + "/sweep 2>&1", &log) ==
          0);
  const std::string summary = testing::ReadFile(dir + "/sweep/summary.md");
  CHECK(summary.find("MODELLED") != std::string::npos);
  CHECK(summary.find("ms/token") != std::string::npos);
  const std::string csv = testing::ReadFile(dir + "/sweep/runs.csv");
  CHECK(csv.find("ms_per_output_token") != std::string::npos);
}

TEST_CASE("kvsim run --device on a streaming trace: encode jobs and answers on the modelled clock",
          "[latency][cli]") {
  const std::string dir = testing::ScratchDir("latency_stream");
  const std::string trace = dir + "/st.h5";
  std::string log;
  REQUIRE(testing::RunCommand(Kvsim() + " synth --config " + testing::SourceDir() +
                                  "/configs/synth/streaming_tiny.textproto --out " + trace,
                              &log) == 0);
  const std::string shape = dir + "/shape.textproto";
  testing::WriteFile(
      shape,
      "name: \"tiny-stream\" num_layers: 4 num_heads: 4 num_kv_heads: 2 head_dim: 16 hidden_size: 64 "
      "intermediate_size: 128 vocab_size: 1000\n");
  REQUIRE(testing::RunCommand(Kvsim() + " run --trace " + trace +
                                  " --policy rekv --device h100-sxm --model " + shape + " --out " + dir +
                                  "/r.json 2>&1",
                              &log) == 0);
  const std::string json = testing::ReadFile(dir + "/r.json");
  CHECK(json.find("\"time_unit\": \"us\"") != std::string::npos);
  CHECK(json.find("\"encode_busy_s\": 0,") == std::string::npos);  // encoding takes modelled time
  // Without a preset for 'tiny-stream' and without --model: one line naming --model, no output.
  CHECK(testing::RunCommand(Kvsim() + " run --trace " + trace + " --policy rekv --device h100-sxm --out " +
                                dir + "/r2.json 2>&1",
                            &log) == 1);
  CHECK(log.find("pass --model") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(dir + "/r2.json"));
}

}  // namespace
}  // namespace kvsim
