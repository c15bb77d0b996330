#include "backend/cpu/cpu_backend.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <new>
#include <numeric>
#include <stdexcept>

#include <spdlog/fmt/fmt.h>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/half_gemm.h"
#include "backend/cpu/kv_block_select.h"
#include "backend/cpu/paged_attention.h"
#include "util/thread_pool.h"

namespace kvflow {

CpuBackend::CpuBackend(const ModelConfig& config, LlamaWeights weights, const KvCacheLayout& layout)
    : config_(config),
      weights_(std::move(weights)),
      layout_(layout),
      rope_(ComputeRopeFrequencies(config)),
      local_rope_(ComputeRopeFrequencies(LocalRopeConfig(config))) {}

Result<std::unique_ptr<CpuBackend>> CpuBackend::Create(const ModelConfig& config, LlamaWeights weights,
                                                       const KvCacheLayout& layout, int num_host_blocks,
                                                       int num_threads, cpu::KvElement kv_element, bool kv_offload) {
  KVFLOW_RETURN_IF_ERROR(config.Validate());
  KVFLOW_RETURN_IF_ERROR(cpu::CheckKvElement(kv_element, config.head_dim));
  if (layout.num_layers != config.num_layers || layout.num_kv_heads != config.num_kv_heads ||
      layout.head_dim != config.head_dim || layout.num_blocks <= 0 || layout.block_size <= 0 ||
      num_host_blocks < 0) {
    return Status::InvalidArgument("KV cache layout does not match the model config");
  }
  if (kv_offload && num_host_blocks > 0) {
    return Status::InvalidArgument("an offloaded KV pool lives in host memory already: it has no swap space");
  }
  if (weights.layers.size() != static_cast<size_t>(config.num_layers)) {
    return Status::InvalidArgument("the weights have " + std::to_string(weights.layers.size()) +
                                   " layers, the config " + std::to_string(config.num_layers));
  }
  KVFLOW_RETURN_IF_ERROR(CheckFamilyWeights(config, weights));
  cpu::InitBlas();
  std::unique_ptr<CpuBackend> backend(new CpuBackend(config, std::move(weights), layout));
  backend->pool_ = std::make_unique<ThreadPool>(std::max(1, num_threads));
  backend->kv_element_ = kv_element;
  backend->resident_begin_ = layout.num_blocks;
  const size_t bytes = cpu::KvPoolBytes(kv_element, layout.layer_stride() * static_cast<size_t>(layout.num_layers));
  try {
    // Zeroed: a slot read before it is written (a bug) gives finite garbage, never NaN from stale memory.
    backend->key_cache_.reset(new uint8_t[bytes]());
    backend->value_cache_.reset(new uint8_t[bytes]());
    if (kv_offload) {
      const size_t staging = cpu::KvPoolBytes(kv_element, layout.layer_stride() * KvStagingLedger::kBuffers);
      backend->staging_key_.reset(new uint8_t[staging]());
      backend->staging_value_.reset(new uint8_t[staging]());
    }
    backend->host_layout_ = layout;
    backend->host_layout_.num_blocks = num_host_blocks;
    const size_t host_bytes =
        cpu::KvPoolBytes(kv_element, backend->host_layout_.layer_stride() * static_cast<size_t>(layout.num_layers));
    if (host_bytes > 0) {
      backend->host_key_cache_.reset(new uint8_t[host_bytes]);
      backend->host_value_cache_.reset(new uint8_t[host_bytes]);
    }
  } catch (const std::bad_alloc&) {
    return Status::OutOfMemory(fmt::format("cannot allocate a KV cache of {} blocks ({:.1f} MiB)",
                                           layout.num_blocks, 2.0 * bytes / (1 << 20)));
  }
  return backend;
}

uint8_t* CpuBackend::Staging(int kv, int layer) const {
  uint8_t* base = kv == 0 ? staging_key_.get() : staging_value_.get();
  return base + cpu::KvPoolBytes(kv_element_, static_cast<size_t>(layer % KvStagingLedger::kBuffers) * layout_.layer_stride());
}

uint8_t* CpuBackend::Pool(KvTier tier, int kv, int layer) const {
  if (tier == KvTier::kHost) {
    uint8_t* base = kv == 0 ? host_key_cache_.get() : host_value_cache_.get();
    return base + cpu::KvPoolBytes(kv_element_, static_cast<size_t>(layer) * host_layout_.layer_stride());
  }
  uint8_t* base = kv == 0 ? key_cache_.get() : value_cache_.get();
  return base + cpu::KvPoolBytes(kv_element_, static_cast<size_t>(layer) * layout_.layer_stride());
}

std::string CpuBackend::Describe() const {
  const WeightMatrix& wqkv = weights_.layers.front().wqkv;
  const bool half = !wqkv.parts.empty() && cpu::IsHalfWeightType(wqkv.parts.front().dtype);
  const std::string weights = weights_.all_f32() ? std::string("fp32")
                                                 : "weights " + wqkv.FormatName() + " (" +
                                                       (half ? cpu::HalfKernelIsa() : cpu::QuantKernelIsa()) + ")";
  const double pool_mib = 2.0 * cpu::KvPoolBytes(kv_element_, layout_.layer_stride() * layout_.num_layers) / (1 << 20);
  if (kv_offloaded()) {
    return fmt::format("cpu ({}, {} threads, {} KV offloaded: host pool {} blocks x {} tokens = {:.1f} MiB, staging "
                       "{} layers = {:.1f} MiB)", weights, pool_->size(), cpu::KvElementName(kv_element_),
                       layout_.num_blocks, layout_.block_size, pool_mib, KvStagingLedger::kBuffers,
                       pool_mib * KvStagingLedger::kBuffers / layout_.num_layers);
  }
  return fmt::format("cpu ({}, {} threads, {} KV pool {} blocks x {} tokens = {:.1f} MiB)", weights, pool_->size(),
                     cpu::KvElementName(kv_element_), layout_.num_blocks, layout_.block_size, pool_mib);
}

Status CpuBackend::CopyBlocks(std::span<const BlockMove> moves, BlockCopyKind kind) {
  KVFLOW_RETURN_IF_ERROR(ValidateBlockMoves(moves, kind, layout_.num_blocks, host_layout_.num_blocks));
  std::vector<KvTransfer> transfers;
  transfers.reserve(moves.size());
  for (const BlockMove& m : moves) {
    KvTransfer t;
    t.src_tier = kind == BlockCopyKind::kHostToDevice ? KvTier::kHost : KvTier::kDevice;
    t.dst_tier = kind == BlockCopyKind::kDeviceToHost ? KvTier::kHost : KvTier::kDevice;
    t.src_block = m.src;
    t.dst_block = m.dst;
    t.num_tokens = layout_.block_size;
    t.layer_end = layout_.num_layers;
    transfers.push_back(t);
  }
  return TransferKv(transfers);
}

Status CpuBackend::TransferKv(std::span<const KvTransfer> transfers) {
  KVFLOW_RETURN_IF_ERROR(ValidateKvTransfers(transfers, layout_, host_layout_.num_blocks));
  // Both tiers share the layout but not the number of blocks, hence Pool's own layer strides.
  // Token ranges are whole rows, so their byte ranges are exact for every element type (q4 too).
  auto bytes = [this](size_t elements) { return cpu::KvPoolBytes(kv_element_, elements); };
  for (const KvTransfer& t : transfers) {
    for (int layer = t.layer_begin; layer < t.layer_end; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        const uint8_t* src = Pool(t.src_tier, kv, layer);
        uint8_t* dst = Pool(t.dst_tier, kv, layer);
        // One kv head's tokens are contiguous inside a block (kv/kv_cache_layout.h).
        for (int h = 0; h < layout_.num_kv_heads; ++h) {
          std::memmove(dst + bytes(layout_.offset(t.dst_block, h, t.dst_offset)),
                       src + bytes(layout_.offset(t.src_block, h, t.src_offset)),
                       bytes(static_cast<size_t>(t.num_tokens) * layout_.head_dim));
        }
      }
    }
  }
  return Status::Ok();
}

Status CpuBackend::RunStep(const ForwardBatch& batch, const LogitsSink& sink,
                           const std::function<Status()>& layers, bool capturable) {
  KVFLOW_RETURN_IF_ERROR(ValidateForwardBatch(batch, config_, layout_));
  if (sink.sampled) return Status::Unsupported("the CPU backend samples on the host");
  ScopedThreadPool use_pool(pool_.get());
  const int64_t T = static_cast<int64_t>(batch.tokens.size());
  try {
    for (Activation a : {Activation::kHidden, Activation::kQkv, Activation::kAttention, Activation::kDelta,
                         Activation::kGateUp, Activation::kMlp}) {
      Storage(a).resize(static_cast<size_t>(T * Width(a)));
    }
    residual_.resize(static_cast<size_t>(T * config_.hidden_size));
    sink.host->resize(static_cast<size_t>(batch.num_logit_rows() * config_.logit_columns()));
    slots_ = ResolveSlotMapping(batch, layout_.block_size);
    view_slots_.resize(batch.seqs.size());
    for (size_t s = 0; s < batch.seqs.size(); ++s) ViewSlots(batch.seqs[s], layout_.block_size, view_slots_[s]);
  } catch (const std::bad_alloc&) {
    return Status::OutOfMemory("cannot allocate activations for a batch of " + std::to_string(T) + " tokens");
  }
  resident_step_ = false;
  if (kv_offloaded()) {
    KVFLOW_ASSIGN_OR_RETURN(resident_step_, CheckOffloadedStep(batch, slots_, resident_begin_, layout_.block_size));
    staged_.Reset();
  }
  batch_ = &batch;
  num_tokens_ = T;
  Status st = layers();
  if (st.ok()) st = Head(sink);
  batch_ = nullptr;
  return st;
}

std::vector<float>& CpuBackend::Storage(Activation which) {
  switch (which) {
    case Activation::kHidden: return hidden_;
    case Activation::kQkv: return qkv_;
    case Activation::kAttention: return attention_;
    case Activation::kDelta: return delta_;
    case Activation::kGateUp: return gate_up_;
    case Activation::kMlp: return mlp_;
    case Activation::kSpeculativeQkv: return speculative_qkv_;
  }
  return hidden_;
}

int64_t CpuBackend::Width(Activation which) const { return ActivationWidth(config_, which); }

const std::vector<float>& CpuBackend::Norm(int layer, LayerWeight which) const {
  const LlamaLayerWeights& w = weights_.layers[static_cast<size_t>(layer)];
  switch (which) {
    case LayerWeight::kFfnNorm: return w.ffn_norm;
    case LayerWeight::kPostAttnNorm: return w.post_attn_norm;
    case LayerWeight::kPostFfnNorm: return w.post_ffn_norm;
    default: return w.attn_norm;
  }
}

const WeightMatrix& CpuBackend::Matrix(int layer, LayerWeight which) const {
  const LlamaLayerWeights& w = weights_.layers[static_cast<size_t>(layer)];
  switch (which) {
    case LayerWeight::kQkv: return w.wqkv;
    case LayerWeight::kO: return w.wo;
    case LayerWeight::kGateUp: return w.w_gate_up;
    case LayerWeight::kDown: return w.w_down;
    case LayerWeight::kAttnNorm:
    case LayerWeight::kFfnNorm:
    case LayerWeight::kPostAttnNorm:
    case LayerWeight::kPostFfnNorm: break;
  }
  throw std::logic_error("CpuBackend::Matrix: a norm is not a matrix");
}

const std::vector<float>& CpuBackend::Bias(int layer, LayerWeight which) const {
  const LlamaLayerWeights& w = weights_.layers[static_cast<size_t>(layer)];
  switch (which) {
    case LayerWeight::kQkv: return w.bqkv;
    case LayerWeight::kO: return w.bo;
    case LayerWeight::kGateUp: return w.b_gate_up;
    case LayerWeight::kDown: return w.b_down;
    case LayerWeight::kAttnNorm:
    case LayerWeight::kFfnNorm:
    case LayerWeight::kPostAttnNorm:
    case LayerWeight::kPostFfnNorm: break;
  }
  throw std::logic_error("CpuBackend::Bias: a norm has no bias");
}

void CpuBackend::Matmul(const WeightMatrix& matrix, const float* x, int64_t M, float* y) {
  const int64_t K = matrix.cols;
  int64_t first_row = 0;
  bool quantized_for_any = false;
  DType quantized_for = DType::kF32;
  for (const WeightPart& part : matrix.parts) {
    if (part.dtype == DType::kF32) {
      cpu::MatmulTransposedB(x, part.f32.data(), y + first_row, M, part.rows, K, false, matrix.rows);
    } else if (cpu::IsHalfWeightType(part.dtype)) {
      cpu::HalfMatmul(part.dtype, x, M, K, part.blocks.data(), part.rows, y + first_row, matrix.rows);
    } else {
      // Parts whose formats share an activation format (a Q4_K_M matrix's Q4_K, Q5_K and Q6_K rows
      // all take Q8_K) reuse one quantization of x.
      if (quantized_for_any && cpu::SameActivationFormat(quantized_for, part.dtype)) {
        quantized_input_.weight_type = part.dtype;
      } else {
        cpu::QuantizeActivations(x, M, K, part.dtype, quantized_input_);
        quantized_for_any = true;
      }
      quantized_for = part.dtype;
      cpu::QuantizedMatmul(quantized_input_, part.blocks.data(), part.rows, y + first_row, matrix.rows, false);
    }
    first_row += part.rows;
  }
}

Status CpuBackend::Embed() {
  const int64_t H = config_.hidden_size;
  // A vocabulary shard holds rows [first, first + count): the other tokens are the other ranks'.
  const int64_t first = config_.vocab_shard_first, count = config_.logit_columns();
  for (int64_t t = 0; t < num_tokens_; ++t) {
    const int64_t row = batch_->tokens[static_cast<size_t>(t)] - first;
    if (row >= 0 && row < count) {
      weights_.embed.DequantizeRow(row, &residual_[t * H]);
    } else {
      std::fill_n(&residual_[t * H], H, 0.0f);
    }
  }
  if (config_.embedding_scale != 1.0f) {
    for (float& x : residual_) x *= config_.embedding_scale;
  }
  return Status::Ok();
}

Status CpuBackend::RmsNorm(int layer, LayerWeight norm, bool add_delta) {
  if (add_delta) KVFLOW_RETURN_IF_ERROR(AddDelta());
  cpu::RmsNorm(residual_.data(), Norm(layer, norm).data(), hidden_.data(), num_tokens_, config_.hidden_size,
               config_.rms_norm_eps);
  return Status::Ok();
}

Status CpuBackend::Linear(int layer, LayerWeight weight, Activation in, Activation out) {
  const WeightMatrix& matrix = Matrix(layer, weight);
  // The speculative buffer is sized on demand: only features that speculate write it.
  if (out == Activation::kSpeculativeQkv) Storage(out).resize(static_cast<size_t>(num_tokens_ * Width(out)));
  Matmul(matrix, Buffer(in), num_tokens_, Buffer(out));
  // The bias joins after the product, whatever format the matrix is in (HF's Linear: x W^T + b).
  const std::vector<float>& bias = Bias(layer, weight);
  if (!bias.empty()) cpu::AddBias(Buffer(out), bias.data(), num_tokens_, matrix.rows);
  return Status::Ok();
}

Status CpuBackend::MoeMlp(int layer) {
  const LlamaLayerWeights& l = weights_.layers[static_cast<size_t>(layer)];
  const int64_t T = num_tokens_, H = config_.hidden_size;
  const int E = config_.num_experts, K = config_.experts_per_token;
  if (E == 0) return Status::InvalidArgument("MoeMlp: the model has no experts");
  router_logits_.resize(static_cast<size_t>(T * E));
  Matmul(l.router, hidden_.data(), T, router_logits_.data());
  // Each token's top-k experts and weights, as HF's sparse MoE blocks: softmax over all experts in
  // fp32, the k largest (ties to the lower index), renormalized if norm_topk_prob.
  // Kept across calls so that decode steps do not allocate: expert -> (token, weight).
  std::vector<std::vector<std::pair<int64_t, float>>>& routed = moe_routed_;
  routed.resize(static_cast<size_t>(E));
  for (auto& tokens : routed) tokens.clear();
  std::vector<int> order(static_cast<size_t>(E));
  std::vector<float> p(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    const float* logits = &router_logits_[static_cast<size_t>(t * E)];
    const float max_logit = *std::max_element(logits, logits + E);
    float sum = 0.0f;
    for (int e = 0; e < E; ++e) sum += p[e] = std::exp(logits[e] - max_logit);
    for (float& v : p) v /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(),
                      [&](int a, int b) { return p[a] != p[b] ? p[a] > p[b] : a < b; });
    float chosen = 0.0f;
    for (int k = 0; k < K; ++k) chosen += p[order[k]];
    for (int k = 0; k < K; ++k) {
      const float w = config_.norm_topk_prob ? p[order[k]] / chosen : p[order[k]];
      routed[static_cast<size_t>(order[k])].emplace_back(t, w);
    }
  }
  // One SwiGLU MLP over `n` rows of `in`, into expert_out_.
  auto swiglu = [&](const WeightMatrix& gate_up, const WeightMatrix& down, const float* in, int64_t n) {
    const int64_t F = down.cols;
    expert_gate_up_.resize(static_cast<size_t>(n * 2 * F));
    expert_act_.resize(static_cast<size_t>(n * F));
    expert_out_.resize(static_cast<size_t>(n * H));
    Matmul(gate_up, in, n, expert_gate_up_.data());
    cpu::SiluMul(expert_gate_up_.data(), expert_act_.data(), n, F);
    Matmul(down, expert_act_.data(), n, expert_out_.data());
  };
  // Expert by expert, over the tokens routed to it: only the chosen experts' weights are read.
  std::fill(delta_.begin(), delta_.begin() + T * H, 0.0f);
  for (int e = 0; e < E; ++e) {
    const auto& tokens = routed[static_cast<size_t>(e)];
    if (tokens.empty()) continue;
    const auto n = static_cast<int64_t>(tokens.size());
    expert_in_.resize(static_cast<size_t>(n * H));
    for (int64_t i = 0; i < n; ++i) {
      std::copy_n(&hidden_[static_cast<size_t>(tokens[i].first * H)], H, &expert_in_[static_cast<size_t>(i * H)]);
    }
    swiglu(l.expert_gate_up[static_cast<size_t>(e)], l.expert_down[static_cast<size_t>(e)], expert_in_.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      float* d = &delta_[static_cast<size_t>(tokens[i].first * H)];
      const float* o = &expert_out_[static_cast<size_t>(i * H)];
      const float w = tokens[i].second;
      for (int64_t j = 0; j < H; ++j) d[j] += w * o[j];
    }
  }
  if (!l.shared_gate_up.empty()) {  // Qwen2-MoE: every token's shared expert, scaled by sigmoid(gate . x)
    swiglu(l.shared_gate_up, l.shared_down, hidden_.data(), T);
    for (int64_t t = 0; t < T; ++t) {
      const float* x = &hidden_[static_cast<size_t>(t * H)];
      float gate = 0.0f;
      for (int64_t j = 0; j < H; ++j) gate += l.shared_gate[static_cast<size_t>(j)] * x[j];
      const float w = 1.0f / (1.0f + std::exp(-gate));
      float* d = &delta_[static_cast<size_t>(t * H)];
      const float* o = &expert_out_[static_cast<size_t>(t * H)];
      for (int64_t j = 0; j < H; ++j) d[j] += w * o[j];
    }
  }
  return Status::Ok();
}

Status CpuBackend::QkNorm(int layer) {
  const LlamaLayerWeights& l = weights_.layers[static_cast<size_t>(layer)];
  if (l.q_norm.empty()) return Status::InvalidArgument("QkNorm: the model has no q/k norms");
  const int64_t D = config_.head_dim, NH = config_.num_heads, KV = config_.num_kv_heads;
  const int64_t row = Width(Activation::kQkv);
  // Per head (Qwen3), or one norm over all of q and one over all of k (OLMoE).
  const bool per_head = config_.qk_norm_per_head;
  cpu::HeadRmsNorm(qkv_.data(), row, 0, num_tokens_, per_head ? NH : 1, per_head ? D : NH * D, l.q_norm.data(),
                   config_.rms_norm_eps);
  cpu::HeadRmsNorm(qkv_.data(), row, NH * D, num_tokens_, per_head ? KV : 1, per_head ? D : KV * D, l.k_norm.data(),
                   config_.rms_norm_eps);
  return Status::Ok();
}

Status CpuBackend::Rotary(int layer) {
  const int64_t D = config_.head_dim, NH = config_.num_heads, KV = config_.num_kv_heads;
  const RopeFrequencies& rope =
      config_.local_rope_theta > 0.0f && !config_.IsGlobalLayer(layer) ? local_rope_ : rope_;
  const int64_t row = Width(Activation::kQkv);
  ParallelFor(num_tokens_, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      float* qk = &qkv_[t * row];
      const int pos = batch_->positions[static_cast<size_t>(t)];
      // Q heads, then K heads: one run of NH + KV heads.
      for (int64_t h = 0; h < NH + KV; ++h) ApplyRope(qk + h * D, static_cast<int>(D), pos, rope);
    }
  });
  return Status::Ok();
}

Status CpuBackend::WriteKv(int layer) {
  const int64_t D = config_.head_dim, NH = config_.num_heads, KV = config_.num_kv_heads;
  cpu::WriteKvCache(slots_, layout_, qkv_.data() + NH * D, qkv_.data() + (NH + KV) * D, Width(Activation::kQkv),
                    kv_element_, Pool(KvTier::kDevice, 0, layer), Pool(KvTier::kDevice, 1, layer));
  if (staged_step()) {
    // Written through: the host pool keeps every token, the staging buffer serves this layer's attention.
    cpu::WriteKvCache(slots_, layout_, qkv_.data() + NH * D, qkv_.data() + (NH + KV) * D, Width(Activation::kQkv),
                      kv_element_, Staging(0, layer), Staging(1, layer));
    offload_stats_.bytes_written += num_tokens_ * kv_token_bytes();
  }
  return Status::Ok();
}

Status CpuBackend::Attention(int layer) {
  if (staged_step()) KVFLOW_RETURN_IF_ERROR(EnsureStaged(layer, {}));
  RunAttention(layer, view_slots_);
  return Status::Ok();
}

Status CpuBackend::KeepResident(BlockId first) {
  if (!kv_offloaded()) return Status::Unsupported("resident blocks of a KV pool that is not offloaded");
  if (batch_ != nullptr) return Status::Internal("KeepResident inside a step");
  if (first < 0 || first > layout_.num_blocks) {
    return Status::InvalidArgument("resident blocks from " + std::to_string(first) + " of a pool of " +
                                   std::to_string(layout_.num_blocks));
  }
  resident_begin_ = first;
  return Status::Ok();
}

Status CpuBackend::PrefetchKv(int layer, std::span<const KvHeadSelection> selection) {
  if (!staged_step()) return Status::Ok();
  if (batch_ == nullptr) return Status::Internal("KV prefetch outside a step");
  if (layer < 0 || layer >= config_.num_layers) return Status::InvalidArgument("KV prefetch: no such layer");
  if (!selection.empty()) KVFLOW_RETURN_IF_ERROR(ValidateKvHeadSelections(selection, *batch_, layout_));
  KVFLOW_RETURN_IF_ERROR(RefuseSpeculatedSelections(selection, Describe()));
  StageKv(layer, selection);
  staged_.Record(layer, selection, batch_->seqs.size());
  offload_stats_.prefetches += 1;
  return Status::Ok();
}

Status CpuBackend::EnsureStaged(int layer, std::span<const KvHeadSelection> selection) {
  KVFLOW_ASSIGN_OR_RETURN(const bool staged, staged_.Holds(layer, selection, batch_->seqs.size()));
  if (staged) return Status::Ok();
  StageKv(layer, selection);
  staged_.Record(layer, selection, batch_->seqs.size());
  offload_stats_.on_demand_fetches += 1;
  return Status::Ok();
}

void CpuBackend::HeadReadLists(std::span<const KvHeadSelection> selection) {
  const int KV = layout_.num_kv_heads;
  head_view_slots_.resize(batch_->seqs.size() * static_cast<size_t>(KV));
  for (size_t s = 0; s < batch_->seqs.size(); ++s) {
    const bool view = selection.empty() || selection[s].per_head == 0;
    for (int h = 0; h < KV; ++h) {
      std::vector<int64_t>& list = head_view_slots_[s * KV + h];
      if (view) {
        list = view_slots_[s];
      } else {
        const KvHeadSelection& sel = selection[s];
        const auto first = sel.slots.begin() + static_cast<std::ptrdiff_t>(h) * sel.per_head;
        list.assign(first, first + sel.per_head);
      }
    }
  }
}

void CpuBackend::StageKv(int layer, std::span<const KvHeadSelection> selection) {
  const auto start = std::chrono::steady_clock::now();
  const int KV = layout_.num_kv_heads, bs = layout_.block_size;
  const size_t row_bytes = cpu::KvPoolBytes(kv_element_, static_cast<size_t>(layout_.head_dim));
  const size_t block_bytes = cpu::KvPoolBytes(kv_element_, layout_.block_stride());
  // Byte ranges, the same in the pool and the staging buffer (one layout), of K and of V alike.
  struct Range {
    size_t offset, bytes;
  };
  std::vector<Range> ranges;
  constexpr size_t kMaxRange = size_t{64} << 10;  // splits long runs across the threads
  for (size_t s = 0; s < batch_->seqs.size(); ++s) {
    const SequenceSlice& slice = batch_->seqs[s];
    if (selection.empty() || selection[s].per_head == 0) {
      // A view: whole blocks of the cached tokens, runs of consecutive blocks as one range. The
      // step's own tokens in the last block come along stale; WriteKv stages them (before a
      // prefetch's attention, and before an on-demand fetch, which then copies them fresh).
      const int32_t cached = slice.context_len - slice.num_tokens;
      const int32_t n = (cached + bs - 1) / bs;
      for (int32_t b = 0; b < n;) {
        int32_t run = 1;
        while (b + run < n && slice.block_table[static_cast<size_t>(b + run)] == slice.block_table[static_cast<size_t>(b)] + run) ++run;
        const size_t first = static_cast<size_t>(slice.block_table[static_cast<size_t>(b)]) * block_bytes;
        for (size_t done = 0; done < run * block_bytes; done += kMaxRange) {
          ranges.push_back({first + done, std::min(kMaxRange, run * block_bytes - done)});
        }
        b += run;
      }
      continue;
    }
    // A selection: per KV head, runs of consecutive slots in one block (a head's rows are
    // contiguous there); the step's own token, last in each list, is WriteKv's.
    const KvHeadSelection& sel = selection[s];
    for (int h = 0; h < KV; ++h) {
      const int64_t* list = sel.slots.data() + static_cast<size_t>(h) * sel.per_head;
      const int32_t cached = sel.per_head - std::min(sel.per_head, slice.num_tokens);
      for (int32_t i = 0; i < cached;) {
        int32_t n = 1;
        while (i + n < cached && list[i + n] == list[i] + n && list[i + n] % bs != 0) ++n;
        ranges.push_back({cpu::KvPoolBytes(kv_element_, layout_.offset(static_cast<int>(list[i] / bs), h,
                                                                       static_cast<int>(list[i] % bs))),
                          n * row_bytes});
        i += n;
      }
    }
  }
  const uint8_t* pool[2] = {Pool(KvTier::kDevice, 0, layer), Pool(KvTier::kDevice, 1, layer)};
  uint8_t* staging[2] = {Staging(0, layer), Staging(1, layer)};
  ParallelFor(static_cast<int64_t>(ranges.size()), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const Range& range = ranges[static_cast<size_t>(r)];
      for (int kv = 0; kv < 2; ++kv) std::memcpy(staging[kv] + range.offset, pool[kv] + range.offset, range.bytes);
    }
  }, 0, 16);
  size_t total = 0;
  for (const Range& range : ranges) total += range.bytes;
  offload_stats_.bytes_fetched += 2 * static_cast<int64_t>(total);
  offload_stats_.fetch_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void CpuBackend::RunAttention(int layer, std::span<const std::vector<int64_t>> view_slots) {
  cpu::AttentionIo io;
  io.query = qkv_.data();
  io.query_row_stride = Width(Activation::kQkv);
  io.out = attention_.data();
  io.out_row_stride = Width(Activation::kAttention);
  io.window = config_.LayerWindow(layer);
  io.softcap = config_.attn_logit_softcap;
  const float scale = config_.AttentionScale();
  // An offloaded pool's attention reads the layer's staging buffer (EnsureStaged filled it).
  const bool staged = staged_step();
  cpu::PagedAttention(*batch_, view_slots, layout_, config_.num_heads, io, kv_element_,
                      staged ? Staging(0, layer) : Pool(KvTier::kDevice, 0, layer),
                      staged ? Staging(1, layer) : Pool(KvTier::kDevice, 1, layer), scale);
}

Result<std::span<float>> CpuBackend::HostActivation(Activation which) {
  if (batch_ == nullptr) return Status::Internal("activation access outside a step");
  std::vector<float>& buffer = Storage(which);
  return std::span<float>(buffer.data(), static_cast<size_t>(num_tokens_ * Width(which)));
}

Result<std::span<float>> CpuBackend::HostResidual() {
  if (batch_ == nullptr) return Status::Internal("residual stream access outside a step");
  return std::span<float>(residual_.data(), static_cast<size_t>(num_tokens_ * config_.hidden_size));
}

Status CpuBackend::ReadActivationRows(Activation which, int64_t first_row, int64_t rows, std::span<float> out) {
  if (batch_ == nullptr) return Status::Internal("activation read outside a step");
  const int64_t width = Width(which);
  const std::vector<float>& buffer = Storage(which);
  if (first_row < 0 || rows < 0 || (first_row + rows) * width > static_cast<int64_t>(buffer.size()) ||
      static_cast<int64_t>(out.size()) < rows * width) {
    return Status::InvalidArgument("activation read outside the step's rows");
  }
  std::copy_n(buffer.data() + first_row * width, rows * width, out.data());
  return Status::Ok();
}

Status CpuBackend::ReadKv(int layer, int kv, std::span<const int64_t> slots, std::span<float> out) {
  if (layer < 0 || layer >= config_.num_layers || kv < 0 || kv > 1) return Status::InvalidArgument("KV read: no such layer");
  const int64_t row = static_cast<int64_t>(layout_.num_kv_heads) * layout_.head_dim;
  if (static_cast<int64_t>(out.size()) < static_cast<int64_t>(slots.size()) * row) {
    return Status::InvalidArgument("KV read: output too small");
  }
  const int64_t pool_slots = static_cast<int64_t>(layout_.num_blocks) * layout_.block_size;
  for (int64_t slot : slots) {
    if (slot < 0 || slot >= pool_slots) return Status::InvalidArgument("KV read: slot " + std::to_string(slot) + " outside the pool");
  }
  cpu::ReadKvRows(slots, layout_, kv_element_, Pool(KvTier::kDevice, kv, layer), out.data());
  return Status::Ok();
}

Status CpuBackend::PackKv(int layer, std::span<const int64_t> slots, std::span<std::byte> out) {
  KVFLOW_RETURN_IF_ERROR(ValidateKvPack(layer, slots, out.size(), *this));
  CopyPacked(layer, slots, out.data(), nullptr);
  return Status::Ok();
}

Status CpuBackend::UnpackKv(int layer, std::span<const int64_t> slots, std::span<const std::byte> in) {
  KVFLOW_RETURN_IF_ERROR(ValidateKvPack(layer, slots, in.size(), *this));
  CopyPacked(layer, slots, nullptr, in.data());
  return Status::Ok();
}

void CpuBackend::CopyPacked(int layer, std::span<const int64_t> slots, std::byte* pack_to, const std::byte* unpack_from) {
  const int64_t n = static_cast<int64_t>(slots.size());
  const size_t row_bytes = cpu::KvPoolBytes(kv_element_, static_cast<size_t>(layout_.head_dim));
  const std::vector<KvSlotRun> runs = KvSlotRuns(slots, layout_.block_size);
  for (int kv = 0; kv < 2; ++kv) {
    uint8_t* pool = Pool(KvTier::kDevice, kv, layer);
    for (int h = 0; h < layout_.num_kv_heads; ++h) {
      const size_t head_at = static_cast<size_t>((kv * layout_.num_kv_heads + h) * n) * row_bytes;
      for (const KvSlotRun& run : runs) {
        const int block = static_cast<int>(run.first_slot / layout_.block_size);
        const int offset = static_cast<int>(run.first_slot % layout_.block_size);
        uint8_t* in_pool = pool + cpu::KvPoolBytes(kv_element_, layout_.offset(block, h, offset));
        const size_t at = head_at + static_cast<size_t>(run.index) * row_bytes;
        const size_t bytes = static_cast<size_t>(run.length) * row_bytes;
        if (unpack_from != nullptr) {
          std::memcpy(in_pool, unpack_from + at, bytes);
        } else {
          std::memcpy(pack_to + at, in_pool, bytes);
        }
      }
    }
  }
}

Status CpuBackend::AttentionOverSelection(int layer, std::span<const KvHeadSelection> selection) {
  if (batch_ == nullptr) return Status::Internal("attention outside a step");
  KVFLOW_RETURN_IF_ERROR(ValidateKvHeadSelections(selection, *batch_, layout_));
  KVFLOW_RETURN_IF_ERROR(RefuseSpeculatedSelections(selection, Describe()));
  if (config_.sliding_window > 0) {
    return Status::Unsupported("attention over selected tokens in a model with a sliding window");
  }
  if (staged_step()) KVFLOW_RETURN_IF_ERROR(EnsureStaged(layer, selection));
  HeadReadLists(selection);
  RunAttention(layer, head_view_slots_);
  return Status::Ok();
}

Status CpuBackend::ResetKvBlockScores(int64_t size) {
  if (size < 0) return Status::InvalidArgument("chunk scoring: negative buffer size");
  if (static_cast<int64_t>(block_scores_.size()) < size) block_scores_.resize(static_cast<size_t>(size));
  std::fill(block_scores_.begin(), block_scores_.begin() + size, 0.0f);
  return Status::Ok();
}

Status CpuBackend::ScoreKvBlocks(int layer, std::span<const KvBlockScoreJob> jobs) {
  if (batch_ == nullptr) return Status::Internal("chunk scoring outside a step");
  if (layer < 0 || layer >= config_.num_layers) return Status::InvalidArgument("chunk scoring: layer out of range");
  KVFLOW_RETURN_IF_ERROR(cpu::ValidateKvBlockScoreJobs(jobs, layout_, num_tokens_,
                                                       static_cast<int64_t>(block_scores_.size())));
  cpu::ScoreKvBlocks(jobs, layout_, config_.num_heads, qkv_.data(), Width(Activation::kQkv), kv_element_,
                     Pool(KvTier::kDevice, 0, layer), block_scores_);
  return Status::Ok();
}

Status CpuBackend::SelectTopKvBlocks(std::span<const KvBlockSelectJob> jobs, std::vector<int32_t>& chosen) {
  chosen.clear();
  KVFLOW_RETURN_IF_ERROR(cpu::ValidateKvBlockSelectJobs(jobs, static_cast<int64_t>(block_scores_.size())));
  cpu::SelectTopKvBlocks(jobs, block_scores_, chosen);
  return Status::Ok();
}

Status CpuBackend::ReadKvBlockScores(int64_t offset, std::span<float> out) {
  if (offset < 0 || offset + static_cast<int64_t>(out.size()) > static_cast<int64_t>(block_scores_.size())) {
    return Status::InvalidArgument("chunk scores: read outside the buffer");
  }
  std::copy_n(block_scores_.begin() + offset, out.size(), out.begin());
  return Status::Ok();
}

Status CpuBackend::SiluMul() {
  cpu::SiluMul(gate_up_.data(), mlp_.data(), num_tokens_, config_.intermediate_size);
  return Status::Ok();
}

Status CpuBackend::GeluTanhMul() {
  cpu::GeluTanhMul(gate_up_.data(), mlp_.data(), num_tokens_, config_.intermediate_size);
  return Status::Ok();
}

Status CpuBackend::NormDelta(int layer, LayerWeight norm) {
  if (norm != LayerWeight::kPostAttnNorm && norm != LayerWeight::kPostFfnNorm) {
    return Status::InvalidArgument("NormDelta takes a post-attention or post-MLP norm");
  }
  if (!config_.sandwich_norms) return NotSupported("post-attention and post-MLP norms in this model");
  // In place: RmsNorm reads each row whole before it writes it.
  cpu::RmsNorm(delta_.data(), Norm(layer, norm).data(), delta_.data(), num_tokens_, config_.hidden_size,
               config_.rms_norm_eps);
  return Status::Ok();
}

Status CpuBackend::AddDelta() {
  const int64_t n = num_tokens_ * config_.hidden_size;
  for (int64_t i = 0; i < n; ++i) residual_[i] += delta_[i];
  return Status::Ok();
}

Status CpuBackend::ReadFinalHidden(int64_t first_row, int64_t rows, std::span<float> out) {
  const int64_t H = config_.hidden_size;
  if (first_row < 0 || rows < 0 || (first_row + rows) * H > static_cast<int64_t>(final_rows_.size()) ||
      static_cast<int64_t>(out.size()) < rows * H) {
    return Status::InvalidArgument("final hidden rows outside the last step's logit rows");
  }
  std::copy_n(final_rows_.begin() + first_row * H, rows * H, out.begin());
  return Status::Ok();
}

// Only the rows that need logits go through the final norm and the (large) output matrix.
Status CpuBackend::Head(const LogitsSink& sink) {
  const int64_t rows = batch_->num_logit_rows();
  final_rows_.clear();  // ReadFinalHidden never sees an earlier step's rows
  if (rows == 0) return Status::Ok();
  const int64_t H = config_.hidden_size;
  if (weights_.final_norm.size() != static_cast<size_t>(H) || weights_.output_matrix().empty()) {
    return Status::InvalidArgument("this backend holds no LM head (a pipeline stage before the last): it makes no logits");
  }
  final_rows_.resize(static_cast<size_t>(rows * H));
  int64_t row = 0;
  for (const SequenceSlice& s : batch_->seqs) {
    if (s.logits == LogitsMode::kNone) continue;
    const int64_t first = s.logits == LogitsMode::kLast ? s.token_offset + s.num_tokens - 1 : s.token_offset;
    const int64_t count = s.logits == LogitsMode::kLast ? 1 : s.num_tokens;
    std::memcpy(&final_rows_[row * H], &residual_[first * H], count * H * sizeof(float));
    row += count;
  }
  cpu::RmsNorm(final_rows_.data(), weights_.final_norm.data(), final_rows_.data(), rows, H, config_.rms_norm_eps);
  Matmul(weights_.output_matrix(), final_rows_.data(), rows, sink.host->data());
  if (const float cap = config_.final_logit_softcap; cap > 0.0f) {
    float* logits = sink.host->data();
    for (int64_t i = 0; i < rows * config_.logit_columns(); ++i) logits[i] = cap * std::tanh(logits[i] / cap);
  }
  return Status::Ok();
}

}  // namespace kvflow
