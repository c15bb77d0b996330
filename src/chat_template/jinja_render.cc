// The interpreter: jinja2's semantics for the parsed statements (scopes, loops, macros,
// namespaces), its filters and tests, and the methods of Python's str, dict and list that chat
// templates call, as ImmutableSandboxedEnvironment allows them (nothing mutates a list or dict).
#include <algorithm>
#include <cctype>
#include <cmath>
#include <ctime>
#include <unordered_map>

#include "chat_template/jinja_ast.h"

namespace kvflow::jinja {
namespace {

[[noreturn]] void Fail(int line, const std::string& message) {
  throw Error("chat template line " + std::to_string(line) + ": " + message);
}

std::string TypeName(const Value& v) {
  switch (v.type()) {
    case Value::Type::kUndefined: return "Undefined";
    case Value::Type::kNone: return "NoneType";
    case Value::Type::kBool: return "bool";
    case Value::Type::kInt: return "int";
    case Value::Type::kFloat: return "float";
    case Value::Type::kString: return "str";
    case Value::Type::kArray: return "list";
    case Value::Type::kObject: return v.is_namespace() ? "Namespace" : "dict";
    case Value::Type::kFunction: return "function";
  }
  return "?";
}

bool IsPySpace(char32_t c) { return c == ' ' || (c >= 0x09 && c <= 0x0D) || c == 0x1C || c == 0x1D || c == 0x1E || c == 0x1F || c == 0x85 || c == 0xA0 || c == 0x2028 || c == 0x2029 || c == 0x3000 || (c >= 0x2000 && c <= 0x200A); }

// str.strip/lstrip/rstrip: whitespace, or the characters of `chars`.
std::string Strip(const std::string& s, const Value& chars, bool left, bool right) {
  std::u32string text = DecodeUtf8(s);
  std::u32string set;
  bool whitespace = chars.is_undefined() || chars.is_none();
  if (!whitespace) {
    if (!chars.is_string()) throw Error("strip arg must be None or str");
    set = DecodeUtf8(chars.as_string());
  }
  auto strip = [&](char32_t c) { return whitespace ? IsPySpace(c) : set.find(c) != std::u32string::npos; };
  size_t b = 0, e = text.size();
  if (left) while (b < e && strip(text[b])) ++b;
  if (right) while (e > b && strip(text[e - 1])) --e;
  return EncodeUtf8(text.substr(b, e - b));
}

Array Split(const std::string& s, const Value& sep, int64_t maxsplit) {
  Array out;
  if (sep.is_undefined() || sep.is_none()) {
    std::u32string text = DecodeUtf8(s);
    size_t i = 0;
    while (i < text.size()) {
      while (i < text.size() && IsPySpace(text[i])) ++i;
      if (i >= text.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        size_t e = text.size();
        while (e > i && IsPySpace(text[e - 1])) --e;
        out.emplace_back(EncodeUtf8(text.substr(i, e - i)));
        break;
      }
      size_t j = i;
      while (j < text.size() && !IsPySpace(text[j])) ++j;
      out.emplace_back(EncodeUtf8(text.substr(i, j - i)));
      i = j;
    }
    return out;
  }
  if (!sep.is_string()) throw Error("split: the separator must be a string");
  const std::string& d = sep.as_string();
  if (d.empty()) throw Error("split: empty separator");
  size_t start = 0;
  while (true) {
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) break;
    size_t at = s.find(d, start);
    if (at == std::string::npos) break;
    out.emplace_back(s.substr(start, at - start));
    start = at + d.size();
  }
  out.emplace_back(s.substr(start));
  return out;
}

std::string Replace(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  std::string out;
  if (from.empty()) {
    // Python inserts `to` between every character (and at both ends).
    std::u32string text = DecodeUtf8(s);
    int64_t done = 0;
    for (size_t i = 0; i <= text.size(); ++i) {
      if (count < 0 || done < count) {
        out += to;
        ++done;
      }
      if (i < text.size()) out += EncodeUtf8(text.substr(i, 1));
    }
    return out;
  }
  size_t start = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t at = s.find(from, start);
    if (at == std::string::npos) break;
    out.append(s, start, at - start);
    out += to;
    start = at + from.size();
    ++done;
  }
  out.append(s, start, std::string::npos);
  return out;
}

// ASCII case mapping with the rest of Unicode left as it is (chat templates lower-case roles and
// type names).
std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}
std::string Upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

bool StartsWith(const std::string& s, const Value& prefix, bool ends) {
  auto one = [&](const Value& p) {
    if (!p.is_string()) throw Error(std::string(ends ? "endswith" : "startswith") + " takes a string or a tuple of strings");
    const std::string& x = p.as_string();
    if (x.size() > s.size()) return false;
    return ends ? s.compare(s.size() - x.size(), x.size(), x) == 0 : s.compare(0, x.size(), x) == 0;
  };
  if (prefix.is_array()) {
    for (const Value& p : prefix.array()) {
      if (one(p)) return true;
    }
    return false;
  }
  return one(prefix);
}

int64_t NormalizeIndex(int64_t i, int64_t n) { return i < 0 ? i + n : i; }

// Python's slice semantics on n items: the indices taken.
std::vector<int64_t> SliceIndices(int64_t n, const Value& start_v, const Value& stop_v, const Value& step_v) {
  auto get = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.is_undefined() || v.is_none()) return std::nullopt;
    if (!v.is_int()) throw Error(std::string("slice ") + what + " must be an integer");
    return v.as_int();
  };
  int64_t step = get(step_v, "step").value_or(1);
  if (step == 0) throw Error("slice step cannot be zero");
  auto clamp = [&](std::optional<int64_t> v, int64_t dflt, bool neg_step) {
    if (!v) return dflt;
    int64_t x = *v;
    if (x < 0) x += n;
    if (neg_step) return std::clamp<int64_t>(x, -1, n - 1);
    return std::clamp<int64_t>(x, 0, n);
  };
  std::vector<int64_t> out;
  if (step > 0) {
    int64_t b = clamp(get(start_v, "start"), 0, false), e = clamp(get(stop_v, "stop"), n, false);
    for (int64_t i = b; i < e; i += step) out.push_back(i);
  } else {
    int64_t b = clamp(get(start_v, "start"), n - 1, true), e = clamp(get(stop_v, "stop"), -1, true);
    for (int64_t i = b; i > e; i += step) out.push_back(i);
  }
  return out;
}

std::string HtmlEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::vector<std::string> SplitLines(const std::string& s) {
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\n' || s[i] == '\r') {
      lines.push_back(s.substr(start, i - start));
      if (s[i] == '\r' && i + 1 < s.size() && s[i + 1] == '\n') ++i;
      start = i + 1;
    }
  }
  if (start < s.size()) lines.push_back(s.substr(start));
  return lines;
}

struct Frame {
  std::unordered_map<std::string, Value> vars;
  Frame* parent = nullptr;

  const Value* Find(const std::string& name) const {
    for (const Frame* f = this; f; f = f->parent) {
      auto it = f->vars.find(name);
      if (it != f->vars.end()) return &it->second;
    }
    return nullptr;
  }
};

class Renderer {
 public:
  Renderer(const RenderLimits& limits, const nlohmann::ordered_json& context) : limits_(limits) {
    for (auto it = context.begin(); it != context.end(); ++it) root_.vars[it.key()] = Value::FromJson(it.value());
    AddGlobals();
    frame_ = &root_;
  }

  std::string Run(const Body& body) {
    std::string out;
    Exec(body, out);
    return out;
  }

 private:
  enum class Flow { kNormal, kBreak, kContinue };

  void Step(int line) {
    if (++steps_ > limits_.max_steps) Fail(line, "the template ran too long");
  }

  void Append(std::string& out, const std::string& text, int line) {
    out += text;
    if (out.size() > limits_.max_output_bytes) Fail(line, "the rendered prompt exceeds the output limit");
  }

  Flow Exec(const Body& body, std::string& out) {
    for (const StmtPtr& s : body) {
      Flow flow = ExecOne(*s, out);
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  Flow ExecOne(const Stmt& s, std::string& out) {
    Step(s.line);
    switch (s.kind) {
      case Stmt::Kind::kText: Append(out, s.text, s.line); return Flow::kNormal;
      case Stmt::Kind::kOutput: Append(out, Eval(*s.expr).Str(), s.line); return Flow::kNormal;
      case Stmt::Kind::kIf:
        for (const auto& [cond, body] : s.branches) {
          if (Eval(*cond).Truthy()) return Exec(body, out);
        }
        return Exec(s.else_body, out);
      case Stmt::Kind::kFor: return ExecFor(s, out);
      case Stmt::Kind::kSet: {
        Value v = Eval(*s.expr);
        if (!s.attribute.empty()) {
          const Value* target = frame_->Find(s.targets[0]);
          if (!target || !target->is_namespace()) Fail(s.line, "can only assign attributes of a namespace(): '" + s.targets[0] + "'");
          target->object().Set(s.attribute, std::move(v));
        } else if (s.targets.size() == 1) {
          frame_->vars[s.targets[0]] = std::move(v);
        } else {
          Unpack(s.targets, v, s.line);
        }
        return Flow::kNormal;
      }
      case Stmt::Kind::kSetBlock: {
        std::string captured;
        Exec(s.body, captured);
        Value v(std::move(captured));
        if (s.filter) v = ApplyFilterChain(*s.filter, std::move(v));
        frame_->vars[s.targets[0]] = std::move(v);
        return Flow::kNormal;
      }
      case Stmt::Kind::kMacro: frame_->vars[s.text] = MakeMacro(s); return Flow::kNormal;
      case Stmt::Kind::kFilterBlock: {
        std::string captured;
        Exec(s.body, captured);
        Append(out, ApplyFilterChain(*s.filter, Value(std::move(captured))).Str(), s.line);
        return Flow::kNormal;
      }
      case Stmt::Kind::kBreak: return Flow::kBreak;
      case Stmt::Kind::kContinue: return Flow::kContinue;
    }
    return Flow::kNormal;
  }

  void Unpack(const std::vector<std::string>& targets, const Value& v, int line) {
    Array items = v.is_array() ? v.array() : v.Items();
    if (items.size() != targets.size()) {
      Fail(line, "cannot unpack " + std::to_string(items.size()) + " values into " + std::to_string(targets.size()));
    }
    for (size_t i = 0; i < targets.size(); ++i) frame_->vars[targets[i]] = items[i];
  }

  Flow ExecFor(const Stmt& s, std::string& out) {
    Value iterable = Eval(*s.expr);
    if (!iterable.is_iterable()) Fail(s.line, "'" + TypeName(iterable) + "' object is not iterable");
    Array items = iterable.Items();
    Frame loop_frame;
    loop_frame.parent = frame_;
    Frame* outer = frame_;
    frame_ = &loop_frame;
    if (s.filter) {
      Array kept;
      for (const Value& item : items) {
        BindTargets(s, item);
        if (Eval(*s.filter).Truthy()) kept.push_back(item);
      }
      items = std::move(kept);
    }
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < n; ++i) {
      BindTargets(s, items[i]);
      Value loop = Value::MakeObject(true);
      Object& o = loop.object();
      o.Set("index", Value(i + 1));
      o.Set("index0", Value(i));
      o.Set("revindex", Value(n - i));
      o.Set("revindex0", Value(n - i - 1));
      o.Set("first", Value(i == 0));
      o.Set("last", Value(i == n - 1));
      o.Set("length", Value(n));
      o.Set("depth", Value(1));
      o.Set("depth0", Value(0));
      o.Set("previtem", i > 0 ? items[i - 1] : Value::Undefined("there is no previous item"));
      o.Set("nextitem", i + 1 < n ? items[i + 1] : Value::Undefined("there is no next item"));
      o.Set("cycle", Value::MakeFunction("loop.cycle", [i](CallArgs& args) {
              if (args.positional.empty()) throw Error("loop.cycle needs at least one item");
              return args.positional[i % args.positional.size()];
            }));
      loop_frame.vars["loop"] = loop;
      Flow flow = Exec(s.body, out);
      if (flow == Flow::kBreak) break;
    }
    frame_ = outer;
    if (n == 0) return Exec(s.else_body, out);
    return Flow::kNormal;
  }

  void BindTargets(const Stmt& s, const Value& item) {
    if (s.targets.size() == 1) {
      frame_->vars[s.targets[0]] = item;
    } else {
      Unpack(s.targets, item, s.line);
    }
  }

  Value MakeMacro(const Stmt& s) {
    const Stmt* macro = &s;
    return Value::MakeFunction(s.text, [this, macro](CallArgs& args) {
      if (++depth_ > limits_.max_call_depth) Fail(macro->line, "macros nest too deep");
      if (args.positional.size() > macro->params.size()) {
        Fail(macro->line, "macro '" + macro->text + "' takes " + std::to_string(macro->params.size()) +
                              " arguments, given " + std::to_string(args.positional.size()));
      }
      Frame frame;
      frame.parent = &root_;
      Frame* outer = frame_;
      frame_ = &frame;
      for (const auto& keyword : args.keywords) {
        const std::string& name = keyword.first;
        bool known = std::any_of(macro->params.begin(), macro->params.end(), [&](const MacroParam& p) { return p.name == name; });
        if (!known) Fail(macro->line, "macro '" + macro->text + "' takes no keyword argument '" + name + "'");
      }
      for (size_t i = 0; i < macro->params.size(); ++i) {
        const MacroParam& p = macro->params[i];
        Value v;
        if (i < args.positional.size()) {
          v = args.positional[i];
        } else {
          bool given = false;
          for (const auto& [name, value] : args.keywords) {
            if (name == p.name) {
              v = value;
              given = true;
            }
          }
          if (!given) {
            v = p.default_value ? Eval(*p.default_value)
                                : Value::Undefined("parameter '" + p.name + "' was not provided");
          }
        }
        frame.vars[p.name] = std::move(v);
      }
      std::string out;
      Exec(macro->body, out);
      frame_ = outer;
      --depth_;
      return Value(std::move(out));
    });
  }

  void AddGlobals() {
    root_.vars["raise_exception"] = Value::MakeFunction("raise_exception", [](CallArgs& args) -> Value {
      throw Error(args.Get(0, "message").Str(), /*raised=*/true);
    });
    root_.vars["strftime_now"] = Value::MakeFunction("strftime_now", [](CallArgs& args) {
      Value format = args.Get(0, "format");
      if (!format.is_string()) throw Error("strftime_now takes a format string");
      std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[512];
      size_t n = std::strftime(buf, sizeof(buf), format.as_string().c_str(), &tm);
      return Value(std::string(buf, n));
    });
    root_.vars["namespace"] = Value::MakeFunction("namespace", [](CallArgs& args) {
      Value ns = Value::MakeObject(true);
      for (const Value& p : args.positional) {
        if (!p.is_object()) throw Error("namespace() takes keyword arguments or a dict");
        for (const auto& [k, v] : p.object().entries) ns.object().Set(k, v);
      }
      for (const auto& [k, v] : args.keywords) ns.object().Set(k, v);
      return ns;
    });
    root_.vars["dict"] = Value::MakeFunction("dict", [](CallArgs& args) {
      Value d = Value::MakeObject();
      for (const Value& p : args.positional) {
        if (!p.is_object()) throw Error("dict() takes keyword arguments or a dict");
        for (const auto& [k, v] : p.object().entries) d.object().Set(k, v);
      }
      for (const auto& [k, v] : args.keywords) d.object().Set(k, v);
      return d;
    });
    root_.vars["range"] = Value::MakeFunction("range", [](CallArgs& args) {
      for (const Value& a : args.positional) {
        if (!a.is_int()) throw Error("range() takes integers");
      }
      int64_t start = 0, stop = 0, step = 1;
      if (args.positional.size() == 1) {
        stop = args.positional[0].as_int();
      } else if (args.positional.size() >= 2) {
        start = args.positional[0].as_int();
        stop = args.positional[1].as_int();
        if (args.positional.size() >= 3) step = args.positional[2].as_int();
      } else {
        throw Error("range() takes 1 to 3 arguments");
      }
      if (step == 0) throw Error("range() step must not be zero");
      Array out;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (out.size() >= 1'000'000) throw Error("range() too large");
        out.emplace_back(i);
      }
      return Value(std::move(out));
    });
  }

  // ---- expressions ---------------------------------------------------------------------------

  Value Eval(const Expr& e) {
    Step(e.line);
    switch (e.kind) {
      case Expr::Kind::kLiteral: return e.value;
      case Expr::Kind::kName: {
        const Value* v = frame_->Find(e.name);
        return v ? *v : Value::Undefined("'" + e.name + "' is undefined");
      }
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        Array items;
        for (const auto& item : e.items) items.push_back(Eval(*item));
        return e.kind == Expr::Kind::kTuple ? Value::Tuple(std::move(items)) : Value(std::move(items));
      }
      case Expr::Kind::kDict: {
        Value d = Value::MakeObject();
        for (size_t i = 0; i + 1 < e.items.size(); i += 2) {
          Value key = Eval(*e.items[i]);
          if (!key.is_string()) Fail(e.line, "dict keys must be strings in kvflow's chat-template engine");
          d.object().Set(key.as_string(), Eval(*e.items[i + 1]));
        }
        return d;
      }
      case Expr::Kind::kGetAttr: return GetAttr(Eval(*e.items[0]), e.name, e.line);
      case Expr::Kind::kGetItem: return GetItem(Eval(*e.items[0]), Eval(*e.items[1]), e.line);
      case Expr::Kind::kSlice: {
        Value obj = Eval(*e.items[0]);
        Value start = e.items[1] ? Eval(*e.items[1]) : Value();
        Value stop = e.items[2] ? Eval(*e.items[2]) : Value();
        Value step = e.items[3] ? Eval(*e.items[3]) : Value();
        return Slice(obj, start, stop, step, e.line);
      }
      case Expr::Kind::kCall: {
        Value callee = Eval(*e.items[0]);
        CallArgs args = EvalArgs(e);
        if (callee.is_undefined()) Fail(e.line, callee.undefined_hint() + " (called as a function)");
        if (!callee.is_function()) Fail(e.line, "'" + TypeName(callee) + "' object is not callable");
        try {
          return callee.Call(args);
        } catch (const Error& err) {
          if (err.raised() || std::string(err.what()).rfind("chat template line", 0) == 0) throw;
          Fail(e.line, callee.function_name() + ": " + err.what());
        }
      }
      case Expr::Kind::kFilter: return ApplyFilterChain(e, Value());
      case Expr::Kind::kTest: {
        Value v = Eval(*e.items[0]);
        CallArgs args = EvalArgs(e);
        bool result;
        try {
          result = ApplyTest(e.name, v, args);
        } catch (const Error& err) {
          Fail(e.line, std::string("test '") + e.name + "': " + err.what());
        }
        return Value(e.negated ? !result : result);
      }
      case Expr::Kind::kUnary: {
        Value v = Eval(*e.items[0]);
        if (e.name == "not") return Value(!v.Truthy());
        if (!v.is_number()) Fail(e.line, "bad operand type for unary " + e.name + ": '" + TypeName(v) + "'");
        if (e.name == "+") return v.is_int() ? Value(v.as_int()) : v;
        return v.type() == Value::Type::kFloat ? Value(-v.as_double()) : Value(-v.as_int());
      }
      case Expr::Kind::kBinary: return EvalBinary(e);
      case Expr::Kind::kCompare: {
        Value left = Eval(*e.items[0]);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = Eval(*e.items[i + 1]);
          if (!Compare(e.ops[i], left, right, e.line)) return Value(false);
          left = std::move(right);
        }
        return Value(true);
      }
      case Expr::Kind::kCondition: {
        if (Eval(*e.items[0]).Truthy()) return Eval(*e.items[1]);
        return e.items[2] ? Eval(*e.items[2]) : Value::Undefined("the condition was false and there is no else");
      }
    }
    Fail(e.line, "unknown expression");
  }

  CallArgs EvalArgs(const Expr& e) {
    CallArgs args;
    for (size_t i = 1; i < e.items.size(); ++i) args.positional.push_back(Eval(*e.items[i]));
    for (const auto& [name, value] : e.keywords) args.keywords.emplace_back(name, Eval(*value));
    return args;
  }

  bool Compare(const std::string& op, const Value& a, const Value& b, int line) {
    try {
      if (op == "==") return a.Equals(b);
      if (op == "!=") return !a.Equals(b);
      if (op == "<") return a.Less(b);
      if (op == ">") return b.Less(a);
      if (op == "<=") return a.Less(b) || a.Equals(b);
      if (op == ">=") return b.Less(a) || a.Equals(b);
      if (op == "in") return b.Contains(a);
      if (op == "not in") return !b.Contains(a);
    } catch (const Error& err) {
      Fail(line, err.what());
    }
    Fail(line, "unknown comparison " + op);
  }

  Value EvalBinary(const Expr& e) {
    const std::string& op = e.name;
    if (op == "and") {
      Value a = Eval(*e.items[0]);
      return a.Truthy() ? Eval(*e.items[1]) : a;
    }
    if (op == "or") {
      Value a = Eval(*e.items[0]);
      return a.Truthy() ? a : Eval(*e.items[1]);
    }
    Value a = Eval(*e.items[0]);
    Value b = Eval(*e.items[1]);
    if (op == "~") return Value(a.Str() + b.Str());
    auto bad = [&]() -> Value {
      Fail(e.line, "unsupported operand types for " + op + ": '" + TypeName(a) + "' and '" + TypeName(b) + "'");
    };
    if (a.is_undefined() || b.is_undefined()) {
      Fail(e.line, (a.is_undefined() ? a : b).undefined_hint() + " (an operand of " + op + ")");
    }
    bool floats = a.type() == Value::Type::kFloat || b.type() == Value::Type::kFloat;
    if (op == "+") {
      if (a.is_number() && b.is_number()) return floats ? Value(a.as_double() + b.as_double()) : Value(a.as_int() + b.as_int());
      if (a.is_string() && b.is_string()) return Value(a.as_string() + b.as_string());
      if (a.is_array() && b.is_array()) {
        Array out = a.array();
        out.insert(out.end(), b.array().begin(), b.array().end());
        return Value(std::move(out));
      }
      return bad();
    }
    if (op == "*") {
      if (a.is_number() && b.is_number()) return floats ? Value(a.as_double() * b.as_double()) : Value(a.as_int() * b.as_int());
      const Value& seq = a.is_int() ? b : a;
      const Value& count = a.is_int() ? a : b;
      if (!count.is_int() || !(seq.is_string() || seq.is_array())) return bad();
      int64_t n = std::max<int64_t>(0, count.as_int());
      size_t unit = seq.is_string() ? seq.as_string().size() : seq.array().size();
      if (static_cast<double>(unit) * static_cast<double>(n) > static_cast<double>(limits_.max_output_bytes)) {
        Fail(e.line, "repetition too large");
      }
      if (seq.is_string()) {
        std::string out;
        for (int64_t i = 0; i < n; ++i) out += seq.as_string();
        return Value(std::move(out));
      }
      Array out;
      for (int64_t i = 0; i < n; ++i) out.insert(out.end(), seq.array().begin(), seq.array().end());
      return Value(std::move(out));
    }
    if (!a.is_number() || !b.is_number()) {
      if (op == "%" && a.is_string()) Fail(e.line, "printf-style string formatting ('%') is not supported");
      return bad();
    }
    if (op == "-") return floats ? Value(a.as_double() - b.as_double()) : Value(a.as_int() - b.as_int());
    if (op == "/") {
      if (b.as_double() == 0) Fail(e.line, "division by zero");
      return Value(a.as_double() / b.as_double());
    }
    if (op == "//" || op == "%") {
      if (b.as_double() == 0) Fail(e.line, "integer division or modulo by zero");
      if (floats) {
        double q = std::floor(a.as_double() / b.as_double());
        return op == "//" ? Value(q) : Value(a.as_double() - q * b.as_double());
      }
      int64_t x = a.as_int(), y = b.as_int();
      int64_t q = x / y;
      if ((x % y != 0) && ((x < 0) != (y < 0))) --q;  // Python floors
      return op == "//" ? Value(q) : Value(x - q * y);
    }
    if (op == "**") {
      if (!floats && b.as_int() >= 0) {
        int64_t r = 1;
        for (int64_t i = 0; i < b.as_int() && i < 64; ++i) r *= a.as_int();
        return Value(r);
      }
      return Value(std::pow(a.as_double(), b.as_double()));
    }
    return bad();
  }

  Value GetAttr(const Value& obj, const std::string& name, int line) {
    if (obj.is_undefined()) Fail(line, obj.undefined_hint() + " (reading its attribute '" + name + "')");
    if (obj.is_namespace()) {
      const Value* v = obj.object().Find(name);
      return v ? *v : Value::Undefined("'" + name + "' is not an attribute of the namespace");
    }
    Value method = BoundMethod(obj, name);
    if (!method.is_undefined()) return method;
    if (obj.is_object()) {
      const Value* v = obj.object().Find(name);
      return v ? *v : Value::Undefined("'dict object' has no attribute '" + name + "'");
    }
    return Value::Undefined("'" + TypeName(obj) + " object' has no attribute '" + name + "'");
  }

  Value GetItem(const Value& obj, const Value& key, int line) {
    if (obj.is_undefined()) Fail(line, obj.undefined_hint() + " (reading an item of it)");
    if (obj.is_object() && key.is_string()) {
      const Value* v = obj.object().Find(key.as_string());
      if (v) return *v;
      if (obj.is_namespace()) return Value::Undefined("'" + key.as_string() + "' is not in the namespace");
      Value method = BoundMethod(obj, key.as_string());
      return method.is_undefined() ? Value::Undefined("'dict object' has no attribute '" + key.as_string() + "'") : method;
    }
    if ((obj.is_array() || obj.is_string()) && key.is_int()) {
      if (obj.is_array()) {
        int64_t n = static_cast<int64_t>(obj.array().size());
        int64_t i = NormalizeIndex(key.as_int(), n);
        if (i < 0 || i >= n) return Value::Undefined("list index out of range");
        return obj.array()[i];
      }
      std::u32string text = DecodeUtf8(obj.as_string());
      int64_t n = static_cast<int64_t>(text.size());
      int64_t i = NormalizeIndex(key.as_int(), n);
      if (i < 0 || i >= n) return Value::Undefined("string index out of range");
      return Value(EncodeUtf8(text.substr(i, 1)));
    }
    if (key.is_string()) return GetAttr(obj, key.as_string(), line);
    return Value::Undefined("'" + TypeName(obj) + " object' has no item " + key.Repr());
  }

  Value Slice(const Value& obj, const Value& start, const Value& stop, const Value& step, int line) {
    try {
      if (obj.is_array()) {
        Array out;
        for (int64_t i : SliceIndices(static_cast<int64_t>(obj.array().size()), start, stop, step)) out.push_back(obj.array()[i]);
        return Value(std::move(out));
      }
      if (obj.is_string()) {
        std::u32string text = DecodeUtf8(obj.as_string());
        std::u32string out;
        for (int64_t i : SliceIndices(static_cast<int64_t>(text.size()), start, stop, step)) out += text[i];
        return Value(EncodeUtf8(out));
      }
    } catch (const Error& err) {
      Fail(line, err.what());
    }
    if (obj.is_undefined()) Fail(line, obj.undefined_hint() + " (sliced)");
    Fail(line, "'" + TypeName(obj) + "' object is not subscriptable");
  }

  // obj.name as a callable, for the methods of str, dict and list that templates call; undefined
  // when obj has no such method.
  Value BoundMethod(const Value& obj, const std::string& name) {
    static const char* kMutating[] = {"append", "extend", "insert", "pop", "remove", "clear", "update",
                                      "setdefault", "popitem", "sort", "reverse"};
    if (obj.is_array() || obj.is_object()) {
      for (const char* m : kMutating) {
        if (name == m) {
          return Value::MakeFunction(name, [name](CallArgs&) -> Value {
            throw Error("'" + name + "' would modify a list or dict, which the sandbox forbids");
          });
        }
      }
    }
    if (obj.is_string()) {
      std::string s = obj.as_string();
      auto fn = [&](Function f) { return Value::MakeFunction("str." + name, std::move(f)); };
      if (name == "strip" || name == "lstrip" || name == "rstrip") {
        bool left = name != "rstrip", right = name != "lstrip";
        return fn([s, left, right](CallArgs& a) { return Value(Strip(s, a.Get(0, "chars"), left, right)); });
      }
      if (name == "split") {
        return fn([s](CallArgs& a) {
          Value max = a.Get(1, "maxsplit", Value(-1));
          return Value(Split(s, a.Get(0, "sep"), max.is_int() ? max.as_int() : -1));
        });
      }
      if (name == "startswith" || name == "endswith") {
        bool ends = name == "endswith";
        return fn([s, ends](CallArgs& a) { return Value(StartsWith(s, a.Get(0, "prefix"), ends)); });
      }
      if (name == "replace") {
        return fn([s](CallArgs& a) {
          Value from = a.Get(0, "old"), to = a.Get(1, "new"), count = a.Get(2, "count", Value(-1));
          if (!from.is_string() || !to.is_string()) throw Error("replace takes strings");
          return Value(Replace(s, from.as_string(), to.as_string(), count.is_int() ? count.as_int() : -1));
        });
      }
      if (name == "upper") return fn([s](CallArgs&) { return Value(Upper(s)); });
      if (name == "lower") return fn([s](CallArgs&) { return Value(Lower(s)); });
      if (name == "title") return fn([s](CallArgs&) { return Value(Title(s)); });
      if (name == "capitalize") return fn([s](CallArgs&) { return Value(Capitalize(s)); });
      if (name == "find") {
        return fn([s](CallArgs& a) {
          Value sub = a.Get(0, "sub");
          if (!sub.is_string()) throw Error("find takes a string");
          size_t at = s.find(sub.as_string());
          return Value(at == std::string::npos ? int64_t{-1} : static_cast<int64_t>(DecodeUtf8(s.substr(0, at)).size()));
        });
      }
      if (name == "count") {
        return fn([s](CallArgs& a) {
          Value sub = a.Get(0, "sub");
          if (!sub.is_string()) throw Error("count takes a string");
          if (sub.as_string().empty()) return Value(static_cast<int64_t>(DecodeUtf8(s).size() + 1));
          int64_t n = 0;
          for (size_t at = s.find(sub.as_string()); at != std::string::npos; at = s.find(sub.as_string(), at + sub.as_string().size())) ++n;
          return Value(n);
        });
      }
      if (name == "join") {
        return fn([s](CallArgs& a) {
          std::string out;
          bool first = true;
          for (const Value& v : a.Get(0, "iterable").Items()) {
            if (!v.is_string()) throw Error("join: sequence item is not a str");
            if (!first) out += s;
            first = false;
            out += v.as_string();
          }
          return Value(std::move(out));
        });
      }
      if (name == "isdigit" || name == "isalpha" || name == "isspace" || name == "isupper" || name == "islower") {
        return fn([s, name](CallArgs&) {
          if (s.empty()) return Value(false);
          bool cased = false;
          for (unsigned char c : s) {
            if (name == "isdigit" && !std::isdigit(c)) return Value(false);
            if (name == "isalpha" && !std::isalpha(c)) return Value(false);
            if (name == "isspace" && !std::isspace(c)) return Value(false);
            if (name == "isupper" && std::islower(c)) return Value(false);
            if (name == "islower" && std::isupper(c)) return Value(false);
            if (std::isalpha(c)) cased = true;
          }
          return Value(name == "isupper" || name == "islower" ? cased : true);
        });
      }
      if (name == "format") {
        return fn([](CallArgs&) -> Value { throw Error("str.format is not supported by kvflow's chat-template engine"); });
      }
      return Value();
    }
    if (obj.is_object() && !obj.is_namespace()) {
      Value self = obj;
      if (name == "get") {
        return Value::MakeFunction("dict.get", [self](CallArgs& a) {
          Value key = a.Get(0, "key");
          const Value* v = key.is_string() ? self.object().Find(key.as_string()) : nullptr;
          return v ? *v : a.Get(1, "default", Value::None());
        });
      }
      if (name == "items") return Value::MakeFunction("dict.items", [self](CallArgs&) { return DictItems(self); });
      if (name == "keys") return Value::MakeFunction("dict.keys", [self](CallArgs&) { return Value(self.Items()); });
      if (name == "values") {
        return Value::MakeFunction("dict.values", [self](CallArgs&) {
          Array out;
          for (const auto& kv : self.object().entries) out.push_back(kv.second);
          return Value(std::move(out));
        });
      }
      if (name == "copy") return Value::MakeFunction("dict.copy", [self](CallArgs&) {
        Value d = Value::MakeObject();
        d.object().entries = self.object().entries;
        return d;
      });
    }
    return Value();
  }

  static Value DictItems(const Value& d) {
    Array out;
    if (d.is_undefined()) return Value(std::move(out));
    if (!d.is_object() || d.is_namespace()) throw Error("items() of a '" + TypeName(d) + "'");
    for (const auto& [k, v] : d.object().entries) out.push_back(Value::Tuple(Array{Value(k), v}));
    return Value(std::move(out));
  }

  static std::string Capitalize(const std::string& s) {
    if (s.empty()) return s;
    std::string out = Lower(s);
    out[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(out[0])));
    return out;
  }

  // jinja2's title: each piece after a run of whitespace, '-', '(', '{', '[' or '<' capitalized.
  static std::string Title(const std::string& s) {
    std::string out;
    bool start = true;
    for (char c : s) {
      bool sep = std::isspace(static_cast<unsigned char>(c)) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
      if (sep) {
        out += c;
        start = true;
      } else {
        out += static_cast<char>(start ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
        start = false;
      }
    }
    return out;
  }

  // ---- filters and tests ---------------------------------------------------------------------

  // e is a kFilter chain; its innermost input is e.items[0] (null: `input`).
  Value ApplyFilterChain(const Expr& e, Value input) {
    Value value = e.items[0] ? (e.items[0]->kind == Expr::Kind::kFilter ? ApplyFilterChain(*e.items[0], std::move(input))
                                                                        : Eval(*e.items[0]))
                             : std::move(input);
    CallArgs args = EvalArgs(e);
    try {
      return ApplyFilter(e.name, value, args);
    } catch (const Error& err) {
      if (err.raised() || std::string(err.what()).rfind("chat template line", 0) == 0) throw;
      Fail(e.line, "filter '" + e.name + "': " + err.what());
    }
  }

  // attribute "a.b" of an item, as jinja2's make_attrgetter reads it.
  Value Attribute(const Value& item, const Value& attribute) {
    if (attribute.is_int()) return GetItem(item, attribute, 0);
    if (!attribute.is_string()) throw Error("attribute must be a string");
    Value v = item;
    for (const Value& part : Split(attribute.as_string(), Value("."), -1)) {
      const std::string& p = part.as_string();
      bool digits = !p.empty() && std::all_of(p.begin(), p.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
      v = digits ? GetItem(v, Value(static_cast<int64_t>(std::stoll(p))), 0) : GetItem(v, Value(p), 0);
    }
    return v;
  }

  Value ApplyFilter(const std::string& name, const Value& v, CallArgs& args) {
    if (name == "tojson") {
      Value indent = args.Get(0, "indent", Value::None());
      if (!indent.is_none() && !indent.is_int()) throw Error("indent must be an integer");
      bool sort_keys = args.Get(99, "sort_keys", Value(false)).Truthy();
      std::optional<int> ind;
      if (indent.is_int()) ind = static_cast<int>(std::clamp<int64_t>(indent.as_int(), 0, 64));
      std::string item_sep = ind ? "," : ", ", key_sep = ": ";
      Value seps = args.Get(99, "separators", Value::None());
      if (seps.is_array() && seps.array().size() == 2 && seps.array()[0].is_string() && seps.array()[1].is_string()) {
        item_sep = seps.array()[0].as_string();
        key_sep = seps.array()[1].as_string();
      }
      return Value(v.ToJson(ind, sort_keys, item_sep, key_sep));
    }
    if (name == "length" || name == "count") return Value(v.Length());
    if (name == "string") return Value(v.Str());
    if (name == "safe") return v;
    if (name == "e" || name == "escape") return Value(HtmlEscape(v.Str()));
    if (name == "trim") {
      if (!v.is_string()) return Value(Strip(v.Str(), args.Get(0, "chars"), true, true));
      return Value(Strip(v.as_string(), args.Get(0, "chars"), true, true));
    }
    if (name == "lower") return Value(Lower(v.Str()));
    if (name == "upper") return Value(Upper(v.Str()));
    if (name == "capitalize") return Value(Capitalize(v.Str()));
    if (name == "title") return Value(Title(v.Str()));
    if (name == "replace") {
      Value from = args.Get(0, "old"), to = args.Get(1, "new"), count = args.Get(2, "count", Value::None());
      return Value(Replace(v.Str(), from.Str(), to.Str(), count.is_int() ? count.as_int() : -1));
    }
    if (name == "items") return DictItems(v);
    if (name == "list") return Value(v.Items());
    if (name == "first") {
      Array items = v.Items();
      return items.empty() ? Value::Undefined("first of an empty sequence") : items.front();
    }
    if (name == "last") {
      Array items = v.Items();
      return items.empty() ? Value::Undefined("last of an empty sequence") : items.back();
    }
    if (name == "reverse") {
      if (v.is_string()) {
        std::u32string t = DecodeUtf8(v.as_string());
        std::reverse(t.begin(), t.end());
        return Value(EncodeUtf8(t));
      }
      Array items = v.Items();
      std::reverse(items.begin(), items.end());
      return Value(std::move(items));
    }
    if (name == "default" || name == "d") {
      Value fallback = args.Get(0, "default_value", Value(""));
      bool boolean = args.Get(1, "boolean", Value(false)).Truthy();
      if (v.is_undefined() || (boolean && !v.Truthy())) return fallback;
      return v;
    }
    if (name == "join") {
      Value sep = args.Get(0, "d", Value(""));
      Value attribute = args.Get(1, "attribute", Value::None());
      std::string out;
      bool first = true;
      for (const Value& item : v.Items()) {
        if (!first) out += sep.Str();
        first = false;
        out += (attribute.is_none() ? item : Attribute(item, attribute)).Str();
      }
      return Value(std::move(out));
    }
    if (name == "map") {
      Array out;
      if (!v.Truthy()) return Value(std::move(out));  // jinja2 maps nothing over a falsy value
      if (args.Has(99, "attribute")) {
        Value attribute = args.Get(99, "attribute");
        Value fallback = args.Get(99, "default");
        for (const Value& item : v.Items()) {
          Value x = Attribute(item, attribute);
          out.push_back(x.is_undefined() && !fallback.is_undefined() ? fallback : x);
        }
        return Value(std::move(out));
      }
      if (args.positional.empty() || !args.positional[0].is_string()) throw Error("map needs a filter name or attribute=");
      std::string filter = args.positional[0].as_string();
      CallArgs rest;
      rest.positional.assign(args.positional.begin() + 1, args.positional.end());
      rest.keywords = args.keywords;
      for (const Value& item : v.Items()) out.push_back(ApplyFilter(filter, item, rest));
      return Value(std::move(out));
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      bool by_attr = name == "selectattr" || name == "rejectattr";
      bool keep = name == "select" || name == "selectattr";
      size_t first_arg = by_attr ? 1 : 0;
      if (by_attr && args.positional.empty()) throw Error(name + " needs an attribute");
      Array out;
      if (!v.Truthy()) return Value(std::move(out));  // jinja2 selects nothing from a falsy value
      for (const Value& item : v.Items()) {
        Value subject = by_attr ? Attribute(item, args.positional[0]) : item;
        bool ok;
        if (args.positional.size() > first_arg) {
          if (!args.positional[first_arg].is_string()) throw Error(name + ": the test must be named by a string");
          CallArgs test_args;
          test_args.positional.assign(args.positional.begin() + first_arg + 1, args.positional.end());
          ok = ApplyTest(args.positional[first_arg].as_string(), subject, test_args);
        } else {
          ok = subject.Truthy();
        }
        if (ok == keep) out.push_back(item);
      }
      return Value(std::move(out));
    }
    if (name == "unique") {
      bool case_sensitive = args.Get(0, "case_sensitive", Value(false)).Truthy();
      Value attribute = args.Get(1, "attribute", Value::None());
      Array out, seen;
      for (const Value& item : v.Items()) {
        Value key = attribute.is_none() ? item : Attribute(item, attribute);
        if (!case_sensitive && key.is_string()) key = Value(Lower(key.as_string()));
        bool dup = std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return s.Equals(key); });
        if (!dup) {
          seen.push_back(key);
          out.push_back(item);
        }
      }
      return Value(std::move(out));
    }
    if (name == "sort" || name == "dictsort") {
      bool reverse = args.Get(name == "sort" ? 0 : 2, "reverse", Value(false)).Truthy();
      bool case_sensitive = args.Get(name == "sort" ? 1 : 0, "case_sensitive", Value(false)).Truthy();
      Value attribute = args.Get(2, "attribute", Value::None());
      Array items = name == "sort" ? v.Items() : DictItems(v).array();
      auto key = [&](const Value& item) {
        Value k = name == "dictsort" ? item.array()[0] : attribute.is_none() ? item : Attribute(item, attribute);
        if (!case_sensitive && k.is_string()) k = Value(Lower(k.as_string()));
        return k;
      };
      std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
        return reverse ? key(b).Less(key(a)) : key(a).Less(key(b));
      });
      return Value(std::move(items));
    }
    if (name == "int") {
      Value fallback = args.Get(0, "default", Value(int64_t{0}));
      if (v.is_int()) return Value(v.as_int());
      if (v.type() == Value::Type::kFloat) return Value(static_cast<int64_t>(v.as_double()));
      if (v.is_string()) {
        try {
          size_t used = 0;
          std::string t = Strip(v.as_string(), Value(), true, true);
          double d = std::stod(t, &used);
          if (used == t.size()) return Value(static_cast<int64_t>(d));
        } catch (...) {
        }
      }
      return fallback;
    }
    if (name == "float") {
      Value fallback = args.Get(0, "default", Value(0.0));
      if (v.is_number()) return Value(v.as_double());
      if (v.is_string()) {
        try {
          size_t used = 0;
          std::string t = Strip(v.as_string(), Value(), true, true);
          double d = std::stod(t, &used);
          if (used == t.size()) return Value(d);
        } catch (...) {
        }
      }
      return fallback;
    }
    if (name == "abs") {
      if (!v.is_number()) throw Error("bad operand type for abs()");
      return v.type() == Value::Type::kFloat ? Value(std::fabs(v.as_double())) : Value(static_cast<int64_t>(std::llabs(v.as_int())));
    }
    if (name == "round") {
      Value precision = args.Get(0, "precision", Value(int64_t{0}));
      Value method = args.Get(1, "method", Value("common"));
      if (!v.is_number() || !precision.is_int()) throw Error("round takes a number");
      double scale = std::pow(10.0, static_cast<double>(precision.as_int()));
      double x = v.as_double() * scale;
      std::string m = method.Str();
      double r = m == "floor" ? std::floor(x) : m == "ceil" ? std::ceil(x) : std::round(x);
      return Value(r / scale);
    }
    if (name == "sum") {
      Value attribute = args.Get(0, "attribute", Value::None());
      Value total = args.Get(1, "start", Value(int64_t{0}));
      for (const Value& item : v.Items()) {
        Value x = attribute.is_none() ? item : Attribute(item, attribute);
        if (!x.is_number() || !total.is_number()) throw Error("sum of non-numbers");
        bool floats = x.type() == Value::Type::kFloat || total.type() == Value::Type::kFloat;
        total = floats ? Value(total.as_double() + x.as_double()) : Value(total.as_int() + x.as_int());
      }
      return total;
    }
    if (name == "min" || name == "max") {
      Array items = v.Items();
      if (items.empty()) return Value::Undefined("min/max of an empty sequence");
      Value best = items[0];
      for (const Value& item : items) {
        if (name == "min" ? item.Less(best) : best.Less(item)) best = item;
      }
      return best;
    }
    if (name == "indent") {
      Value width = args.Get(0, "width", Value(int64_t{4}));
      bool first = args.Get(1, "first", Value(false)).Truthy();
      bool blank = args.Get(2, "blank", Value(false)).Truthy();
      std::string indention = width.is_string() ? width.as_string() : std::string(std::max<int64_t>(0, std::min<int64_t>(width.as_int(), 256)), ' ');
      std::vector<std::string> lines = SplitLines(v.Str() + "\n");
      std::string out;
      if (blank) {
        for (size_t i = 0; i < lines.size(); ++i) out += (i ? "\n" + indention : "") + lines[i];
      } else {
        out = lines.empty() ? "" : lines[0];
        for (size_t i = 1; i < lines.size(); ++i) out += "\n" + (lines[i].empty() ? "" : indention + lines[i]);
      }
      if (first) out = indention + out;
      return Value(std::move(out));
    }
    if (name == "center") {
      int64_t width = args.Get(0, "width", Value(int64_t{80})).as_int();
      std::string s = v.Str();
      int64_t n = static_cast<int64_t>(DecodeUtf8(s).size());
      if (width <= n) return Value(s);
      int64_t pad = width - n;
      int64_t left = pad / 2 + (pad & width & 1);
      return Value(std::string(left, ' ') + s + std::string(pad - left, ' '));
    }
    if (name == "wordcount") return Value(static_cast<int64_t>(Split(v.Str(), Value(), -1).size()));
    if (name == "attr") return GetAttr(v, args.Get(0, "name").Str(), 0);
    throw Error("the filter '" + name + "' is not supported by kvflow's chat-template engine");
  }

  bool ApplyTest(const std::string& name, const Value& v, CallArgs& args) {
    auto arg = [&]() {
      if (args.positional.empty()) throw Error("the test '" + name + "' needs an argument");
      return args.positional[0];
    };
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "boolean") return v.is_bool();
    if (name == "true") return v.is_bool() && v.as_bool();
    if (name == "false") return v.is_bool() && !v.as_bool();
    if (name == "integer") return v.type() == Value::Type::kInt;
    if (name == "float") return v.type() == Value::Type::kFloat;
    if (name == "number") return v.is_number();
    if (name == "string") return v.is_string();
    if (name == "mapping") return v.is_object() && !v.is_namespace();
    if (name == "iterable") return v.is_iterable();
    if (name == "sequence") return v.is_string() || v.is_array() || (v.is_object() && !v.is_namespace()) || v.is_undefined();
    if (name == "callable") return v.is_function();
    if (name == "odd" || name == "even") {
      if (!v.is_int()) throw Error("the test '" + name + "' needs an integer");
      return (v.as_int() % 2 != 0) == (name == "odd");
    }
    if (name == "divisibleby") {
      Value d = arg();
      if (!v.is_int() || !d.is_int() || d.as_int() == 0) throw Error("divisibleby needs non-zero integers");
      return v.as_int() % d.as_int() == 0;
    }
    if (name == "eq" || name == "equalto" || name == "==") return v.Equals(arg());
    if (name == "ne" || name == "!=") return !v.Equals(arg());
    if (name == "lt" || name == "lessthan" || name == "<") return v.Less(arg());
    if (name == "gt" || name == "greaterthan" || name == ">") return arg().Less(v);
    if (name == "le" || name == "<=") return v.Less(arg()) || v.Equals(arg());
    if (name == "ge" || name == ">=") return arg().Less(v) || v.Equals(arg());
    if (name == "in") return arg().Contains(v);
    if (name == "sameas") {
      Value o = arg();
      if (v.is_none() || o.is_none() || v.is_bool() || o.is_bool()) return v.type() == o.type() && v.Equals(o);
      return v.Equals(o) && v.type() == o.type() && (v.is_array() || v.is_object() ? &v.array() == &o.array() : true);
    }
    if (name == "lower") return v.is_string() && Lower(v.as_string()) == v.as_string();
    if (name == "upper") return v.is_string() && Upper(v.as_string()) == v.as_string();
    throw Error("the test '" + name + "' is not supported by kvflow's chat-template engine");
  }

  const RenderLimits& limits_;
  Frame root_;
  Frame* frame_ = nullptr;
  int64_t steps_ = 0;
  int depth_ = 0;
};

}  // namespace

Template::Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;
Template::~Template() = default;

Result<Template> Template::Parse(const std::string& source) {
  Template t;
  t.parsed_ = std::make_unique<Parsed>();
  try {
    t.parsed_->body = ParseTemplate(source);
  } catch (const Error& e) {
    return Status::InvalidArgument(e.what());
  } catch (const std::exception& e) {
    return Status::InvalidArgument(std::string("chat template: ") + e.what());
  }
  return t;
}

Result<std::string> Template::Render(const nlohmann::ordered_json& context, const RenderLimits& limits) const {
  if (!context.is_object()) return Status::InvalidArgument("chat template: the context must be a JSON object");
  try {
    Renderer renderer(limits, context);
    return renderer.Run(parsed_->body);
  } catch (const Error& e) {
    return Status::InvalidArgument(e.what());
  } catch (const std::exception& e) {
    return Status::InvalidArgument(std::string("chat template: ") + e.what());
  }
}

}  // namespace kvflow::jinja
