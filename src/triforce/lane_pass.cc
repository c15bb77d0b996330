#include "triforce/lane_pass.h"

#include <string>

namespace kvflow {

LanePool::LanePool(Backend& backend, BlockId first_block, int blocks_per_lane, int num_lanes)
    : backend_(backend),
      first_block_(first_block),
      blocks_per_lane_(blocks_per_lane),
      num_lanes_(num_lanes),
      block_size_(backend.kv_layout().block_size) {}

int LanePool::BlocksPerLane(int64_t tokens, int block_size) {
  // The partial block holds at most block_size - 1 tokens.
  return BlocksForTokens(tokens + block_size - 1, block_size);
}

Status LanePool::CopyPartialBlocks(std::span<const PartialBlock> parts) {
  std::vector<KvTransfer> transfers;
  const int layers = backend_.model_config().num_layers;
  for (const PartialBlock& p : parts) {
    const int64_t origin = p.cached / block_size_ * block_size_;
    const int count = static_cast<int>(p.cached - origin);
    if (count == 0) continue;
    const size_t block = static_cast<size_t>(p.cached / block_size_);
    if (block >= p.table.size() || p.lane < 0 || p.lane >= num_lanes_) {
      return Status::Internal("lane copy: sequence or lane out of range");
    }
    KvTransfer t;
    t.src_block = p.table[block];
    t.dst_block = LaneBlock(p.lane, 0);
    t.num_tokens = count;
    t.layer_end = layers;
    transfers.push_back(t);
  }
  if (transfers.empty()) return Status::Ok();
  return backend_.TransferKv(transfers);
}

Result<ForwardBatch> LanePool::Build(std::span<const LaneSlice> slices) const {
  ForwardBatch batch;
  for (const LaneSlice& s : slices) {
    const int64_t n = static_cast<int64_t>(s.tokens.size());
    const int64_t end = s.first_position + n;  // context once the pass has written its tokens
    if (s.lane < 0 || s.lane >= num_lanes_ || n == 0 || s.first_position < s.lane_origin ||
        end - s.lane_origin > static_cast<int64_t>(blocks_per_lane_) * block_size_ || s.lane_origin % block_size_ != 0) {
      return Status::Internal("lane pass: slice does not fit its lane");
    }
    SequenceSlice slice;
    slice.token_offset = static_cast<int32_t>(batch.tokens.size());
    slice.num_tokens = static_cast<int32_t>(n);
    slice.context_len = static_cast<int32_t>(end);
    slice.logits = LogitsMode::kAll;
    std::vector<BlockId> view = s.blocks;
    const int64_t lane_tokens = end - s.lane_origin;
    for (int64_t i = 0; i < BlocksForTokens(lane_tokens, block_size_); ++i) view.push_back(LaneBlock(s.lane, i));
    slice.view = KvView::BlockSubset(std::move(view),
                                     static_cast<int32_t>(static_cast<int64_t>(s.blocks.size()) * block_size_ + lane_tokens));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = s.first_position + i;
      const int64_t lane_index = pos - s.lane_origin;
      batch.tokens.push_back(s.tokens[static_cast<size_t>(i)]);
      batch.positions.push_back(static_cast<int32_t>(pos));
      batch.slot_mapping.push_back(static_cast<int64_t>(LaneBlock(s.lane, lane_index / block_size_)) * block_size_ +
                                   lane_index % block_size_);
    }
    batch.seqs.push_back(std::move(slice));
  }
  return batch;
}

Status LanePool::Forward(std::span<const LaneSlice> slices, LayerHooks* hooks, std::vector<float>& logits) {
  KVFLOW_ASSIGN_OR_RETURN(ForwardBatch batch, Build(slices));
  LlamaModel model(backend_, hooks);
  return model.Forward(batch, logits);
}

}  // namespace kvflow
