// TriForce's chunk scoring and selection on the device, and the pinned staging of per-call job metadata.
#include "backend/cuda/cuda_backend_impl.h"

#include <algorithm>
#include <limits>

#include <spdlog/fmt/fmt.h>

#include "backend/cpu/kv_block_select.h"
#include "kv_block_select.h"

namespace kvflow {
namespace cuda_impl {

// ---- TriForce's chunk scoring and selection ----------------------------------------------------

Status CudaBackend::StageBlockMeta(size_t bytes, char** host, char** device) {
  bytes = AlignUp(bytes);
  if (block_meta_restart_) {
    // A new step: the previous step's copies out of the staging are done once the last one is.
    block_meta_restart_ = false;
    if (block_meta_copied_) KVFLOW_CUDA_RETURN(cudaEventSynchronize(block_meta_copied_));
    block_meta_used_ = 0;
  }
  // Both sides (equal unless an allocation below failed half-way).
  const size_t capacity = std::min(block_meta_staging_.bytes(), block_meta_device_.bytes());
  if (block_meta_used_ + bytes > capacity) {
    // Full: in the first step, or when the jobs grow. Everything queued may still read either side
    // (the copy stream's prefetch gathers too), so wait for the streams, then start over, with room
    // for a step's every layer of calls this size so that the next steps need no wait.
    KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
    KVFLOW_CUDA_RETURN(cudaStreamSynchronize(copy_stream_));
    block_meta_used_ = 0;
    const size_t step_bytes = bytes * static_cast<size_t>(std::max(config_.num_layers, 1));
    if (step_bytes > capacity) {
      const size_t grown = std::max(step_bytes, 2 * capacity);
      KVFLOW_RETURN_IF_ERROR(block_meta_staging_.Allocate(grown, "chunk scoring staging"));
      KVFLOW_RETURN_IF_ERROR(block_meta_device_.Allocate(grown, "chunk scoring metadata"));
    }
  }
  if (!block_meta_copied_) KVFLOW_CUDA_RETURN(cudaEventCreateWithFlags(&block_meta_copied_, cudaEventDisableTiming));
  *host = block_meta_staging_.base() + block_meta_used_;
  *device = block_meta_device_.base() + block_meta_used_;
  block_meta_used_ += bytes;
  return Status::Ok();
}

Status CudaBackend::ResetKvBlockScores(int64_t size) {
  if (size < 0) return Status::InvalidArgument("chunk scoring: negative buffer size");
  const size_t bytes = static_cast<size_t>(size) * sizeof(float);
  if (bytes > block_scores_arena_.bytes()) {
    // Grow (geometrically, so a slowly growing request reallocates rarely); the old scores are all
    // inside [0, size), which Reset zeroes anyway. Queued kernels may still read the old buffer.
    KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
    KVFLOW_RETURN_IF_ERROR(
        block_scores_arena_.Allocate(std::max(AlignUp(bytes), 2 * block_scores_arena_.bytes()), "chunk scores"));
    block_scores_ = reinterpret_cast<float*>(block_scores_arena_.base());
  }
  if (bytes > 0) KVFLOW_CUDA_RETURN(cudaMemsetAsync(block_scores_, 0, bytes, stream_));
  block_scores_size_ = std::max(block_scores_size_, size);
  return Status::Ok();
}

Status CudaBackend::ScoreKvBlocks(int layer, std::span<const KvBlockScoreJob> jobs) {
  if (!in_step_) return Status::Internal("chunk scoring outside a step");
  if (layer < 0 || layer >= config_.num_layers) return Status::InvalidArgument("chunk scoring: layer out of range");
  KVFLOW_RETURN_IF_ERROR(cpu::ValidateKvBlockScoreJobs(jobs, layout_, step_.num_tokens, block_scores_size_));
  // The jobs are uploaded per call; a graph would replay the first step's jobs forever.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  KVFLOW_CUDA_RETURN(cudaStreamIsCapturing(stream_, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    return Status::Unsupported("chunk scoring cannot be captured in a CUDA graph: hooks that score are not capturable");
  }
  int64_t total = 0;
  for (const KvBlockScoreJob& job : jobs) total += static_cast<int64_t>(job.blocks.size());
  if (total == 0) return Status::Ok();  // nothing to add
  const int64_t NH = config_.num_heads;
  if (total > std::numeric_limits<int32_t>::max() / NH) {
    return Status::InvalidArgument(fmt::format("chunk scoring: {} blocks in one call is too many", total));
  }
  // [jobs][block ids][block -> job] in one staging region, one copy.
  const size_t jobs_bytes = AlignUp(jobs.size() * sizeof(cuda::KvBlockScoreJobDesc));
  const size_t list_bytes = AlignUp(static_cast<size_t>(total) * sizeof(int32_t));
  char* host = nullptr;
  char* device = nullptr;
  KVFLOW_RETURN_IF_ERROR(StageBlockMeta(jobs_bytes + 2 * list_bytes, &host, &device));
  auto* desc = reinterpret_cast<cuda::KvBlockScoreJobDesc*>(host);
  auto* ids = reinterpret_cast<int32_t*>(host + jobs_bytes);
  auto* owners = reinterpret_cast<int32_t*>(host + jobs_bytes + list_bytes);
  int32_t next = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const KvBlockScoreJob& job = jobs[j];
    desc[j] = cuda::KvBlockScoreJobDesc{};
    desc[j].score_offset = job.score_offset;
    desc[j].row = job.row;
    desc[j].num_blocks = static_cast<int32_t>(job.blocks.size());
    desc[j].num_tokens = job.num_tokens;
    desc[j].first_block = next;
    for (BlockId b : job.blocks) {
      ids[next] = b;
      owners[next++] = static_cast<int32_t>(j);
    }
  }
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(device, host, jobs_bytes + 2 * list_bytes, cudaMemcpyHostToDevice, stream_));
  KVFLOW_CUDA_RETURN(cudaEventRecord(block_meta_copied_, stream_));

  const size_t logits_bytes = static_cast<size_t>(NH * total) * sizeof(float);
  if (logits_bytes > block_logits_arena_.bytes()) {
    KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));  // earlier layers' kernels may use the old scratch
    KVFLOW_RETURN_IF_ERROR(block_logits_arena_.Allocate(std::max(AlignUp(logits_bytes), 2 * block_logits_arena_.bytes()),
                                                        "chunk scoring scratch"));
  }
  cuda::KvBlockScoreArgs a;
  a.dtype = dtype_;
  a.query = qkv_;  // the Q heads lead each kQkv row, rotated by now
  a.query_row_stride = ActivationWidth(Activation::kQkv);
  a.key_cache = key_pool_ + layer * layout_.layer_stride() * cuda::DTypeSize(dtype_);
  if (resident_step_) {
    a.key_cache = ResidentLayer(0, layer);
  } else if (staged_step()) {
    // An offloaded pool: the layer's keys as attention will read them, fetched once for both (the
    // jobs' blocks are their slices' views), not read again over the bus from pinned memory.
    KVFLOW_RETURN_IF_ERROR(EnsureStaged(layer, {}));
    a.key_cache = StagingLayer(0, layer);
  }
  a.jobs = reinterpret_cast<const cuda::KvBlockScoreJobDesc*>(device);
  a.num_jobs = static_cast<int>(jobs.size());
  a.block_ids = reinterpret_cast<const int32_t*>(device + jobs_bytes);
  a.block_jobs = reinterpret_cast<const int32_t*>(device + jobs_bytes + list_bytes);
  a.total_blocks = static_cast<int>(total);
  a.num_heads = config_.num_heads;
  a.num_kv_heads = config_.num_kv_heads;
  a.head_dim = config_.head_dim;
  a.block_size = layout_.block_size;
  a.logits = reinterpret_cast<float*>(block_logits_arena_.base());
  a.scores = block_scores_;
  KVFLOW_KERNEL_RETURN(cuda::ScoreKvBlocks(a, stream_));
  return Status::Ok();
}

Status CudaBackend::SelectTopKvBlocks(std::span<const KvBlockSelectJob> jobs, std::vector<int32_t>& chosen) {
  chosen.clear();
  KVFLOW_RETURN_IF_ERROR(cpu::ValidateKvBlockSelectJobs(jobs, block_scores_size_));
  int64_t total = 0;
  for (const KvBlockSelectJob& job : jobs) total += std::min(job.k, job.num_blocks);
  if (total == 0) return Status::Ok();  // every job chooses nothing
  if (total > std::numeric_limits<int32_t>::max()) return Status::InvalidArgument("chunk selection: too many blocks");
  // [jobs][chosen indices]: the jobs go up, the indices come back through the same region.
  const size_t jobs_bytes = AlignUp(jobs.size() * sizeof(cuda::KvBlockSelectJobDesc));
  const size_t out_bytes = static_cast<size_t>(total) * sizeof(int32_t);
  char* host = nullptr;
  char* device = nullptr;
  KVFLOW_RETURN_IF_ERROR(StageBlockMeta(jobs_bytes + out_bytes, &host, &device));
  auto* desc = reinterpret_cast<cuda::KvBlockSelectJobDesc*>(host);
  int32_t next = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const KvBlockSelectJob& job = jobs[j];
    desc[j] = cuda::KvBlockSelectJobDesc{};
    desc[j].score_offset = job.score_offset;
    desc[j].num_blocks = job.num_blocks;
    desc[j].keep_first = job.keep_first;
    desc[j].keep_last = job.keep_last;
    desc[j].k = job.k;
    desc[j].out_offset = next;
    next += std::min(job.k, job.num_blocks);
  }
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(device, host, jobs_bytes, cudaMemcpyHostToDevice, stream_));
  KVFLOW_KERNEL_RETURN(cuda::SelectTopKvBlocks(block_scores_, reinterpret_cast<const cuda::KvBlockSelectJobDesc*>(device),
                                               static_cast<int>(jobs.size()), reinterpret_cast<int32_t*>(device + jobs_bytes),
                                               stream_));
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(host + jobs_bytes, device + jobs_bytes, out_bytes, cudaMemcpyDeviceToHost, stream_));
  KVFLOW_CUDA_RETURN(cudaEventRecord(block_meta_copied_, stream_));
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  const auto* indices = reinterpret_cast<const int32_t*>(host + jobs_bytes);
  chosen.assign(indices, indices + total);
  return Status::Ok();
}

Status CudaBackend::ReadKvBlockScores(int64_t offset, std::span<float> out) {
  if (offset < 0 || offset + static_cast<int64_t>(out.size()) > block_scores_size_) {
    return Status::InvalidArgument("chunk scores: read outside the buffer");
  }
  if (out.empty()) return Status::Ok();
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(out.data(), block_scores_ + offset, out.size() * sizeof(float),
                                     cudaMemcpyDeviceToHost, stream_));
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  return Status::Ok();
}

}  // namespace cuda_impl
}  // namespace kvflow
