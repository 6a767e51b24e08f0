#pragma once
// Text-proto files embedded in the binary at build time (cmake/embed_configs.cmake): the device profiles
// (configs/devices/) and model presets (configs/models/) of the latency model.

#include <string_view>
#include <vector>

namespace kvsim {

struct EmbeddedConfig {
  std::string_view path;  // relative to the source tree, e.g. "configs/devices/a100_sxm4_80gb.textproto"
  std::string_view text;
};

const std::vector<EmbeddedConfig>& EmbeddedDevices();
const std::vector<EmbeddedConfig>& EmbeddedModels();

}  // namespace kvsim
