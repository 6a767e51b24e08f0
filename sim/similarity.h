#pragma once
// Cosine similarities of key vectors with a fixed summation order, and the per-(layer, KV head) matrix of
// the prompt keys' pairwise cosines that the merging runs of a head share (issue 14).
//
// Every similarity is dot(n_i, n_j) of the rows scaled to unit length (NormalizeRows), summed as one fused
// multiply-add chain over k = 0 .. d-1 from 0 (CosineDots). The value of a pair therefore depends only on
// the two rows, not on how many rows are computed together or where a row falls in a block (an sgemm rounds
// by its blocking), and it is symmetric: fma(a, b, s) == fma(b, a, s). So a similarity read from the shared
// matrix is bit-identical to one computed for a single merge call.

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

namespace kvsim {

// Rows of `x` ([rows][d]) scaled to unit length into `out` (zero rows stay zero). Each row's squared norm is
// a double sum over k in order, so a row's result does not depend on the other rows.
void NormalizeRows(const float* x, int rows, int d, float* out);

// c[i * ldc + j] = Σ_k a[i][k] * b[j][k] for i < rows, j < cols, as one FMA chain over k in order (see
// above). `a` is [rows][d], `b` [cols][d].
void CosineDots(const float* a, int rows, const float* b, int cols, int d, float* c, int ldc);

// Index of the first maximum of a row of n > 0 finite values (std::max_element's answer).
int FirstMaxIndex(const float* row, int n);

// Buffers for PromptSimilarity matrices, reused: a fresh matrix's pages are zeroed by the kernel on first
// touch, which cost as much as computing it. Thread-safe. Holds at most as many buffers as were alive at
// once; freed with the pool.
class SimilarityPool {
 public:
  using Buffer = std::unique_ptr<float[], void (*)(void*)>;
  // A buffer of >= `floats` floats (2 MB-aligned, advised as transparent huge pages; not initialised).
  Buffer Acquire(size_t floats, size_t* capacity);
  void Release(Buffer buffer, size_t capacity);

 private:
  std::mutex mu_;
  std::vector<std::pair<size_t, Buffer>> free_;
};

// The cosines of every pair of the first `n` keys of one KV head, computed on first use and shared by every
// run (policy and budget) of the (layer, KV head) that asks. Stored as the upper triangle (i <= j), row by
// row: n (n + 1) / 2 floats. Thread-safe: runs of one head may ask from different workers.
class PromptSimilarity {
 public:
  // keys: [>= n][d] the head's keys (fp32); not copied, must outlive this object.
  // pool: where the matrix's buffer comes from and goes back to (may be null); must outlive this object.
  PromptSimilarity(const float* keys, int n, int d, SimilarityPool* pool = nullptr)
      : keys_(keys), n_(n), d_(d), pool_(pool) {}
  ~PromptSimilarity();
  PromptSimilarity(const PromptSimilarity&) = delete;
  PromptSimilarity& operator=(const PromptSimilarity&) = delete;

  int size() const { return n_; }
  // Whether Nearest can answer for these token positions: all in [0, size()), and the triangle is
  // addressable with 32-bit offsets.
  bool Covers(std::span<const int32_t> tokens) const;
  // For every query token, the index into `targets` of the most cosine-similar target (first maximum in
  // the order of `targets`) and that similarity: what NearestByCosine returns for the same keys. Every
  // token must be covered; targets non-empty.
  void Nearest(std::span<const int32_t> queries, std::span<const int32_t> targets, std::vector<int>* nearest,
               std::vector<float>* similarity);
  // How many Nearest calls this matrix answered (tests, diagnostics).
  int64_t calls() const;

 private:
  void Compute();

  const float* keys_;
  int n_, d_;
  std::once_flag once_;
  SimilarityPool* pool_;
  SimilarityPool::Buffer tri_storage_{nullptr, std::free};
  size_t tri_capacity_ = 0;
  float* tri_ = nullptr;           // upper triangle, row i holds columns [i, n)
  std::vector<int32_t> col_base_;  // tri_[col_base_[j] + i] = cos(i, j) for i <= j
  mutable std::mutex mu_;
  int64_t calls_ = 0;
};

}  // namespace kvsim
