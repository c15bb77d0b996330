// The CUDA backend (see cuda_backend.h). One forward pass per step on one stream:
//
//   embedding gather -> per layer: RMSNorm, QKV GEMM, RoPE, reshape_and_cache, paged attention
//   (decode kernel for one-token slices, prefill kernel for the rest), O GEMM, add + RMSNorm,
//   gate_up GEMM, SiLU*mul (GeGLU for Gemma), down GEMM -> gather logit rows, final norm, LM-head
//   GEMM (fp32 out). A model with biases adds each one (fp32) right after its GEMM (kernels/bias.cu);
//   a mixture of experts replaces the MLP with cuda_moe.cc's routed grouped GEMMs; Gemma adds its
//   post-norms on delta, scaled embeddings, per-layer RoPE bases and both soft caps.
//
// GEMMs run in cuBLAS (fp16/bf16 inputs, fp32 compute); the residual stream stays fp32 so the
// backend tracks the fp32 CPU reference closely. Step metadata (tokens, positions, slots, block
// tables) is staged in pinned memory and uploaded with one copy. A step made only of decode tokens
// replays a CUDA graph captured once per batch-size bucket, with the bucket's padding rows writing
// nowhere (slot -1) and reading block 0.
//
// KV views: a block subset is just another block table for the kernels. Explicit slot lists
// (KvView::kSlots) are gathered per layer (cache_ops GatherSlots) into scratch blocks, each view
// from a block boundary, and the same kernels run a second time over synthetic tables into that
// scratch; the slice's query tokens are the view's last entries, so causality holds in view order.
// Steps with slot views always run eagerly.
//
// InfiniGen's and H2O's token selections (AttentionOverSelection) use the same scheme per KV head:
// kernels/infinigen_score.h's GatherSelectedKv copies head h's i-th selected slot to scratch block
// first + i / block_size, head h, offset i % block_size, so one synthetic table serves every head
// and the unchanged paged kernels read each head's own tokens. H2O (and InfiniGen on the host)
// compute on the host: ReadActivationRows and ReadKv copy to the host and wait for the stream.
// InfiniGen on the device (DeviceKvSpeculation, cuda_speculation.cc) keeps the partial key cache,
// the scores and the selection on the device; the gather then takes the count from device memory
// and writes the tokens it gathered into the decode rows' context lengths.
//
// TriForce's chunk scoring (ScoreKvBlocks, per layer inside a step) uploads each call's jobs through
// pinned staging without waiting on the stream and runs kernels/kv_block_select.cu on the step's Q
// and the layer's K pool; selection copies its indices back, so it waits. The score buffer and the
// scoring scratch are allocated on first use, outside the memory budget (they are small: 4 bytes
// per scored block, and num_heads x that for one call's scratch).
//
// The class is declared in cuda_backend_impl.h. This file holds construction, memory planning and the
// weights; the step and forward primitives are in cuda_step.cc, attention and token selections in
// cuda_attention.cc, TriForce's scoring in cuda_scoring.cc, device sampling in cuda_sampling.cc,
// block copies, swaps and the offloaded pool in cuda_kv_tier.cc, and mixtures of experts in
// cuda_moe.cc.
#include "backend/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <spdlog/fmt/fmt.h>

#include "attention_decode.h"
#include "attention_prefill.h"
#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_backend_impl.h"
#include "backend/cuda/cuda_device.h"
#include "fill.h"
#include "model/rope.h"
#include "sampling.h"

namespace kvflow {
namespace cuda_impl {
namespace {

constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;
// Device memory kept free beyond the budget's parts: CUDA graphs, cuBLAS heuristics, the context.
constexpr size_t kReserveBytes = size_t{256} << 20;
// Rows of logits computed per LM-head GEMM (a whole-prompt logits request runs in chunks).
constexpr int kMaxLogitRowsPerChunk = 256;

// fp32 -> fp16/bf16 on the host (round to nearest even), as the weights are uploaded.
void ConvertFromFloat(const float* src, size_t n, DType t, uint16_t* dst) {
  if (t == DType::kF16) {
    for (size_t i = 0; i < n; ++i) {
      const __half h = __float2half_rn(src[i]);
      std::memcpy(&dst[i], &h, 2);
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      const __nv_bfloat16 b = __float2bfloat16_rn(src[i]);
      std::memcpy(&dst[i], &b, 2);
    }
  }
}

}  // namespace

CudaBackend::~CudaBackend() {
  if (stream_) cudaStreamSynchronize(stream_);
  if (copy_stream_) cudaStreamSynchronize(copy_stream_);
  for (auto& [bucket, exec] : graphs_) cudaGraphExecDestroy(exec);
  if (cublas_) cublasDestroy(cublas_);
  if (swap_done_) cudaEventDestroy(swap_done_);
  if (block_meta_copied_) cudaEventDestroy(block_meta_copied_);
  if (compute_done_) cudaEventDestroy(compute_done_);
  for (cudaEvent_t e : staged_) {
    if (e) cudaEventDestroy(e);
  }
  if (staging_free_) cudaEventDestroy(staging_free_);
  if (pack_event_) cudaEventDestroy(pack_event_);
  if (stream_) cudaStreamDestroy(stream_);
  if (copy_stream_) cudaStreamDestroy(copy_stream_);
}

Status CudaBackend::Init(const LlamaWeights* weights, uint64_t random_seed) {
  KVFLOW_RETURN_IF_ERROR(config_.Validate());
  KVFLOW_RETURN_IF_ERROR(CheckMoeSupported());
  if (cuda::DeviceCount() == 0) {
    return Status::Unsupported("no CUDA GPU is available: " + cuda::DeviceDescription(0));
  }
  if (options_.device < 0 || options_.device >= cuda::DeviceCount()) {
    return Status::InvalidArgument(fmt::format("CUDA device {} does not exist ({} found)", options_.device,
                                               cuda::DeviceCount()));
  }
  KVFLOW_CUDA_RETURN(cudaSetDevice(options_.device));
  device_name_ = cuda::DeviceDescription(options_.device);

  if (options_.dtype == "fp16" || options_.dtype == "float16") {
    dtype_ = DType::kF16;
  } else if (options_.dtype == "bf16" || options_.dtype == "bfloat16" || options_.dtype == "auto") {
    dtype_ = DType::kBF16;
  } else {
    return Status::InvalidArgument("dtype must be fp16, bf16 or auto, not '" + options_.dtype + "'");
  }
  if (!(options_.gpu_memory_utilization > 0.0 && options_.gpu_memory_utilization <= 1.0)) {
    return Status::InvalidArgument(
        fmt::format("gpu_memory_utilization must be in (0, 1], not {}", options_.gpu_memory_utilization));
  }
  if (!cuda::PagedDecodeSupports(config_.head_dim, options_.block_size) ||
      !cuda::PagedPrefillSupports(config_.head_dim, options_.block_size)) {
    return Status::Unsupported(fmt::format(
        "the CUDA attention kernels support head_dim 64, 128 or 256 and block_size 8, 16 or 32; this model has "
        "head_dim {} and the block size is {}",
        config_.head_dim, options_.block_size));
  }
  if (options_.max_num_seqs < 1 || options_.max_num_batched_tokens < 1 || options_.max_model_len < 1) {
    return Status::InvalidArgument("max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1");
  }
  if (options_.max_gathered_tokens < -1) {
    return Status::InvalidArgument(fmt::format("max_gathered_tokens must be >= 0, or -1 for max_model_len (not {})",
                                               options_.max_gathered_tokens));
  }

  KVFLOW_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  KVFLOW_CUDA_RETURN(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
  KVFLOW_CUDA_RETURN(cudaEventCreateWithFlags(&swap_done_, cudaEventDisableTiming));
  KVFLOW_CUDA_RETURN(cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming));
  KVFLOW_CUDA_RETURN(cudaEventCreateWithFlags(&pack_event_, cudaEventDisableTiming));
  if (options_.kv_offload) {
    for (cudaEvent_t& e : staged_) KVFLOW_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    KVFLOW_CUDA_RETURN(cudaEventCreateWithFlags(&staging_free_, cudaEventDisableTiming));
  }
  KVFLOW_CUBLAS_RETURN(cublasCreate(&cublas_));
  KVFLOW_CUBLAS_RETURN(cublasSetStream(cublas_, stream_));

  KVFLOW_RETURN_IF_ERROR(AllocateWeights());
  if (weights) {
    KVFLOW_RETURN_IF_ERROR(UploadWeights(*weights));
  } else {
    KVFLOW_RETURN_IF_ERROR(FillRandomWeights(random_seed));
  }
  KVFLOW_RETURN_IF_ERROR(AllocatePools());

  for (int b : {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512}) {
    if (b < options_.max_num_seqs) graph_buckets_.push_back(b);
  }
  graph_buckets_.push_back(options_.max_num_seqs);
  return Status::Ok();
}

Status CudaBackend::AllocateWeights() {
  const size_t H = config_.hidden_size, D = config_.head_dim, F = config_.intermediate_size;
  const size_t NH = config_.num_heads, KV = config_.num_kv_heads, V = config_.logit_columns();
  const size_t E = config_.num_experts, FE = config_.expert_intermediate_size;
  const size_t FS = config_.shared_expert_intermediate_size;
  const size_t es = cuda::DTypeSize(dtype_);
  // Dry run to size the arena, then carve it for real.
  auto carve = [&](Carver& c) {
    embed_ = c.TakeBytes(V * H * es);
    final_norm_ = c.TakeBytes(H * es);
    lm_head_ = config_.tie_word_embeddings ? nullptr : c.TakeBytes(V * H * es);
    layers_.assign(static_cast<size_t>(config_.num_layers), {});
    for (DeviceLayer& l : layers_) {
      l.attn_norm = c.TakeBytes(H * es);
      l.wqkv = c.TakeBytes((NH + 2 * KV) * D * H * es);
      l.wo = c.TakeBytes(H * NH * D * es);
      l.ffn_norm = c.TakeBytes(H * es);
      if (E == 0) {
        l.w_gate_up = c.TakeBytes(2 * F * H * es);
        l.w_down = c.TakeBytes(H * F * es);
      } else {
        l.router = c.TakeBytes(E * H * es);
        l.expert_gate_up = c.TakeBytes(E * 2 * FE * H * es);
        l.expert_down = c.TakeBytes(E * H * FE * es);
        if (FS > 0) {
          l.shared_gate_up = c.TakeBytes(2 * FS * H * es);
          l.shared_down = c.TakeBytes(H * FS * es);
          l.shared_gate = c.TakeBytes(H * es);
        }
      }
      if (config_.qkv_bias) l.bqkv = c.Take<float>((NH + 2 * KV) * D);
      if (config_.o_bias) l.bo = c.Take<float>(H);
      if (config_.mlp_bias) {
        l.b_gate_up = c.Take<float>(2 * F);
        l.b_down = c.Take<float>(H);
      }
      if (config_.qk_norm) {
        l.q_norm = c.TakeBytes((config_.qk_norm_per_head ? D : NH * D) * es);
        l.k_norm = c.TakeBytes((config_.qk_norm_per_head ? D : KV * D) * es);
      }
      if (config_.sandwich_norms) {
        l.post_attn_norm = c.TakeBytes(H * es);
        l.post_ffn_norm = c.TakeBytes(H * es);
      }
    }
    inv_freq_ = c.Take<float>(D / 2);
    local_inv_freq_ = config_.local_rope_theta > 0.0f ? c.Take<float>(D / 2) : inv_freq_;
  };
  Carver dry;
  carve(dry);
  weight_bytes_ = dry.size();
  KVFLOW_RETURN_IF_ERROR(weight_arena_.Allocate(weight_bytes_, "the model weights"));
  Carver real(weight_arena_.base());
  carve(real);
  if (!lm_head_) lm_head_ = embed_;

  const RopeFrequencies rope = ComputeRopeFrequencies(config_);
  attention_scale_ = rope.attention_scale;
  KVFLOW_CUDA_RETURN(cudaMemcpy(inv_freq_, rope.inv_freq.data(), rope.inv_freq.size() * sizeof(float),
                                cudaMemcpyHostToDevice));
  local_attention_scale_ = attention_scale_;
  if (local_inv_freq_ != inv_freq_) {
    const RopeFrequencies local = ComputeRopeFrequencies(LocalRopeConfig(config_));
    local_attention_scale_ = local.attention_scale;
    KVFLOW_CUDA_RETURN(cudaMemcpy(local_inv_freq_, local.inv_freq.data(), local.inv_freq.size() * sizeof(float),
                                  cudaMemcpyHostToDevice));
  }
  return Status::Ok();
}

Status CudaBackend::UploadWeights(const LlamaWeights& w) {
  // Convert on the host in slices through one pinned buffer.
  constexpr size_t kSlice = size_t{16} << 20;  // elements
  PinnedArena slice;
  KVFLOW_RETURN_IF_ERROR(slice.Allocate(kSlice * 2, "weight upload staging"));
  auto* slice16 = reinterpret_cast<uint16_t*>(slice.base());
  auto upload = [&](const std::vector<float>& src, void* dst) -> Status {
    for (size_t begin = 0; begin < src.size(); begin += kSlice) {
      const size_t n = std::min(kSlice, src.size() - begin);
      ConvertFromFloat(src.data() + begin, n, dtype_, slice16);
      KVFLOW_CUDA_RETURN(cudaMemcpy(static_cast<char*>(dst) + begin * 2, slice16, n * 2, cudaMemcpyHostToDevice));
    }
    return Status::Ok();
  };
  auto upload_matrix = [&](const WeightMatrix& m, void* dst) -> Status {
    if (!m.is_f32()) {
      return Status::Unsupported("the CUDA backend takes fp32 weights to convert; got " + m.FormatName());
    }
    return upload(m.f32(), dst);
  };
  // Before any copy: the buffers were carved to the config's shapes (a vocabulary shard's rows).
  if (w.layers.size() != layers_.size()) return Status::InvalidArgument("weights have the wrong number of layers");
  KVFLOW_RETURN_IF_ERROR(CheckFamilyWeights(config_, w));
  KVFLOW_RETURN_IF_ERROR(upload_matrix(w.embed, embed_));
  KVFLOW_RETURN_IF_ERROR(upload(w.final_norm, final_norm_));
  if (!w.lm_head.empty()) KVFLOW_RETURN_IF_ERROR(upload_matrix(w.lm_head, lm_head_));
  auto upload_bias = [&](const std::vector<float>& src, float* dst) -> Status {
    if (dst == nullptr) return Status::Ok();  // CheckFamilyWeights: src is empty too
    KVFLOW_CUDA_RETURN(cudaMemcpy(dst, src.data(), src.size() * sizeof(float), cudaMemcpyHostToDevice));
    return Status::Ok();
  };
  for (size_t i = 0; i < layers_.size(); ++i) {
    const LlamaLayerWeights& src = w.layers[i];
    DeviceLayer& dst = layers_[i];
    KVFLOW_RETURN_IF_ERROR(upload(src.attn_norm, dst.attn_norm));
    KVFLOW_RETURN_IF_ERROR(upload_matrix(src.wqkv, dst.wqkv));
    KVFLOW_RETURN_IF_ERROR(upload_matrix(src.wo, dst.wo));
    KVFLOW_RETURN_IF_ERROR(upload(src.ffn_norm, dst.ffn_norm));
    if (config_.num_experts == 0) {
      KVFLOW_RETURN_IF_ERROR(upload_matrix(src.w_gate_up, dst.w_gate_up));
      KVFLOW_RETURN_IF_ERROR(upload_matrix(src.w_down, dst.w_down));
    } else {
      KVFLOW_RETURN_IF_ERROR(upload_matrix(src.router, dst.router));
      // Expert e's gate|up [2FE][H] and down [H][FE] at e times their size in the layer's blocks
      // (CheckFamilyWeights checked the counts): a misshapen one would spill into the next slot.
      const int64_t H = config_.hidden_size, FE = config_.expert_intermediate_size;
      const size_t down_bytes = static_cast<size_t>(H * FE) * cuda::DTypeSize(dtype_);
      for (size_t e = 0; e < src.expert_gate_up.size(); ++e) {
        const WeightMatrix &gu = src.expert_gate_up[e], &dn = src.expert_down[e];
        if (gu.rows != 2 * FE || gu.cols != H || dn.rows != H || dn.cols != FE) {
          return Status::InvalidArgument(fmt::format(
              "layer {} expert {}: gate|up is [{}, {}] and down [{}, {}]; the config implies [{}, {}] and [{}, {}]", i,
              e, gu.rows, gu.cols, dn.rows, dn.cols, 2 * FE, H, H, FE));
        }
        KVFLOW_RETURN_IF_ERROR(upload_matrix(gu, static_cast<char*>(dst.expert_gate_up) + e * 2 * down_bytes));
        KVFLOW_RETURN_IF_ERROR(upload_matrix(dn, static_cast<char*>(dst.expert_down) + e * down_bytes));
      }
      if (dst.shared_gate_up != nullptr) {
        KVFLOW_RETURN_IF_ERROR(upload_matrix(src.shared_gate_up, dst.shared_gate_up));
        KVFLOW_RETURN_IF_ERROR(upload_matrix(src.shared_down, dst.shared_down));
        KVFLOW_RETURN_IF_ERROR(upload(src.shared_gate, dst.shared_gate));
      }
    }
    KVFLOW_RETURN_IF_ERROR(upload_bias(src.bqkv, dst.bqkv));
    KVFLOW_RETURN_IF_ERROR(upload_bias(src.bo, dst.bo));
    KVFLOW_RETURN_IF_ERROR(upload_bias(src.b_gate_up, dst.b_gate_up));
    KVFLOW_RETURN_IF_ERROR(upload_bias(src.b_down, dst.b_down));
    if (dst.q_norm != nullptr) {
      KVFLOW_RETURN_IF_ERROR(upload(src.q_norm, dst.q_norm));
      KVFLOW_RETURN_IF_ERROR(upload(src.k_norm, dst.k_norm));
    }
    if (dst.post_attn_norm != nullptr) {
      KVFLOW_RETURN_IF_ERROR(upload(src.post_attn_norm, dst.post_attn_norm));
      KVFLOW_RETURN_IF_ERROR(upload(src.post_ffn_norm, dst.post_ffn_norm));
    }
  }
  return Status::Ok();
}

Status CudaBackend::FillRandomWeights(uint64_t seed) {
  const int64_t H = config_.hidden_size, D = config_.head_dim, F = config_.intermediate_size;
  const int64_t NH = config_.num_heads, KV = config_.num_kv_heads, V = config_.logit_columns();
  uint64_t tensor = 0;
  // Uniform in [-s, s) has standard deviation s / sqrt(3): s = sqrt(3 / fan_in) keeps activations O(1).
  auto fill = [&](void* p, int64_t count, float scale, float offset) -> Status {
    KVFLOW_KERNEL_RETURN(cuda::FillUniform(dtype_, p, count, seed * 1000003 + tensor++, scale, offset, stream_));
    return Status::Ok();
  };
  auto matrix_scale = [](int64_t fan_in) { return std::sqrt(3.0f / static_cast<float>(fan_in)); };
  KVFLOW_RETURN_IF_ERROR(fill(embed_, V * H, 1.0f, 0.0f));
  KVFLOW_RETURN_IF_ERROR(fill(final_norm_, H, 0.1f, 1.0f));
  if (lm_head_ != embed_) KVFLOW_RETURN_IF_ERROR(fill(lm_head_, V * H, matrix_scale(H), 0.0f));
  for (DeviceLayer& l : layers_) {
    KVFLOW_RETURN_IF_ERROR(fill(l.attn_norm, H, 0.1f, 1.0f));
    KVFLOW_RETURN_IF_ERROR(fill(l.wqkv, (NH + 2 * KV) * D * H, matrix_scale(H), 0.0f));
    KVFLOW_RETURN_IF_ERROR(fill(l.wo, H * NH * D, matrix_scale(NH * D), 0.0f));
    KVFLOW_RETURN_IF_ERROR(fill(l.ffn_norm, H, 0.1f, 1.0f));
    if (l.w_gate_up != nullptr) {
      KVFLOW_RETURN_IF_ERROR(fill(l.w_gate_up, 2 * F * H, matrix_scale(H), 0.0f));
      KVFLOW_RETURN_IF_ERROR(fill(l.w_down, H * F, matrix_scale(F), 0.0f));
    } else {
      const int64_t E = config_.num_experts, FE = config_.expert_intermediate_size;
      const int64_t FS = config_.shared_expert_intermediate_size;
      KVFLOW_RETURN_IF_ERROR(fill(l.router, E * H, matrix_scale(H), 0.0f));
      KVFLOW_RETURN_IF_ERROR(fill(l.expert_gate_up, E * 2 * FE * H, matrix_scale(H), 0.0f));
      KVFLOW_RETURN_IF_ERROR(fill(l.expert_down, E * H * FE, matrix_scale(FE), 0.0f));
      if (FS > 0) {
        KVFLOW_RETURN_IF_ERROR(fill(l.shared_gate_up, 2 * FS * H, matrix_scale(H), 0.0f));
        KVFLOW_RETURN_IF_ERROR(fill(l.shared_down, H * FS, matrix_scale(FS), 0.0f));
        KVFLOW_RETURN_IF_ERROR(fill(l.shared_gate, H, matrix_scale(H), 0.0f));
      }
    }
    auto fill_bias = [&](float* p, int64_t count) -> Status {
      if (p == nullptr) return Status::Ok();
      KVFLOW_KERNEL_RETURN(cuda::FillUniform(DType::kF32, p, count, seed * 1000003 + tensor++, 0.1f, 0.0f, stream_));
      return Status::Ok();
    };
    KVFLOW_RETURN_IF_ERROR(fill_bias(l.bqkv, (NH + 2 * KV) * D));
    KVFLOW_RETURN_IF_ERROR(fill_bias(l.bo, H));
    KVFLOW_RETURN_IF_ERROR(fill_bias(l.b_gate_up, 2 * F));
    KVFLOW_RETURN_IF_ERROR(fill_bias(l.b_down, H));
    if (l.q_norm != nullptr) {
      KVFLOW_RETURN_IF_ERROR(fill(l.q_norm, config_.qk_norm_per_head ? D : NH * D, 0.1f, 1.0f));
      KVFLOW_RETURN_IF_ERROR(fill(l.k_norm, config_.qk_norm_per_head ? D : KV * D, 0.1f, 1.0f));
    }
    if (l.post_attn_norm != nullptr) {
      KVFLOW_RETURN_IF_ERROR(fill(l.post_attn_norm, H, 0.1f, 1.0f));
      KVFLOW_RETURN_IF_ERROR(fill(l.post_ffn_norm, H, 0.1f, 1.0f));
    }
  }
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  return Status::Ok();
}

Status CudaBackend::AllocatePools() {
  const size_t H = config_.hidden_size, D = config_.head_dim, F = config_.intermediate_size;
  const size_t NH = config_.num_heads, KV = config_.num_kv_heads, V = config_.logit_columns();
  const size_t es = cuda::DTypeSize(dtype_);
  max_seqs_ = options_.max_num_seqs;
  max_tokens_ = std::max(options_.max_num_batched_tokens, max_seqs_);
  max_blocks_per_seq_ = (options_.max_model_len + options_.block_size - 1) / options_.block_size;
  logit_rows_per_chunk_ = std::max(max_seqs_, std::min(max_tokens_, kMaxLogitRowsPerChunk));
  sample_workspace_bytes_ = cuda::SampleWorkspaceBytes(max_seqs_, static_cast<int>(V));
  decode_workspace_bytes_ = cuda::PagedDecodeWorkspaceBytes(max_seqs_, static_cast<int>(NH), static_cast<int>(D),
                                                             options_.max_model_len);
  const int gathered_tokens = options_.max_gathered_tokens < 0 ? options_.max_model_len : options_.max_gathered_tokens;
  gather_blocks_ = (gathered_tokens + options_.block_size - 1) / options_.block_size;
  const int max_gathered = gather_blocks_ * options_.block_size;
  const size_t gather_bytes = static_cast<size_t>(max_gathered) * KV * D * es;
  const size_t T = static_cast<size_t>(max_tokens_), R = static_cast<size_t>(logit_rows_per_chunk_);

  // Activations, metadata and workspaces in one arena.
  auto carve = [&](Carver& c) {
    residual_ = c.Take<float>(T * H);
    hidden_ = c.TakeBytes(T * H * es);
    qkv_ = c.TakeBytes(T * (NH + 2 * KV) * D * es);
    speculative_qkv_ = c.TakeBytes(T * (NH + 2 * KV) * D * es);
    attn_ = c.TakeBytes(T * NH * D * es);
    delta_ = c.TakeBytes(T * H * es);
    // A mixture of experts has no dense MLP: its buffers are MoeMlp's scratch.
    const size_t dense_f = config_.num_experts > 0 ? 0 : F;
    gate_up_ = c.TakeBytes(T * 2 * dense_f * es);
    act_ = c.TakeBytes(T * dense_f * es);
    CarveMoeScratch(c);
    final_rows_ = c.Take<float>(R * H);
    final_hidden_ = c.TakeBytes(R * H * es);
    logits_ = c.Take<float>(R * V);
    decode_workspace_ = c.TakeBytes(decode_workspace_bytes_);
    gather_key_ = c.TakeBytes(gather_bytes);
    gather_value_ = c.TakeBytes(gather_bytes);
    cublas_workspace_ = c.TakeBytes(kCublasWorkspaceBytes);
    sample_rows_ = c.Take<cuda::SamplingRow>(static_cast<size_t>(max_seqs_));
    sampled_tokens_ = c.Take<int32_t>(static_cast<size_t>(max_seqs_));
    sampled_logprobs_ = c.Take<float>(static_cast<size_t>(max_seqs_));
    sampled_top_tokens_ = c.Take<int32_t>(static_cast<size_t>(max_seqs_) * cuda::kMaxTopLogprobs);
    sampled_top_logprobs_ = c.Take<float>(static_cast<size_t>(max_seqs_) * cuda::kMaxTopLogprobs);
    sample_workspace_ = c.TakeBytes(sample_workspace_bytes_);
    const size_t before = c.size();
    StepMetadata::Carve(c, &device_meta_, max_tokens_, max_seqs_, max_blocks_per_seq_, max_gathered);
    meta_bytes_ = c.size() - before;
  };
  Carver dry;
  carve(dry);
  KVFLOW_RETURN_IF_ERROR(work_arena_.Allocate(dry.size(), "activations"));
  Carver real(work_arena_.base());
  carve(real);
  KVFLOW_CUBLAS_RETURN(cublasSetWorkspace(cublas_, cublas_workspace_, kCublasWorkspaceBytes));

  // Pinned mirror of the metadata (same offsets), then the logits staging.
  Carver staging_dry;
  StepMetadata::Carve(staging_dry, &host_meta_, max_tokens_, max_seqs_, max_blocks_per_seq_, max_gathered);
  KVFLOW_RETURN_IF_ERROR(staging_.Allocate(staging_dry.size(), "step metadata staging"));
  const size_t sample_staging = AlignUp(max_seqs_ * sizeof(cuda::SamplingRow)) +
                                max_seqs_ * (2 + 2 * cuda::kMaxTopLogprobs) * sizeof(int32_t);
  KVFLOW_RETURN_IF_ERROR(sample_staging_.Allocate(sample_staging, "sampling staging"));
  Carver staging_real(staging_.base());
  StepMetadata::Carve(staging_real, &host_meta_, max_tokens_, max_seqs_, max_blocks_per_seq_, max_gathered);

  // The KV pool gets what the budget leaves (vLLM's gpu_memory_utilization).
  layout_.num_layers = config_.num_layers;
  layout_.num_kv_heads = config_.num_kv_heads;
  layout_.head_dim = config_.head_dim;
  layout_.block_size = options_.block_size;
  const size_t block_bytes = layout_.elements_per_block_all_layers() * es;
  size_t free_bytes = 0, total_bytes = 0;
  KVFLOW_CUDA_RETURN(cudaMemGetInfo(&free_bytes, &total_bytes));
  const double budget = options_.gpu_memory_utilization * static_cast<double>(total_bytes);
  const double used = static_cast<double>(total_bytes - free_bytes);
  const double available = std::min(budget - used, static_cast<double>(free_bytes)) - kReserveBytes;
  int64_t blocks = options_.num_kv_blocks > 0 ? options_.num_kv_blocks
                                              : static_cast<int64_t>(std::max(0.0, available) / block_bytes);
  blocks = std::min<int64_t>(blocks, std::numeric_limits<int32_t>::max() / 2);
  if (options_.kv_offload && options_.num_kv_blocks <= 0) {
    return Status::InvalidArgument("an offloaded KV pool lives in host memory: give its size (num_kv_blocks)");
  }
  if (blocks < max_blocks_per_seq_ && !options_.kv_offload) {
    return Status::OutOfMemory(fmt::format(
        "the GPU budget leaves room for {} KV blocks ({} tokens), less than one sequence of max_model_len {} "
        "needs: weights take {:.2f} GiB, activations {:.2f} GiB, other processes and the context {:.2f} GiB of "
        "{:.2f} GiB; raise --gpu-memory-utilization (now {}), or lower --max-model-len, --max-num-seqs or "
        "--max-num-batched-tokens",
        blocks, blocks * options_.block_size, options_.max_model_len, weight_bytes_ / double(1 << 30),
        work_arena_.bytes() / double(1 << 30),
        (used - weight_bytes_ - work_arena_.bytes()) / double(1 << 30), total_bytes / double(1 << 30),
        options_.gpu_memory_utilization));
  }
  layout_.num_blocks = static_cast<int>(blocks);
  resident_begin_ = layout_.num_blocks;
  const size_t pool_bytes = layout_.layer_stride() * layout_.num_layers * es;
  if (options_.kv_offload) {
    KVFLOW_RETURN_IF_ERROR(offload_pool_arena_.Allocate(2 * pool_bytes, "the offloaded KV pool"));
    key_pool_ = offload_pool_arena_.base();
    value_pool_ = offload_pool_arena_.base() + pool_bytes;
    KVFLOW_RETURN_IF_ERROR(staging_arena_.Allocate(2 * layout_.layer_stride() * es * KvStagingLedger::kBuffers,
                                                   "the KV staging buffers"));
  } else {
    KVFLOW_RETURN_IF_ERROR(kv_arena_.Allocate(2 * pool_bytes, "the KV cache"));
    key_pool_ = kv_arena_.base();
    value_pool_ = kv_arena_.base() + pool_bytes;
  }

  // Copy-on-write pair lists and the logits staging.
  const size_t pairs_bytes = AlignUp(2 * static_cast<size_t>(layout_.num_blocks) * sizeof(int32_t));
  KVFLOW_RETURN_IF_ERROR(pairs_.Allocate(pairs_bytes, "copy-on-write pairs"));
  copy_pairs_ = reinterpret_cast<int32_t*>(pairs_.base());
  KVFLOW_RETURN_IF_ERROR(host_pairs_arena_.Allocate(pairs_bytes, "copy-on-write staging"));
  host_pairs_ = reinterpret_cast<int32_t*>(host_pairs_arena_.base());
  KVFLOW_RETURN_IF_ERROR(host_logits_arena_.Allocate(R * V * sizeof(float), "logits staging"));
  host_logits_ = reinterpret_cast<float*>(host_logits_arena_.base());

  // Swap pool in pinned host memory, same layout as the device pool.
  num_host_blocks_ = options_.kv_offload ? 0 : std::max(0, std::min(options_.num_host_blocks, layout_.num_blocks));
  if (num_host_blocks_ > 0) {
    KvCacheLayout host_layout = layout_;
    host_layout.num_blocks = num_host_blocks_;
    const size_t host_pool_bytes = host_layout.layer_stride() * host_layout.num_layers * es;
    KVFLOW_RETURN_IF_ERROR(host_kv_arena_.Allocate(2 * host_pool_bytes, "the swap space"));
    host_key_pool_ = host_kv_arena_.base();
    host_value_pool_ = host_kv_arena_.base() + host_pool_bytes;
  }
  return Status::Ok();
}

std::string CudaBackend::Describe() const {
  const size_t es = cuda::DTypeSize(dtype_);
  const double kv_gib = 2.0 * layout_.layer_stride() * layout_.num_layers * es / double(1 << 30);
  if (options_.kv_offload) {
    return fmt::format(
        "cuda:{} {} ({}, weights {:.2f} GiB, activations {:.2f} GiB, KV offloaded: host pool {} blocks x {} tokens = "
        "{:.2f} GiB pinned, staging {} layers = {:.2f} GiB on the device, CUDA graphs off)",
        options_.device, device_name_, cuda::DTypeName(dtype_), weight_bytes_ / double(1 << 30),
        work_arena_.bytes() / double(1 << 30), layout_.num_blocks, layout_.block_size, kv_gib, KvStagingLedger::kBuffers,
        kv_gib * KvStagingLedger::kBuffers / layout_.num_layers);
  }
  const double swap_gib = layout_.elements_per_block_all_layers() * es * double(num_host_blocks_) / double(1 << 30);
  return fmt::format(
      "cuda:{} {} ({}, weights {:.2f} GiB, activations {:.2f} GiB, KV pool {} blocks x {} tokens = {:.2f} GiB, "
      "swap {:.2f} GiB pinned, CUDA graphs {})",
      options_.device, device_name_, cuda::DTypeName(dtype_), weight_bytes_ / double(1 << 30),
      work_arena_.bytes() / double(1 << 30), layout_.num_blocks, layout_.block_size, kv_gib, swap_gib,
      options_.enable_cuda_graphs ? (graphs_failed_ ? "failed" : "on") : "off");
}

namespace {

Result<std::unique_ptr<Backend>> Create(const ModelConfig& config, const LlamaWeights* weights,
                                        const CudaBackendOptions& options, uint64_t seed) {
  auto backend = std::make_unique<CudaBackend>(config, options);
  KVFLOW_RETURN_IF_ERROR(backend->Init(weights, seed));
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace
}  // namespace cuda_impl

Result<std::unique_ptr<Backend>> CreateCudaBackend(const ModelConfig& config, const LlamaWeights& weights,
                                                   const CudaBackendOptions& options) {
  return cuda_impl::Create(config, &weights, options, 0);
}

Result<std::unique_ptr<Backend>> CreateCudaBackendWithRandomWeights(const ModelConfig& config,
                                                                    const CudaBackendOptions& options,
                                                                    uint64_t seed) {
  return cuda_impl::Create(config, nullptr, options, seed);
}

}  // namespace kvflow
