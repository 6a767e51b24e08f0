#include "traces/synth_streaming.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <vector>

#include "sim/attention.h"
#include "tests/test_util.h"
#include "traces/synth.h"

namespace kvsim {
namespace {

synth::SynthConfig TinyConfig() {
  auto config = LoadSynthConfig(testing::SourceDir() + "/configs/synth/streaming_tiny.textproto");
  INFO(config.status().message());
  REQUIRE(config.ok());
  return *config;
}

MemoryTrace Generate(const synth::SynthConfig& config, int threads = 2) {
  MemoryTrace trace;
  Status st = Synthesize(config, &trace, threads);
  INFO(st.message());
  REQUIRE(st.ok());
  return trace;
}

// Bitwise equality of every tensor, block encodings included.
bool SameData(MemoryTrace& a, MemoryTrace& b) {
  if (a.layers().size() != b.layers().size()) return false;
  for (size_t l = 0; l < a.layers().size(); ++l) {
    const LayerData &x = a.layers()[l], &y = b.layers()[l];
    if (x.keys != y.keys || x.values != y.values || x.queries != y.queries ||
        x.blocks.size() != y.blocks.size())
      return false;
    for (size_t g = 0; g < x.blocks.size(); ++g)
      if (x.blocks[g].keys != y.blocks[g].keys || x.blocks[g].values != y.blocks[g].values ||
          x.blocks[g].attention_received != y.blocks[g].attention_received)
        return false;
  }
  return true;
}

}  // namespace

TEST_CASE("streaming synth: identical data for any thread count, seed changes it", "[synth][streaming]") {
  synth::SynthConfig c = TinyConfig();
  MemoryTrace a = Generate(c, 1);
  for (int threads : {2, 3}) {
    MemoryTrace b = Generate(c, threads);
    CHECK(SameData(a, b));
    CHECK(b.meta().stream->questions.size() == a.meta().stream->questions.size());
    CHECK(b.meta().tokens.position_id == a.meta().tokens.position_id);
  }
  c.set_seed(c.seed() + 1);
  MemoryTrace d = Generate(c, 2);
  CHECK_FALSE(SameData(a, d));
}

TEST_CASE("streaming synth: layout, questions and evidence", "[synth][streaming]") {
  const synth::SynthConfig c = TinyConfig();
  MemoryTrace tr = Generate(c);
  const TraceMeta& m = tr.meta();
  REQUIRE(m.Validate().ok());
  REQUIRE(m.is_streaming());
  const StreamInfo& s = *m.stream;
  const auto& sc = c.streaming();
  CHECK(s.init_len == sc.init_tokens());
  CHECK(s.tokens_per_frame == sc.rows() * sc.cols());
  CHECK(s.num_frames == sc.num_frames());
  CHECK(m.prefill_length == s.video_end());
  CHECK(m.num_decode_steps == sc.num_questions() * (sc.question_tokens() + sc.answer_tokens()));
  CHECK(m.model.rope_theta == 0);
  CHECK(m.HasAllPromptQueries());  // store_video_queries
  REQUIRE(static_cast<int>(s.questions.size()) == sc.num_questions());
  CHECK(s.questions.back().time_s == s.frame_time_s.back());
  for (const StreamQuestion& q : s.questions) {
    REQUIRE_FALSE(q.evidence_frames.empty());
    CHECK(static_cast<int>(q.evidence_frames.size()) <= sc.evidence_frames_max());
    CHECK(q.evidence_frames.back() < q.frames_before);
    CHECK(s.frame_time_s[q.evidence_frames.back()] <= q.time_s);
    for (size_t e = 1; e < q.evidence_frames.size(); ++e)
      CHECK(q.evidence_frames[e] == q.evidence_frames[e - 1] + 1);  // contiguous run
    // Position ids continue from init_len + frames_before * P.
    CHECK(m.tokens.position_id[q.token_begin] == s.init_len + q.frames_before * s.tokens_per_frame);
  }
  REQUIRE(s.block_encodings.size() == 3);
  CHECK(s.block_encodings[0].granularity == 4);
  CHECK(s.block_encodings[2].num_blocks == 384 / 64);
  CHECK(s.block_encodings[0].attention_layers.size() == 4u);

  // Without store_video_queries: only question/answer queries, attention at the last layer only.
  synth::SynthConfig c2 = c;
  c2.mutable_streaming()->set_store_video_queries(false);
  c2.mutable_streaming()->clear_granularities();
  auto meta2 = BuildSynthMeta(c2);
  REQUIRE(meta2.ok());
  CHECK(meta2->query_positions.front() == meta2->prefill_length);
  CHECK(meta2->stream->block_encodings.size() == 2);  // defaults 49, 196 (784 > 384 video tokens)
  CHECK(meta2->stream->block_encodings[0].attention_layers == std::vector<int32_t>{3});
}

TEST_CASE("streaming synth: answer queries concentrate on the evidence frames", "[synth][streaming]") {
  MemoryTrace tr = Generate(TinyConfig());
  const TraceMeta& m = tr.meta();
  const StreamInfo& s = *m.stream;
  const int d = m.model.head_dim, t = m.total_tokens(), tq = static_cast<int>(m.query_positions.size());
  for (size_t qi = 0; qi < s.questions.size(); ++qi) {
    const StreamQuestion& q = s.questions[qi];
    // Full-history attention of every answer query: init, the frames before the question, its own tokens.
    double ev_mass = 0, ev_per_token = 0, other_per_token = 0;
    int rows = 0;
    for (int l = 0; l < m.model.num_layers; ++l) {
      const LayerData& ld = tr.layers()[l];
      for (int h = 0; h < m.model.num_heads; ++h) {
        const float* keys = ld.keys.data() + static_cast<size_t>(h / m.model.GroupSize()) * t * d;
        for (int a = 0; a < q.num_answer_tokens; ++a) {
          const int pos = q.token_begin + q.num_question_tokens + a;
          const float* qv = ld.queries.data() + (static_cast<size_t>(h) * tq + m.QueryIndex(pos)) * d;
          std::vector<int> vis;
          for (int j = 0; j < s.init_len + q.frames_before * s.tokens_per_frame; ++j) vis.push_back(j);
          for (int j = q.token_begin; j <= pos; ++j) vis.push_back(j);
          std::vector<float> logit(vis.size());
          for (size_t x = 0; x < vis.size(); ++x)
            logit[x] = static_cast<float>(m.model.softmax_scale) *
                       Dot(qv, keys + static_cast<size_t>(vis[x]) * d, d);
          SoftmaxInPlace(logit.data(), static_cast<int>(logit.size()));
          double ev = 0, other = 0;
          int n_ev = 0, n_other = 0;
          for (size_t x = 0; x < vis.size(); ++x) {
            const int j = vis[x];
            if (j < s.video_begin() || j >= s.video_end()) continue;
            const int f = (j - s.video_begin()) / s.tokens_per_frame;
            const bool is_ev = std::binary_search(q.evidence_frames.begin(), q.evidence_frames.end(), f);
            (is_ev ? ev : other) += logit[x];
            ++(is_ev ? n_ev : n_other);
          }
          ev_mass += ev;
          ev_per_token += ev / n_ev;
          other_per_token += other / std::max(1, n_other);
          ++rows;
        }
      }
    }
    INFO("question " << qi << ": evidence mass " << ev_mass / rows << ", per token evidence "
                     << ev_per_token / rows << " vs other " << other_per_token / rows);
    CHECK(ev_mass / rows > 0.15);
    CHECK(ev_per_token > 2.0 * other_per_token);
  }
}

TEST_CASE("streaming synth: block encodings and attention_received", "[synth][streaming]") {
  synth::SynthConfig c = TinyConfig();
  MemoryTrace tr = Generate(c);
  const TraceMeta& m = tr.meta();
  const StreamInfo& s = *m.stream;
  const int d = m.model.head_dim, t = m.total_tokens();
  for (size_t gi = 0; gi < s.block_encodings.size(); ++gi) {
    const BlockEncodingInfo& info = s.block_encodings[gi];
    const int g = info.granularity, bg = info.num_blocks * g;
    for (int l = 0; l < m.model.num_layers; ++l) {
      BlockLayerData b;
      REQUIRE(tr.ReadBlockLayer(g, l, &b).ok());
      const LayerData& ld = tr.layers()[l];
      // The continuous run mixes in the previous W video tokens, a block encoding only its own earlier
      // tokens (within W): they agree exactly for block 0 (the video's start) and where the window fits
      // inside the block (offset >= W), and differ elsewhere.
      const int w = c.streaming().context_window_tokens();
      int mismatches = 0;
      for (int kv = 0; kv < m.model.num_kv_heads; ++kv)
        for (int j = 0; j < bg; ++j) {
          const float* cont = ld.keys.data() + (static_cast<size_t>(kv) * t + info.token_positions[j]) * d;
          const float* blk = b.keys.data() + (static_cast<size_t>(kv) * bg + j) * d;
          const bool same_context = j < g || j % g >= w;
          mismatches += std::equal(cont, cont + d, blk) != same_context;
        }
      CHECK(mismatches == 0);
      // attention_received: per block and head, sum over its G queries of (1 - init share) in (0, G].
      REQUIRE(b.attention_received.size() == static_cast<size_t>(m.model.num_heads) * bg);
      for (int h = 0; h < m.model.num_heads; ++h)
        for (int blk = 0; blk < info.num_blocks; ++blk) {
          double sum = 0;
          for (int j = 0; j < g; ++j) {
            const float a = b.attention_received[static_cast<size_t>(h) * bg + blk * g + j];
            CHECK(a >= 0);
            sum += a;
          }
          CHECK(sum > 0);
          CHECK(sum <= g + 1e-3);
        }
    }
  }
  // Without context mixing, block encodings are the continuous run's keys.
  c.mutable_streaming()->set_context_mix(0);
  MemoryTrace flat = Generate(c);
  const BlockEncodingInfo& info = flat.meta().stream->block_encodings[1];
  BlockLayerData b;
  REQUIRE(flat.ReadBlockLayer(info.granularity, 2, &b).ok());
  const LayerData& ld = flat.layers()[2];
  const int bg = info.num_blocks * info.granularity;
  for (int kv = 0; kv < m.model.num_kv_heads; ++kv)
    for (int j = 0; j < bg; ++j) {
      const float* cont = ld.keys.data() + (static_cast<size_t>(kv) * t + info.token_positions[j]) * d;
      REQUIRE(std::equal(cont, cont + d, b.keys.data() + (static_cast<size_t>(kv) * bg + j) * d));
    }
}

TEST_CASE("streaming synth: config errors name the field", "[synth][streaming]") {
  auto text = [](const std::string& model_extra, const std::string& stream_extra) {
    return "model { num_layers: 2 num_heads: 2 num_kv_heads: 1 head_dim: 16 " + model_extra +
           " }\nstreaming { num_frames: 6 rows: 2 cols: 2 num_questions: 1 init_tokens: 4 num_sinks: 1 " +
           stream_extra + " }\n";
  };
  auto ok = ParseSynthConfig(text("rope_theta: 0", "granularities: [2]"), "cfg");
  INFO(ok.status().message());
  REQUIRE(ok.ok());
  auto bad = ParseSynthConfig(text("rope_theta: 10000", ""), "cfg");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("model.rope_theta") != std::string::npos);
  CHECK(bad.status().message().find("no RoPE") != std::string::npos);
  bad = ParseSynthConfig(text("rope_theta: 0", "granularities: [2, 1]"), "cfg");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("streaming.granularities") != std::string::npos);
  bad = ParseSynthConfig(text("rope_theta: 0", "evidence_attention_mass: 0.9"), "cfg");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("sink_attention_mass") != std::string::npos);
  // A one-frame question still gets evidence (the age rule relaxes).
  synth::SynthConfig c = *ok;
  c.mutable_streaming()->set_num_frames(1);
  c.mutable_streaming()->clear_granularities();
  c.mutable_streaming()->add_granularities(4);
  MemoryTrace tr = Generate(c, 1);
  CHECK(tr.meta().stream->questions[0].evidence_frames == std::vector<int32_t>{0});
}

}  // namespace kvsim
