#include "backend/cpu/cpu_backend.h"

#include <cmath>
#include <cstring>
#include <new>

#include <spdlog/fmt/fmt.h>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/paged_attention.h"

namespace kvflow {

CpuBackend::CpuBackend(const ModelConfig& config, LlamaWeights weights, const KvCacheLayout& layout)
    : config_(config), weights_(std::move(weights)), layout_(layout), rope_(ComputeRopeFrequencies(config)) {}

Result<std::unique_ptr<CpuBackend>> CpuBackend::Create(const ModelConfig& config, LlamaWeights weights,
                                                       const KvCacheLayout& layout, int num_host_blocks,
                                                       int num_threads) {
  KVFLOW_RETURN_IF_ERROR(config.Validate());
  if (layout.num_layers != config.num_layers || layout.num_kv_heads != config.num_kv_heads ||
      layout.head_dim != config.head_dim || layout.num_blocks <= 0 || layout.block_size <= 0 ||
      num_host_blocks < 0) {
    return Status::InvalidArgument("KV cache layout does not match the model config");
  }
  cpu::SetNumThreads(num_threads);
  std::unique_ptr<CpuBackend> backend(new CpuBackend(config, std::move(weights), layout));
  backend->num_threads_ = num_threads;
  const size_t elements = layout.layer_stride() * static_cast<size_t>(layout.num_layers);
  try {
    backend->key_cache_.assign(elements, 0.0f);
    backend->value_cache_.assign(elements, 0.0f);
    backend->host_layout_ = layout;
    backend->host_layout_.num_blocks = num_host_blocks;
    const size_t host_elements = backend->host_layout_.layer_stride() * static_cast<size_t>(layout.num_layers);
    if (host_elements > 0) {
      backend->host_key_cache_.reset(new float[host_elements]);
      backend->host_value_cache_.reset(new float[host_elements]);
    }
  } catch (const std::bad_alloc&) {
    return Status::OutOfMemory(fmt::format("cannot allocate a KV cache of {} blocks ({:.1f} MiB)",
                                           layout.num_blocks, 2.0 * elements * 4 / (1 << 20)));
  }
  return backend;
}

std::string CpuBackend::Describe() const {
  return fmt::format("cpu (fp32, {} threads, KV pool {} blocks x {} tokens = {:.1f} MiB)", cpu::NumThreads(),
                     layout_.num_blocks, layout_.block_size,
                     2.0 * layout_.layer_stride() * layout_.num_layers * 4 / (1 << 20));
}

Status CpuBackend::CopyBlocks(std::span<const BlockMove> moves, BlockCopyKind kind) {
  KVFLOW_RETURN_IF_ERROR(ValidateBlockMoves(moves, kind, layout_.num_blocks, host_layout_.num_blocks));
  if (moves.empty()) return Status::Ok();
  const bool src_host = kind == BlockCopyKind::kHostToDevice;
  const bool dst_host = kind == BlockCopyKind::kDeviceToHost;
  const size_t block = layout_.block_stride();
  for (int layer = 0; layer < layout_.num_layers; ++layer) {
    const size_t dev_base = static_cast<size_t>(layer) * layout_.layer_stride();
    const size_t host_base = static_cast<size_t>(layer) * host_layout_.layer_stride();
    for (int kv = 0; kv < 2; ++kv) {
      float* dev = (kv == 0 ? key_cache_.data() : value_cache_.data()) + dev_base;
      float* host = (kv == 0 ? host_key_cache_.get() : host_value_cache_.get());
      if (host) host += host_base;
      for (const BlockMove& m : moves) {
        const float* src = (src_host ? host : dev) + static_cast<size_t>(m.src) * block;
        float* dst = (dst_host ? host : dev) + static_cast<size_t>(m.dst) * block;
        std::memcpy(dst, src, block * sizeof(float));
      }
    }
  }
  return Status::Ok();
}

Status CpuBackend::Forward(const ForwardBatch& batch, std::vector<float>& logits) {
  KVFLOW_RETURN_IF_ERROR(ValidateForwardBatch(batch, config_, layout_));
  if (num_threads_ > 0 && cpu::NumThreads() != num_threads_) cpu::SetNumThreads(num_threads_);
  const int64_t T = static_cast<int64_t>(batch.tokens.size());
  const int64_t H = config_.hidden_size, D = config_.head_dim, F = config_.intermediate_size;
  const int64_t NH = config_.num_heads, KV = config_.num_kv_heads, V = config_.vocab_size;
  const int64_t QKV = (NH + 2 * KV) * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));

  try {
    x_.resize(T * H);
    h_.resize(T * H);
    qkv_.resize(T * QKV);
    q_.resize(T * NH * D);
    k_.resize(T * KV * D);
    v_.resize(T * KV * D);
    attn_.resize(T * NH * D);
    gate_up_.resize(T * 2 * F);
    act_.resize(T * F);
    logits.resize(static_cast<size_t>(batch.num_logit_rows() * V));
  } catch (const std::bad_alloc&) {
    return Status::OutOfMemory("cannot allocate activations for a batch of " + std::to_string(T) + " tokens");
  }

  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(&x_[t * H], &weights_.embed[static_cast<size_t>(batch.tokens[t]) * H], H * sizeof(float));
  }

  for (int layer = 0; layer < config_.num_layers; ++layer) {
    const LlamaLayerWeights& w = weights_.layers[static_cast<size_t>(layer)];
    cpu::RmsNorm(x_.data(), w.attn_norm.data(), h_.data(), T, H, config_.rms_norm_eps);
    cpu::MatmulTransposedB(h_.data(), w.wqkv.data(), qkv_.data(), T, QKV, H);

    // Split the fused projection and rotate Q and K.
#pragma omp parallel for schedule(static) if (T > 1)
    for (int64_t t = 0; t < T; ++t) {
      const float* row = &qkv_[t * QKV];
      std::memcpy(&q_[t * NH * D], row, NH * D * sizeof(float));
      std::memcpy(&k_[t * KV * D], row + NH * D, KV * D * sizeof(float));
      std::memcpy(&v_[t * KV * D], row + (NH + KV) * D, KV * D * sizeof(float));
      const int pos = batch.positions[static_cast<size_t>(t)];
      for (int64_t h = 0; h < NH; ++h) ApplyRope(&q_[(t * NH + h) * D], static_cast<int>(D), pos, rope_);
      for (int64_t h = 0; h < KV; ++h) ApplyRope(&k_[(t * KV + h) * D], static_cast<int>(D), pos, rope_);
    }

    float* kc = key_cache_.data() + layer * layout_.layer_stride();
    float* vc = value_cache_.data() + layer * layout_.layer_stride();
    cpu::WriteKvCache(batch, layout_, k_.data(), v_.data(), kc, vc);
    cpu::PagedAttention(batch, layout_, static_cast<int>(NH), q_.data(), kc, vc, scale, attn_.data());

    cpu::MatmulTransposedB(attn_.data(), w.wo.data(), x_.data(), T, H, NH * D, /*accumulate=*/true);
    cpu::RmsNorm(x_.data(), w.ffn_norm.data(), h_.data(), T, H, config_.rms_norm_eps);
    cpu::MatmulTransposedB(h_.data(), w.w_gate_up.data(), gate_up_.data(), T, 2 * F, H);
    cpu::SiluMul(gate_up_.data(), act_.data(), T, F);
    cpu::MatmulTransposedB(act_.data(), w.w_down.data(), x_.data(), T, H, F, /*accumulate=*/true);
  }

  // Only the rows that need logits go through the final norm and the (large) output matrix.
  const int64_t rows = batch.num_logit_rows();
  if (rows == 0) return Status::Ok();
  final_h_.resize(rows * H);
  int64_t row = 0;
  for (const SequenceSlice& s : batch.seqs) {
    if (s.logits == LogitsMode::kNone) continue;
    const int64_t first = s.logits == LogitsMode::kLast ? s.token_offset + s.num_tokens - 1 : s.token_offset;
    const int64_t count = s.logits == LogitsMode::kLast ? 1 : s.num_tokens;
    std::memcpy(&final_h_[row * H], &x_[first * H], count * H * sizeof(float));
    row += count;
  }
  cpu::RmsNorm(final_h_.data(), weights_.final_norm.data(), final_h_.data(), rows, H, config_.rms_norm_eps);
  cpu::MatmulTransposedB(final_h_.data(), weights_.output_matrix().data(), logits.data(), rows, V, H);
  return Status::Ok();
}

}  // namespace kvflow
