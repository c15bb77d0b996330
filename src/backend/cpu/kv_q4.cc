#include "backend/cpu/kv_q4.h"

#include <algorithm>
#include <cmath>

#include "util/half.h"

namespace kvflow::cpu {

void QuantizeQ4(const float* src, int64_t n, Q4Group* dst) {
  for (int64_t g = 0; g < n / kQ4GroupSize; ++g) {
    const float* x = src + g * kQ4GroupSize;
    const auto [lo, hi] = std::minmax_element(x, x + kQ4GroupSize);
    Q4Group& group = dst[g];
    group.min = FloatToHalfBits(*lo);
    const float min = HalfBitsToFloat(group.min);
    // The rounded minimum may sit above the true one, so the range is measured from it.
    group.scale = FloatToHalfBits(std::max(0.0f, (*hi - min) / 15.0f));
    const float scale = HalfBitsToFloat(group.scale);
    uint8_t codes[kQ4GroupSize];
    for (int j = 0; j < kQ4GroupSize; ++j) {
      const float q = scale > 0.0f ? std::floor((x[j] - min) / scale + 0.5f) : 0.0f;
      codes[j] = static_cast<uint8_t>(std::clamp(q, 0.0f, 15.0f));
    }
    for (int j = 0; j < kQ4GroupSize / 2; ++j) {
      group.codes[j] = static_cast<uint8_t>(codes[j] | (codes[j + kQ4GroupSize / 2] << 4));
    }
  }
}

void DequantizeQ4(const Q4Group* src, int64_t n, float* dst) {
  for (int64_t g = 0; g < n / kQ4GroupSize; ++g) {
    const Q4Group& group = src[g];
    const float scale = HalfBitsToFloat(group.scale);
    const float min = HalfBitsToFloat(group.min);
    float* out = dst + g * kQ4GroupSize;
    for (int j = 0; j < kQ4GroupSize / 2; ++j) {
      out[j] = min + scale * static_cast<float>(group.codes[j] & 0x0f);
      out[j + kQ4GroupSize / 2] = min + scale * static_cast<float>(group.codes[j] >> 4);
    }
  }
}

}  // namespace kvflow::cpu
