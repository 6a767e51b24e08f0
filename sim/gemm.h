#pragma once
// The reference's two fp32 matrix products (sim/attention.cc ComputeDecodeReference), with every output
// element defined by a fixed order of operations: the same bits whatever the element's place in the matrix,
// the matrix sizes, the tiling, the thread count or the CPU (an AVX2+FMA path and a portable path written
// with std::fma give identical bits; tests/sim/gemm_test.cc checks both against a scalar model). Neither
// packs its operands nor makes a separate pass over C for beta = 0.
//
// All matrices are row-major with leading dimensions (row strides) in elements; IEEE binary32 round to
// nearest even; no flush-to-zero assumed (the project never sets it).

#include <cstdint>

namespace kvsim {

// Scaled dot products of rows: c[i * ldc + j] = scale * D(a_i, b_j) for i < m, j < n, where a_i = a + i * lda
// and b_j = b + j * ldb each hold k floats (cblas_sgemm NoTrans x Trans, beta 0: C = scale * A B^T).
// D(x, y), exactly: acc = +0; for p = 0, 1, ..., k - 1: acc = fma(x[p], y[p], acc); the element is the
// rounded product scale * D. Bound for finite inputs: |element - scale * exact| <= |scale| * (k + 1) * 2^-24
// * sum_p |x[p] y[p]| (to first order), before underflow.
void GemmDotRows(int m, int n, int k, float scale, const float* a, int lda, const float* b, int ldb, float* c,
                 int ldc);

// Row-range products: c[i * ldc + col] for i < m, col < n is, exactly, the fma chain
// acc = +0; for j = lo_i, lo_i + 1, ..., hi_i - 1: acc = fma(a[i * lda + j], b[j * ldb + col], acc)
// (cblas_sgemm NoTrans x NoTrans with alpha 1, beta 0, over each row's range of A's columns: the terms
// outside [lo_i, hi_i) are skipped, not added as zeros). lo and hi (m entries each, 0 <= lo_i, hi_i <= k) may
// both be null for the whole range [0, k); an empty range gives +0. Bound for finite inputs: |element -
// exact| <= (hi_i - lo_i) * 2^-24 * sum_j |a_ij b_j,col| (one rounding per term), before underflow.
void GemmRowRanges(int m, int n, int k, const float* a, int lda, const float* b, int ldb, const int32_t* lo,
                   const int32_t* hi, float* c, int ldc);

// Tests only: false makes both functions take their portable path on an AVX2+FMA build too.
void SetGemmAvx2ForTesting(bool allowed);

}  // namespace kvsim
