#pragma once
// In-memory shapes of a kvsim trace (format documented in docs/trace-format.md) and the two interfaces
// the rest of kvsim uses to read and write one: TraceSource (layer-by-layer reads) and TraceSink
// (layer-by-layer writes). The HDF5 implementation lives in traces/; MemoryTrace below is an in-memory
// implementation of both, used by tests and by small pipelines.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sim/status.h"

namespace kvsim {

inline constexpr const char kTraceFormatName[] = "kvsim-trace";
inline constexpr int kTraceFormatVersion = 1;

enum class Modality : uint8_t { kText = 0, kImage = 1, kVideo = 2, kOther = 3 };
inline constexpr int kNumModalities = 4;
enum class Phase : uint8_t { kPrefill = 0, kDecode = 1 };
enum class Role : uint8_t { kSystem = 0, kContext = 1, kQuestion = 2, kGenerated = 3 };
inline constexpr int kNumRoles = 4;

const char* ModalityName(Modality m);  // "text", "image", "video", "other"
const char* PhaseName(Phase p);        // "prefill", "decode"
const char* RoleName(Role r);          // "system", "context", "question", "generated"

// Storage dtype of Q/K/V in the file. The simulator always computes in fp32.
enum class StorageDtype : uint8_t { kFloat16 = 0, kFloat32 = 1 };
const char* StorageDtypeName(StorageDtype d);  // "float16", "float32"
int StorageDtypeBytes(StorageDtype d);

struct ModelInfo {
  std::string name;    // e.g. "llava-1.5-7b"
  std::string family;  // e.g. "llama"
  int num_layers = 0;
  int num_heads = 0;     // query heads
  int num_kv_heads = 0;  // == num_heads for MHA, < for GQA; num_heads % num_kv_heads == 0
  int head_dim = 0;
  double softmax_scale = 0;  // logits = scale * q.k (usually 1/sqrt(head_dim))
  bool causal = true;
  int sliding_window = 0;     // 0 = none; else a query at i sees keys j with i - j < sliding_window
  double logit_softcap = 0;   // 0 = none; else logits = cap * tanh(logits / cap)
  double rope_theta = 10000;  // informative (Q/K are stored post-RoPE)
  // dtype the model ran in (bytes per element drive KV memory accounting): "float16", "bfloat16", "float32"
  std::string model_dtype = "float16";
  int GroupSize() const { return num_kv_heads > 0 ? num_heads / num_kv_heads : 0; }
  int ModelDtypeBytes() const;  // 2 for float16/bfloat16, 4 for float32
};

// Per-token metadata, one entry per token of the whole sequence (prefill then decode), T entries.
struct TokenTable {
  std::vector<Modality> modality;
  std::vector<int32_t> segment_id;   // which image / frame / text span (-1: none)
  std::vector<int32_t> patch_row;    // row of the patch within its image/frame (-1: n/a)
  std::vector<int32_t> patch_col;    // column of the patch (-1: n/a)
  std::vector<int64_t> position_id;  // position id fed to RoPE
  std::vector<Phase> phase;
  std::vector<Role> role;
  std::vector<int64_t> token_id;  // vocabulary id, -1 when unknown (optional in the file)
  std::vector<std::string> text;  // optional; empty vector when absent
  int64_t size() const { return static_cast<int64_t>(modality.size()); }
  void Resize(int64_t n);
};

struct TraceMeta {
  int format_version = kTraceFormatVersion;
  ModelInfo model;
  int prefill_length = 0;            // n: tokens [0, n) are the prompt
  int num_decode_steps = 0;          // tokens [n, n + num_decode_steps) are generated
  std::string source = "synthetic";  // "synthetic" | "captured"
  std::string generator;             // tool that wrote it, e.g. "kvsim synth"
  std::string generator_version;
  uint64_t seed = 0;
  StorageDtype storage_dtype = StorageDtype::kFloat16;
  // Token positions whose queries are stored, ascending. Either all T tokens, or at least the last W prompt
  // tokens and every decode token.
  std::vector<int32_t> query_positions;
  bool has_prefill_column_sums = false;  // aggregates/layer_XXX/prefill_column_sums [H, n]
  TokenTable tokens;
  std::string config_text;  // optional: the generator config (e.g. synth textproto) for provenance

  int total_tokens() const { return prefill_length + num_decode_steps; }
  bool HasAllPromptQueries() const;
  // Index into query_positions of `pos`, or -1.
  int QueryIndex(int32_t pos) const;
  // Checks the invariants between fields (shapes, ranges, enums). Message names the field and the fix.
  Status Validate() const;
};

// One layer of tensors, fp32 in memory. Layouts are row-major:
//   keys, values: [num_kv_heads][T][head_dim]
//   queries:      [num_heads][query_positions.size()][head_dim]
//   prefill_column_sums (optional, empty if absent): [num_heads][n], Σ_i A[i, j] over prompt queries i
struct LayerData {
  int layer = -1;
  std::vector<float> keys;
  std::vector<float> values;
  std::vector<float> queries;
  std::vector<float> prefill_column_sums;
};

class TraceSource {
 public:
  virtual ~TraceSource() = default;
  virtual const TraceMeta& meta() const = 0;
  // Reads one layer; `out` is overwritten and has passed ValidateLayer (shapes, finite values). Only this
  // layer's data is resident. Must be callable from a
  // thread other than the one that opened the source (the engine prefetches the next layer), though never
  // concurrently with itself.
  virtual Status ReadLayer(int layer, LayerData* out) = 0;
  // Human-readable identity: a file path or "<memory>".
  virtual std::string Describe() const = 0;
  // Decode attention rows recorded by the capture tool for validation (the optional extension
  // /capture/decode_attention/layer_XXX, docs/trace-format.md): [num_heads][num_decode_steps][T], step s's
  // probabilities over keys [0, n + s]. Returns false when the trace has none. Only `kvsim validate` reads
  // it.
  virtual StatusOr<bool> ReadRecordedDecodeRows(int layer, std::vector<float>* out) { return false; }
};

class TraceSink {
 public:
  virtual ~TraceSink() = default;
  virtual Status Begin(const TraceMeta& meta) = 0;
  // Layers must be written in order 0..L-1.
  virtual Status WriteLayer(const LayerData& layer) = 0;
  // Completes the trace; for files, this is when the output appears under its final name.
  virtual Status Finish() = 0;
};

// Whole trace in memory: implements both interfaces (tests, tiny traces).
class MemoryTrace : public TraceSource, public TraceSink {
 public:
  MemoryTrace() = default;
  MemoryTrace(TraceMeta meta, std::vector<LayerData> layers)
      : meta_(std::move(meta)), layers_(std::move(layers)) {}
  const TraceMeta& meta() const override { return meta_; }
  Status ReadLayer(int layer, LayerData* out) override;
  std::string Describe() const override { return "<memory>"; }
  Status Begin(const TraceMeta& meta) override;
  Status WriteLayer(const LayerData& layer) override;
  Status Finish() override { return Status::Ok(); }
  TraceMeta& mutable_meta() { return meta_; }
  std::vector<LayerData>& layers() { return layers_; }

 private:
  TraceMeta meta_;
  std::vector<LayerData> layers_;
};

// Checks a layer's tensor sizes against the meta, and finiteness. `what` names the source for messages.
Status ValidateLayer(const TraceMeta& meta, const LayerData& layer, const std::string& what);

}  // namespace kvsim
