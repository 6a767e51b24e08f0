#pragma once
// Merging evicted tokens into kept cache slots, as a piece any policy can use (MEDA Eqs. 11-12; LOOK-M's
// pivot / average / weighted merges) and as a wrapper around any evicting policy ("snapkv+average").
//
// Target: each evicted token e joins the slot c(e) whose current key is most cosine-similar to k_e, per KV
// head (ties: the earliest slot). A merged slot's key and value are a function of its anchor's original
// k_a, v_a and its m merged-in tokens (their original keys/values), so merges compose across batches:
//   AVERAGE  (MEDA Eq. 12):  k_c = (k_a + Σ_e k_e) / (1 + m)
//   PIVOT    (LOOK-M):       k~_e = (k_e + k_a) / 2,  k_c = (k_a + Σ_e k~_e) / (1 + m)
//   WEIGHTED (LOOK-M):       k_c = (k_a + Σ_e s_e k_e) / (1 + m),  s_e = cos(k_e, k_c(e)) at assignment
// Values use the same assignment and coefficients. Formulas and deviations: docs/policies/merging.md.

#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "policies/policy_params.pb.h"
#include "sim/policy.h"

namespace kvsim {

// For every row of `queries` ([num_queries][d]) the index of the most cosine-similar row of `targets`
// ([num_targets][d]) and that similarity. Zero vectors have similarity 0 to everything. Ties: lowest index.
// The similarity is DEFINED (issue 14, round 10) as one fmaf chain over k from +0 of the two rows scaled to
// unit length (merge_screen::ExactDots), on every CPU and block size, so the slot chosen does not depend on
// the machine (it used to be OpenBLAS sgemm's value, which differs between CPUs' kernels).
void NearestByCosine(const float* queries, int num_queries, const float* targets, int num_targets, int d,
                     std::vector<int>* nearest, std::vector<float>* similarity);
// The same with row pointers (rows need not be contiguous; same results as the contiguous form).
void NearestByCosine(const float* const* queries, int num_queries, const float* const* targets,
                     int num_targets, int d, std::vector<int>* nearest, std::vector<float>* similarity);

// The similarity memo of a unit's merging runs (issue 14, round 8). A sweep runs MEDA / LOOK-M at several
// budgets on the same (layer, KV head), and their kept sets are typically nested (K_5 ⊂ K_10 ⊂ ...) or,
// across policies, overlap heavily: an evicted token's best slot over K is the better of its stored best a*
// over another set A (if a* ∈ K and A ∩ K is in K's order; round 13) and its best over K \ A (none if K ⊆ A).
// Merger::KeepAndMergeOnce keeps such answers in HeadContext::shared (per unit, a few answer sets)
// and reuses them; every slot and similarity is bit for bit NearestByCosine's (the proof is at
// NearestWithMemo in merge.cc and in docs/performance.md, "Round 8"). Only the amount of work depends on
// which run searched first.
namespace merge_memo {
// False if switched off: by KVSIM_MERGE_MEMO=0 (read once; an A/B switch of one binary) or by
// SetEnabledForTesting(false). It serves the query blocks of regular rows (merge.cc) on every CPU.
bool Enabled();
void SetEnabledForTesting(bool enabled);
// The rest searches' floor (round 14: a row with a stored answer v* re-checks only the targets of K \ A that
// can reach v*; merge.cc ScreenBlock): on by default; off (false) for tests comparing the two. The same
// answers either way.
void SetRestFloorForTesting(bool enabled);
// Answer sets a unit keeps (the least recently used goes first).
inline constexpr int kMaxEntries = 8;
// The memo counters of merge_screen::Stats summed over every thread of the process (tests, bench/).
struct Totals {
  long calls = 0, reuse_calls = 0, superset_calls = 0, overlap_calls = 0, queries = 0, free_queries = 0,
       products = 0, products_without = 0;
};
Totals ProcessTotals();
// How many answer sets a unit's memo holds (≤ kMaxEntries; 0 if none was made).
int StoredSets(UnitShared& shared);
}  // namespace merge_memo

// Per-(layer, KV head) merge state: the running sums behind every merged slot, so later evictions can merge
// into (or dissolve) an existing merge.
class Merger {
 public:
  Merger(policy::MergeStrategy strategy, policy::MergeFilter filter) : strategy_(strategy), filter_(filter) {}

  policy::MergeStrategy strategy() const { return strategy_; }

  // Replaces the cache content with `kept` (positions, as plain slots) and merges `evicted` into them.
  void KeepAndMerge(const HeadContext& ctx, std::span<const int32_t> kept, std::span<const int32_t> evicted,
                    HeadCache* cache);

  // KeepAndMerge followed by Release, for a policy that merges once and never again (MEDA, LOOK-M): the same
  // merged slots, bit for bit, without building the running sums.
  void KeepAndMergeOnce(const HeadContext& ctx, std::span<const int32_t> kept,
                        std::span<const int32_t> evicted, HeadCache* cache);

  // Merges original tokens (not in the cache) into the cache's current slots, one batch.
  void MergeTokens(const HeadContext& ctx, std::span<const int32_t> tokens, HeadCache* cache);

  // After a policy changed the cache: `before` is the slot anchors before the change. Anchors that left
  // are merged into the remaining slots together with whatever they had absorbed; surviving anchors whose
  // merge the change dropped (e.g. HeadCache::Assign) get it back.
  void Reconcile(const HeadContext& ctx, std::span<const int32_t> before, HeadCache* cache);

  // Frees the running sums (as much memory again as the merged slots themselves) for a policy that merges
  // once and never again (MEDA, LOOK-M): after it, MergeTokens / Reconcile start from no merges.
  void Release();

 private:
  struct Sums {
    std::vector<float> k, v;  // Σ coefficient * original key/value of the members
    std::vector<std::pair<int32_t, float>> members;
  };
  // The merge of `anchor` with its members (out->members, already set) whose weighted key / value sums are
  // sk / sv: writes out->key and out->value (head_dim floats each).
  void Merged(const HeadContext& ctx, int32_t anchor, const float* sk, const float* sv,
              MergedSlot* out) const;
  void Apply(const HeadContext& ctx, int slot, Sums& s, HeadCache* cache) const;
  // The slot each of `tokens` joins (-1: filtered out) and its coefficient (1, 0.5 or the cosine); false if
  // nothing merges.
  // `memo`: the merge-once path may use the unit's similarity memo (merge_memo).
  bool Join(const HeadContext& ctx, std::span<const int32_t> tokens, const HeadCache& cache,
            std::vector<int>* slot, std::vector<float>* coef, bool memo = false) const;

  policy::MergeStrategy strategy_;
  policy::MergeFilter filter_;
  std::unordered_map<int32_t, Sums> sums_;  // by anchor token
  std::vector<char> mark_;                  // scratch, by token position
};

// Registry support: "base+average" / "base+pivot" / "base+weighted" wraps an evicting policy so that every
// token it evicts (at the prefill hook and during decode) is merged into the nearest kept slot.
bool ParseMergeSuffix(const std::string& suffix, policy::MergeStrategy* strategy);
std::shared_ptr<const Policy> WrapWithMerge(std::shared_ptr<const Policy> base,
                                            policy::MergeStrategy strategy);

}  // namespace kvsim
