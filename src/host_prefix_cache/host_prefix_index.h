// The scheduler side of the host prefix cache: an index of full prompt blocks kept in a capped
// region of the backend's host pool, keyed like the device prefix cache (the block's tokens
// chained with the hash of everything before it, verified on lookup). Device blocks the prefix
// cache reclaims are saved here (least recently used host blocks make room); a prompt whose next
// blocks past the device's hits are here gets them loaded into its fresh blocks instead of
// computing them. Plain C++: the moves it plans are carried out by the connector's worker side.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kv/kv_connector_scheduler.h"
#include "kvflow/host_prefix_cache.h"

namespace kvflow {

class HostPrefixIndex final : public KvConnectorScheduler {
 public:
  // Host blocks [first_host_block, first_host_block + num_blocks) of the backend's host pool are
  // the index's; `block_bytes` (one block, every layer, K and V) is for the byte counters.
  HostPrefixIndex(int block_size, int first_host_block, int num_blocks, int64_t block_bytes);

  int64_t NumMatchedTokens(std::span<const int32_t> tokens, int64_t num_cached) override;
  void UpdateStateAfterAlloc(std::span<const int32_t> tokens, int64_t first_token,
                             std::span<const BlockId> blocks) override;
  bool WantsEvictions() const override { return true; }
  void OnEvicted(std::span<const EvictedBlock> blocks) override;
  KvConnectorMoves TakeStepMoves() override;

  HostPrefixCacheStats stats() const;
  int num_blocks() const { return static_cast<int>(slots_.size()); }

 private:
  struct Slot {
    uint64_t hash = 0;
    uint64_t prefix_hash = 0;
    std::vector<int32_t> tokens;  // empty: free
    std::list<int>::iterator lru;
  };
  // The slots holding tokens' blocks [first_block, ...) in order, as far as they are cached here
  // (at most max_blocks of them).
  std::vector<int> Match(std::span<const int32_t> tokens, int64_t first_block, int64_t max_blocks) const;
  std::optional<int> FindSlot(uint64_t prefix_hash, std::span<const int32_t> tokens) const;
  void Touch(int slot);
  // A slot for new content: a free one, else the least recently used one not moved this step.
  std::optional<int> TakeSlot();

  int block_size_;
  int first_host_block_;
  int64_t block_bytes_;
  std::vector<Slot> slots_;
  std::vector<int> free_;
  std::list<int> lru_;  // occupied slots, least recently used first
  std::unordered_map<uint64_t, int> by_hash_;
  std::unordered_set<int> moved_this_step_;  // saved to or loaded from in the step being planned
  // The slots NumMatchedTokens found, which UpdateStateAfterAlloc (called next, for that prompt)
  // loads: the index does not change in between.
  std::vector<int> matched_;
  KvConnectorMoves moves_;
  HostPrefixCacheStats stats_;
};

}  // namespace kvflow
