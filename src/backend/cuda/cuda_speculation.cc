// InfiniGen's speculation on the device (DeviceKvSpeculation): the paged partial key cache, the
// speculative query's rotation and skew, the scores and the selection, all in
// kernels/infinigen_score.cu and all on the compute stream, so a decode step's selection never
// crosses to the host. Attention (cuda_attention.cc) and an offloaded pool's prefetch
// (cuda_kv_tier.cc) read the selection where it lies.
#include <algorithm>
#include <cmath>
#include <limits>

#include "backend/cuda/cuda_backend_impl.h"
#include "infinigen_score.h"

namespace kvflow {
namespace cuda_impl {
namespace {

// Device memory the partial key cache leaves free (as the memory plan's reserve does).
constexpr size_t kSpeculationReserveBytes = size_t{512} << 20;

// The checks every job shares: a slice of the step whose chunks hold `rows` rows.
Status CheckRows(const DeviceKvSpeculation::PartialKeyRows& r, int64_t rows, const ForwardBatch& batch, int num_chunks,
                 int chunk_rows) {
  if (r.slice < 0 || static_cast<size_t>(r.slice) >= batch.seqs.size()) {
    return Status::InvalidArgument(fmt::format("device speculation: slice {} of a batch of {}", r.slice, batch.seqs.size()));
  }
  if (static_cast<int64_t>(r.chunks.size()) * chunk_rows < rows) {
    return Status::InvalidArgument(fmt::format("device speculation: {} partial key chunks cannot hold {} rows",
                                               r.chunks.size(), rows));
  }
  for (int32_t c : r.chunks) {
    if (c < 0 || c >= num_chunks) {
      return Status::InvalidArgument(fmt::format("device speculation: partial key chunk {} of {}", c, num_chunks));
    }
  }
  return Status::Ok();
}

}  // namespace

int64_t CudaBackend::partial_key_chunk_bytes(int num_partial_columns) const {
  return static_cast<int64_t>(config_.num_layers) * config_.num_kv_heads * kPartialKeyChunkRows * num_partial_columns *
         static_cast<int64_t>(sizeof(float));
}

float* CudaBackend::PartialKeys(int layer, int kv_head) const {
  const size_t head = static_cast<size_t>(speculation_chunks_) * kPartialKeyChunkRows * speculation_columns_;
  return reinterpret_cast<float*>(partial_key_arena_.base()) +
         (static_cast<size_t>(layer) * config_.num_kv_heads + static_cast<size_t>(kv_head)) * head;
}

Status CudaBackend::SetUpSpeculation(const Setup& setup) {
  if (in_step_) return Status::Internal("SetUpSpeculation inside a step");
  if (speculation_columns_ > 0) return Status::Internal("the device speculation is set up already");
  const int L = config_.num_layers, KV = config_.num_kv_heads, D = config_.head_dim, P = setup.num_partial_columns;
  if (P <= 0 || P > D) {
    return Status::InvalidArgument(fmt::format("device speculation: {} partial columns of head_dim {}", P, D));
  }
  if (D > 256 || D % 2 != 0) {
    return Status::Unsupported(fmt::format("device speculation needs an even head_dim of at most 256, not {}", D));
  }
  if (static_cast<int64_t>(setup.matrices.size()) != static_cast<int64_t>(L) * KV * D * D ||
      static_cast<int64_t>(setup.columns.size()) != static_cast<int64_t>(L) * KV * P) {
    return Status::InvalidArgument("device speculation: skew matrices or columns of the wrong size for the model");
  }
  for (int32_t c : setup.columns) {
    if (c < 0 || c >= D) return Status::InvalidArgument(fmt::format("device speculation: skew column {} of head_dim {}", c, D));
  }
  if (setup.num_chunks <= 0) return Status::InvalidArgument("device speculation: no partial key chunks");
  if (!(setup.alpha > 0.0f) || !std::isfinite(setup.alpha)) return Status::InvalidArgument("device speculation: alpha must be > 0");
  KVFLOW_CUDA_RETURN(cudaSetDevice(options_.device));
  const size_t cache_bytes = static_cast<size_t>(setup.num_chunks) * static_cast<size_t>(partial_key_chunk_bytes(P));
  // The cache comes after the memory plan (the skewing file is read after the backend is made):
  // it may take what is free beyond the plan's reserve for CUDA graphs and cuBLAS, no more.
  size_t free_bytes = 0, total_bytes = 0;
  KVFLOW_CUDA_RETURN(cudaMemGetInfo(&free_bytes, &total_bytes));
  Status cache = Status::Ok();
  if (cache_bytes + kSpeculationReserveBytes > free_bytes) {
    cache = Status::OutOfMemory(fmt::format("{:.2f} GiB free, {:.2f} GiB of it kept for CUDA graphs and cuBLAS",
                                            free_bytes / double(1 << 30), kSpeculationReserveBytes / double(1 << 30)));
  } else {
    cache = partial_key_arena_.Allocate(cache_bytes, "InfiniGen's partial key cache");
  }
  if (!cache.ok()) {
    return Status::ResourceExhausted(fmt::format(
        "InfiniGen's partial key cache on the device: {} chunks of {} tokens ({} layers x {} KV heads x {} fp32 "
        "columns) need {:.2f} GiB: {}",
        setup.num_chunks, kPartialKeyChunkRows, L, KV, P, cache_bytes / double(1 << 30), cache.message()));
  }
  const size_t matrix_bytes = AlignUp(setup.matrices.size() * sizeof(float));
  KVFLOW_RETURN_IF_ERROR(skew_arena_.Allocate(matrix_bytes + setup.columns.size() * sizeof(int32_t), "the skew matrices"));
  KVFLOW_CUDA_RETURN(cudaMemcpy(skew_arena_.base(), setup.matrices.data(), setup.matrices.size() * sizeof(float),
                                cudaMemcpyHostToDevice));
  KVFLOW_CUDA_RETURN(cudaMemcpy(skew_arena_.base() + matrix_bytes, setup.columns.data(),
                                setup.columns.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  skew_matrices_ = reinterpret_cast<const float*>(skew_arena_.base());
  skew_columns_ = reinterpret_cast<const int32_t*>(skew_arena_.base() + matrix_bytes);
  KVFLOW_RETURN_IF_ERROR(count_log_arena_.Allocate(2 * static_cast<size_t>(L) * max_seqs_ * sizeof(int32_t),
                                                   "the speculated counts"));
  speculation_columns_ = P;
  speculation_chunks_ = setup.num_chunks;
  speculation_alpha_ = setup.alpha;
  return Status::Ok();
}

Status CudaBackend::ExtendPartialKeys(int layer, std::span<const ExtendJob> jobs) {
  if (!in_step_ || batch_ == nullptr) return Status::Internal("partial keys outside a step");
  if (speculation_columns_ == 0) return Status::Internal("partial keys before SetUpSpeculation");
  if (layer < 0 || layer >= config_.num_layers) return Status::InvalidArgument("partial keys: layer out of range");
  const ForwardBatch& batch = *batch_;
  const int KV = config_.num_kv_heads, D = config_.head_dim, P = speculation_columns_, bs = layout_.block_size;
  int64_t num_slots = 0, num_chunk_ids = 0;
  int max_slots = 0, num_jobs = 0;
  for (const ExtendJob& j : jobs) {
    KVFLOW_RETURN_IF_ERROR(CheckRows(j.rows, j.to, batch, speculation_chunks_, kPartialKeyChunkRows));
    const SequenceSlice& s = batch.seqs[static_cast<size_t>(j.rows.slice)];
    if (j.from < 0 || j.from > j.to || j.to > s.context_len) {
      return Status::InvalidArgument(fmt::format("partial keys: positions [{}, {}) of a sequence of {}", j.from, j.to,
                                                 s.context_len));
    }
    if (j.to == j.from) continue;
    num_slots += j.to - j.from;
    num_chunk_ids += static_cast<int64_t>(j.rows.chunks.size());
    max_slots = std::max(max_slots, j.to - j.from);
    num_jobs += KV;
  }
  if (num_jobs == 0) return Status::Ok();
  if (num_jobs > 65535) return Status::Unsupported("partial keys: more than 65535 (sequence, KV head) jobs in one call");
  KVFLOW_RETURN_IF_ERROR(RefuseUnderCapture("device speculation"));
  const size_t slots_bytes = AlignUp(static_cast<size_t>(num_slots) * sizeof(int64_t));
  const size_t jobs_bytes = AlignUp(static_cast<size_t>(num_jobs) * sizeof(cuda::InfiniGenSkewJob));
  const size_t chunks_bytes = AlignUp(static_cast<size_t>(num_chunk_ids) * sizeof(int32_t));
  char* host = nullptr;
  char* device = nullptr;
  KVFLOW_RETURN_IF_ERROR(StageBlockMeta(slots_bytes + jobs_bytes + chunks_bytes, &host, &device));
  auto* slots = reinterpret_cast<int64_t*>(host);
  auto* skew_jobs = reinterpret_cast<cuda::InfiniGenSkewJob*>(host + slots_bytes);
  auto* chunk_ids = reinterpret_cast<int32_t*>(host + slots_bytes + jobs_bytes);
  const auto* device_chunks = reinterpret_cast<const int32_t*>(device + slots_bytes + jobs_bytes);
  int64_t slot_at = 0, chunk_at = 0;
  int k = 0;
  for (const ExtendJob& j : jobs) {
    if (j.to == j.from) continue;
    const SequenceSlice& s = batch.seqs[static_cast<size_t>(j.rows.slice)];
    const int64_t first_slot = slot_at;
    for (int32_t pos = j.from; pos < j.to; ++pos) slots[slot_at++] = SlotOf(s.block_table, pos, bs);
    std::copy(j.rows.chunks.begin(), j.rows.chunks.end(), chunk_ids + chunk_at);
    for (int h = 0; h < KV; ++h) {
      cuda::InfiniGenSkewJob& job = skew_jobs[k++];
      job = cuda::InfiniGenSkewJob{};
      const size_t lh = static_cast<size_t>(layer) * KV + static_cast<size_t>(h);
      job.matrix = skew_matrices_ + lh * D * D;
      job.columns = skew_columns_ + lh * P;
      job.dst = PartialKeys(layer, h);
      job.chunks = device_chunks + chunk_at;
      job.dst_row = j.from;
      job.kv_head = h;
      job.first_slot = static_cast<int32_t>(first_slot);
      job.num_slots = j.to - j.from;
    }
    chunk_at += static_cast<int64_t>(j.rows.chunks.size());
  }
  if (slot_at > std::numeric_limits<int32_t>::max()) return Status::Unsupported("partial keys: too many slots in one call");
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(device, host, slots_bytes + jobs_bytes + chunks_bytes, cudaMemcpyHostToDevice, stream_));
  KVFLOW_CUDA_RETURN(cudaEventRecord(block_meta_copied_, stream_));
  cuda::SkewPartialKeysArgs a;
  a.dtype = dtype_;
  // The pool wherever it lives: an offloaded pool's keys are read over the bus (new tokens only,
  // but a whole prompt at its prefill).
  a.key_cache = PoolLayer(0, layer);
  a.slots = reinterpret_cast<const int64_t*>(device);
  a.jobs = reinterpret_cast<const cuda::InfiniGenSkewJob*>(device + slots_bytes);
  a.num_jobs = num_jobs;
  a.max_job_slots = max_slots;
  a.num_kv_heads = KV;
  a.head_dim = D;
  a.block_size = bs;
  a.num_partial_columns = P;
  a.chunk_rows = kPartialKeyChunkRows;
  KVFLOW_KERNEL_RETURN(cuda::SkewPartialKeys(a, stream_));
  return Status::Ok();
}

Status CudaBackend::Speculate(int layer, std::span<const SpeculateJob> jobs) {
  if (!in_step_ || batch_ == nullptr) return Status::Internal("speculation outside a step");
  if (speculation_columns_ == 0) return Status::Internal("speculation before SetUpSpeculation");
  if (layer < 0 || layer >= config_.num_layers) return Status::InvalidArgument("speculation: layer out of range");
  const ForwardBatch& batch = *batch_;
  const int NH = config_.num_heads, KV = config_.num_kv_heads, D = config_.head_dim, P = speculation_columns_;
  const int group = NH / KV, n = static_cast<int>(jobs.size());
  SpeculatedLayer& record = speculated_[layer % 2];
  record = SpeculatedLayer{};
  if (n == 0) return Status::Ok();
  if (static_cast<int64_t>(n) * KV > 65535) return Status::Unsupported("speculation: more than 65535 jobs in one call");
  int64_t num_scores = 0, num_indices = 0, num_chunk_ids = 0;
  int max_candidates = 0;
  for (const SpeculateJob& j : jobs) {
    KVFLOW_RETURN_IF_ERROR(CheckRows(j.rows, j.candidates, batch, speculation_chunks_, kPartialKeyChunkRows));
    const SequenceSlice& s = batch.seqs[static_cast<size_t>(j.rows.slice)];
    if (s.num_tokens != 1 || j.candidates < 1 || j.candidates > s.context_len - 1 || j.cap < 1 || j.cap > j.candidates) {
      return Status::InvalidArgument(fmt::format(
          "speculation of slice {}: {} candidates capped at {} for a step of {} tokens at context {}", j.rows.slice,
          j.candidates, j.cap, s.num_tokens, s.context_len));
    }
    num_scores += static_cast<int64_t>(KV) * j.candidates;
    num_indices += static_cast<int64_t>(KV) * j.cap;
    num_chunk_ids += static_cast<int64_t>(j.rows.chunks.size());
    max_candidates = std::max(max_candidates, j.candidates);
  }
  for (size_t a = 1; a < jobs.size(); ++a) {
    if (jobs[a].rows.slice <= jobs[a - 1].rows.slice) return Status::InvalidArgument("speculation: slices not ascending");
  }
  KVFLOW_RETURN_IF_ERROR(RefuseUnderCapture("device speculation"));

  // Scratch: skewed queries [n][NH][P], scores, per-head counts [n][KV].
  const size_t queries_bytes = AlignUp(static_cast<size_t>(n) * NH * P * sizeof(float));
  const size_t scores_bytes = AlignUp(static_cast<size_t>(num_scores) * sizeof(float));
  const size_t head_counts_bytes = AlignUp(static_cast<size_t>(n) * KV * sizeof(int32_t));
  KVFLOW_RETURN_IF_ERROR(GrowScratch(speculation_scratch_, queries_bytes + scores_bytes + head_counts_bytes,
                                     "the speculation scratch"));
  // The indices outlive the call (attention, or the copy stream's prefetch, reads them).
  KVFLOW_RETURN_IF_ERROR(GrowScratch(speculated_indices_[layer % 2], static_cast<size_t>(num_indices) * sizeof(int32_t),
                                     "the speculated indices", /*both_streams=*/true));
  if (count_log_used_ + n > 2 * static_cast<int64_t>(config_.num_layers) * max_seqs_) {
    return Status::Internal("speculation: more speculations in one step than layers");
  }
  float* queries = reinterpret_cast<float*>(speculation_scratch_.base());
  float* scores = reinterpret_cast<float*>(speculation_scratch_.base() + queries_bytes);
  auto* head_counts = reinterpret_cast<int32_t*>(speculation_scratch_.base() + queries_bytes + scores_bytes);
  auto* indices = reinterpret_cast<int32_t*>(speculated_indices_[layer % 2].base());
  auto* count_log = reinterpret_cast<int32_t*>(count_log_arena_.base());

  // Staged: [query rows][score jobs][select jobs][chunk tables].
  const size_t rows_bytes = AlignUp(static_cast<size_t>(n) * sizeof(int32_t));
  const size_t score_jobs_bytes = AlignUp(static_cast<size_t>(n) * KV * sizeof(cuda::PartialKeyScoreJob));
  const size_t select_jobs_bytes = AlignUp(static_cast<size_t>(n) * sizeof(cuda::SpeculationSelectJob));
  const size_t chunks_bytes = AlignUp(static_cast<size_t>(num_chunk_ids) * sizeof(int32_t));
  const size_t total = rows_bytes + score_jobs_bytes + select_jobs_bytes + chunks_bytes;
  char* host = nullptr;
  char* device = nullptr;
  KVFLOW_RETURN_IF_ERROR(StageBlockMeta(total, &host, &device));
  auto* rows = reinterpret_cast<int32_t*>(host);
  auto* score_jobs = reinterpret_cast<cuda::PartialKeyScoreJob*>(host + rows_bytes);
  auto* select_jobs = reinterpret_cast<cuda::SpeculationSelectJob*>(host + rows_bytes + score_jobs_bytes);
  auto* chunk_ids = reinterpret_cast<int32_t*>(host + rows_bytes + score_jobs_bytes + select_jobs_bytes);
  const auto* device_chunks =
      reinterpret_cast<const int32_t*>(device + rows_bytes + score_jobs_bytes + select_jobs_bytes);
  int64_t score_at = 0, index_at = 0, chunk_at = 0;
  for (int j = 0; j < n; ++j) {
    const SpeculateJob& job = jobs[static_cast<size_t>(j)];
    rows[j] = batch.seqs[static_cast<size_t>(job.rows.slice)].token_offset;
    std::copy(job.rows.chunks.begin(), job.rows.chunks.end(), chunk_ids + chunk_at);
    for (int h = 0; h < KV; ++h) {
      cuda::PartialKeyScoreJob& sj = score_jobs[static_cast<size_t>(j) * KV + h];
      sj = cuda::PartialKeyScoreJob{};
      sj.queries = queries + (static_cast<size_t>(j) * NH + static_cast<size_t>(h) * group) * P;
      sj.keys = PartialKeys(layer, h);
      sj.chunks = device_chunks + chunk_at;
      sj.scores = scores + score_at + static_cast<int64_t>(h) * job.candidates;
      sj.num_tokens = job.candidates;
    }
    cuda::SpeculationSelectJob& sel = select_jobs[j];
    sel = cuda::SpeculationSelectJob{};
    sel.scores = scores + score_at;
    sel.score_head_stride = job.candidates;
    sel.num_tokens = job.candidates;
    sel.cap = job.cap;
    sel.indices = indices + index_at;
    sel.count = count_log + count_log_used_ + j;
    record.slices.push_back(job.rows.slice);
    record.caps.push_back(job.cap);
    record.index_offset.push_back(index_at);
    record.count_offset.push_back(count_log_used_ + j);
    score_at += static_cast<int64_t>(KV) * job.candidates;
    index_at += static_cast<int64_t>(KV) * job.cap;
    chunk_at += static_cast<int64_t>(job.rows.chunks.size());
  }
  count_log_used_ += n;
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(device, host, total, cudaMemcpyHostToDevice, stream_));
  KVFLOW_CUDA_RETURN(cudaEventRecord(block_meta_copied_, stream_));

  cuda::SkewPartialQueriesArgs q;
  q.dtype = dtype_;
  q.rows = speculative_qkv_;
  q.row_stride = ActivationWidth(Activation::kSpeculativeQkv);
  q.num_rows = n;
  q.row_indices = reinterpret_cast<const int32_t*>(device);
  q.positions = device_meta_.positions;
  q.inv_freq = inv_freq_;
  q.attention_scale = attention_scale_;
  q.num_heads = NH;
  q.num_kv_heads = KV;
  q.head_dim = D;
  q.num_partial_columns = P;
  q.scale = config_.AttentionScale();
  q.matrices = skew_matrices_ + static_cast<size_t>(layer) * KV * D * D;
  q.columns = skew_columns_ + static_cast<size_t>(layer) * KV * P;
  q.out = queries;
  KVFLOW_KERNEL_RETURN(cuda::SkewPartialQueries(q, stream_));
  KVFLOW_KERNEL_RETURN(cuda::ScorePartialKeys(reinterpret_cast<const cuda::PartialKeyScoreJob*>(device + rows_bytes),
                                              n * KV, max_candidates, group, P, stream_, kPartialKeyChunkRows));
  cuda::SelectSpeculatedTokensArgs s;
  s.jobs = reinterpret_cast<const cuda::SpeculationSelectJob*>(device + rows_bytes + score_jobs_bytes);
  s.num_jobs = n;
  s.num_kv_heads = KV;
  s.alpha = speculation_alpha_;
  s.head_counts = head_counts;
  KVFLOW_KERNEL_RETURN(cuda::SelectSpeculatedTokens(s, stream_));
  record.layer = layer;
  return Status::Ok();
}

Status CudaBackend::BeginSpeculationStep() {
  speculated_[0].layer = speculated_[1].layer = -1;
  prefetched_selection_layer_[0] = prefetched_selection_layer_[1] = -1;
  // The log holds two steps: move it to the host (waiting for the last step) when the selector has
  // not taken it for a whole one.
  if (count_log_used_ <= static_cast<int64_t>(config_.num_layers) * max_seqs_) return Status::Ok();
  return MoveCountLogToHost();
}

Status CudaBackend::MoveCountLogToHost() {
  if (count_log_used_ == 0) return Status::Ok();
  std::vector<int32_t> counts(static_cast<size_t>(count_log_used_));
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(counts.data(), count_log_arena_.base(), counts.size() * sizeof(int32_t),
                                     cudaMemcpyDeviceToHost, stream_));
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  taken_counts_.insert(taken_counts_.end(), counts.begin(), counts.end());
  count_log_used_ = 0;
  return Status::Ok();
}

Status CudaBackend::TakeSpeculatedCounts(std::vector<int32_t>& counts) {
  if (in_step_) return Status::Internal("TakeSpeculatedCounts inside a step");
  KVFLOW_CUDA_RETURN(cudaSetDevice(options_.device));
  KVFLOW_RETURN_IF_ERROR(MoveCountLogToHost());
  if (options_.kv_offload) {
    // Each speculation's rows (and the step's own token) crossed the bus once.
    for (int32_t c : taken_counts_) offload_stats_.bytes_fetched += static_cast<int64_t>(c + 1) * kv_token_bytes();
  }
  counts.insert(counts.end(), taken_counts_.begin(), taken_counts_.end());
  taken_counts_.clear();
  return Status::Ok();
}

Status CudaBackend::ReadSpeculatedSelection(int layer, std::span<const KvHeadSelection> selection,
                                            std::vector<KvHeadSelection>& out) {
  if (!in_step_ || batch_ == nullptr) return Status::Internal("speculation read outside a step");
  KVFLOW_RETURN_IF_ERROR(ValidateKvHeadSelections(selection, *batch_, layout_));
  out.assign(selection.begin(), selection.end());
  if (std::none_of(selection.begin(), selection.end(), [](const KvHeadSelection& s) { return s.speculated; })) {
    return Status::Ok();
  }
  KVFLOW_ASSIGN_OR_RETURN(const std::vector<int> job_of, SpeculatedJobs(layer, selection));
  const SpeculatedLayer& record = speculated_[layer % 2];
  const int KV = config_.num_kv_heads, bs = layout_.block_size;
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  for (size_t i = 0; i < selection.size(); ++i) {
    if (job_of[i] < 0) continue;
    const size_t r = static_cast<size_t>(job_of[i]);
    const int cap = record.caps[r];
    int32_t count = 0;
    std::vector<int32_t> indices(static_cast<size_t>(KV) * cap);
    KVFLOW_CUDA_RETURN(cudaMemcpy(&count, count_log_arena_.base() + record.count_offset[r] * sizeof(int32_t),
                                  sizeof(int32_t), cudaMemcpyDeviceToHost));
    KVFLOW_CUDA_RETURN(cudaMemcpy(indices.data(),
                                  speculated_indices_[layer % 2].base() + record.index_offset[r] * sizeof(int32_t),
                                  indices.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
    if (count < 1 || count > cap) return Status::Internal(fmt::format("speculated count {} of cap {}", count, cap));
    const SequenceSlice& s = batch_->seqs[i];
    KvHeadSelection& sel = out[i];
    sel.speculated = false;
    sel.per_head = count + 1;
    sel.slots.resize(static_cast<size_t>(KV) * sel.per_head);
    for (int h = 0; h < KV; ++h) {
      int64_t* slots = sel.slots.data() + static_cast<size_t>(h) * sel.per_head;
      for (int t = 0; t < count; ++t) slots[t] = SlotOf(s.block_table, indices[static_cast<size_t>(h) * cap + t], bs);
      slots[count] = SlotOf(s.block_table, s.context_len - 1, bs);
    }
  }
  return Status::Ok();
}

Result<std::vector<int>> CudaBackend::SpeculatedJobs(int layer, std::span<const KvHeadSelection> selection) const {
  const SpeculatedLayer& record = speculated_[layer % 2];
  std::vector<int> job_of(selection.size(), -1);
  size_t next = 0;
  for (size_t i = 0; i < selection.size(); ++i) {
    const KvHeadSelection& sel = selection[i];
    if (sel.per_head == 0) continue;
    if (!sel.speculated) {
      return Status::Unsupported("attention over both device speculations and host token selections in one call");
    }
    if (record.layer != layer || next >= record.slices.size() || record.slices[next] != static_cast<int32_t>(i)) {
      return Status::Internal(fmt::format("layer {}'s attention reads a device speculation that was not made for it", layer));
    }
    if (sel.per_head != record.caps[next] + 1) {
      return Status::Internal(fmt::format("layer {}'s speculated selection of slice {}: {} tokens per head, not its cap "
                                          "{} and the step's own",
                                          layer, i, sel.per_head, record.caps[next]));
    }
    job_of[i] = static_cast<int>(next++);
  }
  if (next != record.slices.size() && record.layer == layer) {
    return Status::Internal(fmt::format("layer {}'s attention leaves out speculations made for it", layer));
  }
  return job_of;
}

void CudaBackend::FillSpeculatedGather(int layer, std::span<const KvHeadSelection> selection,
                                       const std::vector<int>& job_of, SpeculatedRows rows,
                                       cuda::SelectedKvGatherJob* jobs, int32_t* tables, const int32_t* device_tables,
                                       int32_t* context_out) const {
  const SpeculatedLayer& record = speculated_[layer % 2];
  const int bs = layout_.block_size;
  const auto* indices = reinterpret_cast<const int32_t*>(speculated_indices_[layer % 2].base());
  const auto* count_log = reinterpret_cast<const int32_t*>(count_log_arena_.base());
  int32_t first_block = 0;
  int64_t table_at = 0;
  int k = 0;
  for (size_t i = 0; i < selection.size(); ++i) {
    if (job_of[i] < 0) continue;
    const size_t r = static_cast<size_t>(job_of[i]);
    const SequenceSlice& s = batch_->seqs[i];
    const int32_t blocks_used = (s.context_len + bs - 1) / bs;
    std::copy_n(s.block_table.begin(), blocks_used, tables + table_at);
    cuda::SelectedKvGatherJob& j = jobs[k];
    j = cuda::SelectedKvGatherJob{};
    j.block_table = device_tables + table_at;
    j.positions = indices + record.index_offset[r];
    j.position_head_stride = record.caps[r];
    j.count = count_log + record.count_offset[r];
    if (rows != SpeculatedRows::kSelected) j.append_position = s.context_len - 1;  // the step's own token, last
    j.only_appended = rows == SpeculatedRows::kStepToken;
    j.first_block = first_block;
    j.num_blocks = (selection[i].per_head + bs - 1) / bs;
    j.context_len = context_out == nullptr ? nullptr : context_out + k;
    first_block += j.num_blocks;
    table_at += blocks_used;
    ++k;
  }
}

}  // namespace cuda_impl
}  // namespace kvflow
