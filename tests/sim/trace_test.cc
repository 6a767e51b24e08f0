#include "sim/trace.h"

#include <catch2/catch.hpp>

#include "tests/test_util.h"

namespace kvsim {

TEST_CASE("TraceMeta::Validate accepts a tiny trace and names bad fields", "[trace]") {
  MemoryTrace tr = testing::MakeTinyTrace();
  REQUIRE(tr.meta().Validate().ok());
  TraceMeta m = tr.meta();
  m.model.num_kv_heads = 3;
  Status st = m.Validate();
  REQUIRE_FALSE(st.ok());
  CHECK(st.message().find("num_kv_heads") != std::string::npos);
  m = tr.meta();
  m.query_positions.pop_back();
  st = m.Validate();
  REQUIRE_FALSE(st.ok());
  CHECK(st.message().find("query_positions") != std::string::npos);
}

TEST_CASE("ValidateLayer rejects NaN and wrong shapes", "[trace]") {
  MemoryTrace tr = testing::MakeTinyTrace();
  LayerData ld;
  REQUIRE(tr.ReadLayer(0, &ld).ok());
  REQUIRE(ValidateLayer(tr.meta(), ld, "x").ok());
  LayerData bad = ld;
  bad.values[3] = std::nanf("");
  Status st = ValidateLayer(tr.meta(), bad, "x");
  REQUIRE_FALSE(st.ok());
  CHECK(st.message().find("values") != std::string::npos);
  bad = ld;
  bad.keys.pop_back();
  CHECK_FALSE(ValidateLayer(tr.meta(), bad, "x").ok());
}

TEST_CASE("query positions: window suffix detection", "[trace]") {
  testing::TinyTraceSpec spec;
  spec.all_queries = false;
  MemoryTrace tr = testing::MakeTinyTrace(spec);
  REQUIRE(tr.meta().Validate().ok());
  CHECK_FALSE(tr.meta().HasAllPromptQueries());
  CHECK(tr.meta().QueryIndex(spec.prefill_length - 8) == 0);
  CHECK(tr.meta().QueryIndex(0) == -1);
  CHECK(testing::MakeTinyTrace().meta().HasAllPromptQueries());
}

}  // namespace kvsim
