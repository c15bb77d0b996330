// Reading a model's output text back into an assistant message: reasoning, content and tool calls, in
// the model's own format (tool_call_format.h), either whole or as the text streams in.
//
// Both run one left-to-right parser, and the streaming one only emits what no later text can change
// (a call once its block is closed, content up to where a marker might begin), so the deltas of any
// split of a text add up to exactly what ParseAssistantOutput gives for the whole. Text that looks
// like a call but does not parse stays content; nothing here throws.
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
  std::string arguments;  // compact JSON text of an object
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
