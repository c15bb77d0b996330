#include "distributed/in_process_communicator.h"

#include "distributed/deadline.h"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <tuple>

namespace kvflow::dist {

namespace {

// A posted receive; owned by its handle, listed in its mailbox until a message matches it.
struct PostedRecv {
  std::span<std::byte> dest;
  bool matched = false;
  Status result;
};

struct Mailbox {
  std::deque<std::vector<std::byte>> unmatched;  // sent before any receive was posted for them
  std::deque<PostedRecv*> waiting;               // posted before any message came for them
};

}  // namespace

struct InProcessWorldState {
  explicit InProcessWorldState(int size) : gone(static_cast<size_t>(size), false) {}

  Mailbox& Box(int src, int dst, int tag) { return mailboxes[std::make_tuple(src, dst, tag)]; }

  std::mutex mu;
  std::condition_variable changed;  // a message was matched or a rank left
  std::vector<bool> gone;
  std::map<std::tuple<int, int, int>, Mailbox> mailboxes;  // (source, destination, tag)
};

namespace {

// Copies a message into the receive it matched (under the world's lock); a message of another
// size than the receive expects is the receive's error.
void Deliver(PostedRecv& recv, std::span<const std::byte> message, int src, int dst, int tag) {
  recv.matched = true;
  if (message.size() != recv.dest.size()) {
    recv.result = Status::InvalidArgument(
        fmt::format("in-process rank {} expected {} bytes from rank {} ({}) but the message has {}", dst,
                    recv.dest.size(), src, TagName(tag), message.size()));
    return;
  }
  if (!message.empty()) std::memcpy(recv.dest.data(), message.data(), message.size());
}

class InProcessMessage final : public PendingMessage {
 public:
  InProcessMessage(std::shared_ptr<InProcessWorldState> world, const InProcessCommunicator* owner, int peer,
                   int tag, std::unique_ptr<PostedRecv> recv)
      : world_(std::move(world)), owner_(owner), self_(owner->rank()), peer_(peer), tag_(tag), recv_(std::move(recv)) {}

  ~InProcessMessage() override {
    if (recv_ == nullptr) return;
    std::lock_guard lock(world_->mu);
    if (recv_->matched) return;
    auto& waiting = world_->Box(peer_, self_, tag_).waiting;
    waiting.erase(std::remove(waiting.begin(), waiting.end(), recv_.get()), waiting.end());
  }

  const InProcessCommunicator* owner() const { return owner_; }
  int peer() const { return peer_; }
  int tag() const { return tag_; }
  PostedRecv* recv() const { return recv_.get(); }  // null for a send (finished when posted)

 private:
  std::shared_ptr<InProcessWorldState> world_;
  const InProcessCommunicator* owner_;  // compared, never dereferenced: it may be gone first
  int self_;
  int peer_;
  int tag_;
  std::unique_ptr<PostedRecv> recv_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> InProcessWorld::Create(int size) {
  auto world = std::make_shared<InProcessWorldState>(size);
  std::vector<std::unique_ptr<Communicator>> ranks;
  for (int r = 0; r < size; ++r) ranks.push_back(std::make_unique<InProcessCommunicator>(world, r));
  return ranks;
}

InProcessCommunicator::InProcessCommunicator(std::shared_ptr<InProcessWorldState> world, int rank)
    : world_(std::move(world)), rank_(rank) {}

InProcessCommunicator::~InProcessCommunicator() { MarkGone(); }

int InProcessCommunicator::size() const { return static_cast<int>(world_->gone.size()); }

std::string InProcessCommunicator::Describe() const { return fmt::format("in-process rank {} of {}", rank_, size()); }

void InProcessCommunicator::MarkGone() {
  {
    std::lock_guard lock(world_->mu);
    world_->gone[static_cast<size_t>(rank_)] = true;
  }
  world_->changed.notify_all();
}

Result<MessageHandle> InProcessCommunicator::ISend(int peer, int tag, std::span<const std::byte> data) {
  KVFLOW_RETURN_IF_ERROR(ValidatePeer(*this, peer, tag));
  return PostSend(peer, tag, data);
}

Result<MessageHandle> InProcessCommunicator::IRecv(int peer, int tag, std::span<std::byte> data) {
  KVFLOW_RETURN_IF_ERROR(ValidatePeer(*this, peer, tag));
  return PostRecv(peer, tag, data);
}

Result<MessageHandle> InProcessCommunicator::PostSend(int peer, int tag, std::span<const std::byte> data) {
  {
    std::lock_guard lock(world_->mu);
    for (int r : {rank_, peer}) {
      if (world_->gone[static_cast<size_t>(r)]) {
        return Status::Unavailable(fmt::format("{}: cannot send to rank {} ({}): rank {} is gone", Describe(), peer,
                                               TagName(tag), r));
      }
    }
    Mailbox& box = world_->Box(rank_, peer, tag);
    if (box.waiting.empty()) {
      box.unmatched.emplace_back(data.begin(), data.end());
    } else {
      Deliver(*box.waiting.front(), data, rank_, peer, tag);
      box.waiting.pop_front();
    }
  }
  world_->changed.notify_all();
  return MessageHandle(std::make_unique<InProcessMessage>(world_, this, peer, tag, nullptr));
}

Result<MessageHandle> InProcessCommunicator::PostRecv(int peer, int tag, std::span<std::byte> data) {
  auto recv = std::make_unique<PostedRecv>();
  recv->dest = data;
  {
    std::lock_guard lock(world_->mu);
    Mailbox& box = world_->Box(peer, rank_, tag);
    if (box.unmatched.empty()) {
      box.waiting.push_back(recv.get());
    } else {
      Deliver(*recv, box.unmatched.front(), peer, rank_, tag);
      box.unmatched.pop_front();
    }
  }
  return MessageHandle(std::make_unique<InProcessMessage>(world_, this, peer, tag, std::move(recv)));
}

Status InProcessCommunicator::Wait(MessageHandle handle, double timeout_s) {
  auto* message = dynamic_cast<InProcessMessage*>(handle.get());
  if (message == nullptr || message->owner() != this) {
    return Status::InvalidArgument(fmt::format("{}: Wait on a handle of another communicator", Describe()));
  }
  PostedRecv* recv = message->recv();
  if (recv == nullptr) return Status::Ok();  // the bytes were copied when it was posted

  const int peer = message->peer();
  std::unique_lock lock(world_->mu);
  const bool done = world_->changed.wait_until(lock, DeadlineAfter(timeout_s), [&] {
    return recv->matched || world_->gone[static_cast<size_t>(peer)];
  });
  if (recv->matched) return recv->result;
  if (done) {
    return Status::Unavailable(fmt::format("{}: rank {} is gone; it never sent the message rank {} waits for ({})",
                                           Describe(), peer, rank_, TagName(message->tag())));
  }
  return Status::Unavailable(fmt::format("{}: rank {} waited {:.1f} s for rank {} ({}); no message came", Describe(),
                                         rank_, timeout_s, peer, TagName(message->tag())));
}

Status InProcessCommunicator::Exchange(int tag, std::span<const std::byte> mine, std::span<std::byte> all,
                                       double timeout_s) {
  const auto deadline = DeadlineAfter(timeout_s);
  const size_t part = mine.size();
  if (part > 0) std::memcpy(all.data() + static_cast<size_t>(rank_) * part, mine.data(), part);
  std::vector<MessageHandle> recvs;
  for (int peer = 0; peer < size(); ++peer) {
    if (peer == rank_) continue;
    KVFLOW_ASSIGN_OR_RETURN(MessageHandle recv, PostRecv(peer, tag, all.subspan(static_cast<size_t>(peer) * part, part)));
    recvs.push_back(std::move(recv));
  }
  for (int peer = 0; peer < size(); ++peer) {
    if (peer == rank_) continue;
    KVFLOW_RETURN_IF_ERROR(PostSend(peer, tag, mine).status());
  }
  for (MessageHandle& recv : recvs) KVFLOW_RETURN_IF_ERROR(Wait(std::move(recv), SecondsLeft(deadline)));
  return Status::Ok();
}

Status InProcessCommunicator::AllGather(std::span<const std::byte> mine, std::span<std::byte> all,
                                        double timeout_s) {
  if (all.size() != mine.size() * static_cast<size_t>(size())) {
    return Status::InvalidArgument(fmt::format("{}: all-gather of {} bytes per rank needs {} bytes, got {}",
                                               Describe(), mine.size(), mine.size() * static_cast<size_t>(size()),
                                               all.size()));
  }
  return Exchange(kAllGatherTag, mine, all, timeout_s);
}

Status InProcessCommunicator::Barrier(double timeout_s) { return Exchange(kBarrierTag, {}, {}, timeout_s); }

}  // namespace kvflow::dist
