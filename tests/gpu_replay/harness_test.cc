// gpu_replay/harness.{h,cc}: timing summaries, the latency fit (synthetic data) and its file, NVML without a
// driver, the lower bound.

#include "gpu_replay/harness.h"

#include <catch2/catch.hpp>

#include "analysis/report.h"
#include "sim/latency_model.h"
#include "tests/test_util.h"

namespace kvsim::gpu_replay {

TEST_CASE("harness: timing summaries by nearest rank", "[gpu_replay][harness]") {
  std::vector<double> s;
  for (int i = 100; i >= 0; --i) s.push_back(i);  // 0..100, unsorted
  const TimingSummary t = Summarize(s);
  CHECK(t.samples == 101);
  CHECK(t.median == 50);
  CHECK(t.p10 == 10);
  CHECK(t.p90 == 90);
  CHECK(t.min == 0);
  CHECK(t.mean == Approx(50));
  CHECK(Summarize({}).samples == 0);
  CHECK(Summarize({7}).p90 == 7);
}

TEST_CASE("harness: latency fit recovers a line and stays loadable", "[gpu_replay][harness]") {
  std::vector<LatencyPoint> decode;
  for (double x : {0.0, 128.0, 512.0, 1024.0, 4096.0})
    decode.push_back({x, 6500.0 + 0.9 * x + (static_cast<int>(x) % 3 - 1) * 0.5});  // small noise
  std::vector<LatencyPoint> prefill{{512, 20000 + 35 * 512}, {2048, 20000 + 35 * 2048}};
  auto m = FitLatencyModel(decode, prefill, "test device");
  REQUIRE(m.ok());
  CHECK(m->decode_base_us() == Approx(6500).margin(1));
  CHECK(m->decode_us_per_kv_token() == Approx(0.9).epsilon(1e-3));
  CHECK(m->prefill_base_us() == Approx(20000).margin(1e-6));
  CHECK(m->prefill_us_per_token() == Approx(35));
  CHECK(m->fitted_on() == "test device");
  const std::string path = testing::ScratchDir("latency_fit") + "/model.textproto";
  REQUIRE(WriteFileAtomic(path, LatencyModelText(*m)).ok());
  auto loaded = LoadLatencyModel(path);
  REQUIRE(loaded.ok());
  CHECK((*loaded)->unit() == "us");
  CHECK((*loaded)->UniformDecodeStepDuration(1000, 1, 1) == Approx(6500 + 900).margin(2));

  // Constrained to non-negative coefficients (LoadLatencyModel's rule).
  std::vector<LatencyPoint> falling{{0, 10}, {100, 9}, {200, 8}};
  auto f = FitLatencyModel(falling, {}, "x");
  REQUIRE(f.ok());
  CHECK(f->decode_us_per_kv_token() == 0);
  CHECK(f->decode_base_us() == Approx(9));
  CHECK(f->description().find("prefill not measured") != std::string::npos);
  std::vector<LatencyPoint> steep{{100, 10}, {200, 30}};  // free fit has a < 0
  auto s = FitLatencyModel(steep, {}, "x");
  REQUIRE(s.ok());
  CHECK(s->decode_base_us() == 0);
  CHECK(s->decode_us_per_kv_token() > 0);
  // Errors.
  CHECK(!FitLatencyModel(std::vector<LatencyPoint>{{1, 1}}, {}, "x").ok());
  CHECK(!FitLatencyModel(std::vector<LatencyPoint>{{1, 1}, {1, 2}}, {}, "x").ok());
  CHECK(FitLatencyModel(std::vector<LatencyPoint>{{1, NAN}, {2, 2}}, {}, "x")
            .status()
            .message()
            .find("finite") != std::string::npos);
}

TEST_CASE("harness: NVML and lower bound", "[gpu_replay][harness]") {
  const NvmlReading r = ReadNvml(0);  // no driver here: a reason, no crash
  if (!r.ok) CHECK(!r.why.empty());
  CHECK(LowerBoundUs(2e9, 2000) == Approx(1000));
  CHECK(LowerBoundUs(1, 0) == 0);
}

}  // namespace kvsim::gpu_replay
