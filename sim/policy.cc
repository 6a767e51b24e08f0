#include "sim/policy.h"

namespace kvsim {

std::vector<int> Policy::LayerBudgets(const TraceMeta& meta, int budget, int compress_len) const {
  return std::vector<int>(meta.model.num_layers, std::min(budget, compress_len));
}

std::vector<int> Policy::FirstPassLayers(const TraceMeta& meta, int) const {
  std::vector<int> all(meta.model.num_layers);
  for (int l = 0; l < meta.model.num_layers; ++l) all[l] = l;
  return all;
}

PolicyGpuWork Policy::gpu_work() const {
  const PolicyRequirements r = requirements();
  PolicyGpuWork w;
  w.window = r.window;
  w.all_query_scores = r.prompt_column_sums || r.first_pass_prompt_queries;
  w.decode_scores = r.decode_attention && evicts_during_decode();
  return w;
}

}  // namespace kvsim
