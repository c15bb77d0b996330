#include "kvflow/async_engine.h"

#include <unordered_map>

#include <spdlog/spdlog.h>

namespace kvflow {

// ---- RequestStream -----------------------------------------------------------------------------

bool RequestStream::Next(std::vector<StreamEvent>& out, Clock::duration timeout) {
  out.clear();
  std::unique_lock<std::mutex> lock(mu_);
  if (last_taken_) return false;
  cv_.wait_for(lock, timeout, [&] { return !events_.empty(); });
  while (!events_.empty()) {
    out.push_back(std::move(events_.front()));
    events_.pop_front();
    if (out.back().request_finished) last_taken_ = true;
  }
  return true;
}

void RequestStream::Cancel() {
  if (cancel_requested_.exchange(true)) return;
  engine_->RequestCancel(shared_from_this());
}

bool RequestStream::finished() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_pushed_;
}

RequestStream::Clock::time_point RequestStream::first_token_time() const {
  std::lock_guard<std::mutex> lock(mu_);
  return first_token_time_;
}

RequestStream::Clock::time_point RequestStream::finish_time() const {
  std::lock_guard<std::mutex> lock(mu_);
  return finish_time_;
}

void RequestStream::Push(const StreamEvent& event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (last_pushed_) return;
    const auto now = Clock::now();
    if (!event.tokens.empty() && first_token_time_ == Clock::time_point{}) first_token_time_ = now;
    events_.push_back(event);
    if (event.request_finished) {
      StreamEvent& last = events_.back();
      if (!forced_error_.ok() && last.finish_reason == FinishReason::kCancelled) {
        last.finish_reason = FinishReason::kError;
        last.error = forced_error_;
      }
      last_pushed_ = true;
      finish_time_ = now;
    }
  }
  // The reader is woken after the step, by the notifier thread (see AsyncEngine::FlushWakeups).
  engine_->to_wake_.push_back(shared_from_this());
  if (event.request_finished) engine_->OnRequestFinished();
}

namespace {

StreamEvent FinalEvent(FinishReason reason, Status error) {
  StreamEvent e;
  e.finished = true;
  e.request_finished = true;
  e.finish_reason = reason;
  e.error = std::move(error);
  return e;
}

}  // namespace

// ---- AsyncEngine -------------------------------------------------------------------------------

Result<std::unique_ptr<AsyncEngine>> AsyncEngine::Create(const EngineConfig& config,
                                                         const AsyncEngineOptions& options) {
  if (options.max_queue_len < 0) return Status::InvalidArgument("max_queue_len must be >= 0");
  KVFLOW_ASSIGN_OR_RETURN(auto engine, Engine::Create(config));
  return std::unique_ptr<AsyncEngine>(new AsyncEngine(std::move(engine), options));
}

AsyncEngine::AsyncEngine(std::unique_ptr<Engine> engine, const AsyncEngineOptions& options)
    : engine_(std::move(engine)), options_(options), describe_(engine_->Describe()) {
  stats_ = engine_->stats();
  notifier_ = std::thread([this] { NotifyLoop(); });
  thread_ = std::thread([this] { Loop(); });
}

AsyncEngine::~AsyncEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  {
    std::lock_guard<std::mutex> lock(notify_mu_);
    notifier_stop_ = true;
  }
  notify_cv_.notify_all();
  if (notifier_.joinable()) notifier_.join();
}

// Waking a reader costs a futex call, and a step can feed hundreds of streams: the engine thread
// hands the wake-ups to this thread instead of making the next step wait for them.
void AsyncEngine::FlushWakeups() {
  if (to_wake_.empty()) return;
  {
    std::lock_guard<std::mutex> lock(notify_mu_);
    if (notify_queue_.empty()) {
      notify_queue_.swap(to_wake_);
    } else {
      notify_queue_.insert(notify_queue_.end(), to_wake_.begin(), to_wake_.end());
      to_wake_.clear();
    }
  }
  notify_cv_.notify_one();
}

void AsyncEngine::NotifyLoop() {
  std::vector<std::shared_ptr<RequestStream>> batch;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(notify_mu_);
      notify_cv_.wait(lock, [&] { return notifier_stop_ || !notify_queue_.empty(); });
      if (notify_queue_.empty()) return;  // stopping, nothing left
      batch.swap(notify_queue_);
    }
    for (const auto& stream : batch) stream->cv_.notify_all();
    batch.clear();
  }
}

Result<std::shared_ptr<RequestStream>> AsyncEngine::Submit(std::vector<int32_t> prompt_tokens,
                                                           const SamplingParams& params) {
  // Validation reads only the engine's configuration, so it runs here, on the caller's thread:
  // a bad request is refused at once instead of one step later.
  KVFLOW_RETURN_IF_ERROR(engine_->ValidateRequest(prompt_tokens, params));
  std::shared_ptr<RequestStream> stream(new RequestStream());
  stream->engine_ = this;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (draining_ || stop_) return Status::Unavailable("the server is shutting down");
    const int queued = static_cast<int>(pending_.size()) + stats_.num_waiting;
    if (options_.max_queue_len > 0 && queued >= options_.max_queue_len) {
      return Status::ResourceExhausted("the request queue is full (" + std::to_string(queued) +
                                       " requests waiting); retry later");
    }
    pending_.push_back(Pending{std::move(prompt_tokens), params, stream});
    ++num_unfinished_;
  }
  wake_.notify_all();
  return stream;
}

void AsyncEngine::RequestCancel(std::shared_ptr<RequestStream> stream) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancels_.push_back(std::move(stream));
  }
  wake_.notify_all();
}

void AsyncEngine::OnRequestFinished() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    --num_unfinished_;
  }
  idle_.notify_all();
}

void AsyncEngine::Drain(Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  draining_ = true;
  if (!idle_.wait_until(lock, deadline, [&] { return num_unfinished_ == 0; })) {
    spdlog::warn("shutdown deadline reached: cancelling {} unfinished request(s)", num_unfinished_);
    cancel_all_ = true;
    wake_.notify_all();
    idle_.wait(lock, [&] { return num_unfinished_ == 0; });
  }
}

EngineStats AsyncEngine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

int AsyncEngine::num_unfinished() const {
  std::lock_guard<std::mutex> lock(mu_);
  return num_unfinished_;
}

void AsyncEngine::Loop() {
  std::unordered_map<RequestId, std::shared_ptr<RequestStream>> live;  // added to the engine, unfinished
  std::deque<Pending> adds;
  std::vector<std::shared_ptr<RequestStream>> cancels;
  bool stopping = false;
  while (true) {
    bool cancel_all = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] {
        return stop_ || cancel_all_ || !pending_.empty() || !cancels_.empty() || engine_->HasUnfinishedRequests();
      });
      adds.swap(pending_);
      cancels.swap(cancels_);
      cancel_all = cancel_all_ || stop_;
      cancel_all_ = false;
      stopping = stop_;
    }

    for (Pending& p : adds) {
      const std::shared_ptr<RequestStream>& stream = p.stream;
      if (cancel_all || stream->cancel_requested_) {
        stream->Push(FinalEvent(FinishReason::kCancelled, Status::Cancelled("cancelled before it started")));
        continue;
      }
      auto id = engine_->AddRequest(std::move(p.prompt), p.params, [stream](const StreamEvent& e) { stream->Push(e); });
      if (!id.ok()) {
        stream->Push(FinalEvent(FinishReason::kError, id.status()));
        continue;
      }
      stream->id_ = id.value();
      live.emplace(id.value(), stream);
    }
    adds.clear();
    if (cancel_all) {
      for (auto& [id, stream] : live) cancels.push_back(stream);
    }
    for (const auto& stream : cancels) {
      if (stream->id_ != 0 && live.count(stream->id_)) (void)engine_->Cancel(stream->id_);
    }
    cancels.clear();
    FlushWakeups();  // refusals and cancellations need not wait for the step

    if (engine_->HasUnfinishedRequests()) {
      auto step = engine_->Step();
      if (!step.ok()) {
        // The backend failed: fail what is running rather than retrying a step that may keep failing.
        spdlog::error("engine step failed: {}; failing {} request(s)", step.status().ToString(), live.size());
        for (auto& [id, stream] : live) {
          {
            std::lock_guard<std::mutex> lock(stream->mu_);
            stream->forced_error_ = step.status();
          }
          (void)engine_->Cancel(id);
        }
      }
    }
    for (auto it = live.begin(); it != live.end();) {
      it = it->second->finished() ? live.erase(it) : std::next(it);
    }
    FlushWakeups();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stats_ = engine_->stats();
    }
    if (stopping && !engine_->HasUnfinishedRequests()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (pending_.empty()) break;
    }
  }
}

}  // namespace kvflow
