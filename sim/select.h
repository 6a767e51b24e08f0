#pragma once
// Deterministic selection helpers shared by the engine and policies.

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace kvsim {

// Indices of the k largest scores, returned ascending. Ties go to the lower index, so results never depend
// on sort stability or thread count. k is clamped to [0, scores.size()].
std::vector<int32_t> TopKIndices(std::span<const float> scores, int k);

// TopKIndices when the k-th largest score `kth` is already known (e.g. from a sorted copy).
std::vector<int32_t> TopKIndicesWithThreshold(std::span<const float> scores, int k, float kth);
// The same indices written into *out (resized to their count; its capacity is reused, so a caller selecting
// at every step allocates nothing once the buffer has grown).
void TopKIndicesWithThreshold(std::span<const float> scores, int k, float kth, std::vector<int32_t>* out);
// Tests only: false makes TopKIndicesWithThreshold and RowBuckets::TopK take their AVX2 (or portable) loops,
// and DescendingSums / RowBuckets their AVX2 splits, on a CPU with AVX-512 too.
void SetSelectAvx512ForTesting(bool allowed);
// Tests only: false makes them skip their AVX2 loops too (taken on a CPU with AVX2 but not AVX-512), and
// FirstLowestAt its gathers.
void SetSelectAvx2ForTesting(bool allowed);

// The first i in [0, n) with the lowest scores[idx[i]] (n > 0): what the scan `if (scores[idx[i]] <
// scores[idx[best]]) best = i` over i = 1 .. n - 1 picks, so ties go to the lowest i (-0.0 equals +0.0), a
// NaN is never picked after i = 0 and a NaN at i = 0 is kept. With AVX2, 8 gathered scores at a time (h2o's
// eviction at every decode step). SetSelectAvx2ForTesting(false) takes the scan.
int FirstLowestAt(const float* scores, const int32_t* idx, int n);

// Sorts non-negative values in descending order into `out` (radix sort, O(n)); `out` is resized.
void SortDescendingNonNegative(std::span<const float> values, std::vector<float>* out);

// What the descending prefix sums of non-negative `values` need, without sorting every value. The sums in
// question are S[k] = (((0 + x_1) + x_2) + ... + x_k) in double, x_1 >= x_2 >= ... the values sorted
// descending (the regret's "mass of the k best tokens"). Outputs:
// - `head`: the min(kmax, n) largest values, descending, so S[k] for k <= kmax is the running sum of head;
// - `exact_sum` and `tail`: S[n] = (((exact_sum + t_1) + t_2) + ...), tail = t_1 >= t_2 >= ... ; when
//   kmax >= n, head holds every value and S[n] is its running sum (exact_sum 0, tail empty).
// Why S[n] needs only the small values sorted: every value >= 2^L, with L = E - 30 and 2^E above the sum
// of all values, is a multiple of 2^(L-23) (or of 2^-149, the smallest subnormal), and so is any sum of
// such values; those sums are below 2^E = 2^(L-23+53), so each is a double and every addition among them
// is exact, in any order. They come first in descending order, so S[|big|] is their exact sum
// (`exact_sum`, added here in any order), and only the nonzero values below 2^L (`tail`; zeros add
// nothing) need their descending order. Both results are bit-identical to a full sort followed by the
// sequential sums (tests/sim/select_test.cc). Sorts only those and the kmax largest: O(n) passes plus a
// radix sort of (kmax + |tail|) keys instead of n; with kmax 0 and no nonzero value below 2^L (softmax rows,
// usually), one vectorised pass: S[n] is then the exact sum that pass computes. Values must be
// non-negative and finite.
void SortForDescendingSums(std::span<const float> values, int kmax, std::vector<float>* head,
                           double* exact_sum, std::vector<float>* tail);

// A row's sums by kind and in all, and its extreme bit patterns, when exact in any order (ExactKindSums).
struct RowSums {
  double kind[4] = {};  // the values of kind k, summed
  double total = 0;     // every value, summed: the row's S[n]
  uint32_t umax = 0;    // the largest magnitude's bit pattern
  uint32_t umin = 0;    // the smallest magnitude's bit pattern (0 when the row holds a zero)
  uint32_t unz = 0;     // the smallest nonzero magnitude's bit pattern (0 when every value is a zero)
};
// The sums of a row of non-negative values by kind (up to 4 kinds, given as runs: run r covers positions
// [r == 0 ? 0 : run_end[r - 1], run_end[r]) of `values` and has kind run_kind[r]; the last run ends at
// values.size()), and the whole row's sum, when they are exact in any order: when no value is below -0,
// the sum is finite and every nonzero value is >= 2^L (as in SortForDescendingSums: L = E - 30, 2^E above
// the sum; or 2^L subnormal). Then every partial sum of any subset is exact (the proof above), so
// out->kind[k] is bit-identical to the sequential sum, in double from +0.0 in index order, of the values
// of kind k (and out->total to the row's S[n], and to the sequential sum of all values): the sums are
// taken by runs, in vector lanes, in any order. Returns false, and leaves *out unspecified, otherwise (a
// caller then sums in its own order, and its own checks report a negative or non-finite value).
bool ExactKindSums(std::span<const float> values, std::span<const int32_t> run_end,
                   std::span<const uint8_t> run_kind, RowSums* out);
// Tests only: false makes ExactKindSums take its portable loops on a CPU with AVX2 too.
void SetKindSumsAvx2ForTesting(bool allowed);
// DescendingSums' (and RowBuckets::Sums') two ways to the sums above each k's bucket: 0 chooses by the row's
// estimated cost (the default), 1 always splits at each level, 2 always puts the values in their buckets.
// The same bits every way. BucketSumsRowsForTesting counts the rows that took the buckets' way.
void SetBucketSumsForTesting(int mode);
int64_t BucketSumsRowsForTesting();

// The same descending prefix sums S[k] of many rows of non-negative finite values, answered one k at a time
// without sorting the rows (the regret needs one S[k] per run, step and query head: RegretSums in
// sim/replay.cc). A row is added once (O(n) passes); Sum(row, k) then returns S[k], bit-identical to the
// sequential sum of a full descending sort (tests/sim/select_test.cc).
// Why no sort is needed for k up to |big| (the values >= 2^L, as in SortForDescendingSums): the k largest
// values are then all >= 2^L, and every partial sum of such values is exact in a double (see above), so
// S[k] is the exact sum of the multiset of the k largest values, added in any order (when 2^L is subnormal
// every value counts as big: all are multiples of 2^-149 and every sum is below 2^-97). AddRow counts the
// values per bucket of their top bits (non-negative floats order like their bit patterns: a bucket's values
// are all above the next lower bucket's; absolute buckets, u >> 19, 16 per binade) and keeps only the
// values of the buckets down to the one holding the min(kmax, |big|)-th largest value (no larger k is
// asked), copied branch-free in index order into up to kGroups groups of whole buckets (group g ends at the
// first bucket boundary holding at least kept / 2^(kGroups-1-g) values), with the exact sum of the groups
// above each. Sum walks the cumulative counts to the bucket holding the k-th largest value and reads only
// its group: one vectorised pass adds the group's values above that bucket (exact: any order, any lanes)
// to the groups above, and gathers the bucket's values, whose largest ones it selects (nth_element, after
// a split by the next 4 bits when there are more than 8; their sum is exact in any order too). No values
// are scattered by bucket and no per-bucket sums kept (round 12: the scatter and the per-value sums were
// most of AddRow). For k above |big| the values below 2^L do need their order: they are sorted when the
// row is added and their running sums from S[|big|] kept, up to kmax (Sum's largest k).
class TopKSums {
 public:
  static constexpr int kGroups = 4;  // the most groups of a row's kept values
  // Forgets every row (keeps the memory).
  void Clear();
  // Reserves room for `rows` rows of `values` values in all (growing by doubling costs copies and page
  // faults; untouched reserved pages cost nothing).
  void Reserve(int rows, size_t values);
  // Adds the next row (rows are numbered 0, 1, ... in the order added) and returns its whole sum S[n].
  // Sum will be asked for k <= kmax only.
  // `known`, when given, is ExactKindSums' result for these values (it returned true): its total and bit
  // patterns replace AddRow's first pass over the row (the same results: its sum is then exact too).
  double AddRow(std::span<const float> values, int kmax, const RowSums* known = nullptr);
  // S[k] of row `row`, k in [0, kmax] (k >= n is S[n]). `scratch` holds one bucket's values (it is grown
  // to a group's length and not shrunk).
  double Sum(int row, int k, std::vector<float>* scratch) const;
  // The k-th largest value of row `row` (k >= 1; 0 for k > n, as zeros fill a descending sort), exactly
  // the value a full descending sort puts at place k - 1: a selection in the one bucket holding it. Empty
  // when that value lies in a bucket below the one holding the kmax-th largest value, or below 2^L and
  // beyond the row's kmax (those values are not kept); always there for k <= kmax.
  std::optional<float> Kth(int row, int k, std::vector<float>* scratch) const;
  // A hint, no result: starts loading what Sum(row, k) will read (the row's cumulative counts and the group
  // of kept values holding the k-th largest value) into the caches. A caller that will ask row r + 1 next
  // (the next decode step's row, with about the same k) calls it right after Sum(r, k), so the lines,
  // written when the row was added long before, are on their way during the caller's work in between.
  // Any row and k (out of range: nothing).
  void Prefetch(int row, int k) const;

 private:
  struct Row {
    size_t elem = 0, bucket = 0, tail = 0;  // offsets in elems_, cc_ (nb + 1 entries), tail_
    int nb = 0, ntail = 0, kept_tail = 0;   // buckets, nonzero values below 2^L, tail_ entries kept
    int n = 0;
    uint32_t hi = 0;  // the number of the top bucket (the largest value's bit pattern >> 19)
    int kept = 0;     // values kept in elems_
    int ngroups = 0;  // their groups: group g holds the buckets [gend[g], gend[g + 1]), at elems_[elem +
                      // cc[gend[g]] + 8 g] on (8 spare places after each group for the block stores)
    int gend[kGroups + 1] = {};
    int gcnt[kGroups + 1] = {};     // [g] cc[gend[g]]: the kept values above group g
    double gsum[kGroups + 1] = {};  // [g] the exact sum of groups 0 .. g - 1
    double total = 0;               // S[n]
  };
  std::vector<Row> rows_;
  std::vector<float> elems_;  // per row: the kept values, by group from the top (index order in one)
  size_t elems_used_ = 0;     // the rows' part of elems_ (beyond it: scratch, or a cleared use's values)
  std::vector<int32_t> cc_;   // per row: [j] how many values the top j buckets hold
  std::vector<double> tail_;  // per row: S[|big| + i], i = 1 .. kept_tail
  std::vector<float> tailv_;  // per row: the values added there (descending), i = 1 .. kept_tail
};

// S[k] of one row for each k of `ks` (any order, repeats allowed; k <= 0 gives 0, k >= n gives S[n]) into
// out[i] = S[ks[i]]: the same bits as TopKSums::AddRow(values, the largest k, known) followed by Sum(row, k)
// for each (every one is the exact sum of the k largest values, see TopKSums), without keeping the row: a
// caller that knows all its k for a row at once (the regret's runs, when the unit's runs have all finished
// their steps: RegretSums in sim/replay.cc) needs no groups of kept values and no second scan of them per
// k. One bucket-count pass as AddRow's; then the values from the lowest bucket some k needs up are
// compressed once, and either split at each next bucket boundary a k needs (each split's exact sum: the sum
// of the values above a k's bucket; the part below the split, when it is one bucket a k ends inside, is
// where that k's largest values are selected, as Sum does) or, when those splits would read many times the
// compressed values (a row with many k's), put in their buckets in one pass (each bucket's exact sum, and
// the values of the buckets a k ends inside). A row with nonzero values below 2^L (their order matters)
// takes TopKSums itself. `known` as in AddRow.
void DescendingSums(std::span<const float> values, std::span<const int32_t> ks, const RowSums* known,
                    double* out);

// Per row, the bucket counts TopKSums and DescendingSums take (and the row pass before them), kept without
// the row's values: for a unit whose regrets are deferred (DescendingSums at the unit's end) while a run
// asks the k-th largest value of its rows at every step (the oracle's threshold: Kth), so neither needs
// TopKSums' kept values (no KeepGroups, no group sums). The values themselves stay with the caller, who
// gives them again to Kth and Sums (the same values as to AddRow). A row with nonzero values below 2^L
// (their order matters) keeps no counts: Kth answers nothing and Sums takes DescendingSums' own path.
class RowBuckets {
 public:
  // Forgets every row (keeps the memory).
  void Clear();
  void Reserve(int rows);
  // Adds the next row (numbered 0, 1, ... in the order added); `known` as in TopKSums::AddRow.
  void AddRow(std::span<const float> values, const RowSums* known = nullptr);
  // The k-th largest of `values` (row `row`'s values; k >= 1; 0 for k > n), exactly the value a full
  // descending sort puts at place k - 1, as TopKSums::Kth: one gather of the bucket holding it from the
  // row, then a selection in it. Empty for a row that keeps no counts. `scratch` is grown, not shrunk.
  std::optional<float> Kth(int row, std::span<const float> values, int k, std::vector<float>* scratch) const;
  // TopKIndicesWithThreshold(values, k, *Kth(row, values, k), out) in one pass over the row instead of
  // three (Kth's gather, the threshold scan's count and its take): the indices and values of the buckets
  // down to the one holding the k-th largest value (a superset of the taken ones: every value above the
  // threshold lies in those buckets, and so does every value equal to it when it is nonzero) and that
  // bucket's values are compressed from the row at once (16 a register with AVX-512, 8 with AVX2), the
  // threshold selected in the bucket as Kth does, and the candidates then filtered in index order by the
  // scan's rule (every value above it, then the lowest-indexed equal ones while fewer than k are taken):
  // the same indices. Returns false, and leaves *out unspecified, where that rule cannot be read from the
  // counts (a row that keeps no counts, k > n, or a k-th largest value in the lowest bucket, which holds
  // the zeros); the caller then takes Kth and the scan. k >= 1. `scratch` and *out are grown, not shrunk
  // (no allocation once grown). SetSelectAvx512ForTesting / SetSelectAvx2ForTesting choose its loops.
  bool TopK(int row, std::span<const float> values, int k, std::vector<float>* scratch,
            std::vector<int32_t>* out) const;
  // DescendingSums(values, ks, known, out) with row `row`'s counts instead of its own row pass and count
  // pass (the same bits).
  void Sums(int row, std::span<const float> values, std::span<const int32_t> ks, const RowSums* known,
            double* out) const;

 private:
  struct Row {
    size_t bucket = 0;  // offset in cc_ (nb + 1 entries)
    int nb = -1;        // buckets from the top one down to 2^L's; -1: no counts (values below 2^L)
    int n = 0;
    uint32_t hi = 0;  // the top bucket's number
    double sum = 0;   // the row's exact sum (S[n]); set only with counts (nb >= 0)
  };
  std::vector<Row> rows_;
  std::vector<int32_t> cc_;  // per row: [j] how many values the top j buckets hold
};

}  // namespace kvsim
