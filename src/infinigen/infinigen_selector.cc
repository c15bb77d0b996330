#include "infinigen/infinigen_selector.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "infinigen/partial_keys.h"
#include "infinigen/skewing.h"
#include "infinigen/speculation.h"
#include "util/thread_pool.h"

namespace kvflow {

Result<SpeculationPoint> ParseSpeculationPoint(const std::string& name) {
  if (name == "layer-input") return SpeculationPoint::kLayerInput;
  if (name == "after-attention") return SpeculationPoint::kAfterAttention;
  return Status::InvalidArgument("infinigen_speculate_from must be layer-input or after-attention, not '" + name + "'");
}

const char* SpeculationPointName(SpeculationPoint p) {
  return p == SpeculationPoint::kLayerInput ? "layer-input" : "after-attention";
}

InfiniGenConfig InfiniGenConfig::FromEngine(const EngineConfig& c) {
  InfiniGenConfig g;
  const auto point = ParseSpeculationPoint(c.infinigen_speculate_from);
  if (point.ok()) g.point = point.value();  // Validate() below refuses a bad name through the engine
  g.alpha = c.infinigen_alpha;
  g.max_fraction = c.infinigen_max_fraction;
  g.min_context = c.kv_selection_min_context;
  return g;
}

Status InfiniGenConfig::Validate() const {
  if (!(alpha > 0.0) || !std::isfinite(alpha)) return Status::InvalidArgument("infinigen_alpha must be > 0");
  if (!(max_fraction > 0.0 && max_fraction <= 1.0)) return Status::InvalidArgument("infinigen_max_fraction must be in (0, 1]");
  if (min_context < 0) return Status::InvalidArgument("kv_selection_min_context must be >= 0");
  return Status::Ok();
}

InfiniGenSelector::InfiniGenSelector(const InfiniGenConfig& config, SkewTable skew, Backend& backend)
    : config_(config),
      skew_(std::move(skew)),
      backend_(backend),
      rope_(ComputeRopeFrequencies(backend.model_config())),
      token_bytes_(backend.kv_token_bytes()) {}

LayerHooks* InfiniGenSelector::ForStep(const ForwardBatch& batch, std::span<const int64_t> seq_ids,
                                       std::span<const uint8_t> selecting) {
  active_.clear();
  active_states_.clear();
  prefilling_.clear();
  prefilling_states_.clear();
  selection_layer_ = -1;
  next_selection_layer_ = -1;
  for (size_t s = 0; s < batch.seqs.size(); ++s) {
    const SequenceSlice& slice = batch.seqs[s];
    const int32_t first_new = slice.context_len - slice.num_tokens;
    auto it = seqs_.find(seq_ids[s]);
    if (it != seqs_.end()) {
      // Positions this step (re)writes are stale in the partial cache (recomputation).
      for (int32_t& rows : it->second.rows) rows = std::min(rows, first_new);
    }
    if (!selecting[s] || slice.view.kind != KvView::Kind::kFull) continue;
    // One new token (a decode step) long enough to select from; or a prefill chunk, whose keys
    // join the partial key cache as they are written (the paper builds it at prefill, so the
    // first decode step does not pay for the whole prompt).
    const bool decode = slice.num_tokens == 1 && slice.context_len >= std::max(config_.min_context, 2);
    if (!decode && slice.num_tokens == 1) continue;
    if (it == seqs_.end()) {
      it = seqs_.emplace(seq_ids[s], SequenceState{}).first;
      it->second.partial_keys.resize(skew_.heads.size());
      it->second.rows.assign(static_cast<size_t>(skew_.num_layers), 0);
    }
    (decode ? active_ : prefilling_).push_back(static_cast<int32_t>(s));
    (decode ? active_states_ : prefilling_states_).push_back(&it->second);
  }
  if (active_.empty() && prefilling_.empty()) return nullptr;
  stats_.decode_tokens += static_cast<int64_t>(active_.size());
  selection_.assign(batch.seqs.size(), KvHeadSelection{});
  next_selection_.assign(batch.seqs.size(), KvHeadSelection{});
  return this;
}

Status InfiniGenSelector::BeforeAttention(const LayerContext& ctx) {
  const ForwardBatch& batch = ctx.batch;
  for (size_t p = 0; p < prefilling_.size(); ++p) {
    const SequenceSlice& slice = batch.seqs[static_cast<size_t>(prefilling_[p])];
    KVFLOW_RETURN_IF_ERROR(ExtendPartialKeys(ctx.layer, slice, slice.context_len, *prefilling_states_[p]));
  }
  if (active_.empty()) return Status::Ok();
  // The speculation at the previous layer chose this layer's reads.
  if (ctx.layer > 0) {
    std::swap(selection_, next_selection_);
    selection_layer_ = ctx.layer;
  }
  // This layer's reads: the selection made at the previous layer, or everything (layer 0).
  for (int32_t s : active_) {
    const SequenceSlice& slice = batch.seqs[static_cast<size_t>(s)];
    stats_.bytes_full += static_cast<int64_t>(slice.context_len) * token_bytes_;
    if (selection_layer_ == ctx.layer && selection_[static_cast<size_t>(s)].per_head > 0) {
      const int32_t read = selection_[static_cast<size_t>(s)].per_head;
      stats_.layer_reads_selected += 1;
      stats_.tokens_selected += read;
      stats_.tokens_available += slice.context_len;
      stats_.bytes_read += static_cast<int64_t>(read) * token_bytes_;
    } else {
      stats_.layer_reads_full += 1;
      stats_.bytes_read += static_cast<int64_t>(slice.context_len) * token_bytes_;
    }
  }
  if (config_.point != SpeculationPoint::kLayerInput || ctx.layer + 1 >= skew_.num_layers || active_.empty()) {
    return Status::Ok();
  }
  return TimedSpeculate(ctx.layer + 1, batch);
}

Status InfiniGenSelector::AfterMlpInput(const LayerContext& ctx) {
  if (config_.point != SpeculationPoint::kAfterAttention || ctx.layer + 1 >= skew_.num_layers || active_.empty()) {
    return Status::Ok();
  }
  return TimedSpeculate(ctx.layer + 1, ctx.batch);
}

Status InfiniGenSelector::TimedSpeculate(int layer, const ForwardBatch& batch) {
  const auto start = std::chrono::steady_clock::now();
  const Status st = Speculate(layer, batch);
  if (st.ok()) next_selection_layer_ = layer;
  stats_.select_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return st;
}

std::span<const KvHeadSelection> InfiniGenSelector::AttentionSelection(const LayerContext& ctx) {
  if (selection_layer_ != ctx.layer) return {};
  return selection_;
}

std::optional<std::span<const KvHeadSelection>> InfiniGenSelector::UpcomingSelection(int layer) {
  // Steps with no selecting decode (prefill chunks only) read every slice's view; layer 0 is not
  // speculated, so nothing is known before it.
  if (active_.empty()) return std::span<const KvHeadSelection>{};
  if (next_selection_layer_ == layer) return std::span<const KvHeadSelection>(next_selection_);
  return std::nullopt;
}

Status InfiniGenSelector::ExtendPartialKeys(int layer, const SequenceSlice& slice, int32_t positions,
                                            SequenceState& state) {
  int32_t& rows = state.rows[static_cast<size_t>(layer)];
  if (rows >= positions) return Status::Ok();
  const int KV = skew_.num_kv_heads, D = skew_.head_dim, P = skew_.num_partial_columns;
  const int bs = backend_.kv_layout().block_size;
  const int32_t n = positions - rows;
  std::vector<int64_t> slots(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    const int32_t pos = rows + i;
    slots[static_cast<size_t>(i)] = SlotOf(slice.block_table, pos, bs);
  }
  keys_.resize(static_cast<size_t>(n) * KV * D);
  KVFLOW_RETURN_IF_ERROR(backend_.ReadKv(layer, 0, slots, keys_));
  for (int g = 0; g < KV; ++g) {
    state.partial_keys[static_cast<size_t>(layer) * KV + g].resize(static_cast<size_t>(positions) * P);
  }
  // Only the partial columns of key . A (a prompt's worth on a sequence's first selecting step).
  ParallelFor(n, [&](int64_t first, int64_t last) {
    for (int g = 0; g < KV; ++g) {
      float* partial = state.partial_keys[static_cast<size_t>(layer) * KV + g].data();
      SkewPartialColumns(keys_.data() + (static_cast<size_t>(first) * KV + g) * D, last - first,
                         static_cast<int64_t>(KV) * D, skew_.at(layer, g), D, partial + static_cast<size_t>(rows + first) * P);
    }
  }, 0, 64);
  rows = positions;
  return Status::Ok();
}

Status InfiniGenSelector::Speculate(int layer, const ForwardBatch& batch) {
  const ModelConfig& mc = backend_.model_config();
  const int NH = mc.num_heads, KV = skew_.num_kv_heads, D = skew_.head_dim, P = skew_.num_partial_columns;
  const int group = NH / KV;
  const int bs = backend_.kv_layout().block_size;
  const int64_t width = ActivationWidth(mc, Activation::kQkv);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // Layer `layer`'s input as far as it is known here: its own RMSNorm of the residual stream (kHidden
  // is free at both speculation points), then its projection (only the selecting rows are read).
  KVFLOW_RETURN_IF_ERROR(backend_.RmsNorm(layer, LayerWeight::kAttnNorm, /*add_delta=*/false));
  KVFLOW_RETURN_IF_ERROR(backend_.Linear(layer, LayerWeight::kQkv, Activation::kHidden, Activation::kSpeculativeQkv));
  qkv_rows_.resize(static_cast<size_t>(width));
  query_.resize(static_cast<size_t>(NH) * P);
  for (size_t a = 0; a < active_.size(); ++a) {
    const int32_t s = active_[a];
    const SequenceSlice& slice = batch.seqs[static_cast<size_t>(s)];
    SequenceState& state = *active_states_[a];
    const int32_t cached = slice.context_len - 1;  // tokens before the step's own
    KVFLOW_RETURN_IF_ERROR(ExtendPartialKeys(layer, slice, cached, state));
    KVFLOW_RETURN_IF_ERROR(backend_.ReadActivationRows(Activation::kSpeculativeQkv, slice.token_offset, 1, qkv_rows_));
    const int position = batch.positions[static_cast<size_t>(slice.token_offset)];
    // Rotate each query head at the token's position, then keep the partial columns of q . A.
    for (int h = 0; h < NH; ++h) {
      float* q = qkv_rows_.data() + static_cast<size_t>(h) * D;
      ApplyRope(q, D, position, rope_);
      for (int d = 0; d < D; ++d) q[d] *= scale;
      SkewPartialColumns(q, 1, D, skew_.at(layer, h / group), D, query_.data() + static_cast<size_t>(h) * P);
    }
    // Each KV head's score of each cached token: the best of its query heads.
    scores_.resize(static_cast<size_t>(KV) * cached);
    ParallelFor(cached, [&](int64_t first, int64_t last) {
      for (int g = 0; g < KV; ++g) {
        ScorePartialKeys(query_.data() + static_cast<size_t>(g) * group * P, group,
                         state.partial_keys[static_cast<size_t>(layer) * KV + g].data() + static_cast<size_t>(first) * P,
                         last - first, P, scores_.data() + static_cast<size_t>(g) * cached + first);
      }
    }, 0, 256);
    const SpeculatedTokens picked =
        SelectSpeculatedTokens(scores_, KV, cached, static_cast<float>(config_.alpha), config_.max_fraction);
    KvHeadSelection& sel = next_selection_[static_cast<size_t>(s)];
    sel.per_head = picked.count + 1;
    sel.slots.resize(static_cast<size_t>(KV) * sel.per_head);
    auto slot = [&](int32_t pos) { return SlotOf(slice.block_table, pos, bs); };
    for (int g = 0; g < KV; ++g) {
      int64_t* out = sel.slots.data() + static_cast<size_t>(g) * sel.per_head;
      for (int32_t i = 0; i < picked.count; ++i) out[i] = slot(picked.per_head[static_cast<size_t>(g)][static_cast<size_t>(i)]);
      out[picked.count] = slot(cached);  // the step's own token, last
    }
  }
  return Status::Ok();
}

void InfiniGenSelector::AddStats(KvSelectionStats& s) const { s.Add(stats_); }

}  // namespace kvflow
