#pragma once
// The ragged cache layout the kernels use: one flat K buffer and one flat V buffer per layer,
// [total_slots][head_dim] each; KV head h owns slots [offset[h], offset[h] + capacity[h]), of which the
// first length[h] are live. capacity = kept + max new tokens, so decode appends write in place (no per-step
// copy). Offsets are aligned to `align` slots. Pure host code: the CPU reference and the CUDA kernels share
// it.
//
// Split-KV: long heads are cut into chunks of at most `chunk` tokens; every chunk of every head is one work
// item (one thread block on the GPU), so uneven heads are load-balanced by cutting, not by padding.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kvsim::gpu_replay {

struct RaggedLayout {
  int num_kv_heads = 0;
  int head_dim = 0;
  std::vector<int64_t> offset;    // [H] first slot of head h
  std::vector<int32_t> capacity;  // [H]
  std::vector<int32_t> length;    // [H] live slots
  int64_t total_slots = 0;        // buffer size in slots (>= offset[h] + capacity[h] for every h)
  int64_t Element(int h, int slot) const { return (offset[h] + slot) * head_dim; }
  int64_t live_tokens() const;
};

// Layout for heads holding `kept[h]` tokens now and growing by up to `max_new[h]` (or one value for all).
RaggedLayout MakeRaggedLayout(std::span<const int32_t> kept, std::span<const int32_t> max_new, int head_dim,
                              int align = 16);
RaggedLayout MakeRaggedLayout(std::span<const int32_t> kept, int max_new, int head_dim, int align = 16);
// Empty string if consistent, else what is wrong (offsets overlapping, length > capacity, ...).
std::string CheckLayout(const RaggedLayout& layout);

struct WorkItem {
  int32_t kv_head = 0;
  int32_t begin = 0;  // [begin, end) live slots of the head
  int32_t end = 0;
};

struct SplitKvPartition {
  std::vector<WorkItem> items;      // by head, then begin
  std::vector<int32_t> head_first;  // [H + 1]: head h's items are [head_first[h], head_first[h + 1])
  int32_t chunk = 0;                // no item is longer
  int max_items_per_head() const;
};

// Partitions every head's live slots [0, lengths[h]) into chunks: chunk = max(min_chunk, ceil(total /
// target_items)) rounded up to a multiple of `granule`; a head of length n gets ceil(n / chunk) items of
// near-equal size (they differ by at most one token). Empty heads get no item. Pure and deterministic.
SplitKvPartition PartitionSplitKv(std::span<const int32_t> lengths, int target_items, int min_chunk = 256,
                                  int granule = 32);
// The minimum chunk the GPU paths use (decode attention, the decoder step, the harness): with ~8 items per
// SM, a 1K-token head is cut into up to 16 items, so 1K-token and GQA caches (few KV heads) fill the GPU.
inline constexpr int kSplitKvMinChunk = 64;

// Ragged lengths for a synthetic run: num_heads values with mean ~ `mean` (clamped to [1, max_len]), spread
// with coefficient of variation `cv` (0 = uniform), deterministic in `seed`, and an exact total of
// round(mean * num_heads) when the clamp allows it.
std::vector<int32_t> SyntheticRaggedLengths(int num_heads, double mean, int max_len, double cv,
                                            uint64_t seed);

}  // namespace kvsim::gpu_replay
