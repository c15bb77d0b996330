// TriForce (Sun et al. 2024, seed 003): lossless hierarchical speculative decoding for long
// contexts, as the engine's Drafter. Three levels:
//
//   bottom  - proposes gamma1 tokens at a time: the n-gram lookup, the target over a StreamingLLM
//             cache (attention sinks + recent window; MagicDec's self-speculation), or a small
//             draft model over its own StreamingLLM cache;
//   middle  - the target over its retrieval cache (triforce/retrieval_cache.h) verifies them in one
//             pass, again and again, until gamma2 tokens are drafted;
//   top     - the target with its full cache verifies the gamma2 tokens in the engine's step
//             (engine/decoding/speculative_sampling.h).
//
// Exact at both levels: the middle keeps a bottom draft d with probability min(1, q_mid(d) /
// q_bot(d)) and otherwise draws from the residual norm(max(0, q_mid - q_bot)) (one-hot n-gram
// drafts: draw x ~ q_mid, keep d iff x == d), so every token it hands up is distributed as q_mid,
// the row it hands up with it; the top then applies the same rule with p. (The published code
// resamples rejected middle tokens from q_mid itself, which is not exact.)
//
// The middle and a streaming bottom run on the target's backend between the engine's steps, their
// drafted K/V in scratch lanes past the blocks the block manager owns (triforce/lane_pass.h).
//
// Over an offloaded KV pool (EngineConfig::kv_offload, the paper's offloading setting) the target's
// full cache is in host memory and every verification streams it once, layer by layer, for all its
// gamma2 + 1 rows (offload/kv_prefetch.h). The middle level must not: its scratch (the lanes and a
// copy region per sequence, for up to kMaxCopyRegions sequences, holding the blocks its retrieval
// cache reads) is kept resident on the device (OffloadedKvPool::KeepResident), each block copied
// there once, when it enters the view, so the middle passes read device memory only. The bottom is n-gram or the draft model (whose
// backend keeps its own cache on the device); the streaming bottom reads the target's recent
// window, which the host holds, and is refused.
//
// The retrieval cache is built inside the engine's own passes, so building costs no pass of its
// own: when a sequence needs a (new) selection, the drafter asks for its chunks to be scored in the
// coming step (StepHooks: the query of the sequence's newest token, at every layer, over the full
// cache: the first decode step after the prefill for the first build, a verification pass for a
// rebuild), and selects the top chunks before the next step drafts. The first decode step of a
// sequence therefore runs without drafts; a rebuild keeps drafting over the old selection meanwhile.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "kvflow/speculative.h"
#include "forward/llama_model.h"
#include "engine/drafter.h"
#include "speculative/ngram_drafter.h"
#include "triforce/lane_pass.h"
#include "triforce/retrieval_cache.h"

namespace kvflow {

struct TriForceConfig {
  int gamma2 = 6;  // tokens the middle drafts for each full-cache verification
  int gamma1 = 3;  // tokens the bottom proposes to each middle pass
  std::string bottom = "ngram";  // "ngram", "streaming" or "draft_model"
  RetrievalPolicy retrieval;
  int sinks = 16;    // streaming bottom (or draft model): sink tokens
  int window = 256;  // and recent tokens
  int ngram_max = 4;
  int ngram_min = 1;
  int max_num_seqs = 64;  // scratch lanes
  bool kv_offload = false;  // the target's pool is offloaded: the middle reads resident copies

  static TriForceConfig FromOptions(const SpeculativeConfig& config, int max_num_seqs);
  Status Validate() const;
};

class TriForceDrafter final : public Drafter, private StepHooks, private LayerHooks {
 public:
  // `target`: the engine's backend; its blocks from `target_scratch` on hold the lanes
  // (TargetScratchBlocks). `draft`: the bottom draft model's backend (bottom "draft_model", else
  // null), following the target's tables, its blocks from `draft_scratch` on for lanes.
  TriForceDrafter(const TriForceConfig& config, Backend& target, BlockId target_scratch, Backend* draft,
                  BlockId draft_scratch);
  ~TriForceDrafter() override;

  // Scratch blocks past the block manager's in the target's pool, and in the draft model's.
  static int TargetScratchBlocks(const TriForceConfig& config, int block_size);
  // Copy regions over an offloaded pool: one per drafting sequence, at most kMaxCopyRegions (each
  // holds a whole retrieval cache on the device; TriForce's offloading setting serves a few long
  // sequences). Sequences past them decode plainly.
  static constexpr int kMaxCopyRegions = 8;
  static int CopyRegions(const TriForceConfig& config);
  static int DraftScratchBlocks(const TriForceConfig& config, int block_size);

  int num_speculative_tokens() const override { return config_.gamma2; }
  void Propose(std::span<DraftJob* const> jobs) override;
  void OnVerified(int64_t seq_id, int64_t drafted, int64_t accepted) override;
  void Forget(int64_t seq_id) override;
  void AddStats(SpecDecodeStats& stats) const override;
  StepHooks* step_hooks() override { return this; }

 private:
  struct Work;
  class Bottom;
  struct Tracked {
    RetrievalCache cache;
    bool want_scores = false;  // score its chunks in the coming step
    // Over an offloaded pool: its copy region (-1: none yet), how many of its view's blocks are
    // copied there (the view's prefix, in order), and the build they belong to.
    int region = -1;
    size_t copied = 0;
    int64_t copied_build = -1;
  };
  // A sequence whose chunks the last step scored: its scores in the backend's buffer.
  struct Scored {
    int64_t seq_id = 0;
    int64_t score_offset = 0;
    int32_t num_blocks = 0;
    int64_t cached = 0;  // tokens cached when it was scored
  };

  // StepHooks: the scoring jobs of the step's sequences that asked for scores.
  LayerHooks* ForStep(const ForwardBatch& batch, std::span<const int64_t> seq_ids,
                      std::span<const uint8_t> kv_selection) override;
  // Of the target's scratch: the lanes (middle, then a streaming bottom's), and over an offloaded
  // pool the CopyRegions copy regions after them, of CopyRegionBlocks each.
  static int LaneScratchBlocks(const TriForceConfig& config, int block_size);
  static int CopyRegionBlocks(const TriForceConfig& config, int block_size);
  // LayerHooks: scores this layer's chunks.
  Status BeforeAttention(const LayerContext& ctx) override { return scorer_.ScoreKvBlocks(ctx.layer, scoring_); }
  // Selects the top chunks of the sequences the last step scored.
  Status BuildScored();
  Status ProposeChunk(std::span<DraftJob* const> jobs);
  // The physical blocks the middle reads for each work: the table's, or over an offloaded pool the
  // resident copies (copying what entered the view since the last call). False for a work whose
  // view does not fit its region (it then decodes plainly until its next build).
  Status PlaceMiddleViews(std::vector<Work>& works, std::vector<bool>& placed);
  Status MiddlePass(std::vector<Work>& works);
  void VerifyAtMiddle(Work& w, std::span<float> rows);

  TriForceConfig config_;
  Backend& target_;
  KvBlockScoring& scorer_;  // the target's (the plugin checks it has one)
  int block_size_;
  LanePool middle_;
  std::unique_ptr<Bottom> bottom_;
  BlockId copy_regions_ = 0;        // first block of the copy regions (offloaded pool)
  std::vector<int> free_regions_;
  std::unordered_map<int64_t, Tracked> seqs_;
  std::vector<KvBlockScoreJob> scoring_;
  std::vector<Scored> scored_;
  SpecDecodeStats stats_;
  int64_t failed_batches_ = 0;
  std::vector<float> logits_;
};

}  // namespace kvflow
