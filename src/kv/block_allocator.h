// Fixed pool of KV blocks with reference counts. Plain C++: no backend, no CUDA.
#pragma once

#include <cstdint>
#include <vector>

#include "kvflow/status.h"

namespace kvflow {

using BlockId = int32_t;

// Hands out physical block ids of one pool. A block is free exactly when its refcount is 0;
// sharing (fork, prefix cache) raises the count, Free lowers it.
class BlockAllocator {
 public:
  explicit BlockAllocator(int num_blocks);

  // A fresh block with refcount 1, or OutOfMemory when none is free.
  Result<BlockId> Allocate();
  // Another reference to an allocated block (sharing).
  void AddRef(BlockId id);
  // Drops one reference; the block returns to the pool when the last one goes.
  void Free(BlockId id);

  int refcount(BlockId id) const { return refcounts_[static_cast<size_t>(id)]; }
  int num_blocks() const { return static_cast<int>(refcounts_.size()); }
  int num_free() const { return static_cast<int>(free_list_.size()); }

 private:
  std::vector<int> refcounts_;
  // LIFO so a just-freed block (warm in cache) is reused first.
  std::vector<BlockId> free_list_;
};

}  // namespace kvflow
