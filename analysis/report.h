#pragma once
// Writing results: JSON (results.proto mapping), tidy CSV, and a readable markdown summary. Files are
// written to a temporary name and renamed into place, so a failed run leaves no partial output.

#include <string>
#include <vector>

#include "sim/results.pb.h"
#include "sim/status.h"

namespace kvsim {

std::string ToJson(const google::protobuf::Message& msg);
// One row per (run, layer) plus one overall row per run (layer = "all").
std::string ResultsCsv(const std::vector<RunResult>& runs);
std::string SummaryMarkdown(const std::vector<RunResult>& runs, const std::string& title);

// Writes `content` to `path` atomically (temp file + rename). Error names the path.
Status WriteFileAtomic(const std::string& path, const std::string& content);

}  // namespace kvsim
