// kvsim._core: the replay engine in-process for the `kvsim` Python package (python/kvsim/, docs/python.md).
// Every entry point calls the same library functions as the CLI (analysis/sweep.h, analysis/stream_sweep.h,
// analysis/report.h) and returns results as the same protobuf JSON that `kvsim run` / `kvsim sweep` write, so
// the two cannot drift. The GIL is released while traces are read and replayed. A Status error becomes
// kvsim.errors.KvsimError carrying the message the CLI prints after "kvsim: error: ".

#include <google/protobuf/stubs/logging.h>
#include <google/protobuf/text_format.h>
#include <google/protobuf/util/json_util.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "analysis/report.h"
#include "analysis/stream_sweep.h"
#include "analysis/sweep.h"
#include "analysis/trace_stats.h"
#include "policies/registry.h"
#include "policies/stream_registry.h"
#include "sim/attention.h"
#include "sim/blas.h"
#include "sim/parallel.h"
#include "sim/replay.h"
#include "sim/version.h"
#include "traces/hash_cache.h"
#include "traces/hdf5_trace.h"

namespace nb = nanobind;

namespace kvsim {
namespace {

const char* CodeName(StatusCode c) {
  switch (c) {
    case StatusCode::kOk:
      return "ok";
    case StatusCode::kInvalidArgument:
      return "invalid_argument";
    case StatusCode::kNotFound:
      return "not_found";
    case StatusCode::kDataLoss:
      return "data_loss";
    case StatusCode::kFailedPrecondition:
      return "failed_precondition";
    case StatusCode::kInternal:
      return "internal";
  }
  return "unknown";
}

// Raises kvsim.KvsimError(message, code). Call with the GIL held.
[[noreturn]] void Raise(const Status& st) {
  nb::object cls = nb::module_::import_("kvsim.errors").attr("KvsimError");
  nb::object exc = cls(st.message(), CodeName(st.code()));
  PyErr_SetObject(cls.ptr(), exc.ptr());
  throw nb::python_error();
}

template <typename T>
T ValueOrRaise(StatusOr<T> v) {
  if (!v.ok()) Raise(v.status());
  return std::move(v).value();
}

void RaiseIfError(const Status& st) {
  if (!st.ok()) Raise(st);
}

StatusOr<QuestionMode> ParseQuestionMode(const std::string& s) {
  if (s == "aware" || s == "query_aware") return QuestionMode::kQueryAware;
  if (s == "agnostic" || s == "query_agnostic") return QuestionMode::kQueryAgnostic;
  return Status::InvalidArgument("question_mode='" + ForMessage(s) + "': expected 'aware' or 'agnostic'");
}

// `kvsim run`: one policy at one budget. Plain traces need budget_fraction in (0, 1] or budget_tokens >= 1
// (exactly one; the Python wrapper checks that); streaming traces take budget_tokens (0 = the policy's
// default). Returns (streaming, result JSON).
std::pair<bool, std::string> Run(const std::string& trace, const std::string& policy,
                                 const std::vector<std::string>& sets, double budget_fraction,
                                 int budget_tokens, const std::string& question_mode, int threads,
                                 const std::string& latency_model, const std::string& device,
                                 const std::string& model, int prefill_chunk, bool progress) {
  const RunOptions options{threads, progress, latency_model, prefill_chunk, device, model};
  StatusOr<bool> streaming = false;
  {
    nb::gil_scoped_release release;
    streaming = IsStreamingTrace(trace);
  }
  // A missing trace is reported by the run itself (the CLI's order of checks).
  if (!streaming.ok() && streaming.status().code() != StatusCode::kNotFound) Raise(streaming.status());
  if (streaming.ok() && *streaming) {
    RaiseIfError(CheckStreamingPolicyName(policy).WithContext(trace));
    if (budget_fraction > 0)
      Raise(Status::InvalidArgument(
          trace +
          " is a streaming trace: give budget_tokens=N (retrieved visual tokens per layer and KV head) or no "
          "budget (the policy's default), not budget="));
    StatusOr<StreamRunResult> res = Status::Internal("not run");
    {
      nb::gil_scoped_release release;
      res = RunStreamOne(trace, policy, sets, budget_tokens, options);
    }
    return {true, ToJson(ValueOrRaise(std::move(res)))};
  }
  const QuestionMode mode = ValueOrRaise(ParseQuestionMode(question_mode));
  if (budget_fraction <= 0 && budget_tokens <= 0)
    Raise(
        Status::InvalidArgument("give budget= (a fraction of the prompt kept, in (0, 1]) or budget_tokens= "
                                "(tokens kept per layer per KV head)"));
  StatusOr<RunResult> res = Status::Internal("not run");
  {
    nb::gil_scoped_release release;
    res = RunOne(trace, policy, sets, budget_fraction, budget_tokens, mode, options);
  }
  return {false, ToJson(ValueOrRaise(std::move(res)))};
}

// The JSON mapping of analysis/experiment.proto (field names as in the .textproto).
config::Experiment ExperimentFromJson(const std::string& json) {
  config::Experiment e;
  google::protobuf::util::JsonParseOptions jo;
  const auto st = google::protobuf::util::JsonStringToMessage(json, &e, jo);
  if (!st.ok())
    Raise(Status::InvalidArgument("kvsim.sweep experiment: " + ForMessage(std::string(st.message()))));
  return e;
}

// `kvsim sweep`: the experiment from a file (`config`; relative paths resolve against its folder) with the
// fields named in `replace` taken from `experiment_json`, or, without a file, `experiment_json` itself
// (relative paths resolve against the working directory). Either way it is checked by the parser of
// experiment files. Writes the CLI's output folder when `out_dir` is set. Returns (streaming, SweepResult /
// StreamSweepResult JSON).
std::pair<bool, std::string> Sweep(const std::string& config, const std::string& experiment_json,
                                   const std::vector<std::string>& replace, int threads,
                                   const std::string& latency_model, const std::string& device,
                                   const std::string& model, int prefill_chunk, bool progress,
                                   const std::string& out_dir, bool resume) {
  config::Experiment exp;
  std::string base = ".";
  const config::Experiment fields = ExperimentFromJson(experiment_json);
  if (!config.empty()) {
    exp = ValueOrRaise(LoadExperiment(config));
    base = std::filesystem::path(config).parent_path().string();
    if (base.empty()) base = ".";
    // Traces given here are relative to the working directory (the CLI's --trace).
    if (fields.traces_size() > 0) base = ".";
    // Every field named in `replace` is replaced (an empty list clears it).
    for (const std::string& name : replace) {
      const auto* f = exp.GetDescriptor()->FindFieldByName(name);
      if (!f)
        Raise(Status::InvalidArgument("kvsim.sweep: the experiment has no field '" + ForMessage(name) + "'"));
      exp.GetReflection()->ClearField(&exp, f);
    }
    exp.MergeFrom(fields);
  } else {
    exp = fields;
  }
  const std::string what = config.empty() ? std::string("kvsim.sweep experiment") : config;
  std::string text;
  google::protobuf::TextFormat::PrintToString(exp, &text);
  exp = ValueOrRaise(ParseExperiment(text, what));
  const RunOptions options{threads, progress, latency_model, prefill_chunk, device, model};
  StatusOr<bool> streaming = false;
  {
    nb::gil_scoped_release release;
    streaming = ExperimentIsStreaming(exp, base);
  }
  if (ValueOrRaise(std::move(streaming))) {
    StatusOr<StreamSweepResult> res = Status::Internal("not run");
    Status written;
    {
      nb::gil_scoped_release release;
      // With an output folder, the same folder as `kvsim sweep` (units kept in out_dir/units).
      written = out_dir.empty() ? Status::Ok() : CheckOutputFolder(out_dir, kStreamSweepOutputNames);
      SweepUnits units{out_dir.empty() ? "" : (std::filesystem::path(out_dir) / kUnitsFolder).string(),
                       resume};
      if (written.ok())
        res =
            RunStreamSweep(exp, base, RunOptions{threads, progress, latency_model, 0, device, model}, &units);
      else
        res = written;
      if (res.ok() && !out_dir.empty()) written = WriteStreamSweepOutputs(*res, out_dir);
    }
    if (!res.ok()) Raise(res.status().WithContext(what));
    RaiseIfError(written);
    return {true, ToJson(*res)};
  }
  StatusOr<SweepResult> res = Status::Internal("not run");
  Status written;
  {
    nb::gil_scoped_release release;
    // With an output folder, the same folder as `kvsim sweep`: the units are kept in out_dir/units.
    written = out_dir.empty() ? Status::Ok() : CheckOutputFolder(out_dir, kSweepOutputNames);
    SweepUnits units{out_dir.empty() ? "" : (std::filesystem::path(out_dir) / kUnitsFolder).string(), resume};
    res = written.ok() ? RunSweep(exp, base, options, &units) : StatusOr<SweepResult>(written);
    if (res.ok() && !out_dir.empty()) written = WriteSweepOutputs(*res, out_dir);
  }
  if (!res.ok()) Raise(res.status().WithContext(what));
  RaiseIfError(written);
  return {false, ToJson(*res)};
}

// ---- Traces
// -------------------------------------------------------------------------------------------------

// A std::vector handed to NumPy without a copy: the array owns it through a capsule.
template <typename T>
nb::ndarray<nb::numpy, T> ToNumpy(std::vector<T>&& v, std::initializer_list<size_t> shape) {
  auto* owned = new std::vector<T>(std::move(v));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(owned->data(), shape, owner);
}

template <typename E>
std::vector<uint8_t> Codes(const std::vector<E>& v) {
  std::vector<uint8_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = static_cast<uint8_t>(v[i]);
  return out;
}

nb::dict ModelDict(const ModelInfo& m) {
  nb::dict d;
  d["name"] = m.name;
  d["family"] = m.family;
  d["num_layers"] = m.num_layers;
  d["num_heads"] = m.num_heads;
  d["num_kv_heads"] = m.num_kv_heads;
  d["head_dim"] = m.head_dim;
  d["softmax_scale"] = m.softmax_scale;
  d["causal"] = m.causal;
  d["sliding_window"] = m.sliding_window;
  d["logit_softcap"] = m.logit_softcap;
  d["rope_theta"] = m.rope_theta;
  d["model_dtype"] = m.model_dtype;
  return d;
}

nb::object StreamDict(const TraceMeta& meta) {
  if (!meta.stream) return nb::none();
  const StreamInfo& s = *meta.stream;
  nb::dict d;
  d["fps"] = s.fps;
  d["init_len"] = s.init_len;
  d["tokens_per_frame"] = s.tokens_per_frame;
  d["num_frames"] = s.num_frames;
  d["frame_time_s"] = ToNumpy(std::vector<double>(s.frame_time_s), {s.frame_time_s.size()});
  nb::list questions;
  for (const StreamQuestion& q : s.questions) {
    nb::dict qd;
    qd["time_s"] = q.time_s;
    qd["token_begin"] = q.token_begin;
    qd["num_question_tokens"] = q.num_question_tokens;
    qd["num_answer_tokens"] = q.num_answer_tokens;
    qd["frames_before"] = q.frames_before;
    qd["evidence_frames"] = q.evidence_frames;
    questions.append(qd);
  }
  d["questions"] = questions;
  nb::list blocks;
  for (const BlockEncodingInfo& b : s.block_encodings) {
    nb::dict bd;
    bd["granularity"] = b.granularity;
    bd["num_blocks"] = b.num_blocks;
    bd["attention_layers"] = b.attention_layers;
    blocks.append(bd);
  }
  d["block_encodings"] = blocks;
  return d;
}

// One opened trace file (the CLI's reader: same validation, same messages). Reads are serialised per trace
// (TraceSource::ReadLayer is never concurrent with itself).
class PyTrace {
 public:
  explicit PyTrace(const std::string& path) : path_(path) {
    StatusOr<std::unique_ptr<TraceSource>> src = Status::Internal("not opened");
    {
      nb::gil_scoped_release release;
      src = OpenTrace(path);
    }
    source_ = ValueOrRaise(std::move(src));
  }

  const std::string& path() const { return path_; }

  nb::dict Meta() const {
    const TraceMeta& m = source_->meta();
    nb::dict d;
    d["format_version"] = m.format_version;
    d["model"] = ModelDict(m.model);
    d["prefill_length"] = m.prefill_length;
    d["num_decode_steps"] = m.num_decode_steps;
    d["total_tokens"] = m.total_tokens();
    d["source"] = m.source;
    d["generator"] = m.generator;
    d["generator_version"] = m.generator_version;
    d["seed"] = m.seed;
    d["storage_dtype"] = std::string(StorageDtypeName(m.storage_dtype));
    d["query_positions"] = ToNumpy(std::vector<int32_t>(m.query_positions), {m.query_positions.size()});
    d["has_prefill_column_sums"] = m.has_prefill_column_sums;
    d["prompt_entropy_regions"] =
        ToNumpy(std::vector<int32_t>(m.prompt_entropy_regions), {m.prompt_entropy_regions.size()});
    d["config_text"] = m.config_text;
    d["stream"] = StreamDict(m);
    const TraceIntegrity integ = source_->integrity();
    nb::dict id;
    id["known"] = integ.known;
    id["superblock_version"] = integ.superblock_version;
    id["datasets"] = integ.datasets;
    id["checksummed_datasets"] = integ.checksummed_datasets;
    id["variable_length_strings"] = integ.variable_length_strings;
    id["checksummed"] = integ.checksummed();
    id["text"] = integ.Text();
    d["integrity"] = id;
    return d;
  }

  // The token table as columns (enums as uint8 codes; their names in kvsim.trace).
  nb::dict Tokens() const {
    const TokenTable& t = source_->meta().tokens;
    const size_t n = static_cast<size_t>(t.size());
    nb::dict d;
    d["modality"] = ToNumpy(Codes(t.modality), {n});
    d["segment_id"] = ToNumpy(std::vector<int32_t>(t.segment_id), {n});
    d["patch_row"] = ToNumpy(std::vector<int32_t>(t.patch_row), {n});
    d["patch_col"] = ToNumpy(std::vector<int32_t>(t.patch_col), {n});
    d["position_id"] = ToNumpy(std::vector<int64_t>(t.position_id), {n});
    d["phase"] = ToNumpy(Codes(t.phase), {n});
    d["role"] = ToNumpy(Codes(t.role), {n});
    if (t.token_id.size() == n) d["token_id"] = ToNumpy(std::vector<int64_t>(t.token_id), {n});
    if (t.text.size() == n) d["text"] = t.text;
    return d;
  }

  nb::dict Layer(int layer) {
    const TraceMeta& m = source_->meta();
    if (layer < 0 || layer >= m.model.num_layers)
      Raise(Status::InvalidArgument(path_ + ": layer " + std::to_string(layer) + " out of range [0, " +
                                    std::to_string(m.model.num_layers) + ")"));
    LayerData data;
    Status st;
    {
      nb::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      st = source_->ReadLayer(layer, &data);
    }
    RaiseIfError(st);
    const size_t kv = m.model.num_kv_heads, h = m.model.num_heads, d = m.model.head_dim;
    const size_t t = m.total_tokens(), q = m.query_positions.size(), n = m.prefill_length;
    nb::dict out;
    out["layer"] = layer;
    out["keys"] = ToNumpy(std::move(data.keys), {kv, t, d});
    out["values"] = ToNumpy(std::move(data.values), {kv, t, d});
    out["queries"] = ToNumpy(std::move(data.queries), {h, q, d});
    if (data.prefill_column_sums.empty())
      out["prefill_column_sums"] = nb::none();
    else
      out["prefill_column_sums"] = ToNumpy(std::move(data.prefill_column_sums), {h, n});
    const size_t regions = m.prompt_entropy_regions.size();
    if (data.prompt_entropies.empty())
      out["prompt_entropies"] = nb::none();
    else
      out["prompt_entropies"] = ToNumpy(std::move(data.prompt_entropies),
                                        {regions, static_cast<size_t>(kNumPromptEntropyKinds), h});
    return out;
  }

  // `kvsim inspect --json`: measured decode-attention statistics (plain traces) or the stream summary.
  std::string StatsJson(int threads) {
    const TraceMeta& m = source_->meta();
    if (m.is_streaming()) return StreamSummaryJson(m);
    StatusOr<TraceStats> stats = Status::Internal("not computed");
    {
      nb::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      stats = ComputeTraceStats(*source_, threads);
    }
    return TraceStatsToJson(m, ValueOrRaise(std::move(stats)));
  }

  std::string Hash() const {
    StatusOr<std::string> h = Status::Internal("not computed");
    {
      nb::gil_scoped_release release;
      h = HashFileAndRemember(path_, HashCacheFromEnv());  // as `kvsim hash`: always read
    }
    return ValueOrRaise(std::move(h));
  }

 private:
  std::string path_;
  std::unique_ptr<TraceSource> source_;
  std::mutex mu_;
};

// ---- Sweeps in units (kvsim.ray, docs/cluster.md)
// ------------------------------------------------------------------------------------

// A `kvsim sweep` split into units: made in the driver from kvsim sweep's arguments (every check the CLI
// makes, nothing written), or in a Ray task from the driver's plan (experiment bytes, base folder, clock
// options; no trace opened). Units are computed here in-process and returned as the JSON a unit file holds;
// the driver writes them and assembles the outputs with AssembleSweep, the code a resumed `kvsim sweep`
// ends in, so the outputs are byte-identical.
class PySweepPlan {
 public:
  PySweepPlan(SweepPlan plan, std::string out_dir) : plan_(std::move(plan)), out_dir_(std::move(out_dir)) {}

  static PySweepPlan FromArgs(const std::string& config, const std::vector<std::string>& traces,
                              const std::string& manifest, const std::string& latency_model,
                              const std::string& device, const std::string& model, int prefill_chunk,
                              const std::string& out) {
    StatusOr<SweepPlan> plan = Status::Internal("not planned");
    std::string out_dir;
    {
      nb::gil_scoped_release release;
      plan = [&]() -> StatusOr<SweepPlan> {
        KVSIM_ASSIGN_OR_RETURN(out_dir, NormalizeOutputFolder("--out", out));
        KVSIM_ASSIGN_OR_RETURN(SweepInput input, LoadSweepInput(config, traces, manifest));
        if (prefill_chunk < -1)
          return Status::InvalidArgument("--prefill-chunk must be >= 0 (0 = whole prompt)");
        KVSIM_ASSIGN_OR_RETURN(bool streaming, ExperimentIsStreaming(input.experiment, input.base_dir));
        if (streaming)
          return Status::InvalidArgument(
              config +
              ": a streaming experiment; streaming sweeps run in one process (kvsim sweep), not on Ray yet");
        KVSIM_RETURN_IF_ERROR(CheckOutputFolder(out_dir, kSweepOutputNames));
        const RunOptions options{0, false, latency_model, prefill_chunk, device, model};
        auto p = PlanSweep(input.experiment, input.base_dir, options, /*check_traces=*/true);
        if (!p.ok()) return p.status().WithContext(config);
        return p;
      }();
    }
    return PySweepPlan(ValueOrRaise(std::move(plan)), out_dir);
  }

  static PySweepPlan FromBytes(const nb::bytes& experiment, const std::string& base_dir,
                               const std::string& latency_model, const std::string& device,
                               const std::string& model, int prefill_chunk) {
    config::Experiment e;
    if (!e.ParseFromString(std::string(experiment.c_str(), experiment.size())))
      Raise(Status::InvalidArgument("a sweep plan's experiment does not parse (another kvsim build?)"));
    const RunOptions options{0, false, latency_model, prefill_chunk, device, model};
    return PySweepPlan(ValueOrRaise(PlanSweep(e, base_dir, options, /*check_traces=*/false)), "");
  }

  nb::bytes ExperimentBytes() const {
    const std::string b = plan_.experiment.SerializeAsString();
    return nb::bytes(b.data(), b.size());
  }
  const std::string& BaseDir() const { return plan_.base_dir; }
  const std::string& DefinitionHash() const { return plan_.definition_hash; }
  const std::string& OutDir() const { return out_dir_; }
  std::string UnitsDir() const { return (std::filesystem::path(out_dir_) / kUnitsFolder).string(); }
  int NumRuns() const { return static_cast<int>(plan_.runs.size()); }

  // [(id, path as recorded in the results)], in sweep order.
  std::vector<std::pair<std::string, std::string>> Samples() const {
    std::vector<std::pair<std::string, std::string>> out;
    for (const config::Sample& s : plan_.samples) out.emplace_back(s.id(), s.path());
    return out;
  }
  std::string UnitFile(size_t i) const {
    CheckIndex(i);
    return plan_.UnitFile(i);
  }

  // --resume: the finished unit file of sample i (its trace hashed here), or None.
  nb::object Reusable(size_t i) const {
    CheckIndex(i);
    std::optional<SweepUnit> unit;
    {
      nb::gil_scoped_release release;
      auto hash = CachedHashFile(plan_.samples[i].path());
      if (hash.ok()) unit = ReusableUnit(plan_, i, UnitsDir(), *hash);
    }
    if (!unit) return nb::none();
    return nb::str(ToJson(*unit).c_str());
  }

  // Sample i's unit, all runs, as the JSON of its unit file; the trace read from read_path when set.
  std::string Compute(size_t i, int threads, const std::string& read_path) const {
    CheckIndex(i);
    StatusOr<SweepUnit> unit = Status::Internal("not run");
    {
      nb::gil_scoped_release release;
      unit = ComputeSweepUnit(plan_, i, threads, nullptr, read_path);
    }
    return ToJson(ValueOrRaise(std::move(unit)));
  }

  // Checks a unit's JSON against sample i (definition hash, sample, runs) and writes it atomically to
  // OUT/units/ (created). Raises when it does not belong to this sweep.
  void WriteUnit(size_t i, const std::string& json) const {
    CheckIndex(i);
    ValueOrRaise(ParseSweepUnit(plan_, i, json));
    Status st;
    {
      nb::gil_scoped_release release;
      std::error_code ec;
      std::filesystem::create_directories(UnitsDir(), ec);
      st = ec ? Status::InvalidArgument(UnitsDir() + ": cannot create the units folder: " + ec.message())
              : WriteFileAtomic((std::filesystem::path(UnitsDir()) / plan_.UnitFile(i)).string(), json);
    }
    RaiseIfError(st);
  }

  // The outputs from one entry per sample: a unit's JSON, or the reason it failed (failed=True). Writes
  // OUT (results.json, runs.csv, layers.csv, aggregates.csv, summary.md) like `kvsim sweep`; returns the
  // SweepResult JSON.
  std::string Finish(const std::vector<std::pair<bool, std::string>>& entries) const {
    if (entries.size() != plan_.samples.size())
      Raise(Status::InvalidArgument("finish: " + std::to_string(entries.size()) + " entries for " +
                                    std::to_string(plan_.samples.size()) + " samples"));
    std::vector<StatusOr<SweepUnit>> units;
    for (size_t i = 0; i < entries.size(); ++i)
      units.push_back(entries[i].first ? StatusOr<SweepUnit>(Status::InvalidArgument(entries[i].second))
                                       : ParseSweepUnit(plan_, i, entries[i].second));
    StatusOr<SweepResult> res = Status::Internal("not assembled");
    Status written;
    {
      nb::gil_scoped_release release;
      std::error_code ec;
      const bool have_units = std::filesystem::is_directory(UnitsDir(), ec);
      res = AssembleSweep(plan_, std::move(units), have_units ? UnitsDir() : "");
      written = WriteSweepOutputs(*res, out_dir_);
    }
    RaiseIfError(written);
    return ToJson(*res);
  }

 private:
  void CheckIndex(size_t i) const {
    if (i >= plan_.samples.size())
      Raise(Status::InvalidArgument("sample index " + std::to_string(i) + " out of range [0, " +
                                    std::to_string(plan_.samples.size()) + ")"));
  }
  SweepPlan plan_;
  std::string out_dir_;
};

nb::list Policies() {
  nb::list out;
  for (const PolicyInfo& p : PolicyRegistry::Default().List()) {
    auto policy = PolicyRegistry::Default().Create(p.name);
    nb::dict d;
    d["name"] = p.name;
    d["summary"] = p.summary;
    d["params_type"] = p.params_type;
    d["defaults"] = policy.ok() ? (*policy)->ParamsText() : std::string();
    d["uses_budget"] = p.uses_budget;
    d["streaming"] = false;
    out.append(d);
  }
  for (const StreamPolicyInfo& p : StreamPolicyRegistry::Default().List()) {
    auto policy = StreamPolicyRegistry::Default().Create(p.name);
    nb::dict d;
    d["name"] = p.name;
    d["summary"] = p.summary;
    d["params_type"] = p.params_type;
    d["defaults"] = policy.ok() ? (*policy)->ParamsText() : std::string();
    d["uses_budget"] = true;
    d["streaming"] = true;
    out.append(d);
  }
  return out;
}

// ---- Recorded prompt entropies for trace writers in Python (the capture tool, docs/capture.md)
// -------------------------------------------------------------------------------------------------

template <typename T>
using CpuArray = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;

// The regions `kvsim synth` records (PromptEntropyRegions, sim/replay.h); `role`: the prompt's role codes
// (n entries).
nb::ndarray<nb::numpy, int32_t> PromptEntropyRegionsOfRoles(CpuArray<uint8_t> role) {
  if (role.ndim() != 1 || role.shape(0) == 0)
    Raise(
        Status::InvalidArgument("prompt_entropy_regions: role must be a non-empty 1-D uint8 array of the "
                                "prompt's role codes"));
  TraceMeta meta;
  meta.prefill_length = static_cast<int>(role.shape(0));
  meta.tokens.role.resize(role.shape(0));
  for (size_t i = 0; i < role.shape(0); ++i) {
    if (role.data()[i] >= kNumRoles)
      Raise(Status::InvalidArgument("prompt_entropy_regions: role[" + std::to_string(i) +
                                    "] = " + std::to_string(role.data()[i]) + " is not a role code (0.." +
                                    std::to_string(kNumRoles - 1) + ")"));
    meta.tokens.role[i] = static_cast<Role>(role.data()[i]);
  }
  std::vector<int32_t> regions = PromptEntropyRegions(meta);
  const size_t r = regions.size();
  return ToNumpy(std::move(regions), {r});
}

// Checks a region list as the reader does (1 to 64 entries; PromptEntropyRegionsIssue, as
// TraceMeta::Validate).
Status CheckRegions(const std::vector<int32_t>& regions, int prefill_length) {
  if (regions.empty() || regions.size() > 64)
    return Status::InvalidArgument("prompt_entropy_regions must have 1 to 64 entries, got " +
                                   std::to_string(regions.size()));
  if (std::string issue = PromptEntropyRegionsIssue(regions, prefill_length); !issue.empty())
    return Status::InvalidArgument("prompt_entropy_regions " + issue);
  return Status::Ok();
}

std::vector<int32_t> Regions(CpuArray<int32_t> regions) {
  if (regions.ndim() != 1) Raise(Status::InvalidArgument("prompt_entropy_regions must be a 1-D int32 array"));
  return std::vector<int32_t>(regions.data(), regions.data() + regions.shape(0));
}

// One layer's [regions, kinds, num_heads] entropies, HeadPromptEntropies per (region, query head) exactly as
// kvsim synth and MEDA compute them. queries: [H, rows, d] float32, positions 0.. (rows >= the last region);
// keys: [Hkv, rows, d] float32, positions 0..; modality: codes of positions 0.. (>= the last region).
// Heads run on `threads` threads (<= 0: all cores); each head's result is independent of the thread count.
nb::ndarray<nb::numpy, double> PromptEntropies(CpuArray<float> queries, CpuArray<float> keys,
                                               CpuArray<uint8_t> modality, CpuArray<int32_t> regions_in,
                                               double softmax_scale, int sliding_window, double logit_softcap,
                                               bool causal, int threads) {
  const std::vector<int32_t> regions = Regions(regions_in);
  auto bad = [](const std::string& what) { Raise(Status::InvalidArgument("prompt_entropies: " + what)); };
  if (queries.ndim() != 3 || keys.ndim() != 3)
    bad("queries and keys must be 3-D [heads, positions, head_dim]");
  const int h = static_cast<int>(queries.shape(0)), hkv = static_cast<int>(keys.shape(0));
  const int d = static_cast<int>(queries.shape(2));
  if (h < 1 || hkv < 1 || h % hkv != 0)
    bad("query heads (" + std::to_string(h) + ") must be a positive multiple of KV heads (" +
        std::to_string(hkv) + ")");
  if (d < 1 || static_cast<int>(keys.shape(2)) != d)
    bad("queries and keys must have the same head_dim >= 1, got " + std::to_string(d) + " and " +
        std::to_string(keys.shape(2)));
  const int rows = static_cast<int>(std::min(queries.shape(1), keys.shape(1)));
  if (modality.ndim() != 1) bad("modality must be a 1-D uint8 array");
  RaiseIfError(CheckRegions(regions, static_cast<int>(std::min<size_t>(rows, modality.shape(0))))
                   .WithContext("prompt_entropies: queries, keys and modality must cover every region"));
  if (!(softmax_scale > 0) || !std::isfinite(softmax_scale)) bad("softmax_scale must be finite and > 0");
  if (sliding_window < 0 || !(logit_softcap >= 0) || !std::isfinite(logit_softcap))
    bad("sliding_window and logit_softcap must be >= 0");
  ModelInfo m;
  m.num_layers = 1;
  m.num_heads = h;
  m.num_kv_heads = hkv;
  m.head_dim = d;
  m.softmax_scale = softmax_scale;
  m.causal = causal;
  m.sliding_window = sliding_window;
  m.logit_softcap = logit_softcap;
  const int ce_max = regions.back();
  std::vector<Modality> mod(ce_max);
  for (int j = 0; j < ce_max; ++j) {
    if (modality.data()[j] >= kNumModalities)
      bad("modality[" + std::to_string(j) + "] = " + std::to_string(modality.data()[j]) +
          " is not a modality code (0.." + std::to_string(kNumModalities - 1) + ")");
    mod[j] = static_cast<Modality>(modality.data()[j]);
  }
  const size_t r = regions.size();
  std::vector<double> out(r * kNumPromptEntropyKinds * h);
  {
    nb::gil_scoped_release release;
    EnsureSingleThreadedBlas();
    const float* q = queries.data();
    const float* k = keys.data();
    const size_t q_rows = queries.shape(1), k_rows = keys.shape(1), group = h / hkv;
    ParallelFor(h, threads, [&](int head) {
      for (size_t i = 0; i < r; ++i) {
        double e[kNumPromptEntropyKinds];
        HeadPromptEntropies(m, std::span<const Modality>(mod).first(regions[i]),
                            q + static_cast<size_t>(head) * q_rows * d, k + head / group * k_rows * d,
                            regions[i], true, true, e);
        for (int kind = 0; kind < kNumPromptEntropyKinds; ++kind)
          out[(i * kNumPromptEntropyKinds + kind) * h + head] = e[kind];
      }
    });
  }
  return ToNumpy(std::move(out), {r, static_cast<size_t>(kNumPromptEntropyKinds), static_cast<size_t>(h)});
}

// The reader's checks of one layer's recorded entropies (ValidatePromptEntropies: shape, range
// [0, log ce] with its slack, NaN) and of the region list, so a Python writer refuses what kvsim would.
void CheckPromptEntropies(nb::ndarray<const double, nb::c_contig, nb::device::cpu> values,
                          CpuArray<int32_t> regions_in, int num_heads, int prefill_length,
                          const std::string& where) {
  TraceMeta meta;
  meta.model.num_heads = num_heads;
  meta.prefill_length = prefill_length;
  meta.prompt_entropy_regions = Regions(regions_in);
  RaiseIfError(CheckRegions(meta.prompt_entropy_regions, prefill_length).WithContext(where));
  const size_t want[3] = {meta.prompt_entropy_regions.size(), static_cast<size_t>(kNumPromptEntropyKinds),
                          static_cast<size_t>(num_heads)};
  if (values.ndim() != 3 || values.shape(0) != want[0] || values.shape(1) != want[1] ||
      values.shape(2) != want[2])
    Raise(Status::InvalidArgument(
        where + " dataset 'prompt_entropies' must have shape [regions=" + std::to_string(want[0]) +
        ", kinds=" + std::to_string(want[1]) + ", num_heads=" + std::to_string(want[2]) + "]"));
  RaiseIfError(ValidatePromptEntropies(meta, std::span<const double>(values.data(), values.size()), where));
}

}  // namespace
}  // namespace kvsim

NB_MODULE(_core, m) {
  using namespace kvsim;
  // Errors reach Python as exceptions; keep protobuf's own log lines off stderr (as the CLI does).
  google::protobuf::SetLogHandler(nullptr);
  m.doc() = "kvsim's replay engine in-process (use the kvsim package, not this module)";
  m.attr("__version__") = std::string(kVersion);
  m.attr("git_commit") = std::string(kGitCommit);
  m.def("run", &Run, nb::arg("trace"), nb::arg("policy"), nb::arg("sets"), nb::arg("budget_fraction"),
        nb::arg("budget_tokens"), nb::arg("question_mode"), nb::arg("threads"), nb::arg("latency_model"),
        nb::arg("device"), nb::arg("model"), nb::arg("prefill_chunk"), nb::arg("progress"));
  m.def("sweep", &Sweep, nb::arg("config"), nb::arg("experiment_json"), nb::arg("replace"),
        nb::arg("threads"), nb::arg("latency_model"), nb::arg("device"), nb::arg("model"),
        nb::arg("prefill_chunk"), nb::arg("progress"), nb::arg("out_dir"), nb::arg("resume") = false);
  m.def("policies", &Policies);
  // The OpenBLAS kernels this process runs, and the set kvsim's rule asks for (sim/blas.h; kvsim._native).
  m.def("blas_core", &BlasCoreName);
  m.def("blas_core_to_request", [] {
    return BlasCoreToRequest(std::getenv("OPENBLAS_CORETYPE"), BlasCoreName(), ThisCpuVectorSupport());
  });
  m.def("prompt_entropy_regions", &PromptEntropyRegionsOfRoles, nb::arg("role"));
  m.def("prompt_entropies", &PromptEntropies, nb::arg("queries"), nb::arg("keys"), nb::arg("modality"),
        nb::arg("regions"), nb::arg("softmax_scale"), nb::arg("sliding_window"), nb::arg("logit_softcap"),
        nb::arg("causal"), nb::arg("threads"));
  m.def("check_prompt_entropies", &CheckPromptEntropies, nb::arg("values"), nb::arg("regions"),
        nb::arg("num_heads"), nb::arg("prefill_length"), nb::arg("where"));
  nb::class_<PySweepPlan>(m, "SweepPlan")
      .def_static("from_args", &PySweepPlan::FromArgs, nb::arg("config"), nb::arg("traces"),
                  nb::arg("manifest"), nb::arg("latency_model"), nb::arg("device"), nb::arg("model"),
                  nb::arg("prefill_chunk"), nb::arg("out"))
      .def_static("from_bytes", &PySweepPlan::FromBytes, nb::arg("experiment"), nb::arg("base_dir"),
                  nb::arg("latency_model"), nb::arg("device"), nb::arg("model"), nb::arg("prefill_chunk"))
      .def("experiment_bytes", &PySweepPlan::ExperimentBytes)
      .def_prop_ro("base_dir", &PySweepPlan::BaseDir)
      .def_prop_ro("definition_hash", &PySweepPlan::DefinitionHash)
      .def_prop_ro("out_dir", &PySweepPlan::OutDir)
      .def_prop_ro("units_dir", &PySweepPlan::UnitsDir)
      .def_prop_ro("num_runs", &PySweepPlan::NumRuns)
      .def("samples", &PySweepPlan::Samples)
      .def("unit_file", &PySweepPlan::UnitFile, nb::arg("i"))
      .def("reusable", &PySweepPlan::Reusable, nb::arg("i"))
      .def("compute", &PySweepPlan::Compute, nb::arg("i"), nb::arg("threads"), nb::arg("read_path"))
      .def("write_unit", &PySweepPlan::WriteUnit, nb::arg("i"), nb::arg("json"))
      .def("finish", &PySweepPlan::Finish, nb::arg("entries"));
  nb::class_<PyTrace>(m, "Trace")
      .def(nb::init<const std::string&>(), nb::arg("path"))
      .def_prop_ro("path", &PyTrace::path)
      .def("meta", &PyTrace::Meta)
      .def("tokens", &PyTrace::Tokens)
      .def("layer", &PyTrace::Layer, nb::arg("layer"))
      .def("stats_json", &PyTrace::StatsJson, nb::arg("threads"))
      .def("hash", &PyTrace::Hash);
}
