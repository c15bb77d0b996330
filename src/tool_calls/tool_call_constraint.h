// The grammar that makes a model call tools in its own format, for tool_choice "required" or a named
// function (the output must parse as calls), and for "auto" where the format has a trigger (text is
// free until the trigger, then the call must be well formed). Each call's arguments follow its tool's
// `parameters` JSON schema. Structural tags are xgrammar's ({"type": "structural_tag", "format": ...});
// the generic format gets a JSON schema of its {"tool_calls"} / {"response"} object instead.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "kvflow/status.h"
#include "tool_calls/tool_call_format.h"

namespace kvflow {

struct ToolChoice {
  enum class Mode { kNone, kAuto, kRequired, kNamed } mode = Mode::kAuto;
  std::string name;  // kNamed: the function
};

// OpenAI's tool_choice: "none", "auto", "required", or {"type": "function", "function": {"name"}}.
Result<ToolChoice> ParseToolChoice(const nlohmann::ordered_json& tool_choice);

struct ToolCallGrammar {
  enum class Kind { kStructuralTag, kJsonSchema } kind = Kind::kStructuralTag;
  std::string spec;  // JSON text: StructuredOutput's spec for that kind
};

struct ToolConstraintOptions {
  // The model reasons first (its block is left free, then closed by the format's marker);
  // starts_in_reasoning: the prompt already opened it, else it may open it.
  ReasoningFormat reasoning = ReasoningFormat::kNone;
  bool starts_in_reasoning = false;
};

// The grammar for `choice` over `tools` (OpenAI tool objects); parallel false: exactly one call.
// Unsupported, naming why, for a format and choice it cannot constrain exactly (auto for a format
// with no trigger: llama3_json, functionary_v3_2); InvalidArgument for no tools, an unknown name or
// tool_choice none.
Result<ToolCallGrammar> ToolCallConstraint(ToolCallFormat format, const nlohmann::ordered_json& tools,
                                           const ToolChoice& choice, bool parallel_tool_calls,
                                           const ToolConstraintOptions& options = {});

}  // namespace kvflow
