// KV-Runahead's chain and TSP from device buffers (kv_runahead/chain_prefill.h over a transport
// whose buffers are device memory): every rank is a thread with its own CUDA backend on its own
// device (the emulator's KVFLOW_EMU_DEVICES devices, or the GPUs there are, shared round-robin),
// the K/V packed and unpacked on the device (kernels/kv_pack.cu) and moved GPU to GPU by the CUDA
// peer transport (distributed/cuda/cuda_peer_communicator.h). The last rank's KV cache and first
// token's logits must be bit-identical to the same chain over host buffers (the in-process
// transport, PackKv through the host) and to one CUDA backend prefilling the prompt chunk by chunk
// at the same bounds. Also: the peer transport's own semantics, and a rank that is gone ends the
// prefill with an error instead of a hang.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <numeric>
#include <random>
#include <thread>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "distributed/cuda/cuda_peer_communicator.h"
#include "distributed/in_process_communicator.h"
#include "forward/llama_model.h"
#include "gpu_test_util.h"
#include "kv_runahead/chain_prefill.h"
#include "model/llama_weights.h"
#include "model/tiny_random.h"

namespace kvflow::dist {
namespace {

#ifdef KVFLOW_CUDA_EMU
// Three emulated devices, before the first CUDA call of the process.
const bool kEmulatedDevices = [] { return setenv("KVFLOW_EMU_DEVICES", "3", 0) == 0; }();
#endif

constexpr int kBlockSize = 16;
constexpr int kPoolBlocks = 24;

struct TinyModel {
  ModelConfig config;
  LlamaWeights weights;
};

const TinyModel& Model() {
  static const TinyModel* model = [] {
    auto files = MakeTinyRandomModel(0x6b76666c6f77, 4, false).value();
    auto* m = new TinyModel{files.config, LoadLlamaWeights(*files.tensors, files.config, files.gguf_rope_permuted).value()};
    return m;
  }();
  return *model;
}

std::unique_ptr<Backend> TinyCudaBackend(int device) {
  CudaBackendOptions o;
  o.device = device;
  o.dtype = "fp16";
  o.block_size = kBlockSize;
  o.num_kv_blocks = kPoolBlocks;
  o.num_host_blocks = 0;
  o.max_num_seqs = 2;
  o.max_num_batched_tokens = 256;
  o.max_model_len = kPoolBlocks * kBlockSize;
  auto backend = CreateCudaBackend(Model().config, Model().weights, o);
  EXPECT_TRUE(backend.ok()) << backend.status().ToString();
  return backend.ok() ? std::move(backend).value() : nullptr;
}

std::vector<int> RankDevices(int p) {
  const int count = cuda::DeviceCount();
  std::vector<int> devices;
  for (int r = 0; r < p; ++r) devices.push_back(r % std::max(count, 1));
  return devices;
}

std::vector<BlockId> ShuffledTable(int blocks, uint32_t seed) {
  std::vector<BlockId> all(kPoolBlocks);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), std::mt19937(seed));
  all.resize(static_cast<size_t>(blocks));
  return all;
}

// K then V of every layer at positions [0, n) of `table`, as the pool holds them (fp16 widened).
std::vector<float> ReadWholeKv(Backend& backend, const std::vector<BlockId>& table, int64_t n) {
  std::vector<int64_t> slots;
  for (int64_t pos = 0; pos < n; ++pos) slots.push_back(SlotOf(table, static_cast<int32_t>(pos), kBlockSize));
  const KvCacheLayout& layout = backend.kv_layout();
  std::vector<float> out, part(slots.size() * layout.num_kv_heads * layout.head_dim);
  for (int layer = 0; layer < layout.num_layers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      EXPECT_TRUE(backend.ReadKv(layer, kv, slots, part).ok());
      out.insert(out.end(), part.begin(), part.end());
    }
  }
  return out;
}

std::vector<int32_t> Prompt(int n) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> d(0, Model().config.vocab_size - 1);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& t : v) t = d(rng);
  return v;
}

enum class Transport { kHostBuffers, kDeviceBuffers };

struct Outcome {
  Status status;
  std::vector<float> logits;
  std::vector<float> kv;  // the last rank's whole cache
  DistributedPrefillStats stats;
};

// One thread per rank; `gone` ranks leave before they start. Returns the last rank's outcome.
Outcome RunRanks(Transport transport, PrefillMethod method, const std::vector<int64_t>& bounds,
                 std::vector<int> gone = {}, double timeout_s = 60.0) {
  const int p = static_cast<int>(bounds.size()) - 1;
  const std::vector<int> devices = RankDevices(p);
  std::vector<std::unique_ptr<Communicator>> comms;
  if (transport == Transport::kDeviceBuffers) {
    auto world = CudaPeerWorld::Create(devices);
    EXPECT_TRUE(world.ok()) << world.status().ToString();
    if (!world.ok()) return {world.status()};
    comms = std::move(world).value();
  } else {
    comms = InProcessWorld::Create(p);
  }
  std::vector<std::unique_ptr<Backend>> backends;
  for (int r = 0; r < p; ++r) {
    backends.push_back(TinyCudaBackend(devices[r]));
    if (!backends.back()) return {Status::Internal("no backend")};
  }
  const std::vector<int32_t> prompt = Prompt(static_cast<int>(bounds.back()));
  const int table_blocks = static_cast<int>((bounds.back() + kBlockSize - 1) / kBlockSize);
  std::vector<Outcome> out(static_cast<size_t>(p));
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r) {
    if (std::find(gone.begin(), gone.end(), r) != gone.end()) {
      if (auto* peer = dynamic_cast<CudaPeerCommunicator*>(comms[r].get())) peer->MarkGone();
      if (auto* local = dynamic_cast<InProcessCommunicator*>(comms[r].get())) local->MarkGone();
      continue;
    }
    threads.emplace_back([&, r] {
      const std::vector<BlockId> table = ShuffledTable(table_blocks, 1000 + r);
      DistributedPrefillOptions options;
      options.method = method;
      options.timeout_s = timeout_s;
      std::span<const int32_t> chunk(prompt.data() + bounds[r], static_cast<size_t>(bounds[r + 1] - bounds[r]));
      out[r].status = RunDistributedPrefill(*comms[r], *backends[r], chunk, bounds, table, options, out[r].logits,
                                            &out[r].stats);
      if (out[r].status.ok() && r + 1 == p) out[r].kv = ReadWholeKv(*backends[r], table, bounds.back());
    });
  }
  for (std::thread& t : threads) t.join();
  return out.back();
}

// One CUDA backend prefilling the prompt chunk by chunk at `bounds`: what every rank computes.
Outcome ChunkedSingleProcess(const std::vector<int64_t>& bounds) {
  auto backend = TinyCudaBackend(0);
  const std::vector<int32_t> prompt = Prompt(static_cast<int>(bounds.back()));
  const int p = static_cast<int>(bounds.size()) - 1;
  const std::vector<BlockId> table =
      ShuffledTable(static_cast<int>((bounds.back() + kBlockSize - 1) / kBlockSize), 1000 + p - 1);
  Outcome out;
  for (int c = 0; c < p; ++c) {
    ForwardBatch batch;
    for (int64_t pos = bounds[c]; pos < bounds[c + 1]; ++pos) {
      batch.tokens.push_back(prompt[static_cast<size_t>(pos)]);
      batch.positions.push_back(static_cast<int32_t>(pos));
    }
    SequenceSlice slice;
    slice.num_tokens = static_cast<int32_t>(bounds[c + 1] - bounds[c]);
    slice.context_len = static_cast<int32_t>(bounds[c + 1]);
    slice.block_table = table;
    slice.logits = c + 1 == p ? LogitsMode::kLast : LogitsMode::kNone;
    batch.seqs.push_back(slice);
    out.status = LlamaModel(*backend).Forward(batch, out.logits);
    if (!out.status.ok()) return out;
  }
  out.kv = ReadWholeKv(*backend, table, bounds.back());
  return out;
}

class DeviceChainPrefill : public ::testing::TestWithParam<PrefillMethod> {};

TEST_P(DeviceChainPrefill, LastRankIsBitIdenticalToTheHostBufferChain) {
  KVFLOW_SKIP_WITHOUT_GPU();
  for (const std::vector<int64_t>& bounds : {std::vector<int64_t>{0, 61, 107}, std::vector<int64_t>{0, 29, 70, 100}}) {
    const std::string what = std::string(PrefillMethodName(GetParam())) + " over " +
                             std::to_string(bounds.size() - 1) + " ranks, " + std::to_string(bounds.back()) + " tokens";
    const Outcome device = RunRanks(Transport::kDeviceBuffers, GetParam(), bounds);
    ASSERT_TRUE(device.status.ok()) << what << ": " << device.status.ToString();
    const Outcome host = RunRanks(Transport::kHostBuffers, GetParam(), bounds);
    ASSERT_TRUE(host.status.ok()) << what << ": " << host.status.ToString();
    const Outcome single = ChunkedSingleProcess(bounds);
    ASSERT_TRUE(single.status.ok()) << single.status.ToString();
    ASSERT_EQ(device.logits.size(), static_cast<size_t>(Model().config.vocab_size));
    ASSERT_FALSE(device.kv.empty());
    const auto differing = [](const std::vector<float>& a, const std::vector<float>& b) {
      size_t n = a.size() == b.size() ? 0 : std::max(a.size(), b.size());
      for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) n += a[i] != b[i];
      return n;
    };
    std::printf("  %-36s device vs host buffers: %zu of %zu KV values and %zu of %zu logits differ; vs one process "
                "chunk by chunk: %zu and %zu; %lld bytes received%s\n",
                what.c_str(), differing(device.kv, host.kv), device.kv.size(), differing(device.logits, host.logits),
                device.logits.size(), differing(device.kv, single.kv), differing(device.logits, single.logits),
                static_cast<long long>(device.stats.bytes_received), test::IsEmulator() ? "  [emulator]" : "");
    EXPECT_EQ(device.kv, host.kv) << what;
    EXPECT_EQ(device.logits, host.logits) << what;
    EXPECT_EQ(device.kv, single.kv) << what;
    EXPECT_EQ(device.logits, single.logits) << what;
    EXPECT_EQ(device.stats.bytes_received, host.stats.bytes_received) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Methods, DeviceChainPrefill, ::testing::Values(PrefillMethod::kKvRunahead, PrefillMethod::kTsp),
                         [](const auto& info) { return info.param == PrefillMethod::kTsp ? "Tsp" : "KvRunahead"; });

TEST(DeviceChainPrefill, RanksAreOnDistinctEmulatedDevices) {
  KVFLOW_SKIP_WITHOUT_GPU();
  if (!test::IsEmulator()) GTEST_SKIP() << "on a GPU the ranks share the GPUs there are";
  EXPECT_EQ(RankDevices(3), (std::vector<int>{0, 1, 2}));
}

// A backend that cannot pack into device memory (the CPU's) is refused by a device transport, with
// the reason.
TEST(DeviceChainPrefill, RefusesABackendWithoutDevicePacking) {
  KVFLOW_SKIP_WITHOUT_GPU();
  auto world = CudaPeerWorld::Create(RankDevices(2));
  ASSERT_TRUE(world.ok()) << world.status().ToString();
  KvCacheLayout layout{Model().config.num_layers, kPoolBlocks, Model().config.num_kv_heads, kBlockSize,
                       Model().config.head_dim};
  auto cpu = CpuBackend::Create(Model().config, Model().weights, layout, 0, 1, cpu::KvElement::kF16).value();
  const std::vector<int32_t> prompt = Prompt(40);
  std::vector<float> logits;
  const std::vector<int64_t> bounds = {0, 20, 40};
  const Status st = RunDistributedPrefill(*world.value()[1], *cpu, std::span(prompt).subspan(20), bounds,
                                          ShuffledTable(3, 5), DistributedPrefillOptions{}, logits);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.ToString();
  EXPECT_NE(st.message().find("packs KV on the device"), std::string::npos) << st.ToString();
}

TEST(DeviceChainPrefill, GoneRankEndsThePrefillWithAnError) {
  KVFLOW_SKIP_WITHOUT_GPU();
  const auto start = std::chrono::steady_clock::now();
  const Outcome last = RunRanks(Transport::kDeviceBuffers, PrefillMethod::kKvRunahead, {0, 40, 80}, {0}, 30.0);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(last.status.code(), StatusCode::kUnavailable) << last.status.ToString();
  EXPECT_NE(last.status.message().find("gone"), std::string::npos) << last.status.ToString();
  EXPECT_LT(seconds, 25.0) << "a gone rank is reported at once, not at the deadline";
}

// The transport alone: messages between devices, in posting order per tag, sizes checked, the
// collectives, ordering after a device event, and a silent peer timing out.
TEST(CudaPeerCommunicator, MovesDeviceBuffersBetweenRanks) {
  KVFLOW_SKIP_WITHOUT_GPU();
  const std::vector<int> devices = RankDevices(2);
  auto world = CudaPeerWorld::Create(devices);
  ASSERT_TRUE(world.ok()) << world.status().ToString();
  std::vector<std::unique_ptr<Communicator>> comms = std::move(world).value();
  EXPECT_EQ(comms[0]->buffer_space(), BufferSpace::kDevice);
  EXPECT_NE(comms[1]->Describe().find("cuda-peer rank 1 of 2"), std::string::npos) << comms[1]->Describe();
  std::vector<uint8_t> payload(1000);
  std::iota(payload.begin(), payload.end(), 0);
  std::vector<uint8_t> other(payload.rbegin(), payload.rend());
  std::vector<std::vector<uint8_t>> received(2);
  std::vector<Status> status(2);
  std::thread sender([&] {
    cudaSetDevice(devices[0]);
    test::DeviceBuffer a = test::DeviceBuffer::From(payload), b = test::DeviceBuffer::From(other);
    cudaEvent_t event = nullptr;
    cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    cudaEventRecord(event, nullptr);
    status[0] = comms[0]->OrderAfter(event);
    auto first = comms[0]->ISend(1, 5, std::as_bytes(std::span(a.get<std::byte>(), a.bytes())));
    auto second = comms[0]->ISend(1, 5, std::as_bytes(std::span(b.get<std::byte>(), b.bytes())));
    if (status[0].ok()) status[0] = first.ok() ? comms[0]->Wait(std::move(first).value(), 30) : first.status();
    if (status[0].ok()) status[0] = second.ok() ? comms[0]->Wait(std::move(second).value(), 30) : second.status();
    cudaEventDestroy(event);
  });
  std::thread receiver([&] {
    cudaSetDevice(devices[1]);
    test::DeviceBuffer x(1000), y(1000);
    x.Poison();
    y.Poison();
    auto first = comms[1]->IRecv(0, 5, std::span(x.get<std::byte>(), x.bytes()));
    auto second = comms[1]->IRecv(0, 5, std::span(y.get<std::byte>(), y.bytes()));
    status[1] = first.ok() ? comms[1]->Wait(std::move(first).value(), 30) : first.status();
    if (status[1].ok()) status[1] = second.ok() ? comms[1]->Wait(std::move(second).value(), 30) : second.status();
    received[0] = x.Download<uint8_t>();
    received[1] = y.Download<uint8_t>();
  });
  sender.join();
  receiver.join();
  ASSERT_TRUE(status[0].ok()) << status[0].ToString();
  ASSERT_TRUE(status[1].ok()) << status[1].ToString();
  EXPECT_EQ(received[0], payload) << "messages of one tag arrive in the order sent";
  EXPECT_EQ(received[1], other);

  // All-gather and barrier across both ranks.
  std::vector<std::vector<uint8_t>> gathered(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      cudaSetDevice(devices[r]);
      test::DeviceBuffer mine = test::DeviceBuffer::From(std::vector<uint8_t>(64, static_cast<uint8_t>(10 + r)));
      test::DeviceBuffer all(128);
      status[r] = comms[r]->AllGather(std::span(mine.get<std::byte>(), 64), std::span(all.get<std::byte>(), 128), 30);
      if (status[r].ok()) status[r] = comms[r]->Barrier(30);
      gathered[r] = all.Download<uint8_t>();
    });
  }
  for (auto& t : ranks) t.join();
  std::vector<uint8_t> want(64, 10);
  want.resize(128, 11);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(status[r].ok()) << status[r].ToString();
    EXPECT_EQ(gathered[r], want) << "rank " << r;
  }

  // A size mismatch is the receive's error; a silent peer times out.
  test::DeviceBuffer small(10), large(20);
  auto send = comms[0]->ISend(1, 9, std::span(large.get<std::byte>(), 20));
  auto recv = comms[1]->IRecv(0, 9, std::span(small.get<std::byte>(), 10));
  ASSERT_TRUE(send.ok() && recv.ok());
  EXPECT_EQ(comms[1]->Wait(std::move(recv).value(), 5).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(comms[0]->Wait(std::move(send).value(), 5).code(), StatusCode::kInvalidArgument);
  auto lonely = comms[1]->IRecv(0, 11, std::span(small.get<std::byte>(), 10));
  ASSERT_TRUE(lonely.ok());
  const Status timed_out = comms[1]->Wait(std::move(lonely).value(), 0.2);
  EXPECT_EQ(timed_out.code(), StatusCode::kUnavailable);
  EXPECT_NE(timed_out.message().find("no message came"), std::string::npos) << timed_out.ToString();
  EXPECT_FALSE(CudaPeerWorld::Create({0, 99}).ok()) << "a device that does not exist is refused";
}

// The device all-reduce (tensor parallelism's sums on CUDA ranks): three ranks' buffers in fp32,
// fp16 and bf16 become, on every rank, the sum in rank order in fp32 rounded once to the type.
TEST(CudaPeerCommunicator, AllReduceOnDeviceSumsInRankOrderOnEveryRank) {
  KVFLOW_SKIP_WITHOUT_GPU();
  constexpr int kRanks = 3;
  constexpr int64_t kCount = 1000;
  auto world = CudaPeerWorld::Create(RankDevices(kRanks));
  ASSERT_TRUE(world.ok()) << world.status().ToString();
  for (const DeviceElement element : {DeviceElement::kF32, DeviceElement::kF16, DeviceElement::kBF16}) {
    const cuda::DType dtype = element == DeviceElement::kF32   ? cuda::DType::kF32
                              : element == DeviceElement::kF16 ? cuda::DType::kF16
                                                               : cuda::DType::kBF16;
    std::mt19937 rng(17);
    std::vector<std::vector<float>> parts(kRanks, std::vector<float>(kCount));
    std::vector<std::vector<uint8_t>> bytes(kRanks);
    for (int r = 0; r < kRanks; ++r) {
      test::FillNormal(parts[r], rng);
      bytes[r] = test::ToDeviceBytes(parts[r], dtype);  // parts[r] now holds what the device holds
    }
    std::vector<float> sum(kCount);
    for (int64_t i = 0; i < kCount; ++i) sum[i] = parts[0][i] + parts[1][i] + parts[2][i];
    const std::vector<uint8_t> expected = test::ToDeviceBytes(sum, dtype);
    std::vector<std::vector<uint8_t>> got(kRanks);
    std::vector<Status> results(kRanks);
    std::vector<std::thread> ranks;
    for (int r = 0; r < kRanks; ++r) {
      ranks.emplace_back([&, r] {
        cudaSetDevice(RankDevices(kRanks)[r]);
        test::DeviceBuffer buffer = test::DeviceBuffer::From(bytes[r]);
        results[r] = world.value()[r]->AllReduceSumOnDevice(buffer.get(), kCount, element, 30.0);
        got[r] = buffer.Download<uint8_t>();
      });
    }
    for (std::thread& t : ranks) t.join();
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_TRUE(results[r].ok()) << results[r].ToString();
      EXPECT_EQ(got[r], expected) << "rank " << r << ", " << cuda::DTypeName(dtype);
    }
  }
  EXPECT_EQ(world.value()[0]->AllReduceSumOnDevice(nullptr, 3, DeviceElement::kF32, 1.0).code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvflow::dist
