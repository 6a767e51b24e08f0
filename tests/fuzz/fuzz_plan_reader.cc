// libFuzzer target: bytes -> gpu_replay's plan reader (ParsePlan: binary Protobuf + ValidatePlan), then what
// kvsim_replay_gpu and the host harness do with a valid plan: replay every head's deltas and the cache
// lengths at every step. Errors are fine; crashes, hangs, leaks and unbounded memory are not.

#include <cstddef>
#include <cstdint>
#include <string>

#include "gpu_replay/plan.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvsim::gpu_replay;
  auto plan = ParsePlan(std::string(reinterpret_cast<const char*>(data), size), "fuzz.pb");
  if (!plan.ok()) return 0;
  for (const HeadPlan& head : plan->heads()) {
    HeadState state = InitialState(head);
    for (const StepDelta& step : head.steps()) {
      ApplyDelta(step.before_attention(), &state);
      ApplyDelta(step.after_step(), &state);
    }
  }
  // After prefill, the first step (what kvsim_replay_gpu sizes its buffers by) and the last.
  for (int step : {-1, 0, plan->num_decode_steps() - 1}) (void)LengthsAtStep(*plan, step);
  (void)PlanSummary(*plan);
  return 0;
}
