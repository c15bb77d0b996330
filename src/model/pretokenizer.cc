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

using Matcher = size_t (*)(const Codepoint*, size_t);

// Appends the matches of `match` over cps[begin, end), as byte ranges of `text`.
void SplitWith(Matcher match, std::string_view text, const std::vector<Codepoint>& cps,
               size_t begin, size_t end, std::vector<std::string_view>* out) {
  auto offset = [&](size_t i) { return i < cps.size() ? cps[i].offset : text.size(); };
  while (begin < end) {
    const size_t len = match(cps.data() + begin, end - begin);
    out->push_back(text.substr(offset(begin), offset(begin + len) - offset(begin)));
    begin += len;
  }
}

}  // namespace

Result<PreTokenizer> PreTokenizer::FromName(std::string_view name) {
  if (name == "gpt2" || name == "gpt-2") return PreTokenizer(Kind::kGpt2);  // "gpt-2": llama.cpp's GGUF name
  if (name == "smollm") return PreTokenizer(Kind::kSmolLm);
  if (name == "llama-bpe" || name == "llama3") return PreTokenizer(Kind::kLlama3);
  if (name == "qwen2") return PreTokenizer(Kind::kQwen2);
  return Status::Unsupported("tokenizer pre-type '" + std::string(name) +
                             "' is not supported (known: gpt2 or gpt-2, smollm, llama-bpe, qwen2)");
}

const char* PreTokenizer::name() const {
  switch (kind_) {
    case Kind::kGpt2: return "gpt2";
    case Kind::kSmolLm: return "smollm";
    case Kind::kLlama3: return "llama-bpe";
    case Kind::kQwen2: return "qwen2";
  }
  return "?";
}

void PreTokenizer::Split(std::string_view text, std::vector<std::string_view>* out) const {
  const std::vector<Codepoint> cps = DecodeText(text);
  switch (kind_) {
    case Kind::kGpt2:
      SplitWith(MatchGpt2, text, cps, 0, cps.size(), out);
      break;
    case Kind::kLlama3:
      SplitWith(MatchLlama3Style<3>, text, cps, 0, cps.size(), out);
      break;
    case Kind::kQwen2:
      SplitWith(MatchLlama3Style<1>, text, cps, 0, cps.size(), out);
      break;
    case Kind::kSmolLm: {
      // HF Digits(individual_digits=true) isolates each numeric char before the GPT-2 regex runs
      // on the pieces between them, so lookaheads never see across a digit.
      size_t begin = 0;
      for (size_t i = 0; i <= cps.size(); ++i) {
        if (i < cps.size() && cps[i].cls != CharClass::kNumber) continue;
        SplitWith(MatchGpt2, text, cps, begin, i, out);
        if (i < cps.size()) SplitWith(MatchGpt2, text, cps, i, i + 1, out);
        begin = i + 1;
      }
      break;
    }
  }
}

}  // namespace kvflow
