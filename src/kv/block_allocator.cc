#include "kv/block_allocator.h"

#include <cassert>
#include <string>

namespace kvflow {

BlockAllocator::BlockAllocator(int num_blocks) : refcounts_(static_cast<size_t>(num_blocks), 0) {
  free_list_.reserve(static_cast<size_t>(num_blocks));
  for (BlockId id = num_blocks - 1; id >= 0; --id) free_list_.push_back(id);
}

Result<BlockId> BlockAllocator::Allocate() {
  if (free_list_.empty()) {
    return Status::OutOfMemory("KV block pool exhausted (" + std::to_string(num_blocks()) +
                               " blocks in use)");
  }
  BlockId id = free_list_.back();
  free_list_.pop_back();
  refcounts_[static_cast<size_t>(id)] = 1;
  return id;
}

void BlockAllocator::AddRef(BlockId id) {
  assert(refcounts_[static_cast<size_t>(id)] > 0);
  ++refcounts_[static_cast<size_t>(id)];
}

void BlockAllocator::Free(BlockId id) {
  int& rc = refcounts_[static_cast<size_t>(id)];
  assert(rc > 0);
  if (--rc == 0) free_list_.push_back(id);
}

}  // namespace kvflow
