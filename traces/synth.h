#pragma once
// `kvsim synth`: synthetic traces from a documented generative model (docs/synth.md), streamed layer by
// layer into any TraceSink, deterministic in the seed.

#include <string>

#include "sim/trace.h"
#include "traces/synth_config.pb.h"

namespace kvsim {

// Parses a SynthConfig text proto; errors name the file, line and field.
StatusOr<synth::SynthConfig> LoadSynthConfig(const std::string& path);
StatusOr<synth::SynthConfig> ParseSynthConfig(const std::string& text, const std::string& what);

// Builds the trace metadata (model, token table, query positions) the config describes.
StatusOr<TraceMeta> BuildSynthMeta(const synth::SynthConfig& config);

// Generates the whole trace into `sink` (Begin, WriteLayer for each layer, Finish). Only one layer's
// tensors are resident at a time. `threads` parallelises within a layer; results do not depend on it.
Status Synthesize(const synth::SynthConfig& config, TraceSink* sink, int threads = 1);

}  // namespace kvsim
