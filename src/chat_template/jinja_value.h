// The values a Jinja chat template computes with, with Python's semantics where templates can see
// them (jinja2 runs on Python objects): str() and repr() of every type, truthiness, equality and
// ordering, and json.dumps as transformers' `tojson` filter calls it (ensure_ascii=False).
// Lists and dicts are shared by reference, as Python's are; a dict keeps insertion order.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvflow::jinja {

// Raised while parsing or rendering; the template's own raise_exception() sets `raised`.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message, bool raised = false)
      : std::runtime_error(message), raised_(raised) {}
  bool raised() const { return raised_; }

 private:
  bool raised_;
};

class Value;
using Array = std::vector<Value>;
struct Object;
struct CallArgs;
using Function = std::function<Value(CallArgs&)>;

class Value {
 public:
  enum class Type { kUndefined, kNone, kBool, kInt, kFloat, kString, kArray, kObject, kFunction };

  Value() = default;  // undefined
  static Value None() { Value v; v.type_ = Type::kNone; return v; }
  Value(bool b) : type_(Type::kBool), int_(b) {}
  Value(int i) : type_(Type::kInt), int_(i) {}
  Value(int64_t i) : type_(Type::kInt), int_(i) {}
  Value(double f) : type_(Type::kFloat), float_(f) {}
  Value(std::string s) : type_(Type::kString), string_(std::make_shared<std::string>(std::move(s))) {}
  Value(const char* s) : Value(std::string(s)) {}
  Value(Array a) : type_(Type::kArray), array_(std::make_shared<Array>(std::move(a))) {}
  // A Python tuple: a list that prints as (a, b) (dict items, tuple literals).
  static Value Tuple(Array a) { Value v(std::move(a)); v.tuple_ = true; return v; }
  static Value MakeObject(bool is_namespace = false);
  static Value MakeFunction(std::string name, Function f);
  // An undefined value that remembers why (for error messages).
  static Value Undefined(std::string hint) { Value v; v.hint_ = std::make_shared<std::string>(std::move(hint)); return v; }

  Type type() const { return type_; }
  bool is_undefined() const { return type_ == Type::kUndefined; }
  bool is_none() const { return type_ == Type::kNone; }
  bool is_bool() const { return type_ == Type::kBool; }
  bool is_int() const { return type_ == Type::kInt || type_ == Type::kBool; }  // Python: bool is an int
  bool is_number() const { return is_int() || type_ == Type::kFloat; }
  bool is_string() const { return type_ == Type::kString; }
  bool is_array() const { return type_ == Type::kArray; }
  bool is_object() const { return type_ == Type::kObject; }
  bool is_function() const { return type_ == Type::kFunction; }
  bool is_namespace() const;
  bool is_iterable() const { return is_string() || is_array() || is_object() || is_undefined(); }

  bool as_bool() const { return int_ != 0; }
  int64_t as_int() const { return int_; }
  double as_double() const { return type_ == Type::kFloat ? float_ : static_cast<double>(int_); }
  const std::string& as_string() const { return *string_; }
  Array& array() const { return *array_; }
  Object& object() const { return *object_; }
  const std::string& undefined_hint() const;
  Value Call(CallArgs& args) const;
  const std::string& function_name() const;

  bool Truthy() const;
  // Python's str(): what {{ value }} prints (undefined prints nothing).
  std::string Str() const;
  // Python's repr().
  std::string Repr() const;
  // len(); throws for what has none.
  int64_t Length() const;
  // ==, with Python's numeric equality across int/float/bool and deep equality of containers.
  bool Equals(const Value& other) const;
  // <; throws for types Python does not order.
  bool Less(const Value& other) const;
  // Iterates as Python does: a list's items, a dict's keys, a string's characters.
  Array Items() const;
  // `needle in this`.
  bool Contains(const Value& needle) const;

  // json.dumps(value, ensure_ascii=False, indent=indent, separators=..., sort_keys=sort_keys).
  std::string ToJson(std::optional<int> indent, bool sort_keys, const std::string& item_separator,
                     const std::string& key_separator) const;

  static Value FromJson(const nlohmann::ordered_json& j);

 private:
  Type type_ = Type::kUndefined;
  int64_t int_ = 0;
  double float_ = 0;
  std::shared_ptr<std::string> string_;
  std::shared_ptr<Array> array_;
  std::shared_ptr<Object> object_;
  struct Callable {
    std::string name;
    Function function;
  };
  std::shared_ptr<Callable> function_;
  std::shared_ptr<std::string> hint_;
  bool tuple_ = false;
};

// A Python dict with string keys, in insertion order; or a jinja2 namespace().
struct Object {
  std::vector<std::pair<std::string, Value>> entries;
  bool is_namespace = false;

  const Value* Find(std::string_view key) const;
  void Set(const std::string& key, Value value);
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keywords;

  // The argument at `index` or named `name`, else `fallback`; marks it used.
  Value Get(size_t index, std::string_view name, Value fallback = Value());
  bool Has(size_t index, std::string_view name) const;
};

// Python's repr(float).
std::string FormatPythonFloat(double value);
// A JSON string literal as json.dumps(ensure_ascii=False) writes it.
std::string JsonQuote(std::string_view text);
// UTF-8 text as code points and back (Python's str indexes code points).
std::u32string DecodeUtf8(std::string_view text);
std::string EncodeUtf8(std::u32string_view text);

}  // namespace kvflow::jinja
