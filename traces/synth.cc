#include "traces/synth.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/text_format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <numbers>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include "sim/attention.h"
#include "sim/parallel.h"
#include "sim/replay.h"
#include "sim/resources.h"
#include "sim/rope.h"
#include "sim/text_proto.h"
#include "sim/version.h"
#include "traces/half.h"
#include "traces/synth_rng.h"
#include "traces/synth_streaming.h"

namespace kvsim {
namespace {

using synth::AttentionProfile;
using synth::Segment;
using synth::Storage;
using synth::SynthConfig;

// ---------------------------------------------------------------------------------------------------------
// Config checks. A problem names the field path; ParseSynthConfig adds the line it was set on.

struct FieldPath {
  std::vector<std::pair<std::string, int>> parts;  // (field name, index into a repeated field or -1)
  std::string ToString() const {
    std::ostringstream s;
    for (size_t k = 0; k < parts.size(); ++k) {
      s << (k ? "." : "") << parts[k].first;
      if (parts[k].second >= 0) s << '[' << parts[k].second << ']';
    }
    return s.str();
  }
};

FieldPath Path(std::initializer_list<std::pair<std::string, int>> parts) { return FieldPath{parts}; }
FieldPath Path(const std::string& message, const std::string& field) {
  return Path({{message, -1}, {field, -1}});
}

struct ConfigIssue {
  FieldPath path;
  std::string message;
};

std::optional<ConfigIssue> Issue(FieldPath path, std::string message) {
  return ConfigIssue{std::move(path), std::move(message)};
}

std::string Num(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

int64_t PromptLength(const synth::Layout& layout) {
  int64_t n = 0;
  for (const Segment& s : layout.segments()) {
    const int64_t per = s.kind() == Segment::TEXT ? s.tokens() : static_cast<int64_t>(s.rows()) * s.cols();
    n += s.repeat() * per + static_cast<int64_t>(s.repeat() - 1) * s.text_between();
  }
  return n;
}

// Allowed range of one double field of AttentionProfile (open or closed ends).
struct Range {
  const char* field;
  double lo, hi;
  bool lo_open, hi_open;
};
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr Range kProfileRanges[] = {
    {"dense_inverse_temperature", 0, 100, true, false},
    {"deep_inverse_temperature", 0, 100, true, false},
    {"deep_ramp", 0, 2, false, true},
    {"last_layer_inverse_temperature", 0, 100, true, false},
    {"layer_jitter", 0, 1, false, false},
    {"dense_sink_mass", 0, 1, false, true},
    {"deep_sink_mass", 0, 1, false, true},
    {"last_layer_sink_mass", 0, 1, false, true},
    {"text_preference_min", 0, 1, false, false},
    {"text_preference_max", 0, 1, false, false},
    {"group_preference_jitter", 0, 1, false, false},
    {"group_focus_divergence", 0, 1, false, false},
    {"head_gain_jitter", 0, 1, false, false},
    {"text_salience_std", 0, 10, false, false},
    {"text_heavy_hitter_fraction", 0, 1, false, false},
    {"text_heavy_hitter_salience", -20, 20, false, false},
    {"visual_salience_std", 0, 10, false, false},
    {"visual_heavy_hitter_fraction", 0, 1, false, false},
    {"visual_heavy_hitter_salience", -20, 20, false, false},
    {"salience_layer_jitter", 0, 10, false, false},
    {"recency_logit", 0, 50, false, false},
    {"content_logit_std", 0, 10, false, false},
    {"query_focus", 0, 1, false, false},
    {"spatial_correlation_length", 0, kInf, true, true},
    {"frame_correlation", 0, 1, false, false},
    {"key_spatial_smoothness", 0, 1, false, false},
    {"value_spatial_smoothness", 0, 1, false, false},
    {"key_noise", 0, 100, false, false},
    {"sink_value_scale", 0, 100, false, false},
    {"value_shared_fraction", 0, 1, false, false},
};

std::optional<ConfigIssue> CheckConfig(const SynthConfig& c) {
  if (c.has_streaming()) {  // streaming traces: their own generator and checks (traces/synth_streaming.h)
    if (auto issue = CheckStreamingConfig(c)) return ConfigIssue{FieldPath{issue->path}, issue->message};
    return std::nullopt;
  }
  const synth::ModelShape& m = c.model();
  if (m.num_layers() < 1) return Issue(Path("model", "num_layers"), "must be >= 1");
  if (m.num_heads() < 1) return Issue(Path("model", "num_heads"), "must be >= 1");
  if (m.num_kv_heads() < 1 || m.num_heads() % m.num_kv_heads() != 0)
    return Issue(Path("model", "num_kv_heads"), "must be >= 1 and divide num_heads (" +
                                                    std::to_string(m.num_heads()) + "), got " +
                                                    std::to_string(m.num_kv_heads()));
  if (m.head_dim() < 16 || m.head_dim() > 1024 || m.head_dim() % 2 != 0)
    return Issue(Path("model", "head_dim"), "must be even and in [16, 1024] (RoPE pairs dimensions), got " +
                                                std::to_string(m.head_dim()));
  if (!(m.rope_theta() > 1) || !std::isfinite(m.rope_theta()))
    return Issue(Path("model", "rope_theta"), "must be a finite number > 1, got " + Num(m.rope_theta()));
  if (m.model_dtype() != "float16" && m.model_dtype() != "bfloat16" && m.model_dtype() != "float32")
    return Issue(Path("model", "model_dtype"),
                 "must be float16, bfloat16 or float32, got '" + m.model_dtype() + "'");
  if (m.sliding_window() < 0) return Issue(Path("model", "sliding_window"), "must be >= 0 (0 = none)");
  if (!(m.logit_softcap() >= 0) || !std::isfinite(m.logit_softcap()))
    return Issue(Path("model", "logit_softcap"), "must be >= 0 (0 = none)");

  const synth::Layout& layout = c.layout();
  if (layout.segments().empty())
    return Issue(Path({{"layout", -1}, {"segments", -1}}), "the prompt is empty; add at least one segment");
  for (int i = 0; i < layout.segments_size(); ++i) {
    const Segment& s = layout.segments(i);
    auto at = [&](const char* field) { return Path({{"layout", -1}, {"segments", i}, {field, -1}}); };
    if (s.repeat() < 1 || s.repeat() > 100000) return Issue(at("repeat"), "must be in [1, 100000]");
    if (s.text_between() < 0 || s.text_between() > 1000000)
      return Issue(at("text_between"), "must be in [0, 1e6]");
    if (s.kind() == Segment::TEXT) {
      if (s.tokens() < 1 || s.tokens() > 1000000)
        return Issue(at("tokens"),
                     "a TEXT segment needs tokens in [1, 1e6], got " + std::to_string(s.tokens()));
    } else {
      if (s.tokens() != 0)
        return Issue(at("tokens"),
                     "applies to TEXT segments only; an image/video segment has rows x cols patches");
      if (s.rows() < 1 || s.cols() < 1 || s.rows() > 4096 || s.cols() > 4096)
        return Issue(at(s.rows() < 1 || s.rows() > 4096 ? "rows" : "cols"),
                     "image/video segments need rows and cols in [1, 4096] (rows * cols patches), got " +
                         std::to_string(s.rows()) + " x " + std::to_string(s.cols()));
    }
  }
  if (layout.decode_steps() < 1 || layout.decode_steps() > 1000000)
    return Issue(Path("layout", "decode_steps"),
                 "must be in [1, 1e6]: statistics and replay are measured on decode steps");
  const int64_t n = PromptLength(layout);
  if (n < 1 || n + layout.decode_steps() > (int64_t{1} << 30))
    return Issue(Path({{"layout", -1}, {"segments", -1}}),
                 "prompt length " + std::to_string(n) + " is out of range");

  // The sink / modality / salience features live in the 3 lowest-frequency RoPE pairs and must stay nearly
  // aligned between any query and key: rotation at most pi/3 (cos >= 0.5) over the whole sequence.
  const double max_angle = RopeFrequency(m.head_dim() / 2 - 3, m.head_dim(), m.rope_theta()) *
                           static_cast<double>(n + layout.decode_steps() - 1);
  if (max_angle > std::numbers::pi / 3)
    return Issue(Path("model", "rope_theta"),
                 "too small for " + std::to_string(n + layout.decode_steps()) + " tokens at head_dim " +
                     std::to_string(m.head_dim()) +
                     ": the generator's lowest-frequency RoPE pairs would rotate by " + Num(max_angle) +
                     " rad (> pi/3); raise rope_theta or head_dim, or shorten the layout");

  const Storage& st = c.storage();
  if (st.dtype() != "float16" && st.dtype() != "float32")
    return Issue(Path("storage", "dtype"), "must be float16 or float32, got '" + st.dtype() + "'");
  if (st.query_storage() == Storage::WINDOW && (st.query_window() < 1 || st.query_window() > n))
    return Issue(Path("storage", "query_window"), "must be in [1, prompt length = " + std::to_string(n) +
                                                      "], got " + std::to_string(st.query_window()));
  if (st.compression_level() < 0 || st.compression_level() > 9)
    return Issue(Path("storage", "compression_level"), "must be in [0, 9] (0 = none, 1..9 = gzip)");

  const AttentionProfile& p = c.profile();
  if (p.num_sinks() < 0 || p.num_sinks() >= n)
    return Issue(Path("profile", "num_sinks"), "must be in [0, prompt length = " + std::to_string(n) +
                                                   "), got " + std::to_string(p.num_sinks()));
  if (p.dense_layers() < 0) return Issue(Path("profile", "dense_layers"), "must be >= 0");
  if (p.recency_window() < 1) return Issue(Path("profile", "recency_window"), "must be >= 1 (tokens)");
  const auto* desc = p.GetDescriptor();
  const auto* refl = p.GetReflection();
  for (const Range& r : kProfileRanges) {
    const double v = refl->GetDouble(p, desc->FindFieldByName(r.field));
    const bool ok = (r.lo_open ? v > r.lo : v >= r.lo) && (r.hi_open ? v < r.hi : v <= r.hi);
    if (!ok)
      return Issue(Path("profile", r.field), std::string("must be in ") + (r.lo_open ? "(" : "[") +
                                                 Num(r.lo) + ", " + Num(r.hi) + (r.hi_open ? ")" : "]") +
                                                 ", got " + Num(v));
  }
  if (p.text_preference_min() > p.text_preference_max())
    return Issue(Path("profile", "text_preference_max"), "must be >= text_preference_min");
  return std::nullopt;
}

// "line L, column C: " of the field a path names (or of its closest enclosing message), "" if not in the
// text.
std::string Locate(const std::string& text, const FieldPath& path) {
  SynthConfig scratch;
  google::protobuf::TextFormat::Parser parser;
  google::protobuf::TextFormat::ParseInfoTree tree;
  parser.WriteLocationsTo(&tree);
  if (!parser.ParseFromString(text, &scratch)) return "";
  const google::protobuf::Descriptor* desc = SynthConfig::descriptor();
  const google::protobuf::TextFormat::ParseInfoTree* node = &tree;
  std::optional<google::protobuf::TextFormat::ParseLocation> best;
  for (size_t k = 0; k < path.parts.size() && node && desc; ++k) {
    const auto* field = desc->FindFieldByName(path.parts[k].first);
    if (!field) break;
    const int index = field->is_repeated() ? path.parts[k].second : -1;
    if (field->is_repeated() && index < 0) break;
    const auto loc = node->GetLocation(field, index);
    if (loc.line < 0) break;
    best = loc;
    node = node->GetTreeForNested(field, index);
    desc = field->message_type();
  }
  if (!best) return "";
  return "line " + std::to_string(best->line + 1) + ", column " + std::to_string(best->column + 1) + ": ";
}

Status IssueStatus(const ConfigIssue& issue, const std::string& what, const std::string& location) {
  return Status::InvalidArgument(what + ": " + location + "field '" + issue.path.ToString() +
                                 "': " + issue.message);
}

// ---------------------------------------------------------------------------------------------------------
// Token layout: the token table and the visual spans (images / video frames).

struct VisualSpan {  // in token order; patches of consecutive spans are consecutive visual tokens
  int rows = 0, cols = 0;
  int clip = 0;  // an image, or one video segment entry (its frames share a slowly drifting field)
};

struct TokenLayout {
  TraceMeta meta;
  std::vector<VisualSpan> spans;
};

Role ToRole(Segment::Role r) {
  switch (r) {
    case Segment::SYSTEM:
      return Role::kSystem;
    case Segment::QUESTION:
      return Role::kQuestion;
    case Segment::CONTEXT:
      break;
  }
  return Role::kContext;
}

TokenLayout BuildLayout(const SynthConfig& c) {
  TokenLayout out;
  TraceMeta& meta = out.meta;
  const synth::ModelShape& m = c.model();
  meta.model.name = m.name();
  meta.model.family = m.family();
  meta.model.num_layers = m.num_layers();
  meta.model.num_heads = m.num_heads();
  meta.model.num_kv_heads = m.num_kv_heads();
  meta.model.head_dim = m.head_dim();
  meta.model.softmax_scale = 1.0 / std::sqrt(static_cast<double>(m.head_dim()));
  meta.model.causal = true;
  meta.model.sliding_window = m.sliding_window();
  meta.model.logit_softcap = m.logit_softcap();
  meta.model.rope_theta = m.rope_theta();
  meta.model.model_dtype = m.model_dtype();

  const int n = static_cast<int>(PromptLength(c.layout()));
  const int steps = c.layout().decode_steps();
  meta.prefill_length = n;
  meta.num_decode_steps = steps;
  meta.source = "synthetic";
  meta.generator = "kvsim synth";
  meta.generator_version = kVersion;
  meta.seed = c.seed();
  meta.storage_dtype = c.storage().dtype() == "float32" ? StorageDtype::kFloat32 : StorageDtype::kFloat16;
  meta.has_prefill_column_sums = c.storage().record_prefill_column_sums();
  google::protobuf::TextFormat::PrintToString(c, &meta.config_text);

  TokenTable& tk = meta.tokens;
  tk.Resize(n + steps);
  int pos = 0;
  int segment_id = 0;
  int next_clip = 0;
  auto emit_text = [&](int count, Role role, Phase phase) {
    for (int i = 0; i < count; ++i, ++pos) {
      tk.modality[pos] = Modality::kText;
      tk.segment_id[pos] = segment_id;
      tk.role[pos] = role;
      tk.phase[pos] = phase;
    }
    ++segment_id;
  };
  for (const Segment& s : c.layout().segments()) {
    const Role role = ToRole(s.role());
    const int video_clip = next_clip;
    for (int r = 0; r < s.repeat(); ++r) {
      if (r > 0 && s.text_between() > 0) emit_text(s.text_between(), role, Phase::kPrefill);
      if (s.kind() == Segment::TEXT) {
        emit_text(s.tokens(), role, Phase::kPrefill);
        continue;
      }
      const bool video = s.kind() == Segment::VIDEO;
      out.spans.push_back({s.rows(), s.cols(), video ? video_clip : next_clip++});
      for (int k = 0; k < s.rows() * s.cols(); ++k, ++pos) {
        tk.modality[pos] = video ? Modality::kVideo : Modality::kImage;
        tk.segment_id[pos] = segment_id;
        tk.patch_row[pos] = k / s.cols();
        tk.patch_col[pos] = k % s.cols();
        tk.role[pos] = role;
      }
      ++segment_id;
    }
    if (s.kind() == Segment::VIDEO) ++next_clip;
  }
  emit_text(steps, Role::kGenerated, Phase::kDecode);
  for (int i = 0; i < n + steps; ++i) tk.position_id[i] = i;

  const int first_query = c.storage().query_storage() == Storage::WINDOW ? n - c.storage().query_window() : 0;
  for (int i = first_query; i < n + steps; ++i) meta.query_positions.push_back(i);
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// Random numbers: independent counter-based streams keyed by (seed, purpose, a, b, c), so every value depends
// only on the seed and on what it is for, never on thread count or generation order.

enum class Purpose : uint64_t {
  kTokenSalience = 1,
  kSalienceField,
  kLayer,
  kKvHead,
  kKeyNoise,
  kKeyField,
  kValueNoise,
  kValueField,
  kQueryHead,
  kQueryNoise,
  kValueShared,  // appended: the other streams keep their numbers
};

using synth_rng::Rng;

// Smooth Gaussian random fields on the patch grids of every visual span, `dims` channels each, unit variance,
// with correlation exp(-|dx|^2 / (2 length^2)) between patches: random Fourier features,
//   f(r, c) = sqrt(2/F) sum_f cos(w_f . (r, c) + b_f) a_f,  w_f ~ N(0, I / length^2), b_f ~ U[0, 2 pi),
// a_f ~ N(0, I_dims). Frames of one video clip share w_f, b_f and evolve a_f as an AR(1) process with
// correlation `frame_corr` per frame. Output: [visual token][dims] in token order.
constexpr int kFourierFeatures = 32;

void SmoothFields(const std::vector<VisualSpan>& spans, int dims, double length, double frame_corr,
                  uint64_t seed, Purpose purpose, uint64_t a, uint64_t b, std::vector<float>* out) {
  size_t total = 0;
  for (const VisualSpan& s : spans) total += static_cast<size_t>(s.rows) * s.cols;
  out->assign(total * dims, 0.0f);
  std::vector<float> wr(kFourierFeatures), wc(kFourierFeatures), phase(kFourierFeatures);
  std::vector<float> amp(static_cast<size_t>(kFourierFeatures) * dims), basis(kFourierFeatures);
  std::vector<float> row_cos, row_sin, col_cos, col_sin;
  const float inv_len = static_cast<float>(1.0 / length);
  const float norm = std::sqrt(2.0f / kFourierFeatures);
  const float keep = static_cast<float>(frame_corr),
              fresh = static_cast<float>(std::sqrt(1 - frame_corr * frame_corr));
  size_t row = 0;
  int current_clip = -1;
  std::optional<Rng> rng;
  for (const VisualSpan& s : spans) {
    if (s.clip != current_clip) {
      current_clip = s.clip;
      rng.emplace(seed, purpose, a, b, static_cast<uint64_t>(s.clip));
      for (int f = 0; f < kFourierFeatures; ++f) {
        wr[f] = rng->Normal() * inv_len;
        wc[f] = rng->Normal() * inv_len;
        phase[f] = static_cast<float>(2 * std::numbers::pi * rng->Uniform());
      }
      for (float& x : amp) x = rng->Normal();
    } else {
      for (float& x : amp) x = keep * x + fresh * rng->Normal();
    }
    // cos(wr r + b + wc c) = cos(wr r + b) cos(wc c) - sin(wr r + b) sin(wc c), tabulated per row and column.
    row_cos.resize(static_cast<size_t>(s.rows) * kFourierFeatures);
    row_sin.resize(row_cos.size());
    col_cos.resize(static_cast<size_t>(s.cols) * kFourierFeatures);
    col_sin.resize(col_cos.size());
    for (int r = 0; r < s.rows; ++r)
      for (int f = 0; f < kFourierFeatures; ++f) {
        row_cos[r * kFourierFeatures + f] = norm * std::cos(wr[f] * r + phase[f]);
        row_sin[r * kFourierFeatures + f] = norm * std::sin(wr[f] * r + phase[f]);
      }
    for (int c = 0; c < s.cols; ++c)
      for (int f = 0; f < kFourierFeatures; ++f) {
        col_cos[c * kFourierFeatures + f] = std::cos(wc[f] * c);
        col_sin[c * kFourierFeatures + f] = std::sin(wc[f] * c);
      }
    for (int r = 0; r < s.rows; ++r)
      for (int c = 0; c < s.cols; ++c, ++row) {
        for (int f = 0; f < kFourierFeatures; ++f)
          basis[f] = row_cos[r * kFourierFeatures + f] * col_cos[c * kFourierFeatures + f] -
                     row_sin[r * kFourierFeatures + f] * col_sin[c * kFourierFeatures + f];
        float* dst = out->data() + row * dims;
        for (int f = 0; f < kFourierFeatures; ++f) {
          const float w = basis[f];
          const float* af = amp.data() + static_cast<size_t>(f) * dims;
          for (int k = 0; k < dims; ++k) dst[k] += w * af[k];
        }
      }
  }
}

void RoundToHalf(float* x, size_t n) {
  uint16_t buf[256];
  for (size_t i = 0; i < n; i += 256) {
    const size_t m = std::min<size_t>(256, n - i);
    FloatToHalf(x + i, buf, m);
    HalfToFloat(buf, x + i, m);
  }
}

double Logit(double p) { return std::log(p / (1 - p)); }

// Logits base_i + x * coef_i of a group of keys, as a function of an offset x.
struct OffsetProblem {
  std::vector<double> base, coef;
  void Add(double b, double c) {
    base.push_back(b);
    coef.push_back(c);
  }
  // Log-sum-exp at x, and the softmax-weighted mean of coef (the derivative).
  std::pair<double, double> Eval(double x) const {
    double mx = -kInf;
    for (size_t i = 0; i < base.size(); ++i) mx = std::max(mx, base[i] + x * coef[i]);
    double s = 0, sc = 0;
    for (size_t i = 0; i < base.size(); ++i) {
      const double e = std::exp(base[i] + x * coef[i] - mx);
      s += e;
      sc += e * coef[i];
    }
    return {mx + std::log(s), sc / s};
  }
};

// Solves LSE(up.base + x up.coef) - LSE(down.base - x down.coef) = target for x by Newton's method (the
// left side is increasing in x when the coefficients are positive, nearly linear when they are similar).
double SolveOffset(const OffsetProblem& up, const OffsetProblem& down, double target) {
  double x = 0;
  for (int iter = 0; iter < 50; ++iter) {
    const auto [lse_up, slope_up] = up.Eval(x);
    const auto [lse_down, slope_down] = down.Eval(-x);
    const double f = lse_up - lse_down - target;
    const double slope = slope_up + slope_down;
    if (std::abs(f) < 1e-9 || !(slope > 1e-6)) break;
    x -= f / slope;
  }
  return x;
}

// ---------------------------------------------------------------------------------------------------------
// The generative model (docs/synth.md). Pre-RoPE vectors live in three groups of RoPE pairs (pair i =
// dimensions i and i + d/2): the 3 lowest-frequency pairs hold one semantic feature each (sink, modality,
// salience), the highest-frequency pairs (frequency >= 1/recency_window) hold the recency component, and
// the pairs in between hold content.

enum Feature { kSink = 0, kModality = 1, kSalience = 2, kNumFeatures = 3 };
constexpr float kFeatureKeyNorm[kNumFeatures] = {8.0f, 2.0f, 1.0f};

enum class LayerGroup { kDense, kDeep, kLast };

// Per (layer, KV head) latents shared by the KV head's keys and its query heads.
struct KvHeadLatents {
  int pair[kNumFeatures];                          // RoPE pair of each feature
  float dir_a[kNumFeatures], dir_b[kNumFeatures];  // in-plane unit direction (dims pair, pair + d/2)
  std::vector<float> recency;                      // [d] pre-RoPE recency vector, shared by q and k
  std::vector<float> focus;                        // [d] group focus direction (content dims), N(0, 1)
  std::vector<float> salience;                     // [T] salience eta_j of this layer and KV head
  double preference = 0.5;                         // target text share of the non-sink attention
};

class Generator {
 public:
  Generator(const SynthConfig& config, TokenLayout layout)
      : config_(config),
        p_(config.profile()),
        layout_(std::move(layout)),
        meta_(layout_.meta),
        n_(meta_.prefill_length),
        t_(meta_.total_tokens()),
        d_(meta_.model.head_dim),
        half_(d_ / 2),
        scale_(meta_.model.softmax_scale),
        round_half_(meta_.storage_dtype == StorageDtype::kFloat16),
        rope_(d_, meta_.model.rope_theta, meta_.tokens.position_id) {
    // Recency pairs [0, recency_pairs_): frequency >= 1 / recency_window; content pairs up to half_ - 3.
    const double w = std::log(static_cast<double>(p_.recency_window())) / std::log(meta_.model.rope_theta);
    recency_pairs_ = std::clamp(static_cast<int>(std::floor(half_ * w)) + 1, 1, half_ - kNumFeatures - 2);
    content_pairs_ = half_ - kNumFeatures - recency_pairs_;
    for (int i = 0; i < half_; ++i) frequency_.push_back(RopeFrequency(i, d_, meta_.model.rope_theta));
    visual_row_.assign(t_, -1);
    int rows = 0;
    for (int j = 0; j < t_; ++j)
      if (IsVisual(j)) visual_row_[j] = rows++;
    num_sinks_ = p_.num_sinks();
    // Recency logit of each prompt key for the first decode query (calibration; see GenerateQueries).
    recency_kernel_.resize(n_);
    for (int j = 0; j < n_; ++j) {
      const double delta = static_cast<double>(meta_.tokens.position_id[n_] - meta_.tokens.position_id[j]);
      double k = 0;
      for (int i = 0; i < recency_pairs_; ++i) k += std::cos(frequency_[i] * delta);
      recency_kernel_[j] = p_.recency_logit() * k / recency_pairs_;
    }
    DrawTokenSalience();
  }

  void GenerateLayer(int layer, int threads, LayerData* out) {
    const ModelInfo& m = meta_.model;
    const int heads = m.num_heads, kv_heads = m.num_kv_heads, group = m.GroupSize();
    const size_t tq = meta_.query_positions.size();
    out->layer = layer;
    out->keys.assign(static_cast<size_t>(kv_heads) * t_ * d_, 0.0f);
    out->values.assign(out->keys.size(), 0.0f);
    out->queries.assign(static_cast<size_t>(heads) * tq * d_, 0.0f);
    out->prefill_column_sums.assign(meta_.has_prefill_column_sums ? static_cast<size_t>(heads) * n_ : 0,
                                    0.0f);
    const std::vector<int32_t>& regions = meta_.prompt_entropy_regions;
    out->prompt_entropies.assign(regions.size() * kNumPromptEntropyKinds * heads, 0.0);

    const LayerGroup lg = GroupOf(layer);
    Rng layer_rng(config_.seed(), Purpose::kLayer, layer);
    double tau = lg == LayerGroup::kDense  ? p_.dense_inverse_temperature()
                 : lg == LayerGroup::kLast ? p_.last_layer_inverse_temperature()
                                           : DeepInverseTemperature(layer);
    tau *= std::exp(p_.layer_jitter() * layer_rng.Normal());
    const double sink_mass = lg == LayerGroup::kDense  ? p_.dense_sink_mass()
                             : lg == LayerGroup::kLast ? p_.last_layer_sink_mass()
                                                       : p_.deep_sink_mass();
    // Stratified text preferences: KV head g gets stratum order[g] of [min, max].
    std::vector<int> order(kv_heads);
    for (int g = 0; g < kv_heads; ++g) order[g] = g;
    for (int g = kv_heads - 1; g > 0; --g) std::swap(order[g], order[layer_rng.Next() % (g + 1)]);
    std::vector<double> preference(kv_heads);
    for (int g = 0; g < kv_heads; ++g)
      preference[g] = p_.text_preference_min() + (p_.text_preference_max() - p_.text_preference_min()) *
                                                     (order[g] + layer_rng.Uniform()) / kv_heads;

    std::vector<KvHeadLatents> latents(kv_heads);
    ParallelFor(kv_heads, threads, [&](int g) {
      latents[g] = DrawKvHeadLatents(layer, g);
      latents[g].preference = preference[g];
      GenerateKeys(layer, g, latents[g], out->keys.data() + static_cast<size_t>(g) * t_ * d_);
      GenerateValues(layer, g, out->values.data() + static_cast<size_t>(g) * t_ * d_);
    });
    ParallelFor(heads, threads, [&](int h) {
      const int g = h / group;
      std::vector<float> q(static_cast<size_t>(t_) * d_);
      GenerateQueries(layer, h, lg, tau, sink_mass, latents[g], q.data());
      for (size_t i = 0; i < tq; ++i)
        std::copy_n(q.data() + static_cast<size_t>(meta_.query_positions[i]) * d_, d_,
                    out->queries.data() + (static_cast<size_t>(h) * tq + i) * d_);
      if (meta_.has_prefill_column_sums) {
        std::vector<int32_t> pos(n_);
        for (int i = 0; i < n_; ++i) pos[i] = i;
        AccumulateColumnSums(m, q.data(), pos.data(), n_, out->keys.data() + static_cast<size_t>(g) * t_ * d_,
                             n_, out->prefill_column_sums.data() + static_cast<size_t>(h) * n_);
      }
      // The entropies MEDA would compute from the stored (already rounded) queries and keys: same function.
      for (size_t r = 0; r < regions.size(); ++r) {
        double e[kNumPromptEntropyKinds];
        HeadPromptEntropies(m, std::span(meta_.tokens.modality).first(regions[r]), q.data(),
                            out->keys.data() + static_cast<size_t>(g) * t_ * d_, regions[r], true, true, e);
        for (int k = 0; k < kNumPromptEntropyKinds; ++k)
          out->prompt_entropies[(r * kNumPromptEntropyKinds + k) * heads + h] = e[k];
      }
    });
  }

 private:
  bool IsVisual(int j) const {
    const Modality mod = meta_.tokens.modality[j];
    return mod == Modality::kImage || mod == Modality::kVideo;
  }
  bool IsSink(int j) const { return j < num_sinks_; }
  int SemanticPair(int k) const { return half_ - 1 - k; }  // k = 0 is the lowest frequency
  int ContentBegin() const { return recency_pairs_; }

  LayerGroup GroupOf(int layer) const {
    if (layer < p_.dense_layers()) return LayerGroup::kDense;
    if (layer == meta_.model.num_layers - 1) return LayerGroup::kLast;
    return LayerGroup::kDeep;
  }
  double DeepInverseTemperature(int layer) const {
    const int first = p_.dense_layers(), last = meta_.model.num_layers - 2;
    const double frac = last > first ? static_cast<double>(layer - first) / (last - first) : 0.5;
    return p_.deep_inverse_temperature() * (1 + p_.deep_ramp() * (frac - 0.5));
  }

  // z_j: text ~ text_salience_std N(0,1), heavy hitters text_heavy_hitter_salience + a quarter of that
  // spread; visual ~ visual_salience_std (smooth field) + heavy hitters; sinks 0. Drawn once per trace.
  void DrawTokenSalience() {
    std::vector<float> field;
    SmoothFields(layout_.spans, 1, p_.spatial_correlation_length(), p_.frame_correlation(), config_.seed(),
                 Purpose::kSalienceField, 0, 0, &field);
    const float smooth = static_cast<float>(std::sqrt(p_.key_spatial_smoothness()));
    const float rough = static_cast<float>(std::sqrt(1 - p_.key_spatial_smoothness()));
    Rng rng(config_.seed(), Purpose::kTokenSalience);
    salience_.resize(t_);
    for (int j = 0; j < t_; ++j) {
      const float noise = rng.Normal();
      const double u = rng.Uniform();
      double z;
      if (IsVisual(j)) {
        z = p_.visual_salience_std() * (smooth * field[visual_row_[j]] + rough * noise) +
            (u < p_.visual_heavy_hitter_fraction() ? p_.visual_heavy_hitter_salience() : 0.0);
      } else {
        // Heavy hitters sit at text_heavy_hitter_salience with a quarter of the spread of ordinary tokens.
        z = u < p_.text_heavy_hitter_fraction()
                ? p_.text_heavy_hitter_salience() + 0.25 * p_.text_salience_std() * noise
                : p_.text_salience_std() * noise;
      }
      salience_[j] = IsSink(j) ? 0.0f : static_cast<float>(z);
    }
  }

  KvHeadLatents DrawKvHeadLatents(int layer, int g) const {
    KvHeadLatents lat;
    Rng rng(config_.seed(), Purpose::kKvHead, layer, g);
    int pairs[kNumFeatures] = {SemanticPair(0), SemanticPair(1), SemanticPair(2)};
    for (int k = kNumFeatures - 1; k > 0; --k) std::swap(pairs[k], pairs[rng.Next() % (k + 1)]);
    for (int f = 0; f < kNumFeatures; ++f) {
      const double phi = 2 * std::numbers::pi * rng.Uniform();
      lat.pair[f] = pairs[f];
      lat.dir_a[f] = static_cast<float>(std::cos(phi));
      lat.dir_b[f] = static_cast<float>(std::sin(phi));
    }
    // Recency: |r_i|^2 = w per pair with scale * w * recency_pairs = recency_logit.
    lat.recency.assign(d_, 0.0f);
    const double norm = std::sqrt(p_.recency_logit() / (scale_ * recency_pairs_));
    for (int i = 0; i < recency_pairs_; ++i) {
      const double phi = 2 * std::numbers::pi * rng.Uniform();
      lat.recency[i] = static_cast<float>(norm * std::cos(phi));
      lat.recency[i + half_] = static_cast<float>(norm * std::sin(phi));
    }
    lat.focus.assign(d_, 0.0f);
    for (int i = ContentBegin(); i < ContentBegin() + content_pairs_; ++i) {
      lat.focus[i] = rng.Normal();
      lat.focus[i + half_] = rng.Normal();
    }
    lat.salience.resize(t_);
    const float jitter = static_cast<float>(p_.salience_layer_jitter());
    for (int j = 0; j < t_; ++j) lat.salience[j] = salience_[j] + jitter * rng.Normal();
    return lat;
  }

  // Keys of one (layer, KV head), [T][d], post-RoPE.
  void GenerateKeys(int layer, int g, const KvHeadLatents& lat, float* keys) const {
    std::vector<float> field;
    const int content_dims = 2 * content_pairs_;
    SmoothFields(layout_.spans, content_dims, p_.spatial_correlation_length(), p_.frame_correlation(),
                 config_.seed(), Purpose::kKeyField, layer, g, &field);
    const float smooth = static_cast<float>(std::sqrt(p_.key_spatial_smoothness()));
    const float rough = static_cast<float>(std::sqrt(1 - p_.key_spatial_smoothness()));
    const float noise = static_cast<float>(p_.key_noise());
    Rng rng(config_.seed(), Purpose::kKeyNoise, layer, g);
    const int c0 = ContentBegin(), c1 = ContentBegin() + content_pairs_;
    for (int j = 0; j < t_; ++j) {
      float* x = keys + static_cast<size_t>(j) * d_;
      const float feature[kNumFeatures] = {IsSink(j) ? 1.0f : 0.0f, IsVisual(j) ? -1.0f : 1.0f,
                                           lat.salience[j]};
      for (int f = 0; f < kNumFeatures; ++f) {
        const float v = kFeatureKeyNorm[f] * feature[f];
        x[lat.pair[f]] = v * lat.dir_a[f];
        x[lat.pair[f] + half_] = v * lat.dir_b[f];
      }
      for (int i = 0; i < c0; ++i) {
        x[i] = lat.recency[i];
        x[i + half_] = lat.recency[i + half_];
      }
      for (int i = 0; i < half_; ++i) {
        if (i >= c0 && i < c1) continue;  // content pairs are drawn below
        x[i] += noise * rng.Normal();
        x[i + half_] += noise * rng.Normal();
      }
      const float* fj =
          IsVisual(j) ? field.data() + static_cast<size_t>(visual_row_[j]) * content_dims : nullptr;
      for (int i = c0, k = 0; i < c1; ++i, k += 2) {
        const float na = rng.Normal(), nb = rng.Normal();
        x[i] = fj ? smooth * fj[k] + rough * na : na;
        x[i + half_] = fj ? smooth * fj[k + 1] + rough * nb : nb;
      }
      rope_.Apply(j, x);
    }
    if (round_half_) RoundToHalf(keys, static_cast<size_t>(t_) * d_);
  }

  // Values of one (layer, KV head), [T][d]: a shared direction + (visual = smooth field + noise, text =
  // noise), sinks scaled down.
  void GenerateValues(int layer, int g, float* values) const {
    std::vector<float> field;
    SmoothFields(layout_.spans, d_, p_.spatial_correlation_length(), p_.frame_correlation(), config_.seed(),
                 Purpose::kValueField, layer, g, &field);
    const float smooth = static_cast<float>(std::sqrt(p_.value_spatial_smoothness()));
    const float rough = static_cast<float>(std::sqrt(1 - p_.value_spatial_smoothness()));
    const float sink_scale = static_cast<float>(p_.sink_value_scale());
    const float shared = static_cast<float>(std::sqrt(p_.value_shared_fraction()));
    const float own = static_cast<float>(std::sqrt(1 - p_.value_shared_fraction()));
    std::vector<float> mu(d_);
    Rng shared_rng(config_.seed(), Purpose::kValueShared, layer, g);
    for (float& m : mu) m = static_cast<float>(shared_rng.Normal());
    Rng rng(config_.seed(), Purpose::kValueNoise, layer, g);
    for (int j = 0; j < t_; ++j) {
      float* x = values + static_cast<size_t>(j) * d_;
      const float* fj = IsVisual(j) ? field.data() + static_cast<size_t>(visual_row_[j]) * d_ : nullptr;
      const float s = IsSink(j) ? sink_scale : 1.0f;
      for (int k = 0; k < d_; ++k) {
        const float z = rng.Normal();
        x[k] = s * (shared * mu[k] + own * (fj ? smooth * fj[k] + rough * z : z));
      }
    }
    if (round_half_) RoundToHalf(values, static_cast<size_t>(t_) * d_);
  }

  // Queries of every token of one (layer, query head), [T][d], post-RoPE. The sink and modality
  // coefficients are calibrated so that the first decode query puts `sink_mass` of its attention on the
  // sinks and, of the rest, a share `preference` on text (content noise ignored).
  void GenerateQueries(int layer, int h, LayerGroup lg, double tau, double sink_mass,
                       const KvHeadLatents& lat, float* q) const {
    Rng rng(config_.seed(), Purpose::kQueryHead, layer, h);
    const double pref =
        std::clamp(lat.preference + p_.group_preference_jitter() * rng.Normal(), 0.005, 0.995);
    const double gain = std::exp(p_.head_gain_jitter() * rng.Normal());
    const double recency_gain = std::exp(p_.head_gain_jitter() * rng.Normal());

    // Calibration on the prompt keys as seen by the first decode query at position p. Feature f of key j
    // enters the logit as coefficient * feature * cos(theta_f (p - p_j)) (the semantic pairs barely rotate).
    // Base logits: B_j = tau (gain eta_j cos_salience(j) + recency_gain K_j), K_j the recency logit of key j.
    // The half modality offset x solves LSE_text(B + x cos_m) - LSE_visual(B - x cos_m) = logit(preference)
    // over non-sink keys; the sink offset S solves LSE_sinks(B' + S cos_s) - LSE_rest(B') = logit(sink_mass)
    // with B'_j = B_j + x m_j cos_m(j), m_j = +1 text / -1 visual.
    const int64_t p_ref = meta_.tokens.position_id[n_];
    auto rot = [&](int f, int j) {
      return std::cos(frequency_[lat.pair[f]] * static_cast<double>(p_ref - meta_.tokens.position_id[j]));
    };
    std::vector<double> base(n_);
    for (int j = 0; j < n_; ++j)
      base[j] = tau * (gain * lat.salience[j] * rot(kSalience, j) + recency_gain * recency_kernel_[j]);
    OffsetProblem text, visual;
    for (int j = num_sinks_; j < n_; ++j) (IsVisual(j) ? visual : text).Add(base[j], rot(kModality, j));
    double half_modality = 0;
    if (lg != LayerGroup::kDense && !text.base.empty() && !visual.base.empty())
      half_modality = SolveOffset(text, visual, Logit(pref));
    double sink = 0;
    if (sink_mass > 0 && num_sinks_ > 0) {
      OffsetProblem sinks, rest;
      for (int j = 0; j < n_; ++j) {
        const double b = base[j] + half_modality * (IsVisual(j) ? -1 : 1) * rot(kModality, j);
        if (IsSink(j))
          sinks.Add(b, rot(kSink, j));
        else
          rest.Add(b, 0.0);
      }
      sink = SolveOffset(sinks, rest, Logit(sink_mass));
    }

    // Query template: semantic coefficients, recency, content (focus share + per-query noise).
    std::vector<float> templ(d_, 0.0f);
    const double coef[kNumFeatures] = {sink, half_modality, tau * gain};
    for (int f = 0; f < kNumFeatures; ++f) {
      const double c = coef[f] / (scale_ * kFeatureKeyNorm[f]);
      templ[lat.pair[f]] = static_cast<float>(c * lat.dir_a[f]);
      templ[lat.pair[f] + half_] = static_cast<float>(c * lat.dir_b[f]);
    }
    for (int i = 0; i < recency_pairs_; ++i) {
      templ[i] = static_cast<float>(tau * recency_gain * lat.recency[i]);
      templ[i + half_] = static_cast<float>(tau * recency_gain * lat.recency[i + half_]);
    }
    const int c0 = ContentBegin(), c1 = ContentBegin() + content_pairs_;
    const double sigma = tau * p_.content_logit_std() / (scale_ * std::sqrt(2.0 * content_pairs_));
    const float focus_w = static_cast<float>(sigma * std::sqrt(p_.query_focus()));
    const float noise_w = static_cast<float>(sigma * std::sqrt(1 - p_.query_focus()));
    const float own = static_cast<float>(std::sqrt(p_.group_focus_divergence()));
    const float shared = static_cast<float>(std::sqrt(1 - p_.group_focus_divergence()));
    for (int i = c0; i < c1; ++i)
      for (int k : {i, i + half_}) templ[k] = focus_w * (shared * lat.focus[k] + own * rng.Normal());

    Rng noise(config_.seed(), Purpose::kQueryNoise, layer, h);
    for (int j = 0; j < t_; ++j) {
      float* x = q + static_cast<size_t>(j) * d_;
      std::copy(templ.begin(), templ.end(), x);
      for (int i = c0; i < c1; ++i) {
        x[i] += noise_w * noise.Normal();
        x[i + half_] += noise_w * noise.Normal();
      }
      rope_.Apply(j, x);
    }
    if (round_half_) RoundToHalf(q, static_cast<size_t>(t_) * d_);
  }

  const SynthConfig& config_;
  const AttentionProfile& p_;
  TokenLayout layout_;
  const TraceMeta& meta_;
  const int n_, t_, d_, half_;
  const double scale_;
  const bool round_half_;
  const RopeTable rope_;
  int recency_pairs_ = 0, content_pairs_ = 0, num_sinks_ = 0;
  std::vector<double> frequency_;       // RoPE frequency of each pair
  std::vector<int> visual_row_;         // row of token j among visual tokens, -1 for text
  std::vector<float> salience_;         // z_j
  std::vector<double> recency_kernel_;  // [n] recency logit of prompt key j for the first decode query
};

}  // namespace

StatusOr<synth::SynthConfig> ParseSynthConfig(const std::string& text, const std::string& what) {
  SynthConfig config;
  KVSIM_RETURN_IF_ERROR(ParseTextProto(text, what, &config));
  if (auto issue = CheckConfig(config)) return IssueStatus(*issue, what, Locate(text, issue->path));
  return config;
}

StatusOr<synth::SynthConfig> LoadSynthConfig(const std::string& path) {
  KVSIM_ASSIGN_OR_RETURN(std::string text, ReadTextProtoFile(path));
  return ParseSynthConfig(text, path);
}

StatusOr<TraceMeta> BuildSynthMeta(const synth::SynthConfig& config) {
  if (auto issue = CheckConfig(config)) return IssueStatus(*issue, "synth config", "");
  if (config.has_streaming()) return BuildStreamingSynthMeta(config);
  TraceMeta meta = BuildLayout(config).meta;
  KVSIM_RETURN_IF_ERROR(meta.Validate().WithContext("synth config produced invalid trace metadata"));
  return meta;
}

// What the config asks for, from its fields alone (before the token table is built): the token table and
// one layer of float32 tensors, twice (the generator's layer and the writer's converted copy).
Status CheckSynthMemory(const SynthConfig& c) {
  const synth::ModelShape& m = c.model();
  const double n = static_cast<double>(PromptLength(c.layout())), steps = c.layout().decode_steps(),
               t = n + steps,
               tq = (c.storage().query_storage() == Storage::WINDOW ? c.storage().query_window() : n) + steps;
  double floats =
      2.0 * m.num_kv_heads() * t * m.head_dim() + static_cast<double>(m.num_heads()) * tq * m.head_dim();
  if (c.storage().record_prefill_column_sums()) floats += static_cast<double>(m.num_heads()) * n;
  return CheckMemory(2 * 4.0 * floats + 64.0 * t,
                     "synth config: one layer (" + std::to_string(m.num_heads()) + " heads x " +
                         std::to_string(static_cast<long long>(t)) + " tokens x head_dim " +
                         std::to_string(m.head_dim()) + ", float32) and the token table");
}

Status Synthesize(const synth::SynthConfig& config, TraceSink* sink, int threads) {
  if (auto issue = CheckConfig(config)) return IssueStatus(*issue, "synth config", "");
  if (config.has_streaming()) return SynthesizeStreaming(config, sink, threads);
  KVSIM_RETURN_IF_ERROR(CheckSynthMemory(config));
  TokenLayout layout = BuildLayout(config);
  if (config.storage().record_prompt_entropies())  // the regions of both question modes (replay.h)
    layout.meta.prompt_entropy_regions = PromptEntropyRegions(layout.meta);
  KVSIM_RETURN_IF_ERROR(layout.meta.Validate().WithContext("synth config produced invalid trace metadata"));
  KVSIM_RETURN_IF_ERROR(sink->Begin(layout.meta));
  Generator gen(config, std::move(layout));
  LayerData layer;
  for (int l = 0; l < config.model().num_layers(); ++l) {
    gen.GenerateLayer(l, threads, &layer);
    KVSIM_RETURN_IF_ERROR(sink->WriteLayer(layer));
  }
  return sink->Finish();
}

}  // namespace kvsim
