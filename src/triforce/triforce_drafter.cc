#include "triforce/triforce_drafter.h"

#include <algorithm>
#include <chrono>

#include <spdlog/spdlog.h>

#include "sampling/sampler.h"
#include "sched/sequence_group.h"
#include "sampling/rejection_sampler.h"

namespace kvflow {

namespace {

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Tokens after the partial block a lane must hold: the gamma2 drafts and one middle pass of
// gamma1 bottom drafts past them.
int LaneTokens(const TriForceConfig& c) { return c.gamma2 + c.gamma1 + 1; }

}  // namespace

TriForceConfig TriForceConfig::FromOptions(const SpeculativeConfig& c, int max_num_seqs) {
  TriForceConfig t;
  t.gamma2 = c.num_tokens;
  t.gamma1 = c.triforce.draft_tokens;
  t.bottom = c.triforce.draft;
  t.retrieval.budget_tokens = c.triforce.budget;
  t.retrieval.rebuild_stride = c.triforce.rebuild_stride;
  t.retrieval.rebuild_acceptance = c.triforce.rebuild_acceptance;
  t.retrieval.min_context = c.triforce.min_context;
  t.sinks = c.triforce.sinks;
  t.window = c.triforce.window;
  t.ngram_max = c.ngram.max;
  t.ngram_min = c.ngram.min;
  t.max_num_seqs = max_num_seqs;
  return t;
}

Status TriForceConfig::Validate() const {
  auto bad = [](const std::string& m) { return Status::InvalidArgument("triforce: " + m); };
  if (gamma2 < 1 || gamma2 > 64) return bad("num_speculative_tokens (gamma2) must be in [1, 64]");
  if (gamma1 < 0 || gamma1 > 64) return bad("triforce_draft_tokens (gamma1) must be in [0, 64]");
  if (bottom != "ngram" && bottom != "streaming" && bottom != "draft_model") {
    return bad("triforce_draft must be ngram, streaming or draft_model, not '" + bottom + "'");
  }
  if (retrieval.budget_tokens < 0) return bad("triforce_budget must be >= 0 (0: auto)");
  if (retrieval.rebuild_stride < 0) return bad("triforce_rebuild_stride must be >= 0");
  if (!(retrieval.rebuild_acceptance >= 0.0 && retrieval.rebuild_acceptance <= 1.0)) {
    return bad("triforce_rebuild_acceptance must be in [0, 1]");
  }
  if (retrieval.min_context < 0) return bad("triforce_min_context must be >= 0");
  if (sinks < 0 || window < 1) return bad("triforce_sinks must be >= 0 and triforce_window >= 1");
  if (ngram_min < 1 || ngram_max < ngram_min) return bad("ngram sizes need 1 <= ngram_min <= ngram_max");
  if (max_num_seqs < 1) return bad("max_num_seqs must be >= 1");
  return Status::Ok();
}

// One sequence's drafting in a Propose call.
struct TriForceDrafter::Work {
  DraftJob* job = nullptr;
  RetrievalCache* cache = nullptr;
  int lane = 0;
  int64_t cached = 0;  // tokens in the KV cache (all but the sequence's last)
  bool done = false;
  std::vector<BlockId> middle_blocks;  // physical full blocks the middle reads
  // The bottom's drafts for the coming middle pass and, from a sampling bottom, their rows.
  std::vector<int32_t> bottom;
  std::vector<float> bottom_probs;
  int64_t bottom_valid = 0;  // positions [cached, bottom_valid) of the bottom's lane are current

  int cap(int gamma2) const { return std::min(job->max_drafts, gamma2); }
  int64_t drafted() const { return static_cast<int64_t>(job->drafts.size()); }
  // The token the next pass starts with (its K/V not computed yet) and its position.
  int32_t pending() const { return job->drafts.empty() ? job->seq->tokens.back() : job->drafts.back(); }
  int64_t pending_position() const { return cached + drafted(); }
  // The sequence's token at `position` >= cached, drafts included.
  int32_t TokenAt(int64_t position) const {
    return position == cached ? job->seq->tokens.back() : job->drafts[static_cast<size_t>(position - cached - 1)];
  }
  // History for penalties: the output so far, then the drafts.
  void History(std::vector<int32_t>& out) const {
    const SchedSequence& s = *job->seq;
    out.assign(s.tokens.begin() + s.prompt_len, s.tokens.end());
    out.insert(out.end(), job->drafts.begin(), job->drafts.end());
  }
};

// ---- the bottom drafter ---------------------------------------------------------------------------

class TriForceDrafter::Bottom {
 public:
  Bottom(const TriForceConfig& config, Backend* backend, BlockId scratch, int vocab)
      : config_(config),
        ngram_(NgramDrafterConfig{std::max(1, config.gamma1), config.ngram_max, config.ngram_min}),
        vocab_(vocab) {
    if (backend) {
      const int bs = backend->kv_layout().block_size;
      lanes_ = std::make_unique<LanePool>(*backend, scratch, LanePool::BlocksPerLane(LaneTokens(config), bs),
                                          config.max_num_seqs);
    }
  }

  bool samples() const { return lanes_ != nullptr; }

  // Readies the lanes for this call's works (copies their partial blocks).
  Status Start(std::vector<Work>& works) {
    if (!lanes_) return Status::Ok();
    std::vector<LanePool::PartialBlock> parts;
    for (Work& w : works) {
      w.bottom_valid = w.cached;
      parts.push_back({w.lane, w.job->block_table, w.cached});
    }
    return lanes_->CopyPartialBlocks(parts);
  }

  // Fills each active work's `bottom` with up to `want` drafts (want[i] for works[i]).
  Status Draft(std::vector<Work*>& works, const std::vector<int>& want, SpecDecodeStats& stats) {
    for (size_t i = 0; i < works.size(); ++i) {
      works[i]->bottom.clear();
      works[i]->bottom_probs.clear();
    }
    if (!lanes_) {
      std::vector<int32_t> tokens;
      for (size_t i = 0; i < works.size(); ++i) {
        if (want[i] <= 0) continue;
        const Work& w = *works[i];
        tokens.assign(w.job->seq->tokens.begin(), w.job->seq->tokens.end());
        tokens.insert(tokens.end(), w.job->drafts.begin(), w.job->drafts.end());
        works[i]->bottom = ngram_.Propose(tokens, want[i]);
      }
      return Status::Ok();
    }
    return DraftWithModel(works, want, stats);
  }

  // After the middle kept `accepted` of a work's bottom drafts: which of the bottom's K/V stay.
  void Advance(Work& w, int64_t pending_position, int64_t accepted, int fed_drafts) {
    if (!lanes_ || fed_drafts < 0) return;
    w.bottom_valid = pending_position + 1 + std::min<int64_t>(accepted, fed_drafts);
  }

 private:
  // The streaming cache: the first `sinks` tokens' blocks and the last `window` tokens' full blocks.
  std::vector<BlockId> StreamingBlocks(const Work& w) const {
    const int bs = lanes_->backend().kv_layout().block_size;
    const int64_t full = w.cached / bs;
    const int64_t sink_blocks = std::min<int64_t>(BlocksForTokens(config_.sinks, bs), full);
    const int64_t window_blocks = std::max<int64_t>(1, config_.window / bs);
    std::vector<BlockId> out;
    for (int64_t b = 0; b < sink_blocks; ++b) out.push_back(w.job->block_table[static_cast<size_t>(b)]);
    for (int64_t b = std::max(sink_blocks, full - window_blocks); b < full; ++b) {
      out.push_back(w.job->block_table[static_cast<size_t>(b)]);
    }
    return out;
  }

  // Autoregressive passes of the bottom model: the first catches up on the tokens its lane lacks
  // and samples draft 1, each later one feeds the previous draft.
  Status DraftWithModel(std::vector<Work*>& works, const std::vector<int>& want, SpecDecodeStats& stats) {
    const auto start = Clock::now();
    std::vector<float> probs;
    std::vector<int32_t> history;
    for (int step = 0;; ++step) {
      std::vector<LaneSlice> slices;
      std::vector<Work*> rows;
      for (size_t i = 0; i < works.size(); ++i) {
        Work& w = *works[i];
        if (step >= want[i]) continue;
        LaneSlice s;
        s.blocks = StreamingBlocks(w);
        s.lane = w.lane;
        s.lane_origin = w.cached / lanes_->backend().kv_layout().block_size * lanes_->backend().kv_layout().block_size;
        if (step == 0) {
          s.first_position = w.bottom_valid;
          for (int64_t p = w.bottom_valid; p <= w.pending_position(); ++p) s.tokens.push_back(w.TokenAt(p));
        } else {
          s.first_position = w.pending_position() + step;
          s.tokens.push_back(w.bottom.back());
        }
        slices.push_back(std::move(s));
        rows.push_back(&w);
      }
      if (slices.empty()) break;
      KVFLOW_RETURN_IF_ERROR(lanes_->Forward(slices, nullptr, logits_));
      stats.bottom_passes += static_cast<int64_t>(slices.size());
      int64_t row = 0;
      for (size_t r = 0; r < rows.size(); ++r) {
        Work& w = *rows[r];
        row += static_cast<int64_t>(slices[r].tokens.size());
        const SchedSequence& seq = *w.job->seq;
        w.History(history);
        history.insert(history.end(), w.bottom.begin(), w.bottom.end());
        std::span<float> last(logits_.data() + (row - 1) * vocab_, static_cast<size_t>(vocab_));
        w.job->sampler->Distribution(last, std::span<const int32_t>(seq.tokens.data(), static_cast<size_t>(seq.prompt_len)),
                                     history, nullptr, probs);
        w.bottom.push_back(w.job->sampler->DrawFrom(probs));
        w.bottom_probs.insert(w.bottom_probs.end(), probs.begin(), probs.end());
      }
    }
    stats.bottom_seconds += SecondsSince(start);
    return Status::Ok();
  }

  const TriForceConfig& config_;
  NgramDrafter ngram_;
  int64_t vocab_;
  std::unique_ptr<LanePool> lanes_;
  std::vector<float> logits_;
};

// ---- the drafter ----------------------------------------------------------------------------------

int TriForceDrafter::LaneScratchBlocks(const TriForceConfig& config, int block_size) {
  const int lanes = config.bottom == "streaming" ? 2 : 1;
  return lanes * config.max_num_seqs * LanePool::BlocksPerLane(LaneTokens(config), block_size);
}

int TriForceDrafter::CopyRegionBlocks(const TriForceConfig& config, int block_size) {
  if (!config.kv_offload) return 0;
  // The largest selection (the configured budget, or the automatic one's cap), then the blocks that
  // fill before the next stride rebuild (or, with no stride, as many again: a view that outgrows
  // its region is rebuilt early).
  const int64_t budget = RetrievalBudgetTokens(config.retrieval.budget_tokens, int64_t{1} << 40);
  const int64_t budget_blocks = std::max<int64_t>(1, budget / block_size);
  const int64_t growth = config.retrieval.rebuild_stride > 0
                             ? BlocksForTokens(config.retrieval.rebuild_stride, block_size) + 1
                             : budget_blocks;
  return static_cast<int>(budget_blocks + growth);
}

int TriForceDrafter::CopyRegions(const TriForceConfig& config) {
  return config.kv_offload ? std::min(config.max_num_seqs, kMaxCopyRegions) : 0;
}

int TriForceDrafter::TargetScratchBlocks(const TriForceConfig& config, int block_size) {
  return LaneScratchBlocks(config, block_size) + CopyRegions(config) * CopyRegionBlocks(config, block_size);
}

int TriForceDrafter::DraftScratchBlocks(const TriForceConfig& config, int block_size) {
  return config.bottom == "draft_model" ? config.max_num_seqs * LanePool::BlocksPerLane(LaneTokens(config), block_size)
                                        : 0;
}

TriForceDrafter::TriForceDrafter(const TriForceConfig& config, Backend& target, BlockId target_scratch, Backend* draft,
                                 BlockId draft_scratch)
    : config_(config),
      target_(target),
      scorer_(*target.As<KvBlockScoring>()),
      block_size_(target.kv_layout().block_size),
      middle_(target, target_scratch, LanePool::BlocksPerLane(LaneTokens(config), target.kv_layout().block_size),
              config.max_num_seqs) {
  Backend* bottom_backend = nullptr;
  BlockId bottom_scratch = 0;
  if (config.bottom == "streaming") {
    bottom_backend = &target;
    bottom_scratch = target_scratch + LaneScratchBlocks(config, block_size_) / 2;
  } else if (config.bottom == "draft_model") {
    bottom_backend = draft;
    bottom_scratch = draft_scratch;
  }
  bottom_ = std::make_unique<Bottom>(config_, bottom_backend, bottom_scratch, target.model_config().vocab_size);
  copy_regions_ = target_scratch + LaneScratchBlocks(config, block_size_);
  for (int r = CopyRegions(config) - 1; r >= 0; --r) free_regions_.push_back(r);
}

TriForceDrafter::~TriForceDrafter() = default;

void TriForceDrafter::OnVerified(int64_t seq_id, int64_t drafted, int64_t accepted) {
  if (auto it = seqs_.find(seq_id); it != seqs_.end()) it->second.cache.RecordVerification(drafted, accepted);
}

LayerHooks* TriForceDrafter::ForStep(const ForwardBatch& batch, std::span<const int64_t> seq_ids,
                                     std::span<const uint8_t>) {
  scoring_.clear();
  scored_.clear();
  int64_t size = 0;
  for (size_t i = 0; i < seq_ids.size() && i < batch.seqs.size(); ++i) {
    auto it = seqs_.find(seq_ids[i]);
    if (it == seqs_.end() || !it->second.want_scores) continue;
    const SequenceSlice& slice = batch.seqs[i];
    // The slice's first token is the sequence's newest (a decode step's token, then its drafts).
    const int64_t cached = slice.context_len - slice.num_tokens;
    const int64_t full = cached / block_size_;
    if (full == 0 || slice.view.kind != KvView::Kind::kFull) continue;
    KvBlockScoreJob job;
    job.row = slice.token_offset;
    job.blocks.assign(slice.block_table.begin(), slice.block_table.begin() + full);
    job.num_tokens = static_cast<int32_t>(full * block_size_);
    job.score_offset = size;
    scoring_.push_back(std::move(job));
    scored_.push_back({seq_ids[i], size, static_cast<int32_t>(full), cached});
    size += full;
  }
  if (scoring_.empty()) return nullptr;
  if (Status st = scorer_.ResetKvBlockScores(size); !st.ok()) {
    spdlog::error("triforce: cannot score chunks: {}", st.ToString());
    scoring_.clear();
    scored_.clear();
    return nullptr;
  }
  return this;
}

Status TriForceDrafter::BuildScored() {
  const std::vector<Scored> scored = std::move(scored_);
  scored_.clear();
  std::vector<KvBlockSelectJob> selecting;
  std::vector<const Scored*> owners;
  for (const Scored& sc : scored) {
    if (!seqs_.contains(sc.seq_id)) continue;  // gone since
    const int64_t budget_blocks =
        std::max<int64_t>(1, RetrievalBudgetTokens(config_.retrieval.budget_tokens, sc.cached) / block_size_);
    KvBlockSelectJob job;
    job.score_offset = sc.score_offset;
    job.num_blocks = sc.num_blocks;
    job.keep_first = 1;
    job.keep_last = RecentBlocks(budget_blocks);
    job.k = static_cast<int32_t>(budget_blocks);
    selecting.push_back(job);
    owners.push_back(&sc);
  }
  if (selecting.empty()) return Status::Ok();
  std::vector<int32_t> chosen;
  KVFLOW_RETURN_IF_ERROR(scorer_.SelectTopKvBlocks(selecting, chosen));
  size_t at = 0;
  for (size_t i = 0; i < owners.size(); ++i) {
    const size_t n = static_cast<size_t>(std::min(selecting[i].k, selecting[i].num_blocks));
    Tracked& tracked = seqs_.at(owners[i]->seq_id);
    tracked.cache.Build(std::vector<int32_t>(chosen.begin() + at, chosen.begin() + at + n), owners[i]->cached);
    tracked.want_scores = false;
    at += n;
    ++stats_.retrieval_builds;
  }
  return Status::Ok();
}

void TriForceDrafter::Forget(int64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return;
  if (it->second.region >= 0) free_regions_.push_back(it->second.region);
  seqs_.erase(it);
}

void TriForceDrafter::AddStats(SpecDecodeStats& s) const {
  s.Add(stats_);  // the drafter counts only its own levels
  s.retrieval_caches += static_cast<int64_t>(seqs_.size());
}

void TriForceDrafter::Propose(std::span<DraftJob* const> jobs) {
  if (Status st = BuildScored(); !st.ok()) {
    spdlog::error("triforce: chunk selection failed: {} (rebuilt on a later step)", st.ToString());
  }
  ProposeInChunks(jobs, static_cast<size_t>(middle_.num_lanes()), [this](auto chunk) { return ProposeChunk(chunk); },
                  "triforce", failed_batches_);
}

Status TriForceDrafter::ProposeChunk(std::span<DraftJob* const> jobs) {
  std::vector<Work> works;
  for (DraftJob* job : jobs) {
    const SchedSequence& seq = *job->seq;
    Work w;
    w.job = job;
    w.cached = seq.num_tokens() - 1;
    if (w.cached != seq.num_computed || static_cast<int64_t>(job->block_table.size()) * block_size_ < w.cached) {
      return Status::Internal("draft job for a sequence that is not decoding");
    }
    Tracked& tracked = seqs_[seq.id];
    w.cache = &tracked.cache;
    const int64_t budget = RetrievalBudgetTokens(config_.retrieval.budget_tokens, w.cached);
    const RetrievalCache::Action action = tracked.cache.Decide(w.cached, budget, config_.retrieval);
    if (action == RetrievalCache::Action::kPlain) {
      ++stats_.plain_steps;
      continue;
    }
    if (action == RetrievalCache::Action::kBuild) {
      // Scored in this step's pass; until the selection is made the old one (if any) drafts.
      tracked.want_scores = true;
      if (!tracked.cache.built()) continue;
    }
    w.lane = static_cast<int>(works.size());
    works.push_back(std::move(w));
  }
  if (works.empty()) return Status::Ok();

  std::vector<bool> placed;
  KVFLOW_RETURN_IF_ERROR(PlaceMiddleViews(works, placed));
  if (std::find(placed.begin(), placed.end(), false) != placed.end()) {
    std::vector<Work> kept;
    for (size_t i = 0; i < works.size(); ++i) {
      if (!placed[i]) continue;
      kept.push_back(std::move(works[i]));
      kept.back().lane = static_cast<int>(kept.size()) - 1;
    }
    works = std::move(kept);
    if (works.empty()) return Status::Ok();
  }

  std::vector<LanePool::PartialBlock> parts;
  for (const Work& w : works) parts.push_back({w.lane, w.job->block_table, w.cached});
  KVFLOW_RETURN_IF_ERROR(middle_.CopyPartialBlocks(parts));
  KVFLOW_RETURN_IF_ERROR(bottom_->Start(works));

  while (true) {
    std::vector<Work*> active;
    std::vector<int> want;
    for (Work& w : works) {
      if (w.done) continue;
      active.push_back(&w);
      // Room for the bottom's drafts and the middle's own token after them.
      want.push_back(static_cast<int>(std::min<int64_t>(config_.gamma1, w.cap(config_.gamma2) - w.drafted() - 1)));
    }
    if (active.empty()) break;
    KVFLOW_RETURN_IF_ERROR(bottom_->Draft(active, want, stats_));
    KVFLOW_RETURN_IF_ERROR(MiddlePass(works));
  }
  return Status::Ok();
}

Status TriForceDrafter::PlaceMiddleViews(std::vector<Work>& works, std::vector<bool>& placed) {
  placed.assign(works.size(), true);
  std::vector<int32_t> logical;
  std::vector<KvTransfer> copies;
  const int region_blocks = CopyRegionBlocks(config_, block_size_);
  const int layers = target_.model_config().num_layers;
  for (size_t i = 0; i < works.size(); ++i) {
    Work& w = works[i];
    w.middle_blocks.clear();
    w.cache->ViewBlocks(w.cached, block_size_, logical);
    if (!config_.kv_offload) {
      for (int32_t b : logical) w.middle_blocks.push_back(w.job->block_table[static_cast<size_t>(b)]);
      continue;
    }
    Tracked& tracked = seqs_.at(w.job->seq->id);
    if (tracked.region < 0 && !free_regions_.empty()) {
      tracked.region = free_regions_.back();
      free_regions_.pop_back();
    }
    if (tracked.region < 0) {
      // Every copy region is taken (kMaxCopyRegions drafting sequences): decode plainly.
      placed[i] = false;
      ++stats_.plain_steps;
      continue;
    }
    if (static_cast<int>(logical.size()) > region_blocks) {
      // Outgrew its region since the build: decode plainly until a new selection is made.
      tracked.want_scores = true;
      placed[i] = false;
      ++stats_.plain_steps;
      continue;
    }
    if (tracked.copied_build != w.cache->builds()) {
      tracked.copied = 0;
      tracked.copied_build = w.cache->builds();
    }
    // The view is the copied prefix and the blocks that filled since: copy those (every layer).
    const BlockId region = copy_regions_ + static_cast<BlockId>(tracked.region) * region_blocks;
    for (size_t b = tracked.copied; b < logical.size(); ++b) {
      KvTransfer t;
      t.src_block = w.job->block_table[static_cast<size_t>(logical[b])];
      t.dst_block = region + static_cast<BlockId>(b);
      t.num_tokens = block_size_;
      t.layer_end = layers;
      copies.push_back(t);
    }
    tracked.copied = logical.size();
    for (size_t b = 0; b < logical.size(); ++b) w.middle_blocks.push_back(region + static_cast<BlockId>(b));
  }
  if (!copies.empty()) {
    stats_.retrieval_copied_blocks += static_cast<int64_t>(copies.size());
    KVFLOW_RETURN_IF_ERROR(target_.TransferKv(copies));
  }
  return Status::Ok();
}

Status TriForceDrafter::MiddlePass(std::vector<Work>& works) {
  const auto start = Clock::now();
  std::vector<LaneSlice> slices;
  std::vector<Work*> rows;
  for (Work& w : works) {
    if (w.done) continue;
    LaneSlice s;
    s.lane = w.lane;
    s.lane_origin = w.cached / block_size_ * block_size_;
    s.first_position = w.pending_position();
    s.tokens.push_back(w.pending());
    s.tokens.insert(s.tokens.end(), w.bottom.begin(), w.bottom.end());
    s.blocks = w.middle_blocks;
    slices.push_back(std::move(s));
    rows.push_back(&w);
  }
  KVFLOW_RETURN_IF_ERROR(middle_.Forward(slices, nullptr, logits_));
  stats_.middle_passes += static_cast<int64_t>(slices.size());
  const int64_t V = target_.model_config().vocab_size;
  int64_t row = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    const int64_t n = static_cast<int64_t>(slices[r].tokens.size());
    VerifyAtMiddle(*rows[r], std::span<float>(logits_.data() + row * V, static_cast<size_t>(n * V)));
    row += n;
  }
  stats_.middle_seconds += SecondsSince(start);
  return Status::Ok();
}

// Turns a middle pass's rows into drafts: the bottom's drafts kept or replaced by exact rejection
// sampling against the middle's distribution, and one more token from it when all were kept.
void TriForceDrafter::VerifyAtMiddle(Work& w, std::span<float> rows) {
  const size_t V = static_cast<size_t>(target_.model_config().vocab_size);
  const SchedSequence& seq = *w.job->seq;
  const std::span<const int32_t> prompt(seq.tokens.data(), static_cast<size_t>(seq.prompt_len));
  const int64_t pending_position = w.pending_position();
  const int fed = static_cast<int>(w.bottom.size()) - 1;  // bottom drafts whose K/V its lane computed
  Sampler& sampler = *w.job->sampler;
  std::vector<float> q;
  std::vector<int32_t> history;
  int64_t kept = 0;
  stats_.middle_draft_tokens += static_cast<int64_t>(w.bottom.size());
  for (size_t i = 0; i <= w.bottom.size(); ++i) {
    w.History(history);
    sampler.Distribution(rows.subspan(i * V, V), prompt, history, nullptr, q);
    int32_t token;
    bool accepted = false;
    if (i == w.bottom.size()) {
      token = sampler.DrawFrom(q);
    } else if (w.bottom_probs.empty() && ActiveRejectionRule(VerifySite::kMiddle) == RejectionRule::kResidual) {
      token = sampler.DrawFrom(q);  // one-hot (n-gram) drafts: keep d iff x ~ q is d
      accepted = token == w.bottom[i];
    } else {
      const std::span<const float> q_bottom = w.bottom_probs.empty()
                                                  ? std::span<const float>()
                                                  : std::span<const float>(w.bottom_probs.data() + i * V, V);
      const double u_accept = sampler.NextUniform();
      const double u_resample = sampler.NextUniform();
      const DraftVerdict verdict = VerifyDraft(q, q_bottom, w.bottom[i], u_accept, u_resample, VerifySite::kMiddle);
      token = verdict.token;
      accepted = verdict.accepted;
    }
    w.job->drafts.push_back(token);
    w.job->probs.insert(w.job->probs.end(), q.begin(), q.end());
    if (accepted) ++kept;
    if (w.drafted() >= w.cap(config_.gamma2) || !accepted) break;
  }
  stats_.middle_accepted_tokens += kept;
  bottom_->Advance(w, pending_position, kept, fed);
  if (w.drafted() >= w.cap(config_.gamma2)) w.done = true;
}

}  // namespace kvflow
