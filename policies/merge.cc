#include "policies/merge.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>

#include "policies/merge_screen.h"
#include "policies/merge_screen_int16.h"
#include "sim/attention.h"

namespace kvsim {
namespace {

// Row r's squared norm as a sequential double sum over k (the order every row has always used).
double SquaredNorm(const float* row, int d) {
  double s = 0;
  for (int k = 0; k < d; ++k) s += static_cast<double>(row[k]) * row[k];
  return s;
}

// Returns whether the row is "regular" for the bf16 screen (merge_screen.cc's bound): zero, or scaled by a
// normal, finite float (not a row with a non-finite entry or a norm so far from 1 that inv leaves the
// normal range).
bool ScaleRow(const float* x, double s, int d, float* out) {
  const float inv = s > 0 ? static_cast<float>(1.0 / std::sqrt(s)) : 0.0f;
  for (int k = 0; k < d; ++k) out[k] = x[k] * inv;
  return s == 0 || (std::isfinite(s) && inv >= std::numeric_limits<float>::min() &&
                    inv <= std::numeric_limits<float>::max());
}

// Rows scaled to unit length (zero rows stay zero); row r is read from rows[r] (rows need not be contiguous:
// MergeTokens hands the cache's keys in place instead of copying them first). Eight rows at a time: each
// row's sum still runs over k in order (so the result is the same as one row at a time), but the eight
// dependency chains overlap instead of one latency-bound chain per row (it was a third of NearestByCosine's
// own time, issue 14). Returns whether every row is regular (ScaleRow).
bool NormalizeRows(const float* const* rows, int n, int d, float* out) {
  bool regular = true;
  constexpr int kRows = 8;
  int r = 0;
  for (; r + kRows <= n; r += kRows) {
    const float* const* xr = rows + r;
    double s[kRows] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < d; ++k)
      for (int i = 0; i < kRows; ++i) {
        const double v = xr[i][k];
        s[i] += v * v;  // exact product (float x float fits a double): fused or not, the same sum
      }
    for (int i = 0; i < kRows; ++i) regular &= ScaleRow(xr[i], s[i], d, out + static_cast<size_t>(r + i) * d);
  }
  for (; r < n; ++r)
    regular &= ScaleRow(rows[r], SquaredNorm(rows[r], d), d, out + static_cast<size_t>(r) * d);
  return regular;
}

// Grows a per-thread scratch buffer without shrinking it or clearing what it held: NearestByCosine's
// buffers are written in full before they are read, and allocating (and zeroing) them per call cost a
// fresh-page fault and a memset per merge (issue 14, round 6).
template <typename T>
T* Scratch(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

const float* OriginalKey(const HeadContext& ctx, int32_t tok) {
  return ctx.keys + static_cast<size_t>(tok) * ctx.head_dim();
}
const float* OriginalValue(const HeadContext& ctx, int32_t tok) {
  return ctx.values + static_cast<size_t>(tok) * ctx.head_dim();
}

// The bf16 screen (issue 14, round 7; merge_screen.h) takes blocks of m·n·d ≥ 2^18 (queries x targets x d);
// smaller ones go to the exact search. Until round 10 the smaller ones went to sgemm, whose small-matrix
// path (below m·n·d ≈ 1.5·10^5 on the Zen 4 machine) gave other values than the fmaf chain; now both paths
// return the first maximum of the fmaf chains, so the threshold only decides the cost.
constexpr long kMinScreenedWork = 1L << 18;

// One block on the exact search (merge_screen::ExactNearest: every pair's fmaf chain, the first maximum
// fused, the rows x targets matrix never written); `tx` holds the targets packed by PackExactTargets.
void ExactBlock(const float* q, int rows, const float* tx, int num_targets, int d, int* nearest,
                float* similarity) {
  merge_screen::ExactNearest(q, rows, tx, num_targets, d, nearest, similarity);
  ++merge_screen::ThreadStats().exact_blocks;
}

// Targets packed for one of the screens: exactly one of bf16 (merge_screen::PackTargets) and int16
// (merge_screen::int16::PackTargets) is set; err is the targets' largest rounding error norm.
struct ScreenTargets {
  const uint32_t* bf16 = nullptr;
  const int16_t* int16 = nullptr;
  double err = 0;
  merge_screen::int16::Narrowed int8;  // with int16: its int8 first stage's targets (round 16), or none
};

float RowMax(const float* row, int n) {
  int i = 0;
  float mx = row[0];
#ifdef __AVX2__
  __m256 lanes = _mm256_set1_ps(row[0]);
  for (; i + 8 <= n; i += 8) lanes = _mm256_max_ps(_mm256_loadu_ps(row + i), lanes);
  float lane[8];
  _mm256_storeu_ps(lane, lanes);
  for (int k = 0; k < 8; ++k) mx = lane[k] > mx ? lane[k] : mx;
#endif
  for (; i < n; ++i) mx = row[i] > mx ? row[i] : mx;
  return mx;
}

// One block of `rows` normalised queries `q` against the normalised targets `t`, packed as `tp`: the first
// maximum of today's values, found without computing most of them.
//
// Why the result is the exact search's, slot and value: let v_j be the value of target j (the fmaf chain
// ExactDots computes: the definition, round 10; on the Zen 4 machine also sgemm's for blocks of
// m·n·d ≥ kMinScreenedWork, round 6), a_j the bf16 value and
// ε = merge_screen::ErrorBound(d, query's rounding error, the targets' largest) ≥ |a_j − v_j| for every j
// (rows regular: NormalizeRows). The answer is j* = the first j with v_j = V := max v. With M = max a_j:
// a_j* ≥ V − ε and M ≤ V + ε, so a_j* ≥ M − 2ε: j* is a candidate. Every candidate's v is computed exactly
// (ExactDots), none exceeds V, and every j < j* has v_j < V; so the first maximum among the candidates, in
// slot order, is j* with value V.
//
// The int16 screen (merge_screen_int16.cc, round 10) is the same argument with a_j = S_j / 2^28, its exact
// fixed-point product, and the window taken in integers (int16::Slack ≥ 2ε 2^28): its candidates are the
// j with S_j ≥ max S − Slack, which again include j*.
// The rows of an int16 screened block read where they are (the unit's keys, UnitKeys): query row r's
// PackQueries words and error norm, already computed, and the normalised query and target rows (read only
// for the candidates' exact values). ScreenBlock's q and t are then not read.
struct InPlace {
  const int16_t* const* words = nullptr;
  const double* err = nullptr;
  const float* const* qrows = nullptr;
  const float* const* trows = nullptr;
  merge_screen::int8::NarrowedRows narrowed;  // the rows' int8 words (UnitKeys::Build), or none (bytes null)
};

//
// With `floor` (issue 14, round 14; int16 screen only), the caller needs only the targets that can reach
// floor[r] (the value of a stored answer that a target of this block must equal or beat to matter:
// NearestWithMemo's rest searches). The candidates are then also limited to S_j ≥ F_r := ⌊floor[r] 2^28⌋ −
// Slack: a target with v_j ≥ floor[r] has S_j / 2^28 ≥ v_j − ε ≥ floor[r] − ε, and Slack ≥ 2ε 2^28, so it
// stays a candidate; in particular j* stays one whenever V ≥ floor[r], and the result is then the same
// (j*, V). When V < floor[r] the row may have other candidates (its result is some (j, v_j) with
// v_j ≤ V < floor[r]) or none: nearest[r] = −1. Either way the caller, which takes a target's answer only
// if it beats or ties floor[r], decides as with the full search. (floor[r] · 2^28 is exact in double: a
// float times a power of two; a non-finite floor or a saturated Slack sets no floor.)
void ScreenBlock(const float* q, int rows, const float* t, const ScreenTargets& tp, int num_targets, int d,
                 int* nearest, float* similarity, const InPlace* in_place = nullptr,
                 const float* floor = nullptr) {
  thread_local std::vector<uint32_t> qp_buf;
  thread_local std::vector<float> approx_buf, values;
  thread_local std::vector<double> q_err;
  thread_local std::vector<const float*> ca, cb;
  thread_local std::vector<int> crow, cidx;
  thread_local std::vector<int16_t> qp16_buf;
  thread_local std::vector<int64_t> slack, floor_s;
  double* qe = Scratch(q_err, rows);
  ca.clear(), cb.clear(), crow.clear(), cidx.clear();
  if (tp.int16 != nullptr) {
    int16_t* qp = Scratch(qp16_buf, static_cast<size_t>(rows) * d);
    if (in_place != nullptr) {
      for (int r = 0; r < rows; ++r) {
        std::memcpy(qp + static_cast<size_t>(r) * d, in_place->words[r], d * sizeof(int16_t));
        qe[r] = in_place->err[r];
      }
    } else {
      merge_screen::int16::PackQueries(q, rows, d, qp, qe);
    }
    int64_t* sl = Scratch(slack, rows);
    for (int r = 0; r < rows; ++r) sl[r] = merge_screen::int16::Slack(d, qe[r], tp.err);
    int64_t* fl = nullptr;
    if (floor != nullptr) {
      fl = Scratch(floor_s, rows);
      for (int r = 0; r < rows; ++r) {
        nearest[r] = -1, similarity[r] = 0.0f;
        fl[r] = std::isfinite(floor[r]) && sl[r] < (int64_t{1} << 30)
                    ? static_cast<int64_t>(std::floor(std::ldexp(static_cast<double>(floor[r]), 28))) - sl[r]
                    : std::numeric_limits<int64_t>::min();
      }
    }
    const bool pre = in_place != nullptr && in_place->narrowed.bytes != nullptr;
    merge_screen::int16::Candidates(qp, rows, tp.int16, num_targets, d, sl, &crow, &cidx, fl, &tp.int8,
                                    pre ? &in_place->narrowed : nullptr);
    for (size_t i = 0; i < crow.size(); ++i) {
      if (in_place != nullptr) {
        ca.push_back(in_place->qrows[crow[i]]), cb.push_back(in_place->trows[cidx[i]]);
      } else {
        ca.push_back(q + static_cast<size_t>(crow[i]) * d),
            cb.push_back(t + static_cast<size_t>(cidx[i]) * d);
      }
    }
  }
  const long ld = merge_screen::PaddedTargets(num_targets);
  uint32_t* qp = tp.bf16 != nullptr ? Scratch(qp_buf, static_cast<size_t>(rows) * (d / 2)) : nullptr;
  float* approx = tp.bf16 != nullptr ? Scratch(approx_buf, static_cast<size_t>(rows) * ld) : nullptr;
  if (tp.bf16 != nullptr) {
    merge_screen::PackQueries(q, rows, d, qp, qe);
    merge_screen::ApproxDots(qp, rows, tp.bf16, num_targets, d, approx, ld);
  }
  for (int r = 0; tp.bf16 != nullptr && r < rows; ++r) {
    const float* row = approx + r * ld;
    // 2ε for this query (its own rounding error, the targets' largest), plus 2^-20 for the rounding of
    // m − window in float (|m| ≤ 1.02: at most 2^-24).
    const float window =
        static_cast<float>(2 * merge_screen::ErrorBound(d, qe[r], tp.err) + std::ldexp(1.0, -20));
    const float threshold = RowMax(row, num_targets) - window;
    const float* qr = q + static_cast<size_t>(r) * d;
    int j = 0;
#ifdef __AVX2__
    const __m256 th = _mm256_set1_ps(threshold);
    for (; j + 8 <= num_targets; j += 8) {
      unsigned mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), th, _CMP_GE_OQ));
      for (; mask != 0; mask &= mask - 1) {
        const int c = j + std::countr_zero(mask);
        ca.push_back(qr), cb.push_back(t + static_cast<size_t>(c) * d), crow.push_back(r), cidx.push_back(c);
      }
    }
#endif
    for (; j < num_targets; ++j)
      if (row[j] >= threshold)
        ca.push_back(qr), cb.push_back(t + static_cast<size_t>(j) * d), crow.push_back(r), cidx.push_back(j);
  }
  const int n = static_cast<int>(ca.size());
  float* value = Scratch(values, n);
  merge_screen::ExactDots(ca.data(), cb.data(), n, d, value);
  // Candidates come row by row, each row's in slot order: keep the first maximum.
  for (int i = 0; i < n; ++i) {
    const int r = crow[i];
    if (i == 0 || crow[i - 1] != r || value[i] > similarity[r]) {
      nearest[r] = cidx[i];
      similarity[r] = value[i];
    }
  }
  merge_screen::Stats& stats = merge_screen::ThreadStats();
  ++stats.screened_blocks;
  stats.screened_queries += rows;
  stats.candidates += n;
}

// ---- the similarity memo of a unit's merging runs (merge.h, merge_memo; issue 14, round 8) ----

std::atomic<bool> g_memo_test_enabled{true};
std::atomic<bool> g_rest_floor{true};
bool rest_floor_enabled() { return g_rest_floor.load(std::memory_order_relaxed); }
bool MemoEnvAllows() {
  const char* v = std::getenv("KVSIM_MERGE_MEMO");
  return v == nullptr || std::string(v) != "0";
}
const bool kMemoEnvAllows = MemoEnvAllows();

struct AtomicTotals {
  std::atomic<long> calls{0}, reuse_calls{0}, superset_calls{0}, overlap_calls{0}, queries{0},
      free_queries{0}, products{0}, products_without{0};
};
AtomicTotals g_totals;

// One stored answer set: for every query token a call answered on the screen path, the token of its first
// most similar target and that fmaf-chain similarity (NearestByCosine's value). Immutable once stored.
struct MemoEntry {
  const float* keys = nullptr;  // the unit's key buffer (queries and targets are its rows)
  int d = 0;
  std::vector<int32_t> targets;  // target tokens, in slot order
  std::vector<int32_t> best;     // by query token: the best target's token; -1: no answer
  std::vector<float> value;      // by query token: its similarity
};

// The unit's keys normalised once (NormalizeRows: each row alone, so the same bits as a call's own
// normalisation) and, where the int16 screen can run, packed once (PackQueries' words and error norms, row
// by row as well): the merge-once calls of a unit's runs gather their rows from here instead of normalising
// and packing every query and target again in each call (issue 14, round 11). Where the int8 stage applies,
// also the rows' int8 words (int8::NarrowRows, row by row: the same as a call's own NarrowQueries; round 19).
struct UnitKeys {
  const float* keys = nullptr;  // the unit's key buffer
  int n = 0, d = 0;             // its rows, their dimension
  std::vector<float> rows;      // n x d, normalised
  std::vector<char> regular;    // per row: ScaleRow's regularity
  std::vector<int16_t> packed;  // n x d int16 words (regular rows; zero otherwise), or empty
  std::vector<double> err;      // per row: the packed row's error norm
  std::vector<uint8_t> bytes;   // n x d int8 stage words (NarrowRows of the packed rows), or empty
  std::vector<int32_t> norm2;   // per row: NarrowRows' ‖q‖², ‖q‖ and error norm
  std::vector<double> norm, nerr;
  const float* row(int32_t tok) const { return rows.data() + static_cast<size_t>(tok) * d; }
  const int16_t* words(int32_t tok) const { return packed.data() + static_cast<size_t>(tok) * d; }
  const uint8_t* narrowed(int32_t tok) const { return bytes.data() + static_cast<size_t>(tok) * d; }

  void Build(const float* k, int num_rows, int dim) {
    keys = k, n = num_rows, d = dim;
    rows.resize(static_cast<size_t>(n) * d);
    regular.assign(n, 1);
    std::vector<const float*> src(n);
    for (int r = 0; r < n; ++r) src[r] = keys + static_cast<size_t>(r) * d;
    // Eight rows per call (NormalizeRows' interleave); a block with an irregular row is redone row by row
    // for the flags (the same values).
    for (int r = 0; r < n; r += 8) {
      const int m = std::min(8, n - r);
      if (NormalizeRows(src.data() + r, m, d, rows.data() + static_cast<size_t>(r) * d)) continue;
      for (int i = r; i < r + m; ++i)
        regular[i] = NormalizeRows(src.data() + i, 1, d, rows.data() + static_cast<size_t>(i) * d);
    }
    if (!merge_screen::int16::Supported() || d % 2 != 0) return;
    packed.assign(static_cast<size_t>(n) * d, 0);
    err.assign(n, 0.0);
    // Runs of regular rows at a time (PackQueries needs finite, normalised rows).
    for (int r = 0; r < n;) {
      if (!regular[r]) {
        ++r;
        continue;
      }
      int e = r;
      while (e < n && regular[e]) ++e;
      merge_screen::int16::PackQueries(row(r), e - r, d, packed.data() + static_cast<size_t>(r) * d,
                                       err.data() + r);
      r = e;
    }
    if (!merge_screen::int8::Applies(d)) return;
    bytes.resize(static_cast<size_t>(n) * d);
    norm2.resize(n), norm.resize(n), nerr.resize(n);
    merge_screen::int8::NarrowRows(packed.data(), n, d, bytes.data(), norm2.data(), norm.data(), nerr.data());
  }
};

// The memo of one unit (UnitShared::merge): at most merge_memo::kMaxEntries answer sets, the least recently
// used replaced first. Runs of a unit may use it concurrently; entries are shared immutable objects, so a
// call reads its source entry without holding the lock.
class SimilarityMemo final : public UnitShared::State {
 public:
  // The unit's normalised (and packed) keys, built by the first call (the unit's other calls wait for it,
  // then read it without a lock); null when a call's key buffer or shape is not the one it was built for.
  const UnitKeys* Keys(const float* keys, int n, int d) {
    std::call_once(keys_once_, [&] { keys_.Build(keys, n, d); });
    return keys_.keys == keys && keys_.n == n && keys_.d == d ? &keys_ : nullptr;
  }
  int size() {
    std::lock_guard lock(mu_);
    return static_cast<int>(entries_.size());
  }
  std::vector<std::shared_ptr<const MemoEntry>> Snapshot() {
    std::lock_guard lock(mu_);
    return entries_;
  }
  void Touch(const MemoEntry* e) {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < entries_.size(); ++i)
      if (entries_[i].get() == e) stamp_[i] = ++clock_;
  }
  void Store(std::shared_ptr<const MemoEntry> e) {
    std::lock_guard lock(mu_);
    if (static_cast<int>(entries_.size()) >= merge_memo::kMaxEntries) {
      const size_t old = std::min_element(stamp_.begin(), stamp_.end()) - stamp_.begin();
      entries_.erase(entries_.begin() + static_cast<std::ptrdiff_t>(old));
      stamp_.erase(stamp_.begin() + static_cast<std::ptrdiff_t>(old));
    }
    entries_.push_back(std::move(e));
    stamp_.push_back(++clock_);
  }

 private:
  std::mutex mu_;
  std::vector<std::shared_ptr<const MemoEntry>> entries_;
  std::vector<uint64_t> stamp_;
  uint64_t clock_ = 0;
  std::once_flag keys_once_;
  UnitKeys keys_;
};

SimilarityMemo* MemoOf(UnitShared* shared) {
  std::lock_guard lock(shared->mu);
  if (!shared->merge) shared->merge = std::make_unique<SimilarityMemo>();
  return static_cast<SimilarityMemo*>(shared->merge.get());  // only this file creates `merge`
}

// A call that may use the memo: the queries and targets are the rows `tokens` of `keys` (plain original keys,
// no merged slot).
struct MemoCall {
  SimilarityMemo* memo;
  const float* keys;
  int rows;  // rows of `keys` (every token of the trace)
  std::span<const int32_t> queries, targets;
};

// The search. Every block of up to 256 query rows goes to the bf16 screen (AVX512-BF16, regular rows, large
// enough) or to the exact search; both return the first maximum of the fmaf-chain values (the definition of
// a merge similarity, round 10), so the answer does not depend on the CPU or on which path took a block.
// With `mc` (Merger::KeepAndMergeOnce on a unit with a memo), the blocks of regular rows reuse stored
// answer sets over other target sets A (any overlap with ours since round 13: a subset, a superset, another
// policy's set). Why every slot and value is still the plain search's, bit for bit:
//  - Which rows use it: every block whose query rows and targets are regular (NormalizeRows: finite, norm
//    ≤ 1 + 2^-20, so every value is finite, no NaN); a block with an irregular row, or a call with an
//    irregular target, is searched as without the memo and stores nothing.
//  - Values: a value v(x) is the fmaf chain (ExactDots) of the two normalised rows, whatever block, path or
//    target subset it was searched in (NormalizeRows normalises each row alone; the exact search computes
//    every pair's chain lane by lane; the screen's result is exact for any target set and any number of
//    rows, ScreenBlock's proof). An entry holds, for query token e, (a*, v*) = the first maximum of these
//    values over its targets A, in A's order, from the same key buffer.
//  - Usable entries: A's tokens that are in our K (tokens unique) map to strictly increasing slots of K,
//    i.e. A ∩ K is in the same relative order in A and in K (checked per call; a duplicate token in A
//    repeats a slot and fails). A row may use an entry if its a* is in K.
//  - Claim: then the plain answer (j*, V) = the first maximum over K is the better of a* and (j_B, v_B) =
//    the first maximum over B = K \ A, in slot order: the strictly greater value wins; equal values: the
//    smaller slot of K. Proof: every x ∈ A ∩ K has v(x) ≤ v*, and if v(x) = v* then x comes after a* in A's
//    order (a* is A's first maximum), hence after a* in K's order. As a* ∈ K, V = max(v*, v_B). If
//    v* > v_B, a* reaches V and no x ∈ B does; any x ∈ A ∩ K reaching V lies after a*: j* = a*. If
//    v_B > v*, no x ∈ A ∩ K reaches V (all ≤ v*): j* = j_B. If equal, the slots reaching V are a*, the
//    A ∩ K ones after it, and B's (the first of them j_B): j* = the smaller of a* and j_B, with its own
//    value (+0 and −0 compare equal; the first slot's bits are the plain search's). B empty (K ⊆ A): (a*, v*)
//    with no product and no re-check at all. Rows whose a* ∉ K, or with no stored answer, search all of K.
//  - Choice: each row takes, among the usable entries with a* ∈ K, the one covering most of K (fewest
//    products |B|); rows are grouped by the entry they use, each group searching its own B. The answer is
//    the same whichever entry a row takes (each gives the plain answer), so only the work depends on which
//    entries exist, i.e. on the order in which runs searched.
void NearestWithMemo(const float* const* queries, int num_queries, const float* const* targets,
                     int num_targets, int d, std::vector<int>* nearest, std::vector<float>* similarity,
                     const MemoCall* mc) {
  nearest->assign(num_queries, -1);
  similarity->assign(num_queries, 0.0f);
  if (num_queries == 0 || num_targets == 0) return;
  thread_local std::vector<float> t_buf, q_buf, tx_buf, tbx_buf;
  thread_local std::vector<uint32_t> tp_buf;
  constexpr int kBlock = 256;  // query rows per block (the screen's approximate values: 256 x num_targets)
  float* t = Scratch(t_buf, static_cast<size_t>(num_targets) * d);
  float* q = Scratch(q_buf, static_cast<size_t>(kBlock) * d);
  // A memo call's rows come from the unit's keys, normalised (and packed) once for all its calls: the same
  // values as NormalizeRows here.
  const UnitKeys* uk = mc != nullptr ? mc->memo->Keys(mc->keys, mc->rows, d) : nullptr;
  bool targets_regular = true;
  if (uk != nullptr) {
    for (int s = 0; s < num_targets; ++s) targets_regular &= uk->regular[mc->targets[s]] != 0;
  } else {
    targets_regular = NormalizeRows(targets, num_targets, d, t);
  }
  // The screen needs dimension pairs, the bound's d ≤ 2^16, regular rows (finite, norm ≤ 1 + 2^-20) and
  // the CPU; everything else is the exact search (ExactBlock), whose values are the same fmaf chains.
  const bool screenable = targets_regular && d % 2 == 0 && d <= (1 << 16);
  const bool bf16 = screenable && merge_screen::Enabled(), int16 = screenable && merge_screen::Int16Enabled();
  const bool screen = bf16 || int16;
  // With the unit's int16 words (packed there: every regular row is) the screen reads the rows in place
  // (InPlace); rows are copied only for the exact search (fill_t, contiguous).
  const bool prepacked = int16 && uk != nullptr && !uk->packed.empty();
  thread_local std::vector<const float*> trow, brow, qrow, qsub;
  bool t_filled = uk == nullptr;
  if (prepacked) {
    trow.resize(num_targets);
    for (int s = 0; s < num_targets; ++s) trow[s] = uk->row(mc->targets[s]);
  }
  auto fill_t = [&] {
    if (t_filled) return;
    for (int s = 0; s < num_targets; ++s)
      std::copy_n(uk->row(mc->targets[s]), d, t + static_cast<size_t>(s) * d);
    t_filled = true;
  };
  if (!prepacked) fill_t();
  bool packed = false, packed_x = false;
  thread_local std::vector<int16_t> tp16_buf, tpb16_buf;
  thread_local std::vector<int8_t> tp8_buf;
  thread_local std::vector<const int16_t*> words, qwords;
  thread_local std::vector<double> word_err, qerr, qnorm, qnerr;
  thread_local std::vector<const uint8_t*> qbytes;
  thread_local std::vector<int32_t> qnorm2;
  // Packs `n` targets `rows` for this call's screen; slot(i) is target row i's slot (for prepacked words).
  auto pack_screen = [&](const float* rows, int n, std::vector<uint32_t>& b32, std::vector<int16_t>& b16,
                         std::vector<int8_t>& b8, auto slot) {
    ScreenTargets st;
    if (bf16) {
      uint32_t* tp = Scratch(b32, merge_screen::PackedTargetsSize(n, d));
      st.err = merge_screen::PackTargets(rows, n, d, tp);
      st.bf16 = tp;
    } else {
      int16_t* tp = Scratch(b16, merge_screen::int16::PackedTargetsSize(n, d));
      if (prepacked) {
        words.resize(n), word_err.resize(n);
        for (int i = 0; i < n; ++i) {
          const int32_t tok = mc->targets[slot(i)];
          words[i] = uk->words(tok), word_err[i] = uk->err[tok];
        }
        st.err = merge_screen::int16::SpreadTargets(words.data(), word_err.data(), n, d, tp);
      } else {
        st.err = merge_screen::int16::PackTargets(rows, n, d, tp);
      }
      st.int16 = tp;
      if (merge_screen::int16::Int8Enabled() && merge_screen::int8::Applies(d)) {
        int8_t* t8 = Scratch(b8, merge_screen::int8::PackedTargetsSize(n, d));
        st.int8.norms = merge_screen::int8::NarrowTargets(tp, n, d, t8);
        st.int8.words = t8;
      }
    }
    return st;
  };
  ScreenTargets screen_t;
  auto pack = [&] {
    if (packed) return;
    screen_t = pack_screen(t, num_targets, tp_buf, tp16_buf, tp8_buf, [](int i) { return i; });
    packed = true;
  };
  auto pack_x = [&] {
    if (packed_x) return;
    fill_t();
    merge_screen::PackExactTargets(t, num_targets, d,
                                   Scratch(tx_buf, merge_screen::ExactPackedSize(num_targets, d)));
    packed_x = true;
  };
  merge_screen::Stats& stats = merge_screen::ThreadStats();
  const merge_screen::Stats before = stats;
  // The memo's sources: every stored answer set over targets A whose tokens in our K keep K's order (proof
  // above). Any regular targets (their values are finite: no NaN in a combination below).
  const bool use_memo = mc != nullptr && targets_regular;
  // One usable stored set A: its part B = K \ A (our slots not in A, in slot order) is searched for the
  // rows that use it, its rows packed for the screen or the exact search once per call.
  struct Source {
    std::shared_ptr<const MemoEntry> e;
    int found = 0;  // |A ∩ K|
    bool rest_ready = false, packed = false, packed_x = false, used = false;
    float* tb = nullptr;  // B's rows, contiguous
    ScreenTargets st;
  };
  std::vector<Source> srcs;
  thread_local std::vector<int32_t> slot_of;  // by token: our slot, -1
  thread_local std::vector<char> in_a;
  thread_local std::vector<int> pick, rows_miss, nearg;  // by block row: the source used, -1: none
  thread_local std::vector<float> qg_buf, simg, floorg;  // gathered query rows, their answers, floors
  // Per source (≤ kMaxEntries): B's slots, its rows (in place), buffers, and this block's rows using it.
  thread_local std::vector<std::vector<int>> rest_of, rows_of;
  thread_local std::vector<std::vector<const float*>> brow_of;
  thread_local std::vector<std::vector<float>> tb_of, tbx_of;
  thread_local std::vector<std::vector<uint32_t>> tpb_of;
  thread_local std::vector<std::vector<int16_t>> tpb16_of;
  thread_local std::vector<std::vector<int8_t>> tpb8_of;
  int32_t max_tok = 0;
  if (use_memo) {
    ++stats.memo_calls;
    for (int32_t tok : mc->targets) max_tok = std::max(max_tok, tok);
    slot_of.assign(static_cast<size_t>(max_tok) + 1, -1);
    bool unique = true;
    for (int s = 0; s < num_targets; ++s) {
      int32_t& so = slot_of[mc->targets[s]];
      unique &= so < 0;
      so = s;
    }
    for (std::shared_ptr<const MemoEntry>& e :
         unique ? mc->memo->Snapshot() : std::vector<std::shared_ptr<const MemoEntry>>{}) {
      if (e->keys != mc->keys || e->d != d) continue;
      // A ∩ K in A's order must map to increasing slots of K (a duplicate token in A repeats a slot).
      bool ordered = true;
      int prev = -1, found = 0;
      for (size_t i = 0; i < e->targets.size() && ordered; ++i) {
        const int32_t tok = e->targets[i];
        const int so = tok <= max_tok ? slot_of[tok] : -1;
        if (so < 0) continue;
        ++found;
        ordered = so > prev;
        prev = so;
      }
      if (ordered && found > 0) srcs.push_back(Source{std::move(e), found});
    }
    const size_t ns = srcs.size();
    if (rest_of.size() < ns) {
      rest_of.resize(ns), rows_of.resize(ns), brow_of.resize(ns), tb_of.resize(ns), tbx_of.resize(ns);
      tpb_of.resize(ns), tpb16_of.resize(ns), tpb8_of.resize(ns);
    }
  }
  // Source i's B = K \ A (slots in order) and, in place, its rows.
  auto ready_rest = [&](int i) {
    Source& s = srcs[i];
    if (s.rest_ready) return;
    in_a.assign(num_targets, 0);
    for (int32_t tok : s.e->targets)
      if (tok <= max_tok && slot_of[tok] >= 0) in_a[slot_of[tok]] = 1;
    std::vector<int>& rest = rest_of[i];
    rest.clear();
    for (int j = 0; j < num_targets; ++j)
      if (!in_a[j]) rest.push_back(j);
    if (prepacked) {
      brow_of[i].resize(rest.size());
      for (size_t j = 0; j < rest.size(); ++j) brow_of[i][j] = trow[rest[j]];
    }
    s.rest_ready = true;
  };
  auto copy_b = [&](int i) {  // B's rows, contiguous
    Source& s = srcs[i];
    if (s.tb != nullptr) return;
    const std::vector<int>& rest = rest_of[i];
    const int nb = static_cast<int>(rest.size());
    s.tb = Scratch(tb_of[i], static_cast<size_t>(nb) * d);
    for (int j = 0; j < nb; ++j)
      std::copy_n(prepacked ? trow[rest[j]] : t + static_cast<size_t>(rest[j]) * d, d,
                  s.tb + static_cast<size_t>(j) * d);
  };

  thread_local std::vector<char> answered;  // by query: searched with regular rows (storable)
  if (use_memo) answered.assign(num_queries, 0);
  for (int b = 0; b < num_queries; b += kBlock) {
    const int rows = std::min(kBlock, num_queries - b);
    bool queries_regular = true;
    if (uk != nullptr) {
      if (prepacked) qrow.resize(rows);
      for (int r = 0; r < rows; ++r) {
        const int32_t tok = mc->queries[b + r];
        if (prepacked) {
          qrow[r] = uk->row(tok);
        } else {
          std::copy_n(uk->row(tok), d, q + static_cast<size_t>(r) * d);
        }
        queries_regular &= uk->regular[tok] != 0;
      }
    } else {
      queries_regular = NormalizeRows(queries + b, rows, d, q);
    }
    // This block's search path: the screen (large enough, regular) or the exact search. Both return the
    // first maximum of the fmaf chains, for any query rows and any target subset; only the cost differs.
    const bool screened =
        screen && queries_regular && static_cast<long>(rows) * num_targets * d >= kMinScreenedWork;
    // The block's rows `sub` (null: all `n`, in order): contiguous (q itself, or copied), or in place.
    auto contiguous = [&](const int* sub, int n) -> const float* {
      if (sub == nullptr && !prepacked) return q;
      float* g = Scratch(qg_buf, static_cast<size_t>(n) * d);
      for (int i = 0; i < n; ++i) {
        const int r = sub != nullptr ? sub[i] : i;
        std::copy_n(prepacked ? qrow[r] : q + static_cast<size_t>(r) * d, d, g + static_cast<size_t>(i) * d);
      }
      return g;
    };
    InPlace ip;
    auto in_place = [&](const int* sub, int n, const float* const* target_rows) {
      qwords.resize(n), qerr.resize(n), qsub.resize(n);
      for (int i = 0; i < n; ++i) {
        const int r = sub != nullptr ? sub[i] : i;
        const int32_t tok = mc->queries[b + r];
        qwords[i] = uk->words(tok), qerr[i] = uk->err[tok], qsub[i] = qrow[r];
      }
      ip = InPlace{qwords.data(), qerr.data(), qsub.data(), target_rows};
      if (!uk->bytes.empty()) {
        qbytes.resize(n), qnorm2.resize(n), qnorm.resize(n), qnerr.resize(n);
        for (int i = 0; i < n; ++i) {
          const int32_t tok = mc->queries[b + (sub != nullptr ? sub[i] : i)];
          qbytes[i] = uk->narrowed(tok), qnorm2[i] = uk->norm2[tok], qnorm[i] = uk->norm[tok];
          qnerr[i] = uk->nerr[tok];
        }
        ip.narrowed = {qbytes.data(), qnorm2.data(), qnorm.data(), qnerr.data()};
      }
      return &ip;
    };
    // The block's rows `sub` against every target / against source i's B = K \ A.
    auto search_all = [&](const int* sub, int n, int* near, float* sim) {
      if (screened) {
        pack();
        if (prepacked) {
          ScreenBlock(nullptr, n, nullptr, screen_t, num_targets, d, near, sim,
                      in_place(sub, n, trow.data()));
        } else {
          ScreenBlock(contiguous(sub, n), n, t, screen_t, num_targets, d, near, sim);
        }
      } else {
        pack_x();
        ExactBlock(contiguous(sub, n), n, tx_buf.data(), num_targets, d, near, sim);
      }
    };
    auto search_rest = [&](int i, const int* sub, int n, int* near, float* sim, const float* fl) {
      Source& s = srcs[i];
      const std::vector<int>& rest = rest_of[i];
      const int nb = static_cast<int>(rest.size());
      if (screened) {
        if (!prepacked) copy_b(i);
        if (!s.packed) {
          s.st = pack_screen(s.tb, nb, tpb_of[i], tpb16_of[i], tpb8_of[i], [&](int j) { return rest[j]; });
          s.packed = true;
        }
        if (prepacked) {
          ScreenBlock(nullptr, n, nullptr, s.st, nb, d, near, sim, in_place(sub, n, brow_of[i].data()), fl);
        } else {
          ScreenBlock(contiguous(sub, n), n, s.tb, s.st, nb, d, near, sim, nullptr, fl);
        }
      } else {
        copy_b(i);
        if (!s.packed_x) {
          merge_screen::PackExactTargets(s.tb, nb, d,
                                         Scratch(tbx_of[i], merge_screen::ExactPackedSize(nb, d)));
          s.packed_x = true;
        }
        ExactBlock(contiguous(sub, n), n, tbx_of[i].data(), nb, d, near, sim);
      }
    };
    if (!use_memo || !queries_regular) {  // today's search
      search_all(nullptr, rows, nearest->data() + b, similarity->data() + b);
      continue;
    }
    std::fill(answered.begin() + b, answered.begin() + b + rows, 1);
    stats.memo_products_without += static_cast<long>(rows) * num_targets;
    // Each row takes the usable source with the fewest remaining targets among those whose stored answer
    // a* is one of our targets; none: every target.
    const int ns = static_cast<int>(srcs.size());
    pick.assign(rows, -1);
    rows_miss.clear();
    for (int i = 0; i < ns; ++i) rows_of[i].clear();
    for (int r = 0; r < rows; ++r) {
      const int32_t tok = mc->queries[b + r];
      int best_found = 0;
      for (int i = 0; i < ns; ++i) {
        const MemoEntry& e = *srcs[i].e;
        if (srcs[i].found <= best_found || tok >= static_cast<int32_t>(e.best.size())) continue;
        const int32_t a = e.best[tok];
        if (a >= 0 && a <= max_tok && slot_of[a] >= 0) best_found = srcs[i].found, pick[r] = i;
      }
      (pick[r] < 0 ? rows_miss : rows_of[pick[r]]).push_back(r);
    }
    // Rows without a usable answer: over every target.
    if (!rows_miss.empty()) {
      const int nm = static_cast<int>(rows_miss.size());
      if (nm == rows) {
        search_all(nullptr, rows, nearest->data() + b, similarity->data() + b);
      } else {
        nearg.resize(nm), simg.resize(nm);
        search_all(rows_miss.data(), nm, nearg.data(), simg.data());
        for (int i = 0; i < nm; ++i) {
          (*nearest)[b + rows_miss[i]] = nearg[i];
          (*similarity)[b + rows_miss[i]] = simg[i];
        }
      }
      stats.memo_products += static_cast<long>(nm) * num_targets;
    }
    // Rows with one: the better of the stored answer (a*, v*) and the first maximum over B = K \ A (proof
    // above); B empty (K ⊆ A): (a*, v*) with no product at all.
    for (int i = 0; i < ns; ++i) {
      const std::vector<int>& hit = rows_of[i];
      if (hit.empty()) continue;
      Source& s = srcs[i];
      s.used = true;
      const int hits = static_cast<int>(hit.size());
      const int nb = num_targets - s.found;
      if (nb > 0) {
        ready_rest(i);
        nearg.resize(hits), simg.resize(hits), floorg.resize(hits);
        // Only a target that beats or ties the stored value can change a row's answer (below).
        for (int k = 0; k < hits; ++k) floorg[k] = s.e->value[mc->queries[b + hit[k]]];
        search_rest(i, hit.data(), hits, nearg.data(), simg.data(),
                    rest_floor_enabled() ? floorg.data() : nullptr);
        stats.memo_products += static_cast<long>(hits) * nb;
      } else {
        stats.memo_free_queries += hits;
      }
      for (int k = 0; k < hits; ++k) {
        const int r = b + hit[k];
        const int32_t tok = mc->queries[r];
        int slot = slot_of[s.e->best[tok]];
        float value = s.e->value[tok];
        if (nb > 0 && nearg[k] >= 0) {  // −1: no target of B can reach v* (ScreenBlock's floor)
          const int sb = rest_of[i][nearg[k]];
          const float vb = simg[k];
          if (vb > value || (vb == value && sb < slot)) slot = sb, value = vb;
        }
        (*nearest)[r] = slot;
        (*similarity)[r] = value;
      }
      stats.memo_queries += hits;
    }
  }
  if (use_memo) {
    bool reused = false, covering = false, overlap = false;
    for (const Source& s : srcs) {
      if (!s.used) continue;
      mc->memo->Touch(s.e.get());
      reused = true;
      covering |= s.found == num_targets;
      overlap |= s.found < num_targets && s.found < static_cast<int>(s.e->targets.size());
    }
    stats.memo_reuse_calls += reused;
    stats.memo_superset_calls += covering;
    stats.memo_overlap_calls += overlap;
  }
  if (!use_memo) return;
  // Store this call's answers of regular rows (every one is the fmaf-chain first maximum over our targets).
  auto entry = std::make_shared<MemoEntry>();
  int32_t max_q = -1;
  for (int i = 0; i < num_queries; ++i)
    if (answered[i]) max_q = std::max(max_q, mc->queries[i]);
  if (max_q >= 0) {
    entry->keys = mc->keys;
    entry->d = d;
    entry->targets.assign(mc->targets.begin(), mc->targets.end());
    entry->best.assign(static_cast<size_t>(max_q) + 1, -1);
    entry->value.assign(static_cast<size_t>(max_q) + 1, 0.0f);
    for (int i = 0; i < num_queries; ++i)
      if (answered[i]) {
        entry->best[mc->queries[i]] = mc->targets[(*nearest)[i]];
        entry->value[mc->queries[i]] = (*similarity)[i];
      }
    mc->memo->Store(std::move(entry));
  }
  g_totals.calls += stats.memo_calls - before.memo_calls;
  g_totals.reuse_calls += stats.memo_reuse_calls - before.memo_reuse_calls;
  g_totals.superset_calls += stats.memo_superset_calls - before.memo_superset_calls;
  g_totals.overlap_calls += stats.memo_overlap_calls - before.memo_overlap_calls;
  g_totals.free_queries += stats.memo_free_queries - before.memo_free_queries;
  g_totals.queries += stats.memo_queries - before.memo_queries;
  g_totals.products += stats.memo_products - before.memo_products;
  g_totals.products_without += stats.memo_products_without - before.memo_products_without;
}

}  // namespace

namespace merge_memo {
bool Enabled() { return kMemoEnvAllows && g_memo_test_enabled.load(std::memory_order_relaxed); }
void SetEnabledForTesting(bool enabled) { g_memo_test_enabled.store(enabled, std::memory_order_relaxed); }
void SetRestFloorForTesting(bool enabled) { g_rest_floor.store(enabled, std::memory_order_relaxed); }
Totals ProcessTotals() {
  Totals t;
  t.calls = g_totals.calls.load();
  t.reuse_calls = g_totals.reuse_calls.load();
  t.superset_calls = g_totals.superset_calls.load();
  t.overlap_calls = g_totals.overlap_calls.load();
  t.free_queries = g_totals.free_queries.load();
  t.queries = g_totals.queries.load();
  t.products = g_totals.products.load();
  t.products_without = g_totals.products_without.load();
  return t;
}
int StoredSets(UnitShared& shared) {
  std::lock_guard lock(shared.mu);
  return shared.merge ? static_cast<SimilarityMemo*>(shared.merge.get())->size() : 0;
}
}  // namespace merge_memo

void NearestByCosine(const float* const* queries, int num_queries, const float* const* targets,
                     int num_targets, int d, std::vector<int>* nearest, std::vector<float>* similarity) {
  NearestWithMemo(queries, num_queries, targets, num_targets, d, nearest, similarity, nullptr);
}

void NearestByCosine(const float* queries, int num_queries, const float* targets, int num_targets, int d,
                     std::vector<int>* nearest, std::vector<float>* similarity) {
  std::vector<const float*> q(num_queries), t(num_targets);
  for (int i = 0; i < num_queries; ++i) q[i] = queries + static_cast<size_t>(i) * d;
  for (int j = 0; j < num_targets; ++j) t[j] = targets + static_cast<size_t>(j) * d;
  NearestByCosine(q.data(), num_queries, t.data(), num_targets, d, nearest, similarity);
}

// A merged slot from its anchor's original key / value and the members' sums (`sk`, `sv`: d floats each).
void Merger::Merged(const HeadContext& ctx, int32_t anchor, const float* sk, const float* sv,
                    MergedSlot* out) const {
  const int d = ctx.head_dim();
  const double m = static_cast<double>(out->members.size());
  const double a = strategy_ == policy::PIVOT ? 1.0 + m / 2 : 1.0;
  const double inv = 1.0 / (1.0 + m);
  const float* ka = OriginalKey(ctx, anchor);
  const float* va = OriginalValue(ctx, anchor);
  for (int k = 0; k < d; ++k) {
    out->key[k] = static_cast<float>((a * ka[k] + sk[k]) * inv);
    out->value[k] = static_cast<float>((a * va[k] + sv[k]) * inv);
  }
}

void Merger::Apply(const HeadContext& ctx, int slot, Sums& s, HeadCache* cache) const {
  MergedSlot& merge = cache->SetMergeInPlace(slot);
  merge.members.assign(s.members.begin(), s.members.end());
  Merged(ctx, cache->token(slot), s.k.data(), s.v.data(), &merge);
}

void Merger::KeepAndMerge(const HeadContext& ctx, std::span<const int32_t> kept,
                          std::span<const int32_t> evicted, HeadCache* cache) {
  cache->Assign(kept);
  sums_.clear();
  MergeTokens(ctx, evicted, cache);
}

void Merger::KeepAndMergeOnce(const HeadContext& ctx, std::span<const int32_t> kept,
                              std::span<const int32_t> evicted, HeadCache* cache) {
  cache->Assign(kept);
  Release();
  thread_local std::vector<int> join_slot;
  thread_local std::vector<float> join_coef;
  if (!Join(ctx, evicted, *cache, &join_slot, &join_coef, /*memo=*/true)) return;
  // The same sums as MergeTokens' (per slot, in token order, from zero, the same float operations), kept
  // flat by slot instead of in the running sums' map: a policy that merges once never reads them again, so
  // they need not outlive this call (one allocation per merged slot's key, value and members instead of
  // the map's nodes, vectors and their copies; issue 14, round 6).
  const int d = ctx.head_dim(), slots = cache->size(), e = static_cast<int>(evicted.size());
  thread_local std::vector<float> k_buf, v_buf;
  thread_local std::vector<int> count;
  count.assign(slots, 0);
  for (int i = 0; i < e; ++i)
    if (join_slot[i] >= 0) ++count[join_slot[i]];
  thread_local std::vector<int> first;  // row of each joined slot in the flat sums
  first.assign(slots, -1);
  int rows = 0;
  for (int s = 0; s < slots; ++s)
    if (count[s] > 0) first[s] = rows++;
  // A row's first member writes 0.0f + c k (the sum's first addition, from +0: no zero fill first; the
  // addition stays, as -0 + +0 is +0), later members add to it.
  float* sk = Scratch(k_buf, static_cast<size_t>(rows) * d);
  float* sv = Scratch(v_buf, static_cast<size_t>(rows) * d);
  // Row r's members, in token order, at members[at[r], at[r + 1]) (filled up to end[r]); they are copied
  // into the merges' own storage below, which the cache reuses (HeadCache::SetMergeInPlace: no allocation
  // per merged slot once the cache has held as many merges).
  thread_local std::vector<std::pair<int32_t, float>> members;
  thread_local std::vector<int> at, end;
  at.resize(rows + 1);
  at[0] = 0;
  for (int s = 0; s < slots; ++s)
    if (count[s] > 0) at[first[s] + 1] = at[first[s]] + count[s];
  end.assign(at.begin(), at.end() - 1);
  members.resize(at[rows]);
  for (int i = 0; i < e; ++i) {
    if (join_slot[i] < 0) continue;
    const int r = first[join_slot[i]];
    const float c = join_coef[i];
    float* rk = sk + static_cast<size_t>(r) * d;
    float* rv = sv + static_cast<size_t>(r) * d;
    const float* k = OriginalKey(ctx, evicted[i]);
    const float* v = OriginalValue(ctx, evicted[i]);
    if (end[r] == at[r]) {
      for (int j = 0; j < d; ++j) {
        rk[j] = 0.0f + c * k[j];
        rv[j] = 0.0f + c * v[j];
      }
    } else {
      for (int j = 0; j < d; ++j) {
        rk[j] += c * k[j];
        rv[j] += c * v[j];
      }
    }
    members[end[r]++] = {evicted[i], c};
  }
  for (int s = 0; s < slots; ++s)
    if (count[s] > 0) {
      const int r = first[s];
      MergedSlot& merge = cache->SetMergeInPlace(s);
      merge.members.assign(members.begin() + at[r], members.begin() + at[r + 1]);
      Merged(ctx, cache->token(s), sk + static_cast<size_t>(r) * d, sv + static_cast<size_t>(r) * d, &merge);
    }
}

bool Merger::Join(const HeadContext& ctx, std::span<const int32_t> tokens, const HeadCache& cache,
                  std::vector<int>* slot, std::vector<float>* coef, bool memo) const {
  if (strategy_ == policy::NO_MERGE || tokens.empty() || cache.size() == 0) return false;
  const int d = ctx.head_dim(), slots = cache.size(), e = static_cast<int>(tokens.size());
  thread_local std::vector<const float*> targets, x;  // the keys in place: NearestByCosine normalises copies
  targets.resize(slots), x.resize(e);
  for (int s = 0; s < slots; ++s)
    targets[s] = cache.is_merged(s) ? cache.merged(s).key.data() : OriginalKey(ctx, cache.token(s));
  for (int i = 0; i < e; ++i) x[i] = OriginalKey(ctx, tokens[i]);
  // The unit's similarity memo, for plain original keys of this unit only (a merged slot's key is no row of
  // ctx.keys).
  if (memo && ctx.shared != nullptr && !cache.has_merges() && merge_memo::Enabled()) {
    const MemoCall mc{MemoOf(ctx.shared), ctx.keys, ctx.meta->total_tokens(), tokens, cache.tokens()};
    NearestWithMemo(x.data(), e, targets.data(), slots, d, slot, coef, &mc);
  } else {
    NearestByCosine(x.data(), e, targets.data(), slots, d, slot, coef);
  }
  double threshold = -2;  // below every cosine
  if (filter_ == policy::ABOVE_MEAN_SIMILARITY) {
    double mean = 0;
    for (float s : *coef) mean += s;
    threshold = mean / e;
  }
  for (int i = 0; i < e; ++i) {
    if ((*coef)[i] < threshold) {
      (*slot)[i] = -1;  // filtered out: dropped
      continue;
    }
    if (strategy_ != policy::WEIGHTED) (*coef)[i] = strategy_ == policy::AVERAGE ? 1.0f : 0.5f;
  }
  return true;
}

void Merger::MergeTokens(const HeadContext& ctx, std::span<const int32_t> tokens, HeadCache* cache) {
  std::vector<int> join_slot;
  std::vector<float> join_coef;
  if (!Join(ctx, tokens, *cache, &join_slot, &join_coef)) return;
  const int d = ctx.head_dim(), slots = cache->size(), e = static_cast<int>(tokens.size());
  // The sums of each slot a token joins, looked up once per slot (not once per token); the map's elements
  // stay where they are when it grows. Non-null = dirty.
  std::vector<Sums*> joined(slots, nullptr);
  for (int i = 0; i < e; ++i) {
    const int slot = join_slot[i];
    if (slot < 0) continue;
    const float c = join_coef[i];
    if (!joined[slot]) joined[slot] = &sums_[cache->token(slot)];
    Sums& s = *joined[slot];
    if (s.k.empty()) {
      s.k.assign(d, 0.0f);
      s.v.assign(d, 0.0f);
    }
    const float* k = OriginalKey(ctx, tokens[i]);
    const float* v = OriginalValue(ctx, tokens[i]);
    for (int j = 0; j < d; ++j) {
      s.k[j] += c * k[j];
      s.v[j] += c * v[j];
    }
    s.members.emplace_back(tokens[i], c);
  }
  for (int s = 0; s < slots; ++s)
    if (joined[s]) Apply(ctx, s, *joined[s], cache);
}

void Merger::Reconcile(const HeadContext& ctx, std::span<const int32_t> before, HeadCache* cache) {
  if (strategy_ == policy::NO_MERGE) return;
  mark_.resize(ctx.meta->total_tokens(), 0);
  for (int32_t tok : cache->tokens()) mark_[tok] = 1;
  std::vector<int32_t> originals;
  for (int32_t tok : before) {
    if (mark_[tok]) continue;
    originals.push_back(tok);
    auto it = sums_.find(tok);
    if (it != sums_.end()) {
      for (const auto& [member, c] : it->second.members) originals.push_back(member);
      sums_.erase(it);
    }
  }
  for (int32_t tok : cache->tokens()) mark_[tok] = 0;
  // A policy that rebuilt the cache (Assign) dropped the merges of the anchors it kept: restore them (every
  // surviving anchor with sums is a merged slot unless a merge was dropped).
  if (static_cast<size_t>(cache->num_merged_slots()) < sums_.size())
    for (int s = 0; s < cache->size(); ++s)
      if (!cache->is_merged(s)) {
        auto it = sums_.find(cache->token(s));
        if (it != sums_.end()) Apply(ctx, s, it->second, cache);
      }
  std::sort(originals.begin(), originals.end());
  MergeTokens(ctx, originals, cache);
}

void Merger::Release() {
  std::unordered_map<int32_t, Sums>().swap(sums_);
  std::vector<char>().swap(mark_);
}

// ---- wrapper ----
namespace {

const char* StrategySuffix(policy::MergeStrategy s) {
  switch (s) {
    case policy::AVERAGE:
      return "average";
    case policy::PIVOT:
      return "pivot";
    case policy::WEIGHTED:
      return "weighted";
    default:
      return "none";
  }
}

class MergeWrappedHead final : public HeadPolicy {
 public:
  MergeWrappedHead(std::unique_ptr<HeadPolicy> base, policy::MergeStrategy strategy)
      : base_(std::move(base)), merger_(strategy, policy::MERGE_ALL) {}

  void OnPrefill(const HeadContext& ctx, int budget, HeadCache* cache) override {
    base_->OnPrefill(ctx, budget, cache);
    // The cache held [0, compress_end) as plain slots: every token the base left out was evicted.
    std::vector<char> kept(ctx.compress_end, 0);
    for (int32_t tok : cache->tokens())
      if (tok < ctx.compress_end) kept[tok] = 1;
    std::vector<int32_t> evicted;
    for (int32_t j = 0; j < ctx.compress_end; ++j)
      if (!kept[j]) evicted.push_back(j);
    merger_.MergeTokens(ctx, evicted, cache);
  }
  void BeforeStep(const HeadContext& ctx, const StepAttention& att, int cap, HeadCache* cache) override {
    const uint64_t version = cache->version();
    before_.assign(cache->tokens().begin(), cache->tokens().end());
    base_->BeforeStep(ctx, att, cap, cache);
    if (cache->version() != version) merger_.Reconcile(ctx, before_, cache);  // else: only appends, if any
  }
  bool AppendNewToken() const override { return base_->AppendNewToken(); }
  void AfterStep(const HeadContext& ctx, const StepAttention& att, HeadCache* cache) override {
    const uint64_t version = cache->version();
    before_.assign(cache->tokens().begin(), cache->tokens().end());
    base_->AfterStep(ctx, att, cache);
    if (cache->version() != version) merger_.Reconcile(ctx, before_, cache);
  }

 private:
  std::unique_ptr<HeadPolicy> base_;
  Merger merger_;
  std::vector<int32_t> before_;
};

class MergeWrappedPolicy final : public Policy {
 public:
  MergeWrappedPolicy(std::shared_ptr<const Policy> base, policy::MergeStrategy strategy)
      : base_(std::move(base)), strategy_(strategy) {}
  std::string name() const override { return base_->name() + "+" + StrategySuffix(strategy_); }
  std::string ParamsText() const override {
    const std::string base = base_->ParamsText();
    return base + (base.empty() ? "" : " ") + "merge: " + policy::MergeStrategy_Name(strategy_);
  }
  PolicyRequirements requirements() const override { return base_->requirements(); }
  bool evicts_during_decode() const override { return base_->evicts_during_decode(); }
  bool may_exceed_budget() const override { return base_->may_exceed_budget(); }
  int compression_step() const override { return base_->compression_step(); }
  int decode_headroom() const override { return base_->decode_headroom(); }
  PolicyGpuWork gpu_work() const override {
    PolicyGpuWork w = base_->gpu_work();
    w.merge = true;
    return w;
  }
  std::vector<int> LayerBudgets(const TraceMeta& meta, int budget, int compress_len) const override {
    return base_->LayerBudgets(meta, budget, compress_len);
  }
  std::unique_ptr<HeadPolicy> NewHeadPolicy(const HeadContext& ctx) const override {
    return std::make_unique<MergeWrappedHead>(base_->NewHeadPolicy(ctx), strategy_);
  }
  std::unique_ptr<PolicyPlan> NewPlan(const TraceMeta& meta, int compress_len) const override {
    return base_->NewPlan(meta, compress_len);
  }
  std::vector<int> FirstPassLayers(const TraceMeta& meta, int compress_len) const override {
    return base_->FirstPassLayers(meta, compress_len);
  }
  void ObserveLayer(const LayerView& layer, PolicyPlan* plan) const override {
    base_->ObserveLayer(layer, plan);
  }
  void FinishPlan(const TraceMeta& meta, PolicyPlan* plan) const override { base_->FinishPlan(meta, plan); }
  std::vector<int> PlannedLayerBudgets(const TraceMeta& meta, int budget, int compress_len,
                                       const PolicyPlan& plan) const override {
    return base_->PlannedLayerBudgets(meta, budget, compress_len, plan);
  }
  std::vector<int> PlannedHeadBudgets(const TraceMeta& meta, int budget, int compress_len,
                                      const PolicyPlan& plan,
                                      std::span<const int> layer_budgets) const override {
    return base_->PlannedHeadBudgets(meta, budget, compress_len, plan, layer_budgets);
  }
  std::map<std::string, std::vector<double>> PlannedLayerStats(const TraceMeta& meta, int budget,
                                                               int compress_len,
                                                               const PolicyPlan& plan) const override {
    return base_->PlannedLayerStats(meta, budget, compress_len, plan);
  }

 private:
  std::shared_ptr<const Policy> base_;
  policy::MergeStrategy strategy_;
};

}  // namespace

bool ParseMergeSuffix(const std::string& suffix, policy::MergeStrategy* strategy) {
  for (policy::MergeStrategy s : {policy::AVERAGE, policy::PIVOT, policy::WEIGHTED})
    if (suffix == StrategySuffix(s)) {
      *strategy = s;
      return true;
    }
  return false;
}

std::shared_ptr<const Policy> WrapWithMerge(std::shared_ptr<const Policy> base,
                                            policy::MergeStrategy strategy) {
  return std::make_shared<MergeWrappedPolicy>(std::move(base), strategy);
}

}  // namespace kvsim
