#include "backend/backend.h"

#include <algorithm>
#include <string>

namespace kvflow {

KvView KvView::BlockSubset(std::vector<BlockId> blocks, int32_t num_tokens) {
  KvView v;
  v.kind = Kind::kBlocks;
  v.blocks = std::move(blocks);
  v.num_tokens = num_tokens;
  return v;
}

KvView KvView::Slots(std::vector<int64_t> slots) {
  KvView v;
  v.kind = Kind::kSlots;
  v.slots = std::move(slots);
  return v;
}

KvView KvView::SinksAndWindow(std::span<const BlockId> table, int32_t context_len, int32_t num_sinks,
                              int32_t window, int block_size) {
  const int32_t sinks = std::clamp(num_sinks, 0, context_len);
  const int32_t recent_from = std::max(sinks, context_len - std::max(window, 0));
  std::vector<int64_t> slots;
  slots.reserve(static_cast<size_t>(sinks + context_len - recent_from));
  auto slot = [&](int32_t t) {
    return static_cast<int64_t>(table[static_cast<size_t>(t / block_size)]) * block_size + t % block_size;
  };
  for (int32_t t = 0; t < sinks; ++t) slots.push_back(slot(t));
  for (int32_t t = recent_from; t < context_len; ++t) slots.push_back(slot(t));
  return Slots(std::move(slots));
}

int64_t ActivationWidth(const ModelConfig& c, Activation which) {
  const int64_t D = c.head_dim;
  switch (which) {
    case Activation::kHidden:
    case Activation::kDelta: return c.hidden_size;
    case Activation::kQkv:
    case Activation::kSpeculativeQkv: return (c.num_heads + 2 * static_cast<int64_t>(c.num_kv_heads)) * D;
    case Activation::kAttention: return c.num_heads * D;
    case Activation::kGateUp: return 2 * static_cast<int64_t>(c.intermediate_size);
    case Activation::kMlp: return c.intermediate_size;
  }
  return 0;
}

int64_t SequenceSlice::view_size() const {
  switch (view.kind) {
    case KvView::Kind::kFull: return context_len;
    case KvView::Kind::kBlocks: return view.num_tokens;
    case KvView::Kind::kSlots: return static_cast<int64_t>(view.slots.size());
  }
  return 0;
}

std::vector<int64_t> ResolveSlotMapping(const ForwardBatch& batch, int block_size) {
  if (!batch.slot_mapping.empty()) return batch.slot_mapping;
  std::vector<int64_t> slots(batch.tokens.size(), -1);
  for (const SequenceSlice& s : batch.seqs) {
    for (int32_t j = 0; j < s.num_tokens; ++j) {
      const int32_t pos = s.context_len - s.num_tokens + j;
      slots[static_cast<size_t>(s.token_offset + j)] =
          static_cast<int64_t>(s.block_table[static_cast<size_t>(pos / block_size)]) * block_size + pos % block_size;
    }
  }
  return slots;
}

void ViewSlots(const SequenceSlice& s, int block_size, std::vector<int64_t>& slots) {
  slots.clear();
  if (s.view.kind == KvView::Kind::kSlots) {
    slots = s.view.slots;
    return;
  }
  const std::vector<BlockId>& table = s.view.kind == KvView::Kind::kFull ? s.block_table : s.view.blocks;
  const int64_t n = s.view_size();
  slots.resize(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    const BlockId block = table[static_cast<size_t>(t / block_size)];
    slots[static_cast<size_t>(t)] = block == kReleasedBlock ? -1 : static_cast<int64_t>(block) * block_size + t % block_size;
  }
}

uint64_t KvReadSignature(std::span<const KvHeadSelection> selection, size_t num_slices) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  auto mix = [&h](uint64_t v) {
    h ^= v;
    h *= 1099511628211ull;
  };
  for (size_t s = 0; s < num_slices; ++s) {
    if (selection.empty() || selection[s].per_head == 0) {
      mix(0);
      continue;
    }
    mix(static_cast<uint64_t>(selection[s].per_head));
    if (selection[s].speculated) mix(0x5bec);  // the layer's own speculation, on the device
    for (int64_t slot : selection[s].slots) mix(static_cast<uint64_t>(slot));
  }
  return h;
}

Result<bool> KvStagingLedger::Holds(int layer, std::span<const KvHeadSelection> selection, size_t num_slices) const {
  const int buffer = BufferOf(layer);
  if (layer_[buffer] != layer) return false;
  if (signature_[buffer] != KvReadSignature(selection, num_slices)) {
    return Status::Internal("layer " + std::to_string(layer) + "'s attention reads other tokens than were prefetched for it");
  }
  return true;
}

void KvStagingLedger::Record(int layer, std::span<const KvHeadSelection> selection, size_t num_slices) {
  layer_[BufferOf(layer)] = layer;
  signature_[BufferOf(layer)] = KvReadSignature(selection, num_slices);
}

int64_t ForwardBatch::num_logit_rows() const {
  int64_t rows = 0;
  for (const SequenceSlice& s : seqs) {
    if (s.logits == LogitsMode::kLast) rows += 1;
    if (s.logits == LogitsMode::kAll) rows += s.num_tokens;
  }
  return rows;
}

namespace {

Status ValidateView(const SequenceSlice& s, const KvCacheLayout& layout) {
  const KvView& v = s.view;
  if (s.view_size() < s.num_tokens) {
    return Status::InvalidArgument("a KV view of " + std::to_string(s.view_size()) +
                                   " tokens cannot hold the step's " + std::to_string(s.num_tokens) + " tokens");
  }
  if (v.kind == KvView::Kind::kBlocks) {
    if (static_cast<int64_t>(v.blocks.size()) * layout.block_size < v.num_tokens) {
      return Status::InvalidArgument("a block-subset view of " + std::to_string(v.blocks.size()) +
                                     " blocks cannot hold " + std::to_string(v.num_tokens) + " tokens");
    }
    for (BlockId b : v.blocks) {
      if (b < 0 || b >= layout.num_blocks) return Status::InvalidArgument("view block id " + std::to_string(b) + " outside the pool");
    }
  } else if (v.kind == KvView::Kind::kSlots) {
    const int64_t slots = static_cast<int64_t>(layout.num_blocks) * layout.block_size;
    for (int64_t slot : v.slots) {
      if (slot < 0 || slot >= slots) return Status::InvalidArgument("view slot " + std::to_string(slot) + " outside the pool");
    }
  }
  return Status::Ok();
}

}  // namespace

Status ValidateKvHeadSelections(std::span<const KvHeadSelection> selection, const ForwardBatch& batch,
                                const KvCacheLayout& layout) {
  if (selection.size() != batch.seqs.size()) {
    return Status::InvalidArgument("token selections: " + std::to_string(selection.size()) + " for a batch of " +
                                   std::to_string(batch.seqs.size()) + " sequences");
  }
  const int64_t slots = static_cast<int64_t>(layout.num_blocks) * layout.block_size;
  for (size_t s = 0; s < selection.size(); ++s) {
    const KvHeadSelection& sel = selection[s];
    if (sel.per_head == 0) continue;
    if (sel.speculated) {
      if (!sel.slots.empty() || batch.seqs[s].num_tokens != 1 || sel.per_head < 1) {
        return Status::InvalidArgument("token selection of sequence " + std::to_string(s) +
                                       ": a device speculation is one decode token's, with no slots");
      }
      continue;
    }
    if (sel.per_head < batch.seqs[s].num_tokens ||
        static_cast<int64_t>(sel.slots.size()) != static_cast<int64_t>(sel.per_head) * layout.num_kv_heads) {
      return Status::InvalidArgument("token selection of sequence " + std::to_string(s) + ": " +
                                     std::to_string(sel.slots.size()) + " slots for " +
                                     std::to_string(layout.num_kv_heads) + " KV heads of " + std::to_string(sel.per_head) +
                                     " tokens (at least the step's " + std::to_string(batch.seqs[s].num_tokens) + ")");
    }
    for (int64_t slot : sel.slots) {
      if (slot < 0 || slot >= slots) return Status::InvalidArgument("selected slot " + std::to_string(slot) + " outside the pool");
    }
  }
  return Status::Ok();
}

Status RefuseSpeculatedSelections(std::span<const KvHeadSelection> selection, const std::string& backend) {
  for (const KvHeadSelection& sel : selection) {
    if (sel.speculated) {
      return Status::Unsupported(backend + " cannot read a token selection speculated on a device (it has no "
                                 "DeviceKvSpeculation)");
    }
  }
  return Status::Ok();
}

Status ValidateForwardBatch(const ForwardBatch& batch, const ModelConfig& config,
                            const KvCacheLayout& layout) {
  if (batch.tokens.size() != batch.positions.size()) {
    return Status::InvalidArgument("batch has " + std::to_string(batch.tokens.size()) + " tokens but " +
                                   std::to_string(batch.positions.size()) + " positions");
  }
  for (int32_t t : batch.tokens) {
    if (t < 0 || t >= config.vocab_size) {
      return Status::InvalidArgument("token id " + std::to_string(t) + " outside the vocabulary [0, " +
                                     std::to_string(config.vocab_size) + ")");
    }
  }
  int64_t expected_offset = 0;
  for (const SequenceSlice& s : batch.seqs) {
    if (s.token_offset != expected_offset || s.num_tokens <= 0 ||
        s.token_offset + s.num_tokens > static_cast<int64_t>(batch.tokens.size())) {
      return Status::InvalidArgument("sequence slices do not tile the batch's tokens");
    }
    expected_offset += s.num_tokens;
    if (s.context_len < s.num_tokens) return Status::InvalidArgument("context_len < num_tokens");
    // The table places the step's K/V (no slot_mapping) and is what a full view reads; a slice
    // with explicit slots and its own view does not use it (a draft model's scratch continuation).
    const bool table_used = batch.slot_mapping.empty() || s.view.kind == KvView::Kind::kFull;
    if (table_used && static_cast<int64_t>(s.block_table.size()) * layout.block_size < s.context_len) {
      return Status::InvalidArgument("block table of " + std::to_string(s.block_table.size()) +
                                     " blocks cannot hold " + std::to_string(s.context_len) + " tokens");
    }
    // A sliding window counts positions, which only the whole-context view keeps.
    if (config.sliding_window > 0 && s.view.kind != KvView::Kind::kFull) {
      return Status::Unsupported("a KV view other than the whole context (retrieval, StreamingLLM) in a model with a "
                                 "sliding window of " + std::to_string(config.sliding_window) + " tokens");
    }
    // Blocks released from a sliding window may lead the table, before the first query's window.
    const int64_t window = config.ReleasableWindow();
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, s.context_len - s.num_tokens - window + 1) : 0;
    for (size_t i = 0; i < s.block_table.size(); ++i) {
      const BlockId b = s.block_table[i];
      if (b == kReleasedBlock && static_cast<int64_t>(i + 1) * layout.block_size <= first_key) continue;
      if (b < 0 || b >= layout.num_blocks) {
        return Status::InvalidArgument("block id " + std::to_string(b) + " outside the pool");
      }
    }
    for (int32_t i = 0; i < s.num_tokens; ++i) {
      if (batch.positions[static_cast<size_t>(s.token_offset + i)] != s.context_len - s.num_tokens + i) {
        return Status::InvalidArgument("positions of a sequence must continue its context");
      }
    }
    KVFLOW_RETURN_IF_ERROR(ValidateView(s, layout));
  }
  if (expected_offset != static_cast<int64_t>(batch.tokens.size())) {
    return Status::InvalidArgument("sequence slices do not cover all tokens of the batch");
  }
  if (!batch.slot_mapping.empty()) {
    if (batch.slot_mapping.size() != batch.tokens.size()) {
      return Status::InvalidArgument("slot_mapping has " + std::to_string(batch.slot_mapping.size()) +
                                     " entries for " + std::to_string(batch.tokens.size()) + " tokens");
    }
    const int64_t slots = static_cast<int64_t>(layout.num_blocks) * layout.block_size;
    for (int64_t slot : batch.slot_mapping) {
      if (slot < -1 || slot >= slots) {
        return Status::InvalidArgument("KV slot " + std::to_string(slot) + " outside the pool");
      }
    }
  }
  return Status::Ok();
}

std::vector<KvSlotRun> KvSlotRuns(std::span<const int64_t> slots, int block_size) {
  std::vector<KvSlotRun> runs;
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t slot = slots[i];
    if (!runs.empty()) {
      KvSlotRun& last = runs.back();
      const int64_t next = last.first_slot + last.length;
      if (slot == next && slot / block_size == last.first_slot / block_size) {
        ++last.length;
        continue;
      }
    }
    runs.push_back({slot, static_cast<int64_t>(i), 1});
  }
  return runs;
}

Status ValidateKvPack(int layer, std::span<const int64_t> slots, size_t buffer_bytes, const Backend& backend) {
  const KvCacheLayout& layout = backend.kv_layout();
  if (layer < 0 || layer >= layout.num_layers) {
    return Status::InvalidArgument("KV pack: no layer " + std::to_string(layer));
  }
  const int64_t pool_slots = static_cast<int64_t>(layout.num_blocks) * layout.block_size;
  for (int64_t slot : slots) {
    if (slot < 0 || slot >= pool_slots) {
      return Status::InvalidArgument("KV pack: slot " + std::to_string(slot) + " outside the pool");
    }
  }
  const int64_t need = KvPackBytes(backend, static_cast<int64_t>(slots.size()));
  if (static_cast<int64_t>(buffer_bytes) != need) {
    return Status::InvalidArgument("KV pack: " + std::to_string(slots.size()) + " slots take " + std::to_string(need) +
                                   " bytes, the buffer has " + std::to_string(buffer_bytes));
  }
  return Status::Ok();
}

Status ValidateKvTransfers(std::span<const KvTransfer> transfers, const KvCacheLayout& layout, int num_host_blocks) {
  for (const KvTransfer& t : transfers) {
    const int src_pool = t.src_tier == KvTier::kHost ? num_host_blocks : layout.num_blocks;
    const int dst_pool = t.dst_tier == KvTier::kHost ? num_host_blocks : layout.num_blocks;
    const bool ok = t.src_block >= 0 && t.src_block < src_pool && t.dst_block >= 0 && t.dst_block < dst_pool &&
                    t.num_tokens >= 0 && t.src_offset >= 0 && t.dst_offset >= 0 &&
                    t.src_offset + t.num_tokens <= layout.block_size && t.dst_offset + t.num_tokens <= layout.block_size &&
                    t.layer_begin >= 0 && t.layer_begin <= t.layer_end && t.layer_end <= layout.num_layers;
    if (!ok) {
      return Status::InvalidArgument("KV transfer of tokens [" + std::to_string(t.src_offset) + ", +" +
                                     std::to_string(t.num_tokens) + ") of block " + std::to_string(t.src_block) +
                                     " to block " + std::to_string(t.dst_block) + ", layers [" +
                                     std::to_string(t.layer_begin) + ", " + std::to_string(t.layer_end) +
                                     "), is outside the pools, the block or the layers");
    }
  }
  return Status::Ok();
}

Status ValidateBlockMoves(std::span<const BlockMove> moves, BlockCopyKind kind, int num_device_blocks,
                          int num_host_blocks) {
  const int src_pool = kind == BlockCopyKind::kHostToDevice ? num_host_blocks : num_device_blocks;
  const int dst_pool = kind == BlockCopyKind::kDeviceToHost ? num_host_blocks : num_device_blocks;
  for (const BlockMove& m : moves) {
    if (m.src < 0 || m.src >= src_pool || m.dst < 0 || m.dst >= dst_pool) {
      return Status::InvalidArgument("block move " + std::to_string(m.src) + " -> " + std::to_string(m.dst) +
                                     " is outside the pools");
    }
  }
  return Status::Ok();
}

namespace {

// Which blocks a step of an offloaded pool touches.
enum class OffloadedStep { kPool, kResident, kMixed };

OffloadedStep ClassifyOffloadedStep(const ForwardBatch& batch, std::span<const int64_t> slots, BlockId resident_begin,
                                    int block_size) {
  bool pool = false, resident = false;
  auto see = [&](int64_t block) { (block >= resident_begin ? resident : pool) = true; };
  for (const SequenceSlice& slice : batch.seqs) {
    switch (slice.view.kind) {
      case KvView::Kind::kFull: {
        const int32_t blocks = (slice.context_len + block_size - 1) / block_size;
        for (int32_t b = 0; b < blocks && b < static_cast<int32_t>(slice.block_table.size()); ++b) {
          see(slice.block_table[static_cast<size_t>(b)]);
        }
        break;
      }
      case KvView::Kind::kBlocks:
        for (BlockId b : slice.view.blocks) see(b);
        break;
      case KvView::Kind::kSlots:
        for (int64_t slot : slice.view.slots) see(slot / block_size);
        break;
    }
  }
  for (int64_t slot : slots) {
    if (slot >= 0) see(slot / block_size);
  }
  return pool && resident ? OffloadedStep::kMixed : resident ? OffloadedStep::kResident : OffloadedStep::kPool;
}

}  // namespace

Result<bool> CheckOffloadedStep(const ForwardBatch& batch, std::span<const int64_t> slots, BlockId resident_begin,
                                int block_size) {
  const OffloadedStep kind = ClassifyOffloadedStep(batch, slots, resident_begin, block_size);
  if (kind == OffloadedStep::kMixed) {
    return Status::Unsupported("a step of an offloaded KV pool reads and writes either resident blocks or host pool "
                               "blocks, not both");
  }
  if (kind == OffloadedStep::kResident) return true;
  for (const SequenceSlice& slice : batch.seqs) {
    if (slice.view.kind != KvView::Kind::kFull) {
      return Status::Unsupported("an offloaded KV pool reads whole views only (except from resident blocks)");
    }
  }
  return false;
}

}  // namespace kvflow
