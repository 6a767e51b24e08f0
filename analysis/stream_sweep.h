#pragma once
// `kvsim run` / `kvsim sweep` on streaming traces (docs/streaming.md): builds streaming runs from the
// streaming policy registry, replays them (sim/stream_replay.h) and writes results: results.json,
// results.csv (one row per run), questions.csv (one row per run and question), memory.csv (CPU bank and GPU
// bytes over video time) and summary.md.

#include <string>
#include <vector>

#include "analysis/experiment.pb.h"
#include "analysis/sweep.h"
#include "sim/stream_results.pb.h"

namespace kvsim {

// Ok for streaming policy names; a one-line error naming the streaming policies for a non-streaming one.
Status CheckStreamingPolicyName(const std::string& name);
// Whether the trace at `path` is a streaming trace (reads only its metadata).
StatusOr<bool> IsStreamingTrace(const std::string& path);
// Whether the experiment's traces are streaming traces; an experiment mixing both kinds is an error.
StatusOr<bool> ExperimentIsStreaming(const config::Experiment& experiment, const std::string& base_dir);

// One streaming policy at one budget (retrieved visual tokens per layer and KV head; 0 = its default).
StatusOr<StreamRunResult> RunStreamOne(const std::string& trace_path, const std::string& policy,
                                       const std::vector<std::string>& sets, int budget_tokens,
                                       const RunOptions& options);

// Every sample x policy x budget_tokens (fractions are refused: the history grows, a fraction of it is not a
// budget). Policies that do not use a budget run once. A dataset sweep like RunSweep, through the same code
// (analysis/dataset.h): samples (ids, tags, groups, declared groups checked), every trace checked before any
// replay, units in units->units_dir reused by --resume, a trace failing mid-sweep a failed unit, then the
// per-(group, policy, budget) aggregates of kStreamAggregateMetrics.
StatusOr<StreamSweepResult> RunStreamSweep(const config::Experiment& experiment, const std::string& base_dir,
                                           const RunOptions& options, SweepUnits* units = nullptr);

// The streaming metrics aggregated across samples (docs/metrics.md "Aggregates across samples"): the
// runs.csv columns of the means over questions, and the GPU peak. evidence_frame_recall counts only samples
// with ground-truth evidence (synthetic traces; -1 otherwise).
inline const std::vector<std::string> kStreamAggregateMetrics = {
    "retained_mass_mean",  "output_rel_error_mean", "evidence_frame_recall",
    "oracle_frame_recall", "oracle_mass_recall",    "gpu_bytes_peak"};
std::vector<Aggregate> AggregateStreamRuns(const std::vector<StreamRunResult>& runs, uint64_t seed,
                                           int resamples);

// `kvsim inspect` on a streaming trace: model, stream, questions (time, frames before, evidence) and block
// encodings. (The decode-attention statistics of plain traces do not apply: each question attends over its
// own history.)
std::string FormatStreamSummary(const TraceMeta& meta);
std::string StreamSummaryJson(const TraceMeta& meta);

std::string StreamRunsCsv(const std::vector<StreamRunResult>& runs);
std::string StreamQuestionsCsv(const std::vector<StreamRunResult>& runs);
std::string StreamMemoryCsv(const std::vector<StreamRunResult>& runs);
std::string StreamSummaryMarkdown(const std::vector<StreamRunResult>& runs, const std::string& title);

// Same folder contract as WriteSweepOutputs: results.json, runs.csv (ending with sample_id, tags, group),
// questions.csv, memory.csv, aggregates.csv and summary.md (a table per sample when there are several, then
// "Failed units" and "Across samples" as the plain sweep's).
Status WriteStreamSweepOutputs(const StreamSweepResult& result, const std::string& out_dir);

}  // namespace kvsim
