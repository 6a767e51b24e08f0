#include "sim/trace.h"

#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <random>

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

TEST_CASE("QueryRows: ranges merge; a layer read with some rows refuses the others", "[trace]") {
  QueryRows r = QueryRows::None();
  CHECK_FALSE(r.all());
  CHECK(r.Text() == "none");
  r.Add(10, 12);
  r.Add(3, 5);
  r.Add(5, 7);    // adjacent: merged
  r.Add(11, 20);  // overlapping: merged
  r.Add(8, 8);    // empty: ignored
  CHECK(r.Text() == "[3, 7) [10, 20)");
  CHECK(r.Contains(3, 7));
  CHECK(r.Contains(12, 20));
  CHECK(r.Contains(9, 9));  // empty range
  CHECK_FALSE(r.Contains(6, 11));
  CHECK_FALSE(r.Contains(2, 3));
  CHECK(r.Count(15) == 4 + 5);
  CHECK(r.Ranges(15) == std::vector<std::pair<int32_t, int32_t>>{{3, 7}, {10, 15}});
  QueryRows all;
  all.Add(1, 2);
  CHECK(all.all());
  CHECK(all.Contains(0, 1 << 30));

  MemoryTrace tr = testing::MakeTinyTrace();
  const TraceMeta& meta = tr.meta();
  const int32_t tq = static_cast<int32_t>(meta.query_positions.size());
  QueryRows some = QueryRows::None();
  some.Add(tq - 6, tq);
  LayerData ld;
  REQUIRE(tr.ReadLayer(1, &ld, LayerReadOptions{.query_rows = some}).ok());
  CHECK(ld.query_rows == some);
  CHECK(ld.QueryRow(meta, 1, tq - 1)[0] == tr.layers()[1].queries[(static_cast<size_t>(tq) + tq - 1) * 8]);
  // Rows that were not read hold no checked data: a NaN there passes validation, one in a read row fails.
  ld.queries[0] = std::nanf("");
  CHECK(ValidateLayer(meta, ld, "x").ok());
  ld.queries[(static_cast<size_t>(tq) + tq - 2) * 8 + 3] = std::nanf("");
  CHECK_FALSE(ValidateLayer(meta, ld, "x").ok());
  // A sink refuses a layer that lacks rows (it would write unspecified values).
  MemoryTrace sink;
  REQUIRE(sink.Begin(meta).ok());
  LayerData l0;
  REQUIRE(tr.ReadLayer(0, &l0, LayerReadOptions{.query_rows = some}).ok());
  const Status refused = sink.WriteLayer(l0);
  CHECK(refused.code() == StatusCode::kInvalidArgument);
  CHECK(refused.message().find("holds only query rows") != std::string::npos);
  // The same layer read into a buffer that held every row of another layer (Replay recycles its two layer
  // buffers): the rows it lacks hold the other layer's values, and are refused the same way.
  LayerData recycled;
  REQUIRE(tr.ReadLayer(0, &recycled).ok());
  REQUIRE(tr.ReadLayer(1, &recycled, LayerReadOptions{.query_rows = some}).ok());
  CHECK(recycled.query_rows == some);
  CHECK(recycled.QueryRow(meta, 1, tq - 1)[0] == ld.QueryRow(meta, 1, tq - 1)[0]);
  // Using a row that was not read aborts (a wrong number would be worse): checked in a child process.
  for (const LayerData* layer : {&ld, &recycled})
    for (const int32_t row : {0, tq - 7}) {
      const pid_t pid = ::fork();
      REQUIRE(pid >= 0);
      if (pid == 0) {
        ::freopen("/dev/null", "w", stderr);
        ::freopen("/dev/null", "w", stdout);  // Catch2's handler reports the abort before re-raising it
        (void)layer->QueryRow(meta, 0, row);
        ::_exit(0);  // not reached when the check works
      }
      int wstatus = 0;
      REQUIRE(::waitpid(pid, &wstatus, 0) == pid);
      CHECK(WIFSIGNALED(wstatus));
      CHECK(WTERMSIG(wstatus) == SIGABRT);
    }
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

namespace {
// A hand-made streaming trace: init 3, 4 frames of 4 tokens at 1 fps, 2 questions (2 question + 2 answer
// tokens), block encodings at G = 4 and 8 with attention at the last layer.
MemoryTrace MakeTinyStream(bool video_queries = false) {
  TraceMeta m;
  m.model.name = "tiny-stream";
  m.model.num_layers = 2;
  m.model.num_heads = 2;
  m.model.num_kv_heads = 1;
  m.model.head_dim = 4;
  m.model.softmax_scale = 0.5;
  m.model.rope_theta = 0;
  StreamInfo s;
  s.fps = 1;
  s.init_len = 3;
  s.tokens_per_frame = 4;
  s.num_frames = 4;
  s.frame_time_s = {0, 1, 2, 3};
  StreamQuestion q0{1.5, 19, 2, 2, 2, {0}};
  StreamQuestion q1{3, 23, 2, 2, 4, {1, 2}};
  s.questions = {q0, q1};
  for (int g : {4, 8}) {
    BlockEncodingInfo b;
    b.granularity = g;
    b.num_blocks = 16 / g;
    for (int j = 0; j < 16; ++j) b.token_positions.push_back(3 + j);
    b.attention_layers = {1};
    s.block_encodings.push_back(b);
  }
  m.prefill_length = 19;
  m.num_decode_steps = 8;
  m.tokens.Resize(27);
  for (int i = 0; i < 27; ++i) {
    m.tokens.position_id[i] = i;
    if (i < 3) m.tokens.role[i] = Role::kSystem;
    if (i >= 3 && i < 19) {
      m.tokens.modality[i] = Modality::kVideo;
      m.tokens.segment_id[i] = (i - 3) / 4;
    }
    if (i >= 19) {
      const bool q = (i - 19) % 4 < 2;
      m.tokens.role[i] = q ? Role::kQuestion : Role::kGenerated;
      m.tokens.phase[i] = q ? Phase::kPrefill : Phase::kDecode;
    }
    if (i >= 19 || (video_queries && i >= 3)) m.query_positions.push_back(i);
  }
  m.stream = s;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<LayerData> layers(2);
  for (int l = 0; l < 2; ++l) {
    LayerData& ld = layers[l];
    ld.layer = l;
    ld.keys.resize(27 * 4);
    ld.values.resize(27 * 4);
    ld.queries.resize(2 * m.query_positions.size() * 4);
    for (float& x : ld.keys) x = nd(rng);
    for (float& x : ld.values) x = nd(rng);
    for (float& x : ld.queries) x = nd(rng);
    for (int g : {4, 8}) {
      BlockLayerData b;
      b.granularity = g;
      b.keys.resize(16 * 4);
      b.values.resize(16 * 4);
      for (float& x : b.keys) x = nd(rng);
      for (float& x : b.values) x = nd(rng);
      if (l == 1) b.attention_received.assign(2 * 16, 0.25f);
      ld.blocks.push_back(b);
    }
  }
  return MemoryTrace(std::move(m), std::move(layers));
}

void ExpectBad(const TraceMeta& m, const std::string& field, const std::string& text = "") {
  Status st = m.Validate();
  INFO(field << ": " << st.message());
  REQUIRE_FALSE(st.ok());
  CHECK(st.message().find(field) != std::string::npos);
  if (!text.empty()) CHECK(st.message().find(text) != std::string::npos);
  CHECK(st.message().find('\n') == std::string::npos);
}
}  // namespace

TEST_CASE("streaming traces: Validate, FramesBefore, ReadBlockLayer", "[trace][streaming]") {
  MemoryTrace tr = MakeTinyStream();
  REQUIRE(tr.meta().Validate().ok());
  REQUIRE(MakeTinyStream(true).meta().Validate().ok());
  CHECK(tr.meta().is_streaming());
  const StreamInfo& s = *tr.meta().stream;
  CHECK(FramesBefore(s, -1) == 0);
  CHECK(FramesBefore(s, 0) == 1);
  CHECK(FramesBefore(s, 2.5) == 3);
  CHECK(FramesBefore(s, 10) == 4);
  CHECK(s.FindBlocks(8) != nullptr);
  CHECK(s.FindBlocks(5) == nullptr);

  BlockLayerData b;
  REQUIRE(tr.ReadBlockLayer(8, 1, &b).ok());
  CHECK(b.attention_received.size() == 32);
  REQUIRE(tr.ReadBlockLayer(4, 0, &b).ok());
  CHECK(b.attention_received.empty());
  Status st = tr.ReadBlockLayer(16, 0, &b);
  REQUIRE_FALSE(st.ok());
  CHECK(st.message().find("no block encodings for granularity 16") != std::string::npos);
  LayerData ld;
  REQUIRE(tr.ReadLayer(1, &ld).ok());
  CHECK(ld.blocks.empty());

  // Writing through the sink validates the blocks.
  MemoryTrace sink;
  REQUIRE(sink.Begin(tr.meta()).ok());
  LayerData l0 = tr.layers()[0];
  REQUIRE(sink.WriteLayer(l0).ok());
  LayerData l1 = tr.layers()[1];
  l1.blocks[1].attention_received.clear();  // last layer must carry attention_received
  st = sink.WriteLayer(l1);
  REQUIRE_FALSE(st.ok());
  CHECK(st.message().find("attention_received") != std::string::npos);
  l1 = tr.layers()[1];
  l1.blocks.pop_back();
  CHECK_FALSE(sink.WriteLayer(l1).ok());
  REQUIRE(sink.WriteLayer(tr.layers()[1]).ok());
  REQUIRE(sink.ReadBlockLayer(4, 1, &b).ok());
}

TEST_CASE("streaming traces: Validate names the bad field", "[trace][streaming]") {
  const TraceMeta good = MakeTinyStream().meta();
  TraceMeta m = good;
  std::swap(m.stream->questions[0].time_s, m.stream->questions[1].time_s);
  std::swap(m.stream->questions[0].frames_before, m.stream->questions[1].frames_before);
  ExpectBad(m, "streaming/questions/time_s", "sorted by time");
  m = good;
  m.stream->questions[0].time_s = -0.5;
  m.stream->questions[0].frames_before = 0;
  ExpectBad(m, "streaming/questions/time_s", "before the first frame");
  m = good;
  m.stream->questions[0].evidence_frames = {2};
  ExpectBad(m, "streaming/questions/evidence_frames");
  m = good;
  m.stream->questions[1].evidence_frames = {2, 1};
  ExpectBad(m, "streaming/questions/evidence_frames", "ascending");
  m = good;
  m.stream->questions[1].frames_before = 3;
  ExpectBad(m, "streaming/questions/frames_before");
  m = good;
  m.stream->frame_time_s[2] = 0.5;
  ExpectBad(m, "streaming/frame_time_s", "non-decreasing");
  m = good;
  m.stream->frame_time_s[2] = NAN;
  ExpectBad(m, "streaming/frame_time_s");
  m = good;
  m.stream->questions[1].token_begin = 24;
  ExpectBad(m, "streaming/questions/token_begin");
  m = good;
  m.tokens.segment_id[8] = 0;
  ExpectBad(m, "tokens/segment_id");
  m = good;
  m.tokens.modality[8] = Modality::kImage;
  ExpectBad(m, "tokens/modality");
  m = good;
  m.tokens.role[20] = Role::kGenerated;
  ExpectBad(m, "tokens/role");
  m = good;
  m.tokens.phase[21] = Phase::kPrefill;
  ExpectBad(m, "tokens/phase");
  m = good;
  m.stream->num_frames = 3;
  ExpectBad(m, "prefill_length");
  m = good;
  m.stream->questions.clear();
  ExpectBad(m, "streaming/questions");
  m = good;
  m.stream->questions[1].num_answer_tokens = 1;
  ExpectBad(m, "streaming/questions");
  m = good;
  m.query_positions.erase(m.query_positions.begin() + 1);
  ExpectBad(m, "query_positions");
  m = good;
  m.query_positions.insert(m.query_positions.begin(), 18);
  ExpectBad(m, "query_positions", "video");
  m = good;
  m.stream->block_encodings[0].attention_layers = {0};
  ExpectBad(m, "streaming_blocks/attention_layers", "last layer");
  m = good;
  m.stream->block_encodings[1].num_blocks = 1;
  ExpectBad(m, "streaming_blocks/num_blocks");
  m = good;
  m.stream->block_encodings[0].token_positions[3] = 19;
  ExpectBad(m, "streaming_blocks/token_positions");
  m = good;
  std::swap(m.stream->block_encodings[0], m.stream->block_encodings[1]);
  ExpectBad(m, "streaming_blocks/granularities");
  // A non-streaming source has no block encodings.
  MemoryTrace plain = testing::MakeTinyTrace();
  BlockLayerData b;
  Status st = plain.ReadBlockLayer(4, 0, &b);
  REQUIRE_FALSE(st.ok());
  CHECK(st.message().find("no block encodings for granularity 4") != std::string::npos);
}

}  // namespace kvsim
