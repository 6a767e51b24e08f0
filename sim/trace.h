#pragma once
// In-memory shapes of a kvsim trace (format documented in docs/trace-format.md) and the two interfaces
// the rest of kvsim uses to read and write one: TraceSource (layer-by-layer reads) and TraceSink
// (layer-by-layer writes). The HDF5 implementation lives in traces/; MemoryTrace below is an in-memory
// implementation of both, used by tests and by small pipelines.

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
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

// The per-(layer, query head) prompt attention entropies a trace may record (computed by HeadPromptEntropies,
// sim/attention.h): the causal self-attention's mean row entropy, and the text->visual and visual->text
// mean row entropies (MEDA's FULL_SELF and CROSS_MODAL quantities).
enum PromptEntropyKind { kSelfEntropy = 0, kTextToVisualEntropy = 1, kVisualToTextEntropy = 2 };
inline constexpr int kNumPromptEntropyKinds = 3;

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

// ---- Streaming video traces (docs/streaming.md) ----
// A streaming trace records a video stream that arrives over time and questions asked at timestamps. The
// token table holds, in order: the init (system) prompt [0, init_len), the video [init_len, init_len +
// num_frames * tokens_per_frame) (frame f's tokens are contiguous, segment_id = f), and then, per question in
// time order, its question tokens (role question, phase prefill) followed by its answer tokens (role
// generated, phase decode). prefill_length = init_len + num_frames * tokens_per_frame (the "stream");
// num_decode_steps = every question and answer token. K/V/Q of the question and answer tokens come from a
// run in which question i followed the frames that had arrived by its time: their position ids continue
// from init_len + frames_before * tokens_per_frame.
struct StreamQuestion {
  double time_s = 0;                // arrival time (video seconds)
  int32_t token_begin = 0;          // first question token in the token table (>= prefill_length)
  int32_t num_question_tokens = 0;  // >= 1
  int32_t num_answer_tokens = 0;    // answer decode steps, right after the question tokens (>= 1)
  // Frames with frame_time_s <= time_s: what the question may use. Derived from the times (not stored).
  int32_t frames_before = 0;
  std::vector<int32_t> evidence_frames;  // ground truth frames (synthetic traces); may be empty
};

// Per-granularity block encodings (MuKV): the video token stream [init_len, init_len + F*P) cut into
// contiguous G-token blocks from its start (the tail shorter than G is dropped), each block encoded on its
// own after the init prompt only (block-local positions init_len .. init_len + G - 1).
struct BlockEncodingInfo {
  int granularity = 0;  // G
  int num_blocks = 0;   // B = floor(F * P / G)
  // Trace position of each block token, [B * G] (block b's tokens are entries [b*G, (b+1)*G)).
  std::vector<int32_t> token_positions;
  // Layers whose attention_received is stored (ascending; always includes the last layer).
  std::vector<int32_t> attention_layers;
};

struct StreamInfo {
  double fps = 0;  // nominal frame rate (informative; frame_time_s is authoritative)
  int init_len = 0;
  int tokens_per_frame = 0;                        // P
  int num_frames = 0;                              // F
  std::vector<double> frame_time_s;                // [F], non-decreasing: arrival time of each frame
  std::vector<StreamQuestion> questions;           // by time (non-decreasing), spans in token-table order
  std::vector<BlockEncodingInfo> block_encodings;  // ascending granularity; may be empty

  int video_begin() const { return init_len; }
  int video_end() const { return init_len + num_frames * tokens_per_frame; }
  const BlockEncodingInfo* FindBlocks(int granularity) const;  // null if not stored
};

// Number of frames with frame_time_s <= t (frame_time_s non-decreasing): the frames a question at t may use.
int FramesBefore(const StreamInfo& s, double t);

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
  // Recorded prompt attention entropies (docs/trace-format.md "Aggregates"): the compressible-region ends
  // (compress_end: the prompt, and the context before the question) they were recorded for, ascending and
  // distinct, in [1, prefill_length]; empty = none recorded.
  std::vector<int32_t> prompt_entropy_regions;
  // Every layer's recorded values, [num_layers][regions][kNumPromptEntropyKinds][num_heads], filled by
  // sources (readers); empty or complete. Sinks ignore it: writers take each layer's
  // LayerData::prompt_entropies.
  std::vector<double> prompt_entropies;
  TokenTable tokens;
  std::string config_text;           // optional: the generator config (e.g. synth textproto) for provenance
  std::optional<StreamInfo> stream;  // set for streaming traces (group /streaming in the file)

  bool is_streaming() const { return stream.has_value(); }

  int total_tokens() const { return prefill_length + num_decode_steps; }
  bool HasAllPromptQueries() const;
  // Index into query_positions of `pos`, or -1.
  int QueryIndex(int32_t pos) const;
  // The recorded [kNumPromptEntropyKinds][num_heads] prompt entropies of `layer` over [0, compress_end), or
  // null when the trace has none for that region.
  const double* RecordedPromptEntropies(int layer, int compress_end) const;
  // Checks the invariants between fields (shapes, ranges, enums). Message names the field and the fix.
  Status Validate() const;
};

// One layer of tensors, fp32 in memory. Layouts are row-major:
//   keys, values: [num_kv_heads][T][head_dim]
//   queries:      [num_heads][query_positions.size()][head_dim]
//   prefill_column_sums (optional, empty if absent): [num_heads][n], Σ_i A[i, j] over prompt queries i
// One layer of one granularity's block encodings, fp32 in memory:
//   keys, values: [num_kv_heads][B*G][head_dim]
//   attention_received: [num_heads][B*G] (empty when not stored for this layer): per query head, the
//   attention each block token receives from its own block's queries (causal, softmax over init + block).
struct BlockLayerData {
  int granularity = 0;
  std::vector<float> keys;
  std::vector<float> values;
  std::vector<float> attention_received;
};

// A set of query rows (indices into TraceMeta::query_positions): every row (the default), or ascending,
// disjoint, non-adjacent half-open ranges. Readers read only these rows of a layer's queries.
class QueryRows {
 public:
  QueryRows() = default;  // every row
  static QueryRows None() {
    QueryRows r;
    r.all_ = false;
    return r;
  }
  // Adds rows [begin, end) (no-op when the set already holds every row or begin >= end).
  void Add(int32_t begin, int32_t end);
  bool all() const { return all_; }
  // Whether every row in [begin, end) is in the set (true for an empty range).
  bool Contains(int32_t begin, int32_t end) const;
  // The ranges, clipped to [0, num_rows) (all(): one range [0, num_rows)).
  std::vector<std::pair<int32_t, int32_t>> Ranges(int32_t num_rows) const;
  int64_t Count(int32_t num_rows) const;  // rows of [0, num_rows) in the set
  std::string Text() const;               // "all" or "[a, b) [c, d)" for messages
  bool operator==(const QueryRows&) const = default;

 private:
  bool all_ = true;
  std::vector<std::pair<int32_t, int32_t>> ranges_;
};

// How a TraceSource reads one layer (ReadLayer's options).
struct LayerReadOptions {
  QueryRows query_rows;  // the query rows to read; the others are left unspecified (LayerData::query_rows)
  int threads = 1;       // threads a reader may use to read and convert the layer (<= 0: hardware)
  bool direct_chunks = true;  // HDF5 reader: read plain checksummed chunks itself (false: always H5Dread)
};

struct LayerData {
  int layer = -1;
  std::vector<float> keys;
  std::vector<float> values;
  // [num_heads][Tq][head_dim] in size, but only the rows in `query_rows` hold the trace's values (the others
  // are unspecified): read rows through HeadQueries / QueryRow, which refuse a row that was not read.
  std::vector<float> queries;
  QueryRows query_rows;
  std::vector<float> prefill_column_sums;
  // Recorded prompt entropies of this layer (empty if absent): [regions][kNumPromptEntropyKinds][num_heads]
  // for meta.prompt_entropy_regions. Writers require them exactly when the meta lists regions.
  std::vector<double> prompt_entropies;
  // Streaming traces with block encodings: one entry per meta.stream->block_encodings, same order. Filled by
  // writers' callers (TraceSink::WriteLayer writes them); ReadLayer leaves it empty (use ReadBlockLayer).
  std::vector<BlockLayerData> blocks;

  // Query head `head`'s row 0 (row qi at [qi * head_dim, (qi + 1) * head_dim)), after checking that rows
  // [begin, end) were read: a row outside `query_rows` aborts (KVSIM_CHECK) instead of giving a wrong number.
  const float* HeadQueries(const TraceMeta& meta, int head, int32_t begin, int32_t end) const;
  // Row qi of query head `head` ([head_dim]), checked the same way.
  const float* QueryRow(const TraceMeta& meta, int head, int32_t qi) const;
};

// How well a trace file protects itself against undetected damage (docs/trace-format.md, "Integrity").
struct TraceIntegrity {
  bool known = false;               // false for sources that are not HDF5 files (in-memory traces)
  int superblock_version = 0;       // HDF5 superblock; >= 2 means every metadata structure carries a checksum
  int datasets = 0;                 // non-empty datasets
  int checksummed_datasets = 0;     // of those, the ones with a Fletcher32 checksum on every chunk
  int variable_length_strings = 0;  // attributes and datasets whose strings live in HDF5's global heap
  // Metadata checksummed, every dataset checksummed, no unchecksummed global-heap strings.
  bool checksummed() const {
    return superblock_version >= 2 && checksummed_datasets == datasets && variable_length_strings == 0;
  }
  std::string Text() const;  // one line, for `kvsim validate`
};

class TraceSource {
 public:
  virtual ~TraceSource() = default;
  virtual const TraceMeta& meta() const = 0;
  // Reads one layer; `out` is overwritten and has passed ValidateLayer (shapes, finite values of what was
  // read). Only this layer's data is resident. Reads only options.query_rows of the queries (out->query_rows
  // says which rows hold data). Must be callable from a thread other than the one that opened the source (the
  // engine prefetches the next layer), though never concurrently with itself.
  virtual Status ReadLayer(int layer, LayerData* out, const LayerReadOptions& options) = 0;
  // Every query row, one thread.
  Status ReadLayer(int layer, LayerData* out) { return ReadLayer(layer, out, LayerReadOptions{}); }
  // Human-readable identity: a file path or "<memory>".
  virtual std::string Describe() const = 0;
  // Decode attention rows recorded by the capture tool for validation (the optional extension
  // /capture/decode_attention/layer_XXX, docs/trace-format.md): [num_heads][num_decode_steps][T], step s's
  // probabilities over keys [0, n + s]. Returns false when the trace has none. Only `kvsim validate` reads
  // it.
  virtual StatusOr<bool> ReadRecordedDecodeRows(int layer, std::vector<float>* out) { return false; }
  // Streaming traces: one layer of one granularity's block encodings (meta().stream->FindBlocks(g) must be
  // non-null). Same threading contract as ReadLayer.
  virtual Status ReadBlockLayer(int granularity, int layer, BlockLayerData* out);
  // The file's integrity features (unknown for sources that are not files).
  virtual TraceIntegrity integrity() const { return {}; }
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
  // meta.prompt_entropies is filled from the layers' when empty.
  MemoryTrace(TraceMeta meta, std::vector<LayerData> layers);
  const TraceMeta& meta() const override { return meta_; }
  using TraceSource::ReadLayer;
  // Copies the layer; only options.query_rows are marked as read, so in-memory replays enforce the same
  // row contract as file reads.
  Status ReadLayer(int layer, LayerData* out, const LayerReadOptions& options) override;
  std::string Describe() const override { return "<memory>"; }
  Status Begin(const TraceMeta& meta) override;
  Status WriteLayer(const LayerData& layer) override;
  Status Finish() override { return Status::Ok(); }
  Status ReadBlockLayer(int granularity, int layer, BlockLayerData* out) override;
  TraceMeta& mutable_meta() { return meta_; }
  std::vector<LayerData>& layers() { return layers_; }

 private:
  TraceMeta meta_;
  std::vector<LayerData> layers_;
};

// The float counts a layer of `meta` holds (what ValidateLayer requires): keys and values each
// [num_kv_heads][T][head_dim], queries [num_heads][Tq][head_dim].
struct LayerSizes {
  size_t kv = 0, queries = 0;
};
LayerSizes ExpectedLayerSizes(const TraceMeta& meta);

// Checks a layer's tensor sizes against the meta, and finiteness (of the query rows in layer.query_rows)
// unless the caller has already checked it (`check_finite` false: a reader that scanned the values as it
// converted them, reporting with NonFiniteError). `what` names the source for messages.
Status ValidateLayer(const TraceMeta& meta, const LayerData& layer, const std::string& what,
                     bool check_finite = true);
// The error for a non-finite value at flat index `index` of dataset `name` ("<what>: layer N" in `where`).
Status NonFiniteError(const std::string& where, const char* name, size_t index);
// Checks one layer of block encodings against meta.stream (sizes, finiteness, attention_received present at
// the layers listed in attention_layers).
Status ValidateBlockLayer(const TraceMeta& meta, int layer, const BlockLayerData& block,
                          const std::string& what);
// Checks layer.blocks against meta.stream->block_encodings (one entry per granularity, same order; none for
// non-streaming traces), each with ValidateBlockLayer, and that the layer holds every query row. Used by
// sinks' WriteLayer.
Status ValidateLayerBlocks(const TraceMeta& meta, const LayerData& layer, const std::string& what);
// Checks one layer's recorded prompt entropies ([regions][kinds][num_heads]) against the meta: shape, and
// every value in [0, log(compress_end)] (NaN refused). `where` names the layer for messages.
Status ValidatePromptEntropies(const TraceMeta& meta, std::span<const double> v, const std::string& where);
// Empty when `regions` is a valid prompt_entropy_regions list for a prompt of `prefill_length` tokens
// (ascending, distinct, each in [1, prefill_length]); otherwise what is wrong ("must be ...").
std::string PromptEntropyRegionsIssue(std::span<const int32_t> regions, int prefill_length);
// Checks that layer.prompt_entropies is present exactly when meta.prompt_entropy_regions is non-empty (sinks'
// WriteLayer; ValidateLayer checks their shape and range).
Status CheckLayerPromptEntropies(const TraceMeta& meta, const LayerData& layer, const std::string& what);

}  // namespace kvsim
