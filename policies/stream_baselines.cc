#include "policies/stream_baselines.h"

#include <algorithm>
#include <numeric>

#include "policies/policy_params.pb.h"
#include "policies/stream_pieces.h"
#include "policies/stream_registry.h"

namespace kvsim {

int FramesForBudget(const TraceMeta& meta, int budget_tokens) {
  return std::max(0, budget_tokens) / std::max(1, meta.stream->tokens_per_frame);
}

void BuildFrameBank(const TraceMeta& meta, const FrameBankOptions& opt, StreamPlan* plan) {
  const StreamInfo& s = *meta.stream;
  const double bpt = static_cast<double>(KvBytesPerToken(meta));
  const int P = s.tokens_per_frame;
  plan->initial_gpu_bytes = s.init_len * bpt;
  plan->context_resident = opt.tiers != FrameBankTiers::kOffloaded;
  plan->bank_offloaded = opt.tiers == FrameBankTiers::kOffloaded;
  std::vector<int32_t> all(P);
  std::iota(all.begin(), all.end(), 0);
  for (int f = 0; f < s.num_frames; ++f) {
    BankBlock b;
    b.source = BlockSource::kStream;
    b.granularity = P;
    b.index = f;
    b.first_token = s.init_len + f * P;
    b.ready_frame = f;
    b.kept = all;
    plan->bank.push_back(std::move(b));
    EncodeJob j;
    j.ready_frame = f;
    j.tokens = P;
    j.granularity = P;
    j.bank_begin = f;
    j.bank_end = f + 1;
    const double seen = static_cast<double>(f + 1) * P;
    switch (opt.tiers) {
      case FrameBankTiers::kAllOnGpu:
        j.gpu_bytes_after = (s.init_len + seen) * bpt;
        j.gpu_bytes_during = j.gpu_bytes_after;
        break;
      case FrameBankTiers::kWindowOnGpu:
        j.gpu_bytes_after =
            (s.init_len + std::min<double>(seen, static_cast<double>(opt.window_frames) * P)) * bpt;
        j.gpu_bytes_during =
            (s.init_len + std::min<double>(seen, static_cast<double>(opt.window_frames + 1) * P)) * bpt;
        break;
      case FrameBankTiers::kOffloaded: {
        const double window =
            opt.local_window_tokens > 0 ? std::min<double>(seen, opt.local_window_tokens) : 0;
        j.gpu_bytes_after = (s.init_len + window) * bpt;
        j.gpu_bytes_during = (s.init_len + std::max<double>(window, P)) * bpt;
        j.cpu_bytes_after = seen * bpt + (f + 1) * opt.representative_bytes_per_frame;
        break;
      }
    }
    plan->jobs.push_back(j);
  }
}

void SelectFrames(std::span<const int32_t> frames, ContextSelection* out) {
  out->entries.clear();
  for (int32_t f : frames) out->entries.push_back(ContextEntry{f, {}});
}

namespace {

int AvailableFrames(const StreamLayerInput& in) {
  int n = 0;
  while (n < static_cast<int>(in.available.size()) && in.available[n]) ++n;
  return n;
}

class StreamFull : public TypedStreamPolicy<policy::StreamFullParams> {
 public:
  using TypedStreamPolicy::TypedStreamPolicy;
  static Status Validate(const policy::StreamFullParams&) { return Status::Ok(); }
  std::string name() const override { return "stream_full"; }
  StreamRequirements requirements() const override { return {}; }
  int DefaultBudgetTokens(const TraceMeta& meta) const override {
    return meta.stream->num_frames * meta.stream->tokens_per_frame;
  }
  StatusOr<std::unique_ptr<StreamPlan>> Plan(const StreamPlanInput& in) const override {
    auto plan = std::make_unique<StreamPlan>();
    BuildFrameBank(*in.meta, {FrameBankTiers::kAllOnGpu}, plan.get());
    return plan;
  }
  Status SelectAtLayer(const StreamLayerInput& in, const StreamPlan&, int,
                       ContextSelection* out) const override {
    std::vector<int32_t> frames(AvailableFrames(in));
    std::iota(frames.begin(), frames.end(), 0);
    SelectFrames(frames, out);
    return Status::Ok();
  }
};

class StreamRecent : public TypedStreamPolicy<policy::StreamRecentParams> {
 public:
  using TypedStreamPolicy::TypedStreamPolicy;
  static Status Validate(const policy::StreamRecentParams&) { return Status::Ok(); }
  std::string name() const override { return "stream_recent"; }
  StreamRequirements requirements() const override { return {}; }
  int DefaultBudgetTokens(const TraceMeta& meta) const override { return 64 * meta.stream->tokens_per_frame; }
  StatusOr<std::unique_ptr<StreamPlan>> Plan(const StreamPlanInput& in) const override {
    auto plan = std::make_unique<StreamPlan>();
    FrameBankOptions opt{FrameBankTiers::kWindowOnGpu, FramesForBudget(*in.meta, in.budget_tokens)};
    BuildFrameBank(*in.meta, opt, plan.get());
    return plan;
  }
  Status SelectAtLayer(const StreamLayerInput& in, const StreamPlan&, int,
                       ContextSelection* out) const override {
    const int fb = AvailableFrames(in), k = std::min(fb, FramesForBudget(*in.meta, in.budget_tokens));
    std::vector<int32_t> frames(k);
    std::iota(frames.begin(), frames.end(), fb - k);
    SelectFrames(frames, out);
    return Status::Ok();
  }
};

class StreamUniform : public TypedStreamPolicy<policy::StreamUniformParams> {
 public:
  using TypedStreamPolicy::TypedStreamPolicy;
  static Status Validate(const policy::StreamUniformParams&) { return Status::Ok(); }
  std::string name() const override { return "stream_uniform"; }
  StreamRequirements requirements() const override { return {}; }
  int DefaultBudgetTokens(const TraceMeta& meta) const override { return 64 * meta.stream->tokens_per_frame; }
  StatusOr<std::unique_ptr<StreamPlan>> Plan(const StreamPlanInput& in) const override {
    auto plan = std::make_unique<StreamPlan>();
    BuildFrameBank(*in.meta, {FrameBankTiers::kOffloaded}, plan.get());
    return plan;
  }
  Status SelectAtLayer(const StreamLayerInput& in, const StreamPlan&, int,
                       ContextSelection* out) const override {
    const int fb = AvailableFrames(in), k = std::min(fb, FramesForBudget(*in.meta, in.budget_tokens));
    std::vector<int32_t> frames;
    for (int i = 0; i < k; ++i) {
      const int32_t f = static_cast<int32_t>((static_cast<int64_t>(2 * i + 1) * fb) / (2 * k));
      if (frames.empty() || frames.back() != f) frames.push_back(f);
    }
    SelectFrames(frames, out);
    return Status::Ok();
  }
};

class StreamOracle : public TypedStreamPolicy<policy::StreamOracleParams> {
 public:
  using TypedStreamPolicy::TypedStreamPolicy;
  static Status Validate(const policy::StreamOracleParams&) { return Status::Ok(); }
  std::string name() const override { return "stream_oracle"; }
  StreamRequirements requirements() const override {
    StreamRequirements r;
    r.oracle = true;
    return r;
  }
  int DefaultBudgetTokens(const TraceMeta& meta) const override { return 64 * meta.stream->tokens_per_frame; }
  StatusOr<std::unique_ptr<StreamPlan>> Plan(const StreamPlanInput& in) const override {
    auto plan = std::make_unique<StreamPlan>();
    BuildFrameBank(*in.meta, {FrameBankTiers::kOffloaded}, plan.get());
    return plan;
  }
  Status SelectAtLayer(const StreamLayerInput&, const StreamPlan&, int, ContextSelection*) const override {
    return Status::Internal("stream_oracle selects with hindsight only");
  }
  Status SelectWithHindsight(const StreamLayerInput& in, const StreamPlan&, int,
                             std::span<const double> video_mass, ContextSelection* out) const override {
    const int P = in.meta->stream->tokens_per_frame;
    const int fb = AvailableFrames(in), k = std::min(fb, FramesForBudget(*in.meta, in.budget_tokens));
    std::vector<float> mass(fb, 0.0f);
    std::vector<double> acc(fb, 0.0);
    for (size_t j = 0; j < video_mass.size() && static_cast<int>(j / P) < fb; ++j)
      acc[j / P] += video_mass[j];
    for (int f = 0; f < fb; ++f) mass[f] = static_cast<float>(acc[f]);
    SelectFrames(TopKSorted(mass, k), out);
    return Status::Ok();
  }
};

}  // namespace

void RegisterStreamBaselines(StreamPolicyRegistry* r) {
  r->Register({"stream_full", "every frame before the question, all on the GPU (full-history reference)",
               "StreamFullParams", false},
              TypedStreamFactory<StreamFull, policy::StreamFullParams>());
  r->Register({"stream_recent",
               "the last floor(B/P) frames before the question (sliding window of frames; none if B < P)",
               "StreamRecentParams", true},
              TypedStreamFactory<StreamRecent, policy::StreamRecentParams>());
  r->Register({"stream_uniform", "floor(B/P) frames sampled uniformly from the history (none if B < P)",
               "StreamUniformParams", true},
              TypedStreamFactory<StreamUniform, policy::StreamUniformParams>());
  r->Register(
      {"stream_oracle",
       "hindsight: the floor(B/P) frames with the most full-history attention of the question and answer "
       "(none if B < P)",
       "StreamOracleParams", true},
      TypedStreamFactory<StreamOracle, policy::StreamOracleParams>());
}

}  // namespace kvsim
