// A small HTTP/1.1 server for the OpenAI front end: one thread per connection (generation requests
// block on the engine anyway), keep-alive, Content-Length bodies with a size limit, chunked
// responses for server-sent events, and a way for a handler to notice that its client went away.
#pragma once

#include <atomic>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "kvflow/status.h"

namespace kvflow::server {

using HeaderList = std::vector<std::pair<std::string, std::string>>;

struct HttpRequest {
  std::string method;
  std::string target;  // as sent: path and query
  std::string path;    // target without the query
  int minor_version = 1;  // HTTP/1.<minor>
  HeaderList headers;  // names lower-cased, in order
  std::string body;

  // The first header named `name` (lower case), or nullptr.
  const std::string* Header(std::string_view name) const;
  bool KeepAlive() const;
};

// A request the HTTP layer refuses before any handler sees it.
struct HttpError {
  int status = 400;
  std::string message;
};

// Parses a request line and headers (`head` ends with the blank line's CRLF CRLF) into `req`.
// Pure: the fuzz target calls it directly.
std::optional<HttpError> ParseRequestHead(std::string_view head, HttpRequest* req);

// What the body will be, from the parsed headers: its length, or an error (411 for chunked
// bodies, 413 over `max_body_bytes`, 400 for a malformed Content-Length).
struct BodyFraming {
  size_t length = 0;
  bool expect_continue = false;
};
std::optional<HttpError> DecideBodyFraming(const HttpRequest& req, size_t max_body_bytes, BodyFraming* framing);

const char* HttpReason(int status);

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  HeaderList headers;  // extra headers
};

// The response side of one request, handed to the handler.
class HttpExchange {
 public:
  HttpExchange(int fd, bool keep_alive, int write_timeout_ms) : fd_(fd), keep_alive_(keep_alive),
                                                                write_timeout_ms_(write_timeout_ms) {}
  // A complete response. Returns false when the client is gone.
  bool Send(const HttpResponse& response);
  // A chunked response: the head now, then chunks as they come, then the terminating chunk.
  bool BeginStream(int status, std::string_view content_type, const HeaderList& headers = {});
  bool WriteChunk(std::string_view data);
  bool EndStream();
  // True once the client closed its side of the connection or a write to it failed. Cheap (a
  // zero-timeout poll); handlers waiting on the engine call it every few tens of milliseconds.
  bool ClientGone();

  bool responded() const { return status_ != 0; }
  int status() const { return status_; }
  bool keep_alive() const { return keep_alive_ && !failed_; }
  void set_close() { keep_alive_ = false; }

 private:
  bool WriteAll(std::string_view data);

  int fd_;
  bool keep_alive_;
  int write_timeout_ms_;
  int status_ = 0;
  bool streaming_ = false;
  bool failed_ = false;
};

using HttpHandler = std::function<void(const HttpRequest&, HttpExchange&)>;

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: an ephemeral port (see HttpServer::port())
  size_t max_body_bytes = size_t{8} << 20;
  size_t max_header_bytes = 16 << 10;
  int max_connections = 512;
  int keep_alive_timeout_ms = 30000;  // idle between requests
  int read_timeout_ms = 30000;        // to receive a whole request once it started
  int write_timeout_ms = 30000;       // for a write to make progress
  // Called with the status of every response, including those the HTTP layer sends itself.
  std::function<void(int status)> on_response;
};

class HttpServer {
 public:
  // Binds and listens; connections are accepted once Start() runs.
  static Result<std::unique_ptr<HttpServer>> Listen(HttpServerOptions options, HttpHandler handler);
  ~HttpServer();

  int port() const { return port_; }
  void Start();
  // Closes the listening socket: new connections are refused; open ones are served on.
  void StopAccepting();
  // Stops accepting, closes idle connections, and waits for the handlers still running.
  void Shutdown();
  int num_connections() const { return num_connections_.load(); }

 private:
  struct Connection {
    std::thread thread;
    std::atomic<bool> done{false};
  };

  HttpServer(HttpServerOptions options, HttpHandler handler, int listen_fd, int port);
  void AcceptLoop();
  void Serve(int fd);
  // Sends an error and, with `linger`, drains what the client still sends before the close.
  void Reply(int fd, const HttpError& error, bool linger);
  void ReapConnections(bool all);

  const HttpServerOptions options_;
  const HttpHandler handler_;
  int listen_fd_;
  int wake_pipe_[2] = {-1, -1};
  const int port_;
  std::thread acceptor_;
  std::atomic<bool> stopping_{false};
  std::atomic<int> num_connections_{0};
  std::mutex connections_mu_;
  std::list<Connection> connections_;
};

}  // namespace kvflow::server
