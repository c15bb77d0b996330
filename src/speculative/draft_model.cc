#include "speculative/draft_model.h"

#include "kvflow/models.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "backend/backend_factory.h"
#include "forward/llama_model.h"
#include "model/tensor_source.h"
#include "sched/length_predictor.h"
#include "sampling/sampler.h"
#include "sched/sequence_group.h"

namespace kvflow {

Result<std::unique_ptr<Backend>> CreateDraftModelBackend(const EngineConfig& config, const Backend& target,
                                                         const ModelConfig& target_model, const Tokenizer& tokenizer,
                                                         int scratch_blocks) {
  KVFLOW_ASSIGN_OR_RETURN(std::string path, ResolveModel(config.speculative.model));
  KVFLOW_ASSIGN_OR_RETURN(ModelFiles files, OpenModelFiles(path));
  const ModelConfig& mc = files.config;
  KVFLOW_RETURN_IF_ERROR(mc.Validate());
  const std::string what = "draft model " + config.speculative.model;
  if (!files.tokenizer) return Status::InvalidArgument(what + " has no tokenizer; it must share the target's");
  if (mc.vocab_size != target_model.vocab_size ||
      TokenizerFingerprint(*files.tokenizer) != TokenizerFingerprint(tokenizer)) {
    return Status::InvalidArgument(what + " has another tokenizer than " + target_model.name + " (vocab " +
                                   std::to_string(mc.vocab_size) + " vs " + std::to_string(target_model.vocab_size) +
                                   "); draft and target must share one");
  }
  if (mc.max_position_embeddings < config.max_model_len) {
    return Status::InvalidArgument(what + " has a context of " + std::to_string(mc.max_position_embeddings) +
                                   " tokens, less than max_model_len " + std::to_string(config.max_model_len) +
                                   "; lower max_model_len");
  }
  KVFLOW_ASSIGN_OR_RETURN(LlamaWeights weights, LoadWeightsFor(files, config));
  files.tensors.reset();
  EngineConfig draft = config;
  draft.num_kv_blocks = target.kv_layout().num_blocks + scratch_blocks;
  // A draft model's cache is small: it stays on the device when the target's is offloaded (its
  // passes read views an offloaded pool does not stage, and TriForce wants it resident).
  draft.kv_offload.enabled = false;
  // The same host pool: the swap space, then the host prefix cache's blocks (resolved by the
  // target's factory).
  draft.host_prefix_cache = HostPrefixCacheConfig{0, std::max(0, config.host_prefix_cache.num_blocks)};
  draft.num_host_kv_blocks = target.num_host_blocks() - draft.host_prefix_cache.num_blocks;
  KVFLOW_ASSIGN_OR_RETURN(auto backend, CreateBackend(draft, /*max_model_len_requested=*/true, mc, std::move(weights)));
  if (backend->kv_layout().num_blocks < draft.num_kv_blocks || backend->num_host_blocks() != target.num_host_blocks()) {
    return Status::Internal(what + ": its KV pool could not be sized to follow the target's");
  }
  spdlog::info("{}: {} layers, KV pool of {} blocks following the target's {}", what, mc.num_layers,
               backend->kv_layout().num_blocks, target.kv_layout().num_blocks);
  return backend;
}

DraftModel::DraftModel(Backend& backend, int num_table_blocks, int num_speculative_tokens, int max_num_seqs)
    : backend_(backend),
      num_table_blocks_(num_table_blocks),
      k_(num_speculative_tokens),
      max_num_seqs_(max_num_seqs),
      blocks_per_seq_(BlocksForTokens(num_speculative_tokens, backend.kv_layout().block_size)) {}

int DraftModel::ScratchBlocks(int num_speculative_tokens, int max_num_seqs, int block_size) {
  return max_num_seqs * BlocksForTokens(num_speculative_tokens, block_size);
}

int64_t DraftModel::ScratchSlot(int b, int step) const {
  const int bs = backend_.kv_layout().block_size;
  const int64_t block = num_table_blocks_ + static_cast<int64_t>(b) * blocks_per_seq_ + step / bs;
  return block * bs + step % bs;
}

void DraftModel::Propose(std::span<DraftJob* const> jobs) {
  // The scratch space holds max_num_seqs sequences; the scheduler never runs more, but stay safe.
  ProposeInChunks(jobs, static_cast<size_t>(max_num_seqs_), [this](auto chunk) { return ProposeChunk(chunk); },
                  "draft model", failed_batches_);
}

Status DraftModel::ProposeChunk(std::span<DraftJob* const> jobs) {
  const int bs = backend_.kv_layout().block_size;
  const int64_t V = backend_.model_config().vocab_size;
  LlamaModel model(backend_);
  std::vector<float> probs;
  std::vector<int32_t> history;
  for (int step = 0;; ++step) {
    ForwardBatch batch;
    std::vector<DraftJob*> rows;
    for (size_t b = 0; b < jobs.size(); ++b) {
      DraftJob& job = *jobs[b];
      if (step >= std::min(job.max_drafts, k_)) continue;
      const SchedSequence& seq = *job.seq;
      // Every token but the last is cached, at the positions the table maps.
      const int64_t cached = seq.num_tokens() - 1;
      if (cached != seq.num_computed || static_cast<int64_t>(job.block_table.size()) * bs < cached) {
        return Status::Internal("draft job for a sequence that is not decoding");
      }
      SequenceSlice slice;
      slice.token_offset = static_cast<int32_t>(batch.tokens.size());
      slice.num_tokens = 1;
      slice.context_len = static_cast<int32_t>(cached + step + 1);
      slice.logits = LogitsMode::kLast;
      std::vector<int64_t> slots;
      slots.reserve(static_cast<size_t>(slice.context_len));
      for (int64_t t = 0; t < cached; ++t) {
        slots.push_back(static_cast<int64_t>(job.block_table[static_cast<size_t>(t / bs)]) * bs + t % bs);
      }
      for (int j = 0; j <= step; ++j) slots.push_back(ScratchSlot(static_cast<int>(b), j));
      slice.view = KvView::Slots(std::move(slots));
      batch.tokens.push_back(step == 0 ? seq.tokens.back() : job.drafts.back());
      batch.positions.push_back(static_cast<int32_t>(cached + step));
      batch.slot_mapping.push_back(ScratchSlot(static_cast<int>(b), step));
      batch.seqs.push_back(std::move(slice));
      rows.push_back(&job);
    }
    if (rows.empty()) return Status::Ok();
    KVFLOW_RETURN_IF_ERROR(model.Forward(batch, logits_));
    for (size_t r = 0; r < rows.size(); ++r) {
      DraftJob& job = *rows[r];
      const SchedSequence& seq = *job.seq;
      const std::span<const int32_t> prompt(seq.tokens.data(), static_cast<size_t>(seq.prompt_len));
      history.assign(seq.tokens.begin() + seq.prompt_len, seq.tokens.end());
      history.insert(history.end(), job.drafts.begin(), job.drafts.end());
      std::span<float> row(logits_.data() + r * V, static_cast<size_t>(V));
      job.sampler->Distribution(row, prompt, history, nullptr, probs);
      job.drafts.push_back(job.sampler->DrawFrom(probs));
      job.probs.insert(job.probs.end(), probs.begin(), probs.end());
    }
  }
}

}  // namespace kvflow
