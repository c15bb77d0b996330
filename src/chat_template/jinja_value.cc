#include "chat_template/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace kvflow::jinja {

Value Value::MakeObject(bool is_namespace) {
  Value v;
  v.type_ = Type::kObject;
  v.object_ = std::make_shared<Object>();
  v.object_->is_namespace = is_namespace;
  return v;
}

Value Value::MakeFunction(std::string name, Function f) {
  Value v;
  v.type_ = Type::kFunction;
  v.function_ = std::make_shared<Callable>(Callable{std::move(name), std::move(f)});
  return v;
}

bool Value::is_namespace() const { return is_object() && object_->is_namespace; }

const std::string& Value::undefined_hint() const {
  static const std::string kNone = "value is undefined";
  return hint_ ? *hint_ : kNone;
}

Value Value::Call(CallArgs& args) const { return function_->function(args); }
const std::string& Value::function_name() const { return function_->name; }

const Value* Object::Find(std::string_view key) const {
  for (const auto& [k, v] : entries) {
    if (k == key) return &v;
  }
  return nullptr;
}

void Object::Set(const std::string& key, Value value) {
  for (auto& [k, v] : entries) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  entries.emplace_back(key, std::move(value));
}

Value CallArgs::Get(size_t index, std::string_view name, Value fallback) {
  for (const auto& [k, v] : keywords) {
    if (k == name) return v;
  }
  if (index < positional.size()) return positional[index];
  return fallback;
}

bool CallArgs::Has(size_t index, std::string_view name) const {
  if (index < positional.size()) return true;
  for (const auto& kv : keywords) {
    if (kv.first == name) return true;
  }
  return false;
}

std::string FormatPythonFloat(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  if (value == 0) return std::signbit(value) ? "-0.0" : "0.0";
  // The shortest digits that round-trip, then Python's layout: positional for exponents in
  // [-4, 16), scientific (two exponent digits at least) otherwise.
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), value, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  size_t e = sci.find('e');
  std::string mantissa = sci.substr(0, e);
  int exponent = std::stoi(sci.substr(e + 1));
  std::string digits;
  for (char c : mantissa) {
    if (c != '.') digits += c;
  }
  if (exponent >= -4 && exponent < 16) {
    std::string out;
    if (exponent >= 0) {
      std::string int_part = digits.substr(0, std::min<size_t>(digits.size(), exponent + 1));
      while (static_cast<int>(int_part.size()) < exponent + 1) int_part += '0';
      std::string frac = static_cast<int>(digits.size()) > exponent + 1 ? digits.substr(exponent + 1) : "0";
      out = int_part + "." + frac;
    } else {
      out = "0." + std::string(-exponent - 1, '0') + digits;
    }
    return sign + out;
  }
  std::string out = digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  char exp_buf[16];
  std::snprintf(exp_buf, sizeof(exp_buf), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
  return sign + out + exp_buf;
}

std::string JsonQuote(std::string_view text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

std::u32string DecodeUtf8(std::string_view text) {
  std::u32string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    unsigned char c = text[i];
    int extra = c < 0x80 ? 0 : (c >> 5) == 0x6 ? 1 : (c >> 4) == 0xE ? 2 : (c >> 3) == 0x1E ? 3 : -1;
    if (extra < 0 || i + extra >= text.size()) {
      // Invalid or truncated: keep the byte as a code point of its own (round-trips through Encode
      // only for ASCII, which is all a malformed input deserves).
      out += static_cast<char32_t>(0xFFFD);
      ++i;
      continue;
    }
    char32_t cp = extra == 0 ? c : extra == 1 ? (c & 0x1F) : extra == 2 ? (c & 0x0F) : (c & 0x07);
    bool ok = true;
    for (int k = 1; k <= extra; ++k) {
      unsigned char cc = text[i + k];
      if ((cc & 0xC0) != 0x80) {
        ok = false;
        break;
      }
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (!ok) {
      out += static_cast<char32_t>(0xFFFD);
      ++i;
      continue;
    }
    out += cp;
    i += extra + 1;
  }
  return out;
}

std::string EncodeUtf8(std::u32string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char32_t cp : text) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  return out;
}

namespace {

// Python's repr(str): single quotes unless the text has one and no double quote.
std::string PythonQuote(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (unsigned char c : s) {
    if (c == quote || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + quote;
}

}  // namespace

bool Value::Truthy() const {
  switch (type_) {
    case Type::kUndefined:
    case Type::kNone: return false;
    case Type::kBool:
    case Type::kInt: return int_ != 0;
    case Type::kFloat: return float_ != 0;
    case Type::kString: return !string_->empty();
    case Type::kArray: return !array_->empty();
    case Type::kObject: return object_->is_namespace || !object_->entries.empty();
    case Type::kFunction: return true;
  }
  return false;
}

std::string Value::Str() const {
  switch (type_) {
    case Type::kUndefined: return "";
    case Type::kString: return *string_;
    default: return Repr();
  }
}

std::string Value::Repr() const {
  switch (type_) {
    case Type::kUndefined: return "";
    case Type::kNone: return "None";
    case Type::kBool: return int_ ? "True" : "False";
    case Type::kInt: return std::to_string(int_);
    case Type::kFloat: return FormatPythonFloat(float_);
    case Type::kString: return PythonQuote(*string_);
    case Type::kArray: {
      std::string out = tuple_ ? "(" : "[";
      for (size_t i = 0; i < array_->size(); ++i) {
        if (i) out += ", ";
        out += (*array_)[i].Repr();
      }
      if (tuple_ && array_->size() == 1) out += ",";
      return out + (tuple_ ? ")" : "]");
    }
    case Type::kObject: {
      if (object_->is_namespace) return "<Namespace>";
      std::string out = "{";
      bool first = true;
      for (const auto& [k, v] : object_->entries) {
        if (!first) out += ", ";
        first = false;
        out += PythonQuote(k) + ": " + v.Repr();
      }
      return out + "}";
    }
    case Type::kFunction: return "<function " + function_->name + ">";
  }
  return "";
}

int64_t Value::Length() const {
  switch (type_) {
    case Type::kUndefined: return 0;
    case Type::kString: return static_cast<int64_t>(DecodeUtf8(*string_).size());
    case Type::kArray: return static_cast<int64_t>(array_->size());
    case Type::kObject: return static_cast<int64_t>(object_->entries.size());
    default: throw Error("object of type '" + Repr() + "' has no len()");
  }
}

bool Value::Equals(const Value& other) const {
  if (is_number() && other.is_number()) {
    if (type_ == Type::kFloat || other.type_ == Type::kFloat) return as_double() == other.as_double();
    return int_ == other.int_;
  }
  if (type_ != other.type_) return false;
  switch (type_) {
    case Type::kUndefined:
    case Type::kNone: return true;
    case Type::kString: return *string_ == *other.string_;
    case Type::kArray: {
      if (array_->size() != other.array_->size()) return false;
      for (size_t i = 0; i < array_->size(); ++i) {
        if (!(*array_)[i].Equals((*other.array_)[i])) return false;
      }
      return true;
    }
    case Type::kObject: {
      if (object_ == other.object_) return true;
      if (object_->is_namespace || other.object_->is_namespace) return false;
      if (object_->entries.size() != other.object_->entries.size()) return false;
      for (const auto& [k, v] : object_->entries) {
        const Value* o = other.object_->Find(k);
        if (!o || !v.Equals(*o)) return false;
      }
      return true;
    }
    case Type::kFunction: return function_ == other.function_;
    default: return false;
  }
}

bool Value::Less(const Value& other) const {
  if (is_number() && other.is_number()) {
    if (type_ == Type::kFloat || other.type_ == Type::kFloat) return as_double() < other.as_double();
    return int_ < other.int_;
  }
  if (is_string() && other.is_string()) return *string_ < *other.string_;  // UTF-8 orders as code points
  if (is_array() && other.is_array()) {
    const Array& a = *array_;
    const Array& b = *other.array_;
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
      if (!a[i].Equals(b[i])) return a[i].Less(b[i]);
    }
    return a.size() < b.size();
  }
  throw Error("'<' is not supported between " + Repr() + " and " + other.Repr());
}

Array Value::Items() const {
  switch (type_) {
    case Type::kUndefined: return {};
    case Type::kArray: return *array_;
    case Type::kObject: {
      Array keys;
      for (const auto& kv : object_->entries) keys.emplace_back(kv.first);
      return keys;
    }
    case Type::kString: {
      Array chars;
      for (char32_t cp : DecodeUtf8(*string_)) chars.emplace_back(EncodeUtf8(std::u32string(1, cp)));
      return chars;
    }
    default: throw Error("'" + Repr() + "' is not iterable");
  }
}

bool Value::Contains(const Value& needle) const {
  switch (type_) {
    case Type::kString:
      if (!needle.is_string()) throw Error("'in <string>' requires string as left operand");
      return string_->find(needle.as_string()) != std::string::npos;
    case Type::kArray:
      for (const Value& v : *array_) {
        if (v.Equals(needle)) return true;
      }
      return false;
    case Type::kObject:
      return needle.is_string() && object_->Find(needle.as_string()) != nullptr;
    case Type::kUndefined: return false;  // jinja2's Undefined iterates as empty
    default: throw Error("argument of type '" + Repr() + "' is not iterable");
  }
}

namespace {

void DumpJson(const Value& v, std::optional<int> indent, bool sort_keys, const std::string& item_sep,
              const std::string& key_sep, int depth, std::string& out) {
  if (depth > 512) throw Error("tojson: nesting too deep");
  auto newline = [&](int level) {
    if (!indent) return;
    out += '\n';
    out.append(static_cast<size_t>(*indent) * level, ' ');
  };
  switch (v.type()) {
    case Value::Type::kNone: out += "null"; return;
    case Value::Type::kBool: out += v.as_bool() ? "true" : "false"; return;
    case Value::Type::kInt: out += std::to_string(v.as_int()); return;
    case Value::Type::kFloat: {
      double d = v.as_double();
      if (std::isnan(d)) out += "NaN";
      else if (std::isinf(d)) out += d > 0 ? "Infinity" : "-Infinity";
      else out += FormatPythonFloat(d);
      return;
    }
    case Value::Type::kString: out += JsonQuote(v.as_string()); return;
    case Value::Type::kArray: {
      const Array& a = v.array();
      if (a.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < a.size(); ++i) {
        if (i) out += item_sep;
        newline(depth + 1);
        DumpJson(a[i], indent, sort_keys, item_sep, key_sep, depth + 1, out);
      }
      newline(depth);
      out += ']';
      return;
    }
    case Value::Type::kObject: {
      if (v.is_namespace()) throw Error("Object of type Namespace is not JSON serializable");
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& e : v.object().entries) entries.push_back(&e);
      if (sort_keys) {
        std::stable_sort(entries.begin(), entries.end(), [](auto* a, auto* b) { return a->first < b->first; });
      }
      if (entries.empty()) {
        out += "{}";
        return;
      }
      out += '{';
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i) out += item_sep;
        newline(depth + 1);
        out += JsonQuote(entries[i]->first);
        out += key_sep;
        DumpJson(entries[i]->second, indent, sort_keys, item_sep, key_sep, depth + 1, out);
      }
      newline(depth);
      out += '}';
      return;
    }
    case Value::Type::kUndefined: throw Error("Object of type Undefined is not JSON serializable");
    case Value::Type::kFunction: throw Error("Object of type function is not JSON serializable");
  }
}

}  // namespace

std::string Value::ToJson(std::optional<int> indent, bool sort_keys, const std::string& item_separator,
                          const std::string& key_separator) const {
  std::string out;
  DumpJson(*this, indent, sort_keys, item_separator, key_separator, 0, out);
  return out;
}

Value Value::FromJson(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return None();
    case nlohmann::ordered_json::value_t::boolean: return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return Value(static_cast<double>(u));
      return Value(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      Array a;
      a.reserve(j.size());
      for (const auto& e : j) a.push_back(FromJson(e));
      return Value(std::move(a));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value o = MakeObject();
      for (auto it = j.begin(); it != j.end(); ++it) o.object().Set(it.key(), FromJson(it.value()));
      return o;
    }
    default: throw Error("unsupported JSON value");
  }
}

}  // namespace kvflow::jinja
