#include "sim/progress.h"

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace kvsim {
namespace {

// Everything a Progress writes, through a memory stream, with a clock the test moves by hand.
struct Captured {
  char* buf = nullptr;
  size_t len = 0;
  std::FILE* f = open_memstream(&buf, &len);
  double now = 0;
  Progress::Clock clock() {
    return [this] { return now; };
  }
  std::string text() {
    std::fflush(f);
    return std::string(buf, len);
  }
  ~Captured() {
    std::fclose(f);
    std::free(buf);
  }
};

TEST_CASE("progress lines: periodic plain lines with outer and inner counts, eta, a last line, no \\r",
          "[progress]") {
  Captured c;
  {
    Progress p("sweep", ProgressStyle::kLines, c.f, /*interval_seconds=*/10, c.clock());
    p.SetOuter("trace", 1, 2);
    c.now = 4;
    p.Update("layer", 1, 4);  // 4 s < 10 s: nothing yet
    CHECK(c.text().empty());
    c.now = 10;
    p.Update("layer", 2, 4);  // a quarter done after 10 s: 30 s to go
    CHECK(c.text() == "kvsim: sweep: trace 1/2, layer 2/4, eta 30 s\n");
    c.now = 15;
    p.Update("layer", 3, 4);  // 5 s since the last line: nothing
    p.SetOuter("trace", 2, 2);
    c.now = 80;
    p.Update("layer", 1, 4);  // 5/8 done after 80 s: 48 s to go
    c.now = 125;
    p.Update("layer", 4, 4);
    p.Finish();
  }
  CHECK(c.text() ==
        "kvsim: sweep: trace 1/2, layer 2/4, eta 30 s\n"
        "kvsim: sweep: trace 2/2, layer 1/4, eta 48 s\n"
        "kvsim: sweep: trace 2/2, layer 4/4, eta 0 s\n"
        "kvsim: sweep: trace 2/2, layer 4/4, done in 2 min 05 s\n");
  CHECK(c.text().find('\r') == std::string::npos);
}

TEST_CASE("progress bar: one line redrawn with \\r, ended by a newline", "[progress]") {
  Captured c;
  Progress p("run", ProgressStyle::kBar, c.f, 10, c.clock());
  c.now = 1;
  p.Update("layer", 1, 2);
  p.Finish();
  p.Finish();  // once only
  CHECK(c.text() ==
        "\rkvsim: run [############............] layer 1/2, eta 1 s"
        "\rkvsim: run [############............] layer 1/2, done in 1 s\n");
}

TEST_CASE("progress off, unused, short or failed work prints nothing", "[progress]") {
  Captured c;
  {
    Progress short_run("run", ProgressStyle::kLines, c.f, 10, c.clock());
    short_run.Update("layer", 1, 1);  // within the interval: no line, and so no last line either
    short_run.Finish();
    Progress failed("run", ProgressStyle::kLines, c.f, 0, c.clock());
    failed.Update("layer", 1, 2);
  }  // `failed` was never finished: its error follows, not a "done" line
  CHECK(c.text() == "kvsim: run: layer 1/2, eta 0 s\n");
  Captured d;
  {
    Progress failed_bar("run", ProgressStyle::kBar, d.f, 10, d.clock());
    d.now = 1;
    failed_bar.Update("layer", 1, 2);
  }  // the bar's line is ended so that the error starts on its own line
  CHECK(d.text() == "\rkvsim: run [############............] layer 1/2, eta 1 s\n");
  {
    Progress off("run", ProgressStyle::kOff, c.f, 0, c.clock());
    off.Update("layer", 1, 1);
    Progress unused("run", ProgressStyle::kLines, c.f, 0, c.clock());
  }
  CHECK(c.text() == "kvsim: run: layer 1/2, eta 0 s\n");
}

TEST_CASE("KVSIM_PROGRESS chooses the style; anything else is refused", "[progress]") {
  Captured c;  // a memory stream is not a terminal: auto means lines
  const char* old = std::getenv("KVSIM_PROGRESS");
  const std::string saved = old ? old : "";
  ::unsetenv("KVSIM_PROGRESS");
  CHECK(ProgressStyleFromEnv(c.f) == ProgressStyle::kLines);
  ::setenv("KVSIM_PROGRESS", "off", 1);
  CHECK(ProgressStyleFromEnv(c.f) == ProgressStyle::kOff);
  ::setenv("KVSIM_PROGRESS", "bar", 1);
  CHECK(ProgressStyleFromEnv(c.f) == ProgressStyle::kBar);
  ::setenv("KVSIM_PROGRESS", "sometimes", 1);
  CHECK_FALSE(ProgressStyleFromEnv(c.f).has_value());
  if (old)
    ::setenv("KVSIM_PROGRESS", saved.c_str(), 1);
  else
    ::unsetenv("KVSIM_PROGRESS");
  CHECK(FormatSeconds(3725) == "1 h 02 min");
}

}  // namespace
}  // namespace kvsim
