#include "kvflow/tokenizer.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "model/byte_level.h"
#include "model/pretokenizer.h"
#include "model/utf8.h"

namespace kvflow {
namespace {

constexpr int32_t kTypeControl = 3;
constexpr int32_t kTypeUserDefined = 4;

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

// Lets unordered_map<std::string, ...> be searched with a string_view.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

// Valid UTF-8 of `bytes`, each maximal invalid subsequence replaced by U+FFFD.
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

// Length of the prefix of `bytes` that ends before a trailing, still-completable UTF-8 sequence.
size_t CompletePrefixLength(std::string_view bytes) {
  for (size_t pos = 0; pos < bytes.size();) {
    const Utf8Step step = DecodeUtf8(bytes, pos);
    if (step.truncated) return pos;
    pos += step.len;
  }
  return bytes.size();
}

class BpeTokenizer final : public Tokenizer {
 public:
  static Result<std::unique_ptr<Tokenizer>> Create(TokenizerSpec spec) {
    KVFLOW_ASSIGN_OR_RETURN(PreTokenizer pre, PreTokenizer::FromName(spec.pre));
    auto tok = std::unique_ptr<BpeTokenizer>(new BpeTokenizer(std::move(pre)));
    KVFLOW_RETURN_IF_ERROR(tok->Init(std::move(spec)));
    return std::unique_ptr<Tokenizer>(std::move(tok));
  }

  std::vector<int32_t> Encode(std::string_view text, bool add_bos,
                              bool parse_special) const override {
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3 + 2);
    if (add_bos && bos_id_ >= 0) ids.push_back(bos_id_);
    size_t plain_begin = 0;
    if (parse_special && !literals_.empty()) {
      for (size_t pos = 0; pos < text.size();) {
        const Literal* lit = MatchLiteralAt(text, pos);
        if (lit == nullptr) {
          ++pos;
          continue;
        }
        EncodePlain(text.substr(plain_begin, pos - plain_begin), &ids);
        ids.push_back(lit->id);
        pos += lit->text.size();
        plain_begin = pos;
      }
    }
    EncodePlain(text.substr(plain_begin), &ids);
    return ids;
  }

  std::string DecodeBytes(const std::vector<int32_t>& ids, bool skip_special) const override {
    std::string out;
    for (int32_t id : ids) {
      if (id < 0 || id >= vocab_size()) continue;
      if (skip_special && is_special(id)) continue;
      out += token_bytes_[id];
    }
    return out;
  }

  std::string Decode(const std::vector<int32_t>& ids, bool skip_special) const override {
    return SanitizeUtf8(DecodeBytes(ids, skip_special));
  }

  int32_t vocab_size() const override { return static_cast<int32_t>(tokens_.size()); }
  int32_t bos_id() const override { return bos_id_; }
  int32_t eos_id() const override { return eos_id_; }
  bool add_bos() const override { return add_bos_; }
  bool is_special(int32_t id) const override {
    return id >= 0 && id < vocab_size() && types_[id] == kTypeControl;
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

 private:
  // A token matched verbatim in the input instead of going through BPE.
  struct Literal {
    std::string text;
    int32_t id;
  };
  struct MergeResult {
    int32_t rank;
    int32_t id;
  };
  // Cached pre-tokens are bounded so that adversarial input cannot grow memory without end.
  static constexpr size_t kMaxCacheEntries = 1 << 18;

  explicit BpeTokenizer(PreTokenizer pre) : pre_(std::move(pre)) {}

  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }

  Status Init(TokenizerSpec spec) {
    tokens_ = std::move(spec.tokens);
    types_ = std::move(spec.token_types);
    if (tokens_.empty()) return Status::InvalidArgument("tokenizer: the vocabulary is empty");
    if (types_.empty()) types_.assign(tokens_.size(), 1);
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
    chat_template_ = std::move(spec.chat_template);
    ignore_merges_ = spec.ignore_merges.value_or(std::string_view(pre_.name()) == "llama-bpe");

    const ByteLevelAlphabet& alphabet = ByteLevelAlphabet::Get();
    vocab_.reserve(tokens_.size());
    token_bytes_.resize(tokens_.size());
    for (int32_t id = 0; id < n; ++id) {
      const std::string& text = tokens_[id];
      if (text.empty()) continue;
      vocab_.emplace(text, id);  // the first id wins for duplicated texts
      // Like HF's ByteLevel decoder: text outside the byte alphabet (added tokens) is raw UTF-8.
      if (!alphabet.Decode(text, &token_bytes_[id])) token_bytes_[id] = text;
      if (types_[id] == kTypeControl || types_[id] == kTypeUserDefined) {
        literals_.push_back({text, id});
        literal_first_byte_[static_cast<uint8_t>(text[0])] = true;
      }
    }
    // Longest first, so that "<|im_start|>" beats a shorter literal sharing its start.
    std::stable_sort(literals_.begin(), literals_.end(), [](const Literal& a, const Literal& b) {
      return a.text.size() > b.text.size();
    });
    for (int b = 0; b < 256; ++b) byte_token_[b] = token_id(alphabet.Encode(b));
    return BuildMerges(spec.merges);
  }

  Status BuildMerges(const std::vector<std::string>& merges) {
    merges_.reserve(merges.size());
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      const std::string& merge = merges[rank];
      const size_t space = merge.find(' ', 1);
      auto bad = [&](const std::string& why) {
        return Status::CorruptFile("tokenizer: merge #" + std::to_string(rank) + " '" + merge +
                                   "' " + why);
      };
      if (space == std::string::npos) return bad("is not two tokens separated by a space");
      const std::string left = merge.substr(0, space), right = merge.substr(space + 1);
      const int32_t left_id = token_id(left), right_id = token_id(right);
      const int32_t merged_id = token_id(left + right);
      if (left_id < 0 || right_id < 0) return bad("uses a token missing from the vocabulary");
      if (merged_id < 0) return bad("makes a token missing from the vocabulary");
      // A repeated pair takes its last rank, as HF's merge map does.
      merges_[PairKey(left_id, right_id)] = {static_cast<int32_t>(rank), merged_id};
    }
    return Status::Ok();
  }

  const Literal* MatchLiteralAt(std::string_view text, size_t pos) const {
    if (!literal_first_byte_[static_cast<uint8_t>(text[pos])]) return nullptr;
    const std::string_view rest = text.substr(pos);
    for (const Literal& lit : literals_) {
      if (rest.starts_with(lit.text)) return &lit;
    }
    return nullptr;
  }

  void EncodePlain(std::string_view text, std::vector<int32_t>* ids) const {
    if (text.empty()) return;
    std::vector<std::string_view> pieces;
    pre_.Split(text, &pieces);
    for (std::string_view piece : pieces) EncodePiece(piece, ids);
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
      if (id < 0) id = unk_id_;
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
      auto it = merges_.find(PairKey(symbols[pos].id, symbols[next].id));
      if (it != merges_.end()) queue.push({it->second.rank, pos, it->second.id});
    };
    for (int32_t pos = 0; pos + 1 < static_cast<int32_t>(symbols.size()); ++pos) push_pair(pos);

    while (!queue.empty()) {
      const Candidate top = queue.top();
      queue.pop();
      Symbol& left = symbols[top.pos];
      if (left.removed || left.next < 0) continue;
      const int32_t right_pos = left.next;
      auto it = merges_.find(PairKey(left.id, symbols[right_pos].id));
      if (it == merges_.end() || it->second.id != top.merged_id) continue;  // stale entry
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
  std::vector<std::string> tokens_;
  std::vector<int32_t> types_;
  std::vector<std::string> token_bytes_;  // what each token decodes to
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> vocab_;
  std::unordered_map<uint64_t, MergeResult> merges_;  // PairKey(left, right) -> merge
  std::array<int32_t, 256> byte_token_{};             // the single-byte token of each byte
  std::vector<Literal> literals_;                     // longest first
  std::array<bool, 256> literal_first_byte_{};
  int32_t bos_id_ = -1, eos_id_ = -1, unk_id_ = -1;
  bool add_bos_ = false;
  bool ignore_merges_ = false;
  std::string chat_template_;

  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>>
      cache_;  // pre-token bytes -> ids
};

// ---- HF tokenizer.json ----------------------------------------------------------------------

using nlohmann::json;

constexpr std::string_view kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::string_view kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|)"
    R"( ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

Result<json> ReadJsonFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound(path + ": cannot open the file");
  std::stringstream content;
  content << in.rdbuf();
  if (in.bad()) return Status::IoError(path + ": read failed");
  try {
    return json::parse(content.str());
  } catch (const json::exception& e) {
    return Status::CorruptFile(path + ": not valid JSON: " + e.what());
  }
}

bool IsType(const json& j, std::string_view type) {
  return j.is_object() && j.contains("type") && j["type"] == type;
}

// ByteLevel pre-tokenizer without a prefix space, with or without its own GPT-2 regex split.
bool IsByteLevel(const json& j, bool use_regex) {
  return IsType(j, "ByteLevel") && !j.value("add_prefix_space", false) &&
         j.value("use_regex", true) == use_regex;
}

bool IsRegexSplit(const json& j, std::string_view regex) {
  return IsType(j, "Split") && j.contains("pattern") && j["pattern"].is_object() &&
         j["pattern"].value("Regex", "") == regex && j.value("behavior", "") == "Isolated" &&
         !j.value("invert", false);
}

// Maps the pre_tokenizer configurations kvflow implements to their llama.cpp names.
Result<std::string> ClassifyPreTokenizer(const json& pt, const std::string& path) {
  if (IsByteLevel(pt, /*use_regex=*/true)) return std::string("gpt2");
  if (IsType(pt, "Sequence") && pt.contains("pretokenizers") && pt["pretokenizers"].is_array() &&
      pt["pretokenizers"].size() == 2) {
    const json& first = pt["pretokenizers"][0];
    const json& second = pt["pretokenizers"][1];
    if (IsType(first, "Digits") && first.value("individual_digits", false) &&
        IsByteLevel(second, /*use_regex=*/true)) {
      return std::string("smollm");
    }
    if (IsRegexSplit(first, kLlama3Regex) && IsByteLevel(second, /*use_regex=*/false)) {
      return std::string("llama-bpe");
    }
    if (IsRegexSplit(first, kGpt2Regex) && IsByteLevel(second, /*use_regex=*/false)) {
      return std::string("gpt2");
    }
  }
  std::string seen = pt.dump();
  if (seen.size() > 400) seen = seen.substr(0, 400) + "...";
  return Status::Unsupported(path + ": unsupported pre_tokenizer " + seen +
                             " (known: GPT-2 ByteLevel, Digits+ByteLevel as in SmolLM, "
                             "Llama-3 Split+ByteLevel)");
}

// The text of a token given as "text" or {"content": "text", ...} in tokenizer_config.json.
std::string TokenContent(const json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j["content"].is_string()) {
    return j["content"].get<std::string>();
  }
  return "";
}

int32_t FindToken(const TokenizerSpec& spec, const std::string& text) {
  if (text.empty()) return -1;
  auto it = std::find(spec.tokens.begin(), spec.tokens.end(), text);
  return it == spec.tokens.end() ? -1 : static_cast<int32_t>(it - spec.tokens.begin());
}

// A TemplateProcessing post-processor that starts single sequences with a special token is how
// HF adds BOS (Llama-3); returns that token's text or "".
std::string TemplateBosToken(const json& post) {
  if (IsType(post, "Sequence") && post.contains("processors")) {
    for (const json& p : post["processors"]) {
      if (std::string bos = TemplateBosToken(p); !bos.empty()) return bos;
    }
    return "";
  }
  if (!IsType(post, "TemplateProcessing") || !post.contains("single")) return "";
  const json& single = post["single"];
  if (!single.is_array() || single.empty() || !single[0].contains("SpecialToken")) return "";
  return single[0]["SpecialToken"].value("id", "");
}

Status CheckSupportedModel(const json& root, const std::string& path) {
  const json& model = root.at("model");
  const std::string type = model.value("type", "BPE");
  if (type != "BPE") return Status::Unsupported(path + ": model type '" + type + "' (only BPE)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && model[key].is_string() && !model[key].get<std::string>().empty()) {
      return Status::Unsupported(path + ": BPE " + key + " is not supported");
    }
  }
  if (model.value("byte_fallback", false)) {
    return Status::Unsupported(path + ": BPE byte_fallback (SentencePiece style) is not supported");
  }
  if (root.contains("normalizer") && !root["normalizer"].is_null()) {
    return Status::Unsupported(path + ": normalizer " + root["normalizer"].dump() +
                               " is not supported");
  }
  if (root.contains("decoder") && !root["decoder"].is_null() &&
      !IsType(root["decoder"], "ByteLevel")) {
    return Status::Unsupported(path + ": decoder " + root["decoder"].dump() +
                               " is not supported (only ByteLevel)");
  }
  return Status::Ok();
}

Status ParseHfTokenizer(const json& root, const std::string& path, TokenizerSpec* spec) {
  KVFLOW_RETURN_IF_ERROR(CheckSupportedModel(root, path));
  const json& model = root.at("model");
  auto set_token = [&](int64_t id, std::string text, int32_t type) -> Status {
    if (id < 0 || id > (1 << 24)) {
      return Status::CorruptFile(path + ": token '" + text + "' has id " + std::to_string(id));
    }
    if (id >= static_cast<int64_t>(spec->tokens.size())) {
      spec->tokens.resize(id + 1);
      spec->token_types.resize(id + 1, 1);
    }
    spec->tokens[id] = std::move(text);
    spec->token_types[id] = type;
    return Status::Ok();
  };
  if (!model.at("vocab").is_object()) {
    return Status::CorruptFile(path + ": model.vocab is not a token -> id object");
  }
  for (const auto& [text, id] : model["vocab"].items()) {
    KVFLOW_RETURN_IF_ERROR(set_token(id.get<int64_t>(), text, 1));
  }
  for (const json& merge : model.at("merges")) {
    if (merge.is_array() && merge.size() == 2) {
      spec->merges.push_back(merge[0].get<std::string>() + " " + merge[1].get<std::string>());
    } else {
      spec->merges.push_back(merge.get<std::string>());
    }
  }
  if (model.contains("ignore_merges")) spec->ignore_merges = model["ignore_merges"].get<bool>();
  if (root.contains("added_tokens")) {
    for (const json& added : root["added_tokens"]) {
      const bool special = added.value("special", false);
      KVFLOW_RETURN_IF_ERROR(set_token(added.at("id").get<int64_t>(),
                                       added.at("content").get<std::string>(),
                                       special ? kTypeControl : kTypeUserDefined));
    }
  }
  const json pre = root.contains("pre_tokenizer") ? root["pre_tokenizer"] : json();
  KVFLOW_ASSIGN_OR_RETURN(spec->pre, ClassifyPreTokenizer(pre, path));
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    spec->unk_id = FindToken(*spec, model["unk_token"].get<std::string>());
  }
  if (root.contains("post_processor")) {
    const int32_t bos = FindToken(*spec, TemplateBosToken(root["post_processor"]));
    if (bos >= 0) {
      spec->bos_id = bos;
      spec->add_bos = true;
    }
  }
  return Status::Ok();
}

// tokenizer_config.json: bos/eos token texts, add_bos_token and the chat template.
void ApplyTokenizerConfig(const json& config, TokenizerSpec* spec) {
  const std::pair<const char*, int32_t*> roles[] = {
      {"bos_token", &spec->bos_id}, {"eos_token", &spec->eos_id}, {"pad_token", &spec->pad_id}};
  for (const auto& [key, id] : roles) {
    if (!config.contains(key)) continue;
    if (int32_t found = FindToken(*spec, TokenContent(config[key])); found >= 0) *id = found;
  }
  if (config.contains("add_bos_token") && config["add_bos_token"].is_boolean()) {
    spec->add_bos = config["add_bos_token"].get<bool>();
  }
  if (config.contains("chat_template")) {
    const json& tmpl = config["chat_template"];
    if (tmpl.is_string()) {
      spec->chat_template = tmpl.get<std::string>();
    } else if (tmpl.is_array()) {  // named templates: [{"name": ..., "template": ...}]
      for (const json& named : tmpl) {
        if (spec->chat_template.empty() || named.value("name", "") == "default") {
          spec->chat_template = named.value("template", "");
        }
      }
    }
  }
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> Tokenizer::FromSpec(TokenizerSpec spec) {
  return BpeTokenizer::Create(std::move(spec));
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::FromHfJson(const std::string& path) {
  KVFLOW_ASSIGN_OR_RETURN(json root, ReadJsonFile(path));
  TokenizerSpec spec;
  try {
    KVFLOW_RETURN_IF_ERROR(ParseHfTokenizer(root, path, &spec));
  } catch (const json::exception& e) {
    return Status::CorruptFile(path + ": unexpected tokenizer.json layout: " + e.what());
  }
  const std::string config_path =
      (std::filesystem::path(path).parent_path() / "tokenizer_config.json").string();
  std::error_code ec;
  if (std::filesystem::exists(config_path, ec)) {
    KVFLOW_ASSIGN_OR_RETURN(json config, ReadJsonFile(config_path));
    try {
      ApplyTokenizerConfig(config, &spec);
    } catch (const json::exception& e) {
      return Status::CorruptFile(config_path + ": unexpected layout: " + e.what());
    }
  }
  return FromSpec(std::move(spec));
}

// ---- IncrementalDecoder ---------------------------------------------------------------------

std::string IncrementalDecoder::Push(int32_t token) {
  pending_ += tok_.DecodeBytes({token}, skip_special_);
  const size_t complete = CompletePrefixLength(pending_);
  std::string out = SanitizeUtf8(std::string_view(pending_).substr(0, complete));
  pending_.erase(0, complete);
  return out;
}

std::string IncrementalDecoder::Flush() {
  std::string out = SanitizeUtf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace kvflow
