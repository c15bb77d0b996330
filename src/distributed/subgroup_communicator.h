// Some of a communicator's ranks as a communicator of their own (MPI_Comm_split's job, over any
// transport): pipeline parallelism's tensor-parallel groups, one per stage, inside the job's world.
// Rank i of the group is member i of the parent; tags are shifted by `tag_offset` so the group's
// messages never match the parent's; the collectives run over point-to-point messages.
#pragma once

#include <string>
#include <vector>

#include "distributed/communicator.h"

namespace kvflow::dist {

class SubgroupCommunicator final : public Communicator {
 public:
  // `members`: parent ranks, each once, the parent's own rank among them. The parent must outlive
  // this; the two are used by one thread.
  static Result<std::unique_ptr<SubgroupCommunicator>> Create(Communicator& parent, std::vector<int> members,
                                                              int tag_offset);

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  std::string Describe() const override;
  BufferSpace buffer_space() const override { return parent_.buffer_space(); }
  Result<MessageHandle> ISend(int peer, int tag, std::span<const std::byte> data) override;
  Result<MessageHandle> IRecv(int peer, int tag, std::span<std::byte> data) override;
  Status Wait(MessageHandle handle, double timeout_s = kDefaultCommTimeoutSeconds) override;
  void Poll() override { parent_.Poll(); }
  Status AllGather(std::span<const std::byte> mine, std::span<std::byte> all,
                   double timeout_s = kDefaultCommTimeoutSeconds) override;
  Status Barrier(double timeout_s = kDefaultCommTimeoutSeconds) override;

 private:
  SubgroupCommunicator(Communicator& parent, std::vector<int> members, int rank, int tag_offset)
      : parent_(parent), members_(std::move(members)), rank_(rank), tag_offset_(tag_offset) {}

  Communicator& parent_;
  std::vector<int> members_;
  int rank_;
  int tag_offset_;
};

}  // namespace kvflow::dist
