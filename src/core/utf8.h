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

// OK when every string of `metadata` (user metadata keys and values, tensor and object keys,
// file names) is valid UTF-8; else kDataLoss "<source>: <what> "<escaped>" is not valid
// UTF-8 ...". tessera writes UTF-8 only; a manifest holding other bytes is corrupt or foreign,
// and readers that must hand out text (JSON, Python str) refuse it with this error.
Status CheckMetadataIsUtf8(const Metadata& metadata, std::string_view source);

}  // namespace tessera

#endif  // TESSERA_CORE_UTF8_H_
