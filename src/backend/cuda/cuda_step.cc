// One step: its plan and metadata upload, the forward primitives, the logits head, and CUDA graph replay.
#include "backend/cuda/cuda_backend_impl.h"

#include <algorithm>
#include <cstring>

#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>

#include "activation.h"
#include "bias.h"
#include "embedding.h"
#include "rms_norm.h"
#include "rotary.h"
#include "softcap.h"

namespace kvflow {
namespace cuda_impl {
namespace {

cudaDataType_t CudaDataType(DType t) {
  return t == DType::kF32 ? CUDA_R_32F : t == DType::kF16 ? CUDA_R_16F : CUDA_R_16BF;
}

}  // namespace

int CudaBackend::GraphBucket(int num_seqs) const {
  for (int b : graph_buckets_) {
    if (b >= num_seqs) return b;
  }
  return -1;
}

StepShape CudaBackend::PlanStep(const ForwardBatch& batch, int padded_seqs) {
  StepShape shape;
  StepMetadata& m = host_meta_;
  const int bs = layout_.block_size;
  const int T = static_cast<int>(batch.tokens.size());
  std::copy(batch.tokens.begin(), batch.tokens.end(), m.tokens);
  std::copy(batch.positions.begin(), batch.positions.end(), m.positions);
  const std::vector<int64_t> slots = ResolveSlotMapping(batch, bs);
  std::copy(slots.begin(), slots.end(), m.slot_mapping);
  bool any_slots = false;
  for (const SequenceSlice& s : batch.seqs) {
    if (s.logits == LogitsMode::kLast) {
      m.logit_rows[shape.num_logit_rows++] = s.token_offset + s.num_tokens - 1;
    } else if (s.logits == LogitsMode::kAll) {
      for (int j = 0; j < s.num_tokens; ++j) m.logit_rows[shape.num_logit_rows++] = s.token_offset + j;
    }
    if (s.view.kind == KvView::Kind::kSlots) {
      any_slots = true;  // after the pool-reading rows, below
      continue;
    }
    // Attention reads the slice's view: its whole table or a subset of blocks, with the slice's
    // tokens as the view's last entries.
    const bool full = s.view.kind == KvView::Kind::kFull;
    const std::vector<BlockId>& table = full ? s.block_table : s.view.blocks;
    const int view_len = static_cast<int>(s.view_size());
    const int used_blocks = (view_len + bs - 1) / bs;
    if (s.num_tokens == 1) {
      const int d = shape.num_decode++;
      std::copy_n(table.begin(), used_blocks, m.decode_block_tables + static_cast<size_t>(d) * max_blocks_per_seq_);
      m.decode_context_lens[d] = view_len;
      m.decode_query_rows[d] = s.token_offset;
      shape.max_decode_context = std::max(shape.max_decode_context, view_len);
    } else {
      const int p = shape.num_prefill++;
      std::copy_n(table.begin(), used_blocks, m.prefill_block_tables + static_cast<size_t>(p) * max_blocks_per_seq_);
      m.prefill_query_starts[p] = s.token_offset;
      m.prefill_query_lens[p] = s.num_tokens;
      m.prefill_context_lens[p] = view_len;
      shape.max_prefill_query = std::max(shape.max_prefill_query, s.num_tokens);
    }
  }
  // Slot views: each view's slots fill scratch blocks from a block boundary on (-1 pads the last
  // one; RunStep checked that they fit), and its table is those consecutive scratch blocks.
  int next_block = 0;
  for (size_t i = 0; any_slots && i < batch.seqs.size(); ++i) {
    const SequenceSlice& s = batch.seqs[i];
    if (s.view.kind != KvView::Kind::kSlots) continue;
    const int view_len = static_cast<int>(s.view.slots.size());
    const int used_blocks = (view_len + bs - 1) / bs;
    int32_t* table;
    if (s.num_tokens == 1) {
      const int d = shape.num_decode + shape.num_gathered_decode++;
      table = m.decode_block_tables + static_cast<size_t>(d) * max_blocks_per_seq_;
      m.decode_context_lens[d] = view_len;
      m.decode_query_rows[d] = s.token_offset;
      shape.max_gathered_decode_context = std::max(shape.max_gathered_decode_context, view_len);
    } else {
      const int p = shape.num_prefill + shape.num_gathered_prefill++;
      table = m.prefill_block_tables + static_cast<size_t>(p) * max_blocks_per_seq_;
      m.prefill_query_starts[p] = s.token_offset;
      m.prefill_query_lens[p] = s.num_tokens;
      m.prefill_context_lens[p] = view_len;
      shape.max_gathered_prefill_query = std::max(shape.max_gathered_prefill_query, s.num_tokens);
    }
    for (int b = 0; b < used_blocks; ++b) table[b] = next_block + b;
    int64_t* dst = m.gather_slots + static_cast<size_t>(next_block) * bs;
    std::copy(s.view.slots.begin(), s.view.slots.end(), dst);
    std::fill(dst + view_len, dst + static_cast<size_t>(used_blocks) * bs, int64_t{-1});
    next_block += used_blocks;
  }
  shape.num_gathered_slots = next_block * bs;
  shape.num_tokens = T;
  // Padding rows of a graph bucket: token 0 at position 0, written nowhere, reading block 0.
  for (int d = shape.num_decode; d < padded_seqs; ++d) {
    m.tokens[d] = 0;
    m.positions[d] = 0;
    m.slot_mapping[d] = -1;
    m.decode_block_tables[static_cast<size_t>(d) * max_blocks_per_seq_] = 0;
    m.decode_context_lens[d] = 1;
    m.decode_query_rows[d] = d;
    m.logit_rows[d] = d;
  }
  return shape;
}

namespace {

// Uploads the used part of every metadata array (the device arrays keep their fixed addresses,
// which CUDA graphs captured).
Status UploadMetadata(const StepMetadata& host, const StepMetadata& dev, int tokens, int decode_rows,
                      int prefill_rows, int gathered_slots, int max_blocks, cudaStream_t stream) {
  auto up = [&](auto* dst, const auto* src, size_t count) -> Status {
    if (count == 0) return Status::Ok();
    return CudaStatus(cudaMemcpyAsync(dst, src, count * sizeof(*src), cudaMemcpyHostToDevice, stream),
                      "upload step metadata");
  };
  const size_t table = static_cast<size_t>(max_blocks);
  KVFLOW_RETURN_IF_ERROR(up(dev.tokens, host.tokens, tokens));
  KVFLOW_RETURN_IF_ERROR(up(dev.positions, host.positions, tokens));
  KVFLOW_RETURN_IF_ERROR(up(dev.slot_mapping, host.slot_mapping, tokens));
  KVFLOW_RETURN_IF_ERROR(up(dev.logit_rows, host.logit_rows, tokens));
  KVFLOW_RETURN_IF_ERROR(up(dev.decode_block_tables, host.decode_block_tables, decode_rows * table));
  KVFLOW_RETURN_IF_ERROR(up(dev.decode_context_lens, host.decode_context_lens, decode_rows));
  KVFLOW_RETURN_IF_ERROR(up(dev.decode_query_rows, host.decode_query_rows, decode_rows));
  KVFLOW_RETURN_IF_ERROR(up(dev.prefill_block_tables, host.prefill_block_tables, prefill_rows * table));
  KVFLOW_RETURN_IF_ERROR(up(dev.prefill_query_starts, host.prefill_query_starts, prefill_rows));
  KVFLOW_RETURN_IF_ERROR(up(dev.prefill_query_lens, host.prefill_query_lens, prefill_rows));
  KVFLOW_RETURN_IF_ERROR(up(dev.prefill_context_lens, host.prefill_context_lens, prefill_rows));
  KVFLOW_RETURN_IF_ERROR(up(dev.gather_slots, host.gather_slots, gathered_slots));
  return Status::Ok();
}

}  // namespace

// y[m, n] = x[m, k] * w[n, k]^T with row-major x, w, y: in cuBLAS's column-major terms
// y^T (n x m) = w (k x n, transposed) * x^T (k x m).
Status CudaBackend::Gemm(const void* x, const void* w, void* y, int m, int n, int k, DType out_dtype) {
  const float one = 1.0f, zero = 0.0f;
  const cudaDataType_t in = CudaDataType(dtype_);
  KVFLOW_CUBLAS_RETURN(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, in, k, x, in, k, &zero, y,
                                    CudaDataType(out_dtype), n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return Status::Ok();
}

void* CudaBackend::ActivationBuffer(Activation which) const {
  switch (which) {
    case Activation::kHidden: return hidden_;
    case Activation::kQkv: return qkv_;
    case Activation::kAttention: return attn_;
    case Activation::kDelta: return delta_;
    case Activation::kGateUp: return gate_up_;
    case Activation::kMlp: return act_;
    case Activation::kSpeculativeQkv: return speculative_qkv_;
  }
  return nullptr;
}

int CudaBackend::ActivationWidth(Activation which) const {
  return static_cast<int>(kvflow::ActivationWidth(config_, which));
}

const void* CudaBackend::LayerWeightPtr(int layer, LayerWeight which) const {
  const DeviceLayer& w = layers_[static_cast<size_t>(layer)];
  switch (which) {
    case LayerWeight::kAttnNorm: return w.attn_norm;
    case LayerWeight::kQkv: return w.wqkv;
    case LayerWeight::kO: return w.wo;
    case LayerWeight::kFfnNorm: return w.ffn_norm;
    case LayerWeight::kGateUp: return w.w_gate_up;
    case LayerWeight::kDown: return w.w_down;
    case LayerWeight::kPostAttnNorm: return w.post_attn_norm;
    case LayerWeight::kPostFfnNorm: return w.post_ffn_norm;
  }
  return nullptr;
}

const float* CudaBackend::LayerBiasPtr(int layer, LayerWeight which) const {
  const DeviceLayer& w = layers_[static_cast<size_t>(layer)];
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
  return nullptr;
}

Status CudaBackend::Embed() {
  const int H = config_.hidden_size;
  // A vocabulary shard (tensor parallelism) embeds its own tokens, zeros for the other ranks'.
  const bool shard = config_.vocab_shard_rows > 0;
  KVFLOW_KERNEL_RETURN(cuda::GatherRowsToF32(dtype_, embed_, H, config_.logit_columns(), device_meta_.tokens,
                                             step_.num_tokens, H, residual_, stream_, config_.embedding_scale,
                                             shard ? config_.vocab_shard_first : -1));
  return Status::Ok();
}

Result<DeviceRows> CudaBackend::DeviceActivation(Activation which) {
  if (!in_step_) return Status::Internal("DeviceActivation outside a step");
  DeviceRows rows;
  rows.data = ActivationBuffer(which);
  rows.count = static_cast<int64_t>(step_.num_tokens) * ActivationWidth(which);
  rows.type = dtype_ == DType::kF32 ? DeviceRows::Type::kF32
              : dtype_ == DType::kF16 ? DeviceRows::Type::kF16
                                      : DeviceRows::Type::kBF16;
  return rows;
}

Result<DeviceRows> CudaBackend::DeviceResidual() {
  if (!in_step_) return Status::Internal("DeviceResidual outside a step");
  return DeviceRows{residual_, static_cast<int64_t>(step_.num_tokens) * config_.hidden_size, DeviceRows::Type::kF32};
}

Status CudaBackend::RmsNorm(int layer, LayerWeight norm, bool add_delta) {
  const int T = step_.num_tokens, H = config_.hidden_size;
  const void* weight = LayerWeightPtr(layer, norm);
  if (add_delta) {
    KVFLOW_KERNEL_RETURN(cuda::FusedAddRmsNorm(dtype_, residual_, delta_, weight, hidden_, T, H, config_.rms_norm_eps,
                                               stream_));
  } else {
    KVFLOW_KERNEL_RETURN(cuda::RmsNorm(dtype_, residual_, weight, hidden_, T, H, config_.rms_norm_eps, stream_));
  }
  return Status::Ok();
}

Status CudaBackend::Linear(int layer, LayerWeight weight, Activation in, Activation out) {
  KVFLOW_RETURN_IF_ERROR(Gemm(ActivationBuffer(in), LayerWeightPtr(layer, weight), ActivationBuffer(out),
                              step_.num_tokens, ActivationWidth(out), ActivationWidth(in), dtype_));
  // HF's Linear adds its bias after the product (before RoPE for q/k): one fp32 add per element.
  if (const float* bias = LayerBiasPtr(layer, weight)) {
    KVFLOW_KERNEL_RETURN(cuda::AddBias(dtype_, ActivationBuffer(out), bias, step_.num_tokens, ActivationWidth(out),
                                       stream_));
  }
  return Status::Ok();
}

Status CudaBackend::QkNorm(int layer) {
  const DeviceLayer& l = layers_[static_cast<size_t>(layer)];
  if (l.q_norm == nullptr) return Status::InvalidArgument("QkNorm: the model has no q/k norms");
  const int D = config_.head_dim, NH = config_.num_heads, KV = config_.num_kv_heads;
  const int row = ActivationWidth(Activation::kQkv), T = step_.num_tokens;
  const bool per_head = config_.qk_norm_per_head;  // else one norm over all of q, one over all of k
  KVFLOW_KERNEL_RETURN(cuda::HeadRmsNorm(dtype_, qkv_, row, 0, T, per_head ? NH : 1, per_head ? D : NH * D, l.q_norm,
                                         config_.rms_norm_eps, stream_));
  KVFLOW_KERNEL_RETURN(cuda::HeadRmsNorm(dtype_, qkv_, row, NH * D, T, per_head ? KV : 1, per_head ? D : KV * D,
                                         l.k_norm, config_.rms_norm_eps, stream_));
  return Status::Ok();
}

Status CudaBackend::Rotary(int layer) {
  // Gemma-3's sliding layers take their own base (CpuBackend::Rotary).
  const bool local = config_.local_rope_theta > 0.0f && !config_.IsGlobalLayer(layer);
  KVFLOW_KERNEL_RETURN(cuda::ApplyRotaryEmbedding(dtype_, qkv_, ActivationWidth(Activation::kQkv),
                                                  device_meta_.positions, step_.num_tokens, config_.num_heads,
                                                  config_.num_kv_heads, config_.head_dim,
                                                  local ? local_inv_freq_ : inv_freq_,
                                                  local ? local_attention_scale_ : attention_scale_, stream_));
  return Status::Ok();
}

Status CudaBackend::SiluMul() {
  KVFLOW_KERNEL_RETURN(cuda::SiluAndMul(dtype_, gate_up_, act_, step_.num_tokens, config_.intermediate_size, stream_));
  return Status::Ok();
}

Status CudaBackend::GeluTanhMul() {
  KVFLOW_KERNEL_RETURN(
      cuda::GeluTanhAndMul(dtype_, gate_up_, act_, step_.num_tokens, config_.intermediate_size, stream_));
  return Status::Ok();
}

Status CudaBackend::NormDelta(int layer, LayerWeight norm) {
  const void* weight = LayerWeightPtr(layer, norm);
  if (weight == nullptr) return Status::InvalidArgument("NormDelta: the model has no such norm");
  // One "head" as wide as the row: RMSNorm of the 16-bit delta in place, summed in fp32.
  const int H = config_.hidden_size;
  KVFLOW_KERNEL_RETURN(cuda::HeadRmsNorm(dtype_, delta_, H, 0, step_.num_tokens, 1, H, weight, config_.rms_norm_eps,
                                         stream_));
  return Status::Ok();
}

Status CudaBackend::AddDelta() {
  KVFLOW_KERNEL_RETURN(cuda::AddToResidual(dtype_, residual_, delta_, step_.num_tokens, config_.hidden_size, stream_));
  return Status::Ok();
}

Status CudaBackend::RunLogits(int first_row, int rows) {
  const int H = config_.hidden_size, V = config_.logit_columns();
  KVFLOW_KERNEL_RETURN(cuda::GatherRowsToF32(DType::kF32, residual_, H, max_tokens_, device_meta_.logit_rows + first_row,
                                             rows, H, final_rows_, stream_));
  KVFLOW_KERNEL_RETURN(cuda::RmsNorm(dtype_, final_rows_, final_norm_, final_hidden_, rows, H, config_.rms_norm_eps, stream_));
  KVFLOW_RETURN_IF_ERROR(Gemm(final_hidden_, lm_head_, logits_, rows, V, H, DType::kF32));
  if (const float cap = config_.final_logit_softcap; cap > 0.0f) {  // Gemma-2
    KVFLOW_KERNEL_RETURN(cuda::SoftCap(logits_, static_cast<int64_t>(rows) * V, cap, stream_));
  }
  return Status::Ok();
}

Status CudaBackend::CopyLogitsToHost(int rows, float* dst) {
  const size_t bytes = static_cast<size_t>(rows) * config_.logit_columns() * sizeof(float);
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(host_logits_, logits_, bytes, cudaMemcpyDeviceToHost, stream_));
  // Also where an asynchronous fault of any kernel of the step surfaces.
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  std::memcpy(dst, host_logits_, bytes);
  return Status::Ok();
}

Status CudaBackend::CheckSink(const ForwardBatch& batch, const LogitsSink& sink, int64_t rows) {
  if (!sink.sampled) {
    if (!sink.host) return Status::InvalidArgument("a step needs a logits sink");
    try {
      sink.host->resize(static_cast<size_t>(rows) * config_.logit_columns());
    } catch (const std::bad_alloc&) {
      return Status::OutOfMemory("cannot allocate host memory for the logits");
    }
    return Status::Ok();
  }
  if (config_.vocab_shard_rows > 0) {
    return Status::Unsupported("device sampling over a vocabulary shard: the driver samples the gathered logits");
  }
  if (static_cast<int64_t>(sink.sample_rows.size()) != rows || static_cast<int>(rows) > max_seqs_) {
    return Status::InvalidArgument(fmt::format("device sampling needs one row per logit row, at most {} ({} given for {})",
                                               max_seqs_, sink.sample_rows.size(), rows));
  }
  for (const DeviceSampleRow& r : sink.sample_rows) {
    if (!r.params || r.params->logprobs > kMaxDeviceTopLogprobs || r.params->logprobs < 0) {
      return Status::InvalidArgument("device sampling row without params or with more than 20 logprobs");
    }
  }
  return Status::Ok();
}

Status CudaBackend::RunStep(const ForwardBatch& batch, const LogitsSink& sink, const std::function<Status()>& layers,
                            bool capturable) {
  KVFLOW_RETURN_IF_ERROR(ValidateForwardBatch(batch, config_, layout_));
  const int64_t rows = batch.num_logit_rows();
  KVFLOW_RETURN_IF_ERROR(CheckSink(batch, sink, rows));
  const int T = static_cast<int>(batch.tokens.size());
  if (T == 0) return Status::Ok();
  // The current device is per host thread: a backend may be driven from a thread other than the
  // one that created it (a rank's thread), on a machine with several GPUs.
  KVFLOW_CUDA_RETURN(cudaSetDevice(options_.device));
  const int num_seqs = static_cast<int>(batch.seqs.size());
  // Marks the step (and its batch) for the primitives valid inside `layers` only, and restarts the
  // chunk scoring staging.
  struct StepScope {
    CudaBackend& b;
    StepScope(CudaBackend& backend, const ForwardBatch& batch) : b(backend) {
      b.in_step_ = true;
      b.batch_ = &batch;
      b.block_meta_restart_ = true;
    }
    ~StepScope() {
      b.in_step_ = false;
      b.batch_ = nullptr;
    }
  } step_scope(*this, batch);
  if (T > max_tokens_ || num_seqs > max_seqs_) {
    return Status::InvalidArgument(fmt::format(
        "batch of {} tokens in {} sequences exceeds the CUDA backend's limits ({} tokens, {} sequences)", T, num_seqs,
        max_tokens_, max_seqs_));
  }
  if (speculation_columns_ > 0) KVFLOW_RETURN_IF_ERROR(BeginSpeculationStep());
  resident_step_ = false;
  if (options_.kv_offload) {
    KVFLOW_ASSIGN_OR_RETURN(resident_step_, CheckOffloadedStep(batch, ResolveSlotMapping(batch, layout_.block_size),
                                                               resident_begin_, layout_.block_size));
    // The prefetches are issued per step from the host (their block runs differ step to step).
    capturable = false;
    ledger_.Reset();
    std::fill(std::begin(staged_async_), std::end(staged_async_), false);
  }
  bool all_decode = true;
  int64_t gather_blocks = 0, gather_tokens = 0;
  for (const SequenceSlice& s : batch.seqs) {
    if (s.context_len > max_blocks_per_seq_ * layout_.block_size || s.view_size() > max_blocks_per_seq_ * layout_.block_size) {
      return Status::InvalidArgument(fmt::format("a sequence of {} tokens exceeds max_model_len {}", s.context_len,
                                                 options_.max_model_len));
    }
    const bool slots = s.view.kind == KvView::Kind::kSlots;
    if (slots) {
      gather_tokens += s.view_size();
      gather_blocks += (s.view_size() + layout_.block_size - 1) / layout_.block_size;
    }
    // Slot views gather per step: eager only.
    all_decode = all_decode && s.num_tokens == 1 && s.logits == LogitsMode::kLast && !slots;
  }
  if (gather_blocks > gather_blocks_) {
    return Status::InvalidArgument(fmt::format(
        "the step's KV views of explicit slots gather {} tokens into {} blocks of {} (each view from a block "
        "boundary), more than the {} blocks of scratch that CudaBackendOptions::max_gathered_tokens ({}) provides; "
        "raise max_gathered_tokens or split the step",
        gather_tokens, gather_blocks, layout_.block_size, gather_blocks_,
        options_.max_gathered_tokens < 0 ? options_.max_model_len : options_.max_gathered_tokens));
  }
  if (capturable && options_.enable_cuda_graphs && !graphs_failed_ && all_decode) {
    const int bucket = GraphBucket(num_seqs);
    if (bucket > 0) return RunWithGraph(batch, bucket, sink, layers);
  }

  step_ = PlanStep(batch, 0);
  KVFLOW_RETURN_IF_ERROR(UploadMetadata(host_meta_, device_meta_, T, step_.num_decode + step_.num_gathered_decode,
                                        step_.num_prefill + step_.num_gathered_prefill, step_.num_gathered_slots,
                                        max_blocks_per_seq_, stream_));
  KVFLOW_RETURN_IF_ERROR(layers());
  for (int first = 0; first < rows; first += logit_rows_per_chunk_) {
    const int chunk = static_cast<int>(std::min<int64_t>(logit_rows_per_chunk_, rows - first));
    KVFLOW_RETURN_IF_ERROR(RunLogits(first, chunk));
    KVFLOW_RETURN_IF_ERROR(Drain(first, chunk, sink));
  }
  if (rows == 0) KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  return Status::Ok();
}

// Hands logits rows [first_row, first_row + rows) of the step (now in logits_) to the sink.
Status CudaBackend::Drain(int first_row, int rows, const LogitsSink& sink) {
  if (!sink.sampled) {
    return CopyLogitsToHost(rows, sink.host->data() + static_cast<size_t>(first_row) * config_.logit_columns());
  }
  // The forward pass (and this chunk's logits) are queued: the host may now wait for the
  // constraints the engine computed meanwhile.
  if (first_row == 0 && sink.await_constraints != nullptr) (*sink.await_constraints)();
  return SampleOnDevice(sink.sample_rows.subspan(static_cast<size_t>(first_row), static_cast<size_t>(rows)),
                        *sink.sampled);
}

Status CudaBackend::RunWithGraph(const ForwardBatch& batch, int bucket, const LogitsSink& sink,
                                 const std::function<Status()>& layers) {
  const int n = static_cast<int>(batch.seqs.size());
  PlanStep(batch, bucket);
  KVFLOW_RETURN_IF_ERROR(UploadMetadata(host_meta_, device_meta_, bucket, bucket, 0, 0, max_blocks_per_seq_, stream_));
  // The graph's shape: the whole bucket, the decode grid sized for max_model_len.
  step_ = StepShape{};
  step_.num_tokens = bucket;
  step_.num_decode = bucket;
  step_.num_logit_rows = bucket;
  step_.max_decode_context = options_.max_model_len;

  auto it = graphs_.find(bucket);
  if (it == graphs_.end()) {
    // First step of this bucket: run it eagerly (the launches the graph will hold, so every kernel
    // is set up outside capture), then capture the same launches for the next steps.
    KVFLOW_RETURN_IF_ERROR(layers());
    KVFLOW_RETURN_IF_ERROR(RunLogits(0, bucket));
    KVFLOW_RETURN_IF_ERROR(Drain(0, n, sink));

    cudaGraph_t graph = nullptr;
    KVFLOW_CUDA_RETURN(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    Status captured = layers();
    if (captured.ok()) captured = RunLogits(0, bucket);
    const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
    cudaGraphExec_t exec = nullptr;
    if (captured.ok() && end == cudaSuccess) {
      const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
      if (inst != cudaSuccess) captured = CudaStatus(inst, "cudaGraphInstantiate");
    } else if (captured.ok()) {
      captured = CudaStatus(end, "cudaStreamEndCapture");
    }
    if (graph) cudaGraphDestroy(graph);
    if (!captured.ok()) {
      // Eager steps still work: log once and stop trying.
      spdlog::warn("CUDA graph capture failed ({}); decode steps run without graphs", captured.message());
      graphs_failed_ = true;
      cudaGetLastError();
      return Status::Ok();
    }
    graphs_.emplace(bucket, exec);
    spdlog::debug("captured a CUDA graph for decode batches of up to {} sequences", bucket);
    return Status::Ok();
  }
  KVFLOW_CUDA_RETURN(cudaGraphLaunch(it->second, stream_));
  return Drain(0, n, sink);
}

}  // namespace cuda_impl
}  // namespace kvflow
