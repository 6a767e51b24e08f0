// The int8 first stage of the int16 screen (policies/merge_screen_int8.*; issue 14, round 16): narrowing
// (words, exact norms, error norms bounded from above), the kernel's exact products at the int16 range's
// edge, the bound |c² S − 2^28 P| ≤ E (reached by aligned rows), and the point of it all: int16::Candidates
// with the stage gives the same list, in the same order, as without it, for near ties, duplicates, zero
// rows, tiny and huge rows, floors and saturated slacks.

#include "policies/merge_screen_int8.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "policies/merge_screen.h"
#include "policies/merge_screen_int16.h"
#include "sim/cpu.h"
#include "tests/test_util.h"

namespace kvsim {
namespace {

namespace i16 = merge_screen::int16;
namespace i8 = merge_screen::int8;

using testing::NormalizeRows;
using testing::UnitRows;

// The narrowed words and their errors (the definitions in merge_screen_int8.cc): a query's with the scale c,
// clamped at ±127; a target's with kTargetScale, clamped at ±64.
int Word(int c, int16_t a, int top = 127) { return std::clamp((c * a + (1 << 13)) >> 14, -top, top); }
int64_t Alpha(int c, int16_t a, int top = 127) { return int64_t{c} * a - (int64_t{Word(c, a, top)} << 14); }
constexpr int kC = i8::kTargetScale, kTop = i8::kTargetMax;
int TWord(int16_t b) { return Word(kC, b, kTop); }
int64_t Beta(int16_t b) { return Alpha(kC, b, kTop); }

// Target j's word at dimension k in the int16 / int8 packed layouts.
int16_t T16(const std::vector<int16_t>& tp, int d, int j, int k) {
  return tp[2 * ((static_cast<size_t>(j / 8) * (d / 2) + k / 2) * 8 + j % 8) + k % 2];
}
int8_t T8(const std::vector<int8_t>& tp, int d, int j, int k) {
  return tp[((static_cast<size_t>(j / 8) * (d / 4) + k / 4) * 8 + j % 8) * 4 + k % 4];
}

// Packed int16 rows (queries row-major, targets in PackTargets' layout) of float rows.
struct Packed {
  std::vector<int16_t> q, t;
  std::vector<double> rq;
  double rt = 0;
};
Packed Pack(const std::vector<float>& q, int nq, const std::vector<float>& t, int nt, int d) {
  Packed p;
  p.q.resize(static_cast<size_t>(nq) * d), p.t.resize(i16::PackedTargetsSize(nt, d)), p.rq.resize(nq);
  i16::PackQueries(q.data(), nq, d, p.q.data(), p.rq.data());
  p.rt = i16::PackTargets(t.data(), nt, d, p.t.data());
  return p;
}

// Narrowed queries and targets of packed int16 rows.
struct Narrow {
  std::vector<uint8_t> q;
  std::vector<int8_t> t;
  std::vector<int32_t> scale;
  std::vector<double> norm, err;
  i8::Norms tn;
};
Narrow NarrowAll(const std::vector<int16_t>& q16, int nq, const std::vector<int16_t>& t16, int nt, int d) {
  Narrow w;
  w.t.resize(i8::PackedTargetsSize(nt, d));
  w.tn = i8::NarrowTargets(t16.data(), nt, d, w.t.data());
  w.q.resize(static_cast<size_t>(nq) * d), w.scale.resize(nq), w.norm.resize(nq), w.err.resize(nq);
  i8::NarrowQueries(q16.data(), nq, d, w.tn, w.q.data(), w.scale.data(), w.norm.data(), w.err.data());
  return w;
}

TEST_CASE("int8 stage: narrowing gives the defined words, exact norms and upper-bound error norms",
          "[merge][screen]") {
  if (!i8::Applies(128)) return;
  CHECK(i8::QueryScale(128) == 237);
  CHECK_FALSE(i8::Applies(8));  // d % 16
  CHECK(i8::Applies(48));
  for (int d : {16, 48, 128, 256}) {
    const int c = i8::QueryScale(d);
    for (int variant = 0; variant < 2; ++variant) {
      const int n = 21;
      std::vector<float> rows = UnitRows(n, d, 11 + d);
      if (variant == 1) {
        for (int k = 0; k < d; ++k) rows[k] = k == 3 ? 1.0f : 0.0f;       // a coordinate at 1: clamped
        for (int k = 0; k < d; ++k) rows[d + k] = k == 5 ? -1.0f : 0.0f;  // and −1
        for (int k = 0; k < d; ++k) rows[2 * d + k] = 0.0f;               // a zero row
        for (int k = 0; k < d; ++k) rows[3 * d + k] *= 1e-3f;             // a tiny row
      }
      Packed p = Pack(rows, n, rows, n, d);
      const Narrow w = NarrowAll(p.q, n, p.t, n, d);
      const uint8_t* bad = i8::Unusable(w.t.data(), n, d);
      const int16_t* rows16 = i8::Rows16(w.t.data(), n, d);
      int64_t max_n2 = 0;
      double max_e2 = 0;
      for (int r = 0; r < n; ++r) {
        int64_t qn2 = 0, qe2 = 0, tn2 = 0, te2 = 0;
        bool clamped = false;
        for (int k = 0; k < d; ++k) {
          const int16_t a = p.q[r * d + k], b = T16(p.t, d, r, k);
          CAPTURE(d, r, k, a, b);
          REQUIRE(w.q[r * d + k] == Word(c, a) + 128);
          REQUIRE(T8(w.t, d, r, k) == TWord(b));
          REQUIRE(rows16[r * d + k] == b);
          qn2 += Word(c, a) * Word(c, a), qe2 += Alpha(c, a) * Alpha(c, a);
          tn2 += TWord(b) * TWord(b), te2 += Beta(b) * Beta(b);
          clamped |= std::abs((kC * b + (1 << 13)) >> 14) > kTop;
        }
        CAPTURE(d, r);
        CHECK(w.scale[r] == c);
        CHECK(w.norm[r] >= std::sqrt(static_cast<double>(qn2)));
        CHECK(w.norm[r] <= std::sqrt(static_cast<double>(qn2)) * (1 + 1e-12));
        CHECK(w.err[r] >= std::sqrt(static_cast<double>(qe2)));
        CHECK(w.err[r] <= std::sqrt(static_cast<double>(qe2)) * (1 + 1e-4) + 1);
        const bool usable = !clamped;  // unit rows: never too long
        CHECK(((bad[r / 8] >> (r % 8)) & 1) == (usable ? 0 : 1));
        if (usable) max_n2 = std::max(max_n2, tn2), max_e2 = std::max(max_e2, static_cast<double>(te2));
      }
      if (variant == 1) CHECK((bad[0] & 3) == 3);  // the ±1 coordinates are clamped
      CHECK(w.tn.norm2 == max_n2);
      CHECK(w.tn.err2 >= max_e2);
      CHECK(w.tn.err2 <= max_e2 * (1 + 1e-4) + 1);
      for (int j = n; j < (n + 7) / 8 * 8; ++j)
        for (int k = 0; k < d; ++k) REQUIRE(T8(w.t, d, j, k) == 0);  // padding: zero words
    }
    // Rows too long for the int16 sums (int16 words of 2^14 everywhere): scale 0 (the block skips the stage).
    std::vector<int16_t> big(static_cast<size_t>(2) * d, 16384), t16(i16::PackedTargetsSize(1, d), 0);
    for (int k = 0; k < 4; ++k) t16[2 * (k / 2) * 8 + k % 2] = 8000;  // a usable target, ‖t‖ = 126
    const Narrow w = NarrowAll(big, 2, t16, 1, d);
    CHECK(w.scale[0] == 0);
  }
}

TEST_CASE("int8 stage: NarrowRows then RowScale is NarrowQueries (round 19)", "[merge][screen]") {
  if (!i8::Applies(128)) return;
  for (int d : {16, 48, 128}) {
    const int n = 13;
    std::vector<float> rows = UnitRows(n, d, 31 + d);
    for (int k = 0; k < d; ++k) rows[k] = k == 2 ? 1.0f : 0.0f;  // a clamped coordinate
    for (int k = 0; k < d; ++k) rows[d + k] = 0.0f;              // a zero row
    Packed p = Pack(rows, n, rows, n, d);
    // Rows 3 and 4 far too long for the targets below: NarrowQueries gives them scale, norm and err 0.
    for (int r : {3, 4})
      for (int k = 0; k < d; ++k) p.q[r * d + k] = static_cast<int16_t>(k % 3 == 0 ? 16384 : -9000);
    std::vector<int16_t> t16(i16::PackedTargetsSize(1, d), 0);
    for (int k = 0; k < 4; ++k) t16[2 * (k / 2) * 8 + k % 2] = 8000;  // one usable target, ‖t‖ = 126
    for (const std::vector<int16_t>& targets : {p.t, t16}) {
      const int nt = targets.size() == t16.size() ? 1 : n;
      const Narrow w = NarrowAll(p.q, n, targets, nt, d);
      std::vector<uint8_t> bytes(static_cast<size_t>(n) * d, 0xAB);
      std::vector<int32_t> norm2(n, -1);
      std::vector<double> norm(n, -1), err(n, -1);
      i8::NarrowRows(p.q.data(), n, d, bytes.data(), norm2.data(), norm.data(), err.data());
      CHECK(bytes == w.q);
      for (int r = 0; r < n; ++r) {
        CAPTURE(d, nt, r);
        int64_t qn2 = 0;
        for (int k = 0; k < d; ++k) qn2 += (bytes[r * d + k] - 128) * (bytes[r * d + k] - 128);
        CHECK(norm2[r] == qn2);
        const int scale = i8::RowScale(d, norm2[r], w.tn);
        CHECK(scale == w.scale[r]);
        CHECK((scale == 0) == (r == 3 || r == 4));
        if (scale > 0) {
          CHECK(norm[r] == w.norm[r]);  // bit for bit
          CHECK(err[r] == w.err[r]);
        }
      }
    }
  }
}

// Runs a test with the int8 kernel `kernel` (round 26: AVX2 or VNNI), the CPU's own choice restored after.
// False, with nothing changed, if the CPU does not run it.
struct KernelScope {
  i8::Kernel saved = i8::ChosenKernel();
  bool runs = false;
  explicit KernelScope(i8::Kernel kernel) {
    i8::SetKernelForTesting(kernel);
    runs = i8::ChosenKernel() == kernel;
  }
  ~KernelScope() { i8::SetKernelForTesting(saved); }
};

TEST_CASE("int8 stage: the VNNI kernel is the default wherever the CPU runs it (round 26)",
          "[merge][screen]") {
  if (!i8::Applies(128)) return;
  const bool vnni = CpuHas(CpuFeature::kAvx512f) && CpuHas(CpuFeature::kAvx512vnni);
  CHECK((i8::ChosenKernel() == i8::Kernel::kVnni) == vnni);
  const KernelScope avx2(i8::Kernel::kAvx2);
  CHECK(avx2.runs);
}

TEST_CASE(
    "int8 stage: the kernel's products are exact up to the Cauchy-Schwarz edge, every tail, and its "
    "block maxima leave out unusable and padding targets",
    "[merge][screen]") {
  if (!i8::Applies(128)) return;
  const KernelScope kernel(GENERATE(i8::Kernel::kAvx2, i8::Kernel::kVnni));
  if (!kernel.runs) return;
  for (int d : {16, 64, 128}) {
    const int c = i8::QueryScale(d);
    for (int nq : {1, 2, 3, 4, 5, 6, 7, 13})
      for (int nt : {1, 7, 8, 9, 17, 25, 32, 40, 57}) {
        std::vector<float> qf = UnitRows(nq, d, d + nq), tf = UnitRows(nt, d, 50 + d + nt);
        for (float& x : tf) x *= 0.5f;  // ‖t‖ ≈ 64: the edge query below stays within Cauchy-Schwarz
        Packed p = Pack(qf, nq, tf, nt, d);
        // Rows at the edge: target 0 = 64 on dimensions 0, 1, 4, 5 (one accumulator lane: ‖t‖ = 128), target
        // 1 its negation; query 0 = 127 on the same dimensions (‖q‖ = 254): P = ±32512 in one int16 lane,
        // with the bias wrapping around many times on the way.
        for (int k = 0; k < d; ++k) {
          const bool on = k == 0 || k == 1 || k == 4 || k == 5;
          p.q[k] = on ? static_cast<int16_t>(std::lround(127.0 * 16384 / c)) : 0;
        }
        std::vector<int16_t> rows(static_cast<size_t>(nt) * d);
        for (int j = 0; j < nt; ++j)
          for (int k = 0; k < d; ++k) rows[j * d + k] = T16(p.t, d, j, k);
        for (int j = 0; j < std::min(nt, 2); ++j)
          for (int k = 0; k < d; ++k) {
            const bool on = k == 0 || k == 1 || k == 4 || k == 5;
            rows[j * d + k] = on ? static_cast<int16_t>(j == 0 ? 8192 : -8192) : 0;
          }
        // The last target unusable (every word clamped), with a large P: the block maxima must leave it out.
        if (nt >= 3)
          for (int k = 0; k < d; ++k) rows[(nt - 1) * d + k] = 16384;
        std::vector<const int16_t*> ptr(nt);
        std::vector<double> err(nt, 0.0);
        for (int j = 0; j < nt; ++j) ptr[j] = &rows[j * d];
        i16::SpreadTargets(ptr.data(), err.data(), nt, d, p.t.data());
        const Narrow w = NarrowAll(p.q, nq, p.t, nt, d);
        const uint8_t* bad = i8::Unusable(w.t.data(), nt, d);
        if (nt >= 3) REQUIRE(((bad[(nt - 1) / 8] >> ((nt - 1) % 8)) & 1) == 1);
        const long ld = (nt + 7) / 8 * 8 + 3, bld = i8::BlockMaxStride(nt);
        std::vector<int32_t> out(static_cast<size_t>(nq) * ld, 12345), plain(out);
        std::vector<int32_t> bm(static_cast<size_t>(nq) * bld, 12345);
        i8::Dots(w.q.data(), nq, w.t.data(), nt, d, out.data(), ld, bm.data());
        i8::Dots(w.q.data(), nq, w.t.data(), nt, d, plain.data(), ld);
        CHECK(plain == out);
        bool unusable_above = false;  // the unusable target's P above its block's maximum (it matters)
        for (int r = 0; r < nq; ++r)
          for (int b = 0; b < bld / 8; ++b)
            for (int i = 0; i < 8; ++i) {
              int32_t want = INT32_MIN;
              for (int v = 0; v < 4; ++v) {
                const int j = 32 * b + 8 * v + i;
                if (j < nt && ((bad[j / 8] >> (j % 8)) & 1) == 0) want = std::max(want, out[r * ld + j]);
                if (j == nt - 1 && nt >= 3) unusable_above = unusable_above || out[r * ld + j] > want;
              }
              CAPTURE(i8::ChosenKernel() == i8::Kernel::kVnni, d, nq, nt, r, b, i);
              REQUIRE(bm[r * bld + 8 * b + i] == want);
            }
        if (nt > 32) CHECK(unusable_above);  // row 0's P with it is 32512, far above its block's others
        for (int r = 0; r < nq; ++r) {
          REQUIRE(w.scale[r] == c);
          for (int j = 0; j < nt; ++j) {
            if ((bad[j / 8] >> (j % 8)) & 1) continue;
            int32_t want = 0;
            for (int k = 0; k < d; ++k) want += Word(c, p.q[r * d + k]) * TWord(rows[j * d + k]);
            CAPTURE(i8::ChosenKernel() == i8::Kernel::kVnni, d, nq, nt, r, j);
            REQUIRE(out[r * ld + j] == want);
          }
        }
        CHECK(out[ld - 1] == 12345);  // the stride's tail untouched
        CHECK(out[0] == 32512);
        if (nt > 1) CHECK(out[1] == -32512);
      }
  }
}

// |c C S − 2^28 P| for one query row (scale c) and one target row of int16 words, and the bound E.
double Gap(int c, const int16_t* a, const int16_t* b, int d, double* e) {
  int64_t s = 0, p = 0;
  double na = 0, nb = 0, ra = 0, rb = 0;
  for (int k = 0; k < d; ++k) {
    s += int64_t{a[k]} * b[k];
    p += Word(c, a[k]) * TWord(b[k]);
    na += Word(c, a[k]) * Word(c, a[k]), nb += TWord(b[k]) * TWord(b[k]);
    ra += static_cast<double>(Alpha(c, a[k]) * Alpha(c, a[k])),
        rb += static_cast<double>(Beta(b[k]) * Beta(b[k]));
  }
  na = std::sqrt(na), nb = std::sqrt(nb), ra = std::sqrt(ra), rb = std::sqrt(rb);
  *e = 0x1p14 * (na * rb + ra * nb) + ra * rb;
  return std::abs(static_cast<double>(int64_t{c} * kC * s - (p << 28)));
}

TEST_CASE("int8 stage: the bound holds, and aligned rows reach it", "[merge][screen]") {
  const int d = 128;
  if (!i8::Applies(d)) return;
  const int c = i8::QueryScale(d);
  std::vector<float> q = UnitRows(40, d, 5), t = UnitRows(40, d, 6);
  Packed p = Pack(q, 40, t, 40, d);
  double worst = 0;
  for (int r = 0; r < 40; ++r)
    for (int j = 0; j < 40; ++j) {
      std::vector<int16_t> b(d);
      for (int k = 0; k < d; ++k) b[k] = T16(p.t, d, j, k);
      double e;
      const double gap = Gap(c, &p.q[r * d], b.data(), d, &e);
      REQUIRE(gap <= e);
      worst = std::max(worst, gap / e);
    }
  CHECK(worst < 0.5);  // random rows: far from the worst case
  // Aligned: every word a bit below a rounding boundary on both sides (q = 7, α ≈ +0.47 2^14; t = 15, β =
  // +0.49 2^14), so all three error terms add up: the bound is attained.
  std::vector<int16_t> a(d, static_cast<int16_t>(std::floor(7.47 * 16384 / c))), b(d, 128 * 15 + 63);
  REQUIRE(Word(c, a[0]) == 7);
  REQUIRE(Alpha(c, a[0]) > 7000);
  double e;
  const double gap = Gap(c, a.data(), b.data(), d, &e);
  CHECK(gap <= e);
  CHECK(gap >= 0.999 * e);
}

// Candidates with and without the int8 stage, for every query row; the stage's counts of groups computed
// are not visible, so the check is the list itself.
// Rows narrowed by int8::NarrowRows, stored last row first, with pointers in row order (row r at
// bytes[r], its norms at [r]).
struct Rows {
  std::vector<uint8_t> bytes;
  std::vector<int32_t> norm2;
  std::vector<double> norm, err;
  std::vector<const uint8_t*> at;
  i8::NarrowedRows rows;
};
Rows NarrowedReversed(const std::vector<int16_t>& q16, int nq, int d) {
  Rows w;
  std::vector<int16_t> rev(static_cast<size_t>(nq) * d);
  for (int r = 0; r < nq; ++r) std::copy_n(&q16[static_cast<size_t>(r) * d], d, &rev[(nq - 1 - r) * d]);
  std::vector<int32_t> n2(nq);
  std::vector<double> nn(nq), ne(nq);
  w.bytes.resize(static_cast<size_t>(nq) * d);
  i8::NarrowRows(rev.data(), nq, d, w.bytes.data(), n2.data(), nn.data(), ne.data());
  for (int r = 0; r < nq; ++r) {
    w.at.push_back(w.bytes.data() + static_cast<size_t>(nq - 1 - r) * d);
    w.norm2.push_back(n2[nq - 1 - r]), w.norm.push_back(nn[nq - 1 - r]), w.err.push_back(ne[nq - 1 - r]);
  }
  w.rows = {w.at.data(), w.norm2.data(), w.norm.data(), w.err.data()};
  return w;
}

void SameCandidates(const Packed& p, int nq, int nt, int d, const std::vector<int64_t>& slack,
                    const int64_t* floor) {
  std::vector<int8_t> t8(i8::PackedTargetsSize(nt, d));
  i16::Narrowed nw;
  nw.norms = i8::NarrowTargets(p.t.data(), nt, d, t8.data());
  nw.words = t8.data();
  std::vector<int> rows{-7}, idx{-7}, rows8{-7}, idx8{-7}, rows_pre{-7}, idx_pre{-7};
  i16::Candidates(p.q.data(), nq, p.t.data(), nt, d, slack.data(), &rows, &idx, floor);
  i16::Candidates(p.q.data(), nq, p.t.data(), nt, d, slack.data(), &rows8, &idx8, floor, &nw);
  REQUIRE(rows8 == rows);
  REQUIRE(idx8 == idx);
  // Round 19: the queries narrowed beforehand (int8::NarrowRows, stored in reverse row order and read
  // through row pointers, as merge.cc's unit keys are) give the same list again.
  const Rows pre = NarrowedReversed(p.q, nq, d);
  i16::Candidates(p.q.data(), nq, p.t.data(), nt, d, slack.data(), &rows_pre, &idx_pre, floor, &nw,
                  &pre.rows);
  REQUIRE(rows_pre == rows);
  REQUIRE(idx_pre == idx);
}

TEST_CASE("int8 stage: the int16 candidates are the same, target for target", "[merge][screen]") {
  if (!i8::Applies(128) || !i16::Supported()) return;
  const KernelScope kernel(GENERATE(i8::Kernel::kAvx2, i8::Kernel::kVnni));
  if (!kernel.runs) return;
  for (int d : {16, 64, 128}) {
    for (int nq : {1, 5, 6, 7, 13, 40})
      for (int nt : {1, 8, 9, 31, 64, 130, 300}) {
        std::vector<float> q = UnitRows(nq, d, 700 + nq + d), t = UnitRows(nt, d, 800 + nt + d);
        std::mt19937 g(nq * 1000 + nt + d);
        std::normal_distribution<float> tiny(0.0f, 1e-3f);
        // Near ties and duplicates: targets = queries + tiny noise, repeated; a zero target and a zero
        // query; a tiny query (1e-6 of unit length: its int16 words are mostly 0); targets = −query;
        // coordinates at ±1.
        for (int j = 0; j < nt; j += 3)
          for (int k = 0; k < d; ++k) t[j * d + k] = q[(j % nq) * d + k] + (j % 2 ? tiny(g) : 0.0f);
        for (int j = 1; j + 9 < nt; j += 9) std::copy_n(&t[j * d], d, &t[(j + 9) * d]);
        NormalizeRows(&t, d);
        if (nt > 4)
          for (int k = 0; k < d; ++k) t[4 * d + k] = 0.0f, t[(nt - 1) * d + k] = -q[k];
        if (nt > 2)
          for (int k = 0; k < d; ++k) t[2 * d + k] = k == 1 ? 1.0f : 0.0f;
        if (nq > 1)
          for (int k = 0; k < d; ++k) q[d + k] = 0.0f;
        if (nq > 2)
          for (int k = 0; k < d; ++k) q[2 * d + k] *= 1e-6f;
        if (nq > 3)
          for (int k = 0; k < d; ++k) q[3 * d + k] = k == 1 ? -1.0f : 0.0f;
        const Packed p = Pack(q, nq, t, nt, d);
        for (int64_t scale : {int64_t{-1}, int64_t{0}, int64_t{1}, int64_t{30}, int64_t{1} << 40}) {
          std::vector<int64_t> slack(nq);
          for (int r = 0; r < nq; ++r)
            slack[r] = scale < 0 ? i16::Slack(d, p.rq[r], p.rt) : scale * i16::Slack(d, p.rq[r], p.rt);
          CAPTURE(d, nq, nt, scale);
          SameCandidates(p, nq, nt, d, slack, nullptr);
          // Floors: none, the row's maximum S, a middle value, above every S, and the extremes.
          const long ld = i16::PaddedTargets(nt);
          std::vector<int32_t> s(static_cast<size_t>(nq) * ld);
          i16::Dots(p.q.data(), nq, p.t.data(), nt, d, s.data(), ld);
          std::vector<int64_t> floor(nq);
          for (int pick = 0; pick < 6; ++pick) {
            for (int r = 0; r < nq; ++r) {
              const int32_t* row = &s[r * ld];
              const int64_t m = *std::max_element(row, row + nt);
              const int64_t opts[] = {std::numeric_limits<int64_t>::min(),
                                      m,
                                      row[(r * 7) % nt] - 5000,
                                      m + 1,
                                      std::numeric_limits<int64_t>::max(),
                                      -(int64_t{1} << 31)};
              floor[r] = opts[(pick + r) % 6];
            }
            SameCandidates(p, nq, nt, d, slack, floor.data());
          }
        }
      }
  }
}

TEST_CASE("int8 stage: a near tie decided by the int8 rounding still reaches the exact check",
          "[merge][screen]") {
  // A query the int8 words hold almost exactly (A = 4079 on four dimensions: q = 59, α = 67 of 2^14), so the
  // error is the targets': target 3 (every word just below a rounding boundary, t = 15, β = +0.49 2^14: P
  // underestimates) has the larger S by one int16 unit; target 12 (three words at a boundary, rounded up
  // to t = 16, β = −0.5 2^14: P overestimates) the larger P, by 177 of a window of 2E 2^-28 ≈ 233. With
  // slack 0 the only int16 candidate is target 3; a window of E instead of 2E (≈ 117) would skip it.
  const int d = 128;
  if (!i8::Applies(d) || !i16::Supported() || i8::QueryScale(d) != 237) return;
  const int c = i8::QueryScale(d), nt = 16, nq = 1;
  Packed p;
  p.q.assign(d, 0);
  for (int k = 0; k < 4; ++k) p.q[k] = 4079;
  p.rq.assign(1, 0.0);
  std::vector<int16_t> rows(static_cast<size_t>(nt) * d, 0);
  for (int k = 0; k < 4; ++k) rows[3 * d + k] = 1983, rows[12 * d + k] = k < 3 ? 1984 : 1979;
  std::vector<const int16_t*> ptr(nt);
  std::vector<double> err(nt, 0.0);
  for (int j = 0; j < nt; ++j) ptr[j] = &rows[j * d];
  p.t.resize(i16::PackedTargetsSize(nt, d));
  i16::SpreadTargets(ptr.data(), err.data(), nt, d, p.t.data());
  int64_t s3 = 0, s12 = 0, p3 = 0, p12 = 0;
  for (int k = 0; k < d; ++k) {
    s3 += int64_t{p.q[k]} * rows[3 * d + k], s12 += int64_t{p.q[k]} * rows[12 * d + k];
    p3 += Word(c, p.q[k]) * TWord(rows[3 * d + k]), p12 += Word(c, p.q[k]) * TWord(rows[12 * d + k]);
  }
  REQUIRE(Word(c, 4079) == 59);
  REQUIRE(Alpha(c, 4079) == 67);
  REQUIRE(s3 == s12 + 4079);  // 3 is the int16 maximum ...
  REQUIRE(p12 == p3 + 177);   // ... 12 the int8 one
  std::vector<int64_t> slack{0};
  std::vector<int> r, idx;
  i16::Candidates(p.q.data(), nq, p.t.data(), nt, d, slack.data(), &r, &idx);
  CHECK(idx == std::vector<int>{3});
  SameCandidates(p, nq, nt, d, slack, nullptr);
  const int64_t f = s3;  // a floor at S_3: the same
  SameCandidates(p, nq, nt, d, slack, &f);
}

}  // namespace
}  // namespace kvsim
