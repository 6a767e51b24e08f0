#pragma once
// MuKV (CVPR 2026): multi-granularity video memory with dual-signal compression and semi-hierarchical
// retrieval (docs/policies/mukv.md).

#include <span>
#include <vector>

#include "sim/stream_policy.h"

namespace kvsim {

// Kept offsets of one block: keep int(g * keep_ratio) tokens with the highest
//   alpha * minmax(att) + (1 - alpha) * minmax(freq), ascending.
// att[j] = Σ_i mean_h A_h[i, j] over the block's own queries; keys [g][dim] averaged over KV heads.
std::vector<int32_t> MuKVKeep(std::span<const float> att, const float* keys, int g, int dim, double alpha,
                              double keep_ratio, bool fft);

// One granularity's retrieval candidates after stage 1 and the rerank.
struct MuKVCandidate {
  int32_t bank_index = 0;
  double score = 0;     // s = cos(q, r)
  double reranked = 0;  // s'
};

}  // namespace kvsim
