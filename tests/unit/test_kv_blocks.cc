#include <gtest/gtest.h>

#include <random>
#include <set>

#include "kv/block_table.h"

namespace kvflow {
namespace {

TEST(BlockAllocator, AllocatesEveryBlockOnceThenReportsExhaustion) {
  BlockAllocator alloc(5);
  std::set<BlockId> seen;
  for (int i = 0; i < 5; ++i) {
    auto b = alloc.Allocate();
    ASSERT_TRUE(b.ok());
    EXPECT_TRUE(seen.insert(b.value()).second);
    EXPECT_EQ(alloc.refcount(b.value()), 1);
  }
  auto none = alloc.Allocate();
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kOutOfMemory);
  alloc.Free(*seen.begin());
  EXPECT_EQ(alloc.num_free(), 1);
}

TEST(BlockAllocator, SharedBlockReturnsOnlyAfterLastReference) {
  BlockAllocator alloc(2);
  BlockId b = alloc.Allocate().value();
  alloc.AddRef(b);
  EXPECT_EQ(alloc.refcount(b), 2);
  alloc.Free(b);
  EXPECT_EQ(alloc.num_free(), 1);
  alloc.Free(b);
  EXPECT_EQ(alloc.num_free(), 2);
}

TEST(BlockTable, GrowsOnlyWhenTheLastBlockIsFull) {
  BlockAllocator alloc(10);
  BlockTable table(4);
  ASSERT_TRUE(table.EnsureCapacity(1, alloc).ok());
  EXPECT_EQ(table.blocks().size(), 1u);
  ASSERT_TRUE(table.EnsureCapacity(4, alloc).ok());
  EXPECT_EQ(table.blocks().size(), 1u);
  ASSERT_TRUE(table.EnsureCapacity(5, alloc).ok());
  EXPECT_EQ(table.blocks().size(), 2u);
  EXPECT_EQ(table.MissingBlocks(13), 2);
  table.Release(alloc);
  EXPECT_EQ(alloc.num_free(), 10);
}

TEST(BlockTable, AllOrNothingWhenThePoolRunsDry) {
  BlockAllocator alloc(3);
  BlockTable a(4), b(4);
  ASSERT_TRUE(a.EnsureCapacity(8, alloc).ok());
  Status st = b.EnsureCapacity(9, alloc);  // needs 3, one free
  EXPECT_EQ(st.code(), StatusCode::kOutOfMemory);
  EXPECT_TRUE(b.blocks().empty());
  EXPECT_EQ(alloc.num_free(), 1);
}

TEST(BlockTable, RandomWorkloadLeavesEveryBlockFree) {
  std::mt19937 rng(42);
  BlockAllocator alloc(64);
  std::vector<BlockTable> tables(8, BlockTable(16));
  std::vector<int64_t> lengths(8, 0);
  for (int step = 0; step < 5000; ++step) {
    const size_t i = rng() % tables.size();
    if (rng() % 10 == 0) {
      tables[i].Release(alloc);
      lengths[i] = 0;
    } else {
      const int64_t want = lengths[i] + 1 + rng() % 20;
      if (tables[i].EnsureCapacity(want, alloc).ok()) lengths[i] = want;
    }
    int used = 0;
    for (const auto& t : tables) used += static_cast<int>(t.blocks().size());
    ASSERT_EQ(used + alloc.num_free(), alloc.num_blocks());
  }
  for (auto& t : tables) t.Release(alloc);
  EXPECT_EQ(alloc.num_free(), alloc.num_blocks());
}

}  // namespace
}  // namespace kvflow
