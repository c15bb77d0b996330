// The in-process transport of the Communicator interface (ranks on threads): point-to-point with
// random payloads and tags, ordering, overlap, collectives with 2-4 ranks, and the failure paths
// (size mismatch, timeout, a rank that is gone, bad arguments).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <random>
#include <thread>

#include "distributed/in_process_communicator.h"
#include "distributed/world.h"

namespace kvflow::dist {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<std::byte> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> bytes(n);
  for (auto& b : bytes) b = static_cast<std::byte>(rng() | 1);  // never all zeros
  return bytes;
}

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Runs body(rank's communicator) on one thread per rank and joins them.
void RunRanks(std::vector<std::unique_ptr<Communicator>>& world, const std::function<void(Communicator&)>& body) {
  std::vector<std::thread> threads;
  for (auto& comm : world) threads.emplace_back([&body, c = comm.get()] { body(*c); });
  for (auto& t : threads) t.join();
}

TEST(InProcessCommunicator, PointToPointRandomPayloadsUnderSeveralTags) {
  auto world = InProcessWorld::Create(2);
  constexpr int kTags = 3, kMessages = 4;
  auto payload = [](int tag, int i) { return RandomBytes(1 + static_cast<size_t>(97 * tag + 31 * i), 1000 + 10 * tag + i); };
  RunRanks(world, [&](Communicator& comm) {
    if (comm.rank() == 0) {
      for (int i = 0; i < kMessages; ++i) {
        for (int tag = 0; tag < kTags; ++tag) EXPECT_TRUE(comm.Send(1, tag, payload(tag, i), 5.0).ok());
      }
      return;
    }
    // Tags are independent queues: drain them last tag first, each in the order sent.
    for (int tag = kTags - 1; tag >= 0; --tag) {
      for (int i = 0; i < kMessages; ++i) {
        const auto expected = payload(tag, i);
        std::vector<std::byte> got(expected.size());
        Status st = comm.Recv(0, tag, got, 5.0);
        ASSERT_TRUE(st.ok()) << st.ToString();
        EXPECT_EQ(got, expected) << "tag " << tag << " message " << i;
      }
    }
  });
}

TEST(InProcessCommunicator, ReceivesMatchInPostingOrderWhateverTheWaitOrder) {
  auto world = InProcessWorld::Create(2);
  auto first = RandomBytes(64, 1), second = RandomBytes(64, 2);
  std::vector<std::byte> a(64), b(64);
  auto recv_a = world[1]->IRecv(0, 5, a);
  auto recv_b = world[1]->IRecv(0, 5, b);
  ASSERT_TRUE(recv_a.ok() && recv_b.ok());
  ASSERT_TRUE(world[0]->Send(1, 5, first).ok());
  ASSERT_TRUE(world[0]->Send(1, 5, second).ok());
  ASSERT_TRUE(world[1]->Wait(std::move(recv_b).value(), 1.0).ok());
  ASSERT_TRUE(world[1]->Wait(std::move(recv_a).value(), 1.0).ok());
  EXPECT_EQ(a, first);
  EXPECT_EQ(b, second);
}

TEST(InProcessCommunicator, RingExchangeOverlapsSendsAndReceives) {
  for (int size : {2, 3, 4}) {
    auto world = InProcessWorld::Create(size);
    RunRanks(world, [&](Communicator& comm) {
      const int right = (comm.rank() + 1) % size, left = (comm.rank() + size - 1) % size;
      std::vector<std::byte> from_left(4096);
      auto recv = comm.IRecv(left, 3, from_left);
      const auto mine = RandomBytes(4096, 50 + static_cast<uint64_t>(comm.rank()));
      auto send = comm.ISend(right, 3, mine);
      ASSERT_TRUE(recv.ok() && send.ok());
      EXPECT_TRUE(comm.Wait(std::move(send).value(), 5.0).ok());
      EXPECT_TRUE(comm.Wait(std::move(recv).value(), 5.0).ok());
      EXPECT_EQ(from_left, RandomBytes(4096, 50 + static_cast<uint64_t>(left)));
    });
  }
}

TEST(InProcessCommunicator, AllGatherAndBarrierWithTwoToFourRanks) {
  for (int size : {2, 3, 4}) {
    auto world = InProcessWorld::Create(size);
    constexpr size_t kPart = 777;
    RunRanks(world, [&](Communicator& comm) {
      for (int round = 0; round < 3; ++round) {
        const auto mine = RandomBytes(kPart, 100 * static_cast<uint64_t>(round) + static_cast<uint64_t>(comm.rank()));
        std::vector<std::byte> all(kPart * static_cast<size_t>(size));
        Status st = comm.AllGather(mine, all, 5.0);
        ASSERT_TRUE(st.ok()) << st.ToString();
        for (int r = 0; r < size; ++r) {
          const auto expected = RandomBytes(kPart, 100 * static_cast<uint64_t>(round) + static_cast<uint64_t>(r));
          EXPECT_TRUE(std::equal(expected.begin(), expected.end(), all.begin() + static_cast<ptrdiff_t>(kPart) * r))
              << "size " << size << " round " << round << " part of rank " << r;
        }
        st = comm.Barrier(5.0);
        EXPECT_TRUE(st.ok()) << st.ToString();
      }
    });
  }
}

TEST(InProcessCommunicator, BarrierHoldsEveryRankUntilTheLastArrives) {
  auto world = InProcessWorld::Create(3);
  std::atomic<int> arrived{0};
  RunRanks(world, [&](Communicator& comm) {
    if (comm.rank() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    arrived.fetch_add(1);
    EXPECT_TRUE(comm.Barrier(5.0).ok());
    EXPECT_EQ(arrived.load(), 3);
  });
}

TEST(InProcessCommunicator, SizeMismatchIsAnErrorAtWait) {
  auto world = InProcessWorld::Create(2);
  ASSERT_TRUE(world[0]->Send(1, 0, RandomBytes(12, 3)).ok());
  std::vector<std::byte> got(16);
  auto recv = world[1]->IRecv(0, 0, got);
  ASSERT_TRUE(recv.ok());
  Status st = world[1]->Wait(std::move(recv).value(), 1.0);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("expected 16 bytes"), std::string::npos) << st.message();

  std::vector<std::byte> all(3 * 8);
  EXPECT_EQ(world[0]->AllGather(RandomBytes(8, 4), all, 1.0).code(), StatusCode::kInvalidArgument);
}

TEST(InProcessCommunicator, TimeoutNamesTheSilentPeer) {
  auto world = InProcessWorld::Create(2);
  std::vector<std::byte> got(8);
  const auto start = Clock::now();
  Status st = world[1]->Recv(0, 7, got, 0.2);
  const double waited = SecondsSince(start);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("rank 1 waited 0.2 s for rank 0 (tag 7)"), std::string::npos) << st.message();
  EXPECT_GE(waited, 0.19);
  EXPECT_LT(waited, 2.0);

  // The timed-out receive is withdrawn: the next message goes to the next receive.
  const auto payload = RandomBytes(8, 9);
  ASSERT_TRUE(world[0]->Send(1, 7, payload).ok());
  ASSERT_TRUE(world[1]->Recv(0, 7, got, 1.0).ok());
  EXPECT_EQ(got, payload);

  EXPECT_EQ(world[0]->Barrier(0.2).code(), StatusCode::kUnavailable);
}

TEST(InProcessCommunicator, GoneRankFailsItsPeersPromptly) {
  auto world = InProcessWorld::Create(3);
  const auto delivered = RandomBytes(32, 11);
  ASSERT_TRUE(world[0]->Send(1, 2, delivered).ok());

  std::thread leaver([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    world[0].reset();
  });
  const auto start = Clock::now();
  std::vector<std::byte> got(32);
  Status st = world[1]->Recv(0, 4, got, 30.0);  // rank 0 leaves while rank 1 waits
  leaver.join();
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("rank 0 is gone"), std::string::npos) << st.message();
  EXPECT_LT(SecondsSince(start), 5.0);

  // What it sent before leaving is still delivered.
  ASSERT_TRUE(world[1]->Recv(0, 2, got, 30.0).ok());
  EXPECT_EQ(got, delivered);
  EXPECT_EQ(world[2]->Send(0, 1, delivered).code(), StatusCode::kUnavailable);
}

TEST(InProcessCommunicator, CollectivesFailPromptlyWhenARankIsGone) {
  auto world = InProcessWorld::Create(3);
  static_cast<InProcessCommunicator&>(*world[2]).MarkGone();
  std::vector<std::thread> survivors;
  for (int r = 0; r < 2; ++r) {
    survivors.emplace_back([&, r] {
      const auto start = Clock::now();
      std::vector<std::byte> all(3 * 4);
      Status gather = world[r]->AllGather(RandomBytes(4, 1), all, 30.0);
      EXPECT_EQ(gather.code(), StatusCode::kUnavailable);
      EXPECT_NE(gather.message().find("rank 2 is gone"), std::string::npos) << gather.message();
      Status barrier = world[r]->Barrier(30.0);
      EXPECT_EQ(barrier.code(), StatusCode::kUnavailable);
      EXPECT_NE(barrier.message().find("rank 2"), std::string::npos) << barrier.message();
      EXPECT_LT(SecondsSince(start), 5.0);
    });
  }
  for (auto& t : survivors) t.join();
}

TEST(InProcessCommunicator, RejectsBadPeersTagsAndForeignHandles) {
  auto world = InProcessWorld::Create(2);
  std::vector<std::byte> buf(4);
  EXPECT_EQ(world[0]->ISend(2, 0, buf).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(world[0]->ISend(-1, 0, buf).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(world[0]->IRecv(1, -3, buf).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidatePeer(*world[0], 1, 0).code(), StatusCode::kOk);

  auto recv = world[1]->IRecv(0, 0, buf);
  ASSERT_TRUE(recv.ok());
  EXPECT_EQ(world[0]->Wait(std::move(recv).value(), 0.1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(world[0]->Wait(nullptr, 0.1).code(), StatusCode::kInvalidArgument);
}

TEST(InProcessCommunicator, DescribesItself) {
  auto world = InProcessWorld::Create(4);
  EXPECT_EQ(world[3]->Describe(), "in-process rank 3 of 4");
  EXPECT_EQ(world[3]->size(), 4);
  EXPECT_EQ(world[3]->buffer_space(), BufferSpace::kHost);
}

TEST(InProcessCommunicator, OpenWorldCommunicatorOutsideMpirunIsAWorldOfOne) {
  if (LaunchedByMpi()) GTEST_SKIP() << "this process was started by mpirun";
  auto world = OpenWorldCommunicator();
  ASSERT_TRUE(world.ok()) << world.status().ToString();
  Communicator& comm = **world;
  EXPECT_EQ(comm.Describe(), "in-process rank 0 of 1");
  const auto payload = RandomBytes(100, 77);
  std::vector<std::byte> got(100), all(100);
  ASSERT_TRUE(comm.Send(0, 1, payload, 1.0).ok());  // to itself
  ASSERT_TRUE(comm.Recv(0, 1, got, 1.0).ok());
  EXPECT_EQ(got, payload);
  ASSERT_TRUE(comm.AllGather(payload, all, 1.0).ok());
  EXPECT_EQ(all, payload);
  EXPECT_TRUE(comm.Barrier(1.0).ok());
}

}  // namespace
}  // namespace kvflow::dist
