#include "sim/perf_model.h"

#include <google/protobuf/text_format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <memory>
#include <numeric>

#include "sim/embedded_configs.h"
#include "sim/text_proto.h"

namespace kvsim {
namespace {

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

template <typename Proto>
std::vector<Proto> ParseEmbedded(const std::vector<EmbeddedConfig>& files) {
  std::vector<Proto> out;
  for (const EmbeddedConfig& f : files) {
    Proto p;
    // The embedded files are checked by tests (perf_model_test); a broken one is a build defect.
    if (!google::protobuf::TextFormat::ParseFromString(std::string(f.text), &p)) std::abort();
    out.push_back(std::move(p));
  }
  return out;
}

const std::vector<DeviceProfile>& BuiltinDevices() {
  static const auto* devices =
      new std::vector<DeviceProfile>(ParseEmbedded<DeviceProfile>(EmbeddedDevices()));
  return *devices;
}

const std::vector<ModelShape>& BuiltinModels() {
  static const auto* models = new std::vector<ModelShape>(ParseEmbedded<ModelShape>(EmbeddedModels()));
  return *models;
}

template <typename Proto>
const Proto* FindByName(const std::vector<Proto>& all, const std::string& name) {
  const std::string n = Lower(name);
  for (const Proto& p : all) {
    if (Lower(p.name()) == n) return &p;
    for (const std::string& a : p.aliases())
      if (Lower(a) == n) return &p;
  }
  return nullptr;
}

bool LooksLikeFile(const std::string& s) {
  return s.find('/') != std::string::npos || s.ends_with(".textproto") || s.ends_with(".txtpb");
}

bool Positive(double v) { return std::isfinite(v) && v > 0; }

}  // namespace

StatusOr<DeviceProfile> FindDevice(const std::string& name) {
  DeviceProfile d;
  if (LooksLikeFile(name)) {
    KVSIM_RETURN_IF_ERROR(ParseTextProtoFile(name, &d));
    KVSIM_RETURN_IF_ERROR(CheckDevice(d, name));
    return d;
  }
  if (const DeviceProfile* p = FindByName(BuiltinDevices(), name)) return *p;
  return Status::InvalidArgument("unknown device '" + name + "'; use one of " + JoinNames(DeviceNames()) +
                                 " or a device profile file (configs/devices/*.textproto)");
}

StatusOr<ModelShape> FindModelShape(const std::string& name) {
  ModelShape m;
  if (LooksLikeFile(name)) {
    KVSIM_RETURN_IF_ERROR(ParseTextProtoFile(name, &m));
    KVSIM_RETURN_IF_ERROR(CheckModelShape(m, name));
    return m;
  }
  if (const ModelShape* p = FindByName(BuiltinModels(), name)) return *p;
  return Status::InvalidArgument("unknown model preset '" + name + "'; use one of " +
                                 JoinNames(ModelPresetNames()) +
                                 " or a model shape file (configs/models/*.textproto)");
}

std::string JoinNames(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

std::vector<std::string> DeviceNames() {
  std::vector<std::string> out;
  for (const DeviceProfile& d : BuiltinDevices()) out.push_back(d.aliases_size() ? d.aliases(0) : d.name());
  return out;
}

std::vector<std::string> ModelPresetNames() {
  std::vector<std::string> out;
  for (const ModelShape& m : BuiltinModels()) out.push_back(m.name());
  return out;
}

const ModelShape* ModelPresetFor(const std::string& trace_model_name) {
  return FindByName(BuiltinModels(), trace_model_name);
}

Status CheckDevice(const DeviceProfile& d, const std::string& where) {
  auto bad = [&](const std::string& field, const std::string& what) {
    return Status::InvalidArgument(where + ": field '" + field + "' " + what);
  };
  if (d.name().empty()) return bad("name", "is missing");
  const std::pair<const char*, double> positive[] = {
      {"hbm_bandwidth_gbps", d.hbm_bandwidth_gbps()},
      {"sm_count", static_cast<double>(d.sm_count())},
      {"tensor_tflops", d.tensor_tflops()},
      {"memory_bytes", d.memory_bytes()},
      {"unit_bandwidth_share", d.unit_bandwidth_share()},
      {"graph_kernel_us", d.graph_kernel_us()},
      {"gemm_efficiency", d.gemm_efficiency()},
      {"prefill_attention_efficiency", d.prefill_attention_efficiency()}};
  for (const auto& [field, v] : positive)
    if (!Positive(v)) return bad(field, "must be set to a finite number > 0");
  if (d.gemm_efficiency() > 1 || d.prefill_attention_efficiency() > 1)
    return bad(d.gemm_efficiency() > 1 ? "gemm_efficiency" : "prefill_attention_efficiency",
               "is a fraction of the peak and must be <= 1");
  if (d.kernels().empty()) return bad("kernels", "is empty; list the decode attention kernel first");
  bool gemv = false;
  for (int i = 0; i < d.kernels_size(); ++i) {
    const StreamingKernel& k = d.kernels(i);
    const std::string f = "kernels[" + std::to_string(i) + "].";
    if (k.name().empty()) return bad(f + "name", "is missing");
    gemv |= k.name() == "gemv";
    if (!Positive(k.efficiency_max()) || k.efficiency_max() > 1)
      return bad(f + "efficiency_max", "must be in (0, 1]");
    if (!Positive(k.half_efficiency_bytes())) return bad(f + "half_efficiency_bytes", "must be > 0");
    if (!Positive(k.efficiency_hill())) return bad(f + "efficiency_hill", "must be > 0");
    if (!(k.launch_us() >= 0) || !std::isfinite(k.launch_us())) return bad(f + "launch_us", "must be >= 0");
    if (k.min_chunk_tokens() < 0) return bad(f + "min_chunk_tokens", "must be >= 0 (0 = no split)");
    if (k.min_chunk_tokens() > 0 && !Positive(k.target_units_per_sm()))
      return bad(f + "target_units_per_sm", "must be > 0 for a split kernel");
  }
  if (!gemv) return bad("kernels", "has no kernel named \"gemv\" (weight streaming)");
  return Status::Ok();
}

Status CheckModelShape(const ModelShape& m, const std::string& where) {
  auto bad = [&](const std::string& field, const std::string& what) {
    return Status::InvalidArgument(where + ": field '" + field + "' " + what);
  };
  if (m.name().empty()) return bad("name", "is missing");
  const std::pair<const char*, int> positive[] = {
      {"num_layers", m.num_layers()},        {"num_heads", m.num_heads()},
      {"num_kv_heads", m.num_kv_heads()},    {"head_dim", m.head_dim()},
      {"hidden_size", m.hidden_size()},      {"intermediate_size", m.intermediate_size()},
      {"vocab_size", m.vocab_size()},        {"dtype_bytes", m.dtype_bytes()},
      {"kv_dtype_bytes", m.kv_dtype_bytes()}};
  for (const auto& [field, v] : positive)
    if (v <= 0) return bad(field, "must be set to an integer > 0");
  if (m.num_heads() % m.num_kv_heads() != 0)
    return bad("num_kv_heads", "must divide num_heads (" + std::to_string(m.num_heads()) + ")");
  return Status::Ok();
}

PerfModel::PerfModel(DeviceProfile device) : d_(std::move(device)) {
  for (const StreamingKernel& k : d_.kernels())
    if (k.name() == "gemv") gemv_ = &k;
}

const StreamingKernel* PerfModel::Kernel(const std::string& name) const {
  for (const StreamingKernel& k : d_.kernels())
    if (k.name() == name) return &k;
  return nullptr;
}

double PerfModel::Efficiency(const StreamingKernel& k, double bytes) const {
  if (bytes <= 0) return k.efficiency_max();
  return k.efficiency_max() / (1 + std::pow(k.half_efficiency_bytes() / bytes, k.efficiency_hill()));
}

double PerfModel::FluidUs(const StreamingKernel& k, std::vector<double> unit_bytes) const {
  std::sort(unit_bytes.begin(), unit_bytes.end());
  const double total = std::accumulate(unit_bytes.begin(), unit_bytes.end(), 0.0);
  if (total <= 0) return 0;
  const double aggregate = PeakBytesPerUs() * Efficiency(k, total);
  const double per_sm = d_.unit_bandwidth_share() * PeakBytesPerUs() / d_.sm_count();
  // Processor sharing: while `active` units remain, each streams at min(aggregate, per_sm * busy SMs) /
  // active; the smallest remaining unit finishes first.
  double t = 0, done = 0;
  const size_t w = unit_bytes.size();
  for (size_t j = 0; j < w; ++j) {
    const double active = static_cast<double>(w - j);
    const double rate = std::min(aggregate, per_sm * std::min<double>(active, d_.sm_count())) / active;
    t += (unit_bytes[j] - done) / rate;
    done = unit_bytes[j];
  }
  return t;
}

KernelCost PerfModel::DecodeAttention(std::span<const int> kv_lengths, int group, int head_dim,
                                      int kv_dtype_bytes, const StreamingKernel& k, bool in_graph) const {
  KernelCost c;
  c.kernels = 1;
  const double per_token = KvBytesPerToken(head_dim, kv_dtype_bytes);
  const double total_tokens = std::accumulate(kv_lengths.begin(), kv_lengths.end(), 0.0);
  // Split-KV: one chunk size for every head, at least min_chunk_tokens, aiming at target units.
  double chunk = 0;
  if (k.min_chunk_tokens() > 0) {
    const double target = std::max(1.0, k.target_units_per_sm() * d_.sm_count());
    chunk = std::max<double>(k.min_chunk_tokens(), std::ceil(total_tokens / target));
  }
  std::vector<double> units;
  bool split = false;
  for (int len : kv_lengths) {
    if (len <= 0) continue;
    const int pieces = chunk > 0 ? static_cast<int>(std::ceil(len / chunk)) : 1;
    split |= pieces > 1;
    for (int p = 0; p < pieces; ++p) {
      const double tokens = pieces == 1 ? len : std::min(chunk, len - p * chunk);
      units.push_back(tokens * per_token);
    }
  }
  c.units = static_cast<int>(units.size());
  c.bytes = total_tokens * per_token;
  c.flops = 4.0 * group * head_dim * total_tokens;  // q.k and p.v for each query head of the group
  const double compute_us = c.flops / (d_.tensor_tflops() * 1e6 * d_.gemm_efficiency());
  c.us = FixedUs(k, in_graph) + std::max(FluidUs(k, std::move(units)), compute_us);
  if (split && k.merge_kernel()) {
    // Partial outputs (value row + max + sum, fp32) written by the splits and read by the merge.
    const double partial = 2.0 * c.units * group * (head_dim + 2) * 4.0;
    c.us += FixedUs(k, in_graph) + partial / (PeakBytesPerUs() * Efficiency(k, partial));
    c.bytes += partial;
    c.kernels = 2;
  }
  return c;
}

KernelCost PerfModel::Gemv(double rows, double cols, int batch, int dtype_bytes, bool in_graph) const {
  KernelCost c;
  c.kernels = 1;
  c.bytes = rows * cols * dtype_bytes + static_cast<double>(batch) * (rows + cols) * dtype_bytes;
  c.flops = 2.0 * rows * cols * batch;
  const double stream = c.bytes / (PeakBytesPerUs() * Efficiency(*gemv_, c.bytes));
  const double compute = c.flops / (d_.tensor_tflops() * 1e6 * d_.gemm_efficiency());
  c.us = FixedUs(*gemv_, in_graph) + std::max(stream, compute);
  return c;
}

KernelCost PerfModel::Gemm(double flops, double bytes) const {
  KernelCost c;
  c.kernels = 1;
  c.bytes = bytes;
  c.flops = flops;
  const double stream = bytes / (PeakBytesPerUs() * Efficiency(*gemv_, bytes));
  c.us = d_.graph_kernel_us() + std::max(stream, flops / (d_.tensor_tflops() * 1e6 * d_.gemm_efficiency()));
  return c;
}

KernelCost PerfModel::Elementwise(double bytes, bool in_graph) const {
  KernelCost c;
  c.kernels = 1;
  c.bytes = bytes;
  c.us = FixedUs(*gemv_, in_graph) + (bytes > 0 ? bytes / (PeakBytesPerUs() * Efficiency(*gemv_, bytes)) : 0);
  return c;
}

DecodeStepCost PerfModel::DecodeStep(const ModelShape& m, int batch, std::span<const int> lengths) const {
  DecodeStepCost s;
  const double hidden = m.hidden_size(), dt = m.dtype_bytes(), n = batch;
  const double q = static_cast<double>(m.num_heads()) * m.head_dim();
  const double kv = static_cast<double>(m.num_kv_heads()) * m.head_dim();
  const int hkv = m.num_kv_heads(), group = m.num_heads() / m.num_kv_heads();
  auto add = [&](const KernelCost& c, double* part) {
    *part += c.us;
    s.bytes += c.bytes;
    s.kernels += c.kernels;
  };
  std::vector<int> heads(static_cast<size_t>(batch) * hkv);
  for (int l = 0; l < m.num_layers(); ++l) {
    add(Elementwise(2 * n * hidden * dt, true), &s.other_us);                    // RMSNorm (+ residual)
    add(Gemv(hidden, q + 2 * kv, batch, m.dtype_bytes(), true), &s.weights_us);  // QKV
    add(Elementwise(2 * n * (q + 2 * kv) * dt, true), &s.other_us);              // RoPE + KV append
    for (int b = 0; b < batch; ++b)
      for (int u = 0; u < hkv; ++u)
        heads[static_cast<size_t>(b) * hkv + u] = lengths[static_cast<size_t>(l) * hkv + u];
    add(DecodeAttention(heads, group, m.head_dim(), m.kv_dtype_bytes(), AttentionKernel(), true),
        &s.attention_us);
    add(Gemv(q, hidden, batch, m.dtype_bytes(), true), &s.weights_us);  // O
    add(Elementwise(2 * n * hidden * dt, true), &s.other_us);           // RMSNorm (+ residual)
    add(Gemv(hidden, 2.0 * m.intermediate_size(), batch, m.dtype_bytes(), true), &s.weights_us);  // gate, up
    add(Elementwise(3 * n * m.intermediate_size() * dt, true), &s.other_us);                      // SiLU * up
    add(Gemv(m.intermediate_size(), hidden, batch, m.dtype_bytes(), true), &s.weights_us);        // down
  }
  add(Elementwise(2 * n * hidden * dt, true), &s.other_us);                        // final norm
  add(Gemv(hidden, m.vocab_size(), batch, m.dtype_bytes(), true), &s.weights_us);  // LM head
  add(Elementwise(n * m.vocab_size() * 4.0, true), &s.other_us);                   // sampling
  s.total_us = s.attention_us + s.weights_us + s.other_us;
  return s;
}

PrefillCost PerfModel::Prefill(const ModelShape& m, int batch, int tokens, int cached) const {
  PrefillCost p;
  const double hidden = m.hidden_size(), dt = m.dtype_bytes(), rows = static_cast<double>(batch) * tokens;
  const double q = static_cast<double>(m.num_heads()) * m.head_dim();
  const double kv = static_cast<double>(m.num_kv_heads()) * m.head_dim();
  auto gemm = [&](double in, double out) {
    const KernelCost c = Gemm(2 * rows * in * out, in * out * dt + rows * (in + out) * dt);
    p.gemm_us += c.us;
    p.flops += c.flops;
    ++p.kernels;
  };
  auto elem = [&](double bytes) {
    p.other_us += Elementwise(bytes, true).us;
    ++p.kernels;
  };
  // Causal flash attention: each new token attends to the cached tokens and the new ones up to itself.
  const double pairs = static_cast<double>(tokens) * cached + 0.5 * tokens * (tokens + 1.0);
  const double attn_flops = 4.0 * batch * m.num_heads() * m.head_dim() * pairs;
  for (int l = 0; l < m.num_layers(); ++l) {
    elem(2 * rows * hidden * dt);
    gemm(hidden, q + 2 * kv);
    elem(2 * rows * (q + 2 * kv) * dt);
    p.attention_us +=
        d_.graph_kernel_us() + attn_flops / (d_.tensor_tflops() * 1e6 * d_.prefill_attention_efficiency());
    p.flops += attn_flops;
    ++p.kernels;
    gemm(q, hidden);
    elem(2 * rows * hidden * dt);
    gemm(hidden, 2.0 * m.intermediate_size());
    elem(3 * rows * m.intermediate_size() * dt);
    gemm(m.intermediate_size(), hidden);
  }
  elem(2.0 * batch * hidden * dt);
  const KernelCost head = Gemv(hidden, m.vocab_size(), batch, m.dtype_bytes(), true);
  p.gemm_us += head.us;
  p.flops += head.flops;
  ++p.kernels;
  p.total_us = p.gemm_us + p.attention_us + p.other_us;
  return p;
}

KernelCost PerfModel::PolicyWork(const ModelShape& m, const PolicyGpuWork& w, int prompt_tokens,
                                 std::span<const int> lengths, bool per_step) const {
  KernelCost total;
  auto add = [&](const KernelCost& c) {
    total.us += c.us;
    total.bytes += c.bytes;
    total.flops += c.flops;
    total.kernels += c.kernels;
  };
  const int hkv = m.num_kv_heads(), h = m.num_heads(), d = m.head_dim();
  const double per_token = KvBytesPerToken(d, m.kv_dtype_bytes()), n = prompt_tokens;
  for (int l = 0; l < m.num_layers(); ++l) {
    double slots = 0;
    for (int u = 0; u < hkv; ++u) slots += lengths[static_cast<size_t>(l) * hkv + u];
    if (per_step) {
      if (w.decode_scores) {
        add(Elementwise(2 * 4.0 * slots * (h / hkv), true));  // the step's weights written, then read
        add(Elementwise(4.0 * slots, true));                  // the slot to evict (arg-min per head)
      }
      continue;
    }
    bool scored = false;
    if (w.window > 0) {  // window queries x every prompt key, softmax, pooling
      const double flops = 2.0 * w.window * n * d * h;
      add(Gemm(flops, n * d * m.kv_dtype_bytes() * hkv + 4.0 * n * h));
      scored = true;
    }
    if (w.all_query_scores) {  // every prompt query x its causal keys, weights materialised
      KernelCost c;
      c.kernels = 1;
      c.flops = 2.0 * d * h * 0.5 * n * (n + 1);
      c.us = d_.graph_kernel_us() + c.flops / (d_.tensor_tflops() * 1e6 * d_.prefill_attention_efficiency());
      add(c);
      scored = true;
    }
    if (scored) add(Elementwise(4.0 * n * hkv, true));  // top-k over the scores
    const double evicted = std::max(0.0, n * hkv - slots);
    if (w.merge && evicted > 0) {  // nearest kept slot of every evicted key (a GEMM + arg-max), then sums
      const double kept = slots / hkv, e = evicted / hkv;
      add(Gemm(2.0 * e * kept * d * hkv, n * per_token * hkv));
      add(Elementwise(2 * slots * per_token, true));
    }
    if (evicted > 0) add(Elementwise(2 * slots * per_token, true));  // compaction of the kept slots
  }
  return total;
}

}  // namespace kvsim
