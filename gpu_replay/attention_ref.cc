// CPU reference of the ragged split-KV decode attention (gpu_replay/kernels.h).

#include <algorithm>
#include <cmath>

#include "gpu_replay/kernels.h"

namespace kvsim::gpu_replay {

AttentionProblem MakeAttentionProblem(Dtype dtype, int num_q_heads, std::span<const int32_t> lengths,
                                      int max_new, int head_dim, uint64_t seed) {
  AttentionProblem p;
  p.dtype = dtype;
  p.num_q_heads = num_q_heads;
  p.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  p.layout = MakeRaggedLayout(lengths, max_new, head_dim);
  KVSIM_CHECK(num_q_heads % p.layout.num_kv_heads == 0);
  p.q.resize(static_cast<size_t>(num_q_heads) * head_dim);
  for (size_t i = 0; i < p.q.size(); ++i) p.q[i] = FromFloat(dtype, HashUniform(seed, i));
  const size_t n = static_cast<size_t>(p.layout.total_slots) * head_dim;
  p.k.assign(n, 0);
  p.v.assign(n, 0);
  for (int h = 0; h < p.layout.num_kv_heads; ++h)
    for (int64_t i = p.layout.Element(h, 0); i < p.layout.Element(h, p.layout.length[h]); ++i) {
      p.k[i] = FromFloat(dtype, HashUniform(seed + 1, i));
      p.v[i] = FromFloat(dtype, HashUniform(seed + 2, i));
    }
  return p;
}

void RefDecodeAttention(const AttentionProblem& p, const SplitKvPartition& part, std::vector<float>* out) {
  const RaggedLayout& L = p.layout;
  const int d = L.head_dim, group = p.group();
  out->assign(static_cast<size_t>(p.num_q_heads) * d, 0.0f);
  std::vector<float> q(d), kf(d), logits, acc;
  for (int h = 0; h < L.num_kv_heads; ++h) {
    const int first = part.head_first[h], last = part.head_first[h + 1];
    if (first == last) continue;
    for (int g = 0; g < group; ++g) {
      const int qh = h * group + g;
      for (int k = 0; k < d; ++k) q[k] = ToFloat(p.dtype, p.q[static_cast<size_t>(qh) * d + k]);
      // Per work item: max, sum of exp and unnormalised output (what the GPU's partial buffers hold).
      std::vector<float> m(last - first), l(last - first);
      std::vector<std::vector<float>> o(last - first, std::vector<float>(d, 0.0f));
      for (int it = first; it < last; ++it) {
        const WorkItem& w = part.items[it];
        logits.resize(w.end - w.begin);
        float mx = -INFINITY;
        for (int s = w.begin; s < w.end; ++s) {
          const uint16_t* kr = &p.k[L.Element(h, s)];
          float dot = 0;
          for (int k = 0; k < d; ++k) dot += q[k] * ToFloat(p.dtype, kr[k]);
          logits[s - w.begin] = dot * p.scale;
          mx = std::max(mx, logits[s - w.begin]);
        }
        float sum = 0;
        auto& ov = o[it - first];
        for (int s = w.begin; s < w.end; ++s) {
          const float e = std::exp(logits[s - w.begin] - mx);
          sum += e;
          const uint16_t* vr = &p.v[L.Element(h, s)];
          for (int k = 0; k < d; ++k) ov[k] += e * ToFloat(p.dtype, vr[k]);
        }
        m[it - first] = mx;
        l[it - first] = sum;
      }
      const float M = *std::max_element(m.begin(), m.end());
      float total = 0;
      acc.assign(d, 0.0f);
      for (int i = 0; i < last - first; ++i) {
        const float c = std::exp(m[i] - M);
        total += l[i] * c;
        for (int k = 0; k < d; ++k) acc[k] += o[i][k] * c;
      }
      for (int k = 0; k < d; ++k) (*out)[static_cast<size_t>(qh) * d + k] = acc[k] / total;
    }
  }
}

double MaxRelError(std::span<const float> a, std::span<const float> b) {
  KVSIM_CHECK(a.size() == b.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return diff / std::max(scale, 1e-30);
}

}  // namespace kvsim::gpu_replay
