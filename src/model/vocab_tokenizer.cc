#include "model/vocab_tokenizer.h"

#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>

#include "model/unicode_data.h"
#include "model/utf8.h"

namespace kvflow {

std::string SanitizeUtf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t pos = 0; pos < bytes.size();) {
    const Utf8Step step = DecodeUtf8(bytes, pos);
    if (step.valid) {
      out.append(bytes.substr(pos, step.len));
    } else {
      AppendUtf8(0xFFFD, &out);
    }
    pos += step.len;
  }
  return out;
}

namespace {

// Whitespace as HF's AddedToken lstrip/rstrip sees it (Unicode White_Space); the length of the
// whitespace character at text[pos], or 0.
size_t WhitespaceAt(std::string_view text, size_t pos) {
  const Utf8Step step = DecodeUtf8(text, pos);
  return step.valid && (CodepointFlags(step.cp) & kCpWhitespace) ? step.len : 0;
}

// Unicode NFC of `text` by utf8proc; text that is not valid UTF-8 stays as it is (HF only ever
// sees valid UTF-8).
std::string Nfc(std::string_view text) {
  bool ascii = true;
  for (char c : text) ascii &= static_cast<unsigned char>(c) < 0x80;
  if (ascii) return std::string(text);  // already NFC
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                   static_cast<utf8proc_ssize_t>(text.size()), &out,
                   static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) return std::string(text);
  std::string result(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  std::free(out);
  return result;
}

}  // namespace

Status MergeTable::Build(const std::vector<std::string>& merges,
                         const std::function<int32_t(std::string_view)>& token_id) {
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const std::string& merge = merges[rank];
    const size_t space = merge.find(' ', 1);
    auto bad = [&](const std::string& why) {
      return Status::CorruptFile("tokenizer: merge #" + std::to_string(rank) + " '" + merge + "' " + why);
    };
    if (space == std::string::npos) return bad("is not two tokens separated by a space");
    const std::string left = merge.substr(0, space), right = merge.substr(space + 1);
    const int32_t left_id = token_id(left), right_id = token_id(right);
    const int32_t merged_id = token_id(left + right);
    if (left_id < 0 || right_id < 0) return bad("uses a token missing from the vocabulary");
    if (merged_id < 0) return bad("makes a token missing from the vocabulary");
    merges_[Key(left_id, right_id)] = {static_cast<int32_t>(rank), merged_id};
  }
  return Status::Ok();
}

Status VocabTokenizer::InitVocab(TokenizerSpec& spec) {
  tokens_ = std::move(spec.tokens);
  types_ = std::move(spec.token_types);
  if (tokens_.empty()) return Status::InvalidArgument("tokenizer: the vocabulary is empty");
  if (types_.empty()) types_.assign(tokens_.size(), kTokenNormal);
  if (types_.size() != tokens_.size()) {
    return Status::InvalidArgument("tokenizer: " + std::to_string(tokens_.size()) +
                                   " tokens but " + std::to_string(types_.size()) +
                                   " token types");
  }
  const int32_t n = vocab_size();
  for (int32_t id : {spec.bos_id, spec.eos_id, spec.unk_id, spec.pad_id}) {
    if (id < -1 || id >= n) {
      return Status::InvalidArgument("tokenizer: special token id " + std::to_string(id) +
                                     " is outside the vocabulary of " + std::to_string(n));
    }
  }
  bos_id_ = spec.bos_id;
  eos_id_ = spec.eos_id;
  unk_id_ = spec.unk_id;
  add_bos_ = spec.add_bos;
  nfc_ = spec.nfc;
  chat_template_ = std::move(spec.chat_template);

  std::vector<uint8_t> strip(tokens_.size(), 0);  // bit 0 lstrip, bit 1 rstrip
  for (const auto& [ids, bit] : {std::pair{&spec.lstrip_ids, 1}, std::pair{&spec.rstrip_ids, 2}}) {
    for (int32_t id : *ids) {
      if (id < 0 || id >= n) {
        return Status::InvalidArgument("tokenizer: strip token id " + std::to_string(id) +
                                       " is outside the vocabulary of " + std::to_string(n));
      }
      strip[id] |= bit;
    }
  }
  vocab_.reserve(tokens_.size());
  token_bytes_.assign(tokens_.size(), std::string());
  for (int32_t id = 0; id < n; ++id) {
    const std::string& text = tokens_[id];
    if (text.empty()) continue;
    vocab_.emplace(text, id);  // the first id wins for duplicated texts
    // Control, user-defined and unknown tokens written in the input are those tokens (llama.cpp's
    // special-token partition, HF's added tokens).
    const int32_t type = types_[id];
    if (type == kTokenControl || type == kTokenUserDefined || type == kTokenUnknown) {
      literals_.push_back({text, id, (strip[id] & 1) != 0, (strip[id] & 2) != 0});
      literal_first_byte_[static_cast<uint8_t>(text[0])] = true;
    }
  }
  // Longest first, so that "<|im_start|>" beats a shorter literal sharing its start.
  std::stable_sort(literals_.begin(), literals_.end(), [](const Literal& a, const Literal& b) {
    return a.text.size() > b.text.size();
  });
  return Status::Ok();
}

const VocabTokenizer::Literal* VocabTokenizer::MatchLiteralAt(std::string_view text,
                                                              size_t pos) const {
  if (!literal_first_byte_[static_cast<uint8_t>(text[pos])]) return nullptr;
  const std::string_view rest = text.substr(pos);
  for (const Literal& lit : literals_) {
    if (rest.starts_with(lit.text)) return &lit;
  }
  return nullptr;
}

std::vector<int32_t> VocabTokenizer::Encode(std::string_view text, bool add_bos,
                                            bool parse_special) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 2);
  if (add_bos && bos_id_ >= 0) ids.push_back(bos_id_);
  size_t plain_begin = 0;
  bool after_special = true;  // the start of the text counts as following a special token
  auto flush = [&](size_t end) {
    if (end > plain_begin) {
      const std::string_view fragment = text.substr(plain_begin, end - plain_begin);
      if (nfc_) {
        EncodeFragment(Nfc(fragment), after_special, &ids);
      } else {
        EncodeFragment(fragment, after_special, &ids);
      }
      after_special = false;
    }
  };
  if (parse_special && !literals_.empty()) {
    for (size_t pos = 0; pos < text.size();) {
      const Literal* lit = MatchLiteralAt(text, pos);
      if (lit == nullptr) {
        ++pos;
        continue;
      }
      size_t plain_end = pos;
      if (lit->lstrip) {  // back to where the whitespace before the literal starts
        plain_end = plain_begin;
        for (size_t at = plain_begin; at < pos;) {
          const size_t ws = WhitespaceAt(text, at);
          at += ws > 0 ? ws : DecodeUtf8(text, at).len;
          if (ws == 0) plain_end = at;
        }
      }
      flush(plain_end);
      ids.push_back(lit->id);
      after_special = true;
      pos += lit->text.size();
      if (lit->rstrip) {
        while (pos < text.size()) {
          const size_t ws = WhitespaceAt(text, pos);
          if (ws == 0) break;
          pos += ws;
        }
      }
      plain_begin = pos;
    }
  }
  flush(text.size());
  return ids;
}

std::string VocabTokenizer::TokenBytes(int32_t id, bool skip_special) const {
  if (id < 0 || id >= vocab_size()) return std::string();
  if (skip_special && is_special(id)) return std::string();
  return token_bytes_[id];
}

std::string VocabTokenizer::DecodePieces(const std::vector<int32_t>& ids,
                                         bool skip_special) const {
  std::string out;
  for (int32_t id : ids) out += TokenBytes(id, skip_special);
  return SanitizeUtf8(out);
}

std::string VocabTokenizer::DecodeBytes(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string out;
  for (int32_t id : ids) out += TokenBytes(id, skip_special);
  if (strip_leading_space_ && !out.empty() && out[0] == ' ') out.erase(0, 1);
  return out;
}

std::string VocabTokenizer::Decode(const std::vector<int32_t>& ids, bool skip_special) const {
  return SanitizeUtf8(DecodeBytes(ids, skip_special));
}

}  // namespace kvflow
