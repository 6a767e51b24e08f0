#pragma once
// IEEE 754 binary16 <-> binary32 conversion. Scalar versions are exact (subnormals, signed zeros, inf; NaNs
// stay NaN with their sign and come out quiet) and round to nearest even; the array versions use F16C when
// the build enables it (-march=x86-64-v3) and give bit-identical results.

#include <bit>
#include <cstddef>
#include <cstdint>
#ifdef __F16C__
#include <immintrin.h>
#endif

namespace kvsim {

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t em = h & 0x7fff;  // exponent and mantissa
  if (em >= 0x7c00)                // inf / NaN (quieted)
    return std::bit_cast<float>(sign | 0x7f800000 | (em & 0x3ff) << 13 | (em > 0x7c00 ? 0x400000 : 0));
  if (em >= 0x0400)
    return std::bit_cast<float>(sign | ((em << 13) + 0x38000000));  // normal: rebias 15 -> 127
  // Zero / subnormal: em * 2^-24 is exact in fp32.
  return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(static_cast<float>(em) * 0x1p-24f));
}

inline uint16_t FloatToHalf(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  x &= 0x7fffffff;
  if (x >= 0x7f800000)  // inf / NaN: keep the top payload bits, force quiet
    return sign | (x > 0x7f800000 ? 0x7e00 | ((x >> 13) & 0x3ff) : 0x7c00);
  if (x >= 0x477ff000) return sign | 0x7c00;  // >= 65520 rounds to inf
  if (x >= 0x38800000) {                      // normal half: rebias, then round to nearest even on bit 13
    x += 0xc8000fff + ((x >> 13) & 1);
    return sign | static_cast<uint16_t>(x >> 13);
  }
  // Zero / subnormal half: adding 0.5f aligns the 10 mantissa bits at the bottom; fp32 addition rounds to
  // nearest even.
  const float aligned = std::bit_cast<float>(x) + 0.5f;
  return sign | static_cast<uint16_t>(std::bit_cast<uint32_t>(aligned) - 0x3f000000);
}

inline void HalfToFloat(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
#endif
  for (; i < n; ++i) out[i] = HalfToFloat(in[i]);
}

inline void FloatToHalf(const float* in, uint16_t* out, size_t n) {
  size_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) out[i] = FloatToHalf(in[i]);
}

}  // namespace kvsim
