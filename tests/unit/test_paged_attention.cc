// The CPU paged attention (the reference for the CUDA kernels) against plain contiguous attention
// computed in double, with shuffled block placement and a cache poisoned with NaN outside the
// written slots, on a 2-thread pool: grouped query heads, and long decode contexts split across
// threads and merged (flash-decoding), outputs and log-sum-exp alike.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <cstdio>
#include <random>

#include "backend/cpu/attention_kernels.h"
#include "backend/cpu/paged_attention.h"
#include "util/thread_pool.h"

namespace kvflow {
namespace {

struct Case {
  int num_heads, num_kv_heads, head_dim, block_size;
  std::vector<int> past;  // tokens already cached per sequence
  std::vector<int> fresh; // new tokens per sequence this step
  // > 0: sliding-window attention; the blocks before each sequence's first query's window are
  // released (kReleasedBlock in the table, their content poisoned with NaN) as the engine does.
  int window = 0;
};

void RunCase(const Case& c, uint32_t seed, cpu::KvElement element = cpu::KvElement::kF32) {
  ThreadPool threads(2);
  ScopedThreadPool use_threads(&threads);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int S = static_cast<int>(c.past.size());
  KvCacheLayout layout{1, 0, c.num_kv_heads, c.block_size, c.head_dim};
  std::vector<int> ctx(S);
  for (int s = 0; s < S; ++s) {
    ctx[s] = c.past[s] + c.fresh[s];
    layout.num_blocks += (ctx[s] + c.block_size - 1) / c.block_size;
  }
  layout.num_blocks += 3;
  std::vector<BlockId> pool(static_cast<size_t>(layout.num_blocks));
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);

  const size_t cache_elems = layout.layer_stride();
  // Poisoned with NaN (fp32 0x7fc00000, fp16 0x7e00) outside the written slots.
  const bool f16 = element == cpu::KvElement::kF16;
  std::vector<float> kc(cache_elems, NAN), vc(cache_elems, NAN);
  std::vector<uint16_t> kc16(cache_elems, 0x7e00), vc16(cache_elems, 0x7e00);
  void* key_pool = f16 ? static_cast<void*>(kc16.data()) : kc.data();
  void* value_pool = f16 ? static_cast<void*>(vc16.data()) : vc.data();
  // Dense K/V of every sequence: [ctx][kv_heads][head_dim].
  std::vector<std::vector<float>> dense_k(S), dense_v(S);
  std::vector<std::vector<BlockId>> tables(S);
  size_t next = 0;
  for (int s = 0; s < S; ++s) {
    const int nb = (ctx[s] + c.block_size - 1) / c.block_size;
    tables[s].assign(pool.begin() + static_cast<long>(next), pool.begin() + static_cast<long>(next + nb));
    next += static_cast<size_t>(nb);
    dense_k[s].resize(static_cast<size_t>(ctx[s]) * c.num_kv_heads * c.head_dim);
    dense_v[s].resize(dense_k[s].size());
    for (float& x : dense_k[s]) x = normal(rng);
    for (float& x : dense_v[s]) x = normal(rng);
    if (f16) {  // the reference attends over what an fp16 cache holds
      for (auto* dense : {&dense_k[s], &dense_v[s]}) {
        for (float& x : *dense) x = static_cast<float>(static_cast<_Float16>(x));
      }
    }
  }

  // Two writes, as the engine does: the past in one batch, then the fresh tokens with attention.
  ForwardBatch step[2];
  std::vector<float> k_rows[2], v_rows[2];
  for (int phase = 0; phase < 2; ++phase) {
    for (int s = 0; s < S; ++s) {
      const int begin = phase == 0 ? 0 : c.past[s];
      const int end = phase == 0 ? c.past[s] : ctx[s];
      if (end == begin) continue;
      SequenceSlice slice;
      slice.token_offset = static_cast<int32_t>(step[phase].tokens.size());
      slice.num_tokens = end - begin;
      slice.context_len = end;
      slice.block_table = tables[s];
      for (int t = begin; t < end; ++t) {
        step[phase].tokens.push_back(0);
        step[phase].positions.push_back(t);
        const size_t row = static_cast<size_t>(t) * c.num_kv_heads * c.head_dim;
        k_rows[phase].insert(k_rows[phase].end(), dense_k[s].begin() + static_cast<long>(row),
                             dense_k[s].begin() + static_cast<long>(row + c.num_kv_heads * c.head_dim));
        v_rows[phase].insert(v_rows[phase].end(), dense_v[s].begin() + static_cast<long>(row),
                             dense_v[s].begin() + static_cast<long>(row + c.num_kv_heads * c.head_dim));
      }
      step[phase].seqs.push_back(slice);
    }
    cpu::WriteKvCache(ResolveSlotMapping(step[phase], layout.block_size), layout, k_rows[phase].data(),
                      v_rows[phase].data(), static_cast<int64_t>(c.num_kv_heads) * c.head_dim, element, key_pool,
                      value_pool);
  }

  ForwardBatch& batch = step[1];
  if (c.window > 0) {
    for (SequenceSlice& slice : batch.seqs) {
      const int first_key = std::max(0, slice.context_len - slice.num_tokens - c.window + 1);
      for (int b = 0; (b + 1) * c.block_size <= first_key; ++b) {
        BlockId& id = slice.block_table[static_cast<size_t>(b)];
        for (int h = 0; h < c.num_kv_heads; ++h) {
          const size_t at = layout.offset(id, h, 0);
          std::fill_n(kc.begin() + static_cast<long>(at), c.block_size * c.head_dim, NAN);
          std::fill_n(vc.begin() + static_cast<long>(at), c.block_size * c.head_dim, NAN);
          std::fill_n(kc16.begin() + static_cast<long>(at), c.block_size * c.head_dim, 0x7e00);
          std::fill_n(vc16.begin() + static_cast<long>(at), c.block_size * c.head_dim, 0x7e00);
        }
        id = kReleasedBlock;
      }
    }
  }
  const size_t T = batch.tokens.size();
  std::vector<float> q(T * c.num_heads * c.head_dim), out(q.size(), NAN), lse(T * c.num_heads, NAN);
  for (float& x : q) x = normal(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  std::vector<std::vector<int64_t>> views(batch.seqs.size());
  for (size_t s = 0; s < batch.seqs.size(); ++s) ViewSlots(batch.seqs[s], layout.block_size, views[s]);
  cpu::AttentionIo io;
  io.query = q.data();
  io.query_row_stride = static_cast<int64_t>(c.num_heads) * c.head_dim;
  io.out = out.data();
  io.out_row_stride = io.query_row_stride;
  io.lse = lse.data();
  io.window = c.window;
  cpu::PagedAttention(batch, views, layout, c.num_heads, io, element, key_pool, value_pool, scale);

  double max_err = 0.0, max_lse_err = 0.0;
  const int group = c.num_heads / c.num_kv_heads;
  size_t seq_index = 0;
  for (int s = 0; s < S; ++s) {
    if (c.fresh[s] == 0) continue;
    const SequenceSlice& slice = batch.seqs[seq_index++];
    for (int i = 0; i < slice.num_tokens; ++i) {
      const int t = slice.token_offset + i;
      const int pos = batch.positions[static_cast<size_t>(t)];
      for (int h = 0; h < c.num_heads; ++h) {
        const int kvh = h / group;
        const float* qh = &q[(static_cast<size_t>(t) * c.num_heads + h) * c.head_dim];
        std::vector<double> p(static_cast<size_t>(pos + 1), 0.0);
        double mx = -1e300, denom = 0.0;
        const int first = c.window > 0 ? std::max(0, pos - c.window + 1) : 0;
        for (int j = first; j <= pos; ++j) {
          const float* k = &dense_k[s][(static_cast<size_t>(j) * c.num_kv_heads + kvh) * c.head_dim];
          double dot = 0.0;
          for (int d = 0; d < c.head_dim; ++d) dot += static_cast<double>(qh[d]) * k[d];
          p[j] = dot * scale;
          mx = std::max(mx, p[j]);
        }
        for (int j = first; j <= pos; ++j) denom += (p[j] = std::exp(p[j] - mx));
        max_lse_err = std::max(max_lse_err, std::abs(lse[static_cast<size_t>(t) * c.num_heads + h] - (mx + std::log(denom))));
        for (int d = 0; d < c.head_dim; ++d) {
          double ref = 0.0;
          for (int j = first; j <= pos; ++j) ref += p[j] / denom * dense_v[s][(static_cast<size_t>(j) * c.num_kv_heads + kvh) * c.head_dim + d];
          const float got = out[(static_cast<size_t>(t) * c.num_heads + h) * c.head_dim + d];
          ASSERT_TRUE(std::isfinite(got)) << "read an unwritten (NaN-poisoned) cache slot";
          max_err = std::max(max_err, std::abs(got - ref));
        }
      }
    }
  }
  ::testing::Test::RecordProperty("max_abs_error", std::to_string(max_err));
  std::printf("  paged attention max |err| = %.2e, log-sum-exp max |err| = %.2e\n", max_err, max_lse_err);
  EXPECT_LT(max_err, 2e-5) << "heads " << c.num_heads << "/" << c.num_kv_heads << " block " << c.block_size;
  EXPECT_LT(max_lse_err, 2e-5);
}

TEST(PagedAttention, PrefillMatchesContiguousAttention) {
  RunCase({8, 2, 16, 16, {0, 0, 0}, {1, 17, 40}}, 1);
  RunCase({4, 4, 64, 8, {0, 0}, {33, 5}}, 2);
}

TEST(PagedAttention, DecodeOverCachedContextMatches) {
  RunCase({8, 2, 16, 16, {31, 1, 100}, {1, 1, 1}}, 3);
  RunCase({6, 1, 32, 32, {64, 7}, {1, 1}}, 4);  // MQA, block size 32
}

// Sliding-window attention (Mistral's mask: the query at p sees p - window + 1 .. p) with the blocks
// before the window released: prefill, chunked prefill over a cached prefix, windows inside one
// block, across partitions, of one token, and decode of long contexts split across threads.
TEST(PagedAttention, SlidingWindowMatchesWindowedAttention) {
  RunCase({8, 2, 16, 16, {0, 0}, {40, 100}, 17}, 31);
  RunCase({8, 2, 16, 16, {50, 600, 3}, {30, 70, 9}, 33}, 32);
  RunCase({9, 3, 64, 16, {3000, 1030, 40}, {1, 1, 1}, 700}, 33);
  RunCase({4, 4, 128, 32, {5000}, {4}, 1300}, 34);
  RunCase({4, 4, 64, 8, {20, 0}, {5, 12}, 1}, 35);
  RunCase({9, 3, 64, 16, {600}, {90}, 513}, 36, cpu::KvElement::kF16);
}

// Sequences decoding over thousands of cached tokens: each context is split into 512-key partitions
// computed apart and merged.
TEST(PagedAttention, LongDecodeSplitAcrossThreadsMatches) {
  RunCase({9, 3, 64, 16, {3000}, {1}}, 7);          // SmolLM2's head layout, 6 partitions
  RunCase({8, 2, 64, 16, {1030, 700}, {1, 1}}, 8);  // a partition boundary inside a block
  RunCase({4, 4, 128, 32, {5000}, {4}}, 9);         // a few rows (drafts) at long context
}

// An fp16 pool: rows rounded once when written, converted back when read; against attention over
// the same rounded values.
TEST(PagedAttention, Fp16CacheMatchesAttentionOverRoundedValues) {
  RunCase({9, 3, 64, 16, {16, 23, 5}, {16, 9, 30}}, 10, cpu::KvElement::kF16);
  RunCase({9, 3, 64, 16, {3000}, {1}}, 11, cpu::KvElement::kF16);
  RunCase({4, 2, 128, 8, {13}, {19}}, 12, cpu::KvElement::kF16);
}

// A row's attention does not depend on the batch around it (a preempted and resumed request, or
// one whose neighbours finish, samples from the same numbers): one decoding sequence alone and
// next to others gives bit-identical outputs, short and split-long contexts alike.
TEST(PagedAttention, ARowsResultDoesNotDependOnItsBatch) {
  ThreadPool threads(2);
  ScopedThreadPool use_threads(&threads);
  const int H = 9, KV = 3, D = 64, bs = 16;
  KvCacheLayout layout{1, 400, KV, bs, D};
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> kc(layout.layer_stride()), vc(layout.layer_stride());
  for (auto* pool : {&kc, &vc}) {
    for (uint16_t& x : *pool) {
      const _Float16 h = static_cast<_Float16>(normal(rng));
      std::memcpy(&x, &h, sizeof(x));
    }
  }
  for (int context : {40, 3000}) {
    auto make_slice = [&](int first_block, int offset) {
      SequenceSlice slice;
      slice.token_offset = offset;
      slice.num_tokens = 1;
      slice.context_len = context;
      for (int b = 0; b < (context + bs - 1) / bs; ++b) slice.block_table.push_back(first_block + b);
      return slice;
    };
    std::vector<float> q(3 * H * D);
    for (float& x : q) x = normal(rng);
    auto run = [&](std::vector<SequenceSlice> slices) {
      ForwardBatch batch;
      batch.seqs = slices;
      std::vector<std::vector<int64_t>> views(slices.size());
      for (size_t s = 0; s < slices.size(); ++s) {
        batch.tokens.push_back(0);
        batch.positions.push_back(context - 1);
        ViewSlots(slices[s], bs, views[s]);
      }
      std::vector<float> out(slices.size() * H * D);
      cpu::AttentionIo io{q.data(), H * D, out.data(), H * D, nullptr};
      cpu::PagedAttention(batch, views, layout, H, io, cpu::KvElement::kF16, kc.data(), vc.data(), 0.125f);
      return out;
    };
    const std::vector<float> alone = run({make_slice(0, 0)});
    const std::vector<float> batched = run({make_slice(0, 0), make_slice(200, 1), make_slice(100, 2)});
    EXPECT_EQ(0, std::memcmp(alone.data(), batched.data(), alone.size() * sizeof(float))) << "context " << context;
  }
}

// Drafted tokens verified in one pass must see exactly the numbers plain decoding would (lossless
// speculative decoding): each row of a multi-token slice equals, bit for bit, the same query decoded
// alone over the same cache; short contexts, contexts split into partitions, and a long prefill
// whose rows fall into several tiles.
TEST(PagedAttention, ARowsResultDoesNotDependOnItsQueryTile) {
  ThreadPool threads(2);
  ScopedThreadPool use_threads(&threads);
  const int H = 9, KV = 3, D = 64, bs = 16;
  std::mt19937 rng(31);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const char* isa : {static_cast<const char*>(nullptr), "avx2", "portable"}) {
  const char* previous = cpu::LimitAttentionIsa(isa);
  for (const auto& [context, fresh] : std::vector<std::pair<int, int>>{{40, 5}, {1500, 5}, {100, 130}}) {
    KvCacheLayout layout{1, (context + fresh + bs - 1) / bs + 1, KV, bs, D};
    std::vector<uint16_t> kc(layout.layer_stride()), vc(layout.layer_stride());
    for (auto* pool : {&kc, &vc}) {
      for (uint16_t& x : *pool) {
        const _Float16 h = static_cast<_Float16>(normal(rng));
        std::memcpy(&x, &h, sizeof(x));
      }
    }
    std::vector<float> q(static_cast<size_t>(fresh) * H * D);
    for (float& x : q) x = normal(rng);
    auto run = [&](int first, int tokens) {
      SequenceSlice slice;
      slice.token_offset = 0;
      slice.num_tokens = tokens;
      slice.context_len = context + first + tokens;
      for (int b = 0; b < layout.num_blocks; ++b) slice.block_table.push_back(layout.num_blocks - 1 - b);
      slice.block_table.resize(static_cast<size_t>((slice.context_len + bs - 1) / bs));
      ForwardBatch batch;
      batch.seqs = {slice};
      std::vector<std::vector<int64_t>> views(1);
      for (int i = 0; i < tokens; ++i) {
        batch.tokens.push_back(0);
        batch.positions.push_back(context + first + i);
      }
      ViewSlots(slice, bs, views[0]);
      std::vector<float> out(static_cast<size_t>(tokens) * H * D);
      cpu::AttentionIo io{q.data() + static_cast<size_t>(first) * H * D, H * D, out.data(), H * D, nullptr};
      cpu::PagedAttention(batch, views, layout, H, io, cpu::KvElement::kF16, kc.data(), vc.data(), 0.125f);
      return out;
    };
    const std::vector<float> together = run(0, fresh);
    for (int i = 0; i < fresh; ++i) {
      const std::vector<float> alone = run(i, 1);
      ASSERT_EQ(0, std::memcmp(alone.data(), together.data() + static_cast<size_t>(i) * H * D, alone.size() * sizeof(float)))
          << cpu::SelectAttentionKernels(D).isa << " context " << context << " row " << i;
    }
  }
  cpu::LimitAttentionIsa(previous);
  }
}

// The AVX-512, AVX2 and portable kernel sets each against the double-precision reference (the
// machine runs those it has), with a head size the 16-lane kernels cannot take (40: AVX2 or
// portable) and one neither vector set takes (36: portable).
TEST(PagedAttention, EveryKernelPathMatches) {
  for (const char* isa : {static_cast<const char*>(nullptr), "avx2", "portable"}) {
    const char* previous = cpu::LimitAttentionIsa(isa);
    std::printf("  kernels %s (head_dim 64)\n", cpu::SelectAttentionKernels(64).isa);
    RunCase({9, 3, 64, 16, {700, 5}, {1, 60}}, 13, cpu::KvElement::kF16);
    RunCase({8, 2, 128, 16, {1030}, {3}}, 14);
    RunCase({4, 2, 40, 8, {33, 0}, {2, 70}}, 15);
    RunCase({4, 1, 36, 16, {20}, {9}}, 16);
    cpu::LimitAttentionIsa(previous);
  }
}

TEST(PagedAttention, ChunkedPrefillAfterCachedPrefixMatches) {
  RunCase({9, 3, 64, 16, {16, 23, 5}, {16, 9, 30}}, 5);  // SmolLM2's head layout
  RunCase({4, 2, 128, 8, {13}, {19}}, 6);
}

}  // namespace
}  // namespace kvflow
