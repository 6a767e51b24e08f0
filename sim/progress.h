#pragma once
// The one progress reporter of every engine (text replay and sweeps, streaming replay, `verify hae`,
// `search`, `gpu-plan`): always on stderr (or the stream given), never part of any result.
// - bar: on a terminal, one line redrawn in place,
//   "kvsim: sweep [######......] trace 1/2, layer 7/32, eta 40 s".
// - lines: otherwise (logs, pipes, files), plain lines at most every `interval` seconds (10 s;
//   KVSIM_PROGRESS_INTERVAL) and, after them, a last line when done:
//   "kvsim: sweep: trace 1/2, layer 7/32, eta 40 s" ... "kvsim: sweep: trace 2/2, layer 32/32, done in 12 s".
//   A run shorter than the interval prints nothing. Never a carriage return.
// - off: nothing (`--quiet`, or KVSIM_PROGRESS=off).
// The style comes from KVSIM_PROGRESS (auto | bar | lines | off; auto = bar when the stream is a terminal,
// else lines). Work that fails prints no "done" line: callers call Finish() on success only. Updates may
// come from any thread.

#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

namespace kvsim {

enum class ProgressStyle { kOff, kBar, kLines };

// KVSIM_PROGRESS parsed: nullopt when set to something else than auto, bar, lines, off (or 0/1).
std::optional<ProgressStyle> ProgressStyleFromEnv(std::FILE* out = stderr);
// KVSIM_PROGRESS_INTERVAL: seconds between plain lines (default 10); nullopt when not a number >= 0.
std::optional<double> ProgressIntervalFromEnv();
// "about 40 s", "3 min 20 s", "1 h 05 min": the remaining-time text of progress lines.
std::string FormatSeconds(double seconds);

class Progress {
 public:
  using Clock = std::function<double()>;  // seconds since any fixed point
  // `task` names the work ("run", "sweep", "search", "verify hae"). Default clock: steady_clock.
  Progress(std::string task, ProgressStyle style, std::FILE* out = stderr, double interval_seconds = 10,
           Clock clock = {});
  // From the environment (KVSIM_PROGRESS, KVSIM_PROGRESS_INTERVAL), off when `enabled` is false.
  static Progress FromEnv(std::string task, bool enabled);
  Progress(Progress&&) = default;
  ~Progress();

  // The outer unit (a trace of a sweep, a pass of a search, a plan), 1-based `index` of `total`; the inner
  // count restarts. Not needed for single-unit work.
  void SetOuter(const std::string& name, int index, int total);
  // `done` of `total` inner units (layers) finished in the current outer unit.
  void Update(const std::string& name, int done, int total);
  // The work succeeded: the last line (bar; lines after periodic ones). An unfinished reporter's
  // destructor prints no "done" line (it only ends a bar's line).
  void Finish();

  // The current state as one line's text: "trace 1/2, layer 7/32, eta 40 s" (tests).
  std::string StatusText(bool done) const;

 private:
  void Emit(bool final_line);
  double Fraction() const;

  std::string task_;
  ProgressStyle style_;
  std::FILE* out_;
  double interval_;
  Clock clock_;
  double start_ = 0, last_emit_ = -1;
  std::string outer_name_, inner_name_;
  int outer_index_ = 0, outer_total_ = 0, inner_done_ = 0, inner_total_ = 0;
  bool started_ = false, finished_ = false;
  size_t bar_width_ = 0;  // characters of the last bar line (to clear what a shorter line leaves)
  std::unique_ptr<std::mutex> mu_ = std::make_unique<std::mutex>();
};

}  // namespace kvsim
