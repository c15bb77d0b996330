// Scale unpacking shared by the K-quant dequantizer (dequant.cc) and the CPU dot kernels
// (backend/cpu/kquant_dot.cc); the block layouts are described in dequant.cc.
#pragma once

#include <cstdint>

namespace kvflow {

// ggml's get_scale_min_k4: Q4_K/Q5_K pack 8 (scale, min) pairs of 6 bits into 12 bytes. Bytes 0..3
// hold scales 0..3 in their low 6 bits, bytes 4..7 mins 0..3; scales/mins 4..7 keep their low 4
// bits in the nibbles of bytes 8..11 and their top 2 bits in the top bits of bytes 0..7.
inline void UnpackScaleMin6(const uint8_t* packed, int j, int* scale, int* min) {
  if (j < 4) {
    *scale = packed[j] & 63;
    *min = packed[j + 4] & 63;
  } else {
    *scale = (packed[j + 4] & 0x0f) | ((packed[j - 4] >> 6) << 4);
    *min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
  }
}

// Q3_K's 6-bit sub-block scales (16 of them in 12 bytes), biased by 32: low 4 bits in the nibbles
// of bytes 0..7 (sub-blocks 8..15 in the high nibbles), top 2 bits at bit 2*(sub/4) of byte
// 8 + sub%4. Returns the signed scale, -32..31.
inline int UnpackQ3Scale(const uint8_t* scales, int sub) {
  const int low = sub < 8 ? scales[sub] & 0x0f : scales[sub - 8] >> 4;
  const int high = (scales[8 + sub % 4] >> (2 * (sub / 4))) & 3;
  return (low | (high << 4)) - 32;
}

}  // namespace kvflow
