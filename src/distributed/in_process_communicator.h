// A world whose ranks are threads of one process: the unit tests' transport, and the world of one
// that a process not started by mpirun runs in (OpenWorldCommunicator, world.h).
//
// Messages go through mailboxes shared by the world, one FIFO per (source, destination, tag). A
// send copies its bytes, so it finishes at once; a receive takes the messages of its key in the
// order the receives were posted (as MPI matches them). A rank whose communicator is destroyed, or
// that calls MarkGone, is gone: a wait on a message from it that was not sent yet, and every
// collective it has not contributed to, fails at once with kUnavailable naming it.
#pragma once

#include <memory>
#include <vector>

#include "distributed/communicator.h"

namespace kvflow::dist {

struct InProcessWorldState;  // the mailboxes, shared by the world's communicators and handles

class InProcessWorld {
 public:
  // `size` communicators, rank i at index i; each is to be driven by one thread. The world's state
  // lives as long as any of them (or any of their message handles).
  static std::vector<std::unique_ptr<Communicator>> Create(int size);
};

// One rank of an InProcessWorld. Thread-safety: one thread per rank at a time (the interface's
// rule); different ranks run concurrently (the shared state is locked).
class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<InProcessWorldState> world, int rank);
  ~InProcessCommunicator() override;  // marks the rank gone

  int rank() const override { return rank_; }
  int size() const override;
  std::string Describe() const override;

  Result<MessageHandle> ISend(int peer, int tag, std::span<const std::byte> data) override;
  Result<MessageHandle> IRecv(int peer, int tag, std::span<std::byte> data) override;
  Status Wait(MessageHandle handle, double timeout_s = kDefaultCommTimeoutSeconds) override;
  // Every rank sends its part to every other (internal tags), so a rank that is gone before it
  // contributed fails the collective on every other rank.
  Status AllGather(std::span<const std::byte> mine, std::span<std::byte> all,
                   double timeout_s = kDefaultCommTimeoutSeconds) override;
  Status Barrier(double timeout_s = kDefaultCommTimeoutSeconds) override;

  // This rank leaves the world (as if its process died): messages it already sent stay
  // deliverable, and waits on anything else from it fail. Idempotent.
  void MarkGone();

 private:
  // ISend / IRecv without the tag check, so collectives can use their reserved negative tags.
  Result<MessageHandle> PostSend(int peer, int tag, std::span<const std::byte> data);
  Result<MessageHandle> PostRecv(int peer, int tag, std::span<std::byte> data);
  // A collective's exchange: sends `mine` to every other rank under `tag` and receives theirs into
  // `all` (rank r's part at r * mine.size()), all within `timeout_s`.
  Status Exchange(int tag, std::span<const std::byte> mine, std::span<std::byte> all, double timeout_s);

  std::shared_ptr<InProcessWorldState> world_;
  int rank_;
};

}  // namespace kvflow::dist
