// The interface every compute backend implements: memory (weights, paged KV pools, activations)
// and the primitives a decoder is written in, over a batch of sequences whose KV cache lives in
// paged blocks (see kv/kv_cache_layout.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <type_traits>
#include <string>
#include <vector>

#include "kv/block_manager.h"
#include "kv/kv_cache_layout.h"
#include "kvflow/config.h"
#include "kvflow/engine_config.h"
#include "kvflow/request.h"
#include "kvflow/sampling.h"
#include "kvflow/status.h"
#include "sampling/token_constraint.h"

namespace kvflow {

enum class LogitsMode { kNone, kLast, kAll };

// Which cached tokens a sequence's queries attend to (FlashInfer's paged_kv_t: one descriptor for
// any set of pages). The step's own tokens are the last num_tokens entries of the view and the
// mask is causal in view order: query j of n sees entries [0, size - n + j]. A view only chooses
// what attention reads; where the new K/V are written is ForwardBatch::slot_mapping.
struct KvView {
  enum class Kind {
    kFull,    // the first context_len tokens of the sequence's block table (plain decoding)
    kBlocks,  // the first num_tokens tokens of `blocks`, a chosen subset of the table (retrieval)
    kSlots,   // exactly `slots`, in order (gathered tokens; sinks + recent window)
  };
  Kind kind = Kind::kFull;
  std::vector<BlockId> blocks;  // kBlocks
  int32_t num_tokens = 0;       // kBlocks: every block but the last is read whole
  std::vector<int64_t> slots;   // kSlots: block * block_size + offset

  static KvView Full() { return {}; }
  static KvView BlockSubset(std::vector<BlockId> blocks, int32_t num_tokens);
  static KvView Slots(std::vector<int64_t> slots);
  // StreamingLLM's cache: the first `num_sinks` and the last `window` of the first context_len
  // tokens of `table` (all of them when they overlap).
  static KvView SinksAndWindow(std::span<const BlockId> table, int32_t context_len, int32_t num_sinks,
                               int32_t window, int block_size);
};

// One sequence's share of a step: `num_tokens` new tokens (a prefill chunk, one decode token, or a
// token and its drafts) at positions context_len - num_tokens .. context_len - 1.
struct SequenceSlice {
  int32_t token_offset = 0;  // index of the first of its tokens in ForwardBatch::tokens
  int32_t num_tokens = 0;
  int32_t context_len = 0;  // tokens in its KV cache once this step has written its own
  std::vector<BlockId> block_table;  // must cover context_len tokens
  LogitsMode logits = LogitsMode::kLast;
  KvView view;  // what its attention reads; the whole table by default

  // Entries of the view (kFull: context_len).
  int64_t view_size() const;
};

struct ForwardBatch {
  std::vector<int32_t> tokens;     // all new tokens of the step, sequence after sequence
  std::vector<int32_t> positions;  // position of each token in its sequence (RoPE)
  // Physical KV slot (block * block_size + offset) each token's K/V is written to, -1 for none.
  // Empty: each token goes to its position's slot in its sequence's block table.
  std::vector<int64_t> slot_mapping;
  std::vector<SequenceSlice> seqs;

  // Rows of logits that Forward will produce, in sequence order.
  int64_t num_logit_rows() const;
};

// The physical slot (block * block_size + offset) of position `pos` of a sequence with `table`.
inline int64_t SlotOf(std::span<const BlockId> table, int32_t pos, int block_size) {
  return static_cast<int64_t>(table[static_cast<size_t>(pos / block_size)]) * block_size + pos % block_size;
}

// The slot of every token of `batch` (its slot_mapping, or the default one).
std::vector<int64_t> ResolveSlotMapping(const ForwardBatch& batch, int block_size);
// The physical slots a slice's view reads, in view order (-1 for a block released from a sliding
// window).
void ViewSlots(const SequenceSlice& slice, int block_size, std::vector<int64_t>& slots);

// One logit row to sample on the device: the request's parameters, the sequence's tokens so far
// (for the penalties), tokens not allowed now, and the row's uniform draw in [0, 1) from the
// sequence's own RNG (so a seed gives the same tokens on every backend).
struct DeviceSampleRow {
  const SamplingParams* params = nullptr;
  double uniform = 0.0;
  std::span<const int32_t> prompt;
  std::span<const int32_t> output;
  // What the logits processors allow (null: everything): the device sampler applies it as the CPU
  // Sampler does (its bans always, its mask and biases where SupportsDeviceTokenMask).
  const TokenConstraint* constraint = nullptr;
};

// A step's rows to sample on the device, and when their constraints are ready: the engine may still
// be computing them (grammar masks, on a helper thread) while the forward pass runs. The sampler
// calls `await_constraints` (when set) once, after it has queued the forward pass and before it
// reads any row's constraint.
struct DeviceSampling {
  std::span<const DeviceSampleRow> rows;
  std::function<void()> await_constraints;
};

// Top alternatives a device sampler returns at most per token.
constexpr int kMaxDeviceTopLogprobs = 20;

// TriForce's retrieval scoring (triforce/retrieval_cache.h): a KV block is a chunk, scored by its
// mean key. One sequence's share: the query heads of token row `row` of the step (kQkv, rotated)
// score each of `blocks`; per query head h, p_h = softmax over the blocks of
// q_h . mean_key(block, kv_head(h)) / sqrt(head_dim), the mean over the block's tokens (every block
// is full but the last, which holds num_tokens - (blocks - 1) * block_size); each block's score in
// the backend's score buffer, at score_offset + its index, gains the sum of p_h over all query heads
// (the attention mass the chunk would draw, summed over heads: with grouped-query attention every
// query head of a group counts, so a chunk one head needs is not averaged away).
struct KvBlockScoreJob {
  int32_t row = 0;
  std::vector<BlockId> blocks;
  int32_t num_tokens = 0;
  int64_t score_offset = 0;
};

// What one slice's attention reads at one layer instead of its view (InfiniGen's speculated tokens,
// H2O's kept tokens): per KV head, `per_head` slots (block * block_size + offset), head after head
// in `slots`; causal in list order, so the step's own tokens end every head's list. per_head 0: the
// slice's own view.
struct KvHeadSelection {
  int32_t per_head = 0;
  std::vector<int64_t> slots;  // num_kv_heads * per_head
  // Chosen on the device by DeviceKvSpeculation::Speculate for this layer (slots empty, a one-token
  // slice): per_head is then the most tokens a head reads (the speculation's cap and the step's
  // own token), the count itself staying on the device.
  bool speculated = false;
};

// Identifies what a layer's attention reads under `selection` (per slice: its view where the span is
// empty or per_head is 0, else its per-head slots): an offloaded pool checks that attention reads
// what was prefetched for it.
uint64_t KvReadSignature(std::span<const KvHeadSelection> selection, size_t num_slices);

// What an offloaded pool's staging buffers hold (layer l in buffer l % kBuffers): the layer, and
// the signature of the reads it was filled for, so attention uses a prefetch only if it reads the
// same tokens. Both backends keep one; Reset at every step.
class KvStagingLedger {
 public:
  static constexpr int kBuffers = 2;
  static int BufferOf(int layer) { return layer % kBuffers; }
  void Reset() { std::fill(std::begin(layer_), std::end(layer_), -1); }
  // Whether `layer`'s buffer was filled for `layer` (whatever the reads).
  bool HoldsLayer(int layer) const { return layer_[BufferOf(layer)] == layer; }
  // Whether `layer`'s buffer holds its `selection` reads already; Internal when it holds the
  // layer filled for other reads.
  Result<bool> Holds(int layer, std::span<const KvHeadSelection> selection, size_t num_slices) const;
  void Record(int layer, std::span<const KvHeadSelection> selection, size_t num_slices);

 private:
  int layer_[kBuffers] = {-1, -1};
  uint64_t signature_[kBuffers] = {0, 0};
};

// Top-k chunk selection over accumulated scores: the first keep_first and the last keep_last of the
// job's num_blocks are always chosen, the rest by highest score (ties: the lower index), min(k,
// num_blocks) in all, returned as ascending indices.
struct KvBlockSelectJob {
  int64_t score_offset = 0;
  int32_t num_blocks = 0;
  int32_t keep_first = 0;
  int32_t keep_last = 0;
  int32_t k = 0;
};

// Where a batch of block moves (planned by the block manager) copies from and to.
enum class BlockCopyKind { kDeviceToHost, kHostToDevice, kDeviceToDevice };

// A run of floats in a backend's device memory (Backend::DeviceActivation).
struct DeviceRows {
  enum class Type { kF32, kF16, kBF16 };
  void* data = nullptr;
  int64_t count = 0;
  Type type = Type::kF32;
};

// Where KV lives: the device pool, or the host pool (the swap space; an offload tier).
enum class KvTier { kDevice, kHost };

// One move of KV, K and V alike: token slots [src_offset, src_offset + num_tokens) of block
// src_block in src_tier go to [dst_offset, dst_offset + num_tokens) of dst_block in dst_tier, for
// layers [layer_begin, layer_end). A whole block of every layer is offsets 0, num_tokens =
// block_size, layers [0, num_layers): what CopyBlocks moves.
struct KvTransfer {
  KvTier src_tier = KvTier::kDevice;
  BlockId src_block = 0;
  int src_offset = 0;
  KvTier dst_tier = KvTier::kDevice;
  BlockId dst_block = 0;
  int dst_offset = 0;
  int num_tokens = 0;
  int layer_begin = 0;
  int layer_end = 0;
};

// Where a step's logits go: copied to the host (num_logit_rows x vocab floats), or sampled on the
// device, one DeviceSampleRow per logit row.
struct LogitsSink {
  std::vector<float>* host = nullptr;
  std::span<const DeviceSampleRow> sample_rows;
  std::vector<SampledToken>* sampled = nullptr;
  // DeviceSampling::await_constraints: called before the first row's constraint is read.
  const std::function<void()>* await_constraints = nullptr;
};

// The step's activation buffers, owned by the backend: one row per token of the step.
enum class Activation {
  kHidden,     // [hidden] normalized input of attention or MLP
  kQkv,        // [(heads + 2 kv_heads) * head_dim] fused projection: Q, then K, then V
  kAttention,  // [heads * head_dim]
  kDelta,      // [hidden] output of a block, added to the residual stream by the next norm
  kGateUp,     // [2 * intermediate]
  kMlp,        // [intermediate]
  // [(heads + 2 kv_heads) * head_dim] a second projection buffer: InfiniGen projects layer i's
  // Q from layer i-1's attention input here to speculate on layer i's attention.
  kSpeculativeQkv,
};
// Elements per row of an activation buffer, for a model of this shape.
int64_t ActivationWidth(const ModelConfig& config, Activation which);
// The weights of one decoder layer, as the primitives name them.
// kPostAttnNorm, kPostFfnNorm: ModelConfig::sandwich_norms (Gemma-2).
enum class LayerWeight { kAttnNorm, kQkv, kO, kFfnNorm, kGateUp, kDown, kPostAttnNorm, kPostFfnNorm };

// Memory a backend allocated on its device, freed when this is destroyed.
class DeviceAllocation {
 public:
  virtual ~DeviceAllocation() = default;
  virtual std::span<std::byte> bytes() const = 0;
};

// ---- capabilities ------------------------------------------------------------------------------
// Primitives one system needs beyond the core ones. A backend implements those it can and returns
// them from FindCapability; a system asks for one with Backend::As<Capability>() and refuses to run
// (a clear error) where it is null.
enum class BackendCapability { kKvBlockScoring, kOffloadedKvPool, kKvPacking, kDeviceKvSpeculation };

// TriForce's retrieval scoring: per-block attention scores of the step's queries over cached keys.
class KvBlockScoring {
 public:
  static constexpr BackendCapability kId = BackendCapability::kKvBlockScoring;
  virtual ~KvBlockScoring() = default;
  // Zeroes the first `size` floats of the backend's block-score buffer (growing it); outside steps.
  virtual Status ResetKvBlockScores(int64_t size) = 0;
  // Adds this layer's scores of every job (KvBlockScoreJob); valid inside `layers`, after WriteKv.
  virtual Status ScoreKvBlocks(int layer, std::span<const KvBlockScoreJob> jobs) = 0;
  // Chooses each job's blocks (KvBlockSelectJob) on the backend; `chosen` receives every job's
  // ascending indices, one job after the other. Outside steps.
  virtual Status SelectTopKvBlocks(std::span<const KvBlockSelectJob> jobs, std::vector<int32_t>& chosen) = 0;
  // Copies scores [offset, offset + out.size()) of the buffer to the host (tests, diagnostics).
  virtual Status ReadKvBlockScores(int64_t offset, std::span<float> out) = 0;
};

// An offloaded KV pool (EngineConfig::kv_offload): the KV pool (KvTier::kDevice to every other
// primitive: block moves, KV reads) lives in host memory, the device keeping staging buffers for
// two layers that attention reads. A backend has this capability only while its pool is offloaded.
class OffloadedKvPool {
 public:
  static constexpr BackendCapability kId = BackendCapability::kOffloadedKvPool;
  virtual ~OffloadedKvPool() = default;
  // Starts fetching what layer `layer`'s attention will read into its staging buffer: each slice's
  // view (an empty `selection`, or a slice whose per_head is 0) or, per KV head, the slots of its
  // KvHeadSelection. Valid inside `layers`, once layer - 1's attention has run (the buffer it
  // reuses is free); the layer's attention must then read the same selections (an error
  // otherwise). Attention fetches by itself when nothing was prefetched.
  virtual Status PrefetchKv(int layer, std::span<const KvHeadSelection> selection) = 0;
  virtual KvOffloadStats kv_offload_stats() const = 0;
  // Keeps blocks [first, num_blocks) on the device for good, the host pool holding the others:
  // TriForce's scratch past the block manager's blocks (its drafting lanes and the copies its middle
  // level reads), so that its passes fetch nothing. A step reads and writes either resident blocks
  // only or pool blocks only (Unsupported otherwise); block moves, KV transfers and KV reads reach
  // both. Outside steps; the resident blocks' contents are undefined until written.
  virtual Status KeepResident(BlockId first) = 0;
  // The first resident block (num_blocks: none).
  virtual BlockId resident_begin() const = 0;
};

// What an offloaded pool's RunStep checks first, from what every slice reads (its view) and where
// the step writes: true for a resident step (resident blocks only, OffloadedKvPool::KeepResident);
// Unsupported for a step that touches both kinds of blocks, or a pool step whose views are not
// whole tables (the fetch leaves each slice's own tokens to WriteKv, which needs them last).
// `slots`: the step's resolved slot mapping (ResolveSlotMapping).
Result<bool> CheckOffloadedStep(const ForwardBatch& batch, std::span<const int64_t> slots, BlockId resident_begin,
                                int block_size);

// KV exchanged with a peer (KV-Runahead's chain, TSP's all-gather), and the device buffers a transport
// reads and writes (tensor parallelism's sums on GPU ranks).
class KvPacking {
 public:
  static constexpr BackendCapability kId = BackendCapability::kKvPacking;
  virtual ~KvPacking() = default;
  // Copies the K and V of `layer` at `slots` into `out` (KvPackBytes of them), in the pool's own
  // element format, so a peer with the same model and KV dtype unpacks exactly what this pool
  // holds: K then V, per KV head, the slots' rows in order. Valid inside `layers` (after WriteKv)
  // and outside steps.
  virtual Status PackKv(int layer, std::span<const int64_t> slots, std::span<std::byte> out) = 0;
  // Writes what PackKv produced for as many slots into `layer` at `slots` (this pool's own slots).
  virtual Status UnpackKv(int layer, std::span<const int64_t> slots, std::span<const std::byte> in) = 0;

  // ---- device buffers, for a transport whose buffers are device memory (NCCL, CUDA peer copies) --
  // The CUDA device whose memory the forms below pack into, or -1 where the backend has none (a CPU
  // backend): they are then unsupported.
  virtual int pack_device() const { return -1; }
  // A buffer of `bytes` in this backend's device memory, freed when the allocation is destroyed.
  virtual Result<std::unique_ptr<DeviceAllocation>> AllocatePackBuffer(int64_t bytes) {
    return Status::Unsupported("KV packing into device memory");
  }
  // PackKv / UnpackKv on the device: `out` / `in` are device memory of this backend (a
  // AllocatePackBuffer's bytes). The copy is issued on the backend's compute stream, after the work
  // already issued there, and the call returns without waiting for it: a transport must order its
  // operations on the buffer after RecordComputeEvent.
  virtual Status PackKvOnDevice(int layer, std::span<const int64_t> slots, std::span<std::byte> out) {
    return Status::Unsupported("KV packing into device memory");
  }
  virtual Status UnpackKvOnDevice(int layer, std::span<const int64_t> slots, std::span<const std::byte> in) {
    return Status::Unsupported("KV packing into device memory");
  }
  // A device event (a cudaEvent_t) recorded on the compute stream after everything issued there so
  // far, for Communicator::OrderAfter: the transport then sends a buffer only once it is packed and
  // overwrites one only once it is unpacked, and the host never waits. Re-recorded by the next call.
  virtual Result<void*> RecordComputeEvent() { return Status::Unsupported("device events"); }
  // The step's rows of an activation (tensor parallelism's partial kDelta) or of the residual
  // stream (a vocabulary shard's embedding) in this backend's device memory, for a device
  // transport to sum across the ranks in place (after RecordComputeEvent). Valid inside `layers`.
  // (This capability is the backend's device buffers for a transport: KV-Runahead's packed KV and
  // tensor parallelism's sums.)
  virtual Result<DeviceRows> DeviceActivation(Activation which) {
    return Status::Unsupported("device activations (tensor parallelism on GPU ranks)");
  }
  virtual Result<DeviceRows> DeviceResidual() {
    return Status::Unsupported("device residual stream (tensor parallelism on GPU ranks)");
  }
};

// InfiniGen's speculation on the device (kernels/infinigen_score.h), so that a decode step's token
// selection never crosses to the host. The backend keeps a partial key cache in device memory,
// paged in chunks of partial_key_chunk_rows() rows that the caller assigns to its sequences (as the
// block manager assigns KV blocks): per layer and KV head, num_partial_columns fp32 per row, row r
// of a sequence holding the partial columns of its key at position r. A speculation leaves its
// selection on the device for the attention of the layer it was made for (KvHeadSelection::
// speculated), and an offloaded pool's PrefetchKv then gathers only the selected rows from the
// host pool, on the copy stream, while the previous layer computes.
class DeviceKvSpeculation {
 public:
  static constexpr BackendCapability kId = BackendCapability::kDeviceKvSpeculation;
  virtual ~DeviceKvSpeculation() = default;
  struct Setup {
    int num_partial_columns = 0;
    std::span<const float> matrices;   // [num_layers][num_kv_heads][head_dim][head_dim]: the skews A, row-major
    std::span<const int32_t> columns;  // [num_layers][num_kv_heads][num_partial_columns]: kept columns of x.A
    int num_chunks = 0;                // of the partial key cache
    float alpha = 0.0f;                // SelectSpeculatedTokens' alpha
  };
  // Uploads the skews and allocates the partial key cache (ResourceExhausted, naming the bytes,
  // where the device lacks them). Outside steps, once.
  virtual Status SetUpSpeculation(const Setup& setup) = 0;
  virtual int partial_key_chunk_rows() const = 0;
  // Bytes one chunk of the partial key cache takes (every layer and KV head).
  virtual int64_t partial_key_chunk_bytes(int num_partial_columns) const = 0;
  // One sequence of the step: its slice, and the chunks holding its partial key rows in order.
  struct PartialKeyRows {
    int32_t slice = 0;
    std::span<const int32_t> chunks;
  };
  // Skews the keys at positions [from, to) of each job's slice (through its block table) into rows
  // [from, to) of its partial key cache. Valid inside `layers`, after the layer's WriteKv.
  struct ExtendJob {
    PartialKeyRows rows;
    int32_t from = 0;
    int32_t to = 0;
  };
  virtual Status ExtendPartialKeys(int layer, std::span<const ExtendJob> jobs) = 0;
  // Speculates `layer`'s attention for each job's one-token slice from that token's row of
  // kSpeculativeQkv: its query heads rotated at the token's position, scaled by 1/sqrt(head_dim)
  // and skewed, scored against rows [0, candidates) of its partial key cache (a KV head's score the
  // best of its group), the tokens chosen as SelectSpeculatedTokens with alpha and `cap`. Valid
  // inside `layers`, after the projection into kSpeculativeQkv and before `layer`'s attention.
  struct SpeculateJob {
    PartialKeyRows rows;
    int32_t candidates = 0;
    int32_t cap = 0;  // SpeculatedTokenCap(candidates, max_fraction)
  };
  virtual Status Speculate(int layer, std::span<const SpeculateJob> jobs) = 0;
  // Appends the token count of every speculation since the last call, in call and job order, to
  // `counts` (waits for the work issued so far: call it between steps).
  virtual Status TakeSpeculatedCounts(std::vector<int32_t>& counts) = 0;
  // What attention at `layer` reads under `selection` (the speculation made for it this step), as
  // host slot lists: `out` gets `selection` with each speculated slice's per-head positions
  // (ascending, the step's own token last) in place of its device selection. Waits for the device:
  // for observers and tests. Valid inside `layers`, before `layer`'s attention.
  virtual Status ReadSpeculatedSelection(int layer, std::span<const KvHeadSelection> selection,
                                         std::vector<KvHeadSelection>& out) = 0;
};

// A compute backend: it owns the weights, the paged KV pools, the step's activations, and the
// primitives a decoder is written in (forward/llama_model.h runs the layer loop over them). It has
// no forward pass of its own.
//
// A step: RunStep(batch, sink, layers) stages the batch, calls `layers` (which issues the
// primitives below for every layer), then runs the head (final norm and LM head over the rows
// that want logits, in chunks its memory allows) into the sink. A capturable `layers` issues the
// same primitives whatever the batch, so a backend may record it once (CUDA graphs) and replay it.
class Backend {
 public:
  virtual ~Backend() = default;

  virtual Status RunStep(const ForwardBatch& batch, const LogitsSink& sink, const std::function<Status()>& layers,
                         bool capturable) = 0;

  // ---- primitives, valid inside `layers` -------------------------------------------------------
  // residual = embedding rows of the step's tokens.
  virtual Status Embed() = 0;
  // hidden = RMSNorm(residual) * weight; with add_delta, residual += delta first.
  virtual Status RmsNorm(int layer, LayerWeight norm, bool add_delta) = 0;
  // out = in x weight^T (+ the weight's bias, fp32, where the model has one: HF's nn.Linear).
  virtual Status Linear(int layer, LayerWeight weight, Activation in, Activation out) = 0;
  // RMSNorm of every Q head and every K head of kQkv in place, with the layer's q and k norm
  // weights (ModelConfig::qk_norm: Qwen3), before Rotary.
  virtual Status QkNorm(int layer) = 0;
  // Rotates the Q and K heads of kQkv at the step's positions.
  virtual Status Rotary(int layer) = 0;
  // Writes the K and V heads of kQkv into the layer's pools at the step's slots.
  virtual Status WriteKv(int layer) = 0;
  // kAttention = attention of the Q heads of kQkv over each sequence's KV view.
  virtual Status Attention(int layer) = 0;
  // The same, where a slice's KvHeadSelection (one per slice of the batch) says so, over the tokens
  // it selects for each KV head.
  virtual Status AttentionOverSelection(int layer, std::span<const KvHeadSelection> selection) {
    return NotSupported("attention over per-head token selections");
  }
  // kMlp = silu(gate) * up of kGateUp.
  virtual Status SiluMul() = 0;
  // kMlp = gelu_tanh(gate) * up of kGateUp (ModelConfig::mlp_activation kGeluTanh: GeGLU).
  virtual Status GeluTanhMul() { return NotSupported("GeGLU (tanh GELU) MLPs"); }
  // delta = RMSNorm(delta) * the layer's `norm` weight, before delta joins the residual stream
  // (ModelConfig::sandwich_norms: kPostAttnNorm after attention, kPostFfnNorm after the MLP).
  virtual Status NormDelta(int layer, LayerWeight norm) {
    (void)layer, (void)norm;
    return NotSupported("norms of the attention and MLP outputs (Gemma-2's sandwich norms)");
  }
  // kDelta = the mixture of experts of kHidden (ModelConfig::num_experts > 0): each token's
  // router-chosen experts' SwiGLU MLPs, weighted by their router probabilities.
  virtual Status MoeMlp(int layer) = 0;
  // residual += delta (after the last layer).
  virtual Status AddDelta() = 0;

  // ---- reads for features that compute on the host (InfiniGen's and H2O's token selection) --------
  // Copies `rows` rows of an activation of the step, from row `first_row`, to `out` (rows x width
  // floats); valid inside `layers`.
  virtual Status ReadActivationRows(Activation which, int64_t first_row, int64_t rows, std::span<float> out) {
    return NotSupported("activation reads");
  }
  // The step's rows of an activation (rows x width floats) in host memory, to change in place:
  // tensor parallelism sums kDelta across the ranks there. Host-computing backends; valid inside
  // `layers`.
  virtual Result<std::span<float>> HostActivation(Activation which) {
    return NotSupported("host activations (tensor parallelism on this backend)");
  }
  // The step's residual stream (tokens x hidden fp32) in host memory, to read or overwrite:
  // pipeline parallelism passes it from stage to stage. Host-computing backends; valid inside
  // `layers`.
  virtual Result<std::span<float>> HostResidual() {
    return NotSupported("host residual stream (pipeline parallelism on this backend)");
  }
  // The final-norm output (what the LM head reads) of the last step's logit rows, `rows` rows from
  // `first_row` (hidden floats each) into `out`; valid after RunStep until the next one. A length
  // probe reads a prompt's last hidden state here, at the cost of a copy.
  virtual Status ReadFinalHidden(int64_t first_row, int64_t rows, std::span<float> out) {
    return NotSupported("final hidden state reads");
  }
  // The cached K (kv 0) or V (kv 1) of `layer` at device `slots` as fp32, [slots][kv_heads][head_dim]
  // into `out` (post-RoPE keys, as attention reads them); valid inside `layers`.
  virtual Status ReadKv(int layer, int kv, std::span<const int64_t> slots, std::span<float> out) {
    return NotSupported("KV reads");
  }

  // Backends that sample on the device accept a sink with sample_rows: only tokens and logprobs
  // cross to the host; same semantics as the CPU Sampler given the same uniforms. Every row's
  // params.logprobs <= kMaxDeviceTopLogprobs.
  virtual bool SupportsDeviceSampling() const { return false; }
  // Whether the forward pass runs on the host's cores (the CPU backend), rather than a device's
  // while the host waits.
  virtual bool ComputesOnHost() const { return true; }
  // Whether device sampling applies DeviceSampleRow::constraint's allowed-token mask and biases
  // (its bans it always applies).
  virtual bool SupportsDeviceTokenMask() const { return false; }

  // Copies whole blocks (every layer, K and V) between the device pool and the host swap pool,
  // or inside the device pool (copy-on-write). One call per kind per step.
  virtual Status CopyBlocks(std::span<const BlockMove> moves, BlockCopyKind kind) = 0;
  // Moves token ranges of chosen layers between tiers or inside one (CopyBlocks' general form:
  // per-layer prefetch, partial blocks, KV received from a peer). Ordered after the work already
  // issued and before the next step's; a destination must not overlap a source of the same call.
  virtual Status TransferKv(std::span<const KvTransfer> transfers) = 0;

  // ---- capabilities (below): what a backend adds for one system ---------------------------------
  // The capability if this backend has it, else null: `backend.As<KvPacking>()`.
  template <typename Capability>
  Capability* As() {
    return static_cast<Capability*>(FindCapability(Capability::kId));
  }
  template <typename Capability>
  const Capability* As() const {
    return static_cast<const Capability*>(FindCapability(Capability::kId));
  }

  virtual const KvCacheLayout& kv_layout() const = 0;
  // Bytes one token's K and V take at one layer (what reading or fetching it moves).
  virtual int64_t kv_token_bytes() const = 0;
  virtual int num_host_blocks() const = 0;
  virtual const ModelConfig& model_config() const = 0;
  virtual std::string Describe() const = 0;

 protected:
  Status NotSupported(const char* what) const { return Status::Unsupported(Describe() + " has no " + what); }
  // The object implementing capability `id` (as that capability's type), or null.
  virtual void* FindCapability(BackendCapability id) const { return nullptr; }
};

// FindCapability for a backend class that implements every capability (DeviceKvSpeculation where
// it derives from it), offering OffloadedKvPool only while its pool is `offloaded`.
template <typename BackendClass>
void* OfferCapabilities(const BackendClass* backend, BackendCapability id, bool offloaded) {
  auto* self = const_cast<BackendClass*>(backend);
  switch (id) {
    case BackendCapability::kKvBlockScoring: return static_cast<KvBlockScoring*>(self);
    case BackendCapability::kOffloadedKvPool: return offloaded ? static_cast<OffloadedKvPool*>(self) : nullptr;
    case BackendCapability::kKvPacking: return static_cast<KvPacking*>(self);
    case BackendCapability::kDeviceKvSpeculation:
      if constexpr (std::is_base_of_v<DeviceKvSpeculation, BackendClass>) {
        return static_cast<DeviceKvSpeculation*>(self);
      } else {
        return nullptr;
      }
  }
  return nullptr;
}

// Bytes PackKv produces for `num_slots` slots of one layer.
inline int64_t KvPackBytes(const Backend& backend, int64_t num_slots) { return num_slots * backend.kv_token_bytes(); }

// A run of slots that sit next to each other in one block: `length` rows from `first_slot`, the
// `index`-th slot of the list onwards. Pack and unpack copy one run per KV head at a time.
struct KvSlotRun {
  int64_t first_slot = 0;
  int64_t index = 0;
  int64_t length = 0;
};
std::vector<KvSlotRun> KvSlotRuns(std::span<const int64_t> slots, int block_size);
// Checks a PackKv / UnpackKv call: the layer, every slot inside the pool, the buffer's size.
Status ValidateKvPack(int layer, std::span<const int64_t> slots, size_t buffer_bytes, const Backend& backend);

// Checks a batch against the layout and the config (token ids, positions, block tables, slots,
// views).
Status ValidateForwardBatch(const ForwardBatch& batch, const ModelConfig& config,
                            const KvCacheLayout& layout);
// Checks one selection per slice, each holding num_kv_heads lists of at least the slice's new
// tokens, inside the pool.
Status ValidateKvHeadSelections(std::span<const KvHeadSelection> selection, const ForwardBatch& batch,
                                const KvCacheLayout& layout);
// Unsupported where any selection is a device speculation (KvHeadSelection::speculated): for a
// backend without DeviceKvSpeculation.
Status RefuseSpeculatedSelections(std::span<const KvHeadSelection> selection, const std::string& backend);
// Checks that every transfer stays inside its blocks, layers and pools.
Status ValidateKvTransfers(std::span<const KvTransfer> transfers, const KvCacheLayout& layout, int num_host_blocks);
// Checks that every move names blocks inside the pools it reads and writes.
Status ValidateBlockMoves(std::span<const BlockMove> moves, BlockCopyKind kind, int num_device_blocks,
                          int num_host_blocks);

}  // namespace kvflow
