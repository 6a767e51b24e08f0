#include "policies/rekv.h"

#include <algorithm>
#include <cmath>

#include "policies/policy_params.pb.h"
#include "policies/stream_baselines.h"
#include "policies/stream_pieces.h"
#include "policies/stream_registry.h"
#include "policies/typed_policy.h"
#include "sim/rope.h"

namespace kvsim {

std::vector<float> ReKVFrameScores(const TraceMeta& meta, const LayerData& layer, int question,
                                   int num_frames, bool cosine) {
  const ModelInfo& m = meta.model;
  const StreamInfo& s = *meta.stream;
  const StreamQuestion& q = s.questions[question];
  const int d = m.head_dim, h = m.num_heads, hkv = m.num_kv_heads, P = s.tokens_per_frame;
  const int64_t t = meta.total_tokens();
  const int tq = static_cast<int>(meta.query_positions.size());
  const std::vector<double> rope = RopeFrequencies(d, m.rope_theta);
  // Frame representatives per KV head: [hkv][F][d].
  std::vector<float> reps(static_cast<size_t>(hkv) * num_frames * d, 0.0f), tmp(d);
  for (int kh = 0; kh < hkv; ++kh)
    for (int f = 0; f < num_frames; ++f) {
      std::vector<double> acc(d, 0.0);
      for (int j = 0; j < P; ++j) {
        const int64_t pos = s.init_len + static_cast<int64_t>(f) * P + j;
        std::copy_n(layer.keys.data() + (kh * t + pos) * d, d, tmp.data());
        RotateBy(tmp.data(), d, -meta.tokens.position_id[pos], rope);  // back to pre-RoPE
        for (int x = 0; x < d; ++x) acc[x] += tmp[x];
      }
      float* r = reps.data() + (static_cast<size_t>(kh) * num_frames + f) * d;
      for (int x = 0; x < d; ++x) r[x] = static_cast<float>(acc[x] / P);
    }
  std::vector<double> score(num_frames, 0.0);
  for (int qh = 0; qh < h; ++qh) {
    std::vector<double> acc(d, 0.0);
    for (int j = 0; j < q.num_question_tokens; ++j) {
      const int32_t pos = q.token_begin + j;
      const int qi = meta.QueryIndex(pos);
      std::copy_n(layer.queries.data() + (static_cast<int64_t>(qh) * tq + qi) * d, d, tmp.data());
      RotateBy(tmp.data(), d, -meta.tokens.position_id[pos], rope);  // back to pre-RoPE
      for (int x = 0; x < d; ++x) acc[x] += tmp[x];
    }
    std::vector<float> qbar(d);
    for (int x = 0; x < d; ++x) qbar[x] = static_cast<float>(acc[x] / q.num_question_tokens);
    const int kh = qh / m.GroupSize();
    for (int f = 0; f < num_frames; ++f) {
      std::span<const float> r(reps.data() + (static_cast<size_t>(kh) * num_frames + f) * d, d);
      score[f] += cosine ? Cosine(qbar, r) : DotProduct(qbar, r);
    }
  }
  return std::vector<float>(score.begin(), score.end());
}

std::vector<int32_t> ReKVSelect(std::span<const float> scores, int k) { return TopKSorted(scores, k); }

namespace {

class ReKV : public TypedStreamPolicy<policy::ReKVParams> {
 public:
  using TypedStreamPolicy::TypedStreamPolicy;
  static Status Validate(const policy::ReKVParams& p) {
    KVSIM_RETURN_IF_ERROR(Need(p.n_local() >= 0, "n_local must be >= 0"));
    KVSIM_RETURN_IF_ERROR(Need(p.default_frames() >= 1, "default_frames must be >= 1"));
    return Status::Ok();
  }
  std::string name() const override { return "rekv"; }
  StreamRequirements requirements() const override { return {}; }
  int DefaultBudgetTokens(const TraceMeta& meta) const override {
    return params_.default_frames() * meta.stream->tokens_per_frame;
  }
  StatusOr<std::unique_ptr<StreamPlan>> Plan(const StreamPlanInput& in) const override {
    auto plan = std::make_unique<StreamPlan>();
    const ModelInfo& m = in.meta->model;
    FrameBankOptions opt;
    opt.tiers = FrameBankTiers::kOffloaded;
    opt.local_window_tokens = params_.n_local();
    // One mean key per frame, layer and KV head, kept at the model dtype.
    opt.representative_bytes_per_frame =
        static_cast<double>(m.num_layers) * m.num_kv_heads * m.head_dim * m.ModelDtypeBytes();
    BuildFrameBank(*in.meta, opt, plan.get());
    // The continuous run attended to the whole history; ReKV's encoder sees only its local window. The
    // retrieved K/V of a question differ from ReKV's only when the video before it exceeds the window.
    for (const StreamQuestion& q : in.meta->stream->questions) {
      const double history = static_cast<double>(q.frames_before) * in.meta->stream->tokens_per_frame;
      plan->question_stats.push_back(
          {{"encoder_window_exceeded", params_.n_local() > 0 && history > params_.n_local() ? 1.0 : 0.0}});
    }
    return plan;
  }
  Status SelectAtLayer(const StreamLayerInput& in, const StreamPlan& plan, int question,
                       ContextSelection* out) const override {
    int fb = 0;
    while (fb < static_cast<int>(in.available.size()) && in.available[fb]) ++fb;
    const auto scores =
        ReKVFrameScores(*in.meta, *in.stream, question, fb, params_.score() == policy::ReKVParams::COSINE);
    SelectFrames(ReKVSelect(scores, std::max(1, FramesForBudget(*in.meta, in.budget_tokens))), out);
    out->positions = params_.positions() == policy::AS_ENCODED ? ContextPositions::kAsEncoded
                                                               : ContextPositions::kReindexed;
    return Status::Ok();
  }
};

}  // namespace

void RegisterReKV(StreamPolicyRegistry* r) {
  r->Register(
      {"rekv",
       "ReKV: frames offloaded to a CPU bank, per-layer top-k frames by question-query x mean-key dot "
       "product, temporal order, re-indexed positions (Di et al. 2025)",
       "ReKVParams", true},
      TypedStreamFactory<ReKV, policy::ReKVParams>());
}

}  // namespace kvsim
