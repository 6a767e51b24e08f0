#include "analysis/trace_stats.h"

#include <google/protobuf/util/json_util.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <random>

#include "tests/test_util.h"
#include "traces/synth.h"

namespace kvsim {
namespace {

// Mid-size GQA trace: 8 layers, 8 query heads on 4 KV heads, d 64, three 12x12 images and 142 text
// tokens (628 prompt tokens), 16 decode steps.
constexpr char kMidConfig[] = R"pb(
  model { name: "mid" num_layers: 8 num_heads: 8 num_kv_heads: 4 head_dim: 64 rope_theta: 10000 }
  layout {
    segments { kind: TEXT role: SYSTEM tokens: 20 }
    segments { kind: IMAGE rows: 12 cols: 12 repeat: 3 text_between: 10 }
    segments { kind: TEXT tokens: 60 }
    segments { kind: TEXT role: QUESTION tokens: 30 }
    decode_steps: 16
  }
  storage { query_storage: WINDOW query_window: 16 dtype: "float32" record_prefill_column_sums: false }
  seed: 3
)pb";

MemoryTrace MidTrace() {
  auto config = ParseSynthConfig(kMidConfig, "mid");
  REQUIRE(config.ok());
  MemoryTrace trace;
  REQUIRE(Synthesize(*config, &trace, 2).ok());
  return trace;
}

// The same layout with i.i.d. N(0, 1) queries, keys and values.
MemoryTrace RandomLike(MemoryTrace& like) {
  MemoryTrace out(like.meta(), {});
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const LayerData& src : like.layers()) {
    LayerData ld = src;
    for (float& x : ld.keys) x = nd(rng);
    for (float& x : ld.values) x = nd(rng);
    for (float& x : ld.queries) x = nd(rng);
    out.layers().push_back(std::move(ld));
  }
  return out;
}

TraceStats Stats(MemoryTrace& trace, int threads = 2) {
  auto stats = ComputeTraceStats(trace, threads);
  INFO(stats.status().message());
  REQUIRE(stats.ok());
  return *stats;
}

// Means over layer groups: dense = the first 2 layers, deep = 2 .. L-2, last = L-1.
struct Groups {
  double dense, deep, last;
};
template <typename F>
Groups Group(const TraceStats& s, F field) {
  const int l = static_cast<int>(s.layers.size());
  Groups g{0, 0, field(s.layers[l - 1])};
  for (int i = 0; i < 2; ++i) g.dense += field(s.layers[i]) / 2;
  for (int i = 2; i < l - 1; ++i) g.deep += field(s.layers[i]) / (l - 3);
  return g;
}

std::vector<double> DeepShares(const TraceStats& s) {
  std::vector<double> v;
  for (size_t l = 2; l + 1 < s.layers.size(); ++l)
    v.insert(v.end(), s.layers[l].head_text_share.begin(), s.layers[l].head_text_share.end());
  return v;
}

double StdDev(const std::vector<double>& v) {
  double m = 0, s = 0;
  for (double x : v) m += x / v.size();
  for (double x : v) s += (x - m) * (x - m) / v.size();
  return std::sqrt(s);
}

// Mean |share(h) - share(h')| over deep-layer query-head pairs in the same / different GQA groups.
std::pair<double, double> GroupShareDistances(const TraceStats& s, int group) {
  double within = 0, across = 0;
  int nw = 0, na = 0;
  for (size_t l = 2; l + 1 < s.layers.size(); ++l) {
    const auto& sh = s.layers[l].head_text_share;
    for (size_t a = 0; a < sh.size(); ++a)
      for (size_t b = a + 1; b < sh.size(); ++b) {
        const double diff = std::abs(sh[a] - sh[b]);
        if (static_cast<int>(a) / group == static_cast<int>(b) / group) {
          within += diff;
          ++nw;
        } else {
          across += diff;
          ++na;
        }
      }
  }
  return {within / nw, across / na};
}

}  // namespace

TEST_CASE("trace stats: synthetic attention shows the seven properties; random Q/K does not",
          "[stats][synth]") {
  MemoryTrace synth = MidTrace();
  MemoryTrace random = RandomLike(synth);
  const TraceStats s = Stats(synth);
  const TraceStats r = Stats(random);
  const double uniform_recent = 32.0 / synth.meta().total_tokens();

  // 1. Sparsity: the top 20% of keys carry most of the decode attention in deep layers.
  const Groups top = Group(s, [](const LayerStats& l) { return l.top_mass; });
  CHECK(top.deep >= 0.75);
  CHECK(Group(r, [](const LayerStats& l) { return l.top_mass; }).deep < 0.65);

  // 2. Layer profile: dense near-uniform early layers, sparse deep layers, a flatter last layer.
  const Groups h = Group(s, [](const LayerStats& l) { return l.normalized_entropy; });
  CHECK(h.dense >= 0.95);
  CHECK(h.dense - h.deep >= 0.15);
  CHECK(h.last - h.deep >= 0.05);
  CHECK(top.dense < 0.45);
  const Groups hr = Group(r, [](const LayerStats& l) { return l.normalized_entropy; });
  CHECK(std::abs(hr.dense - hr.deep) < 0.05);

  // 3. Head modality preference: deep heads spread from visual- to text-preferring.
  const std::vector<double> shares = DeepShares(s), rshares = DeepShares(r);
  CHECK(*std::max_element(shares.begin(), shares.end()) > 0.8);
  CHECK(*std::min_element(shares.begin(), shares.end()) < 0.35);
  CHECK(StdDev(shares) >= 0.15);
  CHECK(StdDev(rshares) < 0.05);

  // 4. Visual attention is more diffuse than text attention within its modality.
  const Groups tc = Group(s, [](const LayerStats& l) { return l.text_concentration; });
  const Groups vc = Group(s, [](const LayerStats& l) { return l.visual_concentration; });
  CHECK(tc.deep - vc.deep >= 0.15);
  CHECK(Group(r, [](const LayerStats& l) { return l.text_concentration - l.visual_concentration; }).deep <
        0.1);

  // 5. Sinks on the first tokens and a recency bias.
  CHECK(Group(s, [](const LayerStats& l) { return l.sink_mass; }).deep >= 0.1);
  CHECK(Group(r, [](const LayerStats& l) { return l.sink_mass; }).deep < 0.03);
  CHECK(Group(s, [](const LayerStats& l) { return l.recent_mass; }).deep >= 1.8 * uniform_recent);
  CHECK(Group(r, [](const LayerStats& l) { return l.recent_mass; }).deep < 1.4 * uniform_recent);

  // 6. Keys of horizontally adjacent patches are much more similar than random pairs of the same image.
  CHECK(s.num_adjacent_pairs == 3 * 12 * 11);
  CHECK(s.adjacent_patch_key_cosine - s.random_patch_key_cosine >= 0.3);
  CHECK(std::abs(r.adjacent_patch_key_cosine - r.random_patch_key_cosine) < 0.05);

  // 7. GQA: query heads of a group have similar but not identical preferences.
  const auto [within, across] = GroupShareDistances(s, synth.meta().model.GroupSize());
  CHECK(within > 1e-4);
  CHECK(within < 0.5 * across);
  const auto [rwithin, racross] = GroupShareDistances(r, synth.meta().model.GroupSize());
  CHECK_FALSE(rwithin < 0.5 * racross);

  // The report and JSON mention what they should.
  const std::string text = FormatTraceStats(synth.meta(), s);
  CHECK(text.find("text-preferring") != std::string::npos);
  CHECK(text.find("image 432") != std::string::npos);
  const std::string json = TraceStatsToJson(synth.meta(), s);
  InspectReport parsed;
  REQUIRE(google::protobuf::util::JsonStringToMessage(json, &parsed).ok());
  REQUIRE(parsed.layers_size() == synth.meta().model.num_layers);
  CHECK(parsed.layers(0).layer() == 0);
  CHECK(json.find("\"layers\": [") != std::string::npos);
}

TEST_CASE("trace stats: deterministic for any thread count", "[stats]") {
  MemoryTrace synth = MidTrace();
  const TraceStats a = Stats(synth, 1), b = Stats(synth, 3);
  CHECK(TraceStatsToJson(synth.meta(), a) == TraceStatsToJson(synth.meta(), b));
  CHECK(a.adjacent_patch_key_cosine == b.adjacent_patch_key_cosine);
  for (size_t l = 0; l < a.layers.size(); ++l) {
    CHECK(a.layers[l].entropy == b.layers[l].entropy);
    CHECK(a.layers[l].head_text_share == b.layers[l].head_text_share);
  }
}

TEST_CASE("trace stats: hand-computed values on a handmade trace", "[stats]") {
  // One layer, one head, d = 2, scale 1. Prompt: token 0 text, tokens 1-2 two patches of one 1x2 image;
  // token 3 is the only decode step. Query (1, 0) and keys (log p_j, c_j) give attention p = (1/2, 1/4,
  // 1/8, 1/8).
  TraceMeta meta;
  meta.model.name = "hand";
  meta.model.num_layers = 1;
  meta.model.num_heads = 1;
  meta.model.num_kv_heads = 1;
  meta.model.head_dim = 2;
  meta.model.softmax_scale = 1.0;
  meta.prefill_length = 3;
  meta.num_decode_steps = 1;
  meta.tokens.Resize(4);
  for (int j = 0; j < 4; ++j) meta.tokens.position_id[j] = j;
  for (int j : {1, 2}) {
    meta.tokens.modality[j] = Modality::kImage;
    meta.tokens.segment_id[j] = 0;
    meta.tokens.patch_row[j] = 0;
    meta.tokens.patch_col[j] = j - 1;
  }
  meta.tokens.phase[3] = Phase::kDecode;
  meta.tokens.role[3] = Role::kGenerated;
  meta.query_positions = {3};
  const double p[4] = {0.5, 0.25, 0.125, 0.125};
  const float c[4] = {0.0f, 1.0f, -1.0f, 0.0f};
  LayerData ld;
  ld.layer = 0;
  for (int j = 0; j < 4; ++j) {
    ld.keys.push_back(static_cast<float>(std::log(p[j])));
    ld.keys.push_back(c[j]);
  }
  ld.values.assign(8, 1.0f);
  ld.queries = {1.0f, 0.0f};
  MemoryTrace trace(meta, {ld});

  TraceStatsOptions opt;
  opt.sink_tokens = 1;
  opt.recent_tokens = 2;
  opt.sparsity_epsilon = 0.2;
  auto stats_or = ComputeTraceStats(trace, 1, opt);
  INFO(stats_or.status().message());
  REQUIRE(stats_or.ok());
  const LayerStats& l = stats_or->layers.at(0);
  const double ln2 = std::log(2.0);
  CHECK(l.entropy == Approx(1.75 * ln2).epsilon(1e-5));
  CHECK(l.normalized_entropy == Approx(0.875).epsilon(1e-5));
  CHECK(l.top_mass == Approx(0.5).epsilon(1e-5));  // ceil(0.2 * 4) = 1 key
  CHECK(l.sink_mass == Approx(0.5).epsilon(1e-5));
  CHECK(l.recent_mass == Approx(0.25).epsilon(1e-5));  // tokens 2 and 3
  CHECK(l.sparsity == Approx(0.5));                    // 1/8, 1/8 <= 0.2
  CHECK(l.text_sparsity == Approx(0.5));               // text keys 0 (1/2) and 3 (1/8)
  CHECK(l.visual_sparsity == Approx(0.5));             // visual keys 1 (1/4) and 2 (1/8)
  CHECK(l.text_concentration == Approx(0.5 / 0.625).epsilon(1e-5));
  CHECK(l.visual_concentration == Approx(0.25 / 0.375).epsilon(1e-5));
  REQUIRE(l.head_text_share.size() == 1);
  CHECK(l.head_text_share[0] == Approx(0.625).epsilon(1e-5));
  // One adjacent pair (1, 2) and one distinct random pair (the same one).
  const double a = std::log(0.25), b = std::log(0.125);
  const double cosine = (a * b - 1) / std::sqrt((a * a + 1) * (b * b + 1));
  CHECK(stats_or->num_adjacent_pairs == 1);
  CHECK(stats_or->num_random_pairs == 1);
  CHECK(stats_or->adjacent_patch_key_cosine == Approx(cosine).epsilon(1e-5));
  CHECK(stats_or->random_patch_key_cosine == Approx(cosine).epsilon(1e-5));

  // k90 and v/o: the query (2, 0) squares p: (16, 4, 1, 1) / 22, so 2 keys hold 20/22 >= 90% of the mass.
  // Values (1,0), (-1,0), (0,1), (0,-1) (norm 1 each) give o = (12/22, 0): v/o = 22/12.
  {
    MemoryTrace sharp(meta, {ld});
    sharp.layers()[0].queries = {2.0f, 0.0f};
    sharp.layers()[0].values = {1, 0, -1, 0, 0, 1, 0, -1};
    auto st = ComputeTraceStats(sharp, 1, opt);
    REQUIRE(st.ok());
    CHECK(st->layers[0].k90 == Approx(2.0));
    CHECK(st->layers[0].k90_fraction == Approx(0.5));
    CHECK(st->layers[0].value_output_ratio == Approx(22.0 / 12.0).epsilon(1e-5));
    // One layer: the JSON's overall values (mean over layers) are that layer's.
    InspectReport parsed;
    REQUIRE(google::protobuf::util::JsonStringToMessage(TraceStatsToJson(sharp.meta(), *st), &parsed).ok());
    CHECK(parsed.mean_over_layers().k90() == 2);
    CHECK(parsed.mean_over_layers().k90_fraction() == 0.5);
    CHECK(parsed.mean_over_layers().value_output_ratio() == Approx(22.0 / 12.0).epsilon(1e-5));
    // The first query: (1/2, 1/4, 1/8, 1/8) needs all 4 keys for 90%; o = (1/4, 0): v/o = 4.
    sharp.layers()[0].queries = {1.0f, 0.0f};
    auto first = ComputeTraceStats(sharp, 1, opt);
    REQUIRE(first.ok());
    CHECK(first->layers[0].k90 == Approx(4.0));
    CHECK(first->layers[0].k90_fraction == Approx(1.0));
    CHECK(first->layers[0].value_output_ratio == Approx(4.0).epsilon(1e-5));
  }

  // A zero query attends uniformly: entropy log 4, normalized 1, sparsity 0.
  trace.layers()[0].queries = {0.0f, 0.0f};
  auto uniform = ComputeTraceStats(trace, 1, opt);
  REQUIRE(uniform.ok());
  CHECK(uniform->layers[0].entropy == Approx(std::log(4.0)).epsilon(1e-5));
  CHECK(uniform->layers[0].normalized_entropy == Approx(1.0).epsilon(1e-5));
  CHECK(uniform->layers[0].top_mass == Approx(0.25).epsilon(1e-5));
  CHECK(uniform->layers[0].sparsity == 0.0);

  // Report and JSON.
  const std::string text = FormatTraceStats(trace.meta(), *stats_or);
  CHECK(text.find("1 visual segments") == std::string::npos);
  CHECK(text.find("visual segments (images / frames): 1 1x2") != std::string::npos);
  CHECK(text.find("1 text-preferring (>0.6), 0 visual-preferring (<0.4), 0 mixed") != std::string::npos);
  const std::string json = TraceStatsToJson(trace.meta(), *stats_or);
  InspectReport parsed;
  REQUIRE(google::protobuf::util::JsonStringToMessage(json, &parsed).ok());
  REQUIRE(parsed.layers_size() == 1);
  CHECK(std::vector<double>(parsed.layers(0).head_text_share().begin(),
                            parsed.layers(0).head_text_share().end()) == std::vector<double>{0.625});
  CHECK(parsed.tokens_by_modality().text() == 2);
  CHECK(parsed.tokens_by_modality().image() == 2);
  CHECK(json.find("\"video\": 0") != std::string::npos);  // zero counts are printed too

  // Errors: no decode steps; bad options.
  opt.top_fraction = 0;
  CHECK_FALSE(ComputeTraceStats(trace, 1, opt).ok());
  MemoryTrace no_decode = testing::MakeTinyTrace({.decode_steps = 0});
  auto st = ComputeTraceStats(no_decode, 1);
  REQUIRE_FALSE(st.ok());
  CHECK(st.status().message().find("no decode steps") != std::string::npos);
}

}  // namespace kvsim
