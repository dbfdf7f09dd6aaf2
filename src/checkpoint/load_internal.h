// Load's two halves, for front doors that read one checkpoint many times (Convert loads it
// unit by unit): the index is read once, then every load plans and reads against it.
#ifndef TESSERA_CHECKPOINT_LOAD_INTERNAL_H_
#define TESSERA_CHECKPOINT_LOAD_INTERNAL_H_

#include <string>

#include "format/checkpoint_index.h"
#include "tessera/checkpoint.h"

namespace tessera {

// Rank 0 reads the index of the checkpoint at `path` (any format ReadCheckpointIndex
// detects) and broadcasts it; every rank returns it, or the same error. COLLECTIVE.
Result<CheckpointIndex> ReadAndShareIndex(Comm& comm, Storage& storage, const std::string& path);

// Everything Load does once it has the index: plan, agree, read. COLLECTIVE over `comm`.
// `path` names the checkpoint in messages. With `list_unexpected` false, the report's
// unexpected_keys stay empty and options.unexpected_keys must be kSkip (a caller that loads a
// checkpoint in many small pieces does not pay for listing every other key each time).
Result<LoadReport> LoadFromIndex(StateDict& state, const CheckpointIndex& index,
                                 const std::string& path, Comm& comm, Storage& storage,
                                 const LoadOptions& options, bool list_unexpected = true);

}  // namespace tessera

#endif  // TESSERA_CHECKPOINT_LOAD_INTERNAL_H_
