#include "policies/merge_screen_int8.h"

// GCC 12 warns "may be used uninitialized" inside its own AVX-512 intrinsics (the _mm512_undefined_*
// pass-through operands of the unmasked forms): a known false positive, silenced for this header only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "sim/cpu.h"

// The bound (issue 14, round 16). A, B are a query's and a target's int16 words (int16::PackQueries /
// PackTargets: any int16 values), S = Σ_k A_k B_k the int16 screen's exact product. With the target scale
// C = kTargetScale and the query row's integer scale c (NarrowQueries), the 8-bit words are t_k =
// clamp(round(C B_k / 2^14), ±64) and q_k = clamp(round(c A_k / 2^14), ±127) (round half up: (x + 2^13)
// >> 14; any rounding would do), and the integer errors β_k = C B_k − 2^14 t_k, α_k = c A_k − 2^14 q_k.
//  (1) The kernel. vpmaddubsw multiplies the unsigned bytes u_k = q_k + 128 ∈ [1, 255] by the signed t_k
//      and adds adjacent pairs into int16 with saturation; |u t + u' t'| ≤ 2 · 255 · 64 = 32640 < 2^15, so
//      never saturates. Each int16 accumulator lane L (a target's dimensions 4p, 4p + 1 for every quad p,
//      or 4p + 2, 4p + 3) starts at −128 Σ_{k∈L} t_k and vpaddw adds modulo 2^16, so at the end it holds
//      Σ_{k∈L} u_k t_k − 128 Σ_{k∈L} t_k = Σ_{k∈L} q_k t_k =: P_L modulo 2^16. By Cauchy-Schwarz |P_L| ≤
//      ‖q‖ ‖t‖ ≤ 32767 when ‖q‖² ‖t‖² ≤ 32767² (NarrowQueries chooses c so, against the usable targets'
//      largest ‖t‖²), so the lane's signed value IS P_L, and vpmaddwd by 1 adds the two lanes of a target
//      exactly: P = Σ_k q_k t_k. (Unusable targets — a clamped word or a long row — may wrap: their P is
//      never read, their groups are always computed.)
//      The VNNI kernel (round 26): `vpdpbusd` adds u_k t_k over a target's 4 dimensions of a quad into its
//      int32 lane, exactly (|Σ u t| ≤ d · 255 · 64 < 2^27 for d ≤ 4096). The lane starts at the sum of the
//      target's two int16 starts (≡ −128 Σ_k t_k modulo 2^16), so at the end it is ≡ P modulo 2^16, and
//      with |P| ≤ 32767 as above its low 16 bits, sign-extended, ARE P: the same values as the AVX2 kernel.
//  (2) c C S − 2^28 P = Σ (2^14 q_k + α_k)(2^14 t_k + β_k) − 2^28 q_k t_k
//                     = 2^14 Σ q_k β_k + 2^14 Σ α_k t_k + Σ α_k β_k,
//      so |c C S − 2^28 P| ≤ E := 2^14 (‖q‖ ‖β‖ + ‖α‖ ‖t‖) + ‖α‖ ‖β‖ (Cauchy-Schwarz, three times). With
//      the usable targets' largest ‖t‖ and ‖β‖ (Norms), E is one number per query row.
//  (3) The stage. Let m be a target with the largest S (M = S_m) and x a usable target with the largest
//      P among the usable ones. If m is usable: 2^28 P_m ≥ c C M − E ≥ c C S_x − E ≥ 2^28 P_x − 2E, and
//      a usable target j with S_j ≥ M − Slack has 2^28 P_j ≥ c C S_j − E ≥ c C (M − Slack) − E ≥ 2^28 P_x −
//      2E − c C Slack (also when m is unusable: M ≥ S_x still gives c C M ≥ 2^28 P_x − E). So every usable
//      int16 candidate j (and m) has P_j ≥ P_x − W with W = Window ≥ (2E + c C Slack) / 2^28. With a floor
//      F (int16 Candidates' clamped floor), a candidate has S_j ≥ F, so 2^28 P_j ≥ c C F − E: P_j ≥ FloorP.
//      Every unusable target and every usable one with P_j ≥ max(P_x − W, FloorP) gets its exact int16
//      product S_j (int16::Candidates' second stage); the others none. The int16 candidates' rule, applied
//      to the computed ones, then sees the same row maximum M when m is computed — which it is unless
//      S_m < F, when no target reaches the floor and the list is empty either way — and every target of
//      S ≥ M − Slack, S ≥ F is computed: the candidate list is the same, target for target, in the same
//      (ascending) order. Padding and unusable targets are left out of the maximum (Dots' block maxima,
//      round 27), and padding is never computed.
//  (4) Rounding of the window. ‖q‖², ‖t‖² are exact integers; ‖α‖², ‖β‖² are summed in float: each α_k,
//      β_k is an integer below 2^24 (|c A_k| ≤ 511 · 2^15), exact; each square and each of the ≤ d + 8
//      additions rounds to nearest with relative error ≤ u = 2^-24 on nonnegative terms, so the exact sum
//      ≤ computed · (1 + 2 (d + 10) u) (Err2Up). E is then formed in double from square roots of these (a
//      few roundings of 2^-53 relative, covered by (1 + 2^-40)); W = ⌈(2E + c C Slack) 2^-28⌉ + 1 and
//      FloorP = ⌊(c C F − E) 2^-28⌋ − 1: the extra unit covers the rounding of the final sum and
//      difference (c C |F| ≤ 2^9 2^7 2^30 = 2^46, an exact integer in double). A saturated Slack (2^30)
//      gives W ≥ 4 c C > 2 · 32767 ≥ the spread of P: every target is computed (correct, only slower).

namespace kvsim::merge_screen::int8 {
namespace {

const bool kSupported = CpuHas(CpuFeature::kAvx2);
const bool kVnniSupported = kSupported && CpuHas(CpuFeature::kAvx512f) && CpuHas(CpuFeature::kAvx512vnni);
std::atomic<bool> g_vnni{kVnniSupported};

double Err2Up(int d) { return 1.0 + 2.0 * (d + 10) * 0x1p-24; }

// The largest ‖t‖² of a usable target (NarrowTargets): normalised rows without a clamped word fit.
int64_t TargetNorm2Cap(int d) {
  const double sd = std::sqrt(static_cast<double>(d));
  const double n = kTargetScale * (1 + 0x1p-20 + sd * 0x1p-15) + sd / 2 + 1;
  return static_cast<int64_t>(n * n);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define KVSIM_INT8_TARGET __attribute__((target("avx2")))

// 16 int16 words -> 16 narrowed words (int16, in order), per pair (8 int32 lanes, lane i = words 2i, 2i + 1):
// the sums of the words, of their squares, of the errors' squares (float), and whether a word was clamped.
struct Narrowed {
  __m256i words;
  __m256i sum, norm2, clamped;
  __m256 err2;
};

KVSIM_INT8_TARGET inline __attribute__((always_inline)) Narrowed Narrow16(const int16_t* in, __m256i c,
                                                                          __m256i top) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in));
  const __m256i lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(x));
  const __m256i hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(x, 1));
  const __m256i clo = _mm256_mullo_epi32(lo, c), chi = _mm256_mullo_epi32(hi, c);
  const __m256i half = _mm256_set1_epi32(1 << 13), bot = _mm256_sub_epi32(_mm256_setzero_si256(), top);
  const __m256i rlo = _mm256_srai_epi32(_mm256_add_epi32(clo, half), 14);
  const __m256i rhi = _mm256_srai_epi32(_mm256_add_epi32(chi, half), 14);
  const __m256i qlo = _mm256_max_epi32(bot, _mm256_min_epi32(top, rlo));
  const __m256i qhi = _mm256_max_epi32(bot, _mm256_min_epi32(top, rhi));
  const __m256 elo = _mm256_cvtepi32_ps(_mm256_sub_epi32(clo, _mm256_slli_epi32(qlo, 14)));
  const __m256 ehi = _mm256_cvtepi32_ps(_mm256_sub_epi32(chi, _mm256_slli_epi32(qhi, 14)));
  Narrowed r;
  // hadd pairs within 128-bit halves: [lo p0 p1, hi p4 p5 | lo p2 p3, hi p6 p7] -> reorder the quarters.
  const __m256 e2 = _mm256_hadd_ps(_mm256_mul_ps(elo, elo), _mm256_mul_ps(ehi, ehi));
  r.err2 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e2), 0xD8));
  const __m256i cl =
      _mm256_packs_epi32(_mm256_xor_si256(_mm256_cmpeq_epi32(qlo, rlo), _mm256_set1_epi32(-1)),
                         _mm256_xor_si256(_mm256_cmpeq_epi32(qhi, rhi), _mm256_set1_epi32(-1)));
  r.clamped = _mm256_madd_epi16(_mm256_permute4x64_epi64(cl, 0xD8), _mm256_set1_epi16(1));  // < 0: clamped
  r.words = _mm256_permute4x64_epi64(_mm256_packs_epi32(qlo, qhi), 0xD8);  // 16 int16, in order
  r.norm2 = _mm256_madd_epi16(r.words, r.words);
  r.sum = _mm256_madd_epi16(r.words, _mm256_set1_epi16(1));
  return r;
}

// 16 narrowed words (|w| ≤ 255 after the bias) to bytes, in order.
KVSIM_INT8_TARGET inline __m128i Bytes(__m256i w) {
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packs_epi16(w, w), 0x08));
}
KVSIM_INT8_TARGET inline __m128i UBytes(__m256i w) {
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi16(w, w), 0x08));
}

KVSIM_INT8_TARGET Norms NarrowTargetsAvx2(const int16_t* t16, int n, int d, int8_t* out) {
  const __m256i c = _mm256_set1_epi32(kTargetScale), top = _mm256_set1_epi32(kTargetMax);
  const int groups = (n + 7) / 8, quads = d / 4;
  const double up = Err2Up(d);
  const int64_t cap = TargetNorm2Cap(d);
  int16_t* bias = reinterpret_cast<int16_t*>(out + static_cast<long>(groups) * 8 * d);
  uint8_t* unusable = reinterpret_cast<uint8_t*>(out + static_cast<long>(groups) * (8L * d + 32));
  int16_t* rows16 = const_cast<int16_t*>(Rows16(out, n, d));
  Norms s;
  for (int g = 0; g < groups; ++g) {
    const int16_t* tg = t16 + static_cast<long>(g) * d * 8;  // pair p of the group: 16 words at tg + 16 p
    int8_t* og = out + static_cast<long>(g) * d * 8;
    __m256i n2 = _mm256_setzero_si256(), sa = n2, sb = n2, cl = n2;
    __m256 e2 = _mm256_setzero_ps();
    for (int p = 0; p < quads; ++p) {
      const Narrowed a = Narrow16(tg + 32 * p, c, top), b = Narrow16(tg + 32 * p + 16, c, top);
      n2 = _mm256_add_epi32(n2, _mm256_add_epi32(a.norm2, b.norm2));
      e2 = _mm256_add_ps(e2, _mm256_add_ps(a.err2, b.err2));
      sa = _mm256_add_epi32(sa, a.sum), sb = _mm256_add_epi32(sb, b.sum);
      cl = _mm256_or_si256(cl, _mm256_or_si256(a.clamped, b.clamped));
      // a: target i's dims 4p, 4p+1 at bytes 2i, 2i+1; b: dims 4p+2, 4p+3. Quad of target i at 4i.
      // The int16 words row after row: target i's dims 4p..4p+3 are 32-bit word i of a, then of b.
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tg + 32 * p));
      const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tg + 32 * p + 16));
      const __m256i lo = _mm256_unpacklo_epi32(x, y),
                    hi = _mm256_unpackhi_epi32(x, y);  // [0 1 | 4 5], [2 3 | 6 7]
      int16_t* rg = rows16 + static_cast<long>(g) * 8 * d + 4 * p;
      _mm_storel_epi64(reinterpret_cast<__m128i*>(rg), _mm256_castsi256_si128(lo));
      _mm_storeh_pd(reinterpret_cast<double*>(rg + d), _mm_castsi128_pd(_mm256_castsi256_si128(lo)));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(rg + 2 * d), _mm256_castsi256_si128(hi));
      _mm_storeh_pd(reinterpret_cast<double*>(rg + 3 * d), _mm_castsi128_pd(_mm256_castsi256_si128(hi)));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(rg + 4 * d), _mm256_extracti128_si256(lo, 1));
      _mm_storeh_pd(reinterpret_cast<double*>(rg + 5 * d), _mm_castsi128_pd(_mm256_extracti128_si256(lo, 1)));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(rg + 6 * d), _mm256_extracti128_si256(hi, 1));
      _mm_storeh_pd(reinterpret_cast<double*>(rg + 7 * d), _mm_castsi128_pd(_mm256_extracti128_si256(hi, 1)));
      const __m128i ab = Bytes(a.words), bb = Bytes(b.words);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(og + 32 * p), _mm_unpacklo_epi16(ab, bb));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(og + 32 * p + 16), _mm_unpackhi_epi16(ab, bb));
    }
    int32_t nl[8], al[8], bl[8], cll[8];
    float el[8];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(nl), n2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(al), sa);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bl), sb);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(cll), cl);
    _mm256_storeu_ps(el, e2);
    uint8_t bad = 0;
    for (int i = 0; i < 8; ++i) {
      // The accumulator starts: −128 Σ t over each lane's dimensions, modulo 2^16.
      bias[g * 16 + 2 * i] = static_cast<int16_t>(static_cast<uint16_t>(-128 * al[i]));
      bias[g * 16 + 2 * i + 1] = static_cast<int16_t>(static_cast<uint16_t>(-128 * bl[i]));
      if (cll[i] != 0 || nl[i] > cap) {
        bad |= static_cast<uint8_t>(1u << i);
        continue;
      }
      s.norm2 = std::max<int64_t>(s.norm2, nl[i]);
      s.err2 = std::max(s.err2, static_cast<double>(el[i]) * up);
    }
    unusable[g] = bad;
  }
  s.norm = std::sqrt(static_cast<double>(s.norm2)) * (1 + 0x1p-50);
  s.err = std::sqrt(s.err2) * (1 + 0x1p-50);
  return s;
}

// One scale for every query row of dimension d: the largest c with (c (1 + 2^-20 + √d 2^-15) + √d / 2) ·
// √TargetNorm2Cap(d) ≤ 32767, so a row of norm ≤ 1 + 2^-20 meets Cauchy-Schwarz against every usable target
// (checked exactly per row all the same). A coordinate above 127 / c (≈ 0.54 at d = 128) is clamped: its
// error counts in α, widening that row's window only.
int QueryScaleOf(int d) {
  const double sd = std::sqrt(static_cast<double>(d));
  const double c =
      (32767.0 / std::sqrt(static_cast<double>(TargetNorm2Cap(d))) - sd / 2) / (1 + 0x1p-20 + sd * 0x1p-15);
  return std::min(kMaxQueryScale, static_cast<int>(std::floor(c)));
}
// QueryScaleOf remembered for the last d (RowScale asks it once per query row).
int QueryScaleFor(int d) {
  thread_local int last_d = 0, last_c = 0;
  if (d != last_d) last_c = QueryScaleOf(d), last_d = d;
  return last_c;
}

KVSIM_INT8_TARGET void NarrowRowsAvx2(const int16_t* q16, int n, int d, uint8_t* out, int32_t* norm2,
                                      double* norm, double* err) {
  const double up = Err2Up(d);
  const int cs = QueryScaleFor(d);
  const __m256i c = _mm256_set1_epi32(cs);
  const __m256i half = _mm256_set1_epi32(1 << 13), top = _mm256_set1_epi32(127),
                bot = _mm256_set1_epi32(-127);
  const __m256i bias = _mm256_set1_epi16(128);
  for (int r = 0; r < n; ++r) {
    const int16_t* x = q16 + static_cast<long>(r) * d;
    uint8_t* o = out + static_cast<long>(r) * d;
    __m256i n2 = _mm256_setzero_si256();
    __m256 e2 = _mm256_setzero_ps();
    for (int k = 0; k < d; k += 16) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k));
      const __m256i clo = _mm256_mullo_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(v)), c);
      const __m256i chi = _mm256_mullo_epi32(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(v, 1)), c);
      const __m256i qlo =
          _mm256_max_epi32(bot, _mm256_min_epi32(top, _mm256_srai_epi32(_mm256_add_epi32(clo, half), 14)));
      const __m256i qhi =
          _mm256_max_epi32(bot, _mm256_min_epi32(top, _mm256_srai_epi32(_mm256_add_epi32(chi, half), 14)));
      const __m256 elo = _mm256_cvtepi32_ps(_mm256_sub_epi32(clo, _mm256_slli_epi32(qlo, 14)));
      const __m256 ehi = _mm256_cvtepi32_ps(_mm256_sub_epi32(chi, _mm256_slli_epi32(qhi, 14)));
      e2 = _mm256_fmadd_ps(elo, elo, _mm256_fmadd_ps(ehi, ehi, e2));
      const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(qlo, qhi), 0xD8);
      n2 = _mm256_add_epi32(n2, _mm256_madd_epi16(w, w));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + k), UBytes(_mm256_add_epi16(w, bias)));
    }
    // Horizontal sums: n2 exactly (≤ d 127² < 2^31), e2 in float (8 more additions: inside Err2Up's count).
    __m128i n4 = _mm_add_epi32(_mm256_castsi256_si128(n2), _mm256_extracti128_si256(n2, 1));
    n4 = _mm_add_epi32(n4, _mm_shuffle_epi32(n4, 0x4E));
    n4 = _mm_add_epi32(n4, _mm_shuffle_epi32(n4, 0xB1));
    __m128 e4 = _mm_add_ps(_mm256_castps256_ps128(e2), _mm256_extractf128_ps(e2, 1));
    e4 = _mm_add_ps(e4, _mm_movehl_ps(e4, e4));
    e4 = _mm_add_ss(e4, _mm_movehdup_ps(e4));
    const int32_t nn = _mm_cvtsi128_si32(n4);
    norm2[r] = nn;
    norm[r] = std::sqrt(static_cast<double>(nn)) * (1 + 0x1p-50);
    err[r] = std::sqrt(static_cast<double>(_mm_cvtss_f32(e4)) * up) * (1 + 0x1p-50);
  }
}

// R query rows x V groups of 8 targets: int16 accumulators from the groups' starts (the bias), lane 2i /
// 2i + 1 = target i's sums over the quads' first / second dimension pairs; combined into int32 (vpmaddwd
// by 1) at the end.
template <int R, int V>
KVSIM_INT8_TARGET inline __attribute__((always_inline)) void Block(const uint8_t* q, int d, const int8_t* t,
                                                                   const int16_t* start, int32_t* out,
                                                                   long ld) {
  __m256i acc[R][V];
  for (int v = 0; v < V; ++v) {
    const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(start + 16 * v));
    for (int r = 0; r < R; ++r) acc[r][v] = s;
  }
  const long group = static_cast<long>(d) * 8;  // bytes per group
  const int quads = d / 4;
  for (int p = 0; p < quads; ++p) {
    __m256i tv[V];
    for (int v = 0; v < V; ++v)
      tv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + v * group + p * 32));
    for (int r = 0; r < R; ++r) {
      int32_t word;
      std::memcpy(&word, q + static_cast<long>(r) * d + 4 * p, sizeof word);
      const __m256i qb = _mm256_set1_epi32(word);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_add_epi16(acc[r][v], _mm256_maddubs_epi16(qb, tv[v]));
    }
  }
  const __m256i one = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ld + v * 8),
                          _mm256_madd_epi16(acc[r][v], one));
}

constexpr int kRows = 6;  // query rows per block (as the int16 kernel's)

// Dots' block maxima from R rows' stored products (the AVX2 kernel): keep[g] bit i set if target 8 g + i
// is usable and real (BlockMaxStride's rule); the others count as INT32_MIN.
KVSIM_INT8_TARGET void BlockMaxima(const int32_t* out, int rows, long ld, int groups, const uint8_t* keep,
                                   int32_t* bm, long bld) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128), low = _mm256_set1_epi32(INT32_MIN);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < groups; g += 4) {
      __m256i mx = low;
      for (int v = g; v < std::min(groups, g + 4); ++v) {
        const __m256i k = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(keep[v]), bit), bit);
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + r * ld + 8 * v));
        mx = _mm256_max_epi32(mx, _mm256_blendv_epi8(low, x, k));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(bm + r * bld + 2 * g), mx);
    }
}

template <int R>
KVSIM_INT8_TARGET void Rows(const uint8_t* q, int d, const int8_t* t, const int16_t* start, int groups,
                            int32_t* out, long ld, const uint8_t* keep, int32_t* bm, long bld) {
  const long group = static_cast<long>(d) * 8;
  int g = 0;
  for (; g + 2 <= groups; g += 2) Block<R, 2>(q, d, t + g * group, start + 16 * g, out + g * 8, ld);
  if (g < groups) Block<R, 1>(q, d, t + g * group, start + 16 * g, out + g * 8, ld);
  if (bm != nullptr) BlockMaxima(out, R, ld, groups, keep, bm, bld);
}

// The VNNI kernel (merge_screen_int8.cc (1)): zmm lanes 0-7 are row r's products with a group's 8
// targets, lanes 8-15 row r + 1's with the same targets: the group's quad is broadcast to both halves (a
// load, no shuffle) and the rows' words come from `pairs`, R / 2 rounded up row pairs laid out per quad as
// 8 copies of row r's word, then 8 of row r + 1's (a missing row r + 1: row r again, never stored). Lane i
// of a half = target i, from the sum of its two int16 starts; the low 16 bits, sign-extended, at the end.
#define KVSIM_INT8_VNNI_TARGET __attribute__((target("avx2,avx512f,avx512vnni")))

// A group's accumulator start (both halves), its 32 bytes of quad p's words (t: the group's quad p), and an
// accumulator's values (the low 16 bits sign-extended).
KVSIM_INT8_VNNI_TARGET inline __attribute__((always_inline)) __m512i VnniStart(const int16_t* start) {
  return _mm512_broadcast_i64x4(
      _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(start)), _mm256_set1_epi16(1)));
}
KVSIM_INT8_VNNI_TARGET inline __attribute__((always_inline)) __m512i VnniQuad(const int8_t* t) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
}
KVSIM_INT8_VNNI_TARGET inline __attribute__((always_inline)) __m512i VnniValues(__m512i acc) {
  return _mm512_srai_epi32(_mm512_slli_epi32(acc, 16), 16);
}
// Row pair r of P: the values' row 2r half, then row 2r + 1's if there is one (the last pair's may not).
template <int P>
KVSIM_INT8_VNNI_TARGET inline __attribute__((always_inline)) void VnniStore(__m512i x, int r, int rows,
                                                                            int32_t* out, long ld) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * r * ld), _mm512_castsi512_si256(x));
  if (r + 1 < P || 2 * r + 1 < rows)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (2 * r + 1) * ld), _mm512_extracti64x4_epi64(x, 1));
}
// A block's P x V accumulators stored, and with kMax the row pairs' block maxima (Dots): each group's values
// masked by its keep byte (in both halves), lane by lane. Unrolled: the epilogue runs once per 32
// quads of products at d = 128, and a loop over the pairs spilled the accumulators.
template <int P, int V, bool kMax>
KVSIM_INT8_VNNI_TARGET inline __attribute__((always_inline)) void VnniStoreBlock(const __m512i (&acc)[P][V],
                                                                                 int rows, int32_t* out,
                                                                                 long ld, const uint8_t* keep,
                                                                                 int32_t* bm, long bld) {
  __mmask16 k[V];
  if constexpr (kMax)
    for (int v = 0; v < V; ++v) k[v] = static_cast<__mmask16>(keep[v] * 0x0101u);
#pragma GCC unroll 4
  for (int r = 0; r < P; ++r) {
    __m512i mx = _mm512_set1_epi32(INT32_MIN);
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      const __m512i x = VnniValues(acc[r][v]);
      VnniStore<P>(x, r, rows, out + v * 8, ld);
      if constexpr (kMax) mx = _mm512_mask_max_epi32(mx, k[v], mx, x);
    }
    if constexpr (kMax) VnniStore<P>(mx, r, rows, bm, bld);
  }
}

// P row pairs x V groups (the tails; the bulk is BlockVnni34).
template <int P, int V, bool kMax>
KVSIM_INT8_VNNI_TARGET inline __attribute__((always_inline)) void BlockVnni(
    const int32_t* pairs, int rows, int d, const int8_t* t, const int16_t* start, int32_t* out, long ld,
    const uint8_t* keep, int32_t* bm, long bld) {
  __m512i acc[P][V];
  for (int v = 0; v < V; ++v) {
    const __m512i s = VnniStart(start + 16 * v);
    for (int r = 0; r < P; ++r) acc[r][v] = s;
  }
  const long group = static_cast<long>(d) * 8;  // bytes per group
  const int quads = d / 4;
  for (int p = 0; p < quads; ++p) {
    __m512i tv[V];
    for (int v = 0; v < V; ++v) tv[v] = VnniQuad(t + v * group + p * 32);
    for (int r = 0; r < P; ++r) {
      const __m512i qb = _mm512_loadu_si512(pairs + (static_cast<long>(r) * quads + p) * 16);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], qb, tv[v]);
    }
  }
  VnniStoreBlock<P, V, kMax>(acc, rows, out, ld, keep, bm, bld);
}

// BlockVnni<3, 4> (the bulk of the work) with its 12 accumulators as named variables and the instruction as
// inline assembly: GCC 12 compiles the intrinsic over an accumulator array with two register copies per
// `vpdpbusd` (measured in kvsim_merge_screen_bench: the products took 0.51-0.61x the AVX2 kernel's time that
// way, 0.40-0.58x this way), and `asm` on the array's elements spilled them to the stack.
template <bool kMax>
KVSIM_INT8_VNNI_TARGET inline __attribute__((always_inline)) void BlockVnni34(
    const int32_t* pairs, int rows, int d, const int8_t* t, const int16_t* start, int32_t* out, long ld,
    const uint8_t* keep, int32_t* bm, long bld) {
  const __m512i s[4] = {VnniStart(start), VnniStart(start + 16), VnniStart(start + 32),
                        VnniStart(start + 48)};
  __m512i a00 = s[0], a01 = s[1], a02 = s[2], a03 = s[3], a10 = s[0], a11 = s[1], a12 = s[2], a13 = s[3],
          a20 = s[0], a21 = s[1], a22 = s[2], a23 = s[3];
  const long group = static_cast<long>(d) * 8;  // bytes per group
  const int quads = d / 4;
  const int32_t* q1 = pairs + static_cast<long>(quads) * 16;
  const int32_t* q2 = q1 + static_cast<long>(quads) * 16;
  for (int p = 0; p < quads; ++p) {
    const __m512i t0 = VnniQuad(t + p * 32), t1 = VnniQuad(t + group + p * 32),
                  t2 = VnniQuad(t + 2 * group + p * 32), t3 = VnniQuad(t + 3 * group + p * 32);
    const __m512i u0 = _mm512_loadu_si512(pairs + p * 16), u1 = _mm512_loadu_si512(q1 + p * 16),
                  u2 = _mm512_loadu_si512(q2 + p * 16);
// Row pair u against the 4 groups: accumulators %0-%3, targets %4-%7, the pair's words %8.
#define KVSIM_VNNI_ROW(u, a0, a1, a2, a3)                                                        \
  asm("vpdpbusd %4, %8, %0\n\tvpdpbusd %5, %8, %1\n\tvpdpbusd %6, %8, %2\n\tvpdpbusd %7, %8, %3" \
      : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3)                                                   \
      : "v"(t0), "v"(t1), "v"(t2), "v"(t3), "v"(u))
    KVSIM_VNNI_ROW(u0, a00, a01, a02, a03);
    KVSIM_VNNI_ROW(u1, a10, a11, a12, a13);
    KVSIM_VNNI_ROW(u2, a20, a21, a22, a23);
#undef KVSIM_VNNI_ROW
  }
  const __m512i acc[3][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}};
  VnniStoreBlock<3, 4, kMax>(acc, rows, out, ld, keep, bm, bld);
}

// Group g's block maxima (none without kMax: bm is then null).
template <bool kMax>
inline int32_t* BlockMaxAt(int32_t* bm, int g) {
  return kMax ? bm + 2 * g : nullptr;
}

// `rows` (≤ kRows) query rows against every group, 4 groups (one block of maxima) at a time.
template <int P, bool kMax>
KVSIM_INT8_VNNI_TARGET void RowsVnni(const uint8_t* q, int rows, int d, const int8_t* t, const int16_t* start,
                                     int groups, int32_t* out, long ld, const uint8_t* keep, int32_t* bm,
                                     long bld) {
  const int quads = d / 4;
  thread_local std::vector<int32_t> pairs;
  if (pairs.size() < static_cast<size_t>(P) * quads * 16) pairs.resize(static_cast<size_t>(P) * quads * 16);
  for (int r = 0; r < P; ++r) {
    const uint8_t* a = q + static_cast<long>(2 * r) * d;
    const uint8_t* b = 2 * r + 1 < rows ? a + d : a;
    for (int p = 0; p < quads; ++p) {
      int32_t wa, wb;
      std::memcpy(&wa, a + 4 * p, sizeof wa);
      std::memcpy(&wb, b + 4 * p, sizeof wb);
      _mm512_storeu_si512(pairs.data() + (static_cast<size_t>(r) * quads + p) * 16,
                          _mm512_mask_set1_epi32(_mm512_set1_epi32(wa), 0xFF00, wb));
    }
  }
  const long group = static_cast<long>(d) * 8;
  int g = 0;
  for (; g + 4 <= groups; g += 4)
    if constexpr (P == 3)
      BlockVnni34<kMax>(pairs.data(), rows, d, t + g * group, start + 16 * g, out + g * 8, ld, keep + g,
                        BlockMaxAt<kMax>(bm, g), bld);
    else
      BlockVnni<P, 4, kMax>(pairs.data(), rows, d, t + g * group, start + 16 * g, out + g * 8, ld, keep + g,
                            BlockMaxAt<kMax>(bm, g), bld);
  switch (groups - g) {
    case 3:
      BlockVnni<P, 3, kMax>(pairs.data(), rows, d, t + g * group, start + 16 * g, out + g * 8, ld, keep + g,
                            BlockMaxAt<kMax>(bm, g), bld);
      break;
    case 2:
      BlockVnni<P, 2, kMax>(pairs.data(), rows, d, t + g * group, start + 16 * g, out + g * 8, ld, keep + g,
                            BlockMaxAt<kMax>(bm, g), bld);
      break;
    case 1:
      BlockVnni<P, 1, kMax>(pairs.data(), rows, d, t + g * group, start + 16 * g, out + g * 8, ld, keep + g,
                            BlockMaxAt<kMax>(bm, g), bld);
      break;
    default:
      break;
  }
}

// Rows<R>, or RowsVnni over (R + 1) / 2 row pairs.
template <int R>
void RowsOf(bool vnni, const uint8_t* q, int d, const int8_t* t, const int16_t* start, int groups,
            int32_t* out, long ld, const uint8_t* keep, int32_t* bm, long bld) {
  if (vnni && bm != nullptr)
    RowsVnni<(R + 1) / 2, true>(q, R, d, t, start, groups, out, ld, keep, bm, bld);
  else if (vnni)
    RowsVnni<(R + 1) / 2, false>(q, R, d, t, start, groups, out, ld, keep, bm, bld);
  else
    Rows<R>(q, d, t, start, groups, out, ld, keep, bm, bld);
}
#endif

// E of (2) for a query row against the usable targets' largest norms, rounded up (4).
double Bound(double q_norm, double q_err, const Norms& t) {
  return (0x1p14 * (q_norm * t.err + q_err * t.norm) + q_err * t.err) * (1.0 + 0x1p-40);
}

}  // namespace

bool Applies(int d) { return kSupported && d > 0 && d % 16 == 0 && d <= 4096; }

Kernel ChosenKernel() { return g_vnni.load(std::memory_order_relaxed) ? Kernel::kVnni : Kernel::kAvx2; }
void SetKernelForTesting(Kernel kernel) {
  g_vnni.store(kernel == Kernel::kVnni && kVnniSupported, std::memory_order_relaxed);
}
int QueryScale(int d) { return QueryScaleFor(d); }

Norms NarrowTargets(const int16_t* targets16, int n, int d, int8_t* out) {
#if defined(__x86_64__) && defined(__GNUC__)
  return NarrowTargetsAvx2(targets16, n, d, out);
#else
  (void)targets16, (void)n, (void)d, (void)out;
  std::abort();
#endif
}

void NarrowRows(const int16_t* rows16, int n, int d, uint8_t* out, int32_t* norm2, double* norm,
                double* err) {
#if defined(__x86_64__) && defined(__GNUC__)
  NarrowRowsAvx2(rows16, n, d, out, norm2, norm, err);
#else
  (void)rows16, (void)n, (void)d, (void)out, (void)norm2, (void)norm, (void)err;
  std::abort();
#endif
}

int RowScale(int d, int32_t norm2, const Norms& t) {
  return int64_t{norm2} * t.norm2 > int64_t{32767} * 32767 ? 0 : QueryScaleFor(d);
}

void NarrowQueries(const int16_t* rows16, int n, int d, const Norms& t, uint8_t* out, int32_t* scale,
                   double* norm, double* err) {
  NarrowRows(rows16, n, d, out, scale, norm, err);  // ‖q‖² into scale, then the targets' check
  for (int r = 0; r < n; ++r) {
    scale[r] = RowScale(d, scale[r], t);
    if (scale[r] == 0) norm[r] = 0, err[r] = 0;  // a row too long for the int16 sums: no stage for its block
  }
}

void Dots(const uint8_t* queries, int num_queries, const int8_t* targets, int num_targets, int d,
          int32_t* out, long ld, int32_t* block_max) {
#if defined(__x86_64__) && defined(__GNUC__)
  const int groups = (num_targets + 7) / 8;
  const int16_t* start = reinterpret_cast<const int16_t*>(targets + static_cast<long>(groups) * 8 * d);
  const bool vnni = g_vnni.load(std::memory_order_relaxed);
  // The block maxima's masks: target 8 g + i counts if usable and below num_targets.
  thread_local std::vector<uint8_t> keep;
  const long bld = BlockMaxStride(num_targets);
  if (block_max != nullptr) {
    const uint8_t* unusable = Unusable(targets, num_targets, d);
    keep.resize(groups);
    for (int g = 0; g < groups; ++g) keep[g] = static_cast<uint8_t>(~unusable[g]);
    if (num_targets % 8 != 0) keep[groups - 1] &= static_cast<uint8_t>((1u << num_targets % 8) - 1);
  }
  for (int r = 0; r < num_queries; r += kRows) {
    const uint8_t* q = queries + static_cast<long>(r) * d;
    int32_t* o = out + r * ld;
    int32_t* bm = block_max != nullptr ? block_max + r * bld : nullptr;
    switch (std::min(kRows, num_queries - r)) {
      case 6:
        RowsOf<6>(vnni, q, d, targets, start, groups, o, ld, keep.data(), bm, bld);
        break;
      case 5:
        RowsOf<5>(vnni, q, d, targets, start, groups, o, ld, keep.data(), bm, bld);
        break;
      case 4:
        RowsOf<4>(vnni, q, d, targets, start, groups, o, ld, keep.data(), bm, bld);
        break;
      case 3:
        RowsOf<3>(vnni, q, d, targets, start, groups, o, ld, keep.data(), bm, bld);
        break;
      case 2:
        RowsOf<2>(vnni, q, d, targets, start, groups, o, ld, keep.data(), bm, bld);
        break;
      default:
        RowsOf<1>(vnni, q, d, targets, start, groups, o, ld, keep.data(), bm, bld);
        break;
    }
  }
#else
  (void)queries, (void)num_queries, (void)targets, (void)num_targets, (void)d, (void)out, (void)ld,
      (void)block_max;
  std::abort();
#endif
}

int64_t Window(int scale, double q_norm, double q_err, const Norms& t, int64_t slack) {
  const double cc = static_cast<double>(scale) * kTargetScale;
  const double w = std::ceil((2 * Bound(q_norm, q_err, t) + cc * static_cast<double>(slack)) * 0x1p-28);
  return w >= 0x1p40 ? int64_t{1} << 40 : static_cast<int64_t>(w) + 1;
}

int64_t FloorP(int scale, double q_norm, double q_err, const Norms& t, int64_t floor) {
  const double cc = static_cast<double>(scale) * kTargetScale;
  const double f = std::floor((cc * static_cast<double>(floor) - Bound(q_norm, q_err, t)) * 0x1p-28);
  return f <= -0x1p40 ? -(int64_t{1} << 40) : static_cast<int64_t>(f) - 1;
}

}  // namespace kvsim::merge_screen::int8
