#include "sim/latency_model.h"

#include <catch2/catch.hpp>
#include <fstream>
#include <string>

#include "tests/test_util.h"

namespace kvsim {
namespace {

bool Contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string WriteFile(const std::string& dir, const std::string& name, const std::string& text) {
  return testing::WriteFile(dir + "/" + name, text);
}

}  // namespace

TEST_CASE("Token-step latency model: every event lasts 1", "[latency_model]") {
  auto m = MakeTokenStepLatencyModel();
  CHECK(m->PrefillDuration(1, 0) == 1);
  CHECK(m->PrefillDuration(4096, 0) == 1);
  CHECK(m->UniformDecodeStepDuration(0, 1, 1) == 1);
  CHECK(m->UniformDecodeStepDuration(37.5, 1, 1) == 1);
  CHECK(m->unit() == "token_steps");
}

TEST_CASE("Linear latency model: base + slope", "[latency_model]") {
  LatencyModelProto p;
  p.set_prefill_base_us(10);
  p.set_prefill_us_per_token(0.5);
  p.set_decode_base_us(20);
  p.set_decode_us_per_kv_token(0.1);
  p.set_fitted_on("h100, tiny");
  auto m = MakeLinearLatencyModel(p);
  CHECK(m->PrefillDuration(100, 0) == Approx(10 + 0.5 * 100));             // 60
  CHECK(m->UniformDecodeStepDuration(50, 1, 1) == Approx(20 + 0.1 * 50));  // 25
  CHECK(m->UniformDecodeStepDuration(37.5, 1, 1) == Approx(23.75));        // fractional mean cache length
  CHECK(m->unit() == "us");
  CHECK(Contains(m->Describe(), "fitted on h100, tiny"));
}

TEST_CASE("LoadLatencyModel reads a text file", "[latency_model]") {
  const std::string dir = testing::ScratchDir("latency_model_ok");
  const std::string path = WriteFile(dir, "lat.txtpb",
                                     "description: \"test\"\n"
                                     "prefill_base_us: 100\nprefill_us_per_token: 2\n"
                                     "decode_base_us: 5\ndecode_us_per_kv_token: 0.25\n");
  auto m = LoadLatencyModel(path);
  REQUIRE(m.ok());
  CHECK((*m)->PrefillDuration(10, 0) == Approx(120));            // 100 + 2 * 10
  CHECK((*m)->UniformDecodeStepDuration(8, 1, 1) == Approx(7));  // 5 + 0.25 * 8
  CHECK((*m)->unit() == "us");
  // Only a per-token slope is fine too.
  m = LoadLatencyModel(WriteFile(dir, "slope.txtpb", "decode_us_per_kv_token: 1\n"));
  REQUIRE(m.ok());
  CHECK((*m)->UniformDecodeStepDuration(3, 1, 1) == Approx(3));
  CHECK((*m)->PrefillDuration(3, 0) == 0);
}

TEST_CASE("LoadLatencyModel rejects bad files, naming the file", "[latency_model]") {
  const std::string dir = testing::ScratchDir("latency_model_bad");
  struct Case {
    const char* name;
    const char* text;
    const char* expect;
  };
  const Case cases[] = {
      {"negative.txtpb", "decode_base_us: -1\ndecode_us_per_kv_token: 1\n", "must be finite and >= 0"},
      {"neg_prefill.txtpb", "decode_base_us: 1\nprefill_us_per_token: -0.5\n", "must be finite and >= 0"},
      {"inf.txtpb", "decode_base_us: 1\nprefill_base_us: inf\n", "must be finite and >= 0"},
      {"nan.txtpb", "decode_base_us: nan\n", "must be finite and >= 0"},
      {"zero.txtpb", "prefill_base_us: 3\n", "decode_base_us and decode_us_per_kv_token are both 0"},
      {"syntax.txtpb", "decode_base_us: 1\ndecode_slope: 2\n", "line 2"},
  };
  for (const Case& c : cases) {
    const std::string path = WriteFile(dir, c.name, c.text);
    auto m = LoadLatencyModel(path);
    INFO(c.name << ": " << m.status().message());
    REQUIRE_FALSE(m.ok());
    CHECK(m.status().code() == StatusCode::kInvalidArgument);
    CHECK(Contains(m.status().message(), path + ": "));
    CHECK(Contains(m.status().message(), c.expect));
  }
  auto missing = LoadLatencyModel(dir + "/missing.txtpb");
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().code() == StatusCode::kNotFound);
  CHECK(Contains(missing.status().message(), dir + "/missing.txtpb"));
}

}  // namespace kvsim
