#pragma once
// Shared helpers for tests: tiny hand-made traces and scratch folders.

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "sim/trace.h"

namespace kvsim::testing {

struct TinyTraceSpec {
  int num_layers = 2;
  int num_heads = 2;
  int num_kv_heads = 2;
  int head_dim = 8;
  int prefill_length = 24;
  int decode_steps = 6;
  int image_begin = 4;  // tokens [image_begin, image_end) are image patches (one segment)
  int image_end = 16;
  int question_tokens = 4;  // last prompt tokens are the question
  bool all_queries = true;  // else the last 8 prompt queries + decode
  uint64_t seed = 1;
};

// A random (Gaussian) trace with valid metadata, entirely in memory.
MemoryTrace MakeTinyTrace(const TinyTraceSpec& spec = {});

// A fresh empty folder under /tmp/kvsim_test_<pid>/, which is removed when the test process exits normally
// (kept after a crash, or always with KVSIM_KEEP_TEST_DIRS=1).
std::string ScratchDir(const std::string& name);

// Path of the kvsim binary and the source tree (set by CMake).
std::string KvsimBinary();
std::string SourceDir();

// The whole content of a file ("" if it cannot be read).
std::string ReadFile(const std::string& path);
// Writes `text` to `path` (replacing it); returns `path`.
std::string WriteFile(const std::string& path, const std::string& text);

// Runs a shell command, returns its exit status; stdout+stderr captured into *output if given.
int RunCommand(const std::string& cmd, std::string* output = nullptr);

// Scales each row of the row-major n x d matrix *m to unit length as NearestByCosine's NormalizeRows does
// (a double sum of squares, a float inverse); zero rows stay zero.
void NormalizeRows(std::vector<float>* m, int d);
// n random rows of length d (normal coordinates from std::mt19937(seed)), scaled by NormalizeRows.
std::vector<float> UnitRows(int n, int d, uint32_t seed);

// A TraceSource over another that records which layers ReadLayer was asked for (in call order), and the
// sizes of the keys, values and queries buffers it was handed (before the read).
class CountingTrace final : public TraceSource {
 public:
  explicit CountingTrace(TraceSource& base) : base_(base) {}
  const TraceMeta& meta() const override { return base_.meta(); }
  using TraceSource::ReadLayer;
  Status ReadLayer(int layer, LayerData* out, const LayerReadOptions& options) override {
    reads.push_back(layer);
    handed.push_back({out->keys.size(), out->values.size(), out->queries.size()});
    return base_.ReadLayer(layer, out, options);
  }
  std::string Describe() const override { return base_.Describe(); }
  std::vector<int> reads;
  std::vector<std::array<size_t, 3>> handed;

 private:
  TraceSource& base_;
};

}  // namespace kvsim::testing
