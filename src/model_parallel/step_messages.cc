#include "model_parallel/step_messages.h"

#include <algorithm>
#include <string>

namespace kvflow::mp {
namespace {

void PutMoves(std::vector<int64_t>& out, std::span<const BlockMove> moves) {
  out.push_back(static_cast<int64_t>(moves.size()));
  for (const BlockMove& m : moves) {
    out.push_back(m.src);
    out.push_back(m.dst);
  }
}

template <typename T>
void PutList(std::vector<int64_t>& out, std::span<const T> values) {
  out.push_back(static_cast<int64_t>(values.size()));
  out.insert(out.end(), values.begin(), values.end());
}

// Reads words in order; any read past the end marks the message malformed.
class Reader {
 public:
  explicit Reader(std::span<const int64_t> words) : words_(words) {}
  int64_t Next() {
    if (at_ >= words_.size()) {
      bad_ = true;
      return 0;
    }
    return words_[at_++];
  }
  // A count of items of `width` words each that the rest of the message can hold.
  int64_t Count(int64_t width) {
    const int64_t n = Next();
    if (n < 0 || n > static_cast<int64_t>(words_.size() - at_) / width) {
      bad_ = true;
      return 0;
    }
    return n;
  }
  template <typename T>
  std::vector<T> List() {
    const int64_t n = Count(1);
    std::vector<T> out;
    out.reserve(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out.push_back(static_cast<T>(Next()));
    return out;
  }
  std::vector<BlockMove> Moves() {
    const int64_t n = Count(2);
    std::vector<BlockMove> out;
    for (int64_t i = 0; i < n; ++i) {
      const auto src = static_cast<BlockId>(Next());
      out.push_back({src, static_cast<BlockId>(Next())});
    }
    return out;
  }
  Status Finish(const char* what) const {
    if (bad_ || at_ != words_.size()) {
      return Status::InvalidArgument(std::string("model parallel: a malformed ") + what + " message of " +
                                     std::to_string(words_.size()) + " words");
    }
    return Status::Ok();
  }

 private:
  std::span<const int64_t> words_;
  size_t at_ = 0;
  bool bad_ = false;
};

}  // namespace

std::vector<int64_t> EncodeMoves(const SchedulerOutput& sched) {
  std::vector<int64_t> out;
  PutMoves(out, sched.swap_out);
  PutMoves(out, sched.swap_in);
  PutMoves(out, sched.copies);
  return out;
}

Result<StepMoves> DecodeMoves(std::span<const int64_t> words) {
  Reader in(words);
  StepMoves moves;
  moves.swap_out = in.Moves();
  moves.swap_in = in.Moves();
  moves.copies = in.Moves();
  KVFLOW_RETURN_IF_ERROR(in.Finish("block moves"));
  return moves;
}

std::vector<int64_t> EncodeBatch(const ForwardBatch& batch) {
  std::vector<int64_t> out;
  PutList(out, std::span<const int32_t>(batch.tokens));
  PutList(out, std::span<const int32_t>(batch.positions));
  PutList(out, std::span<const int64_t>(batch.slot_mapping));
  out.push_back(static_cast<int64_t>(batch.seqs.size()));
  for (const SequenceSlice& s : batch.seqs) {
    out.push_back(s.token_offset);
    out.push_back(s.num_tokens);
    out.push_back(s.context_len);
    out.push_back(static_cast<int64_t>(s.logits));
    PutList(out, std::span<const BlockId>(s.block_table));
    out.push_back(static_cast<int64_t>(s.view.kind));
    PutList(out, std::span<const BlockId>(s.view.blocks));
    out.push_back(s.view.num_tokens);
    PutList(out, std::span<const int64_t>(s.view.slots));
  }
  return out;
}

Result<ForwardBatch> DecodeBatch(std::span<const int64_t> words) {
  Reader in(words);
  ForwardBatch batch;
  batch.tokens = in.List<int32_t>();
  batch.positions = in.List<int32_t>();
  batch.slot_mapping = in.List<int64_t>();
  const int64_t seqs = in.Count(9);  // a slice takes at least 9 words
  for (int64_t i = 0; i < seqs; ++i) {
    SequenceSlice s;
    s.token_offset = static_cast<int32_t>(in.Next());
    s.num_tokens = static_cast<int32_t>(in.Next());
    s.context_len = static_cast<int32_t>(in.Next());
    const int64_t logits = in.Next();
    if (logits != static_cast<int64_t>(LogitsMode::kNone) && logits != static_cast<int64_t>(LogitsMode::kLast) &&
        logits != static_cast<int64_t>(LogitsMode::kAll)) {
      return Status::InvalidArgument("model parallel: a batch message names logits mode " + std::to_string(logits));
    }
    s.logits = static_cast<LogitsMode>(logits);
    s.block_table = in.List<BlockId>();
    const int64_t kind = in.Next();
    if (kind < static_cast<int64_t>(KvView::Kind::kFull) || kind > static_cast<int64_t>(KvView::Kind::kSlots)) {
      return Status::InvalidArgument("model parallel: a batch message names KV view kind " + std::to_string(kind));
    }
    s.view.kind = static_cast<KvView::Kind>(kind);
    s.view.blocks = in.List<BlockId>();
    s.view.num_tokens = static_cast<int32_t>(in.Next());
    s.view.slots = in.List<int64_t>();
    batch.seqs.push_back(std::move(s));
  }
  KVFLOW_RETURN_IF_ERROR(in.Finish("batch"));
  return batch;
}

std::vector<ForwardBatch> SplitIntoMicrobatches(const ForwardBatch& batch, int parts) {
  const int64_t num_seqs = static_cast<int64_t>(batch.seqs.size());
  parts = static_cast<int>(std::clamp<int64_t>(parts, 1, std::max<int64_t>(1, num_seqs)));
  if (parts == 1) return {batch};
  const int64_t total = static_cast<int64_t>(batch.tokens.size());
  std::vector<ForwardBatch> out;
  ForwardBatch* mb = nullptr;
  int64_t done = 0;  // tokens in the micro-batches closed so far and the open one
  for (int64_t i = 0; i < num_seqs; ++i) {
    const SequenceSlice& s = batch.seqs[static_cast<size_t>(i)];
    // Open a new micro-batch when the open one has its share of the tokens, or when each part
    // still to open needs one of the sequences left.
    const int64_t opened = static_cast<int64_t>(out.size());
    const bool share_full = mb != nullptr && done * parts >= opened * total;
    const bool must_open = num_seqs - i <= parts - opened;
    if (mb == nullptr || (opened < parts && (share_full || must_open))) {
      mb = &out.emplace_back();
    }
    SequenceSlice slice = s;
    slice.token_offset = static_cast<int32_t>(mb->tokens.size());
    const auto first = static_cast<size_t>(s.token_offset), last = first + static_cast<size_t>(s.num_tokens);
    mb->tokens.insert(mb->tokens.end(), batch.tokens.begin() + first, batch.tokens.begin() + last);
    mb->positions.insert(mb->positions.end(), batch.positions.begin() + first, batch.positions.begin() + last);
    if (!batch.slot_mapping.empty()) {
      mb->slot_mapping.insert(mb->slot_mapping.end(), batch.slot_mapping.begin() + first,
                              batch.slot_mapping.begin() + last);
    }
    mb->seqs.push_back(std::move(slice));
    done += s.num_tokens;
  }
  return out;
}

std::vector<double> EncodeRankStats(const RankStepStats& s) {
  return {static_cast<double>(s.microbatches), s.forward_seconds,       s.all_reduce_seconds,
          static_cast<double>(s.all_reduce_bytes), s.residual_wait_seconds, s.residual_send_seconds};
}

Result<RankStepStats> DecodeRankStats(std::span<const double> words, int rank, int stage, int tensor_rank) {
  if (words.size() != kRankStatsWords) {
    return Status::Internal("model parallel: a rank's report has " + std::to_string(words.size()) + " words, not " +
                            std::to_string(kRankStatsWords));
  }
  RankStepStats s;
  s.rank = rank;
  s.stage = stage;
  s.tensor_rank = tensor_rank;
  s.microbatches = static_cast<int64_t>(words[0]);
  s.forward_seconds = words[1];
  s.all_reduce_seconds = words[2];
  s.all_reduce_bytes = static_cast<int64_t>(words[3]);
  s.residual_wait_seconds = words[4];
  s.residual_send_seconds = words[5];
  return s;
}

}  // namespace kvflow::mp
