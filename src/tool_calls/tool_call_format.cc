#include "tool_calls/tool_call_format.h"

#include <array>
#include <regex>
#include <utility>

namespace kvflow {
namespace {

using nlohmann::ordered_json;

constexpr std::array<std::pair<ToolCallFormat, const char*>, 11> kFormatNames = {{
    {ToolCallFormat::kGeneric, "generic"},
    {ToolCallFormat::kHermes, "hermes"},
    {ToolCallFormat::kQwen3Coder, "qwen3_coder"},
    {ToolCallFormat::kLlama3Json, "llama3_json"},
    {ToolCallFormat::kMistral, "mistral"},
    {ToolCallFormat::kMistralArgs, "mistral_args"},
    {ToolCallFormat::kGranite, "granite"},
    {ToolCallFormat::kFunctionaryV32, "functionary_v3_2"},
    {ToolCallFormat::kFirefunctionV2, "firefunction_v2"},
    {ToolCallFormat::kCommandR7b, "command_r7b"},
    {ToolCallFormat::kDeepSeekR1, "deepseek_r1"},
}};

constexpr std::array<std::pair<ReasoningFormat, const char*>, 4> kReasoningNames = {{
    {ReasoningFormat::kNone, "none"},
    {ReasoningFormat::kDeepSeekR1, "deepseek_r1"},
    {ReasoningFormat::kQwen3, "qwen3"},
    {ReasoningFormat::kCommandR7b, "command_r7b"},
}};

bool Has(const std::string& s, std::string_view marker) { return s.find(marker) != std::string::npos; }

// `content` of a message as text (OpenAI allows null and arrays of text parts).
std::string ContentText(const ordered_json& message) {
  auto it = message.find("content");
  if (it == message.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  std::string text;
  if (it->is_array())
    for (const auto& part : *it)
      if (part.is_object() && part.value("type", "") == "text" && part.contains("text") && part["text"].is_string())
        text += part["text"].get<std::string>();
  return text;
}

}  // namespace

const char* ToolCallFormatName(ToolCallFormat format) {
  for (const auto& [f, name] : kFormatNames)
    if (f == format) return name;
  return "?";
}

Result<ToolCallFormat> ToolCallFormatFromName(std::string_view name) {
  if (name == "deepseek_v3") return ToolCallFormat::kDeepSeekR1;
  std::string names;
  for (const auto& [f, n] : kFormatNames) {
    if (name == n) return f;
    names += names.empty() ? n : std::string(", ") + n;
  }
  return Status::InvalidArgument("unknown tool-call parser '" + std::string(name) + "' (known: " + names + ")");
}

ToolCallFormat DetectToolCallFormat(const std::string& t) {
  // Most specific markers first: Qwen3-Coder's template also writes <tool_call>.
  if (Has(t, "<function=") && Has(t, "<parameter=")) return ToolCallFormat::kQwen3Coder;
  if (Has(t, "<tool_call>")) return ToolCallFormat::kHermes;
  if (Has(t, "[TOOL_CALLS]")) return Has(t, "[ARGS]") ? ToolCallFormat::kMistralArgs : ToolCallFormat::kMistral;
  if (Has(t, "<|tool_call|>")) return ToolCallFormat::kGranite;
  if (Has(t, ">>>all")) return ToolCallFormat::kFunctionaryV32;
  if (Has(t, "functools[")) return ToolCallFormat::kFirefunctionV2;
  if (Has(t, "<|START_ACTION|>")) return ToolCallFormat::kCommandR7b;
  if (Has(t, "tool▁calls▁begin")) return ToolCallFormat::kDeepSeekR1;
  if (Has(t, "<|start_header_id|>") && Has(t, "\"parameters\"")) return ToolCallFormat::kLlama3Json;
  return ToolCallFormat::kGeneric;
}

bool TemplateReadsTools(const std::string& t) {
  static const std::regex kTools(R"(\btools\b)");
  // The word inside a string literal of the template (a system prompt's prose) would count too;
  // all real templates that mention it read it.
  return std::regex_search(t, kTools);
}

const char* ReasoningFormatName(ReasoningFormat format) {
  for (const auto& [f, name] : kReasoningNames)
    if (f == format) return name;
  return "?";
}

Result<ReasoningFormat> ReasoningFormatFromName(std::string_view name) {
  std::string names;
  for (const auto& [f, n] : kReasoningNames) {
    if (name == n) return f;
    names += names.empty() ? n : std::string(", ") + n;
  }
  return Status::InvalidArgument("unknown reasoning parser '" + std::string(name) + "' (known: " + names + ")");
}

ReasoningFormat DetectReasoningFormat(const std::string& t) {
  if (Has(t, "<|START_THINKING|>")) return ReasoningFormat::kCommandR7b;
  if (Has(t, "<think>") || Has(t, "</think>"))
    return Has(t, "<｜Assistant｜>") ? ReasoningFormat::kDeepSeekR1 : ReasoningFormat::kQwen3;
  return ReasoningFormat::kNone;
}

std::string_view ReasoningOpen(ReasoningFormat format) {
  switch (format) {
    case ReasoningFormat::kNone: return "";
    case ReasoningFormat::kCommandR7b: return "<|START_THINKING|>";
    default: return "<think>";
  }
}

std::string_view ReasoningClose(ReasoningFormat format) {
  switch (format) {
    case ReasoningFormat::kNone: return "";
    case ReasoningFormat::kCommandR7b: return "<|END_THINKING|>";
    default: return "</think>";
  }
}

bool PromptOpensReasoning(ReasoningFormat format, std::string_view prompt) {
  if (format == ReasoningFormat::kNone) return false;
  size_t open = prompt.rfind(ReasoningOpen(format));
  if (open == std::string_view::npos) return false;
  size_t close = prompt.rfind(ReasoningClose(format));
  return close == std::string_view::npos || close < open;
}

std::string GenericToolSystemPrompt(const ordered_json& tools, bool parallel_tool_calls) {
  std::string text = "You can call any of the following tools to satisfy the user's requests: " + tools.dump(2) +
                     "\n\nRespond in JSON format, either with `tool_calls` (a request to call tools) or with "
                     "`response` (a reply to the user's request): ";
  text += parallel_tool_calls
              ? R"({"tool_calls": [{"id": "<a new id>", "name": "<tool name>", "arguments": {<its arguments>}}, ...]})"
              : R"({"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]} (one call at a time))";
  text += R"( or {"response": "<your reply>"}.)";
  return text;
}

ordered_json PrepareGenericToolMessages(const ordered_json& messages, const ordered_json& tools,
                                        bool parallel_tool_calls, bool template_accepts_system_role) {
  ordered_json out = ordered_json::array();
  for (const auto& m : messages) {
    if (!m.is_object()) continue;
    const std::string role = m.value("role", "");
    if (role == "assistant" && m.contains("tool_calls") && m["tool_calls"].is_array() && !m["tool_calls"].empty()) {
      ordered_json calls = ordered_json::array();
      for (const auto& tc : m["tool_calls"]) {
        const ordered_json& fn = tc.contains("function") ? tc["function"] : tc;
        ordered_json call = ordered_json::object();
        if (tc.contains("id")) call["id"] = tc["id"];  // first, as the generic schema asks
        call["name"] = fn.value("name", "");
        ordered_json args = fn.value("arguments", ordered_json::object());
        if (args.is_string()) args = ordered_json::parse(args.get<std::string>(), nullptr, false);
        call["arguments"] = args.is_discarded() ? ordered_json(fn["arguments"]) : args;
        calls.push_back(std::move(call));
      }
      out.push_back({{"role", "assistant"}, {"content", ordered_json{{"tool_calls", calls}}.dump(2)}});
    } else if (role == "tool") {
      ordered_json response = {{"tool", m.value("name", "")}, {"content", ContentText(m)}};
      if (m.contains("tool_call_id")) response["tool_call_id"] = m["tool_call_id"];
      out.push_back({{"role", "user"}, {"content", ordered_json{{"tool_response", response}}.dump(2)}});
    } else {
      out.push_back(m);
    }
  }
  // Without tools (tool_choice none), only the earlier calls and results are rewritten.
  if (!tools.is_array() || tools.empty()) return out;
  const std::string prompt = GenericToolSystemPrompt(tools, parallel_tool_calls);
  if (!out.empty() && out[0].value("role", "") == "system") {
    if (template_accepts_system_role) {
      out[0]["content"] = ContentText(out[0]) + "\n\n" + prompt;
      return out;
    }
  }
  if (template_accepts_system_role) {
    out.insert(out.begin(), ordered_json{{"role", "system"}, {"content", prompt}});
    return out;
  }
  // No system role: the system text (the request's and ours) opens the first user message.
  std::string system = prompt;
  if (!out.empty() && out[0].value("role", "") == "system") {
    system = ContentText(out[0]) + "\n\n" + prompt;
    out.erase(out.begin());
  }
  for (auto& m : out)
    if (m.value("role", "") == "user") {
      m["content"] = system + "\n\n" + ContentText(m);
      return out;
    }
  out.insert(out.begin(), ordered_json{{"role", "user"}, {"content", system}});
  return out;
}

bool TemplateAcceptsSystemRole(const std::string& t) { return !Has(t, "System role not supported"); }

}  // namespace kvflow
