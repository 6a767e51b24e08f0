#pragma once
// 16-bit storage types of the GPU kernels, on the host: fp16 (IEEE binary16) and bf16, stored as uint16_t,
// converted with round-to-nearest-even exactly as CUDA's __float2half_rn / __float2bfloat16_rn do. Host code
// (CPU reference, tests, harness) uses these; no CUDA headers needed.

#include <cstdint>
#include <cstring>

namespace kvsim::gpu_replay {

enum class Dtype : uint8_t { kF16 = 0, kBF16 = 1 };
inline const char* DtypeName(Dtype d) { return d == Dtype::kF16 ? "fp16" : "bf16"; }

inline float Bf16ToFloat(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      u = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t FloatToHalf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // overflow (>= 65520 rounds to inf)
  if (a < 0x38800000u) {                        // subnormal or zero in fp16
    if (a < 0x33000000u) return sign;           // < 2^-25: rounds to zero
    const uint32_t exp = a >> 23, mant = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14 + (113 - exp)
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return sign | static_cast<uint16_t>(h);
  }
  uint32_t h = ((a - 0x38000000u) >> 13);  // rebias exponent
  const uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return sign | static_cast<uint16_t>(h);
}

inline float ToFloat(Dtype d, uint16_t x) { return d == Dtype::kF16 ? HalfToFloat(x) : Bf16ToFloat(x); }
inline uint16_t FromFloat(Dtype d, float f) { return d == Dtype::kF16 ? FloatToHalf(f) : FloatToBf16(f); }
// f rounded to the dtype and back.
inline float RoundTo(Dtype d, float f) { return ToFloat(d, FromFloat(d, f)); }

// Deterministic pseudo-random values by index (a 64-bit mix), identical on host and device: random weights,
// caches and inputs are generated in place on either side without transfers. Uniform in [-1, 1).
inline float HashUniform(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + i + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<int64_t>(z >> 40) - (1ll << 23)) * (1.0f / (1 << 23));
}

}  // namespace kvsim::gpu_replay
