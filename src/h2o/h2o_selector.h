// H2O (Zhang et al., "Heavy-Hitter Oracle"), the eviction baseline InfiniGen is compared with, behind
// the engine's KvSelector seam: per sequence, layer and KV head it keeps a budget of the context
// (budget x context tokens): a recent window plus the "heavy hitters", the tokens with the largest
// attention accumulated over the decoding steps so far; anything else is evicted for good and never
// read again. Attention at every layer reads the kept tokens and the step's own.
//
// Grouped-query attention: a KV head's accumulated score of a token sums the attention of every
// query head of its group. A sequence that reaches decoding with a prompt longer than the budget
// (its prefill read everything) starts from the first decode query's attention over the prompt in
// place of the prefill's accumulated attention, then evicts down to the budget.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "engine/kv_selector.h"
#include "kvflow/kv_selection.h"

namespace kvflow {

struct H2OConfig {
  double budget = 0.2;        // fraction of the context kept
  double recent_share = 0.5;  // of the budget, the most recent tokens (the rest: heavy hitters)
  int min_context = 0;

  static H2OConfig FromOptions(const KvSelectionConfig& c);
  Status Validate() const;
  // Tokens kept once the context holds `context` tokens (the step's own included).
  int32_t Budget(int32_t context) const;
};

class H2OSelector final : public KvSelector, private LayerHooks {
 public:
  H2OSelector(const H2OConfig& config, Backend& backend);

  LayerHooks* ForStep(const ForwardBatch& batch, std::span<const int64_t> seq_ids,
                      std::span<const uint8_t> selecting) override;
  void Forget(int64_t seq_id) override { seqs_.erase(seq_id); }
  void AddStats(KvSelectionStats& stats) const override;

 private:
  struct HeadState {
    std::vector<int32_t> kept;  // positions, ascending
    std::vector<float> score;   // accumulated attention, by position
  };
  struct SequenceState {
    std::vector<HeadState> heads;  // layer * kv_heads + kv_head
    std::vector<int32_t> seen;     // per layer: positions already kept or evicted
  };

  Status BeforeAttention(const LayerContext& ctx) override;
  std::span<const KvHeadSelection> AttentionSelection(const LayerContext& ctx) override;
  Status AfterAttention(const LayerContext& ctx) override;

  // Adds the attention of the step's query (kQkv, rotated) over each KV head's kept tokens and the
  // step's own to their scores.
  Status Accumulate(int layer, const SequenceSlice& slice, SequenceState& state);
  // Evicts each head's lowest-scoring non-recent tokens until `budget` remain.
  void Evict(int layer, int32_t budget, int32_t recent_from, SequenceState& state) const;

  H2OConfig config_;
  Backend& backend_;
  int64_t token_bytes_ = 0;
  std::unordered_map<int64_t, SequenceState> seqs_;

  std::vector<int32_t> active_;
  std::vector<SequenceState*> active_states_;
  std::vector<KvHeadSelection> selection_;
  int selection_layer_ = -1;
  std::vector<float> qkv_row_, keys_, probs_;
  std::vector<int32_t> union_;  // Accumulate: positions read, ascending
  KvSelectionStats stats_;
};

}  // namespace kvflow
