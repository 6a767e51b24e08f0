#include "analysis/chrome_trace.h"

#include "analysis/report.h"
#include "sim/version.h"

namespace kvsim {
namespace {

constexpr int kComputeThread = 1, kMemoryThread = 2;

// What a run's timestamps are (args.clock of every event).
std::string PlainClock(const RunResult& r) {
  if (r.time_unit() == "us")
    return r.has_latency() ? "modelled decode/prefill latency on " + r.latency().device() +
                                 " (microseconds, --device; docs/latency.md), not measured"
                           : "fitted latency model (microseconds, --latency-model), not measured";
  return "simulated token steps (1 viewer microsecond = 1 step: a prefill event, a decode step), not wall "
         "time";
}

std::string StreamClock(const StreamRunResult& r) {
  if (r.time_unit() == "us")
    return "video time in microseconds; encoding and answering take modelled GPU time (docs/streaming.md), "
           "not measured";
  return "video time in microseconds; processing is instantaneous on the token-step clock (no --device), "
         "not measured";
}

ChromeTraceEvent* Add(ChromeTrace* t, const std::string& name, const std::string& cat, const std::string& ph,
                      double ts, int pid, int tid, const std::string& clock) {
  ChromeTraceEvent* e = t->add_traceevents();
  e->set_name(name);
  e->set_cat(cat);
  e->set_ph(ph);
  e->set_ts(ts);
  e->set_pid(pid);
  e->set_tid(tid);
  if (!clock.empty()) e->mutable_args()->set_clock(clock);
  return e;
}

void ProcessNames(ChromeTrace* t, int pid, const std::string& name, const std::string& compute) {
  ChromeTraceEvent* p = Add(t, "process_name", "__metadata", "M", 0, pid, 0, "");
  p->mutable_args()->set_name(name);
  ChromeTraceEvent* o = Add(t, "process_sort_index", "__metadata", "M", 0, pid, 0, "");
  o->mutable_args()->set_sort_index(pid);
  ChromeTraceEvent* th = Add(t, "thread_name", "__metadata", "M", 0, pid, kComputeThread, "");
  th->mutable_args()->set_name(compute);
  ChromeTraceEvent* mem = Add(t, "thread_name", "__metadata", "M", 0, pid, kMemoryThread, "");
  mem->mutable_args()->set_name("memory");
}

void Metadata(ChromeTrace* t, const std::string& clock) {
  t->set_displaytimeunit("ms");
  t->mutable_metadata()->set_clock(clock);
  t->mutable_metadata()->set_kvsim_version(kVersion);
  t->mutable_metadata()->set_git_commit(kGitCommit);
  t->mutable_metadata()->set_note(
      "kvsim simulated runs (replayed attention traces); durations are the simulated clock, not a profile of "
      "kvsim itself");
}

}  // namespace

ChromeTrace ChromeTraceForRuns(const std::vector<RunResult>& runs) {
  ChromeTrace t;
  std::string clocks;
  for (size_t i = 0; i < runs.size(); ++i) {
    const RunResult& r = runs[i];
    const int pid = static_cast<int>(i) + 1;
    const std::string clock = PlainClock(r);
    if (clocks.find(clock) == std::string::npos) clocks += (clocks.empty() ? "" : "; ") + clock;
    std::string budget = r.policy() == "full" ? "full cache" : std::to_string(r.budget_tokens()) + " tokens";
    ProcessNames(&t, pid, "run " + std::to_string(i) + ": " + r.label() + " @ " + budget,
                 "simulated request (" + r.time_unit() + ")");
    double start = 0;
    const int chunks = r.prefill_chunks();
    for (int e = 0; e < r.timeline_size(); ++e) {
      const TimelinePoint& p = r.timeline(e);
      const bool prefill = p.event() == "prefill";
      const std::string name =
          prefill ? "prefill chunk " + std::to_string(chunks + p.step() + 1) + "/" + std::to_string(chunks)
                  : "decode step " + std::to_string(p.step());
      // Memory held during the event (what kv_bytes_mean weights by duration), then the event itself.
      ChromeTraceEvent* c = Add(&t, "KV memory (GPU HBM)", "memory", "C", start, pid, kMemoryThread, "");
      c->mutable_args()->set_gpu_hbm_bytes(p.kv_bytes());
      ChromeTraceEvent* x =
          Add(&t, name, prefill ? "prefill" : "decode", "X", start, pid, kComputeThread, clock);
      x->set_dur(p.time() - start);
      x->mutable_args()->set_step(p.step());
      x->mutable_args()->set_kv_tokens(p.kv_tokens());
      x->mutable_args()->set_kv_bytes(p.kv_bytes());
      // The compression event: at the end of the last prefill chunk (the hook), or at the end of decode step
      // t for policies that compress with its query (the step still attends over the whole prompt:
      // docs/metrics.md "Memory over simulated time").
      const bool compress_here =
          r.policy() != "full" && ((r.compression_step() < 0 && prefill && p.step() == -1) ||
                                   (!prefill && p.step() == r.compression_step()));
      if (compress_here) {
        const double at = p.time();
        ChromeTraceEvent* ce = Add(&t, "compression", "compression", "i", at, pid, kComputeThread, clock);
        ce->set_s("t");
        ChromeTraceArgs* a = ce->mutable_args();
        a->set_policy(r.policy());
        a->set_label(r.label());
        a->set_budget_tokens(r.budget_tokens());
        a->set_step(r.compression_step());
        if (r.has_latency()) a->set_policy_work_ms(r.latency().policy_work_ms());
      }
      start = p.time();
    }
    if (r.timeline_size() > 0) {
      ChromeTraceEvent* c = Add(&t, "KV memory (GPU HBM)", "memory", "C", start, pid, kMemoryThread, "");
      c->mutable_args()->set_gpu_hbm_bytes(r.timeline(r.timeline_size() - 1).kv_bytes());
    }
  }
  Metadata(&t, clocks);
  return t;
}

ChromeTrace ChromeTraceForStreamRuns(const std::vector<StreamRunResult>& runs) {
  ChromeTrace t;
  std::string clocks;
  constexpr double kUs = 1e6;
  for (size_t i = 0; i < runs.size(); ++i) {
    const StreamRunResult& r = runs[i];
    const int pid = static_cast<int>(i) + 1;
    const std::string clock = StreamClock(r);
    if (clocks.find(clock) == std::string::npos) clocks += (clocks.empty() ? "" : "; ") + clock;
    ProcessNames(&t, pid,
                 "run " + std::to_string(i) + ": " + r.label() + " @ " + std::to_string(r.budget_tokens()) +
                     " visual tokens",
                 "GPU (encode jobs, answers)");
    // Memory tiers at every recorded event; an encode job records one point when it starts and one when it
    // ends (one GPU server, FIFO: nothing else starts in between), so consecutive pairs are its slice.
    bool in_encode = false;
    double encode_start = 0;
    for (const MemoryPoint& p : r.memory()) {
      ChromeTraceEvent* c = Add(&t, "KV memory", "memory", "C", p.time_s() * kUs, pid, kMemoryThread, "");
      c->mutable_args()->set_gpu_hbm_bytes(p.gpu_bytes());
      c->mutable_args()->set_cpu_bank_bytes(p.cpu_bank_bytes());
      if (p.event() != "encode") continue;
      if (!in_encode) {
        encode_start = p.time_s();
      } else {
        ChromeTraceEvent* x =
            Add(&t, "encode", "encode", "X", encode_start * kUs, pid, kComputeThread, clock);
        x->set_dur((p.time_s() - encode_start) * kUs);
        x->mutable_args()->set_gpu_hbm_bytes(p.gpu_bytes());
        x->mutable_args()->set_cpu_bank_bytes(p.cpu_bank_bytes());
      }
      in_encode = !in_encode;
    }
    for (const StreamQuestionResult& q : r.questions()) {
      ChromeTraceEvent* arrive = Add(&t, "question " + std::to_string(q.question()) + " arrives", "question",
                                     "i", q.time_s() * kUs, pid, kComputeThread, clock);
      arrive->set_s("t");
      arrive->mutable_args()->set_question(q.question());
      arrive->mutable_args()->set_frames_before(q.frames_before());
      ChromeTraceEvent* x = Add(&t, "answer " + std::to_string(q.question()), "answer", "X",
                                q.answer_start_s() * kUs, pid, kComputeThread, clock);
      x->set_dur((q.answer_end_s() - q.answer_start_s()) * kUs);
      ChromeTraceArgs* a = x->mutable_args();
      a->set_question(q.question());
      a->set_retained_mass(q.retained_mass_mean());
      a->set_output_rel_error(q.output_rel_error_mean());
      a->set_gpu_hbm_bytes(q.gpu_bytes_at_answer());
      a->set_cpu_bank_bytes(q.cpu_bank_bytes_at_answer());
    }
  }
  Metadata(&t, clocks);
  return t;
}

Status WriteChromeTrace(const ChromeTrace& trace, const std::string& path) {
  return WriteFileAtomic(path, ToJson(trace));
}

}  // namespace kvsim
