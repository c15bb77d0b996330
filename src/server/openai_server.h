// The OpenAI-compatible front end: routes HTTP requests to an AsyncEngine and streams the results.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "engine/chat_template.h"
#include "kvflow/async_engine.h"
#include "server/http_server.h"
#include "server/metrics.h"
#include "server/openai_api.h"

namespace kvflow::server {

struct OpenAiServerOptions {
  std::string served_model_name;
  std::string api_key;        // empty: no authentication
  std::string chat_template;  // "chatml", "llama3", or template text; empty: the model's own
};

class OpenAiServer {
 public:
  // Fails when the chat template is given and not recognised (a model without one only makes
  // chat requests fail).
  static Result<std::unique_ptr<OpenAiServer>> Create(AsyncEngine* engine, const OpenAiServerOptions& options);

  void Handle(const HttpRequest& req, HttpExchange& exchange);
  // New generation requests get 503 and /health turns 503.
  void BeginShutdown() { shutting_down_.store(true); }
  ServerMetrics& metrics() { return metrics_; }

 private:
  OpenAiServer(AsyncEngine* engine, const OpenAiServerOptions& options) : engine_(engine), options_(options) {}

  void HandleCompletions(const HttpRequest& req, HttpExchange& exchange);
  void HandleChat(const HttpRequest& req, HttpExchange& exchange);
  void HandleModels(HttpExchange& exchange);
  void HandleTokenize(const HttpRequest& req, HttpExchange& exchange);
  void HandleDetokenize(const HttpRequest& req, HttpExchange& exchange);
  bool Authorized(const HttpRequest& req) const;
  void SendError(HttpExchange& exchange, const ApiError& error);
  std::optional<ApiError> CheckModel(const std::string& model) const;

  AsyncEngine* engine_;
  const OpenAiServerOptions options_;
  std::optional<ChatTemplateFamily> chat_family_;
  std::string chat_template_text_;
  std::string chat_template_error_;
  std::atomic<bool> shutting_down_{false};
  std::atomic<uint64_t> next_id_{1};
  int64_t created_ = 0;
  ServerMetrics metrics_;
  friend class GenerationRun;
};

}  // namespace kvflow::server
