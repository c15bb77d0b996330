// Draft-model speculative decoding (vLLM's "draft_model" method; Leviathan et al. 2023): a smaller
// model with the target's tokenizer drafts k tokens by sampling, and the target verifies them in
// one pass with exact rejection sampling (engine/decoding/speculative_sampling.h).
//
// It is also the first user of a second KV cache in one engine. The draft model's pool follows the
// target's block tables: its first num_table_blocks blocks mirror the target's, because the
// ModelExecutor applies every block move to it and runs every step's tokens through the draft
// model too (ModelExecutor::AddFollower), so each computed position holds the draft model's K/V
// in the same slot. vLLM does the same by putting the draft layers in the target's KV cache group.
// Prefix caching, copy-on-write, swapping, recompute and truncation need nothing of their own.
//
// The k autoregressive draft passes write their K/V into scratch blocks after the table blocks,
// one run of slots per sequence of the batch, and attend over [the sequence's cached slots, then
// its scratch slots] (a KvView of slots): drafting never writes a block the scheduler manages.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "kvflow/engine_config.h"
#include "kvflow/tokenizer.h"
#include "engine/drafter.h"

namespace kvflow {

// The draft model's backend for an engine on `target`: config.speculative.model on the same
// device, its pool the target's blocks (which it follows) plus `scratch_blocks` of the drafter's.
// Refused with a clear error when its tokenizer is not the target's or its context is shorter than
// max_model_len.
Result<std::unique_ptr<Backend>> CreateDraftModelBackend(const EngineConfig& config, const Backend& target,
                                                         const ModelConfig& target_model, const Tokenizer& tokenizer,
                                                         int scratch_blocks);

class DraftModel final : public Drafter {
 public:
  // `backend` holds the draft model and a pool of num_table_blocks + ScratchBlocks() blocks; it
  // must outlive the drafter.
  DraftModel(Backend& backend, int num_table_blocks, int num_speculative_tokens, int max_num_seqs);

  // Scratch blocks the pool needs past the table blocks.
  static int ScratchBlocks(int num_speculative_tokens, int max_num_seqs, int block_size);

  int num_speculative_tokens() const override { return k_; }
  // k passes of the draft model over the whole batch, each sampling one draft per sequence from
  // the draft's distribution under the request's sampling parameters. A pass that fails leaves
  // the batch without drafts (decoding goes on without speculation) and is logged.
  void Propose(std::span<DraftJob* const> jobs) override;

  int64_t failed_batches() const { return failed_batches_; }

 private:
  Status ProposeChunk(std::span<DraftJob* const> jobs);
  // Scratch slot of draft step `step` of the b-th sequence of a batch.
  int64_t ScratchSlot(int b, int step) const;

  Backend& backend_;
  int num_table_blocks_;
  int k_;
  int max_num_seqs_;
  int blocks_per_seq_;
  int64_t failed_batches_ = 0;
  std::vector<float> logits_;
};

}  // namespace kvflow
