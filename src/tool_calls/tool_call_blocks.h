// The call syntax of each tool-call format (tool_call_format.h), read from the start of a text that
// may still be growing: the block of calls there, as far as the text shows it. The parser
// (tool_call_parser.cc) walks an output with these and turns what they find into deltas.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tool_calls/json_prefix.h"
#include "tool_calls/tool_call_format.h"
#include "tool_calls/tool_call_parser.h"

namespace kvflow::tool_calls {

inline size_t LeadingWs(std::string_view s) {
  size_t i = 0;
  while (i < s.size() && IsWs(s[i])) ++i;
  return i;
}
inline bool StartsWith(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
// `s` could still grow into `p`.
inline bool ProperPrefixOf(std::string_view s, std::string_view p) { return s.size() < p.size() && StartsWith(p, s); }

// ---- Calls as far as the text shows them ---------------------------------------------------------
//
// A call *begins* once the text settles that it is one: its name is known (its id too, in the
// formats whose ids must not be lost) and its arguments object has opened. From then on it is
// reported whatever follows, and its arguments grow with the text, so a stream can send them as
// they are generated. The arguments are the model's JSON with the whitespace between tokens
// removed (a function of each prefix, so streamed pieces add up to the whole). If the output ends
// inside a begun call, the call is reported as far as it got (the request's finish_reason says
// "length"); if its syntax breaks, the call ends where it broke and the rest of the text is
// content. Text that breaks before any call began is content, markers and all.

struct CallProgress {
  std::string name;
  std::string id;
  std::string arguments;  // as far as settled
};

// A block of call syntax at the start of a text:
//  kComplete    `consumed` bytes, its calls complete (or content for generic's {"response"}, or
//               neither for functionary's ">>>all\n");
//  kIncomplete  more text is needed; `calls` are those begun so far;
//  kInvalid     with no calls: not a call block; with calls: it broke at `consumed`.
struct Block {
  JsonPrefix scan = JsonPrefix::kInvalid;
  size_t consumed = 0;
  std::vector<CallProgress> calls;
  std::optional<std::string> content;
};

// The block that `s` starts with, for formats whose calls may open the output without a marker
// (llama3_json, functionary_v3_2, generic); kInvalid with no calls where there is none.
Block StartBlock(ToolCallFormat f, std::string_view s, bool final);

// The block that `s` starts with; `s` starts with one of the format's call markers.
Block MarkerBlock(ToolCallFormat f, std::string_view s, bool final, const ToolParseOptions& options);

}  // namespace kvflow::tool_calls
