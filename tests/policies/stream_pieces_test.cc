// The streaming policies' reusable math (policies/stream_pieces.h) on hand-computed cases: min-max
// normalisation, MuKV's FFT and diff frequency signals, the dual-signal fusion, top-k with ties,
// representative vectors, similarities and the semi-hierarchical rerank score.

#include "policies/stream_pieces.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <vector>

namespace kvsim {

namespace {
void CheckNear(const std::vector<float>& got, const std::vector<double>& want, double eps = 1e-5) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("index " << i);
    CHECK(got[i] == Approx(want[i]).margin(eps));
  }
}
}  // namespace

TEST_CASE("stream_pieces: MinMaxNormalize", "[stream_pieces]") {
  std::vector<float> x{2, 4, 6};  // (x - 2) / 4
  MinMaxNormalize(x);
  CheckNear(x, {0, 0.5, 1});
  std::vector<float> y{6, 2, 3};  // (y - 2) / 4 = 1, 0, .25
  MinMaxNormalize(y);
  CheckNear(y, {1, 0, 0.25});
  std::vector<float> c{3, 3, 3};  // max == min -> zeros
  MinMaxNormalize(c);
  CheckNear(c, {0, 0, 0});
  std::vector<float> e;
  MinMaxNormalize(e);  // no-op
  CHECK(e.empty());
}

TEST_CASE("stream_pieces: FrequencySignalFFT (rfft, low bins zeroed, irfft, mean |x|)", "[stream_pieces]") {
  SECTION("n = 4, dim = 1: F = 3 bins, cut = 1, keep k = 1, 2") {
    // X_k = 1 for every k. x_hp(t) = (1/4)[2 cos(2πt/4) + cos(πt)] = .75, -.25, -.25, -.25 (x minus its
    // mean).
    const std::vector<float> x{1, 0, 0, 0};
    CheckNear(FrequencySignalFFT(x.data(), 4, 1), {0.75, 0.25, 0.25, 0.25});
  }
  SECTION("n = 5 (odd), dim = 1: F = 3, cut = 1, no Nyquist bin (k = 1, 2 both weighted 2)") {
    // x_hp(t) = (2/5)[cos(2πt/5) + cos(4πt/5)]: t = 0: 4/5; t = 1..4: (2/5)(cos72° + cos144°) = (2/5)(-1/2) =
    // -.2.
    const std::vector<float> x{1, 0, 0, 0, 0};
    CheckNear(FrequencySignalFFT(x.data(), 5, 1), {0.8, 0.2, 0.2, 0.2, 0.2});
  }
  SECTION("n = 4, dim = 2: mean over dims of |x_hp|") {
    // Only the DC bin is cut, so x_hp = x - column mean.
    // column 0: [1,0,0,0] - .25 = [.75,-.25,-.25,-.25]; column 1: [0,2,0,0] - .5 = [-.5,1.5,-.5,-.5].
    // f = ((.75+.5)/2, (.25+1.5)/2, (.25+.5)/2, (.25+.5)/2) = (.625, .875, .375, .375).
    const std::vector<float> x{1, 0, 0, 2, 0, 0, 0, 0};  // [4][2], row-major
    CheckNear(FrequencySignalFFT(x.data(), 4, 2), {0.625, 0.875, 0.375, 0.375});
  }
  SECTION("n = 8: F = 5, cut = 2 (bins 0 and 1 zeroed; 2, 3 weighted 2, Nyquist 4 weighted 1)") {
    // x_hp(t) = (1/8)[2cos(πt/2) + 2cos(3πt/4) + cos(πt)]
    //   t=0: 5/8; t=1: (0 - √2 - 1)/8 = -.3017767; t=2: (-2 + 0 + 1)/8 = -.125; t=3: (0 + √2 - 1)/8 =
    //   .0517767; t=4: (2 - 2 + 1)/8 = .125; t=5 = t=3; t=6 = t=2; t=7 = t=1 (symmetry).
    const std::vector<float> x{1, 0, 0, 0, 0, 0, 0, 0};
    CheckNear(FrequencySignalFFT(x.data(), 8, 1),
              {0.625, 0.3017767, 0.125, 0.0517767, 0.125, 0.0517767, 0.125, 0.3017767});
  }
  SECTION("a constant sequence has no high-frequency content") {
    const std::vector<float> x{2, 2, 2, 2, 2, 2};
    CheckNear(FrequencySignalFFT(x.data(), 6, 1), {0, 0, 0, 0, 0, 0});
  }
}

// The definition, term by term in double with the angles as the formula writes them (2π k t / n): the
// reference the matrix form (two products with a twiddle table reduced mod n) must match to float precision.
std::vector<float> FrequencySignalByDefinition(const std::vector<float>& x, int n, int dim) {
  const int bins = n / 2 + 1, cut = bins / 2;
  std::vector<double> hp(static_cast<size_t>(n) * dim, 0.0);
  for (int k = cut; k < bins; ++k) {
    const double w = (k == 0 || (n % 2 == 0 && k == n / 2)) ? 1.0 : 2.0;
    for (int j = 0; j < dim; ++j) {
      double re = 0, im = 0;
      for (int t = 0; t < n; ++t) {
        const double a = -2.0 * M_PI * k * t / n;
        re += x[static_cast<size_t>(t) * dim + j] * std::cos(a);
        im += x[static_cast<size_t>(t) * dim + j] * std::sin(a);
      }
      for (int t = 0; t < n; ++t) {
        const double a = 2.0 * M_PI * k * t / n;
        hp[static_cast<size_t>(t) * dim + j] += w * (re * std::cos(a) - im * std::sin(a)) / n;
      }
    }
  }
  std::vector<float> f(n);
  for (int t = 0; t < n; ++t) {
    double acc = 0;
    for (int j = 0; j < dim; ++j) acc += std::fabs(hp[static_cast<size_t>(t) * dim + j]);
    f[t] = static_cast<float>(acc / dim);
  }
  return f;
}

TEST_CASE("stream_pieces: FrequencySignalFFT matches the definition at MuKV's block sizes",
          "[stream_pieces]") {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Sizes in an order that changes the twiddle table between calls (it is rebuilt when n changes).
  for (int n : {49, 196, 49, 784, 7, 8, 1, 2}) {
    const int dim = 16;
    std::vector<float> x(static_cast<size_t>(n) * dim);
    for (float& v : x) v = normal(rng);
    const std::vector<float> got = FrequencySignalFFT(x.data(), n, dim);
    const std::vector<float> want = FrequencySignalByDefinition(x, n, dim);
    INFO("n = " << n);
    REQUIRE(got.size() == want.size());
    for (int t = 0; t < n; ++t) CHECK(got[t] == Approx(want[t]).epsilon(1e-6).margin(1e-6));
  }
}

TEST_CASE("stream_pieces: FrequencySignalDiff", "[stream_pieces]") {
  // f_0 = 0; ||[3,4] - [0,0]|| = 5; ||[3,4] - [3,4]|| = 0.
  const std::vector<float> k{0, 0, 3, 4, 3, 4};
  CheckNear(FrequencySignalDiff(k.data(), 3, 2), {0, 5, 0});
  // 1-d: |2-0| = 2, |-1-2| = 3.
  const std::vector<float> k1{0, 2, -1};
  CheckNear(FrequencySignalDiff(k1.data(), 3, 1), {0, 2, 3});
}

TEST_CASE("stream_pieces: FuseSignals = alpha * minmax(att) + (1 - alpha) * minmax(freq)",
          "[stream_pieces]") {
  const std::vector<float> att{1, 2, 3}, freq{3, 0, 0};
  // minmax(att) = [0, .5, 1], minmax(freq) = [1, 0, 0].
  CheckNear(FuseSignals(att, freq, 0.5), {0.5, 0.25, 0.5});
  CheckNear(FuseSignals(att, freq, 1.0), {0, 0.5, 1});
  CheckNear(FuseSignals(att, freq, 0.0), {1, 0, 0});
  CheckNear(FuseSignals(att, freq, 0.8), {0.2, 0.4, 0.8});  // .8*[0,.5,1] + .2*[1,0,0]
}

TEST_CASE("stream_pieces: TopKSorted ties (lower index first), returned ascending", "[stream_pieces]") {
  // (The descending-order helper is not named here: HEAD's TopKIndices clashes with sim/select.h's
  // TopKIndices and is being renamed; TopKSorted is the stable entry point and what MuKV and ReKV use.)
  const std::vector<float> s{0.5f, 0.9f, 0.5f, 0.9f, 0.1f};
  CHECK(TopKSorted(s, 3) == std::vector<int32_t>{0, 1, 3});  // .9 (1), .9 (3), then .5 at 0 before 2
  CHECK(TopKSorted(s, 2) == std::vector<int32_t>{1, 3});
  CHECK(TopKSorted(s, 1) == std::vector<int32_t>{1});  // .9 tie: index 1 before 3
  CHECK(TopKSorted(s, 0).empty());
  CHECK(TopKSorted(s, 9) == std::vector<int32_t>{0, 1, 2, 3, 4});  // clamped to the size
  CHECK(TopKSorted(s, -1).empty());
  const std::vector<float> same{2, 2, 2, 2};
  CHECK(TopKSorted(same, 2) == std::vector<int32_t>{0, 1});
  const std::vector<float> desc{5, 4, 3, 2, 1};
  CHECK(TopKSorted(desc, 3) == std::vector<int32_t>{0, 1, 2});
  const std::vector<float> asc{1, 2, 3, 4, 5};
  CHECK(TopKSorted(asc, 3) == std::vector<int32_t>{2, 3, 4});
}

TEST_CASE("stream_pieces: MeanRows (representative vector of the kept rows)", "[stream_pieces]") {
  const std::vector<float> x{1, 2, 3, 4, 5, 6};  // [3][2]
  const std::vector<int32_t> rows{0, 2};         // mean of [1,2] and [5,6]
  CheckNear(MeanRows(x.data(), 2, rows), {3, 4});
  const std::vector<int32_t> one{1};
  CheckNear(MeanRows(x.data(), 2, one), {3, 4});
  const std::vector<int32_t> all{0, 1, 2};
  CheckNear(MeanRows(x.data(), 2, all), {3, 4});
  const std::vector<int32_t> none;
  CheckNear(MeanRows(x.data(), 2, none), {0, 0});
  const std::vector<int32_t> two{0, 1};
  CheckNear(MeanRows(x.data(), 2, two), {2, 3});
}

TEST_CASE("stream_pieces: Cosine and DotProduct", "[stream_pieces]") {
  const std::vector<float> a{1, 0}, b{1, 1}, z{0, 0};
  CHECK(DotProduct(a, b) == Approx(1));
  CHECK(Cosine(a, b) == Approx(1 / std::sqrt(2.0)));
  const std::vector<float> u{1, 2, 3}, v{4, 5, 6};
  CHECK(DotProduct(u, v) == Approx(32));                                    // 4 + 10 + 18
  CHECK(Cosine(u, v) == Approx(32 / (std::sqrt(14.0) * std::sqrt(77.0))));  // .974632
  const std::vector<float> neg{-2, 0};
  CHECK(Cosine(a, neg) == Approx(-1));
  CHECK(Cosine(a, z) == 0);  // zero vector: 0, not NaN
}

TEST_CASE("stream_pieces: RerankScore s' = (1 - λ) s + λ cos(r, c)", "[stream_pieces]") {
  const std::vector<float> r{1, 0}, c{1, 1};
  CHECK(RerankScore(0.8, r, c, 0.3) == Approx(0.7 * 0.8 + 0.3 / std::sqrt(2.0)));  // .772132
  CHECK(RerankScore(0.8, r, c, 0.3) == Approx(0.772132).epsilon(1e-5));
  CHECK(RerankScore(0.8, r, c, 0.0) == Approx(0.8));  // λ = 0: the stage-1 score
  CHECK(RerankScore(0.8, r, c, 1.0) == Approx(1 / std::sqrt(2.0)));
}

}  // namespace kvsim
