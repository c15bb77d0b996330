// SentencePiece-style BPE (Llama-2, Mistral, Phi-3, ...): spaces become "▁", the text starts as
// one symbol per character, adjacent symbols merge best pair first, and a character the vocabulary
// lacks falls back to its <0xXX> byte tokens. From GGUF the best pair is the one making the
// highest-scoring token (llama.cpp's llm_tokenizer_spm); from HF tokenizer.json it is the
// lowest-ranked merge (HF BPE with byte_fallback). Leftmost wins ties in both.
#include <cstdio>
#include <queue>

#include "model/utf8.h"
#include "model/vocab_tokenizer.h"

namespace kvflow {
namespace {

constexpr std::string_view kSpaceMark = "\xE2\x96\x81";  // U+2581 "▁"

// The byte a "<0xXX>" token stands for, or -1.
int ByteOfToken(std::string_view text) {
  if (text.size() != 6 || !text.starts_with("<0x") || text[5] != '>') return -1;
  int value = 0;
  for (char c : text.substr(3, 2)) {
    const int digit = c >= '0' && c <= '9'   ? c - '0'
                      : c >= 'A' && c <= 'F' ? c - 'A' + 10
                      : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                             : -1;
    if (digit < 0) return -1;
    value = value * 16 + digit;
  }
  return value;
}

class SpmTokenizer final : public VocabTokenizer {
 public:
  static Result<std::unique_ptr<Tokenizer>> Create(TokenizerSpec spec) {
    auto tok = std::unique_ptr<SpmTokenizer>(new SpmTokenizer());
    KVFLOW_RETURN_IF_ERROR(tok->Init(std::move(spec)));
    return std::unique_ptr<Tokenizer>(std::move(tok));
  }

 protected:
  void EncodeFragment(std::string_view text, bool after_special,
                      std::vector<int32_t>* ids) const override {
    std::string escaped;
    escaped.reserve(text.size() + 8);
    const bool prefix = space_prefix_ == TokenizerSpec::SpacePrefix::kAfterSpecial
                            ? after_special
                            : space_prefix_ == TokenizerSpec::SpacePrefix::kFirst &&
                                  after_special && ids_empty_of_text(*ids);
    if (prefix) escaped += kSpaceMark;
    for (char c : text) {
      if (c == ' ') {
        escaped += kSpaceMark;
      } else {
        escaped += c;
      }
    }
    Merge(escaped, ids);
  }

 private:
  struct Symbol {
    uint32_t begin, len;  // bytes of the escaped text; len 0 once merged into its left neighbour
    int32_t prev, next;   // neighbours, -1 at the ends
    int32_t id;           // the token spelled by the symbol, or -1
  };
  struct Candidate {
    double priority;  // higher merges first
    int32_t left;     // symbol index; lower wins ties
    uint32_t len;     // bytes of the merged symbol, to spot entries made stale by other merges
    int32_t merged_id;
    bool operator<(const Candidate& o) const {
      return priority != o.priority ? priority < o.priority : left > o.left;
    }
  };

  // Whether nothing but a BOS token has been written yet (prepend_scheme "first").
  bool ids_empty_of_text(const std::vector<int32_t>& ids) const {
    return ids.empty() || (ids.size() == 1 && ids[0] == bos_id());
  }

  Status Init(TokenizerSpec spec) {
    const size_t n = spec.tokens.size();
    if (!spec.scores.empty() && spec.scores.size() != n) {
      return Status::CorruptFile("tokenizer: " + std::to_string(spec.scores.size()) +
                                 " scores for " + std::to_string(n) + " tokens");
    }
    if (spec.scores.empty() && spec.merges.empty()) {
      return Status::CorruptFile("tokenizer: a SentencePiece vocabulary needs token scores or merges");
    }
    space_prefix_ = spec.space_prefix;
    set_strip_leading_space(space_prefix_ != TokenizerSpec::SpacePrefix::kNone);
    KVFLOW_RETURN_IF_ERROR(InitVocab(spec));
    scores_ = std::move(spec.scores);

    byte_token_.fill(-1);
    std::vector<std::string>& bytes = token_bytes();
    for (int32_t id = 0; id < vocab_size(); ++id) {
      const std::string& text = token_text(id);
      switch (type_of(id)) {
        case kTokenByte: {
          const int byte = ByteOfToken(text);
          if (byte < 0) {
            return Status::CorruptFile("tokenizer: byte token " + std::to_string(id) + " '" +
                                       text + "' is not of the form <0xXX>");
          }
          if (byte_token_[byte] < 0) byte_token_[byte] = id;
          bytes[id] = std::string(1, static_cast<char>(byte));
          break;
        }
        case kTokenNormal: {  // "▁" reads as a space
          std::string& out = bytes[id];
          for (size_t pos = 0; pos < text.size();) {
            if (std::string_view(text).substr(pos).starts_with(kSpaceMark)) {
              out += ' ';
              pos += kSpaceMark.size();
            } else {
              out += text[pos++];
            }
          }
          break;
        }
        case kTokenControl:
        case kTokenUnknown:
        case kTokenUserDefined:
          bytes[id] = text;
          break;
        default:  // unused and undefined tokens read as nothing, as in llama.cpp
          break;
      }
    }
    // llama.cpp's byte_to_token: "<0xXX>", else the byte's own one-character token.
    for (int b = 0; b < 256; ++b) {
      if (byte_token_[b] < 0 && b < 0x80) byte_token_[b] = token_id(std::string(1, static_cast<char>(b)));
      if (byte_token_[b] < 0 && unk_id() < 0) {
        char hex[8];
        std::snprintf(hex, sizeof(hex), "<0x%02X>", b);
        return Status::Unsupported(std::string("tokenizer: the SentencePiece vocabulary has no byte token ") +
                                   hex + " and no unknown token, so some text cannot be encoded");
      }
    }
    return merge_rank_.Build(spec.merges, [this](std::string_view t) { return token_id(t); });
  }

  // The candidate merge of symbols[left] with the symbol after it, if the vocabulary has one.
  bool Pair(const std::string& text, const std::vector<Symbol>& symbols, int32_t left,
            Candidate* out) const {
    const Symbol& a = symbols[left];
    if (a.next < 0) return false;
    const Symbol& b = symbols[a.next];
    const uint32_t len = a.len + b.len;
    if (!scores_.empty()) {
      const int32_t id = token_id(std::string_view(text).substr(a.begin, len));
      if (id < 0) return false;
      *out = {scores_[id], left, len, id};
      return true;
    }
    if (a.id < 0 || b.id < 0) return false;
    const MergeTable::Merge* m = merge_rank_.Find(a.id, b.id);
    if (m == nullptr) return false;
    *out = {-static_cast<double>(m->rank), left, len, m->merged_id};
    return true;
  }

  void Merge(const std::string& text, std::vector<int32_t>* ids) const {
    std::vector<Symbol> symbols;
    symbols.reserve(text.size());
    for (size_t pos = 0; pos < text.size();) {
      const Utf8Step step = DecodeUtf8(text, pos);
      const uint32_t len = step.valid ? step.len : 1;
      const auto index = static_cast<int32_t>(symbols.size());
      symbols.push_back({static_cast<uint32_t>(pos), len, index - 1, index + 1,
                         token_id(std::string_view(text).substr(pos, len))});
      pos += len;
    }
    if (symbols.empty()) return;
    symbols.back().next = -1;

    std::priority_queue<Candidate> queue;
    Candidate c;
    for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) {
      if (Pair(text, symbols, i, &c)) queue.push(c);
    }
    while (!queue.empty()) {
      const Candidate top = queue.top();
      queue.pop();
      Symbol& left = symbols[top.left];
      if (left.len == 0 || left.next < 0) continue;
      Symbol& right = symbols[left.next];
      if (left.len + right.len != top.len) continue;  // one side changed since it was queued
      left.len = top.len;
      left.id = top.merged_id;
      right.len = 0;
      left.next = right.next;
      if (left.next >= 0) symbols[left.next].prev = top.left;
      if (left.prev >= 0 && Pair(text, symbols, left.prev, &c)) queue.push(c);
      if (Pair(text, symbols, top.left, &c)) queue.push(c);
    }
    for (int32_t i = 0; i >= 0; i = symbols[i].next) {
      const Symbol& s = symbols[i];
      if (s.id >= 0) {
        ids->push_back(s.id);
        continue;
      }
      // A character the vocabulary lacks: its bytes.
      for (uint32_t k = 0; k < s.len; ++k) {
        const int32_t byte_id = byte_token_[static_cast<uint8_t>(text[s.begin + k])];
        ids->push_back(byte_id >= 0 ? byte_id : unk_id());
      }
    }
  }

  TokenizerSpec::SpacePrefix space_prefix_ = TokenizerSpec::SpacePrefix::kNone;
  std::vector<float> scores_;  // by token id; empty when merging by rank
  MergeTable merge_rank_;  // HF merges; empty when merging by score
  std::array<int32_t, 256> byte_token_{};
};

}  // namespace

Result<std::unique_ptr<Tokenizer>> MakeSentencePieceTokenizer(TokenizerSpec spec) {
  return SpmTokenizer::Create(std::move(spec));
}

}  // namespace kvflow
