#pragma once
// `kvsim run/sweep --chrome-trace out.json`: the simulated runs in the Trace Event format that Perfetto
// (ui.perfetto.dev) and chrome://tracing open (docs/cli.md "Timeline view"). Built from the results'
// own records (RunResult.timeline, StreamRunResult.memory and the per-question times): prefill chunks,
// the compression event and decode steps as slices, KV memory per tier as counters; one process per run.
// Timestamps are the simulated clock: modelled microseconds with --device (or a fitted latency model), or
// simulated token steps shown as microseconds; every event's args.clock says which.

#include <string>
#include <vector>

#include "analysis/json_reports.pb.h"
#include "sim/results.pb.h"
#include "sim/status.h"
#include "sim/stream_results.pb.h"

namespace kvsim {

ChromeTrace ChromeTraceForRuns(const std::vector<RunResult>& runs);
ChromeTrace ChromeTraceForStreamRuns(const std::vector<StreamRunResult>& runs);

// Writes the trace as JSON through ToJson, atomically (temp file + rename).
Status WriteChromeTrace(const ChromeTrace& trace, const std::string& path);

}  // namespace kvsim
