// libFuzzer target: the tool-call parsers (src/tool_calls) of every format, whole and streamed, on
// arbitrary bytes. The first byte picks the format, the reasoning parser and whether the output starts
// inside reasoning; the second seeds where the text is split into pieces. Beyond crashes and sanitizer
// reports, it aborts where the streamed deltas do not add up to the whole parse, or break the
// stream's rules (calls numbered in order, arguments only for calls already started), or where a
// call's arguments are not an object's JSON, whole or as far as it was written.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "tool_calls/json_prefix.h"
#include "tool_calls/tool_call_parser.h"

namespace {

using kvflow::AssistantDelta;
using kvflow::ParsedAssistant;

constexpr kvflow::ToolCallFormat kFormats[] = {
    kvflow::ToolCallFormat::kGeneric,        kvflow::ToolCallFormat::kHermes,
    kvflow::ToolCallFormat::kQwen3Coder,     kvflow::ToolCallFormat::kLlama3Json,
    kvflow::ToolCallFormat::kMistral,        kvflow::ToolCallFormat::kMistralArgs,
    kvflow::ToolCallFormat::kGranite,        kvflow::ToolCallFormat::kFunctionaryV32,
    kvflow::ToolCallFormat::kFirefunctionV2, kvflow::ToolCallFormat::kCommandR7b,
    kvflow::ToolCallFormat::kDeepSeekR1};
constexpr kvflow::ReasoningFormat kReasoning[] = {kvflow::ReasoningFormat::kNone, kvflow::ReasoningFormat::kQwen3,
                                                  kvflow::ReasoningFormat::kCommandR7b};

void Add(ParsedAssistant* m, const std::vector<AssistantDelta>& deltas) {
  for (const auto& d : deltas) {
    switch (d.kind) {
      case AssistantDelta::Kind::kContent: m->content += d.text; break;
      case AssistantDelta::Kind::kReasoning: m->reasoning_content += d.text; break;
      case AssistantDelta::Kind::kToolCall:
        if (d.index != static_cast<int>(m->tool_calls.size())) abort();
        m->tool_calls.push_back({d.text, "", d.id});
        break;
      case AssistantDelta::Kind::kArguments:
        if (d.index < 0 || d.index >= static_cast<int>(m->tool_calls.size())) abort();
        m->tool_calls[d.index].arguments += d.text;
        break;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const uint8_t pick = data[0], seed = data[1];
  const std::string_view text(reinterpret_cast<const char*>(data) + 2, size - 2);
  const auto format = kFormats[pick % std::size(kFormats)];
  kvflow::ToolParseOptions options;
  options.reasoning = kReasoning[(pick / std::size(kFormats)) % 3];
  options.starts_in_reasoning = (pick & 0x80) != 0;
  options.tools = nlohmann::ordered_json::parse(
      R"([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"s": {"type": "string"}, "b": {"type": "boolean"}}}}}])");

  const ParsedAssistant whole = kvflow::ParseAssistantOutput(format, text, options);
  kvflow::StreamingToolCallParser stream(format, options);
  ParsedAssistant streamed;
  uint32_t state = seed * 2654435761u + 1;
  for (size_t i = 0; i < text.size();) {
    state = state * 1103515245u + 12345u;
    const size_t n = 1 + (state >> 16) % 17;
    Add(&streamed, stream.Push(text.substr(i, n)));
    i += n;
  }
  Add(&streamed, stream.Finish());
  if (streamed.content != whole.content || streamed.reasoning_content != whole.reasoning_content ||
      streamed.tool_calls.size() != whole.tool_calls.size())
    abort();
  for (size_t i = 0; i < whole.tool_calls.size(); ++i) {
    const auto &a = whole.tool_calls[i], &b = streamed.tool_calls[i];
    if (a.name != b.name || a.arguments != b.arguments || a.id != b.id) abort();
    // Arguments are an object's JSON, or the start of one (a call cut off or broken).
    const auto scan = kvflow::tool_calls::ScanJsonPrefix(a.arguments);
    if (a.arguments.empty() || a.arguments[0] != '{' || scan.valid != a.arguments.size()) abort();
    if (scan.end != 0 && scan.end != a.arguments.size()) abort();
  }
  return 0;
}
