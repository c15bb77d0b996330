// InfiniGen's KV pool manager (seed 000, §4.4): the host pool that holds every sequence's KV can be
// capped; when it is full, a victim entry is chosen and overwritten in place. Three policies:
//
//   counter  (InfiniGen's) each entry counts how often it was prefetched to the device; the entry
//            with the smallest count goes (ties: the oldest); when a count saturates, every count
//            is halved, so old popularity fades;
//   lru      the least recently inserted or prefetched entry goes;
//   fifo     the oldest inserted entry goes (loses accuracy badly in the paper; kept to compare).
//
// Plain C++ over entry ids (the tier decides what an entry is: a token's K/V in one layer, a block):
// policy only, no memory. O(log n) per operation; halving is O(n log n) and happens once per
// counter_max prefetches of one entry at most.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>

#include "kvflow/status.h"

namespace kvflow {

enum class HostEvictionPolicy { kCounter, kLru, kFifo };
Result<HostEvictionPolicy> ParseHostEvictionPolicy(const std::string& name);
const char* HostEvictionPolicyName(HostEvictionPolicy policy);

class HostKvEviction {
 public:
  // `capacity` entries at most (>= 1); counts saturate at `counter_max` (>= 1).
  HostKvEviction(HostEvictionPolicy policy, int64_t capacity, uint32_t counter_max = 255);

  // A new entry (count 0). InvalidArgument if it is already there; ResourceExhausted when full
  // (evict Victim() first).
  Status Insert(int64_t id);
  // The entry was prefetched to the device: counter +1 (halving all when it saturates), or most
  // recently used. NotFound for an unknown id.
  Status OnFetch(int64_t id);
  // The entry to overwrite next (nothing when empty).
  std::optional<int64_t> Victim() const;
  // Drops an entry (its sequence ended); NotFound for an unknown id.
  Status Erase(int64_t id);

  bool full() const { return static_cast<int64_t>(entries_.size()) >= capacity_; }
  int64_t size() const { return static_cast<int64_t>(entries_.size()); }
  int64_t capacity() const { return capacity_; }
  HostEvictionPolicy policy() const { return policy_; }
  // The entry's prefetch count under the counter policy (after halvings); nothing if unknown.
  std::optional<uint32_t> count(int64_t id) const;
  int64_t halvings() const { return halvings_; }

 private:
  struct Entry {
    uint32_t count = 0;
    uint64_t inserted = 0;  // insertion tick: FIFO order and the counter policy's tie-break
    uint64_t used = 0;      // last insert or fetch tick: LRU order
  };
  // Victim order: smallest key first.
  using Key = std::tuple<uint64_t, uint64_t, int64_t>;
  Key KeyOf(int64_t id, const Entry& e) const;

  HostEvictionPolicy policy_;
  int64_t capacity_;
  uint32_t counter_max_;
  uint64_t tick_ = 0;
  int64_t halvings_ = 0;
  std::unordered_map<int64_t, Entry> entries_;
  std::set<Key> order_;
};

}  // namespace kvflow
