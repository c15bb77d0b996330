// Property test of the block manager: thousands of random operation sequences (allocate with
// prefix hits, append with copy-on-write, fork, free, swap out/in, recompute, truncate) run
// against a simulated memory that executes the planned copies exactly as a backend would. After
// every operation: refcounts equal the references in the block tables, free and used never
// overlap, the host pool never holds more than the device pool, every sequence reads back exactly
// its own tokens through its block table, and every block published in the prefix cache holds
// exactly the tokens it is published under. At the end every block is free. With a sliding window,
// every sequence holds exactly the blocks its next query can see: those wholly before the window
// are released (and their references dropped) as soon as the tokens past them are computed, and a
// truncation back into released tokens is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <random>
#include <set>

#include "kv/block_manager.h"

namespace kvflow {
namespace {

constexpr int kBlockSize = 4;

// One KV slot as a backend would hold it: a token's K/V depend on the token and on everything
// before it, so a block mapped after the wrong prefix reads back wrong even with equal tokens.
struct Slot {
  int32_t token = -1;
  uint64_t context = 0;  // fingerprint of the tokens before and at this position
  bool operator==(const Slot&) const = default;
};

std::vector<Slot> Slots(const std::vector<int32_t>& tokens) {
  std::vector<Slot> slots;
  uint64_t context = 0;
  for (int32_t t : tokens) {
    context = HashBlockTokens(context, std::span<const int32_t>(&t, 1));
    slots.push_back({t, context});
  }
  return slots;
}

// How often the interesting paths ran, so the test cannot pass vacuously.
struct Coverage {
  int64_t prefix_hits = 0, copies = 0, swaps_out = 0, swaps_in = 0, forks = 0, recomputes = 0;
  // Truncations; of them those that cut a published block (private or shared), refused ones.
  int64_t truncates = 0, cut_published_private = 0, cut_published_shared = 0, truncates_refused = 0;
  // Sliding window: blocks released, truncations refused for reaching into released tokens.
  int64_t released = 0, truncates_refused_window = 0;
};
Coverage coverage;

struct Harness {
  explicit Harness(uint64_t seed, bool prefix, int device_blocks, int host_blocks, int64_t window)
      : window(window),
        rng(seed),
        manager([&] {
          BlockManagerConfig c;
          c.block_size = kBlockSize;
          c.num_device_blocks = device_blocks;
          c.num_host_blocks = host_blocks;
          c.enable_prefix_caching = prefix;
          c.watermark = 0.0;
          c.sliding_window = window;
          return c;
        }()),
        device_mem(static_cast<size_t>(device_blocks), std::vector<Slot>(kBlockSize)),
        host_mem(static_cast<size_t>(host_blocks), std::vector<Slot>(kBlockSize)) {}

  int64_t window;  // 0: none
  std::mt19937_64 rng;
  BlockManager manager;
  // What each physical slot holds, as a backend's memory would.
  std::vector<std::vector<Slot>> device_mem, host_mem;
  std::map<SeqId, std::vector<int32_t>> tokens;  // every live sequence's tokens (all computed)
  std::vector<std::vector<SeqId>> groups;        // sequences that swap together
  // Sequences whose every computed token has been through MarkComputed since their last
  // truncation: they hold no block before their window.
  std::set<SeqId> fully_released;
  SeqId next_id = 1;

  void MarkComputed(SeqId seq) {
    const int before = manager.ReleasedBlocks(seq);
    manager.MarkComputed(seq, tokens[seq], static_cast<int64_t>(tokens[seq].size()));
    coverage.released += manager.ReleasedBlocks(seq) - before;
    fully_released.insert(seq);
  }

  int Rand(int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); }

  // Prompts from a few shared stems so that prefix hits happen.
  std::vector<int32_t> RandomPrompt() {
    std::vector<int32_t> p;
    const int stem = Rand(3);
    const int stem_len = Rand(3) * kBlockSize + Rand(kBlockSize);
    for (int i = 0; i < stem_len; ++i) p.push_back(stem * 1000 + i);
    const int tail = 1 + Rand(6);
    for (int i = 0; i < tail; ++i) p.push_back(Rand(50));
    return p;
  }

  void Write(SeqId seq, int64_t from) {
    const auto& table = manager.BlockTable(seq);
    const auto slots = Slots(tokens[seq]);
    auto& mem = manager.IsSwapped(seq) ? host_mem : device_mem;
    for (int64_t i = from; i < static_cast<int64_t>(slots.size()); ++i) {
      mem[static_cast<size_t>(table[static_cast<size_t>(i / kBlockSize)])][static_cast<size_t>(i % kBlockSize)] =
          slots[static_cast<size_t>(i)];
    }
  }

  static void Execute(const std::vector<BlockMove>& moves, std::vector<std::vector<Slot>>& from,
                      std::vector<std::vector<Slot>>& to) {
    for (const BlockMove& m : moves) to[static_cast<size_t>(m.dst)] = from[static_cast<size_t>(m.src)];
  }

  std::vector<SeqId>* GroupOf(SeqId seq) {
    for (auto& g : groups) {
      if (std::find(g.begin(), g.end(), seq) != g.end()) return &g;
    }
    return nullptr;
  }

  SeqId RandomSeq() {
    auto it = tokens.begin();
    std::advance(it, Rand(static_cast<int>(tokens.size())));
    return it->first;
  }

  void Add() {
    auto prompt = RandomPrompt();
    const int64_t reserve = Rand(4) == 0 ? static_cast<int64_t>(prompt.size()) + Rand(12) : 0;
    if (manager.BlocksToAllocate(prompt, reserve) > manager.device().num_free()) {
      EXPECT_FALSE(manager.Allocate(next_id, prompt, reserve).ok());
      EXPECT_FALSE(manager.Has(next_id));
      return;
    }
    const SeqId id = next_id++;
    const int64_t cached = manager.Allocate(id, prompt, reserve).value();
    ASSERT_EQ(cached % kBlockSize, 0);
    ASSERT_LT(cached, static_cast<int64_t>(prompt.size()));
    coverage.prefix_hits += cached > 0;
    tokens[id] = prompt;
    // The cached part must already hold our tokens; we compute (write) only the rest.
    Write(id, cached);
    MarkComputed(id);
    groups.push_back({id});
  }

  void Append() {
    const SeqId seq = RandomSeq();
    if (manager.IsSwapped(seq)) return;
    auto& t = tokens[seq];
    const int64_t len = static_cast<int64_t>(t.size());
    const int n = 1 + (Rand(4) == 0 ? Rand(6) : 0);
    const int needed = manager.BlocksToAppend(seq, len, len + n);
    const int free_before = manager.device().num_free();
    const Status st = manager.AppendSlots(seq, len, len + n);
    if (needed > free_before) {  // out of blocks: nothing may have changed
      ASSERT_EQ(st.code(), StatusCode::kOutOfMemory);
      ASSERT_TRUE(manager.TakePendingCopies().empty());
      return;
    }
    ASSERT_TRUE(st.ok());
    const auto copies = manager.TakePendingCopies();
    coverage.copies += static_cast<int64_t>(copies.size());
    Execute(copies, device_mem, device_mem);
    for (int i = 0; i < n; ++i) t.push_back(Rand(50));
    Write(seq, len);
    MarkComputed(seq);
  }

  void Fork() {
    const SeqId parent = RandomSeq();
    const SeqId child = next_id++;
    manager.Fork(parent, child);
    ++coverage.forks;
    tokens[child] = tokens[parent];
    if (fully_released.contains(parent)) fully_released.insert(child);
    GroupOf(parent)->push_back(child);
  }

  void Free() {
    const SeqId seq = RandomSeq();
    manager.Free(seq);
    tokens.erase(seq);
    fully_released.erase(seq);
    auto* g = GroupOf(seq);
    g->erase(std::find(g->begin(), g->end(), seq));
    if (g->empty()) groups.erase(groups.begin() + (g - groups.data()));
  }

  void Swap() {
    auto& g = groups[static_cast<size_t>(Rand(static_cast<int>(groups.size())))];
    if (manager.IsSwapped(g.front())) {
      if (!manager.CanSwapIn(g, 0)) {
        EXPECT_FALSE(manager.SwapIn(g).ok());
        return;
      }
      Execute(manager.SwapIn(g).value(), host_mem, device_mem);
      ++coverage.swaps_in;
    } else {
      if (!manager.CanSwapOut(g)) {
        EXPECT_FALSE(manager.SwapOut(g).ok());
        return;
      }
      Execute(manager.SwapOut(g).value(), device_mem, host_mem);
      ++coverage.swaps_out;
    }
  }

  // Preemption by recompute: drop the KV, allocate again for every token, recompute.
  void Recompute() {
    const SeqId seq = RandomSeq();
    if (manager.IsSwapped(seq)) return;
    const auto& t = tokens[seq];
    manager.Free(seq);
    if (manager.BlocksToAllocate(t, 0) > manager.device().num_free()) {
      fully_released.erase(seq);
      tokens.erase(seq);
      auto* g = GroupOf(seq);
      g->erase(std::find(g->begin(), g->end(), seq));
      if (g->empty()) groups.erase(groups.begin() + (g - groups.data()));
      return;
    }
    const int64_t cached = manager.Allocate(seq, t, 0).value();
    ++coverage.recomputes;
    Write(seq, cached);
    MarkComputed(seq);
  }

  // llama.cpp's seq_rm: mostly a few tokens off the end (rejected drafts), sometimes to a block
  // boundary, to nothing, or past the end (a no-op).
  void Truncate() {
    const SeqId seq = RandomSeq();
    auto& t = tokens[seq];
    const int64_t len = static_cast<int64_t>(t.size());
    int64_t n;
    switch (Rand(6)) {
      case 0: n = 0; break;
      case 1: n = len / kBlockSize * kBlockSize; break;
      case 2: n = len + Rand(3); break;
      default: n = len - Rand(static_cast<int>(std::min<int64_t>(len, 6)) + 1);
    }
    const std::vector<BlockId> before = manager.BlockTable(seq);
    const int released = manager.IsSwapped(seq) ? 0 : manager.ReleasedBlocks(seq);
    const Status st = manager.Truncate(seq, n);
    if (!manager.IsSwapped(seq) && window > 0 &&
        static_cast<int64_t>(released) * kBlockSize > std::max<int64_t>(0, n - window + 1)) {
      ASSERT_EQ(st.code(), StatusCode::kInvalidArgument) << "a truncation into released tokens must be refused";
      ASSERT_EQ(manager.BlockTable(seq), before);
      ++coverage.truncates_refused_window;
      return;
    }
    if (manager.IsSwapped(seq)) {
      ASSERT_EQ(st.code(), StatusCode::kInvalidArgument);
      ASSERT_EQ(manager.BlockTable(seq), before);
      ++coverage.truncates_refused;
      return;
    }
    ASSERT_TRUE(st.ok()) << st.ToString();
    const size_t keep = std::min(before.size(), static_cast<size_t>(BlocksForTokens(n, kBlockSize)));
    ASSERT_EQ(manager.BlockTable(seq), std::vector<BlockId>(before.begin(), before.begin() + static_cast<long>(keep)));
    if (n % kBlockSize != 0 && n < len) {
      const BlockId cut = before[static_cast<size_t>(n / kBlockSize)];
      if (manager.device().is_cached_content(cut)) {
        ++(manager.device().refcount(cut) > 1 ? coverage.cut_published_shared : coverage.cut_published_private);
      }
    }
    ++coverage.truncates;
    if (n < len) {
      t.resize(static_cast<size_t>(n));
      fully_released.erase(seq);
    }
  }

  void CheckInvariants() {
    std::vector<int> device_refs(device_mem.size(), 0), host_refs(host_mem.size(), 0);
    for (const auto& [seq, t] : tokens) {
      ASSERT_TRUE(manager.Has(seq));
      const auto& table = manager.BlockTable(seq);
      ASSERT_GE(static_cast<int64_t>(table.size()) * kBlockSize, static_cast<int64_t>(t.size()));
      const bool on_host = manager.IsSwapped(seq);
      auto& refs = on_host ? host_refs : device_refs;
      const auto& mem = on_host ? host_mem : device_mem;
      // Released entries lead the table: exactly the blocks before the next query's window, or
      // fewer after a truncation.
      int released = 0;
      while (released < static_cast<int>(table.size()) && table[static_cast<size_t>(released)] == kReleasedBlock) {
        ++released;
      }
      const int64_t first_visible = window > 0 ? std::max<int64_t>(0, static_cast<int64_t>(t.size()) - window + 1) : 0;
      ASSERT_LE(static_cast<int64_t>(released) * kBlockSize, first_visible) << "sequence " << seq;
      if (!on_host) {
        ASSERT_EQ(manager.ReleasedBlocks(seq), released);
        if (fully_released.contains(seq)) {
          ASSERT_EQ(released, static_cast<int>(std::min<int64_t>(first_visible / kBlockSize,
                                                                  static_cast<int64_t>(table.size()))))
              << "sequence " << seq << " keeps blocks no query can see";
        }
      }
      for (size_t i = static_cast<size_t>(released); i < table.size(); ++i) {
        ASSERT_NE(table[i], kReleasedBlock) << "a released entry after a live one";
        ++refs[static_cast<size_t>(table[i])];
      }
      const auto slots = Slots(t);
      for (size_t i = static_cast<size_t>(released) * kBlockSize; i < t.size(); ++i) {
        ASSERT_EQ(mem[static_cast<size_t>(table[i / kBlockSize])][i % kBlockSize], slots[i])
            << "sequence " << seq << " reads a wrong token at " << i << (on_host ? " (host)" : " (device)");
      }
      // A published block of the sequence is published after exactly the sequence's prefix.
      uint64_t prefix = 0;
      for (size_t i = 0; !on_host && (i + 1) * kBlockSize <= t.size(); ++i) {
        const std::span<const int32_t> block(t.data() + i * kBlockSize, kBlockSize);
        if (table[i] != kReleasedBlock && manager.device().is_cached_content(table[i])) {
          ASSERT_EQ(manager.device().Peek(prefix, block), std::optional<BlockId>(table[i]))
              << "sequence " << seq << " block " << i << " is published under another prefix";
        }
        prefix = HashBlockTokens(prefix, block);
      }
    }
    ASSERT_EQ(manager.num_sequences(), static_cast<int>(tokens.size()));
    int device_free = 0, host_free = 0;
    for (size_t b = 0; b < device_refs.size(); ++b) {
      ASSERT_EQ(manager.device().refcount(static_cast<BlockId>(b)), device_refs[b]) << "device block " << b;
      device_free += device_refs[b] == 0;
    }
    for (size_t b = 0; b < host_refs.size(); ++b) {
      ASSERT_EQ(manager.host().refcount(static_cast<BlockId>(b)), host_refs[b]) << "host block " << b;
      host_free += host_refs[b] == 0;
    }
    ASSERT_EQ(manager.device().num_free(), device_free) << "free and used overlap";
    for (size_t b = 0; b < device_mem.size(); ++b) {
      const auto published = manager.device().content_tokens(static_cast<BlockId>(b));
      if (published.empty()) continue;
      for (size_t i = 0; i < published.size(); ++i) {
        ASSERT_EQ(device_mem[b][i].token, published[i])
            << "device block " << b << " no longer holds the tokens it is published under";
      }
    }
    ASSERT_EQ(manager.host().num_free(), host_free);
    ASSERT_LE(manager.host().num_used(), manager.device().num_blocks());
  }
};

void RunRandomSequence(uint64_t seed, bool prefix, int ops, int64_t window) {
  const int device_blocks = 8 + static_cast<int>(seed % 24);
  Harness h(seed, prefix, device_blocks, static_cast<int>(seed % 3) * device_blocks / 2, window);
  for (int op = 0; op < ops; ++op) {
    const int dice = h.tokens.empty() ? 0 : h.Rand(100);
    if (dice < 23) {
      h.Add();
    } else if (dice < 55) {
      h.Append();
    } else if (dice < 64) {
      h.Fork();
    } else if (dice < 75) {
      h.Free();
    } else if (dice < 86) {
      h.Swap();
    } else if (dice < 91) {
      h.Recompute();
    } else {
      h.Truncate();
    }
    h.CheckInvariants();
    if (::testing::Test::HasFatalFailure() || ::testing::Test::HasNonfatalFailure()) {
      FAIL() << "seed " << seed << " op " << op;
    }
  }
  while (!h.tokens.empty()) h.Free();
  EXPECT_EQ(h.manager.device().num_free(), h.manager.device().num_blocks());
  EXPECT_EQ(h.manager.host().num_free(), h.manager.host().num_blocks());
  EXPECT_EQ(h.manager.num_sequences(), 0);
}

// window > 0: a sliding window of that many tokens, or, with window < 0, of 1 + seed % -window
// tokens (from one token to a few blocks, not a multiple of the block size or one).
void RunMany(bool prefix, int64_t window = 0) {
  coverage = {};
  for (uint64_t seed = 1; seed <= 1500; ++seed) {
    RunRandomSequence(seed, prefix, 120, window < 0 ? 1 + static_cast<int64_t>(seed % static_cast<uint64_t>(-window)) : window);
    if (::testing::Test::HasFailure()) return;
  }
  std::printf("coverage: %lld prefix hits, %lld CoW copies, %lld swap-outs, %lld swap-ins, %lld forks, %lld recomputes\n",
              static_cast<long long>(coverage.prefix_hits), static_cast<long long>(coverage.copies),
              static_cast<long long>(coverage.swaps_out), static_cast<long long>(coverage.swaps_in),
              static_cast<long long>(coverage.forks), static_cast<long long>(coverage.recomputes));
  std::printf("coverage: %lld truncates (%lld cut a private published block, %lld a shared one), %lld refused\n",
              static_cast<long long>(coverage.truncates), static_cast<long long>(coverage.cut_published_private),
              static_cast<long long>(coverage.cut_published_shared),
              static_cast<long long>(coverage.truncates_refused));
  EXPECT_GT(coverage.copies, 100);
  EXPECT_GT(coverage.swaps_out, 100);
  EXPECT_GT(coverage.swaps_in, 100);
  EXPECT_GT(coverage.recomputes, 100);
  EXPECT_GT(coverage.truncates, 1000);
  EXPECT_GT(coverage.truncates_refused, 100);
  if (window != 0) {
    std::printf("coverage: %lld blocks released from the window, %lld truncations into released tokens refused\n",
                static_cast<long long>(coverage.released), static_cast<long long>(coverage.truncates_refused_window));
    EXPECT_GT(coverage.released, 1000);
    EXPECT_GT(coverage.truncates_refused_window, 100);
  }
  if (prefix) {
    EXPECT_GT(coverage.prefix_hits, 100);
    EXPECT_GT(coverage.cut_published_private, 100);
    EXPECT_GT(coverage.cut_published_shared, 100);
  }
}

TEST(BlockManagerProperty, RandomOperationSequencesKeepEveryInvariant) { RunMany(false); }

TEST(BlockManagerProperty, RandomOperationSequencesWithPrefixCachingKeepEveryInvariant) { RunMany(true); }

// Windows of 1 to 13 tokens over blocks of 4: released blocks, forks of partly released tables,
// swaps and recomputes of them, and truncations back into the window.
TEST(BlockManagerProperty, SlidingWindowReleasesExactlyTheBlocksNoQueryCanSee) { RunMany(false, -13); }

TEST(BlockManagerProperty, SlidingWindowWithPrefixCachingKeepsEveryInvariant) { RunMany(true, -13); }

}  // namespace
}  // namespace kvflow
