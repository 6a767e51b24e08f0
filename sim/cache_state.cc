#include "sim/cache_state.h"

#include <algorithm>
#include <utility>

#include "sim/status.h"

namespace kvsim {

void HeadCache::Compact() {
  if (begin_ == 0) return;
  tokens_.erase(tokens_.begin(), tokens_.begin() + static_cast<std::ptrdiff_t>(begin_));
  merge_of_.erase(merge_of_.begin(), merge_of_.begin() + static_cast<std::ptrdiff_t>(begin_));
  begin_ = 0;
}

void HeadCache::Assign(std::span<const int32_t> tokens) {
  ++version_;
  ++rewrites_;
  begin_ = 0;
  tokens_.assign(tokens.begin(), tokens.end());
  merge_of_.assign(tokens_.size(), -1);
  merges_used_ = 0;  // the entries keep their memory (MergeEntry)
  num_merged_slots_ = 0;
}

void HeadCache::AssignRange(int32_t begin, int32_t end) {
  ++version_;
  ++rewrites_;
  begin_ = 0;
  tokens_.resize(end - begin);
  for (int32_t i = begin; i < end; ++i) tokens_[i - begin] = i;
  merge_of_.assign(tokens_.size(), -1);
  merges_used_ = 0;  // the entries keep their memory (MergeEntry)
  num_merged_slots_ = 0;
}

void HeadCache::Append(int32_t token) {
  ++appends_;
  if (begin_ > 0 && tokens_.size() == tokens_.capacity()) Compact();
  tokens_.push_back(token);
  merge_of_.push_back(-1);
}

void HeadCache::EvictSlot(int slot) {
  ++version_;
  KVSIM_CHECK(slot >= 0 && slot < size());
  const size_t at = begin_ + static_cast<size_t>(slot);
  if (merge_of_[at] >= 0) --num_merged_slots_;
  if (slot < size() / 2) {
    const auto tb = tokens_.begin() + static_cast<std::ptrdiff_t>(begin_);
    const auto mb = merge_of_.begin() + static_cast<std::ptrdiff_t>(begin_);
    std::copy_backward(tb, tb + slot, tb + slot + 1);
    std::copy_backward(mb, mb + slot, mb + slot + 1);
    ++begin_;  // slot < size() / 2: a slot is left
  } else {
    tokens_.erase(tokens_.begin() + static_cast<std::ptrdiff_t>(at));
    merge_of_.erase(merge_of_.begin() + static_cast<std::ptrdiff_t>(at));
  }
}

void HeadCache::EvictSlots(std::span<const int> slots) {
  ++version_;
  if (slots.empty()) return;
  Compact();
  std::vector<char> drop(tokens_.size(), 0);
  for (int s : slots) {
    KVSIM_CHECK(s >= 0 && s < size() && !drop[s]);
    drop[s] = 1;
  }
  size_t w = 0;
  for (size_t r = 0; r < tokens_.size(); ++r) {
    if (drop[r]) {
      if (merge_of_[r] >= 0) --num_merged_slots_;
      continue;
    }
    tokens_[w] = tokens_[r];
    merge_of_[w] = merge_of_[r];
    ++w;
  }
  tokens_.resize(w);
  merge_of_.resize(w);
}

void HeadCache::MergeInto(int slot, int32_t token, float weight, std::span<const float> key,
                          std::span<const float> value) {
  ++version_;
  ++rewrites_;
  KVSIM_CHECK(slot >= 0 && slot < size());
  KVSIM_CHECK(static_cast<int>(key.size()) == head_dim_ && static_cast<int>(value.size()) == head_dim_);
  MergedSlot& m = MergeEntry(slot);
  m.key.assign(key.begin(), key.end());
  m.value.assign(value.begin(), value.end());
  m.members.emplace_back(token, weight);
}

void HeadCache::SetMerge(int slot, MergedSlot merge) {
  ++version_;
  ++rewrites_;
  KVSIM_CHECK(slot >= 0 && slot < size());
  KVSIM_CHECK(static_cast<int>(merge.key.size()) == head_dim_ &&
              static_cast<int>(merge.value.size()) == head_dim_);
  MergeEntry(slot) = std::move(merge);
}

MergedSlot& HeadCache::SetMergeInPlace(int slot) {
  ++version_;
  ++rewrites_;
  KVSIM_CHECK(slot >= 0 && slot < size());
  MergedSlot& m = MergeEntry(slot);
  m.key.resize(head_dim_);
  m.value.resize(head_dim_);
  m.members.clear();
  return m;
}

std::vector<MergedSlot> HeadCache::TakeMergeStorage() {
  ++version_;
  ++rewrites_;
  std::fill(merge_of_.begin(), merge_of_.end(), -1);
  merges_used_ = 0;
  num_merged_slots_ = 0;
  return std::exchange(merges_, {});
}

void HeadCache::AdoptMergeStorage(std::vector<MergedSlot> storage) {
  KVSIM_CHECK_MSG(merges_used_ == 0, "HeadCache::AdoptMergeStorage: the cache has merges");
  merges_ = std::move(storage);
}

MergedSlot& HeadCache::MergeEntry(int slot) {
  int32_t& of = merge_of_[begin_ + slot];
  if (of < 0) {
    if (merges_used_ == merges_.size()) merges_.emplace_back();
    of = static_cast<int32_t>(merges_used_++);
    merges_[of].members.clear();  // an entry of a merge dropped by Assign keeps its members until here
    ++num_merged_slots_;
  }
  return merges_[of];
}

std::vector<int32_t> HeadCache::CoveredTokens() const {
  const std::span<const int32_t> toks = tokens();
  std::vector<int32_t> out(toks.begin(), toks.end());
  for (int s = 0; s < size(); ++s)
    if (is_merged(s))
      for (const auto& [t, w] : merged(s).members) out.push_back(t);
  return out;
}

}  // namespace kvsim
