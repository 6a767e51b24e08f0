#include "sim/attention.h"

#include <cblas.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <numeric>

#include "sim/cpu.h"
#include "sim/parallel.h"
#include "sim/select.h"

namespace kvsim {
namespace {

constexpr int kRowBlock = 256;

// exp(x) for x <= 0 (softmax after max subtraction), branch-free so loops over it vectorise:
// Cody–Waite range reduction x = n ln2 + r, |r| <= ln2/2, and the Cephes degree-6 polynomial for exp(r)
// (max error ~2 ulp); inputs below -87.3 are clamped (exp < 1.2e-38 there).
// With FMA the multiply-adds are fused explicitly, where an optimising build contracted them (the operations
// of ExpNonPositive8 below): the same bits in every build, also an unoptimised (sanitizer) one, which does
// not contract. Without FMA: the plain expressions (nothing is fused then).
inline float MulAdd(float a, float b, float c) {
#if defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.3f);
  const float n = MulAdd(x, 1.44269504088896341f, 12582912.0f) - 12582912.0f;  // round to nearest
  float r = MulAdd(-n, 0.693359375f, x);
  r = MulAdd(n, 2.12194440e-4f, r);
  const float z = r * r;
  float p = MulAdd(1.9875691500e-4f, r, 1.3981999507e-3f);
  p = MulAdd(p, r, 8.3334519073e-3f);
  p = MulAdd(p, r, 4.1665795894e-2f);
  p = MulAdd(p, r, 1.6666665459e-1f);
  p = MulAdd(p, r, 5.0000001201e-1f);
  const float y = MulAdd(p, z, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// ExpNonPositive of eight floats, operation for operation what the compiler makes of ExpNonPositive's
// vectorised loop (-march=x86-64-v3, contraction on): the clamp (vmaxps with the bound first: a NaN passes
// through, as in std::max), n by one fused multiply-add, r by two, z = r², the polynomial by fused
// multiply-adds, y = p·z + r fused, then + 1 and the scale. Checked bit for bit against that loop over
// all 2^32 float inputs (a stand-alone program, round 12) and, in tests/sim/attention_test.cc, against a
// copy of the three-pass softmax.
inline __m256 ExpNonPositive8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);
  __m256 n = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(12582912.0f));
  n = _mm256_sub_ps(n, _mm256_set1_ps(12582912.0f));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  const __m256 z = _mm256_mul_ps(r, r);
  __m256 p = _mm256_fmadd_ps(r, _mm256_set1_ps(1.9875691500e-4f), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  __m256 y = _mm256_fmadd_ps(p, z, r);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#endif

// Soft-cap in place (scale already applied by the GEMM).
}  // namespace

void SoftCap(float* x, int n, float cap) {
  if (cap <= 0) return;
  for (int i = 0; i < n; ++i) x[i] = cap * std::tanh(x[i] / cap);
}

// kvsim parallelises over heads itself; BLAS runs single-threaded inside each task, which also keeps
// every product's reduction order independent of the thread count (bit-identical results).
void EnsureSingleThreadedBlas() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

namespace {

// max(-inf, x[0..n)) as the serial std::max loop computes it, in 8 independent lanes so that it vectorises
// (a serial max chain was a measurable part of MEDA's entropy pass, issue 14). Max is exact, so the lanes
// give the same value; only the sign of a zero maximum can differ, and every use subtracts it and
// exponentiates (exp(±0) = 1) or adds it to a logarithm, so results are unchanged.
float RowMax(const float* x, int n) {
  float lane[8];
  for (float& l : lane) l = -std::numeric_limits<float>::infinity();
  int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  // vmaxps(a, b) is a > b ? a : b (b when either is NaN): with a = x, b = lane that is the scalar
  // lane < x ? x : lane, lane by lane (the compiler left the scalar form unvectorised: 8 vmaxss per 8).
  __m256 vl = _mm256_loadu_ps(lane);
  for (; i + 8 <= n; i += 8) vl = _mm256_max_ps(_mm256_loadu_ps(x + i), vl);
  _mm256_storeu_ps(lane, vl);
#endif
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) lane[k] = lane[k] < x[i + k] ? x[i + k] : lane[k];
  float mx = lane[0];
  for (int k = 1; k < 8; ++k) mx = mx < lane[k] ? lane[k] : mx;
  for (; i < n; ++i) mx = mx < x[i] ? x[i] : mx;
  return mx;
}

}  // namespace

float LogitTransform::operator()(float dot) const {
  float z = dot * scale;
  if (softcap > 0) z = softcap * std::tanh(z / softcap);
  return z;
}

namespace {

// GatherWeightedRows' vector code. Each works on columns [0, width) of rows of stride d (values and out
// offset to the first column) and returns the columns it did (whole register groups); each lane does the
// same fused multiply-adds in the same slot order as the scalar loop, so the bits do not depend on which
// one runs.
#if defined(__AVX2__) && defined(__FMA__)
// NV accumulators of 8 columns, from zero (or, kFromOut, continuing from the values in out).
template <int NV, bool kFromOut = false>
inline void GatherWeightedBlock(const float* p, const int32_t* tok, size_t n, const float* values, size_t d,
                                float* out) {
  __m256 acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = kFromOut ? _mm256_loadu_ps(out + 8 * j) : _mm256_setzero_ps();
  for (size_t i = 0; i < n; ++i) {
    const int32_t t = tok[i];
    const __m256 w = _mm256_set1_ps(p[t]);
    const float* v = values + static_cast<size_t>(t) * d;
    for (int j = 0; j < NV; ++j) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * j), acc[j]);
  }
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + 8 * j, acc[j]);
}

// Blocks of 64 columns (8 of the 16 ymm registers; the rest hold the weight and the loads), then one
// block of the remaining whole 8-column groups.
size_t GatherWeightedAvx2(const float* p, const int32_t* tok, size_t n, const float* values, size_t d,
                          size_t width, float* out) {
  size_t k0 = 0;
  for (; k0 + 64 <= width; k0 += 64) GatherWeightedBlock<8>(p, tok, n, values + k0, d, out + k0);
  switch ((width - k0) / 8) {
    case 7:
      GatherWeightedBlock<7>(p, tok, n, values + k0, d, out + k0);
      break;
    case 6:
      GatherWeightedBlock<6>(p, tok, n, values + k0, d, out + k0);
      break;
    case 5:
      GatherWeightedBlock<5>(p, tok, n, values + k0, d, out + k0);
      break;
    case 4:
      GatherWeightedBlock<4>(p, tok, n, values + k0, d, out + k0);
      break;
    case 3:
      GatherWeightedBlock<3>(p, tok, n, values + k0, d, out + k0);
      break;
    case 2:
      GatherWeightedBlock<2>(p, tok, n, values + k0, d, out + k0);
      break;
    case 1:
      GatherWeightedBlock<1>(p, tok, n, values + k0, d, out + k0);
      break;
    default:
      break;
  }
  return width / 8 * 8;
}

// Only in a build with FMA: the AVX-512 code always fuses the multiply-add, which the portable loop does only
// where the build contracts it (an x86-64-v3 build); a build without FMA keeps that loop on every CPU, so its
// results do not depend on whether the CPU has AVX-512.
#if defined(__x86_64__) && defined(__GNUC__) && defined(__FMA__)
#define KVSIM_GATHER_AVX512 1
#define KVSIM_AVX512F_TARGET __attribute__((target("avx512f")))
const bool kGatherAvx512 = CpuHas(CpuFeature::kAvx512f);
std::atomic<bool> g_gather_avx512_allowed{true};

// NV accumulators of 16 columns: a 128-column row in 8 zmm registers, one pass over the slots (the AVX2
// blocks read each value row in two passes).
template <int NV>
KVSIM_AVX512F_TARGET inline __attribute__((always_inline)) void GatherWeightedBlock512(
    const float* p, const int32_t* tok, size_t n, const float* values, size_t d, float* out) {
  __m512 acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = _mm512_setzero_ps();
  for (size_t i = 0; i < n; ++i) {
    const int32_t t = tok[i];
    const __m512 w = _mm512_set1_ps(p[t]);
    const float* v = values + static_cast<size_t>(t) * d;
    for (int j = 0; j < NV; ++j) acc[j] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16 * j), acc[j]);
  }
  for (int j = 0; j < NV; ++j) _mm512_storeu_ps(out + 16 * j, acc[j]);
}

// Blocks of 128 columns, then one block of the remaining whole 16-column groups.
KVSIM_AVX512F_TARGET size_t GatherWeightedAvx512(const float* p, const int32_t* tok, size_t n,
                                                 const float* values, size_t d, size_t width, float* out) {
  size_t k0 = 0;
  for (; k0 + 128 <= width; k0 += 128) GatherWeightedBlock512<8>(p, tok, n, values + k0, d, out + k0);
  switch ((width - k0) / 16) {
    case 7:
      GatherWeightedBlock512<7>(p, tok, n, values + k0, d, out + k0);
      break;
    case 6:
      GatherWeightedBlock512<6>(p, tok, n, values + k0, d, out + k0);
      break;
    case 5:
      GatherWeightedBlock512<5>(p, tok, n, values + k0, d, out + k0);
      break;
    case 4:
      GatherWeightedBlock512<4>(p, tok, n, values + k0, d, out + k0);
      break;
    case 3:
      GatherWeightedBlock512<3>(p, tok, n, values + k0, d, out + k0);
      break;
    case 2:
      GatherWeightedBlock512<2>(p, tok, n, values + k0, d, out + k0);
      break;
    case 1:
      GatherWeightedBlock512<1>(p, tok, n, values + k0, d, out + k0);
      break;
    default:
      break;
  }
  return width / 16 * 16;
}
#endif
#endif

}  // namespace

void SetGatherAvx512ForTesting(bool allowed) {
#ifdef KVSIM_GATHER_AVX512
  g_gather_avx512_allowed.store(allowed, std::memory_order_relaxed);
#else
  (void)allowed;
#endif
}

namespace {

// out[k] += Σ p[tok[i]] v_tok[i][k] for columns k in [k0, d), slot by slot in order: the columns the vector
// paths leave (all of them without AVX2 and FMA), fused explicitly where the build has FMA (as an optimised
// build contracts `o += w * v`; an unoptimised one would not, and these columns would then differ from the
// vector paths' fused ones), two roundings without FMA.
void AccumulateColumns(const float* p, const int32_t* tok, size_t n, const float* values, size_t d, size_t k0,
                       float* out) {
  for (size_t i = 0; i < n; ++i) {
    const float pt = p[tok[i]];
    const float* v = values + static_cast<size_t>(tok[i]) * d;
    for (size_t k = k0; k < d; ++k) {
#ifdef __FMA__
      out[k] = std::fma(pt, v[k], out[k]);
#else
      out[k] += pt * v[k];
#endif
    }
  }
}

}  // namespace

void GatherWeightedRows(const float* p, const int32_t* tok, size_t n, const float* values, int d,
                        float* out) {
  const size_t dd = static_cast<size_t>(d);
  size_t k0 = 0;
#ifdef KVSIM_GATHER_AVX512
  if (kGatherAvx512 && g_gather_avx512_allowed.load(std::memory_order_relaxed))
    k0 = GatherWeightedAvx512(p, tok, n, values, dd, dd, out);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  k0 += GatherWeightedAvx2(p, tok, n, values + k0, dd, dd - k0, out + k0);
#endif
  // The remaining columns (all of them without AVX2 and FMA), from zero.
  for (size_t k = k0; k < dd; ++k) out[k] = 0.0f;
  AccumulateColumns(p, tok, n, values, dd, k0, out);
}

namespace {

#if defined(__AVX2__) && defined(__FMA__)
// kSteps steps x NV accumulators of 8 columns over the shared slots: each value row is loaded once for every
// step (GatherWeightedBlock loads it once per step). The weights come packed, w[4 i + s] = p[s][tok[i]]
// (GatherWeightedRowsSteps gathers them once for all column blocks: contiguous broadcasts instead of four
// scattered loads per slot and block), and the value row kAhead slots ahead is prefetched (the rows are
// scattered over the cache's tokens, beyond L2 on the demo trace; the loads of this block's columns
// missed). The same multiply-adds in the same order.
template <int NV>
inline void GatherWeightedStepsBlock(const float* w, const int32_t* tok, size_t n, const float* values,
                                     size_t d, size_t col, float* const* out) {
  constexpr int kSteps = 4;
  constexpr size_t kAhead = 12;
  __m256 acc[kSteps][NV];
  for (int s = 0; s < kSteps; ++s)
    for (int j = 0; j < NV; ++j) acc[s][j] = _mm256_setzero_ps();
  auto add = [&](size_t i) {
    const float* v = values + static_cast<size_t>(tok[i]) * d + col;
    __m256 x[NV];
    for (int j = 0; j < NV; ++j) x[j] = _mm256_loadu_ps(v + 8 * j);
    for (int s = 0; s < kSteps; ++s) {
      const __m256 ws = _mm256_broadcast_ss(w + 4 * i + s);
      for (int j = 0; j < NV; ++j) acc[s][j] = _mm256_fmadd_ps(ws, x[j], acc[s][j]);
    }
  };
  size_t i = 0;
  for (; i + kAhead < n; ++i) {
    const float* va = values + static_cast<size_t>(tok[i + kAhead]) * d + col;
    _mm_prefetch(reinterpret_cast<const char*>(va), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(va + 8 * NV - 1), _MM_HINT_T0);
    add(i);
  }
  for (; i < n; ++i) add(i);
  for (int s = 0; s < kSteps; ++s)
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out[s] + col + 8 * j, acc[s][j]);
}

#endif

// out[k] ← out[k] + Σ p[tok[i]] v[k] over the slots in order, one multiply-add per slot as
// GatherWeightedRows does (columns [k0, d) of every row).
void GatherWeightedFrom(const float* p, const int32_t* tok, size_t n, const float* values, size_t d,
                        float* out) {
  size_t k0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; k0 + 32 <= d; k0 += 32) GatherWeightedBlock<4, true>(p, tok, n, values + k0, d, out + k0);
  for (; k0 + 8 <= d; k0 += 8) GatherWeightedBlock<1, true>(p, tok, n, values + k0, d, out + k0);
#endif
  AccumulateColumns(p, tok, n, values, d, k0, out);
}

}  // namespace

void GatherWeightedRowsSteps(const float* const* p, const int32_t* const* tok, const size_t* n, size_t common,
                             const float* values, int d, float* const* out) {
  const size_t dd = static_cast<size_t>(d);
#if defined(__AVX2__) && defined(__FMA__)
  static_assert(kGatherSteps == 4);
  thread_local std::vector<float> packed;  // packed[4 i + s] = p[s][tok[0][i]]
  packed.resize(4 * common);
  for (size_t i = 0; i < common; ++i)
    for (int s = 0; s < kGatherSteps; ++s) packed[4 * i + s] = p[s][tok[0][i]];
  size_t k0 = 0;
  for (; k0 + 16 <= dd; k0 += 16)
    GatherWeightedStepsBlock<2>(packed.data(), tok[0], common, values, dd, k0, out);
  for (; k0 + 8 <= dd; k0 += 8)
    GatherWeightedStepsBlock<1>(packed.data(), tok[0], common, values, dd, k0, out);
  // The remaining columns (d % 8) of the shared slots, one step at a time: the portable loop's order.
  for (int s = 0; s < kGatherSteps; ++s) {
    for (size_t k = k0; k < dd; ++k) out[s][k] = 0.0f;
    AccumulateColumns(p[s], tok[0], common, values, dd, k0, out[s]);
  }
  for (int s = 0; s < kGatherSteps; ++s)
    GatherWeightedFrom(p[s], tok[s] + common, n[s] - common, values, dd, out[s]);
#else
  (void)common;
  for (int s = 0; s < kGatherSteps; ++s) GatherWeightedRows(p[s], tok[s], n[s], values, d, out[s]);
#endif
}

float SoftmaxInPlace(float* x, int n) {
  const float mx = RowMax(x, n);
  // Four independent double partial sums (fixed order, so deterministic): part[k] adds x[k], x[k + 4], ...
  double part[4] = {0, 0, 0, 0};
  int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  // The exponentials and the sum in one pass, eight elements at a time: the sum's serial chain (two adds
  // per eight elements) overlaps the exponentials' arithmetic instead of following it in a second pass.
  // The same bits: ExpNonPositive8 is ExpNonPositive's operations as compiled for the old loop, and the
  // four lanes of `acc` are part[0..3], each adding its elements in order.
  const __m256 m = _mm256_set1_ps(mx);
  __m256d acc = _mm256_setzero_pd();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = ExpNonPositive8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  _mm256_storeu_pd(part, acc);
#endif
  for (int j = i; j < n; ++j) x[j] = ExpNonPositive(x[j] - mx);
  int i4 = i;
  for (; i4 + 4 <= n; i4 += 4)
    for (int k = 0; k < 4; ++k) part[k] += x[i4 + k];
  for (; i4 < n; ++i4) part[0] += x[i4];
  const double sum = (part[0] + part[1]) + (part[2] + part[3]);
  const float inv = static_cast<float>(1.0 / sum);
  for (int i = 0; i < n; ++i) x[i] *= inv;
  return mx + static_cast<float>(std::log(sum));
}

void ComputeDecodeReference(const ModelInfo& m, int prefill_length, int num_steps, const float* q_decode,
                            const float* keys, const float* values, DecodeReference* out,
                            const Modality* modality) {
  EnsureSingleThreadedBlas();
  const int d = m.head_dim;
  const int t_all = prefill_length + num_steps;
  out->num_steps = num_steps;
  out->num_keys = t_all;
  out->head_dim = d;
  // Every element is written below (the products with beta 0, the masked keys' zeros row by row), so a
  // recycled buffer (sim/replay.cc PassBuffers) is resized, not zero-filled first: whatever it held is
  // overwritten.
  out->probs.resize(static_cast<size_t>(num_steps) * t_all);
  out->log_z.resize(num_steps);
  out->output.resize(static_cast<size_t>(num_steps) * d);
  out->first.resize(num_steps);
  out->exact.assign(modality != nullptr ? num_steps : 0, 0);
  out->sums.resize(modality != nullptr ? num_steps : 0);
  if (num_steps == 0) return;
  // The keys' runs of one modality (run r ends at run_end[r]), clipped to each row's visible keys below.
  thread_local std::vector<int32_t> run_end, row_end;
  thread_local std::vector<uint8_t> run_kind, row_kind;
  run_end.clear();
  run_kind.clear();
  if (modality != nullptr) {
    for (int j = 0; j < t_all; ++j) {
      const uint8_t k = static_cast<uint8_t>(modality[j]);
      if (j == 0 || k != run_kind.back()) {
        if (j > 0) run_end.push_back(j);
        run_kind.push_back(k);
      }
    }
    run_end.push_back(t_all);
  }
  // Logits for all steps at once: [S][T] = scale * Qd [S][d] x K^T.
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, num_steps, t_all, d,
              static_cast<float>(m.softmax_scale), q_decode, d, keys, d, 0.0f, out->probs.data(), t_all);
  const float cap = static_cast<float>(m.logit_softcap);
  for (int t = 0; t < num_steps; ++t) {
    float* row = out->probs.data() + static_cast<size_t>(t) * t_all;
    const int pos = prefill_length + t;
    const int first = FirstVisibleKey(m, pos);
    out->first[t] = first;
    SoftCap(row + first, pos - first + 1, cap);
    out->log_z[t] = SoftmaxInPlace(row + first, pos - first + 1);
    if (modality != nullptr) {  // the row's sums by modality and in all, from the cache
      row_end.clear();
      row_kind.clear();
      for (size_t r = 0; r < run_end.size(); ++r) {
        const int e = std::min(run_end[r], pos + 1);
        if (e <= first) continue;
        row_end.push_back(e - first);
        row_kind.push_back(run_kind[r]);
        if (e == pos + 1) break;
      }
      out->exact[t] = ExactKindSums({row + first, static_cast<size_t>(pos - first + 1)}, row_end, row_kind,
                                    &out->sums[t]);
    }
    std::fill(row, row + first, 0.0f);
    std::fill(row + pos + 1, row + t_all, 0.0f);
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, num_steps, d, t_all, 1.0f, out->probs.data(), t_all,
              values, d, 0.0f, out->output.data(), d);
}

void AccumulateColumnSums(const ModelInfo& m, const float* queries, const int32_t* q_pos, int num_queries,
                          const float* keys, int key_limit, float* col_sums) {
  EnsureSingleThreadedBlas();
  const int d = m.head_dim;
  const float cap = static_cast<float>(m.logit_softcap);
  // The logits block, kept per thread across calls and only grown: the product (beta 0) writes every element
  // read below, so no zero fill is needed (a fresh vector's was ≈ 0.3% of the 9-run sweep's samples; issue
  // 14, round 20).
  thread_local std::vector<float> block;
  for (int b0 = 0; b0 < num_queries; b0 += kRowBlock) {
    const int b1 = std::min(num_queries, b0 + kRowBlock);
    const int rows = b1 - b0;
    // Keys any row of this block can see (positions ascending): up to min(last pos, key_limit - 1).
    const int kmax = std::min(q_pos[b1 - 1] + 1, key_limit);
    const int kmin = FirstVisibleKey(m, q_pos[b0]);
    if (kmax <= kmin) continue;
    const int width = kmax - kmin;
    if (block.size() < static_cast<size_t>(rows) * width) block.resize(static_cast<size_t>(rows) * width);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, width, d, static_cast<float>(m.softmax_scale),
                queries + static_cast<size_t>(b0) * d, d, keys + static_cast<size_t>(kmin) * d, d, 0.0f,
                block.data(), width);
    for (int r = 0; r < rows; ++r) {
      const int pos = q_pos[b0 + r];
      const int lo = FirstVisibleKey(m, pos) - kmin;
      const int hi = std::min(pos + 1, key_limit) - kmin;  // exclusive
      if (hi <= lo) continue;
      float* row = block.data() + static_cast<size_t>(r) * width;
      SoftCap(row + lo, hi - lo, cap);
      SoftmaxInPlace(row + lo, hi - lo);
      float* dst = col_sums + kmin;
      for (int j = lo; j < hi; ++j) dst[j] += row[j];
    }
  }
}

float SoftmaxEntropy(const float* x, int n) {
  if (n <= 1) return 0.0f;
  const float mx = RowMax(x, n);
  // With y = x - max and e = exp(y): H = log Σe - Σ e y / Σe (no logarithm per element). Simple map and
  // reduction loops (they vectorise), partial sums combined in a fixed order.
  thread_local std::vector<float> y, e;
  y.resize(n);
  e.resize(n);
  float* __restrict yp = y.data();
  float* __restrict ep = e.data();
  for (int i = 0; i < n; ++i) yp[i] = x[i] - mx;
  for (int i = 0; i < n; ++i) ep[i] = ExpNonPositive(yp[i]);
  double z[4] = {0, 0, 0, 0}, zy[4] = {0, 0, 0, 0};
  int i = 0;
  for (; i + 4 <= n; i += 4)
    for (int k = 0; k < 4; ++k) {
      z[k] += e[i + k];
      zy[k] += e[i + k] * y[i + k];
    }
  for (; i < n; ++i) z[0] += e[i], zy[0] += e[i] * y[i];
  const double sz = (z[0] + z[1]) + (z[2] + z[3]), szy = (zy[0] + zy[1]) + (zy[2] + zy[3]);
  return static_cast<float>(std::max(0.0, std::log(sz) - szy / sz));
}

namespace {

constexpr int kEntropyRows = 128;  // query rows per GEMM block (prompt entropies)

// Gathers rows `idx` of a [*][d] matrix.
std::vector<float> GatherRows(const float* src, std::span<const int32_t> idx, int d) {
  std::vector<float> out(idx.size() * static_cast<size_t>(d));
  for (size_t i = 0; i < idx.size(); ++i)
    std::copy(src + static_cast<size_t>(idx[i]) * d, src + static_cast<size_t>(idx[i] + 1) * d,
              out.begin() + i * d);
  return out;
}

}  // namespace

double MeanRowEntropy(const LogitTransform& tf, const float* q, int rows, const float* k, int cols, int d) {
  if (rows == 0 || cols == 0) return 0;
  EnsureSingleThreadedBlas();
  std::vector<float> block(static_cast<size_t>(kEntropyRows) * cols);
  double sum = 0;
  for (int b = 0; b < rows; b += kEntropyRows) {
    const int r = std::min(kEntropyRows, rows - b);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r, cols, d, tf.scale, q + static_cast<size_t>(b) * d,
                d, k, d, 0.0f, block.data(), cols);
    for (int i = 0; i < r; ++i) {
      float* row = block.data() + static_cast<size_t>(i) * cols;
      SoftCap(row, cols, tf.softcap);
      sum += SoftmaxEntropy(row, cols);
    }
  }
  return sum / rows;
}

double MeanCausalRowEntropy(const ModelInfo& m, const float* q, const float* k, int n) {
  if (n == 0) return 0;
  EnsureSingleThreadedBlas();
  const int d = m.head_dim;
  std::vector<float> block;
  double sum = 0;
  for (int b0 = 0; b0 < n; b0 += kEntropyRows) {
    const int b1 = std::min(n, b0 + kEntropyRows), rows = b1 - b0;
    const int kmin = FirstVisibleKey(m, b0), width = b1 - kmin;
    block.resize(static_cast<size_t>(rows) * width);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, width, d, static_cast<float>(m.softmax_scale),
                q + static_cast<size_t>(b0) * d, d, k + static_cast<size_t>(kmin) * d, d, 0.0f, block.data(),
                width);
    for (int i = 0; i < rows; ++i) {
      const int pos = b0 + i, lo = FirstVisibleKey(m, pos) - kmin, hi = pos + 1 - kmin;
      float* row = block.data() + static_cast<size_t>(i) * width + lo;
      SoftCap(row, hi - lo, static_cast<float>(m.logit_softcap));
      sum += SoftmaxEntropy(row, hi - lo);
    }
  }
  return sum / n;
}

double MeanRowEntropyOfHeadMean(const ModelInfo& m, std::span<const float* const> q,
                                std::span<const float* const> k, int rows, int cols, bool causal,
                                int threads) {
  KVSIM_CHECK(q.size() == k.size());
  const int H = static_cast<int>(q.size()), d = m.head_dim;
  if (rows == 0 || cols == 0 || H == 0) return 0;
  EnsureSingleThreadedBlas();
  const float scale = static_cast<float>(m.softmax_scale), cap = static_cast<float>(m.logit_softcap);
  const int blocks = (rows + kEntropyRows - 1) / kEntropyRows;
  std::vector<double> part(blocks, 0.0);  // per row block, summed in block order: any thread count
  ParallelFor(blocks, threads, [&](int b) {
    const int r0 = b * kEntropyRows, r1 = std::min(rows, r0 + kEntropyRows), nr = r1 - r0;
    const int kmin = causal ? FirstVisibleKey(m, r0) : 0, width = (causal ? r1 : cols) - kmin;
    auto lo = [&](int i) { return causal ? FirstVisibleKey(m, r0 + i) - kmin : 0; };
    auto hi = [&](int i) { return causal ? r0 + i + 1 - kmin : width; };
    std::vector<float> block(static_cast<size_t>(nr) * width), mean(block.size(), 0.0f);
    for (int h = 0; h < H; ++h) {  // heads in a fixed order
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, width, d, scale,
                  q[h] + static_cast<size_t>(r0) * d, d, k[h] + static_cast<size_t>(kmin) * d, d, 0.0f,
                  block.data(), width);
      for (int i = 0; i < nr; ++i) {
        float* row = block.data() + static_cast<size_t>(i) * width;
        float* acc = mean.data() + static_cast<size_t>(i) * width;
        SoftCap(row + lo(i), hi(i) - lo(i), cap);
        SoftmaxInPlace(row + lo(i), hi(i) - lo(i));
        for (int j = lo(i); j < hi(i); ++j) acc[j] += row[j];
      }
    }
    double sum = 0;
    for (int i = 0; i < nr; ++i) {
      const float* acc = mean.data() + static_cast<size_t>(i) * width;
      for (int j = lo(i); j < hi(i); ++j) {
        const double p = static_cast<double>(acc[j]) / H;
        if (p > 0) sum -= p * std::log(p);
      }
    }
    part[b] = sum;
  });
  return std::accumulate(part.begin(), part.end(), 0.0) / rows;
}

void HeadPromptEntropies(const ModelInfo& m, std::span<const Modality> modality, const float* q,
                         const float* k, int ce, bool self, bool cross, double out[kNumPromptEntropyKinds]) {
  KVSIM_CHECK(static_cast<int>(modality.size()) >= ce);
  const int d = m.head_dim;
  out[kSelfEntropy] = self ? MeanCausalRowEntropy(m, q, k, ce) : 0;
  out[kTextToVisualEntropy] = out[kVisualToTextEntropy] = 0;
  if (!cross) return;
  std::vector<int32_t> text, visual;
  for (int j = 0; j < ce; ++j)
    (modality[j] == Modality::kImage || modality[j] == Modality::kVideo ? visual : text).push_back(j);
  const LogitTransform tf(m);
  const std::vector<float> qt = GatherRows(q, text, d), qv = GatherRows(q, visual, d);
  const std::vector<float> kt = GatherRows(k, text, d), kv = GatherRows(k, visual, d);
  const int nt = static_cast<int>(text.size()), nv = static_cast<int>(visual.size());
  out[kTextToVisualEntropy] = MeanRowEntropy(tf, qt.data(), nt, kv.data(), nv, d);
  out[kVisualToTextEntropy] = MeanRowEntropy(tf, qv.data(), nv, kt.data(), nt, d);
}

}  // namespace kvsim
