#pragma once
// Dataset sweeps (docs/cli.md "Datasets", "Resume"): what the plain sweep (analysis/sweep.cc) and the
// streaming sweep (analysis/stream_sweep.cc) share — groups and declared groups, the definition hash, the
// unit loop (one unit = one sample with all its runs, written atomically, reused by --resume, a failure
// kept as a FailedUnit) and the aggregates across samples. One copy of each, used by both.

#include <google/protobuf/repeated_ptr_field.h>
#include <google/protobuf/util/json_util.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "analysis/experiment.pb.h"
#include "analysis/report.h"
#include "analysis/sweep.h"
#include "sim/progress.h"
#include "sim/results.pb.h"
#include "sim/trace.h"
#include "traces/hash_cache.h"
#include "traces/hdf5_trace.h"

namespace kvsim {

// A sample's group: model name and shape, "MODEL L=layers H=heads KV=kv_heads D=head_dim".
std::string TraceGroup(const ModelInfo& model);

// A declared group (config::Sample.group, the manifest's `group` column): a model name, then optionally
// shape items L=, H=, KV=, D= (space-separated, each at most once). Error: what is wrong and the form.
struct GroupSpec {
  std::string model;
  int layers = -1, heads = -1, kv_heads = -1, head_dim = -1;  // -1: not declared
};
StatusOr<GroupSpec> ParseGroupSpec(const std::string& text);

// Ok when the trace's model matches the sample's declared group (or none is declared); else one line naming
// where the sample was declared (its origin, manifest:line, or "sample 'ID'"), the field that differs and
// the fix.
Status CheckSampleGroup(const config::Sample& sample, const ModelInfo& model);

// What a unit's results depend on besides its trace, hashed (16 hex digits): the experiment without its
// traces/samples, the clock (and the latency file's content), the prefill chunk and kvsim's version.
StatusOr<std::string> UnitDefinitionHash(const config::Experiment& experiment, const LatencySpec& clock,
                                         int prefill_chunk);

// One run's values for aggregation: its cell key and one value per metric (NaN = not defined for this run,
// e.g. evidence recall on a trace without ground truth; left out of that metric's n).
struct AggregateRow {
  std::string group, policy, label;
  double budget_fraction = 0;
  int budget_tokens = 0;
  std::vector<double> values;  // parallel to the metric names
};
// Per (group, policy, label, budget) cell in first-seen order, per metric: n, mean, sd and the seeded
// percentile-bootstrap 95% CI of the mean (docs/metrics.md). A fractional budget is one cell whatever each
// sample's prompt length makes of it in tokens. A metric with no defined value in a cell has no row.
std::vector<Aggregate> AggregateRows(const std::vector<AggregateRow>& rows,
                                     const std::vector<std::string>& metrics, uint64_t seed, int resamples);

// The dataset part of summary.md: "Failed units" (if any), then, when the runs cover two or more samples,
// "Across samples": a table per group, one row per cell, one column per metric ("mean ± sd [low, high]").
struct AggregateColumn {
  std::string metric, header;
  double scale = 1;  // shown value = value × scale (e.g. bytes → MiB)
};
std::string DatasetMarkdown(const std::vector<Aggregate>& aggregates,
                            const google::protobuf::RepeatedPtrField<FailedUnit>& failed, int samples,
                            const std::vector<AggregateColumn>& columns);

// The unit loop, for a unit message `Unit` with the fields sample_id, trace_path, trace_hash,
// definition_hash and repeated runs (SweepUnit, StreamSweepUnit). For each sample in order: hash its trace
// (CachedHashFile: the hash remembered from an earlier read of the unchanged file, docs/cli.md);
// with units->resume, reuse units_dir/ID-DEFHASH.json when its definition hash, sample id, trace path,
// trace hash and run count match; else `replay(i, trace_hash)` (returns the unit's runs, tagged with the
// sample) and write the unit atomically. The hash comes first, not beside the replay: `replay` opens the
// trace, and the guarded open forks, which is unsafe under AddressSanitizer while a hashing thread allocates
// (docs/hardening.md); `kvsim run` and the plain sweep open first and hash beside the replay. A sample whose
// unit fails becomes a FailedUnit (the rest completes). At the end, unit files not of this sweep are removed.
// `done` gets the units in sample order.
template <class Unit, class Replay>
Status RunUnits(const std::vector<config::Sample>& samples, const std::string& def_hash, int runs_per_unit,
                SweepUnits* units, Progress& progress, Replay replay, std::vector<Unit>* done,
                google::protobuf::RepeatedPtrField<FailedUnit>* failed) {
  namespace fs = std::filesystem;
  const bool keep = units && !units->units_dir.empty();
  if (keep) {
    std::error_code ec;
    fs::create_directories(units->units_dir, ec);
    if (ec)
      return Status::InvalidArgument(units->units_dir + ": cannot create the units folder: " + ec.message());
  }
  std::set<std::string> unit_files;
  for (size_t i = 0; i < samples.size(); ++i) {
    const config::Sample& s = samples[i];
    progress.SetOuter("trace", static_cast<int>(i) + 1, static_cast<int>(samples.size()));
    const std::string unit_path =
        keep ? (fs::path(units->units_dir) / (s.id() + "-" + def_hash + ".json")).string() : "";
    if (keep) unit_files.insert(fs::path(unit_path).filename().string());
    auto compute = [&]() -> StatusOr<Unit> {
      KVSIM_ASSIGN_OR_RETURN(std::string hash, CachedHashFile(s.path()));
      if (keep && units->resume && fs::exists(unit_path)) {
        Unit old;
        std::ifstream in(unit_path, std::ios::binary);
        std::stringstream ss;
        ss << in.rdbuf();
        if (google::protobuf::util::JsonStringToMessage(ss.str(), &old).ok() &&
            old.definition_hash() == def_hash && old.trace_hash() == hash && old.sample_id() == s.id() &&
            old.trace_path() == s.path() && old.runs_size() == runs_per_unit) {
          ++units->reused;
          return old;
        }
      }
      Unit unit;
      unit.set_sample_id(s.id());
      unit.set_trace_path(s.path());
      unit.set_trace_hash(hash);
      unit.set_definition_hash(def_hash);
      KVSIM_ASSIGN_OR_RETURN(auto runs, replay(i, hash));
      for (auto& r : runs) *unit.add_runs() = std::move(r);
      if (keep) KVSIM_RETURN_IF_ERROR(WriteFileAtomic(unit_path, ToJson(unit)));
      if (units) ++units->computed;
      return unit;
    };
    auto unit = compute();
    if (!unit.ok()) {
      FailedUnit* f = failed->Add();
      f->set_sample_id(s.id());
      f->set_trace_path(s.path());
      f->set_error(unit.status().message());
      continue;
    }
    done->push_back(std::move(*unit));
  }
  // Unit files of other experiments or removed samples are stale: the folder holds this sweep's units only.
  if (keep) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(units->units_dir, ec))
      if (!unit_files.count(e.path().filename().string())) fs::remove(e.path(), ec);
  }
  return Status::Ok();
}

}  // namespace kvsim
