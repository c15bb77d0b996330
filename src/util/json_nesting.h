// How deep JSON text nests, counted before a parser sees it: a recursive parser given hostile input
// ([[[[... a million deep) would exhaust the stack, so bodies past a limit are refused first.
#pragma once

#include <string_view>

namespace kvflow {

// Walks JSON text a byte at a time: whether each byte is part of a string (its quotes included).
class JsonStringState {
 public:
  bool InString(char c) {
    if (!in_string_) {
      in_string_ = c == '"';
      return in_string_;
    }
    if (escaped_) escaped_ = false;
    else if (c == '\\') escaped_ = true;
    else if (c == '"') in_string_ = false;
    return true;
  }

 private:
  bool in_string_ = false;
  bool escaped_ = false;
};

// Whether the [ / { nesting of `text`, outside strings, stays within `limit`.
inline bool JsonNestingWithin(std::string_view text, int limit) {
  int depth = 0;
  JsonStringState strings;
  for (char c : text) {
    if (strings.InString(c)) continue;
    if (c == '[' || c == '{') {
      if (++depth > limit) return false;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

}  // namespace kvflow
