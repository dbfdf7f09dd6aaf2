// Text checks shared by the layers: keys and user metadata are UTF-8 (docs/FORMAT.md).
#ifndef TESSERA_CORE_UTF8_H_
#define TESSERA_CORE_UTF8_H_

#include <string>
#include <string_view>

#include "tessera/metadata.h"
#include "tessera/status.h"

namespace tessera {

// True when `s` is well-formed UTF-8 (no overlong forms, no surrogates, <= U+10FFFF): what a
// strict JSON reader or Python's str accepts.
bool IsValidUtf8(std::string_view s);

// `s` in double quotes for an error message or a terminal: printable ASCII as it is, '"' and
// '\' and every other byte as \xNN, so that any bytes (a key that is not UTF-8, control
// characters) print as one unambiguous line.
std::string QuoteBytes(std::string_view s);

// `s` with every byte that is not part of a well-formed UTF-8 sequence (IsValidUtf8's rules)
// replaced by U+FFFD: valid UTF-8, readable, not reversible (QuoteBytes is).
std::string ReplaceInvalidUtf8(std::string_view s);

// `s` for a one-line message (an error, an exception's text): UTF-8 text as it is, except that
// control characters (U+0000..U+001F, U+007F, and U+0080..U+009F, which terminals also obey)
// and bytes that are not part of well-formed UTF-8 become \xNN, byte by byte, as QuoteBytes
// writes them. A hostile key's escape sequences ("\x1b]0;...", "\x1b[2J") never reach a
// terminal raw. Idempotent.
std::string EscapeControlCharacters(std::string_view s);

// OK when every string of `metadata` (user metadata keys and values, tensor and object keys,
// file names) is valid UTF-8; else kDataLoss "<source>: <what> "<escaped>" is not valid
// UTF-8 ...". tessera writes UTF-8 only; a manifest holding other bytes is corrupt or foreign,
// and readers that must hand out text (JSON, Python str) refuse it with this error.
Status CheckMetadataIsUtf8(const Metadata& metadata, std::string_view source);

}  // namespace tessera

#endif  // TESSERA_CORE_UTF8_H_
