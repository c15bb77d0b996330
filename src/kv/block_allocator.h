// One pool of physical KV blocks with reference counts and an optional content-addressed prefix
// cache. Plain C++: no backend, no CUDA.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvflow/status.h"

namespace kvflow {

using BlockId = int32_t;
// A block-table entry whose block was released: its tokens left the sliding window of every
// query the sequence can still make (BlockManagerConfig::sliding_window). Never read.
constexpr BlockId kReleasedBlock = -1;

// A copy of one block's content from block src to block dst (in the same pool or across pools).
struct BlockMove {
  BlockId src;
  BlockId dst;
  bool operator==(const BlockMove&) const = default;
};

// A full block's content leaving the prefix cache: its block is about to be reused.
struct EvictedBlock {
  BlockId block = 0;
  uint64_t prefix_hash = 0;  // the chained hash of every token before the block
  std::vector<int32_t> tokens;
};

// Hash of a full block's token ids chained with the hash of everything before it, so equal hashes
// mean equal prefixes (verified on lookup, so a 64-bit collision is a miss, never a wrong hit).
uint64_t HashBlockTokens(uint64_t prefix_hash, std::span<const int32_t> tokens);

// Hands out physical block ids. A block is in exactly one of three states:
//   used       refcount > 0 (sharing via fork or prefix hits raises the count),
//   cached     refcount 0 but its content is in the prefix cache; reclaimed LRU when needed,
//   free       refcount 0, content meaningless.
class BlockAllocator {
 public:
  explicit BlockAllocator(int num_blocks);

  // A block with refcount 1: a free one if any, else the least recently used cached one
  // (which leaves the cache). OutOfMemory when every block is used.
  Result<BlockId> Allocate();
  // Another reference to a used block (sharing).
  void AddRef(BlockId id);
  // Drops one reference. At zero the block becomes cached (if it has content) or free.
  void Free(BlockId id);

  // The block holding `tokens` after the prefix with hash `prefix_hash`, or nullopt.
  std::optional<BlockId> Peek(uint64_t prefix_hash, std::span<const int32_t> tokens) const;
  // A new reference to a block found by Peek: a used one is shared, a cached one revived.
  void Acquire(BlockId id);
  // Peek, then Acquire on a hit.
  std::optional<BlockId> Lookup(uint64_t prefix_hash, std::span<const int32_t> tokens);
  // Publishes a used, fully computed block under its content; false if that content is cached
  // already (in another block) or the block already has content.
  bool Register(BlockId id, uint64_t prefix_hash, std::span<const int32_t> tokens);
  // Withdraws a used block's content from the prefix cache: its holder is about to overwrite it.
  void Unregister(BlockId id);

  // Keep the content of every cached block Allocate reclaims (for a KV connector that saves it
  // elsewhere before the block is overwritten), until TakeEvicted.
  void set_record_evictions(bool on) { record_evictions_ = on; }
  std::vector<EvictedBlock> TakeEvicted() { return std::exchange(evicted_, {}); }

  int refcount(BlockId id) const { return refcounts_[static_cast<size_t>(id)]; }
  bool is_cached_content(BlockId id) const { return contents_[static_cast<size_t>(id)].has_value(); }
  // The tokens a block is published under; empty when it has no content.
  std::span<const int32_t> content_tokens(BlockId id) const {
    const auto& c = contents_[static_cast<size_t>(id)];
    return c ? std::span<const int32_t>(c->tokens) : std::span<const int32_t>();
  }
  int num_blocks() const { return static_cast<int>(refcounts_.size()); }
  // Blocks Allocate can still hand out (free + cached).
  int num_free() const { return static_cast<int>(free_list_.size() + lru_.size()); }
  int num_cached_unused() const { return static_cast<int>(lru_.size()); }
  int num_used() const { return num_blocks() - num_free(); }

 private:
  struct Content {
    uint64_t hash;
    uint64_t prefix_hash;
    std::vector<int32_t> tokens;
  };
  void Uncache(BlockId id);
  std::optional<BlockId> Find(uint64_t prefix_hash, std::span<const int32_t> tokens) const;

  std::vector<int> refcounts_;
  // LIFO so a just-freed block (warm in cache) is reused first.
  std::vector<BlockId> free_list_;
  std::vector<std::optional<Content>> contents_;
  std::unordered_map<uint64_t, BlockId> by_hash_;
  // Cached blocks nobody uses, least recently released first.
  std::list<BlockId> lru_;
  std::vector<std::list<BlockId>::iterator> lru_pos_;
  bool record_evictions_ = false;
  std::vector<EvictedBlock> evicted_;
};

}  // namespace kvflow
