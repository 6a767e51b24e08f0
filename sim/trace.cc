#include "sim/trace.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace kvsim {

const char* ModalityName(Modality m) {
  switch (m) {
    case Modality::kText:
      return "text";
    case Modality::kImage:
      return "image";
    case Modality::kVideo:
      return "video";
    case Modality::kOther:
      return "other";
  }
  return "?";
}
const char* PhaseName(Phase p) { return p == Phase::kPrefill ? "prefill" : "decode"; }
const char* RoleName(Role r) {
  switch (r) {
    case Role::kSystem:
      return "system";
    case Role::kContext:
      return "context";
    case Role::kQuestion:
      return "question";
    case Role::kGenerated:
      return "generated";
  }
  return "?";
}
const char* StorageDtypeName(StorageDtype d) { return d == StorageDtype::kFloat16 ? "float16" : "float32"; }
int StorageDtypeBytes(StorageDtype d) { return d == StorageDtype::kFloat16 ? 2 : 4; }

int ModelInfo::ModelDtypeBytes() const { return model_dtype == "float32" ? 4 : 2; }

void TokenTable::Resize(int64_t n) {
  modality.resize(n, Modality::kText);
  segment_id.resize(n, -1);
  patch_row.resize(n, -1);
  patch_col.resize(n, -1);
  position_id.resize(n, 0);
  phase.resize(n, Phase::kPrefill);
  role.resize(n, Role::kContext);
  token_id.resize(n, -1);
  if (!text.empty()) text.resize(n);
}

bool TraceMeta::HasAllPromptQueries() const {
  // query_positions is ascending and unique (Validate), so the prompt is covered iff the first n are 0..n-1.
  if (static_cast<int>(query_positions.size()) < prefill_length) return false;
  return prefill_length == 0 || query_positions[prefill_length - 1] == prefill_length - 1;
}

int TraceMeta::QueryIndex(int32_t pos) const {
  auto it = std::lower_bound(query_positions.begin(), query_positions.end(), pos);
  if (it == query_positions.end() || *it != pos) return -1;
  return static_cast<int>(it - query_positions.begin());
}

const double* TraceMeta::RecordedPromptEntropies(int layer, int compress_end) const {
  const auto it =
      std::lower_bound(prompt_entropy_regions.begin(), prompt_entropy_regions.end(), compress_end);
  if (it == prompt_entropy_regions.end() || *it != compress_end || prompt_entropies.empty() || layer < 0 ||
      layer >= model.num_layers)
    return nullptr;
  const size_t per_region = static_cast<size_t>(kNumPromptEntropyKinds) * model.num_heads;
  const size_t r = it - prompt_entropy_regions.begin();
  return prompt_entropies.data() +
         (static_cast<size_t>(layer) * prompt_entropy_regions.size() + r) * per_region;
}

const BlockEncodingInfo* StreamInfo::FindBlocks(int granularity) const {
  for (const BlockEncodingInfo& b : block_encodings)
    if (b.granularity == granularity) return &b;
  return nullptr;
}

int FramesBefore(const StreamInfo& s, double t) {
  // frame_time_s is non-decreasing (Validate): count the prefix with time <= t.
  return static_cast<int>(std::upper_bound(s.frame_time_s.begin(), s.frame_time_s.end(), t) -
                          s.frame_time_s.begin());
}

namespace {
Status Bad(const std::string& field, const std::string& what) {
  return Status::InvalidArgument("field '" + field + "': " + what);
}

std::string Num(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

std::string IntList(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// The streaming rules of Validate (docs/streaming.md), run after the common shape checks: the token layout
// (init prompt, video frames, then per question its question and answer tokens), the frame times, the
// questions, query_positions and the block encodings.
Status ValidateStream(const TraceMeta& meta) {
  const StreamInfo& s = *meta.stream;
  const TokenTable& tk = meta.tokens;
  const int64_t t = meta.total_tokens();
  const int n = meta.prefill_length;
  if (!std::isfinite(s.fps) || s.fps < 0)
    return Bad("streaming/fps", "must be a finite number >= 0 (nominal frame rate), got " + Num(s.fps));
  if (s.init_len < 1) return Bad("streaming/init_len", "must be >= 1 (the init prompt precedes the video)");
  if (s.tokens_per_frame < 1) return Bad("streaming/tokens_per_frame", "must be >= 1");
  if (s.num_frames < 1) return Bad("streaming/num_frames", "must be >= 1");
  if (static_cast<int64_t>(s.init_len) + static_cast<int64_t>(s.num_frames) * s.tokens_per_frame != n)
    return Bad("prefill_length", "is " + std::to_string(n) +
                                     ", a streaming trace needs init_len + num_frames * tokens_per_frame = " +
                                     std::to_string(static_cast<int64_t>(s.init_len) +
                                                    static_cast<int64_t>(s.num_frames) * s.tokens_per_frame));
  if (static_cast<int>(s.frame_time_s.size()) != s.num_frames)
    return Bad("streaming/frame_time_s",
               "has " + std::to_string(s.frame_time_s.size()) +
                   " entries, expected num_frames = " + std::to_string(s.num_frames));
  for (int f = 0; f < s.num_frames; ++f) {
    const double x = s.frame_time_s[f];
    if (!std::isfinite(x) || x < 0)
      return Bad("streaming/frame_time_s",
                 "frame " + std::to_string(f) + " has time " + Num(x) + "; times must be finite and >= 0");
    if (f > 0 && x < s.frame_time_s[f - 1])
      return Bad("streaming/frame_time_s", "must be non-decreasing (frame " + std::to_string(f) + " at " +
                                               Num(x) + " s comes before frame " + std::to_string(f - 1) +
                                               " at " + Num(s.frame_time_s[f - 1]) + " s)");
  }
  // Prefill tokens: init prompt then video frames, all phase prefill, none generated.
  for (int i = 0; i < n; ++i) {
    if (tk.phase[i] != Phase::kPrefill)
      return Bad("tokens/phase", "token " + std::to_string(i) + " (init prompt or video) must be prefill");
    if (tk.role[i] == Role::kGenerated || tk.role[i] == Role::kQuestion)
      return Bad("tokens/role", "token " + std::to_string(i) + " (init prompt or video) is marked " +
                                    RoleName(tk.role[i]) +
                                    "; roles question/generated belong after prefill_length");
    if (i >= s.video_begin()) {
      const int f = (i - s.video_begin()) / s.tokens_per_frame;
      if (tk.modality[i] != Modality::kVideo)
        return Bad("tokens/modality", "video token " + std::to_string(i) + " (frame " + std::to_string(f) +
                                          ") must have modality video, got " + ModalityName(tk.modality[i]));
      if (tk.segment_id[i] != f)
        return Bad("tokens/segment_id", "video token " + std::to_string(i) +
                                            " must have segment_id = its frame " + std::to_string(f) +
                                            ", got " + std::to_string(tk.segment_id[i]));
    }
  }
  // Questions: time order, spans tiling [prefill_length, T).
  if (s.questions.empty())
    return Bad("streaming/questions", "is empty; a streaming trace needs at least one question");
  int64_t next = n;
  for (size_t qi = 0; qi < s.questions.size(); ++qi) {
    const StreamQuestion& q = s.questions[qi];
    const std::string qs = "question " + std::to_string(qi);
    if (!std::isfinite(q.time_s))
      return Bad("streaming/questions/time_s", qs + " has a non-finite time " + Num(q.time_s));
    if (qi > 0 && q.time_s < s.questions[qi - 1].time_s)
      return Bad("streaming/questions/time_s",
                 qs + " at t=" + Num(q.time_s) + " s comes before question " + std::to_string(qi - 1) +
                     " at t=" + Num(s.questions[qi - 1].time_s) + " s; questions must be sorted by time");
    if (q.token_begin != next)
      return Bad("streaming/questions/token_begin",
                 qs + " begins at token " + std::to_string(q.token_begin) + ", expected " +
                     std::to_string(next) +
                     " (question spans follow prefill_length and each other without gaps)");
    if (q.num_question_tokens < 1)
      return Bad("streaming/questions/num_question_tokens", qs + " must have >= 1 question token");
    if (q.num_answer_tokens < 1)
      return Bad("streaming/questions/num_answer_tokens", qs + " must have >= 1 answer token");
    const int64_t qend = next + q.num_question_tokens;
    const int64_t aend = qend + q.num_answer_tokens;
    if (aend > t)
      return Bad("streaming/questions",
                 qs + " ends at token " + std::to_string(aend) +
                     ", past prefill_length + num_decode_steps = " + std::to_string(t));
    const int fb = FramesBefore(s, q.time_s);
    if (fb < 1)
      return Bad("streaming/questions/time_s",
                 qs + " at t=" + Num(q.time_s) + " s comes before the first frame (t=" +
                     Num(s.frame_time_s[0]) + " s); ask it after a frame has arrived");
    if (q.frames_before != fb)
      return Bad("streaming/questions/frames_before",
                 qs + " has frames_before " + std::to_string(q.frames_before) + " but " + std::to_string(fb) +
                     " frames have frame_time_s <= " + Num(q.time_s) + "; it is derived from the times");
    for (size_t e = 0; e < q.evidence_frames.size(); ++e) {
      const int32_t ef = q.evidence_frames[e];
      if (ef < 0 || ef >= fb)
        return Bad("streaming/questions/evidence_frames",
                   qs + " (t=" + Num(q.time_s) + " s) lists evidence frame " + std::to_string(ef) +
                       ", outside the frames that arrived before it [0, " + std::to_string(fb) + ")");
      if (e > 0 && ef <= q.evidence_frames[e - 1])
        return Bad("streaming/questions/evidence_frames",
                   qs + ": evidence frames must be strictly ascending");
    }
    for (int64_t i = next; i < aend; ++i) {
      const bool is_q = i < qend;
      const Role want_role = is_q ? Role::kQuestion : Role::kGenerated;
      const Phase want_phase = is_q ? Phase::kPrefill : Phase::kDecode;
      if (tk.role[i] != want_role || tk.phase[i] != want_phase)
        return Bad(tk.role[i] != want_role ? "tokens/role" : "tokens/phase",
                   "token " + std::to_string(i) + " is a " + (is_q ? "question" : "answer") + " token of " +
                       qs + " and must be role " + RoleName(want_role) + ", phase " + PhaseName(want_phase) +
                       " (got " + RoleName(tk.role[i]) + ", " + PhaseName(tk.phase[i]) + ")");
    }
    next = aend;
  }
  if (next != t)
    return Bad("streaming/questions",
               "question and answer spans end at token " + std::to_string(next) + " but the trace has " +
                   std::to_string(t) +
                   " tokens; num_decode_steps must count every question and answer token");
  // query_positions: every question/answer token (checked by the caller); prompt queries none, exactly the
  // video tokens, or the whole prompt.
  int n_prompt_q = 0;
  for (int32_t p : meta.query_positions) n_prompt_q += p < n;
  if (n_prompt_q != 0) {
    const int video_len = n - s.video_begin();
    const bool all_prompt = n_prompt_q == n;  // ascending + unique + all < n => exactly [0, n)
    const bool all_video = n_prompt_q == video_len && meta.query_positions[0] == s.video_begin();
    if (!all_prompt && !all_video)
      return Bad("query_positions",
                 "a streaming trace stores either no prompt queries, every video token's query [" +
                     std::to_string(s.video_begin()) + ", " + std::to_string(n) +
                     "), or every prompt query; got " + std::to_string(n_prompt_q) + " prompt queries");
  }
  // Block encodings.
  const int64_t video_len = static_cast<int64_t>(s.num_frames) * s.tokens_per_frame;
  const int num_layers = meta.model.num_layers;
  for (size_t bi = 0; bi < s.block_encodings.size(); ++bi) {
    const BlockEncodingInfo& b = s.block_encodings[bi];
    const std::string gs = "granularity " + std::to_string(b.granularity);
    if (b.granularity < 1)
      return Bad("streaming_blocks/granularities",
                 "entry " + std::to_string(bi) + " is " + std::to_string(b.granularity) + "; must be >= 1");
    if (bi > 0 && b.granularity <= s.block_encodings[bi - 1].granularity)
      return Bad("streaming_blocks/granularities", "must be strictly ascending (unique)");
    if (b.granularity > video_len)
      return Bad("streaming_blocks/granularities", gs + " exceeds the video length " +
                                                       std::to_string(video_len) +
                                                       " tokens (no whole block); drop it");
    if (b.num_blocks != video_len / b.granularity)
      return Bad("streaming_blocks/num_blocks",
                 gs + " has " + std::to_string(b.num_blocks) +
                     " blocks, expected floor(num_frames * tokens_per_frame / G) = " +
                     std::to_string(video_len / b.granularity));
    const size_t bg = static_cast<size_t>(b.num_blocks) * b.granularity;
    if (b.token_positions.size() != bg)
      return Bad("streaming_blocks/token_positions",
                 gs + " has " + std::to_string(b.token_positions.size()) +
                     " entries, expected num_blocks * G = " + std::to_string(bg));
    for (size_t j = 0; j < bg; ++j)
      if (b.token_positions[j] < s.video_begin() || b.token_positions[j] >= s.video_end())
        return Bad("streaming_blocks/token_positions",
                   gs + " entry " + std::to_string(j) + " = " + std::to_string(b.token_positions[j]) +
                       " is outside the video [" + std::to_string(s.video_begin()) + ", " +
                       std::to_string(s.video_end()) + ")");
    for (size_t j = 0; j < b.attention_layers.size(); ++j) {
      const int32_t l = b.attention_layers[j];
      if (l < 0 || l >= num_layers || (j > 0 && l <= b.attention_layers[j - 1]))
        return Bad("streaming_blocks/attention_layers",
                   gs + ": layers must be strictly ascending in [0, " + std::to_string(num_layers) + ")");
    }
    if (b.attention_layers.empty() || b.attention_layers.back() != num_layers - 1)
      return Bad("streaming_blocks/attention_layers",
                 gs + ": attention_received must be stored at the last layer (" +
                     std::to_string(num_layers - 1) + ")");
  }
  return Status::Ok();
}
}  // namespace

Status TraceMeta::Validate() const {
  if (format_version != kTraceFormatVersion)
    return Bad("format_version", "is " + std::to_string(format_version) + ", this kvsim reads version " +
                                     std::to_string(kTraceFormatVersion) +
                                     "; regenerate or convert the trace");
  const ModelInfo& m = model;
  if (m.num_layers <= 0) return Bad("num_layers", "must be > 0");
  if (m.num_heads <= 0) return Bad("num_heads", "must be > 0");
  if (m.num_kv_heads <= 0 || m.num_heads % m.num_kv_heads != 0)
    return Bad("num_kv_heads", "must be > 0 and divide num_heads (" + std::to_string(m.num_heads) + ")");
  if (m.head_dim <= 0 || m.head_dim > 1024) return Bad("head_dim", "must be in [1, 1024]");
  if (!(m.softmax_scale > 0) || !std::isfinite(m.softmax_scale))
    return Bad("softmax_scale", "must be a positive finite number (usually 1/sqrt(head_dim))");
  if (!m.causal) return Bad("causal", "only causal attention is supported");
  if (m.sliding_window < 0) return Bad("sliding_window", "must be >= 0 (0 = none)");
  if (m.logit_softcap < 0 || !std::isfinite(m.logit_softcap))
    return Bad("logit_softcap", "must be >= 0 (0 = none)");
  if (m.model_dtype != "float16" && m.model_dtype != "bfloat16" && m.model_dtype != "float32")
    return Bad("model_dtype",
               "must be float16, bfloat16 or float32, got '" + ForMessage(m.model_dtype) + "'");
  if (prefill_length <= 0) return Bad("prefill_length", "must be > 0");
  if (num_decode_steps < 0) return Bad("num_decode_steps", "must be >= 0");
  if (source != "synthetic" && source != "captured")
    return Bad("source", "must be 'synthetic' or 'captured', got '" + ForMessage(source) + "'");
  if (std::string issue = PromptEntropyRegionsIssue(prompt_entropy_regions, prefill_length); !issue.empty())
    return Bad("aggregates/prompt_entropy_regions", issue);
  if (!prompt_entropies.empty() && prompt_entropies.size() != static_cast<size_t>(m.num_layers) *
                                                                  prompt_entropy_regions.size() *
                                                                  kNumPromptEntropyKinds * m.num_heads)
    return Bad("prompt_entropies", "must hold num_layers x regions x " +
                                       std::to_string(kNumPromptEntropyKinds) +
                                       " x num_heads values, or none");
  const int64_t t = total_tokens();
  const TokenTable& tk = tokens;
  auto check_len = [&](const char* name, size_t n) -> Status {
    if (static_cast<int64_t>(n) != t)
      return Bad(std::string("tokens/") + name,
                 "has " + std::to_string(n) +
                     " entries, expected prefill_length + num_decode_steps = " + std::to_string(t));
    return Status::Ok();
  };
  KVSIM_RETURN_IF_ERROR(check_len("modality", tk.modality.size()));
  KVSIM_RETURN_IF_ERROR(check_len("segment_id", tk.segment_id.size()));
  KVSIM_RETURN_IF_ERROR(check_len("patch_row", tk.patch_row.size()));
  KVSIM_RETURN_IF_ERROR(check_len("patch_col", tk.patch_col.size()));
  KVSIM_RETURN_IF_ERROR(check_len("position_id", tk.position_id.size()));
  KVSIM_RETURN_IF_ERROR(check_len("phase", tk.phase.size()));
  KVSIM_RETURN_IF_ERROR(check_len("role", tk.role.size()));
  KVSIM_RETURN_IF_ERROR(check_len("token_id", tk.token_id.size()));
  if (!tk.text.empty()) KVSIM_RETURN_IF_ERROR(check_len("text", tk.text.size()));
  for (int64_t i = 0; i < t; ++i) {
    if (static_cast<int>(tk.modality[i]) >= kNumModalities)
      return Bad("tokens/modality", "token " + std::to_string(i) + " has unknown modality code " +
                                        std::to_string(static_cast<int>(tk.modality[i])) +
                                        " (0 text, 1 image, 2 video, 3 other)");
    if (static_cast<int>(tk.role[i]) >= kNumRoles)
      return Bad("tokens/role", "token " + std::to_string(i) + " has unknown role code " +
                                    std::to_string(static_cast<int>(tk.role[i])) +
                                    " (0 system, 1 context, 2 question, 3 generated)");
    if (stream) continue;  // streaming traces: ValidateStream checks phases and roles
    const Phase want = i < prefill_length ? Phase::kPrefill : Phase::kDecode;
    if (tk.phase[i] != want)
      return Bad("tokens/phase", "token " + std::to_string(i) + " is marked " + PhaseName(tk.phase[i]) +
                                     " but prefill_length = " + std::to_string(prefill_length));
    if ((i >= prefill_length) != (tk.role[i] == Role::kGenerated))
      return Bad("tokens/role",
                 "token " + std::to_string(i) + ": role 'generated' must be used exactly for decode tokens");
  }
  if (query_positions.empty())
    return Bad("query_positions", "is empty; at least every decode token's query is required");
  for (size_t i = 0; i < query_positions.size(); ++i) {
    if (query_positions[i] < 0 || query_positions[i] >= t)
      return Bad("query_positions", "entry " + std::to_string(i) + " = " +
                                        std::to_string(query_positions[i]) + " is outside [0, " +
                                        std::to_string(t) + ")");
    if (i > 0 && query_positions[i] <= query_positions[i - 1])
      return Bad("query_positions", "must be strictly ascending (entry " + std::to_string(i) + ")");
  }
  // Every decode token's query must be stored.
  for (int32_t p = prefill_length; p < t; ++p)
    if (QueryIndex(p) < 0)
      return Bad("query_positions",
                 "lacks decode token " + std::to_string(p) + "; every decode step's query is required");
  if (stream) return ValidateStream(*this);
  // The stored prompt queries must be a suffix (the last W prompt tokens) or all of them.
  int n_prompt_q = 0;
  for (int32_t p : query_positions) n_prompt_q += p < prefill_length;
  for (int i = 0; i < n_prompt_q; ++i)
    if (query_positions[i] != prefill_length - n_prompt_q + i)
      return Bad(
          "query_positions",
          "stored prompt queries must be the last W prompt tokens (a contiguous suffix of the prompt)");
  return Status::Ok();
}

MemoryTrace::MemoryTrace(TraceMeta meta, std::vector<LayerData> layers)
    : meta_(std::move(meta)), layers_(std::move(layers)) {
  if (meta_.prompt_entropies.empty() && !meta_.prompt_entropy_regions.empty())
    for (const LayerData& l : layers_)
      meta_.prompt_entropies.insert(meta_.prompt_entropies.end(), l.prompt_entropies.begin(),
                                    l.prompt_entropies.end());
}

void QueryRows::Add(int32_t begin, int32_t end) {
  if (all_ || begin >= end) return;
  // Insert, then merge overlapping or adjacent ranges (a handful of ranges: linear is fine).
  ranges_.emplace_back(begin, end);
  std::sort(ranges_.begin(), ranges_.end());
  std::vector<std::pair<int32_t, int32_t>> merged;
  for (const auto& r : ranges_) {
    if (!merged.empty() && r.first <= merged.back().second)
      merged.back().second = std::max(merged.back().second, r.second);
    else
      merged.push_back(r);
  }
  ranges_ = std::move(merged);
}

bool QueryRows::Contains(int32_t begin, int32_t end) const {
  if (all_ || begin >= end) return true;
  for (const auto& [b, e] : ranges_)
    if (b <= begin && end <= e) return true;  // ranges are non-adjacent: one must hold all of [begin, end)
  return false;
}

std::vector<std::pair<int32_t, int32_t>> QueryRows::Ranges(int32_t num_rows) const {
  if (all_)
    return num_rows > 0 ? std::vector<std::pair<int32_t, int32_t>>{{0, num_rows}}
                        : std::vector<std::pair<int32_t, int32_t>>{};
  std::vector<std::pair<int32_t, int32_t>> out;
  for (const auto& [b, e] : ranges_) {
    const int32_t cb = std::max<int32_t>(b, 0), ce = std::min(e, num_rows);
    if (cb < ce) out.emplace_back(cb, ce);
  }
  return out;
}

int64_t QueryRows::Count(int32_t num_rows) const {
  int64_t n = 0;
  for (const auto& [b, e] : Ranges(num_rows)) n += e - b;
  return n;
}

std::string QueryRows::Text() const {
  if (all_) return "all";
  if (ranges_.empty()) return "none";
  std::string s;
  for (const auto& [b, e] : ranges_)
    s += (s.empty() ? "[" : " [") + std::to_string(b) + ", " + std::to_string(e) + ")";
  return s;
}

const float* LayerData::HeadQueries(const TraceMeta& meta, int head, int32_t begin, int32_t end) const {
  const size_t tq = meta.query_positions.size(), d = meta.model.head_dim;
  KVSIM_CHECK_MSG(head >= 0 && head < meta.model.num_heads && begin >= 0 && end <= static_cast<int64_t>(tq),
                  "query head or rows out of range");
  KVSIM_CHECK_MSG(query_rows.Contains(begin, end),
                  "query rows [" + std::to_string(begin) + ", " + std::to_string(end) + ") of layer " +
                      std::to_string(layer) + " were not read (read: " + query_rows.Text() +
                      "); the replay's ReplayQueryRows must include every row a run uses");
  KVSIM_CHECK(queries.size() == meta.model.num_heads * tq * d);
  return queries.data() + static_cast<size_t>(head) * tq * d;
}

const float* LayerData::QueryRow(const TraceMeta& meta, int head, int32_t qi) const {
  return HeadQueries(meta, head, qi, qi + 1) + static_cast<size_t>(qi) * meta.model.head_dim;
}

Status MemoryTrace::ReadLayer(int layer, LayerData* out, const LayerReadOptions& options) {
  if (layer < 0 || layer >= static_cast<int>(layers_.size()))
    return Status::NotFound("<memory>: layer " + std::to_string(layer) + " not present");
  const LayerData& src = layers_[layer];
  out->layer = src.layer;
  out->keys = src.keys;
  out->values = src.values;
  out->queries = src.queries;
  out->query_rows = options.query_rows;
  out->prefill_column_sums = src.prefill_column_sums;
  out->prompt_entropies = src.prompt_entropies;
  out->blocks.clear();  // block encodings are read with ReadBlockLayer
  return ValidateLayer(meta_, *out, "<memory>");
}

Status TraceSource::ReadBlockLayer(int granularity, int layer, BlockLayerData* out) {
  const TraceMeta& m = meta();
  if (!m.is_streaming())
    return Status::NotFound(Describe() + ": trace has no block encodings for granularity " +
                            std::to_string(granularity) +
                            "; it is not a streaming trace (no /streaming group)");
  std::vector<int> have;
  for (const BlockEncodingInfo& b : m.stream->block_encodings) have.push_back(b.granularity);
  if (!m.stream->FindBlocks(granularity))
    return Status::NotFound(Describe() + ": trace has no block encodings for granularity " +
                            std::to_string(granularity) + "; stored granularities: " + IntList(have) +
                            " (regenerate the trace with this granularity)");
  return Status::FailedPrecondition(
      Describe() + ": trace has no block encodings for granularity " + std::to_string(granularity) +
      "; this trace source cannot read them (layer " + std::to_string(layer) + ")");
}

Status MemoryTrace::ReadBlockLayer(int granularity, int layer, BlockLayerData* out) {
  if (!meta_.is_streaming() || !meta_.stream->FindBlocks(granularity))
    return TraceSource::ReadBlockLayer(granularity, layer, out);
  if (layer < 0 || layer >= static_cast<int>(layers_.size()))
    return Status::NotFound("<memory>: layer " + std::to_string(layer) + " not present");
  for (const BlockLayerData& b : layers_[layer].blocks)
    if (b.granularity == granularity) {
      *out = b;
      return ValidateBlockLayer(meta_, layer, *out, "<memory>");
    }
  return Status::NotFound("<memory>: layer " + std::to_string(layer) +
                          " has no block encodings for granularity " + std::to_string(granularity) +
                          " (write them in LayerData::blocks)");
}

Status MemoryTrace::Begin(const TraceMeta& meta) {
  KVSIM_RETURN_IF_ERROR(meta.Validate());
  meta_ = meta;
  meta_.prompt_entropies.clear();  // filled layer by layer (WriteLayer)
  layers_.clear();
  return Status::Ok();
}

Status MemoryTrace::WriteLayer(const LayerData& layer) {
  if (layer.layer != static_cast<int>(layers_.size()))
    return Status::InvalidArgument("layers must be written in order; got layer " +
                                   std::to_string(layer.layer));
  KVSIM_RETURN_IF_ERROR(ValidateLayer(meta_, layer, "<memory>"));
  KVSIM_RETURN_IF_ERROR(ValidateLayerBlocks(meta_, layer, "<memory>"));
  KVSIM_RETURN_IF_ERROR(CheckLayerPromptEntropies(meta_, layer, "<memory>"));
  layers_.push_back(layer);
  meta_.prompt_entropies.insert(meta_.prompt_entropies.end(), layer.prompt_entropies.begin(),
                                layer.prompt_entropies.end());
  return Status::Ok();
}

Status NonFiniteError(const std::string& where, const char* name, size_t index) {
  return Status::DataLoss(where + " dataset '" + name +
                          "' holds a non-finite value (NaN/Inf) at flat index " + std::to_string(index) +
                          "; the capture or generator produced bad data");
}

namespace {
// Branch-free scan first (vectorises); locate the offending index only when there is one.
// Elements [begin, end) of v are finite; messages give the flat index in v.
Status CheckFinite(const std::string& where, const char* name, const std::vector<float>& v, size_t begin,
                   size_t end) {
  uint32_t bad = 0;
  for (size_t i = begin; i < end; ++i) {
    uint32_t u;
    std::memcpy(&u, &v[i], 4);
    bad |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
  }
  if (!bad) return Status::Ok();
  for (size_t i = begin; i < end; ++i)
    if (!std::isfinite(v[i])) return NonFiniteError(where, name, i);
  return Status::Ok();
}
Status CheckFinite(const std::string& where, const char* name, const std::vector<float>& v) {
  return CheckFinite(where, name, v, 0, v.size());
}
}  // namespace

Status ValidateLayerBlocks(const TraceMeta& meta, const LayerData& layer, const std::string& what) {
  // Sinks store every query row: a layer read with only some rows would write unspecified values.
  if (!layer.query_rows.all())
    return Status::InvalidArgument(
        what + ": layer " + std::to_string(layer.layer) + " holds only query rows " +
        layer.query_rows.Text() +
        "; read it with every query row (LayerReadOptions::query_rows) to write it");
  const size_t want = meta.is_streaming() ? meta.stream->block_encodings.size() : 0;
  if (layer.blocks.size() != want)
    return Status::InvalidArgument(what + ": layer " + std::to_string(layer.layer) + " carries " +
                                   std::to_string(layer.blocks.size()) +
                                   " block encodings, the meta declares " + std::to_string(want) +
                                   " (one per stream->block_encodings entry, same order)");
  for (size_t i = 0; i < want; ++i) {
    if (layer.blocks[i].granularity != meta.stream->block_encodings[i].granularity)
      return Status::InvalidArgument(what + ": layer " + std::to_string(layer.layer) + " blocks[" +
                                     std::to_string(i) + "] has granularity " +
                                     std::to_string(layer.blocks[i].granularity) + ", expected " +
                                     std::to_string(meta.stream->block_encodings[i].granularity));
    KVSIM_RETURN_IF_ERROR(ValidateBlockLayer(meta, layer.layer, layer.blocks[i], what));
  }
  return Status::Ok();
}

Status ValidateBlockLayer(const TraceMeta& meta, int layer, const BlockLayerData& block,
                          const std::string& what) {
  const std::string where =
      what + ": block encodings g" + std::to_string(block.granularity) + " layer " + std::to_string(layer);
  const BlockEncodingInfo* info = meta.is_streaming() ? meta.stream->FindBlocks(block.granularity) : nullptr;
  if (!info)
    return Status::InvalidArgument(where + ": the meta declares no block encodings for this granularity");
  const ModelInfo& m = meta.model;
  if (layer < 0 || layer >= m.num_layers)
    return Status::InvalidArgument(where + ": layer outside [0, " + std::to_string(m.num_layers) + ")");
  const size_t bg = static_cast<size_t>(info->num_blocks) * info->granularity;
  const size_t kv = static_cast<size_t>(m.num_kv_heads) * bg * m.head_dim;
  const std::string kvdims = "[num_kv_heads=" + std::to_string(m.num_kv_heads) +
                             ", B*G=" + std::to_string(bg) + ", head_dim=" + std::to_string(m.head_dim) + "]";
  auto shape = [&](const char* name, size_t got, size_t want, const std::string& dims) -> Status {
    if (got != want)
      return Status::InvalidArgument(where + " dataset '" + name + "' has " + std::to_string(got) +
                                     " elements, expected " + dims + " = " + std::to_string(want));
    return Status::Ok();
  };
  KVSIM_RETURN_IF_ERROR(shape("keys", block.keys.size(), kv, kvdims));
  KVSIM_RETURN_IF_ERROR(shape("values", block.values.size(), kv, kvdims));
  const bool want_att =
      std::binary_search(info->attention_layers.begin(), info->attention_layers.end(), layer);
  if (want_att)
    KVSIM_RETURN_IF_ERROR(
        shape("attention_received", block.attention_received.size(), static_cast<size_t>(m.num_heads) * bg,
              "[num_heads=" + std::to_string(m.num_heads) + ", B*G=" + std::to_string(bg) + "]"));
  else if (!block.attention_received.empty())
    return Status::InvalidArgument(where +
                                   " has attention_received but the layer is not in attention_layers");
  KVSIM_RETURN_IF_ERROR(CheckFinite(where, "keys", block.keys));
  KVSIM_RETURN_IF_ERROR(CheckFinite(where, "values", block.values));
  KVSIM_RETURN_IF_ERROR(CheckFinite(where, "attention_received", block.attention_received));
  return Status::Ok();
}

LayerSizes ExpectedLayerSizes(const TraceMeta& meta) {
  const ModelInfo& m = meta.model;
  return {static_cast<size_t>(m.num_kv_heads) * meta.total_tokens() * m.head_dim,
          static_cast<size_t>(m.num_heads) * meta.query_positions.size() * m.head_dim};
}

Status ValidateLayer(const TraceMeta& meta, const LayerData& layer, const std::string& what,
                     bool check_finite) {
  const ModelInfo& m = meta.model;
  const std::string where = what + ": layer " + std::to_string(layer.layer);
  const size_t t = meta.total_tokens();
  const LayerSizes sizes = ExpectedLayerSizes(meta);
  const size_t kv = sizes.kv, q = sizes.queries;
  auto shape = [&](const char* name, size_t got, size_t want, const std::string& dims) -> Status {
    if (got != want)
      return Status::InvalidArgument(where + " dataset '" + name + "' has " + std::to_string(got) +
                                     " elements, expected " + dims + " = " + std::to_string(want));
    return Status::Ok();
  };
  const std::string kvdims = "[num_kv_heads=" + std::to_string(m.num_kv_heads) + ", T=" + std::to_string(t) +
                             ", head_dim=" + std::to_string(m.head_dim) + "]";
  KVSIM_RETURN_IF_ERROR(shape("keys", layer.keys.size(), kv, kvdims));
  KVSIM_RETURN_IF_ERROR(shape("values", layer.values.size(), kv, kvdims));
  KVSIM_RETURN_IF_ERROR(shape("queries", layer.queries.size(), q,
                              "[num_heads=" + std::to_string(m.num_heads) +
                                  ", Tq=" + std::to_string(meta.query_positions.size()) +
                                  ", head_dim=" + std::to_string(m.head_dim) + "]"));
  if (!layer.prefill_column_sums.empty())
    KVSIM_RETURN_IF_ERROR(shape("prefill_column_sums", layer.prefill_column_sums.size(),
                                static_cast<size_t>(m.num_heads) * meta.prefill_length,
                                "[num_heads, prefill_length]"));
  if (!layer.prompt_entropies.empty())
    KVSIM_RETURN_IF_ERROR(ValidatePromptEntropies(meta, layer.prompt_entropies, where));
  auto finite = [&](const char* name, const std::vector<float>& v) {
    return check_finite ? CheckFinite(where, name, v) : Status::Ok();
  };
  KVSIM_RETURN_IF_ERROR(finite("keys", layer.keys));
  KVSIM_RETURN_IF_ERROR(finite("values", layer.values));
  if (layer.query_rows.all() || !check_finite) {
    KVSIM_RETURN_IF_ERROR(finite("queries", layer.queries));
  } else {  // only the rows read hold data
    const int32_t tq = static_cast<int32_t>(meta.query_positions.size());
    const size_t d = m.head_dim;
    for (int h = 0; h < m.num_heads; ++h)
      for (const auto& [b, e] : layer.query_rows.Ranges(tq))
        KVSIM_RETURN_IF_ERROR(CheckFinite(where, "queries", layer.queries,
                                          (static_cast<size_t>(h) * tq + b) * d,
                                          (static_cast<size_t>(h) * tq + e) * d));
  }
  KVSIM_RETURN_IF_ERROR(finite("prefill_column_sums", layer.prefill_column_sums));
  // A column of attention probabilities: key j is seen by at most n - j prompt queries (causal) or n, each
  // giving it at most 1. Anything outside is not an attention aggregate (policies such as h2o would rank
  // keys by it).
  const int n = meta.prefill_length;
  for (size_t i = 0; i < layer.prefill_column_sums.size(); ++i) {
    const int j = static_cast<int>(i % n);
    const double most = m.causal ? n - j : n, v = layer.prefill_column_sums[i];
    if (v < -1e-3 || v > most * (1 + 1e-3) + 1e-3)
      return Status::InvalidArgument(
          where + " dataset 'prefill_column_sums' holds " + std::to_string(v) + " at head " +
          std::to_string(i / n) + ", key " + std::to_string(j) + ": outside [0, " +
          std::to_string(static_cast<int>(most)) +
          "] (a sum of attention probabilities over the prompt queries that see the "
          "key); re-capture the trace or write it without aggregates");
  }
  return Status::Ok();
}

std::string PromptEntropyRegionsIssue(std::span<const int32_t> regions, int prefill_length) {
  for (size_t i = 0; i < regions.size(); ++i) {
    const int32_t ce = regions[i];
    if (ce < 1 || ce > prefill_length || (i > 0 && ce <= regions[i - 1]))
      return "must be ascending, distinct and in [1, prefill_length = " + std::to_string(prefill_length) +
             "], got " + std::to_string(ce) + " at index " + std::to_string(i);
  }
  return "";
}

Status ValidatePromptEntropies(const TraceMeta& meta, std::span<const double> v, const std::string& where) {
  const ModelInfo& m = meta.model;
  const size_t regions = meta.prompt_entropy_regions.size();
  const size_t per_region = static_cast<size_t>(kNumPromptEntropyKinds) * m.num_heads;
  if (v.size() != regions * per_region)
    return Status::InvalidArgument(where + " dataset 'prompt_entropies' has " + std::to_string(v.size()) +
                                   " elements, expected [regions=" + std::to_string(regions) +
                                   ", kinds=" + std::to_string(kNumPromptEntropyKinds) +
                                   ", num_heads=" + std::to_string(m.num_heads) +
                                   "] = " + std::to_string(regions * per_region));
  // A mean of softmax entropies over at most compress_end keys: in [0, log(compress_end)].
  for (size_t i = 0; i < v.size(); ++i) {
    const double most = std::log(static_cast<double>(meta.prompt_entropy_regions[i / per_region]));
    if (!(v[i] >= 0 && v[i] <= most * (1 + 1e-5) + 1e-6))
      return Status::InvalidArgument(
          where + " dataset 'prompt_entropies' holds " + std::to_string(v[i]) + " at region " +
          std::to_string(i / per_region) + ", kind " + std::to_string(i % per_region / m.num_heads) +
          ", head " + std::to_string(i % m.num_heads) +
          ": outside [0, log(compress_end) = " + std::to_string(most) +
          "] (a mean attention entropy); re-capture the trace or write it without aggregates");
  }
  return Status::Ok();
}

Status CheckLayerPromptEntropies(const TraceMeta& meta, const LayerData& layer, const std::string& what) {
  const bool want = !meta.prompt_entropy_regions.empty();
  if (layer.prompt_entropies.empty() == want)
    return Status::InvalidArgument(
        what + ": layer " + std::to_string(layer.layer) + (want ? " lacks" : " has") +
        " prompt_entropies but meta.prompt_entropy_regions " + (want ? "lists regions" : "is empty") +
        "; every layer must have them, or none, as the meta passed to Begin() says");
  return Status::Ok();
}

std::string TraceIntegrity::Text() const {
  if (!known) return "not a file (no integrity features to check)";
  const std::string counts = "HDF5 superblock v" + std::to_string(superblock_version) + ", Fletcher32 on " +
                             std::to_string(checksummed_datasets) + " of " + std::to_string(datasets) +
                             " datasets, " + std::to_string(variable_length_strings) +
                             " variable-length strings";
  if (checksummed()) return "checksummed (" + counts + "): damaged metadata or data is refused when read";
  return "NOT fully checksummed (" + counts +
         "): a trace written before kvsim checksummed its files, or by another writer; damage can go "
         "undetected. Re-write it with this kvsim (kvsim synth / scripts/kvsim-capture) to protect it";
}

}  // namespace kvsim
