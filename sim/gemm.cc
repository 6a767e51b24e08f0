#include "sim/gemm.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <vector>

namespace kvsim {

namespace {

std::atomic<bool> g_gemm_avx2_allowed{true};

// The portable paths: the definitions in sim/gemm.h, element by element.
float DotRowsPortable(const float* x, const float* y, int k) {
  float acc = 0.0f;
  for (int p = 0; p < k; ++p) acc = std::fma(x[p], y[p], acc);
  return acc;
}

void GemmDotRowsPortable(int m, int n, int k, float scale, const float* a, int lda, const float* b, int ldb,
                         float* c, int ldc) {
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j)
      c[static_cast<size_t>(i) * ldc + j] =
          scale * DotRowsPortable(a + static_cast<size_t>(i) * lda, b + static_cast<size_t>(j) * ldb, k);
}

void GemmRowRangesPortable(int m, int n, int k, const float* a, int lda, const float* b, int ldb,
                           const int32_t* lo, const int32_t* hi, float* c, int ldc) {
  for (int i = 0; i < m; ++i) {
    const int j0 = lo != nullptr ? lo[i] : 0;
    const int j1 = hi != nullptr ? hi[i] : k;
    float* ci = c + static_cast<size_t>(i) * ldc;
    std::fill(ci, ci + n, 0.0f);
    const float* ai = a + static_cast<size_t>(i) * lda;
    for (int j = j0; j < j1; ++j) {
      const float* bj = b + static_cast<size_t>(j) * ldb;
      for (int col = 0; col < n; ++col) ci[col] = std::fma(ai[j], bj[col], ci[col]);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)

// Lanes [0, r) set (0 <= r <= 8), for masked loads and stores of a row's last r < 8 elements.
__m256i TailMask(int r) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(r), lane);
}

// Transposes the 8 x 8 block r[0..7] (r[i] = row i) in place: afterwards r[c] holds column c.
__attribute__((always_inline)) inline void Transpose8(__m256 (&r)[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// NB rows of B (NB <= 6) against sixteen rows of A held transposed in at ([k][16], a strip of A^T):
// acc[2r + h] lane l is row 8h + l's chain with B's row r, one fma per p in order; then transposed and
// scaled, and rows [0, rows) of C get their NB elements.
template <int NB>
void DotTile(int k, float scale, const float* at, const float* b, int ldb, float* c, int ldc, int rows) {
  __m256 acc[2 * NB];  // row r of B: acc[2r] (A's rows 0-7), acc[2r + 1] (rows 8-15)
  for (int r = 0; r < 2 * NB; ++r) acc[r] = _mm256_setzero_ps();
  for (int p = 0; p < k; ++p) {
    const __m256 a0 = _mm256_loadu_ps(at + static_cast<size_t>(p) * 16);
    const __m256 a1 = _mm256_loadu_ps(at + static_cast<size_t>(p) * 16 + 8);
    for (int r = 0; r < NB; ++r) {
      const __m256 bv = _mm256_broadcast_ss(b + static_cast<size_t>(r) * ldb + p);
      acc[2 * r] = _mm256_fmadd_ps(bv, a0, acc[2 * r]);
      acc[2 * r + 1] = _mm256_fmadd_ps(bv, a1, acc[2 * r + 1]);
    }
  }
  // Transposed and scaled into out[16][8] with constant indices only (so acc stays in registers), then
  // rows [0, rows) to C.
  const __m256 s = _mm256_set1_ps(scale);
  alignas(32) float out[16][8];
  __m256 t0[8], t1[8];
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r) t0[r] = t1[r] = _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int r = 0; r < NB; ++r) {
    t0[r] = acc[2 * r];
    t1[r] = acc[2 * r + 1];
  }
  Transpose8(t0);
  Transpose8(t1);
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    _mm256_store_ps(out[i], _mm256_mul_ps(s, t0[i]));
    _mm256_store_ps(out[8 + i], _mm256_mul_ps(s, t1[i]));
  }
  for (int i = 0; i < rows; ++i) std::copy(out[i], out[i] + NB, c + static_cast<size_t>(i) * ldc);
}

void GemmDotRowsAvx2(int m, int n, int k, float scale, const float* a, int lda, const float* b, int ldb,
                     float* c, int ldc) {
  // A transposed in strips of sixteen rows ([m16 / 16][k][16], rows past m zero): each strip is one tile's
  // vector operand, read in place while B's rows are broadcast.
  thread_local std::vector<float> at;
  const int m16 = (m + 15) / 16 * 16;
  at.assign(static_cast<size_t>(m16) * k, 0.0f);
  for (int i = 0; i < m; ++i)
    for (int p = 0; p < k; ++p)
      at[(static_cast<size_t>(i / 16) * k + p) * 16 + i % 16] = a[static_cast<size_t>(i) * lda + p];
  // Blocks of B's rows that stay in L1 (about 12 KB) while every strip of A passes over them.
  const int block = std::max(6, (12288 / (4 * std::max(k, 1))) / 6 * 6);
  for (int n0 = 0; n0 < n; n0 += block) {
    const int n1 = std::min(n, n0 + block);
    for (int i = 0; i < m; i += 16) {
      const float* strip = at.data() + static_cast<size_t>(i) * k;
      const int rows = std::min(16, m - i);
      float* ci = c + static_cast<size_t>(i) * ldc;
      int j = n0;
      for (; j + 6 <= n1; j += 6)
        DotTile<6>(k, scale, strip, b + static_cast<size_t>(j) * ldb, ldb, ci + j, ldc, rows);
      const float* bj = b + static_cast<size_t>(j) * ldb;
      switch (n1 - j) {
        case 5:
          DotTile<5>(k, scale, strip, bj, ldb, ci + j, ldc, rows);
          break;
        case 4:
          DotTile<4>(k, scale, strip, bj, ldb, ci + j, ldc, rows);
          break;
        case 3:
          DotTile<3>(k, scale, strip, bj, ldb, ci + j, ldc, rows);
          break;
        case 2:
          DotTile<2>(k, scale, strip, bj, ldb, ci + j, ldc, rows);
          break;
        case 1:
          DotTile<1>(k, scale, strip, bj, ldb, ci + j, ldc, rows);
          break;
        default:
          break;
      }
    }
  }
}

template <int NV, bool masked>
__attribute__((always_inline)) inline void LoadRow(const float* src, __m256i mask, __m256 (&out)[NV]) {
  for (int v = 0; v < NV; ++v)
    out[v] = masked && v == NV - 1 ? _mm256_maskload_ps(src + 8 * v, mask) : _mm256_loadu_ps(src + 8 * v);
}

// B's rows [e0, e1) into the accumulators of the tile's rows whose range holds them (every row when `all`).
template <int MR, int NV, bool masked, bool all>
__attribute__((always_inline)) inline void RangeSteps(int e0, int e1, const float* a, int lda, const float* b,
                                                      int ldb, const int* lo, const int* hi, __m256i mask,
                                                      __m256 (&acc)[MR][NV]) {
  for (int j = e0; j < e1; ++j) {
    __m256 bv[NV];
    LoadRow<NV, masked>(b + static_cast<size_t>(j) * ldb, mask, bv);
    for (int i = 0; i < MR; ++i) {
      if (!all && (j < lo[i] || j >= hi[i])) continue;
      const __m256 av = _mm256_broadcast_ss(a + static_cast<size_t>(i) * lda + j);
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(av, bv[v], acc[i][v]);
    }
  }
}

// MR rows of C, NV vectors of 8 columns (the last one masked by `mask` when `masked`), over B's rows
// [j0, j1) intersected with each row's range: accumulators loaded from C, updated in j order, stored back.
template <int MR, int NV, bool masked>
void RangeTile(int j0, int j1, const float* a, int lda, const float* b, int ldb, const int* lo, const int* hi,
               float* c, int ldc, __m256i mask) {
  __m256 acc[MR][NV];
  for (int i = 0; i < MR; ++i) LoadRow<NV, masked>(c + static_cast<size_t>(i) * ldc, mask, acc[i]);
  // The rows' common range [core0, core1) with every row's term; before and after it, each row's own.
  int core0 = j0, core1 = j1, any0 = j1, any1 = j0;
  for (int i = 0; i < MR; ++i) {
    core0 = std::max(core0, lo[i]);
    core1 = std::min(core1, hi[i]);
    any0 = std::min(any0, std::max(j0, lo[i]));
    any1 = std::max(any1, std::min(j1, hi[i]));
  }
  if (core1 < core0) core1 = core0;
  RangeSteps<MR, NV, masked, false>(any0, std::min(core0, any1), a, lda, b, ldb, lo, hi, mask, acc);
  RangeSteps<MR, NV, masked, true>(core0, core1, a, lda, b, ldb, lo, hi, mask, acc);
  RangeSteps<MR, NV, masked, false>(std::max(core1, any0), any1, a, lda, b, ldb, lo, hi, mask, acc);
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) {
      float* dst = c + static_cast<size_t>(i) * ldc + 8 * v;
      if (masked && v == NV - 1)
        _mm256_maskstore_ps(dst, mask, acc[i][v]);
      else
        _mm256_storeu_ps(dst, acc[i][v]);
    }
}

// Fewer than 16 columns: one vector of 8, then a masked one.
template <int MR>
void RangeNarrowRows(int width, int j0, int j1, const float* a, int lda, const float* b, int ldb,
                     const int* lo, const int* hi, float* c, int ldc) {
  int col = 0;
  if (width >= 8) {
    RangeTile<MR, 1, false>(j0, j1, a, lda, b, ldb, lo, hi, c, ldc, _mm256_setzero_si256());
    col = 8;
  }
  if (col < width)
    RangeTile<MR, 1, true>(j0, j1, a, lda, b + col, ldb, lo, hi, c + col, ldc, TailMask(width - col));
}

void RangeNarrow(int r, int width, int j0, int j1, const float* a, int lda, const float* b, int ldb,
                 const int* lo, const int* hi, float* c, int ldc) {
  switch (r) {
    case 6:
      return RangeNarrowRows<6>(width, j0, j1, a, lda, b, ldb, lo, hi, c, ldc);
    case 5:
      return RangeNarrowRows<5>(width, j0, j1, a, lda, b, ldb, lo, hi, c, ldc);
    case 4:
      return RangeNarrowRows<4>(width, j0, j1, a, lda, b, ldb, lo, hi, c, ldc);
    case 3:
      return RangeNarrowRows<3>(width, j0, j1, a, lda, b, ldb, lo, hi, c, ldc);
    case 2:
      return RangeNarrowRows<2>(width, j0, j1, a, lda, b, ldb, lo, hi, c, ldc);
    default:
      return RangeNarrowRows<1>(width, j0, j1, a, lda, b, ldb, lo, hi, c, ldc);
  }
}

void GemmRowRangesAvx2(int m, int n, int k, const float* a, int lda, const float* b, int ldb,
                       const int32_t* lo, const int32_t* hi, float* c, int ldc) {
  for (int i = 0; i < m; ++i)
    std::fill(c + static_cast<size_t>(i) * ldc, c + static_cast<size_t>(i) * ldc + n, 0.0f);
  // Blocks of B's rows whose strip of 16 columns stays in L1 (256 rows: 16 KB) while every tile of C's rows
  // passes over it; each tile's accumulators are reloaded from C at the next block (the same chain: storing
  // a float changes nothing).
  constexpr int kBlock = 256;
  std::vector<int> row_lo(m), row_hi(m);
  for (int i = 0; i < m; ++i) {
    row_lo[i] = lo != nullptr ? lo[i] : 0;
    row_hi[i] = hi != nullptr ? hi[i] : k;
  }
  const __m256i none = _mm256_setzero_si256();
  for (int j0 = 0; j0 < k; j0 += kBlock) {
    const int j1 = std::min(k, j0 + kBlock);
    for (int col = 0; col < n; col += 16) {
      const int width = std::min(16, n - col);
      for (int i = 0; i < m; i += 6) {
        const float* ai = a + static_cast<size_t>(i) * lda;
        float* ci = c + static_cast<size_t>(i) * ldc + col;
        const float* bc = b + col;
        const int* li = row_lo.data() + i;
        const int* hi_i = row_hi.data() + i;
        const int r = std::min(6, m - i);
        if (width == 16) {
          switch (r) {
            case 6:
              RangeTile<6, 2, false>(j0, j1, ai, lda, bc, ldb, li, hi_i, ci, ldc, none);
              break;
            case 5:
              RangeTile<5, 2, false>(j0, j1, ai, lda, bc, ldb, li, hi_i, ci, ldc, none);
              break;
            case 4:
              RangeTile<4, 2, false>(j0, j1, ai, lda, bc, ldb, li, hi_i, ci, ldc, none);
              break;
            case 3:
              RangeTile<3, 2, false>(j0, j1, ai, lda, bc, ldb, li, hi_i, ci, ldc, none);
              break;
            case 2:
              RangeTile<2, 2, false>(j0, j1, ai, lda, bc, ldb, li, hi_i, ci, ldc, none);
              break;
            default:
              RangeTile<1, 2, false>(j0, j1, ai, lda, bc, ldb, li, hi_i, ci, ldc, none);
              break;
          }
        } else {
          RangeNarrow(r, width, j0, j1, ai, lda, bc, ldb, li, hi_i, ci, ldc);
        }
      }
    }
  }
}

#endif

}  // namespace

void SetGemmAvx2ForTesting(bool allowed) { g_gemm_avx2_allowed.store(allowed, std::memory_order_relaxed); }

void GemmDotRows(int m, int n, int k, float scale, const float* a, int lda, const float* b, int ldb, float* c,
                 int ldc) {
  if (m <= 0 || n <= 0) return;
#if defined(__AVX2__) && defined(__FMA__)
  if (g_gemm_avx2_allowed.load(std::memory_order_relaxed)) {
    GemmDotRowsAvx2(m, n, k, scale, a, lda, b, ldb, c, ldc);
    return;
  }
#endif
  GemmDotRowsPortable(m, n, k, scale, a, lda, b, ldb, c, ldc);
}

void GemmRowRanges(int m, int n, int k, const float* a, int lda, const float* b, int ldb, const int32_t* lo,
                   const int32_t* hi, float* c, int ldc) {
  if (m <= 0 || n <= 0) return;
#if defined(__AVX2__) && defined(__FMA__)
  if (g_gemm_avx2_allowed.load(std::memory_order_relaxed)) {
    GemmRowRangesAvx2(m, n, k, a, lda, b, ldb, lo, hi, c, ldc);
    return;
  }
#endif
  GemmRowRangesPortable(m, n, k, a, lda, b, ldb, lo, hi, c, ldc);
}

}  // namespace kvsim
