// The OpenAI HTTP API's request and response shapes: parsing and validating request bodies into
// kvflow SamplingParams, and building the JSON the official clients expect. No engine, no I/O:
// the fuzz target drives the parsers directly.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/chat_template.h"
#include "kvflow/request.h"
#include "kvflow/sampling.h"
#include "kvflow/tokenizer.h"

namespace kvflow::server {

using Json = nlohmann::ordered_json;

// An error in the OpenAI shape: {"error": {"message", "type", "param", "code"}}.
struct ApiError {
  int status = 400;
  std::string type = "invalid_request_error";
  std::string message;
  std::optional<std::string> param;
  std::optional<std::string> code;

  std::string ToJson() const;
};
ApiError InvalidRequest(std::string message, std::optional<std::string> param = std::nullopt);

// Bodies nested deeper than this are refused before parsing.
inline constexpr int kMaxJsonDepth = 64;

struct PromptInput {
  bool is_tokens = false;
  std::string text;             // when !is_tokens
  std::vector<int32_t> tokens;  // when is_tokens (used as given: no BOS is added)
};

// What both endpoints share.
struct GenerationRequest {
  std::string model;  // empty: not given
  SamplingParams sampling;
  bool max_tokens_given = false;  // else the endpoint's default applies
  bool stream = false;
  bool include_usage = false;     // stream_options.include_usage
};

struct CompletionRequest : GenerationRequest {
  std::vector<PromptInput> prompts;
  bool echo = false;
  bool logprobs_given = false;  // "logprobs": 0 still returns the chosen tokens' logprobs
};

struct ChatRequest : GenerationRequest {
  std::vector<ChatMessage> messages;
  bool logprobs = false;  // top_logprobs goes to sampling.logprobs
};

// Parse and validate a body. Cross-field rules that need the model (context length, n against
// max_num_seqs) are checked later, by the server and the engine.
std::optional<ApiError> ParseCompletionRequest(std::string_view body, CompletionRequest* out);
std::optional<ApiError> ParseChatRequest(std::string_view body, ChatRequest* out);

// "stop", "length", "abort" (cancelled) or "error".
const char* OpenAiFinishReason(FinishReason reason);

// The `logprobs` objects of /v1/completions (`text_offset` counted from `text_offset_start`)
// and of /v1/chat/completions, for the generated tokens.
Json CompletionLogprobs(const Tokenizer& tokenizer, const std::vector<SampledToken>& tokens, size_t text_offset_start);
Json ChatLogprobs(const Tokenizer& tokenizer, const std::vector<SampledToken>& tokens);

// Serialises JSON; invalid UTF-8 (a token that ends inside a character) becomes U+FFFD.
std::string DumpJson(const Json& json);

}  // namespace kvflow::server
