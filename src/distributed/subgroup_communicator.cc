#include "distributed/subgroup_communicator.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include <spdlog/fmt/fmt.h>

namespace kvflow::dist {
namespace {

// The group's own tags for its collectives (shifted by tag_offset like every other).
constexpr int kAllGatherTag = 0;

}  // namespace

Result<std::unique_ptr<SubgroupCommunicator>> SubgroupCommunicator::Create(Communicator& parent, std::vector<int> members,
                                                                           int tag_offset) {
  if (members.empty()) return Status::InvalidArgument("a subgroup needs at least one rank");
  if (tag_offset < 0) return Status::InvalidArgument("a subgroup's tag offset must not be negative");
  std::vector<int> sorted = members;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end() || sorted.front() < 0 ||
      sorted.back() >= parent.size()) {
    return Status::InvalidArgument(fmt::format("a subgroup's ranks must be distinct ranks of {}", parent.Describe()));
  }
  const auto mine = std::find(members.begin(), members.end(), parent.rank());
  if (mine == members.end()) {
    return Status::InvalidArgument(fmt::format("{} is not a member of the subgroup", parent.Describe()));
  }
  const int rank = static_cast<int>(mine - members.begin());
  return std::unique_ptr<SubgroupCommunicator>(new SubgroupCommunicator(parent, std::move(members), rank, tag_offset));
}

std::string SubgroupCommunicator::Describe() const {
  std::string ranks;
  for (int m : members_) ranks += (ranks.empty() ? "" : ",") + std::to_string(m);
  return fmt::format("group rank {} of {} (ranks {} of {})", rank_, size(), ranks, parent_.Describe());
}

Result<MessageHandle> SubgroupCommunicator::ISend(int peer, int tag, std::span<const std::byte> data) {
  KVFLOW_RETURN_IF_ERROR(ValidatePeer(*this, peer, tag));
  return parent_.ISend(members_[static_cast<size_t>(peer)], tag + tag_offset_, data);
}

Result<MessageHandle> SubgroupCommunicator::IRecv(int peer, int tag, std::span<std::byte> data) {
  KVFLOW_RETURN_IF_ERROR(ValidatePeer(*this, peer, tag));
  return parent_.IRecv(members_[static_cast<size_t>(peer)], tag + tag_offset_, data);
}

Status SubgroupCommunicator::Wait(MessageHandle handle, double timeout_s) { return parent_.Wait(std::move(handle), timeout_s); }

Status SubgroupCommunicator::AllGather(std::span<const std::byte> mine, std::span<std::byte> all, double timeout_s) {
  const size_t n = mine.size();
  if (all.size() != n * members_.size()) {
    return Status::InvalidArgument(fmt::format("{}: all-gather of {} bytes a rank into {} bytes", Describe(), n, all.size()));
  }
  std::memcpy(all.data() + n * static_cast<size_t>(rank_), mine.data(), n);
  if (size() == 1) return Status::Ok();
  // Every receive posted before any send, so no rank's send waits on a receive not yet posted.
  std::vector<MessageHandle> pending;
  Status st = Status::Ok();
  for (int r = 0; r < size() && st.ok(); ++r) {
    if (r == rank_) continue;
    auto h = IRecv(r, kAllGatherTag, all.subspan(n * static_cast<size_t>(r), n));
    if (h.ok()) pending.push_back(std::move(h).value()); else st = h.status();
  }
  for (int r = 0; r < size() && st.ok(); ++r) {
    if (r == rank_) continue;
    auto h = ISend(r, kAllGatherTag, mine);
    if (h.ok()) pending.push_back(std::move(h).value()); else st = h.status();
  }
  for (MessageHandle& h : pending) {
    Status w = Wait(std::move(h), timeout_s);
    if (st.ok() && !w.ok()) st = w;
  }
  return st;
}

Status SubgroupCommunicator::Barrier(double timeout_s) {
  const std::byte mine{1};
  std::vector<std::byte> all(members_.size());
  return AllGather(std::span<const std::byte>(&mine, 1), all, timeout_s);
}

}  // namespace kvflow::dist
