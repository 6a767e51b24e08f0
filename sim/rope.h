#pragma once
// Rotary position embedding in the rotate-half convention (GPT-NeoX; Llama and Qwen in Hugging Face):
// dimension i is paired with i + d/2 for i < d/2, pair i has frequency theta_i = rope_theta^(-2i/d), and
// a vector at position p is rotated pair-wise by the angle p * theta_i:
//   x'_i       = x_i cos(p theta_i) - x_{i+d/2} sin(p theta_i)
//   x'_{i+d/2} = x_{i+d/2} cos(p theta_i) + x_i sin(p theta_i)
// so that q'_p . k'_j depends on the positions only through p - j.

#include <cmath>
#include <cstdint>
#include <vector>

namespace kvsim {

// Frequency of pair i (0 <= i < head_dim / 2).
inline double RopeFrequency(int pair, int head_dim, double rope_theta) {
  return std::pow(rope_theta, -2.0 * pair / head_dim);
}

// Rotates one head_dim vector in place for the given position.
inline void ApplyRope(float* x, int head_dim, int64_t position, double rope_theta) {
  const int half = head_dim / 2;
  for (int i = 0; i < half; ++i) {
    const double angle = static_cast<double>(position) * RopeFrequency(i, head_dim, rope_theta);
    const float c = static_cast<float>(std::cos(angle));
    const float s = static_cast<float>(std::sin(angle));
    const float a = x[i];
    const float b = x[i + half];
    x[i] = a * c - b * s;
    x[i + half] = b * c + a * s;
  }
}

// Every pair's frequency (head_dim / 2 values); empty when rope_theta <= 0 (no rotary embedding), which
// makes RotateBy a no-op.
inline std::vector<double> RopeFrequencies(int head_dim, double rope_theta) {
  std::vector<double> f;
  if (rope_theta > 0)
    for (int i = 0; i < head_dim / 2; ++i) f.push_back(RopeFrequency(i, head_dim, rope_theta));
  return f;
}

// Rotates a post-RoPE vector by `delta` positions (rotations compose: the vector at position p becomes the
// vector at p + delta; delta = -p recovers the pre-RoPE vector). Same result as ApplyRope(x, head_dim, delta,
// rope_theta) with the frequencies computed once.
inline void RotateBy(float* x, int head_dim, int64_t delta, const std::vector<double>& freqs) {
  if (freqs.empty() || delta == 0) return;
  const int half = head_dim / 2;
  for (int i = 0; i < half; ++i) {
    const double angle = static_cast<double>(delta) * freqs[i];
    const float c = static_cast<float>(std::cos(angle));
    const float s = static_cast<float>(std::sin(angle));
    const float a = x[i];
    const float b = x[i + half];
    x[i] = a * c - b * s;
    x[i + half] = b * c + a * s;
  }
}

// cos/sin of every (position, pair) of a token sequence, computed once and applied to many vectors.
// Apply(t, x) gives exactly ApplyRope(x, head_dim, positions[t], rope_theta).
class RopeTable {
 public:
  RopeTable(int head_dim, double rope_theta, const std::vector<int64_t>& positions)
      : half_(head_dim / 2), cos_(positions.size() * half_), sin_(positions.size() * half_) {
    for (size_t t = 0; t < positions.size(); ++t)
      for (int i = 0; i < half_; ++i) {
        const double angle = static_cast<double>(positions[t]) * RopeFrequency(i, head_dim, rope_theta);
        cos_[t * half_ + i] = static_cast<float>(std::cos(angle));
        sin_[t * half_ + i] = static_cast<float>(std::sin(angle));
      }
  }
  void Apply(size_t token, float* x) const {
    const float* c = cos_.data() + token * half_;
    const float* s = sin_.data() + token * half_;
    for (int i = 0; i < half_; ++i) {
      const float a = x[i];
      const float b = x[i + half_];
      x[i] = a * c[i] - b * s[i];
      x[i + half_] = b * c[i] + a * s[i];
    }
  }

 private:
  int half_;
  std::vector<float> cos_, sin_;
};

}  // namespace kvsim
