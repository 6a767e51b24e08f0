// kvsim_replay_gpu: re-executes policy decisions on CUDA kernels for true decode latency
// (docs/gpu-replay.md). One run measures, side by side: device copy bandwidth, every kernel against its CPU
// reference, decode attention over ragged caches (and padded), the policies' own kernels, and the full
// decoder step per budget; then fits a latency model for `kvsim run/sweep --latency-model`.
//
// Exit codes: 0 success, 1 bad input, 2 usage error, 4 no CUDA device (or built without CUDA),
// 5 a kernel differs from its CPU reference beyond the tolerance.

#include <boost/program_options.hpp>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <sstream>

#include "analysis/report.h"
#include "gpu_replay/bench_report.pb.h"
#include "gpu_replay/gpu_api.h"
#include "gpu_replay/plan.h"

namespace po = boost::program_options;

namespace kvsim::gpu_replay {
namespace {

constexpr int kExitOk = 0, kExitInput = 1, kExitUsage = 2, kExitNoDevice = 4, kExitMismatch = 5;

struct Options {
  std::string preset = "llava-1.5-7b", dtype = "fp16", plan, out, latency_out;
  std::vector<double> budgets{1.0, 0.5, 0.2, 0.1, 0.05};
  std::vector<int> attention_lengths{1024, 8192};
  int context = 4096, layers = 0, window = 32;
  double ragged_cv = 0.5;
  TimingOptions timing;
  bool cpu_reference = false;
  uint64_t seed = 1;
};

void SetTiming(const TimingSummary& t, Timing* out) {
  out->set_median_us(t.median);
  out->set_p10_us(t.p10);
  out->set_p90_us(t.p90);
  out->set_samples(t.samples);
}

double Tolerance(Dtype dt) { return dt == Dtype::kBF16 ? 1e-2 : 2e-3; }

std::vector<float> ToFloats(Dtype dt, const std::vector<uint16_t>& v) {
  std::vector<float> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = ToFloat(dt, v[i]);
  return o;
}

// Lengths per (layer, KV head) for one budget: from the plan's pattern (rescaled) or synthetic.
std::vector<int32_t> Lengths(const ModelShape& s, const Options& o, const std::vector<int32_t>& plan_pattern,
                             double budget) {
  const int units = s.num_layers * s.num_kv_heads;
  if (budget >= 1.0) return std::vector<int32_t>(units, o.context);
  if (!plan_pattern.empty()) {
    double mean = 0;
    for (int32_t n : plan_pattern) mean += n;
    mean /= plan_pattern.size();
    std::vector<int32_t> out(units);
    for (int u = 0; u < units; ++u)
      out[u] = std::clamp(static_cast<int32_t>(std::lround(plan_pattern[u] / mean * budget * o.context)), 1,
                          o.context);
    return out;
  }
  return SyntheticRaggedLengths(units, budget * o.context, o.context, o.ragged_cv, o.seed + 17);
}

// ---- Correctness: every kernel against its CPU reference ----
Status CheckKernels(const ModelShape& shape, Dtype dt, BenchReport* out, bool* all_ok) {
  *all_ok = true;
  auto record = [&](const std::string& name, double err) {
    const bool ok = err <= Tolerance(dt);
    *all_ok = *all_ok && ok;
    KernelCheck* j = out->add_correctness();
    j->set_kernel(name);
    j->set_max_rel_error(err);
    j->set_tolerance(Tolerance(dt));
    j->set_ok(ok ? "yes" : "NO");
    std::fprintf(stderr, "  %-40s max rel. error %.2e (tolerance %.0e) %s\n", name.c_str(), err,
                 Tolerance(dt), ok ? "ok" : "MISMATCH");
  };
  const int group = shape.num_heads / shape.num_kv_heads;
  for (int d : {64, 128})
    for (int g : {1, group}) {
      const std::vector<int32_t> len{1, 0, 700, 5000, 64, 1500, 9, 257};
      const AttentionProblem p = MakeAttentionProblem(dt, 8 * g, len, 4, d, 3);
      const SplitKvPartition part = PartitionSplitKv(len, 64, 32);
      std::vector<float> ref, gpu;
      RefDecodeAttention(p, part, &ref);
      KVSIM_RETURN_IF_ERROR(GpuDecodeAttention(p, part, &gpu));
      record("decode attention d" + std::to_string(d) + " group " + std::to_string(g), MaxRelError(gpu, ref));
    }
  {
    const WindowScoreProblem p = MakeWindowScoreProblem(dt, 2 * group, 2, 128, 1000, 32, 4);
    std::vector<float> ref, gpu;
    RefWindowScores(p, &ref);
    KVSIM_RETURN_IF_ERROR(GpuWindowScores(p, &gpu));
    record("window scores", MaxRelError(gpu, ref));
  }
  {
    const std::vector<int32_t> len{3000, 0, 17, 800}, keep{600, 5, 17, 1};
    const TopKProblem p = MakeTopKProblem(dt, len, keep, 8, 128, 5);
    TopKResult ref, gpu;
    RefTopKCompact(p, &ref);
    KVSIM_RETURN_IF_ERROR(GpuTopKCompact(p, &gpu));
    const bool same = ref.selected == gpu.selected && ref.k == gpu.k && ref.v == gpu.v;
    record("top-k + compaction (exact)", same ? 0.0 : INFINITY);
  }
  {
    const std::vector<int32_t> kept{400, 3, 0, 50}, evicted{1600, 9, 4, 200};
    const MergeProblem p = MakeMergeProblem(dt, kept, evicted, 128, 6);
    MergeResult ref, gpu;
    RefMergeNearest(p, &ref);
    KVSIM_RETURN_IF_ERROR(GpuMergeNearest(p, &gpu));
    double worst = 0;  // the chosen slot's similarity must be the best (near-ties may pick another slot)
    for (size_t e = 0; e < ref.similarity.size(); ++e)
      worst = std::max(worst, static_cast<double>(ref.similarity[e] - gpu.similarity[e]));
    record("merge: nearest similarity shortfall", worst);
    if (ref.nearest == gpu.nearest)
      record("merge: merged keys", MaxRelError(ToFloats(dt, gpu.k), ToFloats(dt, ref.k)));
  }
  for (const std::string& name : {std::string("tiny"), shape.name}) {
    KVSIM_ASSIGN_OR_RETURN(ModelShape s, PresetShape(name));
    if (name != "tiny") s.num_layers = 1;  // CPU reference of one 7B layer + LM head: seconds
    DecoderProblem p;
    p.shape = s;
    p.dtype = dt;
    p.lengths = SyntheticRaggedLengths(s.num_layers * s.num_kv_heads, 300, 1000, 0.5, 2);
    p.position = 1234;
    std::vector<float> ref, gpu;
    RefDecoderStep(p, &ref);
    KVSIM_RETURN_IF_ERROR(GpuDecoderStep(p, &gpu));
    record("decoder step (" + name + (name == "tiny" ? "" : ", 1 layer") + ", logits)",
           MaxRelError(gpu, ref));
  }
  return Status::Ok();
}

int RunGpu(const Options& o, const ModelShape& shape, Dtype dt, const std::vector<int32_t>& pattern) {
  const DeviceInfo dev = QueryDevice(0);
  if (!dev.available) {
    std::fprintf(stderr, "kvsim_replay_gpu: %s\n", dev.reason.c_str());
    return kExitNoDevice;
  }
  auto fail = [](const Status& st) {
    std::fprintf(stderr, "kvsim_replay_gpu: error: %s\n", st.message().c_str());
    return kExitInput;
  };
  BenchReport root;
  BenchDevice* devj = root.mutable_device();
  devj->set_name(dev.name);
  devj->set_sm_count(dev.sm_count);
  devj->set_cc(dev.cc_major * 10 + dev.cc_minor);
  devj->set_memory_gib(dev.total_mem_gib);
  devj->set_l2_bytes(dev.l2_bytes);
  devj->set_peak_gb_per_s(dev.peak_gb_per_s());
  const NvmlReading before = ReadNvml(0);
  auto nvml_json = [](const NvmlReading& r, Nvml* j) {
    if (!r.ok) return j->set_unavailable(r.why);
    j->set_sm_clock_mhz(r.sm_clock_mhz);
    j->set_mem_clock_mhz(r.mem_clock_mhz);
    j->set_max_sm_clock_mhz(r.max_sm_clock_mhz);
    j->set_power_w(r.power_w);
    j->set_temperature_c(r.temperature_c);
  };
  root.set_preset(shape.name);
  root.set_dtype(DtypeName(dt));
  root.set_context(o.context);
  root.set_ragged_cv(o.ragged_cv);
  root.set_plan(o.plan);
  root.set_repeats(o.timing.repeats);
  root.set_warmup(o.timing.warmup);
  nvml_json(before, root.mutable_nvml_before());
  std::fprintf(stderr, "kvsim_replay_gpu: %s, %s %s\n", dev.name.c_str(), shape.name.c_str(), DtypeName(dt));

  double copy_gbs = 0;
  auto copy = TimeCopy(size_t{1} << 30, o.timing, &copy_gbs);
  if (!copy.ok()) return fail(copy.status());
  SetTiming(*copy, root.mutable_copy_1gib());
  root.set_copy_gb_per_s(copy_gbs);
  std::fprintf(stderr, "  copy bandwidth %.0f GB/s (read + write)\n", copy_gbs);
  double read_gbs = 0;  // the lower bound's denominator: a decode step only reads weights and KV
  auto read = TimeRead(size_t{1} << 30, o.timing, &read_gbs);
  if (!read.ok()) return fail(read.status());
  SetTiming(*read, root.mutable_read_1gib());
  root.set_read_gb_per_s(read_gbs);
  std::fprintf(stderr, "  read bandwidth %.0f GB/s (the lower bound's)\n", read_gbs);

  bool ok = true;
  Status st = CheckKernels(shape, dt, &root, &ok);
  if (!st.ok()) return fail(st);

  // Decode attention of one layer at fixed tokens per head: ragged vs uniform vs padded.
  const int hkv = shape.num_kv_heads;
  for (int n : o.attention_lengths) {
    for (double cv : {0.0, o.ragged_cv}) {
      const std::vector<int32_t> lens = SyntheticRaggedLengths(hkv, n, 4 * n, cv, o.seed);
      const AttentionProblem p = MakeAttentionProblem(dt, shape.num_heads, lens, 1, shape.head_dim, o.seed);
      const SplitKvPartition part = PartitionSplitKv(lens, dev.sm_count * 8, kSplitKvMinChunk);
      auto t = TimeDecodeAttention(p, part, o.timing);
      auto tp = TimePaddedAttention(p, o.timing);
      if (!t.ok()) return fail(t.status());
      if (!tp.ok()) return fail(tp.status());
      const double bytes = 2.0 * p.layout.live_tokens() * shape.head_dim * 2;
      const double gbs = bytes / (t->median * 1e-6) / 1e9;
      std::string lens_text;  // for bench/sdpa_bench.py --lengths (the PyTorch padded-SDPA baseline)
      for (int32_t x : lens) lens_text += (lens_text.empty() ? "" : ",") + std::to_string(x);
      AttentionTiming* j = root.add_attention();
      j->set_tokens_per_head_mean(n);
      j->set_cv(cv);
      j->set_lengths(lens_text);
      SetTiming(*t, j->mutable_ragged());
      SetTiming(*tp, j->mutable_padded());
      j->set_kv_bytes(bytes);
      j->set_gb_per_s(gbs);
      j->set_fraction_of_copy_bw(gbs / copy_gbs);
      j->set_padded_over_ragged(tp->median / t->median);
      std::fprintf(stderr,
                   "  attention %d tok/head cv %.1f: %.1f us (%.0f GB/s, %.0f%% of copy), padded %.1f us\n",
                   n, cv, t->median, gbs, 100 * gbs / copy_gbs, tp->median);
    }
  }

  // Policy kernels at the preset's shape, prompt = context.
  {
    PolicyKernelTiming* pol = root.mutable_policy_overhead();
    const WindowScoreProblem wp =
        MakeWindowScoreProblem(dt, shape.num_heads, hkv, shape.head_dim, o.context, o.window, 7);
    auto tw = TimeWindowScores(wp, o.timing);
    const std::vector<int32_t> len(hkv, o.context), keep(hkv, std::max(1, o.context / 5));
    auto tk = TimeTopKCompact(MakeTopKProblem(dt, len, keep, 64, shape.head_dim, 8), o.timing);
    const std::vector<int32_t> ev(hkv, o.context - o.context / 5);
    auto tm = TimeMergeNearest(MakeMergeProblem(dt, keep, ev, shape.head_dim, 9), o.timing);
    if (!tw.ok() || !tk.ok() || !tm.ok())
      return fail(!tw.ok() ? tw.status() : !tk.ok() ? tk.status() : tm.status());
    SetTiming(*tw, pol->mutable_window_scores_per_layer());
    SetTiming(*tk, pol->mutable_topk_compact_20pct_per_layer());
    SetTiming(*tm, pol->mutable_merge_nearest_80pct_into_20pct_per_layer());
    pol->set_all_layers_us((tw->median + tk->median + tm->median) * shape.num_layers);
    std::fprintf(stderr, "  policy kernels per layer: scores %.1f us, top-k %.1f us, merge %.1f us\n",
                 tw->median, tk->median, tm->median);
  }

  // Full decoder step per budget.
  std::vector<LatencyPoint> points;
  const double weight_bytes = static_cast<double>(DecoderWeightBytes(shape));
  for (double b : o.budgets) {
    DecoderProblem p;
    p.shape = shape;
    p.dtype = dt;
    p.lengths = Lengths(shape, o, pattern, b);
    p.position = o.context;
    p.seed = o.seed;
    auto t = TimeDecoderStep(p, o.timing);
    if (!t.ok()) return fail(t.status());
    const double kv = static_cast<double>(DecoderKvBytes(p));
    double mean_len = 0;
    for (int32_t n : p.lengths) mean_len += n + 1;
    mean_len /= p.lengths.size();
    const double lower = LowerBoundUs(weight_bytes + kv, read_gbs);
    DecoderStepTiming* j = root.add_decoder_step();
    j->set_budget(b);
    j->set_mean_kv_tokens_per_head(mean_len);
    SetTiming(t->step, j->mutable_step());
    SetTiming(t->attention, j->mutable_attention_only());
    j->set_ms_per_token(t->step.median / 1e3);
    j->set_weight_bytes(weight_bytes);
    j->set_kv_bytes(kv);
    j->set_lower_bound_us(lower);
    j->set_fraction_of_lower_bound(lower / t->step.median);
    j->set_achieved_gb_per_s((weight_bytes + kv) / (t->step.median * 1e-6) / 1e9);
    points.push_back({mean_len, t->step.median});
    std::fprintf(stderr,
                 "  step budget %.2f: %.3f ms/token (attention %.3f ms), lower bound %.3f ms (%.0f%%)\n", b,
                 t->step.median / 1e3, t->attention.median / 1e3, lower / 1e3, 100 * lower / t->step.median);
  }
  nvml_json(ReadNvml(0), root.mutable_nvml_after());
  auto model = FitLatencyModel(points, {}, dev.name + ", " + shape.name + " " + DtypeName(dt) + ", batch 1");
  if (model.ok()) {
    root.set_fit_decode_base_us(model->decode_base_us());
    root.set_fit_decode_us_per_kv_token(model->decode_us_per_kv_token());
    if (!o.latency_out.empty()) {
      st = WriteFileAtomic(o.latency_out, LatencyModelText(*model));
      if (!st.ok()) return fail(st);
    }
  } else {
    std::fprintf(stderr, "kvsim_replay_gpu: latency model not fitted: %s\n",
                 model.status().message().c_str());
  }
  if (!o.out.empty()) {
    st = WriteFileAtomic(o.out, ToJson(root));
    if (!st.ok()) return fail(st);
  } else {
    std::cout << ToJson(root);
  }
  return ok ? kExitOk : kExitMismatch;
}

// The CPU reference path, timed (this machine has no GPU; the numbers are the reference's, not a GPU's).
int RunCpu(const Options& o, const ModelShape& shape, Dtype dt) {
  using Clock = std::chrono::steady_clock;
  auto time = [&](auto&& f) {
    std::vector<double> us;
    for (int i = 0; i < std::max(1, o.timing.repeats); ++i) {
      const auto t0 = Clock::now();
      f();
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    return Summarize(us);
  };
  BenchReport root;
  root.set_mode("cpu-reference (single thread; not a GPU measurement)");
  root.set_preset(shape.name);
  root.set_dtype(DtypeName(dt));
  root.set_repeats(o.timing.repeats);
  for (int n : o.attention_lengths) {
    const std::vector<int32_t> lens(shape.num_kv_heads, n);
    const AttentionProblem p = MakeAttentionProblem(dt, shape.num_heads, lens, 1, shape.head_dim, 1);
    const SplitKvPartition part = PartitionSplitKv(lens, 1024);
    std::vector<float> out;
    const TimingSummary t = time([&] { RefDecodeAttention(p, part, &out); });
    AttentionTiming* j = root.add_attention();
    j->set_tokens_per_head(n);
    SetTiming(t, j->mutable_layer_attention());
    std::fprintf(stderr, "  CPU ref attention, one layer, %d tok/head: %.0f us\n", n, t.median);
  }
  {
    const WindowScoreProblem wp = MakeWindowScoreProblem(dt, shape.num_heads, shape.num_kv_heads,
                                                         shape.head_dim, o.context, o.window, 7);
    std::vector<float> sc;
    const TimingSummary tw = time([&] { RefWindowScores(wp, &sc); });
    const std::vector<int32_t> len(shape.num_kv_heads, o.context), keep(shape.num_kv_heads, o.context / 5);
    const TopKProblem tp = MakeTopKProblem(dt, len, keep, 64, shape.head_dim, 8);
    TopKResult tr;
    const TimingSummary tk = time([&] { RefTopKCompact(tp, &tr); });
    const std::vector<int32_t> ev(shape.num_kv_heads, o.context - o.context / 5);
    const MergeProblem mp = MakeMergeProblem(dt, keep, ev, shape.head_dim, 9);
    MergeResult mr;
    const TimingSummary tm = time([&] { RefMergeNearest(mp, &mr); });
    PolicyKernelTiming* pol = root.mutable_policy_kernels();
    SetTiming(tw, pol->mutable_window_scores_per_layer());
    SetTiming(tk, pol->mutable_topk_compact_per_layer());
    SetTiming(tm, pol->mutable_merge_per_layer());
    std::fprintf(stderr,
                 "  CPU ref per layer at %d prompt tokens: scores %.0f us, top-k %.0f us, merge %.0f us\n",
                 o.context, tw.median, tk.median, tm.median);
  }
  {
    ModelShape s = shape;
    s.num_layers = o.layers > 0 ? o.layers : 2;
    DecoderProblem p;
    p.shape = s;
    p.dtype = dt;
    p.lengths.assign(s.num_layers * s.num_kv_heads, o.context);
    p.position = o.context;
    RefDecoder dec(p);
    std::vector<float> logits;
    const TimingSummary t = time([&] { dec.Step(&logits); });
    DecoderStepTiming* j = root.add_decoder_step();
    j->set_layers(s.num_layers);
    j->set_kv_tokens_per_head(o.context);
    SetTiming(t, j->mutable_step());
    std::fprintf(stderr, "  CPU ref decoder step, %d layers + LM head, %d tok/head: %.1f ms\n", s.num_layers,
                 o.context, t.median / 1e3);
  }
  if (!o.out.empty()) {
    Status st = WriteFileAtomic(o.out, ToJson(root));
    if (!st.ok()) {
      std::fprintf(stderr, "kvsim_replay_gpu: error: %s\n", st.message().c_str());
      return kExitInput;
    }
  } else {
    std::cout << ToJson(root);
  }
  return kExitOk;
}

int Main(int argc, char** argv) {
  Options o;
  std::string budgets, lengths;
  po::options_description opts("kvsim_replay_gpu options");
  opts.add_options()("help,h", "show this help")("preset", po::value(&o.preset)->default_value(o.preset),
                                                 "llava-1.5-7b | qwen2-7b | tiny")(
      "dtype", po::value(&o.dtype)->default_value(o.dtype), "fp16 | bf16")(
      "plan", po::value(&o.plan),
      "GPU plan (kvsim gpu-plan): its per-(layer, KV head) pattern of kept lengths")(
      "context", po::value(&o.context)->default_value(o.context), "prompt tokens per head at full cache")(
      "budgets", po::value(&budgets)->default_value("1,0.5,0.2,0.1,0.05"), "kept fractions (1 = full cache)")(
      "ragged-cv", po::value(&o.ragged_cv)->default_value(o.ragged_cv),
      "spread of per-head lengths without a plan (0 = uniform)")(
      "attention-lengths", po::value(&lengths)->default_value("1024,8192"),
      "tokens per head, attention bench")("window", po::value(&o.window)->default_value(o.window),
                                          "observation window of the scoring kernel")(
      "layers", po::value(&o.layers)->default_value(0), "override the preset's layer count (0 = preset)")(
      "repeats", po::value(&o.timing.repeats)->default_value(50), "timed samples")(
      "warmup", po::value(&o.timing.warmup)->default_value(10), "untimed runs first")(
      "no-l2-flush", "do not flush L2 between samples")("cpu-reference", po::bool_switch(&o.cpu_reference),
                                                        "time the CPU reference instead (no GPU needed)")(
      "out", po::value(&o.out), "results JSON (default: stdout)")(
      "latency-model-out", po::value(&o.latency_out), "fitted LatencyModelProto text file");
  const char* usage =
      "usage: kvsim_replay_gpu [--preset P] [--dtype fp16|bf16] [--plan plan.pb] [--out r.json] "
      "[--latency-model-out m.textproto] [--cpu-reference]";
  po::variables_map vm;
  try {
    po::store(po::parse_command_line(argc, argv, opts), vm);
    if (vm.count("help")) {
      std::cout << usage << "\n\n"
                << opts
                << "\nexit codes: 0 ok, 1 bad input, 2 usage, 4 no CUDA device, "
                   "5 kernel mismatch vs the CPU reference\n";
      return kExitOk;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    std::fprintf(stderr, "kvsim_replay_gpu: usage error: %s\n%s\n", e.what(), usage);
    return kExitUsage;
  }
  if (vm.count("no-l2-flush")) o.timing.flush_l2 = false;
  auto bad = [](const std::string& msg) {
    std::fprintf(stderr, "kvsim_replay_gpu: error: %s\n", msg.c_str());
    return kExitInput;
  };
  auto parse_list = [](const std::string& s, auto* out) {
    out->clear();
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ',')) {
      try {
        out->push_back(static_cast<typename std::decay_t<decltype(*out)>::value_type>(std::stod(item)));
      } catch (...) {
        return false;
      }
    }
    return !out->empty();
  };
  if (!parse_list(budgets, &o.budgets))
    return bad("--budgets '" + budgets + "': expected numbers like 1,0.2");
  for (double b : o.budgets)
    if (!(b > 0 && b <= 1)) return bad("--budgets: " + std::to_string(b) + " is not a fraction in (0, 1]");
  if (!parse_list(lengths, &o.attention_lengths))
    return bad("--attention-lengths '" + lengths + "': expected integers");
  if (o.context < 1 || o.window < 1 || o.window > o.context)
    return bad("--context >= 1 and 1 <= --window <= --context");
  if (o.timing.repeats < 1 || o.timing.warmup < 0) return bad("--repeats >= 1, --warmup >= 0");
  if (o.dtype != "fp16" && o.dtype != "bf16") return bad("--dtype '" + o.dtype + "': expected fp16 or bf16");
  const Dtype dt = o.dtype == "fp16" ? Dtype::kF16 : Dtype::kBF16;
  auto shape = PresetShape(o.preset);
  if (!shape.ok()) return bad(shape.status().message());
  if (o.layers > 0) shape->num_layers = o.layers;
  std::vector<int32_t> pattern;
  if (!o.plan.empty()) {
    auto plan = ReadPlan(o.plan);
    if (!plan.ok()) return bad(plan.status().message());
    if (plan->model().num_layers() != shape->num_layers ||
        plan->model().num_kv_heads() != shape->num_kv_heads)
      return bad(o.plan + ": field 'model' has " + std::to_string(plan->model().num_layers()) + " layers x " +
                 std::to_string(plan->model().num_kv_heads()) + " KV heads, preset " + shape->name +
                 " needs " + std::to_string(shape->num_layers) + " x " + std::to_string(shape->num_kv_heads) +
                 "; use a plan from a trace of that model (or --layers)");
    pattern = LengthsAtStep(*plan, 0);
  }
  if (o.cpu_reference) return RunCpu(o, *shape, dt);
  return RunGpu(o, *shape, dt, pattern);
}

}  // namespace
}  // namespace kvsim::gpu_replay

int main(int argc, char** argv) { return kvsim::gpu_replay::Main(argc, argv); }
