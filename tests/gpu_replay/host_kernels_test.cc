// Every gpu_replay CUDA kernel run on the CPU by the host execution layer (gpu_replay/host_kernels.h: the
// same .cuh source and launch sequences as the .cu files) against its CPU reference (gpu_replay/kernels.h):
// ragged per-head lengths including 0 and 1, GQA groups 1/2/4/7/8, head_dim 64/128, fp16 and bf16. A launch
// with a shared-memory race, a divergent barrier or a deadlock fails the test (the layer's checks are on).

#include "gpu_replay/host_kernels.h"

#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "gpu_replay/host_exec.h"
#include "tests/gpu_replay/merge_problems.h"

namespace kvsim::gpu_replay {
namespace {

// The host layer computes in fp32 like the reference; only the summation order differs (expf is exact on
// the host, __expf approximate on the GPU: the GPU tests' bounds are 1e-2 bf16 / 2e-3 fp16).
constexpr double kFp32Tol = 1e-4;
double Tol16(Dtype dt) { return dt == Dtype::kBF16 ? 1e-2 : 2e-3; }

std::vector<float> Floats(Dtype dt, const std::vector<uint16_t>& v) {
  std::vector<float> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = ToFloat(dt, v[i]);
  return o;
}

void RequireOk(const Status& st) {
  INFO(st.message());
  REQUIRE(st.ok());
}

}  // namespace

TEST_CASE("host kernels: decode attention matches the CPU reference", "[gpu_replay][host_exec]") {
  const std::vector<int32_t> len{1, 0, 70, 150, 5, 33};
  hx::CurrentStats() = {};
  for (Dtype dt : {Dtype::kF16, Dtype::kBF16})
    for (int d : {64, 128})
      for (int g : {1, 2, 4, 7, 8}) {
        INFO(DtypeName(dt) << " d " << d << " group " << g);
        const AttentionProblem p = MakeAttentionProblem(dt, 6 * g, len, 2, d, 3);
        // target 1: one item per non-empty head; 64 (min chunk 32): heads cut into several items.
        for (int target : {1, 64}) {
          const SplitKvPartition part = PartitionSplitKv(len, target, 32);
          std::vector<float> ref, host;
          RefDecodeAttention(p, part, &ref);
          RequireOk(HostDecodeAttention(p, part, &host));
          CHECK(MaxRelError(host, ref) <= kFp32Tol);
        }
        if (g == 2) {  // 16-bit output (the decoder's path)
          const SplitKvPartition part = PartitionSplitKv(len, 64, 32);
          std::vector<float> ref, host;
          RefDecodeAttention(p, part, &ref);
          RequireOk(HostDecodeAttention(p, part, &host, false));
          CHECK(MaxRelError(host, ref) <= Tol16(dt));
        }
      }
  const hx::Stats st = hx::CurrentStats();  // the checks really ran
  CHECK(st.shared_accesses > 0);
  CHECK(st.barriers > 0);
  CHECK(st.warp_collectives > 0);
}

TEST_CASE("host kernels: decode attention of a single empty or one-token head", "[gpu_replay][host_exec]") {
  for (const std::vector<int32_t>& len : {std::vector<int32_t>{0}, std::vector<int32_t>{1}}) {
    const AttentionProblem p = MakeAttentionProblem(Dtype::kF16, 4, len, 1, 64, 9);
    const SplitKvPartition part = PartitionSplitKv(len, 8, 32);
    std::vector<float> ref, host;
    RefDecodeAttention(p, part, &ref);
    RequireOk(HostDecodeAttention(p, part, &host));
    CHECK(MaxRelError(host, ref) <= kFp32Tol);
  }
}

TEST_CASE("host kernels: window scores match the CPU reference", "[gpu_replay][host_exec]") {
  for (Dtype dt : {Dtype::kF16, Dtype::kBF16})
    for (int d : {64, 128})
      for (auto [hq, hkv] :
           {std::pair{2, 2}, std::pair{4, 2}, std::pair{8, 2}, std::pair{7, 1}, std::pair{8, 1}}) {
        INFO(DtypeName(dt) << " d " << d << " heads " << hq << "/" << hkv);
        const WindowScoreProblem p = MakeWindowScoreProblem(dt, hq, hkv, d, 70, 6, 4);
        std::vector<float> ref, host;
        RefWindowScores(p, &ref);
        RequireOk(HostWindowScores(p, &host));
        CHECK(MaxRelError(host, ref) <= kFp32Tol);
      }
  // A window as long as the prompt, a one-key prompt.
  for (auto [n, w] : {std::pair{9, 9}, std::pair{1, 1}}) {
    const WindowScoreProblem p = MakeWindowScoreProblem(Dtype::kBF16, 4, 2, 64, n, w, 5);
    std::vector<float> ref, host;
    RefWindowScores(p, &ref);
    RequireOk(HostWindowScores(p, &host));
    CHECK(MaxRelError(host, ref) <= kFp32Tol);
  }
}

TEST_CASE("host kernels: top-k selection and compaction match the CPU reference exactly",
          "[gpu_replay][host_exec]") {
  const std::vector<int32_t> len{600, 0, 17, 1, 80, 1}, keep{100, 5, 17, 1, 0, 0};
  for (Dtype dt : {Dtype::kF16, Dtype::kBF16})
    for (int d : {64, 128}) {
      INFO(DtypeName(dt) << " d " << d);
      TopKProblem p = MakeTopKProblem(dt, len, keep, 3, d, 5);
      TopKResult ref, host;
      RefTopKCompact(p, &ref);
      RequireOk(HostTopKCompact(p, &host));
      CHECK(host.selected == ref.selected);
      CHECK(host.k == ref.k);
      CHECK(host.v == ref.v);
      // All scores tied: the lowest slots win.
      std::fill(p.scores.begin(), p.scores.end(), 0.5f);
      RefTopKCompact(p, &ref);
      RequireOk(HostTopKCompact(p, &host));
      CHECK(host.selected == ref.selected);
    }
}

namespace {

void CheckMerge(const MergeProblem& p, Dtype dt) {
  MergeResult ref, host;
  RefMergeNearest(p, &ref);
  RequireOk(HostMergeNearest(p, &host));
  REQUIRE(host.nearest.size() == ref.nearest.size());
  for (size_t e = 0; e < ref.similarity.size(); ++e)
    CHECK(host.similarity[e] == Approx(ref.similarity[e]).margin(1e-5));
  CHECK(host.nearest == ref.nearest);
  CHECK(host.count == ref.count);
  CHECK(MaxRelError(Floats(dt, host.k), Floats(dt, ref.k)) <= Tol16(dt));
  CHECK(MaxRelError(Floats(dt, host.v), Floats(dt, ref.v)) <= Tol16(dt));
}

}  // namespace

// Ragged heads: 40 kept (a full and a partial 32-key chunk) with 100 evicted (a full and a partial block of
// 64, warps with no rows), 3 / 0 / 1 kept, a head with no evicted key, 33 kept (one key in the second chunk)
// with 70 evicted.
TEST_CASE("host kernels: nearest-slot merge (tensor-core GEMM + argmax) matches the CPU reference",
          "[gpu_replay][host_exec]") {
  const std::vector<int32_t> kept{40, 3, 0, 1, 17, 33}, evicted{100, 9, 4, 5, 0, 70};
  hx::CurrentStats() = {};
  for (Dtype dt : {Dtype::kF16, Dtype::kBF16})
    for (int d : {64, 128}) {
      INFO(DtypeName(dt) << " d " << d);
      std::vector<int32_t> want;
      const MergeProblem sep = SeparatedMergeProblem(dt, kept, evicted, d, 6, &want);
      MergeResult ref;
      RefMergeNearest(sep, &ref);
      REQUIRE(ref.nearest == want);  // the construction is unambiguous for the reference too
      CheckMerge(sep, dt);
      // Random keys (cosines near each other): the host's dot products are the reference's (fp32, k in
      // order), so the nearest slots agree here as well.
      CheckMerge(MakeMergeProblem(dt, kept, evicted, d, 6), dt);
    }
  CHECK(hx::CurrentStats().warp_collectives > 0);  // the WMMA collectives ran
}

// Exact cosine ties (a key and twice the key; two identical keys), within a chunk and across chunks: the
// lowest slot wins, as RefMergeNearest's strict `>` defines it.
TEST_CASE("host kernels: nearest-slot merge breaks exact cosine ties to the lowest slot",
          "[gpu_replay][host_exec]") {
  for (Dtype dt : {Dtype::kF16, Dtype::kBF16})
    for (int d : {64, 128}) {
      INFO(DtypeName(dt) << " d " << d);
      const std::vector<int32_t> kept{37}, evicted{6};
      MergeProblem p = MakeMergeProblem(dt, kept, evicted, d, 11);
      auto at = [&](int slot, int c) -> uint16_t& { return p.k[p.layout.Element(0, slot) + c]; };
      for (int c = 0; c < d; ++c) {
        at(3, c) = FromFloat(dt, 2.0f * ToFloat(dt, at(30, c)));  // slot 3 = 2 x slot 30: the same cosine
        at(33, c) = at(5, c);                                     // slot 33 = slot 5
      }
      for (int e = 0; e < 6; ++e)
        for (int c = 0; c < d; ++c) {
          const size_t i = static_cast<size_t>(e) * d + c;
          p.ek[i] = FromFloat(dt, ToFloat(dt, at(e < 3 ? 30 : 5, c)) + 0.05f * HashUniform(12, i));
        }
      MergeResult ref, host;
      RefMergeNearest(p, &ref);
      CHECK(ref.nearest == std::vector<int32_t>{3, 3, 3, 5, 5, 5});
      RequireOk(HostMergeNearest(p, &host));
      CHECK(host.nearest == ref.nearest);
      CHECK(host.count == ref.count);
      CHECK(MaxRelError(Floats(dt, host.k), Floats(dt, ref.k)) <= Tol16(dt));
    }
}

TEST_CASE(
    "host kernels: decoder step (fill, add+RMSNorm, RoPE+append, attention, SwiGLU) matches the CPU "
    "reference",
    "[gpu_replay][host_exec]") {
  for (Dtype dt : {Dtype::kF16, Dtype::kBF16}) {
    INFO(DtypeName(dt));
    auto s = PresetShape("tiny");
    REQUIRE(s.ok());
    DecoderProblem p;
    p.shape = *s;
    p.dtype = dt;
    p.lengths = {10, 1, 0, 90};
    p.position = 777;
    std::vector<float> ref, host;
    RefDecoderStep(p, &ref);
    RequireOk(HostDecoderStep(p, &host));
    CHECK(MaxRelError(host, ref) <= Tol16(dt));
    // GQA 8, head_dim 128 (a one-layer toy shape; the tiny preset is GQA 2, d 64).
    DecoderProblem g8 = p;
    g8.shape.name = "g8";
    g8.shape.num_layers = 1, g8.shape.num_heads = 8, g8.shape.num_kv_heads = 1, g8.shape.head_dim = 128;
    g8.shape.hidden = 128, g8.shape.intermediate = 192, g8.shape.vocab = 64, g8.shape.qkv_bias = false;
    g8.lengths = {33};
    RefDecoderStep(g8, &ref);
    RequireOk(HostDecoderStep(g8, &host));
    CHECK(MaxRelError(host, ref) <= Tol16(dt));
    // FillKernel generates exactly the reference's 16-bit values.
    for (int id : {static_cast<int>(kWqkv), static_cast<int>(kAttnNorm), kFinalNormId, kCacheKId}) {
      std::vector<uint16_t> bits;
      RequireOk(HostFillTensor(p, id, 3000, &bits));
      for (int64_t i = 0; i < 3000; ++i)
        REQUIRE(ToFloat(dt, bits[i]) == TensorValue(p.shape, dt, p.seed, id, i));
    }
  }
}

TEST_CASE("host kernels: the bandwidth kernels copy and read everything", "[gpu_replay][host_exec]") {
  std::vector<int32_t> src(4 * 1000), dst;
  int want = 0;
  for (size_t i = 0; i < src.size(); ++i) {
    src[i] = static_cast<int32_t>(i * 2654435761u);
    want ^= src[i];
  }
  RequireOk(HostCopy(src, &dst, 3, 64));
  CHECK(dst == src);
  int got = -1;
  RequireOk(HostReadXor(src, &got, 3, 64));
  CHECK(got == want);
}

}  // namespace kvsim::gpu_replay
