#include "kv/block_table.h"

namespace kvflow {

int BlockTable::MissingBlocks(int64_t num_tokens) const {
  int need = BlocksForTokens(num_tokens, block_size_) - static_cast<int>(blocks_.size());
  return need > 0 ? need : 0;
}

Status BlockTable::EnsureCapacity(int64_t num_tokens, BlockAllocator& allocator) {
  const int missing = MissingBlocks(num_tokens);
  if (missing > allocator.num_free()) {
    return Status::OutOfMemory("need " + std::to_string(missing) + " KV blocks, " +
                               std::to_string(allocator.num_free()) + " free");
  }
  for (int i = 0; i < missing; ++i) {
    KVFLOW_ASSIGN_OR_RETURN(BlockId id, allocator.Allocate());
    blocks_.push_back(id);
  }
  return Status::Ok();
}

void BlockTable::Release(BlockAllocator& allocator) {
  for (BlockId id : blocks_) allocator.Free(id);
  blocks_.clear();
}

}  // namespace kvflow
