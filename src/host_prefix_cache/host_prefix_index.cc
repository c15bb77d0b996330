#include "host_prefix_cache/host_prefix_index.h"

#include <algorithm>
#include <cassert>
#include <utility>

namespace kvflow {

HostPrefixIndex::HostPrefixIndex(int block_size, int first_host_block, int num_blocks, int64_t block_bytes)
    : block_size_(block_size), first_host_block_(first_host_block), block_bytes_(block_bytes),
      slots_(static_cast<size_t>(num_blocks)) {
  free_.reserve(static_cast<size_t>(num_blocks));
  for (int s = num_blocks - 1; s >= 0; --s) free_.push_back(s);
  for (Slot& s : slots_) s.lru = lru_.end();
  stats_.capacity_blocks = num_blocks;
}

std::optional<int> HostPrefixIndex::FindSlot(uint64_t prefix_hash, std::span<const int32_t> tokens) const {
  auto it = by_hash_.find(HashBlockTokens(prefix_hash, tokens));
  if (it == by_hash_.end()) return std::nullopt;
  const Slot& s = slots_[static_cast<size_t>(it->second)];
  // A 64-bit collision is a miss, never a wrong hit.
  if (s.prefix_hash != prefix_hash || !std::equal(s.tokens.begin(), s.tokens.end(), tokens.begin(), tokens.end())) {
    return std::nullopt;
  }
  return it->second;
}

std::vector<int> HostPrefixIndex::Match(std::span<const int32_t> tokens, int64_t first_block, int64_t max_blocks) const {
  std::vector<int> found;
  const size_t bs = static_cast<size_t>(block_size_);
  uint64_t prefix = 0;
  for (int64_t b = 0; b < first_block; ++b) prefix = HashBlockTokens(prefix, tokens.subspan(static_cast<size_t>(b) * bs, bs));
  for (int64_t b = first_block; b < first_block + max_blocks; ++b) {
    const auto block_tokens = tokens.subspan(static_cast<size_t>(b) * bs, bs);
    const std::optional<int> slot = FindSlot(prefix, block_tokens);
    if (!slot) break;
    found.push_back(*slot);
    prefix = HashBlockTokens(prefix, block_tokens);
  }
  return found;
}

int64_t HostPrefixIndex::NumMatchedTokens(std::span<const int32_t> tokens, int64_t num_cached) {
  if (slots_.empty() || tokens.empty() || num_cached % block_size_ != 0) return 0;
  // Whole blocks, never the last token: it must run to give logits.
  const int64_t max_blocks = (static_cast<int64_t>(tokens.size()) - 1) / block_size_ - num_cached / block_size_;
  if (max_blocks <= 0) return 0;
  stats_.queried_blocks += max_blocks;
  matched_ = Match(tokens, num_cached / block_size_, max_blocks);
  return static_cast<int64_t>(matched_.size()) * block_size_;
}

void HostPrefixIndex::UpdateStateAfterAlloc(std::span<const int32_t> tokens, int64_t first_token,
                                            std::span<const BlockId> blocks) {
  const std::vector<int> slots = std::exchange(matched_, {});
  assert(slots.size() == blocks.size());  // the blocks of what NumMatchedTokens just matched
  for (size_t i = 0; i < slots.size() && i < blocks.size(); ++i) {
    moves_.load.push_back({first_host_block_ + slots[i], blocks[i]});
    moved_this_step_.insert(slots[i]);
    Touch(slots[i]);
  }
  stats_.hit_blocks += static_cast<int64_t>(slots.size());
  stats_.loaded_blocks += static_cast<int64_t>(slots.size());
  stats_.bytes_loaded += static_cast<int64_t>(slots.size()) * block_bytes_;
}

void HostPrefixIndex::Touch(int slot) {
  Slot& s = slots_[static_cast<size_t>(slot)];
  if (s.lru != lru_.end()) lru_.erase(s.lru);
  lru_.push_back(slot);
  s.lru = std::prev(lru_.end());
}

std::optional<int> HostPrefixIndex::TakeSlot() {
  if (!free_.empty()) {
    const int slot = free_.back();
    free_.pop_back();
    return slot;
  }
  // A slot loaded from this step must keep its content until the loads ran; one saved to this
  // step already holds newer content than anything we would put there.
  for (auto it = lru_.begin(); it != lru_.end(); ++it) {
    if (moved_this_step_.contains(*it)) continue;
    const int slot = *it;
    Slot& s = slots_[static_cast<size_t>(slot)];
    if (auto h = by_hash_.find(s.hash); h != by_hash_.end() && h->second == slot) by_hash_.erase(h);
    s.tokens.clear();
    lru_.erase(it);
    s.lru = lru_.end();
    ++stats_.evicted_blocks;
    return slot;
  }
  return std::nullopt;
}

void HostPrefixIndex::OnEvicted(std::span<const EvictedBlock> blocks) {
  for (const EvictedBlock& e : blocks) {
    if (static_cast<int>(e.tokens.size()) != block_size_) continue;
    if (std::optional<int> held = FindSlot(e.prefix_hash, e.tokens)) {
      Touch(*held);  // already here: the same KV, nothing to copy
      continue;
    }
    const std::optional<int> slot = TakeSlot();
    if (!slot) continue;  // every host block is being moved this step: this content is lost
    Slot& s = slots_[static_cast<size_t>(*slot)];
    s.prefix_hash = e.prefix_hash;
    s.tokens = e.tokens;
    s.hash = HashBlockTokens(e.prefix_hash, e.tokens);
    by_hash_[s.hash] = *slot;
    Touch(*slot);
    moved_this_step_.insert(*slot);
    moves_.save.push_back({e.block, first_host_block_ + *slot});
    ++stats_.saved_blocks;
    stats_.bytes_saved += block_bytes_;
  }
}

KvConnectorMoves HostPrefixIndex::TakeStepMoves() {
  moved_this_step_.clear();
  return std::exchange(moves_, {});
}

HostPrefixCacheStats HostPrefixIndex::stats() const {
  HostPrefixCacheStats s = stats_;
  s.used_blocks = static_cast<int64_t>(lru_.size());
  return s;
}

}  // namespace kvflow
