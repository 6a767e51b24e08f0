// libFuzzer target: the text-proto readers (sim/text_proto.h) and the checks that follow parsing, for every
// kind of text config kvsim reads. The first byte picks the kind ('0'..'5' in the seeds), the rest is the
// text: 0 synth config (kvsim synth: parse, field checks, the trace metadata it describes), 1 experiment
// (kvsim sweep / gpu-plan --config), 2 device profile and 3 model shape (--device / --model files, then one
// modelled decode step), 4 latency model (--latency-model), 5 a policy name and `--set key=value` lines
// (kvsim run --policy P --set ..., plain and streaming registries). Errors are fine; crashes, hangs, leaks
// and unbounded memory are not.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "analysis/sweep.h"
#include "policies/registry.h"
#include "policies/stream_registry.h"
#include "sim/latency_model.h"
#include "sim/perf_model.h"
#include "sim/text_proto.h"
#include "traces/synth.h"

namespace {

using namespace kvsim;

// One modelled decode step and prefill of a checked device and model shape (what --device computes).
void ModelOneStep(const DeviceProfile& device, const ModelShape& model) {
  auto clock = MakeDeviceLatencyModel(device, model);
  (void)clock->UniformDecodeStepDuration(4096, model.num_layers(), model.num_kv_heads());
  (void)clock->PrefillDuration(512, 0);
}

void SynthConfigInput(const std::string& text) {
  auto config = ParseSynthConfig(text, "fuzz.textproto");
  if (config.ok()) (void)BuildSynthMeta(*config);
}

void DeviceInput(const std::string& text) {
  DeviceProfile device;
  if (!ParseTextProto(text, "fuzz.textproto", &device).ok()) return;
  if (!CheckDevice(device, "fuzz.textproto").ok()) return;
  auto model = FindModelShape("llava-1.5-7b");
  if (model.ok()) ModelOneStep(device, *model);
}

void ModelShapeInput(const std::string& text) {
  ModelShape model;
  if (!ParseTextProto(text, "fuzz.textproto", &model).ok()) return;
  if (!CheckModelShape(model, "fuzz.textproto").ok()) return;
  auto device = FindDevice("a100-sxm");
  if (device.ok()) ModelOneStep(*device, model);
}

void PolicyInput(const std::string& text) {
  std::istringstream lines(text);
  std::string name;
  std::getline(lines, name);
  std::vector<std::string> sets;
  for (std::string line; std::getline(lines, line);) sets.push_back(line);
  (void)PolicyRegistry::Default().Create(name, sets);
  (void)StreamPolicyRegistry::Default().Create(name, sets);
}

}  // namespace

// The reader and synth check sizes against the memory kvsim may use before allocating: make that less than
// libFuzzer's -rss_limit_mb (2048), so a refused size is an error, not an out-of-memory finding.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("KVSIM_MAX_MEMORY", "512M", /*overwrite=*/0);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 6) {
    case 0:
      SynthConfigInput(text);
      break;
    case 1:
      (void)ParseExperiment(text, "fuzz.textproto");
      break;
    case 2:
      DeviceInput(text);
      break;
    case 3:
      ModelShapeInput(text);
      break;
    case 4:
      (void)ParseLatencyModel(text, "fuzz.textproto");
      break;
    case 5:
      PolicyInput(text);
      break;
  }
  return 0;
}
