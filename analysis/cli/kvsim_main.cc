// kvsim command line. Every subcommand has --help; exit codes are documented in docs/cli.md:
//   0 success, 1 bad input (file, config, trace, flag value), 2 usage error, 3 validation mismatch.

#include <google/protobuf/stubs/logging.h>
#include <unistd.h>

#include <boost/program_options.hpp>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "analysis/chrome_trace.h"
#include "analysis/latency_report.h"
#include "analysis/report.h"
#include "analysis/search.h"
#include "analysis/stream_sweep.h"
#include "analysis/sweep.h"
#include "analysis/trace_stats.h"
#include "analysis/validate.h"
#include "analysis/verify_hae.h"
#include "gpu_replay/plan.h"
#include "policies/registry.h"
#include "policies/stream_registry.h"
#include "sim/blas.h"
#include "sim/perf_model.h"
#include "sim/progress.h"
#include "sim/version.h"
#include "traces/hash_cache.h"
#include "traces/hdf5_trace.h"
#include "traces/synth.h"

namespace po = boost::program_options;

namespace kvsim {
namespace {

constexpr int kExitOk = 0, kExitInput = 1, kExitUsage = 2, kExitMismatch = 3;
// `kvsim sweep`: outputs written, but some (trace, runs) units failed (listed in the outputs).
constexpr int kExitPartial = 4;
constexpr const char* kPositionalTrace = "trace file (.h5); also as the first argument without --trace";
constexpr const char* kPolicyHelp =
    "policy name (kvsim list-policies), or a merge variant NAME+average, NAME+pivot, NAME+weighted: NAME "
    "with "
    "every evicted token merged into its nearest kept slot (not full, oracle, meda, look_m; "
    "docs/policies/merging.md)";
constexpr const char* kQuietHelp =
    "no progress on stderr (else a bar on a terminal, plain lines otherwise; also KVSIM_PROGRESS=off)";

int Fail(const Status& st) {
  std::fprintf(stderr, "kvsim: error: %s\n", st.message().c_str());
  return kExitInput;
}

struct Usage {
  std::string text;
};

// Parses argv for one subcommand; returns false after printing help or a usage error (exit code set).
// `hidden` options are parsed but not shown in --help (e.g. the positional word of `verify hae`).
bool Parse(int argc, char** argv, const std::string& usage, po::options_description& opts,
           const po::positional_options_description* pos, po::variables_map& vm, int* exit_code,
           const po::options_description* hidden = nullptr) {
  opts.add_options()("help,h", "show this help");
  try {
    po::options_description all;
    all.add(opts);
    if (hidden) all.add(*hidden);
    po::command_line_parser parser(argc, argv);
    parser.options(all);
    if (pos) parser.positional(*pos);
    po::store(parser.run(), vm);
    if (vm.count("help")) {
      std::cout << usage << "\n\n" << opts << "\n";
      *exit_code = kExitOk;
      return false;
    }
    po::notify(vm);
  } catch (const po::validation_error& e) {
    // A value that is not of the option's type ("--budget abc"): bad input (exit 1), like other bad values.
    *exit_code = Fail(Status::InvalidArgument(e.what()));
    return false;
  } catch (const po::error& e) {
    std::fprintf(stderr, "kvsim: usage error: %s\n%s\n(see --help)\n", e.what(), usage.c_str());
    *exit_code = kExitUsage;
    return false;
  }
  // Every command's --threads: 0 = all cores, never negative.
  if (vm.count("threads") && vm["threads"].as<int>() < 0) {
    *exit_code = Fail(Status::InvalidArgument("--threads " + std::to_string(vm["threads"].as<int>()) +
                                              ": must be >= 0 (0 = all cores)"));
    return false;
  }
  return true;
}

// The entry of `others` that names the same file as `out` (after resolving links and "..", for files that do
// not exist yet too), or nullptr.
const std::string* SameFileAs(const std::string& out, std::initializer_list<std::string> others) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path o = fs::weakly_canonical(fs::path(out), ec);
  if (ec) return nullptr;
  for (const std::string& other : others) {
    if (other.empty()) continue;
    std::error_code ec2;
    if (fs::weakly_canonical(fs::path(other), ec2) == o && !ec2) return &other;
  }
  return nullptr;
}

// An output path that names one of the inputs would overwrite it: refused before any work.
Status CheckNotAnInput(const std::string& out, std::initializer_list<std::string> inputs) {
  if (const std::string* in = SameFileAs(out, inputs))
    return Status::InvalidArgument("--out " + out + " is the input " + *in +
                                   "; writing there would overwrite it: choose another --out");
  return Status::Ok();
}

// Output paths, normalised the same way for every command. A file output that ends in '/' or names an
// existing folder gets the command's default file name in that folder ("--out results/" ->
// results/result.json); its folder must exist (checked before any work). A folder output loses trailing
// slashes and "." parts
// ("results//" -> results) and may not be the current folder, its parent or the root.
StatusOr<std::string> NormalizeOutputFile(const std::string& flag, const std::string& path,
                                          const std::string& default_name) {
  namespace fs = std::filesystem;
  if (path.empty()) return Status::InvalidArgument(flag + " is empty; give a file name");
  std::error_code ec;
  fs::path p(path);
  if (path.back() == '/' || fs::is_directory(p, ec)) p /= default_name;
  p = p.lexically_normal();
  const fs::path parent = p.parent_path();
  if (!parent.empty() && !fs::is_directory(parent, ec))
    return Status::InvalidArgument(flag + " " + path + ": folder '" + parent.string() +
                                   (fs::exists(parent, ec) ? "' is not a folder" : "' does not exist") +
                                   "; create it first (mkdir -p " + parent.string() + ") or choose another " +
                                   flag);
  return p.string();
}

// --chrome-trace, normalised like every output file (NormalizeOutputFile); it must not name an input or
// another output of the same command.
Status PrepareChromeTracePath(std::string* path, std::initializer_list<std::string> others) {
  if (path->empty()) return Status::Ok();
  KVSIM_ASSIGN_OR_RETURN(*path, NormalizeOutputFile("--chrome-trace", *path, "trace.json"));
  if (const std::string* o = SameFileAs(*path, others))
    return Status::InvalidArgument("--chrome-trace " + *path + " is also " + *o +
                                   "; writing there would overwrite it: choose another file");
  return Status::Ok();
}

int CmdSynth(int argc, char** argv) {
  std::string config, out, seed_text;
  int threads = 0;
  po::options_description opts("kvsim synth options");
  opts.add_options()("config", po::value(&config)->required(),
                     "SynthConfig text proto (configs/synth/*.textproto)")(
      "out", po::value(&out)->required(), "output trace (.h5); written to a temp file, then renamed")(
      "seed", po::value(&seed_text), "override the config's seed (an integer in [0, 2^64))")(
      "threads", po::value(&threads)->default_value(0), "worker threads (0 = all cores)");
  po::variables_map vm;
  int code;
  if (!Parse(argc, argv, "usage: kvsim synth --config F --out T.h5 [--seed N]", opts, nullptr, vm, &code))
    return code;
  auto out_path = NormalizeOutputFile("--out", out, std::filesystem::path(config).stem().string() + ".h5");
  if (!out_path.ok()) return Fail(out_path.status());
  out = *out_path;
  if (Status st = CheckNotAnInput(out, {config}); !st.ok()) return Fail(st);
  uint64_t seed = 0;
  if (vm.count("seed")) {
    const char* end = seed_text.data() + seed_text.size();
    const auto [ptr, ec] = std::from_chars(seed_text.data(), end, seed);
    if (seed_text.empty() || ec != std::errc() || ptr != end)
      return Fail(Status::InvalidArgument("--seed '" + seed_text + "': must be an integer in [0, 2^64)"));
  }
  auto cfg = LoadSynthConfig(config);
  if (!cfg.ok()) return Fail(cfg.status());
  if (vm.count("seed")) cfg->set_seed(seed);
  Hdf5WriteOptions wo;
  wo.compression_level = cfg->storage().compression_level();
  auto writer = Hdf5TraceWriter::Create(out, wo);
  if (!writer.ok()) return Fail(writer.status());
  Status st = Synthesize(*cfg, writer->get(), threads);
  if (!st.ok()) return Fail(st);
  std::fprintf(stderr, "kvsim: wrote %s\n", out.c_str());
  return kExitOk;
}

int CmdInspect(int argc, char** argv) {
  std::string trace;
  bool json = false;
  int threads = 0;
  po::options_description opts("kvsim inspect options");
  opts.add_options()("trace", po::value(&trace)->required()->value_name("T.h5"), kPositionalTrace)(
      "json", po::bool_switch(&json), "print JSON instead of text")(
      "threads", po::value(&threads)->default_value(0), "worker threads (0 = all cores)");
  po::positional_options_description pos;
  pos.add("trace", 1);
  po::variables_map vm;
  int code;
  if (!Parse(argc, argv, "usage: kvsim inspect [--trace] T.h5 [--json]", opts, &pos, vm, &code)) return code;
  auto src = OpenTrace(trace);
  if (!src.ok()) return Fail(src.status());
  if ((*src)->meta().is_streaming()) {
    std::cout << (json ? StreamSummaryJson((*src)->meta()) : FormatStreamSummary((*src)->meta()));
    return kExitOk;
  }
  auto stats = ComputeTraceStats(**src, threads);
  if (!stats.ok()) return Fail(stats.status());
  std::cout << (json ? TraceStatsToJson((*src)->meta(), *stats) : FormatTraceStats((*src)->meta(), *stats));
  return kExitOk;
}

int CmdValidate(int argc, char** argv) {
  std::string trace;
  double tolerance = 0.05;
  int threads = 0;
  po::options_description opts("kvsim validate options");
  opts.add_options()("trace", po::value(&trace)->required()->value_name("T.h5"), kPositionalTrace)(
      "tolerance", po::value(&tolerance)->default_value(0.05, "0.05")->value_name("X"),
      "max allowed |recorded - recomputed| for attention aggregates")(
      "threads", po::value(&threads)->default_value(0), "worker threads (0 = all cores)");
  po::positional_options_description pos;
  pos.add("trace", 1);
  po::variables_map vm;
  int code;
  if (!Parse(argc, argv, "usage: kvsim validate [--trace] T.h5 [--tolerance X]", opts, &pos, vm, &code))
    return code;
  if (!(tolerance >= 0) || !std::isfinite(tolerance))
    return Fail(Status::InvalidArgument("--tolerance " + std::to_string(tolerance) +
                                        ": must be a finite number >= 0 (e.g. --tolerance 0.05)"));
  auto src = OpenTrace(trace);
  if (!src.ok()) return Fail(src.status());
  auto rep = ValidateTrace(**src, threads);
  if (!rep.ok()) return Fail(rep.status());
  std::cout << trace << ": " << rep->Text((*src)->meta(), tolerance);
  return rep->Mismatch(tolerance) ? kExitMismatch : kExitOk;
}

int CmdListPolicies(int argc, char** argv) {
  po::options_description opts("kvsim list-policies options");
  po::variables_map vm;
  int code;
  if (!Parse(argc, argv, "usage: kvsim list-policies", opts, nullptr, vm, &code)) return code;
  for (const PolicyInfo& p : PolicyRegistry::Default().List()) {
    auto policy = PolicyRegistry::Default().Create(p.name);
    std::cout << p.name << "\n    " << p.summary << "\n    parameters (" << p.params_type
              << "): " << (policy.ok() ? (*policy)->ParamsText() : "") << "\n";
  }
  std::cout << "\nStreaming policies (streaming traces only; budget = retrieved visual tokens, "
               "docs/streaming.md):\n";
  for (const StreamPolicyInfo& p : StreamPolicyRegistry::Default().List()) {
    auto policy = StreamPolicyRegistry::Default().Create(p.name);
    std::cout << p.name << "\n    " << p.summary << "\n    parameters (" << p.params_type
              << "): " << (policy.ok() ? (*policy)->ParamsText() : "") << "\n";
  }
  std::cout
      << "\nMerge wrappers: NAME+average, NAME+pivot, NAME+weighted merge every token NAME evicts into its\n"
         "nearest kept slot (any policy above except full, oracle, meda, look_m; "
         "docs/policies/merging.md).\n";
  return kExitOk;
}

StatusOr<QuestionMode> ParseQuestionMode(const std::string& s) {
  if (s == "aware" || s == "query_aware") return QuestionMode::kQueryAware;
  if (s == "agnostic" || s == "query_agnostic") return QuestionMode::kQueryAgnostic;
  return Status::InvalidArgument("--question-mode '" + s + "': expected 'aware' or 'agnostic'");
}

// `kvsim run --out r.json` also writes its tables next to it: r.runs.csv, r.layers.csv (streaming:
// r.runs.csv, r.questions.csv, r.memory.csv).
std::string OutputStem(const std::string& out) {
  return out.size() > 5 && out.ends_with(".json") ? out.substr(0, out.size() - 5) : out;
}

// `kvsim run` on a streaming trace: --budget-tokens is the retrieved visual-token budget (optional: the
// policy's default), fractions are refused.
int RunStreaming(const std::string& trace, const std::string& policy, const std::vector<std::string>& sets,
                 bool has_fraction, int budget_tokens, const RunOptions& options, const std::string& out,
                 const std::string& chrome_trace) {
  if (Status st = CheckStreamingPolicyName(policy); !st.ok()) return Fail(st.WithContext(trace));
  if (has_fraction)
    return Fail(Status::InvalidArgument(
        trace +
        " is a streaming trace: give --budget-tokens N (retrieved visual tokens per layer and KV head) "
        "or no budget (the policy's default), not --budget"));
  if (budget_tokens < 0)
    return Fail(Status::InvalidArgument("--budget-tokens must be >= 1 (omit it for the policy default)"));
  auto res = RunStreamOne(trace, policy, sets, budget_tokens, options);
  if (!res.ok()) return Fail(res.status());
  const std::vector<StreamRunResult> runs{*res};
  const std::string stem = OutputStem(out);
  std::vector<std::pair<std::string, std::string>> files{{out, ToJson(*res)},
                                                         {stem + ".runs.csv", StreamRunsCsv(runs)},
                                                         {stem + ".questions.csv", StreamQuestionsCsv(runs)},
                                                         {stem + ".memory.csv", StreamMemoryCsv(runs)}};
  if (!chrome_trace.empty()) files.emplace_back(chrome_trace, ToJson(ChromeTraceForStreamRuns(runs)));
  if (Status st = WriteFilesAtomic(files); !st.ok()) return Fail(st);
  const StreamQuestionResult& m = res->mean();
  std::fprintf(
      stderr,
      "kvsim: %s budget %d visual tokens: retained mass %.4f, output rel. error %.4f, evidence frame "
      "recall %.3f, CPU bank %.1f MB -> %s\n",
      res->label().c_str(), res->budget_tokens(), m.retained_mass_mean(), m.output_rel_error_mean(),
      m.evidence_frame_recall(), res->cpu_bank_bytes_final() / (1024.0 * 1024.0), out.c_str());
  return kExitOk;
}

int CmdRun(int argc, char** argv) {
  std::string trace, policy, out, qmode, latency, device, model, chrome_trace;
  double budget = 0;
  int budget_tokens = 0, threads = 0, prefill_chunk = 0;
  bool quiet = false;
  std::vector<std::string> sets;
  po::options_description opts("kvsim run options");
  opts.add_options()("trace", po::value(&trace)->required(), "trace file (.h5)")(
      "policy", po::value(&policy)->required()->value_name("P"), kPolicyHelp)(
      "budget", po::value(&budget), "fraction of the prompt kept per layer per KV head, in (0, 1]")(
      "budget-tokens", po::value(&budget_tokens), "tokens kept per layer per KV head")(
      "set", po::value(&sets)->composing(), "policy parameter override key=value (repeatable)")(
      "question-mode", po::value(&qmode)->default_value("aware"),
      "aware: compress the whole prompt; agnostic: leave the question out of compression")(
      "latency-model", po::value(&latency), "latency model file (default: token steps)")(
      "device", po::value(&device),
      "modelled decode latency on this GPU as the clock: a100-sxm, a100-pcie, h100-sxm, h200 or a profile "
      "file (docs/latency.md)")(
      "model", po::value(&model),
      "model shape for --device: a preset (kvsim latency --list) or a file; default: the trace's model")(
      "prefill-chunk", po::value(&prefill_chunk)->default_value(0),
      "prefill chunk size in tokens (0 = whole prompt)")("threads", po::value(&threads)->default_value(0),
                                                         "worker threads (0 = all cores)")(
      "quiet,q", po::bool_switch(&quiet), kQuietHelp)(
      "out", po::value(&out)->required(),
      "result.json (and its tables next to it: result.runs.csv, result.layers.csv)")(
      "chrome-trace", po::value(&chrome_trace),
      "also write the simulated run as a Chrome trace (Perfetto, chrome://tracing) to this file");
  po::variables_map vm;
  int code;
  const char* usage =
      "usage: kvsim run --trace T.h5 --policy P (--budget R | --budget-tokens N) [--set k=v]... --out "
      "result.json";
  if (!Parse(argc, argv, usage, opts, nullptr, vm, &code)) return code;
  auto out_path = NormalizeOutputFile("--out", out, "result.json");
  if (!out_path.ok()) return Fail(out_path.status());
  out = *out_path;
  if (Status st = CheckNotAnInput(out, {trace}); !st.ok()) return Fail(st);
  if (Status st = PrepareChromeTracePath(&chrome_trace, {trace, out}); !st.ok()) return Fail(st);
  if (vm.count("budget-tokens") && budget_tokens < 1)
    return Fail(Status::InvalidArgument("--budget-tokens must be >= 1"));
  // Streaming traces go to the streaming engine. A missing trace is reported below, after the usage checks;
  // a damaged one now, as itself (not as "not a streaming trace" or a usage error).
  auto streaming = IsStreamingTrace(trace);
  if (!streaming.ok() && streaming.status().code() != StatusCode::kNotFound) return Fail(streaming.status());
  if (streaming.ok() && *streaming)
    return RunStreaming(trace, policy, sets, vm.count("budget") > 0, budget_tokens,
                        RunOptions{threads, !quiet, latency, 0, device, model}, out, chrome_trace);
  if (vm.count("budget") == vm.count("budget-tokens")) {
    std::fprintf(stderr, "kvsim: usage error: give exactly one of --budget or --budget-tokens\n%s\n", usage);
    return kExitUsage;
  }
  if (vm.count("budget") && !(budget > 0 && budget <= 1))
    return Fail(
        Status::InvalidArgument("--budget " + std::to_string(budget) +
                                ": must be a fraction in (0, 1]; use --budget-tokens for token counts"));
  if (vm.count("budget-tokens") && budget_tokens < 1)
    return Fail(Status::InvalidArgument("--budget-tokens must be >= 1"));
  auto mode = ParseQuestionMode(qmode);
  if (!mode.ok()) return Fail(mode.status());
  if (prefill_chunk < 0)
    return Fail(Status::InvalidArgument("--prefill-chunk must be >= 0 (0 = whole prompt)"));
  auto res = RunOne(trace, policy, sets, budget, budget_tokens, *mode,
                    RunOptions{threads, !quiet, latency, prefill_chunk, device, model});
  if (!res.ok()) return Fail(res.status());
  const std::vector<RunResult> runs{*res};
  std::vector<std::pair<std::string, std::string>> files{{out, ToJson(*res)},
                                                         {OutputStem(out) + ".runs.csv", RunsCsv(runs)},
                                                         {OutputStem(out) + ".layers.csv", LayersCsv(runs)}};
  if (!chrome_trace.empty()) files.emplace_back(chrome_trace, ToJson(ChromeTraceForRuns(runs)));
  if (Status st = WriteFilesAtomic(files); !st.ok()) return Fail(st);
  const Metrics& m = res->metrics();
  std::fprintf(stderr,
               "kvsim: %s budget %d tokens: retained mass %.4f, output rel. error %.4f, KV memory %.3f of "
               "full -> %s\n",
               res->label().c_str(), res->budget_tokens(), m.retained_mass_mean(), m.output_rel_error_mean(),
               m.kv_memory_ratio(), out.c_str());
  for (const std::string& w : res->warnings())  // DegenerateRunWarnings, saved in the result too
    std::fprintf(stderr, "kvsim: warning: %s\n", w.c_str());
  if (res->has_latency()) {
    const LatencyMetrics& l = res->latency();
    std::fprintf(stderr,
                 "kvsim: MODELLED on %s (%s): %.3f ms/token (full cache %.3f, speed-up %.3fx), time to first "
                 "token %.2f ms\n",
                 l.device().c_str(), l.model_shape().c_str(), l.ms_per_output_token(),
                 l.full_ms_per_output_token(), l.speedup_vs_full(), l.ttft_ms());
  }
  return kExitOk;
}

// `kvsim verify hae`: the report next to its markdown summary (report.json -> report.md).
int CmdVerify(int argc, char** argv) {
  std::string what, trace, out, preset = "llava";
  bool quiet = false;
  VerifyHaeOptions o;
  po::options_description opts("kvsim verify hae options");
  po::options_description hidden;
  hidden.add_options()("what", po::value(&what)->required(), "what to verify: hae");
  opts.add_options()("trace", po::value(&trace)->required()->value_name("T.h5"),
                     "trace file (.h5); needs every prompt query")(
      "out", po::value(&out)->required(), "report.json (report.md is written next to it)")(
      "preset", po::value(&preset)->default_value("llava"),
      "DAP thresholds and bin from HAE Table 5: llava (r 0.0012, alpha 0.001, d 64), phi-a (0.0005, 0.0005, "
      "128), phi-b (0.0015, 0.0015, 56)")("r", po::value<double>(),
                                          "DAP: A_j <= r * sum (overrides the preset)")(
      "alpha", po::value<double>(), "DAP: max text attention < alpha (overrides the preset)")(
      "rc-size", po::value<int>(), "DDES bin d (overrides the preset)")(
      "dap-layer", po::value(&o.dap_layer)->default_value(0), "layer DAP scores at")(
      "epsilon", po::value(&o.epsilon)->default_value(0.01), "Theorem 2.1's epsilon")(
      "min-r2", po::value(&o.min_r_squared)->default_value(0.5),
      "decay fits with a lower R² make Theorem 2.1 not applicable")(
      "sparsity-epsilon", po::value(&o.sparsity_epsilon)->default_value(1e-4),
      "App. A.1: entries <= this count as sparse")("threads", po::value(&o.threads)->default_value(0),
                                                   "worker threads (0 = all cores)")(
      "quiet,q", po::bool_switch(&quiet), kQuietHelp);
  po::positional_options_description pos;
  pos.add("what", 1);
  po::variables_map vm;
  int code;
  const char* usage =
      "usage: kvsim verify hae --trace T.h5 [--preset llava|phi-a|phi-b] [--epsilon E] --out report.json";
  if (!Parse(argc, argv, usage, opts, &pos, vm, &code, &hidden)) return code;
  if (what != "hae") {
    std::fprintf(stderr, "kvsim: usage error: unknown verification '%s' (available: hae)\n%s\n", what.c_str(),
                 usage);
    return kExitUsage;
  }
  auto out_path = NormalizeOutputFile("--out", out, "report.json");
  if (!out_path.ok()) return Fail(out_path.status());
  out = *out_path;
  if (Status st = CheckNotAnInput(out, {trace}); !st.ok()) return Fail(st);
  if (preset == "llava") {
    o.r = 0.0012, o.alpha = 0.001, o.rc_size = 64;
  } else if (preset == "phi-a") {
    o.r = 0.0005, o.alpha = 0.0005, o.rc_size = 128;
  } else if (preset == "phi-b") {
    o.r = 0.0015, o.alpha = 0.0015, o.rc_size = 56;
  } else {
    return Fail(Status::InvalidArgument("--preset '" + preset + "': expected llava, phi-a or phi-b"));
  }
  if (vm.count("r")) o.r = vm["r"].as<double>();
  if (vm.count("alpha")) o.alpha = vm["alpha"].as<double>();
  if (vm.count("rc-size")) o.rc_size = vm["rc-size"].as<int>();
  auto src = OpenTrace(trace);
  if (!src.ok()) return Fail(src.status());
  auto hash = CachedHashFile(trace);
  if (hash.ok()) o.trace_hash = *hash;
  Progress progress = Progress::FromEnv("verify hae", !quiet);
  o.progress = &progress;
  auto rep = VerifyHae(**src, o);
  if (!rep.ok()) return Fail(rep.status());
  progress.Finish();
  std::string md = out;
  if (md.size() > 5 && md.substr(md.size() - 5) == ".json") md = md.substr(0, md.size() - 5);
  md += ".md";
  const std::string text = HaeVerifyMarkdown(*rep);
  Status st = WriteFileAtomic(out, ToJson(*rep));
  if (st.ok()) st = WriteFileAtomic(md, text);
  if (!st.ok()) return Fail(st);
  std::fprintf(stderr, "kvsim: Theorem 2.1 %s; Corollary 2.1 %lld/%lld flushes hold -> %s, %s\n",
               rep->theorem().verdict().c_str(), static_cast<long long>(rep->corollary().holds()),
               static_cast<long long>(rep->corollary().flushes()), out.c_str(), md.c_str());
  return kExitOk;
}

// The sweep's Chrome trace is written before its folder; when the folder fails, the trace goes too.
Status RemoveOnFailure(const Status& st, const std::string& written) {
  std::error_code ec;
  if (!written.empty()) std::filesystem::remove(written, ec);
  return st;
}

int CmdSweep(int argc, char** argv) {
  std::string config, out, latency, device, model, chrome_trace, manifest;
  std::vector<std::string> traces;
  int threads = 0, prefill_chunk = -1;
  bool quiet = false, resume = false;
  po::options_description opts("kvsim sweep options");
  opts.add_options()("config", po::value(&config)->required(),
                     "Experiment text proto (configs/experiments/)")(
      "trace", po::value(&traces)->composing(),
      "trace file(s) or folder(s) of *.h5 traces replacing the config's traces (repeatable)")(
      "manifest", po::value(&manifest),
      "dataset manifest replacing the config's traces: CSV 'id,path[,tags]' (docs/cli.md \"Manifest\")")(
      "resume", po::bool_switch(&resume),
      "reuse the finished units in DIR/units whose trace and experiment are unchanged (docs/cli.md)")(
      "latency-model", po::value(&latency), "latency model file (overrides the config's)")(
      "device", po::value(&device),
      "modelled decode latency on this GPU as the clock (overrides the config's): a100-sxm, a100-pcie, "
      "h100-sxm, h200 or a profile file (docs/latency.md)")(
      "model", po::value(&model), "model shape for --device (overrides the config's model_shape)")(
      "prefill-chunk", po::value(&prefill_chunk), "prefill chunk size in tokens (overrides the config's)")(
      "threads", po::value(&threads)->default_value(0), "worker threads (0 = all cores)")(
      "quiet,q", po::bool_switch(&quiet), kQuietHelp)(
      "out", po::value(&out)->required(),
      "output folder (results.json, runs.csv, layers.csv, aggregates.csv, summary.md; streaming: runs.csv, "
      "questions.csv, memory.csv, aggregates.csv)")(
      "chrome-trace", po::value(&chrome_trace),
      "also write the simulated runs as a Chrome trace (Perfetto, chrome://tracing) to this file");
  po::variables_map vm;
  int code;
  if (!Parse(argc, argv, "usage: kvsim sweep --config experiment.textproto --out DIR [--trace T.h5]...", opts,
             nullptr, vm, &code))
    return code;
  auto out_dir = NormalizeOutputFolder("--out", out);
  if (!out_dir.ok()) return Fail(out_dir.status());
  out = *out_dir;
  if (Status st = PrepareChromeTracePath(&chrome_trace, {config, out}); !st.ok()) return Fail(st);
  auto input = LoadSweepInput(config, traces, manifest);
  if (!input.ok()) return Fail(input.status());
  config::Experiment* exp = &input->experiment;
  const std::string base = input->base_dir;
  if (vm.count("prefill-chunk") && prefill_chunk < 0)
    return Fail(Status::InvalidArgument("--prefill-chunk must be >= 0 (0 = whole prompt)"));
  auto streaming = ExperimentIsStreaming(*exp, base);
  if (!streaming.ok()) return Fail(streaming.status());
  // Units of work and failed units are the same for both kinds (analysis/dataset.h).
  SweepUnits units{(std::filesystem::path(out) / kUnitsFolder).string(), resume};
  auto report_units = [&](int runs, const char* files,
                          const google::protobuf::RepeatedPtrField<FailedUnit>& failed) {
    std::fprintf(stderr, "kvsim: %d %sruns (%d units computed, %d reused) -> %s/{%s}\n", runs,
                 *streaming ? "streaming " : "", units.computed, units.reused, out.c_str(), files);
    for (const FailedUnit& f : failed)
      std::fprintf(stderr, "kvsim: error: sample '%s' failed, no results for it: %s\n", f.sample_id().c_str(),
                   f.error().c_str());
    return failed.empty() ? kExitOk : kExitPartial;
  };
  if (*streaming) {
    if (Status st = CheckOutputFolder(out, kStreamSweepOutputNames); !st.ok()) return Fail(st);
    auto sres = RunStreamSweep(*exp, base, RunOptions{threads, !quiet, latency, 0, device, model}, &units);
    if (!sres.ok()) return Fail(sres.status().WithContext(config));
    Status st = Status::Ok();
    if (!chrome_trace.empty())
      st = WriteChromeTrace(
          ChromeTraceForStreamRuns(std::vector<StreamRunResult>(sres->runs().begin(), sres->runs().end())),
          chrome_trace);
    const bool trace_written = st.ok() && !chrome_trace.empty();
    if (st.ok()) st = WriteStreamSweepOutputs(*sres, out);
    if (!st.ok()) return Fail(RemoveOnFailure(st, trace_written ? chrome_trace : ""));
    return report_units(sres->runs_size(),
                        "results.json,runs.csv,questions.csv,memory.csv,aggregates.csv,summary.md",
                        sres->failed_units());
  }
  if (Status st = CheckOutputFolder(out, kSweepOutputNames); !st.ok()) return Fail(st);
  auto res = RunSweep(*exp, base, RunOptions{threads, !quiet, latency, prefill_chunk, device, model}, &units);
  if (!res.ok()) return Fail(res.status().WithContext(config));
  Status st = Status::Ok();
  if (!chrome_trace.empty())
    st = WriteChromeTrace(ChromeTraceForRuns(std::vector<RunResult>(res->runs().begin(), res->runs().end())),
                          chrome_trace);
  const bool trace_written = st.ok() && !chrome_trace.empty();
  if (st.ok()) st = WriteSweepOutputs(*res, out, threads);
  if (!st.ok()) return Fail(RemoveOnFailure(st, trace_written ? chrome_trace : ""));
  return report_units(res->runs_size(), "results.json,runs.csv,layers.csv,aggregates.csv,summary.md",
                      res->failed_units());
}

// `kvsim search`: the smallest budget per policy that meets a quality target (analysis/search.h).
int CmdSearch(int argc, char** argv) {
  std::string trace, out, qmode;
  std::vector<std::string> policy_args;
  SearchSpec spec;
  bool quiet = false;
  po::options_description opts("kvsim search options");
  opts.add_options()("trace", po::value(&trace)->required(), kPositionalTrace)(
      "policy", po::value(&policy_args)->composing()->required(),
      "policies, comma-separated and/or repeated; overrides after the name: --policy 'snapkv window=16,h2o'")(
      "metric", po::value(&spec.metric)->default_value("retained_mass"),
      "retained_mass (with --at-least), output_error or regret (with --at-most); docs/metrics.md")(
      "at-least", po::value<double>(), "target: the metric must be >= this (retained_mass), e.g. 0.9")(
      "at-most", po::value<double>(), "target: the metric must be <= this (output_error, regret), e.g. 0.1")(
      "points-per-pass", po::value(&spec.points_per_pass)->default_value(4),
      "budgets evaluated per policy in each replay of the trace")(
      "question-mode", po::value(&qmode)->default_value("aware"), "aware | agnostic (as kvsim run)")(
      "threads", po::value(&spec.threads)->default_value(0), "worker threads (0 = all cores)")(
      "quiet,q", po::bool_switch(&quiet), kQuietHelp)("out", po::value(&out)->required(), "search.json");
  po::positional_options_description pos;
  pos.add("trace", 1);
  po::variables_map vm;
  int code;
  const char* usage =
      "usage: kvsim search [--trace] T.h5 --policy P[,Q...] (--metric retained_mass --at-least X | --metric "
      "output_error|regret --at-most X) --out search.json";
  if (!Parse(argc, argv, usage, opts, &pos, vm, &code)) return code;
  if (vm.count("at-least") == vm.count("at-most")) {
    std::fprintf(stderr, "kvsim: usage error: give exactly one of --at-least or --at-most\n%s\n", usage);
    return kExitUsage;
  }
  spec.at_least = vm.count("at-least") > 0;
  spec.target = spec.at_least ? vm["at-least"].as<double>() : vm["at-most"].as<double>();
  for (const std::string& arg : policy_args) {
    std::string item;
    std::istringstream is(arg);
    while (std::getline(is, item, ',')) spec.policies.push_back(item);
  }
  auto mode = ParseQuestionMode(qmode);
  if (!mode.ok()) return Fail(mode.status());
  spec.question_mode = *mode;
  if (Status st = CheckSearchSpec(spec); !st.ok()) return Fail(st);
  auto out_path = NormalizeOutputFile("--out", out, "search.json");
  if (!out_path.ok()) return Fail(out_path.status());
  if (Status st = CheckNotAnInput(*out_path, {trace}); !st.ok()) return Fail(st);
  auto res = RunSearch(trace, spec, !quiet);
  if (!res.ok()) return Fail(res.status());
  Status st = WriteFileAtomic(*out_path, ToJson(*res));
  if (!st.ok()) return Fail(st);
  for (const PolicySearch& p : res->policies()) {
    if (p.found())
      std::fprintf(stderr,
                   "kvsim: %s: budget %d tokens (%.4g of %d) gives %s %.4g, KV memory %.3f of full%s\n",
                   p.label().c_str(), p.budget_tokens(), p.budget_fraction(), res->compressed_prompt_tokens(),
                   res->metric().c_str(), p.value(), p.kv_memory_ratio(),
                   p.monotone() ? "" : " (metric not monotone in the budget: see non_monotone)");
    else
      std::fprintf(stderr, "kvsim: %s: no budget: %s\n", p.label().c_str(), p.reason().c_str());
  }
  std::fprintf(stderr, "kvsim: %d passes, %d runs -> %s\n", res->passes(), res->runs(), out_path->c_str());
  return kExitOk;
}

// A file-name-safe form of a run label: letters, digits, '-', '.', '+'; everything else becomes '_'.
std::string Slug(const std::string& s) {
  std::string out;
  for (char c : s)
    out += (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '+') ? c : '_';
  return out;
}

// `kvsim gpu-plan --config`: a plan and its replay result for every (policy, budget) of an experiment (the
// policies that ignore the budget, e.g. full, once), named NN_<label>_<budget>.pb / .result.json. Every run
// is checked before any file is written; files are written atomically.
int GpuPlansForExperiment(gpu_replay::PlanRequest base, const std::string& config,
                          const std::string& out_dir) {
  auto exp = LoadExperiment(config);
  if (!exp.ok()) return Fail(exp.status());
  if (exp->budgets().empty() && exp->budget_tokens().empty())
    return Fail(Status::InvalidArgument(config + ": no budgets; set 'budgets' or 'budget_tokens'"));
  base.question_mode = exp->question_mode() == config::QUERY_AGNOSTIC ? QuestionMode::kQueryAgnostic
                                                                      : QuestionMode::kQueryAware;
  std::vector<gpu_replay::PlanRequest> reqs;
  for (const config::PolicySpec& ps : exp->policies()) {
    gpu_replay::PlanRequest r = base;
    r.policy = ps.name();
    r.sets.assign(ps.set().begin(), ps.set().end());
    r.label = ps.has_label() ? ps.label() : RunLabel(ps.name(), r.sets);
    auto policy = PolicyRegistry::Default().Create(r.policy, r.sets);
    if (!policy.ok()) return Fail(policy.status().WithContext(config));
    const PolicyInfo* info = PolicyRegistry::Default().Find(r.policy);
    if (!info->uses_budget) {
      r.budget_fraction = 1.0;
      reqs.push_back(r);
      continue;
    }
    for (double b : exp->budgets()) {
      r.budget_fraction = b, r.budget_tokens = 0;
      reqs.push_back(r);
    }
    for (int b : exp->budget_tokens()) {
      r.budget_fraction = 0, r.budget_tokens = b;
      reqs.push_back(r);
    }
  }
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec)
    return Fail(Status::InvalidArgument("--out-dir " + out_dir + ": cannot create (" + ec.message() + ")"));
  Progress progress = Progress::FromEnv("gpu-plan", base.progress);
  for (size_t i = 0; i < reqs.size(); ++i) {
    progress.SetOuter("plan", static_cast<int>(i) + 1, static_cast<int>(reqs.size()));
    reqs[i].reporter = &progress;
    RunResult result;
    auto plan = gpu_replay::BuildPlan(reqs[i], &result);
    if (!plan.ok()) return Fail(plan.status());
    char budget[32];
    if (reqs[i].budget_tokens > 0)
      std::snprintf(budget, sizeof(budget), "%dtok", reqs[i].budget_tokens);
    else
      std::snprintf(budget, sizeof(budget), "%g", reqs[i].budget_fraction);
    char idx[32];
    std::snprintf(idx, sizeof(idx), "%02zu_", i);
    const std::string stem = out_dir + "/" + idx + Slug(reqs[i].label) + "_" + budget;
    Status st = gpu_replay::WritePlan(*plan, stem + ".pb");
    if (st.ok()) st = WriteFileAtomic(stem + ".result.json", ToJson(result));
    if (!st.ok()) return Fail(st);
  }
  progress.Finish();
  std::fprintf(stderr, "kvsim: %zu plans -> %s/NN_<label>_<budget>.{pb,result.json}\n", reqs.size(),
               out_dir.c_str());
  return kExitOk;
}

// `kvsim gpu-plan`: one policy run's decisions as a GPU replay plan (gpu_replay/plan.proto).
// gpu-plan records plain runs; a streaming trace is refused before any work.
Status CheckPlainTrace(const std::string& trace) {
  if (auto streaming = IsStreamingTrace(trace); streaming.ok() && *streaming)
    return Status::InvalidArgument(
        trace +
        " is a streaming trace; gpu-plan records plain (prefill + decode) runs only "
        "(docs/gpu-replay.md)");
  return Status::Ok();
}

int CmdGpuPlan(int argc, char** argv) {
  gpu_replay::PlanRequest req;
  std::string qmode, out, result_out, config, out_dir;
  bool quiet = false;
  po::options_description opts("kvsim gpu-plan options");
  opts.add_options()("trace", po::value(&req.trace_path)->required(), "trace file (.h5)")(
      "policy", po::value(&req.policy)->required()->value_name("P"), kPolicyHelp)(
      "budget", po::value(&req.budget_fraction),
      "fraction of the prompt kept per layer per KV head, in (0, 1]")(
      "budget-tokens", po::value(&req.budget_tokens), "tokens kept per layer per KV head")(
      "set", po::value(&req.sets)->composing(), "policy parameter override key=value (repeatable)")(
      "question-mode", po::value(&qmode)->default_value("aware"), "aware | agnostic")(
      "threads", po::value(&req.threads)->default_value(0), "worker threads (0 = all cores)")(
      "out", po::value(&out)->required(), "plan file (binary Protobuf; temp file, then rename)")(
      "result", po::value(&result_out), "also write the run's result JSON (as kvsim run --out) here")(
      "config", po::value(&config),
      "experiment text proto: one plan per (policy, budget) of it, instead of --policy/--budget")(
      "out-dir", po::value(&out_dir), "with --config: folder for NN_<label>_<budget>.pb + .result.json")(
      "quiet,q", po::bool_switch(&quiet), kQuietHelp);
  po::variables_map vm;
  int code;
  const char* usage =
      "usage: kvsim gpu-plan --trace T.h5 --policy P (--budget R | --budget-tokens N) [--set k=v]... --out "
      "plan.pb [--result r.json]\n       kvsim gpu-plan --trace T.h5 --config experiment.textproto --out-dir "
      "DIR";
  // --out is required for one plan; the --config form replaces it with --out-dir.
  bool by_config = false;
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--config" || std::string(argv[i]).rfind("--config=", 0) == 0)
      by_config = true;
  if (by_config) {
    po::options_description copts("kvsim gpu-plan --config options");
    copts.add_options()("trace", po::value(&req.trace_path)->required(), "trace file (.h5)")(
        "config", po::value(&config)->required(), "experiment text proto")(
        "out-dir", po::value(&out_dir)->required(), "output folder")(
        "threads", po::value(&req.threads)->default_value(0), "worker threads (0 = all cores)")(
        "quiet,q", po::bool_switch(&quiet), kQuietHelp);
    if (!Parse(argc, argv, usage, copts, nullptr, vm, &code)) return code;
    req.progress = !quiet;
    auto dir = NormalizeOutputFolder("--out-dir", out_dir);
    if (!dir.ok()) return Fail(dir.status());
    out_dir = *dir;
    if (Status st = CheckPlainTrace(req.trace_path); !st.ok()) return Fail(st);
    return GpuPlansForExperiment(req, config, out_dir);
  }
  if (!Parse(argc, argv, usage, opts, nullptr, vm, &code)) return code;
  auto out_path = NormalizeOutputFile("--out", out, "plan.pb");
  if (!out_path.ok()) return Fail(out_path.status());
  out = *out_path;
  if (!result_out.empty()) {
    auto result_path = NormalizeOutputFile("--result", result_out, "result.json");
    if (!result_path.ok()) return Fail(result_path.status());
    result_out = *result_path;
  }
  if (Status st = CheckNotAnInput(out, {req.trace_path}); !st.ok()) return Fail(st);
  if (Status st = CheckNotAnInput(result_out, {req.trace_path}); !st.ok()) return Fail(st);
  if (Status st = CheckPlainTrace(req.trace_path); !st.ok()) return Fail(st);
  if (vm.count("budget") == vm.count("budget-tokens")) {
    std::fprintf(stderr, "kvsim: usage error: give exactly one of --budget or --budget-tokens\n%s\n", usage);
    return kExitUsage;
  }
  if (vm.count("budget") && !(req.budget_fraction > 0 && req.budget_fraction <= 1))
    return Fail(
        Status::InvalidArgument("--budget " + std::to_string(req.budget_fraction) +
                                ": must be a fraction in (0, 1]; use --budget-tokens for token counts"));
  if (vm.count("budget-tokens") && req.budget_tokens < 1)
    return Fail(Status::InvalidArgument("--budget-tokens must be >= 1"));
  auto mode = ParseQuestionMode(qmode);
  if (!mode.ok()) return Fail(mode.status());
  req.question_mode = *mode;
  req.progress = !quiet;
  RunResult result;
  auto plan = gpu_replay::BuildPlan(req, &result);
  if (!plan.ok()) return Fail(plan.status());
  Status st = gpu_replay::WritePlan(*plan, out);
  if (st.ok() && !result_out.empty()) st = WriteFileAtomic(result_out, ToJson(result));
  if (!st.ok()) return Fail(st);
  std::fprintf(stderr, "kvsim: %s: %s -> %s\n", plan->label().c_str(), gpu_replay::PlanSummary(*plan).c_str(),
               out.c_str());
  return kExitOk;
}

// `kvsim hash T.h5`: the content hash that results and plans record as trace_hash.
int CmdHash(int argc, char** argv) {
  if (argc != 2 || std::string(argv[1]).rfind("-", 0) == 0) {
    std::fprintf(stderr, "kvsim: usage error: usage: kvsim hash T.h5\n");
    return kExitUsage;
  }
  auto hash = HashFileAndRemember(argv[1], HashCacheFromEnv());  // always read: the explicit check
  if (!hash.ok()) return Fail(hash.status());
  std::printf("%s\n", hash->c_str());
  return kExitOk;
}

// `kvsim latency`: the device performance model's numbers for one shape (docs/latency.md).
int CmdLatency(int argc, char** argv) {
  LatencyQuery q;
  bool json = false, list = false;
  po::options_description opts("kvsim latency options");
  opts.add_options()("device", po::value(&q.device),
                     "a100-sxm, a100-pcie, h100-sxm, h200, or a device profile file")(
      "model", po::value(&q.model), "model preset (llama-2-7b, llava-1.5-7b, qwen2-7b, ...) or shape file")(
      "heads", po::value(&q.heads), "query heads (instead of --model)")("kv-heads", po::value(&q.kv_heads),
                                                                        "KV heads (instead of --model)")(
      "head-dim", po::value(&q.head_dim), "head dimension (instead of --model)")(
      "kv-length", po::value(&q.kv_length), "KV cache length per head, tokens")(
      "batch", po::value(&q.batch)->default_value(1), "requests decoded together")(
      "prompt-tokens", po::value(&q.prompt_tokens)->default_value(0),
      "also model the prefill of a prompt of this many tokens (time to first token; needs --model)")(
      "hbm-gbps", po::value(&q.hbm_gbps)->default_value(0),
      "override the profile's peak HBM bandwidth, GB/s (e.g. a power-limited card)")(
      "json", po::bool_switch(&json), "print the JSON object instead of text")(
      "list", po::bool_switch(&list), "list the built-in devices and model presets");
  po::variables_map vm;
  int code;
  const char* usage =
      "usage: kvsim latency --device NAME (--model PRESET | --heads H --kv-heads K --head-dim D) "
      "--kv-length L [--batch N] [--prompt-tokens P] [--json]";
  if (!Parse(argc, argv, usage, opts, nullptr, vm, &code)) return code;
  if (list) {
    std::cout << "devices (configs/devices/):";
    for (const std::string& d : DeviceNames()) std::cout << " " << d;
    std::cout << "\nmodel presets (configs/models/):";
    for (const std::string& m : ModelPresetNames()) std::cout << " " << m;
    std::cout << "\n";
    return kExitOk;
  }
  if (q.device.empty() || !vm.count("kv-length")) {
    std::fprintf(stderr, "kvsim: usage error: --device and --kv-length are required\n%s\n", usage);
    return kExitUsage;
  }
  auto r = ComputeLatencyReport(q);
  if (!r.ok()) return Fail(r.status());
  std::cout << (json ? ToJson(*r) : LatencyReportText(*r));
  return kExitOk;
}

// `kvsim plot RESULTS_DIR`: runs python/kvsim/plot.py (matplotlib) in the project's Python environment; the
// interpreter is the configure-time KVSIM_DEFAULT_PYTHON unless env KVSIM_PYTHON names another.
int CmdPlot(int argc, char** argv) {
  const char* usage =
      "usage: kvsim plot RESULTS_DIR [--format png,svg]\n\n"
      "Draws the results of kvsim sweep (plain or streaming) or of kvsim run (a folder holding its "
      "*.runs.csv)\n"
      "into RESULTS_DIR/plots/*.png and *.svg, and embeds them in RESULTS_DIR/summary.md (docs/cli.md).\n"
      "Runs python -m kvsim.plot with the project's Python (env KVSIM_PYTHON overrides it).";
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h") {
      std::cout << usage << "\n";
      return kExitOk;
    }
  if (argc < 2) {
    std::fprintf(stderr, "kvsim: usage error: %s\n", usage);
    return kExitUsage;
  }
  const char* env = std::getenv("KVSIM_PYTHON");
  const std::string python = env && *env ? env : KVSIM_DEFAULT_PYTHON;
  if (::access(python.c_str(), X_OK) != 0)
    return Fail(Status::InvalidArgument("kvsim plot needs the project's Python with matplotlib, and " +
                                        python + " is not an executable" +
                                        (env && *env ? " (from KVSIM_PYTHON)" : "") +
                                        "; run ./run setup (or make setup) to create .venv, or set "
                                        "KVSIM_PYTHON to a Python with matplotlib"));
  const char* old_path = std::getenv("PYTHONPATH");
  const std::string path =
      std::string(KVSIM_PYTHON_DIR) + (old_path && *old_path ? ":" + std::string(old_path) : "");
  ::setenv("PYTHONPATH", path.c_str(), 1);
  std::vector<std::string> args{python, "-m", "kvsim.plot"};
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  std::vector<char*> cargs;
  for (std::string& a : args) cargs.push_back(a.data());
  cargs.push_back(nullptr);
  std::fflush(nullptr);
  ::execv(python.c_str(), cargs.data());
  return Fail(Status::InvalidArgument("kvsim plot: cannot run " + python + ": " + std::strerror(errno) +
                                      "; set KVSIM_PYTHON to a Python with matplotlib"));
}

const char kTopUsage[] =
    "kvsim "
    "— replay recorded LLM attention traces against KV-cache compression policies\n\n"
    "usage: kvsim <command> [options]   (kvsim <command> --help for details)\n\n"
    "commands:\n"
    "  synth          generate a synthetic trace from a config\n"
    "  inspect        print a trace's measured attention statistics\n"
    "  validate       check a trace's structure and recorded aggregates\n"
    "  list-policies  list registered policies and their parameters\n"
    "  run            replay one policy at one budget\n"
    "  sweep          replay traces x policies x budgets, write results and a summary\n"
    "  search         the smallest budget per policy that meets a quality target\n"
    "  verify hae     measure HAE's Theorem 2.1 / Corollary 2.1 and sparsity on a trace\n"
    "  gpu-plan       write one policy run's decisions as a GPU replay plan (docs/gpu-replay.md)\n"
    "  hash           print a trace's content hash (the trace_hash of results and plans)\n"
    "  latency        modelled decode / prefill latency of a shape on a GPU (docs/latency.md)\n"
    "  plot           draw a results folder's plots (RESULTS_DIR/plots/*.png, *.svg; matplotlib)\n"
    "  version        print version, git commit and the BLAS kernels in use\n";

}  // namespace
}  // namespace kvsim

int main(int argc, char** argv) {
  using namespace kvsim;
  RestartForBlasKernels(argv);  // OpenBLAS's fast kernels on a CPU it does not know (sim/blas.h)
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h" ||
      std::string(argv[1]) == "help") {
    std::cout << kTopUsage;
    return argc < 2 ? kExitUsage : kExitOk;
  }
  // kvsim reports errors itself, in one line; keep protobuf's own log lines off stderr.
  google::protobuf::SetLogHandler(nullptr);
  const std::string cmd = argv[1];
  if (cmd == "version" || cmd == "--version") {
    std::cout << "kvsim " << kVersion << " (" << kGitCommit << ")\n"
              << "BLAS: OpenBLAS, " << BlasCoreName() << " kernels\n";
    return kExitOk;
  }
  if (!ProgressIntervalFromEnv()) {
    std::fprintf(stderr,
                 "kvsim: error: environment variable KVSIM_PROGRESS_INTERVAL='%s': expected seconds >= 0\n",
                 std::getenv("KVSIM_PROGRESS_INTERVAL"));
    return kExitInput;
  }
  if (!ProgressStyleFromEnv()) {
    std::fprintf(stderr,
                 "kvsim: error: environment variable KVSIM_PROGRESS='%s': expected auto, bar, lines or off\n",
                 std::getenv("KVSIM_PROGRESS"));
    return kExitInput;
  }
  // The A/B switches of the merging policies' similarity search (same results either way): 0 or 1, and for
  // the screen also which one (policies/merge_screen.h).
  for (const char* name : {"KVSIM_MERGE_SCREEN", "KVSIM_MERGE_MEMO", "KVSIM_MERGE_INT8"}) {
    const char* v = std::getenv(name);
    const bool screen = std::string(name) == "KVSIM_MERGE_SCREEN";
    if (v && *v && std::string(v) != "0" && std::string(v) != "1" &&
        !(screen && (std::string(v) == "bf16" || std::string(v) == "int16"))) {
      std::fprintf(stderr, "kvsim: error: environment variable %s='%s': expected 0 (off) or 1 (on)%s\n", name,
                   v, screen ? ", or bf16 / int16 (that screen)" : "");
      return kExitInput;
    }
  }
  // Subcommand parsers see argv without the command name.
  int sub_argc = argc - 1;
  char** sub_argv = argv + 1;
  try {
    if (cmd == "synth") return CmdSynth(sub_argc, sub_argv);
    if (cmd == "inspect") return CmdInspect(sub_argc, sub_argv);
    if (cmd == "validate") return CmdValidate(sub_argc, sub_argv);
    if (cmd == "list-policies") return CmdListPolicies(sub_argc, sub_argv);
    if (cmd == "run") return CmdRun(sub_argc, sub_argv);
    if (cmd == "sweep") return CmdSweep(sub_argc, sub_argv);
    if (cmd == "search") return CmdSearch(sub_argc, sub_argv);
    if (cmd == "verify") return CmdVerify(sub_argc, sub_argv);
    if (cmd == "gpu-plan") return CmdGpuPlan(sub_argc, sub_argv);
    if (cmd == "hash") return CmdHash(sub_argc, sub_argv);
    if (cmd == "latency") return CmdLatency(sub_argc, sub_argv);
    if (cmd == "plot") return CmdPlot(sub_argc, sub_argv);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "kvsim: error: out of memory in 'kvsim %s'; use fewer --threads, a smaller trace or budget "
                 "set, or a machine with more memory\n",
                 cmd.c_str());
    return kExitInput;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvsim: error: %s\n", e.what());
    return kExitInput;
  }
  std::fprintf(stderr, "kvsim: unknown command '%s'\n\n%s", cmd.c_str(), kTopUsage);
  return kExitUsage;
}
