// Block allocator (refcounts, prefix cache, LRU reclaim) and block manager (fork, copy-on-write,
// prefix hits, swap plans) on hand-built cases. test_block_manager_property.cc covers random ones.
#include <gtest/gtest.h>

#include <numeric>
#include <set>
#include <string>

#include "kv/block_manager.h"

namespace kvflow {
namespace {

std::vector<int32_t> Tokens(int n, int start = 100) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), start);
  return t;
}

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

TEST(BlockAllocator, CachedBlocksAreRevivedByContentAndReclaimedLeastRecentlyUsedFirst) {
  BlockAllocator alloc(3);
  const auto a = Tokens(4, 0), b = Tokens(4, 10);
  BlockId ba = alloc.Allocate().value();
  BlockId bb = alloc.Allocate().value();
  ASSERT_TRUE(alloc.Register(ba, 0, a));
  ASSERT_TRUE(alloc.Register(bb, 0, b));
  EXPECT_FALSE(alloc.Register(bb, 0, b)) << "a block gets content once";
  alloc.Free(ba);  // released first: reclaimed first
  alloc.Free(bb);
  EXPECT_EQ(alloc.num_free(), 3);
  EXPECT_EQ(alloc.num_cached_unused(), 2);
  // The same tokens after a different prefix are different content.
  EXPECT_FALSE(alloc.Peek(HashBlockTokens(0, a), b).has_value());
  auto hit = alloc.Lookup(0, b);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(*hit, bb);
  EXPECT_EQ(alloc.refcount(bb), 1);
  // Free block first, then the cached `a` (its content is dropped), then nothing.
  BlockId fresh = alloc.Allocate().value();
  EXPECT_NE(fresh, ba);
  EXPECT_EQ(alloc.Allocate().value(), ba);
  EXPECT_FALSE(alloc.Peek(0, a).has_value());
  EXPECT_FALSE(alloc.Allocate().ok());
}

BlockManager Manager(int device, int host, bool prefix = false, int block_size = 4) {
  BlockManagerConfig c;
  c.block_size = block_size;
  c.num_device_blocks = device;
  c.num_host_blocks = host;
  c.enable_prefix_caching = prefix;
  c.watermark = 0.0;
  return BlockManager(c);
}

TEST(BlockManager, AppendAllocatesOnlyWhenTheLastBlockIsFull) {
  BlockManager m = Manager(10, 0);
  ASSERT_EQ(m.Allocate(1, Tokens(5), 5).value(), 0);
  EXPECT_EQ(m.BlockTable(1).size(), 2u);
  EXPECT_EQ(m.BlocksToAppend(1, 5, 8), 0);
  ASSERT_TRUE(m.AppendSlots(1, 5, 8).ok());
  EXPECT_EQ(m.BlockTable(1).size(), 2u);
  EXPECT_EQ(m.BlocksToAppend(1, 8, 9), 1);
  ASSERT_TRUE(m.AppendSlots(1, 8, 9).ok());
  EXPECT_EQ(m.BlockTable(1).size(), 3u);
  m.Free(1);
  EXPECT_EQ(m.device().num_free(), 10);
}

TEST(BlockManager, ForkSharesBlocksAndTheFirstWriterCopiesTheSharedPartialBlock) {
  BlockManager m = Manager(10, 0);
  ASSERT_TRUE(m.Allocate(1, Tokens(6), 6).ok());  // blocks: [full][2 of 4]
  m.Fork(1, 2);
  EXPECT_EQ(m.BlockTable(1), m.BlockTable(2));
  EXPECT_EQ(m.device().num_used(), 2);
  EXPECT_EQ(m.NumLogicalDeviceBlocks(), 4);
  const BlockId shared_last = m.BlockTable(1)[1];
  // Seq 2 writes token 6 into the shared last block: one copy, then it owns the copy.
  EXPECT_EQ(m.BlocksToAppend(2, 6, 7), 1);
  ASSERT_TRUE(m.AppendSlots(2, 6, 7).ok());
  auto copies = m.TakePendingCopies();
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src, shared_last);
  EXPECT_EQ(copies[0].dst, m.BlockTable(2)[1]);
  EXPECT_EQ(m.BlockTable(1)[0], m.BlockTable(2)[0]) << "the full block stays shared";
  // Seq 1 is now the only owner of the original: it writes in place.
  EXPECT_EQ(m.BlocksToAppend(1, 6, 7), 0);
  ASSERT_TRUE(m.AppendSlots(1, 6, 7).ok());
  EXPECT_TRUE(m.TakePendingCopies().empty());
  m.Free(1);
  m.Free(2);
  EXPECT_EQ(m.device().num_free(), 10);
}

TEST(BlockManager, PrefixCacheMapsFullComputedBlocksAndKeepsTheLastTokenToCompute) {
  BlockManager m = Manager(10, 0, /*prefix=*/true);
  const auto prompt = Tokens(12);  // three full blocks
  ASSERT_EQ(m.Allocate(1, prompt, 12).value(), 0);
  m.MarkComputed(1, prompt, 12);
  // Same prompt: the first two blocks hit; the third holds the last token, which must run.
  EXPECT_EQ(m.BlocksToAllocate(prompt, 12), 1);
  ASSERT_EQ(m.Allocate(2, prompt, 12).value(), 8);
  EXPECT_EQ(m.BlockTable(1)[0], m.BlockTable(2)[0]);
  EXPECT_EQ(m.BlockTable(1)[1], m.BlockTable(2)[1]);
  EXPECT_NE(m.BlockTable(1)[2], m.BlockTable(2)[2]);
  // A prompt that diverges in block 1 hits only block 0.
  auto other = prompt;
  other[5] = 7;
  ASSERT_EQ(m.Allocate(3, other, 12).value(), 4);
  EXPECT_NEAR(m.PrefixHitRate(), 3.0 / 6.0, 1e-12);  // 0 + 2 + 1 hits of 2 + 2 + 2 eligible blocks
  // Freed cached blocks stay hittable until reclaimed.
  m.Free(1);
  m.Free(2);
  m.Free(3);
  EXPECT_EQ(m.device().num_free(), 10);
  ASSERT_EQ(m.Allocate(4, prompt, 12).value(), 8);
  m.Free(4);
}

TEST(BlockManager, SwapOutAndInKeepSharingInsideTheGroup) {
  BlockManager m = Manager(8, 8);
  ASSERT_TRUE(m.Allocate(1, Tokens(6), 6).ok());
  m.Fork(1, 2);
  ASSERT_TRUE(m.AppendSlots(2, 6, 7).ok());  // seq 2 copies its last block
  (void)m.TakePendingCopies();
  const std::vector<SeqId> group = {1, 2};
  EXPECT_EQ(m.DistinctBlocks(group), 3);
  ASSERT_TRUE(m.CanSwapOut(group));
  auto out = m.SwapOut(group).value();
  EXPECT_EQ(out.size(), 3u);
  EXPECT_EQ(m.device().num_free(), 8);
  EXPECT_EQ(m.host().num_used(), 3);
  EXPECT_TRUE(m.IsSwapped(1));
  EXPECT_EQ(m.BlockTable(1)[0], m.BlockTable(2)[0]) << "shared on the host too";
  auto in = m.SwapIn(group).value();
  EXPECT_EQ(in.size(), 3u);
  EXPECT_EQ(m.host().num_free(), 8);
  EXPECT_EQ(m.device().num_used(), 3);
  EXPECT_EQ(m.BlockTable(1)[0], m.BlockTable(2)[0]);
  // Every host block swapped in was one swapped out.
  std::set<BlockId> host_out, host_in;
  for (auto mv : out) host_out.insert(mv.dst);
  for (auto mv : in) host_in.insert(mv.src);
  EXPECT_EQ(host_out, host_in);
  m.Free(1);
  m.Free(2);
  EXPECT_EQ(m.device().num_free(), 8);
}

TEST(BlockManager, AllOrNothingWhenPoolsRunDry) {
  BlockManager m = Manager(3, 1);
  ASSERT_TRUE(m.Allocate(1, Tokens(8), 8).ok());
  EXPECT_EQ(m.Allocate(2, Tokens(9), 9).status().code(), StatusCode::kOutOfMemory);
  EXPECT_FALSE(m.Has(2));
  EXPECT_EQ(m.device().num_free(), 1);
  EXPECT_EQ(m.AppendSlots(1, 8, 13).code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(m.BlockTable(1).size(), 2u);
  const std::vector<SeqId> group = {1};
  EXPECT_FALSE(m.CanSwapOut(group)) << "two blocks, one host block";
  EXPECT_EQ(m.SwapOut(group).status().code(), StatusCode::kOutOfMemory);
  m.Free(1);
}

TEST(BlockManager, ReservationAllocatesAheadOfTheTokens) {
  BlockManager m = Manager(10, 0);
  EXPECT_EQ(m.BlocksToAllocate(Tokens(3), 17), 5);
  ASSERT_TRUE(m.Allocate(1, Tokens(3), 17).ok());
  EXPECT_EQ(m.BlockTable(1).size(), 5u);
  EXPECT_EQ(m.BlocksToAppend(1, 3, 17), 0);
  EXPECT_EQ(m.BlocksToAppend(1, 17, 18, 24), 1);
  m.Free(1);
}

TEST(BlockManager, TruncateInsideABlockKeepsThePartialBlockAndReleasesTheRest) {
  BlockManager m = Manager(10, 0);
  ASSERT_TRUE(m.Allocate(1, Tokens(10), 10).ok());  // [4][4][2]
  const std::vector<BlockId> before = m.BlockTable(1);
  ASSERT_TRUE(m.Truncate(1, 6).ok());
  EXPECT_EQ(m.BlockTable(1), std::vector<BlockId>(before.begin(), before.begin() + 2));
  EXPECT_EQ(m.device().num_free(), 8);
  // Positions 6 and 7 are written again in the kept block: nothing to allocate or copy.
  EXPECT_EQ(m.BlocksToAppend(1, 6, 8), 0);
  ASSERT_TRUE(m.AppendSlots(1, 6, 8).ok());
  EXPECT_TRUE(m.TakePendingCopies().empty());
  EXPECT_EQ(m.BlockTable(1), std::vector<BlockId>(before.begin(), before.begin() + 2));
  m.Free(1);
  EXPECT_EQ(m.device().num_free(), 10);
}

TEST(BlockManager, TruncateAtABlockBoundaryAndToNothing) {
  BlockManager m = Manager(10, 0);
  ASSERT_TRUE(m.Allocate(1, Tokens(10), 10).ok());
  const BlockId first = m.BlockTable(1)[0];
  ASSERT_TRUE(m.Truncate(1, 4).ok());
  EXPECT_EQ(m.BlockTable(1), std::vector<BlockId>{first});
  EXPECT_EQ(m.device().num_free(), 9);
  ASSERT_TRUE(m.Truncate(1, 7).ok()) << "past the end: nothing to remove";
  EXPECT_EQ(m.BlockTable(1).size(), 1u);
  ASSERT_TRUE(m.Truncate(1, 0).ok());
  EXPECT_TRUE(m.BlockTable(1).empty());
  EXPECT_TRUE(m.Has(1));
  EXPECT_EQ(m.device().num_free(), 10);
  // An empty sequence grows again like any other.
  ASSERT_TRUE(m.AppendSlots(1, 0, 5).ok());
  EXPECT_EQ(m.BlockTable(1).size(), 2u);
  m.Free(1);
  EXPECT_EQ(m.device().num_free(), 10);
}

TEST(BlockManager, TruncatingAForkLeavesTheOtherSequenceItsBlocks) {
  BlockManager m = Manager(10, 0);
  ASSERT_TRUE(m.Allocate(1, Tokens(12), 12).ok());
  m.Fork(1, 2);
  const std::vector<BlockId> parent = m.BlockTable(1);
  ASSERT_TRUE(m.Truncate(2, 5).ok());
  EXPECT_EQ(m.BlockTable(1), parent);
  EXPECT_EQ(m.BlockTable(2), std::vector<BlockId>(parent.begin(), parent.begin() + 2));
  EXPECT_EQ(m.device().refcount(parent[0]), 2);
  EXPECT_EQ(m.device().refcount(parent[1]), 2);
  EXPECT_EQ(m.device().refcount(parent[2]), 1);
  EXPECT_EQ(m.device().num_used(), 3);
  // Sequence 2 rewrites position 5 of the block it shares: it copies, sequence 1 keeps the original.
  ASSERT_TRUE(m.AppendSlots(2, 5, 6).ok());
  const auto copies = m.TakePendingCopies();
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src, parent[1]);
  EXPECT_EQ(m.BlockTable(1), parent);
  EXPECT_NE(m.BlockTable(2)[1], parent[1]);
  m.Free(1);
  m.Free(2);
  EXPECT_EQ(m.device().num_free(), 10);
}

TEST(BlockManager, TruncateUnpublishesAPrivateCachedBlockBeforeItIsRewritten) {
  BlockManager m = Manager(10, 0, /*prefix=*/true);
  const auto prompt = Tokens(12);
  ASSERT_TRUE(m.Allocate(1, prompt, 12).ok());
  m.MarkComputed(1, prompt, 12);
  const std::vector<BlockId> table = m.BlockTable(1);
  ASSERT_TRUE(m.Truncate(1, 6).ok());
  // Block 2 left the table but keeps real KV: still a cache hit. Block 1 is partial now, but until
  // it is written its content is intact.
  EXPECT_EQ(m.device().num_cached_unused(), 1);
  EXPECT_TRUE(m.device().is_cached_content(table[1]));
  // Rewriting positions 6.. of block 1 in place: it must leave the prefix cache first.
  ASSERT_TRUE(m.AppendSlots(1, 6, 8).ok());
  EXPECT_TRUE(m.TakePendingCopies().empty()) << "a private block is written in place";
  EXPECT_FALSE(m.device().is_cached_content(table[1]));
  EXPECT_EQ(m.BlocksToAllocate(prompt, 12), 2) << "only block 0 still hits";
  // The chain shrank with the table: the new block 1 is published after block 0's hash.
  auto rewritten = prompt;
  rewritten[6] = 1;
  rewritten[7] = 2;
  rewritten.resize(8);
  m.MarkComputed(1, rewritten, 8);
  rewritten.push_back(3);
  ASSERT_EQ(m.Allocate(2, rewritten, 9).value(), 8);
  EXPECT_EQ(m.BlockTable(2)[1], table[1]);
  m.Free(1);
  m.Free(2);
  EXPECT_EQ(m.device().num_free(), 10);
}

TEST(BlockManager, ATruncatedSharedCachedBlockIsCopiedOnWriteOrUnpublishedOnceTheSharerLeft) {
  for (bool sharer_leaves : {false, true}) {
    SCOPED_TRACE(sharer_leaves ? "sharer leaves before the write" : "sharer stays");
    BlockManager m = Manager(10, 0, /*prefix=*/true);
    const auto prompt = Tokens(12);
    ASSERT_TRUE(m.Allocate(1, prompt, 12).ok());
    m.MarkComputed(1, prompt, 12);
    ASSERT_EQ(m.Allocate(2, prompt, 12).value(), 8);  // shares blocks 0 and 1
    const BlockId cut = m.BlockTable(1)[1];
    ASSERT_TRUE(m.Truncate(1, 6).ok());
    EXPECT_EQ(m.device().refcount(cut), 2);
    if (sharer_leaves) m.Free(2);
    ASSERT_TRUE(m.AppendSlots(1, 6, 7).ok());
    const auto copies = m.TakePendingCopies();
    if (sharer_leaves) {
      // Sole holder again, but the block is still published: unpublished, then written in place.
      EXPECT_TRUE(copies.empty());
      EXPECT_EQ(m.BlockTable(1)[1], cut);
      EXPECT_FALSE(m.device().is_cached_content(cut));
    } else {
      ASSERT_EQ(copies.size(), 1u);
      EXPECT_EQ(copies[0].src, cut);
      EXPECT_NE(m.BlockTable(1)[1], cut);
      EXPECT_EQ(m.BlockTable(2)[1], cut);
      EXPECT_TRUE(m.device().is_cached_content(cut)) << "the other holder's block stays published";
    }
    // The prompt's block 1 still hits only where the original content is intact.
    EXPECT_EQ(m.BlocksToAllocate(prompt, 12), sharer_leaves ? 2 : 1);
    m.Free(1);
    m.Free(2);
    EXPECT_EQ(m.device().num_free(), 10);
  }
}

TEST(BlockManager, TruncateRefusesSwappedUnknownAndNegativeAndChangesNothing) {
  BlockManager m = Manager(8, 8);
  ASSERT_TRUE(m.Allocate(1, Tokens(10), 10).ok());
  const std::vector<SeqId> group = {1};
  ASSERT_TRUE(m.SwapOut(group).ok());
  const std::vector<BlockId> table = m.BlockTable(1);
  const Status swapped = m.Truncate(1, 2);
  EXPECT_EQ(swapped.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(swapped.message().find("swapped out"), std::string::npos) << swapped.message();
  EXPECT_EQ(m.BlockTable(1), table);
  EXPECT_EQ(m.host().num_used(), 3);
  EXPECT_EQ(m.Truncate(7, 2).code(), StatusCode::kNotFound);
  ASSERT_TRUE(m.SwapIn(group).ok());
  EXPECT_EQ(m.Truncate(1, -1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m.BlockTable(1).size(), 3u);
  ASSERT_TRUE(m.Truncate(1, 2).ok());
  EXPECT_EQ(m.BlockTable(1).size(), 1u);
  m.Free(1);
  EXPECT_EQ(m.device().num_free(), 8);
}

}  // namespace
}  // namespace kvflow
