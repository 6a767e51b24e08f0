#include "analysis/stream_sweep.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>

#include "analysis/dataset.h"
#include "analysis/report.h"
#include "analysis/trace_stats.h"
#include "policies/registry.h"
#include "policies/stream_registry.h"
#include "sim/stream_replay.h"
#include "sim/text_proto.h"
#include "traces/hdf5_trace.h"

namespace kvsim {

namespace {

std::string Num(double v, int prec = 6) { return FormatNumber(v, prec); }

double Mb(double bytes) { return bytes / (1024.0 * 1024.0); }

}  // namespace

Status CheckStreamingPolicyName(const std::string& name) {
  if (StreamPolicyRegistry::Default().Find(name)) return Status::Ok();
  std::string known;
  for (const StreamPolicyInfo& i : StreamPolicyRegistry::Default().List())
    known += (known.empty() ? "" : ", ") + i.name;
  if (PolicyRegistry::Default().Find(name))
    return Status::InvalidArgument(
        "'" + name + "' is not a streaming policy and this is a streaming trace; streaming policies: " +
        known + " (docs/streaming.md)");
  return Status::Ok();  // the registry names the unknown policy
}

StatusOr<bool> IsStreamingTrace(const std::string& path) {
  KVSIM_ASSIGN_OR_RETURN(auto trace, OpenTrace(path));
  return trace->meta().is_streaming();
}

StatusOr<bool> ExperimentIsStreaming(const config::Experiment& experiment, const std::string& base_dir) {
  KVSIM_ASSIGN_OR_RETURN(std::vector<config::Sample> samples, ExperimentSamples(experiment, base_dir));
  const config::Sample *streaming = nullptr, *plain = nullptr;
  for (const config::Sample& s : samples) {
    KVSIM_ASSIGN_OR_RETURN(bool is, IsStreamingTrace(s.path()));
    (is ? streaming : plain) = &s;
    if (streaming && plain)
      return Status::InvalidArgument(
          "the sweep mixes streaming and non-streaming traces (sample '" + streaming->id() + "', " +
          streaming->path() + ", is a streaming trace; sample '" + plain->id() + "', " + plain->path() +
          ", is not): streaming policies replay streaming traces only; split the dataset into two sweeps");
  }
  return streaming != nullptr;
}

StatusOr<StreamRunResult> RunStreamOne(const std::string& trace_path, const std::string& policy,
                                       const std::vector<std::string>& sets, int budget_tokens,
                                       const RunOptions& options) {
  KVSIM_RETURN_IF_ERROR(CheckStreamingPolicyName(policy).WithContext(trace_path));
  KVSIM_ASSIGN_OR_RETURN(auto p, StreamPolicyRegistry::Default().Create(policy, sets));
  KVSIM_ASSIGN_OR_RETURN(auto trace, OpenTrace(trace_path));
  KVSIM_ASSIGN_OR_RETURN(
      auto latency,
      MakeLatencyModel(LatencySpec{options.latency_model, options.device, options.model}, trace->meta()));
  std::vector<StreamRunSpec> runs{StreamRunSpec{p, RunLabel(policy, sets), budget_tokens}};
  KVSIM_RETURN_IF_ERROR(CheckStreamRuns(trace->meta(), runs).WithContext(trace_path));
  Progress progress = Progress::FromEnv("streaming run", options.progress);
  std::vector<StreamRunResult> results;
  KVSIM_ASSIGN_OR_RETURN(std::string hash,
                         HashBesideReplay(trace_path, options.threads, [&](const std::string& h) {
                           StreamReplayOptions ro{options.threads, latency.get(), &progress, h, trace_path};
                           KVSIM_ASSIGN_OR_RETURN(results, ReplayStream(*trace, runs, ro));
                           return Status::Ok();
                         }));
  results[0].set_trace_hash(hash);
  progress.Finish();
  return results[0];
}

StatusOr<StreamSweepResult> RunStreamSweep(const config::Experiment& experiment, const std::string& base_dir,
                                           const RunOptions& options, SweepUnits* units) {
  if (!experiment.budgets().empty())
    return Status::InvalidArgument(
        "field 'budgets': streaming experiments take 'budget_tokens' (retrieved visual tokens per layer and "
        "KV head), not fractions of a history that keeps growing");
  std::vector<StreamRunSpec> runs;
  for (const config::PolicySpec& ps : experiment.policies()) {
    const std::vector<std::string> sets(ps.set().begin(), ps.set().end());
    KVSIM_RETURN_IF_ERROR(CheckStreamingPolicyName(ps.name()));
    KVSIM_ASSIGN_OR_RETURN(auto policy, StreamPolicyRegistry::Default().Create(ps.name(), sets));
    const StreamPolicyInfo* info = StreamPolicyRegistry::Default().Find(ps.name());
    const std::string label = ps.has_label() ? ps.label() : RunLabel(ps.name(), sets);
    if (!info->uses_budget || experiment.budget_tokens().empty()) {
      runs.push_back(StreamRunSpec{policy, label, 0});
      continue;
    }
    for (int b : experiment.budget_tokens()) runs.push_back(StreamRunSpec{policy, label, b});
  }
  const LatencySpec clock = ExperimentLatency(experiment, base_dir, options);
  if (experiment.bootstrap_resamples() < 1)
    return Status::InvalidArgument("field 'bootstrap_resamples' must be >= 1 (e.g. 2000)");
  KVSIM_ASSIGN_OR_RETURN(std::vector<config::Sample> samples, ExperimentSamples(experiment, base_dir));
  // Open and check every trace (and its clock, and its declared group) before replaying anything.
  std::vector<std::string> groups;
  for (const config::Sample& s : samples) {
    KVSIM_ASSIGN_OR_RETURN(auto trace, OpenTrace(s.path()));
    KVSIM_RETURN_IF_ERROR(CheckStreamRuns(trace->meta(), runs).WithContext(s.path()));
    auto latency = MakeLatencyModel(clock, trace->meta());
    if (!latency.ok()) return latency.status().WithContext(s.path());
    KVSIM_RETURN_IF_ERROR(CheckSampleGroup(s, trace->meta().model));
    groups.push_back(TraceGroup(trace->meta().model));
  }
  // Streaming replays have no prefill chunk: 0 in the definition hash.
  KVSIM_ASSIGN_OR_RETURN(const std::string def_hash, UnitDefinitionHash(experiment, clock, 0));
  StreamSweepResult out;
  out.set_experiment(ToTextWithDefaults(experiment));
  Progress progress = Progress::FromEnv("streaming sweep", options.progress);
  auto replay = [&](size_t i, const std::string& hash) -> StatusOr<std::vector<StreamRunResult>> {
    const config::Sample& s = samples[i];
    KVSIM_ASSIGN_OR_RETURN(auto trace, OpenTrace(s.path()));
    KVSIM_ASSIGN_OR_RETURN(auto latency, MakeLatencyModel(clock, trace->meta()));
    StreamReplayOptions ro{options.threads, latency.get(), &progress, hash, s.path()};
    KVSIM_ASSIGN_OR_RETURN(auto results, ReplayStream(*trace, runs, ro));
    for (StreamRunResult& r : results) {
      r.set_sample_id(s.id());
      *r.mutable_sample_tags() = s.tags();
      r.set_group(groups[i]);
    }
    return results;
  };
  std::vector<StreamSweepUnit> done;
  KVSIM_RETURN_IF_ERROR(RunUnits(samples, def_hash, static_cast<int>(runs.size()), units, progress, replay,
                                 &done, out.mutable_failed_units()));
  progress.Finish();
  for (StreamSweepUnit& u : done)
    for (auto& r : *u.mutable_runs()) *out.add_runs() = std::move(r);
  const std::vector<StreamRunResult> all(out.runs().begin(), out.runs().end());
  for (Aggregate& a : AggregateStreamRuns(all, experiment.seed(), experiment.bootstrap_resamples()))
    *out.add_aggregates() = std::move(a);
  return out;
}

std::vector<Aggregate> AggregateStreamRuns(const std::vector<StreamRunResult>& runs, uint64_t seed,
                                           int resamples) {
  std::vector<AggregateRow> rows;
  for (const StreamRunResult& r : runs) {
    const StreamQuestionResult& m = r.mean();
    // Evidence recall is -1 on traces without ground-truth evidence frames: not defined, left out.
    const double evidence = m.evidence_frame_recall() < 0 ? std::nan("") : m.evidence_frame_recall();
    rows.push_back(AggregateRow{r.group(),
                                r.policy(),
                                r.label(),
                                0,
                                r.budget_tokens(),
                                {m.retained_mass_mean(), m.output_rel_error_mean(), evidence,
                                 m.oracle_frame_recall(), m.oracle_mass_recall(), r.gpu_bytes_peak()}});
  }
  return AggregateRows(rows, kStreamAggregateMetrics, seed, resamples);
}

std::string FormatStreamSummary(const TraceMeta& meta) {
  const ModelInfo& m = meta.model;
  const StreamInfo& s = *meta.stream;
  std::ostringstream os;
  os << "model: " << m.name << " (" << m.family << "), " << m.num_layers << " layers, " << m.num_heads
     << " query heads / " << m.num_kv_heads << " KV heads, head_dim " << m.head_dim << ", rope_theta "
     << m.rope_theta << "\n";
  os << "source: " << meta.source << " (" << meta.generator << " " << meta.generator_version << "), seed "
     << meta.seed << "; storage " << StorageDtypeName(meta.storage_dtype) << "\n";
  const double duration = s.frame_time_s.empty() ? 0 : s.frame_time_s.back();
  os << "stream: init prompt " << s.init_len << " tokens, " << s.num_frames << " frames x "
     << s.tokens_per_frame << " tokens (" << static_cast<int64_t>(s.num_frames) * s.tokens_per_frame
     << " video tokens) at " << s.fps << " fps, last frame at " << Num(duration, 6) << " s; KV "
     << Num(KvBytesPerToken(meta) / 1024.0, 4) << " KiB per token (all layers)\n";
  os << "questions: " << s.questions.size() << "\n";
  os << "   #   time_s  frames_before  question  answer  evidence_frames\n";
  for (size_t i = 0; i < s.questions.size(); ++i) {
    const StreamQuestion& q = s.questions[i];
    std::string ev;
    for (int32_t f : q.evidence_frames) ev += (ev.empty() ? "" : ",") + std::to_string(f);
    os << std::setw(4) << i << std::setw(9) << Num(q.time_s, 6) << std::setw(15) << q.frames_before
       << std::setw(10) << q.num_question_tokens << std::setw(8) << q.num_answer_tokens << "  "
       << (ev.empty() ? "-" : ev) << "\n";
  }
  if (s.block_encodings.empty()) {
    os << "block encodings: none (policies that need them derive them from the continuous run: "
          "approximate)\n";
  } else {
    os << "block encodings:";
    for (const BlockEncodingInfo& b : s.block_encodings) {
      os << " g" << b.granularity << " (" << b.num_blocks << " blocks, attention at layers";
      for (int32_t l : b.attention_layers) os << " " << l;
      os << ")";
    }
    os << "\n";
  }
  return os.str();
}

std::string StreamSummaryJson(const TraceMeta& meta) {
  const StreamInfo& s = *meta.stream;
  InspectStream out;
  out.set_model(meta.model.name);
  out.set_num_layers(meta.model.num_layers);
  out.set_init_len(s.init_len);
  out.set_num_frames(s.num_frames);
  out.set_tokens_per_frame(s.tokens_per_frame);
  out.set_fps(s.fps);
  for (const StreamQuestion& q : s.questions) {
    InspectStreamQuestion* oq = out.add_questions();
    oq->set_time_s(q.time_s);
    oq->set_frames_before(q.frames_before);
    oq->set_question_tokens(q.num_question_tokens);
    oq->set_answer_tokens(q.num_answer_tokens);
    for (int32_t f : q.evidence_frames) oq->add_evidence_frames(f);
  }
  for (const BlockEncodingInfo& b : s.block_encodings) out.add_block_granularities(b.granularity);
  return ToJson(out);
}

namespace {

void QuestionColumns(const StreamQuestionResult& q, std::ostringstream& os) {
  const double v[] = {q.retained_mass_mean(),       q.retained_mass_p5(),
                      q.output_rel_error_mean(),    q.output_rel_error_p95(),
                      q.evidence_frame_recall(),    q.evidence_token_recall(),
                      q.oracle_frame_recall(),      q.oracle_mass_recall(),
                      q.visual_tokens_in_context(), q.context_tokens(),
                      q.frames_covered(),           q.duplicate_tokens(),
                      q.time_to_first_token_s(),    q.gpu_bytes_at_answer(),
                      q.cpu_bank_bytes_at_answer(), q.samples()};
  for (double x : v) os << ',' << CsvNumber(x);
}

const char* kQuestionHeader =
    "retained_mass_mean,retained_mass_p5,output_rel_error_mean,output_rel_error_p95,evidence_frame_recall,"
    "evidence_token_recall,oracle_frame_recall,oracle_mass_recall,visual_tokens_in_context,context_tokens,"
    "frames_covered,duplicate_tokens,time_to_first_token_s,gpu_bytes_at_answer,cpu_bank_bytes_at_answer,"
    "samples";

// The key columns every streaming table starts with (run = the run's index in results.json).
constexpr const char* kRunKeyHeader = "run,trace_hash,policy,label,budget_tokens";

void RunKey(size_t index, const StreamRunResult& r, std::ostringstream& os) {
  os << index << ',' << r.trace_hash() << ',' << CsvField(r.policy()) << ',' << CsvField(r.label()) << ','
     << r.budget_tokens();
}

}  // namespace

std::string StreamRunsCsv(const std::vector<StreamRunResult>& runs) {
  std::ostringstream os;
  os << kRunKeyHeader << ",trace,trace_source,model,trace_seed,parameters,time_unit,kvsim_version,git_commit,"
     << kQuestionHeader
     << ",approximate,cpu_bank_bytes_final,bank_tokens_final,bank_tokens_per_frame,gpu_bytes_peak,"
        "gpu_bytes_mean,encode_tokens,encode_passes_per_video_token,encode_busy_s,encode_lag_max_s,"
        "decode_token_steps,sample_id,tags,group\n";
  for (size_t i = 0; i < runs.size(); ++i) {
    const StreamRunResult& r = runs[i];
    RunKey(i, r, os);
    os << ',' << CsvField(r.trace_path()) << ',' << CsvField(r.trace_source()) << ','
       << CsvField(r.trace_model()) << ',' << r.trace_seed() << ',' << CsvField(r.parameters()) << ','
       << r.time_unit() << ',' << CsvField(r.kvsim_version()) << ',' << CsvField(r.git_commit());
    QuestionColumns(r.mean(), os);
    os << ',' << (r.approximate() ? 1 : 0);
    for (double x :
         {r.cpu_bank_bytes_final(), r.cpu_bank_tokens_final(), r.bank_tokens_per_frame(), r.gpu_bytes_peak(),
          r.gpu_bytes_mean(), r.encode_tokens(), r.encode_passes_per_video_token(), r.encode_busy_s(),
          r.encode_lag_max_s(), r.decode_token_steps()})
      os << ',' << CsvNumber(x);
    std::string tags;
    for (const std::string& t : r.sample_tags()) tags += (tags.empty() ? "" : ";") + t;
    os << ',' << CsvField(r.sample_id()) << ',' << CsvField(tags) << ',' << CsvField(r.group()) << '\n';
  }
  return os.str();
}

std::string StreamQuestionsCsv(const std::vector<StreamRunResult>& runs) {
  std::ostringstream os;
  os << kRunKeyHeader << ",question,time_s,frames_before," << kQuestionHeader << ",policy_stats\n";
  for (size_t i = 0; i < runs.size(); ++i)
    for (const StreamQuestionResult& q : runs[i].questions()) {
      RunKey(i, runs[i], os);
      os << ',' << q.question() << ',' << CsvNumber(q.time_s()) << ',' << q.frames_before();
      QuestionColumns(q, os);
      std::string s;
      for (const StreamStat& x : q.policy_stats())
        s += (s.empty() ? "" : ";") + x.name() + "=" + CsvNumber(x.value());
      os << ',' << CsvField(s) << '\n';
    }
  return os.str();
}

std::string StreamMemoryCsv(const std::vector<StreamRunResult>& runs) {
  std::ostringstream os;
  os << kRunKeyHeader << ",time_s,event,cpu_bank_bytes,gpu_bytes\n";
  for (size_t i = 0; i < runs.size(); ++i)
    for (const MemoryPoint& p : runs[i].memory()) {
      RunKey(i, runs[i], os);
      os << ',' << CsvNumber(p.time_s()) << ',' << p.event() << ',' << CsvNumber(p.cpu_bank_bytes()) << ','
         << CsvNumber(p.gpu_bytes()) << '\n';
    }
  return os.str();
}

namespace {

// The summary of one trace's runs: what the trace is, a table of the runs, policy statistics.
void StreamTraceSummary(const std::vector<StreamRunResult>& runs, std::ostringstream& os) {
  os << "Trace: `" << runs[0].trace_path() << "` (" << runs[0].trace_model() << ", seed "
     << runs[0].trace_seed()
     << "). Streaming replay: every question sees only the frames that arrived before it. Means over "
        "questions; attention metrics over layers, query heads and answer steps (docs/streaming.md).\n\n";
  os << "| policy | budget (visual tok.) | visual tokens in context | retained mass | output rel. err (mean "
        "/ "
        "p95) | evidence frame recall | oracle frame recall | CPU bank MB | GPU peak MB | bank tok./frame | "
        "encode passes/token |\n";
  os << "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const StreamRunResult& r : runs) {
    const StreamQuestionResult& m = r.mean();
    os << "| " << r.label() << (r.approximate() ? " (approx.)" : "") << " | " << r.budget_tokens() << " | "
       << Num(m.visual_tokens_in_context(), 5) << " | " << Num(m.retained_mass_mean(), 4) << " | "
       << Num(m.output_rel_error_mean(), 4) << " / " << Num(m.output_rel_error_p95(), 4) << " | "
       << (m.evidence_frame_recall() < 0 ? std::string("n/a") : Num(m.evidence_frame_recall(), 3)) << " | "
       << Num(m.oracle_frame_recall(), 3) << " | " << Num(Mb(r.cpu_bank_bytes_final()), 5) << " | "
       << Num(Mb(r.gpu_bytes_peak()), 5) << " | " << Num(r.bank_tokens_per_frame(), 4) << " | "
       << Num(r.encode_passes_per_video_token(), 3) << " |\n";
  }
  bool any_stats = false;
  for (const StreamRunResult& r : runs) any_stats |= r.policy_stats_size() > 0;
  if (any_stats) {
    os << "\nPolicy statistics (means over questions):\n\n";
    for (const StreamRunResult& r : runs) {
      if (r.policy_stats_size() == 0) continue;
      os << "- " << r.label() << " @ " << r.budget_tokens() << ":";
      for (const StreamStat& x : r.policy_stats()) os << " " << x.name() << " " << Num(x.value(), 4) << ";";
      os << "\n";
    }
  }
  bool approx = false;
  for (const StreamRunResult& r : runs) approx |= r.approximate();
  if (approx)
    os << "\n(approx.): the trace lacks the per-granularity block encodings this policy stores; they were "
          "derived from the continuous run (docs/streaming.md).\n";
}

}  // namespace

std::string StreamSummaryMarkdown(const std::vector<StreamRunResult>& runs, const std::string& title) {
  std::ostringstream os;
  os << "# " << title << "\n\n";
  if (runs.empty()) return os.str() + "No runs.\n";
  // The runs of each sample (trace), in first-seen order; one sample keeps the single-trace layout.
  std::vector<std::vector<StreamRunResult>> by_trace;
  std::map<std::pair<std::string, std::string>, size_t> index;
  for (const StreamRunResult& r : runs) {
    auto [it, fresh] = index.emplace(std::make_pair(r.sample_id(), r.trace_path()), by_trace.size());
    if (fresh) by_trace.emplace_back();
    by_trace[it->second].push_back(r);
  }
  for (const auto& trace_runs : by_trace) {
    if (by_trace.size() > 1) os << "## Sample `" << trace_runs[0].sample_id() << "`\n\n";
    StreamTraceSummary(trace_runs, os);
    if (by_trace.size() > 1) os << "\n";
  }
  os << (by_trace.size() > 1 ? "" : "\n")
     << "One row per run: runs.csv; per question: questions.csv; memory tiers over time: memory.csv.\n";
  return os.str();
}

Status WriteStreamSweepOutputs(const StreamSweepResult& result, const std::string& out_dir) {
  const std::vector<StreamRunResult> runs(result.runs().begin(), result.runs().end());
  const std::vector<Aggregate> aggregates(result.aggregates().begin(), result.aggregates().end());
  std::set<std::string> samples;
  for (const StreamRunResult& r : runs) samples.insert(r.sample_id());
  const std::vector<AggregateColumn> columns = {{"retained_mass_mean", "retained mass"},
                                                {"output_rel_error_mean", "out err mean"},
                                                {"evidence_frame_recall", "evidence frame recall"},
                                                {"oracle_frame_recall", "oracle frame recall"},
                                                {"oracle_mass_recall", "oracle mass recall"},
                                                {"gpu_bytes_peak", "GPU peak MiB", 1.0 / (1024.0 * 1024.0)}};
  return WriteOutputFolder(out_dir,
                           {{"results.json", ToJson(result)},
                            {"runs.csv", StreamRunsCsv(runs)},
                            {"questions.csv", StreamQuestionsCsv(runs)},
                            {"memory.csv", StreamMemoryCsv(runs)},
                            {"aggregates.csv", AggregatesCsv(aggregates)},
                            {"summary.md", StreamSummaryMarkdown(runs, "kvsim streaming sweep summary") +
                                               DatasetMarkdown(aggregates, result.failed_units(),
                                                               static_cast<int>(samples.size()), columns)}});
}

}  // namespace kvsim
