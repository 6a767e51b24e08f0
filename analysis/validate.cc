#include "analysis/validate.h"

#include <cmath>
#include <numeric>
#include <sstream>

#include "sim/attention.h"
#include "sim/parallel.h"

namespace kvsim {

StatusOr<ValidationReport> ValidateTrace(TraceSource& trace, int threads) {
  const TraceMeta& meta = trace.meta();
  KVSIM_RETURN_IF_ERROR(meta.Validate().WithContext(trace.Describe()));
  ValidationReport rep;
  rep.integrity = trace.integrity();
  rep.aggregates_present = meta.has_prefill_column_sums;
  rep.aggregates_checked = meta.has_prefill_column_sums && meta.HasAllPromptQueries();
  rep.entropies_present = !meta.prompt_entropy_regions.empty();
  rep.entropies_checked = rep.entropies_present && meta.HasAllPromptQueries();
  const ModelInfo& m = meta.model;
  const int n = meta.prefill_length, t_all = meta.total_tokens(), d = m.head_dim;
  LayerData layer;
  for (int l = 0; l < m.num_layers; ++l) {
    KVSIM_RETURN_IF_ERROR(trace.ReadLayer(l, &layer));  // validates shapes and finite values
    if (meta.has_prefill_column_sums && layer.prefill_column_sums.empty())
      return Status::DataLoss(trace.Describe() + ": layer " + std::to_string(l) +
                              " lacks prefill_column_sums although the trace declares them");
    ++rep.layers_checked;
    std::vector<float> rows;
    KVSIM_ASSIGN_OR_RETURN(const bool has_rows, trace.ReadRecordedDecodeRows(l, &rows));
    if (has_rows && meta.num_decode_steps > 0) {
      rep.decode_rows_present = true;
      ++rep.decode_rows_layers;
      const int steps = meta.num_decode_steps;
      const int qi = meta.QueryIndex(n);
      KVSIM_CHECK(qi >= 0);
      std::vector<double> dev(m.num_heads, 0);
      std::vector<int> worst(m.num_heads, -1);
      ParallelFor(m.num_heads, threads, [&](int h) {
        const float* q =
            layer.queries.data() + (static_cast<size_t>(h) * meta.query_positions.size() + qi) * d;
        const size_t kv = static_cast<size_t>(h / m.GroupSize()) * t_all * d;
        DecodeReference ref;
        ComputeDecodeReference(m, n, steps, q, layer.keys.data() + kv, layer.values.data() + kv, &ref);
        const float* rec = rows.data() + static_cast<size_t>(h) * steps * t_all;
        for (size_t i = 0; i < ref.probs.size(); ++i) {
          const double e = std::fabs(static_cast<double>(rec[i]) - ref.probs[i]);
          if (e > dev[h]) dev[h] = e, worst[h] = static_cast<int>(i);
        }
      });
      for (int h = 0; h < m.num_heads; ++h)
        if (dev[h] > rep.decode_max_abs_deviation) {
          rep.decode_max_abs_deviation = dev[h];
          rep.decode_worst_layer = l, rep.decode_worst_head = h;
          rep.decode_worst_step = worst[h] / t_all, rep.decode_worst_key = worst[h] % t_all;
        }
    }
    if (rep.entropies_checked) {
      const int regions = static_cast<int>(meta.prompt_entropy_regions.size()), H = m.num_heads;
      const double* rec = meta.RecordedPromptEntropies(l, meta.prompt_entropy_regions[0]);
      KVSIM_CHECK(rec != nullptr);
      std::vector<double> got(static_cast<size_t>(regions) * kNumPromptEntropyKinds * H);
      ParallelFor(H, threads, [&](int h) {  // queries of every token are stored: row = position
        const float* q = layer.queries.data() + static_cast<size_t>(h) * meta.query_positions.size() * d;
        const float* k = layer.keys.data() + static_cast<size_t>(h / m.GroupSize()) * t_all * d;
        for (int r = 0; r < regions; ++r) {
          const int ce = meta.prompt_entropy_regions[r];
          double e[kNumPromptEntropyKinds];
          HeadPromptEntropies(m, std::span(meta.tokens.modality).first(ce), q, k, ce, true, true, e);
          for (int kind = 0; kind < kNumPromptEntropyKinds; ++kind)
            got[(static_cast<size_t>(r) * kNumPromptEntropyKinds + kind) * H + h] = e[kind];
        }
      });
      for (size_t i = 0; i < got.size(); ++i) {
        ++rep.entropies_compared;
        rep.entropies_differing += got[i] != rec[i];
        const double dev = std::fabs(got[i] - rec[i]);
        if (dev > rep.entropy_max_abs_deviation) {
          rep.entropy_max_abs_deviation = dev;
          rep.entropy_worst_layer = l, rep.entropy_worst_head = static_cast<int>(i % H);
          rep.entropy_worst_kind = static_cast<int>(i / H % kNumPromptEntropyKinds);
          rep.entropy_worst_region = static_cast<int>(i / H / kNumPromptEntropyKinds);
        }
      }
    }
    if (!rep.aggregates_checked) continue;
    std::vector<double> abs_dev(m.num_heads, 0), rel_dev(m.num_heads, 0);
    std::vector<int> worst_key(m.num_heads, -1);
    ParallelFor(m.num_heads, threads, [&](int h) {
      std::vector<float> sums(n, 0.0f);
      std::vector<int32_t> pos(n);
      std::iota(pos.begin(), pos.end(), 0);
      const float* q = layer.queries.data() + static_cast<size_t>(h) * meta.query_positions.size() * d;
      const float* k = layer.keys.data() + static_cast<size_t>(h / m.GroupSize()) * t_all * d;
      AccumulateColumnSums(m, q, pos.data(), n, k, n, sums.data());
      const float* rec = layer.prefill_column_sums.data() + static_cast<size_t>(h) * n;
      for (int j = 0; j < n; ++j) {
        const double dev = std::fabs(static_cast<double>(rec[j]) - sums[j]);
        const double rel = dev / std::max(1.0, static_cast<double>(std::fabs(sums[j])));
        abs_dev[h] = std::max(abs_dev[h], dev);
        if (rel > rel_dev[h]) rel_dev[h] = rel, worst_key[h] = j;
      }
    });
    for (int h = 0; h < m.num_heads; ++h) {
      if (rel_dev[h] > rep.max_rel_deviation) {
        rep.max_rel_deviation = rel_dev[h];
        rep.worst_layer = l, rep.worst_head = h, rep.worst_key = worst_key[h];
      }
      rep.max_abs_deviation = std::max(rep.max_abs_deviation, abs_dev[h]);
    }
  }
  return rep;
}

std::string ValidationReport::Text(const TraceMeta& meta, double tolerance) const {
  std::ostringstream os;
  os << "structure: ok (" << layers_checked << " layers; shapes, dtypes, finite values, token metadata)\n";
  os << "integrity: " << integrity.Text() << "\n";
  if (!aggregates_present) {
    os << "aggregates: none recorded (nothing to compare)\n";
  } else if (!aggregates_checked) {
    os << "aggregates: prefill_column_sums recorded but not checkable: the trace stores queries of only the "
          "last "
       << meta.query_positions.size() - meta.num_decode_steps << " prompt tokens\n";
  } else {
    os << "aggregates: prefill_column_sums vs recomputed from Q/K: max deviation |recorded - recomputed| / "
          "max(recomputed, 1) "
       << max_rel_deviation;
    if (worst_layer >= 0)
      os << " (layer " << worst_layer << ", head " << worst_head << ", key " << worst_key << ")";
    os << ", max abs deviation " << max_abs_deviation << " -> "
       << (max_rel_deviation <= tolerance ? "ok" : "MISMATCH") << " (tolerance " << tolerance << ")\n";
  }
  if (entropies_present && !entropies_checked) {
    os << "aggregates: prompt_entropies recorded but not checkable: the trace stores queries of only the "
          "last "
       << meta.query_positions.size() - meta.num_decode_steps << " prompt tokens\n";
  } else if (entropies_checked) {
    os << "aggregates: prompt_entropies vs recomputed from Q/K (HeadPromptEntropies): " << entropies_differing
       << " of " << entropies_compared << " values differ, max abs deviation " << entropy_max_abs_deviation
       << " nats";
    if (entropy_worst_layer >= 0)
      os << " (layer " << entropy_worst_layer
         << ", region ce=" << meta.prompt_entropy_regions[entropy_worst_region] << ", kind "
         << entropy_worst_kind << ", head " << entropy_worst_head << ")";
    os << " -> " << (entropy_max_abs_deviation <= tolerance ? "ok" : "MISMATCH") << " (tolerance "
       << tolerance << ")\n";
  }
  if (decode_rows_present) {
    os << "aggregates: decode attention rows (" << decode_rows_layers
       << " layers) vs recomputed from the decode queries: max abs deviation " << decode_max_abs_deviation;
    if (decode_worst_layer >= 0)
      os << " (layer " << decode_worst_layer << ", head " << decode_worst_head << ", step "
         << decode_worst_step << ", key " << decode_worst_key << ")";
    os << " -> " << (decode_max_abs_deviation <= tolerance ? "ok" : "MISMATCH") << " (tolerance " << tolerance
       << ")\n";
  }
  return os.str();
}

}  // namespace kvsim
