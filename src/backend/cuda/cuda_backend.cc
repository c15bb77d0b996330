// The CUDA backend (see cuda_backend.h). One forward pass per step on one stream:
//
//   embedding gather -> per layer: RMSNorm, QKV GEMM, RoPE, reshape_and_cache, paged attention
//   (decode kernel for one-token slices, prefill kernel for the rest), O GEMM, add + RMSNorm,
//   gate_up GEMM, SiLU*mul, down GEMM -> gather logit rows, final norm, LM-head GEMM (fp32 out).
//   A model with biases adds each one (fp32) right after its GEMM (kernels/bias.cu).
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
// and the unchanged paged kernels read each head's own tokens. The selectors compute on the host:
// ReadActivationRows and ReadKv copy to the host and wait for the stream (correct, synchronous;
// the device-side scoring of kernels/infinigen_score.h is the later fast path).
//
// TriForce's chunk scoring (ScoreKvBlocks, per layer inside a step) uploads each call's jobs through
// pinned staging without waiting on the stream and runs kernels/kv_block_select.cu on the step's Q
// and the layer's K pool; selection copies its indices back, so it waits. The score buffer and the
// scoring scratch are allocated on first use, outside the memory budget (they are small: 4 bytes
// per scored block, and num_heads x that for one call's scratch).
#include "backend/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>

#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>

#include "activation.h"
#include "attention_decode.h"
#include "attention_prefill.h"
#include "bias.h"
#include "backend/cpu/kv_block_select.h"
#include "backend/cuda/cuda_api.h"
#include "backend/cuda/cuda_device.h"
#include "cache_ops.h"
#include "embedding.h"
#include "fill.h"
#include "infinigen_score.h"
#include "kv_block_select.h"
#include "model/rope.h"
#include "rms_norm.h"
#include "rotary.h"
#include "sampling.h"

namespace kvflow {
namespace {

using cuda::DType;

constexpr size_t kAlignment = 256;
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;
// Device memory kept free beyond the budget's parts: CUDA graphs, cuBLAS heuristics, the context.
constexpr size_t kReserveBytes = size_t{256} << 20;
// Rows of logits computed per LM-head GEMM (a whole-prompt logits request runs in chunks).
constexpr int kMaxLogitRowsPerChunk = 256;

size_t AlignUp(size_t n, size_t a = kAlignment) { return (n + a - 1) / a * a; }

Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  cudaGetLastError();  // clear a non-sticky error so the next call does not report it again
  const std::string text = fmt::format("{}: {}", what, cuda::CudaErrorText(e));
  if (e == cudaErrorMemoryAllocation) return Status::OutOfMemory(text);
  return Status::Internal(text);
}
Status KernelStatus(int rc, const char* kernel) {
  if (rc == 0) return Status::Ok();
  return CudaStatus(static_cast<cudaError_t>(rc), kernel);
}
Status CublasStatus(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  if (s == CUBLAS_STATUS_ALLOC_FAILED) return Status::OutOfMemory(fmt::format("{}: cuBLAS could not allocate", what));
  return Status::Internal(fmt::format("{}: {}", what, cublasGetStatusString(s)));
}

#define KVFLOW_CUDA_RETURN(expr) KVFLOW_RETURN_IF_ERROR(CudaStatus((expr), #expr))
#define KVFLOW_KERNEL_RETURN(expr) KVFLOW_RETURN_IF_ERROR(KernelStatus((expr), #expr))
#define KVFLOW_CUBLAS_RETURN(expr) KVFLOW_RETURN_IF_ERROR(CublasStatus((expr), #expr))

cudaDataType_t CudaDataType(DType t) {
  return t == DType::kF32 ? CUDA_R_32F : t == DType::kF16 ? CUDA_R_16F : CUDA_R_16BF;
}

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

// fp16/bf16 -> fp32 on the host (exact), for the reads the selectors make.
void WidenToFloat(const uint16_t* src, size_t n, DType t, float* dst) {
  if (t == DType::kF16) {
    for (size_t i = 0; i < n; ++i) {
      __half h;
      std::memcpy(static_cast<void*>(&h), &src[i], 2);
      dst[i] = __half2float(h);
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
      std::memcpy(&dst[i], &bits, 4);
    }
  }
}

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

class CudaBackend final : public Backend {
 public:
  CudaBackend(const ModelConfig& config, const CudaBackendOptions& options) : config_(config), options_(options) {}
  ~CudaBackend() override;

  Status Init(const LlamaWeights* weights, uint64_t random_seed);

  Status RunStep(const ForwardBatch& batch, const LogitsSink& sink, const std::function<Status()>& layers,
                 bool capturable) override;
  Status Embed() override;
  Status RmsNorm(int layer, LayerWeight norm, bool add_delta) override;
  Status Linear(int layer, LayerWeight weight, Activation in, Activation out) override;
  Status Rotary() override;
  Status WriteKv(int layer) override;
  Status Attention(int layer) override;
  Status AttentionOverSelection(int layer, std::span<const KvHeadSelection> selection) override;
  Status SiluMul() override;
  Status AddDelta() override;
  Status ResetKvBlockScores(int64_t size) override;
  Status ScoreKvBlocks(int layer, std::span<const KvBlockScoreJob> jobs) override;
  Status SelectTopKvBlocks(std::span<const KvBlockSelectJob> jobs, std::vector<int32_t>& chosen) override;
  Status ReadKvBlockScores(int64_t offset, std::span<float> out) override;
  Status ReadActivationRows(Activation which, int64_t first_row, int64_t rows, std::span<float> out) override;
  Status ReadKv(int layer, int kv, std::span<const int64_t> slots, std::span<float> out) override;
  Status PackKv(int layer, std::span<const int64_t> slots, std::span<std::byte> out) override;
  Status UnpackKv(int layer, std::span<const int64_t> slots, std::span<const std::byte> in) override;
  bool SupportsDeviceSampling() const override { return true; }
  Status CopyBlocks(std::span<const BlockMove> moves, BlockCopyKind kind) override;
  Status TransferKv(std::span<const KvTransfer> transfers) override;
  bool kv_offloaded() const override { return options_.kv_offload; }
  Status PrefetchKv(int layer, std::span<const KvHeadSelection> selection) override;
  KvOffloadStats kv_offload_stats() const override { return offload_stats_; }
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
  // The copies of PackKv (into host `pack_to`) and UnpackKv (from host `unpack_from`; pack_to null),
  // one per KV head and run of slots, ordered on the compute stream; returns once they are done.
  Status CopyPacked(int layer, std::span<const int64_t> slots, std::byte* pack_to, const std::byte* unpack_from);
  // Grows `arena` to at least `bytes` (by half again when it grows), waiting for the stream first:
  // queued kernels may still use the old allocation.
  Status GrowScratch(DeviceArena& arena, size_t bytes, const char* what);
  // Offloaded pool: K (kv 0) or V of `layer` in the pool (host) and in its staging buffer (device).
  char* PoolLayer(int kv, int layer) const;
  char* StagingLayer(int kv, int layer) const;
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
  // per run of consecutive blocks); selections are gathered by AttentionOverSelection straight from
  // the host pool, only the selected rows crossing the bus (zero-copy reads on the compute stream:
  // not yet overlapped with the previous layer).
  PinnedArena offload_pool_arena_;
  DeviceArena staging_arena_;
  KvStagingLedger ledger_;  // what each staging buffer holds
  bool staged_async_[KvStagingLedger::kBuffers] = {false, false};  // prefetched on copy_stream_: wait for staged_[b]
  cudaEvent_t staged_[KvStagingLedger::kBuffers] = {nullptr, nullptr};
  cudaEvent_t staging_free_ = nullptr;  // the compute issued before a prefetch
  KvOffloadStats offload_stats_;

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

  // CUDA graphs of decode steps, by padded batch size.
  std::vector<int> graph_buckets_;
  std::map<int, cudaGraphExec_t> graphs_;
  bool graphs_failed_ = false;
};

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
  if (stream_) cudaStreamDestroy(stream_);
  if (copy_stream_) cudaStreamDestroy(copy_stream_);
}

Status CudaBackend::Init(const LlamaWeights* weights, uint64_t random_seed) {
  KVFLOW_RETURN_IF_ERROR(config_.Validate());
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
        "the CUDA attention kernels support head_dim 64 or 128 and block_size 8, 16 or 32; this model has "
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
  const size_t NH = config_.num_heads, KV = config_.num_kv_heads, V = config_.vocab_size;
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
      l.w_gate_up = c.TakeBytes(2 * F * H * es);
      l.w_down = c.TakeBytes(H * F * es);
      if (config_.qkv_bias) l.bqkv = c.Take<float>((NH + 2 * KV) * D);
      if (config_.o_bias) l.bo = c.Take<float>(H);
      if (config_.mlp_bias) {
        l.b_gate_up = c.Take<float>(2 * F);
        l.b_down = c.Take<float>(H);
      }
    }
    inv_freq_ = c.Take<float>(D / 2);
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
  KVFLOW_RETURN_IF_ERROR(upload_matrix(w.embed, embed_));
  KVFLOW_RETURN_IF_ERROR(upload(w.final_norm, final_norm_));
  if (!w.lm_head.empty()) KVFLOW_RETURN_IF_ERROR(upload_matrix(w.lm_head, lm_head_));
  if (w.layers.size() != layers_.size()) return Status::InvalidArgument("weights have the wrong number of layers");
  KVFLOW_RETURN_IF_ERROR(CheckBiases(config_, w));
  auto upload_bias = [&](const std::vector<float>& src, float* dst) -> Status {
    if (dst == nullptr) return Status::Ok();  // CheckBiases: src is empty too
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
    KVFLOW_RETURN_IF_ERROR(upload_matrix(src.w_gate_up, dst.w_gate_up));
    KVFLOW_RETURN_IF_ERROR(upload_matrix(src.w_down, dst.w_down));
    KVFLOW_RETURN_IF_ERROR(upload_bias(src.bqkv, dst.bqkv));
    KVFLOW_RETURN_IF_ERROR(upload_bias(src.bo, dst.bo));
    KVFLOW_RETURN_IF_ERROR(upload_bias(src.b_gate_up, dst.b_gate_up));
    KVFLOW_RETURN_IF_ERROR(upload_bias(src.b_down, dst.b_down));
  }
  return Status::Ok();
}

Status CudaBackend::FillRandomWeights(uint64_t seed) {
  const int64_t H = config_.hidden_size, D = config_.head_dim, F = config_.intermediate_size;
  const int64_t NH = config_.num_heads, KV = config_.num_kv_heads, V = config_.vocab_size;
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
    KVFLOW_RETURN_IF_ERROR(fill(l.w_gate_up, 2 * F * H, matrix_scale(H), 0.0f));
    KVFLOW_RETURN_IF_ERROR(fill(l.w_down, H * F, matrix_scale(F), 0.0f));
    auto fill_bias = [&](float* p, int64_t count) -> Status {
      if (p == nullptr) return Status::Ok();
      KVFLOW_KERNEL_RETURN(cuda::FillUniform(DType::kF32, p, count, seed * 1000003 + tensor++, 0.1f, 0.0f, stream_));
      return Status::Ok();
    };
    KVFLOW_RETURN_IF_ERROR(fill_bias(l.bqkv, (NH + 2 * KV) * D));
    KVFLOW_RETURN_IF_ERROR(fill_bias(l.bo, H));
    KVFLOW_RETURN_IF_ERROR(fill_bias(l.b_gate_up, 2 * F));
    KVFLOW_RETURN_IF_ERROR(fill_bias(l.b_down, H));
  }
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  return Status::Ok();
}

Status CudaBackend::AllocatePools() {
  const size_t H = config_.hidden_size, D = config_.head_dim, F = config_.intermediate_size;
  const size_t NH = config_.num_heads, KV = config_.num_kv_heads, V = config_.vocab_size;
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
    gate_up_ = c.TakeBytes(T * 2 * F * es);
    act_ = c.TakeBytes(T * F * es);
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
    case LayerWeight::kFfnNorm: break;
  }
  return nullptr;
}

Status CudaBackend::Embed() {
  const int H = config_.hidden_size;
  KVFLOW_KERNEL_RETURN(cuda::GatherRowsToF32(dtype_, embed_, H, config_.vocab_size, device_meta_.tokens,
                                             step_.num_tokens, H, residual_, stream_));
  return Status::Ok();
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

Status CudaBackend::Rotary() {
  KVFLOW_KERNEL_RETURN(cuda::ApplyRotaryEmbedding(dtype_, qkv_, ActivationWidth(Activation::kQkv),
                                                  device_meta_.positions, step_.num_tokens, config_.num_heads,
                                                  config_.num_kv_heads, config_.head_dim, inv_freq_,
                                                  attention_scale_, stream_));
  return Status::Ok();
}

Status CudaBackend::WriteKv(int layer) {
  const int NH = config_.num_heads, KV = config_.num_kv_heads, D = config_.head_dim;
  const int QKV = ActivationWidth(Activation::kQkv);
  const size_t es = cuda::DTypeSize(dtype_);
  const size_t layer_bytes = layout_.layer_stride() * es;
  char* qkv = static_cast<char*>(qkv_);
  KVFLOW_KERNEL_RETURN(cuda::ReshapeAndCache(dtype_, qkv + static_cast<size_t>(NH) * D * es, QKV,
                                             qkv + static_cast<size_t>(NH + KV) * D * es, QKV,
                                             key_pool_ + layer * layer_bytes, value_pool_ + layer * layer_bytes,
                                             device_meta_.slot_mapping, step_.num_tokens, KV, D, layout_.block_size,
                                             stream_));
  if (options_.kv_offload) {
    // Written through to the host pool (above) and into the layer's staging buffer, after the
    // prefetch that fills it (whose copies of these slots are stale).
    const int buffer = KvStagingLedger::BufferOf(layer);
    if (ledger_.HoldsLayer(layer) && staged_async_[buffer]) {
      KVFLOW_CUDA_RETURN(cudaStreamWaitEvent(stream_, staged_[buffer], 0));
      staged_async_[buffer] = false;
    }
    KVFLOW_KERNEL_RETURN(cuda::ReshapeAndCache(dtype_, qkv + static_cast<size_t>(NH) * D * es, QKV,
                                               qkv + static_cast<size_t>(NH + KV) * D * es, QKV, StagingLayer(0, layer),
                                               StagingLayer(1, layer), device_meta_.slot_mapping, step_.num_tokens, KV,
                                               D, layout_.block_size, stream_));
    offload_stats_.bytes_written += static_cast<int64_t>(step_.num_tokens) * kv_token_bytes();
  }
  return Status::Ok();
}

Status CudaBackend::Attention(int layer) {
  const StepMetadata& m = device_meta_;
  const size_t layer_bytes = layout_.layer_stride() * cuda::DTypeSize(dtype_);
  const char* key_cache = key_pool_ + layer * layer_bytes;
  const char* value_cache = value_pool_ + layer * layer_bytes;
  if (options_.kv_offload) {
    KVFLOW_RETURN_IF_ERROR(EnsureStaged(layer, {}));
    key_cache = StagingLayer(0, layer);
    value_cache = StagingLayer(1, layer);
  }
  // Slot views read the layer's gathered copy of their slots (the K/V this step wrote included).
  if (step_.num_gathered_slots > 0) {
    KVFLOW_KERNEL_RETURN(cuda::GatherSlots(dtype_, key_cache, value_cache, m.gather_slots, step_.num_gathered_slots,
                                           gather_key_, gather_value_, config_.num_kv_heads, config_.head_dim,
                                           layout_.block_size, stream_));
  }
  const size_t table = static_cast<size_t>(max_blocks_per_seq_);
  if (step_.num_decode > 0) {
    KVFLOW_RETURN_IF_ERROR(DecodeRows(m.decode_block_tables, max_blocks_per_seq_, m.decode_context_lens,
                                      m.decode_query_rows, step_.num_decode, step_.max_decode_context, key_cache,
                                      value_cache));
  }
  if (step_.num_gathered_decode > 0) {
    const size_t first = static_cast<size_t>(step_.num_decode);
    KVFLOW_RETURN_IF_ERROR(DecodeRows(m.decode_block_tables + first * table, max_blocks_per_seq_,
                                      m.decode_context_lens + first, m.decode_query_rows + first,
                                      step_.num_gathered_decode, step_.max_gathered_decode_context, gather_key_,
                                      gather_value_));
  }
  if (step_.num_prefill > 0) {
    KVFLOW_RETURN_IF_ERROR(PrefillRows(m.prefill_block_tables, max_blocks_per_seq_, m.prefill_context_lens,
                                       m.prefill_query_starts, m.prefill_query_lens, step_.num_prefill,
                                       step_.max_prefill_query, key_cache, value_cache));
  }
  if (step_.num_gathered_prefill > 0) {
    const size_t first = static_cast<size_t>(step_.num_prefill);
    KVFLOW_RETURN_IF_ERROR(PrefillRows(m.prefill_block_tables + first * table, max_blocks_per_seq_,
                                       m.prefill_context_lens + first, m.prefill_query_starts + first,
                                       m.prefill_query_lens + first, step_.num_gathered_prefill,
                                       step_.max_gathered_prefill_query, gather_key_, gather_value_));
  }
  return Status::Ok();
}

// The fields the paged decode and prefill kernels' arguments share: the step's Q/attention rows,
// the model's heads, the pools and the block tables.
template <typename Args>
void CudaBackend::FillAttentionArgs(Args& a, const int32_t* tables, int table_stride, const int32_t* context_lens,
                                    int count, const void* keys, const void* values) const {
  a.dtype = dtype_;
  a.out = attn_;
  a.out_row_stride = ActivationWidth(Activation::kAttention);
  a.query = qkv_;
  a.query_row_stride = ActivationWidth(Activation::kQkv);
  a.block_table_stride = table_stride;
  a.num_heads = config_.num_heads;
  a.num_kv_heads = config_.num_kv_heads;
  a.head_dim = config_.head_dim;
  a.block_size = layout_.block_size;
  a.scale = 1.0f / std::sqrt(static_cast<float>(config_.head_dim));
  a.key_cache = keys;
  a.value_cache = values;
  a.block_tables = tables;
  a.context_lens = context_lens;
  a.num_seqs = count;
}

Status CudaBackend::DecodeRows(const int32_t* tables, int table_stride, const int32_t* context_lens,
                               const int32_t* query_rows, int count, int max_context, const void* keys,
                               const void* values) {
  cuda::PagedDecodeArgs a;
  FillAttentionArgs(a, tables, table_stride, context_lens, count, keys, values);
  a.query_rows = query_rows;
  a.max_context_len = max_context;
  a.workspace = decode_workspace_;
  a.workspace_bytes = decode_workspace_bytes_;
  KVFLOW_KERNEL_RETURN(cuda::PagedAttentionDecode(a, stream_));
  return Status::Ok();
}

Status CudaBackend::PrefillRows(const int32_t* tables, int table_stride, const int32_t* context_lens,
                                const int32_t* query_starts, const int32_t* query_lens, int count, int max_query,
                                const void* keys, const void* values) {
  cuda::PagedPrefillArgs a;
  FillAttentionArgs(a, tables, table_stride, context_lens, count, keys, values);
  a.query_starts = query_starts;
  a.query_lens = query_lens;
  a.max_query_len = max_query;
  KVFLOW_KERNEL_RETURN(cuda::PagedAttentionPrefill(a, stream_));
  return Status::Ok();
}

// ---- InfiniGen's and H2O's token selections ------------------------------------------------------

Status CudaBackend::RefuseUnderCapture(const char* what) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  KVFLOW_CUDA_RETURN(cudaStreamIsCapturing(stream_, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    return Status::Unsupported(fmt::format("{} cannot be captured in a CUDA graph: hooks that use it are not capturable",
                                           what));
  }
  return Status::Ok();
}

Status CudaBackend::GrowScratch(DeviceArena& arena, size_t bytes, const char* what) {
  if (bytes <= arena.bytes()) return Status::Ok();
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  // Half again, so a slowly growing selection reallocates (and waits) rarely; exactly `bytes` if
  // that much more does not fit.
  const size_t grown = AlignUp(std::max(bytes, arena.bytes() + arena.bytes() / 2));
  if (arena.Allocate(grown, what).ok()) return Status::Ok();
  return arena.Allocate(AlignUp(bytes), what);
}

// One call plans three kinds of kernel rows per kernel (decode, prefill), each read from its own
// K/V: the pool (a slice without selection, view of the whole table or a block subset), the step's
// slot-view scratch (a slice without selection whose view is explicit slots, as Attention reads
// it), and this call's selection scratch. The rows go up with the gather jobs in one staged copy.
Status CudaBackend::AttentionOverSelection(int layer, std::span<const KvHeadSelection> selection) {
  if (!in_step_ || batch_ == nullptr) return Status::Internal("attention outside a step");
  if (layer < 0 || layer >= config_.num_layers) return Status::InvalidArgument("attention: layer out of range");
  const ForwardBatch& batch = *batch_;
  KVFLOW_RETURN_IF_ERROR(ValidateKvHeadSelections(selection, batch, layout_));
  const bool any_selection =
      std::any_of(selection.begin(), selection.end(), [](const KvHeadSelection& s) { return s.per_head > 0; });
  if (!any_selection) return Attention(layer);
  KVFLOW_RETURN_IF_ERROR(RefuseUnderCapture("attention over token selections"));
  const int bs = layout_.block_size, KV = config_.num_kv_heads;
  // GatherSelectedKv takes int32 positions: a physical slot is one through the identity table.
  const int64_t pool_slots = static_cast<int64_t>(layout_.num_blocks) * bs;
  if (pool_slots > std::numeric_limits<int32_t>::max()) {
    return Status::Unsupported(fmt::format("token selections over a pool of {} slots (more than int32)", pool_slots));
  }

  enum Source { kPool = 0, kSlotView = 1, kSelected = 2 };
  struct Row {
    int slice = 0;
    int context = 0;
    std::vector<int32_t> table;
  };
  std::vector<Row> decode_rows[3], prefill_rows[3];
  int table_stride = 1;
  int64_t next_slot_view_block = 0;  // PlanStep's numbering of the slot-view scratch
  int64_t selected_blocks = 0, selected_slots = 0;
  int num_selected = 0;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const SequenceSlice& s = batch.seqs[i];
    const KvHeadSelection& sel = selection[i];
    Row row;
    row.slice = static_cast<int>(i);
    Source source;
    const bool slot_view = s.view.kind == KvView::Kind::kSlots;
    const int64_t slot_view_first = next_slot_view_block;
    if (slot_view) next_slot_view_block += (s.view_size() + bs - 1) / bs;
    if (sel.per_head > 0) {
      if (sel.per_head > options_.max_model_len) {
        return Status::InvalidArgument(fmt::format("token selection of {} tokens per KV head exceeds max_model_len {}",
                                                   sel.per_head, options_.max_model_len));
      }
      source = kSelected;
      row.context = sel.per_head;
      const int blocks = (sel.per_head + bs - 1) / bs;
      for (int b = 0; b < blocks; ++b) row.table.push_back(static_cast<int32_t>(selected_blocks + b));
      selected_blocks += blocks;
      selected_slots += static_cast<int64_t>(sel.per_head) * KV;
      ++num_selected;
    } else if (slot_view) {
      source = kSlotView;
      row.context = static_cast<int>(s.view_size());
      const int blocks = (row.context + bs - 1) / bs;
      for (int b = 0; b < blocks; ++b) row.table.push_back(static_cast<int32_t>(slot_view_first + b));
    } else {
      source = kPool;
      row.context = static_cast<int>(s.view_size());
      const std::vector<BlockId>& table = s.view.kind == KvView::Kind::kFull ? s.block_table : s.view.blocks;
      row.table.assign(table.begin(), table.begin() + (row.context + bs - 1) / bs);
    }
    table_stride = std::max(table_stride, static_cast<int>(row.table.size()));
    (s.num_tokens == 1 ? decode_rows : prefill_rows)[source].push_back(std::move(row));
  }

  // The gathered selections: K then V, selected_blocks blocks each.
  const size_t es = cuda::DTypeSize(dtype_);
  const size_t block_bytes = layout_.block_stride() * es;
  KVFLOW_RETURN_IF_ERROR(GrowScratch(selection_arena_, 2 * static_cast<size_t>(selected_blocks) * block_bytes,
                                     "the gathered token selections"));
  selection_blocks_ = static_cast<int64_t>(selection_arena_.bytes() / (2 * block_bytes));
  char* selected_key = selection_arena_.base();
  char* selected_value = selection_arena_.base() + static_cast<size_t>(selection_blocks_) * block_bytes;
  if (identity_table_arena_.bytes() == 0) {
    std::vector<int32_t> identity(static_cast<size_t>(layout_.num_blocks));
    for (size_t b = 0; b < identity.size(); ++b) identity[b] = static_cast<int32_t>(b);
    KVFLOW_RETURN_IF_ERROR(identity_table_arena_.Allocate(identity.size() * sizeof(int32_t), "the identity block table"));
    KVFLOW_CUDA_RETURN(cudaMemcpy(identity_table_arena_.base(), identity.data(), identity.size() * sizeof(int32_t),
                                  cudaMemcpyHostToDevice));
  }

  // Staged metadata: [gather jobs][per-head counts][selected slots][decode rows][prefill rows].
  size_t num_decode = 0, num_prefill = 0;
  for (int src = 0; src < 3; ++src) {
    num_decode += decode_rows[src].size();
    num_prefill += prefill_rows[src].size();
  }
  const size_t stride = static_cast<size_t>(table_stride);
  const size_t jobs_bytes = AlignUp(num_selected * sizeof(cuda::SelectedKvGatherJob));
  const size_t counts_bytes = AlignUp(num_selected * sizeof(int32_t));
  const size_t slots_bytes = AlignUp(static_cast<size_t>(selected_slots) * sizeof(int32_t));
  const size_t decode_bytes = AlignUp(num_decode * (stride + 2) * sizeof(int32_t));
  const size_t prefill_bytes = AlignUp(num_prefill * (stride + 3) * sizeof(int32_t));
  char* host = nullptr;
  char* device = nullptr;
  KVFLOW_RETURN_IF_ERROR(
      StageBlockMeta(jobs_bytes + counts_bytes + slots_bytes + decode_bytes + prefill_bytes, &host, &device));
  // The same offset on both sides.
  auto on_device = [&](const void* host_ptr) {
    return device + (static_cast<const char*>(host_ptr) - host);
  };
  auto* jobs = reinterpret_cast<cuda::SelectedKvGatherJob*>(host);
  auto* counts = reinterpret_cast<int32_t*>(host + jobs_bytes);
  auto* slots = reinterpret_cast<int32_t*>(host + jobs_bytes + counts_bytes);
  const auto* identity = reinterpret_cast<const int32_t*>(identity_table_arena_.base());
  int job = 0;
  int64_t slot_at = 0;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const KvHeadSelection& sel = selection[i];
    if (sel.per_head == 0) continue;
    counts[job] = sel.per_head;
    for (int64_t slot : sel.slots) slots[slot_at++] = static_cast<int32_t>(slot);
    cuda::SelectedKvGatherJob& j = jobs[job];
    j = cuda::SelectedKvGatherJob{};
    j.block_table = identity;
    j.positions = reinterpret_cast<const int32_t*>(on_device(slots + slot_at - sel.slots.size()));
    j.position_head_stride = sel.per_head;
    j.count = reinterpret_cast<const int32_t*>(on_device(counts + job));
    j.append_position = -1;  // the step's own token already ends every head's list
    j.num_blocks = (sel.per_head + bs - 1) / bs;
    ++job;
  }
  // First scratch blocks in slice order, as the rows' tables were numbered.
  int32_t first_block = 0;
  for (int k = 0; k < job; ++k) {
    jobs[k].first_block = first_block;
    first_block += jobs[k].num_blocks;
  }
  struct RowRange {
    const int32_t* tables = nullptr;  // device
    const int32_t* context = nullptr;
    const int32_t* rows = nullptr;    // decode: query rows; prefill: query starts
    const int32_t* lens = nullptr;    // prefill: query lens
    int count = 0;
    int max_extent = 0;               // decode: longest context; prefill: longest query run
  };
  RowRange decode_ranges[3], prefill_ranges[3];
  auto* decode_tables = reinterpret_cast<int32_t*>(host + jobs_bytes + counts_bytes + slots_bytes);
  int32_t* decode_context = decode_tables + num_decode * stride;
  int32_t* decode_query = decode_context + num_decode;
  auto* prefill_tables = reinterpret_cast<int32_t*>(host + jobs_bytes + counts_bytes + slots_bytes + decode_bytes);
  int32_t* prefill_context = prefill_tables + num_prefill * stride;
  int32_t* prefill_starts = prefill_context + num_prefill;
  int32_t* prefill_lens = prefill_starts + num_prefill;
  size_t d = 0, p = 0;
  for (int src = 0; src < 3; ++src) {
    RowRange& dr = decode_ranges[src];
    dr.tables = reinterpret_cast<const int32_t*>(on_device(decode_tables + d * stride));
    dr.context = reinterpret_cast<const int32_t*>(on_device(decode_context + d));
    dr.rows = reinterpret_cast<const int32_t*>(on_device(decode_query + d));
    dr.count = static_cast<int>(decode_rows[src].size());
    for (const Row& row : decode_rows[src]) {
      std::copy(row.table.begin(), row.table.end(), decode_tables + d * stride);
      decode_context[d] = row.context;
      decode_query[d] = batch.seqs[static_cast<size_t>(row.slice)].token_offset;
      dr.max_extent = std::max(dr.max_extent, row.context);
      ++d;
    }
    RowRange& pr = prefill_ranges[src];
    pr.tables = reinterpret_cast<const int32_t*>(on_device(prefill_tables + p * stride));
    pr.context = reinterpret_cast<const int32_t*>(on_device(prefill_context + p));
    pr.rows = reinterpret_cast<const int32_t*>(on_device(prefill_starts + p));
    pr.lens = reinterpret_cast<const int32_t*>(on_device(prefill_lens + p));
    pr.count = static_cast<int>(prefill_rows[src].size());
    for (const Row& row : prefill_rows[src]) {
      const SequenceSlice& s = batch.seqs[static_cast<size_t>(row.slice)];
      std::copy(row.table.begin(), row.table.end(), prefill_tables + p * stride);
      prefill_context[p] = row.context;
      prefill_starts[p] = s.token_offset;
      prefill_lens[p] = s.num_tokens;
      pr.max_extent = std::max(pr.max_extent, s.num_tokens);
      ++p;
    }
  }
  const size_t total_bytes = jobs_bytes + counts_bytes + slots_bytes + decode_bytes + prefill_bytes;
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(device, host, total_bytes, cudaMemcpyHostToDevice, stream_));
  KVFLOW_CUDA_RETURN(cudaEventRecord(block_meta_copied_, stream_));

  const size_t layer_bytes = layout_.layer_stride() * es;
  const char* key_cache = key_pool_ + layer * layer_bytes;
  const char* value_cache = value_pool_ + layer * layer_bytes;
  // Rows reading their views read the pool, or an offloaded pool's staging buffer; selections are
  // gathered from the pool wherever it is (an offloaded one: only the selected rows cross the bus).
  const char* view_key = key_cache;
  const char* view_value = value_cache;
  if (options_.kv_offload) {
    KVFLOW_RETURN_IF_ERROR(EnsureStaged(layer, selection));
    view_key = StagingLayer(0, layer);
    view_value = StagingLayer(1, layer);
    offload_stats_.bytes_fetched += selected_slots * 2 * layout_.head_dim * static_cast<int64_t>(es);
  }
  if (!decode_rows[kSlotView].empty() || !prefill_rows[kSlotView].empty()) {
    KVFLOW_KERNEL_RETURN(cuda::GatherSlots(dtype_, key_cache, value_cache, device_meta_.gather_slots,
                                           step_.num_gathered_slots, gather_key_, gather_value_, KV, config_.head_dim,
                                           bs, stream_));
  }
  KVFLOW_KERNEL_RETURN(cuda::GatherSelectedKv(dtype_, key_cache, value_cache,
                                              reinterpret_cast<const cuda::SelectedKvGatherJob*>(device), job,
                                              selected_key, selected_value, KV, config_.head_dim, bs, stream_));
  const void* keys[3] = {view_key, gather_key_, selected_key};
  const void* values[3] = {view_value, gather_value_, selected_value};
  for (int src = 0; src < 3; ++src) {
    const RowRange& dr = decode_ranges[src];
    if (dr.count > 0) {
      KVFLOW_RETURN_IF_ERROR(DecodeRows(dr.tables, table_stride, dr.context, dr.rows, dr.count, dr.max_extent,
                                        keys[src], values[src]));
    }
    const RowRange& pr = prefill_ranges[src];
    if (pr.count > 0) {
      KVFLOW_RETURN_IF_ERROR(PrefillRows(pr.tables, table_stride, pr.context, pr.rows, pr.lens, pr.count,
                                         pr.max_extent, keys[src], values[src]));
    }
  }
  return Status::Ok();
}

// Synchronous: the copy waits for the step's work so far (the selectors read on the host).
Status CudaBackend::ReadActivationRows(Activation which, int64_t first_row, int64_t rows, std::span<float> out) {
  if (!in_step_) return Status::Internal("activation read outside a step");
  const int64_t width = ActivationWidth(which);
  if (first_row < 0 || rows < 0 || first_row + rows > step_.num_tokens ||
      static_cast<int64_t>(out.size()) < rows * width) {
    return Status::InvalidArgument("activation read outside the step's rows");
  }
  if (rows == 0) return Status::Ok();
  KVFLOW_RETURN_IF_ERROR(RefuseUnderCapture("activation reads"));
  const size_t n = static_cast<size_t>(rows * width), es = cuda::DTypeSize(dtype_);
  read_rows_.resize(n);
  const char* src = static_cast<const char*>(ActivationBuffer(which)) + static_cast<size_t>(first_row * width) * es;
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(read_rows_.data(), src, n * es, cudaMemcpyDeviceToHost, stream_));
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  WidenToFloat(read_rows_.data(), n, dtype_, out.data());
  return Status::Ok();
}

// The slots are gathered on the device into whole blocks (cache_ops GatherSlots, K and V together),
// the requested pool's copy comes back in one synchronous copy, and the host reorders it to
// [slot][kv_head][head_dim].
Status CudaBackend::PackKv(int layer, std::span<const int64_t> slots, std::span<std::byte> out) {
  KVFLOW_RETURN_IF_ERROR(ValidateKvPack(layer, slots, out.size(), *this));
  return CopyPacked(layer, slots, out.data(), nullptr);
}

Status CudaBackend::UnpackKv(int layer, std::span<const int64_t> slots, std::span<const std::byte> in) {
  KVFLOW_RETURN_IF_ERROR(ValidateKvPack(layer, slots, in.size(), *this));
  return CopyPacked(layer, slots, nullptr, in.data());
}

Status CudaBackend::CopyPacked(int layer, std::span<const int64_t> slots, std::byte* pack_to,
                               const std::byte* unpack_from) {
  if (slots.empty()) return Status::Ok();
  KVFLOW_RETURN_IF_ERROR(RefuseUnderCapture("KV packing"));
  const int64_t n = static_cast<int64_t>(slots.size());
  const size_t es = cuda::DTypeSize(dtype_);
  const size_t row_bytes = static_cast<size_t>(layout_.head_dim) * es;
  const std::vector<KvSlotRun> runs = KvSlotRuns(slots, layout_.block_size);
  // cudaMemcpyDefault: an offloaded pool is host memory.
  for (int kv = 0; kv < 2; ++kv) {
    char* pool = PoolLayer(kv, layer);
    for (int h = 0; h < layout_.num_kv_heads; ++h) {
      const size_t head_at = static_cast<size_t>((kv * layout_.num_kv_heads + h) * n) * row_bytes;
      for (const KvSlotRun& run : runs) {
        const int block = static_cast<int>(run.first_slot / layout_.block_size);
        const int offset = static_cast<int>(run.first_slot % layout_.block_size);
        char* in_pool = pool + layout_.offset(block, h, offset) * es;
        const size_t at = head_at + static_cast<size_t>(run.index) * row_bytes;
        const size_t bytes = static_cast<size_t>(run.length) * row_bytes;
        if (unpack_from != nullptr) {
          KVFLOW_CUDA_RETURN(cudaMemcpyAsync(in_pool, unpack_from + at, bytes, cudaMemcpyDefault, stream_));
        } else {
          KVFLOW_CUDA_RETURN(cudaMemcpyAsync(pack_to + at, in_pool, bytes, cudaMemcpyDefault, stream_));
        }
      }
    }
  }
  // The host buffer is the caller's once this returns.
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  return Status::Ok();
}

Status CudaBackend::ReadKv(int layer, int kv, std::span<const int64_t> slots, std::span<float> out) {
  if (layer < 0 || layer >= config_.num_layers || kv < 0 || kv > 1) return Status::InvalidArgument("KV read: no such layer");
  const int KV = layout_.num_kv_heads, D = layout_.head_dim, bs = layout_.block_size;
  const int64_t row = static_cast<int64_t>(KV) * D;
  if (static_cast<int64_t>(out.size()) < static_cast<int64_t>(slots.size()) * row) {
    return Status::InvalidArgument("KV read: output too small");
  }
  const int64_t pool_slots = static_cast<int64_t>(layout_.num_blocks) * bs;
  for (int64_t slot : slots) {
    if (slot < 0 || slot >= pool_slots) return Status::InvalidArgument("KV read: slot " + std::to_string(slot) + " outside the pool");
  }
  if (slots.empty()) return Status::Ok();
  KVFLOW_RETURN_IF_ERROR(RefuseUnderCapture("KV reads"));
  const size_t n = slots.size(), es = cuda::DTypeSize(dtype_);
  const size_t blocks = (n + bs - 1) / bs, padded = blocks * bs;
  if (padded > static_cast<size_t>(std::numeric_limits<int>::max())) return Status::InvalidArgument("KV read: too many slots");
  const size_t list_bytes = AlignUp(padded * sizeof(int64_t));
  const size_t gathered_bytes = AlignUp(blocks * layout_.block_stride() * es);
  KVFLOW_RETURN_IF_ERROR(GrowScratch(read_arena_, list_bytes + 2 * gathered_bytes, "KV reads"));
  read_slots_.assign(padded, -1);
  std::copy(slots.begin(), slots.end(), read_slots_.begin());
  auto* device_slots = reinterpret_cast<int64_t*>(read_arena_.base());
  char* gathered[2] = {read_arena_.base() + list_bytes, read_arena_.base() + list_bytes + gathered_bytes};
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(device_slots, read_slots_.data(), padded * sizeof(int64_t),
                                     cudaMemcpyHostToDevice, stream_));
  const size_t layer_bytes = layout_.layer_stride() * es;
  KVFLOW_KERNEL_RETURN(cuda::GatherSlots(dtype_, key_pool_ + layer * layer_bytes, value_pool_ + layer * layer_bytes,
                                         device_slots, static_cast<int>(padded), gathered[0], gathered[1], KV, D, bs,
                                         stream_));
  read_rows_.resize(blocks * layout_.block_stride());
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(read_rows_.data(), gathered[kv], read_rows_.size() * es, cudaMemcpyDeviceToHost,
                                     stream_));
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  // Scratch slot i sits at block i / bs, offset i % bs of each head (the pool's layout).
  for (size_t i = 0; i < n; ++i) {
    for (int h = 0; h < KV; ++h) {
      const size_t src = (((i / bs) * KV + h) * bs + i % bs) * D;
      WidenToFloat(read_rows_.data() + src, static_cast<size_t>(D), dtype_, out.data() + (i * KV + h) * D);
    }
  }
  return Status::Ok();
}

Status CudaBackend::SiluMul() {
  KVFLOW_KERNEL_RETURN(cuda::SiluAndMul(dtype_, gate_up_, act_, step_.num_tokens, config_.intermediate_size, stream_));
  return Status::Ok();
}

Status CudaBackend::AddDelta() {
  KVFLOW_KERNEL_RETURN(cuda::AddToResidual(dtype_, residual_, delta_, step_.num_tokens, config_.hidden_size, stream_));
  return Status::Ok();
}

// ---- TriForce's chunk scoring and selection ----------------------------------------------------

Status CudaBackend::StageBlockMeta(size_t bytes, char** host, char** device) {
  bytes = AlignUp(bytes);
  if (block_meta_restart_) {
    // A new step: the previous step's copies out of the staging are done once the last one is.
    block_meta_restart_ = false;
    if (block_meta_copied_) KVFLOW_CUDA_RETURN(cudaEventSynchronize(block_meta_copied_));
    block_meta_used_ = 0;
  }
  // Both sides (equal unless an allocation below failed half-way).
  const size_t capacity = std::min(block_meta_staging_.bytes(), block_meta_device_.bytes());
  if (block_meta_used_ + bytes > capacity) {
    // Full: in the first step, or when the jobs grow. Everything queued may still read either side,
    // so wait for the stream, then start over, with room for a step's every layer of calls this
    // size so that the next steps need no wait.
    KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
    block_meta_used_ = 0;
    const size_t step_bytes = bytes * static_cast<size_t>(std::max(config_.num_layers, 1));
    if (step_bytes > capacity) {
      const size_t grown = std::max(step_bytes, 2 * capacity);
      KVFLOW_RETURN_IF_ERROR(block_meta_staging_.Allocate(grown, "chunk scoring staging"));
      KVFLOW_RETURN_IF_ERROR(block_meta_device_.Allocate(grown, "chunk scoring metadata"));
    }
  }
  if (!block_meta_copied_) KVFLOW_CUDA_RETURN(cudaEventCreateWithFlags(&block_meta_copied_, cudaEventDisableTiming));
  *host = block_meta_staging_.base() + block_meta_used_;
  *device = block_meta_device_.base() + block_meta_used_;
  block_meta_used_ += bytes;
  return Status::Ok();
}

Status CudaBackend::ResetKvBlockScores(int64_t size) {
  if (size < 0) return Status::InvalidArgument("chunk scoring: negative buffer size");
  const size_t bytes = static_cast<size_t>(size) * sizeof(float);
  if (bytes > block_scores_arena_.bytes()) {
    // Grow (geometrically, so a slowly growing request reallocates rarely); the old scores are all
    // inside [0, size), which Reset zeroes anyway. Queued kernels may still read the old buffer.
    KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
    KVFLOW_RETURN_IF_ERROR(
        block_scores_arena_.Allocate(std::max(AlignUp(bytes), 2 * block_scores_arena_.bytes()), "chunk scores"));
    block_scores_ = reinterpret_cast<float*>(block_scores_arena_.base());
  }
  if (bytes > 0) KVFLOW_CUDA_RETURN(cudaMemsetAsync(block_scores_, 0, bytes, stream_));
  block_scores_size_ = std::max(block_scores_size_, size);
  return Status::Ok();
}

Status CudaBackend::ScoreKvBlocks(int layer, std::span<const KvBlockScoreJob> jobs) {
  if (!in_step_) return Status::Internal("chunk scoring outside a step");
  if (layer < 0 || layer >= config_.num_layers) return Status::InvalidArgument("chunk scoring: layer out of range");
  KVFLOW_RETURN_IF_ERROR(cpu::ValidateKvBlockScoreJobs(jobs, layout_, step_.num_tokens, block_scores_size_));
  // The jobs are uploaded per call; a graph would replay the first step's jobs forever.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  KVFLOW_CUDA_RETURN(cudaStreamIsCapturing(stream_, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    return Status::Unsupported("chunk scoring cannot be captured in a CUDA graph: hooks that score are not capturable");
  }
  int64_t total = 0;
  for (const KvBlockScoreJob& job : jobs) total += static_cast<int64_t>(job.blocks.size());
  if (total == 0) return Status::Ok();  // nothing to add
  const int64_t NH = config_.num_heads;
  if (total > std::numeric_limits<int32_t>::max() / NH) {
    return Status::InvalidArgument(fmt::format("chunk scoring: {} blocks in one call is too many", total));
  }
  // [jobs][block ids][block -> job] in one staging region, one copy.
  const size_t jobs_bytes = AlignUp(jobs.size() * sizeof(cuda::KvBlockScoreJobDesc));
  const size_t list_bytes = AlignUp(static_cast<size_t>(total) * sizeof(int32_t));
  char* host = nullptr;
  char* device = nullptr;
  KVFLOW_RETURN_IF_ERROR(StageBlockMeta(jobs_bytes + 2 * list_bytes, &host, &device));
  auto* desc = reinterpret_cast<cuda::KvBlockScoreJobDesc*>(host);
  auto* ids = reinterpret_cast<int32_t*>(host + jobs_bytes);
  auto* owners = reinterpret_cast<int32_t*>(host + jobs_bytes + list_bytes);
  int32_t next = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const KvBlockScoreJob& job = jobs[j];
    desc[j] = cuda::KvBlockScoreJobDesc{};
    desc[j].score_offset = job.score_offset;
    desc[j].row = job.row;
    desc[j].num_blocks = static_cast<int32_t>(job.blocks.size());
    desc[j].num_tokens = job.num_tokens;
    desc[j].first_block = next;
    for (BlockId b : job.blocks) {
      ids[next] = b;
      owners[next++] = static_cast<int32_t>(j);
    }
  }
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(device, host, jobs_bytes + 2 * list_bytes, cudaMemcpyHostToDevice, stream_));
  KVFLOW_CUDA_RETURN(cudaEventRecord(block_meta_copied_, stream_));

  const size_t logits_bytes = static_cast<size_t>(NH * total) * sizeof(float);
  if (logits_bytes > block_logits_arena_.bytes()) {
    KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));  // earlier layers' kernels may use the old scratch
    KVFLOW_RETURN_IF_ERROR(block_logits_arena_.Allocate(std::max(AlignUp(logits_bytes), 2 * block_logits_arena_.bytes()),
                                                        "chunk scoring scratch"));
  }
  cuda::KvBlockScoreArgs a;
  a.dtype = dtype_;
  a.query = qkv_;  // the Q heads lead each kQkv row, rotated by now
  a.query_row_stride = ActivationWidth(Activation::kQkv);
  a.key_cache = key_pool_ + layer * layout_.layer_stride() * cuda::DTypeSize(dtype_);
  a.jobs = reinterpret_cast<const cuda::KvBlockScoreJobDesc*>(device);
  a.num_jobs = static_cast<int>(jobs.size());
  a.block_ids = reinterpret_cast<const int32_t*>(device + jobs_bytes);
  a.block_jobs = reinterpret_cast<const int32_t*>(device + jobs_bytes + list_bytes);
  a.total_blocks = static_cast<int>(total);
  a.num_heads = config_.num_heads;
  a.num_kv_heads = config_.num_kv_heads;
  a.head_dim = config_.head_dim;
  a.block_size = layout_.block_size;
  a.logits = reinterpret_cast<float*>(block_logits_arena_.base());
  a.scores = block_scores_;
  KVFLOW_KERNEL_RETURN(cuda::ScoreKvBlocks(a, stream_));
  return Status::Ok();
}

Status CudaBackend::SelectTopKvBlocks(std::span<const KvBlockSelectJob> jobs, std::vector<int32_t>& chosen) {
  chosen.clear();
  KVFLOW_RETURN_IF_ERROR(cpu::ValidateKvBlockSelectJobs(jobs, block_scores_size_));
  int64_t total = 0;
  for (const KvBlockSelectJob& job : jobs) total += std::min(job.k, job.num_blocks);
  if (total == 0) return Status::Ok();  // every job chooses nothing
  if (total > std::numeric_limits<int32_t>::max()) return Status::InvalidArgument("chunk selection: too many blocks");
  // [jobs][chosen indices]: the jobs go up, the indices come back through the same region.
  const size_t jobs_bytes = AlignUp(jobs.size() * sizeof(cuda::KvBlockSelectJobDesc));
  const size_t out_bytes = static_cast<size_t>(total) * sizeof(int32_t);
  char* host = nullptr;
  char* device = nullptr;
  KVFLOW_RETURN_IF_ERROR(StageBlockMeta(jobs_bytes + out_bytes, &host, &device));
  auto* desc = reinterpret_cast<cuda::KvBlockSelectJobDesc*>(host);
  int32_t next = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const KvBlockSelectJob& job = jobs[j];
    desc[j] = cuda::KvBlockSelectJobDesc{};
    desc[j].score_offset = job.score_offset;
    desc[j].num_blocks = job.num_blocks;
    desc[j].keep_first = job.keep_first;
    desc[j].keep_last = job.keep_last;
    desc[j].k = job.k;
    desc[j].out_offset = next;
    next += std::min(job.k, job.num_blocks);
  }
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(device, host, jobs_bytes, cudaMemcpyHostToDevice, stream_));
  KVFLOW_KERNEL_RETURN(cuda::SelectTopKvBlocks(block_scores_, reinterpret_cast<const cuda::KvBlockSelectJobDesc*>(device),
                                               static_cast<int>(jobs.size()), reinterpret_cast<int32_t*>(device + jobs_bytes),
                                               stream_));
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(host + jobs_bytes, device + jobs_bytes, out_bytes, cudaMemcpyDeviceToHost, stream_));
  KVFLOW_CUDA_RETURN(cudaEventRecord(block_meta_copied_, stream_));
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  const auto* indices = reinterpret_cast<const int32_t*>(host + jobs_bytes);
  chosen.assign(indices, indices + total);
  return Status::Ok();
}

Status CudaBackend::ReadKvBlockScores(int64_t offset, std::span<float> out) {
  if (offset < 0 || offset + static_cast<int64_t>(out.size()) > block_scores_size_) {
    return Status::InvalidArgument("chunk scores: read outside the buffer");
  }
  if (out.empty()) return Status::Ok();
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(out.data(), block_scores_ + offset, out.size() * sizeof(float),
                                     cudaMemcpyDeviceToHost, stream_));
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  return Status::Ok();
}

Status CudaBackend::RunLogits(int first_row, int rows) {
  const int H = config_.hidden_size, V = config_.vocab_size;
  KVFLOW_KERNEL_RETURN(cuda::GatherRowsToF32(DType::kF32, residual_, H, max_tokens_, device_meta_.logit_rows + first_row,
                                             rows, H, final_rows_, stream_));
  KVFLOW_KERNEL_RETURN(cuda::RmsNorm(dtype_, final_rows_, final_norm_, final_hidden_, rows, H, config_.rms_norm_eps, stream_));
  return Gemm(final_hidden_, lm_head_, logits_, rows, V, H, DType::kF32);
}

Status CudaBackend::CopyLogitsToHost(int rows, float* dst) {
  const size_t bytes = static_cast<size_t>(rows) * config_.vocab_size * sizeof(float);
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
      sink.host->resize(static_cast<size_t>(rows) * config_.vocab_size);
    } catch (const std::bad_alloc&) {
      return Status::OutOfMemory("cannot allocate host memory for the logits");
    }
    return Status::Ok();
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
  if (options_.kv_offload) {
    for (const SequenceSlice& slice : batch.seqs) {
      if (slice.view.kind != KvView::Kind::kFull) return Status::Unsupported("an offloaded KV pool reads whole views only");
    }
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
  if (!sink.sampled) return CopyLogitsToHost(rows, sink.host->data() + static_cast<size_t>(first_row) * config_.vocab_size);
  return SampleOnDevice(sink.sample_rows.subspan(static_cast<size_t>(first_row), static_cast<size_t>(rows)),
                        *sink.sampled);
}

Status CudaBackend::SampleOnDevice(std::span<const DeviceSampleRow> rows, std::vector<SampledToken>& sampled) {
  const int n = static_cast<int>(rows.size());
  if (n == 0) return Status::Ok();
  auto* host_rows = reinterpret_cast<cuda::SamplingRow*>(sample_staging_.base());
  auto* out_tokens = reinterpret_cast<int32_t*>(sample_staging_.base() + AlignUp(max_seqs_ * sizeof(cuda::SamplingRow)));
  auto* out_logprobs = reinterpret_cast<float*>(out_tokens + max_seqs_);
  auto* out_top_tokens = out_tokens + 2 * max_seqs_;
  auto* out_top_logprobs = reinterpret_cast<float*>(out_top_tokens + max_seqs_ * cuda::kMaxTopLogprobs);
  // Histories only for rows with penalties; suppressed tokens after them.
  std::vector<int32_t> tokens;
  int num_top = 0;
  for (int i = 0; i < n; ++i) {
    const DeviceSampleRow& r = rows[static_cast<size_t>(i)];
    const SamplingParams& p = *r.params;
    cuda::SamplingRow& row = host_rows[i];
    row = cuda::SamplingRow{};
    row.temperature = p.temperature;
    row.top_k = p.top_k;
    row.top_p = p.top_p;
    row.min_p = p.min_p;
    row.repetition_penalty = p.repetition_penalty;
    row.frequency_penalty = p.frequency_penalty;
    row.presence_penalty = p.presence_penalty;
    row.uniform = r.uniform;
    if (p.repetition_penalty != 1.0f || p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f) {
      row.history_offset = static_cast<int32_t>(tokens.size());
      row.prompt_len = static_cast<int32_t>(r.prompt.size());
      row.output_len = static_cast<int32_t>(r.output.size());
      tokens.insert(tokens.end(), r.prompt.begin(), r.prompt.end());
      tokens.insert(tokens.end(), r.output.begin(), r.output.end());
    }
    num_top = std::max(num_top, p.logprobs);
  }
  const size_t history_len = tokens.size();
  for (int i = 0; i < n; ++i) {
    const DeviceSampleRow& r = rows[static_cast<size_t>(i)];
    host_rows[i].suppress_offset = static_cast<int32_t>(tokens.size() - history_len);
    host_rows[i].suppress_len = static_cast<int32_t>(r.suppress.size());
    tokens.insert(tokens.end(), r.suppress.begin(), r.suppress.end());
  }
  num_top = std::min(num_top, config_.vocab_size);
  if (tokens.size() * sizeof(int32_t) > sample_tokens_arena_.bytes()) {
    KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));  // the old buffer may still be read
    KVFLOW_RETURN_IF_ERROR(sample_tokens_arena_.Allocate(AlignUp(tokens.size() * sizeof(int32_t) * 2, size_t{1} << 16),
                                                         "sampling histories"));
  }
  auto* dev_tokens = reinterpret_cast<int32_t*>(sample_tokens_arena_.base());
  if (!tokens.empty()) {
    KVFLOW_CUDA_RETURN(cudaMemcpyAsync(dev_tokens, tokens.data(), tokens.size() * sizeof(int32_t),
                                       cudaMemcpyHostToDevice, stream_));
  }
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(sample_rows_, host_rows, n * sizeof(cuda::SamplingRow), cudaMemcpyHostToDevice, stream_));
  cuda::SampleArgs a;
  a.logits = logits_;
  a.num_rows = n;
  a.vocab_size = config_.vocab_size;
  a.rows = sample_rows_;
  a.history = dev_tokens;
  a.suppress = dev_tokens ? dev_tokens + history_len : nullptr;
  a.num_top_logprobs = num_top;
  a.out_tokens = sampled_tokens_;
  a.out_logprobs = sampled_logprobs_;
  a.out_top_tokens = sampled_top_tokens_;
  a.out_top_logprobs = sampled_top_logprobs_;
  a.workspace = sample_workspace_;
  a.workspace_bytes = sample_workspace_bytes_;
  KVFLOW_KERNEL_RETURN(cuda::SampleFromLogits(a, stream_));
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(out_tokens, sampled_tokens_, n * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(out_logprobs, sampled_logprobs_, n * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  if (num_top > 0) {
    const size_t top = static_cast<size_t>(n) * num_top;
    KVFLOW_CUDA_RETURN(cudaMemcpyAsync(out_top_tokens, sampled_top_tokens_, top * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
    KVFLOW_CUDA_RETURN(cudaMemcpyAsync(out_top_logprobs, sampled_top_logprobs_, top * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  }
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  for (int i = 0; i < n; ++i) {
    SampledToken t;
    t.token = out_tokens[i];
    t.logprob = out_logprobs[i];
    const int k = rows[static_cast<size_t>(i)].params->logprobs;
    for (int j = 0; j < std::min(k, num_top); ++j) {
      t.top_logprobs.push_back({out_top_tokens[i * num_top + j], out_top_logprobs[i * num_top + j]});
    }
    if (t.token < 0 || t.token >= config_.vocab_size) {
      return Status::Internal(fmt::format("device sampler returned token {} for row {}", t.token, i));
    }
    sampled.push_back(std::move(t));
  }
  return Status::Ok();
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

Status CudaBackend::CopyBlocks(std::span<const BlockMove> moves, BlockCopyKind kind) {
  KVFLOW_RETURN_IF_ERROR(ValidateBlockMoves(moves, kind, layout_.num_blocks, num_host_blocks_));
  if (moves.empty()) return Status::Ok();
  const size_t es = cuda::DTypeSize(dtype_);
  if (kind == BlockCopyKind::kDeviceToDevice) {
    // The previous pair list may still be in flight to the device.
    KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
    const size_t n = std::min(moves.size(), static_cast<size_t>(layout_.num_blocks));
    for (size_t i = 0; i < n; ++i) {
      host_pairs_[2 * i] = moves[i].src;
      host_pairs_[2 * i + 1] = moves[i].dst;
    }
    KVFLOW_CUDA_RETURN(cudaMemcpyAsync(copy_pairs_, host_pairs_, 2 * n * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    KVFLOW_KERNEL_RETURN(cuda::CopyBlocks(dtype_, key_pool_, value_pool_, layout_.num_layers,
                                          static_cast<int64_t>(layout_.layer_stride()),
                                          static_cast<int64_t>(layout_.block_stride()), copy_pairs_,
                                          static_cast<int>(n), stream_));
    return Status::Ok();
  }

  // Swaps: DMA copies on their own stream, after the compute queued so far; compute waits for them.
  const bool to_host = kind == BlockCopyKind::kDeviceToHost;
  const size_t block_bytes = layout_.block_stride() * es;
  const size_t device_layer_bytes = layout_.layer_stride() * es;
  const size_t host_layer_bytes = block_bytes * static_cast<size_t>(num_host_blocks_);
  KVFLOW_CUDA_RETURN(cudaEventRecord(compute_done_, stream_));
  KVFLOW_CUDA_RETURN(cudaStreamWaitEvent(copy_stream_, compute_done_, 0));
  // Runs of consecutive source and destination ids move as one copy.
  struct Run {
    BlockId src, dst;
    size_t len;
  };
  std::vector<Run> runs;
  for (const BlockMove& mv : moves) {
    if (!runs.empty() && runs.back().src + static_cast<BlockId>(runs.back().len) == mv.src &&
        runs.back().dst + static_cast<BlockId>(runs.back().len) == mv.dst) {
      ++runs.back().len;
    } else {
      runs.push_back({mv.src, mv.dst, 1});
    }
  }
  for (int l = 0; l < layout_.num_layers; ++l) {
    for (int pool = 0; pool < 2; ++pool) {
      char* dev = (pool == 0 ? key_pool_ : value_pool_) + l * device_layer_bytes;
      char* host = (pool == 0 ? host_key_pool_ : host_value_pool_) + l * host_layer_bytes;
      for (const Run& r : runs) {
        char* src = (to_host ? dev : host) + r.src * block_bytes;
        char* dst = (to_host ? host : dev) + r.dst * block_bytes;
        KVFLOW_CUDA_RETURN(cudaMemcpyAsync(dst, src, r.len * block_bytes,
                                           to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, copy_stream_));
      }
    }
  }
  KVFLOW_CUDA_RETURN(cudaEventRecord(swap_done_, copy_stream_));
  KVFLOW_CUDA_RETURN(cudaStreamWaitEvent(stream_, swap_done_, 0));
  return Status::Ok();
}

char* CudaBackend::PoolLayer(int kv, int layer) const {
  return (kv == 0 ? key_pool_ : value_pool_) + static_cast<size_t>(layer) * layout_.layer_stride() * cuda::DTypeSize(dtype_);
}

char* CudaBackend::StagingLayer(int kv, int layer) const {
  const size_t layer_bytes = layout_.layer_stride() * cuda::DTypeSize(dtype_);
  return staging_arena_.base() + (static_cast<size_t>(kv) * KvStagingLedger::kBuffers + layer % KvStagingLedger::kBuffers) * layer_bytes;
}

Status CudaBackend::StageViews(int layer, std::span<const KvHeadSelection> selection, cudaStream_t stream) {
  const int bs = layout_.block_size;
  const size_t block_bytes = layout_.block_stride() * cuda::DTypeSize(dtype_);
  int64_t blocks_moved = 0;
  for (size_t s = 0; s < batch_->seqs.size(); ++s) {
    if (!selection.empty() && selection[s].per_head > 0) continue;
    const SequenceSlice& slice = batch_->seqs[s];
    // The cached tokens' blocks: the step's own tokens are written into the staging buffer.
    const int32_t cached = slice.context_len - slice.num_tokens;
    const int32_t n = (cached + bs - 1) / bs;
    for (int32_t b = 0; b < n;) {
      int32_t run = 1;
      while (b + run < n && slice.block_table[static_cast<size_t>(b + run)] == slice.block_table[static_cast<size_t>(b)] + run) ++run;
      const size_t offset = static_cast<size_t>(slice.block_table[static_cast<size_t>(b)]) * block_bytes;
      for (int kv = 0; kv < 2; ++kv) {
        KVFLOW_CUDA_RETURN(cudaMemcpyAsync(StagingLayer(kv, layer) + offset, PoolLayer(kv, layer) + offset,
                                           static_cast<size_t>(run) * block_bytes, cudaMemcpyHostToDevice, stream));
      }
      blocks_moved += run;
      b += run;
    }
  }
  offload_stats_.bytes_fetched += blocks_moved * 2 * static_cast<int64_t>(block_bytes);
  return Status::Ok();
}

Status CudaBackend::PrefetchKv(int layer, std::span<const KvHeadSelection> selection) {
  if (!options_.kv_offload) return Status::Ok();
  if (batch_ == nullptr) return Status::Internal("KV prefetch outside a step");
  if (layer < 0 || layer >= config_.num_layers) return Status::InvalidArgument("KV prefetch: no such layer");
  if (!selection.empty()) KVFLOW_RETURN_IF_ERROR(ValidateKvHeadSelections(selection, *batch_, layout_));
  // The buffer held layer - 2, whose attention is queued on the compute stream: copy after it.
  const int buffer = layer % KvStagingLedger::kBuffers;
  KVFLOW_CUDA_RETURN(cudaEventRecord(staging_free_, stream_));
  KVFLOW_CUDA_RETURN(cudaStreamWaitEvent(copy_stream_, staging_free_, 0));
  KVFLOW_RETURN_IF_ERROR(StageViews(layer, selection, copy_stream_));
  KVFLOW_CUDA_RETURN(cudaEventRecord(staged_[buffer], copy_stream_));
  ledger_.Record(layer, selection, batch_->seqs.size());
  staged_async_[buffer] = true;
  offload_stats_.prefetches += 1;
  return Status::Ok();
}

Status CudaBackend::EnsureStaged(int layer, std::span<const KvHeadSelection> selection) {
  const int buffer = KvStagingLedger::BufferOf(layer);
  KVFLOW_ASSIGN_OR_RETURN(const bool staged, ledger_.Holds(layer, selection, batch_->seqs.size()));
  if (staged) {
    if (staged_async_[buffer]) {  // WriteKv normally waited already
      KVFLOW_CUDA_RETURN(cudaStreamWaitEvent(stream_, staged_[buffer], 0));
      staged_async_[buffer] = false;
    }
    return Status::Ok();
  }
  // Nothing prefetched: copy on the compute stream, after the write-through of this step's K/V.
  KVFLOW_RETURN_IF_ERROR(StageViews(layer, selection, stream_));
  ledger_.Record(layer, selection, batch_->seqs.size());
  offload_stats_.on_demand_fetches += 1;
  return Status::Ok();
}

// General moves run on the compute stream, so they are ordered with the steps around them; each
// (transfer, layer, K or V) is one 2D copy: a run of num_tokens slots per KV head, the heads a
// block's head stride apart (kv/kv_cache_layout.h).
Status CudaBackend::TransferKv(std::span<const KvTransfer> transfers) {
  KVFLOW_RETURN_IF_ERROR(ValidateKvTransfers(transfers, layout_, num_host_blocks_));
  const size_t es = cuda::DTypeSize(dtype_);
  const size_t head_bytes = layout_.head_stride() * es;
  auto pool = [&](KvTier tier, int kv, int layer) -> char* {
    if (tier == KvTier::kHost) {
      char* base = kv == 0 ? host_key_pool_ : host_value_pool_;
      return base + static_cast<size_t>(layer) * layout_.block_stride() * es * static_cast<size_t>(num_host_blocks_);
    }
    return (kv == 0 ? key_pool_ : value_pool_) + static_cast<size_t>(layer) * layout_.layer_stride() * es;
  };
  for (const KvTransfer& t : transfers) {
    if (t.num_tokens == 0) continue;
    // An offloaded pool is host memory too: let the runtime tell the kinds apart.
    const cudaMemcpyKind kind = options_.kv_offload ? cudaMemcpyDefault
                              : t.src_tier == KvTier::kHost
                                    ? (t.dst_tier == KvTier::kHost ? cudaMemcpyHostToHost : cudaMemcpyHostToDevice)
                                    : (t.dst_tier == KvTier::kHost ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice);
    const size_t width = static_cast<size_t>(t.num_tokens) * layout_.head_dim * es;
    for (int layer = t.layer_begin; layer < t.layer_end; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        const char* src = pool(t.src_tier, kv, layer) + layout_.offset(t.src_block, 0, t.src_offset) * es;
        char* dst = pool(t.dst_tier, kv, layer) + layout_.offset(t.dst_block, 0, t.dst_offset) * es;
        KVFLOW_CUDA_RETURN(cudaMemcpy2DAsync(dst, head_bytes, src, head_bytes, width, layout_.num_kv_heads, kind,
                                             stream_));
      }
    }
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

Result<std::unique_ptr<Backend>> Create(const ModelConfig& config, const LlamaWeights* weights,
                                        const CudaBackendOptions& options, uint64_t seed) {
  auto backend = std::make_unique<CudaBackend>(config, options);
  KVFLOW_RETURN_IF_ERROR(backend->Init(weights, seed));
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace

Result<std::unique_ptr<Backend>> CreateCudaBackend(const ModelConfig& config, const LlamaWeights& weights,
                                                   const CudaBackendOptions& options) {
  return Create(config, &weights, options, 0);
}

Result<std::unique_ptr<Backend>> CreateCudaBackendWithRandomWeights(const ModelConfig& config,
                                                                    const CudaBackendOptions& options,
                                                                    uint64_t seed) {
  return Create(config, nullptr, options, seed);
}

}  // namespace kvflow
