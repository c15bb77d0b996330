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

#include "chat_template/chat_template.h"
#include "tool_calls/tool_call_constraint.h"
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
  // The fields that set sampling.structured_output (response_format, vLLM's structured_outputs and
  // guided_*, llama.cpp's json_schema and grammar): more than one is refused.
  std::vector<std::string> constraint_fields;
  bool max_tokens_given = false;  // else the endpoint's default applies
  bool stream = false;
  bool include_usage = false;     // stream_options.include_usage
  // vLLM's prompt_logprobs (0..20 alternatives): returned with the response. What the engine is
  // asked for is sampling.prompt_logprobs, which echo with logprobs may set as well.
  std::optional<int> prompt_logprobs;
};

struct CompletionRequest : GenerationRequest {
  std::vector<PromptInput> prompts;
  bool echo = false;
  bool logprobs_given = false;  // "logprobs": 0 still returns the chosen tokens' logprobs
};

struct ChatRequest : GenerationRequest {
  // messages (normalised), tools, add_generation_prompt and chat_template_kwargs.
  ChatTemplateInput chat;
  bool logprobs = false;  // top_logprobs goes to sampling.logprobs
  // OpenAI's tool_choice: unset means "auto" when there are tools, else "none".
  std::optional<ToolChoice> tool_choice;
  bool parallel_tool_calls = true;
};

// Parse and validate a body. max_tokens 0 (return or score the prompt only) is allowed with
// prompt_logprobs, and on /v1/completions with echo. Cross-field rules that need the model (context length, n against
// max_num_seqs) are checked later, by the server and the engine.
std::optional<ApiError> ParseCompletionRequest(std::string_view body, CompletionRequest* out);
std::optional<ApiError> ParseChatRequest(std::string_view body, ChatRequest* out);

// /tokenize, in vLLM's shapes ({"prompt", "add_special_tokens" (default true)}, or {"messages",
// "tools", "add_generation_prompt", "chat_template_kwargs", "add_special_tokens" (default false)})
// and llama.cpp's ({"content", "add_special" (default false), "with_pieces"}).
struct TokenizeRequest {
  std::string model;
  bool chat = false;
  std::string text;                   // when !chat
  ChatTemplateInput chat_input;       // when chat
  bool add_special = false;           // the tokenizer's BOS, where it adds one
  bool with_pieces = false;           // llama.cpp: each token with its text
};
std::optional<ApiError> ParseTokenizeRequest(std::string_view body, TokenizeRequest* out);

// llama.cpp's /apply-template: {"messages", "tools", "add_generation_prompt",
// "chat_template_kwargs"}, answered with {"prompt": the rendered text}.
std::optional<ApiError> ParseApplyTemplateRequest(std::string_view body, ChatTemplateInput* out);

// /detokenize, both servers' shape: {"tokens": [ids]}.
struct DetokenizeRequest {
  std::string model;
  std::vector<int32_t> tokens;
};
std::optional<ApiError> ParseDetokenizeRequest(std::string_view body, DetokenizeRequest* out);

// "stop", "length", "abort" (cancelled) or "error".
const char* OpenAiFinishReason(FinishReason reason);

// The `logprobs` objects of /v1/completions (`text_offset` counted from `text_offset_start`)
// and of /v1/chat/completions, for the generated tokens.
Json CompletionLogprobs(const Tokenizer& tokenizer, const std::vector<SampledToken>& tokens, size_t text_offset_start);
Json ChatLogprobs(const Tokenizer& tokenizer, const std::vector<SampledToken>& tokens);

// The prompt's part of a /v1/completions `logprobs` object with echo: every prompt token, the
// first with null logprob and top_logprobs, the others with their logprob (`logprobs` from the
// engine: entry i is prompt token i + 1) and up to `top` alternatives. `text_offset` counts from 0
// over `echo_text`; a special token that is not written there (a BOS the tokenizer added) takes no
// room in it.
Json EchoLogprobs(const Tokenizer& tokenizer, const std::vector<int32_t>& prompt,
                  const std::vector<SampledToken>& logprobs, int top, const std::string& echo_text);
// Appends the arrays of one completions `logprobs` object to another's.
void AppendCompletionLogprobs(Json* to, const Json& more);
// vLLM's `prompt_logprobs`: one entry per prompt token, null for the first, else
// {"<token id>": {"logprob", "decoded_token"}} for the prompt token and then up to `top`
// alternatives, most likely first.
Json PromptLogprobs(const Tokenizer& tokenizer, const std::vector<SampledToken>& logprobs, int top);

// Serialises JSON; invalid UTF-8 (a token that ends inside a character) becomes U+FFFD.
std::string DumpJson(const Json& json);

}  // namespace kvflow::server
