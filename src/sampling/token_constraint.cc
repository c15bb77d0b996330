#include "sampling/token_constraint.h"

#include <algorithm>
#include <limits>

namespace kvflow {

void TokenConstraint::Clear() {
  banned_.clear();
  mask_.clear();
  bias_.clear();
}

void TokenConstraint::AllowOnly(std::span<const uint32_t> mask) {
  if (mask_.empty()) {
    mask_.assign(mask.begin(), mask.end());
    return;
  }
  // A word missing from the shorter mask allows nothing.
  if (mask.size() < mask_.size()) mask_.resize(mask.size());
  for (size_t i = 0; i < mask_.size(); ++i) mask_[i] &= mask[i];
}

bool TokenConstraint::Allows(int32_t token) const {
  if (token < 0) return false;
  if (std::find(banned_.begin(), banned_.end(), token) != banned_.end()) return false;
  if (mask_.empty()) return true;
  const size_t word = static_cast<size_t>(token) / 32;
  return word < mask_.size() && ((mask_[word] >> (token % 32)) & 1u) != 0;
}

void TokenConstraint::ApplyTo(std::span<float> logits, std::vector<TokenLogit>* raw) const {
  constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();
  const int64_t vocab = static_cast<int64_t>(logits.size());
  for (int32_t token : banned_) {
    if (token >= 0 && token < vocab) logits[token] = kNegativeInfinity;
  }
  if (!mask_.empty()) {
    for (int64_t t = 0; t < vocab; ++t) {
      const size_t word = static_cast<size_t>(t) / 32;
      if (word >= mask_.size() || ((mask_[word] >> (t % 32)) & 1u) == 0) logits[t] = kNegativeInfinity;
    }
  }
  if (raw != nullptr) raw->clear();
  for (const TokenBias& b : bias_) {
    if (b.token < 0 || b.token >= vocab) continue;
    if (raw != nullptr &&
        std::none_of(raw->begin(), raw->end(), [&](const TokenLogit& r) { return r.token == b.token; })) {
      raw->push_back({b.token, logits[b.token]});
    }
    logits[b.token] += b.bias;
  }
}

}  // namespace kvflow
