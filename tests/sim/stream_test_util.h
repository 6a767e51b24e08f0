#pragma once
// A tiny hand-made streaming trace for the streaming engine and policy tests (docs/streaming.md layout):
// init prompt, frames of P tokens arriving at 1 fps from t = 0, questions (question + answer tokens) at the
// given times. Random Gaussian K/V/Q; every query stored. With rope_theta > 0 the stored K/Q are the
// pre-RoPE vectors (kept in pre_keys / pre_queries) rotated by their position ids.

#include <cmath>
#include <random>
#include <vector>

#include "sim/trace.h"
#include "sim/rope.h"

namespace kvsim::testing {

struct TinyStreamSpec {
  int num_layers = 2, num_heads = 2, num_kv_heads = 1, head_dim = 8;
  int init_len = 4, tokens_per_frame = 4, num_frames = 6;
  std::vector<double> question_times{2.5, 5.0};
  std::vector<std::vector<int32_t>> evidence{{1}, {3, 4}};
  int question_tokens = 2, answer_tokens = 2;
  double rope_theta = 0;
  uint64_t seed = 3;
};

struct TinyStream {
  MemoryTrace trace;
  std::vector<std::vector<float>> pre_keys, pre_queries;  // per layer, same layout as LayerData
};

inline TinyStream MakeTinyStreamTrace(const TinyStreamSpec& s = {}) {
  TraceMeta meta;
  meta.model.name = "tiny-stream";
  meta.model.family = "test";
  meta.model.num_layers = s.num_layers;
  meta.model.num_heads = s.num_heads;
  meta.model.num_kv_heads = s.num_kv_heads;
  meta.model.head_dim = s.head_dim;
  meta.model.softmax_scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  meta.model.rope_theta = s.rope_theta;
  meta.generator = "tests";
  meta.generator_version = "0";
  meta.seed = s.seed;
  StreamInfo st;
  st.fps = 1;
  st.init_len = s.init_len;
  st.tokens_per_frame = s.tokens_per_frame;
  st.num_frames = s.num_frames;
  for (int f = 0; f < s.num_frames; ++f) st.frame_time_s.push_back(f);
  const int video_end = s.init_len + s.num_frames * s.tokens_per_frame;
  meta.prefill_length = video_end;
  int t = video_end;
  for (size_t i = 0; i < s.question_times.size(); ++i) {
    StreamQuestion q;
    q.time_s = s.question_times[i];
    q.token_begin = t;
    q.num_question_tokens = s.question_tokens;
    q.num_answer_tokens = s.answer_tokens;
    q.frames_before = FramesBefore(st, q.time_s);
    if (i < s.evidence.size()) q.evidence_frames = s.evidence[i];
    t += s.question_tokens + s.answer_tokens;
    st.questions.push_back(q);
  }
  meta.num_decode_steps = t - video_end;
  meta.tokens.Resize(t);
  for (int i = 0; i < t; ++i) {
    meta.tokens.position_id[i] = i;
    if (i < s.init_len) meta.tokens.role[i] = Role::kSystem;
    if (i >= s.init_len && i < video_end) {
      const int v = i - s.init_len;
      meta.tokens.modality[i] = Modality::kVideo;
      meta.tokens.segment_id[i] = v / s.tokens_per_frame;
      meta.tokens.patch_row[i] = 0;
      meta.tokens.patch_col[i] = v % s.tokens_per_frame;
    }
  }
  for (const StreamQuestion& q : st.questions)
    for (int j = 0; j < q.num_question_tokens + q.num_answer_tokens; ++j) {
      const int i = q.token_begin + j;
      meta.tokens.position_id[i] = s.init_len + q.frames_before * s.tokens_per_frame + j;
      const bool answer = j >= q.num_question_tokens;
      meta.tokens.role[i] = answer ? Role::kGenerated : Role::kQuestion;
      meta.tokens.phase[i] = answer ? Phase::kDecode : Phase::kPrefill;
    }
  for (int i = 0; i < t; ++i) meta.query_positions.push_back(i);
  meta.stream = st;
  std::mt19937_64 rng(s.seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  TinyStream out;
  std::vector<LayerData> layers(s.num_layers);
  const int d = s.head_dim;
  for (int l = 0; l < s.num_layers; ++l) {
    LayerData& ld = layers[l];
    ld.layer = l;
    ld.keys.resize(static_cast<size_t>(s.num_kv_heads) * t * d);
    ld.values.resize(ld.keys.size());
    ld.queries.resize(static_cast<size_t>(s.num_heads) * t * d);
    for (float& x : ld.keys) x = 1.5f * nd(rng);
    for (float& x : ld.values) x = nd(rng);
    for (float& x : ld.queries) x = 1.5f * nd(rng);
    out.pre_keys.push_back(ld.keys);
    out.pre_queries.push_back(ld.queries);
    if (s.rope_theta > 0) {
      for (int h = 0; h < s.num_kv_heads; ++h)
        for (int i = 0; i < t; ++i)
          ApplyRope(ld.keys.data() + (static_cast<size_t>(h) * t + i) * d, d, meta.tokens.position_id[i],
                    s.rope_theta);
      for (int h = 0; h < s.num_heads; ++h)
        for (int i = 0; i < t; ++i)
          ApplyRope(ld.queries.data() + (static_cast<size_t>(h) * t + i) * d, d, meta.tokens.position_id[i],
                    s.rope_theta);
    }
  }
  out.trace = MemoryTrace(std::move(meta), std::move(layers));
  return out;
}

}  // namespace kvsim::testing
