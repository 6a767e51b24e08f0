#pragma once
// Counter-based random numbers of `kvsim synth`: independent streams keyed by (seed, purpose, a, b, c), so
// every value depends only on the seed and on what it is for, never on thread count or generation order.

#include <cmath>
#include <cstdint>

namespace kvsim::synth_rng {

inline constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

inline uint64_t Mix64(uint64_t z) {  // splitmix64 finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

class Rng {
 public:
  // `purpose`: any enum (or integer) naming what the stream is for.
  template <typename Purpose>
  Rng(uint64_t seed, Purpose purpose, uint64_t a = 0, uint64_t b = 0, uint64_t c = 0) {
    uint64_t h = Mix64(seed ^ kGolden);
    for (uint64_t key : {static_cast<uint64_t>(purpose), a, b, c}) h = Mix64(h + kGolden * (key + 1));
    state_ = h;
  }
  uint64_t Next() { return Mix64(state_ += kGolden); }
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1p-53; }  // [0, 1)
  // Standard normal, Marsaglia's polar method (pairs; no trigonometry).
  float Normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    float u, v, s;
    do {
      const uint64_t r = Next();
      u = static_cast<float>(static_cast<int32_t>(r)) * 0x1p-31f;
      v = static_cast<float>(static_cast<int32_t>(r >> 32)) * 0x1p-31f;
      s = u * u + v * v;
    } while (s >= 1.0f || s == 0.0f);
    const float f = std::sqrt(-2.0f * std::log(s) / s);
    spare_ = v * f;
    has_spare_ = true;
    return u * f;
  }

 private:
  uint64_t state_;
  float spare_ = 0;
  bool has_spare_ = false;
};

}  // namespace kvsim::synth_rng
