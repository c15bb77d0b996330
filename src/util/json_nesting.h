// How deep JSON text nests, counted before a parser sees it: a recursive parser given hostile input
// ([[[[... a million deep) would exhaust the stack, so bodies past a limit are refused first.
#pragma once

#include <string_view>

namespace kvflow {

// Whether the [ / { nesting of `text`, outside strings, stays within `limit`.
inline bool JsonNestingWithin(std::string_view text, int limit) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return false;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

}  // namespace kvflow
