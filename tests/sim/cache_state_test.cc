#include "sim/cache_state.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <random>
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

TEST_CASE("HeadCache: merges dropped by Assign lend their memory to the next merges", "[cache_state]") {
  HeadCache c(3);
  c.AssignRange(0, 6);
  std::vector<const float*> keys;
  for (int s = 0; s < 3; ++s) {
    MergedSlot& m = c.SetMergeInPlace(s);
    m.key = {1.0f, 2.0f, 3.0f};
    m.value = {4.0f, 5.0f, 6.0f};
    m.members = {{10 + s, 0.5f}, {20 + s, 0.25f}};
    keys.push_back(m.key.data());
  }
  const uint64_t version = c.version(), rewrites = c.rewrites();
  c.Assign(std::vector<int32_t>{7, 8, 9});
  CHECK_FALSE(c.has_merges());
  // The first merges after the Assign reuse the old entries, in order: no allocation, no stale members.
  MergedSlot& m = c.SetMergeInPlace(2);
  CHECK(m.key.data() == keys[0]);
  CHECK(m.key.size() == 3);
  CHECK(m.value.size() == 3);
  CHECK(m.members.empty());
  m.members = {{30, 1.0f}};
  c.MergeInto(0, 31, 0.5f, std::vector<float>{7, 8, 9}, std::vector<float>{1, 1, 1});
  CHECK(c.merged(0).key.data() == keys[1]);
  REQUIRE(c.merged(0).members.size() == 1);  // the dropped merge's two members are gone
  CHECK(c.merged(0).members[0].first == 31);
  CHECK(c.merged(2).members == std::vector<std::pair<int32_t, float>>{{30, 1.0f}});
  CHECK(c.num_merged_slots() == 2);
  CHECK(c.CoveredTokens() == std::vector<int32_t>{7, 8, 9, 31, 30});
  CHECK(c.version() > version);
  CHECK(c.rewrites() > rewrites);
  // A slot merged again keeps its entry.
  MergedSlot& again = c.SetMergeInPlace(2);
  CHECK(again.key.data() == keys[0]);
  CHECK(again.members.empty());
  // A finished cache's storage goes to a new cache (the replay's PassBuffers): its slots are left plain,
  // and the new cache's merges reuse the memory.
  std::vector<MergedSlot> storage = c.TakeMergeStorage();
  CHECK(storage.size() == 3);
  CHECK_FALSE(c.has_merges());
  CHECK_FALSE(c.is_merged(0));
  CHECK(c.CoveredTokens() == std::vector<int32_t>{7, 8, 9});
  HeadCache next(3);
  next.AssignRange(0, 4);
  next.AdoptMergeStorage(std::move(storage));
  CHECK_FALSE(next.has_merges());
  next.MergeInto(3, 40, 0.5f, std::vector<float>{1, 2, 3}, std::vector<float>{4, 5, 6});
  CHECK(next.merged(3).key.data() == keys[0]);
  CHECK(next.merged(3).members == std::vector<std::pair<int32_t, float>>{{40, 0.5f}});
  CHECK(next.CoveredTokens() == std::vector<int32_t>{0, 1, 2, 3, 40});
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

namespace kvsim {

// EvictSlot moves the shorter side (a slot in the first half shifts the slots before it and the cache's
// start advances; Append compacts before its vector would grow). A random mix of every operation, from
// sinks-and-window evictions (slot 2 of many, streaming_llm's) to evictions near the end, merges and
// reassignments, against a plain list of (token, merge id): the same slots, tokens, merges and counts after
// every operation.
TEST_CASE("HeadCache: evictions at either end keep slots, tokens and merges in order", "[cache_state]") {
  std::mt19937 rng(11);
  HeadCache c(1);
  std::vector<std::pair<int32_t, int>> want;  // (token, merge id: -1 plain)
  int32_t next = 0;
  int merges = 0;
  auto check = [&] {
    REQUIRE(c.size() == static_cast<int>(want.size()));
    int merged = 0;
    std::vector<int32_t> covered, members;  // CoveredTokens: the anchors in slot order, then the members
    for (int s = 0; s < c.size(); ++s) {
      INFO("slot " << s);
      CHECK(c.token(s) == want[s].first);
      CHECK(c.tokens()[s] == want[s].first);
      CHECK(c.is_merged(s) == (want[s].second >= 0));
      covered.push_back(want[s].first);
      if (want[s].second >= 0) {
        ++merged;
        REQUIRE(c.merged(s).members.size() == 1);
        CHECK(c.merged(s).members[0].first == -1 - want[s].second);
        CHECK(c.merged(s).key[0] == static_cast<float>(want[s].second));
        members.push_back(-1 - want[s].second);
      }
    }
    covered.insert(covered.end(), members.begin(), members.end());
    CHECK(c.num_merged_slots() == merged);
    CHECK(c.has_merges() == (merged > 0));
    CHECK(c.CoveredTokens() == covered);
  };
  for (int op = 0; op < 4000; ++op) {
    const int size = c.size(), kind = static_cast<int>(rng() % 100);
    if (kind < 2 || size == 0) {  // reassign
      std::vector<int32_t> keep;
      for (int i = 0, n = 1 + static_cast<int>(rng() % 40); i < n; ++i) keep.push_back(next++);
      c.Assign(keep);
      want.clear();
      for (int32_t t : keep) want.emplace_back(t, -1);
    } else if (kind < 45) {
      c.Append(next);
      want.emplace_back(next++, -1);
    } else if (kind < 75) {  // near the front (a sink window's oldest token)
      const int s = std::min(size - 1, static_cast<int>(rng() % 4));
      c.EvictSlot(s);
      want.erase(want.begin() + s);
    } else if (kind < 88) {  // anywhere
      const int s = static_cast<int>(rng() % size);
      c.EvictSlot(s);
      want.erase(want.begin() + s);
    } else if (kind < 92) {  // several at once
      std::vector<int> ev;
      for (int s = 0; s < size; ++s)
        if (rng() % 5 == 0) ev.push_back(s);
      std::shuffle(ev.begin(), ev.end(), rng);
      c.EvictSlots(ev);
      std::sort(ev.rbegin(), ev.rend());
      for (int s : ev) want.erase(want.begin() + s);
    } else {  // a merge into a plain slot: member token -1 - id, key {id}
      const int s = static_cast<int>(rng() % size);
      if (want[s].second >= 0) continue;
      const float k = static_cast<float>(merges);
      const std::vector<float> key{k}, value{k};
      if (kind < 95) {
        c.MergeInto(s, -1 - merges, 0.5f, key, value);
      } else if (kind < 98) {
        MergedSlot m;
        m.key = key;
        m.value = value;
        m.members = {{-1 - merges, 0.5f}};
        c.SetMerge(s, std::move(m));
      } else {
        MergedSlot& m = c.SetMergeInPlace(s);
        REQUIRE(m.key.size() == 1);
        REQUIRE(m.value.size() == 1);
        REQUIRE(m.members.empty());
        m.key[0] = m.value[0] = k;
        m.members.emplace_back(-1 - merges, 0.5f);
      }
      want[s].second = merges++;
    }
    INFO("operation " << op);
    check();
  }
}

}  // namespace kvsim
