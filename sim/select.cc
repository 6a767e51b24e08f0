#include "sim/select.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>

#include "sim/status.h"

namespace kvsim {

std::vector<int32_t> TopKIndices(std::span<const float> scores, int k) {
  const int n = static_cast<int>(scores.size());
  k = std::clamp(k, 0, n);
  std::vector<int32_t> idx;
  idx.reserve(k);
  if (k == 0) return idx;
  if (k == n) {
    for (int32_t j = 0; j < n; ++j) idx.push_back(j);
    return idx;
  }
  // Threshold = the k-th largest score (a selection on plain floats, O(n)); then one in-order scan takes
  // every score above it and the lowest-indexed ties, which is already ascending.
  std::vector<float> v(scores.begin(), scores.end());
  std::nth_element(v.begin(), v.begin() + (k - 1), v.end(), std::greater<float>());
  return TopKIndicesWithThreshold(scores, k, v[k - 1]);
}

std::vector<int32_t> TopKIndicesWithThreshold(std::span<const float> scores, int k, float tau) {
  const int n = static_cast<int>(scores.size());
  k = std::clamp(k, 0, n);
  std::vector<int32_t> idx;
  idx.reserve(k);
  int above = 0;
  for (float s : scores) above += s > tau;
  int ties = k - above;
  for (int32_t j = 0; j < n; ++j) {
    if (scores[j] > tau) {
      idx.push_back(j);
    } else if (scores[j] == tau && ties > 0) {
      idx.push_back(j);
      --ties;
    }
  }
  return idx;
}

void SortDescendingNonNegative(std::span<const float> values, std::vector<float>* out) {
  // Non-negative IEEE floats order like their bit patterns; sort ~bits ascending = values descending.
  // LSD radix sort, 3 passes of 11 bits; the three digits' histograms are counted in one pass, and the
  // keys' buffers are per thread (the engine calls this once per attention row).
  const size_t n = values.size();
  thread_local std::vector<uint32_t> a, b;
  a.resize(n);
  b.resize(n);
  constexpr int kBits = 11, kBuckets = 1 << kBits, kPasses = 3;
  size_t count[kPasses][kBuckets + 1] = {};
  for (size_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &values[i], 4);
    KVSIM_CHECK((u >> 31) == 0 || u == 0x80000000u);
    const uint32_t key = ~(u & 0x7fffffffu);
    a[i] = key;
    for (int p = 0; p < kPasses; ++p) ++count[p][((key >> (p * kBits)) & (kBuckets - 1)) + 1];
  }
  for (int p = 0; p < kPasses; ++p) {
    size_t* c = count[p];
    if (c[((a.empty() ? 0 : a[0]) >> (p * kBits) & (kBuckets - 1)) + 1] == n) continue;  // one bucket
    for (int k = 0; k < kBuckets; ++k) c[k + 1] += c[k];
    const int shift = p * kBits;
    for (size_t i = 0; i < n; ++i) b[c[(a[i] >> shift) & (kBuckets - 1)]++] = a[i];
    a.swap(b);
  }
  out->resize(n);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t u = ~a[i];
    std::memcpy(&(*out)[i], &u, 4);
  }
}

}  // namespace kvsim
