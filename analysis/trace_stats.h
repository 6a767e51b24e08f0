#pragma once
// Statistics of a trace's decode attention (`kvsim inspect`, docs/synth.md): how concentrated it is, per
// layer and per modality, where it goes (sinks, recent tokens, text vs visual per head), and how similar the
// keys of neighbouring image patches are. Computed from the full-cache decode attention
// (ComputeDecodeReference) of every (layer, query head), streaming one layer at a time; deterministic for any
// thread count.

#include <cstdint>
#include <string>
#include <vector>

#include "analysis/json_reports.pb.h"
#include "sim/status.h"
#include "sim/trace.h"

namespace kvsim {

struct TraceStatsOptions {
  double top_fraction = 0.2;       // "top 20% of keys": ceil(top_fraction * count) keys, at least 1
  int sink_tokens = 4;             // the first tokens counted as sinks
  int recent_tokens = 32;          // the last visible keys of a decode step (the step itself included)
  double sparsity_epsilon = 1e-4;  // an entry counts as sparse when p <= epsilon (HAE, App. A.1)
  int max_cosine_pairs = 4096;     // per (layer, KV head) and kind of pair (adjacent / random)
  uint64_t cosine_seed = 1;        // chooses the random patch pairs
};

// Per layer; every attention quantity is a mean over decode steps and query heads unless said otherwise.
// "Visual" keys are image or video tokens; rows without a key of a modality are left out of its means.
struct LayerStats {
  int layer = 0;
  double entropy = 0;             // -sum p log p of a decode row, nats
  double normalized_entropy = 0;  // entropy / log(number of visible keys)
  double top_mass = 0;            // mass on the top `top_fraction` of visible keys
  double sink_mass = 0;           // mass on the first `sink_tokens` tokens
  double recent_mass = 0;         // mass on the last `recent_tokens` visible keys
  double k90 = 0;                 // fewest keys holding 90% of a decode row's mass
  double k90_fraction = 0;        // k90 / number of visible keys
  // mean_j∈visible ‖v_j‖ / ‖Σ_j p_j v_j‖: how much larger values are than the attention output (averaging
  // cancels them). Large ratios make any merge or eviction error large relative to the output.
  double value_output_ratio = 0;
  // Fraction of visible (row, key) entries with p <= epsilon, over all rows of the layer: all keys, text
  // keys, visual keys.
  double sparsity = 0;
  double text_sparsity = 0;
  double visual_sparsity = 0;
  // Within one modality: share of the modality's mass on its top `top_fraction` keys.
  double text_concentration = 0;
  double visual_concentration = 0;
  std::vector<double> head_text_share;  // [num_heads] mass on text keys / total, mean over decode steps
};

struct TraceStats {
  TraceStatsOptions options;
  std::vector<LayerStats> layers;
  // Mean cosine similarity of stored (post-RoPE) keys, over layers and KV heads: horizontally adjacent
  // patches (same image/frame, same row, columns c and c+1) and random pairs of distinct patches of the same
  // image/frame. 0 with no pairs (then the counts are 0).
  double adjacent_patch_key_cosine = 0;
  double random_patch_key_cosine = 0;
  int64_t num_adjacent_pairs = 0;  // per (layer, KV head)
  int64_t num_random_pairs = 0;
};

StatusOr<TraceStats> ComputeTraceStats(TraceSource& src, int threads, const TraceStatsOptions& options = {});

// Readable report: model, token counts by modality and role, a per-layer table, head text-share summary.
std::string FormatTraceStats(const TraceMeta& meta, const TraceStats& stats);

// The same as a message (analysis/json_reports.proto), and as JSON through the one writer (ToJson).
InspectReport TraceStatsReport(const TraceMeta& meta, const TraceStats& stats);
std::string TraceStatsToJson(const TraceMeta& meta, const TraceStats& stats);

}  // namespace kvsim
