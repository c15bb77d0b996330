// Logical-to-physical block mapping of one sequence.
#pragma once

#include <cstdint>
#include <vector>

#include "kv/block_allocator.h"
#include "kvflow/status.h"

namespace kvflow {

inline int BlocksForTokens(int64_t num_tokens, int block_size) {
  return static_cast<int>((num_tokens + block_size - 1) / block_size);
}

// Logical block i of the sequence lives in physical block blocks()[i]; token t is at slot
// t % block_size of logical block t / block_size. Grows on demand, returns blocks on Release.
class BlockTable {
 public:
  explicit BlockTable(int block_size) : block_size_(block_size) {}

  // Makes room for `num_tokens` tokens in total, allocating only the missing blocks.
  // All-or-nothing: on OutOfMemory nothing was allocated.
  Status EnsureCapacity(int64_t num_tokens, BlockAllocator& allocator);
  // Blocks needed beyond the current ones to hold `num_tokens` tokens.
  int MissingBlocks(int64_t num_tokens) const;
  void Release(BlockAllocator& allocator);

  const std::vector<BlockId>& blocks() const { return blocks_; }
  int block_size() const { return block_size_; }
  int64_t capacity() const { return static_cast<int64_t>(blocks_.size()) * block_size_; }

 private:
  int block_size_;
  std::vector<BlockId> blocks_;
};

}  // namespace kvflow
