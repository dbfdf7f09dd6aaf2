// AgreeOnStatus: every rank contributes its status through one AllGather and every rank
// derives the same verdict from the same gathered bytes.
#include <cstdint>
#include <string>
#include <vector>

#include "core/byte_io.h"
#include "tessera/comm.h"

namespace tessera {
namespace {

// Wire form of a status: empty for OK; otherwise the code (uint32), the message, and whether a
// detail follows (uint8), then its fields. Both ends are the same build (one job), so the form
// needs no version.
Bytes EncodeStatus(const Status& status) {
  Bytes out;
  if (status.ok()) return out;
  ByteWriter w(&out);
  w.Put<uint32_t>(static_cast<uint32_t>(status.code()));
  w.PutString(status.message());
  const StatusDetail* detail = status.detail();
  w.Put<uint8_t>(detail ? 1 : 0);
  if (!detail) return out;
  w.Put<uint8_t>(static_cast<uint8_t>(detail->kind));
  for (const std::vector<std::string>* list : {&detail->keys, &detail->options}) {
    w.Put<uint32_t>(static_cast<uint32_t>(list->size()));
    for (const std::string& item : *list) w.PutString(item);
  }
  w.PutString(detail->advice);
  w.PutString(detail->file);
  w.Put<int64_t>(detail->offset);
  return out;
}

Status DecodeDetail(ByteReader& r, StatusDetail* detail) {
  uint8_t kind = 0;
  TESSERA_RETURN_IF_ERROR(r.Get(&kind));
  if (kind > static_cast<uint8_t>(StatusDetail::Kind::kBadOption)) {
    return InvalidArgument("detail of unknown kind " + std::to_string(kind));
  }
  detail->kind = static_cast<StatusDetail::Kind>(kind);
  for (std::vector<std::string>* list : {&detail->keys, &detail->options}) {
    uint32_t n = 0;
    TESSERA_RETURN_IF_ERROR(r.Get(&n));
    for (uint32_t i = 0; i < n; ++i) {
      std::string item;
      TESSERA_RETURN_IF_ERROR(r.GetString(&item));
      list->push_back(std::move(item));
    }
  }
  TESSERA_RETURN_IF_ERROR(r.GetString(&detail->advice));
  TESSERA_RETURN_IF_ERROR(r.GetString(&detail->file));
  return r.Get(&detail->offset);
}

Status DecodeStatus(const Bytes& in) {
  if (in.empty()) return Status::Ok();
  ByteReader r(in);
  uint32_t code = 0;
  std::string message;
  uint8_t has_detail = 0;
  Status read = r.Get(&code);
  if (read.ok()) read = r.GetString(&message);
  if (read.ok()) read = r.Get(&has_detail);
  StatusDetail detail;
  if (read.ok() && has_detail) read = DecodeDetail(r, &detail);
  if (!read.ok()) return Internal("malformed status: " + read.message());
  if (code == 0 || code > static_cast<uint32_t>(StatusCode::kDeadlineExceeded)) {
    return Internal("status with unknown code " + std::to_string(code) + ": " + message);
  }
  Status status(static_cast<StatusCode>(code), std::move(message));
  return has_detail ? status.WithDetail(std::move(detail)) : status;
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
  Status agreed(first.code(), "rank " + std::to_string(first_failed) + ": " + first.message() +
                                  " (" + std::to_string(num_failed) + " of " +
                                  std::to_string(all.size()) + " ranks failed)");
  return first.detail() ? agreed.WithDetail(*first.detail()) : agreed;
}

}  // namespace tessera
