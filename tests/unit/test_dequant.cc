#include <gtest/gtest.h>

#include <cmath>
#include <limits>

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
