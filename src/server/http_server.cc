#include "server/http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include <spdlog/spdlog.h>

namespace kvflow::server {
namespace {

constexpr int kPollTickMs = 200;  // how often idle connections look at the stopping flag

std::string Lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

bool IsTokenChar(unsigned char c) {
  return std::isalnum(c) || std::strchr("!#$%&'*+-.^_`|~", c) != nullptr;
}

bool IsFieldValueChar(unsigned char c) { return c == '\t' || (c >= 0x20 && c != 0x7f); }

// Waits for `events` on fd; returns false on timeout or error.
bool WaitFor(int fd, short events, int timeout_ms) {
  pollfd p{fd, events, 0};
  while (true) {
    const int r = ::poll(&p, 1, timeout_ms);
    if (r < 0 && errno == EINTR) continue;
    return r > 0;
  }
}

std::string ResponseHead(int status, std::string_view content_type, const HeaderList& headers, bool keep_alive,
                         std::optional<size_t> content_length) {
  std::string head = "HTTP/1.1 " + std::to_string(status) + " " + HttpReason(status) + "\r\n";
  if (!content_type.empty()) head += "Content-Type: " + std::string(content_type) + "\r\n";
  if (content_length) {
    head += "Content-Length: " + std::to_string(*content_length) + "\r\n";
  } else {
    head += "Transfer-Encoding: chunked\r\nCache-Control: no-cache\r\n";
  }
  head += keep_alive ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
  for (const auto& [name, value] : headers) head += name + ": " + value + "\r\n";
  head += "\r\n";
  return head;
}

}  // namespace

// ---- parsing -------------------------------------------------------------------------------------

const std::string* HttpRequest::Header(std::string_view name) const {
  for (const auto& [n, v] : headers) {
    if (n == name) return &v;
  }
  return nullptr;
}

bool HttpRequest::KeepAlive() const {
  const std::string* connection = Header("connection");
  const std::string value = connection ? Lower(*connection) : "";
  if (minor_version == 0) return value.find("keep-alive") != std::string::npos;
  return value.find("close") == std::string::npos;
}

std::optional<HttpError> ParseRequestHead(std::string_view head, HttpRequest* req) {
  *req = HttpRequest{};
  const size_t line_end = head.find("\r\n");
  if (line_end == std::string_view::npos) return HttpError{400, "the request line does not end in CRLF"};
  const std::string_view line = head.substr(0, line_end);
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos || line.find(' ', sp2 + 1) != std::string_view::npos) {
    return HttpError{400, "malformed request line"};
  }
  const std::string_view method = line.substr(0, sp1);
  const std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  const std::string_view version = line.substr(sp2 + 1);
  if (method.empty() || !std::all_of(method.begin(), method.end(), [](unsigned char c) { return IsTokenChar(c); })) {
    return HttpError{400, "malformed method"};
  }
  if (target.empty() || target.front() != '/' ||
      !std::all_of(target.begin(), target.end(), [](unsigned char c) { return c > 0x20 && c != 0x7f; })) {
    return HttpError{400, "malformed request target"};
  }
  if (version == "HTTP/1.1") {
    req->minor_version = 1;
  } else if (version == "HTTP/1.0") {
    req->minor_version = 0;
  } else if (version.substr(0, 5) == "HTTP/") {
    return HttpError{505, "only HTTP/1.0 and HTTP/1.1 are supported"};
  } else {
    return HttpError{400, "malformed HTTP version"};
  }
  req->method = std::string(method);
  req->target = std::string(target);
  req->path = req->target.substr(0, req->target.find('?'));

  size_t pos = line_end + 2;
  while (pos < head.size()) {
    const size_t end = head.find("\r\n", pos);
    if (end == std::string_view::npos) return HttpError{400, "a header line does not end in CRLF"};
    if (end == pos) return std::nullopt;  // the blank line
    const std::string_view field = head.substr(pos, end - pos);
    const size_t colon = field.find(':');
    if (colon == std::string_view::npos || colon == 0) return HttpError{400, "malformed header line"};
    const std::string_view name = field.substr(0, colon);
    const std::string_view value = Trim(field.substr(colon + 1));
    if (!std::all_of(name.begin(), name.end(), [](unsigned char c) { return IsTokenChar(c); })) {
      return HttpError{400, "malformed header name"};
    }
    if (!std::all_of(value.begin(), value.end(), [](unsigned char c) { return IsFieldValueChar(c); })) {
      return HttpError{400, "malformed header value"};
    }
    if (req->headers.size() >= 100) return HttpError{431, "too many header fields"};
    req->headers.emplace_back(Lower(name), std::string(value));
    pos = end + 2;
  }
  return HttpError{400, "the header section does not end with a blank line"};
}

std::optional<HttpError> DecideBodyFraming(const HttpRequest& req, size_t max_body_bytes, BodyFraming* framing) {
  *framing = BodyFraming{};
  if (req.Header("transfer-encoding")) {
    return HttpError{411, "chunked request bodies are not supported; send Content-Length"};
  }
  const std::string* expect = req.Header("expect");
  if (expect) {
    if (Lower(*expect) != "100-continue") return HttpError{417, "unsupported Expect header"};
    framing->expect_continue = true;
  }
  const std::string* length = nullptr;
  for (const auto& [n, v] : req.headers) {
    if (n != "content-length") continue;
    if (length && *length != v) return HttpError{400, "conflicting Content-Length headers"};
    length = &v;
  }
  if (!length) return std::nullopt;
  if (length->empty() || length->size() > 18 ||
      !std::all_of(length->begin(), length->end(), [](unsigned char c) { return std::isdigit(c); })) {
    return HttpError{400, "malformed Content-Length"};
  }
  framing->length = std::stoull(*length);
  if (framing->length > max_body_bytes) {
    return HttpError{413, "the request body of " + std::to_string(framing->length) + " bytes exceeds the limit of " +
                              std::to_string(max_body_bytes) + " bytes"};
  }
  return std::nullopt;
}

const char* HttpReason(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 417: return "Expectation Failed";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
  }
}

// ---- HttpExchange ------------------------------------------------------------------------------

bool HttpExchange::WriteAll(std::string_view data) {
  if (failed_) return false;
  while (!data.empty()) {
    const ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && WaitFor(fd_, POLLOUT, write_timeout_ms_)) continue;
    failed_ = true;
    return false;
  }
  return true;
}

bool HttpExchange::Send(const HttpResponse& r) {
  status_ = r.status;
  return WriteAll(ResponseHead(r.status, r.content_type, r.headers, keep_alive_, r.body.size()) + r.body);
}

bool HttpExchange::BeginStream(int status, std::string_view content_type, const HeaderList& headers) {
  status_ = status;
  streaming_ = true;
  return WriteAll(ResponseHead(status, content_type, headers, keep_alive_, std::nullopt));
}

bool HttpExchange::WriteChunk(std::string_view data) {
  if (data.empty()) return !failed_;  // an empty chunk would end the stream
  char size[32];
  const int n = std::snprintf(size, sizeof(size), "%zx\r\n", data.size());
  std::string chunk(size, static_cast<size_t>(n));
  chunk.append(data);
  chunk += "\r\n";
  return WriteAll(chunk);
}

bool HttpExchange::EndStream() {
  streaming_ = false;
  return WriteAll("0\r\n\r\n");
}

bool HttpExchange::ClientGone() {
  if (failed_) return true;
  pollfd p{fd_, POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLERR | POLLHUP | POLLRDHUP | POLLNVAL)) return failed_ = true;
  if (p.revents & POLLIN) {
    char c;
    const ssize_t n = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) return failed_ = true;  // orderly close; bytes instead would be a pipelined request
  }
  return false;
}

// ---- HttpServer --------------------------------------------------------------------------------

Result<std::unique_ptr<HttpServer>> HttpServer::Listen(HttpServerOptions options, HttpHandler handler) {
  if (options.port < 0 || options.port > 65535) return Status::InvalidArgument("port must be in [0, 65535]");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(options.port);
  if (int rc = ::getaddrinfo(options.host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return Status::InvalidArgument("cannot resolve host '" + options.host + "': " + ::gai_strerror(rc));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(found, &::freeaddrinfo);
  std::string last_error = "no address";
  for (addrinfo* ai = found; ai; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd, 1024) != 0) {
      last_error = std::strerror(errno);
      ::close(fd);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
    const int actual = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                         : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    return std::unique_ptr<HttpServer>(new HttpServer(std::move(options), std::move(handler), fd, actual));
  }
  return Status::IoError("cannot listen on " + options.host + ":" + port + ": " + last_error);
}

HttpServer::HttpServer(HttpServerOptions options, HttpHandler handler, int listen_fd, int port)
    : options_(std::move(options)), handler_(std::move(handler)), listen_fd_(listen_fd), port_(port) {
  if (::pipe2(wake_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) wake_pipe_[0] = wake_pipe_[1] = -1;
}

HttpServer::~HttpServer() {
  Shutdown();
  for (int fd : wake_pipe_) {
    if (fd >= 0) ::close(fd);
  }
}

void HttpServer::Start() { acceptor_ = std::thread([this] { AcceptLoop(); }); }

void HttpServer::StopAccepting() {
  if (stopping_.exchange(true)) return;
  if (wake_pipe_[1] >= 0) (void)!::write(wake_pipe_[1], "x", 1);
  if (acceptor_.joinable()) acceptor_.join();
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
  }
}

void HttpServer::Shutdown() {
  StopAccepting();
  ReapConnections(/*all=*/true);
}

void HttpServer::ReapConnections(bool all) {
  std::list<Connection> finished;
  {
    std::lock_guard<std::mutex> lock(connections_mu_);
    for (auto it = connections_.begin(); it != connections_.end();) {
      auto next = std::next(it);
      if (all || it->done.load()) finished.splice(finished.end(), connections_, it);
      it = next;
    }
  }
  for (Connection& c : finished) c.thread.join();
}

void HttpServer::Reply(int fd, const HttpError& error, bool linger) {
  HttpExchange exchange(fd, /*keep_alive=*/false, /*write_timeout_ms=*/1000);
  const std::string body = R"({"error":{"message":")" + error.message +
                           R"(","type":"invalid_request_error","param":null,"code":null}})";
  exchange.Send(HttpResponse{error.status, "application/json", body, {}});
  if (options_.on_response) options_.on_response(error.status);
  if (!linger) return;
  // Closing with unread request bytes would make the kernel send a reset, and a client still
  // sending its body could lose the response: stop writing, then read and drop for a moment.
  ::shutdown(fd, SHUT_WR);
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  char sink[16384];
  size_t drained = 0;
  while (drained < (size_t{4} << 20) && std::chrono::steady_clock::now() < until) {
    if (!WaitFor(fd, POLLIN, 50)) continue;
    const ssize_t n = ::recv(fd, sink, sizeof(sink), 0);
    if (n <= 0) break;
    drained += static_cast<size_t>(n);
  }
}

void HttpServer::AcceptLoop() {
  while (!stopping_.load()) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_pipe_[0], POLLIN, 0}};
    if (::poll(fds, wake_pipe_[0] >= 0 ? 2 : 1, kPollTickMs) <= 0) {
      ReapConnections(false);
      continue;
    }
    if (stopping_.load()) break;
    if (!(fds[0].revents & POLLIN)) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) {
        spdlog::warn("accept: {}; waiting for connections to close", std::strerror(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    ReapConnections(false);
    if (num_connections_.load() >= options_.max_connections) {
      Reply(fd, HttpError{503, "too many connections"}, /*linger=*/false);  // must not stall accepting
      ::close(fd);
      continue;
    }
    ++num_connections_;
    std::lock_guard<std::mutex> lock(connections_mu_);
    Connection& c = connections_.emplace_back();
    c.thread = std::thread([this, fd, &c] {
      Serve(fd);
      ::close(fd);
      --num_connections_;
      c.done.store(true);
    });
  }
}

// Reads requests off one connection until it closes, fails, or the server stops.
void HttpServer::Serve(int fd) {
  std::string buffer;
  char chunk[16384];
  using Clock = std::chrono::steady_clock;
  // Reads more bytes into `buffer`; false on EOF, error, timeout, or shutdown while idle.
  auto read_more = [&](Clock::time_point deadline, bool idle) {
    while (true) {
      if (idle && buffer.empty() && stopping_.load()) return false;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return false;
      if (!WaitFor(fd, POLLIN, static_cast<int>(std::min<int64_t>(left, kPollTickMs)))) continue;
      const ssize_t n = ::recv(fd, chunk, sizeof(chunk), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      buffer.append(chunk, static_cast<size_t>(n));
      return true;
    }
  };

  const HttpError head_too_large{431, "the request head exceeds " + std::to_string(options_.max_header_bytes) +
                                          " bytes"};
  while (true) {
    // The head: wait for the blank line.
    const bool idle = buffer.empty();
    const auto head_deadline =
        Clock::now() + std::chrono::milliseconds(idle ? options_.keep_alive_timeout_ms : options_.read_timeout_ms);
    size_t head_end;
    bool started = !buffer.empty();
    while ((head_end = buffer.find("\r\n\r\n")) == std::string::npos) {
      if (buffer.size() > options_.max_header_bytes) {
        Reply(fd, head_too_large, true);
        return;
      }
      const auto deadline = started ? std::min(head_deadline, Clock::now() + std::chrono::milliseconds(
                                                                                  options_.read_timeout_ms))
                                    : head_deadline;
      if (!read_more(deadline, !started)) return;
      started = true;
    }
    if (head_end + 4 > options_.max_header_bytes) {  // it came in one read with what follows it
      Reply(fd, head_too_large, true);
      return;
    }
    HttpRequest req;
    if (auto error = ParseRequestHead(std::string_view(buffer).substr(0, head_end + 4), &req)) {
      Reply(fd, *error, true);
      return;
    }
    buffer.erase(0, head_end + 4);
    BodyFraming framing;
    if (auto error = DecideBodyFraming(req, options_.max_body_bytes, &framing)) {
      Reply(fd, *error, true);  // the body is not read, so the connection cannot be reused
      return;
    }
    if (framing.expect_continue && buffer.size() < framing.length) {
      constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
      if (::send(fd, kContinue.data(), kContinue.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(kContinue.size())) return;
    }
    const auto body_deadline = Clock::now() + std::chrono::milliseconds(options_.read_timeout_ms);
    while (buffer.size() < framing.length) {
      if (!read_more(body_deadline, false)) return;  // client gone or too slow: nothing to answer
    }
    req.body = buffer.substr(0, framing.length);
    buffer.erase(0, framing.length);

    HttpExchange exchange(fd, req.KeepAlive() && !stopping_.load(), options_.write_timeout_ms);
    handler_(req, exchange);
    if (!exchange.responded()) {
      if (exchange.ClientGone()) return;  // nobody to answer (a cancelled request)
      exchange.Send(HttpResponse{500, "application/json",
                                 R"({"error":{"message":"no response","type":"server_error","param":null,"code":null}})",
                                 {}});
    }
    if (options_.on_response) options_.on_response(exchange.status());
    if (!exchange.keep_alive() || stopping_.load()) return;
  }
}

}  // namespace kvflow::server
