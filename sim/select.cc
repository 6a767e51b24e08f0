#include "sim/select.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>

#include "sim/cpu.h"
#include "sim/status.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

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

namespace {

#if defined(__x86_64__) && defined(__GNUC__)
#define KVSIM_SELECT_AVX512 1
const bool kSelectAvx512 = CpuHas(CpuFeature::kAvx512f);
std::atomic<bool> g_select_avx512_allowed{true};

// How many scores are above tau (the portable count's ordered comparison, 16 at a time).
__attribute__((target("avx512f"))) int CountAboveAvx512(const float* scores, int n, float tau) {
  const __m512 t = _mm512_set1_ps(tau);
  int above = 0;
  for (int b = 0; b < n; b += 16) {
    const __mmask16 in = n - b >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - b)) - 1);
    above +=
        __builtin_popcount(_mm512_mask_cmp_ps_mask(in, _mm512_maskz_loadu_ps(in, scores + b), t, _CMP_GT_OQ));
  }
  return above;
}

// The portable scan's result, 16 scores at a time: a comparison mask per block (the same ordered
// comparisons: a NaN is neither above nor equal), the block's ties limited to the lowest `ties` of them, and
// the taken indices compressed in order into idx (which has 16 spare elements past `most`). Integer work
// only, so the indices are the portable scan's on any build. The index of scores[i] is i, or from[i] when
// `from` is given (RowBuckets::TopK's candidates; from may be idx: each block is loaded before its store,
// which ends at or before the block's end).
__attribute__((target("avx512f"))) int TakeAboveAvx512(const float* scores, int n, float tau, int ties,
                                                       int most, const int32_t* from, int32_t* idx) {
  const __m512 t = _mm512_set1_ps(tau);
  const __m512i step = _mm512_set1_epi32(16);
  __m512i j = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int m = 0;
  for (int b = 0; b < n && m < most; b += 16, j = _mm512_add_epi32(j, step)) {
    const __mmask16 in = n - b >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - b)) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(in, scores + b);
    const __mmask16 gt = _mm512_mask_cmp_ps_mask(in, s, t, _CMP_GT_OQ);
    unsigned eq = 0;
    if (ties > 0) {
      eq = _mm512_mask_cmp_ps_mask(in, s, t, _CMP_EQ_OQ);
      int c = __builtin_popcount(eq);
      while (c > ties) {  // keep the lowest `ties` equal scores: drop the highest until that many are left
        eq &= ~(1u << (31 - __builtin_clz(eq)));
        --c;
      }
      ties -= c;
    }
    const __mmask16 take = static_cast<__mmask16>(gt | eq);
    _mm512_storeu_si512(idx + m,
                        _mm512_maskz_compress_epi32(take, from ? _mm512_maskz_loadu_epi32(in, from + b) : j));
    m += __builtin_popcount(take);
  }
  return m;
}

// The same scan on AVX2 (a CPU without AVX-512, e.g. Zen 3), 8 scores at a time: the ordered comparisons'
// masks by movemask, the tail block's lanes past n masked off (maskload reads no memory for them), and the
// taken indices compressed by a table of the set bits' places (a block's 8-bit mask -> 8 byte offsets).
const bool kSelectAvx2 = CpuHas(CpuFeature::kAvx2);
std::atomic<bool> g_select_avx2_allowed{true};

// kSetBits[m]: the places of m's set bits, ascending, one byte each (the rest 0).
struct SetBitsTable {
  uint64_t at[256];
  constexpr SetBitsTable() : at() {
    for (int m = 0; m < 256; ++m) {
      uint64_t v = 0;
      for (int b = 0, c = 0; b < 8; ++b)
        if (m >> b & 1) v |= static_cast<uint64_t>(b) << (8 * c++);
      at[m] = v;
    }
  }
};
constexpr SetBitsTable kSetBits;

__attribute__((target("avx2,popcnt"))) inline __m256 LoadBlock8(const float* p, int left) {
  if (left >= 8) return _mm256_loadu_ps(p);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(left), lane));
}

__attribute__((target("avx2,popcnt"))) int CountAboveAvx2(const float* scores, int n, float tau) {
  const __m256 t = _mm256_set1_ps(tau);
  __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();  // per lane: minus the count
  int b = 0;
  for (; b + 16 <= n; b += 16) {
    acc0 = _mm256_add_epi32(acc0,
                            _mm256_castps_si256(_mm256_cmp_ps(_mm256_loadu_ps(scores + b), t, _CMP_GT_OQ)));
    acc1 = _mm256_add_epi32(
        acc1, _mm256_castps_si256(_mm256_cmp_ps(_mm256_loadu_ps(scores + b + 8), t, _CMP_GT_OQ)));
  }
  int above = 0;
  for (; b < n; b += 8) {  // the last 1 .. 15 scores
    const unsigned in = n - b >= 8 ? 0xFFu : (1u << (n - b)) - 1;
    above += __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(
                                    _mm256_cmp_ps(LoadBlock8(scores + b, n - b), t, _CMP_GT_OQ))) &
                                in);
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi32(acc0, acc1));
  for (int l = 0; l < 8; ++l) above -= lanes[l];
  return above;
}

__attribute__((target("avx2,popcnt"))) int TakeAboveAvx2(const float* scores, int n, float tau, int ties,
                                                         int most, int32_t* idx) {
  const __m256 t = _mm256_set1_ps(tau);
  int m = 0;
  for (int b = 0; b < n && m < most; b += 8) {
    const unsigned in = n - b >= 8 ? 0xFFu : (1u << (n - b)) - 1;
    const __m256 s = LoadBlock8(scores + b, n - b);
    const unsigned gt = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(s, t, _CMP_GT_OQ))) & in;
    unsigned eq = 0;
    if (ties > 0) {
      eq = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(s, t, _CMP_EQ_OQ))) & in;
      int c = __builtin_popcount(eq);
      while (c > ties) {  // keep the lowest `ties` equal scores: drop the highest until that many are left
        eq &= ~(1u << (31 - __builtin_clz(eq)));
        --c;
      }
      ties -= c;
    }
    const unsigned take = gt | eq;
    const __m256i at = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(kSetBits.at[take])));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx + m), _mm256_add_epi32(_mm256_set1_epi32(b), at));
    m += __builtin_popcount(take);
  }
  return m;
}
#endif

}  // namespace

void SetSelectAvx512ForTesting(bool allowed) {
#ifdef KVSIM_SELECT_AVX512
  g_select_avx512_allowed.store(allowed, std::memory_order_relaxed);
#else
  (void)allowed;
#endif
}

void SetSelectAvx2ForTesting(bool allowed) {
#ifdef KVSIM_SELECT_AVX512
  g_select_avx2_allowed.store(allowed, std::memory_order_relaxed);
#else
  (void)allowed;
#endif
}

std::vector<int32_t> TopKIndicesWithThreshold(std::span<const float> scores, int k, float tau) {
  std::vector<int32_t> idx;
  TopKIndicesWithThreshold(scores, k, tau, &idx);
  return idx;
}

void TopKIndicesWithThreshold(std::span<const float> scores, int k, float tau, std::vector<int32_t>* out) {
  // Takes every score above tau and the first k - above equal to it in index order (more than k if tau is
  // below the k-th largest, as before), ascending. The scans write up to one register of indices past the
  // last taken one, so *out is first grown to hold them (within its capacity once it has grown: no
  // allocation; the part past the previous call's count is zero-filled again, then overwritten).
  const int n = static_cast<int>(scores.size());
  k = std::clamp(k, 0, n);
  std::vector<int32_t>& idx = *out;
  auto room = [&](size_t len) {
    if (idx.size() < len) idx.resize(len);
  };
#ifdef KVSIM_SELECT_AVX512
  if (kSelectAvx512 && g_select_avx512_allowed.load(std::memory_order_relaxed)) {
    const int above = CountAboveAvx512(scores.data(), n, tau), most = std::max(k, above);
    room(static_cast<size_t>(most) + 16);
    idx.resize(
        static_cast<size_t>(TakeAboveAvx512(scores.data(), n, tau, k - above, most, nullptr, idx.data())));
    return;
  }
  if (kSelectAvx2 && g_select_avx2_allowed.load(std::memory_order_relaxed)) {
    const int above = CountAboveAvx2(scores.data(), n, tau), most = std::max(k, above);
    room(static_cast<size_t>(most) + 8);
    idx.resize(static_cast<size_t>(TakeAboveAvx2(scores.data(), n, tau, k - above, most, idx.data())));
    return;
  }
#endif
  int above = 0;
  for (float s : scores) above += s > tau;
  const int most = std::max(k, above);
  // One in-order scan without branches (whether a score is taken is data-dependent and unpredictable):
  // every index is written at the next free place, which advances only when the index is taken; one
  // spare element takes the last write.
  room(static_cast<size_t>(most) + 1);
  int m = 0, ties = k - above;
  for (int32_t j = 0; j < n && m < most; ++j) {
    const float s = scores[j];
    const int tie = (s == tau) & (ties > 0);
    idx[m] = j;
    m += (s > tau) | tie;
    ties -= tie;
  }
  idx.resize(m);
}

namespace {

#ifdef KVSIM_SELECT_AVX512
// FirstLowestAt 8 slots at a time: lane j keeps the lowest score of the slots i = j (mod 8) it has seen and
// the first slot holding it (a strict comparison, from +inf with no slot), then the lanes are combined.
// Returns -1 when no lane saw a score below +inf. A NaN never compares below (the caller returns slot 0
// when slot 0's score is NaN, as the scan does).
__attribute__((target("avx2"))) int FirstLowestAtAvx2(const float* scores, const int32_t* idx, int n) {
  __m256 best = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256i at = _mm256_set1_epi32(-1), i = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i eight = _mm256_set1_epi32(8);
  int b = 0;
  for (; b + 8 <= n; b += 8, i = _mm256_add_epi32(i, eight)) {
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + b));
    const __m256 x = _mm256_i32gather_ps(scores, t, 4);
    const __m256 lt = _mm256_cmp_ps(x, best, _CMP_LT_OQ);
    best = _mm256_blendv_ps(best, x, lt);
    at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(i), lt));
  }
  alignas(32) float bv[8];
  alignas(32) int32_t ba[8];
  _mm256_store_ps(bv, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(ba), at);
  int victim = -1;
  float v = std::numeric_limits<float>::infinity();
  for (int j = 0; j < 8; ++j)
    if (ba[j] >= 0 && (bv[j] < v || (bv[j] == v && ba[j] < victim))) {
      v = bv[j];
      victim = ba[j];
    }
  for (; b < n; ++b)  // the tail: later slots, taken only when strictly lower
    if (scores[idx[b]] < v) {
      v = scores[idx[b]];
      victim = b;
    }
  return victim;
}
#endif

}  // namespace

int FirstLowestAt(const float* scores, const int32_t* idx, int n) {
  KVSIM_CHECK(n > 0);
  if (std::isnan(scores[idx[0]])) return 0;  // never replaced
#ifdef KVSIM_SELECT_AVX512
  if (n >= 16 && kSelectAvx2 && g_select_avx2_allowed.load(std::memory_order_relaxed)) {
    // The first slot holding the lowest score; -1: every score is +inf or NaN, and slot 0's is +inf.
    const int victim = FirstLowestAtAvx2(scores, idx, n);
    return victim < 0 ? 0 : victim;
  }
#endif
  int victim = 0;
  float low = scores[idx[0]];
  for (int i = 1; i < n; ++i)
    if (scores[idx[i]] < low) {
      low = scores[idx[i]];
      victim = i;
    }
  return victim;
}

namespace {

constexpr int kBits = 11, kBuckets = 1 << kBits, kPasses = 3;

// Sorts the keys a[0, n) ascending (LSD radix, 3 passes of 11 bits; the three digits' histograms are
// counted in one pass, and a digit shared by every key skips its pass). `b` is scratch of size >= n.
void RadixSortKeys(std::vector<uint32_t>& a, std::vector<uint32_t>& b, size_t n) {
  size_t count[kPasses][kBuckets + 1] = {};
  for (size_t i = 0; i < n; ++i)
    for (int p = 0; p < kPasses; ++p) ++count[p][((a[i] >> (p * kBits)) & (kBuckets - 1)) + 1];
  for (int p = 0; p < kPasses; ++p) {
    size_t* c = count[p];
    if (c[((n == 0 ? 0 : a[0]) >> (p * kBits) & (kBuckets - 1)) + 1] == n) continue;  // one bucket
    for (int k = 0; k < kBuckets; ++k) c[k + 1] += c[k];
    const int shift = p * kBits;
    for (size_t i = 0; i < n; ++i) b[c[(a[i] >> shift) & (kBuckets - 1)]++] = a[i];
    a.swap(b);
  }
}

// Non-negative IEEE floats order like their bit patterns; ~bits ascending = values descending.
uint32_t DescendingKey(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  KVSIM_CHECK((u >> 31) == 0 || u == 0x80000000u);
  return ~(u & 0x7fffffffu);
}

float KeyValue(uint32_t key) {
  const uint32_t u = ~key;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// The sum of values[0, n) in double (8 lanes, combined in a fixed order: an upper bound of the descending
// sum to within n * 2^-53, relative), the largest value's bit pattern (-0 as +0) and the smallest nonzero
// one's (0 when every value is a zero), in two loops that
// vectorise (as unsigned integers, the bit patterns of non-negative floats order like their values, and
// every negative one but -0 lies above 0x80000000). Checks that no value is below -0 and that the sum is
// finite (a NaN or an infinity makes it NaN or infinite). `who` names the caller in the messages.
double SumAndMax(std::span<const float> values, uint32_t* umax, uint32_t* umin, const char* who) {
  const size_t n = values.size();
  uint32_t m8[8] = {}, r8[8] = {};  // per lane: the largest magnitude's and the largest raw bit pattern
  uint32_t z8[8];                   // per lane: the smallest nonzero magnitude's bit pattern, minus 1
  std::fill_n(z8, 8, ~0u);
  double s8[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) {
      uint32_t u;
      std::memcpy(&u, &values[i + l], 4);
      m8[l] = std::max(m8[l], u & 0x7fffffffu);
      r8[l] = std::max(r8[l], u);
      z8[l] = std::min(z8[l], (u & 0x7fffffffu) - 1);  // a zero wraps to ~0
    }
  for (size_t j = 0; j < i; j += 8)
    for (int l = 0; l < 8; ++l) s8[l] += values[j + l];
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &values[i], 4);
    m8[0] = std::max(m8[0], u & 0x7fffffffu);
    r8[0] = std::max(r8[0], u);
    z8[0] = std::min(z8[0], (u & 0x7fffffffu) - 1);
    s8[0] += values[i];
  }
  uint32_t mx = 0, raw = 0, mn = ~0u;
  for (int l = 0; l < 8; ++l) {
    mx = std::max(mx, m8[l]);
    raw = std::max(raw, r8[l]);
    mn = std::min(mn, z8[l]);
  }
  *umin = mn + 1;  // 0 when every value is a zero
  KVSIM_CHECK_MSG(raw <= 0x80000000u, std::string(who) + ": values must be non-negative");
  const double sum = ((s8[0] + s8[1]) + (s8[2] + s8[3])) + ((s8[4] + s8[5]) + (s8[6] + s8[7]));
  KVSIM_CHECK_MSG(std::isfinite(sum), std::string(who) + ": values must be finite");
  *umax = mx;
  return sum;
}

}  // namespace

void SortDescendingNonNegative(std::span<const float> values, std::vector<float>* out) {
  // The keys' buffers are per thread (the engine calls this once per attention row).
  const size_t n = values.size();
  thread_local std::vector<uint32_t> a, b;
  a.resize(n);
  b.resize(n);
  for (size_t i = 0; i < n; ++i) a[i] = DescendingKey(values[i]);
  RadixSortKeys(a, b, n);
  out->resize(n);
  for (size_t i = 0; i < n; ++i) (*out)[i] = KeyValue(a[i]);
}

void SortForDescendingSums(std::span<const float> values, int kmax, std::vector<float>* head,
                           double* exact_sum, std::vector<float>* tail) {
  const size_t n = values.size();
  const size_t k = static_cast<size_t>(std::clamp<int64_t>(kmax, 0, static_cast<int64_t>(n)));
  thread_local std::vector<uint32_t> a, b;
  a.resize(n);
  b.resize(n);
  if (k == n) {  // everything is sorted anyway: S[n] is head's running sum
    for (size_t i = 0; i < n; ++i) a[i] = DescendingKey(values[i]);
    RadixSortKeys(a, b, n);
    head->resize(n);
    for (size_t i = 0; i < n; ++i) (*head)[i] = KeyValue(a[i]);
    *exact_sum = 0;
    tail->clear();
    return;
  }
  // Pass 1: an upper bound of the sum, the sign check and, when k > 0, the histogram of the keys' top
  // digit (for the k largest). No key is stored: pass 2 recomputes them (cheaper than a store and a load).
  constexpr int kTop = 2 * kBits;  // the top digit: key bits [22, 32)
  size_t top[kBuckets] = {};
  double sum = 0;
  uint32_t umin = 1;  // the smallest nonzero value's bit pattern (when k = 0)
  size_t i = 0;
  if (k > 0) {
    double s4[4] = {};
    uint32_t negative = 0;  // any value below -0
    // Four lanes unrolled by hand: indexing the partial sums by i & 3 kept them in memory (a store and a
    // reload per value on the critical path).
    for (; i + 4 <= n; i += 4)
      for (int l = 0; l < 4; ++l) {
        uint32_t u;
        std::memcpy(&u, &values[i + l], 4);
        negative |= u > 0x80000000u;
        ++top[(~(u & 0x7fffffffu)) >> kTop];
        s4[l] += values[i + l];
      }
    for (; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, &values[i], 4);
      negative |= u > 0x80000000u;
      ++top[(~(u & 0x7fffffffu)) >> kTop];
      s4[0] += values[i];
    }
    KVSIM_CHECK_MSG(!negative, "SortForDescendingSums: values must be non-negative");
    sum = (s4[0] + s4[1]) + (s4[2] + s4[3]);
    KVSIM_CHECK_MSG(std::isfinite(sum), "SortForDescendingSums: values must be finite");
  } else {
    uint32_t umax;
    sum = SumAndMax(values, &umax, &umin, "SortForDescendingSums");
  }
  // The computed sum is within n * 2^-53 (relative) of the true one: 2^-20 of headroom covers n < 2^30.
  int e = 0;
  std::frexp(sum * (1.0 + 0x1p-20), &e);        // sum * (1 + 2^-20) < 2^e
  const float big = std::ldexp(1.0f, e - 30);   // 2^L; 0 when L is below the smallest subnormal
  const uint32_t big_key = DescendingKey(big);  // values >= big: keys <= big_key
  // The k largest values all have a top digit of at most `cut`, the bucket that holds the k-th largest.
  int cut = -1;
  for (size_t c = 0, seen = 0; seen < k; ++c) {
    seen += top[c];
    cut = static_cast<int>(c);
  }
  if (k == 0 && (umin == 0 || umin >= ~big_key)) {
    // Every nonzero value is >= 2^L (the usual case for softmax rows): S[n] is their exact sum, and pass 1
    // has added them already (each lane's sum and the lanes' combination are exact, as any order is).
    *exact_sum = sum;
    head->clear();
    tail->clear();
    return;
  }
  // Pass 2: gather the keys to sort (the top digits up to `cut`, and the nonzero values below 2^L) and
  // sum the values >= 2^L (exact: any order).
  // The exact sum first (a branch-free map and reduction: it vectorises), then the gather (sequential).
  double e4[4] = {};
  for (i = 0; i + 4 <= n; i += 4)
    for (int l = 0; l < 4; ++l) e4[l] += values[i + l] >= big ? static_cast<double>(values[i + l]) : 0.0;
  for (; i < n; ++i) e4[0] += values[i] >= big ? static_cast<double>(values[i]) : 0.0;
  size_t m = 0;
  const uint32_t zero_key = ~0u;
  if (k > 0) {
    for (i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, &values[i], 4);
      const uint32_t key = ~(u & 0x7fffffffu);
      b[m] = key;
      m += static_cast<int>(key >> kTop) <= cut || (key > big_key && key != zero_key);
    }
  } else {  // only the nonzero values below 2^L, usually few: a branch predicted right is cheaper than a
            // store of every key
    for (i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, &values[i], 4);
      const uint32_t key = ~(u & 0x7fffffffu);
      if (key > big_key && key != zero_key) b[m++] = key;
    }
  }
  *exact_sum = (e4[0] + e4[1]) + (e4[2] + e4[3]);
  a.swap(b);
  RadixSortKeys(a, b, m);
  head->resize(k);
  for (size_t j = 0; j < k; ++j) (*head)[j] = KeyValue(a[j]);
  tail->clear();
  for (size_t j = 0; j < m; ++j)
    if (a[j] > big_key && a[j] != zero_key) tail->push_back(KeyValue(a[j]));
}

void TopKSums::Clear() {
  rows_.clear();
  elems_used_ = 0;  // elems_ keeps its size: rows overwrite what they use
  cc_.clear();
  tail_.clear();
  tailv_.clear();
}

void TopKSums::Reserve(int rows, size_t values) {
  rows_.reserve(rows);
  elems_.reserve(values);
  cc_.reserve(static_cast<size_t>(rows) * 512);  // 31 binades x 16 buckets and a margin per row
}

namespace {
// Buckets of TopKSums: the exponent and the top kSubBits mantissa bits (2^kSubBits buckets per binade),
// numbered by the bit pattern's top bits (u >> kBucketShift: 0 .. kTopBuckets - 1 for non-negative floats).
constexpr int kSubBits = 4, kBucketShift = 23 - kSubBits, kTopBuckets = 1 << (31 - kBucketShift);
// Sum's second level in a bucket of more than kSplitMin values: sub-buckets by the next kSubBits bits.
constexpr int kSubShift = kBucketShift - kSubBits, kSplitMin = 8;
constexpr int kGroups = TopKSums::kGroups, kGroupGap = 8;

// One pass over a row's values for the top-k sums: returns the sum (in double) of the values whose bit
// pattern without the sign is at least `from` (<= 2^31; 0 for the others: adding +0 changes no bit), and,
// when `scratch` is given, writes the values of bucket `bucket` (bit patterns with u >> kBucketShift equal to
// it) to its front in index order (the caller knows how many: the bucket's count; scratch is not shrunk). The
// caller sums only values >= 2^L: every partial sum is then exact, so the result is the exact sum whatever
// the order (lanes, blocks): the AVX2 and the portable loops give the same bits.
double SumFromAndGather(const float* v, size_t n, uint32_t from, uint32_t bucket,
                        std::vector<float>* scratch) {
  size_t i = 0, m = 0;
  float* out = nullptr;
  if (scratch) {  // room for the AVX2 loop's whole-block stores; it only grows (no zero fill per call)
    if (scratch->size() < n + 8) scratch->resize(n + 8);
    out = scratch->data();
  }
  double s[4] = {};
#if defined(__AVX2__)
  {
    const __m256i absm = _mm256_set1_epi32(0x7fffffff), lim = _mm256_set1_epi32(static_cast<int>(from - 1)),
                  bk = _mm256_set1_epi32(static_cast<int>(bucket));
    __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
    for (; i + 8 <= n; i += 8) {
      const __m256 f = _mm256_loadu_ps(v + i);
      const __m256i u = _mm256_and_si256(_mm256_castps_si256(f), absm);
      const __m256 fm =
          _mm256_and_ps(f, _mm256_castsi256_ps(_mm256_cmpgt_epi32(u, lim)));  // u < 2^31: signed; from 0: -1
      acc0 = _mm256_add_pd(acc0, _mm256_cvtps_pd(_mm256_castps256_ps128(fm)));
      acc1 = _mm256_add_pd(acc1, _mm256_cvtps_pd(_mm256_extractf128_ps(fm, 1)));
      if (out) {
        const unsigned eq = static_cast<unsigned>(_mm256_movemask_ps(
            _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_srli_epi32(u, kBucketShift), bk))));
        const __m256i at = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(kSetBits.at[eq])));
        _mm256_storeu_ps(out + m, _mm256_permutevar8x32_ps(f, at));  // no branch: it would mispredict
        m += __builtin_popcount(eq);
      }
    }
    _mm256_storeu_pd(s, _mm256_add_pd(acc0, acc1));
  }
#endif
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &v[i], 4);
    u &= 0x7fffffffu;
    s[i & 3] += u >= from ? static_cast<double>(v[i]) : 0.0;
    if (out && (u >> kBucketShift) == bucket) out[m++] = v[i];
  }
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// Copies the values of each group g < ng (bit patterns without the sign in [from[g], from[g - 1]), from[-1]
// = 2^31; from descending) to out + cc[gend[g]] + kGroupGap * g on, in index order: the AVX2 loop stores
// whole blocks of 8, so each group has 8 spare places after it (`out` too, after the last).
void KeepGroups(const float* v, size_t n, int ng, const uint32_t* from, const int32_t* cc, const int* gend,
                float* out) {
  size_t m[kGroups];
  for (int g = 0; g < ng; ++g) m[g] = static_cast<size_t>(cc[gend[g]] + kGroupGap * g);
  size_t i = 0;
#if defined(__AVX2__)
  const __m256i absm = _mm256_set1_epi32(0x7fffffff);
  __m256i lim[kGroups];
  for (int g = 0; g < ng; ++g) lim[g] = _mm256_set1_epi32(static_cast<int>(from[g] - 1));
  for (; i + 8 <= n; i += 8) {
    const __m256 f = _mm256_loadu_ps(v + i);
    const __m256i u = _mm256_and_si256(_mm256_castps_si256(f), absm);
    unsigned prev = 0;
    for (int g = 0; g < ng; ++g) {
      const unsigned ge =
          static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(u, lim[g]))));
      const unsigned take = ge & ~prev;
      prev = ge;
      const __m256i at = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(kSetBits.at[take])));
      _mm256_storeu_ps(out + m[g], _mm256_permutevar8x32_ps(f, at));
      m[g] += static_cast<size_t>(__builtin_popcount(take));
    }
  }
#endif
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &v[i], 4);
    u &= 0x7fffffffu;
    for (int g = 0; g < ng; ++g)
      if (u >= from[g]) {
        out[m[g]++] = v[i];
        break;
      }
  }
}
}  // namespace

namespace {
// SetBucketSumsForTesting (0: by the estimate, 1: split at every level, 2: buckets) and the rows that took
// the buckets' way (BucketSumsRowsForTesting).
std::atomic<int> g_bucket_sums_mode{0};
std::atomic<int64_t> g_bucket_sums_rows{0};
// DescendingSums puts the values in their buckets when splitting at every level would read more than this
// many times as many values (a scalar pass against vector passes). Chosen on 789 regret rows dumped from
// the demo trace's sweeps of 9, 45 and 5 runs (docs/performance.md, round 30): from 4.5 to 5 the rows took
// 0.8% more time than with the faster way for each row, against 15% more always splitting and 7% more
// always putting values in buckets.
constexpr double kBucketPassCost = 4.75;
}  // namespace

void SetBucketSumsForTesting(int mode) { g_bucket_sums_mode.store(mode, std::memory_order_relaxed); }
int64_t BucketSumsRowsForTesting() { return g_bucket_sums_rows.load(std::memory_order_relaxed); }

namespace {
std::atomic<bool> g_kind_sums_avx2_allowed{true};
}  // namespace

void SetKindSumsAvx2ForTesting(bool allowed) {
  g_kind_sums_avx2_allowed.store(allowed, std::memory_order_relaxed);
}

bool ExactKindSums(std::span<const float> values, std::span<const int32_t> run_end,
                   std::span<const uint8_t> run_kind, RowSums* out) {
  const size_t n = values.size();
  const float* v = values.data();
  double ks[4] = {};
  uint32_t raw = 0;             // the largest bit pattern (any negative value but -0 lies above 0x80000000)
  uint32_t unz = ~0u;           // the smallest nonzero magnitude's bit pattern, minus 1 (a zero wraps to ~0)
  uint32_t umin = 0x7fffffffu;  // the smallest magnitude's bit pattern
  uint32_t umax = 0;            // the largest magnitude's bit pattern
  size_t at = 0;
  // Values [at, end) one at a time into the bit-pattern bounds, their sum added to s (the vector path's
  // tails, and every value without it).
  auto scalar = [&](size_t end, double& s) {
    for (; at < end; ++at) {
      uint32_t u;
      std::memcpy(&u, v + at, 4);
      raw = std::max(raw, u);
      umin = std::min(umin, u & 0x7fffffffu);
      umax = std::max(umax, u & 0x7fffffffu);
      unz = std::min(unz, (u & 0x7fffffffu) - 1);
      s += v[at];
    }
  };
  bool vec = false;
#if defined(__AVX2__)
  vec = g_kind_sums_avx2_allowed.load(std::memory_order_relaxed);
  if (vec) {
    __m256i vraw = _mm256_setzero_si256(), vnz = _mm256_set1_epi32(-1), vmin = _mm256_set1_epi32(0x7fffffff),
            vmax = _mm256_setzero_si256();
    const __m256i abs = _mm256_set1_epi32(0x7fffffff), one = _mm256_set1_epi32(1);
    for (size_t r = 0; r < run_end.size(); ++r) {
      const size_t end = static_cast<size_t>(run_end[r]);
      __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
      for (; at + 8 <= end; at += 8) {
        const __m256 f = _mm256_loadu_ps(v + at);
        const __m256i u = _mm256_castps_si256(f);
        vraw = _mm256_max_epu32(vraw, u);
        const __m256i a = _mm256_and_si256(u, abs);
        vmin = _mm256_min_epu32(vmin, a);
        vmax = _mm256_max_epu32(vmax, a);
        vnz = _mm256_min_epu32(vnz, _mm256_sub_epi32(a, one));
        a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(f)));
        a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)));
      }
      double l[4];
      _mm256_storeu_pd(l, _mm256_add_pd(a0, a1));
      double s = (l[0] + l[1]) + (l[2] + l[3]);
      scalar(end, s);
      ks[run_kind[r] & 3] += s;
    }
    uint32_t r8[8], z8[8], m8[8], x8[8];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x8), vmax);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r8), vraw);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(z8), vnz);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(m8), vmin);
    for (int l = 0; l < 8; ++l) {
      raw = std::max(raw, r8[l]);
      unz = std::min(unz, z8[l]);
      umin = std::min(umin, m8[l]);
      umax = std::max(umax, x8[l]);
    }
  }
#endif
  if (!vec)
    for (size_t r = 0; r < run_end.size(); ++r) {
      double s = 0;
      scalar(static_cast<size_t>(run_end[r]), s);
      ks[run_kind[r] & 3] += s;
    }
  KVSIM_CHECK_MSG(at == n, "ExactKindSums: the runs must end at the row's end");
  const double sum = (ks[0] + ks[1]) + (ks[2] + ks[3]);
  // A sum of non-negative values in any order is within n * 2^-53 (relative) of the true one: sum * (1 +
  // 2^-20) bounds it (n < 2^30), as in SortForDescendingSums. A value below -0 or a non-finite one: no.
  if (raw > 0x80000000u || !std::isfinite(sum)) return false;
  int e = 0;
  std::frexp(sum * (1.0 + 0x1p-20), &e);
  const float big = std::ldexp(1.0f, e - 30);  // 2^L (0 when L is below the smallest subnormal)
  uint32_t ubig;
  std::memcpy(&ubig, &big, 4);
  if (ubig < 0x00800000u) ubig = 0;      // 2^L subnormal: every value counts as big (see TopKSums)
  const uint32_t nonzero_min = unz + 1;  // 0 when every value is a zero
  if (nonzero_min != 0 && nonzero_min < ubig) return false;
  for (int k = 0; k < 4; ++k) out->kind[k] = ks[k];
  out->total = sum;
  out->umax = umax;
  out->umin = n > 0 ? umin : 0;
  out->unz = nonzero_min;
  return true;
}

namespace {
// What TopKSums needs from a pass over a row before its buckets: an upper bound of the sum (as
// SortForDescendingSums), the sign check, the largest and smallest value and the smallest nonzero value
// (the minimum of u - 1: a zero wraps to the largest). `known` (ExactKindSums' result for these values)
// replaces the pass: the same bound (its sum is exact too).
struct RowScan {
  double sum = 0;
  uint32_t negative = 0, umax = 0, umin = 0, unz = 0;  // unz: the smallest nonzero pattern minus 1
};
RowScan ScanRow(std::span<const float> values, const RowSums* known) {
  const size_t n = values.size();
  RowScan r;
  if (known != nullptr) {
    r.sum = known->total;
    r.umax = known->umax;
    r.umin = known->umin;
    r.unz = known->unz - 1;  // a row of zeros wraps to ~0, as below
    return r;
  }
  // Four lanes, lane l adding values[i + l] of every group of four in index order (then the tail to lane 0).
  double s4[4] = {};
  uint32_t neg4[4] = {}, umax4[4] = {}, umin4[4] = {0x7fffffffu, 0x7fffffffu, 0x7fffffffu, 0x7fffffffu},
           unz4[4] = {~0u, ~0u, ~0u, ~0u};
  size_t i = 0;
#if defined(__AVX2__)
  {  // the same lanes in registers (GCC does not vectorise the loop below: float to double, mixed types)
    __m256d acc = _mm256_setzero_pd(), acc2 = _mm256_setzero_pd();
    __m128i vneg = _mm_setzero_si128(), vmax = _mm_setzero_si128(), vmin = _mm_set1_epi32(0x7fffffff),
            vnz = _mm_set1_epi32(-1);
    const __m128i abs = _mm_set1_epi32(0x7fffffff), sign = _mm_set1_epi32(static_cast<int>(0x80000000u)),
                  one = _mm_set1_epi32(1);
    auto block = [&](size_t at, __m256d& sum) {
      const __m128 f = _mm_loadu_ps(&values[at]);
      const __m128i u = _mm_castps_si128(f);
      // u > 0x80000000 unsigned <=> (u ^ 0x80000000) > 0 signed
      vneg = _mm_or_si128(vneg, _mm_cmpgt_epi32(_mm_xor_si128(u, sign), _mm_setzero_si128()));
      const __m128i a = _mm_and_si128(u, abs);
      vmax = _mm_max_epu32(vmax, a);
      vmin = _mm_min_epu32(vmin, a);
      vnz = _mm_min_epu32(vnz, _mm_sub_epi32(a, one));
      sum = _mm256_add_pd(sum, _mm256_cvtps_pd(f));
    };
    for (; i + 8 <= n; i += 8) {  // two chains of additions
      block(i, acc);
      block(i + 4, acc2);
    }
    if (i + 4 <= n) {
      block(i, acc);
      i += 4;
    }
    _mm256_storeu_pd(s4, _mm256_add_pd(acc, acc2));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(neg4), vneg);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(umax4), vmax);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(umin4), vmin);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(unz4), vnz);
  }
#else
  for (; i + 4 <= n; i += 4)
    for (int l = 0; l < 4; ++l) {
      uint32_t u;
      std::memcpy(&u, &values[i + l], 4);
      neg4[l] |= u > 0x80000000u;
      u &= 0x7fffffffu;
      umax4[l] = std::max(umax4[l], u);
      umin4[l] = std::min(umin4[l], u);
      unz4[l] = std::min(unz4[l], u - 1);
      s4[l] += values[i + l];
    }
#endif
  r.negative = (neg4[0] | neg4[1]) | (neg4[2] | neg4[3]);
  r.umax = std::max(std::max(umax4[0], umax4[1]), std::max(umax4[2], umax4[3]));
  r.umin = std::min(std::min(umin4[0], umin4[1]), std::min(umin4[2], umin4[3]));
  r.unz = std::min(std::min(unz4[0], unz4[1]), std::min(unz4[2], unz4[3]));
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &values[i], 4);
    r.negative |= u > 0x80000000u;
    u &= 0x7fffffffu;
    r.umax = std::max(r.umax, u);
    r.umin = std::min(r.umin, u);
    r.unz = std::min(r.unz, u - 1);
    s4[0] += values[i];
  }
  r.sum = (s4[0] + s4[1]) + (s4[2] + s4[3]);
  return r;
}

// Per bucket (absolute: by the value's top bits, so before 2^L is known) the count, for the two halves of the
// row separately ([0, h) and [h, n)): two independent chains of increments instead of one whose every
// increment of a repeated bucket waits on the previous one's store. The arrays (thread-local) are kept zero
// between rows: the caller clears [umin's bucket, umax's bucket] after use (ClearBuckets).
struct BucketCounts {
  int32_t *c0, *c1;
};
BucketCounts CountBuckets(std::span<const float> values) {
  thread_local std::vector<int32_t> count0(kTopBuckets, 0), count1(kTopBuckets, 0);
  int32_t *cnt0 = count0.data(), *cnt1 = count1.data();
  const size_t n = values.size(), h = n / 2;
  auto bucket = [&](size_t at) {
    uint32_t u;
    std::memcpy(&u, &values[at], 4);
    return (u & 0x7fffffffu) >> kBucketShift;
  };
  for (size_t i = 0; i < h; ++i) {
    ++cnt0[bucket(i)];
    ++cnt1[bucket(h + i)];
  }
  if (n % 2) ++cnt1[bucket(n - 1)];
  return {cnt0, cnt1};
}
// cc[j] = how many values the top j buckets (numbers hi, hi - 1, ..., hi - j + 1) hold, j = 0 .. nb.
void CumulativeCounts(BucketCounts c, uint32_t hi, int nb, int32_t* cc) {
  int32_t run_count = 0;  // in a register (cc and the counts may alias as far as the compiler knows)
  cc[0] = 0;
  for (int j = 0; j < nb; ++j) {
    run_count += c.c0[hi - j] + c.c1[hi - j];
    cc[j + 1] = run_count;
  }
}
void ClearBuckets(BucketCounts c, uint32_t bmin, uint32_t hi) {
  for (int32_t* p : {c.c0, c.c1}) std::fill(p + bmin, p + hi + 1, 0);
}
// The bit pattern of 2^L (values >= 2^L: bit patterns >= it) for a row whose sum is at most `sum` (an upper
// bound within 2^-20: see SortForDescendingSums). A subnormal 2^L is no bucket boundary; but then every
// value counts as big: all are multiples of 2^-149 and every sum is below 2^(L+30) <= 2^-97, so it has at
// most 53 significant bits (exact in any order): 0.
uint32_t BigPattern(double sum) {
  int e = 0;
  std::frexp(sum * (1.0 + 0x1p-20), &e);       // sum * (1 + 2^-20) < 2^e (see SortForDescendingSums)
  const float big = std::ldexp(1.0f, e - 30);  // 2^L; 0 when L is below the smallest subnormal
  uint32_t ubig;
  std::memcpy(&ubig, &big, 4);
  return ubig < 0x00800000u ? 0 : ubig;
}
}  // namespace

double TopKSums::AddRow(std::span<const float> values, int kmax, const RowSums* known) {
  const size_t n = values.size();
  Row row;
  row.n = static_cast<int>(n);
  row.elem = elems_used_;
  row.bucket = cc_.size();
  row.tail = tail_.size();
  const RowScan scan = ScanRow(values, known);
  const uint32_t umax = scan.umax, unz = scan.unz;
  const BucketCounts counts = CountBuckets(values);
  const uint32_t hi = umax >> kBucketShift, bmin = n > 0 ? scan.umin >> kBucketShift : hi;
  KVSIM_CHECK_MSG(!scan.negative, "TopKSums: values must be non-negative");
  const double sum = scan.sum;
  KVSIM_CHECK_MSG(std::isfinite(sum), "TopKSums: values must be finite");
  const uint32_t ubig = BigPattern(sum);  // values >= 2^L: bit patterns >= ubig
  // Buckets j = 0 .. nb-1 from the top: bucket j holds the bit patterns u with (u >> shift) = hi - j.
  const uint32_t lo = ubig >> kBucketShift;
  const int nb = umax >= ubig ? static_cast<int>(hi - lo) + 1 : 0;
  row.nb = nb;
  row.hi = hi;
  // The cumulative counts.
  cc_.resize(row.bucket + nb + 1);
  int32_t* cc = cc_.data() + row.bucket;
  CumulativeCounts(counts, hi, nb, cc);
  // The values Sum and Kth may need: those of the buckets down to the one holding the min(kmax, |big|)-th
  // largest value (none at kmax 0; Kth answers nothing below). elems_ only grows (its size is a high-water
  // mark, so a row's places are not zero-filled again and again).
  const int nbig = cc[nb], want = std::min(kmax, nbig);
  int jc = 0;
  while (jc < nb && cc[jc + 1] < want) ++jc;
  const int kept = want > 0 ? cc[jc + 1] : 0;
  row.kept = kept;
  // The kept values in up to kGroups groups of whole buckets, from the top: group g ends at the first
  // bucket boundary holding at least kept / 2^(kGroups - 1 - g) values (so a group holds about as many
  // values as the groups above it together: Sum reads one group, ~k values or fewer, instead of the
  // whole row). Each group's values in index order, by a branch-free compress per group; and the exact
  // sums of the groups above each (values >= 2^L: every sum of them is exact).
  row.ngroups = 0;
  row.gend[0] = 0;
  row.gsum[0] = 0;
  if (kept > 0) {
    const size_t room = static_cast<size_t>(kept) + kGroupGap * kGroups;
    if (elems_.size() < row.elem + room) elems_.resize(row.elem + room);
    int ng = 0, jb = 0;
    for (int g = 0; g < kGroups; ++g) {
      const int target = g == kGroups - 1 ? kept : std::max(1, kept >> (kGroups - 1 - g));
      while (cc[jb] < target) ++jb;  // the first boundary holding at least `target` values
      if (jb > row.gend[ng]) row.gend[++ng] = jb;
    }
    row.ngroups = ng;
    for (int g = 0; g <= ng; ++g) row.gcnt[g] = cc[row.gend[g]];
    elems_used_ = row.elem + kept + kGroupGap * ng;
    uint32_t from[kGroups];  // group g: the patterns in [from[g], from[g - 1])
    for (int g = 0; g < ng; ++g) from[g] = (hi - static_cast<uint32_t>(row.gend[g + 1] - 1)) << kBucketShift;
    float* el = elems_.data() + row.elem;
    KeepGroups(values.data(), n, ng, from, cc, row.gend, el);
    for (int g = 0; g < ng; ++g) {
      const int b0 = cc[row.gend[g]], b1 = cc[row.gend[g + 1]];
      row.gsum[g + 1] = row.gsum[g] + SumFromAndGather(el + b0 + kGroupGap * g, static_cast<size_t>(b1 - b0),
                                                       0, 0, nullptr);
    }
  }
  ClearBuckets(counts, bmin, hi);  // back to zero for the next row
  // The exact sum of the values >= 2^L: when every nonzero value is (the usual case for softmax rows; zeros
  // add nothing), pass 1's sum, whose every partial sum was exact; else a masked pass.
  const uint32_t nonzero_min = unz + 1;  // 0 when every value is zero
  double big_sum = sum;
  if (nonzero_min != 0 && nonzero_min < ubig) big_sum = SumFromAndGather(values.data(), n, ubig, 0, nullptr);
  // The nonzero values below 2^L, in descending order, added one by one after the big ones.
  thread_local std::vector<uint32_t> a, b;
  size_t m = 0;
  if (nonzero_min != 0 && nonzero_min < ubig) {
    a.resize(n);
    b.resize(n);
    for (size_t i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, &values[i], 4);
      u &= 0x7fffffffu;
      if (u < ubig && u != 0) a[m++] = ~u;
    }
    RadixSortKeys(a, b, m);
  }
  row.ntail = static_cast<int>(m);
  row.kept_tail = static_cast<int>(std::clamp<int64_t>(static_cast<int64_t>(kmax) - nbig, 0, m));
  tail_.resize(row.tail + row.kept_tail);
  tailv_.resize(row.tail + row.kept_tail);
  double acc = big_sum;
  for (size_t j = 0; j < m; ++j) {
    const float v = KeyValue(a[j]);
    acc += v;
    if (j < static_cast<size_t>(row.kept_tail)) {
      tail_[row.tail + j] = acc;
      tailv_[row.tail + j] = v;
    }
  }
  row.total = acc;
  rows_.push_back(row);
  return acc;
}

namespace {
// The exact sum of the `need` largest of sv[0, size) (0 < need < size; values of one bucket, >= 2^L: every
// sum of them is exact, in any order). Reorders sv[0, size) and may overwrite its front.
double TopOfBucket(float* sv, int size, int need) {
  if (size > kSplitMin) {
    // One more level of buckets, by the next kSubBits bits (again ordered like the values): the sub-buckets
    // above the k-th largest are taken whole (their sums are exact, as every sum of big values is), and only
    // the one holding it is selected in: one counting pass and a selection among ~size / 16 values instead
    // of a selection among all. Every result is the exact sum of the need largest values.
    int32_t sc[1 << kSubBits] = {};
    double ss[1 << kSubBits] = {};
    for (int i = 0; i < size; ++i) {
      uint32_t u;
      std::memcpy(&u, &sv[i], 4);
      const int sb = static_cast<int>(u >> kSubShift) & ((1 << kSubBits) - 1);
      ++sc[sb];
      ss[sb] += sv[i];
    }
    double above = 0;
    int sb = (1 << kSubBits) - 1;
    for (; sc[sb] < need; --sb) {
      need -= sc[sb];
      above += ss[sb];
    }
    if (sc[sb] == need) return above + ss[sb];
    int kept = 0;  // the sub-bucket's values to the front (their order does not matter: exact sums)
    for (int i = 0; i < size; ++i) {
      uint32_t u;
      std::memcpy(&u, &sv[i], 4);
      if ((static_cast<int>(u >> kSubShift) & ((1 << kSubBits) - 1)) == sb) sv[kept++] = sv[i];
    }
    size = kept;
    double part = 0;
    if (need <= size - need) {
      std::nth_element(sv, sv + (need - 1), sv + size, std::greater<float>());
      for (int i = 0; i < need; ++i) part += sv[i];
      return above + part;
    }
    std::nth_element(sv, sv + (size - need - 1), sv + size);
    for (int i = 0; i < size - need; ++i) part += sv[i];
    return (above + ss[sb]) - part;
  }
  double part = 0;
  if (need <= size - need) {  // the `need` largest of the bucket
    std::nth_element(sv, sv + (need - 1), sv + size, std::greater<float>());
    for (int i = 0; i < need; ++i) part += sv[i];
    return part;
  }
  // the bucket's sum minus its size - need smallest (every value and difference here is exact)
  double bucket_sum = 0;
  for (int i = 0; i < size; ++i) bucket_sum += sv[i];
  std::nth_element(sv, sv + (size - need - 1), sv + size);
  for (int i = 0; i < size - need; ++i) part += sv[i];
  return bucket_sum - part;
}

#ifdef KVSIM_SELECT_AVX512
// SplitAt 16 values at a time: one compare mask, a register compress per output and a whole-register store
// (16 spare places), masked double sums; the last block masked. The same values in the same order and the
// same exact sums.
__attribute__((target("avx512f"))) double SplitAtAvx512(const float* v, size_t n, uint32_t from, float* hi,
                                                        float* lo, uint32_t lo_bucket, size_t* nhi) {
  const __m512i absm = _mm512_set1_epi32(0x7fffffff), lim = _mm512_set1_epi32(static_cast<int>(from - 1)),
                lb = _mm512_set1_epi32(static_cast<int>(lo_bucket));
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  size_t m = 0, ml = 0;
  for (size_t i = 0; i < n; i += 16) {
    const __mmask16 in = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 f = _mm512_maskz_loadu_ps(in, v + i);
    const __m512i u = _mm512_and_si512(_mm512_castps_si512(f), absm);
    const __mmask16 ge = _mm512_mask_cmpgt_epi32_mask(in, u, lim);  // u < 2^31: signed; from 0: -1
    acc0 =
        _mm512_mask_add_pd(acc0, static_cast<__mmask8>(ge), acc0, _mm512_cvtps_pd(_mm512_castps512_ps256(f)));
    acc1 =
        _mm512_mask_add_pd(acc1, static_cast<__mmask8>(ge >> 8), acc1,
                           _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1))));
    _mm512_storeu_ps(hi + m, _mm512_maskz_compress_ps(ge, f));
    m += static_cast<size_t>(__builtin_popcount(ge));
    if (lo) {
      const __mmask16 rest = _mm512_mask_cmpeq_epi32_mask(in, _mm512_srli_epi32(u, kBucketShift), lb);
      _mm512_storeu_ps(lo + ml, _mm512_maskz_compress_ps(rest, f));
      ml += static_cast<size_t>(__builtin_popcount(rest));
    }
  }
  *nhi = m;
  return _mm512_reduce_add_pd(_mm512_add_pd(acc0, acc1));
}
#endif

// Splits v[0, n) at the bit pattern `from` (<= 2^31, without the sign): the values at or above it go to `hi`
// in index order (hi may be v: the vector loops load each block before they store, at or before its place),
// and when `lo` is given, those of bucket `lo_bucket` (below `from`) to lo. Returns the sum (in double) of
// those written to hi and their count in *nhi. The caller sums only values >= 2^L (exact in any order, as
// SumFromAndGather). hi and lo need 16 spare places after their values (whole-register stores).
double SplitAt(const float* v, size_t n, uint32_t from, float* hi, float* lo, uint32_t lo_bucket,
               size_t* nhi) {
#ifdef KVSIM_SELECT_AVX512
  if (kSelectAvx512 && g_select_avx512_allowed.load(std::memory_order_relaxed))
    return SplitAtAvx512(v, n, from, hi, lo, lo_bucket, nhi);
#endif
  size_t i = 0, m = 0, ml = 0;
  double s[4] = {};
#if defined(__AVX2__)
  {
    const __m256i absm = _mm256_set1_epi32(0x7fffffff), lim = _mm256_set1_epi32(static_cast<int>(from - 1)),
                  lb = _mm256_set1_epi32(static_cast<int>(lo_bucket));
    __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
    for (; i + 8 <= n; i += 8) {
      const __m256 f = _mm256_loadu_ps(v + i);
      const __m256i u = _mm256_and_si256(_mm256_castps_si256(f), absm);
      const __m256 ge = _mm256_castsi256_ps(_mm256_cmpgt_epi32(u, lim));  // u < 2^31: signed; from 0: -1
      const __m256 fm = _mm256_and_ps(f, ge);
      acc0 = _mm256_add_pd(acc0, _mm256_cvtps_pd(_mm256_castps256_ps128(fm)));
      acc1 = _mm256_add_pd(acc1, _mm256_cvtps_pd(_mm256_extractf128_ps(fm, 1)));
      const unsigned take = static_cast<unsigned>(_mm256_movemask_ps(ge));
      const __m256i at = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(kSetBits.at[take])));
      _mm256_storeu_ps(hi + m, _mm256_permutevar8x32_ps(f, at));
      m += static_cast<size_t>(__builtin_popcount(take));
      if (lo) {
        const unsigned rest = static_cast<unsigned>(_mm256_movemask_ps(
            _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_srli_epi32(u, kBucketShift), lb))));
        const __m256i lat =
            _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(kSetBits.at[rest])));
        _mm256_storeu_ps(lo + ml, _mm256_permutevar8x32_ps(f, lat));
        ml += static_cast<size_t>(__builtin_popcount(rest));
      }
    }
    _mm256_storeu_pd(s, _mm256_add_pd(acc0, acc1));
  }
#endif
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &v[i], 4);
    u &= 0x7fffffffu;
    const float x = v[i];
    if (u >= from) {
      s[i & 3] += x;
      hi[m++] = x;
    } else if (lo && (u >> kBucketShift) == lo_bucket) {
      lo[ml++] = x;
    }
  }
  *nhi = m;
  return (s[0] + s[1]) + (s[2] + s[3]);
}
}  // namespace

namespace {
// The row pass and, when every nonzero value is big (none below 2^L), the count pass that DescendingSums and
// RowBuckets::AddRow take: the row's exact sum, and in (*cc)[at .. at + nb] (cc resized to at + nb + 1) its
// cumulative bucket counts from the top bucket `hi` down to 2^L's. Empty (no counts) when a nonzero value is
// below 2^L: then their order matters (TopKSums).
struct BigCounts {
  double sum = 0;
  uint32_t hi = 0;
  int nb = 0;
};
std::optional<BigCounts> CountBig(std::span<const float> values, const RowSums* known,
                                  std::vector<int32_t>* cc, size_t at) {
  const size_t n = values.size();
  const RowScan scan = ScanRow(values, known);
  KVSIM_CHECK_MSG(!scan.negative, "TopKSums: values must be non-negative");
  KVSIM_CHECK_MSG(std::isfinite(scan.sum), "TopKSums: values must be finite");
  const uint32_t ubig = BigPattern(scan.sum), nonzero_min = scan.unz + 1;
  if (nonzero_min != 0 && nonzero_min < ubig) return std::nullopt;
  const BucketCounts counts = CountBuckets(values);
  BigCounts b;
  b.sum = scan.sum;
  b.hi = scan.umax >> kBucketShift;
  const uint32_t bmin = n > 0 ? scan.umin >> kBucketShift : b.hi, lo = ubig >> kBucketShift;
  b.nb = scan.umax >= ubig ? static_cast<int>(b.hi - lo) + 1 : 0;
  cc->resize(at + static_cast<size_t>(b.nb) + 1);
  CumulativeCounts(counts, b.hi, b.nb, cc->data() + at);
  ClearBuckets(counts, bmin, b.hi);
  return b;
}

// DescendingSums after its row pass and count pass, for a row whose every nonzero value is big: `sum` its
// exact sum, cc[0 .. nb] its cumulative bucket counts from the top bucket `hi` down to 2^L's.
void SumsFromCounts(std::span<const float> values, std::span<const int32_t> ks, double sum, const int32_t* cc,
                    uint32_t hi, int nb, double* out) {
  const size_t n = values.size();
  const int nbig = cc[nb];
  // Each k inside the big values: the bucket j (numbered from the top: bucket hi - j) holding its k-th
  // largest value, and how many of j's values it takes (need; 0 when it takes them all). Its sum is that of
  // every value in the buckets above j (j included when need is 0), plus the need largest of bucket j.
  // Levels: those lower boundaries as bucket numbers (the values at or above bucket b: cc[hi - b + 1] of
  // them), and the lowest bucket any k needs.
  struct Query {
    size_t i;
    int j, need;
  };
  thread_local std::vector<Query> qs;
  thread_local std::vector<uint32_t> levels;
  qs.clear();
  levels.clear();
  int lowest = 0;
  for (size_t i = 0; i < ks.size(); ++i) {
    const int k = ks[i];
    if (k <= 0) {
      out[i] = 0.0;
    } else if (k >= static_cast<int>(n) || k > nbig) {
      out[i] = sum;  // exact: every nonzero value is big
    } else {
      const int j =
          static_cast<int>(std::upper_bound(cc, cc + nb + 1, k - 1) - cc) - 1;  // cc[j] < k <= cc[j+1]
      const int need = cc[j + 1] == k ? 0 : k - cc[j];
      qs.push_back({i, j, need});
      levels.push_back(hi - static_cast<uint32_t>(need > 0 ? j - 1 : j));
      lowest = std::max(lowest, j);
    }
  }
  if (qs.empty()) return;
  levels.push_back(hi - static_cast<uint32_t>(lowest));
  std::sort(levels.begin(), levels.end());
  levels.erase(std::unique(levels.begin(), levels.end()), levels.end());
  thread_local std::vector<float> buf, part, sel;
  if (buf.size() < n + 16) buf.resize(n + 16);
  // The `need` largest of a partial bucket's `count` values (copied: TopOfBucket reorders them, and a bucket
  // may serve several k's).
  auto top_of = [](const float* bucket, int count, int need) {
    if (sel.size() < static_cast<size_t>(count)) sel.resize(count);
    std::copy_n(bucket, count, sel.data());
    return TopOfBucket(sel.data(), count, need);
  };
  // Both ways below first compress the values at or above the lowest level from the row (one vector pass).
  // Then either they are split again at every next level (vector passes over what remains above the
  // previous level: few levels) or each is put in its bucket once (one scalar pass: many levels), by the
  // values each would read (kBucketPassCost). The same bits either way: every sum here is an exact sum of
  // values >= 2^L.
  size_t split_reads = 0;
  for (size_t l = 0; l + 1 < levels.size(); ++l) split_reads += static_cast<size_t>(cc[hi - levels[l] + 1]);
  const size_t len0 = static_cast<size_t>(cc[hi - levels[0] + 1]);
  const int mode = g_bucket_sums_mode.load(std::memory_order_relaxed);
  const bool by_buckets = mode == 0 ? static_cast<double>(split_reads) > kBucketPassCost * len0 : mode == 2;
  if (by_buckets) g_bucket_sums_rows.fetch_add(1, std::memory_order_relaxed);
  size_t len = 0;
  const double at_lowest = SplitAt(values.data(), n, levels[0] << kBucketShift, buf.data(), nullptr, 0, &len);
  if (!by_buckets) {
    // From the lowest level up: the values at or above it split in place at each next level, their exact sum
    // per level, and at level b + 1 of a k ending inside bucket b, that bucket's values (below the level, at
    // or above the one below: bucket b lies between them) for the selections.
    thread_local std::vector<double> at_level;
    at_level.resize(levels.size());
    at_level[0] = at_lowest;
    for (size_t l = 1; l < levels.size(); ++l) {
      const uint32_t b = levels[l] - 1;  // the bucket just below the level
      const int j = static_cast<int>(hi - b);
      bool partial = false;  // some k ends inside bucket b
      for (const Query& q : qs) partial = partial || (q.need > 0 && q.j == j);
      const int size = cc[j + 1] - cc[j];  // bucket b's values
      if (partial && part.size() < static_cast<size_t>(size) + 16) part.resize(size + 16);
      size_t next = 0;
      at_level[l] = SplitAt(buf.data(), len, levels[l] << kBucketShift, buf.data(),
                            partial ? part.data() : nullptr, b, &next);
      if (partial)
        for (const Query& q : qs)
          if (q.need > 0 && q.j == j) out[q.i] = at_level[l] + top_of(part.data(), size, q.need);
      len = next;
    }
    for (const Query& q : qs)
      if (q.need == 0)
        out[q.i] = at_level[std::lower_bound(levels.begin(), levels.end(), hi - static_cast<uint32_t>(q.j)) -
                            levels.begin()];
    return;
  }
  // Per bucket from the top down to the lowest: the exact sum of its values, and, for a bucket some k ends
  // inside, its values (to `part`, from begin[j]) for the selections. Two independent halves of the values
  // (two chains of dependent adds and stores per bucket instead of one): the first half's go into the
  // bucket's region from its front, the second's from its back (step +1 / -1), so both end where they meet.
  // The other buckets write to one spare place (step 0): no branch per value.
  struct Bucket {
    double sum;
    int32_t at, step;
  };
  thread_local std::vector<Bucket> front, back;
  thread_local std::vector<int32_t> begin;
  front.assign(static_cast<size_t>(lowest) + 1, Bucket{0.0, 0, 0});
  back.assign(front.size(), Bucket{0.0, 0, 0});
  begin.resize(front.size());
  int32_t size = 0;
  for (const Query& q : qs)
    if (q.need > 0 && front[q.j].step == 0) {
      const int32_t count = cc[q.j + 1] - cc[q.j];
      begin[q.j] = size;
      front[q.j] = Bucket{0.0, size, 1};
      back[q.j] = Bucket{0.0, size + count - 1, -1};
      size += count;
    }
  for (size_t j = 0; j < front.size(); ++j)
    if (front[j].step == 0) front[j].at = back[j].at = size;
  if (part.size() < static_cast<size_t>(size) + 1) part.resize(size + 1);
  const float* v = buf.data();
  float* pv = part.data();
  auto put = [&](Bucket* top, size_t t) {
    uint32_t u;
    std::memcpy(&u, v + t, 4);
    Bucket& b = top[hi - ((u & 0x7fffffffu) >> kBucketShift)];
    b.sum += v[t];
    pv[b.at] = v[t];
    b.at += b.step;
  };
  const size_t half = len / 2;
  for (size_t t = 0; t < half; ++t) {
    put(front.data(), t);
    put(back.data(), half + t);
  }
  if (len % 2) put(back.data(), len - 1);
  // The sums of the buckets above each (exact), then each k.
  thread_local std::vector<double> above;
  above.resize(front.size() + 1);
  above[0] = 0;
  for (size_t j = 0; j < front.size(); ++j) above[j + 1] = above[j] + (front[j].sum + back[j].sum);
  for (const Query& q : qs) {
    if (q.need == 0) {
      out[q.i] = above[q.j + 1];
      continue;
    }
    out[q.i] = above[q.j] + top_of(pv + begin[q.j], cc[q.j + 1] - cc[q.j], q.need);
  }
}
}  // namespace

void DescendingSums(std::span<const float> values, std::span<const int32_t> ks, const RowSums* known,
                    double* out) {
  // Every nonzero value big: S[k] is the exact sum of the k largest (zeros add nothing), S[n] the row's.
  thread_local std::vector<int32_t> ccv;
  if (const std::optional<BigCounts> b = CountBig(values, known, &ccv, 0))
    return SumsFromCounts(values, ks, b->sum, ccv.data(), b->hi, b->nb, out);
  // Nonzero values below 2^L: their order matters (TopKSums).
  thread_local TopKSums sums;
  thread_local std::vector<float> scratch;
  sums.Clear();
  int kmax = 0;
  for (int32_t k : ks) kmax = std::max(kmax, static_cast<int>(k));
  sums.AddRow(values, kmax, known);
  for (size_t i = 0; i < ks.size(); ++i) out[i] = sums.Sum(0, ks[i], &scratch);
}

double TopKSums::Sum(int r, int k, std::vector<float>* scratch) const {
  const Row& row = rows_[r];
  if (k <= 0) return 0.0;
  if (k >= row.n) return row.total;
  const int32_t* cc = cc_.data() + row.bucket;
  const int nbig = cc[row.nb];
  if (k > nbig) {  // the values below 2^L: their running sums
    const int i = k - nbig;
    if (i > row.ntail) return row.total;  // zeros add nothing
    KVSIM_CHECK_MSG(i <= row.kept_tail, "TopKSums::Sum: k above the row's kmax");
    return tail_[row.tail + i - 1];
  }
  KVSIM_CHECK_MSG(k <= row.kept, "TopKSums::Sum: k above the row's kmax");
  // The bucket j with cc[j] < k <= cc[j + 1].
  const int j = static_cast<int>(std::upper_bound(cc, cc + row.nb + 1, k - 1) - cc) - 1;
  const uint32_t bj = row.hi - static_cast<uint32_t>(j);  // its number
  int g = 0;                                              // the group holding bucket j
  while (row.gend[g + 1] <= j) ++g;
  const float* el = elems_.data() + row.elem + cc[row.gend[g]] + kGroupGap * g;
  const size_t glen = static_cast<size_t>(cc[row.gend[g + 1]] - cc[row.gend[g]]);
  // The whole top j + 1 buckets: the groups above and group g's values from bucket j's smallest pattern up.
  if (cc[j + 1] == k) return row.gsum[g] + SumFromAndGather(el, glen, bj << kBucketShift, 0, nullptr);
  // The exact sum of the values above bucket j, and bucket j's values (in index order).
  double above = row.gsum[g] + SumFromAndGather(el, glen, (bj + 1) << kBucketShift, bj, scratch);
  return above + TopOfBucket(scratch->data(), cc[j + 1] - cc[j], k - cc[j]);
}

void TopKSums::Prefetch(int r, int k) const {
  if (r < 0 || static_cast<size_t>(r) >= rows_.size()) return;
  const Row& row = rows_[r];
  if (k <= 0 || k >= row.n || k > row.kept) return;  // Sum reads no group then
  int g = 0;  // the group holding the k-th largest value: kept values (gcnt[g], gcnt[g + 1]]
  while (g + 1 < row.ngroups && row.gcnt[g + 1] < k) ++g;
  auto lines = [](const void* p, size_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (size_t at = 0; at < bytes; at += 64) __builtin_prefetch(c + at);
    __builtin_prefetch(c + bytes - 1);
  };
  lines(cc_.data() + row.bucket, (static_cast<size_t>(row.nb) + 1) * sizeof(int32_t));
  lines(elems_.data() + row.elem + row.gcnt[g] + kGroupGap * g,
        static_cast<size_t>(row.gcnt[g + 1] - row.gcnt[g]) * sizeof(float));
}

std::optional<float> TopKSums::Kth(int r, int k, std::vector<float>* scratch) const {
  const Row& row = rows_[r];
  KVSIM_CHECK_MSG(k >= 1, "TopKSums::Kth: k must be at least 1");
  if (k > row.n) return 0.0f;
  const int32_t* cc = cc_.data() + row.bucket;
  const int nbig = cc[row.nb];
  if (k > nbig) {  // below 2^L: the sorted values kept up to kmax, then zeros
    const int i = k - nbig;
    if (i > row.ntail) return 0.0f;
    if (i > row.kept_tail) return std::nullopt;
    return tailv_[row.tail + i - 1];
  }
  // The bucket j with cc[j] < k <= cc[j + 1] holds it: the (k - cc[j])-th largest of that bucket.
  if (k > row.kept) return std::nullopt;  // a bucket below the one holding the kmax-th value: not kept
  const int j = static_cast<int>(std::upper_bound(cc, cc + row.nb + 1, k - 1) - cc) - 1;
  int g = 0;  // the group holding bucket j
  while (row.gend[g + 1] <= j) ++g;
  SumFromAndGather(elems_.data() + row.elem + cc[row.gend[g]] + kGroupGap * g,
                   static_cast<size_t>(cc[row.gend[g + 1]] - cc[row.gend[g]]), 1u << 31,
                   row.hi - static_cast<uint32_t>(j), scratch);
  float* sv = scratch->data();  // bucket j's cc[j + 1] - cc[j] values
  std::nth_element(sv, sv + (k - cc[j] - 1), sv + (cc[j + 1] - cc[j]), std::greater<float>());
  return sv[k - cc[j] - 1];
}

void RowBuckets::Clear() {
  rows_.clear();
  cc_.clear();
}

void RowBuckets::Reserve(int rows) {
  rows_.reserve(rows);
  cc_.reserve(static_cast<size_t>(rows) * 512);  // as TopKSums::Reserve
}

void RowBuckets::AddRow(std::span<const float> values, const RowSums* known) {
  Row row;
  row.n = static_cast<int>(values.size());
  row.bucket = cc_.size();
  if (const std::optional<BigCounts> b =
          CountBig(values, known, &cc_, row.bucket)) {  // DescendingSums' counts
    row.sum = b->sum;
    row.hi = b->hi;
    row.nb = b->nb;
  }
  rows_.push_back(row);
}

std::optional<float> RowBuckets::Kth(int r, std::span<const float> values, int k,
                                     std::vector<float>* scratch) const {
  const Row& row = rows_[r];
  KVSIM_CHECK_MSG(k >= 1, "RowBuckets::Kth: k must be at least 1");
  if (row.nb < 0) return std::nullopt;
  if (k > row.n) return 0.0f;
  const int32_t* cc = cc_.data() + row.bucket;
  if (k > cc[row.nb]) return 0.0f;  // beyond the big values: zeros (every nonzero value is big)
  // The bucket j with cc[j] < k <= cc[j + 1] holds it: the (k - cc[j])-th largest of that bucket.
  const int j = static_cast<int>(std::upper_bound(cc, cc + row.nb + 1, k - 1) - cc) - 1;
  SumFromAndGather(values.data(), values.size(), 1u << 31, row.hi - static_cast<uint32_t>(j), scratch);
  float* sv = scratch->data();  // bucket j's cc[j + 1] - cc[j] values
  std::nth_element(sv, sv + (k - cc[j] - 1), sv + (cc[j + 1] - cc[j]), std::greater<float>());
  return sv[k - cc[j] - 1];
}

namespace {
// RowBuckets::TopK's pass over the row: the indices and values at or above the bit pattern `from` (without
// the sign; > 0) to idx / cv, and those of bucket `bucket` (within them) to bv, each in index order; returns
// how many went to idx. Each output has 16 spare places after its values (whole-register stores).
#ifdef KVSIM_SELECT_AVX512
__attribute__((target("avx512f"))) size_t CompressFromAvx512(const float* v, size_t n, uint32_t from,
                                                             uint32_t bucket, int32_t* idx, float* cv,
                                                             float* bv) {
  const __m512i absm = _mm512_set1_epi32(0x7fffffff), lim = _mm512_set1_epi32(static_cast<int>(from - 1)),
                bk = _mm512_set1_epi32(static_cast<int>(bucket)), step = _mm512_set1_epi32(16);
  __m512i j = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  size_t m = 0, mb = 0;
  for (size_t i = 0; i < n; i += 16, j = _mm512_add_epi32(j, step)) {
    const __mmask16 in = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 f = _mm512_maskz_loadu_ps(in, v + i);
    const __m512i u = _mm512_and_si512(_mm512_castps_si512(f), absm);
    const __mmask16 ge = _mm512_mask_cmpgt_epi32_mask(in, u, lim);  // u < 2^31 and from > 0: signed
    const __mmask16 eq = _mm512_mask_cmpeq_epi32_mask(in, _mm512_srli_epi32(u, kBucketShift), bk);
    _mm512_storeu_si512(idx + m, _mm512_maskz_compress_epi32(ge, j));
    _mm512_storeu_ps(cv + m, _mm512_maskz_compress_ps(ge, f));
    m += static_cast<size_t>(__builtin_popcount(ge));
    _mm512_storeu_ps(bv + mb, _mm512_maskz_compress_ps(eq, f));
    mb += static_cast<size_t>(__builtin_popcount(eq));
  }
  return m;
}

__attribute__((target("avx2,popcnt"))) size_t CompressFromAvx2(const float* v, size_t n, uint32_t from,
                                                               uint32_t bucket, int32_t* idx, float* cv,
                                                               float* bv, size_t* done, size_t* nb) {
  const __m256i absm = _mm256_set1_epi32(0x7fffffff), lim = _mm256_set1_epi32(static_cast<int>(from - 1)),
                bk = _mm256_set1_epi32(static_cast<int>(bucket)), step = _mm256_set1_epi32(8);
  __m256i j = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  size_t i = 0, m = 0, mb = 0;
  for (; i + 8 <= n; i += 8, j = _mm256_add_epi32(j, step)) {
    const __m256 f = _mm256_loadu_ps(v + i);
    const __m256i u = _mm256_and_si256(_mm256_castps_si256(f), absm);
    const unsigned ge =
        static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(u, lim))));
    const unsigned eq = static_cast<unsigned>(
        _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_srli_epi32(u, kBucketShift), bk))));
    const __m256i at = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(kSetBits.at[ge])));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx + m), _mm256_permutevar8x32_epi32(j, at));
    _mm256_storeu_ps(cv + m, _mm256_permutevar8x32_ps(f, at));
    m += static_cast<size_t>(__builtin_popcount(ge));
    const __m256i bat = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(kSetBits.at[eq])));
    _mm256_storeu_ps(bv + mb, _mm256_permutevar8x32_ps(f, bat));
    mb += static_cast<size_t>(__builtin_popcount(eq));
  }
  *done = i;
  *nb = mb;
  return m;
}
#endif

size_t CompressFrom(const float* v, size_t n, uint32_t from, uint32_t bucket, int32_t* idx, float* cv,
                    float* bv) {
  size_t i = 0, m = 0, mb = 0;
#ifdef KVSIM_SELECT_AVX512
  if (kSelectAvx512 && g_select_avx512_allowed.load(std::memory_order_relaxed))
    return CompressFromAvx512(v, n, from, bucket, idx, cv, bv);
  if (kSelectAvx2 && g_select_avx2_allowed.load(std::memory_order_relaxed))
    m = CompressFromAvx2(v, n, from, bucket, idx, cv, bv, &i, &mb);
#endif
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &v[i], 4);
    u &= 0x7fffffffu;
    if (u >= from) {
      idx[m] = static_cast<int32_t>(i);
      cv[m++] = v[i];
    }
    if ((u >> kBucketShift) == bucket) bv[mb++] = v[i];
  }
  return m;
}

// TopKIndicesWithThreshold's take over the candidates (indices idx, values cv, both c long, in index order):
// every value above tau and the first `ties` equal to it, until `most` are taken; the taken indices are
// compacted to the front of idx, in place (TakeAboveAvx512 with AVX-512). Returns their count.
size_t TakeCandidates(int32_t* idx, const float* cv, size_t c, float tau, int ties, size_t most) {
#ifdef KVSIM_SELECT_AVX512
  if (kSelectAvx512 && g_select_avx512_allowed.load(std::memory_order_relaxed))
    return static_cast<size_t>(
        TakeAboveAvx512(cv, static_cast<int>(c), tau, ties, static_cast<int>(most), idx, idx));
#endif
  size_t m = 0;
  for (size_t i = 0; i < c && m < most; ++i) {
    const float s = cv[i];
    const bool tie = s == tau && ties > 0;
    idx[m] = idx[i];
    m += (s > tau) | tie;
    ties -= tie;
  }
  return m;
}
}  // namespace

bool RowBuckets::TopK(int r, std::span<const float> values, int k, std::vector<float>* scratch,
                      std::vector<int32_t>* out) const {
  const Row& row = rows_[r];
  KVSIM_CHECK_MSG(k >= 1, "RowBuckets::TopK: k must be at least 1");
  if (row.nb < 0 || k > row.n) return false;
  const int32_t* cc = cc_.data() + row.bucket;
  if (k > cc[row.nb]) return false;  // the k-th largest value is 0
  // The bucket j with cc[j] < k <= cc[j + 1] holds the k-th largest value (as Kth); the candidates are the
  // cc[j + 1] values of buckets j and above (bucket numbers hi - j and up: bit patterns from their bucket's).
  const int j = static_cast<int>(std::upper_bound(cc, cc + row.nb + 1, k - 1) - cc) - 1;
  const uint32_t bucket = row.hi - static_cast<uint32_t>(j);
  if (bucket == 0) return false;  // it may be a zero (bucket 0 holds the zeros): not the rule read here
  const size_t nc = static_cast<size_t>(cc[j + 1]), nbk = static_cast<size_t>(cc[j + 1] - cc[j]);
  // Room for the whole row in each output (and the stores' 16 spare places), so that even a row that is not
  // the one counted (the check below) writes only within them.
  const size_t n = values.size();
  if (out->size() < n + 16) out->resize(n + 16);
  if (scratch->size() < 2 * n + 32) scratch->resize(2 * n + 32);
  float* cv = scratch->data();
  float* bv = cv + n + 16;
  const size_t got =
      CompressFrom(values.data(), values.size(), bucket << kBucketShift, bucket, out->data(), cv, bv);
  KVSIM_CHECK_MSG(got == nc, "RowBuckets::TopK: the row is not the one counted");
  // The threshold: Kth's selection in the same bucket values, in the same order.
  const int need = k - cc[j];
  std::nth_element(bv, bv + (need - 1), bv + nbk, std::greater<float>());
  const float tau = bv[need - 1];
  int above = cc[j];  // every value of the buckets above is above tau; then the bucket's
  for (size_t i = 0; i < nbk; ++i) above += bv[i] > tau;
  out->resize(TakeCandidates(out->data(), cv, nc, tau, k - above, static_cast<size_t>(k)));
  return true;
}

void RowBuckets::Sums(int r, std::span<const float> values, std::span<const int32_t> ks, const RowSums* known,
                      double* out) const {
  const Row& row = rows_[r];
  if (row.nb < 0) return DescendingSums(values, ks, known, out);
  SumsFromCounts(values, ks, row.sum, cc_.data() + row.bucket, row.hi, row.nb, out);
}

}  // namespace kvsim
