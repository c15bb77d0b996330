// UTF-8 decoding that reports invalid input the way Rust's from_utf8_lossy / Python's "replace" do.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kvflow {

struct Utf8Step {
  uint32_t cp;     // the decoded code point, or U+FFFD when !valid
  uint8_t len;     // bytes consumed: the sequence, or the maximal invalid prefix (>= 1)
  bool valid;
  bool truncated;  // invalid only because `s` ended early: more bytes could still complete it
};

// Decodes the sequence starting at s[pos] (pos < s.size()).
inline Utf8Step DecodeUtf8(std::string_view s, size_t pos) {
  const auto b0 = static_cast<uint8_t>(s[pos]);
  if (b0 < 0x80) return {b0, 1, true, false};
  int continuation;
  uint32_t cp;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the next byte; narrower after E0/ED/F0/F4
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    continuation = 1;
    cp = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    continuation = 2;
    cp = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;  // no overlong forms
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    continuation = 3;
    cp = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return {0xFFFD, 1, false, false};
  }
  uint8_t len = 1;
  for (int k = 0; k < continuation; ++k) {
    if (pos + len >= s.size()) return {0xFFFD, len, false, true};
    const auto b = static_cast<uint8_t>(s[pos + len]);
    if (b < lo || b > hi) return {0xFFFD, len, false, false};
    cp = (cp << 6) | (b & 0x3F);
    ++len;
    lo = 0x80;
    hi = 0xBF;
  }
  return {cp, len, true, false};
}

// Whether all of `s` is valid UTF-8.
inline bool IsValidUtf8(std::string_view s) {
  for (size_t pos = 0; pos < s.size();) {
    const Utf8Step step = DecodeUtf8(s, pos);
    if (!step.valid) return false;
    pos += step.len;
  }
  return true;
}

inline void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace kvflow
