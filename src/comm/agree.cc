// AgreeOnStatus: every rank contributes its status through one AllGather and every rank
// derives the same verdict from the same gathered bytes.
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/comm.h"

namespace tessera {
namespace {

// Wire form of a status: empty for OK; otherwise the code as 4 little-endian bytes followed
// by the message.
Bytes EncodeStatus(const Status& status) {
  Bytes out;
  if (status.ok()) return out;
  const auto code = static_cast<uint32_t>(status.code());
  const std::string& message = status.message();
  out.reserve(4 + message.size());
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(code >> (8 * i)));
  out.insert(out.end(), message.begin(), message.end());
  return out;
}

Status DecodeStatus(const Bytes& in) {
  if (in.empty()) return Status::Ok();
  if (in.size() < 4) {
    return Internal("malformed status of " + std::to_string(in.size()) + " bytes");
  }
  uint32_t code = 0;
  for (int i = 0; i < 4; ++i) code |= static_cast<uint32_t>(in[i]) << (8 * i);
  std::string message(in.begin() + 4, in.end());
  if (code == 0 || code > static_cast<uint32_t>(StatusCode::kDeadlineExceeded)) {
    return Internal("status with unknown code " + std::to_string(code) + ": " + message);
  }
  return Status(static_cast<StatusCode>(code), std::move(message));
}

}  // namespace

Status AgreeOnStatus(Comm& comm, const Status& local) {
  std::vector<Bytes> all;
  TESSERA_RETURN_IF_ERROR(comm.AllGather(EncodeStatus(local), &all));
  int first_failed = -1;
  int num_failed = 0;
  Status first;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    Status status = DecodeStatus(all[r]);
    if (status.ok()) continue;
    if (num_failed++ == 0) {
      first_failed = r;
      first = std::move(status);
    }
  }
  if (num_failed == 0) return Status::Ok();
  // Alone, the rank's own error says everything: no "rank 0: ... (1 of 1 ranks failed)".
  if (all.size() == 1) return first;
  return Status(first.code(), "rank " + std::to_string(first_failed) + ": " + first.message() +
                                  " (" + std::to_string(num_failed) + " of " +
                                  std::to_string(all.size()) + " ranks failed)");
}

}  // namespace tessera
