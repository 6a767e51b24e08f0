#include "policies/stream_pieces.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "sim/select.h"

namespace kvsim {

void MinMaxNormalize(std::span<float> x) {
  if (x.empty()) return;
  const auto [lo, hi] = std::minmax_element(x.begin(), x.end());
  const float mn = *lo, range = *hi - *lo;
  for (float& v : x) v = range > 0 ? (v - mn) / range : 0.0f;
}

std::vector<float> FrequencySignalFFT(const float* keys, int n, int dim) {
  std::vector<float> f(n, 0.0f);
  if (n <= 0) return f;
  const int bins = n / 2 + 1, cut = bins / 2;
  // High-passed signal x_hp(t) = (1/n) Σ_{k in kept bins} w_k Re(X_k e^{2πi k t / n}), w_k = 1 for the DC
  // and Nyquist bins, 2 otherwise (irfft of a one-sided spectrum). Computed in double for exactness.
  std::vector<double> xhp(static_cast<size_t>(n) * dim, 0.0);
  std::vector<double> re(dim), im(dim);
  for (int k = cut; k < bins; ++k) {
    std::fill(re.begin(), re.end(), 0.0);
    std::fill(im.begin(), im.end(), 0.0);
    for (int t = 0; t < n; ++t) {
      const double a = -2.0 * M_PI * static_cast<double>(k) * t / n;
      const double c = std::cos(a), s = std::sin(a);
      const float* row = keys + static_cast<size_t>(t) * dim;
      for (int j = 0; j < dim; ++j) {
        re[j] += row[j] * c;
        im[j] += row[j] * s;
      }
    }
    const double w = (k == 0 || (n % 2 == 0 && k == n / 2)) ? 1.0 : 2.0;
    for (int t = 0; t < n; ++t) {
      const double a = 2.0 * M_PI * static_cast<double>(k) * t / n;
      const double c = std::cos(a), s = std::sin(a);
      double* out = xhp.data() + static_cast<size_t>(t) * dim;
      for (int j = 0; j < dim; ++j) out[j] += w * (re[j] * c - im[j] * s) / n;
    }
  }
  for (int t = 0; t < n; ++t) {
    double acc = 0;
    for (int j = 0; j < dim; ++j) acc += std::fabs(xhp[static_cast<size_t>(t) * dim + j]);
    f[t] = static_cast<float>(acc / dim);
  }
  return f;
}

std::vector<float> FrequencySignalDiff(const float* keys, int n, int dim) {
  std::vector<float> f(n, 0.0f);
  for (int t = 1; t < n; ++t) {
    double acc = 0;
    for (int j = 0; j < dim; ++j) {
      const double d = keys[static_cast<size_t>(t) * dim + j] - keys[static_cast<size_t>(t - 1) * dim + j];
      acc += d * d;
    }
    f[t] = static_cast<float>(std::sqrt(acc));
  }
  return f;
}

std::vector<float> FuseSignals(std::span<const float> att, std::span<const float> freq, double alpha) {
  std::vector<float> a(att.begin(), att.end()), f(freq.begin(), freq.end());
  MinMaxNormalize(a);
  MinMaxNormalize(f);
  std::vector<float> out(a.size());
  for (size_t i = 0; i < a.size(); ++i)
    out[i] = static_cast<float>(alpha * a[i] + (1.0 - alpha) * (i < f.size() ? f[i] : 0.0f));
  return out;
}

std::vector<int32_t> TopKByScore(std::span<const float> scores, int k) {
  std::vector<int32_t> idx(scores.size());
  std::iota(idx.begin(), idx.end(), 0);
  k = std::clamp(k, 0, static_cast<int>(idx.size()));
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
    return scores[a] != scores[b] ? scores[a] > scores[b] : a < b;
  });
  idx.resize(k);
  return idx;
}

std::vector<int32_t> TopKSorted(std::span<const float> scores, int k) { return TopKIndices(scores, k); }

std::vector<float> MeanRows(const float* x, int dim, std::span<const int32_t> rows) {
  std::vector<double> acc(dim, 0.0);
  for (int32_t r : rows)
    for (int j = 0; j < dim; ++j) acc[j] += x[static_cast<size_t>(r) * dim + j];
  std::vector<float> out(dim, 0.0f);
  if (!rows.empty())
    for (int j = 0; j < dim; ++j) out[j] = static_cast<float>(acc[j] / rows.size());
  return out;
}

double DotProduct(std::span<const float> a, std::span<const float> b) {
  double s = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

double Cosine(std::span<const float> a, std::span<const float> b) {
  const double na = std::sqrt(DotProduct(a, a)), nb = std::sqrt(DotProduct(b, b));
  return na > 0 && nb > 0 ? DotProduct(a, b) / (na * nb) : 0.0;
}

double RerankScore(double s, std::span<const float> r, std::span<const float> c, double lambda) {
  return (1.0 - lambda) * s + lambda * Cosine(r, c);
}

}  // namespace kvsim
