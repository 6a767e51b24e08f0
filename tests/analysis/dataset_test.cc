#include "analysis/dataset.h"

#include <catch2/catch.hpp>
#include <cmath>

#include "sim/stats.h"

namespace kvsim {

namespace {

ModelInfo Model(const std::string& name, int layers, int heads, int kv_heads, int dim) {
  ModelInfo m;
  m.name = name;
  m.num_layers = layers;
  m.num_heads = heads;
  m.num_kv_heads = kv_heads;
  m.head_dim = dim;
  return m;
}

}  // namespace

TEST_CASE("dataset: groups, declared groups and their one-line errors", "[dataset]") {
  const ModelInfo m = Model("llava-1.5-7b", 32, 32, 8, 128);
  CHECK(TraceGroup(m) == "llava-1.5-7b L=32 H=32 KV=8 D=128");
  auto g = ParseGroupSpec("llava-1.5-7b KV=8 L=32");
  REQUIRE(g.ok());
  CHECK(g->model == "llava-1.5-7b");
  CHECK(g->layers == 32);
  CHECK(g->kv_heads == 8);
  CHECK(g->heads == -1);
  CHECK(g->head_dim == -1);
  for (const char* bad : {"", "L=32", "m L=", "m L=0", "m L=3x", "m X=3", "m L=3 L=3", "m L"})
    CHECK_FALSE(ParseGroupSpec(bad).ok());

  config::Sample s;
  s.set_id("a");
  s.set_path("a.h5");
  CHECK(CheckSampleGroup(s, m).ok());  // nothing declared
  s.set_group("llava-1.5-7b");
  CHECK(CheckSampleGroup(s, m).ok());
  s.set_group(TraceGroup(m));
  CHECK(CheckSampleGroup(s, m).ok());
  s.set_group("llava-1.5-7b L=32 D=64");
  Status st = CheckSampleGroup(s, m);
  REQUIRE_FALSE(st.ok());
  CHECK(st.message().rfind("sample 'a': field 'group'", 0) == 0);
  CHECK(st.message().find("D=128, not 64") != std::string::npos);
  CHECK(st.message().find('\n') == std::string::npos);
  s.set_origin("m.csv:7");
  s.set_group("qwen2-7b");
  st = CheckSampleGroup(s, m);
  REQUIRE_FALSE(st.ok());
  CHECK(st.message().rfind("m.csv:7: field 'group'", 0) == 0);
  CHECK(st.message().find("model 'llava-1.5-7b', not 'qwen2-7b'") != std::string::npos);
}

TEST_CASE("dataset: aggregates per cell; undefined values left out of n; fractions one cell", "[dataset]") {
  const double nan = std::nan("");
  // Two groups; in g1 a fractional budget whose token counts differ per sample (prompt lengths).
  const std::vector<AggregateRow> rows = {
      {"g1", "p", "p", 0.5, 10, {1.0, nan}},  {"g1", "p", "p", 0.5, 20, {2.0, 0.5}},
      {"g2", "p", "p", 0.5, 10, {100.0, nan}}, {"g1", "p", "p", 0.5, 40, {6.0, 0.7}},
      {"g1", "q", "q", 0, 16, {nan, nan}},     {"g1", "q", "q", 0, 32, {3.0, nan}}};
  const auto aggs = AggregateRows(rows, {"a", "b"}, 7, 500);
  // g1/p: a (n=3), b (n=2); g2/p: a only; g1/q@16: nothing defined, no rows; g1/q@32: a only.
  REQUIRE(aggs.size() == 4);
  CHECK(aggs[0].group() == "g1");
  CHECK(aggs[0].metric() == "a");
  CHECK(aggs[0].n() == 3);
  CHECK(aggs[0].mean() == Approx(3.0));
  CHECK(aggs[0].budget_tokens() == 10);  // the first sample's
  CHECK(aggs[0].sd() == Approx(std::sqrt(((1 - 3.0) * (1 - 3.0) + 1 + 9) / 2)));
  CHECK(aggs[0].ci95_low() <= aggs[0].mean());
  CHECK(aggs[0].ci95_high() >= aggs[0].mean());
  CHECK(aggs[0].resamples() == 500);
  CHECK(aggs[1].metric() == "b");
  CHECK(aggs[1].n() == 2);
  CHECK(aggs[1].mean() == Approx(0.6));
  CHECK(aggs[2].group() == "g2");  // never averaged with g1
  CHECK(aggs[2].n() == 1);
  CHECK(aggs[2].mean() == 100.0);
  CHECK(aggs[2].sd() == 0);
  CHECK(aggs[3].label() == "q");
  CHECK(aggs[3].budget_tokens() == 32);
  // Seeded: the same bytes again.
  const auto again = AggregateRows(rows, {"a", "b"}, 7, 500);
  for (size_t i = 0; i < aggs.size(); ++i) CHECK(again[i].SerializeAsString() == aggs[i].SerializeAsString());

  google::protobuf::RepeatedPtrField<FailedUnit> failed;
  const std::string md = DatasetMarkdown(aggs, failed, 3, {{"a", "A"}, {"b", "B", 10}});
  CHECK(md.find("### Group `g1`") != std::string::npos);
  CHECK(md.find("### Group `g2`") != std::string::npos);
  CHECK(md.find("| p | 50% | 3 | 3 ± 2.6 [") != std::string::npos);
  CHECK(md.find("| 6 ± ") != std::string::npos);  // b scaled by 10
  CHECK(md.find("(n=2)") != std::string::npos);  // b has fewer samples than the cell
  CHECK(md.find("| q | 32 tok | 1 | 3 ± 0 [3, 3] | n/a |") != std::string::npos);
  CHECK(DatasetMarkdown(aggs, failed, 1, {{"a", "A"}}).empty());  // one sample: no "Across samples"
}

}  // namespace kvsim
