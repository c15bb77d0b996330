#include "backend/backend_factory.h"

#include <algorithm>
#include <limits>
#include <thread>

#include <spdlog/spdlog.h>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "kv/block_manager.h"
#include "util/thread_pool.h"

namespace kvflow {

bool IsQ4KvCacheDtype(const std::string& kv_cache_dtype) { return kv_cache_dtype == "q4" || kv_cache_dtype == "int4"; }

namespace {

// The host prefix cache's blocks, resolved in `config` (num_blocks) so the engine knows which of
// the host pool's blocks are the tier's: the last ones.
int ResolveHostPrefixCache(EngineConfig& config, int64_t block_bytes) {
  HostPrefixCacheConfig& tier = config.host_prefix_cache;
  const int64_t blocks = config.kv_offload.enabled ? 0 : tier.BlocksFor(block_bytes);
  tier.num_blocks = static_cast<int>(std::clamp<int64_t>(blocks, 0, int64_t{1} << 28));
  return tier.num_blocks;
}

// A sequence must fit the pool alone, or it would be preempted and fail at the end (vLLM refuses to
// start in that case too): a max_model_len the user asked for is refused, a defaulted one lowered.
Status FitMaxModelLenToPool(EngineConfig& config, bool requested, int num_blocks, const char* remedy) {
  BlockManagerConfig pool;
  pool.num_device_blocks = num_blocks;
  const int64_t pool_tokens = static_cast<int64_t>(MaxAdmissibleBlocks(pool)) * config.block_size;
  if (pool_tokens >= config.max_model_len) return Status::Ok();
  if (requested) {
    return Status::InvalidArgument("max_model_len " + std::to_string(config.max_model_len) +
                                   " is more than the KV cache holds (" + std::to_string(pool_tokens) +
                                   " tokens in " + std::to_string(num_blocks) + " blocks); " + remedy +
                                   " or lower max_model_len");
  }
  spdlog::warn("the KV cache holds {} tokens, less than the model's context {}; max_model_len is {}", pool_tokens,
               config.max_model_len, pool_tokens);
  config.max_model_len = static_cast<int>(pool_tokens);
  return Status::Ok();
}

// The CPU backend: the KV pool is kv_cache_bytes (or num_kv_blocks, or enough for max_num_seqs full
// contexts up to 1 GiB); lowers a defaulted max_model_len to what the pool holds.
Result<std::unique_ptr<Backend>> MakeCpuBackend(EngineConfig& config, bool requested, const ModelConfig& mc,
                                                  LlamaWeights weights) {
  KvCacheLayout layout;
  layout.num_layers = mc.num_layers;
  layout.num_kv_heads = mc.num_kv_heads;
  layout.head_dim = mc.head_dim;
  layout.block_size = config.block_size;
  // auto: fp16 elements when the weights stay quantized or 16-bit (llama.cpp's pairing: its f16 KV
  // default), fp32 when every weight is fp32 (the exact mode, or an fp32 checkpoint). q4 only when asked.
  const bool f16 = config.kv_cache_dtype == "f16" || config.kv_cache_dtype == "fp16" ||
                   (config.kv_cache_dtype == "auto" && !weights.all_f32());
  const cpu::KvElement element = IsQ4KvCacheDtype(config.kv_cache_dtype) ? cpu::KvElement::kQ4
                                 : f16                                     ? cpu::KvElement::kF16
                                                                           : cpu::KvElement::kF32;
  // Before sizing: q4 block sizes only make sense for rows of whole groups.
  KVFLOW_RETURN_IF_ERROR(cpu::CheckKvElement(element, layout.head_dim));
  const int64_t block_bytes =
      static_cast<int64_t>(cpu::KvPoolBytes(element, layout.elements_per_block_all_layers()));
  if (config.num_kv_blocks > 0) {
    layout.num_blocks = config.num_kv_blocks;
  } else {
    int64_t bytes = config.kv_cache_bytes;
    if (bytes == 0) {
      const int64_t full = static_cast<int64_t>(config.max_num_seqs) *
                           BlocksForTokens(config.max_model_len, config.block_size) * block_bytes;
      bytes = std::min<int64_t>(full, int64_t{1} << 30);
    }
    layout.num_blocks = static_cast<int>(std::max<int64_t>(1, bytes / block_bytes));
  }
  KVFLOW_RETURN_IF_ERROR(FitMaxModelLenToPool(config, requested, layout.num_blocks, "give it more memory"));
  // Swap space beyond the device pool could never be filled (see the block manager).
  const int64_t host_blocks = config.num_host_kv_blocks >= 0 ? config.num_host_kv_blocks
                                                             : config.swap_space_bytes / block_bytes;
  // An offloaded pool is in host memory already: no swap space. The host prefix cache's blocks
  // follow the swap space's.
  const int num_host_blocks =
      config.kv_offload.enabled
          ? 0
          : static_cast<int>(std::min<int64_t>(host_blocks, layout.num_blocks)) + ResolveHostPrefixCache(config, block_bytes);

  const int threads = config.num_threads > 0 ? config.num_threads : UsableCores();
  KVFLOW_ASSIGN_OR_RETURN(auto backend,
                          CpuBackend::Create(mc, std::move(weights), layout, num_host_blocks, threads, element,
                                             config.kv_offload.enabled));
  return std::unique_ptr<Backend>(std::move(backend));
}

// The CUDA backend sizes its KV pool from gpu_memory_utilization (or kv_cache_bytes /
// num_kv_blocks) and refuses a max_model_len the pool cannot hold.
// `weights` null: a random:<shape> model, whose weights the backend generates from `seed`.
Result<std::unique_ptr<Backend>> MakeCudaBackend(EngineConfig& config, bool requested, const ModelConfig& mc,
                                                   const LlamaWeights* weights, uint64_t seed, int device) {
  if (IsQ4KvCacheDtype(config.kv_cache_dtype)) {
    return Status::InvalidArgument("kv_cache_dtype " + config.kv_cache_dtype +
                                   " (the 4-bit KV cache) is CPU only; CUDA keeps the KV cache in the dtype's 16-bit type");
  }
  CudaBackendOptions o;
  o.device = device;
  o.kv_offload = config.kv_offload.enabled;
  o.dtype = config.dtype;
  o.gpu_memory_utilization = config.gpu_memory_utilization;
  o.block_size = config.block_size;
  o.max_num_seqs = config.max_num_seqs;
  o.max_num_batched_tokens = config.max_num_batched_tokens;
  o.max_model_len = config.max_model_len;
  o.enable_cuda_graphs = !config.enforce_eager;
  KvCacheLayout shape;
  shape.num_layers = mc.num_layers;
  shape.num_kv_heads = mc.num_kv_heads;
  shape.head_dim = mc.head_dim;
  shape.block_size = config.block_size;
  const int64_t block_bytes = static_cast<int64_t>(shape.elements_per_block_all_layers() * 2);  // fp16/bf16
  if (config.num_kv_blocks > 0) {
    o.num_kv_blocks = config.num_kv_blocks;
  } else if (config.kv_cache_bytes > 0) {
    o.num_kv_blocks = static_cast<int>(std::max<int64_t>(1, config.kv_cache_bytes / block_bytes));
  } else if (config.kv_offload.enabled) {
    // An offloaded pool is host memory, which the GPU budget does not size: as the CPU backend,
    // enough for max_num_seqs full contexts, at most 1 GiB (pinned), unless kv_cache_bytes says.
    const int64_t full = static_cast<int64_t>(config.max_num_seqs) * BlocksForTokens(config.max_model_len, config.block_size);
    o.num_kv_blocks = static_cast<int>(std::max<int64_t>(1, std::min(full, (int64_t{1} << 30) / block_bytes)));
  }
  const int64_t host_blocks = config.num_host_kv_blocks >= 0 ? config.num_host_kv_blocks
                                                             : config.swap_space_bytes / block_bytes;
  const int tier = ResolveHostPrefixCache(config, block_bytes);
  o.num_host_blocks = static_cast<int>(std::min<int64_t>(host_blocks, std::numeric_limits<int32_t>::max() - tier)) + tier;
  // A pool of known size lowers (or refuses) max_model_len before the backend sizes its tables.
  const char* remedy = "raise gpu_memory_utilization";
  if (o.num_kv_blocks > 0) {
    KVFLOW_RETURN_IF_ERROR(FitMaxModelLenToPool(config, requested, o.num_kv_blocks, remedy));
    o.max_model_len = config.max_model_len;
  }
  KVFLOW_ASSIGN_OR_RETURN(auto backend, weights != nullptr ? CreateCudaBackend(mc, *weights, o)
                                                            : CreateCudaBackendWithRandomWeights(mc, o, seed));
  KVFLOW_RETURN_IF_ERROR(FitMaxModelLenToPool(config, requested, backend->kv_layout().num_blocks, remedy));
  return backend;
}

}  // namespace

Result<LlamaWeights> LoadWeightsFor(const ModelFiles& files, const EngineConfig& config,
                                    const WeightSelection& selection) {
  if (files.random_weights) {
    return Status::Unsupported("model " + files.config.name +
                               " has no weights to load: its random weights are generated on the GPU, by the engine's "
                               "CUDA backend only (use it as the engine's --model with --device cuda; tiny-random "
                               "runs everywhere)");
  }
  const Result<int> device = ParseDevice(config.device);
  const bool cpu = !device.ok() || device.value() < 0;
  const WeightFormat format = cpu && config.dtype == "auto" ? WeightFormat::kKeepQuantized : WeightFormat::kF32;
  const int threads = config.num_threads > 0 ? config.num_threads : UsableCores();
  ThreadPool pool(threads);
  ScopedThreadPool use_pool(&pool);
  return LoadLlamaWeights(*files.tensors, files.config, files.gguf_rope_permuted, format, selection);
}

Result<int> ParseDevice(const std::string& device) {
  if (device == "cpu") return -1;
  if (device == "cuda") return 0;
  if (device.rfind("cuda:", 0) == 0 && device.size() > 5 &&
      device.find_first_not_of("0123456789", 5) == std::string::npos && device.size() < 9) {
    return std::stoi(device.substr(5));
  }
  return Status::InvalidArgument("device must be cpu, cuda or cuda:N, not '" + device + "'");
}

Result<std::unique_ptr<Backend>> CreateBackend(EngineConfig& config, bool max_model_len_requested,
                                               const ModelConfig& model, LlamaWeights weights) {
  KVFLOW_ASSIGN_OR_RETURN(const int cuda_device, ParseDevice(config.device));
  if (cuda_device >= 0) return MakeCudaBackend(config, max_model_len_requested, model, &weights, 0, cuda_device);
  return MakeCpuBackend(config, max_model_len_requested, model, std::move(weights));
}

Result<std::unique_ptr<Backend>> CreateBackendForModel(EngineConfig& config, bool max_model_len_requested,
                                                       ModelFiles& files) {
  if (files.random_weights) {  // random:<shape>: the CUDA backend generates the weights
    KVFLOW_ASSIGN_OR_RETURN(const int cuda_device, ParseDevice(config.device));
    if (cuda_device < 0) {
      return Status::Unsupported("model " + files.config.name +
                                 " has random weights, which only the CUDA backend generates (--device cuda); on the "
                                 "CPU use tiny-random");
    }
    return MakeCudaBackend(config, max_model_len_requested, files.config, nullptr, files.random_seed, cuda_device);
  }
  KVFLOW_ASSIGN_OR_RETURN(LlamaWeights weights, LoadWeightsFor(files, config));
  files.tensors.reset();  // the weights are copies now; drop the mapping
  return CreateBackend(config, max_model_len_requested, files.config, std::move(weights));
}

}  // namespace kvflow
