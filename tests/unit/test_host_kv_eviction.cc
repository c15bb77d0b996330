// InfiniGen's host KV pool manager (src/infinigen/host_kv_eviction.h): the counter policy evicts
// the least prefetched entry (the oldest among equals) and halves every count when one saturates;
// LRU and FIFO beside it; misuse gets clear errors.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <tuple>

#include "infinigen/host_kv_eviction.h"

namespace kvflow {
namespace {

TEST(HostKvEviction, CounterEvictsTheLeastFetchedThenTheOldest) {
  HostKvEviction pool(HostEvictionPolicy::kCounter, 4);
  for (int64_t id : {10, 11, 12, 13}) ASSERT_TRUE(pool.Insert(id).ok());
  EXPECT_TRUE(pool.full());
  EXPECT_EQ(pool.Insert(14).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.Victim(), 10) << "all at 0: the oldest";
  ASSERT_TRUE(pool.OnFetch(10).ok());
  ASSERT_TRUE(pool.OnFetch(12).ok());
  ASSERT_TRUE(pool.OnFetch(12).ok());
  EXPECT_EQ(pool.Victim(), 11);
  ASSERT_TRUE(pool.Erase(11).ok());
  EXPECT_EQ(pool.Victim(), 13);
  ASSERT_TRUE(pool.Erase(13).ok());
  EXPECT_EQ(pool.Victim(), 10) << "10 fetched once, 12 twice";
  ASSERT_TRUE(pool.Insert(14).ok());
  EXPECT_EQ(pool.Victim(), 14) << "a new entry starts at 0";
}

TEST(HostKvEviction, SaturationHalvesEveryCountAndKeepsTheOrder) {
  HostKvEviction pool(HostEvictionPolicy::kCounter, 3, /*counter_max=*/8);
  for (int64_t id : {1, 2, 3}) ASSERT_TRUE(pool.Insert(id).ok());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(pool.OnFetch(2).ok());
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(pool.OnFetch(3).ok());
  for (int i = 0; i < 7; ++i) ASSERT_TRUE(pool.OnFetch(1).ok());
  EXPECT_EQ(pool.halvings(), 0);
  ASSERT_TRUE(pool.OnFetch(1).ok());  // 1 reaches 8: every count halves
  EXPECT_EQ(pool.halvings(), 1);
  EXPECT_EQ(pool.count(1), 4u);
  EXPECT_EQ(pool.count(2), 2u);
  EXPECT_EQ(pool.count(3), 1u);
  EXPECT_EQ(pool.Victim(), 3);
}

TEST(HostKvEviction, LruAndFifo) {
  HostKvEviction lru(HostEvictionPolicy::kLru, 3), fifo(HostEvictionPolicy::kFifo, 3);
  for (HostKvEviction* p : {&lru, &fifo}) {
    for (int64_t id : {1, 2, 3}) ASSERT_TRUE(p->Insert(id).ok());
    ASSERT_TRUE(p->OnFetch(1).ok());
    ASSERT_TRUE(p->OnFetch(2).ok());
  }
  EXPECT_EQ(lru.Victim(), 3) << "least recently used";
  EXPECT_EQ(fifo.Victim(), 1) << "oldest, however often fetched";
}

// Against a brute-force model of each policy on a random trace of inserts, fetches and evictions.
TEST(HostKvEviction, RandomTracesMatchABruteForceModel) {
  for (HostEvictionPolicy policy : {HostEvictionPolicy::kCounter, HostEvictionPolicy::kLru, HostEvictionPolicy::kFifo}) {
    SCOPED_TRACE(HostEvictionPolicyName(policy));
    const uint32_t kMax = 6;
    HostKvEviction pool(policy, 16, kMax);
    struct Model {
      uint32_t count;
      uint64_t inserted, used;
    };
    std::map<int64_t, Model> model;
    uint64_t tick = 0;
    std::mt19937 rng(3);
    int64_t next_id = 0;
    for (int step = 0; step < 5000; ++step) {
      const int op = static_cast<int>(rng() % 3);
      if (op == 0 || model.empty()) {
        if (pool.full()) {
          const auto victim = pool.Victim();
          ASSERT_TRUE(victim.has_value());
          // The model's victim.
          auto best = model.begin();
          for (auto it = model.begin(); it != model.end(); ++it) {
            auto key = [&](const auto& e) {
              return policy == HostEvictionPolicy::kCounter ? std::make_tuple(uint64_t{e.second.count}, e.second.inserted)
                     : policy == HostEvictionPolicy::kLru   ? std::make_tuple(e.second.used, uint64_t{0})
                                                            : std::make_tuple(e.second.inserted, uint64_t{0});
            };
            if (key(*it) < key(*best)) best = it;
          }
          ASSERT_EQ(*victim, best->first) << "step " << step;
          ASSERT_TRUE(pool.Erase(*victim).ok());
          model.erase(best);
        }
        ASSERT_TRUE(pool.Insert(next_id).ok());
        ++tick;
        model[next_id++] = {0, tick, tick};
      } else {
        auto it = model.begin();
        std::advance(it, rng() % model.size());
        ASSERT_TRUE(pool.OnFetch(it->first).ok());
        ++tick;
        it->second.used = tick;
        if (it->second.count < kMax) ++it->second.count;
        if (policy == HostEvictionPolicy::kCounter && it->second.count >= kMax) {
          for (auto& [id, m] : model) m.count /= 2;
        }
      }
    }
    for (const auto& [id, m] : model) {
      if (policy == HostEvictionPolicy::kCounter) EXPECT_EQ(pool.count(id), m.count);
    }
  }
}

TEST(HostKvEviction, MisuseGetsClearErrors) {
  HostKvEviction pool(HostEvictionPolicy::kCounter, 2);
  EXPECT_FALSE(pool.Victim().has_value());
  ASSERT_TRUE(pool.Insert(7).ok());
  EXPECT_EQ(pool.Insert(7).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.OnFetch(8).code(), StatusCode::kNotFound);
  EXPECT_EQ(pool.Erase(8).code(), StatusCode::kNotFound);
  EXPECT_FALSE(pool.count(8).has_value());
  EXPECT_EQ(ParseHostEvictionPolicy("counter").value(), HostEvictionPolicy::kCounter);
  EXPECT_EQ(ParseHostEvictionPolicy("lfu").status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvflow
