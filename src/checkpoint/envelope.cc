#include "checkpoint/envelope.h"

#include "core/byte_io.h"

namespace tessera {

Bytes Seal(const Status& status, Bytes payload) {
  if (status.ok()) {
    payload.insert(payload.begin(), uint8_t{1});
    return payload;
  }
  Bytes out;
  ByteWriter w(&out);
  w.Put<uint8_t>(0);
  w.Put<uint32_t>(static_cast<uint32_t>(status.code()));
  w.PutString(status.message());
  return out;
}

Result<std::span<const uint8_t>> Open(const Bytes& message, const std::string& sender) {
  const std::string who = sender.empty() ? "this rank" : sender;
  if (message.empty()) return Internal(who + " sent an empty message");
  if (message[0] == 1) return std::span<const uint8_t>(message).subspan(1);
  ByteReader r(std::span<const uint8_t>(message).subspan(1));
  uint32_t code = 0;
  std::string text;
  if (!r.Get(&code).ok() || !r.GetString(&text).ok() || code == 0 ||
      code > static_cast<uint32_t>(StatusCode::kDeadlineExceeded)) {
    return Internal(who + " sent a malformed error message");
  }
  Status status(static_cast<StatusCode>(code), text);
  return sender.empty() ? status : status.WithContext(sender);
}

}  // namespace tessera
