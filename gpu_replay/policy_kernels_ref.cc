// CPU reference of the policies' own GPU work (gpu_replay/kernels.h): observation-window scoring, per-head
// top-k selection with gather/compaction, cosine nearest-neighbour merging.

#include <algorithm>
#include <cmath>
#include <numeric>

#include "gpu_replay/kernels.h"

namespace kvsim::gpu_replay {

WindowScoreProblem MakeWindowScoreProblem(Dtype dtype, int num_q_heads, int num_kv_heads, int head_dim,
                                          int num_keys, int window, uint64_t seed) {
  KVSIM_CHECK(num_q_heads % num_kv_heads == 0 && window >= 1 && window <= num_keys);
  WindowScoreProblem p;
  p.dtype = dtype;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  p.num_keys = num_keys;
  p.window = window;
  p.q.resize(static_cast<size_t>(num_q_heads) * window * head_dim);
  p.k.resize(static_cast<size_t>(num_kv_heads) * num_keys * head_dim);
  for (size_t i = 0; i < p.q.size(); ++i) p.q[i] = FromFloat(dtype, 2.0f * HashUniform(seed, i));
  for (size_t i = 0; i < p.k.size(); ++i) p.k[i] = FromFloat(dtype, 2.0f * HashUniform(seed + 1, i));
  return p;
}

void RefWindowScores(const WindowScoreProblem& p, std::vector<float>* scores) {
  const int d = p.head_dim, n = p.num_keys, group = p.num_q_heads / p.num_kv_heads;
  scores->assign(static_cast<size_t>(p.num_kv_heads) * n, 0.0f);
  std::vector<float> q(d), logits(n), kf(static_cast<size_t>(n) * d);
  for (int h = 0; h < p.num_kv_heads; ++h) {
    for (size_t i = 0; i < kf.size(); ++i) kf[i] = ToFloat(p.dtype, p.k[static_cast<size_t>(h) * n * d + i]);
    float* out = &(*scores)[static_cast<size_t>(h) * n];
    for (int g = 0; g < group; ++g)
      for (int w = 0; w < p.window; ++w) {
        const int qh = h * group + g, pos = n - p.window + w;  // sees keys [0, pos]
        for (int k = 0; k < d; ++k)
          q[k] = ToFloat(p.dtype, p.q[(static_cast<size_t>(qh) * p.window + w) * d + k]);
        float mx = -INFINITY;
        for (int j = 0; j <= pos; ++j) {
          float dot = 0;
          for (int k = 0; k < d; ++k) dot += q[k] * kf[static_cast<size_t>(j) * d + k];
          logits[j] = dot * p.scale;
          mx = std::max(mx, logits[j]);
        }
        float sum = 0;
        for (int j = 0; j <= pos; ++j) sum += std::exp(logits[j] - mx);
        const float lse = mx + std::log(sum);
        for (int j = 0; j <= pos; ++j) out[j] += std::exp(logits[j] - lse);
      }
  }
}

TopKProblem MakeTopKProblem(Dtype dtype, std::span<const int32_t> lengths, std::span<const int32_t> keep,
                            int max_new, int head_dim, uint64_t seed) {
  KVSIM_CHECK(lengths.size() == keep.size());
  TopKProblem p;
  p.dtype = dtype;
  p.src = MakeRaggedLayout(lengths, 0, head_dim);
  p.keep.assign(keep.begin(), keep.end());
  p.max_new = max_new;
  p.scores.assign(p.src.total_slots, 0.0f);
  p.k.assign(static_cast<size_t>(p.src.total_slots) * head_dim, 0);
  p.v.assign(p.k.size(), 0);
  for (int h = 0; h < p.src.num_kv_heads; ++h)
    for (int s = 0; s < p.src.length[h]; ++s) {
      const int64_t slot = p.src.offset[h] + s;
      // Quantised scores so that ties occur (the tie rule is part of the contract).
      p.scores[slot] = std::round(64.0f * (HashUniform(seed, slot) + 1.0f)) / 64.0f;
      for (int k = 0; k < head_dim; ++k) {
        p.k[slot * head_dim + k] = FromFloat(dtype, HashUniform(seed + 1, slot * head_dim + k));
        p.v[slot * head_dim + k] = FromFloat(dtype, HashUniform(seed + 2, slot * head_dim + k));
      }
    }
  return p;
}

RaggedLayout TopKDestinationLayout(const TopKProblem& p) {
  std::vector<int32_t> kept(p.src.num_kv_heads);
  for (int h = 0; h < p.src.num_kv_heads; ++h) kept[h] = std::clamp(p.keep[h], 0, p.src.length[h]);
  return MakeRaggedLayout(kept, p.max_new, p.src.head_dim);
}

void RefTopKCompact(const TopKProblem& p, TopKResult* out) {
  const int d = p.src.head_dim;
  out->dst = TopKDestinationLayout(p);
  out->selected.assign(out->dst.total_slots, -1);
  out->k.assign(static_cast<size_t>(out->dst.total_slots) * d, 0);
  out->v.assign(out->k.size(), 0);
  std::vector<int32_t> idx;
  for (int h = 0; h < p.src.num_kv_heads; ++h) {
    const int n = p.src.length[h], keep = out->dst.length[h];
    const float* sc = &p.scores[p.src.offset[h]];
    idx.resize(n);
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + keep, idx.end(),
                      [&](int32_t a, int32_t b) { return sc[a] > sc[b] || (sc[a] == sc[b] && a < b); });
    std::sort(idx.begin(), idx.begin() + keep);
    for (int i = 0; i < keep; ++i) {
      out->selected[out->dst.offset[h] + i] = idx[i];
      std::copy_n(&p.k[p.src.Element(h, idx[i])], d, &out->k[out->dst.Element(h, i)]);
      std::copy_n(&p.v[p.src.Element(h, idx[i])], d, &out->v[out->dst.Element(h, i)]);
    }
  }
}

MergeProblem MakeMergeProblem(Dtype dtype, std::span<const int32_t> kept, std::span<const int32_t> evicted,
                              int head_dim, uint64_t seed) {
  KVSIM_CHECK(kept.size() == evicted.size());
  MergeProblem p;
  p.dtype = dtype;
  p.layout = MakeRaggedLayout(kept, 0, head_dim);
  p.k.assign(static_cast<size_t>(p.layout.total_slots) * head_dim, 0);
  p.v.assign(p.k.size(), 0);
  for (int h = 0; h < p.layout.num_kv_heads; ++h)
    for (int64_t i = p.layout.Element(h, 0); i < p.layout.Element(h, kept[h]); ++i) {
      p.k[i] = FromFloat(dtype, HashUniform(seed, i));
      p.v[i] = FromFloat(dtype, HashUniform(seed + 1, i));
    }
  p.evicted_first.push_back(0);
  for (int32_t e : evicted) p.evicted_first.push_back(p.evicted_first.back() + e);
  const size_t ne = static_cast<size_t>(p.evicted_first.back()) * head_dim;
  p.ek.resize(ne);
  p.ev.resize(ne);
  for (size_t i = 0; i < ne; ++i) {
    p.ek[i] = FromFloat(dtype, HashUniform(seed + 2, i));
    p.ev[i] = FromFloat(dtype, HashUniform(seed + 3, i));
  }
  return p;
}

void RefMergeNearest(const MergeProblem& p, MergeResult* out) {
  const RaggedLayout& L = p.layout;
  const int d = L.head_dim;
  const int total_e = p.evicted_first.back();
  out->nearest.assign(total_e, -1);
  out->similarity.assign(total_e, 0.0f);
  out->count.assign(L.total_slots, 0);
  std::vector<float> ksum(static_cast<size_t>(L.total_slots) * d, 0.0f), vsum(ksum.size(), 0.0f);
  for (int h = 0; h < L.num_kv_heads; ++h) {
    const int n = L.length[h];
    std::vector<float> knorm(n);
    for (int s = 0; s < n; ++s) {
      float ss = 0;
      for (int k = 0; k < d; ++k)
        ss += ToFloat(p.dtype, p.k[L.Element(h, s) + k]) * ToFloat(p.dtype, p.k[L.Element(h, s) + k]);
      knorm[s] = std::sqrt(ss);
    }
    for (int e = p.evicted_first[h]; e < p.evicted_first[h + 1] && n > 0; ++e) {
      const uint16_t* ke = &p.ek[static_cast<size_t>(e) * d];
      float en = 0;
      for (int k = 0; k < d; ++k) en += ToFloat(p.dtype, ke[k]) * ToFloat(p.dtype, ke[k]);
      en = std::sqrt(en);
      int best = 0;
      float best_sim = -INFINITY;
      for (int s = 0; s < n; ++s) {
        float dot = 0;
        for (int k = 0; k < d; ++k)
          dot += ToFloat(p.dtype, ke[k]) * ToFloat(p.dtype, p.k[L.Element(h, s) + k]);
        const float sim = (en > 0 && knorm[s] > 0) ? dot / (en * knorm[s]) : 0.0f;
        if (sim > best_sim) {
          best_sim = sim;
          best = s;
        }
      }
      out->nearest[e] = best;
      out->similarity[e] = best_sim;
      const int64_t slot = L.offset[h] + best;
      ++out->count[slot];
      for (int k = 0; k < d; ++k) {
        ksum[slot * d + k] += ToFloat(p.dtype, ke[k]);
        vsum[slot * d + k] += ToFloat(p.dtype, p.ev[static_cast<size_t>(e) * d + k]);
      }
    }
  }
  out->k = p.k;
  out->v = p.v;
  for (int64_t slot = 0; slot < L.total_slots; ++slot) {
    if (out->count[slot] == 0) continue;
    const float inv = 1.0f / (1.0f + out->count[slot]);
    for (int k = 0; k < d; ++k) {
      out->k[slot * d + k] =
          FromFloat(p.dtype, (ToFloat(p.dtype, p.k[slot * d + k]) + ksum[slot * d + k]) * inv);
      out->v[slot * d + k] =
          FromFloat(p.dtype, (ToFloat(p.dtype, p.v[slot * d + k]) + vsum[slot * d + k]) * inv);
    }
  }
}

}  // namespace kvsim::gpu_replay
