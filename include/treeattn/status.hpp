// Errors as values at the library boundary.
//
// Every fallible treeattn function returns a Status (or a Result<T>). A Status carries a code
// that callers can branch on and a message written for a human: it names the offending value,
// what was expected and, in distributed code, the rank(s) involved.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace treeattn {

enum class Code {
  kOk = 0,
  kInvalidArgument,  // a caller-supplied value is out of range or inconsistent
  kUnsupported,      // a valid request this build cannot serve (head dim, dtype, ISA)
  kMismatch,         // ranks disagree on a shape, dtype or plan
  kTimeout,          // a peer did not arrive within the configured time
  kNumerics,         // an opt-in check found NaN/Inf in an input
  kInternal,         // a backend call failed
  kOutOfMemory,      // a requested allocation would not fit
};

const char* code_name(Code c) noexcept;

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok() { return {}; }

  bool is_ok() const noexcept { return code_ == Code::kOk; }
  explicit operator bool() const noexcept { return is_ok(); }
  Code code() const noexcept { return code_; }
  const std::string& message() const noexcept { return message_; }
  // "invalid argument: head_dim 59 is not supported (supported: 64, 80, 96, 128, 256)"
  std::string to_string() const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string m) { return {Code::kInvalidArgument, std::move(m)}; }
inline Status unsupported(std::string m) { return {Code::kUnsupported, std::move(m)}; }
inline Status internal_error(std::string m) { return {Code::kInternal, std::move(m)}; }

// A value or the Status that explains why there is none.
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}         // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {}  // NOLINT(google-explicit-constructor)
  bool is_ok() const noexcept { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOkStatus;
    return is_ok() ? kOkStatus : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace treeattn

#define TREEATTN_RETURN_IF_ERROR(expr)            \
  do {                                            \
    ::treeattn::Status treeattn_status_ = (expr); \
    if (!treeattn_status_.is_ok()) return treeattn_status_; \
  } while (0)
