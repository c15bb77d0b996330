// The scheduler with fake sequences and a fake executor (no model): budgets, FCFS order,
// chunked prefill, preemption by recompute and by swap, swapped groups first, policies, draft
// tokens (speculative decoding), and a random-workload property test that checks invariants after
// every step and that every request completes with the right length. The fake executor keeps a
// simulated KV memory, so every computed token must read back through its block table.
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>

#include "sched/scheduler.h"

namespace kvflow {
namespace {

struct FakeRun {
  FakeRun(int device_blocks, int host_blocks, SchedulerConfig sc, std::string policy = "paged",
          bool prefix = false, int block_size = 4)
      : blocks([&] {
          BlockManagerConfig c;
          c.block_size = block_size;
          c.num_device_blocks = device_blocks;
          c.num_host_blocks = host_blocks;
          c.enable_prefix_caching = prefix;
          c.watermark = 0.0;
          return c;
        }()),
        scheduler(sc, blocks, MakeSchedulingPolicy(policy).value()),
        policy_name(policy),
        block_size(block_size),
        device_mem(static_cast<size_t>(device_blocks), std::vector<int32_t>(static_cast<size_t>(block_size), -1)),
        host_mem(static_cast<size_t>(host_blocks), std::vector<int32_t>(static_cast<size_t>(block_size), -1)) {}

  // A request with `n` sequences forked after the prompt's first token (like parallel sampling).
  // `predicted`: the length predictor's output (S3); `max_output`: the request's max_tokens, by
  // default the true output length.
  RequestId Add(int prompt_len, int output_len, double arrival, int n = 1, int first_token = 1000,
                std::optional<int64_t> predicted = std::nullopt, int max_output = -1) {
    auto g = std::make_unique<SequenceGroup>();
    g->request_id = next_request++;
    g->arrival_time = arrival;
    g->max_output_tokens = max_output > 0 ? max_output : output_len;
    g->true_output_len = output_len;
    g->predicted_output_len = predicted;
    g->num_candidates = n;
    auto s = std::make_unique<SchedSequence>();
    s->id = scheduler.NewSeqId();
    s->tokens.resize(static_cast<size_t>(prompt_len));
    std::iota(s->tokens.begin(), s->tokens.end(), first_token);
    s->prompt_len = prompt_len;
    g->seqs.push_back(std::move(s));
    targets[g->request_id] = {output_len, n};
    const RequestId id = g->request_id;
    scheduler.AddGroup(std::move(g));
    return id;
  }

  // One engine step without a model: sample a token for every sequence whose last token ran.
  // With max_drafts > 0 the verifier accepts a random leading run of the drafts that ran (none,
  // all, or between) through AcceptDrafts, and a drafter proposes up to max_drafts new ones.
  // With scheduler.config().batches_in_flight > 1 it is the engine's pipelined step: it completes
  // the oldest step when that many are in flight, then schedules and starts a step; when nothing
  // could be scheduled, it completes the oldest. Returns the step it scheduled (empty when none).
  SchedulerOutput Step() {
    const size_t depth = static_cast<size_t>(std::max(1, scheduler.config().batches_in_flight));
    auto complete_oldest = [this] {
      InFlight oldest = std::move(in_flight.front());
      in_flight.pop_front();
      Complete(oldest);
    };
    bool completed = false;
    if (in_flight.size() >= depth) {
      complete_oldest();
      completed = true;
    }
    InFlight step = Submit();
    SchedulerOutput submitted = step.out;
    if (!step.out.empty()) {
      in_flight.push_back(std::move(step));
      if (depth == 1) complete_oldest();  // one step at a time: it ends in the call that started it
      return submitted;
    }
    if (!completed && !in_flight.empty()) complete_oldest();
    return submitted;
  }

  // A scheduled step not yet completed: what ran, and the tables its sequences wrote through.
  struct InFlight {
    SchedulerOutput out;
    std::vector<std::vector<int32_t>> ran;  // each sequence's drafts that ran
    std::map<SeqId, std::vector<BlockId>> tables;
  };

  InFlight Submit() {
    std::set<SeqId> had_drafts;
    for (RequestId id = 1; id < next_request; ++id) {
      if (const SequenceGroup* g = scheduler.Find(id)) {
        for (const auto& s : g->seqs) {
          if (!s->draft_tokens.empty()) had_drafts.insert(s->id);
        }
      }
    }
    InFlight step;
    step.out = scheduler.Schedule();
    const SchedulerOutput& out = step.out;
    for (auto& [id, why] : out.rejected) rejected.insert(id);
    CheckDrafts(out, had_drafts);
    CheckInFlight(out);
    // Every rank makes the step's block moves in order, after the steps before; the KV writes of a
    // step in flight land later (here: when it completes), so a move that touched a block of a
    // step in flight would show in CheckMemory.
    RunMoves(out);
    // CompleteStep clears the drafts; the verifier compares against the ones that ran.
    step.ran.resize(out.scheduled.size());
    for (size_t i = 0; i < out.scheduled.size(); ++i) {
      const ScheduledSeq& s = out.scheduled[i];
      step.ran[i].assign(s.seq->draft_tokens.begin(), s.seq->draft_tokens.begin() + s.num_draft_tokens);
      step.tables[s.seq->id] = blocks.BlockTable(s.seq->id);
    }
    batch_ids.clear();
    for (const ScheduledSeq& s : out.scheduled) batch_ids.push_back(s.group->request_id);
    if (!out.empty() && !in_flight.empty()) ++overlapped_steps;
    return step;
  }

  // A new step never takes a group of a step in flight, and those keep their blocks and status.
  void CheckInFlight(const SchedulerOutput& out) {
    std::set<const SequenceGroup*> flying;
    for (const InFlight& f : in_flight) {
      for (const ScheduledSeq& s : f.out.scheduled) {
        flying.insert(s.group);
        EXPECT_TRUE(s.group->in_flight);
        EXPECT_EQ(s.seq->status, SeqStatus::kRunning) << "a sequence in flight was preempted";
        EXPECT_EQ(blocks.BlockTable(s.seq->id), f.tables.at(s.seq->id)) << "a table in flight changed";
      }
    }
    for (const ScheduledSeq& s : out.scheduled) {
      EXPECT_FALSE(flying.contains(s.group)) << "request " << s.group->request_id << " scheduled twice in flight";
    }
  }

  void Complete(InFlight& step) {
    const SchedulerOutput& out = step.out;
    WriteTokens(out);
    scheduler.CompleteStep(out);
    std::set<RequestId> touched;
    std::vector<size_t> sampled;
    for (size_t i = 0; i < out.scheduled.size(); ++i) {
      if (out.scheduled[i].needs_logits) sampled.push_back(i);
    }
    for (size_t k : sampled) {
      const ScheduledSeq& step_seq = out.scheduled[k];
      SequenceGroup* g = step_seq.group;
      SchedSequence* seq = step_seq.seq;
      auto& [output_len, n] = targets[g->request_id];
      if (g->seqs.size() == 1 && n > 1 && seq->output_len() == 0) {
        for (int i = 1; i < n; ++i) {
          SchedSequence* child = scheduler.Fork(*g, *seq);
          child->tokens.push_back(static_cast<int32_t>(i));
          if (child->output_len() >= output_len) scheduler.FinishSequence(*child);
        }
      }
      if (max_drafts == 0) {
        seq->tokens.push_back(7);
      } else {
        Verify(step_seq, step.ran[k], output_len);
      }
      if (seq->output_len() >= output_len) {
        scheduler.FinishSequence(*seq);
      } else if (max_drafts > 0) {
        seq->draft_tokens.resize(static_cast<size_t>(rng() % static_cast<uint64_t>(max_drafts + 1)));
        for (int32_t& t : seq->draft_tokens) t = 100 + static_cast<int32_t>(rng() % 50);  // never the real 7
      }
      touched.insert(g->request_id);
    }
    for (RequestId id : touched) {
      SequenceGroup* g = scheduler.Find(id);
      if (g->num_unfinished() == 0) {
        for (const auto& s : g->seqs) EXPECT_EQ(s->output_len(), targets[id].first);
        EXPECT_EQ(static_cast<int>(g->seqs.size()), targets[id].second);
        finished.push_back(id);
        scheduler.RemoveGroup(id);
      }
    }
    CheckMemory();
  }

  // Accepts a random leading run of the drafts that ran, never past the request's length.
  void Verify(const ScheduledSeq& step, const std::vector<int32_t>& ran, int output_len) {
    const int64_t k = static_cast<int64_t>(ran.size());
    const uint64_t dice = rng() % 3;
    int64_t accepted = dice == 0 ? 0 : dice == 1 ? k : static_cast<int64_t>(rng() % static_cast<uint64_t>(k + 1));
    accepted = std::min<int64_t>(accepted, output_len - step.seq->output_len() - 1);
    if (k > 0) {
      drafts_accepted += accepted;
      drafts_rejected += k - accepted;
      all_accepted += accepted == k;
      none_accepted += accepted == 0;
    }
    const auto kept = std::span<const int32_t>(ran).first(static_cast<size_t>(accepted));
    const Status st = scheduler.AcceptDrafts(step, kept, 7);
    EXPECT_TRUE(st.ok()) << st.ToString();
    if (policy_name == "paged") {
      // The rejected drafts' blocks went back: the table holds the tokens and nothing more.
      EXPECT_LE(blocks.BlockTable(step.seq->id).size(),
                static_cast<size_t>(BlocksForTokens(step.seq->num_tokens(), block_size)));
    }
  }

  // Drafts run only behind all of a decoding single-candidate sequence's real tokens, within
  // max_model_len, with KV slots; preemption drops them.
  void CheckDrafts(const SchedulerOutput& out, const std::set<SeqId>& had_drafts) {
    for (const ScheduledSeq& s : out.scheduled) {
      if (s.num_draft_tokens == 0) continue;
      EXPECT_TRUE(s.needs_logits);
      EXPECT_EQ(s.group->num_candidates, 1);
      EXPECT_GE(s.seq->num_computed, s.seq->prompt_len) << "drafts during prefill";
      EXPECT_EQ(s.num_real_tokens(), s.seq->num_uncomputed());
      EXPECT_LE(s.num_draft_tokens, static_cast<int64_t>(s.seq->draft_tokens.size()));
      EXPECT_LE(s.seq->num_tokens() + s.num_draft_tokens, scheduler.config().max_model_len - 1);
      EXPECT_GE(static_cast<int64_t>(blocks.BlockTable(s.seq->id).size()) * block_size,
                s.seq->num_computed + s.num_tokens);
      drafts_scheduled += s.num_draft_tokens;
    }
    for (RequestId id = 1; id < next_request; ++id) {
      const SequenceGroup* g = scheduler.Find(id);
      if (!g) continue;
      for (const auto& s : g->seqs) {
        if (s->status != SeqStatus::kWaiting && s->status != SeqStatus::kSwapped) continue;
        EXPECT_TRUE(s->draft_tokens.empty()) << "a preempted sequence kept its drafts";
        drafts_dropped += had_drafts.contains(s->id);
      }
    }
  }

  // Executes the step's block moves, as a backend does before the forward pass.
  void RunMoves(const SchedulerOutput& out) {
    auto execute = [](const std::vector<BlockMove>& moves, std::vector<std::vector<int32_t>>& from,
                      std::vector<std::vector<int32_t>>& to) {
      for (const BlockMove& m : moves) to[static_cast<size_t>(m.dst)] = from[static_cast<size_t>(m.src)];
    };
    execute(out.swap_out, device_mem, host_mem);
    execute(out.swap_in, host_mem, device_mem);
    execute(out.copies, device_mem, device_mem);
  }

  // Writes every scheduled position (drafts included), as the forward pass does.
  void WriteTokens(const SchedulerOutput& out) {
    for (const ScheduledSeq& s : out.scheduled) {
      const auto& table = blocks.BlockTable(s.seq->id);
      for (int64_t i = 0; i < s.num_tokens; ++i) {
        const int64_t pos = s.seq->num_computed + i;
        device_mem[static_cast<size_t>(table[static_cast<size_t>(pos / block_size)])]
                  [static_cast<size_t>(pos % block_size)] = s.token(i);
      }
    }
  }

  // Every computed token reads back through its sequence's table; every block published in the
  // prefix cache holds the tokens it is published under (never a rejected draft).
  void CheckMemory() {
    for (RequestId id = 1; id < next_request; ++id) {
      const SequenceGroup* g = scheduler.Find(id);
      if (!g) continue;
      for (const auto& s : g->seqs) {
        if (s->finished() || !blocks.Has(s->id)) continue;
        const auto& mem = blocks.IsSwapped(s->id) ? host_mem : device_mem;
        const auto& table = blocks.BlockTable(s->id);
        for (int64_t i = 0; i < s->num_computed; ++i) {
          const int32_t held = mem[static_cast<size_t>(table[static_cast<size_t>(i / block_size)])]
                                  [static_cast<size_t>(i % block_size)];
          if (held != s->tokens[static_cast<size_t>(i)]) {
            ADD_FAILURE() << "request " << id << " sequence " << s->id << " reads " << held << " at " << i
                          << " instead of " << s->tokens[static_cast<size_t>(i)];
            return;
          }
        }
      }
    }
    for (BlockId b = 0; b < blocks.device().num_blocks(); ++b) {
      const auto published = blocks.device().content_tokens(b);
      if (!std::equal(published.begin(), published.end(), device_mem[static_cast<size_t>(b)].begin())) {
        ADD_FAILURE() << "device block " << b << " does not hold the tokens it is published under";
        return;
      }
    }
  }

  BlockManager blocks;
  Scheduler scheduler;
  RequestId next_request = 1;
  std::map<RequestId, std::pair<int, int>> targets;  // output length, n
  std::vector<RequestId> finished;
  std::set<RequestId> rejected;
  // Requests in the last step's batch (its ScheduledSeq pointers die with finished groups).
  std::vector<RequestId> batch_ids;
  std::string policy_name;
  int block_size;
  std::vector<std::vector<int32_t>> device_mem, host_mem;  // the simulated KV: one token per slot
  int max_drafts = 0;
  std::mt19937_64 rng{1};
  int64_t drafts_scheduled = 0, drafts_accepted = 0, drafts_rejected = 0, drafts_dropped = 0;
  int64_t all_accepted = 0, none_accepted = 0;  // verifications with drafts that kept all / none
  std::deque<InFlight> in_flight;  // batches in flight, oldest first
  int64_t overlapped_steps = 0;    // steps scheduled while another was in flight
};

SchedulerConfig Config(int max_seqs = 64, int64_t max_tokens = 2048, PreemptionMode mode = PreemptionMode::kAuto) {
  SchedulerConfig c;
  c.max_num_seqs = max_seqs;
  c.max_num_batched_tokens = max_tokens;
  c.max_model_len = 256;
  c.preemption_mode = mode;
  return c;
}

TEST(Scheduler, RespectsTheSequenceAndTokenBudgetsAndChunksLongPrompts) {
  FakeRun run(100, 0, Config(/*max_seqs=*/2, /*max_tokens=*/10));
  run.Add(25, 3, 0.0);
  run.Add(4, 3, 1.0);
  run.Add(4, 3, 2.0);
  auto s1 = run.Step();
  ASSERT_EQ(s1.scheduled.size(), 1u);  // the first prompt eats the whole token budget
  EXPECT_EQ(s1.num_batched_tokens, 10);
  EXPECT_FALSE(s1.scheduled[0].needs_logits);
  auto s2 = run.Step();
  EXPECT_EQ(s2.num_batched_tokens, 10);
  auto s3 = run.Step();  // 5 tokens finish prompt 1, prompt 2 (4 tokens) joins; max_num_seqs = 2
  ASSERT_EQ(s3.scheduled.size(), 2u);
  EXPECT_EQ(s3.scheduled[0].num_tokens, 5);
  EXPECT_TRUE(s3.scheduled[0].needs_logits);
  EXPECT_EQ(s3.scheduled[1].num_tokens, 4);
  EXPECT_EQ(run.scheduler.stats().num_waiting, 1);
  while (run.scheduler.HasWork()) run.Step();
  EXPECT_EQ(run.finished, (std::vector<RequestId>{1, 2, 3}));
  EXPECT_EQ(run.blocks.device().num_free(), 100);
}

TEST(Scheduler, PreemptsTheLatestArrivalByRecomputeAndServesItAgainFirst) {
  // 6 blocks of 4 tokens: two requests of 8 prompt tokens each need 2 blocks, then grow.
  FakeRun run(6, 0, Config());
  run.Add(8, 8, 0.0);
  run.Add(8, 8, 1.0);
  run.Step();  // both prefill (4 blocks)
  int preempted = 0;
  while (run.scheduler.HasWork()) {
    auto out = run.Step();
    preempted += out.num_preempted_recompute;
    for (RequestId id : run.batch_ids) {
      if (out.num_preempted_recompute > 0) {
        EXPECT_EQ(id, 1u) << "the earlier request keeps running";
      }
    }
  }
  EXPECT_GT(preempted, 0);
  EXPECT_EQ(run.finished, (std::vector<RequestId>{1, 2}));
  EXPECT_EQ(run.scheduler.stats().num_preemptions_swap, 0);
  EXPECT_EQ(run.blocks.device().num_free(), 6);
}

TEST(Scheduler, SwapsGroupsThatShareBlocksAndAdmitsNothingWhileSwapped) {
  FakeRun run(8, 8, Config());
  run.Add(6, 10, 0.0, /*n=*/2);
  run.Add(6, 10, 1.0, /*n=*/2);
  run.Add(2, 2, 2.0);  // must wait while anything is swapped
  bool saw_swap_out = false, saw_swap_in = false;
  for (int step = 0; step < 200 && run.scheduler.HasWork(); ++step) {
    auto out = run.Step();
    saw_swap_out |= !out.swap_out.empty();
    saw_swap_in |= !out.swap_in.empty();
    const auto st = run.scheduler.stats();
    if (st.num_swapped > 0) {
      for (RequestId id : run.batch_ids) EXPECT_NE(id, 3u) << "admitted while swapped";
    }
  }
  EXPECT_TRUE(saw_swap_out);
  EXPECT_TRUE(saw_swap_in);
  EXPECT_EQ(run.finished.size(), 3u);
  EXPECT_GT(run.scheduler.stats().num_preemptions_swap, 0);
  EXPECT_EQ(run.blocks.device().num_free(), 8);
  EXPECT_EQ(run.blocks.host().num_free(), 8);
}

TEST(Scheduler, OrcaMaxReservesTheWholeContextAndServesOneAtATimeWhereThePagedPolicyBatches) {
  SchedulerConfig c = Config();
  c.max_model_len = 64;  // 16 blocks
  FakeRun orca(20, 0, c, "orca-max");
  FakeRun paged(20, 0, c, "paged");
  for (FakeRun* r : {&orca, &paged}) {
    for (int i = 0; i < 4; ++i) r->Add(8, 8, i);
  }
  auto o = orca.Step();
  auto p = paged.Step();
  EXPECT_EQ(o.scheduled.size(), 1u);
  EXPECT_EQ(orca.blocks.BlockTable(o.scheduled[0].seq->id).size(), 16u);
  EXPECT_EQ(p.scheduled.size(), 4u);
  while (orca.scheduler.HasWork()) orca.Step();
  while (paged.scheduler.HasWork()) paged.Step();
  EXPECT_EQ(orca.finished.size(), 4u);
  EXPECT_EQ(paged.finished.size(), 4u);
}

TEST(Scheduler, OraclePolicyReservesTheTrueOutputAndPow2RoundsItUp) {
  SchedulerConfig c = Config();
  FakeRun oracle(100, 0, c, "orca-oracle");
  FakeRun pow2(100, 0, c, "orca-pow2");
  oracle.Add(8, 9, 0);
  pow2.Add(8, 9, 0);
  auto a = oracle.Step();
  auto b = pow2.Step();
  EXPECT_EQ(oracle.blocks.BlockTable(a.scheduled[0].seq->id).size(), 5u);  // 17 tokens
  EXPECT_EQ(pow2.blocks.BlockTable(b.scheduled[0].seq->id).size(), 6u);    // 8 + 16 tokens
}

TEST(Scheduler, RejectsWhatCanNeverFitAndKeepsServingTheRest) {
  FakeRun run(4, 0, Config());
  run.Add(40, 2, 0.0);  // 10 blocks of 4 > 4
  run.Add(4, 2, 1.0);
  while (run.scheduler.HasWork()) run.Step();
  EXPECT_EQ(run.rejected, (std::set<RequestId>{1}));
  EXPECT_EQ(run.finished, (std::vector<RequestId>{2}));
  EXPECT_EQ(run.blocks.device().num_free(), 4);
}

TEST(Scheduler, PrefixHitsSkipTheCachedPartOfThePrompt) {
  FakeRun run(50, 0, Config(), "paged", /*prefix=*/true);
  run.Add(17, 2, 0.0);
  while (run.scheduler.HasWork()) run.Step();
  run.Add(17, 2, 1.0);  // same tokens
  auto out = run.Step();
  ASSERT_EQ(out.scheduled.size(), 1u);
  EXPECT_EQ(out.scheduled[0].num_tokens, 1);  // 16 cached, the last token runs
  EXPECT_GT(run.blocks.PrefixHitRate(), 0.0);
}

TEST(Scheduler, S3ReservesPromptPlusPredictionCappedByMaxTokens) {
  FakeRun run(100, 0, Config(), "s3");
  run.Add(8, 9, 0, 1, 1000, /*predicted=*/12, /*max_output=*/40);  // 20 tokens: 5 blocks
  run.Add(8, 9, 1, 1, 2000, /*predicted=*/500, /*max_output=*/10);  // max_tokens caps it: 18 tokens
  run.Add(8, 9, 2, 1, 3000, std::nullopt, /*max_output=*/30);       // no prediction: max_tokens
  auto out = run.Step();
  ASSERT_EQ(out.scheduled.size(), 3u);
  std::map<RequestId, size_t> table;
  for (const ScheduledSeq& s : out.scheduled) table[s.group->request_id] = run.blocks.BlockTable(s.seq->id).size();
  EXPECT_EQ(table[1], 5u);
  EXPECT_EQ(table[2], 5u);   // ceil(18 / 4)
  EXPECT_EQ(table[3], 10u);  // 38 tokens
}

TEST(Scheduler, S3PacksFirstFitDecreasingWhereFcfsStopsAtTheFirstMisfit) {
  // 20 blocks of 4 tokens. A (6 blocks) arrives first, then B (15), then C (5). FCFS with exact
  // reservations admits A and stops at B; first-fit decreasing takes B, skips A, fits C.
  SchedulerConfig c = Config();
  FakeRun s3(20, 0, c, "s3");
  FakeRun fcfs(20, 0, c, "orca-oracle");
  for (FakeRun* r : {&s3, &fcfs}) {
    r->Add(4, 20, 0.0, 1, 1000, 20);  // 24 tokens: 6 blocks
    r->Add(4, 56, 1.0, 1, 2000, 56);  // 60 tokens: 15 blocks
    r->Add(4, 16, 2.0, 1, 3000, 16);  // 20 tokens: 5 blocks
  }
  s3.Step();
  fcfs.Step();
  std::set<RequestId> s3_batch(s3.batch_ids.begin(), s3.batch_ids.end());
  std::set<RequestId> fcfs_batch(fcfs.batch_ids.begin(), fcfs.batch_ids.end());
  EXPECT_EQ(s3_batch, (std::set<RequestId>{2, 3}));
  EXPECT_EQ(fcfs_batch, (std::set<RequestId>{1}));
  EXPECT_EQ(s3.blocks.device().num_free(), 0);
  for (FakeRun* r : {&s3, &fcfs}) {
    while (r->scheduler.HasWork()) r->Step();
    EXPECT_EQ(r->finished.size(), 3u);
    EXPECT_EQ(r->blocks.device().num_free(), 20);
  }
}

// The supervisor: a prediction too short makes the sequence outgrow its reservation; it is
// preempted (by recompute or by swap), comes back with the reservation doubled, and finishes.
TEST(Scheduler, S3PreemptsASequenceThatOutgrowsItsReservationAndDoublesIt) {
  for (PreemptionMode mode : {PreemptionMode::kRecompute, PreemptionMode::kSwap}) {
    SCOPED_TRACE(PreemptionModeName(mode));
    FakeRun run(40, 40, Config(64, 2048, mode), "s3");
    // Prompt 8, predicted 4: reservation 12 tokens, then 24, then 48 (true length 8 + 30 = 38).
    run.Add(8, 30, 0.0, 1, 1000, /*predicted=*/4, /*max_output=*/200);
    run.Add(8, 2, 1.0, 1, 2000, /*predicted=*/2, /*max_output=*/200);  // right: never preempted
    std::vector<RequestId> exhausted;
    std::vector<size_t> tables;
    int preempted = 0;
    while (run.scheduler.HasWork()) {
      auto out = run.Step();
      exhausted.insert(exhausted.end(), out.reservation_exhausted.begin(), out.reservation_exhausted.end());
      preempted += out.num_preempted_recompute + out.num_preempted_swap;
      if (SequenceGroup* g = run.scheduler.Find(1); g && !out.scheduled.empty() &&
                                                    out.scheduled[0].group == g) {
        const size_t t = run.blocks.BlockTable(g->seqs[0]->id).size();
        if (tables.empty() || tables.back() != t) tables.push_back(t);
      }
    }
    EXPECT_EQ(exhausted, (std::vector<RequestId>{1, 1}));
    EXPECT_EQ(preempted, 2);
    EXPECT_EQ(run.scheduler.stats().num_reservation_preemptions, 2);
    EXPECT_EQ(tables, (std::vector<size_t>{3, 6, 12}));  // 12, 24, 48 tokens
    EXPECT_EQ(run.finished.size(), 2u);
    EXPECT_EQ(run.blocks.device().num_free(), 40);
    EXPECT_EQ(run.blocks.host().num_free(), 40);
  }
}

TEST(Scheduler, S3CapsADoubledReservationAtThePoolInsteadOfPreemptingForever) {
  // 10 blocks (40 tokens). Prompt 4, predicted 4: 8 tokens, 16, 32, then 64, which the pool
  // cannot hold: the request gets the whole pool and finishes (38 tokens).
  FakeRun run(10, 0, Config(64, 2048, PreemptionMode::kRecompute), "s3");
  run.Add(4, 34, 0.0, 1, 1000, /*predicted=*/4, /*max_output=*/100);
  int steps = 0;
  while (run.scheduler.HasWork()) {
    ASSERT_LT(++steps, 500);
    run.Step();
  }
  EXPECT_EQ(run.finished, (std::vector<RequestId>{1}));
  EXPECT_EQ(run.scheduler.stats().num_reservation_preemptions, 3);
  EXPECT_EQ(run.blocks.device().num_free(), 10);
}

TEST(Scheduler, S3OracleReservesTheTrueLengthAndNeverMisses) {
  FakeRun run(60, 0, Config(), "s3-oracle");
  for (int i = 0; i < 12; ++i) run.Add(3 + i, 5 + 3 * i, i, 1, 1000 * i, /*predicted=*/1, /*max_output=*/200);
  while (run.scheduler.HasWork()) run.Step();
  EXPECT_EQ(run.finished.size(), 12u);
  EXPECT_EQ(run.scheduler.stats().num_reservation_preemptions, 0);
}

SchedSequence& First(FakeRun& run, RequestId id) { return *run.scheduler.Find(id)->seqs.front(); }

TEST(Scheduler, DraftsRunBehindTheLastTokenWithTheBudgetTheRealTokensLeave) {
  FakeRun run(100, 0, Config(64, /*max_tokens=*/4));
  run.Add(2, 20, 0.0);
  run.Add(2, 20, 1.0);
  run.Step();  // both prompts (2 + 2 tokens), one token sampled each
  SchedSequence& a = First(run, 1);
  a.draft_tokens = {100, 101, 102, 103, 104};
  auto out = run.scheduler.Schedule();
  ASSERT_EQ(out.scheduled.size(), 2u);
  // The later request's real token runs; the drafts take the 2 tokens of budget left.
  const ScheduledSeq& sa = out.scheduled[0];
  ASSERT_EQ(sa.seq, &a);
  EXPECT_EQ(sa.num_tokens, 3);
  EXPECT_EQ(sa.num_draft_tokens, 2);
  EXPECT_EQ(sa.num_real_tokens(), 1);
  EXPECT_TRUE(sa.needs_logits);
  EXPECT_EQ(sa.token(0), 7);
  EXPECT_EQ(sa.token(1), 100);
  EXPECT_EQ(sa.token(2), 101);
  EXPECT_EQ(out.scheduled[1].num_tokens, 1);
  EXPECT_EQ(out.scheduled[1].num_draft_tokens, 0);
  EXPECT_EQ(out.num_batched_tokens, 4);
  EXPECT_GE(static_cast<int64_t>(run.blocks.BlockTable(a.id).size()) * 4, a.num_computed + sa.num_tokens);
  run.scheduler.CompleteStep(out);
  EXPECT_EQ(a.num_computed, 3) << "drafts are not computed tokens";
  EXPECT_TRUE(a.draft_tokens.empty());
}

TEST(Scheduler, DraftsTakeOnlyFreeBlocksAndNeverPreempt) {
  // 4 blocks of 4 tokens: two decoding sequences each need a new block for their real token;
  // the drafts fit only in what that block has left.
  FakeRun run(4, 0, Config(64, 2048, PreemptionMode::kRecompute));
  run.Add(4, 20, 0.0);
  run.Add(4, 20, 1.0);
  run.Step();
  First(run, 1).draft_tokens = {100, 101, 102, 103, 104, 105, 106, 107};
  auto out = run.scheduler.Schedule();
  ASSERT_EQ(out.scheduled.size(), 2u);
  EXPECT_EQ(out.scheduled[0].num_draft_tokens, 3);  // positions 5, 6, 7
  EXPECT_EQ(out.scheduled[1].num_tokens, 1);
  EXPECT_EQ(out.num_preempted_recompute, 0);
  EXPECT_EQ(run.blocks.device().num_free(), 0);
}

TEST(Scheduler, NoDraftsDuringPrefillOrForSeveralCandidates) {
  FakeRun run(100, 0, Config(64, /*max_tokens=*/6));
  run.Add(8, 5, 0.0);
  SchedSequence& s = First(run, 1);
  for (int chunk = 0; chunk < 2; ++chunk) {  // the last chunk computes the last prompt token
    s.draft_tokens = {100, 101};
    auto out = run.scheduler.Schedule();
    ASSERT_EQ(out.scheduled.size(), 1u);
    EXPECT_EQ(out.scheduled[0].num_tokens, chunk == 0 ? 6 : 2);
    EXPECT_EQ(out.scheduled[0].num_draft_tokens, 0) << "chunk " << chunk;
    run.scheduler.CompleteStep(out);
    if (out.scheduled[0].needs_logits) s.tokens.push_back(7);
  }

  FakeRun beams(100, 0, Config());
  beams.Add(4, 5, 0.0, /*n=*/2);
  beams.Step();  // prompt, then the fork
  SequenceGroup* g = beams.scheduler.Find(1);
  ASSERT_EQ(g->seqs.size(), 2u);
  for (auto& seq : g->seqs) seq->draft_tokens = {100, 101};
  auto out = beams.scheduler.Schedule();
  ASSERT_EQ(out.scheduled.size(), 2u);
  for (const ScheduledSeq& sc : out.scheduled) EXPECT_EQ(sc.num_draft_tokens, 0);
}

TEST(Scheduler, DraftsLeaveRoomForTheBonusTokenWithinMaxModelLen) {
  SchedulerConfig c = Config();
  c.max_model_len = 12;
  FakeRun run(100, 0, c);
  run.Add(8, 4, 0.0);
  run.Step();  // 9 tokens
  SchedSequence& s = First(run, 1);
  s.draft_tokens = {100, 101, 102, 103, 104};
  auto out = run.scheduler.Schedule();
  ASSERT_EQ(out.scheduled.size(), 1u);
  EXPECT_EQ(out.scheduled[0].num_draft_tokens, 2);
  run.scheduler.CompleteStep(out);
  const std::vector<int32_t> accepted = {100, 101};
  ASSERT_TRUE(run.scheduler.AcceptDrafts(out.scheduled[0], accepted, 9).ok());
  EXPECT_EQ(s.num_tokens(), c.max_model_len);
}

TEST(Scheduler, DraftsAreDroppedWhenTheirSequenceIsPreempted) {
  for (PreemptionMode mode : {PreemptionMode::kRecompute, PreemptionMode::kSwap}) {
    SCOPED_TRACE(PreemptionModeName(mode));
    // 3 blocks: after the prompts (one block each) only one of the two can get its next block.
    FakeRun run(3, 3, Config(64, 2048, mode));
    run.Add(4, 6, 0.0);
    run.Add(4, 6, 1.0);
    run.Step();
    SchedSequence& a = First(run, 1);
    SchedSequence& b = First(run, 2);
    a.draft_tokens = {100, 101, 102, 103};
    b.draft_tokens = {100, 101, 102, 103};
    auto out = run.scheduler.Schedule();
    EXPECT_EQ(out.num_preempted_recompute + out.num_preempted_swap, 1);
    EXPECT_EQ(b.status, mode == PreemptionMode::kSwap ? SeqStatus::kSwapped : SeqStatus::kWaiting);
    EXPECT_TRUE(b.draft_tokens.empty());
    ASSERT_EQ(out.scheduled.size(), 1u);
    EXPECT_EQ(out.scheduled[0].seq, &a);
    EXPECT_EQ(out.scheduled[0].num_draft_tokens, 4) << "b's block is free now";
    run.RunMoves(out);
    run.WriteTokens(out);
    run.scheduler.CompleteStep(out);
    ASSERT_TRUE(run.scheduler.AcceptDrafts(out.scheduled[0], {}, 9).ok());
    while (run.scheduler.HasWork()) run.Step();
    EXPECT_EQ(run.finished.size(), 2u);
    EXPECT_EQ(run.blocks.device().num_free(), 3);
    EXPECT_EQ(run.blocks.host().num_free(), 3);
  }
}

TEST(Scheduler, AcceptDraftsKeepsTheAcceptedAndFreesTheRejectedDraftsBlocks) {
  for (int accepted : {0, 3, 8}) {
    SCOPED_TRACE(accepted);
    FakeRun run(100, 0, Config());
    run.Add(4, 40, 0.0);
    run.Step();  // 5 tokens, 4 computed, one block
    SchedSequence& s = First(run, 1);
    const std::vector<int32_t> drafts = {100, 101, 102, 103, 104, 105, 106, 107};
    s.draft_tokens = drafts;
    auto out = run.scheduler.Schedule();
    ASSERT_EQ(out.scheduled[0].num_draft_tokens, 8);
    EXPECT_EQ(run.blocks.BlockTable(s.id).size(), 4u);  // 13 positions
    run.scheduler.CompleteStep(out);
    const auto kept = std::span(drafts).first(static_cast<size_t>(accepted));
    ASSERT_TRUE(run.scheduler.AcceptDrafts(out.scheduled[0], kept, 9).ok());
    EXPECT_EQ(s.num_computed, 5 + accepted);
    EXPECT_EQ(s.num_tokens(), 5 + accepted + 1);
    EXPECT_TRUE(std::equal(drafts.begin(), drafts.begin() + accepted, s.tokens.begin() + 5));
    EXPECT_EQ(s.tokens.back(), 9);
    EXPECT_EQ(run.blocks.BlockTable(s.id).size(), static_cast<size_t>(BlocksForTokens(s.num_tokens(), 4)));
    EXPECT_EQ(run.blocks.device().num_free(), 100 - BlocksForTokens(s.num_tokens(), 4));
  }
}

TEST(Scheduler, AcceptDraftsRefusesMoreDraftsThanRanAndASecondCall) {
  FakeRun run(100, 0, Config());
  run.Add(4, 40, 0.0);
  run.Step();
  SchedSequence& s = First(run, 1);
  s.draft_tokens = {100, 101};
  auto out = run.scheduler.Schedule();
  run.scheduler.CompleteStep(out);
  const std::vector<int32_t> three = {100, 101, 102};
  EXPECT_EQ(run.scheduler.AcceptDrafts(out.scheduled[0], three, 9).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.num_tokens(), 5) << "a refused call changes nothing";
  ASSERT_TRUE(run.scheduler.AcceptDrafts(out.scheduled[0], std::span(three).first(1), 9).ok());
  EXPECT_EQ(run.scheduler.AcceptDrafts(out.scheduled[0], {}, 9).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.num_tokens(), 7);
}

TEST(Scheduler, OnlyComputedRealTokensArePublishedToThePrefixCache) {
  for (int accepted : {1, 3}) {
    SCOPED_TRACE(accepted);
    FakeRun run(100, 0, Config(), "paged", /*prefix=*/true);
    run.Add(4, 40, 0.0);
    run.Step();  // block 0 holds the prompt, published
    SchedSequence& s = First(run, 1);
    const std::vector<int32_t> drafts = {100, 101, 102, 103, 104};
    s.draft_tokens = drafts;
    auto out = run.scheduler.Schedule();
    run.scheduler.CompleteStep(out);
    const BlockId second = run.blocks.BlockTable(s.id)[1];  // positions 4..7: 7, then drafts
    EXPECT_FALSE(run.blocks.device().is_cached_content(second));
    const auto kept = std::span(drafts).first(static_cast<size_t>(accepted));
    ASSERT_TRUE(run.scheduler.AcceptDrafts(out.scheduled[0], kept, 9).ok());
    const auto published = run.blocks.device().content_tokens(second);
    if (accepted == 3) {
      // 7, 100, 101, 102: every position a computed real token now.
      EXPECT_EQ(std::vector<int32_t>(published.begin(), published.end()), (std::vector<int32_t>{7, 100, 101, 102}));
    } else {
      EXPECT_TRUE(published.empty()) << "positions 6 and 7 hold rejected drafts";
    }
  }
}

TEST(Scheduler, S3DraftsStayInsideTheReservationSoTheSupervisorSeesRealGrowth) {
  FakeRun run(100, 0, Config(), "s3");
  run.Add(4, 30, 0.0, 1, 1000, /*predicted=*/4, /*max_output=*/100);  // reserves 8 tokens: 2 blocks
  run.Step();
  SchedSequence& s = First(run, 1);
  const std::vector<int32_t> drafts = {100, 101, 102, 103, 104, 105};
  s.draft_tokens = drafts;
  auto out = run.scheduler.Schedule();
  ASSERT_EQ(out.scheduled.size(), 1u);
  EXPECT_EQ(out.scheduled[0].num_draft_tokens, 3);  // positions 5, 6, 7
  EXPECT_EQ(run.blocks.BlockTable(s.id).size(), 2u);
  run.scheduler.CompleteStep(out);
  ASSERT_TRUE(run.scheduler.AcceptDrafts(out.scheduled[0], std::span(drafts).first(3), 9).ok());
  EXPECT_EQ(run.blocks.BlockTable(s.id).size(), 2u) << "the reservation stays";
  // The bonus token at position 8 is the first past the reservation: a miss, as without drafts.
  auto next = run.scheduler.Schedule();
  EXPECT_EQ(next.reservation_exhausted, (std::vector<RequestId>{1}));
}

std::vector<RequestId> BatchOf(const SchedulerOutput& out) {
  std::vector<RequestId> ids;
  for (const ScheduledSeq& s : out.scheduled) ids.push_back(s.group->request_id);
  return ids;
}

// vLLM V1's batch queue: with two batches in flight each step takes half the sequences, and a
// group in a step that has not completed is not scheduled again until it has.
TEST(Scheduler, BatchesInFlightTakeTheirShareAndNeverTheSameGroup) {
  SchedulerConfig c = Config();
  c.batches_in_flight = 2;
  FakeRun run(100, 0, c);
  for (int i = 0; i < 4; ++i) run.Add(8, 4, i);
  const SchedulerOutput first = run.scheduler.Schedule();
  EXPECT_EQ(BatchOf(first), (std::vector<RequestId>{1, 2}));
  const SchedulerOutput second = run.scheduler.Schedule();
  EXPECT_EQ(BatchOf(second), (std::vector<RequestId>{3, 4}));
  EXPECT_TRUE(run.scheduler.Schedule().empty()) << "every group is in flight";
  run.scheduler.CompleteStep(first);
  for (const ScheduledSeq& s : first.scheduled) {
    EXPECT_FALSE(s.group->in_flight);
    s.seq->tokens.push_back(7);
  }
  for (const ScheduledSeq& s : second.scheduled) EXPECT_TRUE(s.group->in_flight);
  const SchedulerOutput third = run.scheduler.Schedule();
  EXPECT_EQ(BatchOf(third), (std::vector<RequestId>{1, 2}));
  EXPECT_EQ(third.num_batched_tokens, 2);  // one decode token each
  // One batch at a time, the same requests all go in one step.
  FakeRun whole(100, 0, Config());
  for (int i = 0; i < 4; ++i) whole.Add(8, 4, i);
  EXPECT_EQ(BatchOf(whole.scheduler.Schedule()), (std::vector<RequestId>{1, 2, 3, 4}));
}

// A group in flight keeps its blocks: a group that needs one when none is free preempts the last
// group not in flight, and when that is itself, waits for the steps in flight instead.
TEST(Scheduler, AGroupThatNeedsBlocksWaitsForTheBatchesInFlight) {
  SchedulerConfig c = Config();
  c.batches_in_flight = 2;
  FakeRun run(4, 0, c);  // 4 blocks of 4 tokens
  run.Add(8, 4, 0);
  run.Add(8, 4, 1);
  const SchedulerOutput first = run.scheduler.Schedule();
  ASSERT_EQ(BatchOf(first), (std::vector<RequestId>{1}));
  const SchedulerOutput second = run.scheduler.Schedule();
  ASSERT_EQ(BatchOf(second), (std::vector<RequestId>{2}));
  ASSERT_EQ(run.blocks.device().num_free(), 0);
  run.scheduler.CompleteStep(first);
  First(run, 1).tokens.push_back(7);  // its 9th token needs a third block
  const SchedulerOutput waits = run.scheduler.Schedule();
  EXPECT_TRUE(waits.empty());
  EXPECT_EQ(waits.num_preempted_recompute + waits.num_preempted_swap, 0) << "request 2 is in flight";
  EXPECT_TRUE(waits.rejected.empty());
  EXPECT_EQ(First(run, 2).status, SeqStatus::kRunning);
  run.scheduler.CompleteStep(second);
  First(run, 2).tokens.push_back(7);
  const SchedulerOutput after = run.scheduler.Schedule();
  EXPECT_EQ(after.num_preempted_recompute, 1);  // request 2 gives way now that it is not in flight
  EXPECT_EQ(BatchOf(after), (std::vector<RequestId>{1}));
  EXPECT_EQ(First(run, 2).status, SeqStatus::kWaiting);
}

// Random arrivals, lengths, n, budgets, pools, policies and preemption modes, and with `drafts`
// random drafts (up to 1-6 per step) with random acceptance. After every step: budgets hold,
// every scheduled sequence has blocks for its context, device refcounts equal the references in
// the tables, nothing new is admitted while something is swapped, no request overtakes an earlier
// waiting one (FCFS), and FakeRun's own checks (KV memory, draft rules, and with `in_flight` 2 or
// 3 random batches in flight: no group in two of them, none preempted or moved) pass. At the end
// everything finished and every block is free.
void RunRandomWorkloads(bool drafts, bool in_flight = false) {
  int64_t overlapped = 0, steps_total = 0;
  int64_t preempt_recompute = 0, preempt_swap = 0;
  int64_t drafts_scheduled = 0, drafts_accepted = 0, drafts_rejected = 0, drafts_dropped = 0;
  int64_t all_accepted = 0, none_accepted = 0;
  for (uint64_t seed = 1; seed <= 1000; ++seed) {
    std::mt19937_64 rng(seed);
    auto rand = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
    const PreemptionMode mode = std::array{PreemptionMode::kAuto, PreemptionMode::kSwap,
                                           PreemptionMode::kRecompute}[static_cast<size_t>(rand(3))];
    SchedulerConfig c = Config(2 + rand(8), 8 + rand(40), mode);
    c.max_model_len = 96;
    if (in_flight) c.batches_in_flight = 2 + rand(2);
    const std::string policy = SchedulingPolicyNames()[static_cast<size_t>(rand(6))];
    const bool fcfs = !MakeSchedulingPolicy(policy).value()->AdmitOutOfOrder();
    const int device_blocks = 30 + rand(40);
    FakeRun run(device_blocks, rand(2) * device_blocks, c, policy, rand(2) == 1);
    if (drafts) {
      run.max_drafts = 1 + static_cast<int>(seed % 6);
      run.rng.seed(seed);
    }
    const int num_requests = 5 + rand(20);
    for (int i = 0; i < num_requests; ++i) {
      // Predictions anywhere from far too short to far too long; max_tokens at or above the truth.
      const int output_len = 1 + rand(40);
      run.Add(1 + rand(40), output_len, i, policy == "paged" || policy == "s3" ? 1 + rand(3) : 1, rand(2) * 1000,
              1 + rand(2 * output_len), output_len + rand(2) * rand(40));
    }
    std::set<RequestId> ever_admitted;
    int steps = 0;
    while (run.scheduler.HasWork()) {
      const auto st = run.scheduler.stats();
      ASSERT_LT(++steps, 20000) << "seed " << seed << ": no progress; policy " << policy << ", mode "
                                << PreemptionModeName(mode) << ", max_num_seqs " << c.max_num_seqs << ", tokens "
                                << c.max_num_batched_tokens << ", blocks " << device_blocks << "/"
                                << run.blocks.host().num_blocks() << "; waiting " << st.num_waiting << ", running "
                                << st.num_running << " (" << st.num_running_seqs << " seqs), swapped " << st.num_swapped;
      auto out = run.Step();
      ASSERT_FALSE(::testing::Test::HasFailure()) << "seed " << seed;
      ASSERT_LE(out.num_batched_tokens, c.max_num_batched_tokens);
      std::set<RequestId> in_batch(run.batch_ids.begin(), run.batch_ids.end());
      ASSERT_LE(run.scheduler.stats().num_running_seqs, c.max_num_seqs);
      for (RequestId id : in_batch) {
        if (ever_admitted.insert(id).second) {
          // Swapped groups may come back earlier in the same step; then nothing is swapped.
          ASSERT_EQ(run.scheduler.stats().num_swapped, 0) << "seed " << seed << ": admitted while swapped";
          for (RequestId earlier = 1; fcfs && earlier < id; ++earlier) {
            ASSERT_TRUE(ever_admitted.contains(earlier) || run.rejected.contains(earlier))
                << "seed " << seed << ": request " << id << " overtook " << earlier;
          }
        }
      }
      // Refcounts equal the references held by live sequences.
      std::map<BlockId, int> refs;
      for (RequestId id = 1; id < run.next_request; ++id) {
        const SequenceGroup* g = run.scheduler.Find(id);
        if (!g) continue;
        for (const auto& s : g->seqs) {
          if (s->finished() || !run.blocks.Has(s->id) || run.blocks.IsSwapped(s->id)) continue;
          for (BlockId b : run.blocks.BlockTable(s->id)) ++refs[b];
        }
      }
      for (BlockId b = 0; b < device_blocks; ++b) ASSERT_EQ(run.blocks.device().refcount(b), refs[b]);
      ASSERT_LE(run.blocks.host().num_used(), device_blocks);
    }
    ASSERT_TRUE(run.in_flight.empty()) << "seed " << seed;
    overlapped += run.overlapped_steps;
    steps_total += steps;
    ASSERT_EQ(run.finished.size() + run.rejected.size(), static_cast<size_t>(num_requests)) << "seed " << seed;
    ASSERT_EQ(run.blocks.device().num_free(), device_blocks);
    ASSERT_EQ(run.blocks.host().num_free(), run.blocks.host().num_blocks());
    preempt_recompute += run.scheduler.stats().num_preemptions_recompute;
    preempt_swap += run.scheduler.stats().num_preemptions_swap;
    drafts_scheduled += run.drafts_scheduled;
    drafts_accepted += run.drafts_accepted;
    drafts_rejected += run.drafts_rejected;
    drafts_dropped += run.drafts_dropped;
    all_accepted += run.all_accepted;
    none_accepted += run.none_accepted;
  }
  std::printf("preemptions: %lld by recompute, %lld by swap\n", static_cast<long long>(preempt_recompute),
              static_cast<long long>(preempt_swap));
  EXPECT_GT(preempt_recompute, 100);
  EXPECT_GT(preempt_swap, 100);
  if (in_flight) {
    std::printf("batches in flight: %lld of %lld calls scheduled a step while another was in flight\n",
                static_cast<long long>(overlapped), static_cast<long long>(steps_total));
    EXPECT_GT(overlapped, steps_total / 4);
  } else {
    EXPECT_EQ(overlapped, 0);
  }
  if (!drafts) return;
  std::printf("drafts: %lld scheduled, %lld accepted, %lld rejected; %lld verifications kept all, %lld none; "
              "%lld sequences lost drafts to preemption\n",
              static_cast<long long>(drafts_scheduled), static_cast<long long>(drafts_accepted),
              static_cast<long long>(drafts_rejected), static_cast<long long>(all_accepted),
              static_cast<long long>(none_accepted), static_cast<long long>(drafts_dropped));
  EXPECT_GT(drafts_accepted, 1000);
  EXPECT_GT(drafts_rejected, 1000);
  EXPECT_GT(all_accepted, 1000);
  EXPECT_GT(none_accepted, 1000);
  EXPECT_GT(drafts_dropped, 100);
}

TEST(SchedulerProperty, RandomWorkloadsKeepInvariantsAndFinishEveryRequest) { RunRandomWorkloads(false); }

TEST(SchedulerProperty, RandomWorkloadsWithDraftsKeepInvariantsAndFinishEveryRequest) { RunRandomWorkloads(true); }

TEST(SchedulerProperty, RandomWorkloadsWithBatchesInFlightKeepInvariantsAndFinishEveryRequest) {
  RunRandomWorkloads(false, /*in_flight=*/true);
}

}  // namespace
}  // namespace kvflow
