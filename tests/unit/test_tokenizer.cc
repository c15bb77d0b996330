#include "kvflow/tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "model/gguf.h"
#include "model/pretokenizer.h"
#include "model/tensor_source.h"

namespace kvflow {
namespace {

// The GPT-2 byte-level form of a byte string (printable ASCII stays, ' ' -> U+0120 'Ġ', ...).
std::string ByteLevel(std::string_view bytes) {
  std::string out;
  for (unsigned char b : bytes) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    uint32_t cp = b;
    if (!printable) {
      cp = 256;
      for (unsigned c = 0; c < b; ++c) {
        const bool p = (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE;
        if (!p) ++cp;
      }
    }
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp));
    } else {
      out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }
  return out;
}

// A vocabulary of the 256 byte tokens (ids 0..255 in byte order) plus `extra` tokens after them.
TokenizerSpec ByteSpec(const std::vector<std::string>& extra,
                       const std::vector<std::string>& merges) {
  TokenizerSpec spec;
  for (int b = 0; b < 256; ++b) {
    spec.tokens.push_back(ByteLevel(std::string(1, static_cast<char>(b))));
  }
  for (const std::string& t : extra) spec.tokens.push_back(t);
  spec.token_types.assign(spec.tokens.size(), 1);
  spec.merges = merges;
  return spec;
}

std::unique_ptr<Tokenizer> Build(TokenizerSpec spec) {
  auto tok = Tokenizer::FromSpec(std::move(spec));
  EXPECT_TRUE(tok.ok()) << tok.status().ToString();
  return tok.ok() ? std::move(tok).value() : nullptr;
}

std::vector<std::string> Texts(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  std::vector<std::string> out;
  for (int32_t id : ids) out.push_back(tok.token_text(id));
  return out;
}

std::vector<std::string> Split(const char* pre, std::string_view text) {
  auto p = PreTokenizer::FromName(pre);
  EXPECT_TRUE(p.ok());
  std::vector<std::string_view> pieces;
  p->Split(text, &pieces);
  return {pieces.begin(), pieces.end()};
}

TEST(TokenizerPreTokenizer, Gpt2RegexMatchesHf) {
  // Expected pieces come from HF tokenizers' ByteLevel(use_regex=true).pre_tokenize_str.
  EXPECT_EQ(Split("gpt2", "Hello world's  x\n\n 12345 I'M\r\n\tok!!"),
            (std::vector<std::string>{"Hello", " world", "'s", " ", " x", "\n\n", " 12345", " I",
                                      "'", "M", "\r\n", "\t", "ok", "!!"}));
}

TEST(TokenizerPreTokenizer, SmolLmIsolatesEachDigit) {
  // Digits(individual_digits=true) runs first, so "\n\n " keeps its space before the digits.
  EXPECT_EQ(Split("smollm", "Hello world's  x\n\n 12345 I'M"),
            (std::vector<std::string>{"Hello", " world", "'s", " ", " x", "\n\n ", "1", "2", "3",
                                      "4", "5", " I", "'", "M"}));
  EXPECT_EQ(Split("smollm", "x\u00bd\u0663"), (std::vector<std::string>{"x", "\u00bd", "\u0663"}));
}

TEST(TokenizerPreTokenizer, Llama3RegexMatchesHf) {
  EXPECT_EQ(Split("llama-bpe", "Hello world's  x\n\n 12345 I'M\r\n\tok!!"),
            (std::vector<std::string>{"Hello", " world", "'s", " ", " x", "\n\n", " ", "123", "45",
                                      " I", "'M", "\r\n", "\tok", "!!"}));
  EXPECT_EQ(Split("llama-bpe", "a  \n b.\n\n"),
            (std::vector<std::string>{"a", "  \n", " b", ".\n\n"}));
}

// Expected pieces from HF tokenizers 0.20.3 with each model's real pre_tokenizer Sequence (pieces
// given back as the bytes they spell).
constexpr std::string_view kMixedText =
    "Hello world's  x\n\n 12345 I'M\r\n\tok!! $a+=b; 漢字カナ 한국 ½";

TEST(TokenizerPreTokenizer, DeepSeekCoderMatchesHf) {
  EXPECT_EQ(Split("deepseek-coder", kMixedText),
            (std::vector<std::string>{"Hello", " world", "'", "s", " ", " x", "\n", "\n", " ", "1",
                                      "2", "3", "4", "5", " I", "'", "M", "\r", "\n", "\tok", "!!",
                                      " $", "a", "+=", "b", ";", " ", "漢字カナ", " ",
                                      "한국", " ", "½"}));
}

TEST(TokenizerPreTokenizer, FalconMatchesHf) {
  // Falcon's Digits stage runs on GPT-2's byte spelling, where the UTF-8 continuation bytes 0xBC
  // and 0xBD read as "¼" and "½": "漢" (E6 BC A2) and "½" (C2 BD) part inside the character.
  EXPECT_EQ(Split("falcon", kMixedText),
            (std::vector<std::string>{"Hello", " world", "'", "s", " ", " x", "\n\n", " ", "123",
                                      "45", " I", "'", "M", "\r\n", "\t", "ok", "!!", " ", "$", "a",
                                      "+=", "b", ";", " \xE6", "\xBC",
                                      "\xA2\xE5\xAD\x97\xE3\x82\xAB\xE3\x83\x8A",
                                      " \xED\x95\x9C\xEA\xB5\xAD", " \xC2", "\xBD"}));
}

TEST(TokenizerPreTokenizer, StarCoderMatchesHf) {
  EXPECT_EQ(Split("starcoder", kMixedText),
            (std::vector<std::string>{"Hello", " world", "'s", " ", " x", "\n\n ", "1", "2", "3", "4",
                                      "5", " I", "'", "M", "\r\n", "\t", "ok", "!!", " $", "a", "+=",
                                      "b", ";", " 漢字カナ", " 한국", " ",
                                      "½"}));
}

// Text mixing the cases the matchers branch on, plus bytes that are not valid UTF-8.
std::string RandomText(std::mt19937* rng, size_t fragments) {
  static const std::vector<std::string> kFragments = {
      "a", "Zz", "'s", "'LL", "'", "7", "123", "\u00bd", " ", "  ", "\t", "\n", "\r\n", "\u00a0",
      "\u3000", ".", "!?", "\u00e9", "\u6f22", "\U0001F600", "\xE2\x82", "\xFF", "\x80", "\xF0",
      "$", "+=", "\u30ab", "\ud55c", "\u3001", "\u2581"};
  std::uniform_int_distribution<size_t> pick(0, kFragments.size() - 1);
  std::string text;
  for (size_t i = 0; i < fragments; ++i) text += kFragments[pick(*rng)];
  return text;
}

TEST(TokenizerPreTokenizer, PiecesCoverAnyInput) {
  std::mt19937 rng(42);
  for (const char* pre : {"gpt2", "smollm", "llama-bpe", "qwen2", "falcon", "deepseek-coder"}) {
    for (int round = 0; round < 200; ++round) {
      const std::string text = RandomText(&rng, round % 40);
      std::string joined;
      for (const std::string& piece : Split(pre, text)) {
        ASSERT_FALSE(piece.empty()) << pre;
        joined += piece;
      }
      ASSERT_EQ(joined, text) << pre;
    }
  }
}

TEST(TokenizerPreTokenizer, UnknownNameIsUnsupported) {
  auto p = PreTokenizer::FromName("jais");
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(p.status().message().find("jais"), std::string::npos);
}

TEST(TokenizerBpe, LowerRankMergesFirst) {
  // "abc": with "a b" ranked first the result is ab|c; with "b c" first it is a|bc.
  auto ab_first = Build(ByteSpec({"ab", "bc"}, {"a b", "b c"}));
  auto bc_first = Build(ByteSpec({"ab", "bc"}, {"b c", "a b"}));
  ASSERT_TRUE(ab_first && bc_first);
  EXPECT_EQ(Texts(*ab_first, ab_first->Encode("abc")), (std::vector<std::string>{"ab", "c"}));
  EXPECT_EQ(Texts(*bc_first, bc_first->Encode("abc")), (std::vector<std::string>{"a", "bc"}));
}

TEST(TokenizerBpe, MergesChainAndStayInsidePreTokens) {
  auto tok = Build(ByteSpec({"he", "ll", "hell", "hello", "Ġw", "Ġwo", "oĠ"},
                            {"h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "o Ġ"}));
  ASSERT_TRUE(tok);
  // "o Ġ" never applies: "hello" and " wo" are separate pre-tokens.
  EXPECT_EQ(Texts(*tok, tok->Encode("hello wo")), (std::vector<std::string>{"hello", "Ġwo"}));
  EXPECT_EQ(tok->Encode("hello"), std::vector<int32_t>{tok->token_id("hello")});
}

TEST(TokenizerBpe, RepeatedPairMergesLeftmostFirst) {
  auto tok = Build(ByteSpec({"aa"}, {"a a"}));
  ASSERT_TRUE(tok);
  EXPECT_EQ(Texts(*tok, tok->Encode("aaa")), (std::vector<std::string>{"aa", "a"}));
  EXPECT_EQ(Texts(*tok, tok->Encode("aaaa")), (std::vector<std::string>{"aa", "aa"}));
}

TEST(TokenizerBpe, IgnoreMergesUsesWholeWordFromVocab) {
  TokenizerSpec spec = ByteSpec({"xyz"}, {});
  EXPECT_EQ(Build(spec)->Encode("xyz").size(), 3u);
  spec.ignore_merges = true;
  auto tok = Build(spec);
  EXPECT_EQ(tok->Encode("xyz"), std::vector<int32_t>{tok->token_id("xyz")});
}

TEST(TokenizerBpe, BadMergeIsAnError) {
  auto tok = Tokenizer::FromSpec(ByteSpec({}, {"a b"}));  // "ab" is not in the vocabulary
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), StatusCode::kCorruptFile);
  EXPECT_NE(tok.status().message().find("'a b'"), std::string::npos);
}

TEST(TokenizerSpecial, LiteralSpecialTokensBypassBpe) {
  TokenizerSpec spec = ByteSpec({"<|end|>", "<|end|>!", "<x>"}, {});
  const int32_t end = 256, end_bang = 257, user = 258;
  spec.token_types[end] = 3;
  spec.token_types[end_bang] = 3;
  spec.token_types[user] = 4;  // user-defined: matched literally, but not skipped when decoding
  spec.eos_id = end;
  auto tok = Build(spec);
  ASSERT_TRUE(tok);

  const std::vector<int32_t> ids = tok->Encode("hi<|end|><|end|>!<x>");
  EXPECT_EQ(ids, (std::vector<int32_t>{'h', 'i', end, end_bang, user}));  // longest match wins
  EXPECT_TRUE(tok->is_special(end));
  EXPECT_FALSE(tok->is_special(user));
  EXPECT_EQ(tok->Decode(ids), "hi<x>");
  EXPECT_EQ(tok->Decode(ids, /*skip_special=*/false), "hi<|end|><|end|>!<x>");

  const std::vector<int32_t> plain = tok->Encode("hi<|end|>", false, /*parse_special=*/false);
  EXPECT_EQ(plain.size(), 9u);
  EXPECT_EQ(tok->Decode(plain), "hi<|end|>");
}

TEST(TokenizerSpecial, AddBosPrependsBos) {
  TokenizerSpec spec = ByteSpec({"<s>"}, {});
  spec.token_types[256] = 3;
  spec.bos_id = 256;
  auto tok = Build(spec);
  EXPECT_EQ(tok->Encode("a", /*add_bos=*/true), (std::vector<int32_t>{256, 'a'}));
  EXPECT_EQ(tok->Encode("a", /*add_bos=*/false), (std::vector<int32_t>{'a'}));
}

TEST(TokenizerDecode, RoundTripsMixedText) {
  auto tok = Build(ByteSpec({"he", "ll"}, {"h e", "l l"}));
  ASSERT_TRUE(tok);
  const std::string text =
      "hello  wörld\t\n\n 1234 😀👍🏽 漢字かな 'tis I'LL\r\n   e\u0301 \u00a0end";
  EXPECT_EQ(tok->Decode(tok->Encode(text)), text);
}

TEST(TokenizerDecode, AnyBytesRoundTrip) {
  std::mt19937 rng(7);
  for (const char* pre : {"gpt2", "smollm", "llama-bpe", "qwen2", "falcon", "deepseek-coder"}) {
    TokenizerSpec spec = ByteSpec({"Ġa", "'s"}, {"Ġ a", "' s"});
    spec.pre = pre;
    auto tok = Build(spec);
    ASSERT_TRUE(tok);
    for (int round = 0; round < 100; ++round) {
      const std::string text = RandomText(&rng, 30);
      ASSERT_EQ(tok->DecodeBytes(tok->Encode(text)), text) << pre;
    }
  }
}

TEST(TokenizerDecode, InvalidUtf8BecomesReplacementChar) {
  auto tok = Build(ByteSpec({}, {}));
  ASSERT_TRUE(tok);
  // 0xE2 0x82 is an incomplete euro sign, 0xFF is never valid.
  const std::vector<int32_t> ids = {'a', 0xE2, 0x82, 'b', 0xFF, 0xE2};
  EXPECT_EQ(tok->DecodeBytes(ids), "a\xE2\x82" "b\xFF\xE2");
  EXPECT_EQ(tok->Decode(ids), "a\uFFFDb\uFFFD\uFFFD");
}

TEST(TokenizerDecode, IncrementalDecoderHoldsSplitCharacter) {
  auto tok = Build(ByteSpec({}, {}));
  ASSERT_TRUE(tok);
  IncrementalDecoder dec(*tok);
  EXPECT_EQ(dec.Push('x'), "x");
  EXPECT_EQ(dec.Push(0xE2), "");  // "€" is E2 82 AC
  EXPECT_EQ(dec.Push(0x82), "");
  EXPECT_EQ(dec.Push(0xAC), "\u20AC");
  EXPECT_EQ(dec.Push(0xFF), "\uFFFD");  // can never complete: emitted at once
  EXPECT_EQ(dec.Push(0xF0), "");        // start of a 4-byte character, then the stream ends
  EXPECT_EQ(dec.Flush(), "\uFFFD");
  EXPECT_EQ(dec.Flush(), "");
}

// ---- HF tokenizer.json ----------------------------------------------------------------------

class TokenizerHfJson : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* test = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    dir_ = std::filesystem::path(::testing::TempDir()) / ("kvflow_tok_" + std::string(test));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& content) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path) << content;
    return path;
  }

  // A byte-level BPE tokenizer.json over "a", "b", "Ġ" with `pre_tokenizer` and `merges`
  // spliced in.
  static std::string TinyJson(const std::string& pre_tokenizer, const std::string& merges) {
    return R"({"version": "1.0", "normalizer": null, "decoder": {"type": "ByteLevel"},
      "added_tokens": [{"id": 5, "content": "<eos>", "special": true},
                       {"id": 6, "content": "<bos>", "special": true}],
      "pre_tokenizer": )" + pre_tokenizer + R"(,
      "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "Ġ": 2, "ab": 3, "Ġab": 4},
                "merges": )" + merges + "}}";
  }

  std::filesystem::path dir_;
};

constexpr const char* kByteLevelPre =
    R"({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true})";

TEST_F(TokenizerHfJson, ReadsBothMergeFormsAndConfig) {
  for (const char* merges : {R"(["a b", "Ġ ab"])", R"([["a", "b"], ["Ġ", "ab"]])"}) {
    const std::string path = Write("tokenizer.json", TinyJson(kByteLevelPre, merges));
    Write("tokenizer_config.json", R"({"bos_token": "<bos>", "eos_token": {"content": "<eos>"},
        "add_bos_token": true, "chat_template": "{{ messages }}"})");
    auto tok = Tokenizer::FromHfJson(path);
    ASSERT_TRUE(tok.ok()) << tok.status().ToString();
    EXPECT_EQ((*tok)->Encode("ab ab<eos>"), (std::vector<int32_t>{3, 4, 5}));
    EXPECT_EQ((*tok)->vocab_size(), 7);
    EXPECT_EQ((*tok)->bos_id(), 6);
    EXPECT_EQ((*tok)->eos_id(), 5);
    EXPECT_TRUE((*tok)->add_bos());
    EXPECT_TRUE((*tok)->is_special(5));
    EXPECT_EQ((*tok)->chat_template(), "{{ messages }}");
  }
}

TEST_F(TokenizerHfJson, RecognisesKnownPreTokenizers) {
  const std::string smollm = R"({"type": "Sequence", "pretokenizers": [
      {"type": "Digits", "individual_digits": true}, )" + std::string(kByteLevelPre) + "]}";
  const std::string llama3 = R"({"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex":
          "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}|)"
      R"( ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
       "behavior": "Isolated", "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]})";
  for (const std::string& pre : {std::string(kByteLevelPre), smollm, llama3}) {
    auto tok = Tokenizer::FromHfJson(Write("tokenizer.json", TinyJson(pre, R"(["a b"])")));
    EXPECT_TRUE(tok.ok()) << pre << ": " << tok.status().ToString();
  }
}

TEST_F(TokenizerHfJson, MissingFileIsNotFound) {
  auto tok = Tokenizer::FromHfJson((dir_ / "nope.json").string());
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), StatusCode::kNotFound);
  EXPECT_NE(tok.status().message().find("nope.json"), std::string::npos);
}

TEST_F(TokenizerHfJson, GarbledJsonIsCorrupt) {
  auto tok = Tokenizer::FromHfJson(Write("tokenizer.json", R"({"model": {"vocab": )"));
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), StatusCode::kCorruptFile);
  EXPECT_NE(tok.status().message().find("tokenizer.json"), std::string::npos);
  EXPECT_NE(tok.status().message().find("not valid JSON"), std::string::npos);
}

TEST_F(TokenizerHfJson, WrongLayoutIsCorrupt) {
  auto tok = Tokenizer::FromHfJson(Write("tokenizer.json", R"({"model": {"vocab": [1, 2]}})"));
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), StatusCode::kCorruptFile);
}

TEST_F(TokenizerHfJson, UnknownPreTokenizerIsUnsupported) {
  auto tok = Tokenizer::FromHfJson(
      Write("tokenizer.json", TinyJson(R"({"type": "Whitespace"})", R"(["a b"])")));
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(tok.status().message().find("Whitespace"), std::string::npos);
}

// A SentencePiece model as transformers converts it: BPE with byte_fallback over "▁" text.
std::string SpmJson(const std::string& normalizer, const std::string& pre, const std::string& decoder) {
  std::string vocab = R"({"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581": 3, "a": 4, "\u2581a": 5)";
  for (int b = 0; b < 256; ++b) {
    char entry[32];
    std::snprintf(entry, sizeof(entry), ", \"<0x%02X>\": %d", b, 6 + b);
    vocab += entry;
  }
  vocab += "}";
  return R"({"normalizer": )" + normalizer + R"(, "pre_tokenizer": )" + pre + R"(, "decoder": )" + decoder +
         R"(, "added_tokens": [{"id": 0, "content": "<unk>", "special": true},
                              {"id": 1, "content": "<s>", "special": true},
                              {"id": 2, "content": "</s>", "special": true, "rstrip": true}],
            "model": {"type": "BPE", "byte_fallback": true, "unk_token": "<unk>", "vocab": )" + vocab +
         R"(, "merges": ["\u2581 a"]}})";
}

constexpr const char* kLegacyNormalizer =
    R"({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]})";
constexpr const char* kLegacyDecoder =
    R"({"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]})";

TEST_F(TokenizerHfJson, SentencePieceLegacyAndMetaspace) {
  auto legacy = Tokenizer::FromHfJson(Write("tokenizer.json", SpmJson(kLegacyNormalizer, "null", kLegacyDecoder)));
  ASSERT_TRUE(legacy.ok()) << legacy.status().ToString();
  // "▁a", then the byte tokens of "é" (C3 A9), then </s> eats the newline, then "▁a" again.
  EXPECT_EQ((*legacy)->Encode("a\u00e9</s>\na"), (std::vector<int32_t>{5, 6 + 0xC3, 6 + 0xA9, 2, 5}));
  EXPECT_EQ((*legacy)->Decode({5, 6 + 0xC3, 6 + 0xA9}), "a\u00e9");
  auto metaspace = Tokenizer::FromHfJson(Write(
      "tokenizer.json",
      SpmJson("null", R"({"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": false})",
              R"({"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": false})")));
  ASSERT_TRUE(metaspace.ok()) << metaspace.status().ToString();
  EXPECT_EQ((*metaspace)->Encode("a</s>a"), (std::vector<int32_t>{5, 2, 4}));
}

TEST_F(TokenizerHfJson, SentencePieceWithoutMatchingDecoderIsUnsupported) {
  auto tok = Tokenizer::FromHfJson(Write("tokenizer.json", SpmJson(kLegacyNormalizer, "null", R"({"type": "ByteLevel"})")));
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(tok.status().message().find("decoder"), std::string::npos) << tok.status().ToString();
}

TEST_F(TokenizerHfJson, NfcNormalizerComposes) {
  std::string json = TinyJson(kByteLevelPre, R"(["a b", "Ã ¥"])");
  json.replace(json.find(R"("normalizer": null)"), 18, R"("normalizer": {"type": "NFC"})");
  json.replace(json.find(R"("ab": 3)"), 7, R"("ab": 3, "Ã": 7, "¥": 8, "Ã¥": 9)");
  auto tok = Tokenizer::FromHfJson(Write("tokenizer.json", json));
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  // "a" + COMBINING RING ABOVE composes to "å" (C3 A5), one token; without NFC it would be bytes.
  EXPECT_EQ((*tok)->Encode("a\u030a"), (std::vector<int32_t>{9}));
}

TEST_F(TokenizerHfJson, WordPieceIsUnsupported) {
  auto tok = Tokenizer::FromHfJson(Write("tokenizer.json", R"({"model": {"type": "WordPiece"}})"));
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), StatusCode::kUnsupported);
}

// ---- SmolLM2 from its GGUF (ids checked against HF tokenizers) -------------------------------

class TokenizerSmolLm : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string path =
        std::string(KVFLOW_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
    if (!std::filesystem::exists(path)) return;
    auto files = OpenModelFiles(path);
    ASSERT_TRUE(files.ok()) << files.status().ToString();
    tok_ = std::move(files.value().tokenizer).release();
  }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
  }
  void SetUp() override {
    if (tok_ == nullptr) GTEST_SKIP() << "models/SmolLM2-135M-Instruct.Q4_1.gguf is absent";
  }
  static Tokenizer* tok_;
};
Tokenizer* TokenizerSmolLm::tok_ = nullptr;

TEST_F(TokenizerSmolLm, MatchesHfIds) {
  EXPECT_EQ(tok_->vocab_size(), 49152);
  EXPECT_EQ(tok_->Encode("Hello, world! It's 2024 🙂 漢字  \n"),
            (std::vector<int32_t>{19556, 28, 905, 17, 657, 506, 216, 34, 32, 34, 36, 47526, 17097,
                                  137, 112, 36518, 32057}));
  EXPECT_EQ(tok_->Encode("<|im_start|>user\nHi there<|im_end|>\n"),
            (std::vector<int32_t>{1, 4093, 198, 26843, 665, 2, 198}));
}

TEST_F(TokenizerSmolLm, RoundTripsAndSkipsSpecials) {
  const std::string text =
      "<|im_start|>user\n数字 42, émoji 🎉🙂  tabs\t\tand\r\nnewlines<|im_end|>";
  const std::vector<int32_t> ids = tok_->Encode(text);
  EXPECT_EQ(ids.front(), tok_->bos_id());
  EXPECT_EQ(tok_->Decode(ids, /*skip_special=*/false), text);
  EXPECT_EQ(tok_->Decode(ids), "user\n数字 42, émoji 🎉🙂  tabs\t\tand\r\nnewlines");

  IncrementalDecoder dec(*tok_, /*skip_special=*/false);
  std::string streamed;
  for (int32_t id : ids) streamed += dec.Push(id);
  streamed += dec.Flush();
  EXPECT_EQ(streamed, text);
}

// ---- Real vocabularies (../shared/datasets/tokenizer_vocabs: vocabulary-only GGUFs with llama.cpp's
// test vectors, the ids Hugging Face's tokenizer gives) ---------------------------------------------

// What kvflow reads exactly today; the others must be refused with a message that names what.
// A SentencePiece vocabulary as GGUF gives it: <unk>, <s>, </s>, the 256 <0xXX> byte tokens, then
// `extra` tokens with their scores.
TokenizerSpec SpmSpec(const std::vector<std::pair<std::string, float>>& extra) {
  TokenizerSpec spec;
  spec.model = "llama";
  spec.space_prefix = TokenizerSpec::SpacePrefix::kAfterSpecial;
  spec.tokens = {"<unk>", "<s>", "</s>"};
  spec.token_types = {2, 3, 3};
  spec.scores = {0, 0, 0};
  for (int b = 0; b < 256; ++b) {
    char hex[8];
    std::snprintf(hex, sizeof(hex), "<0x%02X>", b);
    spec.tokens.push_back(hex);
    spec.token_types.push_back(6);
    spec.scores.push_back(0);
  }
  for (const auto& [text, score] : extra) {
    spec.tokens.push_back(text);
    spec.token_types.push_back(1);
    spec.scores.push_back(score);
  }
  spec.unk_id = 0;
  spec.bos_id = 1;
  spec.eos_id = 2;
  return spec;
}

const std::string kMark = "\u2581";

TEST(TokenizerSentencePiece, HighestScoreMergesFirst) {
  auto ab_first = Build(SpmSpec({{kMark, -9}, {"a", -9}, {"b", -9}, {"c", -9}, {"ab", -1}, {"bc", -2}}));
  auto bc_first = Build(SpmSpec({{kMark, -9}, {"a", -9}, {"b", -9}, {"c", -9}, {"ab", -2}, {"bc", -1}}));
  ASSERT_TRUE(ab_first && bc_first);
  // The encoder writes "▁abc": "▁a" is no token, so the space stays alone.
  EXPECT_EQ(Texts(*ab_first, ab_first->Encode("abc")), (std::vector<std::string>{kMark, "ab", "c"}));
  EXPECT_EQ(Texts(*bc_first, bc_first->Encode("abc")), (std::vector<std::string>{kMark, "a", "bc"}));
}

TEST(TokenizerSentencePiece, MergesByRankFromHfMerges) {
  TokenizerSpec spec = SpmSpec({{kMark, 0}, {"a", 0}, {"b", 0}, {"c", 0}, {"ab", 0}, {"bc", 0}});
  spec.scores.clear();
  spec.merges = {"b c", "a b"};
  auto tok = Build(spec);
  ASSERT_TRUE(tok);
  EXPECT_EQ(Texts(*tok, tok->Encode("abc")), (std::vector<std::string>{kMark, "a", "bc"}));
}

TEST(TokenizerSentencePiece, UnknownCharactersFallBackToBytes) {
  auto tok = Build(SpmSpec({{kMark, -1}, {"a", -1}}));
  ASSERT_TRUE(tok);
  EXPECT_EQ(Texts(*tok, tok->Encode("a\u00e9")),
            (std::vector<std::string>{kMark, "a", "<0xC3>", "<0xA9>"}));
  EXPECT_EQ(tok->Decode(tok->Encode("a\u00e9 a")), "a\u00e9 a");
}

TEST(TokenizerSentencePiece, WholeTextLosesThePrefixSpacePiecesKeepIt) {
  auto tok = Build(SpmSpec({{kMark, -3}, {"a", -3}, {kMark + "a", -1}}));
  ASSERT_TRUE(tok);
  const std::vector<int32_t> ids = tok->Encode("a a");
  EXPECT_EQ(Texts(*tok, ids), (std::vector<std::string>{kMark + "a", kMark + "a"}));
  EXPECT_EQ(tok->Decode(ids), "a a");           // HF decode, llama.cpp detokenize
  EXPECT_EQ(tok->DecodePieces(ids), " a a");    // what a continuation of a prompt reads
  EXPECT_EQ(tok->TokenBytes(ids[0]), " a");
  EXPECT_EQ(tok->Decode(tok->Encode("  a")), "  a");
}

TEST(TokenizerSentencePiece, SpaceAfterEachSpecialTokenAndStrip) {
  TokenizerSpec spec = SpmSpec({{kMark, -3}, {"a", -3}, {kMark + "a", -1}, {"\n", -3}});
  auto tok = Build(spec);
  ASSERT_TRUE(tok);
  // llama.cpp (and HF's legacy Llama): a "▁" starts the text and each fragment after a special.
  EXPECT_EQ(Texts(*tok, tok->Encode("a</s>a")), (std::vector<std::string>{kMark + "a", "</s>", kMark + "a"}));
  EXPECT_EQ(Texts(*tok, tok->Encode("a</s>a", false, /*parse_special=*/false)).front(), kMark + "a");
  // A token with rstrip (Phi-3's specials) swallows the whitespace after it.
  spec.rstrip_ids = {2};
  auto stripping = Build(spec);
  ASSERT_TRUE(stripping);
  EXPECT_EQ(Texts(*stripping, stripping->Encode("a</s>\n a")),
            (std::vector<std::string>{kMark + "a", "</s>", kMark + "a"}));
  // Metaspace prepend_scheme "first": only the very start gets the "▁".
  spec.rstrip_ids.clear();
  spec.space_prefix = TokenizerSpec::SpacePrefix::kFirst;
  auto first_only = Build(spec);
  ASSERT_TRUE(first_only);
  EXPECT_EQ(Texts(*first_only, first_only->Encode("a</s>a")),
            (std::vector<std::string>{kMark + "a", "</s>", "a"}));
}

TEST(TokenizerSentencePiece, BadVocabulariesAreRefused) {
  TokenizerSpec no_scores = SpmSpec({{"a", -1}});
  no_scores.scores.clear();
  EXPECT_FALSE(Tokenizer::FromSpec(no_scores).ok());
  TokenizerSpec bad_byte = SpmSpec({{"a", -1}});
  bad_byte.tokens[3] = "<0xZZ>";
  EXPECT_FALSE(Tokenizer::FromSpec(bad_byte).ok());
  TokenizerSpec short_scores = SpmSpec({{"a", -1}});
  short_scores.scores.pop_back();
  EXPECT_FALSE(Tokenizer::FromSpec(short_scores).ok());
  TokenizerSpec unknown_model = SpmSpec({});
  unknown_model.model = "bert";
  auto refused = Tokenizer::FromSpec(unknown_model);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("bert"), std::string::npos);
}

const char* const kVocabularies[] = {"deepseek-coder", "falcon", "gpt-2",  "llama-bpe",
                                     "llama-spm",      "phi-3",  "qwen2",  "starcoder"};

struct VocabCase {
  std::string text;
  std::vector<int32_t> ids;
};

std::vector<VocabCase> ReadVocabCases(const std::string& gguf) {
  std::ifstream inp(gguf + ".inp"), out(gguf + ".out");
  std::stringstream all;
  all << inp.rdbuf();
  const std::string text = all.str(), sep = "\n__ggml_vocab_test__\n";
  std::vector<VocabCase> cases;
  for (size_t pos = 0; pos < text.size();) {
    const size_t at = text.find(sep, pos);
    cases.push_back({text.substr(pos, at == std::string::npos ? std::string::npos : at - pos), {}});
    if (at == std::string::npos) break;
    pos = at + sep.size();
  }
  std::string line;
  for (VocabCase& c : cases) {
    if (!std::getline(out, line)) break;
    std::istringstream ids(line);
    for (int32_t id; ids >> id;) c.ids.push_back(id);
  }
  return cases;
}

TEST(TokenizerRealVocabularies, EncodeAsHuggingFace) {
  const std::string dir = std::string(KVFLOW_SOURCE_DIR) + "/../shared/datasets/tokenizer_vocabs/";
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << "no " << dir << " (the ../shared datasets)";
  for (const char* name : kVocabularies) {
    const std::string path = dir + "ggml-vocab-" + name + ".gguf";
    auto gguf = GgufFile::Open(path);
    ASSERT_TRUE(gguf.ok()) << gguf.status().ToString();
    auto spec = TokenizerSpecFromGguf(*gguf.value());
    ASSERT_TRUE(spec.ok()) << name << ": " << spec.status().ToString();
    auto tok = Tokenizer::FromSpec(std::move(spec).value());
    ASSERT_TRUE(tok.ok()) << name << ": " << tok.status().ToString();
    const std::vector<VocabCase> cases = ReadVocabCases(path);
    ASSERT_GT(cases.size(), 20u) << name;
    int same = 0;
    for (const VocabCase& c : cases) {
      const std::vector<int32_t> got = tok.value()->Encode(c.text, /*add_bos=*/false);
      EXPECT_EQ(got, c.ids) << name << " on \"" << c.text << "\"";
      EXPECT_EQ(tok.value()->Decode(got, /*skip_special=*/false), c.text) << name << " round trip";
      same += got == c.ids;
    }
    std::printf("  %-15s %d of %zu test vectors identical to Hugging Face's ids\n", name, same, cases.size());
  }
}

}  // namespace
}  // namespace kvflow
