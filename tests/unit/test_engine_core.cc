// The engine core without a model: a scripted executor hands back several tokens per sequence per
// step (as a speculative step will), and the core appends them with its stop checks token by token:
// the first stop ends the sequence, the tokens after it are dropped, the blocks are freed.
#include <gtest/gtest.h>

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
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
             std::optional<std::span<const DeviceSampleRow>> sample_rows,
             ExecutorOutput& out) override {
    ++steps_;
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

}  // namespace
}  // namespace kvflow
