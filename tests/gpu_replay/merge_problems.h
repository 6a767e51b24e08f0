#pragma once
// Merge problems whose nearest slots are unambiguous, shared by the host-layer and GPU tests of the
// tensor-core merge (tests/gpu_replay/host_kernels_test.cc, gpu_kernels_test.cc).

#include <cstdint>
#include <vector>

#include "gpu_replay/kernels.h"

namespace kvsim::gpu_replay {

// Each evicted key is a chosen kept key of its head plus 5 % noise, so its nearest slot is unambiguous
// (cosine ~0.999 against ~0.3 for the others): any accumulation order of the dot products (tensor cores
// included) must find exactly that slot. *want: the chosen slot of every evicted key (-1 in heads with no
// kept slot).
inline MergeProblem SeparatedMergeProblem(Dtype dt, const std::vector<int32_t>& kept,
                                          const std::vector<int32_t>& evicted, int d, uint64_t seed,
                                          std::vector<int32_t>* want) {
  MergeProblem p = MakeMergeProblem(dt, kept, evicted, d, seed);
  want->assign(p.evicted_first.back(), -1);
  for (int h = 0; h < p.layout.num_kv_heads; ++h)
    for (int e = p.evicted_first[h]; e < p.evicted_first[h + 1] && kept[h] > 0; ++e) {
      const int j = (e * 7 + 3) % kept[h];
      (*want)[e] = j;
      for (int c = 0; c < d; ++c) {
        const size_t i = static_cast<size_t>(e) * d + c;
        p.ek[i] =
            FromFloat(dt, ToFloat(dt, p.k[p.layout.Element(h, j) + c]) + 0.05f * HashUniform(seed + 9, i));
      }
    }
  return p;
}

}  // namespace kvsim::gpu_replay
