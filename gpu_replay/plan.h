#pragma once
// GPU replay plans (gpu_replay/plan.proto): the simulator decides, the GPU replays. PlanRecorder is a
// DecisionRecorder (sim/replay.h) that turns one replay's cache decisions into a GpuPlan per run: the
// per-(layer, KV head) slots after prefill (merged keys/values included) and the per-step deltas of decode.
// Recording is deterministic at any thread count: every (run, layer, KV head) unit writes only its own
// preallocated HeadPlan.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "gpu_replay/plan.pb.h"
#include "sim/replay.h"

namespace kvsim::gpu_replay {

inline constexpr int kPlanFormatVersion = 1;

class PlanRecorder final : public DecisionRecorder {
 public:
  void Begin(const TraceMeta& meta, std::span<const RunSpec> runs, std::span<const int> compress_end,
             std::span<const std::vector<int>> head_budgets) override;
  void AfterPrefill(int run, int layer, int kv_head, const HeadCache& cache) override;
  void BeforeAttention(int run, int layer, int kv_head, int step, const HeadCache& cache) override;
  void AfterStep(int run, int layer, int kv_head, int step, const HeadCache& cache) override;

  int num_runs() const { return static_cast<int>(plans_.size()); }
  // The plan of run `run`, with the run's result metadata (label, budget, trace) copied in. Moves it out.
  GpuPlan TakePlan(int run, const RunResult& result);

 private:
  struct UnitState {
    std::vector<int32_t> sorted;         // anchors, ascending
    std::vector<PlanMergedSlot> merges;  // by anchor, ascending
    uint64_t version = ~uint64_t{0};
    int size = 0;
  };
  // Records the change from the unit's last state to `cache` into `delta` (null: only update the state).
  void Diff(UnitState& st, const HeadCache& cache, CacheDelta* delta, int* added_count) const;
  HeadPlan& Head(int run, int layer, int kv_head) {
    return *plans_[run].mutable_heads(layer * num_kv_heads_ + kv_head);
  }
  UnitState& State(int run, int layer, int kv_head) {
    return state_[run][static_cast<size_t>(layer) * num_kv_heads_ + kv_head];
  }

  int num_kv_heads_ = 0;
  std::vector<int> compression_step_;
  std::vector<GpuPlan> plans_;
  std::vector<std::vector<UnitState>> state_;
};

// Checks a plan's internal consistency (model shape, one HeadPlan per (layer, KV head) in order, steps,
// deltas that apply: removed anchors present, added anchors absent, merges on present anchors, key/value
// sizes). `what` names the file for messages: "plan.pb: heads[3].steps[2].before_attention: ...".
Status ValidatePlan(const GpuPlan& plan, const std::string& what);

// Binary Protobuf, written to a temporary name and renamed into place.
Status WritePlan(const GpuPlan& plan, const std::string& path);
// Reads and validates; errors name the file and the field.
StatusOr<GpuPlan> ReadPlan(const std::string& path);
// The same from the file's bytes (`what` names the file in messages).
StatusOr<GpuPlan> ParsePlan(const std::string& bytes, const std::string& what);

// The cache of one head as a slot list, replaying the plan's deltas (removed slots leave, the rest keep
// their order, added anchors go at the end).
struct HeadState {
  std::vector<int32_t> anchors;        // slot order
  std::vector<PlanMergedSlot> merges;  // merged slots, by anchor ascending
};
HeadState InitialState(const HeadPlan& head);
void ApplyDelta(const CacheDelta& delta, HeadState* state);

// Per-(layer, KV head) cache lengths ([layer * num_kv_heads + kv_head]) when decode step `step` attends
// (step = -1: after the prefill event).
std::vector<int32_t> LengthsAtStep(const GpuPlan& plan, int step);

// Runs `policy` at one budget over the trace with a PlanRecorder: the plan and the run's result.
struct PlanRequest {
  std::string trace_path;
  std::string policy;
  std::vector<std::string> sets;
  double budget_fraction = 0;
  int budget_tokens = 0;
  QuestionMode question_mode = QuestionMode::kQueryAware;
  int threads = 0;
  bool progress = false;         // progress on stderr (sim/progress.h)
  Progress* reporter = nullptr;  // or this reporter (several plans under one progress line)
  std::string label;             // display name; default: policy (+ overrides)
};
StatusOr<GpuPlan> BuildPlan(const PlanRequest& request, RunResult* result = nullptr);
// Same over an open trace (tests): one run.
StatusOr<GpuPlan> BuildPlanFromSource(TraceSource& trace, const RunSpec& run, int threads,
                                      RunResult* result = nullptr);

// One-line summary: heads, mean/max slots, merged slots, decode deltas.
std::string PlanSummary(const GpuPlan& plan);

}  // namespace kvsim::gpu_replay
