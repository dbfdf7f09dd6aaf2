#include "tessera/status.h"

#include <cerrno>
#include <cstring>

namespace tessera {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kNotFound:
      return "NotFound";
    case StatusCode::kAlreadyExists:
      return "AlreadyExists";
    case StatusCode::kFailedPrecondition:
      return "FailedPrecondition";
    case StatusCode::kOutOfRange:
      return "OutOfRange";
    case StatusCode::kDataLoss:
      return "DataLoss";
    case StatusCode::kIOError:
      return "IOError";
    case StatusCode::kUnimplemented:
      return "Unimplemented";
    case StatusCode::kInternal:
      return "Internal";
    case StatusCode::kAborted:
      return "Aborted";
    case StatusCode::kDeadlineExceeded:
      return "DeadlineExceeded";
  }
  return "Unknown";
}

Status::Status(StatusCode code, std::string message) {
  if (code != StatusCode::kOk) {
    state_ = std::make_shared<const State>(State{code, std::move(message), nullptr});
  }
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return state_ ? state_->message : kEmpty;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out(StatusCodeName(code()));
  out += ": ";
  out += message();
  return out;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  std::string message(context);
  message += ": ";
  message += state_->message;
  Status out;
  out.state_ = std::make_shared<const State>(State{code(), std::move(message), state_->detail});
  return out;
}

Status Status::WithDetail(StatusDetail detail) const {
  if (ok()) return *this;
  Status out;
  out.state_ = std::make_shared<const State>(
      State{code(), state_->message, std::make_shared<const StatusDetail>(std::move(detail))});
  return out;
}

Status BadOption(std::string option, std::string_view problem) {
  std::string message = option;
  message += ' ';
  message += problem;
  StatusDetail detail;
  detail.kind = StatusDetail::Kind::kBadOption;
  detail.options.push_back(std::move(option));
  return InvalidArgument(std::move(message)).WithDetail(std::move(detail));
}

Status InvalidArgument(std::string m) { return Status(StatusCode::kInvalidArgument, std::move(m)); }
Status NotFound(std::string m) { return Status(StatusCode::kNotFound, std::move(m)); }
Status AlreadyExists(std::string m) { return Status(StatusCode::kAlreadyExists, std::move(m)); }
Status FailedPrecondition(std::string m) {
  return Status(StatusCode::kFailedPrecondition, std::move(m));
}
Status OutOfRange(std::string m) { return Status(StatusCode::kOutOfRange, std::move(m)); }
Status DataLoss(std::string m) { return Status(StatusCode::kDataLoss, std::move(m)); }
Status IOError(std::string m) { return Status(StatusCode::kIOError, std::move(m)); }
Status IOErrorFromErrno(std::string m, int errno_value) {
  m += ": ";
  m += std::strerror(errno_value);
  return Status(StatusCode::kIOError, std::move(m));
}
Status StatusFromErrno(std::string m, int errno_value) {
  const StatusCode code = errno_value == ENOENT   ? StatusCode::kNotFound
                          : errno_value == EEXIST ? StatusCode::kAlreadyExists
                                                  : StatusCode::kIOError;
  m += ": ";
  m += std::strerror(errno_value);
  return Status(code, std::move(m));
}
Status Unimplemented(std::string m) { return Status(StatusCode::kUnimplemented, std::move(m)); }
Status Internal(std::string m) { return Status(StatusCode::kInternal, std::move(m)); }
Status Aborted(std::string m) { return Status(StatusCode::kAborted, std::move(m)); }
Status DeadlineExceeded(std::string m) {
  return Status(StatusCode::kDeadlineExceeded, std::move(m));
}

}  // namespace tessera
