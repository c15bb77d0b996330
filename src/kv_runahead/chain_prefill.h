// Prefill of one prompt across the ranks of a Communicator (KV-Runahead, seed 001), and the
// sequence-parallel baseline it is measured against (TSP), as layer hooks over the one Llama model
// (forward/llama_model.h): no copy of the layer loop.
//
// The prompt's C tokens are split into p contiguous chunks [bounds[i], bounds[i + 1]), one per
// rank. Rank i runs only its chunk's tokens, at their positions, into its own paged blocks:
//   - KV-Runahead: at every layer, after writing its chunk's K/V, rank i receives the K/V of chunks
//     0..i-1 from rank i-1, writes them into its blocks, sends chunks 0..i on to rank i+1 and then
//     attends (causally) over [received + own]. The send runs while this rank attends and computes
//     the rest of the layer; the next layers' receives are posted ahead. Only the last rank ends
//     with the whole KV cache and the first token's logits; traffic is (p-1)·C/2 tokens per layer
//     on average.
//   - TSP: every rank all-gathers every chunk's K/V at every layer (a global sync, (p-1)/p·C tokens
//     in per rank), so every rank ends with the whole cache; each attends over [0, its end).
// Either way rank i computes exactly what a single process computes for that chunk when it
// prefills the prompt chunk by chunk at the same bounds, so the last rank's KV cache and logits are
// bit-identical to that prefill's (tests/unit/test_chain_prefill.cc).
//
// The K/V cross the wire in the pools' own format (Backend::PackKv): every rank must run the same
// model with the same KV dtype. A message carries one packed segment per chunk, in chunk order, so
// forwarding the received chunks costs no repacking.
//
// Over a transport of device buffers (NCCL, CUDA peer copies) the message buffers are device
// memory of the rank's backend and the K/V are packed and unpacked there by kernels
// (KvPacking::PackKvOnDevice): nothing crosses to the host. Each layer records one event on the
// compute stream after its pack (and its unpacks) and orders the transport after it
// (Communicator::OrderAfter), so the send starts once the buffer is packed and the next receive
// overwrites a buffer only once it was unpacked, with no device-wide synchronisation; the host
// waits only for a layer's receive before issuing its unpack (with the deadline that turns a dead
// peer into an error). Receives are posted one layer ahead there, right after the layer's send, so
// NCCL launches them as one group and a send never queues behind a receive for a later layer.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "distributed/communicator.h"
#include "kv_runahead/context_partition.h"
#include "forward/llama_model.h"

namespace kvflow::dist {

enum class PrefillMethod {
  kKvRunahead,  // the chain: point-to-point, uneven chunks allowed
  kTsp,         // all-gather every layer
};
const char* PrefillMethodName(PrefillMethod method);
Result<PrefillMethod> ParsePrefillMethod(const std::string& name);

// What one rank moved and waited for during a distributed prefill.
struct DistributedPrefillStats {
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  double wait_seconds = 0;  // blocked in receives, all-gathers and send completions
  double total_seconds = 0;
};

struct DistributedPrefillOptions {
  PrefillMethod method = PrefillMethod::kKvRunahead;
  double timeout_s = kDefaultCommTimeoutSeconds;
  // Messages are tagged tag_base + layer, so that prefills following each other never mix.
  int tag_base = 0;
};

// Checks that `bounds` splits a prompt into one non-empty chunk per rank (ValidatePartition).
Status ValidatePrefillBounds(std::span<const int64_t> bounds, int num_ranks);

// The hooks one rank runs inside its LlamaModel pass. `block_table` is this rank's: it must cover
// the positions whose K/V the rank holds (KV-Runahead: [0, its chunk's end); TSP: [0, C)). Call
// Finish after the pass (also after a failed one): it waits for the sends still in flight.
class DistributedPrefillHooks final : public LayerHooks {
 public:
  DistributedPrefillHooks(Communicator& comm, Backend& backend, std::vector<int64_t> bounds,
                          std::vector<BlockId> block_table, const DistributedPrefillOptions& options);
  ~DistributedPrefillHooks() override;

  // Allocates the message buffers and posts the first receives.
  Status Start();
  Status BeforeAttention(const LayerContext& ctx) override;
  // Between the layer's big products: let the sends and receives in flight advance.
  Status AfterAttention(const LayerContext& ctx) override;
  Status AfterMlpInput(const LayerContext& ctx) override;
  Status Finish();
  const DistributedPrefillStats& stats() const { return stats_; }

 private:
  // Ring of message buffers: layer l's receive and send use buffer l % kRing, so receives can be
  // posted kRing - 1 layers ahead (host buffers; one ahead for device ones) while a send is still
  // in flight.
  static constexpr int kRing = 3;
  // Packed K/V to and from message buffers, in host or device memory as the transport wants.
  Status Pack(int layer, std::span<const int64_t> slots, std::span<std::byte> out);
  Status Unpack(int layer, std::span<const int64_t> slots, std::span<const std::byte> in);
  // Device buffers: orders the transport's next operations after the compute issued so far.
  Status OrderTransportAfterCompute();
  // A message buffer of `bytes`, host or device memory.
  Result<std::span<std::byte>> NewBuffer(int64_t bytes);
  int rank() const { return comm_.rank(); }
  int num_ranks() const { return comm_.size(); }
  // The physical slots of positions [begin, end) in this rank's block table.
  std::vector<int64_t> SlotsOf(int64_t begin, int64_t end) const;
  int64_t SegmentBytes(int chunk) const;
  Status RunChainLayer(int layer);
  Status RunTspLayer(int layer);
  // Makes buffer `b` free: waits for the send that last used it.
  Status ReleaseBuffer(int b);
  Status PostReceive(int layer);
  Status Timed(MessageHandle handle);

  Communicator& comm_;
  Backend& backend_;
  KvPacking* packing_ = backend_.As<KvPacking>();  // null: Start refuses
  std::vector<int64_t> bounds_;
  std::vector<BlockId> block_table_;
  DistributedPrefillOptions options_;
  std::vector<std::vector<int64_t>> chunk_slots_;  // per chunk, its positions' slots here
  bool device_buffers_ = comm_.buffer_space() == BufferSpace::kDevice;
  int receives_ahead_ = device_buffers_ ? 1 : kRing - 1;
  std::vector<std::vector<std::byte>> host_memory_;                 // what NewBuffer allocated,
  std::vector<std::unique_ptr<DeviceAllocation>> device_memory_;   // one of the two
  std::vector<std::span<std::byte>> buffers_;
  std::vector<MessageHandle> pending_send_;     // per ring buffer
  std::vector<MessageHandle> pending_receive_;  // per ring buffer
  std::span<std::byte> own_, gathered_;         // TSP
  DistributedPrefillStats stats_;
  bool finished_ = false;
};

// Runs this rank's part of the prefill of a prompt split at `bounds`: `chunk_tokens` are the
// tokens of chunk comm.rank(), written into `block_table` (as for DistributedPrefillHooks). The last
// rank's `logits` receive the prompt's last-token logits (vocab floats); other ranks' stay empty.
Status RunDistributedPrefill(Communicator& comm, Backend& backend, std::span<const int32_t> chunk_tokens,
                             std::span<const int64_t> bounds, std::span<const BlockId> block_table,
                             const DistributedPrefillOptions& options, std::vector<float>& logits,
                             DistributedPrefillStats* stats = nullptr);

}  // namespace kvflow::dist
