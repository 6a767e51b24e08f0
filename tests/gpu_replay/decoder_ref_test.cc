// gpu_replay/decoder_ref.cc: model presets, weight generation, and properties of the reference decoder step.

#include <catch2/catch.hpp>
#include <cmath>

#include "gpu_replay/kernels.h"

namespace kvsim::gpu_replay {

TEST_CASE("decoder ref: preset shapes match the published models", "[gpu_replay][decoder]") {
  auto llava = PresetShape("llava-1.5-7b");
  REQUIRE(llava.ok());
  CHECK(llava->num_layers == 32);
  CHECK(llava->qkv_rows() == 3 * 4096);
  // Llama-2-7B: 6.74e9 parameters, of which the 32000 x 4096 input embedding is not read by a decode step.
  CHECK(llava->weight_params() + 32000LL * 4096 == Approx(6.738e9).epsilon(2e-3));
  auto qwen = PresetShape("qwen2-7b");
  REQUIRE(qwen.ok());
  CHECK(qwen->num_kv_heads == 4);
  CHECK(qwen->qkv_rows() == (28 + 8) * 128);
  // Qwen2-7B: 7.62e9 parameters including a 152064 x 3584 embedding.
  CHECK(qwen->weight_params() + 152064LL * 3584 == Approx(7.616e9).epsilon(2e-3));
  CHECK(!PresetShape("gpt-5").ok());
  CHECK(PresetShape("gpt-5").status().message().find("llava-1.5-7b") != std::string::npos);
}

TEST_CASE("decoder ref: deterministic, finite, sensitive to the cache", "[gpu_replay][decoder]") {
  auto tiny = PresetShape("tiny");
  REQUIRE(tiny.ok());
  DecoderProblem p;
  p.shape = *tiny;
  p.dtype = Dtype::kF16;
  p.lengths = {10, 3, 0, 40};  // 2 layers x 2 KV heads, ragged
  p.position = 57;
  std::vector<float> a, b;
  RefDecoderStep(p, &a);
  RefDecoderStep(p, &b);
  REQUIRE(a.size() == 1000);
  CHECK(a == b);
  for (float x : a) REQUIRE(std::isfinite(x));
  double norm = 0;
  for (float x : a) norm += x * x;
  CHECK(norm > 1.0);  // unit-scale activations give O(1) logits, not zeros
  p.lengths[0] = 11;  // one more cached token changes the step
  RefDecoderStep(p, &b);
  CHECK(a != b);
  // bf16 and fp16 runs of the same random model agree to bf16 precision.
  p.lengths[0] = 10;
  p.dtype = Dtype::kBF16;
  RefDecoderStep(p, &b);
  CHECK(MaxRelError(b, a) < 0.1);
  CHECK(DecoderKvBytes(p) == (11 + 4 + 1 + 41) * 2 * 64 * 2);
  CHECK(DecoderLayerLayout(p, 1).length == std::vector<int32_t>{0, 40});
  CHECK(DecoderLayerLayout(p, 1).capacity == std::vector<int32_t>{1, 41});
}

TEST_CASE("decoder ref: tensor values are the documented distributions", "[gpu_replay][decoder]") {
  auto s = PresetShape("tiny");
  REQUIRE(s.ok());
  for (int i = 0; i < 100; ++i) {
    const float norm = TensorValue(*s, Dtype::kF16, 1, kAttnNorm, i);
    CHECK(std::abs(norm - 1.0f) <= 0.1f + 1e-3f);
    const float w = TensorValue(*s, Dtype::kF16, 1, kWqkv, i);
    CHECK(std::abs(w) <= std::sqrt(3.0f / 256) + 1e-3f);
    CHECK(w == RoundTo(Dtype::kF16, w));
  }
  CHECK(TensorValue(*s, Dtype::kF16, 1, kWo, 5) != TensorValue(*s, Dtype::kF16, 2, kWo, 5));
}

}  // namespace kvsim::gpu_replay
