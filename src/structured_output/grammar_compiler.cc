#include "structured_output/grammar_compiler.h"

#include <algorithm>
#include <exception>
#include <stdexcept>
#include <string_view>
#include <thread>

#include <nlohmann/json.hpp>

#include "util/thread_pool.h"

#if defined(KVFLOW_WITH_XGRAMMAR)
#include <dlpack/dlpack.h>
#include <xgrammar/xgrammar.h>
#endif

namespace kvflow {

namespace {

// A string literal of xgrammar's EBNF: quotes and backslashes escaped, control characters as
// \uXXXX (fixed width: xgrammar's \x takes every hex digit that follows), other bytes as they are.
std::string EbnfLiteral(std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "\"";
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20 || c == 0x7f) {
      out += "\\u00";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

// xgrammar's messages may run long (a whole grammar echoed back): keep the start.
std::string Shorten(std::string message) {
  constexpr size_t kMax = 600;
  if (message.size() > kMax) message = message.substr(0, kMax) + " ...";
  return message;
}

#if defined(KVFLOW_WITH_XGRAMMAR)
// xgrammar's errors read "[12:00:00] /path/to/file.cc:123: Check failed: (cond) is false: what";
// keep what.
std::string XgrammarReason(std::string message) {
  if (!message.empty() && message[0] == '[') {
    if (const size_t end = message.find("] "); end != std::string::npos) message.erase(0, end + 2);
  }
  if (const size_t colon = message.find(": "); colon != std::string::npos) {
    const std::string_view where(message.data(), colon);  // "/path/file.cc:123"
    const size_t line = where.rfind(':');
    if (line != std::string_view::npos && where.find(' ') == std::string_view::npos &&
        where.find_first_not_of("0123456789", line + 1) == std::string_view::npos &&
        (where.substr(0, line).ends_with(".cc") || where.substr(0, line).ends_with(".h"))) {
      message.erase(0, colon + 2);
    }
  }
  if (message.rfind("Check failed: ", 0) == 0) {
    if (const size_t end = message.find(" is false: "); end != std::string::npos) message.erase(0, end + 11);
  }
  while (!message.empty() && (message.back() == '\n' || message.back() == ' ')) message.pop_back();
  return Shorten(std::move(message));
}
#endif

}  // namespace

Result<std::string> ChoiceGrammar(const std::string& choices_json) {
  const nlohmann::json choices = nlohmann::json::parse(choices_json, nullptr, /*allow_exceptions=*/false);
  if (!choices.is_array() || choices.empty()) {
    return Status::InvalidArgument("structured_output choice: the spec must be a non-empty JSON array of strings, got " +
                                   Shorten(choices_json));
  }
  std::string grammar = "root ::= ";
  for (size_t i = 0; i < choices.size(); ++i) {
    if (!choices[i].is_string()) {
      return Status::InvalidArgument("structured_output choice: choice " + std::to_string(i) +
                                     " is not a string: " + Shorten(choices[i].dump()));
    }
    grammar += (i == 0 ? "" : " | ") + EbnfLiteral(choices[i].get<std::string>());
  }
  return grammar;
}

Status NoXgrammarStatus() {
  return Status::Unsupported(
      "structured output needs xgrammar, and this kvflow was built without it: run tools/install-deps (it fetches "
      "xgrammar's source into .cache/xgrammar), then configure again (cmake -S . -B build -DKVFLOW_XGRAMMAR=ON) "
      "and rebuild");
}

#if defined(KVFLOW_WITH_XGRAMMAR)

bool StructuredOutputAvailable() { return true; }

// ---- GrammarMatcher ---------------------------------------------------------------------------

struct GrammarMatcher::Impl {
  xgrammar::GrammarMatcher matcher;
  int64_t vocab_size = 0;
  // Tokens xgrammar never accepts (special tokens, ids past the tokenizer's): refused here, before
  // xgrammar would log a warning for each.
  std::shared_ptr<const std::vector<bool>> never;
};

GrammarMatcher::GrammarMatcher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GrammarMatcher::~GrammarMatcher() = default;

bool GrammarMatcher::AcceptToken(int32_t token) {
  if (token < 0 || token >= impl_->vocab_size || (*impl_->never)[static_cast<size_t>(token)]) return false;
  try {
    return impl_->matcher.AcceptToken(token);
  } catch (const std::exception&) {
    return false;
  }
}

bool GrammarMatcher::FillNextTokenMask(std::span<uint32_t> mask) {
  int64_t shape[1] = {static_cast<int64_t>(mask.size())};
  DLTensor tensor{};
  tensor.data = mask.data();
  tensor.device = DLDevice{kDLCPU, 0};
  tensor.ndim = 1;
  tensor.dtype = DLDataType{kDLInt, 32, 1};
  tensor.shape = shape;
  tensor.strides = nullptr;
  tensor.byte_offset = 0;
  return impl_->matcher.FillNextTokenBitmask(&tensor);
}

void GrammarMatcher::Rollback(int num_tokens) {
  if (num_tokens > 0) impl_->matcher.Rollback(num_tokens);
}
void GrammarMatcher::Reset() { impl_->matcher.Reset(); }
bool GrammarMatcher::IsTerminated() const { return impl_->matcher.IsTerminated(); }
bool GrammarMatcher::IsCompleted() const { return impl_->matcher.IsCompleted(); }
int64_t GrammarMatcher::MaskWords() const { return (impl_->vocab_size + 31) / 32; }

std::unique_ptr<GrammarMatcher> GrammarMatcher::Fork() const {
  auto impl = std::make_unique<Impl>(Impl{impl_->matcher.Fork(), impl_->vocab_size, impl_->never});
  return std::unique_ptr<GrammarMatcher>(new GrammarMatcher(std::move(impl)));
}

// ---- GrammarCompiler --------------------------------------------------------------------------

struct GrammarCompiler::Impl {
  xgrammar::TokenizerInfo tokenizer_info;
  mutable xgrammar::GrammarCompiler compiler;
  int64_t vocab_size;
  std::vector<int32_t> stop_token_ids;
  std::shared_ptr<const std::vector<bool>> never;  // GrammarMatcher::Impl::never

  // xgrammar's compiled grammar for `so`; throws what xgrammar throws for a bad spec.
  xgrammar::CompiledGrammar Compile(const StructuredOutput& so) const {
    using Kind = StructuredOutput::Kind;
    switch (so.kind) {
      case Kind::kJsonObject:
        // Any object (OpenAI's json_object): the schema {"type": "object"}, extra properties allowed.
        return compiler.CompileJSONSchema(R"({"type": "object"})", so.any_whitespace, std::nullopt, std::nullopt,
                                          /*strict_mode=*/false);
      case Kind::kJsonSchema:
        return compiler.CompileJSONSchema(so.spec, so.any_whitespace, std::nullopt, std::nullopt, so.strict);
      case Kind::kRegex:
        return compiler.CompileRegex(so.spec);
      case Kind::kChoice: {
        Result<std::string> grammar = ChoiceGrammar(so.spec);
        if (!grammar.ok()) throw std::invalid_argument(grammar.status().message());  // TryCompile checked it
        return compiler.CompileGrammar(grammar.value(), "root");
      }
      case Kind::kGrammar:
        return compiler.CompileGrammar(so.spec, "root");
      case Kind::kStructuralTag:
        return compiler.CompileStructuralTag(so.spec);
    }
    throw std::invalid_argument("unknown structured_output kind");
  }

  Result<xgrammar::CompiledGrammar> TryCompile(const StructuredOutput& so) const {
    if (so.kind == StructuredOutput::Kind::kChoice) KVFLOW_RETURN_IF_ERROR(ChoiceGrammar(so.spec).status());
    try {
      return Compile(so);
    } catch (const std::exception& e) {
      return Status::InvalidArgument(std::string("structured_output ") + StructuredOutputKindName(so.kind) +
                                     " is invalid: " + XgrammarReason(e.what()));
    } catch (...) {
      return Status::InvalidArgument(std::string("structured_output ") + StructuredOutputKindName(so.kind) +
                                     " is invalid");
    }
  }
};

GrammarCompiler::GrammarCompiler(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GrammarCompiler::~GrammarCompiler() = default;

Result<std::unique_ptr<GrammarCompiler>> GrammarCompiler::Create(const Tokenizer& tokenizer, int64_t vocab_size,
                                                                 std::vector<int32_t> stop_token_ids,
                                                                 const Options& options) {
  if (vocab_size <= 0) return Status::InvalidArgument("structured output: the vocabulary is empty");
  // Every token as the raw bytes it stands for, given to xgrammar as a RAW vocabulary: kvflow's
  // tokenizer already undoes the byte-level (GPT-2) spelling, added tokens included, so xgrammar
  // matches exactly the bytes kvflow's detokenizer emits. Special tokens (and ids past the
  // tokenizer's vocabulary) are empty, which xgrammar never allows; the stop tokens are EOS.
  const int64_t known = std::min<int64_t>(vocab_size, tokenizer.vocab_size());
  std::vector<std::string> vocab(static_cast<size_t>(known));
  for (int64_t id = 0; id < known; ++id) {
    const auto t = static_cast<int32_t>(id);
    if (!tokenizer.is_special(t)) vocab[static_cast<size_t>(id)] = tokenizer.TokenBytes(t, /*skip_special=*/false);
  }
  std::sort(stop_token_ids.begin(), stop_token_ids.end());
  stop_token_ids.erase(std::unique(stop_token_ids.begin(), stop_token_ids.end()), stop_token_ids.end());
  std::erase_if(stop_token_ids, [&](int32_t t) { return t < 0 || t >= vocab_size; });
  try {
    xgrammar::TokenizerInfo info(vocab, xgrammar::VocabType::RAW, static_cast<int>(vocab_size), stop_token_ids,
                                 /*add_prefix_space=*/false);
    const int threads = std::max(1, std::min<int>(options.max_threads, UsableCores()));
    xgrammar::GrammarCompiler compiler(info, threads, /*cache_enabled=*/true, options.cache_bytes);
    auto never = std::make_shared<std::vector<bool>>(static_cast<size_t>(vocab_size), false);
    for (int32_t t : info.GetSpecialTokenIds()) {
      if (t >= 0 && t < vocab_size) (*never)[static_cast<size_t>(t)] = true;
    }
    return std::unique_ptr<GrammarCompiler>(new GrammarCompiler(
        std::make_unique<Impl>(Impl{info, std::move(compiler), vocab_size, stop_token_ids, std::move(never)})));
  } catch (const std::exception& e) {
    return Status::Internal(std::string("structured output: xgrammar refused the tokenizer: ") + XgrammarReason(e.what()));
  }
}

Status GrammarCompiler::Check(const StructuredOutput& so) const { return impl_->TryCompile(so).status(); }

Result<std::unique_ptr<GrammarMatcher>> GrammarCompiler::NewMatcher(const StructuredOutput& so) const {
  KVFLOW_ASSIGN_OR_RETURN(xgrammar::CompiledGrammar compiled, impl_->TryCompile(so));
  try {
    // The engine's EOS ids are the tokenizer info's stop tokens; rollback is unbounded in this
    // xgrammar (max_rollback_tokens is deprecated), which speculative decoding's drafts need.
    auto impl = std::make_unique<GrammarMatcher::Impl>(
        GrammarMatcher::Impl{xgrammar::GrammarMatcher(compiled, std::nullopt, /*terminate_without_stop_token=*/false),
                             impl_->vocab_size, impl_->never});
    return std::unique_ptr<GrammarMatcher>(new GrammarMatcher(std::move(impl)));
  } catch (const std::exception& e) {
    return Status::Internal(std::string("structured output: xgrammar could not start a matcher: ") +
                            XgrammarReason(e.what()));
  }
}

int64_t GrammarCompiler::vocab_size() const { return impl_->vocab_size; }
const std::vector<int32_t>& GrammarCompiler::stop_token_ids() const { return impl_->stop_token_ids; }
int64_t GrammarCompiler::cache_size_bytes() const { return impl_->compiler.GetCacheSizeBytes(); }

#else  // !KVFLOW_WITH_XGRAMMAR: the same API, refusing.

bool StructuredOutputAvailable() { return false; }

struct GrammarMatcher::Impl {};
GrammarMatcher::GrammarMatcher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GrammarMatcher::~GrammarMatcher() = default;
bool GrammarMatcher::AcceptToken(int32_t) { return false; }
bool GrammarMatcher::FillNextTokenMask(std::span<uint32_t>) { return false; }
void GrammarMatcher::Rollback(int) {}
void GrammarMatcher::Reset() {}
bool GrammarMatcher::IsTerminated() const { return false; }
bool GrammarMatcher::IsCompleted() const { return false; }
int64_t GrammarMatcher::MaskWords() const { return 0; }
std::unique_ptr<GrammarMatcher> GrammarMatcher::Fork() const { return nullptr; }

struct GrammarCompiler::Impl {
  std::vector<int32_t> stop_token_ids;
};
GrammarCompiler::GrammarCompiler(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GrammarCompiler::~GrammarCompiler() = default;

Result<std::unique_ptr<GrammarCompiler>> GrammarCompiler::Create(const Tokenizer&, int64_t, std::vector<int32_t>,
                                                                 const Options&) {
  return NoXgrammarStatus();
}
Status GrammarCompiler::Check(const StructuredOutput&) const { return NoXgrammarStatus(); }
Result<std::unique_ptr<GrammarMatcher>> GrammarCompiler::NewMatcher(const StructuredOutput&) const {
  return NoXgrammarStatus();
}
int64_t GrammarCompiler::vocab_size() const { return 0; }
const std::vector<int32_t>& GrammarCompiler::stop_token_ids() const { return impl_->stop_token_ids; }
int64_t GrammarCompiler::cache_size_bytes() const { return 0; }

#endif

}  // namespace kvflow
