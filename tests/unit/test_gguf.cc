#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <tuple>

#include "model/gguf.h"
#include "model/model_config.h"
#include "model/tensor_source.h"
#include "model_file_writers.h"

namespace kvflow {
namespace {

using test::Bytes;
using test::GgufWriter;

std::vector<float> Dequantize(const TensorInfo& info) {
  std::vector<float> out(info.numel());
  Status st = DequantizeToF32(info, out.data());
  EXPECT_TRUE(st.ok()) << st.ToString();
  return out;
}

// Patches a little-endian value at `offset` of a built file.
template <typename T>
void Poke(Bytes* bytes, size_t offset, T value) {
  std::memcpy(bytes->data() + offset, &value, sizeof(T));
}

class GgufTest : public ::testing::Test {
 protected:
  std::string Write(const Bytes& bytes) {
    std::string path = dir_.File("model" + std::to_string(files_++) + ".gguf");
    test::WriteFile(path, bytes);
    return path;
  }

  // Opening must fail with `code`; returns the message, which must name the file.
  std::string ExpectFailure(const Bytes& bytes, StatusCode code) {
    return test::ExpectOpenFailure(Write(bytes), code, [](const std::string& p) { return GgufFile::Open(p); });
  }

  test::ScratchDir dir_{"gguf"};
  int files_ = 0;
};

// One tensor of every supported type, with random contents, and metadata of every value type.
struct SampleModel {
  std::vector<float> f32 = test::RandomFloats(15, 10);
  std::vector<float> f16 = test::RandomFloats(8, 11);
  std::vector<float> bf16 = test::RandomFloats(8, 12);
  std::vector<float> q8 = test::RandomFloats(2 * 64, 13);
  std::vector<float> q40 = test::RandomFloats(3 * 32, 14);
  std::vector<float> q41 = test::RandomFloats(96, 15);
  // K-quants: Q4_K/Q5_K/Q6_K from the test's quantizers, Q2_K/Q3_K as random blocks.
  std::vector<float> q4k = test::RandomFloats(2 * 256, 16);
  std::vector<float> q5k = test::RandomFloats(512, 17);
  std::vector<float> q6k = test::RandomFloats(256, 18);
  Bytes q2k = test::RandomKQuantBlocks(test::kGgmlQ2_K, 2, 19);
  Bytes q3k = test::RandomKQuantBlocks(test::kGgmlQ3_K, 1, 20);

  GgufWriter Writer() const {
    GgufWriter w;
    w.AddString("general.architecture", "llama");
    w.Add("u8", test::kU8, uint8_t{200});
    w.Add("i8", test::kI8, int8_t{-100});
    w.Add("u16", test::kU16, uint16_t{60000});
    w.Add("i16", test::kI16, int16_t{-30000});
    w.Add("u32", test::kU32, uint32_t{4000000000u});
    w.Add("i32", test::kI32, int32_t{-2000000000});
    w.Add("f32", test::kF32, 0.125f);
    w.Add("bool", test::kBool, uint8_t{1});
    w.Add("u64", test::kU64, uint64_t{1} << 40);
    w.Add("i64", test::kI64, int64_t{-(int64_t{1} << 40)});
    w.Add("f64", test::kF64, 2.5);
    w.AddString("str", "héllo");
    w.AddStringArray("strs", {"a", "", "ccc"});
    w.AddRaw("ints", test::kArray, GgufWriter::ArrayOf<int32_t>(test::kI32, {7, -8, 9}));
    // An array of two arrays of u8, as the spec allows.
    Bytes nested;
    test::Append(&nested, static_cast<uint32_t>(test::kArray));
    test::Append(&nested, uint64_t{2});
    for (const auto& inner : {std::vector<uint8_t>{1, 2}, std::vector<uint8_t>{3}}) {
      Bytes one = GgufWriter::ArrayOf<uint8_t>(test::kU8, inner);
      nested.insert(nested.end(), one.begin(), one.end());
    }
    w.AddRaw("nested", test::kArray, nested);

    w.AddTensor("f32", test::kGgmlF32, {3, 5}, test::ToBytes(f32));
    std::vector<uint16_t> f16_bits, bf16_bits;
    for (float f : f16) f16_bits.push_back(test::FloatToHalfBits(f));
    for (float f : bf16) bf16_bits.push_back(test::FloatToBf16Bits(f));
    w.AddTensor("f16", test::kGgmlF16, {2, 4}, test::ToBytes(f16_bits));
    w.AddTensor("bf16", test::kGgmlBF16, {4, 2}, test::ToBytes(bf16_bits));
    w.AddTensor("q8_0", test::kGgmlQ8_0, {2, 64}, test::QuantizeQ8_0(q8));
    w.AddTensor("q4_0", test::kGgmlQ4_0, {3, 1, 32}, test::QuantizeQ4_0(q40));
    w.AddTensor("q4_1", test::kGgmlQ4_1, {96}, test::QuantizeQ4_1(q41));
    w.AddTensor("q4_k", test::kGgmlQ4_K, {2, 256}, test::QuantizeQ4_K(q4k));
    w.AddTensor("q5_k", test::kGgmlQ5_K, {1, 512}, test::QuantizeQ5_K(q5k));
    w.AddTensor("q6_k", test::kGgmlQ6_K, {256}, test::QuantizeQ6_K(q6k));
    w.AddTensor("q2_k", test::kGgmlQ2_K, {2, 1, 256}, q2k);
    w.AddTensor("q3_k", test::kGgmlQ3_K, {256}, q3k);
    return w;
  }
};

TEST_F(GgufTest, RoundTripsMetadata) {
  std::string path = Write(SampleModel().Writer().Build());
  Result<std::unique_ptr<GgufFile>> opened = GgufFile::Open(path);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  const GgufFile& g = **opened;
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(g.Keys().size(), 16u);
  EXPECT_EQ(g.Keys().front(), "general.architecture");
  EXPECT_EQ(g.GetString("general.architecture").value(), "llama");
  EXPECT_EQ(g.GetU32("u8").value(), 200u);
  EXPECT_EQ(g.GetI32("i8").value(), -100);
  EXPECT_EQ(g.GetU32("u16").value(), 60000u);
  EXPECT_EQ(g.GetI32("i16").value(), -30000);
  EXPECT_EQ(g.GetU32("u32").value(), 4000000000u);
  EXPECT_EQ(g.GetI32("i32").value(), -2000000000);
  EXPECT_EQ(g.GetU64("u64").value(), uint64_t{1} << 40);
  EXPECT_EQ(g.GetF32("f32").value(), 0.125f);
  EXPECT_EQ(g.GetF32("f64").value(), 2.5f);
  EXPECT_TRUE(g.GetBool("bool").value());
  EXPECT_EQ(g.GetString("str").value(), "héllo");
  EXPECT_EQ(g.GetStringArray("strs").value(), (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_EQ(g.GetIntArray("ints").value(), (std::vector<int64_t>{7, -8, 9}));
  EXPECT_EQ(g.GetArrayLength("nested").value(), 2u);

  // Wrong types and ranges are errors, not garbage values.
  EXPECT_EQ(g.GetI32("u32").status().code(), StatusCode::kCorruptFile);  // does not fit
  EXPECT_EQ(g.GetU32("i8").status().code(), StatusCode::kCorruptFile);   // negative
  EXPECT_EQ(g.GetU32("i64").status().code(), StatusCode::kCorruptFile);
  EXPECT_EQ(g.GetString("u32").status().code(), StatusCode::kCorruptFile);
  EXPECT_EQ(g.GetF32("str").status().code(), StatusCode::kCorruptFile);
  EXPECT_EQ(g.GetBool("u8").status().code(), StatusCode::kCorruptFile);
  EXPECT_EQ(g.GetIntArray("strs").status().code(), StatusCode::kCorruptFile);
  EXPECT_EQ(g.GetStringArray("nested").status().code(), StatusCode::kCorruptFile);
  Status missing = g.GetU32("no.such.key").status();
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_NE(missing.message().find("no.such.key"), std::string::npos);
}

TEST_F(GgufTest, RoundTripsTensors) {
  SampleModel sample;
  std::string path = Write(sample.Writer().Build());
  Result<std::unique_ptr<GgufFile>> opened = GgufFile::Open(path);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  const GgufFile& g = **opened;
  EXPECT_EQ(g.Names(), (std::vector<std::string>{"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k",
                                                 "q6_k", "q2_k", "q3_k"}));
  EXPECT_EQ(g.Find("absent"), nullptr);
  EXPECT_NE(g.Describe().find("11 tensors"), std::string::npos) << g.Describe();
  EXPECT_EQ(g.data_offset() % 32, 0u);

  const TensorInfo* f32 = g.Find("f32");
  ASSERT_NE(f32, nullptr);
  EXPECT_EQ(f32->shape, (std::vector<int64_t>{3, 5}));  // outermost first
  EXPECT_EQ(f32->file, path);
  EXPECT_EQ(Dequantize(*f32), sample.f32);

  std::vector<float> f16 = Dequantize(*g.Find("f16"));
  for (size_t i = 0; i < f16.size(); ++i) {
    EXPECT_EQ(f16[i], test::HalfBitsToFloat(test::FloatToHalfBits(sample.f16[i])));
  }
  std::vector<float> bf16 = Dequantize(*g.Find("bf16"));
  for (size_t i = 0; i < bf16.size(); ++i) {
    EXPECT_EQ(bf16[i], test::Bf16BitsToFloat(test::FloatToBf16Bits(sample.bf16[i])));
  }

  struct Quantized {
    const char* name;
    DType dtype;
    std::vector<int64_t> shape;
    const std::vector<float>* x;
    float tolerance;
  };
  for (const Quantized& q : {Quantized{"q8_0", DType::kQ8_0, {2, 64}, &sample.q8, 0.02f},
                             Quantized{"q4_0", DType::kQ4_0, {3, 1, 32}, &sample.q40, 0.26f},
                             Quantized{"q4_1", DType::kQ4_1, {96}, &sample.q41, 0.14f},
                             Quantized{"q4_k", DType::kQ4_K, {2, 256}, &sample.q4k, 0.2f},
                             Quantized{"q5_k", DType::kQ5_K, {1, 512}, &sample.q5k, 0.1f},
                             Quantized{"q6_k", DType::kQ6_K, {256}, &sample.q6k, 0.06f}}) {
    const TensorInfo* info = g.Find(q.name);
    ASSERT_NE(info, nullptr) << q.name;
    EXPECT_EQ(info->dtype, q.dtype);
    EXPECT_EQ(info->shape, q.shape);
    EXPECT_EQ(info->nbytes, q.x->size() / DTypeBlockElements(q.dtype) * DTypeBlockBytes(q.dtype));
    std::vector<float> got = Dequantize(*info);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_NEAR(got[i], (*q.x)[i], q.tolerance) << q.name << " " << i;
    }
  }
}

TEST_F(GgufTest, AcceptsVersion2AndCustomAlignment) {
  GgufWriter w = SampleModel().Writer();
  w.SetAlignment(64);
  Result<std::unique_ptr<GgufFile>> opened = GgufFile::Open(Write(w.Build(/*version=*/2)));
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  EXPECT_EQ((*opened)->version(), 2u);
  EXPECT_EQ((*opened)->alignment(), 64u);
  EXPECT_EQ((*opened)->data_offset() % 64, 0u);
  EXPECT_EQ(Dequantize(*(*opened)->Find("f32")), SampleModel().f32);
}

TEST_F(GgufTest, EveryTruncationFailsCleanly) {
  Bytes full = SampleModel().Writer().Build();
  for (size_t cut = 0; cut < full.size(); ++cut) {
    SCOPED_TRACE("truncated to " + std::to_string(cut) + " bytes");
    ExpectFailure(Bytes(full.begin(), full.begin() + cut), StatusCode::kCorruptFile);
  }
}

// Random byte damage anywhere must never crash; whatever opens must still be self-consistent.
TEST_F(GgufTest, RandomCorruptionNeverCrashes) {
  Bytes full = SampleModel().Writer().Build();
  std::mt19937 rng(42);
  std::string path = dir_.File("fuzz.gguf");
  for (int trial = 0; trial < 3000; ++trial) {
    Bytes bytes = full;
    for (int k = 0; k < 1 + trial % 4; ++k) {
      bytes[rng() % bytes.size()] = static_cast<uint8_t>(rng());
    }
    test::WriteFile(path, bytes);
    Result<std::unique_ptr<GgufFile>> g = GgufFile::Open(path);
    if (!g.ok()) {
      EXPECT_NE(g.status().message().find(path), std::string::npos) << g.status().ToString();
      continue;
    }
    for (const std::string& name : (*g)->Names()) {
      const TensorInfo* info = (*g)->Find(name);
      std::vector<float> out(info->numel());
      EXPECT_TRUE(DequantizeToF32(*info, out.data()).ok());
    }
    for (const std::string& key : (*g)->Keys()) {
      (void)(*g)->GetString(key);
      (void)(*g)->GetStringArray(key);
      (void)(*g)->GetIntArray(key);
    }
  }
}

TEST_F(GgufTest, RejectsBadMagicAndVersion) {
  Bytes bytes = SampleModel().Writer().Build();
  Bytes bad_magic = bytes;
  bad_magic[0] = 'X';
  EXPECT_NE(ExpectFailure(bad_magic, StatusCode::kCorruptFile).find("magic"), std::string::npos);
  Bytes v1 = bytes;
  Poke(&v1, 4, uint32_t{1});
  ExpectFailure(v1, StatusCode::kUnsupported);
  Bytes v99 = bytes;
  Poke(&v99, 4, uint32_t{99});
  ExpectFailure(v99, StatusCode::kCorruptFile);
  ExpectFailure(Bytes{}, StatusCode::kCorruptFile);
}

TEST_F(GgufTest, RejectsAbsurdCounts) {
  GgufWriter w;
  w.AddRaw("arr", test::kArray, GgufWriter::ArrayOf<uint32_t>(test::kU32, {1, 2, 3}));
  w.AddTensor("t", test::kGgmlF32, {32}, test::ToBytes(test::RandomFloats(32, 1)));
  const Bytes good = w.Build();
  ASSERT_TRUE(GgufFile::Open(Write(good)).ok());
  // Layout: magic 0, version 4, tensor count 8, kv count 16, key length 24, key 32, type 35,
  // element type 39, element count 43.
  for (auto [offset, value] : {std::pair<size_t, uint64_t>{8, uint64_t{1} << 60},
                               {16, uint64_t{1} << 60},
                               {8, ~uint64_t{0}},
                               {24, ~uint64_t{0} - 3},
                               {43, uint64_t{1} << 62},
                               {43, 4}}) {
    Bytes bytes = good;
    Poke(&bytes, offset, value);
    SCOPED_TRACE("offset " + std::to_string(offset));
    ExpectFailure(bytes, StatusCode::kCorruptFile);
  }
  Bytes bad_value_type = good;
  Poke(&bad_value_type, 35, uint32_t{13});
  ExpectFailure(bad_value_type, StatusCode::kCorruptFile);
}

TEST_F(GgufTest, RejectsDeepNesting) {
  // 100 arrays each holding one array: must be refused without deep recursion.
  Bytes nested;
  for (int depth = 0; depth < 100; ++depth) {
    test::Append(&nested, static_cast<uint32_t>(test::kArray));
    test::Append(&nested, uint64_t{1});
  }
  test::Append(&nested, static_cast<uint32_t>(test::kU8));
  test::Append(&nested, uint64_t{0});
  GgufWriter w;
  w.AddRaw("deep", test::kArray, nested);
  ExpectFailure(w.Build(), StatusCode::kCorruptFile);
}

TEST_F(GgufTest, RejectsBadTensorPlacement) {
  Bytes data = test::ToBytes(test::RandomFloats(32, 1));
  auto build = [&](std::optional<uint64_t> second_offset, uint32_t alignment = 32) {
    GgufWriter w;
    if (alignment != 32) w.SetAlignment(alignment);
    w.AddTensor("a", test::kGgmlF32, {32}, data);
    w.AddTensor("b", test::kGgmlF32, {32}, data, second_offset);
    return w.Build();
  };
  ASSERT_TRUE(GgufFile::Open(Write(build(std::nullopt))).ok());
  EXPECT_NE(ExpectFailure(build(uint64_t{1} << 40), StatusCode::kCorruptFile).find("'b'"),
            std::string::npos);
  EXPECT_NE(ExpectFailure(build(4), StatusCode::kCorruptFile).find("aligned"), std::string::npos);
  EXPECT_NE(ExpectFailure(build(0), StatusCode::kCorruptFile).find("overlaps"), std::string::npos);
  EXPECT_NE(ExpectFailure(build(192), StatusCode::kCorruptFile).find("past the end"),
            std::string::npos);
  ExpectFailure(build(std::nullopt, /*alignment=*/48), StatusCode::kCorruptFile);
  ExpectFailure(build(std::nullopt, /*alignment=*/0), StatusCode::kCorruptFile);
}

TEST_F(GgufTest, RejectsBadTensorInfos) {
  Bytes q8 = test::QuantizeQ8_0(test::RandomFloats(64, 2));
  {
    GgufWriter w;  // the quantized innermost dimension must hold whole blocks
    w.AddTensor("ragged", test::kGgmlQ8_0, {32, 2}, q8);
    ExpectFailure(w.Build(), StatusCode::kCorruptFile);
  }
  {
    GgufWriter w;
    w.AddTensor("five_d", test::kGgmlQ8_0, {1, 1, 1, 1, 64}, q8);
    ExpectFailure(w.Build(), StatusCode::kCorruptFile);
  }
  {
    GgufWriter w;
    w.AddTensor("huge", test::kGgmlF32, {int64_t{1} << 40, int64_t{1} << 20}, q8);
    ExpectFailure(w.Build(), StatusCode::kCorruptFile);
  }
  {
    GgufWriter w;  // no elements, but extents whose product overflows when multiplied outermost first
    w.AddTensor("empty_but_huge", test::kGgmlF32, {int64_t{1} << 40, int64_t{1} << 40, 0}, Bytes{});
    ExpectFailure(w.Build(), StatusCode::kCorruptFile);
  }
  {
    GgufWriter w;
    w.AddTensor("twice", test::kGgmlQ8_0, {64}, q8);
    w.AddTensor("twice", test::kGgmlQ8_0, {64}, q8);
    ExpectFailure(w.Build(), StatusCode::kCorruptFile);
  }
  {
    GgufWriter w;
    w.AddTensor("garbage_type", 1000, {64}, q8);
    ExpectFailure(w.Build(), StatusCode::kCorruptFile);
  }
  {
    GgufWriter w;
    w.Add("k", test::kU32, uint32_t{1});
    w.Add("k", test::kU32, uint32_t{2});
    ExpectFailure(w.Build(), StatusCode::kCorruptFile);
  }
}

TEST_F(GgufTest, RefusesUnsupportedTensorTypes) {
  // Q8_K (292-byte blocks) and IQ4_XS (136) are types kvflow cannot dequantize.
  for (auto [type, name, block_bytes] : {std::tuple<uint32_t, const char*, size_t>{test::kGgmlQ8_K, "Q8_K", 292},
                                         {test::kGgmlIQ4_XS, "IQ4_XS", 136}}) {
    GgufWriter w;
    w.AddTensor("blk.0.attn_q.weight", test::kGgmlQ6_K, {256}, test::RandomKQuantBlocks(test::kGgmlQ6_K, 1, 1));
    w.AddTensor("blk.0.ffn_down.weight", type, {256}, Bytes(block_bytes, 7));
    std::string message = ExpectFailure(w.Build(), StatusCode::kUnsupported);
    EXPECT_NE(message.find("blk.0.ffn_down.weight"), std::string::npos) << message;
    EXPECT_NE(message.find(name), std::string::npos) << message;
    EXPECT_NE(message.find("supported: "), std::string::npos) << message;
  }
}

// K-quant tensors get the same checks as the others, with 256-element blocks.
TEST_F(GgufTest, RejectsBadKQuantTensors) {
  const Bytes two_blocks = test::RandomKQuantBlocks(test::kGgmlQ4_K, 2, 3);
  {
    GgufWriter w;
    w.AddTensor("ok", test::kGgmlQ4_K, {2, 256}, two_blocks);
    Result<std::unique_ptr<GgufFile>> g = GgufFile::Open(Write(w.Build()));
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    EXPECT_EQ((*g)->Find("ok")->nbytes, 288u);
  }
  {
    GgufWriter w;  // whole 32-blocks, but not whole super-blocks
    w.AddTensor("ragged", test::kGgmlQ4_K, {4, 128}, two_blocks);
    std::string message = ExpectFailure(w.Build(), StatusCode::kCorruptFile);
    EXPECT_NE(message.find("Q4_K block size (256)"), std::string::npos) << message;
  }
  {
    GgufWriter w;  // the shape claims three blocks, the file holds two
    w.AddTensor("short", test::kGgmlQ6_K, {768}, test::RandomKQuantBlocks(test::kGgmlQ6_K, 2, 4));
    EXPECT_NE(ExpectFailure(w.Build(), StatusCode::kCorruptFile).find("past the end"), std::string::npos);
  }
  {
    GgufWriter w;  // an offset that lies: the second tensor starts inside the first
    w.AddTensor("a", test::kGgmlQ4_K, {2, 256}, two_blocks);
    w.AddTensor("b", test::kGgmlQ4_K, {2, 256}, two_blocks, /*offset=*/256);
    EXPECT_NE(ExpectFailure(w.Build(), StatusCode::kCorruptFile).find("overlaps"), std::string::npos);
  }
  {
    GgufWriter w;  // an offset past the end of the file
    w.AddTensor("a", test::kGgmlQ5_K, {256}, test::RandomKQuantBlocks(test::kGgmlQ5_K, 1, 5),
                /*offset=*/uint64_t{1} << 32);
    ExpectFailure(w.Build(), StatusCode::kCorruptFile);
  }
}

// ---- tokenizer metadata -----------------------------------------------------------------------

GgufWriter TokenizerWriter() {
  GgufWriter w;
  w.AddString("tokenizer.ggml.model", "gpt2");
  w.AddString("tokenizer.ggml.pre", "smollm");
  w.AddStringArray("tokenizer.ggml.tokens", {"<|endoftext|>", "<|im_start|>", "a", "b", "ab"});
  w.AddRaw("tokenizer.ggml.token_type", test::kArray,
           GgufWriter::ArrayOf<int32_t>(test::kI32, {3, 3, 1, 1, 1}));
  w.AddStringArray("tokenizer.ggml.merges", {"a b"});
  w.Add("tokenizer.ggml.bos_token_id", test::kU32, uint32_t{1});
  w.Add("tokenizer.ggml.eos_token_id", test::kU32, uint32_t{0});
  w.Add("tokenizer.ggml.padding_token_id", test::kU32, uint32_t{0});
  w.Add("tokenizer.ggml.add_bos_token", test::kBool, uint8_t{1});
  w.AddString("tokenizer.chat_template", "{{ messages }}");
  return w;
}

TEST_F(GgufTest, ReadsTokenizerSpec) {
  Result<std::unique_ptr<GgufFile>> g = GgufFile::Open(Write(TokenizerWriter().Build()));
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  Result<TokenizerSpec> spec = TokenizerSpecFromGguf(**g);
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  EXPECT_EQ(spec->pre, "smollm");
  EXPECT_EQ(spec->tokens.size(), 5u);
  EXPECT_EQ(spec->tokens[4], "ab");
  EXPECT_EQ(spec->token_types, (std::vector<int32_t>{3, 3, 1, 1, 1}));
  EXPECT_EQ(spec->merges, (std::vector<std::string>{"a b"}));
  EXPECT_EQ(spec->bos_id, 1);
  EXPECT_EQ(spec->eos_id, 0);
  EXPECT_EQ(spec->unk_id, -1);
  EXPECT_EQ(spec->pad_id, 0);
  EXPECT_TRUE(spec->add_bos);
  EXPECT_EQ(spec->chat_template, "{{ messages }}");
}

TEST_F(GgufTest, TokenizerSpecErrors) {
  GgufWriter bad_id = TokenizerWriter();
  bad_id.Add("tokenizer.ggml.unknown_token_id", test::kU32, uint32_t{5});
  Result<std::unique_ptr<GgufFile>> g = GgufFile::Open(Write(bad_id.Build()));
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(TokenizerSpecFromGguf(**g).status().code(), StatusCode::kCorruptFile);

  GgufWriter wordpiece;
  wordpiece.AddString("tokenizer.ggml.model", "bert");
  g = GgufFile::Open(Write(wordpiece.Build()));
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(TokenizerSpecFromGguf(**g).status().code(), StatusCode::kUnsupported);

  // SentencePiece merges by score: a vocabulary without scores is broken.
  GgufWriter spm;
  spm.AddString("tokenizer.ggml.model", "llama");
  spm.AddStringArray("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "a"});
  g = GgufFile::Open(Write(spm.Build()));
  ASSERT_TRUE(g.ok());
  const Status no_scores = TokenizerSpecFromGguf(**g).status();
  EXPECT_EQ(no_scores.code(), StatusCode::kCorruptFile);
  EXPECT_NE(no_scores.message().find("scores"), std::string::npos) << no_scores.message();

  g = GgufFile::Open(Write(GgufWriter().Build()));
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(TokenizerSpecFromGguf(**g).status().code(), StatusCode::kNotFound);
}

// ---- config -----------------------------------------------------------------------------------

GgufWriter LlamaMetadata() {
  GgufWriter w;
  w.AddString("general.architecture", "llama");
  w.AddString("general.name", "tiny");
  w.Add("llama.block_count", test::kU32, uint32_t{2});
  w.Add("llama.context_length", test::kU32, uint32_t{4096});
  w.Add("llama.embedding_length", test::kU32, uint32_t{64});
  w.Add("llama.feed_forward_length", test::kU32, uint32_t{160});
  w.Add("llama.attention.head_count", test::kU32, uint32_t{8});
  w.Add("llama.attention.head_count_kv", test::kU32, uint32_t{2});
  w.Add("llama.rope.freq_base", test::kF32, 500000.0f);
  w.Add("llama.attention.layer_norm_rms_epsilon", test::kF32, 1e-6f);
  w.AddString("llama.rope.scaling.type", "linear");
  w.Add("llama.rope.scaling.factor", test::kF32, 4.0f);
  w.AddStringArray("tokenizer.ggml.tokens", std::vector<std::string>(100, "x"));
  w.Add("tokenizer.ggml.bos_token_id", test::kU32, uint32_t{1});
  w.Add("tokenizer.ggml.eos_token_id", test::kU32, uint32_t{2});
  w.Add("tokenizer.ggml.eot_token_id", test::kU32, uint32_t{3});
  return w;
}

TEST_F(GgufTest, ModelConfigFromMetadata) {
  GgufWriter w = LlamaMetadata();
  w.AddTensor("output.weight", test::kGgmlF32, {100, 64}, Bytes(100 * 64 * 4, 1));
  Result<std::unique_ptr<GgufFile>> g = GgufFile::Open(Write(w.Build()));
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  Result<ModelConfig> c = ModelConfigFromGguf(**g);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->name, "tiny");
  EXPECT_EQ(c->num_layers, 2);
  EXPECT_EQ(c->hidden_size, 64);
  EXPECT_EQ(c->intermediate_size, 160);
  EXPECT_EQ(c->num_heads, 8);
  EXPECT_EQ(c->num_kv_heads, 2);
  EXPECT_EQ(c->head_dim, 8);
  EXPECT_EQ(c->vocab_size, 100);  // from the token list
  EXPECT_EQ(c->max_position_embeddings, 4096);
  EXPECT_FLOAT_EQ(c->rope_theta, 500000.0f);
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-6f);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kLinear);
  EXPECT_FLOAT_EQ(c->rope_scaling.factor, 4.0f);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->bos_token_id, 1);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int>{2, 3}));
  EXPECT_TRUE(c->Validate().ok()) << c->Validate().ToString();
}

TEST_F(GgufTest, ModelConfigDetectsTiedEmbeddingsAndBadArchitectures) {
  Result<std::unique_ptr<GgufFile>> g = GgufFile::Open(Write(LlamaMetadata().Build()));
  ASSERT_TRUE(g.ok());
  EXPECT_TRUE(ModelConfigFromGguf(**g)->tie_word_embeddings);

  GgufWriter other;
  other.AddString("general.architecture", "gptneox");
  g = GgufFile::Open(Write(other.Build()));
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(ModelConfigFromGguf(**g).status().code(), StatusCode::kUnsupported);

  GgufWriter incomplete;
  incomplete.AddString("general.architecture", "llama");
  g = GgufFile::Open(Write(incomplete.Build()));
  ASSERT_TRUE(g.ok());
  Status st = ModelConfigFromGguf(**g).status();
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  EXPECT_NE(st.message().find("llama.block_count"), std::string::npos) << st.message();
}

// q/k norm tensors decide Qwen3's per-head norms; a Qwen3 without them, or another architecture
// with them, is refused rather than run without (or with) norms it does not expect.
TEST_F(GgufTest, ModelConfigQkNormFollowsTheTensors) {
  auto metadata = [](const std::string& arch) {
    GgufWriter w;
    w.AddString("general.architecture", arch);
    for (const char* key : {"embedding_length", "feed_forward_length"}) w.Add(arch + "." + key, test::kU32, uint32_t{64});
    w.Add(arch + ".block_count", test::kU32, uint32_t{1});
    w.Add(arch + ".attention.head_count", test::kU32, uint32_t{4});
    w.AddStringArray("tokenizer.ggml.tokens", std::vector<std::string>(100, "x"));
    return w;
  };
  GgufWriter qwen3 = metadata("qwen3");
  qwen3.AddTensor("blk.0.attn_q_norm.weight", test::kGgmlF32, {16}, Bytes(16 * 4, 1));
  Result<std::unique_ptr<GgufFile>> g = GgufFile::Open(Write(qwen3.Build()));
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  Result<ModelConfig> c = ModelConfigFromGguf(**g);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->qk_norm);
  EXPECT_EQ(c->architecture, "qwen3");

  g = GgufFile::Open(Write(metadata("qwen3").Build()));
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(ModelConfigFromGguf(**g).status().code(), StatusCode::kCorruptFile);

  GgufWriter llama = metadata("llama");
  llama.AddTensor("blk.0.attn_q_norm.weight", test::kGgmlF32, {16}, Bytes(16 * 4, 1));
  g = GgufFile::Open(Write(llama.Build()));
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(ModelConfigFromGguf(**g).status().code(), StatusCode::kUnsupported);

  // Experts: merged tensors are Mixtral's; one tensor per expert (old files) or shared experts are refused.
  GgufWriter per_expert = metadata("llama");
  per_expert.Add("llama.expert_count", test::kU32, uint32_t{4});
  per_expert.Add("llama.expert_used_count", test::kU32, uint32_t{2});
  g = GgufFile::Open(Write(per_expert.Build()));
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(ModelConfigFromGguf(**g).status().code(), StatusCode::kUnsupported);
  GgufWriter merged = metadata("llama");
  merged.Add("llama.expert_count", test::kU32, uint32_t{4});
  merged.Add("llama.expert_used_count", test::kU32, uint32_t{2});
  merged.AddTensor("blk.0.ffn_gate_exps.weight", test::kGgmlF32, {64, 64, 4}, Bytes(64 * 64 * 4 * 4, 1));
  g = GgufFile::Open(Write(merged.Build()));
  ASSERT_TRUE(g.ok());
  c = ModelConfigFromGguf(**g);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->num_experts, 4);
  EXPECT_EQ(c->experts_per_token, 2);
  EXPECT_TRUE(c->norm_topk_prob) << "llama.cpp's Mixtral renormalizes";
  merged.Add("llama.expert_shared_feed_forward_length", test::kU32, uint32_t{128});
  g = GgufFile::Open(Write(merged.Build()));
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(ModelConfigFromGguf(**g).status().code(), StatusCode::kUnsupported) << "a shared expert is Qwen2-MoE's";
}

// Phi-3's LongRoPE from GGUF: the factor lists are tensors (both needed, and only in a phi3), the
// original context and the cos/sin scale are keys.
TEST_F(GgufTest, ModelConfigReadsLongRopeFactorTensors) {
  auto phi3 = [](bool long_factors, bool short_factors) {
    GgufWriter w;
    w.AddString("general.architecture", "phi3");
    for (const char* key : {"phi3.embedding_length", "phi3.feed_forward_length"}) w.Add(key, test::kU32, uint32_t{64});
    w.Add("phi3.block_count", test::kU32, uint32_t{1});
    w.Add("phi3.attention.head_count", test::kU32, uint32_t{4});  // head_dim 16: 8 factors
    w.Add("phi3.context_length", test::kU32, uint32_t{4096});
    w.Add("phi3.rope.scaling.original_context_length", test::kU32, uint32_t{1024});
    w.Add("phi3.rope.scaling.attn_factor", test::kF32, 1.1f);
    w.AddStringArray("tokenizer.ggml.tokens", std::vector<std::string>(100, "x"));
    std::vector<float> factors = {1, 2, 3, 4, 5, 6, 7, 8};
    if (long_factors) w.AddTensor("rope_factors_long.weight", test::kGgmlF32, {8}, test::ToBytes(factors));
    for (float& f : factors) f *= 0.5f;
    if (short_factors) w.AddTensor("rope_factors_short.weight", test::kGgmlF32, {8}, test::ToBytes(factors));
    return w;
  };
  Result<std::unique_ptr<GgufFile>> g = GgufFile::Open(Write(phi3(true, true).Build()));
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  Result<ModelConfig> c = ModelConfigFromGguf(**g);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const RopeScaling& rope = c->rope_scaling;
  EXPECT_EQ(rope.type, RopeScaling::Type::kLongRope);
  EXPECT_EQ(rope.original_max_position_embeddings, 1024);
  EXPECT_FLOAT_EQ(rope.attention_factor, 1.1f);
  EXPECT_EQ(rope.long_factor, (std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(rope.short_factor, (std::vector<float>{0.5f, 1, 1.5f, 2, 2.5f, 3, 3.5f, 4}));
  EXPECT_TRUE(c->Validate().ok()) << c->Validate().ToString();

  g = GgufFile::Open(Write(phi3(true, false).Build()));
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(ModelConfigFromGguf(**g).status().code(), StatusCode::kCorruptFile) << "one factor list alone";
}

// ---- the real SmolLM2 file, when present --------------------------------------------------------

const std::string kSmolLM2Path =
    std::string(KVFLOW_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";

TEST(GgufSmolLM2, OpensAndDequantizesEveryTensor) {
  const std::string& path = kSmolLM2Path;
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " not present; copy it there to run";

  Result<ModelFiles> files = OpenModelFiles(path);
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  const ModelConfig& c = files->config;
  EXPECT_EQ(c.num_layers, 30);
  EXPECT_EQ(c.hidden_size, 576);
  EXPECT_EQ(c.num_heads, 9);
  EXPECT_EQ(c.num_kv_heads, 3);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.intermediate_size, 1536);
  EXPECT_EQ(c.vocab_size, 49152);
  EXPECT_EQ(c.max_position_embeddings, 8192);
  EXPECT_FLOAT_EQ(c.rope_theta, 100000.0f);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-5f);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int>{2}));
  EXPECT_TRUE(files->gguf_rope_permuted);
  EXPECT_NE(files->tokenizer, nullptr);

  const TensorSource& tensors = *files->tensors;
  EXPECT_EQ(tensors.Names().size(), 272u);
  const TensorInfo* embedding = tensors.Find("token_embd.weight");
  ASSERT_NE(embedding, nullptr);
  EXPECT_EQ(embedding->shape, (std::vector<int64_t>{49152, 576}));
  EXPECT_EQ(embedding->dtype, DType::kQ8_0);
  EXPECT_EQ(tensors.Find("blk.0.ffn_down.weight")->shape, (std::vector<int64_t>{576, 1536}));
  EXPECT_EQ(tensors.Find("blk.0.ffn_down.weight")->dtype, DType::kQ4_1);

  std::vector<float> out;
  for (const std::string& name : tensors.Names()) {
    const TensorInfo* info = tensors.Find(name);
    out.assign(info->numel(), std::nanf(""));
    ASSERT_TRUE(DequantizeToF32(*info, out.data()).ok()) << name;
    double sum_abs = 0;
    for (float v : out) {
      ASSERT_TRUE(std::isfinite(v)) << name;
      sum_abs += std::fabs(v);
    }
    EXPECT_GT(sum_abs, 0.0) << name;
  }
}

// Cuts through the real 1.8 MB header (49k tokens, 49k merges) and through the tensor data.
TEST(GgufSmolLM2, TruncatedCopiesFail) {
  if (!std::filesystem::exists(kSmolLM2Path)) GTEST_SKIP() << kSmolLM2Path << " not present";
  std::ifstream in(kSmolLM2Path, std::ios::binary);
  Bytes full((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  test::ScratchDir dir("smol");
  const std::string path = dir.File("cut.gguf");
  std::vector<size_t> cuts = {full.size() - 1, full.size() / 2};
  for (size_t cut = 0; cut < 2'000'000; cut += 20'011) cuts.push_back(cut);
  for (size_t cut : cuts) {
    test::WriteFile(path, Bytes(full.begin(), full.begin() + cut));
    Result<std::unique_ptr<GgufFile>> g = GgufFile::Open(path);
    ASSERT_FALSE(g.ok()) << "cut at " << cut;
    EXPECT_EQ(g.status().code(), StatusCode::kCorruptFile) << g.status().ToString();
    EXPECT_NE(g.status().message().find(path), std::string::npos) << g.status().ToString();
  }
}

}  // namespace
}  // namespace kvflow
