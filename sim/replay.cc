#include "sim/replay.h"

#include <cblas.h>
// GCC 12 warns "may be used uninitialized" inside its own AVX-512 intrinsics (the _mm512_undefined_*
// pass-through operands of the unmasked forms): a known false positive, silenced for this header only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>

#include "sim/attention.h"
#include "sim/cpu.h"
#include "sim/parallel.h"
#include "sim/select.h"
#include "sim/stats.h"
#include "sim/version.h"

namespace kvsim {

const char* QuestionModeName(QuestionMode m) {
  return m == QuestionMode::kQueryAware ? "query_aware" : "query_agnostic";
}

int CompressEnd(const TraceMeta& meta, QuestionMode mode) {
  if (mode == QuestionMode::kQueryAware) return meta.prefill_length;
  for (int i = 0; i < meta.prefill_length; ++i)
    if (meta.tokens.role[i] == Role::kQuestion) return i;
  return meta.prefill_length;
}

std::vector<int32_t> PromptEntropyRegions(const TraceMeta& meta) {
  std::vector<int32_t> regions;
  for (QuestionMode mode : {QuestionMode::kQueryAgnostic, QuestionMode::kQueryAware})
    if (const int ce = CompressEnd(meta, mode); ce >= 1 && (regions.empty() || regions.back() < ce))
      regions.push_back(ce);
  return regions;
}

namespace {

// dst[i * ld + k] = src[k][off + i] for i, k < 8: an 8 x 8 tile of eight rows, transposed (a copy: every
// value unchanged). With AVX2 in registers (eight loads, the unpack / shuffle / lane-permute network, eight
// stores) instead of 64 scalar loads and stores.
inline void TransposeTile8(const float* const src[8], size_t off, float* dst, size_t ld) {
#ifdef __AVX2__
  __m256 r[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(src[k] + off);
  __m256 t[8], u[8];
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
    t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
  }
  for (int k = 0; k < 8; k += 4) {
    u[k] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ld, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ld, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
  }
#else
  for (int i = 0; i < 8; ++i)
    for (int k = 0; k < 8; ++k) dst[i * ld + k] = src[k][off + i];
#endif
}

struct RunPlan {
  const RunSpec* spec = nullptr;
  int index = 0;                            // position in Replay's `runs` (DecisionRecorder calls)
  std::shared_ptr<PolicyPlan> policy_plan;  // first-pass state, or null
  int compress_end = 0;
  int budget = 0;
  std::vector<int> layer_budgets;
  std::vector<int>
      head_budgets;  // [layer * Hkv + kv head]; every head of layer l: layer_budgets[l] if uniform
  std::map<std::string, std::vector<double>> run_layer_stats;  // Policy::PlannedLayerStats
  PolicyRequirements req;
  bool evicts = false;
  bool may_exceed = false;    // Policy::may_exceed_budget
  int compression_step = -1;  // Policy::compression_step
  int headroom = 0;           // Policy::decode_headroom
};

int BudgetTokens(const RunSpec& r, int compress_len) {
  if (r.budget_fraction > 0)
    return std::clamp(static_cast<int>(std::lround(r.budget_fraction * compress_len)), 1, compress_len);
  return std::min(r.budget_tokens, compress_len);
}

std::string RunName(const RunSpec& r) {
  std::string label = r.label.empty() ? r.policy->name() : r.label;
  return "run '" + label + "' (budget " +
         (r.budget_fraction > 0 ? std::to_string(r.budget_fraction)
                                : std::to_string(r.budget_tokens) + " tokens") +
         ")";
}

// Per (layer, KV head) lazily computed prompt scores, shared by every run of the pass.
class UnitScores final : public PromptScores {
 public:
  UnitScores(const TraceMeta& meta, const LayerData& layer, int kv_head, int compress_end)
      : meta_(meta), layer_(layer), kv_head_(kv_head), ce_(compress_end) {}

  std::span<const float> ColumnSums(int g) override {
    auto& slot = col_[g];
    if (slot.empty()) {
      const int qh = kv_head_ * meta_.model.GroupSize() + g;
      const int n = meta_.prefill_length;
      if (meta_.has_prefill_column_sums && ce_ == n) {
        // What the model computed (kvsim validate checks it against Q/K); avoids an O(n^2 d) recompute.
        const float* src = layer_.prefill_column_sums.data() + static_cast<size_t>(qh) * n;
        slot.assign(src, src + n);
      } else {  // CheckRuns guarantees the queries are there
        KVSIM_CHECK(meta_.HasAllPromptQueries());
        slot.assign(ce_, 0.0f);
        std::vector<int32_t> pos(ce_);
        std::iota(pos.begin(), pos.end(), 0);
        AccumulateColumnSums(meta_.model, Query(qh, 0, ce_), pos.data(), ce_, Keys(), ce_, slot.data());
      }
    }
    return slot;
  }

  std::span<const float> WindowColumnSums(int g, int window) override {
    window = std::min(window, ce_);
    auto& slot = win_[{g, window}];
    if (slot.empty()) {
      const int qh = kv_head_ * meta_.model.GroupSize() + g;
      slot.assign(ce_, 0.0f);
      std::vector<int32_t> pos(window);
      std::iota(pos.begin(), pos.end(), ce_ - window);
      AccumulateColumnSums(meta_.model, Query(qh, meta_.QueryIndex(ce_ - window), window), pos.data(), window,
                           Keys(), ce_, slot.data());
    }
    return slot;
  }

 private:
  // Rows [qi, qi + rows) of query head qh (checked: read and stored).
  const float* Query(int qh, int qi, int rows) const {
    KVSIM_CHECK(qi >= 0);
    return layer_.HeadQueries(meta_, qh, qi, qi + rows) + static_cast<size_t>(qi) * meta_.model.head_dim;
  }
  const float* Keys() const {
    return layer_.keys.data() + static_cast<size_t>(kv_head_) * meta_.total_tokens() * meta_.model.head_dim;
  }
  const TraceMeta& meta_;
  const LayerData& layer_;
  int kv_head_, ce_;
  std::map<int, std::vector<float>> col_;
  std::map<std::pair<int, int>, std::vector<float>> win_;
};

// Whole-trace accumulators of one run. Per-sample arrays are indexed ((layer * H + head) * S + step).
struct RunAccum {
  std::vector<float> retained, anchor, covered, err, regret;  // anchor: merged slots' anchors' mass
  std::vector<double> ret_mod, full_mod;          // [(layer * H + head) * 4 + modality], summed over steps
  std::vector<int64_t> bound_checks, bound_viol;  // [layer * Hkv + unit]
  // Σ over samples with a visible merged slot of (merged slots' weight / their tokens' full mass), and how
  // many such samples: [layer * Hkv + unit].
  std::vector<double> merged_share_sum;
  std::vector<int64_t> merged_share_n;
  std::vector<int32_t> kept_mod;     // [(layer * Hkv + unit) * 4 + modality] after the compression event
  std::vector<int32_t> prompt_kept;  // [layer * Hkv + unit] compressible-prompt slots after compression
  std::vector<int32_t> merged_tokens, merged_slots, merge_max;  // [layer * Hkv + unit] at the end
  std::vector<int32_t> tokens;                                  // [(layer * Hkv + unit) * (S + 1) + event]
};

struct UnitWork {
  HeadContext ctx;
  std::unique_ptr<UnitScores> scores;
  // HeadContext::shared of the unit's runs (the merging runs' similarity memo), freed with the unit.
  std::unique_ptr<UnitShared> shared;
  std::vector<DecodeReference> refs;  // per group member
  int kpre = 0;                       // the largest k of top_sum / sums (see RegretSums)
  bool use_sums = false;              // the top-k sums come from `sums`, not `top_sum`
  // With use_sums: `sums` is not built; each run's k and retained mass per row wait in dk / dret ([r][g][t];
  // k -1: none) until the unit's runs have all finished their steps, then every row's k are answered
  // together (FinishRegret). When some run asks the k-th largest value (FullKth: the oracle), `buckets`
  // keeps each row's bucket counts (row g * steps + t) for it, and FinishRegret takes them too.
  bool defer = false;
  bool kth_buckets = false;
  std::vector<int32_t> dk;
  std::vector<double> dret;
  RowBuckets buckets;
  TopKSums sums;                // row g * steps + t: Σ of the k largest, as if added in descending order
  std::vector<double> top_sum;  // [g][t][kpre + 1]: Σ of the k largest, added in descending order
  std::vector<double> top_all;  // [g][t]: Σ of every visible probability, added in descending order
  // Top-k sums for any k (row g * steps + t), for the runs with no cap below T (see AllSums): built on the
  // first k above kpre, shared by the unit's runs.
  std::unique_ptr<std::once_flag> all_once;
  TopKSums all_sums;
  std::vector<float> max_vnorm;  // [t]
  // The reference probabilities transposed, [g][T][S] (+ kMemberChunk floats of padding): a merged slot's
  // member sums of several steps read each member's steps contiguously (see MemberSums), and so do a
  // prefix-closed run's deferred plain-slot sums (FlushPrefixSums) and its output product's rows (FinishRun).
  // Built on first use (ProbsT; a unit whose runs need none of these never builds it), shared read-only by
  // the unit's runs; its memory goes back to PassBuffers with the unit's.
  std::unique_ptr<SharedBuild> probs_t_build;
  std::vector<float> probs_t;
  // The decode tokens' part of the reference outputs, [g][S][d]: Y_t = Σ_{j=n}^{n+S-1} p_t[j] v_j (one
  // product over the decode columns of the reference probabilities; zeros past step t's position). A run
  // whose every step holds every visible decode token as itself adds it to its own product over the other
  // slots (FinishRun, DecodePart). Built on first use, shared read-only by the unit's runs.
  std::unique_ptr<std::once_flag> decode_part_once;
  std::vector<float> decode_part;
  // Rank bands (FinishRun): sums of a ranked run's first bands, kept for the unit's other runs whose
  // columns begin with the same tokens in the same order. A chain's sums are (m, Σ of bands 0 .. m - 1 added
  // in order, [g·S][d]), ascending in m; its order holds the tokens of its largest m's bands. Under
  // band_mutex.
  using BandSum = std::pair<size_t, std::shared_ptr<const std::vector<float>>>;
  struct BandChain {
    std::vector<int32_t> order;
    std::vector<BandSum> sums;
  };
  std::unique_ptr<std::mutex> band_mutex;
  std::vector<BandChain> band_chains;
  std::vector<double> full_mod;                       // [g][t][4]
  std::vector<std::unique_ptr<HeadPolicy>> policies;  // per run
  std::vector<HeadCache> caches;                      // per run
  std::vector<int> prefill_size;                      // per run: cache slots after the prefill event
  struct Checked {                                    // per run: what CheckCache saw last
    uint64_t rewrites = ~uint64_t{0};                 // HeadCache::rewrites() (never: ~0)
    uint64_t appends = 0;                             // HeadCache::appends()
    int32_t max_token = -1;                           // the largest token any check saw
  };
  std::vector<Checked> checked;
};

// Scratch of one worker, reused across the (KV head, run) items it replays.
struct WorkerScratch {
  std::vector<uint32_t> stamp;  // [T] for CheckCache
  uint32_t epoch = 0;
  std::vector<float> cache_probs;       // [g][slots] of the current step
  std::vector<float> sorted;            // TopKSums::Sum's bucket
  std::vector<const float*> full_rows;  // [g] Step's reference rows of its step (StepAttention::full)
  // The steps' plain visible slots (token positions), step t's in [step_begin[t], step_begin[t + 1]).
  std::vector<int32_t> plain;
  std::vector<size_t> step_begin;
  // While `prefix`: every slot of every step so far was visible and the cache changed only by appending
  // tokens newer than the previous step's position (its version unchanged since step 0), so step t's plain
  // slots are the first (step_begin[t + 1] - step_begin[t]) tokens of `ptok` (the latest step's plain
  // slots, in slot order) and `plain` stays empty. The cache may hold merged slots (a policy that merged
  // before step 0 and keeps its merges, e.g. MEDA's paper variant and LOOK-M): they are not plain, and the
  // same at every step. The first step that breaks this writes the earlier steps into `plain`
  // (ExpandPrefix), and the run continues as before.
  bool prefix = false;
  uint64_t prefix_version = 0;
  std::vector<int32_t> ptok;
  int pslots = 0;  // the cache's slots at the latest prefix step (appended slots are those beyond)
  // Steps [0, deferred) were prefix-closed and their plain-slot sums (and every metric Step derives from
  // them) are not computed yet: FlushPrefixSums computes them for all those steps at once, when the run
  // stops being prefix-closed or in FinishRun. Only for runs whose policy does not read the step's
  // attention (PolicyRequirements::decode_attention): nothing else reads the sums before the run ends.
  int deferred = 0;
  std::vector<int> pcount;       // [t] step t's slots (FlushPrefixSums)
  std::vector<double> psums;     // [t][4][4] step t's PlainSlotSums (FlushPrefixSums)
  std::vector<double> wsum;      // [g][t] Σ_s w_s over visible slots
  std::vector<double> retained;  // [g][t]
  std::vector<char> checked;     // [t]: the bound is checked (no merged slot in the cache)
  std::vector<char> has_extra;   // [t]: a merged slot was visible
  std::vector<float> extra;      // [g][t][d] Σ w_s ṽ_s over visible merged slots
  std::vector<int32_t> col;      // [T] column of a token in the compact product, -1 if unused
  std::vector<int32_t> used;     // columns' tokens, ascending
  struct TokenRun {
    int32_t first, len, at;  // tokens first .. first + len - 1, from ws.plain[at]
  };
  std::vector<TokenRun> runs;  // FinishRun: the steps' lists as runs of consecutive tokens (when few)
  // While `runs_live`, `runs` holds the runs of the steps [0, runs_steps) written into `plain` so far, found
  // as each step's list is written (AddStepRuns: the list still in cache) instead of in another pass over
  // all of them in FinishRun; given up (cleared, FinishRun finds them) once they are more than one per 16
  // listed tokens.
  bool runs_live = false;
  int runs_steps = 0;
  std::vector<float> a, vu, out;  // the compact product: [g*S][|U|] x [|U|][d] = [g*S][d]
  // A ranked run's columns in rank order, their sort keys, and its band sums (FinishRun, RankBands).
  std::vector<int32_t> order;
  std::vector<uint64_t> rank_keys, rank_tmp;
  std::vector<std::pair<size_t, std::shared_ptr<const std::vector<float>>>> band_sums;  // (bands, their sum)
  std::vector<size_t> band_wanted;   // band counts other runs may resume at (WantedBands)
  std::vector<int32_t> hold;         // [T + 1] PositionOrder's difference array (zero between uses)
  std::vector<int32_t> span;         // [|U|] consecutive tokens in consecutive columns from column c on
  std::vector<const float*> band_v;  // FinishRun: each band product's value rows (in V, or in vu)
  std::vector<const float*> band_a;  // FinishRun: each band product's A, in p's rows (see there)
  // Merged slots in bulk (see BeginMergedBlock): while the cache's version is unchanged, its merged slots
  // (keys, values, slot indices) are too, so the dots of steps [mt0, mt0 + mrows) with them are one product
  // per group member and their values' output contribution another, added to `extra` when the block ends.
  uint64_t prev_version = 0;   // the cache's version at the previous step's attention
  uint64_t mversion = 0;       // the version the block was built for
  int mt0 = -1;                // first step of the block; -1: no block
  int mt_end = -1;             // one past the last step the block's weights were written for
  int mrows = 0;               // steps the block covers: [mt0, mt0 + mrows)
  int mlen = 0;                // steps the next block covers at most (adapts to how long blocks last)
  std::vector<int32_t> mslot;  // [M] the merged slots (column c's slot), in slot order
  std::vector<float> mk, mv;   // [M][d] the merged keys / values, in slot order
  std::vector<float> mdot;     // [g][mrows][M] q_t . k_m
  std::vector<float> mw;       // [g][mrows][M] the steps' merged weights (0 when not visible)
  // The chunk of steps [ms0, ms0 + kMemberChunk) Step asked MemberSums for last; ms0 = -1: none. The
  // block's member sums of steps [mb0, mb0 + mbrows) (see MemberSums); mb0 = -1: none.
  int ms0 = -1, mb0 = -1, mbrows = 0;
  std::vector<double> msum;   // [g][mbrows][M]
  std::vector<float> macc;    // [4][mbrows]: MemberSums' float lanes of one slot
  std::vector<size_t> mmem0;  // [M + 1]: merged slot c's members are mmem[mmem0[c] .. mmem0[c + 1])
  std::vector<int32_t> mmem;  // the block's merged slots' members (tokens), slot by slot
  // The block's steps [cs0, cs_end) (within the member sums' chunk) summed over the cache's first cslots
  // slots by MergedSlotSumsSteps, per group member ([g][kMemberChunk]), their weights already in mw (see
  // ChunkSlotSums); cs0 = -1: none.
  int cs0 = -1, cs_end = -1, cslots = 0;
  std::vector<MergedSlotSumsResult> csums;
  // The step's merged slots in slot order (outside a block; in one: mslot) and, per group member, their
  // weights and member sums (entries of masked slots are not written): MergedSlotSums' input.
  std::vector<int32_t> step_mslot;
  std::vector<float> step_mw;
  std::vector<float> step_dot;  // the step's dots with the merged keys (outside a block)
  std::vector<double> step_members;
};

// Steps whose merged slots' member sums are computed together (one AVX2 register pair per member).
constexpr int kMemberChunk = 16;
// Tokens per piece of ProbsT's transpose (a multiple of 8: whole 8 x 8 tiles).
constexpr int kProbsTTokens = 256;

// Buffers that outlive one LayerPass (owned by Replay, reused by every layer): the worker scratch and the
// units' largest buffers, the full-attention references (probabilities [S][T]: 1.7 MB per query head on
// the demo trace) and the top-k sums. They were allocated per (layer, KV head) and freed by the unit's last
// run; glibc handed those pages back to the kernel, so each unit faulted them in (zeroed) again. Here a
// finished unit's buffers go back to the pool and the next unit's Prefill takes them: the pool holds at most
// the buffers of the units alive at once (one chunk plus one per worker, see LayerPass::Run), as before.
// Results do not depend on what a buffer held: ComputeDecodeReference overwrites every field of a
// reference, and the top-k sums are cleared before their rows are added.
struct UnitBuffers {
  std::vector<DecodeReference> refs;
  TopKSums sums, all_sums;
  RowBuckets buckets;
  std::vector<float> probs_t;
};
class PassBuffers {
 public:
  std::vector<WorkerScratch> scratch;  // per worker

  UnitBuffers Take() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) return {};
    UnitBuffers b = std::move(free_.back());
    free_.pop_back();
    return b;
  }
  void Give(UnitBuffers&& b) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(b));
  }
  // The merges' storage of run `run`'s finished caches (HeadCache::TakeMergeStorage), for its caches of later
  // units (AdoptMergeStorage): a merging policy then allocates nothing per merged slot once its first units
  // are done (round 18: the allocator was ≈ 4% of the 45-run sweep). Kept per run, so a run that never
  // merges holds none, and a run's storage fits its own policy; empty storage is not kept.
  void GiveMergeStorage(int run, std::vector<MergedSlot>&& storage) {
    if (storage.empty()) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (merge_free_.size() <= static_cast<size_t>(run)) merge_free_.resize(run + 1);
    merge_free_[run].push_back(std::move(storage));
  }
  std::vector<MergedSlot> TakeMergeStorage(int run) {
    std::lock_guard<std::mutex> lock(mu_);
    if (merge_free_.size() <= static_cast<size_t>(run) || merge_free_[run].empty()) return {};
    std::vector<MergedSlot> storage = std::move(merge_free_[run].back());
    merge_free_[run].pop_back();
    return storage;
  }

 private:
  std::mutex mu_;
  std::vector<UnitBuffers> free_;
  std::vector<std::vector<std::vector<MergedSlot>>> merge_free_;  // [run]
};

// v.size() >= n: the buffer only grows. Its first n elements are then written in full by the caller, so
// what the rest holds, and what a smaller size would have been, does not matter; `resize` would zero-fill
// the part that grows back each time a run needs more than the previous one.
template <typename T>
void GrowTo(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

std::atomic<bool> g_kth_from_sums{true};   // SetFullKthFromSumsForTesting
std::atomic<bool> g_defer_sums{true};      // SetDeferredTopKSumsForTesting
std::atomic<bool> g_defer_kth{true};       // SetDeferredKthUnitsForTesting
std::atomic<bool> g_exact_row_sums{true};  // SetExactRowSumsForTesting
std::atomic<bool> g_run_lists{true};       // SetRunListsForTesting
std::atomic<bool> g_in_place_v{true};      // SetInPlaceValueRowsForTesting
std::atomic<bool> g_union_scan{true};      // SetUnionScanForTesting
std::atomic<bool> g_merged_prefix{true};   // SetMergedPrefixForTesting
std::atomic<bool> g_chunk_sums{true};      // SetChunkSlotSumsForTesting
std::atomic<bool> g_decode_part{true};     // SetSharedDecodePartForTesting
std::atomic<bool> g_rank_bands{true};      // SetOutputBandsForTesting
std::atomic<bool> g_band_memo{true};       // SetRankBandMemoForTesting
std::atomic<bool> g_step0_split{true};     // SetStepZeroSplitForTesting
std::atomic<int64_t> g_step0_splits{0};    // StepZeroSplitsForTesting
std::atomic<bool> g_held_by_runs{true};    // SetHeldByRunsForTesting
std::atomic<bool> g_step_runs{true};       // SetStepRunsForTesting
std::atomic<bool> g_in_place_a{true};      // SetInPlaceProbRowsForTesting
std::atomic<bool> g_whole_rows{true};      // SetWholeRowSumsForTesting
std::atomic<int64_t> g_whole_row_runs{0};  // WholeRowSumsForTesting
std::atomic<bool> g_row_flush{true};       // SetRowFlushForTesting
std::atomic<int64_t> g_row_flushes{0};     // RowFlushesForTesting
// A prefix-closed run's deferred steps are summed from their own rows when they are at most this many
// (FlushPrefixSums), not from the unit's transposed probabilities.
constexpr int kRowFlushSteps = 8;
// A ranked run's output product is added in bands of this many columns (FinishRun).
constexpr size_t kRankBand = 64;

}  // namespace

// PrefixSlotSums (replay.h). The sums of all steps live in memory, [j][mo][t] (contiguous in steps), and each
// slot, in slot order, adds its token's transposed row pt[tok][t] for the steps t that hold it (t >= the
// first step whose count exceeds the slot: a contiguous range, one vectorised loop of float-to-double adds).
// Each (t, j, mo) sum gets the additions PlainSlotSums makes, in its order (slot order), from +0.0; the +0.0
// that PlainSlotSums' AVX2 path adds to the other modalities' sums changes none of them (see there), so
// nothing is added for those here. The per-step gather p_t[tok] and mod[tok] of every slot (load-bound,
// about 1.8 ns per slot and step) becomes one gather per slot for all steps.
void PrefixSlotSums(const int32_t* tk, const int* count, int steps, const float* pt, size_t stride,
                    const Modality* mod, double (*rm)[4][4]) {
  if (steps <= 0) return;
  thread_local std::vector<double> acc;
  const size_t ns = static_cast<size_t>(steps);
  acc.assign(16 * ns, 0.0);
  for (int t = 1; t < steps; ++t) KVSIM_CHECK_MSG(count[t] >= count[t - 1], "prefix step counts decrease");
  const int slots = count[steps - 1];
  int t0 = 0;  // the first step holding slot s
  for (int s = 0; s < slots; ++s) {
    while (count[t0] <= s) ++t0;
    const int32_t tok = tk[s];
    double* a = acc.data() + static_cast<size_t>((s & 3) * 4 + static_cast<int>(mod[tok])) * ns;
    const float* x = pt + static_cast<size_t>(tok) * stride;
    for (int t = t0; t < steps; ++t) a[t] += x[t];
  }
  for (int t = 0; t < steps; ++t)
    for (int j = 0; j < 4; ++j)
      for (int mo = 0; mo < 4; ++mo) rm[t][j][mo] = acc[static_cast<size_t>(j * 4 + mo) * ns + t];
}

namespace {

#ifdef __AVX2__
// pt in the lane of modality `mo`, +0.0 in the other three: the modality-sum registers of PlainSlotSums and
// MergedSlotSums add it to all four lanes at once.
inline __m256d OnlyInLane(float pt, Modality mo) {
  static_assert(kNumModalities == 4);
  alignas(32) static constexpr int64_t kLane[4][4] = {
      {-1, 0, 0, 0}, {0, -1, 0, 0}, {0, 0, -1, 0}, {0, 0, 0, -1}};
  const __m256i lane = _mm256_load_si256(reinterpret_cast<const __m256i*>(kLane[static_cast<int>(mo)]));
  return _mm256_and_pd(_mm256_set1_pd(pt), _mm256_castsi256_pd(lane));
}
#endif

// PlainSlotSums' four lanes combined: ret_mod[mo] = (rm[0][mo] + rm[1][mo]) + (rm[2][mo] + rm[3][mo]), and
// the retained mass (ret_mod[0] + ret_mod[1]) + (ret_mod[2] + ret_mod[3]) returned.
double CombineSlotSums(const double rm[4][4], double ret_mod[4]) {
  for (int mo = 0; mo < 4; ++mo) ret_mod[mo] = (rm[0][mo] + rm[1][mo]) + (rm[2][mo] + rm[3][mo]);
  return (ret_mod[0] + ret_mod[1]) + (ret_mod[2] + ret_mod[3]);
}

}  // namespace

// One past the last slot of the run of consecutive tokens that starts at slot i of pl[.. e): the first
// j > i with pl[j] != pl[j - 1] + 1, or e.
static inline size_t RunEnd(const int32_t* pl, size_t i, size_t e) {
  size_t j = i + 1;
#ifdef __AVX2__
  const __m256i one = _mm256_set1_epi32(1);
  for (; j + 8 <= e; j += 8) {
    const __m256i next =
        _mm256_add_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pl + j - 1)), one);
    const __m256i eq = _mm256_cmpeq_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pl + j)), next);
    const unsigned differ = ~static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(eq))) & 0xffu;
    if (differ != 0) return j + static_cast<size_t>(__builtin_ctz(differ));
  }
#endif
  while (j < e && pl[j] == pl[j - 1] + 1) ++j;
  return j;
}

// RowNorms (replay.h). Eight rows at a time: with AVX2 each 8 × 8 tile (eight rows, eight columns) is
// transposed in registers, so column k of the eight rows is one register, widened to two registers of four
// doubles and squared into them with one fused multiply-add (exact product, one rounding: the same value as
// the scalar square and add); each row's sum still adds over k in order. A strided load per element (what
// the compiler made of the scalar loop over eight rows) was ≈ 60% of Prefill's own time (issue 14, round 12).
void RowNorms(const float* x, int rows, int d, float* out) {
  int j = 0;
  for (; j + 8 <= rows; j += 8) {
    const float* src[8];
    for (int b = 0; b < 8; ++b) src[b] = x + static_cast<size_t>(j + b) * d;
    double s8[8] = {};
    int k = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256d lo = _mm256_setzero_pd(), hi = lo;
    alignas(32) float tile[64];
    for (; k + 8 <= d; k += 8) {
      TransposeTile8(src, static_cast<size_t>(k), tile, 8);
      for (int i = 0; i < 8; ++i) {
        const __m256 c = _mm256_load_ps(tile + 8 * i);
        const __m256d c0 = _mm256_cvtps_pd(_mm256_castps256_ps128(c));
        const __m256d c1 = _mm256_cvtps_pd(_mm256_extractf128_ps(c, 1));
        lo = _mm256_fmadd_pd(c0, c0, lo);
        hi = _mm256_fmadd_pd(c1, c1, hi);
      }
    }
    _mm256_storeu_pd(s8, lo);
    _mm256_storeu_pd(s8 + 4, hi);
#endif
    for (; k < d; ++k)
      for (int b = 0; b < 8; ++b) s8[b] += static_cast<double>(src[b][k]) * src[b][k];
    for (int b = 0; b < 8; ++b) out[j + b] = static_cast<float>(std::sqrt(s8[b]));
  }
  for (; j < rows; ++j) {
    const float* v = x + static_cast<size_t>(j) * d;
    double s1 = 0;
    for (int k = 0; k < d; ++k) s1 += static_cast<double>(v[k]) * v[k];
    out[j] = static_cast<float>(std::sqrt(s1));
  }
}

// MaxRowNorm (replay.h). A float pass bounds every row's sum of squares, then RowNorms' exact double sum
// runs only for the rows whose bound reaches the best lower bound. The proof:
// - a_j, the float sum (fused multiply-adds in eight lanes, the lanes added, the rest one at a time: at most
//   d + 1 roundings on any path (d < 2^22), each relative error <= u = 2^-24 for a normal result, and an
//   absolute error < 2^-149 per product for a subnormal one) is within gamma = (d + 1)u / (1 - (d + 1)u) of
//   the exact sum s_j, plus tiny = (d + 1) 2^-149; the double sum S_j (RowNorms: d additions in double) is
//   within d 2^-53 of s_j. With eps = (d + 2) 2^-23 (more than gamma + d 2^-53 + the double roundings below):
//   lo_j = (a_j - tiny)(1 - eps) <= S_j <= (a_j + tiny)(1 + eps) = hi_j; a float sum that overflowed (+inf)
//   gives lo_j = 0, hi_j = +inf.
// - Let L = max(0, max_i lo_i). If L = 0, every row is a candidate (hi_j >= 0). Otherwise L = lo_i at row i.
// ‖v_j‖ = float(sqrt(S_j)) is non-decreasing in S_j. If row i's norm
//   is the maximum V, row i has hi_i >= S_i >= L. Otherwise a row j with norm V > ‖v_i‖ has S_j > S_i >=
//   L, so hi_j > L. Either way a row with norm V has hi_j >= L: the candidates' maximum is V, bit for bit.
float MaxRowNorm(const float* x, int rows, int d) {
  if (rows <= 0) return 0.0f;
  thread_local std::vector<float> approx;
  approx.resize(rows);
  for (int j = 0; j < rows; ++j) {
    const float* v = x + static_cast<size_t>(j) * d;
    float a = 0.0f;
    int k = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (d >= 8) {
      __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
      for (; k + 16 <= d; k += 16) {
        const __m256 c0 = _mm256_loadu_ps(v + k), c1 = _mm256_loadu_ps(v + k + 8);
        acc0 = _mm256_fmadd_ps(c0, c0, acc0);
        acc1 = _mm256_fmadd_ps(c1, c1, acc1);
      }
      for (; k + 8 <= d; k += 8) {
        const __m256 c0 = _mm256_loadu_ps(v + k);
        acc0 = _mm256_fmadd_ps(c0, c0, acc0);
      }
      const __m256 acc = _mm256_add_ps(acc0, acc1);
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      a = _mm_cvtss_f32(h);
    }
#endif
    for (; k < d; ++k) a = std::fma(v[k], v[k], a);
    approx[j] = a;
  }
  const double eps = std::ldexp(static_cast<double>(d) + 2.0, -23);
  const double tiny = std::ldexp(static_cast<double>(d) + 1.0, -149);
  double best_lo = 0.0;
  for (int j = 0; j < rows; ++j)
    if (approx[j] <= std::numeric_limits<float>::max())
      best_lo = std::max(best_lo, (static_cast<double>(approx[j]) - tiny) * (1.0 - eps));
  float best = 0.0f;
  for (int j = 0; j < rows; ++j) {
    if (approx[j] <= std::numeric_limits<float>::max() &&
        (static_cast<double>(approx[j]) + tiny) * (1.0 + eps) < best_lo)
      continue;
    float norm;
    RowNorms(x + static_cast<size_t>(j) * d, 1, d, &norm);
    best = std::max(best, norm);
  }
  return best;
}

// MaxVisibleNorms (replay.h): a running maximum while the window starts at 0 (a maximum is exact, so this
// equals the search over the whole range); keys [0, n] at once by MaxRowNorm when no step's window moves.
void MaxVisibleNorms(const float* values, int n, int steps, int d, const int32_t* first, float* out) {
  if (steps <= 0) return;
  if (std::all_of(first, first + steps, [](int32_t f) { return f == 0; })) {
    std::vector<float> vnorm(steps);  // vnorm[t] = ‖v_{n + t}‖ for t >= 1
    if (steps > 1) RowNorms(values + static_cast<size_t>(n + 1) * d, steps - 1, d, vnorm.data() + 1);
    out[0] = MaxRowNorm(values, n + 1, d);
    for (int t = 1; t < steps; ++t) out[t] = std::max(out[t - 1], vnorm[t]);
    return;
  }
  std::vector<float> vnorm(static_cast<size_t>(n) + steps);
  RowNorms(values, n + steps, d, vnorm.data());
  for (int t = 0; t < steps; ++t) {
    const int prev_first = t > 0 ? first[t - 1] : -1;
    out[t] = first[t] == 0 && prev_first == 0
                 ? std::max(out[t - 1], vnorm[n + t])
                 : *std::max_element(vnorm.begin() + first[t], vnorm.begin() + n + t + 1);
  }
}

// PlainSlotSums (replay.h). With AVX2, lane j's four modality sums live in one register and every slot adds
// p[tok_s] masked to its modality (the others get +0.0): x + (+0.0) = x for every x these sums hold (they
// start at +0.0, and a NaN or infinity is masked to +0.0 outside its modality), so each sum gets the same
// additions in the same order as the scalar loop, whose rm[s & 3][mod] += p kept the sums in memory, every
// add waiting on the store four slots earlier (issue 14, round 8).
int PlainSlotSums(const int32_t* tk, int slots, const float* p, const Modality* mod, int first, float* cp,
                  double rm[4][4]) {
  int visible = 0, s = 0;
#ifdef __AVX2__
  // By modality: lane j of register `mo` is rm[j][mo]. Four slots s .. s + 3 (s ≡ 0 mod 4, so lane j is slot
  // s + j) add their four probabilities to each modality's register, masked to the lanes of that modality
  // (+0.0 elsewhere, which changes no sum, as above): each sum still gets its slots' values in slot order.
  // Four consecutive tokens (a sliding window's lists) load their p and modalities with one load each.
  __m256d m0 = _mm256_setzero_pd(), m1 = m0, m2 = m0, m3 = m0;  // named: kept in registers
  const __m128i step = _mm_setr_epi32(0, 1, 2, 3), before = _mm_set1_epi32(first - 1);
  for (; s + 4 <= slots; s += 4) {
    const __m128i t4 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tk + s));
    const int32_t t0 = tk[s];
    __m128 p4;
    __m256i mo4;
    if (_mm_movemask_epi8(_mm_cmpeq_epi32(t4, _mm_add_epi32(_mm_set1_epi32(t0), step))) == 0xffff) {
      p4 = _mm_loadu_ps(p + t0);
      uint32_t m;
      std::memcpy(&m, mod + t0, 4);
      mo4 = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(static_cast<int>(m)));
    } else {
      p4 = _mm_setr_ps(p[t0], p[tk[s + 1]], p[tk[s + 2]], p[tk[s + 3]]);
      mo4 = _mm256_setr_epi64x(static_cast<int64_t>(mod[t0]), static_cast<int64_t>(mod[tk[s + 1]]),
                               static_cast<int64_t>(mod[tk[s + 2]]), static_cast<int64_t>(mod[tk[s + 3]]));
    }
    if (cp) _mm_storeu_ps(cp + s, p4);
    visible +=
        std::popcount(static_cast<unsigned>(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(t4, before)))));
    const __m256d pd = _mm256_cvtps_pd(p4);
    auto in = [&](int64_t mo) {
      return _mm256_and_pd(pd, _mm256_castsi256_pd(_mm256_cmpeq_epi64(mo4, _mm256_set1_epi64x(mo))));
    };
    m0 = _mm256_add_pd(m0, in(0));
    m1 = _mm256_add_pd(m1, in(1));
    m2 = _mm256_add_pd(m2, in(2));
    m3 = _mm256_add_pd(m3, in(3));
  }
  static_assert(kNumModalities == 4);
  alignas(32) double by_mod[4][4];
  _mm256_store_pd(by_mod[0], m0);
  _mm256_store_pd(by_mod[1], m1);
  _mm256_store_pd(by_mod[2], m2);
  _mm256_store_pd(by_mod[3], m3);
  for (int j = 0; j < 4; ++j)
    for (int mo = 0; mo < 4; ++mo) rm[j][mo] = by_mod[mo][j];
#endif
  for (; s < slots; ++s) {  // the tail (s & 3 continues the lanes), or every slot without AVX2
    const int32_t tok = tk[s];
    const float pt = p[tok];
    if (cp) cp[s] = pt;
    visible += tok >= first;
    rm[s & 3][static_cast<int>(mod[tok])] += pt;
  }
  return visible;
}

// MergedSlotSums (replay.h). The sums are locals the compiler keeps in registers: the loop has no calls (the
// merged slots' weights and member sums come precomputed), and runs of plain slots between two merged ones
// are a tight inner loop. With AVX2 the four modality sums live in one register and every plain slot adds
// p[tok] masked to its modality (the others get +0.0, which changes none of them: they start at +0.0 and
// a NaN or infinity is masked to +0.0 outside its modality), as in PlainSlotSums: each sum gets the same
// additions in the same order as the per-slot loop Step had (issue 14, round 9).
MergedSlotSumsResult MergedSlotSums(const int32_t* tk, int slots, const float* p, const Modality* mod,
                                    int first, const int32_t* merged, int num_merged, const float* mw,
                                    const double* members, float* cp) {
  double wsum = 0, retained = 0, anchor = 0, covered = 0, merged_w = 0, merged_mass = 0;
  int visible = 0;
#ifdef __AVX2__
  __m256d rm = _mm256_setzero_pd();
#else
  double rm[4] = {0, 0, 0, 0};
#endif
  // The plain slots [s0, s1).
  auto plain = [&](int s0, int s1) {
    for (int s = s0; s < s1; ++s) {
      const int32_t tok = tk[s];
      if (tok < first) continue;  // outside a sliding window: masked
      ++visible;
      const float pt = p[tok];
      retained += pt;
      covered += pt;
      wsum += pt;
#ifdef __AVX2__
      rm = _mm256_add_pd(rm, OnlyInLane(pt, mod[tok]));
#else
      rm[static_cast<int>(mod[tok])] += pt;
#endif
      if (cp) cp[s] = pt;
    }
  };
  int s = 0;
  for (int j = 0; j < num_merged; ++j) {
    const int sm = merged[j];
    plain(s, sm);
    s = sm + 1;
    if (tk[sm] < first) continue;
    ++visible;
    const float pt = p[tk[sm]], wgt = mw[j];
    const double mem = members[j];
    anchor += pt;  // its key and value were replaced: covered, not retained
    covered += pt;
    covered += mem;
    merged_w += wgt;
    merged_mass += pt + mem;
    wsum += wgt;
    if (cp) cp[sm] = wgt;
  }
  plain(s, slots);
  MergedSlotSumsResult r;
  r.wsum = wsum;
  r.retained = retained;
  r.anchor = anchor;
  r.covered = covered;
  r.merged_w = merged_w;
  r.merged_mass = merged_mass;
#ifdef __AVX2__
  _mm256_storeu_pd(r.ret_mod, rm);
#else
  std::copy_n(rm, 4, r.ret_mod);
#endif
  r.visible = visible;
  return r;
}

// MergedSlotSumsSteps (replay.h): the chains of MergedSlotSums (wsum, retained, anchor, covered, merged_w,
// merged_mass, one per modality), each a register of four steps' sums, every lane adding its step's values
// in slot order. A modality's sum gets only its own slots' values here, where MergedSlotSums' AVX2 path adds
// +0.0 to the three others: a sum that starts at +0.0 and adds values >= -0.0 is unchanged by adding +0.0.
void MergedSlotSumsSteps(const int32_t* tk, int slots, const float* pt, size_t stride, const Modality* mod,
                         const int32_t* merged, int num_merged, const float* mw, size_t mw_stride,
                         const double* members, size_t members_stride, int nsteps,
                         MergedSlotSumsResult* out) {
  constexpr int kAhead = 16;
  for (int i0 = 0; i0 < nsteps; i0 += 4) {
    const int nb = std::min(4, nsteps - i0);
    const float* p0 = pt + i0;
#ifdef __AVX2__
    __m256d wsum = _mm256_setzero_pd(), retained = wsum, anchor = wsum, covered = wsum, merged_w = wsum,
            merged_mass = wsum, rm0 = wsum, rm1 = wsum, rm2 = wsum, rm3 = wsum;
    auto plain = [&](int s0, int s1) {
      for (int s = s0; s < s1; ++s) {
        const int32_t tok = tk[s];
        // The slots' rows lie scattered over the transposed probabilities (beyond L2): the row kAhead slots
        // further is fetched while this one is added.
        __builtin_prefetch(p0 + static_cast<size_t>(tk[std::min(s + kAhead, slots - 1)]) * stride);
        const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(p0 + static_cast<size_t>(tok) * stride));
        retained = _mm256_add_pd(retained, v);
        covered = _mm256_add_pd(covered, v);
        wsum = _mm256_add_pd(wsum, v);
        switch (mod[tok]) {
          case Modality::kText:
            rm0 = _mm256_add_pd(rm0, v);
            break;
          case Modality::kImage:
            rm1 = _mm256_add_pd(rm1, v);
            break;
          case Modality::kVideo:
            rm2 = _mm256_add_pd(rm2, v);
            break;
          default:
            rm3 = _mm256_add_pd(rm3, v);
            break;
        }
      }
    };
    int s = 0;
    for (int j = 0; j < num_merged; ++j) {
      const int sm = merged[j];
      plain(s, sm);
      s = sm + 1;
      // The row kAhead slots further, as in `plain` (a cache of merged slots mostly, as at small budgets,
      // has few plain slots to do it).
      __builtin_prefetch(p0 + static_cast<size_t>(tk[std::min(sm + kAhead, slots - 1)]) * stride);
      const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(p0 + static_cast<size_t>(tk[sm]) * stride));
      // The steps' weights and member sums: lanes built in registers (a vector load of four scalar stores
      // would wait for them: no store forwarding); a short last group repeats its last step (unused).
      auto at = [&](int b) { return static_cast<size_t>(i0 + std::min(b, nb - 1)); };
      const __m256d w = _mm256_setr_pd(mw[at(0) * mw_stride + j], mw[at(1) * mw_stride + j],
                                       mw[at(2) * mw_stride + j], mw[at(3) * mw_stride + j]);
      const __m256d m =
          _mm256_setr_pd(members[at(0) * members_stride + j], members[at(1) * members_stride + j],
                         members[at(2) * members_stride + j], members[at(3) * members_stride + j]);
      anchor = _mm256_add_pd(anchor, v);
      covered = _mm256_add_pd(covered, v);
      covered = _mm256_add_pd(covered, m);
      merged_w = _mm256_add_pd(merged_w, w);
      merged_mass = _mm256_add_pd(merged_mass, _mm256_add_pd(v, m));
      wsum = _mm256_add_pd(wsum, w);
    }
    plain(s, slots);
    alignas(32) double l[10][4];
    _mm256_store_pd(l[0], wsum);
    _mm256_store_pd(l[1], retained);
    _mm256_store_pd(l[2], anchor);
    _mm256_store_pd(l[3], covered);
    _mm256_store_pd(l[4], merged_w);
    _mm256_store_pd(l[5], merged_mass);
    _mm256_store_pd(l[6], rm0);
    _mm256_store_pd(l[7], rm1);
    _mm256_store_pd(l[8], rm2);
    _mm256_store_pd(l[9], rm3);
    for (int b = 0; b < nb; ++b) {
      MergedSlotSumsResult& r = out[i0 + b];
      r.wsum = l[0][b];
      r.retained = l[1][b];
      r.anchor = l[2][b];
      r.covered = l[3][b];
      r.merged_w = l[4][b];
      r.merged_mass = l[5][b];
      for (int mo = 0; mo < 4; ++mo) r.ret_mod[mo] = l[6 + mo][b];
      r.visible = slots;
    }
#else
    std::vector<float> row;
    for (int b = 0; b < nb; ++b) {
      // A step's row of p over the tokens the slots hold (others stay 0: never read).
      int32_t hi = 0;
      for (int s = 0; s < slots; ++s) hi = std::max(hi, tk[s]);
      row.assign(static_cast<size_t>(hi) + 1, 0.0f);
      for (int s = 0; s < slots; ++s) row[tk[s]] = p0[static_cast<size_t>(tk[s]) * stride + b];
      out[i0 + b] = MergedSlotSums(tk, slots, row.data(), mod, 0, merged, num_merged,
                                   mw + (i0 + b) * mw_stride, members + (i0 + b) * members_stride, nullptr);
    }
#endif
  }
}

void MergedSlotSumsAppend(const int32_t* tk, int n, const float* p, const Modality* mod,
                          MergedSlotSumsResult* r) {
  for (int s = 0; s < n; ++s) {
    const float pt = p[tk[s]];
    r->retained += pt;
    r->covered += pt;
    r->wsum += pt;
    r->ret_mod[static_cast<int>(mod[tk[s]])] += pt;
    ++r->visible;
  }
}

// MergedWeights (replay.h). Why the AVX2 path returns std::exp's float, for x = double(tf(dot)) - lse in
// [-87, 80] (everything else goes to std::exp):
// - Reduction: k = round(fl(x log2 e)), |k| <= 126, and r = x - k ln2 as r1 = x - k L1 (one fused
//   operation, exact: L1 = 0x1.62e42feep-1 has 32 significant bits, so k L1 is a multiple of 2^-33, x one of
//   2^-54 when k != 0 (|x| > 0.34), and |x - k L1| < 0.35 < 2^-1: 53 bits) then r = fl(r1 - k L2): error
//   <= 2^-55 + 126 |ln2 - L1 - L2| < 2^-54.9, |r| < 0.3466.
// - e^r by the Taylor polynomial of degree 13 in Horner form with fused multiply-adds: truncation
//   <= 0.35^14 e^0.35 / 14! < 2^-57; rounding <= u Σ_i |r|^i q_i (q_i <= e^0.35 / i!: the partial Horner
//   values) < 1.95 u, u = 2^-53; the coefficients' rounding (1/n!, n >= 3) < 0.01 u. So
//   |p - e^r| < 2^-52 with p >= 0.7: relative < 1.43·2^-52, plus the reduction's 2^-54.9 < 0.14·2^-52.
// - y = p 2^k is exact (k in [-126, 116]: normal doubles) and |y - e^x| < 1.6·2^-52 y <= 3.2 ulp(y).
// glibc's exp is within 1 ulp of e^x (0.51 ulp in its source; libm-test-ulps lists at most 1). The float
// nearest y changes only at a midpoint between two floats, where y's 29 bits below the float's 24 are
// 2^28; if they differ from 2^28 by more than 64 (y's ulps), every double within 60 ulp of y (e^x and
// glibc's value among them; a midpoint is 2^28 ulp from a binade's ends) rounds to the same float: that
// of y, as _mm256_cvtpd_ps rounds (to nearest, like static_cast<float>). [-87, 80] keeps e^x a normal
// float (>= 2^-126 > e^-87.4, < 2^127). Lanes within 64 ulp of a midpoint call std::exp.
// On a CPU with AVX-512 (issue 14, round 27), eight at a time: the same operations on eight double lanes
// (AVX-512 F), so the same y, the same safe lanes and the same floats; the AVX2 loop takes the rest.
#if defined(__AVX2__) && defined(__FMA__) && defined(__x86_64__) && defined(__GNUC__)
#define KVSIM_WEIGHTS_AVX512 1
namespace {
const bool kWeightsAvx512 = CpuHas(CpuFeature::kAvx512f);
std::atomic<bool> g_weights_avx512_allowed{true};

__attribute__((target("avx512f"))) int MergedWeightsAvx512(const float* dots, int n, const LogitTransform& tf,
                                                           float lse, float* out) {
  const __m256 scale = _mm256_set1_ps(tf.scale);
  const __m512d l = _mm512_set1_pd(static_cast<double>(lse));
  const __m512d lo = _mm512_set1_pd(-87.0), hi = _mm512_set1_pd(80.0);
  const __m512d log2e = _mm512_set1_pd(0x1.71547652b82fep0);
  const __m512d l1 = _mm512_set1_pd(0x1.62e42feep-1), l2 = _mm512_set1_pd(0x1.a39ef35793c76p-33);
  static constexpr double kC[12] = {1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
                                    1.0 / 362880.0,     1.0 / 40320.0,     1.0 / 5040.0,     1.0 / 720.0,
                                    1.0 / 120.0,        1.0 / 24.0,        1.0 / 6.0,        0.5};
  const __m512i low_mask = _mm512_set1_epi64((int64_t{1} << 29) - 1);
  const __m512i near0 = _mm512_set1_epi64((int64_t{1} << 28) - 64), width = _mm512_set1_epi64(128);
  const __m512i bias = _mm512_set1_epi64(1023);
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m512d x = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_mul_ps(_mm256_loadu_ps(dots + j), scale)), l);
    const __mmask8 in = _mm512_cmp_pd_mask(x, lo, _CMP_GE_OQ) & _mm512_cmp_pd_mask(x, hi, _CMP_LE_OQ);
    const __m512d xc = _mm512_maskz_mov_pd(in, x);
    const __m512d kd =
        _mm512_roundscale_pd(_mm512_mul_pd(xc, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d r = _mm512_fnmadd_pd(kd, l1, xc);
    r = _mm512_fnmadd_pd(kd, l2, r);
    __m512d p = _mm512_set1_pd(kC[0]);
    for (int c = 1; c < 12; ++c) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(kC[c]));
    p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(1.0));
    p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(1.0));
    const __m512i k = _mm512_cvtepi32_epi64(_mm512_cvtpd_epi32(kd));
    const __m512d y = _mm512_mul_pd(p, _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_add_epi64(k, bias), 52)));
    const __m512i t = _mm512_sub_epi64(_mm512_and_si512(_mm512_castpd_si512(y), low_mask), near0);
    const __mmask8 far =
        _mm512_cmpgt_epi64_mask(t, width) | _mm512_cmpgt_epi64_mask(_mm512_setzero_si512(), t);
    const unsigned safe = in & far;
    _mm256_storeu_ps(out + j, _mm512_cvtpd_ps(y));
    if (safe != 0xFF)
      for (int i = 0; i < 8; ++i)
        if (!(safe >> i & 1))
          out[j + i] = static_cast<float>(std::exp(static_cast<double>(tf(dots[j + i])) - lse));
  }
  return j;
}
}  // namespace
#endif

void SetMergedWeightsAvx512ForTesting(bool allowed) {
#ifdef KVSIM_WEIGHTS_AVX512
  g_weights_avx512_allowed.store(allowed, std::memory_order_relaxed);
#else
  (void)allowed;
#endif
}

void MergedWeights(const float* dots, int n, const LogitTransform& tf, float lse, float* out) {
  int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (!(tf.softcap > 0)) {  // tf(dot) = dot * scale, in float
#ifdef KVSIM_WEIGHTS_AVX512
    if (kWeightsAvx512 && g_weights_avx512_allowed.load(std::memory_order_relaxed))
      j = MergedWeightsAvx512(dots, n, tf, lse, out);
#endif
    const __m128 scale = _mm_set1_ps(tf.scale);
    const __m256d l = _mm256_set1_pd(static_cast<double>(lse));
    const __m256d lo = _mm256_set1_pd(-87.0), hi = _mm256_set1_pd(80.0), zero = _mm256_setzero_pd();
    const __m256d log2e = _mm256_set1_pd(0x1.71547652b82fep0);
    const __m256d l1 = _mm256_set1_pd(0x1.62e42feep-1), l2 = _mm256_set1_pd(0x1.a39ef35793c76p-33);
    // 1/n!, n = 13 .. 2 (rounded to double), then 1 and 1.
    static constexpr double kC[12] = {1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0,
                                      1.0 / 3628800.0,    1.0 / 362880.0,    1.0 / 40320.0,
                                      1.0 / 5040.0,       1.0 / 720.0,       1.0 / 120.0,
                                      1.0 / 24.0,         1.0 / 6.0,         0.5};
    const __m256i low_mask = _mm256_set1_epi64x((int64_t{1} << 29) - 1);
    const __m256i near0 = _mm256_set1_epi64x((int64_t{1} << 28) - 64), width = _mm256_set1_epi64x(128);
    const __m256i bias = _mm256_set1_epi64x(1023);
    for (; j + 4 <= n; j += 4) {
      const __m256d x = _mm256_sub_pd(_mm256_cvtps_pd(_mm_mul_ps(_mm_loadu_ps(dots + j), scale)), l);
      const __m256d in = _mm256_and_pd(_mm256_cmp_pd(x, lo, _CMP_GE_OQ), _mm256_cmp_pd(x, hi, _CMP_LE_OQ));
      const __m256d xc = _mm256_blendv_pd(zero, x, in);
      const __m256d kd =
          _mm256_round_pd(_mm256_mul_pd(xc, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m256d r = _mm256_fnmadd_pd(kd, l1, xc);
      r = _mm256_fnmadd_pd(kd, l2, r);
      __m256d p = _mm256_set1_pd(kC[0]);
      for (int c = 1; c < 12; ++c) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(kC[c]));
      p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0));
      p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0));
      const __m256i k = _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(kd));
      const __m256d y =
          _mm256_mul_pd(p, _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_add_epi64(k, bias), 52)));
      // Safe lanes: in range and the low 29 bits outside [2^28 - 64, 2^28 + 64].
      const __m256i t = _mm256_sub_epi64(_mm256_and_si256(_mm256_castpd_si256(y), low_mask), near0);
      const __m256i far =
          _mm256_or_si256(_mm256_cmpgt_epi64(t, width), _mm256_cmpgt_epi64(_mm256_setzero_si256(), t));
      const int safe = _mm256_movemask_pd(_mm256_and_pd(in, _mm256_castsi256_pd(far)));
      _mm_storeu_ps(out + j, _mm256_cvtpd_ps(y));
      if (safe != 0xF)
        for (int i = 0; i < 4; ++i)
          if (!(safe >> i & 1))
            out[j + i] = static_cast<float>(std::exp(static_cast<double>(tf(dots[j + i])) - lse));
    }
  }
#endif
  for (; j < n; ++j) out[j] = static_cast<float>(std::exp(static_cast<double>(tf(dots[j])) - lse));
}

namespace {

class LayerPass {
 public:
  LayerPass(const TraceMeta& meta, const LayerData& layer, std::span<const RunPlan> plans,
            std::vector<RunAccum>& acc, int threads, DecisionRecorder* recorder, PassBuffers& buffers)
      : meta_(meta),
        m_(meta.model),
        layer_(layer),
        plans_(plans),
        acc_(acc),
        threads_(threads),
        recorder_(recorder),
        buffers_(buffers),
        scratch_(buffers.scratch) {}

  // Two kinds of work item over the layer's work units. Prefill: per KV head, the full-attention reference
  // (shared by every run) and every run's compression hook (runs share the head's prompt scores). Decode:
  // per (KV head, run), every decode step in event order, then the outputs of all steps at once. Each item
  // writes only its own accumulator slots, so results never depend on the thread count or on scheduling.
  //
  // The KV heads go in chunks of a few heads (twice the workers): the item list is each chunk's Prefill
  // items, then its decode items, chunk after chunk, handed out in that order by one ParallelForWorkers
  // with no barrier between phases or chunks. A decode item waits (rarely: its Prefill was handed out at
  // least a chunk's other Prefill items earlier) until its head's Prefill is done, and a head's reference
  // and scores are freed by the last of its runs to finish. So the next chunk's Prefill runs while the
  // current chunk's last decode items finish (a barrier per phase left a worker idle behind the longest
  // item). What is resident stays O(chunk) units' state: at most the units whose Prefill was handed out and
  // whose decode items were not all handed out (one chunk) plus those with an item in flight (one per
  // worker), not every unit's state of every run at once (a 45-run sweep held 32 heads x 45 runs of caches
  // over a whole layer before chunking).
  void Run() {
    const int hkv = m_.num_kv_heads, runs = static_cast<int>(plans_.size());
    const int workers = threads_ > 0 ? threads_ : DefaultThreads();
    const int chunk = std::min(hkv, 2 * workers);
    units_.resize(hkv);
    scratch_.resize(std::max(1, std::min(workers, chunk * (runs + 1))));
    struct Item {
      int u, r;  // r < 0: Prefill(u)
    };
    std::vector<Item> items;
    items.reserve(static_cast<size_t>(hkv) * (runs + 1));
    // A unit's decode items by ascending budget (plan order among equal budgets): a policy that compresses
    // in its decode item (MEDA OFFICIAL_CODE, at step 0) then finds its smaller budgets' similarity answers
    // stored (the merge memo, policies/merge.cc) once their runs are done. Only the work depends on the
    // order; every run's results are its own.
    std::vector<int> order(runs);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return plans_[a].budget < plans_[b].budget; });
    // One policy that compresses the prompt in its decode item (compression_step() >= 0: MEDA's official
    // code) at consecutive budgets: the chunk's decode items go budget-major, every unit's run at one budget
    // before any unit's at the next. A unit's next budget is then handed out `nu` items after its previous
    // one, which has usually finished and stored its merge-memo answers; in unit-major order the two runs
    // went to the two workers at once and both searched (MEDA's official code x 4 budgets, 2 threads: about
    // 15% less wall time; issue 14, round 28). Otherwise unit-major, each worker staying on one unit's data:
    // a policy that compresses in its Prefill item does so for all its runs there, and budget-major order
    // cost MEDA and LOOK-M (paper) x 4 budgets 1-14% more wall time.
    bool budget_major = false;
    for (size_t i = 0; i + 1 < order.size(); ++i) {
      const Policy& p = *plans_[order[i]].spec->policy;
      budget_major =
          budget_major || (&p == plans_[order[i + 1]].spec->policy.get() && p.compression_step() >= 0);
    }
    for (int u0 = 0; u0 < hkv; u0 += chunk) {
      const int nu = std::min(chunk, hkv - u0);
      for (int u = u0; u < u0 + nu; ++u) items.push_back({u, -1});
      if (budget_major) {
        for (int r : order)
          for (int u = u0; u < u0 + nu; ++u) items.push_back({u, r});
      } else {
        for (int u = u0; u < u0 + nu; ++u)
          for (int r : order) items.push_back({u, r});
      }
    }
    // Per unit: 0 while its Prefill is pending, 1 once done, 2 if it threw (its decode items are skipped;
    // ParallelForWorkers rethrows the Prefill's exception, the lowest item index); and its runs still to
    // finish.
    std::vector<std::atomic<int>> prefilled(hkv);
    std::vector<std::atomic<int>> remaining(hkv);
    for (int u = 0; u < hkv; ++u) remaining[u].store(runs);
    ParallelForWorkers(static_cast<int>(items.size()), threads_, [&](int item, int worker) {
      const int u = items[item].u, r = items[item].r;
      if (r < 0) {
        int state = 2;
        try {
          Prefill(u);
          state = 1;
        } catch (...) {
          prefilled[u].store(state);
          prefilled[u].notify_all();
          throw;
        }
        if (runs == 0) ReleaseUnit(u);
        prefilled[u].store(state);
        prefilled[u].notify_all();
        return;
      }
      prefilled[u].wait(0);
      if (prefilled[u].load() != 1) return;
      WorkerScratch& ws = scratch_[worker];
      BeginRun(ws);
      ws.prev_version = units_[u].caches[r].version();  // the cache as the prefill left it
      for (int t = 0; t < meta_.num_decode_steps; ++t) Step(u, r, t, ws);
      FinishRun(u, r, ws);
      units_[u].policies[r].reset();  // the run is done on this head: its state goes now
      buffers_.GiveMergeStorage(r, units_[u].caches[r].TakeMergeStorage());
      units_[u].caches[r] = HeadCache(m_.head_dim);
      if (remaining[u].fetch_sub(1) == 1) {  // the head's last run: the deferred regrets, then its state goes
        FinishRegret(u);
        ReleaseUnit(u);
      }
    });
  }

 private:
  size_t Sample(int qh, int t) const {
    return (static_cast<size_t>(layer_.layer) * m_.num_heads + qh) * meta_.num_decode_steps + t;
  }
  // A unit's state goes; its largest buffers go back to the pool for the next unit (PassBuffers).
  void ReleaseUnit(int u) {
    UnitWork& w = units_[u];
    buffers_.Give({std::move(w.refs), std::move(w.sums), std::move(w.all_sums), std::move(w.buckets),
                   std::move(w.probs_t)});
    w = UnitWork{};
  }
  size_t UnitIndex(int u) const { return static_cast<size_t>(layer_.layer) * m_.num_kv_heads + u; }
  // Decode steps [t, num_decode_steps) of query head qh (their rows are consecutive; checked: read).
  const float* DecodeQuery(int qh, int t) const {
    const int qi = meta_.QueryIndex(meta_.prefill_length + t);
    KVSIM_CHECK(qi >= 0);
    return layer_.HeadQueries(meta_, qh, qi, qi + meta_.num_decode_steps - t) +
           static_cast<size_t>(qi) * m_.head_dim;
  }

  void Prefill(int u) {
    UnitWork& w = units_[u];
    const int n = meta_.prefill_length, steps = meta_.num_decode_steps, t_all = meta_.total_tokens();
    const int d = m_.head_dim, group = m_.GroupSize();
    const float* keys = layer_.keys.data() + static_cast<size_t>(u) * t_all * d;
    const float* values = layer_.values.data() + static_cast<size_t>(u) * t_all * d;
    // Buffers recycled from a finished unit (PassBuffers).
    UnitBuffers recycled = buffers_.Take();
    w.refs = std::move(recycled.refs);
    w.sums = std::move(recycled.sums);
    w.all_sums = std::move(recycled.all_sums);
    w.buckets = std::move(recycled.buckets);
    w.probs_t = std::move(recycled.probs_t);  // rebuilt by ProbsT on first use (its memory is what is reused)
    // Full-attention reference, shared by every run.
    w.refs.resize(group);
    for (int g = 0; g < group; ++g)
      ComputeDecodeReference(m_, n, steps, DecodeQuery(u * group + g, 0), keys, values, &w.refs[g],
                             meta_.tokens.modality.data());
    w.probs_t_build = std::make_unique<SharedBuild>();
    w.decode_part_once = std::make_unique<std::once_flag>();
    w.band_mutex = std::make_unique<std::mutex>();
    w.all_once = std::make_unique<std::once_flag>();
    w.shared = std::make_unique<UnitShared>();
    // max ‖v_j‖ over each step's visible keys (the output-error bound's).
    w.max_vnorm.resize(steps);
    if (steps > 0) MaxVisibleNorms(values, n, steps, d, w.refs[0].first.data(), w.max_vnorm.data());
    // Compression hook of every run.
    WorkerScratch check;  // CheckCache's marker for the prefill checks (few per unit)
    check.stamp.assign(t_all, 0);
    w.policies.resize(plans_.size());
    w.caches.assign(plans_.size(), HeadCache(d));
    for (size_t r = 0; r < plans_.size(); ++r)  // a merging run's earlier caches' memory
      w.caches[r].AdoptMergeStorage(buffers_.TakeMergeStorage(static_cast<int>(r)));
    w.prefill_size.assign(plans_.size(), 0);
    w.checked.assign(plans_.size(), {});
    int scores_ce = -1;
    for (size_t r = 0; r < plans_.size(); ++r) {
      const RunPlan& plan = plans_[r];
      // Runs with the same compressible region share one score cache.
      if (scores_ce != plan.compress_end) {
        w.scores = std::make_unique<UnitScores>(meta_, layer_, u, plan.compress_end);
        scores_ce = plan.compress_end;
      }
      HeadContext ctx{
          &meta_,         layer_.layer,           u,          group, plan.compress_end, keys, values,
          w.scores.get(), plan.policy_plan.get(), plan.budget};
      ctx.shared = w.shared.get();
      w.ctx = ctx;
      w.policies[r] = plan.spec->policy->NewHeadPolicy(ctx);
      HeadCache& cache = w.caches[r];
      cache.AssignRange(0, plan.compress_end);
      const int budget = plan.head_budgets[UnitIndex(u)];
      w.policies[r]->OnPrefill(ctx, budget, &cache);
      for (int j = plan.compress_end; j < n; ++j) cache.Append(j);
      CheckCache(w, check, cache, n - 1, r);
      if (!plan.may_exceed)
        KVSIM_CHECK_MSG(cache.size() <= budget + (n - plan.compress_end),
                        plan.spec->policy->name() + " kept " + std::to_string(cache.size()) +
                            " slots after prefill, budget " + std::to_string(budget));
      w.prefill_size[r] = cache.size();
      if (recorder_) recorder_->AfterPrefill(plan.index, layer_.layer, u, cache);
      RunAccum& a = acc_[r];
      if (plan.compression_step < 0) RecordCompression(plan, cache, u, &a);
      a.tokens[UnitIndex(u) * (steps + 1)] = cache.size();
    }
    w.scores.reset();  // prompt scores are a prefill-time facility
    RegretSums(u);
  }

  // What each step's regret needs from the full-attention rows (the mass of the k best visible tokens,
  // added in descending order: `top_sum`, `top_all`), and the full-attention modality sums.
  //
  // A run's k is min(its visible slots, the visible tokens). Step's checks bound a run's cache size (and so
  // its visible slots) by its cap, so the prefix sums are kept up to `kpre`, the largest bound below T of
  // any run; a run whose bound is T or more (`full`) reads `top_all` when it sees every visible token and
  // `all_sums` otherwise (AllSums). When some run needs top-k sums (kpre > 0), no row is sorted: TopKSums
  // keeps each row's values in buckets, and each run's one k per step is answered by selection in one
  // bucket (sim/select.h), bit-identical to the sorted prefix sums; an oracle's k-th largest value comes
  // from the same buckets (FullKth).
  void RegretSums(int u) {
    UnitWork& w = units_[u];
    const int n = meta_.prefill_length, steps = meta_.num_decode_steps;
    const int t_all = meta_.total_tokens(), group = m_.GroupSize();
    int kpre = 0;
    for (size_t r = 0; r < plans_.size(); ++r) {
      const RunPlan& plan = plans_[r];
      const int cap = plan.head_budgets[UnitIndex(u)] + (n - plan.compress_end);
      const int64_t limit = (plan.may_exceed ? std::max(cap, w.prefill_size[r]) : cap) + plan.headroom;
      const int64_t bound = plan.evicts ? limit : limit + steps;  // Step's check of the cache size
      if (bound < t_all) kpre = std::max(kpre, static_cast<int>(bound));
    }
    w.kpre = kpre;
    w.use_sums = kpre > 0;
    bool kth = false;  // some run asks FullKth, which reads `sums` or `buckets`
    for (const RunPlan& plan : plans_) kth = kth || plan.req.future_attention;
    w.defer = w.use_sums && g_defer_sums.load(std::memory_order_relaxed) &&
              (!kth || g_defer_kth.load(std::memory_order_relaxed));
    w.kth_buckets = w.defer && kth;
    w.sums.Clear();
    w.buckets.Clear();
    if (w.use_sums && !w.defer) w.sums.Reserve(group * steps, static_cast<size_t>(group) * steps * t_all);
    if (w.kth_buckets) w.buckets.Reserve(group * steps);
    if (w.defer) w.dk.assign(plans_.size() * group * steps, -1);
    if (w.defer) w.dret.resize(plans_.size() * group * steps);
    // The sorted path's head length: 0 with top-k sums (deferred too: then only each row's S[n] is taken).
    const int kh = w.use_sums ? 0 : kpre;
    w.top_sum.resize(w.use_sums ? 0 : static_cast<size_t>(group) * steps * (kpre + 1));
    w.top_all.resize(static_cast<size_t>(group) * steps);
    w.full_mod.assign(static_cast<size_t>(group) * steps * 4, 0.0);
    // Rows are handled kBlock steps at a time: each row's sums are still added in its own order (the
    // prefix sums in descending order, the modality sums in key order), but the blocks' rows are
    // independent dependency chains the core overlaps. The blocks are padded with zeros, and adding +0 to a
    // non-negative sum changes no bit.
    constexpr int kBlock = 8;
    std::vector<float> head, tails[kBlock];
    std::vector<float> hblock(static_cast<size_t>(kBlock) * kh), tblock;
    const Modality* mod = meta_.tokens.modality.data();
    for (int g = 0; g < group; ++g) {
      const DecodeReference& ref = w.refs[g];
      // Row t's sums by modality and in all, exact and taken after its softmax (ComputeDecodeReference).
      const bool row_sums = g_exact_row_sums.load(std::memory_order_relaxed) && !ref.exact.empty();
      auto exact = [&](int t) { return row_sums && ref.exact[t] != 0; };
      for (int t0 = 0; t0 < steps; t0 += kBlock) {
        const int nb = std::min(kBlock, steps - t0);
        int hlen = 0, tlen = 0, lo = t_all, hi = 0;
        double acc[kBlock] = {}, tot[kBlock] = {}, fm[kBlock][4] = {};
        for (int b = 0; b < nb; ++b) {
          const int t = t0 + b, first = ref.first[t], last = ref.last(t);
          lo = std::min(lo, first);
          hi = std::max(hi, last);
          if (w.use_sums && !w.defer) {  // row g * steps + t
            tot[b] = w.sums.AddRow({ref.row(t) + first, static_cast<size_t>(last - first + 1)}, kpre,
                                   exact(t) ? &ref.sums[t] : nullptr);
            tails[b].clear();
            continue;
          }
          if (w.kth_buckets)  // row g * steps + t (rows are added in this order)
            w.buckets.AddRow({ref.row(t) + first, static_cast<size_t>(last - first + 1)},
                             exact(t) ? &ref.sums[t] : nullptr);
          if (exact(t)) {  // S[n], taken after the row's softmax (kh is 0 here: no head, no tail)
            tot[b] = ref.sums[t].total;
            tails[b].clear();
            continue;
          }
          SortForDescendingSums({ref.row(t) + first, static_cast<size_t>(last - first + 1)}, kh, &head,
                                &tot[b], &tails[b]);
          float* dst = hblock.data() + static_cast<size_t>(b) * kh;
          std::copy(head.begin(), head.end(), dst);
          std::fill(dst + head.size(), dst + kh, 0.0f);
          hlen = std::max(hlen, static_cast<int>(head.size()));
          tlen = std::max(tlen, static_cast<int>(tails[b].size()));
        }
        tblock.assign(static_cast<size_t>(nb) * tlen, 0.0f);
        for (int b = 0; b < nb; ++b)
          std::copy(tails[b].begin(), tails[b].end(), tblock.data() + static_cast<size_t>(b) * tlen);
        double* pre[kBlock];
        for (int b = 0; b < nb && !w.use_sums; ++b) {
          pre[b] = &w.top_sum[(static_cast<size_t>(g) * steps + t0 + b) * (kpre + 1)];
          pre[b][0] = 0;
        }
        for (int i = 0; i < hlen; ++i)
          for (int b = 0; b < nb; ++b) {
            acc[b] += hblock[static_cast<size_t>(b) * kpre + i];
            pre[b][i + 1] = acc[b];
          }
        for (int i = 0; i < tlen; ++i)
          for (int b = 0; b < nb; ++b) tot[b] += tblock[static_cast<size_t>(b) * tlen + i];
        for (int b = 0; b < nb && !w.use_sums; ++b) {  // a row sorted in full: its sum is the last prefix sum
          const int len = ref.last(t0 + b) - ref.first[t0 + b] + 1;
          if (len <= kpre) tot[b] = pre[b][len];
        }
        bool all_exact = true;
        for (int b = 0; b < nb; ++b) all_exact = all_exact && exact(t0 + b);
        if (all_exact) {  // the same sums, taken after each row's softmax (zeros add nothing)
          for (int b = 0; b < nb; ++b) std::copy_n(ref.sums[t0 + b].kind, 4, fm[b]);
        } else {
          for (int j = lo; j <= hi; ++j) {
            const int mo = static_cast<int>(mod[j]);
            for (int b = 0; b < nb; ++b) fm[b][mo] += ref.row(t0 + b)[j];
          }
        }
        for (int b = 0; b < nb; ++b) {
          w.top_all[static_cast<size_t>(g) * steps + t0 + b] = tot[b];
          std::copy_n(fm[b], 4, &w.full_mod[(static_cast<size_t>(g) * steps + t0 + b) * 4]);
        }
      }
    }
  }

  // The top-k sums of every row for any k, for a k above the unit's kpre (a run with no cap below T, e.g.
  // one that compresses at decode step 0 and may exceed its budget): built once per unit on the first such
  // k (a unit whose runs never ask builds nothing) and shared by its runs. Each value is bit-identical to
  // the sequential sum of the row sorted in full (TopKSums' own proof), which this replaces: one sort of
  // the row per run and step before.
  const TopKSums& AllSums(UnitWork& w) {
    std::call_once(*w.all_once, [&] {
      const int steps = meta_.num_decode_steps, t_all = meta_.total_tokens(), group = m_.GroupSize();
      w.all_sums.Clear();  // its buffers may be a finished unit's (PassBuffers)
      w.all_sums.Reserve(group * steps, static_cast<size_t>(group) * steps * t_all);
      for (int g = 0; g < group; ++g)
        for (int t = 0; t < steps; ++t) {  // row g * steps + t
          const DecodeReference& ref = w.refs[g];
          const int first = ref.first[t];
          w.all_sums.AddRow({ref.row(t) + first, static_cast<size_t>(ref.last(t) - first + 1)}, t_all);
        }
    });
    return w.all_sums;
  }

  // The deferred regrets of unit u (UnitWork::defer), by the worker whose run of the unit finished last
  // (after every run's steps, before the unit's buffers go back): per row, the distinct k its runs asked
  // (DescendingSums, the same bits as TopKSums::Sum), then each run's regret as Step would have recorded it.
  void FinishRegret(int u) {
    UnitWork& w = units_[u];
    if (!w.defer) return;
    const int steps = meta_.num_decode_steps, group = m_.GroupSize(), runs = static_cast<int>(plans_.size());
    const size_t rows = static_cast<size_t>(group) * steps;
    std::vector<int32_t> ks;
    std::vector<int> which(runs);  // run r's place in ks (-1: no deferred k for the row)
    std::vector<double> top;
    for (int g = 0; g < group; ++g) {
      const DecodeReference& ref = w.refs[g];
      const bool row_sums = g_exact_row_sums.load(std::memory_order_relaxed) && !ref.exact.empty();
      for (int t = 0; t < steps; ++t) {
        const size_t gt = static_cast<size_t>(g) * steps + t;
        ks.clear();
        for (int r = 0; r < runs; ++r) {
          const int32_t k = w.dk[r * rows + gt];
          which[r] = -1;
          if (k < 0) continue;
          const auto at = std::find(ks.begin(), ks.end(), k);
          which[r] = static_cast<int>(at - ks.begin());
          if (at == ks.end()) ks.push_back(k);
        }
        if (ks.empty()) continue;
        top.resize(ks.size());
        const int first = ref.first[t];
        const std::span<const float> row(ref.row(t) + first, static_cast<size_t>(ref.last(t) - first + 1));
        const RowSums* known = row_sums && ref.exact[t] != 0 ? &ref.sums[t] : nullptr;
        if (w.kth_buckets)
          w.buckets.Sums(static_cast<int>(gt), row, ks, known, top.data());
        else
          DescendingSums(row, ks, known, top.data());
        const size_t si = Sample(u * group + g, t);
        for (int r = 0; r < runs; ++r)
          if (which[r] >= 0) acc_[r].regret[si] = static_cast<float>(top[which[r]] - w.dret[r * rows + gt]);
      }
    }
  }

  // Kept-token statistics right after the compression event.
  void RecordCompression(const RunPlan& plan, const HeadCache& cache, int u, RunAccum* a) const {
    int prompt = 0;
    for (int32_t tok : cache.tokens()) {
      if (tok >= meta_.prefill_length) continue;
      ++a->kept_mod[UnitIndex(u) * 4 + static_cast<int>(meta_.tokens.modality[tok])];
      if (tok < plan.compress_end) ++prompt;
    }
    a->prompt_kept[UnitIndex(u)] = prompt;
  }

  // Merge statistics at the end of the request.
  void RecordMerges(const HeadCache& cache, int u, RunAccum* a) const {
    int merged = 0, slots = 0, most = 0;
    for (int s = 0; s < cache.size(); ++s) {
      if (!cache.is_merged(s)) continue;
      const int members = static_cast<int>(cache.merged(s).members.size());
      merged += members;
      ++slots;
      most = std::max(most, members);
    }
    a->merged_tokens[UnitIndex(u)] = merged;
    a->merged_slots[UnitIndex(u)] = slots;
    a->merge_max[UnitIndex(u)] = most;
  }

  // Never a token twice, never a token from the future (O(covered tokens) with an epoch-stamped marker).
  // When the cache only lost slots and gained appended ones since the last check of run r (no assignment,
  // no merge: HeadCache::rewrites() unchanged), every slot it held then passed that check, and evicting
  // cannot break either rule, so only the slots appended since are checked (O(appends), e.g. streaming_llm's
  // one eviction and one append per step): each must be a plain slot newer than every token any check saw
  // (so it cannot be held twice) and not from the future. A slot that fails this (a policy appending an old
  // token) gets the full check, which decides.
  static void CheckCache(UnitWork& w, WorkerScratch& ws, const HeadCache& cache, int32_t last_token,
                         size_t r) {
    UnitWork::Checked& c = w.checked[r];
    if (cache.rewrites() == c.rewrites) {
      const uint64_t added = cache.appends() - c.appends;
      const int from = cache.size() - static_cast<int>(std::min<uint64_t>(added, cache.size()));
      int32_t newest = c.max_token;
      bool ok = true;
      for (int s = from; s < cache.size() && ok; ++s) {
        const int32_t tok = cache.token(s);
        ok = tok > newest && tok <= last_token && !cache.is_merged(s);
        newest = tok;
      }
      if (ok) {
        c.max_token = newest;
        c.appends = cache.appends();
        return;
      }
    }
    c.rewrites = cache.rewrites();
    c.appends = cache.appends();
    // A rewritten cache of plain slots in ascending token order (what Assign gets from a top-k selection,
    // e.g. oracle's at every step) holds each token once: one branch-free pass over the tokens instead of
    // the markers' scattered writes. Anything else (merged slots, another order, a token out of range) takes
    // the full check below, which names the fault.
    const std::span<const int32_t> toks = cache.tokens();
    if (!cache.has_merges() && !toks.empty() && toks.front() >= 0 && toks.back() <= last_token) {
      bool descent = false;
      for (size_t i = 1; i < toks.size(); ++i) descent |= toks[i] <= toks[i - 1];
      if (!descent) {
        c.max_token = std::max(c.max_token, toks.back());
        return;
      }
    }
    for (int s = 0; s < cache.size(); ++s) {
      c.max_token = std::max(c.max_token, cache.token(s));
      if (cache.is_merged(s))
        for (const auto& member : cache.merged(s).members) c.max_token = std::max(c.max_token, member.first);
    }
    const uint32_t epoch = ++ws.epoch;
    auto mark = [&](int32_t tok) {
      KVSIM_CHECK_MSG(tok >= 0 && tok <= last_token, "cache holds a token outside [0, current position]");
      KVSIM_CHECK_MSG(ws.stamp[tok] != epoch, "a token is held twice in one cache");
      ws.stamp[tok] = epoch;
    };
    for (int s = 0; s < cache.size(); ++s) {
      mark(cache.token(s));
      if (cache.is_merged(s))
        for (const auto& member : cache.merged(s).members) mark(member.first);
    }
  }

  void BeginRun(WorkerScratch& ws) const {
    const int steps = meta_.num_decode_steps, t_all = meta_.total_tokens(), group = m_.GroupSize();
    const size_t gs = static_cast<size_t>(group) * steps;
    if (ws.stamp.size() != static_cast<size_t>(t_all)) {
      ws.stamp.assign(t_all, 0);
      ws.epoch = 0;
      ws.col.assign(t_all, -1);
    }
    ws.plain.clear();
    ws.step_begin.assign(1, 0);
    ws.runs.clear();
    ws.runs_live = g_step_runs.load(std::memory_order_relaxed);
    ws.runs_steps = 0;
    ws.prefix = false;
    ws.ptok.clear();
    ws.deferred = 0;
    ws.wsum.assign(gs, 0.0);
    ws.retained.assign(gs, 0.0);
    ws.checked.assign(steps, 0);
    ws.has_extra.assign(steps, 0);
    ws.extra.clear();
    ws.mt0 = ws.mt_end = -1;
    ws.cs0 = ws.cs_end = -1;
    ws.mlen = steps;
  }

  // Starts a block of merged-slot work at step t for a cache whose version did not change since the
  // previous step (a policy that merges once, like MEDA and LOOK-M, keeps it for every later step; one that
  // merges at every step never gets here and keeps the per-step dots below, in Dot's order). The dots of
  // the steps' queries with the merged keys come from one GEMM per group member: their sums are added in
  // BLAS's order instead of Dot's, which moves merging runs' metrics in the last bits (docs/performance.md,
  // "Round 4"). A block covers the remaining steps at first; a block the cache outlived by changing is
  // followed by blocks of twice the steps it lasted (at least 4), so a policy that changes its merges every
  // few steps does not pay for dots it never uses. The blocks depend only on the cache's history, never on
  // threads or scheduling.
  void BeginMergedBlock(int u, int t, const HeadCache& cache, WorkerScratch& ws) {
    FlushMergedBlock(ws);
    const int steps = meta_.num_decode_steps, d = m_.head_dim, group = m_.GroupSize();
    const int slots = cache.size(), mm = cache.num_merged_slots(), rows = std::min(steps - t, ws.mlen);
    ws.mslot.resize(mm);
    ws.mk.resize(static_cast<size_t>(mm) * d);
    ws.mv.resize(static_cast<size_t>(mm) * d);
    int c = 0;
    for (int s = 0; s < slots; ++s) {
      if (!cache.is_merged(s)) continue;
      const MergedSlot& ms = cache.merged(s);
      std::copy_n(ms.key.data(), d, ws.mk.data() + static_cast<size_t>(c) * d);
      std::copy_n(ms.value.data(), d, ws.mv.data() + static_cast<size_t>(c) * d);
      ws.mslot[c++] = s;
    }
    KVSIM_CHECK(c == mm);
    ws.mdot.resize(static_cast<size_t>(group) * rows * mm);
    ws.mw.resize(ws.mdot.size());  // no zero fill: Step writes every entry of the rows a flush reads
    EnsureSingleThreadedBlas();
    for (int g = 0; g < group; ++g)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, mm, d, 1.0f, DecodeQuery(u * group + g, t),
                  d, ws.mk.data(), d, 0.0f, ws.mdot.data() + static_cast<size_t>(g) * rows * mm, mm);
    ws.mversion = cache.version();
    ws.ms0 = ws.mb0 = -1;
    ws.cs0 = ws.cs_end = -1;
    ws.mt0 = t;
    ws.mt_end = t;
    ws.mrows = rows;
  }

  // The unit's transposed reference probabilities (UnitWork::probs_t), built by the callers that need them
  // before they are done: one group member's kProbsTTokens tokens (all steps) per piece (SharedBuild), so a
  // run of the unit that asks while another run's worker is building helps instead of waiting idle for the
  // whole transpose (the same values whoever writes which piece). A piece writes one contiguous stretch of
  // the output (pieces of 8 steps for all tokens interleaved two workers' stores within cache lines).
  const float* ProbsT(UnitWork& w) const {
    const int steps = meta_.num_decode_steps, t_all = meta_.total_tokens(), group = m_.GroupSize();
    const size_t ts = static_cast<size_t>(t_all) * steps;
    const int per = (t_all + kProbsTTokens - 1) / kProbsTTokens;  // pieces per group member
    w.probs_t_build->Run(
        group * per,
        [&] {
          // Every element below group * ts is written by the pieces; the padding is zeroed (a recycled
          // buffer holds a finished unit's values).
          w.probs_t.resize(group * ts + kMemberChunk);
          std::fill(w.probs_t.begin() + group * ts, w.probs_t.end(), 0.0f);
        },
        [&](int piece) {
          const int g = piece / per, j0 = piece % per * kProbsTTokens;
          const int j1 = std::min(t_all, j0 + kProbsTTokens);
          float* dst = w.probs_t.data() + g * ts;
          for (int t0 = 0; t0 < steps; t0 += 8) {
            const int nb = std::min(8, steps - t0);  // 8 rows read in order, 8 adjacent floats written
            const float* src[8];
            for (int b = 0; b < nb; ++b) src[b] = w.refs[g].row(t0 + b);
            int j = j0;
            if (nb == 8)
              for (; j + 8 <= j1; j += 8)
                TransposeTile8(src, j, dst + static_cast<size_t>(j) * steps + t0, steps);
            for (; j < j1; ++j) {
              float* out = dst + static_cast<size_t>(j) * steps + t0;
              for (int b = 0; b < nb; ++b) out[b] = src[b][j];
            }
          }
        });
    return w.probs_t.data();
  }

  // A ranked run's columns (RankBands): U's first `nu` tokens (ascending) in rank order, into ws.order: the
  // tokens the policy did not rank (j >= rank.size(): an observation window, the question, decode tokens)
  // first, ascending, then the ranked ones by descending score, ties by ascending token (the order in which
  // TopKIndices takes them, so a smaller budget's kept tokens come first). false when a kept score is NaN.
  static bool RankOrder(std::span<const float> rank, size_t nu, WorkerScratch& ws) {
    ws.order.clear();
    ws.rank_keys.clear();
    if (rank.empty()) return false;
    for (size_t c = 0; c < nu; ++c) {
      const int32_t tok = ws.used[c];
      if (static_cast<size_t>(tok) >= rank.size()) {
        ws.order.push_back(tok);
        continue;
      }
      const float v = rank[tok];
      if (std::isnan(v)) return false;
      uint32_t bits = std::bit_cast<uint32_t>(v);
      if (bits == 0x80000000u) bits = 0;                         // -0 ties +0
      bits = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;  // ascending with the float
      ws.rank_keys.push_back((static_cast<uint64_t>(~bits) << 32) | static_cast<uint32_t>(tok));
    }
    // Ascending keys: the score's key (high half) by three stable counting passes of 11 bits over keys
    // listed in ascending token order (the low half), so ties stay by ascending token: std::sort's order.
    std::vector<uint64_t>&a = ws.rank_keys, &b = ws.rank_tmp;
    if (a.size() < 256) {
      std::sort(a.begin(), a.end());
    } else {
      b.resize(a.size());
      for (int shift : {32, 43, 54}) {
        uint32_t count[2049] = {};
        for (uint64_t key : a) ++count[((key >> shift) & 2047) + 1];
        if (count[((a[0] >> shift) & 2047) + 1] == a.size()) continue;  // one digit: nothing moves
        for (int i = 1; i <= 2048; ++i) count[i] += count[i - 1];
        for (uint64_t key : a) b[count[(key >> shift) & 2047]++] = key;
        a.swap(b);
      }
    }
    for (uint64_t key : a) ws.order.push_back(static_cast<int32_t>(key & 0xffffffffu));
    return true;
  }

  // A run of consecutive-token lists (FinishRun's runs path) without a sliding window: the prompt tokens
  // it holds at every step ("full": their columns of A are p's own) in blocks of kRankBand positions
  // counted back from the prompt's end, the newest block first, ascending within one, then every other
  // token of U ascending, into ws.order; returns how many are full (0, ws.order untouched, when fewer than
  // a band). Sliding windows of several sizes hold nested sets of full tokens in the same order.
  size_t PositionOrder(int n, int steps, WorkerScratch& ws) const {
    const int t_all = meta_.total_tokens();
    if (ws.hold.size() != static_cast<size_t>(t_all) + 1) ws.hold.assign(static_cast<size_t>(t_all) + 1, 0);
    for (const auto& run : ws.runs) {
      ++ws.hold[run.first];
      --ws.hold[run.first + run.len];
    }
    ws.order.clear();
    int32_t held = 0, tok = ws.used.front();
    for (int32_t j : ws.used) {
      for (; tok <= j; ++tok) held += ws.hold[tok];
      if (j < n && held == steps) ws.order.push_back(j);
    }
    for (const auto& run : ws.runs) ws.hold[run.first] = ws.hold[run.first + run.len] = 0;
    const size_t full = ws.order.size();
    if (full < kRankBand) return 0;
    // The full tokens by block, newest first (ws.order holds them ascending), then the rest ascending.
    std::vector<int32_t>& by_block = ws.span;  // scratch here
    by_block.clear();
    for (size_t end = full; end > 0;) {
      const int32_t b = (n - 1 - ws.order[end - 1]) / static_cast<int32_t>(kRankBand);
      size_t start = end;
      while (start > 0 && (n - 1 - ws.order[start - 1]) / static_cast<int32_t>(kRankBand) == b) --start;
      by_block.insert(by_block.end(), ws.order.begin() + start, ws.order.begin() + end);
      end = start;
    }
    size_t f = 0;  // the full tokens are a subsequence of U (ascending): the others are what is skipped
    for (int32_t j : ws.used) {
      if (f < full && ws.order[f] == j) {
        ++f;
        continue;
      }
      by_block.push_back(j);
    }
    ws.order.swap(by_block);
    return full;
  }

  // Adds the bands of columns [from, nb) of A to ws.out (which holds the sum of the bands before `from`),
  // kRankBand columns at a time, and keeps the sums other runs of the unit may resume at (WantedBands, and
  // after the last whole band: a larger budget's run resumes there). ws.a's rows hold columns a_first, ...
  // (lda apart); ws.vu the value rows of columns from, from + 1, ..., or, when `band_v` is given,
  // band_v[(c - from) / kRankBand] those of the band from column c on (d apart: the same operand); when
  // `band_a` is given and band_a[(c - from) / kRankBand] is not null, it is that band's A (rows band_lda
  // apart: the same operand).
  void BandProducts(int u, int r, size_t nb, size_t from, size_t a_first, size_t lda, WorkerScratch& ws,
                    const float* const* band_v = nullptr, const float* const* band_a = nullptr,
                    size_t band_lda = 0) {
    const int steps = meta_.num_decode_steps, d = m_.head_dim;
    const size_t rows = static_cast<size_t>(m_.GroupSize()) * steps;
    WantedBands(u, r, nb, ws);
    const size_t last = nb / kRankBand;
    const bool keep = g_band_memo.load(std::memory_order_relaxed);
    EnsureSingleThreadedBlas();
    for (size_t c = from; c < nb; c += kRankBand) {
      const size_t kb = std::min(kRankBand, nb - c);
      const float* a = band_a ? band_a[(c - from) / kRankBand] : nullptr;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows), d, static_cast<int>(kb),
                  1.0f, a ? a : ws.a.data() + (c - a_first), static_cast<int>(a ? band_lda : lda),
                  band_v ? band_v[(c - from) / kRankBand] : ws.vu.data() + (c - from) * d, d, 1.0f,
                  ws.out.data(), d);
      const size_t m = (c + kb) / kRankBand;
      if (keep && kb == kRankBand &&
          (m == last || std::find(ws.band_wanted.begin(), ws.band_wanted.end(), m) != ws.band_wanted.end()))
        ws.band_sums.emplace_back(
            m, std::make_shared<const std::vector<float>>(ws.out.begin(), ws.out.begin() + rows * d));
    }
    KeepBands(units_[u], ws);
  }

  // How many first tokens of `order` (at most `limit`) the chain's order begins with.
  static size_t CommonTokens(const UnitWork::BandChain& chain, const std::vector<int32_t>& order,
                             size_t limit) {
    const size_t lim = std::min(limit, chain.order.size());
    return static_cast<size_t>(
        std::mismatch(chain.order.begin(), chain.order.begin() + lim, order.begin()).first -
        chain.order.begin());
  }

  // The bands of ws.order[0, nu) another run of the unit already added: their sum goes to ws.out (zeros
  // when none); returns how many columns that covers (a multiple of kRankBand).
  size_t ResumeBands(UnitWork& w, size_t nu, size_t elems, WorkerScratch& ws) const {
    ws.band_sums.clear();
    const std::vector<float>* best = nullptr;
    size_t best_m = 0;
    if (g_band_memo.load(std::memory_order_relaxed)) {
      std::lock_guard<std::mutex> lock(*w.band_mutex);
      for (const auto& chain : w.band_chains) {
        const size_t c = CommonTokens(chain, ws.order, nu);
        for (const auto& [m, sum] : chain.sums)
          if (m * kRankBand <= c && m > best_m) {
            best_m = m;
            best = sum.get();  // kept alive by the chain until the unit is released
          }
      }
    }
    if (best == nullptr) {
      std::fill(ws.out.begin(), ws.out.begin() + elems, 0.0f);
      return 0;
    }
    std::copy_n(best->data(), elems, ws.out.begin());
    return best_m * kRankBand;
  }

  // Where the unit's other runs could resume (ResumeBands): the band boundaries below `nu` at their
  // expected column counts (budget + the uncompressed prompt tail), into ws.band_wanted.
  void WantedBands(int u, int r, size_t nu, WorkerScratch& ws) const {
    ws.band_wanted.clear();
    const int n = meta_.prefill_length, steps = meta_.num_decode_steps;
    for (size_t q = 0; q < plans_.size(); ++q) {
      // Only the same policy's other runs rank (or hold windows) alike.
      if (static_cast<int>(q) == r || plans_[q].spec->policy != plans_[r].spec->policy) continue;
      const int64_t cols =
          static_cast<int64_t>(plans_[q].head_budgets[UnitIndex(u)]) + (n - plans_[q].compress_end);
      for (int64_t c : {cols, cols - steps}) {  // a ranked run's columns; a sliding window's full tokens
        const size_t m = static_cast<size_t>(std::max<int64_t>(c, 0)) / kRankBand;
        if (m > 0 && m * kRankBand < nu) ws.band_wanted.push_back(m);
      }
    }
  }

  // Keeps the run's band sums (ws.band_sums, over ws.order) for the unit's later runs: in the chain whose
  // tokens agree with ws.order as far as both go (extended to the run's), or a new one (at most kMaxChains
  // per unit).
  void KeepBands(UnitWork& w, WorkerScratch& ws) const {
    constexpr size_t kMaxChains = 16;
    if (ws.band_sums.empty() || !g_band_memo.load(std::memory_order_relaxed)) return;
    const size_t len = ws.band_sums.back().first * kRankBand;
    std::lock_guard<std::mutex> lock(*w.band_mutex);
    UnitWork::BandChain* into = nullptr;
    for (auto& chain : w.band_chains) {
      if (CommonTokens(chain, ws.order, len) == std::min(len, chain.order.size())) {
        into = &chain;
        break;
      }
    }
    if (into == nullptr) {
      if (w.band_chains.size() >= kMaxChains) return;
      into = &w.band_chains.emplace_back();
    }
    if (into->order.size() < len) into->order.assign(ws.order.begin(), ws.order.begin() + len);
    for (auto& bs : ws.band_sums) {
      auto at = std::lower_bound(into->sums.begin(), into->sums.end(), bs.first,
                                 [](const UnitWork::BandSum& a, size_t m) { return a.first < m; });
      if (at == into->sums.end() || at->first != bs.first) into->sums.insert(at, std::move(bs));
    }
  }

  // The unit's decode part of the reference outputs (UnitWork::decode_part), built by the first caller.
  const float* DecodePart(UnitWork& w) const {
    const int steps = meta_.num_decode_steps, t_all = meta_.total_tokens(), group = m_.GroupSize();
    const int n = meta_.prefill_length, d = m_.head_dim;
    std::call_once(*w.decode_part_once, [&] {
      w.decode_part.resize(static_cast<size_t>(group) * steps * d);
      EnsureSingleThreadedBlas();
      for (int g = 0; g < group; ++g)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, steps, d, steps, 1.0f, w.refs[g].row(0) + n,
                    t_all, w.ctx.values + static_cast<size_t>(n) * d, d, 0.0f,
                    w.decode_part.data() + static_cast<size_t>(g) * steps * d, d);
    });
    return w.decode_part.data();
  }

  // The member sums Σ_{j ∈ members(s)} p_t[j] of every merged slot s of the block, for the steps
  // [t, t + kMemberChunk) (the chunk Step asks for: ws.ms0 = t), into ws.msum. They are computed for every
  // step of the block from t on at once (rounded up to whole chunks; those past the block are computed and
  // never read), so a later chunk of the block finds its sums there: a merged slot's members do not change
  // while the block's version holds, and each member's row of the unit's transposed probabilities
  // (contiguous in steps) is read once, whole, instead of 16 steps at a time per chunk (issue 14, round 15).
  // Each (step, slot) sum keeps its additions and their order: members i = 0, 1, 2, ... go to float lanes
  // i mod 4 (the tail after the last multiple of 4 to lane 0), in member order, and the lanes are added as
  // (m0 + m1) + (m2 + m3) in double, as in Step's per-step path.
  void MemberSums(int u, int t, const HeadCache& cache, WorkerScratch& ws) {
    ws.ms0 = t;
    if (ws.mb0 >= 0 && t >= ws.mb0 && t + kMemberChunk <= ws.mb0 + ws.mbrows) return;
    UnitWork& w = units_[u];
    const int steps = meta_.num_decode_steps, t_all = meta_.total_tokens(), group = m_.GroupSize();
    const size_t ts = static_cast<size_t>(t_all) * steps;
    ProbsT(w);
    // Whole chunks up to the block's end: pt + tok * steps + t + rows - 1 stays within the transposed
    // probabilities' padding (kMemberChunk floats) for the last token.
    const int rows = (ws.mt0 + ws.mrows - t + kMemberChunk - 1) / kMemberChunk * kMemberChunk;
    // The block's merged slots (appends since its start are plain slots after them), their members flat.
    const int mm = static_cast<int>(ws.mslot.size());
    ws.mmem0.resize(mm + 1);
    ws.mmem.clear();
    for (int c = 0; c < mm; ++c) {
      ws.mmem0[c] = ws.mmem.size();
      for (const auto& m : cache.merged(ws.mslot[c]).members) ws.mmem.push_back(m.first);
    }
    ws.mmem0[mm] = ws.mmem.size();
    const int32_t* mem = ws.mmem.data();
    const size_t total = ws.mmem.size();
    ws.msum.resize(static_cast<size_t>(group) * rows * mm);
    ws.macc.resize(4 * static_cast<size_t>(rows));
    float* acc0 = ws.macc.data();
    float* acc1 = acc0 + rows;
    float* acc2 = acc1 + rows;
    float* acc3 = acc2 + rows;
    for (int g = 0; g < group; ++g) {
      const float* pt = w.probs_t.data() + g * ts + t;
      double* out = ws.msum.data() + static_cast<size_t>(g) * rows * mm;
      // The members' rows lie scattered over the transposed probabilities: each group of members added
      // prefetches the rows kAhead members further in the block's member order (across slots), so their
      // loads are in flight before the adds wait on them.
      constexpr size_t kAhead = 8;
      size_t pf = 0;  // the next member to prefetch
      auto prefetch_to = [&](size_t end) {
        for (end = std::min(end, total); pf < end; ++pf) {
          const float* row = pt + static_cast<size_t>(mem[pf]) * steps;
          for (int k = 0; k < rows; k += kMemberChunk) __builtin_prefetch(row + k);
          __builtin_prefetch(row + rows - 1);
        }
      };
      prefetch_to(kAhead);
      for (int c = 0; c < mm; ++c) {
        const size_t i0 = ws.mmem0[c], nm = ws.mmem0[c + 1] - i0;
        // A slot of fewer than 4 members adds to lane 0 only: the other lanes stay +0.0f, not written.
        const bool four = nm >= 4;
        std::fill_n(acc0, (four ? 4 : 1) * static_cast<size_t>(rows), 0.0f);
        size_t i = 0;
        for (; i + 4 <= nm; i += 4) {
          prefetch_to(i0 + i + 4 + kAhead);
          const float* p0 = pt + static_cast<size_t>(mem[i0 + i]) * steps;
          const float* p1 = pt + static_cast<size_t>(mem[i0 + i + 1]) * steps;
          const float* p2 = pt + static_cast<size_t>(mem[i0 + i + 2]) * steps;
          const float* p3 = pt + static_cast<size_t>(mem[i0 + i + 3]) * steps;
          int k = 0;
#ifdef __AVX2__
          // Lane k of a register is step t + k's sum: the same float additions as the scalar loop below.
          for (; k + 8 <= rows; k += 8) {
            _mm256_storeu_ps(acc0 + k, _mm256_add_ps(_mm256_loadu_ps(acc0 + k), _mm256_loadu_ps(p0 + k)));
            _mm256_storeu_ps(acc1 + k, _mm256_add_ps(_mm256_loadu_ps(acc1 + k), _mm256_loadu_ps(p1 + k)));
            _mm256_storeu_ps(acc2 + k, _mm256_add_ps(_mm256_loadu_ps(acc2 + k), _mm256_loadu_ps(p2 + k)));
            _mm256_storeu_ps(acc3 + k, _mm256_add_ps(_mm256_loadu_ps(acc3 + k), _mm256_loadu_ps(p3 + k)));
          }
#endif
          for (; k < rows; ++k) {
            acc0[k] += p0[k];
            acc1[k] += p1[k];
            acc2[k] += p2[k];
            acc3[k] += p3[k];
          }
        }
        for (; i < nm; ++i) {
          prefetch_to(i0 + i + 1 + kAhead);
          const float* p0 = pt + static_cast<size_t>(mem[i0 + i]) * steps;
          int k = 0;
#ifdef __AVX2__
          for (; k + 8 <= rows; k += 8)
            _mm256_storeu_ps(acc0 + k, _mm256_add_ps(_mm256_loadu_ps(acc0 + k), _mm256_loadu_ps(p0 + k)));
#endif
          for (; k < rows; ++k) acc0[k] += p0[k];
        }
        if (four)
          for (int k = 0; k < rows; ++k)
            out[static_cast<size_t>(k) * mm + c] =
                (static_cast<double>(acc0[k]) + acc1[k]) + (static_cast<double>(acc2[k]) + acc3[k]);
        else
          for (int k = 0; k < rows; ++k)
            out[static_cast<size_t>(k) * mm + c] = (static_cast<double>(acc0[k]) + 0.0f) + (0.0 + 0.0f);
      }
    }
    ws.mb0 = t;
    ws.mbrows = rows;
  }

  // The member sums of the block's step t, group member g (ws.msum, see MemberSums).
  static const double* StepMemberSums(const WorkerScratch& ws, int g, int t) {
    const int mm = static_cast<int>(ws.mslot.size());
    return ws.msum.data() + (static_cast<size_t>(g) * ws.mbrows + (t - ws.mb0)) * mm;
  }

  // For the steps [t, t + kMemberChunk) of the block (those it covers), when every slot is visible at each
  // and the policy reads no attention: their merged weights written in place now (MergedWeights on the same
  // dots and log-normaliser as Step's own call) and their sums over the cache's slots now, four steps per
  // instruction (MergedSlotSumsSteps, from the transposed probabilities): while the version stays, a later
  // step of the chunk holds these slots and appended plain ones (MergedSlotSumsAppend adds them in Step).
  void ChunkSlotSums(int u, int t, const HeadCache& cache, WorkerScratch& ws, bool want_cp) {
    ws.cs0 = ws.cs_end = -1;
    if (want_cp || !g_chunk_sums.load(std::memory_order_relaxed)) return;
    UnitWork& w = units_[u];
    const int steps = meta_.num_decode_steps, group = m_.GroupSize();
    const int end = std::min({t + kMemberChunk, ws.mt0 + ws.mrows, steps});
    for (int t1 = t; t1 < end; ++t1)  // (the first visible key is the same for every group member)
      if (w.refs[0].first[t1] != 0) return;
    const int mm = static_cast<int>(ws.mslot.size()), slots = cache.size();
    const size_t mrows = static_cast<size_t>(ws.mrows) * mm,
                 ts = static_cast<size_t>(meta_.total_tokens()) * steps;
    const LogitTransform tf(m_);
    const float* probs_t = ProbsT(w);
    ws.csums.resize(static_cast<size_t>(group) * kMemberChunk);
    for (int g = 0; g < group; ++g) {
      float* mw = ws.mw.data() + g * mrows + static_cast<size_t>(t - ws.mt0) * mm;
      for (int t1 = t; t1 < end; ++t1)
        MergedWeights(ws.mdot.data() + g * mrows + static_cast<size_t>(t1 - ws.mt0) * mm, mm, tf,
                      w.refs[g].log_z[t1], mw + static_cast<size_t>(t1 - t) * mm);
      MergedSlotSumsSteps(cache.tokens().data(), slots, probs_t + g * ts + t, steps,
                          meta_.tokens.modality.data(), ws.mslot.data(), mm, mw, mm, StepMemberSums(ws, g, t),
                          mm, end - t, ws.csums.data() + static_cast<size_t>(g) * kMemberChunk);
    }
    ws.cs0 = t;
    ws.cs_end = end;
    ws.cslots = slots;
  }

  // The merged slots' output contributions of the run's steps (`extra`, allocated on first use); MarkExtra
  // also records that step t has one (a visible merged slot).
  void EnsureExtra(WorkerScratch& ws) const {
    if (ws.extra.empty())
      ws.extra.assign(static_cast<size_t>(m_.GroupSize()) * meta_.num_decode_steps * m_.head_dim, 0.0f);
  }
  void MarkExtra(WorkerScratch& ws, int t) const {
    if (ws.has_extra[t]) return;
    EnsureExtra(ws);
    ws.has_extra[t] = 1;
  }

  // Adds the block's merged values, weighted by its steps' weights, to those steps' `extra` (one GEMM per
  // group member over the steps [mt0, mt_end) it was used for), and ends the block.
  void FlushMergedBlock(WorkerScratch& ws) const {
    if (ws.mt0 < 0) return;
    const int steps = meta_.num_decode_steps, d = m_.head_dim, group = m_.GroupSize();
    const int rows = ws.mrows, used = ws.mt_end - ws.mt0;
    const int mm = static_cast<int>(ws.mk.size() / d);
    if (used > 0 && mm > 0) {
      EnsureExtra(ws);
      EnsureSingleThreadedBlas();
      for (int g = 0; g < group; ++g)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, used, d, mm, 1.0f,
                    ws.mw.data() + static_cast<size_t>(g) * rows * mm, mm, ws.mv.data(), d, 1.0f,
                    ws.extra.data() + (static_cast<size_t>(g) * steps + ws.mt0) * d, d);
    }
    ws.mlen = used < rows ? std::max(4, 2 * used) : 2 * rows;
    ws.mt0 = ws.mt_end = -1;
    ws.ms0 = ws.mb0 = -1;
    ws.cs0 = ws.cs_end = -1;
  }

  // Appends step t's list, plain[step_begin[t] .. step_begin[t + 1]), to ws.runs as runs of consecutive
  // tokens (RunEnd: eight tokens compared per instruction), in list order.
  static void StepRuns(WorkerScratch& ws, int t) {
    const int32_t* pl = ws.plain.data();
    for (size_t i = ws.step_begin[t], e = ws.step_begin[t + 1]; i < e;) {
      const size_t j = RunEnd(pl, i, e);
      ws.runs.push_back({pl[i], static_cast<int32_t>(j - i), static_cast<int32_t>(i)});
      i = j;
    }
  }

  // The runs of the next step's list (StepRuns of step runs_steps), as FinishRun's pass finds them
  // (WorkerScratch::runs_live).
  static void AddStepRuns(WorkerScratch& ws) {
    if (!ws.runs_live) return;
    StepRuns(ws, ws.runs_steps);
    ++ws.runs_steps;
    if (ws.runs.size() * 16 > ws.plain.size()) {
      ws.runs_live = false;
      ws.runs.clear();
    }
  }

  // Ends the prefix mode (WorkerScratch::prefix): writes the steps so far into `plain` (and their runs).
  static void ExpandPrefix(WorkerScratch& ws) {
    if (!ws.prefix) return;
    ws.plain.clear();
    for (size_t t = 0; t + 1 < ws.step_begin.size(); ++t) {
      ws.plain.insert(ws.plain.end(), ws.ptok.begin(),
                      ws.ptok.begin() + static_cast<std::ptrdiff_t>(ws.step_begin[t + 1] - ws.step_begin[t]));
      AddStepRuns(ws);
    }
    ws.prefix = false;
    ws.ptok.clear();
  }

  // The k-th largest of step t's full probabilities of group member g (zeros beyond the visible keys), the
  // value a descending sort of the row puts at place k - 1: from the regret's buckets when the unit has
  // them and they hold it, else a selection in a copy of the row.
  float FullKth(const UnitWork& w, WorkerScratch& ws, int g, int t, int k) const {
    const DecodeReference& ref = w.refs[g];
    const int first = ref.first[t], len = ref.last(t) - first + 1;
    if (k > len) return 0.0f;
    if (w.use_sums && !w.defer && g_kth_from_sums.load(std::memory_order_relaxed))
      if (const std::optional<float> v = w.sums.Kth(g * meta_.num_decode_steps + t, k, &ws.sorted)) return *v;
    if (w.kth_buckets && g_kth_from_sums.load(std::memory_order_relaxed))
      if (const std::optional<float> v = w.buckets.Kth(
              g * meta_.num_decode_steps + t, {ref.row(t) + first, static_cast<size_t>(len)}, k, &ws.sorted))
        return *v;
    ws.sorted.assign(ref.row(t) + first, ref.row(t) + first + len);
    const auto at = ws.sorted.begin() + (k - 1);
    std::nth_element(ws.sorted.begin(), at, ws.sorted.end(), std::greater<float>());
    return *at;
  }

  // The indices of the k largest of step t's full row of member g over [0, pos] (StepAttention::full_topk:
  // TopKIndicesWithThreshold at FullKth's value) into *out: from the regret's bucket counts in one pass over
  // the row (RowBuckets::TopK) when they count the whole row (no sliding window: the row's visible keys are
  // [0, pos]) and can answer (it declines a k above the row's length), else the threshold and the scan.
  void FullTopK(const UnitWork& w, WorkerScratch& ws, int g, int t, int k, std::vector<int32_t>* out) const {
    const DecodeReference& ref = w.refs[g];
    const int pos = meta_.prefill_length + t;
    const std::span<const float> row(ref.row(t), static_cast<size_t>(pos) + 1);
    if (w.kth_buckets && ref.first[t] == 0 && g_kth_from_sums.load(std::memory_order_relaxed) &&
        w.buckets.TopK(g * meta_.num_decode_steps + t, row, k, &ws.sorted, out))
      return;
    TopKIndicesWithThreshold(row, k, FullKth(w, ws, g, t, k), out);
  }

  // What step t of a run records from its sums for group member g: the step's wsum and retained mass (for
  // FinishRun), its samples' retained / anchor / covered mass and regret, and the run's modality sums.
  void RecordSums(UnitWork& w, RunAccum& a, WorkerScratch& ws, int u, int r, int g, int t, double wsum,
                  double retained, double anchor, double covered, const double ret_mod[4], int visible) {
    const int qh = u * m_.GroupSize() + g, steps = meta_.num_decode_steps;
    const int32_t pos = meta_.prefill_length + t;
    const int first = w.refs[g].first[t];
    const size_t gt = static_cast<size_t>(g) * steps + t;
    ws.wsum[gt] = wsum;
    ws.retained[gt] = retained;
    const size_t si = Sample(qh, t);
    a.retained[si] = static_cast<float>(retained);
    a.anchor[si] = static_cast<float>(anchor);
    a.covered[si] = static_cast<float>(covered);
    // Regret: the mass of the best `visible` tokens of this step minus what the cache retained.
    const int len = pos - first + 1, k = std::min(visible, len);
    if (k != len && k <= w.kpre && w.defer) {  // answered with the row's other k (FinishRegret)
      const size_t at = static_cast<size_t>(r) * m_.GroupSize() * steps + gt;
      w.dk[at] = k;
      w.dret[at] = retained;
    } else {
      const double top = k == len      ? w.top_all[gt]
                         : k <= w.kpre ? (w.use_sums ? w.sums.Sum(static_cast<int>(gt), k, &ws.sorted)
                                                     : w.top_sum[gt * (w.kpre + 1) + k])
                                       : AllSums(w).Sum(static_cast<int>(gt), k, &ws.sorted);
      a.regret[si] = static_cast<float>(top - retained);
      // The next step's row of this member (asked next, with about the same k): its lines on their way.
      if (w.use_sums && !w.defer && t + 1 < steps && k <= w.kpre)
        w.sums.Prefetch(static_cast<int>(gt) + 1, k);
    }
    double* rm = &a.ret_mod[(static_cast<size_t>(layer_.layer) * m_.num_heads + qh) * 4];
    double* fm = &a.full_mod[(static_cast<size_t>(layer_.layer) * m_.num_heads + qh) * 4];
    const double* wfm = &w.full_mod[gt * 4];
    for (int mo = 0; mo < 4; ++mo) {
      rm[mo] += ret_mod[mo];
      fm[mo] += wfm[mo];
    }
  }

  // Whether steps [0, tp) of a prefix-closed run each held every visible token as itself (a cache never
  // holds a token twice or one from the future, CheckCache: so all its slots visible and as many as the
  // visible tokens is the whole visible set) and every group member's rows [0, tp) have exact sums.
  bool WholeRows(const UnitWork& w, const WorkerScratch& ws, int tp) const {
    if (!g_whole_rows.load(std::memory_order_relaxed) || !g_exact_row_sums.load(std::memory_order_relaxed))
      return false;
    const DecodeReference& ref = w.refs[0];
    for (int t = 0; t < tp; ++t) {
      const int first = ref.first[t], slots = ws.pcount[t];
      if (slots != ref.last(t) - first + 1) return false;
      for (int s = 0; first > 0 && s < slots; ++s)
        if (ws.ptok[s] < first) return false;
    }
    for (const DecodeReference& r : w.refs) {
      if (r.exact.empty()) return false;
      for (int t = 0; t < tp; ++t)
        if (r.exact[t] == 0) return false;
    }
    return true;
  }

  // The deferred steps [0, ws.deferred) of a prefix-closed run (WorkerScratch::deferred): their plain-slot
  // sums at once from the unit's transposed probabilities (PrefixSlotSums, bit-identical to PlainSlotSums
  // per step), then what Step records from them, step after step in step order per group member (so the
  // run's modality sums get the same additions in the same order as when Step recorded them). Step's plain
  // path with wsum = covered = retained and no anchor; a step's visible slots are its slots at or after
  // the window's first key.
  void FlushPrefixSums(int u, int r, WorkerScratch& ws) {
    if (ws.deferred == 0) return;
    KVSIM_CHECK(ws.prefix);
    UnitWork& w = units_[u];
    const int tp = ws.deferred, steps = meta_.num_decode_steps, group = m_.GroupSize();
    const size_t ts = static_cast<size_t>(meta_.total_tokens()) * steps;
    ws.deferred = 0;
    ws.pcount.resize(tp);
    for (int t = 0; t < tp; ++t) ws.pcount[t] = static_cast<int>(ws.step_begin[t + 1] - ws.step_begin[t]);
    RunAccum& a = acc_[r];
    if (WholeRows(w, ws, tp)) {
      // Every deferred step held every visible token as itself (e.g. `full`) and every row's sums are exact
      // in any order (DecodeReference::exact): PrefixSlotSums' sums, combined, are the row's own kind sums
      // and total (w.full_mod, from its softmax), bit for bit, so neither they nor the transposed
      // probabilities are computed. The same records in the same order as below.
      g_whole_row_runs.fetch_add(1, std::memory_order_relaxed);
      for (int g = 0; g < group; ++g)
        for (int t = 0; t < tp; ++t) {
          double ret_mod[4];
          std::copy_n(&w.full_mod[(static_cast<size_t>(g) * steps + t) * 4], 4, ret_mod);
          const double retained = (ret_mod[0] + ret_mod[1]) + (ret_mod[2] + ret_mod[3]);
          RecordSums(w, a, ws, u, r, g, t, retained, retained, 0.0, retained, ret_mod, ws.pcount[t]);
        }
      return;
    }
    if (tp <= kRowFlushSteps && g_row_flush.load(std::memory_order_relaxed)) {
      // A few steps (a cache that stopped being prefix-closed after them, e.g. a sliding window's step 0):
      // each from its own row, as Step sums a step that is not deferred (PlainSlotSums, the same bits as
      // PrefixSlotSums), so that no run builds the unit's transposed probabilities for them alone.
      g_row_flushes.fetch_add(1, std::memory_order_relaxed);
      for (int g = 0; g < group; ++g)
        for (int t = 0; t < tp; ++t) {
          double rm[4][4] = {}, ret_mod[4];
          const int visible = PlainSlotSums(ws.ptok.data(), ws.pcount[t], w.refs[g].row(t),
                                            meta_.tokens.modality.data(), w.refs[g].first[t], nullptr, rm);
          const double retained = CombineSlotSums(rm, ret_mod);
          RecordSums(w, a, ws, u, r, g, t, retained, retained, 0.0, retained, ret_mod, visible);
        }
      return;
    }
    ws.psums.resize(static_cast<size_t>(tp) * 16);
    auto* rmt = reinterpret_cast<double(*)[4][4]>(ws.psums.data());
    const float* probs_t = ProbsT(w);
    for (int g = 0; g < group; ++g) {
      PrefixSlotSums(ws.ptok.data(), ws.pcount.data(), tp, probs_t + g * ts, steps,
                     meta_.tokens.modality.data(), rmt);
      for (int t = 0; t < tp; ++t) {
        const int first = w.refs[g].first[t], slots = ws.pcount[t];
        int visible = slots;
        if (first > 0) {
          visible = 0;
          for (int s = 0; s < slots; ++s) visible += ws.ptok[s] >= first;
        }
        double ret_mod[4];
        const double retained = CombineSlotSums(rmt[t], ret_mod);
        RecordSums(w, a, ws, u, r, g, t, retained, retained, 0.0, retained, ret_mod, visible);
      }
    }
  }

  // One decode step of run r on KV head u: the policy's hooks, the cache checks and every metric of the
  // step except the output error, which needs Σ_s w_s v_s and is computed for all steps in FinishRun.
  void Step(int u, int r, int t, WorkerScratch& ws) {
    UnitWork& w = units_[u];
    const int n = meta_.prefill_length, steps = meta_.num_decode_steps;
    const int d = m_.head_dim, group = m_.GroupSize();
    const int32_t pos = n + t;
    const LogitTransform tf(m_);
    std::vector<const float*>& full = ws.full_rows;  // scratch: no allocation per step
    full.resize(group);
    for (int g = 0; g < group; ++g) full[g] = w.refs[g].row(t);
    const RunPlan& plan = plans_[r];
    const auto topk_of = [&](int g, int k, std::vector<int32_t>* out) { FullTopK(w, ws, g, t, k, out); };
    std::function<void(int, int, std::vector<int32_t>*)> topk;
    if (plan.req.future_attention) topk = std::cref(topk_of);  // by reference: no allocation per step
    HeadCache& cache = w.caches[r];
    HeadPolicy& hp = *w.policies[r];
    HeadContext ctx = w.ctx;
    ctx.compress_end = plan.compress_end;
    ctx.scores = nullptr;  // prompt scores are a prefill-time facility
    ctx.plan = plan.policy_plan.get();
    ctx.run_budget = plan.budget;
    const int appended = n - plan.compress_end;
    const int cap = plan.head_budgets[UnitIndex(u)] + appended;
    StepAttention before{t, cache.size(), nullptr, plan.req.future_attention ? full.data() : nullptr,
                         plan.req.future_attention ? &topk : nullptr};
    hp.BeforeStep(ctx, before, cap, &cache);
    if (hp.AppendNewToken()) cache.Append(pos);
    CheckCache(w, ws, cache, pos, r);
    const int limit = (plan.may_exceed ? std::max(cap, w.prefill_size[r]) : cap) + plan.headroom;
    if (plan.evicts)
      KVSIM_CHECK_MSG(cache.size() <= limit, plan.spec->policy->name() + " holds " +
                                                 std::to_string(cache.size()) + " slots at decode, cap " +
                                                 std::to_string(limit));
    else
      KVSIM_CHECK_MSG(cache.size() <= limit + t + 1,
                      plan.spec->policy->name() + " exceeded prompt budget + decode");
    if (recorder_) recorder_->BeforeAttention(plan.index, layer_.layer, u, t, cache);
    RunAccum& a = acc_[r];
    a.tokens[UnitIndex(u) * (steps + 1) + 1 + t] = cache.size();
    const int slots = cache.size();
    // The renormalised attention over the slots, only for a policy whose AfterStep reads it at this step.
    const bool want_cp = plan.req.decode_attention &&
                         (plan.req.decode_attention_steps <= 0 || t < plan.req.decode_attention_steps);
    if (want_cp) ws.cache_probs.assign(static_cast<size_t>(group) * slots, 0.0f);
    const auto tokens = cache.tokens();
    // The step's plain visible slots (the same for every head of the group): the compact product's rows.
    const int first0 = w.refs[0].first[t];
    const bool whole = first0 == 0 && !cache.has_merges();  // every slot is plain and visible
    if (ws.prefix) {
      // Unchanged version: only appends since the previous step (plain slots); they must be newer than its
      // position.
      bool keeps = first0 == 0 && cache.version() == ws.prefix_version && slots >= ws.pslots;
      for (int s = ws.pslots; keeps && s < slots; ++s) keeps = tokens[s] >= pos;
      if (keeps) {
        ws.ptok.insert(ws.ptok.end(), tokens.begin() + ws.pslots, tokens.end());
        ws.pslots = slots;
      } else {
        FlushPrefixSums(u, r, ws);
        ExpandPrefix(ws);
      }
    } else if (t == 0 && first0 == 0 &&
               (!cache.has_merges() || g_merged_prefix.load(std::memory_order_relaxed))) {
      ws.prefix = true;
      ws.prefix_version = cache.version();
      ws.pslots = slots;
      if (cache.has_merges()) {
        ws.ptok.clear();
        for (int s = 0; s < slots; ++s)
          if (!cache.is_merged(s)) ws.ptok.push_back(tokens[s]);
      } else {
        ws.ptok.assign(tokens.begin(), tokens.end());
      }
    }
    if (ws.prefix)
      ws.step_begin.push_back(ws.step_begin.back() + ws.ptok.size());
    else if (whole)
      ws.plain.insert(ws.plain.end(), tokens.begin(), tokens.end());
    else {  // every token written, the kept ones counted (no call per slot)
      size_t k = ws.plain.size();
      ws.plain.resize(k + slots);
      int32_t* out = ws.plain.data();
      for (int s = 0; s < slots; ++s) {
        out[k] = tokens[s];
        k += tokens[s] >= first0 && !cache.is_merged(s);
      }
      ws.plain.resize(k);
    }
    if (!ws.prefix) {
      ws.step_begin.push_back(ws.plain.size());
      AddStepRuns(ws);
    }
    ws.checked[t] = !cache.has_merges();
    // Merged slots in bulk while the cache is unchanged since the previous step (else per step, below).
    const uint64_t version = cache.version();
    bool bulk = false;
    if (cache.has_merges()) {
      if (ws.mt0 >= 0 && ws.mversion == version && t < ws.mt0 + ws.mrows) {
        bulk = true;
      } else if (version == ws.prev_version) {
        BeginMergedBlock(u, t, cache, ws);
        bulk = true;
      } else {
        FlushMergedBlock(ws);
      }
    } else {
      FlushMergedBlock(ws);
    }
    ws.prev_version = version;
    const int mm = bulk ? static_cast<int>(ws.mk.size() / d) : 0;
    const size_t mrow0 = bulk ? static_cast<size_t>(t - ws.mt0) * mm : 0;
    const size_t mrows = bulk ? static_cast<size_t>(ws.mrows) * mm : 0;
    if (bulk) {
      ws.mt_end = t + 1;
      if (ws.ms0 < 0 || t >= ws.ms0 + kMemberChunk) {
        MemberSums(u, t, cache, ws);
        ChunkSlotSums(u, t, cache, ws, want_cp);
      }
    }
    // The merged slots in slot order: the block's, else listed here.
    const int32_t* mslot = nullptr;
    int num_merged = 0;
    if (bulk) {
      mslot = ws.mslot.data();
      num_merged = mm;
    } else if (cache.has_merges()) {
      ws.step_mslot.clear();
      for (int s = 0; s < slots; ++s)
        if (cache.is_merged(s)) ws.step_mslot.push_back(s);
      mslot = ws.step_mslot.data();
      num_merged = static_cast<int>(ws.step_mslot.size());
    }
    if (static_cast<int>(ws.step_mw.size()) < num_merged) {
      ws.step_mw.resize(num_merged);
      ws.step_dot.resize(num_merged);
      ws.step_members.resize(num_merged);
    }
    // A prefix-closed step of a run whose policy reads no attention at all (the requirement, not want_cp:
    // the deferred steps are the run's first ones): its sums later, with the other such steps'
    // (FlushPrefixSums).
    const bool defer = ws.prefix && !plan.req.decode_attention && !cache.has_merges();
    if (defer) ++ws.deferred;
    for (int g = 0; g < group && !defer; ++g) {
      const int qh = u * group + g;
      const DecodeReference& ref = w.refs[g];
      const float* p = ref.row(t);
      const int first = ref.first[t];
      const float lse = ref.log_z[t];
      float* cp = want_cp ? &ws.cache_probs[static_cast<size_t>(g) * slots] : nullptr;
      double wsum = 0, retained = 0, anchor = 0, covered = 0, merged_w = 0, merged_mass = 0;
      double ret_mod[4] = {0, 0, 0, 0};
      int visible = 0;
      if (!cache.has_merges()) {
        // Plain slots only: w_s = p_{a(s)}, and p is zero outside the visible keys, so no branch. The
        // modality sums go to four interleaved accumulators (no serial dependency through one of them).
        double rm[4][4] = {};
        visible = PlainSlotSums(tokens.data(), slots, p, meta_.tokens.modality.data(), first, cp, rm);
        retained = CombineSlotSums(rm, ret_mod);
        wsum = covered = retained;
      } else {
        // The merged slots' weights and member sums (in place in a block, per step outside), then the sums
        // over all slots in slot order (MergedSlotSums).
        const float* weights = nullptr;
        const double* member_sums = nullptr;
        const bool chunked = bulk && t >= ws.cs0 && t < ws.cs_end;
        if (chunked) {
          // Summed over the chunk's first slots already (ChunkSlotSums; every slot visible, the weights in
          // place): only the plain slots appended since are left.
          if (num_merged > 0) MarkExtra(ws, t);
        } else if (bulk) {
          // In a block the step's dots, weights and member sums are rows of ws.mdot, ws.mw and ws.msum: the
          // weights are written in place (all at once, MergedWeights; masked slots get 0) and
          // MergedSlotSums reads all three there (the same values as the per-step path below).
          const float* dots = ws.mdot.data() + g * mrows + mrow0;
          float* mw = ws.mw.data() + g * mrows + mrow0;
          int masked = 0;
          if (first > 0)
            for (int j = 0; j < num_merged; ++j) masked += tokens[mslot[j]] < first;
          if (masked == 0) {
            MergedWeights(dots, num_merged, tf, lse, mw);
          } else {
            MergedWeights(dots, num_merged, tf, lse, ws.step_mw.data());
            for (int j = 0; j < num_merged; ++j)  // outside a sliding window: masked, weight 0
              mw[j] = tokens[mslot[j]] >= first ? ws.step_mw[j] : 0.0f;
          }
          if (masked < num_merged) MarkExtra(ws, t);
          weights = mw;
          member_sums = StepMemberSums(ws, g, t);
        } else {
          // Per step (the cache changed since the previous step): first the merged slots alone (their dots,
          // weights, member sums and output contributions: every call of the step), then the sums over all
          // slots in slot order (MergedSlotSums: no calls, the sums in registers), which adds the same values
          // in the same order as one loop doing both did. The weights all at once (MergedWeights; masked
          // slots' dots are 0 and their weights never read).
          for (int j = 0; j < num_merged; ++j) {
            const int s = mslot[j];
            ws.step_dot[j] =
                tokens[s] < first ? 0.0f : Dot(DecodeQuery(qh, t), cache.merged(s).key.data(), d);
          }
          MergedWeights(ws.step_dot.data(), num_merged, tf, lse, ws.step_mw.data());
          for (int j = 0; j < num_merged; ++j) {
            const int s = mslot[j];
            if (tokens[s] < first) continue;  // outside a sliding window: masked
            const MergedSlot& ms = cache.merged(s);
            const float wgt = ws.step_mw[j];
            // Σ p over the members with four independent partial sums in registers (no serial dependency
            // chain).
            double members;
            {
              const auto* mem = ms.members.data();
              const size_t nm = ms.members.size();
              float m0 = 0, m1 = 0, m2 = 0, m3 = 0;
              size_t i = 0;
              for (; i + 4 <= nm; i += 4) {
                m0 += p[mem[i].first];
                m1 += p[mem[i + 1].first];
                m2 += p[mem[i + 2].first];
                m3 += p[mem[i + 3].first];
              }
              for (; i < nm; ++i) m0 += p[mem[i].first];
              members = (static_cast<double>(m0) + m1) + (static_cast<double>(m2) + m3);
            }
            ws.step_members[j] = members;
            // The merged value is no original row: its contribution is added to the step's output here.
            MarkExtra(ws, t);
            float* ex = &ws.extra[(static_cast<size_t>(g) * steps + t) * d];
            const float* v = ms.value.data();
            for (int k = 0; k < d; ++k) ex[k] += wgt * v[k];
          }
          weights = ws.step_mw.data();
          member_sums = ws.step_members.data();
        }
        MergedSlotSumsResult sums;
        if (chunked) {
          sums = ws.csums[static_cast<size_t>(g) * kMemberChunk + (t - ws.cs0)];
          MergedSlotSumsAppend(tokens.data() + ws.cslots, slots - ws.cslots, p, meta_.tokens.modality.data(),
                               &sums);
        } else {
          sums = MergedSlotSums(tokens.data(), slots, p, meta_.tokens.modality.data(), first, mslot,
                                num_merged, weights, member_sums, cp);
        }
        wsum = sums.wsum;
        retained = sums.retained;
        anchor = sums.anchor;
        covered = sums.covered;
        merged_w = sums.merged_w;
        merged_mass = sums.merged_mass;
        std::copy_n(sums.ret_mod, 4, ret_mod);
        visible = sums.visible;
      }
      RecordSums(w, a, ws, u, r, g, t, wsum, retained, anchor, covered, ret_mod, visible);
      if (merged_mass > 0) {
        a.merged_share_sum[UnitIndex(u)] += merged_w / merged_mass;
        ++a.merged_share_n[UnitIndex(u)];
      }
      if (cp && wsum > 0) {
        const double inv = 1.0 / wsum;
        for (int s = 0; s < slots; ++s) cp[s] = static_cast<float>(cp[s] * inv);
      }
    }
    StepAttention after{t, slots, want_cp ? ws.cache_probs.data() : nullptr,
                        plan.req.future_attention ? full.data() : nullptr,
                        plan.req.future_attention ? &topk : nullptr};
    hp.AfterStep(ctx, after, &cache);
    if (recorder_) recorder_->AfterStep(plan.index, layer_.layer, u, t, cache);
    if (t == 0 && plan.compression_step == 0) {
      CheckCache(w, ws, cache, pos, r);
      RecordCompression(plan, cache, u, &a);
    }
    if (t == steps - 1) RecordMerges(cache, u, &a);
  }

  // Does step 0 hold every visible token as itself, and are steps 1.. prefix-closed (each step's plain
  // slots begin with the previous step's, and the tokens it adds lie past the previous step's position,
  // where that step's p is zero)? Then FinishRun takes step 0's output row from the reference and gathers
  // the other steps' rows whole over the last step's tokens. The run's own lists only.
  bool SplitsStepZero(const UnitWork& w, const WorkerScratch& ws) const {
    const int steps = meta_.num_decode_steps;
    if (steps < 2 || ws.prefix) return false;
    const DecodeReference& ref = w.refs[0];
    const auto& sb = ws.step_begin;
    if (static_cast<int64_t>(sb[1] - sb[0]) != ref.last(0) - ref.first[0] + 1) return false;
    const int32_t* pl = ws.plain.data();
    for (int t = 1; t + 1 < steps; ++t) {
      const size_t a = sb[t], na = sb[t + 1] - a, b = sb[t + 1], nb = sb[t + 2] - b;
      if (nb < na || !std::equal(pl + a, pl + a + na, pl + b)) return false;
      const int32_t last = ref.last(t);
      for (size_t i = b + na; i < b + nb; ++i)
        if (pl[i] <= last) return false;
    }
    return true;
  }

  // The outputs ô_t = Σ_s w_s v_s / Σ_s w_s of every step of run r on KV head u, then the output error and
  // the eviction bound per sample. The plain slots' part of all steps is one product: the union U of the
  // tokens any step kept as themselves, A[g·S + t][U] = p_t (zero where step t did not keep the token) times
  // V[U] (a run whose every step kept every visible token is the reference product itself). When the union
  // is much wider than the steps' caches (a cache re-selected every step), a per-step gather is cheaper.
  // When every step holds every visible decode token as itself, A's decode columns are the reference
  // probabilities' own, the same for every such run of the unit: the product covers U's other tokens and
  // the unit's decode part (DecodePart, computed once) is added to it, out = A[:, U \ D] V[U \ D] + Y.
  void FinishRun(int u, int r, WorkerScratch& ws) {
    FlushMergedBlock(ws);
    FlushPrefixSums(u, r, ws);
    UnitWork& w = units_[u];
    const int steps = meta_.num_decode_steps, d = m_.head_dim;
    const int group = m_.GroupSize();
    const float* values = w.ctx.values;
    const size_t rows = static_cast<size_t>(group) * steps;
    const int n = meta_.prefill_length;
    GrowTo(ws.out, rows * d);  // every path below writes every element (the products with beta 0)
    bool decode_part = false;  // the product leaves out the decode tokens, the last `steps` columns of U
    // The product A[:, :k] V[:k] over U's first k tokens (A: lda columns; ws.vu holds their value rows).
    auto product = [&](size_t k, size_t lda) {
      if (k == 0) {
        std::fill(ws.out.begin(), ws.out.begin() + rows * d, 0.0f);
        return;
      }
      EnsureSingleThreadedBlas();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows), d, static_cast<int>(k),
                  1.0f, ws.a.data(), static_cast<int>(lda), ws.vu.data(), d, 0.0f, ws.out.data(), d);
    };
    bool everything = true;  // every step kept every visible token as itself
    for (int t = 0; t < steps && everything; ++t)
      everything = static_cast<int>(ws.step_begin[t + 1] - ws.step_begin[t]) ==
                   w.refs[0].last(t) - w.refs[0].first[t] + 1;
    // Prefix-closed steps (below): the prefix mode's, or steps 1.. after a step 0 that held every visible
    // token as itself (SplitsStepZero: a cache compressed after step 0, then appended to, e.g. MEDA's
    // official code). Then step 0's rows are the reference's own (its output row, exactly as the
    // `everything` path copies it) and the product covers the other steps' union (the last step's tokens):
    // its step-0 rows are computed with the others' and overwritten. Decided by the run's own lists.
    const int32_t* pre_tok = nullptr;  // U's tokens (unsorted) and how many; the steps' slots in all
    size_t pre_n = 0, pre_gathered = 0;
    bool split0 = false;
    if (!everything) {
      if (ws.prefix) {
        pre_tok = ws.ptok.data();
        pre_n = ws.ptok.size();
        pre_gathered = ws.step_begin.back();
      } else if (g_step0_split.load(std::memory_order_relaxed) && SplitsStepZero(w, ws)) {
        split0 = true;
        pre_tok = ws.plain.data() + ws.step_begin[steps - 1];
        pre_n = ws.step_begin[steps] - ws.step_begin[steps - 1];
        pre_gathered = ws.step_begin[steps] - ws.step_begin[1];
      }
    }
    const bool prefix_path = pre_n > 0 && pre_n * static_cast<size_t>(steps - split0) <= 4 * pre_gathered;
    split0 = split0 && prefix_path;  // else the token-by-token branch below, every step as before
    if (split0) g_step0_splits.fetch_add(1, std::memory_order_relaxed);
    if (everything) {
      for (int g = 0; g < group; ++g)
        std::copy(w.refs[g].output.begin(), w.refs[g].output.end(),
                  ws.out.begin() + static_cast<size_t>(g) * steps * d);
    } else if (prefix_path) {
      // Prefix-closed steps: U is the last step's tokens, and every token of U that step t did not hold
      // came later, past step t's position, where p_t is zero: A's rows are gathered whole, the same values
      // in the same layout as the scatter below writes. A[g·S + t][c] = p_t[used[c]] is copied from the
      // unit's transposed probabilities, whose row used[c] holds that column's steps contiguously, in 8 x 8
      // tiles (TransposeTile8) instead of one indexed load per element.
      ws.used.assign(pre_tok, pre_tok + pre_n);
      std::sort(ws.used.begin(), ws.used.end());
      // U holds the decode tokens [n, n + S) (its last S tokens) only if every step held its visible ones
      // (prefix-closed): A's rows are whole rows of p, so its decode columns are the decode part's.
      decode_part = g_decode_part.load(std::memory_order_relaxed) && steps > 0 &&
                    ws.used.size() >= static_cast<size_t>(steps) && ws.used[ws.used.size() - steps] == n;
      const size_t nu = ws.used.size() - (decode_part ? steps : 0);
      // A ranked run (HeadPolicy::PrefillRank) adds its columns in rank order, kRankBand at a time: out =
      // (((0 + X_0) + X_1) + ...) + X_last, X_b = A[:, band b] V[band b]. Its first bands' sum may come from
      // a run of the unit that added the same tokens in the same order (ResumeBands): the same products of
      // the same shapes added in the same order, so the same bits as adding them here.
      const bool ranked =
          g_rank_bands.load(std::memory_order_relaxed) && RankOrder(w.policies[r]->PrefillRank(), nu, ws);
      const size_t from = ranked ? ResumeBands(w, nu, rows * d, ws) : 0;
      const size_t k = nu - from;  // the columns built here: cols[0, k)
      const int32_t* used = ranked ? ws.order.data() + from : ws.used.data();
      GrowTo(ws.a, rows * k);
      GrowTo(ws.vu, k * d);
      for (size_t c = 0; c < k; ++c)
        std::copy_n(values + static_cast<size_t>(used[c]) * d, d, ws.vu.data() + c * d);
      const float* probs_t = ProbsT(w);
      const size_t ts = static_cast<size_t>(meta_.total_tokens()) * steps;
      for (int g = 0; g < group; ++g) {
        const float* pg = probs_t + g * ts;
        float* ag = ws.a.data() + static_cast<size_t>(g) * steps * k;
        size_t c0 = 0;
        for (; c0 + 8 <= k; c0 += 8) {
          const float* src[8];
          for (int i = 0; i < 8; ++i) src[i] = pg + static_cast<size_t>(used[c0 + i]) * steps;
          int t = 0;
          for (; t + 8 <= steps; t += 8) TransposeTile8(src, t, ag + static_cast<size_t>(t) * k + c0, k);
          for (; t < steps; ++t)
            for (int i = 0; i < 8; ++i) ag[static_cast<size_t>(t) * k + c0 + i] = src[i][t];
        }
        for (; c0 < k; ++c0) {
          const float* src = pg + static_cast<size_t>(used[c0]) * steps;
          for (int t = 0; t < steps; ++t) ag[static_cast<size_t>(t) * k + c0] = src[t];
        }
      }
      if (!ranked) {
        product(nu, nu);
      } else {
        BandProducts(u, r, nu, from, from, k, ws);
      }
    } else {
      ExpandPrefix(ws);
      ws.used.clear();
      // The steps' lists as runs of consecutive tokens (a sliding window is two runs per step): with few
      // runs, the union U is the merge of the runs' intervals and A's rows are copies of p's stretches; the
      // same U (ascending) and the same A as the token-by-token loops below.
      const size_t gathered = ws.plain.size();
      {
        // The runs step by step (StepRuns), given up after the first step that brings them to more than one
        // per 16 slots (then the token-by-token loops below). Step found them already
        // (WorkerScratch::runs_live) unless it gave up: then they are more than one per 16 slots of the
        // steps so far, and (if they are not more than one per 16 slots of all steps) found here.
        const int32_t* pl = ws.plain.data();
        bool by_runs = gathered > 0 && g_run_lists.load(std::memory_order_relaxed);
        const bool found = ws.runs_live && ws.runs_steps == steps;
        if (!found || !by_runs || ws.runs.size() * 16 > gathered) ws.runs.clear();
        if (found) by_runs = by_runs && !ws.runs.empty();
        for (int t = 0; t < steps && by_runs && !found; ++t) {
          StepRuns(ws, t);
          if (ws.runs.size() * 16 > gathered) {
            by_runs = false;
            ws.runs.clear();
          }
        }
        if (by_runs) {
          std::vector<WorkerScratch::TokenRun> iv(ws.runs);
          std::sort(iv.begin(), iv.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
          int32_t next = std::numeric_limits<int32_t>::min();  // the first token after U so far
          for (const auto& r : iv) {
            const int32_t end = r.first + r.len;
            for (int32_t tok = std::max(next, r.first); tok < end; ++tok) ws.used.push_back(tok);
            next = std::max(next, end);
          }
        } else {
          // U ascending. Every listed token is marked (one store each, no branch) and, when the tokens'
          // range is no longer than the lists (a cache re-selected every step, e.g. oracle's), U is one scan
          // of the markers over that range; otherwise the first sight of each token is listed and the list
          // sorted. The same tokens in the same order.
          int32_t t0 = std::numeric_limits<int32_t>::max(), t1 = -1;
          if (g_union_scan.load(std::memory_order_relaxed)) {
            for (size_t i = 0; i < gathered; ++i) {
              t0 = std::min(t0, pl[i]);
              t1 = std::max(t1, pl[i]);
            }
          }
          if (t1 >= t0 && static_cast<size_t>(t1 - t0) < gathered) {
            for (size_t i = 0; i < gathered; ++i) ws.col[pl[i]] = 0;
            ws.used.resize(static_cast<size_t>(t1 - t0) + 1);
            size_t c = 0;
            for (int32_t tok = t0; tok <= t1; ++tok) {
              ws.used[c] = tok;
              c += ws.col[tok] >= 0;
            }
            ws.used.resize(c);
          } else {
            for (size_t i = 0; i < gathered; ++i)
              if (ws.col[pl[i]] < 0) {
                ws.col[pl[i]] = 0;
                ws.used.push_back(pl[i]);
              }
            std::sort(ws.used.begin(), ws.used.end());
          }
        }
      }
      const size_t nu = ws.used.size();
      if (nu > 0 && nu * steps <= 4 * gathered) {
        // Does every step hold its visible decode tokens [max(n, first), n + t]? Then U ends with [n, n + S)
        // (step t holds token n + t) and A's decode columns are p's (zero where p is).
        decode_part =
            g_decode_part.load(std::memory_order_relaxed) && steps > 0 && nu >= static_cast<size_t>(steps);
        // With the lists as runs (ascending consecutive tokens), a run's tokens at or after lo are counted at
        // once: the same count as the token-by-token loop, without another pass over the lists.
        const bool held_by_runs = !ws.runs.empty() && g_held_by_runs.load(std::memory_order_relaxed);
        size_t hri = 0;  // the next run (step by step, in list order)
        for (int t = 0; t < steps && decode_part; ++t) {
          const int32_t lo = std::max(n, w.refs[0].first[t]);
          size_t held = 0;
          if (held_by_runs) {
            for (; hri < ws.runs.size() && static_cast<size_t>(ws.runs[hri].at) < ws.step_begin[t + 1];
                 ++hri) {
              const int32_t end = ws.runs[hri].first + ws.runs[hri].len;
              held += static_cast<size_t>(std::max(0, end - std::max(ws.runs[hri].first, lo)));
            }
          } else {
            for (size_t i = ws.step_begin[t]; i < ws.step_begin[t + 1]; ++i) held += ws.plain[i] >= lo;
          }
          decode_part = held == static_cast<size_t>(n + t - lo + 1);
        }
        const size_t k = nu - (decode_part ? steps : 0);
        // Position bands: a sliding window's full tokens (held at every step, PositionOrder) are added
        // first, in bands of kRankBand columns, resuming another run's band sums as a ranked run does
        // (ResumeBands); then the other columns but the decode part's, as one product in token order.
        size_t full = 0, from = 0;
        if (!ws.runs.empty() && g_rank_bands.load(std::memory_order_relaxed) &&
            w.refs[0].first[steps - 1] == 0) {
          full = PositionOrder(n, steps, ws);
          if (full > 0) {
            ws.used.assign(ws.order.begin(), ws.order.end());
            from = ResumeBands(w, full, rows * d, ws);
            ws.span.resize(nu);
            ws.span[nu - 1] = 1;
            for (size_t c = nu - 1; c-- > 0;)
              ws.span[c] = ws.used[c + 1] == ws.used[c] + 1 ? ws.span[c + 1] + 1 : 1;
          }
        }
        for (size_t c = 0; c < nu; ++c) ws.col[ws.used[c]] = static_cast<int32_t>(c);
        GrowTo(ws.a, rows * nu);  // zeroed row by row below, just before its scatter
        GrowTo(ws.vu, (k - from) * d);
        // The value rows of each product's columns (the bands of the full columns, then [full, k)): read in
        // place when the columns' tokens are consecutive (a window's bands: the same rows, d apart, as the
        // copy would hold, so the same operand), copied into ws.vu otherwise.
        ws.band_v.clear();
        const bool in_place = full > 0 && g_in_place_v.load(std::memory_order_relaxed);
        auto rows_of = [&](size_t c0, size_t c1) -> const float* {
          if (in_place && ws.span[c0] >= static_cast<int32_t>(c1 - c0))
            return values + static_cast<size_t>(ws.used[c0]) * d;
          for (size_t c = c0; c < c1; ++c)
            std::copy_n(values + static_cast<size_t>(ws.used[c]) * d, d, ws.vu.data() + (c - from) * d);
          return ws.vu.data() + (c0 - from) * d;
        };
        for (size_t c = from; c < full; c += kRankBand)
          ws.band_v.push_back(rows_of(c, std::min(full, c + kRankBand)));
        // With one query head per KV head (A's rows are the steps' rows of p), a band of consecutive tokens
        // reads A in place too: the reference probabilities' rows from its first token on, T apart, hold the
        // values the copy would (p_t[tok], zero where p is), so the same operand. A's columns of the resumed
        // bands [0, from) and of the first bands that read in place, [from, skip_full), are not written (no
        // product reads them); a band after one that cannot (sinks and a window's oldest tokens together)
        // reads ws.a.
        ws.band_a.clear();
        size_t skip_full = 0;
        if (g_in_place_a.load(std::memory_order_relaxed)) {
          skip_full = from;
          for (size_t c = from; c < full; c += kRankBand) {
            const size_t c1 = std::min(full, c + kRankBand);
            const bool a_in_place =
                in_place && group == 1 && skip_full == c && ws.span[c] >= static_cast<int32_t>(c1 - c);
            ws.band_a.push_back(a_in_place ? w.refs[0].row(0) + ws.used[c] : nullptr);
            if (a_in_place) skip_full = c1;
          }
        }
        const float* rest_v = k > full ? rows_of(std::max(full, from), k) : nullptr;
        for (int g = 0; g < group; ++g) {
          size_t ri = 0;  // the next run (ws.runs: step by step, in list order)
          for (int t = 0; t < steps; ++t) {
            const float* p = w.refs[g].row(t);
            float* row = ws.a.data() + (static_cast<size_t>(g) * steps + t) * nu;
            if (full > 0) {
              // Every step writes every full column (the first `full`): only the others are zeroed. A run of
              // tokens is copied in pieces of consecutive columns (it may span blocks).
              std::fill(row + full, row + nu, 0.0f);
              for (; ri < ws.runs.size() && static_cast<size_t>(ws.runs[ri].at) < ws.step_begin[t + 1]; ++ri)
                for (int32_t f = ws.runs[ri].first, len = ws.runs[ri].len; len > 0;) {
                  const size_t c = static_cast<size_t>(ws.col[f]);
                  const int32_t l = std::min(len, ws.span[c]);
                  // Columns below skip_full are not read (above): only the piece's part past them.
                  const int32_t sk = c < skip_full ? std::min(l, static_cast<int32_t>(skip_full - c)) : 0;
                  std::copy_n(p + f + sk, l - sk, row + c + sk);
                  f += l;
                  len -= l;
                }
            } else if (!ws.runs.empty()) {  // a run's tokens are consecutive in U, so its columns too
              // The step's runs [ri, re). In ascending columns (a window, or sinks then a window) only the
              // gaps between them are zeroed; in any other order the whole row first.
              size_t re = ri;
              bool ascending = true;
              for (int32_t end = 0;
                   re < ws.runs.size() && static_cast<size_t>(ws.runs[re].at) < ws.step_begin[t + 1]; ++re) {
                const int32_t c = ws.col[ws.runs[re].first];
                ascending = ascending && c >= end;
                end = c + ws.runs[re].len;
              }
              if (!ascending) std::fill(row, row + nu, 0.0f);
              size_t zeroed = 0;  // ascending: columns [0, zeroed) are written
              for (; ri < re; ++ri) {
                const size_t c = static_cast<size_t>(ws.col[ws.runs[ri].first]);
                if (ascending) std::fill(row + zeroed, row + c, 0.0f);
                std::copy_n(p + ws.runs[ri].first, ws.runs[ri].len, row + c);
                zeroed = c + static_cast<size_t>(ws.runs[ri].len);
              }
              if (ascending) std::fill(row + zeroed, row + nu, 0.0f);
            } else {
              std::fill(row, row + nu, 0.0f);
              for (size_t i = ws.step_begin[t]; i < ws.step_begin[t + 1]; ++i)
                row[ws.col[ws.plain[i]]] = p[ws.plain[i]];
            }
          }
        }
        if (full == 0) {
          product(k, nu);
        } else {
          BandProducts(u, r, full, from, 0, nu, ws, ws.band_v.data(),
                       ws.band_a.empty() ? nullptr : ws.band_a.data(),
                       static_cast<size_t>(meta_.total_tokens()));
          if (k > full) {
            EnsureSingleThreadedBlas();
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows), d,
                        static_cast<int>(k - full), 1.0f, ws.a.data() + full, static_cast<int>(nu), rest_v, d,
                        1.0f, ws.out.data(), d);
          }
        }
      } else {
        // Per step: out[k] += p[tok] * v[k] over the step's slots in order, the row kept in registers. Steps
        // whose slot lists begin alike (a cache rewritten once, then appended to) share their value-row
        // loads over the common slots (GatherWeightedRowsSteps: the same bits).
        auto list = [&](int t) { return ws.plain.data() + ws.step_begin[t]; };
        auto count = [&](int t) { return ws.step_begin[t + 1] - ws.step_begin[t]; };
        constexpr size_t kMinShared = 32;  // fewer common slots: not worth the grouping
        for (int g = 0; g < group; ++g) {
          float* og = ws.out.data() + static_cast<size_t>(g) * steps * d;
          int t = 0;
          for (; t + kGatherSteps <= steps; t += kGatherSteps) {
            size_t common = count(t);
            for (int s = 1; s < kGatherSteps && common >= kMinShared; ++s) {
              const int32_t *a = list(t), *b = list(t + s);
              const size_t lim = std::min(common, count(t + s));
              size_t c = 0;
              while (c < lim && a[c] == b[c]) ++c;
              common = c;
            }
            if (common < kMinShared) {
              for (int s = 0; s < kGatherSteps; ++s)
                GatherWeightedRows(w.refs[g].row(t + s), list(t + s), count(t + s), values, d,
                                   og + static_cast<size_t>(t + s) * d);
              continue;
            }
            const float* p[kGatherSteps];
            const int32_t* tok[kGatherSteps];
            size_t n[kGatherSteps];
            float* o[kGatherSteps];
            for (int s = 0; s < kGatherSteps; ++s) {
              p[s] = w.refs[g].row(t + s);
              tok[s] = list(t + s);
              n[s] = count(t + s);
              o[s] = og + static_cast<size_t>(t + s) * d;
            }
            GatherWeightedRowsSteps(p, tok, n, common, values, d, o);
          }
          for (; t < steps; ++t)
            GatherWeightedRows(w.refs[g].row(t), list(t), count(t), values, d,
                               og + static_cast<size_t>(t) * d);
        }
      }
      for (int32_t tok : ws.used) ws.col[tok] = -1;
    }
    if (decode_part) {
      const float* y = DecodePart(w);
      for (size_t i = 0; i < rows * d; ++i) ws.out[i] += y[i];
    }
    if (split0)
      for (int g = 0; g < group; ++g)
        std::copy_n(w.refs[g].out(0), d, ws.out.begin() + static_cast<size_t>(g) * steps * d);
    RunAccum& a = acc_[r];
    for (size_t gt = 0; gt < rows; ++gt)
      if (ws.has_extra[gt % steps]) {
        float* out = ws.out.data() + gt * d;
        const float* ex = &ws.extra[gt * d];
        for (int k = 0; k < d; ++k) out[k] += ex[k];
      }
    // ô = out / wsum; relative error against the full output. Four rows at a time: each row's two sums
    // are still added over k in order, but the eight chains are independent (one row's serial chains kept
    // the core waiting on the adder).
    constexpr int kRows = 4;
    for (int g = 0; g < group; ++g) {
      const int qh = u * group + g;
      for (int t0 = 0; t0 < steps; t0 += kRows) {
        const int nb = std::min(kRows, steps - t0);
        const float* out[kRows];
        const float* o[kRows];
        double inv[kRows], diff2[kRows] = {}, o2[kRows] = {};
        for (int b = 0; b < kRows; ++b) {
          const int t = t0 + std::min(b, nb - 1);  // a short last block repeats its last row (unused)
          const size_t gt = static_cast<size_t>(g) * steps + t;
          out[b] = ws.out.data() + gt * d;
          o[b] = w.refs[g].out(t);
          inv[b] = ws.wsum[gt] > 0 ? 1.0 / ws.wsum[gt] : 0.0;
        }
        for (int k = 0; k < d; ++k)
          for (int b = 0; b < kRows; ++b) {
            const double dk = out[b][k] * inv[b] - o[b][k];
            diff2[b] += dk * dk;
            o2[b] += static_cast<double>(o[b][k]) * o[b][k];
          }
        for (int b = 0; b < nb; ++b) {
          const int t = t0 + b;
          const size_t gt = static_cast<size_t>(g) * steps + t;
          const double diff = std::sqrt(diff2[b]);
          a.err[Sample(qh, t)] = static_cast<float>(o2[b] > 0 ? diff / std::sqrt(o2[b]) : diff);
          if (ws.checked[t]) {
            const double bound = 2.0 * std::max(0.0, 1.0 - ws.retained[gt]) * w.max_vnorm[t];
            ++a.bound_checks[UnitIndex(u)];
            if (diff > bound + 1e-4 * w.max_vnorm[t] + 1e-6) ++a.bound_viol[UnitIndex(u)];
          }
        }
      }
    }
  }

  const TraceMeta& meta_;
  const ModelInfo& m_;
  const LayerData& layer_;
  std::span<const RunPlan> plans_;
  std::vector<RunAccum>& acc_;
  int threads_;
  DecisionRecorder* recorder_;
  PassBuffers& buffers_;
  std::vector<UnitWork> units_;
  std::vector<WorkerScratch>& scratch_;  // buffers_.scratch
};

void SetByModality(ByModality* b, const double v[4]) {
  b->set_text(v[0]);
  b->set_image(v[1]);
  b->set_video(v[2]);
  b->set_other(v[3]);
}

// Fills quality metrics from the samples of layers [l0, l1).
void FillQuality(const TraceMeta& meta, const RunAccum& a, int l0, int l1, Metrics* m) {
  const int h = meta.model.num_heads, hkv = meta.model.num_kv_heads, s = meta.num_decode_steps;
  const size_t b = static_cast<size_t>(l0) * h * s, e = static_cast<size_t>(l1) * h * s;
  // Means over the samples in place; a quantile partially sorts one copy (Quantile's own), not two.
  auto span = [&](const std::vector<float>& v) { return std::span<const float>(v.data() + b, e - b); };
  auto copy = [&](const std::vector<float>& v) { return std::vector<float>(v.begin() + b, v.begin() + e); };
  m->set_samples(static_cast<double>(e - b));
  m->set_retained_mass_mean(Mean(span(a.retained)));
  m->set_retained_mass_p5(Quantile(copy(a.retained), 0.05));
  m->set_merged_anchor_mass_mean(Mean(span(a.anchor)));
  m->set_covered_mass_mean(Mean(span(a.covered)));
  m->set_output_rel_error_mean(Mean(span(a.err)));
  m->set_output_rel_error_p95(Quantile(copy(a.err), 0.95));
  m->set_regret_vs_oracle_mean(Mean(span(a.regret)));
  m->set_regret_vs_oracle_p95(Quantile(copy(a.regret), 0.95));
  double rm[4] = {0, 0, 0, 0}, fm[4] = {0, 0, 0, 0}, km[4] = {0, 0, 0, 0};
  for (size_t i = static_cast<size_t>(l0) * h; i < static_cast<size_t>(l1) * h; ++i)
    for (int mo = 0; mo < 4; ++mo) {
      rm[mo] += a.ret_mod[i * 4 + mo];
      fm[mo] += a.full_mod[i * 4 + mo];
    }
  const double samples = std::max<double>(1, e - b);
  int64_t checks = 0, viol = 0, share_n = 0;
  double share = 0;
  for (size_t i = static_cast<size_t>(l0) * hkv; i < static_cast<size_t>(l1) * hkv; ++i) {
    checks += a.bound_checks[i];
    viol += a.bound_viol[i];
    share += a.merged_share_sum[i];
    share_n += a.merged_share_n[i];
    for (int mo = 0; mo < 4; ++mo) km[mo] += a.kept_mod[i * 4 + mo];
  }
  const double units = std::max(1, (l1 - l0) * hkv);
  for (int mo = 0; mo < 4; ++mo) {
    rm[mo] /= samples;
    fm[mo] /= samples;
    km[mo] /= units;
  }
  SetByModality(m->mutable_retained_mass_by_modality(), rm);
  SetByModality(m->mutable_full_mass_by_modality(), fm);
  SetByModality(m->mutable_kept_tokens_by_modality(), km);
  m->set_bound_checks(static_cast<double>(checks));
  m->set_bound_violations(static_cast<double>(viol));
  m->set_merged_weight_over_mass_mean(share_n > 0 ? share / share_n : 0.0);
  double prompt = 0, merged = 0, slots = 0, most = 0;
  for (size_t i = static_cast<size_t>(l0) * hkv; i < static_cast<size_t>(l1) * hkv; ++i) {
    prompt += a.prompt_kept[i];
    merged += a.merged_tokens[i];
    slots += a.merged_slots[i];
    most = std::max<double>(most, a.merge_max[i]);
  }
  m->set_prompt_kept_tokens_mean(prompt / units);
  m->set_merged_tokens_mean(merged / units);
  m->set_merged_slots_mean(slots / units);
  m->set_merge_members_max(most);
}

// The request's timeline: prefill chunks (the compression hook runs at the end of the last one), then
// one event per decode step. KV tokens held over layers [l0, l1) at each event, for the policy and for
// the full cache: before the hook a chunk holds its uncompressed prefix.
struct EventTokens {
  std::vector<int> chunk_len;  // prompt tokens processed by each prefill chunk
  std::vector<double> tokens, full_tokens;
};
EventTokens Timeline(const TraceMeta& meta, const RunAccum& a, int l0, int l1, int chunk) {
  const int hkv = meta.model.num_kv_heads, s = meta.num_decode_steps, n = meta.prefill_length;
  const double heads = static_cast<double>(l1 - l0) * hkv;
  EventTokens ev;
  if (chunk <= 0 || chunk >= n) chunk = n;
  for (int begin = 0; begin < n; begin += chunk) ev.chunk_len.push_back(std::min(chunk, n - begin));
  int done = 0;
  for (size_t c = 0; c + 1 < ev.chunk_len.size(); ++c) {
    done += ev.chunk_len[c];
    ev.tokens.push_back(done * heads);
    ev.full_tokens.push_back(done * heads);
  }
  for (int e = 0; e <= s; ++e) {
    double tokens = 0;
    for (int l = l0; l < l1; ++l)
      for (int u = 0; u < hkv; ++u) tokens += a.tokens[(static_cast<size_t>(l) * hkv + u) * (s + 1) + e];
    ev.tokens.push_back(tokens);
    ev.full_tokens.push_back((n + e) * heads);
  }
  return ev;
}

// Memory over the event timeline `ev` of `num_layers` layers; `dur` holds the duration of every event.
void FillMemory(const TraceMeta& meta, const EventTokens& ev, int num_layers, const std::vector<double>& dur,
                Metrics* m) {
  const int hkv = meta.model.num_kv_heads, s = meta.num_decode_steps;
  const double bytes_per_token = 2.0 * meta.model.head_dim * meta.model.ModelDtypeBytes();
  const size_t first_decode = ev.tokens.size() - s;
  double peak = 0, fp = 0, full_peak = 0, full_fp = 0, total = 0, kept_sum = 0;
  for (size_t e = 0; e < ev.tokens.size(); ++e) {
    peak = std::max(peak, ev.tokens[e] * bytes_per_token);
    full_peak = std::max(full_peak, ev.full_tokens[e] * bytes_per_token);
    fp += ev.tokens[e] * bytes_per_token * dur[e];
    full_fp += ev.full_tokens[e] * bytes_per_token * dur[e];
    total += dur[e];
    if (e >= first_decode) kept_sum += ev.tokens[e] / (num_layers * hkv);
  }
  m->set_kv_bytes_peak(peak);
  m->set_kv_bytes_mean(total > 0 ? fp / total : 0);
  m->set_kv_footprint(fp);
  m->set_full_kv_bytes_peak(full_peak);
  m->set_full_kv_bytes_mean(total > 0 ? full_fp / total : 0);
  m->set_kv_memory_ratio(full_fp > 0 ? fp / full_fp : 0);
  m->set_kept_tokens_mean(s > 0 ? kept_sum / s : 0);
}

// The (layer, KV head) cache lengths at event e of a.tokens (0: after the prefill hook; e >= 1: decode step
// e - 1, before its AfterStep).
std::vector<int> EventLengths(const TraceMeta& meta, const RunAccum& a, int e) {
  const int hkv = meta.model.num_kv_heads, s = meta.num_decode_steps;
  std::vector<int> len(static_cast<size_t>(meta.model.num_layers) * hkv);
  for (size_t i = 0; i < len.size(); ++i) len[i] = a.tokens[i * (s + 1) + e];
  return len;
}

// Duration of every event of `ev` (prefill chunks, then decode steps) from the latency model: prefill chunks
// attend over the earlier ones; the policy's own GPU work is charged at its compression event (the end of
// prefill, or decode step 0) and, for per-step work, at every decode step. With a device model, fills the
// modelled latency metrics (docs/latency.md) and compares with the full cache.
std::vector<double> EventDurations(const TraceMeta& meta, const RunAccum& a, const EventTokens& ev,
                                   const LatencyModel& latency, const PolicyGpuWork& work, int compress_end,
                                   int compression_step, LatencyMetrics* lm) {
  const int nl = meta.model.num_layers, hkv = meta.model.num_kv_heads, s = meta.num_decode_steps;
  const int n = meta.prefill_length;
  const size_t chunks = ev.chunk_len.size();
  std::vector<double> dur(ev.tokens.size());
  double work_us = 0;
  int cached = 0;
  for (size_t c = 0; c < chunks; ++c) {
    dur[c] = latency.PrefillDuration(ev.chunk_len[c], cached);
    cached += ev.chunk_len[c];
  }
  const double full_prefill_us = std::accumulate(dur.begin(), dur.begin() + chunks, 0.0);
  // The compression's work is sized by the compressible-prompt slots it keeps (RecordCompression, taken
  // right after it at either event): not the cache at decode step 0, which is recorded before that step's
  // AfterStep compresses, and without the question or generated tokens appended after the prompt.
  const CacheLengths compressed_cache{a.prompt_kept, nl, hkv};
  if (compression_step < 0) {
    const double w = latency.PolicyWorkDuration(work, compress_end, compressed_cache, false);
    dur[chunks - 1] += w;
    work_us += w;
  }
  const double prefill_us = std::accumulate(dur.begin(), dur.begin() + chunks, 0.0);
  const PerfModel* perf = latency.perf_model();
  const ModelShape* shape = latency.model_shape();
  double attention_us = 0, floor_sum = 0, ragged_sum = 0, spread_sum = 0, spread_n = 0, full_decode_us = 0;
  for (int e = 1; e <= s; ++e) {
    const std::vector<int> len = EventLengths(meta, a, e);
    const CacheLengths cache{len, nl, hkv};
    // With a device model, the step's breakdown is computed once: its total is the step's duration.
    const DecodeStepCost step = perf ? perf->DecodeStep(*shape, 1, len) : DecodeStepCost{};
    const double d = perf ? step.total_us : latency.DecodeStepDuration(cache);
    double w = latency.PolicyWorkDuration(work, compress_end, cache, true);
    if (compression_step == e - 1)
      w += latency.PolicyWorkDuration(work, compress_end, compressed_cache, false);
    dur[chunks - 1 + e] = d + w;
    work_us += w;
    if (!perf) continue;
    attention_us += step.attention_us;
    floor_sum += step.bytes / perf->PeakBytesPerUs() / (d + w);
    // The same step with every head of a layer at the layer's mean length.
    std::vector<int> even(len.size());
    for (int l = 0; l < nl; ++l) {
      double sum = 0;
      int most = 0;
      for (int u = 0; u < hkv; ++u) {
        sum += len[static_cast<size_t>(l) * hkv + u];
        most = std::max(most, len[static_cast<size_t>(l) * hkv + u]);
      }
      const double mean = sum / hkv;
      for (int u = 0; u < hkv; ++u)
        even[static_cast<size_t>(l) * hkv + u] = static_cast<int>(std::lround(mean));
      if (mean > 0) {
        spread_sum += most / mean;
        ++spread_n;
      }
    }
    const double even_attention = perf->DecodeStep(*shape, 1, even).attention_us;
    ragged_sum += even_attention > 0 ? step.attention_us / even_attention : 1;
    const std::vector<int> full(len.size(), n + e);
    full_decode_us += latency.DecodeStepDuration(CacheLengths{full, nl, hkv});
  }
  if (!perf) return dur;
  const double decode_us = std::accumulate(dur.begin() + chunks, dur.end(), 0.0);
  lm->set_device(perf->device().name());
  lm->set_model_shape(shape->name());
  lm->set_source(latency.Describe());
  lm->set_ttft_ms(prefill_us / 1e3);
  lm->set_full_ttft_ms(full_prefill_us / 1e3);
  lm->set_decode_ms_total(decode_us / 1e3);
  lm->set_ms_per_output_token(s > 0 ? decode_us / s / 1e3 : 0);
  lm->set_full_ms_per_output_token(s > 0 ? full_decode_us / s / 1e3 : 0);
  lm->set_speedup_vs_full(decode_us > 0 ? full_decode_us / decode_us : 0);
  lm->set_attention_ms_per_token(s > 0 ? attention_us / s / 1e3 : 0);
  lm->set_policy_work_ms(work_us / 1e3);
  lm->set_floor_fraction(s > 0 ? floor_sum / s : 0);
  lm->set_ragged_attention_ratio(s > 0 ? ragged_sum / s : 1);
  lm->set_head_length_max_over_mean(spread_n > 0 ? spread_sum / spread_n : 1);
  return dur;
}

}  // namespace

QueryRows ReplayQueryRows(const TraceMeta& meta, std::span<const RunSpec> runs, bool first_pass, int layer) {
  QueryRows rows = QueryRows::None();
  const std::vector<int32_t>& qp = meta.query_positions;
  auto add_positions = [&](int32_t begin, int32_t end) {  // the stored rows of token positions [begin, end)
    const auto b = std::lower_bound(qp.begin(), qp.end(), begin),
               e = std::lower_bound(qp.begin(), qp.end(), end);
    rows.Add(static_cast<int32_t>(b - qp.begin()), static_cast<int32_t>(e - qp.begin()));
  };
  if (!first_pass) add_positions(meta.prefill_length, meta.total_tokens());  // every decode step
  for (const RunSpec& r : runs) {
    if (!r.policy) continue;
    const PolicyRequirements req = r.policy->requirements();
    const int ce = CompressEnd(meta, r.question_mode);
    if (first_pass) {
      // ObserveLayer reads only the layers FirstPassLayers lists: their window and (if it says so) every
      // compressible row.
      if (!req.first_pass) continue;
      const std::vector<int> layers = r.policy->FirstPassLayers(meta, ce);
      if (layer >= 0 ? !std::binary_search(layers.begin(), layers.end(), layer) : layers.empty()) continue;
      if (req.window > 0) add_positions(ce - std::min(req.window, ce), ce);
      if (req.first_pass_prompt_queries) add_positions(0, ce);
      continue;
    }
    if (req.window > 0) add_positions(ce - std::min(req.window, ce), ce);
    const bool recorded_sums = meta.has_prefill_column_sums && ce == meta.prefill_length;
    if (req.prompt_column_sums && !recorded_sums) add_positions(0, ce);
  }
  return rows;
}

Status CheckRuns(const TraceMeta& meta, std::span<const RunSpec> runs) {
  if (meta.num_decode_steps < 1)
    return Status::FailedPrecondition(
        "trace has no decode steps; metrics are measured on decode steps (synthesize or capture with >= 1)");
  for (const RunSpec& r : runs) {
    if (!r.policy) return Status::InvalidArgument("a run has no policy");
    if (!(r.budget_fraction > 0 && r.budget_fraction <= 1) && r.budget_tokens <= 0)
      return Status::InvalidArgument(RunName(r) +
                                     ": budget must be a fraction in (0, 1] or a token count >= 1");
    const int ce = CompressEnd(meta, r.question_mode);
    if (ce < 1)
      return Status::InvalidArgument(RunName(r) + ": nothing to compress before the question in " +
                                     QuestionModeName(r.question_mode) + " mode");
    const PolicyRequirements req = r.policy->requirements();
    if (req.prompt_column_sums && !meta.HasAllPromptQueries() &&
        !(meta.has_prefill_column_sums && ce == meta.prefill_length))
      return Status::FailedPrecondition(
          RunName(r) + ": policy needs attention column sums over all " +
          (ce == meta.prefill_length ? std::string("prompt") : std::string("context")) +
          " queries, but the trace stores queries of only the last " +
          std::to_string(meta.query_positions.size() - meta.num_decode_steps) + " prompt tokens" +
          (meta.has_prefill_column_sums
               ? " (its recorded column sums cover the whole prompt, question included)"
               : " and no recorded prefill_column_sums") +
          "; capture with all queries, or use a window-based policy such as snapkv");
    if (req.window > 0) {
      const int w = std::min(req.window, ce);
      for (int p = ce - w; p < ce; ++p)
        if (meta.QueryIndex(p) < 0)
          return Status::FailedPrecondition(
              RunName(r) + ": observation window of " + std::to_string(w) + " queries ending at token " +
              std::to_string(ce) + " needs the query of token " + std::to_string(p) +
              ", which the trace does not store; lower the window (--set window=N) "
              "or capture more prompt queries");
    }
    if (req.first_pass && req.first_pass_prompt_queries && !meta.HasAllPromptQueries()) {
      const size_t layers = r.policy->FirstPassLayers(meta, ce).size();
      if (layers > 0)
        return Status::FailedPrecondition(
            RunName(r) + ": " + r.policy->name() + "'s first pass reads the query of every " +
            (ce == meta.prefill_length ? std::string("prompt") : std::string("context")) + " token in " +
            std::to_string(layers) + (layers == 1 ? " layer" : " layers") +
            ", but the trace stores queries of only the last " +
            std::to_string(meta.query_positions.size() - meta.num_decode_steps) +
            " prompt tokens; capture (or synthesize) with all prompt queries (query_storage: ALL)" +
            (req.prompt_queries_alternative.empty() ? "" : ", " + req.prompt_queries_alternative));
    }
    if (req.first_pass) continue;  // its layer budgets come from the first pass; checked after it
    const int budget = BudgetTokens(r, ce);
    const std::vector<int> lb = r.policy->LayerBudgets(meta, budget, ce);
    if (static_cast<int>(lb.size()) != meta.model.num_layers)
      return Status::Internal(r.policy->name() + ": LayerBudgets returned the wrong number of layers");
    for (int b : lb)
      if (b < 0 || b > ce) return Status::Internal(r.policy->name() + ": layer budget outside [0, prompt]");
  }
  return Status::Ok();
}

void SetFullKthFromSumsForTesting(bool allowed) { g_kth_from_sums.store(allowed, std::memory_order_relaxed); }
void SetDeferredTopKSumsForTesting(bool allowed) { g_defer_sums.store(allowed, std::memory_order_relaxed); }
void SetDeferredKthUnitsForTesting(bool allowed) { g_defer_kth.store(allowed, std::memory_order_relaxed); }
void SetExactRowSumsForTesting(bool allowed) { g_exact_row_sums.store(allowed, std::memory_order_relaxed); }
void SetRunListsForTesting(bool allowed) { g_run_lists.store(allowed, std::memory_order_relaxed); }
void SetUnionScanForTesting(bool allowed) { g_union_scan.store(allowed, std::memory_order_relaxed); }
void SetInPlaceValueRowsForTesting(bool allowed) { g_in_place_v.store(allowed, std::memory_order_relaxed); }
void SetMergedPrefixForTesting(bool allowed) { g_merged_prefix.store(allowed, std::memory_order_relaxed); }
void SetChunkSlotSumsForTesting(bool allowed) { g_chunk_sums.store(allowed, std::memory_order_relaxed); }
void SetSharedDecodePartForTesting(bool allowed) { g_decode_part.store(allowed, std::memory_order_relaxed); }
void SetOutputBandsForTesting(bool allowed) { g_rank_bands.store(allowed, std::memory_order_relaxed); }
void SetRankBandMemoForTesting(bool allowed) { g_band_memo.store(allowed, std::memory_order_relaxed); }
void SetStepZeroSplitForTesting(bool allowed) { g_step0_split.store(allowed, std::memory_order_relaxed); }
int64_t StepZeroSplitsForTesting() { return g_step0_splits.load(std::memory_order_relaxed); }
void SetHeldByRunsForTesting(bool allowed) { g_held_by_runs.store(allowed, std::memory_order_relaxed); }
void SetWholeRowSumsForTesting(bool allowed) { g_whole_rows.store(allowed, std::memory_order_relaxed); }
int64_t WholeRowSumsForTesting() { return g_whole_row_runs.load(std::memory_order_relaxed); }
void SetRowFlushForTesting(bool allowed) { g_row_flush.store(allowed, std::memory_order_relaxed); }
int64_t RowFlushesForTesting() { return g_row_flushes.load(std::memory_order_relaxed); }
void SetStepRunsForTesting(bool allowed) { g_step_runs.store(allowed, std::memory_order_relaxed); }
void SetInPlaceProbRowsForTesting(bool allowed) { g_in_place_a.store(allowed, std::memory_order_relaxed); }

StatusOr<std::vector<RunResult>> Replay(TraceSource& trace, std::span<const RunSpec> runs,
                                        const ReplayOptions& options) {
  const TraceMeta& meta = trace.meta();
  KVSIM_RETURN_IF_ERROR(CheckRuns(meta, runs));
  const int num_layers = meta.model.num_layers, h = meta.model.num_heads, hkv = meta.model.num_kv_heads;
  const int steps = meta.num_decode_steps;
  std::vector<RunPlan> plans(runs.size());
  std::vector<RunAccum> acc(runs.size());
  for (size_t r = 0; r < runs.size(); ++r) {
    RunPlan& p = plans[r];
    p.spec = &runs[r];
    p.index = static_cast<int>(r);
    p.compress_end = CompressEnd(meta, runs[r].question_mode);
    p.budget = BudgetTokens(runs[r], p.compress_end);
    p.req = runs[r].policy->requirements();
    p.evicts = runs[r].policy->evicts_during_decode();
    p.may_exceed = runs[r].policy->may_exceed_budget();
    p.compression_step = runs[r].policy->compression_step();
    p.headroom = std::max(0, runs[r].policy->decode_headroom());
  }
  // The two layer buffers (one replayed or observed, the next read in the background), shared by the first
  // pass and the replay: ReadLayer reuses a buffer's capacity (a fresh ~100 MB layer faulted ~25 K pages
  // in), and a layer read with fewer query rows than the buffer's last one refuses the rows it lacks
  // (LayerData::query_rows).
  LayerData current, next;
  // The first layer's keys, values and queries sized (zero-filled: their pages faulted in) and the runs'
  // accumulators zeroed in parallel: the first read would otherwise fault the buffers in on this thread
  // alone while the other cores wait for the layer. The read overwrites every key and value and the query
  // rows it reads; the other query rows stay zero as after its own resize, so nothing read depends on this.
  const LayerSizes sizes = ExpectedLayerSizes(meta);
  std::vector<float>* const first_buffers[3] = {&current.keys, &current.values, &current.queries};
  const size_t first_sizes[3] = {sizes.kv, sizes.kv, sizes.queries};
  ParallelFor(3 + static_cast<int>(runs.size()), options.threads, [&](int item) {
    if (item < 3) {
      first_buffers[item]->resize(first_sizes[item]);
      return;
    }
    RunAccum& a = acc[item - 3];
    const size_t samples = static_cast<size_t>(num_layers) * h * steps;
    a.retained.assign(samples, 0);
    a.anchor.assign(samples, 0);
    a.covered.assign(samples, 0);
    a.err.assign(samples, 0);
    a.regret.assign(samples, 0);
    a.ret_mod.assign(static_cast<size_t>(num_layers) * h * 4, 0);
    a.full_mod.assign(a.ret_mod.size(), 0);
    a.bound_checks.assign(static_cast<size_t>(num_layers) * hkv, 0);
    a.bound_viol.assign(a.bound_checks.size(), 0);
    a.merged_share_sum.assign(a.bound_checks.size(), 0.0);
    a.merged_share_n.assign(a.bound_checks.size(), 0);
    a.kept_mod.assign(a.bound_checks.size() * 4, 0);
    a.prompt_kept.assign(a.bound_checks.size(), 0);
    a.merged_tokens.assign(a.bound_checks.size(), 0);
    a.merged_slots.assign(a.bound_checks.size(), 0);
    a.merge_max.assign(a.bound_checks.size(), 0);
    a.tokens.assign(a.bound_checks.size() * (steps + 1), 0);
  });
  // First pass for policies that need cross-layer information: one plan per (policy object, compressible
  // region), shared by every budget. Then every run's per-layer budgets.
  std::map<std::pair<const Policy*, int>, std::shared_ptr<PolicyPlan>> shared_plans;
  for (RunPlan& p : plans)
    if (p.req.first_pass) {
      auto& plan = shared_plans[{p.spec->policy.get(), p.compress_end}];
      if (!plan) plan = p.spec->policy->NewPlan(meta, p.compress_end);
      p.policy_plan = plan;
    }
  if (!shared_plans.empty()) {
    // Only the layers some plan needs are read (Policy::FirstPassLayers), the next one in the background
    // while one is observed; every plan still observes every layer in order (data null where not needed).
    std::vector<std::vector<char>> wants;  // per shared plan, per layer
    std::vector<int> needed;               // ascending union
    std::vector<char> any(num_layers, 0);
    for (auto& [key, plan] : shared_plans) {
      std::vector<char>& w = wants.emplace_back(num_layers, 0);
      int prev = -1;
      for (int l : key.first->FirstPassLayers(meta, key.second)) {
        if (l <= prev || l >= num_layers)
          return Status::Internal(key.first->name() +
                                  ": FirstPassLayers must be ascending, distinct and in [0, num_layers)");
        w[l] = any[l] = 1;
        prev = l;
      }
    }
    for (int l = 0; l < num_layers; ++l)
      if (any[l]) needed.push_back(l);
    LayerData &layer = current, &next_layer = next;
    // Each layer read with only the rows of the plans that need that layer (HAE: every prompt row of its
    // dap_layer only).
    std::vector<LayerReadOptions> first_read(num_layers);
    for (int l : needed)
      first_read[l] = {ReplayQueryRows(meta, runs, /*first_pass=*/true, l), options.threads};
    size_t k = 0;  // next entry of `needed` to read
    Status read_status =
        needed.empty() ? Status::Ok() : trace.ReadLayer(needed[0], &layer, first_read[needed[0]]);
    std::future<Status> prefetch;
    for (int l = 0; l < num_layers; ++l) {
      const bool have = k < needed.size() && needed[k] == l;
      if (have) {
        if (prefetch.valid()) {
          read_status = prefetch.get();
          std::swap(layer, next_layer);
        }
        KVSIM_RETURN_IF_ERROR(read_status);
        layer.layer = l;
        if (++k < needed.size())
          prefetch = std::async(std::launch::async, [&trace, &next_layer, &first_read, l = needed[k]] {
            return trace.ReadLayer(l, &next_layer, first_read[l]);
          });
      }
      size_t i = 0;
      for (auto& [key, plan] : shared_plans) {
        const LayerData* data = wants[i++][l] && have ? &layer : nullptr;
        key.first->ObserveLayer(LayerView{&meta, data, l, key.second, options.threads}, plan.get());
      }
    }
    for (auto& [key, plan] : shared_plans) {
      key.first->FinishPlan(meta, plan.get());
      for (const auto& [name, values] : plan->layer_stats)
        if (static_cast<int>(values.size()) != num_layers)
          return Status::Internal(key.first->name() + ": layer statistic '" + name +
                                  "' has the wrong number of layers");
      for (const auto& [name, values] : plan->head_stats)
        if (values.size() != static_cast<size_t>(num_layers) * hkv)
          return Status::Internal(key.first->name() + ": head statistic '" + name +
                                  "' has the wrong number of (layer, KV head) values");
    }
  }
  for (RunPlan& p : plans) {
    p.layer_budgets =
        p.policy_plan ? p.spec->policy->PlannedLayerBudgets(meta, p.budget, p.compress_end, *p.policy_plan)
                      : p.spec->policy->LayerBudgets(meta, p.budget, p.compress_end);
    if (static_cast<int>(p.layer_budgets.size()) != num_layers)
      return Status::Internal(p.spec->policy->name() + ": wrong number of layer budgets");
    for (int b : p.layer_budgets)
      if (b < 0 || b > p.compress_end)
        return Status::Internal(p.spec->policy->name() + ": layer budget outside [0, prompt]");
    if (p.policy_plan)
      p.head_budgets =
          p.spec->policy->PlannedHeadBudgets(meta, p.budget, p.compress_end, *p.policy_plan, p.layer_budgets);
    if (p.head_budgets.empty()) {
      for (int l = 0; l < num_layers; ++l)
        for (int u = 0; u < hkv; ++u) p.head_budgets.push_back(p.layer_budgets[l]);
    } else {
      if (static_cast<int>(p.head_budgets.size()) != num_layers * hkv)
        return Status::Internal(p.spec->policy->name() + ": wrong number of per-head budgets");
      for (int l = 0; l < num_layers; ++l) {
        double sum = 0;
        for (int u = 0; u < hkv; ++u) {
          const int b = p.head_budgets[static_cast<size_t>(l) * hkv + u];
          if (b < 0 || b > p.compress_end)
            return Status::Internal(p.spec->policy->name() + ": head budget outside [0, prompt]");
          sum += b;
        }
        p.layer_budgets[l] = static_cast<int>(std::lround(sum / hkv));
      }
    }
    if (p.policy_plan) {
      p.run_layer_stats = p.spec->policy->PlannedLayerStats(meta, p.budget, p.compress_end, *p.policy_plan);
      for (const auto& [name, values] : p.run_layer_stats)
        if (static_cast<int>(values.size()) != num_layers)
          return Status::Internal(p.spec->policy->name() + ": layer statistic '" + name +
                                  "' has the wrong number of layers");
    }
  }
  // Run configurations in an order that groups equal compressible regions (shared prompt scores).
  std::vector<size_t> order(runs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return plans[a].compress_end < plans[b].compress_end; });
  std::vector<RunPlan> ordered_plans;
  std::vector<RunAccum> ordered_acc;
  for (size_t i : order) {
    ordered_plans.push_back(plans[i]);
    ordered_acc.push_back(std::move(acc[i]));
  }
  if (options.recorder) {
    std::vector<int> ce(runs.size());
    std::vector<std::vector<int>> hb(runs.size());
    for (size_t r = 0; r < runs.size(); ++r) {
      ce[r] = plans[r].compress_end;
      hb[r] = plans[r].head_budgets;
    }
    options.recorder->Begin(meta, runs, ce, hb);
  }
  // Layer l + 1 is read in the background while layer l is replayed (at most two layers resident).
  // Only the query rows the runs read (ReplayQueryRows).
  auto buffers = std::make_unique<PassBuffers>();  // every layer's passes reuse them
  const LayerReadOptions read{ReplayQueryRows(meta, runs, /*first_pass=*/false), options.threads};
  Status read_status = trace.ReadLayer(0, &current, read);
  for (int l = 0; l < num_layers && read_status.ok(); ++l) {
    std::future<Status> prefetch;
    if (l + 1 < num_layers)
      prefetch = std::async(std::launch::async,
                            [&trace, &next, &read, l] { return trace.ReadLayer(l + 1, &next, read); });
    current.layer = l;
    LayerPass pass(meta, current, ordered_plans, ordered_acc, options.threads, options.recorder, *buffers);
    pass.Run();
    if (options.progress) options.progress->Update("layer", l + 1, num_layers);
    if (prefetch.valid()) {
      read_status = prefetch.get();
      std::swap(current, next);
    }
  }
  KVSIM_RETURN_IF_ERROR(read_status);
  for (size_t k = 0; k < order.size(); ++k) acc[order[k]] = std::move(ordered_acc[k]);

  auto token_steps = MakeTokenStepLatencyModel();
  const LatencyModel& latency = options.latency ? *options.latency : *token_steps;
  std::vector<RunResult> results(runs.size());
  // Each run's result from its own accumulators only, so the runs are assembled in parallel (the sweep's
  // serial end: their quantiles, timelines and per-layer metrics kept one core idle), after the first items
  // hand the layer buffers and the units' pooled buffers back to the system (their unmapping, too, was
  // serial work on this thread).
  constexpr int kReleases = 3;
  ParallelFor(kReleases + static_cast<int>(runs.size()), options.threads, [&](int item) {
    switch (item) {
      case 0:
        current = LayerData();
        return;
      case 1:
        next = LayerData();
        return;
      case 2:
        buffers.reset();
        return;
      default:
        break;
    }
    const int r = item - kReleases;
    const RunPlan& p = plans[r];
    const RunAccum& a = acc[r];
    RunResult& out = results[r];
    out.set_policy(runs[r].policy->name());
    out.set_label(runs[r].label.empty() ? runs[r].policy->name() : runs[r].label);
    out.set_parameters(runs[r].policy->ParamsText());
    out.set_budget_fraction(runs[r].budget_fraction);
    out.set_budget_tokens(p.budget);
    out.set_question_mode(QuestionModeName(runs[r].question_mode));
    out.set_compressed_prompt_tokens(p.compress_end);
    out.set_trace_path(trace.Describe());
    out.set_trace_hash(options.trace_hash);
    out.set_trace_model(meta.model.name);
    out.set_trace_seed(meta.seed);
    out.set_trace_source(meta.source);
    out.set_kvsim_version(kVersion);
    out.set_git_commit(kGitCommit);
    out.set_time_unit(latency.unit());
    // Simulated clock: per-event durations from the latency model and the cache sizes of all layers.
    const EventTokens ev = Timeline(meta, a, 0, num_layers, options.prefill_chunk);
    const size_t chunks = ev.chunk_len.size();
    const std::vector<double> dur =
        EventDurations(meta, a, ev, latency, runs[r].policy->gpu_work(), p.compress_end,
                       runs[r].policy->compression_step(), out.mutable_latency());
    if (out.latency().device().empty()) out.clear_latency();  // no device profile: nothing was modelled
    const double bytes_per_token = 2.0 * meta.model.head_dim * meta.model.ModelDtypeBytes();
    double now = 0;
    for (size_t e = 0; e < ev.tokens.size(); ++e) {
      const bool prefill = e < chunks;
      now += dur[e];
      TimelinePoint* tp = out.add_timeline();
      tp->set_event(prefill ? "prefill" : "decode");
      tp->set_step(prefill ? static_cast<int>(e) - static_cast<int>(chunks) : static_cast<int>(e - chunks));
      tp->set_time(now);
      tp->set_kv_tokens(ev.tokens[e]);
      tp->set_kv_bytes(ev.tokens[e] * bytes_per_token);
    }
    out.set_prefill_chunks(static_cast<int>(chunks));
    out.set_compression_step(runs[r].policy->compression_step());
    FillQuality(meta, a, 0, num_layers, out.mutable_metrics());
    FillMemory(meta, ev, num_layers, dur, out.mutable_metrics());
    const double allocated =
        std::accumulate(p.head_budgets.begin(), p.head_budgets.end(), 0.0) / std::max(1, num_layers * hkv);
    out.set_allocated_budget_tokens_mean(allocated);
    out.mutable_metrics()->set_prompt_kept_over_budget(
        p.budget > 0 ? out.metrics().prompt_kept_tokens_mean() / p.budget : 0);
    for (int l = 0; l < num_layers; ++l) {
      LayerResult* lr = out.add_layers();
      lr->set_layer(l);
      double head_sum = 0;
      for (int u = 0; u < hkv; ++u) {
        const int b = p.head_budgets[static_cast<size_t>(l) * hkv + u];
        lr->add_kv_head_budgets(b);
        head_sum += b;
      }
      lr->set_budget_tokens_mean(head_sum / hkv);
      if (p.policy_plan) {
        std::map<std::string, double> stats;  // plan (budget-independent) and run statistics, by name
        for (const auto& [name, values] : p.policy_plan->layer_stats) stats[name] = values[l];
        for (const auto& [name, values] : p.run_layer_stats) stats[name] = values[l];
        for (const auto& [name, value] : stats) {
          PolicyStat* st = lr->add_policy_stats();
          st->set_name(name);
          st->set_value(value);
        }
        for (const auto& [name, values] : p.policy_plan->head_stats) {
          PolicyHeadStat* st = lr->add_policy_head_stats();
          st->set_name(name);
          for (int u = 0; u < hkv; ++u) st->add_values(values[static_cast<size_t>(l) * hkv + u]);
        }
      }
      for (int u = 0; u < hkv; ++u) {
        const int32_t* tk = &a.tokens[(static_cast<size_t>(l) * hkv + u) * (steps + 1)];
        double sum = 0;
        for (int e = 1; e <= steps; ++e) sum += tk[e];
        lr->add_kv_head_tokens_mean(steps > 0 ? sum / steps : 0);
        lr->add_kv_head_tokens_peak(*std::max_element(tk, tk + steps + 1));
      }
      FillQuality(meta, a, l, l + 1, lr->mutable_metrics());
      lr->mutable_metrics()->set_prompt_kept_over_budget(
          lr->budget_tokens_mean() > 0 ? lr->metrics().prompt_kept_tokens_mean() / lr->budget_tokens_mean()
                                       : 0);
      FillMemory(meta, Timeline(meta, a, l, l + 1, options.prefill_chunk), 1, dur, lr->mutable_metrics());
    }
  });
  return results;
}

}  // namespace kvsim
