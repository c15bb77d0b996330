#include "tool_calls/json_prefix.h"

#include <string>

#include "util/json_nesting.h"

namespace kvflow::tool_calls {
namespace {

using nlohmann::ordered_json;
constexpr int kMaxDepth = 256;

bool IsWs(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

// Records only where the first syntax error is: past the end of the text means the text stopped
// early (it can still become JSON), anywhere else means it is wrong already.
struct ErrorPosition : nlohmann::json_sax<ordered_json> {
  size_t position = 0;
  bool failed = false;
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return true; }
  bool key(string_t&) override { return true; }
  bool end_object() override { return true; }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t pos, const std::string&, const nlohmann::detail::exception&) override {
    position = pos;
    failed = true;
    return false;
  }
};


}  // namespace

bool ParseJsonText(std::string_view text, ordered_json* value) {
  if (!JsonNestingWithin(text, kMaxDepth)) return false;
  *value = ordered_json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  return !value->is_discarded();
}

JsonPrefix ScanJsonValue(std::string_view text, size_t* end, ordered_json* value) {
  size_t begin = 0;
  while (begin < text.size() && IsWs(text[begin])) ++begin;
  if (begin == text.size()) return JsonPrefix::kIncomplete;
  if (text[begin] != '{' && text[begin] != '[') return JsonPrefix::kInvalid;
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = begin; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > kMaxDepth) return JsonPrefix::kInvalid;
    } else if (c == '}' || c == ']') {
      if (--depth > 0) continue;
      // The brackets balance here: this is the value, or it never will be (a mismatched bracket).
      if (!ParseJsonText(text.substr(begin, i + 1 - begin), value)) return JsonPrefix::kInvalid;
      *end = i + 1;
      return JsonPrefix::kComplete;
    }
  }
  const std::string_view rest = text.substr(begin);
  ErrorPosition sax;
  ordered_json::sax_parse(rest.begin(), rest.end(), &sax, ordered_json::input_format_t::json, /*strict=*/false);
  return sax.failed && sax.position <= rest.size() ? JsonPrefix::kInvalid : JsonPrefix::kIncomplete;
}

}  // namespace kvflow::tool_calls
