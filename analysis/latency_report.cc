#include "analysis/latency_report.h"

#include <cmath>
#include <cstdio>
#include <sstream>
#include <vector>

#include "sim/perf_model.h"

namespace kvsim {
namespace {

std::string Fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string GiB(double bytes) { return Fmt("%.2f GiB", bytes / (1024.0 * 1024 * 1024)); }

}  // namespace

StatusOr<LatencyReport> ComputeLatencyReport(const LatencyQuery& q) {
  KVSIM_ASSIGN_OR_RETURN(DeviceProfile device, FindDevice(q.device));
  if (q.hbm_gbps != 0) {
    if (!(q.hbm_gbps > 0) || !std::isfinite(q.hbm_gbps))
      return Status::InvalidArgument("--hbm-gbps must be a bandwidth > 0 in GB/s");
    device.set_hbm_bandwidth_gbps(q.hbm_gbps);
  }
  const bool has_model = !q.model.empty();
  const bool has_dims = q.heads != 0 || q.kv_heads != 0 || q.head_dim != 0;
  if (has_model == has_dims)
    return Status::InvalidArgument(
        "give either --model PRESET or all of --heads H --kv-heads K --head-dim D (kvsim latency --list)");
  ModelShape m;
  if (has_model) {
    KVSIM_ASSIGN_OR_RETURN(m, FindModelShape(q.model));
  } else {
    if (q.heads <= 0 || q.kv_heads <= 0 || q.head_dim <= 0)
      return Status::InvalidArgument("--heads, --kv-heads and --head-dim must all be integers >= 1");
    if (q.heads % q.kv_heads != 0)
      return Status::InvalidArgument("--kv-heads " + std::to_string(q.kv_heads) + " must divide --heads " +
                                     std::to_string(q.heads) + " (GQA groups of equal size)");
    m.set_name("custom");
    m.set_num_layers(1);
    m.set_num_heads(q.heads);
    m.set_num_kv_heads(q.kv_heads);
    m.set_head_dim(q.head_dim);
  }
  if (q.kv_length <= 0)
    return Status::InvalidArgument("--kv-length must be >= 1 (KV tokens per head); got " +
                                   std::to_string(q.kv_length));
  if (q.batch <= 0) return Status::InvalidArgument("--batch must be >= 1; got " + std::to_string(q.batch));
  if (q.prompt_tokens < 0) return Status::InvalidArgument("--prompt-tokens must be >= 1");
  if (q.prompt_tokens > 0 && !has_model)
    return Status::InvalidArgument("--prompt-tokens needs --model (prefill runs the whole model)");

  const PerfModel perf(device);
  LatencyReport r;
  r.set_source("modelled: kvsim performance model of " + device.name() +
               " (docs/latency.md; calibrated on published measurements, not measured)");
  r.set_device(device.name());
  r.set_model(m.name());
  r.set_num_heads(m.num_heads());
  r.set_num_kv_heads(m.num_kv_heads());
  r.set_head_dim(m.head_dim());
  r.set_kv_length(q.kv_length);
  r.set_batch(q.batch);
  r.set_hbm_bandwidth_gbps(device.hbm_bandwidth_gbps());
  const int kv_bytes = 2;  // fp16 KV
  const double per_layer =
      static_cast<double>(q.batch) * m.num_kv_heads() * q.kv_length * KvBytesPerToken(m.head_dim(), kv_bytes);
  r.set_kv_bytes_per_layer(per_layer);
  const double kv_total = per_layer * m.num_layers();
  double weights = 0;
  if (has_model) {
    const double h = m.hidden_size(), qd = static_cast<double>(m.num_heads()) * m.head_dim();
    const double kvd = static_cast<double>(m.num_kv_heads()) * m.head_dim();
    weights = (m.num_layers() * (h * (qd + 2 * kvd) + qd * h + 3.0 * h * m.intermediate_size()) +
               2.0 * h * m.vocab_size()) *
              m.dtype_bytes();
    r.set_weight_bytes(weights);
    r.set_kv_cache_bytes(kv_total);
  }
  if (weights + kv_total > device.memory_bytes())
    return Status::InvalidArgument(
        "the shape does not fit in " + device.name() + "'s " + GiB(device.memory_bytes()) + ": " +
        (has_model ? "weights " + GiB(weights) + " + " : std::string()) + "KV cache " + GiB(kv_total) +
        " (batch " + std::to_string(q.batch) + " x " + std::to_string(q.kv_length) +
        " tokens); lower --batch or --kv-length");

  const std::vector<int> heads(static_cast<size_t>(q.batch) * m.num_kv_heads(), q.kv_length);
  const int group = m.num_heads() / m.num_kv_heads();
  for (const StreamingKernel& k : device.kernels()) {
    if (k.name() == "gemv") continue;
    const KernelCost c = perf.DecodeAttention(heads, group, m.head_dim(), kv_bytes, k, false);
    KernelEstimate* e = r.add_kernels();
    e->set_kernel(k.name());
    e->set_us(c.us);
    e->set_work_units(c.units);
    e->set_bandwidth_fraction(per_layer / perf.PeakBytesPerUs() / c.us);
  }
  r.set_attention_us(r.kernels(0).us());
  r.set_attention_bandwidth_fraction(r.kernels(0).bandwidth_fraction());
  if (has_model) {
    const std::vector<int> lengths(static_cast<size_t>(m.num_layers()) * m.num_kv_heads(), q.kv_length);
    const DecodeStepCost s = perf.DecodeStep(m, q.batch, lengths);
    r.set_decode_step_ms(s.total_us / 1e3);
    r.set_decode_attention_ms(s.attention_us / 1e3);
    r.set_decode_weights_ms(s.weights_us / 1e3);
    r.set_decode_other_ms(s.other_us / 1e3);
    r.set_decode_bytes(s.bytes);
    r.set_decode_floor_ms(s.bytes / perf.PeakBytesPerUs() / 1e3);
    r.set_decode_kernels(s.kernels);
    if (q.prompt_tokens > 0) {
      const PrefillCost p = perf.Prefill(m, q.batch, q.prompt_tokens, 0);
      r.set_prompt_tokens(q.prompt_tokens);
      r.set_prefill_ms(p.total_us / 1e3);
      r.set_prefill_gemm_ms(p.gemm_us / 1e3);
      r.set_prefill_attention_ms(p.attention_us / 1e3);
    }
  }
  return r;
}

std::string LatencyReportText(const LatencyReport& r) {
  std::ostringstream os;
  os << "MODELLED (" << r.source() << ")\n";
  os << r.device() << " (peak " << r.hbm_bandwidth_gbps() << " GB/s), " << r.model() << ": " << r.num_heads()
     << " heads / " << r.num_kv_heads() << " KV heads, head_dim " << r.head_dim() << ", batch " << r.batch()
     << ", KV length " << r.kv_length() << " (fp16 KV, " << Fmt("%.1f", r.kv_bytes_per_layer() / 1e6)
     << " MB per layer)\n\n";
  os << "decode attention, one layer, one call timed alone:\n";
  os << "  kernel               us    work units  bandwidth (of peak)\n";
  for (const KernelEstimate& k : r.kernels())
    os << "  " << k.kernel() << std::string(k.kernel().size() < 18 ? 18 - k.kernel().size() : 1, ' ')
       << Fmt("%8.2f", k.us()) << Fmt("%12.0f", k.work_units())
       << Fmt("%12.1f%%", 100 * k.bandwidth_fraction()) << "\n";
  if (r.has_decode_step_ms()) {
    os << "\nwhole model, one output token (CUDA-graph decode step, " << r.decode_kernels() << " kernels):\n";
    os << Fmt("  decode_step_ms %.3f", r.decode_step_ms())
       << Fmt(" = attention %.3f", r.decode_attention_ms()) << Fmt(" + weights %.3f", r.decode_weights_ms())
       << Fmt(" + other %.3f", r.decode_other_ms()) << "\n";
    os << Fmt("  bytes moved %.3f GB", r.decode_bytes() / 1e9) << Fmt(", floor %.3f ms", r.decode_floor_ms())
       << Fmt(" (%.1f%% of the floor's speed)", 100 * r.decode_floor_ms() / r.decode_step_ms()) << "\n";
    os << Fmt("  weights %.2f GB", r.weight_bytes() / 1e9)
       << Fmt(", KV cache %.2f GB", r.kv_cache_bytes() / 1e9) << "\n";
  }
  if (r.has_prefill_ms())
    os << "\nprefill of " << r.prompt_tokens()
       << " tokens (time to first token): " << Fmt("%.2f ms", r.prefill_ms())
       << Fmt(" (GEMMs %.2f", r.prefill_gemm_ms())
       << Fmt(", attention %.2f; assumed efficiencies, not validated)", r.prefill_attention_ms()) << "\n";
  return os.str();
}

}  // namespace kvsim
