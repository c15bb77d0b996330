// InfiniGen's decode-time KV selection (seed 000, §4.3) behind the engine's KvSelector seam: at
// layer i-1 it projects layer i's query from layer i-1's input, rotates and skews it,
// scores it on its partial columns against layer i's partial key cache (the same columns of every
// cached key, skewed), and layer i's attention then reads, per KV head, only the tokens selected:
// those within alpha of the head's maximum, the count averaged over the KV heads and capped at
// max_fraction of the cache, each head taking its own top count (speculation.h). Layer 0 reads
// everything.
//
// The speculative query is layer i's own RMSNorm and QKV projection of the residual stream at layer
// i-1: as the paper does, the stream entering layer i-1 (SpeculationPoint::kLayerInput), or, the
// default, that stream once layer i-1's attention output has joined it (kAfterAttention), which is
// one MLP short of layer i's true input. On SmolLM2 (135M, 30 narrow layers, where consecutive
// layer inputs are less alike than in the paper's 7B+ models) the difference is large: WikiText-2
// perplexity over one 2048-token window, token by token, each layer reading its top 20%: full
// cache 13.47, an oracle with layer i's true query 14.20, kAfterAttention 14.42, kLayerInput 16.57.
// The price is a shorter overlap: the prefetch hides behind layer i-1's MLP, not all of layer i-1.
// (Layer i's own norm weight rather than layer i-1's, which the published OPT code reuses, also
// helped: 19.15 instead of 19.86 over a 512-token window at alpha 5.)
//
// Grouped-query attention (CountRule): by default every query head counts the tokens within alpha of
// its own maximum and a KV head reads the union of its query heads' top tokens (one fetch of a KV
// head's K/V serves every query head of the group); kv-head-max, kvflow's first rule and the one the
// device runs, scores a token per KV head by its query heads' maximum, so one sharp head shrinks
// the group's count. Sinks and a recent window may be forced into every read, the first layers
// kept dense, and SpeculationPoint::kOracle replaces the speculation by each layer's own query
// against its whole keys (the ceiling, for evaluation).
//
// The partial key cache lives here, per sequence and layer; prefill chunks extend it as their keys
// are written, and a decode step extends it from the KV pool to its context (so prefix-cache hits,
// forks and swapped sequences need nothing special);
// it follows recomputation by truncating to the first recomputed position.
//
// The host KV pool manager (§4.4), with InfiniGenConfig::host_kv_tokens > 0: per sequence and
// layer the pool holds at most that many cached tokens, a HostKvEviction (host_kv_eviction.h:
// counter, lru or fifo) over their positions. A token joins a layer's pool in the first step after
// its own, before that layer reads (a decode token at the next step's speculation of the layer,
// layer 0 and prefill chunks just before their attention), and when the pool is full the victim
// leaves it for good: speculation scores, caps (max_fraction of the live tokens) and picks among
// live tokens only, and a read that would take everything (layer 0, prefill chunks, contexts below
// min_context) takes the live tokens and the step's own once the layer has evicted any. Every token
// a layer's read took (the step's own aside) counts as fetched. Recomputation truncates the pool
// too: entries at or past the first recomputed position leave it, without an eviction (tokens they
// evicted stay evicted).
// Physically the engine's paged block tables still map every position to its own slot: an evicted
// token's slot is not reused for the new token as the paper overwrites in place, so the cap bounds
// what attention can read (the accuracy effect the paper's Table 2 measures), not yet the bytes held.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "engine/kv_selector.h"
#include "infinigen/host_kv_eviction.h"
#include "infinigen/skew_file.h"
#include "infinigen/speculation.h"
#include "kvflow/kv_selection.h"
#include "model/rope.h"

namespace kvflow {

// Where layer i's attention is speculated, at layer i-1.
enum class SpeculationPoint {
  kLayerInput,      // before layer i-1's attention, from its input (the paper: the prefetch overlaps all of layer i-1)
  kAfterAttention,  // once layer i-1's attention output joined the residual (the prefetch overlaps its MLP)
  kOracle,          // none: layer i's own query against its whole keys, as it runs (the ceiling; nothing to prefetch)
};
Result<SpeculationPoint> ParseSpeculationPoint(const std::string& name);  // "layer-input", "after-attention", "oracle"
// How a speculated layer's count and tokens are chosen (InfiniGenOptions::count_rule).
enum class CountRule { kKvHeadMax, kQueryHeads };
Result<CountRule> ParseCountRule(const std::string& name);  // "kv-head-max", "query-heads"
const char* SpeculationPointName(SpeculationPoint p);

struct InfiniGenConfig {
  SpeculationPoint point = SpeculationPoint::kAfterAttention;
  double alpha = 5.0;
  double max_fraction = 0.2;
  int max_tokens = 0;   // > 0: the cap in tokens instead of max_fraction
  int min_context = 0;  // shorter contexts read the whole cache
  CountRule count_rule = CountRule::kQueryHeads;
  int dense_layers = 1;    // layers [0, dense_layers) read everything
  int sink_tokens = 0;     // forced into every speculated read: the first tokens
  int recent_tokens = 0;   // and the latest cached ones
  int host_kv_tokens = 0;  // per sequence and layer; 0: no cap
  HostEvictionPolicy eviction = HostEvictionPolicy::kCounter;

  static InfiniGenConfig FromOptions(const KvSelectionConfig& c);
  Status Validate() const;
};

// Why these settings keep the speculation on the host (empty: the device's kernels run them): the
// device scores and counts per KV head on its query heads' maximum, with nothing forced.
std::string HostOnlySettings(const InfiniGenConfig& c);

// Where InfiniGen speculates (InfiniGenOptions::speculate_on).
enum class SpeculationDevice { kAuto, kDevice, kHost };
Result<SpeculationDevice> ParseSpeculationDevice(const std::string& name);  // "auto", "device", "host"

class InfiniGenSelector final : public KvSelector, private LayerHooks {
 public:
  // `backend` must outlive the selector; `skew` must be the model's (ReadSkewTable checks it).
  InfiniGenSelector(const InfiniGenConfig& config, SkewTable skew, Backend& backend);

  // Moves the partial key cache, the scoring and the selection onto the backend's device
  // (DeviceKvSpeculation), the cache in `num_chunks` chunks. Before the first step. Unsupported
  // where the backend has no device speculation or a host pool cap is set (its eviction state
  // lives on the host); ResourceExhausted where the device lacks the memory.
  Status SpeculateOnDevice(int num_chunks);
  bool on_device() const { return device_ != nullptr; }
  int partial_columns() const { return skew_.num_partial_columns; }

  LayerHooks* ForStep(const ForwardBatch& batch, std::span<const int64_t> seq_ids,
                      std::span<const uint8_t> selecting) override;
  void Forget(int64_t seq_id) override;
  void AddStats(KvSelectionStats& stats) const override;

  // Sequences holding a partial key cache (tests).
  size_t num_sequences() const { return seqs_.size(); }
  // A sequence's host pool at `layer` (null without a cap or state) and the positions it evicted
  // so far, ascending (tests).
  const HostKvEviction* HostPool(int64_t seq_id, int layer) const;
  std::vector<int32_t> EvictedPositions(int64_t seq_id, int layer) const;

 private:
  // One layer's host pool: positions [0, admitted) have joined it, those evicted since are marked.
  struct LayerPool {
    explicit LayerPool(HostKvEviction e) : entries(std::move(e)) {}
    HostKvEviction entries;
    int32_t admitted = 0;
    int32_t num_evicted = 0;
    std::vector<uint8_t> evicted;  // by position
  };
  // Partial keys of one sequence: per layer and KV head, rows x num_partial_columns floats.
  struct SequenceState {
    std::vector<std::vector<float>> partial_keys;  // layer * kv_heads + kv_head
    std::vector<int32_t> rows;                      // per layer: positions held
    std::vector<LayerPool> pools;                   // per layer; empty without a cap
    std::vector<int32_t> chunks;                    // on the device: its partial key chunks
  };

  Status BeforeAttention(const LayerContext& ctx) override;
  std::span<const KvHeadSelection> AttentionSelection(const LayerContext& ctx) override;
  std::optional<std::span<const KvHeadSelection>> UpcomingSelection(int layer) override;
  Status AfterMlpInput(const LayerContext& ctx) override;
  Status TimedSpeculate(int layer, const ForwardBatch& batch);
  // Whether layer `layer` reads a selection (speculated at layer - 1, or the oracle's).
  bool Selects(int layer) const { return layer >= config_.dense_layers && layer < skew_.num_layers; }
  // The selection rule for the step's rows (query heads, or KV heads under kv-head-max).
  TokenSelectionRule SelectionRule(int group) const;
  // Turns `picked` (indices into the candidates, per KV head) into the slice's read of `cached`
  // tokens and the step's own; `position_of` maps a candidate to its position.
  template <typename PositionOf>
  void FillSelection(const SpeculatedTokens& picked, const SequenceSlice& slice, int32_t cached,
                     PositionOf position_of, KvHeadSelection& sel);
  // The oracle: layer `layer` chooses its reads from its own rotated queries (kQkv) and its whole
  // keys, into selection_.
  Status OracleSelect(int layer, const ForwardBatch& batch);

  // Extends the layer's partial keys of `state` to the first `positions` positions of the slice.
  Status ExtendPartialKeys(int layer, const SequenceSlice& slice, int32_t positions, SequenceState& state);
  // On the device: gives `state` chunks for `rows` rows (false when none are left).
  bool EnsureChunks(SequenceState& state, int32_t rows);
  // On the device: extends the layer's partial keys of the slices (indices into the batch) with
  // their states to the positions `positions_of` gives.
  template <typename PositionsOf>
  Status ExtendOnDevice(int layer, const ForwardBatch& batch, const std::vector<int32_t>& slices,
                        const std::vector<SequenceState*>& states, PositionsOf positions_of);
  // The device's speculation of `layer` for the step's decode slices.
  Status SpeculateWithDevice(int layer, const ForwardBatch& batch);
  // Adds the device speculations' counts made so far to the stats (between steps).
  void TakeDeviceCounts();
  // Speculates layer `layer`'s attention for the step's selecting slices into next_selection_.
  Status Speculate(int layer, const ForwardBatch& batch);
  // Brings the layer's pool (if capped) to the first `positions` positions: later ones leave it
  // (recomputation), new ones join it, each evicting the victim when it is full.
  Status SyncPool(int layer, int32_t positions, SequenceState& state);
  // The layer's live pooled positions, ascending, into `out`.
  static void LivePositions(const LayerPool& pool, std::vector<int32_t>& out);
  // A read of the whole cache by `slice` at `layer`: with a cap, its earlier tokens join the pool,
  // the live ones count as fetched and, once any was evicted, `sel` takes them and the slice's own
  // (otherwise per_head 0: the slice's view).
  Status ReadWholePool(int layer, const SequenceSlice& slice, SequenceState& state, KvHeadSelection& sel);

  InfiniGenConfig config_;
  SkewTable skew_;
  Backend& backend_;
  RopeFrequencies rope_;
  int64_t token_bytes_ = 0;  // K and V bytes of one token at one layer
  std::unordered_map<int64_t, SequenceState> seqs_;

  // The step: selecting slices (index into the batch) and their states.
  std::vector<int32_t> active_;
  std::vector<SequenceState*> active_states_;
  // Prefill chunks of selecting sequences: their keys extend the partial key cache. With a cap,
  // also single-token steps below the context that selects, which read the whole live pool.
  std::vector<int32_t> prefilling_;
  std::vector<SequenceState*> prefilling_states_;
  // Per slice of the batch: what layer selection_layer_ reads now, and what the speculation at it
  // chose for the next layer.
  std::vector<KvHeadSelection> selection_, next_selection_;
  int selection_layer_ = -1;
  int next_selection_layer_ = -1;  // the layer next_selection_ was speculated for
  // On the device (SpeculateOnDevice): the backend's speculation, and the chunks of its partial key
  // cache no sequence holds.
  DeviceKvSpeculation* device_ = nullptr;
  int chunk_rows_ = 0;
  std::vector<int32_t> free_chunks_;
  bool warned_no_chunks_ = false;
  std::vector<DeviceKvSpeculation::ExtendJob> extend_jobs_;
  std::vector<DeviceKvSpeculation::SpeculateJob> speculate_jobs_;
  std::vector<int32_t> counts_;
  // Scratch.
  std::vector<float> qkv_rows_, keys_, scores_, query_, head_scores_;
  std::vector<int32_t> live_, fetched_;
  std::vector<int64_t> oracle_slots_;
  KvSelectionStats stats_;
};

}  // namespace kvflow
