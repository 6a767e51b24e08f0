#pragma once
// Device-side entry of the ragged split-KV decode attention (attention.cu), shared with the decoder step.

#include "gpu_replay/gpu_common.cuh"

namespace kvsim::gpu_replay {

inline constexpr int kAttnThreads = 128;
// Work items the partition aims for: enough blocks to fill every SM several times.
inline int AttentionTargetItems(int sm_count) { return sm_count * 8; }

struct AttentionArgs {
  Dtype dtype = Dtype::kF16;
  int head_dim = 128, group = 1, num_kv_heads = 0;
  float scale = 0;
  int num_items = 0;
  const void* q = nullptr;  // [num_kv_heads * group][head_dim]
  const void* k = nullptr;  // layer buffer [total_slots][head_dim]
  const void* v = nullptr;
  const int64_t* offset = nullptr;      // [num_kv_heads]
  const int32_t* items = nullptr;       // [num_items][4]: kv_head, begin, end, 0
  const int32_t* head_first = nullptr;  // [num_kv_heads + 1]
  float* partials = nullptr;            // [num_items][group][head_dim + 2]
  void* out = nullptr;                  // [num_kv_heads * group][head_dim], fp32 or the dtype
  bool out_fp32 = true;
};
Status LaunchDecodeAttention(const AttentionArgs& a, cudaStream_t s);

// A problem's buffers on the device (tests, timing).
struct DeviceAttention {
  DeviceBuffer<uint16_t> q, k, v;
  DeviceBuffer<int64_t> offset;
  DeviceBuffer<int32_t> items, head_first;
  DeviceBuffer<float> partials, out;
  AttentionArgs args;
  Status Upload(const AttentionProblem& p, const SplitKvPartition& part);
};

}  // namespace kvsim::gpu_replay
