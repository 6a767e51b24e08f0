#include "sim/perf_model.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <numeric>
#include <vector>

#include "policies/registry.h"
#include "sim/embedded_configs.h"
#include "sim/latency_model.h"
#include "sim/replay.h"
#include "tests/test_util.h"

namespace kvsim {
namespace {

// A toy device for hand computations: 1 GB/s = 1000 bytes/us, 4 SMs, one block streams at most its fair
// share (250 bytes/us), efficiency ~1 at every size.
DeviceProfile ToyDevice() {
  DeviceProfile d;
  d.set_name("toy");
  d.set_hbm_bandwidth_gbps(1);
  d.set_sm_count(4);
  d.set_tensor_tflops(1000);
  d.set_memory_bytes(1e12);
  d.set_unit_bandwidth_share(1);
  d.set_graph_kernel_us(1);
  d.set_gemm_efficiency(0.5);
  d.set_prefill_attention_efficiency(0.5);
  StreamingKernel* k = d.add_kernels();
  k->set_name("split_kv");
  k->set_efficiency_max(1);
  k->set_half_efficiency_bytes(1e-12);
  k->set_efficiency_hill(1);
  k->set_launch_us(3);
  k->set_min_chunk_tokens(100);
  k->set_target_units_per_sm(2);
  k->set_merge_kernel(true);
  StreamingKernel* g = d.add_kernels();
  *g = *k;
  g->set_name("gemv");
  g->clear_min_chunk_tokens();
  g->clear_merge_kernel();
  return d;
}

TEST_CASE("perf model: every embedded profile and preset parses and passes its checks", "[perf_model]") {
  REQUIRE(EmbeddedDevices().size() >= 4);
  REQUIRE(EmbeddedModels().size() >= 3);
  for (const char* name : {"a100-sxm", "a100-pcie", "h100-sxm", "h200", "A100-SXM4-80GB", "H200-SXM-141GB"}) {
    auto d = FindDevice(name);
    INFO(name);
    REQUIRE(d.ok());
    CHECK(CheckDevice(*d, name).ok());
    CHECK(d->kernels(0).name() == "split_kv");
  }
  for (const char* name : {"llama-2-7b", "llava-1.5-7b", "qwen2-7b", "smollm2-135m"}) {
    auto m = FindModelShape(name);
    INFO(name);
    REQUIRE(m.ok());
    CHECK(CheckModelShape(*m, name).ok());
  }
  // Trace model names map to presets.
  REQUIRE(ModelPresetFor("llava-1.5-7b") != nullptr);
  CHECK(ModelPresetFor("qwen2-7b-video")->name() == "qwen2-7b");
  CHECK(ModelPresetFor("tiny-mha") == nullptr);
  auto bad = FindDevice("a100-nvl");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("a100-sxm") != std::string::npos);
}

TEST_CASE("perf model: size-dependent efficiency e(B) = e_max / (1 + (B_half / B)^hill)", "[perf_model]") {
  const PerfModel perf(ToyDevice());
  StreamingKernel k;
  k.set_efficiency_max(0.8);
  k.set_half_efficiency_bytes(100);
  k.set_efficiency_hill(1);
  CHECK(perf.Efficiency(k, 100) == Approx(0.4));
  CHECK(perf.Efficiency(k, 300) == Approx(0.6));  // 0.8 / (1 + 1/3)
  k.set_efficiency_hill(2);
  CHECK(perf.Efficiency(k, 200) == Approx(0.64));  // 0.8 / (1 + 1/4)
}

TEST_CASE("perf model: fluid schedule of work units (processor sharing, per-SM cap)", "[perf_model]") {
  const PerfModel perf(ToyDevice());
  const StreamingKernel& k = perf.AttentionKernel();
  // Two equal units: 2 SMs busy -> 2 x 250 bytes/us; 1000 bytes each -> 4 us.
  CHECK(perf.FluidUs(k, {1000, 1000}) == Approx(4));
  // Eight units fill the 4 SMs: aggregate 1000 bytes/us, 8000 bytes -> 8 us.
  CHECK(perf.FluidUs(k, std::vector<double>(8, 1000)) == Approx(8));
  // Ragged: 100 and 1000 bytes. Both run at 250 until the short one ends (0.4 us), then the long one alone is
  // capped by its SM: 900 / 250 = 3.6 us. The longest unit bounds the kernel.
  CHECK(perf.FluidUs(k, {1000, 100}) == Approx(4.0));
  CHECK(perf.FluidUs(k, {}) == 0);
}

TEST_CASE("perf model: decode attention splits heads into chunks, GQA reads a KV head once", "[perf_model]") {
  const PerfModel perf(ToyDevice());
  const StreamingKernel& k = perf.AttentionKernel();
  // 8 target units; 1010 tokens -> chunk max(100, ceil(1010 / 8) = 127); head 0: 8 pieces, head 1: 1.
  const std::vector<int> lens{1000, 10};
  const KernelCost c = perf.DecodeAttention(lens, 1, 4, 2, k, false);
  CHECK(c.units == 9);
  CHECK(c.kernels == 2);                           // split -> merge kernel
  const double per_token = KvBytesPerToken(4, 2);  // 16 bytes
  CHECK(per_token == 16);
  // Hand value: units of 127 tokens x 7 + 111 + 10 tokens, then the merge (9 units x (4 + 2) x 4 x 2 bytes).
  std::vector<double> units(7, 127 * 16.0);
  units.push_back(111 * 16.0);
  units.push_back(10 * 16.0);
  const double merge_bytes = 2.0 * 9 * (4 + 2) * 4;
  CHECK(c.us == Approx(3 + perf.FluidUs(k, units) + 3 + merge_bytes / 1000));
  CHECK(c.bytes == Approx(1010 * 16 + merge_bytes));
  // No split below the minimum chunk: one unit per head, one kernel.
  const std::vector<int> short_lens{50, 50, 0};
  const KernelCost s = perf.DecodeAttention(short_lens, 1, 4, 2, k, false);
  CHECK(s.units == 2);
  CHECK(s.kernels == 1);
  CHECK(s.us == Approx(3 + 1600 / 500.0));  // 2 units x 800 bytes at 2 x 250 bytes/us
  // GQA: 8 query heads per KV head read the same bytes (memory-bound: the same time here).
  const KernelCost g = perf.DecodeAttention(short_lens, 8, 4, 2, k, false);
  CHECK(g.bytes == s.bytes);
  CHECK(g.us == Approx(s.us));
  CHECK(g.flops == 8 * s.flops);
  // Inside the decode-step graph the fixed cost is graph_kernel_us.
  CHECK(perf.DecodeAttention(short_lens, 1, 4, 2, k, true).us == Approx(1 + 1600 / 500.0));
}

TEST_CASE("perf model: whole-model decode step and prefill", "[perf_model]") {
  auto dev = FindDevice("a100-sxm");
  auto llama = FindModelShape("llama-2-7b");
  REQUIRE(dev.ok());
  REQUIRE(llama.ok());
  const PerfModel perf(*dev);
  const ModelShape& m = *llama;
  const int cells = m.num_layers() * m.num_kv_heads();
  const DecodeStepCost short_ctx = perf.DecodeStep(m, 1, std::vector<int>(cells, 5));
  // 9 kernels per layer (no split at 5 tokens) + final norm, LM head, sampling.
  CHECK(short_ctx.kernels == 32 * 9 + 3);
  // Weights streamed once per step: 32 x (4096 x 12288 + 4096 x 4096 + 3 x 4096 x 11008) + 4096 x 32000,
  // 2 bytes each, ~13.2 GB.
  const double weights =
      2.0 * (32.0 * (4096.0 * 12288 + 4096.0 * 4096 + 3.0 * 4096 * 11008) + 4096.0 * 32000);
  CHECK(short_ctx.bytes > weights);
  CHECK(short_ctx.bytes < weights * 1.001);
  CHECK(short_ctx.total_us == Approx(short_ctx.attention_us + short_ctx.weights_us + short_ctx.other_us));
  // Above the physical floor, and within 2x of it for a weight-bound step.
  const double floor = short_ctx.bytes / perf.PeakBytesPerUs();
  CHECK(short_ctx.total_us > floor);
  CHECK(short_ctx.total_us < 2 * floor);
  // Longer caches cost more; a ragged layer (same total) costs at least as much as an even one.
  const DecodeStepCost long_ctx = perf.DecodeStep(m, 1, std::vector<int>(cells, 16384));
  CHECK(long_ctx.attention_us > short_ctx.attention_us);
  std::vector<int> even(cells, 2048), ragged(cells, 2048);
  for (int l = 0; l < m.num_layers(); ++l) {
    ragged[static_cast<size_t>(l) * 32] = 2048 + 31 * 1024;
    for (int u = 1; u < 32; ++u) ragged[static_cast<size_t>(l) * 32 + u] = 1024;
  }
  CHECK(perf.DecodeStep(m, 1, ragged).attention_us >= perf.DecodeStep(m, 1, even).attention_us);
  // Batch: weights are read once for the batch; KV for each request.
  const DecodeStepCost b8 = perf.DecodeStep(m, 8, std::vector<int>(cells, 4096));
  const DecodeStepCost b1 = perf.DecodeStep(m, 1, std::vector<int>(cells, 4096));
  CHECK(b8.total_us < 8 * b1.total_us);
  CHECK(b8.attention_us > b1.attention_us);
  // Prefill: compute-bound, grows faster than linearly with the prompt (attention is quadratic).
  const PrefillCost p1 = perf.Prefill(m, 1, 1024);
  const PrefillCost p4 = perf.Prefill(m, 1, 4096);
  CHECK(p4.total_us > 3.5 * p1.total_us);
  CHECK(p4.attention_us > 10 * p1.attention_us);
  // Chunked prefill: the second chunk attends over the first.
  CHECK(perf.Prefill(m, 1, 1024, 1024).attention_us > p1.attention_us);
}

TEST_CASE("perf model: a policy's own work is charged where it runs", "[perf_model]") {
  auto dev = FindDevice("h100-sxm");
  auto qwen = FindModelShape("qwen2-7b");
  REQUIRE(dev.ok());
  REQUIRE(qwen.ok());
  const PerfModel perf(*dev);
  const int cells = qwen->num_layers() * qwen->num_kv_heads();
  const std::vector<int> kept(cells, 512), all(cells, 4096);
  PolicyGpuWork none;
  CHECK(perf.PolicyWork(*qwen, none, 4096, all, false).us == 0);  // nothing evicted, nothing scored
  const double compaction = perf.PolicyWork(*qwen, none, 4096, kept, false).us;
  CHECK(compaction > 0);
  PolicyGpuWork snap;
  snap.window = 32;
  const double window = perf.PolicyWork(*qwen, snap, 4096, kept, false).us;
  CHECK(window > compaction);
  PolicyGpuWork h2o;
  h2o.all_query_scores = true;
  h2o.decode_scores = true;
  CHECK(perf.PolicyWork(*qwen, h2o, 4096, kept, false).us > window);  // quadratic scores
  CHECK(perf.PolicyWork(*qwen, h2o, 4096, kept, true).us > 0);        // every decode step
  CHECK(perf.PolicyWork(*qwen, snap, 4096, kept, true).us == 0);
  PolicyGpuWork merged = snap;
  merged.merge = true;
  CHECK(perf.PolicyWork(*qwen, merged, 4096, kept, false).us > window);
}

TEST_CASE("perf model: bad profiles and shapes give one-line errors naming the field", "[perf_model]") {
  DeviceProfile d = ToyDevice();
  CHECK(CheckDevice(d, "toy").ok());
  d.clear_hbm_bandwidth_gbps();
  Status st = CheckDevice(d, "toy.textproto");
  CHECK(st.message() == "toy.textproto: field 'hbm_bandwidth_gbps' must be set to a finite number > 0");
  d = ToyDevice();
  d.mutable_kernels(1)->set_name("other");
  CHECK(CheckDevice(d, "x").message().find("\"gemv\"") != std::string::npos);
  d = ToyDevice();
  d.mutable_kernels(0)->set_efficiency_max(1.5);
  CHECK(CheckDevice(d, "x").message().find("kernels[0].efficiency_max") != std::string::npos);
  ModelShape m = *FindModelShape("llama-2-7b");
  m.set_num_kv_heads(5);
  CHECK(CheckModelShape(m, "m").message().find("num_kv_heads") != std::string::npos);
  // A profile file with a missing field.
  const std::string dir = testing::ScratchDir("perf_model_files");
  const std::string path = dir + "/dev.textproto";
  testing::WriteFile(path, "name: \"x\"\nsm_count: 10\n");
  auto loaded = FindDevice(path);
  REQUIRE_FALSE(loaded.ok());
  CHECK(loaded.status().message().find(path + ": field 'hbm_bandwidth_gbps'") == 0);
}

// A model shape with the tiny trace's dimensions.
ModelShape TinyShape(const testing::TinyTraceSpec& spec) {
  ModelShape shape;
  shape.set_name("tiny-shape");
  shape.set_num_layers(spec.num_layers);
  shape.set_num_heads(spec.num_heads);
  shape.set_num_kv_heads(spec.num_kv_heads);
  shape.set_head_dim(spec.head_dim);
  shape.set_hidden_size(spec.num_heads * spec.head_dim);
  shape.set_intermediate_size(2 * spec.num_heads * spec.head_dim);
  shape.set_vocab_size(100);
  REQUIRE(CheckModelShape(shape, "tiny").ok());
  return shape;
}

TEST_CASE("replay with a device model: the clock, latency metrics, full-cache reference",
          "[perf_model][replay]") {
  testing::TinyTraceSpec spec;
  spec.num_layers = 2;
  spec.num_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 8;
  spec.prefill_length = 40;
  spec.image_end = 30;
  spec.decode_steps = 5;
  MemoryTrace tr = testing::MakeTinyTrace(spec);
  const ModelShape shape = TinyShape(spec);
  auto dev = FindDevice("a100-sxm");
  REQUIRE(dev.ok());
  auto lat = MakeDeviceLatencyModel(*dev, shape);
  CHECK(lat->unit() == "us");
  CHECK(lat->Describe().find("modelled") == 0);
  auto full = PolicyRegistry::Default().Create("full");
  const std::vector<std::string> sets{"window=4"};
  auto snap = PolicyRegistry::Default().Create("snapkv", sets);
  REQUIRE(full.ok());
  REQUIRE(snap.ok());
  std::vector<RunSpec> runs{RunSpec{*full, "full", 1.0, 0, QuestionMode::kQueryAware},
                            RunSpec{*snap, "snapkv", 0.25, 0, QuestionMode::kQueryAware}};
  ReplayOptions o;
  o.threads = 1;
  o.latency = lat.get();
  auto res = Replay(tr, runs, o);
  REQUIRE(res.ok());
  const LatencyMetrics& lf = (*res)[0].latency();
  const LatencyMetrics& ls = (*res)[1].latency();
  CHECK(lf.device() == "A100-SXM4-80GB");
  CHECK(lf.model_shape() == "tiny-shape");
  // The full run's cache is the full reference: speed-up exactly 1, no policy work.
  CHECK(lf.speedup_vs_full() == 1);
  CHECK(lf.policy_work_ms() == 0);
  CHECK(lf.ms_per_output_token() == lf.full_ms_per_output_token());
  // snapkv keeps 10 of 40 prompt tokens: a smaller cache, window scoring + top-k + compaction at prefill.
  CHECK(ls.policy_work_ms() > 0);
  CHECK(ls.ttft_ms() > lf.ttft_ms());
  CHECK(ls.ttft_ms() == Approx(lf.ttft_ms() + ls.policy_work_ms()));
  CHECK(ls.speedup_vs_full() >= 1);
  CHECK(ls.head_length_max_over_mean() >= 1);
  CHECK(ls.floor_fraction() > 0);
  CHECK(ls.floor_fraction() < 1);
  // Hand check of one decode step's duration against the model directly.
  const RunResult& r = (*res)[0];
  const PerfModel perf(*dev);
  const std::vector<int> step0(4, 41);  // 40 prompt tokens + the first generated one, every (layer, KV head)
  const double d0 = perf.DecodeStep(shape, 1, step0).total_us;
  const int first_decode = r.prefill_chunks();
  REQUIRE(r.timeline(first_decode).event() == "decode");
  CHECK(r.timeline(first_decode).time() - r.timeline(first_decode - 1).time() == Approx(d0));
  CHECK(r.timeline(first_decode - 1).time() == Approx(perf.Prefill(shape, 1, 40).total_us));
  // Deterministic at any thread count.
  o.threads = 2;
  auto again = Replay(tr, runs, o);
  REQUIRE(again.ok());
  CHECK((*again)[1].SerializeAsString() == (*res)[1].SerializeAsString());
}

TEST_CASE("replay with a device model: compression at decode step 0 is charged for what it evicts and merges",
          "[perf_model][replay]") {
  const testing::TinyTraceSpec spec;  // 2 layers, 2 KV heads, n 24, 6 steps
  MemoryTrace tr = testing::MakeTinyTrace(spec);
  const ModelShape shape = TinyShape(spec);
  auto dev = FindDevice("h100-sxm");
  REQUIRE(dev.ok());
  auto lat = MakeDeviceLatencyModel(*dev, shape);
  auto make = [](const std::vector<std::string>& sets) {
    auto p = PolicyRegistry::Default().Create("meda", sets);
    REQUIRE(p.ok());
    return *p;
  };
  // The same selection rule at the end of prefill and after decode step 0: both keep 6 prompt tokens per
  // head, so both evict 18 and merge them (MEDA's Eqs. 11-12), and the same work is charged at their events.
  std::vector<RunSpec> runs{RunSpec{make({"compress_at=FIRST_DECODE_STEP"}), "deferred", 0, 6},
                            RunSpec{make({"compress_at=PREFILL"}), "prefill", 0, 6}};
  ReplayOptions o;
  o.threads = 1;
  o.latency = lat.get();
  auto res = Replay(tr, runs, o);
  REQUIRE(res.ok());
  const RunResult &d = (*res)[0], &p = (*res)[1];
  REQUIRE(d.metrics().prompt_kept_tokens_mean() == 6);
  REQUIRE(p.metrics().prompt_kept_tokens_mean() == 6);
  const PerfModel perf(*dev);
  const PolicyGpuWork work = runs[0].policy->gpu_work();
  REQUIRE(work.merge);
  REQUIRE_FALSE(work.decode_scores);  // no per-step work: the compression is all of it
  const std::vector<int> kept(4, 6), all(4, 24);
  const double charged = perf.PolicyWork(shape, work, 24, kept, false).us;
  // Before, step 0 was sized with its cache before the compression (25 slots a head): nothing evicted.
  const double unsized = perf.PolicyWork(shape, work, 24, all, false).us;
  CHECK(charged > unsized);
  CHECK(d.latency().policy_work_ms() * 1e3 == Approx(charged));
  CHECK(p.latency().policy_work_ms() * 1e3 == Approx(charged));
  // Where it is charged: the deferred run's step 0 (which attends over the whole prompt + 1), the other's
  // prefill.
  const int first_decode = d.prefill_chunks();
  const std::vector<int> step0(4, 25);
  CHECK(d.timeline(first_decode).time() - d.timeline(first_decode - 1).time() ==
        Approx(perf.DecodeStep(shape, 1, step0).total_us + charged));
  CHECK(p.latency().ttft_ms() * 1e3 == Approx(d.latency().ttft_ms() * 1e3 + charged));
}

TEST_CASE("ModelShapeForTrace: presets by trace name, explicit shapes, mismatches refused", "[perf_model]") {
  ModelInfo llava;
  llava.name = "llava-1.5-7b";
  llava.num_layers = 32;
  llava.num_heads = 32;
  llava.num_kv_heads = 32;
  llava.head_dim = 128;
  auto m = ModelShapeForTrace(llava, "");
  REQUIRE(m.ok());
  CHECK(m->name() == "llava-1.5-7b");
  auto q = ModelShapeForTrace(llava, "qwen2-7b");
  REQUIRE_FALSE(q.ok());
  CHECK(q.status().message().find("num_layers 28") != std::string::npos);
  ModelInfo tiny = llava;
  tiny.name = "tiny-mha";
  auto t = ModelShapeForTrace(tiny, "");
  REQUIRE_FALSE(t.ok());
  CHECK(t.status().message().find("--model") != std::string::npos);
}

}  // namespace
}  // namespace kvsim
