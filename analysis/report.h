#pragma once
// Writing results: JSON (results.proto mapping), tidy CSV, and a readable markdown summary. Files are
// written to a temporary name and renamed into place, so a failed run leaves no partial output.

#include <string>
#include <utility>
#include <vector>

#include "sim/results.pb.h"
#include "sim/status.h"

namespace kvsim {

// The one JSON writer: every JSON kvsim writes (results, inspect --json, latency --json, verify hae, Chrome
// traces, kvsim_replay_gpu reports) is a message printed here (protobuf's JSON mapping, proto field names,
// indented, zero values printed), so escaping and number formatting are the same everywhere.
std::string ToJson(const google::protobuf::Message& msg);
// ToJson(msg) in pieces that can be printed at the same time: piece 0 is msg without the repeated message
// field `field` (one of msg's own fields), piece i >= 1 its element i - 1. Join() splices them (each
// element re-indented to its depth) into exactly the bytes of ToJson(msg). Print(i) writes only piece i's
// text, so the pieces may be printed on different threads, in any order, before Join.
class SplitJson {
 public:
  SplitJson(const google::protobuf::Message& msg, const std::string& field);
  int parts() const { return static_cast<int>(text_.size()); }
  void Print(int part);
  std::string Join() const;

 private:
  const google::protobuf::Message& msg_;
  const google::protobuf::FieldDescriptor* field_;
  std::string name_;
  std::vector<std::string> text_;
};
// ToJson(msg) with the elements of its repeated message field `field` printed on up to `threads` threads
// (<= 0: all cores): the same bytes.
std::string ToJsonSplit(const google::protobuf::Message& msg, const std::string& field, int threads);
// Tidy tables (docs/metrics.md "Tables"): runs.csv has one row per run, layers.csv one row per (run, layer);
// both start with the same key columns (run = the run's index in results.json).
std::string RunsCsv(const std::vector<RunResult>& runs);
std::string LayersCsv(const std::vector<RunResult>& runs);
// aggregates.csv of a sweep: one row per (group, policy, label, budget, metric) (docs/cli.md).
std::string AggregatesCsv(const std::vector<Aggregate>& aggregates);
std::string SummaryMarkdown(const std::vector<RunResult>& runs, const std::string& title);

// Writes `content` to `path` atomically (temp file + rename). Error names the path.
Status WriteFileAtomic(const std::string& path, const std::string& content);

// Writes several files (path -> content), each atomically; if one fails, the ones already written are
// removed, so a failed command leaves none of its outputs.
Status WriteFilesAtomic(const std::vector<std::pair<std::string, std::string>>& files);

// Writes `files` (name -> content) into the folder `out_dir`, which appears only when all are written. An
// existing `out_dir` is replaced as a whole only if it holds nothing but files with these names, the
// kPlotsFolder of `kvsim plot` and an older kvsim's results.csv (an earlier run's outputs); anything else
// there is an error, never deleted.
// (`kvsim sweep`'s units/ folder of finished units, docs/cli.md "Resume", is kept as it is.)
inline constexpr const char kPlotsFolder[] = "plots";
inline constexpr const char kUnitsFolder[] = "units";
// The check WriteOutputFolder makes first, for commands that check before working: `out_dir` is new, or a
// folder holding only these names, kPlotsFolder, kUnitsFolder and results.csv.
Status CheckOutputFolder(const std::string& out_dir, const std::vector<std::string>& names);
Status WriteOutputFolder(const std::string& out_dir,
                         const std::vector<std::pair<std::string, std::string>>& files);
// A folder output (`flag` names it in errors) without trailing slashes and "." parts ("results//" ->
// results); refused when it is the current folder, its parent or the root (it is replaced as a whole).
StatusOr<std::string> NormalizeOutputFolder(const std::string& flag, const std::string& path);
// The outputs `kvsim sweep` writes into its folder (WriteSweepOutputs), for CheckOutputFolder.
inline const std::vector<std::string> kSweepOutputNames = {"results.json", "runs.csv", "layers.csv",
                                                           "aggregates.csv", "summary.md"};
// The same for a streaming sweep (WriteStreamSweepOutputs).
inline const std::vector<std::string> kStreamSweepOutputNames = {
    "results.json", "runs.csv", "questions.csv", "memory.csv", "aggregates.csv", "summary.md"};

// Shared by the report writers: a number with `prec` significant digits (for reading), a number in a CSV
// table (the shortest form that reads back as the same double: every CSV kvsim writes uses it), and a CSV
// field (quoted when it holds a comma, quote or newline).
std::string FormatNumber(double v, int prec = 6);
std::string CsvNumber(double v);
std::string CsvField(const std::string& s);

}  // namespace kvsim
