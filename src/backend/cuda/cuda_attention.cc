// Paged attention and KV writes, and InfiniGen's and H2O's token selections with the reads they make.
#include "backend/cuda/cuda_backend_impl.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include <spdlog/fmt/fmt.h>

#include "attention_decode.h"
#include "attention_prefill.h"
#include "cache_ops.h"
#include "infinigen_score.h"

namespace kvflow {
namespace cuda_impl {
namespace {

// fp16/bf16 -> fp32 on the host (exact), for the reads the selectors make.
void WidenToFloat(const uint16_t* src, size_t n, DType t, float* dst) {
  if (t == DType::kF16) {
    for (size_t i = 0; i < n; ++i) {
      __half h;
      std::memcpy(static_cast<void*>(&h), &src[i], 2);
      dst[i] = __half2float(h);
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
      std::memcpy(&dst[i], &bits, 4);
    }
  }
}

}  // namespace

Status CudaBackend::WriteKv(int layer) {
  const int NH = config_.num_heads, KV = config_.num_kv_heads, D = config_.head_dim;
  const int QKV = ActivationWidth(Activation::kQkv);
  const size_t es = cuda::DTypeSize(dtype_);
  const size_t layer_bytes = layout_.layer_stride() * es;
  char* qkv = static_cast<char*>(qkv_);
  // A resident step writes only the resident arena (its blocks have no host copy).
  char* key_cache = resident_step_ ? ResidentLayer(0, layer) : key_pool_ + layer * layer_bytes;
  char* value_cache = resident_step_ ? ResidentLayer(1, layer) : value_pool_ + layer * layer_bytes;
  KVFLOW_KERNEL_RETURN(cuda::ReshapeAndCache(dtype_, qkv + static_cast<size_t>(NH) * D * es, QKV,
                                             qkv + static_cast<size_t>(NH + KV) * D * es, QKV, key_cache, value_cache,
                                             device_meta_.slot_mapping, step_.num_tokens, KV, D, layout_.block_size,
                                             stream_));
  if (staged_step()) {
    // Written through to the host pool (above) and into the layer's staging buffer, after the
    // prefetch that fills it (whose copies of these slots are stale).
    const int buffer = KvStagingLedger::BufferOf(layer);
    if (ledger_.HoldsLayer(layer) && staged_async_[buffer]) {
      KVFLOW_CUDA_RETURN(cudaStreamWaitEvent(stream_, staged_[buffer], 0));
      staged_async_[buffer] = false;
    }
    KVFLOW_KERNEL_RETURN(cuda::ReshapeAndCache(dtype_, qkv + static_cast<size_t>(NH) * D * es, QKV,
                                               qkv + static_cast<size_t>(NH + KV) * D * es, QKV, StagingLayer(0, layer),
                                               StagingLayer(1, layer), device_meta_.slot_mapping, step_.num_tokens, KV,
                                               D, layout_.block_size, stream_));
    offload_stats_.bytes_written += static_cast<int64_t>(step_.num_tokens) * kv_token_bytes();
  }
  return Status::Ok();
}

Status CudaBackend::Attention(int layer) {
  attention_window_ = config_.LayerWindow(layer);
  const StepMetadata& m = device_meta_;
  const size_t layer_bytes = layout_.layer_stride() * cuda::DTypeSize(dtype_);
  const char* key_cache = key_pool_ + layer * layer_bytes;
  const char* value_cache = value_pool_ + layer * layer_bytes;
  if (resident_step_) {
    key_cache = ResidentLayer(0, layer);
    value_cache = ResidentLayer(1, layer);
  } else if (options_.kv_offload) {
    KVFLOW_RETURN_IF_ERROR(EnsureStaged(layer, {}));
    key_cache = StagingLayer(0, layer);
    value_cache = StagingLayer(1, layer);
  }
  // Slot views read the layer's gathered copy of their slots (the K/V this step wrote included).
  if (step_.num_gathered_slots > 0) {
    KVFLOW_KERNEL_RETURN(cuda::GatherSlots(dtype_, key_cache, value_cache, m.gather_slots, step_.num_gathered_slots,
                                           gather_key_, gather_value_, config_.num_kv_heads, config_.head_dim,
                                           layout_.block_size, stream_));
  }
  const size_t table = static_cast<size_t>(max_blocks_per_seq_);
  if (step_.num_decode > 0) {
    KVFLOW_RETURN_IF_ERROR(DecodeRows(m.decode_block_tables, max_blocks_per_seq_, m.decode_context_lens,
                                      m.decode_query_rows, step_.num_decode, step_.max_decode_context, key_cache,
                                      value_cache));
  }
  if (step_.num_gathered_decode > 0) {
    const size_t first = static_cast<size_t>(step_.num_decode);
    KVFLOW_RETURN_IF_ERROR(DecodeRows(m.decode_block_tables + first * table, max_blocks_per_seq_,
                                      m.decode_context_lens + first, m.decode_query_rows + first,
                                      step_.num_gathered_decode, step_.max_gathered_decode_context, gather_key_,
                                      gather_value_));
  }
  if (step_.num_prefill > 0) {
    KVFLOW_RETURN_IF_ERROR(PrefillRows(m.prefill_block_tables, max_blocks_per_seq_, m.prefill_context_lens,
                                       m.prefill_query_starts, m.prefill_query_lens, step_.num_prefill,
                                       step_.max_prefill_query, key_cache, value_cache));
  }
  if (step_.num_gathered_prefill > 0) {
    const size_t first = static_cast<size_t>(step_.num_prefill);
    KVFLOW_RETURN_IF_ERROR(PrefillRows(m.prefill_block_tables + first * table, max_blocks_per_seq_,
                                       m.prefill_context_lens + first, m.prefill_query_starts + first,
                                       m.prefill_query_lens + first, step_.num_gathered_prefill,
                                       step_.max_gathered_prefill_query, gather_key_, gather_value_));
  }
  return Status::Ok();
}

// The fields the paged decode and prefill kernels' arguments share: the step's Q/attention rows,
// the model's heads, the pools and the block tables.
template <typename Args>
void CudaBackend::FillAttentionArgs(Args& a, const int32_t* tables, int table_stride, const int32_t* context_lens,
                                    int count, const void* keys, const void* values) const {
  a.dtype = dtype_;
  a.out = attn_;
  a.out_row_stride = ActivationWidth(Activation::kAttention);
  a.query = qkv_;
  a.query_row_stride = ActivationWidth(Activation::kQkv);
  a.block_table_stride = table_stride;
  a.num_heads = config_.num_heads;
  a.num_kv_heads = config_.num_kv_heads;
  a.head_dim = config_.head_dim;
  a.block_size = layout_.block_size;
  a.scale = config_.AttentionScale();
  a.window = attention_window_;
  a.softcap = config_.attn_logit_softcap;
  a.key_cache = keys;
  a.value_cache = values;
  a.block_tables = tables;
  a.context_lens = context_lens;
  a.num_seqs = count;
}

Status CudaBackend::DecodeRows(const int32_t* tables, int table_stride, const int32_t* context_lens,
                               const int32_t* query_rows, int count, int max_context, const void* keys,
                               const void* values) {
  cuda::PagedDecodeArgs a;
  FillAttentionArgs(a, tables, table_stride, context_lens, count, keys, values);
  a.query_rows = query_rows;
  a.max_context_len = max_context;
  a.workspace = decode_workspace_;
  a.workspace_bytes = decode_workspace_bytes_;
  KVFLOW_KERNEL_RETURN(cuda::PagedAttentionDecode(a, stream_));
  return Status::Ok();
}

Status CudaBackend::PrefillRows(const int32_t* tables, int table_stride, const int32_t* context_lens,
                                const int32_t* query_starts, const int32_t* query_lens, int count, int max_query,
                                const void* keys, const void* values) {
  cuda::PagedPrefillArgs a;
  FillAttentionArgs(a, tables, table_stride, context_lens, count, keys, values);
  a.query_starts = query_starts;
  a.query_lens = query_lens;
  a.max_query_len = max_query;
  KVFLOW_KERNEL_RETURN(cuda::PagedAttentionPrefill(a, stream_));
  return Status::Ok();
}

// ---- InfiniGen's and H2O's token selections ------------------------------------------------------

Status CudaBackend::RefuseUnderCapture(const char* what) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  KVFLOW_CUDA_RETURN(cudaStreamIsCapturing(stream_, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    return Status::Unsupported(fmt::format("{} cannot be captured in a CUDA graph: hooks that use it are not capturable",
                                           what));
  }
  return Status::Ok();
}

Status CudaBackend::GrowScratch(DeviceArena& arena, size_t bytes, const char* what, bool both_streams) {
  if (bytes <= arena.bytes()) return Status::Ok();
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  if (both_streams) KVFLOW_CUDA_RETURN(cudaStreamSynchronize(copy_stream_));
  // Half again, so a slowly growing selection reallocates (and waits) rarely; exactly `bytes` if
  // that much more does not fit.
  const size_t grown = AlignUp(std::max(bytes, arena.bytes() + arena.bytes() / 2));
  if (arena.Allocate(grown, what).ok()) return Status::Ok();
  return arena.Allocate(AlignUp(bytes), what);
}

// One call plans three kinds of kernel rows per kernel (decode, prefill), each read from its own
// K/V: the pool (a slice without selection, view of the whole table or a block subset), the step's
// slot-view scratch (a slice without selection whose view is explicit slots, as Attention reads
// it), and this call's selection scratch. The rows go up with the gather jobs in one staged copy.
Status CudaBackend::AttentionOverSelection(int layer, std::span<const KvHeadSelection> selection) {
  if (!in_step_ || batch_ == nullptr) return Status::Internal("attention outside a step");
  if (layer < 0 || layer >= config_.num_layers) return Status::InvalidArgument("attention: layer out of range");
  const ForwardBatch& batch = *batch_;
  KVFLOW_RETURN_IF_ERROR(ValidateKvHeadSelections(selection, batch, layout_));
  if (config_.sliding_window > 0) {
    return Status::Unsupported("attention over selected tokens in a model with a sliding window");
  }
  const bool any_selection =
      std::any_of(selection.begin(), selection.end(), [](const KvHeadSelection& s) { return s.per_head > 0; });
  if (!any_selection) return Attention(layer);
  KVFLOW_RETURN_IF_ERROR(RefuseUnderCapture("attention over token selections"));
  // Device speculations (DeviceKvSpeculation::Speculate): the indices and counts are on the device.
  const bool speculated =
      std::any_of(selection.begin(), selection.end(), [](const KvHeadSelection& s) { return s.speculated; });
  std::vector<int> job_of;
  if (speculated) {
    KVFLOW_ASSIGN_OR_RETURN(job_of, SpeculatedJobs(layer, selection));
  }
  // An offloaded pool's prefetch gathered the speculated rows already (PrefetchKv).
  const bool prefetched = speculated && staged_step() && prefetched_selection_layer_[layer % 2] == layer;
  const int bs = layout_.block_size, KV = config_.num_kv_heads;
  // GatherSelectedKv takes int32 positions: a physical slot is one through the identity table.
  const int64_t pool_slots = static_cast<int64_t>(layout_.num_blocks) * bs;
  if (pool_slots > std::numeric_limits<int32_t>::max()) {
    return Status::Unsupported(fmt::format("token selections over a pool of {} slots (more than int32)", pool_slots));
  }

  enum Source { kPool = 0, kSlotView = 1, kSelected = 2 };
  struct Row {
    int slice = 0;
    int context = 0;
    std::vector<int32_t> table;
  };
  std::vector<Row> decode_rows[3], prefill_rows[3];
  int table_stride = 1;
  int64_t next_slot_view_block = 0;  // PlanStep's numbering of the slot-view scratch
  int64_t selected_blocks = 0, selected_slots = 0, speculated_table_blocks = 0;
  int num_selected = 0;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const SequenceSlice& s = batch.seqs[i];
    const KvHeadSelection& sel = selection[i];
    Row row;
    row.slice = static_cast<int>(i);
    Source source;
    const bool slot_view = s.view.kind == KvView::Kind::kSlots;
    const int64_t slot_view_first = next_slot_view_block;
    if (slot_view) next_slot_view_block += (s.view_size() + bs - 1) / bs;
    if (sel.per_head > 0) {
      if (sel.per_head > options_.max_model_len) {
        return Status::InvalidArgument(fmt::format("token selection of {} tokens per KV head exceeds max_model_len {}",
                                                   sel.per_head, options_.max_model_len));
      }
      source = kSelected;
      row.context = sel.per_head;
      const int blocks = (sel.per_head + bs - 1) / bs;
      for (int b = 0; b < blocks; ++b) row.table.push_back(static_cast<int32_t>(selected_blocks + b));
      selected_blocks += blocks;
      if (sel.speculated) {
        speculated_table_blocks += (s.context_len + bs - 1) / bs;
      } else {
        selected_slots += static_cast<int64_t>(sel.per_head) * KV;
      }
      ++num_selected;
    } else if (slot_view) {
      source = kSlotView;
      row.context = static_cast<int>(s.view_size());
      const int blocks = (row.context + bs - 1) / bs;
      for (int b = 0; b < blocks; ++b) row.table.push_back(static_cast<int32_t>(slot_view_first + b));
    } else {
      source = kPool;
      row.context = static_cast<int>(s.view_size());
      const std::vector<BlockId>& table = s.view.kind == KvView::Kind::kFull ? s.block_table : s.view.blocks;
      row.table.assign(table.begin(), table.begin() + (row.context + bs - 1) / bs);
    }
    table_stride = std::max(table_stride, static_cast<int>(row.table.size()));
    (s.num_tokens == 1 ? decode_rows : prefill_rows)[source].push_back(std::move(row));
  }

  // The gathered selections: K then V, selected_blocks blocks each.
  const size_t es = cuda::DTypeSize(dtype_);
  const size_t block_bytes = layout_.block_stride() * es;
  if (!prefetched) {
    KVFLOW_RETURN_IF_ERROR(GrowScratch(selection_arena_, 2 * static_cast<size_t>(selected_blocks) * block_bytes,
                                       "the gathered token selections"));
  }
  selection_blocks_ = static_cast<int64_t>(selection_arena_.bytes() / (2 * block_bytes));
  char* selected_key = selection_arena_.base();
  char* selected_value = selection_arena_.base() + static_cast<size_t>(selection_blocks_) * block_bytes;
  if (identity_table_arena_.bytes() == 0) {
    std::vector<int32_t> identity(static_cast<size_t>(layout_.num_blocks));
    for (size_t b = 0; b < identity.size(); ++b) identity[b] = static_cast<int32_t>(b);
    KVFLOW_RETURN_IF_ERROR(identity_table_arena_.Allocate(identity.size() * sizeof(int32_t), "the identity block table"));
    KVFLOW_CUDA_RETURN(cudaMemcpy(identity_table_arena_.base(), identity.data(), identity.size() * sizeof(int32_t),
                                  cudaMemcpyHostToDevice));
  }

  // Staged metadata: [gather jobs][per-head counts][selected slots][decode rows][prefill rows]
  // [speculated slices' block tables].
  size_t num_decode = 0, num_prefill = 0;
  for (int src = 0; src < 3; ++src) {
    num_decode += decode_rows[src].size();
    num_prefill += prefill_rows[src].size();
  }
  const size_t stride = static_cast<size_t>(table_stride);
  const size_t jobs_bytes = AlignUp(num_selected * sizeof(cuda::SelectedKvGatherJob));
  const size_t counts_bytes = AlignUp(num_selected * sizeof(int32_t));
  const size_t slots_bytes = AlignUp(static_cast<size_t>(selected_slots) * sizeof(int32_t));
  const size_t decode_bytes = AlignUp(num_decode * (stride + 2) * sizeof(int32_t));
  const size_t prefill_bytes = AlignUp(num_prefill * (stride + 3) * sizeof(int32_t));
  const size_t tables_bytes = AlignUp(static_cast<size_t>(speculated_table_blocks) * sizeof(int32_t));
  char* host = nullptr;
  char* device = nullptr;
  KVFLOW_RETURN_IF_ERROR(StageBlockMeta(
      jobs_bytes + counts_bytes + slots_bytes + decode_bytes + prefill_bytes + tables_bytes, &host, &device));
  // The same offset on both sides.
  auto on_device = [&](const void* host_ptr) {
    return device + (static_cast<const char*>(host_ptr) - host);
  };
  auto* jobs = reinterpret_cast<cuda::SelectedKvGatherJob*>(host);
  auto* counts = reinterpret_cast<int32_t*>(host + jobs_bytes);
  auto* slots = reinterpret_cast<int32_t*>(host + jobs_bytes + counts_bytes);
  const auto* identity = reinterpret_cast<const int32_t*>(identity_table_arena_.base());
  int job = 0;
  int64_t slot_at = 0;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const KvHeadSelection& sel = selection[i];
    if (sel.per_head == 0 || sel.speculated) continue;
    counts[job] = sel.per_head;
    for (int64_t slot : sel.slots) slots[slot_at++] = static_cast<int32_t>(slot);
    cuda::SelectedKvGatherJob& j = jobs[job];
    j = cuda::SelectedKvGatherJob{};
    j.block_table = identity;
    j.positions = reinterpret_cast<const int32_t*>(on_device(slots + slot_at - sel.slots.size()));
    j.position_head_stride = sel.per_head;
    j.count = reinterpret_cast<const int32_t*>(on_device(counts + job));
    j.append_position = -1;  // the step's own token already ends every head's list
    j.num_blocks = (sel.per_head + bs - 1) / bs;
    ++job;
  }
  // First scratch blocks in slice order, as the rows' tables were numbered.
  int32_t first_block = 0;
  for (int k = 0; k < job; ++k) {
    jobs[k].first_block = first_block;
    first_block += jobs[k].num_blocks;
  }
  struct RowRange {
    const int32_t* tables = nullptr;  // device
    const int32_t* context = nullptr;
    const int32_t* rows = nullptr;    // decode: query rows; prefill: query starts
    const int32_t* lens = nullptr;    // prefill: query lens
    int count = 0;
    int max_extent = 0;               // decode: longest context; prefill: longest query run
  };
  RowRange decode_ranges[3], prefill_ranges[3];
  auto* decode_tables = reinterpret_cast<int32_t*>(host + jobs_bytes + counts_bytes + slots_bytes);
  int32_t* decode_context = decode_tables + num_decode * stride;
  int32_t* decode_query = decode_context + num_decode;
  auto* prefill_tables = reinterpret_cast<int32_t*>(host + jobs_bytes + counts_bytes + slots_bytes + decode_bytes);
  int32_t* prefill_context = prefill_tables + num_prefill * stride;
  int32_t* prefill_starts = prefill_context + num_prefill;
  int32_t* prefill_lens = prefill_starts + num_prefill;
  size_t d = 0, p = 0;
  for (int src = 0; src < 3; ++src) {
    RowRange& dr = decode_ranges[src];
    dr.tables = reinterpret_cast<const int32_t*>(on_device(decode_tables + d * stride));
    dr.context = reinterpret_cast<const int32_t*>(on_device(decode_context + d));
    dr.rows = reinterpret_cast<const int32_t*>(on_device(decode_query + d));
    dr.count = static_cast<int>(decode_rows[src].size());
    for (const Row& row : decode_rows[src]) {
      std::copy(row.table.begin(), row.table.end(), decode_tables + d * stride);
      decode_context[d] = row.context;
      decode_query[d] = batch.seqs[static_cast<size_t>(row.slice)].token_offset;
      dr.max_extent = std::max(dr.max_extent, row.context);
      ++d;
    }
    RowRange& pr = prefill_ranges[src];
    pr.tables = reinterpret_cast<const int32_t*>(on_device(prefill_tables + p * stride));
    pr.context = reinterpret_cast<const int32_t*>(on_device(prefill_context + p));
    pr.rows = reinterpret_cast<const int32_t*>(on_device(prefill_starts + p));
    pr.lens = reinterpret_cast<const int32_t*>(on_device(prefill_lens + p));
    pr.count = static_cast<int>(prefill_rows[src].size());
    for (const Row& row : prefill_rows[src]) {
      const SequenceSlice& s = batch.seqs[static_cast<size_t>(row.slice)];
      std::copy(row.table.begin(), row.table.end(), prefill_tables + p * stride);
      prefill_context[p] = row.context;
      prefill_starts[p] = s.token_offset;
      prefill_lens[p] = s.num_tokens;
      pr.max_extent = std::max(pr.max_extent, s.num_tokens);
      ++p;
    }
  }
  // The speculated slices' gathers write their token counts into their decode rows' context lengths
  // (every speculated slice is a decode row of the kSelected kind, in slice order).
  int32_t* speculated_context = nullptr;
  if (speculated) {
    const size_t first_row = decode_rows[kPool].size() + decode_rows[kSlotView].size();
    speculated_context = reinterpret_cast<int32_t*>(on_device(decode_context + first_row));
    auto* tables = reinterpret_cast<int32_t*>(host + jobs_bytes + counts_bytes + slots_bytes + decode_bytes + prefill_bytes);
    // After a prefetch of the selected rows, only the step's own token, written since.
    FillSpeculatedGather(layer, selection, job_of, prefetched ? SpeculatedRows::kStepToken : SpeculatedRows::kBoth,
                         jobs, tables, reinterpret_cast<const int32_t*>(on_device(tables)), speculated_context);
    job = num_selected;
  }
  const size_t total_bytes = jobs_bytes + counts_bytes + slots_bytes + decode_bytes + prefill_bytes + tables_bytes;
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(device, host, total_bytes, cudaMemcpyHostToDevice, stream_));
  KVFLOW_CUDA_RETURN(cudaEventRecord(block_meta_copied_, stream_));

  const size_t layer_bytes = layout_.layer_stride() * es;
  const char* key_cache = resident_step_ ? ResidentLayer(0, layer) : key_pool_ + layer * layer_bytes;
  const char* value_cache = resident_step_ ? ResidentLayer(1, layer) : value_pool_ + layer * layer_bytes;
  // Rows reading their views read the pool, or an offloaded pool's staging buffer; selections are
  // gathered from the pool wherever it is (an offloaded one: only the selected rows cross the bus).
  const char* view_key = key_cache;
  const char* view_value = value_cache;
  if (staged_step()) {
    KVFLOW_RETURN_IF_ERROR(EnsureStaged(layer, selection));
    view_key = StagingLayer(0, layer);
    view_value = StagingLayer(1, layer);
    // Speculated rows count when their counts reach the host (TakeSpeculatedCounts).
    offload_stats_.bytes_fetched += selected_slots * 2 * layout_.head_dim * static_cast<int64_t>(es);
  }
  if (prefetched) {
    // EnsureStaged made the stream wait for the prefetch; the gather below appends the step's token.
    selected_key = prefetched_selection_[layer % 2].base();
    selected_value = selected_key + static_cast<size_t>(selected_blocks) * block_bytes;
  }
  if (!decode_rows[kSlotView].empty() || !prefill_rows[kSlotView].empty()) {
    KVFLOW_KERNEL_RETURN(cuda::GatherSlots(dtype_, key_cache, value_cache, device_meta_.gather_slots,
                                           step_.num_gathered_slots, gather_key_, gather_value_, KV, config_.head_dim,
                                           bs, stream_));
  }
  KVFLOW_KERNEL_RETURN(cuda::GatherSelectedKv(dtype_, key_cache, value_cache,
                                              reinterpret_cast<const cuda::SelectedKvGatherJob*>(device), job,
                                              selected_key, selected_value, KV, config_.head_dim, bs, stream_));
  const void* keys[3] = {view_key, gather_key_, selected_key};
  const void* values[3] = {view_value, gather_value_, selected_value};
  for (int src = 0; src < 3; ++src) {
    const RowRange& dr = decode_ranges[src];
    if (dr.count > 0) {
      KVFLOW_RETURN_IF_ERROR(DecodeRows(dr.tables, table_stride, dr.context, dr.rows, dr.count, dr.max_extent,
                                        keys[src], values[src]));
    }
    const RowRange& pr = prefill_ranges[src];
    if (pr.count > 0) {
      KVFLOW_RETURN_IF_ERROR(PrefillRows(pr.tables, table_stride, pr.context, pr.rows, pr.lens, pr.count,
                                         pr.max_extent, keys[src], values[src]));
    }
  }
  return Status::Ok();
}

// Synchronous: the copy waits for the step's work so far (the selectors read on the host).
Status CudaBackend::ReadActivationRows(Activation which, int64_t first_row, int64_t rows, std::span<float> out) {
  if (!in_step_) return Status::Internal("activation read outside a step");
  const int64_t width = ActivationWidth(which);
  if (first_row < 0 || rows < 0 || first_row + rows > step_.num_tokens ||
      static_cast<int64_t>(out.size()) < rows * width) {
    return Status::InvalidArgument("activation read outside the step's rows");
  }
  if (rows == 0) return Status::Ok();
  KVFLOW_RETURN_IF_ERROR(RefuseUnderCapture("activation reads"));
  const size_t n = static_cast<size_t>(rows * width), es = cuda::DTypeSize(dtype_);
  read_rows_.resize(n);
  const char* src = static_cast<const char*>(ActivationBuffer(which)) + static_cast<size_t>(first_row * width) * es;
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(read_rows_.data(), src, n * es, cudaMemcpyDeviceToHost, stream_));
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  WidenToFloat(read_rows_.data(), n, dtype_, out.data());
  return Status::Ok();
}

// The slots are gathered on the device into whole blocks (cache_ops GatherSlots, K and V together),
// the requested pool's copy comes back in one synchronous copy, and the host reorders it to
// [slot][kv_head][head_dim].
Status CudaBackend::ReadKv(int layer, int kv, std::span<const int64_t> slots, std::span<float> out) {
  if (layer < 0 || layer >= config_.num_layers || kv < 0 || kv > 1) return Status::InvalidArgument("KV read: no such layer");
  const int KV = layout_.num_kv_heads, D = layout_.head_dim, bs = layout_.block_size;
  const int64_t row = static_cast<int64_t>(KV) * D;
  if (static_cast<int64_t>(out.size()) < static_cast<int64_t>(slots.size()) * row) {
    return Status::InvalidArgument("KV read: output too small");
  }
  const int64_t pool_slots = static_cast<int64_t>(layout_.num_blocks) * bs;
  for (int64_t slot : slots) {
    if (slot < 0 || slot >= pool_slots) return Status::InvalidArgument("KV read: slot " + std::to_string(slot) + " outside the pool");
  }
  if (slots.empty()) return Status::Ok();
  KVFLOW_RETURN_IF_ERROR(RefuseUnderCapture("KV reads"));
  const size_t n = slots.size(), es = cuda::DTypeSize(dtype_);
  const size_t blocks = (n + bs - 1) / bs, padded = blocks * bs;
  if (padded > static_cast<size_t>(std::numeric_limits<int>::max())) return Status::InvalidArgument("KV read: too many slots");
  const size_t list_bytes = AlignUp(padded * sizeof(int64_t));
  const size_t gathered_bytes = AlignUp(blocks * layout_.block_stride() * es);
  KVFLOW_RETURN_IF_ERROR(GrowScratch(read_arena_, list_bytes + 2 * gathered_bytes, "KV reads"));
  read_slots_.assign(padded, -1);
  std::copy(slots.begin(), slots.end(), read_slots_.begin());
  auto* device_slots = reinterpret_cast<int64_t*>(read_arena_.base());
  char* gathered[2] = {read_arena_.base() + list_bytes, read_arena_.base() + list_bytes + gathered_bytes};
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(device_slots, read_slots_.data(), padded * sizeof(int64_t),
                                     cudaMemcpyHostToDevice, stream_));
  // An offloaded pool's resident blocks are read from their arena (one side per call).
  const BlockId first_block = static_cast<BlockId>(slots.front() / bs);
  for (int64_t slot : slots) {
    if ((slot / bs >= resident_begin_) != (first_block >= resident_begin_) && options_.kv_offload) {
      return Status::Unsupported("a KV read of resident and host pool blocks at once");
    }
  }
  KVFLOW_KERNEL_RETURN(cuda::GatherSlots(dtype_, DeviceTierLayer(0, layer, first_block), DeviceTierLayer(1, layer, first_block),
                                         device_slots, static_cast<int>(padded), gathered[0], gathered[1], KV, D, bs,
                                         stream_));
  read_rows_.resize(blocks * layout_.block_stride());
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(read_rows_.data(), gathered[kv], read_rows_.size() * es, cudaMemcpyDeviceToHost,
                                     stream_));
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  // Scratch slot i sits at block i / bs, offset i % bs of each head (the pool's layout).
  for (size_t i = 0; i < n; ++i) {
    for (int h = 0; h < KV; ++h) {
      const size_t src = (((i / bs) * KV + h) * bs + i % bs) * D;
      WidenToFloat(read_rows_.data() + src, static_cast<size_t>(D), dtype_, out.data() + (i * KV + h) * D);
    }
  }
  return Status::Ok();
}

}  // namespace cuda_impl
}  // namespace kvflow
