// gpu_replay/attention_ref.cc: the split-KV CPU reference against hand-checked cases, against a one-pass
// softmax at every partition, and against the simulator's own attention (sim/attention.h).

#include <catch2/catch.hpp>
#include <cmath>

#include "gpu_replay/kernels.h"
#include "sim/attention.h"

namespace kvsim::gpu_replay {
namespace {

AttentionProblem HandProblem() {
  // One KV head, two query heads (GQA group 2), head_dim 2, three keys.
  AttentionProblem p;
  p.dtype = Dtype::kF16;
  p.num_q_heads = 2;
  p.scale = 1.0f;
  const std::vector<int32_t> len{3};
  p.layout = MakeRaggedLayout(len, 1, 2, 1);
  auto f = [](float x) { return FromFloat(Dtype::kF16, x); };
  p.q = {f(0), f(0), f(1), f(0)};  // head 0: zero query (uniform); head 1: picks k.x
  // keys: (0,0), (ln 3 ~ 1.0986, 0), (0, 5); values (1,0), (0,1), (2,2)
  p.k = {f(0), f(0), f(std::log(3.0f)), f(0), f(0), f(5), 0, 0};
  p.v = {f(1), f(0), f(0), f(1), f(2), f(2), 0, 0};
  return p;
}

}  // namespace

TEST_CASE("attention ref: hand-checked GQA case", "[gpu_replay][attention]") {
  const AttentionProblem p = HandProblem();
  for (int target : {1, 2, 3}) {
    std::vector<float> out;
    RefDecodeAttention(p, PartitionSplitKv(p.layout.length, target, 1, 1), &out);
    // Head 0: uniform over three values -> (1, 1).
    CHECK(out[0] == Approx(1.0f).epsilon(1e-6));
    CHECK(out[1] == Approx(1.0f).epsilon(1e-6));
    // Head 1: logits 0, ln3 (fp16-rounded), 0 -> weights 1:3:1 / 5 -> (1/5 + 2/5, 3/5 + 2/5).
    const float e = std::exp(HalfToFloat(FloatToHalf(std::log(3.0f))));
    CHECK(out[2] == Approx((1 + 2) / (2 + e)).epsilon(1e-6));
    CHECK(out[3] == Approx((e + 2) / (2 + e)).epsilon(1e-6));
  }
}

TEST_CASE("attention ref: same result at every split, empty heads give zeros", "[gpu_replay][attention]") {
  const std::vector<int32_t> len{1, 0, 700, 3000, 64, 1500, 9, 257};
  for (Dtype dt : {Dtype::kF16, Dtype::kBF16}) {
    const AttentionProblem p = MakeAttentionProblem(dt, 32, len, 4, 64, 11);
    std::vector<float> one, many;
    RefDecodeAttention(p, PartitionSplitKv(len, 1, 1 << 20), &one);  // one item per head
    RefDecodeAttention(p, PartitionSplitKv(len, 200, 32), &many);
    CHECK(MaxRelError(many, one) < 1e-5);
    for (int g = 0; g < 4; ++g)
      for (int k = 0; k < 64; ++k) CHECK(one[(4 + g) * 64 + k] == 0.0f);  // KV head 1 is empty
  }
}

TEST_CASE("attention ref: matches the simulator's decode attention", "[gpu_replay][attention]") {
  // sim/attention.h ComputeDecodeReference on the same (16-bit-rounded) keys/values: one decode step at
  // position n sees keys [0, n].
  const int n = 299, d = 128;
  const std::vector<int32_t> len{n + 1};
  const AttentionProblem p = MakeAttentionProblem(Dtype::kBF16, 1, len, 0, d, 5);
  std::vector<float> q(d), keys(static_cast<size_t>(n + 1) * d), values(keys.size());
  for (int k = 0; k < d; ++k) q[k] = Bf16ToFloat(p.q[k]);
  for (size_t i = 0; i < keys.size(); ++i) {
    keys[i] = Bf16ToFloat(p.k[i]);
    values[i] = Bf16ToFloat(p.v[i]);
  }
  ModelInfo m;
  m.num_layers = 1, m.num_heads = 1, m.num_kv_heads = 1, m.head_dim = d;
  m.softmax_scale = 1.0 / std::sqrt(static_cast<double>(d));
  DecodeReference ref;
  ComputeDecodeReference(m, n, 1, q.data(), keys.data(), values.data(), &ref);
  std::vector<float> out;
  RefDecodeAttention(p, PartitionSplitKv(len, 4, 32), &out);
  CHECK(MaxRelError(out, std::vector<float>(ref.out(0), ref.out(0) + d)) < 1e-5);
}

TEST_CASE("MaxRelError is relative to the reference's largest magnitude", "[gpu_replay][attention]") {
  const std::vector<float> ref{2, -4, 1}, got{2.02f, -4, 1};
  CHECK(MaxRelError(got, ref) == Approx(0.005).epsilon(1e-3));
  CHECK(std::isinf(MaxRelError(std::vector<float>{NAN, 0, 0}, ref)));
}

}  // namespace kvsim::gpu_replay
