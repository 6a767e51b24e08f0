// The int16 screen (policies/merge_screen_int16.*): packing, the kernel's exact integer dot products for
// every tail, the rigorous bound against the fmaf chain (reached to 97% by adversarial rows), and the
// candidates: every first maximum of the exact values is among them.

#include "policies/merge_screen_int16.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "policies/merge_screen.h"
#include "tests/test_util.h"

namespace kvsim {
namespace {

namespace i16 = merge_screen::int16;

using testing::NormalizeRows;
using testing::UnitRows;

float Exact(const float* a, const float* b, int d) {
  float v;
  merge_screen::ExactDots(&a, &b, 1, d, &v);
  return v;
}

// The packed target j's coordinate k (PackTargets' layout).
int16_t TargetAt(const std::vector<int16_t>& tp, int d, int j, int k) {
  const int g = j / 8, i = j % 8, p = k / 2;
  return tp[2 * ((static_cast<size_t>(g) * (d / 2) + p) * 8 + i) + k % 2];
}

TEST_CASE("int16 screen: packing rounds to nearest even and reports the exact error norm",
          "[merge][screen]") {
  const int d = 8;
  // In units of 2^-14: 0.5 -> 0 (tie, even), 1.5 -> 2 (tie, even), 2.5 -> 2, -0.5 -> -0, 1.25 -> 1,
  // 16384 (x = 1) -> 16384, -3.75 -> -4, a subnormal -> 0.
  const float u = std::ldexp(1.0f, -14);
  const std::vector<float> x{0.5f * u, 1.5f * u, 2.5f * u, -0.5f * u, 1.25f * u, 1.0f, -3.75f * u, 1e-40f};
  const std::vector<int16_t> want{0, 2, 2, 0, 1, 16384, -4, 0};
  std::vector<int16_t> q(d);
  double err = 0;
  i16::PackQueries(x.data(), 1, d, q.data(), &err);
  CHECK(q == want);
  double e2 = 0;
  for (int k = 0; k < d; ++k) {
    const double e = static_cast<double>(want[k]) * u - x[k];
    e2 += e * e;
  }
  CHECK(err >= std::sqrt(e2));
  CHECK(err <= std::sqrt(e2) * (1 + 1e-11));
  std::vector<int16_t> tp(i16::PackedTargetsSize(1, d));
  const double rt = i16::PackTargets(x.data(), 1, d, tp.data());
  CHECK(rt == err);
  for (int k = 0; k < d; ++k) CHECK(TargetAt(tp, d, 0, k) == want[k]);
  for (int j = 1; j < 8; ++j)
    for (int k = 0; k < d; ++k) CHECK(TargetAt(tp, d, j, k) == 0);  // padding rows
}

TEST_CASE("int16 screen: the vector query packing gives the scalar packing's words", "[merge][screen]") {
  const float u = std::ldexp(1.0f, -14);
  for (int d : {16, 32, 128, 256}) {
    std::vector<float> q = UnitRows(9, d, 40 + d);
    // Ties at both parities, exact grid points, a subnormal and -0 in row 0.
    const std::vector<float> special{0.5f * u,  1.5f * u, 2.5f * u, -0.5f * u,
                                     -1.5f * u, 3.0f * u, 1e-40f,   -0.0f};
    std::copy(special.begin(), special.end(), q.begin());
    std::vector<int16_t> a(q.size()), b(q.size());
    std::vector<double> ea(9), eb(9);
    i16::SetVectorPackForTesting(false);
    i16::PackQueries(q.data(), 9, d, a.data(), ea.data());
    i16::SetVectorPackForTesting(true);
    i16::PackQueries(q.data(), 9, d, b.data(), eb.data());
    CAPTURE(d);
    CHECK(a == b);
    CHECK(a[0] == 0);
    CHECK(a[1] == 2);
    CHECK(a[2] == 2);
    CHECK(a[4] == -2);
    for (int r = 0; r < 9; ++r) CHECK(eb[r] == Approx(ea[r]).epsilon(1e-12));
  }
}

TEST_CASE("int16 screen: the kernel's products are the exact integer dot products, every tail",
          "[merge][screen]") {
  if (!i16::Supported()) return;  // no AVX2: NearestByCosine does not use the screen
  for (int d : {2, 4, 6, 14, 64, 126, 128, 256})
    for (int nq : {1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 13}) {
      for (int nt : {1, 7, 8, 9, 16, 17, 23, 24, 25, 40, 100}) {
        const std::vector<float> q = UnitRows(nq, d, 100 + d + nq), t = UnitRows(nt, d, 200 + d + nt);
        std::vector<int16_t> qp(static_cast<size_t>(nq) * d), tp(i16::PackedTargetsSize(nt, d));
        std::vector<double> rq(nq);
        i16::PackQueries(q.data(), nq, d, qp.data(), rq.data());
        i16::PackTargets(t.data(), nt, d, tp.data());
        const long ld = i16::PaddedTargets(nt) + 3;  // a row stride wider than the row
        std::vector<int32_t> s(static_cast<size_t>(nq) * ld, 12345);
        i16::Dots(qp.data(), nq, tp.data(), nt, d, s.data(), ld);
        int bad = 0;
        for (int r = 0; r < nq; ++r) {
          for (int j = 0; j < i16::PaddedTargets(nt); ++j) {
            int64_t want = 0;
            for (int k = 0; k < d; ++k)
              want += static_cast<int64_t>(qp[static_cast<size_t>(r) * d + k]) * TargetAt(tp, d, j, k);
            bad += s[r * ld + j] != want;
          }
          for (long j = i16::PaddedTargets(nt); j < ld; ++j) bad += s[r * ld + j] != 12345;  // untouched
        }
        CAPTURE(d, nq, nt);
        CHECK(bad == 0);
      }
    }
}

TEST_CASE("int16 screen: the error bound holds, and adversarial rows reach 97% of it", "[merge][screen]") {
  constexpr int d = 128;
  const double u = std::ldexp(1.0, -14);
  // Every coordinate 0.48 units of 2^-14 above a grid point (rounded down by 0.48 u), all positive, so the
  // rounding errors line up with the rows (Cauchy-Schwarz's equality case): Σ a'b' − Σ ab ≈ −2 Σ a_k δ_k,
  // the bound's E1. 82 coordinates at 1448.48 u and 46 at 1447.48 u make the norm 1 to ~5e-6, so the
  // normalisation moves each coordinate by less than 0.01 u.
  std::vector<float> x(d);
  for (int k = 0; k < d; ++k) x[k] = static_cast<float>(((k < 82 ? 1448 : 1447) + 0.48) * u);
  NormalizeRows(&x, d);
  std::vector<int16_t> qp(d), tp(i16::PackedTargetsSize(1, d));
  double rq = 0;
  i16::PackQueries(x.data(), 1, d, qp.data(), &rq);
  const double rt = i16::PackTargets(x.data(), 1, d, tp.data());
  int64_t s = 0;
  for (int k = 0; k < d; ++k) s += static_cast<int64_t>(qp[k]) * qp[k];
  const double approx = std::ldexp(static_cast<double>(s), -28), v = Exact(x.data(), x.data(), d);
  const double bound = merge_screen::ErrorBound(d, rq, rt) / merge_screen::kSafetyFactor;
  const double err = std::abs(approx - v);
  CAPTURE(err, bound, rq);
  CHECK(err <= bound);
  CHECK(err >= 0.97 * bound);
  // The slack covers twice the full bound (with the safety factor), in units of 2^-28.
  CHECK(static_cast<double>(i16::Slack(d, rq, rt)) >= 2 * merge_screen::ErrorBound(d, rq, rt) * 0x1p28);
  CHECK(static_cast<double>(i16::Slack(d, rq, rt)) < 2 * merge_screen::ErrorBound(d, rq, rt) * 0x1p28 + 1);
  CHECK(i16::Slack(d, 1.0, 1.0) == int64_t{1} << 30);  // saturated
  // Random unit rows: within the bound.
  const int nq = 40, nt = 150;
  const std::vector<float> q = UnitRows(nq, d, 7), t = UnitRows(nt, d, 8);
  std::vector<int16_t> qpp(static_cast<size_t>(nq) * d), tpp(i16::PackedTargetsSize(nt, d));
  std::vector<double> rqs(nq);
  i16::PackQueries(q.data(), nq, d, qpp.data(), rqs.data());
  const double rts = i16::PackTargets(t.data(), nt, d, tpp.data());
  double worst = 0;
  for (int i = 0; i < nq; ++i)
    for (int j = 0; j < nt; ++j) {
      int64_t si = 0;
      for (int k = 0; k < d; ++k) si += static_cast<int64_t>(qpp[i * d + k]) * TargetAt(tpp, d, j, k);
      const double e = std::abs(std::ldexp(static_cast<double>(si), -28) - Exact(&q[i * d], &t[j * d], d));
      worst = std::max(worst, e / (merge_screen::ErrorBound(d, rqs[i], rts) / merge_screen::kSafetyFactor));
    }
  CHECK(worst <= 1.0);
}

TEST_CASE("int16 screen: candidates are the targets within the slack of the row maximum, in order",
          "[merge][screen]") {
  if (!i16::Supported()) return;
  const int d = 32;
  for (int nq : {1, 3, 4, 5, 6, 7, 9, 12, 13})
    for (int nt : {1, 5, 8, 13, 31, 64, 128, 130, 257, 300}) {
      std::vector<float> q = UnitRows(nq, d, 300 + nq), t = UnitRows(nt, d, 400 + nt);
      // Negative products everywhere for row 0 (targets = −query): padding's zero must not be the maximum.
      for (int j = 0; j < nt; ++j)
        for (int k = 0; k < d; ++k) t[j * d + k] = j % 2 == 0 ? -q[k] : t[j * d + k];
      std::vector<int16_t> qp(static_cast<size_t>(nq) * d), tp(i16::PackedTargetsSize(nt, d));
      std::vector<double> rq(nq);
      i16::PackQueries(q.data(), nq, d, qp.data(), rq.data());
      i16::PackTargets(t.data(), nt, d, tp.data());
      const long ld = i16::PaddedTargets(nt);
      std::vector<int32_t> s(static_cast<size_t>(nq) * ld);
      i16::Dots(qp.data(), nq, tp.data(), nt, d, s.data(), ld);
      for (int64_t base : {int64_t{0}, int64_t{1000}, int64_t{20000000}, int64_t{1} << 40}) {
        std::vector<int64_t> slack(nq);
        for (int r = 0; r < nq; ++r) slack[r] = base * (r + 1) / 2;
        std::vector<int> rows{-7}, idx{-7};  // appended to
        i16::Candidates(qp.data(), nq, tp.data(), nt, d, slack.data(), &rows, &idx);
        std::vector<int> want_rows{-7}, want_idx{-7};
        for (int r = 0; r < nq; ++r) {
          const int32_t m = *std::max_element(&s[r * ld], &s[r * ld] + nt);
          for (int j = 0; j < nt; ++j)
            if (static_cast<int64_t>(s[r * ld + j]) >= m - std::min(slack[r], int64_t{1} << 30))
              want_rows.push_back(r), want_idx.push_back(j);
        }
        CAPTURE(nq, nt, base);
        CHECK(rows == want_rows);
        CHECK(idx == want_idx);
        // With a floor (round 14): the same list restricted to S ≥ floor[r]; a floor at or below every S
        // (down to INT64_MIN) changes nothing, one above every S (up to INT64_MAX) leaves the row none.
        std::vector<int64_t> floor(nq);
        for (int r = 0; r < nq; ++r) {
          const int32_t* row = &s[r * ld];
          const int64_t m = *std::max_element(row, row + nt), lo = *std::min_element(row, row + nt);
          const int64_t pick[] = {std::numeric_limits<int64_t>::min(),
                                  lo,
                                  row[(r * 7) % nt],
                                  m,
                                  m + 1,
                                  std::numeric_limits<int64_t>::max(),
                                  -(int64_t{1} << 31),
                                  int64_t{1} << 31};
          floor[r] = pick[(r + base % 5) % 8];
        }
        std::vector<int> frows{-7}, fidx{-7}, want_frows{-7}, want_fidx{-7};
        i16::Candidates(qp.data(), nq, tp.data(), nt, d, slack.data(), &frows, &fidx, floor.data());
        for (size_t i = 1; i < want_rows.size(); ++i)
          if (s[want_rows[i] * ld + want_idx[i]] >= floor[want_rows[i]])
            want_frows.push_back(want_rows[i]), want_fidx.push_back(want_idx[i]);
        CHECK(frows == want_frows);
        CHECK(fidx == want_fidx);
      }
    }
}

TEST_CASE("int16 screen: the first maximum of the exact values is always a candidate", "[merge][screen]") {
  if (!i16::Supported()) return;
  for (int d : {16, 64, 128}) {
    const int nq = 37, nt = 211;
    std::vector<float> q = UnitRows(nq, d, 500 + d), t = UnitRows(nt, d, 600 + d);
    // Near ties: targets that are queries plus a tiny perturbation, duplicates (exact ties), and queries
    // equal to targets.
    std::mt19937 g(d);
    std::normal_distribution<float> tiny(0.0f, 1e-4f);
    for (int j = 0; j < nt; j += 3)
      for (int k = 0; k < d; ++k) t[j * d + k] = q[(j % nq) * d + k] + tiny(g);
    for (int j = 1; j + 10 < nt; j += 10) std::copy_n(&t[j * d], d, &t[(j + 10) * d]);
    NormalizeRows(&t, d);
    for (int r = 0; r < nq; r += 5) std::copy_n(&t[(7 * r % nt) * d], d, &q[r * d]);
    std::vector<int16_t> qp(static_cast<size_t>(nq) * d), tp(i16::PackedTargetsSize(nt, d));
    std::vector<double> rq(nq);
    i16::PackQueries(q.data(), nq, d, qp.data(), rq.data());
    const double rt = i16::PackTargets(t.data(), nt, d, tp.data());
    std::vector<int64_t> slack(nq);
    for (int r = 0; r < nq; ++r) slack[r] = i16::Slack(d, rq[r], rt);
    std::vector<int> rows, idx;
    i16::Candidates(qp.data(), nq, tp.data(), nt, d, slack.data(), &rows, &idx);
    size_t c = 0;
    long total = 0;
    for (int r = 0; r < nq; ++r) {
      int best = 0;
      float bv = Exact(&q[r * d], &t[0], d);
      for (int j = 1; j < nt; ++j) {
        const float v = Exact(&q[r * d], &t[j * d], d);
        if (v > bv) best = j, bv = v;
      }
      int found = -1;
      float fv = 0;
      for (; c < rows.size() && rows[c] == r; ++c, ++total) {
        const float v = Exact(&q[r * d], &t[idx[c] * d], d);
        if (found < 0 || v > fv) found = idx[c], fv = v;
      }
      CAPTURE(d, r);
      CHECK(found == best);
      CHECK(fv == bv);
    }
    CHECK(c == rows.size());
    CHECK(total < 4L * nq);  // the screen leaves few candidates (near ties and duplicates only)
  }
}

}  // namespace
}  // namespace kvsim
