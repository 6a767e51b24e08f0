#include "policies/merge_screen_int16.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "policies/merge_screen.h"
#include "sim/cpu.h"

// The bound. a = q̂ and b = t̂ are rows NearestByCosine normalised (finite, ‖·‖ ≤ N := 1 + 2^-20; see
// merge_screen.cc (0)); a', b' are the fixed-point values the kernel multiplies, a'_k = round(a_k 2^14) /
// 2^14 (nearest, ties to even), and rq ≥ ‖a' − a‖, rt ≥ ‖b' − b‖ (PackQueries / PackTargets compute them).
//  (1) Range. |a_k| ≤ N, so |round(a_k 2^14)| ≤ 16384 < 2^15: every coordinate fits an int16. Every partial
//      sum the kernel forms (a vpmaddwd pair, or the pairs summed so far in a lane) is a sum over a subset
//      of k of products of two such integers, so by Cauchy-Schwarz its size is ≤ ‖2^14 a'‖ ‖2^14 b'‖ ≤
//      (2^14 N + √d / 2)² < 2.8 · 10^8 < 2^31 for d ≤ 2^16: int32 never overflows, and the kernel's S is
//      the exact integer Σ_k 2^14 a'_k · 2^14 b'_k, i.e. S / 2^28 = Σ a'_k b'_k exactly (no rounding at all).
//  (2) Σ a'_k b'_k − Σ a_k b_k = Σ (a'_k − a_k) b'_k + Σ a_k (b'_k − b_k), at most rq (N + rt) + N rt = E1
//      in size (Cauchy-Schwarz; merge_screen.cc (1)).
//  (3) The value NearestByCosine compares is the fmaf chain v = ExactDots(a, b): |v − Σ a_k b_k| ≤ E3 =
//      γ_d N² + d 2^-149 (merge_screen.cc (3)).
// So |S / 2^28 − v| ≤ E1 + E3 ≤ ε := merge_screen::ErrorBound(d, rq, rt) (which adds the bf16 kernel's
// E2 ≥ 0 and the safety factor). The screen: let j* be the first target with v = V := max v, and m a
// target with the largest S. S_j* / 2^28 ≥ V − ε and S_m / 2^28 ≤ v_m + ε ≤ V + ε, so S_j* ≥ S_m − 2ε 2^28
// ≥ S_m − Slack: j* is a candidate, and NearestByCosine's first maximum over the candidates' exact values is
// j* with value V (merge.cc, ScreenBlock). A slack saturated at 2^30 makes every target a candidate
// (S_m − 2^30 < −2.8 · 10^8 ≤ every S), which is still correct. rq, rt: each a'_k − a_k is a difference
// of two floats within 2^-15 of each other, exact in double, and so is its square; the sum of d squares and
// the square root add ≤ (d + 2) 2^-53 relative, covered by the factor 1 + 2^-40.

namespace kvsim::merge_screen::int16 {
namespace {

constexpr double kErrUp = 1.0 + 0x1p-40;
constexpr float kScale = 16384.0f;  // 2^kShift
static_assert(kShift == 14, "kScale and the range argument assume 2^14");

const bool kSupported = CpuHas(CpuFeature::kAvx2);
std::atomic<bool> g_vector_pack{true};

// round(x 2^14), nearest, ties to even (x 2^14 is exact: a power-of-two scaling of a float of size ≤ 2).
inline int16_t Fixed(float x) { return static_cast<int16_t>(std::nearbyint(x * kScale)); }

// The squared rounding error of one coordinate, exactly.
inline double Err2(float x, int16_t q) {
  const double e = static_cast<double>(q) / kScale - static_cast<double>(x);
  return e * e;
}

#if defined(__x86_64__) && defined(__GNUC__)
#define KVSIM_INT16_TARGET __attribute__((target("avx2")))

// R query rows x V groups of 8 targets of int32 accumulators, the dimension pairs in order.
template <int R, int V>
KVSIM_INT16_TARGET inline __attribute__((always_inline)) void Block(const int16_t* q, int pairs,
                                                                    const int32_t* t, int32_t* out, long ld) {
  __m256i acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_si256();
  const long group = static_cast<long>(pairs) * 8;  // words per group of 8 targets
  for (int p = 0; p < pairs; ++p) {
    __m256i tv[V];
    for (int v = 0; v < V; ++v)
      tv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + v * group + p * 8));
    for (int r = 0; r < R; ++r) {
      int32_t word;  // the query's pair p (memcpy: the buffer holds int16)
      std::memcpy(&word, q + 2 * (static_cast<long>(r) * pairs + p), sizeof word);
      const __m256i qb = _mm256_set1_epi32(word);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(qb, tv[v]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ld + v * 8), acc[r][v]);
}

template <int R>
KVSIM_INT16_TARGET void Rows(const int16_t* q, int pairs, const int32_t* t, int groups, int32_t* out,
                             long ld) {
  const long group = static_cast<long>(pairs) * 8;
  int g = 0;
  for (; g + 2 <= groups; g += 2) Block<R, 2>(q, pairs, t + g * group, out + g * 8, ld);
  if (g < groups) Block<R, 1>(q, pairs, t + g * group, out + g * 8, ld);
}

// Up to kRows query rows (row r at q + r d) against every group: out row r at out + r ld.
constexpr int kRows = 6;  // 6 rows x 2 groups = 12 accumulators (+ 2 targets + 1 query word: 15 registers)
KVSIM_INT16_TARGET void RowsN(int rows, const int16_t* q, int d, const int32_t* t, int groups, int32_t* out,
                              long ld) {
  const int pairs = d / 2;
  switch (rows) {
    case 6:
      return Rows<6>(q, pairs, t, groups, out, ld);
    case 5:
      return Rows<5>(q, pairs, t, groups, out, ld);
    case 4:
      return Rows<4>(q, pairs, t, groups, out, ld);
    case 3:
      return Rows<3>(q, pairs, t, groups, out, ld);
    case 2:
      return Rows<2>(q, pairs, t, groups, out, ld);
    case 1:
      return Rows<1>(q, pairs, t, groups, out, ld);
    default:
      std::abort();
  }
}

KVSIM_INT16_TARGET void DotsAvx2(const int16_t* queries, int nq, const int16_t* targets, int nt, int d,
                                 int32_t* out, long ld) {
  const int groups = PaddedTargets(nt) / 8;
  const int32_t* t = reinterpret_cast<const int32_t*>(targets);
  for (int r = 0; r < nq; r += kRows)
    RowsN(std::min(kRows, nq - r), queries + static_cast<long>(r) * d, d, t, groups, out + r * ld, ld);
}

// The candidates of `rows` (≤ kRows) query rows whose products are in buf (row stride ld, padding set to
// INT32_MIN); with `floor`, only those with S ≥ floor[r] too.
KVSIM_INT16_TARGET void Collect(const int32_t* buf, long ld, int rows, int r0, const int64_t* slack,
                                const int64_t* floor, std::vector<int>* out_rows, std::vector<int>* out_idx) {
  for (int r = 0; r < rows; ++r) {
    const int32_t* s = buf + r * ld;
    __m256i mx = _mm256_set1_epi32(INT32_MIN);
    for (long j = 0; j < ld; j += 8)
      mx = _mm256_max_epi32(mx, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + j)));
    int32_t lane[8];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lane), mx);
    int32_t m = lane[0];
    for (int k = 1; k < 8; ++k) m = std::max(m, lane[k]);
    // m ≥ −2.8e8 and the slack ≤ 2^30: no overflow; S ≥ m − slack ⟺ S > m − slack − 1.
    // A floor above every S (> 2^30) leaves no candidate; one below every S (< −2^30) changes nothing.
    int64_t lo = m - std::min<int64_t>(slack[r0 + r], int64_t{1} << 30);
    if (floor != nullptr)
      lo = std::max(lo, std::clamp<int64_t>(floor[r0 + r], -(int64_t{1} << 30), int64_t{1} << 30));
    const int32_t below = static_cast<int32_t>(lo - 1);
    const __m256i th = _mm256_set1_epi32(below);
    for (long j = 0; j < ld; j += 8) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + j));
      unsigned mask =
          static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(v, th))));
      for (; mask != 0; mask &= mask - 1) {
        out_rows->push_back(r0 + r);
        out_idx->push_back(static_cast<int>(j) + std::countr_zero(mask));
      }
    }
  }
}

// PackQueries for d % 16 == 0: vcvtps2dq rounds to nearest even as nearbyint does (the default MXCSR
// mode), and the squared errors are summed in double lanes (any order: only an upper bound is needed,
// kErrUp covers the sum's rounding). Each error is exact in float (see the bound above), its square in
// double.
KVSIM_INT16_TARGET void PackQueriesAvx2(const float* rows, int n, int d, int16_t* out, double* err) {
  const __m256 up = _mm256_set1_ps(kScale), down = _mm256_set1_ps(1.0f / kScale);
  for (int r = 0; r < n; ++r) {
    const float* x = rows + static_cast<long>(r) * d;
    int16_t* o = out + static_cast<long>(r) * d;
    __m256d acc = _mm256_setzero_pd();
    for (int k = 0; k < d; k += 16) {
      const __m256 v0 = _mm256_loadu_ps(x + k), v1 = _mm256_loadu_ps(x + k + 8);
      const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, up));
      const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, up));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8));
      for (const __m256 e : {_mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(i0), down), v0),
                             _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(i1), down), v1)}) {
        const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(e));
        const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1));
        acc = _mm256_fmadd_pd(lo, lo, acc);
        acc = _mm256_fmadd_pd(hi, hi, acc);
      }
    }
    double lane[4];
    _mm256_storeu_pd(lane, acc);
    err[r] = std::sqrt((lane[0] + lane[1]) + (lane[2] + lane[3])) * kErrUp;
  }
}

KVSIM_INT16_TARGET void CandidatesAvx2(const int16_t* queries, int nq, const int16_t* targets, int nt, int d,
                                       const int64_t* slack, const int64_t* floor, std::vector<int>* out_rows,
                                       std::vector<int>* out_idx) {
  thread_local std::vector<int32_t> buf;
  const int groups = PaddedTargets(nt) / 8;
  const long ld = PaddedTargets(nt);
  if (buf.size() < static_cast<size_t>(kRows * ld)) buf.resize(kRows * ld);
  const int32_t* t = reinterpret_cast<const int32_t*>(targets);
  for (int r = 0; r < nq; r += kRows) {
    const int rows = std::min(kRows, nq - r);
    RowsN(rows, queries + static_cast<long>(r) * d, d, t, groups, buf.data(), ld);
    for (int i = 0; i < rows; ++i) std::fill(buf.data() + i * ld + nt, buf.data() + (i + 1) * ld, INT32_MIN);
    Collect(buf.data(), ld, rows, r, slack, floor, out_rows, out_idx);
  }
}
#endif

}  // namespace

bool Supported() { return kSupported; }
void SetVectorPackForTesting(bool enabled) { g_vector_pack.store(enabled, std::memory_order_relaxed); }

void PackQueries(const float* rows, int n, int d, int16_t* out, double* err) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (kSupported && d % 16 == 0 && g_vector_pack.load(std::memory_order_relaxed))
    return PackQueriesAvx2(rows, n, d, out, err);
#endif
  for (int r = 0; r < n; ++r) {
    const float* x = rows + static_cast<long>(r) * d;
    int16_t* o = out + static_cast<long>(r) * d;
    double e2 = 0;
    for (int k = 0; k < d; ++k) {
      o[k] = Fixed(x[k]);
      e2 += Err2(x[k], o[k]);
    }
    err[r] = std::sqrt(e2) * kErrUp;
  }
}

double PackTargets(const float* rows, int n, int d, int16_t* out) {
  // Each row packed as a query (the same words and error), then its pairs spread with a stride of 8.
  thread_local std::vector<int16_t> packed;
  thread_local std::vector<double> err;
  thread_local std::vector<const int16_t*> row;
  if (packed.size() < static_cast<size_t>(n) * d) packed.resize(static_cast<size_t>(n) * d);
  if (err.size() < static_cast<size_t>(n)) err.resize(n);
  PackQueries(rows, n, d, packed.data(), err.data());
  row.resize(n);
  for (int j = 0; j < n; ++j) row[j] = packed.data() + static_cast<long>(j) * d;
  return SpreadTargets(row.data(), err.data(), n, d, out);
}

double SpreadTargets(const int16_t* const* rows, const double* err, int n, int d, int16_t* out) {
  const int pairs = d / 2, groups = PaddedTargets(n) / 8;
  double worst = 0;
  for (int g = 0; g < groups; ++g)
    for (int i = 0; i < 8; ++i) {
      const int j = g * 8 + i;
      int16_t* og = out + 2 * (static_cast<long>(g) * pairs * 8 + i);
      if (j >= n) {
        for (int p = 0; p < pairs; ++p) og[16 * p] = og[16 * p + 1] = 0;
        continue;
      }
      const int16_t* row = rows[j];
      for (int p = 0; p < pairs; ++p) std::memcpy(og + 16 * p, row + 2 * p, 2 * sizeof(int16_t));
      worst = std::max(worst, err[j]);
    }
  return worst;
}

void Dots(const int16_t* queries, int num_queries, const int16_t* targets, int num_targets, int d,
          int32_t* out, long ld) {
#if defined(__x86_64__) && defined(__GNUC__)
  DotsAvx2(queries, num_queries, targets, num_targets, d, out, ld);
#else
  (void)queries, (void)num_queries, (void)targets, (void)num_targets, (void)d, (void)out, (void)ld;
  std::abort();  // callers check Supported()
#endif
}

void Candidates(const int16_t* queries, int num_queries, const int16_t* targets, int num_targets, int d,
                const int64_t* slack, std::vector<int>* rows, std::vector<int>* idx, const int64_t* floor) {
#if defined(__x86_64__) && defined(__GNUC__)
  CandidatesAvx2(queries, num_queries, targets, num_targets, d, slack, floor, rows, idx);
#else
  (void)queries, (void)num_queries, (void)targets, (void)num_targets, (void)d, (void)slack, (void)rows,
      (void)idx, (void)floor;
  std::abort();  // callers check Supported()
#endif
}

int64_t Slack(int d, double rq, double rt) {
  const double s = std::ceil(2 * merge_screen::ErrorBound(d, rq, rt) * std::ldexp(1.0, 2 * kShift));
  return s >= 0x1p30 ? int64_t{1} << 30 : static_cast<int64_t>(s);
}

}  // namespace kvsim::merge_screen::int16
