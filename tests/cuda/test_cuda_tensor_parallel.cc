// Tensor parallelism on CUDA ranks: two ranks, each a thread with its own CUDA backend (the
// emulator's devices, the GPUs there are, or one GPU twice), step messages over the in-process
// transport, the layers' sums over device buffers (Communicator::AllReduceSumOnDevice: the CUDA
// peer transport here; NCCL under mpirun, tests/distributed/nccl). The split engine's greedy tokens
// must equal one CUDA rank's and the CPU's fp32 reference; every rank summed device buffers.
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <vector>

#include "distributed/cuda/cuda_peer_communicator.h"
#include "engine/evaluation.h"
#include "engine_test_util.h"
#include "gpu_test_util.h"
#include "in_process_job.h"
#include "kvflow/engine.h"
#include "model_parallel/model_parallel_service.h"

namespace kvflow {
namespace {

#ifdef KVFLOW_CUDA_EMU
// Two emulated devices, before the first CUDA call of the process.
const bool kEmulatedDevices = [] { return setenv("KVFLOW_EMU_DEVICES", "2", 0) == 0; }();
#endif

EngineConfig TinyCudaConfig(const std::string& device) {
  EngineConfig c;
  c.model = "tiny-random";
  c.device = device;
  c.dtype = "fp16";
  c.num_threads = 1;
  c.num_kv_blocks = 128;  // fixed, so the emulator does not size a pool from its fake memory
  c.max_num_seqs = 4;
  c.max_num_batched_tokens = 128;
  c.max_model_len = 256;
  return c;
}

// Three prompts of random byte tokens, 9, 20 and 31 long.
std::vector<std::vector<int32_t>> Prompts() {
  std::mt19937 rng(70);
  std::uniform_int_distribution<int32_t> byte(0, 255);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 3; ++i) {
    std::vector<int32_t>& p = prompts.emplace_back();
    for (int t = 0; t < 9 + 11 * i; ++t) p.push_back(byte(rng));
  }
  return prompts;
}

TEST(CudaTensorParallel, TwoRanksGreedyEqualsOneRankAndTheCpu) {
  KVFLOW_SKIP_WITHOUT_GPU();
  // Two devices where there are two; one GPU runs both ranks (the peer copies are then local).
  const bool two_devices = cuda::DeviceCount() >= 2;
  const std::vector<int> devices = two_devices ? std::vector<int>{0, 1} : std::vector<int>{0, 0};
  EngineConfig split = TinyCudaConfig(two_devices ? "cuda" : "cuda:0");  // "cuda": rank r on device r
  split.tensor_parallel_size = 2;
  constexpr int kTokens = 24;

  EngineConfig cpu = TinyCudaConfig("cpu");
  cpu.dtype = "f32";
  auto reference = CreateEvaluationEngine(cpu, {});
  ASSERT_TRUE(reference.ok()) << reference.status().ToString();
  auto one_rank = CreateEvaluationEngine(TinyCudaConfig("cuda:0"), {});
  ASSERT_TRUE(one_rank.ok()) << one_rank.status().ToString();

  auto device_world = dist::CudaPeerWorld::Create(devices);
  ASSERT_TRUE(device_world.ok()) << device_world.status().ToString();
  std::vector<std::unique_ptr<dist::Communicator>>& device_comms = device_world.value();
  {
    test::InProcessJob job(2, 0, [&](dist::Communicator& comm) {
      return mp::RunModelParallelWorker(split, comm, 60.0, nullptr, device_comms[1].get());
    });
    EvaluationOptions options;
    options.model_parallel_communicator = &job.serving();
    options.model_parallel_device_communicator = device_comms[0].get();
    auto engine = CreateEvaluationEngine(split, options);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    const auto got = test::GenerateAll(*engine.value(), Prompts(), test::Greedy(kTokens), false);
    const auto whole = test::GenerateAll(*one_rank.value(), Prompts(), test::Greedy(kTokens), false);
    const auto exact = test::GenerateAll(*reference.value(), Prompts(), test::Greedy(kTokens), false);
    EXPECT_EQ(got, whole) << "two CUDA ranks against one";
    EXPECT_EQ(got, exact) << "two CUDA ranks against the CPU's fp32";
    const EngineStats stats = engine.value()->stats();
    ASSERT_EQ(stats.model_parallel.per_rank.size(), 2u);
    for (const RankStepStats& rank : stats.model_parallel.per_rank) {
      SCOPED_TRACE("rank " + std::to_string(rank.rank));
      EXPECT_GT(rank.microbatches, 0);
      // fp16 activations: two bytes an element, one sum after the embedding and two a layer.
      EXPECT_GT(rank.all_reduce_bytes, 0);
    }
    engine.value().reset();  // tells the worker to stop
    job.Join();
    EXPECT_TRUE(job.result(1).ok()) << job.result(1).ToString();
  }
}

// Without a device transport of its own a CUDA rank opens NCCL over the job's ranks; a build
// without NCCL says so instead of computing.
TEST(CudaTensorParallel, ARankWithoutNcclIsRefusedClearly) {
  KVFLOW_SKIP_WITHOUT_GPU();
#if KVFLOW_WITH_NCCL && !defined(KVFLOW_CUDA_EMU)
  GTEST_SKIP() << "this build has NCCL (tests/distributed/nccl runs it under mpirun)";
#endif
  EngineConfig split = TinyCudaConfig("cuda:0");
  split.tensor_parallel_size = 2;
  test::InProcessJob job(2, 0, [&](dist::Communicator& comm) { return mp::RunModelParallelWorker(split, comm, 30.0); });
  EvaluationOptions options;
  options.model_parallel_communicator = &job.serving();
  auto engine = CreateEvaluationEngine(split, options);
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("NCCL"), std::string::npos) << engine.status().ToString();
  job.Join();
  EXPECT_FALSE(job.result(1).ok());
}

}  // namespace
}  // namespace kvflow
