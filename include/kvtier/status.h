// Status and Result<T>: kvtier's single error model.
//
// Every fallible call returns a Status (a code plus a message naming what was
// wrong) or a Result<T> holding either a value or a non-OK Status. No exception
// crosses the public API or a oneTBB task; callers must look at the result
// ([[nodiscard]]).
#pragma once

#include <cassert>
#include <new>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>

namespace kvtier {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,     ///< caller passed something malformed (shape, size, flag)
  kNotFound,            ///< sequence / chunk / file does not exist
  kAlreadyExists,       ///< object exists and may not be created again
  kFailedPrecondition,  ///< object is in the wrong state (dropped, closed)
  kResourceExhausted,   ///< a tier is full and nothing can be demoted
  kCorruption,          ///< stored bytes failed a checksum or format check
  kIOError,             ///< the disk tier or file system failed
  kTimedOut,            ///< a wait ran out; the operation itself continues
  kUnavailable,         ///< a backend (e.g. CUDA) is not present
  kInternal,            ///< a kvtier bug: an invariant did not hold
  kPermissionDenied,    ///< a backend refused the credentials (e.g. Redis AUTH); retrying will not help
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

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
inline Status PermissionDenied(std::string m) { return {StatusCode::kPermissionDenied, std::move(m)}; }

/// Prints "kvtier: Result::value() called on an error: <status>" on stderr and aborts, in
/// every build type: reading the value of an error Result is a caller bug that must not turn
/// into a read of an empty optional in Release.
[[noreturn]] void DieOnErrorValue(const Status& status);

/// Either a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT
    assert(!status_.ok() && "Result built from an OK Status carries no value");
    if (status_.ok()) status_ = Internal("Result built from an OK Status");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  /// The value; on an error Result prints the status and aborts (DieOnErrorValue).
  T& value() & {
    CheckValue();
    return *value_;
  }
  const T& value() const& {
    CheckValue();
    return *value_;
  }
  T&& value() && {
    CheckValue();
    return std::move(*value_);
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  void CheckValue() const {
    if (!value_.has_value()) [[unlikely]]
      DieOnErrorValue(status_);
  }
  std::optional<T> value_;
  Status status_;
};

/// Runs `body` (returning a Status or a Result<T>) and turns a std::bad_alloc escaping it into
/// ResourceExhausted("<what>: out of memory"). For public entry points whose allocations grow
/// with the caller's input (sizes, counts, file contents), so that no exception crosses the
/// API. `what` names what was being allocated: a string, or a callable returning one (built
/// only on failure, so it may format sizes). Only bad_alloc is caught.
template <typename W, typename F>
auto ReturnOnBadAlloc(W&& what, F&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    std::string w;
    if constexpr (std::is_invocable_v<W&>)
      w = what();
    else
      w = what;
    return ResourceExhausted(w + ": out of memory");
  }
}

}  // namespace kvtier

/// Returns early with the status when it is not OK.
#define KVTIER_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::kvtier::Status kvtier_status_ = (expr);        \
    if (!kvtier_status_.ok()) return kvtier_status_; \
  } while (0)

#define KVTIER_CONCAT_INNER(a, b) a##b
#define KVTIER_CONCAT(a, b) KVTIER_CONCAT_INNER(a, b)
/// `KVTIER_ASSIGN_OR_RETURN(auto x, MakeX());`
#define KVTIER_ASSIGN_OR_RETURN(lhs, expr)                   \
  auto KVTIER_CONCAT(kvtier_result_, __LINE__) = (expr);     \
  if (!KVTIER_CONCAT(kvtier_result_, __LINE__).ok())         \
    return KVTIER_CONCAT(kvtier_result_, __LINE__).status(); \
  lhs = std::move(KVTIER_CONCAT(kvtier_result_, __LINE__)).value()
