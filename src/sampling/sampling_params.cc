#include <cmath>
#include <sstream>
#include <string>

#include "kvflow/sampling.h"

namespace kvflow {

namespace {

constexpr int kMaxCompletions = 256;

// "top_p must be in (0, 1], got 1.5": the field, what it accepts, and what it was given.
template <typename T>
Status OutOfRange(const char* field, const char* allowed, T value) {
  std::ostringstream message;
  message << field << " must be " << allowed << ", got " << value;
  return Status::InvalidArgument(message.str());
}

}  // namespace

const char* StructuredOutputKindName(StructuredOutput::Kind kind) {
  switch (kind) {
    case StructuredOutput::Kind::kJsonObject: return "json_object";
    case StructuredOutput::Kind::kJsonSchema: return "json_schema";
    case StructuredOutput::Kind::kRegex: return "regex";
    case StructuredOutput::Kind::kChoice: return "choice";
    case StructuredOutput::Kind::kGrammar: return "grammar";
    case StructuredOutput::Kind::kStructuralTag: return "structural_tag";
  }
  return "unknown";
}

Status SamplingParams::Validate() const {
  // Comparisons are written so that NaN fails them.
  if (!(temperature >= 0.0f && std::isfinite(temperature))) {
    return OutOfRange("temperature", "finite and >= 0", temperature);
  }
  if (top_k < -1) return OutOfRange("top_k", ">= -1 (<= 0 disables it)", top_k);
  if (!(top_p > 0.0f && top_p <= 1.0f)) return OutOfRange("top_p", "in (0, 1]", top_p);
  if (!(min_p >= 0.0f && min_p <= 1.0f)) return OutOfRange("min_p", "in [0, 1]", min_p);
  if (!(repetition_penalty > 0.0f && std::isfinite(repetition_penalty))) {
    return OutOfRange("repetition_penalty", "finite and > 0", repetition_penalty);
  }
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f)) {
    return OutOfRange("frequency_penalty", "in [-2, 2]", frequency_penalty);
  }
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f)) {
    return OutOfRange("presence_penalty", "in [-2, 2]", presence_penalty);
  }
  if (prompt_logprobs && (*prompt_logprobs < 0 || *prompt_logprobs > 20)) {
    return OutOfRange("prompt_logprobs", "in [0, 20]", *prompt_logprobs);
  }
  if (prompt_decode_from < 0) return OutOfRange("prompt_decode_from", ">= 0", prompt_decode_from);
  if (max_tokens < (prompt_logprobs ? 0 : 1)) {
    return OutOfRange("max_tokens", prompt_logprobs ? ">= 0" : ">= 1 (0 only to score the prompt, with prompt_logprobs)",
                      max_tokens);
  }
  if (max_tokens == 0 && (use_beam_search || num_candidates() > 1)) {
    return Status::InvalidArgument("max_tokens 0 (score the prompt only) cannot be combined with n, best_of or beam search");
  }
  if (min_tokens < 0 || min_tokens > max_tokens) {
    return OutOfRange("min_tokens", "in [0, max_tokens]", min_tokens);
  }
  if (logprobs < 0 || logprobs > 20) return OutOfRange("logprobs", "in [0, 20]", logprobs);
  if (n < 1 || n > kMaxCompletions) return OutOfRange("n", "in [1, 256]", n);
  if (best_of && (*best_of < n || *best_of > kMaxCompletions)) return OutOfRange("best_of", "in [n, 256]", *best_of);
  if (!(length_penalty >= -10.0f && length_penalty <= 10.0f)) {
    return OutOfRange("length_penalty", "in [-10, 10]", length_penalty);
  }
  if (use_beam_search) {
    if (temperature != 0.0f) return OutOfRange("temperature", "0 with beam search", temperature);
    if (!stop.empty()) return Status::InvalidArgument("stop strings are not supported with beam search");
  }
  if (logit_bias.size() > 1024) return OutOfRange("logit_bias", "at most 1024 tokens", static_cast<int>(logit_bias.size()));
  for (const auto& [token, bias] : logit_bias) {
    if (!(bias >= -100.0f && bias <= 100.0f)) {
      return Status::InvalidArgument("logit_bias must be in [-100, 100], got " + std::to_string(bias) + " for token " +
                                     std::to_string(token));
    }
  }
  if (structured_output) {
    const StructuredOutput& so = *structured_output;
    const char* kind = StructuredOutputKindName(so.kind);
    if (std::string(kind) == "unknown") return Status::InvalidArgument("structured_output has an unknown kind");
    if (so.kind != StructuredOutput::Kind::kJsonObject && so.spec.empty()) {
      return Status::InvalidArgument(std::string("structured_output ") + kind + " needs a spec");
    }
    constexpr size_t kMaxSpecBytes = size_t{1} << 20;
    if (so.spec.size() > kMaxSpecBytes) {
      return Status::InvalidArgument(std::string("structured_output ") + kind + " spec has " +
                                     std::to_string(so.spec.size()) + " bytes; at most 1 MiB");
    }
  }
  for (size_t i = 0; i < stop.size(); ++i) {
    if (stop[i].empty()) {
      return Status::InvalidArgument("stop[" + std::to_string(i) + "] must be a non-empty string");
    }
  }
  return Status::Ok();
}

}  // namespace kvflow
