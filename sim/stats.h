#pragma once
// The one mean and quantile every report uses (results' p5/p95, streaming per-question metrics, kvsim
// inspect's quartiles, gpu_replay timing summaries). Quantile q of n values is the nearest-rank element: the
// value at index round(q * (n - 1)) of the sorted values (docs/metrics.md). Empty input: 0.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

namespace kvsim {

// Index of quantile q in n sorted values. REQUIRES: n > 0, 0 <= q <= 1.
inline size_t QuantileIndex(size_t n, double q) {
  return std::min(n - 1, static_cast<size_t>(std::floor(q * static_cast<double>(n - 1) + 0.5)));
}

template <class T>
double Mean(std::span<const T> v) {
  double s = 0;
  for (const T& x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}
template <class T>
double Mean(const std::vector<T>& v) {
  return Mean(std::span<const T>(v));
}

// Quantile of values already sorted ascending.
template <class T>
double SortedQuantile(std::span<const T> sorted, double q) {
  return sorted.empty() ? 0 : sorted[QuantileIndex(sorted.size(), q)];
}
template <class T>
double SortedQuantile(const std::vector<T>& sorted, double q) {
  return SortedQuantile(std::span<const T>(sorted), q);
}

// Quantile of unsorted values (partially sorts its copy).
template <class T>
double Quantile(std::vector<T> v, double q) {
  if (v.empty()) return 0;
  const size_t k = QuantileIndex(v.size(), q);
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

}  // namespace kvsim
