#pragma once
// Cache state of one (layer, KV head): an ordered set of slots. A slot is an original token (its "anchor",
// kept as itself) or a merge: the anchor plus merged-in tokens with weights, holding its own key/value.
// Provenance is kept so metrics can tell retained mass (plain slots' anchors) from merged anchors and
// covered mass (every anchor + merged-in tokens).

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace kvsim {

struct MergedSlot {
  std::vector<float> key;                          // [head_dim], replaces the anchor's key
  std::vector<float> value;                        // [head_dim]
  std::vector<std::pair<int32_t, float>> members;  // merged-in tokens (not the anchor) and their weights
};

class HeadCache {
 public:
  HeadCache() = default;
  explicit HeadCache(int head_dim) : head_dim_(head_dim) {}

  int size() const { return static_cast<int>(tokens_.size() - begin_); }
  int head_dim() const { return head_dim_; }
  // Anchor token positions, one per slot, in slot order (ascending unless a policy reorders).
  std::span<const int32_t> tokens() const { return {tokens_.data() + begin_, tokens_.size() - begin_}; }
  int32_t token(int slot) const { return tokens_[begin_ + slot]; }
  bool is_merged(int slot) const { return merge_of_[begin_ + slot] >= 0; }
  const MergedSlot& merged(int slot) const { return merges_[merge_of_[begin_ + slot]]; }
  bool has_merges() const { return num_merged_slots_ > 0; }
  int num_merged_slots() const { return num_merged_slots_; }
  // Counts every change other than Append (evictions, assignments, merges): a checker that saw version v
  // only needs to look at the slots appended since, if the version is still v.
  uint64_t version() const { return version_; }
  // Counts the changes that can bring a token in other than Append (Assign, AssignRange, MergeInto,
  // SetMerge); evictions leave it. Appends add slots at the end and evictions keep the order of the rest,
  // so the slots appended since a checker saw (rewrites() == r, appends() == a) that are still held are
  // among the last appends() - a slots, and every other slot held now was held then.
  uint64_t rewrites() const { return rewrites_; }
  uint64_t appends() const { return appends_; }  // Append calls so far

  // Replaces the content with these tokens as plain slots (ascending).
  void Assign(std::span<const int32_t> tokens);
  // Keeps tokens [begin, end) as plain slots.
  void AssignRange(int32_t begin, int32_t end);
  void Append(int32_t token);
  // Removes the slots whose indices are listed (any order, no duplicates); order of the rest is kept.
  void EvictSlots(std::span<const int> slots);
  // Removes one slot; order of the rest is kept. The shorter side moves: a slot in the first half shifts
  // the slots before it one place towards the end (streaming_llm's oldest non-sink token: its few sinks),
  // one in the second half the slots after it one place towards the front.
  void EvictSlot(int slot);
  // Turns `slot` into a merge (if it isn't one) holding `key`/`value`, and records `token` as merged-in with
  // `weight`. The caller computes the new key/value (merge strategies live in policies/).
  void MergeInto(int slot, int32_t token, float weight, std::span<const float> key,
                 std::span<const float> value);

  // Makes `slot` a merge holding exactly this key/value and these merged-in members (replacing any).
  void SetMerge(int slot, MergedSlot merge);
  // Makes `slot` a merge (replacing any) and returns its storage for the caller to fill in whole: key and
  // value hold head_dim floats (their contents unspecified), members is empty. The reference is valid until
  // the next call that makes a slot a merge. A merge's storage outlives Assign / AssignRange and is reused by
  // the next merges, so a policy that rebuilds its merges every step (MEDA) allocates nothing once the cache
  // has held as many merges (issue 14, round 18: the allocator was ≈ 4% of the 45-run sweep).
  MergedSlot& SetMergeInPlace(int slot);
  // The merges' storage, for a cache made later (AdoptMergeStorage): this cache's slots are left plain.
  std::vector<MergedSlot> TakeMergeStorage();
  // Gives a cache with no merges another's storage (TakeMergeStorage): its merges reuse that memory.
  void AdoptMergeStorage(std::vector<MergedSlot> storage);

  // Every token this cache covers (anchors and merged-in), for invariant checks.
  std::vector<int32_t> CoveredTokens() const;

 private:
  // Moves the slots to the front of tokens_ / merge_of_ (begin_ = 0).
  void Compact();
  // Makes `slot` a merge if it isn't one (taking the next unused entry of merges_, members emptied) and
  // returns its entry.
  MergedSlot& MergeEntry(int slot);

  int head_dim_ = 0;
  // Slot s is tokens_[begin_ + s] / merge_of_[begin_ + s]: EvictSlot of a slot near the front moves the
  // slots before it and advances begin_; Append compacts before tokens_ would reallocate, so the elements
  // before begin_ never outnumber the vector's growth.
  size_t begin_ = 0;
  std::vector<int32_t> tokens_;
  std::vector<int32_t> merge_of_;  // per slot: index into merges_, or -1
  // merges_[0, merges_used_) are the merges made since the last Assign / AssignRange (an evicted merged
  // slot's entry stays unused until then); the entries after them keep their memory for the next merges.
  std::vector<MergedSlot> merges_;
  size_t merges_used_ = 0;
  int num_merged_slots_ = 0;
  uint64_t version_ = 0;
  uint64_t rewrites_ = 0;
  uint64_t appends_ = 0;
};

}  // namespace kvsim
