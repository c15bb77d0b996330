// What the driver rank of a model-parallel job sends its workers each step, as int64 words: the
// step's block moves, its batches (one a micro-batch), or stop. The decoder checks every count against the message's
// length (a message it cannot read is an error, never a crash); the backend validates the batch.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "kvflow/engine.h"
#include "kvflow/status.h"
#include "sched/scheduler.h"

namespace kvflow::mp {

// kReport: the worker answers with its RankStepStats (EncodeRankStats).
enum class StepMessageKind : int64_t { kMoves = 1, kForward = 2, kStop = 3, kReport = 4 };

struct StepMoves {
  std::vector<BlockMove> swap_out, swap_in, copies;
  bool empty() const { return swap_out.empty() && swap_in.empty() && copies.empty(); }
};

std::vector<int64_t> EncodeMoves(const SchedulerOutput& sched);
Result<StepMoves> DecodeMoves(std::span<const int64_t> words);
// With each slice's logits mode: the last pipeline stage makes the logits the driver samples.
std::vector<int64_t> EncodeBatch(const ForwardBatch& batch);
Result<ForwardBatch> DecodeBatch(std::span<const int64_t> words);

// A rank's own counters as doubles (kReport's answer), and back; the decoder checks the length.
constexpr size_t kRankStatsWords = 6;
std::vector<double> EncodeRankStats(const RankStepStats& stats);
Result<RankStepStats> DecodeRankStats(std::span<const double> words, int rank, int stage, int tensor_rank);

// `batch` cut into at most `parts` micro-batches of whole sequences, in order, with about as many
// tokens each (each a batch of its own: token offsets from 0, its part of the slot mapping). Their
// logit rows, one after the other, are the batch's.
std::vector<ForwardBatch> SplitIntoMicrobatches(const ForwardBatch& batch, int parts);

}  // namespace kvflow::mp
