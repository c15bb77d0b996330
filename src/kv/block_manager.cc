#include "kv/block_manager.h"

#include <algorithm>
#include <cassert>
#include <functional>
#include <iterator>
#include <string>
#include <unordered_map>

namespace kvflow {

BlockManager::BlockManager(const BlockManagerConfig& config)
    : config_(config), device_(config.num_device_blocks), host_(config.num_host_blocks) {}

BlockManager::SeqBlocks& BlockManager::Get(SeqId seq) {
  auto it = seqs_.find(seq);
  assert(it != seqs_.end());
  return it->second;
}

const BlockManager::SeqBlocks& BlockManager::Get(SeqId seq) const {
  auto it = seqs_.find(seq);
  assert(it != seqs_.end());
  return it->second;
}

int BlockManager::watermark_blocks() const {
  return static_cast<int>(config_.watermark * config_.num_device_blocks);
}

bool BlockManager::IsSwapped(SeqId seq) const {
  auto it = seqs_.find(seq);
  return it != seqs_.end() && it->second.on_host;
}

const std::vector<BlockId>& BlockManager::BlockTable(SeqId seq) const { return Get(seq).blocks; }

std::vector<std::pair<BlockId, uint64_t>> BlockManager::CachedPrefix(std::span<const int32_t> tokens) const {
  std::vector<std::pair<BlockId, uint64_t>> hits;
  if (!config_.enable_prefix_caching || tokens.empty()) return hits;
  const int bs = config_.block_size;
  const int64_t max_hits = (static_cast<int64_t>(tokens.size()) - 1) / bs;  // the last token must run
  uint64_t prefix = 0;
  for (int64_t i = 0; i < max_hits; ++i) {
    auto block_tokens = tokens.subspan(static_cast<size_t>(i * bs), static_cast<size_t>(bs));
    auto hit = device_.Peek(prefix, block_tokens);
    if (!hit) break;
    prefix = HashBlockTokens(prefix, block_tokens);
    hits.emplace_back(*hit, prefix);
  }
  return hits;
}

int BlockManager::BlocksNeeded(const std::vector<std::pair<BlockId, uint64_t>>& hits, size_t num_tokens,
                               int64_t reserve_tokens) const {
  const int total = BlocksForTokens(std::max<int64_t>(reserve_tokens, static_cast<int64_t>(num_tokens)),
                                    config_.block_size);
  int reused = 0;  // hits on blocks someone already uses cost nothing
  for (const auto& [block, hash] : hits) reused += device_.refcount(block) > 0;
  return total - reused;
}

int BlockManager::BlocksToAllocate(std::span<const int32_t> tokens, int64_t reserve_tokens,
                                   bool reuse_cached_prefix) const {
  return BlocksNeeded(reuse_cached_prefix ? CachedPrefix(tokens) : decltype(CachedPrefix(tokens)){}, tokens.size(),
                      reserve_tokens);
}

bool BlockManager::CanAdmit(int num_blocks) const {
  return device_.num_free() - num_blocks >= watermark_blocks();
}

Result<int64_t> BlockManager::Allocate(SeqId seq, std::span<const int32_t> tokens, int64_t reserve_tokens,
                                       bool reuse_cached_prefix) {
  assert(!seqs_.contains(seq));
  const auto hits = reuse_cached_prefix ? CachedPrefix(tokens) : decltype(CachedPrefix(tokens)){};
  const int needed = BlocksNeeded(hits, tokens.size(), reserve_tokens);
  if (needed > device_.num_free()) {
    return Status::OutOfMemory("need " + std::to_string(needed) + " KV blocks, " +
                               std::to_string(device_.num_free()) + " free");
  }
  const int bs = config_.block_size;
  SeqBlocks entry;
  for (const auto& [block, hash] : hits) {
    device_.Acquire(block);
    entry.blocks.push_back(block);
    entry.hashes.push_back(hash);
  }
  if (config_.enable_prefix_caching && reuse_cached_prefix && !tokens.empty()) {
    prefix_queried_blocks_ += (static_cast<int64_t>(tokens.size()) - 1) / bs;
    prefix_hit_blocks_ += static_cast<int64_t>(entry.hashes.size());
  }
  const int total = BlocksForTokens(std::max<int64_t>(reserve_tokens, static_cast<int64_t>(tokens.size())), bs);
  while (static_cast<int>(entry.blocks.size()) < total) {
    auto id = device_.Allocate();
    assert(id.ok());  // checked above
    entry.blocks.push_back(id.value());
  }
  int64_t cached_tokens = static_cast<int64_t>(entry.hashes.size()) * bs;
  // The connectors supply what they can past the device's hits, into the fresh blocks.
  if (reuse_cached_prefix && !tokens.empty()) {
    for (KvConnectorScheduler* c : connectors_) {
      const int64_t n = c->NumMatchedTokens(tokens, cached_tokens);
      if (n <= 0) continue;
      assert(n % bs == 0 && cached_tokens + n < static_cast<int64_t>(tokens.size()));
      const std::span<const BlockId> blocks(entry.blocks.data() + cached_tokens / bs, static_cast<size_t>(n / bs));
      c->UpdateStateAfterAlloc(tokens, cached_tokens, blocks);
      connector_hit_blocks_ += n / bs;
      cached_tokens += n;
    }
  }
  seqs_.emplace(seq, std::move(entry));
  return cached_tokens;
}

int BlockManager::BlocksToAppend(SeqId seq, int64_t write_from, int64_t write_to, int64_t capacity_tokens) const {
  const SeqBlocks& s = Get(seq);
  const int bs = config_.block_size;
  const int want = BlocksForTokens(std::max(write_to, capacity_tokens), bs);
  const int have = static_cast<int>(s.blocks.size());
  int needed = std::max(0, want - have);
  for (int i = std::max(s.released, static_cast<int>(write_from / bs)); i < std::min(BlocksForTokens(write_to, bs), have);
       ++i) {
    if (device_.refcount(s.blocks[static_cast<size_t>(i)]) > 1) ++needed;
  }
  return needed;
}

Status BlockManager::AppendSlots(SeqId seq, int64_t write_from, int64_t write_to, int64_t capacity_tokens) {
  SeqBlocks& s = Get(seq);
  assert(!s.on_host);
  const int needed = BlocksToAppend(seq, write_from, write_to, capacity_tokens);
  if (needed > device_.num_free()) {
    return Status::OutOfMemory("need " + std::to_string(needed) + " KV blocks, " +
                               std::to_string(device_.num_free()) + " free");
  }
  const int bs = config_.block_size;
  const int want = BlocksForTokens(std::max(write_to, capacity_tokens), bs);
  const int have = static_cast<int>(s.blocks.size());
  // Positions in released blocks left every window: nothing writes them again.
  for (int i = std::max(s.released, static_cast<int>(write_from / bs)); i < std::min(BlocksForTokens(write_to, bs), have);
       ++i) {
    BlockId& b = s.blocks[static_cast<size_t>(i)];
    if (device_.refcount(b) == 1) {
      device_.Unregister(b);
      continue;
    }
    const BlockId copy = device_.Allocate().value();
    pending_copies_.push_back({b, copy});
    device_.Free(b);
    b = copy;
  }
  while (static_cast<int>(s.blocks.size()) < want) s.blocks.push_back(device_.Allocate().value());
  return Status::Ok();
}

Status BlockManager::Truncate(SeqId seq, int64_t num_tokens) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return Status::NotFound("truncate: no sequence " + std::to_string(seq));
  if (num_tokens < 0) {
    return Status::InvalidArgument("truncate: sequence " + std::to_string(seq) + " to " +
                                   std::to_string(num_tokens) + " tokens");
  }
  SeqBlocks& s = it->second;
  if (s.on_host) {
    return Status::InvalidArgument("truncate: sequence " + std::to_string(seq) +
                                   " is swapped out; swap it in first");
  }
  const int bs = config_.block_size;
  const size_t keep = static_cast<size_t>(BlocksForTokens(num_tokens, bs));
  if (config_.sliding_window > 0 &&
      static_cast<int64_t>(s.released) * bs > std::max<int64_t>(0, num_tokens - config_.sliding_window + 1)) {
    return Status::InvalidArgument("truncate: sequence " + std::to_string(seq) + " to " + std::to_string(num_tokens) +
                                   " tokens: its first " + std::to_string(static_cast<int64_t>(s.released) * bs) +
                                   " tokens left the sliding window of " + std::to_string(config_.sliding_window) +
                                   " tokens and their KV was released");
  }
  // Released blocks may stay cached (their content is still the KV of real tokens) or shared.
  for (size_t i = keep; i < s.blocks.size(); ++i) device_.Free(s.blocks[i]);
  if (keep < s.blocks.size()) s.blocks.resize(keep);
  s.hashes.resize(std::min(s.hashes.size(), static_cast<size_t>(num_tokens / bs)));
  return Status::Ok();
}

void BlockManager::Fork(SeqId parent, SeqId child) {
  assert(!seqs_.contains(child));
  SeqBlocks copy = Get(parent);
  BlockAllocator& pool = copy.on_host ? host_ : device_;
  for (BlockId b : copy.blocks) {
    if (b != kReleasedBlock) pool.AddRef(b);
  }
  seqs_.emplace(child, std::move(copy));
}

void BlockManager::Free(SeqId seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  BlockAllocator& pool = it->second.on_host ? host_ : device_;
  for (BlockId b : it->second.blocks) {
    if (b != kReleasedBlock) pool.Free(b);
  }
  seqs_.erase(it);
}

void BlockManager::MarkComputed(SeqId seq, std::span<const int32_t> tokens, int64_t num_computed) {
  SeqBlocks& s = Get(seq);
  if (s.on_host) return;
  num_computed = std::min<int64_t>(num_computed, static_cast<int64_t>(tokens.size()));
  if (config_.enable_prefix_caching) {
    const int bs = config_.block_size;
    for (size_t i = s.hashes.size(); static_cast<int64_t>(i + 1) * bs <= num_computed && i < s.blocks.size(); ++i) {
      const uint64_t prefix = i == 0 ? 0 : s.hashes[i - 1];
      auto block_tokens = tokens.subspan(i * static_cast<size_t>(bs), static_cast<size_t>(bs));
      // A released block's content may already serve another prefix; the chain still needs its hash.
      if (s.blocks[i] != kReleasedBlock) device_.Register(s.blocks[i], prefix, block_tokens);
      s.hashes.push_back(HashBlockTokens(prefix, block_tokens));
    }
  }
  ReleaseOutOfWindow(s, num_computed);
}

void BlockManager::ReleaseOutOfWindow(SeqBlocks& s, int64_t num_computed) {
  if (config_.sliding_window <= 0) return;
  const int64_t first_visible = std::max<int64_t>(0, num_computed - config_.sliding_window + 1);
  const int releasable = static_cast<int>(std::min<int64_t>(first_visible / config_.block_size,
                                                            static_cast<int64_t>(s.blocks.size())));
  for (; s.released < releasable; ++s.released) {
    BlockId& b = s.blocks[static_cast<size_t>(s.released)];
    device_.Free(b);
    b = kReleasedBlock;
  }
}

int BlockManager::DistinctBlocks(std::span<const SeqId> group) const {
  std::vector<BlockId> all;
  for (SeqId seq : group) {
    const auto& b = Get(seq).blocks;
    std::copy_if(b.begin(), b.end(), std::back_inserter(all), [](BlockId id) { return id != kReleasedBlock; });
  }
  std::sort(all.begin(), all.end());
  return static_cast<int>(std::unique(all.begin(), all.end()) - all.begin());
}

bool BlockManager::CanSwapOut(std::span<const SeqId> group) const {
  for (SeqId seq : group) {
    if (Get(seq).on_host) return false;
  }
  return DistinctBlocks(group) <= host_.num_free();
}

bool BlockManager::CanSwapIn(std::span<const SeqId> group, int extra_blocks) const {
  for (SeqId seq : group) {
    if (!Get(seq).on_host) return false;
  }
  return device_.num_free() - DistinctBlocks(group) - extra_blocks >= watermark_blocks();
}

namespace {
// Moves every block of the group from `from` to `to`, keeping blocks shared inside the group
// shared; returns the copies to execute.
Result<std::vector<BlockMove>> MoveGroup(std::span<const SeqId> group, BlockAllocator& from, BlockAllocator& to,
                                         const std::function<std::vector<BlockId>&(SeqId)>& table) {
  std::unordered_map<BlockId, BlockId> mapping;
  std::vector<BlockMove> moves;
  for (SeqId seq : group) {
    for (BlockId& b : table(seq)) {
      if (b == kReleasedBlock) continue;
      auto it = mapping.find(b);
      BlockId dst;
      if (it == mapping.end()) {
        auto id = to.Allocate();
        if (!id.ok()) return id.status();  // callers check capacity first
        dst = id.value();
        mapping.emplace(b, dst);
        moves.push_back({b, dst});
      } else {
        dst = it->second;
        to.AddRef(dst);
      }
      from.Free(b);
      b = dst;
    }
  }
  return moves;
}
}  // namespace

Result<std::vector<BlockMove>> BlockManager::SwapOut(std::span<const SeqId> group) {
  if (!CanSwapOut(group)) {
    return Status::OutOfMemory("swap space cannot hold " + std::to_string(DistinctBlocks(group)) + " blocks (" +
                               std::to_string(host_.num_free()) + " free)");
  }
  auto moves = MoveGroup(group, device_, host_, [this](SeqId s) -> std::vector<BlockId>& { return Get(s).blocks; });
  for (SeqId seq : group) {
    Get(seq).on_host = true;
    Get(seq).hashes.clear();  // host blocks are not content-addressed; re-published after swap-in
  }
  return moves;
}

Result<std::vector<BlockMove>> BlockManager::SwapIn(std::span<const SeqId> group) {
  if (!CanSwapIn(group, 0)) {
    return Status::OutOfMemory("the device pool cannot take back " + std::to_string(DistinctBlocks(group)) +
                               " blocks (" + std::to_string(device_.num_free()) + " free)");
  }
  auto moves = MoveGroup(group, host_, device_, [this](SeqId s) -> std::vector<BlockId>& { return Get(s).blocks; });
  for (SeqId seq : group) Get(seq).on_host = false;
  return moves;
}

std::vector<BlockMove> BlockManager::TakePendingCopies() {
  std::vector<BlockMove> out;
  out.swap(pending_copies_);
  return out;
}

int64_t BlockManager::NumLogicalDeviceBlocks() const {
  int64_t n = 0;
  for (const auto& [id, s] : seqs_) {
    if (!s.on_host) n += static_cast<int64_t>(s.blocks.size()) - s.released;
  }
  return n;
}

double BlockManager::PrefixHitRate() const {
  if (prefix_queried_blocks_ == 0) return 0.0;
  return std::min(1.0, static_cast<double>(prefix_hit_blocks_ + connector_hit_blocks_) /
                           static_cast<double>(prefix_queried_blocks_));
}

}  // namespace kvflow

namespace kvflow {

void BlockManager::AddConnector(KvConnectorScheduler* connector) {
  connectors_.push_back(connector);
  if (connector->WantsEvictions()) device_.set_record_evictions(true);
}

std::vector<KvConnectorMoves> BlockManager::TakeConnectorMoves() {
  std::vector<KvConnectorMoves> moves;
  if (connectors_.empty()) return moves;
  const std::vector<EvictedBlock> evicted = device_.TakeEvicted();
  for (KvConnectorScheduler* c : connectors_) {
    if (!evicted.empty() && c->WantsEvictions()) c->OnEvicted(evicted);
    KvConnectorMoves m = c->TakeStepMoves();
    m.connector = c;
    if (!m.empty()) moves.push_back(std::move(m));
  }
  return moves;
}

}  // namespace kvflow
