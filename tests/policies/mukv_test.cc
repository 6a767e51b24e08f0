// MuKV (policies/mukv.h): block cutting, dual-signal compression of one block (FFT and diff) on hand-computed
// cases, int(g * keep) counts and the default budget, the retrieval (parallel stage 1 with over-retrieval,
// semi-hierarchical rerank, assembly order, query vector) on hand-made block encodings whose representatives
// point in chosen directions, and the policy end to end through the registry and the streaming engine with
// derived block encodings.

#include "policies/mukv.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <map>
#include <random>

#include "policies/stream_registry.h"
#include "sim/stream_replay.h"
#include "tests/sim/stream_test_util.h"

namespace kvsim {

namespace {

using testing::MakeTinyStreamTrace;
using testing::TinyStreamSpec;

std::shared_ptr<const StreamPolicy> Make(std::vector<std::string> sets = {}) {
  auto p = StreamPolicyRegistry::Default().Create("mukv", sets);
  INFO((p.ok() ? std::string("ok") : p.status().message()));
  REQUIRE(p.ok());
  return *p;
}

Status CreateStatus(std::vector<std::string> sets) {
  auto p = StreamPolicyRegistry::Default().Create("mukv", sets);
  return p.ok() ? Status::Ok() : p.status();
}

// ---- Hand-made block encodings ----
// 4 frames of 196 tokens (init 4): blocks of 49 (16), 196 (4) and 784 (1). Every token of a block has the
// same key, the unit vector at the block's angle, so its representative r (mean of the kept keys) is that
// vector whatever is kept. 2 query heads, 1 KV head, head_dim 2, 2 layers.
constexpr double kDeg = M_PI / 180.0;

TinyStreamSpec BigSpec(int head_dim) {
  TinyStreamSpec s;
  s.num_layers = 2;
  s.num_heads = 2;
  s.num_kv_heads = 1;
  s.head_dim = head_dim;
  s.init_len = 4;
  s.tokens_per_frame = 196;
  s.num_frames = 4;
  s.question_times = {2.5, 3.5};  // frames_before 3 and 4
  s.evidence = {{2}, {3}};
  s.question_tokens = 2;
  s.answer_tokens = 1;
  return s;
}

class HandAccess : public StreamLayerAccess {
 public:
  HandAccess(MemoryTrace* trace, std::map<int, std::vector<double>> angles, bool with_attention = true)
      : trace_(trace) {
    const TraceMeta& meta = trace->meta();
    for (auto& [g, deg] : angles) {
      BlockEncodingInfo info;
      info.granularity = g;
      const auto cut = CutVideoBlocks(*meta.stream, g);
      info.num_blocks = static_cast<int>(cut.size());
      REQUIRE(deg.size() == cut.size());
      for (const VideoBlock& b : cut)
        for (int j = 0; j < g; ++j) info.token_positions.push_back(b.first_token + j);
      info.attention_layers = {meta.model.num_layers - 1};
      BlockLayerData data;
      data.granularity = g;
      const size_t n = static_cast<size_t>(info.num_blocks) * g;
      data.keys.resize(n * 2);
      data.values.assign(n * 2, 0.0f);
      data.attention_received.resize(2 * n);
      for (size_t i = 0; i < n; ++i) {
        const double a = deg[i / g] * kDeg;
        data.keys[i * 2] = static_cast<float>(std::cos(a));
        data.keys[i * 2 + 1] = static_cast<float>(std::sin(a));
        // Attention rises along the block: with constant keys the diff signal is 0, so DIFF keeps the last
        // int(g * keep) offsets.
        data.attention_received[i] = data.attention_received[n + i] = static_cast<float>(i % g);
      }
      if (!with_attention) data.attention_received.clear();
      info_[g] = std::move(info);
      data_[g] = std::move(data);
    }
  }
  StatusOr<const LayerData*> Stream(int layer) override { return &trace_->layers()[layer]; }
  StatusOr<StreamBlockLayer> Blocks(int g, int layer) override {
    StreamBlockLayer b;
    b.granularity = g;
    b.info = &info_.at(g);
    b.data = &data_.at(g);
    b.derived = false;
    return b;
  }

 private:
  MemoryTrace* trace_;
  std::map<int, BlockEncodingInfo> info_;
  std::map<int, BlockLayerData> data_;
};

// Angles (degrees): g49 block 0 = 20° ("A"), block 9 = -25° ("B"), the rest 90°; g196 frames 50°, -70°, 10°,
// 80°; g784 -60°. The last question token's last-layer key (OFFICIAL_CODE query) is [1, 0]; the question
// tokens' last-layer queries (PAPER query) point at -25°.
// Bank order (ready frame, then fine to coarse): frame f holds g49 blocks 4f..4f+3 at bank 5f..5f+3 and the
// g196 block at 5f+4; the g784 block (ready at frame 3) is bank 20. So g49 block 9 is bank 11, g196 frame f
// is bank 5f+4.
struct HandCase {
  testing::TinyStream ts;
  std::unique_ptr<HandAccess> access;
};

HandCase MakeHandCase() {
  HandCase c;
  c.ts = MakeTinyStreamTrace(BigSpec(2));
  std::vector<double> g49(16, 90.0);
  g49[0] = 20;
  g49[9] = -25;
  c.access = std::make_unique<HandAccess>(
      &c.ts.trace, std::map<int, std::vector<double>>{{49, g49}, {196, {50, -70, 10, 80}}, {784, {-60}}});
  MemoryTrace& tr = c.ts.trace;
  const int64_t tq = static_cast<int64_t>(tr.meta().query_positions.size());
  LayerData& last = tr.layers()[1];
  for (const StreamQuestion& q : tr.meta().stream->questions) {
    const int32_t lastq = q.token_begin + q.num_question_tokens - 1;
    last.keys[lastq * 2] = 1;
    last.keys[lastq * 2 + 1] = 0;
    for (int qh = 0; qh < 2; ++qh)
      for (int j = 0; j < q.num_question_tokens; ++j) {
        float* v = last.queries.data() + (qh * tq + tr.meta().QueryIndex(q.token_begin + j)) * 2;
        v[0] = static_cast<float>(std::cos(-25 * kDeg));
        v[1] = static_cast<float>(std::sin(-25 * kDeg));
      }
  }
  return c;
}

struct Retrieval {
  std::vector<std::vector<int32_t>> banks;  // per question: bank indices in context order
  std::vector<std::map<std::string, double>> stats;
  std::unique_ptr<StreamPlan> plan;
};

Retrieval Retrieve(HandCase& c, const std::vector<std::string>& sets, int budget) {
  auto policy = Make(sets);
  StreamPlanInput in;
  in.meta = &c.ts.trace.meta();
  in.budget_tokens = budget;
  in.layers = c.access.get();
  auto plan = policy->Plan(in);
  INFO((plan.ok() ? std::string("ok") : plan.status().message()));
  REQUIRE(plan.ok());
  Retrieval r;
  r.plan = std::move(*plan);
  r.stats = r.plan->question_stats;
  StreamLayerInput li;
  li.meta = in.meta;
  li.layer = 0;
  li.stream = &c.ts.trace.layers()[0];
  li.budget_tokens = budget;
  for (int q = 0; q < 2; ++q) {
    ContextSelection sel;
    REQUIRE(policy->SelectAtLayer(li, *r.plan, q, &sel).ok());
    std::vector<int32_t> b;
    for (const ContextEntry& e : sel.entries) {
      CHECK(e.offsets.empty());
      b.push_back(e.bank_index);
    }
    r.banks.push_back(b);
  }
  return r;
}

using V = std::vector<int32_t>;

}  // namespace

TEST_CASE("mukv: CutVideoBlocks per granularity, leftovers dropped", "[mukv]") {
  StreamInfo s;
  s.init_len = 4;
  s.tokens_per_frame = 4;
  s.num_frames = 3;                // video tokens 4..15
  auto b5 = CutVideoBlocks(s, 5);  // 12 / 5 = 2 blocks, 2 tokens dropped
  REQUIRE(b5.size() == 2);
  CHECK(b5[0].first_token == 4);
  CHECK(b5[0].ready_frame == 1);  // last token offset 4 -> frame 1
  CHECK(b5[1].first_token == 9);
  CHECK(b5[1].ready_frame == 2);  // offset 9 -> frame 2
  auto b4 = CutVideoBlocks(s, 4);
  REQUIRE(b4.size() == 3);
  for (int b = 0; b < 3; ++b) {
    CHECK(b4[b].first_token == 4 + 4 * b);
    CHECK(b4[b].ready_frame == b);
  }
  auto b8 = CutVideoBlocks(s, 8);  // one block, offsets 0..7, ready at frame 1; 4 tokens dropped
  REQUIRE(b8.size() == 1);
  CHECK(b8[0].first_token == 4);
  CHECK(b8[0].ready_frame == 1);
  auto b12 = CutVideoBlocks(s, 12);
  REQUIRE(b12.size() == 1);
  CHECK(b12[0].ready_frame == 2);
  CHECK(CutVideoBlocks(s, 13).empty());
  CHECK(CutVideoBlocks(s, 0).empty());
  // MuKV's 49/196/784 on 4 frames of 196: 16, 4, 1 blocks; block 4 of 49 (offsets 196..244) is frame 1's.
  StreamInfo m;
  m.init_len = 4;
  m.tokens_per_frame = 196;
  m.num_frames = 4;
  CHECK(CutVideoBlocks(m, 49).size() == 16);
  CHECK(CutVideoBlocks(m, 49)[3].ready_frame == 0);
  CHECK(CutVideoBlocks(m, 49)[4].ready_frame == 1);
  CHECK(CutVideoBlocks(m, 196).size() == 4);
  CHECK(CutVideoBlocks(m, 784).size() == 1);
  CHECK(CutVideoBlocks(m, 784)[0].ready_frame == 3);
}

TEST_CASE("mukv: MuKVKeep on a 4-token block (FFT and DIFF)", "[mukv]") {
  // att = [0, 4, 1, 2] -> minmax [0, 1, .25, .5]. Keys (dim 1) = [2, 0, 0, 1].
  // FFT (n = 4: only the DC bin is cut): x - mean = [1.25, -.75, -.75, .25] -> |.| -> minmax [1, .5, .5, 0].
  //   fused (α = .5) = [.5, .75, .375, .25] -> keep int(4 * .5) = 2: {1, 0} -> [0, 1].
  // DIFF: [0, 2, 0, 1] -> minmax [0, 1, 0, .5]; fused = [0, 1, .125, .5] -> {1, 3}.
  const std::vector<float> att{0, 4, 1, 2}, keys{2, 0, 0, 1};
  CHECK(MuKVKeep(att, keys.data(), 4, 1, 0.5, 0.5, true) == V{0, 1});
  CHECK(MuKVKeep(att, keys.data(), 4, 1, 0.5, 0.5, false) == V{1, 3});
  CHECK(MuKVKeep(att, keys.data(), 4, 1, 0.5, 0.75, true) == V{0, 1, 2});  // int(3): + .375
  CHECK(MuKVKeep(att, keys.data(), 4, 1, 0.5, 0.3, true) == V{1});         // int(1.2) = 1
  CHECK(MuKVKeep(att, keys.data(), 4, 1, 1.0, 0.5, true) == V{1, 3});      // attention only
  CHECK(MuKVKeep(att, keys.data(), 4, 1, 0.0, 0.5, true) == V{0, 1});      // FFT only: 1, then .5 tie -> 1
  CHECK(MuKVKeep(att, keys.data(), 4, 1, 0.0, 0.5, false) == V{1, 3});     // diff only: 1, .5
  // dim 2: keys [[2,0],[0,0],[0,0],[1,0]] behave as above (second dim constant: no contribution to diff,
  // and |x_hp| = 0 there halves the FFT signal, which min-max undoes).
  const std::vector<float> keys2{2, 0, 0, 0, 0, 0, 1, 0};
  CHECK(MuKVKeep(att, keys2.data(), 4, 2, 0.5, 0.5, true) == V{0, 1});
  CHECK(MuKVKeep(att, keys2.data(), 4, 2, 0.5, 0.5, false) == V{1, 3});
}

TEST_CASE("mukv: int(g * keep) counts and the default budget 8212", "[mukv]") {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  auto kept = [&](int g, double keep) {
    std::vector<float> att(g), keys(static_cast<size_t>(g) * 4);
    for (float& x : att) x = std::fabs(nd(rng));
    for (float& x : keys) x = nd(rng);
    return MuKVKeep(att, keys.data(), g, 4, 0.5, keep, true).size();
  };
  CHECK(kept(49, 0.1) == 4);     // 4.9
  CHECK(kept(196, 0.1) == 19);   // 19.6
  CHECK(kept(784, 0.8) == 627);  // 627.2
  CHECK(kept(100, 0.29) == 29);  // 28.999999999999996 in double: int() must not drop to 28
  CHECK(kept(10, 0.7) == 7);
  const TraceMeta meta = MakeTinyStreamTrace(BigSpec(2)).trace.meta();
  // 20 * 4 + 32 * 19 + 12 * 627 = 80 + 608 + 7524.
  CHECK(Make()->DefaultBudgetTokens(meta) == 8212);
  CHECK(Make({"variant=PAPER"})->DefaultBudgetTokens(meta) == 8212);
  CHECK(Make()->name() == "mukv");
  const StreamRequirements req = Make()->requirements();
  CHECK(req.granularities == std::vector<int>{49, 196, 784});
  CHECK(req.needs_block_attention);
  CHECK_FALSE(req.oracle);
}

TEST_CASE("mukv: plan on hand-made encodings: bank, kept offsets, CPU bytes", "[mukv]") {
  HandCase c = MakeHandCase();
  Retrieval r = Retrieve(c, {"signal=DIFF"}, 411);
  const StreamPlan& plan = *r.plan;
  REQUIRE(plan.bank.size() == 21);  // 16 + 4 + 1
  REQUIRE(plan.jobs.size() == 21);  // one job per block
  CHECK_FALSE(plan.approximate);    // stored (not derived) encodings
  CHECK_FALSE(plan.context_resident);
  // Bank order: frame 0's g49 blocks 0..3, then its g196 block; ...; g784 last.
  CHECK(plan.bank[3].granularity == 49);
  CHECK(plan.bank[3].first_token == 4 + 3 * 49);
  CHECK(plan.bank[4].granularity == 196);
  CHECK(plan.bank[4].first_token == 4);
  CHECK(plan.bank[11].granularity == 49);
  CHECK(plan.bank[11].index == 9);
  CHECK(plan.bank[11].ready_frame == 2);
  CHECK(plan.bank[14].index == 2);
  CHECK(plan.bank[20].granularity == 784);
  CHECK(plan.bank[20].ready_frame == 3);
  CHECK(plan.bank[20].source == BlockSource::kEncoded);  // OFFICIAL_CODE: context-free encodings
  // DIFF with constant keys: the attention (rising along the block) decides: the last int(g * keep) offsets.
  V last4{45, 46, 47, 48};
  CHECK(plan.bank[0].kept == last4);
  CHECK(plan.bank[4].kept.size() == 19);
  CHECK(plan.bank[4].kept.front() == 177);
  CHECK(plan.bank[20].kept.size() == 627);
  CHECK(plan.bank[20].kept.front() == 157);
  // Jobs: g tokens each; CPU after the last job = 767 kept tokens * 16 B (K,V * L 2 * Hkv 1 * d 2 * 2 B) +
  // 21 representatives (Hkv * d * 2 B = 4 B each) = 12272 + 84. After frame 0's five blocks: 35 tokens, 5
  // reps.
  CHECK(plan.jobs[20].tokens == 784);
  CHECK(plan.jobs[20].cpu_bytes_after == Approx(767 * 16 + 21 * 4));
  CHECK(plan.jobs[4].cpu_bytes_after == Approx((4 * 4 + 19) * 16 + 5 * 4));
  CHECK(plan.jobs[20].gpu_bytes_during == Approx((4 + 784) * 16));  // init + the block being encoded
  CHECK(plan.jobs[20].gpu_bytes_after == Approx(4 * 16));           // only the init prompt stays
  CHECK(plan.initial_gpu_bytes == Approx(4 * 16));
}

TEST_CASE("mukv: stage 1, semi-hierarchical rerank and assembly order (hand-computed)", "[mukv]") {
  HandCase c = MakeHandCase();
  // Budget 411: k = round(k_g * 411 / 8212) -> 20 * .05005 = 1.0, 32 * .05005 = 1.6 -> 2, 12 * .05005 = .6 ->
  // 1 (min 1); candidates 2k = 2, 4, 2. Question 1 (all 4 frames). Query [1, 0]: s = cos θ.
  //   g49 candidates: A (20°) .93969, B (-25°) .90631. g196: f2 (10°) .98481, f0 (50°) .64279,
  //   f1 (-70°) .34202, f3 (80°) .17365. g784: -60°, s = .5.
  //   c = r of the one coarse candidate (-60°). s' = .7 s + .3 cos(θ + 60°):
  //   A .7*.93969 + .3*cos 80° = .70988; B .7*.90631 + .3*cos 35° = .88016 -> B (bank 11) replaces A (bank
  //   0). f2 .68937 + .3*cos 70° = .79197; f1 .23941 + .3*cos(-10°) = .53486; f0 .44995 + .3*cos 110° =
  //   .34735; f3 -.10826 -> f2 (bank 14), f1 (bank 9) instead of f2, f0 (bank 4). g784: λ = 0 -> bank 20.
  // Question 0 (2.5 s: frames 0..2; the g784 block is ready at frame 3): no coarse candidate -> no rerank:
  //   g49 A (bank 0), g196 f2, f0 (banks 14, 4), no g784.
  SECTION("OFFICIAL_CODE: score order (fine, medium, coarse; each by descending score)") {
    Retrieval r = Retrieve(c, {}, 411);
    CHECK(r.banks[1] == V{11, 14, 9, 20});
    CHECK(r.banks[0] == V{0, 14, 4});
    CHECK(r.stats[1].at("rerank_changed_blocks") == 2);
    CHECK(r.stats[1].at("retrieved_tokens") == 4 + 2 * 19 + 627);
    CHECK(r.stats[1].at("retrieved_blocks_g49") == 1);
    CHECK(r.stats[1].at("retrieved_blocks_g196") == 2);
    CHECK(r.stats[1].at("retrieved_blocks_g784") == 1);
    // {11, 14, 9, 20}: every fine block's root (20) retrieved; 11 ⊂ 14, 9 -> 14 adjacent, both ⊂ 20: 1
    // cluster.
    CHECK(r.stats[1].at("hierarchy_coherence") == 1);
    CHECK(r.stats[1].at("temporal_clusters") == 1);
    CHECK(r.stats[0].at("rerank_changed_blocks") == 0);
    CHECK(r.stats[0].at("retrieved_blocks_g784") == 0);  // never a block completed after the question
    CHECK(r.stats[0].at("retrieved_tokens") == 4 + 2 * 19);
    // {0, 14, 4}: roots (20) not retrieved -> 0; 0 ⊂ 4, 14 not adjacent to 4 -> 2 clusters.
    CHECK(r.stats[0].at("hierarchy_coherence") == 0);
    CHECK(r.stats[0].at("temporal_clusters") == 2);
  }
  SECTION("TEMPORAL assembly: by first token, ties coarse first") {
    Retrieval r = Retrieve(c, {"assembly=TEMPORAL"}, 411);
    // first tokens: 20 -> 4, 9 -> 200, 14 -> 396, 11 -> 4 + 9*49 = 445.
    CHECK(r.banks[1] == V{20, 9, 14, 11});
    CHECK(r.banks[0] == V{4, 0, 14});  // banks 0 (g49) and 4 (g196) both start at token 4: coarser first
  }
  SECTION("NO_RERANK: stage-1 order; ANCESTOR equals it here (one shared root)") {
    Retrieval r = Retrieve(c, {"rerank=NO_RERANK"}, 411);
    CHECK(r.banks[1] == V{0, 14, 4, 20});
    CHECK(r.stats[1].at("rerank_changed_blocks") == 0);
    // ANCESTOR: s' = .7 s + .3 * .5 for every fine block (root 20 is a coarse candidate): same order.
    Retrieval a = Retrieve(c, {"rerank=ANCESTOR"}, 411);
    CHECK(a.banks[1] == V{0, 14, 4, 20});
    CHECK(a.banks[0] == V{0, 14, 4});
  }
  SECTION("λ = 0 (the coarse granularity): the rerank changes nothing") {
    // g784 has λ = 0: with two coarse blocks it would keep stage-1 order; here the only rerank effects are in
    // the g49/g196 groups (λ = .3), so the coarse entry is the same with and without the rerank.
    Retrieval semi = Retrieve(c, {}, 411), none = Retrieve(c, {"rerank=NO_RERANK"}, 411);
    CHECK(semi.banks[1].back() == none.banks[1].back());
    // Question 0 has no coarse candidate, so SEMI_HIERARCHICAL falls back to stage-1 scores.
    CHECK(semi.banks[0] == none.banks[0]);
  }
  SECTION("PAPER query: mean question query (-25°)") {
    // s = cos(θ + 25°): g49 B 1, A .70711 -> B; g196 f2 .81915, f1 .70711, f0 .25882, f3 -.25882.
    Retrieval r = Retrieve(c, {"query=MEAN_QUESTION_QUERY", "rerank=NO_RERANK"}, 411);
    CHECK(r.banks[1] == V{11, 14, 9, 20});
  }
  SECTION("budget -> k: proportions kept, at least 1") {
    // 821 / 8212 = .09998: k = 2, 3 (3.2), 1 (1.2). g784 has only one block.
    Retrieval r = Retrieve(c, {}, 821);
    CHECK(r.stats[1].at("retrieved_blocks_g49") == 2);
    CHECK(r.stats[1].at("retrieved_blocks_g196") == 3);
    CHECK(r.stats[1].at("retrieved_blocks_g784") == 1);
    // SCORE_ORDER: g49 B (.88016) then A (.70988); g196 f2, f1, f0.
    CHECK(r.banks[1] == V{11, 0, 14, 9, 4, 20});
    Retrieval one = Retrieve(c, {}, 1);  // every k_g at least 1
    CHECK(one.stats[1].at("retrieved_blocks_g49") == 1);
    CHECK(one.stats[1].at("retrieved_blocks_g196") == 1);
    CHECK(one.stats[1].at("retrieved_blocks_g784") == 1);
    Retrieval all = Retrieve(c, {}, 8212);  // k = 20, 32, 12: everything available
    CHECK(all.stats[1].at("retrieved_blocks_g49") == 16);
    CHECK(all.stats[1].at("retrieved_blocks_g196") == 4);
    CHECK(all.stats[0].at("retrieved_blocks_g49") == 12);
    CHECK(all.stats[0].at("retrieved_blocks_g196") == 3);
    CHECK(all.stats[1].at("retrieved_tokens") == 767);
  }
}

TEST_CASE("mukv: PAPER variant: continuous blocks, temporal assembly", "[mukv]") {
  HandCase c = MakeHandCase();
  Retrieval r = Retrieve(c, {"variant=PAPER"}, 821);
  const StreamPlan& plan = *r.plan;
  REQUIRE(plan.bank.size() == 21);
  for (const BankBlock& b : plan.bank) CHECK(b.source == BlockSource::kStream);  // the continuous run's K/V
  CHECK(plan.bank[20].first_token == 4);
  CHECK(plan.bank[20].kept.size() == 627);
  for (int q = 0; q < 2; ++q) {
    INFO("question " << q);
    const V& e = r.banks[q];
    CHECK(e.size() == static_cast<size_t>(q == 0 ? 2 + 3 : 2 + 3 + 1));  // k = 2, 3, 1; no g784 for q0
    for (size_t i = 1; i < e.size(); ++i) {
      const BankBlock &x = plan.bank[e[i - 1]], &y = plan.bank[e[i]];
      CHECK((x.first_token < y.first_token || (x.first_token == y.first_token && x.granularity > y.granularity)));
    }
  }
}

TEST_CASE("mukv: block encodings without attention_received are refused", "[mukv]") {
  HandCase c = MakeHandCase();
  HandAccess no_att(&c.ts.trace, {{49, std::vector<double>(16, 0.0)}, {196, {0, 0, 0, 0}}, {784, {0}}}, false);
  StreamPlanInput in;
  in.meta = &c.ts.trace.meta();
  in.budget_tokens = 411;
  in.layers = &no_att;
  auto plan = Make()->Plan(in);
  REQUIRE_FALSE(plan.ok());
  CHECK(plan.status().code() == StatusCode::kFailedPrecondition);
  CHECK(plan.status().message().find("granularity 49 lack attention_received at the last layer (1)") !=
        std::string::npos);
}

TEST_CASE("mukv: end to end with derived block encodings (approximate)", "[mukv]") {
  testing::TinyStream ts = MakeTinyStreamTrace(BigSpec(8));
  const TraceMeta& meta = ts.trace.meta();
  REQUIRE(meta.stream->block_encodings.empty());  // every query stored: the engine derives them
  const std::vector<StreamRunSpec> runs{
      {Make(), "code", 411}, {Make({"variant=PAPER"}), "paper", 411}, {Make(), "default", 0}};
  StreamReplayOptions opt;
  opt.threads = 1;
  auto res = ReplayStream(ts.trace, runs, opt);
  INFO((res.ok() ? std::string("ok") : res.status().message()));
  REQUIRE(res.ok());
  // float16, L 2, Hkv 1, d 8: 64 B per token; representatives Hkv * d * 2 = 16 B.
  REQUIRE(KvBytesPerToken(meta) == 64);
  for (const StreamRunResult& r : *res) {
    INFO(r.label());
    CHECK(r.approximate());
    CHECK(r.cpu_bank_tokens_final() == Approx(767));  // 16*4 + 4*19 + 627
    CHECK(r.bank_tokens_per_frame() == Approx(191.75));
    CHECK(r.cpu_bank_bytes_final() == Approx(767 * 64 + 21 * 16));
    CHECK(r.encode_tokens() == Approx(16 * 49 + 4 * 196 + 784));
    CHECK(r.encode_passes_per_video_token() == Approx(3));
    // Question 0 (2.5 s): 12 g49 + 3 g196 blocks encoded: (48 + 57) * 64 + 15 * 16.
    CHECK(r.questions(0).cpu_bank_bytes_at_answer() == Approx(105 * 64 + 15 * 16));
    CHECK(FindStreamStat(r.questions(0).policy_stats(), "retrieved_blocks_g784") == 0);
    CHECK(r.questions(0).frames_covered() <= 3);
  }
  const StreamRunResult& code = (*res)[0];
  CHECK(code.budget_tokens() == 411);
  // k = 1, 2, 1: question 0 gets 4 + 2*19 visual tokens, question 1 4 + 38 + 627.
  CHECK(code.questions(0).visual_tokens_in_context() == Approx(42));
  CHECK(code.questions(1).visual_tokens_in_context() == Approx(669));
  CHECK(FindStreamStat(code.questions(1).policy_stats(), "retrieved_tokens") == 669);
  CHECK((*res)[1].questions(1).visual_tokens_in_context() == Approx(669));
  CHECK((*res)[2].budget_tokens() == 8212);
  // At the default budget everything available is retrieved: 767 tokens for question 1, 105 for question 0.
  CHECK((*res)[2].questions(1).visual_tokens_in_context() == Approx(767));
  CHECK((*res)[2].questions(0).visual_tokens_in_context() == Approx(105));
  CHECK((*res)[2].questions(1).frames_covered() == Approx(4));
}

TEST_CASE("mukv: validation errors are one-line InvalidArgument messages", "[mukv]") {
  Status st = CreateStatus({"over_retrieve=0"});
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(st.message() == "mukv: over_retrieve must be >= 1");
  st = CreateStatus({"rerank_segments=0"});
  CHECK(st.message() == "mukv: rerank_segments must be >= 1");
  st = CreateStatus({"variant=NOPE"});
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(st.message().find('\n') == std::string::npos);
}

// Per-granularity lists via `--set key=[a, b, c]` (or `key=a,b,c`), end to end on the default tiny trace
// (init 4, 6 frames of 4 tokens at 1 fps, questions at 2.5 s and 5 s, L 2, Hkv 1, d 8, every query stored).
TEST_CASE("mukv: small granularities end to end (derived encodings)", "[mukv]") {
  const std::vector<std::string> small{"granularities=[2, 4, 8]", "keep_ratios=0.5,0.5,0.5", "top_k=[2, 1, 1]"};
  auto p = StreamPolicyRegistry::Default().Create("mukv", small);
  INFO((p.ok() ? std::string("ok") : p.status().message()));
  REQUIRE(p.ok());
  CHECK((*p)->requirements().granularities == std::vector<int>{2, 4, 8});
  // 24 video tokens -> 12 + 6 + 3 blocks keeping int(.5 g) = 1, 2, 4 tokens. Default budget 2*1 + 1*2 + 1*4.
  testing::TinyStream ts = MakeTinyStreamTrace();
  CHECK((*p)->DefaultBudgetTokens(ts.trace.meta()) == 8);
  const std::vector<StreamRunSpec> runs{{*p, "small", 0}, {*p, "small16", 16}};
  StreamReplayOptions opt;
  opt.threads = 1;
  auto res = ReplayStream(ts.trace, runs, opt);
  INFO((res.ok() ? std::string("ok") : res.status().message()));
  REQUIRE(res.ok());
  const StreamRunResult& r = (*res)[0];
  CHECK(r.approximate());  // the tiny trace has no /streaming_blocks: derived from the continuous run
  CHECK(r.budget_tokens() == 8);
  CHECK(r.cpu_bank_tokens_final() == Approx(12 + 12 + 12));
  CHECK(r.bank_tokens_per_frame() == Approx(6));
  CHECK(r.encode_passes_per_video_token() == Approx(3));
  // 64 B per token (2 * L 2 * Hkv 1 * d 8 * 2 B), representatives 16 B: 36 * 64 + 21 * 16.
  CHECK(r.cpu_bank_bytes_final() == Approx(2640));
  // Question 0 at 2.5 s: g2 blocks 0..5, g4 frames 0..2, g8 block 0 (ready at frame 1) encoded:
  // (6 + 6 + 4) * 64 + 10 * 16 = 1184.
  CHECK(r.questions(0).cpu_bank_bytes_at_answer() == Approx(1184));
  for (int q = 0; q < 2; ++q) {
    INFO("question " << q);
    // k = 2, 1, 1 at the default budget: 2*1 + 2 + 4 = 8 tokens (enough blocks are available for both).
    CHECK(r.questions(q).visual_tokens_in_context() == Approx(8));
    CHECK(FindStreamStat(r.questions(q).policy_stats(), "retrieved_blocks_g2") == 2);
    CHECK(FindStreamStat(r.questions(q).policy_stats(), "retrieved_blocks_g4") == 1);
    CHECK(FindStreamStat(r.questions(q).policy_stats(), "retrieved_blocks_g8") == 1);
    // GPU while answering: the init prompt (resident) + 8 retrieved + 2 question + 2 answer tokens.
    CHECK(r.questions(q).gpu_bytes_at_answer() == Approx((4 + 8 + 2 + 2) * 64));
  }
  // Budget 16 = 2 x the default: k = 4, 2, 2. Question 1: 4 + 4 + 8 = 16; question 0 has one g8 block: 12.
  const StreamRunResult& r16 = (*res)[1];
  CHECK(r16.questions(1).visual_tokens_in_context() == Approx(16));
  CHECK(r16.questions(0).visual_tokens_in_context() == Approx(12));
  CHECK(FindStreamStat(r16.questions(0).policy_stats(), "retrieved_blocks_g8") == 1);
}

TEST_CASE("mukv: per-granularity validation errors", "[mukv]") {
  // Mismatched lengths (the other lists keep their 3 defaults).
  Status st = CreateStatus({"granularities=[2, 4]"});
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(st.message() == "mukv: keep_ratios, alphas, lambdas and top_k need one value per granularity (2)");
  st = CreateStatus({"granularities=[2, 4, 8]"});  // default keep .1: int(2 * .1) = 0 tokens
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(st.message() == "mukv: keep_ratios: int(g * keep) must be >= 1 for g = 2");
  st = CreateStatus({"granularities=[8, 4, 2]", "keep_ratios=[0.5, 0.5, 0.5]"});
  CHECK(st.message() == "mukv: granularities must be >= 1 and strictly ascending (fine to coarse)");
  st = CreateStatus({"keep_ratios=[0.1, 0.1, 1.5]"});
  CHECK(st.message() == "mukv: keep_ratios must be in (0, 1]");
  st = CreateStatus({"lambdas=[0.3, 0.3, -1]"});
  CHECK(st.message() == "mukv: lambdas must be in [0, 1]");
  st = CreateStatus({"granularities=2,x"});
  CHECK(st.code() == StatusCode::kInvalidArgument);
  for (const std::string& m : {st.message(), CreateStatus({"granularities=[2, 4]"}).message()})
    CHECK(m.find('\n') == std::string::npos);
}

}  // namespace kvsim
