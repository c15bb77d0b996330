// What every vocabulary-based tokenizer shares: the token table, the special and added tokens
// matched verbatim before the model's own algorithm runs, and decoding token by token. The byte-
// level BPE (GPT-2 family) and SentencePiece (Llama-2 family) tokenizers derive from it.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvflow/tokenizer.h"

namespace kvflow {

// GGUF token types (llama.cpp's llama_token_type).
enum TokenType : int32_t {
  kTokenUndefined = 0,
  kTokenNormal = 1,
  kTokenUnknown = 2,
  kTokenControl = 3,
  kTokenUserDefined = 4,
  kTokenUnused = 5,
  kTokenByte = 6,
};

// Lets unordered_map<std::string, ...> be searched with a string_view.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

// BPE merges as HF lists them ("left right", highest priority first), keyed by the token pair.
class MergeTable {
 public:
  struct Merge {
    int32_t rank;
    int32_t merged_id;
  };
  // Resolves each merge's tokens with `token_id`; a merge of tokens the vocabulary lacks is corrupt.
  // A repeated pair takes its last rank, as HF's merge map does.
  Status Build(const std::vector<std::string>& merges, const std::function<int32_t(std::string_view)>& token_id);
  const Merge* Find(int32_t left, int32_t right) const {
    auto it = merges_.find(Key(left, right));
    return it == merges_.end() ? nullptr : &it->second;
  }

 private:
  static uint64_t Key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }
  std::unordered_map<uint64_t, Merge> merges_;
};

class VocabTokenizer : public Tokenizer {
 public:
  std::vector<int32_t> Encode(std::string_view text, bool add_bos,
                              bool parse_special) const override;
  std::string TokenBytes(int32_t id, bool skip_special) const override;
  std::string DecodeBytes(const std::vector<int32_t>& ids, bool skip_special) const override;
  std::string Decode(const std::vector<int32_t>& ids, bool skip_special) const override;
  std::string DecodePieces(const std::vector<int32_t>& ids, bool skip_special) const override;

  int32_t vocab_size() const override { return static_cast<int32_t>(tokens_.size()); }
  int32_t bos_id() const override { return bos_id_; }
  int32_t eos_id() const override { return eos_id_; }
  bool add_bos() const override { return add_bos_; }
  bool is_special(int32_t id) const override {
    return id >= 0 && id < vocab_size() &&
           (types_[id] == kTokenControl || types_[id] == kTokenUnknown);
  }
  const std::string& token_text(int32_t id) const override {
    static const std::string kEmpty;
    return id >= 0 && id < vocab_size() ? tokens_[id] : kEmpty;
  }
  int32_t token_id(std::string_view text) const override {
    auto it = vocab_.find(text);
    return it == vocab_.end() ? -1 : it->second;
  }
  const std::string& chat_template() const override { return chat_template_; }

 protected:
  VocabTokenizer() = default;

  // Checks and takes the fields every model shares. `spec.tokens` and `spec.token_types` are
  // moved from; the rest of `spec` stays for the model's own Init.
  Status InitVocab(TokenizerSpec& spec);
  // The bytes each token decodes to; the model fills them once its vocabulary is read.
  std::vector<std::string>& token_bytes() { return token_bytes_; }
  int32_t unk_id() const { return unk_id_; }
  int32_t type_of(int32_t id) const { return types_[id]; }
  // Decoding a whole text drops one leading space, which SentencePiece's encoder added.
  void set_strip_leading_space(bool strip) { strip_leading_space_ = strip; }

  // Encodes text that holds no special tokens. `after_special` says whether a special token (or
  // the start of the text) comes right before it.
  virtual void EncodeFragment(std::string_view text, bool after_special,
                              std::vector<int32_t>* ids) const = 0;

 private:
  // A token matched verbatim in the input instead of going through the model.
  struct Literal {
    std::string text;
    int32_t id;
    bool lstrip, rstrip;  // whitespace on that side of it is dropped (HF AddedToken)
  };

  const Literal* MatchLiteralAt(std::string_view text, size_t pos) const;

  std::vector<std::string> tokens_;
  std::vector<int32_t> types_;
  std::vector<std::string> token_bytes_;
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> vocab_;
  std::vector<Literal> literals_;  // longest first
  std::array<bool, 256> literal_first_byte_{};
  int32_t bos_id_ = -1, eos_id_ = -1, unk_id_ = -1;
  bool add_bos_ = false;
  bool strip_leading_space_ = false;
  bool nfc_ = false;
  std::string chat_template_;
};

// The models; each takes a spec whose `model` names it.
Result<std::unique_ptr<Tokenizer>> MakeByteLevelBpeTokenizer(TokenizerSpec spec);
Result<std::unique_ptr<Tokenizer>> MakeSentencePieceTokenizer(TokenizerSpec spec);

// Valid UTF-8 of `bytes`, each maximal invalid subsequence replaced by U+FFFD.
std::string SanitizeUtf8(std::string_view bytes);

}  // namespace kvflow
