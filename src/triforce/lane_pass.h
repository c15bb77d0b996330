// Forward passes over a partial KV cache, for TriForce's drafting levels: each sequence attends to
// a chosen list of its full KV blocks (the retrieval cache, or StreamingLLM's sinks + window), then
// to its own scratch lane. The lane is a run of blocks past those the block manager owns; it
// starts at the sequence's partial last block (copied in before drafting, all layers) and takes the
// drafted tokens' K/V after it, so the whole view is a block-table subset (KvView::kBlocks) that
// the existing paged kernels read on every backend, and drafting never writes a block the
// scheduler manages.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "kvflow/status.h"
#include "forward/llama_model.h"

namespace kvflow {

// One sequence's share of a pass: `tokens` at positions first_position.. (tokens before
// first_position are cached: those of full blocks in the table, those from lane_origin in the lane).
struct LaneSlice {
  std::vector<BlockId> blocks;  // physical full blocks read before the lane, in order
  int lane = 0;
  int64_t lane_origin = 0;  // position of the lane's first slot (the partial block's start)
  int64_t first_position = 0;
  std::vector<int32_t> tokens;
};

class LanePool {
 public:
  // Lanes of `blocks_per_lane` blocks from `first_block` on in `backend`'s pool.
  LanePool(Backend& backend, BlockId first_block, int blocks_per_lane, int num_lanes);

  // Blocks a lane needs to hold a partial block and `tokens` drafted tokens after it.
  static int BlocksPerLane(int64_t tokens, int block_size);
  int num_lanes() const { return num_lanes_; }
  Backend& backend() { return backend_; }

  // Copies each sequence's partial last block (positions [origin, cached) of `table`, all layers)
  // to the start of its lane; origin = cached rounded down to a block.
  struct PartialBlock {
    int lane = 0;
    std::span<const BlockId> table;
    int64_t cached = 0;
  };
  Status CopyPartialBlocks(std::span<const PartialBlock> parts);

  // Runs the slices (every token gets a logit row, slice after slice, into `logits`), writing
  // their K/V into their lanes; `hooks` may act inside the layer loop (chunk scoring).
  Status Forward(std::span<const LaneSlice> slices, LayerHooks* hooks, std::vector<float>& logits);

 private:
  // The ForwardBatch Forward runs (its slices in order).
  Result<ForwardBatch> Build(std::span<const LaneSlice> slices) const;
  BlockId LaneBlock(int lane, int64_t index) const { return first_block_ + lane * blocks_per_lane_ + static_cast<BlockId>(index); }

  Backend& backend_;
  BlockId first_block_;
  int blocks_per_lane_;
  int num_lanes_;
  int block_size_;
};

}  // namespace kvflow
