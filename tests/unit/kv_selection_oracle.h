// The engine-level oracle for InfiniGen's KV selection, shared by the CPU engine test
// (tests/unit/test_kv_selection.cc) and the CUDA engine test (tests/cuda/test_cuda_backend.cc): the
// engine's reads, recorded through EvaluationOptions::kv_read_observer, are checked against an
// independent recomputation of the selection rule on a fresh CPU (fp32) backend that replays the
// engine's tokens, and attention over exactly those reads must reproduce the engine's logprobs.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <map>
#include <numeric>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "engine/evaluation.h"
#include "systems/builtin_systems.h"
#include "infinigen/infinigen_selector.h"
#include "infinigen/partial_keys.h"
#include "infinigen/skew_file.h"
#include "infinigen/speculation.h"
#include "kv_selection_test_util.h"
#include "forward/llama_model.h"
#include "model/rope.h"

namespace kvflow::test {

// What one layer's attention read at one decode step of one sequence: per KV head, the positions in
// the order attention read them (the step's own last), or nothing: the whole view.
using HeadPositions = std::vector<std::vector<int32_t>>;
using ReadKey = std::tuple<int64_t, int32_t, int>;  // sequence id, decode position, layer

// Replays one sequence on a fresh CPU backend (contiguous blocks, so slot = position): its attention
// at each decode step and layer reads exactly what the engine recorded, and at every layer L-1 it
// recomputes independently what InfiniGen should select for layer L (the test's own wiring of
// layer L's norm, projection, rotation, skew and cached keys, with the rule of speculation.h), as
// the selector does at SpeculationPoint::kAfterAttention.
// The rule's choice per (decode position, layer), and the scores it chose by ([kv head][token]).
struct RuleChoices {
  std::map<std::pair<int32_t, int>, HeadPositions> expected;
  std::map<std::pair<int32_t, int>, std::vector<std::vector<float>>> scores_of;
};

class SelectionReplay final : public LayerHooks {
 public:
  // skew null: only replays the reads (no rule to recompute).
  SelectionReplay(Backend& backend, const SkewTable* skew, const InfiniGenConfig& config,
                  const std::map<ReadKey, HeadPositions>& recorded, int64_t seq, bool full_attention)
      : backend_(backend), skew_(skew), config_(config), recorded_(recorded), seq_(seq), full_(full_attention),
        rope_(ComputeRopeFrequencies(backend.model_config())) {}

  int32_t position = -1;  // the decode step's position; -1: prefill
  RuleChoices choices;     // what the rule picks at each (position, layer >= 1)

  std::span<const KvHeadSelection> AttentionSelection(const LayerContext& ctx) override {
    if (full_ || position < 0) return {};
    const auto it = recorded_.find({seq_, position, ctx.layer});
    if (it == recorded_.end() || it->second.empty()) return {};
    selection_.assign(1, KvHeadSelection{});
    selection_[0].per_head = static_cast<int32_t>(it->second[0].size());
    for (const auto& head : it->second)
      for (int32_t pos : head) selection_[0].slots.push_back(pos);  // slot = position
    return selection_;
  }

  // The oracle (SpeculationPoint::kOracle): layer L picks with its own rotated queries (kQkv) against
  // its whole keys, here with the test's own dot products.
  Status BeforeAttention(const LayerContext& ctx) override {
    const int L = ctx.layer;
    if (config_.point != SpeculationPoint::kOracle || skew_ == nullptr || full_ || position < 0 ||
        L < config_.dense_layers) {
      return Status::Ok();
    }
    const ModelConfig& mc = backend_.model_config();
    const int NH = mc.num_heads, KV = mc.num_kv_heads, D = mc.head_dim;
    std::vector<float> qkv(static_cast<size_t>(ActivationWidth(mc, Activation::kQkv)));
    KVFLOW_RETURN_IF_ERROR(backend_.ReadActivationRows(Activation::kQkv, 0, 1, qkv));
    const int32_t cached = position;
    std::vector<int64_t> slots(static_cast<size_t>(cached));
    std::iota(slots.begin(), slots.end(), 0);
    std::vector<float> keys(static_cast<size_t>(cached) * KV * D), scores(static_cast<size_t>(NH) * cached);
    KVFLOW_RETURN_IF_ERROR(backend_.ReadKv(L, 0, slots, keys));
    for (int h = 0; h < NH; ++h) {
      for (int32_t t = 0; t < cached; ++t) {
        double dot = 0.0;
        for (int d = 0; d < D; ++d) {
          dot += double(qkv[size_t(h) * D + d]) * keys[(size_t(t) * KV + size_t(h / (NH / KV))) * D + d];
        }
        scores[size_t(h) * cached + t] = float(dot / std::sqrt(double(D)));
      }
    }
    Choose(L, scores, NH / KV);
    return Status::Ok();
  }

  Status AfterMlpInput(const LayerContext& ctx) override {
    const int L = ctx.layer + 1;
    if (skew_ == nullptr || full_ || position < 0 || L >= backend_.model_config().num_layers ||
        L < config_.dense_layers || config_.point == SpeculationPoint::kOracle) {
      return Status::Ok();
    }
    const ModelConfig& mc = backend_.model_config();
    const int NH = mc.num_heads, KV = mc.num_kv_heads, D = mc.head_dim, P = skew_->num_partial_columns;
    const int group = NH / KV;
    KVFLOW_RETURN_IF_ERROR(backend_.RmsNorm(L, LayerWeight::kAttnNorm, false));
    KVFLOW_RETURN_IF_ERROR(backend_.Linear(L, LayerWeight::kQkv, Activation::kHidden, Activation::kSpeculativeQkv));
    std::vector<float> qkv(static_cast<size_t>(ActivationWidth(mc, Activation::kQkv)));
    KVFLOW_RETURN_IF_ERROR(backend_.ReadActivationRows(Activation::kSpeculativeQkv, 0, 1, qkv));
    std::vector<float> queries(static_cast<size_t>(NH) * P);
    for (int h = 0; h < NH; ++h) {
      float* q = qkv.data() + static_cast<size_t>(h) * D;
      ApplyRope(q, D, position, rope_);
      for (int d = 0; d < D; ++d) q[d] /= std::sqrt(static_cast<float>(D));
      SkewPartialColumns(q, 1, D, skew_->at(L, h / group), D, queries.data() + static_cast<size_t>(h) * P);
    }
    const int32_t cached = position;  // the tokens before the step's own
    std::vector<int64_t> slots(static_cast<size_t>(cached));
    std::iota(slots.begin(), slots.end(), 0);
    // Every query head's scores: a KV head's rows are its group's query heads.
    std::vector<float> keys(static_cast<size_t>(cached) * KV * D), head_keys(static_cast<size_t>(cached) * D),
        partial(static_cast<size_t>(cached) * P), scores(static_cast<size_t>(NH) * cached);
    KVFLOW_RETURN_IF_ERROR(backend_.ReadKv(L, 0, slots, keys));
    for (int g = 0; g < KV; ++g) {
      for (int32_t t = 0; t < cached; ++t)
        std::copy_n(keys.data() + (static_cast<size_t>(t) * KV + g) * D, D, head_keys.data() + static_cast<size_t>(t) * D);
      SkewPartialColumns(head_keys.data(), cached, D, skew_->at(L, g), D, partial.data());
      for (int j = 0; j < group; ++j) {
        ScorePartialKeys(queries.data() + static_cast<size_t>(g * group + j) * P, 1, partial.data(), cached, P,
                         scores.data() + static_cast<size_t>(g * group + j) * cached);
      }
    }
    Choose(L, scores, group);
    return Status::Ok();
  }

 private:
  // The rule's choice for layer L from every query head's scores ([NH][position]): under
  // kv-head-max a KV head's score is its group's max.
  void Choose(int L, const std::vector<float>& head_scores, int group) {
    const int32_t cached = position;
    const int NH = static_cast<int>(head_scores.size() / std::max<int32_t>(1, cached)), KV = NH / group;
    std::vector<float> scores = head_scores;
    int rows = NH, rule_group = group;
    if (config_.count_rule == CountRule::kKvHeadMax) {
      scores.assign(static_cast<size_t>(KV) * cached, -INFINITY);
      for (int h = 0; h < NH; ++h)
        for (int32_t t = 0; t < cached; ++t)
          scores[size_t(h / group) * cached + t] = std::max(scores[size_t(h / group) * cached + t], head_scores[size_t(h) * cached + t]);
      rows = KV;
      rule_group = 1;
    }
    TokenSelectionRule rule;
    rule.group = rule_group;
    rule.alpha = static_cast<float>(config_.alpha);
    rule.max_fraction = config_.max_fraction;
    rule.max_tokens = config_.max_tokens;
    rule.sink_tokens = config_.sink_tokens;
    rule.recent_tokens = config_.recent_tokens;
    const SpeculatedTokens picked = SelectTokensByRows(scores, rows, cached, rule);
    HeadPositions want(static_cast<size_t>(KV));
    for (int g = 0; g < KV; ++g) {
      want[g].assign(picked.per_head[static_cast<size_t>(g)].begin(), picked.per_head[static_cast<size_t>(g)].end());
      want[g].push_back(cached);
    }
    choices.expected[{position, L}] = std::move(want);
    auto& kept = choices.scores_of[{position, L}];
    kept.resize(static_cast<size_t>(rows));
    for (int r = 0; r < rows; ++r)
      kept[size_t(r)].assign(scores.begin() + static_cast<long>(r) * cached, scores.begin() + static_cast<long>(r + 1) * cached);
  }

  Backend& backend_;
  const SkewTable* skew_;
  InfiniGenConfig config_;
  const std::map<ReadKey, HeadPositions>& recorded_;
  int64_t seq_;
  bool full_;
  RopeFrequencies rope_;
  std::vector<KvHeadSelection> selection_;
};

// Whether the engine's read `got` differs from the rule's choice over `scores` ([kv head][token],
// the CPU recomputation) only by moving scores at most `margin` (see the oracle below).
struct NearTieVerdict {
  bool near_tie = true;
  std::string why;
};
inline NearTieVerdict IsNearTie(const HeadPositions& got, const std::vector<std::vector<float>>& scores,
                                const InfiniGenConfig& config, double margin) {
  NearTieVerdict v;
  if (got.size() != scores.size() || got.empty()) return {false, "another number of KV heads"};
  const size_t tokens = scores[0].size();
  const size_t count = got[0].size() - 1;  // the step's own token aside
  // The count: the heads' counts above (max - alpha), averaged and rounded, capped; with every score
  // free to move by `margin`, each head's count lies between these two.
  double low = 0.0, high = 0.0;
  for (const auto& head : scores) {
    const float top = *std::max_element(head.begin(), head.end());
    for (float x : head) {
      low += x > top - config.alpha + 2 * margin;
      high += x > top - config.alpha - 2 * margin;
    }
  }
  const double cap = std::max(1.0, std::floor(config.max_fraction * double(tokens)));
  const double fewest = std::min(cap, std::floor(low / double(scores.size()))),
               most = std::min(cap, std::ceil(high / double(scores.size())));
  if (double(count) < fewest || double(count) > most) {
    return {false, "read " + std::to_string(count) + " tokens per head, the rule " + std::to_string(size_t(fewest)) +
                       ".." + std::to_string(size_t(most))};
  }
  double worst = 0.0;
  for (size_t g = 0; g < scores.size(); ++g) {
    if (got[g].size() != count + 1) return {false, "heads read different counts"};
    std::vector<int32_t> order(tokens);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return scores[g][size_t(x)] > scores[g][size_t(y)]; });
    std::vector<int32_t> want(order.begin(), order.begin() + static_cast<long>(count));
    std::vector<int32_t> have(got[g].begin(), got[g].end() - 1);
    std::sort(want.begin(), want.end());
    std::sort(have.begin(), have.end());
    const float cutoff = count > 0 ? scores[g][size_t(order[count - 1])] : scores[g][size_t(order[0])];
    std::vector<int32_t> only;
    std::set_symmetric_difference(have.begin(), have.end(), want.begin(), want.end(), std::back_inserter(only));
    for (int32_t t : only) worst = std::max(worst, double(std::fabs(scores[g][size_t(t)] - cutoff)));
  }
  if (worst > margin) return {false, "a token " + std::to_string(worst) + " from the cutoff"};
  return v;
}

struct InfiniGenOracleOptions {
  double score_margin = 0.0;         // 0: reads must equal the CPU rule's exactly
  double max_near_tie_share = 0.0;   // of the reads checked
  double logprob_tolerance = 1e-4;   // replayed (CPU fp32) against the engine's
  int64_t max_argmax_differences = 0;
};

// One engine run with every decode read recorded: three prompts decoded together, 24 greedy tokens
// each with their logprobs.
struct RecordedRun {
  std::map<ReadKey, HeadPositions> reads;
  std::map<int64_t, int32_t> first_decode;  // sequence id -> its first decode position (its prompt length)
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::vector<SampledToken>> outputs;  // by prompt
  KvSelectionStats stats;
  ModelConfig model;
  // The prompt of sequence `seq`.
  size_t PromptOf(int64_t seq) const {
    const int32_t len = first_decode.at(seq);
    for (size_t i = 0; i < prompts.size(); ++i)
      if (static_cast<int32_t>(prompts[i].size()) == len) return i;
    return prompts.size();
  }
};

inline void RecordRun(const EngineConfig& c, RecordedRun& run) {
  const int block_size = c.block_size;
  EvaluationOptions evaluation;
  evaluation.kv_read_observer = [&run, block_size](int layer, const ForwardBatch& batch, std::span<const int64_t> seq_ids,
                                                   std::span<const KvHeadSelection> selection) {
    for (size_t i = 0; i < batch.seqs.size(); ++i) {
      const SequenceSlice& slice = batch.seqs[i];
      if (slice.num_tokens != 1) continue;  // prefill chunks read their whole view
      const int32_t position = batch.positions[static_cast<size_t>(slice.token_offset)];
      auto [it, fresh] = run.first_decode.emplace(seq_ids[i], position);
      if (!fresh) it->second = std::min(it->second, position);
      HeadPositions heads;
      if (!selection.empty() && selection[i].per_head > 0) {
        std::map<int64_t, int32_t> position_of_block;
        for (size_t b = 0; b < slice.block_table.size(); ++b) position_of_block[slice.block_table[b]] = int32_t(b) * block_size;
        const size_t per_head = static_cast<size_t>(selection[i].per_head);
        for (size_t h = 0; h * per_head < selection[i].slots.size(); ++h) {
          heads.emplace_back();
          for (size_t k = 0; k < per_head; ++k) {
            const int64_t slot = selection[i].slots[h * per_head + k];
            heads.back().push_back(position_of_block.at(slot / block_size) + int32_t(slot % block_size));
          }
        }
      }
      run.reads[{seq_ids[i], position, layer}] = std::move(heads);
    }
  };
  auto engine = CreateEvaluationEngine(c, evaluation);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  SamplingParams p = test::Greedy(24);
  p.logprobs = 5;
  run.prompts = test::ThreePrompts();
  run.outputs.assign(run.prompts.size(), {});
  for (size_t i = 0; i < run.prompts.size(); ++i) {
    ASSERT_TRUE((*engine)->AddRequest(run.prompts[i], p, [&run, i](const StreamEvent& e) {
                          for (const auto& t : e.tokens) run.outputs[i].push_back(t);
                        }).ok());
  }
  while ((*engine)->HasUnfinishedRequests()) ASSERT_TRUE((*engine)->Step().ok());
  run.stats = (*engine)->stats().kv_selection;
  run.model = (*engine)->model_config();
  ASSERT_LT(run.stats.tokens_selected, run.stats.tokens_available) << "a partial selection, or the oracle shows nothing";
  ASSERT_EQ(run.first_decode.size(), run.prompts.size());
  for (const auto& o : run.outputs) ASSERT_EQ(o.size(), 24u);
}

// How a replay of one sequence compares with the engine: its logprob of each token the engine chose
// against the engine's, and its argmax against the engine's token.
struct ReplayFit {
  double max_logprob_error = 0.0;
  int64_t argmax_differs = 0;
};

// Replays sequence `seq` of `run` through `replay`'s hooks on `backend` (prefill, then one decode
// step per token, contiguous blocks from 0).
inline void Replay(const RecordedRun& run, int64_t seq, Backend& backend, SelectionReplay& replay, ReplayFit& fit,
                   int block_size) {
  const size_t i = run.PromptOf(seq);
  ASSERT_LT(i, run.prompts.size()) << "sequence " << seq << " matches no prompt";
  const auto& prompt = run.prompts[i];
  const auto& out = run.outputs[i];
  const int32_t prompt_len = static_cast<int32_t>(prompt.size());
  const int total = prompt_len + static_cast<int>(out.size());
  LlamaModel model(backend, &replay);
  std::vector<BlockId> table;
  for (int b = 0; b * block_size < total; ++b) table.push_back(b);
  std::vector<float> logits;
  for (int step = 0; step < static_cast<int>(out.size()); ++step) {
    ForwardBatch batch;
    SequenceSlice slice;
    slice.block_table = table;
    slice.logits = LogitsMode::kLast;
    if (step == 0) {
      batch.tokens = prompt;
      for (int32_t k = 0; k < prompt_len; ++k) batch.positions.push_back(k);
      slice.num_tokens = prompt_len;
      slice.context_len = prompt_len;
      replay.position = -1;
    } else {
      batch.tokens = {out[size_t(step - 1)].token};
      batch.positions = {prompt_len + step - 1};
      slice.num_tokens = 1;
      slice.context_len = prompt_len + step;
      replay.position = prompt_len + step - 1;
    }
    batch.seqs.push_back(slice);
    ASSERT_TRUE(model.Forward(batch, logits).ok());
    double mx = -INFINITY, z = 0.0;
    for (float l : logits) mx = std::max(mx, double(l));
    for (float l : logits) z += std::exp(double(l) - mx);
    const double lp = double(logits[size_t(out[size_t(step)].token)]) - mx - std::log(z);
    fit.max_logprob_error = std::max(fit.max_logprob_error, std::fabs(lp - out[size_t(step)].logprob));
    const auto best = std::max_element(logits.begin(), logits.end()) - logits.begin();
    fit.argmax_differs += best != out[size_t(step)].token;
  }
}

// Replays every sequence of `run` twice on fresh CPU (fp32) backends: over exactly the recorded
// reads (`fit`) and with full attention (`full`: how far the selection moved the logprobs).
inline void ReplayAll(const EngineConfig& c, const RecordedRun& run, const SkewTable* skew, ReplayFit& fit,
                      ReplayFit& full, std::map<int64_t, RuleChoices>* choices = nullptr) {
  const InfiniGenConfig config = InfiniGenConfig::FromOptions(c.kv_selection);
  for (const auto& [seq, prompt_len] : run.first_decode) {
    const int total = prompt_len + 24;
    for (const bool full_attention : {false, true}) {
      auto backend = test::TinyCpuBackend(total + c.block_size);
      SelectionReplay replay(*backend, full_attention ? nullptr : skew, config, run.reads, seq, full_attention);
      Replay(run, seq, *backend, replay, full_attention ? full : fit, c.block_size);
      if (choices && !full_attention) (*choices)[seq] = std::move(replay.choices);
    }
  }
}

// Another sequence's reads at the same layer and decode index differ (a selector mixing up the
// batch's sequences would be seen): returns {differing, compared}.
inline std::pair<int64_t, int64_t> ReadsOfOtherSequencesDiffer(const RecordedRun& run) {
  int64_t compared = 0, differing = 0;
  for (const auto& [key, heads] : run.reads) {
    const auto& [seq, position, layer] = key;
    if (heads.empty()) continue;
    for (const auto& [other, other_first] : run.first_decode) {
      if (other == seq) continue;
      const auto o = run.reads.find({other, other_first + (position - run.first_decode.at(seq)), layer});
      if (o == run.reads.end() || o->second.empty()) continue;
      ++compared;
      differing += o->second != heads;
    }
  }
  return {differing, compared};
}

// Runs `c` (InfiniGen with a partial selection; c.kv_selection.infinigen.skew_file set) and checks every decode
// read at layers >= 1 against the rule's recomputation (see the top of this file). The
// recomputation tells layers and sequences apart: compared with the next layer's or another
// sequence's reads it disagrees.
inline void ExpectInfiniGenReadsFollowTheRule(const EngineConfig& c, const InfiniGenOracleOptions& options) {
  RecordedRun run;
  RecordRun(c, run);
  if (::testing::Test::HasFatalFailure()) return;
  auto skew = ReadSkewTable(c.kv_selection.infinigen.skew_file, run.model);
  ASSERT_TRUE(skew.ok()) << skew.status().ToString();
  const InfiniGenConfig config = InfiniGenConfig::FromOptions(c.kv_selection);
  const int layers = run.model.num_layers;
  ReplayFit fit, full;
  std::map<int64_t, RuleChoices> choices;
  ReplayAll(c, run, &skew.value(), fit, full, &choices);
  if (::testing::Test::HasFatalFailure()) return;
  int64_t reads_checked = 0, reads_differing = 0, near_ties = 0, wrong_layer_differs = 0, wrong_layer_compared = 0;
  for (const auto& [seq, rule] : choices) {
    for (const auto& [key, want] : rule.expected) {
      const auto& [position, layer] = key;
      const auto got = run.reads.find({seq, position, layer});
      ASSERT_NE(got, run.reads.end()) << "no read recorded for sequence " << seq << " position " << position;
      ++reads_checked;
      if (got->second != want) {
        // Allowed only where the engine's arithmetic (fp16 on a device) moved a score across a
        // boundary of the rule (IsNearTie).
        const NearTieVerdict v = IsNearTie(got->second, rule.scores_of.at(key), config, options.score_margin);
        if (options.score_margin > 0 && v.near_tie) {
          ++near_ties;
        } else {
          ++reads_differing;
          ADD_FAILURE() << "sequence " << seq << ", position " << position << ", layer " << layer
                        << ": the engine read other tokens than the rule picks (" << v.why << ")";
        }
      }
      // The same recomputation against the next layer's reads.
      const auto next = run.reads.find({seq, position, layer + 1});
      if (layer + 1 < layers && next != run.reads.end()) {
        ++wrong_layer_compared;
        wrong_layer_differs += next->second != want;
      }
    }
  }
  const auto [wrong_seq_differs, wrong_seq_compared] = ReadsOfOtherSequencesDiffer(run);
  std::printf("  %lld decode reads at layers %d..%d checked against the rule's recomputation on the CPU: %lld differ, "
              "%lld by near-ties (within %.2g of the cutoff); replayed logprobs within %.2g of the engine's, %lld "
              "argmax differ (full attention moves them by up to %.2g); against the next layer's reads %lld of %lld "
              "differ, against another sequence's %lld of %lld\n",
              (long long)reads_checked, config.dense_layers, layers - 1, (long long)reads_differing, (long long)near_ties, options.score_margin,
              fit.max_logprob_error, (long long)fit.argmax_differs, full.max_logprob_error,
              (long long)wrong_layer_differs, (long long)wrong_layer_compared, (long long)wrong_seq_differs,
              (long long)wrong_seq_compared);
  EXPECT_EQ(reads_checked, int64_t(run.prompts.size()) * 23 * (layers - config.dense_layers))
      << "every decode step, every selected layer";
  EXPECT_EQ(reads_differing, 0);
  EXPECT_LE(near_ties, reads_checked * options.max_near_tie_share);
  EXPECT_LT(fit.max_logprob_error, options.logprob_tolerance);
  EXPECT_LE(fit.argmax_differs, options.max_argmax_differences);
  EXPECT_GT(full.max_logprob_error, 1e-3) << "the selection changes the logits, so the replay tells it apart";
  EXPECT_GT(wrong_layer_differs, wrong_layer_compared * 9 / 10);
  EXPECT_GT(wrong_seq_differs, wrong_seq_compared * 9 / 10);
}

}  // namespace kvflow::test
