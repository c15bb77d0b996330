#include "engine/model_executor.h"

#include <utility>

#include <spdlog/spdlog.h>

namespace kvflow {

ForwardBatch BuildForwardBatch(const SchedulerOutput& sched, const BlockManager& blocks,
                               std::span<const LogitsMode> logits) {
  ForwardBatch batch;
  for (size_t k = 0; k < sched.scheduled.size(); ++k) {
    const ScheduledSeq& s = sched.scheduled[k];
    SequenceSlice slice;
    slice.token_offset = static_cast<int32_t>(batch.tokens.size());
    slice.num_tokens = static_cast<int32_t>(s.num_tokens);
    slice.context_len = static_cast<int32_t>(s.seq->num_computed + s.num_tokens);
    slice.block_table = blocks.BlockTable(s.seq->id);
    slice.logits = logits[k];
    for (int64_t i = 0; i < s.num_tokens; ++i) {
      batch.tokens.push_back(s.token(i));
      batch.positions.push_back(static_cast<int32_t>(s.seq->num_computed + i));
    }
    batch.seqs.push_back(std::move(slice));
  }
  return batch;
}

void ModelExecutor::AddFollower(Backend& follower) { followers_.emplace_back(follower); }

Status ModelExecutor::MoveBlocks(const SchedulerOutput& sched) {
  auto planned = [&](KvConnector* c) -> const KvConnectorMoves* {
    const KvConnectorScheduler* side = c->scheduler_side();
    if (side == nullptr) return nullptr;
    for (const KvConnectorMoves& m : sched.connector_moves) {
      if (m.connector == side) return &m;
    }
    return nullptr;
  };
  auto move = [&](Backend& backend) -> Status {
    for (KvConnector* c : connectors_) KVFLOW_RETURN_IF_ERROR(c->Save(sched, planned(c), backend));
    for (KvConnector* c : connectors_) KVFLOW_RETURN_IF_ERROR(c->Load(sched, planned(c), backend));
    return backend.CopyBlocks(sched.copies, BlockCopyKind::kDeviceToDevice);
  };
  if (mirror_) KVFLOW_RETURN_IF_ERROR(mirror_->MirrorMoves(sched));
  KVFLOW_RETURN_IF_ERROR(move(backend_));
  for (LlamaModel& follower : followers_) KVFLOW_RETURN_IF_ERROR(move(follower.backend()));
  return Status::Ok();
}

void ModelExecutor::RunFollowers(const ForwardBatch& target_batch) {
  if (followers_.empty()) return;  // the usual case: no copy of the batch
  ForwardBatch batch = target_batch;
  for (SequenceSlice& s : batch.seqs) s.logits = LogitsMode::kNone;
  for (LlamaModel& follower : followers_) {
    if (Status st = follower.Forward(batch, follower_logits_); !st.ok()) {
      if (follower_failures_++ == 0) spdlog::error("follower KV cache ({}): {}", follower.backend().Describe(), st.ToString());
    }
  }
}

void ModelExecutor::SetStepHooks(const SchedulerOutput& sched, const ForwardBatch& batch) {
  chain_.Clear();
  if (!step_hooks_.empty()) {
    seq_ids_.clear();
    selecting_.clear();
    for (const ScheduledSeq& s : sched.scheduled) {
      seq_ids_.push_back(s.seq->id);
      selecting_.push_back(s.group->kv_selection ? 1 : 0);
    }
    for (StepHooks* features : step_hooks_) chain_.Add(features->ForStep(batch, seq_ids_, selecting_));
  }
  LayerHooks* hooks = chain_.Collapse();
  for (KvConnector* c : connectors_) {
    if (WrappingHooks* around = c->layer_hooks()) hooks = around->Wrap(hooks, backend_.model_config().num_layers);
  }
  model_.set_hooks(hooks);
}

Status ModelExecutor::Run(const SchedulerOutput& sched, std::span<const LogitsMode> logits,
                          const DeviceSampling* sampling, ExecutorOutput& out) {
  if (sched.empty()) return Status::Ok();
  const ForwardBatch batch = BuildForwardBatch(sched, blocks_, logits);
  SetStepHooks(sched, batch);
  const Status st = mirror_ ? RunAcrossRanks(batch, sampling, out) : RunTarget(batch, sampling, out);
  model_.set_hooks(nullptr);
  return st;
}

Status ModelExecutor::SubmitStep(const SchedulerOutput& sched, std::span<const LogitsMode> logits) {
  if (!mirror_) return Executor::SubmitStep(sched, logits);  // the mirror checks its own depth
  const ForwardBatch batch = BuildForwardBatch(sched, blocks_, logits);
  SetStepHooks(sched, batch);  // this rank's stage runs now
  const Status st = mirror_->SubmitStep(model_, batch);
  model_.set_hooks(nullptr);
  return st;
}

Status ModelExecutor::CollectStep(ExecutorOutput& out) {
  if (!mirror_) return Executor::CollectStep(out);
  KVFLOW_RETURN_IF_ERROR(mirror_->CollectStep(logits_));
  out.vocab_size = backend_.model_config().vocab_size;
  out.logits = std::span<float>(logits_);
  return Status::Ok();
}

Status ModelExecutor::RunAcrossRanks(const ForwardBatch& batch, const DeviceSampling* sampling, ExecutorOutput& out) {
  // The model_parallel plugin's validation keeps split models on host-sampling backends.
  if (sampling != nullptr) return Status::Internal("a model split across ranks samples on the host");
  KVFLOW_RETURN_IF_ERROR(mirror_->RunStep(model_, batch, logits_));
  out.vocab_size = backend_.model_config().vocab_size;
  out.logits = std::span<float>(logits_.data(), static_cast<size_t>(batch.num_logit_rows() * out.vocab_size));
  return Status::Ok();
}

Status ModelExecutor::RunTarget(const ForwardBatch& batch, const DeviceSampling* sampling,
                                ExecutorOutput& out) {
  if (sampling) {
    sampled_.clear();
    KVFLOW_RETURN_IF_ERROR(model_.ForwardAndSample(batch, sampling->rows, sampled_, sampling->await_constraints));
    for (SampledToken& t : sampled_) out.sampled.push_back({std::move(t)});
    RunFollowers(batch);
    return Status::Ok();
  }
  KVFLOW_RETURN_IF_ERROR(model_.Forward(batch, logits_));
  if (out.want_final_hidden && !final_hidden_unsupported_) {
    // Read before the followers run: they are other backends, but the read belongs to this pass.
    const int64_t H = backend_.model_config().hidden_size, rows = batch.num_logit_rows();
    final_hidden_.resize(static_cast<size_t>(rows * H));
    if (Status st = backend_.ReadFinalHidden(0, rows, final_hidden_); st.ok()) {
      out.final_hidden = final_hidden_;
      out.hidden_size = H;
    } else {
      final_hidden_unsupported_ = true;
      spdlog::warn("the length probe gets no hidden states on this backend: {}", st.ToString());
    }
  }
  RunFollowers(batch);
  out.vocab_size = backend_.model_config().vocab_size;
  out.logits = std::span<float>(logits_.data(), static_cast<size_t>(batch.num_logit_rows() * out.vocab_size));
  return Status::Ok();
}

}  // namespace kvflow
