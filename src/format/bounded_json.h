// JSON that tessera did not write (a Hugging Face index, a Megatron metadata.json, the
// structure record of a manifest), parsed with a bound on nesting: nlohmann's parser is
// iterative, but what consumes a value (json::dump, a recursive walk) recurses once per level,
// so a small file nested 100,000 deep would overflow the stack of every reader.
#ifndef TESSERA_FORMAT_BOUNDED_JSON_H_
#define TESSERA_FORMAT_BOUNDED_JSON_H_

#include <string_view>

#include <nlohmann/json.hpp>

#include "tessera/status.h"

namespace tessera {

// Deeper than anything tessera reads in practice (an index is flat; Python's json module gives
// up near 1000 levels with its default recursion limit), and shallow enough that a recursive
// consumer uses a few hundred KiB of stack at most.
inline constexpr int kMaxJsonDepth = 1000;

// Parses `text` as one JSON document. Errors (kDataLoss, "<source>: ..."): text that is not
// JSON, and an object or array inside kMaxJsonDepth others ("JSON nested more than 1000 levels
// deep"), refused before any value that deep is built.
Result<nlohmann::json> ParseBoundedJson(std::string_view text, std::string_view source);

}  // namespace tessera

#endif  // TESSERA_FORMAT_BOUNDED_JSON_H_
