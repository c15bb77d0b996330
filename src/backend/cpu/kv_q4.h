// The 4-bit KV cache element (KvElement::kQ4): asymmetric group quantization along head_dim, laid
// out exactly as llama.cpp's Q4_1 block (FlexGen's and InfiniGen's INT4 KV baseline). A group of 32
// consecutive values of one row holds an fp16 scale d, an fp16 minimum m and 32 4-bit codes q; a
// value reads back as m + d * q. A (block, kv head, slot) row of head_dim values is head_dim / 32
// consecutive groups, so a pool row is head_dim / 32 * 20 bytes and element offset e (a multiple of
// 32) starts at group e / 32.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvflow::cpu {

inline constexpr int kQ4GroupSize = 32;

struct Q4Group {
  uint16_t scale;       // fp16 bits of d = (max - m) / 15
  uint16_t min;         // fp16 bits of m, the group's minimum
  uint8_t codes[16];    // value j in the low nibble of codes[j], value j + 16 in the high nibble
};
static_assert(sizeof(Q4Group) == 20, "a Q4 group is 16 bytes of codes and two fp16");

// Quantizes n values (n a multiple of 32) into n / 32 groups. The scale and minimum are rounded to
// fp16 first and the codes computed against the rounded pair (round to nearest, clamped to 0..15),
// so a value's error is at most d / 2 plus the fp16 rounding of m. A constant group has d = 0.
void QuantizeQ4(const float* src, int64_t n, Q4Group* dst);
// n values (n a multiple of 32) of n / 32 groups, as fp32.
void DequantizeQ4(const Q4Group* src, int64_t n, float* dst);

}  // namespace kvflow::cpu
