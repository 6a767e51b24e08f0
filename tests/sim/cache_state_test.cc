#include "sim/cache_state.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <vector>

namespace kvsim {
namespace {

std::vector<int32_t> Tokens(const HeadCache& c) { return {c.tokens().begin(), c.tokens().end()}; }
std::vector<int32_t> SortedCovered(const HeadCache& c) {
  std::vector<int32_t> v = c.CoveredTokens();
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST_CASE("HeadCache: Assign, AssignRange, Append, EvictSlots keep slot order", "[cache_state]") {
  HeadCache c(2);
  CHECK(c.size() == 0);
  CHECK(c.head_dim() == 2);
  const std::vector<int32_t> init{1, 3, 5, 7};
  c.Assign(init);
  CHECK(Tokens(c) == std::vector<int32_t>{1, 3, 5, 7});
  c.Append(9);
  CHECK(c.size() == 5);
  CHECK(c.token(4) == 9);
  // Evict slots 3 and 0, given out of order: the rest keep their order.
  const std::vector<int> ev{3, 0};
  c.EvictSlots(ev);
  CHECK(Tokens(c) == std::vector<int32_t>{3, 5, 9});
  c.EvictSlots(std::vector<int>{});
  CHECK(Tokens(c) == std::vector<int32_t>{3, 5, 9});
  c.EvictSlot(1);
  CHECK(Tokens(c) == std::vector<int32_t>{3, 9});
  // AssignRange(begin, end): tokens [begin, end).
  c.AssignRange(2, 5);
  CHECK(Tokens(c) == std::vector<int32_t>{2, 3, 4});
  c.AssignRange(0, 3);
  CHECK(Tokens(c) == std::vector<int32_t>{0, 1, 2});
  for (int s = 0; s < c.size(); ++s) CHECK_FALSE(c.is_merged(s));
  CHECK_FALSE(c.has_merges());
  CHECK(SortedCovered(c) == std::vector<int32_t>{0, 1, 2});
}

TEST_CASE("HeadCache::MergeInto records provenance and replaces the slot's key/value", "[cache_state]") {
  HeadCache c(2);
  c.AssignRange(0, 4);  // slots: 0 1 2 3
  // Merge token 2 into slot 1 (token 1) with the averaged key/value, then drop token 2's slot.
  const std::vector<float> k12{0.5f, 1.5f}, v12{2.0f, -1.0f};
  c.MergeInto(1, 2, 0.5f, k12, v12);
  c.EvictSlot(2);
  CHECK(Tokens(c) == std::vector<int32_t>{0, 1, 3});
  CHECK(c.is_merged(1));
  CHECK_FALSE(c.is_merged(0));
  CHECK_FALSE(c.is_merged(2));
  CHECK(c.has_merges());
  CHECK(c.merged(1).key == k12);
  CHECK(c.merged(1).value == v12);
  REQUIRE(c.merged(1).members.size() == 1);
  CHECK(c.merged(1).members[0] == std::pair<int32_t, float>{2, 0.5f});
  // The anchor stays in tokens(); covered = anchors + merged-in.
  CHECK(SortedCovered(c) == std::vector<int32_t>{0, 1, 2, 3});

  // A second merge into the same slot: key/value replaced, members appended, still one merged slot.
  c.Append(4);
  const std::vector<float> k2{1.0f, 1.0f}, v2{0.0f, 3.0f};
  c.MergeInto(1, 4, 0.25f, k2, v2);
  c.EvictSlot(3);
  CHECK(c.merged(1).key == k2);
  CHECK(c.merged(1).value == v2);
  REQUIRE(c.merged(1).members.size() == 2);
  CHECK(c.merged(1).members[1] == std::pair<int32_t, float>{4, 0.25f});
  CHECK(SortedCovered(c) == std::vector<int32_t>{0, 1, 2, 3, 4});

  // Evicting a plain slot before the merged one shifts it; its merge follows.
  c.EvictSlot(0);
  CHECK(Tokens(c) == std::vector<int32_t>{1, 3});
  CHECK(c.is_merged(0));
  CHECK(c.merged(0).members.size() == 2);
  CHECK_FALSE(c.is_merged(1));
}

TEST_CASE("HeadCache::has_merges counts merged slots through evictions", "[cache_state]") {
  HeadCache c(1);
  c.AssignRange(0, 6);
  const std::vector<float> k{1.0f}, v{2.0f};
  c.MergeInto(0, 10, 1.0f, k, v);  // two merged slots: 0 and 3
  c.MergeInto(3, 11, 1.0f, k, v);
  CHECK(c.has_merges());
  c.EvictSlot(0);  // one merged slot left (token 3, now slot 2)
  CHECK(c.has_merges());
  CHECK(c.is_merged(2));
  c.EvictSlots(std::vector<int>{4, 2});  // evicts token 5 and the merged token 3
  CHECK(Tokens(c) == std::vector<int32_t>{1, 2, 4});
  CHECK_FALSE(c.has_merges());
  CHECK(SortedCovered(c) == std::vector<int32_t>{1, 2, 4});
  // Assign resets merges.
  c.MergeInto(1, 7, 1.0f, k, v);
  CHECK(c.has_merges());
  c.Assign(std::vector<int32_t>{1, 2});
  CHECK_FALSE(c.has_merges());
  CHECK_FALSE(c.is_merged(1));
  // Appended slots are plain.
  c.Append(3);
  CHECK_FALSE(c.is_merged(2));
}

TEST_CASE("HeadCache: SetMerge replaces a slot's merge wholesale", "[cache_state]") {
  HeadCache c(2);
  c.AssignRange(0, 3);
  c.MergeInto(1, 5, 1.0f, std::vector<float>{1, 1}, std::vector<float>{2, 2});
  c.SetMerge(1, MergedSlot{{3, 3}, {4, 4}, {{6, 0.5f}, {7, 0.5f}}});
  REQUIRE(c.is_merged(1));
  CHECK(c.merged(1).key == std::vector<float>{3, 3});
  CHECK(c.merged(1).members.size() == 2);
  c.SetMerge(0, MergedSlot{{0, 0}, {0, 0}, {{8, 1.0f}}});
  CHECK(c.CoveredTokens() == std::vector<int32_t>{0, 1, 2, 8, 6, 7});
}

TEST_CASE("HeadCache: rewrites() counts what can bring a token in other than Append; appends() the appends",
          "[cache_state]") {
  HeadCache c(1);
  const std::vector<float> k{1.0f}, v{2.0f};
  CHECK(c.rewrites() == 0);
  CHECK(c.appends() == 0);
  c.AssignRange(0, 4);
  CHECK(c.rewrites() == 1);
  const uint64_t version = c.version();
  c.Append(4);
  c.Append(5);
  CHECK(c.appends() == 2);
  CHECK(c.rewrites() == 1);
  CHECK(c.version() == version);  // appends change neither
  c.EvictSlot(0);
  c.EvictSlots(std::vector<int>{0});
  CHECK(c.rewrites() == 1);  // evictions only remove slots
  CHECK(c.version() == version + 2);
  // The appended slots still held are among the last appends() - a slots (evictions keep the order).
  CHECK(Tokens(c) == std::vector<int32_t>{2, 3, 4, 5});
  c.MergeInto(0, 1, 1.0f, k, v);
  CHECK(c.rewrites() == 2);
  c.SetMerge(1, MergedSlot{k, v, {{0, 1.0f}}});
  CHECK(c.rewrites() == 3);
  c.Assign(std::vector<int32_t>{1});
  CHECK(c.rewrites() == 4);
  CHECK(c.appends() == 2);
}

}  // namespace kvsim
