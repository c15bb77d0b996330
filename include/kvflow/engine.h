// kvflow::Engine — load a model, add requests, step, stream tokens.
//
//   auto engine = kvflow::Engine::Create({.model = "smollm2-135m"}).value();
//   kvflow::SamplingParams p;  p.temperature = 0;  p.max_tokens = 32;
//   auto out = engine->Generate("The capital of France is", p);
//   std::cout << out->text;
//
// An Engine is driven by one thread at a time (the server runs it on its own thread). Several
// requests decode together: every Step() runs one batch holding prefill chunks and decode tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvflow/config.h"
#include "kvflow/request.h"
#include "kvflow/sampling.h"
#include "kvflow/status.h"
#include "kvflow/tokenizer.h"

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
  int num_threads = 0;                // CPU threads; 0: all cores
  uint64_t seed = 0;                  // seeds requests that bring no seed of their own
  // Host memory for swapped-out KV (vLLM's --swap-space), capped at the size of the device pool.
  int64_t swap_space_bytes = int64_t{4} << 30;
  int num_host_kv_blocks = -1;        // overrides swap_space_bytes when >= 0
  // "auto" (recompute single sequences, swap groups that share blocks), "swap" or "recompute".
  std::string preemption_mode = "auto";
  bool enable_prefix_caching = false;  // map cached full prompt blocks instead of recomputing them
  // "paged" (vLLM FCFS, blocks on demand), "s3" (reserve prompt + predicted output, first-fit
  // decreasing, preempt and double on a misprediction), or for evaluation the Orca baselines
  // "orca-max", "orca-pow2", "orca-oracle" and S3 with true lengths, "s3-oracle".
  std::string scheduling_policy = "paged";
  // s3: the output-length predictor (written by kvflow-length-predictor train). Empty: start from
  // an untrained predictor and learn from completed requests.
  std::string length_predictor;
  bool length_predictor_online_updates = true;  // s3: retrain on completed requests
  std::string length_reservation_point;         // s3: "upper" or "middle" of the bucket; empty: the file's

  // Speculative decoding (vLLM's flags): "ngram" drafts up to num_speculative_tokens by looking
  // the last ngram_max..ngram_min tokens up earlier in the sequence (prompt lookup);
  // "draft_model" samples them from speculative_model, a smaller model with the same tokenizer
  // (its KV cache follows the target's blocks; it runs on the same device); empty: off, or
  // "draft_model" when speculative_model is set. Lossless: greedy outputs are those of plain
  // decoding and sampled ones follow the target's distribution. Requests opt out with
  // SamplingParams::speculative.
  std::string speculative_method;
  std::string speculative_model;
  // Drafts per step at most (triforce: gamma2); 0: the method's default, 4 (ngram, draft_model) or
  // 8 (triforce, whose retrieval cache drafts well enough to amortize a longer verification).
  int num_speculative_tokens = 0;
  int ngram_max = 4;
  int ngram_min = 1;
  // "triforce" (TriForce, hierarchical speculation for long contexts): the target over a retrieval
  // cache (the top chunks of its own KV, a chunk being a KV block) drafts num_speculative_tokens
  // (gamma2) tokens for the target with its full cache to verify; a bottom drafter proposes
  // triforce_draft_tokens (gamma1) tokens at a time for the middle to verify. Exact rejection
  // sampling at both levels: greedy outputs are plain decoding's, sampled ones follow the target's
  // distribution. Sequences below triforce_min_context decode plainly.
  std::string triforce_draft = "ngram";  // bottom: "ngram", "streaming" (the target over sinks + window) or "draft_model" (speculative_model, sinks + window)
  int triforce_draft_tokens = 3;          // gamma1
  int triforce_budget = 0;                // retrieval cache tokens; 0: context/8 within [256, 4096]
  int triforce_rebuild_stride = 1024;     // tokens appended before the cache is rebuilt; 0: on low acceptance only
  double triforce_rebuild_acceptance = 0.5;  // rolling acceptance below which it is rebuilt
  int triforce_min_context = 4096;        // shorter contexts decode plainly (on a 2-core CPU it paid from 4K on, not at 2K)
  int triforce_sinks = 16;                // streaming bottom: attention-sink tokens
  int triforce_window = 256;              // streaming bottom: recent tokens

  // KV selection: which cached tokens decoding attention reads, per layer and step. "" (all of
  // them), "infinigen" (InfiniGen: at layer i-1 speculate layer i's attention with a partial query
  // against a partial key cache, both skewed, and read the tokens scoring within infinigen_alpha of
  // each head's max, at most infinigen_max_fraction of the cache; layer 0 reads everything; needs
  // the model's skewing file from `kvflow skew`) or "h2o" (H2O: keep the heavy hitters by
  // accumulated attention plus a recent window, h2o_budget of the context, evicting the rest for
  // good). Prefill chunks and steps of more than one token read the whole cache. Requests opt in
  // or out with SamplingParams::kv_selection; unset means kv_selection_default.
  std::string kv_selection;
  bool kv_selection_default = true;
  int kv_selection_min_context = 0;      // shorter contexts read the whole cache
  std::string infinigen_skew_file;       // empty: <model path>.infinigen
  // Where layer i is speculated at layer i-1: "after-attention" (once its attention output joined
  // the residual; the prefetch overlaps its MLP) or "layer-input" (the paper: from its input; the
  // prefetch overlaps the whole layer, but on small models it speculates worse).
  std::string infinigen_speculate_from = "after-attention";
  double infinigen_alpha = 5.0;          // logit margin below each head's max (the paper: 4 OPT, 5 Llama-2)
  double infinigen_max_fraction = 0.2;   // cap on the tokens a layer reads (the paper: 20%)
  // InfiniGen's KV pool manager (the paper's §4.4): the most cached tokens its host pool keeps per
  // sequence and layer (0: no cap). Past it, each new token evicts a victim chosen by
  // infinigen_eviction: "counter" (the paper's: the fewest fetches, every count halved when one
  // saturates), "lru" (least recently fetched) or "fifo" (oldest); an evicted token is never read
  // again at that layer. The paged KV pool still holds it: the cap limits what attention reads.
  int infinigen_host_kv_tokens = 0;
  std::string infinigen_eviction = "counter";
  double h2o_budget = 0.2;               // fraction of the context H2O keeps
  double h2o_recent_share = 0.5;         // of the budget, the recent window (the rest: heavy hitters)

  // KV offload (InfiniGen's and FlexGen's setting): every sequence's KV lives in a host pool (the
  // KV cache size is host memory then) and the device keeps only two layers' staging buffers; each
  // layer's attention fetches what it reads from the host pool, prefetched during the previous
  // layer where it is known by then: every cached token (FlexGen's full offload), or with
  // kv_selection infinigen only the speculated tokens. There is no swap space (preemption
  // recomputes); TriForce and draft models are refused.
  bool kv_offload = false;

  // KV-Runahead (seed 001): under `mpirun -np P`, prompts of at least prefill_parallel_min_tokens
  // tokens are prefilled across all P ranks; this engine runs on the last rank, which keeps the
  // KV cache and decodes, and the other ranks run kvflow's prefill workers (the server and CLI
  // start them by themselves). "kv-runahead" (the chain) or "tsp" (the all-gather baseline); empty:
  // off. The prefilled blocks reach the request through the prefix cache, which this turns on.
  std::string prefill_parallel;
  int prefill_parallel_min_tokens = 2048;
  // The partition lookup table `kvflow prefill-bench --search` writes; empty, missing or corrupt:
  // the even split (with a warning).
  std::string prefill_partition_table;

  // CUDA only. Share of the GPU's memory for weights, activations and the KV pool (which gets the
  // rest, unless kv_cache_bytes / num_kv_blocks fix it).
  double gpu_memory_utilization = 0.9;
  // CPU: "auto" keeps a GGUF's Q4_0/Q4_1/Q8_0 and K-quant (Q2_K..Q6_K) matrices in their blocks
  // (dot products on the quantized weights with 8-bit activations, as llama.cpp computes) and
  // F16/BF16 matrices 16-bit (widened in registers: exact fp32 products), "f32" dequantizes every
  // weight to fp32 (exact: the reference). CUDA weights/activations/KV: "fp16", "bf16" or "auto" (bf16).
  std::string dtype = "auto";
  // KV cache elements. CPU: "auto" (fp16 when weights stay quantized or 16-bit, as llama.cpp pairs them;
  // fp32 with fp32 weights), "f16", "f32" or "q4" (also "int4": 4-bit groups of 32 along head_dim with
  // an fp16 scale and minimum, llama.cpp's Q4_1 layout, 0.625 bytes a value; head_dim must be a
  // multiple of 32; InfiniGen's INT4 baseline). CUDA: "auto" (the dtype's 16-bit type); q4 is refused.
  std::string kv_cache_dtype = "auto";
  bool enforce_eager = false;  // CUDA: no CUDA graphs for decode steps
};

// S3 (scheduling_policy "s3"): its length predictor and supervisor. Zero under other policies.
struct S3Stats {
  int64_t predictions = 0;
  int64_t compared = 0;         // finished requests whose true length bucket is known
  int64_t under_predicted = 0;  // finished requests whose output outgrew the predicted bucket
  int64_t over_predicted = 0;
  int64_t correct = 0;
  int64_t reservation_preemptions = 0;  // preemptions of exhausted reservations (one per miss)
  int64_t online_updates = 0;
  double predict_seconds = 0;
  double update_seconds = 0;
};

// Speculative decoding (vLLM's spec_decode metrics): acceptance rate = accepted / draft tokens;
// mean accepted length = 1 + accepted / drafts (tokens per verification pass of a sequence).
struct SpecDecodeStats {
  int64_t num_drafts = 0;           // verification passes of a sequence with at least one draft
  int64_t num_draft_tokens = 0;
  int64_t num_accepted_tokens = 0;
  std::vector<int64_t> accepted_per_position;  // drafts accepted at position 0, 1, ...
  // TriForce (speculative_method "triforce"): its middle level (the target over a retrieval cache)
  // verifying the bottom drafter's tokens, per sequence pass.
  int64_t middle_passes = 0;
  int64_t middle_draft_tokens = 0;     // bottom drafts the middle verified
  int64_t middle_accepted_tokens = 0;  // of those, kept
  int64_t bottom_passes = 0;           // model passes of a bottom drafter (none for n-gram)
  int64_t retrieval_builds = 0;        // retrieval caches built or rebuilt (full-cache middle passes)
  int64_t plain_steps = 0;             // sequence steps decoded without drafts because TriForce would not pay
  int64_t retrieval_caches = 0;        // sequences holding a retrieval cache now (a gauge)
  double middle_seconds = 0;           // wall time in middle passes
  double bottom_seconds = 0;           // wall time in the bottom drafter

  // Adds `sign` times every counter of `o` (sign -1: the difference of two snapshots).
  void Add(const SpecDecodeStats& o, int sign = 1) {
    num_drafts += sign * o.num_drafts;
    num_draft_tokens += sign * o.num_draft_tokens;
    num_accepted_tokens += sign * o.num_accepted_tokens;
    if (accepted_per_position.size() < o.accepted_per_position.size()) {
      accepted_per_position.resize(o.accepted_per_position.size(), 0);
    }
    for (size_t i = 0; i < o.accepted_per_position.size(); ++i) accepted_per_position[i] += sign * o.accepted_per_position[i];
    middle_passes += sign * o.middle_passes;
    middle_draft_tokens += sign * o.middle_draft_tokens;
    middle_accepted_tokens += sign * o.middle_accepted_tokens;
    bottom_passes += sign * o.bottom_passes;
    retrieval_builds += sign * o.retrieval_builds;
    plain_steps += sign * o.plain_steps;
    retrieval_caches += sign * o.retrieval_caches;
    middle_seconds += sign * o.middle_seconds;
    bottom_seconds += sign * o.bottom_seconds;
  }
};

// KV selection (EngineConfig::kv_selection): how much of the cache attention read. A "read" is one
// sequence step of one token at one layer; its tokens are those each KV head read.
struct KvSelectionStats {
  int64_t decode_tokens = 0;     // sequence steps of one token under a selection method
  int64_t layer_reads_selected = 0;  // reads over a selection (InfiniGen: speculated layers)
  int64_t layer_reads_full = 0;      // reads of the whole cache (InfiniGen's layer 0, short contexts)
  int64_t tokens_selected = 0;   // cached tokens the selected reads took, per KV head (the step's own included)
  int64_t tokens_available = 0;  // cached tokens those reads could have taken
  int64_t bytes_read = 0;        // K and V bytes attention read at every layer (what an offloaded cache fetches)
  int64_t bytes_full = 0;        // K and V bytes full attention would have read
  double select_seconds = 0;     // host time speculating and selecting
  int64_t tokens_evicted = 0;    // (token, layer) entries InfiniGen's capped host pool evicted

  // Adds `sign` times every counter of `o` (sign -1: the difference of two snapshots).
  void Add(const KvSelectionStats& o, int sign = 1) {
    decode_tokens += sign * o.decode_tokens;
    layer_reads_selected += sign * o.layer_reads_selected;
    layer_reads_full += sign * o.layer_reads_full;
    tokens_selected += sign * o.tokens_selected;
    tokens_available += sign * o.tokens_available;
    bytes_read += sign * o.bytes_read;
    bytes_full += sign * o.bytes_full;
    select_seconds += sign * o.select_seconds;
    tokens_evicted += sign * o.tokens_evicted;
  }

  double selection_fraction() const {
    return tokens_available > 0 ? static_cast<double>(tokens_selected) / static_cast<double>(tokens_available) : 0.0;
  }
};

// KV offload (EngineConfig::kv_offload): what moved between the host pool and the device's staging
// buffers. A fetch is one layer of one step.
struct KvOffloadStats {
  int64_t prefetches = 0;         // fetches issued during the previous layer (overlappable with its compute)
  int64_t on_demand_fetches = 0;  // fetches attention issued itself (layer 0; selections known only at the layer)
  int64_t bytes_fetched = 0;      // K and V bytes host pool -> staging
  int64_t bytes_written = 0;      // K and V bytes of the steps' new tokens written to the host pool
  double fetch_seconds = 0;       // time spent fetching (on the CPU backend: the copies themselves)

  void Add(const KvOffloadStats& o, int sign = 1) {
    prefetches += sign * o.prefetches;
    on_demand_fetches += sign * o.on_demand_fetches;
    bytes_fetched += sign * o.bytes_fetched;
    bytes_written += sign * o.bytes_written;
    fetch_seconds += sign * o.fetch_seconds;
  }
};

struct EngineStats {
  int num_waiting = 0;  // requests
  int num_running = 0;
  int num_swapped = 0;
  int num_running_seqs = 0;
  int kv_blocks_total = 0;
  int kv_blocks_free = 0;       // allocatable, including unused prefix-cache blocks
  int kv_blocks_cached = 0;     // unused blocks kept for prefix hits
  int64_t kv_blocks_logical = 0;  // blocks the running sequences would hold without sharing
  int host_blocks_total = 0;
  int host_blocks_free = 0;
  double prefix_cache_hit_rate = 0.0;  // of full prompt blocks admitted with prefix caching on
  int64_t prompt_tokens_processed = 0;
  int64_t generated_tokens = 0;
  int64_t num_preemptions = 0;  // recompute + swap
  int64_t num_preemptions_swap = 0;
  int64_t blocks_swapped_out = 0;
  int64_t blocks_swapped_in = 0;
  int64_t blocks_copied = 0;    // copy-on-write
  int64_t num_steps = 0;
  S3Stats s3;
  SpecDecodeStats spec;
  KvSelectionStats kv_selection;
  KvOffloadStats kv_offload;
};

// What one Step() did.
struct StepResult {
  int num_seqs = 0;
  int num_prefill_tokens = 0;
  int num_decode_tokens = 0;
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> Create(const EngineConfig& config);
  virtual ~Engine() = default;

  // Queues a request. `on_event` is called from Step() for each new token and once at the end.
  virtual Result<RequestId> AddRequest(const std::string& prompt, const SamplingParams& params,
                                       StreamCallback on_event = {}) = 0;
  virtual Result<RequestId> AddRequest(std::vector<int32_t> prompt_tokens, const SamplingParams& params,
                                       StreamCallback on_event = {}) = 0;
  // The checks AddRequest makes (parameters, prompt ids, lengths, limits) without queuing anything.
  // Reads only the configuration, so any thread may call it while another drives the engine.
  virtual Status ValidateRequest(const std::vector<int32_t>& prompt_tokens, const SamplingParams& params) const = 0;
  // Stops a request and frees its KV blocks; its callback receives FinishReason::kCancelled.
  virtual Status Cancel(RequestId id) = 0;

  // Runs one iteration: schedules a batch, runs the model, samples, streams.
  virtual Result<StepResult> Step() = 0;
  virtual bool HasUnfinishedRequests() const = 0;

  // Runs requests to completion (together, in one batch when they fit). With n > 1 every
  // completion is in RequestOutput::outputs.
  virtual Result<RequestOutput> Generate(const std::string& prompt, const SamplingParams& params,
                                         StreamCallback on_event = {}) = 0;
  virtual Result<std::vector<RequestOutput>> Generate(const std::vector<std::string>& prompts,
                                                      const SamplingParams& params) = 0;

  virtual const ModelConfig& model_config() const = 0;
  virtual const EngineConfig& config() const = 0;
  virtual const Tokenizer& tokenizer() const = 0;
  virtual EngineStats stats() const = 0;
  virtual std::string Describe() const = 0;
};

// Where short model names are looked up: $KVFLOW_MODEL_DIR, ./models, and the models/ folder of
// the source tree kvflow was built from.
std::vector<std::string> ModelSearchDirs();
// Resolves a path or short name to a file or directory path ("tiny-random" resolves to itself).
Result<std::string> ResolveModel(const std::string& path_or_name);

}  // namespace kvflow
