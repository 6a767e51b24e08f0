#pragma once
// The one mean and quantile every report uses (results' p5/p95, streaming per-question metrics, kvsim
// inspect's quartiles, gpu_replay timing summaries). Quantile q of n values is the nearest-rank element: the
// value at index round(q * (n - 1)) of the sorted values (docs/metrics.md). Empty input: 0.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
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

// Sample standard deviation (divides by n - 1); 0 for fewer than 2 values.
template <class T>
double StdDev(std::span<const T> v) {
  if (v.size() < 2) return 0;
  const double m = Mean(v);
  double s = 0;
  for (const T& x : v) s += (x - m) * (x - m);
  return std::sqrt(s / static_cast<double>(v.size() - 1));
}

// Percentile bootstrap confidence interval of the mean (docs/metrics.md "Aggregates across samples"): draw
// `resamples` resamples of n values with replacement (index = mt19937_64(seed)() % n, n draws per resample,
// in order), take each resample's mean, and return the nearest-rank quantiles (1 - level) / 2 and (1 + level)
// / 2 of those means. Deterministic for a given seed; independent of threads. Empty input: {0, 0}.
struct Interval {
  double low = 0, high = 0;
};
template <class T>
Interval BootstrapMeanCi(std::span<const T> v, int resamples, uint64_t seed, double level = 0.95) {
  if (v.empty() || resamples < 1) return {};
  std::mt19937_64 rng(seed);
  std::vector<double> means(static_cast<size_t>(resamples));
  for (double& m : means) {
    double s = 0;
    for (size_t i = 0; i < v.size(); ++i) s += v[rng() % v.size()];
    m = s / static_cast<double>(v.size());
  }
  std::sort(means.begin(), means.end());
  return {SortedQuantile(std::span<const double>(means), (1 - level) / 2),
          SortedQuantile(std::span<const double>(means), (1 + level) / 2)};
}

}  // namespace kvsim
