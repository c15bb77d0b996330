// A small blocking/non-blocking HTTP/1.1 client and the SSE parser the serving benchmark uses to talk to kvflow-server.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <sys/socket.h>

#include "serving/common.h"

namespace kvflow::bench::serving {

// ---- http executor: the trace against kvflow-server -------------------------------------------
//
// One connection per request (HTTP/1.1, Connection: close), all driven by one thread blocked in
// ppoll(): the client wakes for a socket's bytes or the next arrival, never spins. Each request is
// POST /v1/completions with the prompt's token ids, streamed: TTFT is the first SSE event with a
// choice in it, the finish the event with a finish_reason, and the usage chunk must report exactly
// the trace's output length.

struct Endpoint {
  std::string host = "127.0.0.1";
  int port = 0;
  std::string url() const { return "http://" + host + ":" + std::to_string(port); }
};

Result<Endpoint> ParseUrl(const std::string& url);

Result<sockaddr_storage> Resolve(const Endpoint& ep, socklen_t& len);

std::string ErrnoText(const std::string& what);

std::string Lower(std::string s);

// Incremental HTTP/1.1 response parser: status line, headers, then a Content-Length, chunked or
// close-delimited body, handed to on_body as it is decoded.
class HttpResponseParser {
 public:
  std::function<void(std::string_view)> on_body;

  void Feed(std::string_view data);
  // The peer closed the connection.
  void Eof();
  bool done() const { return state_ == St::kDone; }
  bool failed() const { return state_ == St::kError; }
  bool headers_done() const { return headers_done_; }
  const std::string& error() const { return error_; }
  int status() const { return status_; }
  std::string Header(const std::string& lower_name) const;

 private:
  enum class St { kStatus, kHeaders, kChunkSize, kChunkData, kChunkEnd, kTrailers, kLength, kClose, kDone, kError };

  void Fail(const std::string& why);

  // Takes one line (through "\n", without "\r\n") from the buffer.
  bool Line(std::string& line);

  void Body(size_t n);

  void StartBody();

  void Process();

  St state_ = St::kStatus;
  std::string buf_;
  size_t pos_ = 0;
  int status_ = 0;
  bool headers_done_ = false;
  std::vector<std::pair<std::string, std::string>> headers_;
  uint64_t remaining_ = 0;
  std::string error_;
};

// Server-sent events: hands each event's data (its "data:" lines joined by "\n") to on_data.
class SseParser {
 public:
  std::function<void(const std::string&)> on_data;

  void Feed(std::string_view bytes) {
    buf_.append(bytes.data(), bytes.size());
    size_t pos = 0;
    for (size_t nl; (nl = buf_.find('\n', pos)) != std::string::npos; pos = nl + 1) {
      std::string_view line(buf_.data() + pos, nl - pos);
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (line.empty()) {
        if (has_data_) on_data(data_);
        data_.clear();
        has_data_ = false;
      } else if (line.rfind("data:", 0) == 0) {
        std::string_view value = line.substr(5);
        if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
        if (has_data_) data_ += '\n';
        data_.append(value.data(), value.size());
        has_data_ = true;
      }  // comments (":") and other fields (event:, id:, retry:) carry nothing here
    }
    buf_.erase(0, pos);
  }
  bool pending() const { return has_data_ || !buf_.empty(); }

 private:
  std::string buf_, data_;
  bool has_data_ = false;
};

std::string HttpRequestText(const Endpoint& ep, const std::string& method, const std::string& path,
                            const std::string& body, const std::string& api_key, bool stream);

int OpenSocket(const sockaddr_storage& addr, socklen_t len, bool nonblocking);

struct HttpResponse {
  int status = 0;
  std::string content_type;
  std::string body;
};

// One blocking request/response (control calls: /health, /metrics, /v1/models, warm-up).
Result<HttpResponse> HttpCall(const Endpoint& ep, const std::string& method, const std::string& path,
                              const std::string& body, const std::string& api_key, double timeout_s);

// Sum of a Prometheus metric's samples (over all label sets); nullopt when absent.
std::optional<double> MetricValue(const std::string& text, const std::string& name);

// Raises the open-file limit to its hard limit: one socket per in-flight request.
void RaiseFileLimit(size_t needed);

}  // namespace kvflow::bench::serving
