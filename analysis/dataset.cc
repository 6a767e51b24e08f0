#include "analysis/dataset.h"

#include <cstdio>
#include <map>
#include <span>
#include <tuple>

#include "sim/stats.h"
#include "sim/text_proto.h"
#include "sim/version.h"

namespace kvsim {

std::string TraceGroup(const ModelInfo& m) {
  return m.name + " L=" + std::to_string(m.num_layers) + " H=" + std::to_string(m.num_heads) +
         " KV=" + std::to_string(m.num_kv_heads) + " D=" + std::to_string(m.head_dim);
}

StatusOr<GroupSpec> ParseGroupSpec(const std::string& text) {
  const char* form =
      "; write a model name, then optionally L=layers H=heads KV=kv_heads D=head_dim (e.g. "
      "'llava-1.5-7b L=32 H=32 KV=32 D=128')";
  std::istringstream is(text);
  GroupSpec g;
  std::string item;
  if (!(is >> g.model) || g.model.find('=') != std::string::npos)
    return Status::InvalidArgument("group '" + text + "' does not start with a model name" + form);
  std::set<std::string> seen;
  while (is >> item) {
    const size_t eq = item.find('=');
    const std::string key = eq == std::string::npos ? item : item.substr(0, eq);
    int* field = key == "L"    ? &g.layers
                 : key == "H"  ? &g.heads
                 : key == "KV" ? &g.kv_heads
                 : key == "D"  ? &g.head_dim
                               : nullptr;
    if (!field || eq == std::string::npos)
      return Status::InvalidArgument("group '" + text + "': '" + item + "' is not L=, H=, KV= or D=" + form);
    if (!seen.insert(key).second)
      return Status::InvalidArgument("group '" + text + "' gives " + key + "= twice" + form);
    const std::string v = item.substr(eq + 1);
    if (v.empty() || v.size() > 9 || v.find_first_not_of("0123456789") != std::string::npos ||
        std::stoi(v) < 1)
      return Status::InvalidArgument("group '" + text + "': " + key + "='" + v +
                                     "' is not a positive integer" + form);
    *field = std::stoi(v);
  }
  return g;
}

Status CheckSampleGroup(const config::Sample& sample, const ModelInfo& m) {
  if (sample.group().empty()) return Status::Ok();
  const std::string where = sample.origin().empty() ? "sample '" + sample.id() + "'" : sample.origin();
  auto spec = ParseGroupSpec(sample.group());
  if (!spec.ok()) return Status::InvalidArgument(where + ": " + spec.status().message());
  std::string differs;
  if (spec->model != m.name) differs = "model '" + m.name + "', not '" + spec->model + "'";
  const std::tuple<const char*, int, int> shape[] = {{"L", spec->layers, m.num_layers},
                                                     {"H", spec->heads, m.num_heads},
                                                     {"KV", spec->kv_heads, m.num_kv_heads},
                                                     {"D", spec->head_dim, m.head_dim}};
  for (const auto& [key, declared, actual] : shape)
    if (declared >= 0 && declared != actual)
      differs += (differs.empty() ? "" : ", ") + std::string(key) + "=" + std::to_string(actual) + ", not " +
                 std::to_string(declared);
  if (differs.empty()) return Status::Ok();
  return Status::InvalidArgument(
      where + ": field 'group': trace " + sample.path() + " is " + differs + " (its group is '" +
      TraceGroup(m) + "'); fix the sample's group or its path, or move the sample to its own dataset");
}

StatusOr<std::string> UnitDefinitionHash(const config::Experiment& experiment, const LatencySpec& clock,
                                         int prefill_chunk) {
  config::Experiment definition = experiment;
  definition.clear_traces();
  definition.clear_samples();
  std::string text = ToTextWithDefaults(definition) + "\nclock " + clock.file + "|" + clock.device + "|" +
                     clock.model + "\nchunk " + std::to_string(prefill_chunk) + "\nversion " + kVersion +
                     " " + kGitCommit;
  if (!clock.file.empty()) {
    KVSIM_ASSIGN_OR_RETURN(std::string h, HashFile(clock.file));
    text += "\nclock_hash " + h;
  }
  // 64-bit FNV-1a, as 16 hex digits (names unit files; not a content hash of trace data).
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) h = (h ^ c) * 0x100000001b3ull;
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return std::string(buf);
}

std::vector<Aggregate> AggregateRows(const std::vector<AggregateRow>& rows,
                                     const std::vector<std::string>& metrics, uint64_t seed, int resamples) {
  std::vector<std::vector<const AggregateRow*>> cells;
  std::map<std::tuple<std::string, std::string, std::string, double, int>, size_t> index;
  for (const AggregateRow& r : rows) {
    // A fractional budget is one cell whatever each sample's prompt length makes of it in tokens.
    auto key = std::make_tuple(r.group, r.policy, r.label, r.budget_fraction,
                               r.budget_fraction > 0 ? 0 : r.budget_tokens);
    auto [it, fresh] = index.emplace(key, cells.size());
    if (fresh) cells.emplace_back();
    cells[it->second].push_back(&r);
  }
  std::vector<Aggregate> out;
  for (const auto& c : cells) {
    const AggregateRow& first = *c[0];
    for (size_t k = 0; k < metrics.size(); ++k) {
      std::vector<double> v;
      for (const AggregateRow* r : c)
        if (k < r->values.size() && !std::isnan(r->values[k])) v.push_back(r->values[k]);
      if (v.empty()) continue;
      const std::span<const double> sv(v);
      const Interval ci = BootstrapMeanCi(sv, resamples, seed);
      Aggregate a;
      a.set_group(first.group);
      a.set_policy(first.policy);
      a.set_label(first.label);
      a.set_budget_fraction(first.budget_fraction);
      a.set_budget_tokens(first.budget_tokens);
      a.set_metric(metrics[k]);
      a.set_n(static_cast<int>(v.size()));
      a.set_mean(Mean(sv));
      a.set_sd(StdDev(sv));
      a.set_ci95_low(ci.low);
      a.set_ci95_high(ci.high);
      a.set_resamples(resamples);
      out.push_back(std::move(a));
    }
  }
  return out;
}

std::string DatasetMarkdown(const std::vector<Aggregate>& aggregates,
                            const google::protobuf::RepeatedPtrField<FailedUnit>& failed, int samples,
                            const std::vector<AggregateColumn>& columns) {
  std::ostringstream os;
  if (!failed.empty()) {
    os << "\n## Failed units\n\nThese samples have no results (their trace could not be replayed); the "
          "aggregates leave them out.\n\n| sample | trace | reason |\n|---|---|---|\n";
    for (const FailedUnit& f : failed)
      os << "| " << f.sample_id() << " | `" << f.trace_path() << "` | " << f.error() << " |\n";
  }
  if (samples < 2) return os.str();
  os << "\n## Across samples\n\nMean over the samples of each group (model and shape; groups are never "
        "mixed) ± standard deviation, with a percentile-bootstrap 95% interval of the mean in brackets ("
     << (aggregates.empty() ? 0 : aggregates[0].resamples())
     << " seeded resamples; docs/metrics.md). Computed from the per-sample results above; see "
        "aggregates.csv.\n";
  auto same_cell = [](const Aggregate& a, const Aggregate& b) {
    return a.group() == b.group() && a.policy() == b.policy() && a.label() == b.label() &&
           a.budget_fraction() == b.budget_fraction() && a.budget_tokens() == b.budget_tokens();
  };
  std::string group;
  for (size_t i = 0; i < aggregates.size();) {
    size_t end = i + 1;
    while (end < aggregates.size() && same_cell(aggregates[i], aggregates[end])) ++end;
    const Aggregate& a = aggregates[i];
    if (a.group() != group) {
      group = a.group();
      os << "\n### Group `" << group << "`\n\n| policy | budget | n";
      for (const AggregateColumn& c : columns) os << " | " << c.header;
      os << " |\n|---|---:|---:";
      for (size_t k = 0; k < columns.size(); ++k) os << "|---";
      os << "|\n";
    }
    const std::string budget = a.policy() == "full" || (a.budget_fraction() == 0 && a.budget_tokens() == 0)
                                   ? std::string("-")
                               : a.budget_fraction() > 0 ? FormatNumber(100 * a.budget_fraction(), 3) + "%"
                                                         : std::to_string(a.budget_tokens()) + " tok";
    int n = 0;
    for (size_t k = i; k < end; ++k) n = std::max(n, aggregates[k].n());
    os << "| " << a.label() << " | " << budget << " | " << n;
    for (const AggregateColumn& c : columns) {
      const Aggregate* m = nullptr;
      for (size_t k = i; k < end; ++k)
        if (aggregates[k].metric() == c.metric) m = &aggregates[k];
      if (!m) {
        os << " | n/a";
        continue;
      }
      os << " | " << FormatNumber(c.scale * m->mean(), 3) << " ± " << FormatNumber(c.scale * m->sd(), 2)
         << " [" << FormatNumber(c.scale * m->ci95_low(), 3) << ", "
         << FormatNumber(c.scale * m->ci95_high(), 3) << "]";
      if (m->n() != n) os << " (n=" << m->n() << ")";
    }
    os << " |\n";
    i = end;
  }
  return os.str();
}

}  // namespace kvsim
