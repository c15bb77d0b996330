// Builds the backend an engine runs on, sizing the KV pools it owns: the CPU backend from
// kv_cache_bytes / num_kv_blocks (or enough for max_num_seqs full contexts, at most 1 GiB), the
// CUDA backend from gpu_memory_utilization (or kv_cache_bytes / num_kv_blocks); the host swap pool
// from swap_space_bytes / num_host_kv_blocks.
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"
#include "kvflow/engine.h"
#include "model/llama_weights.h"

namespace kvflow {

// "cpu" -> -1; "cuda" -> 0; "cuda:N" -> N.
Result<int> ParseDevice(const std::string& device);

// kv_cache_dtype "q4" or "int4": the CPU backend's 4-bit KV cache (cpu::KvElement::kQ4).
bool IsQ4KvCacheDtype(const std::string& kv_cache_dtype);

// The model's weights in the format config.device computes with: the CPU keeps a GGUF's quantized
// matrices as they are unless config.dtype is f32; the CUDA backend takes fp32 and converts them to
// its dtype. Conversions run on a pool of config.num_threads threads. Unsupported for a random:<shape>
// model, which has no host weights.
Result<LlamaWeights> LoadWeightsFor(const ModelFiles& files, const EngineConfig& config);

// The backend for config.device. A sequence must fit the pool alone: a max_model_len the user asked
// for (`max_model_len_requested`) that the pool cannot hold is refused, a defaulted one is lowered
// in `config` to what the pool holds.
Result<std::unique_ptr<Backend>> CreateBackend(EngineConfig& config, bool max_model_len_requested,
                                               const ModelConfig& model, LlamaWeights weights);

// The same for a random:<shape> model (ModelFiles::random_weights): the CUDA backend generates the
// weights from `seed`; the CPU backend is refused (Unsupported), as LoadWeightsFor refuses them.
Result<std::unique_ptr<Backend>> CreateBackendWithRandomWeights(EngineConfig& config, bool max_model_len_requested,
                                                                const ModelConfig& model, uint64_t seed);

}  // namespace kvflow
