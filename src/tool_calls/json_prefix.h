// JSON at the start of a text that may still be growing: is it a complete value yet, can it still
// become one, or is it already wrong? The tool-call parsers decide calls with it without waiting
// for the end of the output.
#pragma once

#include <cstddef>
#include <string_view>

#include <nlohmann/json.hpp>

namespace kvflow::tool_calls {

enum class JsonPrefix { kComplete, kIncomplete, kInvalid };

// JSON's whitespace (also what the call formats skip between their pieces).
inline bool IsWs(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

// The object or array that `text` starts with (after whitespace): kComplete with its value and the
// offset just past it; kIncomplete while more text could complete it; kInvalid when nothing can
// (including other values, and nesting deeper than 256, which parses refuse to bound the stack).
JsonPrefix ScanJsonValue(std::string_view text, size_t* end, nlohmann::ordered_json* value);

// How far `text` (after whitespace) is JSON: `valid`, the length of its longest start that more text
// could complete into an object or array, or that is one (text.size() when all of it is); `end`,
// just past that value when it is complete, else 0. Exactly the grammar nlohmann's parser accepts
// (numbers, escapes, surrogate pairs, UTF-8), so `valid` only grows as text is appended.
struct JsonPrefixScan {
  size_t valid = 0;
  size_t end = 0;
};
JsonPrefixScan ScanJsonPrefix(std::string_view text);

// The whole of `text` (whitespace around it allowed) as one JSON value, under the same depth bound;
// false if it is not one.
bool ParseJsonText(std::string_view text, nlohmann::ordered_json* value);

}  // namespace kvflow::tool_calls
