#pragma once
// Status / StatusOr: errors as values for anything caused by input (files, configs, flags).
// Broken internal invariants use KVSIM_CHECK instead (abort with file:line): a simulation that continues
// past a broken invariant produces plausible wrong numbers.

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

namespace kvsim {

enum class StatusCode { kOk = 0, kInvalidArgument, kNotFound, kDataLoss, kFailedPrecondition, kInternal };

class [[nodiscard]] Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string msg) {
    return Status(StatusCode::kInvalidArgument, std::move(msg));
  }
  static Status NotFound(std::string msg) { return Status(StatusCode::kNotFound, std::move(msg)); }
  static Status DataLoss(std::string msg) { return Status(StatusCode::kDataLoss, std::move(msg)); }
  static Status FailedPrecondition(std::string msg) {
    return Status(StatusCode::kFailedPrecondition, std::move(msg));
  }
  static Status Internal(std::string msg) { return Status(StatusCode::kInternal, std::move(msg)); }
  // A status of any code (e.g. one passed between processes); kOk ignores the message.
  static Status FromCode(StatusCode code, std::string msg) {
    return code == StatusCode::kOk ? Status() : Status(code, std::move(msg));
  }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // Prefixes context, e.g. the file name: "trace.h5: " + message.
  Status WithContext(const std::string& context) const {
    if (ok()) return *this;
    return Status(code_, context + ": " + message_);
  }

 private:
  Status(StatusCode code, std::string msg) : code_(code), message_(std::move(msg)) {}
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// A value from an input file, made fit for a one-line message: control characters as \xNN, at most 80
// bytes (then "...").
inline std::string ForMessage(const std::string& v) {
  std::string out;
  for (unsigned char c : v) {
    if (out.size() >= 80) return out + "...";
    if (c < 0x20 || c == 0x7f) {
      const char* hex = "0123456789abcdef";
      out += std::string("\\x") + hex[c >> 4] + hex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    if (status_.ok()) status_ = Status::Internal("StatusOr constructed from OK status without a value");
  }
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() { return *value_; }
  const T& operator*() const { return *value_; }

 private:
  Status status_;
  std::optional<T> value_;
};

[[noreturn]] inline void CheckFailed(const char* file, int line, const char* expr, const std::string& msg) {
  std::fprintf(stderr, "kvsim: internal invariant broken at %s:%d: %s %s\n", file, line, expr, msg.c_str());
  std::abort();
}

}  // namespace kvsim

#define KVSIM_CHECK(cond)                                                        \
  do {                                                                           \
    if (!(cond)) ::kvsim::CheckFailed(__FILE__, __LINE__, #cond, std::string()); \
  } while (0)
#define KVSIM_CHECK_MSG(cond, msg)                                       \
  do {                                                                   \
    if (!(cond)) ::kvsim::CheckFailed(__FILE__, __LINE__, #cond, (msg)); \
  } while (0)

#define KVSIM_RETURN_IF_ERROR(expr) \
  do {                              \
    ::kvsim::Status _st = (expr);   \
    if (!_st.ok()) return _st;      \
  } while (0)

#define KVSIM_CONCAT_INNER(a, b) a##b
#define KVSIM_CONCAT(a, b) KVSIM_CONCAT_INNER(a, b)
#define KVSIM_ASSIGN_OR_RETURN(lhs, expr) KVSIM_ASSIGN_OR_RETURN_IMPL(KVSIM_CONCAT(_so_, __LINE__), lhs, expr)
#define KVSIM_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()
