#pragma once
// The int16 screen of NearestByCosine for CPUs with AVX2 but without AVX512-BF16 (issue 14, round 10): the
// same idea as the bf16 screen (merge_screen.h), with both operands rounded to 15-bit fixed point and the
// products summed exactly in int32 by `vpmaddwd`. Its rounding is 2^7 times finer than bf16's, so it
// leaves far fewer candidates to re-check, and it needs only AVX2. Rigorous bound, proof in
// merge_screen_int16.cc; NearestByCosine (policies/merge.cc) re-checks every candidate with the exact
// fmaf chain (merge_screen::ExactDots), so its slot and value are the same as without the screen.

#include <cstdint>
#include <vector>

#include "policies/merge_screen_int8.h"

namespace kvsim::merge_screen::int16 {

// A normalised coordinate x is held as the integer round(x * 2^kShift) (nearest, ties to even).
inline constexpr int kShift = 14;

// True if this CPU has AVX2 (the kernel's instructions).
bool Supported();

inline int PaddedTargets(int n) { return (n + 7) / 8 * 8; }
// int16 elements of PackTargets' output.
inline long PackedTargetsSize(int n, int d) { return static_cast<long>(PaddedTargets(n)) * d; }

// Packs `n` rows of d floats (d even; rows NearestByCosine normalised: finite, norm ≤ 1 + 2^-20) as
// fixed-point int16, row after row: out[r * d + k]. err[r] ≥ the Euclidean norm of row r's rounding error
// (the difference between out / 2^kShift and the row).
void PackQueries(const float* rows, int n, int d, int16_t* out, double* err);
// Test hook: PackQueries' AVX2 path (d % 16 == 0) off (false) or on again (true); same words, and err
// within its rounding.
void SetVectorPackForTesting(bool enabled);
// The targets in groups of 8 (the last group padded with zero rows), dimension pairs interleaved: the two
// int16 of pair p of target 8 g + i are out[2 * ((g * d/2 + p) * 8 + i)] and the next one. Returns ≥ the
// largest row's rounding error norm.
double PackTargets(const float* rows, int n, int d, int16_t* out);
// The same layout from rows PackQueries already packed: row j's words at rows[j], its error norm err[j]
// (PackTargets is PackQueries, then this). Returns the largest err.
double SpreadTargets(const int16_t* const* rows, const double* err, int n, int d, int16_t* out);

// The exact integer dot products of packed queries and targets (for tests): out[r * ld + j] for
// j < PaddedTargets(num_targets) (padding targets give 0). Requires Supported().
void Dots(const int16_t* queries, int num_queries, const int16_t* targets, int num_targets, int d,
          int32_t* out, long ld);

// The screen: for each query row r, in row order, the targets j (ascending) whose integer dot product S_rj
// is at least max_j S_rj − slack[r] (slack[r] ≥ 0; values above 2^30 count as 2^30), appended to `rows`
// (r) and `idx` (j). Works on six query rows at a time, so their products stay near (≤ 6 x targets int32: L1
// or L2). With `floor` (issue 14, round 14), only the targets whose S_rj is also ≥ floor[r] (a row may then
// have none). Requires Supported().
//
// With `narrow` (issue 14, round 16: the targets also narrowed by int8::NarrowTargets), an int8 first
// stage (merge_screen_int8.h) picks, per query row, the targets that can be candidates and their int16
// products are computed one by one (from NarrowTargets' row-major copy of the words): the same candidates,
// in the same order (proof in merge_screen_int8.cc). Blocks of 6 rows with a row NarrowQueries cannot
// scale, and d without int8::Applies, use the int16 products of every target.
struct Narrowed {
  const int8_t* words = nullptr;  // int8::NarrowTargets' output (int8::PackedTargetsSize bytes)
  int8::Norms norms;
};
// With `narrowed_queries` as well (issue 14, round 19): the query rows' int8 words and norms as
// int8::NarrowRows made them from these int16 rows (merge.cc narrows a unit's rows once for all its calls),
// used instead of narrowing the rows here; the same candidates.
void Candidates(const int16_t* queries, int num_queries, const int16_t* targets, int num_targets, int d,
                const int64_t* slack, std::vector<int>* rows, std::vector<int>* idx,
                const int64_t* floor = nullptr, const Narrowed* narrow = nullptr,
                const int8::NarrowedRows* narrowed_queries = nullptr);
// Test and A/B hook: the int8 stage off (false) or on again (true). Also off with KVSIM_MERGE_INT8=0.
void SetInt8ForTesting(bool enabled);
bool Int8Enabled();

// The slack for a query whose rounding error norm is rq against targets whose largest is rt:
// ceil(2 · merge_screen::ErrorBound(d, rq, rt) · 2^(2 kShift)), saturated at 2^30.
int64_t Slack(int d, double rq, double rt);

}  // namespace kvsim::merge_screen::int16
