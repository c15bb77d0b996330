#include "tool_calls/json_prefix.h"

#include <cctype>
#include <cstring>
#include <string>

#include "util/json_nesting.h"

namespace kvflow::tool_calls {
namespace {

using nlohmann::ordered_json;
constexpr int kMaxDepth = 256;


}  // namespace

bool ParseJsonText(std::string_view text, ordered_json* value) {
  if (!JsonNestingWithin(text, kMaxDepth)) return false;
  *value = ordered_json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  return !value->is_discarded();
}

JsonPrefixScan ScanJsonPrefix(std::string_view text) {
  size_t i = 0;
  while (i < text.size() && IsWs(text[i])) ++i;
  if (i == text.size()) return {text.size(), 0};
  if (text[i] != '{' && text[i] != '[') return {i, 0};

  // What may come next, outside strings and numbers.
  enum class Expect { kValue, kValueOrClose, kKey, kKeyOrClose, kColon, kCommaOrClose };
  enum class Number { kNone, kMinus, kZero, kInt, kDot, kFrac, kExp, kExpSign, kExpDigits };
  std::string stack;  // '{' and '[' of the open containers
  Expect expect = Expect::kValue;
  Number number = Number::kNone;
  std::string_view literal;  // the rest of true/false/null still to come
  bool in_string = false, escape = false, want_low_surrogate = false;
  int hex_left = 0, utf8_left = 0;
  unsigned code = 0;
  unsigned char utf8_min = 0x80, utf8_max = 0xBF;  // the next continuation byte's range

  // A value (scalar or container) closed: what the container around it expects, or the end.
  auto value_done = [&] { expect = stack.empty() ? Expect::kValue : Expect::kCommaOrClose; };
  // The innermost container closes; true when that was the top-level value.
  auto close = [&] {
    stack.pop_back();
    value_done();
    return stack.empty();
  };

  for (; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (in_string) {
      if (utf8_left > 0) {
        if (c < utf8_min || c > utf8_max) return {i, 0};
        --utf8_left;
        utf8_min = 0x80, utf8_max = 0xBF;
        continue;
      }
      if (hex_left > 0) {
        if (!std::isxdigit(c)) return {i, 0};
        code = code * 16 + static_cast<unsigned>(std::isdigit(c) ? c - '0' : (std::tolower(c) - 'a' + 10));
        if (--hex_left > 0) continue;
        const bool high = code >= 0xD800 && code <= 0xDBFF, low = code >= 0xDC00 && code <= 0xDFFF;
        if (want_low_surrogate != low) return {i, 0};  // pairs only, as nlohmann's parser demands
        want_low_surrogate = high;
        continue;
      }
      if (escape) {
        escape = false;
        if (c == 'u') {
          hex_left = 4;
          code = 0;
          continue;
        }
        if (want_low_surrogate || std::strchr("\"\\/bfnrt", c) == nullptr || c == 0) return {i, 0};
        continue;
      }
      if (want_low_surrogate && c != '\\') return {i, 0};
      if (c == '\\') {
        escape = true;
      } else if (c == '"') {
        in_string = false;
        if (expect == Expect::kKey || expect == Expect::kKeyOrClose) expect = Expect::kColon;
        else value_done();
      } else if (c < 0x20) {
        return {i, 0};
      } else if (c >= 0x80) {  // a UTF-8 lead byte (RFC 3629's table)
        if (c >= 0xC2 && c <= 0xDF) utf8_left = 1;
        else if (c >= 0xE0 && c <= 0xEF) utf8_left = 2;
        else if (c >= 0xF0 && c <= 0xF4) utf8_left = 3;
        else return {i, 0};
        if (c == 0xE0) utf8_min = 0xA0;
        if (c == 0xED) utf8_max = 0x9F;
        if (c == 0xF0) utf8_min = 0x90;
        if (c == 0xF4) utf8_max = 0x8F;
      }
      continue;
    }
    if (!literal.empty()) {
      if (c != static_cast<unsigned char>(literal[0])) return {i, 0};
      literal.remove_prefix(1);
      if (literal.empty()) value_done();
      continue;
    }
    if (number != Number::kNone) {
      const bool digit = c >= '0' && c <= '9';
      Number next = Number::kNone;
      switch (number) {
        case Number::kMinus: next = c == '0' ? Number::kZero : digit ? Number::kInt : Number::kNone; break;
        case Number::kZero: next = c == '.' ? Number::kDot : (c == 'e' || c == 'E') ? Number::kExp : Number::kNone; break;
        case Number::kInt:
          next = digit ? Number::kInt : c == '.' ? Number::kDot : (c == 'e' || c == 'E') ? Number::kExp : Number::kNone;
          break;
        case Number::kDot: next = digit ? Number::kFrac : Number::kNone; break;
        case Number::kFrac: next = digit ? Number::kFrac : (c == 'e' || c == 'E') ? Number::kExp : Number::kNone; break;
        case Number::kExp: next = digit ? Number::kExpDigits : (c == '+' || c == '-') ? Number::kExpSign : Number::kNone; break;
        case Number::kExpSign:
        case Number::kExpDigits: next = digit ? Number::kExpDigits : Number::kNone; break;
        case Number::kNone: break;
      }
      if (next != Number::kNone) {
        number = next;
        continue;
      }
      // The number ends here: only after a digit, and never with another digit (a leading 0).
      if (digit || (number != Number::kZero && number != Number::kInt && number != Number::kFrac &&
                    number != Number::kExpDigits))
        return {i, 0};
      number = Number::kNone;
      value_done();  // then `c` is read below as what follows the number
    }
    if (IsWs(static_cast<char>(c))) continue;
    switch (expect) {
      case Expect::kColon:
        if (c != ':') return {i, 0};
        expect = Expect::kValue;
        continue;
      case Expect::kCommaOrClose:
        if (c == ',') {
          expect = stack.back() == '{' ? Expect::kKey : Expect::kValue;
          continue;
        }
        if ((c == '}' && stack.back() == '{') || (c == ']' && stack.back() == '[')) {
          if (close()) return {i + 1, i + 1};
          continue;
        }
        return {i, 0};
      case Expect::kKeyOrClose:
        if (c == '}') {
          if (close()) return {i + 1, i + 1};
          continue;
        }
        [[fallthrough]];
      case Expect::kKey:
        if (c != '"') return {i, 0};
        in_string = true;
        continue;
      case Expect::kValueOrClose:
        if (c == ']') {
          if (close()) return {i + 1, i + 1};
          continue;
        }
        [[fallthrough]];
      case Expect::kValue:
        if (c == '{' || c == '[') {
          if (static_cast<int>(stack.size()) >= kMaxDepth) return {i, 0};
          stack.push_back(static_cast<char>(c));
          expect = c == '{' ? Expect::kKeyOrClose : Expect::kValueOrClose;
        } else if (stack.empty()) {
          return {i, 0};  // only an object or array at the top
        } else if (c == '"') {
          in_string = true;
        } else if (c == '-') {
          number = Number::kMinus;
        } else if (c == '0') {
          number = Number::kZero;
        } else if (c >= '1' && c <= '9') {
          number = Number::kInt;
        } else if (c == 't' || c == 'f' || c == 'n') {
          literal = c == 't' ? std::string_view("rue") : c == 'f' ? std::string_view("alse") : std::string_view("ull");
        } else {
          return {i, 0};
        }
        continue;
    }
  }
  return {text.size(), 0};
}

JsonPrefix ScanJsonValue(std::string_view text, size_t* end, ordered_json* value) {
  const JsonPrefixScan scan = ScanJsonPrefix(text);
  if (scan.end == 0) return scan.valid == text.size() ? JsonPrefix::kIncomplete : JsonPrefix::kInvalid;
  // The scanner's grammar is the parser's; the parse only builds the value.
  if (!ParseJsonText(text.substr(0, scan.end), value)) return JsonPrefix::kInvalid;
  *end = scan.end;
  return JsonPrefix::kComplete;
}

}  // namespace kvflow::tool_calls
