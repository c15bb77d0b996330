// What the driver rank of a tensor-parallel job sends its workers each step, as int64 words: the
// step's block moves, its batch, or stop. The decoder checks every count against the message's
// length (a message it cannot read is an error, never a crash); the backend validates the batch.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "kvflow/status.h"
#include "sched/scheduler.h"

namespace kvflow::tp {

enum class StepMessageKind : int64_t { kMoves = 1, kForward = 2, kStop = 3 };

struct StepMoves {
  std::vector<BlockMove> swap_out, swap_in, copies;
  bool empty() const { return swap_out.empty() && swap_in.empty() && copies.empty(); }
};

std::vector<int64_t> EncodeMoves(const SchedulerOutput& sched);
Result<StepMoves> DecodeMoves(std::span<const int64_t> words);
// Every slice's logits are dropped: only the driver samples.
std::vector<int64_t> EncodeBatch(const ForwardBatch& batch);
Result<ForwardBatch> DecodeBatch(std::span<const int64_t> words);

}  // namespace kvflow::tp
