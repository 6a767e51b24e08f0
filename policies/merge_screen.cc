#include "policies/merge_screen.h"

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

namespace kvsim::merge_screen {
namespace {

bool CpuSupports() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

bool EnvAllows() {
  const char* v = std::getenv("KVSIM_MERGE_SCREEN");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

const bool kSupported = CpuSupports();
const bool kEnvAllows = EnvAllows();
std::atomic<bool> g_test_enabled{true};

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
bool Enabled() { return kSupported && kEnvAllows && g_test_enabled.load(std::memory_order_relaxed); }
void SetEnabledForTesting(bool enabled) { g_test_enabled.store(enabled, std::memory_order_relaxed); }

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

void ExactDots(const float* const* a, const float* const* b, int n, int d, float* out) {
  constexpr int kChains = 8;
  int i = 0;
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

}  // namespace kvsim::merge_screen
