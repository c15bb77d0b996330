// Status and Result<T>: error values that cross module boundaries instead of exceptions.
#pragma once

#include <cassert>
#include <string>
#include <utility>
#include <variant>

namespace kvflow {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // the caller passed something impossible
  kNotFound,         // a file, tensor, model or request that does not exist
  kIoError,          // the OS refused a read/open/mmap
  kCorruptFile,      // a file whose bytes contradict its own format
  kUnsupported,      // valid input that kvflow does not handle (yet)
  kOutOfMemory,      // a pool or allocation could not be satisfied
  kCancelled,
  kInternal,
  kResourceExhausted,  // a bounded queue is full: retry later
  kUnavailable,        // the service is shutting down
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  static Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status IoError(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
  static Status CorruptFile(std::string m) { return {StatusCode::kCorruptFile, std::move(m)}; }
  static Status Unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
  static Status OutOfMemory(std::string m) { return {StatusCode::kOutOfMemory, std::move(m)}; }
  static Status Cancelled(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
  static Status ResourceExhausted(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
  static Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "CorruptFile: model.gguf: tensor 'x' runs past the end of the file"
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Either a value or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) { assert(!std::get<Status>(v_).ok()); }  // NOLINT

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace kvflow

#define KVFLOW_CONCAT_INNER_(a, b) a##b
#define KVFLOW_CONCAT_(a, b) KVFLOW_CONCAT_INNER_(a, b)

#define KVFLOW_RETURN_IF_ERROR(expr)          \
  do {                                        \
    ::kvflow::Status kvflow_st_ = (expr);     \
    if (!kvflow_st_.ok()) return kvflow_st_;  \
  } while (0)

#define KVFLOW_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).value()

// KVFLOW_ASSIGN_OR_RETURN(auto x, MakeX());
#define KVFLOW_ASSIGN_OR_RETURN(lhs, expr) \
  KVFLOW_ASSIGN_OR_RETURN_IMPL_(KVFLOW_CONCAT_(kvflow_res_, __LINE__), lhs, expr)
