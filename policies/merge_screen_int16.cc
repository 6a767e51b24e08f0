#include "policies/merge_screen_int16.h"

// GCC 12 warns "may be used uninitialized" inside its own AVX-512 intrinsics (the _mm512_undefined_*
// pass-through operands of the unmasked forms): a known false positive, silenced for this header only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

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
std::atomic<bool> g_int8{true};
bool Int8EnvAllows() {
  const char* v = std::getenv("KVSIM_MERGE_INT8");
  return v == nullptr || std::strcmp(v, "0") != 0;
}
const bool kInt8EnvAllows = Int8EnvAllows();

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

// One query row's int16 products with single targets (the int8 stage's survivors): out[c] = S of target
// idx[c], its words row-major at rows + idx[c] d; the same exact integers as Block's (any order of the
// exact int32 sums, by the range argument above). Four targets at a time.
template <int V>
KVSIM_INT16_TARGET inline __attribute__((always_inline)) void TargetsOf(const int16_t* q, int d,
                                                                        const int16_t* rows, const int* idx,
                                                                        int32_t* out) {
  const int16_t* t[V];
  __m256i acc[V];
  for (int v = 0; v < V; ++v) t[v] = rows + static_cast<long>(idx[v]) * d, acc[v] = _mm256_setzero_si256();
  for (int k = 0; k < d; k += 16) {
    const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k));
    for (int v = 0; v < V; ++v)
      acc[v] = _mm256_add_epi32(
          acc[v], _mm256_madd_epi16(qv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t[v] + k))));
  }
  for (int v = 0; v < V; ++v) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(acc[v]), _mm256_extracti128_si256(acc[v], 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    out[v] = _mm_cvtsi128_si32(s4);
  }
}

KVSIM_INT16_TARGET void RowTargets(const int16_t* q, int d, const int16_t* rows, const int* idx, int n,
                                   int32_t* out) {
  int i = 0;
  for (; i + 4 <= n; i += 4) TargetsOf<4>(q, d, rows, idx + i, out + i);
  switch (n - i) {
    case 3:
      return TargetsOf<3>(q, d, rows, idx + i, out + i);
    case 2:
      return TargetsOf<2>(q, d, rows, idx + i, out + i);
    case 1:
      return TargetsOf<1>(q, d, rows, idx + i, out + i);
    default:
      return;
  }
}

// RowTargets with AVX-512 VNNI (issue 14, round 27), where the int8 stage runs its VNNI kernel and d % 32 ==
// 0: `vpdpwssd` adds 32 word products into 16 int32 lanes per instruction, modulo 2^32 as vpmaddwd + vpaddd
// do, so the sums are the same exact integers (the range argument above).
#define KVSIM_INT16_VNNI_TARGET __attribute__((target("avx2,avx512f,avx512vnni")))

template <int V>
KVSIM_INT16_VNNI_TARGET inline __attribute__((always_inline)) void TargetsOfVnni(const int16_t* q, int d,
                                                                                 const int16_t* rows,
                                                                                 const int* idx,
                                                                                 int32_t* out) {
  const int16_t* t[V];
  __m512i acc[V];
  for (int v = 0; v < V; ++v) t[v] = rows + static_cast<long>(idx[v]) * d, acc[v] = _mm512_setzero_si512();
  for (int k = 0; k < d; k += 32) {
    const __m512i qv = _mm512_loadu_si512(q + k);
    for (int v = 0; v < V; ++v) acc[v] = _mm512_dpwssd_epi32(acc[v], qv, _mm512_loadu_si512(t[v] + k));
  }
  for (int v = 0; v < V; ++v) out[v] = _mm512_reduce_add_epi32(acc[v]);
}

KVSIM_INT16_VNNI_TARGET void RowTargetsVnni(const int16_t* q, int d, const int16_t* rows, const int* idx,
                                            int n, int32_t* out) {
  int i = 0;
  for (; i + 4 <= n; i += 4) TargetsOfVnni<4>(q, d, rows, idx + i, out + i);
  switch (n - i) {
    case 3:
      return TargetsOfVnni<3>(q, d, rows, idx + i, out + i);
    case 2:
      return TargetsOfVnni<2>(q, d, rows, idx + i, out + i);
    case 1:
      return TargetsOfVnni<1>(q, d, rows, idx + i, out + i);
    default:
      return;
  }
}

// The int8 stage for `rows` (≤ kRows) query rows from r0 (merge_screen_int8.cc (3)): their int8 products
// p (row stride ld4) and block maxima bmax (int8::Dots; a block of four groups whose maxima all fall below
// the row's threshold is skipped unread); then per row the list of groups that can hold a candidate (and
// those with an unusable target), their int16 products (compact: the i-th listed group's 8 at buf + 8 i;
// padding INT32_MIN), and the row's candidates by Collect's rule over them — the same list as Collect over
// every product, since the groups left out hold none and do not hold the row maximum (unless no target
// reaches the floor). Left-packing: kPack[m] lists the set bits of m (ascending), padded with zeros.
struct PackTable {
  alignas(8) uint8_t idx[256][8];
  constexpr PackTable() : idx{} {
    for (int m = 0; m < 256; ++m) {
      int n = 0;
      for (int b = 0; b < 8; ++b)
        if (m >> b & 1) idx[m][n++] = static_cast<uint8_t>(b);
    }
  }
};
constexpr PackTable kPack;

KVSIM_INT16_TARGET void Int8Stage(const int16_t* queries, int r0, int rows, int d, const uint8_t* q8,
                                  const int32_t* qs, const double* qn, const double* qe, int nt,
                                  const Narrowed& narrow, const int* bad, int num_bad, const int64_t* slack,
                                  const int64_t* floor, int32_t* p, int32_t* bmax, int32_t* buf, long ld4,
                                  int* list, std::vector<int>* out_rows, std::vector<int>* out_idx) {
  const int groups4 = static_cast<int>(ld4 / 8);  // groups4 % 4 == 0
  const long bld = int8::BlockMaxStride(nt);      // = groups4 * 2: 8 lanes per block of 4 groups
  const uint8_t* unusable = int8::Unusable(narrow.words, nt, d);
  const int16_t* rows16 = int8::Rows16(narrow.words, nt, d);
  int8::Dots(q8 + static_cast<long>(r0) * d, rows, narrow.words, nt, d, p, ld4, bmax);
  const bool vnni = d % 32 == 0 && int8::ChosenKernel() == int8::Kernel::kVnni;
  // The blocks of four groups that hold an unusable target, as bits: always expanded.
  const int blocks = groups4 / 4, words = (blocks + 63) / 64;
  thread_local std::vector<uint64_t> bad_blocks;
  bad_blocks.assign(words, 0);
  for (int k = 0; k < num_bad; ++k) bad_blocks[bad[k] / 256] |= uint64_t{1} << (bad[k] / 4 % 64);
  for (int i = 0; i < rows; ++i) {
    const int r = r0 + i;
    int32_t* pr = p + i * ld4;
    const int32_t* br = bmax + i * bld;
    // Padding never passes below. The row maximum leaves padding and unusable targets out (Dots' block
    // maxima), and every unusable target is listed whatever its P.
    std::fill(pr + nt, pr + ld4, INT32_MIN);
    __m256i mx0 = _mm256_set1_epi32(INT32_MIN), mx1 = mx0;
    long j = 0;
    for (; j + 16 <= bld; j += 16) {
      mx0 = _mm256_max_epi32(mx0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(br + j)));
      mx1 = _mm256_max_epi32(mx1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(br + j + 8)));
    }
    if (j < bld) mx0 = _mm256_max_epi32(mx0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(br + j)));
    __m256i mx = _mm256_max_epi32(mx0, mx1);
    mx = _mm256_max_epi32(mx, _mm256_shuffle_epi32(mx, 0x4E));
    mx = _mm256_max_epi32(mx, _mm256_shuffle_epi32(mx, 0xB1));
    const int32_t m = std::max(_mm256_extract_epi32(mx, 0), _mm256_extract_epi32(mx, 4));
    const int64_t sl = std::min<int64_t>(slack[r], int64_t{1} << 30);
    const int64_t f =
        floor != nullptr ? std::clamp<int64_t>(floor[r], -(int64_t{1} << 30), int64_t{1} << 30) : INT64_MIN;
    // m ≥ INT32_MIN, W ≤ 2^40 + 1, |FloorP| ≤ 2^40 + 1: no overflow in int64.
    int64_t lo = int64_t{m} - int8::Window(qs[r], qn[r], qe[r], narrow.norms, sl);
    if (floor != nullptr) lo = std::max(lo, int8::FloorP(qs[r], qn[r], qe[r], narrow.norms, f));
    // P ≥ lo ⟺ P > lo − 1; INT32_MIN entries never pass.
    const __m256i th =
        _mm256_set1_epi32(static_cast<int32_t>(std::clamp<int64_t>(lo - 1, INT32_MIN, INT32_MAX)));
    // The surviving targets, ascending (left-packed 8 at a time), and every unusable one
    // (merge_screen_int8.cc (3)).
    int n = 0;
    int b = 0;  // next unusable group
    for (int w = 0; w < words; ++w) {
      // Most blocks fail: their maxima tested without a branch, 64 blocks to a word of bits.
      uint64_t hit = bad_blocks[w];
      const int32_t* bw = br + 64 * 8 * w;
      const int end = std::min(64, blocks - 64 * w);
      for (int k = 0; k < end; ++k) {
        const __m256i any =
            _mm256_cmpgt_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bw + 8 * k)), th);
        hit |= uint64_t{_mm256_movemask_ps(_mm256_castsi256_ps(any)) != 0} << k;
      }
      for (; hit != 0; hit &= hit - 1) {
        const int g = 4 * (64 * w + std::countr_zero(hit));
        const __m256i* v = reinterpret_cast<const __m256i*>(pr + g * 8);
        const __m256i g0 = _mm256_cmpgt_epi32(_mm256_loadu_si256(v), th);
        const __m256i g1 = _mm256_cmpgt_epi32(_mm256_loadu_si256(v + 1), th);
        const __m256i g2 = _mm256_cmpgt_epi32(_mm256_loadu_si256(v + 2), th);
        const __m256i g3 = _mm256_cmpgt_epi32(_mm256_loadu_si256(v + 3), th);
        unsigned mk[4] = {static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(g0))),
                          static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(g1))),
                          static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(g2))),
                          static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(g3)))};
        for (; b < num_bad && bad[b] < g + 4; ++b) mk[bad[b] - g] |= unusable[bad[b]];
        for (int k = 0; k < 4; ++k) {
          const __m256i at =
              _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(kPack.idx[mk[k]])));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(list + n),
                              _mm256_add_epi32(at, _mm256_set1_epi32((g + k) * 8)));
          n += std::popcount(mk[k]);
        }
      }
    }
    if (n == 0) continue;
    if (vnni)
      RowTargetsVnni(queries + static_cast<long>(r) * d, d, rows16, list, n, buf);
    else
      RowTargets(queries + static_cast<long>(r) * d, d, rows16, list, n, buf);
    // Collect's rule for this row over these targets (padding is never among them: its P is INT32_MIN).
    int32_t sm = buf[0];
    for (int c = 1; c < n; ++c) sm = std::max(sm, buf[c]);
    int64_t slo = sm - sl;
    if (floor != nullptr) slo = std::max(slo, f);
    // Appended without a branch (about one of the row's n targets is kept).
    const size_t at = out_rows->size();
    out_rows->resize(at + n), out_idx->resize(at + n);
    int* const keep_row = out_rows->data() + at;
    int* const keep_idx = out_idx->data() + at;
    int kept = 0;
    for (int c = 0; c < n; ++c) {
      keep_row[kept] = r, keep_idx[kept] = list[c];
      kept += buf[c] >= slo;
    }
    out_rows->resize(at + kept), out_idx->resize(at + kept);
  }
}

KVSIM_INT16_TARGET void CandidatesAvx2(const int16_t* queries, int nq, const int16_t* targets, int nt, int d,
                                       const int64_t* slack, const int64_t* floor, const Narrowed* narrow,
                                       const int8::NarrowedRows* pre, std::vector<int>* out_rows,
                                       std::vector<int>* out_idx) {
  thread_local std::vector<int32_t> buf, pbuf, bmax, qs;
  thread_local std::vector<uint8_t> q8;
  thread_local std::vector<double> qn, qe;
  thread_local std::vector<int> list, bad;
  const int groups = PaddedTargets(nt) / 8;
  const long ld = PaddedTargets(nt);
  const long ld4 = (ld + 31) / 32 * 32;  // the int8 products' row stride: whole runs of four groups
  if (buf.size() < static_cast<size_t>(kRows * ld)) buf.resize(kRows * ld);
  const int32_t* t = reinterpret_cast<const int32_t*>(targets);
  const bool use8 = narrow != nullptr && narrow->words != nullptr && int8::Applies(d) && Int8Enabled();
  if (use8) {
    if (pbuf.size() < static_cast<size_t>(kRows * ld4)) pbuf.resize(kRows * ld4);
    if (bmax.size() < static_cast<size_t>(kRows * ld4 / 4)) bmax.resize(kRows * ld4 / 4);
    if (q8.size() < static_cast<size_t>(nq) * d) q8.resize(static_cast<size_t>(nq) * d);
    if (qn.size() < static_cast<size_t>(nq)) qn.resize(nq), qe.resize(nq), qs.resize(nq);
    if (list.size() < static_cast<size_t>(ld4 + 8)) list.resize(ld4 + 8);
    if (buf.size() < static_cast<size_t>(ld4 + 8)) buf.resize(ld4 + 8);
    if (pre != nullptr) {  // narrowed already: NarrowQueries' bytes and values, the targets' check here
      for (int r = 0; r < nq; ++r) {
        std::memcpy(q8.data() + static_cast<size_t>(r) * d, pre->bytes[r], d);
        qs[r] = int8::RowScale(d, pre->norm2[r], narrow->norms);
        qn[r] = qs[r] > 0 ? pre->norm[r] : 0, qe[r] = qs[r] > 0 ? pre->err[r] : 0;
      }
    } else {
      int8::NarrowQueries(queries, nq, d, narrow->norms, q8.data(), qs.data(), qn.data(), qe.data());
    }
    const uint8_t* unusable = int8::Unusable(narrow->words, nt, d);
    bad.clear();
    for (int g = 0; g < groups; ++g)
      if (unusable[g] != 0) bad.push_back(g);
  }
  for (int r = 0; r < nq; r += kRows) {
    const int rows = std::min(kRows, nq - r);
    bool ok = use8;
    for (int i = 0; ok && i < rows; ++i) ok = qs[r + i] > 0;
    if (ok) {
      Int8Stage(queries, r, rows, d, q8.data(), qs.data(), qn.data(), qe.data(), nt, *narrow, bad.data(),
                static_cast<int>(bad.size()), slack, floor, pbuf.data(), bmax.data(), buf.data(), ld4,
                list.data(), out_rows, out_idx);
      continue;
    }
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

void SetInt8ForTesting(bool enabled) { g_int8.store(enabled, std::memory_order_relaxed); }
bool Int8Enabled() { return kInt8EnvAllows && g_int8.load(std::memory_order_relaxed); }

void Candidates(const int16_t* queries, int num_queries, const int16_t* targets, int num_targets, int d,
                const int64_t* slack, std::vector<int>* rows, std::vector<int>* idx, const int64_t* floor,
                const Narrowed* narrow, const int8::NarrowedRows* narrowed_queries) {
#if defined(__x86_64__) && defined(__GNUC__)
  CandidatesAvx2(queries, num_queries, targets, num_targets, d, slack, floor, narrow, narrowed_queries, rows,
                 idx);
#else
  (void)queries, (void)num_queries, (void)targets, (void)num_targets, (void)d, (void)slack, (void)rows,
      (void)idx, (void)floor, (void)narrow, (void)narrowed_queries;
  std::abort();  // callers check Supported()
#endif
}

int64_t Slack(int d, double rq, double rt) {
  const double s = std::ceil(2 * merge_screen::ErrorBound(d, rq, rt) * std::ldexp(1.0, 2 * kShift));
  return s >= 0x1p30 ? int64_t{1} << 30 : static_cast<int64_t>(s);
}

}  // namespace kvsim::merge_screen::int16
