// kvflow::AsyncEngine — an Engine driven by its own thread, for servers.
//
//   auto engine = kvflow::AsyncEngine::Create({.model = "smollm2-135m"}, {}).value();
//   auto stream = engine->Submit(engine->tokenizer().Encode("Hello", true), params).value();
//   std::vector<kvflow::StreamEvent> events;
//   while (stream->Next(events, std::chrono::milliseconds(100))) { ... }
//
// Any thread may submit, read and cancel. The engine thread adds submissions and cancellations
// between steps, so a cancelled request's KV blocks are free at most one step later. Events are
// buffered per request: a slow reader never stalls the batch.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvflow/engine.h"

namespace kvflow {

class AsyncEngine;

// One request's event queue. Owned jointly by the submitter and the engine thread; it must not be
// used after its AsyncEngine is destroyed.
class RequestStream : public std::enable_shared_from_this<RequestStream> {
 public:
  using Clock = std::chrono::steady_clock;

  // Moves the events that arrived into `out` (replacing its contents), waiting up to `timeout`
  // for the first one. Returns false once the last event has been handed out (and `out` is empty).
  bool Next(std::vector<StreamEvent>& out, Clock::duration timeout);
  // Asks the engine to stop the request; its stream then ends with FinishReason::kCancelled.
  void Cancel();
  bool finished() const;

  Clock::time_point submit_time() const { return submit_time_; }
  // Zero until the first token / the last event arrived.
  Clock::time_point first_token_time() const;
  Clock::time_point finish_time() const;

 private:
  friend class AsyncEngine;
  RequestStream() : submit_time_(Clock::now()) {}
  void Push(const StreamEvent& event);  // engine thread

  const Clock::time_point submit_time_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<StreamEvent> events_;
  bool last_pushed_ = false;   // the request_finished event is queued
  bool last_taken_ = false;    // ... and was handed out
  Clock::time_point first_token_time_{};
  Clock::time_point finish_time_{};
  AsyncEngine* engine_ = nullptr;
  RequestId id_ = 0;           // engine id, once the engine thread added it
  std::atomic<bool> cancel_requested_{false};
  Status forced_error_;        // the engine failed the step: report this instead of "cancelled"
};

struct AsyncEngineOptions {
  // Requests waiting for their first step (queued here or in the scheduler) beyond which Submit
  // fails with ResourceExhausted; 0: no limit.
  int max_queue_len = 0;
};

class AsyncEngine {
 public:
  using Clock = std::chrono::steady_clock;

  // Loads the model and starts the engine thread.
  static Result<std::unique_ptr<AsyncEngine>> Create(const EngineConfig& config, const AsyncEngineOptions& options);
  ~AsyncEngine();  // cancels what is left and joins the engine thread

  // Validates and queues a request. InvalidArgument for a bad request, ResourceExhausted when the
  // queue is full, Unavailable after Shutdown began.
  Result<std::shared_ptr<RequestStream>> Submit(std::vector<int32_t> prompt_tokens, const SamplingParams& params);

  // Refuses new submissions, lets running requests finish until `deadline`, cancels the rest and
  // waits until every stream has its last event. The engine thread keeps running until destruction.
  void Drain(Clock::time_point deadline);

  // A snapshot taken by the engine thread after every step.
  EngineStats stats() const;
  // The systems' metrics derived from a snapshot (Engine::SystemMetrics); any thread.
  std::vector<SystemMetric> SystemMetrics(const EngineStats& stats) const { return engine_->SystemMetrics(stats); }
  // Requests submitted and not finished.
  int num_unfinished() const;

  const Tokenizer& tokenizer() const { return engine_->tokenizer(); }
  const ModelConfig& model_config() const { return engine_->model_config(); }
  const EngineConfig& config() const { return engine_->config(); }
  std::string Describe() const { return describe_; }

 private:
  friend class RequestStream;
  AsyncEngine(std::unique_ptr<Engine> engine, const AsyncEngineOptions& options);
  void Loop();
  void RequestCancel(std::shared_ptr<RequestStream> stream);
  void OnRequestFinished();
  void FlushWakeups();
  void NotifyLoop();

  struct Pending {
    std::vector<int32_t> prompt;
    SamplingParams params;
    std::shared_ptr<RequestStream> stream;
  };

  std::unique_ptr<Engine> engine_;  // touched only by the engine thread after Create
  const AsyncEngineOptions options_;
  const std::string describe_;

  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::deque<Pending> pending_;
  std::vector<std::shared_ptr<RequestStream>> cancels_;
  bool stop_ = false;
  bool draining_ = false;
  bool cancel_all_ = false;
  EngineStats stats_;  // the snapshot after the last step; its num_waiting bounds the queue
  int num_unfinished_ = 0;
  std::condition_variable idle_;  // signalled when num_unfinished_ drops
  std::thread thread_;

  // Streams with new events, woken by the notifier thread after each step.
  std::vector<std::shared_ptr<RequestStream>> to_wake_;  // engine thread only
  std::mutex notify_mu_;
  std::condition_variable notify_cv_;
  std::vector<std::shared_ptr<RequestStream>> notify_queue_;
  bool notifier_stop_ = false;
  std::thread notifier_;
};

}  // namespace kvflow
