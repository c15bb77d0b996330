// KV-Runahead's chain prefill and TSP over real MPI processes (mpirun -np 2..4, see
// tests/CMakeLists.txt): the last rank's KV cache and first-token logits must equal, bit for bit,
// what it computes alone prefilling the prompt chunk by chunk at the same bounds, for the even split
// and for uneven chunks that do not align with the KV blocks.
#include <gtest/gtest.h>

#include "../unit/chain_prefill_test_util.h"
#include "kv_runahead/chain_prefill.h"
#include "distributed/mpi/mpi_communicator.h"

namespace kvflow::dist {
namespace {

// Uneven, unaligned bounds of a 150-token prompt for p ranks (earlier chunks larger, as the chain
// wants them).
std::vector<int64_t> UnevenBounds(int p) {
  switch (p) {
    case 2: return {0, 97, 150};
    case 3: return {0, 61, 107, 150};
    case 4: return {0, 50, 91, 125, 150};
    default: {
      std::vector<int64_t> b;
      for (int i = 0; i <= p; ++i) b.push_back(150 * i / p);
      return b;
    }
  }
}

std::vector<int64_t> EvenBounds(int p) {
  std::vector<int64_t> b;
  for (int i = 0; i <= p; ++i) b.push_back(150 * i / p);
  return b;
}

TEST(MpiChainPrefill, LastRankEqualsChunkedSingleProcessPrefill) {
  auto comm_or = MpiCommunicator::Create();
  ASSERT_TRUE(comm_or.ok()) << comm_or.status().ToString();
  Communicator& comm = *comm_or.value();
  const int p = comm.size(), me = comm.rank();
  const std::vector<int32_t> prompt = test::RandomTokens(150, 21, 256);
  for (PrefillMethod method : {PrefillMethod::kKvRunahead, PrefillMethod::kTsp}) {
    for (const std::string kv_dtype : {"f32", "f16"}) {
      for (const std::vector<int64_t>& bounds : {EvenBounds(p), UnevenBounds(p)}) {
        SCOPED_TRACE(std::string(PrefillMethodName(method)) + " " + kv_dtype + " " + testing::PrintToString(bounds));
        auto backend = test::TinyCpuBackend(test::kPoolTokens, false, kv_dtype);
        const int bs = backend->kv_layout().block_size;
        const std::vector<BlockId> table = test::ShuffledTable((test::kPoolTokens + bs - 1) / bs,
                                                               backend->kv_layout().num_blocks, 500 + me);
        DistributedPrefillOptions options;
        options.method = method;
        options.timeout_s = 60;
        std::vector<float> logits;
        DistributedPrefillStats stats;
        std::span<const int32_t> chunk(prompt.data() + bounds[me], static_cast<size_t>(bounds[me + 1] - bounds[me]));
        Status st = RunDistributedPrefill(comm, *backend, chunk, bounds, table, options, logits, &stats);
        ASSERT_TRUE(st.ok()) << "rank " << me << ": " << st.ToString();
        if (me + 1 < p) {
          EXPECT_TRUE(logits.empty());
          EXPECT_GT(stats.bytes_sent, 0);
          continue;
        }
        const test::Reference chunked = test::SingleProcessPrefill(prompt, bounds, kv_dtype);
        EXPECT_EQ(logits, chunked.logits);
        EXPECT_EQ(test::ReadWholeKv(*backend, table, 150), chunked.kv);
        EXPECT_GT(stats.bytes_received, 0);
      }
    }
  }
  ASSERT_TRUE(comm.Barrier(60).ok());
}

}  // namespace
}  // namespace kvflow::dist
