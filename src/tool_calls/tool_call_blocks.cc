#include "tool_calls/tool_call_blocks.h"

#include <algorithm>
#include <cctype>
#include <initializer_list>
#include <utility>

#include "util/json_nesting.h"

namespace kvflow::tool_calls {
namespace {

using nlohmann::ordered_json;
using std::string_view;

constexpr size_t npos = string_view::npos;

string_view Trim(string_view s) {
  s.remove_prefix(LeadingWs(s));
  while (!s.empty() && IsWs(s.back())) s.remove_suffix(1);
  return s;
}

// Compact JSON; bytes that are not UTF-8 (a model's raw XML value may hold any) become U+FFFD
// rather than throwing.
std::string Compact(const ordered_json& v) { return v.dump(-1, ' ', false, ordered_json::error_handler_t::replace); }

// JSON text with the whitespace outside strings removed.
std::string Tight(string_view json) {
  std::string out;
  out.reserve(json.size());
  JsonStringState strings;
  for (char c : json) {
    if (strings.InString(c) || !IsWs(c)) out += c;
  }
  return out;
}

// Arguments given whole as a value: an object, a string holding one, or null for none.
bool WholeArguments(const ordered_json& args, std::string* out) {
  if (args.is_null()) {
    *out = "{}";
    return true;
  }
  ordered_json parsed;
  const ordered_json* object = &args;
  if (args.is_string()) {
    if (!ParseJsonText(args.get_ref<const std::string&>(), &parsed)) return false;
    object = &parsed;
  }
  if (!object->is_object()) return false;
  *out = Compact(*object);
  return true;
}

// A piece of syntax at a position: done (with where it ends), cut off by the end of the text, or
// wrong.
struct Piece {
  JsonPrefix scan = JsonPrefix::kInvalid;
  size_t end = 0;
};
Piece Done(size_t end) { return {JsonPrefix::kComplete, end}; }
Piece More() { return {JsonPrefix::kIncomplete, 0}; }
Piece Wrong() { return {JsonPrefix::kInvalid, 0}; }

Piece Literal(string_view s, size_t p, string_view lit) {
  string_view rest = s.substr(std::min(p, s.size()));
  if (StartsWith(rest, lit)) return Done(p + lit.size());
  return ProperPrefixOf(rest, lit) ? More() : Wrong();
}

// A JSON string at `p` (s[p] == '"'), decoded into `out` once complete.
Piece JsonString(string_view s, size_t p, std::string* out) {
  for (size_t i = p + 1; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '\\') {
      ++i;
      continue;
    }
    if (static_cast<unsigned char>(c) < 0x20) return Wrong();
    if (c != '"') continue;
    ordered_json v;
    if (!ParseJsonText(s.substr(p, i + 1 - p), &v) || !v.is_string()) return Wrong();
    if (out != nullptr) *out = v.get<std::string>();
    return Done(i + 1);
  }
  return More();
}

// Any JSON value at `p` (no whitespace before it), into `out` when complete and asked for.
Piece JsonValue(string_view s, size_t p, ordered_json* out) {
  if (p >= s.size()) return More();
  const char c = s[p];
  if (c == '{' || c == '[') {
    size_t end = 0;
    ordered_json v;
    switch (ScanJsonValue(s.substr(p), &end, &v)) {
      case JsonPrefix::kIncomplete: return More();
      case JsonPrefix::kInvalid: return Wrong();
      case JsonPrefix::kComplete: break;
    }
    if (out != nullptr) *out = std::move(v);
    return Done(p + end);
  }
  if (c == '"') {
    std::string text;
    Piece piece = JsonString(s, p, &text);
    if (piece.scan == JsonPrefix::kComplete && out != nullptr) *out = std::move(text);
    return piece;
  }
  size_t i = p;  // a number or a literal
  while (i < s.size() && (std::isalnum(static_cast<unsigned char>(s[i])) || s[i] == '+' || s[i] == '-' || s[i] == '.'))
    ++i;
  if (i == s.size()) return More();
  ordered_json v;
  if (i == p || !ParseJsonText(s.substr(p, i - p), &v)) return Wrong();
  if (out != nullptr) *out = std::move(v);
  return Done(i);
}

// The keys of a format's call objects.
struct CallKeys {
  const char* name;
  std::initializer_list<const char*> arguments;
  const char* id = nullptr;
  // The id must be known before the call begins (mistral, command_r7b write ids the next turn's
  // template checks); generic's ids only count ahead of the arguments, where its schema puts them.
  bool wait_for_id = false;
};

bool IsOneOf(const std::string& key, std::initializer_list<const char*> keys) {
  for (const char* k : keys)
    if (key == k) return true;
  return false;
}

// Collects a block's calls as its syntax is walked; each method answers what the block is when the
// walk stops at `at` (the text ended there, or it is wrong there).
class BlockWalk {
 public:
  BlockWalk(string_view s, bool final) : s_(s), final_(final) {}

  string_view text() const { return s_; }
  size_t Ws(size_t p) const { return p + LeadingWs(s_.substr(std::min(p, s_.size()))); }

  // The text ended inside the block: at the end of the output what began is what there is.
  Block Ended() {
    if (!final_) return Block{JsonPrefix::kIncomplete, 0, std::move(calls_), std::nullopt};
    if (calls_.empty()) return Block{};
    return Block{JsonPrefix::kComplete, s_.size(), std::move(calls_), std::nullopt};
  }
  Block Broke(size_t at) { return calls_.empty() ? Block{} : Block{JsonPrefix::kInvalid, at, std::move(calls_), std::nullopt}; }
  Block Closed(size_t end) { return Block{JsonPrefix::kComplete, end, std::move(calls_), std::nullopt}; }
  // A close marker at `p`; at the end of the output a missing one is forgiven (a truncated output,
  // or a template that never writes it).
  Block CloseWith(size_t p, string_view marker) {
    p = Ws(p);
    if (p >= s_.size()) return final_ ? Closed(s_.size()) : Ended();
    Piece close = Literal(s_, p, marker);
    if (close.scan == JsonPrefix::kComplete) return Closed(close.end);
    if (close.scan == JsonPrefix::kIncomplete) return final_ ? Closed(s_.size()) : Ended();
    return Broke(p);
  }

  // A call's arguments object at `p`, its name (and id) known: the call begins here. Read by the
  // grammar alone (no value is built), so what streams is exactly what the whole parse reports.
  Piece StreamedArguments(size_t p, std::string name, std::string id) {
    calls_.push_back({std::move(name), std::move(id), ""});
    const string_view json = s_.substr(p);
    const JsonPrefixScan scan = ScanJsonPrefix(json);
    if (scan.end > 0) {
      calls_.back().arguments = Tight(json.substr(0, scan.end));
      return Done(p + scan.end);
    }
    calls_.back().arguments = Tight(json.substr(0, scan.valid));
    return scan.valid == json.size() ? More() : Piece{JsonPrefix::kInvalid, p + scan.valid};
  }

  // Arguments at `p` for a call named `name`: streamed when they open an object, else whole.
  Piece Arguments(size_t p, std::string name, std::string id) {
    if (p >= s_.size()) return More();
    if (s_[p] == '{') return StreamedArguments(p, std::move(name), std::move(id));
    ordered_json value;
    Piece piece = JsonValue(s_, p, &value);
    if (piece.scan != JsonPrefix::kComplete) return Piece{piece.scan, p};
    std::string args;
    if (!WholeArguments(value, &args)) return Piece{JsonPrefix::kInvalid, p};
    calls_.push_back({std::move(name), std::move(id), std::move(args)});
    return piece;
  }

  // One call object at `p` (after whitespace): its name, arguments and id by `keys`. Wrong before
  // its call began, it fails at its own start; after, where it broke.
  Piece CallObject(size_t p, const CallKeys& keys) {
    const size_t start = p;
    if (p >= s_.size()) return More();
    if (s_[p] != '{') return Piece{JsonPrefix::kInvalid, start};
    std::optional<std::string> name, id;
    std::optional<ordered_json> whole_args;  // arguments that came before the call could begin
    bool begun = false;
    auto fail = [&](size_t at) { return Piece{JsonPrefix::kInvalid, begun ? at : start}; };
    p = Ws(p + 1);
    if (p < s_.size() && s_[p] == '}') return fail(p);  // no name
    while (true) {
      if (p >= s_.size()) return More();
      if (s_[p] != '"') return fail(p);
      std::string key;
      Piece piece = JsonString(s_, p, &key);
      if (piece.scan == JsonPrefix::kIncomplete) return More();
      if (piece.scan == JsonPrefix::kInvalid) return fail(p);
      p = Ws(piece.end);
      if (p >= s_.size()) return More();
      if (s_[p] != ':') return fail(p);
      p = Ws(p + 1);
      if (p >= s_.size()) return More();
      const bool is_args = !begun && !whole_args && IsOneOf(key, keys.arguments);
      const bool ready = name && !name->empty() && (!keys.wait_for_id || id);
      if (is_args && ready && s_[p] == '{') {
        begun = true;
        piece = StreamedArguments(p, *name, id.value_or(""));
        if (piece.scan != JsonPrefix::kComplete) return piece;
      } else {
        ordered_json value;
        piece = JsonValue(s_, p, &value);
        if (piece.scan == JsonPrefix::kIncomplete) return More();
        if (piece.scan == JsonPrefix::kInvalid) return fail(p);
        if (key == keys.name && !name) {
          if (!value.is_string()) return fail(p);
          name = value.get<std::string>();
        } else if (keys.id != nullptr && key == keys.id && !id && !begun) {
          if (value.is_string()) id = value.get<std::string>();
          else if (value.is_number()) id = Compact(value);
        } else if (is_args) {
          whole_args = std::move(value);
        }
      }
      p = Ws(piece.end);
      if (p >= s_.size()) return More();
      if (s_[p] == ',') {
        p = Ws(p + 1);
        continue;
      }
      if (s_[p] != '}') return fail(p);
      if (begun) return Done(p + 1);
      // The object closed before its call could begin: the call is whole now, or there is none.
      std::string args;
      if (!name || name->empty() || !WholeArguments(whole_args.value_or(ordered_json()), &args)) return fail(p);
      calls_.push_back({*name, id.value_or(""), std::move(args)});
      return Done(p + 1);
    }
  }

  // A list of call objects at `p` (after whitespace), or a lone one where `lone` allows it.
  Piece CallList(size_t p, const CallKeys& keys, bool lone) {
    if (p >= s_.size()) return More();
    if (s_[p] == '{' && lone) return CallObject(p, keys);
    if (s_[p] != '[') return Piece{JsonPrefix::kInvalid, p};
    p = Ws(p + 1);
    while (true) {  // a call that fails before it begins breaks the list at its start
      Piece call = CallObject(p, keys);
      if (call.scan != JsonPrefix::kComplete) return call;
      p = Ws(call.end);
      if (p >= s_.size()) return More();
      if (s_[p] == ']') return Done(p + 1);
      if (s_[p] != ',') return Piece{JsonPrefix::kInvalid, p};
      p = Ws(p + 1);
    }
  }

  // A piece's outcome as the block's: done goes on, cut off waits, wrong breaks at its position.
  Block Stop(Piece piece) { return piece.scan == JsonPrefix::kIncomplete ? Ended() : Broke(piece.end); }

  std::vector<CallProgress>& calls() { return calls_; }

 private:
  string_view s_;
  bool final_;
  std::vector<CallProgress> calls_;
};

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

// <tool_call> <function=NAME> (<parameter=P>\nvalue\n</parameter>)* </function> </tool_call>: the
// call begins at its name with "{", each parameter joins its arguments as it closes.
Block QwenXmlBlock(string_view s, bool final, const ordered_json& tools) {
  BlockWalk walk(s, final);
  size_t p = walk.Ws(11);
  if (p >= s.size()) return walk.Ended();
  Piece piece = Literal(s, p, "<function=");
  if (piece.scan != JsonPrefix::kComplete) return walk.Stop({piece.scan, p});
  p = piece.end;
  size_t gt = p;
  while (gt < s.size() && s[gt] != '>' && s[gt] != '\n') ++gt;
  if (gt == s.size()) return walk.Ended();
  if (s[gt] != '>' || gt == p) return walk.Broke(p);
  walk.calls().push_back({std::string(s.substr(p, gt - p)), "", "{"});
  CallProgress& call = walk.calls().back();
  bool first = true;
  p = gt + 1;
  while (true) {
    p = walk.Ws(p);
    if (p >= s.size()) return walk.Ended();
    Piece end_fn = Literal(s, p, "</function>");
    if (end_fn.scan == JsonPrefix::kComplete) {
      call.arguments += "}";
      return walk.CloseWith(end_fn.end, "</tool_call>");
    }
    Piece param = Literal(s, p, "<parameter=");
    if (param.scan == JsonPrefix::kIncomplete || end_fn.scan == JsonPrefix::kIncomplete) return walk.Ended();
    if (param.scan == JsonPrefix::kInvalid) return walk.Broke(p);
    const size_t name_end = s.find('>', param.end);
    if (name_end == npos) return walk.Ended();
    if (name_end == param.end) return walk.Broke(p);
    const std::string name(s.substr(param.end, name_end - param.end));
    const size_t value_end = s.find("</parameter>", name_end + 1);
    if (value_end == npos) return walk.Ended();
    string_view raw = s.substr(name_end + 1, value_end - name_end - 1);
    if (StartsWith(raw, "\n")) raw.remove_prefix(1);  // the template writes ">\nvalue\n</parameter>"
    if (!raw.empty() && raw.back() == '\n') raw.remove_suffix(1);
    call.arguments += (first ? "" : ",") + Compact(name) + ":" +
                      Compact(XmlValue(std::string(raw), ParameterSchema(tools, call.name, name)));
    first = false;
    p = value_end + 12;
  }
}

// <｜tool▁calls▁begin｜> (<｜tool▁call▁begin｜>TYPE<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>)+
// <｜tool▁calls▁end｜>
Block DeepSeekBlock(string_view s, bool final) {
  constexpr string_view kOpen = "<｜tool▁calls▁begin｜>", kClose = "<｜tool▁calls▁end｜>";
  constexpr string_view kBegin = "<｜tool▁call▁begin｜>", kSep = "<｜tool▁sep｜>", kEnd = "<｜tool▁call▁end｜>";
  BlockWalk walk(s, final);
  size_t p = kOpen.size();
  while (true) {
    p = walk.Ws(p);
    if (p >= s.size()) return walk.Ended();
    if (!walk.calls().empty()) {
      Piece close = Literal(s, p, kClose);
      if (close.scan == JsonPrefix::kComplete) return walk.Closed(close.end);
      if (close.scan == JsonPrefix::kIncomplete) return walk.Ended();
    }
    Piece begin = Literal(s, p, kBegin);
    if (begin.scan != JsonPrefix::kComplete) return walk.Stop({begin.scan, p});
    const size_t sep = s.find(kSep, begin.end);
    if (sep == npos) return walk.Ended();
    const size_t nl = s.find('\n', sep);
    if (nl == npos) return walk.Ended();
    std::string name(Trim(s.substr(sep + kSep.size(), nl - sep - kSep.size())));
    if (name.empty()) return walk.Broke(p);
    size_t q = walk.Ws(nl + 1);
    Piece fence = Literal(s, q, "```json");
    if (fence.scan != JsonPrefix::kComplete) return walk.Stop({fence.scan, p});
    q = walk.Ws(fence.end);
    Piece args = walk.Arguments(q, std::move(name), "");
    if (args.scan != JsonPrefix::kComplete) return walk.Stop(args);
    q = walk.Ws(args.end);
    Piece close_fence = Literal(s, q, "```");
    if (close_fence.scan != JsonPrefix::kComplete) return walk.Stop({close_fence.scan, q});
    q = walk.Ws(close_fence.end);
    Piece end = Literal(s, q, kEnd);
    if (end.scan != JsonPrefix::kComplete) return walk.Stop({end.scan, q});
    p = end.end;
  }
}

// Functionary's "recipient\n" header at `from`, then the call's JSON (or nothing for "all").
Block FunctionaryBlock(string_view s, size_t from, bool final) {
  BlockWalk walk(s, final);
  size_t end = 0;
  switch (ScanName(s, from, "\n", &end)) {
    case JsonPrefix::kIncomplete: return walk.Ended();
    case JsonPrefix::kInvalid: return Block{};
    case JsonPrefix::kComplete: break;
  }
  std::string name(s.substr(from, end - from));
  if (name == "all") return walk.Closed(end + 1);
  const size_t p = walk.Ws(end + 1);
  if (p >= s.size()) return walk.Ended();
  if (s[p] != '{') return Block{};
  Piece args = walk.Arguments(p, std::move(name), "");
  return args.scan == JsonPrefix::kComplete ? walk.Closed(args.end) : walk.Stop(args);
}

// [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}, [CALL_ID] optional.
Block MistralArgsBlock(string_view s, bool final) {
  BlockWalk walk(s, final);
  size_t name_end = 0, id_end = 0;
  const size_t from = 12;
  JsonPrefix scan = ScanName(s, from, "[", &name_end);
  if (scan != JsonPrefix::kComplete) return scan == JsonPrefix::kInvalid ? Block{} : walk.Ended();
  std::string name(s.substr(from, name_end - from)), id;
  size_t p = name_end;
  if (StartsWith(s.substr(p), "[CALL_ID]")) {
    scan = ScanName(s, p + 9, "[ARGS]", &id_end);
    if (scan != JsonPrefix::kComplete) return scan == JsonPrefix::kInvalid ? Block{} : walk.Ended();
    id = std::string(s.substr(p + 9, id_end - p - 9));
    p = id_end;
  }
  if (ProperPrefixOf(s.substr(p), "[ARGS]") || ProperPrefixOf(s.substr(p), "[CALL_ID]")) return walk.Ended();
  if (!StartsWith(s.substr(p), "[ARGS]")) return Block{};
  p = walk.Ws(p + 6);
  if (p >= s.size()) return walk.Ended();
  Piece args = walk.Arguments(p, std::move(name), std::move(id));
  return args.scan == JsonPrefix::kComplete ? walk.Closed(args.end) : walk.Stop(args);
}

// A JSON list of calls (or a lone call) at `from`, then an optional close marker.
Block CallListBlock(string_view s, size_t from, bool final, const CallKeys& keys, bool lone, string_view close = {}) {
  BlockWalk walk(s, final);
  Piece list = walk.CallList(walk.Ws(from), keys, lone);
  if (list.scan != JsonPrefix::kComplete) return walk.Stop(list);
  return close.empty() ? walk.Closed(list.end) : walk.CloseWith(list.end, close);
}

// llama.cpp's generic format: {"tool_calls": [...]}, {"tool_call": {...}} or {"response": ...}.
Block GenericBlock(string_view s, bool final) {
  BlockWalk walk(s, final);
  if (s.empty() || s[0] != '{') return Block{};
  size_t p = walk.Ws(1);
  if (p >= s.size()) return walk.Ended();
  if (s[p] != '"') return Block{};
  std::string key;
  Piece piece = JsonString(s, p, &key);
  if (piece.scan != JsonPrefix::kComplete) return walk.Stop({piece.scan, p});
  p = walk.Ws(piece.end);
  piece = Literal(s, p, ":");
  if (piece.scan != JsonPrefix::kComplete) return walk.Stop({piece.scan, p});
  p = walk.Ws(piece.end);
  const CallKeys keys{"name", {"arguments"}, "id"};
  std::optional<std::string> response;
  if (key == "tool_calls" || key == "tool_call") {
    piece = walk.CallList(p, keys, /*lone=*/key == "tool_call");
  } else if (key == "response") {
    ordered_json value;
    piece = JsonValue(s, p, &value);
    if (piece.scan == JsonPrefix::kComplete) response = value.is_string() ? value.get<std::string>() : Compact(value);
  } else {
    return Block{};
  }
  if (piece.scan != JsonPrefix::kComplete) return walk.Stop(piece);
  p = walk.Ws(piece.end);
  if (p >= s.size()) return walk.Ended();
  if (s[p] != '}') return walk.Broke(p);
  Block b = walk.Closed(p + 1);
  b.content = std::move(response);
  return b;
}

}  // namespace

Block StartBlock(ToolCallFormat f, string_view s, bool final) {
  switch (f) {
    case ToolCallFormat::kLlama3Json: {
      constexpr string_view kTag = "<|python_tag|>";
      if (ProperPrefixOf(s, kTag)) return final ? Block{} : Block{JsonPrefix::kIncomplete, 0, {}, std::nullopt};
      size_t from = StartsWith(s, kTag) ? kTag.size() : 0;
      if (from == 0 && !StartsWith(s, "{")) return Block{};
      BlockWalk walk(s, final);
      Piece call = walk.CallObject(walk.Ws(from), CallKeys{"name", {"parameters", "arguments"}});
      return call.scan == JsonPrefix::kComplete ? walk.Closed(call.end) : walk.Stop(call);
    }
    case ToolCallFormat::kFunctionaryV32: return FunctionaryBlock(s, 0, final);
    case ToolCallFormat::kGeneric: return GenericBlock(s, final);
    default: return Block{};
  }
}

Block MarkerBlock(ToolCallFormat f, string_view s, bool final, const ToolParseOptions& options) {
  switch (f) {
    case ToolCallFormat::kHermes: {
      BlockWalk walk(s, final);
      Piece call = walk.CallObject(walk.Ws(11), CallKeys{"name", {"arguments", "parameters"}});
      return call.scan == JsonPrefix::kComplete ? walk.CloseWith(call.end, "</tool_call>") : walk.Stop(call);
    }
    case ToolCallFormat::kQwen3Coder: return QwenXmlBlock(s, final, options.tools);
    case ToolCallFormat::kMistral: return CallListBlock(s, 12, final, CallKeys{"name", {"arguments"}, "id", true}, true);
    case ToolCallFormat::kGranite: return CallListBlock(s, 13, final, CallKeys{"name", {"arguments"}}, true);
    case ToolCallFormat::kFirefunctionV2: return CallListBlock(s, 9, final, CallKeys{"name", {"arguments"}}, true);
    case ToolCallFormat::kFunctionaryV32: return FunctionaryBlock(s, 3, final);
    case ToolCallFormat::kMistralArgs: return MistralArgsBlock(s, final);
    case ToolCallFormat::kCommandR7b:
      return CallListBlock(s, 16, final, CallKeys{"tool_name", {"parameters"}, "tool_call_id", true}, false,
                           "<|END_ACTION|>");
    case ToolCallFormat::kDeepSeekR1: return DeepSeekBlock(s, final);
    default: return Block{};
  }
}

}  // namespace kvflow::tool_calls
