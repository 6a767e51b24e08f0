#pragma once
// Exact attention recomputed from stored post-RoPE Q and K (fp32, BLAS for the dense products).
// Everything here works on one (layer, head) at a time; keys/values rows are token positions.

#include <cstdint>
#include <span>
#include <vector>

#include "sim/select.h"
#include "sim/trace.h"

namespace kvsim {

// Maps a raw dot product q.k to the logit the model uses: scale, then optional soft-cap.
struct LogitTransform {
  float scale = 1.0f;
  float softcap = 0.0f;  // 0 = none
  explicit LogitTransform(const ModelInfo& m)
      : scale(static_cast<float>(m.softmax_scale)), softcap(static_cast<float>(m.logit_softcap)) {}
  LogitTransform(float s, float c) : scale(s), softcap(c) {}
  float operator()(float dot) const;
};

// Keys visible to a query at absolute position `pos` (causal, optional sliding window): [first, pos].
inline int FirstVisibleKey(const ModelInfo& m, int pos) {
  return m.sliding_window > 0 && pos - m.sliding_window + 1 > 0 ? pos - m.sliding_window + 1 : 0;
}

// Full-cache decode attention for one query head: every decode step's query over all keys so far.
struct DecodeReference {
  int num_steps = 0;
  int num_keys = 0;  // T = prefill_length + num_decode_steps; row t sees keys [first, n + t]
  int head_dim = 0;
  std::vector<float> probs;    // [num_steps][num_keys], zero outside the visible range
  std::vector<float> log_z;    // [num_steps] log-sum-exp of the logits (for slots with new keys)
  std::vector<float> output;   // [num_steps][head_dim] o_t = Σ_j p_tj v_j
  std::vector<int32_t> first;  // [num_steps] first visible key
  // When ComputeDecodeReference was given the keys' modalities: [t] whether row t's sums below are exact
  // (ExactKindSums, sim/select.h: every nonzero value >= 2^L), and [t] the row's visible values summed by
  // modality and in all (its S[n]), each bit-identical to the sequential sums in key order, with its
  // extreme bit patterns (for TopKSums::AddRow); taken right after the row's softmax, while it is in the
  // cache. Empty without modalities.
  std::vector<uint8_t> exact;
  std::vector<RowSums> sums;
  const float* row(int t) const { return probs.data() + static_cast<size_t>(t) * num_keys; }
  const float* out(int t) const { return output.data() + static_cast<size_t>(t) * head_dim; }
  int last(int t) const { return num_keys - num_steps + t; }  // last visible key (the token itself)
};

// q_decode: [num_steps][d] queries of the decode tokens; keys/values: [T][d]; modality: [T] or null (then
// out->exact and out->sums are left empty).
void ComputeDecodeReference(const ModelInfo& m, int prefill_length, int num_steps, const float* q_decode,
                            const float* keys, const float* values, DecodeReference* out,
                            const Modality* modality = nullptr);

// Adds Σ_i softmax_i[j] into col_sums[j] for the given queries (absolute positions q_pos[i], ascending)
// over keys [0, key_limit): each row's softmax is over its causal/window-visible keys restricted to
// [0, key_limit) (so a query-agnostic scorer can leave the question out of the keys). Rows whose position
// is >= key_limit still see only keys < key_limit. Works in blocks; never materialises the full matrix.
void AccumulateColumnSums(const ModelInfo& m, const float* queries, const int32_t* q_pos, int num_queries,
                          const float* keys, int key_limit, float* col_sums);

// q . k with 8 independent partial sums (vectorises without -ffast-math; fixed order, so deterministic).
inline float Dot(const float* a, const float* b, int d) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int k = 0;
  for (; k + 8 <= d; k += 8)
    for (int i = 0; i < 8; ++i) acc[i] += a[k + i] * b[k + i];
  for (; k < d; ++k) acc[k & 7] += a[k] * b[k];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// out[k] = Σ_i p[tok[i]] v_{tok[i]}[k], k < d, over the slots i = 0 .. n-1 in that order: the value of
// `out` zeroed, then `out[k] += p[tok] * v[k]` slot by slot (the same multiply-add per element, contracted to
// one fused multiply-add where the build has FMA, in the same slot order: bit-identical), with the row kept
// in registers across the slots instead of loaded and stored per slot. values: [*][d]; out: [d].
// AVX-512 is used where the CPU has it and the build has FMA (the build's AVX2 + FMA otherwise; the same
// bits).
void GatherWeightedRows(const float* p, const int32_t* tok, size_t n, const float* values, int d, float* out);
// Test hook: false keeps GatherWeightedRows off its AVX-512 code (true: allowed again where the CPU has it).
void SetGatherAvx512ForTesting(bool allowed);
// GatherWeightedRows of kGatherSteps steps whose slot lists tok[s][0 .. n[s]) all begin with the same
// `common` slots (tok[s][i] == tok[0][i] for i < common ≤ n[s]): out[s] gets exactly GatherWeightedRows(p[s],
// tok[s], n[s], values, d, out[s])'s bits (each element the same fused multiply-adds in the same slot order),
// but each shared slot's value row is loaded once for all the steps instead of once per step (a run whose
// cache is rewritten at step 0 and then only appends: MEDA's official code; issue 14, round 11).
inline constexpr int kGatherSteps = 4;
void GatherWeightedRowsSteps(const float* const* p, const int32_t* const* tok, const size_t* n, size_t common,
                             const float* values, int d, float* const* out);

// Softmax of one row of logits in place, numerically stable; returns log-sum-exp.
float SoftmaxInPlace(float* x, int n);

// Entropy -Σ p log p (nats) of softmax(logits), without materialising the probabilities.
float SoftmaxEntropy(const float* logits, int n);

// Gemma-style logit soft-cap in place: x = cap * tanh(x / cap); cap <= 0 leaves x unchanged.
void SoftCap(float* x, int n, float cap);

// Prompt attention entropies (MEDA, policies/meda.cc; recorded in traces as
// aggregates/layer_XXX/prompt_entropies, docs/trace-format.md). Computed in row blocks of one GEMM each;
// the sums run in a fixed order, so results do not depend on the thread count.
// Mean over the rows of q ([rows][d]) of the entropy of softmax_j(tf(q_i . k_j)) over keys [cols][d]
// (no mask). 0 when rows or cols is 0.
double MeanRowEntropy(const LogitTransform& tf, const float* q, int rows, const float* k, int cols, int d);

// Mean over rows i in [0, n) of the entropy of the causal self-attention row i (keys
// [FirstVisibleKey(i), i]); q and k are [n][d] at positions 0..n-1.
double MeanCausalRowEntropy(const ModelInfo& m, const float* q, const float* k, int n);

// Mean over rows i in [0, rows) of the entropy of the head-averaged attention row
// (1/H) Σ_h softmax(tf(q_h[i] . k_h[j])), H = q.size(); q[h]: [rows][d], k[h]: [cols][d]. causal: rows and
// cols are positions 0..rows-1 and row i sees keys [FirstVisibleKey(i), i]; else every row sees every key.
double MeanRowEntropyOfHeadMean(const ModelInfo& m, std::span<const float* const> q,
                                std::span<const float* const> k, int rows, int cols, bool causal,
                                int threads);

// The per-head prompt entropies over the compressible prompt [0, ce) that MEDA's MEAN_OF_HEAD_ENTROPIES
// modes average over heads, in this order:
//   kSelfEntropy         MeanCausalRowEntropy of the causal self-attention (FULL_SELF);
//   kTextToVisualEntropy MeanRowEntropy of the text-like queries over the visual keys (CROSS_MODAL's -E_TV);
//   kVisualToTextEntropy MeanRowEntropy of the visual queries over the text-like keys (-E_VT).
// Visual = image and video tokens, text-like = every other token of [0, ce).
// (PromptEntropyKind and kNumPromptEntropyKinds: sim/trace.h.)
// q: this head's queries of positions [0, ce) ([ce][d]); k: its KV head's keys, row = position (>= ce rows);
// modality: of positions [0, ce). Fills out[kSelfEntropy] when `self`, the two cross-modal entries when
// `cross` (the others are set to 0). The one implementation MEDA and the trace writers (kvsim synth) use,
// so a recorded value is bit-identical to a computed one.
void HeadPromptEntropies(const ModelInfo& m, std::span<const Modality> modality, const float* q,
                         const float* k, int ce, bool self, bool cross, double out[kNumPromptEntropyKinds]);

// BLAS runs single-threaded: kvsim parallelises over heads itself, which also keeps every product's
// reduction order independent of the thread count. Call before the first BLAS product of a code path.
void EnsureSingleThreadedBlas();

}  // namespace kvsim
