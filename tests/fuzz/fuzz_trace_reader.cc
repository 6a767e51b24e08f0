// libFuzzer target: bytes -> Hdf5TraceReader::OpenImage -> everything `kvsim validate` / `run` read from a
// trace (every layer, streaming block layers, recorded decode rows, the metadata checks) and the validation
// of recorded aggregates. Any outcome is fine except a crash, a hang, a leak or unbounded memory
// (docs/hardening.md "Fuzzing").

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "analysis/stream_sweep.h"
#include "analysis/validate.h"
#include "traces/hdf5_trace.h"

// The reader and synth check sizes against the memory kvsim may use before allocating: make that less than
// libFuzzer's -rss_limit_mb (2048), so a refused size is an error, not an out-of-memory finding.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("KVSIM_MAX_MEMORY", "512M", /*overwrite=*/0);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvsim;
  auto reader = Hdf5TraceReader::OpenImage("fuzz.h5", data, size);
  if (!reader.ok()) return 0;
  Hdf5TraceReader& trace = **reader;
  const TraceMeta& meta = trace.meta();
  if (!meta.Validate().ok()) return 0;  // Open validated it: a failure here is still no crash
  bool all_ok = true;
  LayerData layer;
  std::vector<float> rows;
  BlockLayerData block;
  for (int l = 0; l < meta.model.num_layers; ++l) {
    all_ok &= trace.ReadLayer(l, &layer).ok();
    all_ok &= trace.ReadRecordedDecodeRows(l, &rows).ok();
    if (meta.is_streaming())
      for (const BlockEncodingInfo& b : meta.stream->block_encodings)
        all_ok &= trace.ReadBlockLayer(b.granularity, l, &block).ok();
  }
  if (meta.is_streaming()) {
    (void)FormatStreamSummary(meta);  // what `kvsim inspect` prints for a streaming trace
  } else if (all_ok) {
    (void)ValidateTrace(trace, /*threads=*/1);  // `kvsim validate`: recomputes the recorded aggregates
  }
  return 0;
}
