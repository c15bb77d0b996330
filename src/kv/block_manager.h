// The block manager (vLLM's BlockSpaceManager): block tables for every sequence over a device
// pool and a host swap pool, with sharing (fork), copy-on-write, prefix caching and swap planning.
// It only plans: copies and swaps come back as block-id mappings that the backend executes as one
// batched copy per step. Plain C++: no backend, no CUDA.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kv/block_allocator.h"
#include "kv/kv_connector_scheduler.h"
#include "kvflow/status.h"

namespace kvflow {

using SeqId = int64_t;

inline int BlocksForTokens(int64_t num_tokens, int block_size) {
  return static_cast<int>((num_tokens + block_size - 1) / block_size);
}

struct BlockManagerConfig {
  int block_size = 16;
  int num_device_blocks = 0;
  int num_host_blocks = 0;  // swap space; 0 disables swapping
  bool enable_prefix_caching = false;
  // Blocks kept free at admission so running sequences can still grow (vLLM's 1% watermark).
  double watermark = 0.01;
  // Tokens each query attends to when every layer attends through a sliding window (Mistral:
  // the query at position p sees keys p - sliding_window + 1 .. p); 0: the whole context. With a
  // window, MarkComputed releases the blocks no later query can see (vLLM's sliding-window KV
  // manager), leaving kReleasedBlock in their table entries.
  int64_t sliding_window = 0;
};

// The most blocks one admission can ever take: the pool less the watermark.
inline int MaxAdmissibleBlocks(const BlockManagerConfig& c) {
  return c.num_device_blocks - static_cast<int>(c.watermark * c.num_device_blocks);
}

class BlockManager {
 public:
  explicit BlockManager(const BlockManagerConfig& config);

  // ---- admission ---------------------------------------------------------------------------
  // Device blocks Allocate would take for `tokens` with room for `reserve_tokens` (prefix hits
  // excluded unless reuse_cached_prefix is false).
  int BlocksToAllocate(std::span<const int32_t> tokens, int64_t reserve_tokens, bool reuse_cached_prefix = true) const;
  // Whether `num_blocks` more blocks can be admitted and still leave the watermark free.
  bool CanAdmit(int num_blocks) const;
  // The most blocks one admission can ever take (the pool less the watermark).
  int MaxAdmissibleBlocks() const { return kvflow::MaxAdmissibleBlocks(config_); }
  // Gives `seq` a block table for `tokens` plus room up to `reserve_tokens` tokens, mapping full
  // prompt blocks found in the prefix cache instead of allocating them. Returns how many leading
  // tokens already have their KV (a multiple of block_size, always < tokens.size() so the last
  // token is computed and yields logits). All-or-nothing. reuse_cached_prefix = false computes every
  // token (a request that scores its whole prompt).
  Result<int64_t> Allocate(SeqId seq, std::span<const int32_t> tokens, int64_t reserve_tokens,
                           bool reuse_cached_prefix = true);

  // ---- running sequences -------------------------------------------------------------------
  // Device blocks AppendSlots would allocate (new blocks + copies).
  int BlocksToAppend(SeqId seq, int64_t write_from, int64_t write_to, int64_t capacity_tokens = 0) const;
  // Grows the table to hold max(write_to, capacity_tokens) tokens and makes every block that
  // positions [write_from, write_to) will be written to private: a shared one is copied
  // (copy-on-write) and remapped; the copy joins TakePendingCopies(). A private block still
  // published in the prefix cache (a full block cut by Truncate) leaves the cache first, so the
  // cache never hands out content being overwritten. All-or-nothing.
  Status AppendSlots(SeqId seq, int64_t write_from, int64_t write_to, int64_t capacity_tokens = 0);
  // Keeps only the first `num_tokens` tokens of `seq` (llama.cpp's seq_rm from num_tokens to the
  // end): the table keeps BlocksForTokens(num_tokens) blocks and drops its reference to the rest
  // (a block shared with a fork or the prefix cache stays valid for the others), and the
  // sequence's prefix-cache chain shrinks to the full blocks kept. A kept block that becomes
  // partial keeps its content until the next AppendSlots writes it (see there). Never allocates;
  // device-resident sequences only: an unknown or swapped-out sequence, a negative count, or one
  // whose next query would see tokens already released from the sliding window is an error and
  // changes nothing. Truncating at or past the table's end changes nothing.
  Status Truncate(SeqId seq, int64_t num_tokens);
  // `child` shares every block of `parent` (refcount + 1 each).
  void Fork(SeqId parent, SeqId child);
  // Drops the sequence's references, on the device or on the host.
  void Free(SeqId seq);
  // The sequence's KV now holds tokens[0, num_computed): publishes their full blocks in the prefix
  // cache (when enabled), then, with a sliding window, releases the blocks wholly before
  // num_computed - sliding_window + 1, the first key the query at num_computed (or any later
  // one) can see. Released blocks that were published stay in the cache until reclaimed.
  void MarkComputed(SeqId seq, std::span<const int32_t> tokens, int64_t num_computed);
  // Leading table entries of `seq` released from the sliding window (kReleasedBlock).
  int ReleasedBlocks(SeqId seq) const { return Get(seq).released; }

  // ---- swapping, all-or-nothing per sequence group -------------------------------------------
  // Distinct blocks of the group (blocks shared inside the group count once).
  int DistinctBlocks(std::span<const SeqId> group) const;
  bool CanSwapOut(std::span<const SeqId> group) const;
  // Moves the group's blocks to the host pool; returns device -> host copies.
  Result<std::vector<BlockMove>> SwapOut(std::span<const SeqId> group);
  // Swap-in needs the group's blocks plus `extra_blocks` of room to keep running.
  bool CanSwapIn(std::span<const SeqId> group, int extra_blocks) const;
  // Moves the group back to the device; returns host -> device copies.
  Result<std::vector<BlockMove>> SwapIn(std::span<const SeqId> group);

  // Copy-on-write copies planned since the last call (device -> device).
  std::vector<BlockMove> TakePendingCopies();

  // ---- KV connectors (kv/kv_connector_scheduler.h) ----------------------------------------------------------
  // Allocate asks each connector, in the order added, for prompt tokens past the prefix hits
  // (requests that reuse a cached prefix only). Not owned; must outlive the manager.
  void AddConnector(KvConnectorScheduler* connector);
  // Hands the connectors the cached blocks reclaimed since the last call and returns the moves
  // each planned (one entry per connector with any). Call once per step, after its allocations.
  std::vector<KvConnectorMoves> TakeConnectorMoves();

  // ---- inspection --------------------------------------------------------------------------
  bool Has(SeqId seq) const { return seqs_.contains(seq); }
  bool IsSwapped(SeqId seq) const;
  const std::vector<BlockId>& BlockTable(SeqId seq) const;
  int block_size() const { return config_.block_size; }
  const BlockAllocator& device() const { return device_; }
  const BlockAllocator& host() const { return host_; }
  bool prefix_caching() const { return config_.enable_prefix_caching; }
  // Blocks the device tables would hold without any sharing (for the sharing-savings figures).
  int64_t NumLogicalDeviceBlocks() const;
  int num_sequences() const { return static_cast<int>(seqs_.size()); }
  // Of the full prompt blocks admitted looking up the prefix cache, the fraction not computed in
  // the engine's steps: found on the device or supplied by a KV connector (a host tier, the ranks of
  // a prompt prefill).
  double PrefixHitRate() const;
  int64_t prefix_hit_blocks() const { return prefix_hit_blocks_; }
  // Of the queried blocks, those the connectors supplied (not counted as prefix hits).
  int64_t connector_hit_blocks() const { return connector_hit_blocks_; }
  int64_t prefix_queried_blocks() const { return prefix_queried_blocks_; }

 private:
  struct SeqBlocks {
    std::vector<BlockId> blocks;
    // Content hashes of the leading full, computed blocks (the prefix-cache chain).
    std::vector<uint64_t> hashes;
    bool on_host = false;
    int released = 0;  // leading entries of `blocks` that are kReleasedBlock
  };
  SeqBlocks& Get(SeqId seq);
  const SeqBlocks& Get(SeqId seq) const;
  int watermark_blocks() const;
  // Releases the blocks of `s` that no query from position num_computed on can see.
  void ReleaseOutOfWindow(SeqBlocks& s, int64_t num_computed);
  // The leading full blocks of `tokens` in the prefix cache, with their chained hashes.
  std::vector<std::pair<BlockId, uint64_t>> CachedPrefix(std::span<const int32_t> tokens) const;
  // Blocks to allocate for `num_tokens` (room for `reserve_tokens`) given those prefix hits.
  int BlocksNeeded(const std::vector<std::pair<BlockId, uint64_t>>& hits, size_t num_tokens,
                   int64_t reserve_tokens) const;

  BlockManagerConfig config_;
  BlockAllocator device_;
  BlockAllocator host_;
  std::unordered_map<SeqId, SeqBlocks> seqs_;
  std::vector<BlockMove> pending_copies_;
  int64_t prefix_queried_blocks_ = 0;
  int64_t prefix_hit_blocks_ = 0;
  int64_t connector_hit_blocks_ = 0;
  std::vector<KvConnectorScheduler*> connectors_;
};

}  // namespace kvflow
