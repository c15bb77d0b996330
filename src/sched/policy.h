// Scheduling policies: how much KV a request reserves, and in which order requests are served.
// The paged policy (vLLM) reserves nothing ahead and grows block by block; the Orca baselines
// reserve a whole output up front, as contiguous-memory systems must; S3 reserves a predicted
// output and packs batches first-fit decreasing.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvflow/status.h"
#include "sched/sequence_group.h"

namespace kvflow {

class SchedulingPolicy {
 public:
  virtual ~SchedulingPolicy() = default;
  virtual std::string_view name() const = 0;

  // KV tokens to reserve for `seq` when its group is admitted (the result is raised to at
  // least the sequence's current length).
  virtual int64_t AdmissionReservation(const SequenceGroup& group, const SchedSequence& seq,
                                       int64_t max_model_len) const;
  // Called when a running sequence needs `needed` tokens of KV but holds fewer: the new
  // reservation (>= needed). Paged growth takes exactly what is needed.
  virtual int64_t GrowReservation(const SequenceGroup& group, const SchedSequence& seq, int64_t needed,
                                  int64_t max_model_len) const;
  // Service order: true when `a` goes before `b`. Default FCFS (arrival, then request id).
  // Preemption takes victims from the end of this order.
  virtual bool Before(const SequenceGroup& a, const SequenceGroup& b) const;
  // Whether admission may pass over a waiting group that does not fit and try later ones
  // (batch packing); FCFS never lets a request overtake.
  virtual bool AdmitOutOfOrder() const { return false; }
  // Hard reservations (S3's supervisor): a sequence that needs more KV than its admission
  // reservation is preempted, and its group comes back with SequenceGroup::reservation_misses
  // raised, which AdmissionReservation must turn into a larger reservation. Otherwise it grows.
  virtual bool PreemptsOnExhaustedReservation() const { return false; }
};

// vLLM: blocks on demand.
class PagedPolicy : public SchedulingPolicy {
 public:
  std::string_view name() const override { return "paged"; }
};

// Orca baselines (vLLM paper §6.2): reserve the maximum sequence length, the true output length
// rounded up to a power of two, or exactly the true output length. Without a known true length
// (live traffic) pow2 and oracle fall back to the request's max_tokens.
class OrcaPolicy : public SchedulingPolicy {
 public:
  enum class Kind { kMax, kPow2, kOracle };
  explicit OrcaPolicy(Kind kind) : kind_(kind) {}
  std::string_view name() const override;
  int64_t AdmissionReservation(const SequenceGroup& group, const SchedSequence& seq,
                               int64_t max_model_len) const override;

 private:
  Kind kind_;
};

// S3: reserve prompt + predicted output (SequenceGroup::predicted_output_len, filled at arrival by
// the length supervisor; without one, the request's max_tokens), doubled after every exhausted
// reservation; serve the largest reservation first and let smaller ones fill the gaps
// (first-fit decreasing). With `oracle`, the true output length replaces the prediction: S3's
// "Oracle" (evaluation only).
class S3Policy : public SchedulingPolicy {
 public:
  explicit S3Policy(bool oracle = false) : oracle_(oracle) {}
  std::string_view name() const override { return oracle_ ? "s3-oracle" : "s3"; }
  int64_t AdmissionReservation(const SequenceGroup& group, const SchedSequence& seq,
                               int64_t max_model_len) const override;
  int64_t GrowReservation(const SequenceGroup& group, const SchedSequence& seq, int64_t needed,
                          int64_t max_model_len) const override;
  bool Before(const SequenceGroup& a, const SequenceGroup& b) const override;
  bool AdmitOutOfOrder() const override { return true; }
  bool PreemptsOnExhaustedReservation() const override { return true; }

 private:
  // KV tokens each sequence of the group reserves (prompt included), after its misses.
  int64_t Reservation(const SequenceGroup& group, int64_t max_model_len) const;
  bool oracle_;
};

// "paged", "s3", "orca-max", "orca-pow2", "orca-oracle", "s3-oracle".
Result<std::unique_ptr<SchedulingPolicy>> MakeSchedulingPolicy(std::string_view name);
std::vector<std::string> SchedulingPolicyNames();

}  // namespace kvflow
