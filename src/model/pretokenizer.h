// Splits text into pre-tokens the way HF `tokenizers` pre-tokenizers do before BPE. The regexes
// are hand-written matchers over code points (std::regex has no \p{L}).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "kvflow/status.h"

namespace kvflow {

class PreTokenizer {
 public:
  enum class Kind {
    kGpt2,           // the GPT-2 regex
    kSmolLm,         // every \p{N} code point alone, then the GPT-2 regex (SmolLM, StarCoder)
    kLlama3,         // the Llama-3 regex
    kQwen2,          // the Llama-3 regex with one digit per piece (Qwen2, Qwen2.5, Qwen3)
    kFalcon,         // punctuation runs, the GPT-2 regex, then numeric byte runs parted in threes
    kDeepSeekCoder,  // line breaks, letters, punctuation, CJK runs, single digits
  };

  // `name` as llama.cpp spells it in `tokenizer.ggml.pre`: "gpt2", "smollm", "llama-bpe", ...
  static Result<PreTokenizer> FromName(std::string_view name);

  // Appends the pre-tokens of `text` to `out`: consecutive, non-empty byte ranges of `text`
  // that together cover it. Invalid UTF-8 bytes count as punctuation.
  void Split(std::string_view text, std::vector<std::string_view>* out) const;

  // The name it was made from.
  std::string_view name() const { return name_; }
  Kind kind() const { return kind_; }

 private:
  PreTokenizer(Kind kind, std::string_view name) : kind_(kind), name_(name) {}

  Kind kind_;
  std::string_view name_;  // points into a static table
};

}  // namespace kvflow
