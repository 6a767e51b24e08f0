#include "policies/stream_pieces.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>

#include "sim/attention.h"
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
  if (n <= 0 || dim <= 0) return f;
  EnsureSingleThreadedBlas();
  const int bins = n / 2 + 1, cut = bins / 2, nk = bins - cut;
  // High-passed signal x_hp(t) = (1/n) Σ_{k in kept bins} w_k Re(X_k e^{2πi k t / n}), w_k = 1 for the DC
  // and Nyquist bins, 2 otherwise (irfft of a one-sided spectrum), X_k = Σ_t x_t e^{-2πi k t / n}: a direct
  // transform of the kept half of the bins, in double, as two matrix products with T = [C; S], the kept
  // bins' twiddles C[k][t] = cos θ_kt and S[k][t] = -sin θ_kt, θ_kt = 2π (k t mod n) / n (the exact integer
  // reduction keeps every angle below 2π):
  //   [Re X; Im X] = T x,   x_hp = (1/n) Tᵀ [w Re X; w Im X]   (Re(X e^{iθ}) = Re X cos θ - Im X sin θ).
  // T depends on n alone; it is built once per thread for each block size in a row.
  thread_local int table_n = -1;
  thread_local std::vector<double> twiddles, x, y, hp;
  const size_t rows = static_cast<size_t>(2) * nk;
  if (table_n != n) {
    twiddles.resize(rows * n);
    for (int kk = 0; kk < nk; ++kk) {
      const int64_t k = cut + kk;
      for (int t = 0; t < n; ++t) {
        const double a = 2.0 * M_PI * static_cast<double>(k * t % n) / n;
        twiddles[kk * static_cast<size_t>(n) + t] = std::cos(a);
        twiddles[(nk + kk) * static_cast<size_t>(n) + t] = -std::sin(a);
      }
    }
    table_n = n;
  }
  x.assign(keys, keys + static_cast<size_t>(n) * dim);
  y.resize(rows * dim);
  hp.resize(static_cast<size_t>(n) * dim);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows), dim, n, 1.0, twiddles.data(),
              n, x.data(), dim, 0.0, y.data(), dim);
  for (int kk = 0; kk < nk; ++kk) {
    const int k = cut + kk;
    if (k == 0 || (n % 2 == 0 && k == n / 2)) continue;  // w_k = 1
    for (size_t r : {static_cast<size_t>(kk), static_cast<size_t>(nk + kk)})
      for (int j = 0; j < dim; ++j) y[r * dim + j] *= 2.0;
  }
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, dim, static_cast<int>(rows), 1.0, twiddles.data(),
              n, y.data(), dim, 0.0, hp.data(), dim);
  for (int t = 0; t < n; ++t) {
    double acc = 0;
    for (int j = 0; j < dim; ++j) acc += std::fabs(hp[static_cast<size_t>(t) * dim + j]);
    f[t] = static_cast<float>(acc / n / dim);
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
