#include "analysis/report.h"

#include <google/protobuf/util/json_util.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string_view>

#include "sim/parallel.h"

namespace kvsim {

std::string ToJson(const google::protobuf::Message& msg) {
  google::protobuf::util::JsonPrintOptions opt;
  opt.add_whitespace = true;
  opt.preserve_proto_field_names = true;
  opt.always_print_primitive_fields = true;
  std::string out;
  auto st = google::protobuf::util::MessageToJsonString(msg, &out, opt);
  KVSIM_CHECK_MSG(st.ok(), std::string(st.message()));
  return out;
}

SplitJson::SplitJson(const google::protobuf::Message& msg, const std::string& field)
    : msg_(msg), field_(msg.GetDescriptor()->FindFieldByName(field)), name_(field) {
  KVSIM_CHECK_MSG(field_ && field_->is_repeated() &&
                      field_->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE,
                  "SplitJson: '" + field + "' is not a repeated message field of " + msg.GetTypeName());
  text_.resize(1 + msg.GetReflection()->FieldSize(msg, field_));
}

void SplitJson::Print(int part) {
  if (part > 0) {
    text_[part] = ToJson(msg_.GetReflection()->GetRepeatedMessage(msg_, field_, part - 1));
    return;
  }
  // The message without the field: a copy, cleared (the elements' JSON is most of the bytes; copying the
  // message is a small part of printing it).
  std::unique_ptr<google::protobuf::Message> rest(msg_.New());
  rest->CopyFrom(msg_);
  rest->GetReflection()->ClearField(rest.get(), field_);
  text_[0] = ToJson(*rest);
}

std::string SplitJson::Join() const {
  if (text_.size() == 1) return text_[0];
  // The printer writes the empty field as `"name": []` at depth 1 (one space) and each element at depth 2;
  // an element printed alone is at depth 0 and ends with a newline. JSON strings escape newlines, so every
  // newline in an element's text is the printer's.
  const std::string empty = "\n \"" + name_ + "\": []";
  const size_t at = text_[0].find(empty);
  KVSIM_CHECK_MSG(at != std::string::npos, "SplitJson: no empty '" + name_ + "' at depth 1");
  size_t bytes = text_[0].size();
  for (size_t i = 1; i < text_.size(); ++i) bytes += text_[i].size() * 2;
  std::string out;
  out.reserve(bytes);
  out.append(text_[0], 0, at + empty.size() - 1);  // up to and with the '['
  out += '\n';
  for (size_t i = 1; i < text_.size(); ++i) {
    std::string_view e = text_[i];
    if (!e.empty() && e.back() == '\n') e.remove_suffix(1);
    if (i > 1) out += ",\n";
    out += "  ";
    for (size_t p = 0;;) {
      const size_t nl = e.find('\n', p);
      if (nl == std::string_view::npos) {
        out.append(e.substr(p));
        break;
      }
      out.append(e.substr(p, nl + 1 - p));
      out += "  ";
      p = nl + 1;
    }
  }
  out += "\n ]";
  out.append(text_[0], at + empty.size(), std::string::npos);
  return out;
}

std::string ToJsonSplit(const google::protobuf::Message& msg, const std::string& field, int threads) {
  SplitJson json(msg, field);
  ParallelFor(json.parts(), threads, [&](int i) { json.Print(i); });
  return json.Join();
}

std::string FormatNumber(double v, int prec) {
  std::ostringstream os;
  os << std::setprecision(prec) << v;
  return os.str();
}

std::string CsvNumber(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), v);  // shortest form that reads back exactly
  return std::string(buf, res.ptr);
}

std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

namespace {

std::string Num(double v, int prec = 6) { return FormatNumber(v, prec); }

void MetricColumns(const Metrics& m, std::ostringstream& os) {
  const double v[] = {m.retained_mass_mean(),
                      m.retained_mass_p5(),
                      m.covered_mass_mean(),
                      m.output_rel_error_mean(),
                      m.output_rel_error_p95(),
                      m.regret_vs_oracle_mean(),
                      m.regret_vs_oracle_p95(),
                      m.bound_checks(),
                      m.bound_violations(),
                      m.kv_bytes_peak(),
                      m.kv_bytes_mean(),
                      m.kv_footprint(),
                      m.full_kv_bytes_peak(),
                      m.full_kv_bytes_mean(),
                      m.kv_memory_ratio(),
                      m.kept_tokens_mean(),
                      m.kept_tokens_by_modality().text(),
                      m.kept_tokens_by_modality().image(),
                      m.kept_tokens_by_modality().video(),
                      m.retained_mass_by_modality().text(),
                      m.retained_mass_by_modality().image(),
                      m.retained_mass_by_modality().video(),
                      m.full_mass_by_modality().text(),
                      m.full_mass_by_modality().image(),
                      m.full_mass_by_modality().video(),
                      m.samples(),
                      m.prompt_kept_tokens_mean(),
                      m.prompt_kept_over_budget(),
                      m.merged_tokens_mean(),
                      m.merged_slots_mean(),
                      m.merge_members_max(),
                      m.merged_anchor_mass_mean(),
                      m.merged_weight_over_mass_mean()};
  for (double x : v) os << ',' << CsvNumber(x);
}

}  // namespace

namespace {

// The metric columns shared by runs.csv and layers.csv (names, then values in the same order).
constexpr const char* kMetricHeader =
    "retained_mass_mean,retained_mass_p5,covered_mass_mean,output_rel_error_mean,output_rel_error_p95,"
    "regret_vs_oracle_mean,regret_vs_oracle_p95,bound_checks,bound_violations,kv_bytes_peak,kv_bytes_mean,"
    "kv_footprint,full_kv_bytes_peak,full_kv_bytes_mean,kv_memory_ratio,kept_tokens_mean,kept_text,"
    "kept_image,kept_video,retained_mass_text,retained_mass_image,retained_mass_video,full_mass_text,"
    "full_mass_image,full_mass_video,samples,prompt_kept_tokens_mean,prompt_kept_over_budget,"
    "merged_tokens_mean,merged_slots_mean,merge_members_max,merged_anchor_mass_mean,"
    "merged_weight_over_mass_mean";

// The columns that identify a run in both tables (run = its index in results.json's runs).
constexpr const char* kRunKeyHeader = "run,trace_hash,policy,label,budget_fraction,budget_tokens";

void RunKey(int index, const RunResult& r, std::ostringstream& os) {
  os << index << ',' << r.trace_hash() << ',' << CsvField(r.policy()) << ',' << CsvField(r.label()) << ','
     << CsvNumber(r.budget_fraction()) << ',' << r.budget_tokens();
}

}  // namespace

std::string RunsCsv(const std::vector<RunResult>& runs) {
  std::ostringstream os;
  os << kRunKeyHeader
     << ",trace,trace_source,model,trace_seed,parameters,question_mode,compressed_prompt_tokens,"
        "allocated_budget_tokens_mean,prefill_chunks,time_unit,kvsim_version,git_commit,"
     << kMetricHeader
     << ",latency_device,latency_model_shape,ms_per_output_token,ttft_ms,full_ms_per_output_token,"
        "full_ttft_ms,speedup_vs_full,attention_ms_per_token,policy_work_ms,floor_fraction,"
        "ragged_attention_ratio,head_length_max_over_mean,decode_ms_total,warnings,sample_id,tags,group\n";
  for (size_t i = 0; i < runs.size(); ++i) {
    const RunResult& r = runs[i];
    RunKey(static_cast<int>(i), r, os);
    os << ',' << CsvField(r.trace_path()) << ',' << CsvField(r.trace_source()) << ','
       << CsvField(r.trace_model()) << ',' << r.trace_seed() << ',' << CsvField(r.parameters()) << ','
       << r.question_mode() << ',' << r.compressed_prompt_tokens() << ','
       << CsvNumber(r.allocated_budget_tokens_mean()) << ',' << r.prefill_chunks() << ',' << r.time_unit()
       << ',' << CsvField(r.kvsim_version()) << ',' << CsvField(r.git_commit());
    MetricColumns(r.metrics(), os);
    if (r.has_latency()) {  // modelled (docs/latency.md); empty without --device
      const LatencyMetrics& l = r.latency();
      os << ',' << CsvField(l.device()) << ',' << CsvField(l.model_shape());
      for (double x :
           {l.ms_per_output_token(), l.ttft_ms(), l.full_ms_per_output_token(), l.full_ttft_ms(),
            l.speedup_vs_full(), l.attention_ms_per_token(), l.policy_work_ms(), l.floor_fraction(),
            l.ragged_attention_ratio(), l.head_length_max_over_mean(), l.decode_ms_total()})
        os << ',' << CsvNumber(x);
    } else {
      os << std::string(13, ',');
    }
    std::string warnings;  // DegenerateRunWarnings (analysis/sweep.h), joined
    for (const std::string& w : r.warnings()) warnings += (warnings.empty() ? "" : "; ") + w;
    std::string tags;
    for (const std::string& t : r.sample_tags()) tags += (tags.empty() ? "" : ";") + t;
    os << ',' << CsvField(warnings) << ',' << CsvField(r.sample_id()) << ',' << CsvField(tags) << ','
       << CsvField(r.group()) << '\n';
  }
  return os.str();
}

std::string LayersCsv(const std::vector<RunResult>& runs) {
  std::ostringstream os;
  os << kRunKeyHeader
     << ",layer,layer_budget_tokens,kv_head_budget_min,kv_head_budget_max,kv_head_tokens_peak_max,"
     << kMetricHeader << '\n';
  for (size_t i = 0; i < runs.size(); ++i) {
    for (const LayerResult& l : runs[i].layers()) {
      RunKey(static_cast<int>(i), runs[i], os);
      const auto [bmin, bmax] = std::minmax_element(l.kv_head_budgets().begin(), l.kv_head_budgets().end());
      const auto peak = std::max_element(l.kv_head_tokens_peak().begin(), l.kv_head_tokens_peak().end());
      const bool heads = bmin != l.kv_head_budgets().end();
      os << ',' << l.layer() << ',' << CsvNumber(l.budget_tokens_mean()) << ','
         << (heads ? std::to_string(*bmin) : "") << ',' << (heads ? std::to_string(*bmax) : "") << ','
         << (peak != l.kv_head_tokens_peak().end() ? CsvNumber(*peak) : "");
      MetricColumns(l.metrics(), os);
      os << '\n';
    }
  }
  return os.str();
}

std::string AggregatesCsv(const std::vector<Aggregate>& aggregates) {
  std::ostringstream os;
  os << "group,policy,label,budget_fraction,budget_tokens,metric,n,mean,sd,ci95_low,ci95_high,resamples\n";
  for (const Aggregate& a : aggregates)
    os << CsvField(a.group()) << ',' << CsvField(a.policy()) << ',' << CsvField(a.label()) << ','
       << CsvNumber(a.budget_fraction()) << ',' << a.budget_tokens() << ',' << a.metric() << ',' << a.n()
       << ',' << CsvNumber(a.mean()) << ',' << CsvNumber(a.sd()) << ',' << CsvNumber(a.ci95_low()) << ','
       << CsvNumber(a.ci95_high()) << ',' << a.resamples() << '\n';
  return os.str();
}

std::string SummaryMarkdown(const std::vector<RunResult>& runs, const std::string& title) {
  std::ostringstream os;
  os << "# " << title << "\n\n";
  // Group by trace (in first-seen order).
  std::vector<std::string> traces;
  for (const auto& r : runs)
    if (std::find(traces.begin(), traces.end(), r.trace_path()) == traces.end())
      traces.push_back(r.trace_path());
  for (const std::string& t : traces) {
    const RunResult* first = nullptr;
    for (const auto& r : runs)
      if (r.trace_path() == t) {
        first = &r;
        break;
      }
    os << "## Trace `" << t << "`\n\n"
       << (first->trace_source() == "captured"
               ? "**Real model run**: captured from the model by kvsim_capture; the numbers are measured on "
                 "its attention.\n\n"
               : std::string("**Synthetic trace**") +
                     (first->trace_source() == "synthetic"
                          ? ""
                          : " (source '" + first->trace_source() + "', not a capture)") +
                     ": generated by kvsim synth, not a real model; the numbers show mechanics, not how a "
                     "model behaves.\n\n")
       << "model " << first->trace_model() << ", hash " << first->trace_hash() << ", seed "
       << first->trace_seed() << ", question mode " << first->question_mode() << ", compressible prompt "
       << first->compressed_prompt_tokens() << " tokens, time unit " << first->time_unit() << ".\n\n"
       << "| policy | budget | prompt kept / budget | kept/head | KV mem vs full | retained mass | merged "
          "anchors | covered | merged/head | out err mean | out err p95 | regret vs oracle | bound viol. |\n"
       << "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    std::vector<const RunResult*> rows;
    for (const auto& r : runs)
      if (r.trace_path() == t) rows.push_back(&r);
    std::stable_sort(rows.begin(), rows.end(), [](const RunResult* a, const RunResult* b) {
      return a->budget_tokens() != b->budget_tokens()
                 ? a->budget_tokens() < b->budget_tokens()
                 : a->metrics().retained_mass_mean() > b->metrics().retained_mass_mean();
    });
    for (const RunResult* r : rows) {
      const Metrics& m = r->metrics();
      std::ostringstream budget;
      if (r->policy() == "full")
        budget << "-";
      else if (r->budget_fraction() > 0)
        budget << Num(100 * r->budget_fraction(), 3) << "% (" << r->budget_tokens() << ")";
      else
        budget << r->budget_tokens() << " tok";
      os << "| " << r->label() << " | " << budget.str() << " | " << std::fixed << std::setprecision(2)
         << m.prompt_kept_over_budget() << " | " << std::setprecision(1) << m.kept_tokens_mean() << " | "
         << std::setprecision(3) << m.kv_memory_ratio() << " | " << m.retained_mass_mean() << " | "
         << m.merged_anchor_mass_mean() << " | " << m.covered_mass_mean() << " | " << std::setprecision(1)
         << m.merged_tokens_mean() << " | " << std::setprecision(3) << m.output_rel_error_mean() << " | "
         << m.output_rel_error_p95() << " | " << m.regret_vs_oracle_mean() << " | " << std::defaultfloat
         << m.bound_violations() << " |\n";
    }
    // Best causal policy per budget (the oracle is an upper bound, not a contender; neither is a variant
    // that kept more prompt tokens than the budget).
    std::map<int, const RunResult*> best;
    bool over_budget = false;
    for (const RunResult* r : rows) {
      if (r->policy() == "oracle" || r->policy() == "full") continue;
      if (r->metrics().prompt_kept_over_budget() > 1 + 1e-9) {
        over_budget = true;
        continue;
      }
      auto& b = best[r->budget_tokens()];
      if (!b || r->metrics().output_rel_error_mean() < b->metrics().output_rel_error_mean()) b = r;
    }
    bool warned = false;  // DegenerateRunWarnings (analysis/sweep.h), one line per run that has any
    for (const RunResult* r : rows) {
      if (r->warnings().empty()) continue;
      if (!warned) os << "\n**Warnings** (runs that say little about their policy):\n\n";
      warned = true;
      os << "- " << r->label() << " at " << r->budget_tokens() << " tokens:";
      for (int k = 0; k < r->warnings_size(); ++k) os << (k ? "; " : " ") << r->warnings(k);
      os << "\n";
    }
    if (first->has_latency()) {
      const LatencyMetrics& l0 = first->latency();
      // Policies that compress at a decode step (MEDA's official code): their compression work is in that
      // step, so in ms/token, not in the time to first token.
      std::vector<std::string> at_decode;
      std::vector<int> steps;  // the decode steps they compress at
      for (const RunResult* r : rows)
        if (r->compression_step() >= 0) {
          if (std::find(at_decode.begin(), at_decode.end(), r->label()) == at_decode.end())
            at_decode.push_back(r->label());
          if (std::find(steps.begin(), steps.end(), r->compression_step()) == steps.end())
            steps.push_back(r->compression_step());
        }
      os << "\n**Decode latency — MODELLED, not measured**: " << l0.source()
         << ". Time to first token includes the policy's compression work at prefill";
      for (size_t i = 0; i < at_decode.size(); ++i)
        os << (i == 0 ? "; " : i + 1 == at_decode.size() ? " and " : ", ") << at_decode[i];
      if (!at_decode.empty())
        os << (at_decode.size() == 1 ? " compresses" : " compress")
           << (steps.size() == 1 ? " at decode step " + std::to_string(steps[0])
                                 : std::string(" at a decode step"))
           << " instead: that work is in the step, so in ms/token (policy work ms counts it either way)";
      os << ".\n\n"
         << "| policy | budget | ms/token | speed-up vs full | TTFT ms | attention ms/token | policy work ms "
            "| "
            "of physical floor | ragged attention x | head max/mean |\n"
         << "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
      for (const RunResult* r : rows) {
        const LatencyMetrics& l = r->latency();
        os << "| " << r->label() << " | "
           << (r->policy() == "full" ? std::string("-") : std::to_string(r->budget_tokens()) + " tok")
           << " | " << std::fixed << std::setprecision(3) << l.ms_per_output_token() << " | "
           << l.speedup_vs_full() << " | " << std::setprecision(2) << l.ttft_ms() << " | "
           << std::setprecision(3) << l.attention_ms_per_token() << " | " << l.policy_work_ms() << " | "
           << std::setprecision(2) << l.floor_fraction() << " | " << l.ragged_attention_ratio() << " | "
           << l.head_length_max_over_mean() << " |\n"
           << std::defaultfloat;
      }
    }
    if (!best.empty()) {
      os << "\nLowest output error per budget (causal policies):";
      for (const auto& [b, r] : best)
        os << " " << b << " tokens: **" << r->label() << "** (" << std::setprecision(3)
           << r->metrics().output_rel_error_mean() << ");" << std::defaultfloat;
      if (over_budget) os << " (runs that kept more prompt tokens than their budget are not ranked)";
      os << "\n";
    }
    os << "\n";
  }
  os << "Columns: *prompt kept / budget* = compressible-prompt slots per KV head right after compression "
        "over "
        "the requested budget (> 1: the variant treats the budget as a floor); *kept/head* = cache slots per "
        "KV "
        "head averaged over decode steps; *merged/head* = tokens merged into kept slots per KV head; "
        "*KV mem vs full* = "
        "time-weighted KV bytes relative to the full cache; *retained mass* = full-attention mass on tokens "
        "kept as themselves in plain (unmerged) slots (mean over decode steps, layers, heads); *merged "
        "anchors* = the mass of merged slots' anchors, whose key and value the merge replaced (not retained, "
        "not lost); *covered* = retained + merged anchors + merged-in members; *out err* = ‖ô − o‖/‖o‖ of "
        "the attention output; *regret* = the best mass any set of the cache's size could keep minus "
        "retained mass. The *oracle* row holds B + (n − ce) slots at every decode step, like every "
        "decode-evicting policy, while a prefill-compressing policy (snapkv, pyramidkv, meda, look_m, ...) "
        "holds B + (n − ce) + t + 1 at step t (compare *kept/head*); `oracle` with `decode_growth=true` "
        "holds the latter. Definitions: docs/metrics.md.\n";
  return os.str();
}

Status WriteFileAtomic(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out)
      return Status::InvalidArgument(path + ": cannot write (check that the folder exists and is writable)");
    out << content;
    out.flush();
    if (!out) {
      std::error_code ec;
      std::filesystem::remove(tmp, ec);
      return Status::DataLoss(path + ": write failed (disk full?)");
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    const std::string why = ec.message();  // before the cleanup reuses ec
    std::filesystem::remove(tmp, ec);
    return Status::InvalidArgument(path + ": cannot move the finished file into place: " + why);
  }
  return Status::Ok();
}

Status WriteFilesAtomic(const std::vector<std::pair<std::string, std::string>>& files) {
  for (size_t i = 0; i < files.size(); ++i) {
    Status st = WriteFileAtomic(files[i].first, files[i].second);
    if (!st.ok()) {
      std::error_code ec;
      for (size_t j = 0; j < i; ++j) std::filesystem::remove(files[j].first, ec);
      return st;
    }
  }
  return Status::Ok();
}

StatusOr<std::string> NormalizeOutputFolder(const std::string& flag, const std::string& path) {
  namespace fs = std::filesystem;
  std::string p = fs::path(path).lexically_normal().string();
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  if (p.empty() || p == "." || p == ".." || p == "/" || p.ends_with("/.."))
    return Status::InvalidArgument(flag + " '" + path +
                                   "': give a new folder's name (it is replaced as a whole), e.g. " + flag +
                                   " results");
  return p;
}

Status CheckOutputFolder(const std::string& out_dir, const std::vector<std::string>& names) {
  namespace fs = std::filesystem;
  const fs::path final_dir(out_dir);
  std::error_code ec;
  if (fs::exists(final_dir, ec)) {
    if (!fs::is_directory(final_dir, ec))
      return Status::InvalidArgument(out_dir + ": exists and is not a folder; choose another --out");
    for (const auto& entry : fs::directory_iterator(final_dir, ec)) {
      const std::string name = entry.path().filename().string();
      // `kvsim plot` output of the earlier results (stale, replaced too), a sweep's units, and the combined
      // table that kvsim wrote before runs.csv / layers.csv.
      bool ours = name == kPlotsFolder || name == kUnitsFolder || name == "results.csv";
      for (const auto& f : names) ours |= name == f;
      if (!ours)
        return Status::InvalidArgument(out_dir + ": folder holds '" + name +
                                       "', which is not a kvsim sweep output; choose an empty or new --out");
    }
  }
  return Status::Ok();
}

Status WriteOutputFolder(const std::string& out_dir_arg,
                         const std::vector<std::pair<std::string, std::string>>& files) {
  namespace fs = std::filesystem;
  // "results/" and "results" name the same folder (the temporary sibling is "results.tmp.PID").
  std::string out_dir = out_dir_arg;
  while (out_dir.size() > 1 && out_dir.back() == '/') out_dir.pop_back();
  const fs::path final_dir(out_dir);
  std::error_code ec;
  std::vector<std::string> names;
  for (const auto& f : files) names.push_back(f.first);
  KVSIM_RETURN_IF_ERROR(CheckOutputFolder(out_dir, names));
  const fs::path tmp = fs::path(out_dir + ".tmp." + std::to_string(::getpid()));
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) return Status::InvalidArgument(out_dir + ": cannot create the output folder: " + ec.message());
  Status st = Status::Ok();
  for (const auto& [name, content] : files) {
    st = WriteFileAtomic((tmp / name).string(), content);
    if (!st.ok()) break;
  }
  // A sweep's finished units stay with its outputs (moved, not copied: same file system).
  if (st.ok() && fs::is_directory(final_dir / kUnitsFolder, ec)) {
    fs::rename(final_dir / kUnitsFolder, tmp / kUnitsFolder, ec);
    if (ec) st = Status::InvalidArgument(out_dir + ": cannot keep its units folder: " + ec.message());
  }
  if (st.ok()) {
    fs::remove_all(final_dir, ec);
    fs::rename(tmp, final_dir, ec);
    if (ec) st = Status::InvalidArgument(out_dir + ": cannot move results into place: " + ec.message());
  }
  if (!st.ok()) fs::remove_all(tmp, ec);
  return st;
}

}  // namespace kvsim
