// gpu_replay/layout.{h,cc} and gpu_replay/dtype.h: 16-bit conversions, the ragged layout, the split-KV
// partition (every token exactly once, balanced chunks) and synthetic ragged lengths.

#include "gpu_replay/layout.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <numeric>

#include "gpu_replay/dtype.h"

namespace kvsim::gpu_replay {

TEST_CASE("dtype: fp16 and bf16 conversions round to nearest even", "[gpu_replay][layout]") {
  CHECK(FloatToHalf(1.0f) == 0x3c00);
  CHECK(FloatToHalf(-2.0f) == 0xc000);
  CHECK(FloatToHalf(65504.0f) == 0x7bff);
  CHECK(FloatToHalf(65520.0f) == 0x7c00);                          // rounds to infinity
  CHECK(FloatToHalf(std::ldexp(1.0f, -24)) == 0x0001);             // smallest subnormal
  CHECK(FloatToHalf(std::ldexp(1.0f, -25)) == 0x0000);             // tie to even: zero
  CHECK(FloatToHalf(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);      // tie, even mantissa stays
  CHECK(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3c02);  // tie, odd mantissa rounds up
  CHECK(FloatToBf16(1.0f) == 0x3f80);
  CHECK(FloatToBf16(1.0f + std::ldexp(1.0f, -8)) == 0x3f80);  // tie to even
  CHECK(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3f82);
  CHECK(std::isnan(HalfToFloat(FloatToHalf(NAN))));
  // Every finite 16-bit value survives a round trip.
  int bad_half = 0, bad_bf16 = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    if ((h & 0x7c00) != 0x7c00 && FloatToHalf(HalfToFloat(static_cast<uint16_t>(h))) != h) ++bad_half;
    if ((h & 0x7f80) != 0x7f80 && FloatToBf16(Bf16ToFloat(static_cast<uint16_t>(h))) != h) ++bad_bf16;
  }
  CHECK(bad_half == 0);
  CHECK(bad_bf16 == 0);
  CHECK(RoundTo(Dtype::kBF16, 3.14159f) == Approx(3.140625f));
  for (uint64_t i = 0; i < 1000; ++i) {
    const float u = HashUniform(3, i);
    REQUIRE(u >= -1.0f);
    REQUIRE(u < 1.0f);
  }
  CHECK(HashUniform(3, 7) == HashUniform(3, 7));
  CHECK(HashUniform(3, 7) != HashUniform(4, 7));
}

TEST_CASE("layout: per-head capacity = kept + max new, aligned, no overlap", "[gpu_replay][layout]") {
  const std::vector<int32_t> kept{5, 0, 100, 17};
  RaggedLayout l = MakeRaggedLayout(kept, 8, 128);
  CHECK(CheckLayout(l).empty());
  CHECK(l.capacity == std::vector<int32_t>{13, 8, 108, 25});
  CHECK(l.length == kept);
  for (int h = 0; h < 4; ++h) CHECK(l.offset[h] % 16 == 0);
  CHECK(l.offset[1] == 16);
  CHECK(l.total_slots == 16 + 16 + 112 + 32);
  CHECK(l.Element(2, 3) == (32 + 3) * 128);
  CHECK(l.live_tokens() == 122);
  l.length[0] = 14;
  CHECK(CheckLayout(l).find("head 0") != std::string::npos);
  l.length[0] = 5;
  l.offset[1] = 10;
  CHECK(CheckLayout(l).find("overlap") != std::string::npos);
}

TEST_CASE("split-KV partition: every token exactly once, chunks balanced", "[gpu_replay][layout]") {
  for (uint64_t seed = 1; seed <= 30; ++seed) {
    const int heads = 1 + static_cast<int>((HashUniform(seed, 0) + 1) * 40);
    std::vector<int32_t> len(heads);
    for (int h = 0; h < heads; ++h) {
      const float u = HashUniform(seed, h + 1);
      len[h] = u < -0.8f ? 0 : static_cast<int32_t>((u + 1) * (seed % 3 == 0 ? 20000 : 700));
    }
    const int target = 1 + static_cast<int>(seed * 37 % 700);
    const SplitKvPartition p = PartitionSplitKv(len, target);
    INFO("seed " << seed << " heads " << heads << " target " << target);
    REQUIRE(p.head_first.size() == static_cast<size_t>(heads) + 1);
    REQUIRE(p.chunk >= 256);
    REQUIRE(p.chunk % 32 == 0);
    const int64_t total = std::accumulate(len.begin(), len.end(), int64_t{0});
    REQUIRE(p.items.size() <= static_cast<size_t>(target + heads));
    if (total > int64_t{256} * target)  // the chunk follows the target, not the minimum
      REQUIRE(p.chunk < (total + target - 1) / target + 32);
    for (int h = 0; h < heads; ++h) {
      std::vector<int> cover(len[h], 0);
      int lo = INT32_MAX, hi = 0;
      for (int i = p.head_first[h]; i < p.head_first[h + 1]; ++i) {
        const WorkItem& w = p.items[i];
        REQUIRE(w.kv_head == h);
        REQUIRE(w.begin < w.end);
        REQUIRE(w.end - w.begin <= p.chunk);
        lo = std::min(lo, w.end - w.begin);
        hi = std::max(hi, w.end - w.begin);
        for (int s = w.begin; s < w.end; ++s) ++cover[s];
      }
      REQUIRE(std::all_of(cover.begin(), cover.end(), [](int c) { return c == 1; }));
      if (len[h] == 0)
        REQUIRE(p.head_first[h] == p.head_first[h + 1]);
      else
        REQUIRE(hi - lo <= 1);
    }
  }
  // Long heads are cut, short ones not: 1 head of 8192 and 31 of 64, target 64 items.
  std::vector<int32_t> skew(32, 64);
  skew[0] = 8192;
  const SplitKvPartition p = PartitionSplitKv(skew, 64);
  CHECK(p.chunk == 256);
  CHECK(p.head_first[1] - p.head_first[0] == 32);
  CHECK(p.max_items_per_head() == 32);
  CHECK(p.items.size() == 32 + 31);
}

TEST_CASE("synthetic ragged lengths: exact total, clamped, deterministic", "[gpu_replay][layout]") {
  const auto a = SyntheticRaggedLengths(1024, 410.0, 2048, 0.6, 9);
  CHECK(std::accumulate(a.begin(), a.end(), int64_t{0}) == 410 * 1024);
  CHECK(*std::min_element(a.begin(), a.end()) >= 1);
  CHECK(*std::max_element(a.begin(), a.end()) <= 2048);
  CHECK(*std::max_element(a.begin(), a.end()) > 2 * *std::min_element(a.begin(), a.end()));
  CHECK(a == SyntheticRaggedLengths(1024, 410.0, 2048, 0.6, 9));
  const auto u = SyntheticRaggedLengths(8, 100.0, 2048, 0.0, 9);
  CHECK(u == std::vector<int32_t>(8, 100));
  const auto full = SyntheticRaggedLengths(16, 5000.0, 300, 0.5, 2);  // mean above the maximum
  CHECK(full == std::vector<int32_t>(16, 300));
}

}  // namespace kvsim::gpu_replay
