#pragma once
// The similarity kernels of NearestByCosine. A merge similarity is DEFINED as one sequential fmaf chain
// over k from +0 of the two normalised rows (ExactDots), on every CPU and block size (issue 14, round 10).
//  - The exact search (round 10): every pair's chain with AVX2 + FMA (8 targets per register, one lane per
//    target, so no reassociation), the first maximum per query fused (ExactNearest), or the same values
//    one pair at a time on CPUs without AVX2 / FMA.
//  - The bf16 screen (round 7): approximate cosine similarities of unit-length rows with AVX512-BF16
//    `vdpbf16ps` (both operands rounded to bf16, fp32 accumulation), a rigorous bound on their distance
//    from the fmaf chain, and candidates re-checked with ExactDots. NearestByCosine (policies/merge.cc) uses
//    it to find the same slot and similarity as the exact search, bit for bit, with about half the
//    multiply-adds; the proof is there and in docs/performance.md ("Round 7: merge similarities screened in
//    bf16"). Since round 25 only where the CPU has AVX512-BF16 but not AVX2, or when asked for
//    (ChosenScreen).
//  - The int16 screen (round 10; merge_screen_int16.h): the same with 15-bit fixed point summed exactly by
//    AVX2 `vpmaddwd` (Int16Enabled below); since round 16 with an int8 first stage (merge_screen_int8.h)
//    that leaves it the same candidates at about half the cost. The default wherever the CPU has AVX2:
//    on an AVX512-BF16 CPU (an Emerald Rapids Xeon) the 12 merging runs took 0.65–0.82× the bf16 screen's
//    CPU-s (docs/performance.md, "Round 25").
// Exposed for tests and bench/.

#include <cstdint>

namespace kvsim::merge_screen {

// Which screen NearestByCosine uses, chosen once from the CPU and the environment variable KVSIM_MERGE_SCREEN
// (for A/B measurements of one binary; results are the same bits with any screen or none): unset, empty or
// 1 = int16 where the CPU has AVX2 (since round 25: on an AVX512-BF16 CPU it was faster than bf16), else bf16
// where it has AVX512-BF16 (and AVX512F/BW/VL), else none; 0 = none; bf16 / int16 = that one where the CPU
// runs it, else none. Without a screen NearestByCosine uses the exact search (ExactNearest) only.
enum class Screen { kNone, kBf16, kInt16 };
Screen ChosenScreen();
// True if the bf16 screen is the chosen one and SetEnabledForTesting has not switched screening off.
bool Enabled();
// The same for the int16 screen (merge_screen_int16.h; round 10).
bool Int16Enabled();
// Whether the CPU supports the bf16 kernel at all (Enabled() also needs it chosen).
bool Supported();
// Test hooks: SetEnabledForTesting(false) forces the exact search, true allows the chosen screen again;
// SetScreenForTesting chooses a screen (one the CPU cannot run: none) until called again with ChosenScreen().
void SetEnabledForTesting(bool enabled);
void SetScreenForTesting(Screen screen);

// What NearestByCosine did on this thread (counts since the thread started; tests and bench read them).
struct Stats {
  long screened_blocks = 0;  // query blocks searched with the screen
  long exact_blocks = 0;     // searches by ExactNearest (screen off, small block, irregular rows, odd d)
  long screened_queries = 0;
  long candidates = 0;  // exact re-checks of the screened queries
  // The similarity memo of a unit's merging runs (policies/merge.h, merge_memo): calls that could use it,
  // calls that reused a stored answer set (any: round 13), calls that reused one containing all their
  // targets (e.g. a larger budget searched first: those rows need no product), calls that reused one
  // neither inside nor containing their targets (e.g. another policy's set), queries answered by a stored
  // answer (plus a search over the remaining targets), those of them with no target left to search, and the
  // query x target pairs the blocks of regular rows of the memo calls searched, with the memo and as
  // today's call would have.
  long memo_calls = 0;
  long memo_reuse_calls = 0;
  long memo_superset_calls = 0;
  long memo_overlap_calls = 0;
  long memo_queries = 0;
  long memo_free_queries = 0;
  long memo_products = 0;
  long memo_products_without = 0;
};
Stats& ThreadStats();

// ErrorBound's safety factor over the derived bound.
inline constexpr double kSafetyFactor = 1.5;
static_assert(kSafetyFactor >= 1.0, "the bound is rigorous only with a factor >= 1");

// The rigorous bound on |approximate similarity − NearestByCosine's fp32 value| for a query and a target of
// dimension d normalised by NearestByCosine (norm ≤ 1 + 2^-20, finite), whose bf16 rounding errors (as the
// kernel reads them: bf16 subnormals are zero) have Euclidean norms ≤ rq and ≤ rt (PackQueries /
// PackTargets return them), times kSafetyFactor. The derivation is in merge_screen.cc.
double ErrorBound(int d, double rq, double rt);
// The same for any rows: rq = rt = the largest possible rounding error norm, 2^-8 (1 + 2^-20) + √d 2^-126.
double ErrorBound(int d);

// Packs `n` rows of d floats (d even) as bf16 dimension pairs, rounded to nearest even:
// queries: out[r * d/2 + p] = bf16(row r, dim 2p) | bf16(row r, dim 2p + 1) << 16; err[r] ≥ the norm of
// row r's rounding error (as above).
void PackQueries(const float* rows, int n, int d, uint32_t* out, double* err);
// targets in groups of 16 (the last group padded with zero rows): out[((g * d/2) + p) * 16 + i] is the pair
// p of target 16 g + i. `out` holds PackedTargetsSize(n, d) words. Returns ≥ the largest row's rounding
// error norm.
double PackTargets(const float* rows, int n, int d, uint32_t* out);
inline int PaddedTargets(int n) { return (n + 15) / 16 * 16; }
inline long PackedTargetsSize(int n, int d) { return static_cast<long>(PaddedTargets(n)) * (d / 2); }

// approx[r * ld + j] for r < num_queries, j < PaddedTargets(num_targets) (padding targets give 0): the
// bf16 dot products of packed queries and packed targets, fp32 accumulation over the pairs in order.
// Requires Supported().
void ApproxDots(const uint32_t* queries, int num_queries, const uint32_t* targets, int num_targets, int d,
                float* approx, long ld);

// The merge similarity of a pair (round 10's definition; on AVX512-BF16 machines it was also the value of
// OpenBLAS's sgemm outside its small-matrix path, round 6): one fmaf chain over k from +0. n pairs
// (a[i], b[i]) of d floats, eight chains interleaved.
void ExactDots(const float* const* a, const float* const* b, int n, int d, float* out);

// ---- the exact search (round 10) ----
// Whether ExactNearest / ExactDotsPacked use the AVX2 + FMA kernel: the CPU has both and the test hook
// below has not forced the portable path (which gives the same values, one fmaf chain per pair).
bool ExactAvx2();
void SetExactAvx2ForTesting(bool enabled);
// Targets for the exact search: groups of 8 rows interleaved by dimension, out[(g * d + k) * 8 + i] = row
// 8 g + i, dimension k (the last group padded with zero rows). `out` holds ExactPackedSize(n, d) floats.
inline int ExactPaddedTargets(int n) { return (n + 7) / 8 * 8; }
inline long ExactPackedSize(int n, int d) { return static_cast<long>(ExactPaddedTargets(n)) * d; }
void PackExactTargets(const float* rows, int n, int d, float* out);
// For each query row r < num_queries (d floats at queries + r d) the first maximum over the packed targets
// j < num_targets (num_targets ≥ 1) of v_j = the fmaf chain of (query, target j) (ExactDots' value, bit
// for bit): nearest[r] = the index, similarity[r] = v_nearest. "First maximum" as a scan in slot order
// that starts at j = 0 and moves on only to a strictly greater value: the first index of the largest
// value, −0 and +0 equal, a NaN never chosen unless v_0 is NaN (then 0) — what std::max_element and
// merge.cc's FirstMaxIndex return. The rows x targets matrix is never written.
void ExactNearest(const float* queries, int num_queries, const float* packed_targets, int num_targets, int d,
                  int* nearest, float* similarity);
// The same kernel's values: out[r * ld + j] = v_j of query r (tests and bench/).
void ExactDotsPacked(const float* queries, int num_queries, const float* packed_targets, int num_targets,
                     int d, float* out, long ld);

}  // namespace kvsim::merge_screen
