#include "kv_runahead/chain_prefill.h"

#include <algorithm>
#include <chrono>
#include <utility>

namespace kvflow::dist {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

const char* PrefillMethodName(PrefillMethod method) {
  switch (method) {
    case PrefillMethod::kKvRunahead: return "kv-runahead";
    case PrefillMethod::kTsp: return "tsp";
  }
  return "?";
}

Result<PrefillMethod> ParsePrefillMethod(const std::string& name) {
  if (name == "kv-runahead" || name == "kvr") return PrefillMethod::kKvRunahead;
  if (name == "tsp") return PrefillMethod::kTsp;
  return Status::InvalidArgument("unknown prefill parallelism '" + name + "' (kv-runahead or tsp)");
}

Status ValidatePrefillBounds(std::span<const int64_t> bounds, int num_ranks) {
  const ContextPartition partition{{bounds.begin(), bounds.end()}};
  return ValidatePartition(partition, partition.context_len(), num_ranks);
}

DistributedPrefillHooks::DistributedPrefillHooks(Communicator& comm, Backend& backend, std::vector<int64_t> bounds,
                                                 std::vector<BlockId> block_table,
                                                 const DistributedPrefillOptions& options)
    : comm_(comm), backend_(backend), bounds_(std::move(bounds)), block_table_(std::move(block_table)),
      options_(options) {}

DistributedPrefillHooks::~DistributedPrefillHooks() {
  // After a failed pass: the buffers must outlive what is still in flight.
  if (!finished_) (void)Finish();
}

std::vector<int64_t> DistributedPrefillHooks::SlotsOf(int64_t begin, int64_t end) const {
  std::vector<int64_t> slots;
  slots.reserve(static_cast<size_t>(end - begin));
  const int bs = backend_.kv_layout().block_size;
  for (int64_t pos = begin; pos < end; ++pos) slots.push_back(SlotOf(block_table_, static_cast<int32_t>(pos), bs));
  return slots;
}

int64_t DistributedPrefillHooks::SegmentBytes(int chunk) const {
  return KvPackBytes(backend_, bounds_[chunk + 1] - bounds_[chunk]);
}

Status DistributedPrefillHooks::Start() {
  KVFLOW_RETURN_IF_ERROR(ValidatePrefillBounds(bounds_, num_ranks()));
  if (backend_.As<OffloadedKvPool>() != nullptr) {
    return Status::Unsupported("distributed prefill into an offloaded KV pool");
  }
  if (packing_ == nullptr) return Status::Unsupported("distributed prefill: " + backend_.Describe() + " has no KV packing");
  if (device_buffers_ && num_ranks() > 1 && packing_->pack_device() < 0) {
    return Status::Unsupported("distributed prefill over " + comm_.Describe() +
                               ", whose buffers are device memory, needs a backend that packs KV on the device; " +
                               backend_.Describe() + " does not");
  }
  const bool tsp = options_.method == PrefillMethod::kTsp;
  // KV-Runahead holds chunks 0..rank; TSP every chunk.
  const int held = tsp ? num_ranks() : rank() + 1;
  const int bs = backend_.kv_layout().block_size;
  const int64_t needed_blocks = (bounds_[held] + bs - 1) / bs;
  if (static_cast<int64_t>(block_table_.size()) < needed_blocks) {
    return Status::InvalidArgument("rank " + std::to_string(rank()) + " holds " + std::to_string(bounds_[held]) +
                                   " tokens but its block table covers " +
                                   std::to_string(block_table_.size() * static_cast<size_t>(bs)));
  }
  chunk_slots_.clear();
  for (int j = 0; j < held; ++j) chunk_slots_.push_back(SlotsOf(bounds_[j], bounds_[j + 1]));
  if (num_ranks() == 1) return Status::Ok();
  if (tsp) {
    int64_t widest = 0;
    for (int j = 0; j < num_ranks(); ++j) widest = std::max(widest, SegmentBytes(j));
    KVFLOW_ASSIGN_OR_RETURN(own_, NewBuffer(widest));
    KVFLOW_ASSIGN_OR_RETURN(gathered_, NewBuffer(widest * num_ranks()));
    return Status::Ok();
  }
  // A middle rank receives chunks 0..rank-1 and sends them on with its own after them.
  const bool sends = rank() + 1 < num_ranks();
  const int64_t bytes = KvPackBytes(backend_, bounds_[sends ? rank() + 1 : rank()]);
  buffers_.clear();
  for (int b = 0; b < kRing; ++b) {
    KVFLOW_ASSIGN_OR_RETURN(std::span<std::byte> buffer, NewBuffer(bytes));
    buffers_.push_back(buffer);
  }
  pending_send_.clear();
  pending_receive_.clear();
  pending_send_.resize(kRing);
  pending_receive_.resize(kRing);
  if (rank() > 0) {
    const int ahead = std::min(receives_ahead_, backend_.kv_layout().num_layers);
    for (int layer = 0; layer < ahead; ++layer) KVFLOW_RETURN_IF_ERROR(PostReceive(layer));
    comm_.Poll();
  }
  return Status::Ok();
}

Result<std::span<std::byte>> DistributedPrefillHooks::NewBuffer(int64_t bytes) {
  if (device_buffers_) {
    KVFLOW_ASSIGN_OR_RETURN(std::unique_ptr<DeviceAllocation> memory, packing_->AllocatePackBuffer(bytes));
    device_memory_.push_back(std::move(memory));
    return device_memory_.back()->bytes();
  }
  try {
    host_memory_.emplace_back(static_cast<size_t>(bytes));
  } catch (const std::bad_alloc&) {
    return Status::OutOfMemory("cannot allocate the distributed prefill's message buffers");
  }
  return std::span<std::byte>(host_memory_.back());
}

Status DistributedPrefillHooks::Pack(int layer, std::span<const int64_t> slots, std::span<std::byte> out) {
  return device_buffers_ ? packing_->PackKvOnDevice(layer, slots, out) : packing_->PackKv(layer, slots, out);
}

Status DistributedPrefillHooks::Unpack(int layer, std::span<const int64_t> slots, std::span<const std::byte> in) {
  return device_buffers_ ? packing_->UnpackKvOnDevice(layer, slots, in) : packing_->UnpackKv(layer, slots, in);
}

Status DistributedPrefillHooks::OrderTransportAfterCompute() {
  if (!device_buffers_) return Status::Ok();
  KVFLOW_ASSIGN_OR_RETURN(void* event, packing_->RecordComputeEvent());
  return comm_.OrderAfter(event);
}

Status DistributedPrefillHooks::Timed(MessageHandle handle) {
  const auto start = std::chrono::steady_clock::now();
  Status st = comm_.Wait(std::move(handle), options_.timeout_s);
  stats_.wait_seconds += SecondsSince(start);
  return st;
}

Status DistributedPrefillHooks::ReleaseBuffer(int b) {
  if (!pending_send_[b]) return Status::Ok();
  return Timed(std::move(pending_send_[b]));
}

Status DistributedPrefillHooks::PostReceive(int layer) {
  const int b = layer % kRing;
  KVFLOW_RETURN_IF_ERROR(ReleaseBuffer(b));
  const int64_t bytes = KvPackBytes(backend_, bounds_[rank()]);
  KVFLOW_ASSIGN_OR_RETURN(pending_receive_[b], comm_.IRecv(rank() - 1, options_.tag_base + layer,
                                                           buffers_[b].first(static_cast<size_t>(bytes))));
  return Status::Ok();
}

Status DistributedPrefillHooks::BeforeAttention(const LayerContext& ctx) {
  if (num_ranks() == 1) return Status::Ok();
  return options_.method == PrefillMethod::kTsp ? RunTspLayer(ctx.layer) : RunChainLayer(ctx.layer);
}

Status DistributedPrefillHooks::AfterAttention(const LayerContext& ctx) {
  if (num_ranks() > 1) comm_.Poll();
  return Status::Ok();
}

Status DistributedPrefillHooks::AfterMlpInput(const LayerContext& ctx) {
  if (num_ranks() > 1) comm_.Poll();
  return Status::Ok();
}

Status DistributedPrefillHooks::RunChainLayer(int layer) {
  const int b = layer % kRing;
  const std::span<std::byte> buffer = buffers_[b];
  const int64_t received = KvPackBytes(backend_, bounds_[rank()]);
  if (rank() > 0) {
    KVFLOW_RETURN_IF_ERROR(Timed(std::move(pending_receive_[b])));
    stats_.bytes_received += received;
    int64_t at = 0;
    for (int j = 0; j < rank(); ++j) {
      const int64_t bytes = SegmentBytes(j);
      KVFLOW_RETURN_IF_ERROR(Unpack(layer, chunk_slots_[j], buffer.subspan(static_cast<size_t>(at), static_cast<size_t>(bytes))));
      at += bytes;
    }
  }
  if (rank() + 1 < num_ranks()) {
    if (rank() == 0) KVFLOW_RETURN_IF_ERROR(ReleaseBuffer(b));
    const int64_t own = SegmentBytes(rank());
    KVFLOW_RETURN_IF_ERROR(
        Pack(layer, chunk_slots_[rank()], buffer.subspan(static_cast<size_t>(received), static_cast<size_t>(own))));
  }
  // The send reads what was just packed; the receive posted below overwrites a buffer unpacked
  // kRing - 1 layers ago.
  KVFLOW_RETURN_IF_ERROR(OrderTransportAfterCompute());
  if (rank() + 1 < num_ranks()) {
    KVFLOW_ASSIGN_OR_RETURN(pending_send_[b], comm_.ISend(rank() + 1, options_.tag_base + layer, buffer));
    stats_.bytes_sent += static_cast<int64_t>(buffer.size());
  }
  // Keep receives_ahead_ receives posted ahead of the layer being computed.
  const int next = layer + receives_ahead_;
  if (rank() > 0 && next < backend_.kv_layout().num_layers) KVFLOW_RETURN_IF_ERROR(PostReceive(next));
  comm_.Poll();
  return Status::Ok();
}

Status DistributedPrefillHooks::RunTspLayer(int layer) {
  const int64_t own = SegmentBytes(rank());
  KVFLOW_RETURN_IF_ERROR(Pack(layer, chunk_slots_[rank()], own_.first(static_cast<size_t>(own))));
  KVFLOW_RETURN_IF_ERROR(OrderTransportAfterCompute());
  const auto start = std::chrono::steady_clock::now();
  Status st = comm_.AllGather(own_, gathered_, options_.timeout_s);
  stats_.wait_seconds += SecondsSince(start);
  KVFLOW_RETURN_IF_ERROR(st);
  stats_.bytes_sent += static_cast<int64_t>(own_.size()) * (num_ranks() - 1);
  stats_.bytes_received += static_cast<int64_t>(own_.size()) * (num_ranks() - 1);
  for (int j = 0; j < num_ranks(); ++j) {
    if (j == rank()) continue;
    KVFLOW_RETURN_IF_ERROR(Unpack(layer, chunk_slots_[j],
                                  gathered_.subspan(own_.size() * static_cast<size_t>(j), static_cast<size_t>(SegmentBytes(j)))));
  }
  return Status::Ok();
}

Status DistributedPrefillHooks::Finish() {
  finished_ = true;
  Status first;
  for (MessageHandle& h : pending_send_) {
    if (!h) continue;
    Status st = Timed(std::move(h));
    if (first.ok() && !st.ok()) first = st;
  }
  // Receives still posted only after a failure (or a pass that stopped early).
  for (MessageHandle& h : pending_receive_) {
    if (!h) continue;
    Status st = comm_.Wait(std::move(h), 0.0);
    if (first.ok() && !st.ok()) first = st;
  }
  return first;
}

Status RunDistributedPrefill(Communicator& comm, Backend& backend, std::span<const int32_t> chunk_tokens,
                             std::span<const int64_t> bounds, std::span<const BlockId> block_table,
                             const DistributedPrefillOptions& options, std::vector<float>& logits,
                             DistributedPrefillStats* stats) {
  const auto start = std::chrono::steady_clock::now();
  logits.clear();
  KVFLOW_RETURN_IF_ERROR(ValidatePrefillBounds(bounds, comm.size()));
  const int rank = comm.rank();
  const int64_t begin = bounds[rank], end = bounds[rank + 1];
  if (static_cast<int64_t>(chunk_tokens.size()) != end - begin) {
    return Status::InvalidArgument("rank " + std::to_string(rank) + " was given " +
                                   std::to_string(chunk_tokens.size()) + " tokens for a chunk of " +
                                   std::to_string(end - begin));
  }
  ForwardBatch batch;
  batch.tokens.assign(chunk_tokens.begin(), chunk_tokens.end());
  for (int64_t pos = begin; pos < end; ++pos) batch.positions.push_back(static_cast<int32_t>(pos));
  SequenceSlice slice;
  slice.num_tokens = static_cast<int32_t>(end - begin);
  slice.context_len = static_cast<int32_t>(end);
  slice.block_table.assign(block_table.begin(), block_table.end());
  slice.logits = rank + 1 == comm.size() ? LogitsMode::kLast : LogitsMode::kNone;
  batch.seqs.push_back(std::move(slice));

  DistributedPrefillHooks hooks(comm, backend, std::vector<int64_t>(bounds.begin(), bounds.end()),
                                std::vector<BlockId>(block_table.begin(), block_table.end()), options);
  Status st = hooks.Start();
  if (st.ok()) {
    LlamaModel model(backend, &hooks);
    st = model.Forward(batch, logits);
  }
  Status finished = hooks.Finish();
  if (st.ok()) st = finished;
  if (stats) {
    *stats = hooks.stats();
    stats->total_seconds = SecondsSince(start);
  }
  if (!st.ok()) {
    logits.clear();
    return Status(st.code(), std::string(PrefillMethodName(options.method)) + " prefill on " + comm.Describe() + ": " +
                                 st.message());
  }
  return Status::Ok();
}

}  // namespace kvflow::dist
