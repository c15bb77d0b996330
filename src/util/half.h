// IEEE half <-> float, portable and bit-exact with F16C's vcvtph2ps / vcvtps2ph (round to nearest
// even), for code that must not depend on the instruction (the portable kernel paths) and for the
// GGUF loaders.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvflow {

// Including subnormals, infinities and NaN.
inline float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f;
  const uint32_t mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000 | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {
    float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // mantissa * 2^-24, exact
    std::memcpy(&bits, &magnitude, sizeof(bits));
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t FloatToHalfBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  const uint32_t magnitude = bits & 0x7fffffff;
  if (magnitude >= 0x7f800000) return sign | 0x7c00 | (magnitude > 0x7f800000 ? 0x200 : 0);
  if (magnitude >= 0x477ff000) return sign | 0x7c00;  // >= 65520 rounds to infinity
  if (magnitude < 0x38800000) {                       // below 2^-14: a subnormal half
    if (magnitude <= 0x33000000) return sign;         // <= 2^-25 rounds (to even) to zero
    const uint32_t significand = (magnitude & 0x7fffff) | 0x800000;
    const int shift = 126 - static_cast<int>(magnitude >> 23);  // to units of 2^-24: 14..24
    uint32_t half = significand >> shift;
    const uint32_t rest = significand & ((1u << shift) - 1), midpoint = 1u << (shift - 1);
    if (rest > midpoint || (rest == midpoint && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = (magnitude >> 13) - (112u << 10);  // rebias the exponent from 127 to 15
  const uint32_t rest = magnitude & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) ++half;  // a carry bumps the exponent
  return static_cast<uint16_t>(sign | half);
}

// bfloat16: the top half of a float's bits; rounding to nearest even, NaN kept a (quiet) NaN.
inline float Bf16BitsToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t FloatToBf16Bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace kvflow
