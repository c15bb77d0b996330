// The OpenAI-compatible front end: routes HTTP requests to an AsyncEngine and streams the results.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "chat_template/chat_template.h"
#include "kvflow/async_engine.h"
#include "server/http_server.h"
#include "server/metrics.h"
#include "server/openai_api.h"
#include "tool_calls/tool_call_format.h"
#include "tool_calls/tool_call_parser.h"

namespace kvflow::server {

struct OpenAiServerOptions {
  std::string served_model_name;
  std::string api_key;        // empty: no authentication
  // "chatml", "llama3", or a file (Jinja, or a tokenizer_config.json); empty: the model's own.
  std::string chat_template;
  // The tool-call format (tool_calls/tool_call_format.h names), or "auto": from the chat template.
  std::string tool_call_parser = "auto";
  // The reasoning format, "none", or "auto": from the chat template.
  std::string reasoning_parser = "auto";
};

class OpenAiServer {
 public:
  // Fails when a chat template is given and cannot be read or parsed, or the model's own does not
  // parse (a model without one only makes chat requests fail).
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
  void HandleApplyTemplate(const HttpRequest& req, HttpExchange& exchange);
  // The chat template's prompt for `input`; an error when there is no template or it refuses.
  std::optional<ApiError> RenderChatPrompt(const ChatTemplateInput& input, std::string* prompt) const;
  bool StartsWithBos(const std::string& prompt) const;
  bool Authorized(const HttpRequest& req) const;
  void SendError(HttpExchange& exchange, const ApiError& error);
  std::optional<ApiError> CheckModel(const std::string& model) const;

  AsyncEngine* engine_;
  const OpenAiServerOptions options_;
  std::optional<ChatTemplate> chat_template_;
  std::string chat_template_error_;
  ToolCallFormat tool_format_ = ToolCallFormat::kGeneric;
  ReasoningFormat reasoning_format_ = ReasoningFormat::kNone;
  bool template_accepts_system_ = true;
  std::atomic<bool> shutting_down_{false};
  std::atomic<uint64_t> next_id_{1};
  int64_t created_ = 0;
  ServerMetrics metrics_;
  friend class GenerationRun;
};

}  // namespace kvflow::server
