#include "sim/trace.h"

#include <algorithm>
#include <cmath>
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

namespace {
Status Bad(const std::string& field, const std::string& what) {
  return Status::InvalidArgument("field '" + field + "': " + what);
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
    return Bad("model_dtype", "must be float16, bfloat16 or float32, got '" + m.model_dtype + "'");
  if (prefill_length <= 0) return Bad("prefill_length", "must be > 0");
  if (num_decode_steps < 0) return Bad("num_decode_steps", "must be >= 0");
  if (source != "synthetic" && source != "captured")
    return Bad("source", "must be 'synthetic' or 'captured', got '" + source + "'");
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

Status MemoryTrace::ReadLayer(int layer, LayerData* out) {
  if (layer < 0 || layer >= static_cast<int>(layers_.size()))
    return Status::NotFound("<memory>: layer " + std::to_string(layer) + " not present");
  *out = layers_[layer];
  return ValidateLayer(meta_, *out, "<memory>");
}

Status MemoryTrace::Begin(const TraceMeta& meta) {
  KVSIM_RETURN_IF_ERROR(meta.Validate());
  meta_ = meta;
  layers_.clear();
  return Status::Ok();
}

Status MemoryTrace::WriteLayer(const LayerData& layer) {
  if (layer.layer != static_cast<int>(layers_.size()))
    return Status::InvalidArgument("layers must be written in order; got layer " +
                                   std::to_string(layer.layer));
  KVSIM_RETURN_IF_ERROR(ValidateLayer(meta_, layer, "<memory>"));
  layers_.push_back(layer);
  return Status::Ok();
}

Status ValidateLayer(const TraceMeta& meta, const LayerData& layer, const std::string& what) {
  const ModelInfo& m = meta.model;
  const std::string where = what + ": layer " + std::to_string(layer.layer);
  const size_t t = meta.total_tokens();
  const size_t kv = static_cast<size_t>(m.num_kv_heads) * t * m.head_dim;
  const size_t q = static_cast<size_t>(m.num_heads) * meta.query_positions.size() * m.head_dim;
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
  auto finite = [&](const char* name, const std::vector<float>& v) -> Status {
    // Branch-free scan first (vectorises); locate the offending index only when there is one.
    uint32_t bad = 0;
    for (float x : v) {
      uint32_t u;
      std::memcpy(&u, &x, 4);
      bad |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
    }
    if (!bad) return Status::Ok();
    for (size_t i = 0; i < v.size(); ++i)
      if (!std::isfinite(v[i]))
        return Status::DataLoss(where + " dataset '" + name +
                                "' holds a non-finite value (NaN/Inf) at flat index " + std::to_string(i) +
                                "; the capture or generator produced bad data");
    return Status::Ok();
  };
  KVSIM_RETURN_IF_ERROR(finite("keys", layer.keys));
  KVSIM_RETURN_IF_ERROR(finite("values", layer.values));
  KVSIM_RETURN_IF_ERROR(finite("queries", layer.queries));
  KVSIM_RETURN_IF_ERROR(finite("prefill_column_sums", layer.prefill_column_sums));
  return Status::Ok();
}

}  // namespace kvsim
