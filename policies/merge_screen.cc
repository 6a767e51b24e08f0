#include "policies/merge_screen.h"

#include "policies/merge_screen_int16.h"
#include "sim/cpu.h"

// GCC 12 warns "may be used uninitialized" inside its own AVX-512 intrinsics (the _mm512_undefined_*
// pass-through operands of the unmasked forms): a known false positive, silenced for this header only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace kvsim::merge_screen {
namespace {

bool CpuSupports() {
  return CpuHas(CpuFeature::kAvx512f) && CpuHas(CpuFeature::kAvx512bw) && CpuHas(CpuFeature::kAvx512vl) &&
         CpuHas(CpuFeature::kAvx512bf16);
}

const bool kSupported = CpuSupports();
// int16::Supported(), read here without another file's static initialiser (their order is unspecified).
const bool kInt16Supported = CpuHas(CpuFeature::kAvx2);

// KVSIM_MERGE_SCREEN (read once): 0 = no screen; bf16 / int16 = that screen where the CPU runs it, else none;
// unset, empty or 1 = the default: int16 where the CPU has AVX2 (round 25: faster than bf16 on an AVX512-BF16
// CPU, docs/performance.md), else bf16 where it has AVX512-BF16, else none.
Screen ScreenFromEnv() {
  const char* v = std::getenv("KVSIM_MERGE_SCREEN");
  const std::string s = v != nullptr ? v : "";
  if (s == "0") return Screen::kNone;
  if (s == "bf16") return kSupported ? Screen::kBf16 : Screen::kNone;
  if (s == "int16") return kInt16Supported ? Screen::kInt16 : Screen::kNone;
  return kInt16Supported ? Screen::kInt16 : kSupported ? Screen::kBf16 : Screen::kNone;
}

const Screen kFromEnv = ScreenFromEnv();
std::atomic<Screen> g_screen{kFromEnv};
std::atomic<bool> g_test_enabled{true};
const bool kAvx2Fma = CpuHas(CpuFeature::kAvx2) && CpuHas(CpuFeature::kFma);
std::atomic<bool> g_test_avx2{true};

// float -> bf16, round to nearest even (finite inputs; subnormals stay subnormal bf16, which vdpbf16ps
// then reads as zero: both within the bound below).
inline uint32_t Bf16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

#if defined(__x86_64__) && defined(__GNUC__)
#define KVSIM_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// QR queries x TV target vectors (16 targets each) of accumulators: no horizontal sums, every lane is one
// (query, target) pair summed over the dimension pairs in order.
template <int QR, int TV>
KVSIM_BF16_TARGET inline __attribute__((always_inline)) void Block(const uint32_t* q, int pairs,
                                                                   const uint32_t* t, float* out, long ld) {
  __m512 acc[QR][TV];
  for (int r = 0; r < QR; ++r)
    for (int v = 0; v < TV; ++v) acc[r][v] = _mm512_setzero_ps();
  const long group = static_cast<long>(pairs) * 16;  // words per 16-target group
  for (int p = 0; p < pairs; ++p) {
    __m512bh tv[TV];
    for (int v = 0; v < TV; ++v) tv[v] = (__m512bh)_mm512_loadu_si512(t + v * group + p * 16);
    for (int r = 0; r < QR; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[static_cast<long>(r) * pairs + p]));
      for (int v = 0; v < TV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], qb, tv[v]);
    }
  }
  for (int r = 0; r < QR; ++r)
    for (int v = 0; v < TV; ++v) _mm512_storeu_ps(out + r * ld + v * 16, acc[r][v]);
}

template <int QR>
KVSIM_BF16_TARGET void Rows(const uint32_t* q, int pairs, const uint32_t* t, int groups, float* out,
                            long ld) {
  const long group = static_cast<long>(pairs) * 16;
  int g = 0;
  for (; g + 4 <= groups; g += 4) Block<QR, 4>(q, pairs, t + g * group, out + g * 16, ld);
  switch (groups - g) {
    case 3:
      Block<QR, 3>(q, pairs, t + g * group, out + g * 16, ld);
      break;
    case 2:
      Block<QR, 2>(q, pairs, t + g * group, out + g * 16, ld);
      break;
    case 1:
      Block<QR, 1>(q, pairs, t + g * group, out + g * 16, ld);
      break;
    default:
      break;
  }
}

KVSIM_BF16_TARGET void ApproxDotsAvx512(const uint32_t* q, int nq, const uint32_t* t, int nt, int d,
                                        float* out, long ld) {
  const int pairs = d / 2, groups = PaddedTargets(nt) / 16;
  constexpr int kQ = 4;
  int r = 0;
  for (; r + kQ <= nq; r += kQ)
    Rows<kQ>(q + static_cast<long>(r) * pairs, pairs, t, groups, out + r * ld, ld);
  for (; r < nq; ++r) Rows<1>(q + static_cast<long>(r) * pairs, pairs, t, groups, out + r * ld, ld);
}
#endif

}  // namespace

Stats& ThreadStats() {
  thread_local Stats stats;
  return stats;
}

bool Supported() { return kSupported; }
bool Enabled() {
  return g_screen.load(std::memory_order_relaxed) == Screen::kBf16 &&
         g_test_enabled.load(std::memory_order_relaxed);
}
bool Int16Enabled() {
  return g_screen.load(std::memory_order_relaxed) == Screen::kInt16 &&
         g_test_enabled.load(std::memory_order_relaxed);
}
Screen ChosenScreen() { return kFromEnv; }
void SetEnabledForTesting(bool enabled) { g_test_enabled.store(enabled, std::memory_order_relaxed); }
void SetScreenForTesting(Screen screen) {
  const bool runs = screen == Screen::kNone || (screen == Screen::kBf16 && kSupported) ||
                    (screen == Screen::kInt16 && kInt16Supported);
  g_screen.store(runs ? screen : Screen::kNone, std::memory_order_relaxed);
}

// The bound. a = q̂ and b = t̂ are rows NearestByCosine normalised (policies/merge.cc NormalizeRows): finite,
// and every row with a nonzero norm was scaled by a normal, finite float inv (the screen is not used
// otherwise). a', b' are the bf16 values the kernel multiplies (a bf16 subnormal read as 0). Notation:
// u = 2^-24 (fp32 unit roundoff), ub = 2^-8 (bf16: 8 significant bits), τ = 2^-126 (the smallest normal
// fp32), γ_d = d u / (1 − d u), rq ≥ ‖a' − a‖, rt ≥ ‖b' − b‖.
//  (0) Norms. s = Σ x_k² in double is within (d + 1) 2^-53 relative of the exact sum (float squares are
//      exact in double), sqrt, the division and the cast to float add 2^-53, 2^-53 and 2^-24; each
//      x_k · inv is rounded with relative error ≤ u, or absolute ≤ 2^-150 if it is subnormal. So
//      ‖a‖ ≤ (1 + 2^-23)(1 + d 2^-52) + √d 2^-150 ≤ N := 1 + 2^-20 for d ≤ 2^16 (zero rows: ‖a‖ = 0).
//  (1) bf16 rounding. Σ a'_k b'_k − Σ a_k b_k = Σ (a'_k − a_k) b'_k + Σ a_k (b'_k − b_k), so by Cauchy-
//      Schwarz its size is ≤ rq ‖b'‖ + ‖a‖ rt ≤ E1 = rq (N + rt) + N rt. a priori (ErrorBound(d)):
//      |a'_k − a_k| ≤ ub |a_k| for a normal a_k (round to nearest even; |a_k| ≤ N, no overflow) and < τ for
//      a subnormal one (read as 0), so rq, rt ≤ ub N + √d τ; E1 ≈ 2^-7 = 0.0078 for d = 128.
//  (2) The kernel. A product of two bf16 numbers is exact in fp32 (8 x 8 significant bits) unless it
//      underflows, when FTZ loses < τ; vdpbf16ps adds two products to the fp32 accumulator per step, at
//      most two roundings (each ≤ u relative, or < τ when FTZ flushes a subnormal result). d products and
//      d additions in all: E2 = γ_d Σ|a'_k b'_k| + 2 d τ, Σ|a'_k b'_k| ≤ ‖a'‖ ‖b'‖ ≤ (N + rq)(N + rt).
//  (3) Today's value: sgemm's result is a sequential fmaf chain over k (docs/performance.md, round 6; no
//      FTZ: each fma rounds with relative error ≤ u, or absolute ≤ 2^-150). E3 = γ_d N² + d 2^-149.
// |approx − value| ≤ E1 + E2 + E3; E2 + E3 ≈ 1.5·10^-5 for d = 128. Returned times kSafetyFactor, which
// covers a vdpbf16ps that rounds its intermediate sums differently from the model in (2) (e.g. truncating:
// 2u instead of u) many times over. The bound's test (tests/policies/merge_test.cc) reaches 98% of
// E1 + E2 + E3 with adversarial rows. rq, rt are computed in double from exact float differences: their
// squares are exact, the sum of d of them and the square root add ≤ (d + 2) 2^-53 relative, which the
// factor (1 + 2^-40) applied to them covers.
double ErrorBound(int d, double rq, double rt) {
  const double u = std::ldexp(1.0, -24), tau = std::ldexp(1.0, -126);
  const double n = 1.0 + std::ldexp(1.0, -20);
  const double gamma = d * u / (1.0 - d * u);
  const double e1 = rq * (n + rt) + n * rt;
  const double e2 = gamma * (n + rq) * (n + rt) + 2 * d * tau;
  const double e3 = gamma * n * n + d * std::ldexp(1.0, -149);
  return kSafetyFactor * (e1 + e2 + e3);
}

double ErrorBound(int d) {
  const double r = std::ldexp(1.0, -8) * (1.0 + std::ldexp(1.0, -20)) +
                   std::sqrt(static_cast<double>(d)) * std::ldexp(1.0, -126);
  return ErrorBound(d, r, r);
}

namespace {

// The value vdpbf16ps reads for a bf16 word: subnormals as zero.
inline float Bf16Value(uint32_t h) { return (h & 0x7f80u) == 0 ? 0.0f : std::bit_cast<float>(h << 16); }

// Packs one row's pair p into a word and adds the squared rounding errors to `e2`.
inline uint32_t PackPair(const float* x, int p, double* e2) {
  const uint32_t lo = Bf16(x[2 * p]), hi = Bf16(x[2 * p + 1]);
  const double dl = static_cast<double>(Bf16Value(lo)) - x[2 * p];  // exact: a difference of two floats
  const double dh = static_cast<double>(Bf16Value(hi)) - x[2 * p + 1];
  *e2 += dl * dl + dh * dh;
  return lo | hi << 16;
}

constexpr double kErrUp = 1.0 + 0x1p-40;  // the rounding of the computed norms (above)

}  // namespace

#if defined(__x86_64__) && defined(__GNUC__)
// PackQueries for d % 16 == 0 with vcvtneps2bf16 (round to nearest even; a subnormal input gives 0, as the
// kernel would read it) and the errors' squares summed in double lanes (any order: an upper bound is all
// that is needed, kErrUp covers the sum's rounding).
KVSIM_BF16_TARGET void PackQueriesAvx512(const float* rows, int n, int d, uint32_t* out, double* err) {
  for (int r = 0; r < n; ++r) {
    const float* x = rows + static_cast<long>(r) * d;
    uint16_t* o = reinterpret_cast<uint16_t*>(out + static_cast<long>(r) * (d / 2));
    __m512d acc = _mm512_setzero_pd();
    for (int k = 0; k < d; k += 16) {
      const __m512 v = _mm512_loadu_ps(x + k);
      const __m256i b = (__m256i)_mm512_cvtneps_pbh(v);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), b);
      const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
      const __m512 diff = _mm512_sub_ps(back, v);  // exact: a float minus its rounding to 8 bits
      const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(diff));
      const __m512d hi =
          _mm512_cvtps_pd(_mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(diff), 1)));
      acc = _mm512_fmadd_pd(lo, lo, acc);  // exact squares of floats in double
      acc = _mm512_fmadd_pd(hi, hi, acc);
    }
    err[r] = std::sqrt(_mm512_reduce_add_pd(acc)) * kErrUp;
  }
}
#endif

void PackQueries(const float* rows, int n, int d, uint32_t* out, double* err) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (kSupported && d % 16 == 0) return PackQueriesAvx512(rows, n, d, out, err);
#endif
  const int pairs = d / 2;
  for (int r = 0; r < n; ++r) {
    const float* x = rows + static_cast<long>(r) * d;
    uint32_t* o = out + static_cast<long>(r) * pairs;
    double e2 = 0;
    for (int p = 0; p < pairs; ++p) o[p] = PackPair(x, p, &e2);
    err[r] = std::sqrt(e2) * kErrUp;
  }
}

double PackTargets(const float* rows, int n, int d, uint32_t* out) {
  const int pairs = d / 2, groups = PaddedTargets(n) / 16;
  double worst = 0;
  for (int g = 0; g < groups; ++g)
    for (int i = 0; i < 16; ++i) {
      const int j = g * 16 + i;
      uint32_t* o = out + static_cast<long>(g) * pairs * 16 + i;
      if (j >= n) {
        for (int p = 0; p < pairs; ++p) o[p * 16] = 0;
        continue;
      }
      const float* x = rows + static_cast<long>(j) * d;
      double e2 = 0;
      for (int p = 0; p < pairs; ++p) o[p * 16] = PackPair(x, p, &e2);
      worst = std::max(worst, e2);
    }
  return std::sqrt(worst) * kErrUp;
}

void ApproxDots(const uint32_t* queries, int num_queries, const uint32_t* targets, int num_targets, int d,
                float* approx, long ld) {
#if defined(__x86_64__) && defined(__GNUC__)
  ApproxDotsAvx512(queries, num_queries, targets, num_targets, d, approx, ld);
#else
  (void)queries, (void)num_queries, (void)targets, (void)num_targets, (void)d, (void)approx, (void)ld;
  std::abort();  // callers check Supported()
#endif
}

#if defined(__x86_64__) && defined(__GNUC__)
namespace {
int ExactDotsAvx2(const float* const* a, const float* const* b, int n, int d, float* out);
}  // namespace
#endif

void ExactDots(const float* const* a, const float* const* b, int n, int d, float* out) {
  constexpr int kChains = 8;
  int i = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  if (ExactAvx2()) i = ExactDotsAvx2(a, b, n, d, out);  // the groups of 8 pairs; the rest below
#endif
  for (; i + kChains <= n; i += kChains) {
    float acc[kChains] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < d; ++k)
      for (int c = 0; c < kChains; ++c) acc[c] = std::fma(a[i + c][k], b[i + c][k], acc[c]);
    for (int c = 0; c < kChains; ++c) out[i + c] = acc[c];
  }
  for (; i < n; ++i) {
    float acc = 0;
    for (int k = 0; k < d; ++k) acc = std::fma(a[i][k], b[i][k], acc);
    out[i] = acc;
  }
}

// ---- the exact search (round 10) ----

bool ExactAvx2() { return kAvx2Fma && g_test_avx2.load(std::memory_order_relaxed); }
void SetExactAvx2ForTesting(bool enabled) { g_test_avx2.store(enabled, std::memory_order_relaxed); }

void PackExactTargets(const float* rows, int n, int d, float* out) {
  const int groups = ExactPaddedTargets(n) / 8;
  for (int g = 0; g < groups; ++g) {
    float* o = out + static_cast<long>(g) * d * 8;
    for (int i = 0; i < 8; ++i) {
      const int j = g * 8 + i;
      if (j >= n) {
        for (int k = 0; k < d; ++k) o[k * 8 + i] = 0.0f;
        continue;
      }
      const float* x = rows + static_cast<long>(j) * d;
      for (int k = 0; k < d; ++k) o[k * 8 + i] = x[k];
    }
  }
}

namespace {

// The running first maximum of a query row, one lane per target residue j % 8: the lane's largest value so
// far (−inf: none yet; a NaN is never taken) and its first index; and v_0 (the scan's start, for NaN).
struct alignas(32) LaneBest {
  float value[8];
  int32_t index[8];
  float first;
};

void InitBest(LaneBest* best, int rows) {
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < 8; ++i)
      best[r].value[i] = -std::numeric_limits<float>::infinity(), best[r].index[i] = -1;
    best[r].first = 0.0f;
  }
}

// The scan's answer from the lanes: the largest lane value, the smallest index among the lanes holding it
// (each lane holds its own first index of its largest value, so that is the first index overall), with
// that lane's bits (−0 and +0 compare equal; the chosen entry's own bits are returned). If no lane took a
// value (every value NaN or −inf) or v_0 is NaN, the scan never moves: index 0, v_0.
void FinishBest(const LaneBest& b, int* nearest, float* similarity) {
  int lane = -1;
  for (int i = 0; i < 8; ++i)
    if (b.index[i] >= 0 && (lane < 0 || b.value[i] > b.value[lane] ||
                            (b.value[i] == b.value[lane] && b.index[i] < b.index[lane])))
      lane = i;
  if (lane < 0 || std::isnan(b.first)) {
    *nearest = 0;
    *similarity = b.first;
    return;
  }
  *nearest = b.index[lane];
  *similarity = b.value[lane];
}

// The portable search: one fmaf chain per pair (ExactDots' loop), the scan of FirstMaxIndex.
void ExactScalar(const float* q, int nq, const float* tp, int nt, int d, int* nearest, float* similarity,
                 float* out, long ld) {
  for (int r = 0; r < nq; ++r) {
    const float* qr = q + static_cast<long>(r) * d;
    int best = 0;
    float bv = 0.0f;
    for (int j = 0; j < nt; ++j) {
      const float* t = tp + static_cast<long>(j / 8) * d * 8 + j % 8;
      float acc = 0.0f;
      for (int k = 0; k < d; ++k) acc = std::fma(qr[k], t[k * 8], acc);
      if (out != nullptr) out[r * ld + j] = acc;
      if (j == 0 || acc > bv) best = j, bv = acc;
    }
    if (nearest != nullptr) nearest[r] = best, similarity[r] = bv;
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define KVSIM_AVX2_TARGET __attribute__((target("avx2,fma")))

// R queries x V groups of 8 targets: R V accumulators, one lane per (query, target) pair, each summed over k
// in order with one vfmadd231ps (q[k] t[k] + acc, rounded once: fmaf(q[k], t[k], acc)) — the fmaf chain,
// lane by lane; lanes are never combined. Then either the values are stored (out) or each query's running
// first maximum is updated (best): lane-wise, in increasing group order, a strictly greater value replaces
// the lane's best; padding targets (j ≥ nt) are masked out.
template <int R, int V>
KVSIM_AVX2_TARGET inline __attribute__((always_inline)) void ExactTile(const float* q, int d, const float* t,
                                                                       int g, int nt, LaneBest* best,
                                                                       float* out, long ld) {
  // The accumulators are only ever indexed by unrolled constants (so they stay in registers: a variable
  // index anywhere made GCC keep the array on the stack and store it on every k), copied out once.
  __m256 acc[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  const long group = static_cast<long>(d) * 8;
  const float* tg = t + g * group;
  for (int k = 0; k < d; ++k) {
    __m256 tv[V];
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) tv[v] = _mm256_loadu_ps(tg + v * group + k * 8);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 qb = _mm256_broadcast_ss(q + static_cast<long>(r) * d + k);
#pragma GCC unroll 16
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(qb, tv[v], acc[r][v]);
    }
  }
  alignas(32) float res[R][V][8];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) _mm256_store_ps(res[r][v], acc[r][v]);
  if (out != nullptr) {
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) {
        const int j0 = (g + v) * 8;
        for (int i = 0; i < 8 && j0 + i < nt; ++i) out[r * ld + j0 + i] = res[r][v][i];
      }
    return;
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i limit = _mm256_set1_epi32(nt);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    LaneBest& b = best[r];
    __m256 bv = _mm256_load_ps(b.value);
    __m256 bi = _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(b.index)));
    if (g == 0) b.first = res[r][0][0];
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) {
      const __m256 x = _mm256_load_ps(res[r][v]);
      const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((g + v) * 8), lane);
      const __m256 take = _mm256_and_ps(_mm256_cmp_ps(x, bv, _CMP_GT_OQ),
                                        _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, idx)));
      bv = _mm256_blendv_ps(bv, x, take);
      bi = _mm256_blendv_ps(bi, _mm256_castsi256_ps(idx), take);
    }
    _mm256_store_ps(b.value, bv);
    _mm256_store_si256(reinterpret_cast<__m256i*>(b.index), _mm256_castps_si256(bi));
  }
}

constexpr int kTileGroups = 3;  // V: 4 x 3 accumulators + 3 target vectors + 1 broadcast = 16 registers
constexpr int kTileRows = 4;    // R

// Rows [0, nq) against groups [g, g + V): R rows at a time, the rest one remainder tile.
template <int V>
KVSIM_AVX2_TARGET void ExactColumn(const float* q, int nq, int d, const float* t, int g, int nt,
                                   LaneBest* best, float* out, long ld) {
  int r = 0;
  for (; r + kTileRows <= nq; r += kTileRows)
    ExactTile<kTileRows, V>(q + static_cast<long>(r) * d, d, t, g, nt, best ? best + r : nullptr,
                            out ? out + r * ld : nullptr, ld);
  const float* qr = q + static_cast<long>(r) * d;
  LaneBest* br = best ? best + r : nullptr;
  float* orow = out ? out + r * ld : nullptr;
  switch (nq - r) {
    case 3:
      ExactTile<3, V>(qr, d, t, g, nt, br, orow, ld);
      break;
    case 2:
      ExactTile<2, V>(qr, d, t, g, nt, br, orow, ld);
      break;
    case 1:
      ExactTile<1, V>(qr, d, t, g, nt, br, orow, ld);
      break;
    default:
      break;
  }
}

// Target tiles of V groups (V d 32 bytes: 12 KiB at d = 128, in L1) in increasing order, each against every
// query row (the query block stays in L2): each lane's best sees its targets in slot order.
KVSIM_AVX2_TARGET void ExactAvx2Search(const float* q, int nq, const float* t, int nt, int d, LaneBest* best,
                                       float* out, long ld) {
  const int groups = ExactPaddedTargets(nt) / 8;
  int g = 0;
  for (; g + kTileGroups <= groups; g += kTileGroups)
    ExactColumn<kTileGroups>(q, nq, d, t, g, nt, best, out, ld);
  switch (groups - g) {
    case 2:
      ExactColumn<2>(q, nq, d, t, g, nt, best, out, ld);
      break;
    case 1:
      ExactColumn<1>(q, nq, d, t, g, nt, best, out, ld);
      break;
    default:
      break;
  }
}

// Transposes 8 rows of 8 floats: afterwards r[k] lane c = row c's element k.
KVSIM_AVX2_TARGET inline __attribute__((always_inline)) void Transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20), r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20), r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31), r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31), r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// ExactDots' groups of 8 pairs with AVX2 + FMA (issue 14, round 13): lane c of one register is pair c's
// chain. Eight dimensions of the 8 a rows and of the 8 b rows are loaded and transposed (lane c = pair c,
// one register per k), then summed in order k, k + 1, … with one vfmadd231ps each: lane c computes
// fmaf(a_c[k], b_c[k], acc_c) for k = 0..d-1 from +0, the same chain as the scalar loop (lanes never mix);
// the last d % 8 dimensions continue each lane's chain with scalar fmaf. Returns the pairs done (n - n % 8).
KVSIM_AVX2_TARGET int ExactDotsAvx2(const float* const* a, const float* const* b, int n, int d, float* out) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const float* const* pa = a + i;
    const float* const* pb = b + i;
    __m256 acc = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= d; k += 8) {
      __m256 x[8], y[8];
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) x[c] = _mm256_loadu_ps(pa[c] + k), y[c] = _mm256_loadu_ps(pb[c] + k);
      Transpose8(x);
      Transpose8(y);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) acc = _mm256_fmadd_ps(x[j], y[j], acc);
    }
    _mm256_storeu_ps(out + i, acc);
    for (; k < d; ++k)
      for (int c = 0; c < 8; ++c) out[i + c] = std::fma(pa[c][k], pb[c][k], out[i + c]);
  }
  return i;
}
#endif

}  // namespace

void ExactNearest(const float* queries, int num_queries, const float* packed_targets, int num_targets, int d,
                  int* nearest, float* similarity) {
  if (num_queries <= 0 || num_targets <= 0) return;
#if defined(__x86_64__) && defined(__GNUC__)
  if (ExactAvx2()) {
    thread_local std::vector<LaneBest> best_buf;
    if (best_buf.size() < static_cast<size_t>(num_queries)) best_buf.resize(num_queries);
    LaneBest* best = best_buf.data();
    InitBest(best, num_queries);
    ExactAvx2Search(queries, num_queries, packed_targets, num_targets, d, best, nullptr, 0);
    for (int r = 0; r < num_queries; ++r) FinishBest(best[r], nearest + r, similarity + r);
    return;
  }
#endif
  ExactScalar(queries, num_queries, packed_targets, num_targets, d, nearest, similarity, nullptr, 0);
}

void ExactDotsPacked(const float* queries, int num_queries, const float* packed_targets, int num_targets,
                     int d, float* out, long ld) {
  if (num_queries <= 0 || num_targets <= 0) return;
#if defined(__x86_64__) && defined(__GNUC__)
  if (ExactAvx2())
    return ExactAvx2Search(queries, num_queries, packed_targets, num_targets, d, nullptr, out, ld);
#endif
  ExactScalar(queries, num_queries, packed_targets, num_targets, d, nullptr, nullptr, out, ld);
}

}  // namespace kvsim::merge_screen
