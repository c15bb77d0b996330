#include "kvflow/tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "model/utf8.h"
#include "model/vocab_tokenizer.h"

namespace kvflow {
namespace {

// Length of the prefix of `bytes` that ends before a trailing, still-completable UTF-8 sequence.
size_t CompletePrefixLength(std::string_view bytes) {
  for (size_t pos = 0; pos < bytes.size();) {
    const Utf8Step step = DecodeUtf8(bytes, pos);
    if (step.truncated) return pos;
    pos += step.len;
  }
  return bytes.size();
}

// ---- HF tokenizer.json ----------------------------------------------------------------------

using nlohmann::json;

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

// One stage of a pre_tokenizer, written canonically, e.g. "Split(<regex>)", "ByteLevel(regex)".
// Returns "" for a stage kvflow does not implement.
std::string CanonicalStage(const json& j) {
  if (IsType(j, "ByteLevel")) {
    if (j.value("add_prefix_space", false)) return "";
    return j.value("use_regex", true) ? "ByteLevel(regex)" : "ByteLevel";
  }
  if (IsType(j, "Split")) {
    if (j.value("behavior", "") != "Isolated" || j.value("invert", false) || !j.contains("pattern") ||
        !j["pattern"].is_object() || !j["pattern"].contains("Regex") || !j["pattern"]["Regex"].is_string()) {
      return "";
    }
    return "Split(" + j["pattern"]["Regex"].get<std::string>() + ")";
  }
  if (IsType(j, "Digits")) return j.value("individual_digits", false) ? "Digits(1)" : "Digits(0)";
  if (IsType(j, "Punctuation")) return j.value("behavior", "") == "Contiguous" ? "Punctuation" : "";
  return "";
}

constexpr std::string_view kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// The real models' pre_tokenizer sequences and the llama.cpp names of the splits they make.
struct KnownSequence {
  const char* pre;
  std::vector<std::string> stages;
};

const std::vector<KnownSequence>& KnownSequences() {
  static const std::vector<KnownSequence> known = {
      {"gpt2", {"ByteLevel(regex)"}},
      {"gpt2", {"Split(" + std::string(kGpt2Regex) + ")", "ByteLevel"}},
      {"smollm", {"Digits(1)", "ByteLevel(regex)"}},  // SmolLM, StarCoder
      {"llama-bpe",
       {R"(Split((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+))",
        "ByteLevel"}},
      {"qwen2",
       {R"(Split((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+))",
        "ByteLevel"}},
      {"falcon", {"Punctuation", "ByteLevel(regex)", "Digits(0)", "Split([0-9][0-9][0-9])"}},
      // The line-break class written with regex escapes or with the characters themselves.
      {"deepseek-coder",
       {R"(Split([\r\n]))", R"(Split(\s?\p{L}+))", R"(Split(\s?\p{P}+))",
        "Split([\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+)", "Digits(1)", "ByteLevel"}},
      {"deepseek-coder",
       {"Split([\r\n])", R"(Split(\s?\p{L}+))", R"(Split(\s?\p{P}+))",
        "Split([\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+)", "Digits(1)", "ByteLevel"}},
  };
  return known;
}

// Maps a byte-level pre_tokenizer configuration kvflow implements to its llama.cpp name.
Result<std::string> ClassifyPreTokenizer(const json& pt, const std::string& path) {
  std::vector<std::string> stages;
  const bool sequence = IsType(pt, "Sequence") && pt.contains("pretokenizers") && pt["pretokenizers"].is_array();
  for (const json& stage : sequence ? pt["pretokenizers"] : json::array({pt})) {
    stages.push_back(CanonicalStage(stage));
  }
  for (const KnownSequence& known : KnownSequences()) {
    if (stages == known.stages) return std::string(known.pre);
  }
  std::string seen = pt.dump();
  if (seen.size() > 400) seen = seen.substr(0, 400) + "...";
  return Status::Unsupported(path + ": unsupported pre_tokenizer " + seen +
                             " (known: those of GPT-2, SmolLM and StarCoder, Llama-3, Qwen2, "
                             "Falcon, DeepSeek-Coder)");
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

std::string Shown(const json& j) {
  std::string seen = j.dump();
  return seen.size() > 300 ? seen.substr(0, 300) + "..." : seen;
}

bool IsNull(const json& root, const char* key) { return !root.contains(key) || root[key].is_null(); }

// A Replace normalizer or decoder of the literal `from` by `to`.
bool IsReplace(const json& j, std::string_view from, std::string_view to) {
  return IsType(j, "Replace") && j.contains("pattern") && j["pattern"].is_object() &&
         j["pattern"].value("String", "") == from && j.value("content", "") == to;
}

const json& Items(const json& j, const char* key) {
  static const json kEmpty = json::array();
  return j.contains(key) && j[key].is_array() ? j[key] : kEmpty;
}

// SentencePiece converted to HF (BPE with byte_fallback): where "▁" is put before the text, from
// the legacy normalizer (Prepend + Replace) or a Metaspace pre-tokenizer; and a decoder that turns
// "▁" back into spaces and drops the leading one exactly when the encoder adds it.
Status ClassifySentencePiece(const json& root, const std::string& path, TokenizerSpec* spec) {
  spec->model = "llama";
  const json& norm = IsNull(root, "normalizer") ? json() : root["normalizer"];
  const json& pre = IsNull(root, "pre_tokenizer") ? json() : root["pre_tokenizer"];
  const json& norms = Items(norm, "normalizers");
  if (IsType(norm, "Sequence") && norms.size() == 2 && IsType(norms[0], "Prepend") &&
      norms[0].value("prepend", "") == "\u2581" && IsReplace(norms[1], " ", "\u2581") && pre.is_null()) {
    spec->space_prefix = TokenizerSpec::SpacePrefix::kAfterSpecial;
  } else if (IsReplace(norm, " ", "\u2581") && pre.is_null()) {
    spec->space_prefix = TokenizerSpec::SpacePrefix::kNone;
  } else if (norm.is_null() && IsType(pre, "Metaspace") && pre.value("replacement", "") == "\u2581" &&
             !pre.value("split", true)) {
    const std::string scheme = pre.value("prepend_scheme", "always");
    if (scheme == "always") {
      spec->space_prefix = TokenizerSpec::SpacePrefix::kAfterSpecial;
    } else if (scheme == "first") {
      spec->space_prefix = TokenizerSpec::SpacePrefix::kFirst;
    } else if (scheme == "never") {
      spec->space_prefix = TokenizerSpec::SpacePrefix::kNone;
    } else {
      return Status::Unsupported(path + ": Metaspace prepend_scheme '" + scheme + "' is not supported");
    }
  } else {
    return Status::Unsupported(path + ": SentencePiece-style BPE with normalizer " + Shown(norm) +
                               " and pre_tokenizer " + Shown(pre) +
                               " is not supported (known: Prepend+Replace \"\u2581\", or Metaspace "
                               "without split)");
  }
  const json& dec = IsNull(root, "decoder") ? json() : root["decoder"];
  const bool prefixed = spec->space_prefix != TokenizerSpec::SpacePrefix::kNone;
  bool decodes = false;
  if (IsType(dec, "Metaspace")) {
    decodes = (dec.value("prepend_scheme", "always") != "never") == prefixed;
  } else if (IsType(dec, "Sequence")) {
    const json& steps = Items(dec, "decoders");
    bool spaces = false, bytes = false, strip = false;
    for (const json& step : steps) {
      spaces |= IsReplace(step, "\u2581", " ");
      bytes |= IsType(step, "ByteFallback");
      strip |= IsType(step, "Strip") && step.value("content", "") == " " && step.value("start", 0) == 1 &&
               step.value("stop", 0) == 0;
    }
    decodes = spaces && bytes && strip == prefixed;
  }
  if (!decodes) {
    return Status::Unsupported(path + ": decoder " + Shown(dec) + " does not undo the encoder's \"\u2581\"" +
                               (prefixed ? " and leading space" : "") + " as kvflow decodes");
  }
  return Status::Ok();
}

// Which model a tokenizer.json is, in llama.cpp's terms, or why kvflow cannot encode it exactly.
Status ClassifyModel(const json& root, const std::string& path, TokenizerSpec* spec) {
  const json& model = root.at("model");
  const std::string type = model.value("type", "BPE");
  if (type != "BPE") return Status::Unsupported(path + ": model type '" + type + "' (only BPE)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && model[key].is_string() && !model[key].get<std::string>().empty()) {
      return Status::Unsupported(path + ": BPE " + key + " is not supported");
    }
  }
  if (model.contains("dropout") && model["dropout"].is_number() && model["dropout"].get<double>() > 0) {
    return Status::Unsupported(path + ": BPE dropout is not supported (it makes encoding random)");
  }
  if (model.value("byte_fallback", false)) return ClassifySentencePiece(root, path, spec);
  spec->model = "gpt2";
  if (!IsNull(root, "normalizer")) {
    if (!IsType(root["normalizer"], "NFC")) {
      return Status::Unsupported(path + ": normalizer " + Shown(root["normalizer"]) +
                                 " is not supported (only NFC)");
    }
    spec->nfc = true;
  }
  if (!IsNull(root, "decoder") && !IsType(root["decoder"], "ByteLevel")) {
    return Status::Unsupported(path + ": decoder " + Shown(root["decoder"]) +
                               " is not supported (only ByteLevel)");
  }
  return Status::Ok();
}

Status ParseHfTokenizer(const json& root, const std::string& path, TokenizerSpec* spec) {
  KVFLOW_RETURN_IF_ERROR(ClassifyModel(root, path, spec));
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
  const bool spm = spec->model == "llama";
  for (const auto& [text, id] : model["vocab"].items()) {
    // SentencePiece's byte-fallback tokens are plain vocabulary entries spelled <0xXX>.
    const bool byte = spm && text.size() == 6 && text.starts_with("<0x") && text.back() == '>';
    KVFLOW_RETURN_IF_ERROR(set_token(id.get<int64_t>(), text, byte ? kTokenByte : kTokenNormal));
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
      const int64_t id = added.at("id").get<int64_t>();
      KVFLOW_RETURN_IF_ERROR(set_token(id, added.at("content").get<std::string>(),
                                       special ? kTokenControl : kTokenUserDefined));
      if (added.value("lstrip", false)) spec->lstrip_ids.push_back(static_cast<int32_t>(id));
      if (added.value("rstrip", false)) spec->rstrip_ids.push_back(static_cast<int32_t>(id));
    }
  }
  if (!spm) {
    const json pre = IsNull(root, "pre_tokenizer") ? json() : root["pre_tokenizer"];
    KVFLOW_ASSIGN_OR_RETURN(spec->pre, ClassifyPreTokenizer(pre, path));
  }
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
  if (spec.model == "gpt2") return MakeByteLevelBpeTokenizer(std::move(spec));
  if (spec.model == "llama") return MakeSentencePieceTokenizer(std::move(spec));
  return Status::Unsupported("tokenizer model '" + spec.model +
                             "' is not supported (known: gpt2, byte-level BPE; llama, SentencePiece)");
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
  pending_ += tok_.TokenBytes(token, skip_special_);
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
