// Status and Result<T>: how every tessera call reports failure. The library throws no
// exceptions; every fallible call returns one of these, and each layer adds its context
// (the key, the box, the rank, the path, the errno text) to the message on the way up.
//
// Thread safety: values; safe to copy and move between threads.
#ifndef TESSERA_STATUS_H_
#define TESSERA_STATUS_H_

#include <cassert>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace tessera {

// Numbers are part of the CLI's and the Python bindings' contract: do not renumber.
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // the caller's input is wrong (shape, dtype, box, option)
  kNotFound = 2,         // a file, directory or key does not exist
  kAlreadyExists = 3,
  kFailedPrecondition = 4,  // e.g. a directory with no committed checkpoint
  kOutOfRange = 5,          // a box or offset outside its bounds
  kDataLoss = 6,            // checksum mismatch, truncated file, corrupt manifest
  kIOError = 7,             // the operating system refused an operation
  kUnimplemented = 8,       // e.g. a manifest of a newer format version
  kInternal = 9,
  kAborted = 10,           // another rank failed; this collective gave up
  kDeadlineExceeded = 11,  // a collective timed out
};

std::string_view StatusCodeName(StatusCode code);

// Typed facts of a failure beside its message, for callers that act on them (the Python layer
// raises and advises from these fields, never from the text). Arrow's StatusDetail is the
// model. Travels with the status: through WithContext, and between ranks (AgreeOnStatus).
struct StatusDetail {
  // Numbers are part of the Python bindings' contract: do not renumber.
  enum class Kind : uint8_t {
    kNone = 0,
    kMissingKeys = 1,     // keys asked for that the checkpoint lacks
    kUnexpectedKeys = 2,  // keys in the checkpoint that no rank asked for
    kShapeMismatch = 3,   // a tensor's shape differs from the checkpoint's
    kDTypeMismatch = 4,   // a tensor's dtype differs from the checkpoint's
    kNotCovered = 5,      // a tensor's chunks do not cover it
    kCorruption = 6,      // stored bytes are not what the index says (`file`, `offset`)
    kBadOption = 7,       // an option's value is not valid (`options`)
  };
  Kind kind = Kind::kNone;
  std::vector<std::string> keys;  // the keys concerned (at most the ones the message names)
  // The options the message names, as C++ spells them ("LoadOptions::num_io_threads",
  // "allow_shape_mismatch"); the first is the one that would change the outcome when `advice`
  // is set.
  std::vector<std::string> options;
  // The advice the message ends with, in parentheses, without them: e.g. "set
  // LoadOptions::missing_keys = kSkip to load the rest". Empty: none.
  std::string advice;
  std::string file;     // kCorruption: the file, as the message names it
  int64_t offset = -1;  // kCorruption: the byte offset in `file` (-1: unknown)
};

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message);

  static Status Ok() { return Status(); }

  bool ok() const { return state_ == nullptr; }
  StatusCode code() const { return state_ ? state_->code : StatusCode::kOk; }
  // Empty for OK.
  const std::string& message() const;
  // "OK" or "<CodeName>: <message>".
  std::string ToString() const;

  // Returns a copy whose message is "<context>: <message>" (the detail kept). OK stays OK.
  Status WithContext(std::string_view context) const;

  // The typed facts of the failure, or null when it has none (and for OK).
  const StatusDetail* detail() const { return state_ ? state_->detail.get() : nullptr; }
  // A copy that carries `detail`. OK stays OK.
  Status WithDetail(StatusDetail detail) const;

  // Explicitly ignores this status (for best-effort cleanup paths).
  void IgnoreError() const {}

 private:
  struct State {
    StatusCode code;
    std::string message;
    std::shared_ptr<const StatusDetail> detail;  // null: none
  };
  // Null when OK, so an OK status costs one pointer and no allocation.
  std::shared_ptr<const State> state_;
};

Status InvalidArgument(std::string message);
Status NotFound(std::string message);
Status AlreadyExists(std::string message);
Status FailedPrecondition(std::string message);
Status OutOfRange(std::string message);
Status DataLoss(std::string message);
Status IOError(std::string message);
// IOError with ": <strerror(errno_value)>" appended.
Status IOErrorFromErrno(std::string message, int errno_value);
// The Status of a failed system call on a path: kNotFound for ENOENT, kAlreadyExists for EEXIST
// (an exclusive create), kIOError otherwise; ": <strerror(errno_value)>" appended. What every
// Storage returns, so that callers branch on the code, never on the text.
Status StatusFromErrno(std::string message, int errno_value);
Status Unimplemented(std::string message);
Status Internal(std::string message);
Status Aborted(std::string message);
// kInvalidArgument "<option> <problem>" with a kBadOption detail naming `option` as C++ spells
// it ("SaveOptions::num_io_threads must be at least 1, got 0").
Status BadOption(std::string option, std::string_view problem);
Status DeadlineExceeded(std::string message);

// Either a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT(runtime/explicit)
  // `status` must not be OK.
  Result(Status status) : status_(std::move(status)) {  // NOLINT(runtime/explicit)
    assert(!status_.ok());
    if (status_.ok()) status_ = Status(StatusCode::kInternal, "Result built from an OK status");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const& { return status_; }
  // By value on a temporary, so `TESSERA_RETURN_IF_ERROR(Save(...).status())` never refers
  // to a destroyed Result.
  Status status() && { return std::move(status_); }

  // Requires ok().
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }
  T&& operator*() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }

  T value_or(T fallback) const& { return ok() ? *value_ : std::move(fallback); }

 private:
  std::optional<T> value_;
  Status status_;  // OK iff value_ holds a value
};

namespace internal {
inline const Status& GetStatus(const Status& s) { return s; }
template <typename T>
const Status& GetStatus(const Result<T>& r) {
  return r.status();
}
}  // namespace internal

}  // namespace tessera

#define TESSERA_CONCAT_IMPL(a, b) a##b
#define TESSERA_CONCAT(a, b) TESSERA_CONCAT_IMPL(a, b)

// Returns from the enclosing function if `expr` (a Status or a Result) is not OK.
#define TESSERA_RETURN_IF_ERROR(expr)                             \
  do {                                                            \
    const auto& _tessera_status_or = (expr);                      \
    if (!::tessera::internal::GetStatus(_tessera_status_or).ok()) \
      return ::tessera::internal::GetStatus(_tessera_status_or);  \
  } while (0)

// Like TESSERA_RETURN_IF_ERROR, but prefixes the message with `context`.
#define TESSERA_RETURN_IF_ERROR_CTX(expr, context)                                    \
  do {                                                                                \
    const auto& _tessera_status_or = (expr);                                          \
    if (!::tessera::internal::GetStatus(_tessera_status_or).ok())                     \
      return ::tessera::internal::GetStatus(_tessera_status_or).WithContext(context); \
  } while (0)

#define TESSERA_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).value()

// `lhs = value of expr`, or returns the error. `lhs` may declare a variable:
//   TESSERA_ASSIGN_OR_RETURN(auto file, storage.NewReadableFile(path));
#define TESSERA_ASSIGN_OR_RETURN(lhs, expr) \
  TESSERA_ASSIGN_OR_RETURN_IMPL(TESSERA_CONCAT(_tessera_result_, __LINE__), lhs, expr)

#endif  // TESSERA_STATUS_H_
