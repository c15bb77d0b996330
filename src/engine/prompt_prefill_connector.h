// A PromptPrefiller (KV-Runahead's ranks) as a KV connector: at admission it supplies the leading
// blocks of a long prompt that nothing is cached for; the request's fresh blocks for them are
// filled by the prefiller before the step's forward pass (its Load), and the engine's steps compute
// only the tail and sample the first token as usual. Once computed, the blocks are published in the
// prefix cache like any other. A prefill that fails (a rank gone) is computed here instead, by the
// target model in chunks of max_num_batched_tokens, so a failure only costs the speed-up.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/kv_connector.h"
#include "engine/prompt_prefiller.h"

namespace kvflow {

class PromptPrefillConnector final : public KvConnector, private KvConnectorScheduler {
 public:
  // `target` is the backend whose pool the prefiller fills; both must outlive the connector.
  PromptPrefillConnector(std::unique_ptr<PromptPrefiller> prefiller, Backend& target, int block_size,
                         int64_t max_num_batched_tokens);

  std::string name() const override { return "prompt_prefill"; }
  std::string Describe() const override { return prefiller_->Describe(); }
  KvConnectorScheduler* scheduler_side() override { return this; }
  Status Load(const SchedulerOutput& step, const KvConnectorMoves* moves, Backend& backend) override;

 private:
  struct Job {
    std::vector<int32_t> tokens;  // the prompt's first num_tokens tokens
    std::vector<BlockId> blocks;
  };
  int64_t NumMatchedTokens(std::span<const int32_t> tokens, int64_t num_cached) override;
  void UpdateStateAfterAlloc(std::span<const int32_t> tokens, int64_t first_token,
                             std::span<const BlockId> blocks) override;
  KvConnectorMoves TakeStepMoves() override;
  // Computes a job's tokens with the target model itself.
  Status ComputeHere(const Job& job);

  std::unique_ptr<PromptPrefiller> prefiller_;
  Backend& target_;
  int block_size_;
  int64_t max_num_batched_tokens_;
  std::vector<Job> planned_;  // admitted since the last schedule ended
  std::vector<Job> step_;     // to fill in the step being run
};

}  // namespace kvflow
