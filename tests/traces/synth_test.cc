#include "traces/synth.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

#include "policies/registry.h"
#include "sim/attention.h"
#include "sim/replay.h"
#include "sim/rope.h"
#include "sim/version.h"
#include "tests/test_util.h"
#include "traces/half.h"

namespace kvsim {
namespace {

synth::SynthConfig LoadShipped(const std::string& name) {
  auto config = LoadSynthConfig(testing::SourceDir() + "/configs/synth/" + name);
  INFO(config.status().message());
  REQUIRE(config.ok());
  return *config;
}

MemoryTrace Generate(const synth::SynthConfig& config, int threads) {
  MemoryTrace trace;
  Status st = Synthesize(config, &trace, threads);
  INFO(st.message());
  REQUIRE(st.ok());
  return trace;
}

bool SameLayers(MemoryTrace& a, MemoryTrace& b) {
  if (a.layers().size() != b.layers().size()) return false;
  for (size_t l = 0; l < a.layers().size(); ++l) {
    const LayerData &x = a.layers()[l], &y = b.layers()[l];
    if (x.keys != y.keys || x.values != y.values || x.queries != y.queries ||
        x.prefill_column_sums != y.prefill_column_sums)
      return false;
  }
  return true;
}

// A small layout exercising every segment kind: system text, 2 images 3x4 with 2 text tokens between,
// a 3-frame 2x2 video, a question.
constexpr char kLayoutConfig[] = R"pb(
  model { num_layers: 2 num_heads: 4 num_kv_heads: 2 head_dim: 16 }
  layout {
    segments { kind: TEXT role: SYSTEM tokens: 5 }
    segments { kind: IMAGE rows: 3 cols: 4 repeat: 2 text_between: 2 }
    segments { kind: VIDEO rows: 2 cols: 2 repeat: 3 }
    segments { kind: TEXT role: QUESTION tokens: 4 }
    decode_steps: 3
  }
  storage { query_storage: ALL dtype: "float32" }
)pb";

}  // namespace

TEST_CASE("synth: same seed gives bit-identical layers, a different seed different ones", "[synth]") {
  synth::SynthConfig config = LoadShipped("tiny.textproto");
  MemoryTrace a = Generate(config, 1);
  MemoryTrace b = Generate(config, 1);
  CHECK(SameLayers(a, b));
  config.set_seed(config.seed() + 1);
  MemoryTrace c = Generate(config, 1);
  REQUIRE(c.layers().size() == a.layers().size());
  CHECK(c.layers()[0].keys != a.layers()[0].keys);
  CHECK(c.layers()[0].values != a.layers()[0].values);
  CHECK(c.layers()[0].queries != a.layers()[0].queries);
  CHECK(c.meta().seed == config.seed());
}

TEST_CASE("synth: output does not depend on the thread count", "[synth]") {
  for (const char* name : {"tiny.textproto", "tiny_gqa.textproto"}) {
    INFO(name);
    const synth::SynthConfig config = LoadShipped(name);
    MemoryTrace one = Generate(config, 1);
    MemoryTrace two = Generate(config, 2);
    MemoryTrace three = Generate(config, 3);
    CHECK(SameLayers(one, two));
    CHECK(SameLayers(one, three));
  }
}

TEST_CASE("synth: BuildSynthMeta lays out segments, patches, roles and query positions", "[synth]") {
  auto parsed = ParseSynthConfig(kLayoutConfig, "layout");
  REQUIRE(parsed.ok());
  auto meta_or = BuildSynthMeta(*parsed);
  INFO(meta_or.status().message());
  REQUIRE(meta_or.ok());
  const TraceMeta& meta = *meta_or;
  // 5 + 12 + 2 + 12 + 3 * 4 + 4 = 47 prompt tokens, 3 decode.
  REQUIRE(meta.prefill_length == 47);
  REQUIRE(meta.num_decode_steps == 3);
  REQUIRE(meta.total_tokens() == 50);
  const TokenTable& tk = meta.tokens;
  // Spans in order: system text (id 0), image (1), text between (2), image (3), frames (4, 5, 6),
  // question (7), generated (8).
  struct Span {
    int begin, end, segment;
    Modality modality;
    Role role;
  };
  const Span spans[] = {
      {0, 5, 0, Modality::kText, Role::kSystem},     {5, 17, 1, Modality::kImage, Role::kContext},
      {17, 19, 2, Modality::kText, Role::kContext},  {19, 31, 3, Modality::kImage, Role::kContext},
      {31, 35, 4, Modality::kVideo, Role::kContext}, {35, 39, 5, Modality::kVideo, Role::kContext},
      {39, 43, 6, Modality::kVideo, Role::kContext}, {43, 47, 7, Modality::kText, Role::kQuestion},
      {47, 50, 8, Modality::kText, Role::kGenerated}};
  for (const Span& s : spans)
    for (int j = s.begin; j < s.end; ++j) {
      INFO("token " << j);
      CHECK(tk.segment_id[j] == s.segment);
      CHECK(tk.modality[j] == s.modality);
      CHECK(tk.role[j] == s.role);
      CHECK(tk.phase[j] == (j < 47 ? Phase::kPrefill : Phase::kDecode));
      CHECK(tk.position_id[j] == j);
      const bool visual = s.modality != Modality::kText;
      const int cols = s.modality == Modality::kImage ? 4 : 2;
      CHECK(tk.patch_row[j] == (visual ? (j - s.begin) / cols : -1));
      CHECK(tk.patch_col[j] == (visual ? (j - s.begin) % cols : -1));
    }
  CHECK(meta.query_positions.size() == 50);
  CHECK(meta.HasAllPromptQueries());
  CHECK(meta.model.num_heads == 4);
  CHECK(meta.model.num_kv_heads == 2);
  CHECK(meta.model.softmax_scale == Approx(0.25));
  CHECK(meta.storage_dtype == StorageDtype::kFloat32);
  CHECK(meta.has_prefill_column_sums);
  CHECK(meta.generator == "kvsim synth");
  CHECK(meta.generator_version == kVersion);
  CHECK(meta.source == "synthetic");
  // The recorded config text parses back to the same config.
  auto back = ParseSynthConfig(meta.config_text, "config_text");
  REQUIRE(back.ok());
  CHECK(back->SerializeAsString() == parsed->SerializeAsString());

  synth::SynthConfig window = *parsed;
  window.mutable_storage()->set_query_storage(synth::Storage::WINDOW);
  window.mutable_storage()->set_query_window(6);
  window.mutable_storage()->set_dtype("float16");
  auto wmeta = BuildSynthMeta(window);
  REQUIRE(wmeta.ok());
  std::vector<int32_t> want;
  for (int p = 41; p < 50; ++p) want.push_back(p);
  CHECK(wmeta->query_positions == want);
  CHECK_FALSE(wmeta->HasAllPromptQueries());
  CHECK(wmeta->storage_dtype == StorageDtype::kFloat16);
}

TEST_CASE("synth: RoPE rotates pairs (i, i + d/2) by position * theta^(-2i/d)", "[synth]") {
  // d = 4, theta = 10000: pair 0 = dims (0, 2) with frequency 1, pair 1 = dims (1, 3) with frequency 0.01.
  float x[4] = {1, 2, 3, 4};
  ApplyRope(x, 4, 3, 10000);
  const double c0 = std::cos(3.0), s0 = std::sin(3.0), c1 = std::cos(0.03), s1 = std::sin(0.03);
  CHECK(x[0] == Approx(1 * c0 - 3 * s0).margin(1e-6));
  CHECK(x[2] == Approx(3 * c0 + 1 * s0).margin(1e-6));
  CHECK(x[1] == Approx(2 * c1 - 4 * s1).margin(1e-6));
  CHECK(x[3] == Approx(4 * c1 + 2 * s1).margin(1e-6));
  CHECK(RopeFrequency(1, 4, 10000) == Approx(0.01));

  // The table gives the same rotation, and q.k after RoPE depends only on the distance.
  const RopeTable table(4, 10000, {3, 10, 17});
  float y[4] = {1, 2, 3, 4};
  table.Apply(0, y);
  for (int i = 0; i < 4; ++i) CHECK(y[i] == Approx(x[i]).margin(1e-6));
  float q1[4] = {0.5f, -1, 2, 1}, k1[4] = {1, 1, -0.5f, 2}, q2[4], k2[4];
  std::copy(q1, q1 + 4, q2);
  std::copy(k1, k1 + 4, k2);
  table.Apply(1, q1);  // q at 10, k at 3
  table.Apply(0, k1);
  ApplyRope(q2, 4, 17, 10000);  // q at 17, k at 10: same distance
  ApplyRope(k2, 4, 10, 10000);
  double d1 = 0, d2 = 0;
  for (int i = 0; i < 4; ++i) {
    d1 += q1[i] * k1[i];
    d2 += q2[i] * k2[i];
  }
  CHECK(d1 == Approx(d2).margin(1e-5));
}

TEST_CASE("synth: recorded prefill column sums equal AccumulateColumnSums on the stored tensors", "[synth]") {
  const synth::SynthConfig config =
      LoadShipped("tiny.textproto");  // ALL queries: every prompt query is stored
  MemoryTrace trace = Generate(config, 2);
  const TraceMeta& meta = trace.meta();
  REQUIRE(meta.has_prefill_column_sums);
  const int n = meta.prefill_length, t = meta.total_tokens(), d = meta.model.head_dim;
  std::vector<int32_t> pos(n);
  for (int i = 0; i < n; ++i) pos[i] = i;
  for (const LayerData& ld : trace.layers()) {
    for (int h = 0; h < meta.model.num_heads; ++h) {
      const int g = h / meta.model.GroupSize();
      std::vector<float> sums(n, 0.0f);
      AccumulateColumnSums(meta.model,
                           ld.queries.data() + static_cast<size_t>(h) * meta.query_positions.size() * d,
                           pos.data(), n, ld.keys.data() + static_cast<size_t>(g) * t * d, n, sums.data());
      const std::vector<float> got(ld.prefill_column_sums.begin() + static_cast<size_t>(h) * n,
                                   ld.prefill_column_sums.begin() + static_cast<size_t>(h + 1) * n);
      CHECK(got == sums);
    }
  }
  // With windowed storage the sums still cover every prompt query: each row sums to 1.
  MemoryTrace gqa = Generate(LoadShipped("tiny_gqa.textproto"), 2);
  for (const LayerData& ld : gqa.layers())
    for (int h = 0; h < gqa.meta().model.num_heads; ++h) {
      double total = 0;
      for (int j = 0; j < gqa.meta().prefill_length; ++j)
        total += ld.prefill_column_sums[static_cast<size_t>(h) * gqa.meta().prefill_length + j];
      CHECK(total == Approx(gqa.meta().prefill_length).epsilon(1e-4));
    }
}

TEST_CASE("synth: windowed storage keeps the same tensors; float16 storage is exactly representable",
          "[synth]") {
  synth::SynthConfig config = LoadShipped("tiny_gqa.textproto");
  MemoryTrace window = Generate(config, 1);
  config.mutable_storage()->set_query_storage(synth::Storage::ALL);
  MemoryTrace all = Generate(config, 1);
  const TraceMeta& wm = window.meta();
  const int d = wm.model.head_dim;
  const size_t tw = wm.query_positions.size(), ta = all.meta().query_positions.size();
  for (size_t l = 0; l < window.layers().size(); ++l) {
    const LayerData &w = window.layers()[l], &a = all.layers()[l];
    CHECK(w.keys == a.keys);
    CHECK(w.values == a.values);
    CHECK(w.prefill_column_sums == a.prefill_column_sums);
    for (int h = 0; h < wm.model.num_heads; ++h)
      for (size_t i = 0; i < tw; ++i) {
        const float* wq = w.queries.data() + (h * tw + i) * d;
        const float* aq = a.queries.data() + (h * ta + wm.query_positions[i]) * d;
        CHECK(std::equal(wq, wq + d, aq));
      }
    for (float x : w.keys) REQUIRE(HalfToFloat(FloatToHalf(x)) == x);
    for (float x : w.queries) REQUIRE(HalfToFloat(FloatToHalf(x)) == x);
    for (float x : w.values) REQUIRE(HalfToFloat(FloatToHalf(x)) == x);
  }
}

TEST_CASE("synth: config errors name the file, line and field", "[synth]") {
  auto check = [](const std::string& text, const std::vector<std::string>& needles) {
    auto r = ParseSynthConfig(text, "cfg.textproto");
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    for (const std::string& s : needles) {
      INFO(r.status().message() << "\n  should contain: " << s);
      CHECK(r.status().message().find(s) != std::string::npos);
    }
  };
  // Syntax: unknown field.
  check("model {\n  num_layers: 2\n  num_layerz: 3\n}\n", {"cfg.textproto", "line 3", "num_layerz"});
  // Semantic checks point at the line the field is set on.
  const std::string seg =
      "layout {\n  segments { kind: TEXT tokens: 4 }\n  segments { kind: IMAGE rows: 0 cols: 24 }\n}\n";
  check(seg, {"cfg.textproto", "line 3", "layout.segments[1].rows", "rows * cols"});
  check("layout { segments { kind: TEXT tokens: 4 } }\nmodel {\n  num_heads: 4\n  num_kv_heads: 3\n}\n",
        {"line 4", "model.num_kv_heads", "divide num_heads"});
  check("model { head_dim: 33 }\nlayout { segments { kind: TEXT tokens: 4 } }\n",
        {"line 1", "model.head_dim", "even"});
  check("layout {\n  segments { kind: TEXT tokens: 4 }\n  decode_steps: 0\n}\n",
        {"line 3", "layout.decode_steps"});
  check("layout { }\n", {"layout.segments", "empty"});
  check("layout { segments { kind: TEXT tokens: 0 } }\n", {"layout.segments[0].tokens"});
  check("layout { segments { kind: TEXT tokens: 4 } }\nstorage { query_storage: WINDOW query_window: 9 }\n",
        {"line 2", "storage.query_window", "prompt length = 4"});
  check("layout { segments { kind: TEXT tokens: 4 } }\nstorage { dtype: \"int8\" }\n",
        {"storage.dtype", "int8"});
  check("layout { segments { kind: TEXT tokens: 8 } }\nprofile {\n  deep_sink_mass: 1.5\n}\n",
        {"line 3", "profile.deep_sink_mass", "[0, 1)"});
  check("layout { segments { kind: TEXT tokens: 8 } }\nprofile { num_sinks: 8 }\n", {"profile.num_sinks"});
  check("model {\n  head_dim: 16\n  rope_theta: 100\n}\nlayout { segments { kind: TEXT tokens: 4000 } }\n",
        {"line 3", "model.rope_theta", "raise rope_theta"});
  check(
      "layout { segments { kind: TEXT tokens: 8 } }\nprofile { text_preference_min: 0.8 text_preference_max: "
      "0.2 }\n",
      {"profile.text_preference_max"});

  // Files: missing, and errors prefixed with the path.
  auto missing = LoadSynthConfig("/nonexistent/x.textproto");
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().code() == StatusCode::kNotFound);
  CHECK(missing.status().message().find("/nonexistent/x.textproto") != std::string::npos);
  const std::string path = testing::ScratchDir("synth_config") + "/bad.textproto";
  std::ofstream(path) << seg;
  auto bad = LoadSynthConfig(path);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find(path + ": line 3") != std::string::npos);

  // Programmatic configs are checked too (no line to name).
  synth::SynthConfig config;
  config.mutable_layout()->add_segments()->set_tokens(4);
  config.mutable_model()->set_num_layers(0);
  MemoryTrace sink;
  Status st = Synthesize(config, &sink);
  REQUIRE_FALSE(st.ok());
  CHECK(st.message().find("model.num_layers") != std::string::npos);
  CHECK_FALSE(BuildSynthMeta(config).ok());
}

TEST_CASE("synth: shipped configs parse and describe valid traces", "[synth]") {
  namespace fs = std::filesystem;
  int count = 0;
  for (const auto& entry : fs::directory_iterator(testing::SourceDir() + "/configs/synth")) {
    if (entry.path().extension() != ".textproto") continue;
    INFO(entry.path().string());
    auto config = LoadSynthConfig(entry.path().string());
    INFO(config.status().message());
    REQUIRE(config.ok());
    auto meta = BuildSynthMeta(*config);
    INFO(meta.status().message());
    REQUIRE(meta.ok());
    CHECK(meta->Validate().ok());
    ++count;
  }
  CHECK(count >= 4);

  auto visual_segments = [](const TraceMeta& m, Modality kind) {
    std::set<int32_t> ids;
    for (int j = 0; j < m.tokens.size(); ++j)
      if (m.tokens.modality[j] == kind) ids.insert(m.tokens.segment_id[j]);
    return ids.size();
  };
  auto llava = BuildSynthMeta(LoadShipped("llava15_7b_multi_image.textproto"));
  REQUIRE(llava.ok());
  CHECK(llava->prefill_length >= 3230);
  CHECK(llava->prefill_length <= 3330);
  CHECK(visual_segments(*llava, Modality::kImage) == 5);
  CHECK(llava->model.num_layers == 32);
  CHECK(llava->model.num_heads == 32);
  CHECK(llava->model.num_kv_heads == 32);
  CHECK(llava->model.head_dim == 128);
  CHECK(llava->num_decode_steps == 128);
  CHECK(llava->HasAllPromptQueries());
  CHECK(llava->has_prefill_column_sums);
  CHECK(llava->storage_dtype == StorageDtype::kFloat16);
  int question = 0, text = 0;
  for (int j = 0; j < llava->prefill_length; ++j) {
    question += llava->tokens.role[j] == Role::kQuestion;
    text += llava->tokens.modality[j] == Modality::kText;
  }
  CHECK(question >= 30);
  CHECK(text >= 350);
  CHECK(text <= 450);

  auto qwen = BuildSynthMeta(LoadShipped("qwen2_7b_video.textproto"));
  REQUIRE(qwen.ok());
  CHECK(visual_segments(*qwen, Modality::kVideo) == 16);
  CHECK(qwen->model.num_heads == 28);
  CHECK(qwen->model.num_kv_heads == 4);
  CHECK(qwen->model.rope_theta == 1e6);
  CHECK(qwen->num_decode_steps == 64);
  CHECK(qwen->query_positions.size() == 64u + 64u);
  CHECK(qwen->has_prefill_column_sums);
}

TEST_CASE("synth: the tiny configs let the window policies run with their defaults and differ",
          "[synth][friction]") {
  // Issue 16: a prompt longer than the default observation window (32) and every query of that window
  // stored, so snapkv, pyramidkv, adakv and madakv run with their defaults; above a 32-token budget they
  // select differently and their numbers differ.
  for (const char* name : {"tiny.textproto", "tiny_gqa.textproto"}) {
    INFO(name);
    MemoryTrace trace = Generate(LoadShipped(name), 2);
    const TraceMeta& meta = trace.meta();
    REQUIRE(meta.prefill_length > 32);
    for (int p = meta.prefill_length - 32; p < meta.prefill_length; ++p) CHECK(meta.QueryIndex(p) >= 0);
    std::vector<RunSpec> runs;
    for (const char* policy : {"snapkv", "pyramidkv", "adakv", "madakv"}) {
      auto created = PolicyRegistry::Default().Create(policy, {});
      REQUIRE(created.ok());
      runs.push_back(RunSpec{*created, policy, 0.5, 0, QuestionMode::kQueryAware});
    }
    ReplayOptions ro;
    ro.threads = 2;
    auto res = Replay(trace, runs, ro);
    INFO(res.status().message());
    REQUIRE(res.ok());
    REQUIRE((*res)[0].budget_tokens() > 32);
    std::set<double> retained;
    for (const RunResult& r : *res) retained.insert(r.metrics().retained_mass_mean());
    CHECK(retained.size() == runs.size());
  }
}

}  // namespace kvsim
