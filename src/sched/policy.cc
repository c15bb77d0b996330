#include "sched/policy.h"

#include <algorithm>
#include <bit>
#include <climits>
#include <optional>

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

int64_t S3Policy::Reservation(const SequenceGroup& group, int64_t max_model_len) const {
  const int64_t prompt = group.prompt_len();
  // A request never outgrows its own max_tokens, whatever the prediction says.
  const int64_t ceiling = std::min(max_model_len, prompt + std::max<int64_t>(1, group.max_output_tokens));
  const std::optional<int64_t> out = oracle_ ? group.true_output_len : group.predicted_output_len;
  int64_t reserve = std::min(ceiling, prompt + std::max<int64_t>(1, out.value_or(group.max_output_tokens)));
  // S3's supervisor doubles the reservation of a sequence each time it runs out.
  for (int i = 0; i < group.reservation_misses && reserve < ceiling; ++i) reserve *= 2;
  return std::min(reserve, ceiling);
}

int64_t S3Policy::AdmissionReservation(const SequenceGroup& group, const SchedSequence&, int64_t max_model_len) const {
  return Reservation(group, max_model_len);
}

int64_t S3Policy::GrowReservation(const SequenceGroup& group, const SchedSequence&, int64_t needed,
                                  int64_t max_model_len) const {
  // Growth happens only up to the reservation (a group swapped back in after a miss) or, when the
  // reservation cannot grow any more, on demand.
  return std::max(needed, Reservation(group, max_model_len));
}

bool S3Policy::Before(const SequenceGroup& a, const SequenceGroup& b) const {
  // First-fit decreasing: the largest KV reservation first (all of the group's sequences).
  const int64_t ka = Reservation(a, INT64_MAX) * a.max_running_seqs();
  const int64_t kb = Reservation(b, INT64_MAX) * b.max_running_seqs();
  if (ka != kb) return ka > kb;
  return SchedulingPolicy::Before(a, b);
}

Result<std::unique_ptr<SchedulingPolicy>> MakeSchedulingPolicy(std::string_view name) {
  if (name == "paged" || name == "fcfs") return std::unique_ptr<SchedulingPolicy>(new PagedPolicy());
  if (name == "orca-max") return std::unique_ptr<SchedulingPolicy>(new OrcaPolicy(OrcaPolicy::Kind::kMax));
  if (name == "orca-pow2") return std::unique_ptr<SchedulingPolicy>(new OrcaPolicy(OrcaPolicy::Kind::kPow2));
  if (name == "orca-oracle") return std::unique_ptr<SchedulingPolicy>(new OrcaPolicy(OrcaPolicy::Kind::kOracle));
  if (name == "s3") return std::unique_ptr<SchedulingPolicy>(new S3Policy(/*oracle=*/false));
  if (name == "s3-oracle") return std::unique_ptr<SchedulingPolicy>(new S3Policy(/*oracle=*/true));
  std::string known;
  for (const auto& n : SchedulingPolicyNames()) known += (known.empty() ? "" : ", ") + n;
  return Status::InvalidArgument("unknown scheduling policy '" + std::string(name) + "' (known: " + known + ")");
}

std::vector<std::string> SchedulingPolicyNames() {
  return {"paged", "s3", "orca-max", "orca-pow2", "orca-oracle", "s3-oracle"};
}

}  // namespace kvflow
