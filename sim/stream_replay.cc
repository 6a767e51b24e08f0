#include "sim/stream_replay.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <future>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>

#include "sim/attention.h"
#include "sim/event_queue.h"
#include "sim/parallel.h"
#include "sim/rope.h"
#include "sim/stats.h"
#include "sim/version.h"

namespace kvsim {

int64_t KvBytesPerToken(const TraceMeta& meta) {
  const ModelInfo& m = meta.model;
  return 2LL * m.num_layers * m.num_kv_heads * m.head_dim * m.ModelDtypeBytes();
}

std::vector<VideoBlock> CutVideoBlocks(const StreamInfo& s, int g) {
  std::vector<VideoBlock> out;
  if (g <= 0) return out;
  const int64_t video = static_cast<int64_t>(s.num_frames) * s.tokens_per_frame;
  const int64_t nb = video / g;
  out.reserve(nb);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t last = (b + 1) * g - 1;  // offset in the video stream
    out.push_back(
        {static_cast<int32_t>(s.init_len + b * g), static_cast<int32_t>(last / s.tokens_per_frame)});
  }
  return out;
}

double FindStreamStat(const google::protobuf::RepeatedPtrField<StreamStat>& stats, const std::string& name) {
  for (const StreamStat& s : stats)
    if (s.name() == name) return s.value();
  return std::nan("");
}

namespace {

constexpr double kUsPerSecond = 1e6;

// Attention of R query rows over N keys; row r sees keys [0, visible[r]). probs [R][N] (zeros beyond),
// out [R][d]
// (null: probabilities only, v unused).
void AttendRows(const ModelInfo& m, const float* q, int rows, const float* k, const float* v, int n,
                const int* visible, std::vector<float>* probs, std::vector<float>* out) {
  const int d = m.head_dim;
  probs->resize(static_cast<size_t>(rows) * n);  // fully overwritten below (beta = 0, tails zeroed)
  if (out) out->resize(static_cast<size_t>(rows) * d);
  if (rows == 0 || n == 0) {
    if (out) std::fill(out->begin(), out->end(), 0.0f);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, n, d, static_cast<float>(m.softmax_scale), q, d,
              k, d, 0.0f, probs->data(), n);
  for (int r = 0; r < rows; ++r) {
    float* row = probs->data() + static_cast<size_t>(r) * n;
    const int vis = visible[r];
    SoftCap(row, vis, static_cast<float>(m.logit_softcap));
    SoftmaxInPlace(row, vis);
    std::fill(row + vis, row + n, 0.0f);
  }
  if (out)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, d, n, 1.0f, probs->data(), n, v, d, 0.0f,
                out->data(), d);
}

// ---- Layer access: reads the trace, derives missing block encodings ----

// Block encodings of granularity g derived from the continuous run: the same tokens' K/V; attention from the
// stored video queries (block-causal softmax over the init prompt + the block, init columns dropped).
Status DeriveBlockLayer(const TraceMeta& meta, const LayerData& layer, const BlockEncodingInfo& info,
                        bool with_attention, BlockLayerData* out) {
  const ModelInfo& m = meta.model;
  const int d = m.head_dim, hkv = m.num_kv_heads, h = m.num_heads, g = info.granularity;
  const int64_t t = meta.total_tokens(), n = static_cast<int64_t>(info.num_blocks) * g;
  out->granularity = g;
  out->keys.assign(static_cast<size_t>(hkv) * n * d, 0.0f);
  out->values.assign(out->keys.size(), 0.0f);
  for (int kh = 0; kh < hkv; ++kh)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = info.token_positions[i];
      std::copy_n(layer.keys.data() + (kh * t + pos) * d, d, out->keys.data() + (kh * n + i) * d);
      std::copy_n(layer.values.data() + (kh * t + pos) * d, d, out->values.data() + (kh * n + i) * d);
    }
  out->attention_received.clear();
  if (!with_attention) return Status::Ok();
  const int init = meta.stream->init_len;
  const int tq = static_cast<int>(meta.query_positions.size());
  out->attention_received.assign(static_cast<size_t>(h) * n, 0.0f);
  std::vector<float> keys(static_cast<size_t>(init + g) * d), qs(static_cast<size_t>(g) * d), probs;
  std::vector<int> vis(g);
  for (int qh = 0; qh < h; ++qh) {
    const int kh = qh / m.GroupSize();
    for (int b = 0; b < info.num_blocks; ++b) {
      for (int j = 0; j < init; ++j)
        std::copy_n(layer.keys.data() + (kh * t + j) * d, d, keys.data() + j * d);
      for (int j = 0; j < g; ++j) {
        const int32_t pos = info.token_positions[static_cast<size_t>(b) * g + j];
        std::copy_n(layer.keys.data() + (kh * t + pos) * d, d, keys.data() + (init + j) * d);
        const int qi = meta.QueryIndex(pos);
        if (qi < 0)
          return Status::FailedPrecondition(
              "deriving block encodings (granularity " + std::to_string(g) +
              ") needs the video tokens' queries; the trace lacks token " + std::to_string(pos) +
              "'s query: store /streaming_blocks in the trace or every video token's query");
        std::copy_n(layer.queries.data() + (static_cast<int64_t>(qh) * tq + qi) * d, d, qs.data() + j * d);
        vis[j] = init + j + 1;
      }
      AttendRows(m, qs.data(), g, keys.data(), nullptr, init + g, vis.data(), &probs, nullptr);
      float* dst = out->attention_received.data() + static_cast<size_t>(qh) * n + static_cast<size_t>(b) * g;
      for (int r = 0; r < g; ++r)
        for (int j = 0; j < g; ++j) dst[j] += probs[static_cast<size_t>(r) * (init + g) + init + j];
    }
  }
  return Status::Ok();
}

class Access : public StreamLayerAccess {
 public:
  Access(TraceSource* trace, bool needs_attention) : trace_(trace), needs_attention_(needs_attention) {}
  StatusOr<const LayerData*> Stream(int layer) override {
    std::lock_guard<std::mutex> lock(mu_);
    return StreamLocked(layer);
  }
  StatusOr<StreamBlockLayer> Blocks(int g, int layer) override {
    std::lock_guard<std::mutex> lock(mu_);
    const TraceMeta& meta = trace_->meta();
    auto key = std::make_pair(g, layer);
    StreamBlockLayer out;
    out.granularity = g;
    const BlockEncodingInfo* stored = meta.stream->FindBlocks(g);
    if (stored) {
      out.info = stored;
      auto it = blocks_.find(key);
      if (it == blocks_.end()) {
        BlockLayerData data = TakeSpareBlocks(g);
        KVSIM_RETURN_IF_ERROR(trace_->ReadBlockLayer(g, layer, &data));
        it = blocks_.emplace(key, std::move(data)).first;
      }
      out.data = &it->second;
      return out;
    }
    auto info_it = derived_info_.find(g);
    if (info_it == derived_info_.end()) {
      BlockEncodingInfo info;
      info.granularity = g;
      const auto cut = CutVideoBlocks(*meta.stream, g);
      info.num_blocks = static_cast<int>(cut.size());
      for (const VideoBlock& b : cut)
        for (int j = 0; j < g; ++j) info.token_positions.push_back(b.first_token + j);
      info.attention_layers = {meta.model.num_layers - 1};
      info_it = derived_info_.emplace(g, std::move(info)).first;
    }
    out.info = &info_it->second;
    out.derived = true;
    auto it = blocks_.find(key);
    if (it == blocks_.end()) {
      auto layer_data = StreamLocked(layer);
      if (!layer_data.ok()) return layer_data.status();
      BlockLayerData data = TakeSpareBlocks(g);
      const bool attention = needs_attention_ && layer == meta.model.num_layers - 1;
      KVSIM_RETURN_IF_ERROR(DeriveBlockLayer(meta, **layer_data, info_it->second, attention, &data));
      it = blocks_.emplace(key, std::move(data)).first;
    }
    out.data = &it->second;
    return out;
  }
  // Reads `layer`'s stream data, then reads or derives its block encodings of granularities `grans`. The
  // stream read holds no lock, so the engine can read layer l + 1 in the background while layer l's already
  // loaded data is used; the source is never read by two threads at once as long as only one Load runs and
  // nothing else reads meanwhile (Stream and Blocks of a loaded layer do not read).
  Status Load(int layer, const std::set<int>& grans) {
    std::optional<LayerData> data;  // set when the layer is not loaded yet
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!stream_.count(layer)) data = TakeSpareStream();
    }
    if (data) {
      KVSIM_RETURN_IF_ERROR(trace_->ReadLayer(layer, &*data));
      std::lock_guard<std::mutex> lock(mu_);
      stream_.emplace(layer, std::move(*data));
    }
    for (int g : grans) KVSIM_RETURN_IF_ERROR(Blocks(g, layer).status());
    return Status::Ok();
  }
  // Keeps only `layer`'s stream data and block encodings (the per-layer pass). What is dropped is kept
  // aside (one layer's worth) so that the next read reuses its buffers instead of allocating anew.
  void KeepOnly(int layer) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = stream_.begin(); it != stream_.end();) {
      if (it->first == layer) {
        ++it;
        continue;
      }
      spare_stream_ = std::move(it->second);
      it = stream_.erase(it);
    }
    for (auto it = blocks_.begin(); it != blocks_.end();) {
      if (it->first.second == layer) {
        ++it;
        continue;
      }
      spare_blocks_[it->first.first] = std::move(it->second);
      it = blocks_.erase(it);
    }
  }
  bool derived_any() const { return !derived_info_.empty(); }

 private:
  LayerData TakeSpareStream() {  // with mu_ held
    LayerData data = std::move(spare_stream_);
    spare_stream_ = LayerData();
    return data;
  }
  BlockLayerData TakeSpareBlocks(int g) {  // with mu_ held
    auto it = spare_blocks_.find(g);
    if (it == spare_blocks_.end()) return {};
    BlockLayerData data = std::move(it->second);
    spare_blocks_.erase(it);
    return data;
  }
  StatusOr<const LayerData*> StreamLocked(int layer) {
    auto it = stream_.find(layer);
    if (it == stream_.end()) {
      LayerData data = TakeSpareStream();
      KVSIM_RETURN_IF_ERROR(trace_->ReadLayer(layer, &data));
      it = stream_.emplace(layer, std::move(data)).first;
    }
    return &it->second;
  }
  TraceSource* trace_;
  bool needs_attention_;
  std::mutex mu_;
  std::map<int, LayerData> stream_;
  std::map<std::pair<int, int>, BlockLayerData> blocks_;
  LayerData spare_stream_;                      // a dropped layer's buffers, for the next read
  std::map<int, BlockLayerData> spare_blocks_;  // by granularity
  std::map<int, BlockEncodingInfo> derived_info_;
};

// Per-worker scratch, reused across calls: the buffers are tens of MB, and fresh allocations cost page
// faults and zeroing on every (question, layer, run).
struct Scratch {
  std::vector<float> k, v, qs, qh_rows, probs, out, qall;
};

// ---- Per-question reference (shared by every run) ----

struct QuestionRef {
  int hist = 0;  // history tokens: [0, video_end_q)
  int nq = 0, na = 0;
  // Per query head: answer rows' probabilities over [history + question + answer] (hist + nq + na columns)
  // and outputs.
  std::vector<std::vector<float>> probs, out;
  // Σ over question and answer rows and query heads of the attention on each video token of the history.
  std::vector<double> video_mass;  // [video tokens before the question]
};

// Keys/values of the history of question q for KV head kh into k/v (rows: history, question, answer).
void GatherHistory(const TraceMeta& meta, const LayerData& layer, const StreamQuestion& q, int kh, int hist,
                   std::vector<float>* k, std::vector<float>* v) {
  const int d = meta.model.head_dim, nqa = q.num_question_tokens + q.num_answer_tokens;
  const int64_t t = meta.total_tokens();
  k->resize(static_cast<size_t>(hist + nqa) * d);
  v->resize(k->size());
  const float* ks = layer.keys.data() + kh * t * d;
  const float* vs = layer.values.data() + kh * t * d;
  std::copy_n(ks, static_cast<size_t>(hist) * d, k->data());
  std::copy_n(vs, static_cast<size_t>(hist) * d, v->data());
  std::copy_n(ks + static_cast<int64_t>(q.token_begin) * d, static_cast<size_t>(nqa) * d,
              k->data() + static_cast<size_t>(hist) * d);
  std::copy_n(vs + static_cast<int64_t>(q.token_begin) * d, static_cast<size_t>(nqa) * d,
              v->data() + static_cast<size_t>(hist) * d);
}

void QueryRows(const TraceMeta& meta, const LayerData& layer, int qh, int32_t first, int rows,
               std::vector<float>* out) {
  const int d = meta.model.head_dim, tq = static_cast<int>(meta.query_positions.size());
  out->resize(static_cast<size_t>(rows) * d);
  for (int r = 0; r < rows; ++r) {
    const int qi = meta.QueryIndex(first + r);
    std::copy_n(layer.queries.data() + (static_cast<int64_t>(qh) * tq + qi) * d, d, out->data() + r * d);
  }
}

Status ComputeQuestionRef(const TraceMeta& meta, const LayerData& layer, int qidx, int threads,
                          std::vector<Scratch>* scratch, QuestionRef* ref) {
  const StreamInfo& s = *meta.stream;
  const StreamQuestion& q = s.questions[qidx];
  const ModelInfo& m = meta.model;
  const int h = m.num_heads, d = m.head_dim;
  ref->hist = s.init_len + q.frames_before * s.tokens_per_frame;
  ref->nq = q.num_question_tokens;
  ref->na = q.num_answer_tokens;
  const int nqa = ref->nq + ref->na, ncols = ref->hist + nqa;
  ref->probs.assign(h, {});
  ref->out.assign(h, {});
  std::vector<std::vector<double>> mass(h);
  const int g = m.GroupSize();
  // One product per KV head: the group's query heads are stacked, so the history keys are packed once.
  ParallelForWorkers(m.num_kv_heads, threads, [&](int kh, int w) {
    Scratch& sc = (*scratch)[w];
    auto &k = sc.k, &v = sc.v, &qs = sc.qs, &qh_rows = sc.qh_rows, &probs = sc.probs, &out = sc.out;
    GatherHistory(meta, layer, q, kh, ref->hist, &k, &v);
    qs.resize(static_cast<size_t>(g) * nqa * d);
    std::vector<int> vis(static_cast<size_t>(g) * nqa);
    for (int i = 0; i < g; ++i) {
      QueryRows(meta, layer, kh * g + i, q.token_begin, nqa, &qh_rows);
      std::copy(qh_rows.begin(), qh_rows.end(), qs.begin() + static_cast<size_t>(i) * nqa * d);
      for (int r = 0; r < nqa; ++r) vis[static_cast<size_t>(i) * nqa + r] = ref->hist + r + 1;
    }
    AttendRows(m, qs.data(), g * nqa, k.data(), v.data(), ncols, vis.data(), &probs, &out);
    for (int i = 0; i < g; ++i) {
      const int qh = kh * g + i;
      const float* p = probs.data() + static_cast<size_t>(i) * nqa * ncols;
      mass[qh].assign(ref->hist - s.init_len, 0.0);
      for (int r = 0; r < nqa; ++r)
        for (int j = s.init_len; j < ref->hist; ++j)
          mass[qh][j - s.init_len] += p[static_cast<size_t>(r) * ncols + j];
      ref->probs[qh].assign(p + static_cast<size_t>(ref->nq) * ncols, p + static_cast<size_t>(nqa) * ncols);
      const float* o = out.data() + static_cast<size_t>(i) * nqa * d;
      ref->out[qh].assign(o + static_cast<size_t>(ref->nq) * d, o + static_cast<size_t>(nqa) * d);
    }
  });
  ref->video_mass.assign(ref->hist - s.init_len, 0.0);
  for (int qh = 0; qh < h; ++qh)
    for (size_t j = 0; j < ref->video_mass.size(); ++j) ref->video_mass[j] += mass[qh][j];
  return Status::Ok();
}

// ---- Per-run accumulation ----

struct QuestionAccum {
  std::vector<float> retained, err;  // samples (layer, head, step), in layer order
  double evidence_frame_recall = 0, evidence_token_recall = 0, oracle_frame_recall = 0,
         oracle_mass_recall = 0;
  double visual_tokens = 0, context_tokens = 0, frames_covered = 0, duplicates = 0;
  int layers = 0;
};

struct RunState {
  const StreamRunSpec* spec = nullptr;
  int budget = 0;
  std::unique_ptr<StreamPlan> plan;
  std::vector<std::vector<uint8_t>> available;  // [question][bank block]
  std::vector<QuestionAccum> acc;               // [question]
};

// One run's context for one question at one layer, with everything the metrics need.
struct AssembledContext {
  std::vector<int32_t> trace_pos;   // per context row: trace position of the token it holds (-1: none)
  std::vector<int64_t> stored_pos;  // position the key was encoded at
  std::vector<int64_t> new_pos;     // position in the assembled context
  // Per row: the source (0: stream, else granularity) and the row index in that source's [N][d] arrays.
  std::vector<int32_t> source, row;
  int video_rows = 0;
};

Status Assemble(const TraceMeta& meta, const StreamLayerInput& in, const StreamPlan& plan,
                const ContextSelection& sel, const StreamQuestion& q, std::span<const uint8_t> available,
                const std::string& who, AssembledContext* ctx) {
  const StreamInfo& s = *meta.stream;
  auto push = [&](int32_t tpos, int64_t stored, int32_t src, int32_t row) {
    ctx->trace_pos.push_back(tpos);
    ctx->stored_pos.push_back(stored);
    ctx->new_pos.push_back(static_cast<int64_t>(ctx->new_pos.size()));
    ctx->source.push_back(src);
    ctx->row.push_back(row);
  };
  for (int j = 0; j < s.init_len; ++j) push(j, meta.tokens.position_id[j], 0, j);
  for (const ContextEntry& e : sel.entries) {
    if (e.bank_index < 0 || e.bank_index >= static_cast<int>(plan.bank.size()))
      return Status::Internal(who + ": context entry names bank block " + std::to_string(e.bank_index) +
                              " of " + std::to_string(plan.bank.size()));
    if (!available[e.bank_index])
      return Status::Internal(who + ": retrieved bank block " + std::to_string(e.bank_index) +
                              ", which is not complete before the question at t=" + std::to_string(q.time_s) +
                              " s (a question may only use frames that arrived before it)");
    const BankBlock& b = plan.bank[e.bank_index];
    const std::vector<int32_t>& offs = e.offsets.empty() ? b.kept : e.offsets;
    if (!e.offsets.empty())
      for (int32_t o : e.offsets)
        if (!std::binary_search(b.kept.begin(), b.kept.end(), o))
          return Status::Internal(who + ": context uses offset " + std::to_string(o) + " of bank block " +
                                  std::to_string(e.bank_index) + ", which the bank did not keep");
    for (int32_t o : offs) {
      const int32_t tpos = b.TracePosition(o);
      if (b.source == BlockSource::kStream) {
        push(tpos, meta.tokens.position_id[tpos], 0, tpos);
      } else {
        auto it = in.blocks.find(b.granularity);
        if (it == in.blocks.end())
          return Status::Internal(who + ": granularity " + std::to_string(b.granularity) + " not loaded");
        const int32_t row = b.index * b.granularity + o;
        const int32_t at = it->second.info->token_positions[row];
        const int64_t stored = it->second.derived ? meta.tokens.position_id[at] : s.init_len + o;
        push(at, stored, b.granularity, row);
      }
      ++ctx->video_rows;
    }
  }
  // Question and answer tokens follow the context in both position modes.
  const int nqa = q.num_question_tokens + q.num_answer_tokens;
  for (int j = 0; j < nqa; ++j) {
    const int32_t tpos = q.token_begin + j;
    push(tpos, meta.tokens.position_id[tpos], 0, tpos);
  }
  if (sel.positions == ContextPositions::kAsEncoded) {
    const int64_t base = s.init_len + ctx->video_rows;
    for (size_t i = 0; i < ctx->new_pos.size(); ++i) {
      const bool qa = static_cast<int>(i) >= static_cast<int>(ctx->new_pos.size()) - nqa;
      ctx->new_pos[i] =
          qa ? base + (static_cast<int64_t>(i) - (ctx->new_pos.size() - nqa)) : ctx->stored_pos[i];
    }
  }
  return Status::Ok();
}

// Attends the answer queries over the assembled context for every query head; accumulates metrics.
// Runs on one worker (the caller parallelises over runs).
void EvaluateContext(const TraceMeta& meta, const LayerData& layer, const StreamLayerInput& in,
                     const AssembledContext& ctx, const StreamQuestion& q, const QuestionRef& ref,
                     Scratch* sc, QuestionAccum* acc) {
  const ModelInfo& m = meta.model;
  const StreamInfo& s = *meta.stream;
  const int d = m.head_dim, h = m.num_heads, hkv = m.num_kv_heads, g = m.GroupSize();
  const int64_t t = meta.total_tokens();
  const std::vector<double> rope = RopeFrequencies(d, m.rope_theta);
  const int n = static_cast<int>(ctx.trace_pos.size());
  const int nq = q.num_question_tokens, na = q.num_answer_tokens;
  const int ncols_ref = ref.hist + nq + na;
  // Covered columns of the reference (history index of each context token), for retained mass.
  std::vector<uint8_t> covered(ncols_ref, 0);
  int duplicates = 0;
  std::vector<uint8_t> seen(t, 0);
  std::vector<int> covered_cols;  // ascending, each once (fixed summation order)
  for (int i = 0; i < n; ++i) {
    const int32_t p = ctx.trace_pos[i];
    if (seen[p]) ++duplicates;
    seen[p] = 1;
    const int col = p < ref.hist ? p : ref.hist + (p - q.token_begin);
    covered[col] = 1;
  }
  for (int c = 0; c < ncols_ref; ++c)
    if (covered[c]) covered_cols.push_back(c);
  std::vector<std::vector<float>> ret(h), err(h);
  std::vector<double> kept_mass;
  auto &k = sc->k, &v = sc->v, &qs = sc->qs, &probs = sc->probs, &out = sc->out, &qall = sc->qall;
  for (int kh = 0; kh < hkv; ++kh) {
    k.resize(static_cast<size_t>(n) * d);
    v.resize(k.size());
    for (int i = 0; i < n; ++i) {
      const float *ks, *vs;
      if (ctx.source[i] == 0) {
        ks = layer.keys.data() + (kh * t + ctx.row[i]) * d;
        vs = layer.values.data() + (kh * t + ctx.row[i]) * d;
      } else {
        const StreamBlockLayer& bl = in.blocks.at(ctx.source[i]);
        const int64_t nb = static_cast<int64_t>(bl.info->num_blocks) * bl.granularity;
        ks = bl.data->keys.data() + (kh * nb + ctx.row[i]) * d;
        vs = bl.data->values.data() + (kh * nb + ctx.row[i]) * d;
      }
      std::copy_n(ks, d, k.data() + static_cast<size_t>(i) * d);
      std::copy_n(vs, d, v.data() + static_cast<size_t>(i) * d);
      RotateBy(k.data() + static_cast<size_t>(i) * d, d, ctx.new_pos[i] - ctx.stored_pos[i], rope);
    }
    // The group's answer queries stacked: one product per KV head.
    std::vector<int> vis(static_cast<size_t>(g) * na);
    qall.resize(static_cast<size_t>(g) * na * d);
    for (int gi = 0; gi < g; ++gi) {
      QueryRows(meta, layer, kh * g + gi, q.token_begin + nq, na, &qs);
      for (int r = 0; r < na; ++r) {
        const int i = n - na + r;  // the answer token's own row
        RotateBy(qs.data() + static_cast<size_t>(r) * d, d, ctx.new_pos[i] - ctx.stored_pos[i], rope);
        vis[static_cast<size_t>(gi) * na + r] = n - na + r + 1;
      }
      std::copy(qs.begin(), qs.end(), qall.begin() + static_cast<size_t>(gi) * na * d);
    }
    AttendRows(m, qall.data(), g * na, k.data(), v.data(), n, vis.data(), &probs, &out);
    for (int gi = 0; gi < g; ++gi) {
      const int qh = kh * g + gi;
      RetainedMass(ref.probs[qh].data(), na, ncols_ref, covered_cols, &kept_mass);
      for (int r = 0; r < na; ++r) {
        const double kept = kept_mass[r];
        const float* of = ref.out[qh].data() + static_cast<size_t>(r) * d;
        const float* oc = out.data() + (static_cast<size_t>(gi) * na + r) * d;
        double num = 0, den = 0;
        for (int j = 0; j < d; ++j) {
          num += static_cast<double>(oc[j] - of[j]) * (oc[j] - of[j]);
          den += static_cast<double>(of[j]) * of[j];
        }
        ret[qh].push_back(static_cast<float>(kept));
        err[qh].push_back(static_cast<float>(den > 0 ? std::sqrt(num / den) : std::sqrt(num)));
      }
    }
  }
  for (int qh = 0; qh < h; ++qh) {
    acc->retained.insert(acc->retained.end(), ret[qh].begin(), ret[qh].end());
    acc->err.insert(acc->err.end(), err[qh].begin(), err[qh].end());
  }
  // Frame-level coverage.
  const int P = s.tokens_per_frame;
  std::vector<int> frame_tokens(q.frames_before, 0);
  for (int i = 0; i < n; ++i) {
    const int32_t p = ctx.trace_pos[i];
    if (p >= s.video_begin() && p < ref.hist && seen[p] == 1) {
      ++frame_tokens[(p - s.video_begin()) / P];
      seen[p] = 2;  // count each token once
    }
  }
  int covered_frames = 0;
  for (int c : frame_tokens) covered_frames += c > 0;
  if (!q.evidence_frames.empty()) {
    int hit = 0;
    double tok = 0;
    for (int32_t f : q.evidence_frames) {
      hit += frame_tokens[f] > 0;
      tok += frame_tokens[f];
    }
    acc->evidence_frame_recall += static_cast<double>(hit) / q.evidence_frames.size();
    acc->evidence_token_recall += tok / (static_cast<double>(q.evidence_frames.size()) * P);
  }
  std::vector<double> fmass(q.frames_before, 0.0);
  double total_mass = 0;
  for (size_t j = 0; j < ref.video_mass.size(); ++j) {
    fmass[j / P] += ref.video_mass[j];
    total_mass += ref.video_mass[j];
  }
  std::vector<int> order(q.frames_before);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return fmass[a] > fmass[b]; });
  int top_hit = 0;
  double covered_mass = 0;
  for (int i = 0; i < covered_frames; ++i) top_hit += frame_tokens[order[i]] > 0;
  for (int f = 0; f < q.frames_before; ++f)
    if (frame_tokens[f] > 0) covered_mass += fmass[f];
  acc->oracle_frame_recall += covered_frames > 0 ? static_cast<double>(top_hit) / covered_frames : 0.0;
  acc->oracle_mass_recall += total_mass > 0 ? covered_mass / total_mass : 0.0;
  acc->visual_tokens += ctx.video_rows;
  acc->context_tokens += n;
  acc->frames_covered += covered_frames;
  acc->duplicates += duplicates;
  acc->layers += 1;
}

}  // namespace

StreamTimeline SimulateStreamTimeline(const TraceMeta& meta, const StreamPlan& plan,
                                      std::span<const double> context_tokens, const LatencyModel& latency) {
  const StreamInfo& s = *meta.stream;
  const bool timed = latency.unit() == "us";
  const double bpt = static_cast<double>(KvBytesPerToken(meta));
  const int nq = static_cast<int>(s.questions.size());
  StreamTimeline tl;
  tl.job_end_s.assign(plan.jobs.size(), 0);
  tl.answer_start_s.assign(nq, 0);
  tl.first_token_s.assign(nq, 0);
  tl.answer_end_s.assign(nq, 0);
  tl.cpu_at_answer.assign(nq, 0);
  tl.gpu_at_answer.assign(nq, 0);

  EventQueue queue;
  double cpu = 0, resident = plan.initial_gpu_bytes, gpu = resident;
  auto now_s = [&] { return static_cast<double>(queue.now().ticks) / kUsPerSecond; };
  auto record = [&](const char* ev) {
    MemoryPoint p;
    p.set_time_s(now_s());
    p.set_event(ev);
    p.set_cpu_bank_bytes(cpu);
    p.set_gpu_bytes(gpu);
    tl.memory.push_back(std::move(p));
  };
  auto dur_us = [&](double d) -> int64_t { return timed ? std::llround(std::max(0.0, d)) : 0; };

  // Tasks: jobs (>= 0) and questions (-1 - q), FIFO on one GPU server.
  std::vector<int> pending;
  size_t head = 0, next_job = 0;
  bool busy = false;
  std::function<void()> start_next = [&] {
    if (busy || head == pending.size()) return;
    busy = true;
    const int task = pending[head++];
    if (task >= 0) {
      const EncodeJob& job = plan.jobs[task];
      gpu = std::max(resident, job.gpu_bytes_during);
      record("encode");
      const int64_t d = dur_us(latency.PrefillDuration(job.tokens, 0));
      tl.encode_busy_s += d / kUsPerSecond;
      queue.ScheduleAfter(d, [&, task] {
        const EncodeJob& j = plan.jobs[task];
        tl.job_end_s[task] = now_s();
        tl.encode_lag_max_s = std::max(tl.encode_lag_max_s, now_s() - s.frame_time_s[j.ready_frame]);
        cpu = j.cpu_bytes_after;
        resident = gpu = j.gpu_bytes_after;
        busy = false;
        record("encode");
        start_next();
      });
      return;
    }
    const int qi = -1 - task;
    const StreamQuestion& q = s.questions[qi];
    tl.answer_start_s[qi] = now_s();
    const double ctx = context_tokens.empty() || plan.context_resident ? 0 : context_tokens[qi];
    gpu = resident + (ctx + q.num_question_tokens + q.num_answer_tokens) * bpt;
    tl.cpu_at_answer[qi] = cpu;
    tl.gpu_at_answer[qi] = gpu;
    record("question");
    const double attended = s.init_len + (context_tokens.empty() ? 0 : context_tokens[qi]);
    const int64_t prefill =
        dur_us(latency.PrefillDuration(q.num_question_tokens, static_cast<int>(attended)));
    int64_t steps = 0, first = 0;
    for (int a = 0; a < q.num_answer_tokens; ++a) {
      steps += dur_us(latency.UniformDecodeStepDuration(attended + q.num_question_tokens + a + 1,
                                                        meta.model.num_layers, meta.model.num_kv_heads));
      if (a == 0) first = prefill + steps;
    }
    tl.first_token_s[qi] = now_s() + first / kUsPerSecond;
    queue.ScheduleAfter(prefill + steps, [&, qi] {
      tl.answer_end_s[qi] = now_s();
      gpu = resident;
      busy = false;
      record("answer");
      start_next();
    });
  };
  // Frames first, then questions: at equal times a frame counts as arrived (frames_before uses <=).
  for (int f = 0; f < s.num_frames; ++f)
    queue.Schedule(SimTime{std::llround(s.frame_time_s[f] * kUsPerSecond)}, [&, f] {
      while (next_job < plan.jobs.size() && plan.jobs[next_job].ready_frame <= f)
        pending.push_back(static_cast<int>(next_job++));
      start_next();
    });
  for (int qi = 0; qi < nq; ++qi)
    queue.Schedule(SimTime{std::llround(s.questions[qi].time_s * kUsPerSecond)}, [&, qi] {
      pending.push_back(-1 - qi);
      start_next();
    });
  record("start");
  queue.Run();
  record("done");
  return tl;
}

Status CheckStreamRuns(const TraceMeta& meta, std::span<const StreamRunSpec> runs) {
  if (!meta.is_streaming())
    return Status::InvalidArgument(
        "trace is not a streaming trace (no /streaming group); streaming policies "
        "need one: synthesize with a `streaming` config (docs/streaming.md)");
  if (meta.model.sliding_window > 0)
    return Status::InvalidArgument(
        "model/sliding_window: streaming replay supports full causal attention "
        "only; this trace's model has sliding_window " +
        std::to_string(meta.model.sliding_window));
  for (const StreamRunSpec& r : runs) {
    if (!r.policy) return Status::InvalidArgument("run '" + r.label + "' has no policy");
    if (r.budget_tokens < 0)
      return Status::InvalidArgument("run '" + r.label +
                                     "': budget tokens must be >= 0 (0 = policy default)");
    const StreamRequirements req = r.policy->requirements();
    for (int g : req.granularities) {
      if (g <= 0) return Status::InvalidArgument("run '" + r.label + "': granularity must be > 0");
      if (meta.stream->FindBlocks(g) || !req.needs_block_attention) continue;
      // Derived encodings need the video tokens' queries for their attention signal.
      for (int p = meta.stream->video_begin(); p < meta.stream->video_end(); ++p)
        if (meta.QueryIndex(p) < 0)
          return Status::FailedPrecondition(
              "run '" + r.label + "' (" + r.policy->name() + ") needs block encodings of granularity " +
              std::to_string(g) +
              "; the trace has none and lacks the video tokens' queries to derive them: add "
              "/streaming_blocks (kvsim synth block_encodings, or kvsim-capture --blocks) or store every "
              "query");
    }
  }
  return Status::Ok();
}

StatusOr<std::vector<StreamRunResult>> ReplayStream(TraceSource& trace, std::span<const StreamRunSpec> runs,
                                                    const StreamReplayOptions& options) {
  const TraceMeta& meta = trace.meta();
  KVSIM_RETURN_IF_ERROR(CheckStreamRuns(meta, runs));
  EnsureSingleThreadedBlas();
  const int threads = options.threads > 0 ? options.threads : DefaultThreads();
  const StreamInfo& s = *meta.stream;
  const int nq = static_cast<int>(s.questions.size()), L = meta.model.num_layers;
  bool needs_attention = false;
  std::set<int> grans;
  for (const StreamRunSpec& r : runs) {
    const StreamRequirements req = r.policy->requirements();
    needs_attention |= req.needs_block_attention;
    grans.insert(req.granularities.begin(), req.granularities.end());
  }
  Access access(&trace, needs_attention);
  std::vector<Scratch> scratch(threads);

  // 1. Plans, in parallel over runs (work shared between runs goes through the plan cache).
  std::vector<RunState> states(runs.size());
  StreamPlanCache cache;
  std::vector<Status> plan_status(runs.size());
  ParallelForWorkers(static_cast<int>(runs.size()), threads, [&](int i, int) {
    RunState& st = states[i];
    st.spec = &runs[i];
    st.budget = runs[i].budget_tokens > 0 ? runs[i].budget_tokens : runs[i].policy->DefaultBudgetTokens(meta);
    StreamPlanInput in{&meta, st.budget, &access, 1, &cache};
    auto plan = runs[i].policy->Plan(in);
    if (!plan.ok()) {
      plan_status[i] = plan.status().WithContext("run '" + runs[i].label + "'");
      return;
    }
    st.plan = std::move(*plan);
    for (int g : runs[i].policy->requirements().granularities) st.plan->approximate |= !s.FindBlocks(g);
    st.available.assign(nq, std::vector<uint8_t>(st.plan->bank.size(), 0));
    for (int q = 0; q < nq; ++q)
      for (size_t b = 0; b < st.plan->bank.size(); ++b)
        st.available[q][b] = st.plan->bank[b].ready_frame < s.questions[q].frames_before;
    st.acc.assign(nq, {});
  });
  for (const Status& st : plan_status) KVSIM_RETURN_IF_ERROR(st);

  // 2. The per-layer pass. Layer l + 1 is read (and its block encodings read or derived) in the background
  // while layer l is replayed: at most two layers resident.
  access.KeepOnly(0);
  Status read_status = access.Load(0, grans);
  for (int l = 0; l < L; ++l) {
    KVSIM_RETURN_IF_ERROR(read_status);
    access.KeepOnly(l);
    auto layer_or = access.Stream(l);
    if (!layer_or.ok()) return layer_or.status();
    const LayerData& layer = **layer_or;
    StreamLayerInput base;
    base.meta = &meta;
    base.layer = l;
    base.stream = &layer;
    for (int g : grans) {
      auto bl = access.Blocks(g, l);
      if (!bl.ok()) return bl.status();
      base.blocks[g] = *bl;
    }
    // An early return below waits for the read too (a std::async future's destructor joins it).
    std::future<Status> next;
    if (l + 1 < L)
      next = std::async(std::launch::async, [&access, &grans, l] { return access.Load(l + 1, grans); });
    for (int qi = 0; qi < nq; ++qi) {
      const StreamQuestion& q = s.questions[qi];
      QuestionRef ref;
      KVSIM_RETURN_IF_ERROR(ComputeQuestionRef(meta, layer, qi, threads, &scratch, &ref));
      // Runs in parallel (each run's selection, assembly and metrics are its own).
      std::vector<Status> status(states.size());
      ParallelForWorkers(static_cast<int>(states.size()), threads, [&](int ri, int w) {
        RunState& st = states[ri];
        StreamLayerInput in = base;
        in.budget_tokens = st.budget;
        in.available = st.available[qi];
        ContextSelection sel;
        Status ss = st.spec->policy->requirements().oracle
                        ? st.spec->policy->SelectWithHindsight(in, *st.plan, qi, ref.video_mass, &sel)
                        : st.spec->policy->SelectAtLayer(in, *st.plan, qi, &sel);
        const std::string who = "run '" + st.spec->label + "'";
        if (!ss.ok()) {
          status[ri] = ss.WithContext(who);
          return;
        }
        AssembledContext ctx;
        status[ri] = Assemble(meta, in, *st.plan, sel, q, st.available[qi], who, &ctx);
        if (status[ri].ok()) EvaluateContext(meta, layer, in, ctx, q, ref, &scratch[w], &st.acc[qi]);
      });
      for (const Status& st : status) KVSIM_RETURN_IF_ERROR(st);
    }
    if (next.valid()) read_status = next.get();
    if (options.progress) options.progress->Update("layer", l + 1, L);
  }

  // 3. Timelines and results.
  auto tokens_latency = MakeTokenStepLatencyModel();
  const LatencyModel& latency = options.latency ? *options.latency : *tokens_latency;
  std::vector<StreamRunResult> results;
  for (RunState& st : states) {
    std::vector<double> ctx_tokens(nq, 0);
    for (int q = 0; q < nq; ++q)
      ctx_tokens[q] = st.acc[q].layers ? st.acc[q].visual_tokens / st.acc[q].layers : 0;
    const StreamTimeline tl = SimulateStreamTimeline(meta, *st.plan, ctx_tokens, latency);
    StreamRunResult r;
    r.set_policy(st.spec->policy->name());
    r.set_label(st.spec->label.empty() ? st.spec->policy->name() : st.spec->label);
    r.set_parameters(st.spec->policy->ParamsText());
    r.set_budget_tokens(st.budget);
    r.set_trace_path(options.trace_path);
    r.set_trace_hash(options.trace_hash);
    r.set_trace_model(meta.model.name);
    r.set_trace_seed(meta.seed);
    r.set_trace_source(meta.source);
    r.set_kvsim_version(kVersion);
    r.set_git_commit(kGitCommit);
    r.set_time_unit(latency.unit());
    r.set_approximate(st.plan->approximate);
    StreamQuestionResult mean;
    std::map<std::string, double> stat_sums;
    double ev_n = 0;
    for (int qi = 0; qi < nq; ++qi) {
      const QuestionAccum& a = st.acc[qi];
      const StreamQuestion& q = s.questions[qi];
      const double nl = std::max(1, a.layers);
      StreamQuestionResult* qr = r.add_questions();
      qr->set_question(qi);
      qr->set_time_s(q.time_s);
      qr->set_frames_before(q.frames_before);
      qr->set_samples(a.retained.size());
      qr->set_retained_mass_mean(Mean(a.retained));
      qr->set_retained_mass_p5(Quantile(a.retained, 0.05));
      qr->set_output_rel_error_mean(Mean(a.err));
      qr->set_output_rel_error_p95(Quantile(a.err, 0.95));
      qr->set_evidence_frame_recall(q.evidence_frames.empty() ? -1 : a.evidence_frame_recall / nl);
      qr->set_evidence_token_recall(q.evidence_frames.empty() ? -1 : a.evidence_token_recall / nl);
      qr->set_oracle_frame_recall(a.oracle_frame_recall / nl);
      qr->set_oracle_mass_recall(a.oracle_mass_recall / nl);
      qr->set_visual_tokens_in_context(a.visual_tokens / nl);
      qr->set_context_tokens(a.context_tokens / nl);
      qr->set_frames_covered(a.frames_covered / nl);
      qr->set_duplicate_tokens(a.duplicates / nl);
      qr->set_answer_start_s(tl.answer_start_s[qi]);
      qr->set_answer_end_s(tl.answer_end_s[qi]);
      qr->set_time_to_first_token_s(tl.first_token_s[qi] - q.time_s);
      qr->set_gpu_bytes_at_answer(tl.gpu_at_answer[qi]);
      qr->set_cpu_bank_bytes_at_answer(tl.cpu_at_answer[qi]);
      if (qi < static_cast<int>(st.plan->question_stats.size()))
        for (const auto& [k, v] : st.plan->question_stats[qi]) {  // std::map: ordered by name
          StreamStat* ps = qr->add_policy_stats();
          ps->set_name(k);
          ps->set_value(v);
          stat_sums[k] += v;
        }
      // Means.
      auto add = [&](auto get, auto set) { set(&mean, get(mean) + get(*qr) / nq); };
      add([](const StreamQuestionResult& x) { return x.retained_mass_mean(); },
          [](StreamQuestionResult* x, double v) { x->set_retained_mass_mean(v); });
      add([](const StreamQuestionResult& x) { return x.retained_mass_p5(); },
          [](StreamQuestionResult* x, double v) { x->set_retained_mass_p5(v); });
      add([](const StreamQuestionResult& x) { return x.output_rel_error_mean(); },
          [](StreamQuestionResult* x, double v) { x->set_output_rel_error_mean(v); });
      add([](const StreamQuestionResult& x) { return x.output_rel_error_p95(); },
          [](StreamQuestionResult* x, double v) { x->set_output_rel_error_p95(v); });
      add([](const StreamQuestionResult& x) { return x.oracle_frame_recall(); },
          [](StreamQuestionResult* x, double v) { x->set_oracle_frame_recall(v); });
      add([](const StreamQuestionResult& x) { return x.oracle_mass_recall(); },
          [](StreamQuestionResult* x, double v) { x->set_oracle_mass_recall(v); });
      add([](const StreamQuestionResult& x) { return x.visual_tokens_in_context(); },
          [](StreamQuestionResult* x, double v) { x->set_visual_tokens_in_context(v); });
      add([](const StreamQuestionResult& x) { return x.context_tokens(); },
          [](StreamQuestionResult* x, double v) { x->set_context_tokens(v); });
      add([](const StreamQuestionResult& x) { return x.frames_covered(); },
          [](StreamQuestionResult* x, double v) { x->set_frames_covered(v); });
      add([](const StreamQuestionResult& x) { return x.duplicate_tokens(); },
          [](StreamQuestionResult* x, double v) { x->set_duplicate_tokens(v); });
      add([](const StreamQuestionResult& x) { return x.time_to_first_token_s(); },
          [](StreamQuestionResult* x, double v) { x->set_time_to_first_token_s(v); });
      add([](const StreamQuestionResult& x) { return x.gpu_bytes_at_answer(); },
          [](StreamQuestionResult* x, double v) { x->set_gpu_bytes_at_answer(v); });
      add([](const StreamQuestionResult& x) { return x.cpu_bank_bytes_at_answer(); },
          [](StreamQuestionResult* x, double v) { x->set_cpu_bank_bytes_at_answer(v); });
      add([](const StreamQuestionResult& x) { return x.samples(); },
          [](StreamQuestionResult* x, double v) { x->set_samples(v); });
      if (!q.evidence_frames.empty()) {
        mean.set_evidence_frame_recall(mean.evidence_frame_recall() + qr->evidence_frame_recall());
        mean.set_evidence_token_recall(mean.evidence_token_recall() + qr->evidence_token_recall());
        ev_n += 1;
      }
    }
    mean.set_question(-1);
    mean.set_evidence_frame_recall(ev_n > 0 ? mean.evidence_frame_recall() / ev_n : -1);
    mean.set_evidence_token_recall(ev_n > 0 ? mean.evidence_token_recall() / ev_n : -1);
    *r.mutable_mean() = mean;
    for (const auto& [k, v] : stat_sums) {
      StreamStat* ps = r.add_policy_stats();
      ps->set_name(k);
      ps->set_value(v / std::max(1, nq));
    }
    for (const MemoryPoint& p : tl.memory) *r.add_memory() = p;
    double bank_tokens = 0;
    if (st.plan->bank_offloaded)
      for (const BankBlock& b : st.plan->bank) bank_tokens += b.kept.size();
    r.set_cpu_bank_bytes_final(tl.memory.empty() ? 0 : tl.memory.back().cpu_bank_bytes());
    r.set_cpu_bank_tokens_final(bank_tokens);
    r.set_bank_tokens_per_frame(s.num_frames > 0 ? bank_tokens / s.num_frames : 0);
    double peak = 0, area = 0;
    for (size_t i = 0; i < tl.memory.size(); ++i) {
      peak = std::max(peak, tl.memory[i].gpu_bytes());
      if (i + 1 < tl.memory.size())
        area += tl.memory[i].gpu_bytes() * (tl.memory[i + 1].time_s() - tl.memory[i].time_s());
    }
    const double span = tl.memory.empty() ? 0 : tl.memory.back().time_s() - tl.memory.front().time_s();
    r.set_gpu_bytes_peak(peak);
    r.set_gpu_bytes_mean(span > 0 ? area / span : peak);
    double enc = 0;
    for (const EncodeJob& j : st.plan->jobs) enc += j.tokens;
    r.set_encode_tokens(enc);
    const double video_tokens = static_cast<double>(s.num_frames) * s.tokens_per_frame;
    r.set_encode_passes_per_video_token(video_tokens > 0 ? enc / video_tokens : 0);
    r.set_encode_busy_s(tl.encode_busy_s);
    r.set_encode_lag_max_s(tl.encode_lag_max_s);
    double steps = 0;
    for (const StreamQuestion& q : s.questions) steps += q.num_answer_tokens;
    r.set_decode_token_steps(steps);
    results.push_back(std::move(r));
  }
  return results;
}

void RetainedMass(const float* p, int rows, int stride, std::span<const int> cols, std::vector<double>* out) {
  out->assign(rows, 0.0);
  constexpr int kRows = 8;
  int r0 = 0;
  for (; r0 + kRows <= rows; r0 += kRows) {
    const float* q[kRows];
    for (int i = 0; i < kRows; ++i) q[i] = p + static_cast<size_t>(r0 + i) * stride;
    double s[kRows] = {};
    for (int c : cols)
      for (int i = 0; i < kRows; ++i) s[i] += q[i][c];
    for (int i = 0; i < kRows; ++i) (*out)[r0 + i] = s[i];
  }
  for (; r0 < rows; ++r0) {
    const float* q = p + static_cast<size_t>(r0) * stride;
    double s = 0;
    for (int c : cols) s += q[c];
    (*out)[r0] = s;
  }
}

}  // namespace kvsim
