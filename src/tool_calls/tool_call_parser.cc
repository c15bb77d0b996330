#include "tool_calls/tool_call_parser.h"

#include <algorithm>
#include <utility>

#include "tool_calls/tool_call_blocks.h"

namespace kvflow {
namespace {

using std::string_view;
using tool_calls::Block;
using tool_calls::CallProgress;
using tool_calls::IsWs;
using tool_calls::JsonPrefix;
using tool_calls::LeadingWs;
using tool_calls::MarkerBlock;
using tool_calls::ProperPrefixOf;
using tool_calls::StartBlock;
using tool_calls::StartsWith;

constexpr size_t npos = string_view::npos;

// ---- What a format's calls look like ------------------------------------------------------------

struct Syntax {
  std::vector<string_view> call_markers;  // a call block starts with one of these
  std::vector<string_view> skip_markers;  // pure syntax: neither content nor a call
  bool calls_at_start = false;            // a call may open the output with no marker
};

Syntax SyntaxOf(ToolCallFormat f) {
  switch (f) {
    case ToolCallFormat::kGeneric: return {{}, {}, true};
    case ToolCallFormat::kHermes:
    case ToolCallFormat::kQwen3Coder: return {{"<tool_call>"}, {}, false};
    case ToolCallFormat::kLlama3Json: return {{}, {}, true};
    case ToolCallFormat::kMistral:
    case ToolCallFormat::kMistralArgs: return {{"[TOOL_CALLS]"}, {}, false};
    case ToolCallFormat::kGranite: return {{"<|tool_call|>"}, {}, false};
    case ToolCallFormat::kFunctionaryV32: return {{">>>"}, {}, true};
    case ToolCallFormat::kFirefunctionV2: return {{"functools["}, {}, false};
    case ToolCallFormat::kCommandR7b: return {{"<|START_ACTION|>"}, {"<|START_RESPONSE|>", "<|END_RESPONSE|>"}, false};
    case ToolCallFormat::kDeepSeekR1: return {{"<｜tool▁calls▁begin｜>"}, {}, false};
  }
  return {};
}

// ---- The left-to-right parser -------------------------------------------------------------------

struct State {
  bool in_reasoning = false;
  bool reasoning_may_open = true;  // reasoning opens only at the very start
  bool at_start = true;            // nothing but whitespace and reasoning so far
  bool skip_ws = true;             // whitespace here is syntax (the output's start, after a call or reasoning)
  bool after_call = false;
};

struct Step {
  // kNeedMore may carry the calls an open block has begun; kCalls ends a block (complete or broken).
  enum Kind { kNeedMore, kContent, kReasoning, kSkip, kCalls } kind = kNeedMore;
  size_t consumed = 0;
  std::string text;
  std::vector<CallProgress> calls;
  State state;
};

Step Make(Step::Kind kind, size_t consumed, State state, string_view text = {}) {
  Step s;
  s.kind = kind;
  s.consumed = consumed;
  s.state = state;
  s.text = std::string(text);
  return s;
}

struct Parser {
  ToolCallFormat format;
  ToolParseOptions options;
  Syntax syntax;
  std::vector<string_view> markers;  // call and skip markers together
  State state;

  Parser(ToolCallFormat f, ToolParseOptions o) : format(f), options(std::move(o)), syntax(SyntaxOf(f)) {
    if (!options.parse_tool_calls) {  // content and reasoning only
      syntax.call_markers.clear();
      syntax.skip_markers.clear();
      syntax.calls_at_start = false;
    }
    markers = syntax.call_markers;
    markers.insert(markers.end(), syntax.skip_markers.begin(), syntax.skip_markers.end());
    state.in_reasoning = options.reasoning != ReasoningFormat::kNone && options.starts_in_reasoning;
    state.reasoning_may_open = options.reasoning != ReasoningFormat::kNone && !state.in_reasoning;
  }

  // A block that is a call block (begun, complete or broken) as the step it makes.
  Step FromBlock(Block b, size_t ws, State st) const {
    if (b.scan == JsonPrefix::kIncomplete) {
      Step s = Make(Step::kNeedMore, 0, st);
      s.calls = std::move(b.calls);
      return s;
    }
    st.at_start = false;
    st.skip_ws = true;
    st.after_call = !b.calls.empty();
    if (b.scan == JsonPrefix::kInvalid) {  // broke after a call began: the rest is content
      st.skip_ws = st.after_call = false;
    }
    if (b.content) {
      st.skip_ws = false;
      return Make(Step::kContent, ws + b.consumed, st, *b.content);
    }
    if (b.calls.empty()) return Make(Step::kSkip, ws + b.consumed, st);
    Step s = Make(Step::kCalls, ws + b.consumed, st);
    s.calls = std::move(b.calls);
    return s;
  }

  // The next settled piece of `rest` (the unparsed text); kNeedMore only when !final.
  Step Next(string_view rest, bool final) const {
    State st = state;
    if (st.in_reasoning) {
      const string_view close = ReasoningClose(options.reasoning);
      size_t at = rest.find(close);
      if (at == 0) {
        st.in_reasoning = false;
        st.skip_ws = true;
        return Make(Step::kSkip, close.size(), st);
      }
      size_t n = at != npos ? at : final ? rest.size() : HeldFrom(rest, {close});
      return n == 0 ? Make(Step::kNeedMore, 0, st) : Make(Step::kReasoning, n, st, rest.substr(0, n));
    }
    if (st.reasoning_may_open) {
      const string_view open = ReasoningOpen(options.reasoning);
      const size_t ws = LeadingWs(rest);
      if (StartsWith(rest.substr(ws), open)) {
        st.in_reasoning = true;
        st.reasoning_may_open = false;
        return Make(Step::kSkip, ws + open.size(), st);
      }
      if (!final && ProperPrefixOf(rest.substr(ws), open)) return Make(Step::kNeedMore, 0, st);
      st.reasoning_may_open = false;
    }
    const size_t ws = LeadingWs(rest);
    if (st.skip_ws && ws > 0) return Make(Step::kSkip, ws, st);
    st.skip_ws = false;
    const string_view body = rest.substr(ws);

    if (st.after_call && format == ToolCallFormat::kLlama3Json && StartsWith(body, ";")) {
      st.skip_ws = true;
      return Make(Step::kSkip, ws + 1, st);
    }
    if (syntax.calls_at_start && (st.at_start || (st.after_call && format == ToolCallFormat::kLlama3Json))) {
      Block b = StartBlock(format, body, final);
      if (b.scan != JsonPrefix::kInvalid || !b.calls.empty()) return FromBlock(std::move(b), ws, st);
    }
    for (string_view m : syntax.skip_markers)
      if (StartsWith(body, m)) {
        st.at_start = st.after_call = false;
        st.skip_ws = true;
        return Make(Step::kSkip, ws + m.size(), st);
      }
    for (string_view m : syntax.call_markers)
      if (StartsWith(body, m)) {
        Block b = MarkerBlock(format, body, final, options);
        if (b.scan != JsonPrefix::kInvalid || !b.calls.empty()) return FromBlock(std::move(b), ws, st);
        st.at_start = st.after_call = false;  // not a call after all: the marker is text
        return Make(Step::kContent, ws + m.size(), st, rest.substr(0, ws + m.size()));
      }
    if (!final) {
      if (body.empty()) return Make(Step::kNeedMore, 0, st);  // whitespace may lead into a marker
      for (string_view m : markers)
        if (ProperPrefixOf(body, m)) return Make(Step::kNeedMore, 0, st);
    }
    // Content, up to the next marker (or what may begin one); the whitespace before it goes with it.
    st.at_start = st.after_call = false;
    if (body.empty()) return Make(Step::kContent, rest.size(), st, rest);
    size_t cut = FindMarker(body);
    if (!final) cut = std::min(cut, HeldFrom(body, markers));
    size_t end = std::min(cut, body.size());
    if (cut != npos)  // something may follow: the whitespace before it waits to see what
      while (end > 1 && IsWs(body[end - 1])) --end;
    return Make(Step::kContent, ws + end, st, rest.substr(0, ws + end));
  }

  // The first full marker in `s` after its first byte (npos if none).
  size_t FindMarker(string_view s) const {
    size_t best = npos;
    for (string_view m : markers) best = std::min(best, s.find(m, 1));
    return best;
  }

  // Where a marker may begin at the end of `s` (the smallest i with s[i:] a proper prefix of one);
  // s.size() if nowhere.
  static size_t HeldFrom(string_view s, const std::vector<string_view>& ms) {
    size_t longest = 0;
    for (string_view m : ms) longest = std::max(longest, m.size());
    for (size_t i = s.size() > longest ? s.size() - longest : 0; i < s.size(); ++i)
      for (string_view m : ms)
        if (ProperPrefixOf(s.substr(i), m)) return i;
    return s.size();
  }

  // What of the open block's calls is news: calls begun since, and arguments grown since.
  std::vector<AssistantDelta> CallDeltas(const std::vector<CallProgress>& calls) {
    std::vector<AssistantDelta> out;
    const int first_index = calls_sent_ - static_cast<int>(block_calls_sent_);
    for (size_t i = 0; i < calls.size(); ++i) {
      if (i + 1 < block_calls_sent_) continue;  // complete, and sent, before a later one began
      const int index = first_index + static_cast<int>(i);
      size_t sent = 0;
      if (i + 1 > block_calls_sent_) {
        out.push_back({AssistantDelta::Kind::kToolCall, calls[i].name, index, calls[i].id});
        block_calls_sent_ = i + 1;
        ++calls_sent_;
      } else {
        sent = last_arguments_sent_;
      }
      const std::string& args = calls[i].arguments;
      if (args.size() > sent) out.push_back({AssistantDelta::Kind::kArguments, args.substr(sent), index, ""});
      last_arguments_sent_ = std::max(sent, args.size());
    }
    return out;
  }

  // Runs the steps over `text` from `*pos`, handing each (and the call deltas it makes) to `emit`.
  template <typename Emit>
  void Run(string_view text, size_t* pos, bool final, Emit&& emit) {
    while (*pos < text.size()) {
      Step s = Next(text.substr(*pos), final);
      std::vector<AssistantDelta> deltas = CallDeltas(s.calls);
      if (s.kind == Step::kNeedMore) {
        if (!deltas.empty()) emit(std::move(s), std::move(deltas));
        return;
      }
      block_calls_sent_ = last_arguments_sent_ = 0;  // the block ends with this step
      if (s.consumed == 0) {  // cannot happen; never loop forever on a bug
        s = Make(Step::kContent, text.size() - *pos, state, text.substr(*pos));
      }
      *pos += s.consumed;
      state = s.state;
      emit(std::move(s), std::move(deltas));
    }
  }

 private:
  int calls_sent_ = 0;               // calls begun over the whole output
  size_t block_calls_sent_ = 0;      // of them, in the open block
  size_t last_arguments_sent_ = 0;   // bytes of the open block's last begun call's arguments
};

}  // namespace

ParsedAssistant ParseAssistantOutput(ToolCallFormat format, std::string_view text, const ToolParseOptions& options) {
  Parser parser(format, options);
  ParsedAssistant out;
  size_t pos = 0;
  parser.Run(text, &pos, /*final=*/true, [&](Step s, std::vector<AssistantDelta> deltas) {
    if (s.kind == Step::kContent) out.content += s.text;
    else if (s.kind == Step::kReasoning) out.reasoning_content += s.text;
    for (auto& d : deltas) {
      if (d.kind == AssistantDelta::Kind::kToolCall) out.tool_calls.push_back({std::move(d.text), "", std::move(d.id)});
      else out.tool_calls.back().arguments += d.text;
    }
  });
  return out;
}

struct StreamingToolCallParser::Impl {
  explicit Impl(Parser p) : parser(std::move(p)) {}
  Parser parser;
  std::string buffer;  // text not yet settled, from pos
  size_t pos = 0;

  std::vector<AssistantDelta> Run(bool final) {
    std::vector<AssistantDelta> out;
    auto text = [&](AssistantDelta::Kind kind, std::string t) {
      if (t.empty()) return;
      if (!out.empty() && out.back().kind == kind) out.back().text += t;
      else out.push_back({kind, std::move(t), -1, ""});
    };
    parser.Run(buffer, &pos, final, [&](Step s, std::vector<AssistantDelta> deltas) {
      if (s.kind == Step::kContent) text(AssistantDelta::Kind::kContent, std::move(s.text));
      else if (s.kind == Step::kReasoning) text(AssistantDelta::Kind::kReasoning, std::move(s.text));
      for (auto& d : deltas) out.push_back(std::move(d));
    });
    if (pos > 4096) {  // keep the buffer to the unsettled text
      buffer.erase(0, pos);
      pos = 0;
    }
    return out;
  }
};

StreamingToolCallParser::StreamingToolCallParser(ToolCallFormat format, ToolParseOptions options)
    : impl_(std::make_unique<Impl>(Parser(format, std::move(options)))) {}
StreamingToolCallParser::~StreamingToolCallParser() = default;
StreamingToolCallParser::StreamingToolCallParser(StreamingToolCallParser&&) noexcept = default;
StreamingToolCallParser& StreamingToolCallParser::operator=(StreamingToolCallParser&&) noexcept = default;

std::vector<AssistantDelta> StreamingToolCallParser::Push(std::string_view new_text) {
  impl_->buffer.append(new_text);
  return impl_->Run(/*final=*/false);
}

std::vector<AssistantDelta> StreamingToolCallParser::Finish() { return impl_->Run(/*final=*/true); }

}  // namespace kvflow
