#pragma once
// Streaming video QA (docs/streaming.md): the interface the streaming engine (sim/stream_replay.h) drives.
// A StreamPolicy decides
//   1. what the memory bank stores as the video is encoded (blocks of video tokens and which of their tokens
//      are kept: StreamPlan::bank), and which encoding jobs produce it (StreamPlan::jobs);
//   2. for each question, the retrieved context at each layer (SelectAtLayer): an ordered list of bank
//      blocks (or parts of them) that is placed between the init prompt and the question.
// The engine owns time (frames, encoding jobs, questions and answer steps on the event queue), the memory
// tiers (CPU bank, GPU context), the invariants (a question only uses blocks complete before it) and the
// metrics.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "sim/status.h"
#include "sim/trace.h"

namespace kvsim {

// Where a block's K/V come from.
//   kStream: the continuous run (the trace's main K/V); a block is `length` consecutive video tokens.
//   kEncoded: a per-granularity block encoding (trace /streaming_blocks/gG, or derived from the continuous
//   run when the trace lacks it; see StreamBlockLayer::derived).
enum class BlockSource : uint8_t { kStream = 0, kEncoded = 1 };

// One memory unit of the bank.
struct BankBlock {
  BlockSource source = BlockSource::kStream;
  int granularity = 0;        // tokens in the block before compression (G); for kStream, its length
  int index = 0;              // kEncoded: block index b in the granularity's encoding; kStream: running index
  int32_t first_token = 0;    // trace position of the block's first token (video tokens are contiguous)
  int32_t ready_frame = 0;    // the frame whose arrival completes the block (its last token's frame)
  std::vector<int32_t> kept;  // kept offsets within the block, ascending (same at every layer and head)
  int32_t TracePosition(int offset) const { return first_token + offset; }
};

// One encoding job (one model pass over new video tokens): runs on the GPU server when `ready_frame` has
// arrived and lasts LatencyModel::PrefillDuration(tokens). Memory is given as tier totals: the GPU holds
// gpu_bytes_during while it runs; afterwards the tiers hold cpu_bytes_after (the bank: kept K/V offloaded
// plus retrieval keys) and gpu_bytes_after (what stays resident: init prompt, a local window, or a bank
// that is never offloaded). Bank blocks [bank_begin, bank_end) become usable when it is done.
struct EncodeJob {
  int32_t ready_frame = 0;
  int32_t tokens = 0;
  int32_t granularity = 0;  // for reporting
  int32_t bank_begin = 0;
  int32_t bank_end = 0;
  double gpu_bytes_during = 0;
  double gpu_bytes_after = 0;
  double cpu_bytes_after = 0;
};

// Everything a policy decides before the per-layer pass. Policies may derive to keep their own state
// (representatives, layer-independent selections).
class StreamPlan {
 public:
  virtual ~StreamPlan() = default;
  std::vector<BankBlock> bank;  // ordered by (ready_frame, job order)
  std::vector<EncodeJob> jobs;  // ordered by ready_frame; the engine runs them FIFO
  // GPU bytes before the first job (the init prompt's KV).
  double initial_gpu_bytes = 0;
  // true: the retrieved context is already resident on the GPU (full history, a recent window); false: it
  // is loaded from the bank for the question, on top of what is resident.
  bool context_resident = false;
  // false: no CPU bank (the blocks stay on the GPU, or are dropped as they leave a resident window): the
  // results' cpu_bank_tokens_final and bank_tokens_per_frame are 0, like cpu_bank_bytes_final.
  bool bank_offloaded = true;
  // Per question: named statistics reported in results (e.g. MuKV's candidates, rerank changes).
  std::vector<std::map<std::string, double>> question_stats;
  // Whether any block encoding used was derived from the continuous run (results marked approximate).
  bool approximate = false;
};

// How retrieved keys are positioned (RoPE, rotate-half convention with the trace's rope_theta; a no-op
// when rope_theta is 0).
enum class ContextPositions : uint8_t {
  // Keys keep the positions they were encoded at (continuous run: their trace positions; block encodings:
  // init_len + offset in the block). The question and answer follow the context (positions continue from
  // the context length), as Hugging Face assigns positions from the cache length (MuKV's code).
  kAsEncoded = 0,
  // Every key is re-rotated to its index in the assembled context (ReKV re-indexes at attention time).
  kReindexed = 1,
};

// One piece of the retrieved context: `offsets` of bank block `bank_index` (a subset of its kept offsets,
// ascending; empty = all kept).
struct ContextEntry {
  int32_t bank_index = 0;
  std::vector<int32_t> offsets;
};

struct ContextSelection {
  std::vector<ContextEntry> entries;  // in context order (after the init prompt, before the question)
  ContextPositions positions = ContextPositions::kAsEncoded;
};

// One layer of one granularity's block encodings as the policy sees them.
struct StreamBlockLayer {
  int granularity = 0;
  const BlockEncodingInfo* info = nullptr;
  const BlockLayerData* data = nullptr;  // keys/values [Hkv][B*G][d], attention_received [H][B*G] or empty
  // true: derived from the continuous run (K/V of the same tokens, attention from stored video queries);
  // such K/V carry their trace positions, not block-local ones.
  bool derived = false;
};

// Lazy access to layers for StreamPolicy::Plan (the engine caches what is read and frees it afterwards).
class StreamLayerAccess {
 public:
  virtual ~StreamLayerAccess() = default;
  virtual StatusOr<const LayerData*> Stream(int layer) = 0;
  virtual StatusOr<StreamBlockLayer> Blocks(int granularity, int layer) = 0;
};

// Work a policy shares between the runs of one replay (MuKV's compressed bank is the same at every budget):
// GetOrCompute runs `compute` once per (owner, key) — concurrent callers of the same key wait for it — and
// hands every caller the same value. Lives for one ReplayStream call.
class StreamPlanCache {
 public:
  using Value = std::shared_ptr<const void>;
  StatusOr<Value> GetOrCompute(const void* owner, const std::string& key,
                               const std::function<StatusOr<Value>()>& compute) {
    Entry* e;
    {
      std::lock_guard<std::mutex> lock(mu_);
      e = &entries_[{owner, key}];
    }
    std::lock_guard<std::mutex> lock(e->mu);
    if (!e->done) {
      auto v = compute();
      if (!v.ok()) return v.status();
      e->value = *v;
      e->done = true;
    }
    return e->value;
  }

 private:
  struct Entry {
    std::mutex mu;
    bool done = false;
    Value value;
  };
  std::mutex mu_;
  std::map<std::pair<const void*, std::string>, Entry> entries_;
};

struct StreamPlanInput {
  const TraceMeta* meta = nullptr;
  int budget_tokens = 0;  // retrieved visual tokens per layer and KV head; 0 = the policy's default
  StreamLayerAccess* layers = nullptr;
  int threads = 1;
  StreamPlanCache* cache = nullptr;  // set by the engine; null = nothing shared (direct calls in tests)
};

// What SelectAtLayer sees: this layer's continuous K/V/Q and the block encodings the policy asked for.
struct StreamLayerInput {
  const TraceMeta* meta = nullptr;
  int layer = 0;
  const LayerData* stream = nullptr;
  std::map<int, StreamBlockLayer> blocks;  // by granularity
  int budget_tokens = 0;
  // Bank blocks usable by this question: bank[i] with available[i] true (complete before the question).
  std::span<const uint8_t> available;
  // Full-history attention of the question's own tokens is NOT given: retrieval must use only what a
  // system has at question time.
};

struct StreamRequirements {
  // Block encodings read at every layer (context K/V) and in Plan. Missing ones are derived from the
  // continuous run (approximate), which needs the video tokens' queries when attention is needed.
  std::vector<int> granularities;
  bool needs_block_attention = false;  // attention_received of the encodings (at the plan layer)
  // Whether the trace's future (full-history attention of the question) may be used: only oracles.
  bool oracle = false;
};

class StreamPolicy {
 public:
  virtual ~StreamPolicy() = default;
  virtual std::string name() const = 0;
  virtual std::string ParamsText() const = 0;
  virtual StreamRequirements requirements() const = 0;
  // The budget a sweep uses when none is given (retrieved visual tokens per layer and KV head).
  virtual int DefaultBudgetTokens(const TraceMeta& meta) const = 0;
  virtual StatusOr<std::unique_ptr<StreamPlan>> Plan(const StreamPlanInput& in) const = 0;
  // The retrieved context for `question` at this layer. Must use only available blocks.
  virtual Status SelectAtLayer(const StreamLayerInput& in, const StreamPlan& plan, int question,
                               ContextSelection* out) const = 0;
  // Oracles only (requirements().oracle): called instead of SelectAtLayer with the question's
  // full-history attention mass per video token of this layer (summed over the question and answer
  // queries and query heads), [video tokens of the history].
  virtual Status SelectWithHindsight(const StreamLayerInput& in, const StreamPlan& plan, int question,
                                     std::span<const double> video_mass, ContextSelection* out) const {
    return Status::Internal(name() + " is not an oracle");
  }
};

// Per-token KV bytes over all layers and KV heads (K and V) at the model's dtype.
int64_t KvBytesPerToken(const TraceMeta& meta);

}  // namespace kvsim
