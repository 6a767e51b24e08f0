#include "gpu_replay/layout.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "gpu_replay/dtype.h"
#include "sim/status.h"

namespace kvsim::gpu_replay {

int64_t RaggedLayout::live_tokens() const {
  return std::accumulate(length.begin(), length.end(), int64_t{0});
}

RaggedLayout MakeRaggedLayout(std::span<const int32_t> kept, std::span<const int32_t> max_new, int head_dim,
                              int align) {
  KVSIM_CHECK(kept.size() == max_new.size() && align >= 1 && head_dim >= 1);
  RaggedLayout l;
  l.num_kv_heads = static_cast<int>(kept.size());
  l.head_dim = head_dim;
  int64_t at = 0;
  for (size_t h = 0; h < kept.size(); ++h) {
    KVSIM_CHECK(kept[h] >= 0 && max_new[h] >= 0);
    l.offset.push_back(at);
    l.capacity.push_back(kept[h] + max_new[h]);
    l.length.push_back(kept[h]);
    at += (static_cast<int64_t>(kept[h]) + max_new[h] + align - 1) / align * align;
  }
  l.total_slots = at;
  return l;
}

RaggedLayout MakeRaggedLayout(std::span<const int32_t> kept, int max_new, int head_dim, int align) {
  std::vector<int32_t> m(kept.size(), max_new);
  return MakeRaggedLayout(kept, m, head_dim, align);
}

std::string CheckLayout(const RaggedLayout& l) {
  const size_t h = static_cast<size_t>(l.num_kv_heads);
  if (l.offset.size() != h || l.capacity.size() != h || l.length.size() != h)
    return "offset/capacity/length must have num_kv_heads entries";
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (size_t i = 0; i < h; ++i) {
    if (l.length[i] < 0 || l.length[i] > l.capacity[i])
      return "head " + std::to_string(i) + ": length " + std::to_string(l.length[i]) +
             " outside [0, capacity " + std::to_string(l.capacity[i]) + "]";
    if (l.offset[i] < 0 || l.offset[i] + l.capacity[i] > l.total_slots)
      return "head " + std::to_string(i) + ": slots outside the buffer";
    spans.push_back({l.offset[i], l.offset[i] + l.capacity[i]});
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].first < spans[i - 1].second) return "two heads' slots overlap";
  return "";
}

int SplitKvPartition::max_items_per_head() const {
  int most = 0;
  for (size_t h = 0; h + 1 < head_first.size(); ++h) most = std::max(most, head_first[h + 1] - head_first[h]);
  return most;
}

SplitKvPartition PartitionSplitKv(std::span<const int32_t> lengths, int target_items, int min_chunk,
                                  int granule) {
  KVSIM_CHECK(target_items >= 1 && min_chunk >= 1 && granule >= 1);
  SplitKvPartition p;
  const int64_t total = std::accumulate(lengths.begin(), lengths.end(), int64_t{0});
  int64_t chunk = std::max<int64_t>(min_chunk, (total + target_items - 1) / target_items);
  chunk = (chunk + granule - 1) / granule * granule;
  p.chunk = static_cast<int32_t>(chunk);
  p.head_first.push_back(0);
  for (size_t h = 0; h < lengths.size(); ++h) {
    const int64_t n = lengths[h];
    KVSIM_CHECK(n >= 0);
    const int64_t k = (n + chunk - 1) / chunk;
    for (int64_t i = 0; i < k; ++i)  // near-equal pieces: sizes floor(n/k) or ceil(n/k)
      p.items.push_back(WorkItem{static_cast<int32_t>(h), static_cast<int32_t>(n * i / k),
                                 static_cast<int32_t>(n * (i + 1) / k)});
    p.head_first.push_back(static_cast<int32_t>(p.items.size()));
  }
  return p;
}

std::vector<int32_t> SyntheticRaggedLengths(int num_heads, double mean, int max_len, double cv,
                                            uint64_t seed) {
  KVSIM_CHECK(num_heads >= 1 && max_len >= 1);
  std::vector<double> raw(num_heads);
  for (int h = 0; h < num_heads; ++h) {
    // Sum of 4 uniforms ~ normal with variance 4/3 (deterministic, no <random> distribution differences).
    double z = 0;
    for (int k = 0; k < 4; ++k) z += HashUniform(seed, static_cast<uint64_t>(h) * 4 + k);
    z /= std::sqrt(4.0 / 3.0);
    raw[h] = std::max(0.0, 1.0 + cv * z);
  }
  const double sum = std::accumulate(raw.begin(), raw.end(), 0.0);
  const int64_t want = std::llround(std::clamp(mean, 1.0, static_cast<double>(max_len)) * num_heads);
  std::vector<int32_t> out(num_heads);
  for (int h = 0; h < num_heads; ++h) {
    const double share = sum > 0 ? raw[h] / sum : 1.0 / num_heads;
    out[h] = static_cast<int32_t>(std::clamp<int64_t>(std::llround(share * want), 1, max_len));
  }
  // Fix the total one token at a time (largest deficit/excess heads first), within [1, max_len].
  int64_t have = std::accumulate(out.begin(), out.end(), int64_t{0});
  for (int guard = 0; have != want && guard < 4 * num_heads + 4; ++guard) {
    const int64_t step = have < want ? 1 : -1;
    const int64_t per = (std::abs(want - have) + num_heads - 1) / num_heads;
    bool moved = false;
    for (int h = 0; h < num_heads && have != want; ++h) {
      const int64_t room = step > 0 ? max_len - out[h] : out[h] - 1;
      const int64_t d = std::min({per, room, std::abs(want - have)});
      if (d <= 0) continue;
      out[h] += static_cast<int32_t>(step * d);
      have += step * d;
      moved = true;
    }
    if (!moved) break;
  }
  return out;
}

}  // namespace kvsim::gpu_replay
