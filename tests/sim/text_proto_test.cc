#include "sim/text_proto.h"

#include <catch2/catch.hpp>
#include <fstream>
#include <string>

#include "policies/policy_params.pb.h"
#include "sim/latency_model.pb.h"
#include "sim/results.pb.h"
#include "tests/test_util.h"

namespace kvsim {
namespace {

bool Contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("ParseTextProto parses text format", "[text_proto]") {
  policy::SnapKVParams p;
  REQUIRE(ParseTextProto("window: 16\npooling: MAX_POOL\n", "inline", &p).ok());
  CHECK(p.window() == 16);
  CHECK(p.pooling() == policy::MAX_POOL);
  CHECK(p.kernel_size() == 5);  // default untouched
}

TEST_CASE("ParseTextProto errors name the source, line, column and message type", "[text_proto]") {
  policy::SnapKVParams p;
  // Line 2 "kernel_size: x": the bad token 'x' is the 14th character.
  Status st = ParseTextProto("window: 16\nkernel_size: x\n", "cfg.txtpb", &p);
  REQUIRE_FALSE(st.ok());
  CHECK(st.code() == StatusCode::kInvalidArgument);
  INFO(st.message());
  CHECK(Contains(st.message(), "cfg.txtpb: line 2, column 14: "));
  CHECK(Contains(st.message(), "kvsim.policy.SnapKVParams"));
  // Unknown field: named in the message.
  st = ParseTextProto("\n\n  windw: 3\n", "other.txtpb", &p);
  REQUIRE_FALSE(st.ok());
  INFO(st.message());
  CHECK(Contains(st.message(), "other.txtpb: line 3, column "));
  CHECK(Contains(st.message(), "windw"));
}

TEST_CASE("ParseTextProtoFile: missing file and errors name the path", "[text_proto]") {
  const std::string dir = testing::ScratchDir("text_proto");
  policy::H2OParams p;
  Status st = ParseTextProtoFile(dir + "/nope.txtpb", &p);
  CHECK(st.code() == StatusCode::kNotFound);
  CHECK(Contains(st.message(), dir + "/nope.txtpb"));
  const std::string path = dir + "/h2o.txtpb";
  std::ofstream(path) << "one_shot: true\nheavy_fraction: half\n";
  st = ParseTextProtoFile(path, &p);
  REQUIRE_FALSE(st.ok());
  INFO(st.message());
  CHECK(Contains(st.message(), path + ": line 2, column 17: "));
  std::ofstream(path) << "heavy_fraction: 0.25\none_shot: true\n";
  REQUIRE(ParseTextProtoFile(path, &p).ok());
  CHECK(p.heavy_fraction() == 0.25);
  CHECK(p.one_shot());
}

TEST_CASE("SetFieldFromString sets int, double, bool, enum and string fields", "[text_proto]") {
  policy::SnapKVParams snap;
  REQUIRE(SetFieldFromString("window=16", &snap).ok());
  REQUIRE(SetFieldFromString("pooling=MAX_POOL", &snap).ok());
  REQUIRE(SetFieldFromString("group_aggregation=2", &snap).ok());  // enum by number
  CHECK(snap.window() == 16);
  CHECK(snap.pooling() == policy::MAX_POOL);
  CHECK(snap.group_aggregation() == policy::SUM);

  policy::H2OParams h2o;
  REQUIRE(SetFieldFromString("heavy_fraction=0.25", &h2o).ok());
  REQUIRE(SetFieldFromString("one_shot=true", &h2o).ok());
  CHECK(h2o.heavy_fraction() == 0.25);
  CHECK(h2o.one_shot());
  REQUIRE(SetFieldFromString("one_shot=0", &h2o).ok());
  CHECK_FALSE(h2o.one_shot());
  REQUIRE(SetFieldFromString("heavy_fraction=1", &h2o).ok());  // integer literal for a double
  CHECK(h2o.heavy_fraction() == 1.0);

  LatencyModelProto lat;
  REQUIRE(SetFieldFromString("description=fitted on h100", &lat).ok());  // unquoted string
  CHECK(lat.description() == "fitted on h100");
  REQUIRE(SetFieldFromString("fitted_on=\"a100\"", &lat).ok());  // quoted string
  CHECK(lat.fitted_on() == "a100");
  REQUIRE(SetFieldFromString("description=", &lat).ok());  // empty string
  CHECK(lat.description().empty());
  REQUIRE(SetFieldFromString("decode_base_us=1e3", &lat).ok());
  CHECK(lat.decode_base_us() == 1000.0);
}

TEST_CASE("SetFieldFromString: nested fields with dots", "[text_proto]") {
  RunResult r;
  REQUIRE(SetFieldFromString("metrics.retained_mass_mean=0.5", &r).ok());
  CHECK(r.metrics().retained_mass_mean() == 0.5);
  Status st = SetFieldFromString("nosuch.x=1", &r);
  REQUIRE_FALSE(st.ok());
  CHECK(Contains(st.message(), "no message field 'nosuch'"));
  st = SetFieldFromString("policy.x=1", &r);  // a scalar is not a message
  REQUIRE_FALSE(st.ok());
  CHECK(Contains(st.message(), "no message field 'policy'"));
  st = SetFieldFromString("metrics=1", &r);
  REQUIRE_FALSE(st.ok());
  CHECK(Contains(st.message(), "'metrics' is not a scalar parameter"));
}

TEST_CASE("SetFieldFromString: unknown field lists the known names; bad values are rejected",
          "[text_proto]") {
  policy::SnapKVParams snap;
  Status st = SetFieldFromString("windw=3", &snap);
  REQUIRE_FALSE(st.ok());
  CHECK(st.code() == StatusCode::kInvalidArgument);
  INFO(st.message());
  CHECK(Contains(st.message(), "SnapKVParams has no parameter 'windw'"));
  CHECK(Contains(st.message(), "(parameters: window, kernel_size, pooling, group_aggregation)"));

  policy::FullParams full;
  st = SetFieldFromString("x=1", &full);
  REQUIRE_FALSE(st.ok());
  CHECK(Contains(st.message(), "(parameters: none)"));

  st = SetFieldFromString("window=abc", &snap);
  REQUIRE_FALSE(st.ok());
  CHECK(Contains(st.message(), "'abc' is not a valid int32 for 'window'"));
  CHECK_FALSE(SetFieldFromString("window=3000000000", &snap).ok());  // overflows int32
  CHECK_FALSE(SetFieldFromString("window=1.5", &snap).ok());
  CHECK_FALSE(SetFieldFromString("pooling=MEDIAN", &snap).ok());
  policy::H2OParams h2o;
  CHECK_FALSE(SetFieldFromString("one_shot=maybe", &h2o).ok());
  CHECK_FALSE(SetFieldFromString("heavy_fraction=half", &h2o).ok());
  CHECK(snap.window() == 32);  // failed sets leave the message unchanged

  st = SetFieldFromString("window", &snap);
  REQUIRE_FALSE(st.ok());
  CHECK(Contains(st.message(), "expected key=value"));
  CHECK_FALSE(SetFieldFromString("=3", &snap).ok());
}

TEST_CASE("ToTextWithDefaults prints unset proto2 fields with their defaults, on one line", "[text_proto]") {
  policy::SnapKVParams snap;
  CHECK(ToTextWithDefaults(snap) == "window: 32 kernel_size: 5 pooling: AVG group_aggregation: MEAN");
  snap.set_window(16);
  CHECK(ToTextWithDefaults(snap) == "window: 16 kernel_size: 5 pooling: AVG group_aggregation: MEAN");
  CHECK(ToTextWithDefaults(policy::FullParams()) == "");
  CHECK(ToTextWithDefaults(policy::H2OParams()) ==
        "heavy_fraction: 0.5 one_shot: false group_aggregation: MEAN");
  // The argument itself is not modified.
  CHECK_FALSE(snap.has_kernel_size());
  // proto3 (no presence): only non-default fields.
  Metrics m;
  m.set_samples(3);
  CHECK(ToTextWithDefaults(m) == "samples: 3");
}

}  // namespace kvsim

namespace kvsim {
TEST_CASE("SetFieldFromString: a repeated field takes a comma-separated list that replaces it",
          "[text_proto]") {
  policy::MuKVParams p;
  REQUIRE(SetFieldFromString("granularities=4,16,64", &p).ok());
  REQUIRE(p.granularities_size() == 3);
  CHECK(p.granularities(2) == 64);
  REQUIRE(SetFieldFromString("keep_ratios=[0.5, 0.25]", &p).ok());
  CHECK(p.keep_ratios_size() == 2);
  CHECK(p.keep_ratios(1) == 0.25);
  REQUIRE(SetFieldFromString("granularities=8", &p).ok());  // replaces, does not append
  CHECK(p.granularities_size() == 1);
  const Status bad = SetFieldFromString("granularities=4,x", &p);
  CHECK_FALSE(bad.ok());
  CHECK(bad.message().find("comma-separated list") != std::string::npos);
  CHECK(p.granularities_size() == 1);  // unchanged on error
}
}  // namespace kvsim
