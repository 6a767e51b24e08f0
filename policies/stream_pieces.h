#pragma once
// Reusable math of the streaming policies (docs/policies/mukv.md, rekv.md): block signals, min-max fusion,
// representative vectors, similarity retrieval and the semi-hierarchical rerank. Pure functions, so the
// paper's equations can be checked on hand-computed cases (tests/policies/stream_pieces_test.cc).

#include <cstdint>
#include <span>
#include <vector>

namespace kvsim {

// Scales x to [0, 1] in place: (x - min) / (max - min); all zeros when max == min.
void MinMaxNormalize(std::span<float> x);

// MuKV's frequency signal on a block's key sequence keys [n][dim] (KV heads already averaged):
// rfft along tokens (F = n/2 + 1 bins), bins k < floor(F/2) zeroed, irfft, f_t = mean_dims |x_hp(t)|.
std::vector<float> FrequencySignalFFT(const float* keys, int n, int dim);
// The `diff` variant: f_t = ||K_t - K_{t-1}||_2, f_0 = 0.
std::vector<float> FrequencySignalDiff(const float* keys, int n, int dim);

// I = alpha * minmax(att) + (1 - alpha) * minmax(freq).
std::vector<float> FuseSignals(std::span<const float> att, std::span<const float> freq, double alpha);

// Indices of the k largest scores (ties: lower index first), returned in descending score order.
std::vector<int32_t> TopKByScore(std::span<const float> scores, int k);
// The same set, ascending by index (kept tokens keep their order in the block); = TopKIndices (sim/select.h).
std::vector<int32_t> TopKSorted(std::span<const float> scores, int k);

// Mean of the given rows of a [rows][dim] matrix.
std::vector<float> MeanRows(const float* x, int dim, std::span<const int32_t> rows);

double Cosine(std::span<const float> a, std::span<const float> b);
double DotProduct(std::span<const float> a, std::span<const float> b);

// MuKV's stage-2 rerank: s'_j = (1 - lambda) s_j + lambda cos(r_j, c).
double RerankScore(double s, std::span<const float> r, std::span<const float> c, double lambda);

}  // namespace kvsim
