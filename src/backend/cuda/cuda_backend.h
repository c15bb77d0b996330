// The CUDA backend: the same Llama forward as the CPU reference (backend/cpu), on one NVIDIA GPU,
// with fp16 or bf16 weights, activations and KV cache (fp32 accumulation and residual stream).
// Plain C++ header: callers need no CUDA headers. Builds without CUDA get a stub that returns
// Unsupported (backend/cuda/cuda_stub.cc).
//
// Memory: one budget, gpu_memory_utilization x the device's memory, is split into the weights,
// the activation workspace (sized for max_num_batched_tokens / max_num_seqs), cuBLAS and CUDA
// graph workspaces, one layer's scratch blocks for KV views of explicit slots (max_gathered_tokens), and the KV block pool, which gets everything left (as vLLM sizes it). The swap
// pool is pinned host memory.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "backend/backend.h"
#include "kvflow/config.h"
#include "kvflow/status.h"
#include "model/llama_weights.h"

namespace kvflow {

struct CudaBackendOptions {
  int device = 0;
  std::string dtype = "auto";            // "fp16", "bf16", or "auto" (bf16)
  double gpu_memory_utilization = 0.9;   // share of the device's memory kvflow may use
  int block_size = 16;                   // 8, 16 or 32 (the attention kernels' block sizes)
  int num_kv_blocks = 0;                 // > 0: this many blocks instead of what the budget leaves
  int num_host_blocks = 0;               // pinned host swap pool, in blocks
  int max_num_seqs = 64;                 // sizes the decode metadata and the CUDA graph buckets
  int max_num_batched_tokens = 2048;     // sizes the activation workspace
  int max_model_len = 2048;              // sizes block tables and decode split-K partitions
  // KV views of explicit slots (KvView::kSlots): the attention kernels read whole blocks, so each
  // layer gathers a step's slot views into scratch blocks first, each view from a block boundary.
  // Sizes that scratch, in tokens (rounded up to blocks); -1: max_model_len, 0: none (slot views
  // are refused). A step whose slot views need more blocks is refused with InvalidArgument.
  int max_gathered_tokens = -1;
  bool enable_cuda_graphs = true;        // capture decode steps per batch-size bucket
  // EngineConfig::kv_offload: the pool of num_kv_blocks (required) in pinned host memory, two
  // layers' staging buffers on the device; no swap pool; decode steps run without CUDA graphs.
  bool kv_offload = false;
};

// Uploads `weights` (converted to the chosen dtype) and allocates the pools. Errors: Unsupported
// (no GPU, head_dim or block_size the kernels do not support), OutOfMemory (the budget cannot hold
// the weights and at least max_model_len tokens of KV cache), InvalidArgument.
Result<std::unique_ptr<Backend>> CreateCudaBackend(const ModelConfig& config, const LlamaWeights& weights,
                                                   const CudaBackendOptions& options);

// Same model shape with uniform random weights generated on the device (deterministic in `seed`):
// benchmarks at real sizes (a Llama-2-7B shape) without a checkpoint.
Result<std::unique_ptr<Backend>> CreateCudaBackendWithRandomWeights(const ModelConfig& config,
                                                                    const CudaBackendOptions& options,
                                                                    uint64_t seed);

}  // namespace kvflow
