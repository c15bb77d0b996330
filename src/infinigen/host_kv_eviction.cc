#include "infinigen/host_kv_eviction.h"

#include <algorithm>
#include <vector>

namespace kvflow {

Result<HostEvictionPolicy> ParseHostEvictionPolicy(const std::string& name) {
  if (name == "counter") return HostEvictionPolicy::kCounter;
  if (name == "lru") return HostEvictionPolicy::kLru;
  if (name == "fifo") return HostEvictionPolicy::kFifo;
  return Status::InvalidArgument("infinigen_eviction (the host KV pool's victim policy) must be counter, lru or fifo, not '" +
                                 name + "'");
}

const char* HostEvictionPolicyName(HostEvictionPolicy policy) {
  switch (policy) {
    case HostEvictionPolicy::kCounter: return "counter";
    case HostEvictionPolicy::kLru: return "lru";
    case HostEvictionPolicy::kFifo: return "fifo";
  }
  return "unknown";
}

HostKvEviction::HostKvEviction(HostEvictionPolicy policy, int64_t capacity, uint32_t counter_max)
    : policy_(policy), capacity_(std::max<int64_t>(1, capacity)), counter_max_(std::max<uint32_t>(1, counter_max)) {}

HostKvEviction::Key HostKvEviction::KeyOf(int64_t id, const Entry& e) const {
  switch (policy_) {
    case HostEvictionPolicy::kCounter: return {e.count, e.inserted, id};
    case HostEvictionPolicy::kLru: return {e.used, 0, id};
    case HostEvictionPolicy::kFifo: return {e.inserted, 0, id};
  }
  return {0, 0, id};
}

Status HostKvEviction::Insert(int64_t id) {
  if (entries_.contains(id)) return Status::InvalidArgument("host KV entry " + std::to_string(id) + " is already pooled");
  if (full()) {
    return Status::ResourceExhausted("host KV pool is full (" + std::to_string(capacity_) + " entries): evict first");
  }
  Entry e;
  e.inserted = e.used = ++tick_;
  entries_.emplace(id, e);
  order_.insert(KeyOf(id, e));
  return Status::Ok();
}

Status HostKvEviction::OnFetch(int64_t id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return Status::NotFound("host KV entry " + std::to_string(id) + " is not pooled");
  Entry& e = it->second;
  order_.erase(KeyOf(id, e));
  e.used = ++tick_;
  if (e.count < counter_max_) ++e.count;
  order_.insert(KeyOf(id, e));
  if (policy_ == HostEvictionPolicy::kCounter && e.count >= counter_max_) {
    // A saturated count: halve every count so the order keeps its shape and old hits fade.
    order_.clear();
    for (auto& [other, entry] : entries_) {
      entry.count /= 2;
      order_.insert(KeyOf(other, entry));
    }
    ++halvings_;
  }
  return Status::Ok();
}

std::optional<int64_t> HostKvEviction::Victim() const {
  if (order_.empty()) return std::nullopt;
  return std::get<2>(*order_.begin());
}

Status HostKvEviction::Erase(int64_t id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return Status::NotFound("host KV entry " + std::to_string(id) + " is not pooled");
  order_.erase(KeyOf(id, it->second));
  entries_.erase(it);
  return Status::Ok();
}

std::optional<uint32_t> HostKvEviction::count(int64_t id) const {
  auto it = entries_.find(id);
  if (it == entries_.end()) return std::nullopt;
  return it->second.count;
}

}  // namespace kvflow
