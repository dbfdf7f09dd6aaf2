// Messages between ranks during a save or load carry the sender's status first, so a rank
// that failed still takes part in every collective and its error reaches the others.
#ifndef TESSERA_CHECKPOINT_ENVELOPE_H_
#define TESSERA_CHECKPOINT_ENVELOPE_H_

#include <span>

#include "tessera/bytes.h"
#include "tessera/status.h"

namespace tessera {

// OK status: [1][payload]. Error: [0][the status as PutStatus writes it, detail included].
Bytes Seal(const Status& status, Bytes payload = {});
// The payload, or the sealed error. `sender` (e.g. "rank 3") prefixes errors; empty: no
// prefix (a rank's own message to itself, in a one-rank run).
Result<std::span<const uint8_t>> Open(const Bytes& message, const std::string& sender);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_ENVELOPE_H_
