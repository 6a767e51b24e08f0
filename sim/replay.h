#pragma once
// The replay engine: runs many (policy, budget) configurations over one trace in a single streamed pass.
// For every layer it reads the layer's tensors once, computes the full-attention reference once (shared by
// every configuration), and runs the request's events — prefill, compression hook, decode steps — in
// token-step order for every (KV head, configuration) unit. After the last layer, the latency model turns the
// per-step cache sizes into simulated time, and metrics are aggregated (docs/metrics.md).

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sim/latency_model.h"
#include "sim/policy.h"
#include "sim/progress.h"
#include "sim/results.pb.h"
#include "sim/trace.h"

namespace kvsim {

enum class QuestionMode { kQueryAware, kQueryAgnostic };
const char* QuestionModeName(QuestionMode m);  // "query_aware" | "query_agnostic"

struct RunSpec {
  std::shared_ptr<const Policy> policy;
  std::string label;           // default: policy name
  double budget_fraction = 0;  // B = round(fraction * compressible prompt length), >= 1
  int budget_tokens = 0;       // used when budget_fraction == 0
  QuestionMode question_mode = QuestionMode::kQueryAware;
};

// Optional observer of every cache decision (gpu_replay builds its plans from it). The engine calls it from
// its worker threads, each call for one (run, layer, KV head) unit; calls for one unit are sequential and in
// event order, calls for different units may be concurrent. `run` is the index into Replay's `runs`. The
// recorder must store per unit (no shared mutable state without its own locking) so that what it records
// never depends on the thread count.
class DecisionRecorder {
 public:
  virtual ~DecisionRecorder() = default;
  // Once, before any layer: the trace and, per run, its compressible region and per-(layer, KV head)
  // budgets ([layer * num_kv_heads + kv_head]).
  virtual void Begin(const TraceMeta& meta, std::span<const RunSpec> runs, std::span<const int> compress_end,
                     std::span<const std::vector<int>> head_budgets) {}
  // After the prefill event: the compression hook ran and the tokens after the compressible region were
  // appended.
  virtual void AfterPrefill(int run, int layer, int kv_head, const HeadCache& cache) {}
  // Decode step `step`: the cache the step attends over (after BeforeStep's evictions and the append).
  virtual void BeforeAttention(int run, int layer, int kv_head, int step, const HeadCache& cache) {}
  // Decode step `step`: the cache after the policy's AfterStep (compression at step 0, decode merges, ...).
  virtual void AfterStep(int run, int layer, int kv_head, int step, const HeadCache& cache) {}
};

struct ReplayOptions {
  int threads = 0;                        // <= 0: hardware concurrency; results never depend on it
  const LatencyModel* latency = nullptr;  // null: token steps
  Progress* progress = nullptr;           // optional: told after every layer (sim/progress.h)
  std::string trace_hash;                 // recorded in results
  // Prefill in chunks of this many tokens (0 = the whole prompt at once). Chunks are timeline events: each
  // lasts LatencyModel::PrefillDuration(chunk) and holds its uncompressed prefix; the compression hook runs
  // at the end of the last chunk.
  int prefill_chunk = 0;
  DecisionRecorder* recorder = nullptr;  // optional: sees every cache decision (gpu_replay plans)
};

// Start of the compressible region for a question mode: n (aware) or the first question token (agnostic).
int CompressEnd(const TraceMeta& meta, QuestionMode mode);
// The compressible-region ends a trace records prompt entropies for (`kvsim synth`, the capture tool): the
// query-agnostic replay's CompressEnd, then the query-aware one's, each kept when >= 1 and beyond the
// previous one (one entry when the prompt has no question).
std::vector<int32_t> PromptEntropyRegions(const TraceMeta& meta);

// The query rows (indices into meta.query_positions) a replay of `runs` reads, decided in this one place from
// each run's PolicyRequirements: every decode step's row (reference, steps, regret, bound), each run's
// observation window (`window`), and every compressible prompt row for runs with `prompt_column_sums` the
// trace does not record for their compressible region. first_pass: only what the first pass reads of
// `layer` (-1: of any layer it reads), i.e. for the first-pass policies whose FirstPassLayers(meta, ce) list
// it, their window and, with `first_pass_prompt_queries`, every compressible row (MEDA with recorded prompt
// entropies lists no layer and so reads no query row). Reads of any other row abort
// (LayerData::HeadQueries), so a missing entry here cannot go unnoticed.
QueryRows ReplayQueryRows(const TraceMeta& meta, std::span<const RunSpec> runs, bool first_pass,
                          int layer = -1);

// Checks that every run can be replayed on this trace (budgets, required queries/aggregates) before any
// work starts. The message names the run, the requirement and the fix.
Status CheckRuns(const TraceMeta& meta, std::span<const RunSpec> runs);

// PlainSlotSums (below) of the first `steps` decode steps of a prefix-closed run at once, vectorised over
// the steps: step t holds the slots s < count[t] (count non-decreasing) with tokens tk[s], and its
// probabilities are pt[tok * stride + t] (the unit's transposed probability matrix). For every step t,
// rm[t][j][mo] gets exactly what PlainSlotSums(tk, count[t], p_t, mod, ...) writes into zeroed sums: the
// same additions in the same order (slot order per (j, mo)), from +0.0. Reads pt[tok * stride + t] only for
// the steps t that hold tok's slot.
void PrefixSlotSums(const int32_t* tk, const int* count, int steps, const float* pt, size_t stride,
                    const Modality* mod, double (*rm)[4][4]);

// A decode step's sums over a cache of plain slots (the replay's inner loop, exposed for its tests): for the
// slots s = 0..slots-1 holding tokens tk[s], rm[j][mo] += p[tk[s]] for s ≡ j (mod 4) and mo = mod[tk[s]],
// each sum's additions in slot order (rm zeroed by the caller); cp[s] = p[tk[s]] when cp is not null.
// Returns the number of slots with tk[s] >= first.
int PlainSlotSums(const int32_t* tk, int slots, const float* p, const Modality* mod, int first, float* cp,
                  double rm[4][4]);

// out[j] = sqrt(Σ_k x[j·d + k]²) in double, rounded to float, for rows j < rows (Prefill's ‖v_j‖): each row's
// exact squares (a float times itself is exact in double) added over k in order from +0.0, whatever path
// (eight rows' 8 × 8 tiles transposed in registers with AVX2, a row at a time without) does it.
void RowNorms(const float* x, int rows, int d, float* out);

// The largest of RowNorms' values for rows j < rows (+0.0 when rows <= 0), bit for bit: a float pass bounds
// every row's sum of squares, and RowNorms' exact sum runs only for the rows that can be the largest.
float MaxRowNorm(const float* x, int rows, int d);

// out[t] = the largest of RowNorms' values over the keys [first[t], n + t] of values [n + steps][d], for
// t < steps (Prefill's max ‖v_j‖ over each decode step's visible keys), bit for bit.
void MaxVisibleNorms(const float* values, int n, int steps, int d, const int32_t* first, float* out);

// Tests only: false makes the oracle's top-k (StepAttention::full_topk) come from a selection of the k-th
// largest value in a copy of the row and the threshold scan, instead of the regret's buckets
// (RowBuckets::TopK, or TopKSums::Kth and the scan), so a test can compare the two.
void SetFullKthFromSumsForTesting(bool allowed);
// Tests only: false makes a unit whose runs ask no k-th largest value build the regret's TopKSums at Prefill
// and answer each run's k at its step, instead of deferring every row's k to the unit's last run
// (DescendingSums), so a test can compare the two.
void SetDeferredTopKSumsForTesting(bool allowed);
// Tests only: false keeps TopKSums (built at Prefill, Sum at each step) for a unit with a run that asks the
// k-th largest value (the oracle), instead of deferring its regrets too and answering the k-th largest
// values from each row's bucket counts (RowBuckets), so a test can compare the two.
void SetDeferredKthUnitsForTesting(bool allowed);
// Tests only: false makes the regret's row sums ignore the exact sums taken after each reference row's
// softmax (DecodeReference::sums) and add every row again in its own order, as before round 14.
void SetExactRowSumsForTesting(bool allowed);
// Test hook: false keeps FinishRun's output product off its run-of-tokens path (the union of the steps'
// slot lists as merged intervals, A's rows as copies of p's stretches), on the token-by-token loops (the
// same U and A).
void SetRunListsForTesting(bool allowed);
// Test hook: false makes FinishRun's token-by-token loops list the union U's tokens at first sight and sort
// them, instead of one scan of the markers over the tokens' range (the same U).
void SetUnionScanForTesting(bool allowed);
// Test hook: false makes FinishRun's runs path copy every product's value rows into its buffer, instead of
// reading a band of consecutive tokens' rows in place in V (the same operand).
void SetInPlaceValueRowsForTesting(bool allowed);
// Test hook: false keeps a cache that holds merged slots at step 0 out of Step's prefix mode (its steps'
// plain slots then listed one by one, step by step, as before round 14), which only a plain cache entered.
void SetMergedPrefixForTesting(bool allowed);
// Test hook: false makes Step sum a merged-slot block's steps one at a time (MergedSlotSums) instead of a
// chunk's steps at once over their common slots (MergedSlotSumsSteps, then the appended ones).
void SetChunkSlotSumsForTesting(bool allowed);
// Test hook: false computes every run's output product over all its plain slots, decode tokens included
// (true: a run that holds every visible decode token adds the unit's shared decode part instead).
void SetSharedDecodePartForTesting(bool allowed);
// Test hook: false adds every run's output product in token order, as one product (true: a run whose
// policy ranks its kept prompt tokens, HeadPolicy::PrefillRank, adds it in rank bands).
void SetOutputBandsForTesting(bool allowed);
// Test hook: false never keeps or resumes another run's band sums (each ranked run adds all its bands).
void SetRankBandMemoForTesting(bool allowed);
// Test hook: false keeps FinishRun from taking step 0 on its own (a step 0 that holds every visible token as
// itself, then prefix-closed steps: its row from the reference, the others' product over their own union).
void SetStepZeroSplitForTesting(bool allowed);
// How many (unit, run) outputs took that split since the process started (tests: the path was taken).
int64_t StepZeroSplitsForTesting();
// Test hook: false makes FinishRun count each step's held decode tokens token by token even when the steps'
// lists are runs of consecutive tokens (it counts them run by run: the same counts).
void SetHeldByRunsForTesting(bool allowed);
// Test hook: false makes FinishRun find the steps' runs of consecutive tokens in one pass over all the lists
// (Step finds each step's as it writes the list: the same runs).
void SetStepRunsForTesting(bool allowed);
// Test hook: false makes FinishRun copy a sliding window's full columns into A even where it can read them in
// place in the reference probabilities' rows (one query head per KV head: the same operand).
void SetInPlaceProbRowsForTesting(bool allowed);
// Test hook: false makes a prefix-closed run whose deferred steps held every visible token (e.g. `full`) sum
// its retained mass from the transposed probabilities even when every row's sums are exact (it takes them
// from the rows' own sums: the same bits).
void SetWholeRowSumsForTesting(bool allowed);
// How many (unit, run) flushes took the rows' own sums since the process started (tests: the path was taken).
int64_t WholeRowSumsForTesting();
// Test hook: false makes a prefix-closed run's few deferred steps (at most 8, e.g. a sliding window's step 0)
// take their sums from the unit's transposed probabilities, as its longer prefixes do, instead of from their
// own rows (the same bits).
void SetRowFlushForTesting(bool allowed);
// How many (unit, run) flushes summed their steps from their own rows since the process started.
int64_t RowFlushesForTesting();

// A decode step's sums over a cache with merged slots (the replay's inner loop for such caches, exposed for
// its tests). Slots s = 0..slots-1 hold anchor tokens tk[s]; the merged ones are merged[0..num_merged), in
// ascending slot order, the j-th with weight mw[j] and member mass members[j] (read only when visible). In
// slot order, every visible slot (tk[s] >= first; the others are masked) adds, with pt = p[tk[s]]:
//   plain:  retained += pt, ret_mod[mod[tk[s]]] += pt, covered += pt, wsum += pt, cp[s] = pt
//   merged: anchor += pt, covered += pt then += members[j], merged_w += mw[j],
//           merged_mass += pt + members[j] (in double), wsum += mw[j], cp[s] = mw[j]
// each sum's additions in slot order, from +0.0 (cp written only when not null).
struct MergedSlotSumsResult {
  double wsum = 0, retained = 0, anchor = 0, covered = 0, merged_w = 0, merged_mass = 0;
  double ret_mod[4] = {0, 0, 0, 0};
  int visible = 0;
};
MergedSlotSumsResult MergedSlotSums(const int32_t* tk, int slots, const float* p, const Modality* mod,
                                    int first, const int32_t* merged, int num_merged, const float* mw,
                                    const double* members, float* cp);
// MergedSlotSums of `nsteps` steps of one cache at once, for steps whose slots are all visible (first 0) and
// that hold the same slots tk[0..slots) with the same merged ones merged[0..num_merged): step i's p[tok] is
// pt[tok * stride + i] (transposed probabilities: a token's steps contiguous; pt + tok * stride + i is
// readable up to i = 4 * ceil(nsteps / 4) - 1), its weights mw + i * mw_stride, its member sums members +
// i * members_stride. out[i] is MergedSlotSums(tk, slots, p_i, mod, 0, merged, num_merged, mw + i *
// mw_stride, members + i * members_stride, nullptr), bit for bit: with AVX2 four steps share each
// instruction (lane i: step i's sums, each added in slot order as there). MergedSlotSumsAppend then continues
// one step's sums over plain slots after these (appended since), as MergedSlotSums would (for a policy that
// reads no attention: neither writes MergedSlotSums' `cp`).
void MergedSlotSumsSteps(const int32_t* tk, int slots, const float* pt, size_t stride, const Modality* mod,
                         const int32_t* merged, int num_merged, const float* mw, size_t mw_stride,
                         const double* members, size_t members_stride, int nsteps, MergedSlotSumsResult* out);
void MergedSlotSumsAppend(const int32_t* tk, int n, const float* p, const Modality* mod,
                          MergedSlotSumsResult* r);

// The merged slots' attention weights of one step: out[j] = static_cast<float>(std::exp(
// static_cast<double>(tf(dots[j])) - lse)) for j in [0, n), bit for bit (issue 14, round 12). With AVX2 and
// FMA, four at a time: a double exp of known error (at most 4 ulp) whose float rounding is the float
// rounding of every value within 64 ulp of it, glibc's exp among them (it is within 1 ulp of e^x), except
// when it lies within 64 ulp of a float rounding boundary or x is outside [-87, 80]: those (about one in
// 4 million on random inputs) call std::exp. The proof is at the function (replay.cc).
// On a CPU with AVX-512, eight at a time (the same operations; round 27);
// SetMergedWeightsAvx512ForTesting(false) keeps the AVX2 loop.
struct LogitTransform;
void MergedWeights(const float* dots, int n, const LogitTransform& tf, float lse, float* out);
void SetMergedWeightsAvx512ForTesting(bool allowed);

// Replays all runs; one RunResult per run, in order.
StatusOr<std::vector<RunResult>> Replay(TraceSource& trace, std::span<const RunSpec> runs,
                                        const ReplayOptions& options);

}  // namespace kvsim
