// gpu_replay's kernels on the host execution layer (gpu_replay/host_kernels.h): the .cuh device code
// compiled by the host compiler, launched with the same grids as the .cu files.

#include "gpu_replay/host_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "gpu_replay/attention_kernels.cuh"
#include "gpu_replay/copy_kernels.cuh"
#include "gpu_replay/decoder_kernels.cuh"
#include "gpu_replay/policy_kernels.cuh"

namespace kvsim::gpu_replay {

using namespace host;  // NOLINT: the device code's namespace in host builds

namespace {

// 16-bit host vectors <-> the kernels' storage types (same bits).
template <typename T>
std::vector<T> To(const std::vector<uint16_t>& v) {
  static_assert(sizeof(T) == 2);
  std::vector<T> out(v.size());
  if (!v.empty()) std::memcpy(out.data(), v.data(), v.size() * 2);
  return out;
}
template <typename T>
std::vector<uint16_t> Bits(const std::vector<T>& v) {
  std::vector<uint16_t> out(v.size());
  if (!v.empty()) std::memcpy(out.data(), v.data(), v.size() * 2);
  return out;
}
// Device buffers are never empty (cudaMalloc of at least one element in the .cu files).
template <typename T>
std::vector<T> Zeros(size_t n) {
  return std::vector<T>(std::max<size_t>(1, n), T{});
}

template <typename T>
Status Attention(const AttentionProblem& p, const SplitKvPartition& part, bool out_fp32,
                 std::vector<float>* out) {
  const int g = p.group(), d = p.layout.head_dim;
  std::vector<T> q = To<T>(p.q), k = To<T>(p.k), v = To<T>(p.v);
  std::vector<int4> items;
  for (const WorkItem& w : part.items) items.push_back(int4{w.kv_head, w.begin, w.end, 0});
  if (items.empty()) items.push_back(int4{0, 0, 0, 0});
  std::vector<float> partials = Zeros<float>(part.items.size() * g * (d + 2)),
                     out32 = Zeros<float>(static_cast<size_t>(p.num_q_heads) * d);
  std::vector<T> out16 = Zeros<T>(static_cast<size_t>(p.num_q_heads) * d);
  AttentionArgs a{p.dtype,
                  d,
                  g,
                  p.layout.num_kv_heads,
                  p.scale,
                  static_cast<int>(part.items.size()),
                  q.data(),
                  k.data(),
                  v.data(),
                  p.layout.offset.data(),
                  reinterpret_cast<const int32_t*>(items.data()),
                  part.head_first.data(),
                  partials.data(),
                  out_fp32 ? static_cast<void*>(out32.data()) : static_cast<void*>(out16.data()),
                  out_fp32};
  KVSIM_RETURN_IF_ERROR(LaunchDecodeAttentionKernels(a, nullptr));
  out->resize(static_cast<size_t>(p.num_q_heads) * d);
  for (size_t i = 0; i < out->size(); ++i) (*out)[i] = out_fp32 ? out32[i] : ToF(out16[i]);
  return Status::Ok();
}

// y[rows] = W[rows][cols] x, fp32 accumulation (cuBLAS with CUBLAS_COMPUTE_32F on the GPU).
template <typename T>
void HostGemv(const std::vector<T>& w, const std::vector<T>& x, int rows, int cols, T* y) {
  for (int r = 0; r < rows; ++r) {
    float acc = 0;
    for (int c = 0; c < cols; ++c) acc += ToF(w[static_cast<size_t>(r) * cols + c]) * ToF(x[c]);
    y[r] = FromF<T>(acc);
  }
}

template <typename T>
class HostDecoder {
 public:
  explicit HostDecoder(const DecoderProblem& p) : p_(p) {}

  Status Step(std::vector<float>* logits) {
    const ModelShape& s = p_.shape;
    std::vector<T> xn(s.hidden), qkv(s.qkv_rows()), q(static_cast<size_t>(s.num_heads) * s.head_dim),
        attn(q.size()), tmp(std::max(s.hidden, 2 * s.intermediate)), act(s.intermediate);
    std::vector<float> x(s.hidden);
    const std::vector<float> inv_freq = RopeInvFreq(s);
    std::vector<T> input;
    KVSIM_RETURN_IF_ERROR(Fill(&input, kInputId, s.hidden, false));
    KVSIM_RETURN_IF_ERROR(Launch(ToFloatKernel<T>, dim3((s.hidden + 255) / 256), dim3(256), nullptr,
                                 static_cast<const T*>(input.data()), x.data(), s.hidden));
    for (int l = 0; l < s.num_layers; ++l) {
      const int base = l * kTensorsPerLayer;
      std::vector<T> attn_norm, wqkv, bqkv, wo, mlp_norm, wgu, wdown, kc, vc;
      KVSIM_RETURN_IF_ERROR(Fill(&attn_norm, base + kAttnNorm, s.hidden, true));
      KVSIM_RETURN_IF_ERROR(Fill(&wqkv, base + kWqkv, static_cast<int64_t>(s.qkv_rows()) * s.hidden, false));
      if (s.qkv_bias) KVSIM_RETURN_IF_ERROR(Fill(&bqkv, base + kBqkv, s.qkv_rows(), false));
      KVSIM_RETURN_IF_ERROR(
          Fill(&wo, base + kWo, static_cast<int64_t>(s.hidden) * s.num_heads * s.head_dim, false));
      KVSIM_RETURN_IF_ERROR(Fill(&mlp_norm, base + kMlpNorm, s.hidden, true));
      KVSIM_RETURN_IF_ERROR(Fill(&wgu, base + kWgateUp, 2LL * s.intermediate * s.hidden, false));
      KVSIM_RETURN_IF_ERROR(
          Fill(&wdown, base + kWdown, static_cast<int64_t>(s.hidden) * s.intermediate, false));
      const RaggedLayout layout = DecoderLayerLayout(p_, l);
      KVSIM_RETURN_IF_ERROR(Fill(&kc, kCacheKId + 2 * l, layout.total_slots * s.head_dim, false));
      KVSIM_RETURN_IF_ERROR(Fill(&vc, kCacheVId + 2 * l, layout.total_slots * s.head_dim, false));

      KVSIM_RETURN_IF_ERROR(Launch(AddRmsNormKernel<T>, dim3(1), dim3(1024), nullptr, x.data(),
                                   l == 0 ? nullptr : static_cast<const T*>(tmp.data()),
                                   static_cast<const T*>(attn_norm.data()), xn.data(), s.hidden, s.rms_eps));
      HostGemv(wqkv, xn, s.qkv_rows(), s.hidden, qkv.data());
      KVSIM_RETURN_IF_ERROR(Launch(
          RopeAppendKernel<T>, dim3(s.num_heads + 2 * s.num_kv_heads), dim3(s.head_dim / 2), nullptr,
          static_cast<const T*>(qkv.data()), s.qkv_bias ? static_cast<const T*>(bqkv.data()) : nullptr,
          s.num_heads, s.num_kv_heads, s.head_dim, p_.position, static_cast<const float*>(inv_freq.data()),
          q.data(), kc.data(), vc.data(), layout.offset.data(), layout.length.data()));
      std::vector<int32_t> attend(layout.length);
      for (int32_t& n : attend) ++n;  // the appended token
      const SplitKvPartition part = PartitionSplitKv(attend, AttentionTargetItems(2), 32);
      std::vector<int4> items;
      for (const WorkItem& w : part.items) items.push_back(int4{w.kv_head, w.begin, w.end, 0});
      const int group = s.num_heads / s.num_kv_heads;
      std::vector<float> partials = Zeros<float>(part.items.size() * group * (s.head_dim + 2));
      const AttentionArgs a{p_.dtype,
                            s.head_dim,
                            group,
                            s.num_kv_heads,
                            1.0f / std::sqrt(static_cast<float>(s.head_dim)),
                            static_cast<int>(part.items.size()),
                            q.data(),
                            kc.data(),
                            vc.data(),
                            layout.offset.data(),
                            reinterpret_cast<const int32_t*>(items.data()),
                            part.head_first.data(),
                            partials.data(),
                            attn.data(),
                            false};
      KVSIM_RETURN_IF_ERROR(LaunchDecodeAttentionKernels(a, nullptr));
      HostGemv(wo, attn, s.hidden, s.num_heads * s.head_dim, tmp.data());
      KVSIM_RETURN_IF_ERROR(Launch(AddRmsNormKernel<T>, dim3(1), dim3(1024), nullptr, x.data(),
                                   static_cast<const T*>(tmp.data()), static_cast<const T*>(mlp_norm.data()),
                                   xn.data(), s.hidden, s.rms_eps));
      HostGemv(wgu, xn, 2 * s.intermediate, s.hidden, tmp.data());
      KVSIM_RETURN_IF_ERROR(Launch(SwiGluKernel<T>, dim3((s.intermediate + 255) / 256), dim3(256), nullptr,
                                   static_cast<const T*>(tmp.data()), s.intermediate, act.data()));
      HostGemv(wdown, act, s.hidden, s.intermediate, tmp.data());
    }
    std::vector<T> final_norm, lm_head;
    KVSIM_RETURN_IF_ERROR(Fill(&final_norm, kFinalNormId, s.hidden, true));
    KVSIM_RETURN_IF_ERROR(Fill(&lm_head, kLmHeadId, static_cast<int64_t>(s.vocab) * s.hidden, false));
    KVSIM_RETURN_IF_ERROR(Launch(AddRmsNormKernel<T>, dim3(1), dim3(1024), nullptr, x.data(),
                                 static_cast<const T*>(tmp.data()), static_cast<const T*>(final_norm.data()),
                                 xn.data(), s.hidden, s.rms_eps));
    logits->assign(s.vocab, 0.0f);
    for (int r = 0; r < s.vocab; ++r) {  // LM head: fp32 logits
      float acc = 0;
      for (int c = 0; c < s.hidden; ++c)
        acc += ToF(lm_head[static_cast<size_t>(r) * s.hidden + c]) * ToF(xn[c]);
      (*logits)[r] = acc;
    }
    return Status::Ok();
  }

  Status Fill(std::vector<T>* b, int id, int64_t n, bool norm) {
    b->assign(std::max<int64_t>(1, n), T{});
    return Launch(FillKernel<T>, dim3(8), dim3(256), nullptr, b->data(), n, TensorSeed(p_.seed, id),
                  TensorScale(p_.shape, id), norm);
  }

 private:
  DecoderProblem p_;
};

}  // namespace

Status HostDecodeAttention(const AttentionProblem& p, const SplitKvPartition& part, std::vector<float>* out,
                           bool out_fp32) {
  return p.dtype == Dtype::kF16 ? Attention<F16>(p, part, out_fp32, out)
                                : Attention<BF16>(p, part, out_fp32, out);
}

Status HostWindowScores(const WindowScoreProblem& p, std::vector<float>* scores) {
  auto run = [&](auto tag) -> Status {
    using T = decltype(tag);
    const std::vector<T> q = To<T>(p.q), k = To<T>(p.k);
    std::vector<float> lse = Zeros<float>(static_cast<size_t>(p.num_q_heads) * p.window),
                       part = Zeros<float>(WindowLsePartSize(p.num_q_heads, p.num_keys, p.window));
    scores->assign(static_cast<size_t>(p.num_kv_heads) * p.num_keys, 0.0f);
    const WindowArgs a{p.dtype, p.head_dim, p.num_q_heads, p.num_kv_heads, p.num_keys,  p.window,
                       p.scale, q.data(),   k.data(),      lse.data(),     part.data(), scores->data()};
    return LaunchWindowScores(a, nullptr);
  };
  return p.dtype == Dtype::kF16 ? run(F16{}) : run(BF16{});
}

Status HostTopKCompact(const TopKProblem& p, TopKResult* out) {
  auto run = [&](auto tag) -> Status {
    using T = decltype(tag);
    out->dst = TopKDestinationLayout(p);
    int max_len = 0;
    for (int32_t n : out->dst.length) max_len = std::max(max_len, n);
    std::vector<float> scores = p.scores;
    if (scores.empty()) scores.push_back(0);
    std::vector<int32_t> selected(std::max<int64_t>(1, out->dst.total_slots), -1);
    const std::vector<T> k = To<T>(p.k), v = To<T>(p.v);
    const size_t n = static_cast<size_t>(out->dst.total_slots) * p.src.head_dim;
    std::vector<T> ko = Zeros<T>(n), vo = Zeros<T>(n);
    const TopKArgs a{p.dtype,
                     p.src.head_dim,
                     p.src.num_kv_heads,
                     max_len,
                     scores.data(),
                     p.src.offset.data(),
                     p.src.length.data(),
                     out->dst.offset.data(),
                     out->dst.length.data(),
                     selected.data(),
                     k.data(),
                     v.data(),
                     ko.data(),
                     vo.data()};
    KVSIM_RETURN_IF_ERROR(LaunchTopKCompact(a, nullptr));
    selected.resize(out->dst.total_slots);
    ko.resize(n);
    vo.resize(n);
    out->selected = selected;
    out->k = Bits(ko);
    out->v = Bits(vo);
    return Status::Ok();
  };
  return p.dtype == Dtype::kF16 ? run(F16{}) : run(BF16{});
}

Status HostMergeNearest(const MergeProblem& p, MergeResult* out) {
  auto run = [&](auto tag) -> Status {
    using T = decltype(tag);
    const int num_e = p.evicted_first.back();
    const int64_t slots = p.layout.total_slots;
    const int d = p.layout.head_dim;
    int max_e = 0;
    for (int h = 0; h < p.layout.num_kv_heads; ++h)
      max_e = std::max(max_e, p.evicted_first[h + 1] - p.evicted_first[h]);
    std::vector<T> k = To<T>(p.k), v = To<T>(p.v), ek = To<T>(p.ek), ev = To<T>(p.ev);
    if (k.empty()) k.push_back(T{}), v.push_back(T{});
    if (ek.empty()) ek.push_back(T{}), ev.push_back(T{});
    std::vector<float> knorm = Zeros<float>(slots), sim = Zeros<float>(num_e), ksum = Zeros<float>(slots * d),
                       vsum = Zeros<float>(slots * d);
    std::vector<int32_t> nearest = Zeros<int32_t>(num_e), count = Zeros<int32_t>(slots);
    const MergeArgs a{p.dtype,
                      d,
                      num_e,
                      slots,
                      k.data(),
                      v.data(),
                      p.layout.num_kv_heads,
                      max_e,
                      ek.data(),
                      ev.data(),
                      p.evicted_first.data(),
                      p.layout.offset.data(),
                      p.layout.length.data(),
                      knorm.data(),
                      nearest.data(),
                      sim.data(),
                      count.data(),
                      ksum.data(),
                      vsum.data()};
    KVSIM_RETURN_IF_ERROR(LaunchMergeNearest(a, nullptr));
    out->nearest.assign(nearest.begin(), nearest.begin() + num_e);
    out->similarity.assign(sim.begin(), sim.begin() + num_e);
    out->count.assign(count.begin(), count.begin() + slots);
    k.resize(p.k.size());
    v.resize(p.v.size());
    out->k = Bits(k);
    out->v = Bits(v);
    return Status::Ok();
  };
  return p.dtype == Dtype::kF16 ? run(F16{}) : run(BF16{});
}

Status HostDecoderStep(const DecoderProblem& p, std::vector<float>* logits) {
  if (p.dtype == Dtype::kF16) return HostDecoder<F16>(p).Step(logits);
  return HostDecoder<BF16>(p).Step(logits);
}

Status HostFillTensor(const DecoderProblem& p, int id, int64_t n, std::vector<uint16_t>* out) {
  auto run = [&](auto tag) -> Status {
    using T = decltype(tag);
    std::vector<T> b;
    KVSIM_RETURN_IF_ERROR(HostDecoder<T>(p).Fill(
        &b, id, n,
        id == kFinalNormId ||
            (id < kInputId && (id % kTensorsPerLayer == kAttnNorm || id % kTensorsPerLayer == kMlpNorm))));
    *out = Bits(b);
    out->resize(n);
    return Status::Ok();
  };
  return p.dtype == Dtype::kF16 ? run(F16{}) : run(BF16{});
}

Status HostCopy(const std::vector<int32_t>& src, std::vector<int32_t>* dst, int grid, int block) {
  KVSIM_CHECK(src.size() % 4 == 0);
  const size_t n = src.size() / 4;
  std::vector<int4> a(std::max<size_t>(1, n)), b(a.size(), int4{0, 0, 0, 0});
  if (n) std::memcpy(a.data(), src.data(), n * sizeof(int4));
  KVSIM_RETURN_IF_ERROR(Launch(CopyKernel<int4>, dim3(grid), dim3(block), nullptr,
                               static_cast<const int4*>(a.data()), b.data(), n));
  dst->resize(src.size());
  if (n) std::memcpy(dst->data(), b.data(), n * sizeof(int4));
  return Status::Ok();
}

Status HostReadXor(const std::vector<int32_t>& src, int* xor_out, int grid, int block) {
  KVSIM_CHECK(src.size() % 4 == 0);
  const size_t n = src.size() / 4;
  std::vector<int4> a(std::max<size_t>(1, n));
  if (n) std::memcpy(a.data(), src.data(), n * sizeof(int4));
  int sink = 0;
  KVSIM_RETURN_IF_ERROR(
      Launch(ReadKernel<>, dim3(grid), dim3(block), nullptr, static_cast<const int4*>(a.data()), n, &sink));
  *xor_out = sink;
  return Status::Ok();
}

}  // namespace kvsim::gpu_replay
