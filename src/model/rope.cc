#include "model/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace kvflow {
namespace {

std::vector<double> DefaultInvFreq(double base, int dim) {
  std::vector<double> inv(static_cast<size_t>(dim / 2));
  for (int i = 0; i < dim / 2; ++i) inv[i] = 1.0 / std::pow(base, (2.0 * i) / dim);
  return inv;
}

void Llama3Scale(std::vector<double>& inv, const RopeScaling& s) {
  const double old_ctx = s.original_max_position_embeddings;
  const double low_freq_wavelen = old_ctx / s.low_freq_factor;
  const double high_freq_wavelen = old_ctx / s.high_freq_factor;
  for (double& f : inv) {
    const double wavelen = 2.0 * std::numbers::pi / f;
    if (wavelen > low_freq_wavelen) {
      f = f / s.factor;
    } else if (wavelen >= high_freq_wavelen) {
      const double smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      f = (1.0 - smooth) * f / s.factor + smooth * f;
    }
  }
}

// HF `_compute_yarn_parameters`.
float YarnScale(std::vector<double>& inv, double base, int dim, const RopeScaling& s, int max_pos) {
  const double orig = s.original_max_position_embeddings > 0 ? s.original_max_position_embeddings : max_pos;
  auto correction_dim = [&](double rotations) {
    return dim * std::log(orig / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(base));
  };
  double low = std::floor(correction_dim(s.beta_fast));
  double high = std::ceil(correction_dim(s.beta_slow));
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  for (size_t i = 0; i < inv.size(); ++i) {
    const double extrapolation = inv[i];
    const double interpolation = inv[i] / s.factor;
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double extrapolation_factor = 1.0 - ramp;
    inv[i] = interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor;
  }
  if (s.attention_factor > 0.0f) return s.attention_factor;
  return s.factor <= 1.0f ? 1.0f : static_cast<float>(0.1 * std::log(s.factor) + 1.0);
}

}  // namespace

void SelectRopeFactorsForContext(ModelConfig& config, int64_t max_model_len) {
  RopeScaling& s = config.rope_scaling;
  if (s.type == RopeScaling::Type::kLongRope) s.long_factors = max_model_len > s.original_max_position_embeddings;
}

ModelConfig LocalRopeConfig(const ModelConfig& config) {
  ModelConfig local = config;
  if (config.local_rope_theta > 0.0f) {
    local.rope_theta = config.local_rope_theta;
    local.rope_scaling = RopeScaling{};
  }
  return local;
}

RopeFrequencies ComputeRopeFrequencies(const ModelConfig& config) {
  const int dim = config.head_dim;
  const RopeScaling& s = config.rope_scaling;
  double base = config.rope_theta;
  RopeFrequencies out;
  std::vector<double> inv;
  switch (s.type) {
    case RopeScaling::Type::kNone:
      inv = DefaultInvFreq(base, dim);
      break;
    case RopeScaling::Type::kLinear:
      inv = DefaultInvFreq(base, dim);
      for (double& f : inv) f /= s.factor;
      break;
    case RopeScaling::Type::kDynamic: {
      const double max_pos = config.max_position_embeddings;
      const double max_len = max_pos * s.factor;
      base *= std::pow((s.factor * max_len / max_pos) - (s.factor - 1.0), dim / (dim - 2.0));
      inv = DefaultInvFreq(base, dim);
      break;
    }
    case RopeScaling::Type::kLlama3:
      inv = DefaultInvFreq(base, dim);
      Llama3Scale(inv, s);
      break;
    case RopeScaling::Type::kYarn:
      inv = DefaultInvFreq(base, dim);
      out.attention_scale = YarnScale(inv, base, dim, s, config.max_position_embeddings);
      break;
    case RopeScaling::Type::kLongRope: {
      // HF's Phi3LongRoPEScaledRotaryEmbedding: inv_freq = 1 / (factor_i * base^(2i / dim)), in
      // fp32 as it computes them; cos and sin times sqrt(1 + ln(scale) / ln(original)).
      const std::vector<float>& factors = s.long_factors ? s.long_factor : s.short_factor;
      inv.resize(static_cast<size_t>(dim / 2));
      for (int i = 0; i < dim / 2; ++i) {
        const float power = std::pow(static_cast<float>(base), static_cast<float>(2 * i) / static_cast<float>(dim));
        inv[static_cast<size_t>(i)] = 1.0f / (factors[static_cast<size_t>(i)] * power);
      }
      // A GGUF states the scale (attention_factor: the converter's value of the same formula).
      const double original = s.original_max_position_embeddings;
      const double scale = config.max_position_embeddings / original;
      out.attention_scale = s.attention_factor > 0.0f ? s.attention_factor
                            : scale <= 1.0            ? 1.0f
                                                      : static_cast<float>(std::sqrt(1.0 + std::log(scale) / std::log(original)));
      break;
    }
  }
  out.inv_freq.assign(inv.begin(), inv.end());
  return out;
}

void ApplyRope(float* head, int head_dim, int position, const RopeFrequencies& freqs) {
  const int half = head_dim / 2;
  for (int i = 0; i < half; ++i) {
    // Angle in float, as HF computes (position * inv_freq) in fp32.
    const float angle = static_cast<float>(position) * freqs.inv_freq[static_cast<size_t>(i)];
    const float c = std::cos(angle) * freqs.attention_scale;
    const float s = std::sin(angle) * freqs.attention_scale;
    const float x0 = head[i];
    const float x1 = head[i + half];
    head[i] = x0 * c - x1 * s;
    head[i + half] = x1 * c + x0 * s;
  }
}

}  // namespace kvflow
