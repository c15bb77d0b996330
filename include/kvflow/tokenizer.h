// Tokenizers: byte-level BPE (GPT-2, Llama-3, Qwen2, SmolLM2, ...) and SentencePiece-style BPE
// with byte fallback (Llama-2, Mistral, Phi-3, ...).
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
  // The model as llama.cpp spells `tokenizer.ggml.model`: "gpt2" is byte-level BPE; "llama" is
  // SentencePiece-style BPE over characters, spaces written "▁", with <0xXX> byte fallback.
  std::string model = "gpt2";
  // Byte-level BPE: the pre-tokenizer name as llama.cpp spells `tokenizer.ggml.pre`:
  // "gpt2", "llama-bpe" (Llama-3), "smollm" (digits split + GPT-2 regex), "qwen2", ...
  std::string pre = "gpt2";
  // id -> token text: byte-level (GPT-2 byte-to-unicode) form for "gpt2", "▁" for a space for
  // "llama".
  std::vector<std::string> tokens;
  // GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
  std::vector<int32_t> token_types;
  // "left right", highest priority first. SentencePiece takes either these (HF tokenizer.json)
  // or `scores` (GGUF: the pair making the highest-scoring token merges first).
  std::vector<std::string> merges;
  std::vector<float> scores;
  // SentencePiece: where "▁" is put before the text. kAfterSpecial: at the start and after each
  // special token (llama.cpp, HF's legacy Llama normalizer); kFirst: only at the very start (HF
  // Metaspace prepend_scheme "first").
  enum class SpacePrefix { kNone, kAfterSpecial, kFirst };
  SpacePrefix space_prefix = SpacePrefix::kNone;
  // Text is put in Unicode NFC before it is encoded (HF normalizer "NFC", as Qwen2's has).
  bool nfc = false;
  // Special tokens that swallow the whitespace before (lstrip) or after (rstrip) them.
  std::vector<int32_t> lstrip_ids, rstrip_ids;
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
  // HF `tokenizer.json` (model type BPE: byte-level, or with byte fallback as SentencePiece
  // converts). `tokenizer_config.json` beside it is read for bos/eos and chat template when
  // present.
  static Result<std::unique_ptr<Tokenizer>> FromHfJson(const std::string& path);

  // Special/control tokens written literally in `text` become their ids when parse_special.
  virtual std::vector<int32_t> Encode(std::string_view text, bool add_bos = false,
                                      bool parse_special = true) const = 0;
  // The raw bytes of one token as it reads inside a text (llama.cpp's token_to_piece): a
  // SentencePiece word keeps its leading space. Empty for a skipped special token.
  virtual std::string TokenBytes(int32_t id, bool skip_special = false) const = 0;
  // A whole text's raw bytes (may end in an incomplete UTF-8 sequence), as HF's decode and
  // llama.cpp's detokenize give it: a SentencePiece text loses the one leading space its encoder
  // added.
  virtual std::string DecodeBytes(const std::vector<int32_t>& ids, bool skip_special = true) const = 0;
  // Valid UTF-8 only: invalid/incomplete sequences become U+FFFD.
  virtual std::string Decode(const std::vector<int32_t>& ids, bool skip_special = true) const = 0;
  // The tokens' pieces joined, as valid UTF-8: text that continues a prompt (generated output)
  // keeps its leading space.
  virtual std::string DecodePieces(const std::vector<int32_t>& ids, bool skip_special = true) const = 0;

  virtual int32_t vocab_size() const = 0;
  virtual int32_t bos_id() const = 0;
  virtual int32_t eos_id() const = 0;
  virtual bool add_bos() const = 0;
  virtual bool is_special(int32_t id) const = 0;
  virtual const std::string& token_text(int32_t id) const = 0;  // as the vocabulary spells it
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
