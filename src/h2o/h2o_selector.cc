#include "h2o/h2o_selector.h"

#include <algorithm>
#include <chrono>
#include <cmath>

namespace kvflow {

H2OConfig H2OConfig::FromOptions(const KvSelectionConfig& c) {
  H2OConfig h;
  h.budget = c.h2o.budget;
  h.recent_share = c.h2o.recent_share;
  h.min_context = c.min_context;
  return h;
}

Status H2OConfig::Validate() const {
  if (!(budget > 0.0 && budget <= 1.0)) return Status::InvalidArgument("h2o_budget must be in (0, 1]");
  if (!(recent_share >= 0.0 && recent_share <= 1.0)) return Status::InvalidArgument("h2o_recent_share must be in [0, 1]");
  if (min_context < 0) return Status::InvalidArgument("kv_selection_min_context must be >= 0");
  return Status::Ok();
}

int32_t H2OConfig::Budget(int32_t context) const {
  return std::clamp(static_cast<int32_t>(std::ceil(budget * context)), 1, context);
}

H2OSelector::H2OSelector(const H2OConfig& config, Backend& backend)
    : config_(config), backend_(backend), token_bytes_(backend.kv_token_bytes()) {}

LayerHooks* H2OSelector::ForStep(const ForwardBatch& batch, std::span<const int64_t> seq_ids,
                                 std::span<const uint8_t> selecting) {
  active_.clear();
  active_states_.clear();
  selection_layer_ = -1;
  const int layers = backend_.model_config().num_layers, KV = backend_.model_config().num_kv_heads;
  for (size_t s = 0; s < batch.seqs.size(); ++s) {
    const SequenceSlice& slice = batch.seqs[s];
    auto it = seqs_.find(seq_ids[s]);
    if (it != seqs_.end() && slice.context_len - slice.num_tokens < it->second.seen.front()) {
      seqs_.erase(it);  // recomputed from an earlier position: its evictions no longer describe the cache
      it = seqs_.end();
    }
    if (!selecting[s] || slice.num_tokens != 1 || slice.view.kind != KvView::Kind::kFull ||
        slice.context_len < std::max(config_.min_context, 2)) {
      continue;
    }
    if (it == seqs_.end()) {
      it = seqs_.emplace(seq_ids[s], SequenceState{}).first;
      it->second.heads.resize(static_cast<size_t>(layers) * KV);
      it->second.seen.assign(static_cast<size_t>(layers), 0);
    }
    active_.push_back(static_cast<int32_t>(s));
    active_states_.push_back(&it->second);
  }
  if (active_.empty()) return nullptr;
  stats_.decode_tokens += static_cast<int64_t>(active_.size());
  selection_.assign(batch.seqs.size(), KvHeadSelection{});
  return this;
}

Status H2OSelector::BeforeAttention(const LayerContext& ctx) {
  const auto start = std::chrono::steady_clock::now();
  const int KV = backend_.model_config().num_kv_heads;
  const int bs = backend_.kv_layout().block_size;
  for (size_t a = 0; a < active_.size(); ++a) {
    const SequenceSlice& slice = ctx.batch.seqs[static_cast<size_t>(active_[a])];
    SequenceState& state = *active_states_[a];
    const int32_t cached = slice.context_len - 1;
    int32_t& seen = state.seen[static_cast<size_t>(ctx.layer)];
    if (seen < cached) {
      // Tokens this layer has not kept yet (a fresh sequence's prompt) join the kept set.
      for (int g = 0; g < KV; ++g) {
        HeadState& head = state.heads[static_cast<size_t>(ctx.layer) * KV + g];
        for (int32_t p = seen; p < cached; ++p) head.kept.push_back(p);
        head.score.resize(static_cast<size_t>(cached) + 1, 0.0f);  // the step's own too
      }
      const bool over_budget = cached + 1 > config_.Budget(slice.context_len);
      seen = cached;
      if (over_budget) {
        // Score the prompt by this query's attention, then evict down to the budget (less the step's own).
        KVFLOW_RETURN_IF_ERROR(Accumulate(ctx.layer, slice, state));
        const int32_t budget = config_.Budget(slice.context_len) - 1;
        const int32_t recent = static_cast<int32_t>(std::lround(config_.recent_share * budget));
        Evict(ctx.layer, std::max(budget, 0), cached - recent, state);
      }
    }
    KvHeadSelection& sel = selection_[static_cast<size_t>(active_[a])];
    const HeadState& first = state.heads[static_cast<size_t>(ctx.layer) * KV];
    sel.per_head = static_cast<int32_t>(first.kept.size()) + 1;
    sel.slots.resize(static_cast<size_t>(KV) * sel.per_head);
    auto slot = [&](int32_t pos) { return SlotOf(slice.block_table, pos, bs); };
    for (int g = 0; g < KV; ++g) {
      const HeadState& head = state.heads[static_cast<size_t>(ctx.layer) * KV + g];
      // Every head keeps the same recent window and evicts the same count, so the sizes agree.
      if (static_cast<int32_t>(head.kept.size()) + 1 != sel.per_head) return Status::Internal("H2O: KV heads kept different counts");
      int64_t* out = sel.slots.data() + static_cast<size_t>(g) * sel.per_head;
      for (size_t i = 0; i < head.kept.size(); ++i) out[i] = slot(head.kept[i]);
      out[head.kept.size()] = slot(cached);
    }
    stats_.layer_reads_selected += 1;
    stats_.tokens_selected += sel.per_head;
    stats_.tokens_available += slice.context_len;
    stats_.bytes_read += static_cast<int64_t>(sel.per_head) * token_bytes_;
    stats_.bytes_full += static_cast<int64_t>(slice.context_len) * token_bytes_;
  }
  selection_layer_ = ctx.layer;
  stats_.select_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return Status::Ok();
}

std::span<const KvHeadSelection> H2OSelector::AttentionSelection(const LayerContext& ctx) {
  if (selection_layer_ != ctx.layer) return {};
  return selection_;
}

Status H2OSelector::AfterAttention(const LayerContext& ctx) {
  const auto start = std::chrono::steady_clock::now();
  const int KV = backend_.model_config().num_kv_heads;
  for (size_t a = 0; a < active_.size(); ++a) {
    const SequenceSlice& slice = ctx.batch.seqs[static_cast<size_t>(active_[a])];
    SequenceState& state = *active_states_[a];
    const int32_t position = slice.context_len - 1;
    for (int g = 0; g < KV; ++g) {
      HeadState& head = state.heads[static_cast<size_t>(ctx.layer) * KV + g];
      head.kept.push_back(position);
      head.score.resize(static_cast<size_t>(position) + 1, 0.0f);
    }
    state.seen[static_cast<size_t>(ctx.layer)] = position + 1;
    KVFLOW_RETURN_IF_ERROR(Accumulate(ctx.layer, slice, state));
    const int32_t budget = config_.Budget(slice.context_len);
    const int32_t recent = static_cast<int32_t>(std::lround(config_.recent_share * budget));
    Evict(ctx.layer, budget, slice.context_len - recent, state);
  }
  stats_.select_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return Status::Ok();
}

Status H2OSelector::Accumulate(int layer, const SequenceSlice& slice, SequenceState& state) {
  const ModelConfig& mc = backend_.model_config();
  const int NH = mc.num_heads, KV = mc.num_kv_heads, D = mc.head_dim, group = NH / KV;
  const int bs = backend_.kv_layout().block_size;
  const float scale = mc.AttentionScale();
  const int32_t own = slice.context_len - 1;
  qkv_row_.resize(static_cast<size_t>(ActivationWidth(mc, Activation::kQkv)));
  KVFLOW_RETURN_IF_ERROR(backend_.ReadActivationRows(Activation::kQkv, slice.token_offset, 1, qkv_row_));
  // The kept tokens of every head and the step's own, read once (ReadKv returns every KV head).
  union_.clear();
  for (int g = 0; g < KV; ++g) {
    const std::vector<int32_t>& kept = state.heads[static_cast<size_t>(layer) * KV + g].kept;
    union_.insert(union_.end(), kept.begin(), kept.end());
  }
  union_.push_back(own);
  std::sort(union_.begin(), union_.end());
  union_.erase(std::unique(union_.begin(), union_.end()), union_.end());
  std::vector<int64_t> slots(union_.size());
  for (size_t i = 0; i < union_.size(); ++i) slots[i] = SlotOf(slice.block_table, union_[i], bs);
  keys_.resize(slots.size() * static_cast<size_t>(KV) * D);
  // The step's own key is in the cache already (written before attention).
  KVFLOW_RETURN_IF_ERROR(backend_.ReadKv(layer, 0, slots, keys_));
  auto row_of = [&](int32_t pos) {
    return static_cast<size_t>(std::lower_bound(union_.begin(), union_.end(), pos) - union_.begin());
  };
  for (int g = 0; g < KV; ++g) {
    HeadState& head = state.heads[static_cast<size_t>(layer) * KV + g];
    // The kept tokens, and the step's own when it is not among them yet.
    std::vector<int32_t> positions = head.kept;
    if (positions.empty() || positions.back() != own) positions.push_back(own);
    probs_.resize(positions.size());
    for (int j = 0; j < group; ++j) {
      const float* q = qkv_row_.data() + static_cast<size_t>(g * group + j) * D;
      float max = -INFINITY;
      for (size_t i = 0; i < positions.size(); ++i) {
        const float* k = keys_.data() + (row_of(positions[i]) * KV + g) * D;
        float acc = 0.0f;
        for (int d = 0; d < D; ++d) acc += q[d] * k[d];
        probs_[i] = acc * scale;
        max = std::max(max, probs_[i]);
      }
      double sum = 0.0;
      for (float& p : probs_) {
        p = std::exp(p - max);
        sum += p;
      }
      for (size_t i = 0; i < positions.size(); ++i) {
        head.score[static_cast<size_t>(positions[i])] += static_cast<float>(probs_[i] / sum);
      }
    }
  }
  return Status::Ok();
}

void H2OSelector::Evict(int layer, int32_t budget, int32_t recent_from, SequenceState& state) const {
  const int KV = backend_.model_config().num_kv_heads;
  for (int g = 0; g < KV; ++g) {
    HeadState& head = state.heads[static_cast<size_t>(layer) * KV + g];
    const int32_t excess = static_cast<int32_t>(head.kept.size()) - budget;
    if (excess <= 0) continue;
    // Candidates: kept tokens older than the recent window; the lowest scores go (ties: the older).
    std::vector<int32_t> candidates;
    for (int32_t p : head.kept) {
      if (p < recent_from) candidates.push_back(p);
    }
    const size_t drop = std::min(candidates.size(), static_cast<size_t>(excess));
    std::partial_sort(candidates.begin(), candidates.begin() + static_cast<std::ptrdiff_t>(drop), candidates.end(),
                      [&](int32_t a, int32_t b) {
                        const float sa = head.score[static_cast<size_t>(a)], sb = head.score[static_cast<size_t>(b)];
                        return sa != sb ? sa < sb : a < b;
                      });
    std::vector<int32_t> evicted(candidates.begin(), candidates.begin() + static_cast<std::ptrdiff_t>(drop));
    std::sort(evicted.begin(), evicted.end());
    std::vector<int32_t> kept;
    kept.reserve(head.kept.size() - drop);
    std::set_difference(head.kept.begin(), head.kept.end(), evicted.begin(), evicted.end(), std::back_inserter(kept));
    head.kept = std::move(kept);
  }
}

void H2OSelector::AddStats(KvSelectionStats& s) const { s.Add(stats_); }

}  // namespace kvflow
