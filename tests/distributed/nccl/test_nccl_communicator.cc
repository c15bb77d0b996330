// The NCCL transport on one GPU: a world of one sends to itself (ncclSend/ncclRecv in one group),
// all-gathers and meets at a barrier. Skips without a GPU; tools/gpu-session runs it (and ctest -L gpu).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <random>

#include "distributed/nccl/nccl_communicator.h"

namespace kvflow::dist {
namespace {

bool HaveGpu() {
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
}

#define SKIP_WITHOUT_GPU()                                                                                     \
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA GPU (cudaGetDeviceCount failed or found none): the NCCL transport " \
                                  "needs one; tools/gpu-session runs this on a GPU machine"

std::vector<std::byte> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> bytes(n);
  for (auto& b : bytes) b = static_cast<std::byte>(rng() | 1);
  return bytes;
}

// A device buffer freed with the test.
struct DeviceBytes {
  explicit DeviceBytes(size_t n) : size(n) { EXPECT_EQ(cudaMalloc(&data, n), cudaSuccess); }
  ~DeviceBytes() { cudaFree(data); }
  std::span<std::byte> span() { return {static_cast<std::byte*>(data), size}; }
  void* data = nullptr;
  size_t size;
};

TEST(NcclCommunicator, SendsToItselfOnOneDevice) {
  SKIP_WITHOUT_GPU();
  auto comm = NcclCommunicator::CreateSingleDevice(0);
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  EXPECT_EQ((*comm)->buffer_space(), BufferSpace::kDevice);
  for (size_t bytes : {size_t{1}, size_t{4096}, (size_t{64} << 20) + 7}) {
    const auto payload = RandomBytes(bytes, bytes);
    DeviceBytes source(bytes), target(bytes);
    ASSERT_EQ(cudaMemcpy(source.data, payload.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
    auto send = (*comm)->ISend(0, 3, source.span());
    auto recv = (*comm)->IRecv(0, 3, target.span());
    ASSERT_TRUE(send.ok() && recv.ok());
    Status st = (*comm)->Wait(std::move(recv).value(), 30.0);
    ASSERT_TRUE(st.ok()) << st.ToString();
    ASSERT_TRUE((*comm)->Wait(std::move(send).value(), 30.0).ok());
    std::vector<std::byte> got(bytes);
    ASSERT_EQ(cudaMemcpy(got.data(), target.data, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_TRUE(got == payload) << bytes << " bytes";
  }
}

// The chain's ordering on a device transport: the payload is produced on another stream, the
// communicator is ordered after that stream's event (no host wait), Poll launches the posted pair
// at once, and the receive holds the produced bytes, not the buffer's earlier ones.
TEST(NcclCommunicator, OrdersAfterADeviceEventAndLaunchesOnPoll) {
  SKIP_WITHOUT_GPU();
  auto comm = NcclCommunicator::CreateSingleDevice(0);
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  const size_t bytes = size_t{32} << 20;
  const auto payload = RandomBytes(bytes, 17);
  std::vector<std::byte> pinned_copy(payload);
  DeviceBytes source(bytes), target(bytes);
  ASSERT_EQ(cudaMemset(source.data, 0, bytes), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaStream_t producer = nullptr;
  cudaEvent_t produced = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&producer, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&produced, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(source.data, pinned_copy.data(), bytes, cudaMemcpyHostToDevice, producer), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(produced, producer), cudaSuccess);
  ASSERT_TRUE((*comm)->OrderAfter(produced).ok());
  auto send = (*comm)->ISend(0, 4, source.span());
  auto recv = (*comm)->IRecv(0, 4, target.span());
  ASSERT_TRUE(send.ok() && recv.ok());
  (*comm)->Poll();
  Status st = (*comm)->Wait(std::move(recv).value(), 30.0);
  ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_TRUE((*comm)->Wait(std::move(send).value(), 30.0).ok());
  std::vector<std::byte> got(bytes);
  ASSERT_EQ(cudaMemcpy(got.data(), target.data, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(got == payload) << "the send read the buffer before the producer's copy finished";
  cudaEventDestroy(produced);
  cudaStreamDestroy(producer);
}

TEST(NcclCommunicator, AllGatherAndBarrierOnOneRank) {
  SKIP_WITHOUT_GPU();
  auto comm = NcclCommunicator::CreateSingleDevice(0);
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  const auto payload = RandomBytes(1000, 5);
  DeviceBytes mine(1000), all(1000);
  ASSERT_EQ(cudaMemcpy(mine.data, payload.data(), 1000, cudaMemcpyHostToDevice), cudaSuccess);
  Status st = (*comm)->AllGather(mine.span(), all.span(), 30.0);
  ASSERT_TRUE(st.ok()) << st.ToString();
  std::vector<std::byte> got(1000);
  ASSERT_EQ(cudaMemcpy(got.data(), all.data, 1000, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, payload);
  st = (*comm)->Barrier(30.0);
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ((*comm)->ISend(1, 0, mine.span()).status().code(), StatusCode::kInvalidArgument);
}

// A world of one sums to itself: the values come back unchanged in every element type, after the
// event the caller's stream recorded (tensor parallelism's path on one GPU; two GPUs:
// tests/distributed/test_mpi_model_parallel.cc under mpirun -np 2).
TEST(NcclCommunicator, AllReduceOnDeviceOnOneRankKeepsTheValues) {
  SKIP_WITHOUT_GPU();
  auto comm = NcclCommunicator::CreateSingleDevice(0);
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  for (const DeviceElement element : {DeviceElement::kF32, DeviceElement::kF16, DeviceElement::kBF16}) {
    const size_t width = element == DeviceElement::kF32 ? 4 : 2, count = 3000;
    auto payload = RandomBytes(count * width, 11);
    for (size_t i = 0; i < count; ++i) {  // finite values: clear each element's top exponent bit
      payload[i * width + width - 1] &= std::byte{0x3f};
    }
    DeviceBytes data(count * width);
    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    cudaEvent_t written;
    ASSERT_EQ(cudaEventCreateWithFlags(&written, cudaEventDisableTiming), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(data.data, payload.data(), payload.size(), cudaMemcpyHostToDevice, stream), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(written, stream), cudaSuccess);
    ASSERT_TRUE((*comm)->OrderAfter(written).ok());
    Status st = (*comm)->AllReduceSumOnDevice(data.data, static_cast<int64_t>(count), element, 30.0);
    ASSERT_TRUE(st.ok()) << st.ToString();
    std::vector<std::byte> got(payload.size());
    ASSERT_EQ(cudaMemcpy(got.data(), data.data, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(got, payload) << "element type " << static_cast<int>(element);
    cudaEventDestroy(written);
    cudaStreamDestroy(stream);
  }
  EXPECT_EQ((*comm)->AllReduceSumOnDevice(nullptr, 4, DeviceElement::kF32, 1.0).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvflow::dist
