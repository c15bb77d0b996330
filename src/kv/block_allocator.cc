#include "kv/block_allocator.h"

#include <algorithm>
#include <cassert>
#include <string>

#include "util/hash.h"

namespace kvflow {

uint64_t HashBlockTokens(uint64_t prefix_hash, std::span<const int32_t> tokens) {
  uint64_t h = SplitMix64(prefix_hash + kGoldenGamma);
  for (int32_t t : tokens) h = SplitMix64(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(t)) + kGoldenGamma));
  return SplitMix64(h ^ tokens.size());
}

BlockAllocator::BlockAllocator(int num_blocks)
    : refcounts_(static_cast<size_t>(num_blocks), 0),
      contents_(static_cast<size_t>(num_blocks)),
      lru_pos_(static_cast<size_t>(num_blocks), lru_.end()) {
  free_list_.reserve(static_cast<size_t>(num_blocks));
  for (BlockId id = num_blocks - 1; id >= 0; --id) free_list_.push_back(id);
}

Result<BlockId> BlockAllocator::Allocate() {
  BlockId id;
  if (!free_list_.empty()) {
    id = free_list_.back();
    free_list_.pop_back();
  } else if (!lru_.empty()) {
    id = lru_.front();
    lru_.pop_front();
    lru_pos_[static_cast<size_t>(id)] = lru_.end();
    if (record_evictions_) {
      Content& c = *contents_[static_cast<size_t>(id)];
      evicted_.push_back({id, c.prefix_hash, std::move(c.tokens)});
    }
    Uncache(id);
  } else {
    return Status::OutOfMemory("KV block pool exhausted (" + std::to_string(num_blocks()) + " blocks in use)");
  }
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
  if (--rc > 0) return;
  if (contents_[static_cast<size_t>(id)]) {
    lru_.push_back(id);
    lru_pos_[static_cast<size_t>(id)] = std::prev(lru_.end());
  } else {
    free_list_.push_back(id);
  }
}

void BlockAllocator::Uncache(BlockId id) {
  auto& c = contents_[static_cast<size_t>(id)];
  if (!c) return;
  if (auto it = by_hash_.find(c->hash); it != by_hash_.end() && it->second == id) by_hash_.erase(it);
  c.reset();
}

std::optional<BlockId> BlockAllocator::Find(uint64_t prefix_hash, std::span<const int32_t> tokens) const {
  auto it = by_hash_.find(HashBlockTokens(prefix_hash, tokens));
  if (it == by_hash_.end()) return std::nullopt;
  const Content& c = *contents_[static_cast<size_t>(it->second)];
  if (c.prefix_hash != prefix_hash || !std::equal(c.tokens.begin(), c.tokens.end(), tokens.begin(), tokens.end())) {
    return std::nullopt;  // a hash collision: treat as a miss
  }
  return it->second;
}

std::optional<BlockId> BlockAllocator::Peek(uint64_t prefix_hash, std::span<const int32_t> tokens) const {
  return Find(prefix_hash, tokens);
}

void BlockAllocator::Acquire(BlockId id) {
  auto& pos = lru_pos_[static_cast<size_t>(id)];
  if (pos != lru_.end()) {  // revive an unused cached block
    lru_.erase(pos);
    pos = lru_.end();
  }
  ++refcounts_[static_cast<size_t>(id)];
}

std::optional<BlockId> BlockAllocator::Lookup(uint64_t prefix_hash, std::span<const int32_t> tokens) {
  auto id = Find(prefix_hash, tokens);
  if (id) Acquire(*id);
  return id;
}

bool BlockAllocator::Register(BlockId id, uint64_t prefix_hash, std::span<const int32_t> tokens) {
  assert(refcounts_[static_cast<size_t>(id)] > 0);
  if (contents_[static_cast<size_t>(id)]) return false;
  const uint64_t hash = HashBlockTokens(prefix_hash, tokens);
  if (by_hash_.contains(hash)) return false;
  contents_[static_cast<size_t>(id)] = Content{hash, prefix_hash, std::vector<int32_t>(tokens.begin(), tokens.end())};
  by_hash_.emplace(hash, id);
  return true;
}

void BlockAllocator::Unregister(BlockId id) {
  assert(refcounts_[static_cast<size_t>(id)] > 0);
  Uncache(id);
}

}  // namespace kvflow
