#include "traces/synth_streaming.h"

#include <cblas.h>
#include <google/protobuf/text_format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>

#include "sim/attention.h"
#include "sim/parallel.h"
#include "sim/resources.h"
#include "sim/version.h"
#include "traces/half.h"
#include "traces/synth_rng.h"

namespace kvsim {
namespace {

using synth::StreamingSynth;
using synth::SynthConfig;
using synth_rng::Rng;

// Random streams of the streaming generator (distinct from traces/synth.cc's purposes).
enum class Purpose : uint64_t {
  kScenes = 201,
  kQuestion,
  kDirections,
  kSceneVectors,
  kFrameDrift,
  kVideoKeyNoise,
  kVideoValueNoise,
  kInitNoise,
  kQaNoise,
  kQueryHead,
  kQaQueryNoise,
  kVideoQueryNoise,
};

constexpr int kDefaultGranularities[] = {49, 196, 784};

std::string Num(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

std::optional<StreamingConfigIssue> Issue(const char* message_name, const char* field, std::string what) {
  return StreamingConfigIssue{{{message_name, -1}, {field, -1}}, std::move(what)};
}
std::optional<StreamingConfigIssue> StreamIssue(const char* field, std::string what) {
  return Issue("streaming", field, std::move(what));
}

std::vector<int> Granularities(const StreamingSynth& s) {
  std::vector<int> g;
  if (!s.block_encodings()) return g;
  const int64_t video = static_cast<int64_t>(s.num_frames()) * s.rows() * s.cols();
  if (s.granularities().empty()) {
    for (int x : kDefaultGranularities)
      if (x <= video) g.push_back(x);
  } else {
    g.assign(s.granularities().begin(), s.granularities().end());
  }
  return g;
}

// ---------------------------------------------------------------------------------------------------------
// The plan: token layout, scenes, questions, evidence (shared by every layer and head).

struct QuestionPlan {
  int frame = 0;          // the question is asked at frame_time_s[frame]
  int frames_before = 0;  // frame + 1
  std::vector<int> evidence;
  int r0 = 0, c0 = 0, rh = 0, rw = 0;  // evidence rectangle (patch rows [r0, r0+rh), cols [c0, c0+rw))
  int begin = 0;                       // first question token
};

struct Plan {
  TraceMeta meta;
  int init_len = 0, rows = 0, cols = 0, per_frame = 0, frames = 0, video_begin = 0, video_end = 0;
  int num_scenes = 0;
  std::vector<int> scene_of_frame;
  std::vector<QuestionPlan> questions;
  std::vector<std::vector<int>> frame_questions;  // questions whose evidence includes frame f
  std::vector<int> granularities;

  int VideoTokens() const { return video_end - video_begin; }
  // Does video token v (index within the video) lie in question i's evidence rectangle?
  bool InEvidence(int i, int v) const {
    const QuestionPlan& q = questions[i];
    const int p = v % per_frame, r = p / cols, c = p % cols;
    return r >= q.r0 && r < q.r0 + q.rh && c >= q.c0 && c < q.c0 + q.rw;
  }
};

Plan MakePlan(const SynthConfig& c) {
  const StreamingSynth& s = c.streaming();
  Plan plan;
  plan.init_len = s.init_tokens();
  plan.rows = s.rows();
  plan.cols = s.cols();
  plan.per_frame = s.rows() * s.cols();
  plan.frames = s.num_frames();
  plan.video_begin = plan.init_len;
  plan.video_end = plan.init_len + plan.frames * plan.per_frame;
  plan.granularities = Granularities(s);

  // Scenes: a new scene starts at each frame after the first with probability 1 / scene_frames_mean.
  Rng scene_rng(c.seed(), Purpose::kScenes);
  plan.scene_of_frame.resize(plan.frames);
  for (int f = 1; f < plan.frames; ++f)
    plan.scene_of_frame[f] = plan.scene_of_frame[f - 1] + (scene_rng.Uniform() < 1.0 / s.scene_frames_mean());
  plan.num_scenes = plan.scene_of_frame.back() + 1;

  StreamInfo info;
  info.fps = s.fps();
  info.init_len = plan.init_len;
  info.tokens_per_frame = plan.per_frame;
  info.num_frames = plan.frames;
  for (int f = 0; f < plan.frames; ++f) info.frame_time_s.push_back(f / s.fps());

  // Questions: from ~20% of the duration to the last frame, evenly, on frame times.
  const int nq = s.num_questions();
  const double t_end = info.frame_time_s.back();
  plan.frame_questions.resize(plan.frames);
  int cursor = plan.video_end;
  for (int i = 0; i < nq; ++i) {
    QuestionPlan q;
    const double target = nq == 1 ? t_end : t_end * (0.2 + 0.8 * i / (nq - 1));
    q.frame = std::clamp(static_cast<int>(std::lround(target * s.fps())), 0, plan.frames - 1);
    q.frames_before = q.frame + 1;
    Rng rng(c.seed(), Purpose::kQuestion, i);
    const int span = s.evidence_frames_max() - s.evidence_frames_min() + 1;
    const int len =
        std::min(q.frames_before, s.evidence_frames_min() + static_cast<int>(rng.Uniform() * span));
    const int age = std::min(s.min_evidence_age_frames(), q.frames_before - len);
    const int last_start = q.frames_before - len - age;  // the run ends at least `age` frames before
    std::vector<int> inside, all;
    for (int st = 0; st <= last_start; ++st) {
      all.push_back(st);
      if (plan.scene_of_frame[st] == plan.scene_of_frame[st + len - 1]) inside.push_back(st);
    }
    const std::vector<int>& pick = inside.empty() ? all : inside;
    const int start =
        pick[std::min<size_t>(pick.size() - 1, static_cast<size_t>(rng.Uniform() * pick.size()))];
    for (int f = start; f < start + len; ++f) {
      q.evidence.push_back(f);
      plan.frame_questions[f].push_back(i);
    }
    const double side = std::sqrt(s.evidence_patch_fraction());
    q.rh = std::clamp(static_cast<int>(std::lround(plan.rows * side)), 1, plan.rows);
    q.rw = std::clamp(static_cast<int>(std::lround(plan.cols * side)), 1, plan.cols);
    q.r0 = std::min(plan.rows - q.rh, static_cast<int>(rng.Uniform() * (plan.rows - q.rh + 1)));
    q.c0 = std::min(plan.cols - q.rw, static_cast<int>(rng.Uniform() * (plan.cols - q.rw + 1)));
    q.begin = cursor;
    cursor += s.question_tokens() + s.answer_tokens();
    StreamQuestion sq;
    sq.time_s = info.frame_time_s[q.frame];
    sq.token_begin = q.begin;
    sq.num_question_tokens = s.question_tokens();
    sq.num_answer_tokens = s.answer_tokens();
    sq.frames_before = q.frames_before;
    sq.evidence_frames = q.evidence;
    info.questions.push_back(sq);
    plan.questions.push_back(std::move(q));
  }
  const int total = cursor;

  const int num_layers = c.model().num_layers();
  for (int g : plan.granularities) {
    BlockEncodingInfo b;
    b.granularity = g;
    b.num_blocks = plan.VideoTokens() / g;
    for (int j = 0; j < b.num_blocks * g; ++j) b.token_positions.push_back(plan.video_begin + j);
    if (s.store_video_queries())
      for (int l = 0; l < num_layers; ++l) b.attention_layers.push_back(l);
    else
      b.attention_layers.push_back(num_layers - 1);
    info.block_encodings.push_back(std::move(b));
  }

  TraceMeta& meta = plan.meta;
  const synth::ModelShape& m = c.model();
  meta.model.name = m.name();
  meta.model.family = m.family();
  meta.model.num_layers = num_layers;
  meta.model.num_heads = m.num_heads();
  meta.model.num_kv_heads = m.num_kv_heads();
  meta.model.head_dim = m.head_dim();
  meta.model.softmax_scale = 1.0 / std::sqrt(static_cast<double>(m.head_dim()));
  meta.model.causal = true;
  meta.model.rope_theta = m.rope_theta();
  meta.model.model_dtype = m.model_dtype();
  meta.prefill_length = plan.video_end;
  meta.num_decode_steps = total - plan.video_end;
  meta.source = "synthetic";
  meta.generator = "kvsim synth";
  meta.generator_version = kVersion;
  meta.seed = c.seed();
  meta.storage_dtype = c.storage().dtype() == "float32" ? StorageDtype::kFloat32 : StorageDtype::kFloat16;
  meta.has_prefill_column_sums = false;
  google::protobuf::TextFormat::PrintToString(c, &meta.config_text);

  TokenTable& tk = meta.tokens;
  tk.Resize(total);
  for (int j = 0; j < total; ++j) tk.position_id[j] = j;
  for (int j = 0; j < plan.init_len; ++j) tk.role[j] = Role::kSystem;
  for (int j = plan.video_begin; j < plan.video_end; ++j) {
    const int v = j - plan.video_begin, p = v % plan.per_frame;
    tk.modality[j] = Modality::kVideo;
    tk.segment_id[j] = v / plan.per_frame;
    tk.patch_row[j] = p / plan.cols;
    tk.patch_col[j] = p % plan.cols;
    tk.role[j] = Role::kContext;
  }
  for (const QuestionPlan& q : plan.questions) {
    const int base = plan.init_len + q.frames_before * plan.per_frame;
    for (int k = 0; k < s.question_tokens() + s.answer_tokens(); ++k) {
      const int j = q.begin + k;
      const bool question = k < s.question_tokens();
      tk.role[j] = question ? Role::kQuestion : Role::kGenerated;
      tk.phase[j] = question ? Phase::kPrefill : Phase::kDecode;
      tk.position_id[j] = base + k;
    }
  }
  for (int j = s.store_video_queries() ? 0 : plan.video_end; j < total; ++j)
    meta.query_positions.push_back(j);
  meta.stream = std::move(info);
  return plan;
}

// ---------------------------------------------------------------------------------------------------------
// Vectors.

void UnitVector(Rng& rng, int d, float* out) {
  double norm = 0;
  for (int k = 0; k < d; ++k) {
    out[k] = rng.Normal();
    norm += static_cast<double>(out[k]) * out[k];
  }
  const float inv = static_cast<float>(1.0 / std::sqrt(std::max(norm, 1e-30)));
  for (int k = 0; k < d; ++k) out[k] *= inv;
}

// x += a * N(0, I / d) (expected norm a).
void AddNoise(Rng& rng, int d, float a, float* x) {
  const float s = a / std::sqrt(static_cast<float>(d));
  for (int k = 0; k < d; ++k) x[k] += s * rng.Normal();
}

void Axpy(float a, const float* x, int d, float* y) {
  for (int k = 0; k < d; ++k) y[k] += a * x[k];
}

double DotD(const float* a, const float* b, int d) {
  double s = 0;
  for (int k = 0; k < d; ++k) s += static_cast<double>(a[k]) * b[k];
  return s;
}

void RoundToHalf(float* x, size_t n) {
  uint16_t buf[256];
  for (size_t i = 0; i < n; i += 256) {
    const size_t m = std::min<size_t>(256, n - i);
    FloatToHalf(x + i, buf, m);
    HalfToFloat(buf, x + i, m);
  }
}

// out[t] = own[t] + mix * mean(own[u], u in [max(lo(t), t - window), t)), 0 when the range is empty, for rows
// t of `own` ([n][d]); lo(t) = the start of t's segment when `segment` > 0 (blocks), else 0.
void MixContext(const float* own, int n, int d, double mix, int window, int segment, float* out) {
  std::vector<double> sum(d, 0.0);
  int lo = 0;  // rows [lo, t) are in `sum`
  for (int t = 0; t < n; ++t) {
    if (segment > 0 && t % segment == 0) {
      std::fill(sum.begin(), sum.end(), 0.0);
      lo = t;
    }
    while (t - lo > window) {
      for (int k = 0; k < d; ++k) sum[k] -= own[static_cast<size_t>(lo) * d + k];
      ++lo;
    }
    const float* x = own + static_cast<size_t>(t) * d;
    float* y = out + static_cast<size_t>(t) * d;
    const int count = t - lo;
    for (int k = 0; k < d; ++k) y[k] = x[k] + (count ? static_cast<float>(mix * sum[k] / count) : 0.0f);
    for (int k = 0; k < d; ++k) sum[k] += x[k];
  }
}

// ---------------------------------------------------------------------------------------------------------
// Calibration: (alpha, gamma) such that softmax(alpha A + B + gamma C) puts `pe` on set E and `ps` on set S
// (2-D damped Newton on the log shares; the Jacobian is a difference of softmax-weighted means).

std::pair<double, double> Calibrate(const std::vector<double>& a, const std::vector<double>& b,
                                    const std::vector<double>& cc, const std::vector<char>& in_e,
                                    const std::vector<char>& in_s, double pe, double ps, bool with_s) {
  const size_t n = a.size();
  double alpha = 0, gamma = 0;
  double amax = 1e-9, cmax = 1e-9;
  for (size_t j = 0; j < n; ++j) {
    amax = std::max(amax, std::abs(a[j]));
    cmax = std::max(cmax, std::abs(cc[j]));
  }
  for (int iter = 0; iter < 60; ++iter) {
    double mx = -1e300;
    for (size_t j = 0; j < n; ++j) mx = std::max(mx, alpha * a[j] + b[j] + gamma * cc[j]);
    double z = 0, ze = 0, zs = 0, ma = 0, mc = 0, mea = 0, mec = 0, msa = 0, msc = 0;
    for (size_t j = 0; j < n; ++j) {
      const double e = std::exp(alpha * a[j] + b[j] + gamma * cc[j] - mx);
      z += e;
      ma += e * a[j];
      mc += e * cc[j];
      if (in_e[j]) ze += e, mea += e * a[j], mec += e * cc[j];
      if (in_s[j]) zs += e, msa += e * a[j], msc += e * cc[j];
    }
    if (!(ze > 0) || (with_s && !(zs > 0))) break;
    const double re = std::log(ze / z) - std::log(pe), rs = with_s ? std::log(zs / z) - std::log(ps) : 0.0;
    if (std::abs(re) < 1e-4 && std::abs(rs) < 1e-4) break;
    ma /= z, mc /= z;
    const double j11 = mea / ze - ma, j12 = mec / ze - mc;
    const double j21 = with_s ? msa / zs - ma : 0, j22 = with_s ? msc / zs - mc : 0;
    const double det = j11 * j22 - j12 * j21;
    double da, dg;
    if (!with_s) {
      da = j11 > 1e-12 ? -re / j11 : 1.0;
      dg = 0;
    } else if (std::abs(det) > 1e-12) {
      da = (-re * j22 + rs * j12) / det;
      dg = (-rs * j11 + re * j21) / det;
    } else {
      da = j11 > 1e-12 ? -re / j11 : 0;
      dg = j22 > 1e-12 ? -rs / j22 : 0;
    }
    // Damping: no logit moves by more than 4 nats per step.
    const double move = std::abs(da) * amax + std::abs(dg) * cmax;
    const double f = move > 4 ? 4 / move : 1;
    alpha += f * da;
    gamma += f * dg;
  }
  return {alpha, gamma};
}

// ---------------------------------------------------------------------------------------------------------
// The generator (docs/synth.md, "Streaming traces").

class StreamGenerator {
 public:
  StreamGenerator(const SynthConfig& c, const Plan& plan)
      : c_(c),
        s_(c.streaming()),
        plan_(plan),
        meta_(plan.meta),
        d_(plan.meta.model.head_dim),
        t_(plan.meta.total_tokens()),
        nv_(plan.VideoTokens()),
        scale_(plan.meta.model.softmax_scale),
        round_half_(plan.meta.storage_dtype == StorageDtype::kFloat16) {}

  void GenerateLayer(int layer, int threads, LayerData* out) {
    const ModelInfo& m = meta_.model;
    const int kvh = m.num_kv_heads, heads = m.num_heads, group = m.GroupSize();
    const int nq = static_cast<int>(plan_.questions.size());
    const size_t tq = meta_.query_positions.size();
    out->layer = layer;
    out->keys.assign(static_cast<size_t>(kvh) * t_ * d_, 0.0f);
    out->values.assign(out->keys.size(), 0.0f);
    out->queries.assign(static_cast<size_t>(heads) * tq * d_, 0.0f);
    out->prefill_column_sums.clear();
    out->blocks.assign(plan_.granularities.size(), BlockLayerData{});
    for (size_t gi = 0; gi < plan_.granularities.size(); ++gi) {
      const int g = plan_.granularities[gi];
      const size_t bg = static_cast<size_t>(nv_ / g) * g;
      out->blocks[gi].granularity = g;
      out->blocks[gi].keys.assign(static_cast<size_t>(kvh) * bg * d_, 0.0f);
      out->blocks[gi].values.assign(out->blocks[gi].keys.size(), 0.0f);
    }

    std::vector<Latents> lat(kvh);
    ParallelFor(kvh, threads, [&](int g) { GenerateKv(layer, g, &lat[g], out); });
    // Question calibration per (KV head, question).
    std::vector<std::pair<double, double>> coef(static_cast<size_t>(kvh) * nq);
    ParallelFor(kvh * nq, threads, [&](int item) {
      const int g = item / nq, i = item % nq;
      coef[item] = CalibrateQuestion(g, i, lat[g], out->keys.data() + static_cast<size_t>(g) * t_ * d_);
    });
    ParallelFor(heads, threads, [&](int h) {
      const int g = h / group;
      GenerateQueries(layer, h, lat[g], coef.data() + static_cast<size_t>(g) * nq,
                      out->keys.data() + static_cast<size_t>(g) * t_ * d_, out->queries.data());
    });
    for (size_t gi = 0; gi < plan_.granularities.size(); ++gi) {
      const BlockEncodingInfo& info = meta_.stream->block_encodings[gi];
      if (!std::binary_search(info.attention_layers.begin(), info.attention_layers.end(), layer)) continue;
      BlockAttention(layer, info, lat, out->keys, threads, &out->blocks[gi]);
    }
  }

 private:
  // Per (layer, KV head) unit directions: sink z, video m, evidence w_i and value signature y_i per
  // question.
  struct Latents {
    std::vector<float> z, m, w, y;  // [d], [d], [Q][d], [Q][d]
  };

  void GenerateKv(int layer, int g, Latents* lat, LayerData* out) const {
    const int d = d_, nq = static_cast<int>(plan_.questions.size());
    Rng dir(c_.seed(), Purpose::kDirections, layer, g);
    lat->z.resize(d);
    lat->m.resize(d);
    lat->w.resize(static_cast<size_t>(nq) * d);
    lat->y.resize(static_cast<size_t>(nq) * d);
    UnitVector(dir, d, lat->z.data());
    UnitVector(dir, d, lat->m.data());
    for (int i = 0; i < nq; ++i) {
      UnitVector(dir, d, lat->w.data() + static_cast<size_t>(i) * d);
      UnitVector(dir, d, lat->y.data() + static_cast<size_t>(i) * d);
    }
    std::vector<float> scenes(static_cast<size_t>(plan_.num_scenes) * d);
    Rng scene_rng(c_.seed(), Purpose::kSceneVectors, layer, g);
    for (int sc = 0; sc < plan_.num_scenes; ++sc)
      UnitVector(scene_rng, d, scenes.data() + static_cast<size_t>(sc) * d);

    // Own (context-free) video keys and values.
    std::vector<float> own_k(static_cast<size_t>(nv_) * d, 0.0f), own_v(own_k.size(), 0.0f);
    std::vector<float> content(d), drift(d);
    const double rho = s_.frame_correlation();
    const float fresh = static_cast<float>(std::sqrt(std::max(0.0, 1 - rho * rho)));
    Rng drift_rng(c_.seed(), Purpose::kFrameDrift, layer, g);
    Rng kn(c_.seed(), Purpose::kVideoKeyNoise, layer, g), vn(c_.seed(), Purpose::kVideoValueNoise, layer, g);
    const float a_scene = static_cast<float>(s_.scene_strength()),
                a_vid = static_cast<float>(s_.video_strength()),
                a_ev = static_cast<float>(s_.evidence_key_strength()),
                b_ev = static_cast<float>(s_.evidence_value_strength());
    for (int f = 0; f < plan_.frames; ++f) {
      const int sc = plan_.scene_of_frame[f];
      if (f == 0 || sc != plan_.scene_of_frame[f - 1]) {
        std::copy_n(scenes.data() + static_cast<size_t>(sc) * d, d, content.data());
      } else {
        UnitVector(drift_rng, d, drift.data());
        double norm = 0;
        for (int k = 0; k < d; ++k) {
          content[k] = static_cast<float>(rho) * content[k] + fresh * drift[k];
          norm += static_cast<double>(content[k]) * content[k];
        }
        const float inv = static_cast<float>(1 / std::sqrt(std::max(norm, 1e-30)));
        for (int k = 0; k < d; ++k) content[k] *= inv;
      }
      for (int p = 0; p < plan_.per_frame; ++p) {
        const int v = f * plan_.per_frame + p;
        float* k = own_k.data() + static_cast<size_t>(v) * d;
        float* x = own_v.data() + static_cast<size_t>(v) * d;
        Axpy(a_scene, content.data(), d, k);
        Axpy(a_vid, lat->m.data(), d, k);
        AddNoise(kn, d, static_cast<float>(s_.patch_noise()), k);
        AddNoise(vn, d, static_cast<float>(s_.value_noise()), x);
        for (int i : plan_.frame_questions[f])
          if (plan_.InEvidence(i, v)) {
            Axpy(a_ev, lat->w.data() + static_cast<size_t>(i) * d, d, k);
            Axpy(b_ev, lat->y.data() + static_cast<size_t>(i) * d, d, x);
          }
      }
    }

    // Continuous run: init, video with context, question and answer tokens.
    float* keys = out->keys.data() + static_cast<size_t>(g) * t_ * d;
    float* values = out->values.data() + static_cast<size_t>(g) * t_ * d;
    Rng in(c_.seed(), Purpose::kInitNoise, layer, g);
    for (int j = 0; j < plan_.init_len; ++j) {
      float* k = keys + static_cast<size_t>(j) * d;
      float* x = values + static_cast<size_t>(j) * d;
      if (j < s_.num_sinks()) {
        Axpy(static_cast<float>(s_.sink_key_strength()), lat->z.data(), d, k);
        AddNoise(in, d, 0.1f * static_cast<float>(s_.text_noise()), k);
        AddNoise(in, d, static_cast<float>(s_.sink_value_scale()), x);
      } else {
        AddNoise(in, d, static_cast<float>(s_.text_noise()), k);
        AddNoise(in, d, 1.0f, x);
      }
    }
    const int window = s_.context_window_tokens();
    const double mix = s_.context_mix();
    MixContext(own_k.data(), nv_, d, mix, window, 0, keys + static_cast<size_t>(plan_.video_begin) * d);
    MixContext(own_v.data(), nv_, d, mix, window, 0, values + static_cast<size_t>(plan_.video_begin) * d);
    Rng qa(c_.seed(), Purpose::kQaNoise, layer, g);
    for (int i = 0; i < static_cast<int>(plan_.questions.size()); ++i) {
      const QuestionPlan& q = plan_.questions[i];
      for (int k = 0; k < s_.question_tokens() + s_.answer_tokens(); ++k) {
        const int j = q.begin + k;
        const double a = k < s_.question_tokens() ? s_.question_key_strength() : s_.answer_key_strength();
        float* key = keys + static_cast<size_t>(j) * d;
        AddNoise(qa, d, static_cast<float>(s_.text_noise()), key);
        Axpy(static_cast<float>(a), lat->w.data() + static_cast<size_t>(i) * d, d, key);
        AddNoise(qa, d, 1.0f, values + static_cast<size_t>(j) * d);
      }
    }
    if (round_half_) {
      RoundToHalf(keys, static_cast<size_t>(t_) * d);
      RoundToHalf(values, static_cast<size_t>(t_) * d);
    }
    // Block encodings: context only from the block's own earlier tokens.
    for (size_t gi = 0; gi < plan_.granularities.size(); ++gi) {
      const int gr = plan_.granularities[gi];
      const int bg = nv_ / gr * gr;
      float* bk = out->blocks[gi].keys.data() + static_cast<size_t>(g) * bg * d;
      float* bv = out->blocks[gi].values.data() + static_cast<size_t>(g) * bg * d;
      MixContext(own_k.data(), bg, d, mix, window, gr, bk);
      MixContext(own_v.data(), bg, d, mix, window, gr, bv);
      if (round_half_) {
        RoundToHalf(bk, static_cast<size_t>(bg) * d);
        RoundToHalf(bv, static_cast<size_t>(bg) * d);
      }
    }
  }

  // Keys the first answer query of question i sees in full-history attention: init, the frames before the
  // question, its question tokens and itself.
  std::vector<int> VisibleKeys(int i) const {
    const QuestionPlan& q = plan_.questions[i];
    std::vector<int> keys;
    for (int j = 0; j < plan_.init_len + q.frames_before * plan_.per_frame; ++j) keys.push_back(j);
    for (int k = 0; k <= s_.question_tokens(); ++k) keys.push_back(q.begin + k);
    return keys;
  }

  std::pair<double, double> CalibrateQuestion(int g, int i, const Latents& lat, const float* keys) const {
    const std::vector<int> vis = VisibleKeys(i);
    const size_t n = vis.size();
    std::vector<double> a(n), b(n), cc(n);
    std::vector<char> in_e(n, 0), in_s(n, 0);
    const float* w = lat.w.data() + static_cast<size_t>(i) * d_;
    const QuestionPlan& q = plan_.questions[i];
    for (size_t x = 0; x < n; ++x) {
      const int j = vis[x];
      const float* k = keys + static_cast<size_t>(j) * d_;
      a[x] = scale_ * DotD(w, k, d_);
      b[x] = scale_ * s_.query_video_strength() * DotD(lat.m.data(), k, d_);
      cc[x] = scale_ * DotD(lat.z.data(), k, d_);
      in_s[x] = j < s_.num_sinks();
      if (j >= plan_.video_begin && j < plan_.video_end) {
        const int v = j - plan_.video_begin, f = v / plan_.per_frame;
        in_e[x] = std::binary_search(q.evidence.begin(), q.evidence.end(), f) && plan_.InEvidence(i, v);
      }
    }
    // Without sinks only the evidence share is calibrated (gamma stays 0).
    return Calibrate(a, b, cc, in_e, in_s, s_.evidence_attention_mass(), s_.sink_attention_mass(),
                     s_.num_sinks() > 0);
  }

  // Video/init query of token j (trace position) for query head h given its key in the run: key + a_vz z +
  // noise (init tokens: no key term).
  void VideoQuery(int layer, int h, int j, const float* key, const Latents& lat, float* q) const {
    std::fill(q, q + d_, 0.0f);
    if (key) std::copy_n(key, d_, q);
    Axpy(static_cast<float>(s_.video_query_sink()), lat.z.data(), d_, q);
    Rng rng(c_.seed(), Purpose::kVideoQueryNoise, layer, h, j);
    AddNoise(rng, d_, static_cast<float>(s_.video_query_noise()), q);
  }

  void GenerateQueries(int layer, int h, const Latents& lat, const std::pair<double, double>* coef,
                       const float* keys, float* queries) const {
    const size_t tq = meta_.query_positions.size();
    Rng head(c_.seed(), Purpose::kQueryHead, layer, h);
    const double ja = std::exp(s_.query_head_jitter() * head.Normal());
    const double jg = std::exp(s_.query_head_jitter() * head.Normal());
    Rng noise(c_.seed(), Purpose::kQaQueryNoise, layer, h);
    auto row = [&](int j) { return queries + (static_cast<size_t>(h) * tq + meta_.QueryIndex(j)) * d_; };
    for (int i = 0; i < static_cast<int>(plan_.questions.size()); ++i) {
      const QuestionPlan& q = plan_.questions[i];
      for (int k = 0; k < s_.question_tokens() + s_.answer_tokens(); ++k) {
        float* x = row(q.begin + k);
        Axpy(static_cast<float>(coef[i].first * ja), lat.w.data() + static_cast<size_t>(i) * d_, d_, x);
        Axpy(static_cast<float>(s_.query_video_strength()), lat.m.data(), d_, x);
        Axpy(static_cast<float>(coef[i].second * jg), lat.z.data(), d_, x);
        AddNoise(noise, d_, static_cast<float>(s_.query_noise()), x);
      }
    }
    if (s_.store_video_queries())
      for (int j = 0; j < plan_.video_end; ++j)
        VideoQuery(layer, h, j, j >= plan_.video_begin ? keys + static_cast<size_t>(j) * d_ : nullptr, lat,
                   row(j));
    if (round_half_) RoundToHalf(queries + static_cast<size_t>(h) * tq * d_, tq * d_);
  }

  // attention_received of one granularity at one layer: per query head and block, causal softmax of the
  // block's queries over [init keys, the block's keys up to the query], summed over queries, init dropped.
  void BlockAttention(int layer, const BlockEncodingInfo& info, const std::vector<Latents>& lat,
                      const std::vector<float>& keys, int threads, BlockLayerData* out) const {
    EnsureSingleThreadedBlas();
    const ModelInfo& m = meta_.model;
    const int gr = info.granularity, nb = info.num_blocks, init = plan_.init_len, width = init + gr;
    const size_t bg = static_cast<size_t>(nb) * gr;
    out->attention_received.assign(static_cast<size_t>(m.num_heads) * bg, 0.0f);
    const int chunk = std::max(1, 4096 / gr);  // blocks per work item
    const int chunks = (nb + chunk - 1) / chunk;
    ParallelFor(m.num_heads * chunks, threads, [&](int item) {
      const int h = item / chunks, g = h / m.GroupSize();
      const float* gkeys = keys.data() + static_cast<size_t>(g) * t_ * d_;
      const float* bkeys = out->keys.data() + static_cast<size_t>(g) * bg * d_;
      std::vector<float> kcat(static_cast<size_t>(width) * d_), q(static_cast<size_t>(gr) * d_),
          logits(static_cast<size_t>(gr) * width);
      std::copy_n(gkeys, static_cast<size_t>(init) * d_, kcat.data());
      const int b0 = (item % chunks) * chunk, b1 = std::min(nb, b0 + chunk);
      for (int b = b0; b < b1; ++b) {
        const float* bk = bkeys + static_cast<size_t>(b) * gr * d_;
        std::copy_n(bk, static_cast<size_t>(gr) * d_, kcat.data() + static_cast<size_t>(init) * d_);
        for (int r = 0; r < gr; ++r)
          VideoQuery(layer, h, info.token_positions[static_cast<size_t>(b) * gr + r],
                     bk + static_cast<size_t>(r) * d_, lat[g], q.data() + static_cast<size_t>(r) * d_);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, gr, width, d_, static_cast<float>(scale_),
                    q.data(), d_, kcat.data(), d_, 0.0f, logits.data(), width);
        float* acc =
            out->attention_received.data() + static_cast<size_t>(h) * bg + static_cast<size_t>(b) * gr;
        for (int r = 0; r < gr; ++r) {
          float* row = logits.data() + static_cast<size_t>(r) * width;
          SoftmaxInPlace(row, init + r + 1);
          for (int j = 0; j <= r; ++j) acc[j] += row[init + j];
        }
      }
    });
  }

  const SynthConfig& c_;
  const StreamingSynth& s_;
  const Plan& plan_;
  const TraceMeta& meta_;
  const int d_, t_, nv_;
  const double scale_;
  const bool round_half_;
};

}  // namespace

std::optional<StreamingConfigIssue> CheckStreamingConfig(const synth::SynthConfig& c) {
  const synth::ModelShape& m = c.model();
  if (m.num_layers() < 1) return Issue("model", "num_layers", "must be >= 1");
  if (m.num_heads() < 1) return Issue("model", "num_heads", "must be >= 1");
  if (m.num_kv_heads() < 1 || m.num_heads() % m.num_kv_heads() != 0)
    return Issue("model", "num_kv_heads",
                 "must be >= 1 and divide num_heads (" + std::to_string(m.num_heads()) + "), got " +
                     std::to_string(m.num_kv_heads()));
  if (m.head_dim() < 4 || m.head_dim() > 1024)
    return Issue("model", "head_dim", "must be in [4, 1024], got " + std::to_string(m.head_dim()));
  if (m.rope_theta() != 0)
    return Issue(
        "model", "rope_theta",
        "must be 0 for streaming traces: the streaming generator applies no RoPE (keys and queries carry "
        "no position rotation); got " +
            Num(m.rope_theta()));
  if (m.model_dtype() != "float16" && m.model_dtype() != "bfloat16" && m.model_dtype() != "float32")
    return Issue("model", "model_dtype",
                 "must be float16, bfloat16 or float32, got '" + m.model_dtype() + "'");
  if (m.sliding_window() != 0)
    return Issue("model", "sliding_window", "must be 0 for streaming traces (full causal attention)");
  if (m.logit_softcap() != 0)
    return Issue("model", "logit_softcap", "must be 0 for streaming traces (no soft-cap)");
  const synth::Storage& st = c.storage();
  if (st.dtype() != "float16" && st.dtype() != "float32")
    return Issue("storage", "dtype", "must be float16 or float32, got '" + st.dtype() + "'");
  if (st.compression_level() < 0 || st.compression_level() > 9)
    return Issue("storage", "compression_level", "must be in [0, 9] (0 = none, 1..9 = gzip)");

  const StreamingSynth& s = c.streaming();
  if (s.init_tokens() < 1 || s.init_tokens() > 100000)
    return StreamIssue("init_tokens", "must be in [1, 1e5]");
  if (s.num_sinks() < 0 || s.num_sinks() > s.init_tokens())
    return StreamIssue("num_sinks", "must be in [0, init_tokens = " + std::to_string(s.init_tokens()) + "]");
  if (s.num_frames() < 1 || s.num_frames() > 1000000) return StreamIssue("num_frames", "must be in [1, 1e6]");
  if (!(s.fps() > 0) || !std::isfinite(s.fps())) return StreamIssue("fps", "must be a finite number > 0");
  if (s.rows() < 1 || s.rows() > 4096) return StreamIssue("rows", "must be in [1, 4096]");
  if (s.cols() < 1 || s.cols() > 4096) return StreamIssue("cols", "must be in [1, 4096]");
  if (s.num_questions() < 1 || s.num_questions() > 100000)
    return StreamIssue("num_questions", "must be in [1, 1e5]");
  if (s.question_tokens() < 1 || s.question_tokens() > 100000)
    return StreamIssue("question_tokens", "must be in [1, 1e5]");
  if (s.answer_tokens() < 1 || s.answer_tokens() > 100000)
    return StreamIssue("answer_tokens", "must be in [1, 1e5]");
  const int64_t video = static_cast<int64_t>(s.num_frames()) * s.rows() * s.cols();
  const int64_t total = s.init_tokens() + video +
                        static_cast<int64_t>(s.num_questions()) * (s.question_tokens() + s.answer_tokens());
  if (total > (int64_t{1} << 30)) return StreamIssue("num_frames", "the trace would have too many tokens");
  if (s.evidence_frames_min() < 1) return StreamIssue("evidence_frames_min", "must be >= 1");
  if (s.evidence_frames_max() < s.evidence_frames_min())
    return StreamIssue("evidence_frames_max", "must be >= evidence_frames_min");
  if (s.min_evidence_age_frames() < 0) return StreamIssue("min_evidence_age_frames", "must be >= 0");
  if (!(s.scene_frames_mean() >= 1) || !std::isfinite(s.scene_frames_mean()))
    return StreamIssue("scene_frames_mean", "must be a finite number >= 1 (frames)");
  if (!(s.evidence_patch_fraction() > 0 && s.evidence_patch_fraction() <= 1))
    return StreamIssue("evidence_patch_fraction", "must be in (0, 1]");
  for (int i = 0; i < s.granularities_size(); ++i) {
    const int g = s.granularities(i);
    if (g < 1 || g > video || (i > 0 && g <= s.granularities(i - 1)))
      return StreamIssue(
          "granularities",
          "entries must be strictly ascending in [1, num_frames * rows * cols = " + std::to_string(video) +
              "], got " + std::to_string(g) + " at index " + std::to_string(i));
  }
  if (!(s.context_mix() >= 0 && s.context_mix() <= 10))
    return StreamIssue("context_mix", "must be in [0, 10]");
  if (s.context_window_tokens() < 1) return StreamIssue("context_window_tokens", "must be >= 1");
  if (!(s.frame_correlation() >= 0 && s.frame_correlation() <= 1))
    return StreamIssue("frame_correlation", "must be in [0, 1]");
  const std::pair<const char*, double> strengths[] = {
      {"scene_strength", s.scene_strength()},
      {"patch_noise", s.patch_noise()},
      {"video_strength", s.video_strength()},
      {"evidence_key_strength", s.evidence_key_strength()},
      {"value_noise", s.value_noise()},
      {"evidence_value_strength", s.evidence_value_strength()},
      {"sink_key_strength", s.sink_key_strength()},
      {"sink_value_scale", s.sink_value_scale()},
      {"text_noise", s.text_noise()},
      {"question_key_strength", s.question_key_strength()},
      {"answer_key_strength", s.answer_key_strength()},
      {"query_video_strength", s.query_video_strength()},
      {"query_head_jitter", s.query_head_jitter()},
      {"query_noise", s.query_noise()},
      {"video_query_sink", s.video_query_sink()},
      {"video_query_noise", s.video_query_noise()},
  };
  for (const auto& [name, v] : strengths)
    if (!(v >= 0 && v <= 1000)) return StreamIssue(name, "must be in [0, 1000], got " + Num(v));
  if (!(s.evidence_key_strength() > 0))
    return StreamIssue("evidence_key_strength", "must be > 0 (evidence must be findable)");
  if (s.num_sinks() > 0 && !(s.sink_key_strength() > 0))
    return StreamIssue("sink_key_strength", "must be > 0 when num_sinks > 0");
  if (!(s.evidence_attention_mass() > 0 && s.evidence_attention_mass() < 1))
    return StreamIssue("evidence_attention_mass", "must be in (0, 1)");
  if (!(s.sink_attention_mass() > 0 && s.sink_attention_mass() < 1))
    return StreamIssue("sink_attention_mass", "must be in (0, 1)");
  if (s.evidence_attention_mass() + (s.num_sinks() > 0 ? s.sink_attention_mass() : 0) >= 0.95)
    return StreamIssue("sink_attention_mass", "evidence_attention_mass + sink_attention_mass must be < 0.95");
  return std::nullopt;
}

namespace {
StatusOr<Plan> CheckedPlan(const synth::SynthConfig& config) {
  if (auto issue = CheckStreamingConfig(config)) {
    std::string path;
    for (size_t k = 0; k < issue->path.size(); ++k) path += (k ? "." : "") + issue->path[k].first;
    return Status::InvalidArgument("synth config: field '" + path + "': " + issue->message);
  }
  Plan plan = MakePlan(config);
  KVSIM_RETURN_IF_ERROR(
      plan.meta.Validate().WithContext("streaming synth config produced invalid trace metadata"));
  return plan;
}
}  // namespace

StatusOr<TraceMeta> BuildStreamingSynthMeta(const synth::SynthConfig& config) {
  KVSIM_ASSIGN_OR_RETURN(Plan plan, CheckedPlan(config));
  return std::move(plan.meta);
}

Status SynthesizeStreaming(const synth::SynthConfig& config, TraceSink* sink, int threads) {
  KVSIM_ASSIGN_OR_RETURN(const Plan plan, CheckedPlan(config));
  KVSIM_RETURN_IF_ERROR(CheckMemory(2 * LayerFloatBytes(plan.meta),
                                    "streaming synth config: one layer of float32 tensors (x2: generator and "
                                    "writer)"));
  KVSIM_RETURN_IF_ERROR(sink->Begin(plan.meta));
  StreamGenerator gen(config, plan);
  LayerData layer;
  for (int l = 0; l < plan.meta.model.num_layers; ++l) {
    gen.GenerateLayer(l, threads, &layer);
    KVSIM_RETURN_IF_ERROR(sink->WriteLayer(layer));
  }
  return sink->Finish();
}

}  // namespace kvsim
