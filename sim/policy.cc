#include "sim/policy.h"

namespace kvsim {

std::vector<int> Policy::LayerBudgets(const TraceMeta& meta, int budget, int compress_len) const {
  return std::vector<int>(meta.model.num_layers, std::min(budget, compress_len));
}

}  // namespace kvsim
