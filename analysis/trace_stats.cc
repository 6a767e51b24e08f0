#include "analysis/trace_stats.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <tuple>

#include "analysis/report.h"
#include "sim/attention.h"
#include "sim/parallel.h"
#include "sim/stats.h"

namespace kvsim {
namespace {

enum KeyClass : uint8_t { kTextKey = 0, kVisualKey = 1, kOtherKey = 2 };

KeyClass ClassOf(Modality m) {
  switch (m) {
    case Modality::kText:
      return kTextKey;
    case Modality::kImage:
    case Modality::kVideo:
      return kVisualKey;
    case Modality::kOther:
      break;
  }
  return kOtherKey;
}

int TopCount(double fraction, int count) {
  return std::clamp(static_cast<int>(std::ceil(fraction * count - 1e-9)), 1, count);
}

// Sum of the `k` largest values of buf (reordered).
double TopSum(std::vector<float>* buf, int k) {
  std::nth_element(buf->begin(), buf->begin() + (k - 1), buf->end(), std::greater<float>());
  double s = 0;
  for (int i = 0; i < k; ++i) s += (*buf)[i];
  return s;
}

// Sums over the decode rows of one (layer, query head).
struct HeadAccum {
  double entropy = 0, normalized_entropy = 0, top_mass = 0, sink_mass = 0, recent_mass = 0, text_share = 0;
  double k90 = 0, k90_fraction = 0, value_output_ratio = 0;
  int64_t rows = 0, normalized_rows = 0, ratio_rows = 0;
  double text_conc = 0, visual_conc = 0;
  int64_t text_conc_rows = 0, visual_conc_rows = 0;
  int64_t sparse[3] = {0, 0, 0}, entries[3] = {0, 0, 0};  // by KeyClass
};

// Fewest entries of `row` (any order; reordered) whose sum reaches `share` of the total.
int KeysForMass(std::vector<float>* row, double share) {
  std::sort(row->begin(), row->end(), std::greater<float>());
  double total = 0;
  for (float p : *row) total += p;
  double run = 0;
  for (size_t i = 0; i < row->size(); ++i) {
    run += (*row)[i];
    if (run >= share * total) return static_cast<int>(i) + 1;
  }
  return static_cast<int>(row->size());
}

// value_norms: ‖v_j‖ of the head's KV group for every token.
void AccumulateHead(const DecodeReference& ref, const std::vector<KeyClass>& cls,
                    const std::vector<double>& value_norms, const TraceStatsOptions& opt, HeadAccum* acc) {
  std::vector<float> all, by_class[2];
  for (int t = 0; t < ref.num_steps; ++t) {
    const float* row = ref.row(t);
    const int first = ref.first[t], last = ref.last(t);
    const int visible = last - first + 1;
    all.clear();
    by_class[0].clear();
    by_class[1].clear();
    double entropy = 0, mass[3] = {0, 0, 0};
    for (int j = first; j <= last; ++j) {
      const float p = row[j];
      if (p > 0) entropy -= p * std::log(static_cast<double>(p));
      all.push_back(p);
      const KeyClass c = cls[j];
      mass[c] += p;
      ++acc->entries[c];
      acc->sparse[c] += p <= opt.sparsity_epsilon;
      if (c != kOtherKey) by_class[c].push_back(p);
    }
    ++acc->rows;
    acc->entropy += entropy;
    if (visible > 1) {
      acc->normalized_entropy += entropy / std::log(static_cast<double>(visible));
      ++acc->normalized_rows;
    }
    acc->top_mass += TopSum(&all, TopCount(opt.top_fraction, visible));
    const int k90 = KeysForMass(&all, 0.9);
    acc->k90 += k90;
    acc->k90_fraction += static_cast<double>(k90) / visible;
    double vnorm = 0, onorm = 0;
    for (int j = first; j <= last; ++j) vnorm += value_norms[j];
    for (int k = 0; k < ref.head_dim; ++k) onorm += static_cast<double>(ref.out(t)[k]) * ref.out(t)[k];
    if (onorm > 0) {
      acc->value_output_ratio += (vnorm / visible) / std::sqrt(onorm);
      ++acc->ratio_rows;
    }
    for (int j = first; j <= std::min(last, opt.sink_tokens - 1); ++j) acc->sink_mass += row[j];
    for (int j = std::max(first, last - opt.recent_tokens + 1); j <= last; ++j) acc->recent_mass += row[j];
    const double total = mass[0] + mass[1] + mass[2];
    if (total > 0) acc->text_share += mass[kTextKey] / total;
    for (int c = 0; c < 2; ++c) {
      if (by_class[c].empty() || !(mass[c] > 0)) continue;
      const double share =
          TopSum(&by_class[c], TopCount(opt.top_fraction, static_cast<int>(by_class[c].size()))) / mass[c];
      (c == kTextKey ? acc->text_conc : acc->visual_conc) += share;
      ++(c == kTextKey ? acc->text_conc_rows : acc->visual_conc_rows);
    }
  }
}

double Ratio(double num, double den) { return den > 0 ? num / den : 0.0; }

double Cosine(const float* a, const float* b, int d) {
  double ab = 0, aa = 0, bb = 0;
  for (int k = 0; k < d; ++k) {
    ab += static_cast<double>(a[k]) * b[k];
    aa += static_cast<double>(a[k]) * a[k];
    bb += static_cast<double>(b[k]) * b[k];
  }
  return aa > 0 && bb > 0 ? ab / std::sqrt(aa * bb) : 0.0;
}

using PairList = std::vector<std::pair<int, int>>;

// Horizontally adjacent patches (evenly thinned to at most max_pairs) and random distinct pairs of patches
// of the same image/frame (at most max_pairs, fewer when the segments have fewer distinct pairs).
void PatchPairs(const TokenTable& tk, const TraceStatsOptions& opt, PairList* adjacent, PairList* random) {
  std::map<std::tuple<int32_t, int32_t, int32_t>, int> where;  // (segment, row, col) -> token
  std::map<int32_t, std::vector<int>> segments;
  for (int j = 0; j < tk.size(); ++j) {
    if (ClassOf(tk.modality[j]) != kVisualKey || tk.patch_row[j] < 0 || tk.patch_col[j] < 0) continue;
    where[{tk.segment_id[j], tk.patch_row[j], tk.patch_col[j]}] = j;
    segments[tk.segment_id[j]].push_back(j);
  }
  PairList all;
  for (const auto& [key, j] : where) {
    const auto it = where.find({std::get<0>(key), std::get<1>(key), std::get<2>(key) + 1});
    if (it != where.end()) all.emplace_back(j, it->second);
  }
  const size_t cap = static_cast<size_t>(std::max(0, opt.max_cosine_pairs));
  adjacent->clear();
  for (size_t i = 0; i < std::min(cap, all.size()); ++i)
    adjacent->push_back(all[i * all.size() / std::min(cap, all.size())]);

  std::vector<const std::vector<int>*> eligible;
  int64_t distinct = 0;
  for (const auto& [seg, toks] : segments)
    if (toks.size() >= 2) {
      eligible.push_back(&toks);
      distinct += static_cast<int64_t>(toks.size()) * (toks.size() - 1) / 2;
    }
  random->clear();
  if (eligible.empty()) return;
  // Tokens are drawn uniformly over all patches of eligible segments, the partner uniformly in the segment.
  std::vector<int64_t> cumulative;
  int64_t total = 0;
  for (const auto* toks : eligible) cumulative.push_back(total += toks->size());
  std::mt19937_64 rng(opt.cosine_seed);
  const int64_t want = std::min<int64_t>(static_cast<int64_t>(cap), distinct);
  for (int64_t i = 0; i < want; ++i) {
    const int64_t u = static_cast<int64_t>(rng() % static_cast<uint64_t>(total));
    const size_t s = std::upper_bound(cumulative.begin(), cumulative.end(), u) - cumulative.begin();
    const std::vector<int>& toks = *eligible[s];
    const size_t a = rng() % toks.size();
    size_t b = rng() % (toks.size() - 1);
    if (b >= a) ++b;
    random->emplace_back(toks[a], toks[b]);
  }
}

Status CheckOptions(const TraceStatsOptions& o) {
  if (!(o.top_fraction > 0 && o.top_fraction <= 1))
    return Status::InvalidArgument("top_fraction must be in (0, 1]");
  if (o.sink_tokens < 0) return Status::InvalidArgument("sink_tokens must be >= 0");
  if (o.recent_tokens < 1) return Status::InvalidArgument("recent_tokens must be >= 1");
  if (!(o.sparsity_epsilon >= 0)) return Status::InvalidArgument("sparsity_epsilon must be >= 0");
  if (o.max_cosine_pairs < 0) return Status::InvalidArgument("max_cosine_pairs must be >= 0");
  return Status::Ok();
}

}  // namespace

StatusOr<TraceStats> ComputeTraceStats(TraceSource& src, int threads, const TraceStatsOptions& options) {
  KVSIM_RETURN_IF_ERROR(CheckOptions(options).WithContext("trace stats"));
  const TraceMeta& meta = src.meta();
  KVSIM_RETURN_IF_ERROR(meta.Validate().WithContext(src.Describe()));
  if (meta.num_decode_steps < 1)
    return Status::FailedPrecondition(
        src.Describe() + ": trace has no decode steps; statistics are measured on decode attention");
  const ModelInfo& m = meta.model;
  const int n = meta.prefill_length, steps = meta.num_decode_steps, d = m.head_dim,
            t_all = meta.total_tokens();
  const int heads = m.num_heads, kv_heads = m.num_kv_heads, group = m.GroupSize();
  const size_t tq = meta.query_positions.size();
  std::vector<int> decode_query(steps);
  for (int t = 0; t < steps; ++t) decode_query[t] = meta.QueryIndex(n + t);
  std::vector<KeyClass> cls(t_all);
  for (int j = 0; j < t_all; ++j) cls[j] = ClassOf(meta.tokens.modality[j]);
  PairList adjacent, random;
  PatchPairs(meta.tokens, options, &adjacent, &random);

  TraceStats stats;
  stats.options = options;
  stats.num_adjacent_pairs = static_cast<int64_t>(adjacent.size());
  stats.num_random_pairs = static_cast<int64_t>(random.size());
  double adjacent_sum = 0, random_sum = 0;
  LayerData ld;
  for (int l = 0; l < m.num_layers; ++l) {
    KVSIM_RETURN_IF_ERROR(src.ReadLayer(l, &ld));
    KVSIM_RETURN_IF_ERROR(ValidateLayer(meta, ld, src.Describe()));
    std::vector<HeadAccum> acc(heads);
    std::vector<std::vector<double>> value_norms(kv_heads, std::vector<double>(t_all));
    ParallelFor(kv_heads, threads, [&](int g) {
      for (int j = 0; j < t_all; ++j) {
        const float* v = ld.values.data() + (static_cast<size_t>(g) * t_all + j) * d;
        double s = 0;
        for (int k = 0; k < d; ++k) s += static_cast<double>(v[k]) * v[k];
        value_norms[g][j] = std::sqrt(s);
      }
    });
    ParallelFor(heads, threads, [&](int h) {
      const int g = h / group;
      std::vector<float> q(static_cast<size_t>(steps) * d);
      for (int t = 0; t < steps; ++t)
        std::copy_n(ld.queries.data() + (static_cast<size_t>(h) * tq + decode_query[t]) * d, d,
                    q.data() + static_cast<size_t>(t) * d);
      const size_t kv = static_cast<size_t>(g) * t_all * d;
      DecodeReference ref;
      ComputeDecodeReference(m, n, steps, q.data(), ld.keys.data() + kv, ld.values.data() + kv, &ref);
      AccumulateHead(ref, cls, value_norms[g], options, &acc[h]);
    });
    std::vector<double> cos_adjacent(kv_heads, 0.0), cos_random(kv_heads, 0.0);
    ParallelFor(kv_heads, threads, [&](int g) {
      const float* keys = ld.keys.data() + static_cast<size_t>(g) * t_all * d;
      for (const auto& [a, b] : adjacent)
        cos_adjacent[g] += Cosine(keys + static_cast<size_t>(a) * d, keys + static_cast<size_t>(b) * d, d);
      for (const auto& [a, b] : random)
        cos_random[g] += Cosine(keys + static_cast<size_t>(a) * d, keys + static_cast<size_t>(b) * d, d);
    });
    for (int g = 0; g < kv_heads; ++g) {
      adjacent_sum += cos_adjacent[g];
      random_sum += cos_random[g];
    }

    HeadAccum sum;
    LayerStats ls;
    ls.layer = l;
    ls.head_text_share.resize(heads);
    for (int h = 0; h < heads; ++h) {
      const HeadAccum& a = acc[h];
      ls.head_text_share[h] = Ratio(a.text_share, static_cast<double>(a.rows));
      sum.entropy += a.entropy;
      sum.normalized_entropy += a.normalized_entropy;
      sum.top_mass += a.top_mass;
      sum.sink_mass += a.sink_mass;
      sum.recent_mass += a.recent_mass;
      sum.k90 += a.k90;
      sum.k90_fraction += a.k90_fraction;
      sum.value_output_ratio += a.value_output_ratio;
      sum.ratio_rows += a.ratio_rows;
      sum.rows += a.rows;
      sum.normalized_rows += a.normalized_rows;
      sum.text_conc += a.text_conc;
      sum.visual_conc += a.visual_conc;
      sum.text_conc_rows += a.text_conc_rows;
      sum.visual_conc_rows += a.visual_conc_rows;
      for (int c = 0; c < 3; ++c) {
        sum.sparse[c] += a.sparse[c];
        sum.entries[c] += a.entries[c];
      }
    }
    const double rows = static_cast<double>(sum.rows);
    ls.entropy = Ratio(sum.entropy, rows);
    ls.normalized_entropy = Ratio(sum.normalized_entropy, static_cast<double>(sum.normalized_rows));
    ls.top_mass = Ratio(sum.top_mass, rows);
    ls.sink_mass = Ratio(sum.sink_mass, rows);
    ls.recent_mass = Ratio(sum.recent_mass, rows);
    ls.k90 = Ratio(sum.k90, rows);
    ls.k90_fraction = Ratio(sum.k90_fraction, rows);
    ls.value_output_ratio = Ratio(sum.value_output_ratio, static_cast<double>(sum.ratio_rows));
    ls.sparsity = Ratio(static_cast<double>(sum.sparse[0] + sum.sparse[1] + sum.sparse[2]),
                        static_cast<double>(sum.entries[0] + sum.entries[1] + sum.entries[2]));
    ls.text_sparsity =
        Ratio(static_cast<double>(sum.sparse[kTextKey]), static_cast<double>(sum.entries[kTextKey]));
    ls.visual_sparsity =
        Ratio(static_cast<double>(sum.sparse[kVisualKey]), static_cast<double>(sum.entries[kVisualKey]));
    ls.text_concentration = Ratio(sum.text_conc, static_cast<double>(sum.text_conc_rows));
    ls.visual_concentration = Ratio(sum.visual_conc, static_cast<double>(sum.visual_conc_rows));
    stats.layers.push_back(std::move(ls));
  }
  const double per = static_cast<double>(m.num_layers) * kv_heads;
  stats.adjacent_patch_key_cosine = Ratio(adjacent_sum, per * adjacent.size());
  stats.random_patch_key_cosine = Ratio(random_sum, per * random.size());
  return stats;
}

namespace {

struct TokenCounts {
  int64_t modality[kNumModalities] = {};
  int64_t role[kNumRoles] = {};
};

TokenCounts CountTokens(const TokenTable& tk) {
  TokenCounts c;
  for (int j = 0; j < tk.size(); ++j) {
    ++c.modality[static_cast<int>(tk.modality[j])];
    ++c.role[static_cast<int>(tk.role[j])];
  }
  return c;
}

// Distinct visual segments (images / frames) and their grid shapes.
std::map<int32_t, std::pair<int, int>> VisualSegments(const TokenTable& tk) {
  std::map<int32_t, std::pair<int, int>> segs;
  for (int j = 0; j < tk.size(); ++j) {
    if (ClassOf(tk.modality[j]) != kVisualKey) continue;
    auto& [rows, cols] = segs[tk.segment_id[j]];
    rows = std::max(rows, tk.patch_row[j] + 1);
    cols = std::max(cols, tk.patch_col[j] + 1);
  }
  return segs;
}

struct ShareSummary {
  int text_preferring = 0, visual_preferring = 0, mixed = 0;
  std::vector<double> sorted;
};

ShareSummary SummarizeShares(const std::vector<double>& shares) {
  ShareSummary s;
  for (double v : shares) {
    if (v > 0.6)
      ++s.text_preferring;
    else if (v < 0.4)
      ++s.visual_preferring;
    else
      ++s.mixed;
  }
  s.sorted = shares;
  std::sort(s.sorted.begin(), s.sorted.end());
  return s;
}

}  // namespace

std::string FormatTraceStats(const TraceMeta& meta, const TraceStats& stats) {
  const ModelInfo& m = meta.model;
  const TokenTable& tk = meta.tokens;
  std::ostringstream out;
  out << "model: " << m.name << " (" << m.family << "), " << m.num_layers << " layers, " << m.num_heads
      << " query heads / " << m.num_kv_heads << " KV heads, head_dim " << m.head_dim << ", rope_theta "
      << m.rope_theta << "\n";
  out << "sequence: " << meta.prefill_length << " prompt tokens + " << meta.num_decode_steps
      << " decode steps; " << meta.query_positions.size() << " stored queries; storage "
      << StorageDtypeName(meta.storage_dtype) << "; prefill column sums "
      << (meta.has_prefill_column_sums ? "yes" : "no");
  for (size_t r = 0; r < meta.prompt_entropy_regions.size(); ++r)
    out << (r ? ", " : "; prompt entropies for compress_end ") << meta.prompt_entropy_regions[r];
  out << "\n";
  out << "source: " << meta.source;
  if (!meta.generator.empty()) out << " (" << meta.generator << " " << meta.generator_version << ")";
  out << ", seed " << meta.seed << "\n";
  const TokenCounts counts = CountTokens(tk);
  out << "tokens by modality:";
  for (int i = 0; i < kNumModalities; ++i)
    out << " " << ModalityName(static_cast<Modality>(i)) << " " << counts.modality[i];
  out << "\ntokens by role:";
  for (int i = 0; i < kNumRoles; ++i) out << " " << RoleName(static_cast<Role>(i)) << " " << counts.role[i];
  const auto segs = VisualSegments(tk);
  std::set<std::pair<int, int>> shapes;
  for (const auto& [id, shape] : segs) shapes.insert(shape);
  out << "\nvisual segments (images / frames): " << segs.size();
  for (const auto& [rows, cols] : shapes) out << " " << rows << "x" << cols;
  const TraceStatsOptions& o = stats.options;
  out << "\n\ndecode attention per layer (mean over decode steps and heads; top/conc = top "
      << 100 * o.top_fraction << "% of keys; sink = first " << o.sink_tokens << " tokens; recent = last "
      << o.recent_tokens << " keys; sparse = share of entries <= " << o.sparsity_epsilon << "):\n";
  out << "layer  entropy  H/logN   top    sink  recent  sparse sp_txt sp_vis conc_txt conc_vis txt_share "
         "#txt>0.6 #vis<0.4\n";
  std::vector<double> all_shares;
  for (const LayerStats& ls : stats.layers) {
    const ShareSummary s = SummarizeShares(ls.head_text_share);
    double mean_share = 0;
    for (double v : ls.head_text_share) mean_share += v;
    mean_share = Ratio(mean_share, static_cast<double>(ls.head_text_share.size()));
    all_shares.insert(all_shares.end(), ls.head_text_share.begin(), ls.head_text_share.end());
    char line[256];
    std::snprintf(line, sizeof line,
                  "%5d %8.3f %7.3f %6.3f %6.3f %6.3f %7.3f %6.3f %6.3f %8.3f %8.3f %9.3f %8d %8d\n", ls.layer,
                  ls.entropy, ls.normalized_entropy, ls.top_mass, ls.sink_mass, ls.recent_mass, ls.sparsity,
                  ls.text_sparsity, ls.visual_sparsity, ls.text_concentration, ls.visual_concentration,
                  mean_share, s.text_preferring, s.visual_preferring);
    out << line;
  }
  out << "\nmass concentration and value scale per layer (mean over decode steps and heads; k90 = fewest "
         "keys "
         "holding 90% of the mass; v/o = mean value norm over visible keys / attention-output norm):\n"
         "layer    sink     k90  k90/N     v/o\n";
  double mean[4] = {0, 0, 0, 0};
  for (const LayerStats& ls : stats.layers) {
    char line[128];
    std::snprintf(line, sizeof line, "%5d %7.3f %7.1f %6.3f %7.2f\n", ls.layer, ls.sink_mass, ls.k90,
                  ls.k90_fraction, ls.value_output_ratio);
    out << line;
    mean[0] += ls.sink_mass, mean[1] += ls.k90, mean[2] += ls.k90_fraction, mean[3] += ls.value_output_ratio;
  }
  if (!stats.layers.empty()) {
    const double L = static_cast<double>(stats.layers.size());
    char line[128];
    std::snprintf(line, sizeof line, " mean %7.3f %7.1f %6.3f %7.2f\n", mean[0] / L, mean[1] / L, mean[2] / L,
                  mean[3] / L);
    out << line;
  }
  const ShareSummary s = SummarizeShares(all_shares);
  char quantiles[128];
  std::snprintf(quantiles, sizeof quantiles, "%.3f %.3f %.3f %.3f %.3f", SortedQuantile(s.sorted, 0),
                SortedQuantile(s.sorted, 0.25), SortedQuantile(s.sorted, 0.5), SortedQuantile(s.sorted, 0.75),
                SortedQuantile(s.sorted, 1));
  out << "\nhead text share (mass on text keys / total) over " << all_shares.size()
      << " (layer, head) pairs: " << s.text_preferring << " text-preferring (>0.6), " << s.visual_preferring
      << " visual-preferring (<0.4), " << s.mixed << " mixed; min/p25/median/p75/max " << quantiles << "\n";
  if (stats.num_adjacent_pairs > 0 || stats.num_random_pairs > 0) {
    char line[256];
    std::snprintf(
        line, sizeof line,
        "patch key cosine: horizontally adjacent %.3f (%lld pairs), random same-image %.3f (%lld pairs), "
        "per layer and KV head\n",
        stats.adjacent_patch_key_cosine, static_cast<long long>(stats.num_adjacent_pairs),
        stats.random_patch_key_cosine, static_cast<long long>(stats.num_random_pairs));
    out << line;
  }
  return out.str();
}

InspectReport TraceStatsReport(const TraceMeta& meta, const TraceStats& stats) {
  InspectReport r;
  const ModelInfo& m = meta.model;
  InspectModel* im = r.mutable_model();
  im->set_name(m.name);
  im->set_family(m.family);
  im->set_num_layers(m.num_layers);
  im->set_num_heads(m.num_heads);
  im->set_num_kv_heads(m.num_kv_heads);
  im->set_head_dim(m.head_dim);
  r.set_prefill_length(meta.prefill_length);
  r.set_num_decode_steps(meta.num_decode_steps);
  r.set_source(meta.source);
  r.set_generator(meta.generator);
  r.set_seed(meta.seed);
  const TokenCounts counts = CountTokens(meta.tokens);
  InspectModalityCounts* mc = r.mutable_tokens_by_modality();
  mc->set_text(counts.modality[static_cast<int>(Modality::kText)]);
  mc->set_image(counts.modality[static_cast<int>(Modality::kImage)]);
  mc->set_video(counts.modality[static_cast<int>(Modality::kVideo)]);
  mc->set_other(counts.modality[static_cast<int>(Modality::kOther)]);
  InspectRoleCounts* rc = r.mutable_tokens_by_role();
  rc->set_system(counts.role[static_cast<int>(Role::kSystem)]);
  rc->set_context(counts.role[static_cast<int>(Role::kContext)]);
  rc->set_question(counts.role[static_cast<int>(Role::kQuestion)]);
  rc->set_generated(counts.role[static_cast<int>(Role::kGenerated)]);
  const TraceStatsOptions& o = stats.options;
  r.mutable_options()->set_top_fraction(o.top_fraction);
  r.mutable_options()->set_sink_tokens(o.sink_tokens);
  r.mutable_options()->set_recent_tokens(o.recent_tokens);
  r.mutable_options()->set_sparsity_epsilon(o.sparsity_epsilon);
  for (const LayerStats& ls : stats.layers) {
    InspectLayer* l = r.add_layers();
    l->set_layer(ls.layer);
    l->set_entropy(ls.entropy);
    l->set_normalized_entropy(ls.normalized_entropy);
    l->set_top_mass(ls.top_mass);
    l->set_sink_mass(ls.sink_mass);
    l->set_recent_mass(ls.recent_mass);
    l->set_k90(ls.k90);
    l->set_k90_fraction(ls.k90_fraction);
    l->set_value_output_ratio(ls.value_output_ratio);
    l->set_sparsity(ls.sparsity);
    l->set_text_sparsity(ls.text_sparsity);
    l->set_visual_sparsity(ls.visual_sparsity);
    l->set_text_concentration(ls.text_concentration);
    l->set_visual_concentration(ls.visual_concentration);
    for (double h : ls.head_text_share) l->add_head_text_share(h);
  }
  // The overall value of each per-layer statistic: its mean over layers (the " mean" row of the text report).
  double mean[8] = {};
  for (const LayerStats& ls : stats.layers) {
    const double v[8] = {ls.entropy,      ls.normalized_entropy, ls.top_mass,
                         ls.sink_mass,    ls.recent_mass,        ls.k90,
                         ls.k90_fraction, ls.value_output_ratio};
    for (int i = 0; i < 8; ++i) mean[i] += v[i];
  }
  const double num_layers = static_cast<double>(stats.layers.size());
  for (double& v : mean) v = Ratio(v, num_layers);
  InspectMeans* mm = r.mutable_mean_over_layers();
  mm->set_entropy(mean[0]);
  mm->set_normalized_entropy(mean[1]);
  mm->set_top_mass(mean[2]);
  mm->set_sink_mass(mean[3]);
  mm->set_recent_mass(mean[4]);
  mm->set_k90(mean[5]);
  mm->set_k90_fraction(mean[6]);
  mm->set_value_output_ratio(mean[7]);
  r.set_adjacent_patch_key_cosine(stats.adjacent_patch_key_cosine);
  r.set_random_patch_key_cosine(stats.random_patch_key_cosine);
  r.set_num_adjacent_pairs(static_cast<int32_t>(stats.num_adjacent_pairs));
  r.set_num_random_pairs(static_cast<int32_t>(stats.num_random_pairs));
  return r;
}

std::string TraceStatsToJson(const TraceMeta& meta, const TraceStats& stats) {
  return ToJson(TraceStatsReport(meta, stats));
}

}  // namespace kvsim
