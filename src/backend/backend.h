// The interface every compute backend implements: one forward pass over a batch of sequences whose
// KV cache lives in paged blocks (see kv/kv_cache_layout.h).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kv/block_manager.h"
#include "kv/kv_cache_layout.h"
#include "kvflow/config.h"
#include "kvflow/request.h"
#include "kvflow/sampling.h"
#include "kvflow/status.h"

namespace kvflow {

enum class LogitsMode { kNone, kLast, kAll };

// One sequence's share of a step: `num_tokens` new tokens (a prefill chunk or one decode token)
// at positions context_len - num_tokens .. context_len - 1.
struct SequenceSlice {
  int32_t token_offset = 0;  // index of the first of its tokens in ForwardBatch::tokens
  int32_t num_tokens = 0;
  int32_t context_len = 0;  // tokens in its KV cache once this step has written its own
  std::vector<BlockId> block_table;  // must cover context_len tokens
  LogitsMode logits = LogitsMode::kLast;
};

struct ForwardBatch {
  std::vector<int32_t> tokens;     // all new tokens of the step, sequence after sequence
  std::vector<int32_t> positions;  // position of each token in its sequence
  std::vector<SequenceSlice> seqs;

  // Rows of logits that Forward will produce, in sequence order.
  int64_t num_logit_rows() const;
};

// One logit row to sample on the device: the request's parameters, the sequence's tokens so far
// (for the penalties), tokens not allowed now, and the row's uniform draw in [0, 1) from the
// sequence's own RNG (so a seed gives the same tokens on every backend).
struct DeviceSampleRow {
  const SamplingParams* params = nullptr;
  double uniform = 0.0;
  std::span<const int32_t> prompt;
  std::span<const int32_t> output;
  std::span<const int32_t> suppress;
};

// Top alternatives a device sampler returns at most per token.
constexpr int kMaxDeviceTopLogprobs = 20;

// Where a batch of block moves (planned by the block manager) copies from and to.
enum class BlockCopyKind { kDeviceToHost, kHostToDevice, kDeviceToDevice };

class Backend {
 public:
  virtual ~Backend() = default;

  // Runs the model on `batch`, writing each new token's K/V into its block, and fills `logits`
  // with num_logit_rows() x vocab_size floats.
  virtual Status Forward(const ForwardBatch& batch, std::vector<float>& logits) = 0;

  // Backends that sample on the device run Forward and then sample each logit row there (`rows`:
  // one per logit row, in order), so only tokens and logprobs cross to the host; same semantics as
  // the CPU Sampler given the same uniforms. Every row's params.logprobs <= kMaxDeviceTopLogprobs.
  virtual bool SupportsDeviceSampling() const { return false; }
  virtual Status ForwardAndSample(const ForwardBatch& batch, std::span<const DeviceSampleRow> rows,
                                  std::vector<SampledToken>& sampled) {
    return Status::Unsupported("this backend does not sample on the device");
  }

  // Copies whole blocks (every layer, K and V) between the device pool and the host swap pool,
  // or inside the device pool (copy-on-write). One call per kind per step.
  virtual Status CopyBlocks(std::span<const BlockMove> moves, BlockCopyKind kind) = 0;

  virtual const KvCacheLayout& kv_layout() const = 0;
  virtual int num_host_blocks() const = 0;
  virtual const ModelConfig& model_config() const = 0;
  virtual std::string Describe() const = 0;
};

// Checks a batch against the layout and the config (token ids, positions, block tables).
Status ValidateForwardBatch(const ForwardBatch& batch, const ModelConfig& config,
                            const KvCacheLayout& layout);
// Checks that every move names blocks inside the pools it reads and writes.
Status ValidateBlockMoves(std::span<const BlockMove> moves, BlockCopyKind kind, int num_device_blocks,
                          int num_host_blocks);

}  // namespace kvflow
