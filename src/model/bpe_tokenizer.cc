// Byte-level BPE (GPT-2, Llama-3, Qwen2, SmolLM2, StarCoder, Falcon, DeepSeek-Coder): the text is
// split by the model's pre-tokenizer, each piece's bytes spelled in GPT-2's printable alphabet and
// merged by rank, as HF `tokenizers` does.
#include <array>
#include <mutex>
#include <queue>
#include <unordered_map>

#include "model/byte_level.h"
#include "model/pretokenizer.h"
#include "model/utf8.h"
#include "model/vocab_tokenizer.h"

namespace kvflow {
namespace {

// GPT-2's reversible map between bytes and printable code points: printable Latin-1 bytes map to
// themselves, the rest to U+0100 onwards, so every byte string becomes visible text.
class ByteLevelAlphabet {
 public:
  static const ByteLevelAlphabet& Get() {
    static const ByteLevelAlphabet alphabet;
    return alphabet;
  }

  const std::string& Encode(uint8_t byte) const { return utf8_of_byte_[byte]; }

  // Maps the byte-level text back to bytes; false if some code point is outside the alphabet.
  bool Decode(std::string_view text, std::string* bytes) const {
    bytes->clear();
    for (size_t pos = 0; pos < text.size();) {
      const Utf8Step step = DecodeUtf8(text, pos);
      if (!step.valid || step.cp >= byte_of_cp_.size() || byte_of_cp_[step.cp] < 0) return false;
      bytes->push_back(static_cast<char>(byte_of_cp_[step.cp]));
      pos += step.len;
    }
    return true;
  }

 private:
  ByteLevelAlphabet() {
    byte_of_cp_.fill(-1);
    uint32_t next_extra = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const uint32_t cp = printable ? b : next_extra++;
      AppendUtf8(cp, &utf8_of_byte_[b]);
      byte_of_cp_[cp] = static_cast<int16_t>(b);
    }
  }

  std::array<std::string, 256> utf8_of_byte_;
  std::array<int16_t, 324> byte_of_cp_;  // 256 + the 68 non-printable bytes
};

}  // namespace

const std::string& ByteLevelSpelling(uint8_t byte) { return ByteLevelAlphabet::Get().Encode(byte); }

namespace {

class BpeTokenizer final : public VocabTokenizer {
 public:
  static Result<std::unique_ptr<Tokenizer>> Create(TokenizerSpec spec) {
    KVFLOW_ASSIGN_OR_RETURN(PreTokenizer pre, PreTokenizer::FromName(spec.pre));
    auto tok = std::unique_ptr<BpeTokenizer>(new BpeTokenizer(std::move(pre)));
    KVFLOW_RETURN_IF_ERROR(tok->Init(std::move(spec)));
    return std::unique_ptr<Tokenizer>(std::move(tok));
  }

 protected:
  void EncodeFragment(std::string_view text, bool /*after_special*/,
                      std::vector<int32_t>* ids) const override {
    if (text.empty()) return;
    std::vector<std::string_view> pieces;
    pre_.Split(text, &pieces);
    for (std::string_view piece : pieces) EncodePiece(piece, ids);
  }

 private:
  // Cached pre-tokens are bounded so that adversarial input cannot grow memory without end.
  static constexpr size_t kMaxCacheEntries = 1 << 18;

  explicit BpeTokenizer(PreTokenizer pre) : pre_(std::move(pre)) {}

  Status Init(TokenizerSpec spec) {
    KVFLOW_RETURN_IF_ERROR(InitVocab(spec));
    ignore_merges_ = spec.ignore_merges.value_or(pre_.kind() == PreTokenizer::Kind::kLlama3);
    const ByteLevelAlphabet& alphabet = ByteLevelAlphabet::Get();
    std::vector<std::string>& bytes = token_bytes();
    for (int32_t id = 0; id < vocab_size(); ++id) {
      if (type_of(id) == kTokenUnused) continue;  // reads as nothing, as in llama.cpp
      // Like HF's ByteLevel decoder: text outside the byte alphabet (added tokens) is raw UTF-8.
      const std::string& text = token_text(id);
      if (!alphabet.Decode(text, &bytes[id])) bytes[id] = text;
    }
    for (int b = 0; b < 256; ++b) byte_token_[b] = token_id(alphabet.Encode(b));
    return merges_.Build(spec.merges, [this](std::string_view t) { return token_id(t); });
  }

  void EncodePiece(std::string_view piece, std::vector<int32_t>* ids) const {
    {
      std::lock_guard<std::mutex> lock(cache_mu_);
      auto it = cache_.find(piece);
      if (it != cache_.end()) {
        ids->insert(ids->end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::vector<int32_t> piece_ids = Bpe(piece);
    ids->insert(ids->end(), piece_ids.begin(), piece_ids.end());
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (cache_.size() >= kMaxCacheEntries) cache_.clear();
    cache_.emplace(std::string(piece), std::move(piece_ids));
  }

  // HF's BPE::merge_word: start from one symbol per byte and repeatedly apply the lowest-ranked
  // merge (leftmost on ties), skipping queue entries that earlier merges made stale.
  std::vector<int32_t> Bpe(std::string_view piece) const {
    const ByteLevelAlphabet& alphabet = ByteLevelAlphabet::Get();
    if (ignore_merges_) {
      std::string word;
      for (char c : piece) word += alphabet.Encode(static_cast<uint8_t>(c));
      if (int32_t id = token_id(word); id >= 0) return {id};
    }
    struct Symbol {
      int32_t id;
      int32_t prev, next;  // neighbours in the linked list, -1 at the ends
      bool removed;
    };
    std::vector<Symbol> symbols;
    symbols.reserve(piece.size());
    for (char c : piece) {
      int32_t id = byte_token_[static_cast<uint8_t>(c)];
      if (id < 0) id = unk_id();
      if (id < 0) continue;  // HF drops characters it cannot represent when there is no unk
      const auto index = static_cast<int32_t>(symbols.size());
      symbols.push_back({id, index - 1, index + 1, false});
    }
    if (symbols.empty()) return {};
    symbols.back().next = -1;

    struct Candidate {
      int32_t rank;
      int32_t pos;
      int32_t merged_id;
      bool operator>(const Candidate& o) const {
        return rank != o.rank ? rank > o.rank : pos > o.pos;
      }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
    auto push_pair = [&](int32_t pos) {
      const int32_t next = symbols[pos].next;
      if (next < 0) return;
      if (const MergeTable::Merge* m = merges_.Find(symbols[pos].id, symbols[next].id)) {
        queue.push({m->rank, pos, m->merged_id});
      }
    };
    for (int32_t pos = 0; pos + 1 < static_cast<int32_t>(symbols.size()); ++pos) push_pair(pos);

    while (!queue.empty()) {
      const Candidate top = queue.top();
      queue.pop();
      Symbol& left = symbols[top.pos];
      if (left.removed || left.next < 0) continue;
      const int32_t right_pos = left.next;
      const MergeTable::Merge* m = merges_.Find(left.id, symbols[right_pos].id);
      if (m == nullptr || m->merged_id != top.merged_id) continue;  // stale entry
      left.id = top.merged_id;
      left.next = symbols[right_pos].next;
      symbols[right_pos].removed = true;
      if (left.next >= 0) symbols[left.next].prev = top.pos;
      if (left.prev >= 0) push_pair(left.prev);
      push_pair(top.pos);
    }
    std::vector<int32_t> ids;
    for (int32_t pos = 0; pos >= 0; pos = symbols[pos].next) ids.push_back(symbols[pos].id);
    return ids;
  }

  PreTokenizer pre_;
  MergeTable merges_;
  std::array<int32_t, 256> byte_token_{};             // the single-byte token of each byte
  bool ignore_merges_ = false;

  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>>
      cache_;  // pre-token bytes -> ids
};

}  // namespace

Result<std::unique_ptr<Tokenizer>> MakeByteLevelBpeTokenizer(TokenizerSpec spec) {
  return BpeTokenizer::Create(std::move(spec));
}

}  // namespace kvflow
