// Every registered streaming policy through the same invariants (docs/streaming.md): it runs on a streaming
// trace at its default budget and at small budgets, uses only frames that arrived before each question (the
// engine enforces it and fails the run otherwise), reports metrics in range, and gives identical bytes at
// any thread count.
#include <catch2/catch.hpp>
#include <cmath>

#include "policies/stream_registry.h"
#include "sim/stream_replay.h"
#include "tests/sim/stream_test_util.h"

namespace kvsim {
namespace {

std::vector<std::string> SetsFor(const std::string& name) {
  // The tiny trace has 16-token frames: MuKV's blocks become 4 / 16 / 64 tokens.
  if (name == "mukv") return {"granularities=4,16,64", "keep_ratios=0.5,0.25,0.8", "top_k=4,3,1"};
  return {};
}

TEST_CASE("every streaming policy satisfies the streaming contract", "[stream_contract]") {
  testing::TinyStreamSpec spec;
  spec.num_heads = 4;
  spec.num_kv_heads = 2;
  spec.tokens_per_frame = 16;
  spec.num_frames = 12;
  spec.question_times = {3.5, 7.0, 11.0};
  spec.evidence = {{1}, {4, 5}, {2}};
  auto ts = testing::MakeTinyStreamTrace(spec);
  REQUIRE(ts.trace.meta().Validate().ok());
  const auto infos = StreamPolicyRegistry::Default().List();
  REQUIRE(infos.size() >= 6);
  for (const StreamPolicyInfo& info : infos) {
    for (int budget : {0, 16, 48}) {
      DYNAMIC_SECTION(info.name << " budget " << budget) {
        auto p = StreamPolicyRegistry::Default().Create(info.name, SetsFor(info.name));
        INFO(p.status().message());
        REQUIRE(p.ok());
        std::vector<StreamRunSpec> runs{{*p, info.name, budget}};
        REQUIRE(CheckStreamRuns(ts.trace.meta(), runs).ok());
        StreamReplayOptions o1, o2;
        o1.threads = 1;
        o2.threads = 2;
        auto a = ReplayStream(ts.trace, runs, o1);
        INFO(a.status().message());
        REQUIRE(a.ok());
        auto b = ReplayStream(ts.trace, runs, o2);
        REQUIRE(b.ok());
        CHECK((*a)[0].SerializeAsString() == (*b)[0].SerializeAsString());
        const StreamRunResult& r = (*a)[0];
        CHECK(r.budget_tokens() == (budget > 0 ? budget : (*p)->DefaultBudgetTokens(ts.trace.meta())));
        REQUIRE(r.questions_size() == 3);
        for (const StreamQuestionResult& q : r.questions()) {
          CHECK(q.retained_mass_mean() >= 0);
          CHECK(q.retained_mass_mean() <= 1 + 1e-6);
          CHECK(std::isfinite(q.output_rel_error_mean()));
          CHECK(q.output_rel_error_mean() >= 0);
          CHECK(q.frames_covered() <= q.frames_before());
          CHECK(q.evidence_frame_recall() >= 0);
          CHECK(q.evidence_frame_recall() <= 1);
          CHECK(q.oracle_frame_recall() >= 0);
          CHECK(q.oracle_frame_recall() <= 1 + 1e-12);
          CHECK(q.samples() == spec.num_layers * spec.num_heads * spec.answer_tokens);
          CHECK(q.gpu_bytes_at_answer() > 0);
          if (info.name != "mukv" && info.uses_budget)  // frame policies: floor(B / P) frames, at least 1
            CHECK(q.visual_tokens_in_context() <= std::max(r.budget_tokens(), spec.tokens_per_frame));
        }
        CHECK(r.memory_size() >= 2);
        for (int i = 1; i < r.memory_size(); ++i) CHECK(r.memory(i).time_s() >= r.memory(i - 1).time_s());
        CHECK(r.cpu_bank_bytes_final() >= 0);
        CHECK(r.encode_passes_per_video_token() > 0);
      }
    }
  }
}

}  // namespace
}  // namespace kvsim
