#include "tool_calls/tool_call_constraint.h"

#include <utility>
#include <vector>

namespace kvflow {
namespace {

using nlohmann::ordered_json;

ordered_json Const(const std::string& s) { return {{"type", "const_string"}, {"value", s}}; }
ordered_json Tag(const std::string& begin, ordered_json content, const std::string& end) {
  return {{"type", "tag"}, {"begin", begin}, {"content", std::move(content)}, {"end", end}};
}
// A call's arguments: its tool's schema, with whitespace between JSON tokens capped (a weak model
// left free to write whitespace may write nothing else; 16 still admits pretty-printed JSON).
ordered_json Schema(const ordered_json& params) {
  return {{"type", "json_schema"}, {"json_schema", params}, {"max_whitespace_cnt", 16}};
}

// How one format writes a call of function `name` whose arguments are `params`, and how calls
// are put together.
struct Shape {
  std::string separator;             // between calls
  std::string wrap_begin, wrap_end;  // around all of them ("" if nothing)
  std::string trigger;               // what starts the calls in free text ("" if nothing does)
  ordered_json (*call)(const std::string& name, const ordered_json& params);
};

std::string Q(const std::string& name) { return ordered_json(name).dump(); }  // as a JSON string

Result<Shape> ShapeOf(ToolCallFormat f) {
  switch (f) {
    case ToolCallFormat::kHermes:
      return Shape{"\n", "", "", "<tool_call>", [](const std::string& n, const ordered_json& p) {
                     return Tag("<tool_call>\n{\"name\": " + Q(n) + ", \"arguments\": ", Schema(p), "}\n</tool_call>");
                   }};
    case ToolCallFormat::kQwen3Coder:
      return Shape{"\n", "", "", "<tool_call>", [](const std::string& n, const ordered_json& p) {
                     return Tag("<tool_call>\n<function=" + n + ">\n",
                                ordered_json{{"type", "qwen_xml_parameter"}, {"json_schema", p}},
                                "\n</function>\n</tool_call>");
                   }};
    case ToolCallFormat::kLlama3Json:
      return Shape{"; ", "", "", "", [](const std::string& n, const ordered_json& p) {
                     return Tag("{\"name\": " + Q(n) + ", \"parameters\": ", Schema(p), "}");
                   }};
    case ToolCallFormat::kMistral:
      return Shape{", ", "[TOOL_CALLS][", "]", "[TOOL_CALLS]", [](const std::string& n, const ordered_json& p) {
                     return Tag("{\"name\": " + Q(n) + ", \"arguments\": ", Schema(p), "}");
                   }};
    case ToolCallFormat::kMistralArgs:
      return Shape{"", "", "", "[TOOL_CALLS]", [](const std::string& n, const ordered_json& p) {
                     return Tag("[TOOL_CALLS]" + n + "[ARGS]", Schema(p), "");
                   }};
    case ToolCallFormat::kGranite:
      return Shape{", ", "<|tool_call|>[", "]", "<|tool_call|>", [](const std::string& n, const ordered_json& p) {
                     return Tag("{\"name\": " + Q(n) + ", \"arguments\": ", Schema(p), "}");
                   }};
    case ToolCallFormat::kFirefunctionV2:
      return Shape{", ", "functools[", "]", "functools[", [](const std::string& n, const ordered_json& p) {
                     return Tag("{\"name\": " + Q(n) + ", \"arguments\": ", Schema(p), "}");
                   }};
    case ToolCallFormat::kFunctionaryV32:  // the prompt ends with ">>>": the first call has none of its own
      return Shape{">>>", "", "", "", [](const std::string& n, const ordered_json& p) {
                     return Tag(n + "\n", Schema(p), "");
                   }};
    case ToolCallFormat::kCommandR7b:  // tool_call_id left out: it counts calls, which a grammar cannot
      return Shape{", ", "<|START_ACTION|>[", "]<|END_ACTION|>", "<|START_ACTION|>",
                   [](const std::string& n, const ordered_json& p) {
                     return Tag("{\"tool_name\": " + Q(n) + ", \"parameters\": ", Schema(p), "}");
                   }};
    case ToolCallFormat::kDeepSeekR1:
      return Shape{"\n", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁calls▁begin｜>",
                   [](const std::string& n, const ordered_json& p) {
                     return Tag("<｜tool▁call▁begin｜>function<｜tool▁sep｜>" + n + "\n```json\n", Schema(p),
                                "\n```<｜tool▁call▁end｜>");
                   }};
    case ToolCallFormat::kGeneric: break;
  }
  return Status::Internal("no structural tag shape for this format");
}

struct Function {
  std::string name;
  ordered_json parameters;
};

Result<std::vector<Function>> Functions(const ordered_json& tools, const ToolChoice& choice) {
  if (!tools.is_array() || tools.empty()) return Status::InvalidArgument("tool_choice needs a non-empty tools array");
  std::vector<Function> out;
  for (const auto& tool : tools) {
    const ordered_json& fn = tool.is_object() && tool.contains("function") ? tool["function"] : tool;
    if (!fn.is_object() || !fn.contains("name") || !fn["name"].is_string())
      return Status::InvalidArgument("a tool without a function name");
    Function f{fn["name"].get<std::string>(), fn.value("parameters", ordered_json{{"type", "object"}})};
    if (!f.parameters.is_object()) return Status::InvalidArgument("tool '" + f.name + "': parameters is not an object");
    if (choice.mode == ToolChoice::Mode::kNamed && f.name != choice.name) continue;
    out.push_back(std::move(f));
  }
  if (out.empty()) return Status::InvalidArgument("tool_choice names '" + choice.name + "', which is not among the tools");
  return out;
}

ordered_json GenericSchema(const std::vector<Function>& fns, bool required, bool parallel) {
  ordered_json calls = ordered_json::array();
  for (const auto& f : fns) {
    ordered_json properties = ordered_json::object();
    if (parallel) {  // llama.cpp asks for ids where several calls may come back
      // First, unlike llama.cpp's last: a call streams its arguments only once its id is known
      // (tool_call_parser.h). Bounded, unlike its minLength 4: a model writes ids longer than any budget.
      properties["id"] = {{"type", "string"}, {"pattern", "^[A-Za-z0-9_-]{4,32}$"}};
    }
    properties["name"] = {{"type", "string"}, {"const", f.name}};
    properties["arguments"] = f.parameters;
    ordered_json required = parallel ? ordered_json{"id", "name", "arguments"} : ordered_json{"name", "arguments"};
    ordered_json call = {{"type", "object"}, {"properties", properties}, {"required", required}};
    calls.push_back(std::move(call));
  }
  ordered_json items = calls.size() == 1 ? calls[0] : ordered_json{{"anyOf", calls}};
  ordered_json array = {{"type", "array"}, {"items", items}, {"minItems", 1}};
  if (!parallel) array["maxItems"] = 1;
  ordered_json tool_calls = {{"type", "object"}, {"properties", {{"tool_calls", array}}}, {"required", {"tool_calls"}}};
  if (required) return tool_calls;
  ordered_json response = {{"type", "object"}, {"properties", {{"response", {{"type", "string"}}}}}, {"required", {"response"}}};
  return {{"anyOf", {tool_calls, response}}};
}

// The reasoning block before the calls: free text up to the closing marker.
ordered_json ReasoningPrefix(const ToolConstraintOptions& o) {
  const std::string open(ReasoningOpen(o.reasoning)), close(ReasoningClose(o.reasoning));
  ordered_json block = Tag(o.starts_in_reasoning ? "" : open, {{"type", "any_text"}}, close);
  if (o.reasoning != ReasoningFormat::kCommandR7b)  // the <think> models leave a blank line after it
    block = {{"type", "sequence"}, {"elements", {block, Const("\n\n")}}};
  if (!o.starts_in_reasoning) block = {{"type", "optional"}, {"content", block}};
  return block;
}

}  // namespace

Result<ToolChoice> ParseToolChoice(const ordered_json& v) {
  ToolChoice c;
  if (v.is_null() || v == "auto") return c;
  if (v == "none") c.mode = ToolChoice::Mode::kNone;
  else if (v == "required") c.mode = ToolChoice::Mode::kRequired;
  else if (v.is_object() && v.value("type", "") == "function" && v.contains("function") && v["function"].is_object() &&
           v["function"].contains("name") && v["function"]["name"].is_string()) {
    c.mode = ToolChoice::Mode::kNamed;
    c.name = v["function"]["name"].get<std::string>();
  } else {
    return Status::InvalidArgument(
        "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}");
  }
  return c;
}

Result<ToolCallGrammar> ToolCallConstraint(ToolCallFormat format, const ordered_json& tools, const ToolChoice& choice,
                                           bool parallel, const ToolConstraintOptions& options) {
  if (choice.mode == ToolChoice::Mode::kNone) return Status::InvalidArgument("tool_choice none constrains nothing");
  KVFLOW_ASSIGN_OR_RETURN(std::vector<Function> fns, Functions(tools, choice));
  const bool required = choice.mode != ToolChoice::Mode::kAuto;
  if (choice.mode == ToolChoice::Mode::kNamed) parallel = false;
  if (format == ToolCallFormat::kGeneric) {
    if (options.reasoning != ReasoningFormat::kNone)
      return Status::Unsupported("the generic tool-call format's JSON schema leaves no room for reasoning");
    return ToolCallGrammar{ToolCallGrammar::Kind::kJsonSchema, GenericSchema(fns, required, parallel).dump()};
  }
  KVFLOW_ASSIGN_OR_RETURN(Shape shape, ShapeOf(format));
  if (!required && shape.trigger.empty())
    return Status::Unsupported(std::string("tool_choice auto cannot be constrained for ") + ToolCallFormatName(format) +
                               ": its calls have no marker that would start them in free text");

  ordered_json tags = ordered_json::array();
  for (const auto& f : fns) tags.push_back(shape.call(f.name, f.parameters));
  // The calls: exactly one, or one or more with the format's separator.
  ordered_json calls = !parallel ? (tags.size() == 1 ? tags[0] : ordered_json{{"type", "or"}, {"elements", tags}})
                                 : ordered_json{{"type", "tags_with_separator"}, {"tags", tags},
                                                {"separator", shape.separator}, {"at_least_one", true},
                                                {"stop_after_first", false}};
  ordered_json body;
  if (required) {
    body = shape.wrap_begin.empty() ? calls : Tag(shape.wrap_begin, calls, shape.wrap_end);
  } else {
    // Free text until the trigger; then the calls, as one tag per call or one wrapping all of them.
    ordered_json triggered = shape.wrap_begin.empty() ? tags : ordered_json::array({Tag(shape.wrap_begin, calls, shape.wrap_end)});
    body = {{"type", "triggered_tags"}, {"triggers", {shape.trigger}}, {"tags", triggered},
            {"at_least_one", false}, {"stop_after_first", !parallel || !shape.wrap_begin.empty()}};
  }
  if (options.reasoning != ReasoningFormat::kNone)
    body = {{"type", "sequence"}, {"elements", {ReasoningPrefix(options), body}}};
  ordered_json tag = {{"type", "structural_tag"}, {"format", body}};
  return ToolCallGrammar{ToolCallGrammar::Kind::kStructuralTag, tag.dump()};
}

}  // namespace kvflow
