// KV-Runahead's chain prefill and the TSP baseline (kv_runahead/chain_prefill.h) over the in-process
// communicator: every rank is a thread with its own CPU backend (own pool, own shuffled block
// table). The last rank's KV cache and logits must equal, bit for bit, one process prefilling the
// prompt chunk by chunk at the same bounds, and come within float rounding of a one-pass prefill.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <random>
#include <thread>

#include "kv_runahead/chain_prefill.h"
#include "distributed/in_process_communicator.h"
#include "chain_prefill_test_util.h"

namespace kvflow::dist {
namespace {

using test::KvPrefix;
using test::kPoolTokens;
using test::CompareQ4Kv;
using test::MaxAbsDiff;
using test::Q4Comparison;
using test::RandomTokens;
using test::ReadWholeKv;
using test::Reference;
using test::ShuffledTable;
using test::SingleProcessPrefill;
using test::TinyCpuBackend;

struct RankOutcome {
  Status status;
  std::vector<float> logits;
  std::vector<float> kv;  // the positions the rank holds at the end
  DistributedPrefillStats stats;
};

// Runs the distributed prefill with one thread per rank; `gone` ranks leave before they start.
std::vector<RankOutcome> RunRanks(const std::vector<int32_t>& prompt, const std::vector<int64_t>& bounds,
                                  PrefillMethod method, const std::string& kv_dtype, std::vector<int> gone = {},
                                  double timeout_s = 30.0) {
  const int p = static_cast<int>(bounds.size()) - 1;
  std::vector<std::unique_ptr<Communicator>> comms = InProcessWorld::Create(p);
  std::vector<std::unique_ptr<Backend>> backends;
  for (int r = 0; r < p; ++r) backends.push_back(TinyCpuBackend(kPoolTokens, false, kv_dtype));
  std::vector<RankOutcome> out(static_cast<size_t>(p));
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r) {
    if (std::find(gone.begin(), gone.end(), r) != gone.end()) {
      static_cast<InProcessCommunicator&>(*comms[r]).MarkGone();
      continue;
    }
    threads.emplace_back([&, r] {
      Backend& backend = *backends[r];
      const int bs = backend.kv_layout().block_size;
      const std::vector<BlockId> table =
          ShuffledTable((kPoolTokens + bs - 1) / bs, backend.kv_layout().num_blocks, 1000 + r);
      DistributedPrefillOptions options;
      options.method = method;
      options.timeout_s = timeout_s;
      std::span<const int32_t> chunk(prompt.data() + bounds[r], static_cast<size_t>(bounds[r + 1] - bounds[r]));
      out[r].status = RunDistributedPrefill(*comms[r], backend, chunk, bounds, table, options, out[r].logits,
                                            &out[r].stats);
      const int64_t held = method == PrefillMethod::kTsp ? bounds.back() : bounds[r + 1];
      if (out[r].status.ok()) out[r].kv = ReadWholeKv(backend, table, held);
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

struct PartitionCase {
  std::vector<int64_t> bounds;
};

class ChainPrefillTest : public ::testing::TestWithParam<std::tuple<PrefillMethod, std::string>> {};

// Uneven chunks, none of them aligned to the 16-token KV blocks, for 2, 3 and 4 ranks.
const std::vector<std::vector<int64_t>> kPartitions = {
    {0, 97, 150}, {0, 61, 107, 150}, {0, 50, 91, 125, 150}, {0, 75, 150}, {0, 3, 149, 150}};

TEST_P(ChainPrefillTest, LastRankEqualsChunkedSingleProcessPrefill) {
  const auto [method, kv_dtype] = GetParam();
  const std::vector<int32_t> prompt = RandomTokens(150, 7, 256);
  const Reference one_pass = SingleProcessPrefill(prompt, std::vector<int64_t>{0, 150}, kv_dtype);
  for (const std::vector<int64_t>& bounds : kPartitions) {
    SCOPED_TRACE(testing::PrintToString(bounds));
    const Reference chunked = SingleProcessPrefill(prompt, bounds, kv_dtype);
    std::vector<RankOutcome> ranks = RunRanks(prompt, bounds, method, kv_dtype);
    const int p = static_cast<int>(bounds.size()) - 1;
    for (int r = 0; r < p; ++r) {
      ASSERT_TRUE(ranks[r].status.ok()) << "rank " << r << ": " << ranks[r].status.ToString();
      EXPECT_EQ(ranks[r].logits.empty(), r + 1 < p) << "only the last rank produces logits";
    }
    const RankOutcome& last = ranks.back();
    // Bit-identical to the chunked prefill: the same computation, the K/V moved unchanged.
    EXPECT_EQ(last.logits, chunked.logits);
    EXPECT_EQ(last.kv, chunked.kv);
    // And a one-pass prefill differs only by the order of float sums.
    const float logit_err = MaxAbsDiff(last.logits, one_pass.logits);
    RecordProperty("max_logit_error_vs_one_pass", std::to_string(logit_err));
    EXPECT_LT(logit_err, kv_dtype == "f32" ? 1e-3f : 2e-2f);
    if (kv_dtype == "q4") {
      // q4 rounds each value to a step of its group of 32; another float sum order may carry a value
      // across a rounding boundary (by -O level and instruction set): at most one step, in few values.
      const Q4Comparison q4 = CompareQ4Kv(last.kv, one_pass.kv, 2e-2f);
      EXPECT_LE(q4.worst_in_steps, 1.0f + 1e-3f);
      EXPECT_LT(q4.off_fraction, 1e-3) << q4.off_values << " of " << last.kv.size() << " values off by a step";
    } else {
      EXPECT_LT(MaxAbsDiff(last.kv, one_pass.kv), kv_dtype == "f32" ? 1e-3f : 2e-2f);
    }
    if (method == PrefillMethod::kTsp) {
      // Every rank all-gathered the whole cache.
      for (int r = 0; r + 1 < p; ++r) EXPECT_EQ(ranks[r].kv, chunked.kv) << "rank " << r;
    } else {
      // Rank r holds chunks 0..r exactly as the chunked prefill computed them.
      for (int r = 0; r + 1 < p; ++r) {
        EXPECT_EQ(ranks[r].kv, KvPrefix(chunked.kv, bounds.back(), bounds[r + 1], chunked.row)) << "rank " << r;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(MethodsAndKvTypes, ChainPrefillTest,
                         ::testing::Combine(::testing::Values(PrefillMethod::kKvRunahead, PrefillMethod::kTsp),
                                            ::testing::Values(std::string("f32"), std::string("f16"),
                                                              std::string("q4"))),
                         [](const auto& info) {
                           return std::string(PrefillMethodName(std::get<0>(info.param))) == "tsp"
                                      ? "Tsp_" + std::get<1>(info.param)
                                      : "KvRunahead_" + std::get<1>(info.param);
                         });

// The chain moves (p-1) chunks' worth less than TSP: rank i sends chunks 0..i, once per layer.
TEST(ChainPrefill, TrafficIsWhatTheChainSends) {
  const std::vector<int32_t> prompt = RandomTokens(150, 8, 256);
  const std::vector<int64_t> bounds = {0, 61, 107, 150};
  std::vector<RankOutcome> ranks = RunRanks(prompt, bounds, PrefillMethod::kKvRunahead, "f32");
  auto probe = TinyCpuBackend(kPoolTokens);
  const int layers = probe->kv_layout().num_layers;
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(ranks[r].status.ok()) << ranks[r].status.ToString();
    const int64_t sent = r < 2 ? KvPackBytes(*probe, bounds[r + 1]) * layers : 0;
    const int64_t received = r > 0 ? KvPackBytes(*probe, bounds[r]) * layers : 0;
    EXPECT_EQ(ranks[r].stats.bytes_sent, sent) << "rank " << r;
    EXPECT_EQ(ranks[r].stats.bytes_received, received) << "rank " << r;
  }
}

// A rank that never comes ends every other rank's prefill with an error, not a hang: its
// neighbours (the chain's next rank; every rank of an all-gather) at once, ranks further down the
// chain when their wait for the failed rank times out.
TEST(ChainPrefill, GoneRankEndsThePrefillWithAnError) {
  const std::vector<int32_t> prompt = RandomTokens(150, 9, 256);
  for (PrefillMethod method : {PrefillMethod::kKvRunahead, PrefillMethod::kTsp}) {
    SCOPED_TRACE(PrefillMethodName(method));
    std::vector<RankOutcome> ranks = RunRanks(prompt, {0, 61, 107, 150}, method, "f32", {0}, 3.0);
    for (int r = 1; r < 3; ++r) {
      EXPECT_EQ(ranks[r].status.code(), StatusCode::kUnavailable) << "rank " << r << ": " << ranks[r].status.ToString();
      const bool neighbour = method == PrefillMethod::kTsp || r == 1;
      if (neighbour) EXPECT_LT(ranks[r].stats.total_seconds, 2.0) << "rank " << r << " must fail at once";
      EXPECT_LT(ranks[r].stats.total_seconds, 10.0) << "rank " << r;
    }
  }
}

// A peer that is there but never sends: the receiver gives up after its timeout.
TEST(ChainPrefill, SilentPeerTimesOut) {
  const std::vector<int32_t> prompt = RandomTokens(100, 10, 256);
  const std::vector<int64_t> bounds = {0, 60, 100};
  std::vector<std::unique_ptr<Communicator>> comms = InProcessWorld::Create(2);
  auto backend = TinyCpuBackend(kPoolTokens);
  const std::vector<BlockId> table = ShuffledTable(10, backend->kv_layout().num_blocks, 3);
  DistributedPrefillOptions options;
  options.timeout_s = 0.3;
  std::vector<float> logits;
  const auto start = std::chrono::steady_clock::now();
  Status st = RunDistributedPrefill(*comms[1], *backend, std::span<const int32_t>(prompt).subspan(60), bounds, table,
                                    options, logits);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("kv-runahead"), std::string::npos) << st.message();
  EXPECT_LT(seconds, 10.0);
  EXPECT_TRUE(logits.empty());
}

TEST(ChainPrefill, BadPartitionsAreRefused) {
  std::vector<std::unique_ptr<Communicator>> comms = InProcessWorld::Create(1);
  auto backend = TinyCpuBackend(kPoolTokens);
  const std::vector<int32_t> prompt = RandomTokens(40, 11, 256);
  const std::vector<BlockId> table = ShuffledTable(4, backend->kv_layout().num_blocks, 4);
  std::vector<float> logits;
  DistributedPrefillOptions options;
  for (const std::vector<int64_t>& bounds : std::vector<std::vector<int64_t>>{{0}, {0, 20, 40}, {5, 40}, {0, 0}}) {
    Status st = RunDistributedPrefill(*comms[0], *backend, prompt, bounds, table, options, logits);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << testing::PrintToString(bounds);
  }
  // Tokens that do not match the chunk, and a table too short for it.
  EXPECT_EQ(RunDistributedPrefill(*comms[0], *backend, std::span<const int32_t>(prompt).first(30),
                                  std::vector<int64_t>{0, 40}, table, options, logits).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(RunDistributedPrefill(*comms[0], *backend, prompt, std::vector<int64_t>{0, 40},
                                  std::span<const BlockId>(table).first(2), options, logits).code(),
            StatusCode::kInvalidArgument);
  // One rank is a plain prefill.
  Status st = RunDistributedPrefill(*comms[0], *backend, prompt, std::vector<int64_t>{0, 40}, table, options, logits);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(logits.size(), static_cast<size_t>(backend->model_config().vocab_size));
  EXPECT_FALSE(ParsePrefillMethod("ring").ok());
}

TEST(KvPack, RoundTripsEveryElementType) {
  for (const std::string dtype : {"f32", "f16", "q4"}) {
    auto from = TinyCpuBackend(kPoolTokens, false, dtype);
    auto to = TinyCpuBackend(kPoolTokens, false, dtype);
    // Fill the pool by prefilling random tokens, then move positions 5..69 to other slots.
    LlamaModel model(*from);
    const std::vector<BlockId> table = ShuffledTable(5, from->kv_layout().num_blocks, 5);
    const std::vector<BlockId> other = ShuffledTable(5, to->kv_layout().num_blocks, 6);
    ForwardBatch batch;
    batch.tokens = RandomTokens(70, 12, 256);
    for (int i = 0; i < 70; ++i) batch.positions.push_back(i);
    SequenceSlice slice;
    slice.num_tokens = 70;
    slice.context_len = 70;
    slice.block_table = table;
    slice.logits = LogitsMode::kNone;
    batch.seqs.push_back(slice);
    std::vector<float> logits;
    ASSERT_TRUE(model.Forward(batch, logits).ok());
    std::vector<int64_t> src, dst;
    for (int pos = 5; pos < 70; ++pos) {
      src.push_back(SlotOf(table, pos, 16));
      dst.push_back(SlotOf(other, pos, 16));
    }
    std::vector<std::byte> packed(static_cast<size_t>(KvPackBytes(*from, 65)));
    for (int layer = 0; layer < from->kv_layout().num_layers; ++layer) {
      ASSERT_TRUE(from->As<KvPacking>()->PackKv(layer, src, packed).ok());
      ASSERT_TRUE(to->As<KvPacking>()->UnpackKv(layer, dst, packed).ok());
      for (int kv = 0; kv < 2; ++kv) {
        const KvCacheLayout& layout = from->kv_layout();
        std::vector<float> a(src.size() * layout.num_kv_heads * layout.head_dim), b(a.size());
        ASSERT_TRUE(from->ReadKv(layer, kv, src, a).ok());
        ASSERT_TRUE(to->ReadKv(layer, kv, dst, b).ok());
        EXPECT_EQ(a, b) << dtype << " layer " << layer;
        EXPECT_GT(MaxAbsDiff(a, std::vector<float>(a.size(), 0.0f)), 0.0f) << "the pool holds real K/V";
      }
    }
    std::vector<std::byte> small(packed.size() - 1);
    EXPECT_EQ(from->As<KvPacking>()->PackKv(0, src, small).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(from->As<KvPacking>()->PackKv(99, src, packed).code(), StatusCode::kInvalidArgument);
    std::vector<int64_t> outside = src;
    outside[3] = int64_t{1} << 40;
    EXPECT_EQ(to->As<KvPacking>()->UnpackKv(0, outside, packed).code(), StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace kvflow::dist
