// Benchmark, variants measured side by side in the same run (each in its own child process so peak RSS is
// its own); prints markdown tables for docs/performance.md.
//   baseline:   the baseline sweep (full, streaming_llm, h2o, snapkv, pyramidkv, oracle x budgets
//               5/10/20/50%): read-only pass (I/O + decode floor), the sweep on 1 thread, on all threads;
//   multimodal: the cost of merging and of the multimodal policies, each x budgets 5/10/20/50% on all
//               threads, as a ratio to snapkv over the same budgets;
//   streaming:  (streaming traces; the default suite for them) reading every layer and block encoding, the
//               full-history reference alone (stream_full), rekv / mukv x 3 budgets, and the demo sweep on 1
//               thread and on all threads, as ratios to stream_full.
//   issue14:    fixed per-trace and per-run cost against their floors (read-only pass, BLAS of the reference
//               and of the runs' own products), CPU use, every text policy x 4 budgets (docs/performance.md).
//   policies:   every text policy's cost (issue14's per-policy table) measured in pairs robust to the
//               machine's drift: each policy x 4 budgets repeating on one core while `full` alone repeats on
//               the other for --window seconds (20), one thread each, then the cores swapped; the floor (4
//               runs' own output products) likewise. Then each policy against the products its own runs
//               need (round 29: OwnProducts, from one replay of its runs), paired with `full` likewise. Each
//               cost / floor per core order, and from both orders at once (round 33: the cores' speeds
//               cancel in the geometric mean of the two orders' ratios).
//   read:       the issue14 suite's three reads alone: every query row (direct chunk reads), only the rows a
//               9-run sweep reads, every row through H5Dread on 1 thread (the reader before round 5); and the
//               trace's content hash (HashFile), which kvsim run / sweep compute before the replay (beside
//               it when the page cache holds the trace).

#include <cblas.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <boost/program_options.hpp>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <functional>
#include <iostream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "analysis/stream_sweep.h"
#include "analysis/sweep.h"
#include "policies/registry.h"
#include "policies/stream_registry.h"
#include "sim/attention.h"
#include "sim/blas.h"
#include "sim/parallel.h"
#include "sim/stream_replay.h"
#include "traces/hdf5_trace.h"

namespace po = boost::program_options;
using namespace kvsim;

namespace {

struct Measure {
  double seconds = 0;
  double peak_rss_mb = 0;
  double samples = 0;
  bool ok = false;
  double cpu_seconds = 0;  // user + system of the child
  double cpu_percent() const { return seconds > 0 ? 100.0 * cpu_seconds / seconds : 0; }
};

// One policy (with overrides) over budgets 5/10/20/50%.
std::vector<RunSpec> BudgetRuns(const std::string& name, const std::vector<std::string>& sets,
                                const std::string& label) {
  auto p = PolicyRegistry::Default().Create(name, sets);
  if (!p.ok()) std::abort();
  std::vector<RunSpec> runs;
  for (double b : {0.05, 0.10, 0.20, 0.50})
    runs.push_back(RunSpec{*p, label, b, 0, QuestionMode::kQueryAware});
  return runs;
}

std::vector<RunSpec> BaselineRuns() {
  std::vector<RunSpec> runs;
  for (const char* name : {"full", "streaming_llm", "h2o", "snapkv", "pyramidkv", "oracle"}) {
    auto p = PolicyRegistry::Default().Create(name);
    if (!p.ok()) std::abort();
    if (std::string(name) == "full") {
      runs.push_back(RunSpec{*p, name, 1.0, 0, QuestionMode::kQueryAware});
      continue;
    }
    for (double b : {0.05, 0.10, 0.20, 0.50})
      runs.push_back(RunSpec{*p, name, b, 0, QuestionMode::kQueryAware});
  }
  return runs;
}

// CPU seconds (user + system) of this process so far.
double SelfCpuSeconds() {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
}

// Runs `body` in a child process; the child reports (seconds, samples) through a pipe.
template <typename Body>
Measure InChild(Body body) {
  int fd[2];
  if (pipe(fd) != 0) std::abort();
  const pid_t pid = fork();
  if (pid == 0) {
    close(fd[0]);
    const auto t0 = std::chrono::steady_clock::now();
    const double samples = body();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double msg[4] = {s, ru.ru_maxrss / 1024.0, samples, SelfCpuSeconds()};
    if (write(fd[1], msg, sizeof msg) != sizeof msg) _exit(2);
    _exit(samples < 0 ? 1 : 0);
  }
  close(fd[1]);
  double msg[4] = {0, 0, 0, 0};
  const bool got = read(fd[0], msg, sizeof msg) == sizeof msg;
  close(fd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return Measure{msg[0], msg[1], msg[2], got && WIFEXITED(status) && WEXITSTATUS(status) == 0, msg[3]};
}

// The first two CPUs this process may run on, or {-1, -1} when it may run on fewer.
std::pair<int, int> TwoCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return {-1, -1};
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE && cpus.size() < 2; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus.size() == 2 ? std::pair{cpus[0], cpus[1]} : std::pair{-1, -1};
}

void PinTo(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (sched_setaffinity(0, sizeof set, &set) != 0) _exit(3);
}

// One pair: `a`'s and `b`'s mean CPU seconds per run, over the runs each finished in the same window.
struct Pair {
  double a_cpu = 0, b_cpu = 0;
  int a_runs = 0, b_runs = 0;
  bool ok = false;
};

// A child process pinned to `cpu` that runs `body` over and over, writing each run's CPU seconds (-1: it
// failed) to `fd` until it is killed; `other_fd` is the other child's write end, closed here.
template <typename Body>
pid_t Repeating(Body body, int cpu, int fd, int other_fd) {
  const pid_t pid = fork();
  if (pid != 0) return pid;
  close(other_fd);
  PinTo(cpu);
  for (;;) {
    const double c0 = SelfCpuSeconds();
    const double msg = body() < 0 ? -1.0 : SelfCpuSeconds() - c0;
    if (write(fd, &msg, sizeof msg) != sizeof msg || msg < 0) _exit(msg < 0 ? 1 : 2);
  }
}

// Runs `a` and `b` at the same time, each over and over in its own child process pinned to its own core
// (ca, cb), for `window` seconds or until each has finished a run, whichever is later. Drift in the
// machine's speed (on the project's VM, 15% between runs minutes apart) hits both alike, so the ratio of
// their CPU seconds per run resolves a few percent where runs one after the other do not (issue 14, round
// 28; bench/ab_simultaneous.sh does the same for two binaries). Each run is timed alone; the runs cut off
// at the end are not counted, and each side's first run (cold: page faults) is averaged in with its others.
template <typename A, typename B>
Pair InPair(A a, B b, int ca, int cb, double window) {
  int fa[2], fb[2];
  if (pipe(fa) != 0 || pipe(fb) != 0) std::abort();
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pa = Repeating(a, ca, fa[1], fb[1]);
  const pid_t pb = Repeating(b, cb, fb[1], fa[1]);
  close(fa[1]), close(fb[1]);
  Pair r;
  double sa = 0, sb = 0, m = 0;
  // The first run of each (waits for it), then the rest of the window.
  bool ok = read(fa[0], &m, sizeof m) == sizeof m && m >= 0;
  if (ok) sa += m, ++r.a_runs;
  ok = ok && read(fb[0], &m, sizeof m) == sizeof m && m >= 0;
  if (ok) sb += m, ++r.b_runs;
  const double left = window - std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (ok && left > 0) std::this_thread::sleep_for(std::chrono::duration<double>(left));
  kill(pa, SIGKILL), kill(pb, SIGKILL);
  waitpid(pa, nullptr, 0), waitpid(pb, nullptr, 0);
  for (auto [fd, sum, runs] : {std::tuple{fa[0], &sa, &r.a_runs}, std::tuple{fb[0], &sb, &r.b_runs}})
    while (ok && read(fd, &m, sizeof m) == sizeof m) {  // the runs finished before the stop
      ok = m >= 0;
      if (ok) *sum += m, ++*runs;
    }
  close(fa[0]), close(fb[0]);
  r.ok = ok;
  r.a_cpu = r.a_runs > 0 ? sa / r.a_runs : 0;
  r.b_cpu = r.b_runs > 0 ? sb / r.b_runs : 0;
  return r;
}

// a / b of one quantity measured in both core orders (InPair with the cores swapped): the geometric mean of
// the two orders' ratios, in which each core's speed cancels (PairedPolicies). Both b's must be > 0.
double BothOrders(const std::array<Pair, 2>& p) {
  return std::sqrt((p[0].a_cpu / p[0].b_cpu) * (p[1].a_cpu / p[1].b_cpu));
}

// A body for InChild: opens the trace and reads every layer with `options` (a read-only pass).
auto ReadOnlyPass(const std::string& trace_path, const TraceMeta& meta, LayerReadOptions options) {
  return [&trace_path, &meta, options]() -> double {
    auto t = OpenTrace(trace_path);
    if (!t.ok()) return -1;
    LayerData layer;
    for (int l = 0; l < meta.model.num_layers; ++l)
      if (!(*t)->ReadLayer(l, &layer, options).ok()) return -1;
    return 0;
  };
}

std::vector<StreamRunSpec> StreamRuns(const std::string& name, const std::vector<std::string>& sets,
                                      const std::vector<int>& budgets) {
  auto p = StreamPolicyRegistry::Default().Create(name, sets);
  if (!p.ok()) std::abort();
  std::vector<StreamRunSpec> runs;
  for (int b : budgets) runs.push_back(StreamRunSpec{*p, name, b});
  return runs;
}

// Issue 14: kvsim's fixed per-trace cost and per-run cost against their floors, CPU use, and every text
// policy x 4 budgets. Floors: a read-only pass (I/O + fp16 -> fp32), and the BLAS time of the products a
// replay cannot avoid, on the trace's shapes with random data, single-threaded BLAS per (layer, KV head)
// unit over `threads` threads (as kvsim runs them): the reference (logits S x T x d and output S x T x d per
// query head) and, per run, its own output product (S x (B + S) x d per query head, B the budget).
double ProductsFloor(const TraceMeta& meta, int threads, const std::vector<int>& kept) {
  const ModelInfo& m = meta.model;
  const int s = meta.num_decode_steps, t = meta.total_tokens(), d = m.head_dim, g = m.GroupSize();
  const int units = m.num_layers * m.num_kv_heads;
  struct Buf {
    std::vector<float> q, k, v, p, o;
  };
  std::vector<Buf> bufs(std::max(1, threads));
  for (Buf& b : bufs) {
    b.q.assign(static_cast<size_t>(g) * s * d, 0.01f);
    b.k.assign(static_cast<size_t>(t) * d, 0.02f);
    b.v.assign(static_cast<size_t>(t) * d, 0.03f);
    b.p.assign(static_cast<size_t>(g) * s * t, 0.001f);
    b.o.assign(static_cast<size_t>(g) * s * d, 0.0f);
  }
  EnsureSingleThreadedBlas();
  const auto t0 = std::chrono::steady_clock::now();
  ParallelForWorkers(units, threads, [&](int, int w) {
    Buf& b = bufs[w];
    if (kept.empty()) {  // the reference: logits and output of every query head of the unit
      for (int h = 0; h < g; ++h) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s, t, d, 1.0f,
                    b.q.data() + static_cast<size_t>(h) * s * d, d, b.k.data(), d, 0.0f,
                    b.p.data() + static_cast<size_t>(h) * s * t, t);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s, d, t, 1.0f,
                    b.p.data() + static_cast<size_t>(h) * s * t, t, b.v.data(), d, 0.0f,
                    b.o.data() + static_cast<size_t>(h) * s * d, d);
      }
      return;
    }
    for (int width : kept)  // one run's output product: the group's rows over its kept columns
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, g * s, d, std::min(width, t), 1.0f, b.p.data(),
                  std::min(width, t), b.v.data(), d, 0.0f, b.o.data(), d);
  });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The products a policy's four runs need on this trace beyond what the trace records (--suite policies'
// second floor, round 29), taken from the runs' own results: each run's output product over its own cache
// (S x kept x d per query head, kept its mean slots per KV head) and its merged slots' logits (S x merged x
// d: a merged key is no key of the trace, so the reference holds no logit for it), the observation window's
// logits (W x n x d per query head and layer, once: the same for every budget), and for a merging policy each
// run's search of every evicted prompt key's nearest kept slot ((n - K) x K x d per KV head and layer, K the
// layer's prompt slots kept). Not counted: products the trace records (prompt column sums, MEDA's prompt
// entropies), which a trace without them would add.
struct OwnProducts {
  std::vector<int> widths;             // per run
  std::vector<int> merged;             // per run: merged slots per KV head at the end (0: none)
  int window = 0;                      // rows (0: no window scoring)
  int prompt = 0;                      // n: the compressible prompt tokens
  std::vector<std::vector<int>> kept;  // merging runs: per layer, the prompt slots kept per KV head
};

OwnProducts OwnProductsOf(const Policy& policy, const std::vector<RunResult>& results) {
  OwnProducts own;
  for (const RunResult& r : results) {
    own.prompt = r.compressed_prompt_tokens();
    own.widths.push_back(static_cast<int>(std::lround(r.metrics().kept_tokens_mean())));
    own.merged.push_back(static_cast<int>(std::lround(r.metrics().merged_slots_mean())));
    if (!policy.gpu_work().merge) continue;
    own.kept.emplace_back();
    for (const LayerResult& l : r.layers())
      own.kept.back().push_back(static_cast<int>(std::lround(l.metrics().prompt_kept_tokens_mean())));
  }
  own.window = std::min(policy.requirements().window, own.prompt);
  return own;
}

// OwnProducts' floating-point operations (GFLOP): the output products, the window's logits, the search.
std::array<double, 3> OwnGflop(const TraceMeta& meta, const OwnProducts& own) {
  const ModelInfo& m = meta.model;
  const double d = m.head_dim, units = static_cast<double>(m.num_layers) * m.num_kv_heads;
  std::array<double, 3> f{};
  for (int w : own.widths) f[0] += 2.0 * m.GroupSize() * meta.num_decode_steps * w * d * units;
  for (int w : own.merged) f[0] += 2.0 * m.GroupSize() * meta.num_decode_steps * w * d * units;
  f[1] = 2.0 * own.window * own.prompt * d * m.num_heads * m.num_layers;
  for (const auto& run : own.kept)
    for (int kept : run) f[2] += 2.0 * std::max(0, own.prompt - kept) * kept * d * m.num_kv_heads;
  for (double& x : f) x /= 1e9;
  return f;
}

// BLAS time (one thread) of OwnProducts' products, on the trace's shapes with constant data.
double OwnProductsFloor(const TraceMeta& meta, const OwnProducts& own) {
  const ModelInfo& m = meta.model;
  const int d = m.head_dim, g = m.GroupSize(), n = own.prompt;
  const auto t0 = std::chrono::steady_clock::now();
  if (ProductsFloor(meta, 1, own.widths) < 0) return -1;
  std::vector<float> q(static_cast<size_t>(std::max({1, n, meta.num_decode_steps})) * d, 0.01f),
      k(q.size(), 0.02f), out;
  size_t most = static_cast<size_t>(own.window) * n;
  for (int merged : own.merged) most = std::max(most, static_cast<size_t>(meta.num_decode_steps) * merged);
  constexpr int kSearchRows = 512;  // the search's evicted keys in blocks: a bounded output on long prompts
  for (const auto& run : own.kept)
    for (int kept : run) most = std::max(most, static_cast<size_t>(std::min(kSearchRows, n)) * kept);
  out.resize(std::max<size_t>(1, most));
  EnsureSingleThreadedBlas();
  for (int u = 0; u < m.num_layers * m.num_kv_heads && own.window > 0; ++u)
    for (int h = 0; h < g; ++h)  // the window's queries x the prompt's keys
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, own.window, n, d, 1.0f, q.data(), d, k.data(), d,
                  0.0f, out.data(), n);
  for (int merged : own.merged)  // the decode queries x the merged keys
    for (int u = 0; u < m.num_layers * m.num_kv_heads && merged > 0; ++u)
      for (int h = 0; h < g; ++h)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, meta.num_decode_steps, merged, d, 1.0f, q.data(),
                    d, k.data(), d, 0.0f, out.data(), merged);
  for (const auto& run : own.kept)
    for (int kept : run) {
      const int e = n - kept;  // evicted keys x kept slots, per KV head of the layer
      if (e <= 0 || kept <= 0) continue;
      for (int u = 0; u < m.num_kv_heads; ++u)
        for (int i = 0; i < e; i += kSearchRows)
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, std::min(kSearchRows, e - i), kept, d, 1.0f,
                      q.data() + static_cast<size_t>(i) * d, d, k.data(), d, 0.0f, out.data(), kept);
    }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// --suite policies: every text policy x 4 budgets beside `full` alone (InPair, both core orders), and the
// floor of 4 runs' own output products likewise; one thread each. cost = policy - full (CPU s per run, each
// order's own pair); cost / floor = (policy / full - 1) / (floor / full): ratios of runs that ran at the
// same time, so the machine's drift between pairs cancels. "both orders" takes each ratio X / full as the
// geometric mean of its two orders' (round 33): if one core runs at c0 and the other at c1, one order
// measures (X / full) c1 / c0 and the other (X / full) c0 / c1, so their geometric mean is X / full whatever
// c0 / c1 is. A 10% asymmetry between the cores moves one order's cost / floor by 25-45% (the cost is a
// difference of two run times); round 32's two orders differed by up to 1.6x.
int PairedPolicies(const std::vector<std::pair<std::string, std::vector<RunSpec>>>& per_policy,
                   const std::function<double(const std::vector<RunSpec>&)>& replay1,
                   const std::vector<RunSpec>& full_only, const TraceMeta& meta,
                   const std::vector<int>& kept4, const std::vector<OwnProducts>& own, double window) {
  const auto [c0, c1] = TwoCpus();
  if (c0 < 0) {
    std::cerr << "kvsim_bench: --suite policies needs two CPUs this process may use (see taskset -p)\n";
    return 2;
  }
  auto full = [&] { return replay1(full_only); };
  auto both_orders = [&](auto a) {
    return std::array<Pair, 2>{InPair(a, full, c0, c1, window), InPair(a, full, c1, c0, window)};
  };
  const auto floor = both_orders([&] { return ProductsFloor(meta, 1, kept4) >= 0 ? 0.0 : -1.0; });
  if (!floor[0].ok || !floor[1].ok) {
    std::cerr << "kvsim_bench: the floor's pair failed\n";
    return 1;
  }
  // Ratios need `full`'s CPU time: on a trace small enough that a run takes less than the clock's tick it
  // can read 0, and the ratios are then shown as "-" rather than as a division by zero.
  const bool timed = floor[0].b_cpu > 0 && floor[1].b_cpu > 0;
  const double floor_ratio = timed ? BothOrders(floor) : 0;
  std::printf(
      "per policy, paired: each row on cpu %d while `full` alone repeats on cpu %d for %g s (at least one "
      "run each), then the "
      "cores "
      "swapped; 1 thread each; CPU s per run (runs in the window), core order 1 / 2; 4 runs = budgets "
      "5/10/20/50%%; both orders: each ratio to `full` as the geometric mean of its two orders' (the cores' "
      "speeds cancel)\n\n| policy x 4 budgets | CPU s (runs) | `full` alone beside it | cost CPU s (policy - "
      "full) | cost / floor | cost / floor, both orders |\n|---|---:|---:|---:|---:|---:|\n",
      c0, c1, window);
  // One side of a pair in both core orders: "CPU s (runs) / CPU s (runs)".
  auto side = [](const std::array<Pair, 2>& p, bool a) {
    char buf[80];
    std::snprintf(buf, sizeof buf, "%.2f (%d) / %.2f (%d)", a ? p[0].a_cpu : p[0].b_cpu,
                  a ? p[0].a_runs : p[0].b_runs, a ? p[1].a_cpu : p[1].b_cpu, a ? p[1].a_runs : p[1].b_runs);
    return std::string(buf);
  };
  auto cells = [&](const std::array<Pair, 2>& p) { return side(p, true) + " | " + side(p, false); };
  // cost / floor: (policy / full - 1) / (floor / full); "-" without the times it needs.
  auto times = [](bool timed_x, double x_over_full, double floor_over_full) {
    char buf[32] = "-";
    if (timed_x && floor_over_full > 0)
      std::snprintf(buf, sizeof buf, "%.2fx", (x_over_full - 1) / floor_over_full);
    return std::string(buf);
  };
  // ... of one core order.
  auto over = [&](const Pair& q, double floor_over_full) {
    return times(q.b_cpu > 0, q.b_cpu > 0 ? q.a_cpu / q.b_cpu : 0, floor_over_full);
  };
  // ... from both orders: each ratio the geometric mean of its orders'.
  auto over_both = [&](const std::array<Pair, 2>& p, double floor_over_full) {
    const bool timed_both = p[0].b_cpu > 0 && p[1].b_cpu > 0;
    return times(timed_both, timed_both ? BothOrders(p) : 0, floor_over_full);
  };
  if (timed)
    std::printf(
        "| floor: 4 runs' own output products (BLAS) | %s | - | floor / full %.3f / %.3f | floor / "
        "full %.3f |\n",
        cells(floor).c_str(), floor[0].a_cpu / floor[0].b_cpu, floor[1].a_cpu / floor[1].b_cpu, floor_ratio);
  else
    std::printf("| floor: 4 runs' own output products (BLAS) | %s | - | - | - |\n", cells(floor).c_str());
  std::fflush(stdout);
  std::vector<std::array<Pair, 2>> pairs;
  for (const auto& [label, rs] : per_policy) {
    const auto p = both_orders([&] { return replay1(rs); });
    if (!p[0].ok || !p[1].ok) {
      std::cerr << "kvsim_bench: " << label << "'s pair failed\n";
      return 1;
    }
    pairs.push_back(p);
    std::printf("| %s | %s | %.2f / %.2f | %s / %s | %s |\n", label.c_str(), cells(p).c_str(),
                p[0].a_cpu - p[0].b_cpu, p[1].a_cpu - p[1].b_cpu, over(p[0], floor_ratio).c_str(),
                over(p[1], floor_ratio).c_str(), over_both(p, floor_ratio).c_str());
    std::fflush(stdout);
  }
  // Each policy against its own products (OwnProducts), paired with `full` the same way: cost / own floor =
  // (policy / full - 1) / (own floor / full), each core order from its own two pairs.
  std::printf(
      "\nper policy against the products its own runs need (OwnProducts: each run's output product over its "
      "own mean cache and its merged slots' logits, the observation window's logits once, a merging run's "
      "nearest-slot search), paired "
      "with `full` alone likewise\n\n| policy x 4 budgets | GFLOP: output + window + search | own floor: CPU "
      "s (runs) | `full` alone beside it | cost / own floor | cost / own floor, both orders |\n"
      "|---|---:|---:|---:|---:|---:|\n");
  for (size_t i = 0; i < per_policy.size(); ++i) {
    const auto f = OwnGflop(meta, own[i]);
    const auto q = both_orders([&] { return OwnProductsFloor(meta, own[i]) >= 0 ? 0.0 : -1.0; });
    if (!q[0].ok || !q[1].ok) {
      std::cerr << "kvsim_bench: " << per_policy[i].first << "'s own floor's pair failed\n";
      return 1;
    }
    std::string ratio[2];
    for (int o = 0; o < 2; ++o) ratio[o] = over(pairs[i][o], q[o].b_cpu > 0 ? q[o].a_cpu / q[o].b_cpu : 0);
    const std::string both = over_both(pairs[i], q[0].b_cpu > 0 && q[1].b_cpu > 0 ? BothOrders(q) : 0);
    char what[96];
    std::snprintf(what, sizeof what, "%.4g + %.4g + %.4g", f[0], f[1], f[2]);
    std::printf("| %s | %s | %s | %s | %s / %s | %s |\n", per_policy[i].first.c_str(), what,
                side(q, true).c_str(), side(q, false).c_str(), ratio[0].c_str(), ratio[1].c_str(),
                both.c_str());
    std::fflush(stdout);
  }
  return 0;
}

int Issue14Suite(const std::string& trace_path, const TraceMeta& meta, double trace_bytes, int threads,
                 bool reads_only, bool paired, double window) {
  auto make = [](const char* name, std::vector<std::string> sets = {}) {
    auto p = PolicyRegistry::Default().Create(name, sets);
    if (!p.ok()) std::abort();
    return *p;
  };
  const std::vector<double> budgets{0.05, 0.10, 0.20, 0.50};
  std::vector<RunSpec> full_only{RunSpec{make("full"), "full", 1.0, 0, QuestionMode::kQueryAware}};
  std::vector<RunSpec> nine = full_only;
  for (const char* name : {"streaming_llm", "snapkv"})
    for (double b : budgets) nine.push_back(RunSpec{make(name), name, b, 0, QuestionMode::kQueryAware});
  std::vector<RunSpec> all = full_only;
  std::vector<std::pair<std::string, std::vector<RunSpec>>> per_policy;  // each policy x 4 budgets alone
  const std::vector<std::pair<const char*, std::vector<std::string>>> text_policies{
      {"streaming_llm", {}},
      {"h2o", {}},
      {"snapkv", {}},
      {"pyramidkv", {}},
      {"adakv", {}},
      {"oracle", {}},
      {"meda", {}},
      {"meda", {"variant=OFFICIAL_CODE"}},
      {"look_m", {}},
      {"madakv", {}},
      {"hae", {"mode=BUDGET"}}};
  for (const auto& [name, sets] : text_policies) {
    auto p = make(name, sets);
    std::string label = name;
    for (const std::string& set : sets) label += " " + set;
    per_policy.emplace_back(label, std::vector<RunSpec>{});
    for (double b : budgets) {
      all.push_back(RunSpec{p, name, b, 0, QuestionMode::kQueryAware});
      per_policy.back().second.push_back(all.back());
    }
  }
  auto replay = [&](const std::vector<RunSpec>& rs) {
    return [&]() -> double {
      auto t = OpenTrace(trace_path);
      if (!t.ok()) return -1;
      auto res = Replay(**t, rs, ReplayOptions{.threads = threads});
      if (!res.ok()) {
        std::cerr << "kvsim_bench: " << res.status().message() << "\n";
        return -1;
      }
      double samples = 0;
      for (const auto& r : *res) samples += r.metrics().samples();
      return samples;
    };
  };
  // Reading every layer as the replay does (direct chunk reads on `threads` threads where the layout
  // allows), every query row: the floor of reading the whole trace. Also only the rows the 9-run sweep reads
  // (ReplayQueryRows), and every row through HDF5's H5Dread on one thread (the reader before round 5).
  auto read_only = [&](LayerReadOptions options) { return ReadOnlyPass(trace_path, meta, options); };
  std::vector<int> kept;  // the 8 budgeted runs' kept widths (prompt budget + decode tokens)
  for (int rep = 0; rep < 2; ++rep)
    for (double b : budgets)
      kept.push_back(static_cast<int>(std::lround(b * meta.prefill_length)) + meta.num_decode_steps);
  // The first pass brings the trace into the page cache (its time is shown, not used as a floor): a trace
  // partly evicted since the last run made the floor cold once and the fixed-cost ratio meaningless.
  const Measure first_read = InChild(read_only(LayerReadOptions{.threads = threads}));
  if (paired) {
    if (!first_read.ok) return 1;
    auto replay1 = [&](const std::vector<RunSpec>& rs) -> double {
      auto t = OpenTrace(trace_path);
      if (!t.ok()) return -1;
      return Replay(**t, rs, ReplayOptions{.threads = 1}).ok() ? 0 : -1;
    };
    const std::vector<int> kept4(kept.begin(), kept.begin() + static_cast<long>(budgets.size()));
    // Each policy's own products, from one replay of its runs (any thread count gives the same results).
    std::vector<OwnProducts> own;
    for (const auto& [label, rs] : per_policy) {
      auto t = OpenTrace(trace_path);
      if (!t.ok()) return 1;
      auto res = Replay(**t, rs, ReplayOptions{.threads = threads});
      if (!res.ok()) {
        std::cerr << "kvsim_bench: " << label << ": " << res.status().message() << "\n";
        return 1;
      }
      own.push_back(OwnProductsOf(*rs.front().policy, *res));
    }
    return PairedPolicies(per_policy, replay1, full_only, meta, kept4, own, window);
  }
  const Measure io = InChild(read_only(LayerReadOptions{.threads = threads}));
  const Measure io9 = InChild(
      read_only(LayerReadOptions{.query_rows = ReplayQueryRows(meta, nine, false), .threads = threads}));
  const Measure io_lib = InChild(read_only(LayerReadOptions{.threads = 1, .direct_chunks = false}));
  if (reads_only) {  // --suite read: the three reads alone, and the content hash run/sweep compute first
    const Measure hash = InChild([&]() -> double { return HashFile(trace_path).ok() ? 0 : -1; });
    if (!first_read.ok || !io.ok || !io9.ok || !io_lib.ok || !hash.ok) return 1;
    std::printf(
        "reads: %d threads\n\n| what | wall s | CPU s | CPU %% | peak RSS MB |\n|---|---:|---:|---:|---:|\n",
        threads);
    for (const auto& [what, m] :
         {std::pair<const char*, const Measure&>{"first read of this run (warms the page cache)", first_read},
          {"every row, direct chunk reads", io},
          {"the 9-run sweep's rows, direct chunk reads", io9},
          {"every row, H5Dread, 1 thread (before round 5)", io_lib},
          {"the content hash (HashFile, 1 thread; before the replay unless cached)", hash}})
      std::printf("| %s | %.2f | %.2f | %.0f | %.0f |\n", what, m.seconds, m.cpu_seconds, m.cpu_percent(),
                  m.peak_rss_mb);
    return 0;
  }
  const Measure ref_floor =
      InChild([&]() -> double { return ProductsFloor(meta, threads, {}) >= 0 ? 0 : -1; });
  const Measure runs_floor =
      InChild([&]() -> double { return ProductsFloor(meta, threads, kept) >= 0 ? 0 : -1; });
  const Measure full = InChild(replay(full_only));
  const Measure sweep9 = InChild(replay(nine));
  const Measure sweep45 = InChild(replay(all));
  if (!first_read.ok || !io.ok || !io9.ok || !io_lib.ok || !ref_floor.ok || !runs_floor.ok || !full.ok ||
      !sweep9.ok || !sweep45.ok) {
    std::cerr << "kvsim_bench: a measurement failed\n";
    return 1;
  }
  std::printf(
      "issue 14: %d threads, OpenBLAS %s kernels; floors are measured on this machine in this run\n\n",
      threads, BlasCoreName().c_str());
  std::printf(
      "| what | wall s | CPU s | CPU %% | peak RSS MB | RSS / trace |\n|---|---:|---:|---:|---:|---:|\n");
  auto row = [&](const std::string& what, const Measure& m) {
    std::printf("| %s | %.2f | %.2f | %.0f | %.0f | %.3f |\n", what.c_str(), m.seconds, m.cpu_seconds,
                m.cpu_percent(), m.peak_rss_mb, m.peak_rss_mb * 1048576.0 / trace_bytes);
  };
  row("first read of this run (warms the page cache; not a floor)", first_read);
  row("floor: read every layer only (I/O + checksum + fp16 -> fp32, every query row)", io);
  row("read only the query rows a 9-run sweep needs (decode steps + snapkv's window)", io9);
  row("read every layer through H5Dread, 1 thread (the reader before round 5)", io_lib);
  row("floor: BLAS of the reference products (logits + output, every query head)", ref_floor);
  row("floor: BLAS of 8 runs' own output products (S x (B + S) x d per query head)", runs_floor);
  row("kvsim: full alone (= the fixed per-trace cost)", full);
  row("kvsim: full + streaming_llm + snapkv x 5/10/20/50% (9 runs)", sweep9);
  row("kvsim: all 12 text policies x 5/10/20/50% (45 runs)", sweep45);
  std::fflush(stdout);
  // Per-policy cost: each policy x 4 budgets in its own child process (no `full` run in it: the reference
  // and the read are computed by every replay anyway), minus `full` alone. Wall and CPU seconds (user +
  // system) are measured; "cost" is the difference to `full` alone, so it is the policy's own work: its
  // first pass, prompt scores, selection, merges, per-step hooks, and its runs' per-step metrics and
  // output products. On a loaded machine compare the CPU columns. "cost / floor" divides the cost's CPU
  // seconds by the measured floor of four runs' own output products (the 8-run floor above, whose runs are
  // the same four budgets twice, per budget set), the issue's "each run's cost within 2x of its own products'
  // floor" for the policy's four runs together. A policy that keeps more than its budget (MEDA's official
  // code keeps all text), or that also computes merged slots' logits, has more products than this floor
  // counts.
  const double floor4_cpu = runs_floor.cpu_seconds * static_cast<double>(budgets.size()) / kept.size();
  std::printf(
      "\nper policy (4 runs: budgets 5/10/20/50%%, each line its own child process; cost = that process - "
      "full alone; floor = 4 runs' own output products, CPU %.2f s)\n\n| policy x 4 budgets | wall s | CPU "
      "s | CPU %% | cost wall s | cost CPU s | cost / floor | peak RSS MB | RSS / trace "
      "|\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
      floor4_cpu);
  auto policy_row = [&](const std::string& what, const Measure& m) {
    const double own_cpu = m.cpu_seconds - full.cpu_seconds;
    char ratio[32] = "-";  // full alone is the reference, not a policy's cost
    if (&m != &full && floor4_cpu > 0) std::snprintf(ratio, sizeof ratio, "%.2fx", own_cpu / floor4_cpu);
    std::printf("| %s | %.2f | %.2f | %.0f | %.2f | %.2f | %s | %.0f | %.3f |\n", what.c_str(), m.seconds,
                m.cpu_seconds, m.cpu_percent(), m.seconds - full.seconds, own_cpu, ratio, m.peak_rss_mb,
                m.peak_rss_mb * 1048576.0 / trace_bytes);
    std::fflush(stdout);
  };
  policy_row("full alone (reference)", full);
  double cost_wall = 0, cost_cpu = 0;
  for (const auto& [label, rs] : per_policy) {
    const Measure m = InChild(replay(rs));
    if (!m.ok) {
      std::cerr << "kvsim_bench: " << label << " failed\n";
      return 1;
    }
    policy_row(label, m);
    cost_wall += m.seconds - full.seconds;
    cost_cpu += m.cpu_seconds - full.cpu_seconds;
  }
  std::printf(
      "\nsum of the policies' costs: wall %.2f s, CPU %.2f s; the 45-run sweep beyond full alone: wall %.2f "
      "s, "
      "CPU %.2f s\n",
      cost_wall, cost_cpu, sweep45.seconds - full.seconds, sweep45.cpu_seconds - full.cpu_seconds);
  const double fixed_floor = io.seconds + ref_floor.seconds;
  const double per_run = (sweep9.seconds - full.seconds) / 8, per_run_floor = runs_floor.seconds / 8;
  std::printf("\nfixed per-trace cost %.2f s vs floor %.2f s (read-only pass + reference BLAS): %.2fx\n",
              full.seconds, fixed_floor, full.seconds / fixed_floor);
  std::printf("cost per extra run %.2f s vs floor %.2f s (its output product): %.2fx\n", per_run,
              per_run_floor, per_run / per_run_floor);
  return 0;
}

int StreamingSuite(const std::string& trace_path, const TraceMeta& meta, int threads) {
  const std::vector<int> budgets{2048, 8212, 12544};
  auto replay = [&](std::vector<StreamRunSpec> rs, int th) {
    return [&, rs, th]() -> double {
      auto t = OpenTrace(trace_path);
      if (!t.ok()) return -1;
      StreamReplayOptions o;
      o.threads = th;
      auto res = ReplayStream(**t, rs, o);
      if (!res.ok()) {
        std::cerr << "kvsim_bench: " << res.status().message() << "\n";
        return -1;
      }
      double samples = 0;
      for (const auto& r : *res) samples += r.mean().samples() * r.questions_size();
      return samples;
    };
  };
  auto read_all = [&]() -> double {
    auto t = OpenTrace(trace_path);
    if (!t.ok()) return -1;
    LayerData layer;
    BlockLayerData block;
    for (int l = 0; l < meta.model.num_layers; ++l) {
      if (!(*t)->ReadLayer(l, &layer).ok()) return -1;
      for (const BlockEncodingInfo& b : meta.stream->block_encodings)
        if (!(*t)->ReadBlockLayer(b.granularity, l, &block).ok()) return -1;
    }
    return 0;
  };
  std::vector<StreamRunSpec> demo = StreamRuns("stream_full", {}, {0});
  for (const char* name : {"stream_recent", "stream_uniform", "stream_oracle", "rekv", "mukv"}) {
    auto r = StreamRuns(name, {}, budgets);
    demo.insert(demo.end(), r.begin(), r.end());
  }
  auto paper = StreamRuns("mukv", {"variant=PAPER"}, budgets);
  demo.insert(demo.end(), paper.begin(), paper.end());
  struct Variant {
    std::string what;
    std::vector<StreamRunSpec> runs;
    int threads;
  };
  const std::string all = std::to_string(threads) + " threads";
  const std::vector<Variant> variants{
      {"stream_full (reference)", StreamRuns("stream_full", {}, {0}), threads},
      {"rekv x budgets 2048/8212/12544", StreamRuns("rekv", {}, budgets), threads},
      {"mukv x budgets 2048/8212/12544 (plan: FFT + attention at the last layer)",
       StreamRuns("mukv", {}, budgets), threads},
      {"demo sweep (" + std::to_string(demo.size()) + " runs), 1 thread", demo, 1},
      {"demo sweep (" + std::to_string(demo.size()) + " runs), " + all, demo, threads},
  };
  std::printf("streaming: %d frames x %d tokens, %zu questions, %zu block granularities\n\n",
              meta.stream->num_frames, meta.stream->tokens_per_frame, meta.stream->questions.size(),
              meta.stream->block_encodings.size());
  std::printf("| variant | wall s | peak RSS MB | vs stream_full |\n|---|---:|---:|---:|\n");
  const Measure io = InChild(read_all);
  if (!io.ok) return 1;
  double ref = 0;
  for (const Variant& v : variants) {
    const Measure m = InChild(replay(v.runs, v.threads));
    if (!m.ok) {
      std::cerr << "kvsim_bench: " << v.what << " failed\n";
      return 1;
    }
    if (ref == 0) {
      std::printf("| read every layer and block encoding only | %.2f | %.0f | %.2fx |\n", io.seconds,
                  io.peak_rss_mb, io.seconds / m.seconds);
      ref = m.seconds;
    }
    std::printf("| %s | %.2f | %.0f | %.2fx |\n", v.what.c_str(), m.seconds, m.peak_rss_mb, m.seconds / ref);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  kvsim::RestartForBlasKernels(argv);  // as kvsim does: OpenBLAS's fast kernels on a CPU it does not know
  std::string trace_path, suite;
  int threads = 0;
  double window = 20;
  po::options_description opts("kvsim_bench options");
  opts.add_options()("help,h", "help")("trace", po::value(&trace_path)->required(), "trace (.h5)")(
      "threads", po::value(&threads)->default_value(0), "threads for the parallel variant (0 = all cores)")(
      "suite", po::value(&suite)->default_value("all"),
      "baseline | multimodal | streaming | issue14 | policies | read | all (streaming traces: streaming)")(
      "window", po::value(&window)->default_value(20),
      "--suite policies: seconds each pair repeats its runs (each side runs at least once; runs of 30 s and "
      "more agreed within 3% in bench/ab_simultaneous.sh)");
  po::variables_map vm;
  try {
    po::store(po::parse_command_line(argc, argv, opts), vm);
    if (vm.count("help")) {
      std::cout << opts << "\n";
      return 0;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    std::cerr << "kvsim_bench: " << e.what() << "\n" << opts << "\n";
    return 2;
  }
  if (threads <= 0) threads = DefaultThreads();
  if (!(window >= 0)) {
    std::cerr << "kvsim_bench: --window " << window << ": must be 0 or more seconds\n";
    return 2;
  }
  auto probe = OpenTrace(trace_path);
  if (!probe.ok()) {
    std::cerr << "kvsim_bench: " << probe.status().message() << "\n";
    return 1;
  }
  const TraceMeta meta = (*probe)->meta();
  probe->reset();
  struct stat st {};
  stat(trace_path.c_str(), &st);
  if (meta.is_streaming() || suite == "streaming") {
    if (!meta.is_streaming()) {
      std::cerr << "kvsim_bench: --suite streaming needs a streaming trace\n";
      return 2;
    }
    std::printf("trace: %s (%s, %d layers, %d/%d heads, d %d, %.2f GB)\n", trace_path.c_str(),
                meta.model.name.c_str(), meta.model.num_layers, meta.model.num_heads, meta.model.num_kv_heads,
                meta.model.head_dim, st.st_size / 1e9);
    return StreamingSuite(trace_path, meta, threads);
  }
  const auto runs = BaselineRuns();

  // Every layer, every query row, read as the replay reads (direct chunk reads on `threads` threads).
  auto read_only = [&](LayerReadOptions options) { return ReadOnlyPass(trace_path, meta, options); };
  auto sweep = [&](int th) {
    return [&, th]() -> double {
      auto t = OpenTrace(trace_path);
      if (!t.ok()) return -1;
      auto res = Replay(**t, runs, ReplayOptions{.threads = th});
      if (!res.ok()) return -1;
      double samples = 0;
      for (const auto& r : *res) samples += r.metrics().samples();
      return samples;
    };
  };
  if (suite == "issue14" || suite == "read" || suite == "policies") {
    std::printf("trace: %s (%s, %d layers, %d/%d heads, d %d, prompt %d, %d decode steps, %.2f GB)\n\n",
                trace_path.c_str(), meta.model.name.c_str(), meta.model.num_layers, meta.model.num_heads,
                meta.model.num_kv_heads, meta.model.head_dim, meta.prefill_length, meta.num_decode_steps,
                st.st_size / 1e9);
    std::fflush(stdout);  // the measurements fork: an unflushed buffer would be written by every child
    return Issue14Suite(trace_path, meta, static_cast<double>(st.st_size), threads, suite == "read",
                        suite == "policies", window);
  }
  if (suite != "all" && suite != "baseline" && suite != "multimodal") {
    std::cerr << "kvsim_bench: --suite '" << suite
              << "': expected baseline, multimodal, issue14, policies, read or all\n";
    return 2;
  }
  std::printf("trace: %s (%s, %d layers, %d/%d heads, d %d, prompt %d, %d decode steps, %.2f GB)\n\n",
              trace_path.c_str(), meta.model.name.c_str(), meta.model.num_layers, meta.model.num_heads,
              meta.model.num_kv_heads, meta.model.head_dim, meta.prefill_length, meta.num_decode_steps,
              st.st_size / 1e9);
  if (suite != "baseline") {
    auto replay = [&](std::vector<RunSpec> rs) {
      return [&, rs]() -> double {
        auto t = OpenTrace(trace_path);
        if (!t.ok()) return -1;
        auto res = Replay(**t, rs, ReplayOptions{.threads = threads});
        if (!res.ok()) return -1;
        double samples = 0;
        for (const auto& r : *res) samples += r.metrics().samples();
        return samples;
      };
    };
    struct Variant {
      const char* what;
      std::vector<RunSpec> runs;
    };
    const std::vector<Variant> variants{
        {"snapkv (reference)", BudgetRuns("snapkv", {}, "snapkv")},
        {"snapkv+average (merging every evicted token)", BudgetRuns("snapkv+average", {}, "snapkv+average")},
        {"look_m (text prior + pivot merge)", BudgetRuns("look_m", {}, "look_m")},
        {"meda (first pass: cross-modal entropy; average merge)", BudgetRuns("meda", {}, "meda")},
        {"meda variant=OFFICIAL_CODE (first pass: causal self-attention entropy)",
         BudgetRuns("meda", {"variant=OFFICIAL_CODE"}, "meda-code")},
    };
    std::printf("multimodal: each variant = one policy x budgets 5/10/20/50%% (4 runs), %d threads\n\n",
                threads);
    std::printf("| variant | wall s | peak RSS MB | vs snapkv |\n|---|---:|---:|---:|\n");
    double ref = 0;
    for (const Variant& v : variants) {
      const Measure m = InChild(replay(v.runs));
      if (!m.ok) {
        std::cerr << "kvsim_bench: " << v.what << " failed\n";
        return 1;
      }
      if (ref == 0) ref = m.seconds;
      std::printf("| %s | %.2f | %.0f | %.2fx |\n", v.what, m.seconds, m.peak_rss_mb, m.seconds / ref);
      std::fflush(stdout);
    }
    std::printf("\n");
    if (suite == "multimodal") return 0;
  }
  // The first pass brings the trace into the page cache (its time is shown, not used as a floor): a trace
  // partly evicted since the last run made the floor cold once and the fixed-cost ratio meaningless.
  const Measure first_read = InChild(read_only(LayerReadOptions{.threads = threads}));
  const Measure io = InChild(read_only(LayerReadOptions{.threads = threads}));
  const Measure one = InChild(sweep(1));
  const Measure par = InChild(sweep(threads));
  if (!first_read.ok || !io.ok || !one.ok || !par.ok) {
    std::cerr << "kvsim_bench: a measurement failed\n";
    return 1;
  }
  std::printf("baseline runs: %zu (6 baselines; full once, the others x budgets 5/10/20/50%%)\n\n",
              runs.size());
  std::printf(
      "| variant | wall s | peak RSS MB | RSS / trace size | samples/s | speed-up vs 1 thread "
      "|\n|---|---:|---:|---:|---:|---:|\n");
  auto row = [&](const char* name, const Measure& m) {
    const double rss_share = m.peak_rss_mb * 1048576.0 / st.st_size;
    if (m.samples <= 0) {  // the read-only pass: no samples, no speed-up to speak of
      std::printf("| %s | %.2f | %.0f | %.3f | - | - |\n", name, m.seconds, m.peak_rss_mb, rss_share);
      return;
    }
    std::printf("| %s | %.2f | %.0f | %.3f | %.3g | %.2fx |\n", name, m.seconds, m.peak_rss_mb, rss_share,
                m.samples / m.seconds, one.seconds / m.seconds);
  };
  row("first read of this run (warms the page cache)", first_read);
  row("read every layer only (I/O + checksum + fp16 decode)", io);
  row("sweep, 1 thread", one);
  std::string name = "sweep, " + std::to_string(threads) + " threads";
  row(name.c_str(), par);
  return 0;
}
