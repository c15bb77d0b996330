#include "model/pretokenizer.h"

#include <algorithm>
#include <cstdint>

#include "model/unicode_data.h"
#include "model/utf8.h"

namespace kvflow {
namespace {

// The four disjoint classes the regexes distinguish.
enum class CharClass : uint8_t { kLetter, kNumber, kSpace, kOther };

struct Codepoint {
  uint32_t cp;
  uint32_t offset;  // of its first byte in the text
  CharClass cls;
};

CharClass ClassOf(uint32_t cp) {
  const uint8_t flags = CodepointFlags(cp);
  if (flags & kCpLetter) return CharClass::kLetter;
  if (flags & kCpNumber) return CharClass::kNumber;
  if (flags & kCpWhitespace) return CharClass::kSpace;
  return CharClass::kOther;
}

std::vector<Codepoint> DecodeText(std::string_view text) {
  std::vector<Codepoint> cps;
  cps.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    const Utf8Step step = DecodeUtf8(text, pos);
    // An invalid byte stands alone as punctuation; its byte is still what gets encoded.
    const uint8_t len = step.valid ? step.len : 1;
    cps.push_back({step.cp, static_cast<uint32_t>(pos),
                   step.valid ? ClassOf(step.cp) : CharClass::kOther});
    pos += len;
  }
  return cps;
}

bool IsCrLf(uint32_t cp) { return cp == '\r' || cp == '\n'; }

// Length of the run of class `cls` in c[from, n).
size_t RunLength(const Codepoint* c, size_t from, size_t n, CharClass cls) {
  size_t i = from;
  while (i < n && c[i].cls == cls) ++i;
  return i - from;
}

// Length of the contraction ('s 't 're 've 'm 'll 'd) at c[0], or 0.
size_t MatchContraction(const Codepoint* c, size_t n, bool ignore_case) {
  if (n < 2 || c[0].cp != '\'') return 0;
  auto lower = [ignore_case](uint32_t cp) {
    return ignore_case && cp >= 'A' && cp <= 'Z' ? cp + ('a' - 'A') : cp;
  };
  const uint32_t a = lower(c[1].cp);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (n < 3) return 0;
  const uint32_t b = lower(c[2].cp);
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

// `\s+(?!\S)|\s+` on the whitespace run at c[0]: a run that is followed by a non-space leaves
// its last character to start the next pre-token (unless it is the only one).
size_t MatchTrailingSpace(const Codepoint* c, size_t n) {
  const size_t run = RunLength(c, 0, n, CharClass::kSpace);
  if (run == n || run == 1) return run;
  return run - 1;
}

// One match of 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// at c[0] within c[0, n). Returns its length in code points (>= 1).
size_t MatchGpt2(const Codepoint* c, size_t n) {
  if (size_t len = MatchContraction(c, n, /*ignore_case=*/false)) return len;
  // " ?X+" for X in letters, numbers, other: the optional space is taken when X follows it.
  const size_t lead = (c[0].cp == ' ' && n > 1 && c[1].cls != CharClass::kSpace) ? 1 : 0;
  const CharClass cls = c[lead].cls;
  if (cls != CharClass::kSpace) return lead + RunLength(c, lead, n, cls);
  return MatchTrailingSpace(c, n);
}

// One match of the Llama-3 regex at c[0] within c[0, n):
// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
// \s*[\r\n]+|\s+(?!\S)|\s+
// Qwen2's is the same with \p{N} one digit at a time (kMaxDigits 1).
template <size_t kMaxDigits>
size_t MatchLlama3Style(const Codepoint* c, size_t n) {
  if (size_t len = MatchContraction(c, n, /*ignore_case=*/true)) return len;
  if (c[0].cls == CharClass::kLetter) return RunLength(c, 0, n, CharClass::kLetter);
  if (c[0].cls != CharClass::kNumber && !IsCrLf(c[0].cp) && n > 1 &&
      c[1].cls == CharClass::kLetter) {
    return 1 + RunLength(c, 1, n, CharClass::kLetter);
  }
  if (c[0].cls == CharClass::kNumber) {
    return std::min<size_t>(kMaxDigits, RunLength(c, 0, n, CharClass::kNumber));
  }
  const size_t lead = (c[0].cp == ' ' && n > 1 && c[1].cls == CharClass::kOther) ? 1 : 0;
  if (c[lead].cls == CharClass::kOther) {
    size_t end = lead + RunLength(c, lead, n, CharClass::kOther);
    while (end < n && IsCrLf(c[end].cp)) ++end;
    return end;
  }
  // c[0] is whitespace. \s*[\r\n]+ backtracks to end after the run's last CR/LF.
  const size_t run = RunLength(c, 0, n, CharClass::kSpace);
  for (size_t i = run; i > 0; --i) {
    if (IsCrLf(c[i - 1].cp)) return i;
  }
  return MatchTrailingSpace(c, n);
}

// `\p{N}`: one number character (HF Digits(individual_digits=true) is the same split).
size_t MatchOneDigit(const Codepoint* c, size_t) { return c[0].cls == CharClass::kNumber ? 1 : 0; }

bool IsAsciiDigit(uint8_t b) { return b >= '0' && b <= '9'; }

// Falcon's last two stages run after its ByteLevel step, on the bytes spelled in GPT-2's
// alphabet: Digits(individual_digits=false) isolates runs of bytes whose spelling is numeric
// (the ASCII digits and 0xB2 0xB3 0xB9 0xBC 0xBD 0xBE, which stand for ²³¹¼½¾ and are also
// UTF-8 continuation bytes, so a character like "ü" parts in two), then `[0-9][0-9][0-9]` parts
// those runs in threes. Appends the pieces of text[begin, end) as byte ranges.
void SplitFalconDigits(std::string_view text, size_t begin, size_t end,
                       std::vector<std::string_view>* out) {
  auto numeric = [&](size_t i) {
    const auto b = static_cast<uint8_t>(text[i]);
    return IsAsciiDigit(b) || b == 0xB2 || b == 0xB3 || b == 0xB9 || (b >= 0xBC && b <= 0xBE);
  };
  for (size_t pos = begin; pos < end;) {
    const bool digits = numeric(pos);
    size_t run_end = pos;
    while (run_end < end && numeric(run_end) == digits) ++run_end;
    if (!digits) {
      out->push_back(text.substr(pos, run_end - pos));
      pos = run_end;
      continue;
    }
    size_t gap = pos;
    for (size_t i = pos; i < run_end;) {
      if (i + 3 <= run_end && IsAsciiDigit(text[i]) && IsAsciiDigit(text[i + 1]) &&
          IsAsciiDigit(text[i + 2])) {
        if (gap < i) out->push_back(text.substr(gap, i - gap));
        out->push_back(text.substr(i, 3));
        i += 3;
        gap = i;
      } else {
        ++i;
      }
    }
    if (gap < run_end) out->push_back(text.substr(gap, run_end - gap));
    pos = run_end;
  }
}

bool IsPunctuation(uint32_t cp) { return (CodepointFlags(cp) & kCpPunctuation) != 0; }

// `[\p{P}\$\+<=>\^~\|`]+` (Falcon): runs of punctuation and the ASCII symbols it names.
size_t MatchFalconPunctuation(const Codepoint* c, size_t n) {
  auto member = [](uint32_t cp) {
    return IsPunctuation(cp) || (cp < 0x80 && std::string_view("$+<=>^~|`").find(static_cast<char>(cp)) !=
                                                  std::string_view::npos);
  };
  size_t i = 0;
  while (i < n && member(c[i].cp)) ++i;
  return i;
}

// `[\r\n]` (DeepSeek-Coder): each line break alone.
size_t MatchLineBreak(const Codepoint* c, size_t) { return IsCrLf(c[0].cp) ? 1 : 0; }

// `\s?X+` where X is letters (`\p{L}`) or punctuation (`\p{P}`) (DeepSeek-Coder).
template <bool kPunctuation>
size_t MatchSpaceThenRun(const Codepoint* c, size_t n) {
  auto member = [](const Codepoint& cp) {
    return kPunctuation ? IsPunctuation(cp.cp) : cp.cls == CharClass::kLetter;
  };
  const size_t lead = c[0].cls == CharClass::kSpace && n > 1 && member(c[1]) ? 1 : 0;
  size_t i = lead;
  while (i < n && member(c[i])) ++i;
  return i == lead ? 0 : i;
}

// `[一-龥ࠀ-一가-퟿]+` (DeepSeek-Coder): U+4E00..U+9FA5, U+0800..U+4E00, U+AC00..U+D7FF.
size_t MatchDeepSeekCjk(const Codepoint* c, size_t n) {
  auto member = [](uint32_t cp) {
    return (cp >= 0x0800 && cp <= 0x9FA5) || (cp >= 0xAC00 && cp <= 0xD7FF);
  };
  size_t i = 0;
  while (i < n && member(c[i].cp)) ++i;
  return i;
}

// One stage of a pre-tokenizer sequence: the length of the match at c[0] within c[0, n), or 0.
using Matcher = size_t (*)(const Codepoint*, size_t);

// HF Split(behavior=Isolated) on cps[begin, end): each leftmost match becomes a piece and so does
// each stretch of text between matches. Appends the pieces as code-point ranges.
void SplitIsolated(Matcher match, const std::vector<Codepoint>& cps, size_t begin, size_t end,
                   std::vector<std::pair<size_t, size_t>>* out) {
  size_t gap = begin;
  for (size_t pos = begin; pos < end;) {
    const size_t len = match(cps.data() + pos, end - pos);
    if (len == 0) {
      ++pos;
      continue;
    }
    if (gap < pos) out->emplace_back(gap, pos);
    out->emplace_back(pos, pos + len);
    pos += len;
    gap = pos;
  }
  if (gap < end) out->emplace_back(gap, end);
}

// The split stages of each pre-tokenizer, applied in order to each piece of the stage before,
// as HF's Sequence pre-tokenizer (and llama.cpp's regex list) does.
std::vector<Matcher> StagesOf(PreTokenizer::Kind kind) {
  using Kind = PreTokenizer::Kind;
  switch (kind) {
    case Kind::kGpt2: return {MatchGpt2};
    case Kind::kLlama3: return {MatchLlama3Style<3>};
    case Kind::kQwen2: return {MatchLlama3Style<1>};
    // StarCoder's regex drops GPT-2's final `|\s+`; the whitespace it would match then stands
    // alone between matches anyway, so the pieces are SmolLM's.
    case Kind::kSmolLm: return {MatchOneDigit, MatchGpt2};
    case Kind::kFalcon: return {MatchFalconPunctuation, MatchGpt2};  // + SplitFalconDigits
    case Kind::kDeepSeekCoder:
      return {MatchLineBreak, MatchSpaceThenRun<false>, MatchSpaceThenRun<true>, MatchDeepSeekCjk,
              MatchOneDigit};
  }
  return {};
}

}  // namespace

namespace {

struct KnownPreTokenizer {
  std::string_view name;  // as llama.cpp spells `tokenizer.ggml.pre`
  PreTokenizer::Kind kind;
};

constexpr KnownPreTokenizer kKnown[] = {
    {"gpt2", PreTokenizer::Kind::kGpt2},
    {"gpt-2", PreTokenizer::Kind::kGpt2},  // llama.cpp's GGUF name
    {"smollm", PreTokenizer::Kind::kSmolLm},
    {"starcoder", PreTokenizer::Kind::kSmolLm},
    {"llama-bpe", PreTokenizer::Kind::kLlama3},
    {"llama3", PreTokenizer::Kind::kLlama3},
    {"qwen2", PreTokenizer::Kind::kQwen2},
    {"falcon", PreTokenizer::Kind::kFalcon},
    {"deepseek-coder", PreTokenizer::Kind::kDeepSeekCoder},
};

}  // namespace

Result<PreTokenizer> PreTokenizer::FromName(std::string_view name) {
  for (const KnownPreTokenizer& known : kKnown) {
    if (known.name == name) return PreTokenizer(known.kind, known.name);
  }
  std::string names;
  for (const KnownPreTokenizer& known : kKnown) names += (names.empty() ? "" : ", ") + std::string(known.name);
  return Status::Unsupported("tokenizer pre-type '" + std::string(name) +
                             "' is not supported (known: " + names + ")");
}

void PreTokenizer::Split(std::string_view text, std::vector<std::string_view>* out) const {
  const std::vector<Codepoint> cps = DecodeText(text);
  std::vector<std::pair<size_t, size_t>> pieces{{0, cps.size()}}, next;
  if (cps.empty()) return;
  for (Matcher stage : StagesOf(kind_)) {
    next.clear();
    for (const auto& [begin, end] : pieces) SplitIsolated(stage, cps, begin, end, &next);
    pieces.swap(next);
  }
  auto offset = [&](size_t i) { return i < cps.size() ? cps[i].offset : text.size(); };
  for (const auto& [begin, end] : pieces) {
    if (kind_ == Kind::kFalcon) {
      SplitFalconDigits(text, offset(begin), offset(end), out);
    } else {
      out->push_back(text.substr(offset(begin), offset(end) - offset(begin)));
    }
  }
}

}  // namespace kvflow
