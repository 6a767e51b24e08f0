#include "gpu_replay/plan.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>

#include "analysis/report.h"
#include "analysis/sweep.h"
#include "policies/registry.h"
#include "traces/hash_cache.h"
#include "traces/hdf5_trace.h"

namespace kvsim::gpu_replay {
namespace {

PlanMergedSlot ToPlanMerge(int32_t anchor, const MergedSlot& m) {
  PlanMergedSlot out;
  out.set_anchor(anchor);
  out.mutable_key()->Assign(m.key.begin(), m.key.end());
  out.mutable_value()->Assign(m.value.begin(), m.value.end());
  for (const auto& [tok, w] : m.members) {
    out.add_members(tok);
    out.add_member_weights(w);
  }
  return out;
}

bool SameMerge(const PlanMergedSlot& a, const PlanMergedSlot& b) {
  auto eq = [](const auto& x, const auto& y) { return std::equal(x.begin(), x.end(), y.begin(), y.end()); };
  return a.anchor() == b.anchor() && eq(a.members(), b.members()) &&
         eq(a.member_weights(), b.member_weights()) && eq(a.key(), b.key()) && eq(a.value(), b.value());
}

bool Contains(const std::vector<int32_t>& sorted, int32_t x) {
  return std::binary_search(sorted.begin(), sorted.end(), x);
}

}  // namespace

void PlanRecorder::Begin(const TraceMeta& meta, std::span<const RunSpec> runs,
                         std::span<const int> compress_end, std::span<const std::vector<int>> head_budgets) {
  const ModelInfo& m = meta.model;
  num_kv_heads_ = m.num_kv_heads;
  const int units = m.num_layers * m.num_kv_heads;
  plans_.assign(runs.size(), GpuPlan());
  state_.assign(runs.size(), std::vector<UnitState>(units));
  compression_step_.assign(runs.size(), -1);
  for (size_t r = 0; r < runs.size(); ++r) {
    GpuPlan& p = plans_[r];
    p.set_format_version(kPlanFormatVersion);
    PlanModel* pm = p.mutable_model();
    pm->set_name(m.name);
    pm->set_num_layers(m.num_layers);
    pm->set_num_heads(m.num_heads);
    pm->set_num_kv_heads(m.num_kv_heads);
    pm->set_head_dim(m.head_dim);
    pm->set_softmax_scale(m.softmax_scale);
    pm->set_model_dtype(m.model_dtype);
    p.set_prefill_length(meta.prefill_length);
    p.set_num_decode_steps(meta.num_decode_steps);
    p.set_compress_end(compress_end[r]);
    compression_step_[r] = runs[r].policy->compression_step();
    p.set_compression_step(compression_step_[r]);
    for (int u = 0; u < units; ++u) {
      HeadPlan* h = p.add_heads();
      h->set_layer(u / m.num_kv_heads);
      h->set_kv_head(u % m.num_kv_heads);
      h->set_budget(head_budgets[r][u]);
      h->mutable_steps()->Reserve(meta.num_decode_steps);
    }
  }
}

void PlanRecorder::Diff(UnitState& st, const HeadCache& cache, CacheDelta* delta, int* added_count) const {
  if (cache.version() == st.version && cache.size() >= st.size) {  // only appends since the last call
    for (int s = st.size; s < cache.size(); ++s) {
      const int32_t tok = cache.token(s);
      delta->add_added(tok);
      st.sorted.insert(std::upper_bound(st.sorted.begin(), st.sorted.end(), tok), tok);
    }
    *added_count += cache.size() - st.size;
    st.size = cache.size();
    return;
  }
  std::vector<int32_t> cur(cache.tokens().begin(), cache.tokens().end());
  std::sort(cur.begin(), cur.end());
  std::set_difference(st.sorted.begin(), st.sorted.end(), cur.begin(), cur.end(),
                      google::protobuf::RepeatedFieldBackInserter(delta->mutable_removed()));
  for (int32_t tok : cache.tokens())
    if (!Contains(st.sorted, tok)) {
      delta->add_added(tok);
      ++*added_count;
    }
  std::vector<PlanMergedSlot> merges;
  for (int s = 0; s < cache.size(); ++s)
    if (cache.is_merged(s)) merges.push_back(ToPlanMerge(cache.token(s), cache.merged(s)));
  std::sort(merges.begin(), merges.end(),
            [](const PlanMergedSlot& a, const PlanMergedSlot& b) { return a.anchor() < b.anchor(); });
  auto by_anchor = [](const PlanMergedSlot& m, int32_t a) { return m.anchor() < a; };
  for (const PlanMergedSlot& m : merges) {
    auto it = std::lower_bound(st.merges.begin(), st.merges.end(), m.anchor(), by_anchor);
    if (it == st.merges.end() || !SameMerge(*it, m)) *delta->add_merges() = m;
  }
  for (const PlanMergedSlot& old : st.merges) {
    if (!Contains(cur, old.anchor())) continue;  // left the cache: covered by `removed`
    auto it = std::lower_bound(merges.begin(), merges.end(), old.anchor(), by_anchor);
    if (it == merges.end() || it->anchor() != old.anchor()) delta->add_unmerged(old.anchor());
  }
  st.sorted = std::move(cur);
  st.merges = std::move(merges);
  st.version = cache.version();
  st.size = cache.size();
}

void PlanRecorder::AfterPrefill(int run, int layer, int kv_head, const HeadCache& cache) {
  UnitState& st = State(run, layer, kv_head);
  HeadPlan& h = Head(run, layer, kv_head);
  CacheDelta initial;
  int added = 0;
  Diff(st, cache, &initial, &added);
  *h.mutable_slots() = std::move(*initial.mutable_added());
  *h.mutable_merges() = std::move(*initial.mutable_merges());
  h.set_max_slots(cache.size());
  h.set_new_tokens(0);
  if (compression_step_[run] < 0) h.set_kept_after_compression(cache.size());
}

void PlanRecorder::BeforeAttention(int run, int layer, int kv_head, int step, const HeadCache& cache) {
  UnitState& st = State(run, layer, kv_head);
  HeadPlan& h = Head(run, layer, kv_head);
  while (h.steps_size() <= step) h.add_steps();
  int added = 0;
  Diff(st, cache, h.mutable_steps(step)->mutable_before_attention(), &added);
  h.set_new_tokens(h.new_tokens() + added);
  h.set_max_slots(std::max(h.max_slots(), cache.size()));
}

void PlanRecorder::AfterStep(int run, int layer, int kv_head, int step, const HeadCache& cache) {
  UnitState& st = State(run, layer, kv_head);
  HeadPlan& h = Head(run, layer, kv_head);
  while (h.steps_size() <= step) h.add_steps();
  int added = 0;
  Diff(st, cache, h.mutable_steps(step)->mutable_after_step(), &added);
  h.set_new_tokens(h.new_tokens() + added);
  h.set_max_slots(std::max(h.max_slots(), cache.size()));
  if (step == 0 && compression_step_[run] == 0) h.set_kept_after_compression(cache.size());
}

GpuPlan PlanRecorder::TakePlan(int run, const RunResult& result) {
  GpuPlan p = std::move(plans_[run]);
  state_[run].clear();
  state_[run].shrink_to_fit();
  p.set_policy(result.policy());
  p.set_label(result.label());
  p.set_parameters(result.parameters());
  p.set_budget_fraction(result.budget_fraction());
  p.set_budget_tokens(result.budget_tokens());
  p.set_question_mode(result.question_mode());
  p.set_trace_path(result.trace_path());
  p.set_trace_hash(result.trace_hash());
  p.set_kvsim_version(result.kvsim_version());
  p.set_git_commit(result.git_commit());
  return p;
}

// ---- Replaying deltas ----

HeadState InitialState(const HeadPlan& head) {
  HeadState s;
  s.anchors.assign(head.slots().begin(), head.slots().end());
  s.merges.assign(head.merges().begin(), head.merges().end());
  std::sort(s.merges.begin(), s.merges.end(),
            [](const PlanMergedSlot& a, const PlanMergedSlot& b) { return a.anchor() < b.anchor(); });
  return s;
}

void ApplyDelta(const CacheDelta& delta, HeadState* state) {
  auto by_anchor = [](const PlanMergedSlot& m, int32_t a) { return m.anchor() < a; };
  auto erase_merge = [&](int32_t a) {
    auto it = std::lower_bound(state->merges.begin(), state->merges.end(), a, by_anchor);
    if (it != state->merges.end() && it->anchor() == a) state->merges.erase(it);
  };
  if (!delta.removed().empty()) {
    std::vector<int32_t> removed(delta.removed().begin(), delta.removed().end());
    std::sort(removed.begin(), removed.end());
    std::erase_if(state->anchors, [&](int32_t a) { return Contains(removed, a); });
    for (int32_t a : removed) erase_merge(a);
  }
  state->anchors.insert(state->anchors.end(), delta.added().begin(), delta.added().end());
  for (int32_t a : delta.unmerged()) erase_merge(a);
  for (const PlanMergedSlot& m : delta.merges()) {
    auto it = std::lower_bound(state->merges.begin(), state->merges.end(), m.anchor(), by_anchor);
    if (it != state->merges.end() && it->anchor() == m.anchor())
      *it = m;
    else
      state->merges.insert(it, m);
  }
}

std::vector<int32_t> LengthsAtStep(const GpuPlan& plan, int step) {
  std::vector<int32_t> out;
  out.reserve(plan.heads_size());
  for (const HeadPlan& h : plan.heads()) {
    int64_t len = h.slots_size();
    for (int t = 0; t <= step && t < h.steps_size(); ++t) {
      const CacheDelta& b = h.steps(t).before_attention();
      len += b.added_size() - b.removed_size();
      if (t < step) {
        const CacheDelta& a = h.steps(t).after_step();
        len += a.added_size() - a.removed_size();
      }
    }
    out.push_back(static_cast<int32_t>(len));
  }
  return out;
}

// ---- Validation and files ----

namespace {

Status CheckDelta(const CacheDelta& d, const std::string& where, int32_t last_token, int head_dim,
                  std::vector<int32_t>* sorted) {
  for (int32_t a : d.removed())
    if (!Contains(*sorted, a))
      return Status::InvalidArgument(where + ".removed: anchor " + std::to_string(a) +
                                     " is not in the cache");
  std::vector<int32_t> removed(d.removed().begin(), d.removed().end());
  std::sort(removed.begin(), removed.end());
  std::vector<int32_t> rest;
  std::set_difference(sorted->begin(), sorted->end(), removed.begin(), removed.end(),
                      std::back_inserter(rest));
  for (int32_t a : d.added()) {
    if (a < 0 || a > last_token)
      return Status::InvalidArgument(where + ".added: anchor " + std::to_string(a) + " outside [0, " +
                                     std::to_string(last_token) + "]");
    auto it = std::lower_bound(rest.begin(), rest.end(), a);
    if (it != rest.end() && *it == a)
      return Status::InvalidArgument(where + ".added: anchor " + std::to_string(a) +
                                     " is already in the cache");
    rest.insert(it, a);
  }
  for (int i = 0; i < d.merges_size(); ++i) {
    const PlanMergedSlot& m = d.merges(i);
    const std::string w = where + ".merges[" + std::to_string(i) + "]";
    if (!Contains(rest, m.anchor()))
      return Status::InvalidArgument(w + ": anchor " + std::to_string(m.anchor()) + " is not in the cache");
    if (m.key_size() != head_dim || m.value_size() != head_dim)
      return Status::InvalidArgument(w + ": key/value must have head_dim = " + std::to_string(head_dim) +
                                     " entries");
    if (m.members_size() != m.member_weights_size())
      return Status::InvalidArgument(w + ": members and member_weights differ in length");
  }
  for (int32_t a : d.unmerged())
    if (!Contains(rest, a))
      return Status::InvalidArgument(where + ".unmerged: anchor " + std::to_string(a) +
                                     " is not in the cache");
  *sorted = std::move(rest);
  return Status::Ok();
}

}  // namespace

Status ValidatePlan(const GpuPlan& plan, const std::string& what) {
  auto bad = [&](const std::string& msg) { return Status::InvalidArgument(what + ": " + msg); };
  if (plan.format_version() != kPlanFormatVersion)
    return bad("field 'format_version' is " + std::to_string(plan.format_version()) + ", expected " +
               std::to_string(kPlanFormatVersion) + " (not a kvsim GPU plan, or from another version)");
  const PlanModel& m = plan.model();
  if (m.num_layers() < 1 || m.num_heads() < 1 || m.num_kv_heads() < 1 || m.head_dim() < 1)
    return bad("field 'model' needs num_layers, num_heads, num_kv_heads, head_dim >= 1");
  if (m.num_heads() % m.num_kv_heads() != 0)
    return bad("field 'model': num_heads must be a multiple of num_kv_heads");
  // Token indices run to prefill_length + num_decode_steps - 1, which must be an int32.
  if (plan.prefill_length() < 1 || plan.num_decode_steps() < 0 ||
      int64_t{plan.prefill_length()} + plan.num_decode_steps() > std::numeric_limits<int32_t>::max())
    return bad(
        "fields 'prefill_length' (>= 1) / 'num_decode_steps' (>= 0, total tokens < 2^31) out of range");
  const int64_t num_units = int64_t{m.num_layers()} * m.num_kv_heads();
  if (plan.heads_size() != num_units)
    return bad("field 'heads' has " + std::to_string(plan.heads_size()) + " entries, expected num_layers * " +
               "num_kv_heads = " + std::to_string(num_units));
  for (int i = 0; i < plan.heads_size(); ++i) {
    const HeadPlan& h = plan.heads(i);
    const std::string where = "heads[" + std::to_string(i) + "]";
    if (h.layer() != i / m.num_kv_heads() || h.kv_head() != i % m.num_kv_heads())
      return bad(where + ": layer/kv_head do not match its index (layer-major order)");
    if (h.steps_size() != plan.num_decode_steps())
      return bad(where + ".steps has " + std::to_string(h.steps_size()) + " entries, expected " +
                 std::to_string(plan.num_decode_steps()));
    std::vector<int32_t> sorted;
    CacheDelta init;
    *init.mutable_added() = h.slots();
    *init.mutable_merges() = h.merges();
    Status st = CheckDelta(init, where + ".slots", plan.prefill_length() - 1, m.head_dim(), &sorted);
    if (!st.ok()) return st.WithContext(what);
    int most = static_cast<int>(sorted.size());
    for (int t = 0; t < h.steps_size(); ++t) {
      const std::string ws = where + ".steps[" + std::to_string(t) + "]";
      const int32_t last = plan.prefill_length() + t;
      st = CheckDelta(h.steps(t).before_attention(), ws + ".before_attention", last, m.head_dim(), &sorted);
      if (st.ok()) {
        most = std::max(most, static_cast<int>(sorted.size()));
        st = CheckDelta(h.steps(t).after_step(), ws + ".after_step", last, m.head_dim(), &sorted);
      }
      if (!st.ok()) return st.WithContext(what);
      most = std::max(most, static_cast<int>(sorted.size()));
    }
    if (h.max_slots() < most)
      return bad(where + ".max_slots is " + std::to_string(h.max_slots()) + " but the cache holds " +
                 std::to_string(most) + " slots at some step");
  }
  return Status::Ok();
}

Status WritePlan(const GpuPlan& plan, const std::string& path) {
  std::string bytes;
  if (!plan.SerializeToString(&bytes)) return Status::Internal(path + ": cannot serialise the plan");
  return WriteFileAtomic(path, bytes);
}

StatusOr<GpuPlan> ReadPlan(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound(path + ": cannot open the plan file");
  std::stringstream ss;
  ss << in.rdbuf();
  return ParsePlan(ss.str(), path);
}

StatusOr<GpuPlan> ParsePlan(const std::string& bytes, const std::string& path) {
  GpuPlan plan;
  if (!plan.ParseFromString(bytes))
    return Status::DataLoss(path +
                            ": not a GpuPlan (binary Protobuf, gpu_replay/plan.proto); write one with "
                            "kvsim gpu-plan");
  KVSIM_RETURN_IF_ERROR(ValidatePlan(plan, path));
  return plan;
}

// ---- Building plans ----

StatusOr<GpuPlan> BuildPlanFromSource(TraceSource& trace, const RunSpec& run, int threads,
                                      RunResult* result) {
  PlanRecorder rec;
  ReplayOptions ro;
  ro.threads = threads;
  ro.recorder = &rec;
  std::vector<RunSpec> runs{run};
  KVSIM_ASSIGN_OR_RETURN(auto results, Replay(trace, runs, ro));
  GpuPlan plan = rec.TakePlan(0, results[0]);
  if (result) *result = std::move(results[0]);
  return plan;
}

StatusOr<GpuPlan> BuildPlan(const PlanRequest& req, RunResult* result) {
  KVSIM_ASSIGN_OR_RETURN(auto policy, PolicyRegistry::Default().Create(req.policy, req.sets));
  KVSIM_ASSIGN_OR_RETURN(auto trace, OpenTrace(req.trace_path));
  std::string label = req.policy;
  for (const auto& s : req.sets) label += " " + s;
  if (!req.label.empty()) label = req.label;
  std::vector<RunSpec> runs{
      RunSpec{policy, label, req.budget_fraction, req.budget_tokens, req.question_mode}};
  KVSIM_RETURN_IF_ERROR(CheckRuns(trace->meta(), runs).WithContext(req.trace_path));
  KVSIM_ASSIGN_OR_RETURN(std::string hash, CachedHashFile(req.trace_path));
  PlanRecorder rec;
  ReplayOptions ro;
  ro.threads = req.threads;
  Progress progress = Progress::FromEnv("gpu-plan", req.progress && !req.reporter);
  ro.progress = req.reporter ? req.reporter : &progress;
  ro.trace_hash = hash;
  ro.recorder = &rec;
  KVSIM_ASSIGN_OR_RETURN(auto results, Replay(*trace, runs, ro));
  progress.Finish();
  GpuPlan plan = rec.TakePlan(0, results[0]);
  if (result) *result = std::move(results[0]);
  return plan;
}

std::string PlanSummary(const GpuPlan& plan) {
  int64_t slots = 0, merged = 0, deltas = 0;
  int most = 0;
  for (const HeadPlan& h : plan.heads()) {
    slots += h.kept_after_compression();
    merged += h.merges_size();
    most = std::max(most, h.max_slots());
    for (const StepDelta& s : h.steps())
      deltas += s.before_attention().removed_size() + s.after_step().removed_size() +
                s.after_step().merges_size() + s.before_attention().merges_size();
  }
  char buf[320];
  std::snprintf(
      buf, sizeof(buf),
      "%d (layer, KV head) caches, %.1f slots kept after compression on average (max %d held), %lld "
      "merged slots after prefill, %lld decode evictions/merges over %d steps",
      plan.heads_size(), plan.heads_size() ? static_cast<double>(slots) / plan.heads_size() : 0.0, most,
      static_cast<long long>(merged), static_cast<long long>(deltas), plan.num_decode_steps());
  return buf;
}

}  // namespace kvsim::gpu_replay
