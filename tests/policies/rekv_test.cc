// ReKV (policies/rekv.h): per-layer frame scores (mean pre-RoPE question query x mean pre-RoPE frame key,
// summed over query heads; dot product or cosine) on a tiny hand-made streaming trace, top-k in temporal
// order, and the policy end to end through the registry and the streaming engine (retrieved frames,
// evidence recall, no frame after the question, CPU bank bytes).

#include "policies/rekv.h"

#include <catch2/catch.hpp>
#include <cmath>

#include "policies/stream_registry.h"
#include "sim/stream_replay.h"
#include "tests/sim/stream_test_util.h"

namespace kvsim {

namespace {

using testing::MakeTinyStreamTrace;
using testing::TinyStreamSpec;

// 2 layers, 2 query heads sharing 1 KV head, head_dim 2, init 2 tokens, 4 frames of 2 tokens (video tokens
// 2..9, frame f = tokens 2+2f, 3+2f, arriving at t = f s), questions at 2.5 s (frames_before 3, tokens 10-11,
// answer 12) and 3.5 s (frames_before 4, tokens 13-14, answer 15). rope_theta 0: stored = pre-RoPE.
TinyStreamSpec HandSpec() {
  TinyStreamSpec s;
  s.num_layers = 2;
  s.num_heads = 2;
  s.num_kv_heads = 1;
  s.head_dim = 2;
  s.init_len = 2;
  s.tokens_per_frame = 2;
  s.num_frames = 4;
  s.question_times = {2.5, 3.5};
  s.evidence = {{2}, {3}};
  s.question_tokens = 2;
  s.answer_tokens = 1;
  s.rope_theta = 0;
  return s;
}

void SetKey(MemoryTrace& tr, int layer, int pos, float a, float b) {
  float* k = tr.layers()[layer].keys.data() + pos * 2;  // KV head 0 (layout [Hkv][T][d])
  k[0] = a;
  k[1] = b;
}
void SetQuery(MemoryTrace& tr, int layer, int qh, int pos, float a, float b) {
  const int64_t tq = static_cast<int64_t>(tr.meta().query_positions.size());
  float* q = tr.layers()[layer].queries.data() + (qh * tq + tr.meta().QueryIndex(pos)) * 2;
  q[0] = a;
  q[1] = b;
}

// Frame keys at both layers (two tokens each; the mean is what ReKV uses):
//   f0: [1,0],[1,2] -> [1,1]   f1: [2,0],[0,0] -> [1,0]   f2: [0,3],[0,1] -> [0,2]   f3: [3,4],[3,4] -> [3,4]
// Question queries (both questions): head 0: [1,0],[1,0] -> q̄0 = [1,0];
//   layer 0, head 1: [0,1],[0,3] -> q̄1 = [0,2];   layer 1, head 1: [0,-1],[0,-3] -> q̄1 = [0,-2].
// DOT, layer 0: f0 1+2 = 3, f1 1+0 = 1, f2 0+4 = 4, f3 3+8 = 11.
// DOT, layer 1: f0 1-2 = -1, f1 1, f2 0-4 = -4, f3 3-8 = -5.
// COSINE, layer 0: f0 .70711+.70711 = 1.41421, f1 1+0 = 1, f2 0+1 = 1, f3 .6+.8 = 1.4.
// COSINE, layer 1: f0 .70711-.70711 = 0, f1 1, f2 -1, f3 .6-.8 = -.2.
testing::TinyStream HandTrace() {
  testing::TinyStream ts = MakeTinyStreamTrace(HandSpec());
  MemoryTrace& tr = ts.trace;
  const float frames[4][2][2] = {{{1, 0}, {1, 2}}, {{2, 0}, {0, 0}}, {{0, 3}, {0, 1}}, {{3, 4}, {3, 4}}};
  for (int l = 0; l < 2; ++l) {
    for (int f = 0; f < 4; ++f)
      for (int j = 0; j < 2; ++j) SetKey(tr, l, 2 + 2 * f + j, frames[f][j][0], frames[f][j][1]);
    const float sign = l == 0 ? 1.0f : -1.0f;
    for (const StreamQuestion& q : tr.meta().stream->questions) {
      SetQuery(tr, l, 0, q.token_begin, 1, 0);
      SetQuery(tr, l, 0, q.token_begin + 1, 1, 0);
      SetQuery(tr, l, 1, q.token_begin, 0, sign * 1);
      SetQuery(tr, l, 1, q.token_begin + 1, 0, sign * 3);
    }
  }
  REQUIRE(tr.meta().Validate().ok());
  return ts;
}

void CheckScores(const std::vector<float>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("frame " << i);
    CHECK(got[i] == Approx(want[i]).margin(1e-5));
  }
}

std::shared_ptr<const StreamPolicy> Make(std::vector<std::string> sets = {}) {
  auto p = StreamPolicyRegistry::Default().Create("rekv", sets);
  REQUIRE(p.ok());
  return *p;
}

}  // namespace

TEST_CASE("rekv: frame scores, DOT vs COSINE, per layer", "[rekv]") {
  auto ts = HandTrace();
  const TraceMeta& meta = ts.trace.meta();
  const auto& layers = ts.trace.layers();
  CHECK(meta.stream->questions[0].frames_before == 3);
  CHECK(meta.stream->questions[1].frames_before == 4);
  CheckScores(ReKVFrameScores(meta, layers[0], 0, 3, false), {3, 1, 4});
  CheckScores(ReKVFrameScores(meta, layers[0], 1, 4, false), {3, 1, 4, 11});
  CheckScores(ReKVFrameScores(meta, layers[1], 0, 4, false), {-1, 1, -4, -5});
  CheckScores(ReKVFrameScores(meta, layers[0], 0, 4, true), {std::sqrt(2.0), 1, 1, 1.4});
  CheckScores(ReKVFrameScores(meta, layers[1], 1, 4, true), {0, 1, -1, -0.2});
}

TEST_CASE("rekv: frame scores undo RoPE (same scores as the pre-RoPE trace)", "[rekv]") {
  // Same seed -> same pre-RoPE vectors; with rope_theta > 0 the stored K/Q are rotated by their position ids
  // (question tokens are not at their trace index), and ReKV rotates them back.
  TinyStreamSpec a;
  a.rope_theta = 0;
  TinyStreamSpec b = a;
  b.rope_theta = 10000;
  auto ta = MakeTinyStreamTrace(a), tb = MakeTinyStreamTrace(b);
  for (int l = 0; l < a.num_layers; ++l)
    for (int q = 0; q < 2; ++q) {
      const int fb = ta.trace.meta().stream->questions[q].frames_before;
      for (bool cosine : {false, true}) {
        const auto sa = ReKVFrameScores(ta.trace.meta(), ta.trace.layers()[l], q, fb, cosine);
        const auto sb = ReKVFrameScores(tb.trace.meta(), tb.trace.layers()[l], q, fb, cosine);
        REQUIRE(sa.size() == sb.size());
        for (size_t f = 0; f < sa.size(); ++f) CHECK(sb[f] == Approx(sa[f]).margin(1e-3));
      }
    }
  // And the rotation matters: the stored (rotated) vectors alone would score differently.
  TinyStreamSpec c = b;
  auto tc = MakeTinyStreamTrace(c);
  tc.trace.mutable_meta().model.rope_theta = 0;  // pretend no RoPE: the rotated vectors are used as they are
  const int fb = tc.trace.meta().stream->questions[1].frames_before;
  const auto sa = ReKVFrameScores(ta.trace.meta(), ta.trace.layers()[0], 1, fb, false);
  const auto sc = ReKVFrameScores(tc.trace.meta(), tc.trace.layers()[0], 1, fb, false);
  double diff = 0;
  for (size_t f = 0; f < sa.size(); ++f) diff += std::fabs(sa[f] - sc[f]);
  CHECK(diff > 1e-2);
}

TEST_CASE("rekv: ReKVSelect is top-k by score, returned in temporal order", "[rekv]") {
  const std::vector<float> s{3, 1, 4};
  CHECK(ReKVSelect(s, 2) == std::vector<int32_t>{0, 2});  // best is frame 2, but the order is temporal
  CHECK(ReKVSelect(s, 1) == std::vector<int32_t>{2});
  CHECK(ReKVSelect(s, 5) == std::vector<int32_t>{0, 1, 2});
  const std::vector<float> tie{1, 2, 2, 1};
  CHECK(ReKVSelect(tie, 1) == std::vector<int32_t>{1});  // ties: earlier frame
  CHECK(ReKVSelect(tie, 3) == std::vector<int32_t>{0, 1, 2});
  const std::vector<float> cos{1.41421f, 1, 1, 1.4f};
  CHECK(ReKVSelect(cos, 2) == std::vector<int32_t>{0, 3});
}

TEST_CASE("rekv: SelectAtLayer uses only available frames; positions re-indexed", "[rekv]") {
  auto ts = HandTrace();
  const TraceMeta& meta = ts.trace.meta();
  auto policy = Make();
  CHECK(policy->name() == "rekv");
  CHECK(policy->DefaultBudgetTokens(meta) == 64 * 2);  // default_frames 64 x P
  CHECK(Make({"default_frames=3"})->DefaultBudgetTokens(meta) == 6);
  StreamPlanInput pin;
  pin.meta = &meta;
  pin.budget_tokens = 4;
  auto plan = policy->Plan(pin);  // ReKV's plan reads no layer
  REQUIRE(plan.ok());
  REQUIRE((*plan)->bank.size() == 4);
  StreamLayerInput in;
  in.meta = &meta;
  in.layer = 0;
  in.stream = &ts.trace.layers()[0];
  in.budget_tokens = 4;  // k = floor(4 / 2) = 2 frames
  const std::vector<uint8_t> q0_avail{1, 1, 1, 0}, q1_avail{1, 1, 1, 1};
  ContextSelection sel;
  in.available = q0_avail;
  REQUIRE(policy->SelectAtLayer(in, **plan, 0, &sel).ok());
  // Layer 0, question 0: scores [3, 1, 4] over frames 0..2 (frame 3, score 11, has not arrived) -> {2, 0}.
  REQUIRE(sel.entries.size() == 2);
  CHECK(sel.entries[0].bank_index == 0);
  CHECK(sel.entries[1].bank_index == 2);
  CHECK(sel.entries[0].offsets.empty());
  CHECK(sel.positions == ContextPositions::kReindexed);
  in.available = q1_avail;
  REQUIRE(policy->SelectAtLayer(in, **plan, 1, &sel).ok());  // [3, 1, 4, 11] -> {3, 2} -> 2, 3
  REQUIRE(sel.entries.size() == 2);
  CHECK(sel.entries[0].bank_index == 2);
  CHECK(sel.entries[1].bank_index == 3);
  in.budget_tokens = 5;  // floor(5 / 2) = 2 still
  REQUIRE(policy->SelectAtLayer(in, **plan, 1, &sel).ok());
  CHECK(sel.entries.size() == 2);
  in.budget_tokens = 1;  // at least one frame
  REQUIRE(policy->SelectAtLayer(in, **plan, 1, &sel).ok());
  REQUIRE(sel.entries.size() == 1);
  CHECK(sel.entries[0].bank_index == 3);
  // positions=AS_ENCODED keeps the encoded positions.
  auto as_encoded = Make({"positions=AS_ENCODED"});
  in.budget_tokens = 4;
  REQUIRE(as_encoded->SelectAtLayer(in, **plan, 1, &sel).ok());
  CHECK(sel.positions == ContextPositions::kAsEncoded);
}

TEST_CASE("rekv: end to end through the registry and the streaming engine", "[rekv]") {
  auto ts = HandTrace();
  const std::vector<StreamRunSpec> runs{{Make(), "dot", 4}, {Make({"score=COSINE"}), "cos", 4}};
  StreamReplayOptions opt;
  opt.threads = 1;
  auto res = ReplayStream(ts.trace, runs, opt);
  REQUIRE(res.ok());
  REQUIRE(res->size() == 2);
  const StreamRunResult& dot = (*res)[0];
  const StreamRunResult& cos = (*res)[1];
  REQUIRE(dot.questions_size() == 2);
  CHECK(dot.budget_tokens() == 4);
  CHECK_FALSE(dot.approximate());
  // DOT: layer 0 q0 {0, 2}, q1 {2, 3}; layer 1 (q̄1 = [0,-2]) q0 {0, 1}, q1 {0, 1}.
  // Evidence q0 = {2}: hit at layer 0 only -> .5; q1 = {3}: layer 0 only -> .5. Token recall: 2 of 2 tokens
  // at one layer of two -> .5.
  for (int q = 0; q < 2; ++q) {
    INFO("question " << q);
    const StreamQuestionResult& r = dot.questions(q);
    CHECK(r.frames_covered() == Approx(2));
    CHECK(r.visual_tokens_in_context() == Approx(4));
    CHECK(r.context_tokens() == Approx(2 + 4 + 2 + 1));  // init + 2 frames + question + answer
    CHECK(r.evidence_frame_recall() == Approx(0.5));
    CHECK(r.evidence_token_recall() == Approx(0.5));
    CHECK(r.duplicate_tokens() == 0);
    CHECK(FindStreamStat(r.policy_stats(), "encoder_window_exceeded") ==
          0);  // 8 video tokens < n_local 15000
  }
  CHECK(dot.mean().evidence_frame_recall() == Approx(0.5));
  // COSINE: layer 0 q0 [1.414, 1, 1] -> {0, 1}; q1 [1.414, 1, 1, 1.4] -> {0, 3}; layer 1 q0 [0, 1, -1] ->
  // {0, 1}; q1 [0, 1, -1, -.2] -> {0, 1}. Evidence: q0 never (0); q1 at layer 0 only (.5).
  CHECK(cos.questions(0).evidence_frame_recall() == Approx(0));
  CHECK(cos.questions(1).evidence_frame_recall() == Approx(0.5));
  CHECK(cos.questions(0).frames_covered() == Approx(2));
  // A budget of 2 frames never covers more, and the question at 2.5 s never sees frame 3: with k = 4 the
  // first question still covers only its 3 frames.
  const std::vector<StreamRunSpec> wide{{Make(), "k4", 8}};
  auto res4 = ReplayStream(ts.trace, wide, opt);
  REQUIRE(res4.ok());
  CHECK((*res4)[0].questions(0).frames_covered() == Approx(3));
  CHECK((*res4)[0].questions(0).visual_tokens_in_context() == Approx(6));
  CHECK((*res4)[0].questions(1).frames_covered() == Approx(4));
  CHECK((*res4)[0].questions(0).evidence_frame_recall() == Approx(1));
}

TEST_CASE("rekv: CPU bank bytes = F*P*bytes_per_token + F*L*Hkv*d*dtype (mean keys)", "[rekv]") {
  auto ts = HandTrace();
  const TraceMeta& meta = ts.trace.meta();
  // float16: KvBytesPerToken = 2 (K,V) * L 2 * Hkv 1 * d 2 * 2 bytes = 16; a frame's mean keys: 2*1*2*2 = 8.
  REQUIRE(KvBytesPerToken(meta) == 16);
  const std::vector<StreamRunSpec> runs{{Make(), "", 4}};
  StreamReplayOptions opt;
  opt.threads = 1;
  auto res = ReplayStream(ts.trace, runs, opt);
  REQUIRE(res.ok());
  const StreamRunResult& r = (*res)[0];
  CHECK(r.cpu_bank_bytes_final() == Approx(4 * 2 * 16 + 4 * 8));  // 160
  CHECK(r.cpu_bank_tokens_final() == Approx(8));
  CHECK(r.bank_tokens_per_frame() == Approx(2));
  // Token steps: encoding is instantaneous, so question 0 (2.5 s) sees 3 encoded frames: 3*2*16 + 3*8.
  CHECK(r.questions(0).cpu_bank_bytes_at_answer() == Approx(120));
  CHECK(r.questions(1).cpu_bank_bytes_at_answer() == Approx(160));
  CHECK(r.encode_passes_per_video_token() == Approx(1));
}

// GPU while a question is answered: what stays resident (init + local window) plus the retrieved frames and
// the question and answer, loaded on top (the init prompt counted once).
TEST_CASE("rekv: GPU bytes while answering count the init prompt once", "[rekv]") {
  auto ts = HandTrace();
  const std::vector<StreamRunSpec> runs{{Make(), "", 4}};
  StreamReplayOptions opt;
  opt.threads = 1;
  auto res = ReplayStream(ts.trace, runs, opt);
  REQUIRE(res.ok());
  const StreamRunResult& r = (*res)[0];
  // Question 0 at 2.5 s: resident = (init 2 + local window min(6, 15000)) * 16 = 128; loaded for the
  // question: 2 retrieved frames (4 tokens) + 2 question + 1 answer tokens = 7 * 16 = 112 -> 240.
  CHECK(r.questions(0).gpu_bytes_at_answer() == Approx(240));
  // Question 1 at 3.5 s: (2 + 8) * 16 + 7 * 16 = 272, the peak.
  CHECK(r.questions(1).gpu_bytes_at_answer() == Approx(272));
  CHECK(r.gpu_bytes_peak() == Approx(272));
}

TEST_CASE("rekv: encoder_window_exceeded and parameter validation", "[rekv]") {
  auto ts = HandTrace();
  const std::vector<StreamRunSpec> runs{{Make({"n_local=4"}), "", 4}};  // 8 video tokens > 4
  StreamReplayOptions opt;
  opt.threads = 1;
  auto res = ReplayStream(ts.trace, runs, opt);
  REQUIRE(res.ok());
  CHECK(FindStreamStat((*res)[0].questions(0).policy_stats(), "encoder_window_exceeded") == 1);
  auto bad = StreamPolicyRegistry::Default().Create("rekv", std::vector<std::string>{"n_local=-1"});
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == StatusCode::kInvalidArgument);
  CHECK(bad.status().message() == "rekv: n_local must be >= 0");
  auto bad2 = StreamPolicyRegistry::Default().Create("rekv", std::vector<std::string>{"default_frames=0"});
  REQUIRE_FALSE(bad2.ok());
  CHECK(bad2.status().message() == "rekv: default_frames must be >= 1");
}

// The K/V a question retrieves were computed causally, so the continuous run differs from ReKV's
// sliding-window encoder only when the video before *that* question exceeds the window: with n_local = 7,
// question 0 (3 frames = 6 video tokens) fits and question 1 (8 tokens) does not.
TEST_CASE("rekv: encoder_window_exceeded is per question", "[rekv]") {
  auto ts = HandTrace();
  const std::vector<StreamRunSpec> runs{{Make({"n_local=7"}), "", 4}};
  StreamReplayOptions opt;
  opt.threads = 1;
  auto res = ReplayStream(ts.trace, runs, opt);
  REQUIRE(res.ok());
  CHECK(FindStreamStat((*res)[0].questions(1).policy_stats(), "encoder_window_exceeded") == 1);
  CHECK(FindStreamStat((*res)[0].questions(0).policy_stats(), "encoder_window_exceeded") == 0);
}

}  // namespace kvsim
