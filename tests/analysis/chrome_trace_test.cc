#include "analysis/chrome_trace.h"

#include <google/protobuf/util/json_util.h>

#include <catch2/catch.hpp>
#include <filesystem>

#include "analysis/report.h"
#include "tests/test_util.h"

namespace kvsim {
namespace {

// Two prefill chunks, then three decode steps, on the token-step clock.
RunResult TwoChunkRun(const std::string& policy, int compression_step) {
  RunResult r;
  r.set_policy(policy);
  r.set_label(policy);
  r.set_budget_tokens(8);
  r.set_time_unit("token_steps");
  r.set_prefill_chunks(2);
  r.set_compression_step(compression_step);
  const char* events[] = {"prefill", "prefill", "decode", "decode", "decode"};
  const int steps[] = {-2, -1, 0, 1, 2};
  for (int e = 0; e < 5; ++e) {
    TimelinePoint* p = r.add_timeline();
    p->set_event(events[e]);
    p->set_step(steps[e]);
    p->set_time(e + 1);
    p->set_kv_tokens(10 * (e + 1));
    p->set_kv_bytes(100 * (e + 1));
  }
  return r;
}

int Count(const ChromeTrace& t, int pid, const std::string& ph, const std::string& cat) {
  int n = 0;
  for (const ChromeTraceEvent& e : t.traceevents()) n += e.pid() == pid && e.ph() == ph && e.cat() == cat;
  return n;
}

}  // namespace

TEST_CASE("chrome trace: slices, compression and memory counters from the run's timeline", "[chrome_trace]") {
  const ChromeTrace t =
      ChromeTraceForRuns({TwoChunkRun("snapkv", -1), TwoChunkRun("full", -1), TwoChunkRun("meda", 0)});
  for (int pid : {1, 2, 3}) {
    CHECK(Count(t, pid, "X", "prefill") == 2);
    CHECK(Count(t, pid, "X", "decode") == 3);
    CHECK(Count(t, pid, "C", "memory") == 6);  // one per event, and the last value at the end
  }
  CHECK(Count(t, 2, "i", "compression") == 0);  // the full cache compresses nothing
  double snapkv_at = -1, meda_at = -1;
  for (const ChromeTraceEvent& e : t.traceevents()) {
    if (e.cat() == "compression") (e.pid() == 1 ? snapkv_at : meda_at) = e.ts();
    if (e.ph() == "X") {
      CHECK(e.dur() == 1);
      CHECK(e.args().clock().find("token steps") != std::string::npos);
    }
    if (e.pid() == 1 && e.ph() == "X" && e.name() == "decode step 0") CHECK(e.ts() == 2);
    if (e.pid() == 1 && e.ph() == "C" && e.ts() == 2) CHECK(e.args().gpu_hbm_bytes() == 300);
  }
  CHECK(snapkv_at == 2);  // the hook at the end of prefill
  CHECK(meda_at == 3);    // with decode step 0's query: at its end
  // Through the one JSON writer, with the format's field names; parses back.
  const std::string json = ToJson(t);
  CHECK(json.find("\"traceEvents\"") != std::string::npos);
  CHECK(json.find("\"displayTimeUnit\": \"ms\"") != std::string::npos);
  ChromeTrace back;
  REQUIRE(google::protobuf::util::JsonStringToMessage(json, &back).ok());
  CHECK(back.traceevents_size() == t.traceevents_size());
}

TEST_CASE("chrome trace: streaming runs show encode jobs, answers and both memory tiers", "[chrome_trace]") {
  StreamRunResult r;
  r.set_policy("rekv");
  r.set_label("rekv");
  r.set_budget_tokens(16);
  r.set_time_unit("us");
  const char* events[] = {"start", "encode", "encode", "question", "answer", "done"};
  const double times[] = {0, 0.5, 0.75, 1, 1.25, 1.25};
  for (int i = 0; i < 6; ++i) {
    MemoryPoint* p = r.add_memory();
    p->set_time_s(times[i]);
    p->set_event(events[i]);
    p->set_gpu_bytes(10 * i);
    p->set_cpu_bank_bytes(i);
  }
  StreamQuestionResult* q = r.add_questions();
  q->set_question(0);
  q->set_time_s(0.9);
  q->set_answer_start_s(1);
  q->set_answer_end_s(1.25);
  const ChromeTrace t = ChromeTraceForStreamRuns({r});
  CHECK(Count(t, 1, "X", "encode") == 1);
  CHECK(Count(t, 1, "X", "answer") == 1);
  CHECK(Count(t, 1, "i", "question") == 1);
  CHECK(Count(t, 1, "C", "memory") == 6);
  for (const ChromeTraceEvent& e : t.traceevents()) {
    if (e.cat() == "encode") {
      CHECK(e.ts() == 0.5e6);
      CHECK(e.dur() == Approx(0.25e6));
    }
    if (e.cat() == "answer") {
      CHECK(e.ts() == 1e6);
      CHECK(e.dur() == Approx(0.25e6));
      CHECK(e.args().has_retained_mass());
    }
  }
  CHECK(t.metadata().clock().find("modelled") != std::string::npos);
}

TEST_CASE("chrome trace: written atomically; a bad path is a one-line error naming it", "[chrome_trace]") {
  const std::string dir = testing::ScratchDir("chrome_trace");
  const std::string path = dir + "/t.json";
  REQUIRE(WriteChromeTrace(ChromeTraceForRuns({TwoChunkRun("snapkv", -1)}), path).ok());
  CHECK(std::filesystem::file_size(path) > 100);
  const Status st = WriteChromeTrace(ChromeTrace(), dir + "/missing/t.json");
  CHECK_FALSE(st.ok());
  CHECK(st.message().find("missing/t.json") != std::string::npos);
}

}  // namespace kvsim
