#include "backend/backend.h"

#include <string>

namespace kvflow {

int64_t ForwardBatch::num_logit_rows() const {
  int64_t rows = 0;
  for (const SequenceSlice& s : seqs) {
    if (s.logits == LogitsMode::kLast) rows += 1;
    if (s.logits == LogitsMode::kAll) rows += s.num_tokens;
  }
  return rows;
}

Status ValidateForwardBatch(const ForwardBatch& batch, const ModelConfig& config,
                            const KvCacheLayout& layout) {
  if (batch.tokens.size() != batch.positions.size()) {
    return Status::InvalidArgument("batch has " + std::to_string(batch.tokens.size()) + " tokens but " +
                                   std::to_string(batch.positions.size()) + " positions");
  }
  for (int32_t t : batch.tokens) {
    if (t < 0 || t >= config.vocab_size) {
      return Status::InvalidArgument("token id " + std::to_string(t) + " outside the vocabulary [0, " +
                                     std::to_string(config.vocab_size) + ")");
    }
  }
  int64_t expected_offset = 0;
  for (const SequenceSlice& s : batch.seqs) {
    if (s.token_offset != expected_offset || s.num_tokens <= 0 ||
        s.token_offset + s.num_tokens > static_cast<int64_t>(batch.tokens.size())) {
      return Status::InvalidArgument("sequence slices do not tile the batch's tokens");
    }
    expected_offset += s.num_tokens;
    if (s.context_len < s.num_tokens) return Status::InvalidArgument("context_len < num_tokens");
    if (static_cast<int64_t>(s.block_table.size()) * layout.block_size < s.context_len) {
      return Status::InvalidArgument("block table of " + std::to_string(s.block_table.size()) +
                                     " blocks cannot hold " + std::to_string(s.context_len) + " tokens");
    }
    for (BlockId b : s.block_table) {
      if (b < 0 || b >= layout.num_blocks) {
        return Status::InvalidArgument("block id " + std::to_string(b) + " outside the pool");
      }
    }
    for (int32_t i = 0; i < s.num_tokens; ++i) {
      if (batch.positions[static_cast<size_t>(s.token_offset + i)] != s.context_len - s.num_tokens + i) {
        return Status::InvalidArgument("positions of a sequence must continue its context");
      }
    }
  }
  if (expected_offset != static_cast<int64_t>(batch.tokens.size())) {
    return Status::InvalidArgument("sequence slices do not cover all tokens of the batch");
  }
  return Status::Ok();
}

Status ValidateBlockMoves(std::span<const BlockMove> moves, BlockCopyKind kind, int num_device_blocks,
                          int num_host_blocks) {
  const int src_pool = kind == BlockCopyKind::kHostToDevice ? num_host_blocks : num_device_blocks;
  const int dst_pool = kind == BlockCopyKind::kDeviceToHost ? num_host_blocks : num_device_blocks;
  for (const BlockMove& m : moves) {
    if (m.src < 0 || m.src >= src_pool || m.dst < 0 || m.dst >= dst_pool) {
      return Status::InvalidArgument("block move " + std::to_string(m.src) + " -> " + std::to_string(m.dst) +
                                     " is outside the pools");
    }
  }
  return Status::Ok();
}

}  // namespace kvflow
