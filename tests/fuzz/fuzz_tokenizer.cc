// libFuzzer target: the tokenizers (src/model/*tokenizer*, pretokenizer) on arbitrary bytes. The
// first byte picks a tokenizer: the 8 real vocabularies of ../shared/datasets/tokenizer_vocabs
// where present (byte-level BPE with each pre-tokenizer, SentencePiece), and built-in byte-only
// ones of every pre-tokenizer and model that need no files. The second byte's bits choose
// parse_special and add_bos. Beyond crashes and sanitizer reports it aborts where an id falls
// outside the vocabulary, or where decoding the ids does not give the text back (plain text,
// no BOS, every byte in the vocabulary; for NFC tokenizers, where re-encoding the decoded text
// gives other ids).
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "kvflow/tokenizer.h"
#include "model/byte_level.h"
#include "model/gguf.h"

namespace {

struct Case {
  std::string name;
  std::unique_ptr<kvflow::Tokenizer> tok;
  bool spm = false;
  bool nfc = false;
  std::array<bool, 256> has_byte{};  // a vocabulary may lack some bytes (Falcon's, StarCoder's)
};

std::vector<Case> Load() {
  std::vector<Case> cases;
  auto add = [&](std::string name, kvflow::TokenizerSpec spec) {
    const bool spm = spec.model == "llama", nfc = spec.nfc;
    auto tok = kvflow::Tokenizer::FromSpec(std::move(spec));
    if (!tok.ok()) {
      std::fprintf(stderr, "fuzz_tokenizer: %s: %s\n", name.c_str(), tok.status().ToString().c_str());
      std::abort();
    }
    Case c{std::move(name), std::move(tok).value(), spm, nfc, {}};
    for (int b = 0; b < 256; ++b) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "<0x%02X>", b);
      c.has_byte[b] = c.tok->token_id(spm ? std::string(hex) : kvflow::ByteLevelSpelling(static_cast<uint8_t>(b))) >= 0;
    }
    cases.push_back(std::move(c));
  };
  for (const char* pre : {"gpt2", "smollm", "llama-bpe", "qwen2", "falcon", "deepseek-coder"}) {
    kvflow::TokenizerSpec spec;
    spec.pre = pre;
    for (int b = 0; b < 256; ++b) spec.tokens.push_back(kvflow::ByteLevelSpelling(static_cast<uint8_t>(b)));
    spec.tokens.push_back("<|end|>");
    spec.token_types.assign(spec.tokens.size(), 1);
    spec.token_types.back() = 3;
    spec.nfc = std::string(pre) == "qwen2";
    add(std::string("bytes-") + pre, std::move(spec));
  }
  {
    kvflow::TokenizerSpec spec;
    spec.model = "llama";
    spec.space_prefix = kvflow::TokenizerSpec::SpacePrefix::kAfterSpecial;
    spec.tokens = {"<unk>", "<s>", "</s>"};
    spec.token_types = {2, 3, 3};
    for (int b = 0; b < 256; ++b) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "<0x%02X>", b);
      spec.tokens.push_back(hex);
      spec.token_types.push_back(6);
    }
    for (const char* t : {"\xE2\x96\x81", "a", "\xE2\x96\x81" "a", "ab", "\xE2\x96\x81" "ab"}) {
      spec.tokens.push_back(t);
      spec.token_types.push_back(1);
    }
    spec.scores.assign(spec.tokens.size(), -1.0f);
    spec.scores.back() = -0.5f;
    spec.unk_id = 0;
    spec.bos_id = 1;
    spec.rstrip_ids = {2};
    add("bytes-spm", std::move(spec));
  }
  const std::string dir = std::string(KVFLOW_SOURCE_DIR) + "/../shared/datasets/tokenizer_vocabs/";
  for (const char* name : {"deepseek-coder", "falcon", "gpt-2", "llama-bpe", "llama-spm", "phi-3", "qwen2", "starcoder"}) {
    const std::string path = dir + "ggml-vocab-" + name + ".gguf";
    if (!std::filesystem::exists(path)) continue;
    auto gguf = kvflow::GgufFile::Open(path);
    if (!gguf.ok()) continue;
    auto spec = kvflow::TokenizerSpecFromGguf(*gguf.value());
    if (!spec.ok()) std::abort();  // these eight must load
    add(name, std::move(spec).value());
  }
  return cases;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::vector<Case> cases = Load();
  if (size < 2) return 0;
  const Case& c = cases[data[0] % cases.size()];
  const bool parse_special = data[1] & 1, add_bos = data[1] & 2;
  const std::string text(reinterpret_cast<const char*>(data + 2), size - 2);
  const std::vector<int32_t> ids = c.tok->Encode(text, add_bos, parse_special);
  for (int32_t id : ids) {
    if (id < 0 || id >= c.tok->vocab_size()) std::abort();
  }
  const std::string decoded = c.tok->DecodeBytes(ids, /*skip_special=*/false);
  (void)c.tok->Decode(ids, true);
  (void)c.tok->DecodePieces(ids, true);
  if (parse_special || add_bos) return 0;
  for (unsigned char b : text) {
    if (!c.has_byte[b]) return 0;  // dropped, as HF drops what it cannot spell
  }
  if (c.nfc) {
    if (c.tok->Encode(decoded, false, false) != ids) std::abort();
  } else if (!(c.spm && text.find("\xE2\x96\x81") != std::string::npos)) {  // "▁" reads back as " "
    if (decoded != text) std::abort();
  }
  return 0;
}
