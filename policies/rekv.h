#pragma once
// ReKV (Di et al., ICLR 2025) as its official code runs it (docs/policies/rekv.md).

#include <span>
#include <vector>

#include "sim/stream_policy.h"

namespace kvsim {

// ReKV's per-layer frame scores: for every frame f < num_frames,
//   score_f = Σ_h sim(q̄_h, r_{f, kv(h)}),
// q̄_h = mean pre-RoPE query of the question tokens (query head h), r = mean pre-RoPE key of the frame's
// tokens (its KV head); sim = dot product (code) or cosine. Pre-RoPE vectors are recovered by rotating the
// stored post-RoPE ones back by their positions (no-op when rope_theta is 0).
std::vector<float> ReKVFrameScores(const TraceMeta& meta, const LayerData& layer, int question,
                                   int num_frames, bool cosine);

// The k best frames by score (ties: earlier frame), in temporal order.
std::vector<int32_t> ReKVSelect(std::span<const float> scores, int k);

}  // namespace kvsim
