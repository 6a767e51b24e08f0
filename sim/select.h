#pragma once
// Deterministic selection helpers shared by the engine and policies.

#include <cstdint>
#include <span>
#include <vector>

namespace kvsim {

// Indices of the k largest scores, returned ascending. Ties go to the lower index, so results never depend
// on sort stability or thread count. k is clamped to [0, scores.size()].
std::vector<int32_t> TopKIndices(std::span<const float> scores, int k);

// TopKIndices when the k-th largest score `kth` is already known (e.g. from a sorted copy).
std::vector<int32_t> TopKIndicesWithThreshold(std::span<const float> scores, int k, float kth);

// Sorts non-negative values in descending order into `out` (radix sort, O(n)); `out` is resized.
void SortDescendingNonNegative(std::span<const float> values, std::vector<float>* out);

}  // namespace kvsim
