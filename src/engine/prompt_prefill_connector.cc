#include "engine/prompt_prefill_connector.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include <spdlog/spdlog.h>

#include "forward/llama_model.h"

namespace kvflow {

PromptPrefillConnector::PromptPrefillConnector(std::unique_ptr<PromptPrefiller> prefiller, Backend& target,
                                               int block_size, int64_t max_num_batched_tokens)
    : prefiller_(std::move(prefiller)), target_(target), block_size_(block_size),
      max_num_batched_tokens_(max_num_batched_tokens) {}

int64_t PromptPrefillConnector::NumMatchedTokens(std::span<const int32_t> tokens, int64_t num_cached) {
  // The ranks compute a prompt from its first token: with part of it cached, the engine computes
  // the rest itself.
  if (num_cached > 0) return 0;
  const int64_t n = prefiller_->TokensToPrefill(tokens, block_size_);
  return n > 0 && n % block_size_ == 0 && n < static_cast<int64_t>(tokens.size()) ? n : 0;
}

void PromptPrefillConnector::UpdateStateAfterAlloc(std::span<const int32_t> tokens, int64_t first_token,
                                                   std::span<const BlockId> blocks) {
  const size_t n = blocks.size() * static_cast<size_t>(block_size_);
  planned_.push_back({std::vector<int32_t>(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(n)),
                      std::vector<BlockId>(blocks.begin(), blocks.end())});
}

KvConnectorMoves PromptPrefillConnector::TakeStepMoves() {
  // No block moves: the prefiller writes the blocks itself, in Load.
  step_ = std::exchange(planned_, {});
  return {};
}

Status PromptPrefillConnector::Load(const SchedulerOutput&, const KvConnectorMoves*, Backend& backend) {
  if (&backend != &target_) return Status::Ok();  // the prefiller fills the target's pool only
  for (const Job& job : step_) {
    const auto start = std::chrono::steady_clock::now();
    const int64_t n = static_cast<int64_t>(job.tokens.size());
    if (Status st = prefiller_->Prefill(job.tokens, n, job.blocks); !st.ok()) {
      spdlog::warn("prefill of {} prompt tokens across ranks failed, computing them here: {}", n, st.ToString());
      KVFLOW_RETURN_IF_ERROR(ComputeHere(job));
      continue;
    }
    spdlog::debug("prefilled {} prompt tokens across ranks in {:.3f} s", n,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  step_.clear();
  return Status::Ok();
}

Status PromptPrefillConnector::ComputeHere(const Job& job) {
  LlamaModel model(target_);
  std::vector<float> no_logits;
  const int64_t n = static_cast<int64_t>(job.tokens.size());
  for (int64_t begin = 0; begin < n; begin += max_num_batched_tokens_) {
    const int64_t end = std::min(n, begin + max_num_batched_tokens_);
    ForwardBatch batch;
    SequenceSlice slice;
    slice.num_tokens = static_cast<int32_t>(end - begin);
    slice.context_len = static_cast<int32_t>(end);
    slice.block_table = job.blocks;
    slice.logits = LogitsMode::kNone;
    for (int64_t i = begin; i < end; ++i) {
      batch.tokens.push_back(job.tokens[static_cast<size_t>(i)]);
      batch.positions.push_back(static_cast<int32_t>(i));
    }
    batch.seqs.push_back(std::move(slice));
    KVFLOW_RETURN_IF_ERROR(model.Forward(batch, no_logits));
  }
  return Status::Ok();
}

}  // namespace kvflow
