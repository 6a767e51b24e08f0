#include "sim/replay.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <csignal>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "policies/registry.h"
#include "sim/attention.h"
#include "tests/test_util.h"
#include "traces/hdf5_trace.h"
#include "traces/synth.h"

namespace kvsim {
namespace {

bool Contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Rewrites the trace in place with a sliding window of `window` tokens; its recorded prefill column sums are
// dropped (they were computed without the window).
void SetSlidingWindow(MemoryTrace& trace, int window) {
  TraceMeta meta = trace.meta();
  meta.model.sliding_window = window;
  std::vector<LayerData> layers;
  for (int l = 0; l < meta.model.num_layers; ++l) {
    LayerData d;
    REQUIRE(trace.ReadLayer(l, &d).ok());
    d.layer = l;
    d.prefill_column_sums.clear();
    layers.push_back(d);
  }
  meta.has_prefill_column_sums = false;
  REQUIRE(trace.Begin(meta).ok());
  for (const LayerData& d : layers) REQUIRE(trace.WriteLayer(d).ok());
}

// A hand-made trace: 1 layer, 1 head, d = 2, scale 1, prompt of 4 tokens (token 3 is the question), 2 decode
// steps (T = 6). Tokens 1 and 2 are image patches, the rest text.
//   keys   k0 = (0, 0), k1 = (ln2, 0), k2 = (ln3, ln4), k3 = (0, 0), k4 = (0, 0), k5 = (0, ln2)
//   values v0 = (1, 0), v1 = (0, 1),   v2 = (1, 1),     v3 = (0, 2), v4 = (2, 0), v5 = (2, 2)
//   decode queries: step 0 (token 4) q = (1, 0); step 1 (token 5) q = (0, 1). Prompt queries are zero.
// So step 0 attends with exp(logits) = the keys' first coordinate exponentiated, a = (1, 2, 3, 1, 1):
//   p(step 0) = (1, 2, 3, 1, 1) / 8,   o0 = (1 v0 + 2 v1 + 3 v2 + v3 + v4) / 8 = (6/8, 7/8)
// and step 1 with b = (1, 1, 4, 1, 1, 2):
//   p(step 1) = (1, 1, 4, 1, 1, 2) / 10, o1 = (.1 v0 + .1 v1 + .4 v2 + .1 v3 + .1 v4 + .2 v5) = (1.1, 1.1)
MemoryTrace MakeHandTrace(int sliding_window = 0) {
  const float l2 = std::log(2.0f), l3 = std::log(3.0f), l4 = std::log(4.0f);
  TraceMeta meta;
  meta.model.name = "hand";
  meta.model.family = "test";
  meta.model.num_layers = 1;
  meta.model.num_heads = 1;
  meta.model.num_kv_heads = 1;
  meta.model.head_dim = 2;
  meta.model.softmax_scale = 1.0;
  meta.model.sliding_window = sliding_window;
  meta.model.model_dtype = "float16";
  meta.prefill_length = 4;
  meta.num_decode_steps = 2;
  meta.tokens.Resize(6);
  for (int i = 0; i < 6; ++i) {
    meta.tokens.position_id[i] = i;
    meta.query_positions.push_back(i);
  }
  meta.tokens.modality[1] = meta.tokens.modality[2] = Modality::kImage;
  meta.tokens.role[3] = Role::kQuestion;
  for (int i = 4; i < 6; ++i) {
    meta.tokens.phase[i] = Phase::kDecode;
    meta.tokens.role[i] = Role::kGenerated;
  }
  LayerData layer;
  layer.layer = 0;
  layer.keys = {0, 0, l2, 0, l3, l4, 0, 0, 0, 0, 0, l2};
  layer.values = {1, 0, 0, 1, 1, 1, 0, 2, 2, 0, 2, 2};
  layer.queries = {0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1};
  return MemoryTrace(std::move(meta), {layer});
}

// Records what the engine shows a head policy after each step.
struct Recorder {
  std::vector<std::vector<int32_t>> tokens;  // cache tokens during each step
  std::vector<std::vector<float>> probs;     // cache_probs of each step
};

class RecordingHead : public HeadPolicy {
 public:
  explicit RecordingHead(Recorder* rec) : rec_(rec) {}
  void AfterStep(const HeadContext&, const StepAttention& att, HeadCache* cache) override {
    if (!rec_) return;
    rec_->tokens.emplace_back(cache->tokens().begin(), cache->tokens().end());
    rec_->probs.emplace_back(att.cache_probs, att.cache_probs + att.num_slots);
  }

 private:
  Recorder* rec_;
};

// Keeps a fixed set of prompt tokens (those below compress_end); decode tokens are appended.
class FixedSetPolicy final : public Policy {
 public:
  FixedSetPolicy(std::vector<int32_t> keep, Recorder* rec = nullptr) : keep_(std::move(keep)), rec_(rec) {}
  std::string name() const override { return "fixed"; }
  std::string ParamsText() const override { return "keep: fixed"; }
  PolicyRequirements requirements() const override { return {.decode_attention = true}; }
  bool evicts_during_decode() const override { return false; }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext&) const override {
    class Head final : public RecordingHead {
     public:
      Head(std::vector<int32_t> keep, Recorder* rec) : RecordingHead(rec), keep_(std::move(keep)) {}
      void OnPrefill(const HeadContext& ctx, int, HeadCache* cache) override {
        std::vector<int32_t> k;
        for (int32_t t : keep_)
          if (t < ctx.compress_end) k.push_back(t);
        cache->Assign(k);
      }

     private:
      std::vector<int32_t> keep_;
    };
    return std::make_unique<Head>(keep_, rec_);
  }

 private:
  std::vector<int32_t> keep_;
  Recorder* rec_;
};

// Keeps the whole prompt; before step 1 merges token 3 into token 2's slot with the averaged key and value
// (weight 0.5) and drops token 3's slot.
class MergePolicy final : public Policy {
 public:
  explicit MergePolicy(Recorder* rec) : rec_(rec) {}
  std::string name() const override { return "merge"; }
  std::string ParamsText() const override { return ""; }
  PolicyRequirements requirements() const override { return {.decode_attention = true}; }
  bool evicts_during_decode() const override { return false; }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext&) const override {
    class Head final : public RecordingHead {
     public:
      using RecordingHead::RecordingHead;
      void OnPrefill(const HeadContext&, int, HeadCache*) override {}
      void BeforeStep(const HeadContext& ctx, const StepAttention& att, int, HeadCache* cache) override {
        if (att.step != 1) return;
        REQUIRE(cache->token(2) == 2);
        REQUIRE(cache->token(3) == 3);
        const int d = ctx.head_dim();
        std::vector<float> key(d), value(d);
        for (int c = 0; c < d; ++c) {
          key[c] = 0.5f * (ctx.keys[2 * d + c] + ctx.keys[3 * d + c]);
          value[c] = 0.5f * (ctx.values[2 * d + c] + ctx.values[3 * d + c]);
        }
        cache->MergeInto(2, 3, 0.5f, key, value);
        cache->EvictSlot(3);
      }
    };
    return std::make_unique<Head>(rec_);
  }

 private:
  Recorder* rec_;
};

// Keeps the whole prompt; before each decode step, `act` changes the cache (a test's way to break or to
// stretch the engine's cache checks).
class ActPolicy final : public Policy {
 public:
  using Act = std::function<void(int step, HeadCache* cache)>;
  // append_new: whether the engine appends each step's own token after the hook (HeadPolicy::AppendNewToken).
  explicit ActPolicy(Act act, PolicyRequirements req = {}, bool append_new = true)
      : act_(std::move(act)), req_(req), append_new_(append_new) {}
  std::string name() const override { return "act"; }
  std::string ParamsText() const override { return ""; }
  PolicyRequirements requirements() const override { return req_; }
  bool evicts_during_decode() const override { return false; }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext&) const override {
    class Head final : public HeadPolicy {
     public:
      Head(const Act& act, bool append_new) : act_(act), append_new_(append_new) {}
      void OnPrefill(const HeadContext&, int, HeadCache*) override {}
      void BeforeStep(const HeadContext&, const StepAttention& att, int, HeadCache* cache) override {
        act_(att.step, cache);
      }
      bool AppendNewToken() const override { return append_new_; }

     private:
      const Act& act_;
      bool append_new_;
    };
    return std::make_unique<Head>(act_, append_new_);
  }

 private:
  Act act_;
  PolicyRequirements req_;
  bool append_new_;
};

RunSpec Spec(std::shared_ptr<const Policy> p, int budget_tokens,
             QuestionMode mode = QuestionMode::kQueryAware) {
  return RunSpec{std::move(p), "", 0, budget_tokens, mode};
}

ReplayOptions Options(const LatencyModel* latency = nullptr) {
  ReplayOptions o;
  o.threads = 1;
  o.latency = latency;
  return o;
}

// The runs replayed with an engine path switched off (`set(false)`: the reference) and on, at 1 and 3
// threads: every result the same, bit for bit, and every run with some output error (so the path mattered).
void CheckSameWithout(MemoryTrace& tr, const std::vector<RunSpec>& runs, void (*set)(bool)) {
  set(false);
  auto want = Replay(tr, runs, Options());
  set(true);
  REQUIRE(want.ok());
  for (int threads : {1, 3}) {
    ReplayOptions o = Options();
    o.threads = threads;
    auto got = Replay(tr, runs, o);
    REQUIRE(got.ok());
    for (size_t i = 0; i < runs.size(); ++i) {
      INFO("run " << i << ", threads " << threads);
      CHECK((*got)[i].metrics().output_rel_error_mean() > 0);
      CHECK((*got)[i].SerializeAsString() == (*want)[i].SerializeAsString());
    }
  }
}

std::shared_ptr<const Policy> Registered(const std::string& name, std::vector<std::string> sets = {}) {
  auto p = PolicyRegistry::Default().Create(name, sets);
  REQUIRE(p.ok());
  return *p;
}

// The trace of the run-list tests (FinishRun's runs of consecutive tokens): GQA (4 query heads on 2 KV
// heads), 600 prompt tokens with an image at [40, 500), 12 decode steps.
constexpr int kRunListPrompt = 600;
MemoryTrace RunListTrace() {
  testing::TinyTraceSpec spec;
  spec.num_heads = 4;  // GQA: group of 2
  spec.num_kv_heads = 2;
  spec.prefill_length = kRunListPrompt;
  spec.decode_steps = 12;
  spec.image_begin = 40;
  spec.image_end = 500;
  return testing::MakeTinyTrace(spec);
}

// Re-selected every step: a window of 100 tokens moving 7 per step, the 4 sinks listed after it, and a
// fixed block [300, 340).
std::shared_ptr<ActPolicy> WindowSinksBlock() {
  return std::make_shared<ActPolicy>([](int step, HeadCache* c) {
    std::vector<int32_t> keep;
    for (int32_t t = 50 + 7 * step; t < 150 + 7 * step; ++t) keep.push_back(t);  // a window
    for (int32_t t = 0; t < 4; ++t) keep.push_back(t);                           // sinks, after it
    for (int32_t t = 300; t < 340; ++t) keep.push_back(t);                       // a fixed block
    c->Assign(keep);
  });
}

}  // namespace

TEST_CASE("replay: the hand trace is valid", "[replay]") {
  MemoryTrace tr = MakeHandTrace();
  REQUIRE(tr.meta().Validate().ok());
  REQUIRE(ValidateLayer(tr.meta(), tr.layers()[0], "hand").ok());
}

TEST_CASE("replay: metrics of a fixed token set on the hand trace", "[replay]") {
  MemoryTrace tr = MakeHandTrace();
  Recorder rec;
  std::vector<RunSpec> runs{Spec(std::make_shared<FixedSetPolicy>(std::vector<int32_t>{0, 2}, &rec), 2)};
  auto res = Replay(tr, runs, Options());
  REQUIRE(res.ok());
  const RunResult& r = (*res)[0];
  const Metrics& m = r.metrics();
  // Caches: after prefill {0, 2}; step 0 {0, 2, 4}; step 1 {0, 2, 4, 5}.
  REQUIRE(rec.tokens.size() == 2);
  CHECK(rec.tokens[0] == std::vector<int32_t>{0, 2, 4});
  CHECK(rec.tokens[1] == std::vector<int32_t>{0, 2, 4, 5});
  // Step 0 cache attention renormalised over {0, 2, 4}: (1, 3, 1) / 5; step 1 over {0, 2, 4, 5}: (1, 4, 1, 2)
  // / 8.
  CHECK(rec.probs[0][0] == Approx(0.2).margin(1e-6));
  CHECK(rec.probs[0][1] == Approx(0.6).margin(1e-6));
  CHECK(rec.probs[0][2] == Approx(0.2).margin(1e-6));
  CHECK(rec.probs[1][1] == Approx(0.5).margin(1e-6));
  CHECK(rec.probs[1][3] == Approx(0.25).margin(1e-6));

  CHECK(r.policy() == "fixed");
  CHECK(r.label() == "fixed");
  CHECK(r.parameters() == "keep: fixed");
  CHECK(r.budget_tokens() == 2);
  CHECK(r.compressed_prompt_tokens() == 4);
  CHECK(r.question_mode() == "query_aware");
  CHECK(r.trace_path() == "<memory>");
  CHECK(r.time_unit() == "token_steps");
  CHECK(m.samples() == 2);  // 1 head x 2 steps
  // Retained mass: step 0 (1 + 3 + 1) / 8 = 0.625; step 1 .1 + .4 + .1 + .2 = 0.8.
  CHECK(m.retained_mass_mean() == Approx((0.625 + 0.8) / 2).margin(1e-6));
  CHECK(m.retained_mass_p5() == Approx(0.625).margin(1e-6));
  CHECK(m.covered_mass_mean() == Approx(m.retained_mass_mean()).margin(1e-7));
  // Outputs: step 0 ô = (v0 + 3 v2 + v4) / 5 = (1.2, 0.6) vs o = (0.75, 0.875):
  //   err0 = |(0.45, -0.275)| / |(0.75, 0.875)| = sqrt(0.278125 / 1.328125) = 0.45761530.
  // Step 1 ô = (.1 v0 + .4 v2 + .1 v4 + .2 v5) / .8 = (1.375, 1.0) vs o = (1.1, 1.1):
  //   err1 = |(0.275, -0.1)| / |(1.1, 1.1)| = sqrt(0.085625 / 2.42) = 0.18810165.
  const double err0 = std::sqrt(0.278125 / 1.328125), err1 = std::sqrt(0.085625 / 2.42);
  CHECK(m.output_rel_error_mean() == Approx((err0 + err1) / 2).epsilon(1e-5));
  CHECK(m.output_rel_error_p95() == Approx(err0).epsilon(1e-5));
  // Regret: step 0 keeps 3 visible slots, the best 3 of (1, 2, 3, 1, 1) / 8 hold 6/8 -> 6/8 - 5/8 = 0.125;
  // step 1 keeps 4, the best 4 of (1, 1, 4, 1, 1, 2) / 10 hold 0.8 -> 0.
  CHECK(m.regret_vs_oracle_mean() == Approx(0.0625).margin(1e-6));
  CHECK(m.regret_vs_oracle_p95() == Approx(0.125).margin(1e-6));
  // By modality (image = tokens 1, 2). Kept after prefill: token 0 (text), token 2 (image).
  CHECK(m.kept_tokens_by_modality().text() == 1);
  CHECK(m.kept_tokens_by_modality().image() == 1);
  CHECK(m.kept_tokens_by_modality().video() == 0);
  // Retained text: step 0 p0 + p4 = 2/8, step 1 p0 + p4 + p5 = 0.4 -> 0.325; image: 3/8 and 0.4 -> 0.3875.
  CHECK(m.retained_mass_by_modality().text() == Approx(0.325).margin(1e-6));
  CHECK(m.retained_mass_by_modality().image() == Approx(0.3875).margin(1e-6));
  CHECK(m.retained_mass_by_modality().other() == 0);
  // Full text: step 0 p0 + p3 + p4 = 3/8, step 1 0.5 -> 0.4375; image: 5/8 and 0.5 -> 0.5625.
  CHECK(m.full_mass_by_modality().text() == Approx(0.4375).margin(1e-6));
  CHECK(m.full_mass_by_modality().image() == Approx(0.5625).margin(1e-6));
  CHECK(m.bound_checks() == 2);
  CHECK(m.bound_violations() == 0);
  // Memory: bytes per token = 2 (K and V) x head_dim 2 x 2 bytes (float16) = 8.
  // Cache tokens per event: prefill 2, step 0 3, step 1 4; the full cache holds 4, 5, 6.
  CHECK(m.kv_bytes_peak() == 32);
  CHECK(m.full_kv_bytes_peak() == 48);
  // Token steps: every event lasts 1. kv_bytes_mean = footprint / total time over all events, the prefill
  // event included (docs/metrics.md).
  CHECK(m.kv_bytes_mean() == Approx((16 + 24 + 32) / 3.0));
  CHECK(m.full_kv_bytes_mean() == Approx((32 + 40 + 48) / 3.0));
  CHECK(m.kv_footprint() == Approx(72));
  CHECK(m.kv_memory_ratio() == Approx(72.0 / 120.0));
  CHECK(m.kept_tokens_mean() == Approx(3.5));  // (3 + 4) / 2, decode steps only
  // Timeline: end times 1, 2, 3.
  REQUIRE(r.timeline_size() == 3);
  const double times[3] = {1, 2, 3}, tokens[3] = {2, 3, 4};
  for (int e = 0; e < 3; ++e) {
    const TimelinePoint& tp = r.timeline(e);
    CHECK(tp.event() == (e == 0 ? "prefill" : "decode"));
    CHECK(tp.step() == e - 1);
    CHECK(tp.time() == times[e]);
    CHECK(tp.kv_tokens() == tokens[e]);
    CHECK(tp.kv_bytes() == 8 * tokens[e]);
  }
  // One layer: the per-layer metrics are the totals.
  REQUIRE(r.layers_size() == 1);
  CHECK(r.layers(0).layer() == 0);
  CHECK(r.layers(0).budget_tokens_mean() == 2);
  CHECK(r.layers(0).metrics().SerializeAsString() == m.SerializeAsString());
}

TEST_CASE("replay: the regret's top-k sums agree whichever way the engine gets them", "[replay]") {
  // The engine answers top-k sums for k up to the largest cache size any run's cap allows (below T) from
  // each row's buckets (TopKSums), keeps the sum of the whole row for runs that see every visible token,
  // and builds all-k sums for a run allowed T slots or more that keeps fewer. The same cache {0, 2} (+
  // decode tokens) with budget 2 (bound 2 + 2 steps = 4 < T = 6: the buckets), with budget 2 next to an
  // oracle (which reads its thresholds from the same buckets) and with budget 4 (bound 6: the all-k sums)
  // must give the same regret, bit for bit, and the hand values of "metrics of a fixed token set".
  MemoryTrace tr = MakeHandTrace();
  auto fixed = std::make_shared<FixedSetPolicy>(std::vector<int32_t>{0, 2});
  std::vector<RunSpec> prefix{Spec(fixed, 2)}, own{Spec(fixed, 4)}, full{Spec(Registered("full"), 4)};
  auto a = Replay(tr, prefix, Options());
  auto b = Replay(tr, own, Options());
  auto c = Replay(tr, full, Options());
  std::vector<RunSpec> sorted{Spec(fixed, 2), Spec(Registered("oracle"), 2)};
  auto d = Replay(tr, sorted, Options());
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(c.ok());
  REQUIRE(d.ok());
  const Metrics& ma = (*a)[0].metrics();
  const Metrics& mb = (*b)[0].metrics();
  const Metrics& md = (*d)[0].metrics();
  CHECK(md.regret_vs_oracle_mean() == ma.regret_vs_oracle_mean());
  CHECK(md.regret_vs_oracle_p95() == ma.regret_vs_oracle_p95());
  CHECK(ma.regret_vs_oracle_mean() == Approx(0.0625).margin(1e-6));
  CHECK(ma.regret_vs_oracle_p95() == Approx(0.125).margin(1e-6));
  CHECK(mb.regret_vs_oracle_mean() == ma.regret_vs_oracle_mean());
  CHECK(mb.regret_vs_oracle_p95() == ma.regret_vs_oracle_p95());
  // `full` sees every visible token: the whole row's sum, which is its retained mass up to rounding.
  CHECK(std::abs((*c)[0].metrics().regret_vs_oracle_mean()) < 1e-7);
}

TEST_CASE("replay: timeline and memory with a linear latency model", "[replay]") {
  MemoryTrace tr = MakeHandTrace();
  LatencyModelProto lp;
  lp.set_prefill_base_us(10);
  lp.set_prefill_us_per_token(2);
  lp.set_decode_base_us(5);
  lp.set_decode_us_per_kv_token(1);
  auto lat = MakeLinearLatencyModel(lp);
  std::vector<RunSpec> runs{Spec(std::make_shared<FixedSetPolicy>(std::vector<int32_t>{0, 2}), 2)};
  auto res = Replay(tr, runs, Options(lat.get()));
  REQUIRE(res.ok());
  const RunResult& r = (*res)[0];
  CHECK(r.time_unit() == "us");
  // Prefill 10 + 2 x 4 = 18; step 0: 5 + 1 x 3 (mean KV tokens per head) = 8; step 1: 5 + 4 = 9.
  REQUIRE(r.timeline_size() == 3);
  CHECK(r.timeline(0).time() == Approx(18));
  CHECK(r.timeline(1).time() == Approx(26));
  CHECK(r.timeline(2).time() == Approx(35));
  const Metrics& m = r.metrics();
  // Bytes 16, 24, 32 over durations 18, 8, 9: footprint 288 + 192 + 288 = 768, mean 768 / 35.
  // Full: 32, 40, 48 -> 576 + 320 + 432 = 1328.
  CHECK(m.kv_footprint() == Approx(768));
  CHECK(m.kv_bytes_mean() == Approx(768.0 / 35));
  CHECK(m.full_kv_bytes_mean() == Approx(1328.0 / 35));
  CHECK(m.kv_memory_ratio() == Approx(768.0 / 1328));
  CHECK(m.kv_bytes_peak() == 32);
}

TEST_CASE("replay: float32 models account 4 bytes per element", "[replay]") {
  MemoryTrace tr = MakeHandTrace();
  tr.mutable_meta().model.model_dtype = "float32";
  std::vector<RunSpec> runs{Spec(std::make_shared<FixedSetPolicy>(std::vector<int32_t>{0, 2}), 2)};
  auto res = Replay(tr, runs, Options());
  REQUIRE(res.ok());
  CHECK((*res)[0].metrics().kv_bytes_peak() == 4 * 2 * 2 * 4);  // 4 tokens x K,V x d 2 x 4 bytes
}

TEST_CASE("replay: query-agnostic mode compresses the context and appends the question", "[replay]") {
  MemoryTrace tr = MakeHandTrace();
  CHECK(CompressEnd(tr.meta(), QuestionMode::kQueryAware) == 4);
  CHECK(CompressEnd(tr.meta(), QuestionMode::kQueryAgnostic) == 3);
  std::vector<RunSpec> runs{
      Spec(std::make_shared<FixedSetPolicy>(std::vector<int32_t>{0, 2}), 2, QuestionMode::kQueryAgnostic)};
  auto res = Replay(tr, runs, Options());
  REQUIRE(res.ok());
  const RunResult& r = (*res)[0];
  CHECK(r.question_mode() == "query_agnostic");
  CHECK(r.compressed_prompt_tokens() == 3);
  // Caches {0, 2, 3}, {0, 2, 3, 4}, {0, 2, 3, 4, 5}: retained (1 + 3 + 1 + 1) / 8 = 0.75 and 0.9.
  CHECK(r.metrics().retained_mass_mean() == Approx((0.75 + 0.9) / 2).margin(1e-6));
  CHECK(r.metrics().kept_tokens_by_modality().text() == 2);
  CHECK(r.metrics().kept_tokens_by_modality().image() == 1);
  CHECK(r.timeline(0).kv_tokens() == 3);
}

TEST_CASE("replay: sliding window masks kept tokens outside it", "[replay]") {
  // Window 3. Step 0 (token 4) sees tokens 2..4, p = (3, 1, 1) / 5; step 1 (token 5) sees 3..5, p = (1, 1, 2)
  // / 4. Cache {0, 2, 4} at step 0: token 0 masked, retained 0.6 + 0.2 = 0.8, 2 visible slots, best 2 = 0.8
  // -> regret 0.
  //   ô = (.6 v2 + .2 v4) / .8 = (1.25, 0.75), o = .6 v2 + .2 v3 + .2 v4 = (1, 1): err = 0.25.
  // Cache {0, 2, 4, 5} at step 1: tokens 4, 5 visible, retained 0.75, best 2 = 0.75 -> regret 0.
  //   ô = (.25 v4 + .5 v5) / .75 = (2, 4/3), o = .25 v3 + .25 v4 + .5 v5 = (1.5, 1.5):
  //   err = |(0.5, -1/6)| / (1.5 sqrt 2) = sqrt(5) / 9.
  MemoryTrace tr = MakeHandTrace(/*sliding_window=*/3);
  std::vector<RunSpec> runs{Spec(std::make_shared<FixedSetPolicy>(std::vector<int32_t>{0, 2}), 2)};
  auto res = Replay(tr, runs, Options());
  REQUIRE(res.ok());
  const Metrics& m = (*res)[0].metrics();
  CHECK(m.retained_mass_mean() == Approx((0.8 + 0.75) / 2).margin(1e-6));
  CHECK(m.regret_vs_oracle_mean() == Approx(0).margin(1e-6));
  CHECK(m.output_rel_error_mean() == Approx((0.25 + std::sqrt(5.0) / 9) / 2).epsilon(1e-5));
  // Full mass by modality inside the window: text 0.4 and 1.0, image 0.6 and 0.
  CHECK(m.full_mass_by_modality().text() == Approx(0.7).margin(1e-6));
  CHECK(m.full_mass_by_modality().image() == Approx(0.3).margin(1e-6));
  CHECK(m.bound_violations() == 0);
}

TEST_CASE(
    "replay: a merged slot counts as covered (not retained), attends with its merged key, skips the bound",
    "[replay]") {
  MemoryTrace tr = MakeHandTrace();
  Recorder rec;
  std::vector<RunSpec> runs{Spec(std::make_shared<MergePolicy>(&rec), 4)};
  auto res = Replay(tr, runs, Options());
  REQUIRE(res.ok());
  const Metrics& m = (*res)[0].metrics();
  // Step 0: the full cache -> retained = covered = 1, error 0.
  // Step 1: slots {0, 1, 2+3, 4, 5}. Retained (plain slots only) = .1 + .1 + .1 + .2 = 0.5; the merged
  // slot's anchor 2 (.4) had its key and value replaced: merged anchor mass .4; covered adds token 3's .1:
  // .5 + .4 + .1 = 1.
  CHECK(m.retained_mass_mean() == Approx((1 + 0.5) / 2).margin(1e-6));
  CHECK(m.merged_anchor_mass_mean() == Approx((0 + 0.4) / 2).margin(1e-6));
  CHECK(m.covered_mass_mean() == Approx(1.0).margin(1e-6));
  CHECK(m.covered_mass_mean() > m.retained_mass_mean());
  // The merged slot attends with k = (k2 + k3) / 2 = (ln3 / 2, ln2): q5 . k = ln2, weight e^{ln2} / 10 = 0.2,
  // value (v2 + v3) / 2 = (0.5, 1.5). Σ weights = .1 + .1 + .2 + .1 + .2 = 0.7;
  //   ô = (.1 v0 + .1 v1 + .2 (0.5, 1.5) + .1 v4 + .2 v5) / .7 = (0.8, 0.8) / 0.7 = (8/7, 8/7);
  //   o = (1.1, 1.1) -> err = (8/7 - 1.1) / 1.1 = 3/77.
  CHECK(m.output_rel_error_mean() == Approx((0 + 3.0 / 77) / 2).epsilon(1e-4));
  // The averaged key's logit is the mean of its tokens' logits, so its weight is their probabilities'
  // geometric mean, sqrt(.4 * .1) = .2, at most their arithmetic mean .25 = (p2 + p3) / (1 + m): the slot
  // gets .2 / .5 = 0.4 of the mass of the tokens it stands for (only step 1 has a merged slot).
  CHECK(m.merged_weight_over_mass_mean() == Approx(0.4).margin(1e-6));
  REQUIRE(rec.probs.size() == 2);
  CHECK(rec.tokens[1] == std::vector<int32_t>{0, 1, 2, 4, 5});
  const double want[5] = {1 / 7.0, 1 / 7.0, 2 / 7.0, 1 / 7.0, 2 / 7.0};
  for (int s = 0; s < 5; ++s) CHECK(rec.probs[1][s] == Approx(want[s]).margin(1e-6));
  // The eviction bound only applies to steps without merged slots: step 0 only.
  CHECK(m.bound_checks() == 1);
  CHECK(m.bound_violations() == 0);
  // Regret: 5 visible slots, best 5 of (1, 1, 4, 1, 1, 2) / 10 = 0.9, minus retained 0.5 -> 0.4.
  CHECK(m.regret_vs_oracle_mean() == Approx((0 + 0.4) / 2).margin(1e-6));
  // Retained by modality counts plain slots only: image step 1 = p1 = 0.1 (the merged anchor 2 is out).
  CHECK(m.retained_mass_by_modality().image() == Approx((5.0 / 8 + 0.1) / 2).margin(1e-6));
  CHECK(m.retained_mass_by_modality().text() == Approx((3.0 / 8 + 0.4) / 2).margin(1e-6));
}

TEST_CASE("replay: budgets from fractions round and clamp to [1, compressible length]", "[replay]") {
  MemoryTrace tr = MakeHandTrace();
  auto p = Registered("streaming_llm");
  std::vector<RunSpec> runs{
      RunSpec{p, "half", 0.5, 0}, RunSpec{p, "tiny", 0.01, 0}, RunSpec{p, "big", 0, 100},
      RunSpec{p, "agn", 0.5, 0, QuestionMode::kQueryAgnostic}, RunSpec{p, "tie", 0.625, 0}};
  auto res = Replay(tr, runs, Options());
  REQUIRE(res.ok());
  CHECK((*res)[0].budget_tokens() == 2);  // round(0.5 x 4)
  CHECK((*res)[0].label() == "half");
  CHECK((*res)[1].budget_tokens() == 1);  // round(0.04) = 0 -> 1
  CHECK((*res)[2].budget_tokens() == 4);  // 100 tokens -> the prompt
  CHECK((*res)[3].budget_tokens() == 2);  // round(0.5 x 3) = round(1.5) = 2
  CHECK((*res)[3].compressed_prompt_tokens() == 3);
  // Ties round half away from zero (docs: B = clamp(round(R · ce), 1, ce)): 0.625 x 4 = 2.5 -> 3, not the
  // even 2.
  CHECK((*res)[4].budget_tokens() == 3);
}

TEST_CASE("CheckRuns: no decode steps, bad budgets, nothing to compress", "[replay]") {
  MemoryTrace tr = MakeHandTrace();
  auto p = Registered("streaming_llm");
  TraceMeta meta = tr.meta();
  std::vector<RunSpec> ok{RunSpec{p, "", 0.5, 0}};
  REQUIRE(CheckRuns(meta, ok).ok());

  TraceMeta no_decode = meta;
  no_decode.num_decode_steps = 0;
  Status st = CheckRuns(no_decode, ok);
  CHECK(st.code() == StatusCode::kFailedPrecondition);
  CHECK(Contains(st.message(), "no decode steps"));

  for (const RunSpec& bad : {RunSpec{p, "", 0, 0}, RunSpec{p, "", 1.5, 0}, RunSpec{p, "", -0.5, -1}}) {
    st = CheckRuns(meta, std::vector<RunSpec>{bad});
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(Contains(st.message(), "budget must be a fraction in (0, 1] or a token count >= 1"));
    CHECK(Contains(st.message(), "run 'streaming_llm'"));
  }
  st = CheckRuns(meta, std::vector<RunSpec>{RunSpec{nullptr, "", 0.5, 0}});
  CHECK(st.code() == StatusCode::kInvalidArgument);

  // The question starts at token 0: nothing to compress in query-agnostic mode.
  TraceMeta all_question = meta;
  for (int i = 0; i < 4; ++i) all_question.tokens.role[i] = Role::kQuestion;
  CHECK(CompressEnd(all_question, QuestionMode::kQueryAgnostic) == 0);
  st = CheckRuns(all_question, std::vector<RunSpec>{RunSpec{p, "", 0.5, 0, QuestionMode::kQueryAgnostic}});
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(Contains(st.message(), "nothing to compress before the question in query_agnostic mode"));
  // Replay reports the same errors before doing any work.
  auto res = Replay(tr, std::vector<RunSpec>{RunSpec{p, "", 0, 0}}, Options());
  CHECK(res.status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("CompressEnd: the first question token, or the prompt length", "[replay]") {
  testing::TinyTraceSpec spec;  // prompt 24, question = last 4 prompt tokens
  MemoryTrace tr = testing::MakeTinyTrace(spec);
  CHECK(CompressEnd(tr.meta(), QuestionMode::kQueryAware) == 24);
  CHECK(CompressEnd(tr.meta(), QuestionMode::kQueryAgnostic) == 20);
  spec.question_tokens = 0;
  MemoryTrace no_q = testing::MakeTinyTrace(spec);
  CHECK(CompressEnd(no_q.meta(), QuestionMode::kQueryAgnostic) == 24);
  CHECK(std::string(QuestionModeName(QuestionMode::kQueryAgnostic)) == "query_agnostic");
}

TEST_CASE("CheckRuns: snapkv's observation window needs stored queries", "[replay]") {
  testing::TinyTraceSpec spec;
  spec.all_queries = false;  // queries of prompt tokens 16..23 + decode
  MemoryTrace tr = testing::MakeTinyTrace(spec);
  // Default window 32 -> min(32, 24) = 24 queries, from token 0: not stored.
  Status st = CheckRuns(tr.meta(), std::vector<RunSpec>{RunSpec{Registered("snapkv"), "", 0.5, 0}});
  CHECK(st.code() == StatusCode::kFailedPrecondition);
  INFO(st.message());
  CHECK(Contains(st.message(), "observation window of 24 queries ending at token 24"));
  CHECK(Contains(st.message(), "needs the query of token 0"));
  CHECK(Contains(st.message(), "--set window=N"));
  // Window 8 fits the stored queries in query-aware mode...
  auto w8 = Registered("snapkv", {"window=8"});
  REQUIRE(CheckRuns(tr.meta(), std::vector<RunSpec>{RunSpec{w8, "", 0.5, 0}}).ok());
  // ...but not before the question (tokens 12..19) in query-agnostic mode.
  st = CheckRuns(tr.meta(), std::vector<RunSpec>{RunSpec{w8, "", 0.5, 0, QuestionMode::kQueryAgnostic}});
  CHECK(st.code() == StatusCode::kFailedPrecondition);
  CHECK(Contains(st.message(), "needs the query of token 12"));
  // pyramidkv has the same requirement.
  st = CheckRuns(tr.meta(), std::vector<RunSpec>{RunSpec{Registered("pyramidkv"), "", 0.5, 0}});
  CHECK(st.code() == StatusCode::kFailedPrecondition);
  // And the replay itself runs with window 8.
  auto res = Replay(tr, std::vector<RunSpec>{RunSpec{w8, "", 0.5, 0}}, Options());
  REQUIRE(res.ok());
  CHECK((*res)[0].budget_tokens() == 12);
}

TEST_CASE("CheckRuns: h2o on a window-only trace needs recorded column sums", "[replay]") {
  testing::TinyTraceSpec spec;
  spec.all_queries = false;
  MemoryTrace tr = testing::MakeTinyTrace(spec);
  auto h2o = Registered("h2o");
  Status st = CheckRuns(tr.meta(), std::vector<RunSpec>{RunSpec{h2o, "", 0.5, 0}});
  CHECK(st.code() == StatusCode::kFailedPrecondition);
  INFO(st.message());
  CHECK(Contains(st.message(), "column sums over all prompt queries"));
  CHECK(Contains(st.message(), "only the last 8 prompt tokens"));
  CHECK(Contains(st.message(), "no recorded prefill_column_sums"));
  CHECK(Contains(st.message(), "capture with all queries, or use a window-based policy such as snapkv"));
  // Streaming needs nothing.
  REQUIRE(CheckRuns(tr.meta(), std::vector<RunSpec>{RunSpec{Registered("streaming_llm"), "", 0.5, 0}}).ok());

  // With recorded column sums: fine in query-aware mode, not in query-agnostic mode (they include the
  // question).
  tr.mutable_meta().has_prefill_column_sums = true;
  REQUIRE(CheckRuns(tr.meta(), std::vector<RunSpec>{RunSpec{h2o, "", 0.5, 0}}).ok());
  st = CheckRuns(tr.meta(), std::vector<RunSpec>{RunSpec{h2o, "", 0.5, 0, QuestionMode::kQueryAgnostic}});
  CHECK(st.code() == StatusCode::kFailedPrecondition);
  CHECK(Contains(st.message(), "column sums over all context queries"));
  CHECK(Contains(st.message(), "question included"));
}

TEST_CASE("replay: h2o uses the recorded column sums of a window-only trace", "[replay]") {
  testing::TinyTraceSpec spec;
  spec.all_queries = false;
  MemoryTrace tr = testing::MakeTinyTrace(spec);
  tr.mutable_meta().has_prefill_column_sums = true;
  const int h = spec.num_heads, n = spec.prefill_length;
  for (LayerData& l : tr.layers()) {
    l.prefill_column_sums.assign(static_cast<size_t>(h) * n, 0.1f);
    for (int head = 0; head < h; ++head)
      for (int j = 4; j < 8; ++j) l.prefill_column_sums[static_cast<size_t>(head) * n + j] = 10.0f;  // image
  }
  // One-shot, heavy_fraction 1: no recent window -> the 4 heaviest = image tokens 4..7.
  // Per-step, heavy_fraction 1: one recent slot (token 23, text) + the 3 heaviest (image 4..6).
  std::vector<RunSpec> runs{
      RunSpec{Registered("h2o", {"one_shot=true", "heavy_fraction=1"}), "one_shot", 0, 4},
      RunSpec{Registered("h2o", {"heavy_fraction=1"}), "per_step", 0, 4}};
  auto res = Replay(tr, runs, Options());
  REQUIRE(res.ok());
  CHECK((*res)[0].metrics().kept_tokens_by_modality().image() == 4);
  CHECK((*res)[0].metrics().kept_tokens_by_modality().text() == 0);
  CHECK((*res)[1].metrics().kept_tokens_by_modality().image() == 3);
  CHECK((*res)[1].metrics().kept_tokens_by_modality().text() == 1);
}

}  // namespace kvsim

namespace kvsim {

TEST_CASE("replay: chunked prefill adds timeline events holding the uncompressed prefix", "[replay]") {
  testing::TinyTraceSpec spec;  // n = 24, 6 decode steps, 2 layers x 2 KV heads
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  auto snap = PolicyRegistry::Default().Create("snapkv");
  REQUIRE(snap.ok());
  std::vector<RunSpec> runs{RunSpec{*snap, "snapkv", 0, 6, QuestionMode::kQueryAware}};
  LatencyModelProto lp;
  lp.set_prefill_base_us(5);
  lp.set_prefill_us_per_token(1);
  lp.set_decode_base_us(100);
  auto latency = MakeLinearLatencyModel(lp);
  ReplayOptions opt{.threads = 1, .latency = latency.get(), .prefill_chunk = 10};
  auto res = Replay(trace, runs, opt);
  REQUIRE(res.ok());
  const RunResult& r = (*res)[0];
  CHECK(r.prefill_chunks() == 3);  // 10 + 10 + 4
  REQUIRE(r.timeline_size() == 3 + spec.decode_steps);
  const double heads = 2 * 2;
  CHECK(r.timeline(0).kv_tokens() == 10 * heads);
  CHECK(r.timeline(1).kv_tokens() == 20 * heads);
  CHECK(r.timeline(2).kv_tokens() == 6 * heads);  // after the compression hook
  CHECK(r.timeline(0).step() == -3);
  CHECK(r.timeline(2).step() == -1);
  CHECK(r.timeline(3).step() == 0);
  CHECK(r.timeline(0).time() == 15);   // 5 + 10
  CHECK(r.timeline(1).time() == 30);   // + 5 + 10
  CHECK(r.timeline(2).time() == 39);   // + 5 + 4
  CHECK(r.timeline(3).time() == 139);  // + 100
  // The uncompressed chunks set the peak: 20 tokens x 4 heads x 2 (K, V) x 8 dims x 2 bytes.
  CHECK(r.metrics().kv_bytes_peak() == 20 * heads * 2 * 8 * 2);
  // Quality metrics do not depend on chunking.
  auto whole = Replay(trace, runs, ReplayOptions{.threads = 1});
  REQUIRE(whole.ok());
  CHECK(r.metrics().retained_mass_mean() == (*whole)[0].metrics().retained_mass_mean());
  CHECK((*whole)[0].prefill_chunks() == 1);
}

}  // namespace kvsim

namespace kvsim {
namespace {

// First-pass test policy: observes every layer (recording order and the layer's key sum), then gives
// even layers one token more and odd layers one token less than the uniform budget; keeps the most
// recent tokens. Its heads check that they see the plan.
struct ObservedPlan : PolicyPlan {
  std::vector<int> order;
  std::vector<double> key_sums;
  bool finished = false;
};
class FirstPassPolicy final : public Policy {
 public:
  std::string name() const override { return "first_pass_test"; }
  std::string ParamsText() const override { return ""; }
  PolicyRequirements requirements() const override { return {.first_pass = true}; }
  bool evicts_during_decode() const override { return false; }
  std::unique_ptr<PolicyPlan> NewPlan(const TraceMeta& meta, int) const override {
    ++plans_made_;
    return std::make_unique<ObservedPlan>();
  }
  void ObserveLayer(const LayerView& v, PolicyPlan* plan) const override {
    auto* p = static_cast<ObservedPlan*>(plan);
    CHECK_FALSE(p->finished);
    p->order.push_back(v.layer);
    double s = -1;  // no data: a layer not in FirstPassLayers
    if (v.data) {
      CHECK(v.data->layer == v.layer);
      s = 0;
      for (float x : v.data->keys) s += x;
    }
    p->key_sums.push_back(s);
  }
  std::vector<int> FirstPassLayers(const TraceMeta& meta, int compress_len) const override {
    return layers ? *layers : Policy::FirstPassLayers(meta, compress_len);
  }
  std::optional<std::vector<int>> layers;  // FirstPassLayers (default: every layer)
  void FinishPlan(const TraceMeta& meta, PolicyPlan* plan) const override {
    auto* p = static_cast<ObservedPlan*>(plan);
    p->finished = true;
    std::vector<int> all(meta.model.num_layers);
    std::iota(all.begin(), all.end(), 0);
    CHECK(p->order == all);
    CHECK(p->key_sums.size() == all.size());
    p->layer_stats["key_sum"] = p->key_sums;
  }
  std::vector<int> PlannedLayerBudgets(const TraceMeta& meta, int budget, int,
                                       const PolicyPlan& plan) const override {
    CHECK(static_cast<const ObservedPlan&>(plan).finished);
    std::vector<int> b;
    for (int l = 0; l < meta.model.num_layers; ++l) b.push_back(budget + (l % 2 == 0 ? 1 : -1));
    return b;
  }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext& ctx) const override {
    struct Recent final : HeadPolicy {
      explicit Recent(int expected) : expected_(expected) {}
      int expected_;
      void OnPrefill(const HeadContext& ctx, int budget, HeadCache* cache) override {
        REQUIRE(ctx.plan != nullptr);
        CHECK(static_cast<const ObservedPlan*>(ctx.plan)->finished);
        CHECK(budget == expected_ + (ctx.layer % 2 == 0 ? 1 : -1));
        cache->AssignRange(ctx.compress_end - budget, ctx.compress_end);
      }
    };
    return std::make_unique<Recent>(expected_budget);
  }
  mutable int plans_made_ = 0;
  int expected_budget = 5;
};

}  // namespace

TEST_CASE("replay: first pass sees every layer in order before any compression", "[replay]") {
  testing::TinyTraceSpec spec;
  spec.num_layers = 4;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  auto policy = std::make_shared<FirstPassPolicy>();
  std::vector<RunSpec> runs{RunSpec{policy, "fp", 0, 5, QuestionMode::kQueryAware}};
  auto res = Replay(trace, runs, ReplayOptions{.threads = 2});
  REQUIRE(res.ok());
  CHECK(policy->plans_made_ == 1);
  const RunResult& r = (*res)[0];
  CHECK(r.allocated_budget_tokens_mean() == 5);
  REQUIRE(r.layers(1).policy_stats_size() == 1);
  CHECK(r.layers(1).policy_stats(0).name() == "key_sum");
  REQUIRE(r.layers_size() == 4);
  CHECK(r.layers(0).budget_tokens_mean() == 6);
  CHECK(r.layers(1).budget_tokens_mean() == 4);
  CHECK(r.layers(2).budget_tokens_mean() == 6);
  CHECK(r.layers(3).budget_tokens_mean() == 4);
  CHECK(r.layers(0).metrics().kept_tokens_by_modality().text() +
            r.layers(0).metrics().kept_tokens_by_modality().image() ==
        6);
  CHECK(r.layers(0).metrics().prompt_kept_tokens_mean() == 6);
  CHECK(r.layers(0).metrics().prompt_kept_over_budget() == 1);
}

TEST_CASE("replay: the first pass reads only the layers its policies need", "[replay]") {
  testing::TinyTraceSpec spec;
  spec.num_layers = 4;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  // Reference: every layer observed with its data.
  auto all = std::make_shared<FirstPassPolicy>();
  std::vector<RunSpec> ref_runs{RunSpec{all, "fp", 0, 5, QuestionMode::kQueryAware}};
  auto ref = Replay(trace, ref_runs, ReplayOptions{.threads = 2});
  REQUIRE(ref.ok());
  std::vector<double> ref_sums;
  for (const auto& l : (*ref)[0].layers()) ref_sums.push_back(l.policy_stats(0).value());
  struct Case {
    std::vector<int> layers, second;  // FirstPassLayers of two policies
    std::vector<int> reads;           // expected ReadLayer calls: the first pass's, then the replay's
  };
  for (const Case& c :
       {Case{{2}, {2}, {2, 0, 1, 2, 3}}, Case{{}, {}, {0, 1, 2, 3}}, Case{{1, 3}, {0}, {0, 1, 3, 0, 1, 2, 3}},
        Case{{0, 1, 2, 3}, {}, {0, 1, 2, 3, 0, 1, 2, 3}}}) {
    auto a = std::make_shared<FirstPassPolicy>(), b = std::make_shared<FirstPassPolicy>();
    a->layers = c.layers;
    b->layers = c.second;
    testing::CountingTrace counted(trace);
    std::vector<RunSpec> runs{RunSpec{a, "a", 0, 5, QuestionMode::kQueryAware},
                              RunSpec{b, "b", 0, 5, QuestionMode::kQueryAware}};
    for (int threads : {1, 3}) {
      counted.reads.clear();
      auto res = Replay(counted, runs, ReplayOptions{.threads = threads});
      REQUIRE(res.ok());
      CHECK(counted.reads == c.reads);
      // Each plan saw every layer in order, with data exactly for its own layers.
      for (int r = 0; r < 2; ++r) {
        const std::vector<int>& want = r == 0 ? c.layers : c.second;
        for (int l = 0; l < 4; ++l) {
          const bool has = std::find(want.begin(), want.end(), l) != want.end();
          CHECK((*res)[r].layers(l).policy_stats(0).value() == (has ? ref_sums[l] : -1));
        }
      }
    }
  }
  // A policy listing layers out of order or out of range is an internal error, not a crash.
  for (std::vector<int> bad : {std::vector<int>{2, 1}, std::vector<int>{1, 1}, std::vector<int>{4}}) {
    auto p = std::make_shared<FirstPassPolicy>();
    p->layers = bad;
    std::vector<RunSpec> runs{RunSpec{p, "p", 0, 5, QuestionMode::kQueryAware}};
    auto res = Replay(trace, runs, ReplayOptions{.threads = 1});
    REQUIRE_FALSE(res.ok());
    CHECK(res.status().message().find("FirstPassLayers must be ascending") != std::string::npos);
  }
}

TEST_CASE("replay: HAE's first pass reads only its DAP layer", "[replay]") {
  testing::TinyTraceSpec spec;
  spec.num_layers = 4;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  for (auto [dap, want] : {std::pair{1, 1}, std::pair{0, 0}, std::pair{9, 3}}) {  // clamped to the last
    testing::CountingTrace counted(trace);
    std::vector<RunSpec> runs{
        RunSpec{Registered("hae", {"dap_layer=" + std::to_string(dap)}), "hae", 0.5, 0}};
    REQUIRE(Replay(counted, runs, ReplayOptions{.threads = 2}).ok());
    CHECK(counted.reads == std::vector<int>{want, 0, 1, 2, 3});
  }
}

TEST_CASE("replay: one first-pass plan serves every budget of a policy object", "[replay]") {
  testing::TinyTraceSpec spec;
  spec.num_layers = 2;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  auto policy = std::make_shared<FirstPassPolicy>();
  std::vector<RunSpec> runs{RunSpec{policy, "fp", 0, 5, QuestionMode::kQueryAware},
                            RunSpec{policy, "fp", 0, 5, QuestionMode::kQueryAware},
                            RunSpec{policy, "fp", 0, 5, QuestionMode::kQueryAgnostic}};
  auto res = Replay(trace, runs, ReplayOptions{.threads = 1});
  REQUIRE(res.ok());
  CHECK(policy->plans_made_ == 2);  // one per compressible region
}

}  // namespace kvsim

namespace kvsim {
namespace {

// The decode phase runs one work item per (KV head, run), and each item computes its steps' outputs as one
// gathered product, a per-step gather, or the reference product (a run that keeps everything). GQA with
// merged slots, a sliding window, decode-evicting and re-selecting policies: every path, at 1, 2 and 5
// threads, gives byte-identical results.
TEST_CASE("replay: (KV head, run) items are bit-identical at any thread count (GQA, merges, window)",
          "[replay]") {
  testing::TinyTraceSpec spec;
  spec.num_heads = 6;
  spec.num_kv_heads = 2;
  spec.prefill_length = 40;
  spec.decode_steps = 9;
  spec.image_end = 30;
  spec.seed = 23;
  for (int window : {0, 20}) {
    MemoryTrace trace = testing::MakeTinyTrace(spec);
    if (window > 0) SetSlidingWindow(trace, window);
    std::vector<RunSpec> runs;
    for (const char* name :
         {"full", "streaming_llm", "h2o", "snapkv", "oracle", "snapkv+average", "look_m"}) {
      auto p = PolicyRegistry::Default().Create(name);
      REQUIRE(p.ok());
      for (double b : {0.1, 0.5}) runs.push_back(RunSpec{*p, name, b, 0, QuestionMode::kQueryAware});
    }
    auto a = Replay(trace, runs, ReplayOptions{.threads = 1});
    auto b = Replay(trace, runs, ReplayOptions{.threads = 2});
    auto c = Replay(trace, runs, ReplayOptions{.threads = 5});
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    REQUIRE(c.ok());
    for (size_t i = 0; i < runs.size(); ++i) {
      INFO(runs[i].label << " budget " << runs[i].budget_fraction << " window " << window);
      CHECK((*a)[i].metrics().bound_violations() == 0);
      CHECK((*a)[i].SerializeAsString() == (*b)[i].SerializeAsString());
      CHECK((*a)[i].SerializeAsString() == (*c)[i].SerializeAsString());
    }
    // The full cache reproduces the reference output (up to the renormalisation by Σ p = 1 ± rounding).
    CHECK((*a)[0].metrics().output_rel_error_mean() < 1e-6);
  }
}

TEST_CASE("replay: the first read gets the layer's buffers already sized (faulted in on the workers)",
          "[replay]") {
  // Replay sizes the first layer's keys, values and queries (and zeroes the runs' accumulators) in
  // parallel before the first ReadLayer, which then writes into them; the results stay those of a replay
  // whose reader sizes them itself (every other test's), at any thread count.
  testing::TinyTraceSpec spec;
  spec.num_layers = 3;
  spec.num_heads = 6;
  spec.num_kv_heads = 2;
  spec.prefill_length = 40;
  spec.decode_steps = 9;
  spec.image_end = 30;
  spec.seed = 31;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  const LayerSizes want = ExpectedLayerSizes(trace.meta());
  REQUIRE(want.kv == 2u * (40 + 9) * trace.meta().model.head_dim);
  REQUIRE(want.queries == 6u * trace.meta().query_positions.size() * trace.meta().model.head_dim);
  std::vector<RunSpec> runs;
  for (const char* name : {"full", "snapkv", "hae"}) {  // hae: a first pass reads first
    auto p = PolicyRegistry::Default().Create(name);
    REQUIRE(p.ok());
    runs.push_back(RunSpec{*p, name, 0.25, 0, QuestionMode::kQueryAware});
  }
  auto serial = Replay(trace, runs, ReplayOptions{.threads = 1});
  REQUIRE(serial.ok());
  for (int threads : {1, 3}) {
    for (size_t n : {size_t{1}, runs.size()}) {
      testing::CountingTrace recorded(trace);
      auto got =
          Replay(recorded, std::span<const RunSpec>(runs.data(), n), ReplayOptions{.threads = threads});
      REQUIRE(got.ok());
      INFO("threads " << threads << " runs " << n);
      REQUIRE(recorded.handed.size() >= 2);
      CHECK(recorded.handed[0] == std::array<size_t, 3>{want.kv, want.kv, want.queries});
      for (size_t i = 0; i < n; ++i) CHECK((*got)[i].SerializeAsString() == (*serial)[i].SerializeAsString());
    }
  }
}

TEST_CASE("replay: a layer's results do not depend on the layers before it (recycled buffers)", "[replay]") {
  // Replay reuses the layer buffers, the worker scratch and a finished unit's references and top-k sums for
  // the next unit, across layers (PassBuffers). The same layers in reverse order hand every unit other
  // buffers' leftovers; each layer's results must not change.
  testing::TinyTraceSpec spec;
  spec.num_layers = 4;
  spec.num_heads = 6;
  spec.num_kv_heads = 2;
  spec.prefill_length = 40;
  spec.decode_steps = 9;
  spec.image_end = 30;
  spec.seed = 29;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  const int num_layers = trace.meta().model.num_layers;
  REQUIRE(num_layers == 4);
  MemoryTrace reversed = testing::MakeTinyTrace(spec);
  REQUIRE(reversed.Begin(trace.meta()).ok());
  for (int l = num_layers - 1; l >= 0; --l) {
    LayerData d;
    REQUIRE(trace.ReadLayer(l, &d).ok());
    d.layer = num_layers - 1 - l;
    REQUIRE(reversed.WriteLayer(d).ok());
  }
  std::vector<RunSpec> runs;
  // No future_attention policy (oracle): a unit keeps no sorted rows then, and its top-k sums come from
  // TopKSums (RegretSums), whose recycled storage is what this checks too.
  for (const char* name : {"full", "streaming_llm", "h2o", "snapkv", "snapkv+average"}) {
    auto p = PolicyRegistry::Default().Create(name);
    REQUIRE(p.ok());
    for (double b : {0.1, 0.5}) runs.push_back(RunSpec{*p, name, b, 0, QuestionMode::kQueryAware});
  }
  for (const int threads : {1, 3}) {
    auto a = Replay(trace, runs, ReplayOptions{.threads = threads});
    auto b = Replay(reversed, runs, ReplayOptions{.threads = threads});
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    for (size_t i = 0; i < runs.size(); ++i) {
      REQUIRE((*a)[i].layers_size() == num_layers);
      REQUIRE((*b)[i].layers_size() == num_layers);
      for (int l = 0; l < num_layers; ++l) {
        INFO(runs[i].label << " budget " << runs[i].budget_fraction << " layer " << l << " threads "
                           << threads);
        const LayerResult& x = (*a)[i].layers(l);
        const LayerResult& y = (*b)[i].layers(num_layers - 1 - l);
        CHECK(x.budget_tokens_mean() == y.budget_tokens_mean());
        CHECK(x.metrics().SerializeAsString() == y.metrics().SerializeAsString());
      }
    }
  }
}

TEST_CASE("replay: the oracle's k-th largest from the regret's buckets equals a selection in the row",
          "[replay]") {
  // FullKth answers from TopKSums::Kth when the unit has the buckets; the test switch makes it select in a
  // copy of each row instead (nth_element, independent of the buckets). Oracles at several budgets, with
  // and without decode growth, MHA, beside runs that set the buckets' kmax: every result equal.
  testing::TinyTraceSpec spec;
  spec.num_heads = 4;
  spec.num_kv_heads = 4;
  spec.prefill_length = 40;
  spec.decode_steps = 9;
  spec.image_end = 24;
  spec.seed = 41;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  std::vector<RunSpec> runs;
  for (const char* set : {"", "decode_growth=false", "decode_growth=true"}) {
    const std::string name = *set ? "oracle" : "snapkv";
    auto p = *set ? PolicyRegistry::Default().Create(name, std::vector<std::string>{set})
                  : PolicyRegistry::Default().Create(name);
    REQUIRE(p.ok());
    for (double b : {0.05, 0.2, 0.5, 0.9})
      runs.push_back(RunSpec{*p, name + " " + set, b, 0, QuestionMode::kQueryAware});
  }
  // Both bucket sources: each row's counts (RowBuckets::Kth, the units deferring their regrets) and
  // TopKSums::Kth (SetDeferredKthUnitsForTesting(false)).
  for (bool deferred : {true, false})
    for (int threads : {1, 3}) {
      SetDeferredKthUnitsForTesting(deferred);
      auto from_sums = Replay(trace, runs, ReplayOptions{.threads = threads});
      SetFullKthFromSumsForTesting(false);
      auto selected = Replay(trace, runs, ReplayOptions{.threads = threads});
      SetFullKthFromSumsForTesting(true);
      SetDeferredKthUnitsForTesting(true);
      REQUIRE(from_sums.ok());
      REQUIRE(selected.ok());
      for (size_t i = 0; i < runs.size(); ++i) {
        INFO(runs[i].label << " budget " << runs[i].budget_fraction << " threads " << threads
                           << (deferred ? " deferred" : ""));
        CHECK((*from_sums)[i].SerializeAsString() == (*selected)[i].SerializeAsString());
      }
    }
}

// The deferred-regret tests' trace: 4 query heads (MHA, or GQA on 2 KV heads with a sliding window of
// `window` tokens), 56 prompt tokens with an image at [4, 30), 13 decode steps.
MemoryTrace DeferralTrace(int window, uint64_t seed) {
  testing::TinyTraceSpec spec;
  spec.num_heads = 4;
  spec.num_kv_heads = window ? 2 : 4;
  spec.prefill_length = 56;
  spec.decode_steps = 13;
  spec.image_begin = 4;
  spec.image_end = 30;
  spec.seed = seed;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  if (window > 0) SetSlidingWindow(trace, window);
  return trace;
}

TEST_CASE("replay: units with an oracle deferring their regrets equal TopKSums at each step", "[replay]") {
  // A unit with an oracle run (it asks the k-th largest value at every step) defers its runs' regrets too
  // (FinishRegret with each row's bucket counts, RowBuckets::Sums) and answers the oracle's k-th largest
  // values from those counts (RowBuckets::Kth); the test switch makes it build TopKSums at Prefill, ask Sum
  // at each step and Kth from it (the old path). Oracles with and without decode growth beside capped runs
  // that defer (snapkv, streaming_llm, h2o, snapkv twice at one budget) and `full`, MHA and GQA (the
  // oracle's group threshold takes no k-th value there, the regrets are still deferred), with a sliding
  // window, at 1 and 3 threads: every result equal.
  for (int window : {0, 17}) {
    MemoryTrace trace = DeferralTrace(window, 53);
    std::vector<RunSpec> runs{RunSpec{Registered("full"), "full", 1.0, 0, QuestionMode::kQueryAware}};
    for (const char* set : {"decode_growth=false", "decode_growth=true"}) {
      auto p = PolicyRegistry::Default().Create("oracle", std::vector<std::string>{set});
      REQUIRE(p.ok());
      for (double b : {0.05, 0.2, 0.5})
        runs.push_back(RunSpec{*p, std::string("oracle ") + set, b, 0, QuestionMode::kQueryAware});
    }
    for (const char* name : {"snapkv", "streaming_llm", "h2o"})
      for (double b : {0.05, 0.2, 0.9})
        runs.push_back(RunSpec{Registered(name), name, b, 0, QuestionMode::kQueryAware});
    runs.push_back(RunSpec{Registered("snapkv"), "snapkv again", 0.2, 0, QuestionMode::kQueryAware});
    for (int threads : {1, 3}) {
      auto deferred = Replay(trace, runs, ReplayOptions{.threads = threads});
      SetDeferredKthUnitsForTesting(false);
      auto at_step = Replay(trace, runs, ReplayOptions{.threads = threads});
      SetDeferredKthUnitsForTesting(true);
      REQUIRE(deferred.ok());
      REQUIRE(at_step.ok());
      for (size_t i = 0; i < runs.size(); ++i) {
        INFO(runs[i].label << " budget " << runs[i].budget_fraction << ", window " << window << ", threads "
                           << threads);
        if (runs[i].budget_fraction <= 0.2 && runs[i].label.rfind("oracle", 0) != 0)
          CHECK((*deferred)[i].metrics().regret_vs_oracle_mean() > 0);
        CHECK((*deferred)[i].SerializeAsString() == (*at_step)[i].SerializeAsString());
      }
    }
  }
}

TEST_CASE("replay: the regret's top-k sums deferred to the unit's last run equal TopKSums at each step",
          "[replay]") {
  // Units whose runs ask no k-th largest value store each run's k and retained mass per row and answer
  // every row's k at the unit's end (FinishRegret, DescendingSums); the test switch makes them build
  // TopKSums at Prefill and ask Sum at each step. Capped runs at several budgets (the same policy and
  // budget twice: many runs asking the same k) and `full` (k = the row's length: no k deferred), MHA and
  // GQA, with a sliding window (rows starting past key 0), at 1 and 3 threads: every result equal.
  for (int window : {0, 17}) {
    MemoryTrace trace = DeferralTrace(window, 47);
    std::vector<RunSpec> runs{RunSpec{Registered("full"), "full", 1.0, 0, QuestionMode::kQueryAware}};
    for (const char* name : {"snapkv", "streaming_llm", "h2o"})
      for (double b : {0.05, 0.2, 0.5, 0.9})
        runs.push_back(RunSpec{Registered(name), name, b, 0, QuestionMode::kQueryAware});
    runs.push_back(RunSpec{Registered("snapkv"), "snapkv again", 0.2, 0, QuestionMode::kQueryAware});
    for (int threads : {1, 3}) {
      auto deferred = Replay(trace, runs, ReplayOptions{.threads = threads});
      SetDeferredTopKSumsForTesting(false);
      auto at_step = Replay(trace, runs, ReplayOptions{.threads = threads});
      SetDeferredTopKSumsForTesting(true);
      REQUIRE(deferred.ok());
      REQUIRE(at_step.ok());
      for (size_t i = 0; i < runs.size(); ++i) {
        INFO(runs[i].label << " budget " << runs[i].budget_fraction << ", window " << window << ", threads "
                           << threads);
        if (runs[i].budget_fraction <= 0.2) CHECK((*deferred)[i].metrics().regret_vs_oracle_mean() > 0);
        CHECK((*deferred)[i].SerializeAsString() == (*at_step)[i].SerializeAsString());
      }
    }
  }
}

TEST_CASE("replay: the reference rows' sums taken after their softmax equal the regret's own pass",
          "[replay]") {
  // RegretSums reads each row's total and modality sums from ComputeDecodeReference (ExactKindSums, after
  // the row's softmax) and gives AddRow the row's bit patterns; the test switch makes it add every row
  // again in its own order (key order by modality, the descending total). `full` alone (no top-k sums:
  // the total from the sort path) and beside capped runs (TopKSums), GQA, text and image tokens in several
  // runs (a sliding window too: rows starting past key 0), at 1 and 3 threads: every result equal.
  for (int window : {0, 21}) {
    testing::TinyTraceSpec spec;
    spec.num_heads = 4;
    spec.num_kv_heads = 2;
    spec.prefill_length = 48;
    spec.decode_steps = 11;
    spec.image_begin = 5;
    spec.image_end = 30;
    spec.seed = 43;
    MemoryTrace trace = testing::MakeTinyTrace(spec);
    if (window > 0) SetSlidingWindow(trace, window);
    const std::vector<std::vector<RunSpec>> sets{
        {RunSpec{Registered("full"), "full", 1.0, 0, QuestionMode::kQueryAware}},
        {RunSpec{Registered("full"), "full", 1.0, 0, QuestionMode::kQueryAware},
         RunSpec{Registered("snapkv"), "snapkv", 0.2, 0, QuestionMode::kQueryAware},
         RunSpec{Registered("streaming_llm"), "streaming", 0.1, 0, QuestionMode::kQueryAware},
         RunSpec{Registered("oracle"), "oracle", 0.3, 0, QuestionMode::kQueryAware}}};
    for (const std::vector<RunSpec>& runs : sets)
      for (int threads : {1, 3}) {
        auto fused = Replay(trace, runs, ReplayOptions{.threads = threads});
        SetExactRowSumsForTesting(false);
        auto again = Replay(trace, runs, ReplayOptions{.threads = threads});
        SetExactRowSumsForTesting(true);
        REQUIRE(fused.ok());
        REQUIRE(again.ok());
        for (size_t i = 0; i < runs.size(); ++i) {
          INFO(runs[i].label << " of " << runs.size() << ", window " << window << ", threads " << threads);
          CHECK((*fused)[i].SerializeAsString() == (*again)[i].SerializeAsString());
        }
      }
  }
}

TEST_CASE("replay: KV heads replayed in chunks give the same results as one chunk", "[replay]") {
  // LayerPass::Run replays 2 x threads KV heads at a time and frees a chunk's state before the next: with 8
  // KV heads, 1 thread is 4 chunks of 2, 3 threads are chunks of 6 and 2, 8 threads one chunk of 8.
  testing::TinyTraceSpec spec;
  spec.num_heads = 8;
  spec.num_kv_heads = 8;
  spec.prefill_length = 36;
  spec.decode_steps = 7;
  spec.image_end = 24;
  spec.seed = 31;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  std::vector<RunSpec> runs;
  for (const char* name : {"full", "streaming_llm", "h2o", "snapkv", "oracle", "look_m", "adakv"}) {
    auto p = PolicyRegistry::Default().Create(name);
    REQUIRE(p.ok());
    for (double b : {0.1, 0.5}) runs.push_back(RunSpec{*p, name, b, 0, QuestionMode::kQueryAware});
  }
  auto one = Replay(trace, runs, ReplayOptions{.threads = 8});
  REQUIRE(one.ok());
  for (int threads : {1, 3}) {
    auto chunked = Replay(trace, runs, ReplayOptions{.threads = threads});
    REQUIRE(chunked.ok());
    for (size_t i = 0; i < runs.size(); ++i) {
      INFO(runs[i].label << " budget " << runs[i].budget_fraction << " threads " << threads);
      CHECK((*one)[i].SerializeAsString() == (*chunked)[i].SerializeAsString());
    }
  }
  // The regret of the full cache is zero up to rounding (it keeps the best tokens: all of them).
  CHECK(std::abs((*one)[0].metrics().regret_vs_oracle_mean()) < 1e-6);
}

// A Prefill that throws (here: the policy's hook on one KV head) ends the replay with that exception at any
// thread count: the decode items waiting on that head's Prefill are woken and skipped, nothing hangs.
class ThrowingPrefillPolicy final : public Policy {
 public:
  explicit ThrowingPrefillPolicy(int bad_head) : bad_head_(bad_head) {}
  std::string name() const override { return "throwing"; }
  std::string ParamsText() const override { return ""; }
  PolicyRequirements requirements() const override { return {}; }
  bool evicts_during_decode() const override { return false; }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext&) const override {
    class Head final : public HeadPolicy {
     public:
      explicit Head(int bad_head) : bad_head_(bad_head) {}
      void OnPrefill(const HeadContext& ctx, int budget, HeadCache* cache) override {
        if (ctx.kv_head == bad_head_) throw std::runtime_error("prefill failed on purpose");
        cache->AssignRange(0, std::min(budget, ctx.compress_end));  // the other heads keep the first B tokens
      }

     private:
      int bad_head_;
    };
    return std::make_unique<Head>(bad_head_);
  }

 private:
  int bad_head_;
};

TEST_CASE("replay: a Prefill that throws ends the replay at any thread count", "[replay]") {
  testing::TinyTraceSpec spec;
  spec.num_heads = 8;
  spec.num_kv_heads = 8;
  spec.prefill_length = 36;
  spec.decode_steps = 7;
  spec.image_end = 24;
  spec.seed = 31;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  auto full = PolicyRegistry::Default().Create("full");
  REQUIRE(full.ok());
  for (int bad : {0, 5, 7}) {
    std::vector<RunSpec> runs{
        RunSpec{*full, "full", 0.5, 0, QuestionMode::kQueryAware},
        RunSpec{std::make_shared<ThrowingPrefillPolicy>(bad), "throwing", 0.5, 0, QuestionMode::kQueryAware}};
    for (int threads : {1, 2, 3}) {
      INFO("bad head " << bad << " threads " << threads);
      CHECK_THROWS_WITH(Replay(trace, runs, ReplayOptions{.threads = threads}), "prefill failed on purpose");
    }
  }
}

// Merging runs replayed together (several runs per KV head, MEDA compressing at the prefill hook, MEDA's
// official code at decode step 0, LOOK-M and a +average wrapper) give the bytes of each run replayed alone,
// at 1, 2 and 3 threads (chunks of 2, 4, 6 KV heads): nothing a run computes depends on the other runs of
// its head (docs/performance.md round 5 measured sharing their cosines between runs).
TEST_CASE("replay: merging runs together equal each run alone, at any thread count", "[replay]") {
  testing::TinyTraceSpec spec;
  spec.num_heads = 8;
  spec.num_kv_heads = 8;
  spec.prefill_length = 230;  // MEDA's official code keeps every text token + 100 recent ones: a long image
  spec.decode_steps = 6;
  spec.image_end = 210;
  spec.seed = 41;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  std::vector<RunSpec> runs;
  const std::vector<std::pair<const char*, std::vector<std::string>>> policies{
      {"meda", {}}, {"meda", {"variant=OFFICIAL_CODE"}}, {"look_m", {}}, {"snapkv+average", {}}};
  for (const auto& [name, sets] : policies) {
    auto p = PolicyRegistry::Default().Create(name, sets);
    REQUIRE(p.ok());
    for (double b : {0.1, 0.3, 0.6})
      runs.push_back(
          RunSpec{*p, name + std::string(sets.empty() ? "" : " official"), b, 0, QuestionMode::kQueryAware});
  }
  std::vector<std::string> alone;
  for (const RunSpec& r : runs) {
    auto one = Replay(trace, std::vector<RunSpec>{r}, ReplayOptions{.threads = 1});
    REQUIRE(one.ok());
    alone.push_back((*one)[0].SerializeAsString());
  }
  for (int threads : {1, 2, 3}) {
    auto together = Replay(trace, runs, ReplayOptions{.threads = threads});
    REQUIRE(together.ok());
    for (size_t i = 0; i < runs.size(); ++i) {
      INFO(runs[i].label << " budget " << runs[i].budget_fraction << " threads " << threads);
      CHECK((*together)[i].metrics().merged_tokens_mean() > 0);
      CHECK((*together)[i].SerializeAsString() == alone[i]);
    }
  }
}

// One policy x budgets: MEDA's official code (compresses in its decode item) has its decode items handed out
// budget-major over a chunk's units (LayerPass::Run), the others unit-major. Either way every run equals the
// run alone, at any thread count.
TEST_CASE("replay: one policy x budgets (budget-major items) equals each run alone, at any thread count",
          "[replay]") {
  testing::TinyTraceSpec spec;
  spec.num_heads = 8;
  spec.num_kv_heads = 4;
  spec.prefill_length = 230;
  spec.decode_steps = 6;
  spec.image_end = 210;
  spec.seed = 43;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  const std::vector<std::pair<const char*, std::vector<std::string>>> policies{
      {"meda", {"variant=OFFICIAL_CODE"}}, {"look_m", {}}, {"h2o", {}}};
  for (const auto& [name, sets] : policies) {
    auto p = PolicyRegistry::Default().Create(name, sets);
    REQUIRE(p.ok());
    std::vector<RunSpec> runs;
    for (double b : {0.6, 0.1, 0.3, 0.2}) runs.push_back(RunSpec{*p, name, b, 0, QuestionMode::kQueryAware});
    std::vector<std::string> alone;
    for (const RunSpec& r : runs) {
      auto one = Replay(trace, std::vector<RunSpec>{r}, ReplayOptions{.threads = 1});
      REQUIRE(one.ok());
      alone.push_back((*one)[0].SerializeAsString());
    }
    for (int threads : {1, 2, 3, 8}) {
      auto together = Replay(trace, runs, ReplayOptions{.threads = threads});
      REQUIRE(together.ok());
      for (size_t i = 0; i < runs.size(); ++i) {
        INFO(name << " budget " << runs[i].budget_fraction << " threads " << threads);
        CHECK((*together)[i].metrics().samples() > 0);
        CHECK((*together)[i].SerializeAsString() == alone[i]);
      }
    }
  }
}

// No runs: every layer's Prefill items and no decode item. One KV head: one unit per layer, fewer units than
// workers. Both at 1, 2 and 3 threads.
TEST_CASE("replay: no runs, and one KV head, at any thread count", "[replay]") {
  testing::TinyTraceSpec spec;
  spec.num_heads = 2;
  spec.num_kv_heads = 1;
  spec.prefill_length = 30;
  spec.decode_steps = 5;
  spec.image_end = 20;
  spec.seed = 59;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  for (int threads : {1, 3}) {
    auto none = Replay(trace, std::vector<RunSpec>{}, ReplayOptions{.threads = threads});
    REQUIRE(none.ok());
    CHECK(none->empty());
  }
  std::vector<RunSpec> runs;
  for (const char* name : {"full", "streaming_llm", "h2o", "look_m"}) {
    auto p = PolicyRegistry::Default().Create(name);
    REQUIRE(p.ok());
    runs.push_back(RunSpec{*p, name, 0.3, 0, QuestionMode::kQueryAware});
  }
  auto one = Replay(trace, runs, ReplayOptions{.threads = 1});
  REQUIRE(one.ok());
  for (int threads : {2, 3}) {
    auto res = Replay(trace, runs, ReplayOptions{.threads = threads});
    REQUIRE(res.ok());
    for (size_t i = 0; i < runs.size(); ++i) {
      INFO(runs[i].label << " threads " << threads);
      CHECK((*res)[i].SerializeAsString() == (*one)[i].SerializeAsString());
    }
  }
}

// Keeps the first B tokens; before decode step `step` on KV head `head` (-1: every head) it throws
// `message`.
class ThrowingStepPolicy final : public Policy {
 public:
  ThrowingStepPolicy(int head, int step, std::string message)
      : head_(head), step_(step), message_(std::move(message)) {}
  std::string name() const override { return "throwing_step"; }
  std::string ParamsText() const override { return ""; }
  PolicyRequirements requirements() const override { return {}; }
  bool evicts_during_decode() const override { return false; }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext&) const override {
    class Head final : public HeadPolicy {
     public:
      explicit Head(const ThrowingStepPolicy& p) : p_(p) {}
      void OnPrefill(const HeadContext& ctx, int budget, HeadCache* cache) override {
        cache->AssignRange(0, std::min(budget, ctx.compress_end));
      }
      void BeforeStep(const HeadContext& ctx, const StepAttention& att, int, HeadCache*) override {
        if ((p_.head_ < 0 || ctx.kv_head == p_.head_) && att.step == p_.step_)
          throw std::runtime_error(p_.message_);
      }

     private:
      const ThrowingStepPolicy& p_;
    };
    return std::make_unique<Head>(*this);
  }

 private:
  int head_, step_;
  std::string message_;
};

// A run whose decode step throws fails the replay with its exception at any thread count. Two runs throw: the
// earlier one in run order at a later step; the replay reports the earlier run's error (the lowest work item
// that threw), not the one thrown first in time. An engine that steps a KV head's runs together must keep
// this (docs/performance.md, "Round 8: a unit's runs stepped together").
TEST_CASE("replay: a decode step that throws ends the replay with the lowest run's error", "[replay]") {
  testing::TinyTraceSpec spec;
  spec.num_heads = 4;
  spec.num_kv_heads = 4;
  spec.prefill_length = 36;
  spec.decode_steps = 7;
  spec.image_end = 24;
  spec.seed = 61;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  auto full = PolicyRegistry::Default().Create("full");
  auto h2o = PolicyRegistry::Default().Create("h2o");
  REQUIRE(full.ok());
  REQUIRE(h2o.ok());
  for (int bad : {-1, 0, 3}) {
    std::vector<RunSpec> runs{RunSpec{*full, "full", 0.5, 0, QuestionMode::kQueryAware},
                              RunSpec{std::make_shared<ThrowingStepPolicy>(bad, 5, "run 1 failed at step 5"),
                                      "a", 0.5, 0, QuestionMode::kQueryAware},
                              RunSpec{*h2o, "h2o", 0.3, 0, QuestionMode::kQueryAware},
                              RunSpec{std::make_shared<ThrowingStepPolicy>(bad, 1, "run 3 failed at step 1"),
                                      "b", 0.5, 0, QuestionMode::kQueryAware}};
    for (int threads : {1, 2, 3}) {
      INFO("bad head " << bad << " threads " << threads);
      CHECK_THROWS_WITH(Replay(trace, runs, ReplayOptions{.threads = threads}), "run 1 failed at step 5");
    }
    // Without the earlier thrower, the later one's error.
    runs.erase(runs.begin() + 1);
    for (int threads : {1, 3}) {
      INFO("bad head " << bad << " threads " << threads);
      CHECK_THROWS_WITH(Replay(trace, runs, ReplayOptions{.threads = threads}), "run 3 failed at step 1");
    }
  }
}

// Records every DecisionRecorder call per (run, layer, KV head) unit, in call order.
class UnitLogRecorder final : public DecisionRecorder {
 public:
  void AfterPrefill(int run, int layer, int kv_head, const HeadCache& cache) override {
    Log(run, layer, kv_head, "prefill", -1, cache);
  }
  void BeforeAttention(int run, int layer, int kv_head, int step, const HeadCache& cache) override {
    Log(run, layer, kv_head, "attend", step, cache);
  }
  void AfterStep(int run, int layer, int kv_head, int step, const HeadCache& cache) override {
    Log(run, layer, kv_head, "after", step, cache);
  }
  std::map<std::tuple<int, int, int>, std::vector<std::string>> log;

 private:
  void Log(int run, int layer, int kv_head, const char* what, int step, const HeadCache& cache) {
    std::string e = std::string(what) + " " + std::to_string(step) + ":";
    for (int32_t t : cache.tokens()) e += " " + std::to_string(t);
    std::lock_guard<std::mutex> lock(mu_);
    log[{run, layer, kv_head}].push_back(e);
  }
  std::mutex mu_;
};

// The recorder sees each (run, layer, KV head) unit's calls in event order at any thread count (the
// contract is per unit: calls of different units may be concurrent).
TEST_CASE("replay: the decision recorder sees each unit's calls in event order", "[replay]") {
  testing::TinyTraceSpec spec;
  spec.num_heads = 4;
  spec.num_kv_heads = 2;
  spec.prefill_length = 36;
  spec.decode_steps = 6;
  spec.image_end = 24;
  spec.seed = 67;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  std::vector<RunSpec> runs;
  for (const char* name : {"full", "streaming_llm", "h2o", "look_m"}) {
    auto p = PolicyRegistry::Default().Create(name);
    REQUIRE(p.ok());
    runs.push_back(RunSpec{*p, name, 0.3, 0, QuestionMode::kQueryAware});
  }
  UnitLogRecorder ref;
  REQUIRE(Replay(trace, runs, ReplayOptions{.threads = 1, .recorder = &ref}).ok());
  REQUIRE(ref.log.size() == runs.size() * spec.num_layers * spec.num_kv_heads);
  for (const auto& [unit, calls] : ref.log) {
    REQUIRE(calls.size() == 1 + 2 * static_cast<size_t>(spec.decode_steps));
    CHECK(calls[0].rfind("prefill -1:", 0) == 0);
    for (int t = 0; t < spec.decode_steps; ++t) {
      CHECK(calls[1 + 2 * t].rfind("attend " + std::to_string(t) + ":", 0) == 0);
      CHECK(calls[2 + 2 * t].rfind("after " + std::to_string(t) + ":", 0) == 0);
    }
  }
  for (int threads : {2, 3}) {
    INFO("threads " << threads);
    UnitLogRecorder rec;
    REQUIRE(Replay(trace, runs, ReplayOptions{.threads = threads, .recorder = &rec}).ok());
    CHECK(rec.log == ref.log);
  }
}

// Merges pairs of compressible tokens once at prefill (each even token's slot holds the pair's averaged key
// and value); `touch_steps` lists decode steps before which the policy sets slot 0's merge again to the same
// content, which changes the cache's version without changing what attention sees.
class PairMergePolicy final : public Policy {
 public:
  explicit PairMergePolicy(std::vector<int> touch_steps) : touch_(std::move(touch_steps)) {}
  std::string name() const override { return "pair_merge"; }
  std::string ParamsText() const override { return ""; }
  PolicyRequirements requirements() const override { return {.decode_attention = true}; }
  bool evicts_during_decode() const override { return false; }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext&) const override {
    class Head final : public HeadPolicy {
     public:
      explicit Head(std::vector<int> touch) : touch_(std::move(touch)) {}
      void OnPrefill(const HeadContext& ctx, int, HeadCache* cache) override {
        const int d = ctx.head_dim(), ce = ctx.compress_end;
        std::vector<int32_t> even;
        for (int32_t j = 0; j < ce; j += 2) even.push_back(j);
        cache->Assign(even);
        for (int s = 0; s < static_cast<int>(even.size()); ++s) {
          const int32_t j = even[s];
          if (j + 1 >= ce) continue;
          MergedSlot m;
          m.key.resize(d);
          m.value.resize(d);
          for (int c = 0; c < d; ++c) {
            m.key[c] = 0.5f * (ctx.keys[j * d + c] + ctx.keys[(j + 1) * d + c]);
            m.value[c] = 0.5f * (ctx.values[j * d + c] + ctx.values[(j + 1) * d + c]);
          }
          m.members = {{j + 1, 0.5f}};
          cache->SetMerge(s, std::move(m));
        }
      }
      void BeforeStep(const HeadContext&, const StepAttention& att, int, HeadCache* cache) override {
        if (std::find(touch_.begin(), touch_.end(), att.step) == touch_.end()) return;
        REQUIRE(cache->is_merged(0));
        MergedSlot same = cache->merged(0);
        cache->SetMerge(0, std::move(same));
      }

     private:
      std::vector<int> touch_;
    };
    return std::make_unique<Head>(touch_);
  }

 private:
  std::vector<int> touch_;
};

// The engine computes a merged slot's dots and value contribution for all steps at once while the cache's
// version is unchanged since the previous step (one product instead of one Dot per step), and per step
// otherwise. The same merged content gives the same metrics both ways up to float rounding (the products
// sum in another order), whichever steps break the blocks (a block's first step, a block cut short, a block
// that runs out and is renewed), with GQA and a sliding window, and bit-identically at any thread count.
TEST_CASE("replay: merged slots in bulk match the per-step path up to rounding", "[replay][merge]") {
  testing::TinyTraceSpec spec;
  spec.num_heads = 6;
  spec.num_kv_heads = 2;
  spec.prefill_length = 40;
  spec.decode_steps = 23;
  spec.image_end = 30;
  spec.seed = 41;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  std::vector<int> every(spec.decode_steps);
  std::iota(every.begin(), every.end(), 0);
  const std::vector<std::vector<int>> touches = {
      every,        // a new version at every step: always the per-step path (the reference here)
      {},           // merged once: one block from step 0
      {3, 4, 9},    // blocks cut short, a per-step stretch, then blocks of 6, 12 ... renewed when used up
      {1, 2, 3, 5}  // alternating
  };
  for (int window : {0, 17}) {
    TraceMeta meta = trace.meta();
    meta.model.sliding_window = window;
    std::vector<LayerData> layers;
    for (int l = 0; l < meta.model.num_layers; ++l) {
      LayerData d;
      REQUIRE(trace.ReadLayer(l, &d).ok());
      d.layer = l;
      layers.push_back(d);
    }
    MemoryTrace t2(meta, layers);
    std::vector<RunSpec> runs;
    for (const auto& touch : touches)
      runs.push_back(RunSpec{std::make_shared<PairMergePolicy>(touch), "", 0, 30, QuestionMode::kQueryAware});
    auto a = Replay(t2, runs, ReplayOptions{.threads = 1});
    auto b = Replay(t2, runs, ReplayOptions{.threads = 3});
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    const Metrics& ref = (*a)[0].metrics();
    REQUIRE(ref.merged_weight_over_mass_mean() > 0);
    REQUIRE(ref.output_rel_error_mean() > 1e-3);
    for (size_t i = 0; i < runs.size(); ++i) {
      INFO("touch variant " << i << " window " << window);
      CHECK((*a)[i].SerializeAsString() == (*b)[i].SerializeAsString());
      const Metrics& m = (*a)[i].metrics();
      CHECK(m.output_rel_error_mean() == Approx(ref.output_rel_error_mean()).epsilon(1e-5));
      CHECK(m.merged_weight_over_mass_mean() == Approx(ref.merged_weight_over_mass_mean()).epsilon(1e-5));
      CHECK(m.retained_mass_mean() == ref.retained_mass_mean());
      CHECK(m.covered_mass_mean() == ref.covered_mass_mean());
      for (int l = 0; l < meta.model.num_layers; ++l)
        CHECK((*a)[i].layers(l).metrics().output_rel_error_mean() ==
              Approx((*a)[0].layers(l).metrics().output_rel_error_mean()).epsilon(1e-5));
    }
  }
}

// Covers the compressible prompt with groups of 1, 2, ..., 12 consecutive tokens (cycling), every fourth
// group evicted. As merges (plain = false): each kept group is one slot anchored at its first token, whose
// other tokens are members in a scrambled order (so member sums see 0..11 members: the 4-lane split and its
// tail); the key and value are the anchor's. As plain slots (plain = true): every kept token as itself. Both
// cover the same tokens, so a step's covered mass is the same sum. `touch_steps` as in PairMergePolicy.
class GroupMergePolicy final : public Policy {
 public:
  GroupMergePolicy(std::vector<int> touch_steps, bool plain)
      : touch_(std::move(touch_steps)), plain_(plain) {}
  std::string name() const override { return plain_ ? "group_plain" : "group_merge"; }
  std::string ParamsText() const override { return ""; }
  PolicyRequirements requirements() const override { return {.decode_attention = true}; }
  bool evicts_during_decode() const override { return false; }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext&) const override {
    class Head final : public HeadPolicy {
     public:
      Head(std::vector<int> touch, bool plain) : touch_(std::move(touch)), plain_(plain) {}
      void OnPrefill(const HeadContext& ctx, int, HeadCache* cache) override {
        const int d = ctx.head_dim(), ce = ctx.compress_end;
        std::vector<std::vector<int32_t>> groups;
        for (int32_t j = 0, size = 1; j < ce; j += size, size = size % 12 + 1) {
          std::vector<int32_t> g;
          for (int32_t i = j; i < std::min(ce, j + size); ++i) g.push_back(i);
          if (groups.size() % 4 != 3)
            groups.push_back(g);
          else
            groups.emplace_back();  // evicted
        }
        std::vector<int32_t> tokens;
        for (const auto& g : groups) {
          if (plain_)
            tokens.insert(tokens.end(), g.begin(), g.end());
          else if (!g.empty())
            tokens.push_back(g[0]);
        }
        cache->Assign(tokens);
        if (plain_) return;
        int s = 0;
        for (size_t gi = 0; gi < groups.size(); ++gi) {
          const auto& g = groups[gi];
          if (g.empty()) continue;
          if (g.size() > 1) {
            MergedSlot m;
            m.key.assign(ctx.keys + static_cast<size_t>(g[0]) * d,
                         ctx.keys + static_cast<size_t>(g[0] + 1) * d);
            m.value.assign(ctx.values + static_cast<size_t>(g[0]) * d,
                           ctx.values + static_cast<size_t>(g[0] + 1) * d);
            std::vector<int32_t> rest(g.begin() + 1, g.end());
            std::reverse(rest.begin(), rest.end());
            std::rotate(rest.begin(), rest.begin() + gi % rest.size(), rest.end());
            for (int32_t tok : rest) m.members.emplace_back(tok, 1.0f);
            cache->SetMerge(s, std::move(m));
          }
          ++s;
        }
      }
      void BeforeStep(const HeadContext&, const StepAttention& att, int, HeadCache* cache) override {
        if (plain_ || std::find(touch_.begin(), touch_.end(), att.step) == touch_.end()) return;
        REQUIRE(cache->is_merged(1));
        MergedSlot same = cache->merged(1);
        cache->SetMerge(1, std::move(same));
      }

     private:
      std::vector<int> touch_;
      bool plain_;
    };
    return std::make_unique<Head>(touch_, plain_);
  }

 private:
  std::vector<int> touch_;
  bool plain_;
};

// A merged slot's member sums Σ_{j ∈ members} p_t[j] (its covered mass beyond the anchor) are computed per
// step on the per-step path and for a chunk of steps at once in a block (MemberSums): the same additions in
// the same order, so the covered masses agree exactly, whichever steps start blocks and chunks (blocks of 40
// steps span three 16-step chunks; touched steps cut them), with GQA and a sliding window; and both agree
// with the covered mass of the same tokens kept as plain slots (another summation order: to rounding;
// without a window).
TEST_CASE("replay: merged slots' member sums in blocks equal the per-step sums exactly", "[replay][merge]") {
  testing::TinyTraceSpec spec;
  spec.num_heads = 6;
  spec.num_kv_heads = 2;
  spec.prefill_length = 90;
  spec.decode_steps = 40;
  spec.image_end = 60;
  spec.seed = 43;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  std::vector<int> every(spec.decode_steps);
  std::iota(every.begin(), every.end(), 0);
  const std::vector<std::vector<int>> touches = {every, {}, {3, 4, 9, 20}, {1, 2, 3, 5, 17, 35}};
  for (int window : {0, 17}) {
    TraceMeta meta = trace.meta();
    meta.model.sliding_window = window;
    std::vector<LayerData> layers;
    for (int l = 0; l < meta.model.num_layers; ++l) {
      LayerData d;
      REQUIRE(trace.ReadLayer(l, &d).ok());
      d.layer = l;
      layers.push_back(d);
    }
    MemoryTrace t2(meta, layers);
    std::vector<RunSpec> runs;
    for (const auto& touch : touches)
      runs.push_back(
          RunSpec{std::make_shared<GroupMergePolicy>(touch, false), "", 0, 60, QuestionMode::kQueryAware});
    runs.push_back(RunSpec{std::make_shared<GroupMergePolicy>(std::vector<int>{}, true), "", 0, 90,
                           QuestionMode::kQueryAware});
    auto a = Replay(t2, runs, ReplayOptions{.threads = 1});
    auto b = Replay(t2, runs, ReplayOptions{.threads = 3});
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    const Metrics& ref = (*a)[0].metrics();
    const Metrics& plain = (*a)[touches.size()].metrics();
    REQUIRE(plain.merged_tokens_mean() == 0);
    REQUIRE(plain.covered_mass_mean() < 0.99);  // the evicted groups are not covered
    REQUIRE(ref.merged_tokens_mean() > 0);
    // With a sliding window a merged slot whose anchor fell out of it is masked whole (members included),
    // so the plain-slot comparison holds without a window only.
    if (window == 0) CHECK(ref.covered_mass_mean() == Approx(plain.covered_mass_mean()).epsilon(1e-6));
    CHECK(ref.covered_mass_mean() > ref.retained_mass_mean() + 0.1);  // the members' mass counts
    for (size_t i = 0; i < runs.size(); ++i) {
      INFO("variant " << i << " window " << window);
      CHECK((*a)[i].SerializeAsString() == (*b)[i].SerializeAsString());
      if (i == touches.size()) continue;
      const Metrics& m = (*a)[i].metrics();
      CHECK(m.covered_mass_mean() == ref.covered_mass_mean());
      CHECK(m.retained_mass_mean() == ref.retained_mass_mean());
      for (int l = 0; l < meta.model.num_layers; ++l) {
        CHECK((*a)[i].layers(l).metrics().covered_mass_mean() ==
              (*a)[0].layers(l).metrics().covered_mass_mean());
        if (window == 0)
          CHECK((*a)[i].layers(l).metrics().covered_mass_mean() ==
                Approx((*a)[touches.size()].layers(l).metrics().covered_mass_mean()).epsilon(1e-6));
      }
    }
  }
}

}  // namespace
}  // namespace kvsim

namespace kvsim {

TEST_CASE("ReplayQueryRows: decode rows, windows, prompt rows only for the runs that need them", "[replay]") {
  MemoryTrace tr = testing::MakeTinyTrace();  // n = 24, 6 decode steps, every query stored
  TraceMeta meta = tr.meta();
  meta.has_prefill_column_sums = true;
  auto rows = [&](std::vector<RunSpec> runs, bool first_pass) {
    return ReplayQueryRows(meta, runs, first_pass).Text();
  };
  CHECK(rows({RunSpec{Registered("full"), "", 0.5, 0}}, false) == "[24, 30)");
  CHECK(rows({RunSpec{Registered("streaming_llm"), "", 0.5, 0}}, false) == "[24, 30)");
  // snapkv's window ends where the compressible region ends; query-agnostic mode ends before the question.
  CHECK(rows({RunSpec{Registered("snapkv", {"window=8"}), "", 0.5, 0}}, false) == "[16, 30)");
  CHECK(rows({RunSpec{Registered("snapkv", {"window=8"}), "", 0.5, 0, QuestionMode::kQueryAgnostic}},
             false) == "[12, 20) [24, 30)");
  // h2o's column sums are recorded for the whole prompt; before the question they are recomputed.
  CHECK(rows({RunSpec{Registered("h2o"), "", 0.5, 0}}, false) == "[24, 30)");
  CHECK(rows({RunSpec{Registered("h2o"), "", 0.5, 0, QuestionMode::kQueryAgnostic}}, false) ==
        "[0, 20) [24, 30)");
  meta.has_prefill_column_sums = false;  // then every prompt row
  CHECK(rows({RunSpec{Registered("h2o"), "", 0.5, 0}}, false) == "[0, 30)");
  meta.has_prefill_column_sums = true;
  // First pass: only the first-pass policies' rows (meda reads every prompt query; adakv its window).
  CHECK(rows({RunSpec{Registered("snapkv"), "", 0.5, 0}}, true) == "none");
  CHECK(rows({RunSpec{Registered("meda"), "", 0.5, 0}}, true) == "[0, 24)");
  CHECK(rows({RunSpec{Registered("adakv", {"window=4"}), "", 0.5, 0}}, true) == "[20, 24)");
  // The replay itself: meda's prompt queries serve only its first pass; its column sums are recorded here
  // (query-aware), recomputed from every context query before the question.
  CHECK(rows({RunSpec{Registered("meda"), "", 0.5, 0}}, false) == "[24, 30)");
  CHECK(rows({RunSpec{Registered("meda"), "", 0.5, 0, QuestionMode::kQueryAgnostic}}, false) ==
        "[0, 20) [24, 30)");
  CHECK(rows({RunSpec{Registered("hae"), "", 0.5, 0}}, false) == "[24, 30)");
  // Per layer: hae's first pass reads its prompt rows only at dap_layer; adakv's window at every layer.
  const std::vector<RunSpec> hae_adakv{RunSpec{Registered("hae", {"dap_layer=1"}), "", 0.5, 0},
                                       RunSpec{Registered("adakv", {"window=4"}), "", 0.5, 0}};
  CHECK(ReplayQueryRows(meta, hae_adakv, true, 1).Text() == "[0, 24)");
  CHECK(ReplayQueryRows(meta, hae_adakv, true, 0).Text() == "[20, 24)");
  CHECK(ReplayQueryRows(meta, hae_adakv, true).Text() == "[0, 24)");  // any layer
  CHECK(ReplayQueryRows(meta, {hae_adakv.data(), 1}, true, 0).Text() == "none");
  // Recorded prompt entropies of the compressible region: meda's first pass reads no layer, so no row; the
  // entropy of the head-averaged attention is not recorded and still needs every prompt query.
  meta.prompt_entropy_regions = {meta.prefill_length};
  meta.prompt_entropies.assign(
      static_cast<size_t>(meta.model.num_layers) * kNumPromptEntropyKinds * meta.model.num_heads, 1.0);
  CHECK(rows({RunSpec{Registered("meda"), "", 0.5, 0}}, true) == "none");
  CHECK(
      ReplayQueryRows(meta, std::vector<RunSpec>{RunSpec{Registered("meda"), "", 0.5, 0}}, true, 0).Text() ==
      "none");
  CHECK(rows({RunSpec{Registered("meda", {"head_averaging=ENTROPY_OF_MEAN_ATTENTION"}), "", 0.5, 0}}, true) ==
        "[0, 24)");
  // Query-agnostic: that region's entropies are not recorded here.
  CHECK(rows({RunSpec{Registered("meda"), "", 0.5, 0, QuestionMode::kQueryAgnostic}}, true) == "[0, 20)");
}

// Every text policy on an HDF5 trace read with only the rows ReplayQueryRows names (direct chunk reads, 1 and
// 3 threads) gives the same results as the in-memory trace: no policy reads a row it did not ask for (that
// would abort), and no row is read wrong.
TEST_CASE("replay: reading only the needed query rows from a file changes no result", "[replay][hdf5]") {
  testing::TinyTraceSpec spec;
  spec.num_heads = 4;
  spec.num_kv_heads = 2;
  spec.prefill_length = 40;
  spec.decode_steps = 7;
  spec.image_end = 30;
  MemoryTrace trace = testing::MakeTinyTrace(spec);
  const std::string path = testing::ScratchDir("replay_rows") + "/t.h5";
  {
    auto w = Hdf5TraceWriter::Create(path, Hdf5WriteOptions{.chunk_tokens = 9});
    REQUIRE(w.ok());
    REQUIRE((*w)->Begin(trace.meta()).ok());
    for (const LayerData& l : trace.layers()) REQUIRE((*w)->WriteLayer(l).ok());
    REQUIRE((*w)->Finish().ok());
  }
  std::vector<RunSpec> runs;
  for (const char* name : {"full", "streaming_llm", "h2o", "snapkv", "pyramidkv", "adakv", "oracle", "meda",
                           "look_m", "madakv", "hae"})
    for (QuestionMode mode : {QuestionMode::kQueryAware, QuestionMode::kQueryAgnostic})
      runs.push_back(RunSpec{Registered(name, {}), name, 0.3, 0, mode});
  auto file = Hdf5TraceReader::Open(path);
  REQUIRE(file.ok());
  // The same values in memory (fp16 rounded), every row read through H5Dread.
  MemoryTrace stored((*file)->meta(), {});
  for (int l = 0; l < stored.meta().model.num_layers; ++l) {
    LayerData d;
    REQUIRE((*file)->ReadLayer(l, &d, LayerReadOptions{.direct_chunks = false}).ok());
    stored.layers().push_back(d);
  }
  auto mem = Replay(stored, runs, ReplayOptions{.threads = 1});
  REQUIRE(mem.ok());
  for (int threads : {1, 3}) {
    auto res = Replay(**file, runs, ReplayOptions{.threads = threads});
    REQUIRE(res.ok());
    for (size_t i = 0; i < runs.size(); ++i) {
      INFO(runs[i].label << " threads " << threads);
      RunResult a = (*mem)[i], b = (*res)[i];
      a.clear_trace_path();
      b.clear_trace_path();
      CHECK(a.SerializeAsString() == b.SerializeAsString());
    }
  }
}

// MEDA on a trace that records its aggregates (prompt entropies, prefill column sums) and stores only the
// last W prompt queries: the first pass reads no layer, the replay no prompt row, and the results equal
// those on the same trace with every query stored. What the recorded aggregates cannot replace is refused
// with a message naming the policy, what is missing and the fix.
TEST_CASE("replay: meda with recorded entropies runs on a window-only trace", "[replay][hdf5][meda]") {
  auto synth = [](bool window_only) {
    auto config = ParseSynthConfig(
        std::string(R"pb(
          model {
            name: "mini"
            family: "llama"
            num_layers: 4
            num_heads: 4
            num_kv_heads: 2
            head_dim: 32
            rope_theta: 10000
          }
          layout {
            segments { kind: TEXT role: SYSTEM tokens: 10 }
            segments { kind: IMAGE role: CONTEXT rows: 6 cols: 6 repeat: 2 text_between: 6 }
            segments { kind: TEXT role: QUESTION tokens: 8 }
            decode_steps: 9
          }
          storage { dtype: "float16" record_prefill_column_sums: true record_prompt_entropies: true)pb") +
            (window_only ? " query_storage: WINDOW query_window: 16" : " query_storage: ALL") + R"pb(}
                                                                                                     profile { num_sinks: 2 dense_layers: 1 }
          seed: 5)pb",
        "window test");
    INFO(config.status().message());
    REQUIRE(config.ok());
    MemoryTrace trace;
    REQUIRE(Synthesize(*config, &trace, 2).ok());
    return trace;
  };
  MemoryTrace all = synth(false), window = synth(true);
  REQUIRE(all.meta().HasAllPromptQueries());
  REQUIRE_FALSE(window.meta().HasAllPromptQueries());
  const std::string path = testing::ScratchDir("replay_rows_window") + "/w.h5";
  {
    auto w = Hdf5TraceWriter::Create(path, Hdf5WriteOptions{.chunk_tokens = 7});
    REQUIRE(w.ok());
    REQUIRE((*w)->Begin(window.meta()).ok());
    for (const LayerData& l : window.layers()) REQUIRE((*w)->WriteLayer(l).ok());
    REQUIRE((*w)->Finish().ok());
  }
  auto file = Hdf5TraceReader::Open(path);
  REQUIRE(file.ok());
  std::vector<RunSpec> runs;
  for (double b : {0.2, 0.5}) {
    runs.push_back(RunSpec{Registered("meda"), "meda", b, 0});
    runs.push_back(RunSpec{Registered("meda", {"variant=OFFICIAL_CODE"}), "meda-code", b, 0});
    runs.push_back(RunSpec{Registered("meda", {"entropy=FULL_SELF"}), "meda-self", b, 0});
    runs.push_back(RunSpec{Registered("snapkv", {"window=8"}), "snapkv", b, 0});
    runs.push_back(RunSpec{Registered("hae", {"components=DDES_ONLY"}), "hae-ddes", b, 0});
  }
  for (const RunSpec& r : runs) CHECK(ReplayQueryRows((*file)->meta(), {&r, 1}, true).Text() == "none");
  auto ref = Replay(all, runs, ReplayOptions{.threads = 1});
  REQUIRE(ref.ok());
  for (int threads : {1, 3}) {
    auto res = Replay(**file, runs, ReplayOptions{.threads = threads});
    INFO(res.status().message());
    REQUIRE(res.ok());
    for (size_t i = 0; i < runs.size(); ++i) {
      INFO(runs[i].label << " budget " << runs[i].budget_fraction << " threads " << threads);
      RunResult a = (*ref)[i], b = (*res)[i];
      a.clear_trace_path();
      b.clear_trace_path();
      CHECK(a.SerializeAsString() == b.SerializeAsString());
    }
  }
  auto refused = [&](RunSpec r) {
    const Status s = CheckRuns((*file)->meta(), {&r, 1});
    REQUIRE_FALSE(s.ok());
    return std::string(s.message());
  };
  // The head-averaged attention's entropy is not recorded: every prompt query, and nothing else helps.
  std::string m =
      refused(RunSpec{Registered("meda", {"head_averaging=ENTROPY_OF_MEAN_ATTENTION"}), "x", 0.2, 0});
  CHECK(m.find("meda's first pass reads the query of every prompt token in 4 layers") != std::string::npos);
  CHECK(m.find("only the last 16 prompt tokens") != std::string::npos);
  CHECK(m.find("query_storage: ALL") != std::string::npos);
  CHECK(m.find("record prompt entropies") == std::string::npos);
  // HAE's DAP reads the prompt queries of its one dap_layer.
  m = refused(RunSpec{Registered("hae"), "x", 0.2, 0});
  CHECK(m.find("hae's first pass reads the query of every prompt token in 1 layer,") != std::string::npos);
  CHECK(m.find("components=DDES_ONLY") != std::string::npos);
  // Query-agnostic meda: the entropies of the context are recorded, its column sums are not.
  m = refused(RunSpec{Registered("meda"), "x", 0.2, 0, QuestionMode::kQueryAgnostic});
  CHECK(m.find("column sums over all context queries") != std::string::npos);
  // Without recorded entropies the fix names them.
  TraceMeta no_entropies = (*file)->meta();
  no_entropies.prompt_entropy_regions.clear();
  no_entropies.prompt_entropies.clear();
  const RunSpec meda{Registered("meda"), "x", 0.2, 0};
  const Status s = CheckRuns(no_entropies, {&meda, 1});
  REQUIRE_FALSE(s.ok());
  CHECK(std::string(s.message()).find("or record prompt entropies") != std::string::npos);
}

// The engine's cache check after evictions: it looks only at the slots appended since its last check when
// nothing but evictions and appends happened, and must still catch a token held twice (appended again, or
// merged in), a token from the future, and accept a legal re-append of an evicted token.
TEST_CASE("replay: the cache check catches broken caches after evictions (checked in a child process)",
          "[replay]") {
  MemoryTrace tr = MakeHandTrace();
  auto aborts = [&tr](ActPolicy::Act act) {
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::freopen("/dev/null", "w", stderr);
      ::freopen("/dev/null", "w", stdout);  // Catch2's handler reports the abort before re-raising it
      std::vector<RunSpec> runs{Spec(std::make_shared<ActPolicy>(std::move(act)), 4)};
      (void)Replay(tr, runs, Options());
      ::_exit(0);  // the check let it through
    }
    int wstatus = 0;
    REQUIRE(::waitpid(pid, &wstatus, 0) == pid);
    return WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGABRT;
  };
  const std::vector<float> k(2, 0.0f), v(2, 0.0f);
  // Step 1 (cache {0, 1, 2, 3, 4}): evict token 0, then append token 2 again.
  CHECK(aborts([](int step, HeadCache* c) {
    if (step != 1) return;
    c->EvictSlot(0);
    c->Append(2);
  }));
  // Evict, then append the newest token (4) again: newer than every other, but already held.
  CHECK(aborts([](int step, HeadCache* c) {
    if (step != 1) return;
    c->EvictSlot(1);
    c->Append(4);
  }));
  // Evict at both steps, and append a token from the future at step 0 (the engine appends 4 after it).
  CHECK(aborts([](int step, HeadCache* c) {
    c->EvictSlot(0);
    if (step == 0) c->Append(5);
  }));
  // Evict, then merge a held token into another slot.
  CHECK(aborts([&k, &v](int step, HeadCache* c) {
    if (step != 1) return;
    c->EvictSlot(0);
    c->MergeInto(0, 3, 0.5f, k, v);
  }));
  // Evict at step 0 and step 1; at step 1 append the token evicted at step 0: legal (held once).
  CHECK_FALSE(aborts([](int step, HeadCache* c) {
    c->EvictSlot(0);
    if (step == 1) c->Append(0);
  }));
  // The same run in this process: it completes, and its caches are what the policy made.
  std::vector<RunSpec> runs{Spec(std::make_shared<ActPolicy>([](int step, HeadCache* c) {
                                   c->EvictSlot(0);
                                   if (step == 1) c->Append(0);
                                 }),
                                 4)};
  auto res = Replay(tr, runs, Options());
  REQUIRE(res.ok());
  // Step 0: {1, 2, 3, 4}; step 1: {2, 3, 4, 0, 5}.
  CHECK((*res)[0].timeline((*res)[0].timeline_size() - 1).kv_tokens() == 5);
}

// The engine's check of a rewritten cache (Assign): a plain cache in ascending token order takes a quick
// pass (ascending and in range), everything else the full check. Both must catch a token held twice (also
// the engine's own append of the current token when the policy kept it already), a token from the future
// and a negative one, and let any legal set through, in whatever order.
TEST_CASE("replay: the cache check of a rewritten cache (checked in a child process)", "[replay]") {
  MemoryTrace tr = MakeHandTrace();
  auto aborts = [&tr](std::vector<int32_t> set, bool append_new = true) {
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::freopen("/dev/null", "w", stderr);
      ::freopen("/dev/null", "w", stdout);
      std::vector<RunSpec> runs{Spec(std::make_shared<ActPolicy>(
                                         [set](int step, HeadCache* c) {
                                           if (step == 1) c->Assign(set);
                                         },
                                         PolicyRequirements{}, append_new),
                                     4)};
      (void)Replay(tr, runs, Options());
      ::_exit(0);
    }
    int wstatus = 0;
    REQUIRE(::waitpid(pid, &wstatus, 0) == pid);
    return WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGABRT;
  };
  // Step 1 is position 5; the engine appends token 5 after the policy's step hook.
  CHECK(aborts({0, 2, 2}));   // ascending with a repeat
  CHECK(aborts({0, 1, 5}));   // the current token kept: the engine's append holds it twice
  CHECK(aborts({0, 1, 9}));   // ascending, from the future
  CHECK(aborts({-1, 0, 1}));  // ascending, negative
  CHECK(aborts({3, 1, 3}));   // another order, a repeat
  CHECK(aborts({3, 9, 1}));   // another order, from the future
  // Without the engine's append the set is checked as the policy left it.
  CHECK(aborts({0, 1, 6}, false));   // ascending, from the future (the last token)
  CHECK(aborts({0, 3, 3}, false));   // ascending with a repeat at the end
  CHECK(aborts({-2, 3, 4}, false));  // ascending, negative
  CHECK_FALSE(aborts({0, 1, 5}, false));
  CHECK_FALSE(aborts({5, 1, 0}, false));
  CHECK_FALSE(aborts({0, 2, 3}));
  CHECK_FALSE(aborts({3, 0, 1}));
  CHECK_FALSE(aborts({4}));
  CHECK_FALSE(aborts({}));
}

// A cache that only grows through step 0 and then loses a token: the engine's compact output product
// keeps step 0's set (appends only) without per-step copies until step 1 changes it, then continues with the
// per-step sets. Step 0 holds every visible token (error 0); step 1 holds {0, 2, 3, 4, 5} of p(step 1) =
// (1, 1, 4, 1, 1, 2) / 10: o = (v0 + 4 v2 + v3 + v4 + 2 v5) / 9 = (11/9, 10/9) against (1.1, 1.1).
TEST_CASE("replay: output error of a run that appends, then evicts (hand trace)", "[replay]") {
  MemoryTrace tr = MakeHandTrace();
  std::vector<RunSpec> runs{Spec(std::make_shared<ActPolicy>([](int step, HeadCache* c) {
                                   if (step == 1) c->EvictSlot(1);
                                 }),
                                 4)};
  for (int threads : {1, 2}) {
    ReplayOptions o = Options();
    o.threads = threads;
    auto res = Replay(tr, runs, o);
    REQUIRE(res.ok());
    const double dx = 11.0 / 9 - 1.1, dy = 10.0 / 9 - 1.1;
    const double err1 = std::sqrt(dx * dx + dy * dy) / (1.1 * std::sqrt(2.0));
    CHECK((*res)[0].metrics().output_rel_error_mean() == Approx(err1 / 2).epsilon(1e-5));
    CHECK((*res)[0].metrics().retained_mass_mean() == Approx((1.0 + 0.9) / 2).epsilon(1e-6));
  }
}

// The compact output product of a run whose steps only append (kept as the latest step's tokens, A's rows
// gathered whole) against the same run with a version bump at every step (an empty eviction: the per-step
// copies and the scatter): every metric bit-identical, for a run that never changes its cache, one that
// evicts at step 0, in the middle, or at the last step (the earlier steps are then written out at once).
TEST_CASE("replay: append-only steps give the same results with or without per-step copies", "[replay]") {
  testing::TinyTraceSpec spec;
  spec.num_heads = 4;  // GQA: group of 2
  spec.decode_steps = 12;
  MemoryTrace tr = testing::MakeTinyTrace(spec);
  for (int k : {-1, 0, 3, 11}) {
    auto act = [k](bool bump) {
      return [k, bump](int step, HeadCache* c) {
        if (bump) c->EvictSlots(std::vector<int>{});  // changes the version only
        if (step == k) c->EvictSlot(2);
      };
    };
    std::vector<RunSpec> runs{Spec(std::make_shared<ActPolicy>(act(false)), spec.prefill_length),
                              Spec(std::make_shared<ActPolicy>(act(true)), spec.prefill_length)};
    for (int threads : {1, 3}) {
      ReplayOptions o = Options();
      o.threads = threads;
      auto res = Replay(tr, runs, o);
      REQUIRE(res.ok());
      INFO("evict at step " << k << ", threads " << threads);
      if (k >= 0) CHECK((*res)[0].metrics().retained_mass_mean() < 1.0);  // the eviction is seen
      CHECK((*res)[0].SerializeAsString() == (*res)[1].SerializeAsString());
    }
  }
}

// FinishRun's output product for caches re-selected every step: with few runs of consecutive tokens per
// step (a sliding window; a window, the sinks after it and a fixed block, overlapping from step to step)
// the union is merged from intervals and A's rows are copies of p's stretches. Every result must be the
// token-by-token path's, bit for bit, at 1 and 3 threads; a list of scattered tokens keeps the old path.
TEST_CASE("replay: the output product from runs of consecutive tokens equals the token-by-token one",
          "[replay]") {
  MemoryTrace tr = RunListTrace();
  auto window = WindowSinksBlock();
  auto scattered = std::make_shared<ActPolicy>([](int step, HeadCache* c) {
    std::vector<int32_t> keep;
    for (int32_t t = step % 3; t < 600; t += 3) keep.push_back(t);
    c->Assign(keep);
  });
  auto streaming = PolicyRegistry::Default().Create("streaming_llm", {});
  REQUIRE(streaming.ok());
  std::vector<RunSpec> runs{Spec(window, kRunListPrompt), Spec(scattered, kRunListPrompt),
                            RunSpec{*streaming, "streaming", 0.2, 0, QuestionMode::kQueryAware}};
  SetOutputBandsForTesting(false);  // the runs path's position bands add in another order
  CheckSameWithout(tr, runs, &SetRunListsForTesting);
  SetOutputBandsForTesting(true);
}

// FinishRun counts each step's held decode tokens (does every step hold its visible ones, so that the unit's
// decode part can be added?) run by run when the steps' lists are runs of consecutive tokens. A window that
// holds every decode token so far (the decode part is used), one that drops decode token n + 2 from step 4
// on (not used), and streaming_llm: every result the token-by-token count's, bit for bit.
TEST_CASE("replay: held decode tokens counted by runs equal the token-by-token count", "[replay]") {
  MemoryTrace tr = RunListTrace();
  auto keeps = [](bool gap) {
    return std::make_shared<ActPolicy>([gap](int step, HeadCache* c) {
      std::vector<int32_t> keep;
      for (int32_t t = 0; t < 4; ++t) keep.push_back(t);                           // sinks
      for (int32_t t = 50 + 7 * step; t < 150 + 7 * step; ++t) keep.push_back(t);  // a window
      for (int32_t t = 600; t < 600 + step; ++t)                                   // decode tokens
        if (!gap || step < 4 || t != 602) keep.push_back(t);
      c->Assign(keep);
    });
  };
  std::vector<RunSpec> runs{Spec(keeps(false), kRunListPrompt), Spec(keeps(true), kRunListPrompt),
                            Spec(Registered("streaming_llm"), 150)};
  CheckSameWithout(tr, runs, &SetHeldByRunsForTesting);
}

// A prefix-closed run whose steps held every visible token as itself (`full`, and a policy that keeps
// everything) takes its retained mass from the rows' own exact sums instead of the transposed probabilities
// (issue 14, round 26): every result the same bits as without, beside runs that are not whole. With a sliding
// window `full` also holds the tokens before the window's first key, which are not visible: no run is whole
// there, and the results are the same too.
TEST_CASE("replay: whole-row runs' retained mass from the rows' own sums equals the slot sums", "[replay]") {
  auto keep_all = std::make_shared<ActPolicy>([](int, HeadCache*) {});
  for (int window : {0, 200}) {
    MemoryTrace tr = RunListTrace();
    if (window > 0) SetSlidingWindow(tr, window);
    std::vector<RunSpec> runs{Spec(Registered("full"), kRunListPrompt), Spec(keep_all, kRunListPrompt),
                              Spec(Registered("streaming_llm"), 150),
                              Spec(WindowSinksBlock(), kRunListPrompt)};
    const int64_t before = WholeRowSumsForTesting();
    CAPTURE(window);
    CheckSameWithout(tr, runs, &SetWholeRowSumsForTesting);
    CHECK((WholeRowSumsForTesting() > before) == (window == 0));  // the path was taken without the window
  }
}

// A prefix-closed run's first steps are summed from their own rows when they are few (at most 8: a cache
// that stopped being prefix-closed after them, e.g. streaming_llm's step 0), not from the unit's transposed
// probabilities (issue 14, round 29): every result the same bits as without. Caches appended to for 1, 4, 8
// and 9 steps, then re-selected, one appended to throughout (all 12 steps), and streaming_llm; the rows' path
// is taken up to 8 steps only.
TEST_CASE("replay: a prefix-closed run's few first steps summed from their rows equal the transposed sums",
          "[replay]") {
  MemoryTrace tr = RunListTrace();
  auto appended_for = [](int steps) {
    return std::make_shared<ActPolicy>([steps](int step, HeadCache* c) {
      if (step == 0) c->AssignRange(20, 560);
      if (step < steps) return;  // appended to: prefix-closed
      std::vector<int32_t> keep;
      for (int32_t t = 100 + 9 * step; t < 400 + 9 * step; ++t) keep.push_back(t);
      c->Assign(keep);
    });
  };
  std::vector<RunSpec> runs{Spec(Registered("streaming_llm"), 150)};
  for (int steps : {1, 4, 8, 9, 99}) runs.push_back(Spec(appended_for(steps), kRunListPrompt));
  CheckSameWithout(tr, runs, &SetRowFlushForTesting);
  for (int steps : {1, 4, 8, 9, 99}) {
    const int64_t before = RowFlushesForTesting();
    REQUIRE(Replay(tr, std::vector<RunSpec>{Spec(appended_for(steps), kRunListPrompt)}, Options()).ok());
    CAPTURE(steps);
    CHECK((RowFlushesForTesting() > before) == (steps <= 8));
  }
}

// Step finds each step's runs of consecutive tokens as it writes the step's list (and ExpandPrefix those of
// the prefix-closed steps it writes out), instead of FinishRun's pass over all lists: the same runs, so every
// result the same, bit for bit. A window with sinks after it and a fixed block; a cache appended to for four
// steps, then a window (the prefix mode's steps expanded at step 4); one whose lists turn scattered after
// step 6 (Step gives up, FinishRun decides); one scattered at step 0 only; streaming_llm.
TEST_CASE("replay: the steps' runs found step by step equal FinishRun's pass", "[replay]") {
  MemoryTrace tr = RunListTrace();
  auto window = WindowSinksBlock();
  auto prefix_then_window = std::make_shared<ActPolicy>([](int step, HeadCache* c) {
    if (step == 0) c->AssignRange(0, 600);
    if (step < 4) return;  // appended to: prefix-closed
    std::vector<int32_t> keep;
    for (int32_t t = 100 + 9 * step; t < 400 + 9 * step; ++t) keep.push_back(t);
    c->Assign(keep);
  });
  auto turns_scattered = [](int from) {
    return std::make_shared<ActPolicy>([from](int step, HeadCache* c) {
      std::vector<int32_t> keep;
      if (step < from)
        for (int32_t t = 200 + step; t < 500 + step; ++t) keep.push_back(t);
      else
        for (int32_t t = step % 3; t < 600; t += 3) keep.push_back(t);
      c->Assign(keep);
    });
  };
  auto scattered_first = std::make_shared<ActPolicy>([](int step, HeadCache* c) {
    std::vector<int32_t> keep;
    if (step == 0)
      for (int32_t t = 0; t < 60; t += 2) keep.push_back(t);
    else
      for (int32_t t = 200 + step; t < 590; ++t) keep.push_back(t);
    c->Assign(keep);
  });
  std::vector<RunSpec> runs{Spec(window, kRunListPrompt),
                            Spec(prefix_then_window, kRunListPrompt),
                            Spec(turns_scattered(6), kRunListPrompt),
                            Spec(turns_scattered(11), kRunListPrompt),
                            Spec(scattered_first, kRunListPrompt),
                            Spec(Registered("streaming_llm"), 150),
                            Spec(Registered("streaming_llm"), 40)};
  CheckSameWithout(tr, runs, &SetStepRunsForTesting);
}

// FinishRun's token-by-token loops build the union U of a cache re-selected every step (the tokens' range
// shorter than the steps' lists together) by marking every listed token and one scan of the markers over
// the range, instead of listing first sights and sorting; the runs' buffers (A, V[U], the outputs) only
// grow, so a run after a wider one works in what that one left past its own size. Every result must be the
// sort's, bit for bit: scattered lists (every third token, a different third each step), a union with gaps
// of never-held tokens, oracle (re-selected every step) and H2O (one eviction a step), runs of different
// widths one after another on one worker, at 1 and 3 threads.
TEST_CASE("replay: a union ordered by a marker scan equals the sorted one", "[replay]") {
  testing::TinyTraceSpec spec;
  spec.num_heads = 2;  // MHA: oracle's threshold path
  spec.num_kv_heads = 2;
  spec.prefill_length = 500;
  spec.decode_steps = 9;
  spec.image_begin = 40;
  spec.image_end = 400;
  MemoryTrace tr = testing::MakeTinyTrace(spec);
  auto scattered = std::make_shared<ActPolicy>([](int step, HeadCache* c) {
    std::vector<int32_t> keep;
    for (int32_t t = step % 3; t < 500; t += 3) keep.push_back(t);
    c->Assign(keep);
  });
  auto gaps = std::make_shared<ActPolicy>([](int step, HeadCache* c) {
    std::vector<int32_t> keep;  // blocks of 5 held tokens, 5 never held between them, shifting by 1 a step
    for (int32_t t = 100 + step; t < 480; t += 10)
      for (int32_t i = 0; i < 5 && t + i < 500; ++i) keep.push_back(t + i);
    c->Assign(keep);
  });
  std::vector<RunSpec> runs{Spec(scattered, spec.prefill_length), Spec(gaps, spec.prefill_length)};
  for (double b : {0.5, 0.1, 0.3})
    runs.push_back(RunSpec{Registered("oracle"), "oracle", b, 0, QuestionMode::kQueryAware});
  for (double b : {0.2, 0.5})
    runs.push_back(RunSpec{Registered("h2o"), "h2o", b, 0, QuestionMode::kQueryAware});
  CheckSameWithout(tr, runs, &SetUnionScanForTesting);
}

// The merged-cache engine tests' trace (GQA groups of 2, image tokens) and runs: MEDA (both variants: the
// official code's step 0 holds the whole prompt, a plain cache that merges later), LOOK-M and SnapKV with
// averaged merges at 10% and 40%, after hand-made caches that keep [0, 120) with tokens 120..139 merged into
// slots 10, 30, ... at step 0, then act at later steps as `then[i]` says (given a key and a value to merge).
MemoryTrace MergedCacheTrace(int decode_steps) {
  testing::TinyTraceSpec spec;
  spec.num_heads = 4;
  spec.num_kv_heads = 2;
  spec.prefill_length = 400;
  spec.decode_steps = decode_steps;
  spec.image_begin = 40;
  spec.image_end = 300;
  return testing::MakeTinyTrace(spec);
}
using MergedAct =
    std::function<void(int step, HeadCache* c, std::span<const float> k, std::span<const float> v)>;
std::vector<RunSpec> MergedCacheRuns(const MemoryTrace& tr, const std::vector<MergedAct>& then) {
  const int d = tr.meta().model.head_dim, n = tr.meta().prefill_length;
  std::vector<float> k(d, 0.25f), v(d, -0.5f);
  std::vector<RunSpec> runs;
  for (const MergedAct& act : then)
    runs.push_back(Spec(std::make_shared<ActPolicy>([k, v, act](int step, HeadCache* c) {
                          if (step == 0) {
                            std::vector<int32_t> keep;
                            for (int32_t t = 0; t < 120; ++t) keep.push_back(t);
                            keep.push_back(399);
                            c->Assign(keep);
                            for (int32_t t = 120; t < 140; ++t)
                              c->MergeInto(10 + 20 * ((t - 120) % 5), t, 0.5f, k, v);
                          }
                          act(step, c, k, v);
                        }),
                        n));
  for (double b : {0.1, 0.4}) {
    runs.push_back(RunSpec{Registered("meda"), "meda", b, 0, QuestionMode::kQueryAware});
    runs.push_back(RunSpec{Registered("meda", {"variant=OFFICIAL_CODE"}), "meda official", b, 0,
                           QuestionMode::kQueryAware});
    runs.push_back(RunSpec{Registered("look_m"), "look_m", b, 0, QuestionMode::kQueryAware});
    runs.push_back(RunSpec{Registered("snapkv+average"), "snapkv+average", b, 0, QuestionMode::kQueryAware});
  }
  return runs;
}

// Step's prefix mode also takes a cache holding merged slots at step 0 whose version then stays (only
// appends): its steps' plain slots are prefixes of one list, and FinishRun's output product reads that list
// instead of the steps' lists. Every result must be the step-by-step lists', bit for bit, at 1 and 3
// threads: the merging policies and hand-made caches that keep their merges, evict (leaving the mode at
// step 3), merge again (step 5) or merge into a decode token's slot (step 2).
TEST_CASE("replay: a merged cache's steps as prefixes of one list equal the step-by-step lists", "[replay]") {
  MemoryTrace tr = MergedCacheTrace(10);
  const auto runs = MergedCacheRuns(tr, {[](int, HeadCache*, auto, auto) {},
                                         [](int step, HeadCache* c, auto, auto) {
                                           if (step == 3) c->EvictSlot(5);
                                         },
                                         [](int step, HeadCache* c, auto k, auto v) {
                                           if (step == 5) c->MergeInto(50, 200, 0.25f, k, v);
                                         },
                                         [](int step, HeadCache* c, auto k, auto v) {
                                           if (step == 2) c->MergeInto(c->size() - 1, 300, 0.5f, k, v);
                                         }});
  SetOutputBandsForTesting(false);  // outside the prefix mode, the tokens held at every step add in bands
  CheckSameWithout(tr, runs, &SetMergedPrefixForTesting);
  SetOutputBandsForTesting(true);
}

// Step sums a merged-slot block's steps a chunk at a time over the slots they share (ChunkSlotSums), then
// each step's appended ones. Every result must be the per-step sums', bit for bit, at 1 and 3 threads, over
// 21 steps (a chunk of 16 and a short one): caches that keep their merges (hand-made, MEDA, LOOK-M, SnapKV
// with averaged merges), one that changes them at step 5 (a new block mid-chunk), MEDA's official code
// (which reads step 0's attention only: its blocks from step 2 on are chunked too).
TEST_CASE("replay: a merged block's chunked sums equal the per-step sums", "[replay][merge]") {
  MemoryTrace tr = MergedCacheTrace(21);
  const auto runs = MergedCacheRuns(tr, {[](int, HeadCache*, auto, auto) {},
                                         [](int step, HeadCache* c, auto k, auto v) {
                                           if (step == 5) c->MergeInto(50, 200, 0.25f, k, v);
                                         }});
  CheckSameWithout(tr, runs, &SetChunkSlotSumsForTesting);
}

TEST_CASE("replay: the plain-slot sums add in slot order per lane and modality, as the scalar loop does",
          "[replay]") {
  // The scalar loop the engine had: rm[s & 3][mod] += p, in slot order.
  auto scalar = [](const std::vector<int32_t>& tk, const std::vector<float>& p,
                   const std::vector<Modality>& mod, int first, std::vector<float>* cp, double rm[4][4]) {
    int visible = 0;
    for (size_t s = 0; s < tk.size(); ++s) {
      const float pt = p[tk[s]];
      if (cp) (*cp)[s] = pt;
      visible += tk[s] >= first;
      rm[s & 3][static_cast<int>(mod[tk[s]])] += pt;
    }
    return visible;
  };
  std::mt19937 rng(7);
  const int n = 300;
  for (int slots : {0, 1, 3, 4, 5, 7, 8, 64, 131, 300}) {
    // runs: the tokens in runs of consecutive ones (1 to 9 long, a sliding window's way) and the modalities
    // in stretches of 13 tokens: the four-consecutive-tokens path, its modality check and its visible count
    // across `first`, next to blocks that straddle a run's or a stretch's end.
    for (auto [with_cp, runs] :
         std::vector<std::pair<bool, bool>>{{false, false}, {true, false}, {false, true}, {true, true}}) {
      std::vector<float> p(n);
      std::vector<Modality> mod(n);
      // Values over many binades, so that a different order of additions would change the double sums.
      for (int i = 0; i < n; ++i) {
        p[i] = std::ldexp(std::uniform_real_distribution<float>(1, 2)(rng), -static_cast<int>(rng() % 40));
        mod[i] = static_cast<Modality>(runs ? (i / 13 + i / 91) % 4 : rng() % 4);
      }
      p[5] = 0.0f;
      p[6] = std::numeric_limits<float>::denorm_min();
      std::vector<int32_t> tk(slots);
      for (int s = 0; s < slots;) {
        const int len = runs ? 1 + static_cast<int>(rng() % 9) : 1;
        const int32_t start = static_cast<int32_t>(rng() % (n - 9));
        for (int k = 0; k < len && s < slots; ++k) tk[s++] = start + k;
      }
      std::vector<float> cp_a(slots, -1), cp_b(slots, -1);
      double a[4][4] = {}, b[4][4] = {};
      const int first = 100;
      const int va = scalar(tk, p, mod, first, with_cp ? &cp_a : nullptr, a);
      const int vb =
          PlainSlotSums(tk.data(), slots, p.data(), mod.data(), first, with_cp ? cp_b.data() : nullptr, b);
      INFO("slots " << slots << " cp " << with_cp << " runs " << runs);
      CHECK(va == vb);
      CHECK(cp_a == cp_b);
      for (int j = 0; j < 4; ++j)
        for (int mo = 0; mo < 4; ++mo)
          CHECK(std::bit_cast<uint64_t>(a[j][mo]) == std::bit_cast<uint64_t>(b[j][mo]));
    }
  }
  // A NaN or an infinity reaches only its own modality's sum (the others are masked to +0.0).
  std::vector<float> p = {1.0f, std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity()};
  std::vector<Modality> mod = {Modality::kText, Modality::kImage, Modality::kVideo};
  std::vector<int32_t> tk = {0, 1, 2, 0, 0, 1, 2, 0, 0};
  double rm[4][4] = {};
  CHECK(PlainSlotSums(tk.data(), 9, p.data(), mod.data(), 1, nullptr, rm) == 4);
  for (int j = 0; j < 4; ++j) {
    CHECK(rm[j][3] == 0.0);
    CHECK_FALSE(std::signbit(rm[j][3]));
  }
  CHECK(rm[0][0] == 3.0);       // slots 0, 4 and 8
  CHECK(std::isnan(rm[1][1]));  // slots 1 and 5
  CHECK(std::isinf(rm[2][2]));  // slot 2 (slot 6 too)
  CHECK(rm[3][0] == 2.0);       // slots 3 and 7
  CHECK(rm[1][0] == 0.0);
  CHECK(rm[0][1] == 0.0);
}

TEST_CASE("replay: RowNorms equals the per-row sum of squares in double, bit for bit", "[replay]") {
  // Rows of 1 .. 136 columns (whole 8 x 8 tiles and a rest), 1 .. 27 rows (blocks of eight and a rest),
  // values over many binades with both signs and some zeros; the row pointer offset so that rows are not
  // aligned.
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> binade(-30, 30);
  for (int d : {1, 7, 8, 9, 15, 16, 63, 128, 129, 136})
    for (int rows : {1, 7, 8, 9, 16, 27}) {
      std::vector<float> x(static_cast<size_t>(rows) * d + 3);
      for (float& v : x) v = rng() % 11 == 0 ? 0.0f : std::ldexp(unit(rng), binade(rng));
      const float* rx = x.data() + 3;
      std::vector<float> got(rows, -1.0f);
      RowNorms(rx, rows, d, got.data());
      for (int j = 0; j < rows; ++j) {
        double s = 0;
        for (int k = 0; k < d; ++k)
          s += static_cast<double>(rx[static_cast<size_t>(j) * d + k]) * rx[static_cast<size_t>(j) * d + k];
        INFO("d = " << d << ", rows = " << rows << ", row " << j);
        CHECK(std::bit_cast<uint32_t>(got[j]) == std::bit_cast<uint32_t>(static_cast<float>(std::sqrt(s))));
      }
    }
}

TEST_CASE("replay: MaxRowNorm equals the largest of RowNorms' values, bit for bit", "[replay]") {
  std::mt19937 rng(4321);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> binade(-30, 30);
  const auto reference = [](const float* x, int rows, int d) {
    std::vector<float> norms(std::max(rows, 1), 0.0f);
    if (rows > 0) RowNorms(x, rows, d, norms.data());
    return *std::max_element(norms.begin(), norms.end());
  };
  const auto same = [](float a, float b) { return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b); };
  // Random rows over many binades (the whole-vector path, its rest, the scalar path for d < 8).
  for (int d : {1, 7, 8, 9, 16, 63, 128, 129, 136})
    for (int rows : {0, 1, 7, 27, 300}) {
      std::vector<float> x(static_cast<size_t>(rows) * d + 3);
      for (float& v : x) v = rng() % 11 == 0 ? 0.0f : std::ldexp(unit(rng), binade(rng));
      INFO("d = " << d << ", rows = " << rows);
      CHECK(same(MaxRowNorm(x.data() + 3, rows, d), reference(x.data() + 3, rows, d)));
    }
  // Near ties: 64 orders of one row (their float sums differ by a few units in the last place, their norms
  // hardly at all) and one row whose norm is one float step above theirs (x[0] raised ulp by ulp until the
  // norm moves), at a random place. The largest float sum is seldom that row's, so the exact norm of the
  // largest float sum alone would miss it.
  for (int d : {64, 128, 136})
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> row(d);
      for (float& v : row) v = std::ldexp(unit(rng), binade(rng) / 10);
      float base_norm;
      RowNorms(row.data(), 1, d, &base_norm);
      std::vector<float> up = row;
      float up_norm = base_norm;
      while (up_norm == base_norm) {
        up[0] = std::nextafter(up[0], up[0] < 0 ? -INFINITY : INFINITY);
        RowNorms(up.data(), 1, d, &up_norm);
      }
      const int rows = 65, at = static_cast<int>(rng() % rows);
      std::vector<float> x;
      for (int j = 0; j < rows; ++j) {
        if (j == at) {
          x.insert(x.end(), up.begin(), up.end());
        } else {
          std::shuffle(row.begin(), row.end(), rng);
          x.insert(x.end(), row.begin(), row.end());
        }
      }
      INFO("d = " << d << ", trial " << trial);
      const float want = reference(x.data(), rows, d);
      CHECK(want >= up_norm);
      CHECK(same(MaxRowNorm(x.data(), rows, d), want));
    }
  // Squares below float's range (every float sum 0, the double sums not) and above it (float sums +inf).
  for (float scale : {1e-30f, 1e-23f, 1e20f, 3e19f}) {
    const int d = 128, rows = 40;
    std::vector<float> x(static_cast<size_t>(rows) * d);
    for (float& v : x) v = scale * unit(rng);
    INFO("scale " << scale);
    CHECK(same(MaxRowNorm(x.data(), rows, d), reference(x.data(), rows, d)));
  }
}

TEST_CASE("replay: MaxVisibleNorms is the largest norm over each step's visible keys, bit for bit",
          "[replay]") {
  // Every window start (none, sliding windows of several widths), with the largest row anywhere: the first
  // key, the last prefill key n, a decode key, inside or outside a window.
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  const int d = 24;
  for (int n : {1, 9, 40})
    for (int steps : {1, 2, 7})
      for (int window : {0, 3, 10, 1000})
        for (int big : {-1, 0, n - 1, n, n + steps - 1}) {
          const int t_all = n + steps;
          std::vector<float> v(static_cast<size_t>(t_all) * d);
          for (float& x : v) x = unit(rng);
          if (big >= 0)
            for (int k = 0; k < d; ++k) v[static_cast<size_t>(big) * d + k] *= 4.0f;
          std::vector<int32_t> first(steps);
          for (int t = 0; t < steps; ++t) first[t] = window > 0 ? std::max(0, n + t - window + 1) : 0;
          std::vector<float> norms(t_all), got(steps, -1.0f);
          RowNorms(v.data(), t_all, d, norms.data());
          MaxVisibleNorms(v.data(), n, steps, d, first.data(), got.data());
          for (int t = 0; t < steps; ++t) {
            const float want = *std::max_element(norms.begin() + first[t], norms.begin() + n + t + 1);
            INFO("n = " << n << ", steps = " << steps << ", window = " << window << ", big = " << big
                        << ", t = " << t);
            CHECK(std::bit_cast<uint32_t>(got[t]) == std::bit_cast<uint32_t>(want));
          }
        }
}

TEST_CASE("replay: the prefix-closed steps' sums at once equal PlainSlotSums step by step, bit for bit",
          "[replay]") {
  // Random prefix-closed caches: step t holds the first count[t] slots (count non-decreasing, from any
  // start, growing by 0, 1 or several slots a step), tokens in any order, all four modalities, values over
  // many binades (a different order or grouping of the additions changes the double sums). The transposed
  // matrix holds step t's probabilities at pt[tok * stride + t]; the entries of the steps before a slot is
  // held are NaN, so reading one would show. Tokens below `first` have p = 0, as a sliding window's.
  std::mt19937 rng(11);
  const int n = 400;
  for (int steps : {1, 2, 7, 16, 33}) {
    for (int start : {0, 1, 5, 64, 203}) {
      for (int first : {0, 50}) {
        const size_t stride = static_cast<size_t>(steps) + rng() % 3;  // the row stride may exceed the steps
        std::vector<Modality> mod(n);
        for (int i = 0; i < n; ++i) mod[i] = static_cast<Modality>(rng() % 4);
        std::vector<int> count(steps);
        int c = start;
        for (int t = 0; t < steps; ++t) {
          const int grow = rng() % 4 == 0 ? static_cast<int>(rng() % 6) : static_cast<int>(rng() % 2);
          c = std::min(n, t == 0 ? c : c + grow);
          count[t] = c;
        }
        std::vector<int32_t> tk(n);
        std::iota(tk.begin(), tk.end(), 0);
        std::shuffle(tk.begin(), tk.end(), rng);
        std::vector<float> pt(static_cast<size_t>(n) * stride, std::numeric_limits<float>::quiet_NaN());
        for (int s = 0; s < count[steps - 1]; ++s)
          for (int t = 0; t < steps; ++t) {
            if (s >= count[t]) continue;  // not held yet: stays NaN
            const float v = tk[s] < first ? 0.0f
                                          : std::ldexp(std::uniform_real_distribution<float>(1, 2)(rng),
                                                       -static_cast<int>(rng() % 40));
            pt[static_cast<size_t>(tk[s]) * stride + t] = v;
          }
        std::vector<double> got(static_cast<size_t>(steps) * 16, -1.0);
        PrefixSlotSums(tk.data(), count.data(), steps, pt.data(), stride, mod.data(),
                       reinterpret_cast<double(*)[4][4]>(got.data()));
        for (int t = 0; t < steps; ++t) {
          std::vector<float> p(n, 0.0f);
          for (int s = 0; s < count[t]; ++s) p[tk[s]] = pt[static_cast<size_t>(tk[s]) * stride + t];
          double want[4][4] = {};
          PlainSlotSums(tk.data(), count[t], p.data(), mod.data(), first, nullptr, want);
          INFO("steps " << steps << " start " << start << " first " << first << " step " << t << " slots "
                        << count[t]);
          for (int j = 0; j < 4; ++j)
            for (int mo = 0; mo < 4; ++mo)
              CHECK(std::bit_cast<uint64_t>(got[static_cast<size_t>(t) * 16 + j * 4 + mo]) ==
                    std::bit_cast<uint64_t>(want[j][mo]));
        }
      }
    }
  }
  // A NaN or an infinity held by a slot reaches only its own (lane, modality) sums, from its first step on.
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  // Tokens 0..2 (text, image, video); step 0 holds slots 0 and 1, step 1 slots 0..2.
  const std::vector<Modality> mod = {Modality::kText, Modality::kImage, Modality::kVideo};
  const std::vector<int32_t> tk = {0, 1, 2};
  const std::vector<int> count = {2, 3};
  const std::vector<float> pt = {1.0f, 2.0f, nan, nan, -1.0f /* never read */, inf};
  double rm[2][4][4];
  PrefixSlotSums(tk.data(), count.data(), 2, pt.data(), 2, mod.data(), rm);
  CHECK(rm[0][0][0] == 1.0);
  CHECK(std::isnan(rm[0][1][1]));
  CHECK(rm[0][2][2] == 0.0);
  CHECK(rm[1][0][0] == 2.0);
  CHECK(std::isnan(rm[1][1][1]));
  CHECK(std::isinf(rm[1][2][2]));
  for (int t = 0; t < 2; ++t)
    for (int j = 0; j < 4; ++j)
      for (int mo = 0; mo < 4; ++mo) {
        if (mo == j && j < 3) continue;
        CHECK(rm[t][j][mo] == 0.0);
        CHECK_FALSE(std::signbit(rm[t][j][mo]));
      }
}

TEST_CASE("replay: a prefix-closed run's deferred sums give Step's own results, at any thread count",
          "[replay]") {
  // The same caches three times: once for a policy that reads the step's attention (Step computes every
  // step's sums itself), once for one that does not (the prefix-closed steps' sums are deferred to
  // FlushPrefixSums) and once for one that reads steps 0 and 1 only (decode_attention_steps: Step computes
  // every step's sums itself, the cache's attention only for those two; no step deferred, as the steps
  // before would not be); every field of the results must be equal. GQA (groups of 2); runs that stay
  // prefix-closed, that stop being so at step 5 (an eviction), that never are (an eviction every step), and
  // with a sliding window that starts to slide at step 4 (no step after it is prefix-closed).
  testing::TinyTraceSpec spec;
  spec.num_layers = 2;
  spec.num_heads = 4;
  spec.num_kv_heads = 2;
  spec.prefill_length = 40;
  spec.image_begin = 4;
  spec.image_end = 30;
  spec.decode_steps = 12;
  spec.seed = 5;
  for (int window : {0, 44}) {
    MemoryTrace tr = testing::MakeTinyTrace(spec);
    if (window > 0) SetSlidingWindow(tr, window);
    const int n = tr.meta().prefill_length;
    using Kept = std::function<std::vector<int32_t>(int t)>;
    auto held = [n](int t, std::vector<int32_t> evicted) {  // the prompt but `evicted`, the decode tokens
      std::vector<int32_t> k;
      for (int j = 0; j < n; ++j)
        if (std::find(evicted.begin(), evicted.end(), j) == evicted.end()) k.push_back(j);
      for (int s = 0; s < t; ++s) k.push_back(n + s);
      return k;
    };
    // Prefix-closed throughout; until step 5; never; everything kept; until step 3; as the first but
    // re-assigned (the same tokens) at step 6.
    const Kept closed = [&](int t) { return held(t, {5, 6, 20}); };
    const Kept until5 = [&](int t) { return t < 5 ? held(t, {5}) : held(t, {5, 33}); };
    const Kept never = [&](int t) { return held(t, {t, t + 9}); };
    const Kept everything = [&](int t) { return held(t, {}); };
    const Kept until3 = [&](int t) { return t < 3 ? held(t, {1, 2, 3}) : held(t, {1, 2, 3, 4 + t}); };
    const std::vector<Kept> kept{closed, until5, never, everything, until3, closed};
    std::vector<RunSpec> runs;
    for (int reads : {0, 1, 2})  // none, every step's, steps 0 and 1
      for (size_t i = 0; i < kept.size(); ++i) {
        PolicyRequirements req;
        req.decode_attention = reads > 0;
        req.decode_attention_steps = reads == 2 ? 2 : 0;
        const Kept k = kept[i];
        const bool reassign = i + 1 == kept.size();
        runs.push_back(Spec(std::make_shared<ActPolicy>(
                                [k, reassign](int step, HeadCache* c) {
                                  const std::vector<int32_t> want = k(step);
                                  if (std::vector<int32_t>(c->tokens().begin(), c->tokens().end()) != want ||
                                      (reassign && step == 6))
                                    c->Assign(want);
                                },
                                req),
                            n));
      }
    std::vector<std::vector<RunResult>> res;
    for (int threads : {1, 3}) {
      ReplayOptions o = Options();
      o.threads = threads;
      auto r = Replay(tr, runs, o);
      REQUIRE(r.ok());
      res.push_back(*r);
    }
    const size_t nk = kept.size();
    for (size_t i = 0; i < nk; ++i) {
      INFO("cache " << i << " window " << window);
      CHECK(res[0][i].SerializeAsString() == res[0][nk + i].SerializeAsString());
      CHECK(res[0][i].SerializeAsString() == res[0][2 * nk + i].SerializeAsString());
      CHECK(res[0][i].SerializeAsString() == res[1][i].SerializeAsString());
      CHECK(res[0][nk + i].SerializeAsString() == res[1][nk + i].SerializeAsString());
      CHECK(res[0][2 * nk + i].SerializeAsString() == res[1][2 * nk + i].SerializeAsString());
      CHECK(res[0][i].metrics().retained_mass_mean() > 0.1);
    }
    // The re-assignment ends the prefix mode at step 6 (the cache's version changes): the sums of its later
    // steps come from PlainSlotSums and its outputs from the scattered product, whose A holds the same values
    // in the same places as the prefix path's (built from the transposed probabilities): every field equal.
    CHECK(res[0][0].SerializeAsString() == res[0][nk - 1].SerializeAsString());
    CHECK(res[0][nk].SerializeAsString() == res[0][2 * nk - 1].SerializeAsString());
  }
}

// A policy that reads the cache's attention at its first decode_attention_steps steps only gets it there
// (StepAttention::cache_probs, renormalised over the cache: Σ = 1 per group member) and null at the later
// steps, for which the engine computes none; MEDA's official code reads step 0's only.
TEST_CASE("replay: the cache's attention only at the steps a policy reads (decode_attention_steps)",
          "[replay]") {
  struct Seen {
    std::mutex mu;
    std::map<int, std::pair<int, int>> steps;  // step: (calls with cache_probs, calls without)
  };
  class Probe final : public Policy {
   public:
    Probe(Seen* seen, int steps) : seen_(seen), steps_(steps) {}
    std::string name() const override { return "probe"; }
    std::string ParamsText() const override { return ""; }
    PolicyRequirements requirements() const override {
      return {.decode_attention = true, .decode_attention_steps = steps_};
    }
    bool evicts_during_decode() const override { return false; }
    std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext&) const override {
      class Head final : public HeadPolicy {
       public:
        explicit Head(Seen* seen) : seen_(seen) {}
        void OnPrefill(const HeadContext& ctx, int, HeadCache* cache) override {
          std::vector<int32_t> keep;
          for (int32_t j = 0; j < ctx.compress_end; j += 2) keep.push_back(j);
          cache->Assign(keep);
        }
        void AfterStep(const HeadContext& ctx, const StepAttention& att, HeadCache*) override {
          std::lock_guard lock(seen_->mu);
          auto& [with, without] = seen_->steps[att.step];
          if (att.cache_probs == nullptr) {
            ++without;
            return;
          }
          ++with;
          for (int g = 0; g < ctx.meta->model.GroupSize(); ++g) {
            double sum = 0;
            for (int s = 0; s < att.num_slots; ++s) sum += att.cache_probs[g * att.num_slots + s];
            CHECK(sum == Approx(1.0).epsilon(1e-5));
          }
        }

       private:
        Seen* seen_;
      };
      return std::make_unique<Head>(seen_);
    }

   private:
    Seen* seen_;
    int steps_;
  };
  MemoryTrace tr = testing::MakeTinyTrace();  // 6 decode steps
  const int steps = tr.meta().num_decode_steps;
  REQUIRE(steps == 6);
  for (int reads : {0, 1, 2, 6, 9}) {  // 0: every step
    INFO("decode_attention_steps " << reads);
    Seen seen;
    const std::vector<RunSpec> runs{Spec(std::make_shared<Probe>(&seen, reads), 12)};
    auto res = Replay(tr, runs, Options());
    REQUIRE(res.ok());
    const int units = tr.meta().model.num_layers * tr.meta().model.num_kv_heads;
    REQUIRE(static_cast<int>(seen.steps.size()) == steps);
    for (int t = 0; t < steps; ++t) {
      const bool read = reads == 0 || t < reads;
      CHECK(seen.steps[t].first == (read ? units : 0));
      CHECK(seen.steps[t].second == (read ? 0 : units));
    }
  }
  const PolicyRequirements official = Registered("meda", {"variant=OFFICIAL_CODE"})->requirements();
  CHECK(official.decode_attention);
  CHECK(official.decode_attention_steps == 1);
  CHECK_FALSE(Registered("meda")->requirements().decode_attention);
}

// FinishRun's three ways to the outputs Σ_s p_s v_s (the compact GEMM over gathered rows of a prefix-closed
// run, the GEMM over scattered rows, the per-step gather of a cache re-selected every step) and the
// reference's own output (a run that keeps everything), each against a plain double computation of the
// output error from the trace: softmax(scale q . k) over the visible keys, the kept tokens' renormalised
// output against the full one. head_dim 20: the gather's 8-column blocks and its scalar tail.
TEST_CASE("replay: every output path of FinishRun gives the plain computation's output error", "[replay]") {
  testing::TinyTraceSpec spec;
  spec.num_layers = 1;
  spec.num_heads = 4;  // GQA: group of 2
  spec.head_dim = 20;
  spec.prefill_length = 40;
  spec.image_begin = 4;
  spec.image_end = 30;
  spec.decode_steps = 12;
  MemoryTrace tr = testing::MakeTinyTrace(spec);
  const TraceMeta& meta = tr.meta();
  const int n = meta.prefill_length, steps = meta.num_decode_steps, d = meta.model.head_dim;
  const int t_all = n + steps, group = meta.model.GroupSize();
  // The prompt tokens each run holds at step t, before the engine appends the step's token.
  using Kept = std::function<std::vector<int32_t>(int t)>;
  std::vector<int32_t> all(n);
  std::iota(all.begin(), all.end(), 0);
  const Kept everything = [&](int t) {
    std::vector<int32_t> k = all;
    for (int s = 0; s < t; ++s) k.push_back(n + s);
    return k;
  };
  const Kept prefix = [&](int t) {  // evicts token 5 before step 0, then only appends: prefix-closed
    std::vector<int32_t> k = everything(t);
    k.erase(k.begin() + 5);
    return k;
  };
  const Kept scatter = [&](int t) {  // evicts one more prompt token every step: the scattered GEMM rows
    std::vector<int32_t> k = everything(t);
    k.erase(k.begin(), k.begin() + t + 1);
    return k;
  };
  const Kept reselect = [&](int t) {  // two new prompt tokens every step: the per-step gather
    return std::vector<int32_t>{3 * t, 3 * t + 1};
  };
  const Kept shuffled = [&](int t) {  // the scattered GEMM rows from runs of consecutive tokens of many
    std::vector<int32_t> k;           // lengths, with gaps, in an order that is not ascending
    for (int32_t j : everything(t))
      if (j % 7 != t % 7) k.push_back(j);
    std::reverse(k.begin(), k.begin() + 6);
    std::rotate(k.begin(), k.begin() + static_cast<std::ptrdiff_t>(k.size() / 2), k.end());
    return k;
  };
  const std::vector<Kept> kept{everything, prefix, scatter, reselect, shuffled};
  std::vector<RunSpec> runs;
  for (const Kept& k : kept)
    runs.push_back(Spec(std::make_shared<ActPolicy>([k](int step, HeadCache* c) {
                          const std::vector<int32_t> want = k(step);
                          if (std::vector<int32_t>(c->tokens().begin(), c->tokens().end()) != want)
                            c->Assign(want);
                        }),
                        n));
  LayerData layer;
  REQUIRE(tr.ReadLayer(0, &layer).ok());
  for (size_t r = 0; r < kept.size(); ++r) {
    double sum = 0;
    for (int h = 0; h < meta.model.num_heads; ++h) {
      const int u = h / group;
      const float* keys = layer.keys.data() + static_cast<size_t>(u) * t_all * d;
      const float* values = layer.values.data() + static_cast<size_t>(u) * t_all * d;
      for (int t = 0; t < steps; ++t) {
        const int pos = n + t;
        const int qi = meta.QueryIndex(pos);
        const float* q = layer.HeadQueries(meta, h, qi, qi + 1) + static_cast<size_t>(qi) * d;
        std::vector<double> p(pos + 1);
        double mx = -1e300, z = 0;
        for (int j = 0; j <= pos; ++j) {
          double dot = 0;
          for (int c = 0; c < d; ++c) dot += static_cast<double>(q[c]) * keys[static_cast<size_t>(j) * d + c];
          p[j] = meta.model.softmax_scale * dot;
          mx = std::max(mx, p[j]);
        }
        for (double& x : p) z += (x = std::exp(x - mx));
        std::vector<int32_t> held = kept[r](t);
        held.push_back(pos);
        std::vector<double> o(d, 0.0), oh(d, 0.0);
        double w = 0;
        for (int j = 0; j <= pos; ++j)
          for (int c = 0; c < d; ++c) o[c] += p[j] / z * values[static_cast<size_t>(j) * d + c];
        for (int32_t j : held) {
          w += p[j] / z;
          for (int c = 0; c < d; ++c) oh[c] += p[j] / z * values[static_cast<size_t>(j) * d + c];
        }
        double diff2 = 0, o2 = 0;
        for (int c = 0; c < d; ++c) {
          diff2 += (oh[c] / w - o[c]) * (oh[c] / w - o[c]);
          o2 += o[c] * o[c];
        }
        sum += std::sqrt(diff2 / o2);
      }
    }
    const double want = sum / (meta.model.num_heads * steps);
    for (int threads : {1, 3}) {
      ReplayOptions o = Options();
      o.threads = threads;
      auto res = Replay(tr, runs, o);
      REQUIRE(res.ok());
      INFO("run " << r << ", threads " << threads);
      CHECK((*res)[r].metrics().output_rel_error_mean() == Approx(want).epsilon(1e-4).margin(1e-7));
      if (r > 0) CHECK(want > 1e-3);  // the run's cache misses attention mass
    }
  }
}

}  // namespace kvsim

namespace kvsim {
namespace {

// Holds the prompt token groups it is given from the prefill on: a group of one token is a plain slot, a
// longer one a merged slot anchored at its first token, its other tokens members in the listed order,
// holding the mean of the group's keys and values. At the `touch` steps the first merged slot is set again
// (a new cache version: that step takes the per-step path, the others the block path). `append`: whether
// the engine appends decode tokens (without, an all-merged selection stays all merged).
class ListMergePolicy final : public Policy {
 public:
  ListMergePolicy(std::vector<std::vector<int32_t>> groups, std::vector<int> touch, bool append)
      : groups_(std::move(groups)), touch_(std::move(touch)), append_(append) {}
  std::string name() const override { return "list_merge"; }
  std::string ParamsText() const override { return ""; }
  PolicyRequirements requirements() const override { return {.decode_attention = true}; }
  bool evicts_during_decode() const override { return false; }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext&) const override {
    class Head final : public HeadPolicy {
     public:
      explicit Head(const ListMergePolicy& p) : p_(p) {}
      void OnPrefill(const HeadContext& ctx, int, HeadCache* cache) override {
        const int d = ctx.head_dim();
        std::vector<int32_t> anchors;
        for (const auto& g : p_.groups_) anchors.push_back(g[0]);
        cache->Assign(anchors);
        for (size_t s = 0; s < p_.groups_.size(); ++s) {
          const auto& g = p_.groups_[s];
          if (g.size() < 2) continue;
          MergedSlot m;
          m.key.assign(d, 0.0f);
          m.value.assign(d, 0.0f);
          for (int32_t tok : g)
            for (int c = 0; c < d; ++c) {
              m.key[c] += ctx.keys[static_cast<size_t>(tok) * d + c] / static_cast<float>(g.size());
              m.value[c] += ctx.values[static_cast<size_t>(tok) * d + c] / static_cast<float>(g.size());
            }
          for (size_t i = 1; i < g.size(); ++i) m.members.emplace_back(g[i], 1.0f);
          cache->SetMerge(static_cast<int>(s), std::move(m));
        }
      }
      void BeforeStep(const HeadContext&, const StepAttention& att, int, HeadCache* cache) override {
        if (std::find(p_.touch_.begin(), p_.touch_.end(), att.step) == p_.touch_.end()) return;
        for (int s = 0; s < cache->size(); ++s)
          if (cache->is_merged(s)) {
            MergedSlot same = cache->merged(s);
            cache->SetMerge(s, std::move(same));
            return;
          }
      }
      bool AppendNewToken() const override { return p_.append_; }

     private:
      const ListMergePolicy& p_;
    };
    return std::make_unique<Head>(*this);
  }

 private:
  std::vector<std::vector<int32_t>> groups_;
  std::vector<int> touch_;
  bool append_;
};

struct PlainMergedMetrics {
  double retained = 0, anchor = 0, covered = 0, share = 0, regret = 0, error = 0, image = 0;
};

// The metrics of a ListMergePolicy run computed plainly, in double, from the trace: softmax over the
// visible keys, a merged slot's weight exp(scale q . k_m - log Z) with k_m the mean of its group's keys.
PlainMergedMetrics PlainMergedRun(MemoryTrace& tr, const std::vector<std::vector<int32_t>>& groups,
                                  bool append) {
  const TraceMeta& meta = tr.meta();
  const int n = meta.prefill_length, steps = meta.num_decode_steps, d = meta.model.head_dim;
  const int t_all = n + steps, group = meta.model.GroupSize(), heads = meta.model.num_heads;
  const double scale = meta.model.softmax_scale;
  PlainMergedMetrics out;
  double share_n = 0;
  for (int l = 0; l < meta.model.num_layers; ++l) {
    LayerData layer;
    REQUIRE(tr.ReadLayer(l, &layer).ok());
    for (int h = 0; h < heads; ++h) {
      const int u = h / group;
      const float* keys = layer.keys.data() + static_cast<size_t>(u) * t_all * d;
      const float* values = layer.values.data() + static_cast<size_t>(u) * t_all * d;
      for (int t = 0; t < steps; ++t) {
        const int pos = n + t, first = FirstVisibleKey(meta.model, pos);
        const int qi = meta.QueryIndex(pos);
        const float* q = layer.HeadQueries(meta, h, qi, qi + 1) + static_cast<size_t>(qi) * d;
        auto logit = [&](const std::vector<double>& k) {
          double dot = 0;
          for (int c = 0; c < d; ++c) dot += static_cast<double>(q[c]) * k[c];
          return scale * dot;
        };
        auto row = [&](const float* base, int32_t j) {
          return std::vector<double>(base + static_cast<size_t>(j) * d,
                                     base + static_cast<size_t>(j + 1) * d);
        };
        std::vector<double> p(t_all, 0.0);
        double mx = -1e300, z = 0;
        for (int j = first; j <= pos; ++j) mx = std::max(mx, p[j] = logit(row(keys, j)));
        for (int j = first; j <= pos; ++j) z += (p[j] = std::exp(p[j] - mx));
        for (int j = first; j <= pos; ++j) p[j] /= z;
        const double lse = mx + std::log(z);
        // The cache: the groups, then the question tokens and the decode tokens up to this step's.
        std::vector<std::vector<int32_t>> slots = groups;
        for (int32_t j = CompressEnd(meta, QuestionMode::kQueryAware); j < n; ++j) slots.push_back({j});
        if (append)
          for (int32_t j = n; j <= pos; ++j) slots.push_back({j});
        double retained = 0, anchor = 0, covered = 0, mw = 0, mmass = 0, wsum = 0;
        int visible = 0;
        std::vector<double> o(d, 0.0), oh(d, 0.0);
        for (int j = first; j <= pos; ++j)
          for (int c = 0; c < d; ++c) o[c] += p[j] * values[static_cast<size_t>(j) * d + c];
        for (const auto& g : slots) {
          if (g[0] < first) continue;
          ++visible;
          if (g.size() == 1) {
            retained += p[g[0]];
            covered += p[g[0]];
            if (meta.tokens.modality[g[0]] == Modality::kImage) out.image += p[g[0]];
            wsum += p[g[0]];
            for (int c = 0; c < d; ++c) oh[c] += p[g[0]] * values[static_cast<size_t>(g[0]) * d + c];
            continue;
          }
          std::vector<double> km(d, 0.0), vm(d, 0.0);
          double mass = 0;
          for (int32_t tok : g) {
            mass += p[tok];
            for (int c = 0; c < d; ++c) {
              km[c] += keys[static_cast<size_t>(tok) * d + c] / g.size();
              vm[c] += values[static_cast<size_t>(tok) * d + c] / g.size();
            }
          }
          const double w = std::exp(logit(km) - lse);
          anchor += p[g[0]];
          covered += mass;
          mw += w;
          mmass += mass;
          wsum += w;
          for (int c = 0; c < d; ++c) oh[c] += w * vm[c];
        }
        std::vector<double> vis(p.begin() + first, p.begin() + pos + 1);
        std::sort(vis.rbegin(), vis.rend());
        double top = 0;
        for (int k = 0; k < std::min<int>(visible, static_cast<int>(vis.size())); ++k) top += vis[k];
        double diff2 = 0, o2 = 0;
        for (int c = 0; c < d; ++c) {
          diff2 += (oh[c] / wsum - o[c]) * (oh[c] / wsum - o[c]);
          o2 += o[c] * o[c];
        }
        out.retained += retained;
        out.anchor += anchor;
        out.covered += covered;
        out.regret += top - retained;
        out.error += std::sqrt(diff2 / o2);
        if (mmass > 0) {
          out.share += mw / mmass;
          ++share_n;
        }
      }
    }
  }
  const double samples = static_cast<double>(meta.model.num_layers) * heads * steps;
  out.retained /= samples;
  out.anchor /= samples;
  out.covered /= samples;
  out.regret /= samples;
  out.error /= samples;
  out.image /= samples;
  out.share = share_n > 0 ? out.share / share_n : 0.0;
  return out;
}

}  // namespace

// The merged-cache metrics of the replay (retained, anchor and covered mass, the merged weight share,
// regret, output error, retained mass by modality) against the plain computation of PlainMergedRun, for a
// cache mixing plain and merged slots, one where every slot is merged (no appends) and one where none is,
// each with and without a sliding window (which masks plain slots and merged ones, anchors and members),
// with blocks and per-step steps, 8 decode steps and 7; bit-identical at 1 and 3 threads.
TEST_CASE("replay: merged-cache metrics equal a plain computation (mixed, all merged, none merged, window)",
          "[replay][merge]") {
  testing::TinyTraceSpec spec;
  spec.num_layers = 1;
  spec.num_heads = 4;  // GQA: group of 2
  spec.prefill_length = 40;
  spec.image_begin = 4;
  spec.image_end = 30;
  spec.question_tokens = 0;  // compress_end = n: every prompt token is the policy's
  // 7 steps: FinishRun's output errors, four rows at a time, end on a short block.
  spec.decode_steps = GENERATE(8, 7);
  spec.seed = 5;
  MemoryTrace base = testing::MakeTinyTrace(spec);
  const int n = spec.prefill_length;
  // Groups of sizes cycling through `sizes`, every `drop`-th group evicted (0: none); members in reverse.
  auto groups = [&](std::vector<int> sizes, int drop) {
    std::vector<std::vector<int32_t>> out;
    int gi = 0;
    for (int32_t j = 0, k = 0; j < n; ++k) {
      const int size = std::min(sizes[k % sizes.size()], n - j);
      std::vector<int32_t> g(size);
      std::iota(g.begin(), g.end(), j);
      if (size > 2) std::reverse(g.begin() + 1, g.end());
      if (drop == 0 || ++gi % drop != 0) out.push_back(g);
      j += size;
    }
    return out;
  };
  struct Case {
    const char* name;
    std::vector<std::vector<int32_t>> groups;
    bool append;
  };
  const std::vector<Case> cases = {{"mixed", groups({1, 1, 3, 1, 2, 1, 1, 5, 1, 4}, 6), true},
                                   {"all merged", groups({2, 3, 5, 4}, 0), false},
                                   {"none merged", groups({1}, 4), true}};
  for (int window : {0, 17}) {
    TraceMeta meta = base.meta();
    meta.model.sliding_window = window;
    LayerData layer;
    REQUIRE(base.ReadLayer(0, &layer).ok());
    MemoryTrace tr(meta, {layer});
    for (const Case& c : cases) {
      const PlainMergedMetrics want = PlainMergedRun(tr, c.groups, c.append);
      std::vector<RunSpec> runs;
      for (std::vector<int> touch :
           {std::vector<int>{}, std::vector<int>{2, 5}, std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}})
        runs.push_back(Spec(std::make_shared<ListMergePolicy>(c.groups, touch, c.append), n));
      auto a = Replay(tr, runs, ReplayOptions{.threads = 1});
      auto b = Replay(tr, runs, ReplayOptions{.threads = 3});
      REQUIRE(a.ok());
      REQUIRE(b.ok());
      for (size_t r = 0; r < runs.size(); ++r) {
        INFO(c.name << ", window " << window << ", touch variant " << r);
        CHECK((*a)[r].SerializeAsString() == (*b)[r].SerializeAsString());
        const Metrics& m = (*a)[r].metrics();
        const double eps = 1e-5;
        CHECK(m.retained_mass_mean() == Approx(want.retained).epsilon(eps).margin(1e-7));
        CHECK(m.merged_anchor_mass_mean() == Approx(want.anchor).epsilon(eps).margin(1e-7));
        CHECK(m.covered_mass_mean() == Approx(want.covered).epsilon(eps).margin(1e-7));
        CHECK(m.merged_weight_over_mass_mean() == Approx(want.share).epsilon(eps).margin(1e-7));
        CHECK(m.regret_vs_oracle_mean() == Approx(want.regret).epsilon(eps).margin(1e-7));
        CHECK(m.output_rel_error_mean() == Approx(want.error).epsilon(1e-4).margin(1e-7));
        CHECK(m.retained_mass_by_modality().image() == Approx(want.image).epsilon(eps).margin(1e-7));
      }
      // The cases are what they claim: merged mass, or none; plain mass, or none; masking with the window.
      if (std::string(c.name) == "none merged") {
        CHECK(want.share == 0);
        CHECK(want.anchor == 0);
      } else {
        CHECK(want.share > 0);
        CHECK(want.covered > want.retained + want.anchor + 0.05);
      }
      if (std::string(c.name) == "all merged") CHECK(want.retained == 0);
      if (std::string(c.name) == "mixed") CHECK(want.retained > 0.05);
    }
  }
}

// MergedSlotSums against the per-slot loop Step had (one pass over the slots in slot order, each sum in its
// own double), bit for bit: values over many binades, so any other order of any sum's additions changes
// it; merged slots anywhere (first, last, adjacent, every slot, none), masked slots of both kinds.
TEST_CASE("replay: the merged-slot sums add in slot order, as the per-slot loop does", "[replay][merge]") {
  auto loop = [](const std::vector<int32_t>& tk, const std::vector<float>& p,
                 const std::vector<Modality>& mod, int first, const std::vector<char>& is_merged,
                 const std::vector<float>& mw, const std::vector<double>& members, std::vector<float>* cp) {
    MergedSlotSumsResult r;
    int j = 0;
    for (size_t s = 0; s < tk.size(); ++s) {
      const bool merged = is_merged[s];
      const int jm = merged ? j++ : -1;
      const int32_t tok = tk[s];
      if (tok < first) continue;
      ++r.visible;
      const float pt = p[tok];
      float wgt;
      if (!merged) {
        r.retained += pt;
        r.ret_mod[static_cast<int>(mod[tok])] += pt;
        wgt = pt;
        r.covered += pt;
      } else {
        wgt = mw[jm];
        r.anchor += pt;
        r.covered += pt;
        r.covered += members[jm];
        r.merged_w += wgt;
        r.merged_mass += pt + members[jm];
      }
      if (cp) (*cp)[s] = wgt;
      r.wsum += wgt;
    }
    return r;
  };
  auto bits = [](double x) { return std::bit_cast<uint64_t>(x); };
  std::mt19937 rng(11);
  auto binades = [&](int spread) {
    return std::ldexp(std::uniform_real_distribution<float>(1, 2)(rng), -static_cast<int>(rng() % spread));
  };
  const int n = 400;
  int cases = 0;
  for (int slots : {0, 1, 2, 3, 7, 64, 131, 400}) {
    for (int every : {0, 1, 2, 3, 17}) {  // merged: none, all, or every k-th slot from a random offset
      for (int first : {0, 150}) {
        for (bool with_cp : {false, true}) {
          std::vector<float> p(n);
          std::vector<Modality> mod(n);
          for (int i = 0; i < n; ++i) {
            p[i] = binades(40);
            mod[i] = static_cast<Modality>(rng() % 4);
          }
          p[5] = 0.0f;
          p[6] = std::numeric_limits<float>::denorm_min();
          std::vector<int32_t> tk(slots);
          for (int s = 0; s < slots; ++s) tk[s] = static_cast<int32_t>(rng() % n);
          std::vector<char> is_merged(slots, 0);
          std::vector<int32_t> merged;
          const int offset = every > 1 ? static_cast<int>(rng() % every) : 0;
          for (int s = 0; s < slots; ++s)
            if (every == 1 || (every > 1 && s % every == offset)) {
              is_merged[s] = 1;
              merged.push_back(s);
            }
          std::vector<float> mw(merged.size());
          std::vector<double> members(merged.size());
          for (size_t j = 0; j < merged.size(); ++j) {
            mw[j] = binades(30);
            members[j] = static_cast<double>(binades(30)) * (1 + std::ldexp(static_cast<double>(rng()), -60));
          }
          std::vector<float> cp_a(slots, -1), cp_b(slots, -1);
          const MergedSlotSumsResult a =
              loop(tk, p, mod, first, is_merged, mw, members, with_cp ? &cp_a : nullptr);
          const MergedSlotSumsResult b = MergedSlotSums(
              tk.data(), slots, p.data(), mod.data(), first, merged.data(), static_cast<int>(merged.size()),
              mw.data(), members.data(), with_cp ? cp_b.data() : nullptr);
          INFO("slots " << slots << ", merged every " << every << ", first " << first << ", cp " << with_cp);
          CHECK(a.visible == b.visible);
          CHECK(cp_a == cp_b);
          CHECK(bits(a.wsum) == bits(b.wsum));
          CHECK(bits(a.retained) == bits(b.retained));
          CHECK(bits(a.anchor) == bits(b.anchor));
          CHECK(bits(a.covered) == bits(b.covered));
          CHECK(bits(a.merged_w) == bits(b.merged_w));
          CHECK(bits(a.merged_mass) == bits(b.merged_mass));
          for (int mo = 0; mo < 4; ++mo) CHECK(bits(a.ret_mod[mo]) == bits(b.ret_mod[mo]));
          ++cases;
        }
      }
    }
  }
  CHECK(cases == 8 * 5 * 2 * 2);
}

// MergedSlotSumsSteps (several steps at once from transposed probabilities) and MergedSlotSumsAppend (a
// step's appended plain slots) against MergedSlotSums of each step over all its slots, bit for bit: values
// over many binades (any other order of a sum's additions changes it), zeros and subnormals, every count of
// steps up to 9 (partial groups of four), merged slots anywhere or none, appended slots or none.
TEST_CASE("replay: merged-slot sums of several steps at once equal each step's", "[replay][merge]") {
  auto bits = [](double x) { return std::bit_cast<uint64_t>(x); };
  std::mt19937 rng(12);
  auto binades = [&](int spread) {
    return std::ldexp(std::uniform_real_distribution<float>(1, 2)(rng), -static_cast<int>(rng() % spread));
  };
  const int n = 300, stride = 16;  // tokens; the transposed rows' length (>= 4 * ceil(9 / 4))
  int cases = 0;
  for (int slots : {0, 1, 5, 64, 131}) {
    for (int every : {0, 1, 3, 17}) {
      for (int nsteps : {1, 2, 3, 4, 5, 8, 9}) {
        for (int appended : {0, 3}) {
          std::vector<float> pt(static_cast<size_t>(n) * stride + stride);  // [token][step] (+ padding)
          for (float& x : pt) x = binades(40);
          pt[5 * stride + 1] = 0.0f;
          pt[6 * stride] = std::numeric_limits<float>::denorm_min();
          std::vector<Modality> mod(n);
          for (auto& m : mod) m = static_cast<Modality>(rng() % 4);
          std::vector<int32_t> tk(slots + appended);
          for (int s = 0; s < slots; ++s) tk[s] = static_cast<int32_t>(rng() % 250);
          for (int s = 0; s < appended; ++s) tk[slots + s] = 250 + s;
          std::vector<int32_t> merged;
          const int offset = every > 1 ? static_cast<int>(rng() % every) : 0;
          for (int s = 0; s < slots; ++s)
            if (every == 1 || (every > 1 && s % every == offset)) merged.push_back(s);
          const int mm = static_cast<int>(merged.size());
          std::vector<float> mw(static_cast<size_t>(nsteps) * mm);
          std::vector<double> members(mw.size());
          for (size_t j = 0; j < mw.size(); ++j) {
            mw[j] = binades(30);
            members[j] = static_cast<double>(binades(30)) * (1 + std::ldexp(static_cast<double>(rng()), -60));
          }
          std::vector<MergedSlotSumsResult> got(nsteps);
          MergedSlotSumsSteps(tk.data(), slots, pt.data(), stride, mod.data(), merged.data(), mm, mw.data(),
                              mm, members.data(), mm, nsteps, got.data());
          for (int i = 0; i < nsteps; ++i) {
            std::vector<float> p(n);
            for (int tok = 0; tok < n; ++tok) p[tok] = pt[static_cast<size_t>(tok) * stride + i];
            MergedSlotSumsAppend(tk.data() + slots, appended, p.data(), mod.data(), &got[i]);
            const MergedSlotSumsResult want =
                MergedSlotSums(tk.data(), slots + appended, p.data(), mod.data(), 0, merged.data(), mm,
                               mw.data() + static_cast<size_t>(i) * mm,
                               members.data() + static_cast<size_t>(i) * mm, nullptr);
            INFO("slots " << slots << ", merged every " << every << ", steps " << nsteps << ", step " << i
                          << ", appended " << appended);
            CHECK(got[i].visible == want.visible);
            CHECK(bits(got[i].wsum) == bits(want.wsum));
            CHECK(bits(got[i].retained) == bits(want.retained));
            CHECK(bits(got[i].anchor) == bits(want.anchor));
            CHECK(bits(got[i].covered) == bits(want.covered));
            CHECK(bits(got[i].merged_w) == bits(want.merged_w));
            CHECK(bits(got[i].merged_mass) == bits(want.merged_mass));
            for (int mo = 0; mo < 4; ++mo) CHECK(bits(got[i].ret_mod[mo]) == bits(want.ret_mod[mo]));
          }
          ++cases;
        }
      }
    }
  }
  CHECK(cases == 5 * 4 * 7 * 2);
}

// MergedWeights against the formula it replaces, bit for bit: random steps' dots, the ends of its vector
// range, values outside it (NaN, infinities, subnormal and overflowing weights) and weights within a few
// ulp of a midpoint between two floats (where the vector path must hand the lane to std::exp).
TEST_CASE("MergedWeights: the float of std::exp, bit for bit", "[replay]") {
  const bool avx512 = GENERATE(true, false);  // where the CPU has AVX-512: its loop, then the AVX2 one
  SetMergedWeightsAvx512ForTesting(avx512);
  struct Restore {
    ~Restore() { SetMergedWeightsAvx512ForTesting(true); }
  } restore;
  auto check = [](const std::vector<float>& dots, const LogitTransform& tf, float lse) {
    std::vector<float> got(dots.size());
    MergedWeights(dots.data(), static_cast<int>(dots.size()), tf, lse, got.data());
    int bad = 0;
    for (size_t j = 0; j < dots.size(); ++j) {
      const float want = static_cast<float>(std::exp(static_cast<double>(tf(dots[j])) - lse));
      if (std::bit_cast<uint32_t>(got[j]) != std::bit_cast<uint32_t>(want)) ++bad;
    }
    return bad;
  };
  std::mt19937 rng(12);
  const LogitTransform tf(1.0f / std::sqrt(128.0f), 0.0f);
  for (int rep = 0; rep < 200; ++rep) {
    std::normal_distribution<float> dot(0.0f, rep % 2 ? 30.0f : 300.0f);
    std::uniform_real_distribution<float> lse(-20.0f, 60.0f);
    std::vector<float> dots(1000 + rep % 7);
    for (float& x : dots) x = dot(rng);
    REQUIRE(check(dots, tf, lse(rng)) == 0);
  }
  // The range's ends and beyond.
  const LogitTransform one(1.0f, 0.0f);
  std::vector<float> ends;
  for (float x : {-87.0f, 80.0f, -87.33f, -88.0f, -103.0f, -104.0f, -150.0f, -800.0f, 80.5f, 88.7f, 88.8f,
                  100.0f, 800.0f, 0.0f, -0.0f, 1e-30f, -1e-30f})
    for (int i = -3; i <= 3; ++i) {
      float y = x;
      for (int k = 0; k < std::abs(i); ++k) y = std::nextafter(y, i < 0 ? -1e9f : 1e9f);
      ends.push_back(y);
    }
  for (float x : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min()})
    ends.push_back(x);
  REQUIRE(check(ends, one, 0.0f) == 0);
  REQUIRE(check(ends, tf, 3.5f) == 0);
  // Near midpoints: x = a - b ≈ ln m (a the float nearest ln m, b the float nearest a - ln m), so e^x is
  // within a few double ulp of the midpoint m between two floats.
  std::uniform_real_distribution<double> unit(0.3, 3.0);
  int n = 0;
  for (int rep = 0; rep < 100; ++rep) {
    std::vector<float> dots;
    std::vector<float> lses;
    for (int i = 0; i < 1000; ++i) {
      const float f = static_cast<float>(unit(rng));
      const long double m = (static_cast<long double>(f) + std::nextafter(f, 10.0f)) / 2;
      const long double lm = std::log(m);
      const float a = static_cast<float>(lm);
      dots.push_back(a);
      lses.push_back(static_cast<float>(a - lm));
    }
    // One lse per call: group the dots by theirs.
    for (int i = 0; i < 1000; ++i) {
      std::vector<float> group(8, dots[i]);  // whole vector lane groups (8 lanes on AVX-512, 2 x 4 on AVX2)
      n += check(group, one, lses[i]);
    }
  }
  REQUIRE(n == 0);
  // A soft-capped transform takes the scalar path.
  std::vector<float> dots(37);
  for (float& x : dots) x = std::normal_distribution<float>(0.0f, 30.0f)(rng);
  REQUIRE(check(dots, LogitTransform(0.1f, 30.0f), 2.0f) == 0);
}

}  // namespace kvsim

namespace kvsim {
namespace {

// A prefill-compressing policy that keeps its top-`budget` prompt tokens by a fixed score (a hash of the
// token, with runs of equal scores: ties are taken by ascending token, as TopKIndices does) and exposes the
// scores (HeadPolicy::PrefillRank). `nan_at` >= 0 puts a NaN score on that token (kept at any budget);
// `lower_at` >= 0 lowers the score of the token at that place of the rank order a little, below its ties:
// the order is the same before that place and differs there.
class RankedPolicy final : public Policy {
 public:
  explicit RankedPolicy(int nan_at = -1, int lower_at = -1) : nan_at_(nan_at), lower_at_(lower_at) {}
  std::string name() const override { return "ranked"; }
  std::string ParamsText() const override { return ""; }
  PolicyRequirements requirements() const override { return {}; }
  bool evicts_during_decode() const override { return false; }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext&) const override {
    class Head final : public HeadPolicy {
     public:
      Head(int nan_at, int lower_at) : nan_at_(nan_at), lower_at_(lower_at) {}
      void OnPrefill(const HeadContext& ctx, int budget, HeadCache* cache) override {
        const int n = ctx.compress_end;
        rank_.resize(n);
        for (int j = 0; j < n; ++j)
          rank_[j] = static_cast<float>(((j * 2654435761u + ctx.kv_head * 40503u) >> 7) % 23);  // ties
        if (lower_at_ >= 0 && lower_at_ < n) {
          std::vector<int32_t> order(n);
          std::iota(order.begin(), order.end(), 0);
          std::stable_sort(order.begin(), order.end(),
                           [&](int32_t a, int32_t b) { return rank_[a] > rank_[b]; });
          float& v = rank_[order[lower_at_]];
          v = std::nextafter(v, -std::numeric_limits<float>::infinity());
        }
        std::vector<int32_t> keep = TopKIndices(rank_, budget);
        if (nan_at_ >= 0 && nan_at_ < n) {
          rank_[nan_at_] = std::numeric_limits<float>::quiet_NaN();
          if (!std::binary_search(keep.begin(), keep.end(), nan_at_)) {
            keep.back() = nan_at_;
            std::sort(keep.begin(), keep.end());
          }
        }
        cache->Assign(keep);
      }
      std::span<const float> PrefillRank() const override { return rank_; }

     private:
      int nan_at_, lower_at_;
      std::vector<float> rank_;
    };
    return std::make_unique<Head>(nan_at_, lower_at_);
  }

 private:
  int nan_at_, lower_at_;
};

// Holds the whole prompt at step 0 (its decode token appended) and compresses after it to every third
// prompt token, the decode token kept (compression_step 0, as MEDA's official code): then appends. `late`:
// from step 1 on, also evicts the cache's first slot each step (the steps no longer prefix-closed: 1), or
// appends at step 2 an old prompt token it dropped (added at the step's position, not past it: 2).
class StepZeroPolicy final : public Policy {
 public:
  explicit StepZeroPolicy(int late = 0) : late_(late) {}
  std::string name() const override { return "step_zero"; }
  std::string ParamsText() const override { return std::to_string(late_); }
  PolicyRequirements requirements() const override { return {}; }
  bool evicts_during_decode() const override { return true; }
  bool may_exceed_budget() const override { return true; }
  int compression_step() const override { return 0; }
  int decode_headroom() const override { return 1; }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext&) const override {
    class Head final : public HeadPolicy {
     public:
      explicit Head(int late) : late_(late) {}
      void OnPrefill(const HeadContext& ctx, int, HeadCache* cache) override {
        cache->AssignRange(0, ctx.prefill_length());
      }
      void AfterStep(const HeadContext& ctx, const StepAttention& att, HeadCache* cache) override {
        const int n = ctx.prefill_length();
        if (att.step == 0) {
          std::vector<int32_t> keep;
          for (int32_t j = ctx.kv_head % 3; j < n; j += 3) keep.push_back(j);
          keep.push_back(n);
          cache->Assign(keep);
        } else if (late_ == 1) {
          cache->EvictSlot(0);
        } else if (late_ == 2 && att.step == 2) {
          cache->Append(ctx.kv_head % 3 + 1);
        }
      }

     private:
      int late_;
    };
    return std::make_unique<Head>(late_);
  }

 private:
  int late_;
};

MemoryTrace BandTrace(int num_kv_heads = 2) {
  testing::TinyTraceSpec spec;
  spec.num_layers = 1;
  spec.num_heads = 4;
  spec.num_kv_heads = num_kv_heads;
  spec.head_dim = 16;
  spec.prefill_length = 420;
  spec.image_begin = 10;
  spec.image_end = 300;
  spec.decode_steps = 9;
  return testing::MakeTinyTrace(spec);
}

}  // namespace

// A ranked run adds its output product in bands of 64 columns in rank order, and resumes from the sum of
// another run's first bands when they hold the same tokens in the same order (budgets 40 .. 380 of one
// ranking: nested sets, resumed at 64, 128, 192, 320 columns); so does a sliding window with the tokens it
// holds at every step, in blocks of 64 positions back from the prompt's end. Each run's results are its own:
// the same bits alone as beside the others, with the kept sums switched off, and at 1 and 3 threads.
TEST_CASE("replay: a ranked run's output product is its own, alone or resuming another run's bands",
          "[replay]") {
  for (int hkv : {2, 4}) {  // GQA (group of 2) and MHA
    MemoryTrace tr = BandTrace(hkv);
    auto ranked = std::make_shared<RankedPolicy>();
    std::vector<RunSpec> runs;
    for (int b : {40, 70, 130, 200, 380, 130}) runs.push_back(Spec(ranked, b));
    // Sliding windows (the runs path): their full tokens in position bands, nested.
    for (int b : {90, 150, 300}) runs.push_back(Spec(Registered("streaming_llm"), b));
    CheckSameWithout(tr, runs, &SetRankBandMemoForTesting);
    auto together = Replay(tr, runs, Options());
    REQUIRE(together.ok());
    for (size_t i = 0; i < runs.size(); ++i) {
      auto alone = Replay(tr, std::vector<RunSpec>{runs[i]}, Options());
      REQUIRE(alone.ok());
      INFO("kv heads " << hkv << ", run " << i);
      CHECK((*alone)[0].SerializeAsString() == (*together)[i].SerializeAsString());
    }
    CHECK((*together)[2].SerializeAsString() == (*together)[5].SerializeAsString());
  }
  // Two rankings whose orders part at place 124, four columns short of the second band's end: the second
  // (at 200) may resume from the first's sum of one band (kept for neither run here), never of two (kept
  // for the first's run at 130).
  MemoryTrace tr = BandTrace();
  auto a = std::make_shared<RankedPolicy>(), b = std::make_shared<RankedPolicy>(-1, 124);
  const std::vector<RunSpec> runs{Spec(a, 130), Spec(a, 200), Spec(b, 200)};
  auto together = Replay(tr, runs, Options());
  auto alone = Replay(tr, std::vector<RunSpec>{runs[2]}, Options());
  REQUIRE(together.ok());
  REQUIRE(alone.ok());
  CHECK((*alone)[0].SerializeAsString() == (*together)[2].SerializeAsString());
  CHECK((*together)[1].SerializeAsString() != (*together)[2].SerializeAsString());
}

namespace {

// The window-band tests' runs on BandTrace(hkv), each the same with and without `hook`'s path
// (CheckSameWithout): streaming_llm at several budgets (bands resumed from another window's run, whole and
// partial bands), a window that holds sinks and a fixed block too, and streaming_llm with 70 sinks.
void CheckWindowBandsSameWithout(int hkv, void (*hook)(bool)) {
  MemoryTrace tr = BandTrace(hkv);
  auto window = std::make_shared<ActPolicy>([](int step, HeadCache* c) {
    std::vector<int32_t> keep;
    for (int32_t t = 0; t < 4; ++t) keep.push_back(t);                 // sinks
    for (int32_t t = 100; t < 140; ++t) keep.push_back(t);             // a fixed block
    for (int32_t t = 200 + 3 * step; t < 420; ++t) keep.push_back(t);  // a window
    c->Assign(keep);
  });
  std::vector<RunSpec> runs;
  for (int b : {30, 90, 150, 300, 410}) runs.push_back(Spec(Registered("streaming_llm"), b));
  runs.push_back(Spec(window, 420));
  runs.push_back(Spec(Registered("streaming_llm", {"num_sinks=70"}), 200));
  INFO("kv heads " << hkv);
  CheckSameWithout(tr, runs, hook);
}

}  // namespace

// A sliding window's output product reads the value rows of a band of consecutive tokens in place in V
// (its full tokens' bands and the columns after them), and copies the others (a band across blocks, the
// sinks with the window's oldest tokens): the same operands, so the same bits as copying every row. Windows
// of several sizes (bands resumed from another window's run, whole and partial bands), GQA and MHA, a
// window that holds sinks and a fixed block too, and a scattered cache (the token-by-token loops).
TEST_CASE("replay: a window's value rows read in place give the copied rows' results", "[replay]") {
  for (int hkv : {2, 4}) {
    CheckWindowBandsSameWithout(hkv, &SetInPlaceValueRowsForTesting);
  }
}

// With one query head per KV head, a sliding window's full bands read A in place in the reference
// probabilities' rows (T apart) and A's full columns are not written: the same operands, so the same bits as
// the copied A. Windows of several sizes (bands resumed from another window's run, whole and partial bands),
// a window that holds sinks and a fixed block too, and GQA (never in place: A's rows span the group).
TEST_CASE("replay: a window's probability rows read in place give the copied A's results", "[replay]") {
  for (int hkv : {4, 2}) {
    CheckWindowBandsSameWithout(hkv, &SetInPlaceProbRowsForTesting);
  }
}

// The bands change only the order in which the product's terms are added: the output errors agree with
// token order to float rounding, and differ from it somewhere (the bands were used).
TEST_CASE("replay: rank bands and the shared decode part agree with one product in token order", "[replay]") {
  MemoryTrace tr = BandTrace();
  std::vector<RunSpec> runs;
  for (int b : {40, 130, 380}) runs.push_back(Spec(std::make_shared<RankedPolicy>(), b));
  runs.push_back(Spec(Registered("snapkv"), 150));
  runs.push_back(Spec(Registered("streaming_llm"), 150));
  auto banded = Replay(tr, runs, Options());
  SetOutputBandsForTesting(false);
  SetSharedDecodePartForTesting(false);
  auto plain = Replay(tr, runs, Options());
  SetOutputBandsForTesting(true);
  SetSharedDecodePartForTesting(true);
  REQUIRE(banded.ok());
  REQUIRE(plain.ok());
  bool differs = false;
  for (size_t i = 0; i < runs.size(); ++i) {
    const Metrics &a = (*banded)[i].metrics(), &b = (*plain)[i].metrics();
    INFO("run " << i);
    CHECK(a.output_rel_error_mean() == Approx(b.output_rel_error_mean()).epsilon(1e-5));
    CHECK(a.output_rel_error_p95() == Approx(b.output_rel_error_p95()).epsilon(1e-5));
    CHECK(a.retained_mass_mean() == b.retained_mass_mean());  // the sums are not the product's
    CHECK(a.bound_violations() == 0);
    differs = differs || a.output_rel_error_mean() != b.output_rel_error_mean();
  }
  CHECK(differs);
}

// A NaN among the kept scores has no rank: the run's product falls back to token order (the same bits as
// with the bands switched off), and the run beside it at another budget keeps its own results.
TEST_CASE("replay: a NaN rank falls back to token order", "[replay]") {
  MemoryTrace tr = BandTrace();
  std::vector<RunSpec> runs{Spec(std::make_shared<RankedPolicy>(7), 200),
                            Spec(std::make_shared<RankedPolicy>(), 300)};
  auto with = Replay(tr, runs, Options());
  SetOutputBandsForTesting(false);
  auto without = Replay(tr, runs, Options());
  SetOutputBandsForTesting(true);
  REQUIRE(with.ok());
  REQUIRE(without.ok());
  CHECK((*with)[0].SerializeAsString() == (*without)[0].SerializeAsString());
  CHECK((*with)[1].SerializeAsString() != (*without)[1].SerializeAsString());
}

// A run whose step 0 holds every visible token as itself and whose later steps are prefix-closed (a cache
// compressed after step 0, then appended to) takes step 0's row from the reference and the other steps'
// product over their own union: its output errors agree with the per-step sums to float rounding, and the
// split is counted as taken (whether the bits differ depends on the BLAS kernels: with OpenBLAS's SkylakeX
// set they happened not to); the runs whose later steps are not prefix-closed keep their bits. Each run's
// results are its own: the same alone as beside the others.
TEST_CASE("replay: a whole step 0 is taken on its own, the prefix-closed steps after it as one product",
          "[replay]") {
  for (int hkv : {2, 4}) {  // GQA (group of 2) and MHA
    MemoryTrace tr = BandTrace(hkv);
    const std::vector<RunSpec> runs{Spec(std::make_shared<StepZeroPolicy>(), 100),
                                    Spec(std::make_shared<StepZeroPolicy>(1), 100),
                                    Spec(std::make_shared<StepZeroPolicy>(2), 100),
                                    Spec(Registered("meda", {"variant=OFFICIAL_CODE"}), 100)};
    const int64_t splits0 = StepZeroSplitsForTesting();
    auto split = Replay(tr, runs, Options());
    const int64_t splits1 = StepZeroSplitsForTesting();
    SetStepZeroSplitForTesting(false);
    auto whole = Replay(tr, runs, Options());
    SetStepZeroSplitForTesting(true);
    CHECK(splits1 > splits0);                      // the split was taken ...
    CHECK(StepZeroSplitsForTesting() == splits1);  // ... and not with the hook off
    REQUIRE(split.ok());
    REQUIRE(whole.ok());
    for (size_t i = 0; i < runs.size(); ++i) {
      const Metrics &a = (*split)[i].metrics(), &b = (*whole)[i].metrics();
      INFO("kv heads " << hkv << ", run " << i);
      CHECK(a.output_rel_error_mean() > 0);
      CHECK(a.output_rel_error_mean() == Approx(b.output_rel_error_mean()).epsilon(1e-6));
      CHECK(a.output_rel_error_p95() == Approx(b.output_rel_error_p95()).epsilon(1e-6));
      CHECK(a.retained_mass_mean() == b.retained_mass_mean());
      if (i == 1 || i == 2) CHECK((*split)[i].SerializeAsString() == (*whole)[i].SerializeAsString());
      auto alone = Replay(tr, std::vector<RunSpec>{runs[i]}, Options());
      REQUIRE(alone.ok());
      CHECK((*alone)[0].SerializeAsString() == (*split)[i].SerializeAsString());
    }
  }
}

}  // namespace kvsim
