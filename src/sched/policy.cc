#include "sched/policy.h"

#include <algorithm>
#include <bit>

namespace kvflow {

int64_t SchedulingPolicy::AdmissionReservation(const SequenceGroup&, const SchedSequence& seq, int64_t) const {
  return seq.num_tokens();
}

int64_t SchedulingPolicy::GrowReservation(const SequenceGroup&, const SchedSequence&, int64_t needed,
                                          int64_t) const {
  return needed;
}

bool SchedulingPolicy::Before(const SequenceGroup& a, const SequenceGroup& b) const {
  if (a.arrival_time != b.arrival_time) return a.arrival_time < b.arrival_time;
  return a.request_id < b.request_id;
}

std::string_view OrcaPolicy::name() const {
  switch (kind_) {
    case Kind::kMax: return "orca-max";
    case Kind::kPow2: return "orca-pow2";
    case Kind::kOracle: return "orca-oracle";
  }
  return "orca";
}

int64_t OrcaPolicy::AdmissionReservation(const SequenceGroup& group, const SchedSequence& seq,
                                         int64_t max_model_len) const {
  if (kind_ == Kind::kMax) return max_model_len;
  const int64_t out = std::max<int64_t>(1, group.true_output_len.value_or(group.max_output_tokens));
  const int64_t reserve = kind_ == Kind::kPow2 ? static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(out))) : out;
  return std::min(seq.prompt_len + reserve, max_model_len);
}

Result<std::unique_ptr<SchedulingPolicy>> MakeSchedulingPolicy(std::string_view name) {
  if (name == "paged" || name == "fcfs") return std::unique_ptr<SchedulingPolicy>(new PagedPolicy());
  if (name == "orca-max") return std::unique_ptr<SchedulingPolicy>(new OrcaPolicy(OrcaPolicy::Kind::kMax));
  if (name == "orca-pow2") return std::unique_ptr<SchedulingPolicy>(new OrcaPolicy(OrcaPolicy::Kind::kPow2));
  if (name == "orca-oracle") return std::unique_ptr<SchedulingPolicy>(new OrcaPolicy(OrcaPolicy::Kind::kOracle));
  std::string known;
  for (const auto& n : SchedulingPolicyNames()) known += (known.empty() ? "" : ", ") + n;
  return Status::InvalidArgument("unknown scheduling policy '" + std::string(name) + "' (known: " + known + ")");
}

std::vector<std::string> SchedulingPolicyNames() { return {"paged", "orca-max", "orca-pow2", "orca-oracle"}; }

}  // namespace kvflow
