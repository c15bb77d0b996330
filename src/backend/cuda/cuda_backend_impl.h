// The CUDA backend's class and the helpers its files share (private to src/backend/cuda).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <spdlog/fmt/fmt.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_backend.h"
#include "infinigen_score.h"
#include "kernel_common.h"
#include "sampling.h"

namespace kvflow {
// Not in an anonymous namespace: the member functions are defined in several files.
namespace cuda_impl {

using cuda::DType;

constexpr size_t kAlignment = 256;

inline size_t AlignUp(size_t n, size_t a = kAlignment) { return (n + a - 1) / a * a; }

inline Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  cudaGetLastError();  // clear a non-sticky error so the next call does not report it again
  const std::string text = fmt::format("{}: {}", what, cuda::CudaErrorText(e));
  if (e == cudaErrorMemoryAllocation) return Status::OutOfMemory(text);
  return Status::Internal(text);
}
inline Status KernelStatus(int rc, const char* kernel) {
  if (rc == 0) return Status::Ok();
  return CudaStatus(static_cast<cudaError_t>(rc), kernel);
}
inline Status CublasStatus(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  if (s == CUBLAS_STATUS_ALLOC_FAILED) return Status::OutOfMemory(fmt::format("{}: cuBLAS could not allocate", what));
  return Status::Internal(fmt::format("{}: {}", what, cublasGetStatusString(s)));
}

#define KVFLOW_CUDA_RETURN(expr) KVFLOW_RETURN_IF_ERROR(CudaStatus((expr), #expr))
#define KVFLOW_KERNEL_RETURN(expr) KVFLOW_RETURN_IF_ERROR(KernelStatus((expr), #expr))
#define KVFLOW_CUBLAS_RETURN(expr) KVFLOW_RETURN_IF_ERROR(CublasStatus((expr), #expr))

// A device (cudaMalloc) or pinned host (cudaHostAlloc) allocation that frees itself.
template <bool kPinnedHost>
class Arena {
 public:
  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena() { Release(); }
  void Release() {
    if (base_) kPinnedHost ? cudaFreeHost(base_) : cudaFree(base_);
    base_ = nullptr;
    bytes_ = 0;
  }
  Status Allocate(size_t bytes, const char* what) {
    Release();
    if (bytes == 0) return Status::Ok();
    const cudaError_t e = kPinnedHost ? cudaHostAlloc(&base_, bytes, cudaHostAllocDefault) : cudaMalloc(&base_, bytes);
    if (e != cudaSuccess) {
      base_ = nullptr;
      cudaGetLastError();
      return Status::OutOfMemory(fmt::format("cannot allocate {:.2f} GiB of {} memory for {} ({})",
                                             bytes / double(1 << 30), kPinnedHost ? "pinned host" : "device", what,
                                             cuda::CudaErrorText(e)));
    }
    bytes_ = bytes;
    return Status::Ok();
  }
  char* base() const { return static_cast<char*>(base_); }
  size_t bytes() const { return bytes_; }

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
};
using DeviceArena = Arena<false>;
using PinnedArena = Arena<true>;

// Carves aligned sub-buffers out of one allocation: first a dry run to size it, then for real.
class Carver {
 public:
  explicit Carver(char* base = nullptr) : base_(base) {}
  template <typename T>
  T* Take(size_t count) {
    T* p = base_ ? reinterpret_cast<T*>(base_ + offset_) : nullptr;
    offset_ = AlignUp(offset_ + count * sizeof(T));
    return p;
  }
  void* TakeBytes(size_t bytes) { return Take<char>(bytes); }
  size_t size() const { return offset_; }

 private:
  char* base_;
  size_t offset_ = 0;
};

struct DeviceLayer {
  void* attn_norm = nullptr;
  void* wqkv = nullptr;
  void* wo = nullptr;
  void* ffn_norm = nullptr;
  void* w_gate_up = nullptr;
  void* w_down = nullptr;
  // fp32 biases, nullptr where the model has none (ModelConfig::qkv_bias, o_bias, mlp_bias).
  float* bqkv = nullptr;
  float* bo = nullptr;
  float* b_gate_up = nullptr;
  float* b_down = nullptr;
  // Per-head q/k norm weights (`dtype`), nullptr unless ModelConfig::qk_norm.
  void* q_norm = nullptr;
  void* k_norm = nullptr;
  // Gemma's norms of the attention and MLP outputs (ModelConfig::sandwich_norms), else nullptr.
  void* post_attn_norm = nullptr;
  void* post_ffn_norm = nullptr;
  // A mixture of experts (ModelConfig::num_experts > 0) in place of w_gate_up / w_down: the router
  // [E][H], every expert's gate|up [E][2F][H] and down [E][H][F] in one allocation each (the
  // grouped GEMM indexes them by expert), and Qwen2-MoE's shared expert: gate|up [2Fs][H], down
  // [H][Fs] and its gate's row [1][H]. All `dtype`.
  void* router = nullptr;
  void* expert_gate_up = nullptr;
  void* expert_down = nullptr;
  void* shared_gate_up = nullptr;
  void* shared_down = nullptr;
  void* shared_gate = nullptr;
};

// Step metadata, laid out identically in pinned staging memory and on the device so that one copy
// uploads it.
struct StepMetadata {
  int32_t* tokens = nullptr;        // [max_tokens]
  int32_t* positions = nullptr;     // [max_tokens]
  int64_t* slot_mapping = nullptr;  // [max_tokens]
  int32_t* logit_rows = nullptr;    // [max_tokens] rows of the batch whose logits are wanted
  // Decode kernel (one-token slices).
  int32_t* decode_block_tables = nullptr;  // [max_seqs][max_blocks_per_seq]
  int32_t* decode_context_lens = nullptr;  // [max_seqs]
  int32_t* decode_query_rows = nullptr;    // [max_seqs]
  // Prefill kernel (the other slices).
  int32_t* prefill_block_tables = nullptr;
  int32_t* prefill_query_starts = nullptr;
  int32_t* prefill_query_lens = nullptr;
  int32_t* prefill_context_lens = nullptr;
  // Rows [num_decode, num_decode + num_gathered_decode) of the decode arrays (likewise prefill) are
  // the slices with slot views, their tables pointing into the gather scratch.
  int64_t* gather_slots = nullptr;  // [max_gathered] cache slot of each scratch slot, -1: padding

  static size_t Carve(Carver& c, StepMetadata* m, int max_tokens, int max_seqs, int max_blocks, int max_gathered) {
    m->tokens = c.Take<int32_t>(max_tokens);
    m->positions = c.Take<int32_t>(max_tokens);
    m->slot_mapping = c.Take<int64_t>(max_tokens);
    m->logit_rows = c.Take<int32_t>(max_tokens);
    m->decode_block_tables = c.Take<int32_t>(static_cast<size_t>(max_seqs) * max_blocks);
    m->decode_context_lens = c.Take<int32_t>(max_seqs);
    m->decode_query_rows = c.Take<int32_t>(max_seqs);
    m->prefill_block_tables = c.Take<int32_t>(static_cast<size_t>(max_seqs) * max_blocks);
    m->prefill_query_starts = c.Take<int32_t>(max_seqs);
    m->prefill_query_lens = c.Take<int32_t>(max_seqs);
    m->prefill_context_lens = c.Take<int32_t>(max_seqs);
    m->gather_slots = c.Take<int64_t>(max_gathered);
    return c.size();
  }
};

// What one step runs: sizes that pick the kernels' grids, filled by PlanStep.
struct StepShape {
  int num_tokens = 0;
  int num_decode = 0;
  int num_prefill = 0;
  int max_decode_context = 0;  // grid bound for the decode kernel
  int max_prefill_query = 0;   // grid bound for the prefill kernel
  int num_logit_rows = 0;
  // Slices with slot views: their kernel rows follow the num_decode / num_prefill ones.
  int num_gathered_decode = 0;
  int num_gathered_prefill = 0;
  int max_gathered_decode_context = 0;
  int max_gathered_prefill_query = 0;
  int num_gathered_slots = 0;  // scratch slots the step fills (whole blocks)
};

class CudaBackend final : public Backend,
                          public KvBlockScoring,
                          public OffloadedKvPool,
                          public KvPacking,
                          public DeviceKvSpeculation {
 public:
  CudaBackend(const ModelConfig& config, const CudaBackendOptions& options) : config_(config), options_(options) {}
  ~CudaBackend() override;

  Status Init(const LlamaWeights* weights, uint64_t random_seed);

  Status RunStep(const ForwardBatch& batch, const LogitsSink& sink, const std::function<Status()>& layers,
                 bool capturable) override;
  Status Embed() override;
  Status RmsNorm(int layer, LayerWeight norm, bool add_delta) override;
  Status Linear(int layer, LayerWeight weight, Activation in, Activation out) override;
  Status QkNorm(int layer) override;
  Status MoeMlp(int layer) override;
  Status Rotary(int layer) override;
  Status WriteKv(int layer) override;
  Status Attention(int layer) override;
  Status AttentionOverSelection(int layer, std::span<const KvHeadSelection> selection) override;
  Status SiluMul() override;
  Status GeluTanhMul() override;
  Status NormDelta(int layer, LayerWeight norm) override;
  Status AddDelta() override;
  Status ResetKvBlockScores(int64_t size) override;
  Status ScoreKvBlocks(int layer, std::span<const KvBlockScoreJob> jobs) override;
  Status SelectTopKvBlocks(std::span<const KvBlockSelectJob> jobs, std::vector<int32_t>& chosen) override;
  Status ReadKvBlockScores(int64_t offset, std::span<float> out) override;
  Status ReadActivationRows(Activation which, int64_t first_row, int64_t rows, std::span<float> out) override;
  Status ReadKv(int layer, int kv, std::span<const int64_t> slots, std::span<float> out) override;
  Status PackKv(int layer, std::span<const int64_t> slots, std::span<std::byte> out) override;
  Status UnpackKv(int layer, std::span<const int64_t> slots, std::span<const std::byte> in) override;
  int pack_device() const override { return options_.device; }
  Result<std::unique_ptr<DeviceAllocation>> AllocatePackBuffer(int64_t bytes) override;
  Status PackKvOnDevice(int layer, std::span<const int64_t> slots, std::span<std::byte> out) override;
  Status UnpackKvOnDevice(int layer, std::span<const int64_t> slots, std::span<const std::byte> in) override;
  Result<void*> RecordComputeEvent() override;
  Result<DeviceRows> DeviceActivation(Activation which) override;
  Result<DeviceRows> DeviceResidual() override;
  bool SupportsDeviceSampling() const override { return config_.vocab_shard_rows == 0; }
  bool ComputesOnHost() const override { return false; }
  bool SupportsDeviceTokenMask() const override { return true; }
  Status CopyBlocks(std::span<const BlockMove> moves, BlockCopyKind kind) override;
  Status TransferKv(std::span<const KvTransfer> transfers) override;
  // Whether the pool is offloaded (the OffloadedKvPool capability is offered only then).
  bool kv_offloaded() const { return options_.kv_offload; }
  Status PrefetchKv(int layer, std::span<const KvHeadSelection> selection) override;
  KvOffloadStats kv_offload_stats() const override { return offload_stats_; }
  Status KeepResident(BlockId first) override;
  BlockId resident_begin() const override { return resident_begin_; }
  Status SetUpSpeculation(const Setup& setup) override;
  int partial_key_chunk_rows() const override { return kPartialKeyChunkRows; }
  int64_t partial_key_chunk_bytes(int num_partial_columns) const override;
  Status ExtendPartialKeys(int layer, std::span<const ExtendJob> jobs) override;
  Status Speculate(int layer, std::span<const SpeculateJob> jobs) override;
  Status TakeSpeculatedCounts(std::vector<int32_t>& counts) override;
  Status ReadSpeculatedSelection(int layer, std::span<const KvHeadSelection> selection,
                                 std::vector<KvHeadSelection>& out) override;

 protected:
  void* FindCapability(BackendCapability id) const override { return OfferCapabilities(this, id, kv_offloaded()); }

 public:
  const KvCacheLayout& kv_layout() const override { return layout_; }
  int num_host_blocks() const override { return num_host_blocks_; }
  int64_t kv_token_bytes() const override {
    return 2 * static_cast<int64_t>(layout_.num_kv_heads) * layout_.head_dim * static_cast<int64_t>(cuda::DTypeSize(dtype_));
  }
  const ModelConfig& model_config() const override { return config_; }
  std::string Describe() const override;

 private:
  Status AllocateWeights();
  Status UploadWeights(const LlamaWeights& weights);
  Status FillRandomWeights(uint64_t seed);
  Status AllocatePools();

  // Fills the staging metadata for `batch`; pads a decode batch to `padded_seqs` rows.
  StepShape PlanStep(const ForwardBatch& batch, int padded_seqs);
  // The head over logit rows [first_row, first_row + rows) of the step, into logits_.
  Status RunLogits(int first_row, int rows);
  Status Gemm(const void* x, const void* w, void* y, int m, int n, int k, DType out_dtype);
  Status CheckSink(const ForwardBatch& batch, const LogitsSink& sink, int64_t rows);
  // The layers (issued by `layers` from the uploaded metadata) and the head, replayed as a CUDA
  // graph per decode batch-size bucket.
  Status RunWithGraph(const ForwardBatch& batch, int bucket, const LogitsSink& sink,
                      const std::function<Status()>& layers);
  void* ActivationBuffer(Activation which) const;
  int ActivationWidth(Activation which) const;
  const void* LayerWeightPtr(int layer, LayerWeight which) const;
  const float* LayerBiasPtr(int layer, LayerWeight which) const;
  Status Drain(int first_row, int rows, const LogitsSink& sink);
  Status CopyLogitsToHost(int rows, float* dst);
  Status SampleOnDevice(std::span<const DeviceSampleRow> rows, std::vector<SampledToken>& sampled);
  int GraphBucket(int num_seqs) const;
  // `bytes` of the chunk scoring / selection staging: a pinned host region and the device region
  // of the same offset (see block_meta_*_ below).
  Status StageBlockMeta(size_t bytes, char** host, char** device);
  // Paged attention of the step's Q over `count` rows of block tables (table_stride apart) into
  // kAttention: decode (one query row per table) and prefill (a run of query rows per table).
  template <typename Args>
  void FillAttentionArgs(Args& a, const int32_t* tables, int table_stride, const int32_t* context_lens, int count,
                         const void* keys, const void* values) const;
  Status DecodeRows(const int32_t* tables, int table_stride, const int32_t* context_lens, const int32_t* query_rows,
                    int count, int max_context, const void* keys, const void* values);
  Status PrefillRows(const int32_t* tables, int table_stride, const int32_t* context_lens, const int32_t* query_starts,
                     const int32_t* query_lens, int count, int max_query, const void* keys, const void* values);
  // Unsupported while stream_ is being captured: `what` uploads per call or waits for the host.
  Status RefuseUnderCapture(const char* what);
  // An offloaded pool's PackKv (into host `pack_to`) and UnpackKv (from host `unpack_from`; pack_to
  // null): one copy per KV head and run of slots, ordered on the compute stream; returns once done.
  Status CopyPackedRuns(int layer, std::span<const int64_t> slots, std::byte* pack_to, const std::byte* unpack_from);
  // The pack kernel (kernels/kv_pack.cu) between `layer` at `slots` and the device buffer `packed`,
  // on the compute stream; the slot list goes up through pack_arena_.
  Status LaunchPack(int layer, std::span<const int64_t> slots, std::byte* packed, bool unpack);
  // Grows `arena` to at least `bytes` (by half again when it grows), waiting for the stream first:
  // queued kernels may still use the old allocation. `both_streams`: the copy stream's too.
  Status GrowScratch(DeviceArena& arena, size_t bytes, const char* what, bool both_streams = false);
  // Device speculation (cuda_speculation.cc). The partial keys of (layer, kv head): chunks of
  // kPartialKeyChunkRows rows of speculation_columns_ floats.
  float* PartialKeys(int layer, int kv_head) const;
  // At a step's start: no speculation made yet, the count log moved to the host if it filled.
  Status BeginSpeculationStep();
  // Copies the count log to taken_counts_ and empties it (waits for the stream).
  Status MoveCountLogToHost();
  // Checks `selection`'s speculated slices against the speculation made for `layer` (the same
  // slices, in order); the per-slice index of each in it, -1 for the others.
  Result<std::vector<int>> SpeculatedJobs(int layer, std::span<const KvHeadSelection> selection) const;
  // Stages GatherSelectedKv jobs for the speculated slices of `selection` (all its selected ones)
  // into `jobs` (host side of StageBlockMeta), with their block tables after them in `tables`
  // (room for every slice's table); scratch blocks numbered from 0 in slice order. `step_token`:
  // the selected rows (a prefetch: the step's own K/V is not written yet), then (attention) the
  // step's own token alone (`after_prefetch`) or the rows and the token, with each job's
  // context_len at context_out[k] (device), k counting the jobs.
  enum class SpeculatedRows { kSelected, kStepToken, kBoth };
  void FillSpeculatedGather(int layer, std::span<const KvHeadSelection> selection, const std::vector<int>& job_of,
                            SpeculatedRows rows, cuda::SelectedKvGatherJob* jobs, int32_t* tables,
                            const int32_t* device_tables, int32_t* context_out) const;
  // Offloaded pool: K (kv 0) or V of `layer` in the pool (host) and in its staging buffer (device).
  char* PoolLayer(int kv, int layer) const;
  char* StagingLayer(int kv, int layer) const;
  // Offloaded pool: K (kv 0) or V of `layer` in the resident blocks' device arena, as the address
  // block 0 would have there, so that resident block ids index it as they index the pool.
  char* ResidentLayer(int kv, int layer) const;
  // Where block `block` of `layer` lives in the device tier: the pool, or the resident arena.
  char* DeviceTierLayer(int kv, int layer, BlockId block) const;
  // Whether this step's attention reads staging buffers (an offloaded pool's non-resident step).
  bool staged_step() const { return options_.kv_offload && !resident_step_; }
  // Copies the cached blocks of every slice that reads its view at `layer` (selection empty or
  // per_head 0) from the pool to the staging buffer on `stream`, one copy per run of blocks.
  Status StageViews(int layer, std::span<const KvHeadSelection> selection, cudaStream_t stream);
  // Attention's side: the layer's staging buffer holds `selection`'s views (copied now on the
  // compute stream when nothing was prefetched for the layer).
  Status EnsureStaged(int layer, std::span<const KvHeadSelection> selection);

  ModelConfig config_;
  CudaBackendOptions options_;
  DType dtype_ = DType::kBF16;
  std::string device_name_;
  KvCacheLayout layout_;
  int num_host_blocks_ = 0;
  int max_tokens_ = 0;  // per step
  int max_seqs_ = 0;
  int max_blocks_per_seq_ = 0;
  int logit_rows_per_chunk_ = 0;

  cudaStream_t stream_ = nullptr;       // compute
  cudaStream_t copy_stream_ = nullptr;  // swap in/out
  cudaEvent_t swap_done_ = nullptr;
  cudaEvent_t compute_done_ = nullptr;
  cublasHandle_t cublas_ = nullptr;

  // Weights.
  DeviceArena weight_arena_;
  size_t weight_bytes_ = 0;
  void* embed_ = nullptr;
  void* final_norm_ = nullptr;
  void* lm_head_ = nullptr;
  std::vector<DeviceLayer> layers_;
  float* inv_freq_ = nullptr;
  // The sliding layers' RoPE where ModelConfig::local_rope_theta > 0 (Gemma-3), else inv_freq_.
  float* local_inv_freq_ = nullptr;
  float local_attention_scale_ = 1.0f;
  float attention_scale_ = 1.0f;

  // Activations and step state.
  DeviceArena work_arena_;
  float* residual_ = nullptr;  // [max_tokens, hidden] fp32
  void* hidden_ = nullptr;     // [max_tokens, hidden]
  void* qkv_ = nullptr;        // [max_tokens, (heads + 2 kv_heads) * head_dim]
  void* speculative_qkv_ = nullptr;  // like qkv_: InfiniGen's speculative projection
  void* attn_ = nullptr;       // [max_tokens, heads * head_dim]
  void* delta_ = nullptr;      // [max_tokens, hidden]
  void* gate_up_ = nullptr;    // [max_tokens, 2 * intermediate]
  void* act_ = nullptr;        // [max_tokens, intermediate]
  // MoeMlp's scratch, for chunks of up to chunk_tokens tokens of the step (cuda_moe.cc).
  struct MoeScratch {
    int chunk_tokens = 0;
    float* router_logits = nullptr;  // [chunk, E] fp32
    int32_t* ids = nullptr;          // [chunk, K]
    float* weights = nullptr;        // [chunk, K]
    int32_t* sorted_pairs = nullptr; // cuda::MoeSortedCapacity entries
    int32_t* tile_expert = nullptr;  // cuda::MoeMaxTiles entries
    int32_t* num_tiles = nullptr;    // [1]
    void* gate_up = nullptr;         // [chunk * K, 2F]
    void* act = nullptr;             // [chunk * K, F]
    void* out = nullptr;             // [chunk * K, H]
    void* shared_gate_up = nullptr;  // [chunk, 2Fs]
    void* shared_act = nullptr;      // [chunk, Fs]
    void* shared_out = nullptr;      // [chunk, H]
    float* shared_gate_logit = nullptr;  // [chunk] fp32
  } moe_;
  // Carves moe_ (nothing for a dense model).
  void CarveMoeScratch(Carver& c);
  // Refuses a mixture of experts the kernels cannot run (kernels/moe.h's limits), naming why.
  Status CheckMoeSupported() const;
  float* final_rows_ = nullptr;  // [chunk, hidden] fp32
  void* final_hidden_ = nullptr; // [chunk, hidden]
  float* logits_ = nullptr;      // [chunk, vocab] fp32
  int32_t* copy_pairs_ = nullptr;  // [2 * num_blocks] copy-on-write pairs
  void* decode_workspace_ = nullptr;
  size_t decode_workspace_bytes_ = 0;
  // One layer's gathered slot views: gather_blocks_ blocks laid out like the cache.
  void* gather_key_ = nullptr;
  void* gather_value_ = nullptr;
  int gather_blocks_ = 0;
  void* cublas_workspace_ = nullptr;
  // Device sampling (rows up to max_seqs_).
  cuda::SamplingRow* sample_rows_ = nullptr;
  int32_t* sampled_tokens_ = nullptr;
  float* sampled_logprobs_ = nullptr;
  int32_t* sampled_top_tokens_ = nullptr;
  float* sampled_top_logprobs_ = nullptr;
  void* sample_workspace_ = nullptr;
  size_t sample_workspace_bytes_ = 0;
  DeviceArena sample_tokens_arena_;  // histories and suppressed tokens, grown on demand
  PinnedArena sample_staging_;       // rows + outputs
  StepMetadata device_meta_;
  size_t meta_bytes_ = 0;
  // The step the primitives act on (for a graph: the bucket's padded shape).
  StepShape step_;

  // KV packing (KV-Runahead's wire format): the slot list of each pack launch, then, for the host
  // forms, the packed bytes on their way to or from the host.
  DeviceArena pack_arena_;
  cudaEvent_t pack_event_ = nullptr;  // RecordComputeEvent's

  DeviceArena pairs_;
  PinnedArena staging_;  // metadata mirror
  PinnedArena host_pairs_arena_;
  PinnedArena host_logits_arena_;
  StepMetadata host_meta_;
  int32_t* host_pairs_ = nullptr;
  float* host_logits_ = nullptr;

  // KV pools: [layer][block][kv_head][slot][head_dim], all layers in one buffer per K and V.
  DeviceArena kv_arena_;
  char* key_pool_ = nullptr;
  char* value_pool_ = nullptr;
  PinnedArena host_kv_arena_;
  char* host_key_pool_ = nullptr;
  char* host_value_pool_ = nullptr;
  // An offloaded pool (options_.kv_offload): key_pool_ / value_pool_ point into pinned host memory
  // (offload_pool_arena_; kernels read and write it over the bus: the write-through of new K/V,
  // KV reads, copy-on-write) and attention reads the device staging buffers of two layers (layer l
  // in buffer l % 2). Views are prefetched into them on copy_stream_, whole blocks (cudaMemcpyAsync
  // per run of consecutive blocks). Host selections are gathered by AttentionOverSelection straight
  // from the host pool, only the selected rows crossing the bus (zero-copy reads on the compute
  // stream); device speculations are gathered the same way but by PrefetchKv on copy_stream_, while
  // the previous layer computes (prefetched_selection_).
  PinnedArena offload_pool_arena_;
  DeviceArena staging_arena_;
  KvStagingLedger ledger_;  // what each staging buffer holds
  bool staged_async_[KvStagingLedger::kBuffers] = {false, false};  // prefetched on copy_stream_: wait for staged_[b]
  cudaEvent_t staged_[KvStagingLedger::kBuffers] = {nullptr, nullptr};
  cudaEvent_t staging_free_ = nullptr;  // the compute issued before a prefetch
  KvOffloadStats offload_stats_;
  // Blocks [resident_begin_, num_blocks) of an offloaded pool live in resident_arena_ on the device
  // ([kv][layer][block - resident_begin_]); a resident step reads and writes only them.
  BlockId resident_begin_ = 0;
  DeviceArena resident_arena_;
  bool resident_step_ = false;

  // TriForce's chunk scoring (ScoreKvBlocks). The score buffer holds block_scores_size_ floats (the
  // size Reset asked for, as the CPU backend's vector) in an allocation that only grows.
  DeviceArena block_scores_arena_;
  float* block_scores_ = nullptr;
  int64_t block_scores_size_ = 0;
  DeviceArena block_logits_arena_;  // scratch [num_heads][blocks of one ScoreKvBlocks call]
  // Job descriptors and block lists (and AttentionOverSelection's rows and gather jobs) go up
  // through pinned staging, appended per call: one step's layers each get their own region, so no
  // layer waits for the previous one's copy. The regions restart at the next step, once
  // block_meta_copied_ (the last copy) has completed -- which a finished step already guarantees,
  // so the wait costs nothing then.
  PinnedArena block_meta_staging_;
  DeviceArena block_meta_device_;
  size_t block_meta_used_ = 0;
  bool block_meta_restart_ = false;
  cudaEvent_t block_meta_copied_ = nullptr;
  bool in_step_ = false;  // inside RunStep: ScoreKvBlocks reads the step's Q
  const ForwardBatch* batch_ = nullptr;  // the step's batch, inside RunStep
  int attention_window_ = 0;             // the sliding window of the layer Attention runs

  // Token selections (AttentionOverSelection): the gathered K and V of one call's selections,
  // selection_blocks_ blocks each laid out like a pool layer, grown on demand; and the identity
  // block table [0, num_blocks) through which GatherSelectedKv reads physical slots as positions.
  DeviceArena selection_arena_;
  int64_t selection_blocks_ = 0;
  DeviceArena identity_table_arena_;
  // ReadKv's slot list and gathered rows on the device, and the host side of the reads.
  DeviceArena read_arena_;
  std::vector<int64_t> read_slots_;
  std::vector<uint16_t> read_rows_;

  // InfiniGen's speculation on the device (DeviceKvSpeculation, cuda_speculation.cc). The skews
  // ([layer][kv_head] matrices, then columns), the paged partial key cache ([layer][kv_head]
  // [chunk][kPartialKeyChunkRows][columns] fp32), one call's scratch (skewed queries, scores, head
  // counts), per layer parity the selected indices ([job][kv_head][cap]) that attention at that
  // layer reads, and the counts of the step's speculations (a log the selector takes between steps).
  static constexpr int kPartialKeyChunkRows = 64;
  struct SpeculatedLayer {
    int layer = -1;
    std::vector<int32_t> slices, caps;   // per job
    std::vector<int64_t> index_offset;  // per job, ints into speculated_indices_[parity]
    std::vector<int64_t> count_offset;  // per job, into the count log
  };
  int speculation_columns_ = 0;
  int speculation_chunks_ = 0;
  float speculation_alpha_ = 0.0f;
  DeviceArena skew_arena_;
  const float* skew_matrices_ = nullptr;
  const int32_t* skew_columns_ = nullptr;
  DeviceArena partial_key_arena_;
  DeviceArena speculation_scratch_;
  DeviceArena speculated_indices_[2];
  DeviceArena count_log_arena_;  // [2 steps][num_layers][max_seqs] int32
  int64_t count_log_used_ = 0;
  std::vector<int32_t> taken_counts_;  // counts moved to the host before the selector took them
  SpeculatedLayer speculated_[2];
  // An offloaded pool's prefetch of speculated rows, per layer parity: K then V gathered from the
  // host pool on the copy stream (attention appends the step's own token once it is written).
  DeviceArena prefetched_selection_[2];
  int prefetched_selection_layer_[2] = {-1, -1};
  int64_t speculated_fetch_tokens_ = 0;  // offloaded: the counts not yet added to offload_stats_

  // CUDA graphs of decode steps, by padded batch size.
  std::vector<int> graph_buckets_;
  std::map<int, cudaGraphExec_t> graphs_;
  bool graphs_failed_ = false;
};

}  // namespace cuda_impl
}  // namespace kvflow
