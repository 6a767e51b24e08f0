#pragma once
// Streaming baselines (docs/streaming.md): stream_full (every frame before the question), stream_recent
// (the last frames), stream_uniform (frames sampled uniformly), stream_oracle (the frames the question's
// full-history attention prefers, in hindsight). Blocks are frames of the continuous run.

#include "sim/stream_policy.h"

namespace kvsim {

// Frames k = floor(budget / P): 0 when the budget is below one frame (the budget is a cap; never exceeded).
int FramesForBudget(const TraceMeta& meta, int budget_tokens);

// Memory tiers of a frame bank built by continuous encoding (one job per frame, P tokens each).
enum class FrameBankTiers {
  kAllOnGpu,     // nothing offloaded: the whole history stays on the GPU (stream_full)
  kWindowOnGpu,  // the last `window_frames` stay on the GPU, older frames are dropped (stream_recent)
  kOffloaded,    // every frame offloaded to the CPU bank; `local_window_tokens` stay on the GPU (ReKV)
};

struct FrameBankOptions {
  FrameBankTiers tiers = FrameBankTiers::kOffloaded;
  int window_frames = 0;
  int64_t local_window_tokens = 0;
  double representative_bytes_per_frame = 0;
};

// A plan whose bank holds every frame (block i = frame i, kStream source, all P tokens kept).
void BuildFrameBank(const TraceMeta& meta, const FrameBankOptions& opt, StreamPlan* plan);

// Entries for the given frames (bank index = frame), in the given order.
void SelectFrames(std::span<const int32_t> frames, ContextSelection* out);

}  // namespace kvsim
