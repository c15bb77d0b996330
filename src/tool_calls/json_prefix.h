// JSON at the start of a text that may still be growing: is it a complete value yet, can it still
// become one, or is it already wrong? The tool-call parsers decide calls with it without waiting
// for the end of the output.
#pragma once

#include <cstddef>
#include <string_view>

#include <nlohmann/json.hpp>

namespace kvflow::tool_calls {

enum class JsonPrefix { kComplete, kIncomplete, kInvalid };

// The object or array that `text` starts with (after whitespace): kComplete with its value and the
// offset just past it; kIncomplete while more text could complete it; kInvalid when nothing can
// (including other values, and nesting deeper than 256, which parses refuse to bound the stack).
JsonPrefix ScanJsonValue(std::string_view text, size_t* end, nlohmann::ordered_json* value);

// The whole of `text` (whitespace around it allowed) as one JSON value, under the same depth bound;
// false if it is not one.
bool ParseJsonText(std::string_view text, nlohmann::ordered_json* value);

}  // namespace kvflow::tool_calls
