// The one writer of the JSON documents the commands print (--json, and the benchmarks).
//
// JSON text is UTF-8; what a checkpoint holds (keys, file names, metadata) and what a user
// passes (paths, prefixes) may not be. PrintJson never fails on such text (issue 22; it once
// aborted inside the JSON library after the work was done): every string of the document that
// is not valid UTF-8, an object's key or a value, is printed with each byte that is not part of
// a well-formed UTF-8 sequence replaced by U+FFFD, and the document, an object, gains a member
//
//   "non_utf8": [{"pointer": "/checkpoints/0/path", "bytes": "runs/ckpt-\\xff"}, ...]
//
// listing each string so replaced: where it is, as a JSON Pointer (RFC 6901) into the document
// as printed ("key": true when it is the key of the member the pointer names), and its exact
// bytes, escaped as the tables escape them (core/utf8.h QuoteBytes, without the quotes:
// printable ASCII but '"' and '\' as it is, every other byte \xNN, so "\xff" is one byte
// 0xFF and a backslash is "\x5c"). Absent when every string is UTF-8. Documented in
// docs/RELIABILITY.md, section 8.
#ifndef TESSERA_TOOLS_JSON_OUTPUT_H_
#define TESSERA_TOOLS_JSON_OUTPUT_H_

#include <nlohmann/json.hpp>

namespace tessera::tools {

// Prints `doc` to stdout, indented by 2, then a newline.
void PrintJson(nlohmann::json doc);

// What PrintJson prints (without the newline).
std::string JsonText(nlohmann::json doc);

}  // namespace tessera::tools

#endif  // TESSERA_TOOLS_JSON_OUTPUT_H_
