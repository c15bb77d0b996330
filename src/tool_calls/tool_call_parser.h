// Reading a model's output text back into an assistant message: reasoning, content and tool calls, in
// the model's own format (tool_call_format.h), either whole or as the text streams in.
//
// Both run one left-to-right parser. The streaming one emits content up to where a marker might
// begin, and a call as soon as the text settles that it is one (its name, and its id where the
// format's ids must be kept, known; its arguments object opened), then its arguments as they grow.
// Every split of a text gives deltas that add up to exactly what ParseAssistantOutput gives for the
// whole. The rules that make that hold (tool_call_parser.cc): a begun call is reported whatever
// follows; cut off by the end of the output it keeps the arguments written so far, and if its
// syntax breaks it ends there and the rest is content. Text that breaks before any call began stays
// content, markers and all. Nothing here throws.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "tool_calls/tool_call_format.h"

namespace kvflow {

struct ParsedToolCall {
  std::string name;
  // The model's JSON object with the whitespace between tokens removed (a string holding one is
  // parsed and re-dumped; qwen3_coder's parameters are assembled); a call cut off by the end of the
  // output or by broken syntax keeps what was written, which is then not complete JSON.
  std::string arguments;
  std::string id;         // where the format carries one (mistral, command_r7b, generic), else ""
};

struct ParsedAssistant {
  std::string content;
  std::string reasoning_content;
  std::vector<ParsedToolCall> tool_calls;
};

struct ToolParseOptions {
  ReasoningFormat reasoning = ReasoningFormat::kNone;
  // The prompt opened the reasoning block (PromptOpensReasoning): the output starts inside it.
  bool starts_in_reasoning = false;
  // The request's tools (OpenAI tool objects): qwen3_coder reads each parameter's type from them,
  // since it writes string values unquoted.
  nlohmann::ordered_json tools;
  // False: the request has no tools (or tool_choice none), so call markers are plain content and
  // only reasoning is split out.
  bool parse_tool_calls = true;
};

ParsedAssistant ParseAssistantOutput(ToolCallFormat format, std::string_view text,
                                     const ToolParseOptions& options = {});

struct AssistantDelta {
  enum class Kind {
    kContent,    // text: more content
    kReasoning,  // text: more reasoning_content
    kToolCall,   // a new call `index`: text is its name, id its id ("" if the format has none)
    kArguments,  // text: argument text appended to call `index`
  };
  Kind kind = Kind::kContent;
  std::string text;
  int index = -1;
  std::string id;
};

class StreamingToolCallParser {
 public:
  explicit StreamingToolCallParser(ToolCallFormat format, ToolParseOptions options = {});
  ~StreamingToolCallParser();
  StreamingToolCallParser(StreamingToolCallParser&&) noexcept;
  StreamingToolCallParser& operator=(StreamingToolCallParser&&) noexcept;

  // The deltas that `new_text` settles (text that might still begin a marker or call is held).
  std::vector<AssistantDelta> Push(std::string_view new_text);
  // The output has ended: everything held is decided.
  std::vector<AssistantDelta> Finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvflow
