#include "core/status_wire.h"

#include <string>
#include <utility>
#include <vector>

namespace tessera {
namespace {

void PutDetail(ByteWriter& w, const StatusDetail& detail) {
  w.Put<uint8_t>(static_cast<uint8_t>(detail.kind));
  for (const std::vector<std::string>* list : {&detail.keys, &detail.options}) {
    w.Put<uint32_t>(static_cast<uint32_t>(list->size()));
    for (const std::string& item : *list) w.PutString(item);
  }
  w.PutString(detail.advice);
  w.PutString(detail.file);
  w.Put<int64_t>(detail.offset);
}

Status GetDetail(ByteReader& r, StatusDetail* detail) {
  uint8_t kind = 0;
  TESSERA_RETURN_IF_ERROR(r.Get(&kind));
  if (kind > static_cast<uint8_t>(StatusDetail::Kind::kBadOption)) {
    return InvalidArgument("status detail of unknown kind " + std::to_string(kind));
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

}  // namespace

void PutStatus(ByteWriter& w, const Status& status) {
  w.Put<uint32_t>(static_cast<uint32_t>(status.code()));
  w.PutString(status.message());
  const StatusDetail* detail = status.detail();
  w.Put<uint8_t>(detail ? 1 : 0);
  if (detail) PutDetail(w, *detail);
}

Status GetStatus(ByteReader& r, Status* status) {
  uint32_t code = 0;
  std::string message;
  uint8_t has_detail = 0;
  TESSERA_RETURN_IF_ERROR(r.Get(&code));
  TESSERA_RETURN_IF_ERROR(r.GetString(&message));
  TESSERA_RETURN_IF_ERROR(r.Get(&has_detail));
  StatusDetail detail;
  if (has_detail) TESSERA_RETURN_IF_ERROR(GetDetail(r, &detail));
  if (code > static_cast<uint32_t>(StatusCode::kDeadlineExceeded)) {
    return InvalidArgument("status with unknown code " + std::to_string(code) + ": " + message);
  }
  *status = Status(static_cast<StatusCode>(code), std::move(message));
  if (has_detail) *status = status->WithDetail(std::move(detail));
  return Status::Ok();
}

Bytes EncodeStatus(const Status& status) {
  Bytes out;
  ByteWriter w(&out);
  PutStatus(w, status);
  return out;
}

Status DecodeStatus(std::span<const uint8_t> bytes, Status* status) {
  ByteReader r(bytes);
  TESSERA_RETURN_IF_ERROR(GetStatus(r, status));
  if (r.position() != bytes.size()) {
    return InvalidArgument("status followed by " + std::to_string(bytes.size() - r.position()) +
                           " more bytes");
  }
  return Status::Ok();
}

}  // namespace tessera
