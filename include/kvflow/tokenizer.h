// Byte-level BPE tokenizer (GPT-2 / Llama-3 / SmolLM2 style).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvflow/status.h"

namespace kvflow {

// Everything needed to build a tokenizer; filled from GGUF metadata or HF tokenizer.json.
struct TokenizerSpec {
  // Pre-tokenizer name as llama.cpp spells it in `tokenizer.ggml.pre`:
  // "gpt2", "llama-bpe" (Llama-3), "smollm" (digits split + GPT-2 regex), ...
  std::string pre = "gpt2";
  std::vector<std::string> tokens;    // id -> token text in byte-level (GPT-2 byte-to-unicode) form
  std::vector<int32_t> token_types;   // GGUF token types: 1 normal, 2 unknown, 3 control, 4 user, 6 byte
  std::vector<std::string> merges;    // "left right", highest priority first
  // Use a pre-token found whole in the vocabulary without merging (HF BPE `ignore_merges`).
  // Unset: what llama.cpp does for `pre`, i.e. on for "llama-bpe" only.
  std::optional<bool> ignore_merges;
  int32_t bos_id = -1;
  int32_t eos_id = -1;
  int32_t unk_id = -1;
  int32_t pad_id = -1;
  bool add_bos = false;
  std::string chat_template;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  static Result<std::unique_ptr<Tokenizer>> FromSpec(TokenizerSpec spec);
  // HF `tokenizer.json` (model type BPE, byte-level). `tokenizer_config.json` beside it is read
  // for bos/eos and chat template when present.
  static Result<std::unique_ptr<Tokenizer>> FromHfJson(const std::string& path);

  // Special/control tokens written literally in `text` become their ids when parse_special.
  virtual std::vector<int32_t> Encode(std::string_view text, bool add_bos = false,
                                      bool parse_special = true) const = 0;
  // Raw bytes of the tokens (may end in an incomplete UTF-8 sequence).
  virtual std::string DecodeBytes(const std::vector<int32_t>& ids, bool skip_special = true) const = 0;
  // Valid UTF-8 only: invalid/incomplete sequences become U+FFFD.
  virtual std::string Decode(const std::vector<int32_t>& ids, bool skip_special = true) const = 0;

  virtual int32_t vocab_size() const = 0;
  virtual int32_t bos_id() const = 0;
  virtual int32_t eos_id() const = 0;
  virtual bool add_bos() const = 0;
  virtual bool is_special(int32_t id) const = 0;
  virtual const std::string& token_text(int32_t id) const = 0;  // byte-level form
  virtual int32_t token_id(std::string_view text) const = 0;    // -1 if absent
  virtual const std::string& chat_template() const = 0;
};

// Streams text out of a growing token sequence: emits only complete UTF-8 characters, holding back
// bytes of a character that is still incomplete.
class IncrementalDecoder {
 public:
  explicit IncrementalDecoder(const Tokenizer& tok, bool skip_special = true)
      : tok_(tok), skip_special_(skip_special) {}
  // Returns the newly completed text (possibly empty).
  std::string Push(int32_t token);
  // Anything still held back, with incomplete sequences replaced by U+FFFD.
  std::string Flush();

 private:
  const Tokenizer& tok_;
  bool skip_special_;
  std::string pending_;
};

}  // namespace kvflow
