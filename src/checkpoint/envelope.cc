#include "checkpoint/envelope.h"

#include "core/status_wire.h"

namespace tessera {

Bytes Seal(const Status& status, Bytes payload) {
  if (status.ok()) {
    payload.insert(payload.begin(), uint8_t{1});
    return payload;
  }
  Bytes out;
  ByteWriter w(&out);
  w.Put<uint8_t>(0);
  PutStatus(w, status);
  return out;
}

Result<std::span<const uint8_t>> Open(const Bytes& message, const std::string& sender) {
  const std::string who = sender.empty() ? "this rank" : sender;
  if (message.empty()) return Internal(who + " sent an empty message");
  if (message[0] == 1) return std::span<const uint8_t>(message).subspan(1);
  ByteReader r(std::span<const uint8_t>(message).subspan(1));
  Status status;
  if (!GetStatus(r, &status).ok() || status.ok()) {
    return Internal(who + " sent a malformed error message");
  }
  return sender.empty() ? status : status.WithContext(sender);
}

}  // namespace tessera
