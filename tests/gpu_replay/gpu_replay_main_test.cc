// kvsim_replay_gpu (gpu_replay/gpu_replay_main.cc): exit codes, the one-line no-device message, the CPU
// reference mode, bad input.

#include <google/protobuf/util/json_util.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "gpu_replay/bench_report.pb.h"
#include "gpu_replay/gpu_api.h"
#include "tests/test_util.h"

namespace kvsim::gpu_replay {
namespace {
std::string Bin() { return KVSIM_REPLAY_GPU_BINARY; }
}  // namespace

TEST_CASE("kvsim_replay_gpu: usage, bad input, no device", "[gpu_replay][harness]") {
  std::string out;
  CHECK(testing::RunCommand(Bin() + " --help", &out) == 0);
  CHECK(out.find("4 no CUDA device") != std::string::npos);
  CHECK(testing::RunCommand(Bin() + " --frobnicate", &out) == 2);
  CHECK(testing::RunCommand(Bin() + " --preset gpt-5", &out) == 1);
  CHECK(out.find("unknown model preset") != std::string::npos);
  CHECK(testing::RunCommand(Bin() + " --budgets 0,2", &out) == 1);
  CHECK(testing::RunCommand(Bin() + " --plan /nonexistent/plan.pb", &out) == 1);
  CHECK(out.find("/nonexistent/plan.pb") != std::string::npos);
  if (!QueryDevice(0).available) {
    CHECK(testing::RunCommand(Bin() + " --preset tiny", &out) == 4);
    CHECK(out.rfind("kvsim_replay_gpu: no CUDA device", 0) == 0);
    CHECK(std::count(out.begin(), out.end(), '\n') == 1);
  }
}

TEST_CASE("kvsim_replay_gpu: --cpu-reference times the reference path", "[gpu_replay][harness]") {
  const std::string dir = testing::ScratchDir("replay_gpu_cpu");
  std::string out;
  REQUIRE(testing::RunCommand(Bin() +
                                  " --cpu-reference --preset tiny --context 256 --attention-lengths 64,128 "
                                  "--repeats 2 --out " +
                                  dir + "/cpu.json",
                              &out) == 0);
  std::ifstream in(dir + "/cpu.json");
  std::stringstream ss;
  ss << in.rdbuf();
  // Through kvsim's one JSON writer: parses back into the report message.
  BenchReport report;
  REQUIRE(google::protobuf::util::JsonStringToMessage(ss.str(), &report).ok());
  CHECK(report.mode().rfind("cpu-reference", 0) == 0);
  CHECK(report.preset() == "tiny");
  CHECK(report.attention_size() == 2);
  CHECK(report.attention(1).tokens_per_head() == 128);
  CHECK(report.attention(0).layer_attention().samples() == 2);
  REQUIRE(report.decoder_step_size() == 1);
  CHECK(report.decoder_step(0).step().median_us() > 0);
}

}  // namespace kvsim::gpu_replay
