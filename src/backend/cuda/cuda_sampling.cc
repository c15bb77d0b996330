// Device sampling: the step's logits rows sampled on the GPU (penalties, top-k/p, min-p, logprobs).
#include "backend/cuda/cuda_backend_impl.h"

#include <algorithm>
#include <bit>
#include <vector>

#include <spdlog/fmt/fmt.h>

#include "sampling.h"

namespace kvflow {
namespace cuda_impl {

Status CudaBackend::SampleOnDevice(std::span<const DeviceSampleRow> rows, std::vector<SampledToken>& sampled) {
  const int n = static_cast<int>(rows.size());
  if (n == 0) return Status::Ok();
  auto* host_rows = reinterpret_cast<cuda::SamplingRow*>(sample_staging_.base());
  auto* out_tokens = reinterpret_cast<int32_t*>(sample_staging_.base() + AlignUp(max_seqs_ * sizeof(cuda::SamplingRow)));
  auto* out_logprobs = reinterpret_cast<float*>(out_tokens + max_seqs_);
  auto* out_top_tokens = out_tokens + 2 * max_seqs_;
  auto* out_top_logprobs = reinterpret_cast<float*>(out_top_tokens + max_seqs_ * cuda::kMaxTopLogprobs);
  // Histories only for rows with penalties; suppressed tokens after them.
  std::vector<int32_t> tokens;
  int num_top = 0;
  for (int i = 0; i < n; ++i) {
    const DeviceSampleRow& r = rows[static_cast<size_t>(i)];
    const SamplingParams& p = *r.params;
    cuda::SamplingRow& row = host_rows[i];
    row = cuda::SamplingRow{};
    row.temperature = p.temperature;
    row.top_k = p.top_k;
    row.top_p = p.top_p;
    row.min_p = p.min_p;
    row.repetition_penalty = p.repetition_penalty;
    row.frequency_penalty = p.frequency_penalty;
    row.presence_penalty = p.presence_penalty;
    row.uniform = r.uniform;
    if (p.repetition_penalty != 1.0f || p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f) {
      row.history_offset = static_cast<int32_t>(tokens.size());
      row.prompt_len = static_cast<int32_t>(r.prompt.size());
      row.output_len = static_cast<int32_t>(r.output.size());
      tokens.insert(tokens.end(), r.prompt.begin(), r.prompt.end());
      tokens.insert(tokens.end(), r.output.begin(), r.output.end());
    }
    num_top = std::max(num_top, p.logprobs);
  }
  // Then each row's constraint (the logits processors'): banned tokens, biased tokens, their
  // biases and raw-logit scratch, and allowed-token masks, all 4-byte words in one upload.
  const size_t history_len = tokens.size();
  size_t num_bias = 0;
  for (int i = 0; i < n; ++i) {
    const TokenConstraint* c = rows[static_cast<size_t>(i)].constraint;
    if (c == nullptr) continue;
    host_rows[i].suppress_offset = static_cast<int32_t>(tokens.size() - history_len);
    host_rows[i].suppress_len = static_cast<int32_t>(c->banned().size());
    tokens.insert(tokens.end(), c->banned().begin(), c->banned().end());
    num_bias += c->bias().size();
  }
  const size_t banned_len = tokens.size() - history_len;
  const size_t bias_at = tokens.size();
  tokens.resize(tokens.size() + 3 * num_bias);  // tokens, values, raw scratch
  size_t next_bias = 0;
  for (int i = 0; i < n; ++i) {
    const TokenConstraint* c = rows[static_cast<size_t>(i)].constraint;
    if (c == nullptr || c->bias().empty()) continue;
    host_rows[i].bias_offset = static_cast<int32_t>(next_bias);
    host_rows[i].bias_len = static_cast<int32_t>(c->bias().size());
    for (const TokenBias& b : c->bias()) {
      tokens[bias_at + next_bias] = b.token;
      tokens[bias_at + num_bias + next_bias] = std::bit_cast<int32_t>(b.bias);
      ++next_bias;
    }
  }
  const size_t masks_at = tokens.size();
  for (int i = 0; i < n; ++i) {
    const TokenConstraint* c = rows[static_cast<size_t>(i)].constraint;
    if (c == nullptr || c->mask().empty()) continue;
    const size_t words = (static_cast<size_t>(config_.vocab_size) + 31) / 32;
    host_rows[i].mask_offset = static_cast<int32_t>(tokens.size() - masks_at);
    for (size_t w = 0; w < words; ++w) {
      tokens.push_back(std::bit_cast<int32_t>(w < c->mask().size() ? c->mask()[w] : 0u));  // past the mask: not allowed
    }
  }
  num_top = std::min(num_top, config_.vocab_size);
  if (tokens.size() * sizeof(int32_t) > sample_tokens_arena_.bytes()) {
    KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));  // the old buffer may still be read
    KVFLOW_RETURN_IF_ERROR(sample_tokens_arena_.Allocate(AlignUp(tokens.size() * sizeof(int32_t) * 2, size_t{1} << 16),
                                                         "sampling histories"));
  }
  auto* dev_tokens = reinterpret_cast<int32_t*>(sample_tokens_arena_.base());
  if (!tokens.empty()) {
    KVFLOW_CUDA_RETURN(cudaMemcpyAsync(dev_tokens, tokens.data(), tokens.size() * sizeof(int32_t),
                                       cudaMemcpyHostToDevice, stream_));
  }
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(sample_rows_, host_rows, n * sizeof(cuda::SamplingRow), cudaMemcpyHostToDevice, stream_));
  cuda::SampleArgs a;
  a.logits = logits_;
  a.num_rows = n;
  a.vocab_size = config_.vocab_size;
  a.rows = sample_rows_;
  a.history = dev_tokens;
  a.suppress = banned_len > 0 ? dev_tokens + history_len : nullptr;
  if (num_bias > 0) {
    a.bias_tokens = dev_tokens + bias_at;
    a.bias_values = reinterpret_cast<const float*>(dev_tokens + bias_at + num_bias);
    a.bias_raw = reinterpret_cast<float*>(dev_tokens + bias_at + 2 * num_bias);
  }
  if (tokens.size() > masks_at) a.masks = reinterpret_cast<const uint32_t*>(dev_tokens + masks_at);
  a.num_top_logprobs = num_top;
  a.out_tokens = sampled_tokens_;
  a.out_logprobs = sampled_logprobs_;
  a.out_top_tokens = sampled_top_tokens_;
  a.out_top_logprobs = sampled_top_logprobs_;
  a.workspace = sample_workspace_;
  a.workspace_bytes = sample_workspace_bytes_;
  KVFLOW_KERNEL_RETURN(cuda::SampleFromLogits(a, stream_));
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(out_tokens, sampled_tokens_, n * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(out_logprobs, sampled_logprobs_, n * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  if (num_top > 0) {
    const size_t top = static_cast<size_t>(n) * num_top;
    KVFLOW_CUDA_RETURN(cudaMemcpyAsync(out_top_tokens, sampled_top_tokens_, top * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
    KVFLOW_CUDA_RETURN(cudaMemcpyAsync(out_top_logprobs, sampled_top_logprobs_, top * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  }
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  for (int i = 0; i < n; ++i) {
    SampledToken t;
    t.token = out_tokens[i];
    t.logprob = out_logprobs[i];
    const int k = rows[static_cast<size_t>(i)].params->logprobs;
    for (int j = 0; j < std::min(k, num_top); ++j) {
      t.top_logprobs.push_back({out_top_tokens[i * num_top + j], out_top_logprobs[i * num_top + j]});
    }
    if (t.token < 0 || t.token >= config_.vocab_size) {
      return Status::Internal(fmt::format("device sampler returned token {} for row {}", t.token, i));
    }
    sampled.push_back(std::move(t));
  }
  return Status::Ok();
}

}  // namespace cuda_impl
}  // namespace kvflow
