// The engine core without a model: a scripted executor hands back several tokens per sequence per
// step (as a speculative step will), and the core appends them with its stop checks token by token:
// the first stop ends the sequence, the tokens after it are dropped, the blocks are freed.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine_core.h"
#include "model/tiny_random.h"

namespace kvflow {
namespace {

// Samples every row itself: each step gives a sequence the next `per_step` tokens of its request's
// script.
class ScriptedExecutor final : public Executor {
 public:
  explicit ScriptedExecutor(int per_step) : per_step_(per_step) {}
  void Script(RequestId id, std::vector<int32_t> tokens) { scripts_[id].assign(tokens.begin(), tokens.end()); }

  bool SupportsSampling() const override { return true; }
  Status MoveBlocks(const SchedulerOutput&) override { return Status::Ok(); }
  Status Run(const SchedulerOutput& sched, std::span<const LogitsMode>,
             const DeviceSampling* sampling, ExecutorOutput& out) override {
    ++steps_;
    if (on_run) on_run(sampling);
    for (const ScheduledSeq& s : sched.scheduled) {
      if (!s.needs_logits) continue;
      std::deque<int32_t>& script = scripts_[s.group->request_id];
      std::vector<SampledToken> tokens;
      for (int i = 0; i < per_step_ && !script.empty(); ++i) {
        SampledToken t;
        t.token = script.front();
        t.logprob = -0.5f;
        script.pop_front();
        tokens.push_back(t);
      }
      out.sampled.push_back(std::move(tokens));
    }
    return Status::Ok();
  }
  int steps() const { return steps_; }
  // Called at the start of each Run, as a backend's forward pass would start.
  std::function<void(const DeviceSampling*)> on_run;

 private:
  int per_step_;
  int steps_ = 0;
  std::map<RequestId, std::deque<int32_t>> scripts_;
};

struct Completion {
  std::vector<int32_t> tokens;
  std::string text;
  int events = 0;
  FinishReason finish = FinishReason::kNone;
  bool request_finished = false;
};

EngineCoreConfig SmallCore() {
  EngineCoreConfig c;
  c.scheduler.max_model_len = 64;
  c.blocks.block_size = 4;
  c.blocks.num_device_blocks = 64;
  c.vocab_size = 256;
  c.eos_token_ids = {2};
  return c;
}

class EngineCoreTest : public ::testing::Test {
 protected:
  void Make(EngineCoreConfig config, const Tokenizer* tokenizer = nullptr) {
    core_ = std::make_unique<EngineCore>(config, MakeSchedulingPolicy("paged").value(), nullptr, tokenizer);
  }
  RequestId Add(const SamplingParams& p, std::vector<int32_t> script, const RequestHints& hints = {}) {
    auto id = core_->AddRequest({5, 6, 7}, p, [this](const StreamEvent& e) {
      Completion& c = out_[e.id];
      ++c.events;
      for (const SampledToken& t : e.tokens) c.tokens.push_back(t.token);
      c.text += e.text_delta;
      if (e.finished) c.finish = e.finish_reason;
      c.request_finished = c.request_finished || e.request_finished;
      if (on_event_) on_event_(e);
    }, hints, 0.0);
    EXPECT_TRUE(id.ok()) << id.status().ToString();
    executor_.Script(id.value(), std::move(script));
    return id.value();
  }
  void RunToEnd() {
    for (int i = 0; i < 100 && core_->HasUnfinishedRequests(); ++i) ASSERT_TRUE(core_->Step(executor_).ok());
    EXPECT_FALSE(core_->HasUnfinishedRequests());
    const EngineStats s = core_->stats();
    EXPECT_EQ(s.kv_blocks_free, s.kv_blocks_total) << "blocks leaked";
  }

  ScriptedExecutor executor_{3};
  std::function<void(const StreamEvent&)> on_event_;  // called from every request's callback
  std::unique_ptr<EngineCore> core_;
  std::map<RequestId, Completion> out_;
};

SamplingParams Params(int max_tokens) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = max_tokens;
  return p;
}

TEST_F(EngineCoreTest, SeveralTokensPerStepStopAtTheFirstStop) {
  Make(SmallCore());
  SamplingParams stop_ids = Params(20);
  stop_ids.stop_token_ids = {9};
  const RequestId eos = Add(Params(20), {10, 11, 12, 13, 2, 14, 15});  // EOS in the second step
  const RequestId length = Add(Params(5), {10, 11, 12, 13, 14, 15, 16});
  const RequestId stop = Add(stop_ids, {10, 9, 11, 12});
  SamplingParams ignore = Params(6);
  ignore.ignore_eos = true;
  const RequestId ignored = Add(ignore, {2, 2, 2, 2, 2, 2, 2, 2});
  RunToEnd();
  EXPECT_EQ(out_[eos].tokens, (std::vector<int32_t>{10, 11, 12, 13, 2}));
  EXPECT_EQ(out_[eos].finish, FinishReason::kEos);
  EXPECT_EQ(out_[eos].events, 2);
  EXPECT_EQ(out_[length].tokens, (std::vector<int32_t>{10, 11, 12, 13, 14}));
  EXPECT_EQ(out_[length].finish, FinishReason::kLength);
  EXPECT_EQ(out_[stop].tokens, (std::vector<int32_t>{10, 9}));
  EXPECT_EQ(out_[stop].finish, FinishReason::kStop);
  EXPECT_EQ(out_[ignored].tokens.size(), 6u);
  EXPECT_EQ(out_[ignored].finish, FinishReason::kLength);
  for (RequestId id : {eos, length, stop, ignored}) EXPECT_TRUE(out_[id].request_finished);
  EXPECT_EQ(core_->stats().generated_tokens, 5 + 5 + 2 + 6);
}

TEST_F(EngineCoreTest, MaxModelLenAndHiddenMaxTokens) {
  EngineCoreConfig c = SmallCore();
  c.scheduler.max_model_len = 10;  // the prompt has 3 tokens: 7 fit
  Make(c);
  std::vector<int32_t> long_script(20, 20);
  const RequestId cut = Add(Params(50), long_script);
  // A trace replay: max_tokens is the true length, which the scheduler does not see.
  RequestHints hints;
  hints.true_output_len = 4;
  hints.hide_max_tokens = true;
  const RequestId replay = Add(Params(4), long_script, hints);
  RunToEnd();
  EXPECT_EQ(out_[cut].tokens.size(), 7u);
  EXPECT_EQ(out_[cut].finish, FinishReason::kLength);
  EXPECT_EQ(out_[replay].tokens.size(), 4u);
}

TEST_F(EngineCoreTest, StopStringsCutTheTextAcrossTokensOfOneStep) {
  auto model = MakeTinyRandomModel();
  ASSERT_TRUE(model.ok());
  const Tokenizer& tok = *model->tokenizer;
  EngineCoreConfig c = SmallCore();
  c.vocab_size = tok.vocab_size();
  Make(c, &tok);
  SamplingParams p = Params(30);
  p.ignore_eos = true;
  p.stop = {"lo w"};
  const std::vector<int32_t> script = tok.Encode("hello world and more", false);
  ASSERT_GT(script.size(), 4u);
  const RequestId id = Add(p, script);
  RunToEnd();
  EXPECT_EQ(out_[id].finish, FinishReason::kStop);
  EXPECT_EQ(out_[id].text, "hel");
  EXPECT_LT(out_[id].tokens.size(), script.size()) << "the tokens after the stop are dropped";
}

TEST_F(EngineCoreTest, WithoutATokenizerStopStringsAreRefused) {
  Make(SmallCore());
  SamplingParams p = Params(4);
  p.stop = {"x"};
  EXPECT_EQ(core_->ValidateRequest({1, 2}, p).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(core_->ValidateRequest({1, 999}, Params(4)).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(core_->ValidateRequest({1, 2}, Params(4)).ok());
}

TEST_F(EngineCoreTest, CancelDuringAStepTakesEffectWhenTheStepEnds) {
  Make(SmallCore());
  const RequestId a = Add(Params(20), std::vector<int32_t>(20, 10));
  const RequestId b = Add(Params(20), std::vector<int32_t>(20, 10));
  on_event_ = [&](const StreamEvent& e) {
    if (e.id != b || out_[b].events != 2) return;
    ASSERT_TRUE(core_->Cancel(a).ok());  // from a callback, i.e. inside Step()
    EXPECT_EQ(out_[a].finish, FinishReason::kNone);
  };
  ASSERT_TRUE(core_->Step(executor_).ok());
  ASSERT_TRUE(core_->Step(executor_).ok());
  EXPECT_EQ(out_[a].finish, FinishReason::kCancelled);
  EXPECT_EQ(core_->Cancel(a).code(), StatusCode::kNotFound);
  RunToEnd();
  EXPECT_EQ(out_[b].finish, FinishReason::kLength);
  EXPECT_EQ(out_[b].tokens.size(), 20u);
  EXPECT_EQ(out_[a].tokens.size(), 6u);
}

// A costly constraint (a grammar's mask) is computed on a helper thread while the forward pass runs.
// The executor signals that its forward pass is queued, then awaits the constraints as a device
// sampler does; the processor's Prepare waits for that signal, which it would wait for in vain if
// the engine computed the constraints before the forward pass. Its ban reaches every row.
class ForwardLatchProcessor final : public LogitsProcessor {
 public:
  const char* name() const override { return "forward latch"; }
  bool Costly(const SamplingParams&) const override { return true; }
  void Prepare(std::span<const LogitsContext> rows) const override {
    std::unique_lock<std::mutex> lock(mu);
    saw_forward.push_back(cv.wait_for(lock, std::chrono::seconds(5), [this] { return forward_queued; }));
    prepare_threads.push_back(std::this_thread::get_id());
    forward_queued = false;
  }
  void Constrain(const LogitsContext&, TokenConstraint& constraint) const override { constraint.Ban(13); }
  void ForwardQueued() {
    std::lock_guard<std::mutex> lock(mu);
    forward_queued = true;
    cv.notify_all();
  }

  mutable std::mutex mu;
  mutable std::condition_variable cv;
  mutable bool forward_queued = false;
  mutable std::vector<bool> saw_forward;
  mutable std::vector<std::thread::id> prepare_threads;
};

TEST_F(EngineCoreTest, CostlyConstraintsAreComputedWhileTheForwardPassRuns) {
  ForwardLatchProcessor latch;
  EngineCoreConfig c = SmallCore();
  c.logits_processors = {&latch};
  Make(c);
  int rows_seen = 0, rows_banning = 0;
  executor_.on_run = [&](const DeviceSampling* sampling) {
    ASSERT_NE(sampling, nullptr);
    latch.ForwardQueued();
    ASSERT_TRUE(sampling->await_constraints) << "costly constraints are awaited, not computed before the step";
    sampling->await_constraints();
    for (const DeviceSampleRow& row : sampling->rows) {
      ++rows_seen;
      if (row.constraint != nullptr && !row.constraint->Allows(13)) ++rows_banning;
    }
  };
  Add(Params(6), {10, 11, 12, 14, 15, 16});
  Add(Params(6), {20, 21, 22, 23, 24, 25});
  RunToEnd();
  ASSERT_FALSE(latch.saw_forward.empty());
  for (size_t i = 0; i < latch.saw_forward.size(); ++i) {
    EXPECT_TRUE(latch.saw_forward[i]) << "step " << i << ": the constraints were computed before the forward pass";
    EXPECT_NE(latch.prepare_threads[i], std::this_thread::get_id()) << "step " << i;
  }
  EXPECT_GT(rows_seen, 0);
  EXPECT_EQ(rows_banning, rows_seen);
}

}  // namespace
}  // namespace kvflow
