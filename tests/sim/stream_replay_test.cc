// The streaming engine: event order, memory tiers, timeline, the full-history reference, position handling.
#include "sim/stream_replay.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <mutex>
#include <thread>

#include "policies/rekv.h"
#include "policies/stream_baselines.h"
#include "policies/stream_registry.h"
#include "sim/attention.h"
#include "tests/sim/stream_test_util.h"

namespace kvsim {
namespace {

using testing::MakeTinyStreamTrace;
using testing::TinyStreamSpec;

std::vector<StreamRunResult> RunPolicies(MemoryTrace& trace,
                                         const std::vector<std::pair<std::string, int>>& runs,
                                         int threads = 1, const LatencyModel* latency = nullptr) {
  std::vector<StreamRunSpec> specs;
  for (const auto& [name, budget] : runs) {
    auto p = StreamPolicyRegistry::Default().Create(name);
    REQUIRE(p.ok());
    specs.push_back({*p, name, budget});
  }
  StreamReplayOptions o;
  o.threads = threads;
  o.latency = latency;
  auto r = ReplayStream(trace, specs, o);
  INFO(r.status().message());
  REQUIRE(r.ok());
  return *r;
}

TEST_CASE("CutVideoBlocks drops the tail and finds each block's ready frame", "[stream_replay]") {
  StreamInfo s;
  s.init_len = 4;
  s.tokens_per_frame = 4;
  s.num_frames = 6;                     // 24 video tokens
  const auto b = CutVideoBlocks(s, 5);  // 4 blocks of 5; the last 4 tokens are dropped
  REQUIRE(b.size() == 4);
  CHECK(b[0].first_token == 4);
  CHECK(b[3].first_token == 19);
  // Last video offsets 4, 9, 14, 19 -> frames 1, 2, 3, 4.
  CHECK(b[0].ready_frame == 1);
  CHECK(b[1].ready_frame == 2);
  CHECK(b[2].ready_frame == 3);
  CHECK(b[3].ready_frame == 4);
  CHECK(CutVideoBlocks(s, 24).size() == 1);
  CHECK(CutVideoBlocks(s, 25).empty());
}

TEST_CASE("stream_full reproduces the full history; a question sees only earlier frames", "[stream_replay]") {
  for (double theta : {0.0, 10000.0}) {
    TinyStreamSpec spec;
    spec.rope_theta = theta;
    auto ts = MakeTinyStreamTrace(spec);
    REQUIRE(ts.trace.meta().Validate().ok());
    const auto r = RunPolicies(ts.trace, {{"stream_full", 0}});
    REQUIRE(r[0].questions_size() == 2);
    // q0 at t = 2.5 s: frames 0, 1, 2 (arrivals 0, 1, 2 s); q1 at t = 5 s: all six (frame 5 arrives at 5 s).
    CHECK(r[0].questions(0).frames_before() == 3);
    CHECK(r[0].questions(0).frames_covered() == 3);
    CHECK(r[0].questions(0).visual_tokens_in_context() == 12);
    CHECK(r[0].questions(1).frames_covered() == 6);
    for (const auto& q : r[0].questions()) {
      CHECK(q.retained_mass_mean() == Approx(1.0).epsilon(1e-6));
      CHECK(q.output_rel_error_mean() < 1e-5);
      CHECK(q.oracle_frame_recall() == Approx(1.0));
      CHECK(q.evidence_frame_recall() == Approx(1.0));
    }
  }
}

// A policy that retrieves a block from the future.
class Cheater : public StreamPolicy {
 public:
  std::string name() const override { return "cheater"; }
  std::string ParamsText() const override { return ""; }
  StreamRequirements requirements() const override { return {}; }
  int DefaultBudgetTokens(const TraceMeta&) const override { return 4; }
  StatusOr<std::unique_ptr<StreamPlan>> Plan(const StreamPlanInput& in) const override {
    auto p = std::make_unique<StreamPlan>();
    BuildFrameBank(*in.meta, {}, p.get());
    return p;
  }
  Status SelectAtLayer(const StreamLayerInput& in, const StreamPlan&, int,
                       ContextSelection* out) const override {
    out->entries = {{static_cast<int32_t>(in.available.size()) - 1, {}}};  // the last frame
    return Status::Ok();
  }
};

TEST_CASE("the engine refuses a retrieval of frames that arrive after the question", "[stream_replay]") {
  auto ts = MakeTinyStreamTrace();
  std::vector<StreamRunSpec> runs{{std::make_shared<Cheater>(), "cheater", 0}};
  auto r = ReplayStream(ts.trace, runs, {});
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message().find("not complete before the question") != std::string::npos);
}

TEST_CASE("rekv re-indexes retrieved keys to contiguous positions (RoPE)", "[stream_replay]") {
  TinyStreamSpec spec;
  spec.num_layers = 1;
  spec.num_heads = 1;
  spec.num_kv_heads = 1;
  spec.question_times = {5.0};
  spec.evidence = {{}};
  spec.answer_tokens = 1;
  spec.rope_theta = 100.0;
  auto ts = MakeTinyStreamTrace(spec);
  const TraceMeta& meta = ts.trace.meta();
  const int d = spec.head_dim, t = meta.total_tokens(), P = spec.tokens_per_frame, init = spec.init_len;
  const StreamQuestion& q = meta.stream->questions[0];
  // Expected frame: argmax over frames of (mean pre-RoPE question query) . (mean pre-RoPE frame key).
  const auto& pk = ts.pre_keys[0];
  const auto& pq = ts.pre_queries[0];
  int best = -1;
  double best_score = -1e30;
  for (int f = 0; f < spec.num_frames; ++f) {
    double s = 0;
    for (int x = 0; x < d; ++x) {
      double kq = 0, kk = 0;
      for (int j = 0; j < q.num_question_tokens; ++j) kq += pq[(q.token_begin + j) * d + x];
      for (int j = 0; j < P; ++j) kk += pk[(init + f * P + j) * d + x];
      s += (kq / q.num_question_tokens) * (kk / P);
    }
    if (s > best_score) best_score = s, best = f;
  }
  // Context rows: init, frame `best`, question, answer; positions 0..n-1 (re-indexed).
  std::vector<int> rows;
  for (int j = 0; j < init; ++j) rows.push_back(j);
  for (int j = 0; j < P; ++j) rows.push_back(init + best * P + j);
  for (int j = 0; j < q.num_question_tokens + q.num_answer_tokens; ++j) rows.push_back(q.token_begin + j);
  const int n = static_cast<int>(rows.size());
  std::vector<float> k(n * d), qv(pq.begin() + (q.token_begin + q.num_question_tokens) * d,
                                  pq.begin() + (q.token_begin + q.num_question_tokens + 1) * d);
  for (int i = 0; i < n; ++i) {
    std::copy_n(pk.data() + rows[i] * d, d, k.data() + i * d);
    ApplyRope(k.data() + i * d, d, i, spec.rope_theta);
  }
  ApplyRope(qv.data(), d, n - 1, spec.rope_theta);
  const LayerData& layer = ts.trace.layers()[0];
  std::vector<double> p(n), o(d, 0.0);
  double mx = -1e30, z = 0;
  for (int i = 0; i < n; ++i) {
    double dot = 0;
    for (int x = 0; x < d; ++x) dot += qv[x] * k[i * d + x];
    p[i] = dot * meta.model.softmax_scale;
    mx = std::max(mx, p[i]);
  }
  for (int i = 0; i < n; ++i) z += (p[i] = std::exp(p[i] - mx));
  for (int i = 0; i < n; ++i)
    for (int x = 0; x < d; ++x) o[x] += p[i] / z * layer.values[rows[i] * d + x];
  // Full history: the stored (post-RoPE) vectors at their trace positions.
  const int hist = init + q.frames_before * P;
  std::vector<int> hrows;
  for (int j = 0; j < hist; ++j) hrows.push_back(j);
  for (int j = 0; j < q.num_question_tokens + q.num_answer_tokens; ++j) hrows.push_back(q.token_begin + j);
  const float* qs = layer.queries.data() + (q.token_begin + q.num_question_tokens) * d;
  std::vector<double> ph(hrows.size()), of(d, 0.0);
  mx = -1e30, z = 0;
  for (size_t i = 0; i < hrows.size(); ++i) {
    double dot = 0;
    for (int x = 0; x < d; ++x) dot += qs[x] * layer.keys[hrows[i] * d + x];
    ph[i] = dot * meta.model.softmax_scale;
    mx = std::max(mx, ph[i]);
  }
  for (double& v : ph) z += (v = std::exp(v - mx));
  double retained = 0;
  for (size_t i = 0; i < hrows.size(); ++i) {
    ph[i] /= z;
    for (int x = 0; x < d; ++x) of[x] += ph[i] * layer.values[hrows[i] * d + x];
    const int r = hrows[i];
    if (r < init || r >= q.token_begin || (r >= init + best * P && r < init + (best + 1) * P))
      retained += ph[i];
  }
  double num = 0, den = 0;
  for (int x = 0; x < d; ++x) num += (o[x] - of[x]) * (o[x] - of[x]), den += of[x] * of[x];
  const auto r = RunPolicies(ts.trace, {{"rekv", P}});
  REQUIRE(r[0].questions_size() == 1);
  CHECK(r[0].questions(0).samples() == 1);
  CHECK(r[0].questions(0).frames_covered() == 1);
  CHECK(r[0].questions(0).retained_mass_mean() == Approx(retained).epsilon(1e-4));
  CHECK(r[0].questions(0).output_rel_error_mean() == Approx(std::sqrt(num / den)).epsilon(1e-3));
  (void)t;
}

TEST_CASE("timeline: questions wait for encoding; TTFT and lag from the latency model", "[stream_replay]") {
  auto ts = MakeTinyStreamTrace();
  LatencyModelProto lp;
  lp.set_prefill_us_per_token(300000);  // a 4-token frame takes 1.2 s
  lp.set_decode_base_us(100000);        // 0.1 s per answer step
  auto latency = MakeLinearLatencyModel(lp);
  const auto r = RunPolicies(ts.trace, {{"stream_full", 0}}, 1, latency.get());
  const auto& q0 = r[0].questions(0);
  // Frames 0, 1, 2 encode over [0, 1.2], [1.2, 2.4], [2.4, 3.6]; q0 (2.5 s) starts at 3.6, its 2-token
  // prefill takes 0.6 s and the first step 0.1 s: TTFT = 3.6 + 0.7 - 2.5 = 1.8 s; it ends at 4.4 s.
  CHECK(q0.answer_start_s() == Approx(3.6));
  CHECK(q0.time_to_first_token_s() == Approx(1.8));
  CHECK(q0.answer_end_s() == Approx(4.4));
  // Frames 3, 4, 5 then run [4.4, 5.6], [5.6, 6.8], [6.8, 8.0]; frame 5 arrived at 5 s: lag 3 s. q1 at 8.0.
  CHECK(r[0].encode_lag_max_s() == Approx(3.0));
  CHECK(r[0].questions(1).answer_start_s() == Approx(8.0));
  CHECK(r[0].encode_busy_s() == Approx(6 * 1.2));
  // Token steps: processing takes no video time.
  const auto r2 = RunPolicies(ts.trace, {{"stream_full", 0}});
  CHECK(r2[0].questions(0).answer_start_s() == Approx(2.5));
  CHECK(r2[0].questions(0).time_to_first_token_s() == 0);
  CHECK(r2[0].time_unit() == "token_steps");
}

TEST_CASE("memory tiers: full keeps the history on the GPU, rekv offloads frames to the CPU bank",
          "[stream_replay]") {
  auto ts = MakeTinyStreamTrace();
  const TraceMeta& meta = ts.trace.meta();
  const double bpt = KvBytesPerToken(meta);  // 2 (K, V) * 2 layers * 1 KV head * 8 dims * 2 bytes = 64
  CHECK(bpt == 64);
  const auto r = RunPolicies(ts.trace, {{"stream_full", 0}, {"rekv", 8}, {"stream_recent", 8}});
  // Full: nothing on the CPU (no bank tokens either); GPU peak = init + 24 video + q1's 4 question/answer
  // tokens.
  CHECK(r[0].cpu_bank_bytes_final() == 0);
  CHECK(r[0].cpu_bank_tokens_final() == 0);
  CHECK(r[0].bank_tokens_per_frame() == 0);
  CHECK(r[0].gpu_bytes_peak() == Approx((4 + 24 + 4) * bpt));
  // ReKV: all 24 video tokens + one mean key per frame, layer and KV head (2 * 1 * 8 * 2 bytes = 32).
  CHECK(r[1].cpu_bank_bytes_final() == Approx(24 * bpt + 6 * 32));
  CHECK(r[1].cpu_bank_tokens_final() == Approx(24));
  CHECK(r[1].bank_tokens_per_frame() == Approx(4));
  // ReKV at answer time: resident init + local window (n_local 15000 > 24: all 24) + 2 frames + 4 tokens.
  CHECK(r[1].questions(1).gpu_bytes_at_answer() == Approx((4 + 24 + 8 + 4) * bpt));
  CHECK(r[1].questions(1).visual_tokens_in_context() == 8);
  // Recent window of 2 frames: GPU holds init + 8 video tokens; older frames are dropped, not banked;
  // q0 retrieves frames 1, 2.
  CHECK(r[2].cpu_bank_bytes_final() == 0);
  CHECK(r[2].cpu_bank_tokens_final() == 0);
  CHECK(r[2].bank_tokens_per_frame() == 0);
  CHECK(r[2].questions(0).gpu_bytes_at_answer() == Approx((4 + 8 + 4) * bpt));
  CHECK(r[2].questions(0).evidence_frame_recall() == Approx(1.0));  // evidence frame 1 is in the window
  CHECK(r[2].questions(1).evidence_frame_recall() == Approx(0.5));  // frames 4, 5 of evidence {3, 4}
  // Memory points are in time order.
  for (const auto& run : r)
    for (int i = 1; i < run.memory_size(); ++i) CHECK(run.memory(i).time_s() >= run.memory(i - 1).time_s());
}

TEST_CASE("stream_oracle: hindsight frames maximise the oracle recall", "[stream_replay]") {
  auto ts = MakeTinyStreamTrace();
  const auto r = RunPolicies(ts.trace, {{"stream_oracle", 8}, {"stream_uniform", 8}, {"stream_recent", 8}});
  for (int q = 0; q < 2; ++q) {
    CHECK(r[0].questions(q).oracle_frame_recall() == Approx(1.0));
    CHECK(r[0].questions(q).oracle_mass_recall() >= r[1].questions(q).oracle_mass_recall() - 1e-12);
    CHECK(r[0].questions(q).oracle_mass_recall() >= r[2].questions(q).oracle_mass_recall() - 1e-12);
  }
}

TEST_CASE("stream baselines: a budget below one frame retrieves no frame; rekv keeps its documented one",
          "[stream_replay]") {
  auto ts = MakeTinyStreamTrace();  // P = 4 tokens per frame
  CHECK(FramesForBudget(ts.trace.meta(), 3) == 0);
  CHECK(FramesForBudget(ts.trace.meta(), 8) == 2);
  const auto r = RunPolicies(ts.trace, {{"stream_recent", 3},
                                        {"stream_uniform", 3},
                                        {"stream_oracle", 3},
                                        {"rekv", 3},
                                        {"stream_uniform", 4}});
  for (int i = 0; i < 3; ++i) {
    INFO(r[i].policy());
    for (int q = 0; q < 2; ++q) {
      CHECK(r[i].questions(q).visual_tokens_in_context() == 0);  // never above the budget of 3
      CHECK(r[i].questions(q).frames_covered() == 0);
      CHECK(r[i].questions(q).evidence_frame_recall() == 0);
    }
  }
  CHECK(r[3].questions(0).visual_tokens_in_context() == 4);  // rekv: k = max(1, floor(B / P))
  CHECK(r[4].questions(0).visual_tokens_in_context() == 4);  // B = P: one frame
}

TEST_CASE("streaming results are identical at any thread count", "[stream_replay]") {
  TinyStreamSpec spec;
  spec.num_heads = 4;
  spec.num_kv_heads = 2;
  auto ts = MakeTinyStreamTrace(spec);
  std::vector<std::pair<std::string, int>> runs{{"rekv", 8}, {"stream_oracle", 8}, {"stream_uniform", 12}};
  const auto a = RunPolicies(ts.trace, runs, 1);
  const auto b = RunPolicies(ts.trace, runs, 3);
  for (size_t i = 0; i < a.size(); ++i) CHECK(a[i].SerializeAsString() == b[i].SerializeAsString());
}

// A source that records its reads (which layers; how many reads were in flight at once) and fails at
// layer `fail_at`. Each read lingers a little, so that two overlapping reads would be seen.
class RecordingSource : public TraceSource {
 public:
  RecordingSource(MemoryTrace* inner, int fail_at) : inner_(inner), fail_at_(fail_at) {}
  const TraceMeta& meta() const override { return inner_->meta(); }
  std::string Describe() const override { return "<recording>"; }
  using TraceSource::ReadLayer;
  Status ReadLayer(int layer, LayerData* out, const LayerReadOptions& options) override {
    const InFlight f(this);
    {
      std::lock_guard<std::mutex> lock(mu_);
      layers_read.push_back(layer);
    }
    if (layer == fail_at_) return Status::DataLoss("layer " + std::to_string(layer) + " is damaged");
    return inner_->ReadLayer(layer, out, options);
  }
  Status ReadBlockLayer(int g, int layer, BlockLayerData* out) override {
    const InFlight f(this);
    return inner_->ReadBlockLayer(g, layer, out);
  }
  std::vector<int> layers_read;
  std::atomic<int> max_in_flight{0};

 private:
  struct InFlight {
    explicit InFlight(RecordingSource* s) : s(s) {
      const int n = ++s->in_flight_;
      int m = s->max_in_flight.load();
      while (n > m && !s->max_in_flight.compare_exchange_weak(m, n)) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(3));
    }
    ~InFlight() { --s->in_flight_; }
    RecordingSource* s;
  };
  MemoryTrace* inner_;
  int fail_at_;
  std::mutex mu_;
  std::atomic<int> in_flight_{0};
};

TEST_CASE("the next layer is read in the background: once, in order, one read at a time; errors surface",
          "[stream_replay]") {
  TinyStreamSpec spec;
  spec.num_layers = 4;
  spec.num_heads = 4;
  spec.num_kv_heads = 2;
  auto ts = MakeTinyStreamTrace(spec);
  std::vector<StreamRunSpec> specs;
  for (const char* name : {"stream_full", "rekv", "mukv"}) {
    auto p = StreamPolicyRegistry::Default().Create(name);
    REQUIRE(p.ok());
    specs.push_back({*p, name, 12});
  }
  StreamReplayOptions o;
  o.threads = 3;
  auto direct = ReplayStream(ts.trace, specs, o);
  REQUIRE(direct.ok());
  RecordingSource src(&ts.trace, /*fail_at=*/-1);
  auto r = ReplayStream(src, specs, o);
  REQUIRE(r.ok());
  CHECK(src.max_in_flight.load() == 1);
  // mukv's plan reads the last layer first (it compresses there); then the pass reads 0, 1, 2, 3.
  CHECK(src.layers_read == std::vector<int>{3, 0, 1, 2, 3});
  for (size_t i = 0; i < r->size(); ++i)
    CHECK((*r)[i].SerializeAsString() == (*direct)[i].SerializeAsString());
  for (int fail_at : {0, 2, 3}) {
    RecordingSource bad(&ts.trace, fail_at);
    std::vector<StreamRunSpec> plain(specs.begin(), specs.begin() + 2);  // no plan reads
    auto e = ReplayStream(bad, plain, o);
    INFO("fail_at " << fail_at);
    REQUIRE_FALSE(e.ok());
    CHECK(e.status().message().find("layer " + std::to_string(fail_at) + " is damaged") != std::string::npos);
    CHECK(bad.max_in_flight.load() == 1);
  }
}

TEST_CASE("RetainedMass adds each row's covered columns in order, in double, eight rows at a time",
          "[stream_replay]") {
  // 19 rows: two blocks of eight and a tail of three. Values spread over many binades, so any other order or
  // precision of the additions (pairwise, float, rows mixed up) changes the last bits of some row.
  const int rows = 19, stride = 203;
  std::vector<float> p(static_cast<size_t>(rows) * stride);
  uint32_t x = 12345;
  for (float& v : p) {
    x = x * 1664525u + 1013904223u;
    v = std::ldexp(static_cast<float>(x >> 8) / (1 << 24), -static_cast<int>(x % 23));
  }
  std::vector<int> cols;
  for (int c = 0; c < stride; c += 1 + c % 3) cols.push_back(c);
  for (const std::span<const int> use : {std::span<const int>(cols), std::span<const int>()}) {
    std::vector<double> got;
    RetainedMass(p.data(), rows, stride, use, &got);
    REQUIRE(got.size() == static_cast<size_t>(rows));
    for (int r = 0; r < rows; ++r) {
      double want = 0;
      for (int c : use) want += p[static_cast<size_t>(r) * stride + c];
      INFO("row " << r << ", " << use.size() << " columns");
      CHECK(got[r] == want);  // bit for bit
    }
  }
}

TEST_CASE("CheckStreamRuns: non-streaming traces and missing video queries give one-line errors",
          "[stream_replay]") {
  auto p = StreamPolicyRegistry::Default().Create("rekv");
  REQUIRE(p.ok());
  std::vector<StreamRunSpec> runs{{*p, "rekv", 0}};
  TraceMeta plain;
  CHECK(CheckStreamRuns(plain, runs).message().find("not a streaming trace") != std::string::npos);
  auto ts = MakeTinyStreamTrace();
  TraceMeta meta = ts.trace.meta();
  meta.query_positions.clear();
  for (const auto& q : meta.stream->questions)
    for (int j = 0; j < q.num_question_tokens + q.num_answer_tokens; ++j)
      meta.query_positions.push_back(q.token_begin + j);
  auto mukv = StreamPolicyRegistry::Default().Create("mukv");
  REQUIRE(mukv.ok());
  std::vector<StreamRunSpec> mruns{{*mukv, "mukv", 0}};
  const Status st = CheckStreamRuns(meta, mruns);
  CHECK_FALSE(st.ok());
  CHECK(st.message().find("video tokens' queries") != std::string::npos);
  CHECK(st.message().find('\n') == std::string::npos);
  CHECK(CheckStreamRuns(meta, runs).ok());  // rekv needs no block encodings
}

}  // namespace
}  // namespace kvsim
