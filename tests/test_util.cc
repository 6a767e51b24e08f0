#include "tests/test_util.h"

#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

namespace kvsim::testing {

MemoryTrace MakeTinyTrace(const TinyTraceSpec& s) {
  TraceMeta meta;
  meta.model.name = "tiny";
  meta.model.family = "test";
  meta.model.num_layers = s.num_layers;
  meta.model.num_heads = s.num_heads;
  meta.model.num_kv_heads = s.num_kv_heads;
  meta.model.head_dim = s.head_dim;
  meta.model.softmax_scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  meta.prefill_length = s.prefill_length;
  meta.num_decode_steps = s.decode_steps;
  meta.seed = s.seed;
  meta.generator = "tests";
  meta.generator_version = "0";
  const int t = s.prefill_length + s.decode_steps;
  meta.tokens.Resize(t);
  for (int i = 0; i < t; ++i) {
    meta.tokens.position_id[i] = i;
    if (i >= s.image_begin && i < s.image_end) {
      meta.tokens.modality[i] = Modality::kImage;
      meta.tokens.segment_id[i] = 0;
      meta.tokens.patch_row[i] = (i - s.image_begin) / 4;
      meta.tokens.patch_col[i] = (i - s.image_begin) % 4;
    }
    if (i < 2) meta.tokens.role[i] = Role::kSystem;
    if (i >= s.prefill_length - s.question_tokens && i < s.prefill_length)
      meta.tokens.role[i] = Role::kQuestion;
    if (i >= s.prefill_length) {
      meta.tokens.phase[i] = Phase::kDecode;
      meta.tokens.role[i] = Role::kGenerated;
    }
  }
  const int first_q = s.all_queries ? 0 : s.prefill_length - 8;
  for (int i = first_q; i < t; ++i) meta.query_positions.push_back(i);
  std::mt19937_64 rng(s.seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<LayerData> layers(s.num_layers);
  for (int l = 0; l < s.num_layers; ++l) {
    LayerData& ld = layers[l];
    ld.layer = l;
    ld.keys.resize(static_cast<size_t>(s.num_kv_heads) * t * s.head_dim);
    ld.values.resize(ld.keys.size());
    ld.queries.resize(static_cast<size_t>(s.num_heads) * meta.query_positions.size() * s.head_dim);
    for (float& x : ld.keys) x = 1.5f * nd(rng);
    for (float& x : ld.values) x = nd(rng);
    for (float& x : ld.queries) x = 1.5f * nd(rng);
  }
  return MemoryTrace(std::move(meta), std::move(layers));
}

namespace {

// The process's scratch root, /tmp/kvsim_test_<pid>, removed when the test process exits normally (a crashed
// or aborted test leaves it for inspection; so does KVSIM_KEEP_TEST_DIRS=1). Every test binary's ctest
// entries would otherwise leave one folder each, tens of MB, behind on every run.
class ScratchRoot {
 public:
  std::filesystem::path Get() {
    if (path_.empty())
      path_ = std::filesystem::temp_directory_path() / ("kvsim_test_" + std::to_string(::getpid()));
    return path_;
  }
  ~ScratchRoot() {
    const char* keep = std::getenv("KVSIM_KEEP_TEST_DIRS");
    if (path_.empty() || (keep != nullptr && *keep != '\0' && std::string(keep) != "0")) return;
    std::error_code ec;  // best effort: never throw from a destructor
    std::filesystem::remove_all(path_, ec);
  }

 private:
  std::filesystem::path path_;
};

ScratchRoot& TheScratchRoot() {
  static ScratchRoot root;
  return root;
}

}  // namespace

std::string ScratchDir(const std::string& name) {
  namespace fs = std::filesystem;
  fs::path p = TheScratchRoot().Get() / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
  return path;
}

std::string KvsimBinary() { return KVSIM_BINARY; }
std::string SourceDir() { return KVSIM_SOURCE_DIR; }

int RunCommand(const std::string& cmd, std::string* output) {
  std::string full = cmd + " 2>&1";
  FILE* f = ::popen(full.c_str(), "r");
  if (!f) return -1;
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  int st = ::pclose(f);
  if (output) *output = out;
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

void NormalizeRows(std::vector<float>* m, int d) {
  for (size_t r = 0; r < m->size() / d; ++r) {
    double s = 0;
    for (int k = 0; k < d; ++k) s += static_cast<double>((*m)[r * d + k]) * (*m)[r * d + k];
    if (s == 0) continue;
    const float inv = static_cast<float>(1.0 / std::sqrt(s));
    for (int k = 0; k < d; ++k) (*m)[r * d + k] *= inv;
  }
}

std::vector<float> UnitRows(int n, int d, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> m(static_cast<size_t>(n) * d);
  for (float& x : m) x = dist(g);
  NormalizeRows(&m, d);
  return m;
}

}  // namespace kvsim::testing
