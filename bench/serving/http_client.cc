// A small blocking/non-blocking HTTP/1.1 client and the SSE parser the serving benchmark uses to talk to kvflow-server.
#include "serving/http_client.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <variant>
#include <vector>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include "bench_files.h"
#include "engine/engine_core.h"
#include "engine/evaluation.h"
#include "systems/builtin_systems.h"
#include "kv/block_manager.h"
#include "kvflow/engine.h"
#include "model/tensor_source.h"
#include "model/tiny_random.h"
#include "sched/length_predictor.h"
#include "sched/length_supervisor.h"
#include "sched/policy.h"
#include "sched/scheduler.h"
#include "sched/sequence_group.h"
#include "util/alpaca.h"

namespace kvflow::bench::serving {

Result<Endpoint> ParseUrl(const std::string& url) {
  std::string rest = url;
  if (rest.rfind("http://", 0) == 0) rest = rest.substr(7);
  while (!rest.empty() && rest.back() == '/') rest.pop_back();
  const size_t colon = rest.rfind(':');
  Endpoint ep;
  if (colon == std::string::npos || rest.find('/') != std::string::npos) {
    return Status::InvalidArgument("expected http://HOST:PORT, got '" + url + "'");
  }
  ep.host = rest.substr(0, colon);
  char* end = nullptr;
  const long port = std::strtol(rest.c_str() + colon + 1, &end, 10);
  if (ep.host.empty() || *end != '\0' || port <= 0 || port > 65535) {
    return Status::InvalidArgument("expected http://HOST:PORT, got '" + url + "'");
  }
  ep.port = static_cast<int>(port);
  return ep;
}
Result<sockaddr_storage> Resolve(const Endpoint& ep, socklen_t& len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(ep.host.c_str(), std::to_string(ep.port).c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) return Status::NotFound("cannot resolve " + ep.host + ": " + gai_strerror(rc));
  sockaddr_storage addr{};
  std::memcpy(&addr, res->ai_addr, res->ai_addrlen);
  len = res->ai_addrlen;
  freeaddrinfo(res);
  return addr;
}
std::string ErrnoText(const std::string& what) { return what + ": " + std::strerror(errno); }
std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}
void HttpResponseParser::Feed(std::string_view data) {
  buf_.append(data.data(), data.size());
  Process();
}

void HttpResponseParser::Eof() {
  if (state_ == St::kClose) {
    state_ = St::kDone;
  } else if (state_ != St::kDone && state_ != St::kError) {
    Fail("connection closed before the end of the response");
  }
}

std::string HttpResponseParser::Header(const std::string& lower_name) const {
  for (const auto& [k, v] : headers_) {
    if (k == lower_name) return v;
  }
  return "";
}

void HttpResponseParser::Fail(const std::string& why) {
  if (state_ != St::kError) error_ = why;
  state_ = St::kError;
}

bool HttpResponseParser::Line(std::string& line) {
  const size_t nl = buf_.find('\n', pos_);
  if (nl == std::string::npos) {
    if (buf_.size() - pos_ > 65536) Fail("header or chunk-size line over 64 KiB");
    return false;
  }
  line.assign(buf_, pos_, nl - pos_);
  if (!line.empty() && line.back() == '\r') line.pop_back();
  pos_ = nl + 1;
  return true;
}

void HttpResponseParser::Body(size_t n) {
  if (on_body && n > 0) on_body(std::string_view(buf_).substr(pos_, n));
  pos_ += n;
}

void HttpResponseParser::StartBody() {
  headers_done_ = true;
  if (status_ / 100 == 1) {  // 100 Continue and friends: the real response follows
    headers_.clear();
    headers_done_ = false;
    state_ = St::kStatus;
    return;
  }
  const std::string te = Lower(Header("transfer-encoding"));
  const std::string cl = Header("content-length");
  if (te.find("chunked") != std::string::npos) {
    state_ = St::kChunkSize;
  } else if (!cl.empty()) {
    remaining_ = std::strtoull(cl.c_str(), nullptr, 10);
    state_ = remaining_ == 0 ? St::kDone : St::kLength;
  } else if (status_ == 204 || status_ == 304) {
    state_ = St::kDone;
  } else {
    state_ = St::kClose;
  }
}

void HttpResponseParser::Process() {
  std::string line;
  bool progress = true;
  while (progress && state_ != St::kDone && state_ != St::kError) {
    progress = false;
    switch (state_) {
      case St::kStatus:
        if (!Line(line)) break;
        if (line.rfind("HTTP/1.", 0) != 0 || line.size() < 12) {
          Fail("bad status line '" + line.substr(0, 80) + "'");
          break;
        }
        status_ = std::atoi(line.c_str() + 9);
        state_ = St::kHeaders;
        progress = true;
        break;
      case St::kHeaders:
        if (!Line(line)) break;
        progress = true;
        if (line.empty()) {
          StartBody();
        } else if (const size_t colon = line.find(':'); colon != std::string::npos) {
          const size_t v = line.find_first_not_of(" \t", colon + 1);
          headers_.emplace_back(Lower(line.substr(0, colon)), v == std::string::npos ? "" : line.substr(v));
        } else {
          Fail("bad header line '" + line.substr(0, 80) + "'");
        }
        break;
      case St::kChunkSize: {
        if (!Line(line)) break;
        char* end = nullptr;
        remaining_ = std::strtoull(line.c_str(), &end, 16);
        if (end == line.c_str()) {
          Fail("bad chunk size line '" + line.substr(0, 80) + "'");
          break;
        }
        state_ = remaining_ == 0 ? St::kTrailers : St::kChunkData;
        progress = true;
        break;
      }
      case St::kChunkData: {
        const size_t n = std::min<uint64_t>(remaining_, buf_.size() - pos_);
        if (n == 0) break;
        Body(n);
        remaining_ -= n;
        if (remaining_ == 0) state_ = St::kChunkEnd;
        progress = true;
        break;
      }
      case St::kChunkEnd:
        if (!Line(line)) break;
        if (!line.empty()) {
          Fail("chunk data longer than its size");
          break;
        }
        state_ = St::kChunkSize;
        progress = true;
        break;
      case St::kTrailers:
        if (!Line(line)) break;
        if (line.empty()) state_ = St::kDone;
        progress = true;
        break;
      case St::kLength: {
        const size_t n = std::min<uint64_t>(remaining_, buf_.size() - pos_);
        if (n == 0) break;
        Body(n);
        remaining_ -= n;
        if (remaining_ == 0) state_ = St::kDone;
        progress = true;
        break;
      }
      case St::kClose:
        if (pos_ < buf_.size()) Body(buf_.size() - pos_);
        break;
      case St::kDone:
      case St::kError:
        break;
    }
  }
  buf_.erase(0, pos_);
  pos_ = 0;
}

std::string HttpRequestText(const Endpoint& ep, const std::string& method, const std::string& path,
                            const std::string& body, const std::string& api_key, bool stream) {
  std::string r = method + " " + path + " HTTP/1.1\r\nHost: " + ep.host + ":" + std::to_string(ep.port) +
                  "\r\nUser-Agent: kvflow-bench-serving\r\nConnection: close\r\n";
  if (stream) r += "Accept: text/event-stream\r\n";
  if (!api_key.empty()) r += "Authorization: Bearer " + api_key + "\r\n";
  if (!body.empty() || method == "POST") {
    r += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  }
  return r + "\r\n" + body;
}
int OpenSocket(const sockaddr_storage& addr, socklen_t len, bool nonblocking) {
  const int fd = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0), 0);
  if (fd < 0) return -1;
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), len) != 0 && errno != EINPROGRESS) {
    const int saved = errno;
    close(fd);
    errno = saved;
    return -1;
  }
  return fd;
}
Result<HttpResponse> HttpCall(const Endpoint& ep, const std::string& method, const std::string& path,
                              const std::string& body, const std::string& api_key, double timeout_s) {
  socklen_t len = 0;
  KVFLOW_ASSIGN_OR_RETURN(sockaddr_storage addr, Resolve(ep, len));
  const int fd = OpenSocket(addr, len, /*nonblocking=*/false);
  if (fd < 0) return Status::IoError(ErrnoText("connect to " + ep.url()));
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout_s);
  tv.tv_usec = static_cast<suseconds_t>(1e6 * (timeout_s - static_cast<double>(tv.tv_sec)));
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  const std::string request = HttpRequestText(ep, method, path, body, api_key, false);
  for (size_t off = 0; off < request.size();) {
    const ssize_t w = send(fd, request.data() + off, request.size() - off, MSG_NOSIGNAL);
    if (w <= 0) {
      const std::string why = ErrnoText("send to " + ep.url() + path);
      close(fd);
      return Status::IoError(why);
    }
    off += static_cast<size_t>(w);
  }
  HttpResponseParser parser;
  HttpResponse out;
  parser.on_body = [&out](std::string_view b) { out.body.append(b.data(), b.size()); };
  char buf[16384];
  while (!parser.done() && !parser.failed()) {
    const ssize_t r = recv(fd, buf, sizeof(buf), 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const std::string why = ErrnoText(method + " " + ep.url() + path);
      close(fd);
      return Status::IoError(why);
    }
    if (r == 0) {
      parser.Eof();
      break;
    }
    parser.Feed(std::string_view(buf, static_cast<size_t>(r)));
  }
  close(fd);
  if (parser.failed()) return Status::IoError(method + " " + ep.url() + path + ": " + parser.error());
  out.status = parser.status();
  out.content_type = parser.Header("content-type");
  return out;
}
std::optional<double> MetricValue(const std::string& text, const std::string& name) {
  std::optional<double> sum;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    const std::string_view line(text.data() + pos, nl - pos);
    pos = nl + 1;
    if (line.rfind(name, 0) != 0 || line.size() <= name.size()) continue;
    const char next = line[name.size()];
    if (next != ' ' && next != '{') continue;
    const size_t space = line.rfind(' ');
    if (space == std::string_view::npos) continue;
    const std::string value(line.substr(space + 1));
    sum = sum.value_or(0.0) + std::strtod(value.c_str(), nullptr);
  }
  return sum;
}
void RaiseFileLimit(size_t needed) {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur >= needed + 64) return;
  lim.rlim_cur = lim.rlim_max;
  setrlimit(RLIMIT_NOFILE, &lim);
}

}  // namespace kvflow::bench::serving
