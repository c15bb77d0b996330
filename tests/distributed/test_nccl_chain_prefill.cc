// KV-Runahead's chain and TSP over NCCL from device buffers, one GPU per rank (mpirun -np P on a
// machine with P GPUs): the last rank's KV cache and first-token logits must be bit-identical to
// the same chain over MPI from host buffers. The job the server runs as
//   mpirun -np 2 kvflow-server --device cuda --prefill-parallel kv-runahead ...
// Skips (on every rank alike) where kvflow was built without NCCL or there are fewer GPUs than ranks;
// the one-process form of the same check runs on the CUDA emulator in CI
// (tests/cuda/test_cuda_chain_prefill.cc).
#include <gtest/gtest.h>

#include "../unit/chain_prefill_test_util.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_device.h"
#include "distributed/mpi/mpi_communicator.h"
#include "distributed/world.h"
#include "kv_runahead/chain_prefill.h"
#include "model/llama_weights.h"
#include "model/tiny_random.h"

namespace kvflow::dist {
namespace {

TEST(NcclChainPrefill, LastRankIsBitIdenticalToTheMpiChain) {
  auto comm_or = MpiCommunicator::Create();
  ASSERT_TRUE(comm_or.ok()) << comm_or.status().ToString();
  Communicator& comm = *comm_or.value();
  const int p = comm.size(), me = comm.rank();
  if (!HaveNccl() || cuda::DeviceCount() < p) {
    GTEST_SKIP() << "needs NCCL and one GPU per rank (" << cuda::DeviceCount() << " GPUs for " << p
                 << " ranks; NCCL " << (HaveNccl() ? "built" : "not built") << ")";
  }
  auto nccl = OpenNcclCommunicator(comm, me, 60);
  ASSERT_TRUE(nccl.ok()) << nccl.status().ToString();
  auto files = MakeTinyRandomModel(0x6b76666c6f77, 4, false).value();
  const LlamaWeights weights = LoadLlamaWeights(*files.tensors, files.config, files.gguf_rope_permuted).value();
  CudaBackendOptions o;
  o.device = me;
  o.dtype = "fp16";
  o.block_size = 16;
  o.num_kv_blocks = 24;
  o.num_host_blocks = 0;
  o.max_num_seqs = 2;
  o.max_num_batched_tokens = 256;
  o.max_model_len = 24 * 16;
  auto backend = CreateCudaBackend(files.config, weights, o);
  ASSERT_TRUE(backend.ok()) << backend.status().ToString();
  const std::vector<int32_t> prompt = test::RandomTokens(150, 21, files.config.vocab_size);
  std::vector<int64_t> bounds;
  for (int i = 0; i <= p; ++i) bounds.push_back(150 * i * i / (p * p));  // uneven, not block-aligned
  for (int i = 1; i <= p; ++i) bounds[i] = std::max(bounds[i], bounds[i - 1] + 1);
  bounds[p] = 150;
  const std::vector<BlockId> table = test::ShuffledTable(10, 24, 700 + me);
  for (PrefillMethod method : {PrefillMethod::kKvRunahead, PrefillMethod::kTsp}) {
    SCOPED_TRACE(PrefillMethodName(method));
    DistributedPrefillOptions options;
    options.method = method;
    options.timeout_s = 60;
    std::span<const int32_t> chunk(prompt.data() + bounds[me], static_cast<size_t>(bounds[me + 1] - bounds[me]));
    std::vector<float> device_logits, host_logits;
    DistributedPrefillStats stats;
    Status st = RunDistributedPrefill(*nccl.value(), *backend.value(), chunk, bounds, table, options, device_logits, &stats);
    ASSERT_TRUE(st.ok()) << "rank " << me << " over NCCL: " << st.ToString();
    const int64_t held = method == PrefillMethod::kTsp ? 150 : bounds[me + 1];
    const std::vector<float> device_kv = test::ReadWholeKv(*backend.value(), table, held);
    st = RunDistributedPrefill(comm, *backend.value(), chunk, bounds, table, options, host_logits);
    ASSERT_TRUE(st.ok()) << "rank " << me << " over MPI: " << st.ToString();
    EXPECT_EQ(device_logits, host_logits);
    EXPECT_EQ(device_kv, test::ReadWholeKv(*backend.value(), table, held));
    if (me + 1 == p) {
      EXPECT_EQ(device_logits.size(), static_cast<size_t>(files.config.vocab_size));
      EXPECT_GT(stats.bytes_received, 0);
    }
  }
  ASSERT_TRUE(comm.Barrier(60).ok());
}

}  // namespace
}  // namespace kvflow::dist
