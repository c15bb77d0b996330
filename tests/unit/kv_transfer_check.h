// Backend::TransferKv end to end, for any backend: a prompt's KV moved token range by token range
// and layer range by layer range, through the host tier at shifted offsets and back into other
// device blocks, decodes the next token exactly as the original blocks do.
#pragma once

#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "forward/llama_model.h"

namespace kvflow::test {

// Needs block_size 8, at least 12 device blocks and 3 host blocks.
inline void ExpectTransferredKvDecodesAlike(Backend& backend, uint32_t seed) {
  const KvCacheLayout& layout = backend.kv_layout();
  ASSERT_EQ(layout.block_size, 8);
  ASSERT_GE(layout.num_blocks, 12);
  ASSERT_GE(backend.num_host_blocks(), 3);
  const int vocab = backend.model_config().vocab_size, layers = layout.num_layers;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> token(0, vocab - 1);
  const int kPrompt = 20;  // blocks of 8, 8 and 4 tokens
  const std::vector<BlockId> original = {4, 9, 1}, moved = {2, 7, 11};

  ForwardBatch prefill;
  for (int i = 0; i < kPrompt; ++i) {
    prefill.tokens.push_back(token(rng));
    prefill.positions.push_back(i);
  }
  SequenceSlice s;
  s.num_tokens = kPrompt;
  s.context_len = kPrompt;
  s.block_table = original;
  s.logits = LogitsMode::kNone;
  prefill.seqs.push_back(s);
  std::vector<float> unused;
  ASSERT_TRUE(LlamaModel(backend).Forward(prefill, unused).ok());

  // Device -> host: each block in two token ranges and two layer ranges, landing 2 slots later
  // in host blocks 0..2 (the last block's 4 tokens fit); then host -> device into `moved` at the
  // original offsets.
  std::vector<KvTransfer> out, in;
  const int split_layer = layers / 2;
  for (int b = 0; b < 3; ++b) {
    const int tokens = b < 2 ? 6 : 4;  // the host copy keeps 6 of a full block's 8 here...
    for (auto [first, count] : {std::pair{0, tokens / 2}, std::pair{tokens / 2, tokens - tokens / 2}}) {
      for (auto [lb, le] : {std::pair{0, split_layer}, std::pair{split_layer, layers}}) {
        out.push_back({KvTier::kDevice, original[b], first, KvTier::kHost, b, first + 2, count, lb, le});
        in.push_back({KvTier::kHost, b, first + 2, KvTier::kDevice, moved[b], first, count, lb, le});
      }
    }
  }
  // ...and the last 2 tokens of each full block go device to device directly.
  for (int b = 0; b < 2; ++b) in.push_back({KvTier::kDevice, original[b], 6, KvTier::kDevice, moved[b], 6, 2, 0, layers});
  ASSERT_TRUE(backend.TransferKv(out).ok());
  ASSERT_TRUE(backend.TransferKv(in).ok());

  auto decode = [&](const std::vector<BlockId>& table, std::vector<float>& logits) {
    ForwardBatch d;
    d.tokens = {prefill.tokens[3]};
    d.positions = {kPrompt};
    SequenceSlice one;
    one.num_tokens = 1;
    one.context_len = kPrompt + 1;
    one.block_table = table;
    d.seqs.push_back(one);
    ASSERT_TRUE(LlamaModel(backend).Forward(d, logits).ok());
  };
  std::vector<float> reference, via_transfers;
  decode(original, reference);
  decode(moved, via_transfers);
  ASSERT_EQ(reference.size(), via_transfers.size());
  EXPECT_EQ(reference, via_transfers) << "the moved KV is the same KV";

  // Bad transfers are refused, and nothing is half-done.
  const std::vector<KvTransfer> bad = {{KvTier::kDevice, 0, 6, KvTier::kDevice, 1, 0, 3, 0, layers}};
  EXPECT_EQ(backend.TransferKv(bad).code(), StatusCode::kInvalidArgument);
  const std::vector<KvTransfer> bad_layers = {{KvTier::kDevice, 0, 0, KvTier::kDevice, 1, 0, 1, 0, layers + 1}};
  EXPECT_EQ(backend.TransferKv(bad_layers).code(), StatusCode::kInvalidArgument);
  const std::vector<KvTransfer> bad_host = {
      {KvTier::kDevice, 0, 0, KvTier::kHost, backend.num_host_blocks(), 0, 1, 0, layers}};
  EXPECT_EQ(backend.TransferKv(bad_host).code(), StatusCode::kInvalidArgument);
}

}  // namespace kvflow::test
