// The one wire form of a Status between the ranks of a job (AgreeOnStatus, the envelopes of
// save and load messages, a save's outcome): its code, its message and its detail, so that a
// rank's typed error reaches every rank whole. Both ends are the same build: no version.
#ifndef TESSERA_CORE_STATUS_WIRE_H_
#define TESSERA_CORE_STATUS_WIRE_H_

#include "core/byte_io.h"
#include "tessera/bytes.h"
#include "tessera/status.h"

namespace tessera {

// Appends `status` (OK included): code (u32), message (u32 length, bytes), whether a detail
// follows (u8), then its kind (u8), keys and options (u32 count, strings), advice, file and
// offset (i64).
void PutStatus(ByteWriter& w, const Status& status);
// Reads what PutStatus wrote into *status. Errors: the reader's (a truncated message), or
// kInvalidArgument naming an unknown code or detail kind.
Status GetStatus(ByteReader& r, Status* status);

// A status alone as bytes (what PutStatus appends), and back: DecodeStatus fails
// (kInvalidArgument) unless `bytes` hold exactly one status.
Bytes EncodeStatus(const Status& status);
Status DecodeStatus(std::span<const uint8_t> bytes, Status* status);

}  // namespace tessera

#endif  // TESSERA_CORE_STATUS_WIRE_H_
