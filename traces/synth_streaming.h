#pragma once
// `kvsim synth` for streaming video QA traces (SynthConfig.streaming; docs/synth.md "Streaming traces",
// docs/streaming.md): an init prompt, a video stream of frames arriving over time, and questions with
// ground-truth evidence frames, plus per-granularity block encodings (MuKV) of the video. Deterministic in
// the seed for any thread count.

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "sim/trace.h"
#include "traces/synth_config.pb.h"

namespace kvsim {

// A problem with a streaming config: the field path ((name, index into a repeated field or -1) from the
// SynthConfig root) and what to do.
struct StreamingConfigIssue {
  std::vector<std::pair<std::string, int>> path;
  std::string message;
};
std::optional<StreamingConfigIssue> CheckStreamingConfig(const synth::SynthConfig& config);

// Metadata of the streaming trace `config` describes (config.has_streaming(); checked).
StatusOr<TraceMeta> BuildStreamingSynthMeta(const synth::SynthConfig& config);

// Generates the whole streaming trace into `sink`, layer by layer (LayerData::blocks filled).
Status SynthesizeStreaming(const synth::SynthConfig& config, TraceSink* sink, int threads = 1);

}  // namespace kvsim
