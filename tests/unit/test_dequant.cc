#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "model/tensor_source.h"
#include "model_file_writers.h"

namespace kvflow {
namespace {

using test::Bytes;

TensorInfo MakeInfo(DType dtype, std::vector<int64_t> shape, const Bytes& bytes) {
  TensorInfo info;
  info.name = "t";
  info.file = "memory";
  info.dtype = dtype;
  info.shape = std::move(shape);
  info.data = bytes.data();
  info.nbytes = bytes.size();
  return info;
}

std::vector<float> Dequantize(const TensorInfo& info) {
  std::vector<float> out(info.numel(), std::numeric_limits<float>::quiet_NaN());
  Status st = DequantizeToF32(info, out.data());
  EXPECT_TRUE(st.ok()) << st.ToString();
  return out;
}

TEST(Dequant, NamesAndBlockSizes) {
  EXPECT_STREQ(DTypeName(DType::kQ4_1), "Q4_1");
  EXPECT_STREQ(DTypeName(DType::kBF16), "BF16");
  EXPECT_EQ(DTypeBlockElements(DType::kF16), 1);
  EXPECT_EQ(DTypeBlockElements(DType::kQ8_0), 32);
  EXPECT_EQ(DTypeBlockBytes(DType::kQ8_0), 34u);
  EXPECT_EQ(DTypeBlockBytes(DType::kQ4_0), 18u);
  EXPECT_EQ(DTypeBlockBytes(DType::kQ4_1), 20u);
  TensorInfo info;
  info.shape = {3, 4, 5};
  EXPECT_EQ(info.numel(), 60);
}

TEST(Dequant, F32IsCopied) {
  std::vector<float> x = test::RandomFloats(37, 1);
  Bytes bytes = test::ToBytes(x);
  EXPECT_EQ(Dequantize(MakeInfo(DType::kF32, {37}, bytes)), x);
}

TEST(Dequant, F16MatchesCompilerConversion) {
  std::vector<uint16_t> bits;
  for (float f : test::RandomFloats(1000, 2, 60000.0f)) bits.push_back(test::FloatToHalfBits(f));
  // Special values: signed zero, smallest/largest subnormal, smallest normal, max, inf, NaN.
  for (uint16_t special :
       {0x0000, 0x8000, 0x0001, 0x03ff, 0x0400, 0x7bff, 0x7c00, 0xfc00, 0x7e00}) {
    bits.push_back(special);
  }
  Bytes bytes = test::ToBytes(bits);
  std::vector<float> got =
      Dequantize(MakeInfo(DType::kF16, {static_cast<int64_t>(bits.size())}, bytes));
  for (size_t i = 0; i < bits.size(); ++i) {
    float want = test::HalfBitsToFloat(bits[i]);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got[i])) << i;
    } else {
      EXPECT_EQ(got[i], want) << "bits 0x" << std::hex << bits[i];
      EXPECT_EQ(std::signbit(got[i]), std::signbit(want));
    }
  }
}

TEST(Dequant, BF16IsTheHighHalfOfF32) {
  std::vector<float> x = test::RandomFloats(999, 3);
  std::vector<uint16_t> bits;
  for (float f : x) bits.push_back(test::FloatToBf16Bits(f));
  Bytes bytes = test::ToBytes(bits);
  std::vector<float> got = Dequantize(MakeInfo(DType::kBF16, {9, 111}, bytes));
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(got[i], test::Bf16BitsToFloat(bits[i]));
    EXPECT_NEAR(got[i], x[i], std::fabs(x[i]) / 256);  // 8 mantissa bits
  }
}

// Q8_0 block: {f16 d; int8 q[32]}; every value is exactly q * d.
TEST(Dequant, Q8_0ExactAndWithinErrorBound) {
  std::vector<float> x = test::RandomFloats(4 * 64, 4);
  Bytes bytes = test::QuantizeQ8_0(x);
  ASSERT_EQ(bytes.size(), 8u * 34);
  std::vector<float> got = Dequantize(MakeInfo(DType::kQ8_0, {4, 64}, bytes));
  for (size_t i = 0; i < x.size(); ++i) {
    const uint8_t* block = &bytes[(i / 32) * 34];
    const float d = test::HalfBitsToFloat(static_cast<uint16_t>(block[0] | block[1] << 8));
    const int8_t q = static_cast<int8_t>(block[2 + i % 32]);
    EXPECT_EQ(got[i], q * d) << i;
    EXPECT_LE(std::fabs(got[i] - x[i]), 0.6f * d) << i;
  }
}

// Q4_0 block: {f16 d; uint8 qs[16]}; low nibbles hold elements 0..15, high nibbles 16..31.
TEST(Dequant, Q4_0ExactAndWithinErrorBound) {
  std::vector<float> x = test::RandomFloats(3 * 96, 5);
  Bytes bytes = test::QuantizeQ4_0(x);
  ASSERT_EQ(bytes.size(), 9u * 18);
  std::vector<float> got = Dequantize(MakeInfo(DType::kQ4_0, {3, 96}, bytes));
  for (size_t i = 0; i < x.size(); ++i) {
    const uint8_t* block = &bytes[(i / 32) * 18];
    const float d = test::HalfBitsToFloat(static_cast<uint16_t>(block[0] | block[1] << 8));
    const int j = i % 32;
    const int nibble = j < 16 ? block[2 + j] & 0x0f : block[2 + j - 16] >> 4;
    EXPECT_EQ(got[i], (nibble - 8) * d) << i;
    // ggml clamps the one value opposite the block's extreme, so the bound is a full step.
    EXPECT_LE(std::fabs(got[i] - x[i]), 1.01f * std::fabs(d)) << i;
  }
}

// Q4_1 block: {f16 d; f16 m; uint8 qs[16]}; value = nibble * d + m.
TEST(Dequant, Q4_1ExactAndWithinErrorBound) {
  std::vector<float> x = test::RandomFloats(2 * 128, 6);
  Bytes bytes = test::QuantizeQ4_1(x);
  ASSERT_EQ(bytes.size(), 8u * 20);
  std::vector<float> got = Dequantize(MakeInfo(DType::kQ4_1, {2, 128}, bytes));
  for (size_t i = 0; i < x.size(); ++i) {
    const uint8_t* block = &bytes[(i / 32) * 20];
    const float d = test::HalfBitsToFloat(static_cast<uint16_t>(block[0] | block[1] << 8));
    const float m = test::HalfBitsToFloat(static_cast<uint16_t>(block[2] | block[3] << 8));
    const int j = i % 32;
    const int nibble = j < 16 ? block[4 + j] & 0x0f : block[4 + j - 16] >> 4;
    EXPECT_FLOAT_EQ(got[i], nibble * d + m) << i;
    EXPECT_LE(std::fabs(got[i] - x[i]), 0.6f * d + 2e-3f * std::fabs(m)) << i;
  }
}

// Big enough to take the OpenMP path; every block must land in its own place.
TEST(Dequant, LargeQuantizedTensorMatchesBlockByBlock) {
  const int64_t rows = 256, cols = 1024;
  std::vector<float> x = test::RandomFloats(rows * cols, 7);
  Bytes bytes = test::QuantizeQ4_1(x);
  std::vector<float> whole = Dequantize(MakeInfo(DType::kQ4_1, {rows, cols}, bytes));
  for (int64_t b = 0; b < rows * cols / 32; b += 97) {
    Bytes one(bytes.begin() + b * 20, bytes.begin() + (b + 1) * 20);
    std::vector<float> block = Dequantize(MakeInfo(DType::kQ4_1, {32}, one));
    for (int j = 0; j < 32; ++j) ASSERT_EQ(whole[b * 32 + j], block[j]) << "block " << b;
  }
}

// ---- K-quants: blocks built by hand, with the value of every element worked out from the format --

void PutHalf(Bytes* block, size_t offset, float value) {
  const uint16_t bits = test::FloatToHalfBits(value);
  std::memcpy(block->data() + offset, &bits, 2);
}

// Q2_K: sub-block g (16 elements) has scale 1 + g % 15 and min g % 4; every qs byte is 0b11100100,
// so the 2-bit quant of element e is its shift index (e % 128) / 32. x = 0.5 * scale * q - 0.25 * min.
TEST(Dequant, Q2_KHandBuiltBlock) {
  Bytes block(test::kQ2_KBytes, 0);
  for (int g = 0; g < 16; ++g) block[g] = static_cast<uint8_t>((1 + g % 15) | ((g % 4) << 4));
  for (int i = 16; i < 80; ++i) block[i] = 0xE4;
  PutHalf(&block, 80, 0.5f);
  PutHalf(&block, 82, 0.25f);
  std::vector<float> got = Dequantize(MakeInfo(DType::kQ2_K, {256}, block));
  for (int e = 0; e < 256; ++e) {
    const int g = e / 16, q = (e % 128) / 32;
    EXPECT_EQ(got[e], 0.5f * (1 + g % 15) * q - 0.25f * (g % 4)) << e;
  }
}

// Q3_K: sub-block g has the 6-bit scale 4g (biased by 32: -32..28); the low 2 bits of element e's
// quant are its shift index s = (e % 128) / 32; hmask[l] is 0x0f for l < 16 and 0xf0 above, so the
// high bit (bit 4h + s) is set for the first half's l < 16 and the second half's l >= 16, and a clear
// high bit subtracts 4. x = 0.25 * (4g - 32) * q.
TEST(Dequant, Q3_KHandBuiltBlock) {
  Bytes block(test::kQ3_KBytes, 0);
  for (int l = 0; l < 32; ++l) block[l] = l < 16 ? 0x0f : 0xf0;
  for (int i = 32; i < 96; ++i) block[i] = 0xE4;
  uint8_t* scales = &block[96];
  for (int g = 0; g < 16; ++g) {
    const int sc = 4 * g;
    scales[g % 8] |= static_cast<uint8_t>((sc & 0x0f) << (g < 8 ? 0 : 4));
    scales[8 + g % 4] |= static_cast<uint8_t>((sc >> 4) << (2 * (g / 4)));
  }
  PutHalf(&block, 108, 0.25f);
  std::vector<float> got = Dequantize(MakeInfo(DType::kQ3_K, {256}, block));
  for (int e = 0; e < 256; ++e) {
    const int g = e / 16, h = e / 128, s = (e % 128) / 32, l = e % 32;
    const bool high = h == 0 ? l < 16 : l >= 16;
    const int q = s - (high ? 0 : 4);
    EXPECT_EQ(got[e], 0.25f * (4 * g - 32) * q) << e;
  }
}

// Q4_K/Q5_K share the 6-bit scale/min packing: sub-block j (32 elements) has scale 10 + 7j and min
// 63 - 5j, so sub-blocks 4..7 and most values need the top bits. Every qs byte is 0x5A: low-nibble
// elements (the first 32 of each 64) are 10, high-nibble ones 5.
constexpr int kScale6[8] = {10, 17, 24, 31, 38, 45, 52, 59};
constexpr int kMin6[8] = {63, 58, 53, 48, 43, 38, 33, 28};

TEST(Dequant, Q4_KHandBuiltBlock) {
  Bytes block(test::kQ4_KBytes, 0);
  PutHalf(&block, 0, 0.125f);
  PutHalf(&block, 2, 0.0625f);
  test::PackScaleMin6(kScale6, kMin6, &block[4]);
  for (int i = 16; i < 144; ++i) block[i] = 0x5A;
  std::vector<float> got = Dequantize(MakeInfo(DType::kQ4_K, {256}, block));
  for (int e = 0; e < 256; ++e) {
    const int j = e / 32, q = (e % 64) < 32 ? 10 : 5;
    EXPECT_EQ(got[e], 0.125f * kScale6[j] * q - 0.0625f * kMin6[j]) << e;
  }
}

// As Q4_K, plus qh bytes 0xAA: bit j of qh[l] set for odd sub-blocks j, adding 16 to their quants.
TEST(Dequant, Q5_KHandBuiltBlock) {
  Bytes block(test::kQ5_KBytes, 0);
  PutHalf(&block, 0, 0.125f);
  PutHalf(&block, 2, 0.0625f);
  test::PackScaleMin6(kScale6, kMin6, &block[4]);
  for (int i = 16; i < 48; ++i) block[i] = 0xAA;
  for (int i = 48; i < 176; ++i) block[i] = 0x5A;
  std::vector<float> got = Dequantize(MakeInfo(DType::kQ5_K, {256}, block));
  for (int e = 0; e < 256; ++e) {
    const int j = e / 32, q = ((e % 64) < 32 ? 10 : 5) + (j % 2 ? 16 : 0);
    EXPECT_EQ(got[e], 0.125f * kScale6[j] * q - 0.0625f * kMin6[j]) << e;
  }
}

// Q6_K: sub-block g has the signed scale 9g - 70; every ql byte is 0x3C (low nibble 12, high 3) and
// every qh byte 0b11100100, so element e with k = (e % 128) / 32 has low bits 12 (k < 2) or 3 and
// top bits k. x = 0.5 * (9g - 70) * (q - 32).
TEST(Dequant, Q6_KHandBuiltBlock) {
  Bytes block(test::kQ6_KBytes, 0);
  for (int i = 0; i < 128; ++i) block[i] = 0x3C;
  for (int i = 128; i < 192; ++i) block[i] = 0xE4;
  for (int g = 0; g < 16; ++g) block[192 + g] = static_cast<uint8_t>(static_cast<int8_t>(9 * g - 70));
  PutHalf(&block, 208, 0.5f);
  std::vector<float> got = Dequantize(MakeInfo(DType::kQ6_K, {256}, block));
  for (int e = 0; e < 256; ++e) {
    const int g = e / 16, k = (e % 128) / 32, q = ((k < 2 ? 12 : 3) | (k << 4)) - 32;
    EXPECT_EQ(got[e], 0.5f * (9 * g - 70) * q) << e;
  }
}

TEST(Dequant, KQuantNamesAndBlockSizes) {
  const std::pair<DType, size_t> types[] = {{DType::kQ2_K, 84}, {DType::kQ3_K, 110}, {DType::kQ4_K, 144},
                                            {DType::kQ5_K, 176}, {DType::kQ6_K, 210}};
  for (auto [type, bytes] : types) {
    EXPECT_EQ(DTypeBlockElements(type), 256) << DTypeName(type);
    EXPECT_EQ(DTypeBlockBytes(type), bytes) << DTypeName(type);
  }
  EXPECT_STREQ(DTypeName(DType::kQ2_K), "Q2_K");
  EXPECT_STREQ(DTypeName(DType::kQ6_K), "Q6_K");
}

// The test's own quantizers (written from the layout) round-trip through kvflow's dequantization
// within a step of each sub-block.
TEST(Dequant, KQuantRoundTripsWithinAStep) {
  std::vector<float> x = test::RandomFloats(4 * 512, 8);
  struct Case {
    DType type;
    Bytes bytes;
    float relative_error;  // of the largest |x| of the super-block
  };
  const Case cases[] = {{DType::kQ4_K, test::QuantizeQ4_K(x), 0.1f},
                        {DType::kQ5_K, test::QuantizeQ5_K(x), 0.05f},
                        {DType::kQ6_K, test::QuantizeQ6_K(x), 0.03f}};
  for (const Case& c : cases) {
    ASSERT_EQ(c.bytes.size(), x.size() / 256 * DTypeBlockBytes(c.type)) << DTypeName(c.type);
    std::vector<float> got = Dequantize(MakeInfo(c.type, {4, 512}, c.bytes));
    for (size_t b = 0; b < x.size() / 256; ++b) {
      float amax = 0;
      for (int j = 0; j < 256; ++j) amax = std::max(amax, std::fabs(x[b * 256 + j]));
      for (int j = 0; j < 256; ++j) {
        const size_t i = b * 256 + j;
        EXPECT_LE(std::fabs(got[i] - x[i]), c.relative_error * amax) << DTypeName(c.type) << " " << i;
      }
    }
  }
}

// Big enough for the parallel path; every super-block must land in its own place.
TEST(Dequant, LargeKQuantTensorsMatchBlockByBlock) {
  const std::pair<DType, uint32_t> types[] = {{DType::kQ2_K, test::kGgmlQ2_K}, {DType::kQ3_K, test::kGgmlQ3_K},
                                              {DType::kQ4_K, test::kGgmlQ4_K}, {DType::kQ5_K, test::kGgmlQ5_K},
                                              {DType::kQ6_K, test::kGgmlQ6_K}};
  const int64_t rows = 64, cols = 1024, blocks = rows * cols / 256;
  for (auto [type, ggml_type] : types) {
    const size_t block_bytes = DTypeBlockBytes(type);
    Bytes bytes = test::RandomKQuantBlocks(ggml_type, blocks, 9);
    std::vector<float> whole = Dequantize(MakeInfo(type, {rows, cols}, bytes));
    for (int64_t b = 0; b < blocks; b += 7) {
      Bytes one(bytes.begin() + b * block_bytes, bytes.begin() + (b + 1) * block_bytes);
      std::vector<float> block = Dequantize(MakeInfo(type, {256}, one));
      for (int j = 0; j < 256; ++j) {
        ASSERT_TRUE(std::isfinite(block[j])) << DTypeName(type);
        ASSERT_EQ(whole[b * 256 + j], block[j]) << DTypeName(type) << " block " << b;
      }
    }
  }
}

TEST(Dequant, RejectsKQuantTensorsThatDoNotHoldWholeSuperBlocks) {
  Bytes bytes(2 * 144, 0);
  std::vector<float> out(512);
  // 128 columns: whole 32-blocks but no whole super-block.
  EXPECT_EQ(DequantizeToF32(MakeInfo(DType::kQ4_K, {4, 128}, bytes), out.data()).code(), StatusCode::kInvalidArgument);
  TensorInfo short_data = MakeInfo(DType::kQ4_K, {512}, bytes);
  short_data.nbytes = 144;
  EXPECT_EQ(DequantizeToF32(short_data, out.data()).code(), StatusCode::kInvalidArgument);
  TensorInfo wrong_type = MakeInfo(DType::kQ6_K, {512}, bytes);  // 288 bytes are not two Q6_K blocks
  EXPECT_EQ(DequantizeToF32(wrong_type, out.data()).code(), StatusCode::kInvalidArgument);
}

TEST(Dequant, RejectsInconsistentTensors) {
  Bytes bytes(34 * 2, 1);
  std::vector<float> out(64);
  TensorInfo short_data = MakeInfo(DType::kQ8_0, {64}, bytes);
  short_data.nbytes = 34;
  Status st = DequantizeToF32(short_data, out.data());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("memory"), std::string::npos) << st.message();

  TensorInfo ragged = MakeInfo(DType::kQ4_0, {2, 48}, bytes);
  EXPECT_EQ(DequantizeToF32(ragged, out.data()).code(), StatusCode::kInvalidArgument);

  TensorInfo no_output = MakeInfo(DType::kQ8_0, {64}, bytes);
  EXPECT_EQ(DequantizeToF32(no_output, nullptr).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvflow
