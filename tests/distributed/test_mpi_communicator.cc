// The MPI transport over real processes (mpirun -np 2..4, see tests/CMakeLists.txt): point-to-point
// with random payloads, messages larger than a chunk and than 64 MiB, all-gather, barrier, size
// mismatches, and a timeout on a receive that nobody sends. Every rank runs every test.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "distributed/mpi/mpi_communicator.h"
#include "distributed/world.h"

namespace kvflow::dist {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<std::byte> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> bytes(n);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t word = rng() | 0x0101010101010101ull;  // no zero bytes
    std::memcpy(bytes.data() + i, &word, std::min<size_t>(8, n - i));
  }
  return bytes;
}

std::unique_ptr<MpiCommunicator> Open(MpiCommunicatorOptions options = {}) {
  auto comm = MpiCommunicator::Create(options);
  EXPECT_TRUE(comm.ok()) << comm.status().ToString();
  return comm.ok() ? std::move(comm).value() : nullptr;
}

TEST(MpiCommunicator, RingOfRandomPayloadsUnderSeveralTags) {
  auto comm = Open();
  ASSERT_NE(comm, nullptr);
  ASSERT_GE(comm->size(), 2) << "run under mpirun -np 2 or more";
  const int me = comm->rank(), n = comm->size();
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  auto payload = [](int from, int tag, int i) {
    return RandomBytes(1 + static_cast<size_t>(1000 * tag + 77 * i + from), 7000 + 100 * from + 10 * tag + i);
  };
  std::vector<MessageHandle> sends;
  std::vector<std::vector<std::byte>> outgoing;
  for (int i = 0; i < 3; ++i) {
    for (int tag = 0; tag < 4; ++tag) outgoing.push_back(payload(me, tag, i));
  }
  for (int i = 0, k = 0; i < 3; ++i) {
    for (int tag = 0; tag < 4; ++tag, ++k) {
      auto send = comm->ISend(right, tag, outgoing[static_cast<size_t>(k)]);
      ASSERT_TRUE(send.ok()) << send.status().ToString();
      sends.push_back(std::move(send).value());
    }
  }
  for (int tag = 3; tag >= 0; --tag) {  // tags are independent queues, each in the order sent
    for (int i = 0; i < 3; ++i) {
      const auto expected = payload(left, tag, i);
      std::vector<std::byte> got(expected.size());
      Status st = comm->Recv(left, tag, got, 30.0);
      ASSERT_TRUE(st.ok()) << st.ToString();
      EXPECT_EQ(got, expected) << "tag " << tag << " message " << i;
    }
  }
  for (auto& send : sends) EXPECT_TRUE(comm->Wait(std::move(send), 30.0).ok());
}

TEST(MpiCommunicator, MessagesOverSixtyFourMiBWholeAndInChunks) {
  for (size_t chunk : {size_t{1} << 30, size_t{1} << 20}) {
    auto comm = Open({.max_chunk_bytes = chunk});
    ASSERT_NE(comm, nullptr);
    const size_t bytes = (size_t{64} << 20) + 12345;
    const auto payload = RandomBytes(bytes, 42 + chunk);
    const auto start = Clock::now();
    if (comm->rank() == 0) {
      Status st = comm->Send(1, 9, payload, 60.0);
      EXPECT_TRUE(st.ok()) << st.ToString();
    } else if (comm->rank() == 1) {
      std::vector<std::byte> got(bytes);
      Status st = comm->Recv(0, 9, got, 60.0);
      ASSERT_TRUE(st.ok()) << st.ToString();
      EXPECT_TRUE(got == payload) << "the " << bytes << "-byte message arrived altered (chunks of " << chunk << ")";
      std::printf("[rank 1] %zu bytes in chunks of %zu: %.3f s\n", bytes, chunk,
                  std::chrono::duration<double>(Clock::now() - start).count());
    }
    EXPECT_TRUE(comm->Barrier(60.0).ok());
  }
}

TEST(MpiCommunicator, AllGatherPutsEveryRanksPartInRankOrder) {
  // Parts below and above the chunk size (the latter through a derived datatype).
  for (size_t part : {size_t{1}, size_t{4096}, (size_t{3} << 20) + 7}) {
    auto comm = Open({.max_chunk_bytes = size_t{1} << 20});
    ASSERT_NE(comm, nullptr);
    const int n = comm->size();
    const auto mine = RandomBytes(part, 500 + part + static_cast<size_t>(comm->rank()));
    std::vector<std::byte> all(part * static_cast<size_t>(n));
    Status st = comm->AllGather(mine, all, 60.0);
    ASSERT_TRUE(st.ok()) << st.ToString();
    for (int r = 0; r < n; ++r) {
      const auto expected = RandomBytes(part, 500 + part + static_cast<size_t>(r));
      EXPECT_TRUE(std::equal(expected.begin(), expected.end(), all.begin() + static_cast<ptrdiff_t>(part) * r))
          << "part of rank " << r << " (" << part << " bytes)";
    }
  }
}

TEST(MpiCommunicator, BarrierWaitsForTheLastRank) {
  auto comm = Open();
  ASSERT_NE(comm, nullptr);
  const bool last = comm->rank() == comm->size() - 1;
  const auto start = Clock::now();
  if (last) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  Status st = comm->Barrier(30.0);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_GE(std::chrono::duration<double>(Clock::now() - start).count(), 0.15);
}

TEST(MpiCommunicator, SizeMismatchIsAnError) {
  auto comm = Open();
  ASSERT_NE(comm, nullptr);
  if (comm->rank() == 0) {
    EXPECT_TRUE(comm->Send(1, 1, RandomBytes(100, 1), 30.0).ok());  // longer than rank 1 expects
    EXPECT_TRUE(comm->Send(1, 2, RandomBytes(32, 2), 30.0).ok());   // shorter
  } else if (comm->rank() == 1) {
    std::vector<std::byte> got(64);
    Status longer = comm->Recv(0, 1, got, 30.0);
    EXPECT_EQ(longer.code(), StatusCode::kInvalidArgument) << longer.ToString();
    Status shorter = comm->Recv(0, 2, got, 30.0);
    EXPECT_EQ(shorter.code(), StatusCode::kInvalidArgument) << shorter.ToString();
  }
  EXPECT_TRUE(comm->Barrier(30.0).ok());
}

TEST(MpiCommunicator, ReceiveThatNobodySendsTimesOutNamingThePeer) {
  auto comm = Open();
  ASSERT_NE(comm, nullptr);
  const int peer = (comm->rank() + 1) % comm->size();
  std::vector<std::byte> got(16);
  const auto start = Clock::now();
  Status st = comm->Recv(peer, 99, got, 0.3);
  const double waited = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("waited 0.3 s for rank " + std::to_string(peer) + " (tag 99)"), std::string::npos)
      << st.message();
  EXPECT_GE(waited, 0.29);
  EXPECT_LT(waited, 5.0);
  // The receive was cancelled: the communicator still works.
  Status barrier = comm->Barrier(30.0);
  EXPECT_TRUE(barrier.ok()) << barrier.ToString();
}

TEST(MpiCommunicator, RejectsBadPeersAndTags) {
  auto comm = Open();
  ASSERT_NE(comm, nullptr);
  std::vector<std::byte> buf(4);
  EXPECT_EQ(comm->ISend(comm->size(), 0, buf).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(comm->IRecv(0, -1, buf).status().code(), StatusCode::kInvalidArgument);
  std::vector<std::byte> wrong(3);
  EXPECT_EQ(comm->AllGather(buf, wrong, 1.0).code(), StatusCode::kInvalidArgument);
}

TEST(MpiCommunicator, OpenWorldCommunicatorIsTheMpiWorldUnderMpirun) {
  EXPECT_TRUE(LaunchedByMpi());
  auto world = OpenWorldCommunicator();
  ASSERT_TRUE(world.ok()) << world.status().ToString();
  EXPECT_GE((*world)->size(), 2);
  EXPECT_EQ((*world)->Describe().rfind("mpi rank ", 0), 0u) << (*world)->Describe();
  EXPECT_TRUE((*world)->Barrier(30.0).ok());
}

}  // namespace
}  // namespace kvflow::dist
