#include "gpu_replay/harness.h"

#include <dlfcn.h>
#include <google/protobuf/text_format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "sim/stats.h"

namespace kvsim::gpu_replay {

TimingSummary Summarize(std::vector<double> s) {
  TimingSummary t;
  t.samples = static_cast<int>(s.size());
  if (s.empty()) return t;
  std::sort(s.begin(), s.end());
  t.median = SortedQuantile(s, 0.5);
  t.p10 = SortedQuantile(s, 0.1);
  t.p90 = SortedQuantile(s, 0.9);
  t.min = s.front();
  t.mean = Mean(s);
  return t;
}

namespace {

// Non-negative least squares for y = a + b x.
Status FitLine(std::span<const LatencyPoint> pts, const std::string& what, double* a, double* b) {
  if (pts.size() < 2)
    return Status::InvalidArgument(what + ": need at least 2 measured points to fit a line");
  double mx = 0, my = 0;
  for (const auto& p : pts) {
    if (!std::isfinite(p.x) || !std::isfinite(p.us) || p.x < 0 || p.us < 0)
      return Status::InvalidArgument(what + ": measured points must be finite and >= 0");
    mx += p.x;
    my += p.us;
  }
  mx /= pts.size();
  my /= pts.size();
  double sxx = 0, sxy = 0;
  for (const auto& p : pts) {
    sxx += (p.x - mx) * (p.x - mx);
    sxy += (p.x - mx) * (p.us - my);
  }
  if (sxx <= 0) return Status::InvalidArgument(what + ": all points have the same x; measure several sizes");
  *b = sxy / sxx;
  *a = my - *b * mx;
  if (*b < 0) {
    *b = 0;
    *a = my;
  } else if (*a < 0) {
    double xx = 0, xy = 0;
    for (const auto& p : pts) {
      xx += p.x * p.x;
      xy += p.x * p.us;
    }
    *a = 0;
    *b = xx > 0 ? xy / xx : 0;
  }
  return Status::Ok();
}

}  // namespace

StatusOr<LatencyModelProto> FitLatencyModel(std::span<const LatencyPoint> decode,
                                            std::span<const LatencyPoint> prefill,
                                            const std::string& fitted_on) {
  LatencyModelProto m;
  double a = 0, b = 0;
  KVSIM_RETURN_IF_ERROR(FitLine(decode, "decode latency fit", &a, &b));
  m.set_decode_base_us(a);
  m.set_decode_us_per_kv_token(b);
  std::string desc = "fitted by kvsim_replay_gpu: decode step vs mean per-head KV length (" +
                     std::to_string(decode.size()) + " points)";
  if (!prefill.empty()) {
    KVSIM_RETURN_IF_ERROR(FitLine(prefill, "prefill latency fit", &a, &b));
    m.set_prefill_base_us(a);
    m.set_prefill_us_per_token(b);
    desc += "; prefill vs prompt tokens (" + std::to_string(prefill.size()) + " points)";
  } else {
    desc += "; prefill not measured (0)";
  }
  m.set_description(desc);
  m.set_fitted_on(fitted_on);
  return m;
}

std::string LatencyModelText(const LatencyModelProto& model) {
  std::string out;
  google::protobuf::TextFormat::Printer printer;
  printer.PrintToString(model, &out);
  return "# LatencyModelProto (sim/latency_model.proto); use with kvsim run/sweep --latency-model\n" + out;
}

// ---- NVML through dlopen: the handful of entry points we use, declared here (no nvml.h needed) ----
namespace {
using nvmlReturn_t = int;
using nvmlDevice_t = void*;
constexpr int kNvmlClockSm = 1, kNvmlClockMem = 2, kNvmlTemperatureGpu = 0;
}  // namespace

NvmlReading ReadNvml(int device_index) {
  NvmlReading r;
  static void* lib = dlopen("libnvidia-ml.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (!lib) {
    r.why = "libnvidia-ml.so.1 not found";
    return r;
  }
  auto sym = [&](const char* name) { return dlsym(lib, name); };
  auto init = reinterpret_cast<nvmlReturn_t (*)()>(sym("nvmlInit_v2"));
  auto by_index =
      reinterpret_cast<nvmlReturn_t (*)(unsigned, nvmlDevice_t*)>(sym("nvmlDeviceGetHandleByIndex_v2"));
  auto clock =
      reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, int, unsigned*)>(sym("nvmlDeviceGetClockInfo"));
  auto max_clock =
      reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, int, unsigned*)>(sym("nvmlDeviceGetMaxClockInfo"));
  auto power = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, unsigned*)>(sym("nvmlDeviceGetPowerUsage"));
  auto temp =
      reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, int, unsigned*)>(sym("nvmlDeviceGetTemperature"));
  if (!init || !by_index || !clock) {
    r.why = "libnvidia-ml.so.1 lacks the expected symbols";
    return r;
  }
  static const nvmlReturn_t init_rc = init();
  if (init_rc != 0) {
    r.why = "nvmlInit failed (code " + std::to_string(init_rc) + ")";
    return r;
  }
  nvmlDevice_t dev = nullptr;
  // NVML indexes devices by PCI order, CUDA by speed unless CUDA_DEVICE_ORDER=PCI_BUS_ID: documented.
  if (by_index(static_cast<unsigned>(device_index), &dev) != 0) {
    r.why = "nvmlDeviceGetHandleByIndex failed";
    return r;
  }
  clock(dev, kNvmlClockSm, &r.sm_clock_mhz);
  clock(dev, kNvmlClockMem, &r.mem_clock_mhz);
  if (max_clock) max_clock(dev, kNvmlClockSm, &r.max_sm_clock_mhz);
  unsigned mw = 0;
  if (power && power(dev, &mw) == 0) r.power_w = mw / 1000.0;
  if (temp) temp(dev, kNvmlTemperatureGpu, &r.temperature_c);
  r.ok = true;
  return r;
}

double LowerBoundUs(double bytes, double gb_per_s) {
  return gb_per_s > 0 ? bytes / (gb_per_s * 1e9) * 1e6 : 0;
}

}  // namespace kvsim::gpu_replay
