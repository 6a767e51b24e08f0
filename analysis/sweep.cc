#include "analysis/sweep.h"

#include <google/protobuf/util/json_util.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include "analysis/dataset.h"
#include "analysis/report.h"
#include "policies/registry.h"
#include "policies/stream_registry.h"
#include "sim/parallel.h"
#include "sim/stats.h"
#include "sim/text_proto.h"
#include "sim/version.h"
#include "traces/hash_cache.h"
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

StatusOr<std::string> HashBesideReplay(const std::string& path, int threads,
                                       const std::function<Status(const std::string& hash)>& replay,
                                       StatusOr<std::string> (*hash)(const std::string&)) {
  std::function<StatusOr<std::string>(const std::string&)> hasher = hash;
  if (!hash) {
    // Remembered from an earlier run (traces/hash_cache.h): nothing to read beside the replay.
    const HashCacheOptions cache = HashCacheFromEnv();
    if (std::optional<std::string> h = LookupFileHash(path, cache)) {
      KVSIM_RETURN_IF_ERROR(replay(*h));
      return *h;
    }
    hasher = [cache](const std::string& p) { return HashFileAndRemember(p, cache); };
  }
  if (!HashConcurrently(path, threads)) {
    KVSIM_ASSIGN_OR_RETURN(std::string h, hasher(path));
    KVSIM_RETURN_IF_ERROR(replay(h));
    return h;
  }
  // The hash thread only reads the file; the replay's results do not depend on it (nor on its timing).
  std::future<StatusOr<std::string>> pending = std::async(std::launch::async, hasher, path);
  const Status replayed = replay("");
  StatusOr<std::string> h = pending.get();
  if (!h.ok()) return h.status();
  KVSIM_RETURN_IF_ERROR(replayed);
  return h;
}

bool HashConcurrently(const std::string& path, int threads) {
  const int n = threads > 0 ? threads : static_cast<int>(std::thread::hardware_concurrency());
  return n > 1 && FileInPageCache(path);
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
  Progress progress = Progress::FromEnv("run", options.progress);
  std::vector<RunResult> results;
  KVSIM_ASSIGN_OR_RETURN(
      std::string hash, HashBesideReplay(trace_path, options.threads, [&](const std::string& h) {
        ReplayOptions ro{options.threads, latency.get(), &progress, h, std::max(0, options.prefill_chunk)};
        KVSIM_ASSIGN_OR_RETURN(results, Replay(*trace, runs, ro));
        return Status::Ok();
      }));
  results[0].set_trace_hash(hash);
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

namespace {

namespace fs = std::filesystem;

bool ValidSampleId(const std::string& id) {
  if (id.empty()) return false;
  for (char c : id)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) return false;
  return true;
}

// A sample id from a file name: its stem, other characters replaced by '_'.
std::string StemId(const std::string& path) {
  std::string id = fs::path(path).stem().string();
  for (char& c : id)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) c = '_';
  return id.empty() ? "trace" : id;
}

std::string Trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\r");
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(" \t\r") - a + 1);
}

}  // namespace

StatusOr<std::vector<config::Sample>> LoadManifest(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    return Status::InvalidArgument(path +
                                   ": cannot read the manifest (check --manifest: the file must exist)");
  const fs::path base = fs::path(path).parent_path();
  std::vector<config::Sample> out;
  std::string line;
  int lineno = 0;
  std::vector<std::string> header;
  while (std::getline(in, line)) {
    ++lineno;
    const std::string t = Trim(line);
    if (t.empty() || t[0] == '#') continue;
    const std::string where = path + ":" + std::to_string(lineno);
    if (t.find('"') != std::string::npos)
      return Status::InvalidArgument(where +
                                     ": quotes are not supported in a manifest; fields are plain "
                                     "(id and path without commas, tags 'key=value;key=value')");
    std::vector<std::string> fields;
    std::istringstream is(t);
    for (std::string f; std::getline(is, f, ',');) fields.push_back(Trim(f));
    if (t.back() == ',') fields.push_back("");
    if (header.empty()) {
      // id,path then the optional columns tags and group, in any order.
      bool ok = fields.size() >= 2 && fields.size() <= 4 && fields[0] == "id" && fields[1] == "path";
      for (size_t k = 2; ok && k < fields.size(); ++k) ok = fields[k] == "tags" || fields[k] == "group";
      if (ok && fields.size() == 4) ok = fields[2] != fields[3];
      if (!ok)
        return Status::InvalidArgument(
            where +
            ": the first line must be the header 'id,path', optionally followed by "
            "the columns 'tags' and/or 'group' (e.g. 'id,path,tags,group')");
      header = fields;
      continue;
    }
    const size_t columns = header.size();
    while (fields.size() >= 2 && fields.size() < columns) fields.push_back("");  // optional columns
    if (fields.size() != columns) {
      std::string form;
      for (const std::string& h : header) form += (form.empty() ? "" : ",") + h;
      return Status::InvalidArgument(where + ": " + std::to_string(fields.size()) +
                                     " fields, the header has " + std::to_string(columns) + "; write '" +
                                     form + "'");
    }
    auto column = [&](const char* name) {
      for (size_t k = 2; k < columns; ++k)
        if (header[k] == name) return fields[k];
      return std::string();
    };
    config::Sample sample;
    if (!ValidSampleId(fields[0]))
      return Status::InvalidArgument(where + ": sample id '" + fields[0] +
                                     "' must be non-empty letters, digits, '.', '_' or '-'");
    if (fields[1].empty())
      return Status::InvalidArgument(where + ": empty path; name the sample's trace file");
    sample.set_id(fields[0]);
    // Relative to the manifest's folder (a manifest in the working folder: the path as written).
    sample.set_path(base.empty() ? fields[1] : ResolveExperimentPath(fields[1], base.string()));
    sample.set_origin(where);
    if (std::error_code ec; !fs::exists(sample.path(), ec))
      return Status::InvalidArgument(where + ": trace '" + fields[1] + "' not found (looked for " +
                                     sample.path() +
                                     "; a relative path is resolved against the manifest's folder)");
    if (const std::string tags = column("tags"); !tags.empty()) {
      std::istringstream ts(tags);
      for (std::string tag; std::getline(ts, tag, ';');) {
        tag = Trim(tag);
        const size_t eq = tag.find('=');
        if (eq == 0 || eq == std::string::npos)
          return Status::InvalidArgument(where + ": tag '" + tag +
                                         "' must be key=value (tags separated by ';')");
        sample.add_tags(tag);
      }
    }
    if (const std::string group = column("group"); !group.empty()) {
      if (auto g = ParseGroupSpec(group); !g.ok())
        return Status::InvalidArgument(where + ": field 'group': " + g.status().message());
      sample.set_group(group);
    }
    out.push_back(std::move(sample));
  }
  if (header.empty() || out.empty())
    return Status::InvalidArgument(
        path +
        ": the manifest lists no samples; add lines 'id,path[,tags][,group]' after "
        "the header");
  return out;
}

StatusOr<std::vector<config::Sample>> FolderSamples(const std::string& dir) {
  std::error_code ec;
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().extension() == ".h5" && !e.is_directory()) files.push_back(e.path().string());
  if (ec) return Status::InvalidArgument(dir + ": cannot list the folder: " + ec.message());
  if (files.empty())
    return Status::InvalidArgument(dir +
                                   ": folder holds no traces (*.h5); give a folder of traces, trace "
                                   "files or --manifest");
  std::sort(files.begin(), files.end());
  std::vector<config::Sample> out;
  for (const auto& f : files) {
    config::Sample s;
    s.set_id(StemId(f));
    s.set_path(f);
    out.push_back(std::move(s));
  }
  return out;
}

StatusOr<std::vector<config::Sample>> ExperimentSamples(const config::Experiment& experiment,
                                                        const std::string& base_dir) {
  std::vector<config::Sample> out;
  if (!experiment.samples().empty()) {
    for (config::Sample s : experiment.samples()) {
      if (!ValidSampleId(s.id()))
        return Status::InvalidArgument("sample id '" + s.id() +
                                       "' must be non-empty letters, digits, '.', '_' or '-'");
      s.set_path(ResolveExperimentPath(s.path(), base_dir));
      out.push_back(std::move(s));
    }
  } else {
    std::set<std::string> taken;
    for (const std::string& t : experiment.traces()) {
      config::Sample s;
      std::string id = StemId(t);
      for (int k = 2; taken.count(id); ++k) id = StemId(t) + "-" + std::to_string(k);
      taken.insert(id);
      s.set_id(id);
      s.set_path(ResolveExperimentPath(t, base_dir));
      out.push_back(std::move(s));
    }
  }
  std::map<std::string, std::string> seen;
  for (const auto& s : out) {
    auto [it, fresh] = seen.emplace(s.id(), s.path());
    if (!fresh)
      return Status::InvalidArgument("duplicate sample id '" + s.id() + "' (" + it->second + " and " +
                                     s.path() + "); give every sample its own id");
  }
  return out;
}

std::vector<Aggregate> AggregateRuns(const std::vector<RunResult>& runs, uint64_t seed, int resamples) {
  std::vector<AggregateRow> rows;
  for (const RunResult& r : runs) {
    const Metrics& m = r.metrics();
    rows.push_back(AggregateRow{
        r.group(),
        r.policy(),
        r.label(),
        r.budget_fraction(),
        r.budget_tokens(),
        {m.retained_mass_mean(), m.output_rel_error_mean(), m.regret_vs_oracle_mean(), m.kv_memory_ratio()}});
  }
  return AggregateRows(
      rows, {"retained_mass_mean", "output_rel_error_mean", "regret_vs_oracle_mean", "kv_memory_ratio"}, seed,
      resamples);
}

StatusOr<SweepInput> LoadSweepInput(const std::string& config, const std::vector<std::string>& traces,
                                    const std::string& manifest) {
  KVSIM_ASSIGN_OR_RETURN(config::Experiment exp, LoadExperiment(config));
  std::string base = fs::path(config).parent_path().string();
  if (!manifest.empty() && !traces.empty())
    return Status::InvalidArgument(
        "give --manifest or --trace, not both (list every sample in the manifest)");
  bool folder = false;
  for (const auto& t : traces) folder |= fs::is_directory(t);
  if (!manifest.empty() || folder) {
    // A dataset: samples with ids (and tags), paths as given (a manifest's relative to its folder).
    std::vector<config::Sample> samples;
    if (!manifest.empty()) {
      KVSIM_ASSIGN_OR_RETURN(samples, LoadManifest(manifest));
    }
    for (const auto& t : traces) {
      if (fs::is_directory(t)) {
        KVSIM_ASSIGN_OR_RETURN(auto f, FolderSamples(t));
        samples.insert(samples.end(), f.begin(), f.end());
      } else {
        config::Sample s;
        s.set_id(fs::path(t).stem().string());
        s.set_path(t);
        samples.push_back(std::move(s));
      }
    }
    exp.clear_traces();
    for (const auto& s : samples) *exp.add_samples() = s;
    base = "";
  } else if (!traces.empty()) {
    exp.clear_traces();
    for (const auto& t : traces) exp.add_traces(t);
    base = ".";
  }
  return SweepInput{std::move(exp), base.empty() ? "." : base};
}

std::string SweepPlan::UnitFile(size_t i) const { return samples[i].id() + "-" + definition_hash + ".json"; }

StatusOr<SweepPlan> PlanSweep(const config::Experiment& experiment, const std::string& base_dir,
                              const RunOptions& options, bool check_traces) {
  SweepPlan plan;
  plan.experiment = experiment;
  plan.base_dir = base_dir;
  const QuestionMode mode = experiment.question_mode() == config::QUERY_AGNOSTIC
                                ? QuestionMode::kQueryAgnostic
                                : QuestionMode::kQueryAware;
  if (experiment.budgets().empty() && experiment.budget_tokens().empty())
    return Status::InvalidArgument("no budgets; set 'budgets' (fractions) or 'budget_tokens'");
  if (experiment.bootstrap_resamples() < 1)
    return Status::InvalidArgument("field 'bootstrap_resamples' must be >= 1 (e.g. 2000)");
  // Policies × budgets, built and validated once.
  for (const config::PolicySpec& ps : experiment.policies()) {
    const std::vector<std::string> sets(ps.set().begin(), ps.set().end());
    KVSIM_RETURN_IF_ERROR(CheckNotStreamingPolicy(ps.name()));
    KVSIM_ASSIGN_OR_RETURN(auto policy, PolicyRegistry::Default().Create(ps.name(), sets));
    const PolicyInfo* info = PolicyRegistry::Default().Find(ps.name());
    const std::string label = ps.has_label() ? ps.label() : RunLabel(ps.name(), sets);
    if (!info->uses_budget) {
      plan.runs.push_back(RunSpec{policy, label, 1.0, 0, mode});
    } else {
      for (double b : experiment.budgets()) plan.runs.push_back(RunSpec{policy, label, b, 0, mode});
      for (int b : experiment.budget_tokens()) plan.runs.push_back(RunSpec{policy, label, 0, b, mode});
    }
    plan.run_policy.resize(plan.runs.size(), ps);
  }
  plan.clock = ExperimentLatency(experiment, base_dir, options);
  plan.chunk = options.prefill_chunk >= 0 ? options.prefill_chunk : experiment.prefill_chunk_tokens();
  KVSIM_ASSIGN_OR_RETURN(plan.samples, ExperimentSamples(experiment, base_dir));
  // Open and check every trace (and its clock) before replaying anything; each unit opens its trace again.
  if (check_traces)
    for (const config::Sample& s : plan.samples) {
      KVSIM_ASSIGN_OR_RETURN(auto trace, OpenTrace(s.path()));
      KVSIM_RETURN_IF_ERROR(CheckRuns(trace->meta(), plan.runs).WithContext(s.path()));
      auto latency = MakeLatencyModel(plan.clock, trace->meta());
      if (!latency.ok()) return latency.status().WithContext(s.path());
      KVSIM_RETURN_IF_ERROR(CheckSampleGroup(s, trace->meta().model));
    }
  KVSIM_ASSIGN_OR_RETURN(plan.definition_hash, UnitDefinitionHash(experiment, plan.clock, plan.chunk));
  return plan;
}

StatusOr<SweepUnit> ParseSweepUnit(const SweepPlan& plan, size_t i, const std::string& json) {
  SweepUnit unit;
  const config::Sample& s = plan.samples.at(i);
  if (!google::protobuf::util::JsonStringToMessage(json, &unit).ok())
    return Status::DataLoss("unit of sample '" + s.id() + "': not a unit's JSON");
  if (unit.definition_hash() != plan.definition_hash)
    return Status::FailedPrecondition("unit of sample '" + s.id() + "' has definition hash " +
                                      unit.definition_hash() + ", the sweep " + plan.definition_hash +
                                      " (another experiment or kvsim build; use the same kvsim everywhere)");
  if (unit.sample_id() != s.id() || unit.trace_path() != s.path() ||
      unit.runs_size() != static_cast<int>(plan.runs.size()))
    return Status::FailedPrecondition("unit of sample '" + s.id() + "' does not match the sweep's sample (" +
                                      unit.sample_id() + ", " + unit.trace_path() + ", " +
                                      std::to_string(unit.runs_size()) + " runs)");
  return unit;
}

std::optional<SweepUnit> ReusableUnit(const SweepPlan& plan, size_t i, const std::string& units_dir,
                                      const std::string& trace_hash) {
  const fs::path path = fs::path(units_dir) / plan.UnitFile(i);
  std::error_code ec;
  if (units_dir.empty() || !fs::exists(path, ec)) return std::nullopt;
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  auto unit = ParseSweepUnit(plan, i, ss.str());
  if (!unit.ok() || unit->trace_hash() != trace_hash) return std::nullopt;
  return std::move(*unit);
}

StatusOr<SweepUnit> ComputeSweepUnit(const SweepPlan& plan, size_t i, int threads, Progress* progress,
                                     const std::string& read_path, const std::string& trace_hash) {
  const config::Sample& s = plan.samples.at(i);
  const std::string& path = read_path.empty() ? s.path() : read_path;
  KVSIM_ASSIGN_OR_RETURN(auto trace, OpenTrace(path));
  KVSIM_RETURN_IF_ERROR(CheckRuns(trace->meta(), plan.runs).WithContext(s.path()));
  KVSIM_ASSIGN_OR_RETURN(auto latency, MakeLatencyModel(plan.clock, trace->meta()));
  std::vector<RunResult> results;
  auto replay = [&](const std::string& h) {
    ReplayOptions ro{threads, latency.get(), progress, h, plan.chunk};
    KVSIM_ASSIGN_OR_RETURN(results, Replay(*trace, plan.runs, ro));
    return Status::Ok();
  };
  std::string hash = trace_hash;
  if (hash.empty()) {  // not hashed by the caller: beside the replay when that pays
    KVSIM_ASSIGN_OR_RETURN(hash, HashBesideReplay(path, threads, replay));
  } else {
    KVSIM_RETURN_IF_ERROR(replay(hash));
  }
  for (RunResult& r : results) r.set_trace_hash(hash);
  const std::string group = TraceGroup(trace->meta().model);
  SweepUnit unit;
  unit.set_sample_id(s.id());
  unit.set_trace_path(s.path());
  unit.set_trace_hash(hash);
  unit.set_definition_hash(plan.definition_hash);
  for (size_t j = 0; j < results.size(); ++j) {
    RunResult& r = results[j];
    const config::PolicySpec& ps = plan.run_policy[j];
    for (std::string& w :
         DegenerateRunWarnings(r, ps.name(), std::vector<std::string>(ps.set().begin(), ps.set().end())))
      r.add_warnings(std::move(w));
    if (!read_path.empty() && r.trace_path() == read_path) r.set_trace_path(s.path());  // not the copy's
    r.set_sample_id(s.id());
    *r.mutable_sample_tags() = s.tags();
    r.set_group(group);
    *unit.add_runs() = std::move(r);
  }
  return unit;
}

SweepResult AssembleSweep(const SweepPlan& plan, std::vector<StatusOr<SweepUnit>> units,
                          const std::string& units_dir) {
  SweepResult out;
  out.set_experiment(ToTextWithDefaults(plan.experiment));
  for (size_t i = 0; i < units.size() && i < plan.samples.size(); ++i) {
    if (!units[i].ok()) {
      FailedUnit* f = out.add_failed_units();
      f->set_sample_id(plan.samples[i].id());
      f->set_trace_path(plan.samples[i].path());
      f->set_error(units[i].status().message());
      continue;
    }
    for (auto& r : *units[i]->mutable_runs()) *out.add_runs() = std::move(r);
  }
  // Unit files of other experiments or removed samples are stale: the folder holds this sweep's units only.
  if (!units_dir.empty()) {
    std::set<std::string> unit_files;
    for (size_t i = 0; i < plan.samples.size(); ++i) unit_files.insert(plan.UnitFile(i));
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(units_dir, ec))
      if (!unit_files.count(e.path().filename().string())) fs::remove(e.path(), ec);
  }
  const std::vector<RunResult> all(out.runs().begin(), out.runs().end());
  for (Aggregate& a : AggregateRuns(all, plan.experiment.seed(), plan.experiment.bootstrap_resamples()))
    *out.add_aggregates() = std::move(a);
  return out;
}

StatusOr<SweepResult> RunSweep(const config::Experiment& experiment, const std::string& base_dir,
                               const RunOptions& options, SweepUnits* units) {
  KVSIM_ASSIGN_OR_RETURN(SweepPlan plan, PlanSweep(experiment, base_dir, options));
  const std::string units_dir = units ? units->units_dir : "";
  if (!units_dir.empty()) {
    std::error_code ec;
    fs::create_directories(units_dir, ec);
    if (ec) return Status::InvalidArgument(units_dir + ": cannot create the units folder: " + ec.message());
  }
  Progress progress = Progress::FromEnv("sweep", options.progress);
  std::vector<StatusOr<SweepUnit>> done;
  for (size_t i = 0; i < plan.samples.size(); ++i) {
    progress.SetOuter("trace", static_cast<int>(i) + 1, static_cast<int>(plan.samples.size()));
    // A unit: reuse a matching finished unit (--resume with a unit file: the trace is hashed first, to
    // compare), or replay all runs on the trace (ComputeSweepUnit hashes it, beside the replay when that
    // pays).
    auto unit = [&]() -> StatusOr<SweepUnit> {
      std::string hash;
      std::error_code ec;
      if (units && units->resume && fs::exists(fs::path(units_dir) / plan.UnitFile(i), ec)) {
        KVSIM_ASSIGN_OR_RETURN(hash, CachedHashFile(plan.samples[i].path()));
        if (auto old = ReusableUnit(plan, i, units_dir, hash)) {
          ++units->reused;
          return std::move(*old);
        }
      }
      KVSIM_ASSIGN_OR_RETURN(SweepUnit unit, ComputeSweepUnit(plan, i, options.threads, &progress, "", hash));
      if (!units_dir.empty())
        KVSIM_RETURN_IF_ERROR(WriteFileAtomic((fs::path(units_dir) / plan.UnitFile(i)).string(),
                                              ToJsonSplit(unit, "runs", options.threads)));
      if (units) ++units->computed;
      return unit;
    }();
    done.push_back(std::move(unit));
  }
  progress.Finish();
  return AssembleSweep(plan, std::move(done), units_dir);
}

namespace {

// The dataset part of summary.md (analysis/dataset.h): failed units, the aggregates over two or more samples.
std::string SweepDatasetMarkdown(const SweepResult& result) {
  std::set<std::string> samples;
  for (const RunResult& r : result.runs()) samples.insert(r.sample_id());
  return DatasetMarkdown(std::vector<Aggregate>(result.aggregates().begin(), result.aggregates().end()),
                         result.failed_units(), static_cast<int>(samples.size()),
                         {{"retained_mass_mean", "retained mass"},
                          {"output_rel_error_mean", "out err mean"},
                          {"regret_vs_oracle_mean", "regret vs oracle"},
                          {"kv_memory_ratio", "KV mem vs full"}});
}

}  // namespace

Status WriteSweepOutputs(const SweepResult& result, const std::string& out_dir, int threads) {
  // The texts are independent functions of the result, formatted on up to two threads (the sweep's serial
  // end): the tables and the summary in one item, results.json in the others (the rest of the result, then
  // each run's JSON: SplitJson), which the other thread takes while the tables are formatted.
  std::string text[5];
  SplitJson json(result, "runs");
  ParallelFor(1 + json.parts(), std::min(threads > 0 ? threads : DefaultThreads(), 2), [&](int i) {
    if (i > 0) {
      json.Print(i - 1);
      return;
    }
    const std::vector<RunResult> runs(result.runs().begin(), result.runs().end());
    const std::vector<Aggregate> aggregates(result.aggregates().begin(), result.aggregates().end());
    text[1] = RunsCsv(runs);
    text[2] = LayersCsv(runs);
    text[3] = AggregatesCsv(aggregates);
    text[4] = SummaryMarkdown(runs, "kvsim sweep summary") + SweepDatasetMarkdown(result);
  });
  text[0] = json.Join();
  return WriteOutputFolder(out_dir, {{"results.json", std::move(text[0])},
                                     {"runs.csv", std::move(text[1])},
                                     {"layers.csv", std::move(text[2])},
                                     {"aggregates.csv", std::move(text[3])},
                                     {"summary.md", std::move(text[4])}});
}

}  // namespace kvsim
