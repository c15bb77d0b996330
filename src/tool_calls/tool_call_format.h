// The ways models write tool calls and reasoning in their output text, named as vLLM's
// --tool-call-parser / --reasoning-parser name them, and how to tell from a chat template which one a
// model uses. "generic" is llama.cpp's format for templates that render no tools: kvflow tells the
// model, in a system message, to answer with one JSON object, {"tool_calls": [...]} or {"response": ...}.
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "kvflow/status.h"

namespace kvflow {

enum class ToolCallFormat {
  kGeneric,          // {"tool_calls": [{"name", "arguments", "id"?}]} or {"response": "..."}
  kHermes,           // <tool_call>{"name", "arguments"}</tool_call> (Qwen2.5, QwQ, Qwen3, Hermes-2-Pro)
  kQwen3Coder,       // <tool_call><function=f><parameter=p>value</parameter></function></tool_call>
  kLlama3Json,       // [<|python_tag|>]{"name", "parameters"} at the start (Llama-3.1/3.2)
  kMistral,          // [TOOL_CALLS][{"name", "arguments", "id"}, ...] (Mistral-Nemo)
  kMistralArgs,      // [TOOL_CALLS]name[ARGS]{...} repeated (Devstral-2507; [CALL_ID]id optional)
  kGranite,          // <|tool_call|>[{"name", "arguments"}, ...]
  kFunctionaryV32,   // name\n{...}>>>name\n{...}; >>>all\ntext is content (the prompt ends with >>>)
  kFirefunctionV2,   //  functools[{"name", "arguments"}, ...]
  kCommandR7b,       // <|START_ACTION|>[{"tool_call_id", "tool_name", "parameters"}]<|END_ACTION|>
  kDeepSeekR1,       // <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name\n```json\n{...}\n```<｜tool▁call▁end｜>...
};

enum class ReasoningFormat {
  kNone,
  kDeepSeekR1,  // <think>...</think>; the prompt usually opens <think> already
  kQwen3,       // <think>...</think>
  kCommandR7b,  // <|START_THINKING|>...<|END_THINKING|>
};

const char* ToolCallFormatName(ToolCallFormat format);
// The format of a --tool-call-parser name (vLLM's names where it has them; "deepseek_v3" is
// accepted for deepseek_r1); InvalidArgument listing the names otherwise.
Result<ToolCallFormat> ToolCallFormatFromName(std::string_view name);
// The format a chat template writes tool calls in, from the markers in its text; generic when it
// has none of them (e.g. a template that never reads `tools`).
ToolCallFormat DetectToolCallFormat(const std::string& template_source);
// Whether the template renders the tool definitions itself (reads `tools`); where it does not, the
// model learns them only from the system message of PrepareGenericToolMessages.
bool TemplateReadsTools(const std::string& template_source);

const char* ReasoningFormatName(ReasoningFormat format);
Result<ReasoningFormat> ReasoningFormatFromName(std::string_view name);  // "none" is kNone
ReasoningFormat DetectReasoningFormat(const std::string& template_source);
// The opening and closing markers of a reasoning format ("" for kNone).
std::string_view ReasoningOpen(ReasoningFormat format);
std::string_view ReasoningClose(ReasoningFormat format);
// Whether `prompt` leaves a reasoning block open (the template wrote "<think>\n" into the generation
// prompt): the model's output then starts inside reasoning.
bool PromptOpensReasoning(ReasoningFormat format, std::string_view prompt);

// The system text telling a model with a generic template how to call `tools` (an array of OpenAI tool
// objects), after llama.cpp's: the tools as JSON, then the answer's JSON shape.
std::string GenericToolSystemPrompt(const nlohmann::ordered_json& tools, bool parallel_tool_calls);
// The messages a generic template renders for a request with tools, as llama.cpp's polyfills make
// them: the system prompt above added to the first system message (or put before the first
// message, or, where the template accepts no system role, before the first user message's text);
// an assistant's tool_calls written into its content as the JSON the model is asked to answer with;
// tool results turned into user messages {"tool_response": {"tool", "tool_call_id", "content"}}.
// With no tools (tool_choice none) only that rewriting is done.
nlohmann::ordered_json PrepareGenericToolMessages(const nlohmann::ordered_json& messages,
                                                  const nlohmann::ordered_json& tools, bool parallel_tool_calls,
                                                  bool template_accepts_system_role);
// False for templates that raise on a system message (Gemma's "System role not supported").
bool TemplateAcceptsSystemRole(const std::string& template_source);

}  // namespace kvflow
