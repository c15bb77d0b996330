// The engine flags `kvflow generate` and `kvflow-server` share, spelled as vLLM spells them.
#pragma once

#include <cstdint>

#include <CLI/CLI.hpp>

#include "kvflow/engine.h"

namespace kvflow {

// Adds the model, device, memory and scheduling flags for `config` to `app`. `swap_space_gib`
// receives --swap-space; ApplySwapSpace puts it into `config` after parsing.
inline void AddEngineFlags(CLI::App* app, EngineConfig* config, double* swap_space_gib) {
  EngineConfig& c = *config;
  app->add_option("-m,--model", c.model, "Model path or short name (tiny-random, smollm2-135m)")
      ->default_val("smollm2-135m");
  app->add_option("--device", c.device, "cpu, cuda or cuda:N")->default_val("cpu");
  app->add_option("--dtype", c.dtype,
                  "CPU: auto (keep a GGUF's Q4_0/Q4_1/Q8_0/K-quant weights quantized, F16/BF16 weights 16-bit) or "
                  "f32 (exact fp32 reference); "
                  "CUDA: fp16, bf16 or auto (bf16)")
      ->default_val("auto");
  app->add_option("--kv-cache-dtype", c.kv_cache_dtype,
                  "CPU: auto (f16 when weights stay quantized or 16-bit, else f32), f16, f32 or q4/int4 "
                  "(4-bit groups of 32 with fp16 scale and min; head_dim a multiple of 32); CUDA: auto")
      ->default_val("auto");
  app->add_option("--gpu-memory-utilization", c.gpu_memory_utilization,
                  "CUDA: share of GPU memory for weights, activations and KV cache")->default_val(0.9);
  app->add_flag("--enforce-eager", c.enforce_eager, "CUDA: no CUDA graphs for decode steps");
  app->add_option("--max-num-seqs", c.max_num_seqs, "Sequences in one batch")->default_val(64);
  app->add_option("--max-num-batched-tokens", c.max_num_batched_tokens,
                  "Tokens in one batch (longer prompts prefill in chunks)")->default_val(2048);
  app->add_option("--max-model-len", c.max_model_len, "Context limit (0 = the model's)")->default_val(0);
  app->add_option("--block-size", c.block_size, "Tokens per KV block")->default_val(16);
  app->add_option("--num-kv-blocks", c.num_kv_blocks, "Fix the device KV pool size in blocks (0 = automatic)");
  app->add_option("--swap-space", *swap_space_gib, "Host memory for swapped-out KV, GiB")->default_val(4.0);
  app->add_option("--num-host-kv-blocks", c.num_host_kv_blocks, "Fix the host (swap) pool in blocks");
  app->add_option("--preemption-mode", c.preemption_mode, "auto, swap or recompute")->default_val("auto");
  app->add_flag("--enable-prefix-caching", c.enable_prefix_caching, "Reuse cached prompt blocks");
  app->add_option_function<double>(
         "--host-prefix-cache",
         [config](double gib) { config->host_prefix_cache.bytes = static_cast<int64_t>(gib * (1ull << 30)); },
         "Host memory, GiB, for prompt blocks the device prefix cache evicts; a prompt that starts with them "
         "loads them back instead of recomputing them (needs --enable-prefix-caching; 0 = off)");
  app->add_option("--num-host-prefix-cache-blocks", c.host_prefix_cache.num_blocks,
                  "Fix the host prefix cache in blocks (overrides --host-prefix-cache)");
  app->add_option("--scheduler,--scheduling-policy", c.scheduling_policy,
                  "paged (vLLM FCFS) or s3 (length-aware); for evaluation orca-max, orca-pow2, orca-oracle, "
                  "s3-oracle")
      ->default_val("paged");
  app->add_option("--length-predictor", c.s3.length_predictor,
                  "s3: output-length predictor file (kvflow-length-predictor train); none: learn online from scratch");
  app->add_option("--length-reservation", c.s3.reservation_point,
                  "s3: reserve the upper or middle edge of the predicted bucket (default: the file's, upper)");
  app->add_option("--length-probe", c.s3.length_probe,
                  "s3: hidden-state length probe for this model (kvflow-length-predictor train-probe): re-sizes each "
                  "request's reservation after its prefill (CPU backend)");
  app->add_flag("!--no-length-online-updates", c.s3.online_updates,
                "s3: do not retrain the predictor on completed requests");
  app->add_option("--speculative-method", c.speculative.method,
                  "Speculative decoding, lossless: ngram (draft by looking the last tokens up earlier in the "
                  "sequence), draft_model (sample drafts from --speculative-model) or triforce (long contexts: the "
                  "model over a retrieval cache of its own KV drafts for the model with its full cache). Default: "
                  "off, or draft_model when --speculative-model is given");
  app->add_option("--speculative-model", c.speculative.model,
                  "draft_model (or triforce with --triforce-draft draft_model): a smaller model with the same "
                  "tokenizer (path or short name), on the same device");
  app->add_option("--num-speculative-tokens", c.speculative.num_tokens,
                  "Drafts per step at most (triforce: gamma2, the tokens the middle level drafts per full-cache "
                  "pass); 0 = the method's default: 4, triforce 8")
      ->default_val(0);
  app->add_option("--triforce-draft", c.speculative.triforce.draft,
                  "triforce: the bottom drafter proposing to the retrieval level: ngram, streaming (the model over "
                  "attention sinks + a recent window) or draft_model (--speculative-model over sinks + window)")
      ->default_val("ngram");
  app->add_option("--triforce-draft-tokens", c.speculative.triforce.draft_tokens,
                  "triforce: gamma1, tokens the bottom drafter proposes per retrieval-level pass")
      ->default_val(3);
  app->add_option("--triforce-budget", c.speculative.triforce.budget,
                  "triforce: tokens in the retrieval cache (top KV blocks by their mean key's attention); 0 = "
                  "context/8 within [256, 4096]")
      ->default_val(0);
  app->add_option("--triforce-rebuild-stride", c.speculative.triforce.rebuild_stride,
                  "triforce: rebuild the retrieval cache after this many new tokens (0 = on low acceptance only)")
      ->default_val(1024);
  app->add_option("--triforce-rebuild-acceptance", c.speculative.triforce.rebuild_acceptance,
                  "triforce: rebuild it when the rolling acceptance falls below this")
      ->default_val(0.5);
  app->add_option("--triforce-min-context", c.speculative.triforce.min_context,
                  "triforce: sequences with a shorter context decode plainly (it would not pay)")
      ->default_val(4096);
  app->add_option("--triforce-sinks", c.speculative.triforce.sinks, "triforce streaming/draft_model bottom: attention sinks")
      ->default_val(16);
  app->add_option("--triforce-window", c.speculative.triforce.window, "triforce streaming/draft_model bottom: recent window")
      ->default_val(256);
  app->add_option("--kv-selection", c.kv_selection.method,
                  "Which cached tokens decoding attention reads: infinigen (speculate each layer's important tokens "
                  "at the layer before and read only those; needs the model's skewing file from `kvflow skew`) or "
                  "h2o (keep heavy hitters + a recent window, evicting the rest); empty = all of them")
      ->check(CLI::IsMember({"", "infinigen", "h2o"}));
  app->add_option("--kv-selection-default", c.kv_selection.apply_by_default,
                  "Whether requests that do not say (the API's kv_selection field) use the selection")
      ->default_val(true);
  app->add_option("--kv-selection-min-context", c.kv_selection.min_context,
                  "Contexts shorter than this read the whole cache")
      ->default_val(0);
  app->add_option("--infinigen-skew-file", c.kv_selection.infinigen.skew_file,
                  "infinigen: the skewing file (default: <model path>.infinigen, written by `kvflow skew`)");
  app->add_option("--infinigen-speculate-from", c.kv_selection.infinigen.speculate_from,
                  "infinigen: speculate layer i at layer i-1's after-attention residual (default; the prefetch "
                  "overlaps layer i-1's MLP) or at its layer-input (the paper; overlaps all of layer i-1); oracle: "
                  "no speculation, each layer picks with its own query against its whole keys (an accuracy ceiling "
                  "for evaluation: nothing is known ahead to prefetch)")
      ->default_val("after-attention")
      ->check(CLI::IsMember({"after-attention", "layer-input", "oracle"}));
  app->add_option("--infinigen-speculate-on", c.kv_selection.infinigen.speculate_on,
                  "infinigen: where the partial key cache, scoring and selection run: auto (the GPU where the "
                  "backend is CUDA and no host pool cap is set, else the host), device (refuse otherwise) or host")
      ->default_val("auto")
      ->check(CLI::IsMember({"auto", "device", "host"}));
  app->add_option("--infinigen-alpha", c.kv_selection.infinigen.alpha,
                  "infinigen: read the tokens whose speculated score is within alpha of each head's max (logits)")
      ->default_val(5.0);
  app->add_option("--infinigen-max-fraction", c.kv_selection.infinigen.max_fraction,
                  "infinigen: at most this fraction of the cache per layer")
      ->default_val(0.2);
  app->add_option("--infinigen-max-tokens", c.kv_selection.infinigen.max_tokens,
                  "infinigen: cap in tokens instead of --infinigen-max-fraction (0 = the fraction; the paper's "
                  "accuracy code: 409, 20% of its 2048-token window)")
      ->default_val(c.kv_selection.infinigen.max_tokens);
  app->add_option("--infinigen-count-rule", c.kv_selection.infinigen.count_rule,
                  "infinigen: query-heads (each query head counts the tokens within alpha of its own max; a KV head "
                  "reads the union of its query heads' top tokens) or kv-head-max (a KV head scores a token by its "
                  "query heads' max and counts on that); the same without grouped-query attention")
      ->default_val(c.kv_selection.infinigen.count_rule)
      ->check(CLI::IsMember({"query-heads", "kv-head-max"}));
  app->add_option("--infinigen-dense-layers", c.kv_selection.infinigen.dense_layers,
                  "infinigen: the first N layers read the whole cache (at least 1; the paper's code keeps 2)")
      ->default_val(c.kv_selection.infinigen.dense_layers);
  app->add_option("--infinigen-sink-tokens", c.kv_selection.infinigen.sink_tokens,
                  "infinigen: every speculated read also takes the context's first N tokens (attention sinks)")
      ->default_val(c.kv_selection.infinigen.sink_tokens);
  app->add_option("--infinigen-recent-tokens", c.kv_selection.infinigen.recent_tokens,
                  "infinigen: every speculated read also takes the latest N cached tokens (within the cap)")
      ->default_val(c.kv_selection.infinigen.recent_tokens);
  app->add_option("--infinigen-host-kv-tokens", c.kv_selection.infinigen.host_kv_tokens,
                  "infinigen: cap the host KV pool at this many tokens per sequence and layer (the paper's KV pool "
                  "manager); past it each new token evicts one, chosen by --infinigen-eviction, that the layer never "
                  "reads again (0 = no cap; e.g. 80% of a 2048-token context: 1638)")
      ->default_val(0);
  app->add_option("--infinigen-eviction", c.kv_selection.infinigen.eviction,
                  "infinigen: which token a full host pool evicts: counter (the paper's: the one fetched least often, "
                  "counts halved when one saturates), lru (least recently fetched) or fifo (the oldest)")
      ->default_val("counter")
      ->check(CLI::IsMember({"counter", "lru", "fifo"}));
  app->add_option("--h2o-budget", c.kv_selection.h2o.budget, "h2o: fraction of the context kept")->default_val(0.2);
  app->add_option("--h2o-recent-share", c.kv_selection.h2o.recent_share, "h2o: share of the budget kept as the recent window")
      ->default_val(0.5);
  app->add_flag("--kv-offload", c.kv_offload.enabled,
               "Keep the KV cache in host memory (InfiniGen's and FlexGen's setting): the device holds two layers' "
               "staging buffers and each layer fetches what its attention reads, during the layer before where it "
               "is known: every cached token, or with --kv-selection infinigen only the speculated ones. No swap "
               "space; on CUDA the pool is pinned host memory and decode steps run without CUDA graphs");
  app->add_option("--prefill-parallel", c.prefill_parallel.method,
                  "KV-Runahead: under mpirun -np P, prefill prompts of --prefill-parallel-min-tokens or more across "
                  "all P ranks; the last rank serves and decodes, the others are prefill workers. kv-runahead (the "
                  "chain) or tsp (all-gather baseline)")
      ->check(CLI::IsMember({"kv-runahead", "tsp"}));
  app->add_option("--prefill-parallel-min-tokens", c.prefill_parallel.min_tokens,
                  "Shorter prompts are prefilled on the last rank alone")
      ->default_val(2048);
  app->add_option("--partition-table", c.prefill_parallel.partition_table,
                  "KV-Runahead's partition lookup table (kvflow prefill-bench --search); none: even split");
  app->add_option("--tensor-parallel-size,--tp", c.tensor_parallel_size,
                  "Tensor parallelism: under mpirun -np N (N*P with --pipeline-parallel-size P), split the model's attention heads and MLP across N "
                  "ranks (N must divide the heads, the KV heads or be a multiple of them, and the MLP width), and the "
                  "vocabulary's embedding and LM head rows. Rank 0 serves and samples; the others run each step's "
                  "share. CPU ranks sum over MPI; with --device cuda each rank takes its local rank's GPU and "
                  "sums over NCCL")
      ->default_val(1)
      ->check(CLI::Range(1, 4096));
  app->add_option("--pipeline-parallel-size,--pp", c.pipeline_parallel_size,
                  "Pipeline parallelism: split the model's layers into P stages of consecutive layers, one per "
                  "rank (or per tensor-parallel group: mpirun -np TP*PP); the residual stream passes from stage to "
                  "stage. Rank 0 (the first stage) serves and samples. CPU ranks over MPI (not yet on CUDA)")
      ->default_val(1)
      ->check(CLI::Range(1, 4096));
  app->add_option("--pipeline-batches-in-flight", c.pipeline_batches_in_flight,
                  "Pipeline parallelism: steps rank 0 keeps in the pipeline at once (vLLM V1's batch queue): it "
                  "schedules the next step on the other sequences while the later stages run the ones before; "
                  "0 = the number of stages, 1 = one step at a time")
      ->default_val(0)
      ->check(CLI::Range(0, 4096));
  app->add_option("--pipeline-microbatches", c.pipeline_microbatches,
                  "Pipeline parallelism: micro-batches each step's batch is cut into (by sequence), so the stages "
                  "work at once within a step; 0 = 1 with batches in flight, else the number of stages")
      ->default_val(0)
      ->check(CLI::Range(0, 4096));
  app->add_option("--pipeline-layer-split", c.pipeline_layer_split,
                  "Pipeline parallelism: layers of each stage, e.g. 19,11 (default: shared by cost, the last stage "
                  "fewer for the LM head)")
      ->delimiter(',');
  app->add_option("--ngram-max,--prompt-lookup-max", c.speculative.ngram.max, "ngram: longest suffix looked up")->default_val(4);
  app->add_option("--ngram-min,--prompt-lookup-min", c.speculative.ngram.min, "ngram: shortest suffix looked up")->default_val(1);
  app->add_option("--threads", c.num_threads, "CPU threads (0 = every core this process may use: its CPU affinity)")->default_val(0);
}

inline void ApplySwapSpace(EngineConfig* config, double swap_space_gib) {
  config->swap_space_bytes = static_cast<int64_t>(swap_space_gib * (1ull << 30));
}

}  // namespace kvflow
