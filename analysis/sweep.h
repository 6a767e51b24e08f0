#pragma once
// `kvsim run` and `kvsim sweep`: build runs from policy names, budgets and overrides, replay them (one
// streamed pass per trace shares the full-attention reference across all runs), and write results.

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "analysis/experiment.pb.h"
#include "sim/latency_model.h"
#include "sim/replay.h"

namespace kvsim {

StatusOr<std::unique_ptr<TraceSource>> OpenTrace(const std::string& path);

// The trace's content hash (HashFile; `hash` replaces it in tests) and `replay`, which records the hash it is
// given in its results. A hash remembered for the file (traces/hash_cache.h; not with `hash`) is handed to
// replay and nothing is read. Otherwise, serially (HashConcurrently(path, threads) false): hashed first, then
// replay(hash); concurrently: hashed on a thread of its own while replay("") runs, and the caller records the
// returned hash in the results. (The page-cache check behind HashConcurrently maps the whole file and asks
// the kernel about every page: it is made only when the file must be read.)
// Either way the hash, and every result, is the same; a failed hash is the error even when replay failed too
// (as if hashed first), replay's error otherwise, and the caller writes nothing unless both succeeded.
StatusOr<std::string> HashBesideReplay(const std::string& path, int threads,
                                       const std::function<Status(const std::string& hash)>& replay,
                                       StatusOr<std::string> (*hash)(const std::string&) = nullptr);
// Whether `kvsim run` / `kvsim sweep` hash the trace beside the replay: only when the page cache holds the
// whole file (FileInPageCache) and the replay may use more than one thread (`threads`: RunOptions::threads).
// A file that must come from the disk is hashed first, as two streams over it measured slower
// (docs/performance.md, "Round 6b: the content hash beside the replay").
bool HashConcurrently(const std::string& path, int threads);

// Shared by the plain and the streaming sweeps:
// "snapkv window=16 pooling=MAX_POOL": a policy name and its overrides, the default run label.
std::string RunLabel(const std::string& name, const std::vector<std::string>& sets);
// Where the simulator's clock comes from: a device performance model (device set; modelled), a fitted
// latency model file, or token steps (neither).
struct LatencySpec {
  std::string file;    // latency model file (sim/latency_model.proto)
  std::string device;  // device profile name or file (sim/perf_model.h)
  std::string model;   // model shape preset or file for the device model; empty = the trace's model name
};
// The clock for a trace; errors name the option and the fix.
StatusOr<std::unique_ptr<LatencyModel>> MakeLatencyModel(const LatencySpec& spec, const TraceMeta& meta);
// A path from an experiment file: relative paths resolve against the experiment's folder.
std::string ResolveExperimentPath(const std::string& path, const std::string& base_dir);

struct RunOptions {
  int threads = 0;
  bool progress = false;
  std::string latency_model;  // file; empty = token steps
  int prefill_chunk = -1;     // tokens per prefill chunk; 0 = whole prompt; -1 = the experiment's setting
  std::string device;         // device profile (modelled latency); overrides the experiment's
  std::string model;          // model shape for the device model; overrides the experiment's
};

// One policy on one trace at one budget (fraction > 0, or tokens > 0); its `warnings` filled.
StatusOr<RunResult> RunOne(const std::string& trace_path, const std::string& policy,
                           const std::vector<std::string>& sets, double budget_fraction, int budget_tokens,
                           QuestionMode mode, const RunOptions& options);

// Why a finished run says little about its policy, one sentence each (empty when nothing is off): a policy
// that ignores the budget, a budget at or below the policy's observation window (it then keeps only the last
// B tokens, like every other window policy), prompt tokens kept over the budget (a floor-style variant).
// RunOne and RunSweep store them in each RunResult's `warnings` (so results.json, runs.csv, summary.md and
// the Python API carry them); `kvsim run` also prints them.
std::vector<std::string> DegenerateRunWarnings(const RunResult& result, const std::string& policy,
                                               const std::vector<std::string>& sets);

StatusOr<config::Experiment> LoadExperiment(const std::string& path);
// The same from the file's text (`what` names it in messages): parsed, then its fields checked.
StatusOr<config::Experiment> ParseExperiment(const std::string& text, const std::string& what);

// Runs every trace x policy x budget of the experiment. Policies and traces are all checked before any
// replay starts. Relative trace paths resolve against `base_dir`.
// The experiment's clock, options first: paths in the experiment resolve against `base_dir`.
LatencySpec ExperimentLatency(const config::Experiment& experiment, const std::string& base_dir,
                              const RunOptions& options);

// Where a sweep keeps its finished units (docs/cli.md "Resume"): each (sample, all runs) unit is written
// atomically to units_dir/SAMPLE-DEFHASH.json as it completes; with `resume`, a unit file whose definition
// hash (experiment minus its traces, clock, prefill chunk, kvsim version) and trace hash match is read back
// instead of replayed. A unit is self-contained (one trace, the experiment) so it can run in another process.
struct SweepUnits {
  std::string units_dir;  // empty: keep nothing
  bool resume = false;
  int reused = 0, computed = 0;  // filled by RunSweep
};

// The samples of an experiment: its 'samples', or one per trace (id = the file's stem, made unique). Paths
// resolved against base_dir; ids checked (unique, [A-Za-z0-9._-]+).
StatusOr<std::vector<config::Sample>> ExperimentSamples(const config::Experiment& experiment,
                                                        const std::string& base_dir);
// A dataset manifest (docs/cli.md "Manifest"): CSV with the header `id,path[,tags]`, '#' comments and blank
// lines skipped, tags "key=value" separated by ';'. Relative paths resolve against the manifest's folder.
// Errors name file:line.
StatusOr<std::vector<config::Sample>> LoadManifest(const std::string& path);
// Every *.h5 in a folder, sorted by name, ids = stems. Error when there is none.
StatusOr<std::vector<config::Sample>> FolderSamples(const std::string& dir);

// `kvsim sweep`'s inputs (also kvsim-ray's, docs/cluster.md): the experiment file `config` with its traces
// replaced by `traces` (files and/or folders of *.h5; relative to the working directory) or by `manifest`
// (docs/cli.md "Manifest"), and the folder its relative paths resolve against. Errors name the file/flag.
struct SweepInput {
  config::Experiment experiment;
  std::string base_dir;
};
StatusOr<SweepInput> LoadSweepInput(const std::string& config, const std::vector<std::string>& traces,
                                    const std::string& manifest);

// A sweep split into units (RunSweep; kvsim.ray runs the units as Ray tasks, docs/cluster.md): the runs
// (policies x budgets, built and checked once), the clock, the samples and the definition hash that names
// the unit files. Self-contained: a plan made in another process from the same experiment, base folder and
// options (PlanSweep with check_traces=false) computes byte-identical units.
struct SweepPlan {
  config::Experiment experiment;
  std::string base_dir;
  std::vector<RunSpec> runs;
  std::vector<config::PolicySpec> run_policy;  // runs[i]'s policy, for its warnings
  LatencySpec clock;
  int chunk = 0;
  std::vector<config::Sample> samples;  // paths resolved against base_dir
  std::string definition_hash;
  // units/ID-DEFHASH.json of samples[i].
  std::string UnitFile(size_t i) const;
};
// check_traces: open every trace and check it against the runs and the clock (what a sweep does before any
// replay); false for a process that computes single units (their trace is checked when it is opened).
StatusOr<SweepPlan> PlanSweep(const config::Experiment& experiment, const std::string& base_dir,
                              const RunOptions& options, bool check_traces = true);
// The finished unit of samples[i] in units_dir (docs/cli.md "Resume"), when its definition hash, sample,
// trace path, run count and trace hash match; nullopt otherwise.
std::optional<SweepUnit> ReusableUnit(const SweepPlan& plan, size_t i, const std::string& units_dir,
                                      const std::string& trace_hash);
// A unit read from JSON (a file, or another process's result) that belongs to samples[i] of this plan.
StatusOr<SweepUnit> ParseSweepUnit(const SweepPlan& plan, size_t i, const std::string& json);
// Replays every run on samples[i]: the shared per-trace work (read, full-attention reference, scores) once.
// The trace is read from `read_path` when it is set (a shipped copy of the same bytes); the unit records
// the sample's own path either way. `trace_hash`: the trace's HashFile when the caller already has it
// (empty: hashed here, beside the replay when HashConcurrently), so a trace is not read twice for it.
StatusOr<SweepUnit> ComputeSweepUnit(const SweepPlan& plan, size_t i, int threads, Progress* progress,
                                     const std::string& read_path = "", const std::string& trace_hash = "");
// The result of a sweep from its units, one per sample in order (a failed one's status gives its reason):
// runs, failed units and aggregates. With units_dir, unit files of other experiments or removed samples are
// deleted (the folder holds this sweep's units only). RunSweep and kvsim.ray both end here.
SweepResult AssembleSweep(const SweepPlan& plan, std::vector<StatusOr<SweepUnit>> units,
                          const std::string& units_dir);

// Runs every sample x policy x budget. Every trace is opened and checked before any replay starts; a trace
// that fails later (unreadable data) becomes a failed unit in the result while the rest completes. Then the
// per-(group, policy, budget) aggregates are computed.
StatusOr<SweepResult> RunSweep(const config::Experiment& experiment, const std::string& base_dir,
                               const RunOptions& options, SweepUnits* units = nullptr);
// The aggregates of a sweep's runs (docs/metrics.md): per (group, policy, label, budget), in first-seen
// order, for retained_mass_mean, output_rel_error_mean, regret_vs_oracle_mean, kv_memory_ratio.
std::vector<Aggregate> AggregateRuns(const std::vector<RunResult>& runs, uint64_t seed, int resamples);

// Writes results.json, runs.csv, layers.csv, aggregates.csv and summary.md into `out_dir` (created, or
// replaced as a whole if it holds only an earlier sweep's outputs; any other existing file or folder is an
// error). The folder appears only when everything is written; its units/ folder is kept. The texts are
// formatted on up to 2 of `threads` threads (<= 0: hardware); they do not depend on it.
Status WriteSweepOutputs(const SweepResult& result, const std::string& out_dir, int threads = 1);

}  // namespace kvsim
