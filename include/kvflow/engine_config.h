// What an Engine is built from: the model, the device, memory and batching, and one section per
// system that plugs into the engine (each section's header says what it does).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvflow/host_prefix_cache.h"
#include "kvflow/kv_offload.h"
#include "kvflow/kv_selection.h"
#include "kvflow/prefill_parallel.h"
#include "kvflow/s3.h"
#include "kvflow/speculative.h"

namespace kvflow {

struct EngineConfig {
  // A path (.gguf, .safetensors, model.safetensors.index.json, or an HF directory) or a short name:
  // "tiny-random" (built in) or "smollm2-135m" (looked up under the model directories).
  std::string model = "tiny-random";
  std::string device = "cpu";  // "cpu", "cuda" or "cuda:N"
  int block_size = 16;                // tokens per KV block
  int64_t kv_cache_bytes = 0;         // KV pool size; 0: enough for max_num_seqs full contexts, at most 1 GiB
  int num_kv_blocks = 0;              // overrides kv_cache_bytes when > 0
  int max_num_seqs = 64;              // sequences in one batch
  int max_num_batched_tokens = 2048;  // tokens in one batch (longer prompts are prefilled in chunks)
  int max_model_len = 0;              // prompt + output limit; 0: the model's context length
  int num_threads = 0;                // CPU threads; 0: the cores this process may use
  uint64_t seed = 0;                  // seeds requests that bring no seed of their own
  // Host memory for swapped-out KV (vLLM's --swap-space), capped at the size of the device pool.
  int64_t swap_space_bytes = int64_t{4} << 30;
  int num_host_kv_blocks = -1;        // overrides swap_space_bytes when >= 0
  // "auto" (recompute single sequences, swap groups that share blocks), "swap" or "recompute".
  std::string preemption_mode = "auto";
  bool enable_prefix_caching = false;  // map cached full prompt blocks instead of recomputing them
  // A registered scheduling policy: "paged" (vLLM FCFS, blocks on demand) or "s3" (see s3.h).
  std::string scheduling_policy = "paged";

  // CUDA only. Share of the GPU's memory for weights, activations and the KV pool (which gets the
  // rest, unless kv_cache_bytes / num_kv_blocks fix it).
  double gpu_memory_utilization = 0.9;
  // CPU: "auto" keeps a GGUF's Q4_0/Q4_1/Q8_0 and K-quant (Q2_K..Q6_K) matrices in their blocks
  // (dot products on the quantized weights with 8-bit activations, as llama.cpp computes) and
  // F16/BF16 matrices 16-bit (widened in registers: exact fp32 products), "f32" dequantizes every
  // weight to fp32 (exact: the reference). CUDA weights/activations/KV: "fp16", "bf16" or "auto" (bf16).
  std::string dtype = "auto";
  // KV cache elements. CPU: "auto" (fp16 when weights stay quantized or 16-bit, as llama.cpp pairs
  // them; fp32 with fp32 weights), "f16", "f32" or "q4" (also "int4": 4-bit groups of 32 along
  // head_dim with an fp16 scale and minimum, llama.cpp's Q4_1 layout; head_dim a multiple of 32).
  // CUDA: "auto" (the dtype's 16-bit type).
  std::string kv_cache_dtype = "auto";
  bool enforce_eager = false;  // CUDA: no CUDA graphs for decode steps

  // Tensor parallelism (Megatron-style) under `mpirun -np N`: the model's attention heads, MLP
  // width and vocabulary rows split across tensor_parallel_size ranks (N of them: CPU backends
  // summing over MPI, CUDA backends over NCCL). Rank 0 runs the engine and samples; every other rank
  // runs each step's share with it.
  int tensor_parallel_size = 1;
  // Pipeline parallelism under `mpirun -np tensor_parallel_size * pipeline_parallel_size`: the
  // layers split into pipeline_parallel_size stages (runs of consecutive layers), each on its own
  // rank or tensor-parallel group; the residual stream passes from stage to stage point to point.
  int pipeline_parallel_size = 1;
  // Steps rank 0 keeps in the pipeline at once (vLLM V1's batch queue): it schedules and starts the
  // next step, on the sequences not in flight, while the later stages run the ones before, so that
  // every stage works. 0: pipeline_parallel_size; 1: one step at a time (then micro-batches keep
  // the stages busy within it).
  int pipeline_batches_in_flight = 0;
  // Micro-batches each step's batch is cut into (by sequence), so that stage k runs one while stage
  // k+1 runs the one before; 0: 1 with batches in flight, else pipeline_parallel_size (never more
  // than the batch's sequences).
  int pipeline_microbatches = 0;
  // Layers of each pipeline stage, in order (vLLM's VLLM_PP_LAYER_PARTITION); empty: by cost, the
  // last stage fewer for its LM head (model/pipeline_stage_split.h).
  std::vector<int> pipeline_layer_split;
  // The ranks a split model needs (1: the model is whole on this process).
  int model_parallel_ranks() const { return tensor_parallel_size * pipeline_parallel_size; }

  // The systems, each configured in its own section.
  S3Config s3;
  SpeculativeConfig speculative;
  KvSelectionConfig kv_selection;
  KvOffloadConfig kv_offload;
  HostPrefixCacheConfig host_prefix_cache;
  PrefillParallelConfig prefill_parallel;
};

}  // namespace kvflow
