// Tilings: checking that boxes are disjoint, inside a shape and (optionally) cover it. Used
// where a plan is built (save) and where a manifest is read (every reader checks what it is
// given before trusting it).
#ifndef TESSERA_CORE_TILING_H_
#define TESSERA_CORE_TILING_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "tessera/box.h"
#include "tessera/metadata.h"

namespace tessera {

// Checks that the boxes are disjoint, inside `shape`, and (when `require_coverage`) cover it
// exactly. O(n log n) for the tilings checkpoints use (see tiling.cc). On failure returns
// the offending pair (indices into `boxes`) or -1s, with the message.
struct BoxCheckFailure {
  std::string message;
  int64_t first = -1;
  int64_t second = -1;
  // The advice `message` ends with in parentheses, without them ("mark the tensor partial if
  // that is intended"), or "".
  std::string advice;
  // `message` without the advice: for a reader of a saved index, where the advice to the saver
  // does not apply (the index is wrong, whatever the saver meant).
  std::string problem() const;
};
std::optional<BoxCheckFailure> CheckTiling(std::span<const Box> boxes, const Shape& shape,
                                           bool require_coverage);
// The same over the boxes of saved chunks.
std::optional<BoxCheckFailure> CheckTiling(std::span<const ChunkInfo> chunks, const Shape& shape,
                                           bool require_coverage);

}  // namespace tessera

#endif  // TESSERA_CORE_TILING_H_
