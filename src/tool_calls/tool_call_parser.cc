#include "tool_calls/tool_call_parser.h"

#include <algorithm>
#include <cctype>
#include <initializer_list>
#include <optional>
#include <utility>

#include "tool_calls/json_prefix.h"

namespace kvflow {
namespace {

using nlohmann::ordered_json;
using std::string_view;
using tool_calls::JsonPrefix;
using tool_calls::ParseJsonText;
using tool_calls::ScanJsonValue;

constexpr size_t npos = string_view::npos;

bool IsWs(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }
size_t LeadingWs(string_view s) {
  size_t i = 0;
  while (i < s.size() && IsWs(s[i])) ++i;
  return i;
}
string_view Trim(string_view s) {
  s.remove_prefix(LeadingWs(s));
  while (!s.empty() && IsWs(s.back())) s.remove_suffix(1);
  return s;
}
bool StartsWith(string_view s, string_view p) { return s.substr(0, p.size()) == p; }
// `s` could still grow into `p`.
bool ProperPrefixOf(string_view s, string_view p) { return s.size() < p.size() && StartsWith(p, s); }

// ---- What a format's calls look like ------------------------------------------------------------

struct Syntax {
  std::vector<string_view> call_markers;  // a call block starts with one of these
  std::vector<string_view> skip_markers;  // pure syntax: neither content nor a call
  bool calls_at_start = false;            // a call may open the output with no marker
};

Syntax SyntaxOf(ToolCallFormat f) {
  switch (f) {
    case ToolCallFormat::kGeneric: return {{}, {}, true};
    case ToolCallFormat::kHermes:
    case ToolCallFormat::kQwen3Coder: return {{"<tool_call>"}, {}, false};
    case ToolCallFormat::kLlama3Json: return {{}, {}, true};
    case ToolCallFormat::kMistral:
    case ToolCallFormat::kMistralArgs: return {{"[TOOL_CALLS]"}, {}, false};
    case ToolCallFormat::kGranite: return {{"<|tool_call|>"}, {}, false};
    case ToolCallFormat::kFunctionaryV32: return {{">>>"}, {}, true};
    case ToolCallFormat::kFirefunctionV2: return {{"functools["}, {}, false};
    case ToolCallFormat::kCommandR7b: return {{"<|START_ACTION|>"}, {"<|START_RESPONSE|>", "<|END_RESPONSE|>"}, false};
    case ToolCallFormat::kDeepSeekR1: return {{"<｜tool▁calls▁begin｜>"}, {}, false};
  }
  return {};
}

// A block of call syntax at the start of a text: complete (its calls, or content for generic's
// {"response"}, or neither for functionary's ">>>all\n"), not yet decidable, or not a call.
struct Block {
  JsonPrefix scan = JsonPrefix::kInvalid;
  size_t consumed = 0;
  std::vector<ParsedToolCall> calls;
  std::optional<std::string> content;
};
Block Incomplete() { return Block{JsonPrefix::kIncomplete, 0, {}, std::nullopt}; }
Block Invalid() { return Block{JsonPrefix::kInvalid, 0, {}, std::nullopt}; }
Block Complete(size_t consumed, std::vector<ParsedToolCall> calls) {
  return Block{JsonPrefix::kComplete, consumed, std::move(calls), std::nullopt};
}

// Compact JSON; bytes that are not UTF-8 (a model's raw XML value may hold any) become U+FFFD
// rather than throwing.
std::string Compact(const ordered_json& v) { return v.dump(-1, ' ', false, ordered_json::error_handler_t::replace); }

// Arguments as compact object text: an object, a string holding one, or absent/null for none.
bool ArgumentsText(const ordered_json* args, std::string* out) {
  if (args == nullptr || args->is_null()) {
    *out = "{}";
    return true;
  }
  ordered_json parsed;
  if (args->is_string()) {
    if (!ParseJsonText(args->get_ref<const std::string&>(), &parsed)) return false;
    args = &parsed;
  }
  if (!args->is_object()) return false;
  *out = Compact(*args);
  return true;
}

// {name_key: "f", one of args_keys: {...}, id_key: "..."} as a call.
bool CallFromObject(const ordered_json& v, const char* name_key, std::initializer_list<const char*> args_keys,
                    const char* id_key, ParsedToolCall* call) {
  if (!v.is_object()) return false;
  auto name = v.find(name_key);
  if (name == v.end() || !name->is_string() || name->get_ref<const std::string&>().empty()) return false;
  const ordered_json* args = nullptr;
  for (const char* key : args_keys)
    if (auto it = v.find(key); it != v.end()) {
      args = &*it;
      break;
    }
  if (!ArgumentsText(args, &call->arguments)) return false;
  call->name = name->get<std::string>();
  if (id_key != nullptr)
    if (auto id = v.find(id_key); id != v.end()) {
      if (id->is_string()) call->id = id->get<std::string>();
      else if (id->is_number()) call->id = Compact(*id);
    }
  return true;
}

bool CallsFromArray(const ordered_json& v, const char* name_key, std::initializer_list<const char*> args_keys,
                    const char* id_key, std::vector<ParsedToolCall>* calls) {
  if (!v.is_array() || v.empty()) return false;
  for (const auto& item : v) {
    ParsedToolCall call;
    if (!CallFromObject(item, name_key, args_keys, id_key, &call)) return false;
    calls->push_back(std::move(call));
  }
  return true;
}

// A JSON object or array starting at `from`: the calls `to_calls` finds in it.
template <typename ToCalls>
Block JsonBlock(string_view s, size_t from, bool final, ToCalls to_calls) {
  size_t end = 0;
  ordered_json value;
  switch (ScanJsonValue(s.substr(from), &end, &value)) {
    case JsonPrefix::kIncomplete: return final ? Invalid() : Incomplete();
    case JsonPrefix::kInvalid: return Invalid();
    case JsonPrefix::kComplete: break;
  }
  std::vector<ParsedToolCall> calls;
  if (!to_calls(value, &calls)) return Invalid();
  return Complete(from + end, std::move(calls));
}

// The text between `s`'s opening marker (`open` bytes) and the first `close`; at the end of the
// output a missing close is forgiven (truncated output, or a template that never writes it).
bool Enclosed(string_view s, size_t open, string_view close, bool final, string_view* inner, size_t* consumed) {
  size_t at = s.find(close, open);
  if (at == npos) {
    if (!final) return false;
    *inner = s.substr(open);
    *consumed = s.size();
    return true;
  }
  *inner = s.substr(open, at - open);
  *consumed = at + close.size();
  return true;
}

// A name made of [A-Za-z0-9_.:-] at `from`, ended by `stop` (not consumed): kIncomplete while the
// text ends inside it.
JsonPrefix ScanName(string_view s, size_t from, string_view stop, size_t* end) {
  size_t i = from;
  while (i < s.size()) {
    const char c = s[i];
    if (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == ':' || c == '-') {
      ++i;
      continue;
    }
    if (i == from) return JsonPrefix::kInvalid;
    if (StartsWith(s.substr(i), stop)) {
      *end = i;
      return JsonPrefix::kComplete;
    }
    return ProperPrefixOf(s.substr(i), stop) ? JsonPrefix::kIncomplete : JsonPrefix::kInvalid;
  }
  return JsonPrefix::kIncomplete;
}

// ---- qwen3_coder's XML parameters -------------------------------------------------------------

const ordered_json* ParameterSchema(const ordered_json& tools, const std::string& function, const std::string& param) {
  if (!tools.is_array()) return nullptr;
  for (const auto& tool : tools) {
    const ordered_json& fn = tool.is_object() && tool.contains("function") ? tool["function"] : tool;
    if (!fn.is_object() || fn.value("name", "") != function) continue;
    auto params = fn.find("parameters");
    if (params == fn.end() || !params->is_object()) return nullptr;
    auto props = params->find("properties");
    if (props == params->end() || !props->is_object()) return nullptr;
    auto it = props->find(param);
    return it == props->end() ? nullptr : &*it;
  }
  return nullptr;
}

bool TypeIs(const ordered_json* schema, const char* type) {
  if (schema == nullptr || !schema->is_object()) return false;
  auto t = schema->find("type");
  if (t == schema->end()) return false;
  if (t->is_string()) return *t == type;
  if (t->is_array())
    for (const auto& x : *t)
      if (x == type) return true;
  return false;
}

// A value written as text (strings unquoted): its JSON value, by the parameter's declared type
// where there is one (the template writes Python's True/False/None for booleans and null).
ordered_json XmlValue(const std::string& raw, const ordered_json* schema) {
  if (TypeIs(schema, "string")) return raw;
  if (TypeIs(schema, "boolean")) {
    if (raw == "true" || raw == "True") return true;
    if (raw == "false" || raw == "False") return false;
  }
  if (raw == "None") return nullptr;
  ordered_json value;
  if (ParseJsonText(raw, &value)) return value;
  return raw;
}

bool QwenXmlCall(string_view inner, const ordered_json& tools, ParsedToolCall* call) {
  size_t p = LeadingWs(inner);
  if (!StartsWith(inner.substr(p), "<function=")) return false;
  p += 10;
  size_t gt = inner.find('>', p);
  if (gt == npos || gt == p || inner.substr(p, gt - p).find('\n') != npos) return false;
  call->name = std::string(inner.substr(p, gt - p));
  p = gt + 1;
  ordered_json args = ordered_json::object();
  while (true) {
    p += LeadingWs(inner.substr(p));
    string_view rest = inner.substr(p);
    if (StartsWith(rest, "</function>")) {
      if (!Trim(rest.substr(11)).empty()) return false;
      break;
    }
    if (!StartsWith(rest, "<parameter=")) return false;
    size_t name_end = rest.find('>');
    if (name_end == npos || name_end == 11) return false;
    std::string param(rest.substr(11, name_end - 11));
    size_t value_end = rest.find("</parameter>", name_end + 1);
    if (value_end == npos) return false;
    string_view raw = rest.substr(name_end + 1, value_end - name_end - 1);
    if (StartsWith(raw, "\n")) raw.remove_prefix(1);  // the template writes ">\nvalue\n</parameter>"
    if (!raw.empty() && raw.back() == '\n') raw.remove_suffix(1);
    args[param] = XmlValue(std::string(raw), ParameterSchema(tools, call->name, param));
    p += value_end + 12;
  }
  call->arguments = Compact(args);
  return true;
}

// ---- DeepSeek-R1's calls ------------------------------------------------------------------------

bool DeepSeekCalls(string_view inner, std::vector<ParsedToolCall>* calls) {
  constexpr string_view kBegin = "<｜tool▁call▁begin｜>", kSep = "<｜tool▁sep｜>", kEnd = "<｜tool▁call▁end｜>";
  size_t p = 0;
  while (true) {
    p += LeadingWs(inner.substr(p));
    if (p == inner.size()) return !calls->empty();
    string_view rest = inner.substr(p);
    if (!StartsWith(rest, kBegin)) return false;
    size_t sep = rest.find(kSep);
    size_t nl = sep == npos ? npos : rest.find('\n', sep);
    if (nl == npos) return false;
    ParsedToolCall call;
    call.name = std::string(Trim(rest.substr(sep + kSep.size(), nl - sep - kSep.size())));
    string_view body = rest.substr(nl + 1);
    size_t open = LeadingWs(body);
    if (!StartsWith(body.substr(open), "```json")) return false;
    open += 7;
    size_t close = body.find("```", open);
    if (close == npos || call.name.empty()) return false;
    ordered_json args;
    if (!ParseJsonText(body.substr(open, close - open), &args) || !ArgumentsText(&args, &call.arguments)) return false;
    size_t after = close + 3;
    after += LeadingWs(body.substr(after));
    if (!StartsWith(body.substr(after), kEnd)) return false;
    calls->push_back(std::move(call));
    p += (nl + 1) + after + kEnd.size();
  }
}

// ---- One block per format -----------------------------------------------------------------------

auto ArrayOf(const char* name_key, std::initializer_list<const char*> args_keys, const char* id_key) {
  return [=](const ordered_json& v, std::vector<ParsedToolCall>* calls) {
    if (v.is_object()) {  // a lone call where a list was asked for
      ParsedToolCall call;
      if (!CallFromObject(v, name_key, args_keys, id_key, &call)) return false;
      calls->push_back(std::move(call));
      return true;
    }
    return CallsFromArray(v, name_key, args_keys, id_key, calls);
  };
}

auto ObjectCall(const char* name_key, std::initializer_list<const char*> args_keys) {
  return [=](const ordered_json& v, std::vector<ParsedToolCall>* calls) {
    ParsedToolCall call;
    if (!CallFromObject(v, name_key, args_keys, nullptr, &call)) return false;
    calls->push_back(std::move(call));
    return true;
  };
}

// Functionary's "recipient\n" header at `from`, then the call's JSON (or nothing for "all").
Block FunctionaryBlock(string_view s, size_t from, bool final) {
  size_t end = 0;
  switch (ScanName(s, from, "\n", &end)) {
    case JsonPrefix::kIncomplete: return final ? Invalid() : Incomplete();
    case JsonPrefix::kInvalid: return Invalid();
    case JsonPrefix::kComplete: break;
  }
  std::string name(s.substr(from, end - from));
  if (name == "all") return Complete(end + 1, {});
  return JsonBlock(s, end + 1, final, [&](const ordered_json& v, std::vector<ParsedToolCall>* calls) {
    ParsedToolCall call{name, "", ""};
    if (!ArgumentsText(&v, &call.arguments)) return false;
    calls->push_back(std::move(call));
    return true;
  });
}

// The block that `s` starts with, for formats whose calls may open the output without a marker.
Block StartBlock(ToolCallFormat f, string_view s, bool final) {
  switch (f) {
    case ToolCallFormat::kLlama3Json: {
      constexpr string_view kTag = "<|python_tag|>";
      if (ProperPrefixOf(s, kTag)) return final ? Invalid() : Incomplete();
      size_t from = StartsWith(s, kTag) ? kTag.size() : 0;
      if (from == 0 && !StartsWith(s, "{")) return Invalid();
      return JsonBlock(s, from, final, ObjectCall("name", {"parameters", "arguments"}));
    }
    case ToolCallFormat::kFunctionaryV32: return FunctionaryBlock(s, 0, final);
    case ToolCallFormat::kGeneric: {
      if (!StartsWith(s, "{")) return Invalid();
      std::optional<std::string> response;
      Block b = JsonBlock(s, 0, final, [&](const ordered_json& v, std::vector<ParsedToolCall>* calls) {
        if (!v.is_object() || v.size() != 1) return false;
        if (auto it = v.find("tool_calls"); it != v.end())
          return CallsFromArray(*it, "name", {"arguments"}, "id", calls);
        if (auto it = v.find("tool_call"); it != v.end()) return ArrayOf("name", {"arguments"}, "id")(*it, calls);
        if (auto it = v.find("response"); it != v.end()) {
          response = it->is_string() ? it->get<std::string>() : Compact(*it);
          return true;
        }
        return false;
      });
      b.content = std::move(response);
      return b;
    }
    default: return Invalid();
  }
}

// The block that `s` starts with; `s` starts with one of the format's call markers.
Block MarkerBlock(ToolCallFormat f, string_view s, bool final, const ToolParseOptions& options) {
  string_view inner;
  size_t consumed = 0;
  switch (f) {
    case ToolCallFormat::kHermes: {
      if (!Enclosed(s, 11, "</tool_call>", final, &inner, &consumed)) return Incomplete();
      ordered_json v;
      ParsedToolCall call;
      if (!ParseJsonText(inner, &v) || !CallFromObject(v, "name", {"arguments", "parameters"}, nullptr, &call))
        return Invalid();
      return Complete(consumed, {std::move(call)});
    }
    case ToolCallFormat::kQwen3Coder: {
      if (!Enclosed(s, 11, "</tool_call>", final, &inner, &consumed)) return Incomplete();
      ParsedToolCall call;
      if (!QwenXmlCall(inner, options.tools, &call)) return Invalid();
      return Complete(consumed, {std::move(call)});
    }
    case ToolCallFormat::kMistral: return JsonBlock(s, 12, final, ArrayOf("name", {"arguments"}, "id"));
    case ToolCallFormat::kGranite: return JsonBlock(s, 13, final, ArrayOf("name", {"arguments"}, nullptr));
    case ToolCallFormat::kFirefunctionV2: return JsonBlock(s, 9, final, ArrayOf("name", {"arguments"}, nullptr));
    case ToolCallFormat::kFunctionaryV32: return FunctionaryBlock(s, 3, final);
    case ToolCallFormat::kMistralArgs: {  // [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}, [CALL_ID] optional
      size_t name_end = 0, id_end = 0;
      const size_t from = 12;
      JsonPrefix scan = ScanName(s, from, "[", &name_end);
      if (scan != JsonPrefix::kComplete) return scan == JsonPrefix::kInvalid || final ? Invalid() : Incomplete();
      ParsedToolCall call;
      call.name = std::string(s.substr(from, name_end - from));
      size_t args = name_end;
      if (StartsWith(s.substr(args), "[CALL_ID]")) {
        scan = ScanName(s, args + 9, "[ARGS]", &id_end);
        if (scan != JsonPrefix::kComplete) return scan == JsonPrefix::kInvalid || final ? Invalid() : Incomplete();
        call.id = std::string(s.substr(args + 9, id_end - args - 9));
        args = id_end;
      }
      if (ProperPrefixOf(s.substr(args), "[ARGS]") || ProperPrefixOf(s.substr(args), "[CALL_ID]"))
        return final ? Invalid() : Incomplete();
      if (!StartsWith(s.substr(args), "[ARGS]")) return Invalid();
      return JsonBlock(s, args + 6, final, [&](const ordered_json& v, std::vector<ParsedToolCall>* calls) {
        if (!ArgumentsText(&v, &call.arguments)) return false;
        calls->push_back(std::move(call));
        return true;
      });
    }
    case ToolCallFormat::kCommandR7b: {
      if (!Enclosed(s, 16, "<|END_ACTION|>", final, &inner, &consumed)) return Incomplete();
      ordered_json v;
      std::vector<ParsedToolCall> calls;
      if (!ParseJsonText(inner, &v) || !CallsFromArray(v, "tool_name", {"parameters"}, "tool_call_id", &calls))
        return Invalid();
      return Complete(consumed, std::move(calls));
    }
    case ToolCallFormat::kDeepSeekR1: {
      constexpr string_view kOpen = "<｜tool▁calls▁begin｜>";
      if (!Enclosed(s, kOpen.size(), "<｜tool▁calls▁end｜>", final, &inner, &consumed)) return Incomplete();
      std::vector<ParsedToolCall> calls;
      if (!DeepSeekCalls(inner, &calls)) return Invalid();
      return Complete(consumed, std::move(calls));
    }
    default: return Invalid();
  }
}

// ---- The left-to-right parser -------------------------------------------------------------------

struct State {
  bool in_reasoning = false;
  bool reasoning_may_open = true;  // reasoning opens only at the very start
  bool at_start = true;            // nothing but whitespace and reasoning so far
  bool skip_ws = true;             // whitespace here is syntax (the output's start, after a call or reasoning)
  bool after_call = false;
};

struct Step {
  enum Kind { kNeedMore, kContent, kReasoning, kSkip, kCalls } kind = kNeedMore;
  size_t consumed = 0;
  std::string text;
  std::vector<ParsedToolCall> calls;
  State state;
};

Step Make(Step::Kind kind, size_t consumed, State state, string_view text = {}) {
  Step s;
  s.kind = kind;
  s.consumed = consumed;
  s.state = state;
  s.text = std::string(text);
  return s;
}

struct Parser {
  ToolCallFormat format;
  ToolParseOptions options;
  Syntax syntax;
  std::vector<string_view> markers;  // call and skip markers together
  State state;

  Parser(ToolCallFormat f, ToolParseOptions o) : format(f), options(std::move(o)), syntax(SyntaxOf(f)) {
    if (!options.parse_tool_calls) {  // content and reasoning only
      syntax.call_markers.clear();
      syntax.skip_markers.clear();
      syntax.calls_at_start = false;
    }
    markers = syntax.call_markers;
    markers.insert(markers.end(), syntax.skip_markers.begin(), syntax.skip_markers.end());
    state.in_reasoning = options.reasoning != ReasoningFormat::kNone && options.starts_in_reasoning;
    state.reasoning_may_open = options.reasoning != ReasoningFormat::kNone && !state.in_reasoning;
  }

  Step FromBlock(Block b, size_t ws, State st) const {
    st.at_start = false;
    st.skip_ws = true;
    st.after_call = !b.calls.empty();
    if (b.content) {
      st.skip_ws = false;
      return Make(Step::kContent, ws + b.consumed, st, *b.content);
    }
    if (b.calls.empty()) return Make(Step::kSkip, ws + b.consumed, st);
    Step s = Make(Step::kCalls, ws + b.consumed, st);
    s.calls = std::move(b.calls);
    return s;
  }

  // The next settled piece of `rest` (the unparsed text); kNeedMore only when !final.
  Step Next(string_view rest, bool final) const {
    State st = state;
    if (st.in_reasoning) {
      const string_view close = ReasoningClose(options.reasoning);
      size_t at = rest.find(close);
      if (at == 0) {
        st.in_reasoning = false;
        st.skip_ws = true;
        return Make(Step::kSkip, close.size(), st);
      }
      size_t n = at != npos ? at : final ? rest.size() : HeldFrom(rest, {close});
      return n == 0 ? Make(Step::kNeedMore, 0, st) : Make(Step::kReasoning, n, st, rest.substr(0, n));
    }
    if (st.reasoning_may_open) {
      const string_view open = ReasoningOpen(options.reasoning);
      const size_t ws = LeadingWs(rest);
      if (StartsWith(rest.substr(ws), open)) {
        st.in_reasoning = true;
        st.reasoning_may_open = false;
        return Make(Step::kSkip, ws + open.size(), st);
      }
      if (!final && ProperPrefixOf(rest.substr(ws), open)) return Make(Step::kNeedMore, 0, st);
      st.reasoning_may_open = false;
    }
    const size_t ws = LeadingWs(rest);
    if (st.skip_ws && ws > 0) return Make(Step::kSkip, ws, st);
    st.skip_ws = false;
    const string_view body = rest.substr(ws);

    if (st.after_call && format == ToolCallFormat::kLlama3Json && StartsWith(body, ";")) {
      st.skip_ws = true;
      return Make(Step::kSkip, ws + 1, st);
    }
    if (syntax.calls_at_start && (st.at_start || (st.after_call && format == ToolCallFormat::kLlama3Json))) {
      Block b = StartBlock(format, body, final);
      if (b.scan == JsonPrefix::kIncomplete) return Make(Step::kNeedMore, 0, st);
      if (b.scan == JsonPrefix::kComplete) return FromBlock(std::move(b), ws, st);
    }
    for (string_view m : syntax.skip_markers)
      if (StartsWith(body, m)) {
        st.at_start = st.after_call = false;
        st.skip_ws = true;
        return Make(Step::kSkip, ws + m.size(), st);
      }
    for (string_view m : syntax.call_markers)
      if (StartsWith(body, m)) {
        Block b = MarkerBlock(format, body, final, options);
        if (b.scan == JsonPrefix::kIncomplete) return Make(Step::kNeedMore, 0, st);
        if (b.scan == JsonPrefix::kComplete) return FromBlock(std::move(b), ws, st);
        st.at_start = st.after_call = false;  // not a call after all: the marker is text
        return Make(Step::kContent, ws + m.size(), st, rest.substr(0, ws + m.size()));
      }
    if (!final) {
      if (body.empty()) return Make(Step::kNeedMore, 0, st);  // whitespace may lead into a marker
      for (string_view m : markers)
        if (ProperPrefixOf(body, m)) return Make(Step::kNeedMore, 0, st);
    }
    // Content, up to the next marker (or what may begin one); the whitespace before it goes with it.
    st.at_start = st.after_call = false;
    if (body.empty()) return Make(Step::kContent, rest.size(), st, rest);
    size_t cut = FindMarker(body);
    if (!final) cut = std::min(cut, HeldFrom(body, markers));
    size_t end = std::min(cut, body.size());
    if (cut != npos)  // something may follow: the whitespace before it waits to see what
      while (end > 1 && IsWs(body[end - 1])) --end;
    return Make(Step::kContent, ws + end, st, rest.substr(0, ws + end));
  }

  // The first full marker in `s` after its first byte (npos if none).
  size_t FindMarker(string_view s) const {
    size_t best = npos;
    for (string_view m : markers) best = std::min(best, s.find(m, 1));
    return best;
  }

  // Where a marker may begin at the end of `s` (the smallest i with s[i:] a proper prefix of one);
  // s.size() if nowhere.
  static size_t HeldFrom(string_view s, const std::vector<string_view>& ms) {
    size_t longest = 0;
    for (string_view m : ms) longest = std::max(longest, m.size());
    for (size_t i = s.size() > longest ? s.size() - longest : 0; i < s.size(); ++i)
      for (string_view m : ms)
        if (ProperPrefixOf(s.substr(i), m)) return i;
    return s.size();
  }

  // Runs the steps over `text` from `*pos`, handing each to `emit`.
  template <typename Emit>
  void Run(string_view text, size_t* pos, bool final, Emit&& emit) {
    while (*pos < text.size()) {
      Step s = Next(text.substr(*pos), final);
      if (s.kind == Step::kNeedMore) return;
      if (s.consumed == 0) {  // cannot happen; never loop forever on a bug
        s = Make(Step::kContent, text.size() - *pos, state, text.substr(*pos));
      }
      *pos += s.consumed;
      state = s.state;
      emit(std::move(s));
    }
  }
};

}  // namespace

ParsedAssistant ParseAssistantOutput(ToolCallFormat format, std::string_view text, const ToolParseOptions& options) {
  Parser parser(format, options);
  ParsedAssistant out;
  size_t pos = 0;
  parser.Run(text, &pos, /*final=*/true, [&](Step s) {
    if (s.kind == Step::kContent) out.content += s.text;
    else if (s.kind == Step::kReasoning) out.reasoning_content += s.text;
    else if (s.kind == Step::kCalls)
      for (auto& c : s.calls) out.tool_calls.push_back(std::move(c));
  });
  return out;
}

struct StreamingToolCallParser::Impl {
  explicit Impl(Parser p) : parser(std::move(p)) {}
  Parser parser;
  std::string buffer;  // text not yet settled, from pos
  size_t pos = 0;
  int calls = 0;

  std::vector<AssistantDelta> Run(bool final) {
    std::vector<AssistantDelta> out;
    auto text = [&](AssistantDelta::Kind kind, std::string t) {
      if (t.empty()) return;
      if (!out.empty() && out.back().kind == kind) out.back().text += t;
      else out.push_back({kind, std::move(t), -1, ""});
    };
    parser.Run(buffer, &pos, final, [&](Step s) {
      if (s.kind == Step::kContent) text(AssistantDelta::Kind::kContent, std::move(s.text));
      else if (s.kind == Step::kReasoning) text(AssistantDelta::Kind::kReasoning, std::move(s.text));
      else if (s.kind == Step::kCalls)
        for (auto& c : s.calls) {
          out.push_back({AssistantDelta::Kind::kToolCall, std::move(c.name), calls, std::move(c.id)});
          out.push_back({AssistantDelta::Kind::kArguments, std::move(c.arguments), calls, ""});
          ++calls;
        }
    });
    if (pos > 4096) {  // keep the buffer to the unsettled text
      buffer.erase(0, pos);
      pos = 0;
    }
    return out;
  }
};

StreamingToolCallParser::StreamingToolCallParser(ToolCallFormat format, ToolParseOptions options)
    : impl_(std::make_unique<Impl>(Parser(format, std::move(options)))) {}
StreamingToolCallParser::~StreamingToolCallParser() = default;
StreamingToolCallParser::StreamingToolCallParser(StreamingToolCallParser&&) noexcept = default;
StreamingToolCallParser& StreamingToolCallParser::operator=(StreamingToolCallParser&&) noexcept = default;

std::vector<AssistantDelta> StreamingToolCallParser::Push(std::string_view new_text) {
  impl_->buffer.append(new_text);
  return impl_->Run(/*final=*/false);
}

std::vector<AssistantDelta> StreamingToolCallParser::Finish() { return impl_->Run(/*final=*/true); }

}  // namespace kvflow
