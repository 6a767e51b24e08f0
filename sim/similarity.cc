#include "sim/similarity.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <new>

#include "sim/status.h"

namespace kvsim {
namespace {

// Row r's squared norm as a sequential double sum over k (the order every row has always used).
double SquaredNorm(const float* row, int d) {
  double s = 0;
  for (int k = 0; k < d; ++k) s += static_cast<double>(row[k]) * row[k];
  return s;
}

void ScaleRow(const float* x, double s, int d, float* out) {
  const float inv = s > 0 ? static_cast<float>(1.0 / std::sqrt(s)) : 0.0f;
  for (int k = 0; k < d; ++k) out[k] = x[k] * inv;
}

constexpr int kCols = 16;  // columns per packed panel / tile
constexpr int kRows = 6;   // rows per tile: 6 x 2 accumulators + 2 panel vectors + 1 broadcast registers

// Columns [j0, j0 + 16) of b ([cols][d]) as a panel [d][16], zero past `cols`.
void PackPanel(const float* b, int cols, int j0, int d, float* panel) {
  for (int c = 0; c < kCols; ++c) {
    const int j = j0 + c;
    if (j < cols) {
      const float* row = b + static_cast<size_t>(j) * d;
      for (int k = 0; k < d; ++k) panel[k * kCols + c] = row[k];
    } else {
      for (int k = 0; k < d; ++k) panel[k * kCols + c] = 0.0f;
    }
  }
}

// Rows [i0, i0 + 6) of a ([rows][d]) as a panel [d][6], zero past `rows`: the tile's broadcasts then read
// one contiguous stream.
void PackRows(const float* a, int rows, int i0, int d, float* panel) {
  for (int r = 0; r < kRows; ++r) {
    const int i = i0 + r;
    for (int k = 0; k < d; ++k) panel[k * kRows + r] = i < rows ? a[static_cast<size_t>(i) * d + k] : 0.0f;
  }
}

// All of a's row panels, [ceil(rows / 6)][d][6].
std::vector<float> PackAllRows(const float* a, int rows, int d) {
  const int panels = (rows + kRows - 1) / kRows;
  std::vector<float> out(static_cast<size_t>(panels) * d * kRows);
  for (int p = 0; p < panels; ++p)
    PackRows(a, rows, p * kRows, d, out.data() + static_cast<size_t>(p) * d * kRows);
  return out;
}

// out[r][c] = Σ_k apanel[k][r] * panel[k][c] for a 6 x 16 tile, one FMA chain per (r, c) over k in order
// from 0 (rows and columns past the data are zeros in the panels).
void Tile(const float* apanel, int d, const float* panel, float* out) {
#ifdef __AVX2__
  // Twelve named accumulators: with an array GCC stored every accumulator to the stack each iteration.
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
         c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int k = 0; k < d; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * kCols), b1 = _mm256_loadu_ps(panel + k * kCols + 8);
    const float* ak = apanel + k * kRows;
    __m256 x = _mm256_broadcast_ss(ak);
    c00 = _mm256_fmadd_ps(x, b0, c00);
    c01 = _mm256_fmadd_ps(x, b1, c01);
    x = _mm256_broadcast_ss(ak + 1);
    c10 = _mm256_fmadd_ps(x, b0, c10);
    c11 = _mm256_fmadd_ps(x, b1, c11);
    x = _mm256_broadcast_ss(ak + 2);
    c20 = _mm256_fmadd_ps(x, b0, c20);
    c21 = _mm256_fmadd_ps(x, b1, c21);
    x = _mm256_broadcast_ss(ak + 3);
    c30 = _mm256_fmadd_ps(x, b0, c30);
    c31 = _mm256_fmadd_ps(x, b1, c31);
    x = _mm256_broadcast_ss(ak + 4);
    c40 = _mm256_fmadd_ps(x, b0, c40);
    c41 = _mm256_fmadd_ps(x, b1, c41);
    x = _mm256_broadcast_ss(ak + 5);
    c50 = _mm256_fmadd_ps(x, b0, c50);
    c51 = _mm256_fmadd_ps(x, b1, c51);
  }
  const __m256 acc[kRows][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int r = 0; r < kRows; ++r) {
    _mm256_storeu_ps(out + r * kCols, acc[r][0]);
    _mm256_storeu_ps(out + r * kCols + 8, acc[r][1]);
  }
#else
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) {
      float s = 0.0f;
      for (int k = 0; k < d; ++k) s = std::fma(apanel[k * kRows + r], panel[k * kCols + c], s);
      out[r * kCols + c] = s;
    }
#endif
}

}  // namespace

SimilarityPool::Buffer SimilarityPool::Acquire(size_t floats, size_t* capacity) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->first >= floats) {
        Buffer b = std::move(it->second);
        *capacity = it->first;
        free_.erase(it);
        return b;
      }
  }
  // 2 MB-aligned and advised as huge pages: a block of queries reads eight rows at once, and the (t, q)
  // pairs one line in every target's row.
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes = (floats * sizeof(float) + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, bytes);
  if (p == nullptr) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  madvise(p, bytes, MADV_HUGEPAGE);
#endif
  *capacity = bytes / sizeof(float);
  return Buffer(static_cast<float*>(p), std::free);
}

void SimilarityPool::Release(Buffer buffer, size_t capacity) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.emplace_back(capacity, std::move(buffer));
}

PromptSimilarity::~PromptSimilarity() {
  if (pool_ != nullptr && tri_storage_) pool_->Release(std::move(tri_storage_), tri_capacity_);
}

// Eight rows at a time: each row's sum still runs over k in order (so the result is the same as one row at
// a time), but the eight dependency chains overlap instead of one latency-bound chain per row.
void NormalizeRows(const float* x, int rows, int d, float* out) {
  constexpr int kNormRows = 8;
  int r = 0;
  for (; r + kNormRows <= rows; r += kNormRows) {
    const float* xr = x + static_cast<size_t>(r) * d;
    double s[kNormRows] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < d; ++k)
      for (int i = 0; i < kNormRows; ++i) {
        const double v = xr[static_cast<size_t>(i) * d + k];
        s[i] += v * v;  // exact product (float x float fits a double): fused or not, the same sum
      }
    for (int i = 0; i < kNormRows; ++i)
      ScaleRow(xr + static_cast<size_t>(i) * d, s[i], d, out + static_cast<size_t>(r + i) * d);
  }
  for (; r < rows; ++r)
    ScaleRow(x + static_cast<size_t>(r) * d, SquaredNorm(x + static_cast<size_t>(r) * d, d), d,
             out + static_cast<size_t>(r) * d);
}

void CosineDots(const float* a, int rows, const float* b, int cols, int d, float* c, int ldc) {
  const std::vector<float> apanels = PackAllRows(a, rows, d);
  std::vector<float> panel(static_cast<size_t>(d) * kCols);
  float tile[kRows * kCols];
  for (int j0 = 0; j0 < cols; j0 += kCols) {
    PackPanel(b, cols, j0, d, panel.data());
    const int nc = std::min(kCols, cols - j0);
    for (int i0 = 0; i0 < rows; i0 += kRows) {
      const int nr = std::min(kRows, rows - i0);
      Tile(apanels.data() + static_cast<size_t>(i0) * d, d, panel.data(), tile);
      for (int r = 0; r < nr; ++r)
        std::copy_n(tile + r * kCols, nc, c + static_cast<size_t>(i0 + r) * ldc + j0);
    }
  }
}

// Two passes: an 8-lane max reduction (max is exact, so the lane order does not matter), then the first
// index equal to it, eight elements per compare mask. std::max_element's compare-and-select chain was the
// profile's top line of merging (issue 14); the compiler keeps both loops scalar, hence the AVX2 intrinsics
// (same comparisons: max_ps(v, lane) is `v > lane ? v : lane`, an ordered equality never matches a NaN).
int FirstMaxIndex(const float* row, int n) {
  float lane[8];
  int i = 0;
#ifdef __AVX2__
  __m256 lanes = _mm256_set1_ps(row[0]);
  for (; i + 8 <= n; i += 8) lanes = _mm256_max_ps(_mm256_loadu_ps(row + i), lanes);
  _mm256_storeu_ps(lane, lanes);
#else
  for (int k = 0; k < 8; ++k) lane[k] = row[0];
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) lane[k] = row[i + k] > lane[k] ? row[i + k] : lane[k];
#endif
  float mx = lane[0];
  for (int k = 1; k < 8; ++k) mx = lane[k] > mx ? lane[k] : mx;
  for (; i < n; ++i) mx = row[i] > mx ? row[i] : mx;
  int j = 0;
#ifdef __AVX2__
  const __m256 target = _mm256_set1_ps(mx);
  for (; j + 8 <= n; j += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), target, _CMP_EQ_OQ));
    if (mask != 0) return j + std::countr_zero(static_cast<unsigned>(mask));
  }
#endif
  for (; j < n; ++j)
    if (row[j] == mx) return j;
  return static_cast<int>(std::max_element(row, row + n) - row);  // a NaN: as before
}

bool PromptSimilarity::Covers(std::span<const int32_t> tokens) const {
  if (static_cast<int64_t>(n_) * (n_ + 1) / 2 > std::numeric_limits<int32_t>::max()) return false;
  for (int32_t t : tokens)
    if (t < 0 || t >= n_) return false;
  return true;
}

void PromptSimilarity::Compute() {
  const int n = n_, d = d_;
  std::vector<float> x(static_cast<size_t>(n) * d);
  NormalizeRows(keys_, n, d, x.data());
  const size_t floats = static_cast<size_t>(n) * (n + 1) / 2;
  if (pool_ != nullptr) {
    tri_storage_ = pool_->Acquire(floats, &tri_capacity_);
  } else {
    SimilarityPool own;
    tri_storage_ = own.Acquire(floats, &tri_capacity_);
  }
  tri_ = tri_storage_.get();
  col_base_.resize(n);
  for (int i = 0; i < n; ++i)  // row i starts at i*n - i(i-1)/2 and holds columns [i, n)
    col_base_[i] =
        static_cast<int32_t>(static_cast<int64_t>(i) * n - static_cast<int64_t>(i) * (i - 1) / 2 - i);
  const std::vector<float> apanels = PackAllRows(x.data(), n, d);
  std::vector<float> panel(static_cast<size_t>(d) * kCols);
  float tile[kRows * kCols];
  for (int j0 = 0; j0 < n; j0 += kCols) {  // only the tiles touching the upper triangle
    PackPanel(x.data(), n, j0, d, panel.data());
    const int j1 = std::min(n, j0 + kCols);
    for (int i0 = 0; i0 < j1; i0 += kRows) {
      const int nr = std::min(kRows, j1 - i0);
      Tile(apanels.data() + static_cast<size_t>(i0) * d, d, panel.data(), tile);
      for (int r = 0; r < nr; ++r) {
        const int i = i0 + r, from = std::max(i, j0);
        if (from < j1)
          std::copy(tile + r * kCols + (from - j0), tile + r * kCols + (j1 - j0), tri_ + col_base_[i] + from);
      }
    }
  }
}

void PromptSimilarity::Nearest(std::span<const int32_t> queries, std::span<const int32_t> targets,
                               std::vector<int>* nearest, std::vector<float>* similarity) {
  std::call_once(once_, [this] { Compute(); });
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++calls_;
  }
  const int nq = static_cast<int>(queries.size()), nt = static_cast<int>(targets.size());
  nearest->assign(nq, -1);
  similarity->assign(nq, 0.0f);
  if (nq == 0 || nt == 0) return;
  // cos(q, t) = tri_[col_base_[min(q, t)] + max(q, t)].
  const float* tri = tri_;
  int i = 0;
#ifdef __AVX2__
  // Eight queries at a time against every target in slot order, keeping each query's running maximum
  // (strictly greater replaces it: the first maximum in slot order, as FirstMaxIndex finds it for finite
  // values). Eight nearby queries read one or two cache lines per target where the pair is (t, q) (row t,
  // columns q) and eight rows read in ascending column order where it is (q, t), instead of one line per
  // target and query.
  constexpr int kVecs = 1;  // 8 queries per pass (32 measured slower: register spills)
  for (; i + 8 <= nq; i += 8 * std::min(kVecs, (nq - i) / 8)) {
    const int vecs = std::min(kVecs, (nq - i) / 8);
    __m256i qv[kVecs], qb[kVecs], best_idx[kVecs];
    __m256 best[kVecs];
    for (int v = 0; v < vecs; ++v) {
      qv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(queries.data() + i + 8 * v));
      qb[v] = _mm256_i32gather_epi32(col_base_.data(), qv[v], 4);
      best[v] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      best_idx[v] = _mm256_setzero_si256();
    }
    for (int s = 0; s < nt; ++s) {
      const __m256i t = _mm256_set1_epi32(targets[s]), tb = _mm256_set1_epi32(col_base_[targets[s]]);
      const __m256i sv = _mm256_set1_epi32(s);
      for (int v = 0; v < vecs; ++v) {
        const __m256i below = _mm256_cmpgt_epi32(qv[v], t);  // t < q: the pair is (t, q)
        const __m256i idx =
            _mm256_blendv_epi8(_mm256_add_epi32(qb[v], t), _mm256_add_epi32(tb, qv[v]), below);
        const __m256 val = _mm256_i32gather_ps(tri, idx, 4);
        const __m256 gt = _mm256_cmp_ps(val, best[v], _CMP_GT_OQ);
        best[v] = _mm256_blendv_ps(best[v], val, gt);
        best_idx[v] = _mm256_blendv_epi8(best_idx[v], sv, _mm256_castps_si256(gt));
      }
    }
    for (int v = 0; v < vecs; ++v) {
      alignas(32) float bv[8];
      alignas(32) int32_t bi[8];
      _mm256_store_ps(bv, best[v]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(bi), best_idx[v]);
      for (int l = 0; l < 8; ++l) {
        (*nearest)[i + 8 * v + l] = bi[l];
        (*similarity)[i + 8 * v + l] = bv[l];
        // No value above -inf (NaN keys): the answer FirstMaxIndex gives.
        if (bv[l] == -std::numeric_limits<float>::infinity()) {
          std::vector<float> row(nt);
          const int32_t q = queries[i + 8 * v + l];
          for (int s = 0; s < nt; ++s)
            row[s] = targets[s] < q ? tri[col_base_[targets[s]] + q] : tri[col_base_[q] + targets[s]];
          const int b = FirstMaxIndex(row.data(), nt);
          (*nearest)[i + 8 * v + l] = b;
          (*similarity)[i + 8 * v + l] = row[b];
        }
      }
    }
  }
#endif
  std::vector<float> row(nt);
  for (; i < nq; ++i) {
    const int32_t q = queries[i], qbase = col_base_[q];
    for (int s = 0; s < nt; ++s) {
      const int32_t t = targets[s];
      row[s] = t < q ? tri[col_base_[t] + q] : tri[qbase + t];
    }
    const int best = FirstMaxIndex(row.data(), nt);
    (*nearest)[i] = best;
    (*similarity)[i] = row[best];
  }
}

int64_t PromptSimilarity::calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_;
}

}  // namespace kvsim
