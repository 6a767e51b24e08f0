#include "policies/mukv.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "policies/memory_graph.h"
#include "policies/policy_params.pb.h"
#include "policies/stream_pieces.h"
#include "policies/stream_registry.h"
#include "policies/typed_policy.h"

namespace kvsim {

std::vector<int32_t> MuKVKeep(std::span<const float> att, const float* keys, int g, int dim, double alpha,
                              double keep_ratio, bool fft) {
  const std::vector<float> freq = fft ? FrequencySignalFFT(keys, g, dim) : FrequencySignalDiff(keys, g, dim);
  const std::vector<float> score = FuseSignals(att, freq, alpha);
  const int keep = static_cast<int>(g * keep_ratio + 1e-9);
  return TopKSorted(score, keep);
}

namespace {

using P = policy::MuKVParams;

struct Resolved {
  std::vector<int> grans{49, 196, 784};
  std::vector<double> keep{0.1, 0.1, 0.8}, alpha{0.5, 0.7, 0.8}, lambda{0.3, 0.3, 0.0};
  std::vector<int> k{20, 32, 12};
  P::Query query = P::LAST_QUESTION_KEY;
  P::Encoding encoding = P::CONTEXT_FREE;
  P::Assembly assembly = P::SCORE_ORDER;
};

Resolved Resolve(const P& p) {
  Resolved r;
  if (p.variant() == P::PAPER) {
    r.query = P::MEAN_QUESTION_QUERY;
    r.encoding = P::CONTINUOUS;
    r.assembly = P::TEMPORAL;
  }
  if (p.granularities_size()) r.grans.assign(p.granularities().begin(), p.granularities().end());
  if (p.keep_ratios_size()) r.keep.assign(p.keep_ratios().begin(), p.keep_ratios().end());
  if (p.alphas_size()) r.alpha.assign(p.alphas().begin(), p.alphas().end());
  if (p.lambdas_size()) r.lambda.assign(p.lambdas().begin(), p.lambdas().end());
  if (p.top_k_size()) r.k.assign(p.top_k().begin(), p.top_k().end());
  if (p.query() != P::QUERY_DEFAULT) r.query = p.query();
  if (p.encoding() != P::ENCODING_DEFAULT) r.encoding = p.encoding();
  if (p.assembly() != P::ASSEMBLY_DEFAULT) r.assembly = p.assembly();
  return r;
}

struct CompressedBank {
  struct Block {
    BankBlock block;
    std::vector<float> rep;  // [Hkv * d]
  };
  std::vector<Block> blocks;
  bool approximate = false;
};

class MuKVPlan : public StreamPlan {
 public:
  std::vector<std::vector<float>> reps;      // per bank block: [Hkv * d]
  std::vector<ContextSelection> selections;  // per question
};

class MuKV : public TypedStreamPolicy<P> {
 public:
  explicit MuKV(P p) : TypedStreamPolicy(std::move(p)), r_(Resolve(params_)) {}
  static Status Validate(const P& p) {
    const Resolved r = Resolve(p);
    const size_t n = r.grans.size();
    KVSIM_RETURN_IF_ERROR(Need(n >= 1, "granularities: at least one"));
    KVSIM_RETURN_IF_ERROR(Need(
        r.keep.size() == n && r.alpha.size() == n && r.lambda.size() == n && r.k.size() == n,
        "keep_ratios, alphas, lambdas and top_k need one value per granularity (" + std::to_string(n) + ")"));
    for (size_t i = 0; i < n; ++i) {
      KVSIM_RETURN_IF_ERROR(Need(r.grans[i] >= 1 && (i == 0 || r.grans[i] > r.grans[i - 1]),
                                 "granularities must be >= 1 and strictly ascending (fine to coarse)"));
      KVSIM_RETURN_IF_ERROR(Need(r.keep[i] > 0 && r.keep[i] <= 1, "keep_ratios must be in (0, 1]"));
      KVSIM_RETURN_IF_ERROR(
          Need(static_cast<int>(r.grans[i] * r.keep[i] + 1e-9) >= 1,
               "keep_ratios: int(g * keep) must be >= 1 for g = " + std::to_string(r.grans[i])));
      KVSIM_RETURN_IF_ERROR(Need(r.alpha[i] >= 0 && r.alpha[i] <= 1, "alphas must be in [0, 1]"));
      KVSIM_RETURN_IF_ERROR(Need(r.lambda[i] >= 0 && r.lambda[i] <= 1, "lambdas must be in [0, 1]"));
      KVSIM_RETURN_IF_ERROR(Need(r.k[i] >= 0, "top_k must be >= 0"));
    }
    KVSIM_RETURN_IF_ERROR(Need(p.over_retrieve() >= 1, "over_retrieve must be >= 1"));
    KVSIM_RETURN_IF_ERROR(Need(p.rerank_segments() >= 1, "rerank_segments must be >= 1"));
    return Status::Ok();
  }
  std::string name() const override { return "mukv"; }
  StreamRequirements requirements() const override {
    StreamRequirements q;
    q.granularities = r_.grans;
    q.needs_block_attention = true;
    return q;
  }
  int Kept(size_t gi) const { return static_cast<int>(r_.grans[gi] * r_.keep[gi] + 1e-9); }
  int DefaultBudgetTokens(const TraceMeta&) const override {
    int b = 0;
    for (size_t i = 0; i < r_.grans.size(); ++i) b += r_.k[i] * Kept(i);
    return std::max(1, b);
  }
  // k_g scaled so the expected retrieved tokens match the budget, keeping the paper's proportions.
  std::vector<int> TopK(const TraceMeta& meta, int budget) const {
    const double scale = static_cast<double>(budget) / DefaultBudgetTokens(meta);
    std::vector<int> k(r_.k.size());
    for (size_t i = 0; i < k.size(); ++i)
      k[i] = r_.k[i] == 0 ? 0 : std::max(1, static_cast<int>(std::llround(r_.k[i] * scale)));
    return k;
  }

  StatusOr<std::unique_ptr<StreamPlan>> Plan(const StreamPlanInput& in) const override;
  StatusOr<std::shared_ptr<const CompressedBank>> Compress(const StreamPlanInput& in) const;

  Status SelectAtLayer(const StreamLayerInput& in, const StreamPlan& plan, int question,
                       ContextSelection* out) const override {
    *out = static_cast<const MuKVPlan&>(plan).selections[question];
    return Status::Ok();
  }

 private:
  Resolved r_;
};

// 1. Every block of every granularity compressed at the last layer, with its representative, in arrival
// order (by ready frame, then fine to coarse). The same at every budget: shared through the plan cache.
StatusOr<std::shared_ptr<const CompressedBank>> MuKV::Compress(const StreamPlanInput& in) const {
  const TraceMeta& meta = *in.meta;
  const ModelInfo& m = meta.model;
  const StreamInfo& s = *meta.stream;
  const int L = m.num_layers, d = m.head_dim, hkv = m.num_kv_heads, h = m.num_heads;
  const int64_t t = meta.total_tokens();
  const bool context_free = r_.encoding == P::CONTEXT_FREE;
  auto last = in.layers->Stream(L - 1);
  if (!last.ok()) return last.status();
  const LayerData& stream = **last;
  auto out = std::make_shared<CompressedBank>();
  std::vector<CompressedBank::Block>& blocks = out->blocks;
  for (size_t gi = 0; gi < r_.grans.size(); ++gi) {
    const int g = r_.grans[gi];
    auto bl = in.layers->Blocks(g, L - 1);
    if (!bl.ok()) return bl.status();
    const StreamBlockLayer& enc = *bl;
    out->approximate |= enc.derived;
    if (enc.info->num_blocks > 0 && enc.data->attention_received.empty())
      return Status::FailedPrecondition("block encodings of granularity " + std::to_string(g) +
                                        " lack attention_received at the last layer (" +
                                        std::to_string(L - 1) + "); MuKV's attention signal needs it");
    const int64_t nb = static_cast<int64_t>(enc.info->num_blocks) * g;
    std::vector<float> avg(static_cast<size_t>(g) * d), att(g), kept_keys;
    for (int b = 0; b < enc.info->num_blocks; ++b) {
      const int32_t first = enc.info->token_positions[static_cast<size_t>(b) * g];
      const int32_t last_tok = enc.info->token_positions[static_cast<size_t>(b) * g + g - 1];
      // Keys of this block as the chosen encoding has them: [hkv][g][d].
      auto key = [&](int kh, int j) -> const float* {
        if (context_free) return enc.data->keys.data() + (kh * nb + static_cast<int64_t>(b) * g + j) * d;
        return stream.keys.data() + (kh * t + enc.info->token_positions[static_cast<size_t>(b) * g + j]) * d;
      };
      std::fill(avg.begin(), avg.end(), 0.0f);
      for (int kh = 0; kh < hkv; ++kh)
        for (int j = 0; j < g; ++j)
          for (int x = 0; x < d; ++x) avg[static_cast<size_t>(j) * d + x] += key(kh, j)[x] / hkv;
      std::fill(att.begin(), att.end(), 0.0f);
      for (int qh = 0; qh < h; ++qh)
        for (int j = 0; j < g; ++j)
          att[j] +=
              enc.data->attention_received[static_cast<size_t>(qh) * nb + static_cast<size_t>(b) * g + j] / h;
      CompressedBank::Block p;
      p.block.source = context_free ? BlockSource::kEncoded : BlockSource::kStream;
      p.block.granularity = g;
      p.block.index = b;
      p.block.first_token = first;
      p.block.ready_frame = (last_tok - s.init_len) / s.tokens_per_frame;
      p.block.kept = MuKVKeep(att, avg.data(), g, d, r_.alpha[gi], r_.keep[gi], params_.signal() == P::FFT);
      p.rep.assign(static_cast<size_t>(hkv) * d, 0.0f);
      for (int kh = 0; kh < hkv; ++kh)
        for (int32_t j : p.block.kept)
          for (int x = 0; x < d; ++x)
            p.rep[static_cast<size_t>(kh) * d + x] += key(kh, j)[x] / p.block.kept.size();
      if (!context_free) p.block.index = b;  // kStream blocks: TracePosition(first_token + offset)
      blocks.push_back(std::move(p));
    }
  }
  // Jobs in arrival order: by ready frame, then fine to coarse.
  std::stable_sort(
      blocks.begin(), blocks.end(), [](const CompressedBank::Block& a, const CompressedBank::Block& b) {
        return a.block.ready_frame != b.block.ready_frame ? a.block.ready_frame < b.block.ready_frame
                                                          : a.block.granularity < b.block.granularity;
      });
  return std::shared_ptr<const CompressedBank>(std::move(out));
}

StatusOr<std::unique_ptr<StreamPlan>> MuKV::Plan(const StreamPlanInput& in) const {
  const TraceMeta& meta = *in.meta;
  const ModelInfo& m = meta.model;
  const StreamInfo& s = *meta.stream;
  const int L = m.num_layers, d = m.head_dim, hkv = m.num_kv_heads, h = m.num_heads;
  const int64_t t = meta.total_tokens();
  const double bpt = static_cast<double>(KvBytesPerToken(meta));
  const double rep_bytes = static_cast<double>(hkv) * d * m.ModelDtypeBytes();
  auto plan = std::make_unique<MuKVPlan>();
  plan->initial_gpu_bytes = s.init_len * bpt;
  auto compute = [&]() -> StatusOr<StreamPlanCache::Value> {
    auto c = Compress(in);
    if (!c.ok()) return c.status();
    return StreamPlanCache::Value(*c);
  };
  auto cached = in.cache ? in.cache->GetOrCompute(this, "compressed_bank", compute) : compute();
  if (!cached.ok()) return cached.status();
  const auto& compressed = *static_cast<const CompressedBank*>(cached->get());
  const auto& blocks = compressed.blocks;
  plan->approximate = compressed.approximate;
  auto last = in.layers->Stream(L - 1);
  if (!last.ok()) return last.status();
  const LayerData& stream = **last;
  double cpu = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    plan->bank.push_back(blocks[i].block);
    plan->reps.push_back(blocks[i].rep);
    cpu += blocks[i].block.kept.size() * bpt + rep_bytes;
    EncodeJob j;
    j.ready_frame = blocks[i].block.ready_frame;
    j.tokens = blocks[i].block.granularity;
    j.granularity = blocks[i].block.granularity;
    j.bank_begin = static_cast<int32_t>(i);
    j.bank_end = static_cast<int32_t>(i + 1);
    j.gpu_bytes_during = (s.init_len + blocks[i].block.granularity) * bpt;
    j.gpu_bytes_after = s.init_len * bpt;
    j.cpu_bytes_after = cpu;
    plan->jobs.push_back(j);
  }
  MemoryGraph graph(plan->bank);

  // 2. Retrieval per question (layer-independent: the last layer's keys decide).
  const std::vector<int> k = TopK(meta, in.budget_tokens);
  const int tq = static_cast<int>(meta.query_positions.size());
  const int coarse = static_cast<int>(r_.grans.size()) - 1;
  for (size_t qi = 0; qi < s.questions.size(); ++qi) {
    const StreamQuestion& q = s.questions[qi];
    std::vector<float> qv(static_cast<size_t>(hkv) * d, 0.0f);
    if (r_.query == P::LAST_QUESTION_KEY) {
      const int64_t pos = q.token_begin + q.num_question_tokens - 1;
      for (int kh = 0; kh < hkv; ++kh)
        std::copy_n(stream.keys.data() + (kh * t + pos) * d, d, qv.data() + static_cast<size_t>(kh) * d);
    } else {
      for (int qh = 0; qh < h; ++qh)
        for (int j = 0; j < q.num_question_tokens; ++j) {
          const int qidx = meta.QueryIndex(q.token_begin + j);
          const float* src = stream.queries.data() + (static_cast<int64_t>(qh) * tq + qidx) * d;
          for (int x = 0; x < d; ++x)
            qv[static_cast<size_t>(qh / m.GroupSize()) * d + x] +=
                src[x] / (static_cast<float>(q.num_question_tokens) * m.GroupSize());
        }
    }
    // Stage 1: candidates per granularity among the blocks complete before the question.
    std::vector<std::vector<MuKVCandidate>> cand(r_.grans.size());
    for (size_t b = 0; b < plan->bank.size(); ++b) {
      if (plan->bank[b].ready_frame >= q.frames_before) continue;
      const size_t gi =
          std::find(r_.grans.begin(), r_.grans.end(), plan->bank[b].granularity) - r_.grans.begin();
      cand[gi].push_back({static_cast<int32_t>(b), Cosine(qv, plan->reps[b]), 0});
    }
    std::vector<double> stage1_score(plan->bank.size(), 0.0);
    std::vector<uint8_t> is_coarse_cand(plan->bank.size(), 0);
    for (size_t gi = 0; gi < cand.size(); ++gi) {
      auto& c = cand[gi];
      std::stable_sort(c.begin(), c.end(), [](const MuKVCandidate& a, const MuKVCandidate& b) {
        return a.score != b.score ? a.score > b.score : a.bank_index < b.bank_index;
      });
      c.resize(std::min<size_t>(c.size(), static_cast<size_t>(params_.over_retrieve()) * k[gi]));
      for (const MuKVCandidate& x : c) stage1_score[x.bank_index] = x.score;
    }
    for (const MuKVCandidate& x : cand[coarse]) is_coarse_cand[x.bank_index] = 1;
    // Stage 2: segment context c = mean r of the top-N coarse candidates.
    std::vector<float> ctx(static_cast<size_t>(hkv) * d, 0.0f);
    const int nseg = std::min<int>(params_.rerank_segments(), cand[coarse].size());
    for (int i = 0; i < nseg; ++i)
      for (size_t x = 0; x < ctx.size(); ++x) ctx[x] += plan->reps[cand[coarse][i].bank_index][x] / nseg;
    int changed = 0, retrieved_tokens = 0;
    std::vector<std::vector<MuKVCandidate>> keep(cand.size());
    for (size_t gi = 0; gi < cand.size(); ++gi) {
      for (MuKVCandidate& x : cand[gi]) {
        switch (params_.rerank()) {
          case P::SEMI_HIERARCHICAL:
            x.reranked =
                nseg > 0 ? RerankScore(x.score, plan->reps[x.bank_index], ctx, r_.lambda[gi]) : x.score;
            break;
          case P::NO_RERANK:
            x.reranked = x.score;
            break;
          case P::ANCESTOR: {
            const int root = graph.Root(x.bank_index);
            const double anc = root != x.bank_index && is_coarse_cand[root] ? stage1_score[root] : 0.0;
            x.reranked = root == x.bank_index ? x.score : (1 - r_.lambda[gi]) * x.score + r_.lambda[gi] * anc;
            break;
          }
        }
      }
      std::vector<MuKVCandidate> by_rerank = cand[gi];
      std::stable_sort(
          by_rerank.begin(), by_rerank.end(), [](const MuKVCandidate& a, const MuKVCandidate& b) {
            return a.reranked != b.reranked ? a.reranked > b.reranked : a.bank_index < b.bank_index;
          });
      by_rerank.resize(std::min<size_t>(by_rerank.size(), k[gi]));
      for (const MuKVCandidate& x : by_rerank) {
        bool in_stage1 = false;
        for (size_t i = 0; i < std::min<size_t>(cand[gi].size(), k[gi]); ++i)
          in_stage1 |= cand[gi][i].bank_index == x.bank_index;
        changed += !in_stage1;
        retrieved_tokens += plan->bank[x.bank_index].kept.size();
      }
      keep[gi] = std::move(by_rerank);
    }
    // Assembly.
    ContextSelection sel;
    sel.positions = params_.positions() == policy::REINDEXED ? ContextPositions::kReindexed
                                                             : ContextPositions::kAsEncoded;
    std::vector<int32_t> retrieved;
    if (r_.assembly == P::SCORE_ORDER) {
      for (const auto& group : keep)
        for (const MuKVCandidate& x : group) retrieved.push_back(x.bank_index);
    } else {
      for (const auto& group : keep)
        for (const MuKVCandidate& x : group) retrieved.push_back(x.bank_index);
      std::stable_sort(retrieved.begin(), retrieved.end(), [&](int32_t a, int32_t b) {
        const BankBlock &x = plan->bank[a], &y = plan->bank[b];
        return x.first_token != y.first_token ? x.first_token < y.first_token : x.granularity > y.granularity;
      });
    }
    for (int32_t b : retrieved) sel.entries.push_back({b, {}});
    plan->selections.push_back(std::move(sel));
    const MemoryGraph::SetStats st = graph.Analyze(retrieved);
    std::map<std::string, double> stats;
    stats["hierarchy_coherence"] = st.coherence;
    stats["temporal_clusters"] = st.clusters;
    stats["rerank_changed_blocks"] = changed;
    stats["retrieved_tokens"] = retrieved_tokens;
    for (size_t gi = 0; gi < keep.size(); ++gi)
      stats["retrieved_blocks_g" + std::to_string(r_.grans[gi])] = keep[gi].size();
    plan->question_stats.push_back(std::move(stats));
  }
  return std::unique_ptr<StreamPlan>(std::move(plan));
}

}  // namespace

void RegisterMuKV(StreamPolicyRegistry* r) {
  r->Register({"mukv",
               "MuKV: 49/196/784-token blocks, dual-signal (attention + FFT) compression, parallel retrieval "
               "with semi-hierarchical rerank (CVPR 2026)",
               "MuKVParams", true},
              TypedStreamFactory<MuKV, P>());
}

}  // namespace kvsim
