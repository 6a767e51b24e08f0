#include "sim/select.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <vector>

namespace kvsim {

TEST_CASE("TopKIndices: largest scores, ascending indices, ties to the lower index", "[select]") {
  const std::vector<float> s{0.5f, 0.9f, 0.5f, 0.1f, 0.9f};
  CHECK(TopKIndices(s, 1) == std::vector<int32_t>{1});        // 0.9 at 1 and 4: the lower index wins
  CHECK(TopKIndices(s, 2) == std::vector<int32_t>{1, 4});     // both 0.9s, ascending
  CHECK(TopKIndices(s, 3) == std::vector<int32_t>{0, 1, 4});  // 0.5 at 0 and 2: index 0
  CHECK(TopKIndices(s, 4) == std::vector<int32_t>{0, 1, 2, 4});
  // All equal: the first k.
  const std::vector<float> flat(6, 1.0f);
  CHECK(TopKIndices(flat, 3) == std::vector<int32_t>{0, 1, 2});
}

TEST_CASE("TopKIndices: k is clamped to [0, n]", "[select]") {
  const std::vector<float> s{3, 1, 2};
  CHECK(TopKIndices(s, 0).empty());
  CHECK(TopKIndices(s, -5).empty());
  CHECK(TopKIndices(s, 3) == std::vector<int32_t>{0, 1, 2});
  CHECK(TopKIndices(s, 10) == std::vector<int32_t>{0, 1, 2});
  CHECK(TopKIndices(std::vector<float>{}, 2).empty());
}

TEST_CASE("TopKIndices matches a full stable sort on random data with many ties", "[select]") {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> level(0, 9);  // 10 distinct values: lots of ties
  for (int trial = 0; trial < 20; ++trial) {
    const int n = 1 + trial * 13;
    std::vector<float> s(n);
    for (float& x : s) x = 0.1f * static_cast<float>(level(rng));
    std::vector<int32_t> order(n);
    for (int i = 0; i < n; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return s[a] > s[b]; });
    for (int k : {0, 1, n / 3, n / 2, n}) {
      std::vector<int32_t> want(order.begin(), order.begin() + k);
      std::sort(want.begin(), want.end());
      CHECK(TopKIndices(s, k) == want);
    }
  }
}

TEST_CASE("SortDescendingNonNegative: hand case", "[select]") {
  std::vector<float> out;
  SortDescendingNonNegative(std::vector<float>{0.25f, 0.0f, 1.0f, 0.5f, 0.25f}, &out);
  CHECK(out == std::vector<float>{1.0f, 0.5f, 0.25f, 0.25f, 0.0f});
  SortDescendingNonNegative(std::vector<float>{}, &out);
  CHECK(out.empty());
}

TEST_CASE("SortDescendingNonNegative matches std::sort, with zeros, denormals and extremes", "[select]") {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::uniform_int_distribution<int> kind(0, 9);
  const float denorm = std::numeric_limits<float>::denorm_min();
  for (int trial = 0; trial < 10; ++trial) {
    const int n = trial * 997 + 1;
    std::vector<float> v(n);
    for (float& x : v) {
      switch (kind(rng)) {
        case 0:
          x = 0.0f;
          break;
        case 1:
          x = -0.0f;
          break;  // allowed: sorts as zero
        case 2:
          x = denorm * static_cast<float>(1 + static_cast<int>(u(rng) * 1000));
          break;
        case 3:
          x = std::numeric_limits<float>::min() * u(rng);
          break;  // subnormal range
        case 4:
          x = std::numeric_limits<float>::max() * u(rng);
          break;
        case 5:
          x = u(rng) * 1e-30f;
          break;
        default:
          x = u(rng);
          break;
      }
    }
    std::vector<float> want = v;
    std::sort(want.begin(), want.end(), std::greater<float>());
    std::vector<float> got;
    SortDescendingNonNegative(v, &got);
    REQUIRE(got.size() == want.size());
    for (int i = 0; i < n; ++i) REQUIRE(got[i] == want[i]);  // -0.0 == 0.0
  }
}

namespace {

// The reference: a full descending sort, then S[k] = (((0 + x_1) + x_2) + ... + x_k) in double.
std::vector<double> DescendingPrefix(std::vector<float> v) {
  std::sort(v.begin(), v.end(), std::greater<float>());
  std::vector<double> pre(v.size() + 1, 0.0);
  for (size_t i = 0; i < v.size(); ++i) pre[i + 1] = pre[i] + v[i];
  return pre;
}

// Checks SortForDescendingSums against the reference for several kmax; returns the tail's size at kmax 0.
size_t CheckDescendingSums(const std::vector<float>& v) {
  const std::vector<double> want = DescendingPrefix(v);
  const int n = static_cast<int>(v.size());
  size_t tail_size = 0;
  for (int kmax : {0, 1, n / 7, n / 2, n - 1, n, n + 3}) {
    std::vector<float> head, tail;
    double exact = -1;
    SortForDescendingSums(v, kmax, &head, &exact, &tail);
    const int k = std::clamp(kmax, 0, n);
    REQUIRE(static_cast<int>(head.size()) == k);
    double acc = 0;
    for (int i = 0; i < k; ++i) {
      acc += head[i];
      REQUIRE(acc == want[i + 1]);  // bit for bit
    }
    if (kmax >= n) {  // every value in head, S[n] its running sum
      REQUIRE(exact == 0);
      REQUIRE(tail.empty());
      continue;
    }
    double total = exact;
    for (size_t i = 0; i < tail.size(); ++i) {
      REQUIRE(tail[i] > 0.0f);
      if (i > 0) REQUIRE(tail[i] <= tail[i - 1]);
      total += tail[i];
    }
    REQUIRE(total == want[n]);  // bit for bit
    if (kmax == 0) tail_size = tail.size();
  }
  return tail_size;
}

}  // namespace

TEST_CASE("SortForDescendingSums: prefix sums and the total equal a full sort's, bit for bit", "[select]") {
  std::mt19937 rng(5);
  std::normal_distribution<float> logit(0.0f, 4.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::uniform_int_distribution<int> kind(0, 9);
  const float denorm = std::numeric_limits<float>::denorm_min();
  CheckDescendingSums({});
  CheckDescendingSums({0.0f});
  CheckDescendingSums({0.0f, -0.0f, 0.0f});
  CheckDescendingSums({0.5f});
  CheckDescendingSums({denorm, denorm, 3 * denorm});  // a sum far below 2^-126: every value is "big"
  for (int trial = 0; trial < 12; ++trial) {
    const int n = 1 + trial * 311;
    // Softmax-like rows over a wide range (exp of N(0, 4^2) logits, normalised in float), with zeros,
    // subnormals and ties mixed in.
    std::vector<float> v(n);
    double z = 0;
    for (float& x : v) {
      x = std::exp(logit(rng) * (trial % 3 == 0 ? 3.0f : 1.0f));
      z += x;
    }
    for (float& x : v) {
      x = static_cast<float>(x / z);
      switch (kind(rng)) {
        case 0:
          x = 0.0f;
          break;
        case 1:
          x = denorm * static_cast<float>(1 + static_cast<int>(u(rng) * 1000));
          break;
        case 2:
          x = 1e-3f;  // ties
          break;
        default:
          break;
      }
    }
    CheckDescendingSums(v);
  }
  // Sums far from 1: values up to 1e30, and values around 1e-35.
  for (float scale : {1e30f, 1e-35f}) {
    std::vector<float> v(2000);
    for (float& x : v) x = scale * std::exp(logit(rng) / 2.0f) * 1e-6f;
    CheckDescendingSums(v);
  }
}

TEST_CASE("SortForDescendingSums: a row with no value below 2^L needs no sort at kmax 0", "[select]") {
  // Values in [1, 2) / n: every one is far above 2^L (the sum's binade - 30), so the tail is empty and
  // S[n] is the exact sum (the early return), still equal to the sorted sum bit for bit.
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(1.0f, 2.0f);
  for (int n : {1, 7, 8, 9, 1000, 3409}) {
    std::vector<float> v(n);
    for (float& x : v) x = u(rng) / static_cast<float>(n);
    if (n > 8) v[3] = -0.0f;  // zeros of either sign add nothing
    CHECK(CheckDescendingSums(v) == 0);
  }
}

TEST_CASE("SortForDescendingSums: the small values' order matters and is kept", "[select]") {
  // One value of 1 and many of 2^-60 .. 2^-40: each small one is below half an ulp of the running sum
  // only in some orders, so the ascending and the descending sums differ; the function must give the
  // descending one, which needs the small values (all in the tail) sorted.
  std::vector<float> v{1.0f};
  std::mt19937 rng(9);
  std::uniform_int_distribution<int> ex(-60, -40);
  for (int i = 0; i < 3000; ++i) v.push_back(std::ldexp(1.0f + static_cast<float>(i % 7) / 8, ex(rng)));
  std::shuffle(v.begin(), v.end(), rng);
  std::vector<float> asc = v;
  std::sort(asc.begin(), asc.end());
  double ascending = 0;
  for (float x : asc) ascending += x;
  const std::vector<double> want = DescendingPrefix(v);
  REQUIRE(ascending != want.back());      // the data is order-sensitive
  CHECK(CheckDescendingSums(v) == 3000);  // every small value is in the tail
}

namespace {

int64_t topk_answered = 0;  // RowBuckets::TopK's answers in CheckDescendingSumsOfRowsOnce (not declined)

// DescendingSums on each row against the full sort's prefix sums, bit for bit: every k from -1 to n + 2 in
// one call (every bucket boundary a level, every bucket a selection), each k alone, and random sets of k
// with repeats (many runs asking the same k) in any order; with and without ExactKindSums' result (when it
// gives one). RowBuckets (the rows added to one structure, with and without ExactKindSums' result): its
// Sums on the same sets, and Kth for every k from 1 to n + 2 against the sort (always answered when the
// row has no nonzero value below 2^L), and with `topk` TopK for every k from 1 to n against the threshold
// scan. Returns how many rows took the rows-with-small-values path (TopKSums itself); adds the TopK answers
// to topk_answered.
int CheckDescendingSumsOfRowsOnce(const std::vector<std::vector<float>>& rows, bool topk) {
  std::mt19937 rng(5);
  int small = 0;
  RowBuckets with_known, alone;
  alone.AddRow(std::vector<float>{1.0f, 2.0f});  // a previous use, forgotten by Clear
  alone.Clear();
  std::vector<RowSums> knowns(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    const int n = static_cast<int>(rows[r].size());
    const bool exact = ExactKindSums(rows[r], std::vector<int32_t>{n}, std::vector<uint8_t>{0}, &knowns[r]);
    with_known.AddRow(rows[r], exact ? &knowns[r] : nullptr);
    alone.AddRow(rows[r]);
  }
  std::vector<float> scratch;
  for (size_t r = 0; r < rows.size(); ++r) {
    const std::vector<float>& v = rows[r];
    const int n = static_cast<int>(v.size());
    const std::vector<double> want = DescendingPrefix(v);
    auto expect = [&](int k) { return k <= 0 ? 0.0 : want[std::min(k, n)]; };
    RowSums known;
    const std::vector<int32_t> end{n};
    const std::vector<uint8_t> kind{0};
    const bool exact = ExactKindSums(v, end, kind, &known);
    small += !exact && !v.empty();
    std::vector<std::vector<int32_t>> sets;
    sets.emplace_back();
    for (int k = -1; k <= n + 2; ++k) sets.back().push_back(k);
    for (int k = 0; k <= n + 1; k += std::max(1, n / 40)) sets.push_back({k});
    for (int trial = 0; trial < 8; ++trial) {
      std::uniform_int_distribution<int> pick(0, n + 1), count(1, 12);
      std::vector<int32_t> ks(count(rng));
      for (int32_t& k : ks) k = pick(rng);
      ks.push_back(ks[0]);  // a repeat
      sets.push_back(ks);
    }
    std::vector<double> out;
    for (const std::vector<int32_t>& ks : sets)
      for (const RowSums* kn : std::vector<const RowSums*>{nullptr, exact ? &known : nullptr}) {
        for (int how = 0; how < 3; ++how) {  // DescendingSums, then RowBuckets::Sums alone and with `known`
          out.assign(ks.size(), -1.0);
          if (how == 0) DescendingSums(v, ks, kn, out.data());
          if (how == 1) alone.Sums(static_cast<int>(r), v, ks, kn, out.data());
          if (how == 2) with_known.Sums(static_cast<int>(r), v, ks, kn, out.data());
          for (size_t i = 0; i < ks.size(); ++i) {
            INFO("row " << r << " of n " << n << ", k " << ks[i] << " of " << ks.size()
                        << (kn ? ", known" : "") << ", way " << how);
            REQUIRE(out[i] == expect(ks[i]));
          }
        }
      }
    std::vector<float> sorted = v;
    std::sort(sorted.begin(), sorted.end(), std::greater<float>());
    for (int k = 1; k <= n + 2; ++k)
      for (const RowBuckets* b : {&alone, &with_known}) {
        INFO("row " << r << " of n " << n << ", Kth " << k);
        const std::optional<float> got = b->Kth(static_cast<int>(r), v, k, &scratch);
        if (exact) REQUIRE(got.has_value());
        if (got) REQUIRE(*got == (k <= n ? sorted[k - 1] : 0.0f));
        // TopK: the threshold scan's indices at that k-th value, on each path (AVX-512, AVX2, portable),
        // into a buffer holding a previous answer; answered whenever the k-th value lies above the lowest
        // bucket (bucket 0 holds the zeros).
        if (!topk || k > n) continue;
        const std::vector<int32_t> want = TopKIndicesWithThreshold(v, k, sorted[k - 1]);
        uint32_t uk;
        std::memcpy(&uk, &sorted[k - 1], 4);
        for (int path = 2; path >= 0; --path) {
          SetSelectAvx512ForTesting(path == 2);
          SetSelectAvx2ForTesting(path >= 1);
          std::vector<int32_t> idx{7, 7, 7};
          const bool answered = b->TopK(static_cast<int>(r), v, k, &scratch, &idx);
          SetSelectAvx512ForTesting(true);
          SetSelectAvx2ForTesting(true);
          INFO("TopK, path " << path);
          if (exact && (uk & 0x7fffffffu) >> 19 > 0) REQUIRE(answered);
          if (answered) REQUIRE(idx == want);
          topk_answered += answered;
        }
      }
  }
  return small;
}

// The same checks with the sums above each k's bucket taken both ways (split at each level; put in buckets)
// and chosen by the estimate: each way is taken (a set of every k has many levels: the buckets' way). Each
// with the splits in AVX-512 (on a CPU that has it) and without.
int CheckDescendingSumsOfRows(const std::vector<std::vector<float>>& rows) {
  int small = 0;
  for (bool avx512 : {true, false}) {
    SetSelectAvx512ForTesting(avx512);
    for (int mode : {1, 2, 0}) {
      INFO("SetBucketSumsForTesting(" << mode << "), AVX-512 allowed " << avx512);
      SetBucketSumsForTesting(mode);
      const int64_t before = BucketSumsRowsForTesting();
      small = CheckDescendingSumsOfRowsOnce(rows, avx512 && mode == 0);  // TopK on its three paths once
      const int64_t by_buckets = BucketSumsRowsForTesting() - before;
      if (mode == 1) CHECK(by_buckets == 0);
      if (mode != 1) CHECK(by_buckets > 0);
    }
  }
  SetSelectAvx512ForTesting(true);
  SetBucketSumsForTesting(0);
  return small;
}

// Adds the rows to one TopKSums (so that rows share its storage) at each kmax, and checks Sum(row, k) for
// every k in [0, min(kmax, n)] and beyond n against the reference, bit for bit: every bucket boundary,
// k = 0 and k = n included.
void CheckTopKSums(const std::vector<std::vector<float>>& rows) {
  std::vector<std::vector<double>> want;
  for (const auto& v : rows) want.push_back(DescendingPrefix(v));
  std::vector<float> scratch;
  for (int kfrac : {0, 1, 3, 7}) {  // kmax = n * kfrac / 7 (0: only the totals)
    TopKSums sums;
    sums.AddRow(std::vector<float>{1.0f, 2.0f}, 2);  // a previous use, forgotten by Clear
    sums.Clear();
    std::vector<int> kmax(rows.size());
    for (size_t r = 0; r < rows.size(); ++r) {
      const int n = static_cast<int>(rows[r].size());
      kmax[r] = n * kfrac / 7;
      REQUIRE(sums.AddRow(rows[r], kmax[r]) == want[r][n]);  // bit for bit
    }
    for (size_t r = 0; r < rows.size(); ++r) {
      const int n = static_cast<int>(rows[r].size());
      for (int k = 0; k <= kmax[r]; ++k) REQUIRE(sums.Sum(static_cast<int>(r), k, &scratch) == want[r][k]);
      REQUIRE(sums.Sum(static_cast<int>(r), n, &scratch) == want[r][n]);
      REQUIRE(sums.Sum(static_cast<int>(r), n + 5, &scratch) == want[r][n]);
      // Kth: the value a descending sort puts at k - 1 (zeros past n), for every k up to kmax; above kmax
      // it may be unavailable (a value below 2^L), never different.
      std::vector<float> sorted = rows[r];
      std::sort(sorted.begin(), sorted.end(), std::greater<float>());
      for (int k = 1; k <= n + 2; ++k) {
        const std::optional<float> v = sums.Kth(static_cast<int>(r), k, &scratch);
        const float expect = k <= n ? sorted[k - 1] : 0.0f;
        if (k <= kmax[r]) REQUIRE(v.has_value());
        if (v) REQUIRE(*v == expect);
      }
    }
  }
}

}  // namespace

TEST_CASE("TopKSums: every top-k sum equals a full sort's prefix sum, bit for bit", "[select]") {
  std::mt19937 rng(23);
  std::normal_distribution<float> logit(0.0f, 4.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::uniform_int_distribution<int> kind(0, 11);
  const float denorm = std::numeric_limits<float>::denorm_min();
  std::vector<std::vector<float>> rows{
      {},
      {0.0f},
      {0.0f, -0.0f, 0.0f},  // all zeros: the sum 0, no value is "big"
      {0.5f},
      {denorm, denorm, 3 * denorm, 0.0f},  // a sum far below 2^-126: every value (zeros too) is "big"
      {1.0f, 1.0f, 1.0f, 1.0f},            // one bucket of ties
  };
  // Values at and next to bucket boundaries (a power of two, the next float below it, 1 + 1/16 and below):
  // ties in one bucket, neighbours in two.
  {
    std::vector<float> v;
    for (int e = -20; e <= 0; ++e)
      for (float m : {1.0f, 1.0625f}) {
        const float x = std::ldexp(m, e);
        for (int rep = 0; rep < 3; ++rep) {
          v.push_back(x);
          v.push_back(std::nextafter(x, 0.0f));
        }
      }
    std::shuffle(v.begin(), v.end(), rng);
    rows.push_back(v);
  }
  for (int trial = 0; trial < 10; ++trial) {
    // Softmax-like rows over a wide range with zeros, subnormals, ties and negative zeros mixed in.
    const int n = 1 + trial * 353;
    std::vector<float> v(n);
    double z = 0;
    for (float& x : v) {
      x = std::exp(logit(rng) * (trial % 3 == 0 ? 3.0f : 1.0f));
      z += x;
    }
    for (float& x : v) {
      x = static_cast<float>(x / z);
      switch (kind(rng)) {
        case 0:
          x = 0.0f;
          break;
        case 1:
          x = denorm * static_cast<float>(1 + static_cast<int>(u(rng) * 1000));
          break;
        case 2:
          x = 1e-3f;  // ties
          break;
        case 3:
          x = -0.0f;
          break;
        default:
          break;
      }
    }
    rows.push_back(v);
  }
  // Sums far from 1: values up to 1e30, and values around 1e-35 (subnormal thresholds).
  for (float scale : {1e30f, 1e-35f}) {
    std::vector<float> v(1500);
    for (float& x : v) x = scale * std::exp(logit(rng) / 2.0f) * 1e-6f;
    rows.push_back(v);
  }
  // Sum's second level (a bucket of more than 48 values is split by the next 4 bits): one bucket of ~2000
  // values in [1, 1.0625) (every sub-bucket, ties at sub-bucket boundaries 1 + i/256 and the floats just
  // below them), with buckets above and below it; and a bucket of 100 ties (one sub-bucket holds all).
  {
    std::vector<float> v;
    std::uniform_real_distribution<float> in(1.0f, 1.0625f);
    for (int i = 0; i < 2000; ++i) v.push_back(in(rng));
    for (int sb = 0; sb < 16; ++sb) {
      const float x = 1.0f + static_cast<float>(sb) / 256.0f;
      v.insert(v.end(), {x, x, std::nextafter(x, 0.0f)});
    }
    for (int i = 0; i < 300; ++i) v.push_back(std::ldexp(in(rng), -1 - i % 12));
    for (int i = 0; i < 50; ++i) v.push_back(2.0f * in(rng));
    std::shuffle(v.begin(), v.end(), rng);
    rows.push_back(v);
    rows.push_back(std::vector<float>(100, 0.75f));
  }
  // An order-sensitive row: 1 and many values of 2^-60 .. 2^-40, all below the threshold (the tail).
  {
    std::vector<float> v{1.0f};
    std::uniform_int_distribution<int> ex(-60, -40);
    for (int i = 0; i < 1500; ++i) v.push_back(std::ldexp(1.0f + static_cast<float>(i % 7) / 8, ex(rng)));
    std::shuffle(v.begin(), v.end(), rng);
    rows.push_back(v);
  }
  CheckTopKSums(rows);
  const int64_t answered = topk_answered;
  CHECK(CheckDescendingSumsOfRows(rows) > 0);  // some rows hold nonzero values below 2^L
  CHECK(topk_answered - answered > 1000);      // RowBuckets::TopK answered (on each path)
}

TEST_CASE("TopKSums: rows of disjoint and extreme ranges, two structures interleaved on one thread",
          "[select]") {
  // AddRow keeps its per-bucket counts between rows (zeroed over the range a row touched): rows whose value
  // ranges are disjoint, overlapping or at the ends of the float range (sums so small that 2^L is
  // subnormal: no bucket boundary), added alternately to two structures, must each equal a full sort.
  std::mt19937 rng(7);
  std::normal_distribution<float> logit(0.0f, 3.0f);
  const float fmax = std::numeric_limits<float>::max(), denorm = std::numeric_limits<float>::denorm_min();
  std::vector<std::vector<float>> rows;
  for (float scale : {1.0f, 1e-20f, 1e20f, 1.0f, 1e-38f, 1e-42f, 1e28f}) {
    std::vector<float> v(700);
    for (float& x : v) x = scale * std::exp(logit(rng));
    rows.push_back(v);
  }
  rows.push_back({fmax / 4, fmax / 8, denorm, 0.0f, fmax / 4, 1.0f});  // the top bucket and bucket 0
  rows.push_back({0.0f, 0.0f, 1e-30f, 1.0f, 0.5f, 0.0f, 1e-20f});      // zeros and values below 2^L
  CheckDescendingSumsOfRows(rows);
  std::vector<std::vector<double>> want;
  for (const auto& v : rows) want.push_back(DescendingPrefix(v));
  for (int kfrac : {0, 1, 7}) {
    TopKSums even, odd;
    std::vector<int> kmax(rows.size());
    for (size_t r = 0; r < rows.size(); ++r) {
      const int n = static_cast<int>(rows[r].size());
      kmax[r] = n * kfrac / 7;
      REQUIRE((r % 2 == 0 ? even : odd).AddRow(rows[r], kmax[r]) == want[r][n]);
    }
    std::vector<float> scratch;
    for (size_t r = 0; r < rows.size(); ++r)
      for (int k = 0; k <= kmax[r]; ++k)
        REQUIRE((r % 2 == 0 ? even : odd).Sum(static_cast<int>(r / 2), k, &scratch) == want[r][k]);
  }
}

TEST_CASE("TopKSums: only the buckets down to the kmax-th value are kept, in groups; any kmax", "[select]") {
  // AddRow keeps the values of the buckets (by the bit pattern's top 12 bits without the sign) down to the
  // one holding the min(kmax, |big|)-th largest value, in up to kGroups groups of whole buckets with the
  // groups' exact sums; Sum scans the one group holding the k-th value. Every kmax from 0 to n + 1 on rows
  // whose lengths are not multiples of 8 (the AVX2 loops' tails), many rows in one structure (the groups'
  // spare places between rows), every k <= kmax against a full sort; Kth has every value up to the kept
  // count and none between it and |big| (the values there are not kept).
  std::mt19937 rng(41);
  std::normal_distribution<float> logit(0.0f, 2.5f);
  std::vector<std::vector<float>> rows;
  for (int n : {1, 7, 9, 61, 203, 517}) {
    std::vector<float> v(n);
    double z = 0;
    for (float& x : v) z += (x = std::exp(std::clamp(logit(rng), -6.0f, 6.0f)));
    for (float& x : v) x = static_cast<float>(x / z);
    for (int i = 0; i < n; i += 13) v[i] = v[(i * 7) % n];   // ties across buckets' members
    REQUIRE(*std::min_element(v.begin(), v.end()) > 2e-9f);  // none below 2^L (< 2^-29): |big| = n
    rows.push_back(v);
  }
  rows.push_back(std::vector<float>(77, 0.25f));  // one bucket: one group
  auto bucket = [](float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return (u & 0x7fffffffu) >> 19;
  };
  std::vector<float> scratch;
  for (int step : {1, 5}) {
    TopKSums sums;
    std::vector<std::pair<int, int>> added;  // (row, kmax) in the order added
    for (size_t r = 0; r < rows.size(); ++r) {
      const int n = static_cast<int>(rows[r].size());
      for (int kmax = 0; kmax <= n + 1; kmax += step) {
        REQUIRE(sums.AddRow(rows[r], kmax) == DescendingPrefix(rows[r])[n]);
        added.push_back({static_cast<int>(r), kmax});
      }
    }
    for (size_t a = 0; a < added.size(); ++a) {
      const auto& v = rows[added[a].first];
      const int n = static_cast<int>(v.size()), kmax = added[a].second;
      const std::vector<double> want = DescendingPrefix(v);
      std::vector<float> sorted = v;
      std::sort(sorted.begin(), sorted.end(), std::greater<float>());
      for (int k = 0; k <= std::min(kmax, n); ++k) {
        // Prefetch is a hint for any row and k (here the next row's, as the replay gives it, and out of
        // range): it reads only the row's bounds, never changes a result.
        for (int r : {static_cast<int>(a) + 1, -1, static_cast<int>(added.size())})
          for (int kk : {k, -1, 0, kmax + 1, n + 7}) sums.Prefetch(r, kk);
        REQUIRE(sums.Sum(static_cast<int>(a), k, &scratch) == want[k]);
      }
      // These rows have no value below 2^L: |big| = n. Kept: the values in the kmax-th value's bucket or
      // above.
      int kept = 0;
      if (kmax > 0 && n > 0)
        for (float x : v) kept += bucket(x) >= bucket(sorted[std::min(kmax, n) - 1]);
      for (int k = 1; k <= n; ++k) {
        const std::optional<float> got = sums.Kth(static_cast<int>(a), k, &scratch);
        REQUIRE(got.has_value() == (k <= kept));
        if (got) REQUIRE(*got == sorted[k - 1]);
      }
    }
  }
}

namespace {
// TopKIndicesWithThreshold's reference: every score above tau, then the lowest-indexed ties while k is not
// reached.
std::vector<int32_t> TwoBranchTopK(const std::vector<float>& s, int k, float tau) {
  int above = 0;
  for (float x : s) above += x > tau;
  int ties = k - above;
  std::vector<int32_t> idx;
  for (int32_t j = 0; j < static_cast<int32_t>(s.size()); ++j)
    if (s[j] > tau || (s[j] == tau && ties-- > 0)) idx.push_back(j);
  return idx;
}
}  // namespace

TEST_CASE("TopKIndicesWithThreshold equals the plain two-branch scan, for any threshold", "[select]") {
  std::mt19937 rng(17);
  std::uniform_int_distribution<int> level(0, 12);
  for (int trial = 0; trial < 40; ++trial) {
    const int n = 1 + trial * 37;
    std::vector<float> s(n);
    for (float& x : s) x = 0.25f * static_cast<float>(level(rng));
    std::vector<float> sorted = s;
    std::sort(sorted.begin(), sorted.end(), std::greater<float>());
    for (int k : {0, 1, n / 4, n / 2, n}) {
      // The k-th largest (the intended use), and thresholds above and below it (more or fewer taken).
      for (float tau : {k > 0 ? sorted[k - 1] : sorted[0], 0.0f, 1.5f, 3.0f, 10.0f}) {
        INFO("n " << n << " k " << k << " tau " << tau);
        CHECK(TopKIndicesWithThreshold(s, k, tau) == TwoBranchTopK(s, k, tau));
      }
    }
  }
}

TEST_CASE("TopKIndicesWithThreshold: the AVX-512, AVX2 and portable scans agree index for index",
          "[select]") {
  // Every tail length (n % 16 and n % 8), ties split across blocks, NaN (neither above nor equal), -0 equal
  // to +0, and thresholds at, above and below the k-th largest; each path also against the two-branch
  // reference. On a CPU without AVX-512 (or AVX2) the fast paths fall back to the next one.
  std::mt19937 rng(29);
  std::uniform_int_distribution<int> level(0, 5);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  int compared = 0;
  for (int n = 1; n <= 70; ++n) {  // every tail length of 16- and 8-blocks, and 1 .. 4 whole blocks
    for (int trial = 0; trial < 3; ++trial) {
      std::vector<float> s(n);
      for (float& x : s) {
        const int l = level(rng);
        x = l == 5 ? nan : l == 0 ? (rng() % 2 ? -0.0f : 0.0f) : 0.5f * static_cast<float>(l);
      }
      std::vector<float> finite;
      for (float x : s)
        if (!std::isnan(x)) finite.push_back(x);
      std::sort(finite.begin(), finite.end(), std::greater<float>());
      for (int k : {0, 1, n / 3, n / 2, n - 1, n}) {
        const int kk = std::clamp(k, 0, n);
        std::vector<float> taus = {0.0f, -0.0f, 1.0f, 2.5f, 9.0f, -1.0f};
        if (kk > 0 && kk <= static_cast<int>(finite.size())) taus.push_back(finite[kk - 1]);
        for (float tau : taus) {
          INFO("n " << n << " k " << k << " tau " << tau);
          const std::vector<int32_t> want = TwoBranchTopK(s, kk, tau);
          SetSelectAvx512ForTesting(false);
          SetSelectAvx2ForTesting(false);
          const std::vector<int32_t> portable = TopKIndicesWithThreshold(s, k, tau);
          SetSelectAvx2ForTesting(true);
          const std::vector<int32_t> avx2 = TopKIndicesWithThreshold(s, k, tau);
          SetSelectAvx512ForTesting(true);
          const std::vector<int32_t> fast = TopKIndicesWithThreshold(s, k, tau);
          CHECK(portable == want);
          CHECK(avx2 == want);
          CHECK(fast == want);
          ++compared;
        }
      }
    }
  }
  CHECK(compared > 1000);
}

TEST_CASE("FirstLowestAt picks the scan's slot on every path: ties, signed zeros, infinities, NaN",
          "[select]") {
  // The scan it replaces (h2o's eviction): the first slot whose score is strictly below every earlier pick.
  auto scan = [](const std::vector<float>& scores, const std::vector<int32_t>& idx, int n) {
    int best = 0;
    for (int i = 1; i < n; ++i)
      if (scores[idx[i]] < scores[idx[best]]) best = i;
    return best;
  };
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> levels = {0.25f, 0.5f, 0.5f, 1.0f, 3.0f, -0.0f, 0.0f, inf, nan, 1e-30f};
  std::mt19937 rng(17);
  int compared = 0, past_first_block = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 70), tokens = n + static_cast<int>(rng() % 40);
    std::vector<float> scores(tokens);
    const int spread = 1 + static_cast<int>(rng() % levels.size());  // few levels: many ties
    for (float& x : scores) x = levels[rng() % spread];
    if (trial % 5 == 0)
      for (float& x : scores) x = std::ldexp(1.0f + static_cast<float>(rng() % 1000) / 1000.0f, -(rng() % 8));
    if (trial % 11 == 0) scores[rng() % tokens] = nan;
    std::vector<int32_t> idx(n);
    for (int32_t& t : idx) t = static_cast<int32_t>(rng() % tokens);
    if (trial % 13 == 0) scores[idx[0]] = nan;  // kept by the scan
    const int want = scan(scores, idx, n);
    INFO("trial " << trial << " n " << n);
    SetSelectAvx2ForTesting(false);
    CHECK(FirstLowestAt(scores.data(), idx.data(), n) == want);
    SetSelectAvx2ForTesting(true);
    CHECK(FirstLowestAt(scores.data(), idx.data(), n) == want);
    past_first_block += want > 8;
    ++compared;
  }
  CHECK(compared == 3000);
  CHECK(past_first_block > 100);  // the lowest is often past the first block
}

TEST_CASE("TopKIndicesWithThreshold into a reused buffer equals a fresh selection, on every path",
          "[select]") {
  // The buffer one caller reuses at every step (oracle's): it arrives holding the previous selection, longer
  // or shorter than this one, with stale indices past its size; the result must not depend on any of that.
  std::mt19937 rng(41);
  std::uniform_int_distribution<int> level(0, 7);
  std::vector<int32_t> buf = {999, -5, 7};
  int compared = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 300);
    std::vector<float> s(n);
    for (float& x : s) x = 0.125f * static_cast<float>(level(rng));
    std::vector<float> sorted = s;
    std::sort(sorted.begin(), sorted.end(), std::greater<float>());
    const int k = static_cast<int>(rng() % (n + 1));
    const float tau = k > 0 ? sorted[k - 1] : sorted[0];
    if (trial % 7 == 0) buf.assign(rng() % 400, 12345);  // stale contents of any length
    for (int path = 0; path < 3; ++path) {
      SetSelectAvx512ForTesting(path == 2);
      SetSelectAvx2ForTesting(path >= 1);
      INFO("trial " << trial << " n " << n << " k " << k << " path " << path);
      const std::vector<int32_t> want = TwoBranchTopK(s, k, tau);
      TopKIndicesWithThreshold(s, k, tau, &buf);
      CHECK(buf == want);
      CHECK(TopKIndicesWithThreshold(s, k, tau) == want);
      ++compared;
    }
  }
  SetSelectAvx512ForTesting(true);
  SetSelectAvx2ForTesting(true);
  CHECK(compared == 600);
}

namespace {

// Random runs of kinds 0..3 covering [0, n) (lengths 1 .. 40, some of one value).
void RandomRuns(std::mt19937& rng, int n, std::vector<int32_t>* end, std::vector<uint8_t>* kind) {
  end->clear();
  kind->clear();
  std::uniform_int_distribution<int> len(1, 40), k(0, 3);
  for (int at = 0; at < n;) {
    at = std::min(n, at + (k(rng) == 0 ? 1 : len(rng)));
    end->push_back(at);
    kind->push_back(static_cast<uint8_t>(k(rng)));
  }
}

// ExactKindSums on both paths: when it accepts the row, every sum equals the sequential one (by kind in
// index order from +0.0, the total as a full descending sort's S[n] and as the index-order sum) and the
// bit patterns the row's; both paths accept the same rows. Returns whether it accepted.
bool CheckKindSums(const std::vector<float>& v, const std::vector<int32_t>& end,
                   const std::vector<uint8_t>& kind) {
  double want[4] = {}, in_order = 0;
  uint32_t umax = 0, umin = 0x7fffffffu, unz = 0;
  size_t at = 0;
  for (size_t r = 0; r < end.size(); ++r)
    for (; at < static_cast<size_t>(end[r]); ++at) {
      want[kind[r]] += v[at];
      in_order += v[at];
      uint32_t u;
      std::memcpy(&u, &v[at], 4);
      u &= 0x7fffffffu;
      umax = std::max(umax, u);
      umin = std::min(umin, u);
      if (u != 0 && (unz == 0 || u < unz)) unz = u;
    }
  if (v.empty()) umin = 0;
  bool accepted[2];
  for (bool avx2 : {true, false}) {
    SetKindSumsAvx2ForTesting(avx2);
    RowSums got;
    accepted[avx2] = ExactKindSums(v, end, kind, &got);
    SetKindSumsAvx2ForTesting(true);
    if (!accepted[avx2]) continue;
    INFO("avx2 " << avx2 << ", n " << v.size());
    for (int k = 0; k < 4; ++k) REQUIRE(got.kind[k] == want[k]);  // bit for bit
    REQUIRE(got.total == DescendingPrefix(v).back());
    REQUIRE(got.total == in_order);
    REQUIRE(got.umax == umax);
    REQUIRE(got.umin == umin);
    REQUIRE(got.unz == unz);
  }
  REQUIRE(accepted[0] == accepted[1]);
  return accepted[1];
}

}  // namespace

TEST_CASE("ExactKindSums: accepted rows' sums by kind and in all are the sequential ones, bit for bit",
          "[select]") {
  std::mt19937 rng(31);
  std::normal_distribution<float> logit(0.0f, 2.0f);
  const float denorm = std::numeric_limits<float>::denorm_min();
  std::vector<int32_t> end;
  std::vector<uint8_t> kind;
  // Hand rows: empty, zeros of either sign, one value, a sum far below 2^-126 (2^L subnormal: every value
  // counts as big, so accepted).
  for (const std::vector<float>& v : std::vector<std::vector<float>>{
           {}, {0.0f}, {0.0f, -0.0f, 0.0f}, {0.5f}, {denorm, denorm, 3 * denorm, 0.0f, 7 * denorm}}) {
    RandomRuns(rng, static_cast<int>(v.size()), &end, &kind);
    CHECK(CheckKindSums(v, end, kind));
  }
  int accepted = 0, refused = 0;
  for (int trial = 0; trial < 40; ++trial) {
    // Softmax rows (exp of N(0, s^2) logits normalised in float), lengths around the AVX2 blocks, with
    // zeros and negative zeros mixed in; every third trial one value put below 2^L (2^-40 of the sum, or
    // a subnormal), which the row must refuse (its order would matter), and sums far from 1.
    const int n = 1 + (trial * 97) % 700 + (trial % 5 == 0 ? 3400 : 0);
    std::vector<float> v(n);
    double z = 0;
    const float s = trial % 4 == 0 ? 4.0f : 1.0f;  // a wide row: some values below 2^L
    for (float& x : v) {
      x = std::exp(std::min(logit(rng) * s, 60.0f));
      z += x;
    }
    const float scale = trial % 7 == 3 ? 1e30f : trial % 7 == 5 ? 1e-35f : 1.0f;
    for (float& x : v) x = static_cast<float>(x / z) * scale;
    for (int i = 0; i < n; i += 13) v[i] = (i / 13) % 2 ? 0.0f : -0.0f;
    bool small = false;
    if (trial % 3 == 1 && n > 2) {
      v[n / 2] = trial % 2 ? std::ldexp(scale, -40) : denorm;
      small = true;
    }
    // Values below 2^L the softmax of a wide row makes itself: refused too (checked against the bound).
    double sum = 0;
    for (float x : v) sum += x;
    int e = 0;
    std::frexp(sum * (1.0 + 0x1p-20), &e);
    const float big = std::ldexp(1.0f, e - 30);
    bool below = false;
    for (float x : v) below = below || (x != 0.0f && x < big && big >= std::numeric_limits<float>::min());
    RandomRuns(rng, n, &end, &kind);
    INFO("trial " << trial);
    const bool ok = CheckKindSums(v, end, kind);
    CHECK(ok == !below);
    if (small && scale == 1.0f) CHECK(!ok);
    (ok ? accepted : refused)++;
  }
  CHECK(accepted > 10);
  CHECK(refused > 5);
  // A value below -0, an infinity or a NaN: refused.
  for (float bad :
       {-1e-3f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> v(100, 0.01f);
    v[57] = bad;
    RandomRuns(rng, 100, &end, &kind);
    CHECK(!CheckKindSums(v, end, kind));
  }
}

TEST_CASE("TopKSums: AddRow with ExactKindSums' result equals AddRow alone", "[select]") {
  // The known total and bit patterns replace AddRow's first pass: every S[k], Kth and total the same, for
  // rows with and without zeros, kmax from 0 to n, interleaved with rows added without them.
  std::mt19937 rng(37);
  std::normal_distribution<float> logit(0.0f, 3.0f);
  TopKSums with, without;
  std::vector<std::vector<float>> rows;
  std::vector<int> kmaxes;
  std::vector<float> scratch;
  for (int trial = 0; trial < 24; ++trial) {
    const int n = trial == 0 ? 0 : 1 + (trial * 151) % 900;
    std::vector<float> v(n);
    double z = 0;
    for (float& x : v) z += (x = std::exp(logit(rng)));
    for (float& x : v) x = static_cast<float>(x / z);
    if (trial % 2)
      for (int i = 0; i < n; i += 5) v[i] = 0.0f;
    if (trial == 1) std::fill(v.begin(), v.end(), 0.0f);
    const std::vector<int32_t> end{n};
    const std::vector<uint8_t> kind{0};
    RowSums known;
    const int kmax = trial % 4 == 0 ? 0 : trial % 4 == 1 ? n : (trial * 37) % (n + 1);
    const double a = without.AddRow(v, kmax);
    double b;
    if (ExactKindSums(v, end, kind, &known)) {
      b = with.AddRow(v, kmax, &known);
    } else {
      b = with.AddRow(v, kmax);
    }
    REQUIRE(a == b);
    rows.push_back(v);
    kmaxes.push_back(kmax);
  }
  for (size_t r = 0; r < rows.size(); ++r) {
    const int n = static_cast<int>(rows[r].size());
    const std::vector<double> pre = DescendingPrefix(rows[r]);
    for (int k = 0; k <= std::min(kmaxes[r], n); ++k) {
      INFO("row " << r << " k " << k);
      REQUIRE(with.Sum(static_cast<int>(r), k, &scratch) == pre[k]);
      REQUIRE(with.Sum(static_cast<int>(r), k, &scratch) == without.Sum(static_cast<int>(r), k, &scratch));
      if (k >= 1)
        REQUIRE(with.Kth(static_cast<int>(r), k, &scratch) == without.Kth(static_cast<int>(r), k, &scratch));
    }
  }
}

}  // namespace kvsim
