// CPU reference of one decoder step at model shapes (gpu_replay/kernels.h): RMSNorm, QKV GEMV (+ bias),
// RoPE, KV append into the ragged per-layer cache, decode attention, O projection, SwiGLU MLP, LM head.
// Rounding to the 16-bit dtype happens where the GPU stores 16-bit values: GEMV outputs, the normed
// activations, RoPE'd q/k, attention output, SwiGLU product. The residual stream and logits stay fp32.

#include <algorithm>
#include <cmath>

#include "gpu_replay/kernels.h"

namespace kvsim::gpu_replay {

int64_t ModelShape::weight_params() const {
  const int64_t per_layer = 2LL * hidden + static_cast<int64_t>(qkv_rows()) * hidden +
                            (qkv_bias ? qkv_rows() : 0) +
                            static_cast<int64_t>(hidden) * num_heads * head_dim + 3LL * intermediate * hidden;
  return per_layer * num_layers + hidden + static_cast<int64_t>(vocab) * hidden;
}

StatusOr<ModelShape> PresetShape(const std::string& name) {
  ModelShape s;
  s.name = name;
  if (name == "llava-1.5-7b") {  // Llama-2-7B / Vicuna-7B language model
    s.num_layers = 32, s.num_heads = 32, s.num_kv_heads = 32, s.head_dim = 128;
    s.hidden = 4096, s.intermediate = 11008, s.vocab = 32000, s.rope_theta = 10000, s.rms_eps = 1e-5f;
  } else if (name == "qwen2-7b") {
    s.num_layers = 28, s.num_heads = 28, s.num_kv_heads = 4, s.head_dim = 128;
    s.hidden = 3584, s.intermediate = 18944, s.vocab = 152064, s.qkv_bias = true, s.rope_theta = 1000000;
    s.rms_eps = 1e-6f;
  } else if (name == "tiny") {
    s.num_layers = 2, s.num_heads = 4, s.num_kv_heads = 2, s.head_dim = 64;
    s.hidden = 256, s.intermediate = 512, s.vocab = 1000, s.qkv_bias = true;
  } else {
    return Status::InvalidArgument("unknown model preset '" + name +
                                   "' (use llava-1.5-7b, qwen2-7b or tiny)");
  }
  return s;
}

uint64_t TensorSeed(uint64_t seed, int id) {
  return seed * 1000003ull + static_cast<uint64_t>(id) * 7919ull + 17;
}

float TensorScale(const ModelShape& s, int id) {
  if (id == kFinalNormId) return 0.1f;
  if (id == kLmHeadId) return std::sqrt(3.0f / s.hidden);
  if (id >= kInputId) return 1.0f;  // input and caches
  switch (id % kTensorsPerLayer) {
    case kAttnNorm:
    case kMlpNorm:
      return 0.1f;
    case kBqkv:
      return 0.1f;
    case kWqkv:
    case kWgateUp:
      return std::sqrt(3.0f / s.hidden);
    case kWo:
      return std::sqrt(3.0f / (s.num_heads * s.head_dim));
    case kWdown:
      return std::sqrt(3.0f / s.intermediate);
  }
  return 1.0f;
}

float TensorValue(const ModelShape& s, Dtype dtype, uint64_t seed, int id, int64_t i) {
  const float u = HashUniform(TensorSeed(seed, id), static_cast<uint64_t>(i)) * TensorScale(s, id);
  const bool norm =
      id == kFinalNormId ||
      (id < kInputId && (id % kTensorsPerLayer == kAttnNorm || id % kTensorsPerLayer == kMlpNorm));
  return RoundTo(dtype, norm ? 1.0f + u : u);
}

RaggedLayout DecoderLayerLayout(const DecoderProblem& p, int layer) {
  const int hkv = p.shape.num_kv_heads;
  std::span<const int32_t> lens(p.lengths.data() + static_cast<size_t>(layer) * hkv, hkv);
  return MakeRaggedLayout(lens, 1, p.shape.head_dim);
}

std::vector<float> RopeInvFreq(const ModelShape& s) {
  std::vector<float> f(s.head_dim / 2);
  for (int i = 0; i < s.head_dim / 2; ++i)
    f[i] = static_cast<float>(std::pow(s.rope_theta, -2.0 * i / s.head_dim));
  return f;
}

int64_t DecoderWeightBytes(const ModelShape& s) { return s.weight_params() * 2; }

int64_t DecoderKvBytes(const DecoderProblem& p) {
  int64_t tokens = 0;
  for (int32_t n : p.lengths) tokens += n + 1;
  return tokens * 2 * p.shape.head_dim * 2;
}

namespace {
std::vector<float> Materialise(const ModelShape& s, Dtype dt, uint64_t seed, int id, int64_t n) {
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = TensorValue(s, dt, seed, id, i);
  return out;
}
}  // namespace

RefDecoder::RefDecoder(const DecoderProblem& p) : p_(p) {
  const ModelShape& s = p.shape;
  KVSIM_CHECK(static_cast<int>(p.lengths.size()) == s.num_layers * s.num_kv_heads);
  for (int l = 0; l < s.num_layers; ++l) {
    Layer L;
    const int base = l * kTensorsPerLayer;
    L.attn_norm = Materialise(s, p.dtype, p.seed, base + kAttnNorm, s.hidden);
    L.wqkv = Materialise(s, p.dtype, p.seed, base + kWqkv, static_cast<int64_t>(s.qkv_rows()) * s.hidden);
    if (s.qkv_bias) L.bqkv = Materialise(s, p.dtype, p.seed, base + kBqkv, s.qkv_rows());
    L.wo = Materialise(s, p.dtype, p.seed, base + kWo,
                       static_cast<int64_t>(s.hidden) * s.num_heads * s.head_dim);
    L.mlp_norm = Materialise(s, p.dtype, p.seed, base + kMlpNorm, s.hidden);
    L.wgu = Materialise(s, p.dtype, p.seed, base + kWgateUp, 2LL * s.intermediate * s.hidden);
    L.wdown = Materialise(s, p.dtype, p.seed, base + kWdown, static_cast<int64_t>(s.hidden) * s.intermediate);
    L.layout = DecoderLayerLayout(p, l);
    const int64_t n = L.layout.total_slots * s.head_dim;
    L.k.assign(n, 0.0f);
    L.v.assign(n, 0.0f);
    for (int h = 0; h < s.num_kv_heads; ++h)
      for (int64_t i = L.layout.Element(h, 0); i < L.layout.Element(h, L.layout.length[h]); ++i) {
        L.k[i] = TensorValue(s, p.dtype, p.seed, kCacheKId + 2 * l, i);
        L.v[i] = TensorValue(s, p.dtype, p.seed, kCacheVId + 2 * l, i);
      }
    layers_.push_back(std::move(L));
  }
  final_norm_ = Materialise(s, p.dtype, p.seed, kFinalNormId, s.hidden);
  lm_head_ = Materialise(s, p.dtype, p.seed, kLmHeadId, static_cast<int64_t>(s.vocab) * s.hidden);
  input_ = Materialise(s, p.dtype, p.seed, kInputId, s.hidden);
}

void RefDecoder::Gemv(const std::vector<float>& w, const std::vector<float>& x, int rows, int cols,
                      float* y) const {
  for (int r = 0; r < rows; ++r) {
    const float* row = &w[static_cast<size_t>(r) * cols];
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int c = 0;
    for (; c + 8 <= cols; c += 8)
      for (int i = 0; i < 8; ++i) acc[i] += row[c + i] * x[c + i];
    for (; c < cols; ++c) acc[0] += row[c] * x[c];
    y[r] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  }
}

void RefDecoder::RmsNorm(const std::vector<float>& x, const std::vector<float>& w,
                         std::vector<float>* out) const {
  double ss = 0;
  for (float v : x) ss += static_cast<double>(v) * v;
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / x.size()) + p_.shape.rms_eps);
  out->resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) (*out)[i] = RoundTo(p_.dtype, x[i] * inv * w[i]);
}

void RefDecoder::Attention(Layer& L, const std::vector<float>& qkv, std::vector<float>* out,
                           bool append) const {
  const ModelShape& s = p_.shape;
  const int d = s.head_dim, group = s.num_heads / s.num_kv_heads;
  out->assign(static_cast<size_t>(s.num_heads) * d, 0.0f);
  std::vector<float> logits;
  for (int h = 0; h < s.num_kv_heads; ++h) {
    const int len = L.layout.length[h] + 1;  // the appended token included
    if (append) {
      const float* kn = &qkv[static_cast<size_t>(s.num_heads + h) * d];
      const float* vn = &qkv[static_cast<size_t>(s.num_heads + s.num_kv_heads + h) * d];
      std::copy_n(kn, d, &L.k[L.layout.Element(h, len - 1)]);
      std::copy_n(vn, d, &L.v[L.layout.Element(h, len - 1)]);
    }
    logits.resize(len);
    for (int g = 0; g < group; ++g) {
      const int qh = h * group + g;
      const float* q = &qkv[static_cast<size_t>(qh) * d];
      float mx = -INFINITY;
      for (int j = 0; j < len; ++j) {
        const float* kr = &L.k[L.layout.Element(h, j)];
        float dot = 0;
        for (int k = 0; k < d; ++k) dot += q[k] * kr[k];
        logits[j] = dot / std::sqrt(static_cast<float>(d));
        mx = std::max(mx, logits[j]);
      }
      float sum = 0;
      float* o = &(*out)[static_cast<size_t>(qh) * d];
      for (int j = 0; j < len; ++j) {
        const float e = std::exp(logits[j] - mx);
        sum += e;
        const float* vr = &L.v[L.layout.Element(h, j)];
        for (int k = 0; k < d; ++k) o[k] += e * vr[k];
      }
      for (int k = 0; k < d; ++k) o[k] = RoundTo(p_.dtype, o[k] / sum);
    }
  }
}

void RefDecoder::AttentionOnly() {
  const ModelShape& s = p_.shape;
  std::vector<float> qkv(s.qkv_rows(), 0.01f), out;
  for (Layer& L : layers_) Attention(L, qkv, &out, false);
}

void RefDecoder::Step(std::vector<float>* logits) {
  const ModelShape& s = p_.shape;
  const int d = s.head_dim, half = d / 2;
  std::vector<float> x = input_, xn, qkv(s.qkv_rows()), attn, tmp(std::max(s.hidden, 2 * s.intermediate)),
                     act(s.intermediate);
  const std::vector<float> inv_freq = RopeInvFreq(s);
  for (Layer& L : layers_) {
    RmsNorm(x, L.attn_norm, &xn);
    Gemv(L.wqkv, xn, s.qkv_rows(), s.hidden, qkv.data());
    for (int r = 0; r < s.qkv_rows(); ++r) {
      qkv[r] = RoundTo(p_.dtype, qkv[r]);  // the GEMV's 16-bit output
      if (s.qkv_bias) qkv[r] += L.bqkv[r];
    }
    for (int h = 0; h < s.num_heads + s.num_kv_heads; ++h) {  // RoPE on q and k heads
      float* v = &qkv[static_cast<size_t>(h) * d];
      for (int i = 0; i < half; ++i) {
        const float ang = static_cast<float>(p_.position) * inv_freq[i];
        const float c = std::cos(ang), sn = std::sin(ang), x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c - x2 * sn;
        v[i + half] = x2 * c + x1 * sn;
      }
    }
    for (float& v : qkv) v = RoundTo(p_.dtype, v);
    Attention(L, qkv, &attn, true);
    Gemv(L.wo, attn, s.hidden, s.num_heads * d, tmp.data());
    for (int i = 0; i < s.hidden; ++i) x[i] += RoundTo(p_.dtype, tmp[i]);
    RmsNorm(x, L.mlp_norm, &xn);
    Gemv(L.wgu, xn, 2 * s.intermediate, s.hidden, tmp.data());
    for (int i = 0; i < s.intermediate; ++i) {
      const float g = RoundTo(p_.dtype, tmp[i]), u = RoundTo(p_.dtype, tmp[s.intermediate + i]);
      act[i] = RoundTo(p_.dtype, g / (1.0f + std::exp(-g)) * u);
    }
    Gemv(L.wdown, act, s.hidden, s.intermediate, tmp.data());
    for (int i = 0; i < s.hidden; ++i) x[i] += RoundTo(p_.dtype, tmp[i]);
  }
  RmsNorm(x, final_norm_, &xn);
  logits->resize(s.vocab);
  Gemv(lm_head_, xn, s.vocab, s.hidden, logits->data());
}

void RefDecoderStep(const DecoderProblem& p, std::vector<float>* logits) {
  RefDecoder dec(p);
  dec.Step(logits);
}

}  // namespace kvsim::gpu_replay
