#include "sim/progress.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <memory>

namespace kvsim {

std::optional<ProgressStyle> ProgressStyleFromEnv(std::FILE* out) {
  const char* v = std::getenv("KVSIM_PROGRESS");
  const std::string s = v ? v : "";
  if (s == "off" || s == "0") return ProgressStyle::kOff;
  if (s == "bar") return ProgressStyle::kBar;
  if (s == "lines") return ProgressStyle::kLines;
  if (s.empty() || s == "auto" || s == "1")
    return ::isatty(::fileno(out)) ? ProgressStyle::kBar : ProgressStyle::kLines;
  return std::nullopt;
}

std::string FormatSeconds(double seconds) {
  const long s = std::lround(std::max(0.0, seconds));
  char buf[64];
  if (s < 60)
    std::snprintf(buf, sizeof(buf), "%ld s", s);
  else if (s < 3600)
    std::snprintf(buf, sizeof(buf), "%ld min %02ld s", s / 60, s % 60);
  else
    std::snprintf(buf, sizeof(buf), "%ld h %02ld min", s / 3600, (s % 3600) / 60);
  return buf;
}

Progress::Progress(std::string task, ProgressStyle style, std::FILE* out, double interval_seconds,
                   Clock clock)
    : task_(std::move(task)),
      style_(style),
      out_(out),
      interval_(interval_seconds),
      clock_(std::move(clock)) {
  if (!clock_)
    clock_ = [] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    };
  start_ = clock_();
}

std::optional<double> ProgressIntervalFromEnv() {
  const char* v = std::getenv("KVSIM_PROGRESS_INTERVAL");
  if (!v || !*v) return 10.0;
  char* end = nullptr;
  const double s = std::strtod(v, &end);
  if (*end != '\0' || !std::isfinite(s) || s < 0) return std::nullopt;
  return s;
}

Progress Progress::FromEnv(std::string task, bool enabled) {
  const ProgressStyle style =
      enabled ? ProgressStyleFromEnv().value_or(ProgressStyle::kLines) : ProgressStyle::kOff;
  return Progress(std::move(task), style, stderr, ProgressIntervalFromEnv().value_or(10.0));
}

Progress::~Progress() {
  // Not finished: the work failed (its error follows) — no "done" line; a bar's line is ended.
  if (mu_ && !finished_ && style_ == ProgressStyle::kBar && last_emit_ >= 0) {
    std::fprintf(out_, "\n");
    std::fflush(out_);
  }
}

void Progress::SetOuter(const std::string& name, int index, int total) {
  std::lock_guard<std::mutex> lock(*mu_);
  outer_name_ = name, outer_index_ = index, outer_total_ = total;
  inner_done_ = 0;
}

void Progress::Update(const std::string& name, int done, int total) {
  if (style_ == ProgressStyle::kOff) return;
  std::lock_guard<std::mutex> lock(*mu_);
  inner_name_ = name, inner_done_ = done, inner_total_ = total;
  started_ = true;
  const double now = clock_();
  // Bar: at most 10 redraws a second (and the last); lines: one per interval.
  const double gap = style_ == ProgressStyle::kBar ? 0.1 : interval_;
  if (last_emit_ < 0 ? now - start_ >= gap : now - last_emit_ >= gap) Emit(false);
}

void Progress::Finish() {
  std::lock_guard<std::mutex> lock(*mu_);
  if (finished_ || style_ == ProgressStyle::kOff || !started_) return;
  finished_ = true;
  // Lines: the last line only after periodic ones (a short run prints nothing); bar: always.
  if (style_ == ProgressStyle::kBar || last_emit_ >= 0) Emit(true);
}

double Progress::Fraction() const {
  const double inner = inner_total_ > 0 ? static_cast<double>(inner_done_) / inner_total_ : 0;
  if (outer_total_ <= 1) return inner;
  return std::min(1.0, (std::max(0, outer_index_ - 1) + inner) / outer_total_);
}

std::string Progress::StatusText(bool done) const {
  std::string s;
  if (outer_total_ > 1)
    s += outer_name_ + " " + std::to_string(outer_index_) + "/" + std::to_string(outer_total_);
  if (inner_total_ > 0)
    s += (s.empty() ? "" : ", ") + inner_name_ + " " + std::to_string(inner_done_) + "/" +
         std::to_string(inner_total_);
  const double elapsed = clock_() - start_, f = Fraction();
  if (done)
    s += (s.empty() ? "" : ", ") + std::string("done in ") + FormatSeconds(elapsed);
  else if (f > 0)
    s += (s.empty() ? "" : ", ") + std::string("eta ") + FormatSeconds(elapsed * (1 - f) / f);
  return s;
}

void Progress::Emit(bool final_line) {
  last_emit_ = clock_();
  const std::string text = StatusText(final_line);
  if (style_ == ProgressStyle::kLines) {
    std::fprintf(out_, "kvsim: %s: %s\n", task_.c_str(), text.c_str());
  } else {
    const int width = 24, filled = static_cast<int>(std::floor(Fraction() * width));
    std::string line =
        "kvsim: " + task_ + " [" + std::string(filled, '#') + std::string(width - filled, '.') + "] " + text;
    const size_t len = line.size();
    if (len < bar_width_) line += std::string(bar_width_ - len, ' ');
    bar_width_ = len;
    std::fprintf(out_, "\r%s%s", line.c_str(), final_line ? "\n" : "");
  }
  std::fflush(out_);
}

}  // namespace kvsim
