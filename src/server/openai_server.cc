#include "server/openai_server.h"

#include <chrono>
#include <ctime>
#include <fstream>
#include <random>
#include <set>
#include <thread>
#include <sstream>

#include <spdlog/spdlog.h>

#include "model/utf8.h"
#include "structured_output/grammar_compiler.h"
#include "tool_calls/tool_call_constraint.h"

namespace kvflow::server {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsBetween(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// Compares in time that depends only on the expected key's length.
bool ConstantTimeEquals(std::string_view given, std::string_view expected) {
  unsigned diff = given.size() != expected.size();
  for (size_t i = 0; i < expected.size(); ++i) {
    diff |= static_cast<unsigned char>(i < given.size() ? given[i] : 0) ^ static_cast<unsigned char>(expected[i]);
  }
  return diff == 0;
}

std::string RandomHex() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(rng()));
  return buf;
}

ApiError ErrorFromStatus(const Status& s) {
  ApiError e;
  e.message = s.message();
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfMemory:  // a request that can never fit the KV cache
    case StatusCode::kUnsupported:
      e.status = 400;
      break;
    case StatusCode::kResourceExhausted:
      e.status = 503;
      e.type = "service_unavailable_error";
      e.code = "queue_full";
      break;
    case StatusCode::kUnavailable:
      e.status = 503;
      e.type = "service_unavailable_error";
      e.code = "shutting_down";
      break;
    default:
      e.status = 500;
      e.type = "server_error";
      e.message = s.ToString();
  }
  return e;
}

// A request the engine accepted and then failed: the server's failure, not the client's.
ApiError EngineFailure(const Status& s) {
  ApiError e;
  e.status = 500;
  e.type = "server_error";
  e.message = s.ok() ? "the request failed in the engine" : s.ToString();
  return e;
}

std::string SseEvent(const Json& json) { return "data: " + DumpJson(json) + "\n\n"; }

}  // namespace

Result<std::unique_ptr<OpenAiServer>> OpenAiServer::Create(AsyncEngine* engine, const OpenAiServerOptions& options) {
  std::unique_ptr<OpenAiServer> server(new OpenAiServer(engine, options));
  server->created_ = static_cast<int64_t>(std::time(nullptr));
  const Tokenizer& tok = engine->tokenizer();
  std::string source;
  const bool explicit_template = !options.chat_template.empty();
  if (explicit_template) {
    auto read = ChatTemplate::ReadSource(options.chat_template);
    if (!read.ok()) return Status(read.status().code(), "--chat-template: " + read.status().message());
    source = std::move(read.value());
  } else {
    source = tok.chat_template();
  }
  if (source.empty()) {
    server->chat_template_error_ = "the model has no chat template; start the server with --chat-template";
    spdlog::warn("{}: /v1/chat/completions will refuse requests", server->chat_template_error_);
    return server;
  }
  auto chat_template = ChatTemplate::Create(source, tok);
  if (!chat_template.ok()) {
    return Status(chat_template.status().code(), (explicit_template ? "--chat-template: " : "the model's chat template: ") +
                                                     chat_template.status().message() +
                                                     (explicit_template ? "" : "; pass --chat-template chatml|llama3|FILE"));
  }
  server->chat_template_.emplace(std::move(chat_template.value()));
  spdlog::info("chat template: {} ({} bytes of Jinja)", explicit_template ? options.chat_template : "the model's own",
               server->chat_template_->source().size());
  if (options.tool_call_parser == "auto") {
    server->tool_format_ = DetectToolCallFormat(source);
  } else {
    auto format = ToolCallFormatFromName(options.tool_call_parser);
    if (!format.ok()) return Status::InvalidArgument("--tool-call-parser: " + format.status().message());
    server->tool_format_ = format.value();
  }
  if (options.reasoning_parser == "auto") {
    server->reasoning_format_ = DetectReasoningFormat(source);
  } else {
    auto format = ReasoningFormatFromName(options.reasoning_parser);
    if (!format.ok()) return Status::InvalidArgument("--reasoning-parser: " + format.status().message());
    server->reasoning_format_ = format.value();
  }
  server->template_accepts_system_ = TemplateAcceptsSystemRole(source);
  spdlog::info("tool calls: {} format ({}){}; reasoning: {}", ToolCallFormatName(server->tool_format_),
               options.tool_call_parser == "auto" ? "from the chat template" : "--tool-call-parser",
               server->tool_format_ == ToolCallFormat::kGeneric && !TemplateReadsTools(source)
                   ? ", the tools told in a system message"
                   : "",
               ReasoningFormatName(server->reasoning_format_));
  return server;
}

bool OpenAiServer::Authorized(const HttpRequest& req) const {
  if (options_.api_key.empty()) return true;
  const std::string* auth = req.Header("authorization");
  if (!auth || auth->size() < 7 || auth->compare(0, 7, "Bearer ") != 0) return false;
  return ConstantTimeEquals(std::string_view(*auth).substr(7), options_.api_key);
}

void OpenAiServer::SendError(HttpExchange& exchange, const ApiError& error) {
  HttpResponse r{error.status, "application/json", error.ToJson(), {}};
  if (error.status == 503) r.headers.emplace_back("Retry-After", "1");
  if (error.status == 401) r.headers.emplace_back("WWW-Authenticate", "Bearer");
  exchange.Send(r);
}

std::optional<ApiError> OpenAiServer::CheckModel(const std::string& model) const {
  if (model.empty() || model == options_.served_model_name) return std::nullopt;
  ApiError e;
  e.status = 404;
  e.message = "The model `" + model + "` does not exist; this server serves `" + options_.served_model_name + "`.";
  e.param = "model";
  e.code = "model_not_found";
  return e;
}

void OpenAiServer::Handle(const HttpRequest& req, HttpExchange& exchange) {
  const std::string& path = req.path;
  auto method_not_allowed = [&](const char* allow) {
    ApiError e = InvalidRequest("method " + req.method + " is not allowed on " + path);
    e.status = 405;
    exchange.Send(HttpResponse{405, "application/json", e.ToJson(), {{"Allow", allow}}});
  };
  if (path == "/health") {
    if (req.method != "GET" && req.method != "HEAD") return method_not_allowed("GET");
    exchange.Send(HttpResponse{shutting_down_.load() ? 503 : 200, "", "", {}});
    return;
  }
  if (path == "/metrics") {
    if (req.method != "GET") return method_not_allowed("GET");
    const EngineStats stats = engine_->stats();
    exchange.Send(HttpResponse{200, "text/plain; version=0.0.4; charset=utf-8",
                               metrics_.Render(stats, engine_->SystemMetrics(stats)), {}});
    return;
  }
  if (path == "/version") {
    if (req.method != "GET") return method_not_allowed("GET");
    exchange.Send(HttpResponse{200, "application/json", R"({"version":"0.1.0"})", {}});
    return;
  }
  if (path == "/tokenize" || path == "/detokenize" || path == "/apply-template") {
    // vLLM's and llama.cpp's, outside /v1 as there.
    if (req.method != "POST") return method_not_allowed("POST");
    if (path == "/apply-template") return HandleApplyTemplate(req, exchange);
    return path == "/tokenize" ? HandleTokenize(req, exchange) : HandleDetokenize(req, exchange);
  }
  if (path.rfind("/v1/", 0) == 0 && !Authorized(req)) {
    ApiError e;
    e.status = 401;
    e.type = "authentication_error";
    e.code = "invalid_api_key";
    e.message = "Incorrect or missing API key: send 'Authorization: Bearer <key>'";
    return SendError(exchange, e);
  }
  if (path == "/v1/models") {
    if (req.method != "GET") return method_not_allowed("GET");
    return HandleModels(exchange);
  }
  if (path == "/v1/completions" || path == "/v1/chat/completions") {
    if (req.method != "POST") return method_not_allowed("POST");
    if (shutting_down_.load()) return SendError(exchange, ErrorFromStatus(Status::Unavailable("the server is shutting down")));
    ++metrics_.in_flight();
    if (path == "/v1/completions") {
      HandleCompletions(req, exchange);
    } else {
      HandleChat(req, exchange);
    }
    --metrics_.in_flight();
    return;
  }
  ApiError e = InvalidRequest("no route for " + req.method + " " + path);
  e.status = 404;
  SendError(exchange, e);
}

void OpenAiServer::HandleModels(HttpExchange& exchange) {
  Json model{{"id", options_.served_model_name},
             {"object", "model"},
             {"created", created_},
             {"owned_by", "kvflow"},
             {"root", engine_->config().model},
             {"max_model_len", engine_->config().max_model_len}};
  exchange.Send(HttpResponse{200, "application/json", DumpJson(Json{{"object", "list"}, {"data", Json::array({model})}}), {}});
}

void OpenAiServer::HandleTokenize(const HttpRequest& req, HttpExchange& exchange) {
  TokenizeRequest request;
  if (auto error = ParseTokenizeRequest(req.body, &request)) return SendError(exchange, *error);
  if (auto error = CheckModel(request.model)) return SendError(exchange, *error);
  const Tokenizer& tok = engine_->tokenizer();
  std::vector<int32_t> ids;
  if (request.chat) {
    std::string text;
    if (auto error = RenderChatPrompt(request.chat_input, &text)) return SendError(exchange, *error);
    ids = tok.Encode(text, request.add_special && tok.add_bos() && !StartsWithBos(text));
  } else {
    ids = tok.Encode(request.text, request.add_special && tok.add_bos());
  }
  Json tokens = Json::array();
  for (int32_t id : ids) {
    if (!request.with_pieces) {
      tokens.push_back(id);
      continue;
    }
    // llama.cpp's pieces: the token's text, or its bytes where they are not valid UTF-8 alone.
    const std::string piece = tok.TokenBytes(id, /*skip_special=*/false);
    Json entry{{"id", id}};
    if (IsValidUtf8(piece)) {
      entry["piece"] = piece;
    } else {
      Json bytes = Json::array();
      for (unsigned char c : piece) bytes.push_back(static_cast<int>(c));
      entry["piece"] = std::move(bytes);
    }
    tokens.push_back(std::move(entry));
  }
  Json out{{"count", ids.size()}, {"max_model_len", engine_->config().max_model_len}, {"tokens", std::move(tokens)}};
  exchange.Send(HttpResponse{200, "application/json", DumpJson(out), {}});
}

std::optional<ApiError> OpenAiServer::RenderChatPrompt(const ChatTemplateInput& input, std::string* prompt) const {
  if (!chat_template_) return InvalidRequest(chat_template_error_, "messages");
  auto rendered = chat_template_->Render(input);
  if (!rendered.ok()) return InvalidRequest("the chat template refused the conversation: " + rendered.status().message(), "messages");
  *prompt = std::move(rendered.value());
  return std::nullopt;
}

bool OpenAiServer::StartsWithBos(const std::string& prompt) const {
  const std::string& bos = chat_template_ ? chat_template_->bos_token() : std::string();
  return !bos.empty() && prompt.compare(0, bos.size(), bos) == 0;
}

void OpenAiServer::HandleApplyTemplate(const HttpRequest& req, HttpExchange& exchange) {
  ChatTemplateInput input;
  if (auto error = ParseApplyTemplateRequest(req.body, &input)) return SendError(exchange, *error);
  std::string prompt;
  if (auto error = RenderChatPrompt(input, &prompt)) return SendError(exchange, *error);
  exchange.Send(HttpResponse{200, "application/json", DumpJson(Json{{"prompt", prompt}}), {}});
}

void OpenAiServer::HandleDetokenize(const HttpRequest& req, HttpExchange& exchange) {
  DetokenizeRequest request;
  if (auto error = ParseDetokenizeRequest(req.body, &request)) return SendError(exchange, *error);
  if (auto error = CheckModel(request.model)) return SendError(exchange, *error);
  const Tokenizer& tok = engine_->tokenizer();
  for (size_t i = 0; i < request.tokens.size(); ++i) {
    const int32_t id = request.tokens[i];
    if (id < 0 || id >= tok.vocab_size()) {
      return SendError(exchange, InvalidRequest("tokens[" + std::to_string(i) + "] = " + std::to_string(id) +
                                                    " is not a token id of this model (vocabulary of " +
                                                    std::to_string(tok.vocab_size()) + ")",
                                                "tokens"));
    }
  }
  // Special tokens as text, as both servers return them (HF's decode and llama.cpp's default).
  const std::string text = tok.Decode(request.tokens, /*skip_special=*/false);
  // vLLM answers "prompt", llama.cpp "content": both, so either client reads its own.
  exchange.Send(HttpResponse{200, "application/json", DumpJson(Json{{"prompt", text}, {"content", text}}), {}});
}

// ---- one generation request, from submission to the last byte ---------------------------------

struct PromptJob {
  std::vector<int32_t> tokens;
  std::string echo_text;  // the prompt, when echo is on
};

// How a chat response's text is read back into an assistant message: reasoning, content and, when
// the request has tools, tool calls in the model's format.
struct ChatOutputParsing {
  bool active = false;
  ToolCallFormat format = ToolCallFormat::kGeneric;
  ToolParseOptions options;
};

// OpenAI's message.tool_calls entry; `id` is the format's own where it carries one.
Json ToolCallJson(const ParsedToolCall& call) {
  return Json{{"id", call.id.empty() ? "call_" + RandomHex() : call.id},
              {"type", "function"},
              {"function", {{"name", call.name}, {"arguments", call.arguments}}}};
}

class GenerationRun {
 public:
  GenerationRun(OpenAiServer& server, HttpExchange& exchange, bool chat, ChatOutputParsing parsing = {})
      : server_(server), exchange_(exchange), chat_(chat), parsing_(std::move(parsing)), start_(Clock::now()) {}

  // Everything after parsing: length checks, submission, waiting, the response.
  void Run(std::vector<PromptJob> jobs, const GenerationRequest& request, bool echo, bool want_logprobs) {
    SamplingParams params = request.sampling;
    // max_tokens 0 was allowed by the parser: only the prompt (echoed or scored) comes back.
    const int64_t min_new_tokens = request.max_tokens_given && params.max_tokens == 0 ? 0 : 1;
    const int64_t max_len = server_.engine_->config().max_model_len;
    if (chat_ && !request.max_tokens_given) {  // chat's default: the rest of the context
      int64_t longest = 0;
      for (const PromptJob& job : jobs) longest = std::max<int64_t>(longest, static_cast<int64_t>(job.tokens.size()));
      params.max_tokens = static_cast<int>(max_len - longest);
    }
    for (const PromptJob& job : jobs) {
      const int64_t prompt_len = static_cast<int64_t>(job.tokens.size());
      const int64_t max_tokens = params.max_tokens;
      if (prompt_len + std::max(max_tokens, min_new_tokens) > max_len) {
        return Fail(InvalidRequest("This model's maximum context length is " + std::to_string(max_len) +
                                       " tokens. However, you requested " + std::to_string(prompt_len + max_tokens) +
                                       " tokens (" + std::to_string(prompt_len) + " in the " +
                                       (chat_ ? "messages" : "prompt") + ", " + std::to_string(max_tokens) +
                                       " in the completion). Please reduce the length of the " +
                                       (chat_ ? "messages" : "prompt") + " or completion.",
                                   chat_ ? "messages" : "prompt"));
      }
    }
    n_ = params.n;
    logprobs_ = want_logprobs;
    echo_logprobs_ = echo && want_logprobs && !chat_;
    top_logprobs_ = params.logprobs;
    prompt_logprobs_field_ = request.prompt_logprobs;
    stream_ = request.stream;
    include_usage_ = request.include_usage;
    prompts_.resize(jobs.size());
    for (size_t i = 0; i < jobs.size(); ++i) {
      PromptJob& job = jobs[i];
      prompt_tokens_ += static_cast<int64_t>(job.tokens.size());
      prompts_[i].length = job.tokens.size();
      if (echo_logprobs_) prompts_[i].tokens = job.tokens;
      echo_texts_.push_back(echo ? job.echo_text : "");
      auto stream = server_.engine_->Submit(std::move(job.tokens), params);
      if (!stream.ok()) {
        for (auto& s : streams_) s->Cancel();
        return Fail(ErrorFromStatus(stream.status()));
      }
      streams_.push_back(stream.value());
    }
    choices_.resize(streams_.size() * static_cast<size_t>(n_));
    if (chat_ && parsing_.active) {
      for (size_t k = 0; k < choices_.size(); ++k) parsers_.emplace_back(parsing_.format, parsing_.options);
      tool_calls_sent_.assign(choices_.size(), 0);
    }
    id_ = (chat_ ? "chatcmpl-" : "cmpl-") + RandomHex();
    if (stream_) {
      Stream();
    } else {
      Collect();
    }
  }

 private:
  // What the engine tells once per prompt: its prompt logprobs, with the request's first event.
  struct Prompt {
    size_t length = 0;
    std::vector<int32_t> tokens;  // kept for echo with logprobs
    bool first_event = false;     // the request's first event has come
    std::vector<SampledToken> logprobs;
    bool prelude_sent = false;    // streaming: the echo / role chunks of its choices went out
  };

  struct Choice {
    std::string text;
    std::vector<SampledToken> tokens;
    FinishReason finish = FinishReason::kNone;
    bool finished = false;
    Status error;
  };

  void Fail(const ApiError& e) { server_.SendError(exchange_, e); }

  Json Envelope() const {
    return Json{{"id", id_},
                {"object", chat_ ? (stream_ ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
                {"created", created_},
                {"model", server_.options_.served_model_name}};
  }

  Json Usage() const {
    return Json{{"prompt_tokens", prompt_tokens_},
                {"completion_tokens", completion_tokens_},
                {"total_tokens", prompt_tokens_ + completion_tokens_}};
  }

  // Applies one event; returns the choice's global index.
  size_t Apply(size_t prompt_index, const StreamEvent& e) {
    const size_t index = prompt_index * static_cast<size_t>(n_) + static_cast<size_t>(std::max(0, e.index));
    Choice& c = choices_.at(index);
    Prompt& prompt = prompts_.at(prompt_index);
    if (!prompt.first_event) {
      prompt.first_event = true;
      prompt.logprobs = e.prompt_logprobs;
    }
    c.text += e.text_delta;
    c.tokens.insert(c.tokens.end(), e.tokens.begin(), e.tokens.end());
    completion_tokens_ += static_cast<int64_t>(e.tokens.size());
    if (e.finished || e.request_finished) {
      c.finished = true;
      c.finish = e.finish_reason;
      c.error = e.error;
    }
    return index;
  }

  // Waits for events from any of the streams and applies them to the choices; returns them with
  // their choice index. False when all streams have ended, or when the client has gone (then
  // everything is cancelled).
  bool NextEvents(std::vector<std::pair<size_t, StreamEvent>>* out) {
    out->clear();
    std::vector<StreamEvent> events;
    while (true) {
      // Events may keep coming while nobody reads them: look at the connection regularly anyway.
      if (const auto now = Clock::now(); now - last_client_check_ > std::chrono::milliseconds(50)) {
        last_client_check_ = now;
        if (exchange_.ClientGone()) {
          CancelAll("client disconnected");
          return false;
        }
      }
      bool any_open = false;
      for (size_t i = 0; i < streams_.size(); ++i) {
        if (done_streams_.count(i)) continue;
        any_open = true;
        const auto wait = streams_.size() == 1 ? std::chrono::milliseconds(50) : std::chrono::milliseconds(0);
        if (!streams_[i]->Next(events, wait)) {
          done_streams_.insert(i);
          continue;
        }
        bool finished = false;
        for (StreamEvent& e : events) {
          finished |= e.request_finished;
          const size_t k = Apply(i, e);
          out->emplace_back(k, std::move(e));
        }
        if (finished) {
          done_streams_.insert(i);
          Finished(i);
        }
      }
      if (!out->empty()) return true;
      if (!any_open) return false;
      if (streams_.size() > 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  void Finished(size_t stream_index) {
    const RequestStream& s = *streams_[stream_index];
    int64_t tokens = 0;
    FinishReason reason = FinishReason::kNone;
    for (int j = 0; j < n_; ++j) {
      const Choice& c = choices_[stream_index * static_cast<size_t>(n_) + static_cast<size_t>(j)];
      tokens += static_cast<int64_t>(c.tokens.size());
      if (j == 0) reason = c.finish;
    }
    if (reason == FinishReason::kError) {
      server_.metrics_.RecordFailure();
    } else if (reason == FinishReason::kCancelled) {
      server_.metrics_.RecordCancelled();
    } else {
      const double ttft = s.first_token_time() == Clock::time_point{} ? 0.0 : SecondsBetween(start_, s.first_token_time());
      server_.metrics_.RecordRequest(ttft, SecondsBetween(start_, s.finish_time()), tokens / n_,
                                     OpenAiFinishReason(reason));
    }
  }

  void CancelAll(const char* why) {
    spdlog::debug("{}: {}; cancelling", id_, why);
    for (size_t i = 0; i < streams_.size(); ++i) {
      if (done_streams_.count(i)) continue;
      streams_[i]->Cancel();
      server_.metrics_.RecordCancelled();
    }
  }

  Json CompletionLogprobsFor(const std::vector<SampledToken>& tokens, size_t offset) const {
    return logprobs_ ? CompletionLogprobs(server_.engine_->tokenizer(), tokens, offset) : Json(nullptr);
  }

  // The engine scored every prompt token after the first (not so when the request was cut short).
  bool PromptScored(size_t prompt_index) const {
    const Prompt& p = prompts_[prompt_index];
    return p.first_event && p.logprobs.size() + 1 == p.length;
  }

  // With echo and logprobs: the logprobs of the echoed prompt (null when they never came).
  Json EchoLogprobsFor(size_t prompt_index) const {
    if (!PromptScored(prompt_index)) return nullptr;
    const Prompt& p = prompts_[prompt_index];
    return EchoLogprobs(server_.engine_->tokenizer(), p.tokens, p.logprobs, top_logprobs_, echo_texts_[prompt_index]);
  }

  // vLLM's prompt_logprobs field, when asked for.
  Json PromptLogprobsFor(size_t prompt_index) const {
    if (!PromptScored(prompt_index)) return nullptr;
    return PromptLogprobs(server_.engine_->tokenizer(), prompts_[prompt_index].logprobs, *prompt_logprobs_field_);
  }

  void Collect() {
    std::vector<std::pair<size_t, StreamEvent>> events;
    while (NextEvents(&events)) {  // NextEvents applies them to choices_
    }
    if (exchange_.ClientGone()) return;
    Json choices = Json::array();
    for (size_t k = 0; k < choices_.size(); ++k) {
      const Choice& c = choices_[k];
      if (c.finish == FinishReason::kError) {
        return Fail(EngineFailure(c.error));
      }
      if (c.finish == FinishReason::kCancelled) {
        return Fail(ErrorFromStatus(Status::Unavailable("the server is shutting down; the request was cancelled")));
      }
      Json choice{{"index", k}};
      const std::string& echo = echo_texts_[k / static_cast<size_t>(n_)];
      std::string finish = OpenAiFinishReason(c.finish);
      if (chat_ && parsing_.active) {
        const ParsedAssistant parsed = ParseAssistantOutput(parsing_.format, c.text, parsing_.options);
        Json message{{"role", "assistant"}};
        message["content"] = parsed.content.empty() && !parsed.tool_calls.empty() ? Json(nullptr) : Json(parsed.content);
        if (!parsed.reasoning_content.empty()) message["reasoning_content"] = parsed.reasoning_content;
        if (!parsed.tool_calls.empty()) {
          Json calls = Json::array();
          for (const ParsedToolCall& call : parsed.tool_calls) calls.push_back(ToolCallJson(call));
          message["tool_calls"] = std::move(calls);
          if (finish == "stop") finish = "tool_calls";
        }
        choice["message"] = std::move(message);
        choice["logprobs"] = logprobs_ ? ChatLogprobs(server_.engine_->tokenizer(), c.tokens) : Json(nullptr);
      } else if (chat_) {
        choice["message"] = Json{{"role", "assistant"}, {"content", c.text}};
        choice["logprobs"] = logprobs_ ? ChatLogprobs(server_.engine_->tokenizer(), c.tokens) : Json(nullptr);
      } else {
        choice["text"] = echo + c.text;
        Json logprobs = CompletionLogprobsFor(c.tokens, echo.size());
        if (echo_logprobs_) {
          Json prompt_part = EchoLogprobsFor(k / static_cast<size_t>(n_));
          if (!prompt_part.is_null()) {
            AppendCompletionLogprobs(&prompt_part, logprobs);
            logprobs = std::move(prompt_part);
          }
        }
        choice["logprobs"] = std::move(logprobs);
      }
      choice["finish_reason"] = finish;
      if (!chat_ && prompt_logprobs_field_) choice["prompt_logprobs"] = PromptLogprobsFor(k / static_cast<size_t>(n_));
      choices.push_back(std::move(choice));
    }
    Json body = Envelope();
    body["choices"] = std::move(choices);
    body["usage"] = Usage();
    if (chat_ && prompt_logprobs_field_) body["prompt_logprobs"] = PromptLogprobsFor(0);  // vLLM's place for it
    exchange_.Send(HttpResponse{200, "application/json", DumpJson(body), {}});
  }

  // Streamed chunks are built as text around a prefix made once: they are the server's hot path
  // (one per token per request). Chunks of one wake-up go out in one write.
  // `top_level` (",\"name\":value") goes after the choices array.
  void Emit(const std::string& choice_json, const std::string& top_level = "") {
    if (chunk_prefix_.empty()) {
      const std::string envelope = DumpJson(Envelope());  // {"id":...,"model":...}
      chunk_prefix_ = "data: " + envelope.substr(0, envelope.size() - 1) + ",\"choices\":[";
    }
    pending_ += chunk_prefix_;
    pending_ += choice_json;
    pending_ += "]";
    pending_ += top_level;
    pending_ += "}\n\n";
  }

  bool Flush() {
    const bool ok = exchange_.WriteChunk(pending_);
    pending_.clear();
    return ok;
  }

  std::string ChoiceJson(size_t k, const std::string& field, const std::string& value_json, const Json& logprobs,
                         std::optional<FinishReason> finish, const std::string& extra = "") const {
    std::string out = "{\"index\":" + std::to_string(k) + ",\"" + field + "\":" + value_json + ",\"logprobs\":";
    out += logprobs.is_null() ? "null" : DumpJson(logprobs);
    out += ",\"finish_reason\":";
    out += finish ? "\"" + FinishText(k, *finish) + "\"" : "null";
    out += extra;
    out += "}";
    return out;
  }

  // OpenAI's finish_reason of choice k: "tool_calls" where it called tools and stopped by itself.
  std::string FinishText(size_t k, FinishReason reason) const {
    const std::string text = OpenAiFinishReason(reason);
    return text == "stop" && k < tool_calls_sent_.size() && tool_calls_sent_[k] > 0 ? "tool_calls" : text;
  }

  // Streams what the output parser settled for choice k: reasoning, content, a call's name (with its
  // id), a call's arguments. `logprobs` go with the first chunk (alone when nothing settled).
  void EmitParsed(size_t k, const std::vector<AssistantDelta>& deltas, Json logprobs) {
    for (const AssistantDelta& d : deltas) {
      Json delta;
      switch (d.kind) {
        case AssistantDelta::Kind::kContent: delta = Json{{"content", d.text}}; break;
        case AssistantDelta::Kind::kReasoning: delta = Json{{"reasoning_content", d.text}}; break;
        case AssistantDelta::Kind::kToolCall:
          delta = Json{{"tool_calls", Json::array({{{"index", d.index},
                                                    {"id", d.id.empty() ? "call_" + RandomHex() : d.id},
                                                    {"type", "function"},
                                                    {"function", {{"name", d.text}, {"arguments", ""}}}}})}};
          ++tool_calls_sent_[k];
          break;
        case AssistantDelta::Kind::kArguments:
          delta = Json{{"tool_calls", Json::array({{{"index", d.index}, {"function", {{"arguments", d.text}}}}})}};
          break;
      }
      Emit(ChoiceJson(k, "delta", DumpJson(delta), logprobs, std::nullopt));
      logprobs = nullptr;
    }
    if (!logprobs.is_null()) Emit(ChoiceJson(k, "delta", "{}", logprobs, std::nullopt));
  }

  // Whether a prompt's first chunks (the role of chat choices, the echo of completions) need what
  // comes with the engine's first event: its prompt logprobs.
  bool PreludeWaits() const { return echo_logprobs_ || prompt_logprobs_field_.has_value(); }

  // The first chunk of every choice of one prompt: chat's role (with vLLM's top-level
  // prompt_logprobs on the first), or the echoed prompt with its logprobs and prompt_logprobs.
  void EmitPrelude(size_t prompt_index, std::vector<size_t>& text_offset) {
    Prompt& prompt = prompts_[prompt_index];
    if (prompt.prelude_sent) return;
    prompt.prelude_sent = true;
    const std::string& echo = echo_texts_[prompt_index];
    for (int j = 0; j < n_; ++j) {
      const size_t k = prompt_index * static_cast<size_t>(n_) + static_cast<size_t>(j);
      if (chat_) {
        Emit(ChoiceJson(k, "delta", R"({"role":"assistant","content":""})", nullptr, std::nullopt),
             j == 0 && prompt_logprobs_field_
                 ? ",\"prompt_logprobs\":" + DumpJson(PromptLogprobsFor(prompt_index))
                 : std::string());
        continue;
      }
      const std::string extra =
          prompt_logprobs_field_ ? ",\"prompt_logprobs\":" + DumpJson(PromptLogprobsFor(prompt_index)) : "";
      if (echo.empty() && extra.empty()) continue;
      Emit(ChoiceJson(k, "text", DumpJson(Json(echo)), echo_logprobs_ ? EchoLogprobsFor(prompt_index) : Json(nullptr),
                      std::nullopt, extra));
      text_offset[k] = echo.size();
    }
  }

  void Stream() {
    if (!exchange_.BeginStream(200, "text/event-stream")) return CancelAll("client disconnected");
    std::vector<size_t> text_offset(choices_.size(), 0);
    if (!PreludeWaits()) {
      for (size_t i = 0; i < prompts_.size(); ++i) EmitPrelude(i, text_offset);
    }
    if (!pending_.empty() && !Flush()) return CancelAll("client disconnected");
    std::vector<std::pair<size_t, StreamEvent>> events;
    std::optional<Status> error;
    while (NextEvents(&events)) {
      for (auto& [k, e] : events) {
        const bool ends = e.finished || e.request_finished;
        if (e.finish_reason == FinishReason::kError) {
          if (!error) error = e.error;
          continue;
        }
        EmitPrelude(k / static_cast<size_t>(n_), text_offset);
        if (e.tokens.empty() && e.text_delta.empty() && !ends) continue;
        const std::optional<FinishReason> finish = ends ? std::optional(e.finish_reason) : std::nullopt;
        if (chat_ && parsing_.active) {
          StreamingToolCallParser& parser = parsers_[k];
          EmitParsed(k, parser.Push(e.text_delta),
                     logprobs_ && !e.tokens.empty() ? ChatLogprobs(server_.engine_->tokenizer(), e.tokens) : Json(nullptr));
          if (ends) {
            EmitParsed(k, parser.Finish(), nullptr);
            Emit(ChoiceJson(k, "delta", "{}", nullptr, finish));
          }
        } else if (chat_) {
          const std::string delta =
              e.text_delta.empty() && ends ? "{}" : "{\"content\":" + DumpJson(Json(e.text_delta)) + "}";
          Emit(ChoiceJson(k, "delta", delta,
                          logprobs_ ? ChatLogprobs(server_.engine_->tokenizer(), e.tokens) : Json(nullptr), finish));
        } else {
          Emit(ChoiceJson(k, "text", DumpJson(Json(e.text_delta)), CompletionLogprobsFor(e.tokens, text_offset[k]),
                          finish));
        }
        text_offset[k] += e.text_delta.size();
      }
      if (!pending_.empty() && !Flush()) return CancelAll("client disconnected");
    }
    if (exchange_.ClientGone()) return;
    if (error) {
      exchange_.WriteChunk(SseEvent(Json::parse(EngineFailure(*error).ToJson())));
    } else if (include_usage_) {
      Json body = Envelope();
      body["choices"] = Json::array();
      body["usage"] = Usage();
      exchange_.WriteChunk(SseEvent(body));
    }
    exchange_.WriteChunk("data: [DONE]\n\n");
    exchange_.EndStream();
  }

  OpenAiServer& server_;
  HttpExchange& exchange_;
  const bool chat_;
  const ChatOutputParsing parsing_;
  std::vector<StreamingToolCallParser> parsers_;  // by choice, when parsing_.active and streaming
  std::vector<int> tool_calls_sent_;              // by choice
  const Clock::time_point start_;
  const int64_t created_ = static_cast<int64_t>(std::time(nullptr));
  Clock::time_point last_client_check_{};
  std::string id_;
  int n_ = 1;
  bool logprobs_ = false;
  bool echo_logprobs_ = false;  // /v1/completions with echo and logprobs: the prompt's come first
  int top_logprobs_ = 0;
  std::optional<int> prompt_logprobs_field_;
  bool stream_ = false;
  bool include_usage_ = false;
  std::vector<std::shared_ptr<RequestStream>> streams_;
  std::set<size_t> done_streams_;
  std::vector<std::string> echo_texts_;
  std::vector<Prompt> prompts_;  // by stream
  std::vector<Choice> choices_;
  std::string chunk_prefix_;  // "data: {envelope,"choices":["
  std::string pending_;       // SSE events not yet written
  int64_t prompt_tokens_ = 0;
  int64_t completion_tokens_ = 0;
};

void OpenAiServer::HandleCompletions(const HttpRequest& req, HttpExchange& exchange) {
  CompletionRequest request;
  if (auto error = ParseCompletionRequest(req.body, &request)) return SendError(exchange, *error);
  if (auto error = CheckModel(request.model)) return SendError(exchange, *error);
  const Tokenizer& tok = engine_->tokenizer();
  std::vector<PromptJob> jobs;
  for (const PromptInput& p : request.prompts) {
    PromptJob job;
    job.tokens = p.is_tokens ? p.tokens : tok.Encode(p.text, tok.add_bos());
    if (request.echo) job.echo_text = p.is_tokens ? tok.Decode(p.tokens) : p.text;
    jobs.push_back(std::move(job));
  }
  GenerationRun run(*this, exchange, /*chat=*/false);
  run.Run(std::move(jobs), request, request.echo, request.logprobs_given);
}

void OpenAiServer::HandleChat(const HttpRequest& req, HttpExchange& exchange) {
  ChatRequest request;
  if (auto error = ParseChatRequest(req.body, &request)) return SendError(exchange, *error);
  if (auto error = CheckModel(request.model)) return SendError(exchange, *error);
  const Tokenizer& tok = engine_->tokenizer();
  const bool has_tools = request.chat.tools.is_array() && !request.chat.tools.empty();
  const ToolChoice choice = request.tool_choice.value_or(
      ToolChoice{has_tools ? ToolChoice::Mode::kAuto : ToolChoice::Mode::kNone, ""});
  const bool use_tools = has_tools && choice.mode != ToolChoice::Mode::kNone;
  const bool forced = choice.mode == ToolChoice::Mode::kRequired || choice.mode == ToolChoice::Mode::kNamed;
  ChatTemplateInput input = request.chat;
  bool history_has_tools = false;
  for (const Json& m : input.messages) history_has_tools |= m["role"] == "tool" || m.contains("tool_calls");
  if (tool_format_ == ToolCallFormat::kGeneric && (use_tools || history_has_tools)) {
    // A template that renders no tools: the model learns them, and how to answer, from a system
    // message, and earlier calls and results become text it can read (llama.cpp's generic format).
    input.messages = PrepareGenericToolMessages(input.messages, use_tools ? input.tools : Json::array(),
                                                request.parallel_tool_calls, template_accepts_system_);
  }
  std::string prompt;
  if (auto error = RenderChatPrompt(input, &prompt)) return SendError(exchange, *error);

  ChatOutputParsing parsing;
  parsing.format = tool_format_;
  parsing.options.reasoning = reasoning_format_;
  parsing.options.starts_in_reasoning = PromptOpensReasoning(reasoning_format_, prompt);
  // A prompt that closed the reasoning block already (Qwen3 with enable_thinking false writes
  // "<think>\n\n</think>\n\n") leaves no reasoning to the model.
  const std::string_view close = ReasoningClose(reasoning_format_);
  const size_t last = prompt.find_last_not_of(" \n\r\t");
  const bool reasoning_closed = !close.empty() && last != std::string::npos && last + 1 >= close.size() &&
                                std::string_view(prompt).substr(last + 1 - close.size(), close.size()) == close;
  parsing.options.parse_tool_calls = use_tools;
  parsing.options.tools = input.tools;
  parsing.active = use_tools || reasoning_format_ != ReasoningFormat::kNone;
  if (use_tools) {
    // Many formats' markers are special tokens (Mistral's [TOOL_CALLS], Llama's <|python_tag|>):
    // the parser reads them in the text (as vLLM does for such parsers).
    request.sampling.skip_special_tokens = false;
    ToolConstraintOptions constraint_options;
    constraint_options.reasoning = reasoning_closed ? ReasoningFormat::kNone : reasoning_format_;
    constraint_options.starts_in_reasoning = parsing.options.starts_in_reasoning;
    auto grammar = ToolCallConstraint(tool_format_, input.tools, choice, request.parallel_tool_calls, constraint_options);
    if (!grammar.ok() && forced) {
      return SendError(exchange, InvalidRequest("tool_choice: " + grammar.status().message(), "tool_choice"));
    }
    if (forced && !request.constraint_fields.empty()) {
      return SendError(exchange, InvalidRequest("a required or named tool_choice cannot be combined with '" +
                                                    request.constraint_fields[0] + "'",
                                                "tool_choice"));
    }
    if (forced && !StructuredOutputAvailable()) {
      return SendError(exchange, ErrorFromStatus(NoXgrammarStatus()));
    }
    // "auto" is constrained where the format has a trigger and nothing else constrains the output;
    // otherwise the calls are parsed from free text.
    if (grammar.ok() && request.constraint_fields.empty() && StructuredOutputAvailable()) {
      StructuredOutput so;
      so.kind = grammar->kind == ToolCallGrammar::Kind::kJsonSchema ? StructuredOutput::Kind::kJsonSchema
                                                                   : StructuredOutput::Kind::kStructuralTag;
      so.spec = grammar->spec;
      so.strict = true;
      so.any_whitespace = false;  // compact JSON: a weak model left free to write whitespace may write nothing else
      request.sampling.structured_output = std::move(so);
    }
  }
  PromptJob job;
  // The template writes the BOS where the model wants one; the tokenizer adds it only where the
  // template did not (llama.cpp's rule, for GGUF templates that leave it out).
  job.tokens = tok.Encode(prompt, tok.add_bos() && !StartsWithBos(prompt));
  std::vector<PromptJob> jobs;
  jobs.push_back(std::move(job));
  GenerationRun run(*this, exchange, /*chat=*/true, std::move(parsing));
  run.Run(std::move(jobs), request, false, request.logprobs);
}

}  // namespace kvflow::server
