// A mixture-of-experts MLP on the device (kernels/moe.h), chunk by chunk of the step's tokens:
//
//   router GEMM (cuBLAS, fp32 logits) -> top-k routing -> the (token, slot) pairs grouped by expert
//   into whole tiles -> grouped GEMM gate|up over the gathered hidden rows -> SiLU * up -> grouped
//   GEMM down -> [Qwen2-MoE: the shared expert's dense MLP and its sigmoid gate, cuBLAS] -> the
//   weighted combine into delta.
//
// The routing is the CPU backend's (softmax in fp32, the k largest with ties to the lower expert,
// renormalized if norm_topk_prob), and nothing goes back to the host, so decode steps still replay
// as CUDA graphs: the grouped GEMM's grid covers the most tiles a chunk can need and the tiles past
// the count the grouping wrote return at once.
#include <algorithm>

#include <spdlog/fmt/fmt.h>

#include "activation.h"
#include "backend/cuda/cuda_backend_impl.h"
#include "moe.h"

namespace kvflow {
namespace cuda_impl {
namespace {

// Tokens per MoE chunk: bounds the pair buffers ([chunk * K] rows of 2F, F and H) while keeping
// prefill chunks large enough that each expert's tile rows fill.
constexpr int kMoeChunkTokens = 1024;

}  // namespace

Status CudaBackend::CheckMoeSupported() const {
  if (config_.num_experts == 0) return Status::Ok();
  const int E = config_.num_experts, K = config_.experts_per_token;
  if (E > cuda::kMoeMaxExperts || K > 32) {
    return Status::Unsupported(fmt::format(
        "the CUDA MoE kernels route at most {} experts, top 32; this model has {} experts, top {}; use --device cpu",
        cuda::kMoeMaxExperts, E, K));
  }
  const int H = config_.hidden_size, F = config_.expert_intermediate_size;
  if (H % 8 != 0 || F % 8 != 0) {
    return Status::Unsupported(fmt::format(
        "the CUDA grouped expert GEMM needs hidden_size and the expert width to be multiples of 8 (16-byte rows); "
        "this model has {} and {}; use --device cpu",
        H, F));
  }
  return Status::Ok();
}

void CudaBackend::CarveMoeScratch(Carver& c) {
  if (config_.num_experts == 0) return;
  const size_t E = config_.num_experts, K = config_.experts_per_token, H = config_.hidden_size;
  const size_t F = config_.expert_intermediate_size, Fs = config_.shared_expert_intermediate_size;
  const size_t es = cuda::DTypeSize(dtype_);
  moe_.chunk_tokens = std::min(max_tokens_, kMoeChunkTokens);
  const size_t C = static_cast<size_t>(moe_.chunk_tokens), pairs = C * K;
  const auto experts = static_cast<int>(E);
  // The small tiles need the most tiles, the large ones the most padded rows.
  const size_t sorted = static_cast<size_t>(std::max(cuda::MoeSortedCapacity(pairs, experts, cuda::kMoeSmallTile),
                                                     cuda::MoeSortedCapacity(pairs, experts, cuda::kMoeLargeTile)));
  const size_t tiles = static_cast<size_t>(cuda::MoeMaxTiles(pairs, experts, cuda::kMoeSmallTile));
  moe_.router_logits = c.Take<float>(C * E);
  moe_.ids = c.Take<int32_t>(pairs);
  moe_.weights = c.Take<float>(pairs);
  moe_.sorted_pairs = c.Take<int32_t>(sorted);
  moe_.tile_expert = c.Take<int32_t>(tiles);
  moe_.num_tiles = c.Take<int32_t>(1);
  moe_.gate_up = c.TakeBytes(pairs * 2 * F * es);
  moe_.act = c.TakeBytes(pairs * F * es);
  moe_.out = c.TakeBytes(pairs * H * es);
  if (Fs > 0) {
    moe_.shared_gate_up = c.TakeBytes(C * 2 * Fs * es);
    moe_.shared_act = c.TakeBytes(C * Fs * es);
    moe_.shared_out = c.TakeBytes(C * H * es);
    moe_.shared_gate_logit = c.Take<float>(C);
  }
}

Status CudaBackend::MoeMlp(int layer) {
  if (config_.num_experts == 0) return Status::InvalidArgument("MoeMlp: the model has no experts");
  const DeviceLayer& l = layers_[static_cast<size_t>(layer)];
  const int H = config_.hidden_size, E = config_.num_experts, K = config_.experts_per_token;
  const int F = config_.expert_intermediate_size, Fs = config_.shared_expert_intermediate_size;
  const size_t es = cuda::DTypeSize(dtype_);
  for (int first = 0; first < step_.num_tokens; first += moe_.chunk_tokens) {
    const int n = std::min(moe_.chunk_tokens, step_.num_tokens - first);
    const void* x = static_cast<const char*>(hidden_) + static_cast<size_t>(first) * H * es;
    void* delta = static_cast<char*>(delta_) + static_cast<size_t>(first) * H * es;
    KVFLOW_RETURN_IF_ERROR(Gemm(x, l.router, moe_.router_logits, n, E, H, DType::kF32));
    KVFLOW_KERNEL_RETURN(cuda::MoeRouteTopK(moe_.router_logits, n, E, K, config_.norm_topk_prob, moe_.ids,
                                            moe_.weights, stream_));
    const int pairs = n * K;
    const int tile = cuda::MoeTileRows(pairs, E);
    const int max_tiles = static_cast<int>(cuda::MoeMaxTiles(pairs, E, tile));
    KVFLOW_KERNEL_RETURN(
        cuda::MoeGroupByExpert(moe_.ids, pairs, E, tile, moe_.sorted_pairs, moe_.tile_expert, moe_.num_tiles, stream_));
    KVFLOW_KERNEL_RETURN(cuda::MoeGroupedGemm(dtype_, x, /*in_row_divisor=*/K, l.expert_gate_up, moe_.gate_up, 2 * F, H,
                                              moe_.sorted_pairs, moe_.tile_expert, moe_.num_tiles, max_tiles, tile,
                                              stream_));
    KVFLOW_KERNEL_RETURN(cuda::SiluAndMul(dtype_, moe_.gate_up, moe_.act, pairs, F, stream_));
    KVFLOW_KERNEL_RETURN(cuda::MoeGroupedGemm(dtype_, moe_.act, 1, l.expert_down, moe_.out, H, F, moe_.sorted_pairs,
                                              moe_.tile_expert, moe_.num_tiles, max_tiles, tile, stream_));
    if (Fs > 0) {  // Qwen2-MoE: every token's shared expert, scaled by sigmoid(gate . x)
      KVFLOW_RETURN_IF_ERROR(Gemm(x, l.shared_gate_up, moe_.shared_gate_up, n, 2 * Fs, H, dtype_));
      KVFLOW_KERNEL_RETURN(cuda::SiluAndMul(dtype_, moe_.shared_gate_up, moe_.shared_act, n, Fs, stream_));
      KVFLOW_RETURN_IF_ERROR(Gemm(moe_.shared_act, l.shared_down, moe_.shared_out, n, H, Fs, dtype_));
      KVFLOW_RETURN_IF_ERROR(Gemm(x, l.shared_gate, moe_.shared_gate_logit, n, 1, H, DType::kF32));
    }
    KVFLOW_KERNEL_RETURN(cuda::MoeCombine(dtype_, moe_.out, moe_.weights, n, K, H, Fs > 0 ? moe_.shared_out : nullptr,
                                          Fs > 0 ? moe_.shared_gate_logit : nullptr, delta, stream_));
  }
  return Status::Ok();
}

}  // namespace cuda_impl
}  // namespace kvflow
