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

// What the descending prefix sums of non-negative `values` need, without sorting every value. The sums in
// question are S[k] = (((0 + x_1) + x_2) + ... + x_k) in double, x_1 >= x_2 >= ... the values sorted
// descending (the regret's "mass of the k best tokens"). Outputs:
// - `head`: the min(kmax, n) largest values, descending, so S[k] for k <= kmax is the running sum of head;
// - `exact_sum` and `tail`: S[n] = (((exact_sum + t_1) + t_2) + ...), tail = t_1 >= t_2 >= ... ; when
//   kmax >= n, head holds every value and S[n] is its running sum (exact_sum 0, tail empty).
// Why S[n] needs only the small values sorted: every value >= 2^L, with L = E - 30 and 2^E above the sum
// of all values, is a multiple of 2^(L-23) (or of 2^-149, the smallest subnormal), and so is any sum of
// such values; those sums are below 2^E = 2^(L-23+53), so each is a double and every addition among them
// is exact, in any order. They come first in descending order, so S[|big|] is their exact sum
// (`exact_sum`, added here in any order), and only the nonzero values below 2^L (`tail`; zeros add
// nothing) need their descending order. Both results are bit-identical to a full sort followed by the
// sequential sums (tests/sim/select_test.cc). Sorts only those and the kmax largest: O(n) passes plus a
// radix sort of (kmax + |tail|) keys instead of n. Values must be non-negative and finite.
void SortForDescendingSums(std::span<const float> values, int kmax, std::vector<float>* head,
                           double* exact_sum, std::vector<float>* tail);

}  // namespace kvsim
