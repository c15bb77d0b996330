// The KV tiers: block copies and swaps, the offloaded pool's staging and prefetch, and KV transfers.
#include "backend/cuda/cuda_backend_impl.h"

#include <algorithm>
#include <vector>

#include "cache_ops.h"
#include "infinigen_score.h"

namespace kvflow {
namespace cuda_impl {

Status CudaBackend::CopyBlocks(std::span<const BlockMove> moves, BlockCopyKind kind) {
  KVFLOW_RETURN_IF_ERROR(ValidateBlockMoves(moves, kind, layout_.num_blocks, num_host_blocks_));
  if (moves.empty()) return Status::Ok();
  const size_t es = cuda::DTypeSize(dtype_);
  if (options_.kv_offload) {
    for (const BlockMove& m : moves) {
      if (m.src >= resident_begin_ || m.dst >= resident_begin_) {
        return Status::Internal("block moves reach the block manager's blocks only, not resident ones");
      }
    }
  }
  if (kind == BlockCopyKind::kDeviceToDevice) {
    // The previous pair list may still be in flight to the device.
    KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
    const size_t n = std::min(moves.size(), static_cast<size_t>(layout_.num_blocks));
    for (size_t i = 0; i < n; ++i) {
      host_pairs_[2 * i] = moves[i].src;
      host_pairs_[2 * i + 1] = moves[i].dst;
    }
    KVFLOW_CUDA_RETURN(cudaMemcpyAsync(copy_pairs_, host_pairs_, 2 * n * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    KVFLOW_KERNEL_RETURN(cuda::CopyBlocks(dtype_, key_pool_, value_pool_, layout_.num_layers,
                                          static_cast<int64_t>(layout_.layer_stride()),
                                          static_cast<int64_t>(layout_.block_stride()), copy_pairs_,
                                          static_cast<int>(n), stream_));
    return Status::Ok();
  }

  // Swaps: DMA copies on their own stream, after the compute queued so far; compute waits for them.
  const bool to_host = kind == BlockCopyKind::kDeviceToHost;
  const size_t block_bytes = layout_.block_stride() * es;
  const size_t device_layer_bytes = layout_.layer_stride() * es;
  const size_t host_layer_bytes = block_bytes * static_cast<size_t>(num_host_blocks_);
  KVFLOW_CUDA_RETURN(cudaEventRecord(compute_done_, stream_));
  KVFLOW_CUDA_RETURN(cudaStreamWaitEvent(copy_stream_, compute_done_, 0));
  // Runs of consecutive source and destination ids move as one copy.
  struct Run {
    BlockId src, dst;
    size_t len;
  };
  std::vector<Run> runs;
  for (const BlockMove& mv : moves) {
    if (!runs.empty() && runs.back().src + static_cast<BlockId>(runs.back().len) == mv.src &&
        runs.back().dst + static_cast<BlockId>(runs.back().len) == mv.dst) {
      ++runs.back().len;
    } else {
      runs.push_back({mv.src, mv.dst, 1});
    }
  }
  for (int l = 0; l < layout_.num_layers; ++l) {
    for (int pool = 0; pool < 2; ++pool) {
      char* dev = (pool == 0 ? key_pool_ : value_pool_) + l * device_layer_bytes;
      char* host = (pool == 0 ? host_key_pool_ : host_value_pool_) + l * host_layer_bytes;
      for (const Run& r : runs) {
        char* src = (to_host ? dev : host) + r.src * block_bytes;
        char* dst = (to_host ? host : dev) + r.dst * block_bytes;
        KVFLOW_CUDA_RETURN(cudaMemcpyAsync(dst, src, r.len * block_bytes,
                                           to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, copy_stream_));
      }
    }
  }
  KVFLOW_CUDA_RETURN(cudaEventRecord(swap_done_, copy_stream_));
  KVFLOW_CUDA_RETURN(cudaStreamWaitEvent(stream_, swap_done_, 0));
  return Status::Ok();
}

char* CudaBackend::PoolLayer(int kv, int layer) const {
  return (kv == 0 ? key_pool_ : value_pool_) + static_cast<size_t>(layer) * layout_.layer_stride() * cuda::DTypeSize(dtype_);
}

char* CudaBackend::StagingLayer(int kv, int layer) const {
  const size_t layer_bytes = layout_.layer_stride() * cuda::DTypeSize(dtype_);
  return staging_arena_.base() + (static_cast<size_t>(kv) * KvStagingLedger::kBuffers + layer % KvStagingLedger::kBuffers) * layer_bytes;
}

Status CudaBackend::StageViews(int layer, std::span<const KvHeadSelection> selection, cudaStream_t stream) {
  const int bs = layout_.block_size;
  const size_t block_bytes = layout_.block_stride() * cuda::DTypeSize(dtype_);
  int64_t blocks_moved = 0;
  for (size_t s = 0; s < batch_->seqs.size(); ++s) {
    if (!selection.empty() && selection[s].per_head > 0) continue;
    const SequenceSlice& slice = batch_->seqs[s];
    // The cached tokens' blocks: the step's own tokens are written into the staging buffer.
    const int32_t cached = slice.context_len - slice.num_tokens;
    const int32_t n = (cached + bs - 1) / bs;
    for (int32_t b = 0; b < n;) {
      int32_t run = 1;
      while (b + run < n && slice.block_table[static_cast<size_t>(b + run)] == slice.block_table[static_cast<size_t>(b)] + run) ++run;
      const size_t offset = static_cast<size_t>(slice.block_table[static_cast<size_t>(b)]) * block_bytes;
      for (int kv = 0; kv < 2; ++kv) {
        KVFLOW_CUDA_RETURN(cudaMemcpyAsync(StagingLayer(kv, layer) + offset, PoolLayer(kv, layer) + offset,
                                           static_cast<size_t>(run) * block_bytes, cudaMemcpyHostToDevice, stream));
      }
      blocks_moved += run;
      b += run;
    }
  }
  offload_stats_.bytes_fetched += blocks_moved * 2 * static_cast<int64_t>(block_bytes);
  return Status::Ok();
}

char* CudaBackend::ResidentLayer(int kv, int layer) const {
  const size_t block_bytes = layout_.block_stride() * cuda::DTypeSize(dtype_);
  const size_t resident = static_cast<size_t>(layout_.num_blocks - resident_begin_);
  const size_t at = (static_cast<size_t>(kv) * layout_.num_layers + static_cast<size_t>(layer)) * resident * block_bytes;
  // Integer arithmetic: the address block 0 would have lies before the arena.
  return reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(resident_arena_.base()) + at -
                                 static_cast<uintptr_t>(resident_begin_) * block_bytes);
}

char* CudaBackend::DeviceTierLayer(int kv, int layer, BlockId block) const {
  return options_.kv_offload && block >= resident_begin_ ? ResidentLayer(kv, layer) : PoolLayer(kv, layer);
}

Status CudaBackend::KeepResident(BlockId first) {
  if (!options_.kv_offload) return Status::Unsupported("resident blocks of a KV pool that is not offloaded");
  if (in_step_) return Status::Internal("KeepResident inside a step");
  if (first < 0 || first > layout_.num_blocks) {
    return Status::InvalidArgument(fmt::format("resident blocks from {} of a pool of {}", first, layout_.num_blocks));
  }
  KVFLOW_CUDA_RETURN(cudaSetDevice(options_.device));
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  const size_t bytes = 2 * static_cast<size_t>(layout_.num_blocks - first) * layout_.block_stride() *
                       static_cast<size_t>(layout_.num_layers) * cuda::DTypeSize(dtype_);
  KVFLOW_RETURN_IF_ERROR(resident_arena_.Allocate(bytes, "the resident KV blocks"));
  resident_begin_ = first;
  return Status::Ok();
}

Status CudaBackend::PrefetchKv(int layer, std::span<const KvHeadSelection> selection) {
  if (!staged_step()) return Status::Ok();
  if (batch_ == nullptr) return Status::Internal("KV prefetch outside a step");
  if (layer < 0 || layer >= config_.num_layers) return Status::InvalidArgument("KV prefetch: no such layer");
  if (!selection.empty()) KVFLOW_RETURN_IF_ERROR(ValidateKvHeadSelections(selection, *batch_, layout_));
  const int buffer = layer % KvStagingLedger::kBuffers;
  // Device speculations of this layer: only their rows cross the bus, gathered from the host pool
  // on the copy stream into the layer parity's selection buffer (whose jobs go up first, so the
  // copy stream's wait below covers them).
  const bool speculated =
      std::any_of(selection.begin(), selection.end(), [](const KvHeadSelection& s) { return s.speculated; });
  const size_t block_bytes = layout_.block_stride() * cuda::DTypeSize(dtype_);
  const cuda::SelectedKvGatherJob* gather_jobs = nullptr;
  int num_gathers = 0;
  int64_t prefetch_blocks = 0;  // K's, then as many of V's
  if (speculated) {
    KVFLOW_ASSIGN_OR_RETURN(const std::vector<int> job_of, SpeculatedJobs(layer, selection));
    const int bs = layout_.block_size;
    int64_t blocks = 0, table_blocks = 0;
    for (size_t i = 0; i < selection.size(); ++i) {
      if (job_of[i] < 0) continue;
      blocks += (selection[i].per_head + bs - 1) / bs;
      table_blocks += (batch_->seqs[i].context_len + bs - 1) / bs;
      ++num_gathers;
    }
    KVFLOW_RETURN_IF_ERROR(GrowScratch(prefetched_selection_[buffer], 2 * static_cast<size_t>(blocks) * block_bytes,
                                       "the prefetched token selections", /*both_streams=*/true));
    const size_t jobs_bytes = AlignUp(static_cast<size_t>(num_gathers) * sizeof(cuda::SelectedKvGatherJob));
    const size_t tables_bytes = AlignUp(static_cast<size_t>(table_blocks) * sizeof(int32_t));
    char* host = nullptr;
    char* device = nullptr;
    KVFLOW_RETURN_IF_ERROR(StageBlockMeta(jobs_bytes + tables_bytes, &host, &device));
    // The selected rows only: the step's own K/V at this layer is written after this (WriteKv).
    FillSpeculatedGather(layer, selection, job_of, SpeculatedRows::kSelected,
                         reinterpret_cast<cuda::SelectedKvGatherJob*>(host), reinterpret_cast<int32_t*>(host + jobs_bytes),
                         reinterpret_cast<const int32_t*>(device + jobs_bytes), nullptr);
    KVFLOW_CUDA_RETURN(cudaMemcpyAsync(device, host, jobs_bytes + tables_bytes, cudaMemcpyHostToDevice, stream_));
    KVFLOW_CUDA_RETURN(cudaEventRecord(block_meta_copied_, stream_));
    gather_jobs = reinterpret_cast<const cuda::SelectedKvGatherJob*>(device);
    prefetch_blocks = blocks;
  }
  // The buffer held layer - 2, whose attention is queued on the compute stream: copy after it.
  KVFLOW_CUDA_RETURN(cudaEventRecord(staging_free_, stream_));
  KVFLOW_CUDA_RETURN(cudaStreamWaitEvent(copy_stream_, staging_free_, 0));
  KVFLOW_RETURN_IF_ERROR(StageViews(layer, selection, copy_stream_));
  if (num_gathers > 0) {
    char* key = prefetched_selection_[buffer].base();
    KVFLOW_KERNEL_RETURN(cuda::GatherSelectedKv(dtype_, PoolLayer(0, layer), PoolLayer(1, layer), gather_jobs,
                                                num_gathers, key, key + static_cast<size_t>(prefetch_blocks) * block_bytes,
                                                config_.num_kv_heads, config_.head_dim, layout_.block_size,
                                                copy_stream_));
    prefetched_selection_layer_[buffer] = layer;
  }
  KVFLOW_CUDA_RETURN(cudaEventRecord(staged_[buffer], copy_stream_));
  ledger_.Record(layer, selection, batch_->seqs.size());
  staged_async_[buffer] = true;
  offload_stats_.prefetches += 1;
  return Status::Ok();
}

Status CudaBackend::EnsureStaged(int layer, std::span<const KvHeadSelection> selection) {
  const int buffer = KvStagingLedger::BufferOf(layer);
  KVFLOW_ASSIGN_OR_RETURN(const bool staged, ledger_.Holds(layer, selection, batch_->seqs.size()));
  if (staged) {
    if (staged_async_[buffer]) {  // WriteKv normally waited already
      KVFLOW_CUDA_RETURN(cudaStreamWaitEvent(stream_, staged_[buffer], 0));
      staged_async_[buffer] = false;
    }
    return Status::Ok();
  }
  // Nothing prefetched: copy on the compute stream, after the write-through of this step's K/V.
  KVFLOW_RETURN_IF_ERROR(StageViews(layer, selection, stream_));
  ledger_.Record(layer, selection, batch_->seqs.size());
  offload_stats_.on_demand_fetches += 1;
  return Status::Ok();
}

// General moves run on the compute stream, so they are ordered with the steps around them; each
// (transfer, layer, K or V) is one 2D copy: a run of num_tokens slots per KV head, the heads a
// block's head stride apart (kv/kv_cache_layout.h).
Status CudaBackend::TransferKv(std::span<const KvTransfer> transfers) {
  KVFLOW_RETURN_IF_ERROR(ValidateKvTransfers(transfers, layout_, num_host_blocks_));
  const size_t es = cuda::DTypeSize(dtype_);
  const size_t head_bytes = layout_.head_stride() * es;
  auto pool = [&](KvTier tier, int kv, int layer, BlockId block) -> char* {
    if (tier == KvTier::kHost) {
      char* base = kv == 0 ? host_key_pool_ : host_value_pool_;
      return base + static_cast<size_t>(layer) * layout_.block_stride() * es * static_cast<size_t>(num_host_blocks_);
    }
    return DeviceTierLayer(kv, layer, block);
  };
  for (const KvTransfer& t : transfers) {
    if (t.num_tokens == 0) continue;
    // An offloaded pool is host memory too: let the runtime tell the kinds apart.
    const cudaMemcpyKind kind = options_.kv_offload ? cudaMemcpyDefault
                              : t.src_tier == KvTier::kHost
                                    ? (t.dst_tier == KvTier::kHost ? cudaMemcpyHostToHost : cudaMemcpyHostToDevice)
                                    : (t.dst_tier == KvTier::kHost ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice);
    const size_t width = static_cast<size_t>(t.num_tokens) * layout_.head_dim * es;
    for (int layer = t.layer_begin; layer < t.layer_end; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        const char* src = pool(t.src_tier, kv, layer, t.src_block) + layout_.offset(t.src_block, 0, t.src_offset) * es;
        char* dst = pool(t.dst_tier, kv, layer, t.dst_block) + layout_.offset(t.dst_block, 0, t.dst_offset) * es;
        KVFLOW_CUDA_RETURN(cudaMemcpy2DAsync(dst, head_bytes, src, head_bytes, width, layout_.num_kv_heads, kind,
                                             stream_));
      }
    }
  }
  return Status::Ok();
}

}  // namespace cuda_impl
}  // namespace kvflow
