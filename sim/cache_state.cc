#include "sim/cache_state.h"

#include <algorithm>

#include "sim/status.h"

namespace kvsim {

void HeadCache::Assign(std::span<const int32_t> tokens) {
  ++version_;
  ++rewrites_;
  tokens_.assign(tokens.begin(), tokens.end());
  merge_of_.assign(tokens_.size(), -1);
  merges_.clear();
  num_merged_slots_ = 0;
}

void HeadCache::AssignRange(int32_t begin, int32_t end) {
  ++version_;
  ++rewrites_;
  tokens_.resize(end - begin);
  for (int32_t i = begin; i < end; ++i) tokens_[i - begin] = i;
  merge_of_.assign(tokens_.size(), -1);
  merges_.clear();
  num_merged_slots_ = 0;
}

void HeadCache::Append(int32_t token) {
  ++appends_;
  tokens_.push_back(token);
  merge_of_.push_back(-1);
}

void HeadCache::EvictSlot(int slot) {
  ++version_;
  KVSIM_CHECK(slot >= 0 && slot < size());
  if (merge_of_[slot] >= 0) --num_merged_slots_;
  tokens_.erase(tokens_.begin() + slot);
  merge_of_.erase(merge_of_.begin() + slot);
}

void HeadCache::EvictSlots(std::span<const int> slots) {
  ++version_;
  if (slots.empty()) return;
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
  if (merge_of_[slot] < 0) {
    merge_of_[slot] = static_cast<int32_t>(merges_.size());
    merges_.emplace_back();
    ++num_merged_slots_;
  }
  MergedSlot& m = merges_[merge_of_[slot]];
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
  if (merge_of_[slot] < 0) {
    merge_of_[slot] = static_cast<int32_t>(merges_.size());
    merges_.emplace_back();
    ++num_merged_slots_;
  }
  merges_[merge_of_[slot]] = std::move(merge);
}

std::vector<int32_t> HeadCache::CoveredTokens() const {
  std::vector<int32_t> out(tokens_.begin(), tokens_.end());
  for (int s = 0; s < size(); ++s)
    if (merge_of_[s] >= 0)
      for (const auto& [t, w] : merges_[merge_of_[s]].members) out.push_back(t);
  return out;
}

}  // namespace kvsim
