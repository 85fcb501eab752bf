// Status and Result<T>: kvtier's single error model.
//
// Every fallible call returns a Status (a code plus a message naming what was
// wrong) or a Result<T> holding either a value or a non-OK Status. No exception
// crosses the public API or a oneTBB task; callers must look at the result
// ([[nodiscard]]).
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace kvtier {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,    ///< caller passed something malformed (shape, size, flag)
  kNotFound,           ///< sequence / chunk / file does not exist
  kAlreadyExists,      ///< object exists and may not be created again
  kFailedPrecondition, ///< object is in the wrong state (dropped, closed)
  kResourceExhausted,  ///< a tier is full and nothing can be demoted
  kCorruption,         ///< stored bytes failed a checksum or format check
  kIOError,            ///< the disk tier or file system failed
  kTimedOut,           ///< a wait ran out; the operation itself continues
  kUnavailable,        ///< a backend (e.g. CUDA) is not present
  kInternal,           ///< a kvtier bug: an invariant did not hold
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message)
      : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  /// "InvalidArgument: chunk_size must be > 0 (got 0)"
  std::string ToString() const;

  /// Marks a deliberately ignored status (for best-effort cleanup paths).
  void IgnoreError() const {}

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status AlreadyExists(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }
inline Status FailedPrecondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
inline Status ResourceExhausted(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
inline Status Corruption(std::string m) { return {StatusCode::kCorruption, std::move(m)}; }
inline Status IOError(std::string m) { return {StatusCode::kIOError, std::move(m)}; }
inline Status TimedOut(std::string m) { return {StatusCode::kTimedOut, std::move(m)}; }
inline Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

/// Either a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT
    assert(!status_.ok() && "Result built from an OK Status carries no value");
    if (status_.ok()) status_ = Internal("Result built from an OK Status");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { assert(ok()); return *value_; }
  const T& value() const& { assert(ok()); return *value_; }
  T&& value() && { assert(ok()); return std::move(*value_); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace kvtier

/// Returns early with the status when it is not OK.
#define KVTIER_RETURN_IF_ERROR(expr)                  \
  do {                                                \
    ::kvtier::Status kvtier_status_ = (expr);         \
    if (!kvtier_status_.ok()) return kvtier_status_;  \
  } while (0)

#define KVTIER_CONCAT_INNER(a, b) a##b
#define KVTIER_CONCAT(a, b) KVTIER_CONCAT_INNER(a, b)
/// `KVTIER_ASSIGN_OR_RETURN(auto x, MakeX());`
#define KVTIER_ASSIGN_OR_RETURN(lhs, expr)                              \
  auto KVTIER_CONCAT(kvtier_result_, __LINE__) = (expr);                \
  if (!KVTIER_CONCAT(kvtier_result_, __LINE__).ok())                    \
    return KVTIER_CONCAT(kvtier_result_, __LINE__).status();            \
  lhs = std::move(KVTIER_CONCAT(kvtier_result_, __LINE__)).value()
