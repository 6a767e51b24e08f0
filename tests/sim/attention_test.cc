#include "sim/attention.h"

#include <algorithm>
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

namespace kvsim {
namespace {

const float kLn2 = std::log(2.0f), kLn3 = std::log(3.0f), kLn4 = std::log(4.0f);

ModelInfo Model(int head_dim, double scale, int sliding_window = 0, double softcap = 0) {
  ModelInfo m;
  m.num_layers = 1;
  m.num_heads = 1;
  m.num_kv_heads = 1;
  m.head_dim = head_dim;
  m.softmax_scale = scale;
  m.sliding_window = sliding_window;
  m.logit_softcap = softcap;
  return m;
}

// Naive reference for AccumulateColumnSums: one query at a time, double precision, explicit visibility.
std::vector<double> NaiveColumnSums(const ModelInfo& m, const std::vector<float>& q,
                                    const std::vector<int32_t>& pos, const std::vector<float>& k,
                                    int key_limit) {
  const int d = m.head_dim;
  std::vector<double> out(key_limit, 0.0);
  for (size_t i = 0; i < pos.size(); ++i) {
    const int p = pos[i];
    int first = 0;
    if (m.sliding_window > 0) first = std::max(0, p - m.sliding_window + 1);
    const int last = std::min(p, key_limit - 1);
    if (last < first) continue;
    std::vector<double> logit(last - first + 1);
    double mx = -1e300;
    for (int j = first; j <= last; ++j) {
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += static_cast<double>(q[i * d + c]) * k[j * d + c];
      double z = dot * m.softmax_scale;
      if (m.logit_softcap > 0) z = m.logit_softcap * std::tanh(z / m.logit_softcap);
      logit[j - first] = z;
      mx = std::max(mx, z);
    }
    double sum = 0;
    for (double& z : logit) sum += (z = std::exp(z - mx));
    for (int j = first; j <= last; ++j) out[j] += logit[j - first] / sum;
  }
  return out;
}

}  // namespace

TEST_CASE("LogitTransform: scale, then soft-cap", "[attention]") {
  // No cap: z = scale * dot.
  CHECK(LogitTransform(0.5f, 0.0f)(4.0f) == Approx(2.0f));
  CHECK(LogitTransform(0.5f, 0.0f)(-3.0f) == Approx(-1.5f));
  // Cap c = 1: z = 1 * tanh(0.5 * 4 / 1) = tanh(2) = 0.9640275800758169.
  CHECK(LogitTransform(0.5f, 1.0f)(4.0f) == Approx(0.9640275800758169).epsilon(1e-6));
  // Cap c = 2, scale 1: z = 2 tanh(2 / 2) = 2 tanh(1) = 1.5231883119115295; odd in dot.
  CHECK(LogitTransform(1.0f, 2.0f)(2.0f) == Approx(1.5231883119115295).epsilon(1e-6));
  CHECK(LogitTransform(1.0f, 2.0f)(-2.0f) == Approx(-1.5231883119115295).epsilon(1e-6));
  // Large logits saturate at the cap: 30 tanh(1000 / 30) ~= 30.
  CHECK(LogitTransform(1.0f, 30.0f)(1000.0f) == Approx(30.0f).epsilon(1e-6));
  // From ModelInfo.
  const LogitTransform tf(Model(4, 0.25, 0, 50.0));
  CHECK(tf.scale == 0.25f);
  CHECK(tf.softcap == 50.0f);
}

TEST_CASE("SoftmaxInPlace on [0, ln2, ln3] gives [1/6, 2/6, 3/6] and log-sum-exp ln 6", "[attention]") {
  float x[3] = {0.0f, kLn2, kLn3};
  const float lse = SoftmaxInPlace(x, 3);
  CHECK(x[0] == Approx(1.0 / 6).margin(1e-7));
  CHECK(x[1] == Approx(2.0 / 6).margin(1e-7));
  CHECK(x[2] == Approx(3.0 / 6).margin(1e-7));
  CHECK(lse == Approx(std::log(6.0)).margin(1e-6));

  // Shift-invariant and stable for large logits: lse = 1000 + ln 6.
  float y[3] = {1000.0f, 1000.0f + kLn2, 1000.0f + kLn3};
  const float lse_y = SoftmaxInPlace(y, 3);
  CHECK(y[0] == Approx(1.0 / 6).margin(1e-4));  // 1000 + ln2 in float loses ~6e-5 of ln2
  CHECK(y[2] == Approx(3.0 / 6).margin(1e-4));
  CHECK(lse_y == Approx(1000.0 + std::log(6.0)).margin(1e-3));

  // One element: probability 1, lse = the logit.
  float z[1] = {-7.5f};
  CHECK(SoftmaxInPlace(z, 1) == -7.5f);
  CHECK(z[0] == 1.0f);
}

namespace {

// The round-11 SoftmaxInPlace (three passes: max, exponentials, sums), copied: the fused pass of round 12
// must give the same bits.
// The expression as an optimising build with FMA contracts it (fused where the compiler fused it), written
// out so that an unoptimised build (the sanitizer build, which contracts nothing) computes it too.
float RefFma(float a, float b, float c) {
#if defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}
float RefExpNonPositive(float x) {
  x = std::max(x, -87.3f);
  const float n = RefFma(x, 1.44269504088896341f, 12582912.0f) - 12582912.0f;
  float r = RefFma(-n, 0.693359375f, x);
  r = RefFma(-n, -2.12194440e-4f, r);
  const float z = r * r;
  const float p =
      RefFma(RefFma(RefFma(RefFma(RefFma(1.9875691500e-4f, r, 1.3981999507e-3f), r, 8.3334519073e-3f), r,
                           4.1665795894e-2f),
                    r, 1.6666665459e-1f),
             r, 5.0000001201e-1f);
  const float y = RefFma(p, z, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}
float RefSoftmaxInPlace(float* x, int n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; ++i) mx = mx < x[i] ? x[i] : mx;
  for (int i = 0; i < n; ++i) x[i] = RefExpNonPositive(x[i] - mx);
  double part[4] = {0, 0, 0, 0};
  int i4 = 0;
  for (; i4 + 4 <= n; i4 += 4)
    for (int k = 0; k < 4; ++k) part[k] += x[i4 + k];
  for (; i4 < n; ++i4) part[0] += x[i4];
  const double sum = (part[0] + part[1]) + (part[2] + part[3]);
  const float inv = static_cast<float>(1.0 / sum);
  for (int i = 0; i < n; ++i) x[i] *= inv;
  return mx + static_cast<float>(std::log(sum));
}

}  // namespace

TEST_CASE("SoftmaxInPlace equals the three-pass softmax bit for bit", "[attention]") {
  // Rows of 1 .. 300 logits (whole blocks of eight and every tail), spreads from 0.01 to 400 (so that many
  // exponentials are clamped below -87.3), ties and exact zeros, offsets that leave the rows unaligned.
  std::mt19937 rng(77);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  int rows = 0;
  for (float spread : {0.01f, 1.0f, 8.0f, 60.0f, 400.0f})
    for (int n = 1; n <= 300; n += (n < 40 ? 1 : 13)) {
      std::vector<float> a(n + 1), b(n + 1);
      for (int i = 0; i <= n; ++i) a[i] = rng() % 9 == 0 ? 0.0f : spread * unit(rng);
      if (n > 3) a[3] = a[2];
      b = a;
      const float la = RefSoftmaxInPlace(a.data() + 1, n);
      const float lb = SoftmaxInPlace(b.data() + 1, n);
      INFO("spread " << spread << ", n = " << n);
      CHECK(std::bit_cast<uint32_t>(la) == std::bit_cast<uint32_t>(lb));
      int differ = 0;
      for (int i = 1; i <= n; ++i) differ += std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i]);
      CHECK(differ == 0);
      ++rows;
    }
  CHECK(rows > 100);
}

TEST_CASE("SoftmaxInPlace takes the row's maximum wherever it is (vector blocks and tail)", "[attention]") {
  // Every other logit is 1000 below the maximum: its exponential is clamped to about 1.2e-38, so the sum is
  // 1 in double, the maximum's probability 1 and the log-sum-exp the maximum itself, bit for bit. A maximum
  // the row's scan misses (a lane, a block or the tail) gives another log-sum-exp.
  for (int n = 1; n <= 41; ++n)
    for (int at = 0; at < n; ++at) {
      std::vector<float> x(n);
      for (int i = 0; i < n; ++i) x[i] = -1000.0f - static_cast<float>(i % 5);
      x[at] = 3.25f + static_cast<float>(at);
      const float want = x[at];
      INFO("n = " << n << ", maximum at " << at);
      CHECK(SoftmaxInPlace(x.data(), n) == want);
      CHECK(x[at] == 1.0f);
    }
}

// One head, d = 2, 3 prompt tokens + 2 decode steps (T = 5), scale 1.
//   keys   k0 = (0, 0), k1 = (ln2, ln2), k2 = (ln3, 0), k3 = (0, ln3), k4 = (ln2, 0)
//   values v0 = (1, 0), v1 = (0, 1),     v2 = (1, 1),   v3 = (2, 0),   v4 = (0, 4)
//   queries: step 0 (pos 3) q = (1, 0); step 1 (pos 4) q = (0, 1).
// Step 0 logits over keys 0..3 = (0, ln2, ln3, 0): exp = (1, 2, 3, 1), Z = 7, p = (1, 2, 3, 1, 0) / 7;
//   o = (1 v0 + 2 v1 + 3 v2 + 1 v3) / 7 = ((1 + 3 + 2) / 7, (2 + 3) / 7) = (6/7, 5/7); log Z = ln 7.
// Step 1 logits over keys 0..4 = (0, ln2, 0, ln3, 0): exp = (1, 2, 1, 3, 1), Z = 8, p = (1, 2, 1, 3, 1) / 8;
//   o = (1 v0 + 2 v1 + 1 v2 + 3 v3 + 1 v4) / 8 = ((1 + 1 + 6) / 8, (2 + 1 + 4) / 8) = (1, 7/8); log Z = ln 8.
struct DecodeCase {
  std::vector<float> q{1, 0, 0, 1};
  std::vector<float> k{0, 0, kLn2, kLn2, kLn3, 0, 0, kLn3, kLn2, 0};
  std::vector<float> v{1, 0, 0, 1, 1, 1, 2, 0, 0, 4};
};

TEST_CASE("ComputeDecodeReference: probabilities, causal zeros, outputs, log Z", "[attention]") {
  DecodeCase c;
  DecodeReference ref;
  ComputeDecodeReference(Model(2, 1.0), 3, 2, c.q.data(), c.k.data(), c.v.data(), &ref);
  REQUIRE(ref.num_steps == 2);
  REQUIRE(ref.num_keys == 5);
  REQUIRE(ref.head_dim == 2);
  const double p0[5] = {1 / 7.0, 2 / 7.0, 3 / 7.0, 1 / 7.0, 0};
  const double p1[5] = {1 / 8.0, 2 / 8.0, 1 / 8.0, 3 / 8.0, 1 / 8.0};
  for (int j = 0; j < 5; ++j) {
    CHECK(ref.row(0)[j] == Approx(p0[j]).margin(1e-6));
    CHECK(ref.row(1)[j] == Approx(p1[j]).margin(1e-6));
  }
  CHECK(ref.row(0)[4] == 0.0f);  // the future key is exactly zero
  CHECK(ref.first == std::vector<int32_t>{0, 0});
  CHECK(ref.last(0) == 3);
  CHECK(ref.last(1) == 4);
  CHECK(ref.log_z[0] == Approx(std::log(7.0)).margin(1e-6));
  CHECK(ref.log_z[1] == Approx(std::log(8.0)).margin(1e-6));
  CHECK(ref.out(0)[0] == Approx(6 / 7.0).margin(1e-6));
  CHECK(ref.out(0)[1] == Approx(5 / 7.0).margin(1e-6));
  CHECK(ref.out(1)[0] == Approx(1.0).margin(1e-6));
  CHECK(ref.out(1)[1] == Approx(7 / 8.0).margin(1e-6));
}

TEST_CASE("ComputeDecodeReference: the scale multiplies the dot product", "[attention]") {
  // Halved keys with scale 2 give the same logits as the base case.
  DecodeCase c;
  for (float& x : c.k) x *= 0.5f;
  DecodeReference ref;
  ComputeDecodeReference(Model(2, 2.0), 3, 2, c.q.data(), c.k.data(), c.v.data(), &ref);
  CHECK(ref.row(0)[2] == Approx(3 / 7.0).margin(1e-6));
  CHECK(ref.row(1)[3] == Approx(3 / 8.0).margin(1e-6));
  CHECK(ref.log_z[1] == Approx(std::log(8.0)).margin(1e-6));
}

TEST_CASE("ComputeDecodeReference: sliding window masks old keys", "[attention]") {
  // Window 3: pos 3 sees keys [1, 3], pos 4 sees keys [2, 4].
  // Step 0 logits (ln2, ln3, 0): exp (2, 3, 1), Z = 6, p = (0, 2, 3, 1, 0) / 6;
  //   o = (2 v1 + 3 v2 + 1 v3) / 6 = ((3 + 2) / 6, (2 + 3) / 6) = (5/6, 5/6); log Z = ln 6.
  // Step 1 logits (0, ln3, 0): exp (1, 3, 1), Z = 5, p = (0, 0, 1, 3, 1) / 5;
  //   o = (1 v2 + 3 v3 + 1 v4) / 5 = ((1 + 6) / 5, (1 + 4) / 5) = (7/5, 1); log Z = ln 5.
  DecodeCase c;
  DecodeReference ref;
  const ModelInfo m = Model(2, 1.0, /*sliding_window=*/3);
  CHECK(FirstVisibleKey(m, 3) == 1);
  CHECK(FirstVisibleKey(m, 1) == 0);
  ComputeDecodeReference(m, 3, 2, c.q.data(), c.k.data(), c.v.data(), &ref);
  const double p0[5] = {0, 2 / 6.0, 3 / 6.0, 1 / 6.0, 0};
  const double p1[5] = {0, 0, 1 / 5.0, 3 / 5.0, 1 / 5.0};
  for (int j = 0; j < 5; ++j) {
    CHECK(ref.row(0)[j] == Approx(p0[j]).margin(1e-6));
    CHECK(ref.row(1)[j] == Approx(p1[j]).margin(1e-6));
  }
  CHECK(ref.row(0)[0] == 0.0f);
  CHECK(ref.row(1)[1] == 0.0f);
  CHECK(ref.first == std::vector<int32_t>{1, 2});
  CHECK(ref.log_z[0] == Approx(std::log(6.0)).margin(1e-6));
  CHECK(ref.log_z[1] == Approx(std::log(5.0)).margin(1e-6));
  CHECK(ref.out(0)[0] == Approx(5 / 6.0).margin(1e-6));
  CHECK(ref.out(0)[1] == Approx(5 / 6.0).margin(1e-6));
  CHECK(ref.out(1)[0] == Approx(7 / 5.0).margin(1e-6));
  CHECK(ref.out(1)[1] == Approx(1.0).margin(1e-6));
}

TEST_CASE("ComputeDecodeReference: soft-cap applies before the softmax", "[attention]") {
  // One prompt key + the token itself; q = (1, 0), k0 = (0, 0), k1 = (10, 0), scale 1, cap 2:
  // logits (2 tanh 0, 2 tanh 5) = (0, 1.9998184); p1 = 1 / (1 + exp(-1.9998184)) = 0.88077...
  std::vector<float> q{1, 0}, k{0, 0, 10, 0}, v{1, 0, 0, 1};
  DecodeReference ref;
  ComputeDecodeReference(Model(2, 1.0, 0, 2.0), 1, 1, q.data(), k.data(), v.data(), &ref);
  const double z1 = 2.0 * std::tanh(5.0);
  const double p1 = 1.0 / (1.0 + std::exp(-z1));
  CHECK(ref.row(0)[1] == Approx(p1).margin(1e-6));
  CHECK(ref.log_z[0] == Approx(std::log(1.0 + std::exp(z1))).margin(1e-6));
}

TEST_CASE("AccumulateColumnSums: hand-computed prompt case, with and without key_limit", "[attention]") {
  // Keys k0 = (0, 0), k1 = (ln2, 0), k2 = (ln3, 0); every query q = (1, 0), positions 0, 1, 2.
  //   pos 0: p = (1);  pos 1: p = (1, 2) / 3;  pos 2: p = (1, 2, 3) / 6.
  //   column sums = (1 + 1/3 + 1/6, 2/3 + 2/6, 3/6) = (1.5, 1, 0.5)  (total = 3 queries).
  // key_limit 2: pos 2 sees only keys 0, 1 -> (1, 2) / 3, sums = (1 + 1/3 + 1/3, 2/3 + 2/3) = (5/3, 4/3).
  const ModelInfo m = Model(2, 1.0);
  std::vector<float> q{1, 0, 1, 0, 1, 0}, k{0, 0, kLn2, 0, kLn3, 0};
  std::vector<int32_t> pos{0, 1, 2};
  std::vector<float> sums(3, 0.0f);
  AccumulateColumnSums(m, q.data(), pos.data(), 3, k.data(), 3, sums.data());
  CHECK(sums[0] == Approx(1.5).margin(1e-6));
  CHECK(sums[1] == Approx(1.0).margin(1e-6));
  CHECK(sums[2] == Approx(0.5).margin(1e-6));
  std::vector<float> lim(2, 0.0f);
  AccumulateColumnSums(m, q.data(), pos.data(), 3, k.data(), 2, lim.data());
  CHECK(lim[0] == Approx(5 / 3.0).margin(1e-6));
  CHECK(lim[1] == Approx(4 / 3.0).margin(1e-6));
  // Accumulates (adds to what is there).
  AccumulateColumnSums(m, q.data() + 4, pos.data() + 2, 1, k.data(), 3, sums.data());
  CHECK(sums[2] == Approx(1.0).margin(1e-6));
}

TEST_CASE("AccumulateColumnSums: a call after a larger one gives a fresh thread's sums", "[attention]") {
  // The logits block is kept per thread across calls: a later, smaller call (fewer rows, another width)
  // must give bit for bit the sums a fresh thread gives, whatever the larger call left in the block.
  const ModelInfo m = Model(8, 0.35);
  std::mt19937 rng(91);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(300 * 8), k(300 * 8);
  for (float& x : q) x = normal(rng);
  for (float& x : k) x = normal(rng);
  std::vector<int32_t> pos(300);
  std::iota(pos.begin(), pos.end(), 0);
  auto small = [&] {  // 40 queries at positions 100 .. 139 over 120 keys
    std::vector<float> sums(120, 0.0f);
    AccumulateColumnSums(m, q.data() + 100 * 8, pos.data() + 100, 40, k.data(), 120, sums.data());
    return sums;
  };
  std::vector<float> fresh;
  std::thread([&] { fresh = small(); }).join();
  std::vector<float> large(300, 0.0f);
  AccumulateColumnSums(m, q.data(), pos.data(), 300, k.data(), 300, large.data());
  const std::vector<float> after = small();
  REQUIRE(after.size() == fresh.size());
  int differ = 0;
  for (size_t j = 0; j < after.size(); ++j)
    differ += std::bit_cast<uint32_t>(after[j]) != std::bit_cast<uint32_t>(fresh[j]);
  CHECK(differ == 0);
  const std::vector<double> naive =
      NaiveColumnSums(m, std::vector<float>(q.begin() + 800, q.begin() + 1120),
                      std::vector<int32_t>(pos.begin() + 100, pos.begin() + 140), k, 120);
  for (size_t j = 0; j < after.size(); ++j) CHECK(after[j] == Approx(naive[j]).margin(1e-5));
}

TEST_CASE("AccumulateColumnSums matches a naive double loop on random data", "[attention]") {
  // 300 keys/queries (more than one 256-row block), d = 8.
  const int n = 300, d = 8;
  std::mt19937 rng(42);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(n) * d), k(q.size());
  for (float& x : q) x = 1.5f * nd(rng);
  for (float& x : k) x = 1.5f * nd(rng);
  std::vector<int32_t> all(n);
  for (int i = 0; i < n; ++i) all[i] = i;

  struct Case {
    const char* name;
    int window;
    double softcap;
    int first_query;
    int key_limit;
  };
  const Case cases[] = {
      {"all queries, all keys", 0, 0, 0, n},
      {"key_limit < positions", 0, 0, 0, 200},
      {"sliding window 50", 50, 0, 0, n},
      {"sliding window 50, key_limit 200", 50, 0, 0, 200},
      {"last 40 queries (observation window), key_limit 280", 0, 0, 240, 280},
      {"soft-cap 5", 0, 5.0, 0, n},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    const ModelInfo m = Model(d, 1.0 / std::sqrt(d), c.window, c.softcap);
    std::vector<int32_t> pos(all.begin() + c.first_query, all.end());
    std::vector<float> qs(q.begin() + static_cast<size_t>(c.first_query) * d, q.end());
    std::vector<float> got(c.key_limit, 0.0f);
    AccumulateColumnSums(m, qs.data(), pos.data(), static_cast<int>(pos.size()), k.data(), c.key_limit,
                         got.data());
    const std::vector<double> want = NaiveColumnSums(m, qs, pos, k, c.key_limit);
    double total = 0;
    for (int j = 0; j < c.key_limit; ++j) {
      CHECK(got[j] == Approx(want[j]).margin(1e-4));
      total += got[j];
    }
    // Every query with at least one visible key contributes exactly 1.
    int rows = 0;
    for (int32_t p : pos) rows += (c.window > 0 ? std::max(0, p - c.window + 1) : 0) < c.key_limit;
    CHECK(total == Approx(rows).epsilon(1e-4));
  }
}

TEST_CASE("SoftmaxEntropy: hand-computed rows", "[attention]") {
  std::vector<float> uniform{2, 2, 2, 2};
  CHECK(SoftmaxEntropy(uniform.data(), 4) == Approx(std::log(4.0)));
  std::vector<float> row{0, 1, 2};
  CHECK(SoftmaxEntropy(row.data(), 3) == Approx(0.83239558));
  std::vector<float> one{5};
  CHECK(SoftmaxEntropy(one.data(), 1) == 0);
  std::vector<float> peaked{0, -200};
  CHECK(SoftmaxEntropy(peaked.data(), 2) == Approx(0).margin(1e-6));
}

// The loop FinishRun's per-step gather had: the row zeroed, then out[k] += p[tok] * v[k] slot by slot, as an
// optimised build with FMA contracted it (one fused multiply-add per element; an unoptimised build, such as
// the sanitizer stage's Debug build, does not contract, so the fusion is written out), and a build without
// FMA as two roundings.
namespace {
void GatherWeightedRowsReplica(const float* p, const int32_t* tok, size_t n, const float* values, int d,
                               float* out) {
  for (int k = 0; k < d; ++k) out[k] = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    const float pt = p[tok[i]];
    const float* v = values + static_cast<size_t>(tok[i]) * d;
#ifdef __FMA__
    for (int k = 0; k < d; ++k) out[k] = std::fma(pt, v[k], out[k]);
#else
    for (int k = 0; k < d; ++k) out[k] += pt * v[k];
#endif
  }
}
}  // namespace

TEST_CASE("GatherWeightedRows: bit-identical to the slot-by-slot loop for any head dim", "[attention]") {
  std::mt19937 rng(7);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  const int tokens = 300;
  bool order_matters = false;
  for (int d : {1, 5, 8, 13, 64, 72, 100, 128, 136, 200, 256}) {
    std::vector<float> values(static_cast<size_t>(tokens) * d), p(tokens);
    for (float& x : values) x = g(rng);
    for (float& x : p) x = u(rng) * u(rng);
    for (size_t n : {size_t{0}, size_t{1}, size_t{3}, size_t{40}, size_t{257}}) {
      std::vector<int32_t> tok(n);
      for (int32_t& t : tok) t = static_cast<int32_t>(rng() % tokens);  // repeats allowed
      std::vector<float> got(d), want(d), rev(d);
      GatherWeightedRowsReplica(p.data(), tok.data(), n, values.data(), d, want.data());
      for (bool avx512 : {true, false}) {  // where the CPU has AVX-512, both code paths
        SetGatherAvx512ForTesting(avx512);
        std::fill(got.begin(), got.end(), std::numeric_limits<float>::quiet_NaN());
        GatherWeightedRows(p.data(), tok.data(), n, values.data(), d, got.data());
        INFO("d " << d << ", slots " << n << ", AVX-512 allowed " << avx512);
        CHECK(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0);
      }
      SetGatherAvx512ForTesting(true);
      // The comparison sees an order change: the slots backwards give other bits somewhere.
      std::vector<int32_t> back(tok.rbegin(), tok.rend());
      GatherWeightedRowsReplica(p.data(), back.data(), n, values.data(), d, rev.data());
      if (std::memcmp(rev.data(), want.data(), want.size() * sizeof(float)) != 0) order_matters = true;
    }
  }
  CHECK(order_matters);
}

// Four steps whose slot lists share a prefix (then each its own tail: appends, or other slots) give each
// step GatherWeightedRows' bits, for any head dim (whole 16- and 8-column groups and the rest), any shared
// length (none, part, a whole list) and distinct probability rows per step.
TEST_CASE("GatherWeightedRowsSteps: each step bit-identical to GatherWeightedRows", "[attention]") {
  std::mt19937 rng(11);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  const int tokens = 400;
  for (int d : {1, 5, 8, 13, 16, 24, 64, 100, 128, 136}) {
    std::vector<float> values(static_cast<size_t>(tokens) * d);
    for (float& x : values) x = g(rng);
    std::vector<std::vector<float>> prob(kGatherSteps, std::vector<float>(tokens));
    for (auto& row : prob)
      for (float& x : row) x = u(rng) * u(rng);
    for (size_t common : {size_t{0}, size_t{1}, size_t{7}, size_t{40}, size_t{257}}) {
      std::vector<int32_t> shared(common);
      for (int32_t& t : shared) t = static_cast<int32_t>(rng() % tokens);
      std::vector<std::vector<int32_t>> lists(kGatherSteps, shared);
      for (int s = 0; s < kGatherSteps; ++s)  // step s: s * 3 more slots (step 0: exactly the shared ones)
        for (int k = 0; k < 3 * s; ++k) lists[s].push_back(static_cast<int32_t>(rng() % tokens));
      const float* p[kGatherSteps];
      const int32_t* tok[kGatherSteps];
      size_t n[kGatherSteps];
      std::vector<std::vector<float>> got(kGatherSteps, std::vector<float>(d, std::nanf(""))), want = got;
      float* o[kGatherSteps];
      for (int s = 0; s < kGatherSteps; ++s) {
        p[s] = prob[s].data(), tok[s] = lists[s].data(), n[s] = lists[s].size(), o[s] = got[s].data();
        GatherWeightedRows(p[s], tok[s], n[s], values.data(), d, want[s].data());
      }
      GatherWeightedRowsSteps(p, tok, n, common, values.data(), d, o);
      for (int s = 0; s < kGatherSteps; ++s) {
        INFO("d " << d << ", shared " << common << ", step " << s);
        CHECK(std::memcmp(got[s].data(), want[s].data(), d * sizeof(float)) == 0);
      }
    }
  }
}

// Recycled references (sim/replay.cc PassBuffers) hold another unit's values, or anything: the reference
// computed into a buffer full of NaN, of another size or of the same size, equals the one computed fresh.
TEST_CASE("ComputeDecodeReference: a recycled buffer's stale contents change nothing", "[attention]") {
  ModelInfo m;
  m.num_layers = 1;
  m.num_heads = m.num_kv_heads = 1;
  m.head_dim = 16;
  m.softmax_scale = 0.25;
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (int window : {0, 20}) {
    m.sliding_window = window;
    const int n = 37, steps = 9, t_all = n + steps;
    std::vector<float> q(static_cast<size_t>(steps) * m.head_dim), k(static_cast<size_t>(t_all) * m.head_dim),
        v(k.size());
    for (float& x : q) x = g(rng);
    for (float& x : k) x = g(rng);
    for (float& x : v) x = g(rng);
    DecodeReference fresh;
    ComputeDecodeReference(m, n, steps, q.data(), k.data(), v.data(), &fresh);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (size_t extra : {size_t{0}, size_t{5}, size_t{1000}}) {
      DecodeReference stale;
      stale.probs.assign(static_cast<size_t>(steps) * t_all + extra, nan);
      stale.probs.resize(static_cast<size_t>(steps) * t_all - (extra == 5 ? 7 : 0));  // also a smaller one
      stale.log_z.assign(steps + extra, nan);
      stale.output.assign(static_cast<size_t>(steps) * m.head_dim + extra, nan);
      stale.first.assign(steps + extra, -5);
      ComputeDecodeReference(m, n, steps, q.data(), k.data(), v.data(), &stale);
      INFO("window " << window << ", extra " << extra);
      CHECK(stale.probs.size() == fresh.probs.size());
      CHECK(std::memcmp(stale.probs.data(), fresh.probs.data(), fresh.probs.size() * sizeof(float)) == 0);
      CHECK(std::memcmp(stale.log_z.data(), fresh.log_z.data(), fresh.log_z.size() * sizeof(float)) == 0);
      CHECK(std::memcmp(stale.output.data(), fresh.output.data(), fresh.output.size() * sizeof(float)) == 0);
      CHECK(stale.first == fresh.first);
      for (int t = 0; t < steps; ++t)  // the masked keys are exact zeros
        for (int j = 0; j < t_all; ++j)
          if (j < fresh.first[t] || j > fresh.last(t)) CHECK(stale.row(t)[j] == 0.0f);
    }
  }
}

}  // namespace kvsim
