#pragma once
// The problems the GPU kernels solve, as host data, and their CPU reference implementations (same layouts,
// same 16-bit inputs, fp32 accumulation, same rounding points). The CUDA versions (gpu_api.h) take the same
// structs; tests compare the two. No CUDA headers here.
//
//   decode attention   ragged per-(layer, KV head) caches, split-KV work items, GQA groups
//   window scores      SnapKV-style observation-window column sums (causal softmax), summed over the group
//   top-k + compaction per-head top-k of scores (ties: lower slot), gathered into a fresh ragged layout
//   merge              cosine nearest kept slot for each evicted token, AVERAGE merge (MEDA Eq. 12)
//   decoder step       one token through a Llama/Qwen2-shaped decoder with random weights

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "gpu_replay/dtype.h"
#include "gpu_replay/layout.h"
#include "sim/status.h"

namespace kvsim::gpu_replay {

// ---- Decode attention over ragged caches ----
struct AttentionProblem {
  Dtype dtype = Dtype::kF16;
  int num_q_heads = 0;         // multiple of layout.num_kv_heads; query head q uses KV head q / group
  float scale = 0;             // logits = scale * q.k
  RaggedLayout layout;         // live slots [0, length[h]) of every head
  std::vector<uint16_t> q;     // [num_q_heads][head_dim]
  std::vector<uint16_t> k, v;  // [layout.total_slots][head_dim]
  int group() const { return num_q_heads / layout.num_kv_heads; }
};
// Random problem: q, k, v uniform in [-1, 1) (HashUniform), capacity = length + max_new.
AttentionProblem MakeAttentionProblem(Dtype dtype, int num_q_heads, std::span<const int32_t> lengths,
                                      int max_new, int head_dim, uint64_t seed);
// out: [num_q_heads][head_dim] fp32. Each work item computes (max, sum, unnormalised output) per query head
// over its chunk; the combine rescales them (flash-decoding). Heads with no live slot give zeros.
void RefDecodeAttention(const AttentionProblem& p, const SplitKvPartition& part, std::vector<float>* out);

// ---- Observation-window scoring ----
struct WindowScoreProblem {
  Dtype dtype = Dtype::kF16;
  int num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  float scale = 0;
  int num_keys = 0;         // prompt length n
  int window = 0;           // queries of positions [n - window, n)
  std::vector<uint16_t> q;  // [num_q_heads][window][head_dim]
  std::vector<uint16_t> k;  // [num_kv_heads][num_keys][head_dim]
};
WindowScoreProblem MakeWindowScoreProblem(Dtype dtype, int num_q_heads, int num_kv_heads, int head_dim,
                                          int num_keys, int window, uint64_t seed);
// scores: [num_kv_heads][num_keys], Σ over the group's query heads and the window of the causal softmax.
void RefWindowScores(const WindowScoreProblem& p, std::vector<float>* scores);

// ---- Per-head top-k selection and gather/compaction ----
struct TopKProblem {
  Dtype dtype = Dtype::kF16;
  RaggedLayout src;            // candidates: live slots of each head
  std::vector<float> scores;   // [src.total_slots], slot-indexed like K/V
  std::vector<int32_t> keep;   // [H] slots kept per head (clamped to the head's length)
  int max_new = 0;             // destination capacity = kept + max_new
  std::vector<uint16_t> k, v;  // [src.total_slots][head_dim]
};
TopKProblem MakeTopKProblem(Dtype dtype, std::span<const int32_t> lengths, std::span<const int32_t> keep,
                            int max_new, int head_dim, uint64_t seed);
struct TopKResult {
  RaggedLayout dst;
  std::vector<int32_t> selected;  // [dst.total_slots]: source slot (within its head) of each live dst slot
  std::vector<uint16_t> k, v;     // [dst.total_slots][head_dim]; unused slots zero
};
// Keeps each head's keep[h] highest-scoring slots (ties: lower slot), in ascending slot order.
void RefTopKCompact(const TopKProblem& p, TopKResult* out);
// dst layout of a problem (both implementations use it).
RaggedLayout TopKDestinationLayout(const TopKProblem& p);

// ---- Cosine nearest-neighbour merging (one batch, AVERAGE) ----
struct MergeProblem {
  Dtype dtype = Dtype::kF16;
  RaggedLayout layout;                 // kept slots (live) of each head
  std::vector<uint16_t> k, v;          // [layout.total_slots][head_dim]
  std::vector<int32_t> evicted_first;  // [H + 1]: head h's evicted tokens are [first[h], first[h + 1])
  std::vector<uint16_t> ek, ev;        // [E][head_dim] evicted keys/values
};
MergeProblem MakeMergeProblem(Dtype dtype, std::span<const int32_t> kept, std::span<const int32_t> evicted,
                              int head_dim, uint64_t seed);
struct MergeResult {
  std::vector<int32_t> nearest;   // [E] slot (within its head) with the highest cosine; ties: lowest slot
  std::vector<float> similarity;  // [E]
  std::vector<int32_t> count;     // [total_slots] tokens merged into each slot
  std::vector<uint16_t> k, v;     // merged buffers: k_c = (k_a + Σ k_e) / (1 + m), same for v
};
void RefMergeNearest(const MergeProblem& p, MergeResult* out);

// ---- One decoder step ----
struct ModelShape {
  std::string name;
  int num_layers = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int hidden = 0, intermediate = 0, vocab = 0;
  bool qkv_bias = false;  // Qwen2
  double rope_theta = 10000;
  float rms_eps = 1e-6f;
  int qkv_rows() const { return (num_heads + 2 * num_kv_heads) * head_dim; }
  int64_t weight_params() const;  // every matrix and norm (no embedding table)
};
// "llava-1.5-7b" (Llama-2-7B language model), "qwen2-7b" (GQA 28/4), "tiny" (tests: 2 layers, 4/2 heads,
// d 64, hidden 256, MLP 512, vocab 1000).
StatusOr<ModelShape> PresetShape(const std::string& name);

struct DecoderProblem {
  ModelShape shape;
  Dtype dtype = Dtype::kF16;
  std::vector<int32_t> lengths;  // [num_layers * num_kv_heads] cached tokens before this step
  int position = 0;              // RoPE position of the new token
  uint64_t seed = 1;
};
// Weight / cache / input generation shared by host and device: tensor `id` element `i`.
enum DecoderTensor : int {
  kAttnNorm = 0,
  kWqkv,
  kBqkv,
  kWo,
  kMlpNorm,
  kWgateUp,
  kWdown,
  kTensorsPerLayer,
};
inline constexpr int kFinalNormId = 1 << 20, kLmHeadId = (1 << 20) + 1, kInputId = (1 << 20) + 2;
inline constexpr int kCacheKId = 1 << 21, kCacheVId = (1 << 21) + 1;  // + 2 * layer
uint64_t TensorSeed(uint64_t seed, int id);
// Scale of a tensor's uniform values (norm weights are 1 + 0.1 u; matrices sqrt(3 / fan_in) u).
float TensorScale(const ModelShape& s, int id);
float TensorValue(const ModelShape& s, Dtype dtype, uint64_t seed, int id, int64_t i);
// The per-layer cache layout of a decoder problem: capacity = length + 1 (this step's append).
RaggedLayout DecoderLayerLayout(const DecoderProblem& p, int layer);
// logits [vocab] fp32; the K/V of the new token appended at slot lengths[h] of every head.
void RefDecoderStep(const DecoderProblem& p, std::vector<float>* logits);
// The same with weights and caches materialised once (fp32 copies of the 16-bit values), so Step() can be
// timed: the CPU reference benchmark (kvsim_replay_gpu --cpu-reference).
class RefDecoder {
 public:
  explicit RefDecoder(const DecoderProblem& p);
  void Step(std::vector<float>* logits);
  // Attention of every layer only (the caches as they are after the append), for timing.
  void AttentionOnly();

 private:
  struct Layer {
    std::vector<float> attn_norm, wqkv, bqkv, wo, mlp_norm, wgu, wdown, k, v;
    RaggedLayout layout;
  };
  void Gemv(const std::vector<float>& w, const std::vector<float>& x, int rows, int cols, float* y) const;
  void RmsNorm(const std::vector<float>& x, const std::vector<float>& w, std::vector<float>* out) const;
  void Attention(Layer& L, const std::vector<float>& qkv, std::vector<float>* out, bool append) const;
  DecoderProblem p_;
  std::vector<Layer> layers_;
  std::vector<float> final_norm_, lm_head_, input_;
};
// RoPE inverse frequencies theta^(-2i/d), i < head_dim / 2, computed in double on the host and rounded to
// fp32 once: the reference and both kernel builds use this table (no device powf).
std::vector<float> RopeInvFreq(const ModelShape& s);
// Weight and KV bytes one decoder step must read (the physical lower bound's numerator).
int64_t DecoderWeightBytes(const ModelShape& s);
int64_t DecoderKvBytes(const DecoderProblem& p);

// Max relative error: max |a - b| / max(max |b|, tiny) (what the targets bound: 1e-2 bf16, 2e-3 fp16).
double MaxRelError(std::span<const float> a, std::span<const float> b);

}  // namespace kvsim::gpu_replay
