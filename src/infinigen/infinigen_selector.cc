#include "infinigen/infinigen_selector.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include <spdlog/spdlog.h>

#include "infinigen/partial_keys.h"
#include "infinigen/skewing.h"
#include "infinigen/speculation.h"
#include "util/thread_pool.h"

namespace kvflow {

Result<SpeculationPoint> ParseSpeculationPoint(const std::string& name) {
  if (name == "layer-input") return SpeculationPoint::kLayerInput;
  if (name == "after-attention") return SpeculationPoint::kAfterAttention;
  if (name == "oracle") return SpeculationPoint::kOracle;
  return Status::InvalidArgument("infinigen_speculate_from must be layer-input, after-attention or oracle, not '" + name +
                                 "'");
}

Result<CountRule> ParseCountRule(const std::string& name) {
  if (name == "kv-head-max") return CountRule::kKvHeadMax;
  if (name == "query-heads") return CountRule::kQueryHeads;
  return Status::InvalidArgument("infinigen_count_rule must be query-heads or kv-head-max, not '" + name + "'");
}

Result<SpeculationDevice> ParseSpeculationDevice(const std::string& name) {
  if (name == "auto") return SpeculationDevice::kAuto;
  if (name == "device") return SpeculationDevice::kDevice;
  if (name == "host") return SpeculationDevice::kHost;
  return Status::InvalidArgument("infinigen_speculate_on must be auto, device or host, not '" + name + "'");
}

const char* SpeculationPointName(SpeculationPoint p) {
  switch (p) {
    case SpeculationPoint::kLayerInput: return "layer-input";
    case SpeculationPoint::kAfterAttention: return "after-attention";
    case SpeculationPoint::kOracle: return "oracle";
  }
  return "?";
}

InfiniGenConfig InfiniGenConfig::FromOptions(const KvSelectionConfig& c) {
  InfiniGenConfig g;
  const auto point = ParseSpeculationPoint(c.infinigen.speculate_from);
  if (point.ok()) g.point = point.value();  // Validate() below refuses a bad name through the engine
  g.alpha = c.infinigen.alpha;
  g.max_fraction = c.infinigen.max_fraction;
  g.min_context = c.min_context;
  g.max_tokens = c.infinigen.max_tokens;
  const auto rule = ParseCountRule(c.infinigen.count_rule);
  if (rule.ok()) g.count_rule = rule.value();  // the engine's checks refuse a bad name
  g.dense_layers = c.infinigen.dense_layers;
  g.sink_tokens = c.infinigen.sink_tokens;
  g.recent_tokens = c.infinigen.recent_tokens;
  g.host_kv_tokens = c.infinigen.host_kv_tokens;
  const auto eviction = ParseHostEvictionPolicy(c.infinigen.eviction);
  if (eviction.ok()) g.eviction = eviction.value();  // the engine's checks refuse a bad name
  return g;
}

Status InfiniGenConfig::Validate() const {
  if (!(alpha > 0.0) || !std::isfinite(alpha)) return Status::InvalidArgument("infinigen_alpha must be > 0");
  if (!(max_fraction > 0.0 && max_fraction <= 1.0)) return Status::InvalidArgument("infinigen_max_fraction must be in (0, 1]");
  if (min_context < 0) return Status::InvalidArgument("kv_selection_min_context must be >= 0");
  if (max_tokens < 0) return Status::InvalidArgument("infinigen_max_tokens must be >= 0 (0: infinigen_max_fraction)");
  if (dense_layers < 1) {
    return Status::InvalidArgument("infinigen_dense_layers must be >= 1 (layer 0 has no earlier layer to speculate from)");
  }
  if (sink_tokens < 0 || recent_tokens < 0) {
    return Status::InvalidArgument("infinigen_sink_tokens and infinigen_recent_tokens must be >= 0");
  }
  if (point == SpeculationPoint::kOracle && host_kv_tokens > 0) {
    return Status::InvalidArgument("the InfiniGen oracle (infinigen_speculate_from oracle) reads the whole cache to "
                                   "choose: it takes no host KV pool cap (infinigen_host_kv_tokens)");
  }
  if (host_kv_tokens < 0) {
    return Status::InvalidArgument("infinigen_host_kv_tokens must be >= 0 (tokens per sequence and layer; 0: no cap)");
  }
  return Status::Ok();
}

std::string HostOnlySettings(const InfiniGenConfig& c) {
  if (c.point == SpeculationPoint::kOracle) return "the oracle (infinigen_speculate_from oracle) runs on the host";
  if (c.count_rule != CountRule::kKvHeadMax) return "infinigen_count_rule query-heads runs on the host";
  if (c.sink_tokens > 0 || c.recent_tokens > 0) return "infinigen_sink_tokens and infinigen_recent_tokens run on the host";
  return {};
}

InfiniGenSelector::InfiniGenSelector(const InfiniGenConfig& config, SkewTable skew, Backend& backend)
    : config_(config),
      skew_(std::move(skew)),
      backend_(backend),
      rope_(ComputeRopeFrequencies(backend.model_config())),
      token_bytes_(backend.kv_token_bytes()) {}

Status InfiniGenSelector::SpeculateOnDevice(int num_chunks) {
  auto* device = backend_.As<DeviceKvSpeculation>();
  if (device == nullptr) return Status::Unsupported(backend_.Describe() + " has no device speculation");
  if (config_.host_kv_tokens > 0) {
    return Status::Unsupported("a host KV pool cap (infinigen_host_kv_tokens) keeps its eviction state on the host");
  }
  if (const std::string why = HostOnlySettings(config_); !why.empty()) return Status::Unsupported(why);
  if (!seqs_.empty()) return Status::Internal("SpeculateOnDevice after the first step");
  DeviceKvSpeculation::Setup setup;
  setup.num_partial_columns = skew_.num_partial_columns;
  std::vector<float> matrices;
  std::vector<int32_t> columns;
  for (int l = 0; l < skew_.num_layers; ++l) {
    for (int g = 0; g < skew_.num_kv_heads; ++g) {
      const SkewHead& head = skew_.at(l, g);
      matrices.insert(matrices.end(), head.matrix.begin(), head.matrix.end());
      columns.insert(columns.end(), head.columns.begin(), head.columns.end());
    }
  }
  setup.matrices = matrices;
  setup.columns = columns;
  setup.num_chunks = num_chunks;
  setup.alpha = static_cast<float>(config_.alpha);
  KVFLOW_RETURN_IF_ERROR(device->SetUpSpeculation(setup));
  device_ = device;
  chunk_rows_ = device->partial_key_chunk_rows();
  free_chunks_.resize(static_cast<size_t>(num_chunks));
  // Handed out from the back: low ids first.
  for (int32_t c = 0; c < num_chunks; ++c) free_chunks_[static_cast<size_t>(c)] = num_chunks - 1 - c;
  return Status::Ok();
}

void InfiniGenSelector::Forget(int64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return;
  // Its last step's counts (between steps here), before its chunks go back.
  if (device_ != nullptr) TakeDeviceCounts();
  const std::vector<int32_t>& chunks = it->second.chunks;
  free_chunks_.insert(free_chunks_.end(), chunks.rbegin(), chunks.rend());
  seqs_.erase(it);
}

bool InfiniGenSelector::EnsureChunks(SequenceState& state, int32_t rows) {
  const size_t need = static_cast<size_t>((rows + chunk_rows_ - 1) / chunk_rows_);
  while (state.chunks.size() < need) {
    if (free_chunks_.empty()) {
      if (!warned_no_chunks_) {
        spdlog::warn("InfiniGen: the device's partial key cache is full; sequences that cannot grow theirs read "
                     "their whole cache until chunks free up");
        warned_no_chunks_ = true;
      }
      return false;
    }
    state.chunks.push_back(free_chunks_.back());
    free_chunks_.pop_back();
  }
  return true;
}

void InfiniGenSelector::TakeDeviceCounts() {
  counts_.clear();
  const Status st = device_->TakeSpeculatedCounts(counts_);
  if (!st.ok()) {
    spdlog::warn("InfiniGen: the device speculation's counts wait for the next step: {}", st.message());
    return;
  }
  for (int32_t c : counts_) {
    const int64_t read = c + 1;  // and the step's own token
    stats_.tokens_selected += read;
    stats_.bytes_read += read * token_bytes_;
  }
}

LayerHooks* InfiniGenSelector::ForStep(const ForwardBatch& batch, std::span<const int64_t> seq_ids,
                                       std::span<const uint8_t> selecting) {
  if (device_ != nullptr) TakeDeviceCounts();
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
    // first decode step does not pay for the whole prompt). With a cap, the shorter single-token
    // steps too: their reads must skip evicted tokens.
    const bool decode = slice.num_tokens == 1 && slice.context_len >= std::max(config_.min_context, 2);
    if (!decode && slice.num_tokens == 1 && config_.host_kv_tokens == 0) continue;
    if (it == seqs_.end()) {
      it = seqs_.emplace(seq_ids[s], SequenceState{}).first;
      it->second.partial_keys.resize(skew_.heads.size());
      it->second.rows.assign(static_cast<size_t>(skew_.num_layers), 0);
      if (config_.host_kv_tokens > 0) {
        it->second.pools.reserve(static_cast<size_t>(skew_.num_layers));
        for (int l = 0; l < skew_.num_layers; ++l) {
          it->second.pools.emplace_back(HostKvEviction(config_.eviction, config_.host_kv_tokens));
        }
      }
    }
    // On the device the sequence needs chunks for every row it will hold this step.
    if (device_ != nullptr && !EnsureChunks(it->second, decode ? slice.context_len - 1 : slice.context_len)) continue;
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
  // The speculation at the previous layer chose this layer's reads.
  if (Selects(ctx.layer) && !active_.empty() && config_.point != SpeculationPoint::kOracle) {
    std::swap(selection_, next_selection_);
  }
  selection_layer_ = ctx.layer;
  if (device_ != nullptr && !prefilling_.empty()) {
    KVFLOW_RETURN_IF_ERROR(ExtendOnDevice(ctx.layer, batch, prefilling_, prefilling_states_,
                                          [](const SequenceSlice& slice) { return slice.context_len; }));
  }
  for (size_t p = 0; p < prefilling_.size(); ++p) {
    const size_t s = static_cast<size_t>(prefilling_[p]);
    const SequenceSlice& slice = batch.seqs[s];
    if (device_ == nullptr) {
      KVFLOW_RETURN_IF_ERROR(ExtendPartialKeys(ctx.layer, slice, slice.context_len, *prefilling_states_[p]));
    }
    KVFLOW_RETURN_IF_ERROR(ReadWholePool(ctx.layer, slice, *prefilling_states_[p], selection_[s]));
  }
  if (active_.empty()) return Status::Ok();
  if (config_.point == SpeculationPoint::kOracle && Selects(ctx.layer)) {
    const auto start = std::chrono::steady_clock::now();
    KVFLOW_RETURN_IF_ERROR(OracleSelect(ctx.layer, batch));
    stats_.select_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  // This layer's reads: the selection made at the previous layer (or the oracle's), or everything
  // live (the dense layers).
  for (size_t a = 0; a < active_.size(); ++a) {
    const size_t s = static_cast<size_t>(active_[a]);
    const SequenceSlice& slice = batch.seqs[s];
    SequenceState& state = *active_states_[a];
    if (!Selects(ctx.layer)) KVFLOW_RETURN_IF_ERROR(ReadWholePool(ctx.layer, slice, state, selection_[s]));
    const int32_t evicted = state.pools.empty() ? 0 : state.pools[static_cast<size_t>(ctx.layer)].num_evicted;
    stats_.bytes_full += static_cast<int64_t>(slice.context_len) * token_bytes_;
    const int32_t read = selection_[s].per_head > 0 ? selection_[s].per_head : slice.context_len;
    if (Selects(ctx.layer) && selection_[s].per_head > 0) {
      stats_.layer_reads_selected += 1;
      stats_.tokens_available += slice.context_len - evicted;
      if (selection_[s].speculated) continue;  // its count is on the device (TakeDeviceCounts)
      stats_.tokens_selected += read;
    } else {
      stats_.layer_reads_full += 1;
    }
    stats_.bytes_read += static_cast<int64_t>(read) * token_bytes_;
  }
  if (config_.point != SpeculationPoint::kLayerInput || !Selects(ctx.layer + 1)) return Status::Ok();
  return TimedSpeculate(ctx.layer + 1, batch);
}

Status InfiniGenSelector::AfterMlpInput(const LayerContext& ctx) {
  if (config_.point != SpeculationPoint::kAfterAttention || !Selects(ctx.layer + 1) || active_.empty()) {
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
  if (selection_layer_ != ctx.layer ||
      std::none_of(selection_.begin(), selection_.end(), [](const KvHeadSelection& sel) { return sel.per_head > 0; })) {
    return {};  // every slice reads its view
  }
  return selection_;
}

std::optional<std::span<const KvHeadSelection>> InfiniGenSelector::UpcomingSelection(int layer) {
  // With a host pool cap, prefill chunks read their live tokens, chosen at the layer itself.
  if (config_.host_kv_tokens > 0 && !prefilling_.empty()) return std::nullopt;
  // Steps with no selecting decode (prefill chunks only) read every slice's view; layer 0 is not
  // speculated, so nothing is known before it.
  if (active_.empty()) return std::span<const KvHeadSelection>{};
  if (next_selection_layer_ == layer) return std::span<const KvHeadSelection>(next_selection_);
  return std::nullopt;
}

Status InfiniGenSelector::SyncPool(int layer, int32_t positions, SequenceState& state) {
  if (state.pools.empty()) return Status::Ok();
  LayerPool& pool = state.pools[static_cast<size_t>(layer)];
  for (; pool.admitted > positions; --pool.admitted) {  // recomputed: no longer in the cache
    const int32_t pos = pool.admitted - 1;
    if (pool.evicted[static_cast<size_t>(pos)]) {
      --pool.num_evicted;
    } else {
      KVFLOW_RETURN_IF_ERROR(pool.entries.Erase(pos));
    }
  }
  pool.evicted.resize(static_cast<size_t>(std::max(pool.admitted, positions)), 0);
  for (; pool.admitted < positions; ++pool.admitted) {
    if (pool.entries.full()) {
      const int64_t victim = pool.entries.Victim().value();
      KVFLOW_RETURN_IF_ERROR(pool.entries.Erase(victim));
      pool.evicted[static_cast<size_t>(victim)] = 1;
      ++pool.num_evicted;
      ++stats_.tokens_evicted;
    }
    KVFLOW_RETURN_IF_ERROR(pool.entries.Insert(pool.admitted));
  }
  return Status::Ok();
}

void InfiniGenSelector::LivePositions(const LayerPool& pool, std::vector<int32_t>& out) {
  out.clear();
  for (int32_t pos = 0; pos < pool.admitted; ++pos) {
    if (!pool.evicted[static_cast<size_t>(pos)]) out.push_back(pos);
  }
}

Status InfiniGenSelector::ReadWholePool(int layer, const SequenceSlice& slice, SequenceState& state,
                                        KvHeadSelection& sel) {
  sel.per_head = 0;
  if (state.pools.empty()) return Status::Ok();
  const int32_t first_new = slice.context_len - slice.num_tokens;
  KVFLOW_RETURN_IF_ERROR(SyncPool(layer, first_new, state));
  LayerPool& pool = state.pools[static_cast<size_t>(layer)];
  LivePositions(pool, live_);
  for (int32_t pos : live_) KVFLOW_RETURN_IF_ERROR(pool.entries.OnFetch(pos));
  if (pool.num_evicted == 0) return Status::Ok();
  const int KV = skew_.num_kv_heads, bs = backend_.kv_layout().block_size;
  sel.per_head = static_cast<int32_t>(live_.size()) + slice.num_tokens;
  sel.slots.resize(static_cast<size_t>(KV) * sel.per_head);
  for (size_t i = 0; i < live_.size(); ++i) sel.slots[i] = SlotOf(slice.block_table, live_[i], bs);
  for (int32_t j = 0; j < slice.num_tokens; ++j) {  // the step's own, last (causal in list order)
    sel.slots[live_.size() + static_cast<size_t>(j)] = SlotOf(slice.block_table, first_new + j, bs);
  }
  for (int g = 1; g < KV; ++g) {
    std::copy_n(sel.slots.begin(), sel.per_head, sel.slots.begin() + static_cast<std::ptrdiff_t>(g) * sel.per_head);
  }
  return Status::Ok();
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

template <typename PositionsOf>
Status InfiniGenSelector::ExtendOnDevice(int layer, const ForwardBatch& batch, const std::vector<int32_t>& slices,
                                         const std::vector<SequenceState*>& states, PositionsOf positions_of) {
  extend_jobs_.clear();
  for (size_t a = 0; a < slices.size(); ++a) {
    const SequenceSlice& slice = batch.seqs[static_cast<size_t>(slices[a])];
    SequenceState& state = *states[a];
    int32_t& rows = state.rows[static_cast<size_t>(layer)];
    const int32_t positions = positions_of(slice);
    if (rows >= positions) continue;
    DeviceKvSpeculation::ExtendJob job;
    job.rows.slice = slices[a];
    job.rows.chunks = state.chunks;
    job.from = rows;
    job.to = positions;
    extend_jobs_.push_back(job);
    rows = positions;
  }
  return device_->ExtendPartialKeys(layer, extend_jobs_);
}

Status InfiniGenSelector::SpeculateWithDevice(int layer, const ForwardBatch& batch) {
  // The partial keys of every cached token (the previous step's among them), the projection, then
  // the speculation: nothing returns to the host.
  KVFLOW_RETURN_IF_ERROR(ExtendOnDevice(layer, batch, active_, active_states_,
                                        [](const SequenceSlice& slice) { return slice.context_len - 1; }));
  KVFLOW_RETURN_IF_ERROR(backend_.RmsNorm(layer, LayerWeight::kAttnNorm, /*add_delta=*/false));
  KVFLOW_RETURN_IF_ERROR(backend_.Linear(layer, LayerWeight::kQkv, Activation::kHidden, Activation::kSpeculativeQkv));
  speculate_jobs_.clear();
  for (size_t a = 0; a < active_.size(); ++a) {
    const int32_t s = active_[a];
    const SequenceSlice& slice = batch.seqs[static_cast<size_t>(s)];
    DeviceKvSpeculation::SpeculateJob job;
    job.rows.slice = s;
    job.rows.chunks = active_states_[a]->chunks;
    job.candidates = slice.context_len - 1;
    job.cap = SpeculatedTokenCap(job.candidates, config_.max_fraction, config_.max_tokens);
    speculate_jobs_.push_back(job);
    KvHeadSelection& sel = next_selection_[static_cast<size_t>(s)];
    sel.per_head = job.cap + 1;
    sel.slots.clear();
    sel.speculated = true;
  }
  return device_->Speculate(layer, speculate_jobs_);
}

Status InfiniGenSelector::Speculate(int layer, const ForwardBatch& batch) {
  if (device_ != nullptr) return SpeculateWithDevice(layer, batch);
  const ModelConfig& mc = backend_.model_config();
  const int NH = mc.num_heads, KV = skew_.num_kv_heads, D = skew_.head_dim, P = skew_.num_partial_columns;
  const int group = NH / KV;
  const int64_t width = ActivationWidth(mc, Activation::kQkv);
  const float scale = mc.AttentionScale();
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
    KVFLOW_RETURN_IF_ERROR(SyncPool(layer, cached, state));
    LayerPool* pool = state.pools.empty() ? nullptr : &state.pools[static_cast<size_t>(layer)];
    // The candidates: every cached token, or the live ones once the layer's pool evicted any.
    const bool sparse = pool != nullptr && pool->num_evicted > 0;
    if (sparse) LivePositions(*pool, live_);
    const int32_t candidates = sparse ? static_cast<int32_t>(live_.size()) : cached;
    KVFLOW_RETURN_IF_ERROR(backend_.ReadActivationRows(Activation::kSpeculativeQkv, slice.token_offset, 1, qkv_rows_));
    const int position = batch.positions[static_cast<size_t>(slice.token_offset)];
    // Rotate each query head at the token's position, then keep the partial columns of q . A.
    for (int h = 0; h < NH; ++h) {
      float* q = qkv_rows_.data() + static_cast<size_t>(h) * D;
      ApplyRope(q, D, position, rope_);
      for (int d = 0; d < D; ++d) q[d] *= scale;
      SkewPartialColumns(q, 1, D, skew_.at(layer, h / group), D, query_.data() + static_cast<size_t>(h) * P);
    }
    // Each KV head's score of each candidate, the best of its query heads (kv-head-max), or every
    // query head's own (query-heads).
    const bool per_query_head = config_.count_rule == CountRule::kQueryHeads && group > 1;
    const int rows = per_query_head ? NH : KV;
    scores_.resize(static_cast<size_t>(rows) * candidates);
    ParallelFor(candidates, [&](int64_t first, int64_t last) {
      for (int r = 0; r < rows; ++r) {
        const int g = per_query_head ? r / group : r;
        const int heads = per_query_head ? 1 : group;
        const float* queries = query_.data() + static_cast<size_t>(per_query_head ? r : g * group) * P;
        const float* partial = state.partial_keys[static_cast<size_t>(layer) * KV + g].data();
        float* scores = scores_.data() + static_cast<size_t>(r) * candidates;
        if (!sparse) {
          ScorePartialKeys(queries, heads, partial + static_cast<size_t>(first) * P, last - first, P, scores + first);
          continue;
        }
        for (int64_t i = first; i < last; ++i) {
          ScorePartialKeys(queries, heads, partial + static_cast<size_t>(live_[static_cast<size_t>(i)]) * P, 1, P,
                           scores + i);
        }
      }
    }, 0, 256);
    const SpeculatedTokens picked = SelectTokensByRows(scores_, rows, candidates, SelectionRule(per_query_head ? group : 1));
    auto position_of = [&](int32_t i) { return sparse ? live_[static_cast<size_t>(i)] : i; };
    KvHeadSelection& sel = next_selection_[static_cast<size_t>(s)];
    FillSelection(picked, slice, cached, position_of, sel);
    if (pool != nullptr) {
      fetched_.clear();
      for (int g = 0; g < KV; ++g) {
        for (int32_t i : picked.per_head[static_cast<size_t>(g)]) fetched_.push_back(position_of(i));
      }
      // One prefetch per token, however many KV heads take it.
      std::sort(fetched_.begin(), fetched_.end());
      fetched_.erase(std::unique(fetched_.begin(), fetched_.end()), fetched_.end());
      for (int32_t pos : fetched_) KVFLOW_RETURN_IF_ERROR(pool->entries.OnFetch(pos));
    }
  }
  return Status::Ok();
}

TokenSelectionRule InfiniGenSelector::SelectionRule(int group) const {
  TokenSelectionRule rule;
  rule.group = group;
  rule.alpha = static_cast<float>(config_.alpha);
  rule.max_fraction = config_.max_fraction;
  rule.max_tokens = config_.max_tokens;
  rule.sink_tokens = config_.sink_tokens;
  rule.recent_tokens = config_.recent_tokens;
  return rule;
}

template <typename PositionOf>
void InfiniGenSelector::FillSelection(const SpeculatedTokens& picked, const SequenceSlice& slice, int32_t cached,
                                      PositionOf position_of, KvHeadSelection& sel) {
  const int KV = skew_.num_kv_heads, bs = backend_.kv_layout().block_size;
  sel.per_head = picked.count + 1;
  sel.slots.resize(static_cast<size_t>(KV) * sel.per_head);
  for (int g = 0; g < KV; ++g) {
    int64_t* out = sel.slots.data() + static_cast<size_t>(g) * sel.per_head;
    const std::vector<int32_t>& tokens = picked.per_head[static_cast<size_t>(g)];
    for (int32_t i = 0; i < picked.count; ++i) out[i] = SlotOf(slice.block_table, position_of(tokens[static_cast<size_t>(i)]), bs);
    out[picked.count] = SlotOf(slice.block_table, cached, bs);  // the step's own token, last
  }
}

Status InfiniGenSelector::OracleSelect(int layer, const ForwardBatch& batch) {
  const ModelConfig& mc = backend_.model_config();
  const int NH = mc.num_heads, KV = skew_.num_kv_heads, D = skew_.head_dim;
  const int group = NH / KV;
  const int bs = backend_.kv_layout().block_size;
  const float scale = mc.AttentionScale();
  const bool per_query_head = config_.count_rule == CountRule::kQueryHeads && group > 1;
  const int rows = per_query_head ? NH : KV;
  qkv_rows_.resize(static_cast<size_t>(ActivationWidth(mc, Activation::kQkv)));
  for (size_t a = 0; a < active_.size(); ++a) {
    const int32_t s = active_[a];
    const SequenceSlice& slice = batch.seqs[static_cast<size_t>(s)];
    const int32_t cached = slice.context_len - 1;
    // The layer's rotated queries (the step's own row of kQkv) and every cached key.
    KVFLOW_RETURN_IF_ERROR(backend_.ReadActivationRows(Activation::kQkv, slice.token_offset, 1, qkv_rows_));
    oracle_slots_.resize(static_cast<size_t>(cached));
    for (int32_t pos = 0; pos < cached; ++pos) oracle_slots_[static_cast<size_t>(pos)] = SlotOf(slice.block_table, pos, bs);
    keys_.resize(static_cast<size_t>(cached) * KV * D);
    KVFLOW_RETURN_IF_ERROR(backend_.ReadKv(layer, 0, oracle_slots_, keys_));
    head_scores_.resize(static_cast<size_t>(NH) * cached);
    ParallelFor(cached, [&](int64_t first, int64_t last) {
      for (int h = 0; h < NH; ++h) {
        const float* q = qkv_rows_.data() + static_cast<size_t>(h) * D;
        float* out = head_scores_.data() + static_cast<size_t>(h) * cached;
        for (int64_t t = first; t < last; ++t) {
          const float* k = keys_.data() + (static_cast<size_t>(t) * KV + h / group) * D;
          double dot = 0.0;  // an evaluation path: exact enough that ties are the model's, not rounding's
          for (int d = 0; d < D; ++d) dot += static_cast<double>(q[d]) * k[d];
          out[t] = static_cast<float>(dot * scale);
        }
      }
    }, 0, 256);
    const float* scores = head_scores_.data();
    if (!per_query_head && group > 1) {
      scores_.assign(static_cast<size_t>(KV) * cached, -INFINITY);
      for (int h = 0; h < NH; ++h) {
        float* out = scores_.data() + static_cast<size_t>(h / group) * cached;
        const float* in = head_scores_.data() + static_cast<size_t>(h) * cached;
        for (int32_t t = 0; t < cached; ++t) out[t] = std::max(out[t], in[t]);
      }
      scores = scores_.data();
    }
    const SpeculatedTokens picked = SelectTokensByRows(std::span<const float>(scores, static_cast<size_t>(rows) * cached),
                                                       rows, cached, SelectionRule(per_query_head ? group : 1));
    FillSelection(picked, slice, cached, [](int32_t i) { return i; }, selection_[static_cast<size_t>(s)]);
  }
  return Status::Ok();
}

void InfiniGenSelector::AddStats(KvSelectionStats& s) const { s.Add(stats_); }

const HostKvEviction* InfiniGenSelector::HostPool(int64_t seq_id, int layer) const {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end() || it->second.pools.empty()) return nullptr;
  return &it->second.pools.at(static_cast<size_t>(layer)).entries;
}

std::vector<int32_t> InfiniGenSelector::EvictedPositions(int64_t seq_id, int layer) const {
  std::vector<int32_t> out;
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end() || it->second.pools.empty()) return out;
  const LayerPool& pool = it->second.pools.at(static_cast<size_t>(layer));
  for (int32_t pos = 0; pos < pool.admitted; ++pos) {
    if (pool.evicted[static_cast<size_t>(pos)]) out.push_back(pos);
  }
  return out;
}

}  // namespace kvflow
