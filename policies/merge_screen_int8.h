#pragma once
// The int8 first stage of the int16 screen (issue 14, round 16). The int16 screen (merge_screen_int16.h)
// computes every query x target product S = Σ_k A_k B_k of the 15-bit words exactly and keeps the targets
// with S ≥ max S − Slack (and S ≥ floor). This stage finds, with 8-bit words and `vpmaddubsw` (32
// products and their pair sums per instruction), a superset of those targets, so the int16
// products are computed only there: the int16 candidates are EXACTLY the ones without the stage (the same
// list, the same order; proof in merge_screen_int8.cc). The stage takes 2 vector operations per 4
// dimensions of a (query, 8 targets) pair where the int16 kernel takes 4: the query is the unsigned
// operand, biased by +128, and the bias's part of the sum is subtracted up front (each accumulator starts
// at −128 Σ t over its dimensions, modulo 2^16: the int16 lanes wrap, and their final values are exact).
// Words are derived from the int16 words: targets t_k = clamp(round(kTargetScale B_k / 2^14), ±64), a
// query row q_k = clamp(round(c A_k / 2^14), ±127) with one integer scale c for d (QueryScale).

#include <cstdint>

namespace kvsim::merge_screen::int8 {

inline constexpr int kTargetScale = 128;  // target words: |t| ≤ kTargetMax (coordinates ≤ 0.5 unclamped)
inline constexpr int kTargetMax = 64;     // 2 · 255 · 64 < 2^15: vpmaddubsw's pair sums never saturate
inline constexpr int kMaxQueryScale = 511;  // |c A_k| < 2^24: the errors are exact floats

// Whether the stage applies to dimension d: AVX2, d % 16 == 0, d ≤ 4096.
bool Applies(int d);
// The query rows' scale for dimension d (NarrowQueries): 236 at d = 128.
int QueryScale(int d);

// The usable targets' largest ‖t‖² (exact) and an upper bound on their largest ‖β‖², β_k = kTargetScale
// B_k − 2^14 t_k (the rounding error in units of 2^-14 / kTargetScale of a word). A target is usable if no
// word was clamped and ‖t‖ ≤ kTargetScale (1 + 2^-20 + √d 2^-15) + √d / 2 + 1 (every row of norm ≤ 1 +
// 2^-20 without a coordinate above 0.5 is); the others' int16 products are always computed (Unusable).
struct Norms {
  int64_t norm2 = 0;
  double err2 = 0;
  double norm = 0, err = 0;  // their square roots (err rounded up: ≥ √err2)
};

// Targets: groups of 8, dimension quads interleaved (byte ((g * d/4 + p) * 8 + i) * 4 + b is target 8 g + i's
// dimension 4 p + b), then per group 16 int16 accumulator starts (the bias), then per group one byte: bit i
// set if target 8 g + i is not usable, then (32-byte aligned from the start) the int16 words again, row
// after row (Rows16: the second stage reads single targets). Size in bytes.
inline long PackedTargetsSize(int n, int d) {
  const long groups = (n + 7) / 8;
  return (groups * (8L * d + 32 + 1) + 31) / 32 * 32 + groups * 8 * d * 2;
}
// From targets in int16::PackTargets' layout (n rows; padding rows zero). Requires Applies(d).
Norms NarrowTargets(const int16_t* targets16, int n, int d, int8_t* out);
// The per-group bytes of unusable targets within NarrowTargets' output.
inline const uint8_t* Unusable(const int8_t* targets, int n, int d) {
  const long groups = (n + 7) / 8;
  return reinterpret_cast<const uint8_t*>(targets + groups * (8L * d + 32));
}
// The int16 words row after row (target j at + j d) within NarrowTargets' output.
inline const int16_t* Rows16(const int8_t* targets, int n, int d) {
  const long groups = (n + 7) / 8;
  return reinterpret_cast<const int16_t*>(targets + (groups * (8L * d + 32 + 1) + 31) / 32 * 32);
}

// Query rows (row-major int16 words, n x d) to row-major biased bytes u_k = q_k + 128 with one scale c for
// d (QueryScale: clamping at ±127 when a coordinate exceeds ≈ 0.54): scale[r] = c, or 0 if the row fails
// ‖q‖² t.norm2 ≤ 32767² (the row's block then skips the stage); ‖q‖ norm[r] and err[r] ≥ ‖α‖, α_k = c A_k
// − 2^14 q_k (both rounded up). Requires Applies(d).
void NarrowQueries(const int16_t* rows16, int n, int d, const Norms& t, uint8_t* out, int32_t* scale,
                   double* norm, double* err);

// NarrowQueries in two parts, for rows narrowed once and screened against many target sets (merge.cc's
// UnitKeys; issue 14, round 19): NarrowRows gives every row's bytes, its exact ‖q‖² (norm2), ‖q‖ and error
// norm (norm, err: NarrowQueries' values for a row it scales), whatever the targets; RowScale is
// NarrowQueries' scale of a row with that norm2 against targets t (QueryScale(d), or 0 when ‖q‖² t.norm2 >
// 32767²; the row's norm and err then count as 0). NarrowQueries is NarrowRows, then RowScale. Require
// Applies(d).
void NarrowRows(const int16_t* rows16, int n, int d, uint8_t* out, int32_t* norm2, double* norm, double* err);
int RowScale(int d, int32_t norm2, const Norms& t);
// Rows NarrowRows narrowed (row r's bytes at bytes[r], its norm2, norm and err), for int16::Candidates.
struct NarrowedRows {
  const uint8_t* const* bytes = nullptr;
  const int32_t* norm2 = nullptr;
  const double* norm = nullptr;
  const double* err = nullptr;
};

// The int8 products P_rj = Σ_k q_rk t_jk, out[r * ld + j] for j < padded targets: exact for usable targets
// and rows with scale > 0 (others: any value). Requires Applies(d). Two kernels give the same values
// (merge_screen_int8.cc (1)): `vpmaddubsw` + `vpaddw` into int16 lanes (AVX2), or, where the CPU has
// AVX-512 F and VNNI, one `vpdpbusd` per 4 dimensions of 16 (row, target) pairs into int32 lanes (issue 14,
// round 26).
// With `block_max` (issue 14, round 27), also each row's largest P per block of 4 groups, lane by lane:
// block_max[r * BlockMaxStride(n) + 8 b + i] = max over v < 4 of P_r,j, j = 32 b + 8 v + i, over the usable
// targets j < num_targets only (INT32_MIN if there is none); the int16 stage takes a row's maximum and
// skips whole blocks from these. The VNNI kernel takes them from its registers.
enum class Kernel { kAvx2, kVnni };
Kernel ChosenKernel();                    // kVnni where the CPU runs it, else kAvx2
void SetKernelForTesting(Kernel kernel);  // kVnni only where the CPU runs it
inline long BlockMaxStride(int n) { return ((n + 7) / 8 + 3) / 4 * 8; }
void Dots(const uint8_t* queries, int num_queries, const int8_t* targets, int num_targets, int d,
          int32_t* out, long ld, int32_t* block_max = nullptr);

// The window in P of a query row (scale, norm, err from NarrowQueries) against targets with summary t:
// W ≥ (2 E + scale kTargetScale slack) / 2^28, rounded up, plus one; E bounds |scale kTargetScale S − 2^28
// P| (merge_screen_int8.cc). Saturated at 2^40.
int64_t Window(int scale, double q_norm, double q_err, const Norms& t, int64_t slack);
// The lowest P a usable target can have and still reach S ≥ floor (rounded down, minus one).
int64_t FloorP(int scale, double q_norm, double q_err, const Norms& t, int64_t floor);

}  // namespace kvsim::merge_screen::int8
