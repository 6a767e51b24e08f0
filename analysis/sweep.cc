#include "analysis/sweep.h"

#include <unistd.h>

#include <filesystem>

#include "analysis/report.h"
#include "policies/registry.h"
#include "policies/stream_registry.h"
#include "sim/text_proto.h"
#include "traces/hdf5_trace.h"

namespace kvsim {

StatusOr<std::unique_ptr<TraceSource>> OpenTrace(const std::string& path) {
  auto reader = Hdf5TraceReader::Open(path);
  if (!reader.ok()) return reader.status();
  return std::unique_ptr<TraceSource>(std::move(*reader));
}

StatusOr<std::unique_ptr<LatencyModel>> MakeLatencyModel(const LatencySpec& spec, const TraceMeta& meta) {
  if (!spec.device.empty() && !spec.file.empty())
    return Status::InvalidArgument(
        "--device and --latency-model both set the simulated clock; give one (--device: modelled from the "
        "device profile; --latency-model: a fitted file)");
  if (!spec.model.empty() && spec.device.empty())
    return Status::InvalidArgument("--model chooses the model shape of a device model; add --device");
  if (!spec.device.empty()) {
    KVSIM_ASSIGN_OR_RETURN(DeviceProfile device, FindDevice(spec.device));
    KVSIM_ASSIGN_OR_RETURN(ModelShape shape, ModelShapeForTrace(meta.model, spec.model));
    return MakeDeviceLatencyModel(device, shape);
  }
  if (spec.file.empty()) return MakeTokenStepLatencyModel();
  return LoadLatencyModel(spec.file);
}

LatencySpec ExperimentLatency(const config::Experiment& experiment, const std::string& base_dir,
                              const RunOptions& options) {
  auto resolve = [&](const std::string& option, const std::string& field, bool path) {
    if (!option.empty()) return option;
    // A device or model name stays a name; a file in the experiment resolves against its folder.
    if (field.empty() || (!path && field.find('/') == std::string::npos && !field.ends_with(".textproto")))
      return field;
    return ResolveExperimentPath(field, base_dir);
  };
  LatencySpec spec;
  spec.file = resolve(options.latency_model, experiment.latency_model(), true);
  spec.device = resolve(options.device, experiment.device(), false);
  spec.model = resolve(options.model, experiment.model_shape(), false);
  // An option on the command line replaces the experiment's clock as a whole.
  if (!options.device.empty() && options.latency_model.empty()) spec.file.clear();
  if (!options.latency_model.empty() && options.device.empty()) spec.device.clear(), spec.model.clear();
  return spec;
}

std::string RunLabel(const std::string& name, const std::vector<std::string>& sets) {
  std::string label = name;
  for (const auto& s : sets) label += " " + s;
  return label;
}

std::string ResolveExperimentPath(const std::string& path, const std::string& base_dir) {
  return std::filesystem::path(path).is_relative() ? (std::filesystem::path(base_dir) / path).string() : path;
}

namespace {

// A streaming policy named for a plain trace: say what it needs instead of "unknown policy".
Status CheckNotStreamingPolicy(const std::string& name) {
  if (!PolicyRegistry::Default().Find(name) && StreamPolicyRegistry::Default().Find(name))
    return Status::InvalidArgument(
        "'" + name +
        "' is a streaming policy: it replays streaming traces (frames arriving over "
        "time, questions at timestamps), and this trace is not one (docs/streaming.md)");
  return Status::Ok();
}

}  // namespace

StatusOr<RunResult> RunOne(const std::string& trace_path, const std::string& policy,
                           const std::vector<std::string>& sets, double budget_fraction, int budget_tokens,
                           QuestionMode mode, const RunOptions& options) {
  KVSIM_RETURN_IF_ERROR(CheckNotStreamingPolicy(policy).WithContext(trace_path));
  KVSIM_ASSIGN_OR_RETURN(auto p, PolicyRegistry::Default().Create(policy, sets));
  KVSIM_ASSIGN_OR_RETURN(auto trace, OpenTrace(trace_path));
  KVSIM_ASSIGN_OR_RETURN(
      auto latency,
      MakeLatencyModel(LatencySpec{options.latency_model, options.device, options.model}, trace->meta()));
  std::vector<RunSpec> runs{RunSpec{p, RunLabel(policy, sets), budget_fraction, budget_tokens, mode}};
  KVSIM_RETURN_IF_ERROR(CheckRuns(trace->meta(), runs).WithContext(trace_path));
  KVSIM_ASSIGN_OR_RETURN(std::string hash, HashFile(trace_path));
  Progress progress = Progress::FromEnv("run", options.progress);
  ReplayOptions ro{options.threads, latency.get(), &progress, hash, std::max(0, options.prefill_chunk)};
  KVSIM_ASSIGN_OR_RETURN(auto results, Replay(*trace, runs, ro));
  progress.Finish();
  for (std::string& w : DegenerateRunWarnings(results[0], policy, sets))
    results[0].add_warnings(std::move(w));
  return results[0];
}

std::vector<std::string> DegenerateRunWarnings(const RunResult& result, const std::string& policy,
                                               const std::vector<std::string>& sets) {
  std::vector<std::string> out;
  const PolicyInfo* info = PolicyRegistry::Default().Find(policy);
  auto p = PolicyRegistry::Default().Create(policy, sets);
  if (!info || !p.ok()) return out;
  const int b = result.budget_tokens(), ce = result.compressed_prompt_tokens();
  if (!info->uses_budget) {
    out.push_back(policy + " ignores the budget: it keeps every token, so the budget of " +
                  std::to_string(b) + " tokens has no effect");
    return out;
  }
  const int window = std::min((*p)->requirements().window, ce);
  const std::string knob =
      (*p)->ParamsText().find("proxy_window") != std::string::npos ? "proxy_window" : "window";
  if (window > 0 && b <= window)
    out.push_back("budget " + std::to_string(b) + " tokens is at or below " + policy +
                  "'s observation window of " + std::to_string(window) + " tokens: it keeps only the last " +
                  std::to_string(b) +
                  " prompt tokens and ranks none (as every window policy would); raise the budget above " +
                  std::to_string(window) + " or lower the window (--set " + knob + "=N)");
  const double over = result.metrics().prompt_kept_over_budget();
  if (over > 1 + 1e-9)
    out.push_back("kept " + FormatNumber(result.metrics().prompt_kept_tokens_mean(), 4) +
                  " prompt tokens per KV head on average, " + FormatNumber(over, 4) + "x the budget of " +
                  std::to_string(b) +
                  " tokens (this variant's budget is a floor, not a cap; see "
                  "allocated_budget_tokens_mean and prompt_kept_tokens_mean in the result)");
  return out;
}

StatusOr<config::Experiment> LoadExperiment(const std::string& path) {
  KVSIM_ASSIGN_OR_RETURN(std::string text, ReadTextProtoFile(path));
  return ParseExperiment(text, path);
}

StatusOr<config::Experiment> ParseExperiment(const std::string& text, const std::string& path) {
  config::Experiment e;
  KVSIM_RETURN_IF_ERROR(ParseTextProto(text, path, &e));
  if (e.traces().empty())
    return Status::InvalidArgument(path + ": field 'traces' is empty; list at least one trace");
  if (e.policies().empty())
    return Status::InvalidArgument(path +
                                   ": field 'policies' is empty; add e.g. policies { name: \"snapkv\" }");
  for (double b : e.budgets())
    if (!(b > 0 && b <= 1))
      return Status::InvalidArgument(
          path + ": field 'budgets' holds " + std::to_string(b) +
          "; budgets are fractions in (0, 1] (use budget_tokens for token counts)");
  for (int b : e.budget_tokens())
    if (b < 1) return Status::InvalidArgument(path + ": field 'budget_tokens' must be >= 1");
  if (e.prefill_chunk_tokens() < 0)
    return Status::InvalidArgument(path + ": field 'prefill_chunk_tokens' must be >= 0 (0 = whole prompt)");
  return e;
}

StatusOr<SweepResult> RunSweep(const config::Experiment& experiment, const std::string& base_dir,
                               const RunOptions& options) {
  const QuestionMode mode = experiment.question_mode() == config::QUERY_AGNOSTIC
                                ? QuestionMode::kQueryAgnostic
                                : QuestionMode::kQueryAware;
  if (experiment.budgets().empty() && experiment.budget_tokens().empty())
    return Status::InvalidArgument("no budgets; set 'budgets' (fractions) or 'budget_tokens'");
  // Policies × budgets, built and validated once.
  std::vector<RunSpec> runs;
  std::vector<const config::PolicySpec*> run_policy;  // runs[i]'s policy, for its warnings
  for (const config::PolicySpec& ps : experiment.policies()) {
    const std::vector<std::string> sets(ps.set().begin(), ps.set().end());
    KVSIM_RETURN_IF_ERROR(CheckNotStreamingPolicy(ps.name()));
    KVSIM_ASSIGN_OR_RETURN(auto policy, PolicyRegistry::Default().Create(ps.name(), sets));
    const PolicyInfo* info = PolicyRegistry::Default().Find(ps.name());
    const std::string label = ps.has_label() ? ps.label() : RunLabel(ps.name(), sets);
    if (!info->uses_budget) {
      runs.push_back(RunSpec{policy, label, 1.0, 0, mode});
    } else {
      for (double b : experiment.budgets()) runs.push_back(RunSpec{policy, label, b, 0, mode});
      for (int b : experiment.budget_tokens()) runs.push_back(RunSpec{policy, label, 0, b, mode});
    }
    run_policy.resize(runs.size(), &ps);
  }
  const LatencySpec clock = ExperimentLatency(experiment, base_dir, options);
  // Open and check every trace (and its clock) before replaying anything.
  std::vector<std::string> paths;
  std::vector<std::unique_ptr<TraceSource>> traces;
  std::vector<std::unique_ptr<LatencyModel>> latencies;
  for (const std::string& t : experiment.traces()) {
    const std::string path = ResolveExperimentPath(t, base_dir);
    KVSIM_ASSIGN_OR_RETURN(auto trace, OpenTrace(path));
    KVSIM_RETURN_IF_ERROR(CheckRuns(trace->meta(), runs).WithContext(path));
    auto latency = MakeLatencyModel(clock, trace->meta());
    if (!latency.ok()) return latency.status().WithContext(path);
    paths.push_back(path);
    traces.push_back(std::move(trace));
    latencies.push_back(std::move(*latency));
  }
  SweepResult out;
  out.set_experiment(ToTextWithDefaults(experiment));
  Progress progress = Progress::FromEnv("sweep", options.progress);
  for (size_t i = 0; i < traces.size(); ++i) {
    KVSIM_ASSIGN_OR_RETURN(std::string hash, HashFile(paths[i]));
    const int chunk = options.prefill_chunk >= 0 ? options.prefill_chunk : experiment.prefill_chunk_tokens();
    progress.SetOuter("trace", static_cast<int>(i) + 1, static_cast<int>(traces.size()));
    ReplayOptions ro{options.threads, latencies[i].get(), &progress, hash, chunk};
    KVSIM_ASSIGN_OR_RETURN(auto results, Replay(*traces[i], runs, ro));
    for (size_t j = 0; j < results.size(); ++j) {
      const config::PolicySpec& ps = *run_policy[j];
      for (std::string& w : DegenerateRunWarnings(results[j], ps.name(),
                                                  std::vector<std::string>(ps.set().begin(), ps.set().end())))
        results[j].add_warnings(std::move(w));
      *out.add_runs() = std::move(results[j]);
    }
  }
  progress.Finish();
  return out;
}

Status WriteSweepOutputs(const SweepResult& result, const std::string& out_dir) {
  const std::vector<RunResult> runs(result.runs().begin(), result.runs().end());
  return WriteOutputFolder(out_dir, {{"results.json", ToJson(result)},
                                     {"runs.csv", RunsCsv(runs)},
                                     {"layers.csv", LayersCsv(runs)},
                                     {"summary.md", SummaryMarkdown(runs, "kvsim sweep summary")}});
}

}  // namespace kvsim
